//! The lab: a simulated Cilium node in network namespaces, faithful to `shared/cilium-facts.md`,
//! used by stepguard's demo, integration tests and benchmarks.
//!
//! One lab = one unique name prefix. Everything it creates (namespaces, a private bpffs mount,
//! servers, files) is recorded in `/run/stepguard-lab/<prefix>/state.json` *before* it is
//! created, so `down` removes exactly that, even after the creating process crashed.
//!
//! Its rooms, lowest first: [`sys`] (syscalls by subject, namespaces, processes, state files),
//! [`kube`] (the control plane and the lab kubelet), [`sim`] (the simulated node), [`lan`] (a
//! LAN of simulated nodes) and [`real`] (a node running the real cilium-agent). The simulated
//! node's handle, spec and addresses are re-exported here.
pub mod kube;
pub mod lan;
pub mod real;
pub mod sim;
pub mod sys;

pub use sim::addr::{
    health_ip, pod_addr, pod_cidr, DNS_PORT, DNS_VIP, DNS_ZONE, GATEWAY_PORT, GATEWAY_TLS_PORT,
    GATEWAY_VIP, HEALTH_PORT,
};
pub use sim::{
    lab_binary, unique_prefix, AttachMode, Capacity, Features, Lab, LabGuard, LabSpec, LabState,
    Profile, RestartOpts, RestartReport,
};
pub use sys::fixture::RUN_ROOT;
pub use sys::now_ns;
