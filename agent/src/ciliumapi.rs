//! What the running cilium-agent loaded, asked over its API socket
//! (`/var/run/cilium/cilium.sock`, on the `cilium-run` hostPath): `GET /v1/debuginfo` answers
//! `environment-variables`, every setting as `key:value` by its ConfigMap/flag name as loaded
//! at the agent's start (docs/cilium-fidelity.md). Read-only: one GET, nothing else.
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

/// The agent's API could not be asked (its loaded settings are unknown).
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("connect {path}: {source}")]
    Connect {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Http { path: String, message: String },
    #[error("{path}: no answer within {ms} ms")]
    Timeout { path: String, ms: u128 },
    #[error("{path}: unexpected answer: {message}")]
    Answer { path: String, message: String },
}

/// What the running agent reports about itself.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AgentInfo {
    /// The settings it loaded at its start, by name.
    pub settings: BTreeMap<String, String>,
    /// Its version as it reports it (`cilium-version`: `1.18.4 6a4b1e4f 2025-… go version …`),
    /// when it does.
    pub version: Option<String>,
    /// When it started (unix seconds): its API socket's modification time (Cilium binds the socket
    /// anew at every start, after building its configuration). None: not known.
    pub started_at: Option<f64>,
}

/// The settings the running agent loaded at its start, by name, and its version.
pub async fn loaded_settings(socket: &Path) -> Result<AgentInfo, ApiError> {
    loaded_settings_within(socket, WAIT).await
}

async fn loaded_settings_within(socket: &Path, timeout: Duration) -> Result<AgentInfo, ApiError> {
    let path = socket.display().to_string();
    let body = get(socket, "/v1/debuginfo", timeout, DEBUGINFO_CAP).await?;
    let mut info = parse_debuginfo(&body).map_err(|message| ApiError::Answer {
        path: path.clone(),
        message,
    })?;
    info.started_at = socket_identity(socket).map(|(_, _, s, ns)| s as f64 + ns as f64 / 1e9);
    Ok(info)
}

/// The largest answers read: debuginfo carries every endpoint, policy and service (a few KB
/// each: megabytes on a big node); the status carries the controllers (one line each).
const DEBUGINFO_CAP: usize = 256 << 20;
const STATUS_CAP: usize = 32 << 20;

/// One `GET` on the agent's API socket, its body read up to `cap` bytes, the whole within
/// `timeout`.
async fn get(socket: &Path, what: &str, timeout: Duration, cap: usize) -> Result<Bytes, ApiError> {
    let path = socket.display().to_string();
    let work = async {
        let stream = tokio::net::UnixStream::connect(socket)
            .await
            .map_err(|source| ApiError::Connect {
                path: path.clone(),
                source,
            })?;
        let http = |e: &dyn std::fmt::Display| ApiError::Http {
            path: path.clone(),
            message: format!("{what}: {e}"),
        };
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| http(&e))?;
        tokio::spawn(conn);
        let req = hyper::Request::get(what)
            .header("host", "localhost")
            .body(Empty::<Bytes>::new())
            .map_err(|e| http(&e))?;
        let resp = sender.send_request(req).await.map_err(|e| http(&e))?;
        let status = resp.status();
        if !status.is_success() {
            return Err(ApiError::Answer {
                path: path.clone(),
                message: format!("{what}: HTTP {status}"),
            });
        }
        let body = http_body_util::Limited::new(resp.into_body(), cap)
            .collect()
            .await
            .map_err(|e| ApiError::Answer {
                path: path.clone(),
                message: format!("{what}: {e} (more than {cap} bytes?)"),
            })?
            .to_bytes();
        Ok(body)
    };
    tokio::time::timeout(timeout, work)
        .await
        .unwrap_or_else(|_| {
            Err(ApiError::Timeout {
                path: path.clone(),
                ms: timeout.as_millis(),
            })
        })
}

/// What the running agent says it selected, from its status (`GET /v1/healthz`): the
/// devices it attached to (`kube-proxy-replacement.deviceList`, filled from the devices
/// table's selected devices whatever the kube-proxy-replacement mode: 1.19.7 and 1.20.2
/// `pkg/status/status_collector.go`), and how it attaches (`attach-mode`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AgentStatus {
    /// None: the status carries no device list (an agent still starting, or one that does
    /// not report it).
    pub devices: Option<Vec<String>>,
    pub attach_mode: Option<String>,
}

/// The running agent's status, read now (it changes: a device plugged in is selected).
pub async fn agent_status(socket: &Path) -> Result<AgentStatus, ApiError> {
    let body = get(socket, "/v1/healthz", WAIT, STATUS_CAP).await?;
    parse_status(&body).map_err(|message| ApiError::Answer {
        path: socket.display().to_string(),
        message,
    })
}

/// How long an answer of [`agent_status_cached`] serves: the status carries every
/// controller (megabytes on a 1,000-endpoint node), the selection it is read for changes
/// only with the node's devices.
pub const STATUS_MAX_AGE: Duration = Duration::from_secs(10);

type StatusEntry = (
    Identity,
    std::path::PathBuf,
    std::time::Instant,
    AgentStatus,
);
static STATUS_CACHE: std::sync::Mutex<Option<StatusEntry>> = std::sync::Mutex::new(None);

/// [`agent_status`], read again when the agent restarted (a new socket) or the last answer
/// is older than [`STATUS_MAX_AGE`]; failures are not remembered.
pub async fn agent_status_cached(socket: &Path) -> Result<AgentStatus, ApiError> {
    let id = socket_identity(socket);
    if let Some(id) = id {
        let c = crate::locks::lock(&STATUS_CACHE);
        if let Some((cid, path, at, s)) = c.as_ref() {
            if *cid == id && path == socket && at.elapsed() < STATUS_MAX_AGE {
                return Ok(s.clone());
            }
        }
    }
    let r = agent_status(socket).await;
    if let (Ok(s), Some(id)) = (&r, id) {
        if socket_identity(socket) == Some(id) {
            *crate::locks::lock(&STATUS_CACHE) = Some((
                id,
                socket.to_path_buf(),
                std::time::Instant::now(),
                s.clone(),
            ));
        }
    }
    r
}

/// The services the running agent holds (`GET /v1/service`): their frontends as the step
/// names a services-map entry (`10.96.0.10:53/UDP`, `[2001:db8::1]:80/TCP`, ` (internal)`
/// for the internal scope) and their backends as it names a backend (`10.0.1.5:80`). What
/// the agent no longer lists it deleted; what it lists must be in the kernel's maps.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AgentServices {
    pub frontends: std::collections::BTreeSet<String>,
    pub backends: std::collections::BTreeSet<String>,
}

impl AgentServices {
    /// Whether a frontend as a services-map entry names it is one the agent holds (a map
    /// entry of protocol `any`, from releases without the protocol in the key, matches any;
    /// the wildcard entry `<ip>:0/any` Cilium adds beside a service's frontends is held while
    /// any frontend at that address is).
    pub fn lists_frontend(&self, entry: &str) -> bool {
        let frontend = entry.split(" backend slot ").next().unwrap_or(entry);
        if self.frontends.contains(frontend) {
            return true;
        }
        if let Some(ip) = frontend.strip_suffix(":0/any") {
            let at = format!("{ip}:");
            return self.frontends.iter().any(|f| f.starts_with(&at));
        }
        match frontend.split_once("/any") {
            Some((addr, scope)) => ["TCP", "UDP", "SCTP"]
                .iter()
                .any(|p| self.frontends.contains(&format!("{addr}/{p}{scope}"))),
            None => false,
        }
    }

    /// Whether a backends-map entry (`backend 7 = 10.0.1.5:80`) is one the agent holds.
    pub fn lists_backend(&self, entry: &str) -> bool {
        entry
            .split_once(" = ")
            .is_some_and(|(_, addr)| self.backends.contains(addr))
    }
}

/// The running agent's services, read now (bounded in size and time).
pub async fn agent_services(socket: &Path) -> Result<AgentServices, ApiError> {
    let body = get(socket, "/v1/service", WAIT, SERVICES_CAP).await?;
    parse_services(&body).map_err(|message| ApiError::Answer {
        path: socket.display().to_string(),
        message,
    })
}

const SERVICES_CAP: usize = 64 << 20;

/// A `/v1/service` answer (1.19.7, 1.20.2 `api/v1/models`: `spec.frontend-address` {ip, port,
/// protocol, scope}, `spec.backend-addresses[]` {ip, port}).
pub fn parse_services(body: &[u8]) -> Result<AgentServices, String> {
    let v: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("/v1/service: not JSON ({e})"))?;
    let list = v.as_array().ok_or("/v1/service: not a list")?;
    let addr = |ip: &str, port: u64| -> Option<String> {
        let ip: std::net::IpAddr = ip.parse().ok()?;
        Some(match ip {
            std::net::IpAddr::V4(a) => format!("{a}:{port}"),
            std::net::IpAddr::V6(a) => format!("[{a}]:{port}"),
        })
    };
    let mut out = AgentServices::default();
    for s in list {
        let spec = &s["spec"];
        let f = &spec["frontend-address"];
        if let Some(a) = addr(
            f["ip"].as_str().unwrap_or(""),
            f["port"].as_u64().unwrap_or(0),
        ) {
            let proto = f["protocol"].as_str().unwrap_or("ANY").to_ascii_uppercase();
            let proto = if proto == "ANY" || proto.is_empty() {
                "any".to_string()
            } else {
                proto
            };
            let scope = if f["scope"].as_str() == Some("internal") {
                " (internal)"
            } else {
                ""
            };
            out.frontends.insert(format!("{a}/{proto}{scope}"));
        }
        for b in spec["backend-addresses"].as_array().into_iter().flatten() {
            if let Some(a) = addr(
                b["ip"].as_str().unwrap_or(""),
                b["port"].as_u64().unwrap_or(0),
            ) {
                out.backends.insert(a);
            }
        }
    }
    Ok(out)
}

/// The parts of a `/v1/healthz` answer read (everything else, the controllers above all, is
/// skipped without being kept).
#[derive(serde::Deserialize)]
struct StatusAnswer {
    #[serde(rename = "kube-proxy-replacement", default)]
    kpr: Option<KprAnswer>,
    #[serde(rename = "attach-mode", default)]
    attach_mode: Option<String>,
}

#[derive(serde::Deserialize)]
struct KprAnswer {
    #[serde(rename = "deviceList", default)]
    device_list: Option<Vec<DeviceAnswer>>,
    #[serde(default)]
    devices: Option<Vec<String>>,
}

#[derive(serde::Deserialize)]
struct DeviceAnswer {
    #[serde(default)]
    name: String,
}

/// A `/v1/healthz` answer's selected devices and attach mode.
pub fn parse_status(body: &[u8]) -> Result<AgentStatus, String> {
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err("/v1/healthz: not a status object".into());
    }
    let a: StatusAnswer = serde_json::from_slice(body)
        .map_err(|e| format!("/v1/healthz: not a status object ({e})"))?;
    let ok = |n: &String| !n.is_empty() && n.len() <= 64;
    let devices = a.kpr.and_then(|k| {
        k.device_list
            .map(|l| l.into_iter().map(|d| d.name).filter(ok).collect())
            .or_else(|| k.devices.map(|l| l.into_iter().filter(ok).collect()))
    });
    let attach_mode = a.attach_mode.filter(|s| !s.is_empty() && s.len() <= 32);
    Ok(AgentStatus {
        devices,
        attach_mode,
    })
}

/// The socket's identity: Cilium binds its API socket anew at every start, so a new inode
/// (or mtime) is a new agent, whose settings are read again.
fn socket_identity(socket: &Path) -> Option<(u64, u64, i64, i64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(socket).ok()?;
    Some((m.dev(), m.ino(), m.mtime(), m.mtime_nsec()))
}

type Identity = (u64, u64, i64, i64);

/// The last answer per socket identity, and a read in flight.
#[derive(Default)]
struct Cache {
    answer: Option<(Identity, std::path::PathBuf, AgentInfo)>,
    reading: Option<(Identity, std::path::PathBuf)>,
}

static CACHE: std::sync::Mutex<Option<Cache>> = std::sync::Mutex::new(None);

/// How long a check waits for the agent's answer; the read itself may take up to
/// [`READ_TIMEOUT`] in the background (debuginfo carries every endpoint, policy and service:
/// seconds on a big node), and the next check finds it.
pub const WAIT: Duration = Duration::from_secs(2);
pub const READ_TIMEOUT: Duration = Duration::from_secs(30);

fn cached(id: Identity, socket: &Path) -> Option<AgentInfo> {
    let c = crate::locks::lock(&CACHE);
    c.as_ref()?
        .answer
        .as_ref()
        .filter(|(cid, path, _)| *cid == id && path == socket)
        .map(|(_, _, info)| info.clone())
}

/// [`loaded_settings`], read once per start of the running agent: the settings are what it
/// loaded at its start, so while its socket is the same one the answer is too. A check waits
/// [`WAIT`] for a read; a slower one goes on in the background (one at a time) and the
/// answer is kept for the next check. Failures are not remembered.
pub async fn loaded_settings_cached(socket: &Path) -> Result<AgentInfo, ApiError> {
    let path = socket.display().to_string();
    let Some(id) = socket_identity(socket) else {
        // No socket file: say why, as an uncached read does.
        return loaded_settings_within(socket, WAIT).await;
    };
    if let Some(info) = cached(id, socket) {
        // Still the same listener, and still listening (a stopped agent leaves its socket
        // file behind): a connect, no request.
        return match tokio::time::timeout(WAIT, tokio::net::UnixStream::connect(socket)).await {
            Ok(Ok(_)) => Ok(info),
            Ok(Err(source)) => Err(ApiError::Connect { path, source }),
            Err(_) => Err(ApiError::Timeout {
                path,
                ms: WAIT.as_millis(),
            }),
        };
    }
    let start = {
        let mut c = crate::locks::lock(&CACHE);
        let c = c.get_or_insert_with(Cache::default);
        let busy = c
            .reading
            .as_ref()
            .is_some_and(|(rid, p)| *rid == id && p == socket);
        if !busy {
            c.reading = Some((id, socket.to_path_buf()));
        }
        !busy
    };
    if start {
        let sock = socket.to_path_buf();
        let read = tokio::spawn(async move {
            let r = loaded_settings_within(&sock, READ_TIMEOUT).await;
            let mut c = crate::locks::lock(&CACHE);
            let c = c.get_or_insert_with(Cache::default);
            c.reading = None;
            // Kept only if the socket is still the one that answered.
            if let Ok(info) = &r {
                if socket_identity(&sock) == Some(id) {
                    c.answer = Some((id, sock.clone(), info.clone()));
                }
            }
            r
        });
        match tokio::time::timeout(WAIT, read).await {
            Ok(Ok(r)) => return r,
            Ok(Err(e)) => {
                return Err(ApiError::Http {
                    path,
                    message: format!("the read task failed: {e}"),
                })
            }
            Err(_) => {}
        }
    } else {
        // Another check started the read: give it the same wait.
        let t0 = std::time::Instant::now();
        while t0.elapsed() < WAIT {
            tokio::time::sleep(Duration::from_millis(50)).await;
            if let Some(info) = cached(id, socket) {
                return Ok(info);
            }
        }
    }
    Err(ApiError::Timeout {
        path,
        ms: WAIT.as_millis(),
    })
}

/// `environment-variables` of a debuginfo answer into a map (`key:value`, split at the first
/// colon), and `cilium-version`.
pub fn parse_debuginfo(body: &[u8]) -> Result<AgentInfo, String> {
    let v: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("not JSON ({e})"))?;
    let env = v["environment-variables"]
        .as_array()
        .ok_or("no `environment-variables`")?;
    let settings = env
        .iter()
        .filter_map(|e| e.as_str())
        .filter_map(|e| e.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let version = v["cilium-version"]
        .as_str()
        .map(|s| s.trim().chars().take(200).collect::<String>())
        .filter(|s| !s.is_empty());
    Ok(AgentInfo {
        settings,
        version,
        started_at: None,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn debuginfo_settings_are_read_by_name() {
        let info = super::parse_debuginfo(
            br#"{"cilium-version": "1.18.4 6a4b1e4f 2025-11-02T10:01:02+00:00 go version go1.24.9 linux/amd64", "environment-variables": ["devices:eth0 eth1", "config-sources:config-map:kube-system/cilium-config", "odd"]}"#,
        )
        .unwrap();
        assert_eq!(
            info.version
                .as_deref()
                .map(crate::cilium::profile::release_of),
            Some(Some("1.18".into()))
        );
        let m = info.settings;
        assert_eq!(m["devices"], "eth0 eth1");
        assert_eq!(m["config-sources"], "config-map:kube-system/cilium-config");
        assert_eq!(m.len(), 2);
        assert!(super::parse_debuginfo(b"{}").is_err());
        let no_version = super::parse_debuginfo(br#"{"environment-variables": []}"#).unwrap();
        assert_eq!(no_version.version, None);
    }

    /// The status as the real 1.20.2 agent answers it (trimmed): the device list whatever
    /// the kube-proxy-replacement mode; odd shapes are an error or no list, never a guess.
    #[test]
    fn the_status_names_the_selected_devices() {
        let s = super::parse_status(
            br#"{"attach-mode":"tcx","kube-proxy-replacement":{"mode":"False","devices":["eth0","eth1","eth2"],"deviceList":[{"name":"eth0","ip":["192.0.2.2"]},{"name":"eth1","ip":["198.51.100.2"]},{"name":"eth2","ip":[]}]}}"#,
        )
        .unwrap();
        assert_eq!(
            s.devices,
            Some(vec!["eth0".into(), "eth1".into(), "eth2".into()])
        );
        assert_eq!(s.attach_mode.as_deref(), Some("tcx"));
        // Only the older list.
        let s = super::parse_status(br#"{"kube-proxy-replacement":{"devices":["eth0"]}}"#).unwrap();
        assert_eq!(s.devices, Some(vec!["eth0".into()]));
        // No list: not reported (an agent still starting).
        let s = super::parse_status(br#"{"cilium":{"state":"Ok"}}"#).unwrap();
        assert_eq!(s.devices, None);
        assert!(super::parse_status(b"[]").is_err());
        assert!(super::parse_status(b"<html>").is_err());
    }

    /// The services as the real agent lists them (trimmed): frontends named as the step names
    /// a services-map entry, backends as it names a backend; an entry of protocol `any`
    /// matches a listed frontend of any protocol.
    #[test]
    fn the_services_name_frontends_as_the_maps_do() {
        let s = super::parse_services(
            br#"[{"spec":{"id":3,"frontend-address":{"ip":"10.96.0.10","port":53,"protocol":"UDP","scope":"external"},"backend-addresses":[{"ip":"10.0.1.5","port":53}]}},
                {"spec":{"id":4,"frontend-address":{"ip":"2001:db8::1","port":80,"protocol":"TCP","scope":"internal"},"backend-addresses":[]}}]"#,
        )
        .unwrap();
        assert!(s.lists_frontend("10.96.0.10:53/UDP"));
        assert!(s.lists_frontend("10.96.0.10:53/UDP backend slot 1"));
        assert!(s.lists_frontend("10.96.0.10:53/any"));
        assert!(
            s.lists_frontend("10.96.0.10:0/any"),
            "the wildcard beside a frontend"
        );
        assert!(!s.lists_frontend("10.96.0.11:0/any"));
        assert!(!s.lists_frontend("10.96.0.10:53/TCP"));
        assert!(s.lists_frontend("[2001:db8::1]:80/TCP (internal)"));
        assert!(!s.lists_frontend("[2001:db8::1]:80/TCP"));
        assert!(s.lists_backend("backend 7 = 10.0.1.5:53"));
        assert!(!s.lists_backend("backend 8 = 10.0.1.6:53"));
        assert!(super::parse_services(b"{}").is_err());
    }
}
