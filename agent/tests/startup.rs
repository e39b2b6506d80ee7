//! Bad startup input stops the agent at once with exit 2 and one line naming the field, never
//! a panicked worker or a busy loop behind a "ready" agent. (No root: the agent stops before
//! it touches the kernel.)
use std::path::PathBuf;
use std::process::Command;

/// A directory of its own for each caller (the tests run side by side in one process: a
/// shared one removed by one test vanished under another's config file).
fn dir() -> PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let d = std::env::temp_dir().join(format!("sg-startup-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs `stepguard agent` with `args` (and a config holding `yaml` when given).
fn agent(args: &[&str], yaml: Option<&str>) -> (Option<i32>, String) {
    let d = dir();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_stepguard"));
    cmd.arg("agent")
        .args(["--listen", "127.0.0.1:9"])
        .arg("--state-dir")
        .arg(d.join("state"));
    if let Some(y) = yaml {
        let p = d.join(format!("cfg-{}.yaml", y.len()));
        std::fs::write(&p, y).unwrap();
        cmd.arg("--config").arg(p);
    }
    let out = cmd
        .args(args)
        .env_remove("STEPGUARD_CONFIG")
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&d);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).trim().to_string(),
    )
}

fn refused(args: &[&str], yaml: Option<&str>, field: &str) {
    let (code, err) = agent(args, yaml);
    assert_eq!(code, Some(2), "{args:?} {yaml:?}: {err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(err.contains(field), "{field} named in: {err}");
}

#[test]
fn bad_startup_input_exits_2_with_one_line_naming_the_field() {
    refused(&["--probe-interval", "0ms"], None, "--probe-interval");
    refused(&["--slow-interval", "0ms"], None, "--slow-interval");
    refused(&["--burst-interval", "0ms"], None, "--burst-interval");
    let target = |extra: &str| {
        format!("targets:\n  - {{name: t, address: 198.51.100.10, probe: tcp, port: 80{extra}}}\n")
    };
    refused(
        &[],
        Some(&target(", port: 0").replace("port: 80, ", "")),
        "port",
    );
    refused(
        &[],
        Some("targets:\n  - {name: t, address: 198.51.100.10, probe: icmp, port: 80}\n"),
        "targets[0].port",
    );
    refused(&[], Some(&target(", timeout: 500us")), "targets[0].timeout");
    refused(&[], Some("dns: {timeout: 100us}\n"), "dns.timeout");
    // A bpffs or cilium_config path that exists but is a file.
    let file = dir().join("a-file");
    std::fs::write(&file, "x").unwrap();
    refused(&[], Some(&format!("bpffs: {}\n", file.display())), "bpffs");
    refused(
        &[],
        Some(&format!("cilium_config: {}\n", file.display())),
        "cilium_config",
    );
    // A token file with two lines: nothing could authenticate.
    let token = dir().join("token");
    std::fs::write(&token, "first-line-0123456789\nsecond-line-0123456789\n").unwrap();
    refused(
        &["--token-file", &token.to_string_lossy()],
        None,
        "token file",
    );
    for f in [&file, &token] {
        if let Some(d) = f.parent() {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// A path that does not exist yet (Cilium not started on this node) is not a startup error:
/// the agent serves, and the checks that need it are unknown until it appears.
#[test]
fn a_bpffs_that_does_not_exist_yet_is_not_a_startup_error() {
    use std::io::{Read, Write};
    let d = dir();
    let missing = d.join("no-bpffs-yet");
    let cfg = d.join("missing-bpffs.yaml");
    std::fs::write(&cfg, format!("bpffs: {}\n", missing.display())).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_stepguard"))
        .args(["agent", "--listen", &format!("127.0.0.1:{port}")])
        .arg("--state-dir")
        .arg(d.join("state-missing"))
        .arg("--config")
        .arg(&cfg)
        .env_remove("STEPGUARD_CONFIG")
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let get = |path: &str| -> Option<String> {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
        s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .ok()?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .ok()?;
        let mut r = String::new();
        s.read_to_string(&mut r).ok()?;
        Some(r)
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let verdict = loop {
        assert!(
            std::time::Instant::now() < deadline && child.try_wait().unwrap().is_none(),
            "the agent did not come up with a missing bpffs"
        );
        if let Some(v) = get("/v1/verdict").filter(|v| v.contains("\"maps\"")) {
            if !v.contains("not_checked_yet") {
                break v;
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(verdict.starts_with("HTTP/1.1 503"), "{verdict}");
    let body = verdict.split("\r\n\r\n").nth(1).unwrap_or("");
    let v: serde_json::Value = serde_json::from_str(body).unwrap();
    let maps = v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["check"] == "maps")
        .unwrap();
    assert_eq!(maps["status"], "unknown", "{maps}");
}

/// `stepguard check | head -1`: stdout closes early; the exit code is still 0/1/2 (before:
/// a panic on the broken pipe, exit 101).
#[test]
fn a_closed_stdout_does_not_change_the_exit_code() {
    let d = dir();
    let cfg = d.join("pipe.yaml");
    std::fs::write(&cfg, format!("bpffs: {}\n", d.join("none").display())).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_stepguard"))
        .args(["check", "--format", "text", "--only", "maps", "--config"])
        .arg(&cfg)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    drop(child.stdout.take()); // the reader is gone before anything is written
    let code = child.wait().unwrap().code();
    assert_eq!(code, Some(2), "unknown maps: exit 2, not a panic");
}

/// A witness without a token refuses to start unless told, by a flag that says so, that it
/// serves steps to anyone on the LAN (anyone could otherwise plant a step with its own budget).
#[test]
fn a_witness_without_a_token_does_not_start_unless_told_it_is_unauthenticated() {
    let d = dir();
    let cfg = d.join("witness.yaml");
    std::fs::write(
        &cfg,
        "targets:\n  - {name: t, address: 198.51.100.10, probe: tcp, port: 80}\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_stepguard"))
        .args(["witness", "--listen", "127.0.0.1:9", "--config"])
        .arg(&cfg)
        .env_remove("STEPGUARD_TOKEN_FILE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--token-file") && err.contains("--allow-unauthenticated"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

/// 500 targets at the default 10 ms step cadence are refused at startup with one line (they
/// cost 1.3 cores in a step).
#[test]
fn a_probe_budget_is_checked_at_startup() {
    let mut y = String::from("targets:\n");
    for i in 0..500 {
        y.push_str(&format!(
            "  - {{name: t{i}, address: 198.51.100.10, probe: tcp, port: 80}}\n"
        ));
    }
    refused(&[], Some(&y), "targets");
    let (_, err) = agent(&[], Some(&y));
    assert!(err.contains("probes a second"), "{err}");
}

/// The guard counts the probes between steps too: 400 targets with a coarse step cadence
/// are fine at the default 1 s steady cadence and refused at 50 ms (8,000 a second); more
/// than 1,000 targets are refused whatever the cadences.
#[test]
fn the_steady_probe_rate_and_the_target_count_are_checked_at_startup() {
    let targets = |n: usize| {
        let mut y = String::from("targets:\n");
        for i in 0..n {
            y.push_str(&format!(
                "  - {{name: t{i}, address: 198.51.100.10, probe: tcp, port: 80}}\n"
            ));
        }
        y
    };
    let y = targets(400);
    let (_, err) = agent(
        &["--burst-interval", "1s", "--probe-interval", "50ms"],
        Some(&y),
    );
    assert!(err.contains("probes a second between steps"), "{err}");
    refused(
        &["--burst-interval", "1s", "--probe-interval", "50ms"],
        Some(&y),
        "targets",
    );
    // Accepted (checked without starting an agent that would then run).
    let cfg = stepguard::config::Config::parse(&y).unwrap();
    let s = std::time::Duration::from_secs(1);
    assert!(cfg.check_probe_budget(s, s).is_ok());
    let (_, err) = agent(&["--burst-interval", "10s"], Some(&targets(1001)));
    assert!(err.contains("1001 targets: at most 1000"), "{err}");
}
