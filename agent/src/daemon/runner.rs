//! The step runner: the one task that owns the active step. Probes and the API send it
//! messages; it takes the readings (kernel, node checks, drops, witnesses), hands them to
//! the step's transitions (`step::lifecycle`), carries out the action they return (persist,
//! export), and publishes a snapshot that everything else reads. Nothing else mutates a
//! step; the rules are the step's, the I/O is here.

use super::loads::ProgramLoads;
use super::watch::{self, current_programs, map_counts};
use super::{lock, Daemon};
use crate::kernel::clock;
use crate::kernel::links;
pub use crate::step::lifecycle::Sample;
use crate::step::lifecycle::{Moment, Next, Readings};
use crate::step::verdict;
use crate::step::Step;
use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

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
    /// What was last read of the node (devices every 200 ms, maps every second).
    readings: Readings,
    /// When the resumed step's record was last written.
    resumed_from: Option<f64>,
    /// Program loads since the last device reading.
    loads: ProgramLoads,
    /// The node checks and drop counters as last read (every second, and at every decision
    /// once a pass is near: [`Step::pass_near`]).
    slow: Option<SlowReadings>,
    /// Witnesses (URLs) whose poll has not come back yet.
    polling: std::collections::BTreeSet<String>,
}

/// Readings a step needs every second, not every decision: the node checks (the kernel
/// ones are refreshed every second; the probe ones are judged over windows of seconds) and
/// the drop counters (cumulative: a read a second later misses nothing). Reading them at
/// every 100 ms decision was a tenth of a step's own CPU on a big node (two batched map
/// walks and every check result copied, ten times a second).
struct SlowReadings {
    node_checks: Vec<crate::checks::CheckResult>,
    kernel_drops: Option<std::collections::BTreeMap<String, u64>>,
    cilium_drops: Option<std::collections::BTreeMap<String, u64>>,
}

/// How far ahead of a possible pass the slow readings are taken at every decision (more than
/// the one second between their regular reads).
const PASS_NEAR_S: f64 = 1.5;

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
        readings: Readings::default(),
        resumed_from: None,
        loads: ProgramLoads::from_now(),
        slow: None,
        polling: Default::default(),
        d,
    };
    r.resume();
    let mut next = tokio::time::Instant::now();
    loop {
        tokio::select! {
            Some(c) = commands.recv() => {
                r.command(c);
                // A step just begun is decided from the next 100 ms on.
                if r.active().is_some() {
                    next = next.min(tokio::time::Instant::now() + TICK);
                }
            }
            Some(w) = witness.recv() => r.witness_poll(w),
            // Samples are drained at each tick (every 100 ms; decisions are only taken
            // there): waking this task for each of a thousand samples a second cost more
            // CPU than the probes' own bookkeeping. The buffer holds seconds of them.
            _ = tokio::time::sleep_until(next) => {
                r.tick(&mut samples).await;
                // Without a step there is nothing to decide: once a second (records the
                // disk refused are retried then), not ten times.
                let period = if r.active().is_some() { TICK } else { IDLE_TICK };
                let (due, now) = (next + period, tokio::time::Instant::now());
                // Late (a slow tick): the next one a period from now, none skipped into a burst.
                next = if due <= now { now + period } else { due };
            }
        }
    }
}

/// The runner's cadence while a step is active: samples drained and the step decided.
const TICK: Duration = Duration::from_millis(100);
/// Its cadence without one.
const IDLE_TICK: Duration = Duration::from_secs(1);

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
            old.abandon(&s.id, clock::now());
            if let Err(e) = watch::persist(&self.d, &mut old) {
                tracing::error!(step = %old.id, error = %e, "cannot persist a step decided at start");
            }
            tracing::warn!(step = %old.id, "an older unfinished step was decided at start: evidence_incomplete");
        }
        self.resumed_from = Some(s.updated_at);
        let now = clock::now();
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
                        let saved = watch::persist(&self.d, &mut s);
                        // A restart nobody stepped is verified whether or not the disk takes
                        // its record: kept in memory, not persisted (said in the step, the
                        // log, the write-error count and /readyz), written once the disk
                        // takes it. A posted step is refused instead: its poster retries.
                        let keep = s.trigger.is_some();
                        if let (Err(e), true) = (&saved, keep) {
                            let why = format!("the step's record could not be written: {e}");
                            tracing::error!(step = %s.id, error = %e, "an implicit step is kept in memory only: the state dir refuses its record");
                            self.d.store.keep_unsaved(&s, why);
                        }
                        match saved {
                            Err(e) if !keep => Begun::NotSaved(e.to_string()),
                            _ => {
                                s.installed(clock::now());
                                watch::exported_begin(&self.d, &s);
                                tracing::info!(step = %s.id, "step begun; probing in burst mode");
                                self.step = Some(s.clone());
                                self.resumed = false;
                                self.readings.maps = None;
                                self.readings.programs = None;
                                self.slow = None;
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
        self.polling.remove(&p.url);
        if let Some(s) = self.step.as_mut().filter(|s| s.id == p.step) {
            s.witness_answered(&p.url, p.result, clock::now());
        }
    }

    /// Asks every witness of the active step for its report (answers come back as
    /// [`WitnessPoll`]s; a slow witness never holds up the runner).
    /// A witness whose previous poll has not come back is not asked again: polls never pile
    /// up behind a slow or hostile one.
    fn poll_witnesses(&mut self) {
        let Some(s) = self.step.as_ref().filter(|s| !s.is_final()) else {
            return;
        };
        let (after, from) = (s.reload.complete_at, s.created_at);
        for url in s.witnesses.keys() {
            if !self.polling.insert(url.clone()) {
                continue;
            }
            let (url, id, token) = (url.clone(), s.id.clone(), self.d.opts.token.current());
            let tx = self.d.ports.witness.clone();
            tokio::spawn(async move {
                let result = watch::poll_witness(url.clone(), token, id.clone(), after, from).await;
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
        if let Some(s) = self.step.as_mut() {
            s.take_sample(x);
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
        // Records the disk refused are written again once it takes them (every second; every
        // tick without a step, which is a second apart).
        if (n.is_multiple_of(10) || self.active().is_none()) && self.d.store.unsaved().is_some() {
            let failed = self.d.store.retry_unsaved();
            if failed > 0 {
                self.d.metrics.step.state_write_errors.inc_by(failed as u64);
            }
        }
        let Some(tracked) = self.active().map(Step::tracked_keys) else {
            self.readings.maps = None;
            self.readings.programs = None;
            self.slow = None;
            return;
        };
        let d = self.d.clone();
        d.metrics.step.step_active.set(1);
        if n.is_multiple_of(5) {
            self.poll_witnesses();
        }
        if n.is_multiple_of(2) || self.readings.programs.is_none() {
            self.read_devices(&tracked).await;
        }
        if n.is_multiple_of(10) || self.readings.maps.is_none() {
            self.read_maps().await;
        }
        let now = clock::now();
        let pass_near = self.active().is_some_and(|s| s.pass_near(now, PASS_NEAR_S));
        if n.is_multiple_of(10) || pass_near || self.slow.is_none() {
            self.slow = Some(SlowReadings {
                node_checks: d.node_results(),
                kernel_drops: d.kernel_drops_now(),
                cilium_drops: d.cilium_drops_now(),
            });
        }
        // Out of `self` while the step is decided (put back below).
        let Some(slow) = self.slow.take() else {
            return;
        };
        // Results that arrived while the kernel was observed are read before anything is
        // decided: "every probe sent before `complete_until` is recorded" must hold.
        while let Ok(s) = samples.try_recv() {
            self.sample(s);
        }
        let resumed = self.resumed && self.readings.programs.is_some();
        if resumed {
            self.resumed = false;
        }
        let resumed_from = self.resumed_from;
        let Some(s) = self.step.as_mut() else { return };
        if resumed {
            // Judge the hole: a reload or an outage while the agent was away is unseen evidence.
            if let Some(p) = &self.readings.programs {
                s.judge_resume(p, resumed_from.unwrap_or(s.updated_at), now);
            }
        }
        let moment = Moment {
            now,
            node_checks: &slow.node_checks,
            kernel_drops: slow.kernel_drops.as_ref(),
            cilium_drops: slow.cilium_drops.as_ref(),
            // Every probe sent before this has answered or timed out, and been recorded (a
            // little slack for the recording itself on a busy node).
            complete_until: crate::timeline::complete_until(now, &d.cfg.targets),
        };
        let next = s.observe(&mut self.readings, &moment, |t| d.dns_p50_since(t));
        self.slow = Some(slow);
        publish_endpoints(&d, s);
        if next == Next::Finished || n.is_multiple_of(5) {
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
        if next == Next::Finished {
            watch::finished(&d, s);
        }
        self.publish();
    }

    /// The tracked devices' programs, and the programs of the endpoints still to regenerate
    /// (endpoints read only in part are marked so, `raced`, and judged next time).
    ///
    /// Only what can still change is read: an endpoint regenerates onto a program loaded
    /// for it, so the endpoints still to regenerate are read here (every 200 ms) only while
    /// programs are being loaded ([`ProgramLoads`]); otherwise the node checks' observation
    /// of every endpoint, once a second, serves ([`Runner::read_maps`]: a deleted pod). On a
    /// node with 1,000 endpoints these queries were most of a step's own kernel time.
    async fn read_devices(&mut self, tracked: &[String]) {
        let now = clock::now();
        let pending: BTreeSet<String> = self
            .active()
            .map(|s| verdict::pending_endpoints(s).into_iter().cloned().collect())
            .unwrap_or_default();
        let due = !pending.is_empty() && self.loads.since_last_look(now);
        let scan = links::EndpointScan::Only(if due { pending } else { BTreeSet::new() });
        let path = self.d.cfg.bpffs.clone();
        let topo = self.d.topology.clone();
        let obs = self
            .d
            .kernel
            .spawn(async move { links::observe_scan_via(&topo, &path, &scan).await })
            .await
            .ok()
            .and_then(|r| r.ok());
        self.readings.endpoints = if due {
            obs.as_ref().map(watch::endpoint_readings)
        } else {
            None
        };
        self.readings.programs = obs
            .filter(|o| !o.prog_details_unreadable)
            .map(|o| current_programs(&o, tracked));
    }

    /// The node checks (the slow loop's refresh), the maps' counts and ids, the agent's
    /// version, and the named entries of kept maps that lost some.
    async fn read_maps(&mut self) {
        let d = self.d.clone();
        let d2 = d.clone();
        let before = clock::now();
        let _ = d.kernel.spawn(async move { d2.refresh_node().await }).await;
        {
            let node = lock(&d.node);
            if self.readings.endpoints.is_none() && node.checked_at >= before {
                // The node checks just observed every endpoint (an older observation is not
                // taken: it would date old programs now). No program was loaded since the
                // last device reading, so what it shows changed is deleted pods.
                self.readings.endpoints = node.links.as_ref().map(watch::endpoint_readings);
            }
            self.readings.maps = node.maps.as_ref().map(map_counts);
            self.readings.required_maps = node.results.get("maps").and_then(|r| {
                r.evidence["required"].as_array().map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_str().map(String::from))
                        .collect()
                })
            });
            self.readings.map_ids = node.maps.as_ref().map(watch::map_ids);
            self.readings.endpoint_maps = node.maps.as_ref().map(|m| m.endpoint_maps.clone());
        }
        self.readings.agent_version = d.agent_version().map(|v| (v, clock::now()));
        self.readings.overlay = d.overlay_intent();
        self.readings.asks = d.asks();
        let shrunk = self
            .active()
            .map(|s| s.kept_maps_shrunk(self.readings.maps.as_ref()))
            .unwrap_or_default();
        let service_maps = shrunk
            .iter()
            .any(|m| m.contains("_services") || m.contains("_backends"));
        self.readings.map_entries = if shrunk.is_empty() {
            Default::default()
        } else {
            let bpffs = d.cfg.bpffs.clone();
            d.kernel
                .spawn(
                    async move { watch::named_entries(&bpffs, shrunk.iter().map(|s| s.as_str())) },
                )
                .await
                .unwrap_or_default()
        };
        // The services the agent holds, asked after the entries were read: what it no longer
        // lists was deleted (a Service deleted in Kubernetes), what it lists must be there.
        self.readings.services = match (&d.cfg.cilium_api, service_maps) {
            (Some(sock), true) => match crate::ciliumapi::agent_services(sock).await {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::debug!(error = %e, "cannot ask the agent for its services");
                    None
                }
            },
            _ => None,
        };
    }
}

/// The step's endpoint regeneration as metrics (`stepguard_step_endpoints{state}`,
/// `stepguard_step_endpoint_regeneration_slowest_seconds`).
fn publish_endpoints(d: &Daemon, s: &Step) {
    use crate::metrics::StateLabels;
    let followed = s.baseline.endpoints.len() as i64;
    let regenerated = s.endpoints.regenerated.len() as i64;
    let deleted = s.endpoints.gone.len() as i64;
    let m = &d.metrics;
    for (state, n) in [
        ("followed", followed),
        ("regenerated", regenerated),
        ("deleted", deleted),
        ("pending", (followed - regenerated - deleted).max(0)),
    ] {
        m.step
            .step_endpoints
            .get_or_create(&StateLabels {
                state: state.into(),
            })
            .set(n);
    }
    m.step
        .step_endpoint_regeneration_slowest
        .set(verdict::slowest_endpoint(s).map_or(0.0, |(_, t)| t));
}
