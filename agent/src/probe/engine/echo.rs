//! The echo transport: ICMP echoes on one shared socket (a ping socket when the kernel allows
//! it, else a raw one), or on a socket of their own for a target with a `source`.
use super::*;

/// Which ICMP socket this process can open: 0 unknown, 1 ping socket, 2 raw socket.
pub(super) static ICMP_KIND: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

pub(super) static ICMP_SEQ: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(1);

pub(super) fn icmp_socket() -> io::Result<(OwnedFd, bool)> {
    use std::sync::atomic::Ordering::Relaxed;
    let ping = || new_socket(libc::AF_INET, libc::SOCK_DGRAM, libc::IPPROTO_ICMP);
    let raw = || new_socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_ICMP);
    match ICMP_KIND.load(Relaxed) {
        1 => ping().map(|f| (f, false)),
        2 => raw().map(|f| (f, true)),
        _ => match ping() {
            Ok(f) => {
                ICMP_KIND.store(1, Relaxed);
                Ok((f, false))
            }
            Err(_) => {
                let f = raw()?;
                ICMP_KIND.store(2, Relaxed);
                Ok((f, true))
            }
        },
    }
}

/// What one received ICMP datagram means for echo probe `op` to `dst` (None: not its).
pub(super) fn icmp_judge(
    datagram: &[u8],
    from: Option<Ipv4Addr>,
    dst: Ipv4Addr,
    op: &Op,
) -> Option<Finished> {
    // Raw sockets deliver the IP header; ping sockets only the ICMP message.
    let icmp = if op.raw {
        let ihl = ((datagram.first()? & 0x0f) as usize) * 4;
        datagram.get(ihl..).unwrap_or(&[])
    } else {
        datagram
    };
    let from = from.unwrap_or(Ipv4Addr::UNSPECIFIED);
    let ident = icmp_ident();
    match icmp::classify(icmp, from, dst, ident, op.id, op.raw) {
        icmp::Reply::Echo => Some(Ok(("echo reply".into(), None))),
        icmp::Reply::Unreachable(code) => Some(Err(ProbeError::Answer(format!(
            "{dst} unreachable (ICMP code {code}, from {from})"
        )))),
        icmp::Reply::NotMine => None,
    }
}

/// The echo identifier: the process id's low 16 bits, read once (`std::process::id()` is a
/// getpid syscall, and replies are judged against every echo in flight).
pub(super) fn icmp_ident() -> u16 {
    static IDENT: std::sync::OnceLock<u16> = std::sync::OnceLock::new();
    *IDENT.get_or_init(|| (std::process::id() & 0xffff) as u16)
}
