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
    /// Host to connect to (an IPv6 literal without brackets).
    host: String,
    port: u16,
    /// The Host header: `host:port`, IPv6 literals in brackets.
    authority: String,
    token: Option<String>,
}

impl Agent {
    /// `http://HOST[:PORT]` (default port 9969; https is not supported: the agent serves plain
    /// HTTP on the node). IPv6 literals in brackets: `http://[::1]:9969`.
    pub fn new(url: &str, token: Option<String>) -> Result<Agent> {
        let uri: hyper::Uri = url
            .parse()
            .with_context(|| format!("agent URL {url:?} is not a URL like http://NODE:9969"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some(other) => bail!(
                "agent URL {url:?}: scheme {other} is not supported (the agent serves plain http://)"
            ),
            None => bail!("agent URL {url:?} must start with http://"),
        }
        let host = uri
            .host()
            .filter(|h| !h.is_empty())
            .with_context(|| format!("agent URL {url:?} has no host"))?;
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            bail!("agent URL {url:?} must not carry a path or query: give http://NODE:PORT");
        }
        let port = uri.port_u16().unwrap_or(9969);
        let bare = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        let authority = if bare.contains(':') {
            format!("[{bare}]:{port}")
        } else {
            format!("{bare}:{port}")
        };
        Ok(Agent {
            host: bare,
            port,
            authority,
            token,
        })
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
