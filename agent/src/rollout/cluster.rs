//! Reading the cluster for the stepper: the DaemonSet, its revisions and pods, the nodes,
//! the L2 leases, the operator, each node's agent; deleting a pod with a UID precondition;
//! Events; retrying what the API server failed transiently. Nothing here decides.
use super::mirror::Mirror;
use super::*;

/// Cluster access (kube) and the agents (HTTP).
pub struct Cluster {
    pub(super) client: Client,
    pub(super) ns: String,
    pub(super) ds: String,
    pub(super) args: RolloutArgs,
    pub(super) token: Option<String>,
    pub(super) identity: String,
    /// While this run holds the lock: its record, where every Event is also kept.
    pub(super) told: Mutex<Option<Arc<Mutex<Record>>>>,
    /// The cluster as watches keep it, once a rollout or `--watch` started them; a one-shot
    /// command (`--dry-run`, `--status`, a decision) lists instead.
    pub(super) mirrors: Arc<std::sync::OnceLock<Mirrors>>,
    /// The DaemonSet and its revisions as last read from the API server right before a
    /// delete, and when: a batch's deletes share one read within [`FRESH_READ`].
    pub(super) before_delete: tokio::sync::Mutex<Option<ReadBeforeDelete>>,
}

/// The DaemonSet and its revisions (hash → number) as read right before a delete, and when.
type ReadBeforeDelete = (Instant, DaemonSet, BTreeMap<String, i64>);

/// How recent the read right before a delete must be (a batch's deletes share it).
const FRESH_READ: Duration = Duration::from_millis(1000);

/// What the stepper watches: the DaemonSet, its revisions and pods, the nodes, the agents,
/// the L2-announcement Leases and the Services.
pub(super) struct Mirrors {
    pub(super) ds: Mirror<DaemonSet>,
    pub(super) revisions: Mirror<ControllerRevision>,
    pub(super) pods: Mirror<Pod>,
    pub(super) nodes: Mirror<Node>,
    pub(super) agents: Mirror<Pod>,
    pub(super) leases: Mirror<Lease>,
    pub(super) services: Mirror<k8s_openapi::api::core::v1::Service>,
}

impl Mirrors {
    /// Lists and watches made so far, by what.
    pub(super) fn requests(&self) -> Vec<(&'static str, (u64, u64))> {
        vec![
            ("daemonset", self.ds.requests()),
            ("controllerrevisions", self.revisions.requests()),
            ("cilium pods", self.pods.requests()),
            ("nodes", self.nodes.requests()),
            ("agent pods", self.agents.requests()),
            ("leases", self.leases.requests()),
            ("services", self.services.requests()),
        ]
    }
}

/// The stepper's lock identity: the host and PID for people, and a random part so two
/// replicas with the same hostname and PID (PID 1 in two containers) never both hold the lock.
pub(super) fn identity(host: &str, pid: u32) -> String {
    let mut r = [0u8; 8];
    if getrandom::fill(&mut r).is_err() {
        // No randomness: the time's nanoseconds still tell two processes apart.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        r = (t.as_nanos() as u64).to_le_bytes();
    }
    format!("{host}-{pid}-{:016x}", u64::from_le_bytes(r))
}

/// The host part of an identity made by [`identity`].
pub(super) fn identity_host(id: &str) -> &str {
    let mut parts = id.rsplitn(3, '-');
    let (_, _, host) = (parts.next(), parts.next(), parts.next());
    host.unwrap_or("")
}

pub(super) fn api_code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
    }
}

pub(super) fn now_s() -> f64 {
    crate::kernel::clock::now()
}

pub(super) fn micro_now() -> MicroTime {
    MicroTime(k8s_openapi::jiff::Timestamp::now())
}

/// Why there is no cluster configuration at all, in one line: not in a pod (no
/// `KUBERNETES_SERVICE_HOST`) and no kubeconfig file where the client looks. `None` when
/// there may be one (the client then says what is wrong with it).
fn no_cluster_config() -> Option<String> {
    if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() {
        return None;
    }
    let files: Vec<std::path::PathBuf> = match std::env::var_os("KUBECONFIG") {
        Some(v) if !v.is_empty() => std::env::split_paths(&v).collect(),
        _ => std::env::var_os("HOME")
            .map(|h| std::path::Path::new(&h).join(".kube/config"))
            .into_iter()
            .collect(),
    };
    if files.iter().any(|f| f.exists()) {
        return None;
    }
    let shown: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
    Some(format!(
        "not running in a pod (KUBERNETES_SERVICE_HOST is unset) and no kubeconfig at {}; set $KUBECONFIG",
        if shown.is_empty() { "~/.kube/config".into() } else { shown.join(", ") }
    ))
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
        if let Some(why) = no_cluster_config() {
            bail!("no Kubernetes API to connect to: {why}");
        }
        // The client's own message already holds its causes: said once, not as a chain.
        let client = Client::try_default().await.map_err(|e| {
            anyhow::anyhow!(
                "connect to the Kubernetes API (in-cluster, or $KUBECONFIG / ~/.kube/config): {e}"
            )
        })?;
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
            identity: identity(&host, std::process::id()),
            args,
            token,
            told: Mutex::new(None),
            mirrors: Arc::new(std::sync::OnceLock::new()),
            before_delete: tokio::sync::Mutex::new(None),
        })
    }

    /// The DaemonSet and its revisions (hash → number) from the API server, read within the
    /// last [`FRESH_READ`] (the steps of a batch deleting side by side share one read).
    pub(super) async fn before_delete(
        &self,
    ) -> Result<(DaemonSet, BTreeMap<String, i64>), RolloutError> {
        let mut last = self.before_delete.lock().await;
        if let Some((at, ds, numbers)) = last.as_ref() {
            if at.elapsed() < FRESH_READ {
                return Ok((ds.clone(), numbers.clone()));
            }
        }
        let at = Instant::now();
        let ds = self.daemonset_now().await?;
        let numbers = self.revisions_fresh(&ds).await?;
        *last = Some((at, ds.clone(), numbers.clone()));
        Ok((ds, numbers))
    }

    /// Starts watching what the stepper reads (the DaemonSet read once for its selector),
    /// and waits for every first list; reads go to the mirrors from then on.
    pub(super) async fn watch_cluster(&self) -> Result<(), RolloutError> {
        if self.mirrors.get().is_some() {
            return Ok(());
        }
        let ds = Api::<DaemonSet>::namespaced(self.client.clone(), &self.ns)
            .get(&self.ds)
            .await
            .api_with(|| format!("get DaemonSet {}/{}", self.ns, self.ds))?;
        let sel = Self::selector(&ds);
        let m = Mirrors {
            ds: Mirror::start(
                Api::namespaced(self.client.clone(), &self.ns),
                None,
                Some(format!("metadata.name={}", self.ds)),
                "the DaemonSet",
            ),
            revisions: Mirror::start(
                Api::namespaced(self.client.clone(), &self.ns),
                Some(sel.clone()),
                None,
                "the ControllerRevisions",
            ),
            pods: Mirror::start(
                Api::namespaced(self.client.clone(), &self.ns),
                Some(sel),
                None,
                "the cilium pods",
            ),
            nodes: Mirror::start(Api::all(self.client.clone()), None, None, "the Nodes"),
            agents: Mirror::start(
                Api::namespaced(self.client.clone(), &self.args.agents_namespace),
                Some(self.args.agents_selector.clone()),
                None,
                "the stepguard agents",
            ),
            leases: Mirror::start(
                Api::namespaced(self.client.clone(), &self.ns),
                None,
                None,
                "the L2-announcement Leases",
            ),
            services: Mirror::start(Api::all(self.client.clone()), None, None, "the Services"),
        };
        let within = Duration::from_secs(60);
        for (what, ok) in [
            ("the DaemonSet", m.ds.synced(within).await),
            ("the ControllerRevisions", m.revisions.synced(within).await),
            ("the cilium pods", m.pods.synced(within).await),
            ("the Nodes", m.nodes.synced(within).await),
            ("the stepguard agents", m.agents.synced(within).await),
            ("the L2-announcement Leases", m.leases.synced(within).await),
            ("the Services", m.services.synced(within).await),
        ] {
            if !ok {
                return Err(
                    anyhow::anyhow!("could not list {what} within {}s", within.as_secs()).into(),
                );
            }
        }
        let _ = self.mirrors.set(m);
        Ok(())
    }

    pub(super) fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    pub(super) async fn daemonset(&self) -> Result<DaemonSet, RolloutError> {
        if let Some(m) = self.mirrors.get() {
            return m.ds.get(&self.ns, &self.ds)?.ok_or_else(|| {
                anyhow::anyhow!("DaemonSet {}/{} not found", self.ns, self.ds).into()
            });
        }
        self.daemonset_now().await
    }

    /// The DaemonSet read from the API server now (right before a delete).
    pub(super) async fn daemonset_now(&self) -> Result<DaemonSet, RolloutError> {
        Api::<DaemonSet>::namespaced(self.client.clone(), &self.ns)
            .get(&self.ds)
            .await
            .api_with(|| format!("get DaemonSet {}/{}", self.ns, self.ds))
    }

    /// The cilium pods the selector matches.
    pub(super) async fn cilium_pods(&self, sel: &str) -> Result<Vec<Pod>, RolloutError> {
        if let Some(m) = self.mirrors.get() {
            return m.pods.list();
        }
        Ok(self
            .pods()
            .list(&ListParams::default().labels(sel))
            .await
            .api("list the cilium pods")?
            .items)
    }

    /// The DaemonSet's whole selector (matchLabels and matchExpressions) as a label selector
    /// string; pods are then claimed by owner reference too (`owned`).
    pub(super) fn selector(ds: &DaemonSet) -> String {
        ds.spec
            .as_ref()
            .map(|s| selector_string(&s.selector))
            .unwrap_or_default()
    }

    /// The ControllerRevisions the DaemonSet owns, each with its hash.
    pub(super) async fn owned_revisions(
        &self,
        ds: &DaemonSet,
    ) -> Result<Vec<(String, ControllerRevision)>, RolloutError> {
        let revs = match self.mirrors.get() {
            Some(m) => m.revisions.list()?,
            None => self.revisions_now(ds).await?,
        };
        Ok(Self::own_revisions(ds, revs))
    }

    /// The ControllerRevisions the DaemonSet's selector matches, from the API server now.
    async fn revisions_now(&self, ds: &DaemonSet) -> Result<Vec<ControllerRevision>, RolloutError> {
        Ok(
            Api::<ControllerRevision>::namespaced(self.client.clone(), &self.ns)
                .list(&ListParams::default().labels(&Self::selector(ds)))
                .await
                .api("list ControllerRevisions")?
                .items,
        )
    }

    /// The DaemonSet's revisions (hash → number) read from the API server now (right
    /// before a delete).
    pub(super) async fn revisions_fresh(
        &self,
        ds: &DaemonSet,
    ) -> Result<BTreeMap<String, i64>, RolloutError> {
        let revs = self.revisions_now(ds).await?;
        Ok(Self::own_revisions(ds, revs)
            .into_iter()
            .map(|(h, r)| (h, r.revision))
            .collect())
    }

    /// Those of `revs` the DaemonSet owns, each with its hash.
    fn own_revisions(
        ds: &DaemonSet,
        revs: Vec<ControllerRevision>,
    ) -> Vec<(String, ControllerRevision)> {
        let uid = ds.metadata.uid.clone().unwrap_or_default();
        revs.into_iter()
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
                (hash, r)
            })
            .collect()
    }

    /// The DaemonSet's revisions: hash → number.
    pub(super) async fn revisions(
        &self,
        ds: &DaemonSet,
    ) -> Result<BTreeMap<String, i64>, RolloutError> {
        Ok(self
            .owned_revisions(ds)
            .await?
            .into_iter()
            .map(|(h, r)| (h, r.revision))
            .collect())
    }

    /// Why the node is no longer in the cluster (its Node object is gone), or None: there, or
    /// not known now (a failed read is not a node gone).
    pub(super) async fn node_gone(&self, node: &str) -> Option<String> {
        let read = match self.mirrors.get() {
            Some(m) => m.nodes.get("", node).map_err(|_| ()),
            None => Api::<Node>::all(self.client.clone())
                .get_opt(node)
                .await
                .map_err(|_| ()),
        };
        match read {
            Ok(None) => Some(format!(
                "node {node} left the cluster during its step (its Node object was deleted): nothing is left to verify there"
            )),
            _ => None,
        }
    }

    /// Deletes the pod if it is still the one with `uid`. Ok(false): already gone.
    pub(super) async fn delete_pod(&self, name: &str, uid: &str) -> Result<bool, RolloutError> {
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
            Err(e) if api_code(&e) == Some(409) => Err(anyhow::anyhow!(
                "pod {name} is no longer the one planned (UID {uid} precondition failed): {e}"
            )
            .into()),
            Err(e) => Err(e).api_with(|| format!("delete pod {name}")),
        }
    }

    /// The replacement on `node` (a pod of the DaemonSet other than `old_uid`, not being
    /// deleted), from one read: the revision a Ready one carries when that is the step's
    /// revision `target` or a newer one, and the stage of the newest one.
    pub(super) async fn replaced(
        &self,
        ds: &DaemonSet,
        sel: &str,
        node: &str,
        old_uid: &str,
        target: (&str, i64),
    ) -> Result<(Option<String>, Option<Stage>), RolloutError> {
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
    pub(super) async fn replacements(
        &self,
        ds: &DaemonSet,
        sel: &str,
        node: &str,
        old_uid: &str,
    ) -> Result<Vec<Pod>, RolloutError> {
        let uid = ds.metadata.uid.clone().unwrap_or_default();
        let wanted = |p: &Pod| {
            owned(p, &uid)
                && target_node(p).as_deref() == Some(node)
                && p.metadata.uid.as_deref() != Some(old_uid)
                && p.metadata.deletion_timestamp.is_none()
        };
        // From the mirror only the node's pods are copied (a batch follows its replacements
        // twice a second each, among a fleet's pods).
        if let Some(m) = self.mirrors.get() {
            return m.pods.matching(wanted);
        }
        Ok(self
            .cilium_pods(sel)
            .await?
            .into_iter()
            .filter(wanted)
            .collect())
    }

    /// The interrupted step's old pod now, and (for a lock written by an older stepper, which
    /// did not record the pod) which pod that is.
    pub(super) async fn old_pod(
        &self,
        sel: &str,
        i: &InFlight,
    ) -> Result<(OldPod, Option<(String, String)>), RolloutError> {
        if i.pod.is_empty() {
            let pods = self.cilium_pods(sel).await?;
            let old = pods.iter().find(|p| {
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
            .api_with(|| format!("read pod {}", i.pod))?;
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

    pub(super) async fn event(&self, ds: &DaemonSet, warning: bool, reason: &str, message: &str) {
        let sink = crate::locks::lock(&self.told).clone();
        if let Some(rec) = sink {
            crate::locks::lock(&rec).tell(&stamp(), warning, reason, message);
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

    pub(super) fn leases(&self) -> Api<Lease> {
        Api::namespaced(self.client.clone(), &self.args.lock_namespace)
    }

    pub(super) fn lock_name(&self) -> String {
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
pub(super) fn owned(p: &Pod, uid: &str) -> bool {
    p.metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.controller == Some(true) && o.uid == uid)
}

/// A container or init container waiting in CrashLoopBackOff: the highest restart count.
pub(super) fn crash_looping(p: &Pod) -> Option<i32> {
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
pub(super) fn agent_image(spec: Option<&k8s_openapi::api::core::v1::PodSpec>) -> String {
    spec.and_then(|p| {
        p.containers
            .iter()
            .find(|c| c.name == "cilium-agent")
            .or(p.containers.first())
    })
    .and_then(|c| c.image.clone())
    .unwrap_or_default()
}

/// When the cilium-agent container (or the first container) now running started, unix
/// seconds (the kubelet writes whole seconds).
pub(super) fn agent_started_at(p: &Pod) -> Option<f64> {
    let st = p.status.as_ref()?.container_statuses.as_ref()?;
    let c = st
        .iter()
        .find(|c| c.name == "cilium-agent")
        .or(st.first())?;
    let t = c.state.as_ref()?.running.as_ref()?.started_at.as_ref()?;
    Some(t.0.as_millisecond() as f64 / 1000.0)
}

pub(crate) fn pod_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
        .is_some_and(|c| c.status == "True")
}

pub(super) fn pod_revision(p: &Pod) -> Option<String> {
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

/// Retries `f` while its error is transient, backing off from 0.5 s to 15 s, until `give_up`
/// has passed or the lock is lost; the first failure is logged. The last error is returned as
/// it was (still transient or not, for a caller that retries in turn); one that is not the
/// API server's is said to be about `what`.
pub(super) async fn patient<T, F, Fut>(
    what: &str,
    give_up: Duration,
    lost: Option<&AtomicBool>,
    mut f: F,
) -> Result<T, RolloutError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, RolloutError>>,
{
    let t0 = Instant::now();
    let mut delay = Duration::from_millis(500);
    let mut said = false;
    loop {
        match f().await {
            Ok(v) => return Ok(v),
            Err(e)
                if e.is_transient()
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
            Err(RolloutError::Other(e)) => {
                return Err(RolloutError::Other(e.context(what.to_string())))
            }
            Err(e) => return Err(e),
        }
    }
}
