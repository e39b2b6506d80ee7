//! Implicit steps' rules: a cilium-agent restart nobody stepped (a RollingUpdate, a crash,
//! an OOM kill, a reboot) is verified like a posted step. What counts as a restart, what the
//! step found at the agent's own start says, and the step itself, begun from the steady
//! snapshot. The daemon (`daemon/implicit.rs`) watches, keeps the snapshot and begins it.
use super::{Baseline, Origin, Step, StepParams, StepRequest, TargetTimeline};
use std::collections::BTreeMap;
use std::time::Duration;

/// The baseline a step would take now, kept while no step runs.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Steady {
    pub at: f64,
    pub boot_id: Option<String>,
    pub baseline: Baseline,
}

/// The tracked keys whose program is not the snapshot's any more (`now`: by key).
pub fn programs_changed(base: &Baseline, now: &BTreeMap<String, Option<u32>>) -> Vec<String> {
    base.programs
        .iter()
        .filter(|(k, v)| now.get(*k).copied().flatten() != Some(**v))
        .map(|(k, _)| k.clone())
        .collect()
}

/// What the watcher saw since its last look, as the trigger of an implicit step (None: no
/// restart). The API socket going down is the earliest signal Cilium gives on the host
/// (see docs/cilium-fidelity.md); new program ids on the tracked devices the surest.
pub fn trigger(api_went_down: bool, changed: &[String]) -> Option<String> {
    if api_went_down {
        Some("the cilium-agent API socket stopped answering (stopped, or starting)".to_string())
    } else if !changed.is_empty() {
        Some(format!("new program ids on {}", changed.join(", ")))
    } else {
        None
    }
}

/// At the agent's own start, against the snapshot it persisted (`old`): a reboot (another
/// boot id) or new program ids mean the cilium-agent restarted while this agent was down.
/// Returns the trigger and why the evidence is incomplete.
pub fn found_at_start(
    old: &Steady,
    changed: &[String],
    boot_id: Option<&str>,
    now: f64,
) -> Option<(String, String)> {
    let rebooted = old.boot_id.is_some() && old.boot_id.as_deref() != boot_id;
    if !rebooted && changed.is_empty() {
        return None;
    }
    let what = if rebooted {
        "the node rebooted".to_string()
    } else {
        format!("new program ids on {}", changed.join(", "))
    };
    let incomplete = format!(
        "this agent was down while the cilium-agent restarted ({what} since its snapshot {:.0}s ago): the outage and the reload were not observed",
        now - old.at
    );
    Some((format!("found at the agent's start: {what}"), incomplete))
}

/// An implicit step's parameters: the configured settle and timeout, the configured
/// witnesses, the targets' own gap budgets.
pub fn params(
    settle: Duration,
    timeout: Duration,
    witnesses: &[String],
    burst_interval: Duration,
    budgets: &[Duration],
) -> Result<StepParams, super::RequestError> {
    let ms = |x: Duration| Some(format!("{}ms", x.as_millis()));
    let req = StepRequest {
        settle: ms(settle),
        timeout: ms(timeout),
        witnesses: Some(witnesses.to_vec()),
        ..Default::default()
    };
    StepParams::from_request(&req, burst_interval, budgets).map(|(_, p)| p)
}

/// The implicit step `id` from `steady`, because of `trigger`; `targets` are seeded with the
/// steady probes since the snapshot (`running`: targets already failing at detection), so
/// the gap's error bound widens to the steady cadence before detection.
#[allow(clippy::too_many_arguments)]
pub fn begin(
    id: String,
    steady: &Steady,
    params: StepParams,
    targets: BTreeMap<String, TargetTimeline>,
    running: &[String],
    trigger: &str,
    incomplete: Option<String>,
    now: f64,
) -> Step {
    let mut why = format!(
        "{trigger}; before it (from {:.1}s earlier) the evidence is the steady probes' (their cadence widens the gap bounds)",
        now - steady.at
    );
    if !running.is_empty() {
        why.push_str(&format!(
            "; an outage was already running at detection on {}",
            running.join(", ")
        ));
    }
    let mut s = Step::new(id, steady.at, params, steady.baseline.clone(), targets);
    s.origin = Origin::Implicit;
    s.trigger = Some(why);
    s.evidence_incomplete = incomplete;
    s.boot_id = steady.boot_id.clone();
    s
}
