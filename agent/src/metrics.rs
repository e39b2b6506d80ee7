//! The agent's Prometheus metrics (names as in DESIGN.md, prefix `stepguard_`), exposed as
//! OpenMetrics text. Counters fed from kernel maps are advanced by the delta since the last
//! read, so they stay monotonic and survive a map that was re-read many times.
use crate::kernel::drops::KernelDrops;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::collections::BTreeMap;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CheckLabels {
    pub check: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VersionLabels {
    pub version: String,
}

pub struct Metrics {
    registry: Registry,
    kernel_drops: Family<ReasonLabels, Counter>,
    check_unknown: Family<CheckLabels, Gauge>,
    last_kernel_drops: BTreeMap<String, u64>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("stepguard");
        let kernel_drops = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "kernel_drops",
            "Packets the kernel dropped (skb:kfree_skb), by kernel drop reason",
            kernel_drops.clone(),
        );
        let check_unknown = Family::<CheckLabels, Gauge>::default();
        registry.register(
            "check_unknown",
            "1 when a check could not run (its result is unknown, never a pass)",
            check_unknown.clone(),
        );
        let build_info = Family::<VersionLabels, Gauge>::default();
        registry.register(
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
            registry,
            kernel_drops,
            check_unknown,
            last_kernel_drops: BTreeMap::new(),
        }
    }

    /// Reads the kernel drop counters and advances the exported counters by what is new.
    pub fn refresh_kernel_drops(&mut self, drops: &KernelDrops) {
        let unknown = self.check_unknown.get_or_create(&CheckLabels {
            check: "drops".into(),
        });
        match drops.by_reason() {
            Ok(now) => {
                unknown.set(0);
                for (reason, total) in now {
                    let last = self.last_kernel_drops.entry(reason.clone()).or_insert(0);
                    if total > *last {
                        self.kernel_drops
                            .get_or_create(&ReasonLabels { reason })
                            .inc_by(total - *last);
                        *last = total;
                    }
                }
            }
            Err(_) => {
                unknown.set(1);
            }
        }
    }

    /// OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
