//! Probes: one request, sent and timed. `tcp` connect, `http` GET (expected status), `https`
//! (TLS handshake, then the GET), `icmp` echo, `dns` query: one file per kind, registered in
//! [`kind::KINDS`]. An answer that arrives after the timeout (e.g. after a SYN retransmit) is
//! a failure, even if it eventually succeeded.
pub mod contract;
pub mod dns;
pub mod engine;
mod error;
pub mod http;
pub mod https;
pub mod icmp;
pub mod kind;
pub mod tcp;

pub use error::ProbeError;
pub use kind::{load, parse, port, validate};

use crate::config::Target;
use serde::Serialize;
use std::net::IpAddr;
use std::time::Duration;

#[derive(Clone, Debug, Serialize)]
pub struct ProbeOutcome {
    pub ok: bool,
    /// Wall clock when the request was sent (unix seconds).
    pub sent_at: f64,
    #[serde(serialize_with = "ser_ms")]
    pub latency: Duration,
    /// What went wrong, one line; or what came back (status, answer).
    pub detail: String,
    /// False when the probe could not even be sent (no socket, no permission): its result
    /// says nothing about the target.
    pub ran: bool,
    /// dns: the addresses answered (sorted).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub answers: Option<Vec<IpAddr>>,
}

fn ser_ms<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64((d.as_secs_f64() * 1e6).round() / 1e3)
}

/// Runs one probe against a target (on the blocking pool; the probe itself is the engine's
/// state machine, see [`crate::probe::engine`], the same one the agent's loops run).
pub async fn probe(t: &Target) -> ProbeOutcome {
    let spec = crate::probe::engine::Spec::new(t);
    match tokio::task::spawn_blocking(move || crate::probe::engine::run_once(&spec)).await {
        Ok(o) => o,
        Err(e) => ProbeOutcome {
            ok: false,
            sent_at: crate::kernel::clock::now(),
            latency: Duration::ZERO,
            detail: format!("probe task: {e}"),
            ran: false,
            answers: None,
        },
    }
}

/// `HTTP/1.1 200 OK` → 200.
pub fn parse_status_line(buf: &[u8]) -> Result<u16, ProbeError> {
    let line_end = buf
        .windows(2)
        .position(|w| w == b"\r\n")
        .unwrap_or(buf.len());
    let line = String::from_utf8_lossy(&buf[..line_end]);
    let mut parts = line.split_whitespace();
    match (
        parts.next(),
        parts.next().and_then(|c| c.parse::<u16>().ok()),
    ) {
        (Some(v), Some(code)) if v.starts_with("HTTP/") && (100..=599).contains(&code) => Ok(code),
        _ => Err(ProbeError::Answer(format!(
            "not an HTTP status line: {:?}",
            line.chars().take(60).collect::<String>()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(yaml: &str) -> Target {
        crate::probe::parse(&format!("targets:\n{yaml}"))
            .unwrap()
            .targets[0]
            .clone()
    }

    /// Wrong pass 3: a resolver answering 1.2.3.4 instead of the real address used to pass
    /// the probe (no expected answer could be configured). With `answers:` it fails.
    #[tokio::test]
    async fn a_wrong_dns_answer_fails_the_probe() {
        let answer =
            std::sync::Arc::new(std::sync::Mutex::new(std::net::Ipv4Addr::new(1, 2, 3, 4)));
        let server = dns::testserver::start(answer.clone());
        let t = target(&format!(
            "  - {{name: d, address: 127.0.0.1, port: {}, probe: dns, query: gw.test, timeout: 500ms, answers: [198.51.100.10]}}\n",
            server.port()
        ));
        let o = probe(&t).await;
        assert!(o.ran && !o.ok, "{o:?}");
        assert!(
            o.detail.contains("wrong answer for gw.test: 1.2.3.4"),
            "{}",
            o.detail
        );
        for bad in [[0, 0, 0, 0], [127, 0, 0, 1]] {
            *answer.lock().unwrap() = bad.into();
            assert!(!probe(&t).await.ok);
        }
        *answer.lock().unwrap() = std::net::Ipv4Addr::new(198, 51, 100, 10);
        let o = probe(&t).await;
        assert!(o.ok, "{o:?}");
        assert_eq!(o.answers, Some(vec!["198.51.100.10".parse().unwrap()]));
    }

    /// ICMPv6 echoes: `::1` answers a one-shot echo; an IPv4 source for an IPv6
    /// target is refused with the config, naming the field.
    #[tokio::test]
    async fn icmpv6_echoes_are_answered_and_a_foreign_source_refused() {
        let t = target("  - {name: six, address: '::1', probe: icmp, timeout: 500ms}\n");
        let o = probe(&t).await;
        assert!(o.ran && o.ok && o.detail == "echo reply", "{o:?}");
        let e = crate::probe::parse(
            "targets:\n  - {name: six, address: '::1', probe: icmp, source: 127.0.0.1}\n",
        )
        .map(|_| ())
        .expect_err("an IPv4 source for an IPv6 target is refused");
        assert!(e.to_string().contains("targets[0].source"), "{e}");
    }

    /// `source:` is used by every probe kind (before, dns and icmp ignored it): a source
    /// address that is not on this host cannot be bound, and the probe says it did not run;
    /// a local one is bound, as a resolver sees.
    #[tokio::test]
    async fn source_is_honoured_by_dns_and_icmp_probes() {
        for kind in ["dns", "icmp", "tcp"] {
            let port = if kind == "icmp" { "" } else { "port: 9, " };
            let t = target(&format!(
                "  - {{name: t, address: 127.0.0.1, {port}probe: {kind}, timeout: 200ms, source: 192.0.2.77}}\n"
            ));
            let o = probe(&t).await;
            assert!(!o.ran && !o.ok, "{kind}: {o:?}");
            assert!(
                o.detail.contains("bind source 192.0.2.77"),
                "{kind}: {}",
                o.detail
            );
        }
        // A resolver on loopback sees queries from the configured source.
        let server = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        server
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let port = server.local_addr().unwrap().port();
        let t = target(&format!(
            "  - {{name: d, address: 127.0.0.1, port: {port}, probe: dns, timeout: 200ms, source: 127.0.0.2}}\n"
        ));
        let (o, from) = tokio::join!(
            probe(&t),
            tokio::task::spawn_blocking(move || {
                let mut buf = [0u8; 512];
                server.recv_from(&mut buf).map(|(_, from)| from)
            })
        );
        assert!(o.ran, "{o:?}");
        assert_eq!(from.unwrap().unwrap().ip().to_string(), "127.0.0.2");
    }
    #[test]
    fn status_lines_are_parsed_strictly() {
        assert_eq!(parse_status_line(b"HTTP/1.1 200 OK\r\n"), Ok(200));
        assert_eq!(
            parse_status_line(b"HTTP/1.0 503 Service Unavailable\r\nx"),
            Ok(503)
        );
        assert!(parse_status_line(b"SSH-2.0-OpenSSH\r\n").is_err());
        assert!(parse_status_line(b"HTTP/1.1 abc\r\n").is_err());
        assert!(parse_status_line(b"HTTP/1.1 999 odd\r\n").is_err());
    }
}
