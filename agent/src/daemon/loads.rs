//! Whether BPF programs were loaded since the last look: a program attached anywhere
//! (a device, an endpoint) was loaded first, and program ids only grow, so while no id above
//! the highest seen exists nothing can have been attached that was not there before
//! ([`crate::kernel::bpf::highest_prog_id_above`], one syscall). The implicit-step watcher
//! and the step runner read the kernel's thousands of attachments only after a load.

/// Programs are loaded before they are attached: after a load, things are looked at until
/// this long after it, so an attach a few seconds later is not missed.
pub const LOOK_AFTER_LOAD_S: f64 = 30.0;

/// The highest program id seen, and until when a load keeps the looks going.
#[derive(Default)]
pub struct ProgramLoads {
    highest: u32,
    looking_until: f64,
}

impl ProgramLoads {
    /// Counting from the programs loaded now (those are no news).
    pub fn from_now() -> ProgramLoads {
        ProgramLoads {
            highest: crate::kernel::bpf::highest_prog_id_above(0)
                .ok()
                .flatten()
                .unwrap_or(0),
            looking_until: 0.0,
        }
    }

    /// Whether a program was loaded since the last call, or within [`LOOK_AFTER_LOAD_S`]
    /// before `now`. Fails open to looking: when programs cannot be enumerated (no
    /// CAP_SYS_ADMIN), always.
    pub fn since_last_look(&mut self, now: f64) -> bool {
        match crate::kernel::bpf::highest_prog_id_above(self.highest) {
            Ok(Some(h)) => {
                self.highest = h;
                self.looking_until = now + LOOK_AFTER_LOAD_S;
                true
            }
            Ok(None) => now < self.looking_until,
            Err(_) => true,
        }
    }
}
