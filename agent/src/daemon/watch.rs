//! The step lifecycle inside the daemon: taking the baseline, watching the reload and the
//! probes, deciding, persisting, and exporting the outcome.
use super::{lock, Daemon};
use crate::checks::{devices, Status};
use crate::kernel::links;
use crate::metrics::ProbeLabels;
use crate::probe::unix_now;
use crate::step::verdict::{self, Observed};
use crate::step::{Baseline, Step, StepParams, TargetTimeline, Verdict};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Program id per baseline device: `cil_from_netdev` on host devices, `cil_to_host` on
/// cilium_host. None when the program is gone.
pub fn current_programs(
    obs: &links::Observation,
    devices: &[String],
) -> BTreeMap<String, Option<u32>> {
    devices
        .iter()
        .map(|dev| {
            let prog = if dev == "cilium_host" {
                "cil_to_host"
            } else {
                "cil_from_netdev"
            };
            let id = obs
                .devices
                .iter()
                .find(|d| &d.name == dev)
                .and_then(|d| {
                    d.programs
                        .iter()
                        .find(|p| p.hook == "ingress" && p.is(prog))
                })
                .map(|p| p.prog_id);
            (dev.clone(), id)
        })
        .collect()
}

fn map_counts(m: &crate::kernel::bpffs::MapsObservation) -> BTreeMap<String, Option<u64>> {
    m.globals
        .iter()
        .map(|(k, v)| (k.clone(), v.entries))
        .collect()
}

/// How long after a probe's timeout its result is surely recorded.
const COMPLETION_SLACK_S: f64 = 0.25;

/// Why a step cannot begin: no baseline can be taken (503).
#[derive(Debug, thiserror::Error)]
pub enum BeginError {
    #[error("cannot take a baseline: {0}")]
    Links(#[from] links::LinkError),
    #[error("cannot take a baseline: {0}")]
    ProgramsUnreadable(String),
    #[error("cannot take a baseline: no device carries cil_from_netdev")]
    NoDatapath,
}

/// Takes the baseline and creates the step.
pub async fn begin(d: &Arc<Daemon>, id: String, params: StepParams) -> Result<Step, BeginError> {
    let now = unix_now();
    let obs = links::observe(&d.cfg.bpffs).await?;
    if obs.prog_details_unreadable {
        return Err(BeginError::ProgramsUnreadable(
            obs.problems.first().cloned().unwrap_or_default(),
        ));
    }
    let selected: Vec<String> = devices::carrying(&obs.devices).into_iter().collect();
    if selected.is_empty() {
        return Err(BeginError::NoDatapath);
    }
    let mut tracked = selected.clone();
    if obs.devices.iter().any(|x| x.name == "cilium_host") {
        tracked.push("cilium_host".into());
    }
    let programs: BTreeMap<String, u32> = current_programs(&obs, &tracked)
        .into_iter()
        .filter_map(|(k, v)| v.map(|v| (k, v)))
        .collect();
    let maps = crate::kernel::bpffs::observe_blocking(&d.cfg.bpffs, true)
        .await
        .map(|m| map_counts(&m))
        .unwrap_or_default();
    let node_checks = d
        .node_results()
        .into_iter()
        .map(|r| (r.check.to_string(), r.status.as_str().to_string()))
        .collect();
    let baseline = Baseline {
        programs,
        selected,
        maps,
        dns_p50_ms: d.dns_p50_since(now - 60.0),
        kernel_drops: d.kernel_drops_now().unwrap_or_default(),
        cilium_drops: d.cilium_drops_now().unwrap_or_default(),
        node_checks,
    };
    let targets = d
        .cfg
        .targets
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                TargetTimeline {
                    kind: t.probe.as_str().into(),
                    budget: t.max_gap.unwrap_or(params.max_gap).as_secs_f64(),
                    ..Default::default()
                },
            )
        })
        .collect();
    Ok(Step::new(id, now, params, baseline, targets))
}

/// The step as persisted: this run's samples folded into outages.
fn persistable(s: &Step) -> Step {
    let mut c = s.clone();
    for t in c.targets.values_mut() {
        let mut samples = t.samples.clone();
        samples.sort_by(|a, b| a.0.total_cmp(&b.0));
        t.prior = t.outages();
        if let Some(last) = samples.last() {
            t.persisted_through = Some(*last);
        }
        if let Some(ok) = samples.iter().rev().find(|s| s.1) {
            t.last_ok = Some(ok.0);
        }
        t.samples.clear();
    }
    c
}

pub fn persist(d: &Daemon, s: &mut Step) {
    s.updated_at = unix_now();
    if let Err(e) = d.store.save(&persistable(s)) {
        tracing::error!(step = %s.id, error = %e, "cannot persist the step");
    }
}

/// Exports a finished step and leaves burst mode.
pub fn finished(d: &Daemon, s: &Step) {
    let Some(v) = &s.verdict else { return };
    let m = lock(&d.metrics);
    m.steps
        .get_or_create(&crate::metrics::VerdictLabels {
            verdict: v.status.as_str().to_string(),
        })
        .inc();
    m.last_step_passed
        .set((v.status == crate::step::Status::Passed) as i64);
    m.last_step_started.set(s.created_at);
    m.last_step_finished.set(v.finished_at);
    m.step_active.set(0);
    for g in &s.gaps {
        let l = ProbeLabels {
            kind: g.kind.clone(),
            target: g.target.clone(),
        };
        m.last_step_gap.get_or_create(&l).set(g.longest_s);
        m.step_gap.observe(g.longest_s);
    }
    drop(m);
    d.burst.store(false, Ordering::SeqCst);
    d.store.prune(100);
    tracing::info!(step = %s.id, verdict = v.status.as_str(), reasons = ?v.reasons, summary = %v.summary, "step decided");
}

pub fn cancel(d: &Daemon, s: &mut Step) {
    if s.is_final() {
        return;
    }
    let now = unix_now();
    s.phase = crate::step::Phase::Done;
    s.verdict = Some(Verdict {
        status: crate::step::Status::Cancelled,
        reasons: vec![crate::step::Reason::Cancelled],
        summary: "cancelled by DELETE".into(),
        finished_at: now,
    });
    persist(d, s);
    finished(d, s);
}

/// Watches the active step: device programs every 200 ms, maps and node checks every second,
/// decides every 100 ms, persists every 500 ms.
pub async fn step_loop(d: Arc<Daemon>) {
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut n: u64 = 0;
    let mut last_maps: Option<BTreeMap<String, Option<u64>>> = None;
    let mut last_programs: Option<BTreeMap<String, Option<u32>>> = None;
    loop {
        tick.tick().await;
        n += 1;
        let active = lock(&d.step).as_ref().map(|s| {
            (
                s.is_final(),
                s.baseline.programs.keys().cloned().collect::<Vec<_>>(),
            )
        });
        let Some((false, tracked)) = active else {
            last_maps = None;
            last_programs = None;
            continue;
        };
        lock(&d.metrics).step_active.set(1);
        if n.is_multiple_of(2) || last_programs.is_none() {
            last_programs = links::observe(&d.cfg.bpffs)
                .await
                .ok()
                .filter(|o| !o.prog_details_unreadable)
                .map(|o| current_programs(&o, &tracked));
        }
        if n.is_multiple_of(10) || last_maps.is_none() {
            d.refresh_node().await;
            last_maps = lock(&d.node).maps.as_ref().map(super::watch::map_counts);
        }
        let node_not_green: Vec<String> = d
            .node_results()
            .into_iter()
            .filter(|r| r.status != Status::Pass)
            .map(|r| format!("{} {}: {}", r.check, r.status.as_str(), r.reason))
            .collect();
        let now = unix_now();
        let kd = d.kernel_drops_now();
        let cd = d.cilium_drops_now();
        let max_timeout = d
            .cfg
            .targets
            .iter()
            .map(|t| t.timeout.as_secs_f64())
            .fold(0.0, f64::max);
        let mut guard = lock(&d.step);
        let Some(s) = guard.as_mut() else { continue };
        if last_programs.is_some() && d.resumed.swap(false, Ordering::SeqCst) {
            // Judge the hole: a reload or an outage while the agent was away is unseen evidence.
            if let Some(p) = &last_programs {
                let before = if s.reload.last_seen.is_empty() {
                    s.baseline
                        .programs
                        .iter()
                        .map(|(k, v)| (k.clone(), Some(*v)))
                        .collect()
                } else {
                    s.reload.last_seen.clone()
                };
                if p != &before {
                    s.evidence_incomplete = Some("the datapath changed while the agent was down: the outage was not observed".into());
                }
            }
        }
        let mut drops = BTreeMap::new();
        if let Some(k) = &kd {
            for (r, v) in k {
                let d0 = s.baseline.kernel_drops.get(r).copied().unwrap_or(0);
                if *v > d0 {
                    drops.insert(format!("kernel:{r}"), v - d0);
                }
            }
        }
        if let Some(c) = &cd {
            for (r, v) in c {
                let d0 = s.baseline.cilium_drops.get(r).copied().unwrap_or(0);
                if *v > d0 {
                    drops.insert(format!("cilium:{r}"), v - d0);
                }
            }
        }
        let after = s.reload.complete_at;
        drop(guard);
        let dns_after = after.and_then(|t| d.dns_p50_since(t));
        let mut guard = lock(&d.step);
        let Some(s) = guard.as_mut() else { continue };
        // The first sample after a resume (judged once per target): failing at once means an
        // outage began while the agent was away.
        if !s.holes.is_empty() && s.evidence_incomplete.is_none() {
            let hole_end = s.holes.last().map(|h| h.1).unwrap_or(0.0);
            let mut incomplete = None;
            for (name, t) in s.targets.iter_mut().filter(|(_, t)| !t.hole_judged) {
                let first = t
                    .samples
                    .iter()
                    .filter(|x| x.0 >= hole_end)
                    .min_by(|a, b| a.0.total_cmp(&b.0))
                    .copied();
                if let Some((_, ok)) = first {
                    t.hole_judged = true;
                    if !ok {
                        incomplete = Some(format!("{name} was already failing when the agent came back: the outage began unseen"));
                    }
                }
            }
            if incomplete.is_some() {
                s.evidence_incomplete = incomplete;
            }
        }
        let o = Observed {
            now,
            programs: last_programs.clone(),
            maps: last_maps.clone(),
            node_not_green,
            dns_p50_after_ms: dns_after,
            drops,
            // Every probe sent before this has answered or timed out, and been recorded (a
            // little slack for the recording itself on a busy node).
            complete_until: now - max_timeout - COMPLETION_SLACK_S,
        };
        verdict::decide(s, &o);
        let done = s.is_final();
        if done || n.is_multiple_of(5) {
            // Probes older than the longest timeout have all answered: fold them into
            // outages so a long step at 10 ms keeps its memory bounded.
            let cutoff = now - max_timeout - 1.0;
            for t in s.targets.values_mut() {
                t.compact(cutoff);
            }
            persist(&d, s);
        }
        if done {
            let snapshot = s.clone();
            drop(guard);
            finished(&d, &snapshot);
        } else {
            drop(guard);
        }
        d.bump();
    }
}
