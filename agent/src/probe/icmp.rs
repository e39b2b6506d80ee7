//! `icmp`: an echo request; the echo reply is the answer, an unreachable is a failure.
//! IPv4 (ICMP) and IPv6 (ICMPv6), no port, no options. The engine's echo transport builds the
//! request, sends it and judges what comes back (the wire format is `engine/wire.rs`): an
//! unprivileged ping socket when the kernel allows it, else a raw socket with CAP_NET_RAW; for
//! IPv4 one socket shared by the targets without a `source`, for IPv6 a socket per echo.
use super::contract::Progress;
use super::contract::{Exchange, Probe, Transport};
use super::kind::{Kind, Problem};
use super::ProbeError;
use crate::config::Target;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::Arc;

pub struct Icmp;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Options {}

#[derive(Debug)]
struct Echo;

impl Kind for Icmp {
    fn name(&self) -> &'static str {
        "icmp"
    }
    fn default_port(&self) -> Option<u16> {
        None
    }
    fn has_port(&self) -> bool {
        false
    }
    fn prepare(&self, t: &Target) -> Result<Arc<dyn Probe>, Problem> {
        let Options {} = super::kind::options(t)?;
        Ok(Arc::new(Echo))
    }
}

impl Probe for Echo {
    fn transport(&self) -> Transport {
        Transport::Echo
    }
    fn exchange(self: Arc<Self>, _addr: SocketAddr) -> Box<dyn Exchange> {
        Box::new(NotAStream)
    }
}

/// Echoes have no stream or datagram exchange (the engine's echo transport sends them).
struct NotAStream;

impl Exchange for NotAStream {
    fn open(&mut self, _fd: RawFd) -> Progress {
        Progress::Done(Err(ProbeError::unsupported(
            "icmp",
            "echoes use the echo transport",
        )))
    }
    fn ready(&mut self, fd: RawFd) -> Progress {
        self.open(fd)
    }
}
