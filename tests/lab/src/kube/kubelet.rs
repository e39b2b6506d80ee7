//! The lab kubelet: the part of a kubelet the rollout needs, for pods bound to the
//! lab's nodes, against the real API server.
//!
//! - A pod bound to a lab node (by the real scheduler) is reported Running, with the node's
//!   address as its IP (the lab's pods are host-network: Cilium's and stepguard's are), and
//!   Ready — a cilium pod only once that node's agent is back from its restart. Pods a lab
//!   runtime made through CNI ([`CNI_POD_LABEL`]) are left to it.
//! - A deleted cilium pod stays Terminating for its grace period (`deletionGracePeriodSeconds`)
//!   while the lab restarts that node's agent (the [`RestartHook`]); then the kubelet removes it
//!   (a delete with grace 0 and a UID precondition, as the real kubelet finishes a graceful
//!   deletion). The real DaemonSet controller creates the replacement only then: it does not
//!   count a terminating pod and does not create a second one beside it
//!   (`pkg/controller/daemon/daemon_controller.go`, `podsShouldBeOnNode`, v1.37.2).
//! - Faults: a node whose replacement never turns Ready; a node whose cilium pod crash-loops
//!   (Running, not Ready, restart count climbing, `CrashLoopBackOff`); pods of a namespace held
//!   Pending on a node (never started); other pods running but not Ready (by name prefix); a
//!   replacement that first pulls its image for a while.
//!
//! Moments of a replacement are reported to a [`MomentHook`], run while the kubelet waits, so a
//! test can change the DaemonSet's template exactly then.
use crate::kube::Kube;
use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Restarts the named node's cilium agent; the second argument counts cilium pod deletions
/// over the kubelet's life (1-based). Runs on a thread of its own.
pub type RestartHook = Arc<dyn Fn(&str, usize) + Send + Sync>;

/// Called at a moment of the replacement that follows the n-th deletion, on `node`.
pub type MomentHook = Arc<dyn Fn(Moment, &str, usize) + Send + Sync>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Moment {
    /// The old pod seen Terminating (before the controller can create the replacement).
    Terminating,
    /// The replacement seen (created, bound or not), not Ready.
    Replaced,
    /// The replacement reported Ready.
    Ready,
}

#[derive(Default, Debug)]
pub struct KubeletState {
    /// The node of every cilium pod deletion seen, in order.
    pub deletions: Vec<String>,
    /// Replacements on these nodes never turn Ready.
    pub never_ready: BTreeSet<String>,
    /// The cilium pod on these nodes crash-loops.
    pub crash_loop: BTreeSet<String>,
    /// (namespace, node): pods there are never started (Pending, no IP).
    pub hold: BTreeSet<(String, String)>,
    /// Pods (not cilium's) whose name starts with one of these run but are not Ready (a
    /// cilium-operator failing its readiness probe).
    pub unready: BTreeSet<String>,
    /// A replacement cilium pod on these nodes first pulls its image this long (Pending, its
    /// container waiting in `ContainerCreating`, as the kubelet reports a pull).
    pub pull: BTreeMap<String, Duration>,
    /// Restarts in flight per node.
    restarting: BTreeMap<String, usize>,
    /// API errors seen (the kubelet retries on its next pass).
    pub errors: usize,
    /// Restart hooks that panicked.
    pub hook_failures: usize,
}

impl KubeletState {
    /// No node's agent is being restarted for a deletion now.
    pub fn settled(&self) -> bool {
        self.restarting.values().all(|n| *n == 0)
    }
}

/// What the kubelet reported for a pod last, so it patches only on a change.
#[derive(Clone, PartialEq, Debug)]
struct Reported {
    ready: bool,
    restarts: u32,
    pulling: bool,
}

pub struct Kubelet {
    pub state: Arc<Mutex<KubeletState>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

const CILIUM_SELECTOR: &str = "k8s-app=cilium";

/// The label of pods a lab runtime made through CNI (`realnode::pods`, value `cni`): their
/// address and status are that runtime's to report, not the lab kubelet's.
pub const CNI_POD_LABEL: &str = "stepguard.test/runtime";

fn is_cni_pod(p: &Pod) -> bool {
    p.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(CNI_POD_LABEL))
        .is_some_and(|v| v == "cni")
}

pub(crate) fn is_cilium(p: &Pod) -> bool {
    p.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get("k8s-app"))
        .is_some_and(|v| v == "cilium")
}

/// The node a pod is for: bound, or (Pending) by the DaemonSet controller's required node
/// affinity on `metadata.name`.
pub fn target_node(p: &Pod) -> Option<String> {
    let spec = p.spec.as_ref()?;
    if let Some(n) = &spec.node_name {
        return Some(n.clone());
    }
    let terms = &spec
        .affinity
        .as_ref()?
        .node_affinity
        .as_ref()?
        .required_during_scheduling_ignored_during_execution
        .as_ref()?
        .node_selector_terms;
    terms.iter().find_map(|t| {
        t.match_fields
            .iter()
            .flatten()
            .find(|f| f.key == "metadata.name")
            .and_then(|f| f.values.as_ref()?.first().cloned())
    })
}

struct Loop {
    k: Kube,
    nodes: BTreeMap<String, String>,
    state: Arc<Mutex<KubeletState>>,
    restart: RestartHook,
    moment: Option<MomentHook>,
    /// uid → (seen terminating at, grace)
    terminating: BTreeMap<String, (Instant, Duration)>,
    /// node → the deletion number whose replacement is awaited
    awaiting: BTreeMap<String, usize>,
    /// replacement uid → (node, deletion number), until it is Ready
    replacements: BTreeMap<String, (String, usize)>,
    /// every replacement's uid (never-ready applies to them)
    replaced: BTreeSet<String>,
    reported: BTreeMap<String, Reported>,
    crash_started: BTreeMap<String, Instant>,
    pull_started: BTreeMap<String, Instant>,
    /// node → when the lab last began restarting its agent for a deletion (RFC 3339).
    restart_began: BTreeMap<String, String>,
    /// uid → its container's start as reported (`state.running.startedAt`), fixed at the
    /// first report as a real kubelet's is: a replacement cilium pod's container is the agent
    /// the lab's restart started, so it started when that restart began.
    started: BTreeMap<String, String>,
}

impl Loop {
    fn moment(&self, m: Moment, node: &str, nth: usize) {
        if let Some(h) = &self.moment {
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h(m, node, nth))).is_err() {
                self.state.lock().unwrap().hook_failures += 1;
            }
        }
    }

    fn pass(&mut self) -> Result<()> {
        let pods = self
            .k
            .block(::kube::Api::<Pod>::all(self.k.client.clone()).list(&Default::default()))
            .context("list pods")?;
        // One pod's failed call does not starve the others: the first error is returned
        // after the pass.
        let mut first_err: Option<anyhow::Error> = None;
        for p in pods.items.into_iter().filter(|p| !is_cni_pod(p)) {
            let Some(node) = target_node(&p) else {
                continue;
            };
            let Some(ip) = self.nodes.get(&node).cloned() else {
                continue;
            };
            let (Some(name), Some(ns), Some(uid)) = (
                p.metadata.name.clone(),
                p.metadata.namespace.clone(),
                p.metadata.uid.clone(),
            ) else {
                continue;
            };
            let cilium = is_cilium(&p);
            if p.metadata.deletion_timestamp.is_some() {
                if let Err(e) = self.terminate(&p, &ns, &name, &uid, &node, cilium) {
                    first_err.get_or_insert(e);
                }
                continue;
            }
            if cilium && !self.replaced.contains(&uid) {
                if let Some(nth) = self.awaiting.remove(&node) {
                    self.replaced.insert(uid.clone());
                    self.replacements.insert(uid.clone(), (node.clone(), nth));
                    self.moment(Moment::Replaced, &node, nth);
                }
            }
            let bound = p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some();
            if !bound
                || self
                    .state
                    .lock()
                    .unwrap()
                    .hold
                    .contains(&(ns.clone(), node.clone()))
            {
                continue;
            }
            let want = self.desired(&uid, &name, &node, cilium);
            if self.reported.get(&uid) != Some(&want) {
                let began = if cilium && self.replaced.contains(&uid) {
                    self.restart_began.get(&node).cloned()
                } else {
                    None
                };
                let started = self
                    .started
                    .entry(uid.clone())
                    .or_insert_with(|| {
                        began.unwrap_or_else(|| k8s_openapi::jiff::Timestamp::now().to_string())
                    })
                    .clone();
                if let Err(e) = self.report(&p, &ns, &name, &ip, &want, &started) {
                    first_err.get_or_insert(e);
                    continue;
                }
                self.reported.insert(uid.clone(), want.clone());
            }
            if want.ready {
                if let Some((node, nth)) = self.replacements.remove(&uid) {
                    self.moment(Moment::Ready, &node, nth);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    fn desired(&mut self, uid: &str, name: &str, node: &str, cilium: bool) -> Reported {
        let st = self.state.lock().unwrap();
        if !cilium {
            return Reported {
                ready: !st.unready.iter().any(|p| name.starts_with(p.as_str())),
                restarts: 0,
                pulling: false,
            };
        }
        if st.crash_loop.contains(node) {
            let since = *self
                .crash_started
                .entry(uid.to_string())
                .or_insert_with(Instant::now);
            return Reported {
                ready: false,
                restarts: 1 + since.elapsed().as_secs() as u32,
                pulling: false,
            };
        }
        // A pull happens once, before the pod first runs: pods already reported are not pulled.
        let fresh = !self.reported.contains_key(uid) || self.pull_started.contains_key(uid);
        if let Some(d) = st
            .pull
            .get(node)
            .filter(|_| fresh && self.replaced.contains(uid))
        {
            let since = *self
                .pull_started
                .entry(uid.to_string())
                .or_insert_with(Instant::now);
            if since.elapsed() < *d {
                return Reported {
                    ready: false,
                    restarts: 0,
                    pulling: true,
                };
            }
            // Pulled: never again for this pod.
            self.pull_started.remove(uid);
        }
        let back = st.restarting.get(node).copied().unwrap_or(0) == 0;
        let never = st.never_ready.contains(node) && self.replaced.contains(uid);
        Reported {
            ready: back && !never,
            restarts: 0,
            pulling: false,
        }
    }

    fn report(
        &self,
        p: &Pod,
        ns: &str,
        name: &str,
        ip: &str,
        r: &Reported,
        started: &str,
    ) -> Result<()> {
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let ready = if r.ready { "True" } else { "False" };
        let containers: Vec<Value> = p
            .spec
            .as_ref()
            .map(|s| s.containers.clone())
            .unwrap_or_default()
            .iter()
            .map(|c| {
                let state = if r.pulling {
                    json!({"waiting": {"reason": "ContainerCreating"}})
                } else if r.restarts > 0 && !r.ready {
                    json!({"waiting": {"reason": "CrashLoopBackOff",
                        "message": format!("back-off restarting failed container {}", c.name)}})
                } else {
                    json!({"running": {"startedAt": started}})
                };
                json!({"name": c.name, "image": c.image, "imageID": "", "ready": r.ready,
                       "started": !r.pulling && (r.restarts == 0 || r.ready), "restartCount": r.restarts,
                       "state": state})
            })
            .collect();
        let patch = json!({"status": {
            "phase": if r.pulling { "Pending" } else { "Running" }, "hostIP": ip, "hostIPs": [{"ip": ip}],
            "podIP": ip, "podIPs": [{"ip": ip}], "startTime": now,
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Initialized", "status": "True"},
                {"type": "ContainersReady", "status": ready, "lastTransitionTime": now},
                {"type": "Ready", "status": ready, "lastTransitionTime": now}],
            "containerStatuses": containers}});
        self.k
            .merge(&self.k.ns::<Pod>(ns), name, patch, true)
            .map(|_| ())
    }

    fn terminate(
        &mut self,
        p: &Pod,
        ns: &str,
        name: &str,
        uid: &str,
        node: &str,
        cilium: bool,
    ) -> Result<()> {
        if !self.terminating.contains_key(uid) {
            // The cilium agent takes its grace period (the lab restarts it meanwhile); the
            // lab's other pods have no process to stop and go at once.
            let grace = if cilium {
                Duration::from_secs(
                    p.metadata
                        .deletion_grace_period_seconds
                        .unwrap_or(30)
                        .max(0) as u64,
                )
            } else {
                Duration::ZERO
            };
            self.terminating
                .insert(uid.to_string(), (Instant::now(), grace));
            if cilium {
                let nth = {
                    let mut st = self.state.lock().unwrap();
                    st.deletions.push(node.to_string());
                    *st.restarting.entry(node.to_string()).or_default() += 1;
                    st.deletions.len()
                };
                self.awaiting.insert(node.to_string(), nth);
                self.restart_began.insert(
                    node.to_string(),
                    k8s_openapi::jiff::Timestamp::now().to_string(),
                );
                let (hook, state, n) = (self.restart.clone(), self.state.clone(), node.to_string());
                std::thread::spawn(move || {
                    // The agent counts as back even when the hook failed (the failure is the
                    // test's to report; a kubelet waiting forever would hide it).
                    let r =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hook(&n, nth)));
                    let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
                    if let Some(c) = st.restarting.get_mut(&n) {
                        *c = c.saturating_sub(1);
                    }
                    if r.is_err() {
                        st.hook_failures += 1;
                    }
                });
                self.moment(Moment::Terminating, node, nth);
            }
            return Ok(());
        }
        let (since, grace) = self.terminating[uid];
        if since.elapsed() < grace {
            return Ok(());
        }
        let dp = ::kube::api::DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(::kube::api::Preconditions {
                uid: Some(uid.to_string()),
                resource_version: None,
            }),
            ..Default::default()
        };
        match self.k.block(self.k.ns::<Pod>(ns).delete(name, &dp)) {
            Ok(_) => {}
            Err(::kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
            Err(e) => return Err(e).with_context(|| format!("remove pod {ns}/{name}")),
        }
        self.terminating.remove(uid);
        self.reported.remove(uid);
        self.started.remove(uid);
        Ok(())
    }
}

impl Kubelet {
    /// Runs the kubelet for `nodes` (name → address) with the API credentials in
    /// `kubeconfig`, passing every 100 ms.
    pub fn start(
        kubeconfig: &Path,
        nodes: BTreeMap<String, String>,
        restart: RestartHook,
        moment: Option<MomentHook>,
    ) -> Result<Kubelet> {
        let k = Kube::connect(kubeconfig)?;
        let state: Arc<Mutex<KubeletState>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (st, sp) = (state.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut l = Loop {
                k,
                nodes,
                state: st,
                restart,
                moment,
                terminating: BTreeMap::new(),
                awaiting: BTreeMap::new(),
                replacements: BTreeMap::new(),
                replaced: BTreeSet::new(),
                reported: BTreeMap::new(),
                crash_started: BTreeMap::new(),
                pull_started: BTreeMap::new(),
                restart_began: BTreeMap::new(),
                started: BTreeMap::new(),
            };
            let mut last_err = String::new();
            while !sp.load(Ordering::Relaxed) {
                if let Err(e) = l.pass() {
                    l.state.lock().unwrap().errors += 1;
                    let e = format!("{e:#}");
                    if e != last_err {
                        eprintln!("lab kubelet: {e} (retrying)");
                        last_err = e;
                    }
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        Ok(Kubelet {
            state,
            stop,
            thread: Some(thread),
        })
    }

    /// Waits (at most `limit`) until no restart hook is running; whether none is.
    pub fn wait_idle(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            let busy = self
                .state
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .restarting
                .values()
                .any(|n| *n > 0);
            if !busy {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The selector of the cilium pods (the chart's).
    pub fn cilium_selector() -> &'static str {
        CILIUM_SELECTOR
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
