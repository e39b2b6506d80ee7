//! The proof of a cilium-agent start: which step of this agent verified the datapath that a
//! cilium-agent container started at a given moment loaded (pure).
//!
//! The stepper reads the cilium-agent container's `state.running.startedAt` from the pod
//! status (the kubelet's clock, the same node's clock as this agent's) and asks which step
//! covers it. A container started at `S` loads its programs after `S`; the first datapath
//! reload this agent saw at or after `S` is therefore that container's own (no other
//! cilium-agent runs on the node after it started), and the step that saw it is the proof.
//! A step that saw only reloads before `S` belongs to an earlier start (stale); a step that
//! saw none proves nothing (a step begun and never followed by a restart, an orphan); a
//! restart after the step moves `S` past it. `startedAt` is written in whole seconds, so `S`
//! is at most a second early, which only widens the window backwards into a time no earlier
//! start can have reloaded in.
use super::{Reason, Status, Step, Verdict};
use serde::{Deserialize, Serialize};

/// What a start's proof is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProofStatus {
    /// A step saw this start's reload and passed.
    Passed,
    /// A step saw this start's reload and failed: the node is not healthy.
    Failed,
    /// A step that saw (or may yet see) this start's reload has no verdict yet.
    Pending,
    /// No step of this agent can vouch for this start (the agent was down, its records were
    /// pruned or wiped, or the only step that saw it could not observe it whole).
    Unproven,
}

impl ProofStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            ProofStatus::Passed => "passed",
            ProofStatus::Failed => "failed",
            ProofStatus::Pending => "pending",
            ProofStatus::Unproven => "unproven",
        }
    }
}

/// The step a proof rests on, as the stepper shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProofStep {
    pub id: String,
    pub origin: super::Origin,
    pub created_at: f64,
    /// The first datapath reload the step saw (unix seconds).
    pub reloaded_at: Option<f64>,
    pub verdict: Option<Verdict>,
}

/// The answer to "which step covers the cilium-agent started at `started_at`".
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Proof {
    pub started_at: f64,
    pub status: ProofStatus,
    pub step: Option<ProofStep>,
    /// One line for people: what decided.
    pub why: String,
}

/// The first datapath reload a step saw: the earliest moment one of its tracked programs
/// was seen replaced.
pub fn first_reload(s: &Step) -> Option<f64> {
    s.reload
        .changed
        .values()
        .map(|(_, at)| *at)
        .min_by(f64::total_cmp)
}

fn brief(s: &Step) -> ProofStep {
    ProofStep {
        id: s.id.clone(),
        origin: s.origin,
        created_at: s.created_at,
        reloaded_at: first_reload(s),
        verdict: s.verdict.clone(),
    }
}

/// A moment for people (RFC 3339, UTC, milliseconds).
fn when(t: f64) -> String {
    k8s_openapi::jiff::Timestamp::from_millisecond((t * 1000.0) as i64)
        .map(|ts| format!("{ts:.3}"))
        .unwrap_or_else(|_| format!("{t:.3}"))
}

/// The proof of the start at `started_at` among `steps` (every step the agent holds, the
/// active one included).
pub fn covering<'a>(steps: impl IntoIterator<Item = &'a Step>, started_at: f64) -> Proof {
    let steps: Vec<&Step> = steps.into_iter().collect();
    let proof = |status, step: Option<&Step>, why: String| Proof {
        started_at,
        status,
        step: step.map(brief),
        why,
    };
    let first = steps
        .iter()
        .filter_map(|s| first_reload(s).map(|r| (r, s)))
        .filter(|(r, _)| *r >= started_at)
        .min_by(|a, b| a.0.total_cmp(&b.0));
    if let Some((reloaded, s)) = first {
        let at = when(reloaded);
        return match &s.verdict {
            None => proof(
                ProofStatus::Pending,
                Some(s),
                format!(
                    "step {} saw the datapath reload at {at} and has no verdict yet",
                    s.id
                ),
            ),
            Some(v) if v.status == Status::Passed => proof(
                ProofStatus::Passed,
                Some(s),
                format!("step {} saw the datapath reload at {at} and passed", s.id),
            ),
            Some(v) if v.status == Status::Cancelled => proof(
                ProofStatus::Unproven,
                Some(s),
                format!("step {} saw the datapath reload at {at} but was cancelled", s.id),
            ),
            // A step that could not observe the restart whole vouches neither way: the
            // node is stepped again to prove it.
            Some(v) if v.reasons.iter().all(|r| *r == Reason::EvidenceIncomplete) => proof(
                ProofStatus::Unproven,
                Some(s),
                format!(
                    "step {} saw the datapath reload at {at} but could not observe the restart whole: {}",
                    s.id, v.summary
                ),
            ),
            Some(v) => proof(
                ProofStatus::Failed,
                Some(s),
                format!(
                    "step {} saw the datapath reload at {at} and failed ({}): {}",
                    s.id,
                    v.reasons
                        .iter()
                        .map(|r| r.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                    v.summary
                ),
            ),
        };
    }
    if let Some(active) = steps.iter().find(|s| !s.is_final()) {
        return proof(
            ProofStatus::Pending,
            Some(active),
            format!(
                "step {} is active and has not seen a datapath reload after the cilium-agent's start at {} yet",
                active.id,
                when(started_at)
            ),
        );
    }
    let since = steps
        .iter()
        .map(|s| s.created_at)
        .min_by(f64::total_cmp)
        .map(|t| format!("its records begin at {}", when(t)))
        .unwrap_or_else(|| "it holds no step at all".into());
    proof(
        ProofStatus::Unproven,
        None,
        format!(
            "no step of this agent saw a datapath reload after the cilium-agent's start at {} ({since})",
            when(started_at)
        ),
    )
}

/// How many of the latest reload-seeing steps are kept whatever else is pruned.
pub const PROOFS_KEPT: usize = 8;

/// The steps that may prove the current start, kept whatever else is pruned: those that saw
/// the latest reloads, newest first (the current start's own step is the latest one a
/// restart made; a reload without a restart — the datapath regenerated at run time — may
/// come after it, so a few are kept, not one).
pub fn current(steps: &[Step]) -> Vec<&Step> {
    let mut seen: Vec<(f64, &Step)> = steps
        .iter()
        .filter_map(|s| first_reload(s).map(|r| (r, s)))
        .collect();
    seen.sort_by(|a, b| b.0.total_cmp(&a.0));
    seen.into_iter().take(PROOFS_KEPT).map(|(_, s)| s).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::step::{Baseline, StepParams, StepRequest};
    use std::collections::BTreeMap;
    use std::time::Duration;

    fn step(
        id: &str,
        created: f64,
        reload: Option<f64>,
        verdict: Option<(Status, &[Reason])>,
    ) -> Step {
        let (_, params) =
            StepParams::from_request(&StepRequest::default(), Duration::from_millis(10), &[])
                .unwrap();
        let mut s = Step::new(
            id.into(),
            created,
            params,
            Baseline::default(),
            BTreeMap::new(),
        );
        if let Some(r) = reload {
            s.reload.changed.insert("eth0".into(), (7, r + 0.5));
            s.reload.changed.insert("cilium_host".into(), (8, r));
        }
        s.verdict = verdict.map(|(status, reasons)| Verdict {
            status,
            reasons: reasons.to_vec(),
            summary: "s".into(),
            finished_at: created + 30.0,
            warnings: vec![],
        });
        s
    }

    #[test]
    fn the_first_reload_at_or_after_the_start_decides() {
        let steps = vec![
            step(
                "old",
                100.0,
                Some(105.0),
                Some((Status::Failed, &[Reason::MapEmptied])),
            ),
            step("now", 200.0, Some(206.0), Some((Status::Passed, &[]))),
            step(
                "later",
                300.0,
                Some(306.0),
                Some((Status::Failed, &[Reason::GapOverBudget])),
            ),
        ];
        let p = covering(&steps, 204.0);
        assert_eq!(p.status, ProofStatus::Passed, "{p:?}");
        assert_eq!(p.step.as_ref().unwrap().id, "now");
        assert_eq!(p.step.unwrap().reloaded_at, Some(206.0));
        // The start the later step covers is judged by it, not by the earlier pass.
        let p = covering(&steps, 305.0);
        assert_eq!(p.status, ProofStatus::Failed);
        assert!(p.why.contains("gap_over_budget"), "{}", p.why);
        // A start after every reload: nothing vouches for it.
        let p = covering(&steps, 400.0);
        assert_eq!(p.status, ProofStatus::Unproven);
        assert!(p.why.contains("records begin at"), "{}", p.why);
    }

    #[test]
    fn a_step_that_saw_no_reload_proves_nothing_and_an_active_one_is_waited_for() {
        let orphan = step(
            "orphan",
            200.0,
            None,
            Some((Status::Failed, &[Reason::DatapathNotReloaded])),
        );
        assert_eq!(
            covering(std::slice::from_ref(&orphan), 190.0).status,
            ProofStatus::Unproven
        );
        let active = step("active", 210.0, None, None);
        let p = covering(&[orphan, active], 205.0);
        assert_eq!(p.status, ProofStatus::Pending);
        assert_eq!(p.step.unwrap().id, "active");
    }

    #[test]
    fn incomplete_evidence_or_a_cancel_is_no_proof_either_way() {
        let s = step(
            "s",
            200.0,
            Some(201.0),
            Some((Status::Failed, &[Reason::EvidenceIncomplete])),
        );
        assert_eq!(covering(&[s], 200.0).status, ProofStatus::Unproven);
        let s = step(
            "s",
            200.0,
            Some(201.0),
            Some((Status::Cancelled, &[Reason::Cancelled])),
        );
        assert_eq!(covering(&[s], 200.0).status, ProofStatus::Unproven);
        let s = step(
            "s",
            200.0,
            Some(201.0),
            Some((
                Status::Failed,
                &[Reason::EvidenceIncomplete, Reason::MapEmptied],
            )),
        );
        assert_eq!(covering(&[s], 200.0).status, ProofStatus::Failed);
    }

    #[test]
    fn the_proofs_kept_are_the_latest_reloads() {
        let steps = vec![
            step("a", 100.0, Some(101.0), None),
            step("b", 300.0, None, None),
            step("c", 200.0, Some(203.0), None),
        ];
        let ids: Vec<&str> = current(&steps).iter().map(|s| s.id.as_str()).collect();
        assert_eq!(ids, ["c", "a"]);
        let many: Vec<Step> = (0..20)
            .map(|i| {
                step(
                    &format!("s{i}"),
                    f64::from(i) * 10.0,
                    Some(f64::from(i) * 10.0 + 1.0),
                    None,
                )
            })
            .collect();
        let kept = current(&many);
        assert_eq!(kept.len(), PROOFS_KEPT);
        assert_eq!(kept[0].id, "s19");
    }
}
