//! Restarting the lab's cilium-agent stand-in the way Cilium restarts (the phases, their
//! order and timing, the faults a restart can carry), and what a restart reports.
use super::*;

impl Lab {
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
                phases.ipcache_refilled_ns = now_ns();
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
    pub(crate) fn come_back(
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
            let fd = sys::bpf::obj_get(&globals.join(m))?;
            maps::flush(&fd, sys::bpf::map_key_size(&fd)?)?;
        }
        if let Some((m, n)) = &o.lose_entries {
            let fd = sys::bpf::obj_get(&globals.join(m))?;
            let deleted = maps::delete_some(&fd, sys::bpf::map_key_size(&fd)?, *n)?;
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
    pub(crate) fn regenerate_endpoints(&mut self, o: &RestartOpts) -> Result<()> {
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
        let node = self.node_ns();
        // Endpoint health checking off: the restarted agent never restores the health
        // endpoint (`validateEndpoint`, `daemon/cmd/endpoint_restore.go` l. 316-333, 1.20.2)
        // and does not create one (`pkg/health/health_manager.go` l. 162): `lxc_health` is
        // left down without programs.
        let health_off = self
            .effective_config(true)?
            .get("enable-endpoint-health-checking")
            .is_some_and(|v| v.trim() == "false");
        if health_off && self.state.lxc.iter().any(|l| l.0 == "lxc_health") {
            let (gone, keep): (Vec<Attachment>, Vec<Attachment>) = self
                .state
                .attachments
                .iter()
                .cloned()
                .partition(|a| a.device == "lxc_health");
            datapath::detach(&node, &gone)?;
            netns::ip(&node, &["link", "set", "lxc_health", "down"])?;
            self.state.attachments = keep;
        }
        let due: Vec<Attachment> = self
            .state
            .attachments
            .iter()
            .filter(|a| a.endpoint.is_some() && !stalled.contains(&a.device))
            .cloned()
            .collect();
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
    pub(crate) fn random_loss(&self, p: f64, d: Duration) -> Result<()> {
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

    pub(crate) fn stop_agent_api(&mut self) {
        let (api, rest): (Vec<Proc>, Vec<Proc>) = std::mem::take(&mut self.state.procs)
            .into_iter()
            .partition(|p| p.what == "agent-api");
        self.state.procs = rest;
        for p in api {
            process::stop(&p);
        }
        // A graceful stop closes the listener, which removes the socket file (Go's net
        // package); the restarted agent binds it anew.
        let _ = std::fs::remove_file(self.agent_socket());
    }

    pub(crate) fn start_agent_api(&mut self) -> Result<()> {
        if self.state.procs.iter().any(|p| p.what == "agent-api") {
            return Ok(());
        }
        let dir = self.state.run_dir.join("services");
        // What the agent reports as `cilium-version` (pkg/version: `<release> <git hash>
        // <date> go version <go> <os>/<arch>`): the lab agent's release.
        std::fs::create_dir_all(self.agent_run_dir())?;
        std::fs::write(
            agentapi::agent_version_file(&self.agent_settings()),
            format!(
                "{}.0 0000000 2026-01-01T00:00:00+00:00 go version go1.24.0 linux/amd64",
                self.state.spec.profile
            ),
        )
        .context("write the lab agent's version")?;
        let p = agentapi::start_agent_api(
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
pub(crate) const HEALTH_ENDPOINT_ID: u16 = 4094;

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
    /// The recreated ipcache held its entries again (0: never refilled).
    #[serde(default)]
    pub ipcache_refilled_ns: u128,
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
