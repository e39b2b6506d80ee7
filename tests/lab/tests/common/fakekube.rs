//! A small Kubernetes API server for the rollout tests, following the API conventions the
//! stepper relies on: lists with `resourceVersion`, `Status` bodies with codes, 404 on a
//! missing object, 409 on a failed UID precondition and on a stale `resourceVersion`
//! (optimistic concurrency on Leases), AlreadyExists on a create. It serves what
//! `stepguard rollout` reads and writes: a DaemonSet, its ControllerRevisions, Nodes, the
//! cilium and stepguard pods, Leases (Cilium's L2 announcements and the lock), Events.
//! Deleting a cilium pod runs a hook (the test restarts the matching lab node) and then
//! reports a Ready replacement on the DaemonSet's current revision.
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
    /// cilium pods: name → (uid, node, revision hash, ready)
    pub pods: BTreeMap<String, (String, String, String, bool)>,
    /// stepguard agent pods: node → pod IP
    pub agents: BTreeMap<String, String>,
    /// (namespace, name) → Lease JSON
    pub leases: BTreeMap<(String, String), Value>,
    pub events: Vec<Value>,
    /// Cilium pod deletions per node, in order.
    pub deletions: Vec<String>,
    /// After this many replacements, the DaemonSet gets a new revision (a change mid-rollout).
    pub bump_after: Option<usize>,
    pub replacements: usize,
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

fn pod_json(name: &str, uid: &str, node: &str, rev: &str, ready: bool) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "kube-system", "uid": uid, "labels": {"k8s-app": "cilium", "controller-revision-hash": rev}},
        "spec": {"nodeName": node, "containers": [{"name": "cilium-agent"}]},
        "status": {"conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"}}]}
    })
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
        w.pods
            .iter()
            .map(|(name, (uid, node, rev, ready))| pod_json(name, uid, node, rev, *ready))
            .collect()
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
    let (deleted, node) = {
        let mut w = w.lock().unwrap();
        let Some((uid, node, rev, ready)) = w.pods.get(&name).cloned() else {
            return status(404, "NotFound", format!("pods \"{name}\" not found"));
        };
        if want_uid.as_deref().is_some_and(|u| u != uid) {
            return status(
                409,
                "Conflict",
                format!(
                    "Precondition failed: UID in precondition: {}, UID in object meta: {uid}",
                    want_uid.unwrap()
                ),
            );
        }
        w.pods.remove(&name);
        w.deletions.push(node.clone());
        w.next_rv();
        (pod_json(&name, &uid, &node, &rev, ready), node)
    };
    // The DaemonSet controller's part: the node's agent restarts (the lab), then a Ready pod
    // on the current revision replaces the deleted one.
    let (w2, hook2) = (w.clone(), hook.clone());
    std::thread::spawn(move || {
        hook2(&node);
        let mut w = w2.lock().unwrap();
        let rev = w.revision.0.clone();
        let n = w.rv;
        w.pods.insert(
            format!("cilium-{node}-{n}"),
            (format!("uid-{node}-{n}"), node.clone(), rev, true),
        );
        w.next_rv();
        w.replacements += 1;
        if w.bump_after == Some(w.replacements) {
            w.bump_revision();
        }
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
    let mut w = w.lock().unwrap();
    let n = w.events.len();
    e["metadata"]["name"] = json!(format!("ev-{n}"));
    w.events.push(e.clone());
    (StatusCode::CREATED, axum::Json(e)).into_response()
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
                    .route("/api/v1/namespaces/{ns}/pods/{name}", axum::routing::delete(delete_pod))
                    .route("/apis/coordination.k8s.io/v1/namespaces/{ns}/leases", get(list_leases).post(create_lease))
                    .route("/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{name}", get(get_lease).put(replace_lease).delete(delete_lease))
                    .route("/api/v1/namespaces/{ns}/events", axum::routing::post(create_event))
                    .fallback(|uri: axum::http::Uri, Query(_q): Query<HashMap<String, String>>| async move {
                        status(404, "NotFound", format!("the fake API server does not serve {uri}"))
                    })
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
