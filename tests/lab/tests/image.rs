//! The OCI image built by `cargo xtask image`: unpacked here without any container runtime,
//! its one layer holds only the static binary, and that binary runs inside the image's own
//! root (chroot): `--version`, `check --help`.
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
    let index: Value =
        serde_json::from_slice(&std::fs::read(dir.join("index.json")).unwrap()).unwrap();
    let manifest: Value = serde_json::from_slice(
        &std::fs::read(blob(
            &dir,
            index["manifests"][0]["digest"].as_str().unwrap(),
        ))
        .unwrap(),
    )
    .unwrap();
    let config: Value = serde_json::from_slice(
        &std::fs::read(blob(&dir, manifest["config"]["digest"].as_str().unwrap())).unwrap(),
    )
    .unwrap();
    assert_eq!(
        config["config"]["Entrypoint"],
        serde_json::json!(["/stepguard", "agent"])
    );
    assert_eq!(config["config"]["User"], "0");
    let layers = manifest["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 1, "FROM scratch plus one file: one layer");
    let root = dir.join("rootfs");
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
    let file = sh("file", &[&root.join("stepguard").to_string_lossy()]);
    assert!(file.contains("static"), "statically linked: {file}");
    // Inside the image's root there is nothing else: it must run on its own.
    let version = sh(
        "chroot",
        &[&root.to_string_lossy(), "/stepguard", "--version"],
    );
    assert!(version.starts_with("stepguard "), "{version}");
    let help = sh(
        "chroot",
        &[&root.to_string_lossy(), "/stepguard", "check", "--help"],
    );
    assert!(help.contains("--cilium-config"), "{help}");
    let _ = std::fs::remove_dir_all(&dir);
}
