//! The rollout tests' world: a control plane with the lab kubelet playing the DaemonSet
//! controller's part, a three-node LAN lab whose nodes the kubelet restarts, real stepguard
//! agents on them, and the stepper as a process in the LAN client namespace; with the readings
//! the tests make of it (pods, Events, the lock, deletions).
use super::*;

pub(crate) const CILIUM_IMAGE: &str = "quay.io/cilium/cilium:v1.18.2@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
pub(crate) const OPERATOR_IMAGE: &str = "quay.io/cilium/operator-generic:v1.18.2@sha256:fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210";

/// A template change at the n-th cilium pod deletion (1-based, over the kubelet's life) and
/// moment; `approve`: the DaemonSet's approval annotation follows it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Bump {
    pub(crate) deletion: usize,
    pub(crate) at: Moment,
    pub(crate) approve: bool,
}

/// The stepping world ([`Stepped`]: the control plane, the LAN lab, the kubelet, the agents)
/// with Cilium installed from its chart and the test's hooks.
pub(crate) struct Env {
    pub(crate) w: Stepped,
    /// When set, the restart for this many-th deletion (1-based, over the kubelet's life)
    /// empties the node's endpoint map.
    pub(crate) fault_at: Arc<Mutex<Option<usize>>>,
    pub(crate) bumps: Arc<Mutex<Vec<Bump>>>,
    /// How many template changes the test made (the bump annotation's value).
    pub(crate) bumped: Arc<Mutex<u32>>,
    /// What a test does at a kubelet moment of the n-th deletion (taken once done).
    pub(crate) at: Arc<Mutex<Vec<At>>>,
}

/// A test's action at a kubelet moment of the n-th cilium pod deletion.
pub(crate) struct At {
    pub(crate) deletion: usize,
    pub(crate) at: Moment,
    pub(crate) act: Act,
}

/// What a test does then, with the admin client and the moment's node.
pub(crate) type Act = Box<dyn FnOnce(&Kube, &str) + Send>;

impl std::ops::Deref for Env {
    type Target = Stepped;
    fn deref(&self) -> &Stepped {
        &self.w
    }
}

pub(crate) fn env() -> Env {
    env_with(None)
}

pub(crate) fn env_with(revision_history_limit: Option<i32>) -> Env {
    env_of(3, 3, revision_history_limit)
}

/// A world of `nodes` lab nodes, the first `registered` of them Nodes of the cluster.
pub(crate) fn env_of(nodes: u8, registered: u8, revision_history_limit: Option<i32>) -> Env {
    let fault_at: Arc<Mutex<Option<usize>>> = Arc::new(Mutex::new(None));
    let bumps: Arc<Mutex<Vec<Bump>>> = Arc::default();
    let bumped: Arc<Mutex<u32>> = Arc::new(Mutex::new(0));
    let at: Arc<Mutex<Vec<At>>> = Arc::default();
    let moment = {
        let (bumps, bumped, at) = (bumps.clone(), bumped.clone(), at.clone());
        move |admin: &std::path::Path| -> stepguard_lab::kube::kubelet::MomentHook {
            let k = Kube::connect(admin).unwrap();
            Arc::new(move |m: Moment, node: &str, nth: usize| {
                let due: Vec<At> = {
                    let mut all = at.lock().unwrap();
                    let (due, rest): (Vec<At>, Vec<At>) =
                        all.drain(..).partition(|a| a.deletion == nth && a.at == m);
                    *all = rest;
                    due
                };
                for a in due {
                    eprintln!("the test acts at {m:?} of deletion {nth} ({node})");
                    (a.act)(&k, node);
                }
                let due: Vec<Bump> = bumps
                    .lock()
                    .unwrap()
                    .iter()
                    .filter(|b| b.deletion == nth && b.at == m)
                    .copied()
                    .collect();
                for b in due {
                    let n = {
                        let mut c = bumped.lock().unwrap();
                        *c += 1;
                        *c
                    };
                    let h = set_template(&k, n, b.approve);
                    eprintln!("the test changes the template at {m:?} of deletion {nth} ({node}): revision {h}{}", if b.approve { ", approved" } else { "" });
                }
            })
        }
    };
    let w = Stepped::up_with(
        nodes,
        Hooks {
            fault_at: fault_at.clone(),
            moment: Some(Box::new(moment)),
            registered: Some(registered),
        },
    );
    // Cilium as its chart renders it, with the lab's lease timings in cilium-config (the
    // plan's expected blips read them). The chart has no value for the DaemonSet's
    // revisionHistoryLimit: a test that needs one sets it as a user's post-renderer would.
    install_cilium(
        &w.cp.lock().unwrap(),
        &w.run_dir,
        &cilium_values(CILIUM_IMAGE, OPERATOR_IMAGE, &short_leases(), &[]),
        &[],
        false,
    );
    if let Some(n) = revision_history_limit {
        w.k.merge(
            &w.k.ns::<DaemonSet>(KS),
            "cilium",
            json!({"spec": {"revisionHistoryLimit": n}}),
            false,
        )
        .expect("the DaemonSet's revisionHistoryLimit");
    }
    let e = Env {
        w,
        fault_at,
        bumps,
        bumped,
        at,
    };
    // Every node runs a Ready cilium pod of the first revision, and a stepguard agent pod;
    // then the template changes (unapproved), so the first rollout has work.
    wait_until(
        "the controller's first revision",
        Duration::from_secs(30),
        || observed(&e.k) && revision_now(&e.k).is_some(),
        || control_plane_logs(&e),
    );
    let first = current_revision(&e.k).0;
    wait_until(
        "the controller's pods Ready on every node, the operator Ready",
        Duration::from_secs(60),
        || {
            all_on(&e, &first)
                && agents_running(&e) == usize::from(registered)
                && operator_ready(&e) == 2
        },
        || format!("{:?}", cilium_pods(&e)),
    );
    bump(&e, false);
    e
}

/// The checksum of `cilium-config` that Cilium's chart puts on the pod template for the lab's
/// values with `image` and `extra` (as a user reads it from `helm template` to approve it).
pub(crate) fn chart_checksum(image: &str, extra: &[&str]) -> String {
    let values = cilium_values(image, OPERATOR_IMAGE, &short_leases(), extra);
    let v: Vec<&str> = values.iter().map(String::as_str).collect();
    let chart = CiliumChart::from_env().unwrap_or_else(|e| panic!("{e:#}"));
    let yaml = chart.render(&v, &[]).unwrap_or_else(|e| panic!("{e:#}"));
    stepguard_lab::kube::chart::checksum(&yaml).expect("the chart's checksum annotation")
}

/// A commit of Cilium's values, applied as a GitOps controller applies it: the chart rendered
/// with the lab's values, `image` and `extra`, and with `approval` (image, config checksum) as
/// the chart's `annotations:` value, applied server-side. The revision, once observed.
pub(crate) fn chart_commit(
    e: &Env,
    image: &str,
    extra: &[&str],
    approval: Option<(&str, &str)>,
) -> String {
    let values = cilium_values(image, OPERATOR_IMAGE, &short_leases(), extra);
    let strings: Vec<String> = approval
        .map(|(image, sum)| {
            vec![
                format!("annotations.stepguard\\.io/approve-image={image}"),
                format!("annotations.stepguard\\.io/approve-config-checksum={sum}"),
            ]
        })
        .unwrap_or_default();
    install_cilium(&e.cp.lock().unwrap(), &e.run_dir, &values, &strings, false);
    wait_until(
        "the controller observes the template",
        Duration::from_secs(20),
        || observed(&e.k),
        String::new,
    );
    current_revision(&e.k).0
}

/// Changes the template now; returns the new revision's hash.
pub(crate) fn bump(e: &Env, approve: bool) -> String {
    let n = {
        let mut c = e.bumped.lock().unwrap();
        *c += 1;
        *c
    };
    set_template(&e.k, n, approve)
}

/// The cilium pods: name → (node it is for, revision hash, Ready, Terminating).
pub(crate) fn cilium_pods(e: &Env) -> BTreeMap<String, (String, String, bool, bool)> {
    cilium_pods_in(&e.k)
}

/// A cilium pod is bound to its node.
pub(crate) fn bound(e: &Env, name: &str) -> bool {
    e.k.block(e.k.ns::<Pod>(KS).get_opt(name))
        .unwrap()
        .and_then(|p| p.spec?.node_name)
        .is_some()
}

/// The cilium-operator Deployment's Ready replicas, as its controller reports them.
pub(crate) fn operator_ready(e: &Env) -> i32 {
    e.k.block(
        e.k.ns::<k8s_openapi::api::apps::v1::Deployment>(KS)
            .get("cilium-operator"),
    )
    .ok()
    .and_then(|d| d.status?.ready_replicas)
    .unwrap_or(0)
}

pub(crate) fn agents_running(e: &Env) -> usize {
    let lp = kube::api::ListParams::default().labels("app.kubernetes.io/name=stepguard");
    let pods = e.k.block(e.k.ns::<Pod>("stepguard").list(&lp)).unwrap();
    pods.items
        .iter()
        .filter(|p| p.status.as_ref().and_then(|s| s.pod_ip.as_ref()).is_some())
        .count()
}

pub(crate) fn rollout_cmd(e: &Env, extra: &[&str]) -> Command {
    // `STEPGUARD_ROLLOUT_BIN`: another build's stepper beside this build's agents (to show a
    // test failing against older code).
    let stepper = std::env::var_os("STEPGUARD_ROLLOUT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| bin("STEPGUARD_BIN", "stepguard"));
    let mut c = Command::new("nsenter");
    c.arg(format!("--net=/run/netns/{}", e.client_ns))
        .arg("--")
        .arg(stepper)
        .arg("rollout");
    // The test's pace, unless the case sets its own.
    for (flag, value) in [
        ("--lock-duration", "3s"),
        ("--settle", "1s"),
        ("--step-timeout", "30s"),
        ("--replace-timeout", "30s"),
    ] {
        if !extra.contains(&flag) {
            c.args([flag, value]);
        }
    }
    c.args(extra)
        .env("KUBECONFIG", &e.kubeconfig)
        .env("RUST_LOG", "warn");
    c
}

pub(crate) fn rollout(e: &Env, extra: &[&str]) -> (i32, String) {
    let out = rollout_cmd(e, extra)
        .output()
        .expect("run stepguard rollout");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

/// A stepper in the background, its output in a file of the lab's run directory.
pub(crate) struct Stepper {
    pub(crate) child: Child,
    pub(crate) log: std::path::PathBuf,
}

impl Stepper {
    pub(crate) fn spawn(e: &Env, name: &str, extra: &[&str]) -> Stepper {
        let log = e.run_dir.join(format!("{name}.log"));
        let f = std::fs::File::create(&log).unwrap();
        let child = rollout_cmd(e, extra)
            .stdout(Stdio::from(f.try_clone().unwrap()))
            .stderr(Stdio::from(f))
            .spawn()
            .expect("spawn stepguard rollout");
        Stepper { child, log }
    }
    /// `stepguard rollout --watch` with the arguments `deploy/rollout/deployment.yaml` gives
    /// it (its token file one of the test's), at the test's pace.
    pub(crate) fn watch(e: &Env, name: &str) -> Stepper {
        let mut extra = watch_args(&e.run_dir);
        extra.extend(["--watch-interval".into(), "1s".into()]);
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        Stepper::spawn(e, name, &extra)
    }
    pub(crate) fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
    pub(crate) fn running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
    pub(crate) fn kill9(&mut self) {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

impl Drop for Stepper {
    fn drop(&mut self) {
        if self.running() {
            self.kill9();
        }
    }
}

/// The tails of the control plane's logs, for a failure message.
pub(crate) fn control_plane_logs(e: &Env) -> String {
    let dir = e.cp.lock().unwrap().dir.clone();
    let mut out = String::new();
    for f in ["kube-controller-manager.log", "kube-scheduler.log"] {
        let t = std::fs::read_to_string(dir.join(f)).unwrap_or_default();
        let lines: Vec<&str> = t.lines().collect();
        out += &format!(
            "--- {f} (last 30 lines)\n{}\n",
            lines[lines.len().saturating_sub(30)..].join("\n")
        );
    }
    out
}

/// The lab kubelet's state (its deletions, held pods, hook failures), locked.
pub(crate) fn kubelet_state(
    e: &Env,
) -> std::sync::MutexGuard<'_, stepguard_lab::kube::kubelet::KubeletState> {
    e.kubelet
        .as_ref()
        .expect("the env's kubelet")
        .state
        .lock()
        .unwrap()
}

pub(crate) fn deletions(e: &Env) -> Vec<String> {
    kubelet_state(e).deletions.clone()
}

pub(crate) fn deletions_since(e: &Env, from: usize) -> Vec<String> {
    deletions(e)[from..].to_vec()
}

pub(crate) fn counts(v: &[String]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for n in v {
        *m.entry(n.clone()).or_insert(0) += 1;
    }
    m
}

/// Every node of the cluster runs one Ready cilium pod on `rev`, none being deleted.
pub(crate) fn all_on(e: &Env, rev: &str) -> bool {
    let pods = cilium_pods(e);
    pods.len() == e.registered()
        && pods
            .values()
            .all(|(_, r, ready, term)| r == rev && *ready && !*term)
}

/// The Events in kube-system: (uid, reason, message), oldest first.
pub(crate) fn all_events(e: &Env) -> Vec<(String, String, String)> {
    let mut ev =
        e.k.block(e.k.ns::<Event>(KS).list(&Default::default()))
            .unwrap()
            .items;
    ev.sort_by_key(|v| v.metadata.creation_timestamp.clone().map(|t| t.0));
    ev.into_iter()
        .map(|v| {
            (
                v.metadata.uid.unwrap_or_default(),
                v.reason.unwrap_or_default(),
                v.message.unwrap_or_default(),
            )
        })
        .collect()
}

/// The Events seen so far (a later call's "since").
pub(crate) fn events(e: &Env) -> BTreeSet<String> {
    all_events(e).into_iter().map(|(u, _, _)| u).collect()
}

pub(crate) fn events_since(e: &Env, before: &BTreeSet<String>) -> Vec<(String, String)> {
    all_events(e)
        .into_iter()
        .filter(|(u, _, _)| !before.contains(u))
        .map(|(_, r, m)| (r, m))
        .collect()
}

/// The nodes of the Events with `reason` since `before`.
pub(crate) fn event_nodes(e: &Env, before: &BTreeSet<String>, reason: &str) -> Vec<String> {
    events_since(e, before)
        .iter()
        .filter(|(r, _)| r == reason)
        .filter_map(|(_, m)| Some(m.strip_prefix("node ")?.split(':').next()?.to_string()))
        .collect()
}

pub(crate) fn reasons_since(e: &Env, before: &BTreeSet<String>) -> Vec<String> {
    events_since(e, before)
        .into_iter()
        .map(|(r, _)| r)
        .collect()
}

/// The rollout lock, if any (the only Lease in stepguard's namespace).
pub(crate) fn lock(e: &Env) -> Option<Value> {
    let l =
        e.k.block(e.k.ns::<Lease>("stepguard").list(&Default::default()))
            .unwrap();
    l.items
        .into_iter()
        .next()
        .map(|l| serde_json::to_value(l).unwrap())
}

pub(crate) fn lock_annotation(e: &Env, key: &str) -> Option<String> {
    lock(e).and_then(|l| l["metadata"]["annotations"][key].as_str().map(String::from))
}

/// Every request the stepper made was allowed by the shipped RBAC (the API server's audit
/// log of its user: no 403; a request that failed authentication would carry no user and is
/// not in this log, but then the stepper could not have done anything), and there were
/// requests. A restarted API server serves
/// before its authorization caches are filled and refuses (403) what RBAC allows; those
/// requests (received while it restarted) are the server's, not the RBAC's, and the stepper
/// retried them.
pub(crate) fn assert_rbac_sufficed(e: &Env) {
    let cp = e.cp.lock().unwrap();
    let reqs = cp.stepper_requests().expect("the audit log");
    assert!(
        reqs.len() > 10,
        "the stepper's requests are audited: {}",
        reqs.len()
    );
    let denied: Vec<String> = reqs
        .iter()
        .filter(|r| r["responseStatus"]["code"].as_i64() == Some(403))
        .filter(|r| !cp.while_restarting(r))
        .map(|r| {
            format!(
                "{} {} → {}",
                r["verb"], r["requestURI"], r["responseStatus"]["code"]
            )
        })
        .collect();
    assert!(
        denied.is_empty(),
        "the shipped RBAC denied the stepper: {denied:#?}"
    );
}

/// Every node stepped exactly once since `from_del`, and every verdict read (one passed Event
/// per node since `from_ev`), all on `rev`.
pub(crate) fn each_node_once_every_verdict_read(
    e: &Env,
    from_del: usize,
    from_ev: &BTreeSet<String>,
    rev: &str,
    out: &str,
) {
    assert_eq!(
        kubelet_state(e).hook_failures,
        0,
        "the lab's restarts and template changes all worked (see the panics above)"
    );
    let d = deletions_since(e, from_del);
    assert_eq!(
        counts(&d).values().copied().collect::<Vec<_>>(),
        [1, 1, 1],
        "each node deleted once: {d:?}\n{out}"
    );
    let mut passed = event_nodes(e, from_ev, "StepguardStepPassed");
    passed.sort();
    assert_eq!(
        passed,
        [node_name(0), node_name(1), node_name(2)],
        "every node's verdict read, once: {:?}\n{out}",
        reasons_since(e, from_ev)
    );
    wait_until(
        "all on the revision",
        Duration::from_secs(10),
        || all_on(e, rev),
        || format!("{:?}", cilium_pods(e)),
    );
}

/// A VIP's LoadBalancer Service in `default` with `externalTrafficPolicy: Local` and an
/// EndpointSlice of `endpoints` (JSON, each with its `nodeName` and `conditions`): Cilium's
/// L2 announcer lets only nodes with a ready local backend announce it.
pub(crate) fn local_service(e: &Env, vip: &str, endpoints: Vec<Value>) {
    e.k.create(
        &e.k.ns::<k8s_openapi::api::core::v1::Service>("default"),
        json!({"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": vip, "namespace": "default"},
               "spec": {"type": "LoadBalancer", "externalTrafficPolicy": "Local",
                        "ports": [{"port": 80, "protocol": "TCP"}]}}),
    )
    .expect("the VIP's Service");
    e.k.create(
        &e.k.ns::<k8s_openapi::api::discovery::v1::EndpointSlice>("default"),
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
               "metadata": {"name": format!("{vip}-1"), "namespace": "default",
                            "labels": {"kubernetes.io/service-name": vip}},
               "addressType": "IPv4",
               "endpoints": endpoints,
               "ports": [{"port": 80, "protocol": "TCP"}]}),
    )
    .expect("the VIP's EndpointSlice");
}
