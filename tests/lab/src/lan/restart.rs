//! Restarting a LAN node's agent: the lease clock that moves the L2 announcements as Cilium's
//! lease timings do, the responder's flush, and the ground truth a witness is judged by.
use super::*;

impl LanLab {
    /// Restarts the agent on node `i` (see [`Lab::restart`]) with Cilium's lease and
    /// responder behaviour ([`LanRestartOpts::default`]); `crash`: nothing is released.
    pub fn restart(&mut self, i: u8, o: &RestartOpts, crash: bool) -> Result<LanRestartReport> {
        self.restart_lan(
            i,
            o,
            &LanRestartOpts {
                crash,
                ..Default::default()
            },
        )
    }

    /// Restarts the agent on node `i` (see [`Lab::restart`]) while the lease of every VIP it
    /// holds moves as Cilium moves it: released at a graceful stop within the grace (else,
    /// and after a crash, it expires), taken by the next node at its retry, announced with a
    /// gratuitous ARP when the taker had no entry; a graceful stop deletes the old holder's
    /// entries for the leases it led at once, a crashed holder's responder answers until its
    /// liveness is older than the lease duration; the new agent's responder reconciles
    /// at its start and re-adds what it still holds once its leases are acquired (see the
    /// module's documentation).
    pub fn restart_lan(
        &mut self,
        i: u8,
        o: &RestartOpts,
        lo: &LanRestartOpts,
    ) -> Result<LanRestartReport> {
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
        if let Some(j) = lo.forget.and_then(|f| f.on).filter(|j| *j >= n) {
            bail!(
                "--forget-neighbours node{j}: LAN lab has nodes 0 to {}",
                n - 1
            );
        }
        if self.state.entries.is_empty() {
            for (v, h) in &self.state.holders {
                self.state.entries.entry(*h).or_default().insert(v.clone());
            }
        }
        let holders_before = self.state.holders.clone();
        // The neighbour table the restart forgets is watched from before it.
        let watch = match lo.forget {
            Some(f) => {
                let ns = match f.on {
                    None => self.client_ns(),
                    Some(j) => self.node(j)?.node_ns(),
                };
                Some(
                    sys::neigh::NeighWatch::start(&netns::netns_path(&ns))
                        .with_context(|| format!("watch the neighbour table of {ns}"))?,
                )
            }
            None => None,
        };
        let mut node = self.node(i)?;
        let (tx, rx) = std::sync::mpsc::channel::<(crate::sim::AgentEvent, Instant)>();
        let lease_thread = {
            let me = LanLab {
                state: self.state.clone(),
            };
            let lo = lo.clone();
            std::thread::spawn(move || me.lease_clock(i, &lo, rx))
        };
        let restarted = node.restart_with(o, &mut |e| {
            let _ = tx.send((e, Instant::now()));
        });
        drop(tx);
        let (clock, clock_result) = lease_thread
            .join()
            .map_err(|_| anyhow::anyhow!("the lease thread panicked"))?;
        // Who holds and who answers is recorded whatever else failed (the state must match
        // the namespaces).
        self.state.holders = clock.holders.clone();
        self.state.entries = clock.entries.clone();
        self.save()?;
        clock_result.context("the lease clock")?;
        let r = restarted?;
        // The forgotten entries resolve when something answers (a gratuitous ARP, an ARP
        // reply to a retransmitted request): watched until each has, or 5 s.
        let forgot = match (watch, clock.forgot) {
            (Some(w), Some((ns, dev, at))) => {
                let addrs: Vec<IpAddr> = match lo.forget.and_then(|f| f.on) {
                    None => self.vips().iter().map(|v| v.addr).collect(),
                    Some(j) => (0..n)
                        .filter(|k| *k != j)
                        .map(|k| node_addr(k).into())
                        .collect(),
                };
                let deadline = Instant::now() + Duration::from_secs(5);
                let mut f = Forgotten {
                    netns: ns,
                    dev: dev.into(),
                    at,
                    events: vec![],
                };
                // The watcher's events are only read when it stops: peek by polling the
                // kernel's table, then stop it.
                while Instant::now() < deadline && !self.all_resolved(&f, &addrs)? {
                    std::thread::sleep(Duration::from_millis(20));
                }
                f.events = w.stop().context("the neighbour watcher")?;
                Some(f)
            }
            (Some(w), None) => {
                let _ = w.stop();
                None
            }
            _ => None,
        };
        let resolved = |addr: IpAddr| forgot.as_ref().and_then(|f| f.resolved(addr));
        let client_forgot = forgot
            .as_ref()
            .filter(|_| lo.forget.is_some_and(|f| f.on.is_none()));
        let mut vips_out = Vec::new();
        for v in self.vips() {
            let before = holders_before.get(&v.name).copied().unwrap_or(0);
            let after = self.state.holders.get(&v.name).copied().unwrap_or(before);
            let took = clock.taken.get(&v.name).copied();
            let flushed = clock
                .flushed
                .get(&v.name)
                .copied()
                .filter(|_| clock.held_at_start.contains(&v.name));
            let reannounced = clock.reannounced.get(&v.name).copied();
            let withdrawn = clock.withdrawn.get(&v.name).copied();
            let client_resolved_ns = client_forgot.and_then(|_| resolved(v.addr));
            // The client's entry points at the holder; while that node's datapath drops,
            // the VIP is down for it, until the gratuitous ARP of a taker without an entry
            // moves it, or the datapath is back.
            let (mut stopped, mut resumed) = if r.blackhole && before == i {
                let back = (r.blackhole_off_ns, r.blackhole_end_ns);
                let resumed = match took {
                    Some((t0, t1, true)) if t0 < back.0 => (t0, t1),
                    _ => back,
                };
                (
                    Some((r.blackhole_start_ns, r.blackhole_on_ns)),
                    Some(resumed),
                )
            } else {
                (None, None)
            };
            if let Some(f) = client_forgot {
                match (stopped, resumed) {
                    // Forgotten during that outage: the client's kernel queues for the VIP
                    // until something answers its ARP, whatever the datapath does.
                    (Some(st), Some(res)) if f.at.1 >= st.0 && f.at.0 <= res.1 => {
                        resumed = client_resolved_ns.map(|t| (t, t));
                    }
                    // Forgotten while nobody answers ARP for the VIP — the holder's responder
                    // flushed at its start, or its entry withdrawn at a graceful stop — until
                    // it re-adds the entry or a taker announces: down for the client from the
                    // moment it forgot until its kernel resolved the VIP again.
                    (None, _) if flushed.or(withdrawn).is_some_and(|fl| f.at.0 >= fl.0) => {
                        let silent_until = reannounced
                            .map(|x| x.0)
                            .or(took.filter(|t| t.2).map(|t| t.0));
                        if silent_until.is_none_or(|u| f.at.1 <= u) {
                            stopped = Some(f.at);
                            resumed = client_resolved_ns.map(|t| (t, t));
                        }
                    }
                    _ => {}
                }
            }
            vips_out.push(VipTruth {
                name: v.name.clone(),
                addr: v.addr,
                holder_before: before,
                holder_after: after,
                takeover: took.map(|t| (t.0, t.1)),
                takeover_garp: took.is_some_and(|t| t.2),
                stopped,
                resumed,
                flushed,
                reannounced,
                withdrawn,
                client_resolved_ns,
            });
        }
        Ok(LanRestartReport {
            node: i,
            crash: lo.crash,
            lease: self.state.spec.lease,
            released: clock.released,
            flush: lo.flush,
            forgot,
            vips: vips_out,
            clock_late_ms: clock.late.as_secs_f64() * 1e3,
            restart: r,
        })
    }

    /// Whether a new entry's announcement moves a LAN client's existing neighbour entry: a
    /// gratuitous ARP does, and the standard unsolicited NA (Override, Target link-layer
    /// address); with v1.19.0–v1.19.4's (neither) the client's entry keeps the old holder's
    /// MAC, so it keeps sending there until its own neighbour probes fail (module
    /// documentation).
    fn announcement_moves(&self, v: &LanVip) -> bool {
        v.addr.is_ipv4() || self.state.spec.na == UnsolicitedNa::Standard
    }

    /// Whether every address in `addrs` has a usable entry in the forgotten table now.
    fn all_resolved(&self, f: &Forgotten, addrs: &[IpAddr]) -> Result<bool> {
        let out = netns::ip(&f.netns, &["neigh", "show", "dev", &f.dev])?;
        Ok(addrs.iter().all(|a| {
            out.lines().any(|l| {
                l.split_whitespace().next() == Some(&a.to_string())
                    && ["REACHABLE", "STALE", "DELAY", "PROBE", "PERMANENT"]
                        .iter()
                        .any(|s| l.contains(s))
            })
        }))
    }

    /// The lease thread of a restart of node `i`: Cilium's lease and responder timeline from
    /// the agent's stop (see [`LanLab::restart_lan`]). Ends when every scheduled move has
    /// happened and the restart is over.
    /// Returns what it did, and the error that stopped it early, if any (what it did until
    /// then is still what the namespaces show).
    fn lease_clock(
        &self,
        i: u8,
        lo: &LanRestartOpts,
        rx: std::sync::mpsc::Receiver<(crate::sim::AgentEvent, Instant)>,
    ) -> (LeaseClock, Result<()>) {
        let mut c = LeaseClock {
            holders: self.state.holders.clone(),
            entries: self.state.entries.clone(),
            ..Default::default()
        };
        let r = self.run_lease_clock(i, lo, rx, &mut c);
        (c, r)
    }

    fn run_lease_clock(
        &self,
        i: u8,
        lo: &LanRestartOpts,
        rx: std::sync::mpsc::Receiver<(crate::sim::AgentEvent, Instant)>,
        c: &mut LeaseClock,
    ) -> Result<()> {
        let lease = self.state.spec.lease;
        let n = self.state.spec.nodes;
        let to = (i + 1) % n;
        let down = loop {
            match rx.recv() {
                Ok((crate::sim::AgentEvent::Down(_), at)) => break at,
                Ok(_) => continue,
                Err(_) => return Ok(()),
            }
        };
        let held: Vec<LanVip> = self
            .vips()
            .into_iter()
            .filter(|v| c.holders.get(&v.name) == Some(&i))
            .collect();
        c.held_at_start = held.iter().map(|v| v.name.clone()).collect();
        let released = !lo.crash && lo.release_takes < lo.grace;
        c.released = (!lo.crash).then_some(released);
        if !lo.crash {
            // A stopping agent deletes the responder entries of the leases it led at once
            // (measured on two real 1.20.2 agents: 17 ms after SIGTERM, before the release
            // was seen; docs/cilium-fidelity.md, "L2 announcements on two real agents"). Its
            // stale entries stay, quiet once its liveness is a lease duration old.
            for v in &held {
                let t0 = now_ns();
                self.withdraw(i, v)?;
                c.withdrawn.insert(v.name.clone(), (t0, now_ns()));
                if let Some(e) = c.entries.get_mut(&i) {
                    e.remove(&v.name);
                }
            }
        }
        let mut sched: Vec<(Instant, Act)> = Vec::new();
        for v in &held {
            let at = if released {
                down + lo.release_takes + lease.retry
            } else {
                down + lease.duration + lease.retry
            };
            sched.push((at, Act::Takeover(v.clone())));
        }
        sched.push((down + lease.duration, Act::Quiet));
        if let Some(f) = lo.forget {
            if let Some(d) = f.after {
                sched.push((down + d, Act::Forget(f)));
            }
        }
        let mut started = false;
        let mut renewed = false;
        let mut back = false;
        loop {
            sched.sort_by_key(|x| x.0);
            let next = sched.first().map(|x| x.0);
            if back {
                match next {
                    None => break,
                    Some(t) => std::thread::sleep(
                        t.saturating_duration_since(Instant::now())
                            .min(Duration::from_millis(2)),
                    ),
                }
            } else {
                let got = match next {
                    Some(t) => rx
                        .recv_timeout(t.saturating_duration_since(Instant::now()))
                        .map_err(|e| e == std::sync::mpsc::RecvTimeoutError::Disconnected),
                    None => rx.recv().map_err(|_| true),
                };
                match got {
                    Ok((crate::sim::AgentEvent::Started(ns), at)) => {
                        started = true;
                        c.started = Some(ns);
                        // Its liveness stamp is fresh again: the entries that survive the
                        // reconciliation answer again; the reconciliation runs against an
                        // empty table.
                        let present: Vec<LanVip> = self
                            .vips()
                            .into_iter()
                            .filter(|v| c.entries.get(&i).is_some_and(|e| e.contains(&v.name)))
                            .collect();
                        let gone: Vec<LanVip> = match lo.flush {
                            ResponderFlush::Last => present.last().cloned().into_iter().collect(),
                            ResponderFlush::All => present.clone(),
                            ResponderFlush::None => vec![],
                        };
                        for v in &present {
                            if gone.contains(v) {
                                let t0 = now_ns();
                                self.withdraw(i, v)?;
                                c.flushed.insert(v.name.clone(), (t0, now_ns()));
                                if let Some(e) = c.entries.get_mut(&i) {
                                    e.remove(&v.name);
                                }
                            } else {
                                self.answer(i, v)?;
                            }
                        }
                        if let Some(f) = lo.forget.filter(|f| f.after.is_none()) {
                            c.forgot = Some(self.forget(&f)?);
                        }
                        sched.retain(|x| !matches!(x.1, Act::Quiet));
                        sched.push((at + lo.reacquire_after, Act::Reacquire));
                    }
                    Ok(_) => {}
                    Err(false) => {}
                    Err(true) => back = true,
                }
            }
            let now = Instant::now();
            while sched.first().is_some_and(|x| x.0 <= now) {
                let (due, act) = sched.remove(0);
                match act {
                    Act::Quiet => {
                        // The stopped agent's liveness stamp is older than the lease: its
                        // responder goes quiet (its entries stay in the map).
                        if !started {
                            for v in self.vips() {
                                self.withdraw(i, &v)?;
                            }
                        }
                    }
                    Act::Forget(f) => c.forgot = Some(self.forget(&f)?),
                    Act::Takeover(v) => {
                        // Renewed (an unexpired lease of its own) or re-acquired (a free
                        // one) by the restarted agent first: it stays.
                        if renewed || c.holders.get(&v.name) != Some(&i) {
                            continue;
                        }
                        c.holders.insert(v.name.clone(), to);
                        let taker = c.entries.entry(to).or_default();
                        let had = !taker.insert(v.name.clone());
                        if had {
                            // `garpOnNewEntry` finds the stale entry: no gratuitous ARP.
                            self.answer(to, &v)?;
                            let t = now_ns();
                            c.taken.insert(v.name.clone(), (t, t, false));
                        } else {
                            let (t0, t1) = self.announce(to, &v)?;
                            c.taken
                                .insert(v.name.clone(), (t0, t1, self.announcement_moves(&v)));
                        }
                    }
                    Act::Reacquire => {
                        renewed = true;
                        sched.retain(|x| !matches!(x.1, Act::Takeover(_)));
                        for v in self
                            .vips()
                            .into_iter()
                            .filter(|v| c.holders.get(&v.name) == Some(&i))
                        {
                            let mine = c.entries.entry(i).or_default();
                            if mine.insert(v.name.clone()) {
                                let t = self.announce(i, &v)?;
                                c.reannounced.insert(v.name.clone(), t);
                            }
                        }
                    }
                }
                // (A takeover skipped above does not count: nothing was due.)
                c.late = c.late.max(Instant::now().saturating_duration_since(due));
            }
        }
        Ok(())
    }
}

/// What a restart's lease thread did.
#[derive(Default)]
struct LeaseClock {
    holders: BTreeMap<String, u8>,
    entries: BTreeMap<u8, std::collections::BTreeSet<String>>,
    /// The VIPs the restarted node held when its agent went down.
    held_at_start: std::collections::BTreeSet<String>,
    released: Option<bool>,
    started: Option<u128>,
    /// VIP → (before, after, gratuitous ARP sent) of its takeover.
    taken: BTreeMap<String, (u128, u128, bool)>,
    flushed: BTreeMap<String, (u128, u128)>,
    /// VIP → (before, after) its entry was withdrawn at a graceful stop.
    withdrawn: BTreeMap<String, (u128, u128)>,
    reannounced: BTreeMap<String, (u128, u128)>,
    forgot: Option<(String, &'static str, (u128, u128))>,
    /// The longest any scheduled move finished after its time.
    late: Duration,
}
