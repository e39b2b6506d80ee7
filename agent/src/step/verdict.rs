//! Deciding a step (pure): the reload, the gaps, the baseline comparison and the drops, over
//! what the daemon observed. `passed` only after every node and step check has been green for
//! the settle window after a complete reload; never on incomplete evidence.
use super::{MapEvidence, Phase, Reason, Reload, Status, Step, StepCheck, TargetGap, Verdict};
use crate::checks::Status as CheckStatus;
use crate::profile;
pub use crate::timeline::gap_row;
use std::collections::BTreeMap;

/// How long nothing may change before a reload counts as complete (Cilium attaches devices one
/// after another).
pub const RELOAD_QUIET_S: f64 = 1.0;
/// A kept-state map that had at least this many entries and lost more than half of them was
/// emptied (2: the three-VIP home cluster's services map losing two of its three is a loss).
pub const MAP_EMPTIED_MIN: u64 = 2;
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
}

/// Folds an observation of the endpoints into the step's progress: an endpoint present at
/// the baseline has regenerated once `cil_from_container` has a new id and
/// `cil_to_container` is either gone (Cilium detaches it from an endpoint that no longer
/// needs it) or new too; an endpoint whose device is gone, or is a new device under the
/// name (another ifindex), was deleted meanwhile.
pub fn update_endpoints(
    progress: &mut super::EndpointProgress,
    baseline: &BTreeMap<String, super::EndpointPrograms>,
    now_eps: &BTreeMap<String, super::EndpointPrograms>,
    now: f64,
) {
    for (name, base) in baseline {
        if progress.regenerated.contains_key(name) || progress.gone.contains(name) {
            continue;
        }
        match now_eps.get(name) {
            None => {
                progress.gone.insert(name.clone());
                progress.old_seen_at.remove(name);
            }
            Some(e) if e.ifindex != base.ifindex => {
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

/// `endpoints`: every endpoint present at the baseline and still present runs new programs
/// by the end of settle (Cilium regenerates every restored endpoint on each start); until
/// then the step is not green, and after it the step fails naming the endpoints.
pub fn check_endpoints(step: &Step, now: f64) -> Judged {
    use super::EndpointsFollowed;
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
        Some(at) if now >= at + step.params.settle.as_secs_f64() => {
            let deadline = at + step.params.settle.as_secs_f64();
            // Only an endpoint read after the deadline, still on its old programs, is
            // evidence of a stalled regeneration; one not readable since is unknown.
            let stale: Vec<&String> = pending
                .iter()
                .copied()
                .filter(|n| p.old_seen_at.get(*n).is_some_and(|t| *t >= deadline))
                .collect();
            if stale.is_empty() {
                return Judged::not_yet(
                    CheckStatus::Unknown,
                    format!(
                        "{} endpoints not read consistently since the end of settle: {names}",
                        pending.len()
                    ),
                    Some(Reason::EvidenceIncomplete),
                );
            }
            Judged::fatal(
                Reason::EndpointsNotRegenerated,
                format!(
                    "{} of {of} endpoints still ran the programs they had before the restart {:.0}s after the host datapath reloaded (the end of settle): {}{gone}",
                    stale.len(),
                    step.params.settle.as_secs_f64(),
                    first_of(&stale, ENDPOINTS_NAMED)
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

/// The reload keys that must carry the datapath after the restart: the declared device set
/// (with XDP on each when the node had XDP, and `cilium_host` and the overlay device when
/// it had them), or the baseline's keys ("as before"). See `watch::tracked_program`.
pub fn wanted_devices(step: &Step) -> std::collections::BTreeSet<String> {
    use crate::checks::devices::XDP_KEY;
    let base = &step.baseline.programs;
    match &step.params.expect_devices {
        Some(d) => {
            let mut w: std::collections::BTreeSet<String> = d.iter().cloned().collect();
            if base.keys().any(|k| k.ends_with(XDP_KEY)) {
                w.extend(d.iter().map(|d| format!("{d}{XDP_KEY}")));
            }
            let to_netdev = crate::checks::devices::TO_NETDEV_KEY;
            if base.keys().any(|k| k.ends_with(to_netdev)) {
                w.extend(d.iter().map(|d| format!("{d}{to_netdev}")));
            }
            w.extend(
                base.keys()
                    .filter(|k| *k == "cilium_host" || crate::checks::devices::is_overlay(k))
                    .cloned(),
            );
            w
        }
        None => base.keys().cloned().collect(),
    }
}

/// Folds an observation of program ids into the reload state: a wanted device has reloaded
/// when it carries a program id other than its baseline one (any id, for a device new to it).
pub fn update_reload(
    r: &mut Reload,
    baseline: &BTreeMap<String, u32>,
    want: &std::collections::BTreeSet<String>,
    current: &BTreeMap<String, Option<u32>>,
    now: f64,
) {
    if &r.last_seen != current {
        if !r.last_seen.is_empty() || current.iter().any(|(d, id)| baseline.get(d) != id.as_ref()) {
            r.last_change_at = Some(now);
        }
        r.last_seen = current.clone();
    }
    for (dev, id) in current {
        match (id, baseline.get(dev)) {
            (Some(id), base) if base != Some(id) => {
                r.changed.entry(dev.clone()).or_insert((*id, now));
                r.lost.retain(|d| d != dev);
            }
            (None, _) if want.contains(dev) && !r.lost.contains(dev) => r.lost.push(dev.clone()),
            _ => {}
        }
    }
    let all_changed = want
        .iter()
        .all(|d| r.changed.contains_key(d) && !r.lost.contains(d));
    let quiet = r.last_change_at.is_some_and(|t| now - t >= RELOAD_QUIET_S);
    if all_changed && quiet && r.complete_at.is_none() {
        r.complete_at = Some(now);
    }
}

fn gap_rows(step: &Step, now: f64) -> Vec<TargetGap> {
    step.targets
        .iter()
        .map(|(name, t)| gap_row(name, t, step.params.burst_interval.as_secs_f64(), now))
        .collect()
}

fn finish(step: &mut Step, status: Status, reasons: Vec<Reason>, summary: String, now: f64) {
    step.phase = Phase::Done;
    step.verdict = Some(Verdict {
        status,
        reasons,
        summary,
        finished_at: now,
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

/// `gaps`: the longest outage can only grow, so one over its budget is final at once; an
/// outage still open keeps the step from settling.
/// The budgets a target's gaps are held to.
#[derive(Clone, Copy, Debug)]
pub struct Budget {
    pub longest_s: f64,
    pub loss: Option<f64>,
    pub total_s: Option<f64>,
}

/// Which budget a target's gaps exceed, named: the longest outage (`gap_over_budget`), all
/// outages added up (`gap_over_budget`, "total"), or the loss outside the longest outage
/// (`loss_over_budget`, from [`super::LOSS_MIN_FAILURES`] lost probes up).
pub fn over_budget(g: &TargetGap, b: Budget) -> Option<(Reason, String)> {
    if g.longest_s > b.longest_s {
        return Some((
            Reason::GapOverBudget,
            format!(
                "{}{} longest outage {:.0}ms > max_gap {:.0}ms",
                g.target,
                if g.east_west {
                    " (east-west: another node through the overlay)"
                } else {
                    ""
                },
                g.longest_s * 1e3,
                b.longest_s * 1e3
            ),
        ));
    }
    if let Some(total) = b.total_s.filter(|t| g.total_s > *t) {
        return Some((
            Reason::GapOverBudget,
            format!(
                "{} outages add up to {:.0}ms over {} outages > max_total_gap {:.0}ms",
                g.target,
                g.total_s * 1e3,
                g.count,
                total * 1e3
            ),
        ));
    }
    if let Some(l) = b
        .loss
        .filter(|l| g.loss > *l && g.lost_outside_longest >= super::LOSS_MIN_FAILURES)
    {
        return Some((
            Reason::LossOverBudget,
            format!(
                "{} lost {:.1} % of its probes outside its longest outage ({} lost) > max_loss {:.1} %",
                g.target,
                g.loss * 100.0,
                g.lost_outside_longest,
                l * 100.0
            ),
        ));
    }
    None
}

pub fn check_gaps(step: &Step) -> Judged {
    let over: Vec<(Reason, String)> = step
        .gaps
        .iter()
        .filter_map(|g| {
            over_budget(
                g,
                Budget {
                    longest_s: g.budget_s,
                    loss: g.loss_budget,
                    total_s: g.total_budget_s,
                },
            )
        })
        .collect();
    if let Some((code, _)) = over.first() {
        return Judged::fatal(
            *code,
            format!(
                "over budget: {}",
                over.iter()
                    .map(|(_, w)| w.as_str())
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
        );
    }
    let open: Vec<&str> = step
        .gaps
        .iter()
        .filter(|g| g.open)
        .map(|g| g.target.as_str())
        .collect();
    if open.is_empty() {
        Judged::pass("every outage within its budget")
    } else {
        Judged::not_yet(
            CheckStatus::Fail,
            format!("still failing: {}", open.join(", ")),
            None,
        )
    }
}

/// `reload`: every tracked device got a new program id and nothing changed for the quiet
/// period; a device whose program vanished once the rest reloaded is a changed device set.
pub fn check_reload(step: &Step, now: f64) -> Judged {
    let r = &step.reload;
    let want = wanted_devices(step);
    let quiet = r.last_change_at.is_some_and(|t| now - t >= RELOAD_QUIET_S);
    let declared = step.params.expect_devices.is_some();
    if !r.lost.is_empty() && quiet && !r.changed.is_empty() {
        return Judged::fatal(
            Reason::DeviceSetChanged,
            format!(
                "the reloaded datapath is no longer attached to {}{}",
                r.lost.join(", "),
                if declared {
                    " (declared in expect.devices)"
                } else {
                    ""
                }
            ),
        );
    }
    // Devices the step declared gone that still carry the datapath after the reload: the
    // node came back as before, not as the rollout intended.
    let unwanted: Vec<&String> = r
        .last_seen
        .iter()
        .filter(|(d, id)| id.is_some() && !want.contains(*d))
        .map(|(d, _)| d)
        .collect();
    if declared && quiet && !r.changed.is_empty() && !unwanted.is_empty() {
        return Judged::fatal(
            Reason::DeviceSetChanged,
            format!(
                "the datapath is still attached to {} although the step expected only {}",
                unwanted
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                want.iter().cloned().collect::<Vec<_>>().join(", ")
            ),
        );
    }
    if r.complete_at.is_some() {
        return Judged::pass(format!(
            "new program ids on {}",
            want.iter().cloned().collect::<Vec<_>>().join(", ")
        ));
    }
    let unchanged: Vec<String> = want
        .iter()
        .filter(|d| !r.changed.contains_key(*d))
        .cloned()
        .collect();
    let why = if r.changed.is_empty() {
        "no device got new program ids before the timeout".to_string()
    } else {
        format!(
            "no new program ids on {} before the timeout",
            unchanged.join(", ")
        )
    };
    Judged {
        shown: Some(StepCheck {
            status: CheckStatus::Fail,
            reason: format!("waiting for new program ids on {}", unchanged.join(", ")),
        }),
        fatal: None,
        at_timeout: Some((Some(Reason::DatapathNotReloaded), why)),
    }
}

/// A kept-state map that lost more than this share of its entries (and had at least
/// [`MAP_EMPTIED_MIN`]) failed; losing every entry fails at any size.
pub const KEPT_LOSS_TOLERANCE: f64 = 0.5;

/// The version a map judgement holds the node to after the reload, and what decided it.
#[derive(Clone, Debug, PartialEq)]
pub struct AfterVersion {
    pub version: profile::CiliumVersion,
    /// `agent API (…)`, `pinned map names: …` or `declared by the step`.
    pub from: String,
    /// The names leave it open between pairs (see `profile::names_ambiguous`).
    pub ambiguous: bool,
}

/// The version that came back: the agent API's release when it was read after the reload,
/// else what the pinned names point to, else the step's declaration.
pub fn after_version(step: &Step, o: &Observed) -> Option<AfterVersion> {
    use profile::CiliumVersion;
    let api = step.reload.complete_at.and_then(|at| {
        o.agent_version
            .as_ref()
            .filter(|(_, seen)| *seen >= at)
            .map(|(v, _)| v.clone())
    });
    if let Some(full) = api {
        if let Some(rel) = profile::release_of(&full) {
            let v = CiliumVersion::parse(&rel).or_else(|| {
                CiliumVersion::newer_than_newest(&rel).then_some(CiliumVersion::NEWEST)
            });
            if let Some(version) = v {
                return Some(AfterVersion {
                    version,
                    from: format!("agent API ({full})"),
                    ambiguous: false,
                });
            }
        }
    }
    if let Some(maps) = &o.maps {
        let names = profile::names_for_inference(
            maps.keys(),
            o.endpoint_maps.as_ref().unwrap_or(&BTreeMap::new()),
        );
        if let Some((version, why)) = profile::infer_version(&names) {
            return Some(AfterVersion {
                version,
                from: format!("pinned map names: {why}"),
                ambiguous: profile::names_ambiguous(&names),
            });
        }
    }
    step.params
        .expect_cilium
        .as_deref()
        .and_then(CiliumVersion::parse)
        .map(|version| AfterVersion {
            version,
            from: "declared by the step".into(),
            ambiguous: true,
        })
}

/// Judges every map of the baseline and of the returning version by its class (what Cilium
/// does with it on a start): kept state must come back with its entries; maps recreated by
/// design (or for a property change: new id) must have refilled by the end of settle; churn
/// is reported only. A map the returning version `va` renamed is judged under its new name
/// against the baseline of the old one (`cilium_ipcache` → `cilium_ipcache_v2`), and so are
/// the per-endpoint policy maps of its prefix; a map `va` does not have at all was removed by
/// design; a map new in `va` is reported. `entries_now`: the named entries of kept maps that
/// lost some (to name what was lost). Returns the evidence and the first failure, or what is
/// still awaited.
pub fn judge_maps(
    step: &Step,
    maps: &BTreeMap<String, Option<u64>>,
    ids: Option<&BTreeMap<String, u32>>,
    endpoint_maps: Option<&BTreeMap<String, u64>>,
    va: Option<&AfterVersion>,
    entries_now: &BTreeMap<String, Vec<String>>,
    settle_over: bool,
) -> MapsJudged {
    let v = va.map(|a| a.version);
    let mut ev = BTreeMap::new();
    let mut fatal: Option<(Reason, String)> = None;
    let mut waiting: Vec<String> = vec![];
    let fail = |code: Reason, why: String, f: &mut Option<(Reason, String)>| {
        if f.is_none() {
            *f = Some((code, why));
        }
    };
    let base = &step.baseline.maps;
    let names: std::collections::BTreeSet<&String> = base.keys().chain(maps.keys()).collect();
    for m in names {
        let class = profile::map_class(m);
        // The name this map has on the returning version, and the baseline it is judged
        // against (its own, or the name it had before a rename).
        let group = profile::rename_group(m);
        let own = match (group, v) {
            (Some(g), Some(v)) => profile::name_in(g, v),
            _ => m.as_str(),
        };
        if own != m {
            // A name of a renamed map that the returning version does not use.
            let judged = match (maps.get(m), v) {
                (Some(_), Some(v)) => format!(
                    "left pinned: Cilium {} uses {own} (judged there), not {m}",
                    v.as_str()
                ),
                _ => format!("renamed by design: Cilium {} calls it {own}", pair(v)),
            };
            ev.insert(
                m.clone(),
                MapEvidence {
                    class,
                    before: base.get(m).copied().flatten(),
                    after: maps.get(m).copied().flatten(),
                    recreated: false,
                    judged,
                },
            );
            continue;
        }
        let predecessor = group.and_then(|g| {
            g.iter()
                .map(|(n, _)| *n)
                .find(|n| *n != m && base.contains_key(*n) && !base.contains_key(m.as_str()))
        });
        let before_entry = base
            .get(m)
            .or_else(|| predecessor.and_then(|p| base.get(p)));
        let Some(before) = before_entry else {
            // New on the returning version, with nothing before to compare.
            let judged = match maps.get(m).copied().flatten() {
                Some(a) => format!("new in Cilium {}, {a} entries (no baseline)", pair(v)),
                None => format!("new in Cilium {}", pair(v)),
            };
            ev.insert(
                m.clone(),
                MapEvidence {
                    class,
                    before: None,
                    after: maps.get(m).copied().flatten(),
                    recreated: false,
                    judged,
                },
            );
            continue;
        };
        let renamed = predecessor
            .map(|p| format!("renamed from {p}, "))
            .unwrap_or_default();
        let Some(after) = maps.get(m) else {
            let judged = match v {
                Some(v) if profile::removed_by_design(m, v) => {
                    format!("removed by design: Cilium {} has no {m}", v.as_str())
                }
                _ => {
                    fail(
                        Reason::MapMissing,
                        format!("pinned map vanished across the restart: {m}"),
                        &mut fatal,
                    );
                    format!("{renamed}missing")
                }
            };
            ev.insert(
                m.clone(),
                MapEvidence {
                    class,
                    before: *before,
                    after: None,
                    recreated: false,
                    judged,
                },
            );
            continue;
        };
        let recreated = predecessor.is_some()
            || match (step.baseline.map_ids.get(m), ids.and_then(|i| i.get(m))) {
                (Some(a), Some(b)) => a != b,
                _ => false,
            };
        let (b, a) = (before.unwrap_or(0), after.unwrap_or(0));
        let counted = before.is_some() && after.is_some();
        let judged = match class {
            profile::MapClass::Churn | profile::MapClass::Other => {
                if counted {
                    format!("{b}→{a} entries (reported only)")
                } else {
                    "present".into()
                }
            }
            _ if !counted => "present (entries not countable)".into(),
            profile::MapClass::Recreated => {
                refill(m, b, a, recreated, settle_over, &mut fatal, &mut waiting)
            }
            profile::MapClass::Kept if recreated => {
                refill(m, b, a, true, settle_over, &mut fatal, &mut waiting)
            }
            profile::MapClass::Kept => {
                let lost = lost_entries(step.baseline.map_entries.get(m), entries_now.get(m));
                if b > 0 && a == 0 {
                    fail(
                        Reason::MapEmptied,
                        format!(
                            "{m} came back empty ({b}→0){lost}: Cilium keeps this state across a restart"
                        ),
                        &mut fatal,
                    );
                    format!("emptied {b}→0{lost}")
                } else if b >= MAP_EMPTIED_MIN
                    && (a as f64) < b as f64 * (1.0 - KEPT_LOSS_TOLERANCE)
                {
                    fail(
                        Reason::MapEmptied,
                        format!("{m} lost most of its entries ({b}→{a}){lost}"),
                        &mut fatal,
                    );
                    format!("lost {b}→{a}{lost}")
                } else {
                    format!("kept {b}→{a}{lost}")
                }
            }
        };
        ev.insert(
            m.clone(),
            MapEvidence {
                class,
                before: *before,
                after: *after,
                recreated,
                judged: format!("{renamed}{judged}"),
            },
        );
    }
    if let (Some(va), Some(now)) = (va, endpoint_maps) {
        judge_policy_maps(
            step,
            va,
            now,
            settle_over,
            &mut ev,
            &mut fatal,
            &mut waiting,
        );
    }
    let waiting =
        (!waiting.is_empty()).then(|| format!("waiting for {} to refill", waiting.join(", ")));
    MapsJudged {
        evidence: ev,
        fatal,
        waiting,
    }
}

fn pair(v: Option<profile::CiliumVersion>) -> &'static str {
    v.map(profile::pair_label).unwrap_or("(version unknown)")
}

/// `; lost: a, b (+3 more)` when the entries before and now are both known.
fn lost_entries(before: Option<&Vec<String>>, now: Option<&Vec<String>>) -> String {
    let (Some(before), Some(now)) = (before, now) else {
        return String::new();
    };
    let now: std::collections::BTreeSet<&String> = now.iter().collect();
    let lost: Vec<&String> = before.iter().filter(|e| !now.contains(e)).collect();
    if lost.is_empty() {
        return String::new();
    }
    format!("; lost: {}", first_of(&lost, 8))
}

/// The per-endpoint policy maps of the returning version's prefix, judged like a recreated
/// map against the baseline's policy maps (whatever their prefix): an upgrade that renames
/// them (`cilium_policy_v2_*` → `cilium_policy_v3_*`) must create them again for the
/// endpoints by the end of settle.
fn judge_policy_maps(
    step: &Step,
    va: &AfterVersion,
    now: &BTreeMap<String, u64>,
    settle_over: bool,
    ev: &mut BTreeMap<String, MapEvidence>,
    fatal: &mut Option<(Reason, String)>,
    waiting: &mut Vec<String>,
) {
    let v = va.version;
    // A version from the names stands for its pair (1.16/1.17 differ in their policy prefix):
    // the pair's kind that is present is the node's.
    let kinds: Vec<&str> = if va.from.starts_with("agent API") {
        vec![profile::policy_kind(v)]
    } else {
        profile::CiliumVersion::ALL
            .into_iter()
            .filter(|o| profile::pair_label(*o) == profile::pair_label(v))
            .map(profile::policy_kind)
            .collect()
    };
    let kind = kinds
        .iter()
        .copied()
        .max_by_key(|k| now.get(*k).copied().unwrap_or(0))
        .unwrap_or(profile::policy_kind(v));
    let prefix = match kind {
        "policy_v3" => "cilium_policy_v3_",
        "policy_v2" => "cilium_policy_v2_",
        _ => "cilium_policy_",
    };
    let policy_kinds = ["policy", "policy_v2", "policy_v3"];
    let base = &step.baseline.endpoint_maps;
    // The baseline's own policy maps: the kind it had most of (a downgraded node may keep
    // another version's maps pinned beside its own).
    let Some((base_kind, b)) = policy_kinds
        .iter()
        .filter_map(|k| base.get(*k).map(|n| (*k, *n)))
        .max_by_key(|(_, n)| *n)
    else {
        return;
    };
    let a = now.get(kind).copied().unwrap_or(0);
    let name = format!("{prefix}*");
    let renamed = base_kind != kind;
    let judged = refill(&name, b, a, renamed, settle_over, fatal, waiting);
    ev.insert(
        name,
        MapEvidence {
            class: profile::MapClass::Recreated,
            before: Some(b),
            after: Some(a),
            recreated: renamed,
            judged: if renamed {
                format!("per-endpoint, renamed from {base_kind} maps: {judged}")
            } else {
                format!("per-endpoint: {judged}")
            },
        },
    );
}

/// [`judge_maps`] over an observation.
fn judge_observed_maps(
    step: &Step,
    o: &Observed,
    maps: &BTreeMap<String, Option<u64>>,
    va: Option<&AfterVersion>,
    settle_over: bool,
) -> MapsJudged {
    judge_maps(
        step,
        maps,
        o.map_ids.as_ref(),
        o.endpoint_maps.as_ref(),
        va,
        &o.map_entries,
        settle_over,
    )
}

/// What [`judge_maps`] found.
pub struct MapsJudged {
    pub evidence: BTreeMap<String, MapEvidence>,
    /// The first failure: the step has failed.
    pub fatal: Option<(Reason, String)>,
    /// Maps still refilling (the step is not green yet).
    pub waiting: Option<String>,
}

/// A map recreated by design (or for a property change): it must hold entries again by the
/// end of settle when it held some before.
fn refill(
    m: &str,
    b: u64,
    a: u64,
    recreated: bool,
    settle_over: bool,
    fatal: &mut Option<(Reason, String)>,
    waiting: &mut Vec<String>,
) -> String {
    let how = if recreated { "recreated" } else { "kept" };
    // Refilled: at least half of what it held (the same tolerance as kept state), so a map
    // holding only its first few entries again does not count as refilled.
    let refilled = b == 0 || (a > 0 && a as f64 >= b as f64 * (1.0 - KEPT_LOSS_TOLERANCE));
    if refilled {
        return format!("{how}, {b}→{a} entries");
    }
    if settle_over {
        if fatal.is_none() {
            *fatal = Some((
                Reason::MapEmptied,
                format!("{m} was not refilled by the end of settle ({b}→{a})"),
            ));
        }
        format!("{how}, not refilled by the end of settle ({b}→{a})")
    } else {
        waiting.push(m.to_string());
        format!("{how}, refilling ({b}→{a} so far)")
    }
}

/// A declared version (`expect.cilium`) against the one that came back: a release from the
/// agent's API decides; without it the pinned names decide only what they can tell apart
/// (1.16 from 1.18 or 1.20, never 1.16 from 1.17 or 1.18 from 1.19): a declaration they
/// cannot verify is unknown, never a pass. None: nothing declared, or it holds.
fn judge_declared_version(
    step: &Step,
    va: Option<&AfterVersion>,
    settle_over: bool,
) -> Option<Judged> {
    let declared = step.params.expect_cilium.as_deref()?;
    let before = step.baseline.cilium.as_deref().unwrap_or("unknown");
    let Some(va) = va.filter(|a| !a.ambiguous) else {
        return Some(Judged::not_yet(
            CheckStatus::Unknown,
            format!("the step declared Cilium {declared}; the version that came back is not known (the agent API did not tell, and the pinned maps leave it open)"),
            Some(Reason::EvidenceIncomplete),
        ));
    };
    let from_api = va.from.starts_with("agent API");
    let came = if from_api {
        va.from
            .strip_prefix("agent API (")
            .and_then(|f| f.strip_suffix(')'))
            .and_then(profile::release_of)
            .unwrap_or_else(|| va.version.as_str().to_string())
    } else {
        profile::pair_label(va.version).to_string()
    };
    let declared_v = profile::CiliumVersion::parse(declared);
    let same = if from_api {
        came == declared
    } else {
        declared_v.is_some_and(|d| profile::pair_label(d) == profile::pair_label(va.version))
    };
    if !same && !from_api && !settle_over {
        // Names settle with the endpoints' regeneration (policy maps of the new prefix):
        // judged on names only at the end of settle.
        return Some(Judged::not_yet(
            CheckStatus::Unknown,
            format!("the step declared Cilium {declared}; the pinned maps point to {came} so far"),
            Some(Reason::CiliumVersionMismatch),
        ));
    }
    if !same {
        return Some(Judged::fatal(
            Reason::CiliumVersionMismatch,
            format!(
                "the step declared Cilium {declared}, the node came back on Cilium {came} (from {}; it was {before} before)",
                if from_api { "the agent API" } else { "the pinned map names" }
            ),
        ));
    }
    if !from_api && !declared_v.is_some_and(profile::names_distinguish) {
        return Some(Judged::not_yet(
            CheckStatus::Unknown,
            format!(
                "the step declared Cilium {declared}: the pinned maps say {came}, which they cannot tell apart; configure `cilium_api` (the agent's API socket) to verify the release"
            ),
            Some(Reason::EvidenceIncomplete),
        ));
    }
    None
}

/// `baseline`: after the reload, the maps judged by class (see [`judge_maps`]), and DNS not
/// slower than before.
pub fn check_baseline(step: &Step, o: &Observed) -> Judged {
    let Some(reloaded_at) = step.reload.complete_at else {
        return Judged::not_yet(CheckStatus::Unknown, "compared after the reload", None);
    };
    if let Some(maps) = &o.maps {
        let settle_over = o.now >= reloaded_at + step.params.settle.as_secs_f64();
        let va = after_version(step, o);
        let j = judge_observed_maps(step, o, maps, va.as_ref(), settle_over);
        if let Some((code, why)) = j.fatal {
            return Judged::fatal(code, why);
        }
        // An upgrade step: the node must come back with the declared version's maps.
        if let Some(v) = step
            .params
            .expect_cilium
            .as_deref()
            .and_then(profile::CiliumVersion::parse)
        {
            let missing: Vec<String> = profile::core_maps(v)
                .into_iter()
                .filter(|m| !maps.contains_key(m))
                .collect();
            if !missing.is_empty() {
                let looks = va
                    .as_ref()
                    .map(|a| format!("; it looks like Cilium {}", a.version.as_str()))
                    .unwrap_or_default();
                return Judged::fatal(
                    Reason::MapMissing,
                    format!(
                        "the step expected Cilium {} after the restart, whose maps {} are missing{looks}",
                        v.as_str(),
                        missing.join(", ")
                    ),
                );
            }
        }
        if let Some(j) = judge_declared_version(step, va.as_ref(), settle_over) {
            return j;
        }
        if let Some(w) = j.waiting {
            return Judged::not_yet(CheckStatus::Unknown, w, Some(Reason::MapEmptied));
        }
    }
    if let (Some(before), Some(after)) = (step.baseline.dns_p50_ms, o.dns_p50_after_ms) {
        if after > before * step.params.dns_slower_ratio + 1.0 {
            return Judged::not_yet(
                CheckStatus::Fail,
                format!(
                    "DNS p50 {after:.1}ms after vs {before:.1}ms before (> {}x)",
                    step.params.dns_slower_ratio
                ),
                Some(Reason::DnsSlower),
            );
        }
    }
    Judged::pass("devices, maps (by class) and DNS latency as before")
}

/// `drops`: drops in the step window within each configured budget.
pub fn check_drops(step: &Step, o: &Observed) -> Judged {
    if !step.params.drops_budget.is_empty() && !o.drops_unknown.is_empty() {
        return Judged::not_yet(
            CheckStatus::Unknown,
            format!(
                "drop budgets are set but the {} drop counters are unknown: they cannot pass",
                o.drops_unknown.join(" and ")
            ),
            Some(Reason::DropsOverBudget),
        );
    }
    let over: Vec<String> = step
        .params
        .drops_budget
        .iter()
        .filter_map(|(reason, budget)| {
            let n = o
                .drops
                .iter()
                .filter(|(k, _)| k.ends_with(&format!(":{reason}")) || *k == reason)
                .map(|(_, v)| *v)
                .sum::<u64>();
            (n > *budget).then(|| format!("{reason} {n} > {budget}"))
        })
        .collect();
    if over.is_empty() {
        Judged::pass(format!(
            "{} drops in the window",
            o.drops.values().sum::<u64>()
        ))
    } else {
        Judged::not_yet(
            CheckStatus::Fail,
            over.join(", "),
            Some(Reason::DropsOverBudget),
        )
    }
}

/// A step check: its name (the key in the step's `checks`) and its judgement. Adding one is
/// a function here plus its line in [`STEP_CHECKS`].
pub struct StepCheckDef {
    pub name: &'static str,
    pub judge: fn(&Step, &Observed) -> Judged,
}

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
        seen.push(format!("{url}: {worst}"));
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
fn last_outage_end(step: &Step) -> Option<f64> {
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
    if let Some(p) = &o.programs {
        let base = step.baseline.programs.clone();
        let want = wanted_devices(step);
        update_reload(&mut step.reload, &base, &want, p, now);
    }
    if let Some(eps) = &o.endpoints {
        let base = std::mem::take(&mut step.baseline.endpoints);
        update_endpoints(&mut step.endpoints, &base, eps, now);
        step.baseline.endpoints = base;
    }
    step.gaps = gap_rows(step, o.complete_until.min(now));
    step.drops = o.drops.clone();
    if let (Some(at), Some(maps)) = (step.reload.complete_at, &o.maps) {
        let va = after_version(step, o);
        step.cilium_after = va.as_ref().map(|a| {
            match a
                .from
                .strip_prefix("agent API (")
                .and_then(profile::release_of)
            {
                Some(rel) => rel,
                None => profile::pair_label(a.version).to_string(),
            }
        });
        step.cilium_after_from = va.as_ref().map(|a| a.from.clone());
        let settle_over = now >= at + step.params.settle.as_secs_f64();
        step.maps = judge_observed_maps(step, o, maps, va.as_ref(), settle_over).evidence;
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
            finish(
                step,
                Status::Passed,
                vec![],
                format!(
                    "datapath reloaded and green for {:.0}s; gaps: {}{lan}",
                    settle,
                    if worst.is_empty() {
                        "none measured".into()
                    } else {
                        worst
                    }
                ),
                now,
            );
        }
        return;
    }
    step.green_since = None;
    if now < step.created_at + step.params.timeout.as_secs_f64() {
        return;
    }
    if !reloaded {
        let why = judged
            .iter()
            .find(|(n, _)| *n == "reload")
            .and_then(|(_, j)| j.at_timeout.clone())
            .map(|(_, w)| w)
            .unwrap_or_default();
        finish(
            step,
            Status::Failed,
            vec![Reason::DatapathNotReloaded],
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
mod tests {
    use super::*;
    use crate::step::{Baseline, StepParams, TargetTimeline};
    use std::time::Duration;

    fn step() -> Step {
        let mut s = bare_step();
        s.targets.get_mut("gw").unwrap().samples = timeline(70.0, None);
        s
    }

    fn bare_step() -> Step {
        let mut s = Step::new(
            "s".into(),
            0.0,
            StepParams {
                timeout: Duration::from_secs(60),
                settle: Duration::from_secs(5),
                max_gap: Duration::from_secs(2),
                max_loss: crate::step::DEFAULT_MAX_LOSS,
                max_total_gap: Some(4.0),
                burst_interval: Duration::from_millis(10),
                dns_slower_ratio: 2.0,
                drops_budget: BTreeMap::new(),
                expect_devices: None,
                expect_cilium: None,
                witnesses: vec![],
            },
            Baseline {
                programs: [("eth0".to_string(), 10u32), ("eth1".to_string(), 11u32)].into(),
                maps: [
                    ("cilium_ct4_global".to_string(), Some(100u64)),
                    ("cilium_lxc".to_string(), Some(4)),
                ]
                .into(),
                dns_p50_ms: Some(1.0),
                ..Default::default()
            },
            [(
                "gw".to_string(),
                TargetTimeline {
                    kind: "http".into(),
                    budget: 2.0,
                    loss_budget: Some(crate::step::DEFAULT_MAX_LOSS),
                    total_budget: Some(4.0),
                    ..Default::default()
                },
            )]
            .into(),
        );
        s.boot_id = None;
        s
    }

    /// Observes the step at `ticks`, the datapath reloading at 1.2 s; the verdict once decided.
    fn reload_at_1_2(s: &mut Step, ticks: &[f64]) -> Option<Verdict> {
        for &t in ticks {
            let p = if t < 1.2 {
                progs(Some(10), Some(11))
            } else {
                progs(Some(20), Some(21))
            };
            decide(s, &obs(t, p));
            if s.verdict.is_some() {
                break;
            }
        }
        s.verdict.clone()
    }

    fn ep(ifindex: u32, from: u32, to: Option<u32>) -> crate::step::EndpointPrograms {
        crate::step::EndpointPrograms {
            ifindex,
            from_container: Some(from),
            to_container: to,
            raced: false,
        }
    }

    /// Four endpoints at the baseline (lxc3 also has `cil_to_container`).
    fn with_endpoints() -> Step {
        let mut s = step();
        s.baseline.endpoints_followed = crate::step::EndpointsFollowed::Followed;
        s.baseline.endpoints = [
            ("lxc0", ep(100, 10, None)),
            ("lxc1", ep(101, 11, None)),
            ("lxc2", ep(102, 12, None)),
            ("lxc3", ep(103, 13, Some(23))),
        ]
        .into_iter()
        .map(|(n, e)| (n.to_string(), e))
        .collect();
        s
    }

    fn eps(
        list: &[(&str, crate::step::EndpointPrograms)],
    ) -> Option<BTreeMap<String, crate::step::EndpointPrograms>> {
        Some(
            list.iter()
                .map(|(n, e)| (n.to_string(), e.clone()))
                .collect(),
        )
    }

    /// Cilium regenerates every restored endpoint on each start: a restart whose host
    /// datapath reloaded but some endpoints kept their old programs fails at the end of
    /// settle, naming them; while it waits the check says how far it got. An endpoint
    /// deleted meanwhile is not a failure.
    #[test]
    fn endpoints_that_keep_their_old_programs_fail_the_step_by_the_end_of_settle() {
        let mut s = with_endpoints();
        let stalled = [
            ("lxc0", ep(100, 40, None)),
            ("lxc1", ep(101, 11, None)),
            ("lxc2", ep(102, 12, None)),
        ];
        let mut v = None;
        for t in [0.0, 1.0, 1.2, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0] {
            let p = if t < 1.2 {
                progs(Some(10), Some(11))
            } else {
                progs(Some(20), Some(21))
            };
            let mut o = obs(t, p);
            o.endpoints = if t < 1.5 {
                eps(&[
                    ("lxc0", ep(100, 10, None)),
                    ("lxc1", ep(101, 11, None)),
                    ("lxc2", ep(102, 12, None)),
                    ("lxc3", ep(103, 13, Some(23))),
                ])
            } else {
                eps(&stalled)
            };
            decide(&mut s, &o);
            if t == 3.0 {
                let c = &s.checks["endpoints"];
                assert_eq!(c.status, CheckStatus::Fail);
                assert!(
                    c.reason.contains(
                        "1 of 3 endpoints regenerated; waiting for lxc1, lxc2; 1 deleted meanwhile"
                    ),
                    "{}",
                    c.reason
                );
                assert!(s.verdict.is_none(), "not green while endpoints are pending");
            }
            if s.verdict.is_some() {
                v = s.verdict.clone();
                break;
            }
        }
        let v = v.expect("decided");
        assert_eq!(v.status, Status::Failed);
        assert_eq!(v.reasons, vec![Reason::EndpointsNotRegenerated], "{v:?}");
        assert!(
            v.summary.contains("2 of 3 endpoints") && v.summary.contains("lxc1, lxc2"),
            "{}",
            v.summary
        );
        assert!(s.verdict.as_ref().unwrap().finished_at >= s.reload.complete_at.unwrap() + 5.0);
    }

    /// A healthy regeneration passes, with the slowest endpoint named; `cil_to_container`
    /// detached on the reload (the endpoint no longer needs it) is regenerated, kept with
    /// its old id is not; a new device under an old name was deleted and recreated; an
    /// endpoint read while its program was being replaced waits for the next observation.
    #[test]
    fn endpoint_regeneration_rules() {
        let base = with_endpoints().baseline.endpoints;
        let mut p = crate::step::EndpointProgress::default();
        let mut raced = ep(102, 52, None);
        raced.raced = true;
        let now = eps(&[
            ("lxc0", ep(100, 40, None)),
            ("lxc1", ep(201, 41, None)),
            ("lxc2", raced),
            ("lxc3", ep(103, 43, Some(23))),
        ])
        .unwrap();
        update_endpoints(&mut p, &base, &now, 2.0);
        assert_eq!(p.regenerated.keys().collect::<Vec<_>>(), ["lxc0"]);
        assert_eq!(p.gone.iter().collect::<Vec<_>>(), ["lxc1"]);
        let now = eps(&[
            ("lxc0", ep(100, 40, None)),
            ("lxc2", ep(102, 52, None)),
            ("lxc3", ep(103, 43, None)),
        ])
        .unwrap();
        update_endpoints(&mut p, &base, &now, 3.5);
        assert_eq!(p.regenerated.len(), 3);
        assert_eq!(p.regenerated["lxc0"], 2.0, "first seen, not last");
        let mut s = with_endpoints();
        s.endpoints = p;
        s.reload.changed.insert("eth0".into(), (20, 1.2));
        s.reload.complete_at = Some(1.7);
        let j = check_endpoints(&s, 4.0);
        assert!(j.green(), "{j:?}");
        let r = &j.shown.unwrap().reason;
        assert!(r.contains("3 of 3 endpoints regenerated (slowest lxc3, 2.3s after the host datapath); 1 deleted meanwhile"), "{r}");
        // Pending endpoints not read consistently since the end of settle (every read
        // raced, or failed): no evidence either way, unknown, never a confident failure.
        let mut s = with_endpoints();
        s.reload.complete_at = Some(1.0);
        s.endpoints.old_seen_at.insert("lxc0".into(), 5.5);
        let j = check_endpoints(&s, 6.5);
        assert!(j.fatal.is_none(), "{j:?}");
        assert_eq!(j.shown.as_ref().unwrap().status, CheckStatus::Unknown);
        assert_eq!(
            j.at_timeout.as_ref().unwrap().0,
            Some(Reason::EvidenceIncomplete)
        );
        // Read again after the deadline, still old: now it is evidence.
        s.endpoints.old_seen_at.insert("lxc0".into(), 6.1);
        let j = check_endpoints(&s, 6.5);
        let (code, why) = j.fatal.expect("fatal");
        assert_eq!(code, Reason::EndpointsNotRegenerated);
        assert!(
            why.starts_with("1 of 4 endpoints") && why.contains(": lxc0"),
            "{why}"
        );
        // No endpoints at the start, or a record of an older agent: nothing to wait for;
        // endpoint programs unreadable at the start: unknown, never a pass.
        let mut s = step();
        assert!(check_endpoints(&s, 1.0).green());
        s.baseline.endpoints_followed = crate::step::EndpointsFollowed::Followed;
        assert!(check_endpoints(&s, 1.0).green());
        s.baseline.endpoints_followed = crate::step::EndpointsFollowed::Unknown("EPERM".into());
        let j = check_endpoints(&s, 1.0);
        assert!(!j.green() && j.shown.unwrap().status == CheckStatus::Unknown);
    }

    /// Sets a target's samples and its counts, as the runner records them.
    fn record<S: Into<super::super::gaps::Sample>>(s: &mut Step, samples: Vec<S>) {
        let samples: Vec<super::super::gaps::Sample> =
            samples.into_iter().map(Into::into).collect();
        let t = s.targets.get_mut("gw").unwrap();
        t.probes = samples.len() as u64;
        t.failures = samples.iter().filter(|x| !x.ok).count() as u64;
        t.samples = samples;
    }

    /// A datapath that loses every other probe after the reload passes no budget of the
    /// longest outage (each is 10 ms) but fails its loss budget, naming it.
    #[test]
    fn a_lossy_datapath_fails_its_loss_budget() {
        let mut s = step();
        let samples: Vec<(f64, bool)> = (0..=900)
            .map(|i| i as f64 * 0.01)
            .map(|t| (t, t < 1.2 || ((t * 100.0).round() as u64).is_multiple_of(2)))
            .collect();
        record(&mut s, samples);
        let v = reload_at_1_2(&mut s, &[0.0, 1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 8.0]).expect("decided");
        assert_eq!(v.status, Status::Failed);
        assert_eq!(v.reasons, vec![Reason::LossOverBudget], "{v:?}");
        assert!(v.summary.contains("max_loss"), "{}", v.summary);
    }

    /// Issue 26: probes held in a neighbour queue until 2.0 end the outage there, and the row
    /// says how long the answer that ended it was held.
    #[test]
    fn a_gap_row_ends_at_the_release_of_held_answers_and_says_so() {
        use super::super::gaps::Sample;
        let t = super::super::TargetTimeline {
            samples: (0..300)
                .map(|i| {
                    let sent = i as f64 * 0.01;
                    if !(1.0..2.0).contains(&sent) {
                        Sample::answered(sent, 0.001, 0.001)
                    } else if sent > 1.8 + 1e-9 {
                        Sample::answered(sent, 2.0 - sent + 0.001, 0.001)
                    } else {
                        Sample::failed(sent)
                    }
                })
                .collect(),
            failures: 81,
            probes: 300,
            ..Default::default()
        };
        let g = gap_row("gw", &t, 0.01, 3.0);
        assert!((g.longest_s - 1.0).abs() < 1e-6, "{g:?}");
        assert!(g.error_bound_s > 0.19, "{g:?}");
        assert!(g.longest_held_s.is_some_and(|h| h > 0.18), "{g:?}");
        assert_eq!(g.longest_end.map(|e| (e * 1e3).round()), Some(2000.0));
    }

    /// Many short outages within max_gap add up over max_total_gap.
    #[test]
    fn outages_that_add_up_fail_the_total_budget() {
        let mut s = step();
        // Loss is its own budget: here only the total is held.
        s.targets.get_mut("gw").unwrap().loss_budget = Some(1.0);
        // 0.5 s outages every 1.5 s from 1.5 s: the ninth passes 4 s in all.
        let samples: Vec<(f64, bool)> = (0..=1500)
            .map(|i| i as f64 * 0.01)
            .map(|t| (t, t < 1.5 || (t - 1.5) % 1.5 >= 0.5))
            .collect();
        record(&mut s, samples);
        let v = reload_at_1_2(
            &mut s,
            &[0.0, 1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 8.0, 11.0, 14.0, 15.0],
        )
        .expect("decided");
        assert_eq!(v.reasons, vec![Reason::GapOverBudget], "{v:?}");
        assert!(v.summary.contains("max_total_gap"), "{}", v.summary);
    }

    /// One probe that failed inside the settle window, recorded after ticks that looked green
    /// (a timeout is recorded late, under its send time), restarts settle.
    #[test]
    fn a_probe_lost_inside_settle_restarts_it() {
        let mut s = step();
        record(&mut s, timeline(20.0, None));
        let p = || progs(Some(20), Some(21));
        decide(&mut s, &obs(0.0, progs(Some(10), Some(11))));
        for t in [1.0, 2.0, 2.5, 3.0, 4.0] {
            decide(&mut s, &obs(t, p()));
        }
        // Green since ~3.0 (reload at 1.0 + 1 s quiet... ); a probe sent at 5.0 failed and is
        // recorded only now.
        let t = s.targets.get_mut("gw").unwrap();
        for x in t.samples.iter_mut().filter(|x| (x.sent - 5.0).abs() < 1e-6) {
            x.ok = false;
        }
        t.failures = 1;
        let since = s.green_since.unwrap();
        decide(&mut s, &obs(since + 5.05, p()));
        assert!(
            s.verdict.is_none(),
            "a failure inside the settle window must restart it: {:?}",
            s.verdict
        );
        decide(&mut s, &obs(5.01 + 5.1, p()));
        let v = s.verdict.as_ref().expect("passed after a full window");
        assert_eq!(v.status, Status::Passed, "{v:?}");
    }
    fn progs(a: Option<u32>, b: Option<u32>) -> Option<BTreeMap<String, Option<u32>>> {
        Some([("eth0".to_string(), a), ("eth1".to_string(), b)].into())
    }
    fn maps(ct: u64) -> Option<BTreeMap<String, Option<u64>>> {
        Some(
            [
                ("cilium_ct4_global".to_string(), Some(ct)),
                ("cilium_lxc".to_string(), Some(4)),
            ]
            .into(),
        )
    }
    /// Probes every 10 ms from 0 to `until`, failing inside `down`.
    fn timeline(until: f64, down: Option<(f64, f64)>) -> Vec<super::super::gaps::Sample> {
        (0..=(until * 100.0) as usize)
            .map(|i| i as f64 * 0.01)
            .map(|t| (t, !down.is_some_and(|(a, b)| t >= a - 1e-9 && t < b - 1e-9)).into())
            .collect()
    }
    fn obs(now: f64, p: Option<BTreeMap<String, Option<u32>>>) -> Observed {
        Observed {
            now,
            programs: p,
            maps: maps(100),
            dns_p50_after_ms: Some(1.2),
            complete_until: now,
            ..Default::default()
        }
    }

    #[test]
    fn a_clean_restart_passes_after_the_settle_window() {
        let mut s = step();
        s.targets.get_mut("gw").unwrap().samples = timeline(9.0, Some((1.0, 1.3)));
        for t in [0.0, 1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 7.0] {
            decide(
                &mut s,
                &obs(
                    t,
                    if t < 1.2 {
                        progs(Some(10), Some(11))
                    } else {
                        progs(Some(20), Some(21))
                    },
                ),
            );
        }
        assert!(s.verdict.is_none(), "not settled yet");
        decide(&mut s, &obs(8.1, progs(Some(20), Some(21))));
        let v = s.verdict.as_ref().unwrap();
        assert_eq!(v.status, Status::Passed, "{v:?}");
        assert!((s.gaps[0].longest_s - 0.3).abs() < 1e-9);
    }

    #[test]
    fn no_reload_fails_at_the_timeout() {
        let mut s = step();
        for t in [0.0, 30.0, 60.0] {
            decide(&mut s, &obs(t, progs(Some(10), Some(11))));
        }
        assert_eq!(
            s.verdict.unwrap().reasons,
            vec![Reason::DatapathNotReloaded]
        );
    }

    #[test]
    fn a_dropped_device_is_a_changed_device_set() {
        let mut s = step();
        decide(&mut s, &obs(1.0, progs(Some(20), None)));
        decide(&mut s, &obs(2.5, progs(Some(20), None)));
        assert_eq!(s.verdict.unwrap().reasons, vec![Reason::DeviceSetChanged]);
    }

    #[test]
    fn a_gap_over_budget_fails_at_once() {
        let mut s = step();
        s.targets.get_mut("gw").unwrap().samples = timeline(4.0, Some((1.0, 3.5)));
        decide(&mut s, &obs(4.0, progs(Some(10), Some(11))));
        assert_eq!(s.verdict.unwrap().reasons, vec![Reason::GapOverBudget]);
    }

    #[test]
    fn lost_and_emptied_maps_fail_after_the_reload() {
        let mut s = step();
        let mut o = obs(1.0, progs(Some(20), Some(21)));
        decide(&mut s, &o);
        o.now = 2.5;
        o.complete_until = 2.5;
        o.maps = Some([("cilium_ct4_global".to_string(), Some(100u64))].into());
        decide(&mut s, &o);
        assert_eq!(s.verdict.clone().unwrap().reasons, vec![Reason::MapMissing]);
        // Wrong pass 6: the endpoint map came back empty; it held only 4 entries, under the
        // old 8-entry threshold, and passed. Kept state emptied fails at any size.
        let mut s = step();
        decide(&mut s, &obs(1.0, progs(Some(20), Some(21))));
        let mut o = obs(2.5, progs(Some(20), Some(21)));
        o.maps = Some(
            [
                ("cilium_ct4_global".to_string(), Some(100u64)),
                ("cilium_lxc".to_string(), Some(0)),
            ]
            .into(),
        );
        decide(&mut s, &o);
        let v = s.verdict.unwrap();
        assert_eq!(v.reasons, vec![Reason::MapEmptied], "{v:?}");
        assert!(
            v.summary.contains("cilium_lxc came back empty (4→0)"),
            "{v:?}"
        );
    }

    /// Connection tracking is churn: flushed, it is reported, never a failure by itself.
    #[test]
    fn churn_maps_are_reported_not_judged() {
        let mut s = step();
        for t in [1.0, 2.5, 5.0, 8.0] {
            let mut o = obs(t, progs(Some(20), Some(21)));
            o.maps = maps(0);
            decide(&mut s, &o);
        }
        assert_eq!(
            s.verdict.as_ref().unwrap().status,
            Status::Passed,
            "{:?}",
            s.verdict
        );
        assert!(
            s.maps["cilium_ct4_global"].judged.contains("100→0"),
            "{:?}",
            s.maps
        );
    }

    fn ipcache_step() -> Step {
        let mut s = step();
        s.baseline.maps.insert("cilium_ipcache_v2".into(), Some(30));
        s.baseline.map_ids.insert("cilium_ipcache_v2".into(), 7);
        s
    }

    fn with_ipcache(t: f64, entries: u64, id: u32) -> Observed {
        let mut o = obs(t, progs(Some(20), Some(21)));
        let mut m = maps(100).unwrap();
        m.insert("cilium_ipcache_v2".into(), Some(entries));
        o.maps = Some(m);
        o.map_ids = Some([("cilium_ipcache_v2".to_string(), id)].into());
        o
    }

    /// ipcache is recreated on every Cilium start (new id, refilled): refilled within settle
    /// passes; still empty at the end of settle fails.
    #[test]
    fn ipcache_recreated_must_refill_by_the_end_of_settle() {
        let mut s = ipcache_step();
        for (t, n) in [
            (1.0, 0),
            (2.5, 0),
            (4.0, 12),
            (6.0, 30),
            (9.0, 30),
            (11.5, 30),
        ] {
            decide(&mut s, &with_ipcache(t, n, 8));
        }
        let v = s.verdict.clone().unwrap();
        assert_eq!(v.status, Status::Passed, "{v:?}");
        assert!(s.maps["cilium_ipcache_v2"].recreated);
        let mut s = ipcache_step();
        for t in [1.0, 2.5, 5.0, 7.6] {
            decide(&mut s, &with_ipcache(t, 0, 8));
        }
        let v = s.verdict.unwrap();
        assert_eq!(v.reasons, vec![Reason::MapEmptied], "{v:?}");
        assert!(
            v.summary
                .contains("not refilled by the end of settle (30→0)"),
            "{v:?}"
        );
    }

    /// The reload follows XDP and the overlay device too: with a declared device set, each
    /// declared device must get XDP again when the node had XDP, and the overlay stays.
    #[test]
    fn declared_devices_carry_xdp_and_the_overlay_along() {
        let mut s = step();
        for k in ["eth0:xdp", "cilium_vxlan", "cilium_host"] {
            s.baseline.programs.insert(k.into(), 9);
        }
        s.params.expect_devices = Some(vec!["eth0".into(), "eth2".into()]);
        let w: Vec<String> = wanted_devices(&s).into_iter().collect();
        assert_eq!(
            w,
            [
                "cilium_host",
                "cilium_vxlan",
                "eth0",
                "eth0:xdp",
                "eth2",
                "eth2:xdp"
            ]
        );
        s.params.expect_devices = None;
        assert!(wanted_devices(&s).contains("eth0:xdp"));
    }

    /// A rollout that drops eth1 on purpose: declared, the node coming back without eth1
    /// passes; coming back as before (eth1 reloaded too) fails with device_set_changed.
    #[test]
    fn a_declared_device_set_is_what_the_node_is_held_to() {
        let expect = |s: &mut Step| s.params.expect_devices = Some(vec!["eth0".into()]);
        let mut s = step();
        expect(&mut s);
        for t in [1.0, 2.5, 5.0, 8.0] {
            decide(&mut s, &obs(t, progs(Some(20), None)));
        }
        assert_eq!(
            s.verdict.as_ref().unwrap().status,
            Status::Passed,
            "{:?}",
            s.verdict
        );
        let mut s = step();
        expect(&mut s);
        for t in [1.0, 2.5] {
            decide(&mut s, &obs(t, progs(Some(20), Some(21))));
        }
        let v = s.verdict.unwrap();
        assert_eq!(v.reasons, vec![Reason::DeviceSetChanged], "{v:?}");
        assert!(v.summary.contains("still attached to eth1"), "{v:?}");
        // Without a declaration, losing eth1 is the failure it always was.
        let mut s = step();
        for t in [1.0, 2.5] {
            decide(&mut s, &obs(t, progs(Some(20), None)));
        }
        assert_eq!(s.verdict.unwrap().reasons, vec![Reason::DeviceSetChanged]);
    }

    /// An upgrade step that declared 1.18: the node coming back with 1.16's maps fails.
    #[test]
    fn a_declared_version_is_what_the_maps_are_held_to() {
        let mut s = step();
        s.params.expect_cilium = Some("1.18".into());
        for t in [1.0, 2.5] {
            decide(&mut s, &obs(t, progs(Some(20), Some(21))));
        }
        let v = s.verdict.unwrap();
        assert_eq!(v.reasons, vec![Reason::MapMissing], "{v:?}");
        assert!(v.summary.contains("expected Cilium 1.18"), "{v:?}");
    }

    /// An upgrade to 1.18 unpins the tunnel map and the v1 node map by design.
    #[test]
    fn maps_removed_by_design_in_the_new_version_are_expected() {
        let mut s = step();
        s.baseline.maps.insert("cilium_tunnel_map".into(), Some(3));
        for t in [1.0, 2.5, 5.0, 8.0] {
            let mut o = obs(t, progs(Some(20), Some(21)));
            let mut m = maps(100).unwrap();
            m.insert("cilium_ipcache_v2".into(), Some(5));
            o.maps = Some(m);
            decide(&mut s, &o);
        }
        assert_eq!(
            s.verdict.as_ref().unwrap().status,
            Status::Passed,
            "{:?}",
            s.verdict
        );
        assert!(s.maps["cilium_tunnel_map"]
            .judged
            .contains("removed by design: Cilium 1.18"));
    }

    #[test]
    fn incomplete_evidence_is_never_a_pass() {
        let mut s = step();
        s.evidence_incomplete =
            Some("the agent was down from 1.0 to 3.0 while the datapath reloaded".into());
        decide(&mut s, &obs(10.0, progs(Some(20), Some(21))));
        assert_eq!(s.verdict.unwrap().reasons, vec![Reason::EvidenceIncomplete]);
    }

    #[test]
    fn slower_dns_keeps_a_step_from_settling() {
        let mut s = step();
        let mut o = obs(1.0, progs(Some(20), Some(21)));
        o.dns_p50_after_ms = Some(9.0);
        for t in [1.0, 2.5, 10.0, 61.0] {
            o.now = t;
            o.complete_until = t;
            decide(&mut s, &o);
        }
        let v = s.verdict.unwrap();
        assert!(v.reasons.contains(&Reason::DnsSlower), "{v:?}");
    }

    /// Probes in flight at the end of the settle window: the step waits until they have
    /// answered (before the fix it passed once probes sent at the start of settle had).
    #[test]
    fn a_step_does_not_pass_while_probes_of_the_settle_window_are_in_flight() {
        let mut s = step();
        s.targets.get_mut("gw").unwrap().samples = timeline(6.5, None);
        let reload = progs(Some(20), Some(21));
        for t in [1.0, 2.5] {
            decide(&mut s, &obs(t, reload.clone()));
        }
        // Green since 2.5, settle 5 s: at 7.6 the window has run, but probes sent after 6.5
        // have not all answered yet (complete only up to 6.5).
        let mut o = obs(7.6, reload.clone());
        o.complete_until = 6.5;
        decide(&mut s, &o);
        assert!(s.verdict.is_none(), "{:?}", s.verdict);
        s.targets.get_mut("gw").unwrap().samples = timeline(7.6, None);
        decide(&mut s, &obs(7.6, reload));
        assert_eq!(s.verdict.unwrap().status, Status::Passed);
    }

    fn witness_report(complete_until: f64, longest: f64) -> crate::witness::WitnessReport {
        crate::witness::WitnessReport {
            id: "s".into(),
            instance: "w1".into(),
            created_at: 0.0,
            complete_until,
            ended: false,
            burst_interval: Duration::from_millis(10),
            gaps: vec![TargetGap {
                target: "gw".into(),
                kind: "http".into(),
                longest_s: longest,
                error_bound_s: 0.01,
                total_s: longest,
                count: usize::from(longest > 0.0),
                budget_s: 2.0,
                open: false,
                ..Default::default()
            }],
            macs: BTreeMap::new(),
            probes: BTreeMap::new(),
            latency_ms: BTreeMap::new(),
        }
    }

    /// A witness's evidence is part of the verdict: over budget fails naming it and the
    /// target; a witness that restarted is a hole; stale evidence never passes; covered
    /// evidence within budget passes.
    #[test]
    fn witnesses_are_judged_like_the_nodes_own_probes() {
        let run = |track: super::super::WitnessTrack, fresh: bool| {
            let mut s = step();
            s.witnesses.insert("http://w:9970".into(), track.clone());
            let mut last = None;
            for t in [1.0, 2.5, 5.0, 9.0, 15.0] {
                if fresh {
                    let mut tr = track.clone();
                    if let Some(r) = tr.report.as_mut() {
                        r.complete_until = t - 0.3;
                    }
                    s.witnesses.insert("http://w:9970".into(), tr);
                }
                decide(&mut s, &obs(t, progs(Some(20), Some(21))));
                last = s.verdict.clone();
            }
            last
        };
        let ok = super::super::WitnessTrack {
            instance: "w1".into(),
            report: Some(witness_report(0.0, 0.5)),
            ..Default::default()
        };
        let v = run(ok.clone(), true).expect("decided");
        assert_eq!(v.status, Status::Passed, "{v:?}");
        assert!(v.summary.contains("as a LAN client sees it"), "{v:?}");
        let over = super::super::WitnessTrack {
            report: Some(witness_report(0.0, 3.0)),
            ..ok.clone()
        };
        let v = run(over, true).expect("decided");
        assert_eq!(v.reasons, vec![Reason::GapOverBudget]);
        assert!(v.summary.contains("witness http://w:9970: gw"), "{v:?}");
        // A witness step planted by someone else with a 1 h budget: the step's own budget
        // (2 s) judges the LAN gap.
        let mut planted = witness_report(0.0, 3.0);
        planted.gaps[0].budget_s = 3600.0;
        let planted = super::super::WitnessTrack {
            report: Some(planted),
            ..ok.clone()
        };
        let v = run(planted, true).expect("decided");
        assert_eq!(v.reasons, vec![Reason::GapOverBudget], "{v:?}");
        let lost = super::super::WitnessTrack {
            lost: Some("restarted".into()),
            ..ok.clone()
        };
        let v = run(lost, true).expect("decided");
        assert_eq!(v.reasons, vec![Reason::EvidenceIncomplete]);
        // Stale: the witness's evidence stops at 0 (unreachable): not passed by 15 s.
        let v = run(ok, false);
        assert!(
            v.as_ref().is_none_or(|v| v.status != Status::Passed),
            "{v:?}"
        );
    }

    /// Probes that could not even be sent (EMFILE, no permission) are a hole, never noise:
    /// five of them end the step as evidence_incomplete, whatever the gaps say.
    #[test]
    fn probes_that_could_not_run_are_a_hole() {
        let mut s = step();
        s.targets.get_mut("gw").unwrap().not_run = NOT_RUN_LIMIT - 1;
        decide(&mut s, &obs(1.0, progs(Some(20), Some(21))));
        assert!(s.evidence_incomplete.is_none(), "under the limit");
        let t = s.targets.get_mut("gw").unwrap();
        t.not_run = NOT_RUN_LIMIT;
        t.not_run_detail = Some("Too many open files".into());
        decide(&mut s, &obs(2.5, progs(Some(20), Some(21))));
        let v = s.verdict.expect("decided");
        assert_eq!(v.reasons, vec![Reason::EvidenceIncomplete]);
        assert!(
            v.summary.contains("could not run (Too many open files)"),
            "{v:?}"
        );
    }

    /// The probe loop stalled for 400 ms (or probes could not run): a hole, never a pass.
    #[test]
    fn a_stalled_probe_loop_is_a_hole_in_the_evidence() {
        let mut s = step();
        let samples: Vec<super::super::gaps::Sample> = timeline(70.0, None)
            .into_iter()
            .filter(|x| !(x.sent > 3.0 && x.sent < 3.4))
            .collect();
        s.targets.get_mut("gw").unwrap().samples = samples;
        for t in [1.0, 2.5, 5.0, 9.0] {
            decide(&mut s, &obs(t, progs(Some(20), Some(21))));
        }
        let v = s.verdict.unwrap();
        assert_eq!(v.reasons, vec![Reason::EvidenceIncomplete], "{v:?}");
        assert!(
            v.summary.contains("no probe of gw was sent for 400ms"),
            "{v:?}"
        );
        // Lateness under the limit is not a hole: 150 ms without a probe at a 10 ms cadence
        // (scheduler noise on a busy node).
        let mut s = step();
        s.targets.get_mut("gw").unwrap().samples = timeline(70.0, None)
            .into_iter()
            .filter(|x| !(x.sent > 3.0 && x.sent < 3.15))
            .collect();
        for t in [1.0, 2.5, 5.0, 9.0] {
            decide(&mut s, &obs(t, progs(Some(20), Some(21))));
        }
        assert_eq!(s.verdict.unwrap().status, Status::Passed);
        // No probe at all (every probe failed to run): a hole too.
        let mut s = bare_step();
        decide(&mut s, &obs(1.0, progs(Some(20), Some(21))));
        assert_eq!(s.verdict.unwrap().reasons, vec![Reason::EvidenceIncomplete]);
    }

    /// A drop budget on a counter that cannot be read is never a pass (before: "0 drops in
    /// the window", and the budget passed).
    #[test]
    fn a_budget_on_unknown_drop_counters_cannot_pass() {
        let mut s = step();
        s.params.drops_budget.insert("TC_INGRESS".into(), 10);
        for t in [1.0, 2.5, 8.0, 61.0] {
            let mut o = obs(t, progs(Some(20), Some(21)));
            o.drops_unknown = vec!["kernel".into()];
            decide(&mut s, &o);
        }
        let v = s.verdict.unwrap();
        assert!(v.reasons.contains(&Reason::DropsOverBudget), "{v:?}");
        assert!(
            v.summary.contains("kernel drop counters are unknown"),
            "{v:?}"
        );
    }

    #[test]
    fn drops_over_budget_are_reported() {
        let mut s = step();
        s.params.drops_budget.insert("TC_INGRESS".into(), 10);
        let mut o = obs(1.0, progs(Some(20), Some(21)));
        o.drops.insert("kernel:TC_INGRESS".into(), 50);
        for t in [1.0, 2.5, 61.0] {
            o.now = t;
            o.complete_until = t;
            decide(&mut s, &o);
        }
        assert!(s
            .verdict
            .unwrap()
            .reasons
            .contains(&Reason::DropsOverBudget));
    }
}
