//! Flux's kustomize-controller for the tests, built from its own module
//! (`github.com/fluxcd/kustomize-controller`) by the ordinary `go` command from the Go module
//! proxy, pinned and kept by version under the cache directory, outside the clone; with the
//! CRDs of its own module and of source-controller's (`config/crd/bases`, from the module
//! cache). Nothing upstream is committed.
//!
//! source-controller is not built: v1.9.6 requires `github.com/fluxcd/pkg/artifact` v0.18.3,
//! which the module proxy here refuses (403, "This module version is not available"); v1.10.1
//! requires Go 1.27, and with the Go 1.27.3 toolchain the proxy serves, its dependency
//! `github.com/fluxcd/pkg/http/transport` v0.9.0 is refused the same way. The tests play source-controller's part for a Git repository
//! through the `ExternalArtifact` source kustomize-controller takes (feature gate
//! `ExternalArtifact`), made from the repository the lab serves over Git's smart HTTP.
use crate::kube::{cache_root, go, run};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// The Flux controllers' release the tests run (both declare `go 1.26.0`).
pub const FLUX: &str = "v1.9.6";

/// The environment variable that gives the tests the Flux directory (`bin/`, `crds/`).
pub const FLUX_ENV: &str = "STEPGUARD_FLUX";

/// The controller built, its module path.
const KUSTOMIZE: &str = "github.com/fluxcd/kustomize-controller";

/// The modules whose `config/crd/bases` the tests apply.
const CRD_MODULES: [&str; 2] = [KUSTOMIZE, "github.com/fluxcd/source-controller"];

/// Where the Flux binaries and CRDs are kept.
pub fn dir() -> PathBuf {
    cache_root().join(format!("flux-{FLUX}"))
}

fn bin() -> PathBuf {
    dir().join("bin").join("kustomize-controller")
}

/// Whether the pinned kustomize-controller is there (its build info names its module at
/// [`FLUX`]) and the CRDs with it.
pub fn built() -> bool {
    let info = std::process::Command::new("go")
        .args(["version", "-m"])
        .arg(bin())
        .output();
    let pinned = info.is_ok_and(|o| {
        o.status.success()
            && String::from_utf8_lossy(&o.stdout).lines().any(|l| {
                l.split_whitespace().take(3).collect::<Vec<_>>()[..] == ["mod", KUSTOMIZE, FLUX]
            })
    });
    pinned
        && dir()
            .join("crds/kustomize.toolkit.fluxcd.io_kustomizations.yaml")
            .is_file()
}

/// `go mod download -json` of `module` at [`FLUX`] (downloaded when missing).
fn download(work: &Path, module: &str) -> Result<serde_json::Value> {
    let info = run(
        go().current_dir(work)
            .args(["mod", "download", "-json"])
            .arg(format!("{module}@{FLUX}")),
        &format!("download {module}"),
    )?;
    serde_json::from_str(&info).context("go mod download -json")
}

/// The replace lines of `module`'s go.mod at [`FLUX`] that name another module (its
/// `./api` replace is its own nested module, which the proxy serves as a module of its own).
fn replaces(work: &Path, module: &str) -> Result<Vec<String>> {
    let v = download(work, module)?;
    let gomod = v["GoMod"].as_str().context("no GoMod in go mod download")?;
    let edit = run(
        go().current_dir(work).args(["mod", "edit", "-json", gomod]),
        "read the controller's go.mod",
    )?;
    let m: serde_json::Value = serde_json::from_str(&edit).context("go mod edit -json")?;
    let at = |p: &serde_json::Value| match p["Version"].as_str() {
        Some(v) => format!("{}@{v}", p["Path"].as_str().unwrap_or_default()),
        None => p["Path"].as_str().unwrap_or_default().to_string(),
    };
    Ok(m["Replace"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| !r["New"]["Path"].as_str().unwrap_or(".").starts_with('.'))
        .map(|r| format!("{}={}", at(&r["Old"]), at(&r["New"])))
        .collect())
}

/// The module's directory in the module cache (downloaded when missing).
fn module_dir(work: &Path, module: &str) -> Result<PathBuf> {
    let v = download(work, module)?;
    Ok(PathBuf::from(
        v["Dir"].as_str().context("no Dir in go mod download")?,
    ))
}

/// Builds kustomize-controller and copies the CRDs when missing; returns the Flux directory.
pub fn ensure() -> Result<PathBuf> {
    let top = dir();
    if built() {
        return Ok(top);
    }
    // Its own throw-away module: the controllers' go.mod files pin their dependencies
    // differently, and each main module's replace lines apply only in the module built.
    let work = top.join("module-kustomize-controller");
    let crds = top.join("crds");
    for d in [&work, &top.join("bin"), &crds] {
        std::fs::create_dir_all(d).with_context(|| format!("create {}", d.display()))?;
    }
    std::fs::write(
        work.join("go.mod"),
        format!(
            "// Written by `cargo xtask flux` (stepguard): builds Flux's kustomize-controller {FLUX}\n\
             // from the Go module proxy. Not part of the project; safe to delete.\n\
             module stepguard.invalid/flux-kustomize-controller-build\n\ngo 1.26\n"
        ),
    )?;
    let _ = std::fs::remove_file(work.join("go.sum"));
    for r in replaces(&work, KUSTOMIZE)? {
        run(
            go().current_dir(&work)
                .args(["mod", "edit"])
                .arg(format!("-replace={r}")),
            "add the controller's replace line",
        )?;
    }
    let started = std::time::Instant::now();
    run(
        go().current_dir(&work)
            .arg("get")
            .arg(format!("{KUSTOMIZE}@{FLUX}")),
        "resolve kustomize-controller",
    )?;
    println!("flux: building kustomize-controller {FLUX}");
    run(
        go().current_dir(&work)
            .args(["build", "-trimpath", "-ldflags", "-s -w", "-o"])
            .arg(bin())
            .arg(KUSTOMIZE),
        "build kustomize-controller",
    )?;
    for m in CRD_MODULES {
        let bases = module_dir(&work, m)?.join("config/crd/bases");
        for f in std::fs::read_dir(&bases).with_context(|| format!("read {}", bases.display()))? {
            let f = f?.path();
            if f.extension().is_some_and(|e| e == "yaml") {
                let to = crds.join(f.file_name().expect("a file name"));
                std::fs::copy(&f, &to).with_context(|| format!("copy {}", f.display()))?;
                // The module cache's files are read-only; the copies need not be.
                let mut p = std::fs::metadata(&to)?.permissions();
                #[allow(clippy::permissions_set_readonly_false)]
                p.set_readonly(false);
                std::fs::set_permissions(&to, p)?;
            }
        }
    }
    if !built() {
        bail!(
            "kustomize-controller was built into {} but its build info does not name {KUSTOMIZE} {FLUX}",
            bin().display()
        );
    }
    println!(
        "flux: built kustomize-controller {FLUX} into {} in {:.0}s",
        bin().display(),
        started.elapsed().as_secs_f64()
    );
    Ok(top)
}
