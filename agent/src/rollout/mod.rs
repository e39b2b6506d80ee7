//! `stepguard rollout`: steps a Cilium DaemonSet (`updateStrategy: OnDelete`) one node at a
//! time, verified by each node's stepguard agent — the stepper the 50-day rollout lacked.
//!
//! Plan (`plan.rs`, pure) → for each node: begin a step on its agent, delete its cilium pod
//! with a UID precondition, wait for a Ready replacement on the step's revision (or a newer
//! one), wait for the verdict (`machine.rs`, pure) → re-read the cluster and re-plan (a new
//! revision is gone on to only when approved).
//! One stepper at a time: a `coordination.k8s.io` Lease in stepguard's namespace, renewed,
//! carrying the record (`record.rs`, pure): the step in flight, so an interrupted rollout
//! finishes it first without repeating it; a halt after a failed step, which every later run
//! respects until a person lifts it; the people's decisions. Transient API failures are
//! waited out. Kubernetes Events on the DaemonSet tell the story to `kubectl describe`.
mod lock;
pub mod machine;
pub mod plan;
pub mod record;
pub mod replacement;

use anyhow::{bail, Context, Result};
use k8s_openapi::api::apps::v1::{ControllerRevision, DaemonSet};
use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event as KEvent, Node, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
use kube::Client;
use lock::{acquire, lock_times, observe, persist, read_lock, release, renew_held, Held};
use machine::{Event, OldPod, Outcome, Phase, Timeouts};
use plan::{CiliumPod, ClusterView, L2Lease, NodeInfo, PlanOpts, PlannedStep};
use record::{Gate, InFlight, Lift, Record};
use replacement::{stage, Stage, Stages};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// On the DaemonSet: `--watch` starts a rollout when this equals the current revision's hash.
pub const ANN_APPROVE: &str = "stepguard.io/approve-revision";
/// Approval from Git, in the commit that changes the template (before its revision exists):
/// the cilium-agent image the template must carry ...
pub const ANN_APPROVE_IMAGE: &str = "stepguard.io/approve-image";
/// ... and the cilium-config checksum the chart puts on it (`rollOutCiliumPods`), so a
/// config-only revision cannot ride an older approval.
pub const ANN_APPROVE_CONFIG: &str = "stepguard.io/approve-config-checksum";
/// The chart's annotation on the pod template: the sha256 of the rendered cilium-config.
pub const CONFIG_CHECKSUM: &str = "cilium.io/cilium-configmap-checksum";
const L2_PREFIX: &str = "cilium-l2announce-";

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
    /// The step each node's agent verifies: its settle window and timeout.
    #[arg(long, default_value = "30s", value_parser = crate::duration::parse)]
    pub settle: Duration,
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

/// Cluster access (kube) and the agents (HTTP).
pub struct Cluster {
    client: Client,
    ns: String,
    ds: String,
    args: RolloutArgs,
    token: Option<String>,
    identity: String,
    /// While this run holds the lock: its record, where every Event is also kept.
    told: Mutex<Option<Arc<Mutex<Record>>>>,
}

fn api_code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
    }
}

fn now_s() -> f64 {
    crate::probe::unix_now()
}

fn micro_now() -> MicroTime {
    MicroTime(k8s_openapi::jiff::Timestamp::now())
}

/// The Cilium minor version from an image reference (`quay.io/cilium/cilium:v1.18.2@sha...`).
pub fn image_minor(image: &str) -> Option<String> {
    let tag = image.split('@').next()?.rsplit(':').next()?;
    let v = tag.trim_start_matches('v');
    let mut parts = v.split('.');
    let (a, b) = (parts.next()?, parts.next()?);
    (a.parse::<u32>().is_ok() && b.parse::<u32>().is_ok()).then(|| format!("{a}.{b}"))
}

impl Cluster {
    pub async fn connect(args: RolloutArgs) -> Result<Cluster> {
        let client = Client::try_default().await.context(
            "connect to the Kubernetes API (in-cluster, or $KUBECONFIG / ~/.kube/config)",
        )?;
        let (ns, ds) = args
            .daemonset
            .split_once('/')
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .context("--daemonset must be NAMESPACE/NAME")?;
        let token = crate::client::read_token(args.token_file.as_deref())?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "stepguard".into());
        Ok(Cluster {
            client,
            ns,
            ds,
            identity: format!("{host}-{}", std::process::id()),
            args,
            token,
            told: Mutex::new(None),
        })
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    async fn daemonset(&self) -> Result<DaemonSet> {
        Api::<DaemonSet>::namespaced(self.client.clone(), &self.ns)
            .get(&self.ds)
            .await
            .with_context(|| format!("get DaemonSet {}/{}", self.ns, self.ds))
    }

    /// The DaemonSet's whole selector (matchLabels and matchExpressions) as a label selector
    /// string; pods are then claimed by owner reference too (`owned`).
    fn selector(ds: &DaemonSet) -> String {
        ds.spec
            .as_ref()
            .map(|s| selector_string(&s.selector))
            .unwrap_or_default()
    }

    /// The DaemonSet's revisions: hash → number.
    async fn revisions(&self, ds: &DaemonSet) -> Result<BTreeMap<String, i64>> {
        let sel = Self::selector(ds);
        let uid = ds.metadata.uid.clone().unwrap_or_default();
        let revs = Api::<ControllerRevision>::namespaced(self.client.clone(), &self.ns)
            .list(&ListParams::default().labels(&sel))
            .await
            .context("list ControllerRevisions")?;
        Ok(revs
            .items
            .iter()
            .filter(|r| {
                r.metadata
                    .owner_references
                    .iter()
                    .flatten()
                    .any(|o| o.uid == uid)
            })
            .map(|r| {
                let hash = r
                    .metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get("controller-revision-hash").cloned())
                    .unwrap_or_else(|| {
                        let n = r.metadata.name.clone().unwrap_or_default();
                        n.rsplit('-').next().unwrap_or_default().to_string()
                    });
                (hash, r.revision)
            })
            .collect())
    }

    /// Everything the plan needs, read now.
    pub async fn view(&self) -> Result<(ClusterView, DaemonSet)> {
        let ds = self.daemonset().await?;
        let sel = Self::selector(&ds);
        let numbers = self.revisions(&ds).await?;
        let revision = numbers
            .iter()
            .max_by_key(|(_, n)| **n)
            .map(|(h, n)| (h.clone(), *n));
        let image = agent_image(ds.spec.as_ref().and_then(|s| s.template.spec.as_ref()));
        let ds_uid = ds.metadata.uid.clone().unwrap_or_default();
        let nodes: Vec<NodeInfo> = Api::<Node>::all(self.client.clone())
            .list(&ListParams::default())
            .await
            .context("list Nodes")?
            .items
            .into_iter()
            .map(|n| {
                let labels = n.metadata.labels.clone().unwrap_or_default();
                NodeInfo {
                    name: n.metadata.name.clone().unwrap_or_default(),
                    ready: n
                        .status
                        .as_ref()
                        .and_then(|s| s.conditions.as_ref())
                        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
                        .is_some_and(|c| c.status == "True"),
                    zone: labels.get("topology.kubernetes.io/zone").cloned(),
                    control_plane: labels.contains_key("node-role.kubernetes.io/control-plane"),
                    labels: labels.into_iter().collect(),
                }
            })
            .collect();
        let listed = self
            .pods()
            .list(&ListParams::default().labels(&sel))
            .await
            .context("list the cilium pods")?
            .items;
        let mut foreign = Vec::new();
        let mut pods: Vec<CiliumPod> = Vec::new();
        for p in listed {
            if p.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let name = p.metadata.name.clone().unwrap_or_default();
            if !owned(&p, &ds_uid) {
                foreign.push(name);
                continue;
            }
            // A pod of the DaemonSet for no node it names, or without a revision label, is
            // the controller's business (it deletes or relabels it); it is shown, never lost.
            let (Some(node), Some(revision)) = (target_node(&p), pod_revision(&p)) else {
                foreign.push(format!("{name} (no node or revision)"));
                continue;
            };
            pods.push(CiliumPod {
                name,
                uid: p.metadata.uid.clone().unwrap_or_default(),
                node,
                revision,
                ready: pod_ready(&p),
                image: agent_image(p.spec.as_ref()),
                bound: p
                    .spec
                    .as_ref()
                    .and_then(|s| s.node_name.as_deref())
                    .is_some_and(|n| !n.is_empty()),
                crash_looping: crash_looping(&p),
            });
        }
        let operator = self.operator().await;
        let agent_pods = Api::<Pod>::namespaced(self.client.clone(), &self.args.agents_namespace)
            .list(&ListParams::default().labels(&self.args.agents_selector))
            .await
            .context("list the stepguard agents")?;
        let mut agents = BTreeMap::new();
        for p in agent_pods.items {
            let (Some(node), Some(ip)) = (
                p.spec.as_ref().and_then(|s| s.node_name.clone()),
                p.status.as_ref().and_then(|s| s.pod_ip.clone()),
            ) else {
                continue;
            };
            let host = if ip.contains(':') {
                format!("[{ip}]")
            } else {
                ip
            };
            agents.insert(node, format!("http://{host}:{}", self.args.agent_port));
        }
        let mut devices = BTreeMap::new();
        for (node, url) in &agents {
            devices.insert(node.clone(), self.devices_of(url).await);
        }
        let leases = Api::<Lease>::namespaced(self.client.clone(), &self.ns)
            .list(&ListParams::default())
            .await
            .context("list the L2-announcement Leases")?
            .items
            .into_iter()
            .filter_map(|l| {
                let name = l.metadata.name.clone()?;
                let service = name.strip_prefix(L2_PREFIX)?.to_string();
                let spec = l.spec.clone().unwrap_or_default();
                Some(L2Lease {
                    service,
                    holder: spec.holder_identity.filter(|h| !h.is_empty()),
                    duration: Duration::from_secs(
                        spec.lease_duration_seconds.unwrap_or(15).max(0) as u64
                    ),
                })
            })
            .collect();
        let status = ds.status.clone().unwrap_or_default();
        let view = ClusterView {
            daemonset: format!("{}/{}", self.ns, self.ds),
            update_strategy: ds
                .spec
                .as_ref()
                .and_then(|s| s.update_strategy.as_ref())
                .and_then(|u| u.type_.clone())
                .unwrap_or_else(|| "RollingUpdate".into()),
            number_unavailable: status.number_unavailable.unwrap_or(0),
            operator,
            foreign,
            generation: ds.metadata.generation.unwrap_or(0),
            observed_generation: ds
                .status
                .as_ref()
                .and_then(|s| s.observed_generation)
                .unwrap_or(0),
            revision,
            cilium_version: image_minor(&image),
            nodes,
            pods,
            agents,
            devices,
            leases,
        };
        Ok((view, ds))
    }

    /// The cilium-operator Deployment's readiness (`--operator`).
    async fn operator(&self) -> plan::Operator {
        let Some((ns, name)) = self.args.operator.split_once('/') else {
            return plan::Operator::NotChecked;
        };
        let full = self.args.operator.clone();
        match Api::<k8s_openapi::api::apps::v1::Deployment>::namespaced(self.client.clone(), ns)
            .get_opt(name)
            .await
        {
            Ok(Some(d)) => plan::Operator::Found {
                name: full,
                ready: d
                    .status
                    .as_ref()
                    .and_then(|s| s.ready_replicas)
                    .unwrap_or(0),
                desired: d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1),
            },
            Ok(None) => plan::Operator::Unknown {
                name: full,
                problem: "no such Deployment".into(),
            },
            Err(e) => plan::Operator::Unknown {
                name: full,
                problem: format!("cannot read it: {e}"),
            },
        }
    }

    fn agent(&self, url: &str) -> Result<crate::client::Agent> {
        crate::client::Agent::new(url, self.token.clone())
    }

    async fn devices_of(&self, url: &str) -> Result<Vec<String>, String> {
        let a = self.agent(url).map_err(|e| format!("{e:#}"))?;
        let (_, v) = a
            .call("GET", "/v1/verdict", None, Duration::from_secs(5))
            .await
            .map_err(|e| format!("{e:#}"))?;
        let check = v["checks"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["check"] == "devices"))
            .ok_or("the agent reports no devices check")?;
        check["evidence"]["selected"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|d| d.as_str().map(String::from))
                    .collect()
            })
            .ok_or_else(|| {
                format!(
                    "devices unknown: {}",
                    check["reason"].as_str().unwrap_or("")
                )
            })
    }

    /// Deletes the pod if it is still the one with `uid`. Ok(false): already gone.
    async fn delete_pod(&self, name: &str, uid: &str) -> Result<bool> {
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some(uid.to_string()),
                resource_version: None,
            }),
            ..Default::default()
        };
        match self.pods().delete(name, &dp).await {
            Ok(_) => Ok(true),
            Err(e) if api_code(&e) == Some(404) => Ok(false),
            Err(e) if api_code(&e) == Some(409) => bail!(
                "pod {name} is no longer the one planned (UID {uid} precondition failed): {e}"
            ),
            Err(e) => Err(e).with_context(|| format!("delete pod {name}")),
        }
    }

    /// The replacement on `node` (a pod of the DaemonSet other than `old_uid`, not being
    /// deleted), from one read: the revision a Ready one carries when that is the step's
    /// revision `target` or a newer one, and the stage of the newest one.
    async fn replaced(
        &self,
        ds: &DaemonSet,
        sel: &str,
        node: &str,
        old_uid: &str,
        target: (&str, i64),
    ) -> Result<(Option<String>, Option<Stage>)> {
        let pods = self.replacements(ds, sel, node, old_uid).await?;
        let newest = pods
            .iter()
            .max_by_key(|p| p.metadata.creation_timestamp.clone().map(|t| t.0))
            .map(stage);
        let ready: Vec<String> = pods
            .iter()
            .filter(|p| pod_ready(p))
            .filter_map(pod_revision)
            .collect();
        if let Some(h) = ready.iter().find(|h| *h == target.0) {
            return Ok((Some(h.clone()), Some(Stage::Ready)));
        }
        if ready.is_empty() {
            return Ok((None, newest));
        }
        let numbers = self.revisions(ds).await?;
        let found = ready
            .into_iter()
            .find(|h| machine::acceptable_revision(h, target, &numbers));
        let stage = if found.is_some() {
            Some(Stage::Ready)
        } else {
            newest
        };
        Ok((found, stage))
    }

    /// The DaemonSet's pods for `node` other than `old_uid`, not being deleted.
    async fn replacements(
        &self,
        ds: &DaemonSet,
        sel: &str,
        node: &str,
        old_uid: &str,
    ) -> Result<Vec<Pod>> {
        let pods = self.pods().list(&ListParams::default().labels(sel)).await?;
        let uid = ds.metadata.uid.clone().unwrap_or_default();
        Ok(pods
            .items
            .into_iter()
            .filter(|p| {
                owned(p, &uid)
                    && target_node(p).as_deref() == Some(node)
                    && p.metadata.uid.as_deref() != Some(old_uid)
                    && p.metadata.deletion_timestamp.is_none()
            })
            .collect())
    }

    /// The interrupted step's old pod now, and (for a lock written by an older stepper, which
    /// did not record the pod) which pod that is.
    async fn old_pod(&self, sel: &str, i: &InFlight) -> Result<(OldPod, Option<(String, String)>)> {
        if i.pod.is_empty() {
            let pods = self.pods().list(&ListParams::default().labels(sel)).await?;
            let old = pods.items.iter().find(|p| {
                target_node(p).as_deref() == Some(i.node.as_str())
                    && p.metadata.deletion_timestamp.is_none()
                    && pod_revision(p).as_deref() != Some(i.revision.as_str())
            });
            return Ok(match old {
                Some(p) => (
                    OldPod::Present,
                    Some((
                        p.metadata.name.clone().unwrap_or_default(),
                        p.metadata.uid.clone().unwrap_or_default(),
                    )),
                ),
                None => (OldPod::Gone, None),
            });
        }
        let p = self
            .pods()
            .get_opt(&i.pod)
            .await
            .with_context(|| format!("read pod {}", i.pod))?;
        Ok(match p {
            Some(p) if p.metadata.uid.as_deref() == Some(i.pod_uid.as_str()) => {
                if p.metadata.deletion_timestamp.is_some() {
                    (OldPod::Terminating, None)
                } else {
                    (OldPod::Present, None)
                }
            }
            _ => (OldPod::Gone, None),
        })
    }

    async fn event(&self, ds: &DaemonSet, warning: bool, reason: &str, message: &str) {
        let sink = self.told.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(rec) = sink {
            rec.lock()
                .unwrap_or_else(|e| e.into_inner())
                .tell(&stamp(), warning, reason, message);
        }
        let t = Time(k8s_openapi::jiff::Timestamp::now());
        let ev = KEvent {
            metadata: ObjectMeta {
                generate_name: Some(format!("{}-stepguard-", self.ds)),
                namespace: Some(self.ns.clone()),
                ..Default::default()
            },
            involved_object: ObjectReference {
                api_version: Some("apps/v1".into()),
                kind: Some("DaemonSet".into()),
                name: Some(self.ds.clone()),
                namespace: Some(self.ns.clone()),
                uid: ds.metadata.uid.clone(),
                ..Default::default()
            },
            reason: Some(reason.into()),
            message: Some(message.into()),
            type_: Some(if warning { "Warning" } else { "Normal" }.into()),
            first_timestamp: Some(t.clone()),
            last_timestamp: Some(t),
            count: Some(1),
            reporting_component: Some("stepguard-rollout".into()),
            reporting_instance: Some(self.identity.clone()),
            source: Some(k8s_openapi::api::core::v1::EventSource {
                component: Some("stepguard-rollout".into()),
                host: None,
            }),
            ..Default::default()
        };
        if let Err(e) = Api::<KEvent>::namespaced(self.client.clone(), &self.ns)
            .create(&PostParams::default(), &ev)
            .await
        {
            tracing::warn!(error = %e, "could not record a Kubernetes Event");
        }
    }

    fn leases(&self) -> Api<Lease> {
        Api::namespaced(self.client.clone(), &self.args.lock_namespace)
    }

    fn lock_name(&self) -> String {
        format!("stepguard-rollout-{}-{}", self.ns, self.ds)
    }
}

/// A LabelSelector as the API's label selector syntax (`k=v,k in (a,b),!k,k`).
pub fn selector_string(
    sel: &k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector,
) -> String {
    let mut parts: Vec<String> = sel
        .match_labels
        .iter()
        .flatten()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    for e in sel.match_expressions.iter().flatten() {
        let vals = e.values.clone().unwrap_or_default().join(",");
        parts.push(match e.operator.as_str() {
            "In" => format!("{} in ({vals})", e.key),
            "NotIn" => format!("{} notin ({vals})", e.key),
            "Exists" => e.key.clone(),
            "DoesNotExist" => format!("!{}", e.key),
            // An operator the API does not know selects nothing rather than everything.
            other => format!("{} in (stepguard-unknown-operator-{other})", e.key),
        });
    }
    parts.join(",")
}

/// Whether the DaemonSet with `uid` is the pod's controller (as the controller claims pods:
/// a pod the selector matches that another controller owns is not the DaemonSet's).
fn owned(p: &Pod, uid: &str) -> bool {
    p.metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.controller == Some(true) && o.uid == uid)
}

/// A container or init container waiting in CrashLoopBackOff: the highest restart count.
fn crash_looping(p: &Pod) -> Option<i32> {
    let st = p.status.as_ref()?;
    st.container_statuses
        .iter()
        .flatten()
        .chain(st.init_container_statuses.iter().flatten())
        .filter(|c| {
            c.state
                .as_ref()
                .and_then(|s| s.waiting.as_ref())
                .and_then(|w| w.reason.as_deref())
                == Some("CrashLoopBackOff")
        })
        .map(|c| c.restart_count)
        .max()
}

/// The cilium-agent container's image (or the first container's).
fn agent_image(spec: Option<&k8s_openapi::api::core::v1::PodSpec>) -> String {
    spec.and_then(|p| {
        p.containers
            .iter()
            .find(|c| c.name == "cilium-agent")
            .or(p.containers.first())
    })
    .and_then(|c| c.image.clone())
    .unwrap_or_default()
}

pub(crate) fn pod_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
        .is_some_and(|c| c.status == "True")
}

fn pod_revision(p: &Pod) -> Option<String> {
    p.metadata
        .labels
        .as_ref()?
        .get("controller-revision-hash")
        .cloned()
}

/// The node a daemon pod is for: its `nodeName` once bound, before that the node the
/// DaemonSet controller pins it to with a required node affinity on `metadata.name`.
pub fn target_node(p: &Pod) -> Option<String> {
    let spec = p.spec.as_ref()?;
    if let Some(n) = spec.node_name.clone().filter(|n| !n.is_empty()) {
        return Some(n);
    }
    spec.affinity
        .as_ref()?
        .node_affinity
        .as_ref()?
        .required_during_scheduling_ignored_during_execution
        .as_ref()?
        .node_selector_terms
        .iter()
        .flat_map(|t| t.match_fields.iter().flatten())
        .find(|f| f.key == "metadata.name" && f.operator == "In")
        .and_then(|f| f.values.as_ref()?.first().cloned())
}

/// Whether an error reading or writing the cluster is worth retrying: the API server failing
/// or overloaded (5xx, 429) or not answering at all. A refusal (4xx) or an answer that cannot
/// be decoded is not.
fn transient(e: &anyhow::Error) -> bool {
    match e.chain().find_map(|c| c.downcast_ref::<kube::Error>()) {
        Some(kube::Error::Api(s)) => s.code >= 500 || s.code == 429,
        Some(kube::Error::SerdeError(_) | kube::Error::BuildRequest(_)) => false,
        Some(_) => true,
        None => false,
    }
}

/// Retries `f` while its error is transient, backing off from 0.5 s to 15 s, until `give_up`
/// has passed or the lock is lost; the first failure is logged.
async fn patient<T, F, Fut>(
    what: &str,
    give_up: Duration,
    lost: Option<&AtomicBool>,
    mut f: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let t0 = Instant::now();
    let mut delay = Duration::from_millis(500);
    let mut said = false;
    loop {
        match f().await {
            Ok(v) => return Ok(v),
            Err(e)
                if transient(&e)
                    && t0.elapsed() < give_up
                    && !lost.is_some_and(|l| l.load(Ordering::SeqCst)) =>
            {
                if !said {
                    tracing::warn!(error = %format!("{e:#}"), "{what}: the API server failed; retrying");
                    said = true;
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(15));
            }
            Err(e) => return Err(e).with_context(|| what.to_string()),
        }
    }
}

fn annotations(meta: &ObjectMeta) -> BTreeMap<String, String> {
    meta.annotations
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect()
}

/// What a person approved, as a revision hash: the one `stepguard.io/approve-revision`
/// names, or the current revision (`current`) when its template carries the image and the
/// config checksum the Git approval names.
fn approval(ds: &DaemonSet, current: &str) -> Option<String> {
    let named = annotations(&ds.metadata).get(ANN_APPROVE).cloned();
    if named.as_deref() != Some(current) && !current.is_empty() && template_approved(ds).is_ok() {
        return Some(current.to_string());
    }
    named
}

/// Whether the DaemonSet's template (the current revision, once the controller observed it)
/// carries what `stepguard.io/approve-image` and `stepguard.io/approve-config-checksum`
/// name; why not.
fn template_approved(ds: &DaemonSet) -> Result<(), String> {
    let ann = annotations(&ds.metadata);
    let Some(want) = ann.get(ANN_APPROVE_IMAGE) else {
        return Err(format!("{ANN_APPROVE_IMAGE} is not set"));
    };
    let observed = ds.status.as_ref().and_then(|s| s.observed_generation) >= ds.metadata.generation;
    if !observed {
        return Err("the DaemonSet controller has not observed the template yet".into());
    }
    let tmpl = ds.spec.as_ref().map(|s| &s.template);
    let have = agent_image(tmpl.and_then(|t| t.spec.as_ref()));
    if &have != want {
        return Err(format!(
            "the template's image is {have}, {ANN_APPROVE_IMAGE} names {want}"
        ));
    }
    let sum = tmpl
        .and_then(|t| t.metadata.as_ref())
        .map(annotations)
        .and_then(|a| a.get(CONFIG_CHECKSUM).cloned());
    match (sum, ann.get(ANN_APPROVE_CONFIG)) {
        // Without the chart's checksum a config change makes no revision at all.
        (None, _) => Ok(()),
        (Some(s), Some(a)) if &s == a => Ok(()),
        (Some(s), Some(a)) => Err(format!(
            "the template's config checksum is {s}, {ANN_APPROVE_CONFIG} names {a}"
        )),
        (Some(s), None) => Err(format!(
            "the template carries config checksum {s} and {ANN_APPROVE_CONFIG} is not set"
        )),
    }
}

/// Why the current revision is not approved, for people.
fn unapproved_why(ds: &DaemonSet) -> String {
    let named = annotations(&ds.metadata)
        .get(ANN_APPROVE)
        .cloned()
        .unwrap_or_else(|| "not set".into());
    match template_approved(ds) {
        Err(e) if annotations(&ds.metadata).contains_key(ANN_APPROVE_IMAGE) => {
            format!("stepguard.io/approve-revision is {named}; {e}")
        }
        _ => format!("stepguard.io/approve-revision is {named}"),
    }
}

fn stamp() -> String {
    k8s_openapi::jiff::Timestamp::now().to_string()
}

/// One node's result, for the summary.
#[derive(Clone, Debug, serde::Serialize)]
pub struct NodeResult {
    pub node: String,
    pub why: String,
    pub moves: Vec<String>,
    pub outcome: Outcome,
    pub elapsed_s: f64,
    /// The replacement pod's stages as seen, each with how long it lasted (seconds).
    pub replacement: Vec<(String, f64)>,
}

/// Runs `stepguard rollout`; the exit code.
pub fn run(args: RolloutArgs) -> Result<i32> {
    if args.canary.is_some() && args.canary_label.is_some() {
        bail!("--canary and --canary-label: give one");
    }
    let lift = match (&args.retry, &args.skip, args.abort) {
        (Some(n), None, false) => Some(Lift::Retry(n.clone())),
        (None, Some(n), false) => Some(Lift::Skip(n.clone())),
        (None, None, true) => Some(Lift::Abort),
        (None, None, false) => None,
        _ => bail!("--retry, --skip and --abort: give one"),
    };
    if matches!(lift, Some(Lift::Retry(_) | Lift::Skip(_)))
        && args.reason.as_deref().is_none_or(|r| r.trim().is_empty())
    {
        bail!("--retry and --skip need --reason WHY: the decision is recorded with who took it");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let c = Cluster::connect(args.clone()).await?;
        if let Some(l) = lift {
            return decide(&c, l).await;
        }
        if args.status {
            return status(&c).await;
        }
        if args.watch {
            return watch(&c).await;
        }
        rollout(&c, false).await
    })
}

/// The failed node's verdict for a halt, read from its agent: the verdict line and each
/// check that did not pass; or why it cannot be read.
async fn halt_verdict(c: &Cluster, view: &ClusterView, h: &record::Halt) -> String {
    let Some(step) = &h.step else {
        return "no step was begun on the node (nothing to read)".into();
    };
    let Some(url) = view.agents.get(&h.node) else {
        return format!(
            "no stepguard agent on node {} to ask for step {step}",
            h.node
        );
    };
    let r = match c.agent(url) {
        Ok(a) => {
            a.call(
                "GET",
                &format!("/v1/steps/{step}"),
                None,
                Duration::from_secs(5),
            )
            .await
        }
        Err(e) => Err(e),
    };
    match r {
        Ok((200 | 202, v)) => {
            let verdict = &v["verdict"];
            let mut out = format!(
                "node {}'s verdict for step {step}: {} — {}",
                h.node,
                verdict["status"].as_str().unwrap_or("none yet"),
                verdict["summary"].as_str().unwrap_or("")
            );
            if let Some(checks) = v["checks"].as_object() {
                for (name, ch) in checks {
                    if ch["status"] != "pass" {
                        out.push_str(&format!(
                            "\n    {name}: {} — {}",
                            ch["status"].as_str().unwrap_or("?"),
                            ch["reason"].as_str().unwrap_or("")
                        ));
                    }
                }
            }
            out
        }
        Ok((404, _)) => format!(
            "node {}'s agent no longer knows step {step} (restarted without its state?)",
            h.node
        ),
        Ok((code, v)) => format!("node {}'s agent answered {code}: {v}", h.node),
        Err(e) => format!("cannot ask node {}'s agent for step {step}: {e:#}", h.node),
    }
}

/// `--status`: the rollout's record on its lock, for people (or `--output json`).
async fn status(c: &Cluster) -> Result<i32> {
    let (lease, rec) = patient(
        "read the rollout lock",
        Duration::from_secs(30),
        None,
        || read_lock(c),
    )
    .await?;
    let Some(lease) = lease else {
        println!(
            "no rollout lock {}/{}: no rollout has run, or its record was removed",
            c.args.lock_namespace,
            c.lock_name()
        );
        return Ok(0);
    };
    let spec = lease.spec.clone().unwrap_or_default();
    let verdict = match &rec.halt {
        Some(h) => match c.view().await {
            Ok((v, _)) => Some(halt_verdict(c, &v, h).await),
            Err(e) => Some(format!(
                "cannot read the cluster for the failed node's verdict: {e:#}"
            )),
        },
        None => None,
    };
    if c.args.output == "json" {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "holder": spec.holder_identity, "renew_time": spec.renew_time.map(|t| t.0.to_string()),
                "inflight": rec.inflight, "halt": rec.halt, "halt_verdict": verdict,
                "retry": rec.retry, "skipped": rec.skipped, "aborted": rec.aborted,
                "decisions": rec.decisions, "history": rec.history}))?
        );
        return Ok(0);
    }
    let h = spec.holder_identity.clone().unwrap_or_default();
    println!(
        "rollout lock {}/{}: {}",
        c.args.lock_namespace,
        c.lock_name(),
        if h.is_empty() {
            "free".to_string()
        } else {
            format!(
                "held by {h} (renewed {})",
                spec.renew_time.map(|t| t.0.to_string()).unwrap_or_default()
            )
        }
    );
    if let Some(i) = &rec.inflight {
        println!(
            "step in flight: node {}, step {}, revision {} ({})",
            i.node, i.step, i.revision, i.why
        );
    }
    if let Some(halt) = &rec.halt {
        println!("{}", record::halt_text(halt));
        if let Some(v) = &verdict {
            println!("  {v}");
        }
    }
    if let Some(n) = &rec.retry {
        println!("node {n} is to be stepped again first (--retry)");
    }
    for sk in &rec.skipped {
        println!(
            "node {} left as it is on revision {} by {}: {}",
            sk.node, sk.revision, sk.by, sk.why
        );
    }
    if let Some(a) = &rec.aborted {
        println!("the rollout of revision {a} was aborted");
    }
    for d in &rec.decisions {
        println!(
            "decision {} {}: {} {} by {}: {}",
            d.at,
            d.action,
            d.node.as_deref().unwrap_or("-"),
            d.revision.as_deref().unwrap_or(""),
            d.by,
            d.why
        );
    }
    if rec.history.is_empty() {
        println!("no history recorded");
    } else {
        println!("history (oldest first, the last {}):", record::HISTORY_KEPT);
        for t in &rec.history {
            println!(
                "  {} {:<26} {}{}",
                t.at,
                t.reason,
                if t.warning { "WARNING " } else { "" },
                t.message
            );
        }
    }
    Ok(0)
}

/// Who takes a decision: the Kubernetes user (SelfSubjectReview) and the local user.
async fn who(c: &Cluster) -> String {
    let user = ["SUDO_USER", "USER", "LOGNAME"]
        .iter()
        .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
        .unwrap_or_else(|| "unknown".into());
    let local = format!(
        "{user}@{}",
        c.identity.rsplit_once('-').map(|h| h.0).unwrap_or("")
    );
    let review = Api::<SelfSubjectReview>::all(c.client.clone())
        .create(&PostParams::default(), &SelfSubjectReview::default())
        .await;
    match review
        .ok()
        .and_then(|r| r.status?.user_info?.username)
        .filter(|u| !u.is_empty())
    {
        Some(u) => format!("{u} ({local})"),
        None => local,
    }
}

/// `--abort`, `--retry NODE`, `--skip NODE`: a person's decision, recorded on the lock with
/// who took it and why, and told in an Event.
async fn decide(c: &Cluster, l: Lift) -> Result<i32> {
    let by = who(c).await;
    let why = c
        .args
        .reason
        .clone()
        .unwrap_or_else(|| "no reason given".into());
    let ds = patient("read the DaemonSet", Duration::from_secs(30), None, || {
        c.daemonset()
    })
    .await?;
    let (view, _) = patient("read the cluster", Duration::from_secs(30), None, || {
        c.view()
    })
    .await?;
    let current = view.revision.clone().map(|r| r.0).unwrap_or_default();
    let api = c.leases();
    let name = c.lock_name();
    for _ in 0..5 {
        let lease = api.get_opt(&name).await.context("read the rollout lock")?;
        let Some(mut lease) = lease else {
            if l == Lift::Abort {
                println!(
                    "no rollout lock {}/{name}: nothing to abort",
                    c.args.lock_namespace
                );
                return Ok(0);
            }
            eprintln!(
                "no halt stands (there is no rollout lock {}/{name}): nothing to lift",
                c.args.lock_namespace
            );
            return Ok(2);
        };
        let mut ann = annotations(&lease.metadata);
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().unwrap_or_default();
        let mut rec = match Record::parse(&ann) {
            Ok(r) => r,
            // An unreadable record: only `--abort` may clear it.
            Err(e) if l == Lift::Abort => {
                println!("the lock's record is unreadable and is cleared: {e}");
                Record::default()
            }
            Err(e) => bail!("{e}: `stepguard rollout --abort` clears it"),
        };
        if l == Lift::Abort {
            println!(
                "releasing the lock held by {} (renewed {}), at node {}, step {}{}",
                if holder.is_empty() { "nobody" } else { &holder },
                spec.renew_time.map(|t| t.0.to_string()).unwrap_or_default(),
                rec.inflight
                    .as_ref()
                    .map(|i| i.node.as_str())
                    .unwrap_or("-"),
                rec.inflight
                    .as_ref()
                    .map(|i| i.step.as_str())
                    .unwrap_or("-"),
                rec.halt
                    .as_ref()
                    .map(|h| format!("; lifting the halt at node {}", h.node))
                    .unwrap_or_default()
            );
        } else if !holder.is_empty() {
            // Whether its holder still renews it, observed as client-go does.
            if let Err(live) = observe(c, lease.clone()).await? {
                eprintln!(
                    "a rollout is running ({live}): decide when it has ended, or `--abort` it"
                );
                return Ok(2);
            }
        }
        let next = match record::lift(&mut rec, &l, &by, &why, &current, &stamp()) {
            Ok(n) => n,
            Err(e) => {
                eprintln!("stepguard rollout: {e}");
                return Ok(2);
            }
        };
        for k in [
            record::ANN_NODE,
            record::ANN_STEP,
            record::ANN_REVISION,
            record::ANN_INFLIGHT,
            record::ANN_HALT,
            record::ANN_RETRY,
            record::ANN_SKIPPED,
            record::ANN_ABORTED,
            record::ANN_DECISIONS,
            record::ANN_HISTORY,
        ] {
            ann.remove(k);
        }
        if let Some(d) = rec.decisions.last() {
            rec.tell(
                &stamp(),
                false,
                if l == Lift::Abort {
                    "StepguardRolloutAborted"
                } else {
                    "StepguardHaltLifted"
                },
                &format!("{} by {}: {}", d.action, d.by, d.why),
            );
        }
        rec.write(&mut ann);
        lease.metadata.annotations = Some(ann.into_iter().collect());
        if l == Lift::Abort {
            lease
                .spec
                .get_or_insert_with(Default::default)
                .holder_identity = None;
        }
        match api.replace(&name, &PostParams::default(), &lease).await {
            Ok(_) => {}
            Err(e) if api_code(&e) == Some(409) => continue,
            Err(e) => return Err(e).context("record the decision on the rollout lock"),
        }
        let d = rec.decisions.last().cloned().unwrap_or_default();
        c.event(
            &ds,
            false,
            if l == Lift::Abort {
                "StepguardRolloutAborted"
            } else {
                "StepguardHaltLifted"
            },
            &format!(
                "{} {} by {}: {}",
                d.action,
                d.node
                    .as_deref()
                    .map(|n| format!("node {n}"))
                    .unwrap_or_default(),
                d.by,
                d.why
            ),
        )
        .await;
        println!("{next}");
        return Ok(0);
    }
    bail!("the rollout lock kept changing while recording the decision: try again")
}

/// `--watch`: whether to start now (a revision not all nodes run, approved).
pub fn approved(view: &ClusterView, approved: Option<&str>) -> bool {
    let Some((rev, _)) = &view.revision else {
        return false;
    };
    approved == Some(rev.as_str()) && view.pods.iter().any(|p| &p.revision != rev)
}

/// `--watch`: never ends on an error; a line is logged whenever what it waits for changes.
async fn watch(c: &Cluster) -> Result<i32> {
    let mut last = String::new();
    let mut announced = String::new();
    loop {
        let note = match watch_tick(c, &mut announced).await {
            Ok(n) => n,
            Err(e) => format!("cannot read the cluster (retrying every tick): {e:#}"),
        };
        if note != last && !note.is_empty() {
            tracing::warn!("{note}");
            eprintln!("stepguard rollout --watch: {note}");
        }
        last = note;
        tokio::time::sleep(c.args.watch_interval).await;
    }
}

/// One `--watch` tick: what it is waiting for, or the end of the rollout it ran. A revision
/// waiting for approval is told once in an Event (`announced`: the revision told last).
async fn watch_tick(c: &Cluster, announced: &mut String) -> Result<String> {
    let (v, ds) = c.view().await?;
    let (_, rec) = read_lock(c).await?;
    let cur = v.revision.clone().map(|r| r.0).unwrap_or_default();
    let approve = approval(&ds, &cur);
    let owed = rec.inflight.is_some() || rec.retry.is_some();
    if let Gate::Halted(m) = record::gate(&rec, &cur, approve.as_deref(), &stamp()) {
        return Ok(m);
    }
    if !owed && !v.pods.iter().any(|p| p.revision != cur) {
        return Ok(String::new());
    }
    if !owed && rec.aborted.as_deref() == Some(cur.as_str()) {
        return Ok(format!(
            "the rollout of revision {cur} was aborted: approve a new revision to start again (or run `stepguard rollout` by hand)"
        ));
    }
    // An interrupted step is always finished (its delete waits for an approval itself); a
    // retry alone waits for the revision to be approved, instead of a run per tick that
    // pauses at once.
    if let (None, Some(n)) = (&rec.inflight, &rec.retry) {
        if approve.as_deref() != Some(cur.as_str()) {
            return Ok(format!(
                "node {n} is to be stepped again but the DaemonSet's revision {cur} is not approved ({}): waiting",
                unapproved_why(&ds)
            ));
        }
    }
    if owed || approved(&v, approve.as_deref()) {
        let code = rollout(c, true).await?;
        return Ok(format!("rollout ended with exit code {code}"));
    }
    let note = format!(
        "revision {cur} is not approved ({}): waiting",
        unapproved_why(&ds)
    );
    if *announced != cur {
        c.event(&ds, false, "StepguardApprovalAwaited", &format!("{note}; approve it with stepguard.io/approve-revision: {cur}, or stepguard.io/approve-image and stepguard.io/approve-config-checksum in the commit that changes the template"))
            .await;
        *announced = cur;
    }
    Ok(note)
}

fn say(json: bool, line: String) {
    if json {
        eprintln!("{line}");
    } else {
        println!("{line}");
    }
}

fn plan_opts(c: &Cluster) -> PlanOpts {
    PlanOpts {
        canary: c.args.canary.clone(),
        canary_label: c
            .args
            .canary_label
            .as_deref()
            .and_then(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string())),
        max_nodes: c.args.max_nodes,
        vip_groups: c
            .args
            .vip_groups
            .iter()
            .filter_map(|g| g.split_once('='))
            .map(|(n, s)| (n.to_string(), s.split(',').map(String::from).collect()))
            .collect(),
        pause_between: c.args.pause_between,
        allow_minor_skip: c.args.allow_minor_skip,
        ..Default::default()
    }
}

/// The step for an interrupted node, from what the lock recorded.
fn resumed_step(i: &InFlight) -> PlannedStep {
    PlannedStep {
        node: i.node.clone(),
        pod: i.pod.clone(),
        pod_uid: i.pod_uid.clone(),
        why: if i.why.is_empty() {
            "resumed".into()
        } else {
            format!("{} (resumed)", i.why)
        },
        moves: vec![],
        pause_before: Duration::ZERO,
    }
}

/// A rollout run; `watched`: started by `--watch`, which goes on only to approved revisions.
async fn rollout(c: &Cluster, watched: bool) -> Result<i32> {
    let json_out = c.args.output == "json";
    let mut opts = plan_opts(c);
    let start = Duration::from_secs(60);
    let (view, ds) = patient("read the cluster", start, None, || c.view()).await?;
    let (_, rec) = patient("read the rollout lock", start, None, || read_lock(c)).await?;
    let current = view.revision.clone().unwrap_or_default();
    let approve = approval(&ds, &current.0);
    if let Gate::Halted(msg) = record::gate(&rec, &current.0, approve.as_deref(), &stamp()) {
        if json_out {
            println!(
                "{}",
                serde_json::to_string_pretty(&json!({"halted": rec.halt, "message": msg,
                "verdict": match &rec.halt {
                    Some(h) => Some(halt_verdict(c, &view, h).await),
                    None => None,
                }}))?
            );
        } else {
            println!("refusing to start the rollout of {}: {msg}", view.daemonset);
            if let Some(h) = &rec.halt {
                println!("  {}", halt_verdict(c, &view, h).await);
            }
        }
        return Ok(2);
    }
    opts.skip = rec.skipped_on(&current.0).into_iter().collect();
    opts.again = rec.retry.clone();
    let first = plan::plan(&view, &opts);
    let refusals_text = |r: &[plan::Refusal]| {
        r.iter()
            .map(|r| format!("  - {r}"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    if let (None, Err(refusals)) = (&rec.inflight, &first) {
        if json_out {
            println!(
                "{}",
                serde_json::to_string_pretty(&json!({"refused": refusals, "view": view}))?
            );
        } else {
            println!(
                "refusing to start the rollout of {}:\n{}",
                view.daemonset,
                refusals_text(refusals)
            );
        }
        return Ok(2);
    }
    if c.args.dry_run {
        if json_out {
            println!(
                "{}",
                serde_json::to_string_pretty(&json!({
                    "interrupted": rec.inflight, "retry": rec.retry, "skipped": rec.skipped,
                    "plan": first.as_ref().ok(), "refused": first.as_ref().err(), "view": view}))?
            );
        } else {
            if let Some(i) = &rec.inflight {
                println!(
                    "first, the interrupted step on node {} (step {}, revision {}) is finished: its replacement awaited and its verdict read",
                    i.node, i.step, i.revision
                );
            }
            for s in rec.skipped.iter().filter(|s| s.revision == current.0) {
                println!(
                    "node {} is left as it is on this revision (skipped by {}: {})",
                    s.node, s.by, s.why
                );
            }
            match &first {
                Ok(p) => print!("{}", plan::render(&view, p)),
                Err(r) => println!("after it, the plan refuses to go on:\n{}", refusals_text(r)),
            }
        }
        return Ok(0);
    }
    let now = stamp();
    let (cur_hash, approve2) = (current.0.clone(), approve.clone());
    let taken = patient("take the rollout lock", start, None, || {
        acquire(c, |r| {
            match record::gate(r, &cur_hash, approve2.as_deref(), &now) {
                Gate::Halted(m) => Err(m),
                Gate::Go { lift } => {
                    if let Some(d) = lift {
                        r.halt = None;
                        r.decide(d);
                    }
                    r.forget_other_revisions(&cur_hash);
                    if !watched {
                        // A person runs the rollout again: an earlier `--abort` no longer holds.
                        r.aborted = None;
                    }
                    Ok(())
                }
            }
        })
    })
    .await?;
    let rec = match taken {
        Ok(r) => r,
        Err(why) => {
            say(json_out, format!("refusing to start: {why}"));
            return Ok(2);
        }
    };
    // The lock is renewed in the background every retry period (with the record); losing it
    // stops everything.
    let held = Arc::new(Held::new());
    let shared = Arc::new(Mutex::new(rec.clone()));
    *c.told.lock().unwrap_or_else(|e| e.into_inner()) = Some(shared.clone());
    let renewer = {
        let (held, shared) = (held.clone(), shared.clone());
        let c2 = Cluster {
            client: c.client.clone(),
            ns: c.ns.clone(),
            ds: c.ds.clone(),
            args: c.args.clone(),
            token: c.token.clone(),
            identity: c.identity.clone(),
            told: Mutex::new(None),
        };
        tokio::spawn(async move {
            let every = lock_times(&c2).retry;
            while !held.is_lost() {
                tokio::time::sleep(every).await;
                renew_held(&c2, &shared, &held).await;
            }
        })
    };
    if rec.halt.is_none() {
        if let Some(d) = rec
            .decisions
            .last()
            .filter(|d| d.action == "approved" && d.at == now)
        {
            c.event(
                &ds,
                false,
                "StepguardHaltLifted",
                &format!("{}: {}", d.by, d.why),
            )
            .await;
        }
    }
    if let Some(i) = &rec.inflight {
        say(
            json_out,
            format!(
                "resuming the rollout interrupted at node {} (step {}, revision {})",
                i.node, i.step, i.revision
            ),
        );
    }
    c.event(
        &ds,
        false,
        "StepguardRolloutStarted",
        &format!(
            "stepguard rollout of revision {} started: {} nodes to step",
            current.0,
            first.as_ref().map(|p| p.len()).unwrap_or(0) + usize::from(rec.inflight.is_some())
        ),
    )
    .await;
    let t0 = Instant::now();
    let mut results: Vec<NodeResult> = Vec::new();
    let mut code = 0;
    let mut ending: Option<String> = None;
    let mut pending = rec.inflight.clone();
    // The revision this run goes on to: under `--watch` only an approved one.
    let mut run_rev = if !watched || approve.as_deref() == Some(current.0.as_str()) {
        current.0.clone()
    } else {
        String::new()
    };
    let run_id = format!("{:x}", (now_s() * 1000.0) as u64 % 0xffffff);
    let mut ds = ds;
    let mut waiting = Waiting::default();
    loop {
        if held.is_lost() {
            code = 2;
            ending = Some("the rollout lock was lost: nothing more is touched".into());
            break;
        }
        if c.args.max_nodes.is_some_and(|m| results.len() >= m) {
            break;
        }
        // Transient failures, and a plan that refuses to go on, are waited out (the lock is
        // renewed meanwhile); only a failed step or a person stops a rollout.
        let (view, ds_now) = match c.view().await {
            Ok(v) => v,
            Err(e) if transient(&e) => {
                waiting
                    .wait(
                        json_out,
                        format!("cannot read the cluster (retrying): {e:#}"),
                    )
                    .await;
                continue;
            }
            Err(e) => {
                code = 2;
                ending = Some(format!("cannot read the cluster: {e:#}"));
                break;
            }
        };
        ds = ds_now;
        let (st, target, resumed) = if let Some(i) = pending.take() {
            let st = resumed_step(&i);
            let target = (i.revision.clone(), i.revision_number);
            (st, target, Some(i))
        } else {
            let Some(cur) = view.revision.clone() else {
                code = 2;
                ending = Some("the DaemonSet has no ControllerRevision any more".into());
                break;
            };
            if cur.0 != run_rev {
                if record::may_adopt(&run_rev, &cur.0, approval(&ds, &cur.0).as_deref()) {
                    say(
                        json_out,
                        format!(
                            "the DaemonSet moved to approved revision {}: re-planning",
                            cur.0
                        ),
                    );
                    run_rev = cur.0.clone();
                    shared
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .forget_other_revisions(&run_rev);
                } else {
                    code = 2;
                    let why = format!(
                        "revision {} of the DaemonSet is not approved ({}): the rollout pauses after node {}; approve it to go on{}",
                        cur.0,
                        unapproved_why(&ds),
                        results.last().map(|r| r.node.as_str()).unwrap_or("-"),
                        if watched { "" } else { ", or run `stepguard rollout` again" }
                    );
                    c.event(&ds, true, "StepguardRolloutPaused", &why).await;
                    ending = Some(why);
                    break;
                }
            }
            {
                let r = shared.lock().unwrap_or_else(|e| e.into_inner());
                opts.skip = r.skipped_on(&run_rev).into_iter().collect();
                opts.again = r.retry.clone();
            }
            opts.max_nodes = None;
            match plan::plan(&view, &opts) {
                Ok(steps) => match steps.into_iter().next() {
                    Some(s) => (s, cur, None),
                    None => break,
                },
                Err(refusals) => {
                    let note = format!(
                        "waiting: the plan refuses to go on:\n{}",
                        refusals_text(&refusals)
                    );
                    waiting.wait(json_out, note).await;
                    continue;
                }
            }
        };
        waiting = Waiting::default();
        if !results.is_empty() && !st.pause_before.is_zero() {
            say(
                json_out,
                format!(
                    "pausing {}s before {} ({})",
                    st.pause_before.as_secs(),
                    st.node,
                    st.why
                ),
            );
            tokio::time::sleep(st.pause_before).await;
        }
        let cx = StepCx {
            c,
            ds: &ds,
            held: &held,
            shared: &shared,
            run_id: &run_id,
            n: results.len() + 1,
            json_out,
        };
        let r = step_node(&cx, &view, &st, target.clone(), resumed).await;
        let stop = !matches!(r.outcome, Outcome::Passed { .. });
        {
            let mut rec = shared.lock().unwrap_or_else(|e| e.into_inner());
            match &r.outcome {
                Outcome::Passed { .. } => {
                    rec.inflight = None;
                    if rec.retry.as_deref() == Some(st.node.as_str()) {
                        rec.retry = None;
                    }
                }
                Outcome::Failed { step, why } => {
                    code = 1;
                    rec.inflight = None;
                    rec.retry = None;
                    rec.halt = Some(record::Halt {
                        node: st.node.clone(),
                        step: step.clone(),
                        revision: target.0.clone(),
                        reason: why.clone(),
                        at: stamp(),
                    });
                }
                Outcome::Stopped { .. } => code = 2,
            }
        }
        if let Outcome::Failed { .. } = &r.outcome {
            // The halt is on the lock before anything else happens (release may not get
            // through; a later run must see it).
            persist(c, &shared, &held).await;
            let h = shared
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .halt
                .clone();
            if let Some(h) = h {
                c.event(&ds, true, "StepguardRolloutHalted", &record::halt_text(&h))
                    .await;
            }
        } else if !stop {
            persist(c, &shared, &held).await;
        }
        results.push(r);
        if stop {
            break;
        }
    }
    let summary = match code {
        0 => format!(
            "stepguard rollout finished: {} nodes stepped and verified",
            results.len()
        ),
        1 => format!(
            "stepguard rollout halted: the step on {} failed; no further node is touched until a person decides (`--retry`, `--skip`, `--abort`)",
            results.last().map(|r| r.node.as_str()).unwrap_or("?")
        ),
        _ => format!(
            "stepguard rollout interrupted: {}",
            ending
                .clone()
                .unwrap_or_else(|| "the lock was lost".into())
        ),
    };
    c.event(
        &ds,
        code != 0,
        if code == 0 {
            "StepguardRolloutDone"
        } else {
            "StepguardRolloutStopped"
        },
        &summary,
    )
    .await;
    // The rollout's end is on the record too; then the lock is given up.
    renewer.abort();
    *c.told.lock().unwrap_or_else(|e| e.into_inner()) = None;
    let rec = shared.lock().unwrap_or_else(|e| e.into_inner()).clone();
    if !held.is_lost() {
        release(c, &rec).await;
    }
    if json_out {
        println!(
            "{}",
            serde_json::to_string_pretty(
                &json!({"exit_code": code, "summary": summary, "elapsed_s": t0.elapsed().as_secs_f64(), "nodes": results, "halt": rec.halt})
            )?
        );
    } else {
        println!("\n{summary} in {:.0}s", t0.elapsed().as_secs_f64());
        println!(
            "  {:<20} {:<22} {:<10} {:>8}  DETAIL",
            "NODE", "WHY", "OUTCOME", "TIME"
        );
        for r in &results {
            let (o, d) = match &r.outcome {
                Outcome::Passed { summary, .. } => ("passed", summary.clone()),
                Outcome::Failed { why, .. } => ("FAILED", why.clone()),
                Outcome::Stopped { why } => ("stopped", why.clone()),
            };
            println!(
                "  {:<20} {:<22} {:<10} {:>7.0}s  {d}",
                r.node, r.why, o, r.elapsed_s
            );
        }
        if let Some(h) = &rec.halt {
            println!("\n{}", record::halt_text(h));
        }
    }
    Ok(code)
}

/// A rollout waiting out something (a transient failure, a plan that refuses to go on): each
/// new reason told once, the pause growing from 0.5 s to 15 s.
#[derive(Default)]
struct Waiting {
    note: String,
    delay: Duration,
}

impl Waiting {
    async fn wait(&mut self, json_out: bool, note: String) {
        if note != self.note {
            say(json_out, note.clone());
            self.note = note;
        }
        let d = self.delay.max(Duration::from_millis(500));
        tokio::time::sleep(d).await;
        self.delay = (d * 2).min(Duration::from_secs(15));
    }
}

/// What every step of a run shares.
struct StepCx<'a> {
    c: &'a Cluster,
    ds: &'a DaemonSet,
    held: &'a Held,
    shared: &'a Mutex<Record>,
    run_id: &'a str,
    n: usize,
    json_out: bool,
}

async fn step_node(
    cx: &StepCx<'_>,
    view: &ClusterView,
    st: &PlannedStep,
    target: (String, i64),
    resumed: Option<InFlight>,
) -> NodeResult {
    let t0 = Instant::now();
    let c = cx.c;
    let (held, n, json_out) = (cx.held, cx.n, cx.json_out);
    let lost = &held.lost;
    let mut st = st.clone();
    let result = |st: &PlannedStep, outcome: Outcome, stages: &Stages| NodeResult {
        node: st.node.clone(),
        why: st.why.clone(),
        moves: st.moves.clone(),
        outcome,
        elapsed_s: t0.elapsed().as_secs_f64(),
        replacement: stages.durations(),
    };
    let mut stages = Stages::default();
    let sel = Cluster::selector(cx.ds);
    let agent = match view
        .agents
        .get(&st.node)
        .ok_or_else(|| anyhow::anyhow!("no stepguard agent on node {}", st.node))
        .and_then(|url| c.agent(url))
    {
        Ok(a) => a,
        Err(e) => {
            return result(
                &st,
                Outcome::Failed {
                    step: resumed.as_ref().map(|i| i.step.clone()),
                    why: format!("cannot reach the node's agent to verify the step: {e:#}"),
                },
                &stages,
            )
        }
    };
    // The verdict's polls: at most two a second, and not before the agent's Retry-After.
    let mut pace = crate::client::Pace::default();
    let mut retry_after: Option<Duration> = None;
    let t = Timeouts {
        replace: c.args.replace_timeout.as_secs_f64(),
        verdict: c.args.step_timeout.as_secs_f64() + 60.0,
        pull: c.args.pull_timeout.as_secs_f64(),
    };
    let forever = Duration::MAX;
    let mut phase = match &resumed {
        Some(i) => {
            let knows = match agent
                .call(
                    "GET",
                    &format!("/v1/steps/{}", i.step),
                    None,
                    Duration::from_secs(5),
                )
                .await
            {
                Ok((200 | 202, _)) => Some(true),
                Ok((404, _)) => Some(false),
                _ => None,
            };
            let old = patient(
                "read the interrupted step's pod",
                forever,
                Some(lost),
                || c.old_pod(&sel, i),
            )
            .await;
            match old {
                Ok((old, pod)) => {
                    if let Some((name, uid)) = pod {
                        st.pod = name;
                        st.pod_uid = uid;
                    }
                    let replaced = c
                        .replaced(cx.ds, &sel, &st.node, &st.pod_uid, (&target.0, target.1))
                        .await
                        .is_ok_and(|(found, _)| found.is_some());
                    machine::resume(&i.step, knows, old, replaced, now_s())
                }
                Err(e) if lost.load(Ordering::SeqCst) => Phase::Done(Outcome::Stopped {
                    why: format!("the rollout lock was lost: {e:#}"),
                }),
                Err(e) => Phase::Done(Outcome::Failed {
                    step: Some(i.step.clone()),
                    why: format!("cannot read the interrupted step's pod: {e:#}"),
                }),
            }
        }
        None => Phase::Begin,
    };
    let mut last_shown = String::new();
    // The run id first: a long node name is cut, never the part that makes the id new.
    let step_id = format!("rollout-{}-{}-{}", cx.run_id, target.0, st.node)
        .chars()
        .filter(|ch| ch.is_ascii_alphanumeric() || "-_.".contains(*ch))
        .take(64)
        .collect::<String>();
    let mut carried: Option<String> = None;
    loop {
        // Decided (also by a lost lock, which turns every phase into Done): nothing more to do.
        if matches!(phase, Phase::Done(_)) {
            break;
        }
        let shown = match &phase {
            Phase::Begin => "beginning the step".to_string(),
            Phase::Delete { step } => format!("deleting pod {} (step {step})", st.pod),
            Phase::Replace { .. } => "waiting for the replacement pod".to_string(),
            Phase::Verdict { .. } => "waiting for the verdict".to_string(),
            Phase::Done(_) => String::new(),
        };
        if shown != last_shown && !shown.is_empty() {
            say(
                json_out,
                format!(
                    "[{n:>2}] {:<20} {shown} ({:.1}s)",
                    st.node,
                    t0.elapsed().as_secs_f64()
                ),
            );
            last_shown = shown;
        }
        let ev = if lost.load(Ordering::SeqCst) {
            Event::LockLost
        } else {
            match machine::action(&phase) {
                machine::Action::BeginStep => {
                    let mut body = json!({
                        "id": step_id,
                        "settle": format!("{}ms", c.args.settle.as_millis()),
                        "timeout": format!("{}ms", c.args.step_timeout.as_millis()),
                    });
                    let mut expect = serde_json::Map::new();
                    if let Some(v) = &view.cilium_version {
                        expect.insert("cilium".into(), json!(v));
                    }
                    if let Some(d) = &c.args.expect_devices {
                        expect.insert("devices".into(), json!(d));
                    }
                    if !expect.is_empty() {
                        body["expect"] = Value::Object(expect);
                    }
                    if !c.args.witnesses.is_empty() {
                        body["witnesses"] = json!(c.args.witnesses);
                    }
                    // The id is idempotent: a begin that got no answer is asked again.
                    let mut r = Err(anyhow::anyhow!("not asked"));
                    for attempt in 0..3 {
                        if attempt > 0 {
                            tokio::time::sleep(Duration::from_secs(2)).await;
                        }
                        r = agent
                            .call(
                                "POST",
                                "/v1/steps",
                                Some(body.clone()),
                                Duration::from_secs(60),
                            )
                            .await;
                        if !matches!(&r, Err(_) | Ok((503, _))) {
                            break;
                        }
                    }
                    let ev = Event::Begun(match r {
                        Ok((200 | 201, v)) => v["id"]
                            .as_str()
                            .map(String::from)
                            .ok_or_else(|| "no step id".to_string()),
                        Ok((s, v)) => Err(format!(
                            "agent answered {s}: {}",
                            v["error"].as_str().unwrap_or("")
                        )),
                        Err(e) => Err(format!("{e:#}")),
                    });
                    if let Event::Begun(Ok(id)) = &ev {
                        // Recorded before the pod is deleted: a resumed run finishes this step.
                        cx.shared.lock().unwrap_or_else(|e| e.into_inner()).inflight =
                            Some(InFlight {
                                node: st.node.clone(),
                                step: id.clone(),
                                pod: st.pod.clone(),
                                pod_uid: st.pod_uid.clone(),
                                revision: target.0.clone(),
                                revision_number: target.1,
                                why: st.why.clone(),
                            });
                        if persist(c, cx.shared, held).await {
                            c.event(
                                cx.ds,
                                false,
                                "StepguardStepBegun",
                                &format!(
                                    "node {}: step {id} begun ({}); deleting pod {}",
                                    st.node, st.why, st.pod
                                ),
                            )
                            .await;
                        }
                    }
                    ev
                }
                machine::Action::DeletePod
                    if !record::may_adopt(
                        &target.0,
                        view.revision.as_ref().map(|r| r.0.as_str()).unwrap_or(""),
                        approval(
                            cx.ds,
                            view.revision.as_ref().map(|r| r.0.as_str()).unwrap_or(""),
                        )
                        .as_deref(),
                    ) =>
                {
                    // A resumed step whose pod is still there, while the DaemonSet moved to a
                    // revision nobody approved: deleting now would start that revision.
                    phase = Phase::Done(Outcome::Stopped {
                        why: format!(
                            "the DaemonSet moved to revision {} (not approved) before pod {} was deleted: paused; approve it to go on",
                            view.revision.as_ref().map(|r| r.0.as_str()).unwrap_or("?"),
                            st.pod
                        ),
                    });
                    continue;
                }
                machine::Action::DeletePod => {
                    // Right before the delete, the lock is renewed (it is ours now, not only
                    // as of the last renewal: a stepper paused since then may have lost it).
                    let r = patient(
                        "delete the cilium pod",
                        c.args.replace_timeout,
                        Some(lost),
                        || async {
                            if !persist(c, cx.shared, held).await {
                                bail!("the rollout lock was lost before the delete");
                            }
                            c.delete_pod(&st.pod, &st.pod_uid).await
                        },
                    )
                    .await;
                    match r {
                        Err(_) if held.is_lost() => Event::LockLost,
                        r => Event::Deleted(r.map_err(|e| format!("{e:#}"))),
                    }
                }
                machine::Action::FindReplacement => {
                    // The replacement's stage, shown and timed as it changes.
                    let (found, now_stage) = c
                        .replaced(cx.ds, &sel, &st.node, &st.pod_uid, (&target.0, target.1))
                        .await
                        .unwrap_or((None, None));
                    if let Some(stg) = now_stage {
                        if stages.enter(&stg, now_s()) {
                            let line = if stg == Stage::Ready {
                                format!("replacement Ready: {}", stages.summary())
                            } else {
                                format!("replacement: {}", stg.label())
                            };
                            say(
                                json_out,
                                format!(
                                    "[{n:>2}] {:<20} {line} ({:.1}s)",
                                    st.node,
                                    t0.elapsed().as_secs_f64()
                                ),
                            );
                        }
                    }
                    match &found {
                        None => tokio::time::sleep(Duration::from_millis(500)).await,
                        Some(h) if *h != target.0 && carried.is_none() => {
                            say(
                                json_out,
                                format!(
                                    "[{n:>2}] {:<20} the replacement carries revision {h}, newer than the step's {}: the template changed before it was created",
                                    st.node, target.0
                                ),
                            );
                            carried = Some(h.clone());
                        }
                        Some(_) => {}
                    }
                    match stages.pulling_since() {
                        Some(started) if found.is_none() => Event::Pulling { started },
                        _ => Event::Replaced(found.is_some()),
                    }
                }
                machine::Action::WaitVerdict { step } => {
                    pace.wait(retry_after.take()).await;
                    let r = agent
                        .call_paced(
                            "GET",
                            &format!("/v1/steps/{step}?wait=20s"),
                            None,
                            Duration::from_secs(30),
                        )
                        .await
                        .map(|(s, v, ra)| {
                            retry_after = ra;
                            (s, v)
                        });
                    match r {
                        Ok((200, v)) => {
                            let reasons: Vec<&str> = v["verdict"]["reasons"]
                                .as_array()
                                .map(|a| a.iter().filter_map(|r| r.as_str()).collect())
                                .unwrap_or_default();
                            let summary = v["verdict"]["summary"].as_str().unwrap_or("");
                            Event::Verdict(Ok(Some((
                                v["verdict"]["status"].as_str().unwrap_or("?").to_string(),
                                if reasons.is_empty() {
                                    summary.to_string()
                                } else {
                                    format!("{} — {summary}", reasons.join(", "))
                                },
                            ))))
                        }
                        Ok((202, _)) => Event::Verdict(Ok(None)),
                        Ok((s, v)) => {
                            retry_after = retry_after.or(Some(Duration::from_secs(1)));
                            Event::Verdict(Err(format!("agent answered {s}: {v}")))
                        }
                        Err(e) => {
                            retry_after = Some(Duration::from_secs(1));
                            Event::Verdict(Err(format!("{e:#}")))
                        }
                    }
                }
                machine::Action::Finished => break,
            }
        };
        phase = machine::advance(phase, ev, now_s(), t);
    }
    let Phase::Done(outcome) = phase else {
        unreachable!()
    };
    let (warn, reason, msg) = match &outcome {
        Outcome::Passed { step, summary } => (
            false,
            "StepguardStepPassed",
            format!("node {}: step {step} passed: {summary}", st.node),
        ),
        Outcome::Failed { step, why } => (
            true,
            "StepguardStepFailed",
            format!(
                "node {}: step {} failed: {why}; the rollout halts here",
                st.node,
                step.as_deref().unwrap_or("-")
            ),
        ),
        Outcome::Stopped { why } => (
            true,
            "StepguardRolloutStopped",
            format!("node {}: {why}", st.node),
        ),
    };
    c.event(cx.ds, warn, reason, &msg).await;
    say(
        json_out,
        format!(
            "[{n:>2}] {:<20} {} ({:.1}s)",
            st.node,
            match &outcome {
                Outcome::Passed { summary, .. } => format!("passed: {summary}"),
                Outcome::Failed { why, .. } => format!("FAILED: {why}"),
                Outcome::Stopped { why } => format!("stopped: {why}"),
            },
            t0.elapsed().as_secs_f64()
        ),
    );
    result(&st, outcome, &stages)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_whole_selector_becomes_a_label_selector() {
        let sel: k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector =
            serde_json::from_value(json!({
                "matchLabels": {"k8s-app": "cilium"},
                "matchExpressions": [
                    {"key": "pool", "operator": "In", "values": ["a", "b"]},
                    {"key": "debug", "operator": "NotIn", "values": ["true"]},
                    {"key": "tier", "operator": "Exists"},
                    {"key": "legacy", "operator": "DoesNotExist"}]}))
            .unwrap();
        assert_eq!(
            selector_string(&sel),
            "k8s-app=cilium,pool in (a,b),debug notin (true),tier,!legacy"
        );
    }

    fn ds(image: &str, checksum: Option<&str>, ann: Value) -> DaemonSet {
        let mut tmeta = json!({"labels": {"k8s-app": "cilium"}});
        if let Some(c) = checksum {
            tmeta["annotations"] = json!({ CONFIG_CHECKSUM: c });
        }
        serde_json::from_value(json!({
            "metadata": {"name": "cilium", "generation": 4, "annotations": ann},
            "spec": {"selector": {"matchLabels": {"k8s-app": "cilium"}},
                     "template": {"metadata": tmeta, "spec": {"containers": [{"name": "cilium-agent", "image": image}]}}},
            "status": {"observedGeneration": 4, "currentNumberScheduled": 0, "desiredNumberScheduled": 0,
                       "numberMisscheduled": 0, "numberReady": 0}
        }))
        .unwrap()
    }

    #[test]
    fn git_approves_the_image_and_config_checksum_a_revision_carries() {
        let img = "quay.io/cilium/cilium:v1.19.1@sha256:aa";
        let both = json!({ ANN_APPROVE_IMAGE: img, ANN_APPROVE_CONFIG: "c2" });
        assert_eq!(
            approval(&ds(img, Some("c2"), both.clone()), "h2").as_deref(),
            Some("h2")
        );
        // A config-only revision does not ride the approval of the earlier config.
        assert_eq!(approval(&ds(img, Some("c3"), both.clone()), "h3"), None);
        assert!(
            unapproved_why(&ds(img, Some("c3"), both.clone())).contains("config checksum is c3")
        );
        // Another image; a checksum the approval does not name.
        assert_eq!(
            approval(&ds("cilium:v1.19.2", Some("c2"), both), "h4"),
            None
        );
        let image_only = json!({ ANN_APPROVE_IMAGE: img });
        assert_eq!(
            approval(&ds(img, Some("c2"), image_only.clone()), "h5"),
            None
        );
        // Without the chart's checksum, the image alone.
        assert_eq!(
            approval(&ds(img, None, image_only), "h6").as_deref(),
            Some("h6")
        );
        // The revision hash, as before; an older one stays what it names.
        let named = json!({ ANN_APPROVE: "h1" });
        assert_eq!(
            approval(&ds(img, None, named.clone()), "h1").as_deref(),
            Some("h1")
        );
        assert_eq!(approval(&ds(img, None, named), "h7").as_deref(), Some("h1"));
        // Not judged before the controller observed the template.
        let mut d = ds(img, None, json!({ ANN_APPROVE_IMAGE: img }));
        d.metadata.generation = Some(5);
        assert_eq!(approval(&d, "h8"), None);
    }

    #[test]
    fn the_minor_version_comes_from_the_image_tag() {
        assert_eq!(
            image_minor("quay.io/cilium/cilium:v1.18.2@sha256:abc").as_deref(),
            Some("1.18")
        );
        assert_eq!(image_minor("cilium:1.17.0").as_deref(), Some("1.17"));
        assert_eq!(image_minor("cilium:latest"), None);
        assert_eq!(image_minor("registry:5000/cilium"), None);
    }

    #[test]
    fn watch_starts_only_an_approved_revision_not_yet_everywhere() {
        let mut v = ClusterView {
            revision: Some(("r2".into(), 2)),
            ..Default::default()
        };
        v.pods.push(CiliumPod {
            name: "p".into(),
            uid: "u".into(),
            node: "n".into(),
            revision: "r1".into(),
            ready: true,
            image: String::new(),
            bound: true,
            crash_looping: None,
        });
        assert!(!approved(&v, None));
        assert!(!approved(&v, Some("r1")), "an older approval");
        assert!(approved(&v, Some("r2")));
        v.pods[0].revision = "r2".into();
        assert!(!approved(&v, Some("r2")), "already everywhere");
    }

    #[test]
    fn a_pending_daemon_pod_belongs_to_the_node_its_affinity_names() {
        let p: Pod = serde_json::from_value(json!({
            "metadata": {"name": "cilium-x"},
            "spec": {"containers": [], "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-2"]}]}]}}}}
        }))
        .unwrap();
        assert_eq!(target_node(&p).as_deref(), Some("node-2"));
        let mut bound = p.clone();
        bound.spec.as_mut().unwrap().node_name = Some("node-3".into());
        assert_eq!(target_node(&bound).as_deref(), Some("node-3"));
    }

    #[test]
    fn only_failures_of_the_api_server_itself_are_retried() {
        let api = |code: u16| -> anyhow::Error {
            anyhow::Error::new(kube::Error::Api(Box::new(kube::core::Status {
                code,
                ..Default::default()
            })))
            .context("list the cilium pods")
        };
        assert!(transient(&api(500)));
        assert!(transient(&api(503)));
        assert!(transient(&api(429)));
        assert!(!transient(&api(403)));
        assert!(!transient(&api(404)));
        assert!(!transient(&anyhow::anyhow!("a plain error")));
    }
}
