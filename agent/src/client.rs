//! The stepper's side: `stepguard step` and `stepguard wait` talk to an agent over HTTP/1.1
//! (hyper), with the bearer token when given.
use anyhow::{bail, Context, Result};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Bytes;
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use std::time::Duration;

pub struct Agent {
    /// Host to connect to (an IPv6 literal without brackets).
    host: String,
    port: u16,
    /// The Host header: `host:port`, IPv6 literals in brackets.
    authority: String,
    token: Option<String>,
    /// The largest answer read (bytes); a longer one is an error, never read to its end.
    limit: usize,
}

/// The largest answer an agent's API gives a stepper (a step with its samples and evidence is
/// a few MB at most).
pub const ANSWER_CAP: usize = 64 << 20;

impl Agent {
    /// `http://HOST[:PORT]` (default port 9969; https is not supported: the agent serves plain
    /// HTTP on the node). IPv6 literals in brackets: `http://[::1]:9969`.
    pub fn new(url: &str, token: Option<String>) -> Result<Agent> {
        let u = crate::wire::AgentUrl::parse(url)?;
        Ok(Agent {
            host: u.host,
            port: u.port,
            authority: u.authority,
            token,
            limit: ANSWER_CAP,
        })
    }

    /// Reads answers up to `bytes` only (a peer that is not trusted to be small: a witness).
    pub fn limited(mut self, bytes: usize) -> Agent {
        self.limit = bytes;
        self
    }

    /// The URL in one spelling: `http://host:port` (lower-case host, the port always given).
    pub fn url(&self) -> String {
        format!("http://{}", self.authority.to_ascii_lowercase())
    }

    /// One request; returns (status, JSON body or {"text": ...}).
    pub async fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
        timeout: Duration,
    ) -> Result<(u16, Value)> {
        self.call_paced(method, path, body, timeout)
            .await
            .map(|(s, v, _)| (s, v))
    }

    /// [`Agent::call`], with the answer's `Retry-After` (seconds) when it has one.
    pub async fn call_paced(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
        timeout: Duration,
    ) -> Result<(u16, Value, Option<Duration>)> {
        let fut = async {
            let stream = tokio::net::TcpStream::connect((self.host.as_str(), self.port))
                .await
                .with_context(|| format!("connect to the agent at {}", self.authority))?;
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .context("HTTP handshake")?;
            tokio::spawn(conn);
            let mut req = Request::builder()
                .method(method)
                .uri(path)
                .header("host", &self.authority)
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
            let retry_after = resp
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map(|s| Duration::from_secs(s.min(60)));
            let limit = self.limit;
            let bytes = Limited::new(resp.into_body(), limit)
                .collect()
                .await
                .map_err(|e| {
                    if e.is::<http_body_util::LengthLimitError>() {
                        anyhow::anyhow!("the answer is longer than {limit} bytes: not read")
                    } else {
                        anyhow::anyhow!("read response: {e}")
                    }
                })?
                .to_bytes();
            let v = serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| serde_json::json!({"text": String::from_utf8_lossy(&bytes)}));
            Ok::<_, anyhow::Error>((status, v, retry_after))
        };
        tokio::time::timeout(timeout, fut).await.map_err(|_| {
            anyhow::anyhow!(
                "the agent at {} did not answer within {timeout:?}",
                self.authority
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
            // A token is one line without spaces: a second line would make every request
            // carry something nobody can match.
            if t.chars().any(char::is_whitespace) {
                bail!(
                    "token file {} holds more than one word or line: it must hold the token alone",
                    p.display()
                );
            }
            if t.len() < 16 {
                bail!(
                    "token file {} holds a token of {} characters: use at least 16 (e.g. `head -c 32 /dev/urandom | base64`)",
                    p.display(),
                    t.len()
                );
            }
            Ok(Some(t))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Before the fix `http://[::1]` failed ("bad port") and the Host header of an IPv6
    /// agent lost its brackets.
    #[test]
    fn agent_urls_with_ipv6_literals_and_default_ports_parse() {
        for (url, host, port, authority) in [
            ("http://[::1]:9969", "::1", 9969, "[::1]:9969"),
            ("http://[::1]", "::1", 9969, "[::1]:9969"),
            (
                "http://[2001:db8::7]:1234/",
                "2001:db8::7",
                1234,
                "[2001:db8::7]:1234",
            ),
            ("http://192.0.2.1:8080", "192.0.2.1", 8080, "192.0.2.1:8080"),
            ("http://node-a", "node-a", 9969, "node-a:9969"),
        ] {
            let a = Agent::new(url, None).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(
                (a.host.as_str(), a.port, a.authority.as_str()),
                (host, port, authority)
            );
        }
        for (url, why) in [
            ("https://node:9969", "not supported"),
            ("node:9969", "http://"),
            ("http://node:9969/v1/steps", "path"),
            ("http://:9969", "URL"),
            ("http://[::1", "URL"),
        ] {
            let e = Agent::new(url, None)
                .err()
                .unwrap_or_else(|| panic!("{url} accepted"))
                .to_string();
            assert!(e.contains(why), "{url}: {e}");
            assert_eq!(e.lines().count(), 1);
        }
    }
}

/// Paces a waiter's polls: at most [`Pace::PER_SECOND`] requests a second, and not before
/// the agent's `Retry-After` (an agent whose long-poll slots are all held answers at once).
#[derive(Debug, Default)]
pub struct Pace {
    last: Option<std::time::Instant>,
}

impl Pace {
    pub const PER_SECOND: u32 = 2;

    /// Waits until the next request may be sent (`retry_after`: what the last answer asked).
    pub async fn wait(&mut self, retry_after: Option<Duration>) {
        let gap = Duration::from_secs(1) / Self::PER_SECOND;
        if let Some(last) = self.last {
            let due = last + gap.max(retry_after.unwrap_or_default());
            tokio::time::sleep_until(due.into()).await;
        }
        self.last = Some(std::time::Instant::now());
    }
}
