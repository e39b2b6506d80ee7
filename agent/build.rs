//! Embeds the agent's eBPF object, built by `cargo xtask build` with Debian's rustc-web.
use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let obj = manifest
        .parent()
        .unwrap()
        .join("target/ebpf/bpfel-unknown-none/release/agent-ebpf");
    println!("cargo:rerun-if-changed={}", obj.display());
    if !obj.exists() {
        panic!(
            "\n\nthe agent's eBPF object {} is missing.\nRun `cargo xtask build` (it builds the eBPF crates with Debian's rustc-web), \
             or `cargo xtask setup` first on a fresh machine.\n\n",
            obj.display()
        );
    }
    println!("cargo:rustc-env=AGENT_EBPF_OBJ={}", obj.display());
}
