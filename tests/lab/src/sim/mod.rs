//! The simulated node: a Cilium node in network namespaces, faithful to `shared/cilium-facts.md`
//! ([`Lab`], [`LabSpec`]): its addresses, pinned maps and datapath programs, the fabric's
//! servers, the agent's config and API, restarts, node maps and the overlay.
pub mod addr;
pub mod agentapi;
mod agentcfg;
mod build;
pub mod ciliumconfig;
pub mod datapath;
pub mod maps;
mod nodemaps;
mod overlay;
mod restart;
pub mod servers;

pub use addr::*;
pub use datapath::{AttachMode, Attachment, Hook};
pub use maps::{Capacity, Features, Profile};
pub use restart::*;

use crate::sys::fixture::{self, validate_prefix, RUN_ROOT};
use crate::sys::process::{self, Proc};
use crate::sys::{self, check_root, netns, now_ns};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// What to build.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LabSpec {
    pub prefix: String,
    pub profile: Profile,
    pub attach: AttachMode,
    pub xdp: bool,
    /// With `xdp`: `bpf-lb-acceleration: best-effort` (a device refusing XDP is skipped)
    /// instead of `native`.
    #[serde(default)]
    pub xdp_best_effort: bool,
    /// Host devices whose driver refuses native XDP: their veth peer gets an MTU above what
    /// XDP without fragments allows (the kernel's `veth_xdp_set`: "Peer MTU is too large to
    /// set XDP", ERANGE).
    #[serde(default)]
    pub xdp_refused: Vec<String>,
    pub pods: u32,
    pub features: Features,
    #[serde(default)]
    pub capacity: Capacity,
    /// Entries written into `cilium_ct4_global` (benchmarks ask for ~500k).
    pub ct_fill: u32,
    /// Per-node config overrides (a CiliumNodeConfig for this node): the agent loads them
    /// over the ConfigMap.
    #[serde(default)]
    pub node_overrides: BTreeMap<String, String>,
    /// A node of a multi-node LAN lab ([`lan::LanLab`]): `eth1` is this node's port on the
    /// shared LAN segment instead of a veth into its own fabric.
    #[serde(default)]
    pub lan: Option<LanPort>,
}

/// Where a node's `eth1` plugs into a LAN segment: a bridge `br0` in namespace `ns`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LanPort {
    pub ns: String,
    /// The node's index on the segment: port `n<index>`, address `203.0.113.<1 + index>`.
    pub index: u8,
    /// The other nodes this node reaches over the overlay (their indexes): `cilium_vxlan`
    /// carries pod traffic to their pod CIDRs, and this node has a health endpoint (see
    /// [`health_ip`]). Empty: no overlay between the nodes.
    #[serde(default)]
    pub peers: Vec<u8>,
}

impl LabSpec {
    pub fn new(prefix: impl Into<String>) -> Self {
        Self {
            prefix: prefix.into(),
            profile: Profile::V1_18,
            attach: AttachMode::Tcx,
            xdp: false,
            xdp_best_effort: false,
            xdp_refused: vec![],
            pods: 3,
            features: Features {
                ipv4: true,
                ipv6: false,
                kube_proxy_replacement: true,
                l2_announcements: true,
                tunnel: true,
            },
            capacity: Capacity::default(),
            ct_fill: 64,
            node_overrides: BTreeMap::new(),
            lan: None,
        }
    }
}

/// The `stepguard-lab` binary (it also serves the lab agent's API): `STEPGUARD_LAB_BIN`, this
/// process when it is the lab binary, or the debug build next to the workspace.
pub fn lab_binary() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("STEPGUARD_LAB_BIN") {
        return Ok(PathBuf::from(p));
    }
    let me = std::env::current_exe().context("locate this executable")?;
    if me.file_name().is_some_and(|n| n == "stepguard-lab") {
        return Ok(me);
    }
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/debug/stepguard-lab");
    if built.exists() {
        return Ok(built);
    }
    bail!("cannot find the stepguard-lab binary (set STEPGUARD_LAB_BIN, or `cargo xtask build`)")
}

/// A fresh prefix nobody uses: `sglab` + 5 hex digits.
pub fn unique_prefix() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .subsec_nanos();
    let seed = nanos ^ (std::process::id() << 12);
    for i in 0..64u32 {
        let p = format!(
            "sglab{:05x}",
            (seed.wrapping_add(i.wrapping_mul(0x9e37_79b9))) & 0xfffff
        );
        if !prefix_in_use(&p) {
            return p;
        }
    }
    format!("sglab{:05x}", seed & 0xfffff)
}

fn prefix_in_use(p: &str) -> bool {
    Path::new(RUN_ROOT).join(p).exists()
        || netns::netns_exists(&format!("{p}-node"))
        || netns::netns_exists(&format!("{p}-fabric"))
}

/// Everything a lab created, persisted as it is created.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LabState {
    pub spec: LabSpec,
    pub run_dir: PathBuf,
    pub netns: Vec<String>,
    pub bpffs: PathBuf,
    pub bpffs_mounted: bool,
    pub cilium_config: PathBuf,
    pub procs: Vec<Proc>,
    pub devices: Vec<String>,
    pub lxc: Vec<(String, u16)>,
    pub attachments: Vec<Attachment>,
    pub host_endpoint: u16,
    pub ready: bool,
    /// Set once a per-node override was given: from then on every restart attaches the host
    /// devices' programs as the effective configuration (ConfigMap + overrides) says.
    #[serde(default)]
    pub follows_config: bool,
}

/// A lab handle. Dropping it does nothing; call [`Lab::down`] (tests use [`LabGuard`]).
pub struct Lab {
    pub state: LabState,
}

/// Takes a lab down when dropped, also while a test panics.
pub type LabGuard = fixture::Guard<Lab>;

impl fixture::Fixture for Lab {
    const KIND: &'static str = "lab";
    fn prefix(&self) -> &str {
        &self.state.spec.prefix
    }
    fn down(&mut self) -> Result<()> {
        Lab::down(self)
    }
}

impl Lab {
    pub fn state_file(run_dir: &Path) -> PathBuf {
        run_dir.join("state.json")
    }

    fn save(&self) -> Result<()> {
        fixture::save(&Self::state_file(&self.state.run_dir), &self.state)
    }

    /// Opens the state of a running lab.
    pub fn open(prefix: &str) -> Result<Lab> {
        validate_prefix(prefix)?;
        Ok(Lab {
            state: fixture::read("lab", prefix, "state.json")?,
        })
    }

    /// All labs with a state file.
    pub fn list() -> Vec<String> {
        fixture::list("state.json")
    }

    pub fn node_ns(&self) -> String {
        format!("{}-node", self.state.spec.prefix)
    }
    pub fn fabric_ns(&self) -> String {
        format!("{}-fabric", self.state.spec.prefix)
    }

    /// Builds a lab. On any error, what was created so far is removed again.
    pub fn up(spec: LabSpec) -> Result<Lab> {
        check_root()?;
        datapath::require_object()?;
        validate_prefix(&spec.prefix)?;
        if prefix_in_use(&spec.prefix) {
            bail!("lab prefix {:?} is already in use (see `cargo xtask lab status`; remove it with `cargo xtask lab down --prefix {}`)", spec.prefix, spec.prefix);
        }
        if spec.features.l2_announcements && !spec.features.kube_proxy_replacement {
            bail!("L2 announcements need kube-proxy replacement (Cilium's documented prerequisite): turn L2 announcements off too (--no-l2)");
        }
        if spec.pods > 5000 {
            bail!("--pods {} is more than the lab supports (5000)", spec.pods);
        }
        let run_dir = Path::new(RUN_ROOT).join(&spec.prefix);
        std::fs::create_dir_all(&run_dir)
            .with_context(|| format!("create {}", run_dir.display()))?;
        let mut lab = Lab {
            state: LabState {
                bpffs: run_dir.join("bpffs"),
                cilium_config: run_dir.join("cilium-config"),
                run_dir,
                spec,
                netns: vec![],
                bpffs_mounted: false,
                procs: vec![],
                devices: vec!["eth0".into(), "eth1".into()],
                lxc: vec![],
                attachments: vec![],
                host_endpoint: 1,
                ready: false,
                follows_config: false,
            },
        };
        lab.save()?;
        match lab.build() {
            Ok(()) => Ok(lab),
            Err(e) => {
                if let Err(d) = lab.down() {
                    eprintln!(
                        "lab {}: cleanup after a failed up also failed: {d:#}",
                        lab.state.spec.prefix
                    );
                }
                Err(e)
            }
        }
    }

    /// The CA certificate the gateway's TLS certificate leads to.
    pub fn gateway_ca(&self) -> PathBuf {
        self.state.run_dir.join("services/lab-ca.pem")
    }

    /// What a script needs to use the lab (`lab status --format json`).
    pub fn status(&self) -> serde_json::Value {
        let s = &self.state;
        serde_json::json!({
            "prefix": s.spec.prefix,
            "ready": s.ready,
            "node_netns": self.node_ns(),
            "node_netns_path": netns::netns_path(&self.node_ns()),
            "fabric_netns": self.fabric_ns(),
            "bpffs": s.bpffs,
            "cilium_config": s.cilium_config,
            "profile": s.spec.profile,
            "attach": s.spec.attach,
            "xdp": s.spec.xdp,
            "features": s.spec.features,
            "devices": s.devices,
            "lxc": s.lxc.iter().map(|l| &l.0).collect::<Vec<_>>(),
            "vips": {
                "gateway": {"address": GATEWAY_VIP, "port": GATEWAY_PORT, "probe": "http", "path": "/healthz"},
                "dns": {"address": DNS_VIP, "port": DNS_PORT, "probe": "dns", "names": [format!("gateway.{DNS_ZONE}"), format!("dns.{DNS_ZONE}")]},
            },
            "stepguard_config": self.stepguard_config(),
            "programs": s.attachments,
            "processes": s.procs,
        })
    }

    /// A new host device (veth into the fabric) that the datapath attaches to, as when a node
    /// gains a NIC matching Cilium's selection: `cil_from_netdev`/`cil_to_netdev` on it.
    pub fn add_host_device(&mut self, name: &str) -> Result<()> {
        check_root()?;
        if name.is_empty() || name.len() > 15 || self.state.devices.iter().any(|d| d == name) {
            bail!("invalid or existing device name {name:?}");
        }
        let node = self.node_ns();
        let peer = format!("fab{}", self.state.devices.len());
        netns::add_veth(&node, name, &self.fabric_ns(), &peer)?;
        netns::add_addr(
            &node,
            name,
            &format!("203.0.113.{}/32", 10 + self.state.devices.len()),
        )?;
        self.state.devices.push(name.to_string());
        self.save()?;
        let plan = datapath::plan(&[name.to_string()], &[], self.plan_opts(false));
        let atts = datapath::attach_all(&node, &self.state.bpffs, self.state.spec.attach, &plan)?;
        self.state.attachments.extend(atts);
        self.save()
    }

    /// Removes everything this lab recorded. Safe to call twice and after a crash.
    pub fn down(&mut self) -> Result<()> {
        let mut errors = Vec::new();
        for p in std::mem::take(&mut self.state.procs) {
            process::stop(&p);
        }
        for ns in self.state.netns.iter().rev() {
            if let Err(e) = netns::del_netns(ns) {
                errors.push(format!("{e:#}"));
            }
        }
        if self.state.bpffs_mounted && is_mountpoint(&self.state.bpffs) {
            if let Err(e) = netns::run("umount", &[&self.state.bpffs.to_string_lossy()]) {
                errors.push(format!("{e:#}"));
            }
        }
        if errors.is_empty() {
            if let Err(e) = std::fs::remove_dir_all(&self.state.run_dir) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    errors.push(format!("remove {}: {e}", self.state.run_dir.display()));
                }
            }
            self.state.ready = false;
            Ok(())
        } else {
            bail!("lab {} down: {}", self.state.spec.prefix, errors.join("; "))
        }
    }
}

fn is_mountpoint(p: &Path) -> bool {
    let target = match std::fs::canonicalize(p) {
        Ok(t) => t,
        Err(_) => return false,
    };
    std::fs::read_to_string("/proc/self/mountinfo")
        .map(|m| {
            m.lines()
                .any(|l| l.split_whitespace().nth(4) == Some(&*target.to_string_lossy()))
        })
        .unwrap_or(false)
}
