//! The agent's Prometheus metrics, names and labels as DESIGN.md lists them (prefix
//! `stepguard_`, base units, `_total` counters, no unbounded labels), exposed as OpenMetrics.
//! Counters fed from kernel maps advance by the delta since the last read.
use crate::checks::{CheckResult, Status};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};
use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;

macro_rules! labels {
    ($name:ident { $($f:ident),* }) => {
        #[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
        pub struct $name { $(pub $f: String),* }
    };
}
labels!(ReasonLabels { reason });
labels!(CheckLabels { check });
labels!(VersionLabels { version });
pub use crate::timeline::{ProbeLabels, ProbeMetrics, PROBE_BUCKETS};
labels!(GapLabels {
    kind,
    target,
    vantage
});
labels!(VerdictLabels { verdict, origin });
labels!(DeviceLabels { device });
labels!(MapLabels { map });
labels!(KindLabels { kind });
labels!(StateLabels { state });

type GaugeF = Gauge<f64, AtomicU64>;

/// Send delay buckets: from 50 µs (what an idle runtime gives) to 100 ms.
pub const SEND_DELAY_BUCKETS: [f64; 11] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1,
];
pub const GAP_BUCKETS: [f64; 12] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0,
];

pub struct Metrics {
    registry: Registry,
    pub check_passed: Family<CheckLabels, Gauge>,
    pub check_unknown: Family<CheckLabels, Gauge>,
    pub check_duration: Family<CheckLabels, GaugeF>,
    /// `probe_duration`, `probe_failures`: shared with the probe recorder.
    pub probes: ProbeMetrics,
    /// How late probes are sent against their schedule (the gap's resolution depends on it).
    pub probe_send_delay: Histogram,
    pub gap_budget: Family<ProbeLabels, GaugeF>,
    /// By vantage point: `node` (the agent's own probes) or `witness:<host:port>`.
    pub last_step_gap: Family<GapLabels, GaugeF>,
    pub step_gap: Histogram,
    pub step_active: Gauge,
    /// The active (or last) step's endpoints by state: `followed` (at the baseline),
    /// `regenerated`, `pending`, `deleted`.
    pub step_endpoints: Family<StateLabels, Gauge>,
    /// How long after the host datapath the slowest endpoint regenerated (active or last step).
    pub step_endpoint_regeneration_slowest: GaugeF,
    /// Writes of step records that failed (a full or read-only state dir).
    pub state_write_errors: Counter,
    pub steps: Family<VerdictLabels, Counter>,
    pub last_step_passed: Gauge,
    pub last_step_started: GaugeF,
    pub last_step_finished: GaugeF,
    pub device_selected: Family<DeviceLabels, Gauge>,
    pub map_present: Family<MapLabels, Gauge>,
    pub map_entries: Family<MapLabels, Gauge>,
    pub endpoint_maps: Family<KindLabels, Gauge>,
    kernel_drops: Family<ReasonLabels, Counter>,
    cilium_drops: Family<ReasonLabels, Counter>,
    last_kernel_drops: BTreeMap<String, u64>,
    last_cilium_drops: BTreeMap<String, u64>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut r = Registry::with_prefix("stepguard");
        let check_passed = Family::<CheckLabels, Gauge>::default();
        r.register(
            "check_passed",
            "1 when the node check passes, 0 otherwise (fail or unknown)",
            check_passed.clone(),
        );
        let check_unknown = Family::<CheckLabels, Gauge>::default();
        r.register(
            "check_unknown",
            "1 when the check could not run (unknown is never a pass)",
            check_unknown.clone(),
        );
        let check_duration = Family::<CheckLabels, GaugeF>::default();
        r.register_with_unit(
            "check_duration",
            "How long the check took last time",
            Unit::Seconds,
            check_duration.clone(),
        );
        let probes = ProbeMetrics::default();
        probes.register(
            &mut r,
            "Probe round-trip time, successful or not",
            "Probes that failed (timeout, refused, wrong answer)",
        );
        let probe_send_delay = Histogram::new(SEND_DELAY_BUCKETS);
        r.register_with_unit(
            "probe_send_delay",
            "How late a VIP probe was sent against its schedule",
            Unit::Seconds,
            probe_send_delay.clone(),
        );
        let gap_budget = Family::<ProbeLabels, GaugeF>::default();
        r.register_with_unit(
            "gap_budget",
            "Longest acceptable outage of the target during a step",
            Unit::Seconds,
            gap_budget.clone(),
        );
        let last_step_gap = Family::<GapLabels, GaugeF>::default();
        r.register_with_unit(
            "last_step_gap",
            "Longest outage of the target during the last step, by vantage point (node: the agent's own probes; witness:HOST:PORT: a LAN client)",
            Unit::Seconds,
            last_step_gap.clone(),
        );
        let step_gap = Histogram::new(GAP_BUCKETS);
        r.register_with_unit(
            "step_gap",
            "Longest outage per target per finished step",
            Unit::Seconds,
            step_gap.clone(),
        );
        let step_active = Gauge::default();
        r.register(
            "step_active",
            "1 while a step is being watched",
            step_active.clone(),
        );
        let step_endpoints = Family::<StateLabels, Gauge>::default();
        r.register(
            "step_endpoints",
            "Endpoints of the active or last step by state: followed (carrying cil_from_container at the baseline), regenerated (new program ids), pending, deleted",
            step_endpoints.clone(),
        );
        let step_endpoint_regeneration_slowest = GaugeF::default();
        r.register_with_unit(
            "step_endpoint_regeneration_slowest",
            "How long after the host datapath's first new program the slowest endpoint of the active or last step got new programs",
            Unit::Seconds,
            step_endpoint_regeneration_slowest.clone(),
        );
        let state_write_errors = Counter::default();
        r.register(
            "state_write_errors",
            "Step records that could not be written to the state dir (full or read-only)",
            state_write_errors.clone(),
        );
        let steps = Family::<VerdictLabels, Counter>::default();
        r.register("steps", "Finished steps by verdict", steps.clone());
        let last_step_passed = Gauge::default();
        r.register(
            "last_step_passed",
            "1 when the last finished step passed",
            last_step_passed.clone(),
        );
        let last_step_started = GaugeF::default();
        r.register_with_unit(
            "last_step_started_timestamp",
            "When the last step began (unix time)",
            Unit::Seconds,
            last_step_started.clone(),
        );
        let last_step_finished = GaugeF::default();
        r.register_with_unit(
            "last_step_finished_timestamp",
            "When the last step was decided (unix time)",
            Unit::Seconds,
            last_step_finished.clone(),
        );
        let device_selected = Family::<DeviceLabels, Gauge>::default();
        r.register(
            "device_selected",
            "1 when the host device carries cil_from_netdev",
            device_selected.clone(),
        );
        let map_present = Family::<MapLabels, Gauge>::default();
        r.register(
            "bpf_map_present",
            "1 when the global pinned map is present and opens",
            map_present.clone(),
        );
        let map_entries = Family::<MapLabels, Gauge>::default();
        r.register(
            "bpf_map_entries",
            "Entries in the global pinned map (hash-like maps)",
            map_entries.clone(),
        );
        let endpoint_maps = Family::<KindLabels, Gauge>::default();
        r.register(
            "bpf_endpoint_maps",
            "Per-endpoint pinned maps by kind",
            endpoint_maps.clone(),
        );
        let kernel_drops = Family::<ReasonLabels, Counter>::default();
        r.register(
            "kernel_drops",
            "Packets the kernel dropped (skb:kfree_skb), by kernel drop reason",
            kernel_drops.clone(),
        );
        let cilium_drops = Family::<ReasonLabels, Counter>::default();
        r.register(
            "cilium_drops",
            "Packets Cilium dropped (pinned cilium_metrics), by Cilium drop reason",
            cilium_drops.clone(),
        );
        let build_info = Family::<VersionLabels, Gauge>::default();
        r.register(
            "build_info",
            "stepguard build information (always 1)",
            build_info.clone(),
        );
        build_info
            .get_or_create(&VersionLabels {
                version: env!("CARGO_PKG_VERSION").into(),
            })
            .set(1);
        Self {
            registry: r,
            check_passed,
            check_unknown,
            check_duration,
            probes,
            gap_budget,
            probe_send_delay,
            last_step_gap,
            step_gap,
            step_active,
            step_endpoints,
            step_endpoint_regeneration_slowest,
            state_write_errors,
            steps,
            last_step_passed,
            last_step_started,
            last_step_finished,
            device_selected,
            map_present,
            map_entries,
            endpoint_maps,
            kernel_drops,
            cilium_drops,
            last_kernel_drops: BTreeMap::new(),
            last_cilium_drops: BTreeMap::new(),
        }
    }

    pub fn record_check(&self, r: &CheckResult) {
        let l = CheckLabels {
            check: r.check.into(),
        };
        self.check_passed
            .get_or_create(&l)
            .set((r.status == Status::Pass) as i64);
        self.check_unknown
            .get_or_create(&l)
            .set((r.status == Status::Unknown) as i64);
        self.check_duration
            .get_or_create(&l)
            .set(r.duration_ms.as_secs_f64());
    }

    fn advance(
        family: &Family<ReasonLabels, Counter>,
        last: &mut BTreeMap<String, u64>,
        now: &BTreeMap<String, u64>,
    ) {
        for (reason, total) in now {
            let prev = last.entry(reason.clone()).or_insert(0);
            if *total > *prev {
                family
                    .get_or_create(&ReasonLabels {
                        reason: reason.clone(),
                    })
                    .inc_by(*total - *prev);
            } else {
                // A counter that went down (map re-created): count from the new value on.
                let _ = family.get_or_create(&ReasonLabels {
                    reason: reason.clone(),
                });
            }
            *prev = *total;
        }
    }

    /// Advances `kernel_drops_total` to the totals read now; `None` marks the signal unknown.
    pub fn set_kernel_drops(&mut self, now: Option<&BTreeMap<String, u64>>) {
        self.check_unknown
            .get_or_create(&CheckLabels {
                check: "drops".into(),
            })
            .set(now.is_none() as i64);
        if let Some(now) = now {
            Self::advance(&self.kernel_drops, &mut self.last_kernel_drops, now);
        }
    }

    pub fn set_cilium_drops(&mut self, now: &BTreeMap<String, u64>) {
        Self::advance(&self.cilium_drops, &mut self.last_cilium_drops, now);
    }

    /// Compatibility helper for callers holding a `KernelDrops`.
    pub fn refresh_kernel_drops(&mut self, drops: &crate::kernel::drops::KernelDrops) {
        let now = drops.by_reason().ok();
        self.set_kernel_drops(now.as_ref());
    }

    /// OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
