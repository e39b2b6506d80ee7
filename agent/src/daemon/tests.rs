use super::*;

fn outcome(sent_at: f64, ok: bool) -> ProbeOutcome {
    ProbeOutcome {
        ok,
        sent_at,
        latency: Duration::from_millis(1),
        detail: String::new(),
        ran: true,
        answers: None,
    }
}

fn test_daemon(yaml: &str, name: &str) -> Arc<Daemon> {
    let dir = std::env::temp_dir().join(format!("sg-{name}-{}", std::process::id()));
    Daemon::new(
        Config::parse(yaml).unwrap(),
        DaemonOptions {
            state_dir: dir,
            probe_interval: Duration::from_secs(3600),
            slow_interval: Duration::from_secs(3600),
            burst_interval: Duration::from_millis(10),
            token: crate::serving::Token::fixed(None),
            drop_accounting: false,
            max_long_polls: 4,
        },
    )
    .unwrap()
}

/// `answers: baseline`: outside a step the reference follows the answer; during a step a
/// changed answer set is a failed probe (an outage of the target), so a step cannot pass
/// while the name resolves elsewhere.
#[test]
fn a_changed_answer_during_a_step_is_a_failed_probe() {
    let d = test_daemon(
        "targets:\n  - {name: dns, address: 198.51.100.53, probe: dns, answers: baseline}\n",
        "answers",
    );
    let t = d.cfg.targets[0].clone();
    let with = |ip: &str, at: f64| ProbeOutcome {
        answers: Some(vec![ip.parse().unwrap()]),
        ..outcome(at, true)
    };
    d.record_probe(&t, &with("198.51.100.10", 1.0));
    d.record_probe(&t, &with("198.51.100.11", 2.0)); // outside a step: follows
    d.step_active.store(true, Ordering::SeqCst);
    d.record_probe(&t, &with("198.51.100.11", 3.0));
    assert!(d.host.recorder.latest()["dns"].ok);
    d.record_probe(&t, &with("1.2.3.4", 4.0));
    let latest = d.host.recorder.latest()["dns"].clone();
    assert!(!latest.ok, "{latest:?}");
    assert!(
        latest.detail.contains("198.51.100.11 before, 1.2.3.4 now"),
        "{}",
        latest.detail
    );
}

/// The agent sends `dns.burst` queries per name and type each interval, as the one-shot
/// check does (before, it sent one and ignored `dns.burst`).
#[tokio::test]
async fn the_agent_sends_dns_burst_queries_per_name_and_type() {
    let server = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    server
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let port = server.local_addr().unwrap().port();
    let d = test_daemon(
        &format!(
            "dns: {{resolvers: [\"127.0.0.1:{port}\"], names: [a.test, b.test], burst: 3, timeout: 20ms}}\n"
        ),
        "dnsburst",
    );
    let resolver = format!("127.0.0.1:{port}").parse().unwrap();
    let task = tokio::spawn(dns_loop(d.clone(), resolver));
    // One interval (the first tick fires at once, the next in an hour): 2 names x 3.
    let n = tokio::task::spawn_blocking(move || {
        let mut buf = [0u8; 512];
        let mut n = 0;
        while server.recv_from(&mut buf).is_ok() {
            n += 1;
        }
        n
    })
    .await
    .unwrap();
    task.abort();
    assert_eq!(n, 6);
}

/// A probe sent at t=1 times out at t=2, after the probe sent at t=1.5 succeeded: the
/// newer success stays the target's latest result (before the fix the late timeout won,
/// turning `vips` red and resetting the settle window).
#[test]
fn a_late_timeout_does_not_overwrite_a_newer_success() {
    let newer = outcome(1.5, true);
    assert!(supersedes(None, &newer));
    assert!(!supersedes(Some(&newer), &outcome(1.0, false)));
    assert!(supersedes(Some(&outcome(1.0, false)), &newer));
}
