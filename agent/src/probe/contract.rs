//! What a probe kind and the engine agree on: a kind's prepared [`Probe`] says how its packets
//! travel ([`Transport`]) and gives each probe an [`Exchange`] on its connected socket; the
//! exchange answers every event with [`Progress`]. The engine ([`super::engine`]) knows this
//! file, not the kinds; each kind knows this file, not the engine.
use super::ProbeError;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::RawFd;
use std::sync::Arc;

/// How a probe's packets travel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// A TCP connection (closed with RST); the exchange begins once it is established.
    Stream,
    /// A connected UDP socket; the exchange sends the first datagram.
    Datagram,
    /// An ICMP echo on the engine's shared socket (or one of its own with a `source`).
    Echo,
}

/// A target's prepared probes.
pub trait Probe: Send + Sync + std::fmt::Debug {
    fn transport(&self) -> Transport;
    /// One probe's exchange on a connected socket (stream and datagram transports).
    fn exchange(self: Arc<Self>, addr: SocketAddr) -> Box<dyn Exchange>;
}

/// One probe's conversation on its socket.
pub trait Exchange: Send {
    /// The socket is connected: send what opens the exchange (nothing, for a bare connect).
    fn open(&mut self, fd: RawFd) -> Progress;
    /// The socket is ready for what the last [`Progress::Wait`] asked for.
    fn ready(&mut self, fd: RawFd) -> Progress;
}

/// A finished probe's detail (and dns answers), or what went wrong.
pub type Finished = Result<(String, Option<Vec<IpAddr>>), ProbeError>;

/// What happened after an event.
pub enum Progress {
    /// Wait for these epoll events.
    Wait(u32),
    /// Finished: the detail (and dns answers) or what went wrong.
    Done(Finished),
}

/// Whether a non-blocking call would have blocked (or was interrupted): wait and try again.
pub fn would_block(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EINTR))
}
