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
mod addr;
mod config;
mod restart;
mod spec;

pub use addr::*;
pub use spec::*;

use crate::sim::{servers, Lab, LabSpec, RestartOpts};
use crate::sys::fixture::{validate_prefix, RUN_ROOT};
use crate::sys::process;
use crate::sys::{self, check_root, netns, now_ns};
use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

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

/// Adds an IPv6 address without duplicate address detection (it is usable at once; the lab
/// gives every address on its LAN once).
fn add_addr6(ns: &str, dev: &str, cidr: &str) -> Result<()> {
    netns::ip(ns, &["-6", "addr", "add", cidr, "dev", dev, "nodad"]).map(|_| ())
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
