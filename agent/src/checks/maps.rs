//! `maps`: every map of the expected profile (Cilium version × features, adjusted by the
//! config's `required`/`optional`) is pinned under `<bpffs>/tc/globals/` and opens read-only;
//! evidence: type, key/value size, max entries, entry count of every global map.
use super::CheckResult;
use crate::checks::Code;
use crate::cilium::profile::{self, CiliumVersion, Features};
use crate::kernel::bpffs::{BpffsError, MapsObservation};
use serde_json::json;
use std::collections::BTreeSet;

pub const CHECK: &str = "maps";

/// Reads Cilium's pins with Cilium's rules: per-endpoint maps counted by kind, and the entries
/// of every global map (`count_all`: a person's one-off check) or only of those a verdict
/// judges by count (kept state and maps recreated by design; churn such as CT or NAT is never a
/// failure by itself, so the steady loop and steps do not pay for counting it).
pub async fn observe(
    bpffs: &std::path::Path,
    count_all: bool,
) -> Result<MapsObservation, BpffsError> {
    let count = if count_all {
        crate::kernel::bpffs::Count::All
    } else {
        crate::kernel::bpffs::Count::Only(|name| {
            matches!(
                profile::map_class(name),
                profile::MapClass::Kept | profile::MapClass::Recreated
            )
        })
    };
    let rules = crate::kernel::bpffs::Rules {
        per_endpoint: profile::is_per_endpoint,
        count,
    };
    crate::kernel::bpffs::observe_blocking(bpffs, rules).await
}

/// What the maps check expects.
#[derive(Clone, Debug)]
pub struct MapsExpectation {
    /// None = infer from the names present (`--cilium auto`).
    pub version: Option<CiliumVersion>,
    pub features: Features,
    pub features_from: String,
    pub required: Vec<String>,
    pub optional: Vec<String>,
    /// The configured version is newer than the newest profile (checked against it).
    pub newer: Option<String>,
}

pub fn evaluate(obs: Result<&MapsObservation, &BpffsError>, exp: &MapsExpectation) -> CheckResult {
    let obs = match obs {
        Ok(o) => o,
        Err(e) => return CheckResult::unknown(CHECK, Code::BpffsMissing, e.to_string(), json!({})),
    };
    let present: BTreeSet<String> = obs
        .globals
        .keys()
        .chain(obs.unreadable.keys())
        .cloned()
        .collect();
    // Per-endpoint names are not kept one by one; their prefix is what inference needs.
    let all_names = profile::names_for_inference(&present, &obs.endpoint_maps);
    let (version, how) = match exp.version {
        Some(v) => (v, "configured".to_string()),
        None => match profile::infer_version(&all_names) {
            Some((v, why)) => (v, format!("inferred: {why}")),
            None => {
                return CheckResult::unknown(
                    CHECK,
                    Code::VersionUnknown,
                    format!(
                    "cannot infer the Cilium version from {} pinned maps; set `cilium:` / --cilium",
                    present.len()
                ),
                    json!({"present": present}),
                )
            }
        },
    };
    let mut required = profile::required_maps(version, exp.features);
    required.extend(exp.required.iter().cloned());
    for o in &exp.optional {
        required.remove(o);
    }
    let missing: Vec<&String> = required.iter().filter(|n| !present.contains(*n)).collect();
    let maps: Vec<_> = obs.globals.values().map(|m| json!({"name": m.name, "type": m.map_type, "key_size": m.key_size, "value_size": m.value_size, "max_entries": m.max_entries, "entries": m.entries, "required": required.contains(&m.name)})).collect();
    let foreign = profile::foreign_names(version, exp.features, &all_names);
    let inferred = profile::infer_version(&all_names).map(|(v, _)| v.as_str());
    let evidence = json!({
        "profile_note": exp.newer.as_ref().map(|n| format!("Cilium {n} is newer than the newest profile ({}): checked against it; names it does not know are not failures", version.as_str())),
        "bpffs_dir": "tc/globals",
        "cilium": version.as_str(),
        "cilium_from": how,
        "features": exp.features,
        "features_from": exp.features_from,
        "required": required,
        "missing": missing,
        "other_versions_names": foreign,
        "maps": maps,
        "endpoint_maps": obs.endpoint_maps,
        "unreadable": obs.unreadable,
    });
    if obs.permission_denied {
        return CheckResult::unknown(
            CHECK,
            Code::NoPermission,
            "cannot open pinned maps: permission denied (needs CAP_BPF, or CAP_SYS_ADMIN)",
            evidence,
        );
    }
    if let Some((name, why)) = obs.unreadable.iter().find(|(n, _)| required.contains(*n)) {
        return CheckResult::fail(
            CHECK,
            Code::MapUnreadable,
            format!("{name}: {why}"),
            evidence,
        );
    }
    if !missing.is_empty() {
        let mut reason = format!(
            "{} of {} maps of the Cilium {} profile missing: {}",
            missing.len(),
            required.len(),
            version.as_str(),
            missing
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
        if !foreign.is_empty() {
            reason.push_str(&format!(
                " (present instead: {}{})",
                foreign.join(", "),
                inferred
                    .filter(|i| *i != version.as_str())
                    .map(|i| format!("; looks like Cilium {i}"))
                    .unwrap_or_default()
            ));
        }
        return CheckResult::fail(CHECK, Code::MapMissing, reason, evidence);
    }
    CheckResult::pass(
        CHECK,
        Code::MapsOk,
        format!(
            "all {} maps of the Cilium {} profile present and readable",
            required.len(),
            version.as_str()
        ),
        evidence,
    )
}

/// The maps the profile requires that this run found gone (from the `maps` result among
/// `results`), for the `map_present` metric.
pub fn missing(results: &[CheckResult]) -> Vec<String> {
    results
        .iter()
        .filter(|r| r.check == CHECK)
        .flat_map(|r| {
            r.evidence["missing"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|v| v.as_str().map(String::from))
        .collect()
}

/// The `maps` node check: needs the pinned maps.
pub const NODE_CHECK: super::NodeCheck = super::NodeCheck {
    name: CHECK,
    needs: super::Needs {
        links: false,
        maps: true,
        agent: true,
        status: false,
    },
    from_probes: None,
    evaluate: evaluate_node,
    render,
};

fn evaluate_node<'a>(i: &'a super::Inputs<'a>) -> super::Evaluating<'a> {
    Box::pin(async move {
        let Some(obs) = i.maps else {
            return CheckResult::unknown(
                CHECK,
                Code::NotObserved,
                "maps were not observed",
                json!({}),
            );
        };
        let cfg = i.cfg;
        let release = i
            .loaded
            .and_then(|l| l.ok())
            .and_then(|l| l.version.as_deref())
            .and_then(crate::cilium::profile::release_of);
        let (features, features_from) = features(
            cfg,
            i.effective.or(i.cilium.and_then(|c| c.ok())),
            release.as_deref(),
        );
        let exp = MapsExpectation {
            // A version newer than the newest profile is checked against the newest (the
            // evidence says so): never failed for names the profile does not know.
            version: CiliumVersion::parse(&cfg.cilium).or_else(|| {
                CiliumVersion::newer_than_newest(&cfg.cilium).then_some(CiliumVersion::NEWEST)
            }),
            newer: CiliumVersion::newer_than_newest(&cfg.cilium).then(|| cfg.cilium.clone()),
            features,
            features_from,
            required: cfg.maps.required.clone(),
            optional: cfg.maps.optional.clone(),
        };
        evaluate(obs.as_ref(), &exp)
    })
}

/// The datapath features that decide the maps: cilium-config over the agent config over
/// Helm's defaults.
pub fn features(
    cfg: &crate::config::Config,
    cilium_cfg: Option<&crate::ciliumconfig::Snapshot>,
    release: Option<&str>,
) -> (Features, String) {
    let mut base = Features::default();
    // A mounted cilium-config without `enable-ipv6`: the agent's own default applies, which
    // is on (`defaults.EnableIPv6 = true`, 1.19.7 and 1.20.2; Helm writes the key, false).
    if cilium_cfg.is_some() {
        base.ipv6 = true;
    }
    if let Some(v) = cfg.maps.ipv6 {
        base.ipv6 = v;
    }
    if let Some(v) = cfg.maps.snat {
        base.snat = v;
    }
    if let Some(v) = cfg.maps.l2_announcements {
        base.l2_announcements = v;
    }
    match cilium_cfg {
        Some(s) => (
            Features::from_cilium_config_at(&s.values, base, release),
            "cilium-config".into(),
        ),
        None => (base, "agent config / defaults".into()),
    }
}

/// The `maps` check's evidence as lines for people.
pub fn render(r: &CheckResult) -> Vec<String> {
    let e = &r.evidence;
    let s = super::show;
    let mut l = Vec::new();
    l.push(format!(
        "Cilium {} ({}), features from {}",
        s(&e["cilium"]),
        s(&e["cilium_from"]),
        s(&e["features_from"])
    ));
    for m in e["maps"].as_array().into_iter().flatten() {
        l.push(format!(
            "{:<28} {:<16} {:>3}/{:<4} max {:<8} entries {}",
            s(&m["name"]),
            s(&m["type"]),
            m["key_size"],
            m["value_size"],
            m["max_entries"],
            s(&m["entries"])
        ));
    }
    l.push(format!("per-endpoint maps: {}", s(&e["endpoint_maps"])));
    l
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::Status;
    use crate::kernel::bpffs::PinnedMap;

    fn obs(names: &[&str]) -> MapsObservation {
        let mut o = MapsObservation::default();
        for n in names {
            o.globals.insert(
                n.to_string(),
                PinnedMap {
                    name: n.to_string(),
                    map_type: "hash",
                    key_size: 4,
                    value_size: 4,
                    max_entries: 10,
                    entries: Some(3),
                    id: 1,
                },
            );
        }
        o
    }
    fn exp(v: Option<CiliumVersion>) -> MapsExpectation {
        MapsExpectation {
            version: v,
            features: Features::default(),
            features_from: "test".into(),
            required: vec![],
            optional: vec![],
            newer: None,
        }
    }

    #[test]
    fn a_complete_profile_passes_and_a_missing_map_is_named() {
        let names: Vec<String> = profile::required_maps(CiliumVersion::V1_18, Features::default())
            .into_iter()
            .collect();
        let refs: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
        let r = evaluate(Ok(&obs(&refs)), &exp(Some(CiliumVersion::V1_18)));
        assert_eq!(r.status, Status::Pass, "{}", r.reason);
        let without: Vec<&str> = refs
            .iter()
            .copied()
            .filter(|n| *n != "cilium_lb4_services_v2")
            .collect();
        let r = evaluate(Ok(&obs(&without)), &exp(Some(CiliumVersion::V1_18)));
        assert_eq!((r.status, r.code.as_str()), (Status::Fail, "map_missing"));
        assert!(r.reason.contains("cilium_lb4_services_v2"));
    }

    #[test]
    fn optional_and_required_adjust_the_profile() {
        let names: Vec<String> = profile::required_maps(CiliumVersion::V1_18, Features::default())
            .into_iter()
            .filter(|n| n != "cilium_auth_map")
            .collect();
        let refs: Vec<&str> = names.iter().map(|s| s.as_str()).collect();
        let mut e = exp(Some(CiliumVersion::V1_18));
        e.optional = vec!["cilium_auth_map".into()];
        assert_eq!(evaluate(Ok(&obs(&refs)), &e).status, Status::Pass);
        e.required = vec!["cilium_custom".into()];
        assert!(evaluate(Ok(&obs(&refs)), &e)
            .reason
            .contains("cilium_custom"));
    }

    #[test]
    fn missing_bpffs_and_uninferable_versions_are_unknown() {
        let err = BpffsError::NotBpffs("/tmp/x".into());
        assert_eq!(evaluate(Err(&err), &exp(None)).status, Status::Unknown);
        assert_eq!(evaluate(Ok(&obs(&[])), &exp(None)).code, "version_unknown");
    }

    #[test]
    fn permission_problems_are_unknown_never_pass() {
        let mut o = obs(&[]);
        o.permission_denied = true;
        o.unreadable.insert("cilium_lxc".into(), "EPERM".into());
        o.unreadable
            .insert("cilium_ipcache_v2".into(), "EPERM".into());
        assert_eq!(
            evaluate(Ok(&o), &exp(Some(CiliumVersion::V1_18))).status,
            Status::Unknown
        );
    }

    /// A mounted cilium-config without `enable-ipv6` runs with the agent's default, IPv6 on;
    /// the key, or stepguard's own `maps.ipv6`, decides otherwise.
    #[test]
    fn ipv6_follows_ciliums_default_when_the_key_is_absent() {
        let snap = |pairs: &[(&str, &str)]| crate::ciliumconfig::Snapshot {
            changed_at: 0.0,
            version: "..1".into(),
            values: pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        let cfg = crate::config::Config::default();
        assert!(features(&cfg, Some(&snap(&[])), None).0.ipv6);
        assert!(
            !features(&cfg, Some(&snap(&[("enable-ipv6", "false")])), None)
                .0
                .ipv6
        );
        assert!(
            !features(&cfg, None, None).0.ipv6,
            "no ConfigMap: Helm's default"
        );
        let mut own = crate::config::Config::default();
        own.maps.ipv6 = Some(false);
        assert!(!features(&own, Some(&snap(&[])), None).0.ipv6);
    }
}
