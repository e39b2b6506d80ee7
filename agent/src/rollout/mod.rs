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
pub mod machine;
pub mod plan;
pub mod record;

use anyhow::{bail, Context, Result};
use k8s_openapi::api::apps::v1::{ControllerRevision, DaemonSet};
use k8s_openapi::api::authentication::v1::SelfSubjectReview;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event as KEvent, Node, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
use kube::Client;
use machine::{Event, OldPod, Outcome, Phase, Timeouts};
use plan::{CiliumPod, ClusterView, L2Lease, NodeInfo, PlanOpts, PlannedStep};
use record::{Gate, InFlight, Lift, Record};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// On the DaemonSet: `--watch` starts a rollout when this equals the current revision's hash.
pub const ANN_APPROVE: &str = "stepguard.io/approve-revision";
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
    /// How long the replacement cilium pod has to be Ready on the current revision.
    #[arg(long, default_value = "10m", value_parser = crate::duration::parse)]
    pub replace_timeout: Duration,
    /// The devices every node must carry the datapath on after its restart (when the new
    /// revision changes them on purpose).
    #[arg(long, value_delimiter = ',')]
    pub expect_devices: Option<Vec<String>>,
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

    fn selector(ds: &DaemonSet) -> String {
        ds.spec
            .as_ref()
            .and_then(|s| s.selector.match_labels.clone())
            .unwrap_or_default()
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",")
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
        let image = ds
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .and_then(|p| {
                p.containers
                    .iter()
                    .find(|c| c.name == "cilium-agent")
                    .or(p.containers.first())
            })
            .and_then(|c| c.image.clone())
            .unwrap_or_default();
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
        let pods: Vec<CiliumPod> = self
            .pods()
            .list(&ListParams::default().labels(&sel))
            .await
            .context("list the cilium pods")?
            .items
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter_map(|p| {
                Some(CiliumPod {
                    name: p.metadata.name.clone()?,
                    uid: p.metadata.uid.clone()?,
                    node: target_node(&p)?,
                    revision: pod_revision(&p)?,
                    ready: pod_ready(&p),
                })
            })
            .collect();
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
        let view = ClusterView {
            daemonset: format!("{}/{}", self.ns, self.ds),
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

    /// A Ready replacement on `node` (a pod other than `old_uid`, not being deleted) on the
    /// step's revision `target` or a newer one: the revision it carries.
    async fn replaced(
        &self,
        ds: &DaemonSet,
        sel: &str,
        node: &str,
        old_uid: &str,
        target: (&str, i64),
    ) -> Result<Option<String>> {
        let pods = self.pods().list(&ListParams::default().labels(sel)).await?;
        let ready: Vec<String> = pods
            .items
            .iter()
            .filter(|p| {
                target_node(p).as_deref() == Some(node)
                    && p.metadata.uid.as_deref() != Some(old_uid)
                    && p.metadata.deletion_timestamp.is_none()
                    && pod_ready(p)
            })
            .filter_map(pod_revision)
            .collect();
        if let Some(h) = ready.iter().find(|h| *h == target.0) {
            return Ok(Some(h.clone()));
        }
        if ready.is_empty() {
            return Ok(None);
        }
        let numbers = self.revisions(ds).await?;
        Ok(ready
            .into_iter()
            .find(|h| machine::acceptable_revision(h, target, &numbers)))
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

fn pod_ready(p: &Pod) -> bool {
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

fn lease_expired(l: &Lease, now: f64) -> bool {
    let spec = l.spec.clone().unwrap_or_default();
    if spec.holder_identity.as_deref().unwrap_or("").is_empty() {
        return true;
    }
    let renew = spec
        .renew_time
        .map(|t| t.0.as_second() as f64)
        .unwrap_or(0.0);
    renew + spec.lease_duration_seconds.unwrap_or(0) as f64 <= now
}

fn annotations(meta: &ObjectMeta) -> BTreeMap<String, String> {
    meta.annotations
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect()
}

fn approval(ds: &DaemonSet) -> Option<String> {
    annotations(&ds.metadata).get(ANN_APPROVE).cloned()
}

fn stamp() -> String {
    k8s_openapi::jiff::Timestamp::now().to_string()
}

/// The lock Lease and the record it carries (a record that cannot be read is an error).
async fn read_lock(c: &Cluster) -> Result<(Option<Lease>, Record)> {
    let l = c
        .leases()
        .get_opt(&c.lock_name())
        .await
        .context("read the rollout lock")?;
    let rec = match &l {
        Some(l) => Record::parse(&annotations(&l.metadata)).map_err(|e| {
            anyhow::anyhow!(
                "{e}: fix or remove it (`kubectl -n {} edit lease {}`), or `stepguard rollout --abort`",
                c.args.lock_namespace,
                c.lock_name()
            )
        })?,
        None => Record::default(),
    };
    Ok((l, rec))
}

/// Takes the lock when free or expired; a live lock of another stepper refuses. `admit` sees
/// the record under the lock (it may change it, or refuse: a halt recorded meanwhile).
async fn acquire(
    c: &Cluster,
    admit: impl Fn(&mut Record) -> Result<(), String>,
) -> Result<Result<Record, String>> {
    let api = c.leases();
    let name = c.lock_name();
    let dur = c.args.lock_duration.as_secs().max(1) as i32;
    let (lease, mut rec) = read_lock(c).await?;
    if let Some(l) = &lease {
        let holder = l
            .spec
            .as_ref()
            .and_then(|s| s.holder_identity.clone())
            .unwrap_or_default();
        if !lease_expired(l, now_s()) && holder != c.identity {
            let at = rec.inflight.as_ref();
            return Ok(Err(format!(
                "another rollout holds the lock {}/{name}: {holder}, at node {} (step {}); wait for it, or `stepguard rollout --abort` if it is gone",
                c.args.lock_namespace,
                at.map(|i| i.node.as_str()).unwrap_or("-"),
                at.map(|i| i.step.as_str()).unwrap_or("-"),
            )));
        }
    }
    if let Err(why) = admit(&mut rec) {
        return Ok(Err(why));
    }
    let mut l = lease.unwrap_or_else(|| Lease {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: Some(c.args.lock_namespace.clone()),
            ..Default::default()
        },
        ..Default::default()
    });
    let mut ann = annotations(&l.metadata);
    rec.write(&mut ann);
    l.metadata.annotations = Some(ann.into_iter().collect());
    let s = l.spec.get_or_insert_with(Default::default);
    s.holder_identity = Some(c.identity.clone());
    s.lease_duration_seconds = Some(dur);
    s.acquire_time = Some(micro_now());
    s.renew_time = Some(micro_now());
    let r = if l.metadata.resource_version.is_some() {
        api.replace(&name, &PostParams::default(), &l).await
    } else {
        api.create(&PostParams::default(), &l).await
    };
    match r {
        Ok(_) => Ok(Ok(rec)),
        Err(e) if api_code(&e) == Some(409) => {
            Ok(Err("another stepper took the lock just now".into()))
        }
        Err(e) => Err(e).context("take the rollout lock"),
    }
}

enum RenewError {
    /// Someone else holds the lock: stop touching anything now.
    NotOurs(String),
    /// The API server did not take the renewal; the lock holds until it expires.
    Failed(String),
}

/// Renews the lock and writes the record as it is at each attempt (a 409 retry never writes
/// an older copy over a newer one), giving up at `within`: a renewal must not outlive the
/// lock it renews.
async fn renew(c: &Cluster, shared: &Mutex<Record>, within: Duration) -> Result<(), RenewError> {
    match tokio::time::timeout(within.max(Duration::from_millis(100)), renew_now(c, shared)).await {
        Ok(r) => r,
        Err(_) => Err(RenewError::Failed(format!(
            "the API server did not answer the renewal within {:.1}s",
            within.as_secs_f64()
        ))),
    }
}

async fn renew_now(c: &Cluster, shared: &Mutex<Record>) -> Result<(), RenewError> {
    let api = c.leases();
    let name = c.lock_name();
    for _ in 0..3 {
        let mut l = api.get(&name).await.map_err(|e| match api_code(&e) {
            Some(404) => RenewError::NotOurs("the lock was deleted (`--abort`?)".into()),
            _ => RenewError::Failed(format!("read the lock: {e}")),
        })?;
        let holder = l
            .spec
            .as_ref()
            .and_then(|s| s.holder_identity.clone())
            .unwrap_or_default();
        if holder != c.identity {
            return Err(RenewError::NotOurs(format!(
                "the lock is held by {}",
                if holder.is_empty() {
                    "nobody (released by `--abort`?)"
                } else {
                    &holder
                }
            )));
        }
        let rec = shared.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut ann = annotations(&l.metadata);
        rec.write(&mut ann);
        l.metadata.annotations = Some(ann.into_iter().collect());
        l.spec.get_or_insert_with(Default::default).renew_time = Some(micro_now());
        match api.replace(&name, &PostParams::default(), &l).await {
            Ok(_) => return Ok(()),
            Err(e) if api_code(&e) == Some(409) => continue,
            Err(e) => return Err(RenewError::Failed(format!("renew the lock: {e}"))),
        }
    }
    Err(RenewError::Failed(
        "the lock kept changing under us (409 three times)".into(),
    ))
}

/// How long a renewal may keep failing before the lock must be taken as lost: another
/// stepper may take it once it expired.
fn renew_tolerance(c: &Cluster) -> Duration {
    c.args
        .lock_duration
        .saturating_sub(c.args.lock_duration / 3)
}

/// Writes the record now, retrying until it is written or the lock must be taken as lost.
async fn persist(c: &Cluster, shared: &Mutex<Record>, lost: &AtomicBool) -> bool {
    let t0 = Instant::now();
    loop {
        if lost.load(Ordering::SeqCst) {
            return false;
        }
        match renew(c, shared, renew_tolerance(c).saturating_sub(t0.elapsed())).await {
            Ok(()) => return true,
            Err(RenewError::NotOurs(e)) => {
                tracing::error!(error = %e, "the rollout lock was lost");
                lost.store(true, Ordering::SeqCst);
                return false;
            }
            Err(RenewError::Failed(e)) => {
                if t0.elapsed() >= renew_tolerance(c) {
                    tracing::error!(error = %e, "the rollout lock could not be renewed before it expires: taken as lost");
                    lost.store(true, Ordering::SeqCst);
                    return false;
                }
                tracing::warn!(error = %e, "recording the rollout on its lock; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

/// Gives the lock up, leaving the record for the next run (the Lease is deleted when there is
/// nothing to leave). A lock that is no longer ours is not touched.
async fn release(c: &Cluster, rec: &Record) {
    let api = c.leases();
    let name = c.lock_name();
    for attempt in 0..10 {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let mut l = match api.get(&name).await {
            Ok(l) => l,
            Err(e) if api_code(&e) == Some(404) => return,
            Err(_) => continue,
        };
        if l.spec.as_ref().and_then(|s| s.holder_identity.as_deref()) != Some(c.identity.as_str()) {
            return;
        }
        let r = if rec.is_empty() {
            let dp = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: None,
                    resource_version: l.metadata.resource_version.clone(),
                }),
                ..Default::default()
            };
            api.delete(&name, &dp).await.map(|_| ())
        } else {
            let mut ann = annotations(&l.metadata);
            rec.write(&mut ann);
            l.metadata.annotations = Some(ann.into_iter().collect());
            let s = l.spec.get_or_insert_with(Default::default);
            s.holder_identity = None;
            s.renew_time = Some(micro_now());
            api.replace(&name, &PostParams::default(), &l)
                .await
                .map(|_| ())
        };
        match r {
            Ok(()) => return,
            Err(e) if api_code(&e) == Some(404) => return,
            Err(e) => tracing::warn!(error = %e, "releasing the rollout lock; retrying"),
        }
    }
    tracing::error!("could not release the rollout lock: it expires by itself");
}

/// One node's result, for the summary.
#[derive(Clone, Debug, serde::Serialize)]
pub struct NodeResult {
    pub node: String,
    pub why: String,
    pub moves: Vec<String>,
    pub outcome: Outcome,
    pub elapsed_s: f64,
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
        if args.watch {
            return watch(&c).await;
        }
        rollout(&c, false).await
    })
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
        } else if !lease_expired(&lease, now_s()) {
            eprintln!("a rollout is running ({holder}): decide when it has ended, or `--abort` it");
            return Ok(2);
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
        ] {
            ann.remove(k);
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

/// `--watch`: whether to start now (a revision not all nodes run, approved by annotation).
pub fn approved(view: &ClusterView, ds_annotations: &BTreeMap<String, String>) -> bool {
    let Some((rev, _)) = &view.revision else {
        return false;
    };
    ds_annotations.get(ANN_APPROVE) == Some(rev) && view.pods.iter().any(|p| &p.revision != rev)
}

/// `--watch`: never ends on an error; a line is logged whenever what it waits for changes.
async fn watch(c: &Cluster) -> Result<i32> {
    let mut last = String::new();
    loop {
        let note = match watch_tick(c).await {
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

/// One `--watch` tick: what it is waiting for, or the end of the rollout it ran.
async fn watch_tick(c: &Cluster) -> Result<String> {
    let (v, ds) = c.view().await?;
    let ann = annotations(&ds.metadata);
    let (_, rec) = read_lock(c).await?;
    let cur = v.revision.clone().map(|r| r.0).unwrap_or_default();
    let owed = rec.inflight.is_some() || rec.retry.is_some();
    if let Gate::Halted(m) = record::gate(
        &rec,
        &cur,
        ann.get(ANN_APPROVE).map(String::as_str),
        &stamp(),
    ) {
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
        if ann.get(ANN_APPROVE) != Some(&cur) {
            return Ok(format!(
                "node {n} is to be stepped again but the DaemonSet's revision {cur} is not approved (stepguard.io/approve-revision is {}): waiting",
                ann.get(ANN_APPROVE).map(String::as_str).unwrap_or("not set")
            ));
        }
    }
    if owed || approved(&v, &ann) {
        let code = rollout(c, true).await?;
        return Ok(format!("rollout ended with exit code {code}"));
    }
    Ok(format!(
        "revision {cur} is not approved (stepguard.io/approve-revision is {}): waiting",
        ann.get(ANN_APPROVE)
            .map(String::as_str)
            .unwrap_or("not set")
    ))
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
    let approve = approval(&ds);
    if let Gate::Halted(msg) = record::gate(&rec, &current.0, approve.as_deref(), &stamp()) {
        if json_out {
            println!(
                "{}",
                serde_json::to_string_pretty(&json!({"halted": rec.halt, "message": msg}))?
            );
        } else {
            println!("refusing to start the rollout of {}: {msg}", view.daemonset);
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
    // The lock is renewed in the background (with the record); losing it stops everything.
    let lost = Arc::new(AtomicBool::new(false));
    let shared = Arc::new(Mutex::new(rec.clone()));
    let renewer = {
        let (lost, shared) = (lost.clone(), shared.clone());
        let c2 = Cluster {
            client: c.client.clone(),
            ns: c.ns.clone(),
            ds: c.ds.clone(),
            args: c.args.clone(),
            token: c.token.clone(),
            identity: c.identity.clone(),
        };
        tokio::spawn(async move {
            let every = (c2.args.lock_duration / 3).max(Duration::from_millis(200));
            let mut last_ok = Instant::now();
            loop {
                tokio::time::sleep(every).await;
                let left = renew_tolerance(&c2).saturating_sub(last_ok.elapsed());
                match renew(&c2, &shared, left).await {
                    Ok(()) => last_ok = Instant::now(),
                    Err(RenewError::NotOurs(e)) => {
                        tracing::error!(error = %e, "the rollout lock was lost");
                        lost.store(true, Ordering::SeqCst);
                        return;
                    }
                    Err(RenewError::Failed(e)) => {
                        if last_ok.elapsed() >= renew_tolerance(&c2) {
                            tracing::error!(error = %e, "the rollout lock could not be renewed before it expires: taken as lost");
                            lost.store(true, Ordering::SeqCst);
                            return;
                        }
                        tracing::warn!(error = %e, "renewing the rollout lock; retrying");
                    }
                }
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
        if lost.load(Ordering::SeqCst) {
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
                if record::may_adopt(&run_rev, &cur.0, approval(&ds).as_deref()) {
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
                        "revision {} of the DaemonSet is not approved (stepguard.io/approve-revision is {}): the rollout pauses after node {}; approve it to go on{}",
                        cur.0,
                        approval(&ds).unwrap_or_else(|| "not set".into()),
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
            lost: &lost,
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
            persist(c, &shared, &lost).await;
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
            persist(c, &shared, &lost).await;
        }
        results.push(r);
        if stop {
            break;
        }
    }
    renewer.abort();
    let rec = shared.lock().unwrap_or_else(|e| e.into_inner()).clone();
    if !lost.load(Ordering::SeqCst) {
        release(c, &rec).await;
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
    lost: &'a AtomicBool,
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
    let (lost, n, json_out) = (cx.lost, cx.n, cx.json_out);
    let mut st = st.clone();
    let result = |st: &PlannedStep, outcome: Outcome| NodeResult {
        node: st.node.clone(),
        why: st.why.clone(),
        moves: st.moves.clone(),
        outcome,
        elapsed_s: t0.elapsed().as_secs_f64(),
    };
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
            )
        }
    };
    // The verdict's polls: at most two a second, and not before the agent's Retry-After.
    let mut pace = crate::client::Pace::default();
    let mut retry_after: Option<Duration> = None;
    let t = Timeouts {
        replace: c.args.replace_timeout.as_secs_f64(),
        verdict: c.args.step_timeout.as_secs_f64() + 60.0,
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
                        .ok()
                        .flatten()
                        .is_some();
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
                        if persist(c, cx.shared, lost).await {
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
                        approval(cx.ds).as_deref(),
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
                    let r = patient(
                        "delete the cilium pod",
                        c.args.replace_timeout,
                        Some(lost),
                        || c.delete_pod(&st.pod, &st.pod_uid),
                    )
                    .await;
                    Event::Deleted(r.map_err(|e| format!("{e:#}")))
                }
                machine::Action::FindReplacement => {
                    let found = c
                        .replaced(cx.ds, &sel, &st.node, &st.pod_uid, (&target.0, target.1))
                        .await
                        .ok()
                        .flatten();
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
                    Event::Replaced(found.is_some())
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
    result(&st, outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        });
        let mut ann = BTreeMap::new();
        assert!(!approved(&v, &ann));
        ann.insert(ANN_APPROVE.to_string(), "r1".to_string());
        assert!(!approved(&v, &ann), "an older approval");
        ann.insert(ANN_APPROVE.to_string(), "r2".to_string());
        assert!(approved(&v, &ann));
        v.pods[0].revision = "r2".into();
        assert!(!approved(&v, &ann), "already everywhere");
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
