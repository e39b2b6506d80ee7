//! Which pinned global maps a Cilium node of a given version and feature set must have
//! (`shared/cilium-facts.md`), and inferring the version from the names present.
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum CiliumVersion {
    #[serde(rename = "1.16")]
    V1_16,
    #[serde(rename = "1.18")]
    V1_18,
    #[serde(rename = "1.20")]
    V1_20,
}

impl CiliumVersion {
    pub const ALL: [CiliumVersion; 3] = [Self::V1_16, Self::V1_18, Self::V1_20];
    pub fn as_str(self) -> &'static str {
        match self {
            Self::V1_16 => "1.16",
            Self::V1_18 => "1.18",
            Self::V1_20 => "1.20",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|v| v.as_str() == s)
    }
}

/// Datapath features that decide which maps exist, from cilium-config or the agent config.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Features {
    pub ipv4: bool,
    pub ipv6: bool,
    /// kube-proxy replacement or BPF masquerade (both bring the SNAT maps).
    pub snat: bool,
    pub l2_announcements: bool,
}

impl Default for Features {
    fn default() -> Self {
        Self {
            ipv4: true,
            ipv6: false,
            snat: true,
            l2_announcements: false,
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
        Features {
            ipv4: flag("enable-ipv4").unwrap_or(base.ipv4),
            ipv6: flag("enable-ipv6").unwrap_or(base.ipv6),
            snat: match (kpr, masq) {
                (None, None) => base.snat,
                (k, m) => k.unwrap_or(false) || m.unwrap_or(false),
            },
            l2_announcements: flag("enable-l2-announcements").unwrap_or(base.l2_announcements),
        }
    }
}

/// Global maps (`tc/globals/<name>`) required for a version and feature set.
pub fn required_maps(v: CiliumVersion, f: Features) -> BTreeSet<String> {
    let mut m: Vec<&str> = vec![
        "cilium_lxc",
        "cilium_metrics",
        "cilium_events",
        "cilium_signals",
        "cilium_runtime_config",
        "cilium_call_policy",
        "cilium_egresscall_policy",
        "cilium_policystats",
        "cilium_auth_map",
        "cilium_node_map_v2",
    ];
    m.push(if v == CiliumVersion::V1_16 {
        "cilium_ipcache"
    } else {
        "cilium_ipcache_v2"
    });
    if v == CiliumVersion::V1_16 {
        m.push("cilium_tunnel_map");
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

/// Per-endpoint map prefix of a version: `cilium_policy_v2_` (≤1.18) or `cilium_policy_v3_`.
pub fn policy_prefix(v: CiliumVersion) -> &'static str {
    if v == CiliumVersion::V1_20 {
        "cilium_policy_v3_"
    } else {
        "cilium_policy_v2_"
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
    if has("cilium_ipcache_v2") {
        return Some((
            CiliumVersion::V1_18,
            "cilium_ipcache_v2 present and policy maps are v2 (1.18/1.19)".into(),
        ));
    }
    if has("cilium_ipcache") && has("cilium_node_map_v2") {
        return Some((
            CiliumVersion::V1_16,
            "cilium_ipcache (pre-1.18) with cilium_node_map_v2 (1.16+)".into(),
        ));
    }
    None
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
        assert!(v18.contains("cilium_snat_v4_external"));
        assert!(!v18.contains("cilium_l2_responder_v4"));
        assert!(!v18.contains("cilium_ct6_global"));
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
