//! The baseline check: kept state kept, maps recreated by design refilled, the version the
//! maps point to the one declared.
use super::*;

mod lost;
mod version;
pub use lost::kept_losses;
use lost::lost_named;
pub(super) use lost::{lost_entries, pair};
pub use version::check_baseline;
pub(super) use version::judge_policy_maps;

/// A kept-state map that had at least this many entries and lost more than half of them was
/// emptied (2: the three-VIP home cluster's services map losing two of its three is a loss).
pub const MAP_EMPTIED_MIN: u64 = 2;

/// A kept-state map that lost more than this share of its entries (and had at least
/// [`MAP_EMPTIED_MIN`]) failed; losing every entry fails at any size.
pub const KEPT_LOSS_TOLERANCE: f64 = 0.5;

/// The version a map judgement holds the node to after the reload, and what decided it.
#[derive(Clone, Debug, PartialEq)]
pub struct AfterVersion {
    pub version: profile::CiliumVersion,
    pub from: VersionSource,
    /// The names leave it open between pairs (see `profile::names_ambiguous`).
    pub ambiguous: bool,
}

/// What told the version a node runs.
#[derive(Clone, Debug, PartialEq)]
pub enum VersionSource {
    /// The running cilium-agent's API, with the version it reported (`1.20.2`).
    AgentApi(String),
    /// The pinned maps' names, and why they point there.
    MapNames(String),
    /// Only the step's declaration.
    Declared,
}

impl VersionSource {
    /// The release the agent's API reported (`1.20`); None for the other sources.
    pub fn api_release(&self) -> Option<String> {
        match self {
            VersionSource::AgentApi(full) => profile::release_of(full),
            _ => None,
        }
    }

    /// For people and the step's record: `agent API (1.20.2)`, `pinned map names: …`,
    /// `declared by the step`.
    pub fn describe(&self) -> String {
        match self {
            VersionSource::AgentApi(full) => format!("agent API ({full})"),
            VersionSource::MapNames(why) => format!("pinned map names: {why}"),
            VersionSource::Declared => "declared by the step".into(),
        }
    }
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
                    from: VersionSource::AgentApi(full.clone()),
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
                from: VersionSource::MapNames(why),
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
            from: VersionSource::Declared,
            ambiguous: true,
        })
}

/// Judges every map of the baseline and of the returning version by its class (what Cilium
/// does with it on a start): kept state must come back with its entries; maps recreated by
/// design (or for a property change: new id) must have refilled within the step's timeout; churn
/// is reported only. A map the returning version `va` renamed is judged under its new name
/// against the baseline of the old one (`cilium_ipcache` → `cilium_ipcache_v2`), and so are
/// the per-endpoint policy maps of its prefix; a map `va` does not have at all was removed by
/// design; a map new in `va` is reported. `entries_now`: the named entries of kept maps that
/// lost some (to name what was lost). Returns the evidence and the first failure, or what is
/// still awaited.
pub fn judge_maps(
    step: &Step,
    maps: &BTreeMap<String, Option<u64>>,
    reads: MapReads<'_>,
    va: Option<&AfterVersion>,
    past_timeout: bool,
) -> MapsJudged {
    let MapReads {
        ids,
        endpoint_maps,
        entries_now,
        services,
        required,
    } = reads;
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
    // Service frontends the agent deleted meanwhile, per family (`lb4`, `lb6`): each had
    // one reverse NAT entry.
    let family = |m: &str| {
        if m.starts_with("cilium_lb6") {
            "lb6"
        } else {
            "lb4"
        }
    };
    let mut deleted_services: BTreeMap<&'static str, u64> = BTreeMap::new();
    if let Some(agent) = services {
        for m in names.iter().filter(|m| m.contains("_services")) {
            let n = lost_named(step, m, entries_now)
                .unwrap_or_default()
                .iter()
                .filter(|e| !e.contains(" backend slot ") && !agent.lists_frontend(e))
                .count() as u64;
            *deleted_services.entry(family(m)).or_default() += n;
        }
    }
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
                    deleted: 0,
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
                    deleted: 0,
                },
            );
            continue;
        };
        let renamed = predecessor
            .map(|p| format!("renamed from {p}, "))
            .unwrap_or_default();
        let Some(after) = maps.get(m) else {
            let judged = match v {
                _ if profile::swept_when_disabled(m)
                    && !required.is_some_and(|r| r.contains(m.as_str())) =>
                {
                    "unpinned: Cilium's start-up sweep removes it when its feature is disabled (the maps check holds the node to its required maps)".into()
                }
                Some(v) if profile::removed_by_design(m, v) => {
                    format!("removed by design: Cilium {} has no {m}", v.as_str())
                }
                // A map of no profile (affinity, source ranges, egress gateway, ip-masq,
                // bandwidth, …): not said to be by design, and not counted as kept state.
                Some(v) if class != profile::MapClass::Kept && !profile::known_map(m) => {
                    format!(
                        "vanished (reported only): stepguard's profiles do not know {m}, so whether Cilium {} removes it by design is not known",
                        v.as_str()
                    )
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
                    deleted: 0,
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
        let mut deleted = 0;
        // The named entries a kept service map lost, judged by the agent's services.
        let named_lost = services.and_then(|_| lost_named(step, m, entries_now));
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
                refill(m, b, a, recreated, past_timeout, &mut fatal, &mut waiting)
            }
            profile::MapClass::Kept if recreated => {
                refill(m, b, a, true, past_timeout, &mut fatal, &mut waiting)
            }
            profile::MapClass::Kept if services.is_some() && named_lost.is_some() => {
                let agent = services.expect("checked");
                let gone = named_lost.unwrap_or_default();
                let held = |e: &String| {
                    if m.contains("backends") {
                        agent.lists_backend(e)
                    } else {
                        agent.lists_frontend(e)
                    }
                };
                let (still, removed): (Vec<&String>, Vec<&String>) =
                    gone.iter().partition(|e| held(e));
                deleted = removed.len() as u64;
                let removed_s = if removed.is_empty() {
                    String::new()
                } else {
                    format!(
                        "; deleted by the agent meanwhile: {}",
                        first_of(&removed, 8)
                    )
                };
                if still.is_empty() {
                    format!("kept {b}→{a}{removed_s}")
                } else if past_timeout {
                    fail(
                        Reason::KeptStateLost,
                        format!(
                            "{m} lacks {} entries the cilium-agent still holds ({b}→{a}): {}",
                            still.len(),
                            first_of(&still, 8)
                        ),
                        &mut fatal,
                    );
                    format!("lost {b}→{a}; lost: {}{removed_s}", first_of(&still, 8))
                } else {
                    waiting.push(format!(
                        "{m} ({} the agent still holds)",
                        first_of(&still, 3)
                    ));
                    format!(
                        "waiting {b}→{a}; missing: {}{removed_s}",
                        first_of(&still, 8)
                    )
                }
            }
            // A deleted service's reverse NAT entry and Maglev table go with it (their key is
            // the service's id, which names nothing to compare): as many lost as services the
            // agent deleted are deletions too.
            profile::MapClass::Kept
                if (m.ends_with("_reverse_nat") || m.ends_with("_maglev"))
                    && a < b
                    && b - a <= deleted_services.get(family(m)).copied().unwrap_or(0) =>
            {
                deleted = b - a;
                format!("kept {b}→{a}; the entries of services the agent deleted meanwhile")
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
                deleted,
            },
        );
    }
    if let (Some(va), Some(now)) = (va, endpoint_maps) {
        judge_policy_maps(
            step,
            va,
            now,
            past_timeout,
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

/// [`judge_maps`] over an observation.
pub(super) fn judge_observed_maps(
    step: &Step,
    o: &Observed,
    maps: &BTreeMap<String, Option<u64>>,
    va: Option<&AfterVersion>,
    past_timeout: bool,
) -> MapsJudged {
    judge_maps(
        step,
        maps,
        MapReads {
            ids: o.map_ids.as_ref(),
            endpoint_maps: o.endpoint_maps.as_ref(),
            entries_now: &o.map_entries,
            services: o.services.as_ref(),
            required: o.required_maps.as_ref(),
        },
        va,
        past_timeout,
    )
}

/// What [`judge_maps`] reads beside the counts: the maps' ids, the per-endpoint policy maps,
/// the named entries of kept maps that lost some, the services the agent holds.
pub struct MapReads<'a> {
    pub ids: Option<&'a BTreeMap<String, u32>>,
    pub endpoint_maps: Option<&'a BTreeMap<String, u64>>,
    pub entries_now: &'a BTreeMap<String, Vec<String>>,
    pub services: Option<&'a crate::ciliumapi::AgentServices>,
    /// The maps the node's features require now: one of them vanishing is never the
    /// start-up sweep of a disabled feature.
    pub required: Option<&'a std::collections::BTreeSet<String>>,
}

/// What [`judge_maps`] found.
pub struct MapsJudged {
    pub evidence: BTreeMap<String, MapEvidence>,
    /// The first failure: the step has failed.
    pub fatal: Option<(Reason, String)>,
    /// Maps still refilling (the step is not green yet).
    pub waiting: Option<String>,
}

/// A map recreated by design (or for a property change): it must hold entries again within
/// the step's timeout (its only deadline) when it held some before; until then it is
/// waited for.
pub(super) fn refill(
    m: &str,
    b: u64,
    a: u64,
    recreated: bool,
    past_timeout: bool,
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
    if past_timeout {
        if fatal.is_none() {
            *fatal = Some((
                Reason::MapEmptied,
                format!("{m} was not refilled within the step's timeout ({b}→{a})"),
            ));
        }
        format!("{how}, not refilled within the step's timeout ({b}→{a})")
    } else {
        waiting.push(m.to_string());
        format!("{how}, refilling ({b}→{a} so far)")
    }
}
