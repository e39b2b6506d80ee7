//! A halted rollout: a failed step or a replacement that never turns ready halts it there
//! until a person lifts it, and the runbook rolls the halted node back.
use super::*;

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

    // The runbook (docs/rollout.md, "The runbook: after a halt"): roll the template back, lift the halt by
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
