//! Real Kubernetes control-plane binaries for the tests: kube-apiserver,
//! kube-controller-manager, kube-scheduler and kubectl from `k8s.io/kubernetes`, and etcd from
//! `go.etcd.io/etcd/server/v3`, built by the ordinary `go` command from the Go module proxy.
//! Nothing upstream is committed: a throw-away local module per version is written under the
//! cache directory, outside the clone, and the binaries are kept there by version; they are
//! built only when missing.
//!
//! `go install k8s.io/kubernetes/cmd/...@v` cannot work: k8s.io/kubernetes's go.mod requires
//! its staging modules (`k8s.io/api`, `k8s.io/client-go`, …) at `v0.0.0` and replaces them
//! with `./staging/src/…`, and replace lines only count in the main module. The local module
//! requires `k8s.io/kubernetes vX.Y.Z` and replaces each staging module with its published
//! `v0.Y.Z`; the list of staging modules is read from k8s.io/kubernetes's own go.mod at that
//! version (`go mod edit -json`), never written by hand, since it changes between minors.
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The Kubernetes release the tests run against.
pub const KUBERNETES: &str = "v1.37.2";
/// The etcd release (the server module; its siblings come at the same version).
pub const ETCD: &str = "v3.6.16";
/// The binaries built from `k8s.io/kubernetes/cmd/…`.
pub const KUBE_BINARIES: &[&str] = &[
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
];

/// Where built binaries are kept, by version: `$STEPGUARD_CACHE` or `/var/cache/stepguard`.
pub fn cache_root() -> PathBuf {
    std::env::var_os("STEPGUARD_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/stepguard"))
}

/// The directory holding the control plane's binaries of the pinned versions.
pub fn bin_dir() -> PathBuf {
    cache_root()
        .join(format!("kube-{KUBERNETES}-etcd-{ETCD}"))
        .join("bin")
}

/// `v1.37.2` → `v0.37.2` (the staging modules' published version of a release).
fn staging_version(v: &str) -> Result<String> {
    match v.strip_prefix("v1.") {
        Some(rest) if rest.split('.').count() == 2 => Ok(format!("v0.{rest}")),
        _ => bail!("unexpected Kubernetes version {v:?}: expected v1.MINOR.PATCH"),
    }
}

pub(crate) fn go() -> Command {
    // Below the Rust build's priority when they run side by side (`cargo xtask test`).
    let mut c = Command::new("nice");
    c.args(["-n", "10", "go"]);
    // The proxy, never a VCS; a module needing a newer Go fails rather than downloading one
    // unasked (TESTING.md, on `GOTOOLCHAIN`).
    c.env("GOFLAGS", "-mod=mod")
        .env("CGO_ENABLED", "0")
        .env("GOTOOLCHAIN", "local");
    c
}

pub(crate) fn run(c: &mut Command, what: &str) -> Result<String> {
    let out = c
        .output()
        .with_context(|| format!("{what}: cannot run go (is Go installed? `go version`)"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(15).collect();
        bail!(
            "{what} failed ({}):\n{}",
            out.status,
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The staging modules k8s.io/kubernetes at `version` replaces with `./staging/src/…`, read
/// from its own go.mod (downloaded from the proxy), with that go.mod's `go` line.
fn staging_modules(work: &Path, version: &str) -> Result<(Vec<String>, String)> {
    let info = run(
        go().current_dir(work)
            .args(["mod", "download", "-json"])
            .arg(format!("k8s.io/kubernetes@{version}")),
        "download k8s.io/kubernetes",
    )?;
    let v: serde_json::Value =
        serde_json::from_str(&info).context("parse `go mod download -json`")?;
    let gomod = v["GoMod"]
        .as_str()
        .context("`go mod download -json` gave no GoMod")?;
    let edit = run(
        go().current_dir(work).args(["mod", "edit", "-json", gomod]),
        "read k8s.io/kubernetes's go.mod",
    )?;
    let m: serde_json::Value = serde_json::from_str(&edit).context("parse `go mod edit -json`")?;
    let mut staging: Vec<String> = m["Replace"]
        .as_array()
        .map(|r| {
            r.iter()
                .filter(|x| {
                    x["New"]["Path"]
                        .as_str()
                        .is_some_and(|p| p.starts_with("./staging/src/"))
                })
                .filter_map(|x| x["Old"]["Path"].as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    staging.sort();
    if staging.is_empty() {
        bail!("k8s.io/kubernetes {version}'s go.mod replaces no staging module: the recipe no longer applies");
    }
    let go_line = m["Go"].as_str().unwrap_or("1.26").to_string();
    Ok((staging, go_line))
}

fn have(bin: &Path, version_arg: &[&str], want: &str) -> bool {
    Command::new(bin)
        .args(version_arg)
        .output()
        .map(|o| {
            o.status.success()
                && (String::from_utf8_lossy(&o.stdout).contains(want)
                    || String::from_utf8_lossy(&o.stderr).contains(want))
        })
        .unwrap_or(false)
}

/// Whether every binary of the pinned versions is there and reports its version.
pub fn built() -> bool {
    let bin = bin_dir();
    KUBE_BINARIES.iter().all(|b| {
        have(&bin.join(b), &["--version"], KUBERNETES)
            || have(&bin.join(b), &["version", "--client"], KUBERNETES)
    }) && have(
        &bin.join("etcd"),
        &["--version"],
        ETCD.trim_start_matches('v'),
    )
}

/// Builds whatever of the control plane is missing; returns the binaries' directory.
pub fn ensure() -> Result<PathBuf> {
    let bin = bin_dir();
    if built() {
        return Ok(bin);
    }
    let root = bin.parent().expect("bin has a parent").to_path_buf();
    std::fs::create_dir_all(&bin).with_context(|| format!("create {}", bin.display()))?;
    let started = std::time::Instant::now();
    let kube_ok = KUBE_BINARIES.iter().all(|b| {
        have(&bin.join(b), &["--version"], KUBERNETES)
            || have(&bin.join(b), &["version", "--client"], KUBERNETES)
    });
    if !kube_ok {
        build_kubernetes(&root.join("kubernetes-module"), &bin)?;
    }
    if !have(
        &bin.join("etcd"),
        &["--version"],
        ETCD.trim_start_matches('v'),
    ) {
        build_etcd(&root.join("etcd-module"), &bin)?;
    }
    if !built() {
        bail!(
            "the control plane was built into {} but does not report {KUBERNETES} / etcd {ETCD}",
            bin.display()
        );
    }
    println!(
        "kube: built Kubernetes {KUBERNETES} and etcd {ETCD} into {} in {:.0}s",
        bin.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(bin)
}

fn build_kubernetes(work: &Path, bin: &Path) -> Result<()> {
    std::fs::create_dir_all(work)?;
    let staging_v = staging_version(KUBERNETES)?;
    // A go.mod of our own to read theirs (`go mod download` needs a module context).
    std::fs::write(
        work.join("go.mod"),
        "module stepguard.invalid/kube-build\n\ngo 1.26\n",
    )?;
    let (staging, go_line) = staging_modules(work, KUBERNETES)?;
    let mut gomod = format!(
        "// Written by `cargo xtask setup` (stepguard): builds Kubernetes {KUBERNETES} from the\n\
         // Go module proxy. Not part of the project; safe to delete.\n\
         module stepguard.invalid/kube-build\n\ngo {go_line}\n\nrequire k8s.io/kubernetes {KUBERNETES}\n\n"
    );
    for m in &staging {
        gomod.push_str(&format!("replace {m} => {m} {staging_v}\n"));
    }
    std::fs::write(work.join("go.mod"), gomod)?;
    let _ = std::fs::remove_file(work.join("go.sum"));
    let pkgs: Vec<String> = KUBE_BINARIES
        .iter()
        .map(|b| format!("k8s.io/kubernetes/cmd/{b}"))
        .collect();
    println!(
        "kube: resolving k8s.io/kubernetes {KUBERNETES} ({} staging modules at {staging_v})",
        staging.len()
    );
    run(
        go().current_dir(work).arg("get").args(&pkgs),
        "resolve k8s.io/kubernetes's commands",
    )?;
    let minor = KUBERNETES
        .trim_start_matches("v1.")
        .split('.')
        .next()
        .unwrap_or("0");
    let pkg = "k8s.io/component-base/version";
    let ldflags = format!(
        "-s -w -X {pkg}.gitVersion={KUBERNETES} -X {pkg}.gitMajor=1 -X {pkg}.gitMinor={minor} \
         -X {pkg}.gitTreeState=clean -X {pkg}.buildDate=1970-01-01T00:00:00Z"
    );
    println!(
        "kube: building {} (tens of minutes cold on 2 cores)",
        KUBE_BINARIES.join(", ")
    );
    run(
        go().current_dir(work)
            .args(["build", "-trimpath", "-ldflags", &ldflags, "-o"])
            .arg(bin)
            .args(&pkgs),
        "build the Kubernetes control plane",
    )?;
    Ok(())
}

fn build_etcd(work: &Path, bin: &Path) -> Result<()> {
    std::fs::create_dir_all(work)?;
    std::fs::write(
        work.join("go.mod"),
        format!(
            "// Written by `cargo xtask setup` (stepguard): builds etcd {ETCD} from the Go module\n\
             // proxy. Not part of the project; safe to delete.\n\
             module stepguard.invalid/etcd-build\n\ngo 1.26\n\nrequire go.etcd.io/etcd/server/v3 {ETCD}\n"
        ),
    )?;
    let _ = std::fs::remove_file(work.join("go.sum"));
    run(
        go().current_dir(work)
            .arg("get")
            .arg(format!("go.etcd.io/etcd/server/v3@{ETCD}")),
        "resolve etcd",
    )?;
    println!("kube: building etcd {ETCD}");
    run(
        go().current_dir(work)
            .args(["build", "-trimpath", "-ldflags", "-s -w", "-o"])
            .arg(bin.join("etcd"))
            .arg("go.etcd.io/etcd/server/v3"),
        "build etcd",
    )?;
    Ok(())
}
