//! The node checks' families: passed, unknown, how long each took.
use super::{CheckLabels, GaugeF};
use crate::checks::{CheckResult, Status};
use crate::families::Registrar;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Unit;

pub struct CheckMetrics {
    pub passed: Family<CheckLabels, Gauge>,
    pub unknown: Family<CheckLabels, Gauge>,
    pub duration: Family<CheckLabels, GaugeF>,
}

impl CheckMetrics {
    pub fn register(r: &mut Registrar) -> CheckMetrics {
        let passed = Family::<CheckLabels, Gauge>::default();
        r.register(
            "check_passed",
            "1 when the node check passes, 0 otherwise (fail or unknown)",
            passed.clone(),
        );
        let unknown = Family::<CheckLabels, Gauge>::default();
        r.register(
            "check_unknown",
            "1 when the check could not run (unknown is never a pass)",
            unknown.clone(),
        );
        let duration = Family::<CheckLabels, GaugeF>::default();
        r.register_with_unit(
            "check_duration",
            "How long the check took last time",
            Unit::Seconds,
            duration.clone(),
        );
        CheckMetrics {
            passed,
            unknown,
            duration,
        }
    }

    /// A check's last result.
    pub fn record(&self, r: &CheckResult) {
        let l = CheckLabels {
            check: r.check.into(),
        };
        self.passed
            .get_or_create(&l)
            .set((r.status == Status::Pass) as i64);
        self.unknown
            .get_or_create(&l)
            .set((r.status == Status::Unknown) as i64);
        self.duration
            .get_or_create(&l)
            .set(r.duration_ms.as_secs_f64());
    }

    /// Marks a signal known or unknown without a full result (the drops signal).
    pub fn set_unknown(&self, check: &str, unknown: bool) {
        self.unknown
            .get_or_create(&CheckLabels {
                check: check.into(),
            })
            .set(unknown as i64);
    }
}
