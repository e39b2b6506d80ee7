//! stepguard: verifies a node's Cilium datapath around cilium-agent restarts.
//!
//! Pure logic (verdicts, config, profiles, statistics) lives in modules that need no root;
//! kernel access stays under [`kernel`] and [`probe`].
#![forbid(unsafe_code)]

pub mod checks;
pub mod cilium;
pub mod ciliumapi;
pub mod ciliumconfig;
pub mod client;
pub mod config;
pub mod daemon;
pub mod durable;
pub mod duration;
pub mod exit;
pub mod families;
pub mod hooks;
pub use stepguard_kernel as kernel;
pub mod limits;
pub mod locks;
pub mod metrics;
pub mod node;
pub mod probe;
pub mod report;
pub mod rollout;
pub mod serving;
pub mod stats;
pub mod step;
pub mod timeline;
pub mod wire;
pub mod witness;

#[cfg(test)]
mod reference_docs;
