//! The agent's bounds that more than one layer checks against (config validation, the step
//! API, the probe engine): one definition each.

/// Witnesses a step may name.
pub const MAX_WITNESSES: usize = 8;

/// Probes of one target in flight at once (a step's cadence must not need more).
pub const MAX_IN_FLIGHT: usize = 256;
