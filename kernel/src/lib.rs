//! stepguard's kernel layer: syscalls and kernel objects only — BTF, bpf(2) and bpffs pins
//! (read-only), rtnetlink dumps and events, the agent's own passive eBPF programs, the probe
//! engine's sockets, epoll and timers, clocks. It decides nothing about Cilium (the rules are
//! passed in, see `bpffs::Rules`) and is the only crate of the agent with `unsafe`; the agent
//! (`stepguard`) forbids it.
pub mod bpf;
pub mod bpffs;
pub mod btf;
pub mod clock;
pub mod counters;
pub mod drops;
pub mod links;
pub mod neigh;
pub mod sock;

/// CLOCK_BOOTTIME now, in seconds.
pub fn boottime() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into ts, which outlives the call.
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// Hands memory the allocator keeps after large transient work (parsing the kernel's BTF at
/// start, a link dump of a thousand devices) back to the kernel, so RSS follows what is in
/// use rather than the peak. glibc keeps freed heap pages; musl returns them by itself.
pub fn release_freed_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// One line for an I/O error that came from the kernel: permission problems say which
/// capability is missing.
pub fn io_reason(what: &str, e: &std::io::Error) -> (String, &'static str) {
    match e.raw_os_error() {
        Some(libc::EPERM) | Some(libc::EACCES) => (
            format!("{what}: permission denied (needs CAP_BPF and CAP_SYS_ADMIN)"),
            "no_permission",
        ),
        _ => (format!("{what}: {e}"), "kernel_error"),
    }
}
