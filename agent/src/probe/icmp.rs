//! ICMP echo: an unprivileged ping socket when the kernel allows it, else a raw socket
//! (CAP_NET_RAW). IPv4 only.
use std::net::IpAddr;
use std::time::{Duration, Instant};

static SEQ: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(1);

/// Sends one echo request; returns the wall-clock send time (taken right before sendto, not
/// when the blocking task was queued) and the outcome.
pub async fn echo(addr: IpAddr, timeout: Duration) -> (Option<f64>, Result<String, String>) {
    let IpAddr::V4(v4) = addr else {
        return (None, Err("icmp probes support IPv4 only".into()));
    };
    match tokio::task::spawn_blocking(move || echo_blocking(v4, timeout)).await {
        Ok(r) => r,
        Err(e) => (None, Err(format!("icmp task: {e}"))),
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
    dst: std::net::Ipv4Addr,
    timeout: Duration,
) -> (Option<f64>, Result<String, String>) {
    let mut sent_at = None;
    let r = echo_inner(dst, timeout, &mut sent_at);
    (sent_at, r)
}

fn echo_inner(
    dst: std::net::Ipv4Addr,
    timeout: Duration,
    sent_at: &mut Option<f64>,
) -> Result<String, String> {
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
            return Err(format!(
                "icmp socket: {} (needs CAP_NET_RAW or net.ipv4.ping_group_range)",
                std::io::Error::last_os_error()
            ));
        }
        let _guard = scopeguard(fd);
        let tv = libc::timeval {
            tv_sec: timeout.as_secs() as i64,
            tv_usec: timeout.subsec_micros() as i64,
        };
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            &tv as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::timeval>() as u32,
        );
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
        *sent_at = Some(super::unix_now());
        if libc::sendto(
            fd,
            pkt.as_ptr() as *const libc::c_void,
            pkt.len(),
            0,
            &sa as *const _ as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_in>() as u32,
        ) < 0
        {
            return Err(format!(
                "send echo to {dst}: {}",
                std::io::Error::last_os_error()
            ));
        }
        let mut buf = [0u8; 1500];
        loop {
            let left = timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Err(format!("timeout after {}ms", timeout.as_millis()));
            }
            let n = libc::recv(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len(), 0);
            if n < 0 {
                let e = std::io::Error::last_os_error();
                return Err(if matches!(e.raw_os_error(), Some(libc::EAGAIN)) {
                    format!("timeout after {}ms", timeout.as_millis())
                } else {
                    format!("receive echo reply: {e}")
                });
            }
            let n = n as usize;
            // Raw sockets deliver the IP header; ping sockets only the ICMP message.
            let icmp = if raw {
                let ihl = ((buf[0] & 0x0f) as usize) * 4;
                if n < ihl + 8 {
                    continue;
                }
                &buf[ihl..n]
            } else {
                &buf[..n]
            };
            let (src_ok, ty) = (true, icmp.first().copied().unwrap_or(255));
            if src_ok
                && ty == 0
                && (!raw || icmp[4..6] == ident.to_be_bytes())
                && icmp[6..8] == seq.to_be_bytes()
            {
                return Ok("echo reply".into());
            }
            if ty == 3 {
                return Err(format!(
                    "{dst} unreachable (ICMP code {})",
                    icmp.get(1).copied().unwrap_or(0)
                ));
            }
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
