//! A world `stepguard rollout` steps in, with Cilium left to whoever installs it (a GitOps
//! controller): a real control plane with the shipped manifests, a LAN lab of `n` nodes as
//! Node objects, the lab kubelet restarting a node's simulated Cilium when its cilium pod is
//! deleted, real stepguard agents on the nodes, and the stepper run in the LAN client's
//! namespace with the arguments of `deploy/rollout/deployment.yaml`.
#![allow(dead_code)]
use crate::common::cluster::*;
use crate::common::{bin, require_root, AgentProc};
use k8s_openapi::api::coordination::v1::Lease;
use serde_json::json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use stepguard_lab::kube::kubelet::{Kubelet, MomentHook};
use stepguard_lab::kube::{ControlPlane, Forward, Kube};
use stepguard_lab::lan::{LanGuard, LanLab, LanSpec, LeaseTimings};
use stepguard_lab::RestartOpts;

pub fn node_name(i: u8) -> String {
    format!("node-{i}")
}

/// Short L2-announcement lease timings, so a lease moves within a test.
pub fn short_leases() -> LeaseTimings {
    LeaseTimings {
        duration: Duration::from_secs(2),
        renew: Duration::from_secs(1),
        retry: Duration::from_millis(500),
    }
}

pub struct Stepped {
    pub nodes: u8,
    pub agents: Vec<AgentProc>,
    pub kubelet: Option<Kubelet>,
    pub forward: Forward,
    pub k: Arc<Kube>,
    pub cp: Arc<Mutex<ControlPlane>>,
    /// The stepper's ServiceAccount kubeconfig, reaching the API server through `forward`.
    pub kubeconfig: PathBuf,
    pub client_ns: String,
    pub run_dir: PathBuf,
    pub lan: Arc<Mutex<LanGuard>>,
}

/// Cilium's L2-announcement Leases in kube-system as the lab's holders are now (the lab plays
/// the cilium-agent's part in them).
pub fn sync_leases(k: &Kube, lan: &LanLab) {
    let api = k.ns::<Lease>(KS);
    for (vip, holder) in &lan.state.holders {
        let name = format!("cilium-l2announce-default-{vip}");
        let spec = json!({"holderIdentity": node_name(*holder), "leaseDurationSeconds": 2});
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let r = match k.block(api.get_opt(&name)) {
                Ok(Some(_)) => k
                    .merge(&api, &name, json!({"spec": spec}), false)
                    .map(|_| ()),
                Ok(None) => k
                    .create(
                        &api,
                        json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                               "metadata": {"name": name, "namespace": KS}, "spec": spec}),
                    )
                    .map(|_| ()),
                Err(e) => Err(e.into()),
            };
            match r {
                Ok(()) => break,
                Err(e) if Instant::now() < deadline => {
                    eprintln!("write the L2 Lease {name}: {e:#} (retrying)");
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => panic!("write the L2 Lease {name}: {e:#}"),
            }
        }
    }
}

/// Makes the kubelet's moment hook, given the admin kubeconfig.
pub type MakeMoment = Box<dyn FnOnce(&Path) -> MomentHook>;

/// What a test does to the world at the kubelet's moments.
#[derive(Default)]
pub struct Hooks {
    /// When set, the restart for this many-th cilium pod deletion (1-based, over the kubelet's
    /// life) empties the node's endpoint map.
    pub fault_at: Arc<Mutex<Option<usize>>>,
    /// Makes the kubelet's moment hook, given the admin kubeconfig.
    pub moment: Option<MakeMoment>,
    /// Only the first this many lab nodes are registered as Node objects at the start (the
    /// others by [`Stepped::register`]); all of them when unset.
    pub registered: Option<u8>,
}

impl Stepped {
    /// The world with `nodes` nodes; no Cilium object exists yet.
    pub fn up(nodes: u8) -> Stepped {
        Stepped::up_with(nodes, Hooks::default())
    }

    /// As [`Stepped::up`], with the test's `hooks`.
    pub fn up_with(nodes: u8, hooks: Hooks) -> Stepped {
        require_root();
        let kube_bin = PathBuf::from(std::env::var("STEPGUARD_KUBE_BIN").expect(
            "STEPGUARD_KUBE_BIN: the control plane's binaries (`cargo xtask kube`; `cargo xtask test` sets it)",
        ));
        let mut spec = LanSpec::new(stepguard_lab::unique_prefix());
        spec.nodes = nodes;
        spec.lease = short_leases();
        let lan = stepguard_lab::sys::fixture::Guard(LanLab::up(spec).expect("LAN lab up"));
        let run_dir = lan.state.run_dir.clone();
        let client_ns = lan.client_ns();
        let lan = Arc::new(Mutex::new(lan));
        // From here on a failure still takes the control plane and the lab down.
        struct Partial(Option<Arc<Mutex<ControlPlane>>>, Arc<Mutex<LanGuard>>);
        impl Drop for Partial {
            fn drop(&mut self) {
                if let Some(cp) = &self.0 {
                    cp.lock().unwrap_or_else(|e| e.into_inner()).down();
                }
                let _ = self.1.lock().unwrap_or_else(|e| e.into_inner()).0.down();
            }
        }
        let mut partial = Partial(None, lan.clone());
        let cp = ControlPlane::up(&run_dir.join("kube"), &kube_bin).expect("control plane up");
        let cp = Arc::new(Mutex::new(cp));
        partial.0 = Some(cp.clone());
        let (admin, server) = {
            let c = cp.lock().unwrap();
            (c.admin_kubeconfig(), c.server.clone())
        };
        let k = Arc::new(Kube::connect(&admin).expect("admin client"));
        apply_shipped_manifests(&cp.lock().unwrap());
        let node_addrs: Vec<(String, String)> = (0..nodes)
            .map(|i| (node_name(i), stepguard_lab::lan::node_addr(i).to_string()))
            .collect();
        let registered = usize::from(hooks.registered.unwrap_or(nodes).min(nodes));
        stepguard_lab::kube::create_nodes(&k, &node_addrs[..registered]).expect("Nodes");
        let restart = {
            let (lan, k, fault_at) = (
                lan.clone(),
                Kube::connect(&admin).unwrap(),
                hooks.fault_at.clone(),
            );
            Arc::new(move |node: &str, nth: usize| {
                let i: u8 = node.trim_start_matches("node-").parse().unwrap();
                let mut opts = RestartOpts {
                    down: Duration::from_millis(300),
                    ..Default::default()
                };
                if *fault_at.lock().unwrap() == Some(nth) {
                    opts.flush_map = Some("cilium_lxc".into());
                }
                eprintln!(
                    "the lab restarts {node} for deletion {nth}{}",
                    if opts.flush_map.is_some() {
                        ", emptying cilium_lxc"
                    } else {
                        ""
                    }
                );
                let mut l = lan.lock().unwrap();
                l.restart(i, &opts, false).expect("lab restart");
                sync_leases(&k, &l);
            })
        };
        let moment = hooks.moment.map(|make| make(&admin));
        let kubelet = Kubelet::start(&admin, node_addrs.into_iter().collect(), restart, moment)
            .expect("lab kubelet");
        let mut agents = Vec::new();
        {
            let l = lan.lock().unwrap();
            for i in 0..nodes {
                let node = l.node(i).unwrap();
                let addr = std::net::SocketAddr::new(stepguard_lab::lan::node_addr(i).into(), 9969);
                agents.push(AgentProc::start_at(
                    node.node_ns(),
                    l.node_config(i),
                    l.state.run_dir.join(format!("agent-state-n{i}")),
                    addr,
                    &[],
                    &[],
                ));
            }
            sync_leases(&k, &l);
        }
        let target: std::net::SocketAddr = server.trim_start_matches("https://").parse().unwrap();
        let forward = Forward::start(
            &client_ns,
            &stepguard_lab::lan::CLIENT_ADDR.to_string(),
            target,
        )
        .expect("forward the API server into the LAN");
        let kubeconfig = cp
            .lock()
            .unwrap()
            .stepper_kubeconfig(&format!("https://{}", forward.addr))
            .unwrap();
        std::mem::forget(partial);
        Stepped {
            nodes,
            agents,
            kubelet: Some(kubelet),
            forward,
            k,
            cp,
            kubeconfig,
            client_ns,
            run_dir,
            lan,
        }
    }

    /// Registers lab node `i` as a Node object (a node joining the cluster): the DaemonSets'
    /// pods follow for it.
    pub fn register(&self, i: u8) {
        stepguard_lab::kube::create_nodes(
            &self.k,
            &[(node_name(i), stepguard_lab::lan::node_addr(i).to_string())],
        )
        .expect("register the Node");
    }

    /// The Node objects now.
    pub fn registered(&self) -> usize {
        self.k
            .block(
                self.k
                    .all::<k8s_openapi::api::core::v1::Node>()
                    .list(&Default::default()),
            )
            .map(|l| l.items.len())
            .unwrap_or(0)
    }

    /// `stepguard rollout` with `args` as the stepper's ServiceAccount.
    pub fn rollout_cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/run/netns/{}", self.client_ns))
            .arg("--")
            .arg(bin("STEPGUARD_BIN", "stepguard"))
            .arg("rollout")
            .args(args)
            .env("KUBECONFIG", &self.kubeconfig)
            .env("RUST_LOG", "warn");
        c
    }

    /// `stepguard rollout` with `args`: its exit code and output.
    pub fn rollout(&self, args: &[&str]) -> (i32, String) {
        let out = self
            .rollout_cmd(args)
            .output()
            .expect("run stepguard rollout");
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.code().unwrap_or(-1), text)
    }

    /// `stepguard rollout --watch` with the arguments `deploy/rollout/deployment.yaml` gives
    /// it (its token file one of the test's) and `pace`, in the background.
    pub fn watch(&self, name: &str, pace: &[&str]) -> Stepper {
        let mut extra = watch_args(&self.run_dir);
        extra.extend(pace.iter().map(|s| s.to_string()));
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let log = self.run_dir.join(format!("{name}.log"));
        let f = std::fs::File::create(&log).unwrap();
        let child = self
            .rollout_cmd(&extra)
            .stdout(Stdio::from(f.try_clone().unwrap()))
            .stderr(Stdio::from(f))
            .spawn()
            .expect("spawn stepguard rollout");
        Stepper { child, log }
    }

    /// The nodes of the cilium pod deletions the kubelet saw, in order.
    pub fn deletions(&self) -> Vec<String> {
        self.kubelet
            .as_ref()
            .expect("the kubelet")
            .state
            .lock()
            .unwrap()
            .deletions
            .clone()
    }

    /// Every node runs one Ready cilium pod on `rev`, none being deleted.
    pub fn all_on(&self, rev: &str) -> bool {
        let pods = cilium_pods_in(&self.k);
        pods.len() == self.nodes as usize
            && pods
                .values()
                .all(|(_, r, ready, term)| r == rev && *ready && !*term)
    }
}

impl Drop for Stepped {
    fn drop(&mut self) {
        if let Some(k) = self.kubelet.take() {
            if !k.wait_idle(Duration::from_secs(40)) {
                eprintln!("a lab restart still runs at teardown");
            }
        }
        self.cp.lock().unwrap_or_else(|e| e.into_inner()).down();
        let mut lan = self.lan.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = lan.0.down() {
            eprintln!("LAN lab down: {e:#}");
        }
    }
}

/// A stepper in the background, its output in a file; killed (the child it started) when
/// dropped.
pub struct Stepper {
    pub child: Child,
    pub log: PathBuf,
}

impl Stepper {
    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Stepper {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The arguments `deploy/rollout/deployment.yaml` gives `stepguard rollout --watch`, after
/// `rollout`, its token file one written into `run_dir`.
pub fn watch_args(run_dir: &Path) -> Vec<String> {
    let args = deployment_args();
    assert_eq!(
        args.first().map(String::as_str),
        Some("rollout"),
        "{args:?}"
    );
    assert!(args.iter().any(|a| a == "--watch"), "{args:?}");
    let token = run_dir.join("agents-token");
    std::fs::write(&token, "lab-agents-token\n").unwrap();
    args[1..]
        .iter()
        .map(|a| match a.strip_prefix("--token-file=") {
            Some(_) => format!("--token-file={}", token.display()),
            None => a.clone(),
        })
        .collect()
}

/// The container arguments of the stepper's Deployment as shipped.
pub fn deployment_args() -> Vec<String> {
    let text = std::fs::read_to_string(repo_root().join("deploy/rollout/deployment.yaml")).unwrap();
    let mut lines = text.lines().skip_while(|l| l.trim() != "args:").skip(1);
    let mut args = vec![];
    for l in lines.by_ref() {
        match l.trim().strip_prefix("- ") {
            Some(a) => args.push(a.trim_matches('"').to_string()),
            None => break,
        }
    }
    args
}

/// The nodes named by `reason` Events on the DaemonSet (`node N: ...`).
pub fn event_nodes(k: &Kube, reason: &str) -> BTreeMap<String, usize> {
    let ev = k
        .block(
            k.ns::<k8s_openapi::api::core::v1::Event>(KS)
                .list(&Default::default()),
        )
        .unwrap();
    let mut m = BTreeMap::new();
    for e in ev.items {
        if e.reason.as_deref() == Some(reason) {
            if let Some(n) = e
                .message
                .as_deref()
                .and_then(|m| m.strip_prefix("node "))
                .and_then(|m| m.split(':').next())
            {
                *m.entry(n.to_string()).or_insert(0) += 1;
            }
        }
    }
    m
}
