//! The effective configuration: what the node runs with is the ConfigMap plus the
//! per-node overrides (a CiliumNodeConfig) the agent loaded, and every check reading a config
//! key expects that. The lab's restart builds its datapath from the same effective
//! configuration once an override was given (its fault: a datapath that ignores the
//! override). And `cil_to_netdev` is required exactly when Cilium's `AreDevicesRequired()`
//! holds: a restart that loses it fails, a node where it is not required passes without it.
mod common;
use common::*;
use serde_json::Value;
use std::time::Duration;
use stepguard_lab::{Lab, RestartOpts};

fn restart(lab: &mut Lab, o: RestartOpts) {
    lab.restart(&RestartOpts {
        down: Duration::from_millis(10),
        ..o
    })
    .expect("lab restart");
}

/// One check with the agent state directory (the ConfigMap's history tells an override).
fn one(lab: &Lab, name: &str) -> (i32, Value) {
    let state = lab.state.run_dir.join("agent-state");
    let state = state.to_string_lossy().into_owned();
    let (code, v, err) = check(lab, &["--only", name, "--state-dir", &state]);
    assert!(v.is_object(), "{err}");
    (code, result(&v, name).clone())
}

/// A restart whose datapath ignores the override the agent loaded; then the devices check.
fn ignoring_the_override(lab: &mut Lab) -> (i32, Value) {
    restart(
        lab,
        RestartOpts {
            ignore_override: true,
            ..Default::default()
        },
    );
    one(lab, "devices")
}

fn code_of(r: &Value) -> &str {
    r["code"].as_str().unwrap_or("?")
}

fn overriding(lab: &mut Lab, key: &str, value: &str) {
    lab.config_override(&[(key.to_string(), value.to_string())])
        .expect("config override");
}

/// A lab without kube-proxy replacement (and so without L2 announcements): `cil_to_netdev`
/// is not required until an override makes it so.
fn lab_without_kpr() -> stepguard_lab::LabGuard {
    lab(|s| {
        s.features.kube_proxy_replacement = false;
        s.features.l2_announcements = false;
    })
}

#[test]
fn per_node_overrides_reach_every_check_reading_a_config_key() {
    let mut lab = lab_without_kpr();
    let (code, r) = one(&lab, "config");
    assert_eq!(code, 0, "the ConfigMap as loaded, remembered: {r}");
    let (code, r) = one(&lab, "devices");
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["evidence"]["selected"],
        serde_json::json!(["eth0", "eth1"])
    );

    // devices: the override, then a healthy restart that follows it.
    overriding(&mut lab, "devices", "eth0");
    restart(&mut lab, RestartOpts::default());
    let (code, r) = one(&lab, "config");
    assert_eq!(code, 0, "{r}");
    assert!(
        r["reason"]
            .as_str()
            .unwrap()
            .contains("per-node overrides: devices"),
        "{r}"
    );
    let (code, r) = one(&lab, "devices");
    assert_eq!(code, 0, "the override is what the node should select: {r}");
    assert_eq!(r["evidence"]["selected"], serde_json::json!(["eth0"]));
    // A datapath that ignores the override it loaded.
    let (code, r) = ignoring_the_override(&mut lab);
    assert_eq!((code, code_of(&r)), (1, "device_unexpected"), "{r}");
    // The override removed: the ConfigMap's devices again.
    overriding(&mut lab, "devices", "");
    restart(&mut lab, RestartOpts::default());
    let (code, r) = one(&lab, "devices");
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["evidence"]["selected"],
        serde_json::json!(["eth0", "eth1"])
    );

    // Two keys that make devices required (AreDevicesRequired), each as an override.
    for key in ["enable-host-firewall", "enable-ipsec"] {
        overriding(&mut lab, key, "true");
        restart(&mut lab, RestartOpts::default());
        let (code, r) = one(&lab, "devices");
        assert_eq!(code, 0, "{key}: {r}");
        assert_eq!(
            r["evidence"]["to_netdev_required_by"],
            serde_json::json!([key]),
            "{r}"
        );
        let (code, r) = ignoring_the_override(&mut lab);
        assert_eq!((code, code_of(&r)), (1, "to_netdev_missing"), "{key}: {r}");
        assert!(r["reason"].as_str().unwrap().contains(key), "{r}");
        overriding(&mut lab, key, "");
        restart(&mut lab, RestartOpts::default());
        let (code, r) = one(&lab, "devices");
        assert_eq!(code, 0, "{key} removed: not required, and detached: {r}");
        assert_eq!(
            r["evidence"]["to_netdev_required_by"],
            serde_json::json!([])
        );
    }
}

/// `cil_to_netdev` per condition (KPR from the lab's spec; the host firewall as a per-node
/// override; L2 announcements need KPR in Cilium, so they add no case of their own): lost in
/// a restart, the devices check and the step's reload check fail; not required, its absence
/// passes.
#[test]
fn cil_to_netdev_is_required_exactly_when_devices_are() {
    for (kpr, fw) in [(true, false), (false, true)] {
        let mut lab = lab(|s| {
            s.features.kube_proxy_replacement = kpr;
            s.features.l2_announcements = false;
        });
        if fw {
            let (code, r) = one(&lab, "config");
            assert_eq!(code, 0, "{r}");
            overriding(&mut lab, "enable-host-firewall", "true");
            restart(&mut lab, RestartOpts::default());
        }
        let (code, r) = one(&lab, "devices");
        assert_eq!(code, 0, "kpr {kpr} host firewall {fw}: {r}");
        let agent = AgentProc::start(&lab, &[]);
        let id = agent.begin(r#"{"settle": "1s", "timeout": "30s"}"#);
        restart(
            &mut lab,
            RestartOpts {
                lose_program: Some("cil_to_netdev".into()),
                ..Default::default()
            },
        );
        let v = agent.verdict(&id);
        assert_eq!(
            v["verdict"]["status"], "failed",
            "kpr {kpr} host firewall {fw}: {v:#}"
        );
        assert!(
            v.to_string().contains("to_netdev"),
            "the reload check names it: {v:#}"
        );
        drop(agent);
        let (code, r) = one(&lab, "devices");
        assert_eq!(
            (code, code_of(&r)),
            (1, "to_netdev_missing"),
            "kpr {kpr} host firewall {fw}: {r}"
        );
    }
    // Neither: the lab attaches no cil_to_netdev (as Cilium detaches it) and that passes.
    let lab = lab(|s| {
        s.features.kube_proxy_replacement = false;
        s.features.l2_announcements = false;
    });
    let (code, r) = one(&lab, "devices");
    assert_eq!(code, 0, "{r}");
    assert!(
        !r.to_string().contains("cil_to_netdev"),
        "no cil_to_netdev anywhere: {r}"
    );
}

/// The routing mode as a per-node override: the configuration decides the overlay. A
/// datapath that followed `routing-mode=native` (no overlay device) passes the devices check;
/// one that kept tunnelling fails it, naming the overlay and the setting.
#[test]
fn a_routing_mode_override_decides_the_overlay() {
    let mut lab = lab_without_kpr();
    let (code, r) = one(&lab, "devices");
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["evidence"]["overlay"]["wanted"], "cilium_vxlan", "{r}");

    overriding(&mut lab, "routing-mode", "native");
    restart(&mut lab, RestartOpts::default());
    let (code, r) = one(&lab, "devices");
    assert_eq!(code, 0, "native routing followed: {r}");
    assert_eq!(r["evidence"]["overlay"]["wanted"], Value::Null, "{r}");
    assert!(
        r["evidence"]["overlay"]["because"]
            .as_str()
            .unwrap_or("")
            .contains("routing-mode=native"),
        "{r}"
    );
    assert!(
        !r["evidence"]["devices"]
            .as_array()
            .unwrap()
            .iter()
            .any(|d| d["device"] == "cilium_vxlan"),
        "Cilium removes the overlay device in native routing: {r}"
    );

    // The datapath ignores the override: still tunnelling.
    let (code, r) = ignoring_the_override(&mut lab);
    assert_eq!((code, code_of(&r)), (1, "overlay_unexpected"), "{r}");
    let why = r["reason"].as_str().unwrap();
    assert!(
        why.contains("cilium_vxlan") && why.contains("routing-mode=native"),
        "{r}"
    );

    // The override removed: tunnel routing again, the overlay back.
    overriding(&mut lab, "routing-mode", "");
    restart(&mut lab, RestartOpts::default());
    let (code, r) = one(&lab, "devices");
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["evidence"]["overlay"]["wanted"], "cilium_vxlan", "{r}");
}
