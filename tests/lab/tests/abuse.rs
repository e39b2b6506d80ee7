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
    stepguard_lab::sys::netns::in_netns(ns, move || {
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
    let agent = AgentProc::start_wrapped(
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
    let mut agent = AgentProc::start(
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

/// A socket with a tiny receive buffer (set before connecting), from inside `ns`.
fn slow_reader(ns: &str, addr: std::net::SocketAddr, n: usize, requests: usize) -> Vec<TcpStream> {
    stepguard_lab::sys::netns::in_netns(ns, move || {
        use std::io::Write;
        use std::os::fd::FromRawFd;
        let mut out = Vec::new();
        let std::net::SocketAddr::V4(a) = addr else {
            anyhow::bail!("IPv4 only")
        };
        let req = "GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n".repeat(requests);
        for _ in 0..n {
            // SAFETY: plain socket calls on a descriptor this function owns.
            let s = unsafe {
                let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
                if fd < 0 {
                    continue;
                }
                let size: libc::c_int = 2048;
                libc::setsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    libc::SO_RCVBUF,
                    &size as *const _ as *const libc::c_void,
                    std::mem::size_of::<libc::c_int>() as u32,
                );
                let sa = libc::sockaddr_in {
                    sin_family: libc::AF_INET as u16,
                    sin_port: a.port().to_be(),
                    sin_addr: libc::in_addr {
                        s_addr: u32::from(*a.ip()).to_be(),
                    },
                    sin_zero: [0; 8],
                };
                if libc::connect(
                    fd,
                    &sa as *const _ as *const libc::sockaddr,
                    std::mem::size_of::<libc::sockaddr_in>() as u32,
                ) != 0
                {
                    libc::close(fd);
                    continue;
                }
                TcpStream::from_raw_fd(fd)
            };
            let mut s = s;
            s.set_write_timeout(Some(Duration::from_millis(50)))?;
            let _ = s.write_all(req.as_bytes());
            out.push(s);
        }
        Ok(out)
    })
    .unwrap()
}

/// 270 slow readers (2 KiB receive buffers, 400 pipelined GETs each, never
/// reading) hold no slot for long: /readyz and /metrics keep answering, and a step with an
/// outage is begun and measured meanwhile.
#[test]
fn slow_readers_do_not_lock_the_agent_out() {
    let mut lab = lab(|_| {});
    let agent = AgentProc::start(&lab, &[]);
    let slow = slow_reader(&agent.ns, agent.addr, 270, 400);
    assert!(slow.len() >= 250, "{} slow readers", slow.len());
    let t = Instant::now();
    let mut answered = 0;
    for _ in 0..20 {
        let (a, _) = agent.get("/readyz");
        let (b, m) = agent.get("/metrics");
        if a == 200 && b == 200 && m.ends_with("# EOF\n") {
            answered += 1;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        answered >= 18,
        "/readyz and /metrics answered {answered} of 20 times in {:?} with slow readers",
        t.elapsed()
    );
    let id = agent.begin_probing(r#"{"settle":"1s","timeout":"30s"}"#);
    let more = slow_reader(&agent.ns, agent.addr, 270, 400);
    let r = lab
        .restart(&RestartOpts {
            down: Duration::from_millis(300),
            blackhole: true,
            ..Default::default()
        })
        .unwrap();
    let v = agent.verdict(&id);
    assert_eq!(v["verdict"]["status"], "passed", "{:#}", v["verdict"]);
    for g in v["gaps"].as_array().unwrap() {
        assert_gap_matches(g, &r, g["target"].as_str().unwrap());
    }
    drop((slow, more));
}

/// `n` long-polls of step `id` on `agent`, each waiting up to `wait`: (status, body) each.
fn long_polls(
    agent: &AgentProc,
    id: &str,
    n: usize,
    wait: &str,
) -> Vec<std::thread::JoinHandle<(u16, String)>> {
    (0..n)
        .map(|_| {
            let (ns, addr) = (agent.ns.clone(), agent.addr);
            let path = format!("/v1/steps/{id}?wait={wait}");
            std::thread::spawn(move || http(&ns, addr, "GET", &path, None, None))
        })
        .collect()
}

/// With every long-poll slot held, `stepguard wait` connects at most twice
/// a second (it used to spin: 2,136 connects in 5 s), honouring the agent's Retry-After.
#[test]
fn waiters_back_off_when_every_long_poll_slot_is_held() {
    let lab = lab(|_| {});
    let agent = AgentProc::start(&lab, &["--max-long-polls", "2"]);
    let id = agent.begin_probing(r#"{"settle":"1s","timeout":"60s"}"#);
    let hold = long_polls(&agent, &id, 2, "30s");
    std::thread::sleep(Duration::from_millis(500));
    // A counting proxy in the node namespace between `stepguard wait` and the agent.
    let proxy = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()));
    let connects = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let listener = {
        let ns = agent.ns.clone();
        stepguard_lab::sys::netns::in_netns(&ns, move || Ok(std::net::TcpListener::bind(proxy)?))
            .unwrap()
    };
    listener.set_nonblocking(true).unwrap();
    let (c2, target) = (connects.clone(), agent.addr);
    let ns = agent.ns.clone();
    let proxy_thread = std::thread::spawn(move || {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(8) {
            match listener.accept() {
                Ok((mut client, _)) => {
                    c2.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let upstream = stepguard_lab::sys::netns::in_netns(&ns, move || {
                        Ok(TcpStream::connect_timeout(&target, Duration::from_secs(1))?)
                    });
                    if let Ok(mut up) = upstream {
                        let _ = client.set_nonblocking(false);
                        let (mut c_r, mut u_w) =
                            (client.try_clone().unwrap(), up.try_clone().unwrap());
                        std::thread::spawn(move || {
                            let _ = std::io::copy(&mut c_r, &mut u_w);
                        });
                        std::thread::spawn(move || {
                            let _ = std::io::copy(&mut up, &mut client);
                        });
                    }
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    });
    let t = Instant::now();
    let out = in_node(
        &lab,
        "timeout",
        &[
            "5",
            bin("STEPGUARD_BIN", "stepguard").to_str().unwrap(),
            "wait",
            "--agent",
            &format!("http://{proxy}"),
            "--step",
            &id,
            "--timeout",
            "60s",
        ],
    );
    let elapsed = t.elapsed().as_secs_f64();
    let n = connects.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        (n as f64) <= 2.0 * elapsed + 2.0,
        "`stepguard wait` connected {n} times in {elapsed:.1} s (at most 2 a second): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(n >= 2, "it did poll: {n}");
    proxy_thread.join().unwrap();
    for h in hold {
        let _ = h.join();
    }
}

/// The state dir fills after the first save. The verdict is served and says
/// it is not persisted, readiness says why, a metric counts the failed writes, no temporary
/// file is left, and once there is room again the record is written and survives a restart.
#[test]
fn a_full_state_dir_loses_no_verdict() {
    let mut lab = lab(|_| {});
    let dir = lab.state.run_dir.join("small-state");
    let _mounted = Tmpfs::small(&dir);
    let mut agent = AgentProc::start_with(
        lab.node_ns(),
        lab.stepguard_config(),
        dir.clone(),
        free_port(),
        &[],
    );
    let id = agent.begin_probing(r#"{"settle":"1s","timeout":"30s"}"#);
    // Fill the disk: the step's later writes fail.
    let filler = Tmpfs::fill(&dir);
    lab.restart(&RestartOpts {
        down: Duration::from_millis(200),
        ..Default::default()
    })
    .unwrap();
    let v = agent.verdict(&id);
    assert_eq!(v["verdict"]["status"], "passed", "{:#}", v["verdict"]);
    assert!(
        v["not_persisted"]
            .as_str()
            .is_some_and(|n| n.contains("could not be written")),
        "the step says it is not on disk: {}",
        v["not_persisted"]
    );
    let (s, body) = agent.get("/readyz");
    assert_eq!(s, 503, "{body}");
    assert!(body.contains("state dir"), "{body}");
    let (_, m) = agent.get("/metrics");
    let errors = metric_value(&m, "stepguard_state_write_errors_total").unwrap_or(0.0);
    assert!(errors >= 1.0, "write errors counted: {errors}");
    let steps_dir = dir.join("steps");
    let leftovers: Vec<String> = std::fs::read_dir(&steps_dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
    // Room again: the record is written within a few seconds, readiness comes back.
    std::fs::remove_file(&filler).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let on_disk: serde_json::Value = std::fs::read(steps_dir.join(format!("{id}.json")))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        if on_disk["verdict"]["status"] == "passed" && agent.get("/readyz").0 == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the record was not written again: {on_disk}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    agent.kill9();
    agent.restart_same();
    let v = agent.verdict(&id);
    assert_eq!(
        v["verdict"]["status"], "passed",
        "after a restart: {:#}",
        v["verdict"]
    );
    assert!(v["not_persisted"].is_null(), "{}", v["not_persisted"]);
}

/// A peer at a witness's address (a compromised LAN witness, or anyone answering at its
/// address over plain HTTP): it accepts the step's begin, then answers every poll with a body
/// that never ends (`endless`) or not at all. Counts the polls, and the most in flight at once.
struct HostileWitness {
    url: String,
    polls: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    most_at_once: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// Steps begun on it (POSTs).
    begins: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

fn hostile_witness(ns: &str, endless: bool, for_s: u64) -> HostileWitness {
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use std::sync::Arc;
    let listener =
        stepguard_lab::sys::netns::in_netns(ns, || Ok(std::net::TcpListener::bind("127.0.0.1:0")?))
            .unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (polls, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let begins = Arc::new(AtomicUsize::new(0));
    let now_in = Arc::new(AtomicUsize::new(0));
    let (p, m, bg) = (polls.clone(), most.clone(), begins.clone());
    let until = Instant::now() + Duration::from_secs(for_s);
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        while Instant::now() < until {
            let Ok((mut c, _)) = listener.accept() else {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            };
            let (p, m, now_in, bg) = (p.clone(), m.clone(), now_in.clone(), bg.clone());
            std::thread::spawn(move || {
                c.set_nonblocking(false).unwrap();
                c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
                let mut head = Vec::new();
                let mut b = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 65536 {
                    match c.read(&mut b) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&b[..n]),
                    }
                }
                if head.starts_with(b"DELETE") {
                    let _ = c.write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}",
                    );
                    return;
                }
                if head.starts_with(b"POST") {
                    bg.fetch_add(1, SeqCst);
                    let body = format!(
                        r#"{{"id":"hostile","instance":"hostile-1","created_at":{}}}"#,
                        std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)
                            .unwrap()
                            .as_secs_f64()
                    );
                    let _ = write!(
                        c,
                        "HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    return;
                }
                p.fetch_add(1, SeqCst);
                let at_once = now_in.fetch_add(1, SeqCst) + 1;
                m.fetch_max(at_once, SeqCst);
                if endless {
                    let chunk = format!("10000\r\n{}\r\n", " ".repeat(0x10000));
                    let _ = c.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n");
                    while Instant::now() < until && c.write_all(chunk.as_bytes()).is_ok() {}
                } else {
                    // Never answers: holds the poll until the agent gives up on it.
                    while Instant::now() < until && !matches!(c.read(&mut b), Ok(0)) {}
                }
                now_in.fetch_sub(1, SeqCst);
            });
        }
    });
    HostileWitness {
        url,
        polls,
        most_at_once: most,
        begins,
    }
}

/// A witness answering polls with an endless body: the agent reads at most its cap (1 MiB)
/// of each answer, its memory stays under the DaemonSet's 64 Mi limit, and the step records the
/// witness's failure. One that never answers is polled one poll at a time, never piled up
/// (polls every 500 ms, each waiting up to 3 s).
#[test]
fn a_hostile_witness_neither_fills_the_agents_memory_nor_piles_up_its_polls() {
    use std::sync::atomic::Ordering::SeqCst;
    let mut lab = lab(|_| {});
    let agent = AgentProc::start(&lab, &[]);
    for endless in [true, false] {
        let w = hostile_witness(&agent.ns, endless, 40);
        let id = agent.begin_probing(&format!(
            r#"{{"settle":"1s","timeout":"12s","witnesses":["{}"]}}"#,
            w.url
        ));
        let (pid, mut peak) = (agent.child.id(), 0.0f64);
        let sampler = std::thread::spawn(move || {
            let mut peak = 0.0f64;
            let until = Instant::now() + Duration::from_secs(8);
            while Instant::now() < until {
                peak = peak.max(rss_mib(pid));
                std::thread::sleep(Duration::from_millis(100));
            }
            peak
        });
        lab.restart(&RestartOpts {
            down: Duration::from_millis(100),
            ..Default::default()
        })
        .unwrap();
        peak = peak.max(sampler.join().unwrap());
        let v = agent.verdict(&id);
        let polls = w.polls.load(SeqCst);
        assert!(polls >= 2, "the witness was polled: {polls}");
        assert!(peak < 64.0, "RSS peaked at {peak:.1} MiB ({polls} polls)");
        let track = &v["witnesses"][&w.url];
        assert!(track.is_object(), "{v:#}");
        if endless {
            assert!(
                track.to_string().contains("longer than 1048576 bytes"),
                "the cap named: {track}"
            );
        } else {
            assert_eq!(
                w.most_at_once.load(SeqCst),
                1,
                "one poll at a time ({polls} polls)"
            );
        }
        assert!(agent.get_json("/readyz").0 == 200, "the agent still ready");
    }
}

/// Twenty POSTs at once (different ids, the same witness): one step begins, the others are
/// refused 409 before anything is begun on the witness, which so sees exactly one step
/// (before, all twenty were begun there and never ended, evicting the winner's).
#[test]
fn concurrent_posts_naming_a_witness_begin_only_the_winner_there() {
    use std::sync::atomic::Ordering::SeqCst;
    let lab = lab(|_| {});
    let agent = AgentProc::start(&lab, &[]);
    let w = hostile_witness(&agent.ns, false, 30);
    let posts: Vec<_> = (0..20)
        .map(|i| {
            let (ns, addr, url) = (agent.ns.clone(), agent.addr, w.url.clone());
            std::thread::spawn(move || {
                let body = format!(
                    r#"{{"id":"race-{i}","settle":"1s","timeout":"10s","witnesses":["{url}"]}}"#
                );
                http(&ns, addr, "POST", "/v1/steps", Some(&body), None).0
            })
        })
        .collect();
    let mut codes: Vec<u16> = posts.into_iter().map(|h| h.join().unwrap()).collect();
    codes.sort();
    assert_eq!(codes.iter().filter(|c| **c == 201).count(), 1, "{codes:?}");
    assert_eq!(codes.iter().filter(|c| **c == 409).count(), 19, "{codes:?}");
    assert_eq!(w.begins.load(SeqCst), 1, "steps begun on the witness");
}

/// SIGHUP (a closed terminal, a habit of reloading daemons) no longer ends the agent: it is
/// ignored with a line saying so, and the agent keeps serving.
#[test]
fn sighup_does_not_end_the_agent() {
    let lab = lab(|_| {});
    let agent = AgentProc::start(&lab, &[]);
    // SAFETY: a signal to the agent this test started.
    unsafe { libc::kill(agent.child.id() as i32, libc::SIGHUP) };
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        agent.get("/livez").0,
        200,
        "the agent still serves after SIGHUP"
    );
}

/// A legitimate client: `GET /readyz` every 200 ms for `for_s` from `ns`, each on a new
/// connection. Returns (answered 200 within 1 s, asked, the slowest answer).
fn prompt_client(
    ns: &str,
    addr: std::net::SocketAddr,
    for_s: u64,
) -> std::thread::JoinHandle<(usize, usize, Duration)> {
    use std::io::{Read, Write};
    let ns = ns.to_string();
    std::thread::spawn(move || {
        stepguard_lab::sys::netns::in_netns(&ns, move || {
            let until = Instant::now() + Duration::from_secs(for_s);
            let (mut ok, mut asked, mut slowest) = (0, 0, Duration::ZERO);
            while Instant::now() < until {
                asked += 1;
                let t = Instant::now();
                let served = (|| -> std::io::Result<bool> {
                    let mut c = TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
                    c.set_read_timeout(Some(Duration::from_secs(1)))?;
                    c.write_all(
                        b"GET /readyz HTTP/1.1\r\nhost: client\r\nconnection: close\r\n\r\n",
                    )?;
                    let mut b = [0u8; 64];
                    let n = c.read(&mut b)?;
                    Ok(b[..n].starts_with(b"HTTP/1.1 200"))
                })()
                .unwrap_or(false);
                let took = t.elapsed();
                slowest = slowest.max(took);
                if served && took <= Duration::from_secs(1) {
                    ok += 1;
                }
                std::thread::sleep(Duration::from_millis(200).saturating_sub(took));
            }
            Ok((ok, asked, slowest))
        })
        .unwrap()
    })
}

/// Floods that once took every connection slot from anyone without a token — one byte per
/// connection, idle keep-alive connections, slowloris — each well beyond the slots, from the
/// same address as a legitimate client: the client asking `/readyz` every 200 ms is served
/// within 1 s at least 99 % of the time during each (a newcomer whose request has arrived
/// takes the slot of the oldest connection not answering a request; one source holds at most
/// its share).
#[test]
fn connection_floods_do_not_lock_a_prompt_client_out() {
    let lab = lab(|_| {});
    let agent = AgentProc::start(&lab, &["--max-connections", "64"]);
    let mut report = vec![];
    for kind in [Flood::OneByte, Flood::IdleKeepAlive, Flood::Slowloris] {
        let f = flood(&agent.ns, agent.addr, kind, 150, 8);
        std::thread::sleep(Duration::from_secs(1));
        let (ok, asked, slowest) = prompt_client(&agent.ns, agent.addr, 6).join().unwrap();
        let made = f.join().unwrap();
        report.push(format!(
            "{kind:?}: {ok}/{asked} served within 1 s (slowest {slowest:?}; the flood opened {made})"
        ));
        assert!(made >= 150, "{}", report.join("\n"));
        assert!(ok * 100 >= asked * 99, "{}", report.join("\n"));
    }
    // 300 clients pipelining `GET /metrics` with a 2 KiB receive buffer, never reading: one
    // encoding runs at a time, its answer shared for 100 ms; stalled writers give their slots
    // up.
    let slow = slow_reader(&agent.ns, agent.addr, 300, 400);
    let (ok, asked, slowest) = prompt_client(&agent.ns, agent.addr, 6).join().unwrap();
    report.push(format!(
        "/metrics slow readers ({}): {ok}/{asked} served within 1 s (slowest {slowest:?})",
        slow.len()
    ));
    assert!(ok * 100 >= asked * 99, "{}", report.join("\n"));
    drop(slow);
    eprintln!("{}", report.join("\n"));
}

/// Every slot held by a request being answered (long-polls, which no newcomer may evict): a
/// probe still gets the slot set aside for `/livez` and `/readyz`, at once.
#[test]
fn a_probe_is_served_while_every_slot_answers_a_long_poll() {
    let lab = lab(|_| {});
    let agent = AgentProc::start(&lab, &["--max-connections", "8", "--max-long-polls", "8"]);
    let id = agent.begin_probing(r#"{"settle":"1s","timeout":"60s"}"#);
    let polls = long_polls(&agent, &id, 8, "4s");
    std::thread::sleep(Duration::from_millis(1000));
    let t = Instant::now();
    let (s, body) = agent.get("/readyz");
    assert_eq!(s, 200, "{body}");
    assert!(
        t.elapsed() < Duration::from_millis(400),
        "{:?}",
        t.elapsed()
    );
    for p in polls {
        assert_eq!(
            p.join().unwrap().0,
            202,
            "the long-polls were held to their wait"
        );
    }
}
