//! What is attached where: host devices from an rtnetlink link/address dump, their tcx
//! programs (BPF_PROG_QUERY), legacy clsact filters (rtnetlink filter dump: name and program
//! id), XDP programs (link attribute), and Cilium's pinned tcx links. Read-only.
use super::bpf;
use futures_util::TryStreamExt;
use netlink_packet_route::address::AddressAttribute;
use netlink_packet_route::link::{InfoKind, LinkAttribute, LinkFlags, LinkInfo, LinkXdp};
use netlink_packet_route::tc::{TcAttribute, TcFilterBpfOption, TcOption};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, Serialize)]
pub struct AttachedProgram {
    /// `ingress`, `egress` or `xdp`.
    pub hook: &'static str,
    /// `tcx`, `tc` or `xdp`.
    pub via: &'static str,
    pub prog_id: u32,
    /// Kernel program name (15 characters at most), when readable.
    pub name: Option<String>,
    /// Legacy tc filter name (`cil_from_netdev-eth0`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub filter: Option<String>,
    /// Load time, unix seconds (wall clock), when readable.
    pub loaded_at: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub link_pin: Option<PathBuf>,
}

impl AttachedProgram {
    /// The program's Cilium name: from the kernel name, or the tc filter name `<prog>-<dev>`.
    pub fn cilium_name(&self) -> Option<&str> {
        self.name.as_deref().or_else(|| {
            self.filter
                .as_deref()
                .and_then(|f| f.rsplit_once('-').map(|(p, _)| p))
        })
    }
    /// True if this is `prog` (matching the kernel's 15-character truncation).
    pub fn is(&self, prog: &str) -> bool {
        let short = &prog[..prog.len().min(15)];
        self.cilium_name().is_some_and(|n| n == prog || n == short)
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Device {
    pub name: String,
    pub ifindex: u32,
    pub up: bool,
    /// IFF_LOOPBACK.
    pub loopback: bool,
    /// IFF_SLAVE (a bond port).
    pub port: bool,
    /// Link kind (`veth`, `bridge`, ...), when the kernel says.
    pub kind: Option<String>,
    /// Enslaved to a bridge/bond.
    pub has_controller: bool,
    /// Addresses of any scope (Cilium rejects a device without any).
    pub addresses: usize,
    pub global_addrs: Vec<IpAddr>,
    /// A route in the main table with destination 0.0.0.0/0 or ::/0 through this device
    /// (Cilium's `tables.HasDefaultRoute`: a veth without one is not auto-selected).
    pub default_route: bool,
    /// A route in any table through this device whose destination is global unicast
    /// (Cilium's auto-detection needs one; a global address gives one in the local table).
    pub global_route: bool,
    pub programs: Vec<AttachedProgram>,
}

/// An endpoint device as the link dump or a notification named it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointLink {
    pub name: String,
    /// IFLA_INFO_KIND (`veth`, `netkit`), when the kernel says.
    pub kind: Option<String>,
}

/// An endpoint's host-side device (`lxc*`: a veth, or netkit in Cilium's netkit datapath
/// mode) and the programs on it.
#[derive(Clone, Debug, Serialize)]
pub struct EndpointDevice {
    pub name: String,
    pub ifindex: u32,
    pub kind: Option<String>,
    pub programs: Vec<AttachedProgram>,
    /// A program was replaced between the query and its lookup (a regeneration in progress):
    /// this endpoint's programs are not a consistent snapshot this time.
    pub raced: bool,
}

/// Where an endpoint's programs are queried, by device kind (docs/cilium-fidelity.md,
/// "Endpoints"): netkit's peer and primary attach types on a netkit device (Cilium attaches
/// `cil_from_container` to the peer, `cil_to_container` to the primary), tcx ingress and
/// egress otherwise (legacy tc filters when tcx has none). `(hook, attach type)`.
pub fn endpoint_hooks(kind: Option<&str>) -> [(&'static str, u32); 2] {
    if kind == Some("netkit") {
        [
            ("netkit_peer", bpf::BPF_NETKIT_PEER),
            ("netkit_primary", bpf::BPF_NETKIT_PRIMARY),
        ]
    } else {
        [
            ("ingress", bpf::BPF_TCX_INGRESS),
            ("egress", bpf::BPF_TCX_EGRESS),
        ]
    }
}

/// Everything observed, plus what could not be read (each entry one line).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Observation {
    pub devices: Vec<Device>,
    /// lxc* devices seen (counted here; their programs are in `endpoints`).
    pub endpoint_devices: usize,
    /// Every endpoint device with its programs (not serialized: a node has thousands).
    #[serde(skip)]
    pub endpoints: Vec<EndpointDevice>,
    /// Endpoint programs that could not be queried (one line each, the first few).
    #[serde(skip)]
    pub endpoint_problems: Vec<String>,
    pub problems: Vec<String>,
    /// Pinned links that could not be opened: reported, but they do not make the device
    /// observation unknown (the tcx query is the source of truth for what is attached).
    pub link_pin_problems: Vec<String>,
    /// A program id was seen but its details were unreadable (permissions).
    pub prog_details_unreadable: bool,
    /// A program or link went away between listing and lookup (a reload in progress): the
    /// observation is not a consistent snapshot and is taken again.
    #[serde(skip)]
    pub raced: bool,
}

/// Host devices, addresses and routes from the dumps (programs not queried).
#[derive(Clone, Debug, Default)]
struct Topology {
    devices: Vec<Device>,
    endpoints: BTreeMap<u32, EndpointLink>,
}

/// The agent's steady observations reuse the topology (the dumps of every link, address and
/// route: ~35 ms of kernel time with 1,000 endpoint devices) while rtnetlink says nothing
/// about host devices changed; programs are queried on every observation. Endpoint devices
/// (lxc*) coming and going, with their addresses and routes, do not count as a change.
pub struct TopologyCache {
    /// A netlink socket subscribed to link, address and route notifications (None: could not
    /// subscribe; every observation dumps).
    events: Option<std::os::fd::OwnedFd>,
    topology: Option<(Topology, std::time::Instant)>,
    /// Full dumps taken (for tests and the bench).
    pub dumps: u64,
    /// Program details by id (a program's name and load time never change): endpoint
    /// programs are looked up once, not on every observation.
    names: ProgNames,
}

/// Program details by id, kept for the ids last seen.
#[derive(Default)]
struct ProgNames {
    known: std::collections::HashMap<u32, bpf::ProgInfo>,
    seen: BTreeSet<u32>,
}

impl ProgNames {
    fn lookup(&mut self, id: u32) -> std::io::Result<bpf::ProgInfo> {
        self.seen.insert(id);
        if let Some(i) = self.known.get(&id) {
            return Ok(i.clone());
        }
        let info = bpf::prog_info_by_id(id)?;
        self.known.insert(id, info.clone());
        Ok(info)
    }
    /// Forgets the ids not looked up since the last call (replaced programs).
    fn prune(&mut self) {
        let seen = std::mem::take(&mut self.seen);
        self.known.retain(|id, _| seen.contains(id));
    }
}

/// A topology is dumped again at least this often, whatever the notifications said.
const TOPOLOGY_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(300);

impl TopologyCache {
    pub fn new() -> TopologyCache {
        TopologyCache {
            events: super::rtevents::subscribe().ok(),
            topology: None,
            dumps: 0,
            names: ProgNames::default(),
        }
    }

    /// Observes like [`observe`], dumping the topology only when it may have changed.
    pub async fn observe(&mut self, bpffs: &Path) -> Result<Observation, LinkError> {
        let (conn, handle, _) =
            rtnetlink::new_connection().map_err(|e| LinkError::Socket(e.to_string()))?;
        let task = tokio::spawn(conn);
        let r = self.observe_with(&handle, bpffs).await;
        task.abort();
        r
    }

    async fn observe_with(
        &mut self,
        handle: &rtnetlink::Handle,
        bpffs: &Path,
    ) -> Result<Observation, LinkError> {
        // Notifications are read before the dump: a change during the dump is seen next time.
        let endpoints: BTreeSet<u32> = self
            .topology
            .as_ref()
            .map(|(t, _)| t.endpoints.keys().copied().collect())
            .unwrap_or_default();
        let changed = match &self.events {
            Some(fd) => {
                let c = super::rtevents::host_changes(fd, &endpoints);
                if let Some((t, _)) = &mut self.topology {
                    for (i, mut link) in c.endpoints_added.clone() {
                        // A notification without IFLA_INFO_KIND keeps the kind known.
                        if link.kind.is_none() {
                            link.kind = t.endpoints.get(&i).and_then(|l| l.kind.clone());
                        }
                        t.endpoints.insert(i, link);
                    }
                    t.endpoints.retain(|i, _| !c.endpoints_removed.contains(i));
                }
                c.host
            }
            None => true,
        };
        let fresh = self
            .topology
            .as_ref()
            .is_some_and(|(_, at)| at.elapsed() < TOPOLOGY_MAX_AGE);
        let mut t = match (&self.topology, changed || !fresh) {
            (Some((t, _)), false) => match refresh_links(handle, t).await {
                Some(t) => t,
                None => self.dump(handle).await?,
            },
            _ => self.dump(handle).await?,
        };
        let mut r = programs(handle, bpffs, &t, &mut self.names).await;
        for _ in 1..RACE_RETRIES {
            match &r {
                Ok(o) if o.raced => {
                    t = refresh_links(handle, &t).await.unwrap_or(t);
                    r = programs(handle, bpffs, &t, &mut self.names).await
                }
                _ => break,
            }
        }
        if let Ok(o) = &mut r {
            if o.raced {
                o.prog_details_unreadable = true;
                o.problems.push(format!(
                    "programs kept changing during {RACE_RETRIES} observations in a row (a reload in progress)"
                ));
            }
            // Endpoints once per observation, after the host devices' retries.
            scan_endpoints(handle, &t, o, &mut self.names).await;
        }
        r
    }

    async fn dump(&mut self, handle: &rtnetlink::Handle) -> Result<Topology, LinkError> {
        let t = topology(handle).await?;
        self.dumps += 1;
        self.topology = Some((t.clone(), std::time::Instant::now()));
        Ok(t)
    }
}

impl std::fmt::Debug for TopologyCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TopologyCache")
            .field("subscribed", &self.events.is_some())
            .field("dumps", &self.dumps)
            .finish()
    }
}

/// A topology cache shared by the agent's observers (all on its kernel runtime).
pub type SharedTopology = std::sync::Arc<tokio::sync::Mutex<TopologyCache>>;

/// Observes through `cache` when there is one, else with fresh dumps.
pub async fn observe_via(
    cache: Option<&SharedTopology>,
    bpffs: &Path,
) -> Result<Observation, LinkError> {
    match cache {
        Some(c) => c.lock().await.observe(bpffs).await,
        None => observe(bpffs).await,
    }
}

impl Default for TopologyCache {
    fn default() -> Self {
        Self::new()
    }
}

/// The cached host devices with their link state and XDP programs read again (one request
/// per device, not a dump). None when a device is gone or cannot be read: dump instead.
async fn refresh_links(handle: &rtnetlink::Handle, t: &Topology) -> Option<Topology> {
    let mut fresh = t.clone();
    for d in &mut fresh.devices {
        let mut req = handle.link().get().match_index(d.ifindex).execute();
        let msg = req.try_next().await.ok().flatten()?;
        let now = device_of(&msg);
        if now.name != d.name {
            return None;
        }
        d.up = now.up;
        d.loopback = now.loopback;
        d.port = now.port;
        d.has_controller = now.has_controller;
        d.programs = now.programs;
    }
    Some(fresh)
}

/// How many times an observation is retaken when a reload races it.
const RACE_RETRIES: usize = 5;

/// Fills name and load time of every program on `d` from `lookup` (by id). A program that no
/// longer exists (ENOENT: replaced since the query, as during every Cilium restart) is not a
/// permission problem: returns true (raced) so the caller observes again. Any other error
/// makes the details unreadable, named in `obs.problems`.
pub fn fill_details(
    d: &mut Device,
    obs: &mut Observation,
    lookup: impl FnMut(u32) -> std::io::Result<bpf::ProgInfo>,
) -> bool {
    fill_program_details(&d.name, &mut d.programs, obs, lookup)
}

fn fill_program_details(
    device: &str,
    programs: &mut [AttachedProgram],
    obs: &mut Observation,
    mut lookup: impl FnMut(u32) -> std::io::Result<bpf::ProgInfo>,
) -> bool {
    let mut raced = false;
    for p in programs {
        match lookup(p.prog_id) {
            Ok(info) => {
                p.name = Some(info.name.clone());
                p.loaded_at = info
                    .loaded_at()
                    .duration_since(std::time::UNIX_EPOCH)
                    .ok()
                    .map(|d| d.as_secs_f64());
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => raced = true,
            Err(e) => {
                obs.prog_details_unreadable = true;
                let (line, _) = super::io_reason(&format!("program {} on {device}", p.prog_id), &e);
                if !obs.problems.contains(&line) {
                    obs.problems.push(line);
                }
            }
        }
    }
    raced
}

/// Endpoint devices are never host devices and are not inspected one by one.
pub fn is_endpoint_device(name: &str) -> bool {
    name.starts_with("lxc")
}

fn global_unicast(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            !(v4.is_loopback()
                || v4.is_link_local()
                || v4.is_multicast()
                || v4.is_unspecified()
                || v4.is_broadcast())
        }
        IpAddr::V6(v6) => {
            !(v6.is_loopback()
                || v6.is_multicast()
                || v6.is_unspecified()
                || (v6.segments()[0] & 0xffc0) == 0xfe80)
        }
    }
}

/// The link kind as the kernel names it (IFLA_INFO_KIND: `veth`, `bridge`, `openvswitch`):
/// the crate's Display, not its Debug form (which turned `openvswitch` into
/// `other("openvswitch")`, so OVS devices were never excluded).
fn kind_name(k: &InfoKind) -> String {
    k.to_string()
}

/// A link message's kind (IFLA_INFO_KIND), when it has one.
pub fn link_kind(msg: &netlink_packet_route::link::LinkMessage) -> Option<String> {
    msg.attributes.iter().find_map(|a| match a {
        LinkAttribute::LinkInfo(infos) => infos.iter().find_map(|i| match i {
            LinkInfo::Kind(k) => Some(kind_name(k)),
            _ => None,
        }),
        _ => None,
    })
}

/// Observes the current network namespace. `bpffs` is where Cilium pins its tcx links.
/// Netlink could not be asked (the devices are unknown, not absent).
#[derive(Clone, Debug, thiserror::Error)]
pub enum LinkError {
    #[error("open rtnetlink socket: {0}")]
    Socket(String),
    #[error("rtnetlink {what} dump: {message}")]
    Dump { what: &'static str, message: String },
}

pub async fn observe(bpffs: &Path) -> Result<Observation, LinkError> {
    let (conn, handle, _) =
        rtnetlink::new_connection().map_err(|e| LinkError::Socket(e.to_string()))?;
    let task = tokio::spawn(conn);
    let mut r = observe_with(&handle, bpffs).await;
    for _ in 1..RACE_RETRIES {
        match &r {
            Ok((o, _)) if o.raced => r = observe_with(&handle, bpffs).await,
            _ => break,
        }
    }
    let r = match r {
        Ok((mut o, t)) => {
            if o.raced {
                o.prog_details_unreadable = true;
                o.problems.push(format!(
                    "programs kept changing during {RACE_RETRIES} observations in a row (a reload in progress)"
                ));
            }
            scan_endpoints(&handle, &t, &mut o, &mut ProgNames::default()).await;
            Ok(o)
        }
        Err(e) => Err(e),
    };
    task.abort();
    r
}

/// Output devices of default routes (main table) and of routes with a global-unicast
/// destination (any table), IPv4 and IPv6, as Cilium's devices controller reads them.
/// Multipath routes name their devices in nexthops and are not followed.
async fn routes(handle: &rtnetlink::Handle) -> Result<(BTreeSet<u32>, BTreeSet<u32>), LinkError> {
    use netlink_packet_route::route::{RouteAddress, RouteAttribute, RouteHeader};
    let (mut default, mut global) = (BTreeSet::new(), BTreeSet::new());
    for msg in [
        rtnetlink::RouteMessageBuilder::<std::net::Ipv4Addr>::new().build(),
        rtnetlink::RouteMessageBuilder::<std::net::Ipv6Addr>::new().build(),
    ] {
        let mut dump = handle.route().get(msg).execute();
        while let Some(r) = dump.try_next().await.map_err(|e| LinkError::Dump {
            what: "route",
            message: e.to_string(),
        })? {
            let mut table = u32::from(r.header.table);
            let (mut oif, mut dst) = (None, None);
            for a in &r.attributes {
                match a {
                    RouteAttribute::Table(t) => table = *t,
                    RouteAttribute::Oif(i) => oif = Some(*i),
                    RouteAttribute::Destination(RouteAddress::Inet(ip)) => {
                        dst = Some(IpAddr::V4(*ip))
                    }
                    RouteAttribute::Destination(RouteAddress::Inet6(ip)) => {
                        dst = Some(IpAddr::V6(*ip))
                    }
                    _ => {}
                }
            }
            let Some(oif) = oif else { continue };
            if r.header.destination_prefix_length == 0
                && table == u32::from(RouteHeader::RT_TABLE_MAIN)
            {
                default.insert(oif);
            }
            if dst.is_some_and(|ip| global_unicast(&ip)) {
                global.insert(oif);
            }
        }
    }
    Ok((default, global))
}

/// A device as a link message describes it (programs: XDP only; tc/tcx are queried).
fn device_of(msg: &netlink_packet_route::link::LinkMessage) -> Device {
    let mut d = Device {
        name: String::new(),
        ifindex: msg.header.index,
        up: msg.header.flags.contains(LinkFlags::Up),
        loopback: msg.header.flags.contains(LinkFlags::Loopback),
        port: msg.header.flags.contains(LinkFlags::Port),
        kind: None,
        has_controller: false,
        addresses: 0,
        global_addrs: vec![],
        default_route: false,
        global_route: false,
        programs: vec![],
    };
    for a in &msg.attributes {
        match a {
            LinkAttribute::IfName(n) => d.name = n.clone(),
            LinkAttribute::Controller(_) => d.has_controller = true,
            LinkAttribute::LinkInfo(infos) => {
                for i in infos {
                    if let LinkInfo::Kind(k) = i {
                        d.kind = Some(kind_name(k));
                    }
                }
            }
            LinkAttribute::Xdp(xdp) => {
                for x in xdp {
                    if let LinkXdp::ProgId(id) = x {
                        if *id != 0 {
                            d.programs.push(AttachedProgram {
                                hook: "xdp",
                                via: "xdp",
                                prog_id: *id,
                                name: None,
                                filter: None,
                                loaded_at: None,
                                link_pin: None,
                            });
                        }
                    }
                }
            }
            _ => {}
        }
    }
    d
}

/// Host devices with their addresses and routes (no tc/tcx programs yet): the part of an
/// observation that needs dumps of every link, address and route of the namespace.
async fn topology(handle: &rtnetlink::Handle) -> Result<Topology, LinkError> {
    let mut t = Topology::default();
    let mut links = handle.link().get().execute();
    while let Some(msg) = links.try_next().await.map_err(|e| LinkError::Dump {
        what: "link",
        message: e.to_string(),
    })? {
        let d = device_of(&msg);
        if is_endpoint_device(&d.name) {
            t.endpoints.insert(
                d.ifindex,
                EndpointLink {
                    name: d.name,
                    kind: d.kind,
                },
            );
            continue;
        }
        t.devices.push(d);
    }
    // Addresses, for Cilium's auto-detection rule (global unicast).
    let mut addrs = handle.address().get().execute();
    let mut by_index: BTreeMap<u32, Vec<IpAddr>> = BTreeMap::new();
    let mut any_addr: BTreeMap<u32, usize> = BTreeMap::new();
    while let Some(msg) = addrs.try_next().await.map_err(|e| LinkError::Dump {
        what: "address",
        message: e.to_string(),
    })? {
        for a in &msg.attributes {
            if let AddressAttribute::Address(ip) = a {
                *any_addr.entry(msg.header.index).or_default() += 1;
                if global_unicast(ip) {
                    by_index.entry(msg.header.index).or_default().push(*ip);
                }
            }
        }
    }
    let (default_route, global_route) = routes(handle).await?;
    for d in &mut t.devices {
        d.global_addrs = by_index.remove(&d.ifindex).unwrap_or_default();
        d.addresses = any_addr.get(&d.ifindex).copied().unwrap_or(0);
        d.default_route = default_route.contains(&d.ifindex);
        d.global_route = global_route.contains(&d.ifindex);
    }
    Ok(t)
}

async fn observe_with(
    handle: &rtnetlink::Handle,
    bpffs: &Path,
) -> Result<(Observation, Topology), LinkError> {
    let t = topology(handle).await?;
    let o = programs(handle, bpffs, &t, &mut ProgNames::default()).await?;
    Ok((o, t))
}

/// The observation from a topology: each host device's tc/tcx programs queried now.
async fn programs(
    handle: &rtnetlink::Handle,
    bpffs: &Path,
    t: &Topology,
    names: &mut ProgNames,
) -> Result<Observation, LinkError> {
    let mut obs = Observation {
        endpoint_devices: t.endpoints.len(),
        ..Default::default()
    };
    let mut devices = t.devices.clone();
    let pins = pinned_tcx_links(bpffs, &mut obs.link_pin_problems);
    for d in &mut devices {
        for (hook, at) in [
            ("ingress", bpf::BPF_TCX_INGRESS),
            ("egress", bpf::BPF_TCX_EGRESS),
        ] {
            match bpf::tcx_prog_ids(d.ifindex, at) {
                Ok(ids) => {
                    for id in ids {
                        d.programs.push(AttachedProgram {
                            hook,
                            via: "tcx",
                            prog_id: id,
                            name: None,
                            filter: None,
                            loaded_at: None,
                            link_pin: pins.get(&id).cloned(),
                        });
                    }
                }
                // No tcx on this kernel: nothing attached that way.
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINVAL) | Some(libc::EOPNOTSUPP)
                    ) => {}
                Err(e) => obs.problems.push(format!(
                    "tcx query on {} {hook}: {}",
                    d.name,
                    super::io_reason("bpf prog query", &e).0
                )),
            }
        }
        for hook in ["ingress", "egress"] {
            match tc_filters(handle, d.ifindex, hook).await {
                Ok(Some(mut p)) => d.programs.append(&mut p),
                Ok(None) => obs.problems.push(format!(
                    "tc filter dump on {} {hook}: the device went away",
                    d.name
                )),
                Err(e) => obs
                    .problems
                    .push(format!("tc filter dump on {} {hook}: {e}", d.name)),
            }
        }
        if fill_details(d, &mut obs, |id| names.lookup(id)) {
            obs.raced = true;
        }
    }
    obs.devices = devices;
    Ok(obs)
}

/// Every endpoint device's programs into `obs` (once per observation).
async fn scan_endpoints(
    handle: &rtnetlink::Handle,
    t: &Topology,
    obs: &mut Observation,
    names: &mut ProgNames,
) {
    for (ifindex, link) in &t.endpoints {
        if let Some(ep) = endpoint_programs(handle, *ifindex, link, obs, names).await {
            obs.endpoints.push(ep);
        }
    }
    names.prune();
}

/// At most this many endpoint problems are kept (a node has thousands of endpoints).
const ENDPOINT_PROBLEMS_MAX: usize = 5;

/// The programs `query` (BPF_PROG_QUERY on the device's ifindex, by attach type) finds on
/// one endpoint device at its hooks ([`endpoint_hooks`]); None when the device went away
/// since it was listed (ENODEV: a pod deleted). Problems are one line each.
pub fn query_endpoint(
    link: &EndpointLink,
    mut query: impl FnMut(u32) -> std::io::Result<Vec<u32>>,
    problems: &mut Vec<String>,
) -> Option<Vec<AttachedProgram>> {
    let netkit = link.kind.as_deref() == Some("netkit");
    let via = if netkit { "netkit" } else { "tcx" };
    let mut programs = Vec::new();
    for (hook, at) in endpoint_hooks(link.kind.as_deref()) {
        match query(at) {
            Ok(ids) => programs.extend(ids.into_iter().map(|id| AttachedProgram {
                hook,
                via,
                prog_id: id,
                name: None,
                filter: None,
                loaded_at: None,
                link_pin: None,
            })),
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => return None,
            // Not on this kernel (no tcx, no netkit): nothing attached that way.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINVAL) | Some(libc::EOPNOTSUPP)
                ) => {}
            Err(e) => problems.push(format!(
                "{via} query on endpoint {} {hook}: {}",
                link.name,
                super::io_reason("bpf prog query", &e).0
            )),
        }
    }
    Some(programs)
}

/// One endpoint device's programs with their names; None when the device went away.
async fn endpoint_programs(
    handle: &rtnetlink::Handle,
    ifindex: u32,
    link: &EndpointLink,
    obs: &mut Observation,
    names: &mut ProgNames,
) -> Option<EndpointDevice> {
    let mut problems = Vec::new();
    let mut programs = query_endpoint(link, |at| bpf::tcx_prog_ids(ifindex, at), &mut problems)?;
    // Cilium on tcx removes an endpoint's legacy filters: only a veth endpoint without tcx
    // programs is dumped for them (a netlink dump per hook per endpoint otherwise).
    if link.kind.as_deref() != Some("netkit") && programs.is_empty() {
        for hook in ["ingress", "egress"] {
            match tc_filters(handle, ifindex, hook).await {
                Ok(Some(mut p)) => programs.append(&mut p),
                // Deleted since it was listed (a pod deleted): gone, not a problem.
                Ok(None) => return None,
                Err(e) => problems.push(format!(
                    "tc filter dump on endpoint {} {hook}: {e}",
                    link.name
                )),
            }
        }
    }
    let mut scratch = Observation::default();
    let raced = fill_program_details(&link.name, &mut programs, &mut scratch, |id| {
        names.lookup(id)
    });
    problems.extend(scratch.problems);
    // An endpoint read only in part is not a consistent snapshot either: judged next time.
    let raced = raced || !problems.is_empty();
    for line in problems {
        if obs.endpoint_problems.len() < ENDPOINT_PROBLEMS_MAX {
            obs.endpoint_problems.push(line);
        }
    }
    Some(EndpointDevice {
        name: link.name.clone(),
        ifindex,
        kind: link.kind.clone(),
        programs,
        raced,
    })
}

/// The legacy clsact filters of one hook: (name, program id) each. No qdisc: none; the
/// device gone (ENODEV): None.
async fn tc_filters(
    handle: &rtnetlink::Handle,
    ifindex: u32,
    hook: &'static str,
) -> Result<Option<Vec<AttachedProgram>>, String> {
    let req = handle.traffic_filter(ifindex as i32).get();
    let req = if hook == "ingress" {
        req.ingress()
    } else {
        req.egress()
    };
    let mut stream = req.execute();
    let mut out = Vec::new();
    loop {
        match stream.try_next().await {
            Ok(Some(msg)) => {
                let (mut name, mut id) = (None, None);
                for a in &msg.attributes {
                    if let TcAttribute::Options(opts) = a {
                        for o in opts {
                            match o {
                                TcOption::Bpf(TcFilterBpfOption::ProgName(n)) => {
                                    name = Some(n.clone())
                                }
                                TcOption::Bpf(TcFilterBpfOption::ProgId(i)) => id = Some(*i),
                                _ => {}
                            }
                        }
                    }
                }
                if let Some(id) = id {
                    out.push(AttachedProgram {
                        hook,
                        via: "tc",
                        prog_id: id,
                        name: None,
                        filter: name,
                        loaded_at: None,
                        link_pin: None,
                    });
                }
            }
            Ok(None) => return Ok(Some(out)),
            // No clsact qdisc on this device: no filters.
            Err(rtnetlink::Error::NetlinkError(e))
                if matches!(e.raw_code().abs(), libc::EINVAL | libc::ENOENT) =>
            {
                return Ok(Some(out))
            }
            Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code().abs() == libc::ENODEV => {
                return Ok(None)
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// Where this node's routing ends for `addr` (`ip route get`, in the current network
/// namespace): `Some(why)` when on this node — a local address, or a route out of an
/// endpoint device (`lxc*`: a local pod) — and None when it leaves the node.
pub async fn route_ends_here(addr: IpAddr) -> Result<Option<String>, String> {
    use netlink_packet_route::route::{RouteAttribute, RouteType};
    let (conn, handle, _) = rtnetlink::new_connection().map_err(|e| e.to_string())?;
    let task = tokio::spawn(conn);
    let msg = match addr {
        IpAddr::V4(a) => rtnetlink::RouteMessageBuilder::<std::net::Ipv4Addr>::new()
            .destination_prefix(a, 32)
            .build(),
        IpAddr::V6(a) => rtnetlink::RouteMessageBuilder::<std::net::Ipv6Addr>::new()
            .destination_prefix(a, 128)
            .build(),
    };
    let r = async {
        let mut answers = handle.route().get(msg).execute();
        let Some(route) = answers
            .try_next()
            .await
            .map_err(|e| format!("route lookup of {addr}: {e}"))?
        else {
            return Err(format!("route lookup of {addr}: no answer"));
        };
        if route.header.kind == RouteType::Local {
            return Ok(Some("a local address of this node".to_string()));
        }
        let Some(oif) = route.attributes.iter().find_map(|a| match a {
            RouteAttribute::Oif(i) => Some(*i),
            _ => None,
        }) else {
            return Ok(None);
        };
        let mut links = handle.link().get().match_index(oif).execute();
        let name = match links.try_next().await {
            Ok(Some(m)) => device_of(&m).name,
            Ok(None) => return Err(format!("route lookup of {addr}: no device {oif}")),
            Err(e) => return Err(format!("route lookup of {addr}: device {oif}: {e}")),
        };
        Ok(is_endpoint_device(&name).then(|| format!("routed to the local endpoint {name}")))
    }
    .await;
    task.abort();
    r
}

/// Cilium's pinned tcx links (`<bpffs>/cilium/devices/<dev>/links/<prog>`), by program id.
fn pinned_tcx_links(bpffs: &Path, problems: &mut Vec<String>) -> BTreeMap<u32, PathBuf> {
    let mut out = BTreeMap::new();
    let Ok(devs) = std::fs::read_dir(bpffs.join("cilium/devices")) else {
        return out;
    };
    for dev in devs.flatten() {
        let Ok(links) = std::fs::read_dir(dev.path().join("links")) else {
            continue;
        };
        for l in links.flatten() {
            let path = l.path();
            match bpf::obj_get_link(&path).and_then(|fd| bpf::link_info(&fd)) {
                Ok(info) => {
                    out.insert(info.prog_id, path);
                }
                // Unpinned since the directory was read (a reload): nothing to report.
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => problems.push(format!("open pinned link {}: {e}", path.display())),
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(ids: &[u32]) -> Device {
        Device {
            name: "eth0".into(),
            ifindex: 2,
            up: true,
            loopback: false,
            port: false,
            kind: None,
            has_controller: false,
            addresses: 0,
            global_addrs: vec![],
            default_route: false,
            global_route: false,
            programs: ids
                .iter()
                .map(|id| AttachedProgram {
                    hook: "ingress",
                    via: "tcx",
                    prog_id: *id,
                    name: None,
                    filter: None,
                    loaded_at: None,
                    link_pin: None,
                })
                .collect(),
        }
    }

    fn info(id: u32) -> bpf::ProgInfo {
        bpf::ProgInfo {
            id,
            prog_type: 3,
            name: "cil_from_netdev".into(),
            load_time_boot_ns: 0,
        }
    }

    /// Program 10 was replaced between the tcx query and the info lookup (ENOENT), as during
    /// every Cilium restart: a race to observe again, not a missing permission (before the
    /// fix: `prog_details_unreadable`, the devices check `unknown`, a step begun then 503).
    #[test]
    fn a_program_replaced_between_query_and_lookup_is_a_race_not_a_permission_problem() {
        let mut obs = Observation::default();
        let mut d = device(&[10, 11]);
        let raced = fill_details(&mut d, &mut obs, |id| {
            if id == 10 {
                Err(std::io::Error::from_raw_os_error(libc::ENOENT))
            } else {
                Ok(info(id))
            }
        });
        assert!(raced);
        assert!(!obs.prog_details_unreadable && obs.problems.is_empty());
        assert_eq!(d.programs[1].name.as_deref(), Some("cil_from_netdev"));
        // A real permission problem stays one.
        let mut obs = Observation::default();
        let mut d = device(&[10]);
        let raced = fill_details(&mut d, &mut obs, |_| {
            Err(std::io::Error::from_raw_os_error(libc::EPERM))
        });
        assert!(!raced && obs.prog_details_unreadable);
        assert_eq!(obs.problems.len(), 1);
    }
}

#[cfg(test)]
mod endpoint_tests {
    use super::*;
    use netlink_packet_route::link::LinkMessage;
    use rtnetlink::packet_core::{Emitable, Parseable};

    /// An RTM_NEWLINK for `name` of `kind`, as bytes the kernel sends, parsed back.
    fn link_message(name: &str, kind: InfoKind) -> LinkMessage {
        let mut m = LinkMessage::default();
        m.header.index = 42;
        m.attributes.push(LinkAttribute::IfName(name.into()));
        m.attributes
            .push(LinkAttribute::LinkInfo(vec![LinkInfo::Kind(kind)]));
        let mut buf = vec![0u8; m.buffer_len()];
        m.emit(&mut buf);
        LinkMessage::parse(&buf[..]).expect("parse link message")
    }

    fn prog(id: u32, name: &str) -> bpf::ProgInfo {
        bpf::ProgInfo {
            id,
            prog_type: 3,
            name: name.into(),
            load_time_boot_ns: 0,
        }
    }

    /// A netkit endpoint (Cilium's `bpf.datapathMode: netkit`; this machine's kernel has no
    /// netkit, so the kernel's answers are given here as it gives them): the link kind
    /// `netkit` from the link message, programs queried at BPF_NETKIT_PEER and
    /// BPF_NETKIT_PRIMARY on the primary's ifindex, kernel names truncated to 15 characters.
    #[test]
    fn a_netkit_endpoint_is_queried_at_the_netkit_attach_types() {
        let m = link_message("lxc1a2b3c", InfoKind::Netkit);
        let link = EndpointLink {
            name: "lxc1a2b3c".into(),
            kind: link_kind(&m),
        };
        assert_eq!(link.kind.as_deref(), Some("netkit"));
        let mut asked = vec![];
        let mut problems = vec![];
        let mut programs = query_endpoint(
            &link,
            |at| {
                asked.push(at);
                Ok(match at {
                    bpf::BPF_NETKIT_PEER => vec![301],
                    bpf::BPF_NETKIT_PRIMARY => vec![302],
                    _ => vec![],
                })
            },
            &mut problems,
        )
        .expect("present");
        assert_eq!(asked, [bpf::BPF_NETKIT_PEER, bpf::BPF_NETKIT_PRIMARY]);
        assert!(problems.is_empty());
        let mut obs = Observation::default();
        let raced = fill_program_details(&link.name, &mut programs, &mut obs, |id| {
            Ok(prog(
                id,
                if id == 301 {
                    "cil_from_contai"
                } else {
                    "cil_to_containe"
                },
            ))
        });
        assert!(!raced);
        assert_eq!(
            (
                programs[0].hook,
                programs[0].via,
                programs[0].is("cil_from_container")
            ),
            ("netkit_peer", "netkit", true)
        );
        assert_eq!(
            (programs[1].hook, programs[1].is("cil_to_container")),
            ("netkit_primary", true)
        );
        // A veth endpoint is asked at tcx ingress and egress; a kernel without tcx (EINVAL)
        // has nothing attached that way, and a device deleted meanwhile (ENODEV) is gone.
        let veth = EndpointLink {
            name: "lxc9".into(),
            kind: link_kind(&link_message("lxc9", InfoKind::Veth)),
        };
        let mut asked = vec![];
        let p = query_endpoint(
            &veth,
            |at| {
                asked.push(at);
                Err(std::io::Error::from_raw_os_error(libc::EINVAL))
            },
            &mut problems,
        );
        assert_eq!(asked, [bpf::BPF_TCX_INGRESS, bpf::BPF_TCX_EGRESS]);
        assert!(p.is_some_and(|p| p.is_empty()) && problems.is_empty());
        let gone = query_endpoint(
            &veth,
            |_| Err(std::io::Error::from_raw_os_error(libc::ENODEV)),
            &mut problems,
        );
        assert!(gone.is_none());
        let denied = query_endpoint(
            &veth,
            |_| Err(std::io::Error::from_raw_os_error(libc::EPERM)),
            &mut problems,
        );
        assert!(denied.is_some() && problems.len() == 2, "{problems:?}");
    }
}

#[cfg(test)]
mod topology_tests {
    use super::*;

    fn ip(args: &str) {
        let st = std::process::Command::new("ip")
            .args(args.split_whitespace())
            .status()
            .expect("run ip");
        assert!(st.success(), "ip {args}");
    }

    /// In a network namespace of its own (root): the topology is dumped once and reused while
    /// nothing about host devices changes; endpoint devices coming and going are counted
    /// without a dump; an address, a new host device or a route change makes the next
    /// observation dump again and see it.
    #[test]
    fn the_topology_is_dumped_again_only_when_host_devices_change() {
        std::thread::spawn(|| {
            // SAFETY: moves only this thread (and the processes it starts) to a new netns.
            let r = unsafe { libc::unshare(libc::CLONE_NEWNET) };
            assert_eq!(
                r,
                0,
                "unshare(CLONE_NEWNET) needs root: {}",
                std::io::Error::last_os_error()
            );
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                ip("link add hst0 type veth peer name hst1");
                ip("link add lxc1 type veth peer name lxc2");
                let bpffs = Path::new("/nonexistent-bpffs");
                let mut c = TopologyCache::new();
                assert!(c.events.is_some(), "subscribed");
                let o = c.observe(bpffs).await.unwrap();
                assert_eq!(c.dumps, 1);
                assert_eq!(o.endpoint_devices, 2);
                assert!(o.devices.iter().any(|d| d.name == "hst0"));
                c.observe(bpffs).await.unwrap();
                assert_eq!(c.dumps, 1, "nothing changed: no dump");
                // Endpoints come and go: counted, no dump.
                ip("link add lxc3 type veth peer name lxc4");
                ip("link set lxc3 up");
                let o = c.observe(bpffs).await.unwrap();
                assert_eq!((c.dumps, o.endpoint_devices), (1, 4));
                ip("link del lxc1");
                let o = c.observe(bpffs).await.unwrap();
                assert_eq!((c.dumps, o.endpoint_devices), (1, 2));
                // A host device's link state is read on every observation, without a dump.
                ip("link set hst0 up");
                let o = c.observe(bpffs).await.unwrap();
                let hst0 = o.devices.iter().find(|d| d.name == "hst0").unwrap();
                assert!(hst0.up);
                let dumps = c.dumps;
                // An address on a host device: dumped again, and seen.
                ip("addr add 192.0.2.1/24 dev hst0");
                let o = c.observe(bpffs).await.unwrap();
                assert_eq!(c.dumps, dumps + 1);
                let hst0 = o.devices.iter().find(|d| d.name == "hst0").unwrap();
                assert_eq!(
                    hst0.global_addrs,
                    vec!["192.0.2.1".parse::<IpAddr>().unwrap()]
                );
                // A default route through it.
                ip("route add default via 192.0.2.254 dev hst0");
                let o = c.observe(bpffs).await.unwrap();
                assert_eq!(c.dumps, dumps + 2);
                assert!(
                    o.devices
                        .iter()
                        .find(|d| d.name == "hst0")
                        .unwrap()
                        .default_route
                );
                // A new host device.
                ip("link add hst2 type veth peer name hst3");
                let o = c.observe(bpffs).await.unwrap();
                assert!(o.devices.iter().any(|d| d.name == "hst2"));
                assert_eq!(c.dumps, dumps + 3);
                c.observe(bpffs).await.unwrap();
                assert_eq!(c.dumps, dumps + 3);
            });
        })
        .join()
        .expect("the topology test thread");
    }
}
