//! Cilium's pinned maps under `<bpffs>/tc/globals/`, each opened read-only (BPF_OBJ_GET with
//! BPF_F_RDONLY): type, sizes, entry count. Per-endpoint maps are only counted by name.
use super::bpf;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;

#[derive(Clone, Debug, Serialize)]
pub struct PinnedMap {
    pub name: String,
    #[serde(rename = "type")]
    pub map_type: &'static str,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
    /// None for arrays (every slot exists) or when counting failed.
    pub entries: Option<u64>,
    pub id: u32,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct MapsObservation {
    pub globals: BTreeMap<String, PinnedMap>,
    /// Per-endpoint/per-load maps by kind (`policy`, `calls`, `other`).
    pub endpoint_maps: BTreeMap<String, u64>,
    /// Maps that are pinned but could not be opened or read, with the reason.
    pub unreadable: BTreeMap<String, String>,
    pub permission_denied: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum BpffsError {
    #[error("{0} does not exist (is the bpffs mounted? set `bpffs` / --bpffs)")]
    Missing(String),
    #[error("{0} is not a bpf filesystem (mount -t bpf, or point --bpffs at Cilium's)")]
    NotBpffs(String),
    #[error("read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("the map observation task failed: {0}")]
    Task(String),
}

/// [`observe`] on a blocking thread: entry counts of big maps take many bpf(2) calls, and
/// must not hold up the async workers whose probe send times define the gaps.
pub async fn observe_blocking(bpffs: &Path, rules: Rules) -> Result<MapsObservation, BpffsError> {
    let path = bpffs.to_path_buf();
    tokio::task::spawn_blocking(move || observe(&path, rules))
        .await
        .unwrap_or_else(|e| Err(BpffsError::Task(e.to_string())))
}

/// Which global maps get their entries counted (the dominant cost on a big node: 500,000
/// conntrack entries take most of the maps check).
#[derive(Clone, Copy, Debug)]
pub enum Count {
    /// None.
    No,
    /// Those the function picks (the agent's steady loop and steps count only what a verdict
    /// judges by count: see `checks::maps::observe`).
    Only(fn(&str) -> bool),
    /// Every global map (a person's one-off `stepguard check`, `GET /v1/checks`).
    All,
}

impl Count {
    fn wants(self, name: &str) -> bool {
        match self {
            Count::No => false,
            Count::All => true,
            Count::Only(f) => f(name),
        }
    }
}

/// How the pins are read. Which names are Cilium's per-endpoint maps, and which maps a
/// verdict counts, are Cilium's rules (`profile`): the caller gives them, this layer only
/// reads the kernel.
#[derive(Clone, Copy, Debug)]
pub struct Rules {
    /// A per-endpoint (per-load) map's kind, or None for a global map.
    pub per_endpoint: fn(&str) -> Option<&'static str>,
    pub count: Count,
}

/// Visits up to `limit` entries (key, value) of the global map `name`, opened read-only.
pub fn read_entries(
    bpffs: &Path,
    name: &str,
    limit: usize,
    f: impl FnMut(&[u8], &[u8]),
) -> std::io::Result<u64> {
    let fd = bpf::obj_get_rdonly(&bpffs.join("tc/globals").join(name))?;
    let info = bpf::map_info(&fd)?;
    bpf::for_each_entry(&fd, &info, limit, f)
}

/// Reads every pin under `<bpffs>/tc/globals/`, counting entries as `rules.count` says.
pub fn observe(bpffs: &Path, rules: Rules) -> Result<MapsObservation, BpffsError> {
    if !bpffs.exists() {
        return Err(BpffsError::Missing(bpffs.display().to_string()));
    }
    if !bpf::is_bpffs(bpffs) {
        return Err(BpffsError::NotBpffs(bpffs.display().to_string()));
    }
    let dir = bpffs.join("tc/globals");
    let mut obs = MapsObservation::default();
    let rd = match std::fs::read_dir(&dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(obs),
        Err(source) => {
            return Err(BpffsError::Read {
                path: dir.display().to_string(),
                source,
            })
        }
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(kind) = (rules.per_endpoint)(&name) {
            *obs.endpoint_maps.entry(kind.to_string()).or_insert(0) += 1;
            continue;
        }
        let path = e.path();
        let fd = match bpf::obj_get_rdonly(&path) {
            Ok(fd) => fd,
            Err(err) => {
                if matches!(err.raw_os_error(), Some(libc::EPERM) | Some(libc::EACCES)) {
                    obs.permission_denied = true;
                }
                obs.unreadable
                    .insert(name, format!("open read-only: {err}"));
                continue;
            }
        };
        let info = match bpf::map_info(&fd) {
            Ok(i) => i,
            Err(err) => {
                obs.unreadable.insert(name, format!("map info: {err}"));
                continue;
            }
        };
        let entries = if rules.count.wants(&name) {
            match bpf::count_entries(&fd, &info) {
                Ok(n) => n,
                Err(err) => {
                    obs.unreadable
                        .insert(name.clone(), format!("count entries: {err}"));
                    None
                }
            }
        } else {
            None
        };
        obs.globals.insert(
            name.clone(),
            PinnedMap {
                name,
                map_type: bpf::map_type_name(info.map_type),
                key_size: info.key_size,
                value_size: info.value_size,
                max_entries: info.max_entries,
                entries,
                id: info.id,
            },
        );
    }
    Ok(obs)
}
