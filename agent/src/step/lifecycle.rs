//! A step's life as pure transitions: installed, fed probe samples and witness answers,
//! observed and decided, cancelled, resumed or abandoned after an agent restart. Nothing here
//! reads a clock, a file or the kernel: the daemon's runner takes the readings, passes the
//! time in, and carries out the [`Next`] action an observation returns (persist, export,
//! end the witnesses).
use super::verdict::{self, Observed};
use super::{Baseline, Phase, Reason, Status, Step, Verdict};
use crate::checks::CheckResult;
use std::collections::{BTreeMap, BTreeSet};

/// One probe result for the step's timeline.
#[derive(Clone, Debug)]
pub struct Sample {
    pub target: String,
    /// The gap arithmetic's evidence (its round trip judged against the target's usual).
    pub sample: super::gaps::Sample,
    /// False: the probe could not even be sent (no socket, no permission); `detail` says why.
    pub ran: bool,
    pub detail: String,
}

/// Why a witness poll brought no report.
#[derive(Debug, Clone)]
pub enum WitnessPollError {
    /// The witness does not know the step (it restarted): its evidence is gone.
    Unknown(String),
    /// Unreachable or a bad answer: try again.
    Failed(String),
}

/// What the runner read of the node, kept between observations (devices every 200 ms,
/// maps every second).
#[derive(Clone, Debug, Default)]
pub struct Readings {
    /// Program id per tracked key ([`Step::tracked_keys`]); None when devices were unreadable.
    pub programs: Option<BTreeMap<String, Option<u32>>>,
    pub maps: Option<BTreeMap<String, Option<u64>>>,
    pub map_ids: Option<BTreeMap<String, u32>>,
    pub endpoint_maps: Option<BTreeMap<String, u64>>,
    /// The agent API's version at the last node refresh, and when.
    pub agent_version: Option<(String, f64)>,
    /// Named entries of kept maps that lost some since the baseline
    /// ([`Step::kept_maps_shrunk`]).
    pub map_entries: BTreeMap<String, Vec<String>>,
    /// The endpoints' programs at the last device observation (taken by the next decision).
    pub endpoints: Option<BTreeMap<String, super::EndpointPrograms>>,
    /// The overlay the configuration asks for, and when it was read.
    pub overlay: Option<(crate::cilium::devices::OverlayIntent, f64)>,
    /// The services the agent holds, read after kept service maps were seen to shrink
    /// (None: not read, or the agent could not be asked).
    pub services: Option<crate::ciliumapi::AgentServices>,
    /// The maps the node's features require now (the `maps` check's `required`), when known.
    pub required_maps: Option<std::collections::BTreeSet<String>>,
    /// What the configuration asks of endpoints and host hooks (None: not known).
    pub asks: Option<crate::cilium::devices::Asks>,
}

/// What an observation reads only at its own moment.
pub struct Moment<'a> {
    pub now: f64,
    /// Every node check as last known.
    pub node_checks: &'a [CheckResult],
    /// Drop counters by reason now (None: unknown).
    pub kernel_drops: Option<&'a BTreeMap<String, u64>>,
    pub cilium_drops: Option<&'a BTreeMap<String, u64>>,
    /// Every probe sent before this has answered or timed out and been recorded.
    pub complete_until: f64,
}

/// What the runner does after an observation (kube-rs's reconcile: the decision returns
/// the action, the caller performs it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Still watching: persist on the runner's cadence.
    Watch,
    /// Decided now: persist, export the verdict, end the witnesses.
    Finished,
}

impl Step {
    /// The step is installed at `now`: probes count from here (the baseline took its time
    /// before), so the stall scan starts here.
    pub fn installed(&mut self, now: f64) {
        for t in self.targets.values_mut() {
            t.scanned_through = Some(now);
        }
    }

    /// Folds one probe result into the timeline (probes sent before the step are not its).
    pub fn take_sample(&mut self, x: Sample) {
        if self.is_final() || x.sample.sent < self.created_at {
            return;
        }
        if let Some(t) = self.targets.get_mut(&x.target) {
            if !x.ran {
                t.not_sent(&x.detail);
                return;
            }
            t.record(x.sample);
        }
    }

    /// Folds a witness's answer into the step. A witness that restarted (another instance)
    /// or forgot the step has lost its evidence of the window; one that could not be asked
    /// is asked again.
    pub fn witness_answered(
        &mut self,
        url: &str,
        result: Result<crate::wire::WitnessReport, WitnessPollError>,
        now: f64,
    ) {
        if self.is_final() {
            return;
        }
        let Some(t) = self.witnesses.get_mut(url) else {
            return;
        };
        match result {
            Ok(r) if r.instance != t.instance => {
                t.lost.get_or_insert(format!(
                    "restarted during the step (instance {}, was {}): its evidence of the window is gone",
                    r.instance, t.instance
                ));
            }
            Ok(r) => {
                t.report = Some(r);
                t.last_ok_at = Some(now);
                t.last_error = None;
            }
            Err(WitnessPollError::Unknown(e)) => {
                t.lost.get_or_insert(format!(
                    "no longer knows the step ({e}): it restarted, its evidence of the window is gone"
                ));
            }
            Err(WitnessPollError::Failed(e)) => t.last_error = Some(e),
        }
    }

    /// Cancelled by its stepper at `now`; false when it was already decided.
    pub fn cancel(&mut self, now: f64) -> bool {
        if self.is_final() {
            return false;
        }
        self.phase = Phase::Done;
        self.verdict = Some(Verdict {
            status: Status::Cancelled,
            reasons: vec![Reason::Cancelled],
            summary: "cancelled by DELETE".into(),
            finished_at: now,
            warnings: vec![],
        });
        true
    }

    /// An unfinished step found at the agent's start beside a newer unfinished one (`newer`):
    /// its evidence ended where its record did, so it is decided now, incomplete, never left
    /// watching forever.
    pub fn abandon(&mut self, newer: &str, now: f64) {
        self.phase = Phase::Done;
        let why = format!(
            "the agent restarted with this step unfinished and a newer one ({newer}) also unfinished: its record ends at {:.0} (unix), its evidence with it",
            self.updated_at
        );
        self.evidence_incomplete = Some(why.clone());
        self.verdict = Some(Verdict {
            status: Status::Failed,
            reasons: vec![Reason::EvidenceIncomplete],
            summary: why,
            finished_at: now,
            warnings: vec![],
        });
    }

    /// The keys whose programs the step follows: the baseline's devices and any the step
    /// declared it expects after the restart.
    pub fn tracked_keys(&self) -> Vec<String> {
        let mut t: BTreeSet<String> = self.baseline.programs.keys().cloned().collect();
        t.extend(verdict::wanted_devices(self));
        t.into_iter().collect()
    }

    /// Kept maps that lost entries since the baseline, by the counts now: the runner reads
    /// their entries so the loss can be named (small maps only, see `Baseline::map_entries`).
    pub fn kept_maps_shrunk(&self, maps: Option<&BTreeMap<String, Option<u64>>>) -> Vec<String> {
        self.baseline
            .map_entries
            .keys()
            .filter(|m| {
                let before = self.baseline.maps.get(*m).copied().flatten();
                let now = maps.and_then(|l| l.get(*m).copied().flatten());
                matches!((before, now), (Some(b), Some(a)) if a < b)
            })
            .cloned()
            .collect()
    }

    /// The first device observation after a resume: a datapath other than the one last
    /// seen means a reload or an outage happened while the agent was away, unseen.
    /// `since`: when the resumed record was written.
    pub fn judge_resume(&mut self, programs: &BTreeMap<String, Option<u32>>, since: f64, now: f64) {
        let before: BTreeMap<String, Option<u32>> = if self.reload.last_seen.is_empty() {
            self.baseline
                .programs
                .iter()
                .map(|(k, v)| (k.clone(), Some(*v)))
                .collect()
        } else {
            self.reload.last_seen.clone()
        };
        if programs != &before {
            self.evidence_incomplete = Some(format!(
                "the datapath changed after the step's record was last written ({:.1} s before this agent started: the agent was down, or could not write its state dir): the outage was not observed",
                (now - since).max(0.0)
            ));
        }
    }

    /// Observes the node (`r`, `m`) and decides; `dns_p50_since` gives the DNS p50 (ms)
    /// since a time. Returns what the runner does next.
    pub fn observe(
        &mut self,
        r: &mut Readings,
        m: &Moment,
        dns_p50_since: impl Fn(f64) -> Option<f64>,
    ) -> Next {
        let (drops, drops_unknown) = drops_since(
            &self.baseline,
            m.kernel_drops,
            m.cilium_drops,
            r.map_ids.as_ref(),
        );
        self.judge_first_samples_after_a_hole();
        let o = Observed {
            now: m.now,
            programs: r.programs.clone(),
            maps: r.maps.clone(),
            map_ids: r.map_ids.clone(),
            node_not_green: blocking_node_checks(m.node_checks, &self.baseline.node_checks),
            dns_p50_after_ms: self.reload.complete_at.and_then(dns_p50_since),
            drops,
            drops_unknown,
            complete_until: m.complete_until,
            endpoint_maps: r.endpoint_maps.clone(),
            agent_version: r.agent_version.clone(),
            map_entries: r.map_entries.clone(),
            endpoints: r.endpoints.take(),
            overlay: r.overlay.clone(),
            services: r.services.clone(),
            required_maps: r.required_maps.clone(),
            asks: r.asks,
        };
        verdict::decide(self, &o);
        if self.is_final() {
            Next::Finished
        } else {
            Next::Watch
        }
    }

    /// The first sample after a resume (judged once per target): failing at once means an
    /// outage began while the agent was away.
    fn judge_first_samples_after_a_hole(&mut self) {
        if self.holes.is_empty() || self.evidence_incomplete.is_some() {
            return;
        }
        let hole_end = self.holes.last().map(|h| h.1).unwrap_or(0.0);
        let mut incomplete = None;
        for (name, t) in self.targets.iter_mut().filter(|(_, t)| !t.hole_judged) {
            let first = t
                .samples
                .iter()
                .filter(|x| x.sent >= hole_end)
                .min_by(|a, b| a.sent.total_cmp(&b.sent))
                .copied();
            if let Some(super::gaps::Sample { ok, .. }) = first {
                t.hole_judged = true;
                if !ok {
                    incomplete = Some(format!(
                        "{name} was already failing when the agent came back: the outage began unseen"
                    ));
                }
            }
        }
        if incomplete.is_some() {
            self.evidence_incomplete = incomplete;
        }
    }

    /// The step as persisted: this run's samples folded into outages.
    pub fn persistable(&self) -> Step {
        let mut c = self.clone();
        for t in c.targets.values_mut() {
            let mut samples = t.samples.clone();
            samples.sort_by(|a, b| a.sent.total_cmp(&b.sent));
            t.prior = t.outages();
            if let Some(last) = samples.last() {
                t.persisted_through = Some((last.sent, last.ok));
            }
            if let Some(ok) = samples.iter().rev().find(|s| s.ok) {
                t.last_ok = Some(ok.sent);
            }
            t.samples.clear();
        }
        c
    }
}

/// Drops since the step began, by `kernel:<reason>` and `cilium:<reason>`, and the sources
/// unknown now or at the start. `cilium_metrics` recreated (a property change on start: a
/// new id) restarted its counters from zero, so they count from there, not from the baseline.
pub fn drops_since(
    baseline: &Baseline,
    kernel: Option<&BTreeMap<String, u64>>,
    cilium: Option<&BTreeMap<String, u64>>,
    map_ids: Option<&BTreeMap<String, u32>>,
) -> (BTreeMap<String, u64>, Vec<String>) {
    let recreated = match (
        baseline.map_ids.get("cilium_metrics"),
        map_ids.and_then(|i| i.get("cilium_metrics")),
    ) {
        (Some(a), Some(b)) => a != b,
        _ => false,
    };
    let zero = BTreeMap::new();
    let cilium_base = if recreated {
        &zero
    } else {
        &baseline.cilium_drops
    };
    let mut drops = BTreeMap::new();
    for (prefix, now, base) in [
        ("kernel", kernel, &baseline.kernel_drops),
        ("cilium", cilium, cilium_base),
    ] {
        for (r, v) in now.into_iter().flatten() {
            let d0 = base.get(r).copied().unwrap_or(0);
            if *v > d0 {
                drops.insert(format!("{prefix}:{r}"), v - d0);
            }
        }
    }
    let mut unknown = baseline.drops_unknown_at_start.clone();
    for (source, known) in [("kernel", kernel.is_some()), ("cilium", cilium.is_some())] {
        if !known && !unknown.iter().any(|x| x == source) {
            unknown.push(source.to_string());
        }
    }
    (drops, unknown)
}

/// The node checks that keep a step from passing: any that fails, and any that was passing
/// when the step began and is no longer known. A check unknown from the start (not
/// configured: no targets, no cilium-config, no agent API) cannot regress and does not block;
/// before, such a check kept every step of such a node from ever passing.
pub fn blocking_node_checks(
    now: &[CheckResult],
    baseline: &BTreeMap<String, String>,
) -> Vec<String> {
    use crate::checks::Status as CheckStatus;
    now.iter()
        .filter(|r| {
            r.status == CheckStatus::Fail
                || (r.status == CheckStatus::Unknown
                    && baseline.get(r.check).is_some_and(|b| b == "pass"))
        })
        .map(|r| format!("{} {}: {}", r.check, r.status.as_str(), r.reason))
        .collect()
}
