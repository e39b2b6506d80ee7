//! The step protocol's state: a step's parameters, its baseline, what it has observed (reload,
//! probe timelines, holes in the evidence) and its verdict; persisted under the state
//! directory so a restarted agent resumes it. The decision itself is in [`verdict`].
pub mod admission;
pub mod implicit;
pub mod lifecycle;
pub mod observe;
mod params;
pub mod proof;
pub mod verdict;
pub mod view;

use crate::duration;
pub use crate::timeline::{gaps, timelines, Budgets, TargetTimeline, MAX_OUTAGES};
pub use crate::wire::{secs, TargetGap};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

pub use crate::limits::MAX_WITNESSES;
pub use params::*;

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

impl Baseline {
    /// A copy without the endpoints (the API's view shows their progress instead, and a big
    /// node has thousands of them: not copied only to be dropped).
    pub fn without_endpoints(&self) -> Baseline {
        let Baseline {
            programs,
            selected,
            maps,
            dns_p50_ms,
            kernel_drops,
            cilium_drops,
            node_checks,
            map_ids,
            drops_unknown_at_start,
            cilium,
            cilium_from,
            endpoint_maps,
            map_entries,
            endpoints: _,
            endpoints_followed,
            endpoints_excluded,
        } = self;
        Baseline {
            programs: programs.clone(),
            selected: selected.clone(),
            maps: maps.clone(),
            dns_p50_ms: *dns_p50_ms,
            kernel_drops: kernel_drops.clone(),
            cilium_drops: cilium_drops.clone(),
            node_checks: node_checks.clone(),
            map_ids: map_ids.clone(),
            drops_unknown_at_start: drops_unknown_at_start.clone(),
            cilium: cilium.clone(),
            cilium_from: cilium_from.clone(),
            endpoint_maps: endpoint_maps.clone(),
            map_entries: map_entries.clone(),
            endpoints: BTreeMap::new(),
            endpoints_followed: endpoints_followed.clone(),
            endpoints_excluded: *endpoints_excluded,
        }
    }
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
    /// A record from an agent version that did not follow endpoints: not judged.
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
    /// Endpoints whose device lives on under another name (the same ifindex): baseline
    /// name → the name now.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub renamed: BTreeMap<String, String>,
}

/// How a global map fared across the step, by what Cilium does with it (see
/// `profile::MapClass` and docs/cilium-fidelity.md).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct MapEvidence {
    pub class: crate::cilium::profile::MapClass,
    pub before: Option<u64>,
    pub after: Option<u64>,
    /// The map has a new id: recreated (by design on every start, or for a property change).
    pub recreated: bool,
    /// What the step made of it, one line.
    pub judged: String,
    /// Entries gone because the agent deleted what they stood for (a Service deleted in
    /// Kubernetes: the agent no longer lists it), not lost.
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub deleted: u64,
}

fn is_zero_u64(n: &u64) -> bool {
    *n == 0
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
    /// The overlay the restarted agent's configuration asks for: read after the datapath
    /// began to change (an earlier read is the previous agent's). None: not read yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlay_intent: Option<crate::cilium::devices::OverlayIntent>,
    /// The node's configuration was readable at some point of the step (so the restarted
    /// agent's intent is awaited before a pass).
    #[serde(default)]
    pub intent_readable: bool,
    /// The configuration attaches XDP best-effort (a device that refuses it is skipped), as
    /// last read.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub xdp_best_effort: bool,
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

/// Why a step did not pass (docs/reference/checks.md lists each with its rule).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// Cilium's programs on the host devices were not replaced within the timeout.
    DatapathNotReloaded,
    /// Never green for `settle` before the timeout.
    NotSettled,
    /// A target's longest outage over its `max_gap`, or the outages together over
    /// `max_total_gap`.
    GapOverBudget,
    /// The devices carrying Cilium's programs came back other than expected: unlike the
    /// baseline, or unlike `expect.devices` when the step declared them.
    DeviceSetChanged,
    /// A map the returning release must have is not pinned.
    MapMissing,
    /// Kept state came back empty or lost more than half its entries, or a recreated map did
    /// not refill.
    MapEmptied,
    /// The node came back on another Cilium release than `expect.cilium` declared.
    CiliumVersionMismatch,
    /// A target lost more than `max_loss` of its probes outside its longest outage.
    LossOverBudget,
    /// DNS answers slower than `dns_slower_ratio` times the baseline.
    DnsSlower,
    /// An endpoint did not run a new `cil_from_container` within the timeout.
    EndpointsNotRegenerated,
    /// Drops of a reason over its `drops_budget`.
    DropsOverBudget,
    /// A hole in the evidence: the agent was down, the node rebooted, a probe loop stalled,
    /// a witness did not report, or a reading could not be had.
    EvidenceIncomplete,
    /// Ended by `DELETE` before it was decided.
    Cancelled,
    /// Service frontends or backends gone from a kept map: a failure while the cilium-agent
    /// still lists them past the timeout; a warning on a step that passes.
    KeptStateLost,
}

impl Reason {
    /// Every reason.
    pub const ALL: [Reason; 14] = [
        Reason::DatapathNotReloaded,
        Reason::NotSettled,
        Reason::GapOverBudget,
        Reason::DeviceSetChanged,
        Reason::MapMissing,
        Reason::MapEmptied,
        Reason::CiliumVersionMismatch,
        Reason::LossOverBudget,
        Reason::DnsSlower,
        Reason::EndpointsNotRegenerated,
        Reason::DropsOverBudget,
        Reason::EvidenceIncomplete,
        Reason::Cancelled,
        Reason::KeptStateLost,
    ];

    /// Its name in JSON (the same as serde's).
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
            Reason::KeptStateLost => "kept_state_lost",
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
    /// What a person must know even of a pass (`kept_state_lost`: kept state vanished
    /// across the restart within the tolerance); named in the summary too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<Reason>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Step {
    pub id: String,
    pub created_at: f64,
    pub params: StepParams,
    pub phase: Phase,
    pub baseline: std::sync::Arc<Baseline>,
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
    /// A step beginning at `now`, watching for the reload (its `boot_id` is the caller's to
    /// set: the step layer reads no clock).
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
            baseline: baseline.into(),
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
            boot_id: None,
        }
    }

    /// Whether this step could pass within `within_s` seconds from `now`: it has been green
    /// for all but that much of its settle window (or the window is that short). Readings
    /// taken less often than every decision (drop counters, node checks) are taken at every
    /// decision then, so a pass is never decided on readings older than its window's end.
    pub fn pass_near(&self, now: f64, within_s: f64) -> bool {
        let settle = self.params.settle.as_secs_f64();
        settle <= within_s
            || self
                .green_since
                .is_some_and(|g| now - g + within_s >= settle)
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

#[cfg(test)]
mod tests;
