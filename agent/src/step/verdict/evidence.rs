//! The evidence check: probes that could not run, and stalls (no sample for longer than the
//! cadence allows) are holes in the evidence, never a pass.
use super::*;

/// An interval with no probe of a target sent for more than this many burst intervals is a
/// hole in the evidence (the probe loop stalled, or probes could not run: no socket, EMFILE).
/// Shorter lateness only widens the error bound of the gaps it touches (see `gaps`).
pub const STALL_INTERVALS: f64 = 5.0;

/// ... and never less than this, so scheduler noise on a busy node (a cilium-agent starting
/// up takes the CPU; 50 ms delays were seen on a loaded 2-core machine) is not mistaken for a
/// stalled loop. The gap's error bound still reports the actual probe spacing.
pub const STALL_MIN_S: f64 = 0.25;

/// Probes of one target that could not run before the step's evidence counts as incomplete
/// (probes that never left are not scheduler noise: the agent lacks sockets or permission).
pub const NOT_RUN_LIMIT: u64 = 5;

/// The first target with too many probes that could not run: a hole in the evidence.
pub fn not_run_hole<'a>(
    targets: impl IntoIterator<Item = (&'a String, u64, Option<&'a String>)>,
) -> Option<String> {
    targets
        .into_iter()
        .find(|(_, n, _)| *n >= NOT_RUN_LIMIT)
        .map(|(t, n, why)| {
            format!(
                "{n} probes of {t} could not run ({}): the evidence has holes",
                why.map(String::as_str).unwrap_or("no reason recorded")
            )
        })
}

/// The longest a target may go without a probe sent, at `cadence`.
pub fn stall_limit(cadence: f64) -> f64 {
    (cadence * STALL_INTERVALS).max(STALL_MIN_S)
}

/// Scans each target's probe send times from where the last scan stopped up to
/// `complete_until` (every probe sent before it has been recorded) and returns the first
/// stall: (target, from, to). Intervals that start inside a recorded agent hole are judged
/// by the hole rules instead.
pub fn stalls(step: &mut Step, complete_until: f64) -> Option<(String, f64, f64)> {
    let cadence = step.params.burst_interval.as_secs_f64();
    let created = step.created_at;
    let mut found = None;
    for (name, t) in step.targets.iter_mut() {
        let limit = stall_limit(t.cadence(cadence));
        let mut prev = t.scanned_through.unwrap_or(created);
        if complete_until <= prev {
            continue;
        }
        let mut sent: Vec<f64> = t
            .samples
            .iter()
            .map(|s| s.sent)
            .filter(|s| *s > prev && *s <= complete_until)
            .collect();
        sent.sort_by(|a, b| a.total_cmp(b));
        sent.push(complete_until);
        for at in sent {
            if at - prev > limit && found.is_none() {
                found = Some((name.clone(), prev, at));
            }
            prev = at;
        }
        t.scanned_through = Some(complete_until);
    }
    found
}

/// `evidence`: a hole in the evidence (agent down during an outage or a reload, a stalled
/// probe loop, a reboot) ends the step; it can never pass.
pub fn check_evidence(step: &Step) -> Judged {
    match &step.evidence_incomplete {
        Some(why) => Judged::fatal(Reason::EvidenceIncomplete, why.clone()),
        None => Judged {
            shown: None,
            fatal: None,
            at_timeout: None,
        },
    }
}
