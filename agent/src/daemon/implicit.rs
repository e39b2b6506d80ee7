//! Implicit steps: a cilium-agent restart nobody stepped (a RollingUpdate, a crash, an OOM
//! kill, a reboot) is verified like a posted step. The agent keeps a steady snapshot (the
//! baseline a step would take) and watches for the earliest signal Cilium gives on the host:
//! its API socket stops answering (`api/v1/server/server.go` serves it last at start and
//! closes it at stop; "not connectable" is "down or still initialising", see
//! docs/cilium-fidelity.md), then the programs replaced (new ids on the tracked devices). On
//! either it begins a step from the snapshot, seeded with the steady probes since the
//! snapshot, so the gap's error bound widens to the steady cadence before detection.
//!
//! An agent that was itself down while the cilium-agent restarted finds, at its own start,
//! program ids other than its persisted snapshot's: that step is `evidence_incomplete`.
use super::loads::ProgramLoads;
use super::{lock, watch, Daemon};
use crate::kernel::clock;
use crate::kernel::links;
pub use crate::step::implicit::Steady;
use crate::step::implicit::{self as rules, programs_changed};
use std::sync::Arc;
use std::time::Duration;

fn steady_file(d: &Daemon) -> std::path::PathBuf {
    d.opts.state_dir.join("steady.json")
}

/// The steady snapshot a previous run left: None when there is none; an error when there is
/// one that cannot be read (truncated, garbage, too big, not a file).
fn load_steady(d: &Daemon) -> Result<Option<Steady>, String> {
    let path = steady_file(d);
    let meta = match std::fs::symlink_metadata(&path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    if meta.len() > crate::daemon::store::MAX_STEP_FILE {
        return Err(format!("{} bytes is more than a snapshot", meta.len()));
    }
    let b = std::fs::read(&path).map_err(|e| e.to_string())?;
    serde_json::from_slice(&b)
        .map(Some)
        .map_err(|e| format!("not a snapshot ({e})"))
}

fn save_steady(d: &Daemon, s: &Steady) {
    let path = steady_file(d);
    let tmp = path.with_extension("json.tmp");
    let r = serde_json::to_vec(s)
        .map_err(std::io::Error::other)
        .and_then(|b| crate::durable::write(&tmp, &path, &b));
    if let Err(e) = &r {
        tracing::warn!(path = %path.display(), error = %e, "cannot persist the steady snapshot");
    }
    d.store.note_write(&r);
}

/// Whether the cilium-agent's API socket accepts a connection (None: not configured).
fn api_up(d: &Daemon) -> Option<bool> {
    let p = d.cfg.cilium_api.as_ref()?;
    Some(std::os::unix::net::UnixStream::connect(p).is_ok())
}

/// A step is active (the runner's snapshot; a step left unfinished by an agent restart is
/// resumed by the runner before this loop's first look).
fn busy(d: &Daemon) -> bool {
    d.current_step().is_some_and(|s| !s.is_final())
}

/// Begins an implicit step from `steady`, because of `trigger`.
async fn begin(d: &Arc<Daemon>, steady: &Steady, trigger: String, incomplete: Option<String>) {
    let budgets: Vec<Duration> = d.cfg.targets.iter().filter_map(|t| t.max_gap).collect();
    let c = &d.cfg.implicit_steps;
    let params = match rules::params(
        c.settle,
        c.timeout,
        &d.cfg.witnesses,
        d.opts.burst_interval,
        &budgets,
    ) {
        Ok(p) => p,
        Err(e) => {
            tracing::error!(error = %e, "cannot begin an implicit step");
            return;
        }
    };
    let id = format!("implicit-{}", super::store::new_id(clock::now()));
    let mut targets = crate::step::timelines(&d.cfg.targets, crate::step::Budgets::of(&params));
    // The evidence before detection: the steady cadence's probes since the snapshot.
    let running = d.host.recorder.seed(&mut targets, steady.at);
    let mut s = rules::begin(
        id,
        steady,
        params.clone(),
        targets,
        &running,
        &trigger,
        incomplete,
        clock::now(),
    );
    // Witnesses burst from here; one that cannot be reached is a hole in the LAN's view.
    for url in &params.witnesses {
        let one = crate::step::StepParams {
            witnesses: vec![url.clone()],
            ..params.clone()
        };
        match watch::begin_witnesses(d, &s.id, &one, Some(steady.at)).await {
            Ok(w) => s.witnesses.extend(w),
            Err(e) => {
                s.witnesses.insert(
                    url.clone(),
                    crate::step::WitnessTrack {
                        lost: Some(format!("could not begin: {e}")),
                        ..Default::default()
                    },
                );
            }
        }
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    let id = s.id.clone();
    let begun_on = s.clone();
    let sent = d
        .ports
        .commands
        .send(super::runner::Command::Begin {
            step: Box::new(s),
            reply: tx,
        })
        .await;
    match (sent, rx.await) {
        (Ok(()), Ok(super::runner::Begun::Created(_))) => {
            tracing::warn!(step = %id, trigger = %trigger, "a cilium-agent restart nobody stepped: verifying it as an implicit step");
        }
        // Another step won meanwhile: what this one began on the witnesses is ended.
        _ => watch::end_witnesses(d, &begun_on),
    }
}

/// Watches for restarts nobody stepped; runs forever.
pub async fn run(d: Arc<Daemon>) {
    if !d.cfg.implicit_steps.enabled {
        return;
    }
    // Give the slow loop its first round (maps for the snapshot).
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Was the cilium-agent restarted while this agent was down?
    let found = match load_steady(&d) {
        Ok(s) => s,
        Err(why) => {
            // What it held is lost (a crash mid-write on an older agent, a power loss, a
            // hand): whether the cilium-agent restarted meanwhile cannot be told, so a step
            // says so rather than nothing.
            tracing::error!(path = %steady_file(&d).display(), error = %why, "the steady snapshot cannot be read: a cilium-agent restart while this agent was down cannot be ruled out");
            if !busy(&d) && !d.store.list().iter().any(|s| !s.is_final()) {
                if let Ok(obs) = links::observe_via(Some(&d.topology), &d.cfg.bpffs).await {
                    let maps = lock(&d.node).maps.clone();
                    let now = clock::now();
                    if let Ok(baseline) = watch::baseline_from(&d, &obs, maps.as_ref(), now) {
                        let steady = Steady {
                            at: now,
                            boot_id: crate::kernel::clock::boot_id(),
                            baseline,
                        };
                        begin(
                            &d,
                            &steady,
                            "found at the agent's start: its steady snapshot unreadable".into(),
                            Some(format!(
                                "this agent's steady snapshot could not be read at its start ({why}): whether the cilium-agent restarted while this agent was down is not known"
                            )),
                        )
                        .await;
                    }
                }
            }
            None
        }
    };
    if let Some(old) = found {
        if !busy(&d) && !d.store.list().iter().any(|s| !s.is_final()) {
            if let Ok(obs) = links::observe_via(Some(&d.topology), &d.cfg.bpffs).await {
                let keys: Vec<String> = old.baseline.programs.keys().cloned().collect();
                let changed =
                    programs_changed(&old.baseline, &watch::current_programs(&obs, &keys));
                let boot = crate::kernel::clock::boot_id();
                if let Some((trigger, incomplete)) =
                    rules::found_at_start(&old, &changed, boot.as_deref(), clock::now())
                {
                    begin(&d, &old, trigger, Some(incomplete)).await;
                }
            }
        }
    }
    let mut last: Option<Steady> = None;
    let mut last_api: Option<bool> = None;
    let mut saved_at = 0.0;
    let mut n: u64 = 0;
    let mut loads = ProgramLoads::from_now();
    // The API socket is tried every 250 ms (its going down starts a step at once); the
    // programs are looked at every second. Without a socket to try, a wake-up a second.
    let (period, looks_every) = if d.cfg.cilium_api.is_some() {
        (Duration::from_millis(250), 4)
    } else {
        (Duration::from_secs(1), 1)
    };
    loop {
        tokio::time::sleep(period).await;
        n += 1;
        if busy(&d) {
            // After a step, a fresh snapshot: the programs changed by design.
            last = None;
            last_api = None;
            continue;
        }
        let api = api_up(&d);
        let api_went_down = last_api == Some(true) && api == Some(false);
        last_api = api;
        if !(api_went_down || n.is_multiple_of(looks_every) || last.is_none()) {
            continue;
        }
        // Dumping every device each second cost ~35 ms of kernel time on a node with 1,000
        // endpoints (3.5 % of a core). A device's programs can only change to programs
        // loaded since the last look, so the dump runs only when one was (or the API socket
        // went down, or there is no snapshot yet); otherwise the snapshot follows the slow
        // loop's observation.
        let now = clock::now();
        let look = api_went_down || last.is_none() || loads.since_last_look(now);
        let obs = if look {
            match links::observe_via(Some(&d.topology), &d.cfg.bpffs).await {
                Ok(obs) => obs,
                Err(_) => continue,
            }
        } else {
            let node = lock(&d.node);
            match (&node.links, &last) {
                (Some(l), Some(prev)) if node.checked_at > prev.at => l.clone(),
                _ => continue,
            }
        };
        if let Some(prev) = &last {
            let keys: Vec<String> = prev.baseline.programs.keys().cloned().collect();
            let changed = programs_changed(&prev.baseline, &watch::current_programs(&obs, &keys));
            let trigger = rules::trigger(api_went_down, &changed);
            if let Some(t) = trigger {
                let prev = prev.clone();
                begin(&d, &prev, t, None).await;
                last = None;
                continue;
            }
        }
        // No restart: the snapshot moves on.
        let maps = lock(&d.node).maps.clone();
        if let Ok(baseline) = watch::baseline_from(&d, &obs, maps.as_ref(), now) {
            let s = Steady {
                at: now,
                boot_id: crate::kernel::clock::boot_id(),
                baseline,
            };
            if now - saved_at >= 10.0 {
                save_steady(&d, &s);
                saved_at = now;
            }
            last = Some(s);
        }
    }
}
