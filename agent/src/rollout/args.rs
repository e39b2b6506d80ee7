//! `stepguard rollout`'s flags.
use super::*;

#[derive(clap::Args, Clone, Debug)]
pub struct RolloutArgs {
    /// Print the plan (and every reason not to start) and exit.
    #[arg(long)]
    pub dry_run: bool,
    /// The Cilium DaemonSet, NAMESPACE/NAME.
    #[arg(long, default_value = "kube-system/cilium")]
    pub daemonset: String,
    /// Step this node first.
    #[arg(long)]
    pub canary: Option<String>,
    /// Step the first node with this label (KEY=VALUE) first.
    #[arg(long)]
    pub canary_label: Option<String>,
    /// Where the stepguard agents run (their pods are found by label).
    #[arg(long, default_value = "stepguard")]
    pub agents_namespace: String,
    #[arg(long, default_value = "app.kubernetes.io/name=stepguard")]
    pub agents_selector: String,
    #[arg(long, default_value_t = 9969)]
    pub agent_port: u16,
    /// Bearer token file for the agents (and their witnesses).
    #[arg(long, env = "STEPGUARD_TOKEN_FILE")]
    pub token_file: Option<std::path::PathBuf>,
    /// A witness (http://HOST:PORT) every step names, to measure lease moves as LAN clients.
    #[arg(long = "witness", value_name = "URL")]
    pub witnesses: Vec<String>,
    /// VIP group NAME=SVC,SVC (lease services `<ns>-<svc>`): holders of one group are never
    /// stepped back to back.
    #[arg(long = "vip-group", value_name = "NAME=SVC,SVC")]
    pub vip_groups: Vec<String>,
    /// Pause between nodes (holders after a holder wait at least a lease duration).
    #[arg(long, default_value = "0s", value_parser = crate::duration::parse)]
    pub pause_between: Duration,
    /// Step at most this many nodes in this run.
    #[arg(long)]
    pub max_nodes: Option<usize>,
    /// Step up to N nodes (or P% of the nodes in scope, rounded up) at once, as the DaemonSet
    /// controller's `maxUnavailable`. The canary (or the first node) goes alone, then batches
    /// grow 1, 2, 4, … up to this while every verdict passes. A failed verdict halts the
    /// rollout once the batch's other verdicts are in: no further pod is deleted, and the
    /// halt names every node of the batch. Lease holders whose VIPs may move to a node of the
    /// batch, two holders of one VIP group, and two control-plane nodes never share a batch.
    #[arg(long, default_value = "1", value_name = "N|P%", value_parser = plan::Budget::parse)]
    pub max_unavailable: plan::Budget,
    /// At most N nodes (or P% of a failure domain's nodes, rounded down, at least 1) of one
    /// failure domain in a batch; unset, a batch is limited by --max-unavailable alone (its
    /// nodes are still taken from every domain in turn).
    #[arg(long, value_name = "N|P%", value_parser = plan::Budget::parse)]
    pub max_unavailable_per_domain: Option<plan::Budget>,
    /// The node label naming a node's failure domain (nodes without it share one domain;
    /// control-plane nodes are a domain of their own, one per batch).
    #[arg(long, default_value = plan::ZONE_LABEL, value_name = "KEY")]
    pub domain_label: String,
    /// Leave N of the nodes in scope on their older revision (as OpenKruise's Advanced
    /// DaemonSet `partition`): the rollout is done when only N are left; lower it (or run
    /// without it) to go on. Nodes left by `--skip` count among the N.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub partition: usize,
    /// Only nodes whose labels match are stepped (KEY=VALUE, KEY!=VALUE, KEY, !KEY,
    /// comma-separated); the others' cilium pods are left as they are.
    #[arg(long, value_name = "SELECTOR", value_parser = plan::scope::Selector::parse)]
    pub node_selector: Option<plan::scope::Selector>,
    /// The step each node's agent verifies: how long everything must stay green, once
    /// nothing is pending, before it passes (a window, not a deadline).
    #[arg(long, default_value = "30s", value_parser = crate::duration::parse)]
    pub settle: Duration,
    /// The step's only deadline: the reload, refills and regenerations may take until then.
    #[arg(long, default_value = "10m", value_parser = crate::duration::parse)]
    pub step_timeout: Duration,
    /// How long the replacement cilium pod has to be Ready on the current revision, counted
    /// once its image is there (a pull is `--pull-timeout`'s).
    #[arg(long, default_value = "10m", value_parser = crate::duration::parse)]
    pub replace_timeout: Duration,
    /// How long the replacement's image may take to pull (its containers being created).
    #[arg(long, default_value = "15m", value_parser = crate::duration::parse)]
    pub pull_timeout: Duration,
    /// The devices every node must carry the datapath on after its restart (when the new
    /// revision changes them on purpose).
    #[arg(long, value_delimiter = ',')]
    pub expect_devices: Option<Vec<String>>,
    /// Hooks the new revision removes on purpose (comma-separated reload keys or devices:
    /// cilium_vxlan for tunnel → native, eth0:xdp for XDP off); each step expects them gone.
    #[arg(long, value_delimiter = ',')]
    pub expect_gone: Option<Vec<String>>,
    /// The cilium-operator Deployment, NAMESPACE/NAME, that must be Ready before a step
    /// (`''`: Cilium runs without one here).
    #[arg(long, default_value = "kube-system/cilium-operator")]
    pub operator: String,
    /// Allow a revision more than one Cilium minor version from a node's (Cilium supports
    /// upgrading and downgrading one minor version at a time).
    #[arg(long)]
    pub allow_minor_skip: bool,
    /// The lock: a Lease in this namespace (never kube-system's leases).
    #[arg(long, default_value = "stepguard")]
    pub lock_namespace: String,
    #[arg(long, default_value = "30s", value_parser = crate::duration::parse)]
    pub lock_duration: Duration,
    /// End the rollout and exit: release the lock (after showing who held it), lift a halt,
    /// forget a step in flight; `--watch` does not start this revision again (a new approved
    /// revision, or a person running `stepguard rollout`, starts anew).
    #[arg(long, conflicts_with_all = ["watch", "dry_run"])]
    pub abort: bool,
    /// Lift a halt by stepping NODE, whose step failed, again first (needs --reason); then
    /// run `stepguard rollout`, or let `--watch` go on.
    #[arg(long, value_name = "NODE", conflicts_with_all = ["watch", "dry_run"])]
    pub retry: Option<String>,
    /// Lift a halt by leaving NODE, whose step failed, as it is on this revision and going on
    /// with the others (needs --reason).
    #[arg(long, value_name = "NODE", conflicts_with_all = ["watch", "dry_run"])]
    pub skip: Option<String>,
    /// Why a person decides (`--retry`, `--skip`, `--abort`): recorded on the lock with who
    /// decided, and told in an Event.
    #[arg(long, value_name = "TEXT")]
    pub reason: Option<String>,
    /// Print the rollout's record and exit: who holds the lock, the step in flight, a halt
    /// (with the failed node's verdict), skips, decisions, and what the rollouts told (their
    /// Events, kept on the lock beyond the Events' one-hour TTL).
    #[arg(long, conflicts_with_all = ["watch", "dry_run", "abort", "retry", "skip"])]
    pub status: bool,
    /// Keep running: start a rollout whenever a new revision appears whose hash the
    /// DaemonSet's `stepguard.io/approve-revision` annotation names. A revision that appears
    /// mid-rollout pauses it until approved; a halt stops it until a person lifts it.
    #[arg(long)]
    pub watch: bool,
    #[arg(long, default_value = "30s", value_parser = crate::duration::parse)]
    pub watch_interval: Duration,
    /// `text` (progress lines and a summary table) or `json` (one document at the end).
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    pub output: String,
}
