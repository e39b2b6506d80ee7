//! A Prometheus registry that keeps the exposed name of every family registered with it
//! (`stepguard_` + name + `_seconds` for a unit + `_total` for a counter), so the reference
//! docs can be checked against what the agent and the witness really expose, families with
//! no series yet included.
use prometheus_client::registry::{Metric, Registry, Unit};

/// The prefix of every family.
pub const PREFIX: &str = "stepguard";

pub struct Registrar {
    registry: Registry,
    names: Vec<String>,
}

impl Default for Registrar {
    fn default() -> Self {
        Registrar {
            registry: Registry::with_prefix(PREFIX),
            names: Vec::new(),
        }
    }
}

impl Registrar {
    pub fn register(&mut self, name: &str, help: &str, metric: impl Metric) {
        self.note(name, None, &metric);
        self.registry.register(name, help, metric);
    }

    pub fn register_with_unit(&mut self, name: &str, help: &str, unit: Unit, metric: impl Metric) {
        self.note(name, Some(&unit), &metric);
        self.registry.register_with_unit(name, help, unit, metric);
    }

    fn note(&mut self, name: &str, unit: Option<&Unit>, metric: &impl Metric) {
        let mut exposed = format!("{PREFIX}_{name}");
        if let Some(u) = unit {
            exposed = format!("{exposed}_{}", u.as_str());
        }
        if matches!(
            metric.metric_type(),
            prometheus_client::metrics::MetricType::Counter
        ) {
            exposed.push_str("_total");
        }
        self.names.push(exposed);
    }

    /// The exposed family names, in registration order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The registry, for encoding.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::gauge::Gauge;
    use prometheus_client::metrics::histogram::Histogram;

    #[test]
    fn the_exposed_names_carry_the_unit_and_the_counter_suffix() {
        let mut r = Registrar::default();
        r.register("steps", "h", Counter::<u64>::default());
        r.register("step_active", "h", Gauge::<i64>::default());
        r.register_with_unit("step_gap", "h", Unit::Seconds, Histogram::new([1.0]));
        assert_eq!(
            r.names(),
            [
                "stepguard_steps_total",
                "stepguard_step_active",
                "stepguard_step_gap_seconds"
            ]
        );
    }
}
