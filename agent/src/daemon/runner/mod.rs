//! The step runner: the one task that owns the active step. Probes and the API send it
//! messages; it observes the datapath, decides, persists, exports, and publishes a snapshot
//! that everything else reads. Nothing else mutates a step.

use super::watch::{self, current_programs, map_counts};
use super::{lock, Daemon};
use crate::checks::Status;
use crate::kernel::links;
use crate::probe::unix_now;
use crate::step::verdict::{self, Observed};
use crate::step::Step;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// One probe result for the step's timeline.
#[derive(Clone, Debug)]
pub struct Sample {
    pub target: String,
    /// The gap arithmetic's evidence (its round trip judged against the target's usual).
    pub sample: crate::step::gaps::Sample,
    /// False: the probe could not even be sent (no socket, no permission); `detail` says why.
    pub ran: bool,
    pub detail: String,
}

/// What the API asks of the runner.
pub enum Command {
    /// Install a step whose baseline was just taken.
    Begin {
        step: Box<Step>,
        reply: oneshot::Sender<Begun>,
    },
    /// Cancel the active step `id`; replies with it when it was the active one.
    Cancel {
        id: String,
        reply: oneshot::Sender<Option<Step>>,
    },
}

/// The runner's answer to [`Command::Begin`].
pub enum Begun {
    Created(Box<Step>),
    /// The same id is already active: the request is idempotent.
    Existing(Box<Step>),
    /// Another step is active.
    Conflict(String),
    /// The step could not be saved: refused, or it would be lost on an agent restart.
    NotSaved(String),
}

/// A witness's answer to a poll, for the step it was asked about.
pub struct WitnessPoll {
    pub step: String,
    pub url: String,
    pub result: Result<crate::witness::WitnessReport, watch::WitnessPollError>,
}

type Receivers = (
    mpsc::Receiver<Command>,
    mpsc::Receiver<Sample>,
    mpsc::Receiver<WitnessPoll>,
);

/// The channels between the daemon and its runner.
pub struct Ports {
    pub commands: mpsc::Sender<Command>,
    pub samples: mpsc::Sender<Sample>,
    pub witness: mpsc::Sender<WitnessPoll>,
    receivers: std::sync::Mutex<Option<Receivers>>,
}

/// Samples buffered while the runner observes the kernel (10 targets at 1 ms for 6 s).
const SAMPLE_BUFFER: usize = 65_536;

impl Ports {
    pub fn new() -> Ports {
        let (ctx, crx) = mpsc::channel(64);
        let (stx, srx) = mpsc::channel(SAMPLE_BUFFER);
        let (wtx, wrx) = mpsc::channel(64);
        Ports {
            commands: ctx,
            samples: stx,
            witness: wtx,
            receivers: std::sync::Mutex::new(Some((crx, srx, wrx))),
        }
    }
}

impl Default for Ports {
    fn default() -> Self {
        Self::new()
    }
}

struct Runner {
    d: Arc<Daemon>,
    step: Option<Step>,
    /// Set after a restart with an unfinished step, until the first observation is judged.
    resumed: bool,
    n: u64,
    last_maps: Option<BTreeMap<String, Option<u64>>>,
    last_map_ids: Option<BTreeMap<String, u32>>,
    last_endpoint_maps: Option<BTreeMap<String, u64>>,
    /// The agent API's version at the last node refresh, and when.
    last_agent_version: Option<(String, f64)>,
    /// Named entries of kept maps that lost some since the baseline.
    last_map_entries: BTreeMap<String, Vec<String>>,
    /// The endpoints' programs at the last device observation (taken by the next decision).
    last_endpoints: Option<BTreeMap<String, crate::step::EndpointPrograms>>,
    last_programs: Option<BTreeMap<String, Option<u32>>>,
    /// When the resumed step's record was last written.
    resumed_from: Option<f64>,
}

/// Runs the step runner until the daemon goes away. Call once per daemon.
pub async fn run(d: Arc<Daemon>) {
    let Some((mut commands, mut samples, mut witness)) = lock(&d.ports.receivers).take() else {
        tracing::error!("the step runner was started twice");
        return;
    };
    let mut r = Runner {
        step: None,
        resumed: false,
        n: 0,
        last_maps: None,
        last_map_ids: None,
        last_endpoint_maps: None,
        last_agent_version: None,
        last_map_entries: BTreeMap::new(),
        last_endpoints: None,
        last_programs: None,
        resumed_from: None,
        d,
    };
    r.resume();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            Some(c) = commands.recv() => r.command(c),
            Some(w) = witness.recv() => r.witness_poll(w),
            // Samples are drained at each tick (every 100 ms; decisions are only taken
            // there): waking this task for each of a thousand samples a second cost more
            // CPU than the probes' own bookkeeping. The buffer holds seconds of them.
            _ = tick.tick() => r.tick(&mut samples).await,
        }
    }
}

impl Runner {
    fn active(&self) -> Option<&Step> {
        self.step.as_ref().filter(|s| !s.is_final())
    }

    /// Publishes the step to readers (API, metrics) and wakes long-polls and probe loops.
    fn publish(&self) {
        let d = &self.d;
        let active = self.active().is_some();
        let cadence_before = (
            d.burst.load(Ordering::SeqCst),
            d.burst_interval_ns.load(Ordering::SeqCst),
        );
        d.step_active.store(active, Ordering::SeqCst);
        if let Some(s) = self.active() {
            d.burst_interval_ns
                .store(s.params.burst_interval.as_nanos() as u64, Ordering::SeqCst);
        }
        d.burst.store(active, Ordering::SeqCst);
        d.snapshot.send_replace(self.step.clone().map(Arc::new));
        let cadence_now = (
            d.burst.load(Ordering::SeqCst),
            d.burst_interval_ns.load(Ordering::SeqCst),
        );
        // Readers every time; the probe engine only when its cadence changed (it was woken
        // ten times a second for nothing during every step).
        if cadence_now == cadence_before {
            d.bump_readers();
        } else {
            d.bump();
        }
    }

    /// Picks up an unfinished step from disk: the time the agent was away is a hole.
    fn resume(&mut self) {
        // The newest unfinished step is resumed; older unfinished ones (a crash between two
        // steps' writes, a state dir copied around) are decided now: their evidence ended
        // where their record did, so they are incomplete, never left watching forever.
        let mut unfinished = self.d.store.list().into_iter().filter(|s| !s.is_final());
        let Some(mut s) = unfinished.next() else {
            return;
        };
        for mut old in unfinished {
            let now = unix_now();
            old.phase = crate::step::Phase::Done;
            old.evidence_incomplete = Some(format!(
                "the agent restarted with this step unfinished and a newer one ({}) also unfinished: its record ends at {:.0} (unix), its evidence with it",
                s.id, old.updated_at
            ));
            old.verdict = Some(crate::step::Verdict {
                status: crate::step::Status::Failed,
                reasons: vec![crate::step::Reason::EvidenceIncomplete],
                summary: old.evidence_incomplete.clone().unwrap_or_default(),
                finished_at: now,
            });
            if let Err(e) = watch::persist(&self.d, &mut old) {
                tracing::error!(step = %old.id, error = %e, "cannot persist a step decided at start");
            }
            tracing::warn!(step = %old.id, "an older unfinished step was decided at start: evidence_incomplete");
        }
        self.resumed_from = Some(s.updated_at);
        let now = unix_now();
        s.resume(now, crate::kernel::clock::boot_id().as_deref());
        tracing::warn!(step = %s.id, away_s = now - s.updated_at, "resuming an unfinished step after an agent restart");
        self.step = Some(s);
        self.resumed = true;
        self.publish();
    }

    fn command(&mut self, c: Command) {
        match c {
            Command::Begin { step, reply } => {
                let answer = match self.active() {
                    Some(a) if a.id == step.id => Begun::Existing(Box::new(a.clone())),
                    Some(a) => Begun::Conflict(a.id.clone()),
                    None => {
                        let mut s = *step;
                        match watch::persist(&self.d, &mut s) {
                            Err(e) => Begun::NotSaved(e.to_string()),
                            Ok(()) => {
                                // Probes count from here (the baseline took its time before):
                                // the stall scan starts when the step is installed.
                                let installed = unix_now();
                                for t in s.targets.values_mut() {
                                    t.scanned_through = Some(installed);
                                }
                                watch::exported_begin(&self.d, &s);
                                tracing::info!(step = %s.id, "step begun; probing in burst mode");
                                self.step = Some(s.clone());
                                self.resumed = false;
                                self.last_maps = None;
                                self.last_programs = None;
                                self.publish();
                                Begun::Created(Box::new(s))
                            }
                        }
                    }
                };
                let _ = reply.send(answer);
            }
            Command::Cancel { id, reply } => {
                let cancelled = match self.step.as_mut().filter(|s| s.id == id && !s.is_final()) {
                    Some(s) => {
                        watch::cancel(&self.d, s);
                        Some(s.clone())
                    }
                    None => None,
                };
                if cancelled.is_some() {
                    self.publish();
                }
                let _ = reply.send(cancelled);
            }
        }
    }

    /// Folds a witness's answer into the active step.
    fn witness_poll(&mut self, p: WitnessPoll) {
        let now = unix_now();
        let Some(s) = self
            .step
            .as_mut()
            .filter(|s| !s.is_final() && s.id == p.step)
        else {
            return;
        };
        let Some(t) = s.witnesses.get_mut(&p.url) else {
            return;
        };
        match p.result {
            Ok(r) if r.instance != t.instance => {
                t.lost.get_or_insert(format!(
                    "restarted during the step (instance {}, was {}): its evidence of the window is gone",
                    r.instance, t.instance
                ));
            }
            Ok(r) => {
                t.report = Some(r);
                t.last_ok_at = Some(now);
                t.last_error = None;
            }
            Err(watch::WitnessPollError::Unknown(e)) => {
                t.lost.get_or_insert(format!(
                    "no longer knows the step ({e}): it restarted, its evidence of the window is gone"
                ));
            }
            Err(watch::WitnessPollError::Failed(e)) => t.last_error = Some(e),
        }
    }

    /// Asks every witness of the active step for its report (answers come back as
    /// [`WitnessPoll`]s; a slow witness never holds up the runner).
    fn poll_witnesses(&self) {
        let Some(s) = self.active() else { return };
        let after = s.reload.complete_at;
        for url in s.witnesses.keys() {
            let (url, id, token) = (url.clone(), s.id.clone(), self.d.opts.token.current());
            let tx = self.d.ports.witness.clone();
            tokio::spawn(async move {
                let result = watch::poll_witness(url.clone(), token, id.clone(), after).await;
                let _ = tx
                    .send(WitnessPoll {
                        step: id,
                        url,
                        result,
                    })
                    .await;
            });
        }
    }

    fn sample(&mut self, x: Sample) {
        let Some(s) = self.step.as_mut().filter(|s| !s.is_final()) else {
            return;
        };
        if x.sample.sent < s.created_at {
            return;
        }
        if let Some(t) = s.targets.get_mut(&x.target) {
            if !x.ran {
                t.not_sent(&x.detail);
                return;
            }
            t.record(x.sample);
        }
    }

    /// Device programs every 200 ms, maps and node checks every second, decides every
    /// 100 ms, persists every 500 ms.
    async fn tick(&mut self, samples: &mut mpsc::Receiver<Sample>) {
        while let Ok(s) = samples.try_recv() {
            self.sample(s);
        }
        self.n += 1;
        let n = self.n;
        // Records the disk refused are written again once it takes them (every second).
        if n.is_multiple_of(10) && self.d.store.unsaved().is_some() {
            let failed = self.d.store.retry_unsaved();
            if failed > 0 {
                lock(&self.d.metrics)
                    .state_write_errors
                    .inc_by(failed as u64);
            }
        }
        // The baseline's devices and any the step declared it expects after the restart.
        let Some(tracked) = self.active().map(|s| {
            let mut t: std::collections::BTreeSet<String> =
                s.baseline.programs.keys().cloned().collect();
            t.extend(verdict::wanted_devices(s));
            t.into_iter().collect::<Vec<_>>()
        }) else {
            self.last_maps = None;
            self.last_programs = None;
            return;
        };
        let d = self.d.clone();
        lock(&d.metrics).step_active.set(1);
        if n.is_multiple_of(5) {
            self.poll_witnesses();
        }
        if n.is_multiple_of(2) || self.last_programs.is_none() {
            let path = d.cfg.bpffs.clone();
            let topo = d.topology.clone();
            let obs = d
                .kernel
                .spawn(async move { links::observe_via(Some(&topo), &path).await })
                .await
                .ok()
                .and_then(|r| r.ok());
            // Endpoints read only in part are marked so (`raced`) and judged next time.
            self.last_endpoints = obs.as_ref().map(watch::endpoint_programs);
            self.last_programs = obs
                .filter(|o| !o.prog_details_unreadable)
                .map(|o| current_programs(&o, &tracked));
        }
        if n.is_multiple_of(10) || self.last_maps.is_none() {
            let d2 = d.clone();
            let _ = d.kernel.spawn(async move { d2.refresh_node().await }).await;
            {
                let node = lock(&d.node);
                self.last_maps = node.maps.as_ref().map(map_counts);
                self.last_map_ids = node.maps.as_ref().map(watch::map_ids);
                self.last_endpoint_maps = node.maps.as_ref().map(|m| m.endpoint_maps.clone());
            }
            self.last_agent_version = d.agent_version().map(|v| (v, unix_now()));
            // Kept maps that lost entries since the baseline: name what is gone (read only
            // then; small maps only, see `Baseline::map_entries`).
            let shrunk: Vec<String> = self
                .active()
                .map(|s| {
                    s.baseline
                        .map_entries
                        .keys()
                        .filter(|m| {
                            let before = s.baseline.maps.get(*m).copied().flatten();
                            let now = self
                                .last_maps
                                .as_ref()
                                .and_then(|l| l.get(*m).copied().flatten());
                            matches!((before, now), (Some(b), Some(a)) if a < b)
                        })
                        .cloned()
                        .collect()
                })
                .unwrap_or_default();
            self.last_map_entries = if shrunk.is_empty() {
                BTreeMap::new()
            } else {
                let bpffs = d.cfg.bpffs.clone();
                d.kernel
                    .spawn(async move {
                        watch::named_entries(&bpffs, shrunk.iter().map(|s| s.as_str()))
                    })
                    .await
                    .unwrap_or_default()
            };
        }
        let baseline_checks = self
            .active()
            .map(|s| s.baseline.node_checks.clone())
            .unwrap_or_default();
        let node_not_green = blocking_node_checks(&d.node_results(), &baseline_checks);
        let now = unix_now();
        let kd = d.kernel_drops_now();
        let cd = d.cilium_drops_now();
        // Results that arrived while the kernel was observed are read before anything is
        // decided: "every probe sent before `complete_until` is recorded" must hold.
        while let Ok(s) = samples.try_recv() {
            self.sample(s);
        }
        let resumed = self.resumed && self.last_programs.is_some();
        let resumed_from = self.resumed_from;
        if resumed {
            self.resumed = false;
        }
        let last_programs = self.last_programs.clone();
        let last_maps = self.last_maps.clone();
        let Some(s) = self.step.as_mut() else { return };
        if resumed {
            // Judge the hole: a reload or an outage while the agent was away is unseen evidence.
            if let Some(p) = &last_programs {
                let before = if s.reload.last_seen.is_empty() {
                    s.baseline
                        .programs
                        .iter()
                        .map(|(k, v)| (k.clone(), Some(*v)))
                        .collect()
                } else {
                    s.reload.last_seen.clone()
                };
                if p != &before {
                    let since = resumed_from.unwrap_or(s.updated_at);
                    s.evidence_incomplete = Some(format!(
                        "the datapath changed after the step's record was last written ({:.1} s before this agent started: the agent was down, or could not write its state dir): the outage was not observed",
                        (now - since).max(0.0)
                    ));
                }
            }
        }
        let mut drops = BTreeMap::new();
        // cilium_metrics recreated (a property change on start: new id): its counters
        // restarted from zero, so they count from there (rebased), not against the baseline.
        let metrics_recreated = match (
            s.baseline.map_ids.get("cilium_metrics"),
            self.last_map_ids
                .as_ref()
                .and_then(|i| i.get("cilium_metrics")),
        ) {
            (Some(a), Some(b)) => a != b,
            _ => false,
        };
        let zero = BTreeMap::new();
        let cilium_base = if metrics_recreated {
            &zero
        } else {
            &s.baseline.cilium_drops
        };
        for (prefix, now_counts, base) in [
            ("kernel", &kd, &s.baseline.kernel_drops),
            ("cilium", &cd, cilium_base),
        ] {
            for (r, v) in now_counts.iter().flatten() {
                let d0 = base.get(r).copied().unwrap_or(0);
                if *v > d0 {
                    drops.insert(format!("{prefix}:{r}"), v - d0);
                }
            }
        }
        let mut drops_unknown: Vec<String> = s.baseline.drops_unknown_at_start.clone();
        for (source, now_known) in [("kernel", kd.is_some()), ("cilium", cd.is_some())] {
            if !now_known && !drops_unknown.iter().any(|x| x == source) {
                drops_unknown.push(source.to_string());
            }
        }
        let dns_after = s.reload.complete_at.and_then(|t| d.dns_p50_since(t));
        judge_first_samples_after_a_hole(s);
        let o = Observed {
            now,
            programs: last_programs,
            maps: last_maps,
            map_ids: self.last_map_ids.clone(),
            node_not_green,
            dns_p50_after_ms: dns_after,
            drops,
            drops_unknown,
            // Every probe sent before this has answered or timed out, and been recorded (a
            // little slack for the recording itself on a busy node).
            complete_until: crate::timeline::complete_until(now, &d.cfg.targets),
            endpoint_maps: self.last_endpoint_maps.clone(),
            agent_version: self.last_agent_version.clone(),
            map_entries: self.last_map_entries.clone(),
            endpoints: self.last_endpoints.take(),
        };
        verdict::decide(s, &o);
        publish_endpoints(&d, s);
        let done = s.is_final();
        if done || n.is_multiple_of(5) {
            // Probes older than the longest timeout have all answered: fold them into
            // outages so a long step at 10 ms keeps its memory bounded.
            let cutoff = crate::timeline::compaction_cutoff(now, &d.cfg.targets);
            for t in s.targets.values_mut() {
                t.compact(cutoff);
            }
            if let Err(e) = watch::persist(&d, s) {
                tracing::error!(step = %s.id, error = %e, "cannot persist the step");
            }
        }
        if done {
            watch::finished(&d, s);
        }
        self.publish();
    }
}

/// The step's endpoint regeneration as metrics (`stepguard_step_endpoints{state}`,
/// `stepguard_step_endpoint_regeneration_slowest_seconds`).
fn publish_endpoints(d: &Daemon, s: &Step) {
    use crate::metrics::StateLabels;
    let followed = s.baseline.endpoints.len() as i64;
    let regenerated = s.endpoints.regenerated.len() as i64;
    let deleted = s.endpoints.gone.len() as i64;
    let m = lock(&d.metrics);
    for (state, n) in [
        ("followed", followed),
        ("regenerated", regenerated),
        ("deleted", deleted),
        ("pending", (followed - regenerated - deleted).max(0)),
    ] {
        m.step_endpoints
            .get_or_create(&StateLabels {
                state: state.into(),
            })
            .set(n);
    }
    m.step_endpoint_regeneration_slowest
        .set(verdict::slowest_endpoint(s).map_or(0.0, |(_, t)| t));
}

/// The node checks that keep a step from passing: any that fails, and any that was passing
/// when the step began and is no longer known. A check unknown from the start (not
/// configured: no targets, no cilium-config, no agent API) cannot regress and does not block;
/// before, such a check kept every step of such a node from ever passing.
pub fn blocking_node_checks(
    now: &[crate::checks::CheckResult],
    baseline: &BTreeMap<String, String>,
) -> Vec<String> {
    now.iter()
        .filter(|r| {
            r.status == Status::Fail
                || (r.status == Status::Unknown
                    && baseline.get(r.check).is_some_and(|b| b == "pass"))
        })
        .map(|r| format!("{} {}: {}", r.check, r.status.as_str(), r.reason))
        .collect()
}

/// The first sample after a resume (judged once per target): failing at once means an
/// outage began while the agent was away.
fn judge_first_samples_after_a_hole(s: &mut Step) {
    if s.holes.is_empty() || s.evidence_incomplete.is_some() {
        return;
    }
    let hole_end = s.holes.last().map(|h| h.1).unwrap_or(0.0);
    let mut incomplete = None;
    for (name, t) in s.targets.iter_mut().filter(|(_, t)| !t.hole_judged) {
        let first = t
            .samples
            .iter()
            .filter(|x| x.sent >= hole_end)
            .min_by(|a, b| a.sent.total_cmp(&b.sent))
            .copied();
        if let Some(crate::step::gaps::Sample { ok, .. }) = first {
            t.hole_judged = true;
            if !ok {
                incomplete = Some(format!(
                    "{name} was already failing when the agent came back: the outage began unseen"
                ));
            }
        }
    }
    if incomplete.is_some() {
        s.evidence_incomplete = incomplete;
    }
}

#[cfg(test)]
mod tests;
