//! The lab comes up faithful to cilium-facts.md, checked with tools independent of the lab
//! library: ip, tc, bpftool, dig, curl.
mod common;
use common::*;
use std::path::Path;
use stepguard_lab::{AttachMode, Profile};

fn expected_maps(profile: Profile) -> Vec<&'static str> {
    let mut v = vec![
        "cilium_lxc",
        "cilium_ct4_global",
        "cilium_ct_any4_global",
        "cilium_lb4_services_v2",
        "cilium_lb4_backends_v3",
        "cilium_lb4_reverse_nat",
        "cilium_metrics",
        "cilium_events",
        "cilium_signals",
        "cilium_runtime_config",
        "cilium_call_policy",
        "cilium_egresscall_policy",
        "cilium_auth_map",
        "cilium_node_map_v2",
        "cilium_snat_v4_external",
        "cilium_l2_responder_v4",
    ];
    match profile {
        // 1.16/1.17: ipcache v1, the tunnel map and the v1 node map; policy stats from 1.18.
        Profile::V1_16 | Profile::V1_17 => v.extend([
            "cilium_ipcache",
            "cilium_tunnel_map",
            "cilium_node_map",
            if profile == Profile::V1_16 {
                "cilium_policy_01000"
            } else {
                "cilium_policy_v2_01000"
            },
        ]),
        Profile::V1_18 | Profile::V1_19 => v.extend([
            "cilium_ipcache_v2",
            "cilium_policystats",
            "cilium_policy_v2_01000",
        ]),
        Profile::V1_20 => v.extend([
            "cilium_ipcache_v2",
            "cilium_policystats",
            "cilium_policy_v3_01000",
        ]),
    }
    v
}

fn absent_maps(profile: Profile) -> Vec<&'static str> {
    match profile {
        Profile::V1_16 | Profile::V1_17 => vec![
            "cilium_ipcache_v2",
            "cilium_policystats",
            "cilium_policy_v3_01000",
        ],
        Profile::V1_18 | Profile::V1_19 => vec![
            "cilium_ipcache",
            "cilium_tunnel_map",
            "cilium_policy_v3_01000",
        ],
        Profile::V1_20 => vec![
            "cilium_ipcache",
            "cilium_tunnel_map",
            "cilium_policy_v2_01000",
        ],
    }
}

fn check_lab(profile: Profile, attach: AttachMode) {
    let lab = lab(|s| {
        s.profile = profile;
        s.attach = attach;
    });
    let ns = lab.node_ns();
    // Devices exist in the node namespace, as veths.
    let links = sh("ip", &["-n", &ns, "-d", "-o", "link", "show"]);
    for dev in ["eth0", "eth1", "cilium_host", "cilium_net"] {
        assert!(
            links
                .lines()
                .any(|l| l.contains(&format!(": {dev}@")) && l.contains("veth")),
            "{dev} missing:\n{links}"
        );
    }
    assert_eq!(
        links.lines().filter(|l| l.contains(": lxc")).count(),
        3,
        "3 lxc devices:\n{links}"
    );

    // cil_from_netdev on eth0 and eth1, the way the attach mode says.
    for dev in ["eth0", "eth1"] {
        match attach {
            AttachMode::Tc => {
                let f = sh("tc", &["-n", &ns, "filter", "show", "dev", dev, "ingress"]);
                assert!(
                    f.contains(&format!("handle 0x1 cil_from_netdev-{dev} direct-action")),
                    "tc filter on {dev}:\n{f}"
                );
                let e = sh("tc", &["-n", &ns, "filter", "show", "dev", dev, "egress"]);
                assert!(
                    e.contains(&format!("cil_to_netdev-{dev}")),
                    "egress filter on {dev}:\n{e}"
                );
            }
            AttachMode::Tcx => {
                let pin = lab
                    .state
                    .bpffs
                    .join(format!("cilium/devices/{dev}/links/cil_from_netdev"));
                let link = bpftool_json(&["link", "show", "pinned", &pin.to_string_lossy()]);
                assert_eq!(link["type"], 11, "BPF_LINK_TYPE_TCX: {link}");
                let prog = bpftool_json(&["prog", "show", "id", &link["prog_id"].to_string()]);
                assert_eq!(prog["name"], "cil_from_netdev");
                assert_eq!(prog["type"], "sched_cls");
                // No legacy filters in tcx mode.
                let f = sh("tc", &["-n", &ns, "filter", "show", "dev", dev, "ingress"]);
                assert!(
                    !f.contains("cil_from_netdev"),
                    "unexpected tc filter in tcx mode: {f}"
                );
            }
        }
    }
    // The 15-character kernel name of cil_from_container.
    let progs = bpftool_json(&["prog", "show"]);
    let ids: Vec<u64> = lab
        .state
        .attachments
        .iter()
        .filter(|a| a.program == "cil_from_container")
        .map(|a| a.prog_id as u64)
        .collect();
    assert_eq!(ids.len(), 3);
    for p in progs
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| ids.contains(&p["id"].as_u64().unwrap()))
    {
        assert!(
            p["name"].as_str().unwrap().starts_with("cil_from_conta"),
            "{p}"
        );
    }

    // The profile's maps are pinned (and the other versions' names are not).
    let globals = lab.state.bpffs.join("tc/globals");
    for m in expected_maps(profile) {
        let info = bpftool_json(&["map", "show", "pinned", &globals.join(m).to_string_lossy()]);
        assert!(info["id"].as_u64().is_some(), "{m}: {info}");
    }
    for m in absent_maps(profile) {
        assert!(
            !globals.join(m).exists(),
            "{m} must not exist in the {profile} profile"
        );
    }
    let metrics = bpftool_json(&[
        "map",
        "show",
        "pinned",
        &globals.join("cilium_metrics").to_string_lossy(),
    ]);
    assert_eq!(metrics["type"], "percpu_hash");
    assert_eq!(metrics["bytes_key"], 8);
    assert_eq!(metrics["bytes_value"], 16);
    let services = bpftool_json(&[
        "map",
        "dump",
        "pinned",
        &globals.join("cilium_lb4_services_v2").to_string_lossy(),
    ]);
    assert!(
        !services.as_array().unwrap().is_empty(),
        "LB services have entries"
    );

    // The DNS VIP answers, the gateway VIP accepts connections, from the node namespace.
    let dig = in_node(
        &lab,
        "dig",
        &[
            "+time=1",
            "+tries=2",
            "+short",
            "@198.51.100.53",
            "gateway.lab.stepguard.test",
        ],
    );
    assert_eq!(String::from_utf8_lossy(&dig.stdout).trim(), "198.51.100.10");
    assert_eq!(
        http_status_from_node(&lab, "http://198.51.100.10/healthz"),
        "200"
    );

    // cilium-config is a kubelet-style mount.
    let cfg = &lab.state.cilium_config;
    assert!(std::fs::symlink_metadata(cfg.join("..data"))
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(
        std::fs::read_link(cfg.join("devices")).unwrap(),
        Path::new("..data/devices")
    );
    assert_eq!(
        std::fs::read_to_string(cfg.join("enable-tcx")).unwrap(),
        if attach == AttachMode::Tcx {
            "true"
        } else {
            "false"
        }
    );
}

#[test]
fn lab_comes_up_cilium_1_16_tcx() {
    check_lab(Profile::V1_16, AttachMode::Tcx);
}
#[test]
fn lab_comes_up_cilium_1_16_tc() {
    check_lab(Profile::V1_16, AttachMode::Tc);
}
#[test]
fn lab_comes_up_cilium_1_18_tcx() {
    check_lab(Profile::V1_18, AttachMode::Tcx);
}
#[test]
fn lab_comes_up_cilium_1_18_tc() {
    check_lab(Profile::V1_18, AttachMode::Tc);
}
#[test]
fn lab_comes_up_cilium_1_20_tcx() {
    check_lab(Profile::V1_20, AttachMode::Tcx);
}
#[test]
fn lab_comes_up_cilium_1_20_tc() {
    check_lab(Profile::V1_20, AttachMode::Tc);
}

#[test]
fn xdp_attaches_cil_xdp_entry_to_the_host_devices() {
    let lab = lab(|s| s.xdp = true);
    for dev in ["eth0", "eth1"] {
        let l = sh(
            "ip",
            &["-n", &lab.node_ns(), "-d", "link", "show", "dev", dev],
        );
        assert!(l.contains("xdp"), "{dev} has an XDP program:\n{l}");
        let pin = lab
            .state
            .bpffs
            .join(format!("cilium/devices/{dev}/links/cil_xdp_entry"));
        let link = bpftool_json(&["link", "show", "pinned", &pin.to_string_lossy()]);
        let prog = bpftool_json(&["prog", "show", "id", &link["prog_id"].to_string()]);
        assert_eq!(prog["name"], "cil_xdp_entry");
    }
    assert_eq!(
        http_status_from_node(&lab, "http://198.51.100.10/"),
        "200",
        "traffic passes XDP"
    );
}
