//! Which pinned global maps a Cilium node of a given version and feature set must have
//! (`shared/cilium-facts.md`), and inferring the version from the names present.
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum CiliumVersion {
    #[serde(rename = "1.16")]
    V1_16,
    #[serde(rename = "1.17")]
    V1_17,
    #[serde(rename = "1.18")]
    V1_18,
    #[serde(rename = "1.19")]
    V1_19,
    #[serde(rename = "1.20")]
    V1_20,
}

impl CiliumVersion {
    pub const ALL: [CiliumVersion; 5] = [
        Self::V1_16,
        Self::V1_17,
        Self::V1_18,
        Self::V1_19,
        Self::V1_20,
    ];
    /// The newest version with a profile: a newer node is checked against it (with a warning).
    pub const NEWEST: CiliumVersion = Self::V1_20;
    pub fn as_str(self) -> &'static str {
        match self {
            Self::V1_16 => "1.16",
            Self::V1_17 => "1.17",
            Self::V1_18 => "1.18",
            Self::V1_19 => "1.19",
            Self::V1_20 => "1.20",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|v| v.as_str() == s)
    }
    /// `1.21` or later (no profile yet): the newest profile stands in for it.
    pub fn newer_than_newest(s: &str) -> bool {
        let mut it = s.split('.').map(|p| p.parse::<u32>().ok());
        matches!((it.next(), it.next()), (Some(Some(1)), Some(Some(minor))) if minor > 20)
    }
}

/// Datapath features that decide which maps exist, from cilium-config or the agent config.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Features {
    pub ipv4: bool,
    pub ipv6: bool,
    /// kube-proxy replacement or BPF masquerade (which needs NodePort): the SNAT maps.
    pub snat: bool,
    pub l2_announcements: bool,
    /// Tunnel routing mode (VXLAN/Geneve): the tunnel map up to 1.17.
    pub tunnel: bool,
}

impl Default for Features {
    /// Cilium's Helm defaults: IPv4 only, kube-proxy replacement and BPF masquerade off,
    /// tunnel routing, no L2 announcements.
    fn default() -> Self {
        Self {
            ipv4: true,
            ipv6: false,
            snat: false,
            l2_announcements: false,
            tunnel: true,
        }
    }
}

impl Features {
    /// From cilium-config keys, over `base` for keys that are absent.
    pub fn from_cilium_config(cfg: &BTreeMap<String, String>, base: Features) -> Features {
        let flag = |k: &str| {
            cfg.get(k)
                .map(|v| matches!(v.trim(), "true" | "strict" | "True" | "TRUE"))
        };
        let kpr = flag("kube-proxy-replacement");
        let masq = flag("enable-bpf-masquerade");
        let nodeport = flag("enable-node-port");
        let tunnel = match (cfg.get("routing-mode"), cfg.get("tunnel")) {
            (Some(m), _) => Some(m.trim() != "native"),
            (None, Some(t)) => Some(t.trim() != "disabled"),
            (None, None) => None,
        };
        Features {
            ipv4: flag("enable-ipv4").unwrap_or(base.ipv4),
            ipv6: flag("enable-ipv6").unwrap_or(base.ipv6),
            snat: match (kpr, masq, nodeport) {
                (None, None, None) => base.snat,
                (k, m, n) => k.unwrap_or(false) || m.unwrap_or(false) || n.unwrap_or(false),
            },
            l2_announcements: flag("enable-l2-announcements").unwrap_or(base.l2_announcements),
            tunnel: tunnel.unwrap_or(base.tunnel),
        }
    }
}

/// Maps a version may have but never requires (created unconditionally in some versions,
/// deprecated in others).
pub fn optional_maps(_v: CiliumVersion) -> &'static [&'static str] {
    &[
        "cilium_auth_map",
        "cilium_l2_responder_v4",
        "cilium_l2_responder_v6",
    ]
}

/// Global maps (`tc/globals/<name>`) required for a version and feature set.
pub fn required_maps(v: CiliumVersion, f: Features) -> BTreeSet<String> {
    use CiliumVersion::*;
    let mut m: Vec<&str> = vec![
        "cilium_lxc",
        "cilium_metrics",
        "cilium_events",
        "cilium_signals",
        "cilium_runtime_config",
        "cilium_call_policy",
        "cilium_egresscall_policy",
        "cilium_node_map_v2",
    ];
    let before_1_18 = matches!(v, V1_16 | V1_17);
    // ipcache v2 from 1.18; the v1 node map is mirrored until 1.18 removes it; the tunnel
    // map exists up to 1.17 in tunnel mode only; per-CPU policy stats from 1.18.
    m.push(if before_1_18 {
        "cilium_ipcache"
    } else {
        "cilium_ipcache_v2"
    });
    if before_1_18 {
        m.push("cilium_node_map");
        if f.tunnel {
            m.push("cilium_tunnel_map");
        }
    } else {
        m.push("cilium_policystats");
    }
    if f.ipv4 {
        m.extend([
            "cilium_ct4_global",
            "cilium_ct_any4_global",
            "cilium_lb4_services_v2",
            "cilium_lb4_backends_v3",
            "cilium_lb4_reverse_nat",
        ]);
        if f.snat {
            m.push("cilium_snat_v4_external");
        }
        if f.l2_announcements {
            m.push("cilium_l2_responder_v4");
        }
    }
    if f.ipv6 {
        m.extend([
            "cilium_ct6_global",
            "cilium_ct_any6_global",
            "cilium_lb6_services_v2",
            "cilium_lb6_backends_v3",
            "cilium_lb6_reverse_nat",
        ]);
        if f.snat {
            m.push("cilium_snat_v6_external");
        }
    }
    m.into_iter().map(String::from).collect()
}

/// What Cilium does with a global map across an agent restart, and so how a step judges it
/// (docs/cilium-fidelity.md cites the source of each class).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MapClass {
    /// State Cilium keeps (opened, not recreated) and traffic depends on: endpoints,
    /// services, backends, reverse NAT, the node map. It must come back with its entries.
    Kept,
    /// Recreated by design on every start (unpinned, created anew, refilled): ipcache, the
    /// tunnel map (≤ 1.17), the VTEP map. It must have refilled by the end of settle.
    Recreated,
    /// Entries come and go with traffic (connection tracking, NAT, events, metrics, policy
    /// stats, L2 responder): reported, never a failure by itself.
    Churn,
    /// Configuration and program arrays: present, not counted.
    Other,
}

/// The class of a global map by name.
pub fn map_class(name: &str) -> MapClass {
    const KEPT: [&str; 10] = [
        "cilium_lxc",
        "cilium_lb4_services_v2",
        "cilium_lb4_backends_v3",
        "cilium_lb4_reverse_nat",
        "cilium_lb6_services_v2",
        "cilium_lb6_backends_v3",
        "cilium_lb6_reverse_nat",
        "cilium_node_map",
        "cilium_node_map_v2",
        "cilium_lb4_backends_v2",
    ];
    const RECREATED: [&str; 4] = [
        "cilium_ipcache",
        "cilium_ipcache_v2",
        "cilium_tunnel_map",
        "cilium_vtep_map",
    ];
    if KEPT.contains(&name) {
        MapClass::Kept
    } else if RECREATED.contains(&name) {
        MapClass::Recreated
    } else if name.starts_with("cilium_ct")
        || name.starts_with("cilium_snat")
        || name.starts_with("cilium_nodeport_neigh")
        || name.starts_with("cilium_l2_responder")
        || matches!(
            name,
            "cilium_events"
                | "cilium_signals"
                | "cilium_metrics"
                | "cilium_policystats"
                | "cilium_auth_map"
        )
    {
        MapClass::Churn
    } else {
        MapClass::Other
    }
}

/// Every global map a version may have, whatever its features.
pub fn possible_maps(v: CiliumVersion) -> BTreeSet<String> {
    let mut all = BTreeSet::new();
    for ipv6 in [false, true] {
        for snat in [false, true] {
            for l2 in [false, true] {
                for tunnel in [false, true] {
                    all.extend(required_maps(
                        v,
                        Features {
                            ipv4: true,
                            ipv6,
                            snat,
                            l2_announcements: l2,
                            tunnel,
                        },
                    ));
                }
            }
        }
    }
    all.extend(optional_maps(v).iter().map(|s| s.to_string()));
    all
}

/// Whether a map gone after a restart was removed by design: the version that came back
/// (inferred from `after`) has no such map whatever its features (e.g. `cilium_tunnel_map`
/// and the v1 `cilium_node_map` on 1.18).
pub fn removed_by_design(
    name: &str,
    after: &BTreeSet<String>,
    declared: Option<CiliumVersion>,
) -> Option<CiliumVersion> {
    let v = declared.or_else(|| infer_version(after).map(|(v, _)| v))?;
    (!possible_maps(v).contains(name)).then_some(v)
}

/// The maps every node of version `v` has whatever its features: what an upgrade step that
/// declared `v` holds the node to.
pub fn core_maps(v: CiliumVersion) -> BTreeSet<String> {
    required_maps(
        v,
        Features {
            ipv4: true,
            ipv6: false,
            snat: false,
            l2_announcements: false,
            tunnel: false,
        },
    )
}

/// Per-endpoint policy map prefix of a version: `cilium_policy_` (≤ 1.17),
/// `cilium_policy_v2_` (1.18, 1.19), `cilium_policy_v3_` (1.20).
pub fn policy_prefix(v: CiliumVersion) -> &'static str {
    match v {
        CiliumVersion::V1_20 => "cilium_policy_v3_",
        CiliumVersion::V1_18 | CiliumVersion::V1_19 => "cilium_policy_v2_",
        CiliumVersion::V1_16 | CiliumVersion::V1_17 => "cilium_policy_",
    }
}

/// True for per-endpoint and per-load maps, which are counted, not required by name.
pub fn is_per_endpoint(name: &str) -> Option<&'static str> {
    let tail_digits = |p: &str| {
        name.strip_prefix(p)
            .is_some_and(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()))
    };
    if tail_digits("cilium_policy_v3_") {
        Some("policy_v3")
    } else if tail_digits("cilium_policy_v2_") {
        Some("policy_v2")
    } else if tail_digits("cilium_policy_") {
        Some("policy")
    } else if tail_digits("cilium_calls_netdev_")
        || tail_digits("cilium_calls_hostns_")
        || tail_digits("cilium_calls_xdp_")
        || tail_digits("cilium_calls_")
    {
        Some("calls")
    } else if tail_digits("cilium_ep_config_") || tail_digits("cilium_egress_gw_") {
        Some("other")
    } else {
        None
    }
}

/// The version whose names fit `present` best, with the evidence that decided it.
pub fn infer_version(present: &BTreeSet<String>) -> Option<(CiliumVersion, String)> {
    let has = |n: &str| present.contains(n);
    let any_prefix = |p: &str| present.iter().any(|n| n.starts_with(p));
    if any_prefix("cilium_policy_v3_") {
        return Some((
            CiliumVersion::V1_20,
            "per-endpoint policy maps are cilium_policy_v3_* (1.20+)".into(),
        ));
    }
    // 1.18 and 1.19 have the same global maps, as do 1.16 and 1.17: the older of each pair
    // stands for both (their profiles are the same).
    if has("cilium_ipcache_v2") {
        return Some((
            CiliumVersion::V1_18,
            "cilium_ipcache_v2 present and policy maps are not v3 (1.18/1.19)".into(),
        ));
    }
    if has("cilium_ipcache") && has("cilium_node_map_v2") {
        return Some((
            CiliumVersion::V1_16,
            "cilium_ipcache (before 1.18) with cilium_node_map_v2 (1.16+): 1.16/1.17".into(),
        ));
    }
    None
}

/// The Cilium version(s) a set of pinned map names points to, for people and the step JSON:
/// `1.16/1.17`, `1.18/1.19` (the pairs share their global maps) or `1.20`.
pub fn version_label(present: &BTreeSet<String>) -> Option<String> {
    infer_version(present).map(|(v, _)| {
        match v {
            CiliumVersion::V1_16 | CiliumVersion::V1_17 => "1.16/1.17",
            CiliumVersion::V1_18 | CiliumVersion::V1_19 => "1.18/1.19",
            CiliumVersion::V1_20 => "1.20",
        }
        .to_string()
    })
}

/// Names that belong to another version's profile but not to `v`'s: evidence of a wrong profile.
pub fn foreign_names(v: CiliumVersion, f: Features, present: &BTreeSet<String>) -> Vec<String> {
    let mine = required_maps(v, f);
    let mut out: BTreeSet<String> = BTreeSet::new();
    for other in CiliumVersion::ALL.into_iter().filter(|o| *o != v) {
        for n in required_maps(other, f).difference(&mine) {
            if present.contains(n) {
                out.insert(n.clone());
            }
        }
        let p = policy_prefix(other);
        if p != policy_prefix(v) && present.iter().any(|n| n.starts_with(p)) {
            out.insert(format!("{p}*"));
        }
    }
    out.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(v: &[&str]) -> BTreeSet<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn names_follow_the_version_changes_in_cilium_facts() {
        let f = Features::default();
        let v16 = required_maps(CiliumVersion::V1_16, f);
        let v18 = required_maps(CiliumVersion::V1_18, f);
        assert!(v16.contains("cilium_ipcache") && v16.contains("cilium_tunnel_map"));
        assert!(
            v18.contains("cilium_ipcache_v2")
                && !v18.contains("cilium_tunnel_map")
                && !v18.contains("cilium_ipcache")
        );
        assert_eq!(policy_prefix(CiliumVersion::V1_20), "cilium_policy_v3_");
        // Helm defaults: no kube-proxy replacement, so no SNAT maps.
        assert!(!v18.contains("cilium_snat_v4_external"));
        assert!(!v18.contains("cilium_l2_responder_v4"));
        assert!(!v18.contains("cilium_ct6_global"));
        // Corrections read from Cilium's source (docs/cilium-fidelity.md): policy stats only
        // from 1.18; the tunnel map only in tunnel mode up to 1.17; the v1 node map until 1.18.
        assert!(!v16.contains("cilium_policystats") && v18.contains("cilium_policystats"));
        let native = Features { tunnel: false, ..f };
        assert!(!required_maps(CiliumVersion::V1_17, native).contains("cilium_tunnel_map"));
        assert!(v16.contains("cilium_node_map") && !v18.contains("cilium_node_map"));
        assert_eq!(
            required_maps(CiliumVersion::V1_17, f),
            v16,
            "1.17 has 1.16's global maps"
        );
        assert_eq!(required_maps(CiliumVersion::V1_19, f), v18);
        let kpr = Features { snat: true, ..f };
        assert!(required_maps(CiliumVersion::V1_20, kpr).contains("cilium_snat_v4_external"));
    }

    #[test]
    fn map_classes_follow_what_cilium_does_on_start() {
        assert_eq!(map_class("cilium_lxc"), MapClass::Kept);
        assert_eq!(map_class("cilium_lb4_services_v2"), MapClass::Kept);
        assert_eq!(map_class("cilium_ipcache_v2"), MapClass::Recreated);
        assert_eq!(map_class("cilium_ct4_global"), MapClass::Churn);
        assert_eq!(map_class("cilium_runtime_config"), MapClass::Other);
        // Gone after an upgrade to 1.18 by design; a service map gone is not.
        let after = set(&[
            "cilium_ipcache_v2",
            "cilium_node_map_v2",
            "cilium_policystats",
        ]);
        assert_eq!(
            removed_by_design("cilium_tunnel_map", &after, None),
            Some(CiliumVersion::V1_18)
        );
        assert!(removed_by_design("cilium_node_map", &after, None).is_some());
        assert!(removed_by_design("cilium_lb4_services_v2", &after, None).is_none());
        assert!(
            CiliumVersion::newer_than_newest("1.21") && !CiliumVersion::newer_than_newest("1.20")
        );
    }

    #[test]
    fn features_come_from_cilium_config_keys() {
        let cfg: BTreeMap<String, String> = [
            ("enable-ipv6", "true"),
            ("kube-proxy-replacement", "false"),
            ("enable-l2-announcements", "true"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let f = Features::from_cilium_config(&cfg, Features::default());
        assert!(f.ipv6 && f.l2_announcements && !f.snat);
        let m = required_maps(CiliumVersion::V1_18, f);
        assert!(
            m.contains("cilium_lb6_services_v2")
                && m.contains("cilium_l2_responder_v4")
                && !m.contains("cilium_snat_v4_external")
        );
    }

    #[test]
    fn the_version_is_inferred_from_names_present() {
        assert_eq!(
            infer_version(&set(&["cilium_ipcache_v2", "cilium_policy_v3_00012"]))
                .unwrap()
                .0,
            CiliumVersion::V1_20
        );
        assert_eq!(
            infer_version(&set(&["cilium_ipcache_v2", "cilium_policy_v2_00012"]))
                .unwrap()
                .0,
            CiliumVersion::V1_18
        );
        assert_eq!(
            infer_version(&set(&["cilium_ipcache", "cilium_node_map_v2"]))
                .unwrap()
                .0,
            CiliumVersion::V1_16
        );
        assert!(infer_version(&set(&["something_else"])).is_none());
    }

    #[test]
    fn a_wrong_profile_names_the_other_versions_maps() {
        let present = set(&["cilium_ipcache_v2", "cilium_policy_v3_01000"]);
        let f = foreign_names(CiliumVersion::V1_16, Features::default(), &present);
        assert!(f.contains(&"cilium_ipcache_v2".to_string()), "{f:?}");
        assert!(f.contains(&"cilium_policy_v3_*".to_string()), "{f:?}");
    }

    #[test]
    fn per_endpoint_maps_are_recognised() {
        assert_eq!(is_per_endpoint("cilium_policy_v2_00123"), Some("policy_v2"));
        assert_eq!(is_per_endpoint("cilium_policy_v3_00123"), Some("policy_v3"));
        assert_eq!(is_per_endpoint("cilium_calls_netdev_00002"), Some("calls"));
        assert_eq!(is_per_endpoint("cilium_calls_01000"), Some("calls"));
        assert_eq!(is_per_endpoint("cilium_lxc"), None);
        assert_eq!(is_per_endpoint("cilium_policystats"), None);
    }
}
