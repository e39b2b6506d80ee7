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
    /// Tunnel routing mode (VXLAN/Geneve): the tunnel map up to 1.17. None: the routing mode
    /// is not known (no cilium-config mounted), so the tunnel map is not required.
    pub tunnel: Option<bool>,
}

impl Default for Features {
    /// Cilium's Helm defaults: IPv4 only, kube-proxy replacement and BPF masquerade off, no
    /// L2 announcements. The routing mode is left unknown: Helm's default is tunnel, but a
    /// native-routing node without a mounted cilium-config must not be held to the tunnel map.
    fn default() -> Self {
        Self {
            ipv4: true,
            ipv6: false,
            snat: false,
            l2_announcements: false,
            tunnel: None,
        }
    }
}

impl Features {
    /// From cilium-config keys, over `base` for keys that are absent.
    pub fn from_cilium_config(cfg: &BTreeMap<String, String>, base: Features) -> Features {
        Self::from_cilium_config_at(cfg, base, None)
    }

    /// [`Features::from_cilium_config`] for the agent's release (`1.20`) when known:
    /// `enable-node-port` exists up to 1.18 only (1.19 removed the key; the SNAT maps follow
    /// kube-proxy replacement and BPF masquerade), so from 1.19 it counts for nothing.
    pub fn from_cilium_config_at(
        cfg: &BTreeMap<String, String>,
        base: Features,
        release: Option<&str>,
    ) -> Features {
        let minor = release.and_then(minor_of);
        let flag = |k: &str| {
            cfg.get(k)
                .map(|v| matches!(v.trim(), "true" | "strict" | "True" | "TRUE"))
        };
        let kpr = flag("kube-proxy-replacement");
        let masq = flag("enable-bpf-masquerade");
        let nodeport = flag("enable-node-port").filter(|_| minor.is_none_or(|m| m <= 18));
        let tunnel = match (cfg.get("routing-mode"), cfg.get("tunnel")) {
            (Some(m), _) => m.trim() != "native",
            (None, Some(t)) => t.trim() != "disabled",
            // No routing-mode key in a mounted cilium-config: the agent's own default
            // (`defaults.RoutingMode = "tunnel"`); Helm always writes the key.
            (None, None) => true,
        };
        Features {
            ipv4: flag("enable-ipv4").unwrap_or(base.ipv4),
            ipv6: flag("enable-ipv6").unwrap_or(base.ipv6),
            snat: match (kpr, masq, nodeport) {
                (None, None, None) => base.snat,
                (k, m, n) => k.unwrap_or(false) || m.unwrap_or(false) || n.unwrap_or(false),
            },
            l2_announcements: flag("enable-l2-announcements").unwrap_or(base.l2_announcements),
            tunnel: Some(tunnel),
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
        if f.tunnel == Some(true) {
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
    /// services, backends, reverse NAT, Maglev tables, the node map. It must come back with
    /// its entries.
    Kept,
    /// Recreated by design on every start (unpinned, created anew, refilled): ipcache, the
    /// tunnel map (≤ 1.17), the VTEP map. It must have refilled within the step's timeout.
    Recreated,
    /// Entries come and go with traffic (connection tracking, NAT, events, metrics, policy
    /// stats, L2 responder): reported, never a failure by itself.
    Churn,
    /// Configuration and program arrays: present, not counted.
    Other,
}

/// The class of a global map by name.
pub fn map_class(name: &str) -> MapClass {
    const KEPT: [&str; 12] = [
        // Maglev's outer maps (one entry per service using Maglev, its inner table): an
        // emptied one drops the services' traffic (`bpf_lxc`/`nodeport` look the table up by
        // the service's id); Cilium does not check them after it wrote them.
        "cilium_lb4_maglev",
        "cilium_lb6_maglev",
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

/// Kept-state maps up to this many entries have their entries named in a step's baseline
/// (the loss of a few is then said in Cilium's terms); bigger ones are only counted.
pub const NAMED_ENTRIES_MAX: u64 = 64;

/// Kept-state maps whose entries can be named (their key layouts are cited in
/// docs/cilium-fidelity.md).
pub fn names_entries(map: &str) -> bool {
    matches!(
        map,
        "cilium_lxc"
            | "cilium_lb4_services_v2"
            | "cilium_lb6_services_v2"
            | "cilium_lb4_backends_v3"
            | "cilium_lb6_backends_v3"
    )
}

fn ip4(b: &[u8]) -> Option<std::net::Ipv4Addr> {
    Some(std::net::Ipv4Addr::from(
        <[u8; 4]>::try_from(b.get(..4)?).ok()?,
    ))
}

fn ip6(b: &[u8]) -> Option<std::net::Ipv6Addr> {
    Some(std::net::Ipv6Addr::from(
        <[u8; 16]>::try_from(b.get(..16)?).ok()?,
    ))
}

/// The address of a `cilium_lxc` key (`struct endpoint_key`: 16 address bytes, the family
/// at byte 16: 1 IPv4, 2 IPv6).
pub fn endpoint_ip(key: &[u8]) -> Option<std::net::IpAddr> {
    match key.get(16)? {
        1 => ip4(key).map(Into::into),
        2 => ip6(key).map(Into::into),
        _ => None,
    }
}

fn be16(b: &[u8]) -> Option<u16> {
    Some(u16::from_be_bytes(b.get(..2)?.try_into().ok()?))
}

fn proto_name(p: u8) -> String {
    match p {
        0 => "any".into(),
        6 => "TCP".into(),
        17 => "UDP".into(),
        132 => "SCTP".into(),
        n => format!("proto {n}"),
    }
}

/// A service key after its address: `dport` (network order), `backend_slot`, `proto`, `scope`.
fn service_key(addr: String, rest: &[u8]) -> Option<String> {
    let (port, slot) = (
        be16(rest)?,
        u16::from_ne_bytes([*rest.get(2)?, *rest.get(3)?]),
    );
    let scope = if *rest.get(5)? == 1 {
        " (internal)"
    } else {
        ""
    };
    let frontend = format!("{addr}:{port}/{}{scope}", proto_name(rest[4]));
    Some(if slot == 0 {
        frontend
    } else {
        format!("{frontend} backend slot {slot}")
    })
}

/// An entry of a kept-state map in Cilium's terms, read from its key (and value): a service
/// frontend `198.51.100.10:80/TCP` (`struct lb4_key`: address, dport in network order,
/// backend_slot, proto, scope; slot 0 is the service itself, others its backend slots), a
/// backend `backend 7 = 10.0.1.5:80` (`struct lb4_backend`: address, port in network order),
/// an endpoint `10.0.1.5` (`struct endpoint_key`: address, family). None for another map or a
/// key of another size.
pub fn describe_entry(map: &str, key: &[u8], value: &[u8]) -> Option<String> {
    match (map, key.len()) {
        ("cilium_lb4_services_v2", 12) => service_key(ip4(key)?.to_string(), &key[4..]),
        ("cilium_lb6_services_v2", 24) => service_key(format!("[{}]", ip6(key)?), &key[16..]),
        ("cilium_lb4_backends_v3", 4) => Some(format!(
            "backend {} = {}:{}",
            u32::from_ne_bytes(key.try_into().ok()?),
            ip4(value)?,
            be16(value.get(4..)?)?
        )),
        ("cilium_lb6_backends_v3", 4) => Some(format!(
            "backend {} = [{}]:{}",
            u32::from_ne_bytes(key.try_into().ok()?),
            ip6(value)?,
            be16(value.get(16..)?)?
        )),
        ("cilium_lxc", 20) => match endpoint_ip(key) {
            Some(ip) => Some(format!("endpoint {ip}")),
            None => Some(format!("endpoint key family {}", key[16])),
        },
        _ => None,
    }
}

/// Every global map a version may have, whatever its features.
pub fn possible_maps(v: CiliumVersion) -> BTreeSet<String> {
    let mut all = BTreeSet::new();
    for ipv6 in [false, true] {
        for snat in [false, true] {
            for l2 in [false, true] {
                for tunnel in [Some(false), Some(true)] {
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

/// Whether a map gone after a restart was removed by design: a map of an earlier release's
/// profile that the version `v` that came back has no longer, whatever its features (e.g.
/// `cilium_tunnel_map` and the v1 `cilium_node_map` on 1.18), or one Cilium retired before
/// 1.16 and deletes where an old node still pins it. A name no profile knows is never
/// "removed by design": whether Cilium removes it is not known here ([`known_map`]).
pub fn removed_by_design(name: &str, v: CiliumVersion) -> bool {
    const RETIRED: [&str; 6] = [
        "cilium_lb4_backends",
        "cilium_lb4_backends_v2",
        "cilium_lb4_services",
        "cilium_lb6_backends",
        "cilium_lb6_backends_v2",
        "cilium_lb6_services",
    ];
    !possible_maps(v).contains(name)
        && (RETIRED.contains(&name)
            || CiliumVersion::ALL
                .iter()
                .any(|w| possible_maps(*w).contains(name)))
}

/// Whether any release's profile knows the map (required for some features, or optional).
pub fn known_map(name: &str) -> bool {
    CiliumVersion::ALL
        .iter()
        .any(|w| possible_maps(*w).contains(name))
}

/// Maps Cilium's start-up sweep removes when their feature is disabled
/// (`MapSweeper.RemoveDisabledMaps`, run after the endpoints are restored:
/// `pkg/datapath/mapsweeper/map.go` l. 118–265 @ v1.20.2, `pkg/datapath/maps/map.go` @
/// v1.19.7), while the programs a start loads may pin some of them again
/// (`cilium_l2_responder_v6` and `cilium_lb4_maglev` on an IPv4-only node without Maglev,
/// measured on 1.20.2): whether such a pin exists after a restart depends on which came last.
/// Its vanishing is no fault by itself; the `maps` check holds the node to the maps its
/// features require, and a step passes only with that check green.
pub fn swept_when_disabled(name: &str) -> bool {
    const SWEPT: [&str; 36] = [
        "cilium_ct6_global",
        "cilium_ct_any6_global",
        "cilium_lb6_reverse_nat",
        "cilium_lb6_rr_seq",
        "cilium_lb6_services",
        "cilium_lb6_services_v2",
        "cilium_lb6_rr_seq_v2",
        "cilium_lb6_backends_v2",
        "cilium_lb6_reverse_sk",
        "cilium_snat_v6_external",
        "cilium_snat_v6_alloc_retries",
        "cilium_l2_responder_v6",
        "cilium_egress_gw_policy_v6",
        "cilium_lb6_maglev",
        "cilium_lb6_affinity",
        "cilium_lb6_source_range",
        "cilium_lb6_health",
        "cilium_ipmasq_v6",
        "cilium_snat_v4_external",
        "cilium_snat_v4_alloc_retries",
        "cilium_l2_responder_v4",
        "cilium_egress_gw_policy_v4",
        "cilium_egress_gw_policy_v4_v2",
        "cilium_lb4_maglev",
        "cilium_lb4_affinity",
        "cilium_lb4_source_range",
        "cilium_lb4_health",
        "cilium_ipmasq_v4",
        "cilium_ipv4_frag_datagrams",
        "cilium_ipv6_frag_datagrams",
        "cilium_srv6_sid",
        "cilium_srv6_policy_v4",
        "cilium_srv6_policy_v6",
        "cilium_srv6_vrf_v4",
        "cilium_srv6_vrf_v6",
        "cilium_egress_gw_policy_v6_v2",
    ];
    SWEPT.contains(&name)
        || name.starts_with("cilium_cidr_v4_")
        || name.starts_with("cilium_cidr_v6_")
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
            tunnel: Some(false),
        },
    )
}

/// Per-endpoint policy map prefix of a version (`pkg/maps/policymap` `MapName`):
/// `cilium_policy_` (1.16), `cilium_policy_v2_` (1.17–1.19), `cilium_policy_v3_` (1.20).
pub fn policy_prefix(v: CiliumVersion) -> &'static str {
    match v {
        CiliumVersion::V1_20 => "cilium_policy_v3_",
        CiliumVersion::V1_17 | CiliumVersion::V1_18 | CiliumVersion::V1_19 => "cilium_policy_v2_",
        CiliumVersion::V1_16 => "cilium_policy_",
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

/// Names of one map that Cilium renamed between versions, oldest first, each with the first
/// version that uses it (docs/cilium-fidelity.md): a step judges the name the returning
/// version uses against the baseline of whichever name the node had before.
const RENAMED: &[&[(&str, CiliumVersion)]] = &[&[
    ("cilium_ipcache", CiliumVersion::V1_16),
    ("cilium_ipcache_v2", CiliumVersion::V1_18),
]];

/// The names of the renamed map `name` belongs to, if Cilium renamed it.
pub fn rename_group(name: &str) -> Option<&'static [(&'static str, CiliumVersion)]> {
    RENAMED
        .iter()
        .copied()
        .find(|g| g.iter().any(|(n, _)| *n == name))
}

/// The name version `v` gives the map of `group`.
pub fn name_in(group: &'static [(&'static str, CiliumVersion)], v: CiliumVersion) -> &'static str {
    group
        .iter()
        .rev()
        .find(|(_, since)| *since <= v)
        .or(group.first())
        .map(|(n, _)| *n)
        .unwrap_or_default()
}

/// The kind (`kernel::bpffs` counts per-endpoint maps by it) of version `v`'s per-endpoint
/// policy maps, after [`policy_prefix`]: `policy`, `policy_v2` or `policy_v3`.
pub fn policy_kind(v: CiliumVersion) -> &'static str {
    match v {
        CiliumVersion::V1_20 => "policy_v3",
        CiliumVersion::V1_17 | CiliumVersion::V1_18 | CiliumVersion::V1_19 => "policy_v2",
        CiliumVersion::V1_16 => "policy",
    }
}

/// The names version inference reads: the global maps, plus one pseudo-name per kind of
/// per-endpoint policy map present (those are counted by kind, not kept by name). The
/// `maps` check and a step's versions use this one set, so they name the same version.
pub fn names_for_inference<'a>(
    globals: impl IntoIterator<Item = &'a String>,
    endpoint_maps: &BTreeMap<String, u64>,
) -> BTreeSet<String> {
    let mut all: BTreeSet<String> = globals.into_iter().cloned().collect();
    for (kind, prefix) in [
        ("policy", "cilium_policy_"),
        ("policy_v2", "cilium_policy_v2_"),
        ("policy_v3", "cilium_policy_v3_"),
    ] {
        if endpoint_maps.get(kind).is_some_and(|n| *n > 0) {
            all.insert(format!("{prefix}00000"));
        }
    }
    all
}

/// The version whose names fit `present` best (see [`names_for_inference`]), with the
/// evidence that decided it. Names of an older version win over a newer one's: Cilium
/// removes at start only the pins it knows (the old names it migrated from), so a node
/// downgraded from 1.18 to 1.17 may keep `cilium_ipcache_v2` and `cilium_policystats`, and a
/// node downgraded from 1.20 its `cilium_policy_v3_*` maps, while an upgraded node has had the
/// old names removed (docs/cilium-fidelity.md).
pub fn infer_version(present: &BTreeSet<String>) -> Option<(CiliumVersion, String)> {
    let has = |n: &str| present.contains(n);
    let any_prefix = |p: &str| present.iter().any(|n| n.starts_with(p));
    if has("cilium_ipcache") && has("cilium_node_map_v2") {
        // 1.18 removes the v1 ipcache pin at start (it migrates from `OldName`).
        return Some((
            CiliumVersion::V1_16,
            "cilium_ipcache (before 1.18) with cilium_node_map_v2 (1.16+): 1.16/1.17".into(),
        ));
    }
    if has("cilium_ipcache_v2") {
        if any_prefix("cilium_policy_v2_") && any_prefix("cilium_policy_v3_") {
            return Some((
                CiliumVersion::V1_18,
                "cilium_ipcache_v2 with per-endpoint policy maps of both cilium_policy_v2_* and cilium_policy_v3_* (1.18–1.20: ambiguous)".into(),
            ));
        }
        if any_prefix("cilium_policy_v3_") {
            return Some((
                CiliumVersion::V1_20,
                "cilium_ipcache_v2 with per-endpoint policy maps cilium_policy_v3_* (1.20+)".into(),
            ));
        }
        // 1.18 and 1.19 have the same maps: the older stands for both.
        return Some((
            CiliumVersion::V1_18,
            "cilium_ipcache_v2, per-endpoint policy maps not cilium_policy_v3_* (1.18/1.19)".into(),
        ));
    }
    None
}

/// Whether the names leave the version open between pairs (a node that was downgraded, or
/// upgraded, may keep another version's per-endpoint policy maps pinned: whether 1.20 removes
/// 1.19's `cilium_policy_v2_*` maps is *open* in docs/cilium-fidelity.md). A declared version
/// is then not judged by names.
pub fn names_ambiguous(present: &BTreeSet<String>) -> bool {
    let any_prefix = |p: &str| present.iter().any(|n| n.starts_with(p));
    present.contains("cilium_ipcache_v2")
        && !present.contains("cilium_ipcache")
        && any_prefix("cilium_policy_v2_")
        && any_prefix("cilium_policy_v3_")
}

/// The label of an inferred version for people and the step JSON: `1.16/1.17`, `1.18/1.19`
/// (the pairs share their maps, so names cannot tell them apart) or `1.20`.
pub fn pair_label(v: CiliumVersion) -> &'static str {
    match v {
        CiliumVersion::V1_16 | CiliumVersion::V1_17 => "1.16/1.17",
        CiliumVersion::V1_18 | CiliumVersion::V1_19 => "1.18/1.19",
        CiliumVersion::V1_20 => "1.20",
    }
}

/// Whether pinned map names can tell `v` from every other version (1.16 from 1.17 and 1.18
/// from 1.19 they cannot).
pub fn names_distinguish(v: CiliumVersion) -> bool {
    v == CiliumVersion::V1_20
}

/// The Cilium version(s) a set of names points to (see [`names_for_inference`]).
pub fn version_label(present: &BTreeSet<String>) -> Option<String> {
    infer_version(present).map(|(v, _)| pair_label(v).to_string())
}

/// The minor of a 1.x release (`1.20`, `1.20.2` → 20).
pub fn minor_of(release: &str) -> Option<u32> {
    release.strip_prefix("1.")?.split('.').next()?.parse().ok()
}

/// The minor release (`1.18`) of a cilium-agent version string as its API reports it
/// (`cilium-version` in `GET /v1/debuginfo`: `1.18.4 6a4b1e4f 2025-…`, or `v1.18.4`).
pub fn release_of(version: &str) -> Option<String> {
    let first = version.split_whitespace().next()?;
    let first = first.strip_prefix('v').unwrap_or(first);
    let mut it = first.split(['.', '-', '+']);
    let (major, minor) = (it.next()?, it.next()?);
    (major.parse::<u32>().is_ok() && minor.parse::<u32>().is_ok())
        .then(|| format!("{major}.{minor}"))
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
mod tests;
