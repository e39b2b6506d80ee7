//! A stepper interrupted mid-rollout (killed in any phase, its API server restarted, a watch
//! stopped by SIGTERM): the next run finishes the node in flight and steps none twice.
use super::*;

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
