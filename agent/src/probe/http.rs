//! `http`: a GET over a fresh connection; the status line is the answer. Options: `path`
//! (default `/`) and `expect` (the status, default 200). Port 80 unless given.
use super::contract::{would_block, Finished, Progress};
use super::contract::{Exchange, Probe, Transport};
use super::kind::{Kind, Problem};
use super::ProbeError;
use crate::config::Target;
use crate::kernel::sock::{recv, send};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::RawFd;
use std::sync::Arc;

pub struct Http;

/// `path` and `expect`, shared with `https`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Options {
    #[serde(default)]
    pub path: Option<String>,
    #[serde(default)]
    pub expect: Option<u16>,
}

impl Options {
    /// The request line and headers, and the status expected.
    pub(super) fn request(
        &self,
        t: &Target,
        host: Option<&str>,
    ) -> Result<(Vec<u8>, u16), Problem> {
        let path = self.path.as_deref().unwrap_or("/");
        if !path.starts_with('/') || path.contains(char::is_whitespace) {
            return Err(Problem::new(
                "path",
                format!("{path:?} must start with / and hold no spaces"),
            ));
        }
        let expect = self.expect.unwrap_or(200);
        if !(100..=599).contains(&expect) {
            return Err(Problem::new("expect", "an HTTP status is 100..599"));
        }
        let host = match (host, t.address) {
            (Some(h), _) => h.to_string(),
            (None, IpAddr::V6(v6)) => format!("[{v6}]"),
            (None, IpAddr::V4(v4)) => v4.to_string(),
        };
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: stepguard\r\nConnection: close\r\n\r\n"
        )
        .into_bytes();
        Ok((request, expect))
    }
}

#[derive(Debug)]
struct Get {
    request: Vec<u8>,
    expect: u16,
}

impl Kind for Http {
    fn name(&self) -> &'static str {
        "http"
    }
    fn default_port(&self) -> Option<u16> {
        Some(80)
    }
    fn prepare(&self, t: &Target) -> Result<Arc<dyn Probe>, Problem> {
        let o: Options = super::kind::options(t)?;
        let (request, expect) = o.request(t, None)?;
        Ok(Arc::new(Get { request, expect }))
    }
}

impl Probe for Get {
    fn transport(&self) -> Transport {
        Transport::Stream
    }
    fn exchange(self: Arc<Self>, _addr: SocketAddr) -> Box<dyn Exchange> {
        Box::new(Exchanging {
            get: self,
            buf: Vec::new(),
        })
    }
}

struct Exchanging {
    get: Arc<Get>,
    buf: Vec<u8>,
}

impl Exchange for Exchanging {
    fn open(&mut self, fd: RawFd) -> Progress {
        // A request of ~100 bytes fits any fresh socket's send buffer: one send.
        match send(fd, &self.get.request) {
            Ok(n) if n == self.get.request.len() => Progress::Wait(libc::EPOLLIN as u32),
            Ok(_) => Progress::Done(Err(ProbeError::Answer("request only partly sent".into()))),
            Err(e) => Progress::Done(Err(ProbeError::exchange("send request", &e))),
        }
    }

    fn ready(&mut self, fd: RawFd) -> Progress {
        let mut chunk = [0u8; 512];
        loop {
            match recv(fd, &mut chunk) {
                Ok((0, _)) => {
                    return Progress::Done(Err(ProbeError::Answer(
                        "connection closed before a status line".into(),
                    )))
                }
                Ok((n, _)) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    if let Some(done) = judge_status(&self.buf, self.get.expect, "HTTP") {
                        return Progress::Done(done);
                    }
                }
                Err(e) if would_block(&e) => return Progress::Wait(libc::EPOLLIN as u32),
                Err(e) => return Progress::Done(Err(ProbeError::exchange("read response", &e))),
            }
        }
    }
}

/// The answer once `buf` holds the status line (None: read on). `what` names the protocol in
/// the detail (`HTTP 200`, `HTTPS 200`).
pub(super) fn judge_status(buf: &[u8], expect: u16, what: &str) -> Option<Finished> {
    if buf.windows(2).any(|w| w == b"\r\n") {
        return Some(super::parse_status_line(buf).and_then(|status| {
            if status == expect {
                Ok((format!("{what} {status}"), None))
            } else {
                Err(ProbeError::Answer(format!(
                    "{what} {status}, expected {expect}"
                )))
            }
        }));
    }
    (buf.len() > 8192).then(|| {
        Err(ProbeError::Answer(
            "no status line in the first 8 KiB".into(),
        ))
    })
}
