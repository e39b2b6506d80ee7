//! The maps of the version a node came back on: the per-endpoint policy maps of its prefix,
//! the version a step declared, and the baseline check.
use super::*;

/// The per-endpoint policy maps of the returning version's prefix, judged like a recreated
/// map against the baseline's policy maps (whatever their prefix): an upgrade that renames
/// them (`cilium_policy_v2_*` → `cilium_policy_v3_*`) must create them again for the
/// endpoints within the step's timeout.
pub(in crate::step::verdict) fn judge_policy_maps(
    step: &Step,
    va: &AfterVersion,
    now: &BTreeMap<String, u64>,
    past_timeout: bool,
    ev: &mut BTreeMap<String, MapEvidence>,
    fatal: &mut Option<(Reason, String)>,
    waiting: &mut Vec<String>,
) {
    let v = va.version;
    // A version from the names stands for its pair (1.16/1.17 differ in their policy prefix):
    // the pair's kind that is present is the node's.
    let kinds: Vec<&str> = if matches!(va.from, VersionSource::AgentApi(_)) {
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
    let judged = refill(&name, b, a, renamed, past_timeout, fatal, waiting);
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
            deleted: 0,
        },
    );
}

/// A declared version (`expect.cilium`) against the one that came back: a release from the
/// agent's API decides; without it the pinned names decide only what they can tell apart
/// (1.16 from 1.18 or 1.20, never 1.16 from 1.17 or 1.18 from 1.19): a declaration they
/// cannot verify is unknown, never a pass. None: nothing declared, or it holds.
pub(in crate::step::verdict) fn judge_declared_version(
    step: &Step,
    va: Option<&AfterVersion>,
    past_timeout: bool,
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
    let from_api = matches!(va.from, VersionSource::AgentApi(_));
    let came = if from_api {
        va.from
            .api_release()
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
    if !same && !from_api && !past_timeout {
        // Names settle with the endpoints' regeneration (policy maps of the new prefix):
        // judged on names only at the step's timeout.
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
        let _ = reloaded_at;
        let past_timeout = super::timed_out(step, o.now);
        let va = after_version(step, o);
        let j = judge_observed_maps(step, o, maps, va.as_ref(), past_timeout);
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
                let why = format!(
                    "the step expected Cilium {} after the restart, whose maps {} are missing{looks}",
                    v.as_str(),
                    missing.join(", ")
                );
                // The timeout is the only deadline: the returning agent pins its maps as it
                // starts, and a reading may predate that; missing still at the timeout fails.
                return if past_timeout {
                    Judged::fatal(Reason::MapMissing, why)
                } else {
                    Judged::not_yet(CheckStatus::Unknown, why, Some(Reason::MapMissing))
                };
            }
        }
        if let Some(j) = judge_declared_version(step, va.as_ref(), past_timeout) {
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
