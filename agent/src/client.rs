//! The stepper's side: `stepguard step` and `stepguard wait` talk to an agent over HTTP/1.1
//! (hyper), with the bearer token when given.
use anyhow::{bail, Context, Result};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use std::time::Duration;

pub struct Agent {
    host: String,
    port: u16,
    token: Option<String>,
}

impl Agent {
    /// `http://HOST:PORT` (https is not supported: the agent serves plain HTTP on the node).
    pub fn new(url: &str, token: Option<String>) -> Result<Agent> {
        let rest = url
            .strip_prefix("http://")
            .with_context(|| format!("agent URL {url:?} must start with http://"))?;
        let hostport = rest.split('/').next().unwrap_or("");
        let (host, port) = match hostport.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => (
                h.trim_matches(['[', ']']).to_string(),
                p.parse().with_context(|| format!("bad port in {url:?}"))?,
            ),
            _ => (hostport.trim_matches(['[', ']']).to_string(), 9969),
        };
        if host.is_empty() {
            bail!("agent URL {url:?} has no host");
        }
        Ok(Agent { host, port, token })
    }

    /// One request; returns (status, JSON body or {"text": ...}).
    pub async fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
        timeout: Duration,
    ) -> Result<(u16, Value)> {
        let fut = async {
            let stream = tokio::net::TcpStream::connect((self.host.as_str(), self.port))
                .await
                .with_context(|| format!("connect to the agent at {}:{}", self.host, self.port))?;
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .context("HTTP handshake")?;
            tokio::spawn(conn);
            let mut req = Request::builder()
                .method(method)
                .uri(path)
                .header("host", format!("{}:{}", self.host, self.port))
                .header("accept", "application/json");
            if let Some(t) = &self.token {
                req = req.header("authorization", format!("Bearer {t}"));
            }
            let payload = body.map(|b| b.to_string()).unwrap_or_default();
            if !payload.is_empty() {
                req = req.header("content-type", "application/json");
            }
            let resp = sender
                .send_request(req.body(Full::new(Bytes::from(payload)))?)
                .await
                .context("send request")?;
            let status = resp.status().as_u16();
            let bytes = resp
                .into_body()
                .collect()
                .await
                .context("read response")?
                .to_bytes();
            let v = serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| serde_json::json!({"text": String::from_utf8_lossy(&bytes)}));
            Ok::<_, anyhow::Error>((status, v))
        };
        tokio::time::timeout(timeout, fut).await.map_err(|_| {
            anyhow::anyhow!(
                "the agent at {}:{} did not answer within {timeout:?}",
                self.host,
                self.port
            )
        })?
    }
}

pub fn read_token(path: Option<&std::path::Path>) -> Result<Option<String>> {
    match path {
        None => Ok(None),
        Some(p) => {
            let t = std::fs::read_to_string(p)
                .with_context(|| format!("read token file {}", p.display()))?;
            let t = t.trim().to_string();
            if t.is_empty() {
                bail!("token file {} is empty", p.display());
            }
            Ok(Some(t))
        }
    }
}
