//! A cilium-config directory laid out the way kubelet mounts a ConfigMap: the data lives in a
//! timestamped directory, `..data` is a symlink to it, and every key is a symlink `KEY ->
//! ..data/KEY`. A change writes a new timestamped directory and swaps `..data` atomically
//! (rename of a temporary symlink), exactly the sequence an agent watching the mount sees.
use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::symlink;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

/// Reads the current key/value pairs through the `..data` symlink.
pub fn read(dir: &Path) -> Result<BTreeMap<String, String>> {
    let data = dir.join("..data");
    let mut out = BTreeMap::new();
    for e in fs::read_dir(&data).with_context(|| format!("read {}", data.display()))? {
        let e = e?;
        let key = e.file_name().to_string_lossy().into_owned();
        let value =
            fs::read_to_string(e.path()).with_context(|| format!("read {}", e.path().display()))?;
        out.insert(key, value);
    }
    Ok(out)
}

/// Refuses keys a ConfigMap (or a CiliumNodeConfig) cannot have.
pub fn validate_keys<'a>(keys: impl IntoIterator<Item = &'a String>) -> Result<()> {
    for k in keys {
        if k.is_empty() || k.starts_with('.') || k.contains('/') {
            bail!("invalid ConfigMap key {k:?}");
        }
    }
    Ok(())
}

/// Writes `values` as the ConfigMap's new content, kubelet style.
pub fn write(dir: &Path, values: &BTreeMap<String, String>) -> Result<()> {
    validate_keys(values.keys())?;
    fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let ts_name = format!("..{}_{:09}", now.as_secs(), now.subsec_nanos());
    let ts_dir = dir.join(&ts_name);
    fs::create_dir(&ts_dir).with_context(|| format!("create {}", ts_dir.display()))?;
    for (k, v) in values {
        fs::write(ts_dir.join(k), v).with_context(|| format!("write key {k}"))?;
    }
    let old = fs::read_link(dir.join("..data")).ok();
    let tmp = dir.join("..data_tmp");
    let _ = fs::remove_file(&tmp);
    symlink(&ts_name, &tmp).context("create ..data_tmp symlink")?;
    fs::rename(&tmp, dir.join("..data")).context("swap ..data symlink")?;
    for k in values.keys() {
        let link = dir.join(k);
        if fs::symlink_metadata(&link).is_err() {
            symlink(Path::new("..data").join(k), &link).with_context(|| format!("link key {k}"))?;
        }
    }
    // Keys that disappeared: kubelet removes their symlinks.
    for e in fs::read_dir(dir)? {
        let name = e?.file_name().to_string_lossy().into_owned();
        if !name.starts_with("..") && !values.contains_key(&name) {
            let _ = fs::remove_file(dir.join(&name));
        }
    }
    if let Some(old) = old {
        if old != Path::new(&ts_name) {
            let _ = fs::remove_dir_all(dir.join(old));
        }
    }
    Ok(())
}

/// `KEY=VALUE` changes applied on top of the current content.
pub fn set(dir: &Path, changes: &[(String, String)]) -> Result<BTreeMap<String, String>> {
    let mut values = read(dir)?;
    for (k, v) in changes {
        values.insert(k.clone(), v.clone());
    }
    write(dir, &values)?;
    Ok(values)
}
