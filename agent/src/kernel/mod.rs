//! Kernel access: BTF, the agent's own eBPF programs. Everything that needs privileges or a
//! kernel object lives below this module.
pub mod btf;
pub mod drops;
