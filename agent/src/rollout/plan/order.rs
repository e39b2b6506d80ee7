//! The order of a rollout's steps, once nothing refuses it: a retry first, the canary, then
//! workers without leases interleaved by zone, then lease holders (holders of one VIP group
//! never back to back), then control-plane nodes; with each step's pause and expected blip.
use super::refusals::{standing, Inputs, Standing};
use super::{expected_blip, CiliumPod, PlannedStep};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// The nodes to step, in order.
pub fn order(i: &Inputs) -> Vec<PlannedStep> {
    let (v, o, rev) = (i.v, i.o, i.rev);
    let unproven: BTreeMap<&str, String> = v
        .pods
        .iter()
        .filter_map(|p| match standing(i, p)? {
            Standing::Unproven(why) => Some((p.node.as_str(), why)),
            _ => None,
        })
        .collect();
    let node = |name: &str| v.nodes.iter().find(|n| n.name == name);
    let held = |name: &str| -> Vec<String> {
        v.leases
            .iter()
            .filter(|l| l.holder.as_deref() == Some(name))
            .map(|l| l.service.clone())
            .collect()
    };
    let again = o
        .again
        .as_deref()
        .and_then(|n| v.pods.iter().find(|p| p.node == n));
    let mut todo: Vec<&CiliumPod> = v
        .pods
        .iter()
        .filter(|p| {
            (p.revision != rev || unproven.contains_key(p.node.as_str()))
                && !o.skip.contains(&p.node)
                && super::scope::in_scope(v, o, &p.node)
        })
        .filter(|p| again.is_none_or(|a| a.node != p.node))
        .collect();
    todo.sort_by(|a, b| a.node.cmp(&b.node));
    let canary = o.canary.clone().or_else(|| {
        let (k, val) = o.canary_label.as_ref()?;
        todo.iter()
            .find(|p| node(&p.node).is_some_and(|n| n.labels.get(k) == Some(val)))
            .map(|p| p.node.clone())
    });
    let mut order: Vec<(&CiliumPod, String)> = Vec::new();
    if let Some(p) = again {
        order.push((p, "retry".into()));
    }
    if let Some(c) = &canary {
        if let Some(i) = todo.iter().position(|p| &p.node == c) {
            order.push((todo.remove(i), "canary".into()));
        }
    }
    let cp = |p: &CiliumPod| node(&p.node).is_some_and(|n| n.control_plane);
    // Workers without leases, interleaved by zone.
    let mut zones: BTreeMap<String, Vec<&CiliumPod>> = BTreeMap::new();
    for p in todo.iter().filter(|p| !cp(p) && held(&p.node).is_empty()) {
        let z = node(&p.node)
            .and_then(|n| n.zone.clone())
            .unwrap_or_default();
        zones.entry(z).or_default().push(p);
    }
    let mut queues: Vec<std::collections::VecDeque<&CiliumPod>> =
        zones.into_values().map(Into::into).collect();
    loop {
        let mut any = false;
        for q in &mut queues {
            if let Some(p) = q.pop_front() {
                let z = node(&p.node).and_then(|n| n.zone.clone());
                order.push((
                    p,
                    match z {
                        Some(z) => format!("worker (zone {z})"),
                        None => "worker".into(),
                    },
                ));
                any = true;
            }
        }
        if !any {
            break;
        }
    }
    // Lease holders, then control-plane nodes; holders of one VIP group never back to back.
    let group_of = |svc: &str| -> String {
        o.vip_groups
            .iter()
            .find(|(_, s)| s.iter().any(|x| x == svc))
            .map(|(g, _)| g.clone())
            .unwrap_or_else(|| svc.to_string())
    };
    let groups = |n: &str| -> BTreeSet<String> { held(n).iter().map(|s| group_of(s)).collect() };
    for control_plane in [false, true] {
        let mut rest: Vec<&CiliumPod> = todo
            .iter()
            .copied()
            .filter(|p| cp(p) == control_plane && (control_plane || !held(&p.node).is_empty()))
            .collect();
        while !rest.is_empty() {
            let prev: BTreeSet<String> = order
                .last()
                .map(|(p, _)| groups(&p.node))
                .unwrap_or_default();
            let i = rest
                .iter()
                .position(|p| groups(&p.node).is_disjoint(&prev))
                .unwrap_or(0);
            let p = rest.remove(i);
            let why = if control_plane {
                "control plane".to_string()
            } else {
                "lease holder".to_string()
            };
            order.push((p, why));
        }
    }
    let longest_lease = v
        .leases
        .iter()
        .map(|l| l.duration)
        .max()
        .unwrap_or(Duration::ZERO);
    let mut out: Vec<PlannedStep> = Vec::new();
    for (p, why) in order {
        let moves = held(&p.node);
        let after_holder = out.last().is_some_and(|s| !s.moves.is_empty());
        let pause_before = if out.is_empty() {
            Duration::ZERO
        } else if after_holder && !moves.is_empty() {
            o.pause_between.max(longest_lease)
        } else {
            o.pause_between
        };
        let blip = (!moves.is_empty()).then(|| {
            let lease = v
                .leases
                .iter()
                .filter(|l| moves.contains(&l.service))
                .map(|l| l.duration)
                .max()
                .unwrap_or(Duration::ZERO);
            let mut b = expected_blip(lease, &v.l2_timings);
            b.no_taker = v
                .leases
                .iter()
                .filter(|l| moves.contains(&l.service))
                .filter(|l| {
                    l.local_backends
                        .as_ref()
                        .is_some_and(|nodes| nodes.iter().all(|n| n == &p.node))
                })
                .map(|l| l.service.clone())
                .collect();
            b
        });
        let why = match unproven.get(p.node.as_str()) {
            Some(u) if why != "retry" => format!("{why}; on the revision but not proven: {u}"),
            _ => why,
        };
        out.push(PlannedStep {
            node: p.node.clone(),
            pod: p.name.clone(),
            pod_uid: p.uid.clone(),
            why,
            moves,
            pause_before,
            blip,
        });
    }
    // The partition: only so many nodes leave their older revision; the last in the order
    // stay (a node on the revision that its agent cannot yet vouch for is still proven).
    let mut movable = super::scope::movable(v, o, rev);
    out.retain(|s| {
        let old = v.pods.iter().any(|p| p.node == s.node && p.revision != rev);
        if !old || s.why == "retry" {
            return true;
        }
        let keep = movable > 0;
        movable = movable.saturating_sub(1);
        keep
    });
    if let Some(m) = o.max_nodes {
        out.truncate(m);
    }
    out
}
