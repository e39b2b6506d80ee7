//! `cargo xtask`: set up a fresh machine, build (eBPF with Debian's rustc-web, userspace with
//! rustup's stable), test, run the demo, drive the lab, benchmark, build the image.
mod bench;
mod buildcache;
mod cilium;
mod cross;
mod demo;
mod flux;
mod helm;
mod image;
mod kube;
mod lanes;
mod layers;
mod setup;
mod testrun;

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
    /// Every test target of the workspace: unit and unprivileged integration tests, then the
    /// privileged integration tests against the lab (root), their targets in three lanes side
    /// by side and the host-wide-sensitive ones alone (`STEPGUARD_TEST_LANES=1`: one target at
    /// a time), each test one at a time. Builds go to the machine's build cache (see
    /// TESTING.md). Prints seconds per target and stage; fails when a test target did not run.
    Test {
        /// Only the unit tests (no root needed).
        #[arg(long)]
        unit: bool,
        /// Run only integration tests whose name contains this.
        #[arg(long)]
        filter: Option<String>,
        /// The real-agent cases beyond CI's budget: also build every Cilium
        /// release of `cargo xtask cilium` (1.19: about seven minutes more on a cold machine),
        /// run the `#[ignore]`d real-agent tests (faults, upgrades), and ten real restarts
        /// instead of two (`STEPGUARD_REAL_RESTARTS`, unless set).
        #[arg(long)]
        real_extended: bool,
    },
    /// The demo on a simulated node.
    Demo,
    /// Check that the imports of the agent, the kernel crate and the lab point only down their
    /// layers and the workspace's crates depend only on crates below them (also the first
    /// thing `test` does).
    Layers,
    /// Build the real Kubernetes control plane for the tests (kube-apiserver,
    /// kube-controller-manager, kube-scheduler, kubectl, etcd) from the Go module proxy, into
    /// a cache by version outside the clone (`$STEPGUARD_CACHE`, default /var/cache/stepguard);
    /// only what is missing. Prints the binaries' directory.
    Kube,
    /// Build Helm (`helm.sh/helm/v4`, pinned) from the Go module proxy into the same cache, for
    /// the tests that render Cilium's own chart; only when missing. Prints the binary's path.
    Helm,
    /// Build Flux's kustomize-controller (pinned) from the Go module proxy into the same cache,
    /// with the CRDs of its module and source-controller's, for the Flux test; only when
    /// missing. Prints the Flux directory.
    Flux,
    /// Build the real cilium-agent and cilium-cni (the pinned 1.20 and 1.19 releases, or the
    /// one named) from `github.com/cilium/cilium` on the Go module proxy into the same cache;
    /// only what is missing. Prints each release's binaries' directory and the agent's lib
    /// dir (the module's own directory, holding `bpf/`). `cargo xtask test` builds them too
    /// (in the background, after the control plane) for the real-agent tests.
    Cilium {
        /// One release only (e.g. 1.20).
        #[arg(long)]
        release: Option<String>,
    },
    /// Drive the lab (a simulated Cilium node): up | status | restart | config | down, or
    /// `real-node` (the real cilium-agent, in the foreground). See `cargo xtask lab --help`.
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
        /// Run only these parts (comma-separated: devmaps, daemon, witness, config, fleet); the
        /// report then has only them.
        #[arg(long, value_delimiter = ',', value_parser = ["devmaps", "daemon", "witness", "config", "fleet"])]
        only: Vec<String>,
        /// How many times each agent/reference pair is measured (the report gives each run and
        /// the median of their ratios).
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=9))]
        runs: u16,
    },
    /// Build the OCI image: one index with linux/amd64 and linux/arm64 (static binaries;
    /// arm64 with Debian's rustc-web), target/image/stepguard-VERSION.oci.tar.
    Image,
    /// The LAN witness for machines outside the cluster (a NAS, a Raspberry Pi): a static
    /// binary for linux/amd64 and linux/arm64 with its systemd unit and an example config,
    /// as target/dist/stepguard-witness-VERSION-linux-ARCH.tar.gz and SHA256SUMS.
    WitnessDist,
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

/// rustup's (and cargo install's) bin directory, where bpf-linker lives.
fn cargo_bin_dir() -> String {
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    std::env::var("CARGO_HOME")
        .map(|h| format!("{h}/bin"))
        .unwrap_or_else(|_| format!("{home}/.cargo/bin"))
}

/// Debian's cargo (cargo-web, with rustc-web), with nothing of the outer rustup cargo's
/// environment, bpf-linker's directory on its PATH.
pub fn debian_cargo() -> Result<Command> {
    for tool in ["/usr/bin/rustc", "/usr/bin/cargo"] {
        if !Path::new(tool).exists() {
            bail!("{tool} (Debian's rustc-web/cargo-web) is missing: run `cargo xtask setup` as root first");
        }
    }
    let cargo_bin = cargo_bin_dir();
    // Debian's tools first, then bpf-linker's directory; rustup's proxies must not shadow them.
    let path = format!(
        "/usr/bin:/bin:{cargo_bin}:{}",
        std::env::var("PATH").unwrap_or_default()
    );
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
    cmd.env("PATH", &path).env("RUSTC", "/usr/bin/rustc");
    Ok(cmd)
}

/// Builds the eBPF crates with Debian's compiler; objects land in target/ebpf/bpfel-unknown-none/release.
fn build_ebpf() -> Result<()> {
    let cargo_bin = cargo_bin_dir();
    if which("bpf-linker").is_none() && !Path::new(&cargo_bin).join("bpf-linker").exists() {
        bail!("bpf-linker is missing: run `cargo xtask setup` as root first");
    }
    let target_dir = buildcache::target_dir().join("ebpf");
    for krate in EBPF_CRATES {
        let mut cmd = debian_cargo()?;
        cmd.current_dir(root().join(krate))
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
    // A plain `cargo build`/`cargo test` in the clone (no `STEPGUARD_EBPF_DIR`) looks in the
    // clone's own target/ebpf: the objects are copied there when the build cache holds them.
    let local = root().join("target/ebpf/bpfel-unknown-none/release");
    let built = target_dir.join("bpfel-unknown-none/release");
    if built != local {
        let copy = || -> Result<()> {
            std::fs::create_dir_all(&local)?;
            for obj in ["agent-ebpf", "lab-ebpf"] {
                std::fs::copy(built.join(obj), local.join(obj))?;
            }
            Ok(())
        };
        if let Err(e) = copy() {
            eprintln!(
                "note: the eBPF objects could not be copied into {} ({e:#}): a plain cargo build there embeds the stub",
                local.display()
            );
        }
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

fn test(unit_only: bool, filter: Option<String>, real_extended: bool) -> Result<()> {
    let started = std::time::Instant::now();
    // Seconds, and before anything is built: imports point only down.
    layers::check(&root())?;
    let mut stages: Vec<(String, f64)> = Vec::new();
    let mut t = std::time::Instant::now();
    let mut lap = |name: &str, t: &mut std::time::Instant| {
        stages.push((name.to_string(), t.elapsed().as_secs_f64()));
        *t = std::time::Instant::now();
    };
    // Set-up is idempotent and takes seconds on a machine that has everything.
    setup::setup_with(false, false)?;
    // Chosen (and exported to every cargo below) before the Go builds' thread starts.
    buildcache::target_dir();
    lap("set-up (Debian packages, bpf-linker, tools)", &mut t);
    // The real control plane for the rollout tests (Go, from the module proxy; cached by
    // version) builds in the background, at a lower priority, while the workspace builds and
    // the unprivileged tests run: the Rust build leaves cores idle that the Go build fills.
    // Then the real cilium-agent releases the tests run, in the same background
    // thread: one Go build at a time.
    let kube_build = (!unit_only).then(|| {
        std::thread::spawn(move || -> Result<(PathBuf, Vec<(String, PathBuf)>)> {
            let kube = kube::ensure()?;
            let mut agents = Vec::new();
            for r in cilium::RELEASES
                .iter()
                .filter(|r| r.tested || real_extended)
            {
                let (bin, _) = cilium::ensure(r)?;
                agents.push((cilium::env_var(r), bin));
            }
            if real_extended {
                agents.push((cilium::CNI_PLUGINS_ENV.into(), cilium::cni_plugins()?));
            }
            // Helm and Cilium's own chart (of the newest tested release), for the tests that
            // render it.
            agents.push((helm::HELM_ENV.into(), helm::ensure()?));
            if let Some(r) = cilium::RELEASES.iter().find(|r| r.tested) {
                agents.push((helm::CHART_ENV.into(), helm::cilium_chart(r)?));
            }
            // Flux's kustomize-controller, for the extended Flux test.
            if real_extended {
                agents.push((flux::FLUX_ENV.into(), flux::ensure()?));
            }
            Ok((kube, agents))
        })
    });
    build(false)?;
    lap("the workspace's build (eBPF, debug)", &mut t);
    let packages = testrun::discover(&root())?;
    let all: Vec<testrun::Target> = packages
        .iter()
        .flat_map(|p| p.targets.iter().cloned())
        .collect();
    // What this run must account for: a filtered run only the privileged targets, a unit-only
    // run only the unprivileged ones, otherwise every target of the workspace.
    let expected = all.iter().filter(|t| match (&filter, unit_only) {
        (Some(_), _) => t.privileged,
        (None, true) => !t.privileged,
        (None, false) => true,
    });
    let mut ledger = testrun::Ledger::new(expected.cloned());
    ledger.stages = stages;
    let mut failed = Vec::new();
    if filter.is_none() {
        let t = std::time::Instant::now();
        let stage = testrun::Stage {
            title: "tests without root",
            envs: vec![],
            test_args: vec![],
        };
        for p in &packages {
            let plain: Vec<&testrun::Target> = p
                .targets
                .iter()
                .filter(|t| !t.privileged && t.kind != testrun::Kind::Doc)
                .collect();
            if !testrun::run_targets(&root(), p, &plain, &stage, &mut ledger)? {
                failed.push(p.name.clone());
            }
            let doc: Vec<&testrun::Target> = p
                .targets
                .iter()
                .filter(|t| t.kind == testrun::Kind::Doc)
                .collect();
            if !testrun::run_targets(&root(), p, &doc, &stage, &mut ledger)? {
                failed.push(format!("{} (doc tests)", p.name));
            }
        }
        ledger.stage("tests without root (their builds included)", t);
    }
    if !unit_only {
        if !is_root() {
            bail!("the integration tests need root (network namespaces, bpffs, eBPF): run `sudo -E cargo xtask test` — they are never skipped");
        }
        println!("== the OCI image (static binaries for amd64 and arm64, FROM scratch, buildah)");
        let t = std::time::Instant::now();
        let archive = image::image()?;
        ledger.stage("the OCI image (static amd64 and arm64 builds)", t);
        if filter.is_none() {
            let t = std::time::Instant::now();
            println!(
                "== the witness distribution; the arm64 binary and its unit tests under qemu-user"
            );
            if let Err(e) = cross::witness_dist().and_then(|d| cross::qemu_test_dist(&d)) {
                eprintln!("{e:#}");
                failed.push("the witness distribution, or arm64 under qemu-user".to_string());
            }
            ledger.stage("the witness distribution; arm64 unit tests under qemu", t);
        }
        let waited = std::time::Instant::now();
        let (kube_bin, agents) = kube_build
            .expect("started unless unit-only")
            .join()
            .map_err(|_| anyhow::anyhow!("the control plane's build panicked"))??;
        println!(
            "== the control plane (Kubernetes {}, etcd {}) in {} and cilium-agent {}; waited {:.0}s for them",
            kube::KUBERNETES,
            kube::ETCD,
            kube_bin.display(),
            cilium::RELEASES
                .iter()
                .filter(|r| r.tested || real_extended)
                .map(|r| r.version)
                .collect::<Vec<_>>()
                .join(", "),
            waited.elapsed().as_secs_f64()
        );
        ledger.stage(
            "waiting for the Go builds (control plane, cilium-agent)",
            waited,
        );
        let bin = buildcache::target_dir().join("debug");
        let mut test_args = vec!["--test-threads=1".to_string()];
        if real_extended {
            test_args.push("--include-ignored".into());
        }
        // Real restarts: two (a SIGTERM, a SIGKILL) in the default run, ten with the flag.
        let restarts = std::env::var("STEPGUARD_REAL_RESTARTS")
            .unwrap_or_else(|_| if real_extended { "10" } else { "2" }.into());
        if let Some(f) = &filter {
            test_args.push(f.clone());
        }
        let stage = testrun::Stage {
            title: "privileged tests against the lab",
            envs: vec![
                ("STEPGUARD_BIN".into(), bin.join("stepguard")),
                ("STEPGUARD_LAB_BIN".into(), bin.join("stepguard-lab")),
                ("STEPGUARD_IMAGE".into(), archive),
                ("STEPGUARD_KUBE_BIN".into(), kube_bin.clone()),
                ("STEPGUARD_REAL_RESTARTS".into(), PathBuf::from(restarts)),
            ]
            .into_iter()
            .chain(agents)
            .collect(),
            test_args,
        };
        let t = std::time::Instant::now();
        for p in &packages {
            let privileged: Vec<&testrun::Target> =
                p.targets.iter().filter(|t| t.privileged).collect();
            if !lanes::run(&root(), p, &privileged, &stage, &mut ledger)? {
                failed.push(format!("{} (privileged)", p.name));
            }
        }
        ledger.stage(
            "privileged tests against the lab (their builds included)",
            t,
        );
    }
    print!("{}", ledger.table());
    println!(
        "== the whole run took {:.1} min",
        started.elapsed().as_secs_f64() / 60.0
    );
    let problems = if filter.is_some() {
        // A filtered run proves only what it selected: failures count, absent targets do not.
        ledger
            .problems()
            .into_iter()
            .filter(|p| !p.ends_with("did not run") && !p.contains("ran no test"))
            .collect()
    } else {
        ledger.problems()
    };
    if !failed.is_empty() || !problems.is_empty() {
        bail!(
            "tests failed or did not run:\n  {}",
            failed
                .iter()
                .map(|f| format!("{f}: failed"))
                .chain(problems)
                .collect::<Vec<_>>()
                .join("\n  ")
        );
    }
    if filter.is_some() {
        println!("(a filtered run: not every target ran)");
    }
    let passed: u64 = ledger.rows.values().flatten().map(|o| o.passed).sum();
    println!("total: {passed} passed, 0 failed");
    Ok(())
}

fn lab(args: Vec<String>) -> Result<()> {
    build(false)?;
    let mut cmd = Command::new(buildcache::target_dir().join("debug/stepguard-lab"));
    if args.first().is_some_and(|a| a == "real-node") {
        // The real agent's node needs the control plane and the agent: built when missing.
        cmd.env("STEPGUARD_KUBE_BIN", kube::ensure()?);
        for r in cilium::RELEASES.iter().filter(|r| {
            r.tested
                || args
                    .iter()
                    .any(|a| r.version.contains(a.trim_start_matches('v')))
        }) {
            cmd.env(cilium::env_var(r), cilium::ensure(r)?.0);
        }
    }
    let status = cmd.args(&args).status().context("run stepguard-lab")?;
    std::process::exit(status.code().unwrap_or(1));
}

fn main() {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Setup { check } => setup::setup(check),
        Cmd::Build { release } => build(release),
        Cmd::Test {
            unit,
            filter,
            real_extended,
        } => test(unit, filter, real_extended),
        Cmd::Demo => demo(),
        Cmd::Layers => layers::check(&root()),
        Cmd::Kube => kube::ensure().map(|d| println!("{}", d.display())),
        Cmd::Helm => helm::ensure().map(|b| println!("{}", b.display())),
        Cmd::Flux => flux::ensure().map(|d| println!("{}", d.display())),
        Cmd::Cilium { release } => (|| {
            let releases: Vec<&cilium::Release> = match &release {
                Some(v) => vec![cilium::release(v)?],
                None => cilium::RELEASES.iter().collect(),
            };
            for r in releases {
                let (bin, lib) = cilium::ensure(r)?;
                println!("{} {} {}", r.version, bin.display(), lib.display());
            }
            Ok(())
        })(),
        Cmd::Lab { args } => lab(args),
        Cmd::Bench { quick, only, runs } => {
            if !is_root() {
                eprintln!("xtask: the benchmarks build labs: run as root");
                std::process::exit(1);
            }
            setup::setup_with(false, false)
                .and_then(|_| build(true))
                .and_then(|_| bench::bench(quick, &only, runs as usize))
        }
        Cmd::Image => build_ebpf().and_then(|_| image::image()).map(|_| ()),
        Cmd::WitnessDist => build_ebpf().and_then(|_| cross::witness_dist()).map(|_| ()),
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
    setup::setup_with(false, false)?;
    build(false)?;
    demo::demo()
}
