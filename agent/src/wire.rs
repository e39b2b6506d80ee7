//! Wire types: what the agent, the witness and the stepper send each other over HTTP (the
//! witness's step request and report, the gap rows and probe counts they carry), and the one
//! spelling of an agent's or a witness's URL. Nothing here knows how a step is decided.
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

/// An agent's (or a witness's) address, as `http://HOST[:PORT]` (default port 9969; https is
/// not supported: the agent serves plain HTTP on the node). IPv6 literals in brackets:
/// `http://[::1]:9969`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentUrl {
    /// Host to connect to (an IPv6 literal without brackets).
    pub host: String,
    pub port: u16,
    /// The Host header: `host:port`, IPv6 literals in brackets.
    pub authority: String,
}

impl AgentUrl {
    pub fn parse(url: &str) -> Result<AgentUrl> {
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
        if uri.authority().is_some_and(|a| a.as_str().contains('@')) {
            bail!("agent URL {url:?} carries user info: give http://HOST:PORT (a token goes in --token-file)");
        }
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
        Ok(AgentUrl {
            host: bare,
            port,
            authority,
        })
    }

    /// The URL in one spelling: `http://host:port` (lower-case host, the port always given).
    pub fn canonical(&self) -> String {
        format!("http://{}", self.authority.to_ascii_lowercase())
    }
}

/// Durations as seconds (f64) on the wire.
pub mod secs {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;
    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let v = f64::deserialize(d)?;
        Duration::try_from_secs_f64(v).map_err(serde::de::Error::custom)
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct TargetGap {
    pub target: String,
    pub kind: String,
    /// An east-west target (see `config::Target::east_west`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub east_west: bool,
    pub longest_s: f64,
    pub error_bound_s: f64,
    pub total_s: f64,
    pub count: usize,
    pub budget_s: f64,
    pub open: bool,
    /// Share of probes lost outside the longest outage (failed / sent).
    #[serde(default)]
    pub loss: f64,
    /// Probes lost outside the longest outage.
    #[serde(default)]
    pub lost_outside_longest: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_budget: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_budget_s: Option<f64>,
    /// The longest outage's edges (unix seconds), for comparison with other clocks: the send
    /// time of its first failed probe, and when the answer that ended it shows the path
    /// working (see `gaps`: a held answer counts when it was released).
    #[serde(default)]
    pub longest_start: Option<f64>,
    #[serde(default)]
    pub longest_end: Option<f64>,
    /// The answer that ended the longest outage was held this long beyond the target's usual
    /// round trip (queued while a neighbour entry resolved, or slow): its end is that answer's
    /// release, and the bound reaches back to the last failed probe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub longest_held_s: Option<f64>,
}

/// Probes of a target recorded in the step.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ProbeCount {
    pub sent: u64,
    pub failed: u64,
    /// Probes that could not even be sent (no socket, no permission).
    #[serde(default)]
    pub not_run: u64,
}

/// `POST /v1/steps` on a witness.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct WitnessStepRequest {
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst_interval: Option<String>,
    /// The step ends by itself after this (default 15m): a node agent that vanished cannot
    /// leave the witness bursting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<String>,
    /// Budget for every target without its own `max_gap` (default 5s, as on the agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_gap: Option<String>,
    /// Begin the evidence at this unix time (at most 10 minutes back) with the continuous
    /// probes: an implicit step on a node begins after the restart it verifies did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<f64>,
}

/// A lease move the witness saw without any step: a VIP's MAC changed.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Move {
    pub target: String,
    pub at: f64,
    pub from: Option<String>,
    pub to: Option<String>,
    /// The outage around the move, from the continuous probes (None: no outage).
    pub gap_s: Option<f64>,
    pub error_bound_s: Option<f64>,
    pub outage_start: Option<f64>,
    pub outage_end: Option<f64>,
}

/// A MAC address the witness's kernel used for a target's address, from `at` on (None: no
/// usable neighbour entry).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct MacChange {
    pub at: f64,
    pub mac: Option<String>,
}

/// Latency quantiles of successful probes, before the step (the minute before it began) and
/// after (from the `after` instant the agent asks for: the end of the reload).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Latency {
    pub before_p50_ms: Option<f64>,
    pub before_p99_ms: Option<f64>,
    pub after_p50_ms: Option<f64>,
    pub after_p99_ms: Option<f64>,
}

/// `GET /v1/steps/{id}` on a witness.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct WitnessReport {
    pub id: String,
    /// Changes whenever the witness restarts: a report from another instance is not the
    /// same evidence.
    pub instance: String,
    pub created_at: f64,
    /// Every probe sent before this has answered or timed out and is in `gaps`.
    pub complete_until: f64,
    pub ended: bool,
    #[serde(with = "secs")]
    pub burst_interval: Duration,
    pub gaps: Vec<TargetGap>,
    pub macs: BTreeMap<String, Vec<MacChange>>,
    pub probes: BTreeMap<String, ProbeCount>,
    pub latency_ms: BTreeMap<String, Latency>,
}

/// `POST /v1/steps` answer on a witness.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct WitnessBegun {
    pub id: String,
    pub instance: String,
    pub created_at: f64,
}
