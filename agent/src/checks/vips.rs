//! `vips`: every configured target (`tcp`, `http`, `icmp`, `dns` probe) answers within its
//! timeout. On kube-proxy-replacement nodes, Cilium's socket-LB may translate a host-namespace
//! connect to a VIP straight to a backend: see README, "Known limit: socket-LB".
use super::CheckResult;
use crate::config::Target;
use crate::probe::{self, ProbeOutcome};
use serde_json::json;

pub const CHECK: &str = "vips";

pub async fn run(targets: &[Target]) -> CheckResult {
    if targets.is_empty() {
        return CheckResult::unknown(
            CHECK,
            "no_targets",
            "no VIP targets configured (`targets:`)",
            json!({"targets": []}),
        );
    }
    let outcomes = futures_util::future::join_all(targets.iter().map(probe::probe)).await;
    evaluate(targets, &outcomes)
}

pub fn evaluate(targets: &[Target], outcomes: &[ProbeOutcome]) -> CheckResult {
    let evidence = json!({
        "targets": targets.iter().zip(outcomes).map(|(t, o)| json!({
            "name": t.name, "address": t.address, "port": t.port(), "probe": t.probe.as_str(),
            "timeout_ms": t.timeout.as_millis() as u64, "ok": o.ok, "latency_ms": (o.latency.as_secs_f64() * 1e6).round() / 1e3, "detail": o.detail,
        })).collect::<Vec<_>>()
    });
    let failed: Vec<String> = targets
        .iter()
        .zip(outcomes)
        .filter(|(_, o)| !o.ok && o.ran)
        .map(|(t, o)| format!("{} ({})", t.name, o.detail))
        .collect();
    let not_run: Vec<String> = targets
        .iter()
        .zip(outcomes)
        .filter(|(_, o)| !o.ran)
        .map(|(t, o)| format!("{} ({})", t.name, o.detail))
        .collect();
    if !failed.is_empty() {
        return CheckResult::fail(
            CHECK,
            "vip_unreachable",
            format!(
                "{} of {} targets failed: {}",
                failed.len(),
                targets.len(),
                failed.join("; ")
            ),
            evidence,
        );
    }
    if !not_run.is_empty() {
        return CheckResult::unknown(
            CHECK,
            "probe_not_run",
            format!("could not probe: {}", not_run.join("; ")),
            evidence,
        );
    }
    CheckResult::pass(
        CHECK,
        "vips_ok",
        format!("all {} targets answered", targets.len()),
        evidence,
    )
}

/// The `vips` node check: probes every target (in the agent: its latest probes).
pub const NODE_CHECK: super::NodeCheck = super::NodeCheck {
    name: CHECK,
    needs: super::Needs {
        links: false,
        maps: false,
    },
    from_probes: true,
    evaluate: |i| Box::pin(run(&i.cfg.targets)),
    render,
};

/// The `vips` check's evidence as lines for people.
pub fn render(r: &CheckResult) -> Vec<String> {
    let e = &r.evidence;
    let s = super::show;
    let mut l = Vec::new();
    for t in e["targets"].as_array().into_iter().flatten() {
        l.push(format!(
            "{:<12} {}:{} {:<5} {} in {} ms: {}",
            s(&t["name"]),
            s(&t["address"]),
            t["port"],
            s(&t["probe"]),
            if t["ok"] == true { "ok" } else { "FAILED" },
            t["latency_ms"],
            s(&t["detail"])
        ));
    }
    l
}
