//! `devices`: which host devices carry Cilium's `cil_from_netdev`, against the expected set
//! (an explicit list, Cilium-style patterns like `eth+`, the `devices` key of cilium-config,
//! or Cilium's own auto-detection rules). Evidence per device: program ids and load times,
//! the baseline for "was the datapath reloaded?".

use super::CheckResult;
use crate::checks::Code;
use crate::cilium::devices::*;
use crate::kernel::links::{Device, Observation};
use serde_json::json;
use std::collections::BTreeSet;

mod expected;
pub use expected::*;

pub const CHECK: &str = "devices";

/// The overlay against the configuration's intent: the wanted overlay device carries
/// `cil_from_overlay`, no other overlay device carries Cilium's programs. None: as intended.
pub fn overlay_mismatch(obs: &Observation, intent: &OverlayIntent) -> Option<(Code, String)> {
    let carries = |name: &str| {
        obs.devices
            .iter()
            .find(|d| d.name == name)
            .is_some_and(|d| {
                d.programs
                    .iter()
                    .any(|p| p.hook == "ingress" && p.is("cil_from_overlay"))
            })
    };
    let stray: Vec<&str> = obs
        .devices
        .iter()
        .filter(|d| is_overlay(&d.name) && Some(&d.name) != intent.device.as_ref())
        .filter(|d| !d.programs.is_empty())
        .map(|d| d.name.as_str())
        .collect();
    if !stray.is_empty() {
        return Some((
            Code::OverlayUnexpected,
            format!(
                "{} still carries Cilium's programs, but the configuration asks for {}",
                stray.join(", "),
                intent.describe()
            ),
        ));
    }
    match &intent.device {
        Some(d) if !carries(d) => Some((
            Code::OverlayMissing,
            format!(
                "{d} lacks cil_from_overlay, but the configuration asks for {}",
                intent.describe()
            ),
        )),
        _ => None,
    }
}

/// Decides the check from an observation.
pub fn evaluate(obs: &Observation, exp: &Expected) -> CheckResult {
    evaluate_with(obs, exp, &ToNetdev::default())
}

/// Selected devices lacking `cil_to_netdev` on egress.
pub fn lacking_to_netdev(obs: &Observation, selected: &BTreeSet<String>) -> Vec<String> {
    obs.devices
        .iter()
        .filter(|d| selected.contains(&d.name))
        .filter(|d| {
            !d.programs
                .iter()
                .any(|p| p.hook == "egress" && p.is("cil_to_netdev"))
        })
        .map(|d| d.name.clone())
        .collect()
}

/// Decides the check, `cil_to_netdev` required as `to_netdev` says.
pub fn evaluate_with(obs: &Observation, exp: &Expected, to_netdev: &ToNetdev) -> CheckResult {
    evaluate_by(obs, exp, to_netdev, SelectionRules::newest())
}

/// [`evaluate_with`] by a release's device selection rules.
pub fn evaluate_by(
    obs: &Observation,
    exp: &Expected,
    to_netdev: &ToNetdev,
    rules: SelectionRules,
) -> CheckResult {
    let expected = expected_set_by(&obs.devices, exp, rules);
    let carried = carrying(&obs.devices);
    let have: BTreeSet<String> = carried
        .iter()
        .filter(|n| !ciliums_own(n))
        .cloned()
        .collect();
    let own: Vec<&String> = carried.iter().filter(|n| ciliums_own(n)).collect();
    let absent = listed_but_absent(&obs.devices, exp);
    let missing: Vec<&String> = expected.difference(&have).collect();
    let unexpected: Vec<&String> = have.difference(&expected).collect();
    let per_device: Vec<_> = obs
        .devices
        .iter()
        .filter(|d| {
            !d.programs.is_empty() || expected.contains(&d.name) || d.name.starts_with("cilium_")
        })
        .map(
            |d| json!({"device": d.name, "ifindex": d.ifindex, "up": d.up, "programs": d.programs}),
        )
        .collect();
    let source = match exp {
        Expected::Patterns {
            patterns,
            source,
            force,
        } => json!({"patterns": patterns, "source": source, "force_device_detection": force}),
        Expected::Auto => {
            json!({"source": "Cilium's auto-detection (up, an address, a global-unicast route; not loopback, enslaved, bridge, openvswitch, cilium_/lo/lxc/cni/docker)", "rules": rules.label()})
        }
        Expected::Reported {
            devices,
            attach_mode,
            rules: fallback,
        } => {
            // What the re-derived rules would have expected, beside the agent's answer: a
            // difference is a finding about the rules, not about the node.
            let by_rules = expected_set_by(&obs.devices, fallback, rules);
            json!({
                "source": "cilium-agent status (GET /v1/healthz: kube-proxy-replacement.deviceList)",
                "reported": devices,
                "attach_mode": attach_mode,
                "rules_would_expect": by_rules,
                "rules_agree": by_rules == expected,
                "rules": rules.label(),
            })
        }
    };
    let decided_by = exp.decided_by(rules);
    let evidence = json!({
        "expected": expected,
        "selected": have,
        "missing": missing,
        "unexpected": unexpected,
        "ciliums_own_devices_with_cil_from_netdev": own,
        "listed_but_absent": absent,
        "expected_from": source,
        "decided_by": decided_by,
        "devices": per_device,
        "endpoint_devices": obs.endpoint_devices,
        "problems": obs.problems,
        "link_pin_problems": obs.link_pin_problems,
        "to_netdev_required_by": to_netdev.because,
    });
    if obs.prog_details_unreadable {
        return CheckResult::unknown(
            CHECK,
            Code::NoPermission,
            format!(
                "cannot read program details: {}",
                obs.problems
                    .first()
                    .map(String::as_str)
                    .unwrap_or("permission denied")
            ),
            evidence,
        );
    }
    if let Some(p) = obs.problems.first() {
        return CheckResult::unknown(CHECK, Code::KernelError, p.clone(), evidence);
    }
    if expected.is_empty() {
        return CheckResult::unknown(
            CHECK,
            Code::NoExpectedDevices,
            "no expected devices: none configured and none auto-detected",
            evidence,
        );
    }
    // cilium_host must carry the host programs whenever the datapath is there at all.
    let host_ok = obs
        .devices
        .iter()
        .find(|d| d.name == "cilium_host")
        .map(|d| {
            d.programs
                .iter()
                .any(|p| p.hook == "ingress" && p.is("cil_to_host"))
                && d.programs
                    .iter()
                    .any(|p| p.hook == "egress" && p.is("cil_from_host"))
        });
    let list = |v: &[&String]| v.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ");
    let no_egress = if to_netdev.because.is_empty() {
        vec![]
    } else {
        lacking_to_netdev(obs, &have)
    };
    match (missing.is_empty(), unexpected.is_empty()) {
        (true, true) if !no_egress.is_empty() && to_netdev.unconfirmed => {
            let mut evidence = evidence;
            evidence["to_netdev_missing"] = json!(no_egress);
            CheckResult::unknown(
                CHECK,
                Code::ToNetdevUnconfirmed,
                format!(
                    "cil_to_netdev missing on {}; the ConfigMap requires it ({}), but what the running cilium-agent loaded could not be read, and a per-node override may turn it off",
                    no_egress.join(", "),
                    to_netdev.because.join(", ")
                ),
                evidence,
            )
        }
        (true, true) if !no_egress.is_empty() => {
            let mut evidence = evidence;
            evidence["to_netdev_missing"] = json!(no_egress);
            CheckResult::fail(
                CHECK,
                Code::ToNetdevMissing,
                format!(
                    "cil_to_netdev missing on {}, required because {} (Cilium attaches it on every selected device when devices are required)",
                    no_egress.join(", "),
                    to_netdev.because.iter().map(|k| format!("{k}=true")).collect::<Vec<_>>().join(", ")
                ),
                evidence,
            )
        }
        (true, true) => match host_ok {
            Some(true) => CheckResult::pass(
                CHECK,
                Code::DevicesOk,
                format!(
                    "cil_from_netdev on {} (as expected by {decided_by})",
                    list(&have.iter().collect::<Vec<_>>())
                ),
                evidence,
            ),
            Some(false) => CheckResult::fail(
                CHECK,
                Code::HostDeviceMissing,
                "cilium_host lacks cil_to_host/cil_from_host",
                evidence,
            ),
            None => CheckResult::fail(
                CHECK,
                Code::HostDeviceMissing,
                "no cilium_host device: the datapath is not set up",
                evidence,
            ),
        },
        (false, true) => CheckResult::fail(
            CHECK,
            Code::DeviceMissing,
            format!(
                "cil_from_netdev missing on {} (expected by {decided_by})",
                list(&missing)
            ),
            evidence,
        ),
        (true, false) => CheckResult::fail(
            CHECK,
            Code::DeviceUnexpected,
            format!(
                "cil_from_netdev on unexpected {} (not expected by {decided_by})",
                list(&unexpected)
            ),
            evidence,
        ),
        (false, false) => CheckResult::fail(
            CHECK,
            Code::DeviceSetMismatch,
            format!(
                "cil_from_netdev missing on {}; unexpected on {} (expected by {decided_by})",
                list(&missing),
                list(&unexpected)
            ),
            evidence,
        ),
    }
}

/// Oldest load time of the programs on selected devices: when the running datapath started.
pub fn datapath_loaded_at(obs: &Observation) -> Option<f64> {
    let sel = carrying(&obs.devices);
    obs.devices
        .iter()
        .filter(|d| sel.contains(&d.name) || d.name == "cilium_host")
        .flat_map(|d| d.programs.iter())
        .filter_map(|p| p.loaded_at)
        .min_by(|a, b| a.total_cmp(b))
}

/// The `devices` node check: needs the device observation.
pub const NODE_CHECK: super::NodeCheck = super::NodeCheck {
    name: CHECK,
    needs: super::Needs {
        links: true,
        maps: false,
        agent: true,
        status: true,
    },
    from_probes: None,
    evaluate: evaluate_node,
    render,
};

fn evaluate_node<'a>(i: &'a super::Inputs<'a>) -> super::Evaluating<'a> {
    Box::pin(async move {
        // What the node runs with: the ConfigMap and the per-node overrides the agent loaded.
        let cfg = i.effective.or(i.cilium.and_then(|c| c.ok()));
        let release = i
            .loaded
            .and_then(|l| l.ok())
            .and_then(|l| l.version.as_deref())
            .and_then(crate::cilium::profile::release_of);
        let mut to_netdev = cfg
            .map(|c| to_netdev_required(&c.values, release.as_deref()))
            .unwrap_or_default();
        // Without the agent's answer only the ConfigMap was read (with no API socket
        // configured the ConfigMap is all there is, and it decides).
        to_netdev.unconfirmed = i.effective.is_none() && i.cfg.cilium_api.is_some();
        // The overlay is judged against what the agent loaded, or the ConfigMap when no API
        // socket is configured (it alone decides then); never against a ConfigMap a per-node
        // override may contradict.
        let overlay = cfg
            .filter(|_| i.effective.is_some() || i.cfg.cilium_api.is_none())
            .map(|c| overlay_intent(&c.values));
        let rules = SelectionRules::of(release.as_deref());
        let (exp, status_problem) = expected_from_agent(expected_devices(i.cfg, cfg), i.status);
        match i.links {
            Some(Ok(o)) => with_overlay(
                {
                    let mut r = evaluate_by(o, &exp, &to_netdev, rules);
                    if let Some(p) = status_problem {
                        r.evidence["expected_from"]["agent_status"] = json!(p);
                    }
                    r
                },
                o,
                overlay.as_ref(),
            ),
            Some(Err(e)) => CheckResult::unknown(
                CHECK,
                Code::NetlinkError,
                e.to_string(),
                serde_json::json!({}),
            ),
            None => CheckResult::unknown(
                CHECK,
                Code::NotObserved,
                "devices were not observed",
                serde_json::json!({}),
            ),
        }
    })
}

/// The overlay's judgment added to a devices result: the intent in the evidence; a passing
/// result fails when the overlay is not as the configuration asks.
fn with_overlay(
    mut r: CheckResult,
    obs: &Observation,
    intent: Option<&OverlayIntent>,
) -> CheckResult {
    let Some(intent) = intent else {
        r.evidence["overlay"] = json!({"judged": false, "why": "the agent's configuration could not be read (a per-node override may change the routing mode)"});
        return r;
    };
    r.evidence["overlay"] =
        json!({"judged": true, "wanted": intent.device, "because": intent.because});
    if r.status != super::Status::Pass {
        return r;
    }
    match overlay_mismatch(obs, intent) {
        Some((code, why)) => CheckResult::fail(CHECK, code, why, r.evidence),
        None => r,
    }
}

/// The `devices` check's evidence as lines for people.
pub fn render(r: &CheckResult) -> Vec<String> {
    let e = &r.evidence;
    let s = super::show;
    let mut l = Vec::new();
    l.push(format!(
        "expected {} (from {})",
        s(&e["expected"]),
        s(&e["expected_from"]["source"])
    ));
    l.push(format!("selected {}", s(&e["selected"])));
    for d in e["devices"].as_array().into_iter().flatten() {
        let progs: Vec<String> = d["programs"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| {
                format!(
                    "{}:{}#{}({})",
                    p["hook"].as_str().unwrap_or(""),
                    p["name"].as_str().or(p["filter"].as_str()).unwrap_or("?"),
                    p["prog_id"],
                    p["via"].as_str().unwrap_or("")
                )
            })
            .collect();
        l.push(format!(
            "{:<14} {}",
            s(&d["device"]),
            if progs.is_empty() {
                "-".into()
            } else {
                progs.join(" ")
            }
        ));
    }
    if let Some(n) = e["endpoint_devices"].as_u64() {
        l.push(format!("endpoint devices (lxc*): {n}"));
    }
    l
}

#[cfg(test)]
mod tests;
