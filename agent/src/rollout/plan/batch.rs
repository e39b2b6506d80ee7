//! Batches (pure): which of the planned steps go together, so a fleet is stepped several
//! nodes at a time without two restarts that hurt together. A batch holds at most its size;
//! at most a per-domain limit of nodes of one failure domain (a node label, the zone by
//! default); at most one control-plane node; never two lease holders of one VIP group; and
//! never a lease holder together with a node its VIPs may move to (a node with a ready local
//! backend under `externalTrafficPolicy: Local`; any node otherwise, so such a holder is
//! stepped alone). A retry goes alone. Sizes grow 1, 2, 4, … up to the maximum while every
//! verdict passes: the canary (or the first node) alone first.
use super::{ClusterView, PlanOpts, PlannedStep};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// How many nodes: a count or a percentage of a total (`--max-unavailable 10%`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Budget {
    Count(usize),
    Percent(u32),
}

impl Budget {
    /// `N` (at least 1) or `P%` (1 to 100).
    pub fn parse(s: &str) -> Result<Budget, String> {
        let s = s.trim();
        if let Some(p) = s.strip_suffix('%') {
            return match p.trim().parse::<u32>() {
                Ok(p) if (1..=100).contains(&p) => Ok(Budget::Percent(p)),
                _ => Err(format!(
                    "{s:?}: a percentage is 1% to 100% (a whole number)"
                )),
            };
        }
        match s.parse::<usize>() {
            Ok(n) if n >= 1 => Ok(Budget::Count(n)),
            _ => Err(format!(
                "{s:?}: give a number of nodes (1 or more) or a percentage such as 10%"
            )),
        }
    }

    /// The number of nodes out of `total`: a percentage rounded up, as the DaemonSet
    /// controller rounds `maxUnavailable`; never less than 1.
    pub fn of(&self, total: usize) -> usize {
        match *self {
            Budget::Count(n) => n.max(1),
            Budget::Percent(p) => (total * p as usize).div_ceil(100).max(1),
        }
    }

    /// A per-domain limit out of a domain's `total` nodes: a percentage rounded down (a
    /// domain is never emptied beyond its share), never less than 1.
    pub fn of_down(&self, total: usize) -> usize {
        match *self {
            Budget::Count(n) => n.max(1),
            Budget::Percent(p) => (total * p as usize / 100).max(1),
        }
    }
}

impl std::fmt::Display for Budget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Budget::Count(n) => write!(f, "{n}"),
            Budget::Percent(p) => write!(f, "{p}%"),
        }
    }
}

/// The batch sizes of a rollout: 1 first, then doubled after every batch whose verdicts
/// all passed, up to `max`.
pub fn next_size(last: Option<usize>, max: usize) -> usize {
    match last {
        None => 1,
        Some(n) => (n * 2).min(max.max(1)),
    }
}

/// A node's failure domain: the domain label's value; control-plane nodes are one domain
/// of their own; nodes without the label share one.
pub fn domain_of(v: &ClusterView, o: &PlanOpts, node: &str) -> String {
    let n = v.nodes.iter().find(|n| n.name == node);
    if n.is_some_and(|n| n.control_plane) {
        return "control plane".into();
    }
    let zone = n
        .and_then(|n| n.zone.as_ref())
        .filter(|_| o.domain_label == super::ZONE_LABEL);
    match n.and_then(|n| n.labels.get(&o.domain_label)).or(zone) {
        Some(d) => format!("{}={d}", o.domain_label),
        None => format!("no {} label", o.domain_label),
    }
}

/// The nodes a holder's VIPs may move to when it restarts: those with a ready local backend
/// (`externalTrafficPolicy: Local`), or every node (None) when the lease names none.
fn takers(v: &ClusterView, holder: &str) -> Option<BTreeSet<String>> {
    let mut all = BTreeSet::new();
    for l in v
        .leases
        .iter()
        .filter(|l| l.holder.as_deref() == Some(holder))
    {
        all.extend(
            l.local_backends
                .clone()?
                .into_iter()
                .filter(|n| n != holder),
        );
    }
    Some(all)
}

/// The VIP groups a node's leases belong to (a lease in no group is a group of its own).
fn groups(v: &ClusterView, o: &PlanOpts, node: &str) -> BTreeSet<String> {
    v.leases
        .iter()
        .filter(|l| l.holder.as_deref() == Some(node))
        .map(|l| {
            o.vip_groups
                .iter()
                .find(|(_, s)| s.iter().any(|x| x == &l.service))
                .map(|(g, _)| g.clone())
                .unwrap_or_else(|| l.service.clone())
        })
        .collect()
}

/// The batch to step now: the planned steps (in the plan's order) that go together, at most
/// `size`, the first step always among them.
pub fn batch(
    v: &ClusterView,
    o: &PlanOpts,
    steps: &[PlannedStep],
    size: usize,
) -> Vec<PlannedStep> {
    let in_domain: BTreeMap<String, usize> = v.pods.iter().fold(BTreeMap::new(), |mut m, p| {
        *m.entry(domain_of(v, o, &p.node)).or_default() += 1;
        m
    });
    let mut out: Vec<PlannedStep> = Vec::new();
    let mut per: BTreeMap<String, usize> = BTreeMap::new();
    // The nodes the batch's holders' VIPs may move to (None: any node: the batch is closed).
    let mut taken: Option<BTreeSet<String>> = Some(BTreeSet::new());
    let mut held_groups: BTreeSet<String> = BTreeSet::new();
    for s in steps {
        if out.len() >= size.max(1) || taken.is_none() {
            break;
        }
        if !out.is_empty() && (s.why == "retry" || out[0].why == "retry") {
            break;
        }
        let d = domain_of(v, o, &s.node);
        let limit = if d == "control plane" {
            1
        } else {
            o.per_domain
                .map(|b| b.of_down(in_domain.get(&d).copied().unwrap_or(1)))
                .unwrap_or(usize::MAX)
        };
        if per.get(&d).copied().unwrap_or(0) >= limit {
            continue;
        }
        let mine = taken.as_ref().is_some_and(|t| t.contains(&s.node));
        if mine {
            continue;
        }
        if !s.moves.is_empty() {
            let g = groups(v, o, &s.node);
            if !g.is_disjoint(&held_groups) {
                continue;
            }
            match takers(v, &s.node) {
                None if !out.is_empty() => continue,
                None => taken = None,
                Some(t) => {
                    if out.iter().any(|m| t.contains(&m.node)) {
                        continue;
                    }
                    if let Some(all) = taken.as_mut() {
                        all.extend(t);
                    }
                }
            }
            held_groups.extend(g);
        }
        *per.entry(d).or_default() += 1;
        out.push(s.clone());
    }
    out
}

/// How long to wait before a batch: `--pause-between` after the first, and at least the
/// longest lease when it and the batch before it both move VIPs (the VIPs moved by the one
/// before have a new holder that may be in this one).
pub fn pause(
    v: &ClusterView,
    o: &PlanOpts,
    first: bool,
    after_holders: bool,
    b: &[PlannedStep],
) -> Duration {
    if first {
        return Duration::ZERO;
    }
    let holders = b.iter().any(|s| !s.moves.is_empty());
    if holders && after_holders {
        let longest = v
            .leases
            .iter()
            .map(|l| l.duration)
            .max()
            .unwrap_or_default();
        o.pause_between.max(longest)
    } else {
        o.pause_between
    }
}

/// The whole rollout as batches, were every verdict to pass (for `--dry-run`): the sizes
/// growing from 1 to `max`.
pub fn simulate(
    v: &ClusterView,
    o: &PlanOpts,
    steps: &[PlannedStep],
    max: usize,
) -> Vec<Vec<PlannedStep>> {
    let mut left: Vec<PlannedStep> = steps.to_vec();
    let mut out = Vec::new();
    let mut size = None;
    while !left.is_empty() {
        let n = next_size(size, max);
        let b = batch(v, o, &left, n);
        left.retain(|s| !b.iter().any(|x| x.node == s.node));
        size = Some(n);
        out.push(b);
    }
    out
}
