//! `stepguard rollout` end to end: a real kube-apiserver and controllers (built from their
//! modules), the lab kubelet playing a node's part for the DaemonSet's pods (a deleted pod
//! Terminating for its grace period, the replacement Pending and unbound, then bound, then
//! Ready once the matching node of a three-node LAN lab restarted), real stepguard agents on the
//! lab nodes, and the stepper as a process in the LAN client namespace (`env.rs` builds it).
//! Each test is one promise: the stepper never walks past a node whose verdict it did not read
//! as passed.
#[path = "../common/mod.rs"]
mod common;
mod env;
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
use stepguard_lab::kube::kubelet::{Kubelet, Moment};
use stepguard_lab::kube::{ControlPlane, Forward, Kube};
use stepguard_lab::lan::{LanGuard, LanLab, LanSpec, LeaseTimings};
use stepguard_lab::RestartOpts;

#[test]
fn rollouts_plan_step_verify_and_replan_on_an_approved_revision() {
    let e = env();

    // The plan, and the refusals in their documented order.
    let (code, out) = rollout(&e, &["--dry-run"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("3 of 3 nodes to step") && out.contains("moves L2 VIPs"),
        "{out}"
    );
    // What will blip, from the lab's lease timings (2 s, 1 s, 500 ms) and the chart's 1 s
    // grace: 0.5 × 2.2 s for a resolving client, 2 − 0.5 to 2 + 2 × 1.1 s when the release
    // misses.
    assert!(
        out.contains("up to 1.1s for a client resolving it meanwhile; 1.5-4.2s if the lease is not released within the 1s grace (lease 2s, retry 0.5s: kube-system/cilium-config)"),
        "{out}"
    );
    // One VIP's Service with externalTrafficPolicy Local and its only ready backend on its
    // holder: nobody may take it over (Cilium's L2 announcer: a node without a local backend is
    // no candidate), and the holder's expected blip says so; the other VIPs' stay as they were.
    let (vip, holder) = {
        let lan = e.lan.lock().unwrap();
        let (v, h) = lan.state.holders.iter().next().expect("a VIP");
        (v.clone(), node_name(*h))
    };
    let svc = e.k.ns::<k8s_openapi::api::core::v1::Service>("default");
    e.k.create(
        &svc,
        json!({"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": vip, "namespace": "default"},
               "spec": {"type": "LoadBalancer", "externalTrafficPolicy": "Local",
                        "ports": [{"port": 80, "protocol": "TCP"}]}}),
    )
    .unwrap();
    let slices =
        e.k.ns::<k8s_openapi::api::discovery::v1::EndpointSlice>("default");
    e.k.create(
        &slices,
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
               "metadata": {"name": format!("{vip}-1"), "namespace": "default",
                            "labels": {"kubernetes.io/service-name": vip}},
               "addressType": "IPv4",
               "endpoints": [{"addresses": ["192.0.2.80"], "nodeName": holder,
                              "conditions": {"ready": true}},
                             {"addresses": ["192.0.2.81"], "nodeName": "node-elsewhere",
                              "conditions": {"ready": false}}],
               "ports": [{"port": 80, "protocol": "TCP"}]}),
    )
    .unwrap();
    let (code, out) = rollout(&e, &["--dry-run"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains(&format!("default-{vip}: externalTrafficPolicy Local with no ready backend on another node, so nobody takes the lease over")),
        "{out}"
    );
    assert_eq!(
        out.matches("externalTrafficPolicy Local").count(),
        1,
        "only {vip}'s holder: {out}"
    );
    // node-2's agent gone (its replacement never started), node-1 NotReady, and the
    // DaemonSet's status stale (the controller frozen across a template change).
    kubelet_state(&e)
        .hold
        .insert(("stepguard".into(), node_name(2)));
    let lp = kube::api::ListParams::default().labels("app.kubernetes.io/name=stepguard");
    let agent2 =
        e.k.block(e.k.ns::<Pod>("stepguard").list(&lp))
            .unwrap()
            .items
            .into_iter()
            .find(|p| p.spec.as_ref().unwrap().node_name.as_deref() == Some("node-2"))
            .expect("node-2's agent pod");
    e.k.block(e.k.ns::<Pod>("stepguard").delete(
        &agent2.metadata.name.unwrap(),
        &kube::api::DeleteParams::default(),
    ))
    .unwrap();
    wait_until(
        "node-2's agent gone",
        Duration::from_secs(30),
        || agents_running(&e) == 2,
        String::new,
    );
    stepguard_lab::kube::set_node_ready(
        &e.k,
        "node-1",
        &stepguard_lab::lan::node_addr(1).to_string(),
        false,
    )
    .unwrap();
    e.cp.lock()
        .unwrap()
        .pause("kube-controller-manager")
        .unwrap();
    e.k.merge(
        &e.k.ns::<DaemonSet>(KS),
        "cilium",
        json!({"spec": {"template": {"metadata": {"annotations": {"stepguard.test/stale": "1"}}}}}),
        false,
    )
    .unwrap();
    let (code, out) = rollout(&e, &["--dry-run"]);
    e.cp.lock()
        .unwrap()
        .resume("kube-controller-manager")
        .unwrap();
    assert_eq!(code, 2, "{out}");
    let (a, b, c) = (
        out.find("status is stale").expect(&out),
        out.find("node node-1 is NotReady").expect(&out),
        out.find("no stepguard agent on node node-2").expect(&out),
    );
    assert!(a < b && b < c, "refusals in order: {out}");
    stepguard_lab::kube::set_node_ready(
        &e.k,
        "node-1",
        &stepguard_lab::lan::node_addr(1).to_string(),
        true,
    )
    .unwrap();
    kubelet_state(&e).hold.clear();
    wait_until(
        "the controller caught up and node-2's agent is back",
        Duration::from_secs(30),
        || observed(&e.k) && agents_running(&e) == 3,
        String::new,
    );
    let target = current_revision(&e.k).0;

    // A three-node rollout passes: each node stepped once, verified, the lock released.
    let ev = events(&e);
    let (code, out) = rollout(&e, &[]);
    assert_eq!(code, 0, "{out}");
    each_node_once_every_verdict_read(&e, 0, &ev, &target, &out);
    assert!(out.contains("3 nodes stepped and verified"), "{out}");
    assert_eq!(
        lock(&e).map(|l| l["spec"]["holderIdentity"]
            .as_str()
            .unwrap_or("")
            .to_string()),
        Some(String::new()),
        "the lock is released, its history kept: {:?}",
        lock(&e)
    );

    // An approved revision change mid-rollout: the node already stepped to the superseded
    // revision is stepped again.
    eprintln!("test: the second rollout, a revision approved mid-way");
    let from = deletions(&e).len();
    let old = target;
    let old_n = *e.bumped.lock().unwrap();
    let superseded = bump(&e, false);
    e.bumps.lock().unwrap().push(Bump {
        deletion: from + 1,
        at: Moment::Replaced,
        approve: true,
    }); // approved while the first replacement waits (long before its verdict is read)
    let (code, out) = rollout(&e, &[]);
    assert_eq!(code, 0, "{out}");
    let newest = current_revision(&e.k).0;
    assert_ne!(newest, superseded);
    assert!(
        out.contains(&format!("moved to approved revision {newest}")),
        "{out}"
    );
    let d = deletions_since(&e, from);
    assert_eq!(d.len(), 4, "{d:?}\n{out}");
    assert_eq!(
        counts(&d)[&d[0]],
        2,
        "the first node is stepped again: {d:?}"
    );
    assert!(all_on(&e, &newest));

    eprintln!("test: a rollback");
    // A rollback: the template as it was two revisions ago. The controller reuses that
    // ControllerRevision and renumbers it; the stepper steps every node back to it.
    let before = current_revision(&e.k).1;
    let back = set_template(&e.k, old_n, true);
    assert_eq!(back, old, "the controller reuses the old revision's hash");
    assert!(
        current_revision(&e.k).1 > before,
        "renumbered: {:?}",
        current_revision(&e.k)
    );
    let (from, ev) = (deletions(&e).len(), events(&e));
    let (code, out) = rollout(&e, &[]);
    assert_eq!(code, 0, "{out}");
    each_node_once_every_verdict_read(&e, from, &ev, &old, &out);
    assert_rbac_sufficed(&e);
}

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

/// Where the stepper is killed.
#[derive(Clone, Copy, Debug)]
enum KillAt {
    /// The step begun on the agent and recorded; the pod not deleted yet (the stepper's
    /// StepguardStepBegun Event held by a slow admission webhook).
    BeforeDelete,
    /// The old pod Terminating (its grace period), no replacement yet.
    Terminating,
    /// The replacement Pending, unbound (the scheduler frozen).
    Pending,
    /// The replacement Ready, its verdict not read.
    ReadyBeforeVerdict,
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

#[test]
fn a_stepper_killed_in_any_phase_finishes_that_node_first_and_steps_none_twice() {
    let e = env();
    let hook = begun_webhook(&e);
    for at in [
        KillAt::BeforeDelete,
        KillAt::Terminating,
        KillAt::Pending,
        KillAt::ReadyBeforeVerdict,
    ] {
        let rev = bump(&e, false);
        let (from_del, from_ev) = (deletions(&e).len(), events(&e));
        match at {
            KillAt::BeforeDelete => {
                hook.hold.lock().unwrap().next =
                    Some(("StepguardStepBegun".into(), Duration::from_secs(5)))
            }
            KillAt::Pending => e.cp.lock().unwrap().pause("kube-scheduler").unwrap(),
            KillAt::Terminating | KillAt::ReadyBeforeVerdict => {}
        }
        let mut s = Stepper::spawn(&e, &format!("kill-{at:?}"), &[]);
        let in_flight = || lock_annotation(&e, "stepguard.io/node");
        wait_until(
            &format!("{at:?}: the stepper reaches the phase"),
            Duration::from_secs(60),
            || {
                let Some(node) = in_flight() else {
                    return false;
                };
                let deleted = deletions(&e).len() > from_del;
                let pods = cilium_pods(&e);
                let old_terminating = pods.values().any(|p| p.0 == node && p.3);
                let fresh: Vec<(&String, bool)> = pods
                    .iter()
                    .filter(|(_, p)| p.0 == node && !p.3 && p.1 == rev)
                    .map(|(n, p)| (n, p.2))
                    .collect();
                match at {
                    KillAt::BeforeDelete => hook.hold.lock().unwrap().holding && !deleted,
                    KillAt::Terminating => deleted && old_terminating && fresh.is_empty(),
                    KillAt::Pending => fresh.iter().any(|(n, _)| !bound(&e, n)),
                    KillAt::ReadyBeforeVerdict => fresh.iter().any(|(_, ready)| *ready),
                }
            },
            || s.output(),
        );
        s.kill9();
        // Killed in the phase: nothing moved past it before the kill landed.
        match at {
            KillAt::BeforeDelete => {
                assert_eq!(deletions(&e).len(), from_del, "killed before the delete")
            }
            _ => assert_eq!(deletions(&e).len(), from_del + 1, "{at:?}: one pod deleted"),
        }
        assert!(
            event_nodes(&e, &from_ev, "StepguardStepPassed").is_empty(),
            "{at:?}: killed before the verdict was read"
        );
        if let KillAt::Pending = at {
            e.cp.lock().unwrap().resume("kube-scheduler").unwrap();
        }
        let killed_at = in_flight().expect("the lock records the step in flight");
        the_next_run_finishes(&e, &killed_at, from_del, &from_ev, &rev, &format!("{at:?}"));
    }
    assert_eq!(
        hook.hold.lock().unwrap().held,
        1,
        "the webhook held one Event"
    );
    assert_rbac_sufficed(&e);
}

#[test]
fn a_failed_step_halts_every_later_run_until_a_person_lifts_it() {
    let e = env();
    // A fault on the second node (its endpoint map comes back empty): the rollout halts there,
    // exit 1, and the third node is untouched.
    let from = deletions(&e).len();
    *e.fault_at.lock().unwrap() = Some(from + 2);
    let (code, out) = rollout(&e, &[]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("map_emptied"), "{out}");
    let d = deletions_since(&e, from);
    assert_eq!(d.len(), 2, "halted at the second node: {d:?}\n{out}");
    let failed = d[1].clone();
    let halt = lock_annotation(&e, "stepguard.io/halt").expect("the halt is on the lock");
    assert!(
        halt.contains(&failed) && halt.contains("map_emptied"),
        "{halt}"
    );
    assert!(reasons_since(&e, &BTreeSet::new())
        .iter()
        .any(|r| r == "StepguardRolloutHalted"));

    // The next run refuses, and so does --dry-run, naming the halt and how to lift it.
    let (code, out) = rollout(&e, &[]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("halted") && out.contains(&format!("--retry {failed}")),
        "{out}"
    );
    let (code, out) = rollout(&e, &["--dry-run"]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("halted") && out.contains(&failed), "{out}");
    assert_eq!(deletions_since(&e, from).len(), 2, "nothing stepped");

    // `--watch` on an approved revision does not step either while the halt stands.
    approve_revision(&e.k, &current_revision(&e.k).0);
    let mut watch = Stepper::watch(&e, "watch-halted");
    std::thread::sleep(Duration::from_secs(4));
    assert!(watch.running(), "{}", watch.output());
    assert_eq!(
        deletions_since(&e, from).len(),
        2,
        "the watch steps nothing while halted: {}",
        watch.output()
    );
    assert!(watch.output().contains("halted"), "{}", watch.output());

    // Only the failed node's halt can be lifted, with a reason; the decision is recorded.
    let other = (0..3).map(node_name).find(|n| *n != failed).unwrap();
    let (code, out) = rollout(&e, &["--retry", &other, "--reason", "wrong node"]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains(&format!("the halt is at node {failed}")),
        "{out}"
    );
    let (code, out) = rollout(&e, &["--retry", &failed]);
    assert_ne!(code, 0, "a decision needs a reason: {out}");
    let ev = events(&e);
    let (code, out) = rollout(
        &e,
        &["--retry", &failed, "--reason", "flushed by hand, fixed"],
    );
    assert_eq!(code, 0, "{out}");
    let decisions = lock_annotation(&e, "stepguard.io/decisions").unwrap_or_default();
    assert!(
        decisions.contains(&stepguard_lab::kube::stepper_user())
            && decisions.contains("flushed by hand, fixed"),
        "who and why: {decisions}"
    );
    assert!(reasons_since(&e, &ev)
        .iter()
        .any(|r| r == "StepguardHaltLifted"));

    // The watch goes on: the failed node stepped again first, then the third.
    wait_until(
        "the watch finishes the rollout after the retry",
        Duration::from_secs(90),
        || deletions_since(&e, from).len() >= 4 && all_on(&e, &current_revision(&e.k).0),
        || watch.output(),
    );
    let d = deletions_since(&e, from);
    assert_eq!(d[2], failed, "the retried node first: {d:?}");
    assert_eq!(counts(&d)[&failed], 2, "{d:?}");
    wait_until(
        "the watch's rollout ends (lock released)",
        Duration::from_secs(60),
        || {
            lock(&e).is_some_and(|l| {
                l["spec"]["holderIdentity"]
                    .as_str()
                    .unwrap_or("")
                    .is_empty()
            })
        },
        || watch.output(),
    );
    assert!(
        event_nodes(&e, &ev, "StepguardStepPassed").contains(&failed),
        "the retried step's verdict read: {}",
        watch.output()
    );
    watch.kill9();

    // `--skip`: a halt on a new revision lifted by leaving the node as it is.
    let from = deletions(&e).len();
    bump(&e, true);
    // The fault on the run's second node: the first is the node emptied above, whose map the
    // lab leaves empty (it does not regenerate endpoints), so emptying it again changes nothing.
    let emptied = failed;
    *e.fault_at.lock().unwrap() = Some(from + 2);
    let (code, out) = rollout(&e, &[]);
    assert_eq!(code, 1, "{out}");
    let failed = deletions_since(&e, from)[1].clone();
    assert_ne!(failed, emptied, "{out}");
    let (code, out) = rollout(&e, &["--skip", &failed, "--reason", "known bad NIC"]);
    assert_eq!(code, 0, "{out}");
    let (code, out) = rollout(&e, &[]);
    assert_eq!(code, 0, "{out}");
    let d = deletions_since(&e, from);
    assert_eq!(
        counts(&d).get(&failed),
        Some(&1),
        "the skipped node is not stepped again: {d:?}"
    );
    assert_eq!(d.len(), 3, "{d:?}");
    assert_rbac_sufficed(&e);
}

#[test]
fn a_template_change_before_the_replacement_is_judged_by_the_revision_it_carries() {
    // `revisionHistoryLimit: 1`: the controller keeps only the live revisions' history.
    let e = env_with(Some(1));
    // The template changes (approved) while the first old pod is Terminating: its replacement
    // carries the newer revision, and that is a replacement, not a timeout.
    approve_revision(&e.k, &current_revision(&e.k).0);
    let (from, ev) = (deletions(&e).len(), events(&e));
    e.bumps.lock().unwrap().push(Bump {
        deletion: from + 1,
        at: Moment::Terminating,
        approve: true,
    });
    let (code, out) = rollout(&e, &["--replace-timeout", "20s"]);
    assert_eq!(code, 0, "{out}");
    let carried = current_revision(&e.k).0;
    assert!(
        out.contains(&format!("carries revision {carried}")),
        "{out}"
    );
    assert!(
        !reasons_since(&e, &ev)
            .iter()
            .any(|r| r == "StepguardStepFailed"),
        "{out}"
    );
    each_node_once_every_verdict_read(&e, from, &ev, &carried, &out);

    // Unapproved, by hand: the step is finished and its verdict read, then the run stops
    // (exit 2) instead of going on to a revision nobody approved.
    bump(&e, true);
    let (from, ev) = (deletions(&e).len(), events(&e));
    e.bumps.lock().unwrap().push(Bump {
        deletion: from + 1,
        at: Moment::Replaced,
        approve: false,
    });
    let (code, out) = rollout(&e, &["--replace-timeout", "20s"]);
    assert_eq!(code, 2, "{out}");
    let unapproved = current_revision(&e.k).0;
    assert!(
        out.contains(&format!(
            "revision {unapproved} of the DaemonSet is not approved"
        )),
        "{out}"
    );
    let d = deletions_since(&e, from);
    assert_eq!(d.len(), 1, "{d:?}\n{out}");
    assert_eq!(event_nodes(&e, &ev, "StepguardStepPassed"), d, "{out}");
    // The history the controller kept: the revisions pods run, and the newest.
    let kept =
        e.k.block(e.k.ns::<ControllerRevision>(KS).list(&Default::default()))
            .unwrap()
            .items
            .len();
    assert!(
        kept <= 3,
        "revisionHistoryLimit 1 prunes the history: {kept} revisions"
    );
    assert_rbac_sufficed(&e);
}

#[test]
fn watch_pauses_at_an_unapproved_revision_until_it_is_approved() {
    let e = env();
    approve_revision(&e.k, &current_revision(&e.k).0);
    let ev = events(&e);
    e.bumps.lock().unwrap().push(Bump {
        deletion: 1,
        at: Moment::Ready,
        approve: false,
    }); // a newer revision, not approved, as the first replacement turns Ready
    let mut watch = Stepper::watch(&e, "watch-pause");
    wait_until(
        "the watch pauses with an Event",
        Duration::from_secs(60),
        || {
            reasons_since(&e, &ev)
                .iter()
                .any(|r| r == "StepguardRolloutPaused")
        },
        || watch.output(),
    );
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(deletions(&e).len(), 1, "paused: {}", watch.output());
    assert!(watch.running());
    let newer = current_revision(&e.k).0;
    assert!(
        watch.output().contains(&newer),
        "a log line: {}",
        watch.output()
    );
    approve_revision(&e.k, &newer);
    wait_until(
        "the watch goes on once the newer revision is approved",
        Duration::from_secs(90),
        || all_on(&e, &newer),
        || watch.output(),
    );
    let d = deletions(&e);
    assert_eq!(d.len(), 4, "{d:?}");
    assert_eq!(
        counts(&d)[&d[0]],
        2,
        "the first node again, for the newer revision: {d:?}"
    );
    watch.kill9();
    assert_rbac_sufficed(&e);
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

/// A stepper (lock of `lock`) in the background; once it deleted its first pod, the API
/// server is stopped and started again `down_s` seconds later. The stepper's exit code and
/// output.
fn restart_during_a_step(e: &Env, name: &str, lock: &str, down_s: u64) -> (i32, String) {
    let from = deletions(e).len();
    let mut s = Stepper::spawn(e, name, &["--lock-duration", lock]);
    wait_until(
        "the first pod deleted",
        Duration::from_secs(60),
        || deletions(e).len() > from,
        || s.output(),
    );
    e.cp.lock()
        .unwrap()
        .restart_apiserver(Duration::from_secs(down_s))
        .expect("restart the API server");
    let code = exit_code(&mut s, Duration::from_secs(120));
    (code, s.output())
}

#[test]
fn an_api_server_restart_mid_rollout_is_waited_out_or_stops_on_a_lost_lock() {
    let e = env();
    let target = current_revision(&e.k).0;
    // The API server goes away for 2 s (stopped, refused connections, started again on the
    // same etcd: an apiserver upgrade as clients see it) while the first node is stepped;
    // the lock (60 s) outlasts it, so the stepper waits it out. (Until its authorization
    // caches are filled a restarted API server refuses what RBAC allows: on a loaded machine
    // that took over 13 s, longer than a 20 s lock tolerates.)
    let (code, out) = restart_during_a_step(&e, "apiserver-restart", "60s", 2);
    assert_eq!(code, 0, "{out}");
    assert!(
        kubelet_state(&e).errors > 0,
        "the API server was away for the kubelet too"
    );
    each_node_once_every_verdict_read(&e, 0, &BTreeSet::new(), &target, &out);

    // Away longer than a short lock can be held without renewal: the stepper stops at once,
    // touching nothing more (exit 2), and the next run finishes the interrupted node first.
    let rev = bump(&e, false);
    let (from, ev) = (deletions(&e).len(), events(&e));
    let (code, out) = restart_during_a_step(&e, "lock-lost", "3s", 4);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("the rollout lock was lost"), "{out}");
    assert_eq!(
        deletions_since(&e, from).len(),
        1,
        "nothing more touched: {out}"
    );
    let interrupted = deletions_since(&e, from)[0].clone();
    the_next_run_finishes(&e, &interrupted, from, &ev, &rev, "lock lost");
    assert_rbac_sufficed(&e);
}

#[test]
fn a_replacement_that_never_turns_ready_halts_the_rollout_there() {
    let e = env();
    // The lab kubelet's faults: every replacement stays not Ready (a new agent that never
    // passes its readiness probe); and one node's cilium pod crash-loops.
    let from = deletions(&e).len();
    {
        let mut st = kubelet_state(&e);
        st.never_ready.extend((0..3).map(node_name));
    }
    let (code, out) = rollout(&e, &["--replace-timeout", "5s"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("no Ready cilium pod"), "{out}");
    let d = deletions_since(&e, from);
    assert_eq!(d.len(), 1, "halted at the first node: {d:?}\n{out}");
    let halt = lock_annotation(&e, "stepguard.io/halt").expect("the halt is on the lock");
    assert!(halt.contains(&d[0]), "{halt}");
    // The replacement exists, Running and not Ready, on the revision the step asked for.
    let pods = cilium_pods(&e);
    let rev = current_revision(&e.k).0;
    assert!(
        pods.values()
            .any(|p| p.0 == d[0] && p.1 == rev && !p.2 && !p.3),
        "{pods:?}"
    );

    // A crash-looping cilium pod: not Ready, its container waiting in CrashLoopBackOff with
    // a climbing restart count, as the kubelet reports one.
    let other = (0..3).map(node_name).find(|n| *n != d[0]).unwrap();
    kubelet_state(&e).crash_loop.insert(other.clone());
    let crash = || {
        let lp = kube::api::ListParams::default().labels("k8s-app=cilium");
        e.k.block(e.k.ns::<Pod>(KS).list(&lp))
            .unwrap()
            .items
            .into_iter()
            .find(|p| {
                stepguard_lab::kube::kubelet::target_node(p).as_deref() == Some(other.as_str())
            })
            .and_then(|p| p.status?.container_statuses?.into_iter().next())
    };
    wait_until(
        "the crash loop shows",
        Duration::from_secs(10),
        || {
            crash().is_some_and(|c| {
                !c.ready
                    && c.restart_count >= 2
                    && c.state
                        .and_then(|s| s.waiting)
                        .and_then(|w| w.reason)
                        .as_deref()
                        == Some("CrashLoopBackOff")
            })
        },
        || format!("{:?}", crash()),
    );
    assert_rbac_sufficed(&e);
}

/// Deletes a kube-system pod as a person would (its grace period).
fn delete_pod(e: &Env, name: &str) {
    e.k.block(
        e.k.ns::<Pod>(KS)
            .delete(name, &kube::api::DeleteParams::default()),
    )
    .unwrap_or_else(|err| panic!("delete pod {name}: {err}"));
}

/// The DaemonSet's status as its controller last wrote it.
fn ds_status(e: &Env) -> k8s_openapi::api::apps::v1::DaemonSetStatus {
    e.k.block(e.k.ns::<DaemonSet>(KS).get("cilium"))
        .unwrap()
        .status
        .unwrap_or_default()
}

/// A pod the DaemonSet's selector matches but another controller owns (a ConfigMap stands in
/// for it: the garbage collector keeps a pod whose owner exists), bound to `node`.
fn foreign_pod(e: &Env, node: &str) -> String {
    let cm =
        e.k.create(
            &e.k.ns::<k8s_openapi::api::core::v1::ConfigMap>(KS),
            json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": "foreign-owner", "namespace": KS}}),
        )
        .expect("the foreign pod's owner");
    let name = "cilium-foreign".to_string();
    e.k.create(
        &e.k.ns::<Pod>(KS),
        json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": KS,
               "labels": {"k8s-app": "cilium", "controller-revision-hash": "foreign"},
               "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "foreign-owner",
                                    "uid": cm.metadata.uid.unwrap(), "controller": true}]},
           "spec": {"nodeName": node, "hostNetwork": true, "terminationGracePeriodSeconds": 1,
                    "containers": [{"name": "cilium-agent", "image": CILIUM_IMAGE}],
                    "tolerations": [{"operator": "Exists"}]}}),
    )
    .expect("the foreign pod");
    name
}

#[test]
fn an_unhealthy_cluster_is_refused_with_every_reason_in_the_documented_order() {
    let e = env();
    let kubelet = e.kubelet.as_ref().unwrap();
    // A pod the selector matches that the DaemonSet does not own is never planned.
    let foreign = foreign_pod(&e, &node_name(0));
    let (code, out) = rollout(&e, &["--dry-run"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("3 of 3 nodes to step")
            && out.contains(&format!(
                "pod {foreign} matches the DaemonSet's selector but is not its own"
            )),
        "{out}"
    );

    // Another node's cilium pod crash-looping, the operator not Ready, a cilium pod Pending
    // and unbound (the scheduler frozen when node-2's pod was deleted), so the controller
    // counts pods unavailable.
    kubelet
        .state
        .lock()
        .unwrap()
        .crash_loop
        .insert(node_name(1));
    kubelet
        .state
        .lock()
        .unwrap()
        .unready
        .insert("cilium-operator".into());
    e.cp.lock().unwrap().pause("kube-scheduler").unwrap();
    let old2 = cilium_pods(&e)
        .into_iter()
        .find(|(n, p)| p.0 == node_name(2) && *n != foreign)
        .map(|(n, _)| n)
        .unwrap();
    delete_pod(&e, &old2);
    wait_until(
        "the faults show in the cluster's status",
        Duration::from_secs(60),
        || {
            let unbound = cilium_pods(&e)
                .iter()
                .any(|(n, p)| p.0 == node_name(2) && !p.3 && !bound(&e, n));
            unbound && ds_status(&e).number_unavailable.unwrap_or(0) >= 2 && operator_ready(&e) == 0
        },
        || format!("{:?} {:?}", cilium_pods(&e), ds_status(&e)),
    );
    // Then, with the controller frozen: RollingUpdate, and an image two minors ahead.
    e.cp.lock()
        .unwrap()
        .pause("kube-controller-manager")
        .unwrap();
    let skip_image = CILIUM_IMAGE.replace("v1.18.2", "v1.20.1");
    e.k.merge(
        &e.k.ns::<DaemonSet>(KS),
        "cilium",
        json!({"spec": {"updateStrategy": {"type": "RollingUpdate"},
                        "template": {"spec": {"containers": [{"name": "cilium-agent", "image": skip_image}]}}}}),
        false,
    )
    .unwrap();
    let (code, out) = rollout(&e, &["--dry-run"]);
    let (code_run, out_run) = rollout(&e, &[]);
    let (_, out_allowed) = rollout(&e, &["--dry-run", "--allow-minor-skip"]);
    e.k.merge(
        &e.k.ns::<DaemonSet>(KS),
        "cilium",
        json!({"spec": {"updateStrategy": {"type": "OnDelete"},
                        "template": {"spec": {"containers": [{"name": "cilium-agent", "image": CILIUM_IMAGE}]}}}}),
        false,
    )
    .unwrap();
    e.cp.lock()
        .unwrap()
        .resume("kube-controller-manager")
        .unwrap();
    e.cp.lock().unwrap().resume("kube-scheduler").unwrap();
    assert_eq!(code, 2, "{out}");
    let order = [
        "updateStrategy is RollingUpdate",
        "status is stale",
        "Cilium 1.20 is more than one minor version from 1.18",
        &format!(
            "on node {} is crash-looping (CrashLoopBackOff",
            node_name(1)
        ),
        &format!(
            "(for node {}) is Pending, not bound to a node",
            node_name(2)
        ),
        "unavailable pods (status.numberUnavailable)",
        "cilium-operator kube-system/cilium-operator is not Ready: 0 of 2 replicas Ready",
    ];
    let at: Vec<usize> = order
        .iter()
        .map(|s| out.find(s).unwrap_or_else(|| panic!("{s:?} in:\n{out}")))
        .collect();
    assert!(at.windows(2).all(|w| w[0] < w[1]), "in order: {out}");
    assert_eq!(code_run, 2, "{out_run}");
    assert!(out_run.contains("refusing to start"), "{out_run}");
    assert!(
        !out_allowed.contains("more than one minor version")
            && out_allowed.contains("crash-looping"),
        "--allow-minor-skip lifts that refusal alone: {out_allowed}"
    );

    // Healthy again: the plan goes.
    {
        let mut st = kubelet.state.lock().unwrap();
        st.crash_loop.clear();
        st.unready.clear();
    }
    delete_pod(&e, &foreign);
    // The lab kubelet restarts node-0's agent for that deletion (a pod with Cilium's labels):
    // healthy means after that restart, not in the moment before the kubelet reacts to it.
    // The controller may delete pods too: resumed with two template updates queued (to
    // RollingUpdate and the skipped minor, then back), it can sync between them and start a
    // rolling update of the unhealthy pods (seen in a run: deletions node-2, node-0, node-2,
    // node-1). Who deleted what is the audit log's to say (below), not the kubelet's count.
    wait_until(
        "healthy again",
        Duration::from_secs(60),
        || {
            let settled = {
                let st = kubelet_state(&e);
                st.deletions.len() >= 2 && st.settled()
            };
            settled
                && observed(&e.k)
                && operator_ready(&e) == 2
                && ds_status(&e).number_unavailable.unwrap_or(0) == 0
                && cilium_pods(&e).values().filter(|p| p.2 && !p.3).count() == 3
        },
        // Each condition, so a failure says which one (this wait timed out once in a
        // fresh-clone CI run with every cilium pod Ready).
        || {
            let (deleted, settled) = {
                let st = kubelet_state(&e);
                (st.deletions.clone(), st.settled())
            };
            format!(
                "kubelet deletions {deleted:?} (want at least 2), settled {settled}, observed {}, operator ready {} (want 2)\n{:?} {:?}",
                observed(&e.k),
                operator_ready(&e),
                cilium_pods(&e),
                ds_status(&e)
            )
        },
    );
    let (code, out) = rollout(&e, &["--dry-run"]);
    assert_eq!(code, 0, "{out}");
    // Nothing was stepped while refused: the stepper deleted no pod (the audit log).
    let deletes: Vec<String> =
        e.cp.lock()
            .unwrap()
            .stepper_requests()
            .expect("the audit log")
            .iter()
            .filter(|r| r["verb"] == "delete")
            .map(|r| r["requestURI"].to_string())
            .collect();
    assert!(
        deletes.is_empty(),
        "the stepper deleted {deletes:?} (kubelet deletions: {:?})",
        deletions(&e)
    );
    assert_rbac_sufficed(&e);
}

/// A stepper in the background, once it holds the lock and deleted a pod (deletions past
/// `from`).
fn stepping(e: &Env, name: &str, extra: &[&str], from: usize) -> Stepper {
    let s = Stepper::spawn(e, name, extra);
    wait_until(
        "the stepper holds the lock and deleted its first pod",
        Duration::from_secs(60),
        || !lock_holder(e).is_empty() && deletions(e).len() > from,
        || s.output(),
    );
    s
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

/// The shared library that shifts a process's clock (Debian's faketime package).
const FAKETIME_LIB: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1";

#[test]
fn the_lock_outlives_a_paused_api_server_only_within_its_renew_deadline() {
    let e = env();
    eprintln!("test: the API server paused (SIGSTOP) across renewals, within the renew deadline");
    // A 9 s lock: renewed every 1.2 s, lost after 6 s without a renewal. Paused 2 s.
    let target = current_revision(&e.k).0;
    let (from, ev) = (deletions(&e).len(), events(&e));
    let mut s = stepping(&e, "apiserver-paused", &["--lock-duration", "9s"], from);
    e.cp.lock().unwrap().pause("kube-apiserver").unwrap();
    std::thread::sleep(Duration::from_secs(2));
    e.cp.lock().unwrap().resume("kube-apiserver").unwrap();
    let code = exit_code(&mut s, Duration::from_secs(120));
    assert_eq!(code, 0, "{}", s.output());
    each_node_once_every_verdict_read(&e, from, &ev, &target, &s.output());

    eprintln!("test: the API server paused beyond the renew deadline");
    // A 3 s lock: lost 2 s after the last renewal. Paused 5 s: the stepper gives the lock up
    // while the API server is away and touches nothing once it is back.
    let rev = bump(&e, false);
    let (from, ev) = (deletions(&e).len(), events(&e));
    let mut s = stepping(&e, "apiserver-paused-long", &[], from);
    e.cp.lock().unwrap().pause("kube-apiserver").unwrap();
    std::thread::sleep(Duration::from_secs(5));
    let gone_while_paused = s.running();
    e.cp.lock().unwrap().resume("kube-apiserver").unwrap();
    let code = exit_code(&mut s, Duration::from_secs(60));
    assert_eq!(code, 2, "{}", s.output());
    assert!(
        s.output().contains("the rollout lock was lost"),
        "{}",
        s.output()
    );
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        deletions_since(&e, from).len(),
        1,
        "nothing more touched (still running when the API server came back: {gone_while_paused}): {}",
        s.output()
    );
    let interrupted = deletions_since(&e, from)[0].clone();
    the_next_run_finishes(&e, &interrupted, from, &ev, &rev, "API server paused");
    assert_rbac_sufficed(&e);
}

#[test]
fn a_second_stepper_with_a_skewed_clock_does_not_take_a_live_lock() {
    let e = env();
    eprintln!("test: a second stepper whose clock is ten minutes ahead");
    // Judged by the holder's renewTime against its own clock, the lock would look expired to
    // it; observed as client-go does (a record that changes is alive) it is not.
    let rev = bump(&e, false);
    let (from, ev) = (deletions(&e).len(), events(&e));
    let mut a = stepping(&e, "holder", &[], from);
    let mut cmd = rollout_cmd(&e, &[]);
    cmd.env("LD_PRELOAD", FAKETIME_LIB)
        .env("FAKETIME", "+10m")
        .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
    let out = cmd.output().expect("the skewed stepper");
    let skewed =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{skewed}");
    assert!(
        skewed.contains("another rollout holds the lock"),
        "{skewed}"
    );
    let code = exit_code(&mut a, Duration::from_secs(120));
    assert_eq!(
        code,
        0,
        "the holder was not disturbed: {}\n{skewed}",
        a.output()
    );
    each_node_once_every_verdict_read(&e, from, &ev, &rev, &a.output());
    assert_rbac_sufficed(&e);
}

#[test]
fn a_stepper_paused_before_its_delete_finds_its_lock_taken_over_and_stops() {
    let e = env();
    let hook = begun_webhook(&e);
    eprintln!("test: a stepper paused before its delete, its lock taken over meanwhile");
    // The first stepper stops (SIGSTOP) right before it deletes its first pod (its
    // StepguardStepBegun Event held by the webhook); a second one sees the lock unchanged for
    // a lease duration, takes it over and finishes the rollout. The first, resumed, finds the
    // lock no longer its own right before the delete and stops.
    let rev = bump(&e, false);
    let (from, ev) = (deletions(&e).len(), events(&e));
    hook.hold.lock().unwrap().next = Some(("StepguardStepBegun".into(), Duration::from_secs(6)));
    let mut a = Stepper::spawn(&e, "paused-stepper", &[]);
    wait_until(
        "the first stepper is about to delete",
        Duration::from_secs(60),
        || hook.hold.lock().unwrap().holding,
        || a.output(),
    );
    signal(&a, libc::SIGSTOP);
    let a_id = lock_holder(&e);
    // The paused stepper's lock expires (3 s) before the second one starts.
    std::thread::sleep(Duration::from_millis(3500));
    let mut b = Stepper::spawn(&e, "taker", &[]);
    wait_until(
        "the second stepper takes the lock over",
        Duration::from_secs(30),
        || {
            let h = lock_holder(&e);
            !h.is_empty() && h != a_id
        },
        || b.output(),
    );
    signal(&a, libc::SIGCONT);
    let code_a = exit_code(&mut a, Duration::from_secs(60));
    let code_b = exit_code(&mut b, Duration::from_secs(120));
    assert_eq!(code_a, 2, "{}", a.output());
    assert!(
        a.output().contains("the rollout lock was lost"),
        "{}",
        a.output()
    );
    assert_eq!(code_b, 0, "{}", b.output());
    assert!(
        b.output().contains("taking it over")
            && b.output().contains("resuming the rollout interrupted"),
        "{}",
        b.output()
    );
    each_node_once_every_verdict_read(
        &e,
        from,
        &ev,
        &rev,
        &format!("{}\n{}", a.output(), b.output()),
    );
    assert_rbac_sufficed(&e);
}

/// The stepper's `--status` output.
fn status(e: &Env) -> String {
    let (code, out) = rollout(e, &["--status"]);
    assert_eq!(code, 0, "{out}");
    out
}

#[test]
fn git_approves_in_one_commit_and_the_history_outlives_the_events() {
    let e = env();
    let mut watch = Stepper::watch(&e, "watch-git");
    // The revision the environment made is not approved: the watch waits, says so in a line
    // and, once, in an Event.
    let waiting = current_revision(&e.k).0;
    wait_until(
        "the watch tells that it waits for an approval",
        Duration::from_secs(20),
        || {
            all_events(&e).iter().any(|(_, r, m)| {
                r == "StepguardApprovalAwaited" && m.contains(&format!("revision {waiting}"))
            })
        },
        || watch.output(),
    );
    assert!(
        watch
            .output()
            .contains(&format!("revision {waiting} is not approved")),
        "{}",
        watch.output()
    );

    // One commit: the new image, the chart's config checksum on the template, and the
    // approval naming both (before the revision exists). It also drops the environment's
    // unapproved change (its bump annotation): a Git approval covers the image and the
    // config alone, judged from the revision the nodes run.
    let image = CILIUM_IMAGE.replace("v1.18.2", "v1.18.3");
    let (from, ev) = (deletions(&e).len(), events(&e));
    let approved = patch_daemonset(
        &e.k,
        json!({"metadata": {"annotations": {
                   "stepguard.io/approve-image": image, "stepguard.io/approve-config-checksum": "c2"}},
               "spec": {"template": {
                   "metadata": {"annotations": {"cilium.io/cilium-configmap-checksum": "c2",
                       "stepguard.test/bump": null}},
                   "spec": {"containers": [{"name": "cilium-agent", "image": image,
                       "imagePullPolicy": "IfNotPresent", "command": ["cilium-agent"],
                       "args": ["--config-dir=/tmp/cilium/config-map"]}]}}}}),
    );
    wait_until(
        "the watch steps every node onto the approved revision",
        Duration::from_secs(120),
        || {
            all_on(&e, &approved)
                && lock_holder(&e).is_empty()
                && deletions_since(&e, from).len() >= 3
        },
        || watch.output(),
    );
    each_node_once_every_verdict_read(&e, from, &ev, &approved, &watch.output());

    // A config-only change (a new checksum, the same image) does not ride that approval.
    let from = deletions(&e).len();
    let config_only = patch_daemonset(
        &e.k,
        json!({"spec": {"template": {"metadata": {"annotations": {"cilium.io/cilium-configmap-checksum": "c3"}}}}}),
    );
    assert_ne!(config_only, approved);
    wait_until(
        "the watch waits for the config-only revision's approval",
        Duration::from_secs(20),
        || {
            all_events(&e).iter().any(|(_, r, m)| {
                r == "StepguardApprovalAwaited"
                    && m.contains(&format!("revision {config_only}"))
                    && m.contains("config checksum is c3")
            })
        },
        || watch.output(),
    );
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        deletions_since(&e, from).len(),
        0,
        "nothing stepped: {}",
        watch.output()
    );
    watch.kill9();

    // Events expire (kube-apiserver's --event-ttl, one hour by default): with them gone,
    // `--status` still tells the rollout's story from the lock.
    e.cp.lock()
        .unwrap()
        .kubectl(&["-n", KS, "delete", "events", "--all"])
        .expect("delete the Events");
    let out = status(&e);
    assert!(
        out.contains("rollout lock stepguard/") && out.contains(": free"),
        "{out}"
    );
    for n in 0..3 {
        assert!(
            out.lines().any(|l| l.contains("StepguardStepPassed")
                && l.contains(&format!("node {}:", node_name(n)))),
            "node {n}'s step in the history: {out}"
        );
    }
    assert!(
        out.contains("StepguardRolloutStarted") && out.contains("StepguardRolloutDone"),
        "{out}"
    );
    assert_rbac_sufficed(&e);
}

#[test]
fn a_halted_node_is_rolled_back_by_the_runbook() {
    let e = env();
    let previous = {
        // The environment's first revision: the one every node ran before the bump.
        let pods = cilium_pods(&e);
        pods.values().next().unwrap().1.clone()
    };
    let new = current_revision(&e.k).0;
    assert_ne!(previous, new);
    let from = deletions(&e).len();
    *e.fault_at.lock().unwrap() = Some(from + 2);
    let (code, out) = rollout(&e, &[]);
    assert_eq!(code, 1, "{out}");
    let d = deletions_since(&e, from);
    let (first, failed) = (d[0].clone(), d[1].clone());

    // `--dry-run` and `--status` show the halt with the failed node's verdict.
    let (code, out) = rollout(&e, &["--dry-run"]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains(&format!("node {failed}'s verdict for step"))
            && out.contains("fail")
            && out.contains("map_emptied"),
        "{out}"
    );
    let st = status(&e);
    assert!(
        st.contains(&format!("node {failed}'s verdict for step")),
        "{st}"
    );

    // The runbook (README, "After a halt"): roll the template back, lift the halt by
    // retrying the failed node, run the rollout.
    e.cp.lock()
        .unwrap()
        .kubectl(&["-n", KS, "rollout", "undo", "daemonset/cilium"])
        .expect("kubectl rollout undo");
    wait_until(
        "the controller observes the rolled-back template",
        Duration::from_secs(20),
        || observed(&e.k) && current_revision(&e.k).0 == previous,
        || format!("{:?}", current_revision(&e.k)),
    );
    let (code, out) = rollout(
        &e,
        &[
            "--retry",
            &failed,
            "--reason",
            "rolled back to the previous revision",
        ],
    );
    assert_eq!(code, 0, "{out}");
    // The two nodes on the failed revision, and the third: its pod runs the previous
    // revision since the lab began and no agent ever verified it, so it is stepped to prove it.
    let third = (0..3)
        .map(node_name)
        .find(|n| *n != first && *n != failed)
        .unwrap();
    let (code, out) = rollout(&e, &["--dry-run"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("3 of 3 nodes to step"), "{out}");
    assert!(
        out.lines()
            .any(|l| l.contains(&third) && l.contains("on the revision but not proven")),
        "{out}"
    );
    let ev = events(&e);
    let from2 = deletions(&e).len();
    let (code, out) = rollout(&e, &[]);
    assert_eq!(code, 0, "{out}");
    let d = deletions_since(&e, from2);
    assert_eq!(
        d.len(),
        3,
        "the two nodes on the failed revision and the unproven one: {d:?}\n{out}"
    );
    assert_eq!(d[0], failed, "the failed node first: {d:?}\n{out}");
    let mut rest = d[1..].to_vec();
    rest.sort();
    let mut want_rest = vec![first.clone(), third.clone()];
    want_rest.sort();
    assert_eq!(rest, want_rest, "{d:?}\n{out}");
    wait_until(
        "every node on the previous revision",
        Duration::from_secs(10),
        || all_on(&e, &previous),
        || format!("{:?}", cilium_pods(&e)),
    );
    let mut passed = event_nodes(&e, &ev, "StepguardStepPassed");
    passed.sort();
    let mut want = vec![first, failed, third];
    want.sort();
    assert_eq!(passed, want, "{out}");

    eprintln!("test: slow image pulls");
    // Every replacement pulls its image for 6 s, longer than the 4 s replace timeout, which
    // starts once the image is there: the pull is shown and timed, and the rollout passes.
    let kubelet = e.kubelet.as_ref().unwrap();
    let rev = bump(&e, false);
    let (from, ev) = (deletions(&e).len(), events(&e));
    kubelet.state.lock().unwrap().pull = (0..3)
        .map(|i| (node_name(i), Duration::from_secs(6)))
        .collect();
    let (code, out) = rollout(&e, &["--replace-timeout", "4s"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("replacement: pulling the image (ContainerCreating)"),
        "{out}"
    );
    let pulls: Vec<f64> = out
        .lines()
        .filter_map(|l| l.split("replacement Ready: ").nth(1))
        .filter_map(|l| l.split("pulling ").nth(1)?.split('s').next()?.parse().ok())
        .collect();
    assert_eq!(pulls.len(), 3, "each replacement's pull timed: {out}");
    assert!(
        pulls.iter().all(|p| (5.0..8.0).contains(p)),
        "the 6 s pulls measured: {pulls:?}\n{out}"
    );
    each_node_once_every_verdict_read(&e, from, &ev, &rev, &out);
    // A pull past --pull-timeout fails the step, saying so.
    bump(&e, false);
    let from = deletions(&e).len();
    kubelet.state.lock().unwrap().pull = (0..3)
        .map(|i| (node_name(i), Duration::from_secs(10)))
        .collect();
    let (code, out) = rollout(&e, &["--pull-timeout", "2s"]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("still being pulled after 2s (--pull-timeout)"),
        "{out}"
    );
    assert_eq!(deletions_since(&e, from).len(), 1, "{out}");
    assert_rbac_sufficed(&e);
}

// The stepper's proof: a node is done only when its agent holds a passed verdict covering
// its current cilium pod's start. Nothing it must remember lives only in its own record, so
// an approval, an abort, a deleted lock, a pod replaced behind its back or a resumed step
// cannot make it walk past a node whose current pod failed or was never verified.

/// The rollout halted (exit 1) naming `node` as a node whose current pod failed its
/// verification, and a StepguardRolloutHalted Event since `ev` names it too.
fn halted_on(e: &Env, code: i32, out: &str, node: &str, ev: &BTreeSet<String>) {
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!("node {node}'s cilium pod"))
            && out.contains("failed its verification"),
        "the failed node named: {out}"
    );
    assert!(
        events_since(e, ev)
            .iter()
            .any(|(r, m)| r == "StepguardRolloutHalted"
                && m.contains(&format!("node {node}'s cilium pod"))),
        "an Event names {node}: {:?}",
        events_since(e, ev)
    );
}

/// `--dry-run` (exit 1) and `--status` name `node` as failed.
fn dry_run_and_status_name(e: &Env, node: &str) {
    let (code, out) = rollout(e, &["--dry-run"]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!("node {node}'s cilium pod"))
            && out.contains("failed its verification"),
        "{out}"
    );
    let st = status(e);
    assert!(
        st.contains(&format!("node {node}: pod")) && st.contains("FAILED its verification"),
        "{st}"
    );
}

/// A rollout that halted at its second node (the fault empties that node's endpoint map);
/// the failed node, and where the deletions and Events stood before.
fn halt_at_the_second_node(e: &Env) -> (String, usize, BTreeSet<String>) {
    let from = deletions(e).len();
    *e.fault_at.lock().unwrap() = Some(from + 2);
    let (code, out) = rollout(e, &[]);
    assert_eq!(code, 1, "{out}");
    let d = deletions_since(e, from);
    assert_eq!(d.len(), 2, "halted at the second node: {d:?}\n{out}");
    *e.fault_at.lock().unwrap() = None;
    (d[1].clone(), from, events(e))
}

#[test]
fn an_approved_newer_revision_does_not_lift_a_failed_verdict_on_the_node_that_runs_it() {
    let e = env();
    approve_revision(&e.k, &current_revision(&e.k).0);
    let (from, ev) = (deletions(&e).len(), events(&e));
    // The first node's restart empties its endpoint map, and while its old pod is Terminating
    // the template moves to a newer revision that is approved at once: the replacement comes
    // up on it and its verdict fails.
    *e.fault_at.lock().unwrap() = Some(from + 1);
    e.bumps.lock().unwrap().push(Bump {
        deletion: from + 1,
        at: Moment::Terminating,
        approve: true,
    });
    let mut watch = Stepper::watch(&e, "watch-newer");
    wait_until(
        "the first node's step fails",
        Duration::from_secs(90),
        || {
            reasons_since(&e, &ev)
                .iter()
                .any(|r| r == "StepguardStepFailed")
        },
        || watch.output(),
    );
    let failed = deletions_since(&e, from)[0].clone();
    let newer = current_revision(&e.k).0;
    // Given time to go on, the watch steps no other node: the failed node runs the newer,
    // approved revision and its verdict stands.
    wait_until(
        "the watch halts naming the failed node",
        Duration::from_secs(30),
        || {
            events_since(&e, &ev).iter().any(|(r, m)| {
                r == "StepguardRolloutHalted"
                    && m.contains(&format!("node {failed}'s cilium pod"))
                    && m.contains("failed its verification")
            })
        },
        || format!("{:?}\n{}", events_since(&e, &ev), watch.output()),
    );
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(
        deletions_since(&e, from),
        std::slice::from_ref(&failed),
        "no node stepped past the failed one: {}",
        watch.output()
    );
    assert!(watch.running(), "{}", watch.output());
    watch.kill9();
    assert!(
        cilium_pods(&e)
            .values()
            .any(|(n, r, _, _)| *n == failed && *r == newer),
        "the failed node runs the newer revision"
    );
    let ev = events(&e);
    std::thread::sleep(Duration::from_millis(3500));
    let (code, out) = rollout(&e, &[]);
    halted_on(&e, code, &out, &failed, &ev);
    dry_run_and_status_name(&e, &failed);
    assert_eq!(deletions_since(&e, from).len(), 1);
    assert_rbac_sufficed(&e);
}

#[test]
fn an_abort_does_not_make_the_stepper_forget_a_failed_node() {
    let e = env();
    let (failed, from, ev) = halt_at_the_second_node(&e);
    let (code, out) = rollout(&e, &["--abort", "--reason", "stop everything"]);
    assert_eq!(code, 0, "{out}");
    dry_run_and_status_name(&e, &failed);
    let (code, out) = rollout(&e, &[]);
    halted_on(&e, code, &out, &failed, &ev);
    assert_eq!(deletions_since(&e, from).len(), 2, "nothing stepped: {out}");
    // A person's decision on that node is what moves the rollout on.
    let (code, out) = rollout(&e, &["--skip", &failed, "--reason", "known bad, drained"]);
    assert_eq!(code, 0, "{out}");
    let (code, out) = rollout(&e, &[]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("1 nodes stepped and verified"), "{out}");
    assert_eq!(deletions_since(&e, from).len(), 3, "{out}");
    assert_rbac_sufficed(&e);
}

#[test]
fn a_deleted_lock_does_not_make_the_stepper_forget_a_failed_node() {
    let e = env();
    let (failed, from, ev) = halt_at_the_second_node(&e);
    // The lock Lease (the halt, the decisions, the history) deleted, as the tool's own
    // message allows.
    e.cp.lock()
        .unwrap()
        .kubectl(&["-n", "stepguard", "delete", "lease", "--all"])
        .expect("delete the lock");
    assert!(lock(&e).is_none());
    let (code, out) = rollout(&e, &[]);
    halted_on(&e, code, &out, &failed, &ev);
    assert_eq!(deletions_since(&e, from).len(), 2, "nothing stepped: {out}");
    dry_run_and_status_name(&e, &failed);
    assert_rbac_sufficed(&e);
}

#[test]
fn a_pod_replaced_outside_the_stepper_is_judged_by_its_agents_own_verdict() {
    let e = env();
    let rev = current_revision(&e.k).0;
    // A person deletes node-1's cilium pod: the controller recreates it on the current
    // revision (even under OnDelete), the restart empties its endpoint map, and the node's
    // agent verifies that restart as an implicit step, which fails.
    let from = deletions(&e).len();
    *e.fault_at.lock().unwrap() = Some(from + 1);
    let victim = cilium_pods(&e)
        .into_iter()
        .find(|(_, p)| p.0 == node_name(1))
        .map(|(n, _)| n)
        .unwrap();
    let ev = events(&e);
    delete_pod(&e, &victim);
    wait_until(
        "node-1's replacement Ready on the current revision",
        Duration::from_secs(60),
        || {
            cilium_pods(&e)
                .values()
                .any(|(n, r, ready, term)| *n == node_name(1) && *r == rev && *ready && !*term)
        },
        || format!("{:?}", cilium_pods(&e)),
    );
    wait_until(
        "the dry run names node-1's failed verification",
        Duration::from_secs(60),
        || rollout(&e, &["--dry-run"]).0 == 1,
        || rollout(&e, &["--dry-run"]).1,
    );
    dry_run_and_status_name(&e, &node_name(1));
    let (code, out) = rollout(&e, &[]);
    halted_on(&e, code, &out, &node_name(1), &ev);
    assert_eq!(
        deletions_since(&e, from),
        [node_name(1)],
        "nothing stepped past it: {out}"
    );
    assert_rbac_sufficed(&e);
}

#[test]
fn a_resumed_step_that_is_already_over_is_not_resumed_but_the_node_stepped_afresh() {
    let e = env();
    let hook = begun_webhook(&e);
    let rev = current_revision(&e.k).0;
    let (from, ev) = (deletions(&e).len(), events(&e));
    // Killed after the begin was recorded, before the delete (its StepguardStepBegun Event
    // held); the step then times out on the agent (no restart came).
    hook.hold.lock().unwrap().next = Some(("StepguardStepBegun".into(), Duration::from_secs(8)));
    let mut s = Stepper::spawn(&e, "killed-before-delete", &["--step-timeout", "5s"]);
    wait_until(
        "the stepper recorded its step and waits before the delete",
        Duration::from_secs(60),
        || lock_annotation(&e, "stepguard.io/node").is_some() && hook.hold.lock().unwrap().holding,
        || s.output(),
    );
    s.kill9();
    let node = lock_annotation(&e, "stepguard.io/node").unwrap();
    // The step's timeout and settle, and the lock's expiry.
    std::thread::sleep(Duration::from_secs(9));
    assert_eq!(deletions(&e).len(), from, "killed before the delete");
    let (code, out) = rollout(&e, &[]);
    assert_eq!(code, 0, "the stale verdict is not this restart's: {out}");
    assert!(
        out.contains("already over") && out.contains(&node),
        "the interrupted step is not resumed: {out}"
    );
    each_node_once_every_verdict_read(&e, from, &ev, &rev, &out);
    assert!(
        lock_annotation(&e, "stepguard.io/halt").is_none(),
        "no halt"
    );
    assert_rbac_sufficed(&e);
}

/// Begins a step on node `i`'s agent as another stepper would have (an orphan), from the
/// LAN; its id.
fn orphan_step(e: &Env, i: u8, timeout: &str) -> String {
    let out = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", e.client_ns))
        .arg("--")
        .arg(bin("STEPGUARD_BIN", "stepguard"))
        .args([
            "step",
            "--agent",
            &format!("http://{}:9969", stepguard_lab::lan::node_addr(i)),
            "--timeout",
            timeout,
            "--settle",
            "1s",
        ])
        .output()
        .expect("stepguard step");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap_or_default()
        .trim()
        .to_string()
}

#[test]
fn a_begin_refused_by_an_active_step_waits_for_it_instead_of_halting() {
    let e = env();
    let rev = current_revision(&e.k).0;
    let (from, ev) = (deletions(&e).len(), events(&e));
    // An orphaned step is active on node-0's agent (no restart follows it: it will time out).
    let orphan = orphan_step(&e, 0, "8s");
    assert!(!orphan.is_empty());
    let (code, out) = rollout(&e, &["--canary", &node_name(0)]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains(&format!("step {orphan} is active")),
        "the stepper waited for the active step: {out}"
    );
    assert!(!out.contains("FAILED"), "{out}");
    let d = deletions_since(&e, from);
    assert_eq!(d[0], node_name(0), "the canary first: {d:?}");
    each_node_once_every_verdict_read(&e, from, &ev, &rev, &out);
    assert_rbac_sufficed(&e);
}

#[test]
fn a_skipped_node_that_is_not_ready_blocks_no_later_run() {
    let e = env();
    let (failed, from, _) = halt_at_the_second_node(&e);
    let (code, out) = rollout(&e, &["--skip", &failed, "--reason", "known bad, drained"]);
    assert_eq!(code, 0, "{out}");
    // The skipped node goes NotReady (drained, powered off).
    let i: u8 = failed.trim_start_matches("node-").parse().unwrap();
    stepguard_lab::kube::set_node_ready(
        &e.k,
        &failed,
        &stepguard_lab::lan::node_addr(i).to_string(),
        false,
    )
    .unwrap();
    let (code, out) = rollout(&e, &["--dry-run"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("1 of 3 nodes to step"), "{out}");
    let (code, out) = rollout(&e, &[]);
    assert_eq!(
        code, 0,
        "a skipped node is exempt from every refusal: {out}"
    );
    let d = deletions_since(&e, from);
    assert_eq!(d.len(), 3, "{d:?}\n{out}");
    assert!(!d[2..].contains(&failed), "{d:?}");
    assert_rbac_sufficed(&e);
}

#[test]
fn a_watch_stepper_stops_on_sigterm_leaving_the_step_in_flight_to_the_next() {
    let e = env();
    approve_revision(&e.k, &current_revision(&e.k).0);
    let rev = current_revision(&e.k).0;
    let (from, ev) = (deletions(&e).len(), events(&e));
    let mut watch = Stepper::watch(&e, "watch-term");
    wait_until(
        "the watch deleted its first pod",
        Duration::from_secs(60),
        || deletions(&e).len() > from,
        || watch.output(),
    );
    signal(&watch, libc::SIGTERM);
    let code = exit_code(&mut watch, Duration::from_secs(40));
    assert_eq!(code, 0, "{}", watch.output());
    assert!(
        watch.output().contains("stopped by a signal"),
        "{}",
        watch.output()
    );
    assert!(
        lock_holder(&e).is_empty(),
        "the lock given up: {}",
        watch.output()
    );
    // The next run goes on from the record: every node stepped once.
    let (code, out) = rollout(&e, &[]);
    assert_eq!(code, 0, "{out}");
    each_node_once_every_verdict_read(&e, from, &ev, &rev, &out);
}

#[test]
fn the_revision_is_read_again_right_before_the_delete() {
    let e = env();
    let hook = begun_webhook(&e);
    let from = deletions(&e).len();
    // The step is begun and recorded; its StepguardStepBegun Event (the moment right before
    // the delete) is held while the template changes to a revision nobody approved.
    hook.hold.lock().unwrap().next = Some(("StepguardStepBegun".into(), Duration::from_secs(5)));
    let mut s = Stepper::spawn(&e, "reread", &[]);
    wait_until(
        "the stepper waits right before its delete",
        Duration::from_secs(60),
        || hook.hold.lock().unwrap().holding,
        || s.output(),
    );
    let unapproved = bump(&e, false);
    let code = exit_code(&mut s, Duration::from_secs(60));
    assert_eq!(code, 2, "{}", s.output());
    assert!(
        s.output().contains(&format!(
            "the DaemonSet moved to revision {unapproved} (not approved) before pod"
        )),
        "{}",
        s.output()
    );
    assert_eq!(deletions(&e).len(), from, "no pod deleted: {}", s.output());
    assert_rbac_sufficed(&e);
}
