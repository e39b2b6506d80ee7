//! What a LAN lab is: its spec and lease timings, its state, and what a restart takes and
//! reports.
use crate::sim::RestartReport;
use crate::sys;
use crate::sys::process::Proc;
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

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
    /// and stale ones its reconciliation has not deleted. Empty in state files written before the
    /// lab kept them: then the holders' VIPs.
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
    /// Nothing is deleted (as the lab did before it deleted stale entries).
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
