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

/// The settings the running agent loaded at its start, by name.
pub async fn loaded_settings(socket: &Path) -> Result<BTreeMap<String, String>, ApiError> {
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
/// colon).
pub fn parse_debuginfo(body: &[u8]) -> Result<BTreeMap<String, String>, String> {
    let v: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("not JSON ({e})"))?;
    let env = v["environment-variables"]
        .as_array()
        .ok_or("no `environment-variables`")?;
    Ok(env
        .iter()
        .filter_map(|e| e.as_str())
        .filter_map(|e| e.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect())
}

#[cfg(test)]
mod tests {
    #[test]
    fn debuginfo_settings_are_read_by_name() {
        let m = super::parse_debuginfo(
            br#"{"environment-variables": ["devices:eth0 eth1", "config-sources:config-map:kube-system/cilium-config", "odd"]}"#,
        )
        .unwrap();
        assert_eq!(m["devices"], "eth0 eth1");
        assert_eq!(m["config-sources"], "config-map:kube-system/cilium-config");
        assert_eq!(m.len(), 2);
        assert!(super::parse_debuginfo(b"{}").is_err());
    }
}
