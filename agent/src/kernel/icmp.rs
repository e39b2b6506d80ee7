//! ICMP echo: an unprivileged ping socket when the kernel allows it, else a raw socket
//! (CAP_NET_RAW). IPv4 only.
use crate::probe::ProbeError;
use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

static SEQ: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(1);

/// Sends one echo request; returns the wall-clock send time (taken right before sendto, not
/// when the blocking task was queued) and the outcome.
pub async fn echo(
    addr: IpAddr,
    source: Option<IpAddr>,
    timeout: Duration,
) -> (Option<f64>, Result<String, ProbeError>) {
    let IpAddr::V4(v4) = addr else {
        return (
            None,
            Err(ProbeError::unsupported(
                "icmp",
                "icmp probes support IPv4 only",
            )),
        );
    };
    let source = match source {
        None => None,
        Some(IpAddr::V4(s)) => Some(s),
        Some(IpAddr::V6(s)) => {
            return (
                None,
                Err(ProbeError::unsupported(
                    format!("bind source {s}"),
                    "an IPv6 source for an IPv4 echo",
                )),
            )
        }
    };
    match tokio::task::spawn_blocking(move || echo_blocking(v4, source, timeout)).await {
        Ok(r) => r,
        Err(e) => (
            None,
            Err(ProbeError::unsupported("icmp task", e.to_string())),
        ),
    }
}

fn checksum(b: &[u8]) -> u16 {
    let mut sum = 0u32;
    for c in b.chunks(2) {
        sum += u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]) as u32;
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

fn echo_blocking(
    dst: Ipv4Addr,
    source: Option<Ipv4Addr>,
    timeout: Duration,
) -> (Option<f64>, Result<String, ProbeError>) {
    let mut sent_at = None;
    let r = echo_inner(dst, source, timeout, &mut sent_at);
    (sent_at, r)
}

/// What a received ICMP message means for the probe that sent (`ident`, `seq`) to `dst`.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply {
    /// The echo reply to this probe.
    Echo,
    /// A Destination Unreachable about this probe's own request (the quoted packet matches).
    Unreachable(u8),
    /// Anything else: another probe's reply, another host's, an error about other traffic.
    NotMine,
}

/// Classifies an ICMP message (from its first byte) received from `from`. A raw socket sees
/// every ICMP message of the host, so the ident is checked there; a ping socket's ident is
/// the kernel's and only the sequence number is ours.
pub fn classify(
    icmp: &[u8],
    from: Ipv4Addr,
    dst: Ipv4Addr,
    ident: u16,
    seq: u16,
    raw: bool,
) -> Reply {
    if icmp.len() < 8 {
        return Reply::NotMine;
    }
    let ours =
        |id: &[u8], sq: &[u8]| (!raw || id == ident.to_be_bytes()) && sq == seq.to_be_bytes();
    match icmp[0] {
        0 if from == dst && ours(&icmp[4..6], &icmp[6..8]) => Reply::Echo,
        3 => {
            // The quoted datagram: its IP header, then the first 8 bytes of our echo request.
            let quoted = &icmp[8..];
            if quoted.len() < 20 {
                return Reply::NotMine;
            }
            let ihl = ((quoted[0] & 0x0f) as usize) * 4;
            if ihl < 20 || quoted.len() < ihl + 8 {
                return Reply::NotMine;
            }
            let proto = quoted[9];
            let qdst = Ipv4Addr::new(quoted[16], quoted[17], quoted[18], quoted[19]);
            let inner = &quoted[ihl..ihl + 8];
            if proto == libc::IPPROTO_ICMP as u8
                && qdst == dst
                && inner[0] == 8
                && ours(&inner[4..6], &inner[6..8])
            {
                Reply::Unreachable(icmp[1])
            } else {
                Reply::NotMine
            }
        }
        _ => Reply::NotMine,
    }
}

fn set_rcvtimeo(fd: i32, d: Duration) {
    let tv = libc::timeval {
        tv_sec: d.as_secs() as i64,
        // At least 1 µs: a zero timeval means "block forever".
        tv_usec: (d.subsec_micros() as i64).max(if d.as_secs() == 0 { 1 } else { 0 }),
    };
    // SAFETY: setsockopt on an fd the caller owns, with a timeval that outlives the call.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            &tv as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::timeval>() as u32,
        );
    }
}

fn echo_inner(
    dst: Ipv4Addr,
    source: Option<Ipv4Addr>,
    timeout: Duration,
    sent_at: &mut Option<f64>,
) -> Result<String, ProbeError> {
    // SAFETY: plain socket calls on an fd owned by this function; buffers outlive the calls.
    unsafe {
        let mut raw = false;
        let mut fd = libc::socket(
            libc::AF_INET,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            libc::IPPROTO_ICMP,
        );
        if fd < 0 {
            fd = libc::socket(
                libc::AF_INET,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::IPPROTO_ICMP,
            );
            raw = true;
        }
        if fd < 0 {
            return Err(ProbeError::cannot_run(
                "icmp socket (needs CAP_NET_RAW or net.ipv4.ping_group_range)",
                &std::io::Error::last_os_error(),
            ));
        }
        let _guard = scopeguard(fd);
        if let Some(src) = source {
            let sa = libc::sockaddr_in {
                sin_family: libc::AF_INET as u16,
                sin_port: 0,
                sin_addr: libc::in_addr {
                    s_addr: u32::from(src).to_be(),
                },
                sin_zero: [0; 8],
            };
            if libc::bind(
                fd,
                &sa as *const _ as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_in>() as u32,
            ) < 0
            {
                return Err(ProbeError::cannot_run(
                    format!("bind source {src}"),
                    &std::io::Error::last_os_error(),
                ));
            }
        }
        // Raw sockets see every echo reply: each probe gets its own sequence number.
        let ident = (std::process::id() & 0xffff) as u16;
        let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut pkt = [0u8; 16];
        pkt[0] = 8; // echo request
        pkt[4..6].copy_from_slice(&ident.to_be_bytes());
        pkt[6..8].copy_from_slice(&seq.to_be_bytes());
        pkt[8..16].copy_from_slice(b"stepgrd!");
        let c = checksum(&pkt);
        pkt[2..4].copy_from_slice(&c.to_be_bytes());
        let sa = libc::sockaddr_in {
            sin_family: libc::AF_INET as u16,
            sin_port: 0,
            sin_addr: libc::in_addr {
                s_addr: u32::from(dst).to_be(),
            },
            sin_zero: [0; 8],
        };
        let start = Instant::now();
        *sent_at = Some(crate::clock::now());
        if libc::sendto(
            fd,
            pkt.as_ptr() as *const libc::c_void,
            pkt.len(),
            0,
            &sa as *const _ as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_in>() as u32,
        ) < 0
        {
            return Err(ProbeError::exchange(
                format!("send echo to {dst}"),
                &std::io::Error::last_os_error(),
            ));
        }
        let mut buf = [0u8; 1500];
        let recv = |left: Duration| -> std::io::Result<(Vec<u8>, Ipv4Addr)> {
            set_rcvtimeo(fd, left);
            let mut from: libc::sockaddr_in = std::mem::zeroed();
            let mut from_len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            let n = libc::recvfrom(
                fd,
                buf.as_mut_ptr() as *mut libc::c_void,
                buf.len(),
                0,
                &mut from as *mut _ as *mut libc::sockaddr,
                &mut from_len,
            );
            if n < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let n = n as usize;
            // Raw sockets deliver the IP header; ping sockets only the ICMP message.
            let icmp = if raw {
                let ihl = ((buf[0] & 0x0f) as usize) * 4;
                buf.get(ihl..n).unwrap_or(&[]).to_vec()
            } else {
                buf[..n].to_vec()
            };
            Ok((icmp, Ipv4Addr::from(u32::from_be(from.sin_addr.s_addr))))
        };
        await_reply(dst, start, timeout, recv, |icmp, from| {
            classify(icmp, from, dst, ident, seq, raw)
        })
    }
}

/// Receives until this probe's answer, or until `timeout` after `start`: each receive waits
/// at most for what is left, so a probe never takes longer than its timeout however many
/// unrelated messages arrive (a raw socket sees every ICMP message of the host).
fn await_reply(
    dst: Ipv4Addr,
    start: Instant,
    timeout: Duration,
    mut recv: impl FnMut(Duration) -> std::io::Result<(Vec<u8>, Ipv4Addr)>,
    classify: impl Fn(&[u8], Ipv4Addr) -> Reply,
) -> Result<String, ProbeError> {
    loop {
        let left = timeout.saturating_sub(start.elapsed());
        if left.is_zero() {
            return Err(ProbeError::timeout(timeout));
        }
        let (icmp, from) = match recv(left) {
            Ok(x) => x,
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN)) => {
                return Err(ProbeError::timeout(timeout))
            }
            Err(e) => return Err(ProbeError::exchange("receive echo reply", &e)),
        };
        match classify(&icmp, from) {
            Reply::Echo => return Ok("echo reply".into()),
            Reply::Unreachable(code) => {
                return Err(ProbeError::Answer(format!(
                    "{dst} unreachable (ICMP code {code}, from {from})"
                )))
            }
            Reply::NotMine => continue,
        }
    }
}

struct FdGuard(i32);
impl Drop for FdGuard {
    fn drop(&mut self) {
        // SAFETY: closing the fd this guard owns.
        unsafe { libc::close(self.0) };
    }
}
fn scopeguard(fd: i32) -> FdGuard {
    FdGuard(fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DST: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 7);

    fn echo_reply(ident: u16, seq: u16) -> Vec<u8> {
        let mut p = vec![0u8, 0, 0, 0];
        p.extend_from_slice(&ident.to_be_bytes());
        p.extend_from_slice(&seq.to_be_bytes());
        p
    }

    /// Destination Unreachable quoting an echo request (ident, seq) to `to`.
    fn unreachable(to: Ipv4Addr, proto: u8, ident: u16, seq: u16) -> Vec<u8> {
        let mut p = vec![3u8, 1, 0, 0, 0, 0, 0, 0];
        let mut ip = vec![0x45u8, 0, 0, 28, 0, 0, 0, 0, 64, proto, 0, 0, 192, 0, 2, 1];
        ip.extend_from_slice(&to.octets());
        p.extend(ip);
        p.extend([8u8, 0, 0, 0]);
        p.extend_from_slice(&ident.to_be_bytes());
        p.extend_from_slice(&seq.to_be_bytes());
        p
    }

    #[test]
    fn an_unrelated_destination_unreachable_does_not_fail_the_probe() {
        // Another host unreachable, or a UDP datagram's error: not about this probe.
        let other = Ipv4Addr::new(203, 0, 113, 9);
        assert_eq!(
            classify(&unreachable(other, 1, 7, 42), other, DST, 7, 42, true),
            Reply::NotMine
        );
        assert_eq!(
            classify(&unreachable(DST, 17, 7, 42), DST, DST, 7, 42, true),
            Reply::NotMine
        );
        // Another probe's request (another sequence number) to the same host.
        assert_eq!(
            classify(&unreachable(DST, 1, 7, 41), DST, DST, 7, 42, true),
            Reply::NotMine
        );
        // This probe's own request quoted: it fails, with the code.
        assert_eq!(
            classify(
                &unreachable(DST, 1, 7, 42),
                Ipv4Addr::new(192, 0, 2, 1),
                DST,
                7,
                42,
                true
            ),
            Reply::Unreachable(1)
        );
    }

    /// Unrelated ICMP messages keep arriving every 30 ms: the probe still gives up at its
    /// 200 ms timeout, because each receive waits only for what is left (before the fix each
    /// receive waited the whole timeout, so a probe could take up to twice its timeout).
    #[test]
    fn the_receive_timeout_shrinks_to_what_is_left() {
        let timeout = Duration::from_millis(200);
        let start = Instant::now();
        let mut waits = Vec::new();
        let r = await_reply(
            DST,
            start,
            timeout,
            |left| {
                waits.push(left);
                // Another probe's reply arrives after 30 ms, or the receive times out.
                let d = left.min(Duration::from_millis(30));
                std::thread::sleep(d);
                if d < Duration::from_millis(30) {
                    Err(std::io::Error::from_raw_os_error(libc::EAGAIN))
                } else {
                    Ok((echo_reply(9, 9), DST))
                }
            },
            |icmp, from| classify(icmp, from, DST, 7, 42, true),
        );
        assert_eq!(r, Err(ProbeError::timeout(timeout)));
        assert!(waits.len() >= 3, "{waits:?}");
        assert!(
            waits.windows(2).all(|w| w[1] < w[0]),
            "shrinking: {waits:?}"
        );
        assert!(waits.iter().all(|w| *w <= timeout));
    }

    #[test]
    fn an_echo_reply_counts_only_from_the_probed_address() {
        assert_eq!(
            classify(&echo_reply(7, 42), DST, DST, 7, 42, true),
            Reply::Echo
        );
        let spoof = Ipv4Addr::new(192, 0, 2, 66);
        assert_eq!(
            classify(&echo_reply(7, 42), spoof, DST, 7, 42, true),
            Reply::NotMine
        );
        // Raw sockets check the ident; ping sockets (kernel-chosen ident) only the sequence.
        assert_eq!(
            classify(&echo_reply(8, 42), DST, DST, 7, 42, true),
            Reply::NotMine
        );
        assert_eq!(
            classify(&echo_reply(8, 42), DST, DST, 7, 42, false),
            Reply::Echo
        );
        assert_eq!(
            classify(&echo_reply(7, 43), DST, DST, 7, 42, false),
            Reply::NotMine
        );
        assert_eq!(classify(&[0u8, 0], DST, DST, 7, 42, false), Reply::NotMine);
    }
}
