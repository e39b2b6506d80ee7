//! What the agent and the witness share to probe their targets: the recorder (metrics,
//! latest outcomes, rings of samples) and the probe engine once started. Each is a
//! [`Vantage`]: it says its targets, its cadence now and takes each outcome.
use super::{start_probes, ProbeMetrics, Recorder, RingBounds, Vantage};
use crate::config::Target;
use crate::probe::engine::Engine;
use std::sync::{Arc, OnceLock};

pub struct ProbeHost {
    /// The targets' probes as recorded: metrics, latest outcomes, samples kept `bounds` long.
    pub recorder: Recorder,
    /// The probe engine (its own thread) once started.
    engine: OnceLock<Engine>,
}

impl ProbeHost {
    /// A host for `targets`, recording into `metrics` (its series declared for each target,
    /// so every target shows in `/metrics` before its first probe).
    pub fn new(targets: &[Target], metrics: ProbeMetrics, bounds: RingBounds) -> ProbeHost {
        metrics.declare(targets);
        ProbeHost {
            recorder: Recorder::new(metrics, bounds),
            engine: OnceLock::new(),
        }
    }

    /// Starts probing for `v` (once; the engine holds `v` weakly).
    pub fn start<V: Vantage>(&self, v: &Arc<V>) {
        start_probes(&self.engine, v);
    }

    /// Wakes the engine: a cadence may have changed.
    pub fn wake(&self) {
        if let Some(e) = self.engine.get() {
            e.wake();
        }
    }
}
