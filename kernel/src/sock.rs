//! The probe engine's syscalls, each behind a safe function: non-blocking sockets, epoll,
//! eventfd and timerfd, CLOCK_MONOTONIC. What is sent, when and how an answer is judged is
//! the engine's (`probe::engine`); nothing here keeps state.
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// CLOCK_MONOTONIC in nanoseconds (the clock the engine's timerfd runs on).
pub fn mono_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into ts, which outlives the call.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn last_err() -> io::Error {
    io::Error::last_os_error()
}

fn sockaddr(a: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: an all-zero sockaddr_storage is valid; the casts write within its size.
    unsafe {
        let mut ss: libc::sockaddr_storage = std::mem::zeroed();
        let len = match a {
            SocketAddr::V4(v4) => {
                let sin = &mut ss as *mut _ as *mut libc::sockaddr_in;
                (*sin).sin_family = libc::AF_INET as u16;
                (*sin).sin_port = v4.port().to_be();
                (*sin).sin_addr.s_addr = u32::from(*v4.ip()).to_be();
                std::mem::size_of::<libc::sockaddr_in>()
            }
            SocketAddr::V6(v6) => {
                let sin6 = &mut ss as *mut _ as *mut libc::sockaddr_in6;
                (*sin6).sin6_family = libc::AF_INET6 as u16;
                (*sin6).sin6_port = v6.port().to_be();
                (*sin6).sin6_addr.s6_addr = v6.ip().octets();
                (*sin6).sin6_scope_id = v6.scope_id();
                std::mem::size_of::<libc::sockaddr_in6>()
            }
        };
        (ss, len as libc::socklen_t)
    }
}

pub fn new_socket(domain: i32, ty: i32, proto: i32) -> io::Result<OwnedFd> {
    // SAFETY: socket(2) returns a new fd or -1; a new fd is owned by the OwnedFd.
    let fd = unsafe { libc::socket(domain, ty | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, proto) };
    if fd < 0 {
        return Err(last_err());
    }
    // SAFETY: fd is a fresh, valid descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

pub fn bind(fd: RawFd, a: SocketAddr) -> io::Result<()> {
    let (ss, len) = sockaddr(a);
    // SAFETY: ss is a valid sockaddr of length len for the call's duration.
    if unsafe { libc::bind(fd, &ss as *const _ as *const libc::sockaddr, len) } < 0 {
        return Err(last_err());
    }
    Ok(())
}

/// connect(2): Ok(true) connected, Ok(false) in progress.
pub fn connect(fd: RawFd, a: SocketAddr) -> io::Result<bool> {
    let (ss, len) = sockaddr(a);
    // SAFETY: ss is a valid sockaddr of length len for the call's duration.
    if unsafe { libc::connect(fd, &ss as *const _ as *const libc::sockaddr, len) } == 0 {
        return Ok(true);
    }
    let e = last_err();
    match e.raw_os_error() {
        Some(libc::EINPROGRESS) => Ok(false),
        _ => Err(e),
    }
}

pub fn send(fd: RawFd, b: &[u8]) -> io::Result<usize> {
    // SAFETY: b is valid for reads of b.len() bytes.
    let n = unsafe {
        libc::send(
            fd,
            b.as_ptr() as *const libc::c_void,
            b.len(),
            libc::MSG_NOSIGNAL,
        )
    };
    if n < 0 {
        return Err(last_err());
    }
    Ok(n as usize)
}

/// recvfrom(2) into `buf`: (length, IPv4 or IPv6 source if any).
pub fn recv(fd: RawFd, buf: &mut [u8]) -> io::Result<(usize, Option<IpAddr>)> {
    // SAFETY: buf is valid for writes of buf.len() bytes; from is a zeroed sockaddr_storage,
    // large enough for any source address.
    unsafe {
        let mut from: libc::sockaddr_storage = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        let n = libc::recvfrom(
            fd,
            buf.as_mut_ptr() as *mut libc::c_void,
            buf.len(),
            0,
            &mut from as *mut _ as *mut libc::sockaddr,
            &mut len,
        );
        if n < 0 {
            return Err(last_err());
        }
        let src = match from.ss_family as i32 {
            libc::AF_INET => {
                let sin = &from as *const _ as *const libc::sockaddr_in;
                Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                    (*sin).sin_addr.s_addr,
                ))))
            }
            libc::AF_INET6 => {
                let sin6 = &from as *const _ as *const libc::sockaddr_in6;
                Some(IpAddr::V6(Ipv6Addr::from((*sin6).sin6_addr.s6_addr)))
            }
            _ => None,
        };
        Ok((n as usize, src))
    }
}

pub fn so_error(fd: RawFd) -> io::Result<()> {
    let mut err: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes an int into err, which outlives the call.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ERROR,
            &mut err as *mut _ as *mut libc::c_void,
            &mut len,
        )
    };
    if r < 0 {
        return Err(last_err());
    }
    if err != 0 {
        return Err(io::Error::from_raw_os_error(err));
    }
    Ok(())
}

pub fn set_zero_linger(fd: RawFd) -> io::Result<()> {
    let l = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt reads a linger struct that outlives the call.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            &l as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::linger>() as u32,
        )
    };
    if r < 0 {
        return Err(last_err());
    }
    Ok(())
}

pub fn poll_one(fd: RawFd, events: u32, timeout_ms: i32) -> io::Result<bool> {
    let mut p = libc::pollfd {
        fd,
        events: events as i16,
        revents: 0,
    };
    // SAFETY: p is one valid pollfd for the call's duration.
    let n = unsafe { libc::poll(&mut p, 1, timeout_ms) };
    if n < 0 {
        let e = last_err();
        if e.raw_os_error() == Some(libc::EINTR) {
            return Ok(false);
        }
        return Err(e);
    }
    Ok(n > 0)
}

pub fn epoll_ctl(ep: RawFd, op: i32, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
    let mut ev = libc::epoll_event { events, u64: token };
    // SAFETY: ev is valid for the call's duration.
    if unsafe { libc::epoll_ctl(ep, op, fd, &mut ev) } < 0 {
        return Err(last_err());
    }
    Ok(())
}

/// sendto(2) of one datagram to `to`.
pub fn send_to(fd: RawFd, b: &[u8], to: SocketAddr) -> io::Result<usize> {
    let (ss, len) = sockaddr(to);
    // SAFETY: b and ss are valid for the call's duration.
    let n = unsafe {
        libc::sendto(
            fd,
            b.as_ptr() as *const libc::c_void,
            b.len(),
            0,
            &ss as *const _ as *const libc::sockaddr,
            len,
        )
    };
    if n < 0 {
        return Err(last_err());
    }
    Ok(n as usize)
}

/// A non-blocking eventfd (the engine's wake-up).
pub fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: eventfd returns a new fd or -1.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(last_err());
    }
    // SAFETY: fd is fresh and owned here.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Adds one to an eventfd's counter (a wake-up; a full counter is already awake).
pub fn eventfd_signal(fd: &OwnedFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from `one`, which outlives the call.
    unsafe { libc::write(fd.as_raw_fd(), &one as *const u64 as *const libc::c_void, 8) };
}

/// Reads (and so resets) an eventfd's or a timerfd's 8-byte counter; nothing when none is due.
pub fn drain_counter(fd: RawFd) {
    let mut v: u64 = 0;
    // SAFETY: reads at most 8 bytes into v, which outlives the call.
    unsafe { libc::read(fd, &mut v as *mut u64 as *mut libc::c_void, 8) };
}

/// A new epoll set.
pub fn epoll_create() -> io::Result<OwnedFd> {
    // SAFETY: epoll_create1 returns a new fd or -1.
    let e = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if e < 0 {
        return Err(last_err());
    }
    // SAFETY: e is fresh and owned here.
    Ok(unsafe { OwnedFd::from_raw_fd(e) })
}

/// A non-blocking CLOCK_MONOTONIC timerfd.
pub fn timerfd_monotonic() -> io::Result<OwnedFd> {
    // SAFETY: timerfd_create returns a new fd or -1.
    let t = unsafe {
        libc::timerfd_create(
            libc::CLOCK_MONOTONIC,
            libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
        )
    };
    if t < 0 {
        return Err(last_err());
    }
    // SAFETY: t is fresh and owned here.
    Ok(unsafe { OwnedFd::from_raw_fd(t) })
}

/// Arms a timerfd to fire once at the absolute CLOCK_MONOTONIC instant `at_ns`.
pub fn timerfd_at(fd: RawFd, at_ns: u64) {
    let spec = libc::itimerspec {
        it_interval: libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        },
        it_value: libc::timespec {
            tv_sec: (at_ns / 1_000_000_000) as i64,
            tv_nsec: (at_ns % 1_000_000_000).max(1) as i64,
        },
    };
    // SAFETY: spec is valid for the call; the old value is not asked for.
    unsafe { libc::timerfd_settime(fd, libc::TFD_TIMER_ABSTIME, &spec, std::ptr::null_mut()) };
}

/// `epoll_pwait2(2)` (Linux 5.11), the same number on every architecture.
const SYS_EPOLL_PWAIT2: libc::c_long = 441;

/// `epoll_pwait2` with a nanosecond timeout: the events ready, or the error (ENOSYS on
/// kernels before 5.11).
pub fn epoll_pwait2(
    ep: RawFd,
    events: &mut [libc::epoll_event],
    timeout_ns: u64,
) -> io::Result<usize> {
    let ts = libc::timespec {
        tv_sec: (timeout_ns / 1_000_000_000) as i64,
        tv_nsec: (timeout_ns % 1_000_000_000) as i64,
    };
    // SAFETY: events is valid for writes of events.len() entries; ts outlives the call; no
    // signal mask.
    let n = unsafe {
        libc::syscall(
            SYS_EPOLL_PWAIT2,
            ep,
            events.as_mut_ptr(),
            events.len() as i32,
            &ts as *const libc::timespec,
            std::ptr::null::<libc::sigset_t>(),
            0usize,
        )
    };
    if n < 0 {
        return Err(last_err());
    }
    Ok(n as usize)
}

/// `epoll_wait` with a millisecond timeout.
pub fn epoll_wait(
    ep: RawFd,
    events: &mut [libc::epoll_event],
    timeout_ms: i32,
) -> io::Result<usize> {
    // SAFETY: events is valid for writes of events.len() entries.
    let n = unsafe { libc::epoll_wait(ep, events.as_mut_ptr(), events.len() as i32, timeout_ms) };
    if n < 0 {
        return Err(last_err());
    }
    Ok(n as usize)
}

/// Asks for 1 ns of timer slack on the calling thread (its sends are timed by hrtimers).
pub fn set_timer_slack_1ns() {
    // SAFETY: prctl with integer arguments.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0) };
}
