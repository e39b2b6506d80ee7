//! Every restart is verified, stepped or not: with no POSTed step, the agent sees
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
fn implicit_verdict(agent: &AgentProc, after: Option<&str>) -> Value {
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
    let agent = AgentProc::start(&lab, &[]);
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
    let agent = AgentProc::start(&lab, &[]);
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
    let mut agent = AgentProc::start(&lab, &[]);
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

/// Waits (bounded) for the agent's steady snapshot on disk.
fn steady_persisted(agent: &AgentProc) -> std::path::PathBuf {
    let steady = agent.state_dir.join("steady.json");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !steady.exists() {
        assert!(Instant::now() < deadline, "no steady snapshot persisted");
        std::thread::sleep(Duration::from_millis(100));
    }
    steady
}

/// An agent whose state directory is a 256 KiB tmpfs `name` in the lab's run directory, once
/// its steady snapshot is on disk.
fn on_small_state_dir(
    lab: &stepguard_lab::Lab,
    name: &str,
) -> (std::path::PathBuf, Tmpfs, AgentProc) {
    let dir = lab.state.run_dir.join(name);
    let mounted = Tmpfs::small(&dir);
    let agent = AgentProc::start_with(
        lab.node_ns(),
        lab.stepguard_config(),
        dir.clone(),
        free_port(),
        &[],
    );
    steady_persisted(&agent);
    (dir, mounted, agent)
}

/// The steady snapshot cut in half (as a crash mid-write leaves a file that was not written
/// durably) while the cilium-agent restarted with this agent down: whether it restarted cannot
/// be told, and an implicit step says so (`evidence_incomplete`), never nothing.
#[test]
fn an_unreadable_steady_snapshot_is_an_incomplete_implicit_step() {
    let mut lab = lab(|_| {});
    let mut agent = AgentProc::start(&lab, &[]);
    let steady = steady_persisted(&agent);
    agent.kill9();
    lab.restart(&RestartOpts {
        down: Duration::from_millis(200),
        ..Default::default()
    })
    .unwrap();
    let whole = std::fs::read(&steady).unwrap();
    std::fs::write(&steady, &whole[..whole.len() / 2]).unwrap();
    agent.restart_same();
    let v = implicit_verdict(&agent, None);
    assert_eq!(
        v["verdict"]["reasons"],
        serde_json::json!(["evidence_incomplete"]),
        "{v:#}"
    );
    assert!(
        v["verdict"]["summary"]
            .as_str()
            .unwrap()
            .contains("steady snapshot could not be read"),
        "{v:#}"
    );
}

/// The state dir full when the cilium-agent restarts unstepped: the implicit step is still
/// verified, kept in memory and marked not persisted, the failed writes counted, and the agent
/// unready until the disk takes its record.
#[test]
fn a_full_state_dir_keeps_an_implicit_step_in_memory_and_the_agent_unready() {
    let mut lab = lab(|_| {});
    let (dir, _mounted, agent) = on_small_state_dir(&lab, "small-state");
    let filler = Tmpfs::fill(&dir);
    lab.restart(&RestartOpts {
        down: Duration::from_millis(300),
        ..Default::default()
    })
    .unwrap();
    let v = implicit_verdict(&agent, None);
    assert_eq!(v["verdict"]["status"], "passed", "{:#}", v["verdict"]);
    assert!(
        v["not_persisted"]
            .as_str()
            .is_some_and(|n| n.contains("could not be written")),
        "{v:#}"
    );
    let (s, body) = agent.get("/readyz");
    assert_eq!(s, 503, "{body}");
    let (_, m) = agent.get("/metrics");
    let errors = metric_value(&m, "stepguard_state_write_errors_total").unwrap_or(0.0);
    assert!(errors >= 1.0, "write errors counted: {errors}");
    std::fs::remove_file(&filler).unwrap();
    let id = v["id"].as_str().unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(15);
    while !(dir.join(format!("steps/{id}.json")).exists() && agent.get("/readyz").0 == 200) {
        assert!(
            Instant::now() < deadline,
            "the record was not written again"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A read-only state dir: every write fails, and readiness says so from the first failed
/// write on (a refused step, the steady snapshot), not only while a step is unsaved.
#[test]
fn a_read_only_state_dir_makes_the_agent_unready() {
    let lab = lab(|_| {});
    let (dir, _mounted, agent) = on_small_state_dir(&lab, "ro-state");
    assert_eq!(agent.get("/readyz").0, 200);
    sh("mount", &["-o", "remount,ro", dir.to_str().unwrap()]);
    let (s, _) = agent.post("/v1/steps", r#"{"settle":"1s","timeout":"10s"}"#, None);
    assert_eq!(s, 503, "a step that cannot be saved is refused");
    let (s, body) = agent.get("/readyz");
    assert_eq!(s, 503, "{body}");
    assert!(body.contains("state dir"), "{body}");
}
