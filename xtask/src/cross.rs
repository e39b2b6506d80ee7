//! stepguard beyond amd64: static binaries for linux/amd64 and linux/arm64, the witness
//! distribution (`cargo xtask witness-dist`), and the arm64 binary and its unit tests run
//! under qemu-user (`cargo xtask test`).
//!
//! amd64 builds with rustup's stable toolchain. rustup cannot fetch other targets here, so
//! arm64 builds with Debian's rustc-web and its arm64 standard library (multiarch,
//! `libstd-rust-web-dev:arm64`), linked by `aarch64-linux-gnu-gcc` against Debian's static
//! arm64 glibc (`libc6-dev-arm64-cross`). The eBPF object the agent embeds is the same for
//! both: BPF bytecode, little-endian like both CPUs.
use crate::{debian_cargo, root, run};
use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::process::Command;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Amd64,
    Arm64,
}

pub const ARCHES: [Arch; 2] = [Arch::Amd64, Arch::Arm64];

impl Arch {
    /// The OCI (and Debian) name.
    pub fn oci(self) -> &'static str {
        match self {
            Arch::Amd64 => "amd64",
            Arch::Arm64 => "arm64",
        }
    }
    pub fn triple(self) -> &'static str {
        match self {
            Arch::Amd64 => "x86_64-unknown-linux-gnu",
            Arch::Arm64 => "aarch64-unknown-linux-gnu",
        }
    }
    fn target_dir(self) -> PathBuf {
        match self {
            Arch::Amd64 => crate::buildcache::target_dir().join("static"),
            Arch::Arm64 => crate::buildcache::target_dir().join("cross"),
        }
    }

    /// The cargo that builds for this architecture, with the flags of a static binary.
    fn cargo(self) -> Result<Command> {
        let mut c = match self {
            Arch::Amd64 => Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())),
            Arch::Arm64 => {
                if crate::which("aarch64-linux-gnu-gcc").is_none() {
                    bail!("aarch64-linux-gnu-gcc is missing: run `cargo xtask setup` as root (Debian's cross toolchain for arm64)");
                }
                let mut c = debian_cargo()?;
                c.env(
                    "CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER",
                    "aarch64-linux-gnu-gcc",
                )
                .env("CC_aarch64_unknown_linux_gnu", "aarch64-linux-gnu-gcc")
                .env("AR_aarch64_unknown_linux_gnu", "aarch64-linux-gnu-ar")
                // The unit tests' runner (`cargo test` for this target).
                .env(
                    "CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER",
                    "qemu-aarch64-static",
                );
                c
            }
        };
        c.current_dir(root())
            .env("RUSTFLAGS", "-C target-feature=+crt-static")
            .arg("--quiet");
        Ok(c)
    }
}

/// Builds the static `stepguard` for `arch` (profile `image`); returns its path.
pub fn static_stepguard(arch: Arch) -> Result<PathBuf> {
    println!(
        "static stepguard for linux/{} ({})",
        arch.oci(),
        arch.triple()
    );
    let mut c = arch.cargo()?;
    // `--quiet` goes before the subcommand's own arguments: cargo's global flag.
    c.args(["build", "--profile", "image", "--target", arch.triple()])
        .args(["-p", "stepguard", "--target-dir"])
        .arg(arch.target_dir());
    run(&mut c).with_context(|| format!("build stepguard for {}", arch.triple()))?;
    let bin = arch
        .target_dir()
        .join(arch.triple())
        .join("image/stepguard");
    if !bin.exists() {
        bail!(
            "the build reported success but {} is missing",
            bin.display()
        );
    }
    Ok(bin)
}

/// `cargo xtask witness-dist`: for each architecture, `target/dist/stepguard-witness-VERSION-
/// linux-ARCH.tar.gz` holding the static binary, the systemd unit and an example config, and
/// `SHA256SUMS` beside them. Returns the directory.
pub fn witness_dist() -> Result<PathBuf> {
    let version = env!("CARGO_PKG_VERSION");
    let dist = root().join("target/dist");
    std::fs::create_dir_all(&dist)?;
    let mut archives = Vec::new();
    for arch in ARCHES {
        let bin = static_stepguard(arch)?;
        let name = format!("stepguard-witness-{version}-linux-{}", arch.oci());
        let dir = dist.join(&name);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        std::fs::copy(&bin, dir.join("stepguard"))?;
        for f in ["stepguard-witness.service", "witness.example.yaml"] {
            std::fs::copy(root().join("deploy/witness").join(f), dir.join(f))
                .with_context(|| format!("copy deploy/witness/{f}"))?;
        }
        std::fs::write(
            dir.join("INSTALL"),
            format!(
                "stepguard witness {version}, linux/{arch} (static: no libraries needed).\n\
                 install -m 0755 stepguard /usr/local/bin/stepguard\n\
                 install -d -m 0755 /etc/stepguard && install -m 0644 witness.example.yaml /etc/stepguard/witness.yaml   # then edit it (the service's dynamic user reads it)\n\
                 install -m 0644 stepguard-witness.service /etc/systemd/system/   # the token (root only, 0600): see its comments\n\
                 systemctl daemon-reload && systemctl enable --now stepguard-witness\n",
                arch = arch.oci()
            ),
        )?;
        let tar = format!("{name}.tar.gz");
        run(Command::new("tar").current_dir(&dist).args([
            "--owner=0",
            "--group=0",
            "-czf",
            &tar,
            &name,
        ]))?;
        archives.push(tar);
    }
    let sums = Command::new("sha256sum")
        .current_dir(&dist)
        .args(&archives)
        .output()
        .context("sha256sum")?;
    if !sums.status.success() {
        bail!("sha256sum: {}", String::from_utf8_lossy(&sums.stderr));
    }
    std::fs::write(dist.join("SHA256SUMS"), &sums.stdout)?;
    for a in &archives {
        println!("witness-dist: {}", dist.join(a).display());
    }
    Ok(dist)
}

/// The arm64 witness tarball of `witness-dist` in `dist`: unpacked, it holds the binary, the
/// unit and the example config, and its binary passes [`qemu_test`].
pub fn qemu_test_dist(dist: &std::path::Path) -> Result<usize> {
    let name = format!(
        "stepguard-witness-{}-linux-{}",
        env!("CARGO_PKG_VERSION"),
        Arch::Arm64.oci()
    );
    let tmp = root().join("target/dist/unpacked");
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)?;
    run(Command::new("tar")
        .arg("-xzf")
        .arg(dist.join(format!("{name}.tar.gz")))
        .arg("-C")
        .arg(&tmp))?;
    for f in [
        "stepguard",
        "stepguard-witness.service",
        "witness.example.yaml",
        "INSTALL",
    ] {
        if !tmp.join(&name).join(f).exists() {
            bail!("{name}.tar.gz lacks {f}");
        }
    }
    qemu_test(&tmp.join(&name).join("stepguard"))
}

/// The arm64 binary under qemu-user: `--version` and `--help` answer, and the agent's unit
/// tests (the library's, as `cargo test` runs them on amd64) pass. Returns the number of
/// unit tests that passed.
pub fn qemu_test(bin: &std::path::Path) -> Result<usize> {
    if crate::which("qemu-aarch64-static").is_none() {
        bail!("qemu-aarch64-static is missing: run `cargo xtask setup` as root (Debian's qemu-user-static)");
    }
    for args in [
        &["--version"][..],
        &["--help"][..],
        &["witness", "--help"][..],
    ] {
        let out = Command::new("qemu-aarch64-static")
            .arg(bin)
            .args(args)
            .output()
            .context("run qemu-aarch64-static (Debian's qemu-user-static)")?;
        let text = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() || !text.contains("stepguard") {
            bail!(
                "the arm64 stepguard {} under qemu: {} {}{}",
                args.join(" "),
                out.status,
                text.trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
    }
    println!("arm64: stepguard --version, --help and witness --help answer under qemu-user");
    // The unit tests, built as the image's binary is (same profile and flags: its
    // dependencies are reused) and run by the target's runner, qemu-aarch64-static.
    let mut c = Arch::Arm64.cargo()?;
    c.args([
        "test",
        "--profile",
        "image",
        "--target",
        Arch::Arm64.triple(),
    ])
    .args(["-p", "stepguard", "--lib", "--target-dir"])
    .arg(Arch::Arm64.target_dir())
    .args(["--", "--test-threads=2"]);
    let out = c.output().context("cargo test for arm64")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary = stdout
        .lines()
        .rfind(|l| l.starts_with("test result:"))
        .unwrap_or("")
        .to_string();
    if !out.status.success() {
        let failures: Vec<&str> = stdout
            .lines()
            .filter(|l| l.ends_with("FAILED") || l.starts_with("---- "))
            .collect();
        bail!(
            "the arm64 unit tests under qemu-user failed: {summary}\n{}\n{}",
            failures.join("\n"),
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .rev()
                .take(30)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    let passed = summary
        .split_whitespace()
        .skip_while(|w| *w != "ok.")
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    if passed == 0 {
        bail!("the arm64 unit tests under qemu-user ran nothing: {summary:?}");
    }
    println!("arm64: {passed} unit tests passed under qemu-user ({summary})");
    Ok(passed)
}
