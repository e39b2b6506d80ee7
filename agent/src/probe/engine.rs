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
use super::icmp;
use super::kind::{Exchange, Probe, Transport};
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

/// Which ICMP socket this process can open: 0 unknown, 1 ping socket, 2 raw socket.
static ICMP_KIND: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);
static ICMP_SEQ: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(1);

fn icmp_socket() -> io::Result<(OwnedFd, bool)> {
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

/// A finished probe's detail (and dns answers), or what went wrong.
pub type Finished = Result<(String, Option<Vec<IpAddr>>), ProbeError>;

/// What happened after an event.
pub enum Progress {
    /// Wait for these epoll events.
    Wait(u32),
    /// Finished: the detail (and dns answers) or what went wrong.
    Done(Finished),
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
                Some((fd, raw)) if spec.source.is_none() => (None, fd, raw),
                _ => {
                    let (fd, raw) = icmp_socket()
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
            let pkt = icmp::echo_request(ident, seq);
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

/// Whether a non-blocking call would have blocked (or was interrupted): wait and try again.
pub fn would_block(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EINTR))
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
    // An echo on a socket of its own (a target with a `source`).
    let IpAddr::V4(dst) = spec.addr.ip() else {
        return Progress::Done(Err(ProbeError::unsupported("icmp", "IPv4 only")));
    };
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

/// What one received ICMP datagram means for echo probe `op` to `dst` (None: not its).
fn icmp_judge(datagram: &[u8], from: Option<Ipv4Addr>, dst: Ipv4Addr, op: &Op) -> Option<Finished> {
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

/// What the engine asks of its owner.
pub trait Sink: Send + Sync + 'static {
    /// The cadence target `i` is probed at now.
    fn interval(&self, i: usize) -> Duration;
    /// A probe of target `i` is over.
    fn outcome(&self, i: usize, o: ProbeOutcome);
    /// A probe left `late` after its scheduled time.
    fn late(&self, late: Duration) {
        let _ = late;
    }
}

pub use crate::limits::MAX_IN_FLIGHT;

/// A running engine. Dropping it stops the thread.
pub struct Engine {
    wake: Arc<OwnedFd>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Starts an engine for `targets` into `slot` (none without targets). Without an engine no
/// probe runs and every VIP check stays `unknown` ("not probed yet"): fail closed, logged.
pub fn start_into(slot: &std::sync::OnceLock<Engine>, targets: &[Target], sink: Arc<dyn Sink>) {
    if targets.is_empty() {
        return;
    }
    match Engine::start(targets, sink) {
        Ok(e) => {
            let _ = slot.set(e);
        }
        Err(e) => tracing::error!(error = %e, "cannot start the probe engine; probes will not run"),
    }
}

impl Engine {
    /// Starts the engine thread for `targets` (indices are the sink's target indices).
    pub fn start(targets: &[Target], sink: Arc<dyn Sink>) -> io::Result<Engine> {
        let wake = Arc::new(eventfd()?);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let specs: Vec<Spec> = targets.iter().map(Spec::new).collect();
        let mut lp = Loop::new(specs, sink, wake.clone())?;
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("stepguard-probes".into())
            .spawn(move || lp.run(&stop2))?;
        Ok(Engine {
            wake,
            stop,
            thread: Some(thread),
        })
    }

    /// The cadence may have changed (a step began or ended): look again now.
    pub fn wake(&self) {
        eventfd_signal(&self.wake);
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        self.wake();
        if let Some(t) = self.thread.take() {
            // The last owner may be the engine thread itself (its sink upgrading a weak
            // reference): then it ends on its own after this iteration.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

const TOKEN_TIMER: u64 = u64::MAX;
const TOKEN_WAKE: u64 = u64::MAX - 1;
const TOKEN_ICMP: u64 = u64::MAX - 2;
struct Slot {
    op: Op,
    target: usize,
    gen: u32,
}

struct Loop {
    specs: Vec<Spec>,
    sink: Arc<dyn Sink>,
    wake: Arc<OwnedFd>,
    epfd: OwnedFd,
    timer: OwnedFd,
    due: Vec<u64>,
    cadence: Vec<u64>,
    in_flight: Vec<usize>,
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    gen: u32,
    deadlines: BinaryHeap<Reverse<(u64, usize, u32)>>,
    /// One ICMP socket for every echo without a `source` (socket, raw): an echo has no
    /// connection or flow for a fresh socket to stand for, so it saves two syscalls and a
    /// socket per probe (and a raw socket per probe would see every other probe's replies).
    icmp: Option<(OwnedFd, bool)>,
    /// Echoes in flight on the shared socket: sequence number → (slot, generation).
    icmp_ops: std::collections::BTreeMap<u16, (usize, u32)>,
    /// The kernel has no epoll_pwait2: the timerfd times the sends.
    no_pwait2: bool,
    /// What the timerfd is armed for (0: nothing).
    armed: u64,
}

/// The echo identifier: the process id's low 16 bits, read once (`std::process::id()` is a
/// getpid syscall, and replies are judged against every echo in flight).
fn icmp_ident() -> u16 {
    static IDENT: std::sync::OnceLock<u16> = std::sync::OnceLock::new();
    *IDENT.get_or_init(|| (std::process::id() & 0xffff) as u16)
}

impl Loop {
    fn new(specs: Vec<Spec>, sink: Arc<dyn Sink>, wake: Arc<OwnedFd>) -> io::Result<Loop> {
        let (epfd, timer) = (epoll_create()?, timerfd_monotonic()?);
        epoll_ctl(
            epfd.as_raw_fd(),
            libc::EPOLL_CTL_ADD,
            timer.as_raw_fd(),
            libc::EPOLLIN as u32,
            TOKEN_TIMER,
        )?;
        epoll_ctl(
            epfd.as_raw_fd(),
            libc::EPOLL_CTL_ADD,
            wake.as_raw_fd(),
            libc::EPOLLIN as u32,
            TOKEN_WAKE,
        )?;
        let n = specs.len();
        let now = mono_ns();
        let icmp = if specs
            .iter()
            .any(|s| s.transport() == Some(Transport::Echo) && s.source.is_none())
        {
            // Without one, each echo opens its own socket (and says why it cannot).
            match icmp_socket() {
                Ok((fd, raw)) => {
                    epoll_ctl(
                        epfd.as_raw_fd(),
                        libc::EPOLL_CTL_ADD,
                        fd.as_raw_fd(),
                        libc::EPOLLIN as u32,
                        TOKEN_ICMP,
                    )?;
                    Some((fd, raw))
                }
                Err(_) => None,
            }
        } else {
            None
        };
        Ok(Loop {
            specs,
            sink,
            wake,
            epfd,
            timer,
            // The first probes leave at once, spread by a few µs each.
            due: (0..n).map(|i| now + i as u64 * 50_000).collect(),
            cadence: vec![u64::MAX; n],
            in_flight: vec![0; n],
            slots: Vec::new(),
            free: Vec::new(),
            gen: 0,
            deadlines: BinaryHeap::new(),
            icmp,
            icmp_ops: Default::default(),
            no_pwait2: false,
            armed: 0,
        })
    }

    fn run(&mut self, stop: &std::sync::atomic::AtomicBool) {
        // Sends are timed by an absolute timer: ask for no slack on this thread's timers.
        set_timer_slack_1ns();
        let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 256];
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            let now = mono_ns();
            self.send_due(now);
            self.expire(mono_ns());
            let n = match self.wait(&mut events) {
                Ok(n) => n,
                Err(e) => {
                    if e.raw_os_error() != Some(libc::EINTR) {
                        tracing::error!(error = %e, "probe engine: epoll_wait failed");
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    continue;
                }
            };
            for ev in &events[..n] {
                let (token, flags) = (ev.u64, ev.events);
                match token {
                    TOKEN_TIMER | TOKEN_WAKE => {
                        let fd = if token == TOKEN_TIMER {
                            self.timer.as_raw_fd()
                        } else {
                            self.wake.as_raw_fd()
                        };
                        drain_counter(fd);
                    }
                    TOKEN_ICMP => self.icmp_ready(),
                    t => self.ready(t, flags),
                }
            }
        }
    }

    fn send_due(&mut self, now: u64) {
        for i in 0..self.specs.len() {
            let cadence = self.sink.interval(i).as_nanos().max(100_000) as u64;
            // A step beginning switches to its burst cadence at once.
            if cadence < self.cadence[i] && self.cadence[i] != u64::MAX {
                self.due[i] = self.due[i].min(now);
            }
            self.cadence[i] = cadence;
            if self.due[i] > now {
                continue;
            }
            self.sink.late(Duration::from_nanos(now - self.due[i]));
            if self.in_flight[i] < MAX_IN_FLIGHT {
                self.launch(i);
            }
            self.due[i] += cadence;
            let now = mono_ns();
            if self.due[i] + cadence < now {
                self.due[i] = now; // fell behind (suspend, overload): no backlog
            }
        }
    }

    fn launch(&mut self, i: usize) {
        let shared = self.icmp.as_ref().map(|(fd, raw)| (fd.as_raw_fd(), *raw));
        match start_with(&self.specs[i], shared) {
            Err((at, e)) => {
                let o = outcome(&self.specs[i], at, Duration::ZERO, Err(e));
                self.sink.outcome(i, o);
            }
            Ok((op, Progress::Done(r))) => self.finish(i, op, r),
            Ok((op, Progress::Wait(ev))) => {
                let slot = self.free.pop().unwrap_or_else(|| {
                    self.slots.push(None);
                    self.slots.len() - 1
                });
                self.gen = self.gen.wrapping_add(1);
                let token = ((self.gen as u64) << 32) | slot as u64;
                let registered = match &op.fd {
                    Some(fd) => epoll_ctl(
                        self.epfd.as_raw_fd(),
                        libc::EPOLL_CTL_ADD,
                        fd.as_raw_fd(),
                        ev,
                        token,
                    ),
                    None => {
                        self.icmp_ops.insert(op.id, (slot, self.gen));
                        Ok(())
                    }
                };
                if let Err(e) = registered {
                    self.free.push(slot);
                    let o = outcome(
                        &self.specs[i],
                        op.sent_at,
                        Duration::ZERO,
                        Err(ProbeError::cannot_run("epoll_ctl", &e)),
                    );
                    self.sink.outcome(i, o);
                    return;
                }
                self.deadlines
                    .push(Reverse((op.deadline_ns, slot, self.gen)));
                self.in_flight[i] += 1;
                self.slots[slot] = Some(Slot {
                    op,
                    target: i,
                    gen: self.gen,
                });
            }
        }
    }

    fn finish(&mut self, i: usize, op: Op, r: Finished) {
        let latency = Duration::from_nanos(mono_ns().saturating_sub(op.sent_ns));
        let o = outcome(&self.specs[i], op.sent_at, latency, r);
        drop(op); // closes the socket (RST for TCP) before the result is recorded
        self.sink.outcome(i, o);
    }

    fn take(&mut self, slot: usize, gen: u32) -> Option<Slot> {
        match self.slots.get(slot) {
            Some(Some(s)) if s.gen == gen => {
                let s = self.slots[slot].take();
                self.free.push(slot);
                if let Some(s) = &s {
                    self.in_flight[s.target] -= 1;
                    if s.op.fd.is_none() {
                        self.icmp_ops.remove(&s.op.id);
                    }
                }
                s
            }
            _ => None,
        }
    }

    fn ready(&mut self, token: u64, _flags: u32) {
        let (slot, gen) = ((token & 0xffff_ffff) as usize, (token >> 32) as u32);
        let Some(Some(s)) = self.slots.get_mut(slot) else {
            return;
        };
        if s.gen != gen {
            return;
        }
        let i = s.target;
        match advance(&self.specs[i], &mut s.op) {
            Progress::Wait(ev) => {
                if let Some(fd) = &s.op.fd {
                    let fd = fd.as_raw_fd();
                    let _ = epoll_ctl(self.epfd.as_raw_fd(), libc::EPOLL_CTL_MOD, fd, ev, token);
                }
            }
            Progress::Done(r) => {
                if let Some(s) = self.take(slot, gen) {
                    self.finish(i, s.op, r);
                }
            }
        }
    }

    /// Replies on the shared ICMP socket, each to the echo in flight it answers.
    fn icmp_ready(&mut self) {
        let Some((fd, raw)) = self.icmp.as_ref().map(|(f, r)| (f.as_raw_fd(), *r)) else {
            return;
        };
        let mut buf = [0u8; 1500];
        for _ in 0..4096 {
            let (n, from) = match recv(fd, &mut buf) {
                Ok(x) => x,
                Err(_) => return, // EAGAIN (or an error the next echo's timeout will show)
            };
            // The echo it may answer, by sequence number (a raw socket also sees every other
            // ICMP message of the namespace: no scan of the echoes in flight for each).
            let datagram = &buf[..n];
            let icmp = if raw {
                let ihl = ((datagram.first().copied().unwrap_or(0) & 0x0f) as usize) * 4;
                datagram.get(ihl..).unwrap_or(&[])
            } else {
                datagram
            };
            let Some(&(slot, gen)) =
                icmp::answered_seq(icmp).and_then(|seq| self.icmp_ops.get(&seq))
            else {
                continue;
            };
            let done = match self.slots.get(slot) {
                Some(Some(s)) if s.gen == gen => match self.specs[s.target].addr.ip() {
                    IpAddr::V4(dst) => icmp_judge(datagram, from, dst, &s.op),
                    IpAddr::V6(_) => None,
                },
                _ => None,
            };
            if let Some(done) = done {
                if let Some(s) = self.take(slot, gen) {
                    self.finish(s.target, s.op, done);
                }
            }
        }
    }

    fn expire(&mut self, now: u64) {
        while let Some(Reverse((deadline, slot, gen))) = self.deadlines.peek().copied() {
            if deadline > now {
                break;
            }
            self.deadlines.pop();
            if let Some(s) = self.take(slot, gen) {
                let spec = &self.specs[s.target];
                let o = outcome(
                    spec,
                    s.op.sent_at,
                    spec.timeout,
                    Err(ProbeError::timeout(spec.timeout)),
                );
                drop(s.op);
                self.sink.outcome(s.target, o);
            }
        }
    }

    /// The next send or timeout, CLOCK_MONOTONIC ns (at most a second away).
    fn next_wake(&self) -> u64 {
        let next_send = self.due.iter().copied().min().unwrap_or(u64::MAX);
        let next_deadline = self
            .deadlines
            .peek()
            .map(|Reverse((d, _, _))| *d)
            .unwrap_or(u64::MAX);
        next_send.min(next_deadline).min(mono_ns() + 1_000_000_000)
    }

    /// Waits for socket events until the next send or timeout. `epoll_pwait2` takes a
    /// nanosecond timeout (an hrtimer with this thread's 1 ns slack): one syscall per wake-up.
    /// Kernels before 5.11 lack it: then the absolute timerfd is armed and `epoll_wait` used.
    fn wait(&mut self, events: &mut [libc::epoll_event]) -> std::io::Result<usize> {
        let at = self.next_wake();
        let left = at.saturating_sub(mono_ns());
        if !self.no_pwait2 {
            match epoll_pwait2(self.epfd.as_raw_fd(), events, left) {
                Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => self.no_pwait2 = true,
                r => return r,
            }
        }
        if self.armed != at {
            timerfd_at(self.timer.as_raw_fd(), at);
            self.armed = at;
        }
        epoll_wait(self.epfd.as_raw_fd(), events, 1000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    fn targets(yaml: &str) -> Vec<Target> {
        crate::probe::parse(&format!("targets:\n{yaml}"))
            .unwrap()
            .targets
    }

    #[derive(Default)]
    struct Rec {
        interval: Mutex<Duration>,
        outcomes: Mutex<Vec<(usize, ProbeOutcome)>>,
        late: Mutex<Vec<Duration>>,
    }
    impl Sink for Rec {
        fn interval(&self, _: usize) -> Duration {
            *self.interval.lock().unwrap()
        }
        fn outcome(&self, i: usize, o: ProbeOutcome) {
            self.outcomes.lock().unwrap().push((i, o));
        }
        fn late(&self, late: Duration) {
            self.late.lock().unwrap().push(late);
        }
    }

    fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
        let end = std::time::Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(
                std::time::Instant::now() < end,
                "timed out waiting for {what}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// A tiny HTTP server on loopback answering every request with `status`.
    fn http_server(status: u16) -> std::net::SocketAddr {
        use std::io::{Read, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for s in l.incoming().take(2000) {
                let Ok(mut s) = s else { continue };
                let mut buf = [0u8; 512];
                let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
                if s.read(&mut buf).is_ok() {
                    let _ = write!(s, "HTTP/1.1 {status} X\r\nContent-Length: 0\r\n\r\n");
                }
            }
        });
        addr
    }

    /// The engine probes at the cadence it is given, switches to a finer one at once when
    /// woken (a step beginning), and every probe is a real exchange: tcp connects, http
    /// status lines judged, a refused port fails with the kernel's reason.
    #[test]
    fn the_engine_probes_at_its_cadence_and_switches_at_once() {
        let ok = http_server(200);
        let bad = http_server(503);
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let closed_port = closed.local_addr().unwrap().port();
        drop(closed);
        let ts = targets(&format!(
            "  - {{name: a, address: 127.0.0.1, port: {}, probe: tcp, timeout: 200ms}}\n  - {{name: b, address: 127.0.0.1, port: {}, probe: http, timeout: 200ms}}\n  - {{name: c, address: 127.0.0.1, port: {}, probe: http, timeout: 200ms}}\n  - {{name: d, address: 127.0.0.1, port: {closed_port}, probe: tcp, timeout: 200ms}}\n  - {{name: e, address: 127.0.0.1, probe: icmp, timeout: 200ms}}\n",
            ok.port(), ok.port(), bad.port()
        ));
        let rec = Arc::new(Rec::default());
        *rec.interval.lock().unwrap() = Duration::from_secs(3600);
        let e = Engine::start(&ts, rec.clone()).unwrap();
        // The first probe of each target leaves at once, then nothing for an hour.
        wait_for("first probes", || rec.outcomes.lock().unwrap().len() >= 5);
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(rec.outcomes.lock().unwrap().len(), 5);
        *rec.interval.lock().unwrap() = Duration::from_millis(10);
        e.wake();
        wait_for("a burst", || {
            rec.outcomes.lock().unwrap().len() >= 5 + 5 * 20
        });
        drop(e);
        let outcomes = rec.outcomes.lock().unwrap();
        for (i, o) in outcomes.iter() {
            match i {
                0 => assert!(o.ok && o.detail == "connected", "{o:?}"),
                1 => assert!(o.ok && o.detail == "HTTP 200", "{o:?}"),
                2 => assert!(
                    !o.ok && o.ran && o.detail == "HTTP 503, expected 200",
                    "{o:?}"
                ),
                3 => assert!(!o.ok && o.ran && o.detail.contains("refused"), "{o:?}"),
                _ => assert!(o.ok && o.detail == "echo reply", "{o:?}"),
            }
        }
        // Sends of one target are ~10 ms apart (no backlog, no bunching).
        let sent: Vec<f64> = outcomes
            .iter()
            .filter(|(i, _)| *i == 0)
            .map(|(_, o)| o.sent_at)
            .skip(1)
            .collect();
        let mut sorted = sent.clone();
        sorted.sort_by(f64::total_cmp);
        let gaps: Vec<f64> = sorted.windows(2).map(|w| w[1] - w[0]).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        assert!(
            (0.008..0.02).contains(&mean),
            "mean spacing {mean}: {gaps:?}"
        );
        assert!(!rec.late.lock().unwrap().is_empty());
    }

    /// A resolver that never answers our id, but sends stray datagrams with other ids every
    /// 30 ms: the probe still ends at its timeout (stray datagrams neither satisfy nor extend
    /// it), in the engine and in a one-shot probe.
    #[test]
    fn stray_datagrams_neither_answer_nor_extend_a_probe() {
        let server = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        server
            .set_read_timeout(Some(Duration::from_millis(20)))
            .unwrap();
        let port = server.local_addr().unwrap().port();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop2 = stop.clone();
        let t = std::thread::spawn(move || {
            let mut peers = Vec::new();
            let end = std::time::Instant::now() + Duration::from_secs(20);
            while !stop2.load(std::sync::atomic::Ordering::SeqCst)
                && std::time::Instant::now() < end
            {
                let mut buf = [0u8; 512];
                if let Ok((n, from)) = server.recv_from(&mut buf) {
                    let mut reply = buf[..n].to_vec();
                    reply[0] ^= 0xff; // another id
                    reply[2] |= 0x80;
                    peers.push((from, reply));
                }
                for (p, r) in &peers {
                    let _ = server.send_to(r, p);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        let ts = targets(&format!(
            "  - {{name: d, address: 127.0.0.1, port: {port}, probe: dns, query: a.test, timeout: 200ms}}\n"
        ));
        let o = run_once(&Spec::new(&ts[0]));
        assert!(!o.ok && o.ran, "{o:?}");
        assert_eq!(o.detail, "timeout after 200ms");
        assert_eq!(o.latency, Duration::from_millis(200));
        let rec = Arc::new(Rec::default());
        *rec.interval.lock().unwrap() = Duration::from_secs(3600);
        let started = std::time::Instant::now();
        let e = Engine::start(&ts, rec.clone()).unwrap();
        wait_for("the timeout", || !rec.outcomes.lock().unwrap().is_empty());
        let took = started.elapsed();
        drop(e);
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let _ = t.join();
        let o = &rec.outcomes.lock().unwrap()[0].1;
        assert_eq!(o.detail, "timeout after 200ms");
        assert!(
            took >= Duration::from_millis(195) && took < Duration::from_millis(400),
            "{took:?}"
        );
    }
}
