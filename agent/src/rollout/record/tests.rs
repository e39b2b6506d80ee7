use super::*;

fn halted() -> Record {
    Record {
        halt: Some(Halt {
            node: "n2".into(),
            step: Some("s2".into()),
            revision: "r2".into(),
            reason: "step failed: map_emptied".into(),
            at: "t".into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[test]
fn a_record_survives_the_annotations_and_a_mangled_one_is_an_error() {
    let mut r = halted();
    r.begin(InFlight {
        node: "n1".into(),
        step: "s1".into(),
        pod: "cilium-x".into(),
        pod_uid: "u".into(),
        revision: "r2".into(),
        revision_number: 2,
        why: "worker".into(),
    });
    r.skipped.push(Skip {
        node: "n3".into(),
        revision: "r2".into(),
        by: "me".into(),
        why: "broken disk".into(),
    });
    r.retry = Some("n2".into());
    r.aborted = Some("r1".into());
    let mut ann = BTreeMap::new();
    ann.insert("other".to_string(), "kept".to_string());
    r.write(&mut ann);
    assert_eq!(ann[ANN_NODE], "n1");
    assert_eq!(Record::parse(&ann).unwrap(), r);
    assert_eq!(ann["other"], "kept");
    Record::default().write(&mut ann);
    assert_eq!(ann.len(), 1, "an empty record removes its keys: {ann:?}");

    let mut bad = BTreeMap::new();
    bad.insert(ANN_HALT.to_string(), "{not json".to_string());
    let e = Record::parse(&bad).unwrap_err();
    assert_eq!(e.key, ANN_HALT);
    assert!(e.to_string().contains(ANN_HALT), "{e}");

    // An older stepper's lock: the step in flight from the plain annotations.
    let mut old = BTreeMap::new();
    old.insert(ANN_NODE.to_string(), "n1".to_string());
    old.insert(ANN_STEP.to_string(), "s1".to_string());
    old.insert(ANN_REVISION.to_string(), "r2".to_string());
    let i = Record::parse(&old).unwrap().inflight;
    assert_eq!(i.len(), 1);
    assert_eq!((i[0].node.as_str(), i[0].pod_uid.as_str()), ("n1", ""));
}

/// A batch in flight is a list on the lock, every node of it kept (a resumed run finishes
/// each); one step alone stays the single object older steppers read.
#[test]
fn a_batch_in_flight_survives_the_annotations_one_step_stays_an_object() {
    let step = |n: &str| InFlight {
        node: n.into(),
        step: format!("s-{n}"),
        pod: format!("cilium-{n}"),
        pod_uid: format!("u-{n}"),
        revision: "r2".into(),
        revision_number: 2,
        why: "worker".into(),
    };
    let mut r = Record::default();
    r.begin(step("n1"));
    let mut ann = BTreeMap::new();
    r.write(&mut ann);
    assert!(ann[ANN_INFLIGHT].starts_with('{'), "{}", ann[ANN_INFLIGHT]);
    r.begin(step("n2"));
    r.begin(step("n3"));
    r.begin(step("n2"));
    assert_eq!(r.inflight.len(), 3, "a node is in flight once");
    r.write(&mut ann);
    assert!(ann[ANN_INFLIGHT].starts_with('['), "{}", ann[ANN_INFLIGHT]);
    assert_eq!(ann[ANN_NODE], "n1,n3,n2");
    assert_eq!(Record::parse(&ann).unwrap(), r);
    r.end("n3");
    assert_eq!(
        r.inflight
            .iter()
            .map(|i| i.node.as_str())
            .collect::<Vec<_>>(),
        ["n1", "n2"]
    );
    assert!(r.inflight_nodes().contains("n2 (step s-n2)"));
}

/// A halt in a batch names every node of the batch with its outcome.
#[test]
fn a_batch_halt_names_every_node_of_its_batch() {
    let mut r = halted();
    if let Some(h) = r.halt.as_mut() {
        h.batch = vec![
            "n1: passed".into(),
            "n2: failed: map_emptied".into(),
            "n3: not deleted: another node of the batch failed".into(),
        ];
    }
    let t = halt_text(r.halt.as_ref().unwrap());
    for n in ["n1: passed", "n2: failed", "n3: not deleted"] {
        assert!(t.contains(n), "{t}");
    }
    let mut ann = BTreeMap::new();
    r.write(&mut ann);
    assert_eq!(Record::parse(&ann).unwrap(), r);
}

#[test]
fn a_halt_stands_until_a_new_revision_is_approved() {
    let r = halted();
    assert!(matches!(gate(&r, "r2", Some("r2"), "t"), Gate::Halted(m) if m.contains("--retry n2")));
    assert!(
        matches!(gate(&r, "r3", None, "t"), Gate::Halted(_)),
        "a new revision alone does not lift it"
    );
    assert!(
        matches!(gate(&r, "r3", Some("r2"), "t"), Gate::Halted(_)),
        "an approval of the halted revision does not either"
    );
    match gate(&r, "r3", Some("r3"), "t") {
        Gate::Go { lift: Some(d) } => assert_eq!(d.action, "approved"),
        g => panic!("{g:?}"),
    }
    assert_eq!(
        gate(&Record::default(), "r2", None, "t"),
        Gate::Go { lift: None }
    );
}

#[test]
fn people_lift_a_halt_on_the_failed_node_only_and_are_recorded() {
    let mut r = halted();
    let e = lift(
        &mut r,
        &Lift::Retry("n1".into()),
        "me",
        "x",
        "r2",
        "t",
        None,
    )
    .unwrap_err();
    assert!(e.contains("the halt is at node n2"), "{e}");
    assert!(r.halt.is_some());
    lift(
        &mut r,
        &Lift::Retry("n2".into()),
        "me",
        "fixed the NIC",
        "r2",
        "t",
        None,
    )
    .unwrap();
    assert_eq!((r.halt.is_none(), r.retry.as_deref()), (true, Some("n2")));
    assert_eq!(r.decisions[0].by, "me");
    assert_eq!(r.decisions[0].why, "fixed the NIC");
    let e = lift(&mut r, &Lift::Skip("n2".into()), "me", "x", "r2", "t", None).unwrap_err();
    assert!(e.contains("no halt stands"), "{e}");

    let mut r = halted();
    lift(
        &mut r,
        &Lift::Skip("n2".into()),
        "you",
        "known bad",
        "r2",
        "t",
        None,
    )
    .unwrap();
    assert_eq!(r.skipped_on("r2"), ["n2"]);
    assert!(r.skipped_on("r3").is_empty());
    r.forget_other_revisions("r3");
    assert!(r.skipped.is_empty());

    let mut r = halted();
    lift(&mut r, &Lift::Abort, "me", "giving up", "r2", "t", None).unwrap();
    assert_eq!((r.halt.is_none(), r.aborted.as_deref()), (true, Some("r2")));
    for _ in 0..30 {
        r.decide(Decision::default());
    }
    assert_eq!(r.decisions.len(), DECISIONS_KEPT);
}

/// A node whose current pod failed its verification can be decided on whatever the
/// record holds (its halt aborted, or the lock deleted): the world's halt stands in.
#[test]
fn a_failed_node_without_a_halt_on_the_record_can_be_decided_on() {
    let world = Halt {
        node: "n3".into(),
        step: Some("implicit-1".into()),
        revision: "r2".into(),
        reason: "map_emptied".into(),
        at: "t".into(),
        ..Default::default()
    };
    let mut r = Record::default();
    let e = lift(&mut r, &Lift::Skip("n3".into()), "me", "x", "r2", "t", None).unwrap_err();
    assert!(e.contains("no halt stands"), "{e}");
    lift(
        &mut r,
        &Lift::Skip("n3".into()),
        "me",
        "drained",
        "r2",
        "t",
        Some(&world),
    )
    .unwrap();
    assert_eq!(r.skipped_on("r2"), ["n3"]);
    let mut r = halted();
    let e = lift(
        &mut r,
        &Lift::Retry("n1".into()),
        "me",
        "x",
        "r2",
        "t",
        Some(&world),
    )
    .unwrap_err();
    assert!(e.contains("the halt is at node n2"), "{e}");
    // Another node's halt stands: decide there first (the gate would refuse anyway).
    let e = lift(
        &mut r,
        &Lift::Retry("n3".into()),
        "me",
        "x",
        "r2",
        "t",
        Some(&world),
    )
    .unwrap_err();
    assert!(e.contains("the halt is at node n2"), "{e}");
    assert_eq!(r.halt.as_ref().map(|h| h.node.as_str()), Some("n2"));
    // The same node halted on an older revision: its current verdict decides; another
    // node's retry is kept.
    let mut r = halted();
    r.retry = Some("n1".into());
    let now = Halt {
        node: "n2".into(),
        revision: "r3".into(),
        ..world.clone()
    };
    lift(
        &mut r,
        &Lift::Skip("n2".into()),
        "me",
        "x",
        "r3",
        "t",
        Some(&now),
    )
    .unwrap();
    assert_eq!(r.skipped_on("r3"), ["n2"]);
    assert_eq!(r.retry.as_deref(), Some("n1"));
}

#[test]
fn a_run_goes_on_only_to_its_own_or_an_approved_revision() {
    assert!(may_adopt("r2", "r2", None));
    assert!(!may_adopt("r2", "r3", None));
    assert!(!may_adopt("r2", "r3", Some("r2")));
    assert!(may_adopt("r2", "r3", Some("r3")));
}
