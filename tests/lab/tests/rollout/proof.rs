//! The stepper's proof: a node is done only when its agent holds a passed verdict covering
//! its current cilium pod's start. Nothing it must remember lives only in its own record, so
//! an approval, an abort, a deleted lock, a pod replaced behind its back or a resumed step
//! cannot make it walk past a node whose current pod failed or was never verified.
use super::*;

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
