//! Host devices, addresses and routes, dumped again only when rtnetlink reports a change (or
//! after `TOPOLOGY_MAX_AGE`).
use super::*;

/// Host devices, addresses and routes from the dumps (programs not queried).
#[derive(Clone, Debug, Default)]
pub(super) struct Topology {
    pub(super) devices: Vec<Device>,
    pub(super) endpoints: BTreeMap<u32, EndpointLink>,
}

/// The agent's steady observations reuse the topology (the dumps of every link, address and
/// route: ~35 ms of kernel time with 1,000 endpoint devices) while rtnetlink says nothing
/// about host devices changed; programs are queried on every observation. Endpoint devices
/// (lxc*) coming and going, with their addresses and routes, do not count as a change.
pub struct TopologyCache {
    /// A netlink socket subscribed to link, address and route notifications (None: could not
    /// subscribe; every observation dumps).
    pub(super) events: Option<std::os::fd::OwnedFd>,
    pub(super) topology: Option<(Topology, std::time::Instant)>,
    /// Full dumps taken (for tests and the bench).
    pub dumps: u64,
    /// Program details by id (a program's name and load time never change): endpoint
    /// programs are looked up once, not on every observation.
    pub(super) names: ProgNames,
}

/// Program details by id, kept for the ids last seen.
#[derive(Default)]
pub(super) struct ProgNames {
    pub(super) known: std::collections::HashMap<u32, bpf::ProgInfo>,
    pub(super) seen: BTreeSet<u32>,
}

impl ProgNames {
    pub(super) fn lookup(&mut self, id: u32) -> std::io::Result<bpf::ProgInfo> {
        self.seen.insert(id);
        if let Some(i) = self.known.get(&id) {
            return Ok(i.clone());
        }
        let info = bpf::prog_info_by_id(id)?;
        self.known.insert(id, info.clone());
        Ok(info)
    }
    /// Forgets the ids not looked up since the last call (replaced programs).
    pub(super) fn prune(&mut self) {
        let seen = std::mem::take(&mut self.seen);
        self.known.retain(|id, _| seen.contains(id));
    }
}

/// A topology is dumped again at least this often, whatever the notifications said.
pub(super) const TOPOLOGY_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(300);

impl TopologyCache {
    pub fn new() -> TopologyCache {
        TopologyCache {
            events: super::events::subscribe().ok(),
            topology: None,
            dumps: 0,
            names: ProgNames::default(),
        }
    }

    /// Observes like [`observe`], dumping the topology only when it may have changed.
    pub async fn observe(&mut self, bpffs: &Path) -> Result<Observation, LinkError> {
        self.observe_scan(bpffs, &EndpointScan::All).await
    }

    /// [`TopologyCache::observe`], querying only the endpoints `scan` selects.
    pub async fn observe_scan(
        &mut self,
        bpffs: &Path,
        scan: &EndpointScan,
    ) -> Result<Observation, LinkError> {
        let (conn, handle, _) =
            rtnetlink::new_connection().map_err(|e| LinkError::Socket(e.to_string()))?;
        let task = tokio::spawn(conn);
        let r = self.observe_with(&handle, bpffs, scan).await;
        task.abort();
        r
    }

    pub(super) async fn observe_with(
        &mut self,
        handle: &rtnetlink::Handle,
        bpffs: &Path,
        scan: &EndpointScan,
    ) -> Result<Observation, LinkError> {
        // Notifications are read before the dump: a change during the dump is seen next time.
        let endpoints: BTreeSet<u32> = self
            .topology
            .as_ref()
            .map(|(t, _)| t.endpoints.keys().copied().collect())
            .unwrap_or_default();
        let changed = match &self.events {
            Some(fd) => {
                let c = super::events::host_changes(fd, &endpoints);
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
            scan_endpoints(handle, &t, o, &mut self.names, scan).await;
        }
        r
    }

    pub(super) async fn dump(&mut self, handle: &rtnetlink::Handle) -> Result<Topology, LinkError> {
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

/// [`observe_via`] through `cache`, querying only the endpoints `scan` selects.
pub async fn observe_scan_via(
    cache: &SharedTopology,
    bpffs: &Path,
    scan: &EndpointScan,
) -> Result<Observation, LinkError> {
    cache.lock().await.observe_scan(bpffs, scan).await
}

impl Default for TopologyCache {
    fn default() -> Self {
        Self::new()
    }
}

/// The cached host devices with their link state and XDP programs read again (one request
/// per device, not a dump). None when a device is gone or cannot be read: dump instead.
pub(super) async fn refresh_links(handle: &rtnetlink::Handle, t: &Topology) -> Option<Topology> {
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
        d.controller = now.controller;
        d.alt_names = now.alt_names.clone();
        d.programs = now.programs;
    }
    Some(fresh)
}

pub(super) fn global_unicast(ip: &IpAddr) -> bool {
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
pub(super) fn kind_name(k: &InfoKind) -> String {
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

/// A device as a link message describes it (programs: XDP only; tc/tcx are queried).
pub(super) fn device_of(msg: &netlink_packet_route::link::LinkMessage) -> Device {
    let mut d = Device {
        name: String::new(),
        ifindex: msg.header.index,
        up: msg.header.flags.contains(LinkFlags::Up),
        loopback: msg.header.flags.contains(LinkFlags::Loopback),
        port: msg.header.flags.contains(LinkFlags::Port),
        kind: None,
        has_controller: false,
        controller: None,
        alt_names: vec![],
        addresses: 0,
        global_addrs: vec![],
        default_route: false,
        global_route: false,
        programs: vec![],
    };
    for a in &msg.attributes {
        match a {
            LinkAttribute::IfName(n) => d.name = n.clone(),
            LinkAttribute::Controller(i) => {
                d.has_controller = true;
                d.controller = Some(*i);
            }
            LinkAttribute::PropList(props) => {
                for p in props {
                    if let netlink_packet_route::link::Prop::AltIfName(n) = p {
                        d.alt_names.push(n.clone());
                    }
                }
            }
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
pub(super) async fn topology(handle: &rtnetlink::Handle) -> Result<Topology, LinkError> {
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
