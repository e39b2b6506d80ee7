//! Helm for the tests, built from its own module (`helm.sh/helm/v4`) by the ordinary `go`
//! command from the Go module proxy, pinned and kept by version under the cache directory,
//! outside the clone; and Cilium's own chart, `install/kubernetes/cilium` of the Cilium module
//! the tests already download. Nothing upstream is committed.
use crate::kube::{cache_root, go, run};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The Helm release the tests render with.
pub const HELM: &str = "v4.3.2";

/// The environment variable that gives the tests the `helm` binary.
pub const HELM_ENV: &str = "STEPGUARD_HELM";

/// The environment variable that gives the tests Cilium's chart (of the tested release).
pub const CHART_ENV: &str = "STEPGUARD_CILIUM_CHART";

/// Where `helm` is kept.
pub fn bin() -> PathBuf {
    cache_root()
        .join(format!("helm-{HELM}"))
        .join("bin")
        .join("helm")
}

/// Whether the pinned `helm` is there and says its version.
pub fn built() -> bool {
    Command::new(bin())
        .args(["version", "--short"])
        .output()
        .map(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).contains(HELM))
        .unwrap_or(false)
}

/// Builds `helm` when missing; returns its path.
pub fn ensure() -> Result<PathBuf> {
    let bin = bin();
    if built() {
        return Ok(bin);
    }
    let top = bin
        .parent()
        .and_then(Path::parent)
        .expect("bin has a grandparent")
        .to_path_buf();
    let work = top.join("module");
    for d in [&work, &top.join("bin")] {
        std::fs::create_dir_all(d).with_context(|| format!("create {}", d.display()))?;
    }
    std::fs::write(
        work.join("go.mod"),
        format!(
            "// Written by `cargo xtask setup` (stepguard): builds Helm {HELM} from the Go module\n\
             // proxy. Not part of the project; safe to delete.\n\
             module stepguard.invalid/helm-build\n\ngo 1.26\n"
        ),
    )?;
    let _ = std::fs::remove_file(work.join("go.sum"));
    let started = std::time::Instant::now();
    run(
        go().current_dir(&work)
            .arg("get")
            .arg(format!("helm.sh/helm/v4/cmd/helm@{HELM}")),
        "resolve helm",
    )?;
    println!("helm: building {HELM}");
    // The version Helm reports (`internal/version.version`), as its own release build sets it.
    let ldflags = format!("-s -w -X helm.sh/helm/v4/internal/version.version={HELM}");
    run(
        go().current_dir(&work)
            .args(["build", "-trimpath", "-ldflags", &ldflags, "-o"])
            .arg(&bin)
            .arg("helm.sh/helm/v4/cmd/helm"),
        "build helm",
    )?;
    if !built() {
        bail!(
            "helm was built into {} but does not report {HELM}",
            bin.display()
        );
    }
    println!(
        "helm: built {HELM} into {} in {:.0}s",
        bin.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(bin)
}

/// Cilium's chart in release `r`'s module (downloaded when missing).
pub fn cilium_chart(r: &crate::cilium::Release) -> Result<PathBuf> {
    let (module, _) = crate::cilium::module_dir(r)?;
    let chart = module.join("install/kubernetes/cilium");
    if !chart.join("Chart.yaml").exists() {
        bail!("{} has no Chart.yaml: not Cilium's chart", chart.display());
    }
    Ok(chart)
}
