//! `cargo xtask`: set up a fresh machine, build (eBPF with Debian's rustc-web, userspace with
//! rustup's stable), test, run the demo, drive the lab, benchmark, build the image.
mod bench;
mod demo;
mod image;
mod setup;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(Parser)]
#[command(name = "cargo xtask", about = "stepguard's build, test and lab tasks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what the build and the tests need (Debian packages, bpf-linker); idempotent, needs root.
    Setup {
        /// Only report what is missing; install nothing.
        #[arg(long)]
        check: bool,
    },
    /// Build the eBPF objects (Debian rustc-web) and the userspace binaries (rustup stable).
    Build {
        /// Build the userspace in release mode.
        #[arg(long)]
        release: bool,
    },
    /// Unit tests, then the privileged integration tests against the lab, one at a time (root).
    Test {
        /// Only the unit tests (no root needed).
        #[arg(long)]
        unit: bool,
        /// Run only integration tests whose name contains this.
        #[arg(long)]
        filter: Option<String>,
    },
    /// The demo on a simulated node.
    Demo,
    /// Drive the lab (a simulated Cilium node): up | status | restart | config | down. See `cargo xtask lab --help`.
    #[command(disable_help_flag = true)]
    Lab {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Benchmarks (speed and memory targets), written to target/bench/report.md (root).
    Bench {
        /// Smaller sizes, for a quick look.
        #[arg(long)]
        quick: bool,
    },
    /// Build the OCI image.
    Image,
}

pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

/// Runs a command, streaming its output; fails naming it when it fails.
pub fn run(cmd: &mut Command) -> Result<()> {
    let shown = format!("{cmd:?}");
    let status = cmd.status().with_context(|| format!("start {shown}"))?;
    if !status.success() {
        bail!("{shown} failed ({status})");
    }
    Ok(())
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

const EBPF_CRATES: [&str; 2] = ["agent-ebpf", "tests/lab-ebpf"];

/// Builds the eBPF crates with Debian's compiler; objects land in target/ebpf/bpfel-unknown-none/release.
fn build_ebpf() -> Result<()> {
    for tool in ["/usr/bin/rustc", "/usr/bin/cargo"] {
        if !Path::new(tool).exists() {
            bail!("{tool} (Debian's rustc-web/cargo-web) is missing: run `cargo xtask setup` as root first");
        }
    }
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let cargo_bin = std::env::var("CARGO_HOME")
        .map(|h| format!("{h}/bin"))
        .unwrap_or_else(|_| format!("{home}/.cargo/bin"));
    if which("bpf-linker").is_none() && !Path::new(&cargo_bin).join("bpf-linker").exists() {
        bail!("bpf-linker is missing: run `cargo xtask setup` as root first");
    }
    // Debian's tools first, then bpf-linker's directory; rustup's proxies must not shadow them.
    let path = format!(
        "/usr/bin:/bin:{cargo_bin}:{}",
        std::env::var("PATH").unwrap_or_default()
    );
    let target_dir = root().join("target/ebpf");
    for krate in EBPF_CRATES {
        let mut cmd = Command::new("/usr/bin/cargo");
        // Drop what the outer (rustup) cargo exported, so the inner build is Debian's alone.
        for (k, _) in std::env::vars() {
            if k.starts_with("CARGO")
                || k.starts_with("RUSTUP")
                || k.starts_with("RUSTC")
                || k == "RUSTFLAGS"
                || k == "RUSTDOC"
            {
                cmd.env_remove(k);
            }
        }
        cmd.current_dir(root().join(krate))
            .env("PATH", &path)
            .env("RUSTC", "/usr/bin/rustc")
            .env("RUSTC_BOOTSTRAP", "1")
            .env("CARGO_TARGET_DIR", &target_dir)
            .env("RUSTFLAGS", "-C debuginfo=2 -C link-arg=--btf")
            .args([
                "build",
                "--quiet",
                "--release",
                "--target",
                "bpfel-unknown-none",
                "-Z",
                "build-std=core",
            ]);
        run(&mut cmd).with_context(|| format!("build eBPF crate {krate}"))?;
    }
    Ok(())
}

pub fn which(tool: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(tool))
            .find(|f| f.is_file())
    })
}

fn build(release: bool) -> Result<()> {
    build_ebpf()?;
    let mut cmd = cargo();
    cmd.current_dir(root())
        .args(["build", "--quiet", "--workspace", "--bins"]);
    if release {
        cmd.arg("--release");
    }
    run(&mut cmd)
}

pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn test(unit_only: bool, filter: Option<String>) -> Result<()> {
    // Set-up is idempotent and takes seconds on a machine that has everything.
    setup::setup(false)?;
    build(false)?;
    println!("== unit tests (no root needed)");
    run(cargo()
        .current_dir(root())
        .args(["test", "--workspace", "--lib", "--bins"]))?;
    if unit_only {
        return Ok(());
    }
    if !is_root() {
        bail!("the integration tests need root (network namespaces, bpffs, eBPF): run `sudo -E cargo xtask test` — they are never skipped");
    }
    println!("== the OCI image (static binary, FROM scratch, buildah)");
    let archive = image::image()?;
    println!("== privileged integration tests against the lab (one at a time)");
    let bin = root().join("target/debug");
    let mut cmd = cargo();
    cmd.current_dir(root())
        .env("STEPGUARD_BIN", bin.join("stepguard"))
        .env("STEPGUARD_LAB_BIN", bin.join("stepguard-lab"))
        .env("STEPGUARD_IMAGE", &archive)
        .args([
            "test",
            "-p",
            "stepguard-lab",
            "--tests",
            "--",
            "--test-threads=1",
        ]);
    if let Some(f) = filter {
        cmd.arg(f);
    }
    run(&mut cmd)
}

fn lab(args: Vec<String>) -> Result<()> {
    build(false)?;
    let status = Command::new(root().join("target/debug/stepguard-lab"))
        .args(&args)
        .status()
        .context("run stepguard-lab")?;
    std::process::exit(status.code().unwrap_or(1));
}

fn main() {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Setup { check } => setup::setup(check),
        Cmd::Build { release } => build(release),
        Cmd::Test { unit, filter } => test(unit, filter),
        Cmd::Demo => demo(),
        Cmd::Lab { args } => lab(args),
        Cmd::Bench { quick } => {
            if !is_root() {
                eprintln!("xtask: the benchmarks build labs: run as root");
                std::process::exit(1);
            }
            setup::setup(false)
                .and_then(|_| build(true))
                .and_then(|_| bench::bench(quick))
        }
        Cmd::Image => image::image().map(|_| ()),
    };
    if let Err(e) = r {
        eprintln!("xtask: {e:#}");
        std::process::exit(1);
    }
}

fn demo() -> Result<()> {
    if !is_root() {
        bail!("the demo needs root (it builds a simulated node in network namespaces): run `sudo -E cargo xtask demo`");
    }
    setup::setup(false)?;
    build(false)?;
    demo::demo()
}
