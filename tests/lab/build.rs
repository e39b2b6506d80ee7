//! Embeds the lab's fake datapath object, built by `cargo xtask build` with Debian's rustc-web.
use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let root = manifest
        .parent()
        .and_then(|p| p.parent())
        .unwrap()
        .to_path_buf();
    let obj = root.join("target/ebpf/bpfel-unknown-none/release/lab-ebpf");
    println!("cargo:rerun-if-changed={}", obj.display());
    if !obj.exists() {
        panic!(
            "\n\nthe lab's eBPF object {} is missing.\nRun `cargo xtask build` (it builds the eBPF crates with Debian's rustc-web), \
             or `cargo xtask setup` first on a fresh machine.\n\n",
            obj.display()
        );
    }
    println!("cargo:rustc-env=LAB_EBPF_OBJ={}", obj.display());
}
