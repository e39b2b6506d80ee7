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

/// Everything observed, plus what could not be read (each entry one line).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Observation {
    pub devices: Vec<Device>,
    /// lxc* devices seen (counted, not inspected: they are endpoints, not host devices).
    pub endpoint_devices: usize,
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
    endpoint_ifindexes: BTreeSet<u32>,
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
}

/// A topology is dumped again at least this often, whatever the notifications said.
const TOPOLOGY_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(300);

impl TopologyCache {
    pub fn new() -> TopologyCache {
        TopologyCache {
            events: super::rtevents::subscribe().ok(),
            topology: None,
            dumps: 0,
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
        let endpoints = self
            .topology
            .as_ref()
            .map(|(t, _)| t.endpoint_ifindexes.clone())
            .unwrap_or_default();
        let changed = match &self.events {
            Some(fd) => {
                let c = super::rtevents::host_changes(fd, &endpoints);
                if let Some((t, _)) = &mut self.topology {
                    t.endpoint_ifindexes.extend(&c.endpoints_added);
                    t.endpoint_ifindexes
                        .retain(|i| !c.endpoints_removed.contains(i));
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
        let mut r = programs(handle, bpffs, &t).await;
        for _ in 1..RACE_RETRIES {
            match &r {
                Ok(o) if o.raced => {
                    t = refresh_links(handle, &t).await.unwrap_or(t);
                    r = programs(handle, bpffs, &t).await
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
    lookup: impl Fn(u32) -> std::io::Result<bpf::ProgInfo>,
) -> bool {
    let mut raced = false;
    for p in &mut d.programs {
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
                let (line, _) = super::super::checks::io_reason(
                    &format!("program {} on {}", p.prog_id, d.name),
                    &e,
                );
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
            Ok(o) if o.raced => r = observe_with(&handle, bpffs).await,
            _ => break,
        }
    }
    task.abort();
    if let Ok(o) = &mut r {
        if o.raced {
            o.prog_details_unreadable = true;
            o.problems.push(format!(
                "programs kept changing during {RACE_RETRIES} observations in a row (a reload in progress)"
            ));
        }
    }
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
            t.endpoint_ifindexes.insert(d.ifindex);
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

async fn observe_with(handle: &rtnetlink::Handle, bpffs: &Path) -> Result<Observation, LinkError> {
    let t = topology(handle).await?;
    programs(handle, bpffs, &t).await
}

/// The observation from a topology: each host device's tc/tcx programs queried now.
async fn programs(
    handle: &rtnetlink::Handle,
    bpffs: &Path,
    t: &Topology,
) -> Result<Observation, LinkError> {
    let mut obs = Observation {
        endpoint_devices: t.endpoint_ifindexes.len(),
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
                    super::super::checks::io_reason("bpf prog query", &e).0
                )),
            }
        }
        for (hook, ingress) in [("ingress", true), ("egress", false)] {
            let req = handle.traffic_filter(d.ifindex as i32).get();
            let req = if ingress { req.ingress() } else { req.egress() };
            let mut stream = req.execute();
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
                                        TcOption::Bpf(TcFilterBpfOption::ProgId(i)) => {
                                            id = Some(*i)
                                        }
                                        _ => {}
                                    }
                                }
                            }
                        }
                        if let Some(id) = id {
                            d.programs.push(AttachedProgram {
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
                    Ok(None) => break,
                    // No clsact qdisc on this device: no filters.
                    Err(rtnetlink::Error::NetlinkError(e))
                        if matches!(e.raw_code().abs(), libc::EINVAL | libc::ENOENT) =>
                    {
                        break
                    }
                    Err(e) => {
                        obs.problems
                            .push(format!("tc filter dump on {} {hook}: {e}", d.name));
                        break;
                    }
                }
            }
        }
        if fill_details(d, &mut obs, bpf::prog_info_by_id) {
            obs.raced = true;
        }
    }
    obs.devices = devices;
    Ok(obs)
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
