//! The command line: its commands and flags, and the parsers of their values.
use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use std::time::Duration;
use stepguard_lab::{AttachMode, Profile};

#[derive(Parser)]
#[command(
    name = "stepguard-lab",
    version,
    about = "A simulated Cilium node in network namespaces (needs root)"
)]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Cmd,
}

// Parsed once per run: the size of `Restart`'s flags costs nothing worth boxing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
pub enum Cmd {
    /// (internal) Serve the lab agent's API on a unix socket, as `lab up` starts it.
    #[command(hide = true)]
    AgentApi {
        #[arg(long)]
        socket: std::path::PathBuf,
        #[arg(long)]
        settings: std::path::PathBuf,
    },
    /// Create a lab: namespaces, devices, bpffs with Cilium's maps, fake datapath, DNS/HTTP VIPs.
    Up {
        /// Unique name prefix for the lab's namespaces (default: a fresh `sglabXXXXX`).
        #[arg(long)]
        prefix: Option<String>,
        /// Cilium version whose maps the lab imitates: 1.16, 1.17, 1.18, 1.19 or 1.20.
        #[arg(long, default_value = "1.18")]
        cilium: Profile,
        /// How the datapath attaches: tcx (bpf_link, pinned) or tc (legacy clsact filters).
        #[arg(long, default_value = "tcx")]
        attach: AttachMode,
        /// Also attach cil_xdp_entry to the host devices.
        #[arg(long)]
        xdp: bool,
        /// Number of pods (lxc veths, each into its own namespace).
        #[arg(long, default_value_t = 3)]
        pods: u32,
        /// enable-ipv6 (adds the IPv6 maps); a LAN lab (--nodes 2+, --cilium 1.19 or 1.20) is
        /// then dual-stack, with IPv6 VIPs (gateway6, dns6) announced over NDP.
        #[arg(long)]
        ipv6: bool,
        /// Turn kube-proxy replacement off (no SNAT map; with --no-l2, no cil_to_netdev).
        /// Cilium needs KPR for L2 announcements, so this needs --no-l2.
        #[arg(long)]
        no_kpr: bool,
        /// Turn L2 announcements off (no L2 responder map).
        #[arg(long)]
        no_l2: bool,
        /// routing-mode: tunnel (VXLAN overlay device cilium_vxlan; the tunnel map up to
        /// 1.17) or native.
        #[arg(long, default_value = "tunnel", value_parser = ["tunnel", "native"])]
        routing: String,
        /// max_entries of cilium_ct4_global (LRU, preallocated).
        #[arg(long, default_value_t = 65536)]
        ct_entries: u32,
        /// Entries written into cilium_ct4_global.
        #[arg(long, default_value_t = 64)]
        ct_fill: u32,
        /// 2 to 4: a LAN lab — that many nodes with their eth1 on one segment, a LAN client
        /// namespace for a witness, and L2-announced VIPs (gateway, dns-a, dns-b) whose leases
        /// move as Cilium's do.
        #[arg(long, default_value_t = 1)]
        nodes: u8,
        /// LAN lab: l2-announcements-lease-duration.
        #[arg(long, default_value = "15s", value_parser = parse_duration)]
        lease_duration: std::time::Duration,
        /// LAN lab: l2-announcements-renew-deadline.
        #[arg(long, default_value = "5s", value_parser = parse_duration)]
        lease_renew: std::time::Duration,
        /// LAN lab: l2-announcements-retry-period.
        #[arg(long, default_value = "2s", value_parser = parse_duration)]
        lease_retry: std::time::Duration,
        /// LAN lab: the nodes reach each other's pods over the overlay (cilium_vxlan); each
        /// has a health endpoint (HTTP on 4240), which the other nodes' agents probe as
        /// east-west targets.
        #[arg(long)]
        east_west: bool,
        /// LAN lab with --ipv6: the unsolicited neighbour advertisement a taker sends,
        /// `standard` (v1.19.5+, v1.20: Override, Target link-layer address; moves clients)
        /// or `early` (v1.19.0–v1.19.4: neither; clients keep the old holder's MAC).
        #[arg(long, default_value = "standard")]
        unsolicited_na: stepguard_lab::lan::UnsolicitedNa,
    },
    /// Show a lab (or all labs) as text or JSON.
    Status {
        #[arg(long)]
        prefix: Option<String>,
        #[arg(long, default_value = "text", value_parser = ["text", "json"])]
        format: String,
    },
    /// Simulate a cilium-agent restart; prints what really happened as JSON.
    Restart {
        #[arg(long)]
        prefix: Option<String>,
        /// How long the agent is down (e.g. 300ms, 2s). As in Cilium, the old programs keep
        /// forwarding meanwhile, unless --blackhole.
        #[arg(long, alias = "gap", default_value = "500ms", value_parser = parse_duration)]
        down: std::time::Duration,
        /// Fault: the datapath drops all traffic while the agent is down (a measurable
        /// outage; a real Cilium restart does not do this).
        #[arg(long)]
        blackhole: bool,
        /// How long after the reload the recreated ipcache is refilled.
        #[arg(long, default_value = "0s", value_parser = parse_duration)]
        refill_after: std::time::Duration,
        /// Fault: this program keeps its old instance on every device (e.g. cil_xdp_entry,
        /// cil_from_overlay) while the rest is reloaded.
        #[arg(long, value_name = "PROGRAM")]
        stale: Option<String>,
        /// Fault: the programs are reloaded but the agent does not read its config again.
        #[arg(long)]
        keep_config: bool,
        /// Fault: this program (e.g. cil_to_netdev) is no longer attached after the reload.
        #[arg(long, value_name = "PROGRAM")]
        lose_program: Option<String>,
        /// Fault: the agent loads the per-node overrides but its datapath follows the
        /// ConfigMap alone.
        #[arg(long)]
        ignore_override: bool,
        /// Fault: endpoint regeneration stalls: the first N endpoints (or all) keep the
        /// programs they had before the restart.
        #[arg(long, value_name = "N|all", value_parser = parse_stall)]
        stall_endpoints: Option<u32>,
        /// Fault (a LAN lab with --east-west): after the reload this node's tunnel entries
        /// to the other nodes are gone: their pods are unreachable from it.
        #[arg(long)]
        break_overlay: bool,
        /// How long each batch of 50 endpoint regenerations takes (after the host
        /// programs are replaced), e.g. 200ms: a slow regeneration.
        #[arg(long, default_value = "0s", value_parser = parse_duration)]
        regenerate_every: std::time::Duration,
        /// LAN lab: restart the agent on this node (its leases move as Cilium's do).
        #[arg(long)]
        node: Option<u8>,
        /// LAN lab: the agent crashes (its leases are not released; they expire).
        #[arg(long, requires = "node")]
        crash: bool,
        /// LAN lab: the pod's termination grace (the Helm chart's 1 s, preStop included).
        #[arg(long, requires = "node", default_value = "1s", value_parser = parse_duration)]
        grace: std::time::Duration,
        /// LAN lab: how long a graceful stop takes to release the leases; not under
        /// --grace: killed first, nothing released (the leases expire as after a crash).
        #[arg(long, requires = "node", default_value = "0s", value_parser = parse_duration)]
        release_takes: std::time::Duration,
        /// LAN lab: how the new agent's L2 responder reconciles its map at start: `all`
        /// (every entry deleted: v1.19.7 and v1.20.2, after cilium/cilium#45197), `last`
        /// (1.16 to 1.19.0-dev: only the entry iterated last, #45068), `none`.
        #[arg(long, requires = "node", default_value = "all")]
        responder_flush: stepguard_lab::lan::ResponderFlush,
        /// LAN lab: from the new agent's start to its leases re-acquired, when it re-adds
        /// missing responder entries with a gratuitous ARP.
        #[arg(long, requires = "node", default_value = "1s", value_parser = parse_duration)]
        reacquire_after: std::time::Duration,
        /// LAN lab: forget neighbour entries during the restart: `client` (the LAN client's,
        /// for the VIPs) or `node<i>` (node i's, for the other nodes); see --forget-at.
        #[arg(long, requires = "node", value_name = "client|node<i>")]
        forget_neighbours: Option<String>,
        /// When to forget them: `flush` (right after the responder's reconciliation at the
        /// agent's start) or a time after the agent went down (e.g. 500ms).
        #[arg(
            long,
            requires = "forget_neighbours",
            value_name = "flush|DURATION",
            default_value = "flush"
        )]
        forget_at: String,
        /// Fault: nothing is replaced (same program IDs afterwards).
        #[arg(long)]
        no_reload: bool,
        /// Fault: the new datapath is no longer attached to this device.
        #[arg(long, value_name = "DEV")]
        drop_device: Option<String>,
        /// Fault: this pinned map disappears from tc/globals.
        #[arg(long, value_name = "NAME")]
        lose_map: Option<String>,
        /// Fault: this map comes back empty.
        #[arg(long, value_name = "NAME")]
        flush_map: Option<String>,
        /// Fault: N entries of this map are deleted while the agent is down (as
        /// `bpftool map delete` would; a pod deleted during the restart is one `cilium_lxc`
        /// entry).
        #[arg(long, value_name = "MAP:N", value_parser = parse_lose_entries)]
        lose_entries: Option<(String, u32)>,
        /// Fault: after the reload, packets to the VIPs are dropped at random with this
        /// probability (0 to 1) for `--loss-for`: a lossy datapath.
        #[arg(long, value_name = "P")]
        loss: Option<f64>,
        /// How long `--loss` lasts.
        #[arg(long, value_name = "DURATION", default_value = "3s", value_parser = parse_duration)]
        loss_for: std::time::Duration,
        /// Fault: ipcache is recreated (as on every Cilium start) but never refilled.
        #[arg(long)]
        no_refill: bool,
        /// An upgrade restart: the agent comes back as this Cilium version (1.16 … 1.20),
        /// with that version's maps.
        #[arg(long, value_name = "VERSION")]
        to: Option<Profile>,
        /// A property change: this map is recreated with twice its size (new id), refilled.
        #[arg(long, value_name = "NAME")]
        resize_map: Option<String>,
    },
    /// The lab's cilium-config: `config set KEY=VALUE...` edits the ConfigMap the way kubelet
    /// updates its mount; `config override KEY=VALUE...` adds a per-node override (a
    /// CiliumNodeConfig), loaded like the ConfigMap when the agent next restarts; `show`.
    Config {
        #[arg(long)]
        prefix: Option<String>,
        #[arg(value_parser = ["set", "override", "show"])]
        action: String,
        /// KEY=VALUE pairs (`set`, `override`; `override KEY=` removes an override).
        pairs: Vec<String>,
    },
    /// Add a host device (a veth into the fabric) carrying the datapath: `device add eth2`.
    Device {
        #[arg(long)]
        prefix: Option<String>,
        #[arg(value_parser = ["add"])]
        action: String,
        name: String,
    },
    /// A lab node running the real cilium-agent (built by `cargo xtask cilium`) against its
    /// own real control plane, in the foreground until Ctrl-C (then everything is removed):
    /// prints how to run stepguard on it. `cargo xtask lab real-node` builds what is missing
    /// and sets STEPGUARD_CILIUM_1_20 and STEPGUARD_KUBE_BIN.
    RealNode {
        #[arg(long)]
        prefix: Option<String>,
        /// The Cilium minor (its bin dir from STEPGUARD_CILIUM_<MINOR>, e.g. STEPGUARD_CILIUM_1_20).
        #[arg(long, default_value = "1.20")]
        release: String,
        /// routing-mode: tunnel (VXLAN) or native.
        #[arg(long, default_value = "tunnel", value_parser = ["tunnel", "native"])]
        routing: String,
        /// No pods (by default two nginx pods and a dnsmasq pod are made through cilium-cni,
        /// with Services over them whose VIPs are stepguard targets).
        #[arg(long)]
        no_pods: bool,
        /// Restart the cilium-agent (SIGTERM, then a new agent, until it is ready) over and
        /// over while this file exists: the load of a real restart, its datapath compiled,
        /// for `cargo xtask bench`. Checked every 200 ms.
        #[arg(long, value_name = "FILE")]
        restart_while: Option<std::path::PathBuf>,
    },
    /// One rollout of a simulated fleet measured two ways on a real control plane (the
    /// DaemonSet controller's RollingUpdate, then `stepguard rollout --max-unavailable`):
    /// wall time, API requests by verb and resource, the stepper's CPU and peak RSS, as one
    /// JSON line (`cargo xtask bench --only fleet`). Needs STEPGUARD_KUBE_BIN.
    Fleet {
        #[arg(long, default_value_t = 100)]
        nodes: usize,
        #[arg(long, default_value = "10%")]
        max_unavailable: String,
        /// From a cilium pod bound to Running and Ready.
        #[arg(long, default_value = "2s", value_parser = parse_secs)]
        restart: std::time::Duration,
        /// The settle each step's verdict waits after the restart.
        #[arg(long, default_value = "5s", value_parser = parse_secs)]
        settle: std::time::Duration,
        #[arg(long, default_value_t = 0.0)]
        fail_rate: f64,
        /// The stepguard binary.
        #[arg(long)]
        stepguard: std::path::PathBuf,
        /// The repository (its deploy/rollout/rbac.yaml is applied).
        #[arg(long, default_value = ".")]
        repo: std::path::PathBuf,
        #[arg(long, default_value_t = 19969)]
        agent_port: u16,
    },
    /// Remove a lab and everything it created.
    Down {
        #[arg(long)]
        prefix: Option<String>,
        /// Remove every lab on this machine.
        #[arg(long)]
        all: bool,
    },
}

/// `MAP:N` of `--lose-entries`.
/// `all` (every endpoint) or a count.
fn parse_stall(s: &str) -> Result<u32, String> {
    if s == "all" {
        return Ok(u32::MAX);
    }
    s.parse()
        .map_err(|_| format!("invalid --stall-endpoints {s:?}: a number of endpoints or `all`"))
}

fn parse_lose_entries(s: &str) -> Result<(String, u32), String> {
    let (m, n) = s
        .rsplit_once(':')
        .ok_or_else(|| format!("{s:?}: expected MAP:N (e.g. cilium_lb4_services_v2:3)"))?;
    let n: u32 = n
        .parse()
        .map_err(|_| format!("{s:?}: N must be a count of entries"))?;
    if m.is_empty() || n == 0 {
        return Err(format!("{s:?}: expected MAP:N with N ≥ 1"));
    }
    Ok((m.to_string(), n))
}

/// `client` → None; `node1` → Some(1).
pub fn parse_forget_on(s: &str) -> Result<Option<u8>> {
    match s {
        "client" => Ok(None),
        _ => match s.strip_prefix("node").map(str::parse::<u8>) {
            Some(Ok(i)) => Ok(Some(i)),
            _ => bail!("--forget-neighbours {s:?}: expected client or node<i> (e.g. node0)"),
        },
    }
}

/// `flush` → None; a duration → Some.
pub fn parse_forget_at(s: &str) -> Result<Option<std::time::Duration>> {
    if s == "flush" {
        Ok(None)
    } else {
        parse_duration(s).map(Some)
    }
}

/// Parses `500ms`, `2s`, `1.5s`, `300us`, `1m`.
fn parse_duration(s: &str) -> Result<Duration> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .parse()
        .with_context(|| format!("invalid duration {s:?}: expected e.g. 500ms or 2s"))?;
    let secs = match unit {
        "ns" => n / 1e9,
        "us" | "µs" => n / 1e6,
        "ms" => n / 1e3,
        "s" => n,
        "m" => n * 60.0,
        _ => bail!("invalid duration {s:?}: unit must be ns, us, ms, s or m"),
    };
    if !(0.0..=3600.0).contains(&secs) {
        bail!("duration {s:?} out of range (0 to 1h)");
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Whole or fractional seconds (`2s`, `0.5s`, `500ms`).
fn parse_secs(s: &str) -> Result<std::time::Duration, String> {
    let (num, scale) = if let Some(ms) = s.strip_suffix("ms") {
        (ms, 1e-3)
    } else {
        (s.strip_suffix('s').unwrap_or(s), 1.0)
    };
    num.parse::<f64>()
        .ok()
        .filter(|v| v.is_finite() && *v >= 0.0)
        .map(|v| std::time::Duration::from_secs_f64(v * scale))
        .ok_or_else(|| format!("{s:?}: a duration such as 2s or 500ms"))
}
