//! Embeds the agent's eBPF object, built by `cargo xtask build` with Debian's rustc-web.
//!
//! Without that object (a plain `cargo check`, clippy or unit-test run with rustup's toolchain
//! alone) an empty stub is embedded instead, as aya-template does: the agent then builds and
//! runs, and reports kernel drop accounting as unavailable, naming this cause. `cargo xtask
//! build`/`test`/`image` always build the real object first.
use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let obj = manifest
        .parent()
        .unwrap()
        .join("target/ebpf/bpfel-unknown-none/release/agent-ebpf");
    println!("cargo:rerun-if-changed={}", obj.display());
    let embedded = if obj.exists() {
        obj
    } else {
        let stub = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("agent-ebpf.stub");
        std::fs::write(&stub, b"").unwrap();
        println!(
            "cargo:warning=the agent's eBPF object {} is missing: embedding an empty stub \
             (kernel drop accounting will report unavailable). `cargo xtask build` builds it.",
            obj.display()
        );
        stub
    };
    println!("cargo:rustc-env=AGENT_EBPF_OBJ={}", embedded.display());
}
