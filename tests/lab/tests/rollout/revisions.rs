//! Revisions: a replacement is judged by the revision it carries, an unapproved revision
//! pauses a watch until approved (git approves in one commit), and the revision is read again
//! right before the delete.
use super::*;

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
    // The history the controller kept: the revisions pods run, and the newest (the cilium
    // DaemonSet's: the chart's cilium-envoy DaemonSet keeps its own beside them).
    let lp = kube::api::ListParams::default().labels("k8s-app=cilium");
    let kept =
        e.k.block(e.k.ns::<ControllerRevision>(KS).list(&lp))
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

    // One commit: Cilium's chart with a new image and a value that lands in cilium-config
    // (so a new checksum on the template), and the approval naming both through the chart's
    // `annotations:` value (the checksum read from `helm template` before the commit). The
    // environment's unapproved change (its bump annotation) is dropped first: a Git approval
    // covers the image and the config alone, judged from the revision the nodes run.
    let image = CILIUM_IMAGE.replace("v1.18.2", "v1.18.3");
    let (from, ev) = (deletions(&e).len(), events(&e));
    patch_daemonset(
        &e.k,
        json!({"spec": {"template": {"metadata": {"annotations": {"stepguard.test/bump": null}}}}}),
    );
    let sum = chart_checksum(&image, &["debug.enabled=true"]);
    let approved = chart_commit(&e, &image, &["debug.enabled=true"], Some((&image, &sum)));
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

    // A config-only commit (a new checksum, the same image, the approval unchanged) does not
    // ride that approval.
    let from = deletions(&e).len();
    let extra = ["debug.enabled=true", "debug.verbose=flow"];
    let sum3 = chart_checksum(&image, &extra);
    assert_ne!(
        sum3, sum,
        "a value that lands in cilium-config changes the checksum"
    );
    let config_only = chart_commit(&e, &image, &extra, Some((&image, &sum)));
    assert_ne!(config_only, approved);
    // The Event is told once per revision, and may be told before the controller observed
    // the template (then it says so, without the checksum); the watch's line names the
    // checksum once it is observed.
    wait_until(
        "the watch waits for the config-only revision's approval",
        Duration::from_secs(20),
        || {
            all_events(&e).iter().any(|(_, r, m)| {
                r == "StepguardApprovalAwaited" && m.contains(&format!("revision {config_only}"))
            }) && watch.output().lines().any(|l| {
                l.contains(&format!("revision {config_only} is not approved"))
                    && l.contains(&format!("config checksum is {sum3}"))
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
