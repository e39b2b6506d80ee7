//! Endpoint regeneration against the lab: after every restart Cilium regenerates every
//! endpoint (new `cil_from_container` programs, after the host's); a regeneration that
//! stalls for all or some endpoints fails the step naming them, a healthy one of 1,000
//! endpoints passes.
mod common;
use common::*;
use std::time::{Duration, Instant};
use stepguard_lab::{AttachMode, RestartOpts};

/// The lab's endpoint devices, in pod order.
fn endpoint_names(lab: &stepguard_lab::Lab) -> Vec<String> {
    lab.state.lxc.iter().map(|l| l.0.clone()).collect()
}

fn stalled(attach: AttachMode, pods: u32, stall: u32) -> (Vec<String>, serde_json::Value) {
    let mut lab = lab(|s| {
        s.attach = attach;
        s.pods = pods;
    });
    let names = endpoint_names(&lab);
    let agent = AgentProc::start(&lab, &[]);
    // The timeout is the deadline a stalled regeneration is judged at.
    let id = agent.begin_probing(r#"{"settle": "2s", "timeout": "10s"}"#);
    lab.restart(&RestartOpts {
        down: Duration::from_millis(200),
        stall_endpoints: Some(stall),
        ..Default::default()
    })
    .unwrap();
    (names, agent.verdict(&id))
}

fn assert_fails_naming(v: &serde_json::Value, stalled: &[String], regenerated: &[String]) {
    assert_eq!(v["verdict"]["status"], "failed", "{v:#}");
    assert_eq!(
        v["verdict"]["reasons"],
        serde_json::json!(["endpoints_not_regenerated"]),
        "{}",
        v["verdict"]
    );
    let summary = v["verdict"]["summary"].as_str().unwrap();
    for n in stalled {
        assert!(summary.contains(n.as_str()), "{n} named in: {summary}");
    }
    for n in regenerated {
        assert!(!summary.contains(n.as_str()), "{n} not named in: {summary}");
    }
    // The host datapath did reload: this is the endpoints' failure alone.
    assert!(v["reload"]["complete_at"].is_number(), "{}", v["reload"]);
    let e = &v["endpoints"];
    assert_eq!(e["state"], "followed", "{e}");
    assert_eq!(e["pending_count"], stalled.len(), "{e}");
    assert_eq!(e["regenerated"], regenerated.len(), "{e}");
}

/// Every endpoint keeps its old programs (tcx): the step fails at its timeout, naming each
/// of them.
#[test]
fn a_stalled_regeneration_of_every_endpoint_fails_naming_them() {
    let (names, v) = stalled(AttachMode::Tcx, 3, u32::MAX);
    assert_fails_naming(&v, &names, &[]);
}

/// One of four endpoints keeps its old programs (legacy tc filters): only it is named, the
/// others regenerated.
#[test]
fn a_stalled_regeneration_of_some_endpoints_fails_naming_only_them() {
    let (names, v) = stalled(AttachMode::Tc, 4, 1);
    assert_fails_naming(&v, &names[..1], &names[1..]);
}

/// A healthy restart of a node with 1,000 endpoints, regenerated in batches of 50 after the
/// host programs, 200 ms a batch (as Cilium's regeneration takes seconds: ~4 s here): passes
/// within the default settle (10 s, docs/reference/api.md), with progress and the
/// slowest endpoint in the view and the metrics.
#[test]
fn a_healthy_regeneration_of_1000_endpoints_passes() {
    let mut lab = lab(|s| s.pods = 1000);
    let agent = AgentProc::start(&lab, &[]);
    let id = agent.begin_probing(r#"{"settle": "10s", "timeout": "90s"}"#);
    let t = Instant::now();
    lab.restart(&RestartOpts {
        down: Duration::from_millis(200),
        regenerate_every: Duration::from_millis(200),
        ..Default::default()
    })
    .unwrap();
    let regen = t.elapsed();
    let v = agent.verdict(&id);
    assert_eq!(v["verdict"]["status"], "passed", "{v:#}");
    let e = &v["endpoints"];
    assert_eq!(
        (
            e["followed"].as_u64(),
            e["regenerated"].as_u64(),
            e["pending_count"].as_u64()
        ),
        (Some(1000), Some(1000), Some(0)),
        "{e}"
    );
    let slowest = e["slowest_s"].as_f64().expect("slowest endpoint time");
    assert!(
        slowest > 2.0 && slowest < regen.as_secs_f64() + 1.0,
        "slowest {slowest}s, the lab's restart took {regen:?}"
    );
    assert!(
        v["checks"]["endpoints"]["reason"]
            .as_str()
            .unwrap()
            .starts_with("1000 of 1000 endpoints regenerated (slowest lxc"),
        "{}",
        v["checks"]["endpoints"]
    );
    let (_, m) = agent.get("/metrics");
    assert_eq!(
        metric_value(&m, "stepguard_step_endpoints{state=\"regenerated\"}"),
        Some(1000.0),
        "{m}"
    );
    assert!(
        metric_value(&m, "stepguard_step_endpoint_regeneration_slowest_seconds")
            .is_some_and(|s| (s - slowest).abs() < 0.01)
    );
    eprintln!("1,000 endpoints: the lab's restart took {regen:?}, slowest endpoint {slowest:.2}s after the host datapath");
}

/// 100 endpoints regenerated in two batches 3.5 s apart (a big node: Cilium regenerates at
/// its own concurrency), the last one ~7 s after the host programs: past a 2 s settle, well
/// inside the timeout. The step waits for them and passes: settle is how long everything
/// must then stay green, not a deadline.
#[test]
fn endpoints_regenerating_past_settle_pass_within_the_timeout() {
    let mut lab = lab(|s| s.pods = 100);
    let agent = AgentProc::start(&lab, &[]);
    let id = agent.begin_probing(r#"{"settle": "2s", "timeout": "40s"}"#);
    let r = lab
        .restart(&RestartOpts {
            down: Duration::from_millis(200),
            regenerate_every: Duration::from_millis(3500),
            ..Default::default()
        })
        .unwrap();
    let late = (r.phases.endpoints_regenerated_ns - r.phases.host_replaced_ns) as f64 / 1e9;
    assert!(
        late > 3.0,
        "the last batch came {late:.1}s after the host programs"
    );
    let v = agent.verdict(&id);
    assert_eq!(v["verdict"]["status"], "passed", "{v:#}");
    let e = &v["endpoints"];
    assert_eq!(
        (e["regenerated"].as_u64(), e["pending_count"].as_u64()),
        (Some(100), Some(0)),
        "{e}"
    );
    let slowest = e["slowest_s"].as_f64().unwrap();
    assert!(
        slowest > 3.0,
        "the slowest endpoint came after settle: {slowest}s"
    );
}

/// A pod deleted during a step while nothing restarts is seen within seconds, whichever way
/// the runner read the endpoints then (itself every 200 ms within 30 s of a program load —
/// here the lab's and the agent's own loads at start may still count — otherwise through the
/// node checks' observation of every endpoint, once a second); the other endpoints stay
/// pending (nothing regenerated them).
#[test]
fn a_pod_deleted_during_a_quiet_step_is_seen_from_the_node_checks() {
    let lab = lab(|s| s.pods = 3);
    let names = endpoint_names(&lab);
    let agent = AgentProc::start(&lab, &[]);
    let id = agent.begin_probing(r#"{"settle": "2s", "timeout": "60s"}"#);
    let (_, v) = agent.get_json(&format!("/v1/steps/{id}"));
    assert_eq!(
        (
            v["endpoints"]["followed"].as_u64(),
            v["endpoints"]["deleted"].as_u64()
        ),
        (Some(3), Some(0)),
        "{}",
        v["endpoints"]
    );
    let out = in_node(&lab, "ip", &["link", "del", &names[0]]);
    assert!(out.status.success(), "ip link del: {out:?}");
    let t = Instant::now();
    let mut e = serde_json::Value::Null;
    while t.elapsed() < Duration::from_secs(10) {
        let (_, v) = agent.get_json(&format!("/v1/steps/{id}"));
        e = v["endpoints"].clone();
        if e["deleted"].as_u64() == Some(1) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(e["deleted"].as_u64(), Some(1), "not seen in 10 s: {e}");
    assert_eq!(e["pending_count"].as_u64(), Some(2), "{e}");
    assert_eq!(e["regenerated"].as_u64(), Some(0), "{e}");
    eprintln!("deleted pod seen after {:?}", t.elapsed());
    agent.delete(&format!("/v1/steps/{id}"), None);
}
