//! The daemon under abuse (loopback inside the lab's node namespace, bounded in count and
//! time): probes that cannot run are a hole, never a pass; a connection flood and long-polls
//! at and beyond the configured limits leave /readyz and /metrics answering, a step with an
//! outage measured correctly, memory under the DaemonSet's limit, and SIGTERM quick.
mod common;
use common::*;
use std::net::TcpStream;
use std::time::{Duration, Instant};
use stepguard_lab::RestartOpts;

/// Opens `n` connections to `addr` from inside `ns` that never send a byte.
fn idle_connections(ns: &str, addr: std::net::SocketAddr, n: usize) -> Vec<TcpStream> {
    stepguard_lab::netns::in_netns(ns, move || {
        Ok((0..n)
            .filter_map(|_| TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok())
            .collect())
    })
    .unwrap()
}

fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|kb| kb.parse::<f64>().ok())
        .unwrap()
        / 1024.0
}

/// Wrong pass 1: with the agent's file descriptors exhausted, probe sockets cannot be opened.
/// Before, those probes were dropped as "not run" and a blackhole step passed with a quarter
/// of its probes; now the interval without probes is a hole in the evidence.
#[test]
fn probes_that_cannot_run_are_a_hole_never_a_pass() {
    let mut lab = lab(|_| {});
    let agent = Daemon::start_wrapped(
        lab.node_ns(),
        lab.stepguard_config(),
        lab.state.run_dir.join("agent-state"),
        free_port(),
        &["--max-connections", "4000", "--header-timeout", "60s"],
        &["prlimit", "--nofile=160:160"],
    );
    let id = agent.begin_probing(r#"{"settle":"1s","timeout":"30s"}"#);
    // Exhaust the agent's descriptors with connections it accepts and holds.
    let flood = idle_connections(&agent.ns, agent.addr, 300);
    assert!(flood.len() > 160, "only {} connections", flood.len());
    lab.restart(&RestartOpts {
        down: Duration::from_millis(1000),
        blackhole: true,
        ..Default::default()
    })
    .unwrap();
    drop(flood);
    let v = agent.verdict(&id);
    assert_eq!(v["verdict"]["status"], "failed", "{v:#}");
    assert_eq!(
        v["verdict"]["reasons"],
        serde_json::json!(["evidence_incomplete"]),
        "{v:#}"
    );
    assert!(
        v["verdict"]["summary"]
            .as_str()
            .unwrap()
            .contains("could not run"),
        "{v:#}"
    );
}

/// A bounded abuse run: idle connections beyond the connection limit and its reserve,
/// long-polls beyond their limit, then a step with an outage.
#[test]
fn a_connection_flood_and_long_polls_at_the_limits_leave_the_agent_measuring() {
    let mut lab = lab(|_| {});
    let mut agent = Daemon::start(
        &lab,
        &[
            "--max-connections",
            "64",
            "--header-timeout",
            "3s",
            "--max-long-polls",
            "8",
            "--shutdown-grace",
            "3s",
        ],
    );
    let id = agent.begin_probing(r#"{"settle":"1s","timeout":"60s"}"#);
    let flood = idle_connections(&agent.ns, agent.addr, 400);
    assert!(flood.len() >= 200, "{} connections", flood.len());
    // 12 long-polls where 8 are held: the rest are answered at once (202).
    let polls: Vec<_> = (0..12)
        .map(|_| {
            let (ns, addr, id) = (agent.ns.clone(), agent.addr, id.clone());
            std::thread::spawn(move || {
                let t = Instant::now();
                let (s, _) = http(
                    &ns,
                    addr,
                    "GET",
                    &format!("/v1/steps/{id}?wait=120s"),
                    None,
                    None,
                );
                (s, t.elapsed())
            })
        })
        .collect();
    // /readyz and /metrics answer throughout: their request comes at once, while the idle
    // connections wait without a slot (the oldest of them closed as new ones come).
    for _ in 0..10 {
        assert_eq!(agent.get("/readyz").0, 200);
        let (s, m) = agent.get("/metrics");
        assert_eq!(s, 200);
        assert!(m.ends_with("# EOF\n"));
        std::thread::sleep(Duration::from_millis(100));
    }
    let r = lab
        .restart(&RestartOpts {
            down: Duration::from_millis(300),
            blackhole: true,
            ..Default::default()
        })
        .unwrap();
    let v = agent.verdict(&id);
    assert_eq!(v["verdict"]["status"], "passed", "{v:#}");
    for g in v["gaps"].as_array().unwrap() {
        assert_gap_matches(g, &r, g["target"].as_str().unwrap());
    }
    let rss = rss_mib(agent.child.id());
    assert!(
        rss < 64.0,
        "RSS {rss:.1} MiB is over the DaemonSet's 64 Mi limit"
    );
    // The long-polls: the step was decided, so the held ones returned 200; the ones beyond
    // the limit were answered at once with 202.
    let answers: Vec<(u16, Duration)> = polls.into_iter().map(|p| p.join().unwrap()).collect();
    let quick = answers
        .iter()
        .filter(|(s, t)| *s == 202 && *t < Duration::from_secs(5))
        .count();
    assert!(
        quick >= 4,
        "beyond the limit, answered at once: {answers:?}"
    );
    assert!(
        answers.iter().all(|(s, _)| *s == 200 || *s == 202),
        "{answers:?}"
    );
    // SIGTERM with idle connections and a long-poll open: the agent exits within its grace.
    let (ns, addr, id2) = (agent.ns.clone(), agent.addr, id.clone());
    let held = std::thread::spawn(move || {
        http(
            &ns,
            addr,
            "GET",
            &format!("/v1/steps/{id2}?wait=120s"),
            None,
            None,
        )
    });
    let more = idle_connections(&agent.ns, agent.addr, 50);
    let t = Instant::now();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(agent.child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = agent.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "the agent did not exit within 10 s of SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}");
    assert!(
        t.elapsed() < Duration::from_secs(6),
        "exit took {:?}",
        t.elapsed()
    );
    let _ = held.join();
    drop((flood, more));
}
