//! stepguard against the **real cilium-agent** (issue 30): a lab node runs cilium-agent 1.20
//! built from its Go module (`cargo xtask cilium`), against the lab's real control plane, in
//! its own network, mount and cgroup namespaces (`stepguard_lab::realnode`). The checks must
//! pass on the healthy node with the agent's own devices, programs, maps and config keys as
//! evidence, and its restarts — SIGTERM as the kubelet sends it, and SIGKILL — must be seen
//! and verified as implicit steps with no false alarm.
//!
//! `STEPGUARD_REAL_RESTARTS` (default 10, alternating SIGTERM and SIGKILL) sets how many restarts the
//! restart test makes; issue 30 asks for ten, run as
//! `STEPGUARD_REAL_RESTARTS=10 cargo xtask test --filter real_restarts` (README, "Tests").
mod common;
use common::*;
use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};
use stepguard_lab::realnode::{RealGuard, RealNode, RealSpec, Release};
use stepguard_lab::realpods::Workload;

fn real_node() -> RealGuard {
    real_node_routed(true)
}

fn real_node_routed(tunnel: bool) -> RealGuard {
    require_root();
    let release = Release::from_env("1.20").expect("the real cilium-agent 1.20");
    let kube_bin = PathBuf::from(std::env::var("STEPGUARD_KUBE_BIN").expect(
        "STEPGUARD_KUBE_BIN: the control plane's binaries (`cargo xtask kube`; `cargo xtask test` sets it)",
    ));
    let t0 = Instant::now();
    let node = RealNode::up(RealSpec {
        prefix: stepguard_lab::unique_prefix(),
        release,
        kube_bin,
        tunnel,
    })
    .expect("a lab node with the real cilium-agent");
    eprintln!(
        "real node {} up in {:.1}s (cilium-agent {})",
        node.state.spec.prefix,
        t0.elapsed().as_secs_f64(),
        node.state.spec.release.version
    );
    RealGuard(node)
}

/// A real node with pods made through `cilium-cni` (two nginx, one dnsmasq) and the Services
/// over them (ClusterIP, a LoadBalancer with a hand-set ingress IP, DNS).
fn real_node_with_pods(tunnel: bool) -> RealGuard {
    let mut node = real_node_routed(tunnel);
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
    node
}

/// Keeps the agent's log past the node's removal: `target/real-cilium/<test>.log`.
fn keep_log(node: &RealNode, test: &str) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/real-cilium");
    let _ = std::fs::create_dir_all(&dir);
    let to = dir.join(format!("{test}.log"));
    match std::fs::copy(node.agent_log(), &to) {
        Ok(_) => eprintln!("the cilium-agent's log: {}", to.display()),
        Err(e) => eprintln!("could not keep the cilium-agent's log: {e}"),
    }
}

/// Takes the node down at the end of a test (also when it panics), keeping the agent's log.
struct Kept(RealGuard, &'static str);
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

/// `stepguard check --format json` on the node (its network namespace and cgroup) with its
/// config.
fn check_real(node: &RealNode, config: &std::path::Path) -> (i32, Value, String) {
    let out = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", node.node_ns()))
        .arg("--")
        .args(node.in_node_cgroup())
        .arg(bin("STEPGUARD_BIN", "stepguard"))
        .args(["check", "--format", "json", "--config"])
        .arg(config)
        .output()
        .expect("run stepguard check");
    (
        out.status.code().unwrap_or(-1),
        serde_json::from_slice(&out.stdout).unwrap_or(Value::Null),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The id of the program behind the agent's pinned tcx link for `program` on `dev`, as
/// bpftool reads the pin (`<bpffs>/cilium/devices/<dev>/links/<program>`).
fn pinned_link_program(node: &RealNode, dev: &str, program: &str) -> u64 {
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

#[test]
fn a_healthy_real_node_passes_every_check_with_the_agents_own_evidence() {
    healthy(true);
}

/// The second routing mode: native routing (no overlay device, no overlay programs).
#[test]
fn a_healthy_real_node_in_native_routing_passes_every_check() {
    healthy(false);
}

fn healthy(tunnel: bool) {
    let node = Kept(
        real_node_with_pods(tunnel),
        if tunnel { "healthy" } else { "healthy-native" },
    );
    // The socket-LB is the node's own: attached to its cgroup, to nothing outside it.
    let outside = node.cgroup_attachments_outside().unwrap();
    assert!(outside.is_empty(), "attached outside the node: {outside:?}");
    let mine = node.cgroup_attachments().unwrap();
    assert!(
        mine.contains("cil_sock4_connect"),
        "kube-proxy replacement's socket-LB on the node's cgroup: {mine}"
    );

    let cfg = node.write_stepguard_config().unwrap();
    let (code, v, err) = check_real(&node, &cfg);
    if code != 0 {
        let dig = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", node.node_ns()))
            .arg("--")
            .args(node.in_node_cgroup())
            .args([
                "dig",
                "+tries=1",
                "+time=1",
                "@198.51.100.54",
                "web.lab.stepguard.test",
            ])
            .output()
            .unwrap();
        eprintln!(
            "dig from the node: {}",
            String::from_utf8_lossy(&dig.stdout)
        );
        let (_, svc) =
            stepguard_lab::realnode::api_get(&node.agent_socket(), "/v1/service").unwrap();
        eprintln!("the agent's services: {svc}");
        for args in [
            &["route", "show", "table", "all"][..],
            &["rule"][..],
            &["addr"][..],
        ] {
            let out = Command::new("ip")
                .args(["-n", &node.node_ns()])
                .args(args)
                .output()
                .unwrap();
            eprintln!(
                "ip {args:?} in the node:\n{}",
                String::from_utf8_lossy(&out.stdout)
            );
        }
    }
    eprintln!("stepguard check on the real node:\n{v:#}\n{err}");
    assert_eq!(
        code, 0,
        "every check passes on a healthy real node: {v:#}\n{err}"
    );
    for c in ["devices", "maps", "vips", "dns", "config"] {
        assert_eq!(result(&v, c)["status"], "pass", "{c}: {}", result(&v, c));
    }
    // Devices: the ones the agent selected, with the program ids the kernel shows.
    let dev = &result(&v, "devices")["evidence"];
    assert_eq!(
        dev["selected"],
        serde_json::json!(["eth0", "eth1"]),
        "{dev}"
    );
    for d in ["eth0", "eth1"] {
        let want = pinned_link_program(&node, d, "cil_from_netdev");
        let e = dev["devices"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["device"] == d)
            .unwrap_or_else(|| panic!("{d} in the evidence: {dev}"));
        let p = e["programs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["hook"] == "ingress")
            .unwrap_or_else(|| panic!("{d}'s ingress program: {e}"));
        assert_eq!(p["prog_id"].as_u64(), Some(want), "{d}: {e}");
        assert_eq!(p["via"], "tcx", "{d}: {e}");
    }
    // The overlay device exists, with its programs, only in tunnel routing.
    let has_overlay = dev["devices"]
        .as_array()
        .unwrap()
        .iter()
        .any(|x| x["device"] == "cilium_vxlan");
    assert_eq!(has_overlay, tunnel, "cilium_vxlan in the evidence: {dev}");
    // Maps: the release's profile, inferred from what the agent pinned.
    let maps = &result(&v, "maps")["evidence"];
    assert_eq!(maps["cilium"], "1.20", "{maps}");
    assert_eq!(maps["features"]["tunnel"], tunnel, "{maps}");
    assert_eq!(
        maps["features"]["snat"], true,
        "kube-proxy replacement: {maps}"
    );
    let names: Vec<&str> = maps["maps"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["name"].as_str())
        .collect();
    for m in ["cilium_lxc", "cilium_ipcache_v2", "cilium_lb4_services_v2"] {
        assert!(names.contains(&m), "{m} among {names:?}");
    }
    // VIPs: the fabric's, and the Services' through Cilium's own service maps and socket-LB.
    let vips = result(&v, "vips").to_string();
    for t in ["gateway", "dns", "web-clusterip", "web-lb", "dns-svc"] {
        assert!(vips.contains(&format!("\"{t}\"")), "{t} probed: {vips}");
    }
    // Endpoints: the pods the agent made through CNI, ready, with their programs.
    let (_, eps) = stepguard_lab::realnode::api_get(&node.agent_socket(), "/v1/endpoint").unwrap();
    let eps: Value = serde_json::from_str(&eps).unwrap();
    for p in node.pods() {
        assert!(
            eps.as_array()
                .unwrap()
                .iter()
                .any(|e| e.to_string().contains(&p.ip.to_string())
                    && e["status"]["state"] == "ready"),
            "pod {} ({}) is a ready endpoint: {eps}",
            p.name,
            p.ip
        );
    }
    // Config: what the running agent loaded, by key, against the mounted ConfigMap.
    let config = result(&v, "config").to_string();
    for key in ["kube-proxy-replacement", "routing-mode", "devices"] {
        assert!(
            config.contains(key),
            "{key} in the config evidence: {config}"
        );
    }
}

/// Waits (bounded) for a decided implicit step other than those in `seen`; returns it.
fn implicit_verdict(agent: &Daemon, seen: &[String]) -> Value {
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

#[test]
fn real_restarts_pass_as_implicit_steps_with_no_false_alarm() {
    let restarts: usize = std::env::var("STEPGUARD_REAL_RESTARTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let mut node = Kept(real_node_with_pods(true), "restarts");
    let cfg = node.write_stepguard_config().unwrap();
    let wrapper = node.in_node_cgroup();
    let wrapper: Vec<&str> = wrapper.iter().map(String::as_str).collect();
    let agent = Daemon::start_wrapped(
        node.node_ns(),
        cfg,
        node.state.run_dir.join("stepguard-state"),
        free_port(),
        &[],
        &wrapper,
    );
    // A steady snapshot first (the agent polls every 250 ms).
    std::thread::sleep(Duration::from_secs(3));
    let mut seen = Vec::new();
    let mut rows = Vec::new();
    for i in 0..restarts {
        let (sig, name) = if i % 2 == 0 {
            (libc::SIGTERM, "SIGTERM")
        } else {
            (libc::SIGKILL, "SIGKILL")
        };
        // What the restart looks like from outside, sampled every 10 ms from the signal on.
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let t0 = Instant::now();
        let sampler = {
            let (s, stop) = (node.sampler(), stop.clone());
            std::thread::spawn(move || s.timeline(t0, Duration::from_millis(10), &stop))
        };
        let exited = node.stop_agent(sig, Duration::from_secs(30)).unwrap();
        let started = t0.elapsed();
        node.start_agent().unwrap();
        let ready = node.wait_ready(Duration::from_secs(240)).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let timeline = sampler.join().unwrap();
        let v = implicit_verdict(&agent, &seen);
        seen.push(v["id"].as_str().unwrap().to_string());
        assert_eq!(
            v["verdict"]["status"], "passed",
            "restart {i} ({name}): {v:#}"
        );
        let trigger = v["trigger"].as_str().unwrap_or("").to_string();
        assert!(!trigger.is_empty(), "the trigger is named: {v:#}");
        let gaps: Vec<String> = v["gaps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| {
                format!(
                    "{}: {} gaps, longest {}",
                    g["target"], g["count"], g["longest"]
                )
            })
            .collect();
        let row = format!(
            "restart {i} ({name}): exited in {:.2}s; API healthy {:.1}s and endpoints regenerated {:.1}s after start; trigger {trigger:?}; {}",
            exited.as_secs_f64(),
            ready.api.as_secs_f64(),
            ready.ready.as_secs_f64(),
            gaps.join("; ")
        );
        let timeline: Vec<String> = timeline
            .iter()
            .map(|(t, what)| format!("{:+.2}s {what}", t - started.as_secs_f64()))
            .collect();
        let row = format!(
            "{row}\n    from the start (signal at {:+.2}s): {}",
            -started.as_secs_f64(),
            timeline.join(", ")
        );
        eprintln!("{row}");
        rows.push(row);
    }
    let (_, m) = agent.get("/metrics");
    assert!(
        m.contains(&format!(
            "stepguard_steps_total{{verdict=\"passed\",origin=\"implicit\"}} {restarts}"
        )),
        "every restart passed, none failed: {}",
        m.lines()
            .filter(|l| l.starts_with("stepguard_steps_total"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    eprintln!("{}", rows.join("\n"));
}
