//! The lab agent's API: what the simulated cilium-agent answers on its `cilium.sock`.
use crate::sys::process::{spawn_detached, wait_until, Proc};
use anyhow::{bail, Context, Result};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

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
