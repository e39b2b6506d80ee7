//! The rollout plan, from a view of the cluster (pure): which nodes' cilium pods are not on the
//! DaemonSet's current revision, in which order to step them, which L2-announced VIPs move at
//! each step, and why the rollout must not start at all.

pub use crate::step::proof::{Proof, ProofStatus};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct NodeInfo {
    pub name: String,
    pub ready: bool,
    pub zone: Option<String>,
    pub control_plane: bool,
    pub labels: BTreeMap<String, String>,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct CiliumPod {
    pub name: String,
    pub uid: String,
    pub node: String,
    /// `controller-revision-hash` label.
    pub revision: String,
    pub ready: bool,
    /// The cilium-agent container's image.
    pub image: String,
    /// Bound to its node by the scheduler (`spec.nodeName`); a Pending pod is not yet, and
    /// belongs to the node its required node affinity names.
    pub bound: bool,
    /// A container (or init container) waiting in `CrashLoopBackOff`: its restart count.
    pub crash_looping: Option<i32>,
    /// When the cilium-agent container now running started (`state.running.startedAt`, unix
    /// seconds): the start a proof must cover.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<f64>,
}

/// The cilium-operator Deployment, as read.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum Operator {
    /// Not looked at (`--operator ''`).
    #[default]
    NotChecked,
    Found {
        name: String,
        ready: i32,
        desired: i32,
    },
    /// Not found, or could not be read: why.
    Unknown { name: String, problem: String },
}

/// A Cilium L2-announcement lease (`cilium-l2announce-<ns>-<svc>`).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct L2Lease {
    /// `<ns>-<svc>` (the lease name without the prefix).
    pub service: String,
    pub holder: Option<String>,
    pub duration: Duration,
    /// With `externalTrafficPolicy: Local`, the nodes with a ready backend of the Service:
    /// only they may announce it (`pkg/l2announcer/l2announcer.go` l. 413, 682: a node
    /// without a local backend is no candidate). None: `Cluster`, or not read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_backends: Option<Vec<String>>,
}

/// What the plan is made from.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ClusterView {
    pub daemonset: String,
    /// `spec.updateStrategy.type` (the API's default is RollingUpdate).
    pub update_strategy: String,
    /// `status.numberUnavailable`.
    pub number_unavailable: i32,
    pub operator: Operator,
    /// Pods the DaemonSet's selector matches that it does not own (another controller's, or
    /// nobody's): never stepped, shown.
    pub foreign: Vec<String>,
    pub generation: i64,
    pub observed_generation: i64,
    /// The current revision: (hash, number).
    pub revision: Option<(String, i64)>,
    /// The Cilium minor version of the current revision's image (e.g. "1.18").
    pub cilium_version: Option<String>,
    pub nodes: Vec<NodeInfo>,
    pub pods: Vec<CiliumPod>,
    /// The stepguard agent per node (URL).
    pub agents: BTreeMap<String, String>,
    /// The device set each agent reports (`devices` check), or why it could not be read.
    pub devices: BTreeMap<String, Result<Vec<String>, String>>,
    pub leases: Vec<L2Lease>,
    /// The timings the expected blips are computed from.
    pub l2_timings: L2Timings,
    /// For each node whose cilium pod is on the current revision: its agent's proof for the
    /// cilium-agent container's current start (`GET /v1/proof`), or why it could not be read.
    pub proofs: BTreeMap<String, Result<Proof, String>>,
}

/// Cilium's L2-announcement timings beyond each lease's duration, and the agent pod's grace.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct L2Timings {
    /// `l2-announcements-renew-deadline`.
    #[serde(with = "crate::step::secs")]
    pub renew: Duration,
    /// `l2-announcements-retry-period`.
    #[serde(with = "crate::step::secs")]
    pub retry: Duration,
    /// The cilium-agent pod's `terminationGracePeriodSeconds` (the DaemonSet's template).
    #[serde(with = "crate::step::secs")]
    pub grace: Duration,
    /// Where `renew` and `retry` came from: the ConfigMap, or Cilium's defaults and why.
    pub source: String,
}

impl Default for L2Timings {
    /// Cilium's defaults (5 s, 2 s) and the chart's grace (1 s).
    fn default() -> Self {
        Self {
            renew: Duration::from_secs(5),
            retry: Duration::from_secs(2),
            grace: Duration::from_secs(1),
            source: "Cilium's defaults".into(),
        }
    }
}

/// client-go's `leaderelection.JitterFactor`: a candidate tries again after
/// `retry × (1 + rand × 1.2)` (`wait.JitterUntil`).
pub const LEASE_JITTER: f64 = 1.2;

/// What a lease holder's step is expected to do to the VIPs it announces (seconds), from the
/// lease timings and what two real cilium-agents 1.20.2 were measured to do
/// (`docs/cilium-fidelity.md`, "L2 announcements on two real agents"). Clients that resolved a
/// VIP keep reaching this node's datapath until the new holder's gratuitous ARP: no outage for
/// them while it forwards.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ExpectedBlip {
    /// A client that resolves a moving VIP before the takeover waits at most this long: the
    /// stopping agent deletes its responder entry and releases the lease at once, and the
    /// next node takes it at its next jittered retry (`retry × (1 + 1.2)`).
    pub resolving_max_s: f64,
    /// When the release does not land within the grace (the API server slow or away) the
    /// lease expires first: from a lease duration less one retry period (the holder renews
    /// every retry period, so its last renewal may precede the stop by one) to a lease
    /// duration and two jittered retries (the candidate counts from its own observation of the
    /// last renewal, then tries at its next jittered retry).
    pub unreleased_min_s: f64,
    pub unreleased_max_s: f64,
    /// The longest lease among the VIPs that move.
    pub lease_s: f64,
    pub retry_s: f64,
    pub grace_s: f64,
    pub timings: String,
    /// Moving VIPs no other node may take over (`externalTrafficPolicy: Local`, no ready
    /// backend elsewhere): a client resolving one meanwhile waits until the restarted agent
    /// announces it again.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub no_taker: Vec<String>,
}

/// The expected blip of a step that moves VIPs whose longest lease is `lease`. The timings
/// are first made sane as the agent makes them (`pkg/l2announcer/l2announcer.go`
/// `leaseTimings`, v1.20.2): a lease not above the renew deadline halves it, a renew deadline
/// not above `1.2 × retry` halves the retry period.
pub fn expected_blip(lease: Duration, t: &L2Timings) -> ExpectedBlip {
    let lease = lease.max(Duration::from_secs(1));
    let renew = if lease <= t.renew { lease / 2 } else { t.renew };
    let retry = if renew.as_secs_f64() <= LEASE_JITTER * t.retry.as_secs_f64() {
        renew / 2
    } else {
        t.retry
    };
    let jittered = retry.as_secs_f64() * (1.0 + LEASE_JITTER);
    ExpectedBlip {
        resolving_max_s: jittered,
        unreleased_min_s: (lease.as_secs_f64() - retry.as_secs_f64()).max(0.0),
        unreleased_max_s: lease.as_secs_f64() + 2.0 * jittered,
        lease_s: lease.as_secs_f64(),
        retry_s: retry.as_secs_f64(),
        grace_s: t.grace.as_secs_f64(),
        timings: t.source.clone(),
        no_taker: vec![],
    }
}

impl ExpectedBlip {
    /// One line for people.
    pub fn text(&self) -> String {
        let mut s = format!(
            "expected LAN blip: none for clients that resolved the VIP (this node forwards until the takeover); up to {:.1}s for a client resolving it meanwhile; {:.1}-{:.1}s if the lease is not released within the {}s grace (lease {}s, retry {}s: {})",
            self.resolving_max_s,
            self.unreleased_min_s,
            self.unreleased_max_s,
            self.grace_s,
            self.lease_s,
            self.retry_s,
            self.timings
        );
        if !self.no_taker.is_empty() {
            s.push_str(&format!(
                "; {}: externalTrafficPolicy Local with no ready backend on another node, so nobody takes the lease over: a client resolving it meanwhile waits until the restarted cilium-agent announces it again (its restart, not the lease timings, bounds that)",
                self.no_taker.join(", ")
            ));
        }
        s
    }
}

#[derive(Clone, Debug, Default)]
pub struct PlanOpts {
    pub canary: Option<String>,
    pub canary_label: Option<(String, String)>,
    pub max_nodes: Option<usize>,
    /// VIP group → lease services (`<ns>-<svc>`): holders of one group are never stepped back
    /// to back (clients with two resolvers keep one).
    pub vip_groups: BTreeMap<String, Vec<String>>,
    pub pause_between: Duration,
    /// Nodes a person left as they are on this revision (`--skip`): not stepped.
    pub skip: BTreeSet<String>,
    /// A node a person asked to step again (`--retry`): first, whatever its revision.
    pub again: Option<String>,
    /// A person allows a revision more than one Cilium minor version away (`--allow-minor-skip`).
    pub allow_minor_skip: bool,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct PlannedStep {
    pub node: String,
    pub pod: String,
    pub pod_uid: String,
    /// Why it is here in the order: canary, worker (zone), lease holder, control plane.
    pub why: String,
    /// L2-announced VIPs (lease services) that move when this node's agent restarts.
    pub moves: Vec<String>,
    /// Wait this long before stepping the node (lease holders after another holder wait at
    /// least a lease duration).
    #[serde(with = "crate::step::secs")]
    pub pause_before: Duration,
    /// For a step that moves VIPs: what LAN clients should expect.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub blip: Option<ExpectedBlip>,
}

/// Why a rollout must not start. Listed in this order (README, "Stepping a Cilium rollout").
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "refusal", rename_all = "snake_case")]
pub enum Refusal {
    /// The controller deletes pods itself (RollingUpdate), at the same time as the stepper.
    NotOnDelete {
        strategy: String,
    },
    /// `status.observedGeneration` has not caught up: the controller's counts are stale.
    NotObserved {
        generation: i64,
        observed: i64,
    },
    NoRevision,
    /// Cilium upgrades (and downgrades) one minor version at a time.
    MinorSkip {
        from: String,
        to: String,
        nodes: Vec<String>,
    },
    NodeNotReady {
        node: String,
    },
    PodCrashLooping {
        node: String,
        pod: String,
        restarts: i32,
    },
    PodNotReady {
        node: String,
        pod: String,
    },
    /// A cilium pod Pending, not bound to a node (the node it is for, from its affinity).
    PodUnbound {
        pod: String,
        node: String,
    },
    /// `status.numberUnavailable` beyond what the nodes a person skipped explain.
    Unavailable {
        unavailable: i32,
    },
    OperatorNotReady {
        name: String,
        ready: i32,
        desired: i32,
    },
    OperatorUnknown {
        name: String,
        problem: String,
    },
    AgentMissing {
        node: String,
    },
    DevicesUnknown {
        node: String,
        problem: String,
    },
    /// Nodes on the same revision report different device sets.
    DevicesDiffer {
        revision: String,
        sets: BTreeMap<String, Vec<String>>,
    },
    /// A node's cilium pod is on the current revision and its agent's step for that pod's
    /// start failed: the rollout halts there (a person decides: `--retry`, `--skip`).
    VerdictFailed {
        node: String,
        pod: String,
        step: Option<String>,
        why: String,
    },
    /// A step that covers (or may cover) a node's current start has no verdict yet.
    ProofPending {
        node: String,
        why: String,
    },
    /// A node's agent could not be asked for the proof of its cilium pod's start.
    ProofUnknown {
        node: String,
        problem: String,
    },
    /// `--canary` names no node running a cilium pod, or `--canary-label` matches none.
    CanaryUnknown {
        canary: String,
    },
}

impl Refusal {
    /// Whether this refusal halts the rollout (a person must decide) rather than being
    /// waited out.
    pub fn halts(&self) -> bool {
        matches!(self, Refusal::VerdictFailed { .. })
    }

    /// Whether this refusal is only a wait (a verification still to be decided): a run does
    /// not refuse to start on it, it waits, and never ends while it stands.
    pub fn waits(&self) -> bool {
        matches!(self, Refusal::ProofPending { .. })
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::NotOnDelete { strategy } => write!(f, "the DaemonSet's updateStrategy is {strategy}: the controller deletes pods itself, at the same time as the stepper; set `updateStrategy: OnDelete` (the chart's `updateStrategy.type`)"),
            Refusal::NotObserved { generation, observed } => write!(f, "the DaemonSet's status is stale (generation {generation}, observedGeneration {observed}): its counts cannot be trusted yet"),
            Refusal::NoRevision => write!(f, "no ControllerRevision owned by the DaemonSet: its current revision is unknown"),
            Refusal::MinorSkip { from, to, nodes } => write!(f, "the revision's Cilium {to} is more than one minor version from {from} (on {}): Cilium upgrades one minor version at a time; step through the versions between, or `--allow-minor-skip` if you decided otherwise", nodes.join(", ")),
            Refusal::NodeNotReady { node } => write!(f, "node {node} is NotReady"),
            Refusal::PodCrashLooping { node, pod, restarts } => write!(f, "cilium pod {pod} on node {node} is crash-looping (CrashLoopBackOff, {restarts} restarts)"),
            Refusal::PodNotReady { node, pod } => write!(f, "cilium pod {pod} on node {node} is not Ready"),
            Refusal::PodUnbound { pod, node } => write!(f, "cilium pod {pod} (for node {node}) is Pending, not bound to a node"),
            Refusal::Unavailable { unavailable } => write!(f, "the DaemonSet reports {unavailable} unavailable pods (status.numberUnavailable)"),
            Refusal::OperatorNotReady { name, ready, desired } => write!(f, "cilium-operator {name} is not Ready: {ready} of {desired} replicas Ready"),
            Refusal::OperatorUnknown { name, problem } => write!(f, "cilium-operator {name} is unknown: {problem} (`--operator NAMESPACE/NAME`, or `--operator ''` where Cilium runs without one)"),
            Refusal::AgentMissing { node } => write!(f, "no stepguard agent on node {node}: a step there could not be verified"),
            Refusal::DevicesUnknown { node, problem } => write!(f, "the device set of node {node} is unknown: {problem}"),
            Refusal::DevicesDiffer { revision, sets } => write!(
                f,
                "nodes on revision {revision} report different device sets: {}",
                sets.iter().map(|(set, nodes)| format!("[{set}] on {}", nodes.join(", "))).collect::<Vec<_>>().join("; ")
            ),
            Refusal::VerdictFailed { node, pod, why, .. } => write!(f, "node {node}'s cilium pod {pod} is on the current revision and failed its verification: {why}; the rollout halts here (`--retry {node}` steps it again, `--skip {node}` leaves it)"),
            Refusal::ProofPending { node, why } => write!(f, "node {node}'s verification is not decided yet: {why}"),
            Refusal::ProofUnknown { node, problem } => write!(f, "node {node}'s proof cannot be read from its agent: {problem}"),
            Refusal::CanaryUnknown { canary } => write!(f, "the canary {canary} is no node running a cilium pod of the DaemonSet (misspelled?)"),
        }
    }
}

/// The nodes to step, in order, or every reason not to start.
pub fn plan(v: &ClusterView, o: &PlanOpts) -> Result<Vec<PlannedStep>, Vec<Refusal>> {
    let mut refusals = Vec::new();
    if v.update_strategy != "OnDelete" {
        refusals.push(Refusal::NotOnDelete {
            strategy: v.update_strategy.clone(),
        });
    }
    if v.observed_generation < v.generation {
        refusals.push(Refusal::NotObserved {
            generation: v.generation,
            observed: v.observed_generation,
        });
    }
    let Some((rev, _)) = &v.revision else {
        refusals.push(Refusal::NoRevision);
        return Err(refusals);
    };
    if !o.allow_minor_skip {
        if let Some(to) = v.cilium_version.as_deref() {
            let mut far: BTreeMap<String, Vec<String>> = BTreeMap::new();
            for p in v
                .pods
                .iter()
                .filter(|p| &p.revision != rev && !o.skip.contains(&p.node))
            {
                if let Some(from) = crate::rollout::image_minor(&p.image) {
                    if !adjacent_minors(&from, to) {
                        let nodes = far.entry(from).or_default();
                        nodes.push(p.node.clone());
                        nodes.sort();
                    }
                }
            }
            for (from, nodes) in far {
                refusals.push(Refusal::MinorSkip {
                    from,
                    to: to.to_string(),
                    nodes,
                });
            }
        }
    }
    let with_pod: BTreeSet<&str> = v.pods.iter().map(|p| p.node.as_str()).collect();
    for n in v
        .nodes
        .iter()
        .filter(|n| with_pod.contains(n.name.as_str()) && !o.skip.contains(&n.name))
    {
        if !n.ready {
            refusals.push(Refusal::NodeNotReady {
                node: n.name.clone(),
            });
        }
    }
    // The other nodes' cilium pods: a node a person left as it is (`--skip`) is known bad.
    let mut explained = 0;
    let (mut crashing, mut not_ready, mut unbound) = (vec![], vec![], vec![]);
    let mut by_node: Vec<&CiliumPod> = v.pods.iter().collect();
    by_node.sort_by(|a, b| (&a.node, &a.name).cmp(&(&b.node, &b.name)));
    for p in by_node {
        if o.skip.contains(&p.node) {
            explained += i32::from(!p.ready);
            continue;
        }
        let (node, pod) = (p.node.clone(), p.name.clone());
        if !p.bound {
            unbound.push(Refusal::PodUnbound { pod, node });
        } else if let Some(restarts) = p.crash_looping {
            crashing.push(Refusal::PodCrashLooping {
                node,
                pod,
                restarts,
            });
        } else if !p.ready {
            not_ready.push(Refusal::PodNotReady { node, pod });
        }
    }
    refusals.extend(crashing.into_iter().chain(not_ready).chain(unbound));
    let node_of = |name: &str| v.nodes.iter().find(|n| n.name == name);
    if let Some(c) = &o.canary {
        if !with_pod.contains(c.as_str()) {
            refusals.push(Refusal::CanaryUnknown { canary: c.clone() });
        }
    } else if let Some((k, val)) = &o.canary_label {
        if !with_pod
            .iter()
            .any(|n| node_of(n).is_some_and(|n| n.labels.get(k) == Some(val)))
        {
            refusals.push(Refusal::CanaryUnknown {
                canary: format!("label {k}={val}"),
            });
        }
    }
    if v.number_unavailable > explained {
        refusals.push(Refusal::Unavailable {
            unavailable: v.number_unavailable,
        });
    }
    match &v.operator {
        Operator::NotChecked => {}
        Operator::Found {
            name,
            ready,
            desired,
        } => {
            if ready < desired || *desired == 0 {
                refusals.push(Refusal::OperatorNotReady {
                    name: name.clone(),
                    ready: *ready,
                    desired: *desired,
                });
            }
        }
        Operator::Unknown { name, problem } => refusals.push(Refusal::OperatorUnknown {
            name: name.clone(),
            problem: problem.clone(),
        }),
    }
    for n in with_pod.iter().filter(|n| !o.skip.contains(**n)) {
        if !v.agents.contains_key(*n) {
            refusals.push(Refusal::AgentMissing {
                node: n.to_string(),
            });
        }
    }
    // Homogeneity within a revision: mid-rollout, old and new revisions may differ.
    let mut by_rev: BTreeMap<&str, BTreeMap<String, Vec<String>>> = BTreeMap::new();
    for p in v.pods.iter().filter(|p| !o.skip.contains(&p.node)) {
        match v.devices.get(&p.node) {
            Some(Ok(d)) => {
                let mut d = d.clone();
                d.sort();
                by_rev
                    .entry(&p.revision)
                    .or_default()
                    .entry(d.join(","))
                    .or_default()
                    .push(p.node.clone());
            }
            Some(Err(e)) if v.agents.contains_key(&p.node) => {
                refusals.push(Refusal::DevicesUnknown {
                    node: p.node.clone(),
                    problem: e.clone(),
                })
            }
            _ => {}
        }
    }
    for (r, sets) in by_rev {
        if sets.len() > 1 {
            refusals.push(Refusal::DevicesDiffer {
                revision: r.to_string(),
                sets,
            });
        }
    }
    // A pod on the current revision is done only when its agent proves the cilium-agent's
    // current start passed; one it cannot vouch for is stepped to prove it.
    let mut unproven: BTreeMap<&str, String> = BTreeMap::new();
    for p in v.pods.iter().filter(|p| &p.revision == rev) {
        if o.skip.contains(&p.node) || o.again.as_deref() == Some(p.node.as_str()) {
            continue;
        }
        if !v.agents.contains_key(&p.node) {
            continue;
        }
        match v.proofs.get(&p.node) {
            Some(Ok(pr)) => match pr.status {
                ProofStatus::Passed => {}
                ProofStatus::Failed => refusals.push(Refusal::VerdictFailed {
                    node: p.node.clone(),
                    pod: p.name.clone(),
                    step: pr.step.as_ref().map(|s| s.id.clone()),
                    why: pr.why.clone(),
                }),
                ProofStatus::Pending => refusals.push(Refusal::ProofPending {
                    node: p.node.clone(),
                    why: pr.why.clone(),
                }),
                ProofStatus::Unproven => {
                    unproven.insert(&p.node, pr.why.clone());
                }
            },
            Some(Err(e)) => refusals.push(Refusal::ProofUnknown {
                node: p.node.clone(),
                problem: e.clone(),
            }),
            None if p.started_at.is_none() => {
                unproven.insert(
                    &p.node,
                    "its cilium-agent container reports no start time".into(),
                );
            }
            None => refusals.push(Refusal::ProofUnknown {
                node: p.node.clone(),
                problem: "not asked".into(),
            }),
        }
    }
    if !refusals.is_empty() {
        return Err(refusals);
    }

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
            (&p.revision != rev || unproven.contains_key(p.node.as_str()))
                && !o.skip.contains(&p.node)
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
    if let Some(m) = o.max_nodes {
        out.truncate(m);
    }
    Ok(out)
}

/// Whether a rollout from Cilium minor `from` to `to` ("1.19", "1.20") is one Cilium supports:
/// the same minor, or the next or previous one of the same major.
pub fn adjacent_minors(from: &str, to: &str) -> bool {
    let parse = |v: &str| -> Option<(u32, u32)> {
        let (a, b) = v.split_once('.')?;
        Some((a.parse().ok()?, b.parse().ok()?))
    };
    match (parse(from), parse(to)) {
        (Some((fa, fb)), Some((ta, tb))) => fa == ta && fb.abs_diff(tb) <= 1,
        // A version that cannot be read is not judged here (the step expects the version).
        _ => true,
    }
}

/// The plan for people: a line per step.
pub fn render(v: &ClusterView, steps: &[PlannedStep]) -> String {
    let mut s = format!(
        "plan for {}: revision {} (Cilium {}), {} of {} nodes to step\n",
        v.daemonset,
        v.revision
            .as_ref()
            .map(|r| format!("{} #{}", r.0, r.1))
            .unwrap_or_default(),
        v.cilium_version.as_deref().unwrap_or("?"),
        steps.len(),
        v.pods.len()
    );
    for f in &v.foreign {
        s.push_str(&format!(
            "  (pod {f} matches the DaemonSet's selector but is not its own: never stepped)\n"
        ));
    }
    for (i, st) in steps.iter().enumerate() {
        s.push_str(&format!(
            "  {:>2}. {:<20} {:<22} {}{}\n",
            i + 1,
            st.node,
            st.why,
            if st.moves.is_empty() {
                "no L2 lease".to_string()
            } else {
                format!("moves L2 VIPs: {}", st.moves.join(", "))
            },
            if st.pause_before.is_zero() {
                String::new()
            } else {
                format!(" (after a {}s pause)", st.pause_before.as_secs())
            }
        ));
        if let Some(b) = &st.blip {
            s.push_str(&format!("      {}\n", b.text()));
        }
    }
    s
}

#[cfg(test)]
mod tests;
