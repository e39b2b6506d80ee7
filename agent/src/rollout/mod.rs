//! `stepguard rollout`: steps a Cilium DaemonSet (`updateStrategy: OnDelete`) one node at a
//! time, verified by each node's stepguard agent — the stepper the 50-day rollout lacked.
//!
//! Plan (`plan.rs`, pure) → for each node: begin a step on its agent, delete its cilium pod
//! with a UID precondition, wait for a Ready replacement on the current revision, wait for the
//! verdict (`machine.rs`, pure) → re-read the cluster and re-plan (a revision change re-plans).
//! One stepper at a time: a `coordination.k8s.io` Lease in stepguard's namespace, renewed,
//! carrying the node and step in flight, so an interrupted rollout resumes without repeating a
//! step. Kubernetes Events on the DaemonSet tell the story to `kubectl describe`.
pub mod machine;
pub mod plan;

use anyhow::{bail, Context, Result};
use k8s_openapi::api::apps::v1::{ControllerRevision, DaemonSet};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event as KEvent, Node, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
use kube::Client;
use machine::{Event, Outcome, Phase, Timeouts};
use plan::{CiliumPod, ClusterView, L2Lease, NodeInfo, PlanOpts, PlannedStep};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const ANN_NODE: &str = "stepguard.io/node";
const ANN_STEP: &str = "stepguard.io/step";
const ANN_REVISION: &str = "stepguard.io/revision";
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
    /// Release a stale lock (after showing who held it) and exit.
    #[arg(long)]
    pub abort: bool,
    /// Keep running: start a rollout whenever a new revision appears whose hash the
    /// DaemonSet's `stepguard.io/approve-revision` annotation names.
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

    /// Everything the plan needs, read now.
    pub async fn view(&self) -> Result<(ClusterView, DaemonSet)> {
        let ds = self.daemonset().await?;
        let sel = Self::selector(&ds);
        let uid = ds.metadata.uid.clone().unwrap_or_default();
        let revs = Api::<ControllerRevision>::namespaced(self.client.clone(), &self.ns)
            .list(&ListParams::default().labels(&sel))
            .await
            .context("list ControllerRevisions")?;
        let revision = revs
            .items
            .iter()
            .filter(|r| {
                r.metadata
                    .owner_references
                    .iter()
                    .flatten()
                    .any(|o| o.uid == uid)
            })
            .max_by_key(|r| r.revision)
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
            });
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
                    node: p.spec.as_ref()?.node_name.clone()?,
                    revision: p
                        .metadata
                        .labels
                        .as_ref()?
                        .get("controller-revision-hash")?
                        .clone(),
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
    async fn delete_pod(&self, name: &str, uid: &str) -> Result<bool, String> {
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
            Err(e) if api_code(&e) == Some(409) => Err(format!(
                "pod {name} is no longer the one planned (UID {uid} precondition failed): {e}"
            )),
            Err(e) => Err(format!("{e}")),
        }
    }

    /// A Ready cilium pod on `node`, on `revision`, other than `old_uid`.
    async fn replaced(&self, sel: &str, node: &str, old_uid: &str, revision: &str) -> Result<bool> {
        let pods = self.pods().list(&ListParams::default().labels(sel)).await?;
        Ok(pods.items.iter().any(|p| {
            p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)
                && p.metadata.uid.as_deref() != Some(old_uid)
                && p.metadata.deletion_timestamp.is_none()
                && p.metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get("controller-revision-hash"))
                    .map(String::as_str)
                    == Some(revision)
                && pod_ready(p)
        }))
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

/// What the lock recorded of an interrupted run.
#[derive(Clone, Debug, Default)]
pub struct Interrupted {
    pub holder: String,
    pub node: Option<String>,
    pub step: Option<String>,
    pub revision: Option<String>,
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

/// The lock Lease: taken when free or expired; a live lock of another stepper refuses.
async fn acquire(c: &Cluster) -> Result<Result<Option<Interrupted>, String>> {
    let api = c.leases();
    let name = c.lock_name();
    let dur = c.args.lock_duration.as_secs().max(1) as i32;
    match api.get_opt(&name).await.context("read the rollout lock")? {
        None => {
            let l = Lease {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    namespace: Some(c.args.lock_namespace.clone()),
                    ..Default::default()
                },
                spec: Some(k8s_openapi::api::coordination::v1::LeaseSpec {
                    holder_identity: Some(c.identity.clone()),
                    lease_duration_seconds: Some(dur),
                    acquire_time: Some(micro_now()),
                    renew_time: Some(micro_now()),
                    ..Default::default()
                }),
            };
            match api.create(&PostParams::default(), &l).await {
                Ok(_) => Ok(Ok(None)),
                Err(e) if api_code(&e) == Some(409) => {
                    Ok(Err("another stepper took the lock just now".into()))
                }
                Err(e) => Err(e).context("create the rollout lock"),
            }
        }
        Some(mut l) => {
            let ann = l.metadata.annotations.clone().unwrap_or_default();
            let spec = l.spec.clone().unwrap_or_default();
            let holder = spec.holder_identity.clone().unwrap_or_default();
            if !lease_expired(&l, now_s()) && holder != c.identity {
                return Ok(Err(format!(
                    "another rollout holds the lock {}/{name}: {holder}, at node {} (step {}); wait for it, or `stepguard rollout --abort` if it is gone",
                    c.args.lock_namespace,
                    ann.get(ANN_NODE).map(String::as_str).unwrap_or("-"),
                    ann.get(ANN_STEP).map(String::as_str).unwrap_or("-"),
                )));
            }
            let interrupted = Interrupted {
                holder,
                node: ann.get(ANN_NODE).cloned(),
                step: ann.get(ANN_STEP).cloned(),
                revision: ann.get(ANN_REVISION).cloned(),
            };
            let s = l.spec.get_or_insert_with(Default::default);
            s.holder_identity = Some(c.identity.clone());
            s.lease_duration_seconds = Some(dur);
            s.acquire_time = Some(micro_now());
            s.renew_time = Some(micro_now());
            match api.replace(&name, &PostParams::default(), &l).await {
                Ok(_) => Ok(Ok(interrupted.node.is_some().then_some(interrupted))),
                Err(e) if api_code(&e) == Some(409) => {
                    Ok(Err("another stepper took the lock just now".into()))
                }
                Err(e) => Err(e).context("take the rollout lock"),
            }
        }
    }
}

/// Renews the lock and records the node/step in flight. Err: the lock is no longer ours.
async fn renew(
    c: &Cluster,
    inflight: &(Option<String>, Option<String>, Option<String>),
) -> Result<(), String> {
    let api = c.leases();
    let name = c.lock_name();
    for _ in 0..3 {
        let mut l = api
            .get(&name)
            .await
            .map_err(|e| format!("read the lock: {e}"))?;
        if l.spec.as_ref().and_then(|s| s.holder_identity.as_deref()) != Some(c.identity.as_str()) {
            return Err(format!(
                "the lock is held by {}",
                l.spec
                    .as_ref()
                    .and_then(|s| s.holder_identity.clone())
                    .unwrap_or_default()
            ));
        }
        let ann = l.metadata.annotations.get_or_insert_with(Default::default);
        for (k, v) in [
            (ANN_NODE, &inflight.0),
            (ANN_STEP, &inflight.1),
            (ANN_REVISION, &inflight.2),
        ] {
            match v {
                Some(v) => ann.insert(k.into(), v.clone()),
                None => ann.remove(k),
            };
        }
        l.spec.get_or_insert_with(Default::default).renew_time = Some(micro_now());
        match api.replace(&name, &PostParams::default(), &l).await {
            Ok(_) => return Ok(()),
            Err(e) if api_code(&e) == Some(409) => continue,
            Err(e) => return Err(format!("renew the lock: {e}")),
        }
    }
    Err("the lock kept changing under us (409 three times)".into())
}

async fn release(c: &Cluster) {
    let _ = c
        .leases()
        .delete(&c.lock_name(), &DeleteParams::default())
        .await;
}

/// The node, step and revision in flight, as the lock records them.
type InFlight = (Option<String>, Option<String>, Option<String>);

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
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let c = Cluster::connect(args.clone()).await?;
        if args.abort {
            return abort(&c).await;
        }
        if args.watch {
            return watch(&c).await;
        }
        rollout(&c).await
    })
}

async fn abort(c: &Cluster) -> Result<i32> {
    match c.leases().get_opt(&c.lock_name()).await? {
        None => {
            println!(
                "no rollout lock {}/{}",
                c.args.lock_namespace,
                c.lock_name()
            );
            Ok(0)
        }
        Some(l) => {
            let ann = l.metadata.annotations.clone().unwrap_or_default();
            let spec = l.spec.clone().unwrap_or_default();
            println!(
                "releasing the lock held by {} (renewed {}, at node {}, step {})",
                spec.holder_identity.unwrap_or_default(),
                spec.renew_time.map(|t| t.0.to_string()).unwrap_or_default(),
                ann.get(ANN_NODE).map(String::as_str).unwrap_or("-"),
                ann.get(ANN_STEP).map(String::as_str).unwrap_or("-")
            );
            release(c).await;
            Ok(0)
        }
    }
}

/// `--watch`: whether to start now (a revision not all nodes run, approved by annotation).
pub fn approved(view: &ClusterView, ds_annotations: &BTreeMap<String, String>) -> bool {
    let Some((rev, _)) = &view.revision else {
        return false;
    };
    ds_annotations.get(ANN_APPROVE) == Some(rev) && view.pods.iter().any(|p| &p.revision != rev)
}

async fn watch(c: &Cluster) -> Result<i32> {
    loop {
        match c.view().await {
            Ok((v, ds)) => {
                let ann: BTreeMap<String, String> = ds
                    .metadata
                    .annotations
                    .clone()
                    .unwrap_or_default()
                    .into_iter()
                    .collect();
                if approved(&v, &ann) {
                    let code = rollout(c).await?;
                    tracing::info!(code, "rollout finished");
                }
            }
            Err(e) => tracing::warn!(error = %format!("{e:#}"), "cannot read the cluster"),
        }
        tokio::time::sleep(c.args.watch_interval).await;
    }
}

fn say(json: bool, line: String) {
    if json {
        eprintln!("{line}");
    } else {
        println!("{line}");
    }
}

async fn rollout(c: &Cluster) -> Result<i32> {
    let json_out = c.args.output == "json";
    let opts = PlanOpts {
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
    };
    let (view, ds) = c.view().await?;
    let first = match plan::plan(&view, &opts) {
        Ok(p) => p,
        Err(refusals) => {
            if json_out {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&json!({"refused": refusals, "view": view}))?
                );
            } else {
                println!("refusing to start the rollout of {}:", view.daemonset);
                for r in &refusals {
                    println!("  - {r}");
                }
            }
            return Ok(2);
        }
    };
    if c.args.dry_run {
        if json_out {
            println!(
                "{}",
                serde_json::to_string_pretty(&json!({"plan": first, "view": view}))?
            );
        } else {
            print!("{}", plan::render(&view, &first));
        }
        return Ok(0);
    }
    let interrupted = match acquire(c).await? {
        Ok(i) => i,
        Err(why) => {
            say(json_out, format!("refusing to start: {why}"));
            return Ok(2);
        }
    };
    // The lock is renewed in the background; losing it stops everything.
    let lost = Arc::new(AtomicBool::new(false));
    let inflight: Arc<Mutex<InFlight>> = Arc::new(Mutex::new((None, None, None)));
    let renewer = {
        let (lost, inflight) = (lost.clone(), inflight.clone());
        let c2 = Cluster {
            client: c.client.clone(),
            ns: c.ns.clone(),
            ds: c.ds.clone(),
            args: c.args.clone(),
            token: c.token.clone(),
            identity: c.identity.clone(),
        };
        tokio::spawn(async move {
            let every = c2.args.lock_duration / 3;
            loop {
                tokio::time::sleep(every).await;
                let cur = inflight.lock().unwrap_or_else(|e| e.into_inner()).clone();
                if let Err(e) = renew(&c2, &cur).await {
                    tracing::error!(error = %e, "the rollout lock was lost");
                    lost.store(true, Ordering::SeqCst);
                    return;
                }
            }
        })
    };
    if let Some(i) = &interrupted {
        say(
            json_out,
            format!(
                "resuming the rollout interrupted at node {} (step {}, lock held by {})",
                i.node.as_deref().unwrap_or("-"),
                i.step.as_deref().unwrap_or("-"),
                i.holder
            ),
        );
    }
    c.event(
        &ds,
        false,
        "StepguardRolloutStarted",
        &format!(
            "stepguard rollout of revision {} started: {} nodes to step",
            view.revision.as_ref().map(|r| r.0.as_str()).unwrap_or("?"),
            first.len()
        ),
    )
    .await;
    let t0 = Instant::now();
    let mut results: Vec<NodeResult> = Vec::new();
    let mut code = 0;
    let mut pending_resume = interrupted;
    let run_id = format!("{:x}", (now_s() * 1000.0) as u64 % 0xffffff);
    loop {
        if lost.load(Ordering::SeqCst) {
            code = 2;
            break;
        }
        let (view, ds) = c.view().await?;
        let steps = match plan::plan(&view, &opts) {
            Ok(p) => p,
            Err(refusals) => {
                for r in &refusals {
                    say(json_out, format!("stopping: {r}"));
                }
                code = 2;
                break;
            }
        };
        if c.args.max_nodes.is_some_and(|m| results.len() >= m) {
            break;
        }
        // The interrupted node first, when it is still to step.
        let next = match pending_resume.as_ref().and_then(|i| i.node.clone()) {
            Some(n) => steps
                .iter()
                .find(|s| s.node == n)
                .or(steps.first())
                .cloned(),
            None => steps.first().cloned(),
        };
        let Some(st) = next else { break };
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
        let resume = pending_resume
            .take()
            .filter(|i| i.node.as_deref() == Some(&st.node));
        let r = step_node(
            c,
            &view,
            &ds,
            &st,
            resume,
            &run_id,
            &lost,
            &inflight,
            results.len() + 1,
            json_out,
        )
        .await?;
        let stop = !matches!(r.outcome, Outcome::Passed { .. });
        if let Outcome::Failed { .. } = r.outcome {
            code = 1;
        }
        if let Outcome::Stopped { .. } = r.outcome {
            code = 2;
        }
        results.push(r);
        if stop {
            break;
        }
    }
    renewer.abort();
    *inflight.lock().unwrap_or_else(|e| e.into_inner()) = (None, None, None);
    if !lost.load(Ordering::SeqCst) {
        release(c).await;
    }
    let (_, ds) = c.view().await?;
    let summary = match code {
        0 => format!(
            "stepguard rollout finished: {} nodes stepped and verified",
            results.len()
        ),
        1 => format!(
            "stepguard rollout stopped: the step on {} failed; no further node was touched",
            results.last().map(|r| r.node.as_str()).unwrap_or("?")
        ),
        _ => "stepguard rollout interrupted: the lock was lost or the plan refused to go on"
            .to_string(),
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
                &json!({"exit_code": code, "summary": summary, "elapsed_s": t0.elapsed().as_secs_f64(), "nodes": results})
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
    }
    Ok(code)
}

#[allow(clippy::too_many_arguments)]
async fn step_node(
    c: &Cluster,
    view: &ClusterView,
    ds: &DaemonSet,
    st: &PlannedStep,
    resume: Option<Interrupted>,
    run_id: &str,
    lost: &AtomicBool,
    inflight: &Mutex<InFlight>,
    n: usize,
    json_out: bool,
) -> Result<NodeResult> {
    let t0 = Instant::now();
    let rev = view.revision.clone().map(|r| r.0).unwrap_or_default();
    let sel = Cluster::selector(ds);
    let url = view.agents.get(&st.node).cloned().unwrap_or_default();
    let agent = c.agent(&url)?;
    // The verdict's polls: at most two a second, and not before the agent's Retry-After.
    let mut pace = crate::client::Pace::default();
    let mut retry_after: Option<Duration> = None;
    let t = Timeouts {
        replace: c.args.replace_timeout.as_secs_f64(),
        verdict: c.args.step_timeout.as_secs_f64() + 60.0,
    };
    let mut phase = match &resume {
        Some(i) => {
            let knows = match &i.step {
                Some(s) => agent
                    .call(
                        "GET",
                        &format!("/v1/steps/{s}"),
                        None,
                        Duration::from_secs(5),
                    )
                    .await
                    .map(|(code, _)| code == 200 || code == 202)
                    .unwrap_or(false),
                None => false,
            };
            let old_present = view.pods.iter().any(|p| p.uid == st.pod_uid);
            let replaced = c
                .replaced(&sel, &st.node, &st.pod_uid, &rev)
                .await
                .unwrap_or(false);
            machine::resume(i.step.as_deref(), knows, old_present, replaced, now_s())
        }
        None => Phase::Begin,
    };
    let mut last_shown = String::new();
    let step_id = format!("rollout-{rev}-{}-{run_id}", st.node)
        .chars()
        .filter(|ch| ch.is_ascii_alphanumeric() || "-_.".contains(*ch))
        .take(64)
        .collect::<String>();
    loop {
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
                    let r = agent
                        .call("POST", "/v1/steps", Some(body), Duration::from_secs(60))
                        .await;
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
                        // Recorded before the pod is deleted: a resumed run waits on this step.
                        *inflight.lock().unwrap_or_else(|e| e.into_inner()) =
                            (Some(st.node.clone()), Some(id.clone()), Some(rev.clone()));
                        if let Err(e) = renew(
                            c,
                            &(Some(st.node.clone()), Some(id.clone()), Some(rev.clone())),
                        )
                        .await
                        {
                            lost.store(true, Ordering::SeqCst);
                            tracing::error!(error = %e, "the rollout lock was lost");
                        }
                        c.event(
                            ds,
                            false,
                            "StepguardStepBegun",
                            &format!(
                                "node {}: step {id} begun ({}); deleting pod {}",
                                st.node, st.why, st.pod
                            ),
                        )
                        .await;
                    }
                    ev
                }
                machine::Action::DeletePod => {
                    Event::Deleted(c.delete_pod(&st.pod, &st.pod_uid).await)
                }
                machine::Action::FindReplacement => {
                    let ok = c
                        .replaced(&sel, &st.node, &st.pod_uid, &rev)
                        .await
                        .unwrap_or(false);
                    if !ok {
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                    Event::Replaced(ok)
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
                "node {}: step {} failed: {why}; the rollout stops here",
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
    c.event(ds, warn, reason, &msg).await;
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
    Ok(NodeResult {
        node: st.node.clone(),
        why: st.why.clone(),
        moves: st.moves.clone(),
        outcome,
        elapsed_s: t0.elapsed().as_secs_f64(),
    })
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
}
