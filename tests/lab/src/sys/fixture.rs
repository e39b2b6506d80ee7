//! What every kind of lab shares (a node lab, a LAN lab, a real-agent node, a real-agent
//! cluster): a state file in its run directory (`/run/stepguard-lab/<prefix>/`), written
//! whole or not at all, read back by prefix and listed; and a guard that takes the lab down
//! when dropped, also while a test panics.
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// Where every lab keeps its run directory, `<RUN_ROOT>/<prefix>/`.
pub const RUN_ROOT: &str = "/run/stepguard-lab";

/// A lab that can be taken down.
pub trait Fixture {
    /// What it is, for messages ("LAN lab").
    const KIND: &'static str;
    /// Its prefix (its namespaces' and run directory's name).
    fn prefix(&self) -> &str;
    /// Removes everything it made.
    fn down(&mut self) -> Result<()>;
}

/// Takes the lab down when dropped.
pub struct Guard<T: Fixture>(pub T);

impl<T: Fixture> Drop for Guard<T> {
    fn drop(&mut self) {
        if let Err(e) = self.0.down() {
            eprintln!("{} {}: down failed: {e:#}", T::KIND, self.0.prefix());
        }
    }
}

impl<T: Fixture> std::ops::Deref for Guard<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T: Fixture> std::ops::DerefMut for Guard<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

/// The state file `file` of lab `prefix`.
pub fn state_path(prefix: &str, file: &str) -> PathBuf {
    Path::new(RUN_ROOT).join(prefix).join(file)
}

/// Writes `state` to `path` whole: a temporary file beside it, then renamed over it.
pub fn save<S: serde::Serialize>(path: &Path, state: &S) -> Result<()> {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(state)?)
        .with_context(|| format!("write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("write {}", path.display()))
}

/// Reads the state file `file` of the `kind` named `prefix`.
pub fn read<S: serde::de::DeserializeOwned>(kind: &str, prefix: &str, file: &str) -> Result<S> {
    let path = state_path(prefix, file);
    let data = std::fs::read(&path)
        .with_context(|| format!("no {kind} {prefix:?} (read {})", path.display()))?;
    serde_json::from_slice(&data).with_context(|| format!("parse {}", path.display()))
}

/// The prefixes of every lab with a state file named `file`, sorted.
pub fn list(file: &str) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(RUN_ROOT)
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.path().join(file).exists())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// A lab prefix: 1-16 lowercase letters or digits (every kind of lab names its namespaces
/// and run directory after it).
pub fn validate_prefix(p: &str) -> Result<()> {
    if p.is_empty()
        || p.len() > 16
        || !p
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    {
        bail!("invalid lab prefix {p:?}: use 1-16 lowercase letters or digits");
    }
    Ok(())
}
