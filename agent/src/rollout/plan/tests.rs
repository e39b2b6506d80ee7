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

/// A fleet of `per_zone` workers in each of `zones` zones (`z0-w0`, …), none holding a lease.
fn fleet(zones: usize, per_zone: usize) -> ClusterView {
    let mut v = view();
    v.leases.clear();
    v.nodes.clear();
    v.pods.clear();
    for z in 0..zones {
        for w in 0..per_zone {
            let name = format!("z{z}-w{w}");
            v.nodes.push(n(&name, &format!("zone-{z}"), false));
            v.pods.push(pod(&name, "old"));
            v.agents.insert(name.clone(), format!("http://{name}:9969"));
            v.devices.insert(name.clone(), Ok(vec!["eth0".into()]));
            v.proofs
                .insert(name.clone(), Ok(proof(ProofStatus::Passed)));
        }
    }
    v
}

fn names(b: &[PlannedStep]) -> Vec<&str> {
    b.iter().map(|s| s.node.as_str()).collect()
}

#[test]
fn a_budget_is_a_count_or_a_percentage_rounded_as_the_controller_rounds() {
    assert_eq!(Budget::parse("3"), Ok(Budget::Count(3)));
    assert_eq!(Budget::parse("10%"), Ok(Budget::Percent(10)));
    for bad in ["0", "0%", "101%", "-1", "x", "1.5%", ""] {
        let e = Budget::parse(bad).unwrap_err();
        assert!(
            e.contains("percentage") || e.contains("number"),
            "{bad}: {e}"
        );
    }
    assert_eq!(Budget::Percent(10).of(1000), 100);
    assert_eq!(Budget::Percent(10).of(95), 10, "rounded up");
    assert_eq!(Budget::Percent(10).of(3), 1, "at least one");
    assert_eq!(
        Budget::Percent(10).of_down(95),
        9,
        "a domain's share rounded down"
    );
    assert_eq!(Budget::Percent(10).of_down(5), 1);
    assert_eq!(
        (1..=6)
            .fold((vec![], None), |(mut v, last), _| {
                let n = batch::next_size(last, 10);
                v.push(n);
                (v, Some(n))
            })
            .0,
        [1, 2, 4, 8, 10, 10],
        "the canary alone, then doubling up to the maximum"
    );
}

/// Batches take nodes from every zone in turn and never more of one zone than its limit.
#[test]
fn a_batch_holds_no_more_of_a_zone_than_its_limit() {
    let v = fleet(3, 4);
    let mut o = PlanOpts::default();
    let steps = plan(&v, &o).unwrap();
    let b = batch::batch(&v, &o, &steps, 6);
    assert_eq!(
        names(&b),
        ["z0-w0", "z1-w0", "z2-w0", "z0-w1", "z1-w1", "z2-w1"]
    );
    o.per_domain = Some(Budget::Count(1));
    let b = batch::batch(&v, &o, &steps, 6);
    assert_eq!(names(&b), ["z0-w0", "z1-w0", "z2-w0"], "one per zone");
    o.per_domain = Some(Budget::Percent(50));
    let b = batch::batch(&v, &o, &steps, 12);
    assert_eq!(b.len(), 6, "half of each 4-node zone: {:?}", names(&b));
    // A label of the user's naming: the rack.
    let mut v = fleet(1, 4);
    for (i, node) in v.nodes.iter_mut().enumerate() {
        node.labels.insert("rack".into(), format!("r{}", i % 2));
    }
    let o = PlanOpts {
        domain_label: "rack".into(),
        per_domain: Some(Budget::Count(1)),
        ..Default::default()
    };
    let steps = plan(&v, &o).unwrap();
    let b = batch::batch(&v, &o, &steps, 4);
    assert_eq!(names(&b), ["z0-w0", "z0-w1"], "one per rack");
}

/// Lease holders: never two of one VIP group in a batch, never with a node their VIPs may
/// move to; with no local backends named, every node may take the VIP: the holder goes alone.
#[test]
fn a_batch_never_holds_a_holder_with_its_takers_or_its_group() {
    let v = view();
    let o = PlanOpts::default();
    let steps = plan(&v, &o).unwrap();
    let holder_at = steps.iter().position(|s| s.node == "a1").unwrap();
    let b = batch::batch(&v, &o, &steps[holder_at..], 5);
    assert_eq!(names(&b), ["a1"], "any node may take a1's VIP: alone");
    let workers = batch::batch(&v, &o, &steps, 5);
    assert!(
        workers.iter().all(|s| s.moves.is_empty()),
        "workers first, a holder never joins them: {:?}",
        names(&workers)
    );
    // With externalTrafficPolicy Local the takers are known: a1's VIP may go to a2 only,
    // b1's to b2 only.
    let mut v = view();
    v.leases[0].local_backends = Some(vec!["a1".into(), "a2".into()]);
    v.leases[1].local_backends = Some(vec!["b1".into(), "b2".into()]);
    let steps: Vec<PlannedStep> = plan(&v, &o)
        .unwrap()
        .into_iter()
        .filter(|s| s.node != "cp")
        .collect();
    let order: Vec<&str> = names(&steps);
    let b = batch::batch(&v, &o, &steps, 5);
    let got = names(&b);
    assert!(
        !(got.contains(&"a1") && got.contains(&"a2")),
        "a1 with its taker: {got:?} from {order:?}"
    );
    assert!(!(got.contains(&"b1") && got.contains(&"b2")), "{got:?}");
    let holders: Vec<PlannedStep> = steps
        .iter()
        .filter(|s| !s.moves.is_empty())
        .cloned()
        .collect();
    let b = batch::batch(&v, &o, &holders, 5);
    assert_eq!(names(&b), ["a1", "b1"], "two groups' holders together");
    let grouped = PlanOpts {
        vip_groups: [(
            "dns".to_string(),
            vec!["net-pihole-a".to_string(), "net-pihole-b".to_string()],
        )]
        .into(),
        ..Default::default()
    };
    let b = batch::batch(&v, &grouped, &holders, 5);
    assert_eq!(names(&b), ["a1"], "one VIP group's holders never together");
}

/// Control-plane nodes go one per batch; a retry goes alone.
#[test]
fn control_planes_one_per_batch_and_a_retry_alone() {
    let mut v = fleet(1, 3);
    for i in 0..3 {
        let name = format!("cp{i}");
        v.nodes.push(n(&name, "zone-0", true));
        v.pods.push(pod(&name, "old"));
        v.agents.insert(name.clone(), format!("http://{name}:9969"));
        v.devices.insert(name.clone(), Ok(vec!["eth0".into()]));
    }
    let o = PlanOpts::default();
    let steps = plan(&v, &o).unwrap();
    let all = batch::simulate(&v, &o, &steps, 10);
    let sizes: Vec<usize> = all.iter().map(|b| b.len()).collect();
    assert_eq!(sizes, [1, 2, 1, 1, 1], "{all:?}");
    assert!(all[2..].iter().all(|b| b[0].node.starts_with("cp")));
    let again = PlanOpts {
        again: Some("z0-w2".into()),
        ..Default::default()
    };
    let steps = plan(&v, &again).unwrap();
    assert_eq!(names(&batch::batch(&v, &again, &steps, 10)), ["z0-w2"]);
}

/// The partition leaves the last nodes of the order on their revision; the node selector
/// leaves out-of-scope nodes alone.
#[test]
fn a_partition_and_a_node_selector_bound_the_rollout() {
    let mut v = fleet(2, 3);
    let o = PlanOpts {
        partition: 2,
        ..Default::default()
    };
    let steps = plan(&v, &o).unwrap();
    assert_eq!(steps.len(), 4, "{:?}", names(&steps));
    for p in v
        .pods
        .iter_mut()
        .filter(|p| steps.iter().any(|s| s.node == p.node))
    {
        p.revision = "new".into();
    }
    assert!(
        plan(&v, &o).unwrap().is_empty(),
        "two left, as the partition asks"
    );
    let o = PlanOpts {
        partition: 1,
        ..Default::default()
    };
    assert_eq!(plan(&v, &o).unwrap().len(), 1, "a lower partition goes on");

    let mut v = fleet(2, 2);
    v.nodes[1].labels.insert("pool".into(), "media".into());
    v.nodes[3].labels.insert("pool".into(), "media".into());
    let o = PlanOpts {
        node_selector: scope::parse_selector("pool=media").unwrap(),
        ..Default::default()
    };
    assert_eq!(names(&plan(&v, &o).unwrap()), ["z0-w1", "z1-w1"]);
    let o = PlanOpts {
        node_selector: scope::parse_selector("!pool").unwrap(),
        ..Default::default()
    };
    assert_eq!(names(&plan(&v, &o).unwrap()), ["z0-w0", "z1-w0"]);
    for bad in ["pool in (a,b)", "=x", "a b"] {
        assert!(scope::parse_selector(bad).is_err(), "{bad}");
    }
    assert_eq!(
        scope::parse_selector("a=b, c!=d,e,!f").unwrap(),
        [
            LabelTerm::Is("a".into(), "b".into()),
            LabelTerm::IsNot("c".into(), "d".into()),
            LabelTerm::Has("e".into()),
            LabelTerm::HasNot("f".into()),
        ]
    );
}

/// A rollout of a big fleet: batches grow to the maximum and cover every node once.
#[test]
fn a_simulated_rollout_covers_every_node_once_in_growing_batches() {
    let v = fleet(3, 40);
    let o = PlanOpts {
        per_domain: Some(Budget::Percent(25)),
        ..Default::default()
    };
    let steps = plan(&v, &o).unwrap();
    let all = batch::simulate(&v, &o, &steps, Budget::Percent(10).of(120));
    let sizes: Vec<usize> = all.iter().map(|b| b.len()).collect();
    assert_eq!(&sizes[..5], [1, 2, 4, 8, 12], "{sizes:?}");
    let mut seen: Vec<&str> = all.iter().flat_map(|b| names(b)).collect();
    assert_eq!(seen.len(), 120);
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 120, "each node once");
}
