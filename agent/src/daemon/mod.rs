//! `stepguard agent`: probes at a steady cadence (bursts during a step), node checks on a
//! slower one, the step protocol, and the state behind the HTTP API.
pub mod api;
pub mod implicit;
mod loads;
mod loops;
mod post;
pub mod runner;
pub mod store;
mod watch;

use crate::checks::{self, vips as vips_check, CheckResult};
use crate::config::Config;
use crate::kernel::clock;
use crate::kernel::drops::KernelDrops;
use crate::kernel::{bpffs, links};
use crate::locks::lock;
use crate::metrics::{DeviceLabels, KindLabels, MapLabels, Metrics, ProbeLabels};
use crate::node::{self, NodeOptions};
use crate::probe::{dns as dns_probe, ProbeOutcome};
use crate::step::Step;
pub use post::Posted;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use store::StepStore;

#[derive(Clone, Debug)]
pub struct DaemonOptions {
    pub state_dir: PathBuf,
    pub probe_interval: Duration,
    pub slow_interval: Duration,
    pub burst_interval: Duration,
    /// The bearer token mutating requests must carry (read again when its file changes).
    pub token: crate::serving::Token,
    /// Load the agent's eBPF drop counter (off only in in-process tests).
    pub drop_accounting: bool,
    /// Long-polls held at once; more are answered at once.
    pub max_long_polls: usize,
}

pub use crate::checks::dns::DnsSample;

#[derive(Default)]
pub struct ProbeView {
    pub dns: VecDeque<DnsSample>,
}

#[derive(Default)]
pub struct NodeView {
    /// devices, maps, config from the slow loop.
    pub results: BTreeMap<String, CheckResult>,
    pub links: Option<links::Observation>,
    pub maps: Option<bpffs::MapsObservation>,
    /// The version the running cilium-agent's API reported at the last refresh.
    pub agent_version: Option<String>,
    /// The overlay the configuration asks for, as last read, and when (the newest read:
    /// refreshes may overlap).
    pub overlay: Option<(crate::cilium::devices::OverlayIntent, f64)>,
    /// What the configuration asks of endpoints and host hooks, as last read.
    pub asks: Option<crate::cilium::devices::Asks>,
    pub checked_at: f64,
}

pub struct Daemon {
    cfg: Config,
    opts: DaemonOptions,
    /// Ready for traffic: set by the command once serving, cleared first on shutdown.
    ready: crate::serving::Readiness,
    metrics: Metrics,
    kernel_drops: Mutex<KernelDrops>,
    node: Mutex<NodeView>,
    probes: Mutex<ProbeView>,
    /// Where the east-west targets' routes end (looked up with the kernel checks).
    east_west: Mutex<vips_check::EastWest>,
    store: StepStore,
    /// The runner's latest snapshot of the current (or last) step; only the runner sends.
    snapshot: tokio::sync::watch::Sender<Option<Arc<Step>>>,
    /// The runner's channels (commands from the API, samples from the probes).
    ports: runner::Ports,
    /// A step is active (probe samples go to the runner).
    step_active: AtomicBool,
    /// The active step's burst cadence.
    burst_interval_ns: AtomicU64,
    /// Bumped whenever a step changes, to wake long-polls and probe loops.
    changed: tokio::sync::watch::Sender<u64>,
    burst: AtomicBool,
    wake_slow: tokio::sync::Notify,
    /// `answers: baseline` references (see [`Daemon::answer_changed`]).
    answer_refs: Mutex<BTreeMap<String, Vec<std::net::IpAddr>>>,
    /// Long-polls being held.
    long_polls: Arc<tokio::sync::Semaphore>,
    /// Set on SIGTERM: long-polls answer at once.
    shutting_down: tokio::sync::watch::Sender<bool>,
    /// Held while a posted step is admitted and begun (one at a time).
    begin_lock: tokio::sync::Mutex<()>,
    /// On-demand `GET /v1/checks`: one run at a time, reused for a moment (coalesced).
    on_demand: tokio::sync::Mutex<Option<(Instant, Vec<CheckResult>)>>,
    /// The targets' probes: the recorder (metrics, latest outcomes, and the steady samples of
    /// the last minute: the evidence an implicit step has from before it was detected) and
    /// the probe engine once the loops are spawned.
    host: crate::timeline::ProbeHost,
    /// `stepguard_probe_send_delay_seconds` (a handle on the registered series: the probe
    /// thread records each send into it).
    send_delay: prometheus_client::metrics::histogram::Histogram,
    /// A runtime on a thread of its own for kernel observations (netlink dumps, bpf(2) calls,
    /// map counts), so they never hold up the probes' send times on the main workers.
    kernel: tokio::runtime::Handle,
    /// Host devices, addresses and routes, dumped again only when rtnetlink reports a change.
    topology: links::SharedTopology,
    /// Targets whose answers must stay what they were when a step began (`answers: baseline`).
    baseline_answers: BTreeSet<String>,
}

/// Starts the kernel-observation runtime (a current-thread runtime on its own OS thread).
fn kernel_runtime() -> anyhow::Result<tokio::runtime::Handle> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("kernel-observe".into())
        .spawn(move || {
            match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => {
                    let _ = tx.send(Ok(rt.handle().clone()));
                    rt.block_on(std::future::pending::<()>());
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                }
            }
        })?;
    Ok(rx.recv()??)
}

/// Steady samples kept per target for implicit steps.
const RECENT_S: f64 = 60.0;
const RECENT_MAX: usize = 6000;

/// How long DNS samples are kept (the baseline uses the last minute).
const DNS_WINDOW_S: f64 = 120.0;

impl Daemon {
    pub fn new(cfg: Config, opts: DaemonOptions) -> anyhow::Result<Arc<Daemon>> {
        // Every target's probe kind and options (the config layer does not know the kinds),
        // before anything is created.
        crate::probe::validate(&cfg)?;
        let store = StepStore::new(&opts.state_dir)
            .map_err(|e| anyhow::anyhow!("state directory {}: {e}", opts.state_dir.display()))?;
        let baseline_answers = cfg
            .targets
            .iter()
            .filter(|t| {
                matches!(
                    crate::probe::dns::answers(t),
                    Ok(Some(crate::config::Answers::Baseline))
                )
            })
            .map(|t| t.name.clone())
            .collect();
        let metrics = Metrics::new();
        for t in &cfg.targets {
            if let Some(g) = t.max_gap {
                metrics
                    .step
                    .gap_budget
                    .get_or_create(&ProbeLabels::of(t))
                    .set(g.as_secs_f64());
            }
        }
        let metrics_probes = metrics.probes.clone();
        let send_delay = metrics.probe_send_delay.clone();
        let (tx, _) = tokio::sync::watch::channel(0u64);
        let max_long_polls = opts.max_long_polls;
        // Per-CPU reads size their buffers by this: read it now, while descriptors are free.
        if let Err(e) = crate::kernel::bpf::possible_cpus() {
            tracing::warn!(error = %e, "cannot read the number of possible CPUs: per-CPU counters stay unknown");
        }
        let kernel_drops = if opts.drop_accounting {
            KernelDrops::start()
        } else {
            KernelDrops::Unavailable {
                reason: "drop accounting is off".into(),
            }
        };
        let host = crate::timeline::ProbeHost::new(
            &cfg.targets,
            metrics_probes,
            crate::timeline::RingBounds {
                age_s: RECENT_S,
                max: RECENT_MAX,
            },
        );
        let d = Arc::new(Daemon {
            cfg,
            opts,
            ready: crate::serving::Readiness::default(),
            metrics,
            kernel_drops: Mutex::new(kernel_drops),
            node: Mutex::new(NodeView::default()),
            probes: Mutex::new(ProbeView::default()),
            east_west: Mutex::new(Default::default()),
            store,
            snapshot: tokio::sync::watch::Sender::new(None),
            ports: runner::Ports::new(),
            step_active: AtomicBool::new(false),
            burst_interval_ns: AtomicU64::new(0),
            changed: tx,
            burst: AtomicBool::new(false),
            wake_slow: tokio::sync::Notify::new(),
            long_polls: Arc::new(tokio::sync::Semaphore::new(max_long_polls)),
            answer_refs: Mutex::new(BTreeMap::new()),
            shutting_down: tokio::sync::watch::Sender::new(false),
            on_demand: tokio::sync::Mutex::new(None),
            begin_lock: tokio::sync::Mutex::new(()),
            host,
            send_delay,
            kernel: kernel_runtime()?,
            baseline_answers,
            topology: Arc::new(tokio::sync::Mutex::new(links::TopologyCache::new())),
        });
        Ok(d)
    }

    /// The agent's readiness (`/readyz`): the command sets it once serving.
    pub fn readiness(&self) -> crate::serving::Readiness {
        self.ready.clone()
    }

    /// Shutting down: readiness goes false first, so nothing new is sent this way before the
    /// listener closes; long-polls answer at once with the step as it is.
    pub fn shut_down(&self) {
        self.ready.set(false);
        self.shutting_down.send_replace(true);
    }

    /// The configuration the agent runs with.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The kernel drop counter's attach point, or why there is none.
    pub fn drop_accounting(&self) -> Result<String, String> {
        let kd = lock(&self.kernel_drops);
        match kd.attach_point() {
            Some(at) => Ok(at.to_string()),
            None => Err(kd.unavailable_reason().unwrap_or("unavailable").to_string()),
        }
    }

    /// Wakes long-polls and the probe engine (a cadence may have changed).
    pub fn bump(&self) {
        self.bump_readers();
        self.host.wake();
    }

    /// Wakes long-polls only.
    pub fn bump_readers(&self) {
        self.changed.send_modify(|v| *v += 1);
    }

    pub fn probe_interval(&self) -> Duration {
        match self.burst_interval_ns.load(Ordering::SeqCst) {
            ns if ns > 0 && self.burst.load(Ordering::SeqCst) => Duration::from_nanos(ns),
            _ if self.burst.load(Ordering::SeqCst) => self.opts.burst_interval,
            _ => self.opts.probe_interval,
        }
    }

    /// The current (or last) step as the runner last published it.
    pub fn current_step(&self) -> Option<Arc<Step>> {
        self.snapshot.borrow().clone()
    }

    /// Records one VIP probe: metrics, latest outcome, and the step timeline.
    /// `answers: baseline`: while a step is active, an answer must be the one from just
    /// before it began; outside steps the reference follows the answers. `key` names the
    /// target or the resolver × name × type. Returns the problem when the answer changed.
    pub fn answer_changed(&self, key: &str, answers: &[std::net::IpAddr]) -> Option<String> {
        let mut refs = lock(&self.answer_refs);
        if !self.step_active.load(Ordering::SeqCst) {
            refs.insert(key.to_string(), answers.to_vec());
            return None;
        }
        let before = refs.get(key)?;
        (before.as_slice() != answers).then(|| {
            let show = |v: &[std::net::IpAddr]| {
                v.iter()
                    .map(|a| a.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            };
            format!(
                "the answer changed during the step: {} before, {} now",
                show(before),
                show(answers)
            )
        })
    }

    pub fn record_probe(&self, target: &crate::config::Target, o: &ProbeOutcome) {
        let mut judged;
        let o = match &o.answers {
            Some(a) if o.ok && self.baseline_answers.contains(&target.name) => {
                match self.answer_changed(&format!("target:{}", target.name), a) {
                    Some(problem) => {
                        judged = o.clone();
                        judged.ok = false;
                        judged.detail = problem;
                        &judged
                    }
                    None => o,
                }
            }
            _ => o,
        };
        // Into the active step's timeline (the runner owns it) or, between steps, the ring.
        // A probe that could not run is no sample: the gap it leaves is judged as a stall. A
        // full buffer drops samples the same way (never silently into a pass).
        let stepping = self.step_active.load(Ordering::SeqCst);
        let sample = self.host.recorder.record(target, o, !stepping).sample;
        if stepping {
            let _ = self.ports.samples.try_send(runner::Sample {
                target: target.name.clone(),
                sample,
                ran: o.ran,
                detail: if o.ran {
                    String::new()
                } else {
                    o.detail.clone()
                },
            });
        }
    }

    /// What the continuous probes have seen, for the checks decided from them.
    fn probe_windows<R>(&self, f: impl FnOnce(&checks::ProbeWindows) -> R) -> R {
        let latest = self.host.recorder.latest();
        let east_west = lock(&self.east_west).clone();
        let probes = lock(&self.probes);
        f(&checks::ProbeWindows {
            cfg: &self.cfg,
            now: clock::now(),
            latest: &latest,
            east_west: &east_west,
            dns: &probes.dns,
        })
    }

    /// The checks decided from the continuous probes, as they stand now.
    pub fn probe_results(&self) -> Vec<CheckResult> {
        self.probe_windows(|w| {
            checks::REGISTRY
                .iter()
                .filter_map(|c| c.from_probes)
                .map(|f| f(w))
                .collect()
        })
    }

    /// DNS p50 (ms) of successful queries since `since`.
    pub fn dns_p50_since(&self, since: f64) -> Option<f64> {
        let lat: Vec<Duration> = lock(&self.probes)
            .dns
            .iter()
            .filter(|d| d.at >= since)
            .filter_map(|d| d.latency)
            .collect();
        crate::stats::quantile(&lat, 0.5).map(|d| d.as_secs_f64() * 1e3)
    }

    /// Every registered node check as last known: the kernel checks from the slow loop, the
    /// probe checks from the continuous probe windows.
    pub fn node_results(&self) -> Vec<CheckResult> {
        // The node view first, then the probe windows (the order every path takes them).
        let view = lock(&self.node);
        self.probe_windows(|w| {
            checks::REGISTRY
                .iter()
                .map(|c| match c.from_probes {
                    Some(decide) => decide(w),
                    None => view.results.get(c.name).cloned().unwrap_or_else(|| {
                        CheckResult::unknown(
                            c.name,
                            crate::checks::Code::NotCheckedYet,
                            "not checked yet",
                            serde_json::json!({}),
                        )
                    }),
                })
                .collect()
        })
    }

    /// The version the running cilium-agent reported at the last config check (None: not
    /// configured, not answering, or not reported).
    pub fn agent_version(&self) -> Option<String> {
        lock(&self.node).agent_version.clone()
    }

    /// The overlay the configuration asked for at the newest read, and when it was read.
    pub fn overlay_intent(&self) -> Option<(crate::cilium::devices::OverlayIntent, f64)> {
        lock(&self.node).overlay.clone()
    }

    /// Whether the configuration runs the endpoint health checker, as last read.
    pub fn asks(&self) -> Option<crate::cilium::devices::Asks> {
        lock(&self.node).asks
    }

    /// Kernel drops by reason now (None: the signal is unknown).
    pub fn kernel_drops_now(&self) -> Option<BTreeMap<String, u64>> {
        lock(&self.kernel_drops).by_reason().ok()
    }

    /// Cilium's own drop counters by reason now (None: `cilium_metrics` unreadable).
    pub fn cilium_drops_now(&self) -> Option<BTreeMap<String, u64>> {
        use crate::cilium::drops;
        let (key_size, value_size) = drops::METRICS_LAYOUT;
        let layout = crate::kernel::counters::Layout {
            key_size,
            value_size,
        };
        crate::kernel::counters::sum_by_first_key_byte(
            &self.cfg.bpffs.join(drops::METRICS_MAP),
            layout,
        )
        .ok()
        .map(drops::by_reason)
    }

    /// Runs devices/maps/config now, stores and exports them.
    pub async fn refresh_node(&self) {
        // The kernel checks; the probe checks come from the continuous probe windows.
        let only: BTreeSet<String> = checks::REGISTRY
            .iter()
            .filter(|c| c.from_probes.is_none())
            .map(|c| c.name.to_string())
            .collect();
        let opts = NodeOptions {
            count_all: false,
            state_dir: Some(self.opts.state_dir.clone()),
            topology: Some(self.topology.clone()),
        };
        let (results, obs) = node::run(&self.cfg, &opts, &only).await;
        if self.cfg.targets.iter().any(|t| t.east_west) {
            let ew = vips_check::east_west_routes(&self.cfg.targets, &self.cfg.bpffs).await;
            *lock(&self.east_west) = ew;
        }
        let from_probes = self.probe_results();
        {
            let m = &self.metrics;
            for r in results.iter().chain(&from_probes) {
                m.checks.record(r);
            }
            if let Some(l) = &obs.links {
                let sel = checks::devices::carrying(&l.devices);
                for d in l.devices.iter().filter(|d| {
                    !checks::devices::excluded(
                        d,
                        &l.devices,
                        crate::cilium::devices::SelectionRules::newest(),
                    ) || sel.contains(&d.name)
                }) {
                    m.node
                        .device_selected
                        .get_or_create(&DeviceLabels {
                            device: d.name.clone(),
                        })
                        .set(sel.contains(&d.name) as i64);
                }
            }
            if let Some(mo) = &obs.maps {
                for (name, pm) in &mo.globals {
                    m.node
                        .map_present
                        .get_or_create(&MapLabels { map: name.clone() })
                        .set(1);
                    if let Some(n) = pm.entries {
                        m.node
                            .map_entries
                            .get_or_create(&MapLabels { map: name.clone() })
                            .set(n as i64);
                    }
                }
                for name in mo.unreadable.keys() {
                    m.node
                        .map_present
                        .get_or_create(&MapLabels { map: name.clone() })
                        .set(0);
                }
                for (kind, n) in &mo.endpoint_maps {
                    m.node
                        .endpoint_maps
                        .get_or_create(&KindLabels { kind: kind.clone() })
                        .set(*n as i64);
                }
            }
        }
        // The drop counters are read (bpf(2)) with no metrics lock held.
        self.metrics.set_drops(
            self.kernel_drops_now().as_ref(),
            self.cilium_drops_now().as_ref(),
        );
        // Maps the profile requires but that are gone: present = 0.
        {
            let m = &self.metrics;
            for n in checks::maps::missing(&results) {
                m.node
                    .map_present
                    .get_or_create(&MapLabels { map: n })
                    .set(0);
            }
        }
        let mut view = lock(&self.node);
        view.results = results
            .into_iter()
            .map(|r| (r.check.to_string(), r))
            .collect();
        view.links = obs.links;
        view.maps = obs.maps;
        view.agent_version = obs.agent_version;
        if let Some((i, at)) = obs.overlay {
            if view.overlay.as_ref().is_none_or(|(_, last)| at >= *last) {
                view.overlay = Some((i, at));
            }
        }
        if obs.asks.is_some() {
            view.asks = obs.asks;
        }
        view.checked_at = clock::now();
    }
}

pub use crate::timeline::supersedes;

/// Probes of one target in flight at once (a step's cadence must not need more: see the API).
pub use crate::limits::MAX_IN_FLIGHT;
pub use loops::*;

/// What the probe engine reports to: the daemon's timeline, metrics and latest outcomes.
impl crate::timeline::Vantage for Daemon {
    fn targets(&self) -> &[crate::config::Target] {
        &self.cfg.targets
    }
    fn cadence_now(&self) -> (Duration, bool) {
        (self.probe_interval(), self.burst.load(Ordering::SeqCst))
    }
    fn outcome(&self, target: &crate::config::Target, o: &ProbeOutcome) {
        self.record_probe(target, o);
    }
    fn late(&self, late: Duration) {
        self.send_delay.observe(late.as_secs_f64());
    }
}

#[cfg(test)]
mod tests;
