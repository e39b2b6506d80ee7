//! The agent's configuration: one YAML file, every field documented in
//! `deploy/stepguard.example.yaml`. Unknown keys, bad addresses and bad durations are errors
//! naming the field; an empty file checks a default Cilium node at `/sys/fs/bpf`.
use crate::duration;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// bpffs root holding Cilium's pins.
    pub bpffs: PathBuf,
    /// A mounted cilium-config ConfigMap directory (optional): what is declared now.
    pub cilium_config: Option<PathBuf>,
    /// The cilium-agent's API socket (`/var/run/cilium/cilium.sock`, optional): what the
    /// running agent loaded, compared with `cilium_config` by the `config` check.
    pub cilium_api: Option<PathBuf>,
    /// `auto`, `1.16` … `1.20` (newer: checked against 1.20).
    pub cilium: String,
    pub devices: DevicesConfig,
    pub maps: MapsConfig,
    pub targets: Vec<Target>,
    pub dns: DnsConfig,
    /// Restarts nobody stepped: verified as implicit steps.
    pub implicit_steps: ImplicitConfig,
    /// Witnesses (`http://HOST:PORT`) every implicit step names (a posted step names its own).
    pub witnesses: Vec<String>,
}

/// `implicit_steps`: the agent verifies a cilium-agent restart nobody stepped (its API socket
/// stops answering, or its programs are replaced) like a posted step.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ImplicitConfig {
    pub enabled: bool,
    #[serde(deserialize_with = "duration::deserialize")]
    pub settle: Duration,
    #[serde(deserialize_with = "duration::deserialize")]
    pub timeout: Duration,
}

impl Default for ImplicitConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            settle: Duration::from_secs(10),
            timeout: Duration::from_secs(300),
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            bpffs: PathBuf::from("/sys/fs/bpf"),
            cilium_config: None,
            cilium_api: None,
            cilium: "auto".into(),
            devices: DevicesConfig::default(),
            maps: MapsConfig::default(),
            targets: vec![],
            dns: DnsConfig::default(),
            implicit_steps: ImplicitConfig::default(),
            witnesses: vec![],
        }
    }
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DevicesConfig {
    /// Expected devices: names or Cilium-style patterns (`eth+`). Empty: the `devices` key of
    /// cilium-config, else Cilium's auto-detection rules.
    pub expected: Vec<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MapsConfig {
    /// Maps required on top of the profile.
    pub required: Vec<String>,
    /// Profile maps that may be missing.
    pub optional: Vec<String>,
    /// Feature overrides when there is no cilium-config: ipv6, snat (KPR/BPF masquerade),
    /// l2_announcements.
    pub ipv6: Option<bool>,
    pub snat: Option<bool>,
    pub l2_announcements: Option<bool>,
}

/// A probed address. The fields here are every kind's; a kind's own (http's `path` and
/// `expect`, dns's `query` and `answers`, https's `server_name` and `ca`, ...) are its
/// `options`, read and checked by the kind (`probe::kind`), unknown ones refused there.
#[derive(Clone, Debug, Deserialize)]
pub struct Target {
    pub name: String,
    pub address: IpAddr,
    #[serde(default)]
    pub port: Option<u16>,
    /// The probe kind (`tcp`, `http`, `https`, `icmp`, `dns`: see `probe::kind::KINDS`).
    pub probe: String,
    #[serde(
        default = "default_timeout",
        deserialize_with = "duration::deserialize"
    )]
    pub timeout: Duration,
    /// Longest acceptable outage during a step (default: the step's `max_gap`).
    #[serde(default, deserialize_with = "duration::deserialize_opt")]
    pub max_gap: Option<Duration>,
    /// Share of probes this target may lose outside its longest outage during a step
    /// (default: the step's `max_loss`, 0.05).
    #[serde(default)]
    pub max_loss: Option<f64>,
    /// All of this target's outages during a step added up (default: the step's
    /// `max_total_gap`, twice `max_gap`).
    #[serde(default, deserialize_with = "duration::deserialize_opt")]
    pub max_total_gap: Option<Duration>,
    /// Source address for the probe (e.g. to leave the node like an outside client would).
    #[serde(default)]
    pub source: Option<IpAddr>,
    /// A finer cadence for this target during a step than the step's `burst_interval` (a
    /// critical target: down to 1ms, for at most 4 targets below 10ms; the gap is then known
    /// to within this cadence).
    #[serde(default, deserialize_with = "duration::deserialize_opt")]
    pub burst_interval: Option<Duration>,
    /// An east-west target: an address on another node (its health endpoint — Cilium's
    /// cilium-health answers HTTP `/hello` on 4240 at an address from that node's pod CIDR,
    /// `CiliumNode.spec.health.ipv4` — or a pod there), reached through this node's datapath
    /// and the overlay or routes to other nodes. A VIP answered by a local backend cannot
    /// see a broken overlay; this can. The `vips` check judges it like any target and
    /// fails it when its route ends on this node (it would not be east-west).
    #[serde(default)]
    pub east_west: bool,
    /// The kind's own fields.
    #[serde(flatten)]
    pub options: BTreeMap<String, serde_yaml_ng::Value>,
}

/// What a DNS answer must be.
#[derive(Clone, Debug, PartialEq)]
pub enum Answers {
    /// During a step: the same address set as just before the step began.
    Baseline,
    /// Every address returned must be one of these (and there is at least one).
    Set(Vec<IpAddr>),
}

impl<'de> Deserialize<'de> for Answers {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Word(String),
            Set(Vec<IpAddr>),
        }
        match Raw::deserialize(d).map_err(|_| {
            serde::de::Error::custom("expected `baseline` or a list of IP addresses")
        })? {
            Raw::Word(w) if w == "baseline" => Ok(Answers::Baseline),
            Raw::Word(w) => Err(serde::de::Error::custom(format!(
                "{w:?}: expected `baseline` or a list of IP addresses"
            ))),
            Raw::Set(v) if v.is_empty() => Err(serde::de::Error::custom(
                "an empty address list would accept nothing: list the addresses or say `baseline`",
            )),
            Raw::Set(v) => Ok(Answers::Set(v)),
        }
    }
}

impl Answers {
    /// The fixed set, when one is configured.
    pub fn set(&self) -> Option<&[IpAddr]> {
        match self {
            Answers::Set(v) => Some(v),
            Answers::Baseline => None,
        }
    }
}

fn default_timeout() -> Duration {
    Duration::from_millis(1000)
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DnsConfig {
    /// Resolvers, `IP` or `IP:PORT`.
    pub resolvers: Vec<String>,
    pub names: Vec<String>,
    /// Record types: A, AAAA (default A).
    pub types: Vec<String>,
    /// Queries per resolver × name × type in one check.
    pub burst: u32,
    #[serde(deserialize_with = "duration::deserialize")]
    pub timeout: Duration,
    /// Lowest acceptable share of successful queries (0..1).
    pub min_success_ratio: f64,
    /// Highest acceptable p99 latency.
    #[serde(deserialize_with = "duration::deserialize")]
    pub max_p99: Duration,
    /// Expected answers per name (see [`Answers`]); names not listed only need an answer.
    pub expect: std::collections::BTreeMap<String, Answers>,
}

impl Default for DnsConfig {
    fn default() -> Self {
        Self {
            resolvers: vec![],
            names: vec![],
            types: vec!["A".into()],
            burst: 5,
            timeout: Duration::from_millis(1000),
            min_success_ratio: 1.0,
            max_p99: Duration::from_millis(250),
            expect: Default::default(),
        }
    }
}

impl DnsConfig {
    pub fn resolver_addrs(&self) -> Result<Vec<SocketAddr>, ConfigError> {
        self.resolvers.iter().map(|r| parse_resolver(r)).collect()
    }
}

pub fn parse_resolver(r: &str) -> Result<SocketAddr, ConfigError> {
    if let Ok(a) = r.parse::<SocketAddr>() {
        return Ok(a);
    }
    r.parse::<IpAddr>()
        .map(|ip| SocketAddr::new(ip, 53))
        .map_err(|_| ConfigError::Field {
            field: "dns.resolvers".into(),
            problem: format!("{r:?} is not an IP or IP:PORT"),
        })
}

/// Probes a second a step may send (the probe budget checked at startup): 5,000 — the
/// four critical targets at 1 ms and 100 more at 10 ms.
pub const MAX_STEP_PROBES_PER_S: f64 = 5_000.0;

/// Targets one agent probes at most.
pub const MAX_TARGETS: usize = 1_000;

/// Targets with a `burst_interval` below this are critical targets; at most [`MAX_CRITICAL`].
pub const CRITICAL_BELOW: Duration = Duration::from_millis(10);
pub const MAX_CRITICAL: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("read config {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("config {path}: {message}")]
    Parse { path: String, message: String },
    #[error("config: {field}: {problem}")]
    Field { field: String, problem: String },
}

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse {
                path: path.display().to_string(),
                message,
            },
            other => other,
        })
    }

    pub fn parse(text: &str) -> Result<Config, ConfigError> {
        let cfg: Config = if text.trim().is_empty() {
            Config::default()
        } else {
            serde_yaml_ng::from_str(text).map_err(|e| ConfigError::Parse {
                path: String::new(),
                message: one_line(&e.to_string()),
            })?
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Probes a second during a step at `burst` (each target's own `burst_interval` where
    /// set), and between steps at `steady`, must fit [`MAX_STEP_PROBES_PER_S`]: 500 targets at
    /// 10 ms cost more than a core. At most [`MAX_TARGETS`] targets (each is a series of
    /// every probe metric).
    pub fn check_probe_budget(&self, burst: Duration, steady: Duration) -> Result<(), ConfigError> {
        if self.targets.len() > MAX_TARGETS {
            return Err(ConfigError::Field {
                field: "targets".into(),
                problem: format!(
                    "{} targets: at most {MAX_TARGETS} (each is probed every {} and is a series of every probe metric)",
                    self.targets.len(),
                    crate::duration::human(steady)
                ),
            });
        }
        let steady_per_s = self.targets.len() as f64 / steady.as_secs_f64().max(1e-3);
        if steady_per_s > MAX_STEP_PROBES_PER_S {
            return Err(ConfigError::Field {
                field: "targets".into(),
                problem: format!(
                    "{} targets make {steady_per_s:.0} probes a second between steps at a {} cadence (at most {MAX_STEP_PROBES_PER_S:.0}): probe fewer targets, or set a coarser --probe-interval",
                    self.targets.len(),
                    crate::duration::human(steady)
                ),
            });
        }
        let per_s: f64 = self
            .targets
            .iter()
            .map(|t| {
                1.0 / t
                    .burst_interval
                    .unwrap_or(burst)
                    .min(burst)
                    .as_secs_f64()
                    .max(1e-3)
            })
            .sum();
        if per_s > MAX_STEP_PROBES_PER_S {
            return Err(ConfigError::Field {
                field: "targets".into(),
                problem: format!(
                    "{} targets make {per_s:.0} probes a second during a step at a {} cadence (at most {MAX_STEP_PROBES_PER_S:.0}): probe fewer targets, or set a coarser --burst-interval",
                    self.targets.len(),
                    crate::duration::human(burst)
                ),
            });
        }
        Ok(())
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let field = |f: &str, p: String| {
            Err(ConfigError::Field {
                field: f.into(),
                problem: p,
            })
        };
        if self.cilium != "auto"
            && crate::cilium::profile::CiliumVersion::parse(&self.cilium).is_none()
            && !crate::cilium::profile::CiliumVersion::newer_than_newest(&self.cilium)
        {
            return field(
                "cilium",
                format!(
                    "{:?} is not auto, 1.16, 1.17, 1.18, 1.19, 1.20 (or newer: checked against 1.20)",
                    self.cilium
                ),
            );
        }
        if self.implicit_steps.settle < Duration::from_millis(100) {
            return field(
                "implicit_steps.settle",
                "must be at least 100ms (a green-for window shorter than one decision passes on a single look)".into(),
            );
        }
        if self.implicit_steps.settle >= self.implicit_steps.timeout {
            return field(
                "implicit_steps.settle",
                "must be shorter than implicit_steps.timeout".into(),
            );
        }
        if self.witnesses.len() > crate::limits::MAX_WITNESSES {
            return field(
                "witnesses",
                format!("at most {}", crate::limits::MAX_WITNESSES),
            );
        }
        for (i, w) in self.witnesses.iter().enumerate() {
            if let Err(e) = crate::wire::AgentUrl::parse(w) {
                return field(&format!("witnesses[{i}]"), format!("{e:#}"));
            }
        }
        let mut names = std::collections::BTreeSet::new();
        let critical = self
            .targets
            .iter()
            .filter(|t| t.burst_interval.is_some_and(|b| b < CRITICAL_BELOW))
            .count();
        if critical > MAX_CRITICAL {
            return field(
                "targets",
                format!(
                    "{critical} targets have a burst_interval below {}: at most {MAX_CRITICAL} may",
                    crate::duration::human(CRITICAL_BELOW)
                ),
            );
        }
        for (i, t) in self.targets.iter().enumerate() {
            let f = format!("targets[{i}]");
            if let Some(l) = t.max_loss {
                if !(l.is_finite() && (0.0..=1.0).contains(&l)) {
                    return field(
                        &format!("{f}.max_loss"),
                        format!("{l} is not a share of probes between 0 and 1 (e.g. 0.02 for 2 %)"),
                    );
                }
            }
            if let Some(b) = t.burst_interval {
                if b < Duration::from_millis(1) {
                    return field(
                        &format!("{f}.burst_interval"),
                        format!("{}: the finest cadence is 1ms", crate::duration::human(b)),
                    );
                }
                // Probes in flight are bounded per target: a cadence needing more would be
                // throttled during an outage (a hole in the evidence, not a finer gap).
                if b * crate::limits::MAX_IN_FLIGHT as u32 <= t.timeout {
                    return field(
                        &format!("{f}.burst_interval"),
                        format!(
                            "{} with a {} timeout needs more than {} probes in flight; shorten the timeout",
                            crate::duration::human(b),
                            crate::duration::human(t.timeout),
                            crate::limits::MAX_IN_FLIGHT
                        ),
                    );
                }
            }
            if t.name.is_empty()
                || !t
                    .name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
            {
                return field(
                    &format!("{f}.name"),
                    format!("{:?}: use letters, digits, '-', '_' or '.'", t.name),
                );
            }
            if !names.insert(t.name.clone()) {
                return field(&format!("{f}.name"), format!("{:?} is used twice", t.name));
            }
            if t.port == Some(0) {
                return field(&format!("{f}.port"), "0 is not a port".into());
            }
            if t.timeout < Duration::from_millis(1) || t.timeout > Duration::from_secs(30) {
                return field(
                    &format!("{f}.timeout"),
                    "must be between 1ms and 30s".into(),
                );
            }
            if let Some(src) = t.source {
                if src.is_ipv4() != t.address.is_ipv4() {
                    return field(
                        &format!("{f}.source"),
                        format!("{src} is not of the address family of {}", t.address),
                    );
                }
            }
        }
        self.dns.resolver_addrs()?;
        if !(0.0..=1.0).contains(&self.dns.min_success_ratio) {
            return field("dns.min_success_ratio", "must be between 0 and 1".into());
        }
        for name in self.dns.expect.keys() {
            if !self.dns.names.contains(name) {
                return field(&format!("dns.expect.{name}"), "not one of dns.names".into());
            }
        }
        if self.dns.burst == 0 || self.dns.burst > 1000 {
            return field("dns.burst", "must be between 1 and 1000".into());
        }
        for t in &self.dns.types {
            if !matches!(t.as_str(), "A" | "AAAA") {
                return field(
                    "dns.types",
                    format!("{t:?}: supported types are A and AAAA"),
                );
            }
        }
        if self.dns.timeout < Duration::from_millis(1) || self.dns.timeout > Duration::from_secs(30)
        {
            return field("dns.timeout", "must be between 1ms and 30s".into());
        }
        Ok(())
    }

    /// Paths that exist must be of the right type; a path that does not exist yet (a node
    /// where Cilium has not started) is fine: those checks stay `unknown` until it appears.
    pub fn check_paths(&self) -> Result<(), ConfigError> {
        for (f, p) in [
            ("bpffs", Some(&self.bpffs)),
            ("cilium_config", self.cilium_config.as_ref()),
        ] {
            let Some(p) = p else { continue };
            if let Ok(m) = std::fs::metadata(p) {
                if !m.is_dir() {
                    return Err(ConfigError::Field {
                        field: f.into(),
                        problem: format!("{} exists but is not a directory", p.display()),
                    });
                }
            }
        }
        Ok(())
    }
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_config_checks_a_default_cilium_node() {
        let c = Config::parse("").unwrap();
        assert_eq!(c.bpffs, PathBuf::from("/sys/fs/bpf"));
        assert_eq!(c.cilium, "auto");
        assert!(c.targets.is_empty());
    }

    #[test]
    fn a_full_config_parses() {
        let c = Config::parse(
            "bpffs: /run/x\ncilium: \"1.18\"\ntargets:\n  - {name: gw, address: 198.51.100.10, probe: http, path: /healthz, expect: 200, timeout: 500ms, max_gap: 2s}\n  - {name: dns, address: 198.51.100.53, probe: dns, query: a.test}\ndns:\n  resolvers: [198.51.100.53, \"127.0.0.1:5353\"]\n  names: [a.test]\n  max_p99: 100ms\n",
        )
        .unwrap();
        assert_eq!(c.targets[0].max_gap, Some(Duration::from_secs(2)));
        assert_eq!(c.targets[1].options["query"], "a.test");
        assert_eq!(c.dns.resolver_addrs().unwrap()[1].port(), 5353);
    }

    #[test]
    fn errors_name_the_field_and_fit_on_one_line() {
        for (text, needle) in [
            ("bogus: 1\n", "unknown field `bogus`"),
            ("targets:\n  - {name: gw, address: 300.1.1.1, probe: tcp, port: 80}\n", "targets"),
            ("targets:\n  - {name: gw, address: 192.0.2.1, probe: tcp, port: 80, timeout: soon}\n", "invalid duration"),
            ("dns:\n  resolvers: [not-an-ip]\n", "dns.resolvers"),
            ("cilium: \"1.2\"\n", "cilium"),
            ("dns:\n  min_success_ratio: 2\n", "dns.min_success_ratio"),
        ] {
            let e = Config::parse(text).unwrap_err().to_string();
            assert!(e.contains(needle), "{text:?} -> {e}");
            assert_eq!(e.lines().count(), 1, "{e}");
        }
    }
}
