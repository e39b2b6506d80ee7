//! Cilium's pinned global maps for a chosen version and feature set, created with Cilium's
//! names, types and key/value sizes (bpf/lib/*.h, pkg/maps/*), and filled with plausible entries
//! so that entry counts are not zero. `cilium_metrics` is created by the fake datapath object
//! (it shares the programs' key layout); everything else is created here.
use crate::sys;
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

pub const HASH: u32 = 1;
pub const ARRAY: u32 = 2;
pub const PROG_ARRAY: u32 = 3;
pub const PERF_EVENT_ARRAY: u32 = 4;
pub const PERCPU_HASH: u32 = 5;
pub const LRU_HASH: u32 = 9;
pub const LPM_TRIE: u32 = 11;

/// Cilium minor version the lab imitates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Profile {
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

impl Profile {
    /// 1.16 and 1.17 share their global maps (ipcache v1, the v1 node map, the tunnel map),
    /// as do 1.18 and 1.19 (docs/cilium-fidelity.md).
    pub fn before_1_18(self) -> bool {
        matches!(self, Self::V1_16 | Self::V1_17)
    }
}

impl std::str::FromStr for Profile {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "1.16" => Ok(Self::V1_16),
            "1.17" => Ok(Self::V1_17),
            "1.18" => Ok(Self::V1_18),
            "1.19" => Ok(Self::V1_19),
            "1.20" => Ok(Self::V1_20),
            _ => anyhow::bail!("unknown Cilium profile {s:?}: expected 1.16 … 1.20"),
        }
    }
}

impl std::fmt::Display for Profile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::V1_16 => "1.16",
            Self::V1_17 => "1.17",
            Self::V1_18 => "1.18",
            Self::V1_19 => "1.19",
            Self::V1_20 => "1.20",
        })
    }
}

/// Datapath features that change which maps exist (mirrors cilium-config keys).
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct Features {
    /// `enable-ipv4` (on by default); off, an IPv6-only node: Cilium creates no IPv4 maps.
    #[serde(default = "yes")]
    pub ipv4: bool,
    pub ipv6: bool,
    pub kube_proxy_replacement: bool,
    pub l2_announcements: bool,
    /// `routing-mode: tunnel` (Helm's default, VXLAN); false is native routing.
    #[serde(default = "yes")]
    pub tunnel: bool,
}

fn yes() -> bool {
    true
}

impl Features {
    /// Cilium's `AreDevicesRequired` as far as the lab's features go (NodePort/KPR,
    /// L2 announcements): `cil_to_netdev` is attached only then.
    pub fn devices_required(self) -> bool {
        self.kube_proxy_replacement || self.l2_announcements
    }
}

/// Cilium's `AreDevicesRequired` from configuration keys (`pkg/option/config.go`, every
/// version 1.16–main: NodePort/KPR, host firewall, WireGuard, L2 announcements, IPsec, BPF
/// masquerade — which needs NodePort before 1.19 and is its own term since): the lab's
/// agent attaches `cil_to_netdev` exactly then.
pub fn devices_required_by(cfg: &std::collections::BTreeMap<String, String>) -> bool {
    let on = |k: &str| {
        cfg.get(k)
            .is_some_and(|v| matches!(v.trim(), "true" | "True" | "strict"))
    };
    [
        "kube-proxy-replacement",
        "enable-node-port",
        "enable-host-firewall",
        "enable-wireguard",
        "enable-l2-announcements",
        "enable-ipsec",
        "enable-bpf-masquerade",
    ]
    .iter()
    .any(|k| on(k))
}

#[derive(Clone, Debug)]
pub struct MapSpec {
    pub name: String,
    pub map_type: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
    pub flags: u32,
}

fn spec(name: &str, map_type: u32, key_size: u32, value_size: u32, max_entries: u32) -> MapSpec {
    let flags = if map_type == LPM_TRIE {
        sys::bpf::BPF_F_NO_PREALLOC
    } else {
        0
    };
    MapSpec {
        name: name.into(),
        map_type,
        key_size,
        value_size,
        max_entries,
        flags,
    }
}

/// Sizes the lab gives the big conntrack/NAT maps. Real defaults are 512k/256k entries; the lab
/// keeps them smaller unless a benchmark asks for more (LRU maps are preallocated).
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct Capacity {
    pub ct_entries: u32,
}

impl Default for Capacity {
    fn default() -> Self {
        Self { ct_entries: 65536 }
    }
}

/// The global maps (`tc/globals/<name>`) of a profile, without `cilium_metrics`.
pub fn global_maps(profile: Profile, f: Features, cap: Capacity) -> Vec<MapSpec> {
    let ncpu = std::thread::available_parallelism()
        .map(|n| n.get() as u32)
        .unwrap_or(1);
    let ct = cap.ct_entries;
    let ipcache = if profile.before_1_18() {
        "cilium_ipcache"
    } else {
        "cilium_ipcache_v2"
    };
    let mut v = vec![
        spec("cilium_lxc", HASH, 20, 48, 65535),
        spec(
            ipcache,
            LPM_TRIE,
            24,
            if profile.before_1_18() { 20 } else { 24 },
            512000,
        ),
        spec("cilium_events", PERF_EVENT_ARRAY, 4, 4, ncpu),
        spec("cilium_signals", PERF_EVENT_ARRAY, 4, 4, ncpu),
        spec("cilium_runtime_config", ARRAY, 4, 8, 256),
        spec("cilium_call_policy", PROG_ARRAY, 4, 4, 65535),
        spec("cilium_egresscall_policy", PROG_ARRAY, 4, 4, 65535),
        spec("cilium_auth_map", HASH, 12, 8, 524288),
        spec("cilium_node_map_v2", HASH, 20, 4, 16384),
    ];
    for m in v.iter_mut().filter(|m| m.name == "cilium_auth_map") {
        m.flags = sys::bpf::BPF_F_NO_PREALLOC;
    }
    if !profile.before_1_18() {
        // Per-CPU policy stats from 1.18 (pkg/maps/policymap/statsmap.go).
        v.push(spec("cilium_policystats", PERCPU_HASH, 16, 16, 65536));
    }
    if profile.before_1_18() {
        // Up to 1.17: the tunnel map (only in tunnel routing mode) and the v1 node map
        // mirrored next to v2 (Cilium's pkg/maps/nodemap; removed at init from 1.18).
        if f.tunnel {
            v.push(spec("cilium_tunnel_map", HASH, 20, 20, 65536));
        }
        v.push(spec("cilium_node_map", HASH, 20, 2, 16384));
    }
    if f.ipv4 {
        // The IPv4 conntrack and load-balancing maps exist only with IPv4 on
        // (`ctmap.GlobalMaps(ipv4, ipv6)`, `lbmaps.go` `allMaps` per enabled family).
        v.extend([
            spec("cilium_ct4_global", LRU_HASH, 14, 56, ct),
            spec("cilium_ct_any4_global", LRU_HASH, 14, 56, (ct / 2).max(1)),
            spec("cilium_lb4_services_v2", HASH, 12, 12, 65536),
            spec("cilium_lb4_backends_v3", HASH, 4, 12, 65536),
            spec("cilium_lb4_reverse_nat", HASH, 2, 8, 65536),
        ]);
        if f.kube_proxy_replacement {
            v.push(spec("cilium_snat_v4_external", LRU_HASH, 14, 16, ct));
        }
        if f.l2_announcements {
            v.push(spec("cilium_l2_responder_v4", HASH, 8, 8, 4096));
        }
    }
    if f.ipv6 {
        v.push(spec("cilium_ct6_global", LRU_HASH, 38, 56, ct));
        v.push(spec(
            "cilium_ct_any6_global",
            LRU_HASH,
            38,
            56,
            (ct / 2).max(1),
        ));
        v.push(spec("cilium_lb6_services_v2", HASH, 24, 12, 65536));
        v.push(spec("cilium_lb6_backends_v3", HASH, 4, 24, 65536));
        v.push(spec("cilium_lb6_reverse_nat", HASH, 2, 20, 65536));
        if f.kube_proxy_replacement {
            v.push(spec("cilium_snat_v6_external", LRU_HASH, 38, 32, ct));
        }
    }
    v
}

/// Per-endpoint policy map name for a profile (`cilium_policy_v2_00123`, `_v3_` from 1.20).
pub fn policy_map_name(profile: Profile, epid: u16) -> String {
    match profile {
        // pkg/maps/policymap `MapName`: `cilium_policy_` at 1.16, `cilium_policy_v2_` from 1.17
        // (docs/cilium-fidelity.md), `cilium_policy_v3_` at 1.20.
        Profile::V1_16 => format!("cilium_policy_{epid:05}"),
        Profile::V1_20 => format!("cilium_policy_v3_{epid:05}"),
        _ => format!("cilium_policy_v2_{epid:05}"),
    }
}

pub fn globals_dir(bpffs: &Path) -> PathBuf {
    bpffs.join("tc/globals")
}

/// Creates the map and pins it at `<bpffs>/tc/globals/<name>`, replacing an older pin.
pub fn create_pinned(bpffs: &Path, m: &MapSpec) -> Result<OwnedFd> {
    let fd = sys::bpf::map_create(
        m.map_type,
        m.key_size,
        m.value_size,
        m.max_entries,
        m.flags,
        &m.name,
    )
    .with_context(|| {
        format!(
            "create map {} (type {}, {}x{}, max {})",
            m.name, m.map_type, m.key_size, m.value_size, m.max_entries
        )
    })?;
    let path = globals_dir(bpffs).join(&m.name);
    let _ = std::fs::remove_file(&path);
    sys::bpf::obj_pin(&fd, &path).with_context(|| format!("pin map {}", path.display()))?;
    Ok(fd)
}

/// An index as Cilium's ids are stored (host byte order): a `__u32` backend id, a `__u16`
/// reverse-NAT index or node id, at the start of a key or value of `size` bytes.
fn key_from(idx: u32, size: u32) -> Vec<u8> {
    let mut k = vec![0u8; size as usize];
    match k.len() {
        0 | 1 => k.iter_mut().for_each(|b| *b = idx as u8),
        2 | 3 => k[..2].copy_from_slice(&(idx as u16).to_ne_bytes()),
        _ => k[..4].copy_from_slice(&idx.to_ne_bytes()),
    }
    k
}

/// What the lab knows about the node, to fill maps with entries that mean something.
pub struct NodeFacts<'a> {
    pub pod_ips: &'a [[u8; 4]],
    pub node_ips: &'a [[u8; 4]],
    pub vips: &'a [([u8; 4], u16)],
}

/// Fills a freshly created global map with entries; returns how many were written.
pub fn populate(fd: &OwnedFd, m: &MapSpec, facts: &NodeFacts, ct_fill: u32) -> Result<u32> {
    let mut n = 0u32;
    let mut put = |k: &[u8], v: &[u8]| -> Result<()> {
        sys::bpf::map_update(fd, k, v)
            .with_context(|| format!("write an entry into {}", m.name))?;
        n += 1;
        Ok(())
    };
    let val = vec![1u8; m.value_size as usize];
    match m.name.as_str() {
        "cilium_lxc" => {
            // struct endpoint_key: ip (16), family (1), key (1), cluster_id (2)
            for ip in facts.pod_ips.iter().chain(facts.node_ips.iter().take(1)) {
                let mut k = vec![0u8; 20];
                k[..4].copy_from_slice(ip);
                k[16] = 1;
                put(&k, &val)?;
            }
        }
        "cilium_ipcache" | "cilium_ipcache_v2" => {
            // struct ipcache_key: lpm prefixlen (4), pad (3), family (1), ip (16)
            let world = [0u8; 4];
            for (ip, plen) in facts
                .pod_ips
                .iter()
                .chain(facts.node_ips)
                .map(|i| (i, 32))
                .chain([(&world, 0)])
            {
                let mut k = vec![0u8; 24];
                k[..4].copy_from_slice(&(32u32 + plen).to_ne_bytes());
                k[7] = 1;
                k[8..12].copy_from_slice(ip);
                put(&k, &val)?;
            }
        }
        "cilium_lb4_services_v2" => {
            // struct lb4_key: address (4), dport (2), backend_slot (2), proto (1), scope (1), pad (2)
            for (i, (vip, port)) in facts.vips.iter().enumerate() {
                for slot in 0..=1u16 {
                    let mut k = vec![0u8; 12];
                    k[..4].copy_from_slice(vip);
                    k[4..6].copy_from_slice(&port.to_be_bytes());
                    k[6..8].copy_from_slice(&slot.to_ne_bytes());
                    let mut v = vec![0u8; 12];
                    v[..4].copy_from_slice(&(i as u32 + 1).to_ne_bytes());
                    v[4..6].copy_from_slice(&1u16.to_ne_bytes());
                    v[6..8].copy_from_slice(&(i as u16 + 1).to_ne_bytes());
                    put(&k, &v)?;
                }
            }
        }
        "cilium_lb4_backends_v3" | "cilium_lb4_reverse_nat" | "cilium_l2_responder_v4" => {
            for (i, (vip, port)) in facts.vips.iter().enumerate() {
                let mut k = key_from(i as u32 + 1, m.key_size);
                if m.key_size == 8 {
                    k[..4].copy_from_slice(vip);
                }
                let mut v = vec![0u8; m.value_size as usize];
                v[..4].copy_from_slice(vip);
                v[4..6].copy_from_slice(&port.to_be_bytes());
                put(&k, &v)?;
            }
        }
        "cilium_node_map_v2" | "cilium_node_map" | "cilium_tunnel_map" => {
            for (i, ip) in facts.node_ips.iter().enumerate() {
                let mut k = vec![0u8; m.key_size as usize];
                k[..4].copy_from_slice(ip);
                k[16] = 1;
                put(&k, &key_from(i as u32 + 1, m.value_size))?;
            }
        }
        "cilium_ct4_global"
        | "cilium_ct_any4_global"
        | "cilium_snat_v4_external"
        | "cilium_ct6_global" => {
            // conntrack tuples: daddr, saddr, dport, sport, nexthdr, flags
            let count = if m.name == "cilium_ct4_global" {
                ct_fill
            } else {
                (ct_fill / 4).max(8)
            };
            for i in 0..count.min(m.max_entries) {
                let mut k = vec![0u8; m.key_size as usize];
                k[..4]
                    .copy_from_slice(&facts.vips.first().map(|v| v.0).unwrap_or([203, 0, 113, 1]));
                k[4..8].copy_from_slice(&[10, 0, (i >> 16) as u8, (i >> 8) as u8]);
                k[8..10].copy_from_slice(&80u16.to_be_bytes());
                k[10..12].copy_from_slice(&(i as u16).to_be_bytes());
                k[12] = 6;
                put(&k, &val)?;
            }
        }
        "cilium_runtime_config" => {
            put(&0u32.to_ne_bytes(), &1u64.to_ne_bytes())?;
        }
        _ => {}
    }
    Ok(n)
}

/// Deletes up to `n` entries of a map (the `--lose-entries` fault); returns how many.
pub fn delete_some(fd: &OwnedFd, key_size: u32, n: u32) -> Result<u32> {
    let mut key = vec![0u8; key_size as usize];
    let mut deleted = 0;
    while deleted < n && sys::bpf::map_next_key(fd, None, &mut key)? {
        sys::bpf::map_delete(fd, &key)?;
        deleted += 1;
    }
    Ok(deleted)
}

/// Deletes every entry of a map (the `--flush-map` fault).
pub fn flush(fd: &OwnedFd, key_size: u32) -> Result<u32> {
    let mut key = vec![0u8; key_size as usize];
    let mut deleted = 0;
    // Deleting while walking restarts from the first key each time: maps are small in the lab
    // and bounded by their max_entries.
    while sys::bpf::map_next_key(fd, None, &mut key)? {
        sys::bpf::map_delete(fd, &key)?;
        deleted += 1;
    }
    Ok(deleted)
}
