//! `stepguard rollout`: steps a Cilium DaemonSet (`updateStrategy: OnDelete`) one node at a
//! time, verified by each node's stepguard agent — the stepper the 50-day rollout lacked.
//!
//! Plan (`plan.rs`, pure) → for each node: begin a step on its agent, delete its cilium pod
//! with a UID precondition, wait for a Ready replacement on the step's revision (or a newer
//! one), wait for the verdict (`machine.rs`, pure) → re-read the cluster and re-plan (a new
//! revision is gone on to only when approved).
//! One stepper at a time: a `coordination.k8s.io` Lease in stepguard's namespace, renewed,
//! carrying the record (`record.rs`, pure): the step in flight, so an interrupted rollout
//! finishes it first without repeating it; a halt after a failed step, which every later run
//! respects until a person lifts it; the people's decisions. Transient API failures are
//! waited out. Kubernetes Events on the DaemonSet tell the story to `kubectl describe`.
mod actions;
mod approval;
mod args;
mod cluster;
mod decide;
mod error;
mod lock;
pub mod machine;
mod node;
mod output;
pub mod plan;
pub mod record;
pub mod replacement;
mod view;
mod watch;

use anyhow::{bail, Context, Result};
pub use approval::*;
pub use args::*;
use cluster::*;
use decide::*;
use error::ApiContext;
pub use error::RolloutError;
use k8s_openapi::api::apps::v1::{ControllerRevision, DaemonSet};
use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event as KEvent, Node, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
use kube::Client;
use lock::{
    acquire, lock_times, observe, persist, read_lock, release, renew_held, Held, Taken, Watched,
};
use machine::{Event, OldPod, Outcome, Phase, Timeouts};
use node::*;
use output::*;
use plan::{CiliumPod, ClusterView, L2Lease, NodeInfo, PlanOpts, PlannedStep};
use record::{Gate, InFlight, Lift, Record};
use replacement::{stage, Stage, Stages};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use watch::*;

const L2_PREFIX: &str = "cilium-l2announce-";

/// `--watch` was told to stop (SIGTERM, SIGINT): nothing more is touched; the record keeps
/// what is in flight for the next run.
pub(super) static TERMINATING: AtomicBool = AtomicBool::new(false);

fn stamp() -> String {
    k8s_openapi::jiff::Timestamp::now().to_string()
}

/// One node's result, for the summary.
#[derive(Clone, Debug, serde::Serialize)]
pub struct NodeResult {
    pub node: String,
    pub why: String,
    pub moves: Vec<String>,
    pub outcome: Outcome,
    pub elapsed_s: f64,
    /// The replacement pod's stages as seen, each with how long it lasted (seconds).
    pub replacement: Vec<(String, f64)>,
    /// What LAN clients were expected to see (a lease holder's step), beside the witnesses'
    /// measurement in the verdict's summary.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub blip: Option<plan::ExpectedBlip>,
}

/// Runs `stepguard rollout`; the exit code.
pub fn run(args: RolloutArgs) -> Result<crate::exit::ExitCode> {
    if args.canary.is_some() && args.canary_label.is_some() {
        bail!("--canary and --canary-label: give one");
    }
    let lift = match (&args.retry, &args.skip, args.abort) {
        (Some(n), None, false) => Some(Lift::Retry(n.clone())),
        (None, Some(n), false) => Some(Lift::Skip(n.clone())),
        (None, None, true) => Some(Lift::Abort),
        (None, None, false) => None,
        _ => bail!("--retry, --skip and --abort: give one"),
    };
    if matches!(lift, Some(Lift::Retry(_) | Lift::Skip(_)))
        && args.reason.as_deref().is_none_or(|r| r.trim().is_empty())
    {
        bail!("--retry and --skip need --reason WHY: the decision is recorded with who took it");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let c = Cluster::connect(args.clone()).await?;
        if let Some(l) = lift {
            return decide(&c, l).await;
        }
        if args.status {
            return status(&c).await;
        }
        if args.watch {
            // The Deployment's pod is stopped with SIGTERM: the node in flight stays on the
            // record for the next replica, the lock is given up, the process ends at once.
            tokio::spawn(async {
                use tokio::signal::unix::{signal, SignalKind};
                let (Ok(mut term), Ok(mut int)) = (
                    signal(SignalKind::terminate()),
                    signal(SignalKind::interrupt()),
                ) else {
                    return;
                };
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
                TERMINATING.store(true, Ordering::SeqCst);
            });
            return watch(&c).await;
        }
        rollout(&c, false).await
    })
}

fn plan_opts(c: &Cluster) -> PlanOpts {
    PlanOpts {
        canary: c.args.canary.clone(),
        canary_label: c
            .args
            .canary_label
            .as_deref()
            .and_then(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string())),
        max_nodes: c.args.max_nodes,
        vip_groups: c
            .args
            .vip_groups
            .iter()
            .filter_map(|g| g.split_once('='))
            .map(|(n, s)| (n.to_string(), s.split(',').map(String::from).collect()))
            .collect(),
        pause_between: c.args.pause_between,
        allow_minor_skip: c.args.allow_minor_skip,
        ..Default::default()
    }
}

/// The step for an interrupted node, from what the lock recorded.
fn resumed_step(i: &InFlight) -> PlannedStep {
    PlannedStep {
        node: i.node.clone(),
        pod: i.pod.clone(),
        pod_uid: i.pod_uid.clone(),
        why: if i.why.is_empty() {
            "resumed".into()
        } else {
            format!("{} (resumed)", i.why)
        },
        moves: vec![],
        pause_before: Duration::ZERO,
        blip: None,
    }
}

/// A rollout run; `watched`: started by `--watch`, which goes on only to approved revisions.
async fn rollout(c: &Cluster, watched: bool) -> Result<crate::exit::ExitCode> {
    let json_out = c.args.output == "json";
    let mut opts = plan_opts(c);
    let start = Duration::from_secs(60);
    let (view, ds) = patient("read the cluster", start, None, || c.view()).await?;
    let (_, rec) = patient("read the rollout lock", start, None, || read_lock(c)).await?;
    let current = view.revision.clone().unwrap_or_default();
    let (approve, _) = c.approval_now(&ds, &current.0, &view).await;
    if let Gate::Halted(msg) = record::gate(&rec, &current.0, approve.as_deref(), &stamp()) {
        if json_out {
            println!(
                "{}",
                serde_json::to_string_pretty(&json!({"halted": rec.halt, "message": msg,
                "verdict": match &rec.halt {
                    Some(h) => Some(halt_verdict(c, &view, h).await),
                    None => None,
                }}))?
            );
        } else {
            println!("refusing to start the rollout of {}: {msg}", view.daemonset);
            if let Some(h) = &rec.halt {
                println!("  {}", halt_verdict(c, &view, h).await);
            }
        }
        return Ok(crate::exit::ExitCode::NotDecided);
    }
    opts.skip = rec.skipped_on(&current.0).into_iter().collect();
    opts.again = rec.retry.clone();
    let first = plan::plan(&view, &opts);
    let failed: Vec<&plan::Refusal> = match &first {
        Err(r) => r.iter().filter(|r| r.halts()).collect(),
        Ok(_) => vec![],
    };
    if rec.inflight.is_none() && !failed.is_empty() {
        // A node's current pod holds a failed verdict: nothing is stepped past it, whatever
        // the record says (an abort, a deleted lock, an approved newer revision).
        let text = failed
            .iter()
            .map(|r| format!("  - {r}"))
            .collect::<Vec<_>>()
            .join("\n");
        if json_out {
            println!(
                "{}",
                serde_json::to_string_pretty(&json!({"halted_on": failed, "view": view}))?
            );
        } else {
            if c.args.dry_run {
                print_dry_run(false, &view, &rec, &first, &current.0)?;
            }
            println!(
                "stepguard rollout of {} halted: a node's current cilium pod failed its verification:\n{text}",
                view.daemonset
            );
        }
        if !c.args.dry_run {
            c.event(
                &ds,
                true,
                "StepguardRolloutHalted",
                &format!(
                    "a node's current cilium pod failed its verification: {}",
                    failed
                        .iter()
                        .map(|r| r.to_string())
                        .collect::<Vec<_>>()
                        .join("; ")
                ),
            )
            .await;
        }
        return Ok(crate::exit::ExitCode::Failed);
    }
    let only_waits = first
        .as_ref()
        .err()
        .is_some_and(|r| r.iter().all(|r| r.waits()));
    if let (None, Err(refusals), false) = (&rec.inflight, &first, only_waits) {
        if json_out {
            println!(
                "{}",
                serde_json::to_string_pretty(&json!({"refused": refusals, "view": view}))?
            );
        } else {
            println!(
                "refusing to start the rollout of {}:\n{}",
                view.daemonset,
                refusals_text(refusals)
            );
        }
        return Ok(crate::exit::ExitCode::NotDecided);
    }
    if c.args.dry_run {
        print_dry_run(json_out, &view, &rec, &first, &current.0)?;
        return Ok(crate::exit::ExitCode::Ok);
    }
    let now = stamp();
    let (cur_hash, approve2) = (current.0.clone(), approve.clone());
    let taken = patient("take the rollout lock", start, None, || {
        acquire(c, |r| {
            match record::gate(r, &cur_hash, approve2.as_deref(), &now) {
                Gate::Halted(m) => Err(m),
                Gate::Go { lift } => {
                    if let Some(d) = lift {
                        r.halt = None;
                        r.decide(d);
                    }
                    r.forget_other_revisions(&cur_hash);
                    // A retry of a node that no longer runs a cilium pod is done with.
                    if r.retry
                        .as_ref()
                        .is_some_and(|n| !view.pods.iter().any(|p| &p.node == n))
                    {
                        r.retry = None;
                    }
                    if !watched {
                        // A person runs the rollout again: an earlier `--abort` no longer holds.
                        r.aborted = None;
                    }
                    Ok(())
                }
            }
        })
    })
    .await?;
    let rec = match taken {
        Taken::Held(r) => *r,
        Taken::Refused(why) => {
            say(json_out, format!("refusing to start: {why}"));
            return Ok(crate::exit::ExitCode::NotDecided);
        }
    };
    // The lock is renewed in the background every retry period (with the record); losing it
    // stops everything.
    let held = Arc::new(Held::new());
    let shared = Arc::new(Mutex::new(rec.clone()));
    *crate::locks::lock(&c.told) = Some(shared.clone());
    let renewer = {
        let (held, shared) = (held.clone(), shared.clone());
        let c2 = Cluster {
            client: c.client.clone(),
            ns: c.ns.clone(),
            ds: c.ds.clone(),
            args: c.args.clone(),
            token: c.token.clone(),
            identity: c.identity.clone(),
            told: Mutex::new(None),
        };
        tokio::spawn(async move {
            let every = lock_times(&c2).retry;
            while !held.is_lost() {
                tokio::time::sleep(every).await;
                renew_held(&c2, &shared, &held).await;
            }
        })
    };
    if rec.halt.is_none() {
        if let Some(d) = rec
            .decisions
            .last()
            .filter(|d| d.action == "approved" && d.at == now)
        {
            c.event(
                &ds,
                false,
                "StepguardHaltLifted",
                &format!("{}: {}", d.by, d.why),
            )
            .await;
        }
    }
    if let Some(i) = &rec.inflight {
        say(
            json_out,
            format!(
                "resuming the rollout interrupted at node {} (step {}, revision {})",
                i.node, i.step, i.revision
            ),
        );
    }
    c.event(
        &ds,
        false,
        "StepguardRolloutStarted",
        &format!(
            "stepguard rollout of revision {} started: {} nodes to step",
            current.0,
            first.as_ref().map(|p| p.len()).unwrap_or(0) + usize::from(rec.inflight.is_some())
        ),
    )
    .await;
    let t0 = Instant::now();
    let mut results: Vec<NodeResult> = Vec::new();
    let mut code = crate::exit::ExitCode::Ok;
    let mut ending: Option<String> = None;
    let mut pending = rec.inflight.clone();
    // The revision this run goes on to: under `--watch` only an approved one.
    let mut run_rev = if !watched || approve.as_deref() == Some(current.0.as_str()) {
        current.0.clone()
    } else {
        String::new()
    };
    let run_id = format!("{:x}", (now_s() * 1000.0) as u64 % 0xffffff);
    let mut ds = ds;
    let mut waiting = Waiting::default();
    // Nodes stepped and passed in this run; begins deferred in a row.
    let mut stepped: std::collections::BTreeSet<String> = Default::default();
    let mut deferred = 0;
    loop {
        if held.is_lost() {
            code = crate::exit::ExitCode::NotDecided;
            ending = Some("the rollout lock was lost: nothing more is touched".into());
            break;
        }
        if TERMINATING.load(Ordering::SeqCst) {
            code = crate::exit::ExitCode::NotDecided;
            ending = Some("stopped by a signal: the next run goes on from the record".into());
            break;
        }
        if c.args.max_nodes.is_some_and(|m| results.len() >= m) {
            break;
        }
        // Transient failures, and a plan that refuses to go on, are waited out (the lock is
        // renewed meanwhile); only a failed step or a person stops a rollout.
        let (view, ds_now) = match c.view().await {
            Ok(v) => v,
            Err(e) if e.is_transient() => {
                waiting
                    .wait(
                        json_out,
                        format!("cannot read the cluster (retrying): {e:#}"),
                    )
                    .await;
                continue;
            }
            Err(e) => {
                code = e.exit_code();
                ending = Some(format!("cannot read the cluster: {e:#}"));
                break;
            }
        };
        ds = ds_now;
        let (st, target, resumed) = if let Some(i) = pending.take() {
            let st = resumed_step(&i);
            let target = (i.revision.clone(), i.revision_number);
            (st, target, Some(i))
        } else {
            let Some(cur) = view.revision.clone() else {
                code = crate::exit::ExitCode::NotDecided;
                ending = Some("the DaemonSet has no ControllerRevision any more".into());
                break;
            };
            if cur.0 != run_rev {
                let (approved_now, unapproved) = c.approval_now(&ds, &cur.0, &view).await;
                if record::may_adopt(&run_rev, &cur.0, approved_now.as_deref()) {
                    say(
                        json_out,
                        format!(
                            "the DaemonSet moved to approved revision {}: re-planning",
                            cur.0
                        ),
                    );
                    run_rev = cur.0.clone();
                    crate::locks::lock(&shared).forget_other_revisions(&run_rev);
                } else {
                    code = crate::exit::ExitCode::NotDecided;
                    let why = format!(
                        "revision {} of the DaemonSet is not approved ({}): the rollout pauses after node {}; approve it to go on{}",
                        cur.0,
                        unapproved,
                        results.last().map(|r| r.node.as_str()).unwrap_or("-"),
                        if watched { "" } else { ", or run `stepguard rollout` again" }
                    );
                    c.event(&ds, true, "StepguardRolloutPaused", &why).await;
                    ending = Some(why);
                    break;
                }
            }
            {
                let r = crate::locks::lock(&shared);
                opts.skip = r.skipped_on(&run_rev).into_iter().collect();
                opts.again = r.retry.clone();
            }
            opts.max_nodes = None;
            match plan::plan(&view, &opts) {
                Ok(steps) => match steps.into_iter().next() {
                    Some(s)
                        if stepped.contains(&s.node)
                            && opts.again.as_deref() != Some(s.node.as_str())
                            && view
                                .pods
                                .iter()
                                .any(|p| p.node == s.node && p.revision == cur.0) =>
                    {
                        // Stepped and passed in this run, yet its agent does not vouch for the
                        // pod's start: never stepped round and round.
                        code = crate::exit::ExitCode::NotDecided;
                        let why = format!(
                            "node {} was stepped in this run and its verdict passed, but its agent does not prove the current pod's start ({}): stopping instead of stepping it again",
                            s.node, s.why
                        );
                        c.event(&ds, true, "StepguardRolloutStopped", &why).await;
                        ending = Some(why);
                        break;
                    }
                    Some(s) => (s, cur, None),
                    None => break,
                },
                Err(refusals) if refusals.iter().any(|r| r.halts()) => {
                    code = crate::exit::ExitCode::Failed;
                    let text = refusals
                        .iter()
                        .filter(|r| r.halts())
                        .map(|r| r.to_string())
                        .collect::<Vec<_>>()
                        .join("; ");
                    c.event(&ds, true, "StepguardRolloutHalted", &text).await;
                    ending = Some(text);
                    break;
                }
                Err(refusals) => {
                    let note = format!(
                        "waiting: the plan refuses to go on:\n{}",
                        refusals_text(&refusals)
                    );
                    waiting.wait(json_out, note).await;
                    continue;
                }
            }
        };
        waiting = Waiting::default();
        if !results.is_empty() && !st.pause_before.is_zero() {
            say(
                json_out,
                format!(
                    "pausing {}s before {} ({})",
                    st.pause_before.as_secs(),
                    st.node,
                    st.why
                ),
            );
            tokio::time::sleep(st.pause_before).await;
        }
        let cx = StepCx {
            c,
            ds: &ds,
            held: &held,
            shared: &shared,
            run_id: &run_id,
            n: results.len() + 1,
            json_out,
        };
        let r = step_node(&cx, &view, &st, target.clone(), resumed).await;
        if let Outcome::Deferred { why } = &r.outcome {
            // Nothing was deleted: the node is planned again from what its agent says.
            say(json_out, format!("{}: {why}; re-planning", st.node));
            crate::locks::lock(&shared).inflight = None;
            persist(c, &shared, &held).await;
            deferred += 1;
            if deferred > 20 {
                code = crate::exit::ExitCode::NotDecided;
                ending = Some(format!("node {} could not be begun: {why}", st.node));
                break;
            }
            continue;
        }
        deferred = 0;
        let stop = !matches!(r.outcome, Outcome::Passed { .. });
        if !stop {
            stepped.insert(st.node.clone());
        }
        {
            let mut rec = crate::locks::lock(&shared);
            match &r.outcome {
                Outcome::Passed { .. } => {
                    rec.inflight = None;
                    if rec.retry.as_deref() == Some(st.node.as_str()) {
                        rec.retry = None;
                    }
                }
                Outcome::Failed { step, why } => {
                    code = crate::exit::ExitCode::Failed;
                    rec.inflight = None;
                    rec.retry = None;
                    rec.halt = Some(record::Halt {
                        node: st.node.clone(),
                        step: step.clone(),
                        revision: target.0.clone(),
                        reason: why.clone(),
                        at: stamp(),
                    });
                }
                Outcome::Stopped { .. } => code = crate::exit::ExitCode::NotDecided,
                Outcome::Deferred { .. } => {}
            }
        }
        if let Outcome::Failed { .. } = &r.outcome {
            // The halt is on the lock before anything else happens (release may not get
            // through; a later run must see it).
            persist(c, &shared, &held).await;
            let h = crate::locks::lock(&shared).halt.clone();
            if let Some(h) = h {
                c.event(&ds, true, "StepguardRolloutHalted", &record::halt_text(&h))
                    .await;
            }
        } else if !stop {
            persist(c, &shared, &held).await;
        }
        results.push(r);
        if stop {
            break;
        }
    }
    let summary = match code {
        crate::exit::ExitCode::Ok => format!(
            "stepguard rollout finished: {} nodes stepped and verified",
            stepped.len()
        ),
        crate::exit::ExitCode::Failed => match (&ending, results.last()) {
            (Some(e), _) => format!(
                "stepguard rollout halted: {e}; no further node is touched until a person decides"
            ),
            (None, last) => format!(
                "stepguard rollout halted: the step on {} failed; no further node is touched until a person decides (`--retry`, `--skip`, `--abort`)",
                last.map(|r| r.node.as_str()).unwrap_or("?")
            ),
        },
        crate::exit::ExitCode::NotDecided => format!(
            "stepguard rollout interrupted: {}",
            ending
                .clone()
                .unwrap_or_else(|| "the lock was lost".into())
        ),
    };
    c.event(
        &ds,
        code != crate::exit::ExitCode::Ok,
        if code == crate::exit::ExitCode::Ok {
            "StepguardRolloutDone"
        } else {
            "StepguardRolloutStopped"
        },
        &summary,
    )
    .await;
    // The rollout's end is on the record too; then the lock is given up.
    renewer.abort();
    *crate::locks::lock(&c.told) = None;
    let rec = crate::locks::lock(&shared).clone();
    if !held.is_lost() {
        release(c, &rec).await;
    }
    print_end(json_out, code, &summary, t0.elapsed(), &results, &rec)?;
    Ok(code)
}

#[cfg(test)]
mod tests;
