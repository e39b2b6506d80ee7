//! Files under the state directory written so that a crash, a power loss or a planted link
//! cannot leave or make anything but the old record or the new one: written to a temporary
//! file created anew (never through a link another process left there), fsynced, renamed
//! into place, the directory fsynced.
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Writes `bytes` to `path` through the temporary file `tmp` (in the same directory). A file
/// or link already at `tmp` (a write that did not finish, or a planted symlink) is removed,
/// never followed; on failure the temporary file is removed and `path` is as it was.
pub fn write(tmp: &Path, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let _ = std::fs::remove_file(tmp);
    let r = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(tmp, path)?;
        let dir = path.parent().unwrap_or(Path::new("."));
        std::fs::File::open(dir)?.sync_all()
    })();
    if r.is_err() {
        let _ = std::fs::remove_file(tmp);
    }
    r
}

#[cfg(test)]
mod tests {
    /// A symlink planted at the temporary path is removed, not written through: its target
    /// keeps its content, and the record lands at its own path.
    #[test]
    fn a_planted_link_is_never_followed() {
        let dir = std::env::temp_dir().join(format!("sg-durable-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let victim = dir.join("victim");
        std::fs::write(&victim, b"keep me").unwrap();
        let (tmp, path) = (dir.join(".rec.json.tmp"), dir.join("rec.json"));
        std::os::unix::fs::symlink(&victim, &tmp).unwrap();
        super::write(&tmp, &path, b"{}").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep me");
        assert_eq!(std::fs::read(&path).unwrap(), b"{}");
        assert!(!tmp.exists());
        let _ = std::fs::remove_dir_all(dir);
    }
}
