use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

fn nl() -> OwnedFd {
    // SAFETY: a fresh netlink socket, owned at once.
    unsafe {
        OwnedFd::from_raw_fd(libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        ))
    }
}

/// One dump request; calls `each(type, body)` for every message until NLMSG_DONE.
fn dump(fd: &OwnedFd, ty: u16, payload: &[u8], buf: &mut [u8], mut each: impl FnMut(u16, &[u8])) {
    let mut req = Vec::with_capacity(16 + payload.len());
    req.extend_from_slice(&((16 + payload.len()) as u32).to_ne_bytes());
    req.extend_from_slice(&ty.to_ne_bytes());
    req.extend_from_slice(&((libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16).to_ne_bytes());
    req.extend_from_slice(&1u32.to_ne_bytes());
    req.extend_from_slice(&0u32.to_ne_bytes());
    req.extend_from_slice(payload);
    // SAFETY: req and buf are valid for the calls.
    unsafe { libc::send(fd.as_raw_fd(), req.as_ptr() as *const _, req.len(), 0) };
    loop {
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr() as *mut _, buf.len(), 0) };
        if n <= 0 {
            return;
        }
        let mut off = 0usize;
        while off + 16 <= n as usize {
            let len = u32::from_ne_bytes(buf[off..off + 4].try_into().unwrap()) as usize;
            let t = u16::from_ne_bytes(buf[off + 4..off + 6].try_into().unwrap());
            if len < 16 || t == libc::NLMSG_DONE as u16 || t == libc::NLMSG_ERROR as u16 {
                return;
            }
            each(t, &buf[off + 16..off + len]);
            off += (len + 3) & !3;
        }
    }
}

/// rtattrs from `b`: (type, value).
fn attrs(mut b: &[u8]) -> Vec<(u16, &[u8])> {
    let mut v = Vec::new();
    while b.len() >= 4 {
        let len = u16::from_ne_bytes([b[0], b[1]]) as usize;
        let t = u16::from_ne_bytes([b[2], b[3]]) & 0x3fff;
        if len < 4 || len > b.len() {
            break;
        }
        v.push((t, &b[4..len]));
        b = &b[((len + 3) & !3).min(b.len())..];
    }
    v
}

fn bpf<T>(cmd: i64, attr: &mut T) -> i64 {
    // SAFETY: attr is a repr(C) prefix of bpf_attr for cmd.
    unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut T as *mut libc::c_void,
            std::mem::size_of::<T>(),
        )
    }
}

fn info_of(fd: i32, buf: &mut [u8]) {
    #[repr(C)]
    struct A {
        fd: u32,
        len: u32,
        info: u64,
    }
    let mut a = A {
        fd: fd as u32,
        len: buf.len() as u32,
        info: buf.as_mut_ptr() as u64,
    };
    bpf(15, &mut a);
}

/// A tcx query of one device and direction: the attached programs' ids (up to 64) and
/// how many there are (no allocation: the loop stays minimal).
fn tcx_query(ifindex: u32, attach: u32) -> ([u32; 64], usize) {
    #[repr(C)]
    #[derive(Default)]
    struct Q {
        ifindex: u32,
        attach: u32,
        qflags: u32,
        aflags: u32,
        ids: u64,
        count: u32,
        pad: u32,
        f: [u64; 4],
    }
    let mut ids = [0u32; 64];
    let mut q = Q {
        ifindex,
        attach,
        ids: ids.as_mut_ptr() as u64,
        count: 64,
        ..Default::default()
    };
    let n = if bpf(16, &mut q) == 0 {
        (q.count as usize).min(64)
    } else {
        0
    };
    (ids, n)
}

fn prog(id: u32) {
    #[repr(C)]
    struct A {
        id: u32,
        next: u32,
        flags: u32,
    }
    let mut a = A {
        id,
        next: 0,
        flags: 0,
    };
    let fd = bpf(13, &mut a);
    if fd >= 0 {
        let mut b = [0u8; 256];
        info_of(fd as i32, &mut b);
        // SAFETY: closing the fd just returned.
        unsafe { libc::close(fd as i32) };
    }
}

/// What one observation covers beyond the host devices and the map pins.
#[derive(Default)]
pub struct Scope {
    /// Every endpoint device (`lxc*`) too: a tcx query per direction, as the agent's
    /// steady observation reads every endpoint's programs (their names already known).
    pub endpoints: bool,
    /// The maps whose entries are counted (None: every hash-like map, as a person's
    /// one-off check counts; the agent's steady loop counts only the maps it names).
    pub count: Option<Vec<String>>,
}

/// Returns (host devices, programs, maps opened, entries counted).
pub fn run(bpffs: &str) -> (usize, usize, usize, u64) {
    run_scoped(bpffs, &Scope::default())
}

/// One BPF_PROG_GET_NEXT_ID: whether a program above `id` exists (the agent's
/// implicit-step watcher asks this once a second).
pub fn next_prog_id(id: u32) -> bool {
    #[repr(C)]
    struct A {
        id: u32,
        next: u32,
        flags: u32,
    }
    let mut a = A {
        id,
        next: 0,
        flags: 0,
    };
    bpf(11, &mut a) == 0
}

pub fn run_scoped(bpffs: &str, scope: &Scope) -> (usize, usize, usize, u64) {
    let fd = nl();
    let mut buf = vec![0u8; 1 << 16];
    let mut host = Vec::new();
    let mut lxc = Vec::new();
    dump(&fd, libc::RTM_GETLINK, &[0u8; 16], &mut buf, |_, b| {
        if b.len() < 16 {
            return;
        }
        let index = i32::from_ne_bytes(b[4..8].try_into().unwrap());
        for (t, v) in attrs(&b[16..]) {
            if t == libc::IFLA_IFNAME {
                if !v.starts_with(b"lxc") {
                    host.push(index);
                } else {
                    lxc.push(index);
                }
                break;
            }
        }
    });
    dump(&fd, libc::RTM_GETADDR, &[0u8; 8], &mut buf, |_, _| {});
    for family in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
        let mut rt = [0u8; 12];
        rt[0] = family;
        dump(&fd, libc::RTM_GETROUTE, &rt, &mut buf, |_, _| {});
    }
    let mut progs = 0;
    for &ifindex in &host {
        for attach in [46u32, 47] {
            // Per program found, an fd by id and its info (a host device's names are read).
            let (ids, n) = tcx_query(ifindex as u32, attach);
            for &id in &ids[..n] {
                prog(id);
                progs += 1;
            }
        }
        for parent in [0xFFFF_FFF2u32, 0xFFFF_FFF3] {
            let mut tc = [0u8; 20];
            tc[4..8].copy_from_slice(&ifindex.to_ne_bytes());
            tc[12..16].copy_from_slice(&parent.to_ne_bytes());
            let mut ids = Vec::new();
            dump(&fd, libc::RTM_GETTFILTER, &tc, &mut buf, |_, b| {
                if b.len() < 20 {
                    return;
                }
                for (t, v) in attrs(&b[20..]) {
                    if t == 2 {
                        // TCA_OPTIONS → TCA_BPF_ID
                        for (t2, v2) in attrs(v) {
                            if t2 == 11 && v2.len() >= 4 {
                                ids.push(u32::from_ne_bytes(v2[..4].try_into().unwrap()));
                            }
                        }
                    }
                }
            });
            for id in ids {
                prog(id);
                progs += 1;
            }
        }
    }
    if scope.endpoints {
        for &ifindex in &lxc {
            for attach in [46u32, 47] {
                progs += tcx_query(ifindex as u32, attach).1;
            }
        }
    }
    let (mut maps, mut entries) = (0, 0u64);
    let dir = format!("{bpffs}/tc/globals");
    for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        let per_endpoint = ["cilium_policy_", "cilium_calls_"].iter().any(|p| {
            name.strip_prefix(p)
                .is_some_and(|t| t.bytes().last().is_some_and(|b| b.is_ascii_digit()))
        });
        if per_endpoint {
            continue;
        }
        let path = std::ffi::CString::new(format!("{dir}/{name}")).unwrap();
        #[repr(C)]
        struct G {
            path: u64,
            fd: u32,
            flags: u32,
        }
        let mut g = G {
            path: path.as_ptr() as u64,
            fd: 0,
            flags: 1 << 3,
        };
        let fd = bpf(7, &mut g);
        if fd < 0 {
            continue;
        }
        maps += 1;
        let mut info = [0u8; 128];
        info_of(fd as i32, &mut info);
        let ty = u32::from_ne_bytes(info[0..4].try_into().unwrap());
        let ks = u32::from_ne_bytes(info[8..12].try_into().unwrap()) as usize;
        let vs = u32::from_ne_bytes(info[12..16].try_into().unwrap()) as usize;
        let counted = scope
            .count
            .as_ref()
            .is_none_or(|names| names.iter().any(|n| *n == name));
        // hash, lru hash, lpm trie (percpu variants excluded for brevity: same syscalls)
        if counted && matches!(ty, 1 | 9 | 11) {
            let chunk = ((1usize << 20) / (ks + vs).max(1)).clamp(64, 8192);
            let mut keys = vec![0u8; chunk * ks];
            let mut vals = vec![0u8; chunk * vs];
            let mut tin = vec![0u8; ks.max(8)];
            let mut tout = vec![0u8; ks.max(8)];
            let mut first = true;
            loop {
                #[repr(C)]
                struct B {
                    inb: u64,
                    outb: u64,
                    keys: u64,
                    vals: u64,
                    count: u32,
                    fd: u32,
                    ef: u64,
                    f: u64,
                }
                let mut b = B {
                    inb: if first { 0 } else { tin.as_mut_ptr() as u64 },
                    outb: tout.as_mut_ptr() as u64,
                    keys: keys.as_mut_ptr() as u64,
                    vals: vals.as_mut_ptr() as u64,
                    count: chunk as u32,
                    fd: fd as u32,
                    ef: 0,
                    f: 0,
                };
                let r = bpf(24, &mut b);
                entries += b.count as u64;
                if r < 0 {
                    break;
                }
                tin.copy_from_slice(&tout);
                first = false;
            }
        }
        // SAFETY: closing the fd just opened.
        unsafe { libc::close(fd as i32) };
    }
    (host.len(), progs, maps, entries)
}
