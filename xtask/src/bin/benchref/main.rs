//! `benchref`: the references `cargo xtask bench` measures stepguard against — the same
//! syscalls in a minimal loop (the physical limit of the work), with no runtime, no
//! allocation per probe, no bookkeeping.
//!
//! `benchref probes --interval 10ms --seconds 15 TARGET...` probes each target once per
//! interval, one after another on one thread, paced by `clock_nanosleep` on absolute times:
//! `tcp:ADDR:PORT` (socket, SO_LINGER, connect, poll, SO_ERROR, close), `http:ADDR:PORT/PATH`
//! (the same, then send the request, poll, recv), `dns:ADDR:PORT:NAME` (socket, connect,
//! send, poll, recv, close), `icmp:ADDR` (ping socket, sendto, poll, recv, close). Prints one
//! JSON line: probes, failures, user and system CPU, µs per probe, % of a core, and how late
//! each tick woke against its schedule (p50/p99/max). With `--observe BPFFS` (every
//! `--observe-every`, 10 s by default; `--count MAP,MAP` the maps whose entries it counts) it
//! also makes the steady agent's node observation, and with `--watch` the implicit-step
//! watcher's one program-id query per tick: the steady agent's own syscalls at its cadence.
use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::Duration;

fn mono_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into ts.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn sleep_until(ns: u64) {
    let ts = libc::timespec {
        tv_sec: (ns / 1_000_000_000) as i64,
        tv_nsec: (ns % 1_000_000_000) as i64,
    };
    // SAFETY: clock_nanosleep reads ts; EINTR just ends the sleep early.
    unsafe {
        libc::clock_nanosleep(
            libc::CLOCK_MONOTONIC,
            libc::TIMER_ABSTIME,
            &ts,
            std::ptr::null_mut(),
        )
    };
}

enum Target {
    Tcp(SocketAddrV4),
    Http(SocketAddrV4, Vec<u8>),
    Dns(SocketAddrV4, Vec<u8>),
    Icmp(Ipv4Addr),
}

fn parse(s: &str) -> Target {
    let (kind, rest) = s.split_once(':').expect("KIND:...");
    let addr =
        |a: &str| -> SocketAddrV4 { a.parse().unwrap_or_else(|_| panic!("bad address {a}")) };
    match kind {
        "tcp" => Target::Tcp(addr(rest)),
        "http" => {
            let (a, path) = rest.split_once('/').unwrap_or((rest, ""));
            let sa = addr(a);
            let req = format!(
                "GET /{path} HTTP/1.1\r\nHost: {}\r\nUser-Agent: stepguard\r\nConnection: close\r\n\r\n",
                sa.ip()
            );
            Target::Http(sa, req.into_bytes())
        }
        "dns" => {
            let (a, name) = rest.rsplit_once(':').expect("dns:ADDR:PORT:NAME");
            let mut q = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
            for label in name.trim_end_matches('.').split('.') {
                q.push(label.len() as u8);
                q.extend_from_slice(label.as_bytes());
            }
            q.extend_from_slice(&[0, 0, 1, 0, 1]);
            Target::Dns(addr(a), q)
        }
        "icmp" => Target::Icmp(rest.parse().expect("icmp:ADDR")),
        _ => panic!("unknown target kind {kind}"),
    }
}

fn sa(a: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as u16,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*a.ip()).to_be(),
        },
        sin_zero: [0; 8],
    }
}

const SALEN: u32 = std::mem::size_of::<libc::sockaddr_in>() as u32;

fn wait(fd: i32, ev: i16) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: ev,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    unsafe { libc::poll(&mut p, 1, 500) == 1 }
}

/// One probe; true when it succeeded.
fn probe(t: &Target, buf: &mut [u8]) -> bool {
    // SAFETY: plain socket syscalls on an fd owned here; buffers outlive the calls.
    unsafe {
        let nb = libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;
        match t {
            Target::Tcp(a) | Target::Http(a, _) => {
                let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | nb, 0);
                let l = libc::linger {
                    l_onoff: 1,
                    l_linger: 0,
                };
                libc::setsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    libc::SO_LINGER,
                    &l as *const _ as *const libc::c_void,
                    std::mem::size_of::<libc::linger>() as u32,
                );
                let s = sa(*a);
                libc::connect(fd, &s as *const _ as *const libc::sockaddr, SALEN);
                let mut ok = wait(fd, libc::POLLOUT);
                let mut err = 0i32;
                let mut len = 4u32;
                libc::getsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    libc::SO_ERROR,
                    &mut err as *mut _ as *mut libc::c_void,
                    &mut len,
                );
                ok &= err == 0;
                if let (true, Target::Http(_, req)) = (ok, t) {
                    libc::send(fd, req.as_ptr() as *const _, req.len(), libc::MSG_NOSIGNAL);
                    ok = wait(fd, libc::POLLIN)
                        && libc::recv(fd, buf.as_mut_ptr() as *mut _, buf.len(), 0) > 12
                        && buf.starts_with(b"HTTP/1.1 200");
                }
                libc::close(fd);
                ok
            }
            Target::Dns(a, q) => {
                let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | nb, 0);
                let s = sa(*a);
                libc::connect(fd, &s as *const _ as *const libc::sockaddr, SALEN);
                libc::send(fd, q.as_ptr() as *const _, q.len(), 0);
                let ok = wait(fd, libc::POLLIN)
                    && libc::recv(fd, buf.as_mut_ptr() as *mut _, buf.len(), 0) > 12;
                libc::close(fd);
                ok
            }
            Target::Icmp(ip) => {
                // One socket for every echo, as the agent's engine does.
                let fd = icmp_fd();
                if fd < 0 {
                    return false;
                }
                let mut pkt = [
                    8u8, 0, 0, 0, 0, 0, 0, 1, b's', b't', b'e', b'p', b'g', b'r', b'd', b'!',
                ];
                let mut sum = 0u32;
                for c in pkt.chunks(2) {
                    sum += u16::from_be_bytes([c[0], c[1]]) as u32;
                }
                while sum >> 16 != 0 {
                    sum = (sum & 0xffff) + (sum >> 16);
                }
                pkt[2..4].copy_from_slice(&(!(sum as u16)).to_be_bytes());
                let s = sa(SocketAddrV4::new(*ip, 0));
                libc::sendto(
                    fd,
                    pkt.as_ptr() as *const _,
                    pkt.len(),
                    0,
                    &s as *const _ as *const libc::sockaddr,
                    SALEN,
                );
                wait(fd, libc::POLLIN)
                    && libc::recv(fd, buf.as_mut_ptr() as *mut _, buf.len(), 0) >= 8
            }
        }
    }
}

/// The process's one ICMP socket (ping socket, else raw).
fn icmp_fd() -> i32 {
    static FD: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    *FD.get_or_init(|| {
        let nb = libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;
        // SAFETY: socket(2) with constant arguments.
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | nb, libc::IPPROTO_ICMP);
            if fd >= 0 {
                fd
            } else {
                libc::socket(libc::AF_INET, libc::SOCK_RAW | nb, libc::IPPROTO_ICMP)
            }
        }
    })
}

fn cpu_us() -> (u64, u64) {
    // SAFETY: getrusage writes into ru.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut ru);
        ru
    };
    let us = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
    (us(ru.ru_utime), us(ru.ru_stime))
}

fn duration(s: &str) -> Duration {
    match s.strip_suffix("ms") {
        Some(ms) => Duration::from_millis(ms.parse().expect("duration")),
        None => Duration::from_secs(s.trim_end_matches('s').parse().expect("duration")),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("observe") {
        // benchref observe BPFFS RUNS: the median wall time of RUNS observations.
        let bpffs = args.get(1).expect("observe BPFFS RUNS");
        let runs: usize = args.get(2).and_then(|r| r.parse().ok()).unwrap_or(5);
        let mut times = Vec::new();
        let mut last = (0, 0, 0, 0);
        for _ in 0..runs {
            let t = mono_ns();
            last = observe::run(bpffs);
            times.push(mono_ns() - t);
        }
        times.sort();
        println!(
            "{{\"median_ms\":{:.2},\"host_devices\":{},\"programs\":{},\"maps\":{},\"entries\":{}}}",
            times[times.len() / 2] as f64 / 1e6,
            last.0,
            last.1,
            last.2,
            last.3
        );
        return;
    }
    if args.first().map(String::as_str) != Some("probes") {
        eprintln!("usage: benchref probes --interval 10ms --seconds 15 KIND:TARGET... | benchref observe BPFFS RUNS");
        std::process::exit(2);
    }
    let mut interval = Duration::from_millis(10);
    let mut seconds = 15u64;
    let mut targets = Vec::new();
    // The steady agent's other work, at its cadence: an observation of the node every
    // `observe_every` (`--observe BPFFS`), and the implicit-step watcher's one program-id
    // query per tick (`--watch`).
    let mut observe_at: Option<String> = None;
    let mut observe_every = Duration::from_secs(10);
    let mut scope = observe::Scope {
        endpoints: true,
        count: Some(Vec::new()),
    };
    let mut watch = false;
    let mut it = args[1..].iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--interval" => interval = duration(it.next().expect("--interval VALUE")),
            "--seconds" => seconds = it.next().expect("--seconds N").parse().expect("seconds"),
            "--observe" => observe_at = Some(it.next().expect("--observe BPFFS").clone()),
            "--observe-every" => {
                observe_every = duration(it.next().expect("--observe-every VALUE"))
            }
            "--count" => {
                scope.count = Some(
                    it.next()
                        .expect("--count MAP,MAP")
                        .split(',')
                        .filter(|n| !n.is_empty())
                        .map(str::to_string)
                        .collect(),
                )
            }
            "--watch" => watch = true,
            t => targets.push(parse(t)),
        }
    }
    let mut observations = 0u64;
    // SAFETY: prctl with integer arguments: no slack on this thread's sleeps.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0) };
    let mut buf = [0u8; 1500];
    let (u0, s0) = cpu_us();
    let start = mono_ns();
    let end = start + seconds * 1_000_000_000;
    let step = interval.as_nanos() as u64;
    let (mut probes, mut failures) = (0u64, 0u64);
    let mut late = Vec::new();
    let mut due = start;
    let mut observe_due = start;
    while due < end {
        sleep_until(due);
        late.push(mono_ns().saturating_sub(due));
        for t in &targets {
            probes += 1;
            if !probe(t, &mut buf) {
                failures += 1;
            }
        }
        if watch {
            observe::next_prog_id(u32::MAX / 2);
        }
        if let Some(bpffs) = observe_at.as_deref().filter(|_| mono_ns() >= observe_due) {
            observe::run_scoped(bpffs, &scope);
            observations += 1;
            observe_due += observe_every.as_nanos() as u64;
        }
        due += step;
    }
    let wall = (mono_ns() - start) as f64 / 1e9;
    let (u1, s1) = cpu_us();
    let (user, sys) = (u1 - u0, s1 - s0);
    late.sort();
    let q = |f: f64| late[((late.len() - 1) as f64 * f) as usize] as f64 / 1e3;
    // Cumulative counts at the agent's send-delay histogram bounds (then +Inf), so both are
    // read into a quantile the same way.
    let bounds_us = [
        50u64, 100, 250, 500, 1000, 2000, 5000, 10000, 25000, 50000, 100000,
    ];
    let late_buckets: Vec<String> = bounds_us
        .iter()
        .map(|b| late.partition_point(|l| *l <= b * 1000))
        .chain([late.len()])
        .map(|c| c.to_string())
        .collect();
    let late_buckets = late_buckets.join(",");
    println!(
        "{{\"probes\":{probes},\"failures\":{failures},\"observations\":{observations},\"user_us\":{user},\"sys_us\":{sys},\"wall_s\":{wall:.3},\"us_per_probe\":{:.2},\"user_us_per_probe\":{:.2},\"sys_us_per_probe\":{:.2},\"cpu_percent\":{:.3},\"late_p50_us\":{:.1},\"late_p99_us\":{:.1},\"late_max_us\":{:.1},\"late_buckets\":[{late_buckets}]}}",
        (user + sys) as f64 / probes.max(1) as f64,
        user as f64 / probes.max(1) as f64,
        sys as f64 / probes.max(1) as f64,
        (user + sys) as f64 / 1e4 / wall,
        q(0.5),
        q(0.99),
        q(1.0)
    );
}

/// The devices+maps observation as bare syscalls: rtnetlink dumps of links, addresses and
/// routes (v4, v6), per host device (not lxc*) a tcx query and a tc filter dump per direction
/// and, per program found, an fd by id and its info; then per global map (not per-endpoint)
/// BPF_OBJ_GET, its info and, for hash-like maps, batched lookups to count entries. Nothing
/// is decoded beyond what the next syscall needs.
mod observe;
