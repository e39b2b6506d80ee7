//! A lab node that runs the **real cilium-agent** (issue 30), built by `cargo xtask cilium`
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
pub mod cluster;
pub mod config;
pub mod pods;

use crate::kube::{self as lkube, ControlPlane, Forward, Kube};
use crate::sim::servers;
use crate::sys::netns;
use crate::sys::process::{self, Proc};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
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

/// A node's place in a cluster of real-agent nodes (issue 31 part 3).
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

/// The ConfigMap the node's agent runs with (the chart's keys for this lab): kube-proxy
/// replacement, IPAM `kubernetes` (no operator), CRD identities, no Envoy, no Hubble, no
/// health checking, IPv4 only.
pub fn cilium_config(tunnel: bool) -> BTreeMap<String, String> {
    let mut m: BTreeMap<String, String> = [
        ("cluster-name", "stepguard-lab"),
        ("ipam", "kubernetes"),
        ("enable-ipv4", "true"),
        ("enable-ipv6", "false"),
        ("identity-allocation-mode", "crd"),
        ("enable-l7-proxy", "false"),
        ("enable-hubble", "false"),
        ("enable-health-checking", "false"),
        ("enable-endpoint-health-checking", "false"),
        ("kube-proxy-replacement", "true"),
        ("devices", "eth0 eth1"),
        ("enable-l2-announcements", "false"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    if tunnel {
        m.insert("routing-mode".into(), "tunnel".into());
        m.insert("tunnel-protocol".into(), "vxlan".into());
    } else {
        m.insert("routing-mode".into(), "native".into());
        m.insert("ipv4-native-routing-cidr".into(), POD_CIDR.into());
        m.insert("auto-direct-node-routes".into(), "false".into());
    }
    m
}

/// [`process::realtime`], or a warning when the kernel refuses it (RT group scheduling
/// without a budget): the lab still works, but gaps under load may then be the lab's servers.
fn realtime_or_warn(p: &Proc) {
    if let Err(e) = process::realtime(p) {
        eprintln!(
            "real node: {e:#}: the fabric's servers share the CPU with the restarting agent (a gap under load may be theirs)"
        );
    }
}

/// Spawns `cmd` from a thread that lives as long as the process. The agent dies with the lab
/// (`PR_SET_PDEATHSIG`), and the kernel sends that signal when the **thread** that forked it
/// exits: an agent started from a short-lived thread (the lab kubelet's restart hook) would be
/// killed as soon as the hook returned.
fn spawn_durable(cmd: Command) -> std::io::Result<Child> {
    use std::sync::mpsc::{channel, Sender};
    use std::sync::{Mutex, OnceLock};
    type Job = (Command, Sender<std::io::Result<Child>>);
    static SPAWNER: OnceLock<Mutex<Sender<Job>>> = OnceLock::new();
    let gone = || std::io::Error::other("the lab's agent spawner thread is gone");
    let jobs = SPAWNER.get_or_init(|| {
        let (tx, rx) = channel::<Job>();
        std::thread::Builder::new()
            .name("agent-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("start the lab's agent spawner thread");
        Mutex::new(tx)
    });
    let (tx, rx) = channel();
    jobs.lock()
        .unwrap_or_else(|e| e.into_inner())
        .send((cmd, tx))
        .map_err(|_| gone())?;
    rx.recv().map_err(|_| gone())?
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

/// One HTTP/1.0 GET on the agent's API socket: (status, body).
pub fn api_get(socket: &Path, path: &str) -> Result<(u16, String)> {
    let mut s =
        UnixStream::connect(socket).with_context(|| format!("connect {}", socket.display()))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.set_write_timeout(Some(Duration::from_secs(5)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
    let mut buf = Vec::new();
    s.take(16 << 20).read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("no HTTP status from {path}: {head:?}"))?;
    Ok((status, body.to_string()))
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

    fn build(&mut self) -> Result<()> {
        let (node, fabric) = (self.node_ns(), self.fabric_ns());
        self.state.netns = vec![node.clone(), fabric.clone()];
        self.save()?;
        netns::add_netns(&node)?;
        netns::add_netns(&fabric)?;
        netns::add_veth(&node, "eth0", &fabric, "fab0")?;
        netns::add_addr(&node, "eth0", &format!("{NODE_IP}/25"))?;
        netns::add_addr(&fabric, "fab0", &format!("{FABRIC0}/25"))?;
        match &self.state.spec.member {
            // The second NIC on the cluster's LAN (a bridge port `n<index>`).
            Some(m) => {
                let port = format!("n{}", m.index);
                netns::add_veth(&node, "eth1", &m.lan_ns, &port)?;
                netns::ip(&m.lan_ns, &["link", "set", &port, "master", "br0"])?;
                netns::add_addr(
                    &node,
                    "eth1",
                    &format!("{}/25", cluster::node_lan_addr(m.index)),
                )?;
            }
            None => {
                netns::add_veth(&node, "eth1", &fabric, "fab1")?;
                netns::add_addr(&node, "eth1", &format!("{NODE_IP1}/25"))?;
                netns::add_addr(&fabric, "fab1", &format!("{FABRIC1}/25"))?;
            }
        }
        for vip in [crate::sim::addr::GATEWAY_VIP, crate::sim::addr::DNS_VIP] {
            netns::add_addr(&fabric, "lo", &format!("{vip}/32"))?;
        }
        netns::ip(
            &node,
            &["route", "add", "default", "via", FABRIC0, "dev", "eth0"],
        )?;
        netns::sysctl(&fabric, &["net.ipv4.ip_forward=1"])?;
        // The fabric returns pod traffic to the node.
        netns::ip(&fabric, &["route", "add", &self.pod_cidr(), "via", NODE_IP])?;

        // The VIPs' servers, as in the simulated lab: nginx on the gateway, dnsmasq on DNS; they
        // stand for other machines, so a restart's CPU load on this one must not slow them
        // ([`process::realtime`]).
        let dir = self.state.run_dir.join("servers");
        std::fs::create_dir_all(&dir)?;
        let z = crate::sim::addr::DNS_ZONE;
        let records = vec![
            (
                format!("gateway.{z}"),
                crate::sim::addr::GATEWAY_VIP.to_string(),
            ),
            (format!("dns.{z}"), crate::sim::addr::DNS_VIP.to_string()),
        ];
        let p = servers::start_dnsmasq(
            &fabric,
            &dir,
            &crate::sim::addr::DNS_VIP.to_string(),
            &records,
        )?;
        self.state.procs.push(p.clone());
        self.save()?;
        realtime_or_warn(&p);
        let p = servers::start_nginx(
            &fabric,
            &dir,
            &crate::sim::addr::GATEWAY_VIP.to_string(),
            crate::sim::addr::GATEWAY_PORT,
            None,
        )?;
        self.state.procs.push(p.clone());
        self.save()?;
        realtime_or_warn(&p);

        // The private bpffs.
        std::fs::create_dir_all(&self.state.bpffs)?;
        self.state.bpffs_mounted = true;
        self.save()?;
        netns::run(
            "mount",
            &[
                "-t",
                "bpf",
                "bpffs",
                &self.state.bpffs.display().to_string(),
            ],
        )?;

        // The node's cgroup: a child of the lab's own cgroup2 mount.
        std::fs::create_dir_all(&self.state.cgroup_mount)?;
        self.state.cgroup_mounted = true;
        self.save()?;
        netns::run(
            "mount",
            &[
                "-t",
                "cgroup2",
                "none",
                &self.state.cgroup_mount.display().to_string(),
            ],
        )?;
        self.state.cgroup_made = true;
        self.save()?;
        std::fs::create_dir(&self.state.cgroup)
            .with_context(|| format!("create cgroup {}", self.state.cgroup.display()))?;
        if !self.state.cgroup.join("cgroup.procs").exists() {
            bail!(
                "{} is no cgroup2 directory (no cgroup.procs): the agent would attach socket-LB to a shared cgroup",
                self.state.cgroup.display()
            );
        }

        // The control plane (a cluster's member uses the cluster's), Cilium's CRDs, the Node
        // with its pod CIDR.
        if self.state.spec.member.is_none() {
            let cp = ControlPlane::up(
                &self.state.run_dir.join("kube"),
                &self.state.spec.kube_bin.clone(),
            )?;
            self.state.control_plane = Some(cp);
            self.save()?;
            apply_crds(self.control_plane(), &self.state.spec.release)?;
        }
        let cp = self.control_plane();
        let server: std::net::SocketAddr = cp
            .server
            .trim_start_matches("https://")
            .parse()
            .context("the API server's address")?;
        let kube = Kube::connect(&cp.admin_kubeconfig())?;
        lkube::create_nodes(&kube, &[(self.node_name(), self.node_ip())])?;
        let cidr = self.pod_cidr();
        kube.merge(
            &kube.all::<k8s_openapi::api::core::v1::Node>(),
            &self.node_name(),
            json!({"spec": {"podCIDR": cidr, "podCIDRs": [cidr]}}),
            false,
        )?;
        self.kube = Some(kube);
        // The agent reaches the API server through a forward on its namespace's loopback.
        let fwd = Forward::start(&node, "127.0.0.1", server)?;
        self.control_plane()
            .kubeconfig_for(&self.kubeconfig, &format!("https://{}", fwd.addr))?;
        self.forward = Some(fwd);

        self.create_config()?;
        std::fs::create_dir_all(self.agent_run_dir())?;
        let sysctls = self.state.run_dir.join("sysctl-masks");
        std::fs::create_dir_all(&sysctls)?;
        for (f, v) in [
            ("unprivileged_bpf_disabled", "2\n"),
            ("timer_migration", "1\n"),
        ] {
            std::fs::write(sysctls.join(f), v)?;
        }
        if !Path::new("/run/cilium").exists() {
            self.state.made_run_cilium = true;
            self.save()?;
            std::fs::create_dir_all("/run/cilium")?;
        }
        self.start_agent()?;
        self.wait_ready(Duration::from_secs(180))?;
        let outside = self.cgroup_attachments_outside()?;
        if !outside.is_empty() {
            bail!("the agent attached programs outside its node's cgroup: {outside:?}");
        }
        Ok(())
    }

    /// The agent's command line: per-node paths as flags, everything else from the ConfigMap.
    fn agent_args(&self) -> Vec<String> {
        let s = &self.state;
        vec![
            format!("--config-dir={}", self.agent_config_dir().display()),
            format!("--k8s-kubeconfig-path={}", self.kubeconfig.display()),
            format!("--bpf-root={}", s.bpffs.display()),
            format!("--cgroup-root={}", self.agent_cgroup_root().display()),
            format!("--state-dir={}", self.agent_run_dir().display()),
            format!("--lib-dir={}", s.spec.release.lib.display()),
            format!("--socket-path={}", self.agent_socket().display()),
        ]
    }

    /// Where the agent mounts cgroup2 inside its cgroup namespace (the node's cgroup is its root).
    fn agent_cgroup_root(&self) -> PathBuf {
        self.state.run_dir.join("cgroup-agent")
    }

    /// Starts the agent: into the node's cgroup first, then a new cgroup and mount namespace
    /// in the node's network namespace, then its mounts, then `cilium-agent`. One process
    /// throughout (each step execs the next), so its pid is the agent's.
    pub fn start_agent(&mut self) -> Result<()> {
        self.start_agent_with(true)
    }

    /// Starts the agent; `clang: false` leaves clang off its PATH (a fault: it cannot compile
    /// its datapath).
    pub fn start_agent_with(&mut self, clang: bool) -> Result<()> {
        if self.agent_running() {
            bail!("the agent is already running");
        }
        // The pod's init container, then the agent.
        self.build_config()?;
        let s = &self.state;
        std::fs::create_dir_all(self.agent_cgroup_root())?;
        let sysctls = s.run_dir.join("sysctl-masks");
        let inner = format!(
            "set -e\n\
             mount -t sysfs sysfs /sys\n\
             mount -t cgroup2 none {cg}\n\
             mount --bind {run} /run/cilium\n\
             mount --bind {masks}/unprivileged_bpf_disabled /proc/sys/kernel/unprivileged_bpf_disabled\n\
             mount --bind {masks}/timer_migration /proc/sys/kernel/timer_migration\n\
             exec \"$0\" \"$@\"",
            cg = self.agent_cgroup_root().display(),
            run = self.agent_run_dir().display(),
            masks = sysctls.display(),
        );
        let outer = format!(
            "echo $$ > {procs} && exec nsenter --net={net} -- unshare --mount --cgroup --propagation private -- sh -c \"$0\" \"$@\"",
            procs = s.cgroup.join("cgroup.procs").display(),
            net = netns::netns_path(&self.node_ns()).display(),
        );
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.agent_log())?;
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(outer)
            .arg(inner)
            .arg(s.spec.release.bin.join("cilium-agent"))
            .args(self.agent_args())
            .env("K8S_NODE_NAME", self.node_name())
            // The chart sets it from the pod's namespace: where the agent keeps its
            // L2-announcement leases (`l2announcer.go` `leaseNamespace`; "default" without).
            .env("CILIUM_K8S_NAMESPACE", config::CILIUM_NAMESPACE)
            .env(
                "PATH",
                format!(
                    "{}/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    if clang {
                        format!("{}:", clang_dir().display())
                    } else {
                        String::new()
                    }
                ),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        // SAFETY: prctl is async-signal-safe; the agent dies with the lab process.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = spawn_durable(cmd).context("start cilium-agent")?;
        let pid = child.id() as i32;
        self.child = Some(child);
        std::thread::sleep(Duration::from_millis(50));
        let start_ticks = process::start_ticks(pid).context("the agent exited at once")?;
        self.state.agent = Some(Proc {
            what: "cilium-agent".into(),
            pid,
            start_ticks,
        });
        self.save()
    }

    /// Whether the agent process is alive (not exited, not a zombie).
    pub fn agent_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Sends `sig` to the agent and, for SIGTERM/SIGKILL, waits until it exited (up to
    /// `limit`; then SIGKILL). Returns how long it took to exit.
    pub fn stop_agent(&mut self, sig: i32, limit: Duration) -> Result<Duration> {
        let Some(mut child) = self.child.take() else {
            bail!("no agent to stop");
        };
        let t0 = Instant::now();
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(child.id() as i32, sig) };
        loop {
            if child.try_wait()?.is_some() {
                break;
            }
            if t0.elapsed() > limit {
                let _ = child.kill();
                let _ = child.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.state.agent = None;
        self.save()?;
        Ok(t0.elapsed())
    }

    /// Runs another release at the next start (an upgrade or a downgrade): applies that
    /// release's CRDs (server-side, as its chart or operator would) and switches the binaries
    /// and lib dir. The agent must be stopped.
    pub fn switch_release(&mut self, release: Release) -> Result<()> {
        if self.agent_running() {
            bail!("stop the agent before switching its release");
        }
        for v in ["v2", "v2alpha1"] {
            let dir = release
                .lib
                .join("pkg/k8s/apis/cilium.io/client/crds")
                .join(v);
            self.control_plane()
                .kubectl(&[
                    "apply",
                    "--server-side",
                    "--force-conflicts",
                    "-f",
                    &dir.display().to_string(),
                ])
                .with_context(|| format!("apply Cilium {}'s CRDs", release.version))?;
        }
        self.state.spec.release = release;
        self.save()
    }

    /// Deletes every entry of the pinned global map `name` with bpftool (a fault made from
    /// outside the agent; stepguard itself never writes Cilium's maps). Returns how many.
    pub fn empty_map(&self, name: &str) -> Result<usize> {
        self.delete_map_entries(name, |_| true)
    }

    /// Deletes the entries of a pinned global map whose key `pick` chooses (bpftool, behind
    /// the agent's back); how many.
    pub fn delete_map_entries(&self, name: &str, pick: impl Fn(&[u8]) -> bool) -> Result<usize> {
        let pin = self.state.bpffs.join("tc/globals").join(name);
        let pin = pin.display().to_string();
        let dump: Value = serde_json::from_str(&netns::run(
            "bpftool",
            &["-j", "map", "dump", "pinned", &pin],
        )?)
        .context("parse bpftool's dump")?;
        let mut n = 0;
        for e in dump.as_array().into_iter().flatten() {
            let key: Vec<String> = e["key"]
                .as_array()
                .context("a key as bytes")?
                .iter()
                .filter_map(|b| b.as_str().map(|s| s.trim_start_matches("0x").to_string()))
                .collect();
            let bytes: Vec<u8> = key
                .iter()
                .filter_map(|b| u8::from_str_radix(b, 16).ok())
                .collect();
            if !pick(&bytes) {
                continue;
            }
            let mut args = vec!["map", "delete", "pinned", &pin, "key", "hex"];
            args.extend(key.iter().map(String::as_str));
            netns::run("bpftool", &args)?;
            n += 1;
        }
        Ok(n)
    }

    /// Entries of the pinned global map `name` (bpftool).
    pub fn map_entries(&self, name: &str) -> Result<usize> {
        let pin = self.state.bpffs.join("tc/globals").join(name);
        let dump: Value = serde_json::from_str(&netns::run(
            "bpftool",
            &["-j", "map", "dump", "pinned", &pin.display().to_string()],
        )?)
        .context("parse bpftool's dump")?;
        Ok(dump.as_array().map(|a| a.len()).unwrap_or(0))
    }

    /// Sends a signal (SIGSTOP, SIGCONT) to the running agent without waiting.
    pub fn signal_agent(&self, sig: i32) -> Result<()> {
        let p = self.state.agent.as_ref().context("no agent running")?;
        if process::start_ticks(p.pid) != Some(p.start_ticks) {
            bail!("the agent is gone");
        }
        // SAFETY: kill(2) on a pid verified to be our agent.
        unsafe { libc::kill(p.pid, sig) };
        Ok(())
    }

    /// The devices the agent was started with: `devices` as `build-config` resolved it (a
    /// per-node override included).
    pub fn agent_devices(&self) -> Vec<String> {
        std::fs::read_to_string(self.agent_config_dir().join("devices"))
            .unwrap_or_else(|_| "eth0 eth1".into())
            .split([' ', ','])
            .filter(|d| !d.is_empty())
            .map(String::from)
            .collect()
    }

    /// The devices the running agent reports it selected (its status,
    /// `kube-proxy-replacement.deviceList`). None: not answering or not reported yet.
    pub fn selected_devices(&self) -> Option<Vec<String>> {
        let (code, body) = api_get(&self.agent_socket(), "/v1/healthz").ok()?;
        if code != 200 {
            return None;
        }
        let v: Value = serde_json::from_str(&body).ok()?;
        let list = v["kube-proxy-replacement"]["deviceList"].as_array()?;
        let mut names: Vec<String> = list
            .iter()
            .filter_map(|d| d["name"].as_str().map(String::from))
            .collect();
        names.sort();
        Some(names)
    }

    /// Waits until the agent's API says it is healthy and the host datapath is attached on
    /// the devices it was started with (the pinned tcx links of `cil_from_netdev`); with a
    /// pattern (`eth+`, `!eth2`) in its `devices`, on those it reports it selected.
    pub fn wait_ready(&mut self, limit: Duration) -> Result<Readiness> {
        let t0 = Instant::now();
        let listed = self.agent_devices();
        let patterns = listed
            .iter()
            .any(|d| d.ends_with('+') || d.starts_with('!'));
        let mut api_at = None;
        loop {
            if !self.agent_running() {
                bail!(
                    "the agent exited ({}); see {}",
                    self.child
                        .as_mut()
                        .and_then(|c| c.try_wait().ok().flatten())
                        .map(|s| s.to_string())
                        .unwrap_or_else(|| "not started".into()),
                    self.agent_log().display()
                );
            }
            if api_at.is_none()
                && api_get(&self.agent_socket(), "/v1/healthz").is_ok_and(|(c, _)| c == 200)
            {
                api_at = Some(t0.elapsed());
            }
            let devices = if patterns {
                self.selected_devices()
                    .filter(|d| !d.is_empty())
                    .unwrap_or_else(|| vec!["(the agent's selection)".into()])
            } else {
                listed.clone()
            };
            let attached = devices.iter().all(|d| {
                self.state
                    .bpffs
                    .join("cilium/devices")
                    .join(d)
                    .join("links/cil_from_netdev")
                    .exists()
            });
            if let (Some(api), true) = (api_at, attached) {
                if let Ok(ready) = self.endpoints_ready() {
                    if ready {
                        return Ok(Readiness {
                            api,
                            ready: t0.elapsed(),
                        });
                    }
                }
            }
            if t0.elapsed() > limit {
                bail!(
                    "the agent was not ready after {limit:?} (API healthy: {api_at:?}, host datapath attached: {attached}); see {}",
                    self.agent_log().display()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// A command prefix that moves the process into the node's cgroup, then execs the rest:
    /// what runs "on the node" (stepguard's agent, as a hostNetwork pod does) is under the
    /// cgroup the node's socket-LB is attached to, as on a real node (Cilium attaches at the
    /// host's cgroup2 root), so its connects to Service addresses are translated by it.
    pub fn in_node_cgroup(&self) -> Vec<String> {
        vec![
            "sh".into(),
            "-c".into(),
            format!(
                "echo $$ > {} && exec \"$@\"",
                self.state.cgroup.join("cgroup.procs").display()
            ),
            "sh".into(),
        ]
    }

    pub fn sampler(&self) -> Sampler {
        Sampler {
            socket: self.agent_socket(),
            bpffs: self.state.bpffs.clone(),
        }
    }

    /// Whether every endpoint the agent knows is `ready` (at least the host endpoint).
    pub fn endpoints_ready(&self) -> Result<bool> {
        let (code, body) = api_get(&self.agent_socket(), "/v1/endpoint")?;
        if code != 200 {
            bail!("GET /v1/endpoint: {code}");
        }
        let eps: Value = serde_json::from_str(&body).context("parse /v1/endpoint")?;
        let eps = eps.as_array().context("/v1/endpoint is no list")?;
        Ok(!eps.is_empty()
            && eps
                .iter()
                .all(|e| e["status"]["state"].as_str() == Some("ready")))
    }

    /// Programs attached to cgroups other than the node's own (or its descendants), as
    /// `bpftool cgroup tree` lists them from the lab's cgroup2 mount: empty when the agent's
    /// socket-LB is confined to its node.
    pub fn cgroup_attachments_outside(&self) -> Result<Vec<String>> {
        let out = netns::run(
            "bpftool",
            &[
                "cgroup",
                "tree",
                &self.state.cgroup_mount.display().to_string(),
            ],
        )?;
        let mine = self.state.cgroup.display().to_string();
        let mut outside = Vec::new();
        let mut current = String::new();
        // `bpftool cgroup tree`: a header, then each cgroup's path followed by its programs
        // (ID, attach type, flags, name). Cilium's programs are named `cil_*`.
        for line in out.lines() {
            let t = line.trim();
            if t.starts_with("CgroupPath") || t.starts_with("ID") || t.is_empty() {
                continue;
            }
            if t.starts_with('/') {
                current = t.to_string();
            } else if t
                .split_whitespace()
                .last()
                .is_some_and(|n| n.starts_with("cil_"))
                && !current.starts_with(&mine)
                && !another_nodes_cgroup(&self.state.cgroup_mount, &current)
            {
                outside.push(format!("{current}: {t}"));
            }
        }
        Ok(outside)
    }

    /// Programs attached to the node's own cgroup (the agent's socket-LB).
    pub fn cgroup_attachments(&self) -> Result<String> {
        netns::run(
            "bpftool",
            &["cgroup", "show", &self.state.cgroup.display().to_string()],
        )
    }

    /// A stepguard config for this node, as a user writes it from
    /// `deploy/stepguard.example.yaml`: the agent's bpffs, ConfigMap and API socket, the
    /// VIPs' targets and the DNS check.
    pub fn write_stepguard_config(&self) -> Result<PathBuf> {
        let p = self.state.run_dir.join("stepguard.yaml");
        let z = crate::sim::addr::DNS_ZONE;
        let yaml = format!(
            "# stepguard config for the real-agent node {prefix} (run it in {node})\n\
             bpffs: {bpffs}\n\
             cilium_config: {cfg}\n\
             cilium_api: {api}\n\
             cilium: auto\n\
             implicit_steps: {{settle: 1s, timeout: 120s}}\n\
             targets:\n\
             \x20 - name: gateway\n    address: {gw}\n    port: {gwp}\n    probe: http\n    path: /healthz\n    expect: 200\n    timeout: 500ms\n\
             \x20 - name: dns\n    address: {dns}\n    port: 53\n    probe: dns\n    query: gateway.{z}\n    timeout: 500ms\n\
             {services}\
             dns:\n  resolvers: [\"{dns}:53\"]\n  names: [\"gateway.{z}\", \"dns.{z}\"]\n",
            services = if self.state.services {
                Self::service_targets_yaml()
            } else {
                String::new()
            },
            prefix = self.state.spec.prefix,
            node = self.node_ns(),
            bpffs = self.state.bpffs.display(),
            cfg = self.state.cilium_config.display(),
            api = self.agent_socket().display(),
            gw = crate::sim::addr::GATEWAY_VIP,
            gwp = crate::sim::addr::GATEWAY_PORT,
            dns = crate::sim::addr::DNS_VIP,
        );
        std::fs::write(&p, yaml).context("write the stepguard config")?;
        Ok(p)
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

/// What a restart looks like from outside the agent, sampled: the API socket, the ids of the
/// recreated ipcache map, of `cilium_lxc`, and of the programs behind `eth0`'s and
/// `cilium_host`'s pinned links.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample {
    pub api: bool,
    pub ipcache: Option<u32>,
    pub lxc: Option<u32>,
    pub eth0_prog: Option<u32>,
    pub host_prog: Option<u32>,
}

/// Paths the sampler reads (cloneable into a thread).
#[derive(Clone, Debug)]
pub struct Sampler {
    socket: PathBuf,
    bpffs: PathBuf,
}

impl Sampler {
    pub fn sample(&self) -> Sample {
        let map_id = |name: &str| {
            crate::sys::bpf::obj_get(&self.bpffs.join("tc/globals").join(name))
                .and_then(|fd| crate::sys::bpf::obj_id(&fd))
                .ok()
        };
        let link_prog = |dev: &str, prog: &str| {
            crate::sys::bpf::obj_get(
                &self
                    .bpffs
                    .join("cilium/devices")
                    .join(dev)
                    .join("links")
                    .join(prog),
            )
            .and_then(|fd| crate::sys::bpf::link_prog_id(&fd))
            .ok()
        };
        Sample {
            api: UnixStream::connect(&self.socket).is_ok(),
            ipcache: map_id("cilium_ipcache_v2"),
            lxc: map_id("cilium_lxc"),
            eth0_prog: link_prog("eth0", "cil_from_netdev"),
            host_prog: link_prog("cilium_host", "cil_to_host"),
        }
    }

    /// Samples every `every` until `stop` is set; returns each change with its time since
    /// `t0`: `(seconds, what changed)`.
    pub fn timeline(
        &self,
        t0: Instant,
        every: Duration,
        stop: &std::sync::atomic::AtomicBool,
    ) -> Vec<(f64, String)> {
        let mut out = Vec::new();
        let mut last = self.sample();
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            std::thread::sleep(every);
            let now = self.sample();
            let at = t0.elapsed().as_secs_f64();
            let mut note = |what: String| out.push((at, what));
            if now.api != last.api {
                note(format!(
                    "API socket {}",
                    if now.api { "accepts" } else { "refuses" }
                ));
            }
            if now.ipcache != last.ipcache {
                note(format!(
                    "cilium_ipcache_v2 id {:?} -> {:?}",
                    last.ipcache, now.ipcache
                ));
            }
            if now.lxc != last.lxc {
                note(format!("cilium_lxc id {:?} -> {:?}", last.lxc, now.lxc));
            }
            if now.eth0_prog != last.eth0_prog {
                note(format!(
                    "eth0 cil_from_netdev program {:?} -> {:?}",
                    last.eth0_prog, now.eth0_prog
                ));
            }
            if now.host_prog != last.host_prog {
                note(format!(
                    "cilium_host cil_to_host program {:?} -> {:?}",
                    last.host_prog, now.host_prog
                ));
            }
            last = now;
        }
        out
    }
}

/// Whether `path` (a cgroup as `bpftool cgroup tree` prints it from the lab's mount `mount`)
/// is another real-agent node's cgroup: `<mount>/<prefix>-node` with a recorded real node of
/// that prefix. Such a node's socket-LB is confined to it as this one's is; only attachments
/// at the root or elsewhere reach other processes.
fn another_nodes_cgroup(mount: &Path, path: &str) -> bool {
    let p = Path::new(path);
    p.parent() == Some(mount)
        && p.file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix("-node"))
            .is_some_and(|prefix| {
                Path::new(crate::sys::fixture::RUN_ROOT)
                    .join(prefix)
                    .join("real.json")
                    .exists()
            })
}

/// How long an agent start took until its API answered healthy and until it was ready (host
/// datapath attached, every endpoint regenerated).
#[derive(Clone, Copy, Debug)]
pub struct Readiness {
    pub api: Duration,
    pub ready: Duration,
}

/// The directory whose `clang` the agent runs: Debian's clang-19 (`/usr/lib/llvm-19/bin`),
/// a version Cilium 1.19/1.20 support (LLVM ≥ 18.1).
pub fn clang_dir() -> PathBuf {
    PathBuf::from("/usr/lib/llvm-19/bin")
}
