//! Every restart is verified, stepped or not (issue 14): with no POSTed step, the agent sees
//! the cilium-agent go down (its API socket stops answering) or its programs replaced, and
//! verifies the restart as an implicit step; a faulty unstepped restart fails it; an agent
//! that was itself down during the restart reports `evidence_incomplete`; an always-on
//! witness measures an unstepped lease move.
mod common;
use common::*;
use serde_json::Value;
use std::time::{Duration, Instant};
use stepguard_lab::{AttachMode, RestartOpts};

/// Waits (bounded) for a decided implicit step newer than `after` (its id), returns it.
fn implicit_verdict(agent: &Daemon, after: Option<&str>) -> Value {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let (_, list) = agent.get_json("/v1/steps");
        let found = list["steps"].as_array().and_then(|a| {
            a.iter()
                .find(|s| {
                    s["origin"] == "implicit" && Some(s["id"].as_str().unwrap_or("")) != after
                })
                .cloned()
        });
        if let Some(s) = found {
            return agent.verdict(s["id"].as_str().unwrap());
        }
        assert!(Instant::now() < deadline, "no implicit step: {list}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The agent has a steady snapshot (it polls every 250 ms; the first one is taken at once).
fn settle_in() {
    std::thread::sleep(Duration::from_millis(1500));
}

fn unstepped_restart_passes(attach: AttachMode) {
    let mut lab = lab(|s| s.attach = attach);
    let agent = Daemon::start(&lab, &[]);
    settle_in();
    lab.restart(&RestartOpts {
        down: Duration::from_millis(300),
        ..Default::default()
    })
    .unwrap();
    let v = implicit_verdict(&agent, None);
    assert_eq!(v["origin"], "implicit", "{v:#}");
    assert_eq!(v["verdict"]["status"], "passed", "{v:#}");
    assert!(
        v["trigger"]
            .as_str()
            .unwrap()
            .contains("API socket stopped answering"),
        "the earliest signal: {}",
        v["trigger"]
    );
    for g in v["gaps"].as_array().unwrap() {
        assert_eq!(g["count"], 0, "{g}");
    }
    let (_, m) = agent.get("/metrics");
    assert!(
        m.contains("stepguard_steps_total{verdict=\"passed\",origin=\"implicit\"} 1"),
        "{m}"
    );
}

#[test]
fn an_unstepped_restart_is_verified_as_an_implicit_step_tcx() {
    unstepped_restart_passes(AttachMode::Tcx);
}

#[test]
fn an_unstepped_restart_is_verified_as_an_implicit_step_tc() {
    unstepped_restart_passes(AttachMode::Tc);
}

/// Faulty restarts nobody stepped fail their implicit steps with the fault's reason.
#[test]
fn faulty_unstepped_restarts_fail_their_implicit_steps() {
    let mut lab = lab(|_| {});
    let agent = Daemon::start(&lab, &[]);
    settle_in();
    lab.restart(&RestartOpts {
        down: Duration::from_millis(200),
        drop_device: Some("eth1".into()),
        ..Default::default()
    })
    .unwrap();
    let v = implicit_verdict(&agent, None);
    assert_eq!(v["verdict"]["status"], "failed", "{v:#}");
    assert_eq!(
        v["verdict"]["reasons"],
        serde_json::json!(["device_set_changed"]),
        "{v:#}"
    );
    let first = v["id"].as_str().unwrap().to_string();
    settle_in();
    lab.restart(&RestartOpts {
        down: Duration::from_millis(200),
        flush_map: Some("cilium_lxc".into()),
        ..Default::default()
    })
    .unwrap();
    let v = implicit_verdict(&agent, Some(&first));
    assert_eq!(v["verdict"]["status"], "failed", "{v:#}");
    assert_eq!(
        v["verdict"]["reasons"],
        serde_json::json!(["map_emptied"]),
        "{v:#}"
    );
    let (_, m) = agent.get("/metrics");
    assert!(
        m.contains("stepguard_steps_total{verdict=\"failed\",origin=\"implicit\"} 2"),
        "{m}"
    );
}

/// The agent was down while the cilium-agent restarted: at its start it finds other program
/// ids than its persisted snapshot's, and the implicit step is evidence_incomplete.
#[test]
fn an_agent_down_during_the_restart_reports_evidence_incomplete() {
    let mut lab = lab(|_| {});
    let mut agent = Daemon::start(&lab, &[]);
    let steady = agent.state_dir.join("steady.json");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !steady.exists() {
        assert!(Instant::now() < deadline, "no steady snapshot persisted");
        std::thread::sleep(Duration::from_millis(100));
    }
    agent.kill9();
    lab.restart(&RestartOpts {
        down: Duration::from_millis(200),
        ..Default::default()
    })
    .unwrap();
    agent.restart_same();
    let v = implicit_verdict(&agent, None);
    assert_eq!(v["verdict"]["status"], "failed", "{v:#}");
    assert_eq!(
        v["verdict"]["reasons"],
        serde_json::json!(["evidence_incomplete"]),
        "{v:#}"
    );
    assert!(
        v["verdict"]["summary"]
            .as_str()
            .unwrap()
            .contains("agent was down"),
        "{v:#}"
    );
}
