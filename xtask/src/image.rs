//! `cargo xtask image`: a static `stepguard` (glibc, `+crt-static`) in an OCI image built
//! `FROM scratch` with Debian's buildah (vfs storage under target/image, nothing pulled),
//! saved as an OCI archive. No shell in the image; entrypoint `stepguard agent`.
use crate::{root, run};
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
    println!("image: static stepguard (x86_64-unknown-linux-gnu, +crt-static)");
    run(
        Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .current_dir(root())
            .env("RUSTFLAGS", "-C target-feature=+crt-static")
            .args([
                "build",
                "--quiet",
                "--profile",
                "image",
                "--target",
                "x86_64-unknown-linux-gnu",
                "-p",
                "stepguard",
                "--target-dir",
            ])
            .arg(root().join("target/static")),
    )?;
    let bin = root().join("target/static/x86_64-unknown-linux-gnu/image/stepguard");
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
    let _ = buildah(&["rmi", "--force", &name]);
    let ctr = buildah(&[
        "from",
        "--signature-policy",
        &policy.to_string_lossy(),
        "scratch",
    ])?;
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
        buildah(&[
            "commit",
            "--signature-policy",
            &policy.to_string_lossy(),
            &ctr,
            &name,
        ])?;
        let archive = archive_path();
        let _ = std::fs::remove_file(&archive);
        buildah(&[
            "push",
            "--signature-policy",
            &policy.to_string_lossy(),
            &name,
            &format!("oci-archive:{}:{name}", archive.display()),
        ])?;
        Ok(())
    })();
    let _ = buildah(&["rm", &ctr]);
    result?;
    println!("image: {}", archive_path().display());
    Ok(archive_path())
}
