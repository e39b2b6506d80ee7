//! A LAN of lab nodes with Cilium's L2 announcements, and a LAN client to witness from.
//!
//! Topology: a bridge `br0` in `<prefix>-lan`; every node (a full single-node [`Lab`] with
//! prefix `<prefix>n<i>`) has its `eth1` on it at `203.0.113.<1+i>`; the client namespace
//! `<prefix>-client` has `eth0` on it at `203.0.113.100`, where a witness runs. With
//! [`LanSpec::ipv6`] the segment is dual-stack (`2001:db8:113::<1+i>`, client
//! `2001:db8:113::100`) and two IPv6 VIPs are announced beside the IPv4 ones.
//!
//! What it imitates (docs/cilium-fidelity.md, "L2 announcements"):
//! - one lease per service VIP; the holder answers ARP for the VIP on its LAN NIC (Cilium: an
//!   entry in `cilium_l2_responder_v4`, answered by `cil_from_netdev`; here: the VIP as an
//!   address on `eth1` with `arp_ignore=1`, so only the holder answers);
//! - IPv6 VIPs (Cilium 1.19+, `cilium_l2_responder_v6`): the holder answers Neighbor
//!   Solicitations for the VIP (Cilium: `handle_l2_announcement` in `cil_from_netdev` answers
//!   with a Neighbor Advertisement from the device's MAC; here: the VIP on `eth1`, `nodad`,
//!   which the kernel answers only on that NIC); a new entry is announced with an unsolicited
//!   NA to ff02::1 (`gneighOnNewEntry`) instead of a gratuitous ARP — with the Override flag
//!   and a Target link-layer option from v1.19.5 (v1.19.7 and v1.20.2 read too; `ndSender.Send`), without them
//!   in v1.19.0–v1.19.4 ([`UnsolicitedNa::Early`]: a Linux client's entry keeps the old
//!   holder's MAC and its state, so it sends there until its own reachability confirmation
//!   lapses and its neighbour probes fail; the lab's truth ends such an outage when the old
//!   holder's datapath is back, right for outages shorter than that, ~20 s or more); 1.16–1.18
//!   have no IPv6 responder and a LAN lab refuses IPv6 there;
//! - every node accepts traffic for every VIP whoever holds the lease (Cilium: `nodeport_lb4`
//!   load-balances a LoadBalancer IP on any node; here: the VIP on `lo` of every node and a
//!   backend on every node), so a client with a stale ARP entry is still served while that
//!   node's datapath forwards;
//! - a graceful agent stop releases the lease (`ReleaseOnCancel`); another node takes it at
//!   its next retry (`retry` after the release), adds the responder entry and sends a
//!   gratuitous ARP; after a crash the lease must expire first (`duration`, then `retry`);
//! - a gracefully stopping agent deletes the responder entries of the leases it led at once
//!   (measured on two real 1.20.2 agents, `tests/real_l2.rs`): until the taker's gratuitous ARP
//!   nobody answers ARP for the VIP, while a client's existing entry still reaches the old
//!   holder's datapath;
//! - a crashed holder's responder keeps answering ARP until its agent's liveness stamp is
//!   older than the lease duration, so two nodes answer during a move; its entries stay in
//!   the pinned map and answer again once the new agent heartbeats;
//! - the restarted agent's L2 responder reconciles the pinned map against a still-empty table
//!   at its start ([`ResponderFlush`]): it deletes every entry (v1.19.7, v1.20.2; up to
//!   1.19.0-dev, through a reused key pointer, only the one iterated last:
//!   cilium/cilium#45068, fixed by #45197); once its leases are (re)acquired
//!   ([`LanRestartOpts::reacquire_after`]) it re-adds the entries that are missing, each with
//!   a gratuitous ARP, and none for an entry still there (`garpOnNewEntry`); a taker with a
//!   stale entry of its own sends no gratuitous ARP either;
//! - a `kubectl delete pod` gives the agent the Helm chart's 1 s grace
//!   (`terminationGracePeriodSeconds`, preStop hook included): a release that takes longer
//!   never happens, and the leases expire as after a crash ([`LanRestartOpts::release_takes`]);
//! - the LAN client's (or a node's) neighbour entries can be forgotten mid-restart
//!   ([`Forget`]): its kernel then queues packets on an INCOMPLETE entry until something
//!   answers; the lab watches the neighbour table (rtnetlink) for when it resolved.
//!
//! Not imitated: the API server (the lab decides the lease moves itself, with Cilium's
//! timings, deterministically: the taker acts exactly `retry` after the lease became free,
//! where client-go waits a jittered retry period); backends in pods (each node serves the VIPs
//! itself); veths do not filter by MAC, so the lab does not prove anything a switch's MAC
//! learning would change.
use crate::sim::{servers, Lab, LabSpec, RestartOpts, RestartReport};
use crate::sys::fixture::{validate_prefix, RUN_ROOT};
use crate::sys::process::{self, Proc};
use crate::sys::{self, check_root, netns, now_ns};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

mod restart;

pub use crate::sim::addr::{node_addr, LAN_ROUTER};
/// The LAN client, where a witness runs.
pub const CLIENT_ADDR: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 100);
/// The port a witness in the client namespace listens on.
pub const WITNESS_PORT: u16 = 9310;
const ZONE: &str = "lab.stepguard.test";

/// The LAN's IPv6 prefix (documentation range, RFC 3849), /64.
const LAN6: [u16; 4] = [0x2001, 0xdb8, 0x113, 0];

fn lan6(host: u16) -> Ipv6Addr {
    Ipv6Addr::new(LAN6[0], LAN6[1], LAN6[2], LAN6[3], 0, 0, 0, host)
}

/// Node `i`'s IPv6 address on a dual-stack LAN.
pub fn node_addr6(i: u8) -> Ipv6Addr {
    lan6(1 + i as u16)
}

/// The LAN client's IPv6 address on a dual-stack LAN.
pub fn client_addr6() -> Ipv6Addr {
    lan6(0x100)
}

/// An L2-announced LoadBalancer VIP on the LAN.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct LanVip {
    pub name: String,
    pub addr: IpAddr,
    pub port: u16,
    /// `http` or `dns`.
    pub probe: String,
}

impl LanVip {
    /// The VIP as an address with its host prefix length, as `ip addr` prints it.
    fn cidr(&self) -> String {
        match self.addr {
            IpAddr::V4(a) => format!("{a}/32"),
            IpAddr::V6(a) => format!("{a}/128"),
        }
    }

    /// The node that holds its lease when the LAN comes up.
    fn first_holder(&self) -> u8 {
        if matches!(self.name.as_str(), "dns-b" | "dns6") {
            1
        } else {
            0
        }
    }
}

/// The gateway (HTTP) and two DNS VIPs (two resolvers, like the PiHole replicas behind two
/// Services); their leases start on nodes 0, 0 and 1.
pub fn vips() -> Vec<LanVip> {
    let v = |name: &str, last: u8, port: u16, probe: &str| LanVip {
        name: name.into(),
        addr: Ipv4Addr::new(203, 0, 113, last).into(),
        port,
        probe: probe.into(),
    };
    vec![
        v("gateway", 200, 80, "http"),
        v("dns-a", 53, 53, "dns"),
        v("dns-b", 54, 53, "dns"),
    ]
}

/// The IPv6 VIPs of a dual-stack LAN: a gateway (HTTP) and a resolver; their leases start on
/// nodes 0 and 1.
pub fn vips6() -> Vec<LanVip> {
    let v = |name: &str, host: u16, port: u16, probe: &str| LanVip {
        name: name.into(),
        addr: lan6(host).into(),
        port,
        probe: probe.into(),
    };
    vec![v("gateway6", 0xc8, 80, "http"), v("dns6", 0x35, 53, "dns")]
}

mod ms {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;
    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_millis() as u64)
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_millis(u64::deserialize(d)?))
    }
}

/// Cilium's lease timings (`l2-announcements-lease-duration`, `-renew-deadline`,
/// `-retry-period`), in milliseconds on disk.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct LeaseTimings {
    #[serde(with = "ms")]
    pub duration: Duration,
    #[serde(with = "ms")]
    pub renew: Duration,
    #[serde(with = "ms")]
    pub retry: Duration,
}

impl Default for LeaseTimings {
    /// Cilium's defaults: 15 s, 5 s, 2 s.
    fn default() -> Self {
        Self {
            duration: Duration::from_secs(15),
            renew: Duration::from_secs(5),
            retry: Duration::from_secs(2),
        }
    }
}

impl LeaseTimings {
    /// Cilium's `leaseTimings()` sanity rules: a lease under 1 s becomes 1 s; a renew deadline
    /// not below the lease becomes half of it; a retry period not below the renew deadline
    /// (over client-go's jitter factor 1.2) becomes half the renew deadline.
    pub fn sane(mut self) -> Self {
        self.duration = self.duration.max(Duration::from_secs(1));
        if self.duration <= self.renew {
            self.renew = self.duration / 2;
        }
        if self.renew.as_secs_f64() <= 1.2 * self.retry.as_secs_f64() {
            self.retry = self.renew / 2;
        }
        self
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LanSpec {
    pub prefix: String,
    pub nodes: u8,
    pub profile: crate::sim::Profile,
    pub attach: crate::sim::AttachMode,
    pub lease: LeaseTimings,
    /// The nodes reach each other's pods over the overlay (`cilium_vxlan`), each has a
    /// health endpoint, and every node's agent probes the other nodes' health endpoints as
    /// east-west targets.
    #[serde(default)]
    pub east_west: bool,
    /// A dual-stack LAN: the nodes run with `enable-ipv6` and the IPv6 VIPs of [`vips6`]
    /// are announced beside the IPv4 ones (Cilium 1.19 or later).
    #[serde(default)]
    pub ipv6: bool,
    /// The unsolicited neighbour advertisement a taker sends for an IPv6 VIP.
    #[serde(default)]
    pub na: UnsolicitedNa,
}

/// Which unsolicited neighbour advertisement Cilium's `gneigh` sends for a new IPv6 entry
/// (docs/cilium-fidelity.md, "IPv6 L2 announcements").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UnsolicitedNa {
    /// v1.19.5 and later, v1.20: Override flag and a Target link-layer address option; it moves a
    /// client's existing entry, as a gratuitous ARP does.
    #[default]
    Standard,
    /// v1.19.0 to v1.19.4: no Override flag, a Source link-layer address option (which a
    /// Linux client ignores in an NA): the client's entry keeps the old MAC (and its state).
    Early,
}

impl std::str::FromStr for UnsolicitedNa {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "standard" => Ok(Self::Standard),
            "early" => Ok(Self::Early),
            _ => bail!("unsolicited NA {s:?}: expected standard or early"),
        }
    }
}

impl LanSpec {
    pub fn new(prefix: impl Into<String>) -> Self {
        Self {
            prefix: prefix.into(),
            nodes: 2,
            profile: crate::sim::Profile::V1_18,
            attach: crate::sim::AttachMode::Tcx,
            lease: LeaseTimings::default(),
            east_west: false,
            ipv6: false,
            na: UnsolicitedNa::Standard,
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LanState {
    pub spec: LanSpec,
    pub run_dir: PathBuf,
    /// Namespaces this LAN created itself (the segment and the client); the nodes are labs.
    pub netns: Vec<String>,
    /// Prefixes of the node labs, by index.
    pub nodes: Vec<String>,
    /// VIP name → index of the node holding its lease.
    pub holders: BTreeMap<String, u8>,
    /// Node index → the VIPs in its L2 responder map (`cilium_l2_responder_v4`): held ones,
    /// and stale ones its reconciliation has not deleted. Empty in state files from before
    /// issue 26: the holders' VIPs.
    #[serde(default)]
    pub entries: BTreeMap<u8, std::collections::BTreeSet<String>>,
    pub procs: Vec<Proc>,
    pub ready: bool,
}

pub struct LanLab {
    pub state: LanState,
}

/// One VIP's ground truth across a node restart, as the lab made it happen.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VipTruth {
    pub name: String,
    pub addr: IpAddr,
    pub holder_before: u8,
    pub holder_after: u8,
    /// When the new holder announced itself: wall clock ns just before and just after its
    /// gratuitous ARP.
    pub takeover: Option<(u128, u128)>,
    /// When the VIP stopped answering for the LAN client (the ARP entry the client uses points
    /// at a node whose datapath drops): the instant lies in [.0, .1]. None: it never stopped.
    pub stopped: Option<(u128, u128)>,
    /// When it answered again (the datapath back, the client moved by the gratuitous ARP, or
    /// the client's kernel resolved the VIP again after forgetting it).
    pub resumed: Option<(u128, u128)>,
    /// The taker had no entry of its own and sent a gratuitous ARP, or an unsolicited NA that
    /// moves a client (false: a stale entry of its own was there, so it sent none, or it sent
    /// v1.19.0–v1.19.4's NA, which does not move a client: either way the client was not moved).
    #[serde(default)]
    pub takeover_garp: bool,
    /// The restarted node's responder reconciliation deleted its entry at the agent's start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flushed: Option<(u128, u128)>,
    /// The restarted node, still the holder, re-added the entry with a gratuitous ARP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reannounced: Option<(u128, u128)>,
    /// The holder's agent, stopping gracefully, withdrew its entry (nobody answers ARP for
    /// the VIP until a taker announces it or the restarted holder re-adds it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub withdrawn: Option<(u128, u128)>,
    /// The LAN client's kernel resolved the VIP again after forgetting it (rtnetlink).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_resolved_ns: Option<u128>,
}

/// How the restarted agent's L2 responder reconciles `cilium_l2_responder_v4` at its start,
/// against an `l2-announce` table nothing has filled yet (docs/cilium-fidelity.md, "L2
/// responder at start").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ResponderFlush {
    /// Cilium 1.16 to 1.19.0-dev as read: every undesired key is collected through one
    /// reused pointer, so only the entry iterated last is deleted (cilium/cilium#45068).
    /// The lab's iteration order is its VIP order (the real one is the hash map's).
    Last,
    /// After cilium/cilium#45197, as v1.19.7 and v1.20.2 (the releases the users run) do:
    /// every entry is deleted.
    #[default]
    All,
    /// Nothing is deleted (the lab before issue 26).
    None,
}

impl std::str::FromStr for ResponderFlush {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "last" => Ok(Self::Last),
            "all" => Ok(Self::All),
            "none" => Ok(Self::None),
            _ => bail!("responder flush {s:?}: expected last, all or none"),
        }
    }
}

/// Whose neighbour entries are forgotten during a restart, and when.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Forget {
    /// None: the LAN client's (`eth0`: the VIPs); `Some(i)`: node `i`'s on `eth1` (the
    /// other nodes, its overlay peers).
    pub on: Option<u8>,
    /// After the agent went down; None: right after its responder's reconciliation at start.
    #[serde(default, with = "opt_ms")]
    pub after: Option<Duration>,
}

mod opt_ms {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;
    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_some(&(d.as_millis() as u64)),
            None => s.serialize_none(),
        }
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Ok(Option::<u64>::deserialize(d)?.map(Duration::from_millis))
    }
}

/// A LAN restart's lease and responder behaviour (Cilium's, by default).
#[derive(Clone, Debug)]
pub struct LanRestartOpts {
    /// The agent crashes: nothing is released; the leases expire.
    pub crash: bool,
    /// The pod's termination grace (Helm `terminationGracePeriodSeconds`: 1 s in 1.16 to
    /// 1.19, the preStop hook included).
    pub grace: Duration,
    /// From the pod's termination to its lease releases reaching the API server (the preStop
    /// hook, the agent's shutdown up to its leader elections, one Update per lease). Not
    /// under `grace`: the agent is killed first and nothing is released.
    pub release_takes: Duration,
    pub flush: ResponderFlush,
    /// From the new agent's start to its leases (re)acquired and the table filled (its
    /// informers synced, a lease round trip): when missing entries are re-added. Not
    /// measured on a real agent; 1 s by default.
    pub reacquire_after: Duration,
    pub forget: Option<Forget>,
}

impl Default for LanRestartOpts {
    fn default() -> Self {
        Self {
            crash: false,
            grace: Duration::from_secs(1),
            release_takes: Duration::ZERO,
            flush: ResponderFlush::All,
            reacquire_after: Duration::from_secs(1),
            forget: None,
        }
    }
}

/// The neighbour entries a restart forgot, and what the kernel did with them.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Forgotten {
    /// The namespace whose entries were flushed, and the device.
    pub netns: String,
    pub dev: String,
    /// Wall clock ns just before and after `ip neigh flush dev DEV`.
    pub at: (u128, u128),
    /// Every change of the namespace's neighbour table while the lab watched (rtnetlink).
    pub events: Vec<sys::neigh::NeighEvent>,
}

impl Forgotten {
    /// When `addr` had a usable entry again after it was forgotten: the first valid state
    /// after its deletion (the kernel sends the packets it queued at that moment).
    /// Events are taken in the order the kernel sent them: the first valid one after the
    /// flush's deletion of `addr` (after the flush began, when there was nothing to delete).
    pub fn resolved(&self, addr: IpAddr) -> Option<u128> {
        let mine: Vec<&sys::neigh::NeighEvent> =
            self.events.iter().filter(|e| e.addr == addr).collect();
        let from = match mine.iter().position(|e| e.deleted && e.at_ns >= self.at.0) {
            Some(d) => d + 1,
            None => mine
                .iter()
                .position(|e| e.at_ns > self.at.1)
                .unwrap_or(mine.len()),
        };
        mine[from..].iter().find(|e| e.valid()).map(|e| e.at_ns)
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LanRestartReport {
    pub node: u8,
    pub crash: bool,
    pub lease: LeaseTimings,
    /// A graceful stop: whether the leases were released within the grace (None: a crash).
    #[serde(default)]
    pub released: Option<bool>,
    #[serde(default)]
    pub flush: ResponderFlush,
    /// The neighbour entries forgotten during the restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forgot: Option<Forgotten>,
    pub vips: Vec<VipTruth>,
    /// How late the lease clock finished its latest-running move (a takeover, the responder
    /// going quiet, a forget, a re-acquisition) against Cilium's timeline, ms. The kernel
    /// changes behind each move wait for the host's RTNL lock, which another test creating or
    /// deleting a thousand interfaces can hold for seconds: past a few cadences, the restart
    /// did not follow the timeline it was asked for (the truth above still says what happened).
    #[serde(default)]
    pub clock_late_ms: f64,
    /// The node's own restart, as [`Lab::restart`] reports it.
    pub restart: RestartReport,
}

fn state_file(run_dir: &Path) -> PathBuf {
    run_dir.join("lan.json")
}

impl LanLab {
    pub fn up(spec: LanSpec) -> Result<LanLab> {
        check_root()?;
        validate_prefix(&spec.prefix)?;
        if spec.prefix.len() > 13 {
            bail!("LAN lab prefix {:?} is too long: at most 13 characters (its nodes are <prefix>n<i>)", spec.prefix);
        }
        if !(2..=4).contains(&spec.nodes) {
            bail!("--nodes {}: a LAN lab has 2 to 4 nodes", spec.nodes);
        }
        if spec.ipv6
            && !matches!(
                spec.profile,
                crate::sim::Profile::V1_19 | crate::sim::Profile::V1_20
            )
        {
            bail!("--ipv6: Cilium answers Neighbor Solicitations for L2-announced VIPs from 1.19 on (cilium_l2_responder_v6): use --cilium 1.19 or 1.20");
        }
        let run_dir = Path::new(RUN_ROOT).join(&spec.prefix);
        if run_dir.exists() {
            bail!(
                "lab prefix {:?} is already in use (remove it with `stepguard-lab down --prefix {}`)",
                spec.prefix,
                spec.prefix
            );
        }
        std::fs::create_dir_all(&run_dir)?;
        let mut lan = LanLab {
            state: LanState {
                run_dir,
                netns: vec![],
                nodes: vec![],
                holders: BTreeMap::new(),
                entries: BTreeMap::new(),
                procs: vec![],
                ready: false,
                spec: LanSpec {
                    lease: spec.lease.sane(),
                    ..spec
                },
            },
        };
        lan.save()?;
        match lan.build() {
            Ok(()) => Ok(lan),
            Err(e) => {
                if let Err(d) = lan.down() {
                    eprintln!("LAN lab cleanup after a failed up also failed: {d:#}");
                }
                Err(e)
            }
        }
    }

    pub fn open(prefix: &str) -> Result<LanLab> {
        validate_prefix(prefix)?;
        Ok(LanLab {
            state: crate::sys::fixture::read("LAN lab", prefix, "lan.json")?,
        })
    }

    /// Prefixes of every LAN lab on this machine.
    pub fn list() -> Vec<String> {
        crate::sys::fixture::list("lan.json")
    }

    fn save(&self) -> Result<()> {
        crate::sys::fixture::save(&state_file(&self.state.run_dir), &self.state)
    }

    /// The VIPs of this LAN: the IPv4 ones, and the IPv6 ones when dual-stack.
    pub fn vips(&self) -> Vec<LanVip> {
        let mut v = vips();
        if self.state.spec.ipv6 {
            v.extend(vips6());
        }
        v
    }

    pub fn lan_ns(&self) -> String {
        format!("{}-lan", self.state.spec.prefix)
    }
    pub fn client_ns(&self) -> String {
        format!("{}-client", self.state.spec.prefix)
    }

    /// Node `i`'s lab.
    pub fn node(&self, i: u8) -> Result<Lab> {
        let p = self
            .state
            .nodes
            .get(i as usize)
            .with_context(|| format!("no node {i} in LAN lab {}", self.state.spec.prefix))?;
        Lab::open(p)
    }

    /// The stepguard config for the agent on node `i`: its own datapath, and the LAN VIPs as
    /// its targets, reached the way a node reaches them (locally: blind to lease moves).
    pub fn node_config(&self, i: u8) -> PathBuf {
        self.state.run_dir.join(format!("node{i}.yaml"))
    }

    /// The stepguard config for a witness in the client namespace: the LAN VIPs.
    pub fn witness_config(&self) -> PathBuf {
        self.state.run_dir.join("witness.yaml")
    }

    fn build(&mut self) -> Result<()> {
        let lan = self.lan_ns();
        let client = self.client_ns();
        self.state.netns = vec![lan.clone(), client.clone()];
        self.save()?;
        netns::add_netns(&lan)?;
        netns::ip(&lan, &["link", "add", "br0", "type", "bridge"])?;
        netns::ip(&lan, &["link", "set", "br0", "up"])?;
        netns::add_netns(&client)?;
        netns::add_veth(&client, "eth0", &lan, "client")?;
        netns::ip(&lan, &["link", "set", "client", "master", "br0"])?;
        netns::add_addr(&client, "eth0", &format!("{CLIENT_ADDR}/24"))?;
        if self.state.spec.ipv6 {
            add_addr6(&client, "eth0", &format!("{}/64", client_addr6()))?;
        }

        let s = self.state.spec.clone();
        for i in 0..s.nodes {
            let prefix = format!("{}n{i}", s.prefix);
            self.state.nodes.push(prefix.clone());
            self.save()?;
            let mut spec = LabSpec::new(prefix);
            spec.profile = s.profile;
            spec.attach = s.attach;
            spec.pods = 2;
            spec.features.ipv6 = s.ipv6;
            spec.lan = Some(crate::sim::LanPort {
                ns: lan.clone(),
                index: i,
                peers: if s.east_west {
                    (0..s.nodes).filter(|j| *j != i).collect()
                } else {
                    vec![]
                },
            });
            Lab::up(spec)?;
            if s.ipv6 {
                let ns = self.node(i)?.node_ns();
                add_addr6(&ns, "eth1", &format!("{}/64", node_addr6(i)))?;
            }
        }
        // Every node accepts every VIP (on lo) and serves it; only the holder answers ARP
        // (or NDP).
        let records: Vec<(String, String)> = self
            .vips()
            .iter()
            .map(|v| (format!("{}.{ZONE}", v.name), v.addr.to_string()))
            .collect();
        for i in 0..s.nodes {
            let node = self.node(i)?;
            let ns = node.node_ns();
            for v in self.vips() {
                if v.addr.is_ipv6() {
                    add_addr6(&ns, "lo", &v.cidr())?;
                } else {
                    netns::add_addr(&ns, "lo", &v.cidr())?;
                }
            }
            let dir = self.state.run_dir.join(format!("services-n{i}"));
            std::fs::create_dir_all(&dir)?;
            let dns: Vec<String> = self
                .vips()
                .iter()
                .filter(|v| v.probe == "dns")
                .map(|v| v.addr.to_string())
                .collect();
            let p = servers::start_dnsmasq(&ns, &dir, &dns.join(","), &records)?;
            self.state.procs.push(p);
            self.save()?;
            for gw in self.vips().into_iter().filter(|v| v.probe == "http") {
                // One nginx per gateway VIP (each with its own pid file and logs).
                let (dir, listen) = match gw.addr {
                    IpAddr::V4(a) => (dir.clone(), a.to_string()),
                    IpAddr::V6(a) => (dir.join("v6"), format!("[{a}]")),
                };
                std::fs::create_dir_all(&dir)?;
                let p = servers::start_nginx(&ns, &dir, &listen, gw.port, None)?;
                self.state.procs.push(p);
                self.save()?;
            }
            self.write_node_config(i, &node)?;
        }
        for v in self.vips().iter() {
            let holder = v.first_holder();
            self.announce(holder, v)?;
            self.state.holders.insert(v.name.clone(), holder);
            self.state
                .entries
                .entry(holder)
                .or_default()
                .insert(v.name.clone());
            self.save()?;
        }
        self.write_witness_config()?;
        // Ready: the client reaches every VIP over the LAN.
        let client = self.client_ns();
        for v in self.vips().into_iter().filter(|v| v.probe == "http") {
            let c = client.clone();
            process::wait_until(
                &format!("{} VIP from the LAN client", v.name),
                Duration::from_secs(10),
                || {
                    let addr = (v.addr, v.port).into();
                    netns::in_netns(&c, move || {
                        std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500))?;
                        Ok(())
                    })
                },
            )?;
        }
        self.state.ready = true;
        self.save()
    }

    /// Node `i` takes the VIP: the responder entry (the VIP on its LAN NIC) and a gratuitous
    /// ARP (an unsolicited neighbour advertisement for an IPv6 VIP). Returns the wall clock
    /// just before and after it went out.
    fn announce(&self, i: u8, v: &LanVip) -> Result<(u128, u128)> {
        let ns = self.node(i)?.node_ns();
        self.answer(i, v)?;
        let mac = mac_of(&ns, "eth1")?;
        let ifindex = netns::ifindex(&ns, "eth1")?;
        let ip = v.addr;
        // The frame Cilium of this profile sends (docs/cilium-fidelity.md).
        let reply = matches!(
            self.state.spec.profile,
            crate::sim::Profile::V1_16 | crate::sim::Profile::V1_17 | crate::sim::Profile::V1_18
        );
        let standard_na = self.state.spec.na == UnsolicitedNa::Standard;
        let src6 = node_addr6(i);
        netns::in_netns(&ns, move || {
            let sock = sys::packets::GarpSocket::open().context("open a packet socket")?;
            let before = now_ns();
            match ip {
                IpAddr::V4(ip) => sock
                    .send(ifindex, mac, ip, reply)
                    .context("send a gratuitous ARP")?,
                IpAddr::V6(ip) => sock
                    .send_na(ifindex, mac, src6, ip, standard_na)
                    .context("send an unsolicited neighbour advertisement")?,
            }
            let after = now_ns();
            drop(sock);
            Ok((before, after))
        })
    }

    /// Node `i`'s responder answers ARP for the VIP (idempotent; no gratuitous ARP).
    fn answer(&self, i: u8, v: &LanVip) -> Result<()> {
        let ns = self.node(i)?.node_ns();
        let have = netns::ip(&ns, &["-o", "addr", "show", "dev", "eth1"])?;
        if !have.contains(&format!("{} ", v.cidr())) {
            if v.addr.is_ipv6() {
                add_addr6(&ns, "eth1", &v.cidr())?;
            } else {
                netns::add_addr(&ns, "eth1", &v.cidr())?;
            }
        }
        Ok(())
    }

    /// Deletes the neighbour entries of `f` (the client's, or a node's), timed.
    fn forget(&self, f: &Forget) -> Result<(String, &'static str, (u128, u128))> {
        let (ns, dev) = match f.on {
            None => (self.client_ns(), "eth0"),
            Some(i) => (self.node(i)?.node_ns(), "eth1"),
        };
        let before = now_ns();
        netns::ip(&ns, &["neigh", "flush", "dev", dev])?;
        Ok((ns, dev, (before, now_ns())))
    }

    /// Node `i`'s responder stops answering ARP for the VIP.
    fn withdraw(&self, i: u8, v: &LanVip) -> Result<()> {
        let ns = self.node(i)?.node_ns();
        let have = netns::ip(&ns, &["-o", "addr", "show", "dev", "eth1"])?;
        if have.contains(&format!("{} ", v.cidr())) {
            netns::ip(&ns, &["addr", "del", &v.cidr(), "dev", "eth1"])?;
        }
        Ok(())
    }

    fn write_node_config(&self, i: u8, node: &Lab) -> Result<()> {
        let yaml = format!(
            "# stepguard config for node {i} of LAN lab {prefix} (run the agent in {ns})\n\
             bpffs: {bpffs}\n\
             cilium_config: {cfg}\n\
             cilium_api: {api}\n\
             cilium: auto\n\
             implicit_steps: {{settle: 1s, timeout: 20s}}\n\
             {targets}\
             dns:\n  resolvers: [{resolvers}]\n  names: [\"gateway.{ZONE}\"]\n",
            resolvers = if self.state.spec.ipv6 {
                format!("\"203.0.113.53:53\", \"[{}]:53\"", vips6()[1].addr)
            } else {
                "\"203.0.113.53:53\"".into()
            },
            prefix = self.state.spec.prefix,
            ns = node.node_ns(),
            bpffs = node.state.bpffs.display(),
            cfg = node.state.cilium_config.display(),
            api = node.agent_socket().display(),
            targets = targets_yaml(&self.vips())
                + &if self.state.spec.east_west {
                    east_west_yaml(i, self.state.spec.nodes)
                } else {
                    String::new()
                },
        );
        std::fs::write(self.node_config(i), yaml).context("write a node's stepguard config")
    }

    fn write_witness_config(&self) -> Result<()> {
        let yaml = format!(
            "# stepguard witness config for LAN lab {prefix} (run it in {ns}, a LAN client)\n{targets}",
            prefix = self.state.spec.prefix,
            ns = self.client_ns(),
            targets = targets_yaml(&self.vips()),
        );
        std::fs::write(self.witness_config(), yaml).context("write the witness config")
    }

    pub fn status(&self) -> serde_json::Value {
        serde_json::json!({
            "prefix": self.state.spec.prefix,
            "ready": self.state.ready,
            "lan_netns": self.lan_ns(),
            "client_netns": self.client_ns(),
            "client_address": CLIENT_ADDR,
            "witness_config": self.witness_config(),
            "nodes": (0..self.state.nodes.len() as u8).map(|i| serde_json::json!({
                "index": i,
                "prefix": self.state.nodes[i as usize],
                "address": node_addr(i),
                "netns": format!("{}-node", self.state.nodes[i as usize]),
                "stepguard_config": self.node_config(i),
            })).collect::<Vec<_>>(),
            "vips": self.vips(),
            "ipv6": self.state.spec.ipv6,
            "holders": self.state.holders,
            "lease": self.state.spec.lease,
        })
    }

    /// Removes the nodes, the client and the segment. Safe to call twice.
    pub fn down(&mut self) -> Result<()> {
        let mut errors = Vec::new();
        for p in std::mem::take(&mut self.state.procs) {
            process::stop(&p);
        }
        for prefix in self.state.nodes.clone() {
            match Lab::open(&prefix) {
                Ok(mut l) => {
                    if let Err(e) = l.down() {
                        errors.push(format!("{e:#}"));
                    }
                }
                Err(_) => {
                    // Never came up (or already down): its namespaces, if any, by name.
                    for suffix in ["node", "fabric"] {
                        let _ = netns::del_netns(&format!("{prefix}-{suffix}"));
                    }
                }
            }
        }
        for ns in self.state.netns.iter().rev() {
            if let Err(e) = netns::del_netns(ns) {
                errors.push(format!("{e:#}"));
            }
        }
        if errors.is_empty() {
            let _ = std::fs::remove_dir_all(&self.state.run_dir);
            self.state.ready = false;
            Ok(())
        } else {
            bail!(
                "LAN lab {} down: {}",
                self.state.spec.prefix,
                errors.join("; ")
            )
        }
    }
}

/// Removes the LAN lab when dropped (tests).
pub type LanGuard = crate::sys::fixture::Guard<LanLab>;

impl crate::sys::fixture::Fixture for LanLab {
    const KIND: &'static str = "LAN lab";
    fn prefix(&self) -> &str {
        &self.state.spec.prefix
    }
    fn down(&mut self) -> Result<()> {
        LanLab::down(self)
    }
}

/// A lease thread's scheduled actions.
enum Act {
    Takeover(LanVip),
    Quiet,
    Forget(Forget),
    Reacquire,
}

/// The LAN's VIPs as stepguard targets; an IPv6 gateway also gets an ICMPv6 echo target,
/// and an IPv6 resolver is asked for the IPv6 gateway's AAAA record.
fn targets_yaml(vips: &[LanVip]) -> String {
    let mut out = String::from("targets:\n");
    for v in vips {
        match v.probe.as_str() {
            "http" => {
                out.push_str(&format!(
                    "  - name: {}\n    address: \"{}\"\n    port: {}\n    probe: http\n    path: /healthz\n    expect: 200\n    timeout: 200ms\n",
                    v.name, v.addr, v.port
                ));
                if v.addr.is_ipv6() {
                    out.push_str(&format!(
                        "  - name: {}-echo\n    address: \"{}\"\n    probe: icmp\n    timeout: 200ms\n",
                        v.name, v.addr
                    ));
                }
            }
            _ if v.addr.is_ipv6() => out.push_str(&format!(
                "  - name: {}\n    address: \"{}\"\n    port: {}\n    probe: dns\n    query: gateway6.{ZONE}\n    record: AAAA\n    answers: [\"{}\"]\n    timeout: 200ms\n",
                v.name, v.addr, v.port, vips6()[0].addr
            )),
            _ => out.push_str(&format!(
                "  - name: {}\n    address: {}\n    port: {}\n    probe: dns\n    query: gateway.{ZONE}\n    timeout: 200ms\n",
                v.name, v.addr, v.port
            )),
        }
    }
    out
}

/// Adds an IPv6 address without duplicate address detection (it is usable at once; the lab
/// gives every address on its LAN once).
fn add_addr6(ns: &str, dev: &str, cidr: &str) -> Result<()> {
    netns::ip(ns, &["-6", "addr", "add", cidr, "dev", dev, "nodad"]).map(|_| ())
}

/// Node `i`'s east-west targets: every other node's health endpoint (HTTP on 4240, as
/// cilium-health probes it) and its first pod (ICMP), reached through the overlay.
fn east_west_yaml(i: u8, nodes: u8) -> String {
    let mut out = String::new();
    for j in (0..nodes).filter(|j| *j != i) {
        out.push_str(&format!(
            "  - name: health-n{j}\n    address: {}\n    port: {}\n    probe: http\n    path: /hello\n    expect: 200\n    timeout: 200ms\n    east_west: true\n",
            crate::sim::addr::health_ip(j),
            crate::sim::addr::HEALTH_PORT
        ));
        out.push_str(&format!(
            "  - name: pod0-n{j}\n    address: {}\n    probe: icmp\n    timeout: 200ms\n    east_west: true\n",
            crate::sim::addr::pod_addr(j, 0)
        ));
    }
    out
}

/// The MAC address of `dev` in `ns`.
fn mac_of(ns: &str, dev: &str) -> Result<[u8; 6]> {
    let out = netns::ip(ns, &["-o", "link", "show", "dev", dev])?;
    let text = out
        .split("link/ether ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .with_context(|| format!("no MAC address for {dev} in {ns}: {out:?}"))?;
    let mut mac = [0u8; 6];
    for (k, part) in text.split(':').enumerate().take(6) {
        mac[k] = u8::from_str_radix(part, 16).with_context(|| format!("parse MAC {text}"))?;
    }
    Ok(mac)
}
