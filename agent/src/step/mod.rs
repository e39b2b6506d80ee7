//! The step protocol's state: a step's parameters, its baseline, what it has observed (reload,
//! probe timelines, holes in the evidence) and its verdict; persisted under the state
//! directory so a restarted agent resumes it. The decision itself is in [`verdict`].
pub mod verdict;
pub mod view;

use crate::duration;
pub use crate::timeline::{gaps, timelines, Budgets, TargetTimeline, MAX_OUTAGES};
pub use crate::wire::{secs, TargetGap};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// `POST /v1/steps` body. Every field optional; unknown fields are rejected.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepRequest {
    pub id: Option<String>,
    pub timeout: Option<String>,
    pub settle: Option<String>,
    pub max_gap: Option<String>,
    /// Budget for a target's loss outside its longest outage (failed / sent), 0 to 1.
    pub max_loss: Option<f64>,
    /// Budget for a target's outages added up (default: twice `max_gap`).
    pub max_total_gap: Option<String>,
    pub burst_interval: Option<String>,
    pub dns_slower_ratio: Option<f64>,
    /// Budget per drop reason for the step window, e.g. {"TC_INGRESS": 1000, "202_host_datapath_not_ready": 500}.
    pub drops_budget: Option<BTreeMap<String, u64>>,
    /// What the node should look like after the restart, when a rollout changes it on purpose.
    pub expect: Option<ExpectRequest>,
    /// Witnesses (`http://HOST:PORT` of `stepguard witness` on the LAN) that burst-probe the
    /// VIPs as LAN clients during the step; their gaps are part of the verdict.
    pub witnesses: Option<Vec<String>>,
}

/// `expect` of a step request: the device set and/or Cilium version after the restart.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpectRequest {
    /// Host devices that must carry the datapath after the restart (exact names).
    pub devices: Option<Vec<String>>,
    /// The Cilium version that must come back (an upgrade step), e.g. "1.18".
    pub cilium: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct StepParams {
    #[serde(with = "secs")]
    pub timeout: Duration,
    #[serde(with = "secs")]
    pub settle: Duration,
    #[serde(with = "secs")]
    pub max_gap: Duration,
    /// Loss budget (failed / sent outside the longest outage), see [`DEFAULT_MAX_LOSS`].
    #[serde(default = "default_max_loss")]
    pub max_loss: f64,
    /// Total outage budget, seconds (None in steps persisted before it existed: not judged).
    #[serde(default)]
    pub max_total_gap: Option<f64>,
    #[serde(with = "secs")]
    pub burst_interval: Duration,
    pub dns_slower_ratio: f64,
    pub drops_budget: BTreeMap<String, u64>,
    /// Declared device set after the restart (None: as before).
    #[serde(default)]
    pub expect_devices: Option<Vec<String>>,
    /// Declared Cilium version after the restart (None: whatever comes back, inferred).
    #[serde(default)]
    pub expect_cilium: Option<String>,
    /// Witness URLs (see [`StepRequest::witnesses`]).
    #[serde(default)]
    pub witnesses: Vec<String>,
}

/// A target may lose this share of its probes outside its longest outage (which `max_gap`
/// judges): 5 % — a node that drops probes at random (a lossy datapath) fails, a clean outage
/// does not count twice, and an outage split in two by one answer at its edge stays within.
pub const DEFAULT_MAX_LOSS: f64 = 0.05;
/// Lost probes outside the longest outage below this count never fail a step (one stray
/// timeout on a busy node is not a lossy datapath).
pub const LOSS_MIN_FAILURES: u64 = 3;

fn default_max_loss() -> f64 {
    DEFAULT_MAX_LOSS
}

/// Validates a loss budget (a share of probes).
pub fn check_loss(field: &'static str, v: f64) -> Result<f64, RequestError> {
    if v.is_finite() && (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(RequestError::new(
            field,
            format!("{v} is not a share of probes between 0 and 1 (e.g. 0.02 for 2 %)"),
        ))
    }
}

/// A step request that cannot be taken (400), naming the field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct RequestError {
    pub field: &'static str,
    pub problem: String,
}

impl RequestError {
    pub fn new(field: &'static str, problem: impl ToString) -> Self {
        RequestError {
            field,
            problem: problem.to_string(),
        }
    }
}

impl StepParams {
    /// The first parameter in which `other` differs (a re-POST of the active id must ask for
    /// the same step).
    pub fn differing_field(&self, other: &StepParams) -> Option<&'static str> {
        [
            ("timeout", self.timeout != other.timeout),
            ("settle", self.settle != other.settle),
            ("max_gap", self.max_gap != other.max_gap),
            ("max_loss", self.max_loss != other.max_loss),
            ("max_total_gap", self.max_total_gap != other.max_total_gap),
            (
                "burst_interval",
                self.burst_interval != other.burst_interval,
            ),
            (
                "dns_slower_ratio",
                self.dns_slower_ratio != other.dns_slower_ratio,
            ),
            ("drops_budget", self.drops_budget != other.drops_budget),
            (
                "expect",
                self.expect_devices != other.expect_devices
                    || self.expect_cilium != other.expect_cilium,
            ),
            ("witnesses", self.witnesses != other.witnesses),
        ]
        .into_iter()
        .find(|(_, d)| *d)
        .map(|(f, _)| f)
    }

    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

    /// Validates a request; errors name the field, on one line.
    /// `target_budgets`: the targets' own `max_gap`s, which the cadence must resolve too.
    pub fn from_request(
        r: &StepRequest,
        default_burst: Duration,
        target_budgets: &[Duration],
    ) -> Result<(Option<String>, StepParams), RequestError> {
        let dur = |field: &'static str,
                   v: &Option<String>,
                   default: Duration,
                   min: Duration,
                   max: Duration|
         -> Result<Duration, RequestError> {
            let d = match v {
                None => default,
                Some(s) => duration::parse(s).map_err(|e| RequestError::new(field, e))?,
            };
            if d < min || d > max {
                return Err(RequestError::new(
                    field,
                    format!(
                        "{} is out of range ({} to {})",
                        duration::human(d),
                        duration::human(min),
                        duration::human(max)
                    ),
                ));
            }
            Ok(d)
        };
        let timeout = dur(
            "timeout",
            &r.timeout,
            Self::DEFAULT_TIMEOUT,
            Duration::from_secs(1),
            Duration::from_secs(6 * 3600),
        )?;
        let settle = dur(
            "settle",
            &r.settle,
            Duration::from_secs(10),
            Duration::ZERO,
            Duration::from_secs(3600),
        )?;
        if settle >= timeout {
            return Err(RequestError::new(
                "settle",
                format!(
                    "{} must be shorter than timeout {}",
                    duration::human(settle),
                    duration::human(timeout)
                ),
            ));
        }
        let max_gap = dur(
            "max_gap",
            &r.max_gap,
            Duration::from_secs(5),
            Duration::from_millis(1),
            Duration::from_secs(3600),
        )?;
        let max_loss = check_loss("max_loss", r.max_loss.unwrap_or(DEFAULT_MAX_LOSS))?;
        let max_total_gap = dur(
            "max_total_gap",
            &r.max_total_gap,
            max_gap * 2,
            Duration::from_millis(1),
            Duration::from_secs(6 * 3600),
        )?;
        let burst_interval = dur(
            "burst_interval",
            &r.burst_interval,
            default_burst,
            Duration::from_millis(1),
            Duration::from_secs(10),
        )?;
        let dns_slower_ratio = r.dns_slower_ratio.unwrap_or(2.0);
        if !(1.0..=100.0).contains(&dns_slower_ratio) {
            return Err(RequestError::new(
                "dns_slower_ratio",
                "must be between 1 and 100",
            ));
        }
        // The cadence must resolve the budget: a gap is known only to within a probe
        // interval, so a cadence coarser than half the budget cannot tell a gap within the
        // budget from one over it (10 s probes against a 1 s budget would "pass" a 3 s outage).
        let smallest = target_budgets
            .iter()
            .copied()
            .fold(max_gap, |a: Duration, b| a.min(b));
        if burst_interval * 2 > smallest {
            return Err(RequestError::new(
                "burst_interval",
                format!(
                    "{} cannot resolve a gap budget of {} (at most half the smallest budget: max_gap or a target's max_gap)",
                    duration::human(burst_interval),
                    duration::human(smallest)
                ),
            ));
        }
        let expect = r.expect.clone().unwrap_or_default();
        let expect_devices = match expect.devices {
            Some(d) if d.is_empty() => {
                return Err(RequestError::new(
                    "expect.devices",
                    "an empty device set would expect no datapath at all",
                ))
            }
            Some(d)
                if d.iter()
                    .any(|x| x.is_empty() || x.len() > 15 || x.contains('/')) =>
            {
                return Err(RequestError::new(
                    "expect.devices",
                    "device names are 1-15 characters without '/'",
                ))
            }
            Some(mut d) => {
                d.sort();
                d.dedup();
                Some(d)
            }
            None => None,
        };
        let expect_cilium = match expect.cilium {
            Some(v) if crate::profile::CiliumVersion::parse(&v).is_none() => {
                return Err(RequestError::new(
                    "expect.cilium",
                    format!("{v:?} is not 1.16, 1.17, 1.18, 1.19 or 1.20"),
                ))
            }
            v => v,
        };
        let mut witnesses = r.witnesses.clone().unwrap_or_default();
        if witnesses.len() > MAX_WITNESSES {
            return Err(RequestError::new(
                "witnesses",
                format!("at most {MAX_WITNESSES} witnesses per step"),
            ));
        }
        // One spelling per witness (`http://host:port`): its metric series and its track.
        for w in witnesses.iter_mut() {
            match crate::wire::AgentUrl::parse(w) {
                Ok(a) => *w = a.canonical(),
                Err(e) => return Err(RequestError::new("witnesses", format!("{e:#}"))),
            }
        }
        witnesses.sort();
        witnesses.dedup();
        if let Some(id) = &r.id {
            if id.is_empty()
                || id.len() > 64
                || !id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
                || id.starts_with('.')
            {
                return Err(RequestError::new(
                    "id",
                    format!("{id:?} must be 1-64 characters of letters, digits, '-', '_' or '.'"),
                ));
            }
        }
        Ok((
            r.id.clone(),
            StepParams {
                timeout,
                settle,
                max_gap,
                max_loss,
                max_total_gap: Some(max_total_gap.as_secs_f64()),
                burst_interval,
                dns_slower_ratio,
                drops_budget: r.drops_budget.clone().unwrap_or_default(),
                expect_devices: expect_devices.clone(),
                expect_cilium: expect_cilium.clone(),
                witnesses,
            },
        ))
    }
}

pub use crate::limits::MAX_WITNESSES;

/// A witness's part in a step, as the agent follows it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct WitnessTrack {
    /// The witness instance that began the step (a restart changes it).
    pub instance: String,
    pub began_at: f64,
    /// Its latest report.
    pub report: Option<crate::wire::WitnessReport>,
    /// When the agent last heard from it.
    pub last_ok_at: Option<f64>,
    /// Why the last poll failed (unreachable), when it did.
    pub last_error: Option<String>,
    /// The witness restarted or forgot the step: its evidence of the window is gone.
    pub lost: Option<String>,
}

/// What the node looked like when the step began.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Baseline {
    /// Program id of `cil_from_netdev` per selected device (plus cilium_host's `cil_to_host`).
    pub programs: BTreeMap<String, u32>,
    /// Selected devices (carrying cil_from_netdev).
    pub selected: Vec<String>,
    /// Entry counts of global maps (None: array or unreadable).
    pub maps: BTreeMap<String, Option<u64>>,
    /// DNS p50 over the last minute, milliseconds.
    pub dns_p50_ms: Option<f64>,
    pub kernel_drops: BTreeMap<String, u64>,
    pub cilium_drops: BTreeMap<String, u64>,
    /// Node check statuses at the start.
    pub node_checks: BTreeMap<String, String>,
    /// Map ids of global maps (a new id after the restart: the map was recreated).
    #[serde(default)]
    pub map_ids: BTreeMap<String, u32>,
    /// Drop counters (`kernel`, `cilium`) that could not be read at the start.
    #[serde(default)]
    pub drops_unknown_at_start: Vec<String>,
    /// The Cilium version at the start: the release the agent's API reported (`1.18`), or
    /// what the pinned maps point to (`1.16/1.17`, `1.18/1.19`, `1.20`; see
    /// `profile::version_label`) when the API did not answer.
    #[serde(default)]
    pub cilium: Option<String>,
    /// What decided `cilium`: `agent API (<its cilium-version>)` or `pinned map names`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cilium_from: Option<String>,
    /// Per-endpoint maps by kind (`policy`, `policy_v2`, `policy_v3`, `calls`, `other`).
    #[serde(default)]
    pub endpoint_maps: BTreeMap<String, u64>,
    /// The entries of small kept-state maps in Cilium's terms (service frontends, endpoint
    /// IPs, backends), so a loss can be named; maps above `profile::NAMED_ENTRIES_MAX`
    /// entries are not listed.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub map_entries: BTreeMap<String, Vec<String>>,
    /// Every endpoint carrying `cil_from_container` at the start, by device (left out of
    /// the API's view, which shows [`view::EndpointsView`]: a node has thousands).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub endpoints: BTreeMap<String, EndpointPrograms>,
    /// Whether the endpoints could be followed (see [`EndpointsFollowed`]).
    #[serde(default)]
    pub endpoints_followed: EndpointsFollowed,
    /// Endpoint devices at the start that are not followed: without `cil_from_container`
    /// (being created) or read while a program was replaced.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub endpoints_excluded: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// Cilium's programs on one endpoint device (Cilium's loader: `cil_from_container` on the
/// device's ingress, or netkit's peer hook; `cil_to_container` on egress or netkit's
/// primary hook only when the endpoint needs it). See docs/cilium-fidelity.md, "Endpoints".
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct EndpointPrograms {
    pub ifindex: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_container: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_container: Option<u32>,
    /// A program was replaced while it was read (a regeneration in progress): not a
    /// consistent snapshot this time.
    #[serde(skip)]
    pub raced: bool,
}

/// Whether a step follows its endpoints' regeneration.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum EndpointsFollowed {
    /// A record from an agent that did not follow endpoints (before issue 25): not judged.
    #[default]
    NotFollowed,
    Followed,
    /// The endpoint programs could not be read at the start (why): the check is unknown.
    Unknown(String),
}

/// How the endpoints fared since the baseline.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct EndpointProgress {
    /// Endpoints with new program ids: device → first seen at (unix seconds).
    #[serde(default)]
    pub regenerated: BTreeMap<String, f64>,
    /// Endpoints deleted since the baseline (or replaced by a new device of the same name):
    /// not failures.
    #[serde(default)]
    pub gone: std::collections::BTreeSet<String>,
    /// Endpoints not regenerated yet: when each was last read, consistently, still running
    /// its baseline programs (the evidence for `endpoints_not_regenerated`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub old_seen_at: BTreeMap<String, f64>,
}

/// How a global map fared across the step, by what Cilium does with it (see
/// `profile::MapClass` and docs/cilium-fidelity.md).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct MapEvidence {
    pub class: crate::profile::MapClass,
    pub before: Option<u64>,
    pub after: Option<u64>,
    /// The map has a new id: recreated (by design on every start, or for a property change).
    pub recreated: bool,
    /// What the step made of it, one line.
    pub judged: String,
}

/// Watching the datapath reload.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Reload {
    /// Device → (new program id, first seen at).
    pub changed: BTreeMap<String, (u32, f64)>,
    /// Devices whose program vanished.
    pub lost: Vec<String>,
    /// Last time any observed id changed.
    pub last_change_at: Option<f64>,
    /// All devices changed and nothing changed for the quiet period.
    pub complete_at: Option<f64>,
    /// Last observation (device → id), to see changes.
    pub last_seen: BTreeMap<String, Option<u32>>,
}

impl Budgets {
    pub fn of(p: &StepParams) -> Budgets {
        Budgets {
            max_gap: p.max_gap,
            max_loss: Some(p.max_loss),
            max_total_gap: p
                .max_total_gap
                .and_then(|s| Duration::try_from_secs_f64(s).ok()),
        }
    }
}

/// Where a step is: waiting for the reload, settling after it, decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Watching,
    Settling,
    Done,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Watching => "watching",
            Phase::Settling => "settling",
            Phase::Done => "done",
        }
    }
}

/// A decided step's status, as DESIGN.md names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Passed,
    Failed,
    Cancelled,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Passed => "passed",
            Status::Failed => "failed",
            Status::Cancelled => "cancelled",
        }
    }
}

/// Why a step did not pass: the reason codes of DESIGN.md (plus `cancelled`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    DatapathNotReloaded,
    NotSettled,
    GapOverBudget,
    DeviceSetChanged,
    MapMissing,
    MapEmptied,
    CiliumVersionMismatch,
    LossOverBudget,
    DnsSlower,
    EndpointsNotRegenerated,
    DropsOverBudget,
    EvidenceIncomplete,
    Cancelled,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::DatapathNotReloaded => "datapath_not_reloaded",
            Reason::NotSettled => "not_settled",
            Reason::GapOverBudget => "gap_over_budget",
            Reason::DeviceSetChanged => "device_set_changed",
            Reason::MapMissing => "map_missing",
            Reason::MapEmptied => "map_emptied",
            Reason::CiliumVersionMismatch => "cilium_version_mismatch",
            Reason::LossOverBudget => "loss_over_budget",
            Reason::DnsSlower => "dns_slower",
            Reason::EndpointsNotRegenerated => "endpoints_not_regenerated",
            Reason::DropsOverBudget => "drops_over_budget",
            Reason::EvidenceIncomplete => "evidence_incomplete",
            Reason::Cancelled => "cancelled",
        }
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A step check as last judged (`reload`, `gaps`, `baseline`, `drops`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct StepCheck {
    pub status: crate::checks::Status,
    pub reason: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Verdict {
    pub status: Status,
    pub reasons: Vec<Reason>,
    pub summary: String,
    pub finished_at: f64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Step {
    pub id: String,
    pub created_at: f64,
    pub params: StepParams,
    pub phase: Phase,
    pub baseline: Baseline,
    pub reload: Reload,
    pub targets: BTreeMap<String, TargetTimeline>,
    /// Periods the agent was not watching (down), unix seconds.
    pub holes: Vec<(f64, f64)>,
    pub evidence_incomplete: Option<String>,
    pub green_since: Option<f64>,
    /// Step checks (reload, gaps, baseline, drops) as last decided.
    pub checks: BTreeMap<String, StepCheck>,
    pub gaps: Vec<TargetGap>,
    /// Drops in the step window, by reason (kernel: `kernel:<REASON>`, Cilium: `cilium:<code>_<name>`).
    pub drops: BTreeMap<String, u64>,
    pub dns_p50_after_ms: Option<f64>,
    /// The Cilium version the pinned maps point to after the reload (the step's `baseline.cilium`
    /// is the one before).
    #[serde(default)]
    pub cilium_after: Option<String>,
    /// What decided `cilium_after` (see `Baseline::cilium_from`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cilium_after_from: Option<String>,
    /// Witnesses named by the step, by URL.
    #[serde(default)]
    pub witnesses: BTreeMap<String, WitnessTrack>,
    /// Global maps across the step, by class (set once the reload is complete).
    #[serde(default)]
    pub maps: BTreeMap<String, MapEvidence>,
    /// The endpoints' regeneration (against `baseline.endpoints`).
    #[serde(default)]
    pub endpoints: EndpointProgress,
    pub verdict: Option<Verdict>,
    pub updated_at: f64,
    /// The boot the step began on (`/proc/sys/kernel/random/boot_id`).
    #[serde(default)]
    pub boot_id: Option<String>,
    /// Who began it: a stepper (`posted`) or the agent itself on a restart it saw (`implicit`).
    #[serde(default)]
    pub origin: Origin,
    /// For an implicit step: what the agent saw, and that the evidence before it is the
    /// steady cadence's.
    #[serde(default)]
    pub trigger: Option<String>,
    /// The last write of this step's record failed (the state dir is full or read-only):
    /// what is served is newer than what is on disk. Never written to disk itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_persisted: Option<String>,
}

/// Who began a step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Origin {
    #[default]
    Posted,
    Implicit,
}

impl Origin {
    pub fn as_str(self) -> &'static str {
        match self {
            Origin::Posted => "posted",
            Origin::Implicit => "implicit",
        }
    }
}

impl Step {
    /// A step beginning at `now`, watching for the reload.
    pub fn new(
        id: String,
        now: f64,
        params: StepParams,
        baseline: Baseline,
        targets: BTreeMap<String, TargetTimeline>,
    ) -> Step {
        Step {
            id,
            created_at: now,
            params,
            phase: Phase::Watching,
            baseline,
            reload: Default::default(),
            targets,
            holes: vec![],
            evidence_incomplete: None,
            green_since: None,
            checks: BTreeMap::new(),
            gaps: vec![],
            drops: BTreeMap::new(),
            dns_p50_after_ms: None,
            cilium_after: None,
            cilium_after_from: None,
            witnesses: BTreeMap::new(),
            origin: Origin::Posted,
            trigger: None,
            not_persisted: None,
            maps: BTreeMap::new(),
            endpoints: EndpointProgress::default(),
            verdict: None,
            updated_at: now,
            boot_id: crate::kernel::clock::boot_id(),
        }
    }

    pub fn is_final(&self) -> bool {
        self.verdict.is_some()
    }

    /// An agent that restarted picks this step up again at `now`, on boot `boot_id`: the
    /// time it was away is a hole in the evidence (judged further on the first observation).
    pub fn resume(&mut self, now: f64, boot_id: Option<&str>) {
        self.holes.push((self.updated_at, now));
        for t in self.targets.values_mut() {
            t.hole_judged = false;
            // Probe send times are not known across the hole: it is judged by the hole rules.
            t.scanned_through = Some(now);
        }
        for (name, t) in &self.targets {
            if matches!(t.persisted_through, Some((_, false))) {
                self.evidence_incomplete = Some(format!(
                    "the agent went down during an outage of {name} and was away {:.1}s",
                    now - self.updated_at
                ));
            }
        }
        // Whatever happened while the agent was away (an outage with no datapath change, drops
        // its new counters cannot see) was not observed: a hole in the step window blocks a
        // pass. The more specific reasons above and below say what was missed.
        if self.evidence_incomplete.is_none() {
            self.evidence_incomplete = Some(format!(
                "the agent was down for {:.1}s during the step: an outage or drops in that window were not observed",
                now - self.updated_at
            ));
        }
        if self.boot_id.is_some() && boot_id != self.boot_id.as_deref() {
            self.evidence_incomplete = Some(
                "the node rebooted during the step (the boot id changed): the restart and its gaps were not observed"
                    .into(),
            );
        }
    }
}

/// Where steps live: `<state_dir>/steps/<id>.json`, and in memory: files are read once at
/// startup (bounded in size; corrupt or oversized ones are quarantined with a log line), so
/// requests never parse files.
pub struct StepStore {
    dir: PathBuf,
    steps: std::sync::Mutex<BTreeMap<String, Step>>,
    /// Steps whose latest record could not be written, with the error (written again by
    /// [`StepStore::retry_unsaved`]).
    unsaved: std::sync::Mutex<BTreeMap<String, String>>,
    /// Writes that failed since start.
    pub write_errors: std::sync::atomic::AtomicU64,
}

/// A step file larger than this is not read (a step's record is bounded far below it).
pub const MAX_STEP_FILE: u64 = 8 << 20;
/// Steps kept (on disk and in memory).
pub const KEEP_STEPS: usize = 100;

impl StepStore {
    pub fn new(state_dir: &Path) -> std::io::Result<Self> {
        let dir = state_dir.join("steps");
        std::fs::create_dir_all(&dir)?;
        let store = Self {
            steps: std::sync::Mutex::new(Self::read_all(&dir)),
            dir,
            unsaved: Default::default(),
            write_errors: Default::default(),
        };
        Ok(store)
    }

    fn quarantine(path: &Path, why: &str) {
        let to = path.with_extension("quarantined");
        match std::fs::rename(path, &to) {
            Ok(()) => {
                tracing::warn!(file = %path.display(), moved_to = %to.display(), "{why}: step file quarantined")
            }
            Err(e) => {
                tracing::warn!(file = %path.display(), error = %e, "{why}; cannot quarantine it")
            }
        }
    }

    fn read_all(dir: &Path) -> BTreeMap<String, Step> {
        let mut steps = BTreeMap::new();
        let Ok(rd) = std::fs::read_dir(dir) else {
            return steps;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') && name.ends_with(".json.tmp") {
                // A write that did not finish (a full disk, a crash): its record is not whole.
                let _ = std::fs::remove_file(e.path());
                continue;
            }
            if !name.ends_with(".json") || name.starts_with('.') {
                continue;
            }
            let path = e.path();
            match e.metadata() {
                Ok(m) if m.len() > MAX_STEP_FILE => {
                    Self::quarantine(
                        &path,
                        &format!("{} bytes is more than a step record", m.len()),
                    );
                    continue;
                }
                Err(_) => continue,
                Ok(_) => {}
            }
            match std::fs::read(&path).map(|d| serde_json::from_slice::<Step>(&d)) {
                Ok(Ok(s)) => {
                    steps.insert(s.id.clone(), s);
                }
                Ok(Err(err)) => Self::quarantine(&path, &format!("not a step record ({err})")),
                Err(err) => {
                    tracing::warn!(file = %path.display(), error = %err, "cannot read a step file")
                }
            }
        }
        steps
    }

    fn mem(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Step>> {
        self.steps.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Saves a step to disk (written to a temporary file, fsynced, renamed, the directory
    /// fsynced) and keeps it in memory. A step already known is updated in memory first, so
    /// its verdict is served even when the disk refuses the write (the step then says it is
    /// not persisted, and the write is tried again); a new step is kept only once it is on
    /// disk.
    pub fn save(&self, s: &Step) -> std::io::Result<()> {
        let mut on_disk = s.clone();
        on_disk.not_persisted = None;
        let known = {
            let mut m = self.mem();
            match m.get_mut(&s.id) {
                Some(k) => {
                    *k = on_disk.clone();
                    true
                }
                None => false,
            }
        };
        match self.write(&on_disk) {
            Ok(()) => {
                self.unsaved_mut().remove(&s.id);
                self.mem().insert(s.id.clone(), on_disk);
                Ok(())
            }
            Err(e) => {
                self.write_errors
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if known {
                    let why = format!("the step's record could not be written: {e}");
                    if let Some(k) = self.mem().get_mut(&s.id) {
                        k.not_persisted = Some(why.clone());
                    }
                    self.unsaved_mut().insert(s.id.clone(), why);
                }
                Err(e)
            }
        }
    }

    fn unsaved_mut(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, String>> {
        self.unsaved.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self, s: &Step) -> std::io::Result<()> {
        use std::io::Write;
        let path = self.dir.join(format!("{}.json", s.id));
        let tmp = self.dir.join(format!(".{}.json.tmp", s.id));
        let r = (|| {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&serde_json::to_vec(s)?)?;
            f.sync_all()?;
            drop(f);
            std::fs::rename(&tmp, &path)?;
            std::fs::File::open(&self.dir)?.sync_all()
        })();
        if r.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        r
    }

    /// Why some step's latest record is not on disk (readiness and the view say so).
    pub fn unsaved(&self) -> Option<String> {
        self.unsaved_mut().values().next().cloned()
    }

    /// Writes again the steps whose last write failed; how many writes failed again.
    pub fn retry_unsaved(&self) -> usize {
        let ids: Vec<String> = self.unsaved_mut().keys().cloned().collect();
        let mut failed = 0;
        for id in ids {
            match self.load(&id) {
                Some(s) => failed += usize::from(self.save(&s).is_err()),
                None => {
                    self.unsaved_mut().remove(&id);
                }
            }
        }
        failed
    }

    pub fn load(&self, id: &str) -> Option<Step> {
        self.mem().get(id).cloned()
    }

    /// All steps, newest first.
    pub fn list(&self) -> Vec<Step> {
        let mut v: Vec<Step> = self.mem().values().cloned().collect();
        v.sort_by(|a: &Step, b: &Step| b.created_at.total_cmp(&a.created_at));
        v
    }

    /// Keeps the newest `keep` steps.
    pub fn prune(&self, keep: usize) {
        for s in self.list().into_iter().skip(keep) {
            self.mem().remove(&s.id);
            let _ = std::fs::remove_file(self.dir.join(format!("{}.json", s.id)));
        }
    }
}

/// A fresh step id: `step-<unix seconds>-<4 hex>`.
pub fn new_id(now: f64) -> String {
    let r = getrandom::u32().unwrap_or_else(|_| std::process::id() ^ now.fract().to_bits() as u32);
    format!("step-{}-{:04x}", now as u64, r as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `burst_interval 10s` with `max_gap 1s` used to pass a 3 s outage as `0±10000ms`: a
    /// cadence that cannot resolve the budget is refused, naming the field.
    #[test]
    fn a_cadence_coarser_than_the_budget_is_refused() {
        let burst = Duration::from_millis(10);
        let req = StepRequest {
            burst_interval: Some("10s".into()),
            max_gap: Some("1s".into()),
            ..Default::default()
        };
        let e = StepParams::from_request(&req, burst, &[]).unwrap_err();
        assert_eq!(e.field, "burst_interval", "{e}");
        // A target's own budget counts too.
        let req = StepRequest {
            burst_interval: Some("100ms".into()),
            ..Default::default()
        };
        assert!(StepParams::from_request(&req, burst, &[]).is_ok());
        let e = StepParams::from_request(&req, burst, &[Duration::from_millis(150)]).unwrap_err();
        assert_eq!(e.field, "burst_interval");
        assert!(StepParams::from_request(&req, burst, &[Duration::from_millis(200)]).is_ok());
    }

    /// Each spelling of one witness is one witness (and one metric series).
    #[test]
    fn witness_urls_are_normalised() {
        let req = StepRequest {
            witnesses: Some(vec![
                "http://W.example:9970".into(),
                "http://w.example:9970/".into(),
            ]),
            ..Default::default()
        };
        let (_, p) = StepParams::from_request(&req, Duration::from_millis(10), &[]).unwrap();
        assert_eq!(p.witnesses, vec!["http://w.example:9970".to_string()]);
        let req = StepRequest {
            witnesses: Some(vec!["http://u1@w.example:9970".into()]),
            ..Default::default()
        };
        let e = StepParams::from_request(&req, Duration::from_millis(10), &[]).unwrap_err();
        assert_eq!(e.field, "witnesses", "{e}");
    }

    #[test]
    fn requests_are_validated_with_the_field_named() {
        let burst = Duration::from_millis(10);
        let (_, p) = StepParams::from_request(&StepRequest::default(), burst, &[]).unwrap();
        assert_eq!(p.timeout, StepParams::DEFAULT_TIMEOUT);
        for (req, field) in [
            (
                StepRequest {
                    timeout: Some("soon".into()),
                    ..Default::default()
                },
                "timeout",
            ),
            (
                StepRequest {
                    timeout: Some("100h".into()),
                    ..Default::default()
                },
                "timeout",
            ),
            (
                StepRequest {
                    settle: Some("20m".into()),
                    timeout: Some("10m".into()),
                    ..Default::default()
                },
                "settle",
            ),
            (
                StepRequest {
                    max_gap: Some("0ms".into()),
                    ..Default::default()
                },
                "max_gap",
            ),
            (
                StepRequest {
                    id: Some("../etc".into()),
                    ..Default::default()
                },
                "id",
            ),
            (
                StepRequest {
                    dns_slower_ratio: Some(0.5),
                    ..Default::default()
                },
                "dns_slower_ratio",
            ),
        ] {
            let e = StepParams::from_request(&req, burst, &[]).unwrap_err();
            assert_eq!(e.field, field, "{e}");
            assert!(e.to_string().starts_with(field), "{e}");
            assert_eq!(e.to_string().lines().count(), 1);
        }
    }

    fn bare(boot: Option<&str>) -> Step {
        let (_, params) =
            StepParams::from_request(&StepRequest::default(), Duration::from_millis(10), &[])
                .unwrap();
        let mut s = Step::new(
            "s".into(),
            0.0,
            params,
            Baseline::default(),
            BTreeMap::new(),
        );
        s.updated_at = 5.0;
        s.boot_id = boot.map(str::to_string);
        s
    }

    /// A step persisted on one boot and resumed on another (the node rebooted with the
    /// agent): CLOCK_BOOTTIME restarted and nothing was watched, so incomplete evidence
    /// (before the fix the boot was not recorded and the step could pass).
    #[test]
    fn a_step_resumed_on_another_boot_is_incomplete_evidence() {
        let mut s = bare(Some("boot-a"));
        s.resume(9.0, Some("boot-a"));
        assert_eq!(s.holes, vec![(5.0, 9.0)]);
        // Any hole in the step window blocks a pass (before, a hole with no datapath change
        // and no outage running at the kill passed: a 3 s outage while the agent was down
        // went unseen).
        assert!(s
            .evidence_incomplete
            .as_deref()
            .unwrap()
            .contains("down for 4.0s"));
        let mut s = bare(Some("boot-a"));
        s.resume(9.0, Some("boot-b"));
        assert!(s.evidence_incomplete.unwrap().contains("rebooted"));
    }

    /// A corrupt step file and a 9 MiB file in the state dir: both set aside with a log
    /// line, neither parsed on a request; good steps still load.
    #[test]
    fn corrupt_and_oversized_step_files_are_quarantined() {
        let root = std::env::temp_dir().join(format!("sg-store-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let store = StepStore::new(&root).unwrap();
        store.save(&bare(None)).unwrap();
        std::fs::write(root.join("steps/broken.json"), b"{not json").unwrap();
        std::fs::write(
            root.join("steps/huge.json"),
            vec![b' '; (MAX_STEP_FILE + 1) as usize],
        )
        .unwrap();
        let store = StepStore::new(&root).unwrap();
        assert_eq!(store.list().len(), 1);
        assert!(store.load("s").is_some());
        assert!(root.join("steps/broken.quarantined").exists());
        assert!(root.join("steps/huge.quarantined").exists());
        assert!(!root.join("steps/broken.json").exists());
        let _ = std::fs::remove_dir_all(&root);
    }
}
