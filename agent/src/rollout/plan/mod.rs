//! The rollout plan, from a view of the cluster (pure): which nodes' cilium pods are not on the
//! DaemonSet's current revision, in which order to step them, which L2-announced VIPs move at
//! each step, and why the rollout must not start at all.

pub use crate::step::proof::{Proof, ProofStatus};
pub mod batch;
mod order;
pub mod refusals;
pub mod scope;

pub use batch::Budget;
pub use refusals::Refusal;
pub use scope::LabelTerm;
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

#[derive(Clone, Debug)]
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
    /// The nodes in scope (`--node-selector`): pods on other nodes are not stepped.
    pub node_selector: Vec<LabelTerm>,
    /// Leave this many nodes in scope on an older revision (`--partition`).
    pub partition: usize,
    /// The node label naming a node's failure domain (`--domain-label`).
    pub domain_label: String,
    /// At most this many nodes of one failure domain in a batch (`--max-unavailable-per-domain`).
    pub per_domain: Option<Budget>,
}

/// The zone: the failure domain unless `--domain-label` names another label.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

impl Default for PlanOpts {
    fn default() -> Self {
        PlanOpts {
            canary: None,
            canary_label: None,
            max_nodes: None,
            vip_groups: BTreeMap::new(),
            pause_between: Duration::ZERO,
            skip: BTreeSet::new(),
            again: None,
            allow_minor_skip: false,
            node_selector: vec![],
            partition: 0,
            domain_label: ZONE_LABEL.into(),
            per_domain: None,
        }
    }
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

/// The nodes to step, in order, or every reason not to start.
pub fn plan(v: &ClusterView, o: &PlanOpts) -> Result<Vec<PlannedStep>, Vec<Refusal>> {
    let mut refusals = refusals::daemonset(v);
    let Some((rev, _)) = &v.revision else {
        refusals.push(Refusal::NoRevision);
        return Err(refusals);
    };
    let i = refusals::Inputs { v, o, rev };
    refusals.extend(refusals::refusals(&i));
    if !refusals.is_empty() {
        return Err(refusals);
    }
    Ok(order::order(&i))
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
