//! A lossy datapath (failures that are timeouts, not refusals) fails on its
//! loss budget, on tcp, http and dns targets alike, and the verdict says which budget.
mod common;
use common::*;
use std::time::Duration;
use stepguard_lab::{RestartOpts, GATEWAY_PORT, GATEWAY_VIP};

/// The lab's config with a plain tcp target beside its http and dns ones.
fn with_tcp_target(lab: &stepguard_lab::Lab) -> std::path::PathBuf {
    let text = std::fs::read_to_string(lab.stepguard_config()).unwrap();
    let tcp = format!(
        "targets:\n  - name: gateway-tcp\n    address: {GATEWAY_VIP}\n    port: {GATEWAY_PORT}\n    probe: tcp\n    timeout: 200ms\n"
    );
    assert!(text.contains("targets:\n"), "{text}");
    let p = lab.state.run_dir.join("stepguard-tcp.yaml");
    std::fs::write(&p, text.replacen("targets:\n", &tcp, 1)).unwrap();
    p
}

/// The lab's config with only the targets of `kind` (the tcp one added), so each kind's own
/// probes decide the step.
fn only_kind(lab: &stepguard_lab::Lab, kind: &str) -> std::path::PathBuf {
    let full = std::fs::read_to_string(with_tcp_target(lab)).unwrap();
    let (head, rest) = full.split_once("targets:\n").unwrap();
    let (targets, tail) = match rest.find("\ndns:") {
        Some(i) => (&rest[..i + 1], &rest[i + 1..]),
        None => (rest, ""),
    };
    let mut kept = String::new();
    for item in targets.split("  - ").filter(|t| !t.trim().is_empty()) {
        if item.contains(&format!("probe: {kind}\n")) {
            kept.push_str("  - ");
            kept.push_str(item);
        }
    }
    assert!(!kept.is_empty(), "no {kind} target in {targets}");
    let p = lab.state.run_dir.join(format!("stepguard-{kind}.yaml"));
    std::fs::write(&p, format!("{head}targets:\n{kept}{tail}")).unwrap();
    p
}

#[test]
fn random_loss_after_the_reload_fails_the_loss_budget_on_every_kind() {
    let mut lab = lab(|_| {});
    let mut errors = vec![];
    for kind in ["tcp", "http", "dns"] {
        let agent = AgentProc::start_with(
            lab.node_ns(),
            only_kind(&lab, kind),
            lab.state.run_dir.join(format!("agent-state-loss-{kind}")),
            free_port(),
            &[],
        );
        let id = agent.begin_probing(r#"{"settle":"2s","timeout":"30s"}"#);
        lab.restart(&RestartOpts {
            down: Duration::from_millis(150),
            loss: Some(0.5),
            loss_for: Duration::from_secs(3),
            ..Default::default()
        })
        .unwrap();
        let v = agent.verdict(&id);
        let summary = v["verdict"]["summary"].as_str().unwrap_or("").to_string();
        let g = &v["gaps"][0];
        if v["verdict"]["status"] != "failed"
            || v["verdict"]["reasons"][0] != "loss_over_budget"
            || !summary.contains("max_loss")
            || g["kind"] != kind
            || g["longest_s"].as_f64().unwrap_or(9.0) >= 5.0
        {
            errors.push(format!(
                "{kind}: {} {}: {summary} ({g})",
                v["verdict"]["status"], v["verdict"]["reasons"]
            ));
        }
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

/// The same restart without the fault passes: the loss budget raises no false alarm.
#[test]
fn a_healthy_restart_is_within_every_budget() {
    let mut lab = lab(|_| {});
    let cfg = with_tcp_target(&lab);
    let agent = AgentProc::start_with(
        lab.node_ns(),
        cfg,
        lab.state.run_dir.join("agent-state-loss"),
        free_port(),
        &[],
    );
    let id = agent.begin_probing(r#"{"settle":"2s","timeout":"30s"}"#);
    lab.restart(&RestartOpts {
        down: Duration::from_millis(150),
        ..Default::default()
    })
    .unwrap();
    let v = agent.verdict(&id);
    assert_eq!(
        v["verdict"]["status"], "passed",
        "{}",
        v["verdict"]["summary"]
    );
    for g in v["gaps"].as_array().unwrap() {
        assert_eq!(g["lost_outside_longest"], 0, "{g}");
    }
}
