//! The OCI image built by `cargo xtask image`: unpacked here without any container runtime,
//! an index of linux/amd64 and linux/arm64 whose images' one layer holds only the static
//! binary, which runs inside the image's own root (chroot; arm64 under qemu-user):
//! `--version`, `check --help`.
mod common;
use common::*;
use serde_json::Value;
use std::path::{Path, PathBuf};

fn archive() -> PathBuf {
    let p = std::env::var_os("STEPGUARD_IMAGE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../target/image/stepguard-0.1.0.oci.tar")
        });
    assert!(
        p.exists(),
        "no image archive at {}: run `cargo xtask image` (cargo xtask test builds it)",
        p.display()
    );
    p
}

fn blob(dir: &Path, digest: &str) -> PathBuf {
    dir.join("blobs/sha256")
        .join(digest.trim_start_matches("sha256:"))
}

/// The platform manifests of the archive: its index.json lists them, or lists one image
/// index (a manifest list) that does.
fn platform_manifests(dir: &Path) -> Vec<(String, Value)> {
    let read = |digest: &str| -> Value {
        serde_json::from_slice(&std::fs::read(blob(dir, digest)).unwrap()).unwrap()
    };
    let index: Value =
        serde_json::from_slice(&std::fs::read(dir.join("index.json")).unwrap()).unwrap();
    let mut entries: Vec<Value> = index["manifests"].as_array().unwrap().clone();
    if entries.len() == 1 && entries[0]["mediaType"] == "application/vnd.oci.image.index.v1+json" {
        let nested = read(entries[0]["digest"].as_str().unwrap());
        entries = nested["manifests"].as_array().unwrap().clone();
    }
    entries
        .iter()
        .map(|e| {
            let platform = format!(
                "{}/{}",
                e["platform"]["os"].as_str().unwrap_or("?"),
                e["platform"]["architecture"].as_str().unwrap_or("?")
            );
            (platform, read(e["digest"].as_str().unwrap()))
        })
        .collect()
}

/// One index, two platforms: linux/amd64 and linux/arm64, each an image of its
/// own static binary for that CPU (`file` says which), nothing else in it. The amd64 binary
/// runs inside its image's root (chroot); the arm64 one under qemu-user.
#[test]
fn the_image_holds_only_a_static_stepguard_that_runs() {
    require_root();
    let dir = std::env::temp_dir().join(format!("sg-image-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    sh(
        "tar",
        &[
            "-xf",
            &archive().to_string_lossy(),
            "-C",
            &dir.to_string_lossy(),
        ],
    );
    let mut manifests = platform_manifests(&dir);
    manifests.sort_by(|a, b| a.0.cmp(&b.0));
    let platforms: Vec<&str> = manifests.iter().map(|m| m.0.as_str()).collect();
    assert_eq!(platforms, vec!["linux/amd64", "linux/arm64"], "the index");
    for (platform, manifest) in &manifests {
        let arch = platform.trim_start_matches("linux/");
        let config: Value = serde_json::from_slice(
            &std::fs::read(blob(&dir, manifest["config"]["digest"].as_str().unwrap())).unwrap(),
        )
        .unwrap();
        assert_eq!(config["architecture"], arch, "{platform}: {config}");
        assert_eq!(config["os"], "linux");
        assert_eq!(
            config["config"]["Entrypoint"],
            serde_json::json!(["/stepguard", "agent"])
        );
        assert_eq!(config["config"]["User"], "0");
        let layers = manifest["layers"].as_array().unwrap();
        assert_eq!(layers.len(), 1, "FROM scratch plus one file: one layer");
        let root = dir.join(format!("rootfs-{arch}"));
        std::fs::create_dir_all(&root).unwrap();
        sh(
            "tar",
            &[
                "-xf",
                &blob(&dir, layers[0]["digest"].as_str().unwrap()).to_string_lossy(),
                "-C",
                &root.to_string_lossy(),
            ],
        );
        let files: Vec<String> = std::fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            files,
            vec!["stepguard"],
            "nothing but the binary (no shell)"
        );
        let bin = root.join("stepguard");
        let file = sh("file", &[&bin.to_string_lossy()]);
        assert!(file.contains("static"), "statically linked: {file}");
        let cpu = if arch == "amd64" {
            "x86-64"
        } else {
            "ARM aarch64"
        };
        assert!(file.contains(cpu), "{platform}: {file}");
        let (version, help) = if arch == "amd64" {
            // Inside the image's root there is nothing else: it must run on its own.
            let r = root.to_string_lossy();
            (
                sh("chroot", &[&r, "/stepguard", "--version"]),
                sh("chroot", &[&r, "/stepguard", "check", "--help"]),
            )
        } else {
            let b = bin.to_string_lossy();
            (
                sh("qemu-aarch64-static", &[&b, "--version"]),
                sh("qemu-aarch64-static", &[&b, "check", "--help"]),
            )
        };
        assert!(version.starts_with("stepguard "), "{platform}: {version}");
        assert!(help.contains("--cilium-config"), "{platform}: {help}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
