//! A fleet of many nodes for the rollout benchmark, against the real API server and
//! controllers: a kubelet for every node that keeps up with thousands of pods by watching them
//! (not the lab kubelet's poll), and a **simulated** stepguard agent per node answering the
//! step protocol (`POST /v1/steps`, `GET /v1/steps/{id}`, `DELETE`, `GET /v1/proof`,
//! `GET /v1/verdict`).
//!
//! The agents are a simulation on purpose: what is measured here is the stepper and the API
//! server at a thousand nodes, and a real agent per node (a lab node each) does not fit on
//! this machine. What a real agent does on a restart is proven by the agent's own tests on real
//! kernel objects and the real cilium-agent; here a step's verdict comes `settle` after the
//! replacement cilium pod the fleet kubelet started (each start a reload the step saw), and
//! fails for a configurable share of steps.
//!
//! Each node `i` has the loopback address [`node_ip`]; its agent listens there on the
//! fleet's port, and its pods are given that address (host network, as Cilium's and
//! stepguard's are).
use super::kubelet::is_cilium;
use super::Kube;
use anyhow::{Context, Result};
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Json;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{
    Api, DeleteParams, ListParams, Patch, PatchParams, Preconditions, WatchEvent, WatchParams,
};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Node `i`'s loopback address (127.100.0.1 …, 250 to a /24).
pub fn node_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 100, (i / 250) as u8, (i % 250 + 1) as u8)
}

pub fn node_name(i: usize) -> String {
    format!("fleet-{i:04}")
}

/// What the fleet does.
#[derive(Clone, Debug)]
pub struct FleetSpec {
    pub nodes: usize,
    /// From a cilium pod bound to its node to Running and Ready (its agent up again).
    pub restart: Duration,
    /// The share of steps whose verdict fails (0.0 to 1.0), chosen by a hash of node and step.
    pub fail_rate: f64,
    pub agent_port: u16,
}

fn now_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

/// A step the simulated agent keeps.
struct SimStep {
    settle: f64,
    /// The cilium-agent start the step saw (its reload), and when its verdict is due.
    start: Option<f64>,
    due: Option<f64>,
    failed: bool,
}

/// A cilium-agent start on a node, and the verdict that covers it.
struct Start {
    /// Whole seconds, as the kubelet writes `startedAt`.
    at: f64,
    due: f64,
    failed: bool,
}

#[derive(Default)]
struct Agent {
    active: Option<String>,
    steps: HashMap<String, SimStep>,
    starts: Vec<Start>,
}

struct Shared {
    spec: FleetSpec,
    agents: Vec<Mutex<Agent>>,
    index: BTreeMap<String, usize>,
    /// Requests the simulated agents answered.
    answered: std::sync::atomic::AtomicU64,
}

impl Shared {
    fn agent(&self, i: usize) -> std::sync::MutexGuard<'_, Agent> {
        self.agents[i].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The fleet kubelet started node `i`'s cilium-agent at `at` (whole seconds).
    fn started(&self, i: usize, at: f64) {
        let mut a = self.agent(i);
        let active = a.active.clone();
        let covered = active.and_then(|id| {
            let s = a.steps.get_mut(&id)?;
            if s.start.is_some() {
                return None;
            }
            s.start = Some(at);
            let due = at.max(now_s()) + s.settle;
            s.due = Some(due);
            s.failed = fails(&self.spec, i, &id);
            Some((due, s.failed))
        });
        // A start no step saw: an implicit step of the agent proves it after a short settle.
        let (due, failed) = covered.unwrap_or((now_s() + 1.0, false));
        a.starts.push(Start { at, due, failed });
        let n = a.starts.len();
        if n > 16 {
            a.starts.drain(..n - 16);
        }
    }
}

/// Whether the step `id` on node `i` fails (a stable hash: the same run, the same failures).
fn fails(spec: &FleetSpec, i: usize, id: &str) -> bool {
    if spec.fail_rate <= 0.0 {
        return false;
    }
    let mut h: u64 = 0xcbf29ce484222325;
    for b in id.bytes().chain((i as u64).to_le_bytes()) {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    ((h % 10_000) as f64) < spec.fail_rate * 10_000.0
}

/// The fleet: its kubelet and its agents, on a runtime of their own; stopped when dropped
/// (the runtime's tasks end with it).
pub struct Fleet {
    _rt: tokio::runtime::Runtime,
    shared: Arc<Shared>,
}

impl Fleet {
    /// Starts the agents' listeners and the kubelet for `spec.nodes` nodes named
    /// [`node_name`] (the Node objects are [`create_fleet_nodes`]'s).
    pub fn start(k: &Kube, spec: FleetSpec) -> Result<Fleet> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let shared = Arc::new(Shared {
            agents: (0..spec.nodes).map(|_| Mutex::default()).collect(),
            index: (0..spec.nodes).map(|i| (node_name(i), i)).collect(),
            spec: spec.clone(),
            answered: Default::default(),
        });
        for i in 0..spec.nodes {
            let l = rt
                .block_on(tokio::net::TcpListener::bind((node_ip(i), spec.agent_port)))
                .with_context(|| format!("listen on {}:{}", node_ip(i), spec.agent_port))?;
            let app = axum::Router::new()
                .route("/v1/steps", axum::routing::post(begin))
                .route("/v1/steps/{id}", get(step).delete(end))
                .route("/v1/proof", get(proof))
                .route("/v1/verdict", get(verdict))
                .with_state((shared.clone(), i));
            rt.spawn(async move {
                let _ = axum::serve(l, app).await;
            });
        }
        rt.spawn(kubelet(k.client.clone(), shared.clone()));
        Ok(Fleet { _rt: rt, shared })
    }

    /// Requests the simulated agents answered so far.
    pub fn answered(&self) -> u64 {
        self.shared
            .answered
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Creates the fleet's Node objects, Ready, a few at a time.
pub fn create_fleet_nodes(k: &Kube, nodes: usize) -> Result<()> {
    let api: Api<k8s_openapi::api::core::v1::Node> = k.all();
    k.block(async {
        let results: Vec<Result<()>> = futures_util::stream::iter(0..nodes)
            .map(|i| {
                let api = api.clone();
                async move {
                    let name = node_name(i);
                    let node: k8s_openapi::api::core::v1::Node = serde_json::from_value(json!({
                        "apiVersion": "v1", "kind": "Node",
                        "metadata": {"name": name, "labels": {
                            "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                            "kubernetes.io/arch": "amd64",
                            "topology.kubernetes.io/zone": format!("zone-{}", i % 3)}}}))?;
                    api.create(&Default::default(), &node)
                        .await
                        .with_context(|| format!("create Node {name}"))?;
                    let now = k8s_openapi::jiff::Timestamp::now().to_string();
                    let cap = json!({"cpu": "4", "memory": "8Gi", "pods": "110"});
                    let ip = node_ip(i).to_string();
                    api.patch_status(
                        &name,
                        &PatchParams::default(),
                        &Patch::Merge(json!({"status": {
                            "capacity": cap, "allocatable": cap,
                            "addresses": [{"type": "InternalIP", "address": ip}],
                            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                            "lastHeartbeatTime": now, "lastTransitionTime": now}]}})),
                    )
                    .await
                    .with_context(|| format!("set Node {name} Ready"))?;
                    Ok(())
                }
            })
            .buffer_unordered(16)
            .collect()
            .await;
        results.into_iter().collect::<Result<Vec<()>>>()
    })?;
    Ok(())
}

/// The kubelet: every pod bound to a fleet node is reported Running and Ready (a cilium pod
/// after the restart time), a deleted one removed after its grace (at most a second).
async fn kubelet(client: kube::Client, shared: Arc<Shared>) {
    let api: Api<Pod> = Api::all(client.clone());
    let reported: Arc<Mutex<BTreeSet<String>>> = Arc::default();
    let removing: Arc<Mutex<BTreeSet<String>>> = Arc::default();
    loop {
        let Ok(list) = api.list(&ListParams::default()).await else {
            tokio::time::sleep(Duration::from_millis(500)).await;
            continue;
        };
        let mut version = list.metadata.resource_version.clone().unwrap_or_default();
        for p in list.items {
            handle(&client, &shared, &reported, &removing, p);
        }
        loop {
            let wp = WatchParams::default().timeout(290);
            let Ok(stream) = api.watch(&wp, &version).await else {
                break;
            };
            let mut stream = std::pin::pin!(stream);
            let mut relist = false;
            while let Some(ev) = stream.next().await {
                match ev {
                    Ok(WatchEvent::Added(p)) | Ok(WatchEvent::Modified(p)) => {
                        version = p.metadata.resource_version.clone().unwrap_or(version);
                        handle(&client, &shared, &reported, &removing, p);
                    }
                    Ok(WatchEvent::Deleted(p)) => {
                        version = p.metadata.resource_version.clone().unwrap_or(version);
                    }
                    Ok(WatchEvent::Bookmark(b)) => version = b.metadata.resource_version,
                    Ok(WatchEvent::Error(_)) | Err(_) => {
                        relist = true;
                        break;
                    }
                }
            }
            if relist {
                break;
            }
        }
    }
}

fn handle(
    client: &kube::Client,
    shared: &Arc<Shared>,
    reported: &Arc<Mutex<BTreeSet<String>>>,
    removing: &Arc<Mutex<BTreeSet<String>>>,
    p: Pod,
) {
    let (Some(node), Some(uid), Some(name), Some(ns)) = (
        p.spec.as_ref().and_then(|s| s.node_name.clone()),
        p.metadata.uid.clone(),
        p.metadata.name.clone(),
        p.metadata.namespace.clone(),
    ) else {
        return;
    };
    let Some(&i) = shared.index.get(&node) else {
        return;
    };
    let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
    if p.metadata.deletion_timestamp.is_some() {
        if !removing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(uid.clone())
        {
            return;
        }
        let grace = p
            .metadata
            .deletion_grace_period_seconds
            .unwrap_or(1)
            .clamp(0, 1) as u64;
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(grace)).await;
            let dp = DeleteParams {
                grace_period_seconds: Some(0),
                preconditions: Some(Preconditions {
                    uid: Some(uid),
                    resource_version: None,
                }),
                ..Default::default()
            };
            let _ = api.delete(&name, &dp).await;
        });
        return;
    }
    if !reported
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(uid)
    {
        return;
    }
    let cilium = is_cilium(&p);
    let delay = if cilium {
        shared.spec.restart
    } else {
        Duration::ZERO
    };
    let containers: Vec<(String, String)> = p
        .spec
        .as_ref()
        .map(|s| {
            s.containers
                .iter()
                .map(|c| (c.name.clone(), c.image.clone().unwrap_or_default()))
                .collect()
        })
        .unwrap_or_default();
    let shared = shared.clone();
    tokio::spawn(async move {
        tokio::time::sleep(delay).await;
        let started = now_s().floor();
        let at = k8s_openapi::jiff::Timestamp::from_second(started as i64)
            .map(|t| t.to_string())
            .unwrap_or_default();
        let ip = node_ip(i).to_string();
        let statuses: Vec<Value> = containers
            .iter()
            .map(|(n, image)| {
                json!({"name": n, "image": image, "imageID": "", "ready": true, "started": true,
                       "restartCount": 0, "state": {"running": {"startedAt": at}}})
            })
            .collect();
        let patch = json!({"status": {
            "phase": "Running", "hostIP": ip, "hostIPs": [{"ip": ip}], "podIP": ip,
            "podIPs": [{"ip": ip}], "startTime": at,
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Initialized", "status": "True"},
                {"type": "ContainersReady", "status": "True", "lastTransitionTime": at},
                {"type": "Ready", "status": "True", "lastTransitionTime": at}],
            "containerStatuses": statuses}});
        for _ in 0..5 {
            let r = api
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await;
            match r {
                Ok(_) => break,
                Err(kube::Error::Api(s)) if s.code == 404 => return,
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
        if cilium {
            shared.started(i, started);
        }
    });
}

type Cx = State<(Arc<Shared>, usize)>;

fn count(s: &Shared) {
    s.answered
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// `5000ms`, `30s`, `2m` (what the stepper sends), else 30 s.
fn secs(v: &Value) -> f64 {
    let s = v.as_str().unwrap_or("");
    let num = |t: &str| t.parse::<f64>().ok();
    if let Some(ms) = s.strip_suffix("ms").and_then(num) {
        ms / 1000.0
    } else if let Some(x) = s.strip_suffix('s').and_then(num) {
        x
    } else if let Some(m) = s.strip_suffix('m').and_then(num) {
        m * 60.0
    } else {
        30.0
    }
}

async fn begin(State((s, i)): Cx, Json(body): Json<Value>) -> impl IntoResponse {
    count(&s);
    let id = body["id"].as_str().unwrap_or("").to_string();
    if id.is_empty() {
        return (StatusCode::BAD_REQUEST, Json(json!({"error": "no id"})));
    }
    let mut a = s.agent(i);
    if let Some(active) = a.active.clone() {
        if active == id {
            return (StatusCode::OK, Json(json!({"id": id})));
        }
        return (
            StatusCode::CONFLICT,
            Json(json!({"error": format!("step {active} is active"), "active_id": active})),
        );
    }
    a.steps.insert(
        id.clone(),
        SimStep {
            settle: secs(&body["settle"]),
            start: None,
            due: None,
            failed: false,
        },
    );
    a.active = Some(id.clone());
    (StatusCode::CREATED, Json(json!({"id": id})))
}

/// The step's verdict when due (the step then over), else None.
fn decided(a: &mut Agent, id: &str) -> Option<Value> {
    let s = a.steps.get(id)?;
    let due = s.due?;
    if now_s() < due {
        return None;
    }
    let failed = s.failed;
    let settle = s.settle;
    if a.active.as_deref() == Some(id) {
        a.active = None;
    }
    Some(json!({"id": id,
        "verdict": {"status": if failed { "failed" } else { "passed" },
                    "summary": format!("simulated agent: the restart seen, green for {settle:.0}s"),
                    "reasons": if failed { vec!["simulated_failure"] } else { vec![] },
                    "warnings": []},
        "reload": {"changed": {"cil_from_netdev": 1}}}))
}

async fn step(
    State((s, i)): Cx,
    UrlPath(id): UrlPath<String>,
    Query(q): Query<HashMap<String, String>>,
) -> impl IntoResponse {
    count(&s);
    let wait = q
        .get("wait")
        .map(|w| secs(&json!(w)))
        .unwrap_or(0.0)
        .min(30.0);
    let t0 = now_s();
    loop {
        {
            let mut a = s.agent(i);
            if !a.steps.contains_key(&id) {
                return (
                    StatusCode::NOT_FOUND,
                    Json(json!({"error": "no such step"})),
                );
            }
            if let Some(v) = decided(&mut a, &id) {
                return (StatusCode::OK, Json(v));
            }
        }
        if now_s() - t0 >= wait {
            return (
                StatusCode::ACCEPTED,
                Json(json!({"id": id, "state": "active"})),
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn end(State((s, i)): Cx, UrlPath(id): UrlPath<String>) -> impl IntoResponse {
    count(&s);
    let mut a = s.agent(i);
    if a.active.as_deref() == Some(id.as_str()) {
        a.active = None;
    }
    match a.steps.remove(&id) {
        Some(_) => (StatusCode::OK, Json(json!({"id": id, "cancelled": true}))),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": "no such step"})),
        ),
    }
}

async fn proof(State((s, i)): Cx, Query(q): Query<HashMap<String, String>>) -> impl IntoResponse {
    count(&s);
    let at: f64 = q
        .get("started_at")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    let a = s.agent(i);
    let found = a.starts.iter().rev().find(|st| (st.at - at).abs() <= 1.5);
    let status = match found {
        None => "unproven",
        Some(st) if now_s() < st.due => "pending",
        Some(st) if st.failed => "failed",
        Some(_) => "passed",
    };
    Json(json!({"started_at": at, "status": status, "step": null,
                "why": format!("simulated agent: {status}")}))
}

async fn verdict(State((s, _)): Cx) -> impl IntoResponse {
    count(&s);
    Json(json!({"status": "pass", "checks": [
        {"check": "devices", "status": "pass", "evidence": {"selected": ["eth0"]}}]}))
}
