//! The steps' families: the active step, its endpoints, each target's gap budget and last
//! gap by vantage point, the finished steps by verdict, the state dir's failed writes.
use super::{GapLabels, GaugeF, ProbeLabels, StateLabels, VerdictLabels, GAP_BUCKETS};
use crate::families::Registrar;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Unit;

pub struct StepMetrics {
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
}

impl StepMetrics {
    pub fn register(r: &mut Registrar) -> StepMetrics {
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
        StepMetrics {
            gap_budget,
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
        }
    }
}
