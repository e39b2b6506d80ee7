//! Helpers for the tests that run the real cilium-agent on a lab node (`real_*.rs`).
use super::*;
use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};
use stepguard_lab::real::pods::Workload;
use stepguard_lab::real::{RealGuard, RealNode, RealSpec, Release};

pub fn real_node_on(minor: &str, tunnel: bool) -> RealGuard {
    require_root();
    let release = Release::from_env(minor).expect("the real cilium-agent");
    let kube_bin = PathBuf::from(std::env::var("STEPGUARD_KUBE_BIN").expect(
        "STEPGUARD_KUBE_BIN: the control plane's binaries (`cargo xtask kube`; `cargo xtask test` sets it)",
    ));
    let t0 = Instant::now();
    let node = RealNode::up(RealSpec {
        prefix: stepguard_lab::unique_prefix(),
        release,
        kube_bin,
        tunnel,
        member: None,
    })
    .expect("a lab node with the real cilium-agent");
    eprintln!(
        "real node {} up in {:.1}s (cilium-agent {})",
        node.state.spec.prefix,
        t0.elapsed().as_secs_f64(),
        node.state.spec.release.version
    );
    stepguard_lab::sys::fixture::Guard(node)
}

pub fn real_node_routed(tunnel: bool) -> RealGuard {
    real_node_on("1.20", tunnel)
}

/// Makes the lab's pods through `cilium-cni` (two nginx, one dnsmasq) and the Services over
/// them (ClusterIP, a LoadBalancer with a hand-set ingress IP, DNS).
pub fn add_pods(node: &mut RealNode) {
    let t0 = Instant::now();
    for (name, w) in [
        ("web-0", Workload::Web),
        ("web-1", Workload::Web),
        ("dns-0", Workload::Dns),
    ] {
        let p = node.add_pod(name, w).expect("a pod through CNI ADD");
        eprintln!("pod {name}: {} (CNI ADD)", p.ip);
    }
    node.add_services()
        .expect("the Services, served by the agent");
    eprintln!("pods and Services up in {:.1}s", t0.elapsed().as_secs_f64());
}

/// A real node (1.20) with the lab's pods and Services.
pub fn real_node_with_pods(tunnel: bool) -> RealGuard {
    let mut node = real_node_routed(tunnel);
    add_pods(&mut node);
    node
}

/// Keeps the agent's log past the node's removal: `target/real-cilium/<test>.log`.
pub fn keep_log(node: &RealNode, test: &str) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/real-cilium");
    let _ = std::fs::create_dir_all(&dir);
    let to = dir.join(format!("{test}.log"));
    match std::fs::copy(node.agent_log(), &to) {
        Ok(_) => eprintln!("the cilium-agent's log: {}", to.display()),
        Err(e) => eprintln!("could not keep the cilium-agent's log: {e}"),
    }
}

/// Takes the node down at the end of a test (also when it panics), keeping the agent's log.
pub struct Kept(pub RealGuard, pub &'static str);
impl Drop for Kept {
    fn drop(&mut self) {
        keep_log(&self.0, self.1);
    }
}
impl std::ops::Deref for Kept {
    type Target = RealNode;
    fn deref(&self) -> &RealNode {
        &self.0
    }
}
impl std::ops::DerefMut for Kept {
    fn deref_mut(&mut self) -> &mut RealNode {
        &mut self.0
    }
}

/// `stepguard check --format json` on the node (its network namespace and cgroup).
pub fn check_real(node: &RealNode, config: &std::path::Path) -> (i32, Value, String) {
    check_real_with(node, config, &[])
}

/// `stepguard check --format json` with `extra` arguments on the node.
pub fn check_real_with(
    node: &RealNode,
    config: &std::path::Path,
    extra: &[&str],
) -> (i32, Value, String) {
    let out = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", node.node_ns()))
        .arg("--")
        .args(node.in_node_cgroup())
        .arg(bin("STEPGUARD_BIN", "stepguard"))
        .args(["check", "--format", "json", "--config"])
        .arg(config)
        .args(extra)
        .output()
        .expect("run stepguard check");
    (
        out.status.code().unwrap_or(-1),
        serde_json::from_slice(&out.stdout).unwrap_or(Value::Null),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// stepguard's agent on the node (its network namespace and cgroup), with the node's config.
pub fn real_agent_on(node: &RealNode) -> AgentProc {
    real_agent_with(node, "")
}

/// stepguard's agent on the node, with the node's config and `extra` YAML appended.
pub fn real_agent_with(node: &RealNode, extra: &str) -> AgentProc {
    let cfg = node.write_stepguard_config().unwrap();
    if !extra.is_empty() {
        let mut text = std::fs::read_to_string(&cfg).unwrap();
        text.push_str(extra);
        std::fs::write(&cfg, text).unwrap();
    }
    let wrapper = node.in_node_cgroup();
    let wrapper: Vec<&str> = wrapper.iter().map(String::as_str).collect();
    AgentProc::start_wrapped(
        node.node_ns(),
        cfg,
        node.state.run_dir.join("stepguard-state"),
        free_port(),
        &[],
        &wrapper,
    )
}

/// Waits (bounded) for a decided implicit step other than those in `seen`; returns it.
pub fn implicit_verdict(agent: &AgentProc, seen: &[String]) -> Value {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let (_, list) = agent.get_json("/v1/steps");
        let found = list["steps"].as_array().and_then(|a| {
            a.iter()
                .find(|s| {
                    s["origin"] == "implicit"
                        && !seen.iter().any(|x| Some(x.as_str()) == s["id"].as_str())
                })
                .cloned()
        });
        if let Some(s) = found {
            return agent.verdict(s["id"].as_str().unwrap());
        }
        assert!(Instant::now() < deadline, "no implicit step: {list}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The id of the program behind the agent's pinned tcx link for `program` on `dev`, as
/// bpftool reads the pin (`<bpffs>/cilium/devices/<dev>/links/<program>`).
pub fn pinned_link_program(node: &RealNode, dev: &str, program: &str) -> u64 {
    let pin = node
        .state
        .bpffs
        .join("cilium/devices")
        .join(dev)
        .join("links")
        .join(program);
    let v = bpftool_json(&["link", "show", "pinned", &pin.display().to_string()]);
    v["prog_id"]
        .as_u64()
        .unwrap_or_else(|| panic!("bpftool link show pinned {}: {v}", pin.display()))
}

/// A real-agent cluster, taken down at the end of a test (also when it panics) after its
/// agents' logs are kept (`target/real-cilium/<test>-node<i>.log`).
pub struct KeptCluster(
    pub stepguard_lab::real::cluster::ClusterGuard,
    pub &'static str,
);
impl Drop for KeptCluster {
    fn drop(&mut self) {
        for (i, n) in self.0.nodes.iter().enumerate() {
            keep_log(n, &format!("{}-node{i}", self.1));
        }
    }
}
impl std::ops::Deref for KeptCluster {
    type Target = stepguard_lab::real::cluster::RealCluster;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}
impl std::ops::DerefMut for KeptCluster {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

/// A cluster of `nodes` real-agent nodes (1.20) on one LAN, announcing its VIP with Cilium's
/// default lease timings (15 s, 5 s, 2 s: what the users run).
pub fn real_cluster(nodes: u8, test: &'static str) -> KeptCluster {
    real_cluster_with(nodes, test, stepguard_lab::lan::LeaseTimings::default())
}

/// A cluster of `nodes` real-agent nodes with the lease timings `lease` in its ConfigMap.
pub fn real_cluster_with(
    nodes: u8,
    test: &'static str,
    lease: stepguard_lab::lan::LeaseTimings,
) -> KeptCluster {
    use stepguard_lab::real::cluster::{ClusterSpec, RealCluster};
    require_root();
    let release = Release::from_env("1.20").expect("the real cilium-agent");
    let kube_bin = PathBuf::from(std::env::var("STEPGUARD_KUBE_BIN").expect(
        "STEPGUARD_KUBE_BIN: the control plane's binaries (`cargo xtask kube`; `cargo xtask test` sets it)",
    ));
    let t0 = Instant::now();
    let c = RealCluster::up(ClusterSpec {
        prefix: stepguard_lab::unique_prefix(),
        release,
        kube_bin,
        nodes,
        lease,
    })
    .expect("a cluster of real-agent nodes announcing a VIP");
    eprintln!(
        "real cluster {} of {nodes} nodes up in {:.1}s; the VIP's lease holder: node {:?}",
        c.state.spec.prefix,
        t0.elapsed().as_secs_f64(),
        c.holder().unwrap()
    );
    KeptCluster(stepguard_lab::sys::fixture::Guard(c), test)
}
