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
}

/// The settings the running agent loaded at its start, by name, and its version.
pub async fn loaded_settings(socket: &Path) -> Result<AgentInfo, ApiError> {
    let path = socket.display().to_string();
    let timeout = Duration::from_secs(2);
    let work = async {
        let stream = tokio::net::UnixStream::connect(socket)
            .await
            .map_err(|source| ApiError::Connect {
                path: path.clone(),
                source,
            })?;
        let http = |e: &dyn std::fmt::Display| ApiError::Http {
            path: path.clone(),
            message: e.to_string(),
        };
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| http(&e))?;
        tokio::spawn(conn);
        let req = hyper::Request::get("/v1/debuginfo")
            .header("host", "localhost")
            .body(Empty::<Bytes>::new())
            .map_err(|e| http(&e))?;
        let resp = sender.send_request(req).await.map_err(|e| http(&e))?;
        let status = resp.status();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| http(&e))?
            .to_bytes();
        if !status.is_success() {
            return Err(ApiError::Answer {
                path: path.clone(),
                message: format!("HTTP {status}"),
            });
        }
        parse_debuginfo(&body).map_err(|message| ApiError::Answer {
            path: path.clone(),
            message,
        })
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
    Ok(AgentInfo { settings, version })
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
            info.version.as_deref().map(crate::profile::release_of),
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
}
