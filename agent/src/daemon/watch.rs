//! The step lifecycle's pieces the runner uses: taking the baseline, persisting, and
//! exporting the outcome. The runner (`runner.rs`) alone owns and advances the active step.
use super::{lock, Daemon};
use crate::checks::devices::{self, TO_NETDEV_KEY, XDP_KEY};
use crate::kernel::links;
use crate::metrics::ProbeLabels;
use crate::probe::unix_now;
use crate::profile;
use crate::step::{Baseline, Step, StepParams, Verdict};
use std::collections::BTreeMap;
use std::sync::Arc;

/// What the reload check follows under a tracking key: the device and the program (Cilium's
/// entry points, bpf/bpf_host.c, bpf_overlay.c, bpf_xdp.c): `cil_from_netdev` on a host
/// device, `cil_to_host` on cilium_host, `cil_from_overlay` on the overlay device, and
/// `cil_xdp_entry` for `<dev>:xdp`, `cil_to_netdev` (egress) for `<dev>:to_netdev`.
pub fn tracked_program(key: &str) -> (&str, &'static str, &'static str) {
    if let Some(dev) = key.strip_suffix(XDP_KEY) {
        (dev, "xdp", "cil_xdp_entry")
    } else if let Some(dev) = key.strip_suffix(TO_NETDEV_KEY) {
        (dev, "egress", "cil_to_netdev")
    } else if key == "cilium_host" {
        (key, "ingress", "cil_to_host")
    } else if devices::is_overlay(key) {
        (key, "ingress", "cil_from_overlay")
    } else {
        (key, "ingress", "cil_from_netdev")
    }
}

/// Program id per tracking key (see [`tracked_program`]). None when the program is gone.
pub fn current_programs(
    obs: &links::Observation,
    keys: &[String],
) -> BTreeMap<String, Option<u32>> {
    keys.iter()
        .map(|key| {
            let (dev, hook, prog) = tracked_program(key);
            let id = obs
                .devices
                .iter()
                .find(|d| d.name == dev)
                .and_then(|d| d.programs.iter().find(|p| p.hook == hook && p.is(prog)))
                .map(|p| p.prog_id);
            (key.clone(), id)
        })
        .collect()
}

/// Cilium's programs on every endpoint device, by device name (see
/// `links::endpoint_hooks`): `cil_from_container` on ingress or netkit's peer hook,
/// `cil_to_container` on egress or netkit's primary hook.
pub fn endpoint_programs(
    obs: &links::Observation,
) -> BTreeMap<String, crate::step::EndpointPrograms> {
    obs.endpoints
        .iter()
        .map(|e| {
            let [(entry, _), (exit, _)] = links::endpoint_hooks(e.kind.as_deref());
            let find = |hook: &str, prog: &str| {
                e.programs
                    .iter()
                    .find(|p| p.hook == hook && p.is(prog))
                    .map(|p| p.prog_id)
            };
            (
                e.name.clone(),
                crate::step::EndpointPrograms {
                    ifindex: e.ifindex,
                    from_container: find(entry, "cil_from_container"),
                    to_container: find(exit, "cil_to_container"),
                    raced: e.raced,
                },
            )
        })
        .collect()
}

/// The endpoints a step follows: those carrying `cil_from_container` at the start, read
/// consistently; unknown when endpoint programs could not be queried.
pub fn endpoint_baseline(
    obs: &links::Observation,
) -> (
    BTreeMap<String, crate::step::EndpointPrograms>,
    crate::step::EndpointsFollowed,
    usize,
) {
    use crate::step::EndpointsFollowed;
    if let Some(p) = obs.endpoint_problems.first() {
        return (BTreeMap::new(), EndpointsFollowed::Unknown(p.clone()), 0);
    }
    let all = endpoint_programs(obs);
    let eps: BTreeMap<_, _> = all
        .iter()
        .filter(|(_, e)| e.from_container.is_some() && !e.raced)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let excluded = all.len() - eps.len();
    // Cilium attaches cil_from_container to every endpoint: endpoint devices of which none
    // carries it were not read as they are (a hook or kind not understood).
    if eps.is_empty() && !all.is_empty() {
        return (
            eps,
            EndpointsFollowed::Unknown(format!(
                "{} endpoint devices, none carrying cil_from_container where Cilium attaches it",
                all.len()
            )),
            excluded,
        );
    }
    (eps, EndpointsFollowed::Followed, excluded)
}

/// The keys a step follows for the reload: the selected host devices, `cilium_host`, the
/// overlay device when it carries `cil_from_overlay`, and `<dev>:xdp` for every selected
/// device carrying `cil_xdp_entry`, `<dev>:to_netdev` for every one carrying `cil_to_netdev`.
/// Cilium reloads all of them on every start.
pub fn reload_keys(obs: &links::Observation, selected: &[String]) -> Vec<String> {
    let mut keys = selected.to_vec();
    let carries = |name: &str, hook: &str, prog: &str| {
        obs.devices
            .iter()
            .any(|d| d.name == name && d.programs.iter().any(|p| p.hook == hook && p.is(prog)))
    };
    if obs.devices.iter().any(|x| x.name == "cilium_host") {
        keys.push("cilium_host".into());
    }
    for d in obs.devices.iter().filter(|d| devices::is_overlay(&d.name)) {
        if carries(&d.name, "ingress", "cil_from_overlay") {
            keys.push(d.name.clone());
        }
    }
    for dev in selected {
        if carries(dev, "xdp", "cil_xdp_entry") {
            keys.push(format!("{dev}{XDP_KEY}"));
        }
        if carries(dev, "egress", "cil_to_netdev") {
            keys.push(format!("{dev}{TO_NETDEV_KEY}"));
        }
    }
    keys
}

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

/// Map ids of the global maps.
pub fn map_ids(m: &crate::kernel::bpffs::MapsObservation) -> BTreeMap<String, u32> {
    m.globals.iter().map(|(k, v)| (k.clone(), v.id)).collect()
}

pub fn map_counts(m: &crate::kernel::bpffs::MapsObservation) -> BTreeMap<String, Option<u64>> {
    m.globals
        .iter()
        .map(|(k, v)| (k.clone(), v.entries))
        .collect()
}

/// Why a step cannot begin: no baseline can be taken (503).
#[derive(Debug, thiserror::Error)]
pub enum BeginError {
    #[error("cannot take a baseline: {0}")]
    Links(#[from] links::LinkError),
    #[error("cannot take a baseline: {0}")]
    ProgramsUnreadable(String),
    #[error("cannot take a baseline: no device carries cil_from_netdev")]
    NoDatapath,
    #[error("witness {url}: {problem} (the step was not begun)")]
    Witness { url: String, problem: String },
}

/// How long the agent waits for a witness's answer.
pub const WITNESS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

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
    for url in &params.witnesses {
        let fail = |problem: String| BeginError::Witness {
            url: url.clone(),
            problem,
        };
        let w = crate::client::Agent::new(url, d.opts.token.current())
            .map_err(|e| fail(format!("{e:#}")))?;
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
    Ok(out)
}

/// Polls a witness for its report of step `id`.
pub async fn poll_witness(
    url: String,
    token: Option<String>,
    id: String,
    after: Option<f64>,
) -> Result<crate::witness::WitnessReport, WitnessPollError> {
    let w = crate::client::Agent::new(&url, token)
        .map_err(|e| WitnessPollError::Failed(format!("{e:#}")))?;
    let path = match after {
        Some(a) => format!("/v1/steps/{id}?after={a:.3}"),
        None => format!("/v1/steps/{id}"),
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

/// Why a witness poll brought no report.
#[derive(Debug, Clone)]
pub enum WitnessPollError {
    /// The witness does not know the step (it restarted): its evidence is gone.
    Unknown(String),
    /// Unreachable or a bad answer: try again.
    Failed(String),
}

/// Ends the step on its witnesses (best effort, in the background).
pub fn end_witnesses(d: &Daemon, s: &Step) {
    for url in s.witnesses.keys() {
        let (url, token, id) = (url.clone(), d.opts.token.current(), s.id.clone());
        tokio::spawn(async move {
            if let Ok(w) = crate::client::Agent::new(&url, token) {
                let _ = w
                    .call("DELETE", &format!("/v1/steps/{id}"), None, WITNESS_TIMEOUT)
                    .await;
            }
        });
    }
}

/// Takes the baseline and creates the step.
pub async fn begin(d: &Arc<Daemon>, id: String, params: StepParams) -> Result<Step, BeginError> {
    let now = unix_now();
    let obs = links::observe_via(Some(&d.topology), &d.cfg.bpffs).await?;
    let observed = crate::checks::maps::observe(&d.cfg.bpffs, false).await.ok();
    let baseline = baseline_from(d, &obs, observed.as_ref(), now)?;
    let targets = crate::step::timelines(&d.cfg.targets, crate::step::Budgets::of(&params));
    let witnesses = begin_witnesses(d, &id, &params, None).await?;
    let mut s = Step::new(id, now, params, baseline, targets);
    s.witnesses = witnesses;
    Ok(s)
}

/// A baseline from an observation of the devices and of the maps (taken now, or kept from
/// the steady cadence for an implicit step).
pub fn baseline_from(
    d: &Daemon,
    obs: &links::Observation,
    observed: Option<&crate::kernel::bpffs::MapsObservation>,
    now: f64,
) -> Result<Baseline, BeginError> {
    if obs.prog_details_unreadable {
        return Err(BeginError::ProgramsUnreadable(
            obs.problems.first().cloned().unwrap_or_default(),
        ));
    }
    // Host devices only: Cilium's own devices change programs by design across versions
    // (cilium_wg0: cil_from_netdev up to 1.17, cil_from_wireguard from 1.18).
    let selected: Vec<String> = devices::carrying(&obs.devices)
        .into_iter()
        .filter(|d| !devices::ciliums_own(d))
        .collect();
    if selected.is_empty() {
        return Err(BeginError::NoDatapath);
    }
    let tracked = reload_keys(obs, &selected);
    let programs: BTreeMap<String, u32> = current_programs(obs, &tracked)
        .into_iter()
        .filter_map(|(k, v)| v.map(|v| (k, v)))
        .collect();
    let maps = observed.map(map_counts).unwrap_or_default();
    let map_ids = observed.map(map_ids).unwrap_or_default();
    let endpoint_maps = observed
        .map(|m| m.endpoint_maps.clone())
        .unwrap_or_default();
    let small_kept = maps.iter().filter(|(name, n)| {
        profile::names_entries(name) && n.is_some_and(|n| n <= profile::NAMED_ENTRIES_MAX)
    });
    let map_entries = named_entries(&d.cfg.bpffs, small_kept.map(|(n, _)| n.as_str()));
    let (cilium, cilium_from) = match d.agent_version() {
        Some(full) => (
            profile::release_of(&full),
            Some(format!("agent API ({full})")),
        ),
        None => (None, None),
    };
    let (cilium, cilium_from) = match cilium {
        Some(c) => (Some(c), cilium_from),
        None => (
            profile::version_label(&profile::names_for_inference(maps.keys(), &endpoint_maps)),
            Some("pinned map names".to_string()),
        ),
    };
    let node_checks = d
        .node_results()
        .into_iter()
        .map(|r| (r.check.to_string(), r.status.as_str().to_string()))
        .collect();
    let (kernel_drops, cilium_drops) = (d.kernel_drops_now(), d.cilium_drops_now());
    let (endpoints, endpoints_followed, endpoints_excluded) = endpoint_baseline(obs);
    Ok(Baseline {
        endpoints,
        endpoints_followed,
        endpoints_excluded,
        cilium,
        cilium_from,
        endpoint_maps,
        map_entries,
        programs,
        selected,
        maps,
        dns_p50_ms: d.dns_p50_since(now - 60.0),
        kernel_drops: kernel_drops.clone().unwrap_or_default(),
        cilium_drops: cilium_drops.clone().unwrap_or_default(),
        node_checks,
        map_ids,
        drops_unknown_at_start: [
            ("kernel", kernel_drops.is_none()),
            ("cilium", cilium_drops.is_none()),
        ]
        .into_iter()
        .filter(|(_, unknown)| *unknown)
        .map(|(s, _)| s.to_string())
        .collect(),
    })
}

/// The step as persisted: this run's samples folded into outages.
fn persistable(s: &Step) -> Step {
    let mut c = s.clone();
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

/// Saves the step (this run's samples folded into outages).
pub fn persist(d: &Daemon, s: &mut Step) -> std::io::Result<()> {
    s.updated_at = unix_now();
    let r = d.store.save(&persistable(s));
    if r.is_err() {
        lock(&d.metrics).state_write_errors.inc();
    }
    s.not_persisted = r
        .as_ref()
        .err()
        .map(|e| format!("the step's record could not be written: {e}"));
    r
}

/// Exports a step that just began: active, and the gap budget of each target.
pub fn exported_begin(d: &Daemon, s: &Step) {
    let m = lock(&d.metrics);
    m.step_active.set(1);
    for (name, t) in &s.targets {
        m.gap_budget
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
    let m = lock(&d.metrics);
    m.steps
        .get_or_create(&crate::metrics::VerdictLabels {
            verdict: v.status.as_str().to_string(),
            origin: s.origin.as_str().to_string(),
        })
        .inc();
    m.last_step_passed
        .set((v.status == crate::step::Status::Passed) as i64);
    m.last_step_started.set(s.created_at);
    m.last_step_finished.set(v.finished_at);
    m.step_active.set(0);
    // The last step's gaps only: series of earlier steps' witnesses (or targets) go.
    m.last_step_gap.clear();
    for g in &s.gaps {
        let l = crate::metrics::GapLabels {
            kind: g.kind.clone(),
            target: g.target.clone(),
            vantage: "node".into(),
        };
        m.last_step_gap.get_or_create(&l).set(g.longest_s);
        m.step_gap.observe(g.longest_s);
    }
    for (url, w) in &s.witnesses {
        for g in w.report.iter().flat_map(|r| &r.gaps) {
            let l = crate::metrics::GapLabels {
                kind: g.kind.clone(),
                target: g.target.clone(),
                vantage: format!("witness:{}", url.trim_start_matches("http://")),
            };
            m.last_step_gap.get_or_create(&l).set(g.longest_s);
        }
    }
    drop(m);
    end_witnesses(d, s);
    d.store.prune(crate::step::KEEP_STEPS);
    let reasons: Vec<&str> = v.reasons.iter().map(|r| r.as_str()).collect();
    tracing::info!(step = %s.id, verdict = v.status.as_str(), reasons = ?reasons, summary = %v.summary, "step decided");
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
    if let Err(e) = persist(d, s) {
        tracing::error!(step = %s.id, error = %e, "cannot persist the cancelled step");
    }
    finished(d, s);
}
