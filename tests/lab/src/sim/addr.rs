//! The simulated node's addresses: the fabric's VIPs and zone, the node's and fabric's
//! interfaces, pods, health endpoints and the overlay, and a node's place on a LAN segment.
use std::net::Ipv4Addr;

pub const GATEWAY_VIP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 10);
pub const GATEWAY_PORT: u16 = 80;
/// The gateway's TLS port (nginx; a certificate for `gateway.<DNS_ZONE>` signed by the lab's
/// CA, [`Lab::gateway_ca`]).
pub const GATEWAY_TLS_PORT: u16 = 443;
pub const DNS_VIP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 53);
pub const DNS_PORT: u16 = 53;
pub const DNS_ZONE: &str = "lab.stepguard.test";
pub(super) const NODE_ETH0: &str = "192.0.2.1";
pub(super) const FABRIC_ETH0: &str = "192.0.2.254";
pub(super) const NODE_ETH1: &str = "203.0.113.1";
pub(super) const FABRIC_ETH1: &str = "203.0.113.254";
pub(super) const CILIUM_HOST_IP: &str = "169.254.100.1";
/// Cilium's VXLAN overlay device (tunnel routing mode).
pub(super) const OVERLAY: &str = "cilium_vxlan";

/// Node `index`'s pod CIDR is `169.254.<101 + 20 * index>.0/24` (a single-node lab is node 0).
pub fn pod_cidr(index: u8) -> String {
    format!("169.254.{}.0/24", 101 + 20 * index as u32)
}

/// Node `index`'s health endpoint (Cilium's `cilium-health` endpoint: an address from the
/// node's pod CIDR, answering HTTP on 4240), the first address of its pod CIDR.
pub fn health_ip(index: u8) -> Ipv4Addr {
    Ipv4Addr::new(169, 254, 101 + 20 * index, 1)
}

/// Pod `i`'s address on node `index`.
pub fn pod_addr(index: u8, i: u32) -> Ipv4Addr {
    Ipv4Addr::from(pod_ip(index, i))
}

/// The port Cilium's health endpoint answers on (`/hello`).
pub const HEALTH_PORT: u16 = 4240;

/// Node `index`'s address on the overlay device (the peers' routes point at it).
pub(super) fn overlay_ip(index: u8) -> Ipv4Addr {
    Ipv4Addr::new(169, 254, 200, 1 + index)
}

pub(super) fn lxc_name(prefix: &str, i: u32) -> String {
    // Cilium names host-side veths `lxc` + 11 hex characters of a hash.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in prefix.bytes().chain(i.to_le_bytes()) {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    format!("lxc{:011x}", h & 0xfff_ffff_ffff)
}

pub(super) fn pod_ip(node: u8, i: u32) -> [u8; 4] {
    [
        169,
        254,
        (101 + 20 * node as u32 + i / 250) as u8,
        (i % 250 + 2) as u8,
    ]
}

/// The LAN's router address (nothing answers there; the nodes' second default route).
pub const LAN_ROUTER: &str = "203.0.113.254";

/// Node `i`'s address on the LAN.
pub fn node_addr(i: u8) -> Ipv4Addr {
    Ipv4Addr::new(203, 0, 113, 1 + i)
}
