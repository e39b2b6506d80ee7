//! The neighbour watch: a namespace's ARP and NDP tables as rtnetlink reports their changes.
use super::{fd_result, now_ns};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;

/// A change of a neighbour entry, as rtnetlink reported it to a [`NeighWatch`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NeighEvent {
    /// Wall clock (ns since the epoch) when the watcher read it.
    pub at_ns: u128,
    pub addr: std::net::IpAddr,
    /// `NUD_*` state (0x01 INCOMPLETE, 0x02 REACHABLE, 0x04 STALE, 0x08 DELAY, 0x10 PROBE,
    /// 0x20 FAILED).
    pub state: u16,
    /// An `RTM_DELNEIGH`.
    pub deleted: bool,
    /// The link-layer address the entry points at (`NDA_LLADDR`), when it has one: which
    /// node a client's packets for the address go to.
    #[serde(default)]
    pub lladdr: Option<[u8; 6]>,
}

impl NeighEvent {
    /// The entry has a link-layer address packets can go to (`NUD_VALID`).
    pub fn valid(&self) -> bool {
        !self.deleted && self.state & (0x02 | 0x04 | 0x08 | 0x10 | 0x40 | 0x80) != 0
    }
}

/// Watches a network namespace's neighbour tables (ARP and NDP) (rtnetlink `RTNLGRP_NEIGH`) from a
/// thread of its own: the lab's ground truth for when a client's kernel resolved an address
/// (and so released the packets it had queued for it).
pub struct NeighWatch {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<io::Result<Vec<NeighEvent>>>>,
}

impl NeighWatch {
    /// Starts watching the namespace at `ns_path` (e.g. `/run/netns/NAME`); returns once
    /// subscribed, so no later change is missed.
    pub fn start(ns_path: &Path) -> io::Result<NeighWatch> {
        let file = std::fs::File::open(ns_path)?;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<io::Result<()>>();
        let flag = stop.clone();
        let thread = std::thread::spawn(move || -> io::Result<Vec<NeighEvent>> {
            let sock = match neigh_socket(&file) {
                Ok(s) => {
                    let _ = ready_tx.send(Ok(()));
                    s
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(io::Error::new(e.kind(), e.to_string())));
                    return Err(e);
                }
            };
            let mut events = Vec::new();
            let mut buf = vec![0u8; 64 * 1024];
            while !flag.load(std::sync::atomic::Ordering::SeqCst) {
                // SAFETY: buf is valid for its length.
                let n = unsafe {
                    libc::recv(
                        sock.as_raw_fd(),
                        buf.as_mut_ptr() as *mut libc::c_void,
                        buf.len(),
                        0,
                    )
                };
                let at_ns = now_ns();
                if n < 0 {
                    let e = io::Error::last_os_error();
                    match e.raw_os_error() {
                        Some(libc::EAGAIN) | Some(libc::EINTR) => continue,
                        // The socket's buffer overflowed: events were lost; say so.
                        Some(libc::ENOBUFS) => {
                            return Err(io::Error::other("neighbour events were lost (ENOBUFS)"))
                        }
                        _ => return Err(e),
                    }
                }
                parse_neigh_events(&buf[..n as usize], at_ns, &mut events);
            }
            Ok(events)
        });
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(NeighWatch {
                stop,
                thread: Some(thread),
            }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(io::Error::other("the neighbour watcher thread died")),
        }
    }

    /// Stops watching; every change seen, in order.
    pub fn stop(mut self) -> io::Result<Vec<NeighEvent>> {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(io::Error::other("the neighbour watcher thread panicked")),
            None => Ok(vec![]),
        }
    }
}

impl Drop for NeighWatch {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// An rtnetlink socket in the namespace `ns` subscribed to neighbour changes, with a 20 ms
/// receive timeout (so its thread sees the stop flag).
fn neigh_socket(ns: &std::fs::File) -> io::Result<OwnedFd> {
    // SAFETY: setns on this (the watcher's own) thread; the fd is valid for the call.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: plain socket(2); the fd is owned below.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let sock = fd_result(fd as libc::c_long);
    // SAFETY: sockaddr_nl is plain data; zeroed is valid.
    let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    sa.nl_family = libc::AF_NETLINK as u16;
    sa.nl_groups = libc::RTMGRP_NEIGH as u32;
    // SAFETY: sa is valid for the call.
    if unsafe {
        libc::bind(
            sock.as_raw_fd(),
            &sa as *const libc::sockaddr_nl as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_nl>() as u32,
        )
    } != 0
    {
        return Err(io::Error::last_os_error());
    }
    let tv = libc::timeval {
        tv_sec: 0,
        tv_usec: 20_000,
    };
    let big: libc::c_int = 4 << 20;
    // SAFETY: option values are valid for the calls.
    unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            &tv as *const libc::timeval as *const libc::c_void,
            std::mem::size_of::<libc::timeval>() as u32,
        );
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            &big as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as u32,
        );
    }
    Ok(sock)
}

/// IPv4 and IPv6 `RTM_NEWNEIGH`/`RTM_DELNEIGH` messages in a netlink datagram.
fn parse_neigh_events(buf: &[u8], at_ns: u128, out: &mut Vec<NeighEvent>) {
    const RTM_NEWNEIGH: u16 = 28;
    const RTM_DELNEIGH: u16 = 29;
    const NDA_DST: u16 = 1;
    const NDA_LLADDR: u16 = 2;
    let u16_at = |b: &[u8], i: usize| u16::from_ne_bytes([b[i], b[i + 1]]);
    let mut off = 0;
    while off + 16 <= buf.len() {
        let len = u32::from_ne_bytes(buf[off..off + 4].try_into().unwrap()) as usize;
        if len < 16 || off + len > buf.len() {
            return;
        }
        let ty = u16_at(buf, off + 4);
        let msg = &buf[off + 16..off + len];
        if (ty == RTM_NEWNEIGH || ty == RTM_DELNEIGH)
            && msg.len() >= 12
            && (msg[0] == libc::AF_INET as u8 || msg[0] == libc::AF_INET6 as u8)
        {
            let state = u16_at(msg, 8);
            let (mut dst, mut lladdr) = (None, None);
            let mut a = 12;
            while a + 4 <= msg.len() {
                let alen = u16_at(msg, a) as usize;
                let aty = u16_at(msg, a + 2);
                if alen < 4 || a + alen > msg.len() {
                    break;
                }
                let d = &msg[a + 4..a + alen];
                if aty == NDA_DST && d.len() == 4 {
                    dst = Some(std::net::IpAddr::from([d[0], d[1], d[2], d[3]]));
                } else if aty == NDA_DST && d.len() == 16 {
                    let o: [u8; 16] = d.try_into().unwrap_or([0; 16]);
                    dst = Some(std::net::IpAddr::from(o));
                } else if aty == NDA_LLADDR && d.len() == 6 {
                    lladdr = d.try_into().ok();
                }
                a += (alen + 3) & !3;
            }
            if let Some(addr) = dst {
                out.push(NeighEvent {
                    at_ns,
                    addr,
                    state,
                    deleted: ty == RTM_DELNEIGH,
                    lladdr,
                });
            }
        }
        off += (len + 3) & !3;
    }
}
