//! The lab: a simulated Cilium node in network namespaces, faithful to `shared/cilium-facts.md`,
//! used by stepguard's demo, integration tests and benchmarks.
//!
//! One lab = one unique name prefix. Everything it creates (namespaces, a private bpffs mount,
//! servers, files) is recorded in `/run/stepguard-lab/<prefix>/state.json` *before* it is
//! created, so `down` removes exactly that, even after the creating process crashed.
pub mod ciliumconfig;
pub mod datapath;
pub mod kube;
pub mod kubelet;
pub mod lan;
pub mod maps;
pub mod netns;
pub mod services;
pub mod sys;

use anyhow::{bail, Context, Result};
pub use datapath::{AttachMode, Attachment, Hook};
pub use maps::{Capacity, Features, Profile};
use serde::{Deserialize, Serialize};
use services::Proc;
use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub const RUN_ROOT: &str = "/run/stepguard-lab";
pub const GATEWAY_VIP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 10);
pub const GATEWAY_PORT: u16 = 80;
/// The gateway's TLS port (nginx; a certificate for `gateway.<DNS_ZONE>` signed by the lab's
/// CA, [`Lab::gateway_ca`]).
pub const GATEWAY_TLS_PORT: u16 = 443;
pub const DNS_VIP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 53);
pub const DNS_PORT: u16 = 53;
pub const DNS_ZONE: &str = "lab.stepguard.test";
const NODE_ETH0: &str = "192.0.2.1";
const FABRIC_ETH0: &str = "192.0.2.254";
const NODE_ETH1: &str = "203.0.113.1";
const FABRIC_ETH1: &str = "203.0.113.254";
const CILIUM_HOST_IP: &str = "169.254.100.1";
/// Cilium's VXLAN overlay device (tunnel routing mode).
const OVERLAY: &str = "cilium_vxlan";

/// What to build.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LabSpec {
    pub prefix: String,
    pub profile: Profile,
    pub attach: AttachMode,
    pub xdp: bool,
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

/// Node `index`'s pod CIDR is `169.254.<101 + 20 * index>.0/24` (a single-node lab is node 0).
pub fn pod_cidr(index: u8) -> String {
    format!("169.254.{}.0/24", 101 + 20 * index as u32)
}

/// Node `index`'s health endpoint (Cilium's `cilium-health` endpoint: an address from the
/// node's pod CIDR, answering HTTP on 4240), the first address of its pod CIDR.
pub fn health_ip(index: u8) -> Ipv4Addr {
    Ipv4Addr::new(169, 254, 101 + 20 * index, 1)
}

/// Pod `i`'s address on node `index`.
pub fn pod_addr(index: u8, i: u32) -> Ipv4Addr {
    Ipv4Addr::from(pod_ip(index, i))
}

/// The port Cilium's health endpoint answers on (`/hello`).
pub const HEALTH_PORT: u16 = 4240;

/// Node `index`'s address on the overlay device (the peers' routes point at it).
fn overlay_ip(index: u8) -> Ipv4Addr {
    Ipv4Addr::new(169, 254, 200, 1 + index)
}

impl LabSpec {
    pub fn new(prefix: impl Into<String>) -> Self {
        Self {
            prefix: prefix.into(),
            profile: Profile::V1_18,
            attach: AttachMode::Tcx,
            xdp: false,
            pods: 3,
            features: Features {
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
pub struct LabGuard(pub Lab);

impl Drop for LabGuard {
    fn drop(&mut self) {
        if let Err(e) = self.0.down() {
            eprintln!("lab {}: down failed: {e:#}", self.0.state.spec.prefix);
        }
    }
}

impl std::ops::Deref for LabGuard {
    type Target = Lab;
    fn deref(&self) -> &Lab {
        &self.0
    }
}
impl std::ops::DerefMut for LabGuard {
    fn deref_mut(&mut self) -> &mut Lab {
        &mut self.0
    }
}

pub fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos()
}

fn lxc_name(prefix: &str, i: u32) -> String {
    // Cilium names host-side veths `lxc` + 11 hex characters of a hash.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in prefix.bytes().chain(i.to_le_bytes()) {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    format!("lxc{:011x}", h & 0xfff_ffff_ffff)
}

fn pod_ip(node: u8, i: u32) -> [u8; 4] {
    [
        169,
        254,
        (101 + 20 * node as u32 + i / 250) as u8,
        (i % 250 + 2) as u8,
    ]
}

pub fn check_root() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the lab needs root (network namespaces, bpffs mounts, eBPF): run it as root, e.g. `sudo -E cargo xtask lab up`");
    }
    Ok(())
}

fn validate_prefix(p: &str) -> Result<()> {
    if p.is_empty()
        || p.len() > 16
        || !p
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    {
        bail!("invalid lab prefix {p:?}: use 1-16 lowercase letters or digits");
    }
    Ok(())
}

impl Lab {
    pub fn state_file(run_dir: &Path) -> PathBuf {
        run_dir.join("state.json")
    }

    fn save(&self) -> Result<()> {
        let path = Self::state_file(&self.state.run_dir);
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(&self.state)?)
            .with_context(|| format!("write {}", tmp.display()))?;
        std::fs::rename(&tmp, &path).with_context(|| format!("write {}", path.display()))
    }

    /// Opens the state of a running lab.
    pub fn open(prefix: &str) -> Result<Lab> {
        validate_prefix(prefix)?;
        let path = Self::state_file(&Path::new(RUN_ROOT).join(prefix));
        let data = std::fs::read(&path)
            .with_context(|| format!("no lab {prefix:?} (read {})", path.display()))?;
        let state =
            serde_json::from_slice(&data).with_context(|| format!("parse {}", path.display()))?;
        Ok(Lab { state })
    }

    /// All labs with a state file.
    pub fn list() -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(RUN_ROOT)
            .map(|rd| {
                rd.flatten()
                    .filter(|e| Self::state_file(&e.path()).exists())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
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

    fn build(&mut self) -> Result<()> {
        let p = self.state.spec.prefix.clone();
        let node = self.node_ns();
        let fabric = self.fabric_ns();
        // Namespaces: recorded first, then made.
        let pods: Vec<String> = (0..self.state.spec.pods)
            .map(|i| format!("{p}-pod{i}"))
            .collect();
        self.state.netns = [node.clone(), fabric.clone()]
            .into_iter()
            .chain(pods.iter().cloned())
            .collect();
        self.save()?;
        for ns in [&node, &fabric] {
            netns::add_netns(ns)?;
        }
        let mut batch = String::new();
        for ns in &pods {
            batch.push_str(&format!("netns add {ns}\n"));
        }
        self.ip_batch(None, &batch)?;

        // Host devices: eth0/eth1 are veths into the fabric, which holds the VIPs.
        netns::add_veth(&node, "eth0", &fabric, "fab0")?;
        netns::add_addr(&node, "eth0", &format!("{NODE_ETH0}/24"))?;
        netns::add_addr(&fabric, "fab0", &format!("{FABRIC_ETH0}/24"))?;
        match self.state.spec.lan.clone() {
            None => {
                netns::add_veth(&node, "eth1", &fabric, "fab1")?;
                netns::add_addr(&node, "eth1", &format!("{NODE_ETH1}/24"))?;
                netns::add_addr(&fabric, "fab1", &format!("{FABRIC_ETH1}/24"))?;
            }
            Some(port) => {
                // eth1 is this node's NIC on the shared LAN; ARP is answered only for
                // addresses on the NIC itself (the L2-announced VIPs), see `lan`.
                let peer = format!("n{}", port.index);
                netns::add_veth(&node, "eth1", &port.ns, &peer)?;
                netns::ip(&port.ns, &["link", "set", &peer, "master", "br0"])?;
                netns::add_addr(&node, "eth1", &format!("{}/24", lan::node_addr(port.index)))?;
                netns::sysctl(
                    &node,
                    &[
                        "net.ipv4.conf.all.arp_ignore=1",
                        "net.ipv4.conf.eth1.arp_ignore=1",
                    ],
                )?;
            }
        }
        for vip in [GATEWAY_VIP, DNS_VIP] {
            netns::add_addr(&fabric, "lo", &format!("{vip}/32"))?;
        }
        netns::ip(
            &node,
            &[
                "route",
                "add",
                "198.51.100.0/24",
                "via",
                FABRIC_ETH0,
                "dev",
                "eth0",
            ],
        )?;
        // Default routes through both NICs (Cilium does not auto-detect a veth without one).
        self.ip_batch(
            Some(&node),
            &format!(
                "route add default via {FABRIC_ETH0} dev eth0 metric 100\nroute add default via {} dev eth1 metric 200\n",
                if self.state.spec.lan.is_some() { lan::LAN_ROUTER } else { FABRIC_ETH1 }
            ),
        )?;
        // cilium_host/cilium_net are a veth pair in Cilium too.
        netns::ip(
            &node,
            &[
                "link",
                "add",
                "cilium_host",
                "type",
                "veth",
                "peer",
                "name",
                "cilium_net",
            ],
        )?;
        netns::ip(&node, &["link", "set", "cilium_host", "up"])?;
        let peers = self.overlay_peers();
        if self.state.spec.features.tunnel {
            // The overlay device, as Cilium creates it in tunnel mode (VXLAN, port 8472).
            // Cilium's is `external` (its programs set the tunnel key per packet); a LAN lab
            // whose nodes reach each other's pods uses the kernel's own VXLAN forwarding
            // instead (a VNI, the node's LAN address, one flood entry per peer), since the
            // lab's programs do not route.
            if peers.is_empty() {
                netns::ip(
                    &node,
                    &[
                        "link", "add", OVERLAY, "type", "vxlan", "external", "dstport", "8472",
                    ],
                )?;
            } else {
                let local = lan::node_addr(self.node_index()).to_string();
                netns::ip(
                    &node,
                    &[
                        "link",
                        "add",
                        OVERLAY,
                        "type",
                        "vxlan",
                        "id",
                        "2",
                        "dstport",
                        "8472",
                        "local",
                        &local,
                        "dev",
                        "eth1",
                        "nolearning",
                    ],
                )?;
            }
            netns::ip(&node, &["link", "set", OVERLAY, "up"])?;
        } else if !peers.is_empty() {
            bail!("an overlay between LAN nodes needs tunnel routing");
        }
        netns::ip(&node, &["link", "set", "cilium_net", "up"])?;
        netns::add_addr(&node, "cilium_host", &format!("{CILIUM_HOST_IP}/32"))?;

        // Pods: lxc veths into their own namespaces, with a /32 route each (as Cilium does).
        let mut node_batch = String::new();
        let mut lxc = Vec::new();
        for (i, ns) in pods.iter().enumerate() {
            let name = lxc_name(&p, i as u32);
            let ip = Ipv4Addr::from(pod_ip(self.node_index(), i as u32));
            node_batch.push_str(&format!("link add {name} type veth peer name eth0 netns {ns}\nlink set {name} up\nroute add {ip}/32 dev {name}\n"));
            lxc.push((name, 1000 + i as u16));
        }
        if !peers.is_empty() {
            // Cilium's health endpoint (`lxc_health`, an address from the pod CIDR).
            let health = self.health_ns();
            self.state.netns.push(health.clone());
            self.save()?;
            netns::add_netns(&health)?;
            let ip = health_ip(self.node_index());
            node_batch.push_str(&format!(
                "link add lxc_health type veth peer name eth0 netns {health}
link set lxc_health up
route add {ip}/32 dev lxc_health
"
            ));
            lxc.push(("lxc_health".to_string(), HEALTH_ENDPOINT_ID));
        }
        self.ip_batch(Some(&node), &node_batch)?;
        if !peers.is_empty() {
            self.build_overlay(&peers)?;
        }
        for (i, ns) in pods.iter().enumerate() {
            let ip = Ipv4Addr::from(pod_ip(self.node_index(), i as u32));
            if peers.is_empty() {
                self.ip_batch(
                    Some(ns),
                    &format!("link set eth0 up\naddr add {ip}/32 dev eth0\n"),
                )?;
            } else {
                // Reachable from the other nodes' pods over the overlay.
                self.endpoint_routes(ns, &lxc_name(&p, i as u32), ip)?;
            }
        }
        self.state.lxc = lxc;
        self.save()?;

        // Private bpffs, outside /sys.
        std::fs::create_dir_all(&self.state.bpffs)?;
        self.state.bpffs_mounted = true;
        self.save()?;
        netns::run(
            "mount",
            &["-t", "bpf", "bpffs", &self.state.bpffs.to_string_lossy()],
        )?;
        std::fs::create_dir_all(maps::globals_dir(&self.state.bpffs))?;
        std::fs::create_dir_all(self.state.bpffs.join("stepguard-lab"))?;

        self.create_maps()?;
        self.write_cilium_config()?;

        let plan = datapath::plan(&self.state.devices, &self.state.lxc, self.plan_opts(true));
        self.state.attachments =
            datapath::attach_all(&node, &self.state.bpffs, self.state.spec.attach, &plan)?;
        self.create_tail_call_maps()?;
        self.save()?;

        self.start_services()?;
        if !peers.is_empty() {
            let dir = self.state.run_dir.join("services-health");
            std::fs::create_dir_all(&dir)?;
            let ip = health_ip(self.node_index()).to_string();
            let p = services::start_nginx(&self.health_ns(), &dir, &ip, HEALTH_PORT, None)?;
            self.state.procs.push(p);
            self.save()?;
        }
        self.write_stepguard_config()?;
        self.state.ready = true;
        self.save()
    }

    /// This node's index on a LAN (0 for a single-node lab).
    fn node_index(&self) -> u8 {
        self.state.spec.lan.as_ref().map_or(0, |l| l.index)
    }

    fn overlay_peers(&self) -> Vec<u8> {
        self.state
            .spec
            .lan
            .as_ref()
            .map(|l| l.peers.clone())
            .unwrap_or_default()
    }

    /// The namespace of this node's health endpoint (LAN labs with an overlay).
    pub fn health_ns(&self) -> String {
        format!("{}-health", self.state.spec.prefix)
    }

    /// The overlay between LAN nodes: an address on `cilium_vxlan`, a flood entry and a route
    /// to the pod CIDR of every peer; the node forwards; the health endpoint's namespace
    /// routes through `cilium_host`'s address (a permanent neighbour: the host side's MAC).
    fn build_overlay(&self, peers: &[u8]) -> Result<()> {
        let node = self.node_ns();
        let me = self.node_index();
        netns::add_addr(&node, OVERLAY, &format!("{}/24", overlay_ip(me)))?;
        for j in peers {
            self.tunnel_entry("append", *j)?;
            netns::ip(
                &node,
                &[
                    "route",
                    "add",
                    &pod_cidr(*j),
                    "via",
                    &overlay_ip(*j).to_string(),
                    "dev",
                    OVERLAY,
                ],
            )?;
        }
        netns::sysctl(&node, &["net.ipv4.ip_forward=1"])?;
        self.endpoint_routes(&self.health_ns(), "lxc_health", health_ip(me))
    }

    /// An endpoint namespace's `eth0` with its address and a default route through
    /// `cilium_host`'s address, a permanent neighbour for it (the host side's MAC: Cilium's
    /// datapath answers that ARP), so the endpoint answers traffic from other nodes.
    fn endpoint_routes(&self, ns: &str, host_dev: &str, ip: Ipv4Addr) -> Result<()> {
        let link = netns::ip(&self.node_ns(), &["-o", "link", "show", "dev", host_dev])?;
        let mac = link
            .split("link/ether ")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .with_context(|| format!("{host_dev} has no MAC address"))?
            .to_string();
        self.ip_batch(
            Some(ns),
            &format!(
                "link set lo up
link set eth0 up
addr add {ip}/32 dev eth0
route add {CILIUM_HOST_IP} dev eth0 scope link
route add default via {CILIUM_HOST_IP} dev eth0
neigh add {CILIUM_HOST_IP} lladdr {mac} dev eth0 nud permanent
"
            ),
        )
    }

    /// The overlay fault: this node's tunnel entries to its peers are gone (as when the
    /// agent comes back without the other nodes' tunnel endpoints), so nothing reaches
    /// another node's pods from here, nor their answers back.
    fn break_overlay(&self) -> Result<()> {
        let peers = self.overlay_peers();
        if peers.is_empty() {
            bail!("--break-overlay: this lab has no overlay between nodes (a LAN lab with --east-west)");
        }
        for j in peers {
            self.tunnel_entry("del", j)?;
        }
        Ok(())
    }

    /// Adds (`append`) or deletes (`del`) the overlay's flood entry towards node `peer`.
    fn tunnel_entry(&self, op: &str, peer: u8) -> Result<()> {
        let dst = lan::node_addr(peer).to_string();
        netns::run(
            "bridge",
            &[
                "-n",
                &self.node_ns(),
                "fdb",
                op,
                "00:00:00:00:00:00",
                "dev",
                OVERLAY,
                "dst",
                &dst,
            ],
        )
        .map(|_| ())
    }

    fn plan_opts(&self, host: bool) -> datapath::PlanOpts {
        let s = &self.state.spec;
        datapath::PlanOpts {
            xdp: s.xdp,
            to_netdev: s.features.devices_required(),
            host,
            overlay: s.features.tunnel.then_some(OVERLAY),
        }
    }

    fn ip_batch(&self, ns: Option<&str>, cmds: &str) -> Result<()> {
        if cmds.is_empty() {
            return Ok(());
        }
        let file = self.state.run_dir.join("ip-batch");
        std::fs::write(&file, cmds)?;
        let f = file.to_string_lossy().into_owned();
        let r = match ns {
            Some(ns) => netns::run("ip", &["-n", ns, "-batch", &f]),
            None => netns::run("ip", &["-batch", &f]),
        };
        let _ = std::fs::remove_file(&file);
        r.map(|_| ())
    }

    /// What the maps are filled with: pod IPs, node IPs, VIPs.
    #[allow(clippy::type_complexity)]
    fn fact_data(&self) -> (Vec<[u8; 4]>, [[u8; 4]; 2], [([u8; 4], u16); 2]) {
        (
            (0..self.state.spec.pods)
                .map(|i| pod_ip(self.node_index(), i))
                // The health endpoint is an endpoint like the pods (in cilium_lxc).
                .chain(
                    (!self.overlay_peers().is_empty())
                        .then(|| health_ip(self.node_index()).octets()),
                )
                .collect(),
            [[192, 0, 2, 1], [203, 0, 113, 1]],
            [
                (GATEWAY_VIP.octets(), GATEWAY_PORT),
                (DNS_VIP.octets(), DNS_PORT),
            ],
        )
    }

    fn facts_and_create(&self, only: Option<&str>) -> Result<()> {
        let (pod_ips, node_ips, vips) = self.fact_data();
        let facts = maps::NodeFacts {
            pod_ips: &pod_ips,
            node_ips: &node_ips,
            vips: &vips,
        };
        let s = &self.state.spec;
        for m in maps::global_maps(s.profile, s.features, s.capacity) {
            if only.is_some_and(|o| o != m.name) {
                continue;
            }
            let fd = maps::create_pinned(&self.state.bpffs, &m)?;
            maps::populate(&fd, &m, &facts, s.ct_fill)?;
        }
        Ok(())
    }

    /// The lab agent's runtime directory (Cilium's `/var/run/cilium`).
    pub fn agent_run_dir(&self) -> PathBuf {
        self.state.run_dir.join("cilium-run")
    }

    /// The lab agent's API socket (Cilium's `/var/run/cilium/cilium.sock`).
    pub fn agent_socket(&self) -> PathBuf {
        self.agent_run_dir().join("cilium.sock")
    }

    fn agent_settings(&self) -> PathBuf {
        self.agent_run_dir().join("loaded-settings.json")
    }

    /// The lab's agent (re)starts: it loads the cilium-config as it is now, with the per-node
    /// overrides (Cilium: `cilium-dbg build-config` merges the ConfigMap and matching
    /// CiliumNodeConfigs, later sources winning, and records `config-sources`).
    fn load_agent_config(&self) -> Result<()> {
        let mut values = self.effective_config(true)?;
        let mut sources = vec!["config-map:kube-system/cilium-config".to_string()];
        if !self.state.spec.node_overrides.is_empty() {
            sources.push("cilium-node-config:kube-system/lab-node".into());
        }
        values.insert("config-sources".into(), sources.join(","));
        std::fs::create_dir_all(self.agent_run_dir())?;
        std::fs::write(
            services::agent_endpoints_file(&self.agent_settings()),
            self.state.lxc.len().to_string(),
        )?;
        std::fs::write(self.agent_settings(), serde_json::to_vec(&values)?)
            .context("write the lab agent's loaded settings")
    }

    /// The configuration the agent builds at its start: the mounted ConfigMap, with the
    /// per-node overrides on top when `with_overrides`.
    pub fn effective_config(&self, with_overrides: bool) -> Result<BTreeMap<String, String>> {
        let mut values = ciliumconfig::read(&self.state.cilium_config)?;
        if with_overrides {
            for (k, v) in &self.state.spec.node_overrides {
                values.insert(k.clone(), v.clone());
            }
        }
        Ok(values)
    }

    /// The host-device programs a configuration asks for (Cilium's loader: `cil_from_netdev`
    /// on every selected device, `cil_to_netdev` when devices are required, `cil_xdp_entry`
    /// with `bpf-lb-acceleration`), over the lab's devices.
    fn host_plan(&self, cfg: &BTreeMap<String, String>, dropped: Option<&str>) -> datapath::Plan {
        let patterns: Vec<&str> = cfg
            .get("devices")
            .map(|d| d.split([' ', ',']).filter(|p| !p.is_empty()).collect())
            .unwrap_or_default();
        let selected: Vec<String> = self
            .state
            .devices
            .iter()
            .filter(|d| Some(d.as_str()) != dropped)
            .filter(|d| {
                patterns.is_empty()
                    || patterns.iter().any(|p| match p.strip_suffix('+') {
                        Some(prefix) => d.starts_with(prefix),
                        None => d == p,
                    })
            })
            .cloned()
            .collect();
        let xdp = cfg
            .get("bpf-lb-acceleration")
            .is_some_and(|v| v != "disabled" && !v.is_empty());
        datapath::plan(
            &selected,
            &[],
            datapath::PlanOpts {
                xdp,
                to_netdev: maps::devices_required_by(cfg),
                host: false,
                overlay: None,
            },
        )
    }

    /// After a restart's reload: the host devices carry what `cfg` asks for — programs it no
    /// longer asks for detached, new ones attached.
    /// `dropped`: the `--drop-device` fault's device stays without programs.
    fn follow_config(
        &mut self,
        cfg: &BTreeMap<String, String>,
        dropped: Option<&str>,
    ) -> Result<()> {
        let want = self.host_plan(cfg, dropped);
        let host_prog =
            |p: &str| matches!(p, "cil_from_netdev" | "cil_to_netdev" | "cil_xdp_entry");
        let (keep, gone): (Vec<Attachment>, Vec<Attachment>) =
            self.state.attachments.iter().cloned().partition(|a| {
                !(self.state.devices.contains(&a.device) && host_prog(&a.program))
                    || want
                        .iter()
                        .any(|w| w.0 == a.device && w.1 == a.program && w.2 == a.hook)
            });
        let missing: datapath::Plan = want
            .into_iter()
            .filter(|w| {
                !keep
                    .iter()
                    .any(|a| a.device == w.0 && a.program == w.1 && a.hook == w.2)
            })
            .collect();
        datapath::detach(&self.node_ns(), &gone)?;
        let added = datapath::attach_all(
            &self.node_ns(),
            &self.state.bpffs,
            self.state.spec.attach,
            &missing,
        )?;
        self.state.attachments = keep.into_iter().chain(added).collect();
        self.save()
    }

    /// The maps of an agent coming back as `to`. An upgrade unpins the global maps the new
    /// version no longer has (1.18 unpins the tunnel map, the v1 node map and the v1 ipcache
    /// it migrates from); a downgrade leaves the newer version's pins alone (Cilium removes
    /// only pins it knows: a 1.17 agent after 1.18 keeps `cilium_ipcache_v2` and
    /// `cilium_policystats` pinned, unused). New maps are created and filled; per-endpoint
    /// policy maps follow the new name prefix (renamed on an upgrade, created beside the
    /// newer ones on a downgrade).
    fn upgrade_maps(&mut self, to: Profile) -> Result<()> {
        let s = &self.state.spec;
        let old: Vec<maps::MapSpec> = maps::global_maps(s.profile, s.features, s.capacity);
        let new: Vec<maps::MapSpec> = maps::global_maps(to, s.features, s.capacity);
        let globals = maps::globals_dir(&self.state.bpffs);
        let downgrade = (to as u8) < (s.profile as u8);
        if !downgrade {
            for m in old.iter().filter(|m| !new.iter().any(|n| n.name == m.name)) {
                let _ = std::fs::remove_file(globals.join(&m.name));
            }
        }
        let from = s.profile;
        self.state.spec.profile = to;
        for m in new.iter().filter(|m| !old.iter().any(|o| o.name == m.name)) {
            self.facts_and_create(Some(&m.name))?;
        }
        // Per-endpoint policy maps renamed by the new version: the old pins go.
        let eps: Vec<u16> = self
            .state
            .lxc
            .iter()
            .map(|l| l.1)
            .chain([self.state.host_endpoint])
            .collect();
        for ep in eps {
            let (a, b) = (
                maps::policy_map_name(from, ep),
                maps::policy_map_name(to, ep),
            );
            if a != b && globals.join(&a).exists() {
                if downgrade {
                    self.create_policy_map(ep)?;
                } else {
                    let _ = std::fs::rename(globals.join(&a), globals.join(&b));
                }
            }
        }
        self.save()
    }

    /// Recreates a global map with twice its max entries (a new id), refilled, as Cilium does
    /// when a map's properties change between versions or configurations.
    fn resize_map(&self, name: &str) -> Result<()> {
        let s = &self.state.spec;
        let Some(mut spec) = maps::global_maps(s.profile, s.features, s.capacity)
            .into_iter()
            .find(|m| m.name == name)
        else {
            bail!("--resize-map {name}: not a global map of this lab");
        };
        spec.max_entries *= 2;
        let fd = maps::create_pinned(&self.state.bpffs, &spec)?;
        let (pod_ips, node_ips, vips) = self.fact_data();
        let facts = maps::NodeFacts {
            pod_ips: &pod_ips,
            node_ips: &node_ips,
            vips: &vips,
        };
        maps::populate(&fd, &spec, &facts, s.ct_fill).map(|_| ())
    }

    /// Replaces the pinned ipcache with a new, empty map (new id).
    fn recreate_ipcache(&self) -> Result<()> {
        match self.global_map_like("cilium_ipcache") {
            Some(spec) => maps::create_pinned(&self.state.bpffs, &spec).map(|_| ()),
            None => Ok(()),
        }
    }

    fn global_map_like(&self, prefix: &str) -> Option<maps::MapSpec> {
        let s = &self.state.spec;
        maps::global_maps(s.profile, s.features, s.capacity)
            .into_iter()
            .find(|m| m.name.starts_with(prefix))
    }

    /// Fills the pinned map (as it is now) with the lab's facts.
    fn fill_map_named_like(&self, prefix: &str) -> Result<()> {
        let Some(spec) = self.global_map_like(prefix) else {
            return Ok(());
        };
        let fd = sys::obj_get(&maps::globals_dir(&self.state.bpffs).join(&spec.name))?;
        let (pod_ips, node_ips, vips) = self.fact_data();
        let facts = maps::NodeFacts {
            pod_ips: &pod_ips,
            node_ips: &node_ips,
            vips: &vips,
        };
        maps::populate(&fd, &spec, &facts, self.state.spec.ct_fill).map(|_| ())
    }

    /// The endpoint's policy map under the lab version's name, with one entry.
    fn create_policy_map(&self, ep: u16) -> Result<()> {
        let s = &self.state.spec;
        let policy = maps::MapSpec {
            name: maps::policy_map_name(s.profile, ep),
            map_type: if s.profile == Profile::V1_20 {
                maps::LPM_TRIE
            } else {
                maps::HASH
            },
            key_size: 12,
            value_size: 8,
            max_entries: 16384,
            flags: if s.profile == Profile::V1_20 {
                sys::BPF_F_NO_PREALLOC
            } else {
                0
            },
        };
        let fd = maps::create_pinned(&self.state.bpffs, &policy)?;
        let mut k = vec![0u8; 12];
        if s.profile == Profile::V1_20 {
            k[..4].copy_from_slice(&64u32.to_ne_bytes());
        }
        sys::map_update(&fd, &k, &[0u8; 8]).with_context(|| format!("write {}", policy.name))
    }

    fn create_maps(&self) -> Result<()> {
        self.facts_and_create(None)?;
        // Per-endpoint maps: policy + tail calls for every pod and the host endpoint.
        let eps = self
            .state
            .lxc
            .iter()
            .map(|l| l.1)
            .chain([self.state.host_endpoint]);
        for ep in eps {
            self.create_policy_map(ep)?;
            let calls = maps::MapSpec {
                name: format!("cilium_calls_{ep:05}"),
                map_type: maps::PROG_ARRAY,
                key_size: 4,
                value_size: 4,
                max_entries: 33,
                flags: 0,
            };
            maps::create_pinned(&self.state.bpffs, &calls)?;
        }
        Ok(())
    }

    /// `cilium_calls_netdev_<ifindex>`, `cilium_calls_hostns_<id>` (and `_xdp_` with XDP):
    /// Cilium re-creates these on every load and replaces the pin after attaching.
    fn create_tail_call_maps(&self) -> Result<()> {
        let node = self.node_ns();
        let mut names = vec![format!(
            "cilium_calls_hostns_{:05}",
            self.state.host_endpoint
        )];
        for d in &self.state.devices {
            if let Ok(idx) = netns::ifindex(&node, d) {
                names.push(format!("cilium_calls_netdev_{idx:05}"));
                if self.state.spec.xdp {
                    names.push(format!("cilium_calls_xdp_{idx:05}"));
                }
            }
        }
        for name in names {
            let m = maps::MapSpec {
                name,
                map_type: maps::PROG_ARRAY,
                key_size: 4,
                value_size: 4,
                max_entries: 33,
                flags: 0,
            };
            maps::create_pinned(&self.state.bpffs, &m)?;
        }
        Ok(())
    }

    fn write_cilium_config(&self) -> Result<()> {
        let s = &self.state.spec;
        let b = |v: bool| {
            if v {
                "true".to_string()
            } else {
                "false".to_string()
            }
        };
        let values: BTreeMap<String, String> = [
            ("cluster-name", "stepguard-lab".to_string()),
            ("devices", self.state.devices.join(" ")),
            ("enable-ipv4", "true".into()),
            ("enable-ipv6", b(s.features.ipv6)),
            (
                "kube-proxy-replacement",
                b(s.features.kube_proxy_replacement),
            ),
            ("enable-l2-announcements", b(s.features.l2_announcements)),
            (
                "routing-mode",
                if s.features.tunnel {
                    "tunnel".into()
                } else {
                    "native".into()
                },
            ),
            ("enable-tcx", b(s.attach == AttachMode::Tcx)),
            (
                "bpf-lb-acceleration",
                if s.xdp {
                    "native".into()
                } else {
                    "disabled".into()
                },
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        ciliumconfig::write(&self.state.cilium_config, &values)
    }

    fn start_services(&mut self) -> Result<()> {
        let dir = self.state.run_dir.join("services");
        std::fs::create_dir_all(&dir)?;
        let fabric = self.fabric_ns();
        let records = [
            (format!("gateway.{DNS_ZONE}"), GATEWAY_VIP.to_string()),
            (format!("dns.{DNS_ZONE}"), DNS_VIP.to_string()),
            (format!("media.{DNS_ZONE}"), "198.51.100.20".to_string()),
        ];
        let p = services::start_dnsmasq(&fabric, &dir, &DNS_VIP.to_string(), &records)?;
        self.state.procs.push(p);
        self.save()?;
        // The gateway also serves TLS on 443, with a certificate of the lab's own CA.
        let (_, cert, key) = services::lab_certificate(&dir, &format!("gateway.{DNS_ZONE}"))?;
        let tls = services::Tls {
            port: GATEWAY_TLS_PORT,
            cert,
            key,
        };
        let p = services::start_nginx(
            &fabric,
            &dir,
            &GATEWAY_VIP.to_string(),
            GATEWAY_PORT,
            Some(&tls),
        )?;
        self.state.procs.push(p);
        self.save()?;
        // The "agent" loads its config at start, as Cilium's does (the init container merges
        // the ConfigMap into what the agent reads); its API tells what it loaded.
        self.load_agent_config()?;
        std::fs::create_dir_all(self.agent_run_dir())?;
        self.start_agent_api()?;
        // Ready means reachable from the node namespace, through eth0 and the fake datapath.
        let node = self.node_ns();
        services::wait_until("gateway VIP (nginx)", Duration::from_secs(10), || {
            netns::in_netns(&node, || {
                std::net::TcpStream::connect_timeout(
                    &(GATEWAY_VIP, GATEWAY_PORT).into(),
                    Duration::from_millis(500),
                )?;
                Ok(())
            })
        })?;
        let node = self.node_ns();
        services::wait_until("DNS VIP (dnsmasq)", Duration::from_secs(10), || {
            let out = netns::run(
                "nsenter",
                &[
                    &format!("--net={}", netns::netns_path(&node).display()),
                    "--",
                    "dig",
                    "+time=1",
                    "+tries=1",
                    "+short",
                    &format!("@{DNS_VIP}"),
                    &format!("gateway.{DNS_ZONE}"),
                ],
            )?;
            if out.trim() == GATEWAY_VIP.to_string() {
                Ok(())
            } else {
                bail!("unexpected answer {out:?}")
            }
        })
    }

    /// A ready stepguard config for this lab (schema: deploy/stepguard.example.yaml).
    fn write_stepguard_config(&self) -> Result<()> {
        let s = &self.state;
        let yaml = format!(
            "# stepguard config for lab {prefix} (written by the lab; run the agent in {node})\n\
             bpffs: {bpffs}\n\
             cilium_config: {cfg}\n\
             cilium_api: {api}\n\
             cilium: auto\n\
             implicit_steps: {{settle: 1s, timeout: 20s}}\n\
             targets:\n\
             \x20 - name: gateway\n    address: {gw}\n    port: {gwp}\n    probe: http\n    path: /healthz\n    expect: 200\n    timeout: 500ms\n\
             \x20 - name: dns\n    address: {dns}\n    port: {dnsp}\n    probe: dns\n    query: gateway.{zone}\n    timeout: 500ms\n\
             dns:\n  resolvers: [\"{dns}:{dnsp}\"]\n  names: [\"gateway.{zone}\", \"dns.{zone}\"]\n",
            prefix = s.spec.prefix,
            node = self.node_ns(),
            bpffs = s.bpffs.display(),
            cfg = s.cilium_config.display(),
            api = self.agent_socket().display(),
            gw = GATEWAY_VIP,
            gwp = GATEWAY_PORT,
            dns = DNS_VIP,
            dnsp = DNS_PORT,
            zone = DNS_ZONE,
        );
        std::fs::write(self.stepguard_config(), yaml).context("write stepguard config")
    }

    pub fn stepguard_config(&self) -> PathBuf {
        self.state.run_dir.join("stepguard.yaml")
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

    /// `lab config set KEY=VALUE...`, the way kubelet updates a mounted ConfigMap.
    pub fn config_set(&self, changes: &[(String, String)]) -> Result<BTreeMap<String, String>> {
        ciliumconfig::set(&self.state.cilium_config, changes)
    }

    /// Simulates a cilium-agent restart; see [`RestartOpts`].
    pub fn restart(&mut self, o: &RestartOpts) -> Result<RestartReport> {
        self.restart_with(o, &mut |_| {})
    }

    /// [`Lab::restart`], calling `on_event` the moment the agent went down and the moment the
    /// new agent started (with that instant, wall clock ns): a LAN lab starts its lease clock
    /// at the first and reconciles the node's L2 responder at the second.
    pub fn restart_with(
        &mut self,
        o: &RestartOpts,
        on_event: &mut dyn FnMut(AgentEvent),
    ) -> Result<RestartReport> {
        check_root()?;
        if !self.state.ready {
            bail!("lab {} is not ready", self.state.spec.prefix);
        }
        if let Some(d) = &o.drop_device {
            if !self.state.attachments.iter().any(|a| &a.device == d) {
                bail!("--drop-device {d}: no lab programs are attached to {d}");
            }
        }
        if let Some(p) = &o.stale {
            if !self.state.attachments.iter().any(|a| &a.program == p) {
                bail!("--stale {p}: no lab device carries {p}");
            }
        }
        if let Some(p) = &o.lose_program {
            if !self.state.attachments.iter().any(|a| &a.program == p) {
                bail!("--lose-program {p}: no lab device carries {p}");
            }
        }
        let globals = maps::globals_dir(&self.state.bpffs);
        for m in [
            &o.lose_map,
            &o.flush_map,
            &o.lose_entries.as_ref().map(|l| l.0.clone()),
        ]
        .into_iter()
        .flatten()
        {
            if !globals.join(m).exists() {
                bail!("no pinned map {m} in {}", globals.display());
            }
        }
        let bpffs = self.state.bpffs.clone();
        let node = self.node_ns();
        let old = self.state.attachments.clone();
        // The host programs are loaded ahead so the swap itself is quick; the endpoints'
        // are loaded when they regenerate, after the host's (bounded fds on big labs).
        let prepared = if o.no_reload {
            None
        } else {
            Some(datapath::prepare(&node, &bpffs, &old, |a| {
                a.endpoint.is_some()
                    || Some(a.device.as_str()) == o.drop_device.as_deref()
                    || Some(a.program.as_str()) == o.stale.as_deref()
            })?)
        };

        // The agent is down: its API socket stops answering (Cilium serves it last at start and
        // closes it at stop); Cilium's pinned links and maps stay and the old programs keep
        // forwarding; only the blackhole fault drops traffic meanwhile.
        self.stop_agent_api();
        let start = now_ns();
        if o.blackhole {
            datapath::set_blackhole(&bpffs, true)?;
        }
        let on = now_ns();
        on_event(AgentEvent::Down(start));
        let mut recreated_at = None;
        let mut phases = Phases::default();
        let result = self.come_back(o, prepared, &old, &mut recreated_at, &mut phases, on_event);
        // Whatever happened, the blackhole is lifted.
        let off = now_ns();
        let lift = if o.blackhole {
            datapath::set_blackhole(&bpffs, false)
        } else {
            Ok(())
        };
        let end = now_ns();
        let new = result?;
        lift?;
        self.state.attachments = new.clone();
        self.save()?;
        if self.state.follows_config && !o.no_reload && !o.keep_config {
            // The agent's datapath follows the configuration it builds at its start (the
            // fault: it ignores the per-node overrides it loaded).
            let cfg = self.effective_config(!o.ignore_override)?;
            self.follow_config(&cfg, o.drop_device.as_deref())?;
        }
        if let Some(p) = &o.lose_program {
            let (gone, kept): (Vec<Attachment>, Vec<Attachment>) = self
                .state
                .attachments
                .iter()
                .cloned()
                .partition(|a| &a.program == p);
            datapath::detach(&node, &gone)?;
            self.state.attachments = kept;
            self.save()?;
        }
        if !o.no_reload {
            self.create_tail_call_maps()?;
            // ipcache is refilled from the agent's state while the endpoints wait their turn.
            if !o.no_refill {
                let since =
                    recreated_at.map_or(Duration::ZERO, |t: std::time::Instant| t.elapsed());
                std::thread::sleep(o.refill_after.saturating_sub(since));
                self.fill_map_named_like("cilium_ipcache")?;
            }
            // Then the endpoints regenerate, each getting new programs (Cilium's
            // regeneration of restored endpoints, after the host endpoint's); the fault
            // holds some back.
            self.regenerate_endpoints(o)?;
            phases.endpoints_regenerated_ns = now_ns();
        }
        if o.break_overlay {
            self.break_overlay()?;
        }
        let new = self.state.attachments.clone();
        if let Some(p) = o.loss {
            self.random_loss(p, o.loss_for)?;
        }
        Ok(RestartReport {
            prefix: self.state.spec.prefix.clone(),
            gap_requested_ns: o.down.as_nanos(),
            blackhole: o.blackhole,
            blackhole_start_ns: start,
            blackhole_on_ns: on,
            blackhole_off_ns: off,
            blackhole_end_ns: end,
            reloaded: !o.no_reload,
            drop_device: o.drop_device.clone(),
            lose_map: o.lose_map.clone(),
            flush_map: o.flush_map.clone(),
            old_programs: old,
            new_programs: new,
            phases,
        })
    }

    /// The agent's start after it was down, in Cilium's order (docs/cilium-fidelity.md,
    /// "Restart order"): the maps are opened or migrated and ipcache is recreated (new id,
    /// empty) before the API serves; the config is loaded; the API serves; the host
    /// endpoint's regeneration replaces the host programs. The endpoints follow (see
    /// [`Lab::regenerate_endpoints`]). Returns the attachments after the host's swap.
    fn come_back(
        &mut self,
        o: &RestartOpts,
        prepared: Option<datapath::Prepared>,
        old: &[Attachment],
        recreated_at: &mut Option<std::time::Instant>,
        phases: &mut Phases,
        on_event: &mut dyn FnMut(AgentEvent),
    ) -> Result<Vec<Attachment>> {
        let globals = maps::globals_dir(&self.state.bpffs);
        std::thread::sleep(o.down);
        // The new agent process starts: its hive's cells start (the L2 responder's first
        // full reconciliation among them), then the maps are opened, and so on below.
        phases.agent_started_ns = now_ns();
        on_event(AgentEvent::Started(phases.agent_started_ns));
        if let Some(m) = &o.lose_map {
            std::fs::remove_file(globals.join(m))
                .with_context(|| format!("remove pinned map {m}"))?;
        }
        if let Some(m) = &o.flush_map {
            let fd = sys::obj_get(&globals.join(m))?;
            maps::flush(&fd, sys::map_key_size(&fd)?)?;
        }
        if let Some((m, n)) = &o.lose_entries {
            let fd = sys::obj_get(&globals.join(m))?;
            let deleted = maps::delete_some(&fd, sys::map_key_size(&fd)?, *n)?;
            if deleted < *n {
                bail!("--lose-entries {m}:{n}: the map had only {deleted} entries");
            }
        }
        if let Some(to) = o.to.filter(|t| *t != self.state.spec.profile) {
            self.upgrade_maps(to)?;
        }
        if let Some(m) = &o.resize_map {
            self.resize_map(m)?;
        }
        let Some(prepared) = prepared else {
            self.start_agent_api()?;
            return Ok(old.to_vec());
        };
        // ipcache is unpinned and created anew (new id) before the API serves; the old
        // programs keep the old map until they are replaced; it is refilled from the
        // agent's state over `refill_after` (the fault leaves it empty).
        self.recreate_ipcache()?;
        *recreated_at = Some(std::time::Instant::now());
        phases.ipcache_recreated_ns = now_ns();
        // The agent loaded its config at its start, before it serves its API again: an
        // answer never carries the previous start's settings.
        if !o.keep_config {
            self.load_agent_config()?;
        }
        self.start_agent_api()?;
        phases.api_serving_ns = now_ns();
        let new = datapath::replace(&self.node_ns(), old, prepared, o.drop_device.as_deref());
        phases.host_replaced_ns = now_ns();
        new
    }

    /// Every endpoint gets new programs after the host's, in batches (as Cilium's
    /// regeneration of restored endpoints does), except those the stall fault holds back:
    /// they keep running their old programs.
    fn regenerate_endpoints(&mut self, o: &RestartOpts) -> Result<()> {
        let stalled: std::collections::BTreeSet<String> = match o.stall_endpoints {
            None => Default::default(),
            Some(n) => self
                .state
                .lxc
                .iter()
                .take(n as usize)
                .map(|l| l.0.clone())
                .collect(),
        };
        let due: Vec<Attachment> = self
            .state
            .attachments
            .iter()
            .filter(|a| a.endpoint.is_some() && !stalled.contains(&a.device))
            .cloned()
            .collect();
        let node = self.node_ns();
        for batch in due.chunks(ENDPOINT_BATCH) {
            let names: std::collections::BTreeSet<(&str, &str)> = batch
                .iter()
                .map(|a| (a.device.as_str(), a.program.as_str()))
                .collect();
            self.state.attachments =
                datapath::replace_shared(&node, &self.state.bpffs, &self.state.attachments, |a| {
                    names.contains(&(a.device.as_str(), a.program.as_str()))
                })?;
            if !o.regenerate_every.is_zero() {
                std::thread::sleep(o.regenerate_every);
            }
        }
        self.save()
    }

    /// Drops packets from the node to the VIPs at random with probability `p` for `d`
    /// (iptables in the node namespace), then removes exactly the rules it added.
    fn random_loss(&self, p: f64, d: Duration) -> Result<()> {
        if !(0.0..=1.0).contains(&p) {
            bail!("--loss {p}: a probability between 0 and 1");
        }
        let ns = netns::netns_path(&self.node_ns());
        let rule = |op: &str, vip: Ipv4Addr| -> Result<()> {
            let prob = format!("{p}");
            let out = std::process::Command::new("nsenter")
                .arg(format!("--net={}", ns.display()))
                .args(["--", "iptables", "-w", op, "OUTPUT", "-d"])
                .arg(vip.to_string())
                .args(["-m", "statistic", "--mode", "random", "--probability"])
                .arg(&prob)
                .args(["-j", "DROP"])
                .output()
                .context("run iptables (apt-get install iptables)")?;
            if !out.status.success() {
                bail!(
                    "iptables {op} OUTPUT -d {vip}: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
            Ok(())
        };
        let vips = [GATEWAY_VIP, DNS_VIP];
        for v in vips {
            rule("-A", v)?;
        }
        std::thread::sleep(d);
        let mut first_err = None;
        for v in vips {
            if let Err(e) = rule("-D", v) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    fn stop_agent_api(&mut self) {
        let (api, rest): (Vec<Proc>, Vec<Proc>) = std::mem::take(&mut self.state.procs)
            .into_iter()
            .partition(|p| p.what == "agent-api");
        self.state.procs = rest;
        for p in api {
            services::stop(&p);
        }
        // A graceful stop closes the listener, which removes the socket file (Go's net
        // package); the restarted agent binds it anew.
        let _ = std::fs::remove_file(self.agent_socket());
    }

    fn start_agent_api(&mut self) -> Result<()> {
        if self.state.procs.iter().any(|p| p.what == "agent-api") {
            return Ok(());
        }
        let dir = self.state.run_dir.join("services");
        // What the agent reports as `cilium-version` (pkg/version: `<release> <git hash>
        // <date> go version <go> <os>/<arch>`): the lab agent's release.
        std::fs::create_dir_all(self.agent_run_dir())?;
        std::fs::write(
            services::agent_version_file(&self.agent_settings()),
            format!(
                "{}.0 0000000 2026-01-01T00:00:00+00:00 go version go1.24.0 linux/amd64",
                self.state.spec.profile
            ),
        )
        .context("write the lab agent's version")?;
        let p = services::start_agent_api(
            &lab_binary()?,
            &self.agent_socket(),
            &self.agent_settings(),
            &dir.join("agent-api.log"),
        )?;
        self.state.procs.push(p);
        self.save()
    }

    /// `lab config override KEY=VALUE...`: a CiliumNodeConfig for this node. Like Cilium's,
    /// it takes effect when the agent next starts (the init container merges it).
    pub fn config_override(&mut self, changes: &[(String, String)]) -> Result<()> {
        ciliumconfig::validate_keys(changes.iter().map(|c| &c.0))?;
        for (k, v) in changes {
            // `KEY=` removes the override (the CiliumNodeConfig loses the key).
            if v.is_empty() {
                self.state.spec.node_overrides.remove(k);
            } else {
                self.state.spec.node_overrides.insert(k.clone(), v.clone());
            }
        }
        self.state.follows_config = true;
        self.save()
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
            services::stop(&p);
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

/// A simulated cilium-agent restart, as Cilium does one: the agent is down for `down` while
/// its pinned links and maps stay and the old programs keep forwarding; then new program
/// instances replace the old ones atomically, the agent reloads its config, recreates ipcache
/// and refills it over `refill_after`. Fault flags change what comes back.
#[derive(Clone, Debug, Default)]
pub struct RestartOpts {
    /// How long the agent is down.
    pub down: Duration,
    /// Fault: the datapath drops all traffic while the agent is down (Cilium's does not; this
    /// is how the lab produces a measurable outage).
    pub blackhole: bool,
    pub no_reload: bool,
    pub drop_device: Option<String>,
    pub lose_map: Option<String>,
    pub flush_map: Option<String>,
    /// Fault: this many entries of the map are deleted while the agent is down.
    pub lose_entries: Option<(String, u32)>,
    /// Fault: after the reload, packets from the node to the VIPs are dropped at random
    /// with this probability (iptables `-m statistic --mode random` in the node namespace),
    /// for `loss_for`: a lossy datapath whose failures are timeouts, not refusals.
    pub loss: Option<f64>,
    pub loss_for: Duration,
    /// Fault: ipcache is recreated (as on every Cilium start) but not refilled.
    pub no_refill: bool,
    /// How long after the new programs are in the recreated ipcache is refilled.
    pub refill_after: Duration,
    /// An upgrade (or downgrade) restart: the agent comes back as this version, with its
    /// maps (those the new version no longer has are unpinned, new ones created and filled).
    pub to: Option<Profile>,
    /// A property change (Cilium's `pkg/bpf` "Removing map to allow for property upgrade"):
    /// this map is recreated with twice its max entries (a new id) and refilled.
    pub resize_map: Option<String>,
    /// Fault: this program (e.g. `cil_xdp_entry`, `cil_from_overlay`) keeps its old instance
    /// on every device while the rest is reloaded.
    pub stale: Option<String>,
    /// Fault: the programs are reloaded but the agent does not read its config again (as when
    /// Cilium reloads the datapath for a device change without restarting).
    pub keep_config: bool,
    /// Fault: this program (e.g. `cil_to_netdev`) is no longer attached anywhere after the
    /// reload.
    pub lose_program: Option<String>,
    /// Fault: the agent loads the per-node overrides but its datapath follows the ConfigMap
    /// alone.
    pub ignore_override: bool,
    /// Fault: endpoint regeneration stalls for this many endpoints (the first ones; all
    /// with the lab's pod count): they keep their old programs after the restart.
    pub stall_endpoints: Option<u32>,
    /// Fault (a LAN lab with an overlay): after the reload this node's tunnel entries to
    /// the other nodes are gone: pods on other nodes are unreachable from here.
    pub break_overlay: bool,
    /// A pause between batches of endpoint regenerations ([`ENDPOINT_BATCH`] each): a
    /// regeneration that takes this long per batch.
    pub regenerate_every: Duration,
}

/// Endpoints regenerated (loaded and swapped in) per batch.
pub const ENDPOINT_BATCH: usize = 50;

/// The lab's health endpoint's id.
const HEALTH_ENDPOINT_ID: u16 = 4094;

/// What really happened, for tests to compare against.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RestartReport {
    pub prefix: String,
    /// How long the agent was asked to be down.
    pub gap_requested_ns: u128,
    /// Whether the datapath dropped traffic while the agent was down (the blackhole fault);
    /// the `blackhole_*` instants bound the agent-down window either way.
    #[serde(default)]
    pub blackhole: bool,
    /// Wall clock (CLOCK_REALTIME, ns since the epoch) just before the blackhole was set.
    pub blackhole_start_ns: u128,
    /// Wall clock just after it was set: the blackhole began in
    /// [`blackhole_start_ns`, `blackhole_on_ns`] (wide only when the lab was preempted).
    #[serde(default)]
    pub blackhole_on_ns: u128,
    /// Wall clock just before it was lifted: it ended in [`blackhole_off_ns`, `blackhole_end_ns`].
    #[serde(default)]
    pub blackhole_off_ns: u128,
    /// Wall clock just after it was lifted.
    pub blackhole_end_ns: u128,
    pub reloaded: bool,
    pub drop_device: Option<String>,
    pub lose_map: Option<String>,
    pub flush_map: Option<String>,
    pub old_programs: Vec<Attachment>,
    pub new_programs: Vec<Attachment>,
    /// When each part of the agent's start happened (wall clock ns; 0: did not happen).
    #[serde(default)]
    pub phases: Phases,
}

/// The instants of a restart's start-up, in Cilium's order (docs/cilium-fidelity.md,
/// "Restart order"): ipcache recreated, the API serving, the host programs replaced, every
/// endpoint regenerated.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Phases {
    /// The new agent process started (after `down`).
    #[serde(default)]
    pub agent_started_ns: u128,
    pub ipcache_recreated_ns: u128,
    pub api_serving_ns: u128,
    pub host_replaced_ns: u128,
    pub endpoints_regenerated_ns: u128,
}

/// What [`Lab::restart_with`] reports while it runs (wall clock ns).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AgentEvent {
    /// The agent went down (its API stopped answering; the blackhole, if any, is set).
    Down(u128),
    /// The new agent process started.
    Started(u128),
}

/// Parses `500ms`, `2s`, `1.5s`, `300us`, `1m`.
pub fn parse_duration(s: &str) -> Result<Duration> {
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
