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
mod mirror;
mod node;
mod output;
pub mod plan;
pub mod record;
pub mod replacement;
mod run;
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
use run::rollout;
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
            // The cluster is watched from here on (a failure to list is waited out).
            while let Err(e) = c.watch_cluster().await {
                eprintln!("stepguard rollout --watch: cannot list the cluster to watch it (retrying): {e:#}");
                tokio::time::sleep(c.args.watch_interval).await;
                if TERMINATING.load(Ordering::SeqCst) {
                    return Ok(crate::exit::ExitCode::Ok);
                }
            }
            return watch(&c).await;
        }
        if !args.dry_run {
            patient("list the cluster to watch it", Duration::from_secs(60), None, || {
                c.watch_cluster()
            })
            .await?;
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
        node_selector: c
            .args
            .node_selector
            .clone()
            .map(|s| s.0)
            .unwrap_or_default(),
        partition: c.args.partition,
        domain_label: c.args.domain_label.clone(),
        per_domain: c.args.max_unavailable_per_domain,
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

#[cfg(test)]
mod tests;
