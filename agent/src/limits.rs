//! The agent's bounds that more than one layer checks against (config validation, the step
//! API, the probe engine): one definition each.

use std::time::Duration;

/// Witnesses a step may name.
pub const MAX_WITNESSES: usize = 8;

/// Probes of one target in flight at once (a step's cadence must not need more).
pub const MAX_IN_FLIGHT: usize = 256;

/// The steady probe cadence an agent or a witness accepts (`--probe-interval`).
pub const PROBE_INTERVAL: (Duration, Duration) =
    (Duration::from_millis(10), Duration::from_secs(3600));

/// The burst probe cadence an agent or a witness accepts (`--burst-interval`).
pub const BURST_INTERVAL: (Duration, Duration) =
    (Duration::from_millis(1), Duration::from_secs(10));
