//! The agent's Prometheus metrics, names and labels as docs/reference/metrics.md lists them
//! (prefix `stepguard_`, base units, `_total` counters, no unbounded labels), exposed as
//! OpenMetrics. Each component registers its own families (`register(&mut Registrar)`): the
//! node checks (`checks.rs`), the probes (`timeline::ProbeMetrics`), steps (`step.rs`), the
//! node's devices and maps (`node.rs`), the drop counters (`drops.rs`). Families are atomics:
//! nothing here is behind a lock but the drop counters' last readings.
mod checks;
mod drops;
mod node;
mod step;

pub use checks::CheckMetrics;
pub use drops::DropCounters;
pub use node::NodeMetrics;
pub use step::StepMetrics;

use crate::families::Registrar;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Unit;
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

pub(crate) type GaugeF = Gauge<f64, AtomicU64>;

/// Send delay buckets: from 50 µs (what an idle runtime gives) to 100 ms.
pub const SEND_DELAY_BUCKETS: [f64; 11] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1,
];
pub const GAP_BUCKETS: [f64; 12] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0,
];

/// The agent's metrics: its registry and each component's handles on its families.
pub struct Metrics {
    registry: Registrar,
    pub checks: CheckMetrics,
    /// `probe_duration`, `probe_failures`: shared with the probe recorder.
    pub probes: ProbeMetrics,
    /// How late probes are sent against their schedule (the gap's resolution depends on it).
    pub probe_send_delay: Histogram,
    pub step: StepMetrics,
    pub node: NodeMetrics,
    pub drops: DropCounters,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut r = Registrar::default();
        let checks = CheckMetrics::register(&mut r);
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
        let step = StepMetrics::register(&mut r);
        let node = NodeMetrics::register(&mut r);
        let drops = DropCounters::register(&mut r);
        register_build_info(&mut r);
        Self {
            registry: r,
            checks,
            probes,
            probe_send_delay,
            step,
            node,
            drops,
        }
    }

    /// Advances the drop counters to the totals read now (`kernel`: `None` marks the kernel
    /// drops signal unknown).
    pub fn set_drops(
        &self,
        kernel: Option<&BTreeMap<String, u64>>,
        cilium: Option<&BTreeMap<String, u64>>,
    ) {
        self.checks.set_unknown("drops", kernel.is_none());
        self.drops.advance(kernel, cilium);
    }

    /// OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, self.registry.registry());
        out
    }

    /// Every family's exposed name (`stepguard_…`), series or not.
    pub fn families(&self) -> &[String] {
        self.registry.names()
    }
}

/// `stepguard_build_info{version}`, always 1.
fn register_build_info(r: &mut Registrar) {
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
}
