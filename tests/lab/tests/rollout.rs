//! `stepguard rollout` end to end (issue 13): a fake Kubernetes API server whose cilium pod
//! DELETE restarts the matching node of a three-node LAN lab and then reports a Ready
//! replacement; real stepguard agents on the lab nodes; the stepper as a process in the LAN
//! client namespace. Cases: the plan and refusals (`--dry-run`); a three-node rollout passes;
//! the stepper killed mid-step and started again finishes without stepping a node twice; a
//! revision change mid-rollout re-plans; a fault on the second node stops the rollout there
//! with the third node untouched.
mod common;
use common::fakekube::{FakeKube, World};
use common::*;
use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use stepguard_lab::lan::{LanGuard, LanLab, LanSpec, LeaseTimings};
use stepguard_lab::RestartOpts;

fn node_name(i: u8) -> String {
    format!("node-{i}")
}

struct Env {
    // Dropped in this order: the agents, then the API server, then the lab.
    _agents: Vec<Daemon>,
    kube: FakeKube,
    kubeconfig: std::path::PathBuf,
    client_ns: String,
    _lan: Arc<Mutex<LanGuard>>,
    /// When set, the next restart of this many-th deletion (1-based, in the current run)
    /// empties the node's endpoint map.
    fault_at: Arc<Mutex<Option<usize>>>,
}

/// Cilium's L2 leases in the fake API, as the lab's holders are now.
fn sync_leases(w: &mut World, lan: &LanLab) {
    for (vip, holder) in &lan.state.holders {
        let name = format!("cilium-l2announce-default-{vip}");
        w.leases.insert(
            ("kube-system".into(), name.clone()),
            serde_json::json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": name, "namespace": "kube-system", "resourceVersion": "1"},
                "spec": {"holderIdentity": node_name(*holder), "leaseDurationSeconds": 2}}),
        );
    }
}

fn env() -> Env {
    require_root();
    let mut spec = LanSpec::new(stepguard_lab::unique_prefix());
    spec.nodes = 3;
    spec.lease = LeaseTimings {
        duration: Duration::from_secs(2),
        renew: Duration::from_secs(1),
        retry: Duration::from_millis(500),
    };
    let lan = LanGuard(LanLab::up(spec).expect("LAN lab up"));
    let mut agents = Vec::new();
    let mut world = World {
        revision: ("rev2".into(), 2),
        generation: 2,
        observed_generation: 2,
        image: "quay.io/cilium/cilium:v1.18.2@sha256:0123".into(),
        ..Default::default()
    };
    for i in 0..3u8 {
        let node = lan.node(i).unwrap();
        let addr = std::net::SocketAddr::new(stepguard_lab::lan::node_addr(i).into(), 9969);
        agents.push(Daemon::start_at(
            node.node_ns(),
            lan.node_config(i),
            lan.state.run_dir.join(format!("agent-state-n{i}")),
            addr,
            &[],
            &[],
        ));
        world.nodes.insert(node_name(i), true);
        world.pods.insert(
            format!("cilium-{i}"),
            (format!("uid-{i}"), node_name(i), "rev1".into(), true),
        );
        world
            .agents
            .insert(node_name(i), stepguard_lab::lan::node_addr(i).to_string());
    }
    sync_leases(&mut world, &lan);
    let client_ns = lan.client_ns();
    let run_dir = lan.state.run_dir.clone();
    let lan = Arc::new(Mutex::new(lan));
    let fault_at: Arc<Mutex<Option<usize>>> = Arc::new(Mutex::new(None));
    let world_cell: Arc<Mutex<Option<Arc<Mutex<World>>>>> = Arc::new(Mutex::new(None));
    let hook = {
        let (lan, fault_at, world_cell) = (lan.clone(), fault_at.clone(), world_cell.clone());
        Arc::new(move |node: &str| {
            let i: u8 = node.trim_start_matches("node-").parse().unwrap();
            let w = world_cell.lock().unwrap().clone().unwrap();
            let nth = w.lock().unwrap().deletions.len();
            let mut opts = RestartOpts {
                down: Duration::from_millis(300),
                ..Default::default()
            };
            if *fault_at.lock().unwrap() == Some(nth) {
                opts.flush_map = Some("cilium_lxc".into());
            }
            let mut l = lan.lock().unwrap();
            l.restart(i, &opts, false).expect("lab restart");
            sync_leases(&mut w.lock().unwrap(), &l);
        })
    };
    let kube = FakeKube::start(
        &client_ns,
        &stepguard_lab::lan::CLIENT_ADDR.to_string(),
        world,
        hook,
    );
    *world_cell.lock().unwrap() = Some(kube.world.clone());
    let kubeconfig = kube.kubeconfig(&run_dir);
    Env {
        _lan: lan,
        _agents: agents,
        kube,
        kubeconfig,
        client_ns,
        fault_at,
    }
}

/// The API server's hook holds the lab too, so the guard alone would never drop: take the
/// lab down when the test ends (also on a panic).
impl Drop for Env {
    fn drop(&mut self) {
        let mut lan = self._lan.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = lan.0.down() {
            eprintln!("LAN lab down: {e:#}");
        }
    }
}

fn rollout_cmd(e: &Env, extra: &[&str]) -> Command {
    let mut c = Command::new("nsenter");
    c.arg(format!("--net=/run/netns/{}", e.client_ns))
        .arg("--")
        .arg(bin("STEPGUARD_BIN", "stepguard"))
        .args([
            "rollout",
            "--lock-duration",
            "3s",
            "--settle",
            "1s",
            "--step-timeout",
            "30s",
            "--replace-timeout",
            "60s",
        ])
        .args(extra)
        .env("KUBECONFIG", &e.kubeconfig)
        .env("RUST_LOG", "warn");
    c
}

fn rollout(e: &Env, extra: &[&str]) -> (i32, String) {
    let out = rollout_cmd(e, extra)
        .output()
        .expect("run stepguard rollout");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

fn deletions_since(e: &Env, from: usize) -> Vec<String> {
    e.kube.world.lock().unwrap().deletions[from..].to_vec()
}

fn all_on(e: &Env, rev: &str) -> bool {
    e.kube
        .world
        .lock()
        .unwrap()
        .pods
        .values()
        .all(|p| p.2 == rev)
}

fn counts(v: &[String]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for n in v {
        *m.entry(n.clone()).or_insert(0) += 1;
    }
    m
}

#[test]
fn rollouts_step_verify_resume_replan_and_stop_at_a_failed_step() {
    let e = env();

    // The plan, and the refusals in their documented order.
    let (code, out) = rollout(&e, &["--dry-run"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("3 of 3 nodes to step") && out.contains("moves L2 VIPs"),
        "{out}"
    );
    {
        let mut w = e.kube.world.lock().unwrap();
        w.nodes.insert(node_name(1), false);
        w.agents.remove(&node_name(2));
        w.observed_generation = 1;
    }
    let (code, out) = rollout(&e, &["--dry-run"]);
    assert_eq!(code, 2, "{out}");
    let (a, b, c) = (
        out.find("status is stale").expect(&out),
        out.find("node node-1 is NotReady").expect(&out),
        out.find("no stepguard agent on node node-2").expect(&out),
    );
    assert!(a < b && b < c, "refusals in order: {out}");
    {
        let mut w = e.kube.world.lock().unwrap();
        w.nodes.insert(node_name(1), true);
        w.agents
            .insert(node_name(2), stepguard_lab::lan::node_addr(2).to_string());
        w.observed_generation = w.generation;
    }

    // A three-node rollout passes: each node stepped once, verified, the lock released.
    let (code, out) = rollout(&e, &[]);
    assert_eq!(code, 0, "{out}");
    let d = deletions_since(&e, 0);
    assert_eq!(
        counts(&d).values().copied().collect::<Vec<_>>(),
        [1, 1, 1],
        "{d:?}\n{out}"
    );
    assert!(all_on(&e, "rev2"));
    assert!(out.contains("3 nodes stepped and verified"), "{out}");
    {
        let w = e.kube.world.lock().unwrap();
        assert!(
            !w.leases.keys().any(|(ns, _)| ns == "stepguard"),
            "the lock is released"
        );
        let reasons: Vec<&str> = w
            .events
            .iter()
            .filter_map(|e| e["reason"].as_str())
            .collect();
        assert_eq!(
            reasons
                .iter()
                .filter(|r| **r == "StepguardStepPassed")
                .count(),
            3,
            "{reasons:?}"
        );
    }

    // Killed mid-step, started again: finishes without stepping a node twice.
    let from = e.kube.world.lock().unwrap().deletions.len();
    e.kube.world.lock().unwrap().bump_revision(); // rev3
    let mut child = rollout_cmd(&e, &[])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let w = e.kube.world.lock().unwrap();
        let lock = w
            .leases
            .iter()
            .find(|((ns, _), _)| ns == "stepguard")
            .map(|(_, l)| l.clone());
        let inflight = lock.as_ref().and_then(|l| {
            l["metadata"]["annotations"]["stepguard.io/node"]
                .as_str()
                .map(String::from)
        });
        // The second node's step has begun (its pod may or may not be deleted yet).
        if w.deletions.len() > from && inflight.is_some_and(|n| n != w.deletions[from]) {
            break;
        }
        drop(w);
        assert!(
            Instant::now() < deadline,
            "the stepper never reached its second node"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    let _ = child.wait();
    // A second stepper refuses while the lock is live, then resumes once it expired.
    let (code, out) = rollout(&e, &[]);
    assert!(
        code == 2 && out.contains("another rollout holds the lock"),
        "{code}: {out}"
    );
    std::thread::sleep(Duration::from_millis(3500));
    let (code, out) = rollout(&e, &[]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("resuming the rollout interrupted at node"),
        "{out}"
    );
    let d = deletions_since(&e, from);
    assert_eq!(
        counts(&d).values().copied().collect::<Vec<_>>(),
        [1, 1, 1],
        "no node twice: {d:?}\n{out}"
    );
    assert!(all_on(&e, "rev3"));

    // A revision change mid-rollout: the node already stepped to the superseded revision is
    // stepped again.
    let from = e.kube.world.lock().unwrap().deletions.len();
    {
        let mut w = e.kube.world.lock().unwrap();
        w.bump_revision(); // rev4
        w.bump_after = Some(w.replacements + 1); // rev5 right after the first replacement
    }
    let (code, out) = rollout(&e, &[]);
    assert_eq!(code, 0, "{out}");
    let d = deletions_since(&e, from);
    assert_eq!(d.len(), 4, "{d:?}\n{out}");
    assert_eq!(
        counts(&d)[&d[0]],
        2,
        "the first node is stepped again: {d:?}"
    );
    assert!(all_on(&e, "rev5"));

    // A fault on the second node (its endpoint map comes back empty): the rollout stops there,
    // exit 1, and the third node is untouched.
    let from = e.kube.world.lock().unwrap().deletions.len();
    e.kube.world.lock().unwrap().bump_revision(); // rev6
    *e.fault_at.lock().unwrap() = Some(from + 2);
    let (code, out) = rollout(&e, &[]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("map_emptied"), "{out}");
    let d = deletions_since(&e, from);
    assert_eq!(d.len(), 2, "stopped at the second node: {d:?}\n{out}");
    let w = e.kube.world.lock().unwrap();
    let untouched: Vec<_> = w.pods.values().filter(|p| p.2 != "rev6").collect();
    assert_eq!(untouched.len(), 1, "{:?}", w.pods);
    assert!(
        !d.contains(&untouched[0].1),
        "the third node was not touched"
    );
    assert!(w
        .events
        .iter()
        .any(|e| e["reason"] == "StepguardStepFailed"));
    drop(w);
}
