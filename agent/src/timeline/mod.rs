//! The timeline core the node agent and the witness share. Every probe outcome is recorded
//! the same way: into the probe metrics (`stepguard_probe_duration_seconds`,
//! `stepguard_probe_failures_total`, labelled by kind and target), the target's latest outcome
//! (a late timeout never overwrites a newer answer), a bounded ring of recent samples, and —
//! judged against the target's usual round trip ([`gaps::RttFloor`]) — into the timelines of
//! the steps that are collecting. A step begun after the fact is seeded from the ring. The
//! critical-target cadence rule and the instant before which every probe has answered are
//! here too, so both vantage points measure a gap with the same arithmetic ([`gaps`]).
pub mod gaps;
mod host;

pub use host::ProbeHost;

use crate::config::Target;
use crate::families::Registrar;
use crate::locks::lock;
use crate::probe::ProbeOutcome;
use crate::wire::{ProbeCount, TargetGap};
use gaps::{summarize, Outage, RttFloor, Sample};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Unit;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

/// A target's evidence during the step.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct TargetTimeline {
    pub kind: String,
    /// An east-west target (another node, through the overlay or routes to other nodes).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub east_west: bool,
    /// Budget for the longest outage, seconds.
    pub budget: f64,
    /// Budget for the loss outside the longest outage (failed / sent); None: not judged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_budget: Option<f64>,
    /// Budget for all outages added up, seconds; None: not judged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_budget: Option<f64>,
    /// Outages from before an agent restart (persisted).
    pub prior: Vec<Outage>,
    /// Send time of the last sample persisted, and whether it succeeded.
    pub persisted_through: Option<(f64, bool)>,
    pub probes: u64,
    pub failures: u64,
    /// The first sample after the agent's last restart has been judged.
    #[serde(default)]
    pub hole_judged: bool,
    /// Send time of the last successful probe folded into `prior` (brackets the start of an
    /// outage that begins right after).
    #[serde(default)]
    pub last_ok: Option<f64>,
    /// Probe send times have been checked for stalls up to here (see `verdict::stalls`).
    #[serde(default)]
    pub scanned_through: Option<f64>,
    /// Short outages folded away to keep the record bounded (a flapping target): their
    /// count and total still count in the gap summary; the longest is always kept.
    #[serde(default)]
    pub dropped_outages: u64,
    #[serde(default)]
    pub dropped_total_s: f64,
    /// Probes that could not even be sent (no socket, no permission), and the first reason.
    #[serde(default)]
    pub not_run: u64,
    #[serde(default)]
    pub not_run_detail: Option<String>,
    /// The target's own finer cadence during a step (`targets[].burst_interval`), seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cadence_s: Option<f64>,
    /// This run's samples; not persisted, summarized into `prior` on save.
    #[serde(skip)]
    pub samples: Vec<gaps::Sample>,
}

impl TargetTimeline {
    /// The cadence this target is probed at during a step whose cadence is `step`.
    pub fn cadence(&self, step: f64) -> f64 {
        self.cadence_s.map_or(step, |c| c.min(step))
    }

    pub fn outages(&self) -> Vec<Outage> {
        // The last outage recorded (when older samples were folded, or before the agent
        // went down) continues into these samples: still open, or ended by an answer held
        // past some of them.
        let mut o = self.prior.clone();
        let prev = o.pop();
        o.extend(gaps::outages_continuing(prev, &self.samples, self.last_ok));
        o
    }
}

impl TargetTimeline {
    /// Probes sent, failed, and not run.
    pub fn count(&self) -> ProbeCount {
        ProbeCount {
            sent: self.probes,
            failed: self.failures,
            not_run: self.not_run,
        }
    }
}

impl TargetTimeline {
    /// Folds samples sent before `cutoff` into `prior` outages, keeping memory bounded during
    /// long steps. Only call with a cutoff older than every probe still in flight.
    pub fn compact(&mut self, cutoff: f64) {
        if !self.samples.iter().any(|s| s.sent < cutoff) {
            return;
        }
        let (old, keep): (Samples, Samples) = self.samples.iter().partition(|s| s.sent < cutoff);
        let last_ok = old
            .iter()
            .filter(|s| s.ok)
            .map(|s| s.sent)
            .fold(self.last_ok, |a, t| Some(a.map_or(t, |a: f64| a.max(t))));
        let folded = TargetTimeline {
            prior: std::mem::take(&mut self.prior),
            samples: old,
            last_ok: self.last_ok,
            ..Default::default()
        };
        self.prior = folded.outages();
        self.last_ok = last_ok;
        self.samples = keep;
        self.bound_outages();
    }

    /// Keeps at most [`MAX_OUTAGES`] outages, folding the shortest closed ones into a count
    /// and a total (the gap is the longest outage, which is never folded).
    fn bound_outages(&mut self) {
        if self.prior.len() <= MAX_OUTAGES {
            return;
        }
        let excess = self.prior.len() - MAX_OUTAGES;
        let mut closed: Vec<(usize, f64)> = self
            .prior
            .iter()
            .enumerate()
            .filter_map(|(i, o)| o.end.map(|e| (i, e - o.start)))
            .collect();
        closed.sort_by(|a, b| a.1.total_cmp(&b.1));
        let fold: std::collections::BTreeSet<usize> =
            closed.iter().take(excess).map(|(i, _)| *i).collect();
        for (_, d) in closed.iter().take(excess) {
            self.dropped_outages += 1;
            self.dropped_total_s += d;
        }
        let mut i = 0;
        self.prior.retain(|_| {
            let keep = !fold.contains(&i);
            i += 1;
            keep
        });
    }
}

/// The step's budgets a target falls back to.
#[derive(Clone, Copy, Debug)]
pub struct Budgets {
    pub max_gap: Duration,
    pub max_loss: Option<f64>,
    pub max_total_gap: Option<Duration>,
}

/// A fresh timeline per target, each with its budgets: the target's own (`max_gap`,
/// `max_loss`, `max_total_gap`), else the step's (the agent's steps and a witness's alike).
pub fn timelines(
    targets: &[crate::config::Target],
    b: Budgets,
) -> BTreeMap<String, TargetTimeline> {
    targets
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                TargetTimeline {
                    kind: t.probe.as_str().into(),
                    east_west: t.east_west,
                    budget: t.max_gap.unwrap_or(b.max_gap).as_secs_f64(),
                    loss_budget: t.max_loss.or(b.max_loss),
                    total_budget: t.max_total_gap.or(b.max_total_gap).map(|d| d.as_secs_f64()),
                    cadence_s: t.burst_interval.map(|b| b.as_secs_f64()),
                    ..Default::default()
                },
            )
        })
        .collect()
}

type Samples = Vec<gaps::Sample>;

/// Outages kept per target in a step's record (a target flapping at 25 outages/s for a
/// 10-minute step would otherwise rewrite 15,000 of them every 500 ms).
pub const MAX_OUTAGES: usize = 1000;

/// One target's gap row from its timeline (the agent's, or a witness's).
pub fn gap_row(name: &str, t: &TargetTimeline, cadence: f64, now: f64) -> TargetGap {
    let cadence = t.cadence(cadence);
    let outages = t.outages();
    let g = summarize(&outages, cadence, now);
    let longest = outages
        .iter()
        .max_by(|a, b| a.duration(now).total_cmp(&b.duration(now)));
    // Probes lost outside the longest outage: the longest is `max_gap`'s to judge; the rest
    // is loss. (Outages recorded before their failures were counted: length over cadence.)
    let in_longest = longest.map_or(0, |o| {
        if o.failed > 0 {
            o.failed
        } else {
            (g.longest / cadence).round().max(0.0) as u64
        }
    });
    let lost_outside_longest = t.failures.saturating_sub(in_longest);
    TargetGap {
        target: name.to_string(),
        kind: t.kind.clone(),
        east_west: t.east_west,
        longest_s: g.longest,
        error_bound_s: g.error_bound,
        total_s: g.total + t.dropped_total_s,
        count: g.count + t.dropped_outages as usize,
        budget_s: t.budget,
        open: g.open,
        longest_start: longest.map(|o| o.start),
        longest_end: longest.and_then(|o| o.end),
        longest_held_s: longest.and_then(|o| o.held),
        loss: if t.probes > 0 {
            lost_outside_longest as f64 / t.probes as f64
        } else {
            0.0
        },
        lost_outside_longest,
        loss_budget: t.loss_budget,
        total_budget_s: t.total_budget,
    }
}

/// Probe latency buckets: millisecond-fine at the bottom, up to the longest timeout.
pub const PROBE_BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

/// A probe series: the target and its probe kind (the same on the agent and the witness).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProbeLabels {
    pub kind: String,
    pub target: String,
}

impl ProbeLabels {
    pub fn of(t: &Target) -> ProbeLabels {
        ProbeLabels {
            kind: t.probe.as_str().into(),
            target: t.name.clone(),
        }
    }
}

/// The probe metrics both vantage points serve.
#[derive(Clone)]
pub struct ProbeMetrics {
    pub duration: Family<ProbeLabels, Histogram>,
    pub failures: Family<ProbeLabels, Counter>,
}

impl Default for ProbeMetrics {
    fn default() -> Self {
        ProbeMetrics {
            duration: Family::new_with_constructor(|| Histogram::new(PROBE_BUCKETS)),
            failures: Family::default(),
        }
    }
}

impl ProbeMetrics {
    /// Registers both families (`help` names the vantage point: the registry's readers see
    /// which one they scrape).
    pub fn register(&self, r: &mut Registrar, duration_help: &str, failures_help: &str) {
        r.register_with_unit(
            "probe_duration",
            duration_help,
            Unit::Seconds,
            self.duration.clone(),
        );
        r.register("probe_failures", failures_help, self.failures.clone());
    }

    /// Every target's series exists from the start (a failure counter at 0 is a fact).
    pub fn declare(&self, targets: &[Target]) {
        for t in targets {
            let _ = self.failures.get_or_create(&ProbeLabels::of(t));
        }
    }
}

/// How much of the recent past the ring keeps per target.
#[derive(Clone, Copy, Debug)]
pub struct RingBounds {
    pub age_s: f64,
    pub max: usize,
}

/// Whether `new` replaces `old` as a target's latest outcome: only a probe sent no earlier.
pub fn supersedes(old: Option<&ProbeOutcome>, new: &ProbeOutcome) -> bool {
    old.is_none_or(|old| new.sent_at >= old.sent_at)
}

/// What a probe outcome became once recorded.
#[derive(Clone, Copy, Debug)]
pub struct Recorded {
    /// The probe ran (a probe that could not even be sent is no sample: the gap it leaves is
    /// judged as a stall).
    pub ran: bool,
    /// Its sample for the gap arithmetic.
    pub sample: Sample,
}

/// One vantage point's record of its probes.
pub struct Recorder {
    pub metrics: ProbeMetrics,
    latest: Mutex<BTreeMap<String, ProbeOutcome>>,
    ring: Mutex<BTreeMap<String, VecDeque<Sample>>>,
    floors: Mutex<BTreeMap<String, RttFloor>>,
    bounds: RingBounds,
    /// Each target's two series, looked up once (a probe then records into them without
    /// building, hashing and dropping its labels: at a thousand probes a second that was
    /// most of the recording's own cost).
    handles: Mutex<BTreeMap<String, SeriesHandles>>,
}

/// A target's probe series (handles share the family's series).
#[derive(Clone)]
struct SeriesHandles {
    duration: Histogram,
    failures: Counter,
}

impl Recorder {
    /// A recorder writing into `metrics` (families share their series: the vantage point's
    /// registry serves what is recorded here).
    pub fn new(metrics: ProbeMetrics, bounds: RingBounds) -> Recorder {
        Recorder {
            metrics,
            latest: Mutex::new(BTreeMap::new()),
            ring: Mutex::new(BTreeMap::new()),
            floors: Mutex::new(BTreeMap::new()),
            bounds,
            handles: Mutex::new(BTreeMap::new()),
        }
    }

    fn series(&self, target: &Target) -> SeriesHandles {
        let mut h = lock(&self.handles);
        if let Some(s) = h.get(&target.name) {
            return s.clone();
        }
        let l = ProbeLabels::of(target);
        let s = SeriesHandles {
            duration: self.metrics.duration.get_or_create(&l).clone(),
            failures: self.metrics.failures.get_or_create(&l).clone(),
        };
        h.insert(target.name.clone(), s.clone());
        s
    }

    /// Records `o` (already judged: an answer that changed is a failure by now) into the
    /// metrics, the latest outcomes and, when `into_ring`, the ring; returns its sample.
    pub fn record(&self, target: &Target, o: &ProbeOutcome, into_ring: bool) -> Recorded {
        let series = self.series(target);
        series.duration.observe(o.latency.as_secs_f64());
        if !o.ok {
            series.failures.inc();
        }
        {
            // Probes overlap and finish out of order: a late timeout must not overwrite the
            // result of a probe sent after it.
            let mut latest = lock(&self.latest);
            match latest.get_mut(&target.name) {
                Some(old) if supersedes(Some(old), o) => old.clone_from(o),
                Some(_) => {}
                None => {
                    latest.insert(target.name.clone(), o.clone());
                }
            }
        }
        let sample = self.sample_of(&target.name, o);
        if o.ran && into_ring {
            let mut ring = lock(&self.ring);
            if !ring.contains_key(&target.name) {
                ring.insert(target.name.clone(), VecDeque::new());
            }
            let Some(q) = ring.get_mut(&target.name) else {
                return Recorded { ran: o.ran, sample };
            };
            while q.len() >= self.bounds.max
                || q.front()
                    .is_some_and(|s| s.sent < o.sent_at - self.bounds.age_s)
            {
                q.pop_front();
            }
            q.push_back(sample);
        }
        Recorded { ran: o.ran, sample }
    }

    /// A probe's evidence for the gap arithmetic: an answer is judged against the target's
    /// usual round trip (a held answer counts when it was released, see [`gaps`]).
    fn sample_of(&self, target: &str, o: &ProbeOutcome) -> Sample {
        let rtt = o.latency.as_secs_f64();
        let floor = if o.ok && o.ran {
            let mut floors = lock(&self.floors);
            if !floors.contains_key(target) {
                floors.insert(target.to_string(), RttFloor::default());
            }
            floors
                .get_mut(target)
                .map_or(rtt, |f| f.observe(o.sent_at, rtt))
        } else {
            rtt
        };
        Sample::of(o.sent_at, o.ok, rtt, floor)
    }

    /// The latest outcome of every target.
    pub fn latest(&self) -> BTreeMap<String, ProbeOutcome> {
        lock(&self.latest).clone()
    }

    /// The latest outcome of one target.
    pub fn latest_of(&self, target: &str) -> Option<ProbeOutcome> {
        lock(&self.latest).get(target).cloned()
    }

    /// The ring's samples of `target` sent in `[from, to]`.
    pub fn window(&self, target: &str, from: f64, to: f64) -> Vec<Sample> {
        lock(&self.ring)
            .get(target)
            .map(|q| {
                q.iter()
                    .filter(|s| s.sent >= from && s.sent <= to)
                    .copied()
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Seeds each timeline with the ring's samples sent from `since` on (a step that begins
    /// after what it verifies did); returns the targets whose last sample failed (an outage
    /// already running).
    pub fn seed(
        &self,
        timelines: &mut BTreeMap<String, TargetTimeline>,
        since: f64,
    ) -> Vec<String> {
        let mut running = Vec::new();
        for (name, t) in timelines.iter_mut() {
            let samples = self.window(name, since, f64::INFINITY);
            if samples.last().is_some_and(|s| !s.ok) {
                running.push(name.clone());
            }
            t.probes = samples.len() as u64;
            t.failures = samples.iter().filter(|s| !s.ok).count() as u64;
            t.samples = samples;
        }
        running
    }
}

/// A vantage point's probing, as the engine drives it (the node agent, the witness).
pub trait Vantage: Send + Sync + 'static {
    fn targets(&self) -> &[Target];
    /// The cadence now, and whether a step is bursting (a critical target's own finer
    /// cadence applies only then).
    fn cadence_now(&self) -> (Duration, bool);
    /// A probe of `target` is over.
    fn outcome(&self, target: &Target, o: &ProbeOutcome);
    /// A probe left `late` after its scheduled time.
    fn late(&self, late: Duration) {
        let _ = late;
    }
}

/// The engine's sink for a vantage point: it holds the vantage point weakly, so a dropped
/// agent or witness stops being probed for.
struct VantageSink<V>(std::sync::Weak<V>);

impl<V: Vantage> crate::probe::engine::Sink for VantageSink<V> {
    fn interval(&self, i: usize) -> Duration {
        let Some(v) = self.0.upgrade() else {
            return Duration::from_secs(3600);
        };
        let (base, bursting) = v.cadence_now();
        cadence(
            base,
            bursting,
            v.targets().get(i).and_then(|t| t.burst_interval),
        )
    }
    fn outcome(&self, i: usize, o: ProbeOutcome) {
        if let Some(v) = self.0.upgrade() {
            if let Some(t) = v.targets().get(i) {
                v.outcome(t, &o);
            }
        }
    }
    fn late(&self, late: Duration) {
        if let Some(v) = self.0.upgrade() {
            v.late(late);
        }
    }
}

/// Starts the probe engine for `v`'s targets into `slot`.
pub fn start_probes<V: Vantage>(
    slot: &std::sync::OnceLock<crate::probe::engine::Engine>,
    v: &std::sync::Arc<V>,
) {
    crate::probe::engine::start_into(
        slot,
        v.targets(),
        std::sync::Arc::new(VantageSink(std::sync::Arc::downgrade(v))),
    );
}

/// The cadence a target is probed at: the vantage point's cadence now (`base`), or, while a
/// step bursts, the target's own finer `burst_interval` (a critical target) when it has one.
pub fn cadence(base: Duration, bursting: bool, own: Option<Duration>) -> Duration {
    match own {
        Some(own) if bursting => own.min(base),
        _ => base,
    }
}

/// Slack for recording a probe that has just answered (a busy node).
pub const COMPLETION_SLACK_S: f64 = 0.25;

/// The longest probe timeout of `targets`, seconds.
pub fn max_timeout(targets: &[Target]) -> f64 {
    targets
        .iter()
        .map(|t| t.timeout.as_secs_f64())
        .fold(0.0, f64::max)
}

/// Every probe sent before this instant has answered or timed out, and been recorded.
pub fn complete_until(now: f64, targets: &[Target]) -> f64 {
    now - max_timeout(targets) - COMPLETION_SLACK_S
}

/// Samples sent before this instant may be folded into outages (`TargetTimeline::compact`):
/// a second older than [`complete_until`], so no probe still in flight is folded.
pub fn compaction_cutoff(now: f64, targets: &[Target]) -> f64 {
    now - max_timeout(targets) - 1.0
}

impl TargetTimeline {
    /// One probe's sample into this timeline.
    pub fn record(&mut self, sample: Sample) {
        self.samples.push(sample);
        self.probes += 1;
        self.failures += u64::from(!sample.ok);
    }

    /// A probe that could not even be sent (its first reason kept).
    pub fn not_sent(&mut self, detail: &str) {
        self.not_run += 1;
        self.not_run_detail
            .get_or_insert_with(|| detail.to_string());
    }
}

#[cfg(test)]
mod tests;
