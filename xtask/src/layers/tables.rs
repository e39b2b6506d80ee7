//! The tables the check holds the sources to: each crate's modules by layer (lowest first),
//! the pure modules, the workspace's crates in order.
use super::{Crate, Layers};

/// The agent's layers, lowest first (see `docs/architecture.md`).
pub const AGENT_LAYERS: Layers = &[
    (
        "base: durations, statistics, limits, locks, durable files, exit codes, metric families",
        &[
            "duration", "stats", "limits", "locks", "durable", "exit", "families",
        ],
    ),
    (
        "cilium: Cilium's own rules per release (maps, drop reasons, device selection and hooks)",
        &["cilium"],
    ),
    (
        "wire: what agent, witness and stepper send each other; agent URLs and the HTTP client",
        &["wire", "client"],
    ),
    ("config", &["config"]),
    (
        "kernel: syscalls only (sockets, epoll, bpf, netlink, clocks)",
        &["kernel"],
    ),
    (
        "probes: one file per kind, their registry and the engine",
        &["probe"],
    ),
    (
        "timeline: recording probe outcomes, rings, gaps, seeding (agent and witness)",
        &["timeline"],
    ),
    (
        "checks and their evidence",
        &["ciliumapi", "ciliumconfig", "checks", "node", "report"],
    ),
    (
        "step: params, state, baseline, observation rules, verdict",
        &["step"],
    ),
    (
        "serving: auth, limits, health and metrics",
        &["serving", "metrics"],
    ),
    (
        "the agent, the witness, the stepper and the command-line hooks",
        &["daemon", "witness", "rollout", "hooks"],
    ),
];

/// The kernel crate's layers, lowest first (see `docs/architecture.md`). `lib` is the crate
/// root's own helpers (`clock` reads `super::boottime`, `links` reports through
/// `super::super::io_reason`).
pub const KERNEL_LAYERS: Layers = &[
    (
        "root: CLOCK_BOOTTIME, an I/O error's reason, handing freed memory back",
        &["lib"],
    ),
    ("clock: the agent's clock on CLOCK_BOOTTIME", &["clock"]),
    (
        "syscalls and formats: bpf(2), BTF, the probe engine's sockets and epoll",
        &["bpf", "btf", "sock"],
    ),
    (
        "kernel objects: bpffs pins, counter maps, drops, links, neighbours",
        &["bpffs", "counters", "drops", "links", "neigh"],
    ),
];

/// The lab's layers, lowest first (see `docs/architecture.md`): its rooms, each a directory.
/// `bin` is the lab's command line (`src/bin/`), which reaches the library as `stepguard_lab::`.
/// The crate root only declares the rooms and re-exports the simulated node's face; nothing in
/// a room reaches the root's own items.
pub const LAB_LAYERS: Layers = &[
    (
        "sys: syscalls by subject (bpf, tc filters, packets, the neighbour watch), namespaces, \
         processes, a lab's state file and guard",
        &["sys"],
    ),
    (
        "kube: the control plane (the API server and its clients), the lab kubelet, Cilium's chart, \
         a Git server and Flux's kustomize-controller with the lab's Git source",
        &["kube"],
    ),
    (
        "sim: the simulated node (Lab, LabSpec, addresses, maps, datapath, the fabric's servers, \
         the agent's config and API, restarts, node maps, the overlay)",
        &["sim"],
    ),
    (
        "lan: a LAN of simulated nodes with L2 announcements",
        &["lan"],
    ),
    (
        "real: a node (and a cluster) running the real cilium-agent",
        &["real"],
    ),
    ("the command line", &["bin"]),
];

/// Modules that must stay pure: no clock, file, socket, process, randomness or runtime, so
/// their rules are tested without a daemon (the caller passes the time and the readings in).
/// Each with the paths its code (outside tests) must not name.
pub const PURE: &[(&str, &[&str])] = &[(
    "step",
    &[
        "std::fs",
        "std::net::Tcp",
        "std::net::Udp",
        "std::process",
        "std::thread",
        "SystemTime",
        "Instant::now",
        "unix_now",
        "clock::",
        "getrandom",
        "tokio",
        "bpffs::read",
        "observe_via",
    ],
)];

/// Workspace crates, lowest first: a crate may depend only on crates before it.
pub const CRATES: &[&str] = &[
    "agent-common",
    "agent-ebpf",
    "lab-ebpf",
    "stepguard-kernel",
    "stepguard",
    "stepguard-lab",
    "xtask",
];

/// External crates whose paths stand for one of the agent's layers (the agent also
/// re-exports the kernel crate as `crate::kernel`).
pub const CRATE_MODULES: &[(&str, &str)] = &[("stepguard_kernel", "kernel")];

/// The crates whose modules the check judges.
pub const AGENT: Crate = Crate {
    name: "agent",
    dir: "agent/src",
    ident: "stepguard",
    layers: AGENT_LAYERS,
    units: &[],
    externs: CRATE_MODULES,
};

pub const KERNEL: Crate = Crate {
    name: "kernel",
    dir: "kernel/src",
    ident: "stepguard_kernel",
    layers: KERNEL_LAYERS,
    units: &[],
    externs: &[],
};

pub const LAB: Crate = Crate {
    name: "lab",
    dir: "tests/lab/src",
    ident: "stepguard_lab",
    layers: LAB_LAYERS,
    units: &[],
    externs: &[],
};
