use super::*;
use std::sync::Mutex;

fn targets(yaml: &str) -> Vec<Target> {
    crate::probe::parse(&format!("targets:\n{yaml}"))
        .unwrap()
        .targets
}

#[derive(Default)]
struct Rec {
    interval: Mutex<Duration>,
    outcomes: Mutex<Vec<(usize, ProbeOutcome)>>,
    late: Mutex<Vec<Duration>>,
}
impl Sink for Rec {
    fn interval(&self, _: usize) -> Duration {
        *self.interval.lock().unwrap()
    }
    fn outcome(&self, i: usize, o: ProbeOutcome) {
        self.outcomes.lock().unwrap().push((i, o));
    }
    fn late(&self, late: Duration) {
        self.late.lock().unwrap().push(late);
    }
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let end = std::time::Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(
            std::time::Instant::now() < end,
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A tiny HTTP server on loopback answering every request with `status`.
fn http_server(status: u16) -> std::net::SocketAddr {
    use std::io::{Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for s in l.incoming().take(2000) {
            let Ok(mut s) = s else { continue };
            let mut buf = [0u8; 512];
            let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
            if s.read(&mut buf).is_ok() {
                let _ = write!(s, "HTTP/1.1 {status} X\r\nContent-Length: 0\r\n\r\n");
            }
        }
    });
    addr
}

/// The engine probes at the cadence it is given, switches to a finer one at once when
/// woken (a step beginning), and every probe is a real exchange: tcp connects, http
/// status lines judged, a refused port fails with the kernel's reason, ICMP and ICMPv6
/// echoes are answered (the IPv6 one on a socket of its own), tcp over IPv6 connects.
#[test]
fn the_engine_probes_at_its_cadence_and_switches_at_once() {
    let ok = http_server(200);
    let bad = http_server(503);
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed_port = closed.local_addr().unwrap().port();
    drop(closed);
    // An IPv6 listener: tcp over IPv6 connects like IPv4 (the kernel completes the handshake
    // from its backlog; nothing needs to accept).
    let six = std::net::TcpListener::bind("[::1]:0").unwrap();
    let six_port = six.local_addr().unwrap().port();
    let ts = targets(&format!(
        "  - {{name: a, address: 127.0.0.1, port: {}, probe: tcp, timeout: 200ms}}\n  - {{name: b, address: 127.0.0.1, port: {}, probe: http, timeout: 200ms}}\n  - {{name: c, address: 127.0.0.1, port: {}, probe: http, timeout: 200ms}}\n  - {{name: d, address: 127.0.0.1, port: {closed_port}, probe: tcp, timeout: 200ms}}\n  - {{name: e, address: 127.0.0.1, probe: icmp, timeout: 200ms}}\n  - {{name: f, address: '::1', probe: icmp, timeout: 200ms}}\n  - {{name: g, address: '::1', port: {six_port}, probe: tcp, timeout: 200ms}}\n",
        ok.port(), ok.port(), bad.port()
    ));
    let rec = Arc::new(Rec::default());
    *rec.interval.lock().unwrap() = Duration::from_secs(3600);
    let e = Engine::start(&ts, rec.clone()).unwrap();
    // The first probe of each target leaves at once, then nothing for an hour.
    wait_for("first probes", || rec.outcomes.lock().unwrap().len() >= 7);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(rec.outcomes.lock().unwrap().len(), 7);
    *rec.interval.lock().unwrap() = Duration::from_millis(10);
    e.wake();
    wait_for("a burst", || {
        rec.outcomes.lock().unwrap().len() >= 7 + 7 * 20
    });
    drop(e);
    drop(six);
    let outcomes = rec.outcomes.lock().unwrap();
    for (i, o) in outcomes.iter() {
        match i {
            0 | 6 => assert!(o.ok && o.detail == "connected", "{i}: {o:?}"),
            1 => assert!(o.ok && o.detail == "HTTP 200", "{o:?}"),
            2 => assert!(
                !o.ok && o.ran && o.detail == "HTTP 503, expected 200",
                "{o:?}"
            ),
            3 => assert!(!o.ok && o.ran && o.detail.contains("refused"), "{o:?}"),
            _ => assert!(o.ok && o.detail == "echo reply", "{o:?}"),
        }
    }
    // Sends of one target are ~10 ms apart (no backlog, no bunching).
    let sent: Vec<f64> = outcomes
        .iter()
        .filter(|(i, _)| *i == 0)
        .map(|(_, o)| o.sent_at)
        .skip(1)
        .collect();
    let mut sorted = sent.clone();
    sorted.sort_by(f64::total_cmp);
    let gaps: Vec<f64> = sorted.windows(2).map(|w| w[1] - w[0]).collect();
    let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
    assert!(
        (0.008..0.02).contains(&mean),
        "mean spacing {mean}: {gaps:?}"
    );
    assert!(!rec.late.lock().unwrap().is_empty());
}

/// A resolver that never answers our id, but sends stray datagrams with other ids every
/// 30 ms: the probe still ends at its timeout (stray datagrams neither satisfy nor extend
/// it), in the engine and in a one-shot probe.
#[test]
fn stray_datagrams_neither_answer_nor_extend_a_probe() {
    let server = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    server
        .set_read_timeout(Some(Duration::from_millis(20)))
        .unwrap();
    let port = server.local_addr().unwrap().port();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = stop.clone();
    let t = std::thread::spawn(move || {
        let mut peers = Vec::new();
        let end = std::time::Instant::now() + Duration::from_secs(20);
        while !stop2.load(std::sync::atomic::Ordering::SeqCst) && std::time::Instant::now() < end {
            let mut buf = [0u8; 512];
            if let Ok((n, from)) = server.recv_from(&mut buf) {
                let mut reply = buf[..n].to_vec();
                reply[0] ^= 0xff; // another id
                reply[2] |= 0x80;
                peers.push((from, reply));
            }
            for (p, r) in &peers {
                let _ = server.send_to(r, p);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    });
    let ts = targets(&format!(
        "  - {{name: d, address: 127.0.0.1, port: {port}, probe: dns, query: a.test, timeout: 200ms}}\n"
    ));
    let o = run_once(&Spec::new(&ts[0]));
    assert!(!o.ok && o.ran, "{o:?}");
    assert_eq!(o.detail, "timeout after 200ms");
    assert_eq!(o.latency, Duration::from_millis(200));
    let rec = Arc::new(Rec::default());
    *rec.interval.lock().unwrap() = Duration::from_secs(3600);
    let started = std::time::Instant::now();
    let e = Engine::start(&ts, rec.clone()).unwrap();
    wait_for("the timeout", || !rec.outcomes.lock().unwrap().is_empty());
    let took = started.elapsed();
    drop(e);
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let _ = t.join();
    let o = &rec.outcomes.lock().unwrap()[0].1;
    assert_eq!(o.detail, "timeout after 200ms");
    assert!(
        took >= Duration::from_millis(195) && took < Duration::from_millis(400),
        "{took:?}"
    );
}
