//! A lab node that runs the **real cilium-agent**, built by `cargo xtask cilium`
//! from `github.com/cilium/cilium` on the Go module proxy, against the lab's real control
//! plane ([`crate::kube::ControlPlane`]). Nothing of Cilium is imitated here: the node's
//! programs, maps, links and API are the agent's own.
//!
//! Isolation, each checked before the agent starts:
//! - **network**: the node's own namespace (`<prefix>-node`: `eth0`, `eth1` as veths into a
//!   fabric namespace that holds the VIPs' servers);
//! - **bpffs**: a private bpffs mounted under the lab's run dir (`--bpf-root`), so the node's
//!   pins are its own and stepguard reads them from the host's mount namespace;
//! - **cgroup**: the agent runs in a child cgroup of its own (`<prefix>-node` under a cgroup2
//!   mount the lab makes) and in a cgroup namespace rooted there, with `--cgroup-root` a cgroup2
//!   mounted inside that namespace: its socket-LB programs attach to the node's cgroup, never to
//!   the machine's root cgroup (the mistake of the first hand-made run, see
//!   `docs/cilium-fidelity.md`). [`RealNode::cgroup_attachments_outside`] proves it after start;
//! - **mounts**: a private mount namespace per agent start, with the netns's own sysfs, the
//!   node's runtime dir bound on `/var/run/cilium` (Cilium writes its pid file, shell socket and
//!   netns dir there whatever its flags), and regular files over the two global sysctls Cilium
//!   writes at start (`kernel.unprivileged_bpf_disabled=1`, which cannot be undone, and
//!   `kernel.timer_migration=0`; `pkg/datapath/loader/base.go` `Reinitialize`), so the
//!   machine's kernel settings stay as they were.
//!
//! The agent's configuration comes as a Cilium pod's does ([`config`]): the ConfigMap object
//! and the node's CiliumNodeConfigs merged by the release's `cilium-dbg build-config` before
//! each start (`--config-dir`); stepguard's `cilium_config` reads the ConfigMap's kubelet-style
//! mount. Only per-node paths are flags.
mod agent;
mod build;
pub mod cluster;
pub mod config;
mod inspect;
pub mod pods;

use agent::realtime_or_warn;
pub use agent::{api_get, clang_dir, Readiness};
pub use config::cilium_config;
pub use inspect::{Sample, Sampler};

use crate::kube::{ControlPlane, Forward, Kube};
use crate::sys::netns;
use crate::sys::process::{self, Proc};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// The node's name in Kubernetes (each real-node lab has its own control plane).
pub const NODE_NAME: &str = "lab-node-0";
/// `eth0`: the node's address (its Node InternalIP) and the fabric's end.
pub const NODE_IP: &str = "192.0.2.1";
const FABRIC0: &str = "192.0.2.126";
/// `eth1`, the second NIC (as the simulated lab has).
const NODE_IP1: &str = "192.0.2.129";
const FABRIC1: &str = "192.0.2.254";
/// The Node's pod CIDR (IPAM `kubernetes`): a documentation range, never routed.
pub const POD_CIDR: &str = "203.0.113.0/24";

/// A Cilium release built by `cargo xtask cilium`: its binaries and the agent's lib dir.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Release {
    /// e.g. `1.20.2`.
    pub version: String,
    pub bin: PathBuf,
    /// The module directory holding `bpf/` (`--lib-dir`'s content, read-only).
    pub lib: PathBuf,
}

impl Release {
    /// The release `cargo xtask cilium` built for `minor` (`1.20`): from
    /// `STEPGUARD_CILIUM_<MINOR>` (`STEPGUARD_CILIUM_1_20`, set by `cargo xtask test`), a bin
    /// dir whose parent holds `libdir` and `version` files.
    pub fn from_env(minor: &str) -> Result<Release> {
        let var = format!("STEPGUARD_CILIUM_{}", minor.replace('.', "_"));
        let bin = PathBuf::from(std::env::var_os(&var).with_context(|| {
            format!("{var}: the real cilium-agent {minor}'s bin dir (`cargo xtask cilium --release {minor}` prints it; `cargo xtask test` sets it)")
        })?);
        Release::at(&bin)
    }

    pub fn at(bin: &Path) -> Result<Release> {
        let parent = bin
            .parent()
            .with_context(|| format!("{} has no parent", bin.display()))?;
        let read = |f: &str| {
            std::fs::read_to_string(parent.join(f))
                .map(|s| s.trim().to_string())
                .with_context(|| {
                    format!(
                        "read {} (written by `cargo xtask cilium`)",
                        parent.join(f).display()
                    )
                })
        };
        let lib = PathBuf::from(read("libdir")?);
        if !lib.join("bpf/bpf_host.c").exists() {
            bail!("{} holds no bpf/bpf_host.c", lib.display());
        }
        for b in ["cilium-agent", "cilium-cni"] {
            if !bin.join(b).exists() {
                bail!("no {b} in {}", bin.display());
            }
        }
        Ok(Release {
            version: read("version")?.trim_start_matches('v').to_string(),
            bin: bin.to_path_buf(),
            lib,
        })
    }
}

/// What to build.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RealSpec {
    pub prefix: String,
    pub release: Release,
    /// The control plane's binaries (`cargo xtask kube`).
    pub kube_bin: PathBuf,
    /// Tunnel (VXLAN) routing; native routing otherwise.
    pub tunnel: bool,
    /// A node of a [`cluster::RealCluster`]: its `eth1` on the cluster's LAN, the cluster's
    /// control plane and ConfigMap. None: a node with a control plane of its own.
    #[serde(default)]
    pub member: Option<Member>,
}

/// A node's place in a cluster of real-agent nodes.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Member {
    pub index: u8,
    /// The namespace holding the LAN bridge `br0` its `eth1` joins.
    pub lan_ns: String,
    /// The cluster's control plane (not this node's to take down).
    pub control_plane: ControlPlane,
    /// The cluster's ConfigMap (created by the cluster; each node writes its mount).
    pub config: BTreeMap<String, String>,
}

/// Everything a real node created, recorded before it is created.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RealState {
    pub spec: RealSpec,
    pub run_dir: PathBuf,
    pub netns: Vec<String>,
    pub bpffs: PathBuf,
    pub bpffs_mounted: bool,
    /// The lab's own cgroup2 mount (the host's view) and the node's child cgroup in it.
    pub cgroup_mount: PathBuf,
    pub cgroup_mounted: bool,
    pub cgroup: PathBuf,
    pub cgroup_made: bool,
    /// `/run/cilium`, created by the lab when it was missing (a bind mount needs it).
    pub made_run_cilium: bool,
    pub cilium_config: PathBuf,
    pub procs: Vec<Proc>,
    pub agent: Option<Proc>,
    pub control_plane: Option<ControlPlane>,
    /// Pods made through CNI ([`crate::real::pods`]).
    #[serde(default)]
    pub pods: Vec<pods::RealPod>,
    /// The Services over them exist (their VIPs are stepguard targets).
    #[serde(default)]
    pub services: bool,
    /// Pods are made by a primary plugin with `cilium-cni` chained after it (generic-veth):
    /// the directory holding `ptp` and `host-local` (`github.com/containernetworking/plugins`).
    #[serde(default)]
    pub cni_chain: Option<PathBuf>,
}

/// A running real-agent node. [`RealNode::down`] (or dropping a [`RealGuard`]) removes
/// exactly what it made.
pub struct RealNode {
    pub state: RealState,
    child: Option<Child>,
    forward: Option<Forward>,
    kube: Option<Kube>,
    /// The kubeconfig the agent uses (through the forward in its namespace).
    kubeconfig: PathBuf,
}

/// Takes a real-agent node down when dropped.
pub type RealGuard = crate::sys::fixture::Guard<RealNode>;

impl crate::sys::fixture::Fixture for RealNode {
    const KIND: &'static str = "real node";
    fn prefix(&self) -> &str {
        &self.state.spec.prefix
    }
    fn down(&mut self) -> Result<()> {
        RealNode::down(self)
    }
}

/// Creates a release's CRDs (only Cilium's operator registers them; the agent waits for
/// them) and waits until they are established.
pub(crate) fn apply_crds(cp: &ControlPlane, release: &Release) -> Result<()> {
    for v in ["v2", "v2alpha1"] {
        let dir = release
            .lib
            .join("pkg/k8s/apis/cilium.io/client/crds")
            .join(v);
        cp.kubectl(&["create", "-f", &dir.display().to_string()])
            .with_context(|| format!("apply Cilium's CRDs from {}", dir.display()))?;
    }
    cp.wait_crds_established(&["crd", "--all"], Duration::from_secs(60))?;
    Ok(())
}

impl RealNode {
    pub fn node_ns(&self) -> String {
        format!("{}-node", self.state.spec.prefix)
    }
    /// The node's name in Kubernetes: `lab-node-<index>` ([`NODE_NAME`] alone).
    pub fn node_name(&self) -> String {
        match &self.state.spec.member {
            Some(m) => format!("lab-node-{}", m.index),
            None => NODE_NAME.to_string(),
        }
    }
    /// The node's InternalIP: `eth0`'s alone, its LAN address (`eth1`) in a cluster, where
    /// every node's `eth0` has the same address into a fabric of its own.
    pub fn node_ip(&self) -> String {
        match &self.state.spec.member {
            Some(m) => cluster::node_lan_addr(m.index).to_string(),
            None => NODE_IP.to_string(),
        }
    }
    /// The node's pod CIDR (IPAM `kubernetes`): [`POD_CIDR`] alone, a /26 of it per node in
    /// a cluster.
    pub fn pod_cidr(&self) -> String {
        match &self.state.spec.member {
            Some(m) => format!("203.0.113.{}/26", 64 * u32::from(m.index)),
            None => POD_CIDR.to_string(),
        }
    }
    pub fn fabric_ns(&self) -> String {
        format!("{}-fabric", self.state.spec.prefix)
    }
    /// The node's `/var/run/cilium` (bound there in the agent's mount namespace).
    pub fn agent_run_dir(&self) -> PathBuf {
        self.state.run_dir.join("cilium-run")
    }
    pub fn agent_socket(&self) -> PathBuf {
        self.agent_run_dir().join("cilium.sock")
    }
    pub fn agent_log(&self) -> PathBuf {
        self.state.run_dir.join("cilium-agent.log")
    }
    pub fn control_plane(&self) -> &ControlPlane {
        match &self.state.spec.member {
            Some(m) => &m.control_plane,
            None => self
                .state
                .control_plane
                .as_ref()
                .expect("a real node has a control plane"),
        }
    }
    pub fn kube(&self) -> &Kube {
        self.kube.as_ref().expect("a real node has an API client")
    }

    /// Real-agent nodes with a state file (`real.json`).
    pub fn list() -> Vec<String> {
        crate::sys::fixture::list("real.json")
    }

    /// The recorded state of a real-agent node, e.g. to take it down after the process that
    /// made it died (its agent and forward died with it).
    pub fn open(prefix: &str) -> Result<RealNode> {
        let run_dir = Path::new(crate::sys::fixture::RUN_ROOT).join(prefix);
        let state: RealState = crate::sys::fixture::read("real-agent node", prefix, "real.json")?;
        Ok(RealNode {
            kubeconfig: run_dir.join("cilium-agent.kubeconfig"),
            state,
            child: None,
            forward: None,
            kube: None,
        })
    }

    pub(crate) fn state_pods(&mut self) -> &mut Vec<pods::RealPod> {
        &mut self.state.pods
    }
    pub(crate) fn save_state(&self) -> Result<()> {
        self.save()
    }
    pub(crate) fn kube_opt(&self) -> Option<&Kube> {
        self.kube.as_ref()
    }

    fn save(&self) -> Result<()> {
        crate::sys::fixture::save(&self.state.run_dir.join("real.json"), &self.state)
    }

    /// Builds the node and starts the agent; returns once its host datapath is attached and
    /// its API is healthy. On error, what was made is removed again.
    pub fn up(spec: RealSpec) -> Result<RealNode> {
        crate::sys::check_root()?;
        let run_dir = Path::new(crate::sys::fixture::RUN_ROOT).join(&spec.prefix);
        if run_dir.exists() || netns::netns_exists(&format!("{}-node", spec.prefix)) {
            bail!("lab prefix {:?} is already in use", spec.prefix);
        }
        std::fs::create_dir_all(&run_dir)
            .with_context(|| format!("create {}", run_dir.display()))?;
        let mut node = RealNode {
            state: RealState {
                bpffs: run_dir.join("bpffs"),
                cgroup_mount: run_dir.join("cgroup"),
                cgroup: run_dir.join("cgroup").join(format!("{}-node", spec.prefix)),
                cilium_config: run_dir.join("cilium-config"),
                run_dir: run_dir.clone(),
                spec,
                netns: vec![],
                bpffs_mounted: false,
                cgroup_mounted: false,
                cgroup_made: false,
                made_run_cilium: false,
                procs: vec![],
                agent: None,
                control_plane: None,
                pods: vec![],
                services: false,
                cni_chain: None,
            },
            child: None,
            forward: None,
            kube: None,
            kubeconfig: run_dir.join("cilium-agent.kubeconfig"),
        };
        node.save()?;
        match node.build() {
            Ok(()) => Ok(node),
            Err(e) => {
                let log = std::fs::read_to_string(node.agent_log()).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(40).collect();
                if let Err(d) = node.down() {
                    eprintln!("real node: cleanup after a failed up also failed: {d:#}");
                }
                Err(e.context(format!(
                    "the agent log's last lines:\n{}",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                )))
            }
        }
    }

    /// Removes exactly what this node made, in reverse: the agent, the control plane, the
    /// servers, the mounts, the cgroup, the namespaces, the run dir.
    pub fn down(&mut self) -> Result<()> {
        let mut errors = Vec::new();
        // Pods first, by CNI DEL while the agent still runs (a runtime's order).
        let names: Vec<String> = self.state.pods.iter().map(|p| p.name.clone()).collect();
        for name in names.into_iter().rev() {
            if let Err(e) = self.remove_pod(&name) {
                errors.push(format!("remove pod {name}: {e:#}"));
            }
        }
        if self.child.is_some() {
            let _ = self.signal_agent(libc::SIGCONT);
            if let Err(e) = self.stop_agent(libc::SIGTERM, Duration::from_secs(10)) {
                errors.push(format!("stop the agent: {e:#}"));
            }
        } else if let Some(p) = self.state.agent.take() {
            process::stop(&p);
        }
        self.forward = None;
        self.kube = None;
        if let Some(mut cp) = self.state.control_plane.take() {
            cp.down();
        }
        for p in self.state.procs.drain(..).rev() {
            process::stop(&p);
        }
        // Unpinning everything releases the agent's links (cgroup, tcx) and maps.
        if self.state.bpffs_mounted {
            if let Err(e) = netns::run("umount", &["-l", &self.state.bpffs.display().to_string()]) {
                errors.push(format!("{e:#}"));
            }
            self.state.bpffs_mounted = false;
        }
        for ns in self.state.netns.drain(..).rev() {
            if let Err(e) = netns::del_netns(&ns) {
                errors.push(format!("{e:#}"));
            }
        }
        if self.state.cgroup_made {
            // A cgroup goes once its last process is gone; the agent's exit may lag.
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                match std::fs::remove_dir(&self.state.cgroup) {
                    Ok(()) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                    Err(e) if Instant::now() > deadline => {
                        errors.push(format!("remove {}: {e}", self.state.cgroup.display()));
                        break;
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(100)),
                }
            }
            self.state.cgroup_made = false;
        }
        if self.state.cgroup_mounted {
            if let Err(e) = netns::run(
                "umount",
                &["-l", &self.state.cgroup_mount.display().to_string()],
            ) {
                errors.push(format!("{e:#}"));
            }
            self.state.cgroup_mounted = false;
        }
        if self.state.made_run_cilium {
            // Only if still empty: never remove what something else put there.
            let _ = std::fs::remove_dir("/run/cilium");
            self.state.made_run_cilium = false;
        }
        if errors.is_empty() {
            let _ = std::fs::remove_dir_all(&self.state.run_dir);
            Ok(())
        } else {
            let _ = self.save();
            bail!("{}", errors.join("; "))
        }
    }
}
