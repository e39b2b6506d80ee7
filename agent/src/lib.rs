//! stepguard: verifies a node's Cilium datapath around cilium-agent restarts.
//!
//! Pure logic lives in modules that need no root; kernel access stays under [`kernel`].
pub mod kernel;
pub mod metrics;
pub mod server;
