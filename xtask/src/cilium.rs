//! The real cilium-agent, cilium-cni and cilium-dbg for the tests, built by the ordinary `go`
//! command from `github.com/cilium/cilium` on the Go module proxy, kept by version under the
//! cache directory outside the clone (like the control plane, `kube.rs`). Nothing upstream is
//! committed or copied: the agent's lib dir is the module's own directory in the module cache
//! (it holds `bpf/`, the datapath sources the agent compiles at every start).
//!
//! The local module copies the release's `replace` lines (read from its go.mod, never written
//! by hand) and adds, per release, a replacement for each dependency the proxy here does not
//! serve (`Release::unserved`, each with why it is safe). Link-time values as Cilium's
//! Makefile.defs sets them: `pkg/version.ciliumVersion` ("VERSION GITHASH DATE": three
//! fields, or `version.FromString` reads nothing), `-s -w`, the `osusergo` tag, CGO off.
//! Cilium 1.19 and 1.20 have no link-time datapath hash any more (`loader.DatapathSHA256` is
//! gone): the template hash is of the node configuration the agent writes
//! (`pkg/datapath/loader/hash.go`), and the template cache is cleared at every start
//! (`cache.go`, `UpdateDatapathHash`), so an upgraded agent cannot reuse an older datapath.
use crate::kube::{cache_root, go, run};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A Cilium release the tests run, and what its build needs beyond its own go.mod.
pub struct Release {
    pub version: &'static str,
    /// Whether `cargo xtask test` builds it (its tests run it). 1.19 is for the upgrade tests,
    /// which run with `--real-extended` (which builds it), else built on demand by `cargo xtask
    /// cilium`: each release adds 7-10 minutes to a cold run.
    pub tested: bool,
    /// `(module version, replacement)`: dependencies of the release the proxy here refuses,
    /// replaced by a served version (`path version`) or a go.mod-only stub (`./stub/NAME`).
    pub unserved: &'static [(&'static str, &'static str, &'static str)],
}

/// The users' release (the newest 1.20 served here) and the newest 1.19 served here.
pub const RELEASES: &[Release] = &[
    Release {
        version: "v1.20.2",
        tested: true,
        unserved: &[
            // 403 at the proxy; v4.7.0 is five commits later (d6dee83 is its ancestor) and
            // changes only unexported BFD functions.
            (
                "github.com/osrg/gobgp/v4 v4.6.1-0.20260630022313-d6dee8360046",
                "github.com/osrg/gobgp/v4 v4.7.0",
                "",
            ),
            // 404; neither the agent nor cilium-cni imports it (the operator does), and the
            // pseudo-version Cilium 1.19.7 uses has the symbols Cilium uses.
            (
                "sigs.k8s.io/mcs-api/controllers v0.5.2",
                "sigs.k8s.io/mcs-api/controllers v0.0.0-20260403094305-4b9911b73f14",
                "",
            ),
            // 404; imported only by a _test.go file of Cilium's.
            (
                "sigs.k8s.io/mcs-api/conformance v0.5.2",
                "./stub/mcs-api-conformance",
                "sigs.k8s.io/mcs-api/conformance",
            ),
        ],
    },
    Release {
        version: "v1.19.7",
        tested: false,
        unserved: &[],
    },
];

/// The release named `v` (`v1.20.2`, `1.20`, `1.20.2`).
pub fn release(v: &str) -> Result<&'static Release> {
    let want = v.trim_start_matches('v');
    RELEASES
        .iter()
        .find(|r| {
            let have = r.version.trim_start_matches('v');
            have == want || have.starts_with(&format!("{want}."))
        })
        .with_context(|| {
            format!(
                "no Cilium release {v:?} is pinned (one of {})",
                RELEASES
                    .iter()
                    .map(|r| r.version)
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
}

/// The environment variable that gives the tests a release's bin dir:
/// `STEPGUARD_CILIUM_1_20` for v1.20.x (`stepguard_lab::realnode::Release::from_env`).
pub fn env_var(r: &Release) -> String {
    let v = r.version.trim_start_matches('v');
    let minor: Vec<&str> = v.split('.').take(2).collect();
    format!("STEPGUARD_CILIUM_{}", minor.join("_"))
}

/// Where a release's binaries are kept.
pub fn bin_dir(r: &Release) -> PathBuf {
    cache_root()
        .join(format!("cilium-{}", r.version))
        .join("bin")
}

/// The release's module directory in the module cache (its `bpf/` is the agent's lib dir's),
/// downloaded when missing; with the release's date from the proxy.
pub fn module_dir(r: &Release) -> Result<(PathBuf, String)> {
    let work = cache_root()
        .join(format!("cilium-{}", r.version))
        .join("module");
    std::fs::create_dir_all(&work)?;
    if !work.join("go.mod").exists() {
        std::fs::write(
            work.join("go.mod"),
            "module stepguard.invalid/cilium-build\n\ngo 1.25\n",
        )?;
    }
    let info = run(
        go().current_dir(&work)
            .args(["mod", "download", "-json"])
            .arg(format!("github.com/cilium/cilium@{}", r.version)),
        "download github.com/cilium/cilium",
    )?;
    let v: serde_json::Value =
        serde_json::from_str(&info).context("parse `go mod download -json`")?;
    let dir = PathBuf::from(v["Dir"].as_str().context("no Dir from the module proxy")?);
    if !dir.join("bpf/bpf_host.c").exists() {
        bail!(
            "{} has no bpf/bpf_host.c: not a Cilium source tree",
            dir.display()
        );
    }
    let info_file = v["Info"].as_str().unwrap_or_default();
    let date = std::fs::read_to_string(info_file)
        .ok()
        .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
        .and_then(|i| i["Time"].as_str().map(String::from))
        .unwrap_or_else(|| "1970-01-01T00:00:00Z".into());
    Ok((dir, date))
}

/// Writes `version` and `libdir` beside the release's `bin/`: what the lab reads to run it
/// (`stepguard_lab::realnode::Release::at`).
fn describe(r: &Release, module: &Path) -> Result<()> {
    let dir = bin_dir(r);
    let top = dir.parent().expect("bin has a parent");
    std::fs::write(top.join("version"), format!("{}\n", r.version))?;
    std::fs::write(top.join("libdir"), format!("{}\n", module.display()))?;
    Ok(())
}

fn reports(bin: &Path, want: &str) -> bool {
    Command::new(bin)
        .arg("--version")
        .output()
        .map(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).contains(want))
        .unwrap_or(false)
}

/// What is built of a release: the agent, the CNI plugin, and `cilium-dbg` (its
/// `build-config` is the agent pod's init container, merging the ConfigMap with the
/// node's CiliumNodeConfigs).
const BINARIES: [(&str, &str); 3] = [
    ("github.com/cilium/cilium/daemon", "cilium-agent"),
    ("github.com/cilium/cilium/plugins/cilium-cni", "cilium-cni"),
    ("github.com/cilium/cilium/cilium-dbg", "cilium-dbg"),
];

/// Whether the release's binaries are there and the agent reports the release.
pub fn built(r: &Release) -> bool {
    let bin = bin_dir(r);
    reports(&bin.join("cilium-agent"), r.version.trim_start_matches('v'))
        && BINARIES.iter().all(|(_, name)| bin.join(name).exists())
}

/// Builds the release's cilium-agent, cilium-cni and cilium-dbg when missing; returns their directory and
/// the agent's lib dir (the module directory, holding `bpf/`).
pub fn ensure(r: &Release) -> Result<(PathBuf, PathBuf)> {
    let bin = bin_dir(r);
    let (module, date) = module_dir(r)?;
    if built(r) {
        describe(r, &module)?;
        return Ok((bin, module));
    }
    let started = std::time::Instant::now();
    let work = bin.parent().expect("bin has a parent").join("module");
    std::fs::create_dir_all(&bin)?;
    let edit = run(
        go().current_dir(&work)
            .args(["mod", "edit", "-json"])
            .arg(module.join("go.mod")),
        "read cilium's go.mod",
    )?;
    let m: serde_json::Value = serde_json::from_str(&edit).context("parse `go mod edit -json`")?;
    let go_line = m["Go"].as_str().unwrap_or("1.25").to_string();
    let mut gomod = format!(
        "// Written by `cargo xtask cilium` (stepguard): builds Cilium {v} from the Go module\n\
         // proxy. Not part of the project; safe to delete.\n\
         module stepguard.invalid/cilium-build\n\ngo {go_line}\n\nrequire github.com/cilium/cilium {v}\n\n\
         // The release's own replace lines.\n",
        v = r.version
    );
    for x in m["Replace"].as_array().into_iter().flatten() {
        let (old, new) = (&x["Old"], &x["New"]);
        let side = |s: &serde_json::Value| {
            let p = s["Path"].as_str().unwrap_or_default();
            match s["Version"].as_str() {
                Some(v) => format!("{p} {v}"),
                None => p.to_string(),
            }
        };
        if new["Path"].as_str().is_some_and(|p| p.starts_with('.')) {
            bail!(
                "cilium {}'s go.mod replaces {} with a local path: the recipe no longer applies",
                r.version,
                side(old)
            );
        }
        gomod.push_str(&format!("replace {} => {}\n", side(old), side(new)));
    }
    if !r.unserved.is_empty() {
        gomod.push_str(
            "\n// Dependencies the module proxy here does not serve (see xtask/src/cilium.rs).\n",
        );
    }
    for (old, new, stub_module) in r.unserved {
        if let Some(dir) = new.strip_prefix("./") {
            let d = work.join(dir);
            std::fs::create_dir_all(&d)?;
            std::fs::write(
                d.join("go.mod"),
                format!("module {stub_module}\n\ngo 1.23\n"),
            )?;
        }
        gomod.push_str(&format!("replace {old} => {new}\n"));
    }
    std::fs::write(work.join("go.mod"), gomod)?;
    let _ = std::fs::remove_file(work.join("go.sum"));
    let version = r.version.trim_start_matches('v');
    // "VERSION GITHASH DATE", as Makefile.defs's FULL_BUILD_VERSION: the module zip carries
    // no git revision, so the hash field says where the source came from.
    let ldflags = format!(
        "-s -w -X \"github.com/cilium/cilium/pkg/version.ciliumVersion={version} go-module-proxy {date}\""
    );
    // Binaries already built for this release stay (a cache that predates cilium-dbg).
    let current = reports(&bin.join("cilium-agent"), version);
    for (pkg, name) in BINARIES {
        if current && bin.join(name).exists() {
            continue;
        }
        println!("cilium: building {name} {version} (minutes on 2 cores)");
        run(
            go().current_dir(&work)
                .args([
                    "build",
                    "-trimpath",
                    "-tags",
                    "osusergo",
                    "-ldflags",
                    &ldflags,
                    "-o",
                ])
                .arg(bin.join(name))
                .arg(pkg),
            &format!("build {name} {version}"),
        )?;
    }
    if !built(r) {
        bail!(
            "cilium-agent was built into {} but does not report {version}",
            bin.display()
        );
    }
    describe(r, &module)?;
    println!(
        "cilium: built cilium-agent, cilium-cni and cilium-dbg {version} into {} in {:.0}s; lib dir {}",
        bin.display(),
        started.elapsed().as_secs_f64(),
        module.display()
    );
    Ok((bin, module))
}

/// The primary CNI plugins the real-agent chaining tests put before `cilium-cni`
/// (`github.com/containernetworking/plugins`: `ptp` and its IPAM, `host-local`), pinned.
pub const CNI_PLUGINS: &str = "v1.10.0";

/// The environment variable that gives the tests the CNI plugins' directory.
pub const CNI_PLUGINS_ENV: &str = "STEPGUARD_CNI_PLUGINS";

/// Builds `ptp` and `host-local` from their module by the ordinary `go` command into the
/// cache (a throw-away module beside them), when missing; their directory.
pub fn cni_plugins() -> Result<PathBuf> {
    let root = cache_root().join(format!("cni-plugins-{CNI_PLUGINS}"));
    let bin = root.join("bin");
    if ["ptp", "host-local"].iter().all(|p| bin.join(p).exists()) {
        return Ok(bin);
    }
    let work = root.join("work");
    std::fs::create_dir_all(&work)?;
    std::fs::write(
        work.join("go.mod"),
        "module stepguard.invalid/cni-plugins-build\n\ngo 1.25\n",
    )?;
    let module = "github.com/containernetworking/plugins";
    run(
        go().current_dir(&work)
            .arg("get")
            .arg(format!("{module}@{CNI_PLUGINS}")),
        "go get the CNI plugins",
    )?;
    run(
        go().current_dir(&work)
            .args(["build", "-o"])
            .arg(format!("{}/", bin.display()))
            .arg(format!("{module}/plugins/main/ptp"))
            .arg(format!("{module}/plugins/ipam/host-local")),
        "build ptp and host-local",
    )?;
    Ok(bin)
}
