//! Real servers behind the lab's VIPs, run in the fabric namespace: dnsmasq (Debian's
//! dnsmasq-base) answering a few names on the DNS VIP, and nginx on the gateway VIP.
//! They run detached (own session) so they outlive the `lab up` process; `down` stops them
//! by the pid and start time recorded in the lab's state.
use crate::netns::netns_path;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A process the lab started, identified beyond pid reuse by its start time.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Proc {
    pub what: String,
    pub pid: i32,
    pub start_ticks: u64,
}

/// Field 22 of /proc/PID/stat: start time in clock ticks since boot.
pub fn start_ticks(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 2..];
    after.split_whitespace().nth(19)?.parse().ok()
}

fn spawn_in(ns: &str, what: &str, program: &str, args: &[String], log: &Path) -> Result<Proc> {
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net={}", netns_path(ns).display()))
        .arg("--")
        .arg(program)
        .args(args);
    // nsenter execs the server in place: the pid is the server's.
    spawn_detached(cmd, what, log)
}

/// Runs a lab server and its child processes (nginx's workers) under `SCHED_RR` priority 1:
/// the real-agent lab's fabric stands for **other machines** (the LAN's gateway and DNS), which
/// a node's restart does not slow. On the lab's two cores they share the CPU with the restarting
/// cilium-agent's clang jobs and the control plane: measured in the real-agent rollout, dnsmasq
/// answered queries that had reached it on time (pcap on both ends of the veth) in batches up to
/// 0.6 s late, and stepguard rightly reported 0.6–2.5 s gaps of a datapath that had none. They
/// use little CPU (a probe every 10 ms at most), and the kernel's RT throttling bounds them.
pub fn realtime(p: &Proc) -> Result<()> {
    let mut pids = vec![p.pid];
    let tasks = format!("/proc/{}/task", p.pid);
    for t in std::fs::read_dir(&tasks)
        .with_context(|| format!("read {tasks}"))?
        .flatten()
    {
        let children = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
        pids.extend(
            children
                .split_whitespace()
                .filter_map(|c| c.parse::<i32>().ok()),
        );
    }
    for pid in pids {
        let param = libc::sched_param { sched_priority: 1 };
        // SAFETY: sched_setscheduler on a pid with a valid parameter struct.
        if unsafe { libc::sched_setscheduler(pid, libc::SCHED_RR, &param) } != 0 {
            bail!(
                "SCHED_RR for {} (pid {pid}): {}",
                p.what,
                std::io::Error::last_os_error()
            );
        }
    }
    Ok(())
}

/// Starts `program args` in the host's namespaces, output to `log`, in a session of its own
/// (see [`spawn_detached`]) but tied to the calling thread: it is killed when that thread ends,
/// so a test killed mid-run leaves no control plane behind. It runs at nice 10.
pub fn spawn_logged(
    what: &str,
    program: &std::ffi::OsStr,
    args: &[String],
    log: &Path,
) -> Result<Proc> {
    let mut cmd = Command::new(program);
    cmd.args(args);
    // SAFETY: prctl and setpriority are async-signal-safe; they set this child's parent-death
    // signal and its niceness. At nice 10 the control plane yields the lab's own servers and
    // agents the CPU on a 2-core machine (DNS answers slowed by a busy apiserver would be a
    // latency verdict about the lab, not the datapath).
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            libc::setpriority(libc::PRIO_PROCESS, 0, 10);
            Ok(())
        });
    }
    spawn_detached(cmd, what, log)
}

/// Starts `cmd` detached (own session, so it outlives `lab up`), output to `log`; records its
/// pid and start time.
fn spawn_detached(mut cmd: Command, what: &str, log: &Path) -> Result<Proc> {
    let out = File::create(log).with_context(|| format!("create {}", log.display()))?;
    let err = out.try_clone()?;
    cmd.stdin(Stdio::null()).stdout(out).stderr(err);
    // SAFETY: setsid is async-signal-safe; detaches the server from our session and terminal.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let child = cmd
        .spawn()
        .with_context(|| format!("start {what}: is it installed? (cargo xtask setup)"))?;
    let pid = child.id() as i32;
    std::thread::sleep(Duration::from_millis(20));
    let start_ticks = start_ticks(pid)
        .with_context(|| format!("{what} exited at once; see {}", log.display()))?;
    Ok(Proc {
        what: what.into(),
        pid,
        start_ticks,
    })
}

pub fn start_dnsmasq(
    ns: &str,
    dir: &Path,
    vip: &str,
    records: &[(String, String)],
) -> Result<Proc> {
    let mut args: Vec<String> = vec![
        "--keep-in-foreground".into(),
        "--conf-file=/dev/null".into(),
        "--no-resolv".into(),
        "--no-hosts".into(),
        "--no-negcache".into(),
        "--bind-interfaces".into(),
        format!("--listen-address={vip}"),
        "--port=53".into(),
        "--cache-size=0".into(),
        "--pid-file=".into(),
        "--log-facility=-".into(),
        "--user=root".into(),
        "--local=/lab.stepguard.test/".into(),
    ];
    for (name, addr) in records {
        args.push(format!("--host-record={name},{addr}"));
    }
    spawn_in(ns, "dnsmasq", "dnsmasq", &args, &dir.join("dnsmasq.log"))
}

/// The gateway's TLS listener (a Gateway VIP on 443): its port and certificate.
pub struct Tls {
    pub port: u16,
    pub cert: std::path::PathBuf,
    pub key: std::path::PathBuf,
}

fn openssl(args: &[&str]) -> Result<()> {
    let out = Command::new("openssl")
        .args(args)
        .output()
        .context("run openssl (Debian package openssl)")?;
    if !out.status.success() {
        bail!(
            "openssl {}: {}",
            args.first().unwrap_or(&""),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// A lab CA and a certificate it signs for `name` (EC P-256, two days): (CA certificate,
/// certificate, key), in `dir`.
pub fn lab_certificate(
    dir: &Path,
    name: &str,
) -> Result<(std::path::PathBuf, std::path::PathBuf, std::path::PathBuf)> {
    let p = |f: &str| dir.join(f).display().to_string();
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let (ca, ca_key) = (p("lab-ca.pem"), p("lab-ca.key"));
    let (csr, key, cert, ext) = (p("tls.csr"), p("tls.key"), p("tls.pem"), p("tls.ext"));
    openssl(
        &[
            &["req", "-x509"][..],
            &ec,
            &[
                "-days",
                "2",
                "-subj",
                "/CN=stepguard lab CA",
                "-keyout",
                &ca_key,
                "-out",
                &ca,
            ],
        ]
        .concat(),
    )?;
    openssl(
        &[
            &["req", "-new"][..],
            &ec,
            &[
                "-subj",
                &format!("/CN={name}"),
                "-keyout",
                &key,
                "-out",
                &csr,
            ],
        ]
        .concat(),
    )?;
    std::fs::write(
        &ext,
        format!("subjectAltName=DNS:{name}\nbasicConstraints=CA:FALSE\n"),
    )?;
    openssl(&[
        "x509",
        "-req",
        "-in",
        &csr,
        "-CA",
        &ca,
        "-CAkey",
        &ca_key,
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        &ext,
        "-out",
        &cert,
    ])?;
    Ok((ca.into(), cert.into(), key.into()))
}

pub fn start_nginx(ns: &str, dir: &Path, vip: &str, port: u16, tls: Option<&Tls>) -> Result<Proc> {
    let tmp = dir.join("nginx-tmp");
    std::fs::create_dir_all(&tmp)?;
    let tls_server = match tls {
        Some(t) => format!(
            r#"    server {{
        listen {vip}:{port} ssl;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        location = /healthz {{ return 200 "ok\n"; }}
        location / {{ return 200 "stepguard lab gateway (tls)\n"; }}
    }}
"#,
            port = t.port,
            cert = t.cert.display(),
            key = t.key.display()
        ),
        None => String::new(),
    };
    let conf = format!(
        r#"daemon off;
master_process on;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/nginx-error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    server {{
        listen {vip}:{port};
        location = /healthz {{ return 200 "ok\n"; }}
        location = /unhealthy {{ return 503 "not ready\n"; }}
        location / {{ return 200 "stepguard lab gateway\n"; }}
    }}
{tls_server}}}
"#,
        dir = dir.display(),
        tmp = tmp.display()
    );
    let conf_path = dir.join("nginx.conf");
    std::fs::write(&conf_path, conf)?;
    let args = vec![
        "-e".into(),
        dir.join("nginx-error.log").display().to_string(),
        "-c".into(),
        conf_path.display().to_string(),
    ];
    spawn_in(ns, "nginx", "nginx", &args, &dir.join("nginx.log"))
}

/// Stops a recorded process if it is still the one we started: SIGTERM, then SIGKILL.
pub fn stop(p: &Proc) {
    if start_ticks(p.pid) != Some(p.start_ticks) {
        return; // gone, or the pid now belongs to someone else
    }
    // SAFETY: plain kill(2) on a pid we verified is ours.
    unsafe { libc::kill(p.pid, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline {
        if start_ticks(p.pid) != Some(p.start_ticks) || is_zombie(p.pid) {
            reap(p.pid);
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    unsafe { libc::kill(p.pid, libc::SIGKILL) };
    reap(p.pid);
}

fn is_zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rfind(')').map(|i| s[i + 2..].starts_with('Z')))
        .unwrap_or(false)
}

fn reap(pid: i32) {
    // Only reaps if it is our child (same process started it); harmless otherwise.
    let mut status = 0;
    unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
}

/// Waits until `check` succeeds, up to `timeout`.
pub fn wait_until(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> Result<()>,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        match check() {
            Ok(()) => return Ok(()),
            Err(e) if Instant::now() >= deadline => {
                bail!("{what} not ready after {timeout:?}: {e:#}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// The lab's stand-in for the cilium-agent API on `cilium.sock` (`GET /v1/debuginfo`): the
/// settings the lab's "agent" loaded at its last start, as `environment-variables`
/// (`key:value`), read from `settings` (JSON object) on every request. Runs as
/// `stepguard-lab agent-api` (the lab binary itself), detached like the other servers.
pub fn start_agent_api(lab_bin: &Path, socket: &Path, settings: &Path, log: &Path) -> Result<Proc> {
    let mut cmd = Command::new(lab_bin);
    cmd.arg("agent-api")
        .arg("--socket")
        .arg(socket)
        .arg("--settings")
        .arg(settings);
    let proc = spawn_detached(cmd, "agent-api", log)?;
    wait_until("the agent API socket", Duration::from_secs(5), || {
        if socket.exists() {
            Ok(())
        } else {
            bail!("{} not there yet", socket.display())
        }
    })?;
    Ok(proc)
}

/// Beside the settings: how many endpoints the lab agent manages (its debuginfo lists them).
pub fn agent_endpoints_file(settings: &Path) -> std::path::PathBuf {
    settings.with_file_name("endpoint-count")
}

/// An endpoint as Cilium's debuginfo lists it (`endpoint-list`: identity, labels, addressing,
/// policy and health per endpoint, a few KB each), so the answer grows with the node as the
/// real one does.
fn endpoint_json(i: usize) -> serde_json::Value {
    let labels: Vec<String> = (0..12)
        .map(|l| format!("k8s:app.kubernetes.io/label-{l}=lab-endpoint-{i}-value-{l}"))
        .collect();
    serde_json::json!({
        "id": i + 1,
        "spec": {"label-configuration": {"user": []}, "options": {"Conntrack": "Enabled", "Debug": "Disabled", "DropNotification": "Enabled", "PolicyAuditMode": "Disabled", "PolicyVerdictNotification": "Enabled", "TraceNotification": "Enabled"}},
        "status": {
            "external-identifiers": {"container-id": format!("{:064x}", i), "k8s-namespace": "lab", "k8s-pod-name": format!("lab-pod-{i}"), "pod-name": format!("lab/lab-pod-{i}")},
            "identity": {"id": 10000 + i, "labels": labels.clone(), "labelsSHA256": format!("{:064x}", i * 7)},
            "labels": {"realized": {"user": []}, "security-relevant": labels.clone(), "derived": labels},
            "networking": {"addressing": [{"ipv4": format!("10.{}.{}.{}", i / 65536 % 256, i / 256 % 256, i % 256)}], "host-mac": "02:00:00:00:00:01", "interface-index": 100 + i, "interface-name": format!("lxc{i:05}"), "mac": "02:00:00:00:00:02"},
            "policy": {"realized": {"allowed-egress-identities": [1, 2, 3], "allowed-ingress-identities": [1, 2, 3], "build": 3, "policy-enabled": "none", "policy-revision": 3}, "spec": {"policy-enabled": "none", "policy-revision": 3}},
            "health": {"bpf": "OK", "connected": true, "overallHealth": "OK", "policy": "OK"},
            "state": "ready",
            "log": (0..6).map(|n| serde_json::json!({"code": "OK", "message": format!("Successfully regenerated endpoint program (Reason: policy rules added) #{n}"), "state": "ready", "timestamp": "2026-01-01T00:00:00Z"})).collect::<Vec<_>>()
        }
    })
}

/// The lab agent's status (`GET /v1/healthz`), as big as the real one: the agent's state and
/// its controllers, five per endpoint as Cilium runs them. It carries no
/// `kube-proxy-replacement` device list: the lab does not imitate Cilium's device selection,
/// so stepguard's checks fall back to the selection rules here (the real agent's answer is
/// followed in the real-agent tests).
fn status_json(endpoints: usize) -> serde_json::Value {
    let controller = |name: String| {
        serde_json::json!({
            "name": name,
            "uuid": format!("{:08x}-0000-4000-8000-{:012x}", name.len(), name.len() * 7919),
            "configuration": {"error-retry": true, "error-retry-base": "2s", "interval": "5m0s"},
            "status": {"consecutive-failure-count": 0, "failure-count": 0, "last-failure-timestamp": "0001-01-01T00:00:00.000Z", "last-success-timestamp": "2026-01-01T00:00:00.000Z", "success-count": 12}
        })
    };
    let mut controllers: Vec<serde_json::Value> = (0..endpoints)
        .flat_map(|i| {
            let id = i + 1;
            [
                format!("endpoint-{id}-regeneration-recovery"),
                format!("resolve-identity-{id}"),
                format!("resolve-labels-lab/lab-pod-{i}"),
                format!("sync-policymap-{id}"),
                format!("sync-to-k8s-ciliumendpoint ({id})"),
            ]
        })
        .map(controller)
        .collect();
    controllers.push(controller("ipcache-inject-labels".into()));
    serde_json::json!({
        "cilium": {"state": "Ok", "msg": "OK"},
        "datapath-mode": "veth",
        "controllers": controllers,
    })
}

/// Beside the settings: the version the lab agent reports (`cilium-version`).
pub fn agent_version_file(settings: &Path) -> std::path::PathBuf {
    settings.with_file_name("cilium-version")
}

/// Serves `GET /v1/debuginfo` and `GET /v1/healthz` on a unix socket until killed (the body
/// of `agent-api`).
pub fn serve_agent_api(socket: &Path, settings: &Path) -> Result<()> {
    use std::io::{Read, Write};
    let _ = std::fs::remove_file(socket);
    let listener = std::os::unix::net::UnixListener::bind(socket)
        .with_context(|| format!("bind {}", socket.display()))?;
    for conn in listener.incoming() {
        let Ok(mut c) = conn else { continue };
        let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
        let mut buf = Vec::new();
        let mut chunk = [0u8; 1024];
        while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 16384 {
            match c.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let req = String::from_utf8_lossy(&buf);
        let (status, body) = if req.starts_with("GET /v1/debuginfo") {
            let values: serde_json::Map<String, serde_json::Value> = std::fs::read(settings)
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .unwrap_or_default();
            let env: Vec<String> = values
                .iter()
                .map(|(k, v)| format!("{k}:{}", v.as_str().unwrap_or_default()))
                .collect();
            let version = std::fs::read_to_string(agent_version_file(settings)).ok();
            let endpoints: usize = std::fs::read_to_string(agent_endpoints_file(settings))
                .ok()
                .and_then(|n| n.trim().parse().ok())
                .unwrap_or(0);
            let list: Vec<serde_json::Value> = (0..endpoints).map(endpoint_json).collect();
            (
                "200 OK",
                serde_json::json!({"cilium-version": version.map(|v| v.trim().to_string()), "environment-variables": env, "endpoint-list": list}).to_string(),
            )
        } else if req.starts_with("GET /v1/healthz") {
            let endpoints: usize = std::fs::read_to_string(agent_endpoints_file(settings))
                .ok()
                .and_then(|n| n.trim().parse().ok())
                .unwrap_or(0);
            ("200 OK", status_json(endpoints).to_string())
        } else {
            ("404 Not Found", "{}".to_string())
        };
        let _ = write!(
            c,
            "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
    }
    Ok(())
}
