//! The LAN's addresses (IPv4 and, dual-stack, IPv6) and its L2-announced VIPs.
use serde::{Deserialize, Serialize};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

pub use crate::sim::addr::{node_addr, LAN_ROUTER};
/// The LAN client, where a witness runs.
pub const CLIENT_ADDR: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 100);
/// The port a witness in the client namespace listens on.
pub const WITNESS_PORT: u16 = 9310;
pub(super) const ZONE: &str = "lab.stepguard.test";

/// The LAN's IPv6 prefix (documentation range, RFC 3849), /64.
pub(super) const LAN6: [u16; 4] = [0x2001, 0xdb8, 0x113, 0];

pub(super) fn lan6(host: u16) -> Ipv6Addr {
    Ipv6Addr::new(LAN6[0], LAN6[1], LAN6[2], LAN6[3], 0, 0, 0, host)
}

/// Node `i`'s IPv6 address on a dual-stack LAN.
pub fn node_addr6(i: u8) -> Ipv6Addr {
    lan6(1 + i as u16)
}

/// The LAN client's IPv6 address on a dual-stack LAN.
pub fn client_addr6() -> Ipv6Addr {
    lan6(0x100)
}

/// An L2-announced LoadBalancer VIP on the LAN.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct LanVip {
    pub name: String,
    pub addr: IpAddr,
    pub port: u16,
    /// `http` or `dns`.
    pub probe: String,
}

impl LanVip {
    /// The VIP as an address with its host prefix length, as `ip addr` prints it.
    pub(super) fn cidr(&self) -> String {
        match self.addr {
            IpAddr::V4(a) => format!("{a}/32"),
            IpAddr::V6(a) => format!("{a}/128"),
        }
    }

    /// The node that holds its lease when the LAN comes up.
    pub(super) fn first_holder(&self) -> u8 {
        if matches!(self.name.as_str(), "dns-b" | "dns6") {
            1
        } else {
            0
        }
    }
}

/// The gateway (HTTP) and two DNS VIPs (two resolvers, like the PiHole replicas behind two
/// Services); their leases start on nodes 0, 0 and 1.
pub fn vips() -> Vec<LanVip> {
    let v = |name: &str, last: u8, port: u16, probe: &str| LanVip {
        name: name.into(),
        addr: Ipv4Addr::new(203, 0, 113, last).into(),
        port,
        probe: probe.into(),
    };
    vec![
        v("gateway", 200, 80, "http"),
        v("dns-a", 53, 53, "dns"),
        v("dns-b", 54, 53, "dns"),
    ]
}

/// The IPv6 VIPs of a dual-stack LAN: a gateway (HTTP) and a resolver; their leases start on
/// nodes 0 and 1.
pub fn vips6() -> Vec<LanVip> {
    let v = |name: &str, host: u16, port: u16, probe: &str| LanVip {
        name: name.into(),
        addr: lan6(host).into(),
        port,
        probe: probe.into(),
    };
    vec![v("gateway6", 0xc8, 80, "http"), v("dns6", 0x35, 53, "dns")]
}
