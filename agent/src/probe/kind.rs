//! Probe kinds: each is one file (its options, its request, its judgement) and one line in
//! [`KINDS`]. A target's own fields beyond the common ones (`name`, `address`, `port`,
//! `probe`, `timeout`, budgets, `source`, `burst_interval`, `east_west`) are its kind's
//! options, read by the kind with unknown fields refused. The engine ([`super::engine`])
//! knows transports, not kinds: it connects a stream or a datagram socket, times the probe,
//! and hands the socket to the kind's [`Exchange`]; ICMP echoes have a transport of their own
//! (one shared socket).
use super::contract::Probe;
use crate::config::{Config, ConfigError, Target};
use std::sync::Arc;

/// Every probe kind, in the order `--help` and errors list them.
pub static KINDS: &[&dyn Kind] = &[
    &super::tcp::Tcp,
    &super::http::Http,
    &super::https::Https,
    &super::icmp::Icmp,
    &super::dns::Dns,
];

/// A probe kind.
pub trait Kind: Sync {
    fn name(&self) -> &'static str;
    /// The port when the target gives none; None: the target must give one (tcp), or the
    /// kind has no port ([`Kind::has_port`]).
    fn default_port(&self) -> Option<u16>;
    fn has_port(&self) -> bool {
        true
    }
    /// Reads the target's options and prepares its probes (once per target).
    fn prepare(&self, t: &Target) -> Result<Arc<dyn Probe>, Problem>;
}

/// A target option that cannot be taken: the field (under the target) and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub field: String,
    pub problem: String,
}

impl Problem {
    pub fn new(field: impl Into<String>, problem: impl Into<String>) -> Problem {
        Problem {
            field: field.into(),
            problem: problem.into(),
        }
    }
}

/// The kind named `name`.
pub fn kind(name: &str) -> Option<&'static dyn Kind> {
    KINDS.iter().copied().find(|k| k.name() == name)
}

/// The names of every kind: `tcp, http, https, icmp, dns`.
pub fn names() -> String {
    KINDS
        .iter()
        .map(|k| k.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Reads a kind's options from the target's own fields (unknown ones refused, naming the
/// fields the kind knows).
pub fn options<T: serde::de::DeserializeOwned>(t: &Target) -> Result<T, Problem> {
    let map: serde_yaml_ng::Mapping = t
        .options
        .iter()
        .map(|(k, v)| (serde_yaml_ng::Value::String(k.clone()), v.clone()))
        .collect();
    serde_yaml_ng::from_value(serde_yaml_ng::Value::Mapping(map)).map_err(|e| {
        Problem::new(
            "",
            format!(
                "{} (for a {} probe)",
                e.to_string().lines().next().unwrap_or("invalid option"),
                t.probe
            ),
        )
    })
}

/// The port a target's probes go to (0 for kinds without ports).
pub fn port(t: &Target) -> u16 {
    t.port
        .or_else(|| kind(&t.probe).and_then(|k| k.default_port()))
        .unwrap_or(0)
}

/// Prepares a target's probes, or says which field is wrong.
pub fn prepare(t: &Target) -> Result<Arc<dyn Probe>, Problem> {
    let Some(k) = kind(&t.probe) else {
        return Err(Problem::new(
            "probe",
            format!("{:?} is not a probe kind (one of {})", t.probe, names()),
        ));
    };
    if !k.has_port() && t.port.is_some() {
        return Err(Problem::new(
            "port",
            format!("an {} probe has no port (remove it)", k.name()),
        ));
    }
    if k.has_port() && t.port.is_none() && k.default_port().is_none() {
        return Err(Problem::new(
            "port",
            format!("a {} probe needs a port", k.name()),
        ));
    }
    k.prepare(t)
}

/// Checks every target's kind and options (what [`Config::parse`] cannot: the config layer
/// does not know the kinds).
pub fn validate(cfg: &Config) -> Result<(), ConfigError> {
    for (i, t) in cfg.targets.iter().enumerate() {
        if let Err(p) = prepare(t) {
            let field = if p.field.is_empty() {
                format!("targets[{i}]")
            } else {
                format!("targets[{i}].{}", p.field)
            };
            return Err(ConfigError::Field {
                field,
                problem: p.problem,
            });
        }
    }
    Ok(())
}

/// [`Config::load`] with every target's probe checked.
pub fn load(path: &std::path::Path) -> Result<Config, ConfigError> {
    let c = Config::load(path)?;
    validate(&c)?;
    Ok(c)
}

/// [`Config::parse`] with every target's probe checked.
pub fn parse(text: &str) -> Result<Config, ConfigError> {
    let c = Config::parse(text)?;
    validate(&c)?;
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_checks_its_own_options_naming_the_field() {
        for (target, needle) in [
            ("{name: gw, address: 192.0.2.1, probe: tcp}", "targets[0].port: a tcp probe needs a port"),
            ("{name: gw, address: 192.0.2.1, probe: smoke}", "targets[0].probe: \"smoke\" is not a probe kind (one of tcp, http, https, icmp, dns)"),
            ("{name: gw, address: 192.0.2.1, probe: icmp, port: 7}", "targets[0].port: an icmp probe has no port"),
            ("{name: gw, address: \"2001:db8::1\", probe: icmp, source: 192.0.2.1}", "targets[0].source: 192.0.2.1 is not of the address family of 2001:db8::1"),
            ("{name: gw, address: 192.0.2.1, probe: http, path: healthz}", "targets[0].path: \"healthz\" must start with /"),
            ("{name: gw, address: 192.0.2.1, probe: http, expect: 700}", "targets[0].expect: an HTTP status is 100..599"),
            ("{name: gw, address: 192.0.2.1, probe: tcp, port: 80, answers: baseline}", "targets[0]: unknown field `answers`"),
            ("{name: gw, address: 192.0.2.1, probe: http, max_gapp: 1s}", "unknown field `max_gapp`, expected `path` or `expect` (for a http probe)"),
            ("{name: gw, address: 192.0.2.1, probe: https, ca: /nonexistent/ca.pem}", "targets[0].ca: read /nonexistent/ca.pem"),
            ("{name: gw, address: 192.0.2.1, probe: https, server_name: \"bad name!\"}", "targets[0].server_name"),
            ("{name: gw, address: 192.0.2.1, probe: dns, query: \"a..b\"}", "targets[0].query"),
            ("{name: gw, address: 192.0.2.1, probe: dns, record: MX}", "targets[0].record: \"MX\": expected A or AAAA"),
            ("{name: gw, address: 192.0.2.1, probe: dns, record: AAAA, answers: [192.0.2.9]}", "targets[0].answers: 192.0.2.9 cannot answer a AAAA query"),
        ] {
            let e = parse(&format!("targets:\n  - {target}\n")).unwrap_err().to_string();
            assert!(e.contains(needle), "{target} -> {e}");
            assert_eq!(e.lines().count(), 1, "{e}");
        }
    }

    #[test]
    fn ports_default_by_kind() {
        let c = parse(
            "targets:\n  - {name: a, address: 192.0.2.1, probe: http}\n  - {name: b, address: 192.0.2.1, probe: https}\n  - {name: c, address: 192.0.2.1, probe: dns}\n  - {name: d, address: 192.0.2.1, probe: icmp}\n  - {name: e, address: 192.0.2.1, probe: https, port: 8443}\n",
        )
        .unwrap();
        let ports: Vec<u16> = c.targets.iter().map(port).collect();
        assert_eq!(ports, [80, 443, 53, 0, 8443]);
    }
}
