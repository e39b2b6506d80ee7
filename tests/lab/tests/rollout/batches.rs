//! Batches on the real control plane: several nodes stepped side by side (`--max-unavailable`),
//! spread over failure domains, lease holders never with the nodes their VIPs may move to,
//! every node's own verdict read; a failed verdict halting once its batch's verdicts are in; a
//! node joining or leaving the cluster in the middle of a batch.
use super::*;

/// The lab's zones: nodes 0 and 2 in zone a, 1 and 3 in zone b (4 and up in zone c).
fn zone(i: u8) -> &'static str {
    match i {
        0 | 2 => "a",
        1 | 3 => "b",
        _ => "c",
    }
}

fn label_zones(e: &Env) {
    for i in 0..e.registered() as u8 {
        e.k.merge(
            &e.k.all::<k8s_openapi::api::core::v1::Node>(),
            &node_name(i),
            json!({"metadata": {"labels": {"topology.kubernetes.io/zone": zone(i)}}}),
            false,
        )
        .expect("label the node's zone");
    }
}

/// Every VIP's Service with `externalTrafficPolicy: Local` and ready backends on nodes 0 and 1
/// only: Cilium's L2 announcer lets only them announce it, so a holder's VIPs may move only to
/// the other of the two.
fn local_services(e: &Env) {
    local_services_on(e, |_| vec!["node-0".into(), "node-1".into()]);
}

/// Every VIP's Service with `externalTrafficPolicy: Local` and ready backends on the nodes
/// `on` names for the VIP's holder.
fn local_services_on(e: &Env, on: impl Fn(&str) -> Vec<String>) {
    let vips: Vec<(String, String)> = e
        .lan
        .lock()
        .unwrap()
        .state
        .holders
        .iter()
        .map(|(v, h)| (v.clone(), node_name(*h)))
        .collect();
    for (vip, holder) in vips {
        let endpoints: Vec<Value> = on(&holder)
            .iter()
            .enumerate()
            .map(|(i, n)| {
                json!({"addresses": [format!("192.0.2.{}", 80 + i)], "nodeName": n,
                       "conditions": {"ready": true}})
            })
            .collect();
        local_service(e, &vip, endpoints);
    }
}

/// The stepper's batches as it told them: `batch N: a, b (…)` → [a, b].
fn batches(out: &str) -> Vec<Vec<String>> {
    out.lines()
        .filter_map(|l| {
            let rest = l.trim().strip_prefix("batch ")?;
            let (_, nodes) = rest.split_once(": ")?;
            let nodes = nodes.split(" (").next()?;
            Some(nodes.split(", ").map(String::from).collect())
        })
        .collect()
}

/// The first output line of a node's step containing `what`, by its position.
fn line_of(out: &str, node: &str, what: &str) -> Option<usize> {
    out.lines()
        .position(|l| l.starts_with('[') && l.contains(&format!(" {node} ")) && l.contains(what))
}

#[test]
fn batches_spread_over_zones_keep_vip_takers_apart_and_read_every_verdict() {
    let e = env_of(4, 4, None);
    label_zones(&e);
    local_services(&e);
    let args = [
        "--max-unavailable",
        "2",
        "--max-unavailable-per-domain",
        "1",
        "--vip-group",
        "dns=default-dns-a,default-dns-b",
    ];
    // The plan: workers first (a zone each in turn), then the holders; the canary alone, then
    // two at a time: node-0 (holding the gateway and dns-a, which may move only to node-1) goes
    // with node-3 (another zone, no taker of its VIPs), never with node-1.
    let mut dry = vec!["--dry-run"];
    dry.extend(args);
    let (code, out) = rollout(&e, &dry);
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        batches(&out),
        [vec!["node-2"], vec!["node-3", "node-0"], vec!["node-1"]],
        "{out}"
    );
    assert!(
        out.contains("in batches of up to 2 nodes (--max-unavailable 2, at most 1 of one topology.kubernetes.io/zone per batch)"),
        "{out}"
    );

    let rev = current_revision(&e.k).0;
    let (from_del, from_ev) = (deletions(&e).len(), events(&e));
    let (code, out) = rollout(&e, &args);
    assert_eq!(code, 0, "{out}");
    let b = batches(&out);
    assert_eq!(b.first().map(Vec::len), Some(1), "the canary alone: {out}");
    assert!(b.iter().all(|b| b.len() <= 2), "{b:?}\n{out}");
    for batch in &b {
        let zones: BTreeSet<&str> = batch
            .iter()
            .map(|n| zone(n.trim_start_matches("node-").parse().unwrap()))
            .collect();
        assert_eq!(
            zones.len(),
            batch.len(),
            "one node per zone in a batch: {b:?}\n{out}"
        );
        assert!(
            !(batch.contains(&"node-0".to_string()) && batch.contains(&"node-1".to_string())),
            "a holder with the node its VIPs move to: {b:?}\n{out}"
        );
    }
    // Side by side: both nodes of the pair deleted before either verdict was read.
    let pair = b.iter().find(|b| b.len() == 2).expect("a batch of two");
    let deleted: Vec<usize> = pair
        .iter()
        .map(|n| line_of(&out, n, "deleting pod").unwrap_or_else(|| panic!("{n}: {out}")))
        .collect();
    let passed: Vec<usize> = pair
        .iter()
        .map(|n| line_of(&out, n, "passed").unwrap_or_else(|| panic!("{n}: {out}")))
        .collect();
    assert!(
        deleted.iter().max() < passed.iter().min(),
        "both deleted before either verdict: {pair:?}\n{out}"
    );
    // Every node once, each proven by its own verdict.
    let d = deletions_since(&e, from_del);
    assert_eq!(
        counts(&d).values().copied().collect::<Vec<_>>(),
        [1, 1, 1, 1],
        "{d:?}\n{out}"
    );
    let mut proven = event_nodes(&e, &from_ev, "StepguardStepPassed");
    proven.sort();
    assert_eq!(proven, (0..4).map(node_name).collect::<Vec<_>>(), "{out}");
    assert!(all_on(&e, &rev), "{:?}", cilium_pods(&e));
    let (code, out) = rollout(&e, &["--dry-run"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("0 of 4 nodes to step"),
        "every node proven: {out}"
    );
}

#[test]
fn a_failed_verdict_in_a_batch_halts_once_its_verdicts_are_in_naming_every_node() {
    let e = env_of(4, 4, None);
    local_services(&e);
    // Batches node-2, then node-3 with node-0, then node-1: the first pod deleted in the
    // second batch comes back with an empty endpoint map.
    let from = deletions(&e).len();
    *e.fault_at.lock().unwrap() = Some(from + 2);
    let from_ev = events(&e);
    let (code, out) = rollout(&e, &["--max-unavailable", "2"]);
    assert_eq!(code, 1, "{out}");
    let d = deletions_since(&e, from);
    assert_eq!(d.len(), 3, "no delete after the failed batch: {d:?}\n{out}");
    assert!(!d.contains(&"node-1".to_string()), "{d:?}\n{out}");
    let failed = d[1].clone();
    let other = if failed == "node-3" {
        "node-0"
    } else {
        "node-3"
    };
    assert!(d.contains(&other.to_string()), "{d:?}\n{out}");
    // The other node's verdict was read before the halt, and the halt names the batch.
    assert!(
        event_nodes(&e, &from_ev, "StepguardStepPassed").contains(&other.to_string()),
        "{out}"
    );
    let halt = lock_annotation(&e, "stepguard.io/halt").expect("the halt is on the lock");
    assert!(
        halt.contains(&format!("{failed}: failed"))
            && halt.contains(&format!("{other}: passed"))
            && halt.contains("map_emptied"),
        "{halt}"
    );
    assert!(
        out.contains(&format!("the step on {failed} failed; its batch: ")),
        "{out}"
    );
    assert!(
        lock_annotation(&e, "stepguard.io/inflight").is_none(),
        "nothing left in flight: {:?}",
        lock(&e)
    );
    // The next run refuses, naming the batch's nodes.
    let (code, out) = rollout(&e, &["--max-unavailable", "2"]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains(&format!("{other}: passed")), "{out}");
    assert_eq!(deletions_since(&e, from).len(), 3);
}

#[test]
fn a_node_leaving_mid_batch_is_let_go_and_one_joining_is_proven() {
    // Four lab nodes, three in the cluster; each VIP's only backend on its holder, so nobody
    // takes a VIP over and the holders node-0 and node-1 share the second batch. While it is
    // in flight node-1 leaves the cluster and node-3 joins.
    let e = env_of(4, 3, None);
    local_services_on(&e, |holder| vec![holder.to_string()]);
    let from = deletions(&e).len();
    e.at.lock().unwrap().push(At {
        deletion: from + 2,
        at: Moment::Terminating,
        act: Box::new(|k: &Kube, _node: &str| {
            k.block(
                k.all::<k8s_openapi::api::core::v1::Node>()
                    .delete("node-1", &Default::default()),
            )
            .expect("node-1 leaves");
            stepguard_lab::kube::create_nodes(
                k,
                &[(node_name(3), stepguard_lab::lan::node_addr(3).to_string())],
            )
            .expect("node-3 joins");
        }),
    });
    // With no taker for their VIPs the two holders may share a batch, unless their VIPs are
    // one group (two resolvers a client fails over between): then never.
    let (code, dry) = rollout(
        &e,
        &[
            "--dry-run",
            "--max-unavailable",
            "2",
            "--vip-group",
            "dns=default-dns-a,default-dns-b",
        ],
    );
    assert_eq!(code, 0, "{dry}");
    assert_eq!(
        batches(&dry),
        [vec!["node-2"], vec!["node-0"], vec!["node-1"]],
        "{dry}"
    );
    let rev = current_revision(&e.k).0;
    let from_ev = events(&e);
    let (code, out) = rollout(&e, &["--max-unavailable", "2"]);
    assert_eq!(code, 0, "{out}");
    let b = batches(&out);
    assert_eq!(
        b.get(1),
        Some(&vec!["node-0".to_string(), "node-1".to_string()]),
        "the holders together in the second batch: {b:?}\n{out}"
    );
    assert!(
        out.contains("node node-1 left the cluster during its step"),
        "{out}"
    );
    assert_eq!(
        event_nodes(&e, &from_ev, "StepguardNodeGone"),
        ["node-1"],
        "{out}"
    );
    // The joining node's cilium pod is on the revision from its start; its agent proves it
    // (or it is stepped to be proven): no node is left unproven.
    wait_until(
        "every node of the cluster on the revision",
        Duration::from_secs(30),
        || all_on(&e, &rev),
        || format!("{:?}", cilium_pods(&e)),
    );
    let (code, dry) = rollout(&e, &["--dry-run"]);
    assert_eq!(code, 0, "{dry}");
    assert!(
        dry.contains("0 of 3 nodes to step"),
        "every node proven: {dry}\n{out}"
    );
    let proven = event_nodes(&e, &from_ev, "StepguardStepPassed");
    assert!(
        ["node-0", "node-2", "node-3"]
            .iter()
            .all(|n| proven.contains(&n.to_string())),
        "{proven:?}\n{out}"
    );
}
