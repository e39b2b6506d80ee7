//! The lab: a simulated Cilium node in network namespaces, faithful to `shared/cilium-facts.md`,
//! used by stepguard's demo, integration tests and benchmarks.
//!
//! One lab = one unique name prefix. Everything it creates (namespaces, a private bpffs mount,
//! servers, files) is recorded in `/run/stepguard-lab/<prefix>/state.json` *before* it is
//! created, so `down` removes exactly that, even after the creating process crashed.
mod agentcfg;
pub mod ciliumconfig;
pub mod datapath;
pub mod fixture;
pub mod kube;
pub mod kubelet;
pub mod lan;
pub mod maps;
pub mod netns;
mod nodemaps;
mod overlay;
pub mod realnode;
/// The real-agent node's pods and Services ([`realnode::pods`]).
pub use realnode::pods as realpods;
mod restart;
pub use restart::*;
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

pub use fixture::RUN_ROOT;
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

pub use sys::now_ns;

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
        for dev in &self.state.spec.xdp_refused {
            let peer = match (dev.as_str(), &self.state.spec.lan) {
                ("eth0", _) => "fab0".to_string(),
                ("eth1", None) => "fab1".to_string(),
                ("eth1", Some(port)) => format!("n{}", port.index),
                _ => bail!("xdp_refused: {dev} is no host device of the lab (eth0, eth1)"),
            };
            let ns = match &self.state.spec.lan {
                Some(port) if dev == "eth1" => port.ns.clone(),
                _ => fabric.clone(),
            };
            netns::ip(&ns, &["link", "set", &peer, "mtu", "9000"])?;
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
        self.state.attachments = datapath::attach_all_xdp(
            &node,
            &self.state.bpffs,
            self.state.spec.attach,
            &plan,
            self.state.spec.xdp_best_effort,
        )?;
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
