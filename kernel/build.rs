//! Embeds the agent's eBPF object, built by `cargo xtask build` with Debian's rustc-web.
//!
//! Without that object (a plain `cargo check`, clippy or unit-test run with rustup's toolchain
//! alone) an empty stub is embedded instead, as aya-template does: the agent then builds and
//! runs, and reports kernel drop accounting as unavailable, naming this cause. `cargo xtask
//! build`/`test`/`image` always build the real object first.
use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    // `cargo xtask` says where it built the eBPF objects (its build cache); else the
    // workspace's own target directory.
    println!("cargo:rerun-if-env-changed=STEPGUARD_EBPF_DIR");
    let obj = std::env::var_os("STEPGUARD_EBPF_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest.parent().unwrap().join("target/ebpf"))
        .join("bpfel-unknown-none/release/agent-ebpf");
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
