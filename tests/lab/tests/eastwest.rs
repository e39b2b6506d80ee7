//! East-west targets against a multi-node lab (issue 25): the LAN lab's nodes reach each
//! other's pods over the overlay (`cilium_vxlan`), each has a health endpoint (HTTP on 4240,
//! as cilium-health answers), and every node's agent probes the other nodes' health
//! endpoints as east-west targets beside its VIPs, which local backends answer.
mod common;
use common::*;
use serde_json::Value;
use stepguard_lab::lan::{LanGuard, LanLab, LanSpec};
use stepguard_lab::RestartOpts;

fn lan(nodes: u8) -> LanGuard {
    require_root();
    let mut spec = LanSpec::new(stepguard_lab::unique_prefix());
    spec.nodes = nodes;
    spec.east_west = true;
    LanGuard(LanLab::up(spec).expect("LAN lab up"))
}

fn gap<'a>(v: &'a Value, target: &str) -> &'a Value {
    v["gaps"]
        .as_array()
        .and_then(|g| g.iter().find(|g| g["target"] == target))
        .unwrap_or_else(|| panic!("no gap row for {target}: {}", v["gaps"]))
}

const STEP: &str = r#"{"settle": "2s", "timeout": "30s", "max_gap": "1s"}"#;

/// The restart loses the node's tunnel entries to the other nodes: its VIPs (local
/// backends) still answer without a single lost probe, but the east-west target — the other
/// node's health endpoint through the overlay — does not, and the step fails naming it. An
/// agent before this issue had no east-west target and passed such a restart.
#[test]
fn an_overlay_broken_by_the_restart_fails_the_east_west_target_while_the_vips_answer() {
    let mut lab = lan(2);
    let agent = agent_on(&lab, 0);
    let id = agent.begin_probing(STEP);
    lab.restart(
        0,
        &RestartOpts {
            down: std::time::Duration::from_millis(200),
            break_overlay: true,
            ..Default::default()
        },
        false,
    )
    .unwrap();
    let v = agent.verdict(&id);
    assert_eq!(v["verdict"]["status"], "failed", "{v:#}");
    assert_eq!(
        v["verdict"]["reasons"],
        serde_json::json!(["gap_over_budget"]),
        "{}",
        v["verdict"]
    );
    let summary = v["verdict"]["summary"].as_str().unwrap();
    assert!(
        summary.contains("health-n1 (east-west"),
        "the east-west target named: {summary}"
    );
    for t in ["health-n1", "pod0-n1"] {
        let ew = gap(&v, t);
        assert_eq!(ew["east_west"], true, "{ew}");
        assert!(ew["longest_s"].as_f64().unwrap() > 1.0, "{t}: {ew}");
    }
    for vip in ["gateway", "dns-a", "dns-b"] {
        let g = gap(&v, vip);
        assert_eq!(
            g["longest_s"].as_f64(),
            Some(0.0),
            "{vip} kept answering: {g}"
        );
        assert!(g.get("east_west").is_none(), "{g}");
    }
    // The node check says so too, while the step is over.
    let (_, checks) = agent.get_json("/v1/checks");
    let vips = checks["checks"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["check"] == "vips"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(vips["status"], "fail", "{checks:#}");
    assert!(
        vips["reason"].as_str().unwrap_or("").contains("health-n1"),
        "{vips}"
    );
}

/// A healthy restart of one node of three: every east-west target (the two other nodes'
/// health endpoints, HTTP, and their first pods, ICMP) and every VIP keeps answering, and
/// the step passes.
#[test]
fn a_healthy_multi_node_restart_passes_with_its_east_west_targets() {
    let mut lab = lan(3);
    let agent = agent_on(&lab, 1);
    let id = agent.begin_probing(STEP);
    lab.restart(
        1,
        &RestartOpts {
            down: std::time::Duration::from_millis(200),
            ..Default::default()
        },
        false,
    )
    .unwrap();
    let v = agent.verdict(&id);
    assert_eq!(v["verdict"]["status"], "passed", "{v:#}");
    for t in ["health-n0", "health-n2", "pod0-n0", "pod0-n2"] {
        let g = gap(&v, t);
        assert_eq!(g["east_west"], true, "{g}");
        assert_eq!(g["longest_s"].as_f64(), Some(0.0), "{t}: {g}");
    }
    assert!(
        v["probes"]["health-n2"]["sent"].as_u64().unwrap_or(0) > 50,
        "probed at the step's cadence: {}",
        v["probes"]
    );
    let text = agent.get(&format!("/v1/steps/{id}?format=text")).1;
    assert!(text.contains("http/ew"), "{text}");
}

/// An east-west target that is this node's own endpoint — its own health endpoint, in its
/// `cilium_lxc` — cannot see the overlay: the vips check fails it, naming why, although it
/// answers; the other nodes' targets pass.
#[test]
fn an_east_west_target_on_this_node_fails_the_vips_check() {
    let lab = lan(2);
    let node = lab.node(0).unwrap();
    let own = stepguard_lab::health_ip(0).to_string();
    let cfg = std::fs::read_to_string(lab.node_config(0))
        .unwrap()
        .replace(&stepguard_lab::health_ip(1).to_string(), &own);
    let path = lab.state.run_dir.join("node0-own-health.yaml");
    std::fs::write(&path, cfg).unwrap();
    let (code, v, err) = check(
        &node,
        &["--only", "vips", "--config", &path.to_string_lossy()],
    );
    assert_eq!(code, 1, "{v:#} {err}");
    let r = result(&v, "vips");
    assert_eq!(r["code"], "east_west_target_local", "{r:#}");
    assert!(
        r["reason"]
            .as_str()
            .unwrap()
            .contains("health-n1 is an endpoint of this node (in cilium_lxc)"),
        "{r:#}"
    );
    // It did answer: only where it answered from is wrong.
    let t = r["evidence"]["targets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "health-n1")
        .unwrap();
    assert_eq!(
        (t["ok"].clone(), t["east_west"].clone()),
        (true.into(), true.into()),
        "{t}"
    );
}
