//! `stepguard rollout` over **real cilium-agents**: a cluster of three lab
//! nodes each running the real cilium-agent 1.20 (`stepguard_lab::real::cluster`), the real
//! API server, DaemonSet and Deployment controllers and scheduler, the shipped manifests
//! (`deploy/base`, `deploy/rollout`), Cilium's DaemonSet as the chart renders it with
//! `updateStrategy: OnDelete`, and the lab kubelet: when the stepper deletes a node's cilium
//! pod, the kubelet keeps it Terminating for its grace period while the lab restarts **that
//! node's real agent** (SIGTERM, the chart's 1 s grace, then a new agent), and reports the
//! replacement Ready once the agent is ready again. stepguard's agent on each node verifies
//! its node's step against the real restart; the stepper, a LAN client, reads each verdict.
//! The plan names what will blip from the lease timings the agents run with (not
//! Cilium's defaults, so the numbers show they were read), and the summary puts it beside what
//! a witness on the LAN measured in the holder's step.
//!
//! It runs with `cargo xtask test --real-extended` (three real agents; beyond CI's budget,
//! TESTING.md); a plain `cargo xtask test` lists it as ignored.
mod common;
use common::cluster::*;
use common::real::*;
use common::*;

use k8s_openapi::api::core::v1::Pod;
use serde_json::Value;
use std::collections::BTreeMap;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use stepguard_lab::kube::kubelet::Kubelet;
use stepguard_lab::kube::{Forward, Kube};
use stepguard_lab::real::cluster::{node_lan_addr, LAN_CLIENT};

const CILIUM_IMAGE: &str = "quay.io/cilium/cilium:v1.20.2@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
const OPERATOR_IMAGE: &str = "quay.io/cilium/operator-generic:v1.20.2@sha256:fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210";
const NODES: u8 = 3;

fn node_name(i: u8) -> String {
    format!("lab-node-{i}")
}

/// Every node runs one Ready cilium pod of revision `rev`, none terminating.
fn all_on(k: &Kube, rev: &str) -> bool {
    let pods = cilium_pods_in(k);
    pods.len() == usize::from(NODES)
        && pods
            .values()
            .all(|(_, h, ready, term)| h == rev && *ready && !*term)
}

fn stepguard_pods_running(k: &Kube) -> usize {
    let lp = kube::api::ListParams::default().labels("app.kubernetes.io/name=stepguard");
    let pods = k.block(k.ns::<Pod>("stepguard").list(&lp)).unwrap();
    pods.items
        .iter()
        .filter(|p| p.status.as_ref().and_then(|s| s.pod_ip.as_ref()).is_some())
        .count()
}

fn operator_ready(k: &Kube) -> i32 {
    k.block(
        k.ns::<k8s_openapi::api::apps::v1::Deployment>(KS)
            .get("cilium-operator"),
    )
    .ok()
    .and_then(|d| d.status?.ready_replicas)
    .unwrap_or(0)
}

fn rollout(client_ns: &str, kubeconfig: &std::path::Path, extra: &[&str]) -> (i32, String) {
    let out = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{client_ns}"))
        .arg("--")
        .arg(bin("STEPGUARD_BIN", "stepguard"))
        .arg("rollout")
        // The lock's default duration: three real agents compiling their datapaths on two
        // cores slow the API server past a 3 s lock's 2 s renew deadline (measured).
        .args([
            "--settle",
            "2s",
            "--step-timeout",
            "120s",
            "--replace-timeout",
            "120s",
        ])
        .args(extra)
        .env("KUBECONFIG", kubeconfig)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run stepguard rollout");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

/// The steps stepguard's agent on a node decided: (origin, status, the targets with a gap)
/// of each; each step's record is kept in `target/real-cilium/<name>-<id>.json`.
fn steps_of(agent: &AgentProc, name: &str) -> Vec<(String, String, Vec<String>)> {
    let (_, list) = agent.get_json("/v1/steps");
    list["steps"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|s| {
            let id = s["id"].as_str().unwrap_or_default().to_string();
            let v: Value = agent.get_json(&format!("/v1/steps/{id}")).1;
            let dir = repo_root().join("target/real-cilium");
            let _ = std::fs::create_dir_all(&dir);
            let _ = std::fs::write(
                dir.join(format!("{name}-{id}.json")),
                serde_json::to_vec_pretty(&v).unwrap_or_default(),
            );
            (
                s["origin"].as_str().unwrap_or_default().to_string(),
                v["verdict"]["status"]
                    .as_str()
                    .unwrap_or("none")
                    .to_string(),
                v["gaps"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|g| g["count"] != 0)
                    .map(|g| g.to_string())
                    .collect(),
            )
        })
        .collect()
}

#[test]
#[ignore = "three real cilium-agents: run with `cargo xtask test --real-extended`"]
fn the_stepper_walks_a_real_agent_cluster_one_verified_node_at_a_time() {
    // Lease timings other than Cilium's defaults, so the plan's numbers show they were read.
    let lease = stepguard_lab::lan::LeaseTimings {
        duration: Duration::from_secs(6),
        renew: Duration::from_secs(3),
        retry: Duration::from_secs(1),
    };
    let c = Arc::new(Mutex::new(real_cluster_with(NODES, "real_rollout", lease)));
    let (cp, client_ns) = {
        let g = c.lock().unwrap();
        (g.control_plane().clone(), g.client_ns())
    };
    let admin = cp.admin_kubeconfig();
    apply_shipped_manifests(&cp);
    let k = Kube::connect(&admin).expect("admin client");
    // Cilium as its chart renders it, with the lease timings above in cilium-config.
    let dir = std::env::temp_dir().join(format!("sg-real-rollout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    install_cilium(
        &cp,
        &dir,
        &cilium_values(CILIUM_IMAGE, OPERATOR_IMAGE, &lease, &[]),
        &[],
        true,
    );

    // A deleted cilium pod restarts that node's real agent: SIGTERM with the chart's 1 s
    // grace, then a new agent, ready (API healthy, datapath attached, endpoints regenerated).
    let restarts: Arc<Mutex<Vec<String>>> = Arc::default();
    let restart = {
        let (c, restarts) = (c.clone(), restarts.clone());
        Arc::new(move |node: &str, nth: usize| {
            let i: usize = node.trim_start_matches("lab-node-").parse().unwrap();
            let mut g = c.lock().unwrap();
            let n = &mut g.nodes[i];
            let exited = n
                .stop_agent(libc::SIGTERM, Duration::from_secs(1))
                .expect("stop the agent");
            n.start_agent().expect("start the agent");
            let r = n
                .wait_ready(Duration::from_secs(180))
                .expect("the agent ready again");
            let row = format!(
                "deletion {nth}: {node}'s cilium-agent exited in {:.2}s; API healthy {:.1}s and ready {:.1}s after its start",
                exited.as_secs_f64(),
                r.api.as_secs_f64(),
                r.ready.as_secs_f64()
            );
            eprintln!("the lab kubelet: {row}");
            restarts.lock().unwrap().push(row);
        })
    };
    let nodes: BTreeMap<String, String> = (0..NODES)
        .map(|i| (node_name(i), node_lan_addr(i).to_string()))
        .collect();
    let kubelet = Kubelet::start(&admin, nodes, restart, None).expect("lab kubelet");
    // A witness on the LAN, which every step names: the measured blip beside the expected.
    let witness = {
        let g = c.lock().unwrap();
        common::witness::Witness::start_in(
            &g.client_ns(),
            &g.witness_config(),
            &format!(
                "{LAN_CLIENT}:{}",
                stepguard_lab::real::cluster::WITNESS_PORT
            ),
            1,
            &["--probe-interval", "100ms"],
        )
    };

    // stepguard's agent on every node, at the node's address (its pod's, host network).
    let agents: Vec<AgentProc> = (0..NODES)
        .map(|i| {
            let g = c.lock().unwrap();
            let n = &g.nodes[usize::from(i)];
            let cfg = n.write_stepguard_config().unwrap();
            let wrapper = n.in_node_cgroup();
            let wrapper: Vec<&str> = wrapper.iter().map(String::as_str).collect();
            AgentProc::start_at(
                n.node_ns(),
                cfg,
                n.state.run_dir.join("stepguard-state"),
                std::net::SocketAddr::new(node_lan_addr(i).into(), 9969),
                &[],
                &wrapper,
            )
        })
        .collect();
    // The stepper is a LAN client; the API server is forwarded to it.
    let server: std::net::SocketAddr = cp.server.trim_start_matches("https://").parse().unwrap();
    let forward = Forward::start(&client_ns, &LAN_CLIENT.to_string(), server)
        .expect("forward the API server into the LAN");
    let kubeconfig = cp
        .stepper_kubeconfig(&format!("https://{}", forward.addr))
        .unwrap();

    wait_until(
        "the controller's first revision",
        Duration::from_secs(30),
        || observed(&k) && revision_now(&k).is_some(),
        String::new,
    );
    let first = current_revision(&k).0;
    wait_until(
        "a Ready cilium pod on every node, stepguard on every node, the operator Ready",
        Duration::from_secs(90),
        || all_on(&k, &first) && stepguard_pods_running(&k) == 3 && operator_ready(&k) == 2,
        || format!("{:?}", cilium_pods_in(&k)),
    );
    let pids: Vec<i32> = {
        let g = c.lock().unwrap();
        g.nodes
            .iter()
            .map(|n| n.state.agent.as_ref().unwrap().pid)
            .collect()
    };
    let holder = c.lock().unwrap().holder().unwrap().expect("a lease holder");

    // A new template (its image digest unchanged: the agents run what they ran).
    let target = set_template(&k, 1, false);
    assert_ne!(target, first);
    let (code, out) = rollout(&client_ns, &kubeconfig, &["--dry-run"]);
    eprintln!("--- stepguard rollout --dry-run ---\n{out}");
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("3 of 3 nodes to step"), "{out}");
    // The real agents' lease, read by the stepper: the holder's step moves the VIP.
    let holder_line = out
        .lines()
        .find(|l| l.contains(&node_name(holder)) && l.contains("moves L2 VIPs"))
        .unwrap_or_else(|| panic!("the plan names {}'s L2 VIP: {out}", node_name(holder)));
    assert!(holder_line.contains("web-lan"), "{holder_line}");
    // What will blip, from the timings the agents run with (the ConfigMap's 1 s retry, the
    // lease's 6 s, the chart's 1 s grace): 1 × 2.2 s, and 6 − 1 to 6 + 2 × 2.2 s.
    let expected = "up to 2.2s for a client resolving it meanwhile; 5.0-10.4s if the lease is not released within the 1s grace (lease 6s, retry 1s: kube-system/cilium-config)";
    assert!(out.contains(expected), "{out}");

    let t0 = Instant::now();
    let (code, out) = rollout(&client_ns, &kubeconfig, &["--witness", &witness.url]);
    eprintln!(
        "--- stepguard rollout ({:.1}s) ---\n{out}",
        t0.elapsed().as_secs_f64()
    );
    for r in restarts.lock().unwrap().iter() {
        eprintln!("{r}");
    }
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("3 nodes stepped and verified"), "{out}");
    // The summary: the holder's expected blip beside the witness's measurement, which is the
    // expected "none": the witness had resolved the VIP, and the old holder forwards it until
    // the takeover's gratuitous ARP.
    let row = out
        .lines()
        .find(|l| l.contains(expected) && l.contains("measured: as a LAN client sees it"))
        .unwrap_or_else(|| panic!("the expected beside the measured: {out}"));
    let measured_ms: f64 = row
        .split("web-lan ")
        .nth(1)
        .and_then(|r| r.split('±').next())
        .and_then(|m| m.trim_end_matches("ms").parse().ok())
        .unwrap_or_else(|| panic!("the witness's web-lan gap in {row}"));
    assert_eq!(measured_ms, 0.0, "no outage for a resolved client: {row}");
    // Each node's cilium pod deleted once, each real agent restarted once (a new process).
    let deletions = kubelet.state.lock().unwrap().deletions.clone();
    let mut once: Vec<String> = deletions.clone();
    once.sort();
    once.dedup();
    assert_eq!(
        (deletions.len(), once.len()),
        (3, 3),
        "each node once: {deletions:?}"
    );
    assert!(kubelet.wait_idle(Duration::from_secs(30)));
    {
        let mut g = c.lock().unwrap();
        for (i, n) in g.nodes.iter_mut().enumerate() {
            assert!(n.agent_running(), "node {i}'s agent runs");
            assert_ne!(
                n.state.agent.as_ref().unwrap().pid,
                pids[i],
                "node {i}'s agent was restarted"
            );
        }
    }
    // Each node's step was verified by its own stepguard agent, against its real restart.
    for (i, a) in agents.iter().enumerate() {
        let steps = steps_of(a, &format!("real_rollout-node{i}"));
        let explicit: Vec<_> = steps.iter().filter(|s| s.0 != "implicit").collect();
        assert_eq!(
            explicit.len(),
            1,
            "node {i}: one step by the stepper: {steps:?}"
        );
        assert_eq!(explicit[0].1, "passed", "node {i}: {steps:?}");
        // A real restart drops nothing on the node's way to the fabric (its servers stand for
        // other machines: `services::realtime`).
        assert!(
            explicit[0].2.is_empty(),
            "node {i}: no gap: {:?}",
            explicit[0].2
        );
    }
    assert!(all_on(&k, &target), "{:?}", cilium_pods_in(&k));
    let g = c.lock().unwrap();
    wait_until(
        "the VIP answering the LAN client",
        Duration::from_secs(30),
        || g.client_get_ok().unwrap_or(false),
        String::new,
    );
    drop(g);
    drop(forward);
    drop(kubelet);
}
