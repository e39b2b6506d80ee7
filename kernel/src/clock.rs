//! The agent's clock: wall-clock seconds for display and for comparison with other clocks,
//! but advancing with CLOCK_BOOTTIME. The offset between the two is taken once per process,
//! so an NTP step during a step (a restart is exactly when time sync settles) cannot stretch
//! or shrink a gap, a settle window or a reload quiet period; and program load times (which
//! the kernel keeps in CLOCK_BOOTTIME) convert with the same offset, so they compare exactly.
//! CLOCK_BOOTTIME restarts at reboot: steps carry the boot id, and a step resumed on another
//! boot is incomplete evidence (see `step::resume`).
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

fn boottime() -> f64 {
    super::boottime()
}

fn realtime() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Wall-clock minus boot-clock, as taken at the first reading in this process.
fn offset() -> f64 {
    static OFFSET: OnceLock<f64> = OnceLock::new();
    *OFFSET.get_or_init(|| anchor(realtime(), boottime()))
}

/// The offset from one simultaneous reading of both clocks.
pub fn anchor(realtime: f64, boottime: f64) -> f64 {
    realtime - boottime
}

/// Now, in unix seconds on the agent's clock.
pub fn now() -> f64 {
    offset() + boottime()
}

/// A CLOCK_BOOTTIME instant (nanoseconds, e.g. a program's load time) on the agent's clock.
pub fn from_boot_ns(boot_ns: u64) -> f64 {
    offset() + boot_ns as f64 / 1e9
}

/// This boot's id (`/proc/sys/kernel/random/boot_id`); None when unreadable.
pub fn boot_id() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The clock advances with CLOCK_BOOTTIME from one anchor: a wall-clock step after the
    /// anchor (NTP correcting the clock mid-restart) changes nothing (before the fix every
    /// time was SystemTime::now(), so a 2 s step turned a 300 ms gap into 2.3 s).
    #[test]
    fn an_ntp_step_after_the_anchor_does_not_move_the_clock() {
        let off = anchor(1_000.0, 10.0);
        // Boot clock advances 0.3 s; meanwhile the wall clock was stepped by +2 s.
        let (t0, t1) = (off + 10.0, off + 10.3);
        assert!((t1 - t0 - 0.3).abs() < 1e-9);
        assert!(
            (t0 - 1_000.0).abs() < 1e-9,
            "display time is the wall clock at the anchor"
        );
        // The real clock agrees with the wall clock when nothing stepped it.
        assert!((now() - realtime()).abs() < 0.05);
        let b = boottime();
        assert!((from_boot_ns((b * 1e9) as u64) - now()).abs() < 0.05);
        assert!(boot_id().is_some_and(|id| id.len() >= 32));
    }
}
