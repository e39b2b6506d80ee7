//! Kernel access: BTF, bpf(2), rtnetlink, bpffs, the agent's own eBPF programs. Everything
//! that needs privileges or a kernel object lives below this module.
pub mod bpf;
pub mod bpffs;
pub mod btf;
pub mod ciliumdrops;
pub mod drops;
pub mod links;
