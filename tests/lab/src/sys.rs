//! The few bpf(2) commands the lab needs that aya does not expose: creating maps with Cilium's
//! names and shapes, writing their entries, pinning, and swapping a link's program.
//! Raw syscalls on purpose: the lab plays cilium-agent, which writes; the agent never does.
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_LINK_UPDATE: libc::c_long = 29;

pub const BPF_F_NO_PREALLOC: u32 = 1;

fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: attr is a #[repr(C)] prefix of union bpf_attr for `cmd`, valid for the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut T as *mut libc::c_void,
            std::mem::size_of::<T>(),
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn fd_result(r: libc::c_long) -> OwnedFd {
    // SAFETY: the kernel just returned this fd to us; nothing else owns it.
    unsafe { OwnedFd::from_raw_fd(r as RawFd) }
}

#[repr(C)]
#[derive(Default)]
struct MapCreate {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
    inner_map_fd: u32,
    numa_node: u32,
    map_name: [u8; 16],
}

/// BPF_MAP_CREATE. `name` is truncated to the kernel's 15 characters, as it is for Cilium.
pub fn map_create(
    map_type: u32,
    key: u32,
    value: u32,
    max: u32,
    flags: u32,
    name: &str,
) -> io::Result<OwnedFd> {
    let mut attr = MapCreate {
        map_type,
        key_size: key,
        value_size: value,
        max_entries: max,
        map_flags: flags,
        ..Default::default()
    };
    for (d, s) in attr.map_name.iter_mut().zip(
        name.bytes()
            .filter(|b| b.is_ascii_alphanumeric() || *b == b'_' || *b == b'.')
            .take(15),
    ) {
        *d = s;
    }
    bpf(BPF_MAP_CREATE, &mut attr).map(fd_result)
}

#[repr(C)]
struct MapElem {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

pub fn map_update(fd: &OwnedFd, key: &[u8], value: &[u8]) -> io::Result<()> {
    let mut attr = MapElem {
        map_fd: fd.as_raw_fd() as u32,
        _pad: 0,
        key: key.as_ptr() as u64,
        value: value.as_ptr() as u64,
        flags: 0,
    };
    bpf(BPF_MAP_UPDATE_ELEM, &mut attr).map(|_| ())
}

pub fn map_delete(fd: &OwnedFd, key: &[u8]) -> io::Result<()> {
    let mut attr = MapElem {
        map_fd: fd.as_raw_fd() as u32,
        _pad: 0,
        key: key.as_ptr() as u64,
        value: 0,
        flags: 0,
    };
    bpf(BPF_MAP_DELETE_ELEM, &mut attr).map(|_| ())
}

/// BPF_MAP_GET_NEXT_KEY; `None` at the end of the map.
pub fn map_next_key(fd: &OwnedFd, key: Option<&[u8]>, next: &mut [u8]) -> io::Result<bool> {
    let mut attr = MapElem {
        map_fd: fd.as_raw_fd() as u32,
        _pad: 0,
        key: key.map(|k| k.as_ptr() as u64).unwrap_or(0),
        value: next.as_mut_ptr() as u64,
        flags: 0,
    };
    match bpf(BPF_MAP_GET_NEXT_KEY, &mut attr) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

#[repr(C)]
struct ObjAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
}

pub fn obj_pin(fd: &impl AsRawFd, path: &Path) -> io::Result<()> {
    let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(io::Error::other)?;
    let mut attr = ObjAttr {
        pathname: c.as_ptr() as u64,
        bpf_fd: fd.as_raw_fd() as u32,
        file_flags: 0,
    };
    bpf(BPF_OBJ_PIN, &mut attr).map(|_| ())
}

pub fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(io::Error::other)?;
    let mut attr = ObjAttr {
        pathname: c.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
    };
    bpf(BPF_OBJ_GET, &mut attr).map(fd_result)
}

#[repr(C)]
struct LinkUpdate {
    link_fd: u32,
    new_prog_fd: u32,
    flags: u32,
    old_prog_fd: u32,
}

/// BPF_LINK_UPDATE: atomically replace the program behind a link (what Cilium does on restart).
pub fn link_update(link: &impl AsRawFd, prog: &impl AsRawFd) -> io::Result<()> {
    let mut attr = LinkUpdate {
        link_fd: link.as_raw_fd() as u32,
        new_prog_fd: prog.as_raw_fd() as u32,
        flags: 0,
        old_prog_fd: 0,
    };
    bpf(BPF_LINK_UPDATE, &mut attr).map(|_| ())
}

#[repr(C)]
struct InfoAttr {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

fn info_by_fd(fd: &impl AsRawFd, buf: &mut [u8]) -> io::Result<()> {
    let mut attr = InfoAttr {
        bpf_fd: fd.as_raw_fd() as u32,
        info_len: buf.len() as u32,
        info: buf.as_mut_ptr() as u64,
    };
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr).map(|_| ())
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_ne_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// ID of a program, map or link fd (the `id` field sits at offset 4 in all three info structs).
pub fn obj_id(fd: &impl AsRawFd) -> io::Result<u32> {
    let mut buf = [0u8; 256];
    info_by_fd(fd, &mut buf)?;
    Ok(u32_at(&buf, 4))
}

/// `prog_id` of a link (struct bpf_link_info: type, id, prog_id).
pub fn link_prog_id(link: &impl AsRawFd) -> io::Result<u32> {
    let mut buf = [0u8; 256];
    info_by_fd(link, &mut buf)?;
    Ok(u32_at(&buf, 8))
}

/// `key_size` of a map (struct bpf_map_info: type, id, key_size, value_size, ...).
pub fn map_key_size(map: &impl AsRawFd) -> io::Result<u32> {
    let mut buf = [0u8; 256];
    info_by_fd(map, &mut buf)?;
    Ok(u32_at(&buf, 8))
}

// --- rtnetlink: legacy tc filters, named the way Cilium names them --------------------------

const RTM_NEWTFILTER: u16 = 44;
const RTM_DELTFILTER: u16 = 45;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_CREATE: u16 = 0x400;
const TCA_KIND: u16 = 1;
const TCA_OPTIONS: u16 = 2;
const TCA_BPF_FD: u16 = 6;
const TCA_BPF_NAME: u16 = 7;
const TCA_BPF_FLAGS: u16 = 8;
const TCA_BPF_FLAG_ACT_DIRECT: u32 = 1;
const NLA_F_NESTED: u16 = 0x8000;
const TC_H_CLSACT: u32 = 0xffff_fff1;
const TC_H_MIN_INGRESS: u32 = 0xfff2;
const TC_H_MIN_EGRESS: u32 = 0xfff3;
const ETH_P_ALL: u16 = 0x0003;

fn nla(buf: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    let len = 4 + payload.len();
    buf.extend_from_slice(&(len as u16).to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(payload);
    while !buf.len().is_multiple_of(4) {
        buf.push(0);
    }
}

/// Adds/replaces (`prog = Some`) or deletes (`None`) the direct-action bpf filter at priority 1,
/// handle 1 on the clsact hook of `ifindex`, named `name` (e.g. `cil_from_netdev-eth0`).
/// Runs in the calling thread's network namespace.
pub fn tc_filter(ifindex: u32, egress: bool, prog: Option<(&dyn AsRawFd, &str)>) -> io::Result<()> {
    let parent = (TC_H_CLSACT & 0xffff_0000)
        | if egress {
            TC_H_MIN_EGRESS
        } else {
            TC_H_MIN_INGRESS
        };
    let mut body = Vec::new();
    // struct tcmsg: family, pad[3], ifindex, handle, parent, info (prio << 16 | protocol)
    body.extend_from_slice(&[libc::AF_UNSPEC as u8, 0, 0, 0]);
    body.extend_from_slice(&(ifindex as i32).to_ne_bytes());
    body.extend_from_slice(&1u32.to_ne_bytes());
    body.extend_from_slice(&parent.to_ne_bytes());
    body.extend_from_slice(&((1u32 << 16) | ETH_P_ALL.to_be() as u32).to_ne_bytes());
    nla(&mut body, TCA_KIND, b"bpf\0");
    let (msg_type, flags) = match prog {
        Some((fd, name)) => {
            let mut opts = Vec::new();
            nla(
                &mut opts,
                TCA_BPF_FD,
                &(fd.as_raw_fd() as u32).to_ne_bytes(),
            );
            let mut n = name.as_bytes().to_vec();
            n.push(0);
            nla(&mut opts, TCA_BPF_NAME, &n);
            nla(
                &mut opts,
                TCA_BPF_FLAGS,
                &TCA_BPF_FLAG_ACT_DIRECT.to_ne_bytes(),
            );
            nla(&mut body, TCA_OPTIONS | NLA_F_NESTED, &opts);
            (RTM_NEWTFILTER, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE)
        }
        None => (RTM_DELTFILTER, NLM_F_REQUEST | NLM_F_ACK),
    };
    let mut msg = Vec::with_capacity(16 + body.len());
    msg.extend_from_slice(&((16 + body.len()) as u32).to_ne_bytes());
    msg.extend_from_slice(&msg_type.to_ne_bytes());
    msg.extend_from_slice(&flags.to_ne_bytes());
    msg.extend_from_slice(&1u32.to_ne_bytes()); // seq
    msg.extend_from_slice(&0u32.to_ne_bytes()); // pid
    msg.extend_from_slice(&body);
    netlink_request(&msg)
}

/// Sends one rtnetlink request and waits for its ACK.
fn netlink_request(msg: &[u8]) -> io::Result<()> {
    // SAFETY: plain socket/send/recv on an fd we own; buffers outlive the calls.
    unsafe {
        let fd = libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        );
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let sock = OwnedFd::from_raw_fd(fd);
        if libc::send(
            sock.as_raw_fd(),
            msg.as_ptr() as *const libc::c_void,
            msg.len(),
            0,
        ) < 0
        {
            return Err(io::Error::last_os_error());
        }
        let mut buf = [0u8; 4096];
        let n = libc::recv(
            sock.as_raw_fd(),
            buf.as_mut_ptr() as *mut libc::c_void,
            buf.len(),
            0,
        );
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n >= 20 && u16::from_ne_bytes([buf[4], buf[5]]) == libc::NLMSG_ERROR as u16 {
            let err = i32::from_ne_bytes([buf[16], buf[17], buf[18], buf[19]]);
            if err != 0 {
                return Err(io::Error::from_raw_os_error(-err));
            }
        }
        Ok(())
    }
}

/// A packet socket for gratuitous ARPs and unsolicited neighbour advertisements, opened ahead
/// so that sending is quick (closing a packet socket waits for an RCU grace period: do it
/// after the timed part).
pub struct GarpSocket(OwnedFd);

const ETH_P_ARP: u16 = 0x0806;
const ETH_P_IPV6: u16 = 0x86dd;

impl GarpSocket {
    pub fn open() -> io::Result<GarpSocket> {
        // SAFETY: plain socket(2); the fd is owned below.
        let fd = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                (ETH_P_ARP.to_be()) as i32,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(GarpSocket(fd_result(fd as libc::c_long)))
    }

    /// Sends one gratuitous ARP from `mac` for `ip` to the broadcast address on interface
    /// `ifindex` of the socket's network namespace, as Cilium's L2 responder reconciler does
    /// when it adds a VIP's entry: `reply` (Cilium 1.16–1.18, `garp.SendOnInterfaceIdx`): an
    /// ARP *reply* with sender and target IP `ip` and target MAC broadcast; otherwise (1.19+,
    /// `gneigh`, commit 128aab97fd): an ARP *request* with sender = target = `ip`.
    pub fn send(
        &self,
        ifindex: u32,
        mac: [u8; 6],
        ip: std::net::Ipv4Addr,
        reply: bool,
    ) -> io::Result<()> {
        let mut frame = Vec::with_capacity(42);
        frame.extend_from_slice(&[0xff; 6]);
        frame.extend_from_slice(&mac);
        frame.extend_from_slice(&ETH_P_ARP.to_be_bytes());
        frame.extend_from_slice(&1u16.to_be_bytes()); // Ethernet
        frame.extend_from_slice(&0x0800u16.to_be_bytes()); // IPv4
        frame.extend_from_slice(&[6, 4]);
        frame.extend_from_slice(&(if reply { 2u16 } else { 1 }).to_be_bytes());
        frame.extend_from_slice(&mac);
        frame.extend_from_slice(&ip.octets());
        frame.extend_from_slice(&if reply { [0xff; 6] } else { [0; 6] });
        frame.extend_from_slice(&ip.octets());
        self.send_frame(ifindex, ETH_P_ARP, [0xff; 6], &frame)
    }

    /// Sends one unsolicited neighbour advertisement for `target` from `mac` to all nodes
    /// (ff02::1) on `ifindex`, from `src`, hop limit 255, as Cilium's `gneigh` ND sender does
    /// when its L2 responder adds an IPv6 VIP's entry (`gneighOnNewEntry`): `standard`
    /// (v1.20.2 `ndSender.Send`, cilium/cilium#46079): the Override flag and a *Target*
    /// link-layer address option, which moves a client's existing entry; otherwise (1.19 as
    /// first released, docs/research/issue-26-l2-responder.md): no Override flag and a
    /// *Source* link-layer address option, which a Linux client reads as no address at all
    /// (`ndisc_recv_na` takes only the target option): its entry keeps the old address.
    pub fn send_na(
        &self,
        ifindex: u32,
        mac: [u8; 6],
        src: std::net::Ipv6Addr,
        target: std::net::Ipv6Addr,
        standard: bool,
    ) -> io::Result<()> {
        let dst = std::net::Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);
        let mut icmp = Vec::with_capacity(32);
        icmp.extend_from_slice(&[136, 0, 0, 0]); // type, code, checksum (below)
        icmp.extend_from_slice(&[if standard { 0x20 } else { 0 }, 0, 0, 0]); // R=0 S=0 O
        icmp.extend_from_slice(&target.octets());
        icmp.extend_from_slice(&[if standard { 2 } else { 1 }, 1]); // option, 8 bytes
        icmp.extend_from_slice(&mac);
        let sum = icmpv6_checksum(src, dst, &icmp);
        icmp[2..4].copy_from_slice(&sum.to_be_bytes());
        let mut frame = Vec::with_capacity(14 + 40 + icmp.len());
        frame.extend_from_slice(&[0x33, 0x33, 0, 0, 0, 1]);
        frame.extend_from_slice(&mac);
        frame.extend_from_slice(&ETH_P_IPV6.to_be_bytes());
        frame.extend_from_slice(&[0x60, 0, 0, 0]);
        frame.extend_from_slice(&(icmp.len() as u16).to_be_bytes());
        frame.extend_from_slice(&[58, 255]); // ICMPv6, hop limit 255 (RFC 4861 7.1.2)
        frame.extend_from_slice(&src.octets());
        frame.extend_from_slice(&dst.octets());
        frame.extend_from_slice(&icmp);
        self.send_frame(ifindex, ETH_P_IPV6, [0x33, 0x33, 0, 0, 0, 1], &frame)
    }

    fn send_frame(&self, ifindex: u32, proto: u16, to: [u8; 6], frame: &[u8]) -> io::Result<()> {
        // SAFETY: sockaddr_ll is plain data; zeroed is a valid value.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_protocol = proto.to_be();
        addr.sll_ifindex = ifindex as i32;
        addr.sll_halen = 6;
        addr.sll_addr[..6].copy_from_slice(&to);
        // SAFETY: frame and addr are valid for the call.
        let r = unsafe {
            libc::sendto(
                self.0.as_raw_fd(),
                frame.as_ptr() as *const libc::c_void,
                frame.len(),
                0,
                &addr as *const libc::sockaddr_ll as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if r < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    }
}

/// The ICMPv6 checksum of `msg` (its checksum field zero) from `src` to `dst` (RFC 8200 8.1).
fn icmpv6_checksum(src: std::net::Ipv6Addr, dst: std::net::Ipv6Addr, msg: &[u8]) -> u16 {
    let mut pseudo = Vec::with_capacity(40 + msg.len() + 1);
    pseudo.extend_from_slice(&src.octets());
    pseudo.extend_from_slice(&dst.octets());
    pseudo.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    pseudo.extend_from_slice(&[0, 0, 0, 58]);
    pseudo.extend_from_slice(msg);
    if pseudo.len() % 2 == 1 {
        pseudo.push(0);
    }
    let mut sum: u32 = pseudo
        .chunks(2)
        .map(|c| u16::from_be_bytes([c[0], c[1]]) as u32)
        .sum();
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

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

/// Now, in unix nanoseconds: the instants the lab records as truth.
pub fn now_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos()
}
