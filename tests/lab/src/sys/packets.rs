//! Gratuitous ARPs and unsolicited neighbour advertisements, sent from a packet socket.
use super::fd_result;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

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
    /// first released, docs/research/l2-responder-restart.md): no Override flag and a
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
