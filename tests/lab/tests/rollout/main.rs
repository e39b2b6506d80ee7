//! `stepguard rollout` end to end: a real kube-apiserver and controllers (built from their
//! modules), the lab kubelet playing a node's part for the DaemonSet's pods (a deleted pod
//! Terminating for its grace period, the replacement Pending and unbound, then bound, then
//! Ready once the matching node of a three-node LAN lab restarted), real stepguard agents on the
//! lab nodes, and the stepper as a process in the LAN client namespace (`env.rs` builds it).
//! Each test is one promise: the stepper never walks past a node whose verdict it did not read
//! as passed.
mod batches;
#[path = "../common/mod.rs"]
mod common;
mod env;
mod halts;
mod interrupted;
mod lock;
mod plan;
mod proof;
mod revisions;
#[path = "../common/stepping.rs"]
mod stepping;
use common::cluster::*;
use common::webhook;
use common::*;
use env::*;
use k8s_openapi::api::apps::v1::{ControllerRevision, DaemonSet};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Pod};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use stepguard_lab::kube::chart::CiliumChart;
use stepguard_lab::kube::kubelet::Moment;
use stepguard_lab::kube::Kube;
use stepping::{node_name, short_leases, watch_args, Hooks, Stepped};

/// Once the interrupted run's lock expired (3 s), the next run finishes the interrupted node
/// first, then the others: every node stepped once since `from_del`, every verdict read.
fn the_next_run_finishes(
    e: &Env,
    interrupted: &str,
    from_del: usize,
    from_ev: &BTreeSet<String>,
    rev: &str,
    case: &str,
) {
    std::thread::sleep(Duration::from_millis(3500));
    let (code, out) = rollout(e, &[]);
    assert_eq!(code, 0, "{case}: {out}");
    assert!(
        out.contains(&format!(
            "resuming the rollout interrupted at node {interrupted}"
        )),
        "{case}: {out}"
    );
    let first = out
        .lines()
        .find(|l| l.starts_with("[ 1]"))
        .unwrap_or_default()
        .to_string();
    assert!(
        first.contains(interrupted),
        "{case}: the interrupted node comes first: {out}"
    );
    each_node_once_every_verdict_read(e, from_del, from_ev, rev, &format!("{case}: {out}"));
}

/// The admission webhook that can hold the stepper's StepguardStepBegun Event (the moment
/// right before its delete), registered with the API server.
fn begun_webhook(e: &Env) -> webhook::Webhook {
    let hook = webhook::Webhook::start(&e.run_dir);
    e.k.create(
        &e.k.all::<k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration>(),
        hook.configuration("StepguardStepBegun"),
    )
    .expect("the webhook configuration");
    hook
}

/// Waits (bounded) for a background stepper to exit; its exit code.
fn exit_code(s: &mut Stepper, limit: Duration) -> i32 {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            return st.code().unwrap_or(-1);
        }
        assert!(
            Instant::now() < deadline,
            "the stepper ends within {limit:?}: {}",
            s.output()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Deletes a kube-system pod as a person would (its grace period).
fn delete_pod(e: &Env, name: &str) {
    e.k.block(
        e.k.ns::<Pod>(KS)
            .delete(name, &kube::api::DeleteParams::default()),
    )
    .unwrap_or_else(|err| panic!("delete pod {name}: {err}"));
}

/// The lock holder's identity, if any.
fn lock_holder(e: &Env) -> String {
    lock(e)
        .and_then(|l| l["spec"]["holderIdentity"].as_str().map(String::from))
        .unwrap_or_default()
}

fn signal(s: &Stepper, sig: i32) {
    assert_eq!(
        unsafe { libc::kill(s.child.id() as i32, sig) },
        0,
        "signal the stepper"
    );
}

/// The stepper's `--status` output.
fn status(e: &Env) -> String {
    let (code, out) = rollout(e, &["--status"]);
    assert_eq!(code, 0, "{out}");
    out
}
