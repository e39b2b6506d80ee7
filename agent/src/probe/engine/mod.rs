//! The probe engine: one thread, one epoll set, non-blocking sockets, sends timed by
//! `epoll_pwait2`'s nanosecond timeout (an absolute timerfd on kernels before 5.11).
//!
//! Why not tasks on the async runtime: a probe there cost a task, a timer-wheel entry
//! (1 ms granularity), a reactor registration and two wake-ups on top of the syscalls the
//! probe itself needs; and its send time depended on whatever else the runtime's workers were
//! doing. Here a probe is exactly its syscalls (socket, connect or sendto, one epoll_ctl, the
//! read, close), and a send leaves when its hrtimer fires (1 ns timer slack on this thread).
//!
//! The vantage point is unchanged: every probe is a fresh socket going through the socket
//! layer (socket-LB translates it like any process's connection), TCP closes with RST (no
//! TIME_WAIT), nothing is installed on the host. The same state machines serve the one-shot
//! probes of `stepguard check` ([`run_once`]), so there is one implementation per probe kind.
mod echo;
mod scheduler;
mod wire;
use super::contract::{would_block, Finished, Progress};
use super::contract::{Exchange, Probe, Transport};
use crate::config::Target;
use crate::kernel::sock::{
    bind, connect, drain_counter, epoll_create, epoll_ctl, epoll_pwait2, epoll_wait, eventfd,
    eventfd_signal, mono_ns, new_socket, poll_one, recv, send_to, set_timer_slack_1ns,
    set_zero_linger, so_error, timerfd_at, timerfd_monotonic,
};
use crate::probe::{ProbeError, ProbeOutcome};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

/// A target's probes, prepared once: where they go, from where, how long they may take, and
/// the kind's prepared probe (or why the target cannot be probed at all).
#[derive(Debug)]
pub struct Spec {
    addr: SocketAddr,
    source: Option<IpAddr>,
    timeout: Duration,
    probe: Result<Arc<dyn Probe>, ProbeError>,
}

impl Spec {
    pub fn new(t: &Target) -> Spec {
        let addr = SocketAddr::new(t.address, super::kind::port(t));
        let probe = super::kind::prepare(t).map_err(|p| {
            let field = if p.field.is_empty() {
                t.name.clone()
            } else {
                format!("{} {}", t.name, p.field)
            };
            ProbeError::unsupported(field, p.problem)
        });
        Spec::checked(addr, t.source, t.timeout, probe)
    }

    /// A probe prepared by its kind (the `dns` check's resolver queries).
    pub fn with(
        addr: SocketAddr,
        source: Option<IpAddr>,
        timeout: Duration,
        probe: Arc<dyn Probe>,
    ) -> Spec {
        Spec::checked(addr, source, timeout, Ok(probe))
    }

    fn checked(
        addr: SocketAddr,
        source: Option<IpAddr>,
        timeout: Duration,
        probe: Result<Arc<dyn Probe>, ProbeError>,
    ) -> Spec {
        let probe = match source {
            Some(src) if src.is_ipv4() != addr.is_ipv4() => Err(ProbeError::unsupported(
                format!("bind source {src}"),
                format!("not the address family of {}", addr.ip()),
            )),
            _ => probe,
        };
        Spec {
            addr,
            source,
            timeout,
            probe,
        }
    }

    fn transport(&self) -> Option<Transport> {
        self.probe.as_ref().ok().map(|p| p.transport())
    }
}

/// Where a probe is.
#[derive(Debug)]
enum Phase {
    /// Stream: the TCP handshake is under way (waiting for writable).
    Connecting,
    /// The exchange (or the echo) is under way.
    Exchanging,
}

/// One probe in flight.
pub struct Op {
    /// The probe's own socket; None for an echo sent on the engine's shared ICMP socket.
    fd: Option<OwnedFd>,
    phase: Phase,
    /// Unix seconds (the agent's clock) right before the first packet's syscall.
    pub sent_at: f64,
    /// CLOCK_MONOTONIC ns at the send and at the timeout.
    pub sent_ns: u64,
    pub deadline_ns: u64,
    /// Stream and datagram: the kind's exchange.
    exchange: Option<Box<dyn Exchange>>,
    /// Echo: the sequence number, and whether the socket is raw (replies carry the IP header).
    id: u16,
    raw: bool,
}

fn cannot(ctx: &str) -> impl Fn(io::Error) -> ProbeError + '_ {
    move |e| ProbeError::cannot_run(ctx, &e)
}

/// Opens the socket and sends the first packet. `Err` is a probe that is already over
/// (it could not run, or failed at once — e.g. connection refused on loopback).
pub fn start(spec: &Spec) -> Result<(Op, Progress), (f64, ProbeError)> {
    start_with(spec, None)
}

/// [`start`], sending an echo without a `source` on `shared_icmp` (socket, raw) instead of a
/// socket of its own.
fn start_with(
    spec: &Spec,
    shared_icmp: Option<(RawFd, bool)>,
) -> Result<(Op, Progress), (f64, ProbeError)> {
    let early = |e| (crate::kernel::clock::now(), e);
    let probe = match &spec.probe {
        Ok(p) => p,
        Err(e) => return Err(early(e.clone())),
    };
    let v4 = spec.addr.is_ipv4();
    let domain = if v4 { libc::AF_INET } else { libc::AF_INET6 };
    let bind_source = |fd: RawFd| -> Result<(), ProbeError> {
        if let Some(src) = spec.source {
            bind(fd, SocketAddr::new(src, 0))
                .map_err(|e| ProbeError::cannot_run(format!("bind source {src}"), &e))?;
        }
        Ok(())
    };
    let op = |fd: Option<OwnedFd>, exchange: Option<Box<dyn Exchange>>, raw: bool, id: u16| Op {
        fd,
        phase: Phase::Exchanging,
        sent_at: 0.0,
        sent_ns: 0,
        deadline_ns: 0,
        exchange,
        id,
        raw,
    };
    let stamp = |op: &mut Op| {
        op.sent_ns = mono_ns();
        op.sent_at = crate::kernel::clock::now();
        op.deadline_ns = op.sent_ns + spec.timeout.as_nanos() as u64;
    };
    match probe.transport() {
        Transport::Stream => {
            let fd = new_socket(domain, libc::SOCK_STREAM, 0)
                .map_err(cannot("socket"))
                .map_err(early)?;
            // Close with RST, not FIN: a probe leaves no TIME_WAIT socket behind (at a 10 ms
            // cadence thousands would pile up per minute and exhaust the ephemeral ports
            // towards one VIP, turning into false outages); it also saves packets.
            set_zero_linger(fd.as_raw_fd())
                .map_err(cannot("socket: SO_LINGER"))
                .map_err(early)?;
            bind_source(fd.as_raw_fd()).map_err(early)?;
            let raw_fd = fd.as_raw_fd();
            let mut o = op(Some(fd), Some(probe.clone().exchange(spec.addr)), false, 0);
            stamp(&mut o);
            match connect(raw_fd, spec.addr) {
                Ok(false) => {
                    o.phase = Phase::Connecting;
                    Ok((o, Progress::Wait(libc::EPOLLOUT as u32)))
                }
                Ok(true) => {
                    let p = open(&mut o, raw_fd);
                    Ok((o, p))
                }
                Err(e) => Err((
                    o.sent_at,
                    ProbeError::exchange(format!("connect {}", spec.addr), &e),
                )),
            }
        }
        Transport::Datagram => {
            let fd = new_socket(domain, libc::SOCK_DGRAM, 0)
                .map_err(cannot("udp socket"))
                .map_err(early)?;
            bind_source(fd.as_raw_fd()).map_err(early)?;
            connect(fd.as_raw_fd(), spec.addr)
                .map_err(|e| ProbeError::cannot_run(format!("connect {}", spec.addr), &e))
                .map_err(early)?;
            let raw_fd = fd.as_raw_fd();
            let mut o = op(Some(fd), Some(probe.clone().exchange(spec.addr)), false, 0);
            stamp(&mut o);
            let p = open(&mut o, raw_fd);
            Ok((o, p))
        }
        Transport::Echo => {
            let (own, raw_fd, raw) = match shared_icmp {
                Some((fd, raw)) if spec.source.is_none() && v4 => (None, fd, raw),
                _ => {
                    let (fd, raw) = icmp_socket(!v4)
                        .map_err(cannot(
                            "icmp socket (needs CAP_NET_RAW or net.ipv4.ping_group_range)",
                        ))
                        .map_err(early)?;
                    bind_source(fd.as_raw_fd()).map_err(early)?;
                    let raw_fd = fd.as_raw_fd();
                    (Some(fd), raw_fd, raw)
                }
            };
            let seq = ICMP_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let ident = icmp_ident();
            let pkt = if v4 {
                wire::echo_request(ident, seq)
            } else {
                wire::echo_request_v6(ident, seq)
            };
            let mut o = op(own, None, raw, seq);
            stamp(&mut o);
            if let Err(e) = send_to(raw_fd, &pkt, spec.addr) {
                return Err((
                    o.sent_at,
                    ProbeError::exchange(format!("send echo to {}", spec.addr.ip()), &e),
                ));
            }
            Ok((o, Progress::Wait(libc::EPOLLIN as u32)))
        }
    }
}

/// The socket is connected: the kind's exchange opens.
fn open(op: &mut Op, fd: RawFd) -> Progress {
    op.phase = Phase::Exchanging;
    match op.exchange.as_mut() {
        Some(x) => x.open(fd),
        None => Progress::Done(Err(ProbeError::unsupported("probe", "no exchange"))),
    }
}

/// Advances a probe after its socket became ready.
pub fn advance(spec: &Spec, op: &mut Op) -> Progress {
    let Some(fd) = op.fd.as_ref().map(|f| f.as_raw_fd()) else {
        return Progress::Wait(libc::EPOLLIN as u32);
    };
    if let Phase::Connecting = op.phase {
        return match so_error(fd) {
            Ok(()) => open(op, fd),
            Err(e) => Progress::Done(Err(ProbeError::exchange(
                format!("connect {}", spec.addr),
                &e,
            ))),
        };
    }
    if let Some(x) = op.exchange.as_mut() {
        return x.ready(fd);
    }
    // An echo on a socket of its own (a target with a `source`, or IPv6).
    let dst = spec.addr.ip();
    let mut buf = [0u8; 1500];
    loop {
        match recv(fd, &mut buf) {
            Ok((n, from)) => {
                if let Some(done) = icmp_judge(&buf[..n], from, dst, op) {
                    return Progress::Done(done);
                }
            }
            Err(e) if would_block(&e) => return Progress::Wait(libc::EPOLLIN as u32),
            Err(e) => return Progress::Done(Err(ProbeError::exchange("receive echo reply", &e))),
        }
    }
}

/// The outcome of a finished probe. An answer later than the timeout is a failure.
pub fn outcome(spec: &Spec, sent_at: f64, latency: Duration, r: Finished) -> ProbeOutcome {
    match r {
        Ok((detail, answers)) if latency <= spec.timeout => ProbeOutcome {
            ok: true,
            sent_at,
            latency,
            detail,
            ran: true,
            answers,
        },
        Ok((detail, _)) => ProbeOutcome {
            ok: false,
            sent_at,
            latency,
            detail: format!(
                "answered after the {}ms timeout ({detail})",
                spec.timeout.as_millis()
            ),
            ran: true,
            answers: None,
        },
        Err(e) => ProbeOutcome {
            ok: false,
            sent_at,
            latency,
            ran: e.ran(),
            detail: e.to_string(),
            answers: None,
        },
    }
}

/// One probe, blocking the calling thread until it is over (`stepguard check`, tests).
pub fn run_once(spec: &Spec) -> ProbeOutcome {
    let (at, latency, r) = run_once_raw(spec);
    outcome(spec, at, latency, r)
}

/// [`run_once`] before judging the timeout: (sent at, latency, result).
pub fn run_once_raw(spec: &Spec) -> (f64, Duration, Finished) {
    let (mut op, mut progress) = match start(spec) {
        Ok(x) => x,
        Err((at, e)) => return (at, Duration::ZERO, Err(e)),
    };
    loop {
        match progress {
            Progress::Done(r) => {
                let latency = Duration::from_nanos(mono_ns().saturating_sub(op.sent_ns));
                return (op.sent_at, latency, r);
            }
            Progress::Wait(ev) => {
                let now = mono_ns();
                if now >= op.deadline_ns {
                    return (
                        op.sent_at,
                        spec.timeout,
                        Err(ProbeError::timeout(spec.timeout)),
                    );
                }
                let left_ms = (op.deadline_ns - now).div_ceil(1_000_000) as i32;
                let Some(fd) = op.fd.as_ref().map(|f| f.as_raw_fd()) else {
                    return (
                        op.sent_at,
                        Duration::ZERO,
                        Err(ProbeError::unsupported("probe", "no socket")),
                    );
                };
                progress = match poll_one(fd, ev, left_ms) {
                    Ok(true) => advance(spec, &mut op),
                    Ok(false) => Progress::Wait(ev),
                    Err(e) => Progress::Done(Err(ProbeError::exchange("poll", &e))),
                };
            }
        }
    }
}

pub use crate::limits::MAX_IN_FLIGHT;
use echo::*;
pub use scheduler::*;

#[cfg(test)]
mod tests;
