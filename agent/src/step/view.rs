//! The step as the API answers it: one typed response, serialized by the agent, parsed by
//! `stepguard wait` and the stepper, and rendered for people in one place ([`StepView::text`]).
use super::{Baseline, Phase, Step, StepCheck, StepParams, TargetGap, Verdict};
pub use crate::wire::ProbeCount;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What the reload looked like.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ReloadView {
    /// Device → (new program id, first seen at).
    pub changed: BTreeMap<String, (u32, f64)>,
    pub lost: Vec<String>,
    pub complete_at: Option<f64>,
}

/// The endpoints' regeneration (`GET /v1/steps/{id}`: `endpoints`).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct EndpointsView {
    /// `followed`, `not_followed` (a step begun by an older agent) or `unknown`.
    pub state: String,
    /// Endpoints carrying `cil_from_container` at the baseline.
    pub followed: usize,
    pub regenerated: usize,
    /// Deleted since the baseline (not failures).
    pub deleted: usize,
    /// Neither regenerated nor deleted: the first few, and how many.
    pub pending: Vec<String>,
    pub pending_count: usize,
    /// Endpoint devices at the baseline not followed (no `cil_from_container` yet, or
    /// read mid-replacement).
    #[serde(default)]
    pub excluded: usize,
    /// The endpoint that regenerated last, and how long after the host datapath's first new
    /// program (seconds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slowest: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slowest_s: Option<f64>,
}

impl EndpointsView {
    pub fn of(s: &Step) -> EndpointsView {
        let pending = super::verdict::pending_endpoints(s);
        let slowest = super::verdict::slowest_endpoint(s);
        EndpointsView {
            state: match &s.baseline.endpoints_followed {
                super::EndpointsFollowed::Followed => "followed",
                super::EndpointsFollowed::NotFollowed => "not_followed",
                super::EndpointsFollowed::Unknown(_) => "unknown",
            }
            .into(),
            followed: s.baseline.endpoints.len(),
            regenerated: s.endpoints.regenerated.len(),
            deleted: s.endpoints.gone.len(),
            excluded: s.baseline.endpoints_excluded,
            pending_count: pending.len(),
            pending: pending
                .into_iter()
                .take(super::verdict::ENDPOINTS_NAMED)
                .cloned()
                .collect(),
            slowest_s: slowest.as_ref().map(|x| x.1),
            slowest: slowest.map(|x| x.0),
        }
    }
}

/// `GET /v1/steps/{id}`, `POST /v1/steps` and `last_step` in `/v1/verdict`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StepView {
    pub id: String,
    /// `posted` (a stepper began it) or `implicit` (the agent saw a restart nobody stepped).
    #[serde(default)]
    pub origin: super::Origin,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trigger: Option<String>,
    pub phase: Phase,
    pub created_at: f64,
    pub verdict: Option<Verdict>,
    pub params: StepParams,
    #[serde(default)]
    pub checks: BTreeMap<String, StepCheck>,
    #[serde(default)]
    pub gaps: Vec<TargetGap>,
    #[serde(default)]
    pub reload: ReloadView,
    #[serde(default)]
    pub baseline: Baseline,
    #[serde(default)]
    pub drops: BTreeMap<String, u64>,
    pub dns_p50_after_ms: Option<f64>,
    /// The Cilium version after the reload (before: `baseline.cilium`), from the agent's API
    /// or the pinned map names.
    #[serde(default)]
    pub cilium_after: Option<String>,
    /// What decided `cilium_after`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cilium_after_from: Option<String>,
    #[serde(default)]
    pub holes: Vec<(f64, f64)>,
    pub evidence_incomplete: Option<String>,
    /// Why the served step is newer than its record on disk (the state dir cannot be
    /// written); absent when it is on disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_persisted: Option<String>,
    /// Global maps across the step, judged by class (new in this version).
    #[serde(default)]
    pub maps: BTreeMap<String, super::MapEvidence>,
    /// Probes recorded per target so far (new in this version).
    #[serde(default)]
    pub probes: BTreeMap<String, ProbeCount>,
    /// The witnesses' view (LAN clients), by URL: instance, latest report (gaps, the MAC
    /// addresses each VIP was reached at, latency before/after), reachability.
    #[serde(default)]
    pub witnesses: BTreeMap<String, super::WitnessTrack>,
    /// The endpoints' regeneration (new in this version; `baseline.endpoints` is left out).
    #[serde(default)]
    pub endpoints: EndpointsView,
}

impl StepView {
    pub fn of(s: &Step) -> StepView {
        StepView {
            id: s.id.clone(),
            origin: s.origin,
            trigger: s.trigger.clone(),
            phase: s.phase,
            created_at: s.created_at,
            verdict: s.verdict.clone(),
            params: s.params.clone(),
            checks: s.checks.clone(),
            gaps: s.gaps.clone(),
            reload: ReloadView {
                changed: s.reload.changed.clone(),
                lost: s.reload.lost.clone(),
                complete_at: s.reload.complete_at,
            },
            baseline: s.baseline.without_endpoints(),
            endpoints: EndpointsView::of(s),
            drops: s.drops.clone(),
            dns_p50_after_ms: s.dns_p50_after_ms,
            cilium_after: s.cilium_after.clone(),
            cilium_after_from: s.cilium_after_from.clone(),
            holes: s.holes.clone(),
            evidence_incomplete: s.evidence_incomplete.clone(),
            not_persisted: s.not_persisted.clone(),
            maps: s.maps.clone(),
            witnesses: s.witnesses.clone(),
            probes: s
                .targets
                .iter()
                .map(|(k, t)| (k.clone(), t.count()))
                .collect(),
        }
    }

    /// The verdict, the gaps and the step checks, for a person (`wait`, `?format=text`).
    pub fn text(&self) -> String {
        let mut out = format!(
            "step {}: {}",
            self.id,
            self.verdict
                .as_ref()
                .map(|v| v.status.as_str().to_uppercase())
                .unwrap_or_else(|| self.phase.as_str().to_string())
        );
        match &self.verdict {
            Some(v) => {
                if !v.reasons.is_empty() {
                    out.push_str(&format!(
                        " ({})",
                        v.reasons
                            .iter()
                            .map(|r| r.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ));
                }
                out.push_str(&format!("\n  {}\n", v.summary));
            }
            None => {
                out.push('\n');
                // What a pass waits for: the timeout is the only deadline, settle the
                // window everything must then stay green for.
                let waiting: Vec<String> = self
                    .checks
                    .iter()
                    .filter(|(_, c)| c.status != crate::checks::Status::Pass)
                    .map(|(n, c)| format!("{n} ({})", c.reason))
                    .collect();
                let deadline = self.created_at + self.params.timeout.as_secs_f64();
                if waiting.is_empty() {
                    out.push_str(&format!(
                        "  waiting for: {} green (settle), before the timeout at {deadline:.0}\n",
                        crate::duration::human(self.params.settle)
                    ));
                } else {
                    out.push_str(&format!(
                        "  waiting for: {}; then {} green (settle), all before the timeout at {deadline:.0}\n",
                        waiting.join("; "),
                        crate::duration::human(self.params.settle)
                    ));
                }
            }
        }
        if let Some(t) = &self.trigger {
            out.push_str(&format!("  implicit step: {t}\n"));
        }
        if let Some(n) = &self.not_persisted {
            out.push_str(&format!("  NOT PERSISTED: {n}\n"));
        }
        if let Some(before) = &self.baseline.cilium {
            let after = self.cilium_after.as_deref().unwrap_or("not yet seen");
            let declared = self
                .params
                .expect_cilium
                .as_deref()
                .map(|v| format!(", declared {v}"))
                .unwrap_or_default();
            let from = |f: &Option<String>| match f.as_deref() {
                Some(f) if f.starts_with("agent API") => "agent API",
                _ => "pinned maps",
            };
            out.push_str(&format!(
                "  cilium: {before} ({}) -> {after} ({}){declared}\n",
                from(&self.baseline.cilium_from),
                from(&self.cilium_after_from)
            ));
        }
        if !self.gaps.is_empty() {
            out.push_str(&format!(
                "  {:<14} {:<6} {:>14} {:>10} {:>8} {:>10}",
                "TARGET", "PROBE", "LONGEST GAP", "TOTAL", "OUTAGES", "BUDGET"
            ));
            let witnesses: Vec<(&String, &super::WitnessTrack)> = self.witnesses.iter().collect();
            for (k, _) in witnesses.iter().enumerate() {
                out.push_str(&format!(" {:>16}", format!("WITNESS {}", k + 1)));
            }
            out.push('\n');
            for g in &self.gaps {
                out.push_str(&format!(
                    "  {:<14} {:<6} {:>14} {:>10} {:>8} {:>10}",
                    g.target,
                    if g.east_west {
                        format!("{}/ew", g.kind)
                    } else {
                        g.kind.clone()
                    },
                    format!("{:.0}±{:.0}ms", g.longest_s * 1e3, g.error_bound_s * 1e3),
                    format!("{:.0}ms", g.total_s * 1e3),
                    g.count,
                    format!("{:.0}ms", g.budget_s * 1e3)
                ));
                for (_, w) in &witnesses {
                    let cell = w
                        .report
                        .as_ref()
                        .and_then(|r| r.gaps.iter().find(|x| x.target == g.target))
                        .map(|x| format!("{:.0}±{:.0}ms", x.longest_s * 1e3, x.error_bound_s * 1e3))
                        .unwrap_or_else(|| "-".into());
                    out.push_str(&format!(" {cell:>16}"));
                }
                out.push('\n');
            }
            let held: Vec<String> = self
                .gaps
                .iter()
                .filter_map(|g| g.longest_held_s.map(|h| (g, h)))
                .map(|(g, h)| format!("{} {:.0}ms", g.target, h * 1e3))
                .collect();
            if !held.is_empty() {
                out.push_str(&format!(
                    "  (answers that ended an outage were held: {}; queued while a neighbour entry resolved, or slow: the outage ends when they were released, and its bound reaches back to the last failed probe)\n",
                    held.join(", ")
                ));
            }
            if self.gaps.iter().any(|g| g.east_west) {
                out.push_str("  (PROBE x/ew: an east-west target, another node reached through the overlay or the routes to other nodes)\n");
            }
            if !witnesses.is_empty() {
                out.push_str("  (LONGEST GAP is the node's own view: with kube-proxy replacement its probes never cross the wire and cannot see an L2-announcement lease move; WITNESS columns are LAN clients)\n");
            }
            for (k, (url, w)) in witnesses.iter().enumerate() {
                let state = match (&w.lost, &w.report, &w.last_error) {
                    (Some(l), _, _) => format!("LOST: {l}"),
                    (None, None, Some(e)) => format!("no report yet: {e}"),
                    (None, None, None) => "no report yet".into(),
                    (None, Some(_), Some(e)) => format!("last poll failed: {e}"),
                    (None, Some(_), None) => "reporting".into(),
                };
                out.push_str(&format!("  witness {} = {url} ({state})\n", k + 1));
                if let Some(r) = &w.report {
                    for (target, macs) in &r.macs {
                        if macs.len() > 1 {
                            out.push_str(&format!(
                                "    {target}: answered by {}\n",
                                macs.iter()
                                    .map(|m| format!(
                                        "{} from +{:.3}s",
                                        m.mac.as_deref().unwrap_or("nobody"),
                                        m.at - self.created_at
                                    ))
                                    .collect::<Vec<_>>()
                                    .join(", then ")
                            ));
                        }
                    }
                    for (target, l) in &r.latency_ms {
                        if let (Some(b), Some(a)) = (l.before_p50_ms, l.after_p50_ms) {
                            out.push_str(&format!(
                                "    {target}: p50 {b:.1}ms before, {a:.1}ms after; p99 {:.1}ms before, {:.1}ms after\n",
                                l.before_p99_ms.unwrap_or(f64::NAN),
                                l.after_p99_ms.unwrap_or(f64::NAN)
                            ));
                        }
                    }
                }
            }
        }
        for (k, c) in &self.checks {
            out.push_str(&format!("  {k:<9} {:<7} {}\n", c.status.as_str(), c.reason));
        }
        if !self.drops.is_empty() {
            out.push_str(&format!(
                "  drops in the step window: {}\n",
                self.drops
                    .iter()
                    .map(|(k, n)| format!("{k}={n}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            ));
        }
        out
    }
}
