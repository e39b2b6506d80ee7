//! Embeds the lab's fake datapath object, built by `cargo xtask build` with Debian's rustc-web.
//!
//! Without it (`cargo check`, clippy, unit tests with rustup's toolchain alone) an empty stub
//! is embedded, and `Lab::up` stops with a one-line error naming `cargo xtask build`.
use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let root = manifest
        .parent()
        .and_then(|p| p.parent())
        .unwrap()
        .to_path_buf();
    // `cargo xtask` says where it built the eBPF objects (its build cache); else the
    // workspace's own target directory.
    println!("cargo:rerun-if-env-changed=STEPGUARD_EBPF_DIR");
    let obj = std::env::var_os("STEPGUARD_EBPF_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target/ebpf"))
        .join("bpfel-unknown-none/release/lab-ebpf");
    println!("cargo:rerun-if-changed={}", obj.display());
    let embedded = if obj.exists() {
        obj
    } else {
        let stub = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("lab-ebpf.stub");
        std::fs::write(&stub, b"").unwrap();
        println!(
            "cargo:warning=the lab's eBPF object {} is missing: embedding an empty stub \
             (the lab cannot start). `cargo xtask build` builds it.",
            obj.display()
        );
        stub
    };
    println!("cargo:rustc-env=LAB_EBPF_OBJ={}", embedded.display());
}
