use super::*;

fn n(name: &str, zone: &str, cp: bool) -> NodeInfo {
    NodeInfo {
        name: name.into(),
        ready: true,
        zone: Some(zone.into()),
        control_plane: cp,
        labels: BTreeMap::new(),
    }
}
fn pod(node: &str, rev: &str) -> CiliumPod {
    CiliumPod {
        name: format!("cilium-{node}"),
        uid: format!("uid-{node}"),
        node: node.into(),
        revision: rev.into(),
        ready: true,
        image: "quay.io/cilium/cilium:v1.17.3".into(),
        bound: true,
        crash_looping: None,
        started_at: Some(100.0),
    }
}
fn view() -> ClusterView {
    let names = [
        ("a1", "a", false),
        ("a2", "a", false),
        ("b1", "b", false),
        ("b2", "b", false),
        ("cp", "a", true),
    ];
    ClusterView {
        daemonset: "kube-system/cilium".into(),
        update_strategy: "OnDelete".into(),
        number_unavailable: 0,
        operator: Operator::Found {
            name: "kube-system/cilium-operator".into(),
            ready: 2,
            desired: 2,
        },
        foreign: vec![],
        generation: 3,
        observed_generation: 3,
        revision: Some(("new".into(), 3)),
        cilium_version: Some("1.18".into()),
        nodes: names.iter().map(|(x, z, c)| n(x, z, *c)).collect(),
        pods: names.iter().map(|(x, _, _)| pod(x, "old")).collect(),
        agents: names
            .iter()
            .map(|(x, _, _)| (x.to_string(), format!("http://{x}:9969")))
            .collect(),
        devices: names
            .iter()
            .map(|(x, _, _)| (x.to_string(), Ok(vec!["eth0".to_string()])))
            .collect(),
        leases: vec![
            L2Lease {
                service: "net-pihole-a".into(),
                holder: Some("a1".into()),
                duration: Duration::from_secs(15),
                local_backends: None,
            },
            L2Lease {
                service: "net-pihole-b".into(),
                holder: Some("b1".into()),
                duration: Duration::from_secs(15),
                local_backends: None,
            },
        ],
        l2_timings: L2Timings::default(),
        proofs: names
            .iter()
            .map(|(x, _, _)| (x.to_string(), Ok(proof(ProofStatus::Passed))))
            .collect(),
    }
}

fn proof(status: ProofStatus) -> Proof {
    Proof {
        started_at: 100.0,
        status,
        step: Some(crate::step::proof::ProofStep {
            id: "implicit-1".into(),
            origin: crate::step::Origin::Implicit,
            created_at: 99.0,
            reloaded_at: Some(101.0),
            verdict: None,
        }),
        why: format!("step implicit-1: {}", status.as_str()),
    }
}

#[test]
fn canary_first_workers_by_zone_then_holders_apart_then_control_plane() {
    let o = PlanOpts {
        canary: Some("b2".into()),
        vip_groups: [(
            "dns".to_string(),
            vec!["net-pihole-a".to_string(), "net-pihole-b".to_string()],
        )]
        .into(),
        ..Default::default()
    };
    let p = plan(&view(), &o).unwrap();
    let names: Vec<&str> = p.iter().map(|s| s.node.as_str()).collect();
    assert_eq!(names, ["b2", "a2", "a1", "b1", "cp"]);
    assert_eq!(
        p[3].pause_before,
        Duration::from_secs(15),
        "a lease duration between holders"
    );
    assert_eq!(p[2].moves, ["net-pihole-a"]);
    assert!(render(&view(), &p).contains("moves L2 VIPs: net-pihole-a"));
}

/// A lease holder's step says what LAN clients should expect, from the lease
/// timings: retry × 2.2 for a client resolving the VIP meanwhile; a lease duration less a retry
/// to a lease duration and two jittered retries when the release misses the grace. Workers
/// expect none.
#[test]
fn a_holders_step_names_its_expected_blip_from_the_lease_timings() {
    let mut v = view();
    v.leases[0].duration = Duration::from_secs(6);
    v.l2_timings = L2Timings {
        renew: Duration::from_secs(3),
        retry: Duration::from_secs(1),
        grace: Duration::from_secs(1),
        source: "kube-system/cilium-config".into(),
    };
    let p = plan(&v, &PlanOpts::default()).unwrap();
    let holder = p.iter().find(|s| s.node == "a1").unwrap();
    let b = holder.blip.as_ref().expect("a holder's blip");
    assert!((b.resolving_max_s - 2.2).abs() < 1e-9, "{b:?}");
    assert!((b.unreleased_min_s - 5.0).abs() < 1e-9, "{b:?}");
    assert!((b.unreleased_max_s - 10.4).abs() < 1e-9, "{b:?}");
    assert!(p
        .iter()
        .filter(|s| s.moves.is_empty())
        .all(|s| s.blip.is_none()));
    let text = render(&v, &p);
    assert!(
        text.contains("up to 2.2s for a client resolving it meanwhile; 5.0-10.4s if the lease is not released within the 1s grace (lease 6s, retry 1s: kube-system/cilium-config)"),
        "{text}"
    );
    // Timings the agent would correct are corrected as it does: a renew deadline not above
    // 1.2 × retry halves the retry period (5 s / 2 = 2.5 s).
    let t = L2Timings {
        renew: Duration::from_secs(5),
        retry: Duration::from_secs(5),
        ..Default::default()
    };
    let b = expected_blip(Duration::from_secs(15), &t);
    assert!(
        (b.retry_s - 2.5).abs() < 1e-9 && (b.resolving_max_s - 5.5).abs() < 1e-9,
        "{b:?}"
    );
}

/// `externalTrafficPolicy: Local`: only nodes with a ready backend may announce the VIP. With
/// the holder the only one, nobody takes the lease over while its agent restarts, and the
/// estimate says a resolving client waits for the restarted agent; with a backend on another
/// node (or `Cluster`), the lease timings stand.
#[test]
fn a_local_policy_vip_with_its_only_backend_on_the_holder_has_no_taker() {
    let mut v = view();
    // The VIPs a1's step says nobody takes over, with its backends on `nodes`.
    let no_taker = |v: &mut ClusterView, nodes: &[&str]| {
        v.leases[0].local_backends = Some(nodes.iter().map(|n| n.to_string()).collect());
        let p = plan(v, &PlanOpts::default()).unwrap();
        let b = p
            .iter()
            .find(|s| s.node == "a1")
            .unwrap()
            .blip
            .clone()
            .unwrap();
        (b.no_taker, render(v, &p))
    };
    let (vips, text) = no_taker(&mut v, &["a1"]);
    assert_eq!(vips, ["net-pihole-a"]);
    assert!(
        text.contains("net-pihole-a: externalTrafficPolicy Local with no ready backend on another node, so nobody takes the lease over"),
        "{text}"
    );
    let (vips, _) = no_taker(&mut v, &["a1", "a2"]);
    assert!(vips.is_empty(), "{vips:?}");
    // No backend anywhere: still nobody else may take it.
    let (vips, _) = no_taker(&mut v, &[]);
    assert_eq!(vips, ["net-pihole-a"]);
}

#[test]
fn nodes_already_on_the_revision_are_not_stepped_and_max_nodes_limits() {
    let mut v = view();
    v.pods[0].revision = "new".into();
    let p = plan(
        &v,
        &PlanOpts {
            max_nodes: Some(2),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(p.len(), 2);
    assert!(p.iter().all(|s| s.node != "a1"));
}

#[test]
fn a_retried_node_comes_first_and_skipped_nodes_not_at_all() {
    let mut v = view();
    v.pods[2].revision = "new".into(); // b1: already stepped (and failed its verdict)
    let o = PlanOpts {
        again: Some("b1".into()),
        skip: ["a2".to_string()].into(),
        ..Default::default()
    };
    let p = plan(&v, &o).unwrap();
    let names: Vec<&str> = p.iter().map(|s| s.node.as_str()).collect();
    assert_eq!(names, ["b1", "b2", "a1", "cp"]);
    assert_eq!(p[0].why, "retry");
}

fn kinds(r: &[Refusal]) -> Vec<&'static str> {
    r.iter()
        .map(|x| match x {
            Refusal::NotOnDelete { .. } => "strategy",
            Refusal::NotObserved { .. } => "stale",
            Refusal::NoRevision => "norev",
            Refusal::MinorSkip { .. } => "minor",
            Refusal::NodeNotReady { .. } => "notready",
            Refusal::PodCrashLooping { .. } => "crash",
            Refusal::PodNotReady { .. } => "podnotready",
            Refusal::PodUnbound { .. } => "unbound",
            Refusal::Unavailable { .. } => "unavailable",
            Refusal::OperatorNotReady { .. } | Refusal::OperatorUnknown { .. } => "operator",
            Refusal::AgentMissing { .. } => "agent",
            Refusal::DevicesUnknown { .. } => "devunknown",
            Refusal::DevicesDiffer { .. } => "devices",
            Refusal::VerdictFailed { .. } => "failed",
            Refusal::ProofPending { .. } => "pending",
            Refusal::ProofUnknown { .. } => "proofunknown",
            Refusal::CanaryUnknown { .. } => "canary",
        })
        .collect()
}

#[test]
fn refusals_come_in_the_documented_order() {
    let mut v = view();
    v.observed_generation = 2;
    v.nodes[1].ready = false;
    v.agents.remove("b1");
    v.devices
        .insert("b2".into(), Ok(vec!["eth0".into(), "eth1".into()]));
    let r = plan(&v, &PlanOpts::default()).unwrap_err();
    assert_eq!(kinds(&r), ["stale", "notready", "agent", "devices"]);
    assert!(r[3].to_string().contains("[eth0,eth1] on b2"), "{}", r[3]);
    // The cluster's own health, every kind at once.
    let mut v = view();
    v.update_strategy = "RollingUpdate".into();
    v.cilium_version = Some("1.20".into());
    v.pods[0].crash_looping = Some(7);
    v.pods[0].ready = false;
    v.pods[1].ready = false;
    v.pods[2].bound = false;
    v.number_unavailable = 3;
    v.operator = Operator::Found {
        name: "kube-system/cilium-operator".into(),
        ready: 0,
        desired: 1,
    };
    let r = plan(&v, &PlanOpts::default()).unwrap_err();
    assert_eq!(
        kinds(&r),
        [
            "strategy",
            "minor",
            "crash",
            "podnotready",
            "unbound",
            "unavailable",
            "operator"
        ]
    );
    assert!(
        r[1].to_string()
            .contains("1.20 is more than one minor version from 1.17"),
        "{}",
        r[1]
    );
    let o = PlanOpts {
        allow_minor_skip: true,
        skip: ["a1".to_string(), "a2".to_string(), "b1".to_string()].into(),
        ..Default::default()
    };
    v.update_strategy = "OnDelete".into();
    v.operator = Operator::NotChecked;
    // Skipped nodes' pods (known bad by a person's decision) explain the unavailable count.
    v.number_unavailable = 2;
    assert!(plan(&v, &o).is_ok(), "{:?}", plan(&v, &o));
    v.number_unavailable = 3;
    assert_eq!(kinds(&plan(&v, &o).unwrap_err()), ["unavailable"]);
    v.cilium_version = Some("1.18".into());
    assert!(adjacent_minors("1.17", "1.18") && adjacent_minors("1.18", "1.17"));
    assert!(!adjacent_minors("1.18", "1.20") && !adjacent_minors("1.18", "2.0"));
    // Mid-rollout, another revision may differ: no refusal.
    let mut v = view();
    v.pods[4].revision = "new".into();
    v.devices.insert("cp".into(), Ok(vec!["eth1".into()]));
    assert!(plan(&v, &PlanOpts::default()).is_ok());
}

/// A pod on the current revision is done only when its agent proves its start passed: a
/// failed proof halts naming it, a pending one is waited for, an unproven one is stepped.
#[test]
fn a_pod_on_the_revision_is_done_only_with_a_passed_proof() {
    let mut v = view();
    for p in &mut v.pods {
        p.revision = "new".into();
    }
    assert_eq!(plan(&v, &PlanOpts::default()).unwrap(), vec![]);
    v.proofs
        .insert("b1".into(), Ok(proof(ProofStatus::Unproven)));
    let p = plan(&v, &PlanOpts::default()).unwrap();
    assert_eq!(p.len(), 1);
    assert_eq!(p[0].node, "b1");
    assert!(
        p[0].why.contains("not proven: step implicit-1: unproven"),
        "{}",
        p[0].why
    );
    v.proofs.insert("a2".into(), Ok(proof(ProofStatus::Failed)));
    let r = plan(&v, &PlanOpts::default()).unwrap_err();
    assert_eq!(kinds(&r), ["failed"]);
    assert!(r[0].halts());
    assert!(
        r[0].to_string().contains("node a2's cilium pod cilium-a2"),
        "{}",
        r[0]
    );
    // A person's --retry steps it again; --skip leaves it.
    let o = PlanOpts {
        again: Some("a2".into()),
        ..Default::default()
    };
    let names: Vec<String> = plan(&v, &o).unwrap().into_iter().map(|s| s.node).collect();
    assert_eq!(names, ["a2", "b1"]);
    let o = PlanOpts {
        skip: ["a2".to_string()].into(),
        ..Default::default()
    };
    assert_eq!(plan(&v, &o).unwrap().len(), 1);
    v.proofs
        .insert("b2".into(), Ok(proof(ProofStatus::Pending)));
    v.proofs.insert("cp".into(), Err("unreachable".into()));
    let r = plan(&v, &o).unwrap_err();
    assert_eq!(kinds(&r), ["pending", "proofunknown"]);
    assert!(!r[0].halts() && !r[1].halts());
    // A pod without a start time (its container not running) is not proven.
    let mut v = view();
    v.pods[0].revision = "new".into();
    v.pods[0].started_at = None;
    v.proofs.remove("a1");
    let p = plan(&v, &PlanOpts::default()).unwrap();
    assert!(p
        .iter()
        .any(|s| s.node == "a1" && s.why.contains("no start time")));
}

/// A node a person skipped is exempt from every refusal: NotReady, its agent gone, its
/// devices unknown, its failed verdict.
#[test]
fn a_skipped_node_is_exempt_from_every_refusal() {
    let mut v = view();
    v.nodes[1].ready = false;
    v.pods[1].ready = false;
    v.number_unavailable = 1;
    v.agents.remove("a2");
    v.devices.insert("a2".into(), Err("unreachable".into()));
    v.pods[1].revision = "new".into();
    v.proofs.insert("a2".into(), Ok(proof(ProofStatus::Failed)));
    let r = plan(&v, &PlanOpts::default()).unwrap_err();
    assert_eq!(
        kinds(&r),
        ["notready", "podnotready", "unavailable", "agent"]
    );
    let o = PlanOpts {
        skip: ["a2".to_string()].into(),
        ..Default::default()
    };
    let p = plan(&v, &o).unwrap();
    assert!(p.iter().all(|s| s.node != "a2"), "{p:?}");
    v.agents.insert("a2".into(), "http://a2:9969".into());
    let p = plan(&v, &o).unwrap();
    assert!(p.iter().all(|s| s.node != "a2"), "{p:?}");
}

/// A misspelled canary, or a canary label that matches no node, is refused, not ignored.
#[test]
fn a_canary_that_names_no_node_is_refused() {
    let v = view();
    let o = PlanOpts {
        canary: Some("b3".into()),
        ..Default::default()
    };
    let r = plan(&v, &o).unwrap_err();
    assert_eq!(kinds(&r), ["canary"]);
    assert!(r[0].to_string().contains("b3"), "{}", r[0]);
    let o = PlanOpts {
        canary_label: Some(("stepguard.io/canary".into(), "true".into())),
        ..Default::default()
    };
    assert_eq!(kinds(&plan(&v, &o).unwrap_err()), ["canary"]);
    let mut v = view();
    v.nodes[2]
        .labels
        .insert("stepguard.io/canary".into(), "true".into());
    assert_eq!(plan(&v, &o).unwrap()[0].node, "b1");
}
