//! The five node checks. Each lives in its own module with one entry point returning a
//! [`CheckResult`]: a status, a machine reason code, a one-line human reason, and the evidence
//! (what was read, from where). A check that could not run is `unknown`, never `pass`.
mod code;
pub mod config;
pub use code::Code;
pub mod devices;
pub mod dns;
pub mod maps;
pub mod vips;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Pass,
    Fail,
    Unknown,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pass => "pass",
            Self::Fail => "fail",
            Self::Unknown => "unknown",
        }
    }
}

/// Node check names: the `check` label, the `--only` values and the JSON keys, in the order
/// of [`REGISTRY`] (a test keeps them the same).
pub const NODE_CHECKS: [&str; 5] = ["devices", "maps", "vips", "dns", "config"];

/// What a node check needs observed before it is decided (read once per run, shared).
#[derive(Clone, Copy, Debug, Default)]
pub struct Needs {
    /// Devices and their programs (rtnetlink, tcx, tc).
    pub links: bool,
    /// Pinned maps with entry counts (bpffs).
    pub maps: bool,
    /// What the running cilium-agent reports it loaded (its API).
    pub agent: bool,
    /// What the running cilium-agent reports it selected now (its status).
    pub status: bool,
}

/// What the node checks of one run share.
pub struct Inputs<'a> {
    pub cfg: &'a crate::config::Config,
    pub cilium:
        Option<Result<&'a crate::ciliumconfig::Snapshot, &'a crate::ciliumconfig::ReadError>>,
    pub store: Option<&'a crate::ciliumconfig::SnapshotStore>,
    /// What the running cilium-agent reports it loaded (its API), when asked.
    pub loaded: Option<Result<&'a crate::ciliumapi::AgentInfo, &'a crate::ciliumapi::ApiError>>,
    /// The effective configuration: the ConfigMap with the per-node overrides the agent
    /// loaded (`config::effective`); what every check reading a config key expects.
    pub effective: Option<&'a crate::ciliumconfig::Snapshot>,
    /// What the running cilium-agent reports it selected now (its status), when asked.
    pub status: Option<Result<&'a crate::ciliumapi::AgentStatus, &'a crate::ciliumapi::ApiError>>,
    pub links:
        Option<&'a Result<crate::kernel::links::Observation, crate::kernel::links::LinkError>>,
    pub maps:
        Option<&'a Result<crate::kernel::bpffs::MapsObservation, crate::kernel::bpffs::BpffsError>>,
}

/// What the agent's continuous probes have seen, for the checks it decides from them
/// rather than by probing again (`vips`, `dns`).
pub struct ProbeWindows<'a> {
    pub cfg: &'a crate::config::Config,
    pub now: f64,
    /// The latest outcome of every target probed so far, by name.
    pub latest: &'a std::collections::BTreeMap<String, crate::probe::ProbeOutcome>,
    /// Where the east-west targets' routes end (looked up with the kernel checks).
    pub east_west: &'a vips::EastWest,
    /// The steady resolver queries of the last minutes, oldest first.
    pub dns: &'a std::collections::VecDeque<dns::DnsSample>,
}

/// A decision in the making (some checks probe).
pub type Evaluating<'a> =
    std::pin::Pin<Box<dyn std::future::Future<Output = CheckResult> + Send + 'a>>;

/// A node check: its name, what it needs, how it is decided, and how its evidence reads for
/// people. Adding a check is one module with its `NODE_CHECK`, plus its line in [`REGISTRY`].
pub struct NodeCheck {
    pub name: &'static str,
    pub needs: Needs,
    /// In the agent, decided from the continuous probe windows instead (not re-run by the
    /// slow loop).
    pub from_probes: Option<fn(&ProbeWindows) -> CheckResult>,
    pub evaluate: for<'a> fn(&'a Inputs<'a>) -> Evaluating<'a>,
    pub render: fn(&CheckResult) -> Vec<String>,
}

/// Every node check, in report order.
pub static REGISTRY: [&NodeCheck; 5] = [
    &devices::NODE_CHECK,
    &maps::NODE_CHECK,
    &vips::NODE_CHECK,
    &dns::NODE_CHECK,
    &config::NODE_CHECK,
];

/// The registered check named `name`.
pub fn registered(name: &str) -> Option<&'static NodeCheck> {
    REGISTRY.iter().copied().find(|c| c.name == name)
}

/// A value as a short string for evidence lines.
pub fn show(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct CheckResult {
    pub check: &'static str,
    pub status: Status,
    /// Stable machine reason code, e.g. `device_missing`.
    pub code: Code,
    /// One line for a human.
    pub reason: String,
    #[serde(serialize_with = "ser_ms")]
    pub duration_ms: Duration,
    pub evidence: Value,
}

fn ser_ms<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64((d.as_secs_f64() * 1e6).round() / 1e3)
}

impl CheckResult {
    pub fn new(
        check: &'static str,
        status: Status,
        code: Code,
        reason: impl Into<String>,
        evidence: Value,
    ) -> Self {
        Self {
            check,
            status,
            code,
            reason: reason.into(),
            duration_ms: Duration::ZERO,
            evidence,
        }
    }
    pub fn pass(
        check: &'static str,
        code: Code,
        reason: impl Into<String>,
        evidence: Value,
    ) -> Self {
        Self::new(check, Status::Pass, code, reason, evidence)
    }
    pub fn fail(
        check: &'static str,
        code: Code,
        reason: impl Into<String>,
        evidence: Value,
    ) -> Self {
        Self::new(check, Status::Fail, code, reason, evidence)
    }
    pub fn unknown(
        check: &'static str,
        code: Code,
        reason: impl Into<String>,
        evidence: Value,
    ) -> Self {
        Self::new(check, Status::Unknown, code, reason, evidence)
    }
}

/// Overall outcome of a set of results: ok when all pass, failed when any fails, not decided
/// when any is unknown (none failed) or none ran.
pub fn exit_code(results: &[CheckResult]) -> crate::exit::ExitCode {
    use crate::exit::ExitCode;
    if results.iter().any(|r| r.status == Status::Fail) {
        ExitCode::Failed
    } else if results.iter().any(|r| r.status == Status::Unknown) || results.is_empty() {
        ExitCode::NotDecided
    } else {
        ExitCode::Ok
    }
}

pub use crate::kernel::io_reason;

/// Evidence as `key: value` lines (checks without a renderer of their own).
pub fn generic_lines(r: &CheckResult) -> Vec<String> {
    r.evidence
        .as_object()
        .map(|o| {
            o.iter()
                .map(|(k, v)| format!("{k}: {}", evidence_value(v)))
                .collect()
        })
        .unwrap_or_default()
}

fn evidence_value(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn exit_codes_follow_the_worst_status() {
        let p = CheckResult::pass("maps", Code::Ok, "", Value::Null);
        let f = CheckResult::fail("maps", Code::NotObserved, "", Value::Null);
        let u = CheckResult::unknown("maps", Code::NotObserved, "", Value::Null);
        assert_eq!(exit_code(&[p.clone(), p.clone()]).code(), 0);
        assert_eq!(exit_code(&[p.clone(), u.clone()]).code(), 2);
        assert_eq!(exit_code(&[u, f, p]).code(), 1);
        assert_eq!(exit_code(&[]).code(), 2, "nothing checked is not a pass");
    }

    #[test]
    fn the_registry_and_the_check_names_agree() {
        let names: Vec<&str> = REGISTRY.iter().map(|c| c.name).collect();
        assert_eq!(names, NODE_CHECKS);
        // Every check renders its own evidence (the text report has no per-check code).
        for c in REGISTRY {
            let r =
                CheckResult::unknown(c.name, Code::NotObserved, "", serde_json::json!({"k": 1}));
            let _ = (c.render)(&r);
        }
    }
}
