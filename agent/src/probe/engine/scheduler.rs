//! The engine's thread: one epoll set, sends timed by `epoll_pwait2` (an absolute timerfd before
//! 5.11), each target at the cadence its owner ([`Sink`]) gives, at most `MAX_IN_FLIGHT`
//! probes of a target at once, deadlines in a heap.
use super::*;

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

/// A running engine. Dropping it stops the thread.
pub struct Engine {
    pub(super) wake: Arc<OwnedFd>,
    pub(super) stop: Arc<std::sync::atomic::AtomicBool>,
    pub(super) thread: Option<std::thread::JoinHandle<()>>,
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

pub(super) const TOKEN_TIMER: u64 = u64::MAX;

pub(super) const TOKEN_WAKE: u64 = u64::MAX - 1;

pub(super) const TOKEN_ICMP: u64 = u64::MAX - 2;

pub(super) struct Slot {
    pub(super) op: Op,
    pub(super) target: usize,
    pub(super) gen: u32,
}

pub(super) struct Loop {
    pub(super) specs: Vec<Spec>,
    pub(super) sink: Arc<dyn Sink>,
    pub(super) wake: Arc<OwnedFd>,
    pub(super) epfd: OwnedFd,
    pub(super) timer: OwnedFd,
    pub(super) due: Vec<u64>,
    pub(super) cadence: Vec<u64>,
    pub(super) in_flight: Vec<usize>,
    pub(super) slots: Vec<Option<Slot>>,
    pub(super) free: Vec<usize>,
    pub(super) gen: u32,
    pub(super) deadlines: BinaryHeap<Reverse<(u64, usize, u32)>>,
    /// One ICMP socket for every echo without a `source` (socket, raw): an echo has no
    /// connection or flow for a fresh socket to stand for, so it saves two syscalls and a
    /// socket per probe (and a raw socket per probe would see every other probe's replies).
    pub(super) icmp: Option<(OwnedFd, bool)>,
    /// Echoes in flight on the shared socket: sequence number → (slot, generation).
    pub(super) icmp_ops: std::collections::BTreeMap<u16, (usize, u32)>,
    /// The kernel has no epoll_pwait2: the timerfd times the sends.
    pub(super) no_pwait2: bool,
    /// What the timerfd is armed for (0: nothing).
    pub(super) armed: u64,
}

impl Loop {
    pub(super) fn new(
        specs: Vec<Spec>,
        sink: Arc<dyn Sink>,
        wake: Arc<OwnedFd>,
    ) -> io::Result<Loop> {
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
        let icmp = if specs.iter().any(|s| {
            s.transport() == Some(Transport::Echo) && s.source.is_none() && s.addr.is_ipv4()
        }) {
            // Without one, each echo opens its own socket (and says why it cannot). IPv6
            // echoes always do.
            match icmp_socket(false) {
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

    pub(super) fn run(&mut self, stop: &std::sync::atomic::AtomicBool) {
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

    pub(super) fn send_due(&mut self, now: u64) {
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

    pub(super) fn launch(&mut self, i: usize) {
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

    pub(super) fn finish(&mut self, i: usize, op: Op, r: Finished) {
        let latency = Duration::from_nanos(mono_ns().saturating_sub(op.sent_ns));
        let o = outcome(&self.specs[i], op.sent_at, latency, r);
        drop(op); // closes the socket (RST for TCP) before the result is recorded
        self.sink.outcome(i, o);
    }

    pub(super) fn take(&mut self, slot: usize, gen: u32) -> Option<Slot> {
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

    pub(super) fn ready(&mut self, token: u64, _flags: u32) {
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
    pub(super) fn icmp_ready(&mut self) {
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
                wire::answered_seq(icmp).and_then(|seq| self.icmp_ops.get(&seq))
            else {
                continue;
            };
            let done = match self.slots.get(slot) {
                Some(Some(s)) if s.gen == gen => {
                    icmp_judge(datagram, from, self.specs[s.target].addr.ip(), &s.op)
                }
                _ => None,
            };
            if let Some(done) = done {
                if let Some(s) = self.take(slot, gen) {
                    self.finish(s.target, s.op, done);
                }
            }
        }
    }

    pub(super) fn expire(&mut self, now: u64) {
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
    pub(super) fn next_wake(&self) -> u64 {
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
    pub(super) fn wait(&mut self, events: &mut [libc::epoll_event]) -> std::io::Result<usize> {
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
