//! A small Kubernetes API server for the rollout tests, following the API conventions the
//! stepper relies on: lists with `resourceVersion`, `Status` bodies with codes, 404 on a
//! missing object, 409 on a failed UID precondition and on a stale `resourceVersion`
//! (optimistic concurrency on Leases), AlreadyExists on a create. It serves what
//! `stepguard rollout` reads and writes: a DaemonSet, its ControllerRevisions, Nodes, the
//! cilium and stepguard pods, Leases (Cilium's L2 announcements and the lock), Events.
//! Deleting a cilium pod behaves as the real DaemonSet controller and kubelet make it look
//! (`pkg/controller/daemon/daemon_controller.go`, `podsShouldBeOnNode`/`syncNodes`): the pod
//! stays Terminating (`deletionTimestamp`) for its grace period; the controller, which skips
//! terminating pods, creates the replacement with the hash of the revision current at that
//! moment, Pending and unbound (pinned to the node by a required node affinity on
//! `metadata.name`); the scheduler binds it; it turns Ready once the node's agent restarted
//! (the hook: the test restarts the matching lab node) and the old pod is gone. A template
//! change can land at any of those moments (`bump_at`). Faults the real API server is not made
//! to produce on demand: every request answered 500 for a while (`fail_until`), one Event
//! create held (`slow_event`).
#![allow(dead_code)]
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

pub type Hook = Arc<dyn Fn(&str) + Send + Sync>;

/// A cilium pod.
#[derive(Clone, Debug)]
pub struct FakePod {
    pub uid: String,
    /// The node it is for (bound or, while Pending, by affinity).
    pub node: String,
    pub bound: bool,
    /// `controller-revision-hash`.
    pub revision: String,
    pub ready: bool,
    pub terminating: bool,
}

impl FakePod {
    pub fn running(uid: &str, node: &str, revision: &str) -> FakePod {
        FakePod {
            uid: uid.into(),
            node: node.into(),
            bound: true,
            revision: revision.into(),
            ready: true,
            terminating: false,
        }
    }
}

/// The moments of a replacement at which a template change can land.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Moment {
    /// The old pod Terminating, before the controller created the replacement.
    Terminating,
    /// The replacement created, Pending, unbound.
    Pending,
    /// Bound, not Ready.
    Bound,
    /// Ready.
    Ready,
}

/// A template change at the n-th deletion (1-based, counted over the world's life) and moment;
/// `approve`: the DaemonSet's approval annotation follows it.
#[derive(Clone, Copy, Debug)]
pub struct Bump {
    pub deletion: usize,
    pub at: Moment,
    pub approve: bool,
}

#[derive(Default)]
pub struct World {
    pub rv: u64,
    pub revision: (String, i64),
    pub generation: i64,
    pub observed_generation: i64,
    pub image: String,
    pub ds_annotations: BTreeMap<String, String>,
    /// name → ready
    pub nodes: BTreeMap<String, bool>,
    /// cilium pods by name
    pub pods: BTreeMap<String, FakePod>,
    /// stepguard agent pods: node → pod IP
    pub agents: BTreeMap<String, String>,
    /// (namespace, name) → Lease JSON
    pub leases: BTreeMap<(String, String), Value>,
    pub events: Vec<Value>,
    /// Cilium pod deletions per node, in order.
    pub deletions: Vec<String>,
    /// Template changes mid-rollout.
    pub bumps: Vec<Bump>,
    pub replacements: usize,
    /// The controller's pace: how long a deleted pod stays Terminating, and when the
    /// replacement is created and bound after the delete.
    pub grace: std::time::Duration,
    pub create_after: std::time::Duration,
    pub bind_after: std::time::Duration,
    /// Every request is answered 500 until then.
    pub fail_until: Option<std::time::Instant>,
    pub failed_requests: usize,
    /// An Event create with this reason is held this long (once).
    pub slow_event: Option<(String, std::time::Duration)>,
    /// Set while a held Event create is in flight.
    pub holding_event: bool,
}

impl World {
    fn next_rv(&mut self) -> String {
        self.rv += 1;
        self.rv.to_string()
    }

    /// A new revision of the DaemonSet's template (generation and observedGeneration follow).
    pub fn bump_revision(&mut self) {
        let n = self.revision.1 + 1;
        self.revision = (format!("rev{n}"), n);
        self.generation += 1;
        self.observed_generation = self.generation;
        self.next_rv();
    }

    /// A new revision, approved by the DaemonSet's annotation.
    pub fn bump_approved(&mut self) {
        self.bump_revision();
        self.approve_current();
    }

    pub fn approve_current(&mut self) {
        let h = self.revision.0.clone();
        self.ds_annotations
            .insert("stepguard.io/approve-revision".into(), h);
        self.next_rv();
    }

    /// Pods not being deleted.
    pub fn live_pods(&self) -> impl Iterator<Item = (&String, &FakePod)> {
        self.pods.iter().filter(|(_, p)| !p.terminating)
    }

    fn bump_if(&mut self, deletion: usize, at: Moment) {
        let due: Vec<Bump> = self
            .bumps
            .iter()
            .filter(|b| b.deletion == deletion && b.at == at)
            .copied()
            .collect();
        for b in due {
            if b.approve {
                self.bump_approved();
            } else {
                self.bump_revision();
            }
        }
    }
}

pub struct FakeKube {
    pub world: Arc<Mutex<World>>,
    pub addr: std::net::SocketAddr,
    _thread: std::thread::JoinHandle<()>,
}

fn status(code: u16, reason: &str, message: String) -> Response {
    (
        StatusCode::from_u16(code).unwrap(),
        axum::Json(json!({"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":message,"reason":reason,"code":code})),
    )
        .into_response()
}

fn list(kind: &str, api_version: &str, rv: u64, items: Vec<Value>) -> Response {
    axum::Json(json!({"kind": format!("{kind}List"), "apiVersion": api_version, "metadata": {"resourceVersion": rv.to_string()}, "items": items})).into_response()
}

type S = (Arc<Mutex<World>>, Hook);

fn ds_json(w: &World) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": "cilium", "namespace": "kube-system", "uid": "ds-uid", "generation": w.generation, "resourceVersion": w.rv.to_string(), "annotations": w.ds_annotations},
        "spec": {
            "selector": {"matchLabels": {"k8s-app": "cilium"}},
            "updateStrategy": {"type": "OnDelete"},
            "template": {"metadata": {"labels": {"k8s-app": "cilium"}}, "spec": {"containers": [{"name": "cilium-agent", "image": w.image}]}}
        },
        "status": {"observedGeneration": w.observed_generation, "currentNumberScheduled": w.pods.len(), "desiredNumberScheduled": w.pods.len(), "numberMisscheduled": 0, "numberReady": w.pods.len()}
    })
}

fn pod_json(name: &str, p: &FakePod) -> Value {
    let mut v = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "kube-system", "uid": p.uid, "labels": {"k8s-app": "cilium", "controller-revision-hash": p.revision},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "cilium", "uid": "ds-uid", "controller": true}]},
        "spec": {"containers": [{"name": "cilium-agent"}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [p.node]}]}]}}}},
        "status": {"phase": if p.bound && p.ready {"Running"} else {"Pending"},
            "conditions": [{"type": "Ready", "status": if p.ready {"True"} else {"False"}}]}
    });
    if p.bound {
        v["spec"]["nodeName"] = json!(p.node);
    }
    if p.terminating {
        v["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        v["metadata"]["deletionGracePeriodSeconds"] = json!(1);
    }
    v
}

async fn get_ds(State((w, _)): State<S>) -> Response {
    let w = w.lock().unwrap();
    axum::Json(ds_json(&w)).into_response()
}

async fn list_revisions(State((w, _)): State<S>) -> Response {
    let w = w.lock().unwrap();
    let items = (1..=w.revision.1)
        .map(|n| {
            let hash = if n == w.revision.1 { w.revision.0.clone() } else { format!("rev{n}") };
            json!({"apiVersion": "apps/v1", "kind": "ControllerRevision", "revision": n,
                "metadata": {"name": format!("cilium-{hash}"), "namespace": "kube-system", "labels": {"k8s-app": "cilium", "controller-revision-hash": hash},
                    "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "cilium", "uid": "ds-uid"}]},
                "data": {}})
        })
        .collect();
    list("ControllerRevision", "apps/v1", w.rv, items)
}

async fn list_nodes(State((w, _)): State<S>) -> Response {
    let w = w.lock().unwrap();
    let items = w
        .nodes
        .iter()
        .map(|(n, ready)| json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": n, "labels": {"topology.kubernetes.io/zone": "lab"}},
            "status": {"conditions": [{"type": "Ready", "status": if *ready {"True"} else {"False"}}]}}))
        .collect();
    list("Node", "v1", w.rv, items)
}

async fn list_pods(State((w, _)): State<S>, Path(ns): Path<String>) -> Response {
    let w = w.lock().unwrap();
    let items = if ns == "kube-system" {
        w.pods.iter().map(|(name, p)| pod_json(name, p)).collect()
    } else if ns == "stepguard" {
        w.agents
            .iter()
            .map(|(node, ip)| json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": format!("stepguard-{node}"), "namespace": "stepguard", "labels": {"app.kubernetes.io/name": "stepguard"}},
                "spec": {"nodeName": node, "containers": [{"name": "stepguard"}]}, "status": {"podIP": ip}}))
            .collect()
    } else {
        vec![]
    };
    list("Pod", "v1", w.rv, items)
}

async fn get_pod(State((w, _)): State<S>, Path((ns, name)): Path<(String, String)>) -> Response {
    let w = w.lock().unwrap();
    match w.pods.get(&name).filter(|_| ns == "kube-system") {
        Some(p) => axum::Json(pod_json(&name, p)).into_response(),
        None => status(404, "NotFound", format!("pods \"{name}\" not found")),
    }
}

async fn delete_pod(
    State((w, hook)): State<S>,
    Path((ns, name)): Path<(String, String)>,
    body: axum::body::Bytes,
) -> Response {
    if ns != "kube-system" {
        return status(404, "NotFound", format!("pods \"{name}\" not found"));
    }
    let opts: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let want_uid = opts["preconditions"]["uid"].as_str().map(String::from);
    let (deleted, node, nth, pace) = {
        let mut w = w.lock().unwrap();
        let Some(p) = w.pods.get(&name).cloned() else {
            return status(404, "NotFound", format!("pods \"{name}\" not found"));
        };
        if want_uid.as_deref().is_some_and(|u| u != p.uid) {
            return status(
                409,
                "Conflict",
                format!(
                    "Precondition failed: UID in precondition: {}, UID in object meta: {}",
                    want_uid.unwrap(),
                    p.uid
                ),
            );
        }
        if p.terminating {
            // Deleting a terminating pod again changes nothing.
            return axum::Json(pod_json(&name, &p)).into_response();
        }
        w.pods.get_mut(&name).unwrap().terminating = true;
        w.deletions.push(p.node.clone());
        let nth = w.deletions.len();
        w.next_rv();
        let pace = (w.grace, w.create_after, w.bind_after);
        (pod_json(&name, &w.pods[&name]), p.node.clone(), nth, pace)
    };
    // The DaemonSet controller, the scheduler and the kubelet, at their pace.
    let (w2, hook2) = (w.clone(), hook.clone());
    std::thread::spawn(move || {
        let t0 = std::time::Instant::now();
        let (grace, create_after, bind_after) = pace;
        std::thread::sleep(create_after);
        let new = {
            let mut w = w2.lock().unwrap();
            w.bump_if(nth, Moment::Terminating);
            let n = w.next_rv();
            let new = format!("cilium-{node}-{n}");
            let rev = w.revision.0.clone();
            w.pods.insert(
                new.clone(),
                FakePod {
                    uid: format!("uid-{node}-{n}"),
                    node: node.clone(),
                    bound: false,
                    revision: rev,
                    ready: false,
                    terminating: false,
                },
            );
            w.bump_if(nth, Moment::Pending);
            new
        };
        std::thread::sleep(bind_after);
        {
            let mut w = w2.lock().unwrap();
            if let Some(p) = w.pods.get_mut(&new) {
                p.bound = true;
            }
            w.next_rv();
            w.bump_if(nth, Moment::Bound);
        }
        // The node's agent restarts with the new pod; the old pod is gone after its grace.
        hook2(&node);
        if let Some(rest) = grace.checked_sub(t0.elapsed()) {
            std::thread::sleep(rest);
        }
        let mut w = w2.lock().unwrap();
        w.pods.remove(&name);
        if let Some(p) = w.pods.get_mut(&new) {
            p.ready = true;
        }
        w.next_rv();
        w.replacements += 1;
        w.bump_if(nth, Moment::Ready);
    });
    axum::Json(deleted).into_response()
}

async fn list_leases(State((w, _)): State<S>, Path(ns): Path<String>) -> Response {
    let w = w.lock().unwrap();
    let items = w
        .leases
        .iter()
        .filter(|((n, _), _)| *n == ns)
        .map(|(_, l)| l.clone())
        .collect();
    list("Lease", "coordination.k8s.io/v1", w.rv, items)
}

async fn get_lease(State((w, _)): State<S>, Path((ns, name)): Path<(String, String)>) -> Response {
    let w = w.lock().unwrap();
    match w.leases.get(&(ns, name.clone())) {
        Some(l) => axum::Json(l.clone()).into_response(),
        None => status(
            404,
            "NotFound",
            format!("leases.coordination.k8s.io \"{name}\" not found"),
        ),
    }
}

async fn create_lease(
    State((w, _)): State<S>,
    Path(ns): Path<String>,
    axum::Json(mut l): axum::Json<Value>,
) -> Response {
    let mut w = w.lock().unwrap();
    let name = l["metadata"]["name"].as_str().unwrap_or("").to_string();
    if w.leases.contains_key(&(ns.clone(), name.clone())) {
        return status(
            409,
            "AlreadyExists",
            format!("leases.coordination.k8s.io \"{name}\" already exists"),
        );
    }
    let rv = w.next_rv();
    l["metadata"]["resourceVersion"] = json!(rv);
    l["metadata"]["namespace"] = json!(ns);
    w.leases.insert((ns, name), l.clone());
    (StatusCode::CREATED, axum::Json(l)).into_response()
}

async fn replace_lease(
    State((w, _)): State<S>,
    Path((ns, name)): Path<(String, String)>,
    axum::Json(mut l): axum::Json<Value>,
) -> Response {
    let mut w = w.lock().unwrap();
    let Some(cur) = w.leases.get(&(ns.clone(), name.clone())) else {
        return status(
            404,
            "NotFound",
            format!("leases.coordination.k8s.io \"{name}\" not found"),
        );
    };
    if l["metadata"]["resourceVersion"] != cur["metadata"]["resourceVersion"] {
        return status(409, "Conflict", format!("Operation cannot be fulfilled on leases.coordination.k8s.io \"{name}\": the object has been modified; please apply your changes to the latest version and try again"));
    }
    let rv = w.next_rv();
    l["metadata"]["resourceVersion"] = json!(rv);
    w.leases.insert((ns, name), l.clone());
    axum::Json(l).into_response()
}

async fn delete_lease(
    State((w, _)): State<S>,
    Path((ns, name)): Path<(String, String)>,
) -> Response {
    let mut w = w.lock().unwrap();
    match w.leases.remove(&(ns, name.clone())) {
        Some(l) => axum::Json(l).into_response(),
        None => status(
            404,
            "NotFound",
            format!("leases.coordination.k8s.io \"{name}\" not found"),
        ),
    }
}

async fn create_event(State((w, _)): State<S>, axum::Json(mut e): axum::Json<Value>) -> Response {
    let hold = {
        let mut w = w.lock().unwrap();
        let due = w
            .slow_event
            .as_ref()
            .filter(|(r, _)| e["reason"].as_str() == Some(r.as_str()))
            .map(|(_, d)| *d);
        if due.is_some() {
            w.slow_event = None;
            w.holding_event = true;
        }
        due
    };
    if let Some(d) = hold {
        tokio::time::sleep(d).await;
    }
    let mut w = w.lock().unwrap();
    w.holding_event = false;
    let n = w.events.len();
    e["metadata"]["name"] = json!(format!("ev-{n}"));
    w.events.push(e.clone());
    (StatusCode::CREATED, axum::Json(e)).into_response()
}

async fn self_subject_review() -> Response {
    (
        StatusCode::CREATED,
        axum::Json(json!({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview", "metadata": {},
            "status": {"userInfo": {"username": "fake-stepper", "groups": ["system:authenticated"]}}})),
    )
        .into_response()
}

/// Every request answered 500 while `fail_until` is ahead.
async fn failing(
    State((w, _)): State<S>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    {
        let mut w = w.lock().unwrap();
        if w.fail_until.is_some_and(|t| std::time::Instant::now() < t) {
            w.failed_requests += 1;
            return status(
                500,
                "InternalError",
                "the fake API server fails on purpose".into(),
            );
        }
    }
    next.run(req).await
}

impl FakeKube {
    /// Serves in network namespace `ns` on `ip` (a free port), deleting pods through `hook`.
    pub fn start(ns: &str, ip: &str, world: World, hook: Hook) -> FakeKube {
        let ip = ip.to_string();
        let listener = stepguard_lab::netns::in_netns(ns, move || {
            Ok(std::net::TcpListener::bind((ip.as_str(), 0))?)
        })
        .expect("bind the fake API server");
        let addr = listener.local_addr().unwrap();
        listener.set_nonblocking(true).unwrap();
        let world = Arc::new(Mutex::new(world));
        let state: S = (world.clone(), hook);
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let app = Router::new()
                    .route("/apis/apps/v1/namespaces/kube-system/daemonsets/cilium", get(get_ds))
                    .route("/apis/apps/v1/namespaces/kube-system/controllerrevisions", get(list_revisions))
                    .route("/api/v1/nodes", get(list_nodes))
                    .route("/api/v1/namespaces/{ns}/pods", get(list_pods))
                    .route("/api/v1/namespaces/{ns}/pods/{name}", get(get_pod).delete(delete_pod))
                    .route("/apis/authentication.k8s.io/v1/selfsubjectreviews", axum::routing::post(self_subject_review))
                    .route("/apis/coordination.k8s.io/v1/namespaces/{ns}/leases", get(list_leases).post(create_lease))
                    .route("/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{name}", get(get_lease).put(replace_lease).delete(delete_lease))
                    .route("/api/v1/namespaces/{ns}/events", axum::routing::post(create_event))
                    .fallback(|uri: axum::http::Uri, Query(_q): Query<HashMap<String, String>>| async move {
                        status(404, "NotFound", format!("the fake API server does not serve {uri}"))
                    })
                    .layer(axum::middleware::from_fn_with_state(state.clone(), failing))
                    .with_state(state);
                let l = tokio::net::TcpListener::from_std(listener).unwrap();
                axum::serve(l, app).await.unwrap();
            });
        });
        FakeKube {
            world,
            addr,
            _thread: thread,
        }
    }

    /// A kubeconfig pointing at this server (plain HTTP, a token as a real cluster would use).
    pub fn kubeconfig(&self, dir: &std::path::Path) -> std::path::PathBuf {
        let p = dir.join("kubeconfig");
        std::fs::write(
            &p,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{}\nusers:\n- name: stepper\n  user:\n    token: fake-token\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: stepper\ncurrent-context: fake\n",
                self.addr
            ),
        )
        .unwrap();
        p
    }
}
