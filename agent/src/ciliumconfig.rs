//! Reading a mounted cilium-config ConfigMap directory (kubelet layout: `..data` symlink to a
//! timestamped directory, one file per key), and remembering what it held when, so a changed
//! key can be named later.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    /// When the content last changed (mtime of the `..data` symlink swap), unix seconds.
    pub changed_at: f64,
    /// The timestamped directory `..data` points at (kubelet's version marker).
    pub version: String,
    pub values: BTreeMap<String, String>,
}

fn unix(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The cilium-config directory could not be read.
#[derive(Debug, thiserror::Error)]
#[error("read cilium-config {path}: {source}")]
pub struct ReadError {
    pub path: String,
    #[source]
    pub source: std::io::Error,
}

/// Reads the ConfigMap as mounted now, naming the directory on error.
pub fn read_named(dir: &Path) -> Result<Snapshot, ReadError> {
    read(dir).map_err(|source| ReadError {
        path: dir.display().to_string(),
        source,
    })
}

/// Reads the ConfigMap as mounted now.
pub fn read(dir: &Path) -> std::io::Result<Snapshot> {
    let data = dir.join("..data");
    let (base, changed_at, version) = match std::fs::symlink_metadata(&data) {
        Ok(m) => {
            let target = std::fs::read_link(&data)?;
            (
                data.clone(),
                unix(m.modified()?),
                target.to_string_lossy().into_owned(),
            )
        }
        // Not kubelet-style: plain files; the newest file's mtime is the change time.
        Err(_) => (dir.to_path_buf(), 0.0, String::new()),
    };
    let mut values = BTreeMap::new();
    let mut newest = changed_at;
    for e in std::fs::read_dir(&base)? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') {
            continue;
        }
        let path = e.path();
        if !path.is_file() {
            continue;
        }
        if changed_at == 0.0 {
            newest = newest.max(
                std::fs::metadata(&path)
                    .and_then(|m| m.modified())
                    .map(unix)
                    .unwrap_or(0.0),
            );
        }
        values.insert(name, std::fs::read_to_string(&path)?.trim_end().to_string());
    }
    Ok(Snapshot {
        changed_at: newest,
        version,
        values,
    })
}

/// Keys whose values differ between two snapshots.
pub fn changed_keys(old: &BTreeMap<String, String>, new: &BTreeMap<String, String>) -> Vec<String> {
    old.keys()
        .chain(new.keys())
        .filter(|k| old.get(*k) != new.get(*k))
        .cloned()
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect()
}

/// FNV-1a, 64 bits: a stable name for stored content.
fn fnv1a(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, x| {
        (h ^ *x as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Snapshots remembered under `<state_dir>/cilium-config/`, one file per ConfigMap version.
pub struct SnapshotStore {
    dir: PathBuf,
}

impl SnapshotStore {
    pub fn new(state_dir: &Path) -> Self {
        Self {
            dir: state_dir.join("cilium-config"),
        }
    }

    pub fn remember(&self, s: &Snapshot) -> std::io::Result<()> {
        std::fs::create_dir_all(&self.dir)?;
        // The file name comes from nothing outside the state directory: a hash of what is
        // stored (a crafted `..data` target such as `../../etc/x` cannot name a path).
        let body = serde_json::json!({"changed_at": s.changed_at, "version": s.version, "values": s.values});
        let bytes = serde_json::to_vec(&body)?;
        let path = self.dir.join(format!("snap-{:016x}.json", fnv1a(&bytes)));
        if path.exists() {
            return Ok(());
        }
        let tmp = path.with_extension("tmp");
        crate::durable::write(&tmp, &path, &bytes)
    }

    /// Every value `key` had in a remembered snapshot (oldest first, deduplicated).
    pub fn history(&self, key: &str) -> Vec<String> {
        let mut snaps: Vec<Snapshot> = self.all();
        snaps.sort_by(|a, b| a.changed_at.total_cmp(&b.changed_at));
        let mut out: Vec<String> = Vec::new();
        for v in snaps.iter().filter_map(|s| s.values.get(key)) {
            if !out.contains(v) {
                out.push(v.clone());
            }
        }
        out
    }

    /// Since when the ConfigMap has declared `key` as `value` without a break: the earliest
    /// snapshot of the newest run holding it (unix seconds). None: no snapshot holds it now.
    pub fn declared_since(&self, key: &str, value: &str) -> Option<f64> {
        let mut snaps: Vec<Snapshot> = self.all();
        snaps.sort_by(|a, b| a.changed_at.total_cmp(&b.changed_at));
        let mut since = None;
        for s in &snaps {
            match s.values.get(key) {
                Some(v) if v == value => {
                    since.get_or_insert(s.changed_at);
                }
                _ => since = None,
            }
        }
        since
    }

    fn all(&self) -> Vec<Snapshot> {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return vec![];
        };
        rd.flatten()
            .filter_map(|e| std::fs::read(e.path()).ok())
            .filter_map(|t| serde_json::from_slice::<serde_json::Value>(&t).ok())
            .map(|v| Snapshot {
                changed_at: v["changed_at"].as_f64().unwrap_or(0.0),
                version: v["version"].as_str().unwrap_or("").into(),
                values: v["values"]
                    .as_object()
                    .map(|o| {
                        o.iter()
                            .map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_string()))
                            .collect()
                    })
                    .unwrap_or_default(),
            })
            .collect()
    }

    /// The newest remembered snapshot that was already in place at `t` (unix seconds).
    pub fn in_effect_at(&self, t: f64) -> Option<Snapshot> {
        let rd = std::fs::read_dir(&self.dir).ok()?;
        let mut best: Option<Snapshot> = None;
        for e in rd.flatten() {
            let Ok(text) = std::fs::read(e.path()) else {
                continue;
            };
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(&text) else {
                continue;
            };
            let changed_at = v["changed_at"].as_f64().unwrap_or(f64::MAX);
            if changed_at > t {
                continue;
            }
            let values = v["values"]
                .as_object()
                .map(|o| {
                    o.iter()
                        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_string()))
                        .collect()
                })
                .unwrap_or_default();
            let s = Snapshot {
                changed_at,
                version: v["version"].as_str().unwrap_or("").into(),
                values,
            };
            if best.as_ref().is_none_or(|b| b.changed_at < s.changed_at) {
                best = Some(s);
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `..data` symlink target crafted to climb out (`../../x`) used to name the snapshot
    /// file, writing outside the state directory; names are now a hash of the content.
    #[test]
    fn a_crafted_version_cannot_write_outside_the_state_dir() {
        // Its own directory: tests run in parallel in one process.
        let root = std::env::temp_dir().join(format!("sg-snap-crafted-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let state = root.join("state");
        let store = SnapshotStore::new(&state);
        let snap = Snapshot {
            changed_at: 1.0,
            version: "../../escaped".into(),
            values: [("devices".to_string(), "eth0".to_string())].into(),
        };
        store.remember(&snap).unwrap();
        assert!(!root.join("escaped.json").exists() && !root.join("escaped").exists());
        let files: Vec<_> = std::fs::read_dir(state.join("cilium-config"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(files.len(), 1, "{files:?}");
        assert!(files[0].starts_with("snap-") && files[0].ends_with(".json"));
        assert_eq!(store.in_effect_at(2.0).unwrap().values, snap.values);
        let _ = std::fs::remove_dir_all(&root);
    }
    #[test]
    fn changed_keys_lists_added_removed_and_modified() {
        let a: BTreeMap<String, String> = [("devices", "eth0"), ("x", "1")]
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        let b: BTreeMap<String, String> = [("devices", "eth+"), ("y", "2"), ("x", "1")]
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        assert_eq!(changed_keys(&a, &b), vec!["devices", "y"]);
    }

    #[test]
    fn snapshots_are_found_by_time() {
        let dir = std::env::temp_dir().join(format!("sg-snap-bytime-{}", std::process::id()));
        let store = SnapshotStore::new(&dir);
        let mk = |t: f64, v: &str| Snapshot {
            changed_at: t,
            version: format!("..v{t}"),
            values: [("devices".to_string(), v.to_string())].into(),
        };
        store.remember(&mk(100.0, "eth0")).unwrap();
        store.remember(&mk(200.0, "eth+")).unwrap();
        assert_eq!(store.in_effect_at(150.0).unwrap().values["devices"], "eth0");
        assert_eq!(store.in_effect_at(250.0).unwrap().values["devices"], "eth+");
        assert!(store.in_effect_at(50.0).is_none());
        let _ = std::fs::remove_dir_all(dir);
    }
}
