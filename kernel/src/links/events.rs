//! rtnetlink notifications about host devices: a non-blocking socket subscribed to link,
//! address and route changes, drained when the agent next looks. It only answers "did
//! anything about a host device change since the last look?"; the dumps say what.
use netlink_packet_route::address::AddressMessage;
use netlink_packet_route::link::LinkAttribute;
use netlink_packet_route::route::{RouteAttribute, RouteMessage};
use netlink_packet_route::RouteNetlinkMessage;
use rtnetlink::packet_core::{NetlinkMessage, NetlinkPayload};
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const RTMGRP_LINK: u32 = 0x1;
const RTMGRP_IPV4_IFADDR: u32 = 0x10;
const RTMGRP_IPV4_ROUTE: u32 = 0x40;
const RTMGRP_IPV6_IFADDR: u32 = 0x100;
const RTMGRP_IPV6_ROUTE: u32 = 0x400;

/// A socket receiving link, address and route notifications of this network namespace.
pub fn subscribe() -> io::Result<OwnedFd> {
    // SAFETY: socket/bind/setsockopt on a fresh fd owned by the returned OwnedFd; the
    // sockaddr and the buffer size outlive the calls.
    unsafe {
        let fd = libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        );
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let fd = OwnedFd::from_raw_fd(fd);
        let mut sa: libc::sockaddr_nl = std::mem::zeroed();
        sa.nl_family = libc::AF_NETLINK as u16;
        sa.nl_groups = RTMGRP_LINK
            | RTMGRP_IPV4_IFADDR
            | RTMGRP_IPV4_ROUTE
            | RTMGRP_IPV6_IFADDR
            | RTMGRP_IPV6_ROUTE;
        if libc::bind(
            fd.as_raw_fd(),
            &sa as *const _ as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_nl>() as u32,
        ) < 0
        {
            return Err(io::Error::last_os_error());
        }
        // Room for bursts of endpoint churn between looks; an overflow reads as "changed".
        let size: libc::c_int = 1 << 20;
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            &size as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as u32,
        );
        Ok(fd)
    }
}

/// What the notifications since the last look said.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// A notification was about a host device (not an endpoint device: `lxc*` by name, or
    /// a known endpoint by ifindex), notifications were lost (the socket overflowed), or the
    /// socket failed.
    pub host: bool,
    /// Endpoint devices that appeared (by ifindex, with name and kind) and went away.
    pub endpoints_added: BTreeMap<u32, super::EndpointLink>,
    pub endpoints_removed: BTreeSet<u32>,
}

/// Drains the socket.
pub fn host_changes(fd: &OwnedFd, endpoints: &BTreeSet<u32>) -> Changes {
    let mut buf = vec![0u8; 64 * 1024];
    let mut c = Changes::default();
    loop {
        // SAFETY: buf is valid for writes of buf.len() bytes.
        let n = unsafe {
            libc::recv(
                fd.as_raw_fd(),
                buf.as_mut_ptr() as *mut libc::c_void,
                buf.len(),
                0,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EAGAIN) => return c,
                Some(libc::EINTR) => continue,
                // ENOBUFS: notifications were dropped; anything may have changed. The
                // socket stays usable.
                Some(libc::ENOBUFS) => {
                    c.host = true;
                    continue;
                }
                _ => {
                    tracing::debug!(error = %e, "rtnetlink notification socket failed");
                    c.host = true;
                    return c;
                }
            }
        }
        let mut off = 0usize;
        let n = n as usize;
        while off + 16 <= n {
            let len =
                u32::from_ne_bytes([buf[off], buf[off + 1], buf[off + 2], buf[off + 3]]) as usize;
            if len < 16 || off + len > n {
                c.host = true; // malformed: be safe
                break;
            }
            match NetlinkMessage::<RouteNetlinkMessage>::deserialize(&buf[off..off + len]) {
                Ok(m) => {
                    if let NetlinkPayload::InnerMessage(inner) = m.payload {
                        if about_host(&inner, endpoints, &mut c) {
                            c.host = true;
                        }
                    }
                }
                Err(_) => c.host = true,
            }
            off += (len + 3) & !3;
        }
    }
}

fn about_host(m: &RouteNetlinkMessage, endpoints: &BTreeSet<u32>, c: &mut Changes) -> bool {
    let endpoint =
        |i: u32, c: &Changes| endpoints.contains(&i) || c.endpoints_added.contains_key(&i);
    let link_name = |l: &netlink_packet_route::link::LinkMessage| {
        l.attributes.iter().find_map(|a| match a {
            LinkAttribute::IfName(n) => Some(n.clone()),
            _ => None,
        })
    };
    match m {
        RouteNetlinkMessage::NewLink(l) => {
            if let Some(n) = link_name(l).filter(|n| super::is_endpoint_device(n)) {
                c.endpoints_removed.remove(&l.header.index);
                c.endpoints_added.insert(
                    l.header.index,
                    super::EndpointLink {
                        name: n,
                        kind: super::link_kind(l),
                    },
                );
                false
            } else {
                true
            }
        }
        RouteNetlinkMessage::DelLink(l) => {
            if link_name(l).is_some_and(|n| super::is_endpoint_device(&n)) {
                c.endpoints_added.remove(&l.header.index);
                c.endpoints_removed.insert(l.header.index);
                false
            } else {
                true
            }
        }
        RouteNetlinkMessage::NewAddress(AddressMessage { header, .. })
        | RouteNetlinkMessage::DelAddress(AddressMessage { header, .. }) => {
            !endpoint(header.index, c)
        }
        RouteNetlinkMessage::NewRoute(r) | RouteNetlinkMessage::DelRoute(r) => {
            !route_oif(r).is_some_and(|i| endpoint(i, c))
        }
        _ => false,
    }
}

fn route_oif(r: &RouteMessage) -> Option<u32> {
    r.attributes.iter().find_map(|a| match a {
        RouteAttribute::Oif(i) => Some(*i),
        _ => None,
    })
}
