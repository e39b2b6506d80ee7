//! stepguard against the **real cilium-agent**: a lab node runs cilium-agent 1.20
//! built from its Go module (`cargo xtask cilium`), against the lab's real control plane, in
//! its own network, mount and cgroup namespaces (`stepguard_lab::real`). The checks must
//! pass on the healthy node with the agent's own devices, programs, maps and config keys as
//! evidence, and its restarts — SIGTERM as the kubelet sends it, and SIGKILL — must be seen
//! and verified as implicit steps with no false alarm.
//!
//! `STEPGUARD_REAL_RESTARTS` (alternating SIGTERM and SIGKILL; 10 when unset) sets how many
//! restarts the restart test makes: `cargo xtask test` runs two (CI's budget), `cargo xtask
//! test --real-extended` ten (TESTING.md).
mod common;
use common::real::*;
use common::*;
use serde_json::Value;
use std::process::Command;
use std::time::{Duration, Instant};

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
        let (_, svc) = stepguard_lab::real::api_get(&node.agent_socket(), "/v1/service").unwrap();
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
    let (_, eps) = stepguard_lab::real::api_get(&node.agent_socket(), "/v1/endpoint").unwrap();
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

#[test]
fn real_restarts_pass_as_implicit_steps_with_no_false_alarm() {
    let restarts: usize = std::env::var("STEPGUARD_REAL_RESTARTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let mut node = Kept(real_node_with_pods(true), "restarts");
    let agent = real_agent_on(&node);

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
