//! Deciding a step (pure): the reload, the gaps, the baseline comparison and the drops, over
//! what the daemon observed. `passed` only after every node and step check has been green for
//! the settle window after a complete reload; never on incomplete evidence.
mod drops;
mod endpoints;
mod evidence;
mod gaps;
mod maps;
mod reload;
mod witnesses;
use super::{MapEvidence, Phase, Reason, Reload, Status, Step, StepCheck, TargetGap, Verdict};
use crate::checks::Status as CheckStatus;
use crate::cilium::profile;
pub use crate::timeline::gap_row;
pub use drops::*;
pub use endpoints::*;
pub use evidence::*;
pub use gaps::*;
pub use maps::*;
pub use reload::*;
use std::collections::BTreeMap;
pub use witnesses::*;

/// What the daemon sees now.
#[derive(Clone, Debug, Default)]
pub struct Observed {
    pub now: f64,
    /// Current `cil_from_netdev` (or host) program id per baseline device; None = vanished.
    /// The whole map is None when devices could not be observed.
    pub programs: Option<BTreeMap<String, Option<u32>>>,
    /// Current global maps and entry counts; None when unreadable.
    pub maps: Option<BTreeMap<String, Option<u64>>>,
    /// Current map ids (to see recreated maps).
    pub map_ids: Option<BTreeMap<String, u32>>,
    /// Node checks that are not passing, with their reason.
    pub node_not_green: Vec<String>,
    pub dns_p50_after_ms: Option<f64>,
    /// Drops since the step began, by reason.
    pub drops: BTreeMap<String, u64>,
    /// Drop counters (`kernel`, `cilium`) unknown now or at the start: drops there are not
    /// counted, so a budget cannot pass on them.
    pub drops_unknown: Vec<String>,
    /// Samples are complete up to this time (older probes have all answered or timed out).
    pub complete_until: f64,
    /// Per-endpoint maps by kind now; None when unreadable.
    pub endpoint_maps: Option<BTreeMap<String, u64>>,
    /// The version the agent's API last reported, and when it was read.
    pub agent_version: Option<(String, f64)>,
    /// The named entries now of kept-state maps that lost entries (see
    /// `Baseline::map_entries`).
    pub map_entries: BTreeMap<String, Vec<String>>,
    /// Every endpoint device's Cilium programs now; None when they could not be read.
    pub endpoints: Option<BTreeMap<String, super::EndpointPrograms>>,
    /// The overlay the node's configuration asks for as last read, and when the read began.
    pub overlay: Option<(crate::cilium::devices::OverlayIntent, f64)>,
    /// The services the agent holds, read after the map entries (kept service maps that
    /// lost entries are judged against it: what it no longer lists was deleted).
    pub services: Option<crate::ciliumapi::AgentServices>,
    /// The maps the node's features require now (None: not known).
    pub required_maps: Option<std::collections::BTreeSet<String>>,
    /// What the configuration asks of endpoints and host hooks (None: not known).
    pub asks: Option<crate::cilium::devices::Asks>,
}

/// The step's only deadline: its timeout. Whatever must happen after a restart (the reload,
/// refills, regenerations) may take until then; settle is how long everything must then stay
/// green.
pub fn timed_out(step: &Step, now: f64) -> bool {
    now >= step.created_at + step.params.timeout.as_secs_f64()
}

fn finish(step: &mut Step, status: Status, reasons: Vec<Reason>, summary: String, now: f64) {
    step.phase = Phase::Done;
    step.verdict = Some(Verdict {
        status,
        reasons,
        summary,
        finished_at: now,
        warnings: vec![],
    });
}

/// One step check's judgement at this observation.
#[derive(Clone, Debug, PartialEq)]
pub struct Judged {
    /// What the check says now (shown in the step's `checks`; `None` for checks that only
    /// ever end a step, like the evidence check).
    pub shown: Option<StepCheck>,
    /// The step has failed for good: no later observation can repair this.
    pub fatal: Option<(Reason, String)>,
    /// Not green now; if the step times out like this, this reason (when any) is reported.
    pub at_timeout: Option<(Option<Reason>, String)>,
}

impl Judged {
    fn pass(reason: impl Into<String>) -> Self {
        Judged {
            shown: Some(StepCheck {
                status: CheckStatus::Pass,
                reason: reason.into(),
            }),
            fatal: None,
            at_timeout: None,
        }
    }
    fn not_yet(status: CheckStatus, reason: impl Into<String>, code: Option<Reason>) -> Self {
        let reason = reason.into();
        Judged {
            shown: Some(StepCheck {
                status,
                reason: reason.clone(),
            }),
            fatal: None,
            at_timeout: Some((code, reason)),
        }
    }
    fn fatal(code: Reason, why: String) -> Self {
        Judged {
            shown: None,
            fatal: Some((code, why)),
            at_timeout: None,
        }
    }
    fn green(&self) -> bool {
        self.fatal.is_none() && self.at_timeout.is_none()
    }
}

/// A step check: its name (the key in the step's `checks`) and its judgement. Adding one is
/// a function here plus its line in [`STEP_CHECKS`].
pub struct StepCheckDef {
    pub name: &'static str,
    pub judge: fn(&Step, &Observed) -> Judged,
}

pub const STEP_CHECKS: [StepCheckDef; 7] = [
    StepCheckDef {
        name: "evidence",
        judge: |s, _| check_evidence(s),
    },
    StepCheckDef {
        name: "gaps",
        judge: |s, _| check_gaps(s),
    },
    StepCheckDef {
        name: "witnesses",
        judge: check_witnesses,
    },
    StepCheckDef {
        name: "reload",
        judge: |s, o| check_reload(s, o.now),
    },
    StepCheckDef {
        name: "endpoints",
        judge: |s, o| check_endpoints(s, o.now),
    },
    StepCheckDef {
        name: "baseline",
        judge: check_baseline,
    },
    StepCheckDef {
        name: "drops",
        judge: check_drops,
    },
];

/// Advances the step with an observation; sets `step.verdict` once it is decided. The step
/// checks are judged one by one; this is the one place they are composed.
pub fn decide(step: &mut Step, o: &Observed) {
    if step.is_final() {
        return;
    }
    let now = o.now;
    // The baseline is shared, never changed: one handle for the reads below.
    let base = step.baseline.clone();
    note_overlay_intent(step, o);
    if let Some(p) = &o.programs {
        let want = wanted_devices(step);
        update_reload(&mut step.reload, &base.programs, &want, p, now);
    }
    if let Some(eps) = &o.endpoints {
        update_endpoints(
            &mut step.endpoints,
            &base.endpoints,
            eps,
            o.asks.is_some_and(|a| !a.health_endpoint),
            now,
        );
    }
    step.gaps = gap_rows(step, o.complete_until.min(now));
    step.drops = o.drops.clone();
    if let (Some(at), Some(maps)) = (step.reload.complete_at, &o.maps) {
        let va = after_version(step, o);
        step.cilium_after = va.as_ref().map(|a| {
            a.from
                .api_release()
                .unwrap_or_else(|| profile::pair_label(a.version).to_string())
        });
        step.cilium_after_from = va.as_ref().map(|a| a.from.describe());
        let _ = at;
        step.maps = judge_observed_maps(step, o, maps, va.as_ref(), timed_out(step, now)).evidence;
    }
    step.dns_p50_after_ms = o.dns_p50_after_ms;
    if step.evidence_incomplete.is_none() {
        step.evidence_incomplete = not_run_hole(
            step.targets
                .iter()
                .map(|(k, t)| (k, t.not_run, t.not_run_detail.as_ref())),
        );
    }
    if let Some((target, from, to)) = stalls(step, o.complete_until.min(now)) {
        if step.evidence_incomplete.is_none() {
            step.evidence_incomplete = Some(format!(
                "no probe of {target} was sent for {:.0}ms (limit {:.0}ms): the probe loop stalled or probes could not run",
                (to - from) * 1e3,
                stall_limit(step.params.burst_interval.as_secs_f64()) * 1e3
            ));
        }
    }

    let mut judged = Vec::new();
    for c in &STEP_CHECKS {
        let j = (c.judge)(step, o);
        if let Some((code, why)) = j.fatal {
            finish(step, Status::Failed, vec![code], why, now);
            return;
        }
        judged.push((c.name, j));
    }
    step.checks = judged
        .iter()
        .filter_map(|(n, j)| j.shown.clone().map(|c| (n.to_string(), c)))
        .collect();
    let reloaded = step.reload.complete_at.is_some();
    if reloaded {
        step.phase = Phase::Settling;
    }
    let green = judged.iter().all(|(_, j)| j.green()) && o.node_not_green.is_empty();
    if green {
        let mut since = *step.green_since.get_or_insert(now);
        // A probe that failed inside the window restarts it: a timed-out probe is recorded
        // late, under its send time, after ticks that looked green.
        if let Some(bad) = last_outage_end(step).filter(|b| *b > since) {
            since = bad;
            step.green_since = Some(bad);
        }
        let settle = step.params.settle.as_secs_f64();
        // Every probe sent up to the end of the settle window must have answered (or timed
        // out) before the window counts: a probe still in flight may yet fail.
        if now - since >= settle
            && o.complete_until >= since + settle
            && witnesses_cover(step, since + settle)
        {
            let worst = step
                .gaps
                .iter()
                .map(|g| {
                    format!(
                        "{} {:.0}±{:.0}ms",
                        g.target,
                        g.longest_s * 1e3,
                        g.error_bound_s * 1e3
                    )
                })
                .collect::<Vec<_>>()
                .join(", ");
            let lan: String = step
                .witnesses
                .iter()
                .filter_map(|(url, w)| {
                    let r = w.report.as_ref()?;
                    Some(format!(
                        "; as a LAN client sees it (witness {url}): {}",
                        r.gaps
                            .iter()
                            .map(|g| format!(
                                "{} {:.0}±{:.0}ms",
                                g.target,
                                g.longest_s * 1e3,
                                g.error_bound_s * 1e3
                            ))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ))
                })
                .collect();
            // Kept state that vanished within the tolerance is never silent: named in the
            // summary and as a warning the stepper prints. Whether Cilium still intends each
            // entry (a Service deleted on purpose) is not read here, and the summary says so.
            let losses = kept_losses(step);
            let lost = if losses.is_empty() {
                String::new()
            } else {
                format!(
                    "; KEPT STATE LOST across the restart (under the failing share; whether Cilium still intends it was not read): {}",
                    losses.join("; ")
                )
            };
            finish(
                step,
                Status::Passed,
                vec![],
                format!(
                    "datapath reloaded and green for {:.0}s; gaps: {}{lan}{lost}",
                    settle,
                    if worst.is_empty() {
                        "none measured".into()
                    } else {
                        worst
                    }
                ),
                now,
            );
            if !losses.is_empty() {
                if let Some(v) = step.verdict.as_mut() {
                    v.warnings.push(Reason::KeptStateLost);
                }
            }
        }
        return;
    }
    step.green_since = None;
    if now < step.created_at + step.params.timeout.as_secs_f64() {
        return;
    }
    if !reloaded {
        let (code, why) = judged
            .iter()
            .find(|(n, _)| *n == "reload")
            .and_then(|(_, j)| j.at_timeout.clone())
            .unwrap_or_default();
        finish(
            step,
            Status::Failed,
            vec![code.unwrap_or(Reason::DatapathNotReloaded)],
            why,
            now,
        );
        return;
    }
    let mut reasons = vec![Reason::NotSettled];
    let mut why: Vec<String> = o.node_not_green.clone();
    for (_, j) in &judged {
        if let Some((code, w)) = &j.at_timeout {
            reasons.extend(*code);
            why.push(w.clone());
        }
    }
    finish(
        step,
        Status::Failed,
        reasons,
        format!(
            "never green for {:.0}s after the reload: {}",
            step.params.settle.as_secs_f64(),
            why.join("; ")
        ),
        now,
    );
}

#[cfg(test)]
mod tests;
