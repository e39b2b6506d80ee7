//! The endpoints check: every endpoint's programs reattached after the restart.
use super::*;

/// Folds an observation of the endpoints into the step's progress: an endpoint present at
/// the baseline has regenerated once `cil_from_container` has a new id and
/// `cil_to_container` is either gone (Cilium detaches it from an endpoint that no longer
/// needs it) or new too; an endpoint whose device is gone, or is a new device under the
/// name (another ifindex), was deleted meanwhile. One whose device lives on under another
/// name (the same ifindex) was not deleted: it is followed under its new name (a Cilium
/// that cannot find it drops the endpoint and leaves its old programs: a stall).
///
/// `health_off`: the configuration no longer runs the endpoint health checker: `lxc_health`
/// without Cilium's programs was removed by design (Cilium leaves the device down), not a
/// stall.
pub fn update_endpoints(
    progress: &mut super::super::EndpointProgress,
    baseline: &BTreeMap<String, super::super::EndpointPrograms>,
    now_eps: &BTreeMap<String, super::super::EndpointPrograms>,
    health_off: bool,
    now: f64,
) {
    for (name, base) in baseline {
        if progress.regenerated.contains_key(name) || progress.gone.contains(name) {
            continue;
        }
        // Under its name, or renamed (the same interface, another name: not deleted, and
        // still judged by its programs).
        let now_e = now_eps.get(name).or_else(|| {
            let (new, e) = now_eps
                .iter()
                .find(|(n, e)| e.ifindex == base.ifindex && !baseline.contains_key(*n))?;
            progress.renamed.insert(name.clone(), new.clone());
            Some(e)
        });
        match now_e {
            None => {
                progress.gone.insert(name.clone());
                progress.old_seen_at.remove(name);
            }
            Some(e) if e.ifindex != base.ifindex => {
                progress.gone.insert(name.clone());
                progress.old_seen_at.remove(name);
            }
            Some(e)
                if health_off
                    && name == HEALTH_ENDPOINT
                    && e.from_container.is_none()
                    && e.to_container.is_none()
                    && !e.raced =>
            {
                progress.gone.insert(name.clone());
                progress.old_seen_at.remove(name);
            }
            Some(e) if e.raced => {}
            Some(e) => {
                let from_new =
                    e.from_container.is_some() && e.from_container != base.from_container;
                let to_ok = e.to_container.is_none() || e.to_container != base.to_container;
                if from_new && to_ok {
                    progress.regenerated.insert(name.clone(), now);
                    progress.old_seen_at.remove(name);
                } else {
                    progress.old_seen_at.insert(name.clone(), now);
                }
            }
        }
    }
}

/// The health endpoint's host device (`cilium-health`'s endpoint).
pub const HEALTH_ENDPOINT: &str = "lxc_health";

/// At most this many endpoints are named in a verdict or a check's reason.
pub const ENDPOINTS_NAMED: usize = 10;

/// The first `shown` of `items`, comma-separated, and how many more: `a, b (+7 more)`.
pub fn first_of(items: &[&String], shown: usize) -> String {
    let mut s = items
        .iter()
        .take(shown)
        .map(|e| e.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    let more = items.len().saturating_sub(shown);
    if more > 0 {
        s.push_str(&format!(" (+{more} more)"));
    }
    s
}

/// The endpoint that regenerated last and how long after the host datapath's first new
/// program it did (seconds, never negative).
pub fn slowest_endpoint(step: &Step) -> Option<(String, f64)> {
    let (name, at) = step
        .endpoints
        .regenerated
        .iter()
        .max_by(|a, b| a.1.total_cmp(b.1))?;
    let host = step
        .reload
        .changed
        .values()
        .map(|(_, t)| *t)
        .fold(f64::INFINITY, f64::min);
    let from = if host.is_finite() {
        host
    } else {
        step.created_at
    };
    Some((name.clone(), (at - from).max(0.0)))
}

/// Endpoints at the baseline neither regenerated nor gone.
pub fn pending_endpoints(step: &Step) -> Vec<&String> {
    let p = &step.endpoints;
    step.baseline
        .endpoints
        .keys()
        .filter(|n| !p.regenerated.contains_key(*n) && !p.gone.contains(*n))
        .collect()
}

/// An endpoint read still on its old programs this close to the timeout is evidence its
/// regeneration stalled (the runner reads endpoints at least once a second during a step).
pub const STALE_READ_S: f64 = 3.0;

/// `endpoints`: every endpoint present at the baseline and still present runs new programs
/// within the step's timeout (Cilium regenerates every restored endpoint on each start, at
/// its own pace: a big node takes long); until then the step is not green, and at the
/// timeout it fails naming the endpoints still waited for.
pub fn check_endpoints(step: &Step, now: f64) -> Judged {
    use super::super::EndpointsFollowed;
    match &step.baseline.endpoints_followed {
        EndpointsFollowed::NotFollowed => {
            return Judged::pass(
                "not followed: the step began under an agent that did not follow endpoints",
            )
        }
        EndpointsFollowed::Unknown(why) => {
            return Judged::not_yet(
                CheckStatus::Unknown,
                format!("endpoint programs could not be read at the start: {why}"),
                Some(Reason::EndpointsNotRegenerated),
            )
        }
        EndpointsFollowed::Followed => {}
    }
    let total = step.baseline.endpoints.len();
    if total == 0 {
        return Judged::pass("no endpoint carried cil_from_container at the start");
    }
    let p = &step.endpoints;
    let pending = pending_endpoints(step);
    let gone = if p.gone.is_empty() {
        String::new()
    } else {
        format!("; {} deleted meanwhile", p.gone.len())
    };
    let of = total - p.gone.len();
    if pending.is_empty() {
        let slowest = slowest_endpoint(step)
            .map(|(n, s)| format!(" (slowest {n}, {s:.1}s after the host datapath)"))
            .unwrap_or_default();
        return Judged::pass(format!(
            "{} of {of} endpoints regenerated{slowest}{gone}",
            p.regenerated.len()
        ));
    }
    let names = first_of(&pending, ENDPOINTS_NAMED);
    match step.reload.complete_at {
        Some(_) if super::timed_out(step, now) => {
            let deadline = step.created_at + step.params.timeout.as_secs_f64();
            // Only an endpoint read at the deadline (within the last few seconds of it: the
            // runner reads endpoints at least every second), still on its old programs, is
            // evidence of a stalled regeneration; one not readable since is unknown.
            let stale: Vec<&String> = pending
                .iter()
                .copied()
                .filter(|n| {
                    p.old_seen_at
                        .get(*n)
                        .is_some_and(|t| *t >= deadline - STALE_READ_S)
                })
                .collect();
            if stale.is_empty() {
                return Judged::not_yet(
                    CheckStatus::Unknown,
                    format!(
                        "{} endpoints not read consistently since the step's timeout: {names}",
                        pending.len()
                    ),
                    Some(Reason::EvidenceIncomplete),
                );
            }
            let shown: Vec<String> = stale
                .iter()
                .map(|n| match p.renamed.get(*n) {
                    Some(now) => format!("{n} (renamed {now})"),
                    None => n.to_string(),
                })
                .collect();
            Judged::fatal(
                Reason::EndpointsNotRegenerated,
                format!(
                    "{} of {of} endpoints still ran the programs they had before the restart at the step's timeout ({:.0}s): {}{gone}",
                    stale.len(),
                    step.params.timeout.as_secs_f64(),
                    first_of(&shown.iter().collect::<Vec<_>>(), ENDPOINTS_NAMED)
                ),
            )
        }
        _ => Judged::not_yet(
            CheckStatus::Fail,
            format!(
                "{} of {of} endpoints regenerated; waiting for {names}{gone}",
                p.regenerated.len()
            ),
            Some(Reason::EndpointsNotRegenerated),
        ),
    }
}
