//! Why a rollout must not start: the refusals and the rules that find them, one function
//! each, run in [`RULES`]' order (docs/rollout.md's, "Refusals"). A new refusal is a variant,
//! its sentence, a rule and its line in `RULES` (and its line in docs/rollout.md).
use super::{adjacent_minors, CiliumPod, ClusterView, Operator, PlanOpts, ProofStatus};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};

/// Why a rollout must not start. Listed in this order (docs/rollout.md, "Refusals").
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

/// What every rule reads: the view, the options, and the DaemonSet's current revision.
pub struct Inputs<'a> {
    pub v: &'a ClusterView,
    pub o: &'a PlanOpts,
    pub rev: &'a str,
}

impl Inputs<'_> {
    fn skipped(&self, node: &str) -> bool {
        self.o.skip.contains(node)
    }

    /// Nodes running a cilium pod of the DaemonSet.
    fn with_pod(&self) -> BTreeSet<&str> {
        self.v.pods.iter().map(|p| p.node.as_str()).collect()
    }
}

/// A rule: the refusals it finds.
pub type Rule = fn(&Inputs) -> Vec<Refusal>;

/// Every rule, in the order their refusals are listed.
pub const RULES: &[(&str, Rule)] = &[
    ("minor versions one at a time", minor_skip),
    ("nodes Ready", nodes_ready),
    ("cilium pods healthy and bound", pods),
    ("the canary exists", canary),
    ("nothing else unavailable", unavailable),
    ("the operator Ready", operator),
    ("an agent on every node", agents),
    ("one device set per revision", devices),
    ("the current revision proven", proofs),
];

/// Refusals about the DaemonSet itself, before its revision is known: its update strategy and
/// whether its status is current.
pub fn daemonset(v: &ClusterView) -> Vec<Refusal> {
    let mut r = Vec::new();
    if v.update_strategy != "OnDelete" {
        r.push(Refusal::NotOnDelete {
            strategy: v.update_strategy.clone(),
        });
    }
    if v.observed_generation < v.generation {
        r.push(Refusal::NotObserved {
            generation: v.generation,
            observed: v.observed_generation,
        });
    }
    r
}

/// Every refusal the rules find, in order.
pub fn refusals(i: &Inputs) -> Vec<Refusal> {
    RULES.iter().flat_map(|(_, rule)| rule(i)).collect()
}

fn minor_skip(i: &Inputs) -> Vec<Refusal> {
    let Some(to) =
        i.v.cilium_version
            .as_deref()
            .filter(|_| !i.o.allow_minor_skip)
    else {
        return vec![];
    };
    let mut far: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for p in
        i.v.pods
            .iter()
            .filter(|p| p.revision != i.rev && !i.skipped(&p.node))
    {
        if let Some(from) = crate::rollout::image_minor(&p.image) {
            if !adjacent_minors(&from, to) {
                let nodes = far.entry(from).or_default();
                nodes.push(p.node.clone());
                nodes.sort();
            }
        }
    }
    far.into_iter()
        .map(|(from, nodes)| Refusal::MinorSkip {
            from,
            to: to.to_string(),
            nodes,
        })
        .collect()
}

fn nodes_ready(i: &Inputs) -> Vec<Refusal> {
    let with_pod = i.with_pod();
    i.v.nodes
        .iter()
        .filter(|n| with_pod.contains(n.name.as_str()) && !i.skipped(&n.name) && !n.ready)
        .map(|n| Refusal::NodeNotReady {
            node: n.name.clone(),
        })
        .collect()
}

/// The other nodes' cilium pods (a node a person left as it is, `--skip`, is known bad):
/// crash-looping, then not Ready, then unbound.
fn pods(i: &Inputs) -> Vec<Refusal> {
    let (mut crashing, mut not_ready, mut unbound) = (vec![], vec![], vec![]);
    let mut by_node: Vec<&CiliumPod> = i.v.pods.iter().collect();
    by_node.sort_by(|a, b| (&a.node, &a.name).cmp(&(&b.node, &b.name)));
    for p in by_node.into_iter().filter(|p| !i.skipped(&p.node)) {
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
    crashing
        .into_iter()
        .chain(not_ready)
        .chain(unbound)
        .collect()
}

fn canary(i: &Inputs) -> Vec<Refusal> {
    let with_pod = i.with_pod();
    let node_of = |name: &str| i.v.nodes.iter().find(|n| n.name == name);
    if let Some(c) = &i.o.canary {
        if !with_pod.contains(c.as_str()) {
            return vec![Refusal::CanaryUnknown { canary: c.clone() }];
        }
    } else if let Some((k, val)) = &i.o.canary_label {
        if !with_pod
            .iter()
            .any(|n| node_of(n).is_some_and(|n| n.labels.get(k) == Some(val)))
        {
            return vec![Refusal::CanaryUnknown {
                canary: format!("label {k}={val}"),
            }];
        }
    }
    vec![]
}

/// `status.numberUnavailable` beyond the not-Ready pods of the nodes a person skipped.
fn unavailable(i: &Inputs) -> Vec<Refusal> {
    let explained: i32 =
        i.v.pods
            .iter()
            .filter(|p| i.skipped(&p.node) && !p.ready)
            .count() as i32;
    if i.v.number_unavailable > explained {
        vec![Refusal::Unavailable {
            unavailable: i.v.number_unavailable,
        }]
    } else {
        vec![]
    }
}

fn operator(i: &Inputs) -> Vec<Refusal> {
    match &i.v.operator {
        Operator::NotChecked => vec![],
        Operator::Found {
            name,
            ready,
            desired,
        } if ready < desired || *desired == 0 => vec![Refusal::OperatorNotReady {
            name: name.clone(),
            ready: *ready,
            desired: *desired,
        }],
        Operator::Found { .. } => vec![],
        Operator::Unknown { name, problem } => vec![Refusal::OperatorUnknown {
            name: name.clone(),
            problem: problem.clone(),
        }],
    }
}

fn agents(i: &Inputs) -> Vec<Refusal> {
    i.with_pod()
        .into_iter()
        .filter(|n| !i.skipped(n) && !i.v.agents.contains_key(*n))
        .map(|n| Refusal::AgentMissing {
            node: n.to_string(),
        })
        .collect()
}

/// Homogeneity within a revision (mid-rollout, old and new revisions may differ), and a
/// device set an agent could not tell.
fn devices(i: &Inputs) -> Vec<Refusal> {
    let mut out = Vec::new();
    let mut by_rev: BTreeMap<&str, BTreeMap<String, Vec<String>>> = BTreeMap::new();
    for p in i.v.pods.iter().filter(|p| !i.skipped(&p.node)) {
        match i.v.devices.get(&p.node) {
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
            Some(Err(e)) if i.v.agents.contains_key(&p.node) => out.push(Refusal::DevicesUnknown {
                node: p.node.clone(),
                problem: e.clone(),
            }),
            _ => {}
        }
    }
    for (r, sets) in by_rev {
        if sets.len() > 1 {
            out.push(Refusal::DevicesDiffer {
                revision: r.to_string(),
                sets,
            });
        }
    }
    out
}

/// What a node's agent vouches for about its cilium pod on the current revision.
pub enum Standing {
    /// Its current start passed: done.
    Proven,
    /// Not covered by a step (the agent says why): stepped to prove it.
    Unproven(String),
    /// Something in the way of stepping or of calling it done.
    Refused(Refusal),
}

/// A pod on the current revision is done only when its agent proves the cilium-agent's current
/// start passed; one it cannot vouch for is stepped to prove it. None: not judged (skipped,
/// stepped again on request, or no agent: another rule's).
pub fn standing(i: &Inputs, p: &CiliumPod) -> Option<Standing> {
    if p.revision != i.rev
        || i.skipped(&p.node)
        || i.o.again.as_deref() == Some(p.node.as_str())
        || !i.v.agents.contains_key(&p.node)
    {
        return None;
    }
    Some(match i.v.proofs.get(&p.node) {
        Some(Ok(pr)) => match pr.status {
            ProofStatus::Passed => Standing::Proven,
            ProofStatus::Failed => Standing::Refused(Refusal::VerdictFailed {
                node: p.node.clone(),
                pod: p.name.clone(),
                step: pr.step.as_ref().map(|s| s.id.clone()),
                why: pr.why.clone(),
            }),
            ProofStatus::Pending => Standing::Refused(Refusal::ProofPending {
                node: p.node.clone(),
                why: pr.why.clone(),
            }),
            ProofStatus::Unproven => Standing::Unproven(pr.why.clone()),
        },
        Some(Err(e)) => Standing::Refused(Refusal::ProofUnknown {
            node: p.node.clone(),
            problem: e.clone(),
        }),
        None if p.started_at.is_none() => {
            Standing::Unproven("its cilium-agent container reports no start time".into())
        }
        None => Standing::Refused(Refusal::ProofUnknown {
            node: p.node.clone(),
            problem: "not asked".into(),
        }),
    })
}

fn proofs(i: &Inputs) -> Vec<Refusal> {
    i.v.pods
        .iter()
        .filter_map(|p| match standing(i, p)? {
            Standing::Refused(r) => Some(r),
            _ => None,
        })
        .collect()
}
