//! The echo transport: ICMP echoes on one shared socket (a ping socket when the kernel allows
//! it, else a raw one), or on a socket of their own for a target with a `source`; ICMPv6
//! echoes always on a socket of their own.
use super::*;

/// Which ICMP socket this process can open: 0 unknown, 1 ping socket, 2 raw socket; for
/// IPv4 and for IPv6 (ping sockets of either family follow `net.ipv4.ping_group_range`, but
/// each is found out by trying it).
pub(super) static ICMP_KIND: [std::sync::atomic::AtomicU8; 2] = [
    std::sync::atomic::AtomicU8::new(0),
    std::sync::atomic::AtomicU8::new(0),
];

pub(super) static ICMP_SEQ: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(1);

/// An ICMP socket (`v6`: ICMPv6) and whether it is raw.
pub(super) fn icmp_socket(v6: bool) -> io::Result<(OwnedFd, bool)> {
    use std::sync::atomic::Ordering::Relaxed;
    let (domain, proto) = if v6 {
        (libc::AF_INET6, libc::IPPROTO_ICMPV6)
    } else {
        (libc::AF_INET, libc::IPPROTO_ICMP)
    };
    let ping = || new_socket(domain, libc::SOCK_DGRAM, proto);
    let raw = || new_socket(domain, libc::SOCK_RAW, proto);
    let kind = &ICMP_KIND[v6 as usize];
    match kind.load(Relaxed) {
        1 => ping().map(|f| (f, false)),
        2 => raw().map(|f| (f, true)),
        _ => match ping() {
            Ok(f) => {
                kind.store(1, Relaxed);
                Ok((f, false))
            }
            Err(_) => {
                let f = raw()?;
                kind.store(2, Relaxed);
                Ok((f, true))
            }
        },
    }
}

/// What one received ICMP datagram means for echo probe `op` to `dst` (None: not its).
pub(super) fn icmp_judge(
    datagram: &[u8],
    from: Option<IpAddr>,
    dst: IpAddr,
    op: &Op,
) -> Option<Finished> {
    let ident = icmp_ident();
    let reply = match (dst, from) {
        (IpAddr::V4(dst), from) => {
            // Raw IPv4 sockets deliver the IP header; ping sockets only the ICMP message.
            let icmp = if op.raw {
                let ihl = ((datagram.first()? & 0x0f) as usize) * 4;
                datagram.get(ihl..).unwrap_or(&[])
            } else {
                datagram
            };
            let from = match from {
                Some(IpAddr::V4(f)) => f,
                _ => Ipv4Addr::UNSPECIFIED,
            };
            wire::classify(icmp, from, dst, ident, op.id, op.raw)
        }
        // ICMPv6 sockets, raw or not, deliver the message alone.
        (IpAddr::V6(dst), from) => {
            let from = match from {
                Some(IpAddr::V6(f)) => f,
                _ => std::net::Ipv6Addr::UNSPECIFIED,
            };
            wire::classify_v6(datagram, from, dst, ident, op.id, op.raw)
        }
    };
    match reply {
        wire::Reply::Echo => Some(Ok(("echo reply".into(), None))),
        wire::Reply::Unreachable(code) => Some(Err(ProbeError::Answer(format!(
            "{dst} unreachable ({} code {code}, from {})",
            if dst.is_ipv4() { "ICMP" } else { "ICMPv6" },
            from.map_or_else(|| "?".to_string(), |f| f.to_string())
        )))),
        wire::Reply::NotMine => None,
    }
}

/// The echo identifier: the process id's low 16 bits, read once (`std::process::id()` is a
/// getpid syscall, and replies are judged against every echo in flight).
pub(super) fn icmp_ident() -> u16 {
    static IDENT: std::sync::OnceLock<u16> = std::sync::OnceLock::new();
    *IDENT.get_or_init(|| (std::process::id() & 0xffff) as u16)
}
