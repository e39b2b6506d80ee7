//! Whether a posted step may begin: its id, its cadence against the targets' timeouts, and
//! the steps already there (one at a time; re-posting the active id is idempotent; a
//! finished id is never begun again). The API answers each refusal with its status.
use super::{Step, StepParams};
use crate::duration;
use crate::limits::MAX_IN_FLIGHT;
use std::time::Duration;

/// What [`valid_id`] accepts, as a refusal says it.
pub const ID_RULE: &str =
    "1-64 characters of letters, digits, '-', '_' or '.', not starting with '.'";

/// A step id (the agent's and the witness's): 1–64 of `[A-Za-z0-9-_.]`, not starting with a
/// dot (it names a file).
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        && !id.starts_with('.')
}

/// A cadence so fine that a target's timeout (the longest, `longest_timeout`) would need more
/// probes in flight than the probe engine allows: probes would be skipped during an outage
/// and read as a stall. The one-line reason when so.
pub fn cadence_refused(params: &StepParams, longest_timeout: Option<Duration>) -> Option<String> {
    let t = longest_timeout?;
    (params.burst_interval * MAX_IN_FLIGHT as u32 <= t).then(|| {
        format!(
            "invalid step request: burst_interval: {} with a {} probe timeout needs more than {} probes in flight per target",
            duration::human(params.burst_interval),
            duration::human(t),
            MAX_IN_FLIGHT
        )
    })
}

/// What becomes of a posted step, given the active step and the finished one of the same id.
#[derive(Debug)]
pub enum Admission<'a> {
    /// Begin it.
    Begin,
    /// The active step is this one, asked for the same way: answer with it (idempotent).
    Same(&'a Step),
    /// The active step has this id but another parameter (named).
    SameIdOtherParams {
        active: &'a Step,
        field: &'static str,
    },
    /// Another step is active.
    Busy(&'a Step),
    /// This id already finished: its old verdict would answer a new restart.
    Finished(&'a Step),
}

/// One step at a time: checked when the request arrives (to answer at once) and again by
/// the runner, which alone installs a step.
pub fn admit<'a>(
    id: Option<&str>,
    params: &StepParams,
    active: Option<&'a Step>,
    finished: Option<&'a Step>,
) -> Admission<'a> {
    if let Some(a) = active.filter(|s| !s.is_final()) {
        if id == Some(a.id.as_str()) {
            return match a.params.differing_field(params) {
                None => Admission::Same(a),
                Some(field) => Admission::SameIdOtherParams { active: a, field },
            };
        }
        return Admission::Busy(a);
    }
    match finished.filter(|s| s.is_final() && Some(s.id.as_str()) == id) {
        Some(done) => Admission::Finished(done),
        None => Admission::Begin,
    }
}
