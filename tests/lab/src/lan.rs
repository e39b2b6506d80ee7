//! A LAN of lab nodes with Cilium's L2 announcements, and a LAN client to witness from.
//!
//! Topology: a bridge `br0` in `<prefix>-lan`; every node (a full single-node [`Lab`] with
//! prefix `<prefix>n<i>`) has its `eth1` on it at `203.0.113.<1+i>`; the client namespace
//! `<prefix>-client` has `eth0` on it at `203.0.113.100`, where a witness runs.
//!
//! What it imitates (docs/cilium-fidelity.md, "L2 announcements"):
//! - one lease per service VIP; the holder answers ARP for the VIP on its LAN NIC (Cilium: an
//!   entry in `cilium_l2_responder_v4`, answered by `cil_from_netdev`; here: the VIP as an
//!   address on `eth1` with `arp_ignore=1`, so only the holder answers);
//! - every node accepts traffic for every VIP whoever holds the lease (Cilium: `nodeport_lb4`
//!   load-balances a LoadBalancer IP on any node; here: the VIP on `lo` of every node and a
//!   backend on every node), so a client with a stale ARP entry is still served while that
//!   node's datapath forwards;
//! - a graceful agent stop releases the lease (`ReleaseOnCancel`); another node takes it at
//!   its next retry (`retry` after the release), adds the responder entry and sends a
//!   gratuitous ARP; after a crash the lease must expire first (`duration`, then `retry`);
//! - the stopped holder's responder keeps answering ARP until its agent's liveness stamp is
//!   older than the lease duration, so two nodes answer during a move; the restarted agent
//!   removes the entries of leases it no longer holds.
//!
//! Not imitated: the API server (the lab decides the lease moves itself, with Cilium's
//! timings, deterministically: the taker acts exactly `retry` after the lease became free,
//! where client-go waits a jittered retry period); backends in pods (each node serves the VIPs
//! itself); veths do not filter by MAC, so the lab does not prove anything a switch's MAC
//! learning would change.
use crate::services::{self, Proc};
use crate::{check_root, netns, now_ns, sys, validate_prefix};
use crate::{Lab, LabSpec, RestartOpts, RestartReport, RUN_ROOT};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The LAN's router address (nothing answers there; the nodes' second default route).
pub const LAN_ROUTER: &str = "203.0.113.254";
/// The LAN client, where a witness runs.
pub const CLIENT_ADDR: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 100);
/// The port a witness in the client namespace listens on.
pub const WITNESS_PORT: u16 = 9310;
const ZONE: &str = "lab.stepguard.test";

/// Node `i`'s address on the LAN.
pub fn node_addr(i: u8) -> Ipv4Addr {
    Ipv4Addr::new(203, 0, 113, 1 + i)
}

/// An L2-announced LoadBalancer VIP on the LAN.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct LanVip {
    pub name: String,
    pub addr: Ipv4Addr,
    pub port: u16,
    /// `http` or `dns`.
    pub probe: String,
}

/// The gateway (HTTP) and two DNS VIPs (two resolvers, like the PiHole replicas behind two
/// Services); their leases start on nodes 0, 0 and 1.
pub fn vips() -> Vec<LanVip> {
    let v = |name: &str, last: u8, port: u16, probe: &str| LanVip {
        name: name.into(),
        addr: Ipv4Addr::new(203, 0, 113, last),
        port,
        probe: probe.into(),
    };
    vec![
        v("gateway", 200, 80, "http"),
        v("dns-a", 53, 53, "dns"),
        v("dns-b", 54, 53, "dns"),
    ]
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
    pub profile: crate::Profile,
    pub attach: crate::AttachMode,
    pub lease: LeaseTimings,
    /// The nodes reach each other's pods over the overlay (`cilium_vxlan`), each has a
    /// health endpoint, and every node's agent probes the other nodes' health endpoints as
    /// east-west targets.
    #[serde(default)]
    pub east_west: bool,
}

impl LanSpec {
    pub fn new(prefix: impl Into<String>) -> Self {
        Self {
            prefix: prefix.into(),
            nodes: 2,
            profile: crate::Profile::V1_18,
            attach: crate::AttachMode::Tcx,
            lease: LeaseTimings::default(),
            east_west: false,
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
    pub addr: Ipv4Addr,
    pub holder_before: u8,
    pub holder_after: u8,
    /// When the new holder announced itself: wall clock ns just before and just after its
    /// gratuitous ARP.
    pub takeover: Option<(u128, u128)>,
    /// When the VIP stopped answering for the LAN client (the ARP entry the client uses points
    /// at a node whose datapath drops): the instant lies in [.0, .1]. None: it never stopped.
    pub stopped: Option<(u128, u128)>,
    /// When it answered again (the datapath back, or the client moved by the gratuitous ARP).
    pub resumed: Option<(u128, u128)>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LanRestartReport {
    pub node: u8,
    pub crash: bool,
    pub lease: LeaseTimings,
    pub vips: Vec<VipTruth>,
    /// The node's own restart, as [`Lab::restart`] reports it.
    pub restart: RestartReport,
}

fn state_file(run_dir: &Path) -> PathBuf {
    run_dir.join("lan.json")
}

/// A VIP's lease move, run on the lease thread.
struct Move {
    vip: LanVip,
    from: u8,
    to: u8,
    /// After the agent went down: the taker acts at this offset.
    takeover_after: Duration,
    /// After the agent went down: the old holder's responder goes quiet (liveness stale).
    quiet_after: Duration,
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
        let path = state_file(&Path::new(RUN_ROOT).join(prefix));
        let data = std::fs::read(&path)
            .with_context(|| format!("no LAN lab {prefix:?} (read {})", path.display()))?;
        Ok(LanLab {
            state: serde_json::from_slice(&data)
                .with_context(|| format!("parse {}", path.display()))?,
        })
    }

    /// Prefixes of every LAN lab on this machine.
    pub fn list() -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(RUN_ROOT)
            .map(|rd| {
                rd.flatten()
                    .filter(|e| state_file(&e.path()).exists())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    fn save(&self) -> Result<()> {
        let path = state_file(&self.state.run_dir);
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(&self.state)?)?;
        std::fs::rename(&tmp, &path).with_context(|| format!("write {}", path.display()))
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

        let s = self.state.spec.clone();
        for i in 0..s.nodes {
            let prefix = format!("{}n{i}", s.prefix);
            self.state.nodes.push(prefix.clone());
            self.save()?;
            let mut spec = LabSpec::new(prefix);
            spec.profile = s.profile;
            spec.attach = s.attach;
            spec.pods = 2;
            spec.lan = Some(crate::LanPort {
                ns: lan.clone(),
                index: i,
                peers: if s.east_west {
                    (0..s.nodes).filter(|j| *j != i).collect()
                } else {
                    vec![]
                },
            });
            Lab::up(spec)?;
        }
        // Every node accepts every VIP (on lo) and serves it; only the holder answers ARP.
        let records: Vec<(String, String)> = vips()
            .iter()
            .map(|v| (format!("{}.{ZONE}", v.name), v.addr.to_string()))
            .collect();
        for i in 0..s.nodes {
            let node = self.node(i)?;
            let ns = node.node_ns();
            for v in vips() {
                netns::add_addr(&ns, "lo", &format!("{}/32", v.addr))?;
            }
            let dir = self.state.run_dir.join(format!("services-n{i}"));
            std::fs::create_dir_all(&dir)?;
            let dns: Vec<String> = vips()
                .iter()
                .filter(|v| v.probe == "dns")
                .map(|v| v.addr.to_string())
                .collect();
            let p = services::start_dnsmasq(&ns, &dir, &dns.join(","), &records)?;
            self.state.procs.push(p);
            self.save()?;
            let gw = &vips()[0];
            let p = services::start_nginx(&ns, &dir, &gw.addr.to_string(), gw.port)?;
            self.state.procs.push(p);
            self.save()?;
            self.write_node_config(i, &node)?;
        }
        for (k, v) in vips().iter().enumerate() {
            let holder = if k == 2 { 1 } else { 0 };
            self.announce(holder, v)?;
            self.state.holders.insert(v.name.clone(), holder);
            self.save()?;
        }
        self.write_witness_config()?;
        // Ready: the client reaches every VIP over the LAN.
        let client = self.client_ns();
        for v in vips().into_iter().filter(|v| v.probe == "http") {
            let c = client.clone();
            services::wait_until(
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
    /// ARP. Returns the wall clock just before and after the ARP went out.
    fn announce(&self, i: u8, v: &LanVip) -> Result<(u128, u128)> {
        let ns = self.node(i)?.node_ns();
        netns::add_addr(&ns, "eth1", &format!("{}/32", v.addr))?;
        let mac = mac_of(&ns, "eth1")?;
        let ifindex = netns::ifindex(&ns, "eth1")?;
        let ip = v.addr;
        netns::in_netns(&ns, move || {
            let sock = sys::GarpSocket::open().context("open a packet socket")?;
            let before = now_ns();
            sock.send(ifindex, mac, ip)
                .context("send a gratuitous ARP")?;
            let after = now_ns();
            drop(sock);
            Ok((before, after))
        })
    }

    /// Node `i`'s responder stops answering ARP for the VIP.
    fn withdraw(&self, i: u8, v: &LanVip) -> Result<()> {
        let ns = self.node(i)?.node_ns();
        let have = netns::ip(&ns, &["-o", "addr", "show", "dev", "eth1"])?;
        if have.contains(&format!("{}/32", v.addr)) {
            netns::ip(
                &ns,
                &["addr", "del", &format!("{}/32", v.addr), "dev", "eth1"],
            )?;
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
             dns:\n  resolvers: [\"203.0.113.53:53\"]\n  names: [\"gateway.{ZONE}\"]\n",
            prefix = self.state.spec.prefix,
            ns = node.node_ns(),
            bpffs = node.state.bpffs.display(),
            cfg = node.state.cilium_config.display(),
            api = node.agent_socket().display(),
            targets = targets_yaml()
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
            targets = targets_yaml(),
        );
        std::fs::write(self.witness_config(), yaml).context("write the witness config")
    }

    /// Restarts the agent on node `i` (see [`Lab::restart`]) while the lease of every VIP it
    /// holds moves as Cilium moves it: released at a graceful stop (`crash`: not released,
    /// it expires), taken by the next node at its retry, announced with a gratuitous ARP; the
    /// old holder's responder answers until its liveness is older than the lease duration.
    pub fn restart(&mut self, i: u8, o: &RestartOpts, crash: bool) -> Result<LanRestartReport> {
        check_root()?;
        if !self.state.ready {
            bail!("LAN lab {} is not ready", self.state.spec.prefix);
        }
        let n = self.state.spec.nodes;
        if i >= n {
            bail!(
                "--node {i}: LAN lab {} has nodes 0 to {}",
                self.state.spec.prefix,
                n - 1
            );
        }
        let lease = self.state.spec.lease;
        let moves: Vec<Move> = vips()
            .into_iter()
            .filter(|v| self.state.holders.get(&v.name) == Some(&i))
            .map(|vip| Move {
                vip,
                from: i,
                to: (i + 1) % n,
                takeover_after: if crash {
                    lease.duration + lease.retry
                } else {
                    lease.retry
                },
                quiet_after: lease.duration,
            })
            .collect();
        let mut node = self.node(i)?;
        let back = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel::<Instant>();
        let lease_thread = {
            let me = LanLab {
                state: self.state.clone(),
            };
            let back = back.clone();
            let moves: Vec<(LanVip, u8, u8, Duration, Duration)> = moves
                .iter()
                .map(|m| (m.vip.clone(), m.from, m.to, m.takeover_after, m.quiet_after))
                .collect();
            std::thread::spawn(move || -> Result<BTreeMap<String, (u128, u128)>> {
                let mut taken = BTreeMap::new();
                let Ok(down_at) = rx.recv() else {
                    return Ok(taken);
                };
                // Events in time order: (offset, vip index, takeover?).
                let mut events: Vec<(Duration, usize, bool)> = Vec::new();
                for (k, m) in moves.iter().enumerate() {
                    events.push((m.3, k, true));
                    events.push((m.4, k, false));
                }
                events.sort_by_key(|e| e.0);
                'events: for (at, k, takeover) in events {
                    let deadline = down_at + at;
                    // Sleep in slices: once the agent is back, a crashed holder keeps its
                    // lease (it renews before the lease expires) and a responder it still
                    // runs never goes quiet; only a released lease is still taken.
                    while Instant::now() < deadline {
                        if back.load(Ordering::SeqCst) && (crash || !takeover) {
                            continue 'events;
                        }
                        std::thread::sleep(
                            deadline
                                .saturating_duration_since(Instant::now())
                                .min(Duration::from_millis(2)),
                        );
                    }
                    let (vip, from, to, _, _) = &moves[k];
                    if takeover {
                        if crash && back.load(Ordering::SeqCst) {
                            continue;
                        }
                        let t = me.announce(*to, vip)?;
                        taken.insert(vip.name.clone(), t);
                    } else if !back.load(Ordering::SeqCst) {
                        // The stopped agent's liveness stamp is older than the lease: its
                        // responder goes quiet.
                        me.withdraw(*from, vip)?;
                    }
                }
                Ok(taken)
            })
        };
        let mut tx = Some(tx);
        let restarted = node.restart_with(o, &mut |_| {
            if let Some(tx) = tx.take() {
                let _ = tx.send(Instant::now());
            }
        });
        back.store(true, Ordering::SeqCst);
        drop(tx);
        let taken = lease_thread
            .join()
            .map_err(|_| anyhow::anyhow!("the lease thread panicked"))??;
        let r = restarted?;
        // The restarted agent reconciles its responder map: entries of leases it no longer
        // holds are removed.
        let mut vips_out = Vec::new();
        for m in &moves {
            let took = taken.get(&m.vip.name).copied();
            if took.is_some() {
                self.state.holders.insert(m.vip.name.clone(), m.to);
                self.withdraw(m.from, &m.vip)?;
            } else {
                // Still the holder (a crash shorter than the lease): the agent recreates a
                // responder entry that went quiet, with a gratuitous ARP.
                let ns = self.node(m.from)?.node_ns();
                let have = netns::ip(&ns, &["-o", "addr", "show", "dev", "eth1"])?;
                if !have.contains(&format!("{}/32", m.vip.addr)) {
                    self.announce(m.from, &m.vip)?;
                }
            }
            let (stopped, resumed) = if r.blackhole {
                let back = (r.blackhole_off_ns, r.blackhole_end_ns);
                let resumed = match took {
                    Some(t) if t.0 < back.0 => t,
                    _ => back,
                };
                (
                    Some((r.blackhole_start_ns, r.blackhole_on_ns)),
                    Some(resumed),
                )
            } else {
                (None, None)
            };
            vips_out.push(VipTruth {
                name: m.vip.name.clone(),
                addr: m.vip.addr,
                holder_before: m.from,
                holder_after: if took.is_some() { m.to } else { m.from },
                takeover: took,
                stopped,
                resumed,
            });
        }
        for v in vips()
            .iter()
            .filter(|v| !moves.iter().any(|m| m.vip == **v))
        {
            let h = self.state.holders.get(&v.name).copied().unwrap_or(0);
            vips_out.push(VipTruth {
                name: v.name.clone(),
                addr: v.addr,
                holder_before: h,
                holder_after: h,
                takeover: None,
                stopped: None,
                resumed: None,
            });
        }
        self.save()?;
        Ok(LanRestartReport {
            node: i,
            crash,
            lease,
            vips: vips_out,
            restart: r,
        })
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
            "vips": vips(),
            "holders": self.state.holders,
            "lease": self.state.spec.lease,
        })
    }

    /// Removes the nodes, the client and the segment. Safe to call twice.
    pub fn down(&mut self) -> Result<()> {
        let mut errors = Vec::new();
        for p in std::mem::take(&mut self.state.procs) {
            services::stop(&p);
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
pub struct LanGuard(pub LanLab);

impl Drop for LanGuard {
    fn drop(&mut self) {
        if let Err(e) = self.0.down() {
            eprintln!("LAN lab {}: {e:#}", self.0.state.spec.prefix);
        }
    }
}

impl std::ops::Deref for LanGuard {
    type Target = LanLab;
    fn deref(&self) -> &LanLab {
        &self.0
    }
}

impl std::ops::DerefMut for LanGuard {
    fn deref_mut(&mut self) -> &mut LanLab {
        &mut self.0
    }
}

fn targets_yaml() -> String {
    let mut out = String::from("targets:\n");
    for v in vips() {
        match v.probe.as_str() {
            "http" => out.push_str(&format!(
                "  - name: {}\n    address: {}\n    port: {}\n    probe: http\n    path: /healthz\n    expect: 200\n    timeout: 200ms\n",
                v.name, v.addr, v.port
            )),
            _ => out.push_str(&format!(
                "  - name: {}\n    address: {}\n    port: {}\n    probe: dns\n    query: gateway.{ZONE}\n    timeout: 200ms\n",
                v.name, v.addr, v.port
            )),
        }
    }
    out
}

/// Node `i`'s east-west targets: every other node's health endpoint (HTTP on 4240, as
/// cilium-health probes it) and its first pod (ICMP), reached through the overlay.
fn east_west_yaml(i: u8, nodes: u8) -> String {
    let mut out = String::new();
    for j in (0..nodes).filter(|j| *j != i) {
        out.push_str(&format!(
            "  - name: health-n{j}\n    address: {}\n    port: {}\n    probe: http\n    path: /hello\n    expect: 200\n    timeout: 200ms\n    east_west: true\n",
            crate::health_ip(j),
            crate::HEALTH_PORT
        ));
        out.push_str(&format!(
            "  - name: pod0-n{j}\n    address: {}\n    probe: icmp\n    timeout: 200ms\n    east_west: true\n",
            crate::pod_addr(j, 0)
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
