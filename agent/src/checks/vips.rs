//! `vips`: every configured target (`tcp`, `http`, `icmp`, `dns` probe) answers within its
//! timeout. On kube-proxy-replacement nodes, Cilium's socket-LB may translate a host-namespace
//! connect to a VIP straight to a backend: see docs/witness.md, and "Known limit: socket-LB"
//! in deploy/stepguard.example.yaml.
use super::CheckResult;
use crate::checks::Code;
use crate::config::Target;
use crate::probe::{self, ProbeOutcome};
use serde_json::json;

pub const CHECK: &str = "vips";

/// No targets configured: nothing to decide.
fn no_targets() -> CheckResult {
    CheckResult::unknown(
        CHECK,
        Code::NoTargets,
        "no VIP targets configured (`targets:`)",
        json!({"targets": []}),
    )
}

pub async fn run(targets: &[Target], bpffs: &std::path::Path) -> CheckResult {
    if targets.is_empty() {
        return no_targets();
    }
    let outcomes = futures_util::future::join_all(targets.iter().map(probe::probe)).await;
    let ew = east_west_routes(targets, bpffs).await;
    evaluate(targets, &outcomes, &ew)
}

/// Where the east-west targets' routes end: those ending on this node (a local address, a
/// local endpoint) are not east-west; those whose route could not be looked up are not
/// confirmed. By target name.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EastWest {
    /// The routes were looked up (false: not yet, every east-west target unconfirmed).
    pub looked_up: bool,
    pub local: std::collections::BTreeMap<String, String>,
    pub unconfirmed: std::collections::BTreeMap<String, String>,
}

/// Looks up every east-west target (in this network namespace): an address of one of this
/// node's endpoints (Cilium's `cilium_lxc`, read-only; Cilium routes its own pod CIDR
/// through `cilium_host` like the others, so the route alone cannot tell), or a route that
/// ends here (a local address, an `lxc*` device).
pub async fn east_west_routes(targets: &[Target], bpffs: &std::path::Path) -> EastWest {
    let mut ew = EastWest {
        looked_up: true,
        ..Default::default()
    };
    let wanted: Vec<&Target> = targets.iter().filter(|t| t.east_west).collect();
    if wanted.is_empty() {
        return ew;
    }
    let mut endpoints = std::collections::BTreeSet::new();
    let read = crate::kernel::bpffs::read_entries(bpffs, "cilium_lxc", 1 << 20, |k, _| {
        if let Some(ip) = crate::cilium::profile::endpoint_ip(k) {
            endpoints.insert(ip);
        }
    });
    for t in wanted {
        match &read {
            Ok(_) if endpoints.contains(&t.address) => {
                ew.local.insert(
                    t.name.clone(),
                    "an endpoint of this node (in cilium_lxc)".to_string(),
                );
                continue;
            }
            Ok(_) => {}
            Err(e) => {
                ew.unconfirmed.insert(
                    t.name.clone(),
                    format!("read cilium_lxc (this node's endpoints): {e}"),
                );
                continue;
            }
        }
        match crate::kernel::links::route_ends_here(t.address).await {
            Ok(Some(why)) => {
                ew.local.insert(t.name.clone(), why);
            }
            Ok(None) => {}
            Err(e) => {
                ew.unconfirmed.insert(t.name.clone(), e);
            }
        }
    }
    ew
}

pub fn evaluate(targets: &[Target], outcomes: &[ProbeOutcome], ew: &EastWest) -> CheckResult {
    let evidence = json!({
        "targets": targets.iter().zip(outcomes).map(|(t, o)| json!({
            "name": t.name, "address": t.address, "port": crate::probe::port(t), "probe": t.probe.as_str(),
            "timeout_ms": t.timeout.as_millis() as u64, "ok": o.ok, "latency_ms": (o.latency.as_secs_f64() * 1e6).round() / 1e3, "detail": o.detail,
            "east_west": t.east_west,
        })).collect::<Vec<_>>(),
        "east_west_local": ew.local,
    });
    let failed: Vec<String> = targets
        .iter()
        .zip(outcomes)
        .filter(|(_, o)| !o.ok && o.ran)
        .map(|(t, o)| {
            let ew = if t.east_west { ", east-west" } else { "" };
            format!("{} ({}{ew})", t.name, o.detail)
        })
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
            Code::VipUnreachable,
            format!(
                "{} of {} targets failed: {}",
                failed.len(),
                targets.len(),
                failed.join("; ")
            ),
            evidence,
        );
    }
    if !ew.looked_up && targets.iter().any(|t| t.east_west) {
        return CheckResult::unknown(
            CHECK,
            Code::EastWestUnconfirmed,
            "the east-west targets' routes were not looked up yet",
            evidence,
        );
    }
    if !ew.local.is_empty() {
        return CheckResult::fail(
            CHECK,
            Code::EastWestTargetLocal,
            format!(
                "not east-west, answered on this node: {} (an east-west target must be on another node, e.g. its health endpoint, or it cannot see a broken overlay)",
                ew.local
                    .iter()
                    .map(|(n, why)| format!("{n} is {why}"))
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
            evidence,
        );
    }
    if !ew.unconfirmed.is_empty() {
        return CheckResult::unknown(
            CHECK,
            Code::EastWestUnconfirmed,
            format!(
                "cannot tell whether east-west targets leave this node: {}",
                ew.unconfirmed
                    .iter()
                    .map(|(n, e)| format!("{n}: {e}"))
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
            evidence,
        );
    }
    if !not_run.is_empty() {
        return CheckResult::unknown(
            CHECK,
            Code::ProbeNotRun,
            format!("could not probe: {}", not_run.join("; ")),
            evidence,
        );
    }
    CheckResult::pass(
        CHECK,
        Code::VipsOk,
        format!("all {} targets answered", targets.len()),
        evidence,
    )
}

/// The `vips` check from the latest probe of every target (in the agent): unknown until
/// every target was probed once.
pub fn from_probes(w: &super::ProbeWindows) -> CheckResult {
    let started = std::time::Instant::now();
    let targets = &w.cfg.targets;
    if targets.is_empty() {
        return no_targets();
    }
    let mut outcomes = Vec::with_capacity(targets.len());
    for t in targets {
        match w.latest.get(&t.name) {
            Some(o) => outcomes.push(o.clone()),
            None => {
                return CheckResult::unknown(
                    CHECK,
                    Code::NoProbeYet,
                    format!("{} not probed yet", t.name),
                    json!({}),
                )
            }
        }
    }
    let mut r = evaluate(targets, &outcomes, w.east_west);
    r.duration_ms = started.elapsed();
    r
}

/// The `vips` node check: probes every target (in the agent: its latest probes).
pub const NODE_CHECK: super::NodeCheck = super::NodeCheck {
    name: CHECK,
    needs: super::Needs {
        links: false,
        maps: false,
        agent: false,
        status: false,
    },
    from_probes: Some(from_probes),
    evaluate: |i| Box::pin(run(&i.cfg.targets, &i.cfg.bpffs)),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn target(yaml: &str) -> Target {
        crate::probe::parse(&format!("targets:\n  - {yaml}"))
            .unwrap()
            .targets[0]
            .clone()
    }

    fn ok() -> ProbeOutcome {
        ProbeOutcome {
            ok: true,
            sent_at: 0.0,
            latency: std::time::Duration::from_millis(1),
            detail: "HTTP 200".into(),
            ran: true,
            answers: None,
        }
    }

    /// An east-west target answered on this node proves nothing about the overlay: the
    /// check fails naming why; one whose route could not be looked up is unknown; one that
    /// leaves the node is judged like any target.
    #[test]
    fn an_east_west_target_must_leave_the_node() {
        let ts = vec![
            target("{name: gw, address: 198.51.100.10, port: 80, probe: http}"),
            target("{name: health-n1, address: 169.254.121.1, port: 4240, probe: http, path: /hello, east_west: true}"),
        ];
        assert!(ts[1].east_west && !ts[0].east_west);
        let outcomes = [ok(), ok()];
        let looked_up = EastWest {
            looked_up: true,
            ..Default::default()
        };
        // Not looked up yet: unknown, never a pass.
        let r = evaluate(&ts, &outcomes, &EastWest::default());
        assert_eq!(r.status, crate::checks::Status::Unknown);
        let r = evaluate(&ts, &outcomes, &looked_up);
        assert_eq!(r.status, crate::checks::Status::Pass);
        assert_eq!(r.evidence["targets"][1]["east_west"], true);
        let mut ew = looked_up.clone();
        ew.local.insert(
            "health-n1".into(),
            "routed to the local endpoint lxc_health".into(),
        );
        let r = evaluate(&ts, &outcomes, &ew);
        assert_eq!(r.status, crate::checks::Status::Fail);
        assert_eq!(r.code, "east_west_target_local");
        assert!(
            r.reason
                .contains("health-n1 is routed to the local endpoint lxc_health"),
            "{}",
            r.reason
        );
        let mut ew = looked_up.clone();
        ew.unconfirmed
            .insert("health-n1".into(), "route lookup: EPERM".into());
        let r = evaluate(&ts, &outcomes, &ew);
        assert_eq!(r.status, crate::checks::Status::Unknown);
        // A failing east-west target says it is one.
        let mut bad = ok();
        bad.ok = false;
        bad.detail = "timeout after 200ms".into();
        let r = evaluate(&ts, &[ok(), bad], &looked_up);
        assert!(
            r.reason
                .contains("health-n1 (timeout after 200ms, east-west)"),
            "{}",
            r.reason
        );
    }
}
