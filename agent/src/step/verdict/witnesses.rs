//! The witnesses check: the LAN's view of the step, fresh and within budget.
use super::*;

/// The step checks, in the order their failures are reported.
/// A witness whose evidence ends more than this before now is stale (it polls every 500 ms
/// and reports up to its longest probe timeout before now).
pub const WITNESS_STALE_S: f64 = 3.0;

/// `witnesses`: the gaps LAN clients saw. A witness that restarted or forgot the step leaves
/// a hole in the evidence; a gap over budget at a witness fails the step naming the witness
/// and the target; a witness whose evidence is stale (unreachable) keeps the step from
/// passing, and at the timeout it is `evidence_incomplete`.
pub fn check_witnesses(step: &Step, o: &Observed) -> Judged {
    if step.witnesses.is_empty() {
        return Judged {
            shown: None,
            fatal: None,
            at_timeout: None,
        };
    }
    let mut stale = Vec::new();
    let mut seen = Vec::new();
    for (url, w) in &step.witnesses {
        if let Some(l) = &w.lost {
            return Judged::fatal(Reason::EvidenceIncomplete, format!("witness {url} {l}"));
        }
        let Some(r) = &w.report else {
            stale.push(format!(
                "no report from witness {url} yet{}",
                w.last_error
                    .as_ref()
                    .map(|e| format!(" ({e})"))
                    .unwrap_or_default()
            ));
            continue;
        };
        if let Some(hole) = not_run_hole(r.probes.iter().map(|(k, p)| (k, p.not_run, None))) {
            return Judged::fatal(Reason::EvidenceIncomplete, format!("witness {url}: {hole}"));
        }
        // Held to this step's own budgets (the target's on this node, else the step's),
        // never to what the witness reports as its budget: anyone on the LAN may have begun
        // the witness's step first.
        for g in &r.gaps {
            let own = step.targets.get(&g.target);
            let b = Budget {
                longest_s: own.map_or(step.params.max_gap.as_secs_f64(), |t| t.budget),
                loss: own
                    .and_then(|t| t.loss_budget)
                    .or(Some(step.params.max_loss)),
                total_s: own
                    .and_then(|t| t.total_budget)
                    .or(step.params.max_total_gap),
            };
            if let Some((code, why)) = over_budget(g, b) {
                return Judged::fatal(
                    code,
                    format!(
                        "witness {url}: {why} (as a LAN client sees it: longest {:.0}±{:.0}ms)",
                        g.longest_s * 1e3,
                        g.error_bound_s * 1e3
                    ),
                );
            }
        }
        if r.complete_until < o.now - WITNESS_STALE_S {
            stale.push(format!(
                "witness {url}'s evidence ends {:.1}s ago{}",
                o.now - r.complete_until,
                w.last_error
                    .as_ref()
                    .map(|e| format!(" ({e})"))
                    .unwrap_or_default()
            ));
            continue;
        }
        let worst = r
            .gaps
            .iter()
            .map(|g| format!("{} {:.0}ms", g.target, g.longest_s * 1e3))
            .collect::<Vec<_>>()
            .join(", ");
        // A witness step begun before this one (by anyone, under the same id) is told: its
        // gaps are counted from this step's own start only.
        let early = step.created_at - r.created_at;
        let note = if early > 1.0 {
            format!(" (its step began {early:.1}s before this one; counted from this step's start)")
        } else {
            String::new()
        };
        seen.push(format!("{url}: {worst}{note}"));
    }
    if !stale.is_empty() {
        return Judged::not_yet(
            CheckStatus::Unknown,
            stale.join("; "),
            Some(Reason::EvidenceIncomplete),
        );
    }
    Judged::pass(format!("LAN-side gaps within budget ({})", seen.join("; ")))
}

/// The latest moment a node target was failing: the end of its last outage (when the answer
/// that ended it shows the path working), or the last failure's send time while still open.
pub(super) fn last_outage_end(step: &Step) -> Option<f64> {
    step.targets
        .values()
        .filter_map(|t| {
            let o = t.outages();
            o.last()
                .map(|o| o.end.unwrap_or(o.last_failed.unwrap_or(o.start)))
        })
        .fold(None, |a: Option<f64>, b| Some(a.map_or(b, |a| a.max(b))))
}

/// Every witness's evidence reaches `until` (a step passes only on complete evidence).
pub fn witnesses_cover(step: &Step, until: f64) -> bool {
    step.witnesses
        .values()
        .all(|w| w.report.as_ref().is_some_and(|r| r.complete_until >= until))
}
