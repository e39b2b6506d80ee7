//! The I/O around a step's life (its rules are `step::lifecycle` and `step::observe`):
//! the observations and reads a baseline is taken from, the witnesses asked, the store
//! written, the outcome exported. The runner (`runner/`) alone owns and advances the active
//! step.
use super::Daemon;
use crate::cilium::profile;
use crate::kernel::clock;
use crate::kernel::links;
use crate::metrics::ProbeLabels;
pub use crate::step::lifecycle::WitnessPollError;
pub use crate::step::observe::{
    current_programs, endpoint_readings, map_counts, map_ids, BeginError,
};
use crate::step::observe::{entries_to_name, BaselineInputs};
use crate::step::{Baseline, Step, StepParams};
use std::collections::BTreeMap;
use std::sync::Arc;

/// The entries of `names` in Cilium's terms (`profile::describe_entry`), read-only; a map
/// that cannot be read is left out (its loss is then only counted).
pub fn named_entries<'a>(
    bpffs: &std::path::Path,
    names: impl IntoIterator<Item = &'a str>,
) -> BTreeMap<String, Vec<String>> {
    let limit = profile::NAMED_ENTRIES_MAX as usize * 4;
    names
        .into_iter()
        .filter_map(|name| {
            let mut out = std::collections::BTreeSet::new();
            crate::kernel::bpffs::read_entries(bpffs, name, limit, |k, v| {
                if let Some(e) = profile::describe_entry(name, k, v) {
                    out.insert(e);
                }
            })
            .ok()?;
            Some((name.to_string(), out.into_iter().collect()))
        })
        .collect()
}

/// How long the agent waits for a witness's answer.
pub const WITNESS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

/// The largest witness answer read: a report is its gaps per target, a few KB; a witness (or
/// whoever answers at its address) sending more is refused, never read to its end.
pub const WITNESS_ANSWER_CAP: usize = 1 << 20;

/// Begins the step on every witness it names (idempotent there); their instances and start
/// times, by URL.
/// `since`: an implicit step's start (the witness seeds it with its continuous probes).
pub async fn begin_witnesses(
    d: &Daemon,
    id: &str,
    params: &StepParams,
    since: Option<f64>,
) -> Result<BTreeMap<String, crate::step::WitnessTrack>, BeginError> {
    let mut out = BTreeMap::new();
    let r = begin_each(d, id, params, since, &mut out).await;
    if r.is_err() {
        // The witnesses begun before one refused: ended, not left probing an orphan.
        end_on(d, id, out.keys());
    }
    r.map(|()| out)
}

async fn begin_each(
    d: &Daemon,
    id: &str,
    params: &StepParams,
    since: Option<f64>,
    out: &mut BTreeMap<String, crate::step::WitnessTrack>,
) -> Result<(), BeginError> {
    for url in &params.witnesses {
        let fail = |problem: String| BeginError::Witness {
            url: url.clone(),
            problem,
        };
        let w = crate::client::Agent::new(url, d.opts.token.current())
            .map_err(|e| fail(format!("{e:#}")))?
            .limited(WITNESS_ANSWER_CAP);
        let ms = |d: std::time::Duration| Some(format!("{}ms", d.as_millis().max(1)));
        let body = crate::witness::WitnessStepRequest {
            id: id.to_string(),
            burst_interval: ms(params.burst_interval),
            // The witness ends by itself a minute after the step's timeout.
            timeout: ms(params.timeout + std::time::Duration::from_secs(60)),
            max_gap: ms(params.max_gap),
            since,
        };
        let (status, v) = w
            .call(
                "POST",
                "/v1/steps",
                Some(serde_json::to_value(&body).unwrap_or_default()),
                WITNESS_TIMEOUT,
            )
            .await
            .map_err(|e| fail(format!("unreachable: {e:#}")))?;
        if status != 201 && status != 200 {
            return Err(fail(format!(
                "answered {status}: {}",
                v["error"].as_str().unwrap_or("")
            )));
        }
        let b: crate::witness::WitnessBegun =
            serde_json::from_value(v).map_err(|e| fail(format!("unexpected answer: {e}")))?;
        out.insert(
            url.clone(),
            crate::step::WitnessTrack {
                instance: b.instance,
                began_at: b.created_at,
                ..Default::default()
            },
        );
    }
    Ok(())
}

/// Polls a witness for its report of step `id`.
pub async fn poll_witness(
    url: String,
    token: Option<String>,
    id: String,
    after: Option<f64>,
    from: f64,
) -> Result<crate::witness::WitnessReport, WitnessPollError> {
    let w = crate::client::Agent::new(&url, token)
        .map_err(|e| WitnessPollError::Failed(format!("{e:#}")))?
        .limited(WITNESS_ANSWER_CAP);
    // The gaps over this step's own window only (`from`: where it began).
    let path = match after {
        Some(a) => format!("/v1/steps/{id}?from={from:.3}&after={a:.3}"),
        None => format!("/v1/steps/{id}?from={from:.3}"),
    };
    let (status, v) = w
        .call("GET", &path, None, WITNESS_TIMEOUT)
        .await
        .map_err(|e| WitnessPollError::Failed(format!("unreachable: {e:#}")))?;
    match status {
        200 => serde_json::from_value(v)
            .map_err(|e| WitnessPollError::Failed(format!("unexpected report: {e}"))),
        404 => Err(WitnessPollError::Unknown(
            v["error"].as_str().unwrap_or("no such step").to_string(),
        )),
        s => Err(WitnessPollError::Failed(format!(
            "answered {s}: {}",
            v["error"].as_str().unwrap_or("")
        ))),
    }
}

/// Ends the step on its witnesses (best effort, in the background).
pub fn end_witnesses(d: &Daemon, s: &Step) {
    end_on(d, &s.id, s.witnesses.keys());
}

/// Ends step `id` on the witnesses at `urls` (best effort, in the background): a step that
/// ended, or one begun there but never installed here.
fn end_on<'a>(d: &Daemon, id: &str, urls: impl IntoIterator<Item = &'a String>) {
    for url in urls {
        let (url, token, id) = (url.clone(), d.opts.token.current(), id.to_string());
        tokio::spawn(async move {
            if let Ok(w) = crate::client::Agent::new(&url, token) {
                let w = w.limited(WITNESS_ANSWER_CAP);
                let _ = w
                    .call("DELETE", &format!("/v1/steps/{id}"), None, WITNESS_TIMEOUT)
                    .await;
            }
        });
    }
}

/// Takes the baseline and creates the step.
pub async fn begin(d: &Arc<Daemon>, id: String, params: StepParams) -> Result<Step, BeginError> {
    let now = clock::now();
    let obs = links::observe_via(Some(&d.topology), &d.cfg.bpffs).await?;
    let observed = crate::checks::maps::observe(&d.cfg.bpffs, false).await.ok();
    let baseline = baseline_from(d, &obs, observed.as_ref(), now)?;
    let targets = crate::step::timelines(&d.cfg.targets, crate::step::Budgets::of(&params));
    let witnesses = begin_witnesses(d, &id, &params, None).await?;
    let mut s = Step::new(id, now, params, baseline, targets);
    s.boot_id = crate::kernel::clock::boot_id();
    s.witnesses = witnesses;
    Ok(s)
}

/// A baseline from an observation of the devices and of the maps (taken now, or kept from
/// the steady cadence for an implicit step), with what the daemon knows around it.
pub fn baseline_from(
    d: &Daemon,
    obs: &links::Observation,
    maps: Option<&crate::kernel::bpffs::MapsObservation>,
    now: f64,
) -> Result<Baseline, BeginError> {
    let (kernel_drops, cilium_drops) = (d.kernel_drops_now(), d.cilium_drops_now());
    Baseline::take(
        obs,
        BaselineInputs {
            maps,
            map_entries: named_entries(
                &d.cfg.bpffs,
                entries_to_name(maps).iter().map(|s| s.as_str()),
            ),
            agent_version: d.agent_version(),
            node_checks: &d.node_results(),
            kernel_drops,
            cilium_drops,
            dns_p50_ms: d.dns_p50_since(now - 60.0),
        },
    )
}

/// Saves the step (this run's samples folded into outages).
pub fn persist(d: &Daemon, s: &mut Step) -> std::io::Result<()> {
    s.updated_at = clock::now();
    let r = d.store.save(&s.persistable());
    if r.is_err() {
        d.metrics.step.state_write_errors.inc();
    }
    s.not_persisted = r
        .as_ref()
        .err()
        .map(|e| format!("the step's record could not be written: {e}"));
    r
}

/// Exports a step that just began: active, and the gap budget of each target.
pub fn exported_begin(d: &Daemon, s: &Step) {
    let m = &d.metrics;
    m.step.step_active.set(1);
    for (name, t) in &s.targets {
        m.step
            .gap_budget
            .get_or_create(&ProbeLabels {
                kind: t.kind.clone(),
                target: name.clone(),
            })
            .set(t.budget);
    }
}

/// Exports a finished step and leaves burst mode.
pub fn finished(d: &Daemon, s: &Step) {
    let Some(v) = &s.verdict else { return };
    let m = &d.metrics;
    m.step
        .steps
        .get_or_create(&crate::metrics::VerdictLabels {
            verdict: v.status.as_str().to_string(),
            origin: s.origin.as_str().to_string(),
        })
        .inc();
    m.step
        .last_step_passed
        .set((v.status == crate::step::Status::Passed) as i64);
    m.step.last_step_started.set(s.created_at);
    m.step.last_step_finished.set(v.finished_at);
    m.step.step_active.set(0);
    // The last step's gaps only: series of earlier steps' witnesses (or targets) go.
    m.step.last_step_gap.clear();
    for g in &s.gaps {
        let l = crate::metrics::GapLabels {
            kind: g.kind.clone(),
            target: g.target.clone(),
            vantage: "node".into(),
        };
        m.step.last_step_gap.get_or_create(&l).set(g.longest_s);
        m.step.step_gap.observe(g.longest_s);
    }
    for (url, w) in &s.witnesses {
        for g in w.report.iter().flat_map(|r| &r.gaps) {
            let l = crate::metrics::GapLabels {
                kind: g.kind.clone(),
                target: g.target.clone(),
                vantage: format!("witness:{}", url.trim_start_matches("http://")),
            };
            m.step.last_step_gap.get_or_create(&l).set(g.longest_s);
        }
    }
    end_witnesses(d, s);
    d.store.prune(super::store::KEEP_STEPS);
    let reasons: Vec<&str> = v.reasons.iter().map(|r| r.as_str()).collect();
    tracing::info!(step = %s.id, verdict = v.status.as_str(), reasons = ?reasons, summary = %v.summary, "step decided");
}

/// Cancels the step (when it is not decided yet), persists and exports it.
pub fn cancel(d: &Daemon, s: &mut Step) {
    if !s.cancel(clock::now()) {
        return;
    }
    if let Err(e) = persist(d, s) {
        tracing::error!(step = %s.id, error = %e, "cannot persist the cancelled step");
    }
    finished(d, s);
}
