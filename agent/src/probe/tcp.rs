//! `tcp`: a connect; the handshake completing is the answer (then closed with RST). Needs a
//! `port`; no options of its own.
use super::contract::Progress;
use super::contract::{Exchange, Probe, Transport};
use super::kind::{Kind, Problem};
use crate::config::Target;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::Arc;

pub struct Tcp;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Options {}

#[derive(Debug)]
struct Connect;

impl Kind for Tcp {
    fn name(&self) -> &'static str {
        "tcp"
    }
    fn default_port(&self) -> Option<u16> {
        None
    }
    fn prepare(&self, t: &Target) -> Result<Arc<dyn Probe>, Problem> {
        let Options {} = super::kind::options(t)?;
        Ok(Arc::new(Connect))
    }
}

impl Probe for Connect {
    fn transport(&self) -> Transport {
        Transport::Stream
    }
    fn exchange(self: Arc<Self>, _addr: SocketAddr) -> Box<dyn Exchange> {
        Box::new(Connected)
    }
}

struct Connected;

impl Exchange for Connected {
    fn open(&mut self, _fd: RawFd) -> Progress {
        Progress::Done(Ok(("connected".into(), None)))
    }
    fn ready(&mut self, _fd: RawFd) -> Progress {
        Progress::Done(Ok(("connected".into(), None)))
    }
}
