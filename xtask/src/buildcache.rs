//! Where cargo builds: a target directory that survives a fresh clone on the same machine.
//!
//! Compiling the dependency graph (debug, the static amd64 and arm64 images, the eBPF objects)
//! is most of a cold run's build time and the same for every clone of one lockfile. As root,
//! the builds go to `<cache root>/cargo-target/<key>` (the cache root of the Go builds,
//! `$STEPGUARD_CACHE` or `/var/cache/stepguard`), the key hashing both toolchains (rustup's
//! and Debian's `rustc -vV`) and the lockfiles, so a toolchain or lockfile change starts clean;
//! directories of other keys are removed when no run holds them. Cargo itself decides what is
//! fresh: the workspace's own crates are rebuilt for a new clone (new paths and mtimes), the
//! dependencies are not.
//!
//! A run holds the directory's lock while it lives: a second run at the same time (another
//! clone) builds in its own `target/` instead, so one run never tests the other's binaries.
//! `CARGO_TARGET_DIR` set by the caller wins; `STEPGUARD_BUILD_CACHE=off` keeps the builds in
//! the clone's `target/`.
use crate::root;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The chosen directory, and the lock held on it for the life of this process.
static CHOSEN: OnceLock<(PathBuf, Option<std::fs::File>)> = OnceLock::new();

/// The cargo target directory of this run (chosen once; see the module's comment). Exported
/// as `CARGO_TARGET_DIR` (every cargo this run starts) and `STEPGUARD_EBPF_DIR` (where the
/// build scripts find the eBPF objects) the first time; call it before starting threads.
pub fn target_dir() -> PathBuf {
    CHOSEN
        .get_or_init(|| {
            let (dir, lock) = choose();
            // Before any other thread of this process runs (see the callers).
            unsafe {
                std::env::set_var("CARGO_TARGET_DIR", &dir);
                std::env::set_var("STEPGUARD_EBPF_DIR", dir.join("ebpf"));
            }
            (dir, lock)
        })
        .0
        .clone()
}

fn choose() -> (PathBuf, Option<std::fs::File>) {
    let clone = root().join("target");
    if let Some(d) = std::env::var_os("CARGO_TARGET_DIR") {
        return (PathBuf::from(d), None);
    }
    if std::env::var("STEPGUARD_BUILD_CACHE").is_ok_and(|v| v == "off" || v == "0") {
        return (clone, None);
    }
    if !crate::is_root() {
        return (clone, None);
    }
    let base = crate::kube::cache_root().join("cargo-target");
    let dir = base.join(key());
    if let Err(e) = std::fs::create_dir_all(&dir) {
        println!(
            "== build cache {} cannot be created ({e}): building in {}",
            dir.display(),
            clone.display()
        );
        return (clone, None);
    }
    match lock(&dir) {
        Some(l) => {
            prune(&base, &dir);
            println!("== build cache: {}", dir.display());
            (dir, Some(l))
        }
        None => {
            println!(
                "== build cache {} is in use by another run: building in {}",
                dir.display(),
                clone.display()
            );
            (clone, None)
        }
    }
}

/// The lock of a cache directory, when no other run holds it.
fn lock(dir: &Path) -> Option<std::fs::File> {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(".lock"))
        .ok()?;
    f.try_lock().ok().map(|_| f)
}

/// Removes the directories of other keys that no run holds (a toolchain or lockfile
/// changed: they will not be used again).
fn prune(base: &Path, keep: &Path) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p == keep || !p.is_dir() {
            continue;
        }
        if let Some(l) = lock(&p) {
            println!(
                "== build cache: removing {} (another toolchain or lockfile)",
                p.display()
            );
            let _ = std::fs::remove_dir_all(&p);
            drop(l);
        }
    }
}

/// A hash of both toolchains and the lockfiles.
fn key() -> String {
    let mut input = Vec::new();
    for rustc in [
        std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into()),
        "/usr/bin/rustc".into(),
    ] {
        if let Ok(o) = Command::new(&rustc).arg("-vV").output() {
            input.extend(o.stdout);
        }
    }
    for lock in [
        "Cargo.lock",
        "agent-ebpf/Cargo.lock",
        "tests/lab-ebpf/Cargo.lock",
    ] {
        input.extend(lock.as_bytes());
        input.extend(std::fs::read(root().join(lock)).unwrap_or_default());
    }
    let digest = Command::new("sha256sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .ok()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take()?.write_all(&input).ok()?;
            c.wait_with_output().ok()
        })
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .chars()
                .take(16)
                .collect::<String>()
        })
        .filter(|s| s.len() == 16)
        .unwrap_or_else(|| format!("len{}", input.len()));
    digest
}
