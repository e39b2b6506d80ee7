//! What the agent knows of Cilium that Cilium's API does not tell it, each rule read from
//! Cilium's source per release and cited in `docs/cilium-fidelity.md`: the pinned maps a
//! node of a release and feature set has ([`profile`]), its drop reasons ([`drops`]), and how
//! it names, selects and hooks host devices from its configuration ([`devices`]). The checks
//! hold the kernel to these rules; the rules themselves read no kernel state.
pub mod devices;
pub mod drops;
pub mod profile;
