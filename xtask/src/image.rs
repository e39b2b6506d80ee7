//! `cargo xtask image`: a static `stepguard` (glibc, `+crt-static`) for linux/amd64 and
//! linux/arm64 (see `cross`), each in an image built `FROM scratch` with Debian's buildah
//! (vfs storage under target/image, nothing pulled), both under one OCI image index saved as
//! an OCI archive. No shell in the image; entrypoint `stepguard agent`.
use crate::cross::{self, Arch};
use crate::root;
use anyhow::{Context, Result};
use std::path::PathBuf;
use std::process::Command;

pub fn archive_path() -> PathBuf {
    root().join(format!(
        "target/image/stepguard-{}.oci.tar",
        env!("CARGO_PKG_VERSION")
    ))
}

pub fn image() -> Result<PathBuf> {
    let version = env!("CARGO_PKG_VERSION");
    let bins: Vec<(Arch, PathBuf)> = cross::ARCHES
        .iter()
        .map(|a| cross::static_stepguard(*a).map(|b| (*a, b)))
        .collect::<Result<_>>()?;
    let dir = root().join("target/image");
    std::fs::create_dir_all(&dir)?;
    let policy = dir.join("policy.json");
    // Nothing is pulled or verified: a scratch image from a local file.
    std::fs::write(
        &policy,
        r#"{"default":[{"type":"insecureAcceptAnything"}]}"#,
    )?;
    let storage = |c: &mut Command| {
        c.arg("--root")
            .arg(dir.join("storage"))
            .arg("--runroot")
            .arg(dir.join("run"))
            .args(["--storage-driver", "vfs"]);
    };
    let buildah = |args: &[&str]| -> Result<String> {
        let mut c = Command::new("buildah");
        storage(&mut c);
        c.args(args);
        let out = c
            .output()
            .context("run buildah (Debian package `buildah`; cargo xtask setup)")?;
        if !out.status.success() {
            anyhow::bail!(
                "buildah {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let name = format!("stepguard:{version}");
    let policy = policy.to_string_lossy().into_owned();
    let _ = buildah(&["manifest", "rm", &name]);
    let _ = buildah(&["rmi", "--force", &name]);
    buildah(&["manifest", "create", &name])?;
    for (arch, bin) in &bins {
        let image = format!("stepguard:{version}-{}", arch.oci());
        let _ = buildah(&["rmi", "--force", &image]);
        let ctr = buildah(&["from", "--signature-policy", &policy, "scratch"])?;
        let result = (|| -> Result<()> {
            buildah(&[
                "copy",
                "--chmod",
                "0755",
                &ctr,
                &bin.to_string_lossy(),
                "/stepguard",
            ])?;
            buildah(&[
                "config",
                "--os",
                "linux",
                "--arch",
                arch.oci(),
                "--entrypoint",
                r#"["/stepguard","agent"]"#,
                "--cmd",
                "",
                "--user",
                "0",
                "--port",
                "9969/tcp",
                "--label",
                "org.opencontainers.image.title=stepguard",
                "--label",
                &format!("org.opencontainers.image.version={version}"),
                "--label",
                "org.opencontainers.image.description=Verifies a node's Cilium datapath around cilium-agent restarts",
                &ctr,
            ])?;
            buildah(&["commit", "--signature-policy", &policy, &ctr, &image])?;
            buildah(&[
                "manifest",
                "add",
                "--os",
                "linux",
                "--arch",
                arch.oci(),
                &name,
                &format!("containers-storage:localhost/{image}"),
            ])?;
            Ok(())
        })();
        let _ = buildah(&["rm", &ctr]);
        result.with_context(|| format!("the linux/{} image", arch.oci()))?;
    }
    let archive = archive_path();
    let _ = std::fs::remove_file(&archive);
    buildah(&[
        "manifest",
        "push",
        "--all",
        "--format",
        "oci",
        "--signature-policy",
        &policy,
        &name,
        &format!("oci-archive:{}:{name}", archive.display()),
    ])?;
    println!("image: {}", archive_path().display());
    Ok(archive_path())
}
