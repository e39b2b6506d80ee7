//! `stepguard witness`: probes the VIPs as a LAN client does, from a machine that is not a
//! Cilium node (a NAS, a router, a small VM). With kube-proxy replacement a node's own
//! connections to a LoadBalancer VIP are translated on the node (socket-LB) and never cross
//! the wire, so no node can see its L2-announcement lease move; a LAN client can.
//!
//! The witness uses the agent's probes (same kinds, same timeouts), the same step timeline and
//! gap arithmetic (`step::TargetTimeline`, `verdict::gap_row`), and records which MAC address
//! its kernel sends to for each VIP (the neighbour table, followed through rtnetlink), so a
//! report shows the lease move itself. It decides nothing: the agent on the node being
//! stepped collects its report into the step's verdict.
//!
//! API: `POST /v1/steps {"id", "burst_interval"?, "timeout"?, "max_gap"?}` begins burst probing
//! for a step (idempotent per id); `GET /v1/steps/{id}[?after=UNIX][&from=UNIX]` is the
//! report (latency quantiles "after" are over probes sent from `after`; gaps over probes sent
//! from `from`, the asking agent's own step window); `DELETE /v1/steps/{id}` ends it;
//! `GET /v1/status`, `/metrics`, `/livez`, `/readyz`.
mod api;
mod steps;
use crate::config::Config;
use crate::families::Registrar;
use crate::kernel::clock;
use crate::kernel::neigh::NeighLog;
use crate::locks::lock;
use crate::probe::ProbeOutcome;
use crate::step::verdict::gap_row;
use crate::step::TargetTimeline;
pub use crate::wire::{Latency, MacChange, Move, WitnessBegun, WitnessReport, WitnessStepRequest};
pub use api::*;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use serde_json::json;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Steps remembered (the newest; ended ones are dropped first).
pub const MAX_STEPS: usize = 16;
/// Lease moves remembered.
pub const MAX_MOVES: usize = 32;
/// Continuous samples kept per target (for moves and for steps that begin late).
const RING_S: f64 = 600.0;
const RING_MAX: usize = 20_000;
/// Latency samples kept per target (steady window and per step).
const MAX_LATENCIES: usize = 4096;
/// Steady latencies older than this are dropped ("before" uses the last minute).
const STEADY_WINDOW_S: f64 = 120.0;
/// The longest a witness step may run before it ends by itself.
const MAX_STEP: Duration = Duration::from_secs(6 * 3600);

#[derive(Clone, Debug)]
pub struct WitnessOptions {
    pub probe_interval: Duration,
    pub burst_interval: Duration,
    /// The bearer token steps (begin, end, read) need; none only when the witness was started
    /// with `--allow-unauthenticated`.
    pub token: crate::serving::Token,
}

/// Why a witness step was not begun.
#[derive(Debug, PartialEq)]
pub enum BeginRefused {
    /// 400: the request is invalid (the field named).
    Invalid(String),
    /// 409: the id exists with other parameters (someone else began it first, or a typo).
    Conflict(String),
}

struct WStep {
    /// What it was begun with: a re-POST must ask for the same step.
    request: WitnessStepRequest,
    created_at: f64,
    until: f64,
    ended_at: Option<f64>,
    burst: Duration,
    targets: BTreeMap<String, TargetTimeline>,
    latencies: BTreeMap<String, VecDeque<(f64, f32)>>,
}

impl WStep {
    fn active(&self, now: f64) -> bool {
        self.ended_at.is_none() && now < self.until
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TargetLabels {
    target: String,
}

struct WitnessMetrics {
    registry: Registrar,
    mac_changes: Family<TargetLabels, Counter>,
    steps_active: Gauge,
}

impl WitnessMetrics {
    fn new(probes: &crate::timeline::ProbeMetrics) -> Self {
        let mut r = Registrar::default();
        probes.register(
            &mut r,
            "Probe round-trip time from the witness (a LAN client), successful or not",
            "Probes from the witness (a LAN client) that failed",
        );
        let mac_changes = Family::<TargetLabels, Counter>::default();
        r.register(
            "witness_mac_changes",
            "Changes of the MAC address the witness sends a target's traffic to (lease moves)",
            mac_changes.clone(),
        );
        let steps_active = Gauge::default();
        r.register(
            "witness_steps_active",
            "Steps the witness is burst-probing for",
            steps_active.clone(),
        );
        WitnessMetrics {
            registry: r,
            mac_changes,
            steps_active,
        }
    }
}

pub struct Witness {
    pub cfg: Config,
    pub opts: WitnessOptions,
    pub instance: String,
    pub started_at: f64,
    steps: Mutex<BTreeMap<String, WStep>>,
    steady: Mutex<BTreeMap<String, VecDeque<(f64, f32)>>>,
    neigh: Option<Arc<NeighLog>>,
    /// MAC last seen per target address, for the change counter.
    last_mac: Mutex<BTreeMap<String, Option<String>>>,
    /// The targets' probes: the recorder (metrics, latest outcomes and continuous samples per
    /// target, for moves and late steps) and the probe engine once started.
    host: crate::timeline::ProbeHost,
    moves: Mutex<VecDeque<Move>>,
    metrics: WitnessMetrics,
    changed: tokio::sync::watch::Sender<u64>,
}

/// A quantile of latencies in ms (see [`crate::stats::quantile`]).
fn quantile_ms(v: &[f32], q: f64) -> Option<f64> {
    crate::stats::quantile(v, q).map(f64::from)
}

fn push_bounded(q: &mut VecDeque<(f64, f32)>, x: (f64, f32)) {
    if q.len() >= MAX_LATENCIES {
        q.pop_front();
    }
    q.push_back(x);
}

/// A witness's cadences: steady probes every 10 ms to 1 h, bursts every 1 ms to 10 s (the
/// errors name `stepguard witness`'s flags).
pub fn check_intervals(probe: Duration, burst: Duration) -> anyhow::Result<()> {
    use crate::limits::{BURST_INTERVAL, PROBE_INTERVAL};
    crate::duration::flags(&[
        ("--probe-interval", probe, PROBE_INTERVAL),
        ("--burst-interval", burst, BURST_INTERVAL),
    ])
    .map_err(anyhow::Error::msg)
}

/// A witness's configuration: at least one target, every target's probe kind and options
/// valid.
pub fn check_config(cfg: &Config) -> anyhow::Result<()> {
    if cfg.targets.is_empty() {
        anyhow::bail!("a witness needs `targets` (the VIPs to probe)");
    }
    Ok(crate::probe::validate(cfg)?)
}

impl Witness {
    /// A witness for `cfg.targets` (a config read with `probe::load`, which checks every
    /// target's kind and options; a target it would refuse is never probed, its probes "not
    /// run"); `neigh` follows the targets' neighbour entries (None when netlink is
    /// unavailable: reports then carry no MACs).
    /// A witness for `cfg`, its targets and cadences checked first (see [`check_config`],
    /// [`check_intervals`]).
    pub fn new(
        cfg: Config,
        opts: WitnessOptions,
        neigh: Option<Arc<NeighLog>>,
    ) -> anyhow::Result<Arc<Witness>> {
        check_intervals(opts.probe_interval, opts.burst_interval)?;
        check_config(&cfg)?;
        let mut id = [0u8; 6];
        let _ = getrandom::fill(&mut id);
        let probes = crate::timeline::ProbeMetrics::default();
        let metrics = WitnessMetrics::new(&probes);
        let host = crate::timeline::ProbeHost::new(
            &cfg.targets,
            probes,
            crate::timeline::RingBounds {
                age_s: RING_S,
                max: RING_MAX,
            },
        );
        Ok(Arc::new(Witness {
            cfg,
            opts,
            instance: id.iter().map(|b| format!("{b:02x}")).collect(),
            started_at: clock::now(),
            steps: Mutex::new(BTreeMap::new()),
            steady: Mutex::new(BTreeMap::new()),
            neigh,
            last_mac: Mutex::new(BTreeMap::new()),
            host,
            moves: Mutex::new(VecDeque::new()),
            metrics,
            changed: tokio::sync::watch::Sender::new(0),
        }))
    }

    /// The addresses whose neighbour entries a witness follows.
    pub fn watched(cfg: &Config) -> Vec<IpAddr> {
        cfg.targets.iter().map(|t| t.address).collect()
    }

    /// The cadence now: the fastest active step's burst, or the steady interval.
    fn interval(&self) -> Duration {
        let now = clock::now();
        lock(&self.steps)
            .values()
            .filter(|s| s.active(now))
            .map(|s| s.burst)
            .min()
            .unwrap_or(self.opts.probe_interval)
    }

    fn record(&self, target: &crate::config::Target, o: &ProbeOutcome) {
        let sample = self.host.recorder.record(target, o, true).sample;
        if !o.ran {
            let now = clock::now();
            for s in lock(&self.steps).values_mut().filter(|s| s.active(now)) {
                if let Some(t) = s.targets.get_mut(&target.name) {
                    t.not_sent(&o.detail);
                }
            }
            return;
        }
        let lat = (o.sent_at, (o.latency.as_secs_f64() * 1e3) as f32);
        if o.ok {
            let mut steady = lock(&self.steady);
            let q = steady.entry(target.name.clone()).or_default();
            while q.front().is_some_and(|f| f.0 < o.sent_at - STEADY_WINDOW_S) {
                q.pop_front();
            }
            push_bounded(q, lat);
        }
        let now = clock::now();
        for s in lock(&self.steps).values_mut() {
            if !s.active(now) || o.sent_at < s.created_at {
                continue;
            }
            if let Some(t) = s.targets.get_mut(&target.name) {
                t.record(sample);
            }
            if o.ok {
                push_bounded(s.latencies.entry(target.name.clone()).or_default(), lat);
            }
        }
    }

    /// Every 500 ms: folds old samples (bounded memory in long steps), counts MAC changes,
    /// publishes the active step count.
    fn maintain(&self) {
        let now = clock::now();
        let cutoff = crate::timeline::compaction_cutoff(now, &self.cfg.targets);
        let mut active = 0;
        for s in lock(&self.steps).values_mut() {
            if s.active(now) {
                active += 1;
            }
            for t in s.targets.values_mut() {
                t.compact(cutoff);
            }
        }
        let m = &self.metrics;
        m.steps_active.set(active);
        if let Some(n) = &self.neigh {
            let mut last = lock(&self.last_mac);
            for t in &self.cfg.targets {
                let mac = n.since(t.address, now).last().and_then(|c| c.1.clone());
                // A move is one MAC replacing another. The first resolution, and an entry
                // that failed or is being resolved again, are not moves (the MAC last known
                // is kept, so A → unresolved → B is still one move from A to B).
                if mac.is_none() {
                    continue;
                }
                let prev = last.insert(t.name.clone(), mac.clone());
                if let Some(p) = prev.filter(|p| p.is_some() && *p != mac) {
                    m.mac_changes
                        .get_or_create(&TargetLabels {
                            target: t.name.clone(),
                        })
                        .inc();
                    // When it changed: the neighbour log knows to the notification.
                    let at = n
                        .since(t.address, now - 1.0)
                        .into_iter()
                        .rev()
                        .find(|c| c.1 == mac)
                        .map(|c| c.0)
                        .unwrap_or(now);
                    let mut moves = lock(&self.moves);
                    if moves.len() >= MAX_MOVES {
                        moves.pop_front();
                    }
                    moves.push_back(Move {
                        target: t.name.clone(),
                        at,
                        from: p,
                        to: mac,
                        gap_s: None,
                        error_bound_s: None,
                        outage_start: None,
                        outage_end: None,
                    });
                }
            }
        }
    }

    /// Every family's exposed name (`stepguard_…`), series or not.
    pub fn metric_families(&self) -> &[String] {
        self.metrics.registry.names()
    }

    fn encode_metrics(&self) -> String {
        let mut out = String::new();
        let _ =
            prometheus_client::encoding::text::encode(&mut out, self.metrics.registry.registry());
        out
    }
}

/// What the probe engine reports to: the witness's rings, steps and metrics.
impl crate::timeline::Vantage for Witness {
    fn targets(&self) -> &[crate::config::Target] {
        &self.cfg.targets
    }
    fn cadence_now(&self) -> (Duration, bool) {
        let base = self.interval();
        (base, base < self.opts.probe_interval)
    }
    fn outcome(&self, target: &crate::config::Target, o: &ProbeOutcome) {
        self.record(target, o);
    }
}

/// Starts the witness's probe loops and maintenance.
pub fn spawn_loops(w: &Arc<Witness>) {
    w.host.start(w);
    let w2 = w.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tick.tick().await;
            w2.maintain();
        }
    });
}

#[cfg(test)]
mod tests;
