//! The lab's host-level tools, by subject: bpf(2) ([`bpf`]), tc filters over rtnetlink ([`tc`]),
//! gratuitous ARPs and neighbour advertisements ([`packets`]), the neighbour watch ([`neigh`]),
//! network namespaces ([`netns`]), the processes the lab starts ([`process`]), and a lab's state
//! file and guard ([`fixture`]). Nothing here knows which kind of lab it serves.
pub mod bpf;
pub mod fixture;
pub mod neigh;
pub mod netns;
pub mod packets;
pub mod process;
pub mod tc;

use anyhow::{bail, Result};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

fn fd_result(r: libc::c_long) -> OwnedFd {
    // SAFETY: the kernel just returned this fd to us; nothing else owns it.
    unsafe { OwnedFd::from_raw_fd(r as RawFd) }
}

/// Now, in unix nanoseconds: the instants the lab records as truth.
pub fn now_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos()
}

pub fn check_root() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the lab needs root (network namespaces, bpffs mounts, eBPF): run it as root, e.g. `sudo -E cargo xtask lab up`");
    }
    Ok(())
}
