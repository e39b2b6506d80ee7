//! Shared helpers for the privileged integration tests. They need root and real kernel objects;
//! without root they fail loudly, they never skip.
#![allow(dead_code)]
use serde_json::Value;
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use stepguard_lab::{Lab, LabGuard, LabSpec};

pub mod cluster;
pub mod plane;
pub mod real;
pub mod webhook;
pub mod witness;

pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "this integration test needs root (network namespaces, bpffs, eBPF): run `sudo -E cargo xtask test`"
    );
}

pub fn lab(f: impl FnOnce(&mut LabSpec)) -> LabGuard {
    require_root();
    let mut spec = LabSpec::new(stepguard_lab::unique_prefix());
    f(&mut spec);
    stepguard_lab::sys::fixture::Guard(Lab::up(spec).expect("lab up"))
}

/// Runs a command, asserting success, returning stdout.
pub fn sh(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs a command inside the lab's node namespace (host /sys kept: nsenter, not ip netns exec).
pub fn in_node(lab: &Lab, program: &str, args: &[&str]) -> std::process::Output {
    Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", lab.node_ns()))
        .arg("--")
        .arg(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("nsenter {program}: {e}"))
}

/// The HTTP status `curl` gets for `url` from the lab's node namespace (an independent client).
pub fn http_status_from_node(lab: &Lab, url: &str) -> String {
    let out = in_node(
        lab,
        "curl",
        &[
            "-s",
            "-m",
            "2",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            url,
        ],
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn bpftool_json(args: &[&str]) -> Value {
    let mut a = vec!["-j"];
    a.extend_from_slice(args);
    serde_json::from_str(&sh("bpftool", &a)).expect("bpftool JSON")
}

pub fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

pub fn bin(env: &str, name: &str) -> PathBuf {
    std::env::var_os(env).map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../target/debug")
            .join(name)
    })
}

/// Value of one exposition line `name{labels} value`.
pub fn metric_value(body: &str, series: &str) -> Option<f64> {
    body.lines().find_map(|l| {
        l.strip_prefix(series)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse().ok())
    })
}

/// A port nobody listens on yet, for an agent under test.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `stepguard check --format json` in the lab's node namespace with the lab's config.
/// Returns (exit code, parsed JSON, stderr).
pub fn check(lab: &Lab, extra: &[&str]) -> (i32, Value, String) {
    let stepguard = bin("STEPGUARD_BIN", "stepguard");
    let cfg = lab.stepguard_config();
    let out = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", lab.node_ns()))
        .arg("--")
        .arg(&stepguard)
        .args(["check", "--format", "json"])
        .args(if extra.contains(&"--config") {
            vec![]
        } else {
            vec!["--config".to_string(), cfg.to_string_lossy().into_owned()]
        })
        .args(extra)
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", stepguard.display()));
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let v = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (out.status.code().unwrap_or(-1), v, stderr)
}

/// Every Cilium minor the lab imitates, oldest first.
pub const VERSIONS: [stepguard_lab::Profile; 5] = [
    stepguard_lab::Profile::V1_16,
    stepguard_lab::Profile::V1_17,
    stepguard_lab::Profile::V1_18,
    stepguard_lab::Profile::V1_19,
    stepguard_lab::Profile::V1_20,
];

/// A step's verdict reason codes.
pub fn reasons(v: &Value) -> Vec<String> {
    v["verdict"]["reasons"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|r| r.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// One check's result from `check`'s JSON.
pub fn result<'a>(v: &'a Value, name: &str) -> &'a Value {
    v["checks"]
        .as_array()
        .and_then(|a| a.iter().find(|c| c["check"] == name))
        .unwrap_or_else(|| panic!("no {name} in {v}"))
}

/// Sets or clears the lab's blackhole flag directly (bpftool, not the lab library).
pub fn blackhole(lab: &Lab, on: bool) {
    let pin = lab.state.bpffs.join("stepguard-lab/blackhole");
    sh(
        "bpftool",
        &[
            "map",
            "update",
            "pinned",
            &pin.to_string_lossy(),
            "key",
            "0",
            "0",
            "0",
            "0",
            "value",
            if on { "1" } else { "0" },
            "0",
            "0",
            "0",
        ],
    );
}

/// A plain HTTP/1.1 request from inside `netns`; returns (status, body).
pub fn http(
    netns: &str,
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
    token: Option<&str>,
) -> (u16, String) {
    let (method, path) = (method.to_string(), path.to_string());
    let body = body.map(str::to_string);
    let token = token.map(str::to_string);
    stepguard_lab::sys::netns::in_netns(netns, move || {
        use std::io::{Read, Write};
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
        s.set_read_timeout(Some(Duration::from_secs(120)))?;
        let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
        if let Some(t) = &token {
            req.push_str(&format!("Authorization: Bearer {t}\r\n"));
        }
        let b = body.unwrap_or_default();
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}",
            b.len()
        ));
        s.write_all(req.as_bytes())?;
        let mut resp = Vec::new();
        let _ = s.read_to_end(&mut resp);
        let text = String::from_utf8_lossy(&resp).into_owned();
        let status = text
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = text
            .split_once("\r\n\r\n")
            .map(|x| x.1.to_string())
            .unwrap_or_default();
        // Chunked bodies: keep the JSON between the chunk sizes.
        let body = if text
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(&body)
        } else {
            body
        };
        Ok((status, body))
    })
    .expect("http request")
}

fn dechunk(b: &str) -> String {
    let mut out = String::new();
    let mut rest = b;
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || tail.len() < n {
            break;
        }
        out.push_str(&tail[..n]);
        rest = tail[n..].trim_start_matches("\r\n");
    }
    out
}

fn json_or_text(b: String) -> Value {
    match serde_json::from_str(&b) {
        Ok(v) => v,
        Err(_) => Value::String(b),
    }
}

/// `stepguard agent` as a process of the test, in a lab namespace with a lab's config (the one
/// builder of agent processes: `start` for a lab's node, `start_with`/`start_wrapped`/`start_at`
/// for anything else); killed on drop.
pub struct AgentProc {
    pub child: Child,
    pub addr: SocketAddr,
    pub ns: String,
    pub state_dir: PathBuf,
    pub args: Vec<String>,
    /// A command the agent runs under (e.g. `prlimit --nofile=N:N`); it must exec the agent.
    pub wrapper: Vec<String>,
}

impl AgentProc {
    pub fn start(lab: &Lab, extra: &[&str]) -> AgentProc {
        let state_dir = lab.state.run_dir.join("agent-state");
        Self::start_with(
            lab.node_ns(),
            lab.stepguard_config(),
            state_dir,
            free_port(),
            extra,
        )
    }

    pub fn start_with(
        ns: String,
        config: PathBuf,
        state_dir: PathBuf,
        port: u16,
        extra: &[&str],
    ) -> AgentProc {
        Self::start_wrapped(ns, config, state_dir, port, extra, &[])
    }

    /// Starts the agent under `wrapper` (a command that execs its arguments).
    pub fn start_wrapped(
        ns: String,
        config: PathBuf,
        state_dir: PathBuf,
        port: u16,
        extra: &[&str],
        wrapper: &[&str],
    ) -> AgentProc {
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        Self::start_at(ns, config, state_dir, addr, extra, wrapper)
    }

    /// Starts the agent listening on `addr` (e.g. a node's LAN address).
    pub fn start_at(
        ns: String,
        config: PathBuf,
        state_dir: PathBuf,
        addr: SocketAddr,
        extra: &[&str],
        wrapper: &[&str],
    ) -> AgentProc {
        let mut args: Vec<String> = vec![
            "agent".into(),
            "--config".into(),
            config.to_string_lossy().into(),
            "--state-dir".into(),
            state_dir.to_string_lossy().into(),
            "--listen".into(),
            addr.to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let wrapper: Vec<String> = wrapper.iter().map(|s| s.to_string()).collect();
        let child = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{ns}"))
            .arg("--")
            .args(&wrapper)
            .arg(bin("STEPGUARD_BIN", "stepguard"))
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start stepguard agent");
        let d = AgentProc {
            child,
            addr,
            ns,
            state_dir,
            args,
            wrapper,
        };
        d.wait_ready();
        d
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            let ns = self.ns.clone();
            let addr = self.addr;
            let ok = stepguard_lab::sys::netns::in_netns(&ns, move || {
                Ok(TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok())
            })
            .unwrap_or(false);
            if ok && self.get("/readyz").0 == 200 {
                // Wait for the first full round of checks, so steps have a baseline.
                let (_, v) = self.get_json("/v1/verdict");
                if v["checks"].as_array().is_some_and(|a| {
                    a.iter()
                        .all(|c| c["code"] != "not_checked_yet" && c["code"] != "no_probe_yet")
                }) {
                    return;
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!(
            "stepguard agent on {} did not become ready with a first verdict",
            self.addr
        );
    }

    pub fn get(&self, path: &str) -> (u16, String) {
        http(&self.ns, self.addr, "GET", path, None, None)
    }
    pub fn get_json(&self, path: &str) -> (u16, Value) {
        let (s, b) = self.get(path);
        (s, serde_json::from_str(&b).unwrap_or(Value::Null))
    }

    /// `stepguard_kernel_drops_total{reason=...}` from /metrics (0 when absent).
    pub fn kernel_drops(&self, reason: &str) -> u64 {
        let (_, body) = self.get("/metrics");
        metric_value(
            &body,
            &format!("stepguard_kernel_drops_total{{reason=\"{reason}\"}}"),
        )
        .unwrap_or(0.0) as u64
    }
    pub fn post(&self, path: &str, body: &str, token: Option<&str>) -> (u16, Value) {
        let (s, b) = http(&self.ns, self.addr, "POST", path, Some(body), token);
        (s, json_or_text(b))
    }
    pub fn delete(&self, path: &str, token: Option<&str>) -> (u16, Value) {
        let (s, b) = http(&self.ns, self.addr, "DELETE", path, None, token);
        (s, json_or_text(b))
    }

    /// Begins a step; returns its id.
    pub fn begin(&self, body: &str) -> String {
        let (s, v) = self.post("/v1/steps", body, None);
        assert_eq!(s, 201, "POST /v1/steps: {v}");
        v["id"].as_str().unwrap().to_string()
    }

    /// Waits (bounded) until every target of step `id` has at least `n` more probes recorded
    /// in the step than `since` (from [`AgentProc::probes`]): the step is probing at its cadence.
    pub fn wait_probing(&self, id: &str, n: u64, since: &std::collections::BTreeMap<String, u64>) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let now = self.probes(id);
            if !now.is_empty()
                && now
                    .iter()
                    .all(|(k, v)| *v >= since.get(k).copied().unwrap_or(0) + n)
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "step {id}: targets never reached {n} more probes: {now:?} (from {since:?})"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits (bounded) until the step as persisted on disk satisfies `ok`.
    pub fn wait_persisted(&self, id: &str, ok: impl Fn(&Value) -> bool) {
        let path = self.state_dir.join("steps").join(format!("{id}.json"));
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let v: Value = std::fs::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .unwrap_or(Value::Null);
            if ok(&v) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "step {id} on disk never reached the expected state: {v}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Probes recorded per target in step `id` so far.
    pub fn probes(&self, id: &str) -> std::collections::BTreeMap<String, u64> {
        let (_, v) = self.get_json(&format!("/v1/steps/{id}"));
        v["probes"]
            .as_object()
            .map(|o| {
                o.iter()
                    .map(|(k, p)| (k.clone(), p["sent"].as_u64().unwrap_or(0)))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Begins a step and waits until it probes every target at its cadence.
    pub fn begin_probing(&self, body: &str) -> String {
        let id = self.begin(body);
        self.wait_probing(&id, 5, &Default::default());
        id
    }

    /// Long-polls until the step is decided (bounded).
    pub fn verdict(&self, id: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(600);
        while Instant::now() < deadline {
            let t = Instant::now();
            let (s, v) = self.get_json(&format!("/v1/steps/{id}?wait=60s"));
            if s == 200 {
                return v;
            }
            assert_eq!(s, 202, "GET step: {v}");
            // Answered at once (the agent holds no more long-polls): poll again shortly.
            if t.elapsed() < Duration::from_secs(1) {
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        panic!("step {id} was not decided within 10 minutes");
    }

    pub fn kill9(&mut self) {
        // nsenter execs stepguard in place: this pid is the agent.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGKILL) };
        let _ = self.child.wait();
    }

    /// Starts the agent again with the same state directory and port.
    pub fn restart_same(&mut self) {
        let child = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", self.ns))
            .arg("--")
            .args(&self.wrapper)
            .arg(bin("STEPGUARD_BIN", "stepguard"))
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("restart stepguard agent");
        self.child = child;
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            let (ns, addr) = (self.ns.clone(), self.addr);
            let up = stepguard_lab::sys::netns::in_netns(&ns, move || {
                Ok(TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok())
            })
            .unwrap_or(false);
            if up && self.get("/readyz").0 == 200 {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the restarted agent did not become ready");
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Asserts that a measured gap (one entry of a step's `gaps`) matches the lab's recorded
/// blackhole within the error bound the agent itself reports, widened only by the lab's own
/// recording uncertainty (the instants just before and after it set and lifted the flag).
pub fn assert_gap_matches(g: &Value, r: &stepguard_lab::RestartReport, what: &str) {
    let s = |ns: u128| ns as f64 / 1e9;
    let bound = g["error_bound_s"].as_f64().expect("error_bound_s");
    let longest = g["longest_s"].as_f64().expect("longest_s");
    let (gs, ge) = (
        g["longest_start"].as_f64().expect("longest_start"),
        g["longest_end"].as_f64().expect("longest_end"),
    );
    let (start, on, off, end) = (
        s(r.blackhole_start_ns),
        s(r.blackhole_on_ns),
        s(r.blackhole_off_ns),
        s(r.blackhole_end_ns),
    );
    assert!(
        gs >= start - bound && gs <= on + bound,
        "{what}: outage began at {gs:.4}, the blackhole in [{start:.4}, {on:.4}], bound ±{:.1} ms",
        bound * 1e3
    );
    assert!(
        ge >= off - bound && ge <= end + bound,
        "{what}: outage ended at {ge:.4}, the blackhole in [{off:.4}, {end:.4}], bound ±{:.1} ms",
        bound * 1e3
    );
    assert!(
        longest >= (off - on) - bound && longest <= (end - start) + bound,
        "{what}: measured {:.1} ms, the blackhole lasted {:.1}..{:.1} ms, bound ±{:.1} ms",
        longest * 1e3,
        (off - on) * 1e3,
        (end - start) * 1e3,
        bound * 1e3
    );
}

/// A step on disk whose every target has samples persisted.
pub fn every_target_persisted(s: &Value) -> bool {
    s["targets"]
        .as_object()
        .is_some_and(|t| t.values().all(|t| t["persisted_through"].is_array()))
}

/// A step on disk with a target whose last persisted probe failed (an outage going on).
pub fn some_target_persisted_failing(s: &Value) -> bool {
    s["targets"]
        .as_object()
        .is_some_and(|t| t.values().any(|t| t["persisted_through"][1] == false))
}

/// Waits (bounded) until the lab's blackhole flag reads 1, as bpftool sees it.
pub fn wait_for_blackhole(bpffs: &std::path::Path) {
    let pin = bpffs.join("stepguard-lab/blackhole");
    for _ in 0..500 {
        let v = bpftool_json(&[
            "map",
            "lookup",
            "pinned",
            &pin.to_string_lossy(),
            "key",
            "0",
            "0",
            "0",
            "0",
        ]);
        if v["value"][0].as_str() == Some("0x01") {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("the blackhole never became active");
}

/// The agent on node `i` of a LAN lab, with the lab's config for that node.
pub fn agent_on(lan: &stepguard_lab::lan::LanLab, i: u8) -> AgentProc {
    let node = lan.node(i).unwrap();
    AgentProc::start_with(
        node.node_ns(),
        lan.node_config(i),
        lan.state.run_dir.join(format!("agent-state-n{i}")),
        free_port(),
        &[],
    )
}

/// A 256 KiB tmpfs mounted at `dir` for a test's state directory; unmounted however the test
/// ends.
pub struct Tmpfs(pub PathBuf);

impl Tmpfs {
    pub fn small(dir: &std::path::Path) -> Tmpfs {
        std::fs::create_dir_all(dir).unwrap();
        sh(
            "mount",
            &[
                "-t",
                "tmpfs",
                "-o",
                "size=256k",
                "tmpfs",
                dir.to_str().unwrap(),
            ],
        );
        Tmpfs(dir.to_path_buf())
    }

    /// Fills the tmpfs at `dir` (writes after this fail); returns the filler to remove.
    pub fn fill(dir: &std::path::Path) -> PathBuf {
        let filler = dir.join("filler");
        let _ = Command::new("dd")
            .args(["if=/dev/zero", "bs=4k", "count=1000"])
            .arg(format!("of={}", filler.display()))
            .stderr(std::process::Stdio::null())
            .status();
        filler
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// What a flooder does with each of its connections.
#[derive(Clone, Copy, Debug)]
pub enum Flood {
    /// Sends one byte of a request, then nothing.
    OneByte,
    /// Sends a whole request, reads the answer, then keeps the connection open and idle.
    IdleKeepAlive,
    /// Sends its request headers a byte every half second.
    Slowloris,
}

/// Keeps `n` connections of kind `kind` open to `addr` from `ns` for `for_s`, opening a new one
/// whenever the agent closes one (bounded in time). Returns how many it opened.
pub fn flood(
    ns: &str,
    addr: std::net::SocketAddr,
    kind: Flood,
    n: usize,
    for_s: u64,
) -> std::thread::JoinHandle<usize> {
    use std::io::{Read, Write};
    let ns = ns.to_string();
    std::thread::spawn(move || {
        stepguard_lab::sys::netns::in_netns(&ns, move || {
            let until = Instant::now() + Duration::from_secs(for_s);
            let mut conns: Vec<std::net::TcpStream> = Vec::new();
            let (mut made, mut dribbled) = (0, Instant::now());
            while Instant::now() < until {
                while conns.len() < n && Instant::now() < until {
                    let Ok(mut c) =
                        std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200))
                    else {
                        break;
                    };
                    let first: &[u8] = match kind {
                        Flood::OneByte | Flood::Slowloris => b"G",
                        Flood::IdleKeepAlive => b"GET /livez HTTP/1.1\r\nhost: flood\r\n\r\n",
                    };
                    let _ = c.write_all(first);
                    let _ = c.set_nonblocking(true);
                    conns.push(c);
                    made += 1;
                }
                let mut b = [0u8; 1024];
                conns.retain_mut(|c| match c.read(&mut b) {
                    Ok(0) => false,
                    Ok(_) => true,
                    Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
                });
                if matches!(kind, Flood::Slowloris)
                    && dribbled.elapsed() > Duration::from_millis(500)
                {
                    for c in conns.iter_mut() {
                        let _ = c.write(b"E");
                    }
                    dribbled = Instant::now();
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(made)
        })
        .unwrap()
    })
}

/// A control plane of a test's own and its directory, taken down and removed when dropped.
pub struct PlaneGuard(pub stepguard_lab::kube::ControlPlane, pub PathBuf);

impl Drop for PlaneGuard {
    fn drop(&mut self) {
        self.0.down();
        let _ = std::fs::remove_dir_all(&self.1);
    }
}

/// `kubectl apply --server-side` as `manager`, panicking with kubectl's answer on failure.
pub fn apply_server_side(
    cp: &stepguard_lab::kube::ControlPlane,
    manager: &str,
    args: &[&str],
) -> String {
    let manager = format!("--field-manager={manager}");
    let mut a = vec!["apply", "--server-side", manager.as_str()];
    a.extend_from_slice(args);
    cp.kubectl(&a)
        .unwrap_or_else(|e| panic!("server-side apply {args:?}: {e:#}"))
}
