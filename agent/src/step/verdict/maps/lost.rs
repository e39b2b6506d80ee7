//! What kept maps lost across a restart, named in Cilium's terms where the entries were read.
use super::*;

/// Kept state that vanished across the restart within the tolerance (a pass still names it),
/// one line per map in Cilium's terms: what the entries are, the counts, which were lost.
pub fn kept_losses(step: &Step) -> Vec<String> {
    step.maps
        .iter()
        .filter(|(_, e)| e.class == profile::MapClass::Kept && !e.recreated)
        .filter_map(|(m, e)| {
            let (b, a) = (e.before?, e.after?);
            if a + e.deleted >= b {
                return None;
            }
            let what = if m.contains("services") {
                "service frontends"
            } else if m.contains("backends") {
                "service backends"
            } else if m.contains("maglev") {
                "Maglev tables"
            } else if m.contains("lxc") {
                "endpoints"
            } else if m.contains("rev") {
                "reverse NAT entries"
            } else {
                "entries"
            };
            let lost = e
                .judged
                .split_once("; lost: ")
                .map(|(_, l)| format!(": {l}"))
                .unwrap_or_default();
            Some(format!(
                "{} {what} of {m} ({b}→{a}){lost}",
                b - a - e.deleted
            ))
        })
        .collect()
}

pub(in crate::step::verdict) fn pair(v: Option<profile::CiliumVersion>) -> &'static str {
    v.map(profile::pair_label).unwrap_or("(version unknown)")
}

/// The named entries of a kept map that are gone since the baseline (None: not both known,
/// or none gone).
pub(super) fn lost_named(
    step: &Step,
    m: &str,
    entries_now: &BTreeMap<String, Vec<String>>,
) -> Option<Vec<String>> {
    if !(m.contains("services") || m.contains("backends")) {
        return None;
    }
    let lost: Vec<String> = gone_entries(step.baseline.map_entries.get(m)?, entries_now.get(m)?)
        .into_iter()
        .cloned()
        .collect();
    (!lost.is_empty()).then_some(lost)
}

/// The entries of `before` not in `now`, in `before`'s order.
pub(super) fn gone_entries<'a>(before: &'a [String], now: &[String]) -> Vec<&'a String> {
    let now: std::collections::BTreeSet<&String> = now.iter().collect();
    before.iter().filter(|e| !now.contains(e)).collect()
}

/// `; lost: a, b (+3 more)` when the entries before and now are both known.
pub(in crate::step::verdict) fn lost_entries(
    before: Option<&Vec<String>>,
    now: Option<&Vec<String>>,
) -> String {
    let (Some(before), Some(now)) = (before, now) else {
        return String::new();
    };
    let lost = gone_entries(before, now);
    if lost.is_empty() {
        return String::new();
    }
    format!("; lost: {}", first_of(&lost, 8))
}
