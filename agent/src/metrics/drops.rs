//! The drop counters: `kernel_drops_total` (the agent's own skb:kfree_skb counter) and
//! `cilium_drops_total` (Cilium's pinned `cilium_metrics`), by reason. They advance by the
//! delta since the last reading, so a map re-created with its counters at zero never makes a
//! counter go down. The readings are taken by the caller (bpf(2), outside any lock here); only
//! the last totals are kept under this component's own lock.
use super::ReasonLabels;
use crate::families::Registrar;
use crate::locks::lock;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use std::collections::BTreeMap;
use std::sync::Mutex;

pub struct DropCounters {
    kernel: Family<ReasonLabels, Counter>,
    cilium: Family<ReasonLabels, Counter>,
    /// The totals last read: kernel, Cilium.
    last: Mutex<(BTreeMap<String, u64>, BTreeMap<String, u64>)>,
}

impl DropCounters {
    pub fn register(r: &mut Registrar) -> DropCounters {
        let kernel = Family::<ReasonLabels, Counter>::default();
        r.register(
            "kernel_drops",
            "Packets the kernel dropped (skb:kfree_skb), by kernel drop reason",
            kernel.clone(),
        );
        let cilium = Family::<ReasonLabels, Counter>::default();
        r.register(
            "cilium_drops",
            "Packets Cilium dropped (pinned cilium_metrics), by Cilium drop reason",
            cilium.clone(),
        );
        DropCounters {
            kernel,
            cilium,
            last: Mutex::new(Default::default()),
        }
    }

    /// Advances the counters to the totals read now (a source not read stays as it was).
    pub fn advance(
        &self,
        kernel: Option<&BTreeMap<String, u64>>,
        cilium: Option<&BTreeMap<String, u64>>,
    ) {
        let mut last = lock(&self.last);
        let (last_kernel, last_cilium) = &mut *last;
        if let Some(now) = kernel {
            advance(&self.kernel, last_kernel, now);
        }
        if let Some(now) = cilium {
            advance(&self.cilium, last_cilium, now);
        }
    }
}

fn advance(
    family: &Family<ReasonLabels, Counter>,
    last: &mut BTreeMap<String, u64>,
    now: &BTreeMap<String, u64>,
) {
    for (reason, total) in now {
        let prev = last.entry(reason.clone()).or_insert(0);
        let series = family.get_or_create(&ReasonLabels {
            reason: reason.clone(),
        });
        // A counter that went down (map re-created): count from the new value on.
        if *total > *prev {
            series.inc_by(*total - *prev);
        }
        *prev = *total;
    }
}
