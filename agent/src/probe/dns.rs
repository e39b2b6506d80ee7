//! `dns`: one query over UDP with hickory-proto messages: no cache, no retry. SERVFAIL, a
//! mismatched reply, an empty answer and a timeout are all failures. Options: `query` (the
//! name, default `kubernetes.default.svc.cluster.local`), `record` (`A`, the default, or
//! `AAAA`) and `answers` (the addresses expected, or `baseline`: during a step the answer
//! must stay what it was when the step began). Port 53 unless given. The `dns` check's resolver queries are the same exchange.
use super::contract::{would_block, Progress};
use super::contract::{Exchange, Probe, Transport};
use super::kind::{Kind, Problem};
use super::ProbeError;
use crate::config::{Answers, Target};
use crate::kernel::sock::{recv, send};
use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{Name, RData, RecordType};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordKind {
    A,
    Aaaa,
}

impl RecordKind {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "A" => Some(Self::A),
            "AAAA" => Some(Self::Aaaa),
            _ => None,
        }
    }
    pub(crate) fn rtype(self) -> RecordType {
        match self {
            Self::A => RecordType::A,
            Self::Aaaa => RecordType::AAAA,
        }
    }
}

/// A successful answer.
#[derive(Clone, Debug)]
pub struct Answer {
    pub addresses: Vec<IpAddr>,
}

impl Answer {
    pub fn summary(&self) -> String {
        self.addresses
            .iter()
            .map(|a| a.to_string())
            .collect::<Vec<_>>()
            .join(",")
    }
}

pub(crate) fn query_id() -> u16 {
    // A random id: a stray or spoofed datagram must not match by guess.
    getrandom::u32().map(|r| r as u16).unwrap_or_else(|_| {
        (std::process::id() as u16) ^ (crate::kernel::clock::now().fract() * 65535.0) as u16
    })
}

/// A recursive query for `name`/`kind` with this id, on the wire.
pub fn encode_query(name: &str, kind: RecordKind, id: u16) -> Result<Vec<u8>, ProbeError> {
    let qname = Name::from_ascii(name)
        .map_err(|e| ProbeError::unsupported(format!("bad name {name:?}"), e.to_string()))?;
    let mut msg = Message::new(id, MessageType::Query, OpCode::Query);
    msg.metadata.recursion_desired = true;
    msg.add_query(Query::query(qname, kind.rtype()));
    msg.to_vec()
        .map_err(|e| ProbeError::unsupported("encode query", e.to_string()))
}

/// Judges one datagram received for the query with `id`: None when it carries another id
/// (a stray or late datagram: keep waiting), else the probe's result.
pub fn judge_reply(
    datagram: &[u8],
    id: u16,
    resolver: SocketAddr,
    name: &str,
    kind: RecordKind,
    expect: Option<&[IpAddr]>,
) -> Option<Result<Answer, ProbeError>> {
    // Not a DNS header, or another query's id: a stray datagram (garbage from the resolver's
    // own address included), ignored like any other; the probe waits for its answer.
    if datagram.len() < 12 || u16::from_be_bytes([datagram[0], datagram[1]]) != id {
        return None;
    }
    let reply = match Message::from_vec(datagram) {
        Ok(m) => m,
        Err(e) => {
            return Some(Err(ProbeError::Answer(format!(
                "malformed reply from {resolver}: {e}"
            ))))
        }
    };
    if reply.metadata.id != id {
        return None;
    }
    Some(check_reply(&reply, name, kind, expect))
}

pub struct Dns;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Options {
    #[serde(default)]
    query: Option<String>,
    #[serde(default)]
    record: Option<String>,
    #[serde(default)]
    answers: Option<Answers>,
}

impl Kind for Dns {
    fn name(&self) -> &'static str {
        "dns"
    }
    fn default_port(&self) -> Option<u16> {
        Some(53)
    }
    fn prepare(&self, t: &Target) -> Result<Arc<dyn Probe>, Problem> {
        let o: Options = super::kind::options(t)?;
        let name = o
            .query
            .unwrap_or_else(|| "kubernetes.default.svc.cluster.local".into());
        let kind = match o.record.as_deref() {
            None => RecordKind::A,
            Some(r) => RecordKind::parse(r)
                .ok_or_else(|| Problem::new("record", format!("{r:?}: expected A or AAAA")))?,
        };
        let expect = o.answers.as_ref().and_then(|a| a.set()).map(|s| s.to_vec());
        if let Some(bad) = expect
            .iter()
            .flatten()
            .find(|a| a.is_ipv4() != (kind == RecordKind::A))
        {
            return Err(Problem::new(
                "answers",
                format!(
                    "{bad} cannot answer a {} query",
                    if kind == RecordKind::A { "A" } else { "AAAA" }
                ),
            ));
        }
        let q =
            Question::new(&name, kind, expect).map_err(|e| Problem::new("query", e.to_string()))?;
        Ok(Arc::new(q))
    }
}

/// A target's `answers` (None for other kinds, or when not given); an error when its options
/// do not read (`probe::validate` refuses such a config first).
pub fn answers(t: &Target) -> Result<Option<Answers>, Problem> {
    if t.probe != "dns" {
        return Ok(None);
    }
    Ok(super::kind::options::<Options>(t)?.answers)
}

/// One name and record type to ask, encoded once (the id is patched per query).
#[derive(Debug)]
pub struct Question {
    name: String,
    kind: RecordKind,
    wire: Vec<u8>,
    expect: Option<Vec<IpAddr>>,
}

impl Question {
    pub fn new(
        name: &str,
        kind: RecordKind,
        expect: Option<Vec<IpAddr>>,
    ) -> Result<Question, ProbeError> {
        Ok(Question {
            name: name.to_string(),
            kind,
            wire: encode_query(name, kind, 0)?,
            expect,
        })
    }
}

impl Probe for Question {
    fn transport(&self) -> Transport {
        Transport::Datagram
    }
    fn exchange(self: Arc<Self>, addr: SocketAddr) -> Box<dyn Exchange> {
        // The id and the datagram are ready before the probe is timed: its send time is the
        // send's (the id's random bytes cost a syscall).
        let id = query_id();
        let mut wire = self.wire.clone();
        wire[..2].copy_from_slice(&id.to_be_bytes());
        Box::new(Asking {
            query: self,
            id,
            wire,
            addr,
        })
    }
}

struct Asking {
    query: Arc<Question>,
    id: u16,
    wire: Vec<u8>,
    addr: SocketAddr,
}

impl Exchange for Asking {
    fn open(&mut self, fd: RawFd) -> Progress {
        match send(fd, &self.wire) {
            Ok(_) => Progress::Wait(libc::EPOLLIN as u32),
            Err(e) => Progress::Done(Err(ProbeError::exchange(
                format!("send to {}", self.addr),
                &e,
            ))),
        }
    }

    fn ready(&mut self, fd: RawFd) -> Progress {
        let mut buf = [0u8; 4096];
        loop {
            match recv(fd, &mut buf) {
                Ok((n, _)) => {
                    let q = &self.query;
                    match judge_reply(
                        &buf[..n],
                        self.id,
                        self.addr,
                        &q.name,
                        q.kind,
                        q.expect.as_deref(),
                    ) {
                        None => continue, // another id: not our answer
                        Some(r) => {
                            return Progress::Done(r.map(|mut a| {
                                a.addresses.sort();
                                (a.summary(), Some(a.addresses))
                            }))
                        }
                    }
                }
                Err(e) if would_block(&e) => return Progress::Wait(libc::EPOLLIN as u32),
                Err(e) => {
                    return Progress::Done(Err(ProbeError::exchange(
                        format!("receive from {}", self.addr),
                        &e,
                    )))
                }
            }
        }
    }
}

/// Sends one query and waits for its answer, up to `timeout` (on the blocking pool: the
/// probe is the engine's, see [`crate::probe::engine`]).
pub async fn query(
    resolver: SocketAddr,
    name: &str,
    kind: RecordKind,
    timeout: Duration,
    expect: Option<&[IpAddr]>,
    source: Option<IpAddr>,
) -> Result<Answer, ProbeError> {
    let q = Question::new(name, kind, expect.map(|e| e.to_vec()))?;
    let spec = crate::probe::engine::Spec::with(resolver, source, timeout, Arc::new(q));
    match tokio::task::spawn_blocking(move || crate::probe::engine::run_once_raw(&spec)).await {
        Ok((_, latency, _)) if latency > timeout => Err(ProbeError::timeout(timeout)),
        Ok((_, _, r)) => r.map(|(_, addrs)| Answer {
            addresses: addrs.unwrap_or_default(),
        }),
        Err(e) => Err(ProbeError::unsupported("dns task", e.to_string())),
    }
}

/// One question of a [`query_round`]: name, record type, expected answers.
pub struct RoundQuestion {
    pub name: String,
    pub kind: RecordKind,
    pub expect: Option<Vec<IpAddr>>,
}

/// What one query of a round found: sent at (agent clock), its latency, its answer.
pub struct RoundAnswer {
    pub at: f64,
    pub latency: Duration,
    pub result: Result<Answer, ProbeError>,
}

/// Sends `questions` to `resolver` one after another, each waiting for its answer up to
/// `timeout`, all on one blocking-pool task: a round of the agent's steady resolver queries
/// costs one hand-off to the pool, not one per query. The latency is the probe's own, from
/// its send to its answer (no scheduling between the runtime and the pool in it).
pub async fn query_round(
    resolver: SocketAddr,
    questions: Vec<RoundQuestion>,
    timeout: Duration,
) -> Vec<RoundAnswer> {
    let n = questions.len();
    let run = move || {
        questions
            .into_iter()
            .map(|q| {
                let question = match Question::new(&q.name, q.kind, q.expect) {
                    Ok(x) => x,
                    Err(e) => {
                        return RoundAnswer {
                            at: crate::kernel::clock::now(),
                            latency: Duration::ZERO,
                            result: Err(e),
                        }
                    }
                };
                let spec =
                    crate::probe::engine::Spec::with(resolver, None, timeout, Arc::new(question));
                let (at, latency, r) = crate::probe::engine::run_once_raw(&spec);
                let result = if latency > timeout {
                    Err(ProbeError::timeout(timeout))
                } else {
                    r.map(|(_, addrs)| Answer {
                        addresses: addrs.unwrap_or_default(),
                    })
                };
                RoundAnswer {
                    at,
                    latency,
                    result,
                }
            })
            .collect()
    };
    match tokio::task::spawn_blocking(run).await {
        Ok(v) => v,
        Err(e) => (0..n)
            .map(|_| RoundAnswer {
                at: crate::kernel::clock::now(),
                latency: Duration::ZERO,
                result: Err(ProbeError::unsupported("dns task", e.to_string())),
            })
            .collect(),
    }
}

/// Judges a reply that carries our id.
pub fn check_reply(
    reply: &Message,
    name: &str,
    kind: RecordKind,
    expect: Option<&[IpAddr]>,
) -> Result<Answer, ProbeError> {
    if reply.metadata.message_type != MessageType::Response {
        return Err(ProbeError::Answer("reply is not a response".into()));
    }
    if reply.metadata.response_code != ResponseCode::NoError {
        return Err(ProbeError::Answer(format!(
            "{} for {name}",
            reply.metadata.response_code
        )));
    }
    let q_ok = reply.queries.first().is_some_and(|q| {
        q.name()
            .to_ascii()
            .trim_end_matches('.')
            .eq_ignore_ascii_case(name.trim_end_matches('.'))
            && q.query_type() == kind.rtype()
    });
    if !q_ok {
        return Err(ProbeError::Answer("reply is for another question".into()));
    }
    let addresses: Vec<IpAddr> = reply
        .answers
        .iter()
        .filter_map(|r| match (&r.data, kind) {
            (RData::A(a), RecordKind::A) => Some(IpAddr::V4(a.0)),
            (RData::AAAA(a), RecordKind::Aaaa) => Some(IpAddr::V6(a.0)),
            _ => None,
        })
        .collect();
    if addresses.is_empty() {
        return Err(ProbeError::Answer(format!(
            "no {:?} record for {name}",
            kind.rtype()
        )));
    }
    // Every address returned must be expected: a resolver answering 1.2.3.4, 0.0.0.0 or
    // 127.0.0.1 (a sinkhole, a captive portal, a poisoned cache) besides or instead of the
    // real address fails.
    if let Some(want) = expect {
        if !addresses.iter().all(|a| want.contains(a)) {
            return Err(ProbeError::Answer(format!(
                "wrong answer for {name}: {} (expected one of {})",
                Answer { addresses }.summary(),
                want.iter()
                    .map(|a| a.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            )));
        }
    }
    Ok(Answer { addresses })
}

/// A DNS server on loopback for tests: answers every A query with the address it currently
/// holds (switchable), bounded to a few minutes.
#[cfg(test)]
pub(crate) mod testserver {
    use super::*;
    use hickory_proto::rr::{rdata, Record};
    use std::sync::{Arc, Mutex};

    pub fn start(answer: Arc<Mutex<std::net::Ipv4Addr>>) -> SocketAddr {
        let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        sock.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let addr = sock.local_addr().unwrap();
        std::thread::spawn(move || {
            let end = std::time::Instant::now() + Duration::from_secs(120);
            let mut buf = [0u8; 512];
            while std::time::Instant::now() < end {
                let Ok((n, from)) = sock.recv_from(&mut buf) else {
                    continue;
                };
                let Ok(q) = Message::from_vec(&buf[..n]) else {
                    continue;
                };
                let mut r = Message::new(q.metadata.id, MessageType::Response, OpCode::Query);
                r.metadata.recursion_desired = true;
                for query in &q.queries {
                    r.add_query(query.clone());
                    let ip = *answer.lock().unwrap();
                    r.answers.push(Record::from_rdata(
                        query.name().clone(),
                        5,
                        RData::A(rdata::A(ip)),
                    ));
                }
                let _ = sock.send_to(&r.to_vec().unwrap(), from);
            }
        });
        addr
    }
}

#[cfg(test)]
mod garbage_tests {
    use super::*;

    #[test]
    fn garbage_from_the_resolver_is_ignored_not_a_failure() {
        let r: SocketAddr = "198.51.100.53:53".parse().unwrap();
        for junk in [&b"x"[..], &b"\x00\x00garbage!!"[..], &[0xffu8; 40][..]] {
            assert!(
                judge_reply(junk, 0x1234, r, "a.test", RecordKind::A, None).is_none(),
                "{junk:?}"
            );
        }
        // Our id, but not a DNS message: a malformed answer, a failure.
        let mut ours = vec![0x12, 0x34];
        ours.extend([0xff; 20]);
        assert!(matches!(
            judge_reply(&ours, 0x1234, r, "a.test", RecordKind::A, None),
            Some(Err(_))
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::rr::{rdata, Record};

    fn reply(rcode: ResponseCode, answers: Vec<Record>) -> Message {
        let mut m = Message::new(7, MessageType::Response, OpCode::Query);
        m.metadata.response_code = rcode;
        m.add_query(Query::query(
            Name::from_ascii("gw.test.").unwrap(),
            RecordType::A,
        ));
        for a in answers {
            m.answers.push(a);
        }
        m
    }
    fn a(ip: [u8; 4]) -> Record {
        Record::from_rdata(
            Name::from_ascii("gw.test.").unwrap(),
            5,
            RData::A(rdata::A(ip.into())),
        )
    }

    #[test]
    fn servfail_empty_and_wrong_answers_fail() {
        assert!(check_reply(
            &reply(ResponseCode::ServFail, vec![]),
            "gw.test",
            RecordKind::A,
            None
        )
        .unwrap_err()
        .to_string()
        .contains("Server Failure"));
        assert!(check_reply(
            &reply(ResponseCode::NoError, vec![]),
            "gw.test",
            RecordKind::A,
            None
        )
        .unwrap_err()
        .to_string()
        .contains("no A record"));
        let ok = reply(ResponseCode::NoError, vec![a([198, 51, 100, 10])]);
        assert_eq!(
            check_reply(&ok, "gw.test", RecordKind::A, None)
                .unwrap()
                .summary(),
            "198.51.100.10"
        );
        let want: Vec<IpAddr> = vec!["203.0.113.9".parse().unwrap()];
        assert!(check_reply(&ok, "gw.test", RecordKind::A, Some(&want))
            .unwrap_err()
            .to_string()
            .contains("wrong answer"));
        assert!(check_reply(&ok, "other.test", RecordKind::A, None)
            .unwrap_err()
            .to_string()
            .contains("another question"));
    }
}
