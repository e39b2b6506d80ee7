//! `stepguard check` against the lab: a healthy node passes every check in every profile and
//! attach mode; each fault is caught with its reason code; what cannot be checked is never a
//! pass; and the check leaves Cilium's maps and attachments exactly as they were.
mod common;
use common::*;
use std::time::Duration;
use stepguard_lab::{AttachMode, Profile, RestartOpts};

fn healthy(profile: Profile, attach: AttachMode) {
    let lab = lab(|s| {
        s.profile = profile;
        s.attach = attach;
    });
    let (code, v, err) = check(&lab, &[]);
    assert_eq!(code, 0, "all checks pass: {v:#}\n{err}");
    for c in ["devices", "maps", "vips", "dns", "config"] {
        assert_eq!(result(&v, c)["status"], "pass", "{c}: {}", result(&v, c));
    }
    let dev = &result(&v, "devices")["evidence"];
    assert_eq!(dev["selected"], serde_json::json!(["eth0", "eth1"]));
    for d in ["eth0", "eth1"] {
        let e = dev["devices"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["device"] == d)
            .unwrap();
        let p = e["programs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["hook"] == "ingress")
            .unwrap();
        let want = lab
            .state
            .attachments
            .iter()
            .find(|a| a.device == d && a.program == "cil_from_netdev")
            .unwrap()
            .prog_id;
        assert_eq!(p["prog_id"].as_u64(), Some(want as u64), "{d} program id");
        assert_eq!(
            p["via"],
            if attach == AttachMode::Tcx {
                "tcx"
            } else {
                "tc"
            }
        );
        assert!(
            p["loaded_at"].as_f64().unwrap() > 1.7e9,
            "load time is wall clock"
        );
    }
    let maps = &result(&v, "maps")["evidence"];
    assert_eq!(maps["cilium"], profile.to_string());
    let entries = |n: &str| {
        maps["maps"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == n)
            .unwrap_or_else(|| panic!("{n} listed"))["entries"]
            .as_u64()
    };
    let ipcache = if profile.before_1_18() {
        "cilium_ipcache"
    } else {
        "cilium_ipcache_v2"
    };
    for m in [
        "cilium_ct4_global",
        "cilium_lb4_services_v2",
        ipcache,
        "cilium_lxc",
    ] {
        assert!(entries(m).unwrap() > 0, "{m} has entries");
    }
    assert_eq!(
        entries("cilium_ct4_global"),
        Some(64),
        "exact count of the lab's conntrack entries"
    );
    // auto infers the same version.
    let (code, v, _) = check(&lab, &["--cilium", "auto", "--only", "maps"]);
    assert_eq!(code, 0);
    assert_eq!(
        result(&v, "maps")["evidence"]["cilium"],
        profile.to_string()
    );
    assert!(result(&v, "maps")["evidence"]["cilium_from"]
        .as_str()
        .unwrap()
        .starts_with("inferred"));
}

#[test]
fn a_healthy_node_passes_1_16_tcx() {
    healthy(Profile::V1_16, AttachMode::Tcx);
}
#[test]
fn a_healthy_node_passes_1_16_tc() {
    healthy(Profile::V1_16, AttachMode::Tc);
}
#[test]
fn a_healthy_node_passes_1_18_tcx() {
    healthy(Profile::V1_18, AttachMode::Tcx);
}
#[test]
fn a_healthy_node_passes_1_18_tc() {
    healthy(Profile::V1_18, AttachMode::Tc);
}
#[test]
fn a_healthy_node_passes_1_20_tcx() {
    healthy(Profile::V1_20, AttachMode::Tcx);
}
#[test]
fn a_healthy_node_passes_1_20_tc() {
    healthy(Profile::V1_20, AttachMode::Tc);
}

fn dropped_device_is_named(attach: AttachMode) {
    let mut lab = lab(|s| s.attach = attach);
    lab.restart(&RestartOpts {
        down: Duration::from_millis(10),
        blackhole: true,
        drop_device: Some("eth1".into()),
        ..Default::default()
    })
    .unwrap();
    let (code, v, _) = check(&lab, &["--only", "devices"]);
    assert_eq!(code, 1);
    let r = result(&v, "devices");
    assert_eq!(r["code"], "device_missing");
    assert!(r["reason"].as_str().unwrap().contains("eth1"), "{r}");
    assert_eq!(r["evidence"]["missing"], serde_json::json!(["eth1"]));
}

#[test]
fn a_dropped_device_is_caught_and_named_tcx() {
    dropped_device_is_named(AttachMode::Tcx);
}
#[test]
fn a_dropped_device_is_caught_and_named_tc() {
    dropped_device_is_named(AttachMode::Tc);
}

#[test]
fn an_unexpected_extra_device_is_caught_and_named() {
    let mut lab = lab(|_| {});
    lab.add_host_device("eth2").unwrap();
    let (code, v, _) = check(&lab, &["--only", "devices"]);
    assert_eq!(code, 1);
    let r = result(&v, "devices");
    assert_eq!(r["code"], "device_unexpected");
    assert!(r["reason"].as_str().unwrap().contains("eth2"), "{r}");
}

#[test]
fn a_lost_map_is_caught_and_named() {
    let mut lab = lab(|_| {});
    lab.restart(&RestartOpts {
        down: Duration::from_millis(10),
        blackhole: true,
        lose_map: Some("cilium_lb4_services_v2".into()),
        ..Default::default()
    })
    .unwrap();
    let (code, v, _) = check(&lab, &["--only", "maps"]);
    assert_eq!(code, 1);
    let r = result(&v, "maps");
    assert_eq!(r["code"], "map_missing");
    assert_eq!(
        r["evidence"]["missing"],
        serde_json::json!(["cilium_lb4_services_v2"])
    );
}

#[test]
fn a_blackholed_datapath_fails_vips_and_dns() {
    let lab = lab(|_| {});
    blackhole(&lab, true);
    let (code, v, _) = check(&lab, &["--only", "vips,dns"]);
    blackhole(&lab, false);
    assert_eq!(code, 1, "{v:#}");
    assert_eq!(result(&v, "vips")["status"], "fail");
    assert_eq!(result(&v, "vips")["code"], "vip_unreachable");
    assert_eq!(result(&v, "dns")["status"], "fail");
    let (code, _, _) = check(&lab, &["--only", "vips,dns"]);
    assert_eq!(code, 0, "both recover once the blackhole is lifted");
}

/// The `https` probe kind on the lab's Gateway VIP: nginx serves TLS on 443 with a
/// certificate of the lab's CA; the probe goes through the node's (fake) datapath like any.
#[test]
fn an_https_gateway_vip_is_verified_through_the_datapath() {
    let lab = lab(|_| {});
    let base = std::fs::read_to_string(lab.stepguard_config()).unwrap();
    let with = |extra: &str| {
        let cfg = base.replacen(
            "targets:\n",
            &format!(
                "targets:\n  - {{name: gateway-tls, address: {}, probe: https, path: /healthz, timeout: 1s{extra}}}\n",
                stepguard_lab::GATEWAY_VIP
            ),
            1,
        );
        let path = lab
            .stepguard_config()
            .with_file_name(format!("stepguard-https-{}.yaml", extra.len()));
        std::fs::write(&path, cfg).unwrap();
        path
    };
    let tls = |v: &serde_json::Value| {
        result(v, "vips")["evidence"]["targets"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == "gateway-tls")
            .cloned()
            .unwrap_or_default()
    };
    let verified = with(&format!(
        ", server_name: gateway.{}, ca: {}",
        stepguard_lab::DNS_ZONE,
        lab.gateway_ca().display()
    ));
    let verified = verified.to_string_lossy().into_owned();
    let (code, v, err) = check(&lab, &["--only", "vips", "--config", &verified]);
    assert_eq!(code, 0, "{v:#} {err}");
    let t = tls(&v);
    assert_eq!(t["port"], 443, "{t}");
    assert!(
        t["detail"]
            .as_str()
            .unwrap()
            .starts_with("HTTPS 200 (TLSv1_"),
        "{t}"
    );
    assert!(
        t["detail"]
            .as_str()
            .unwrap()
            .ends_with(", certificate verified)"),
        "{t}"
    );

    // A name the certificate does not carry: the handshake fails, the target with it.
    let wrong = with(&format!(
        ", server_name: other.{}, ca: {}",
        stepguard_lab::DNS_ZONE,
        lab.gateway_ca().display()
    ));
    let (code, v, _) = check(
        &lab,
        &["--only", "vips", "--config", &wrong.to_string_lossy()],
    );
    assert_eq!(code, 1, "{v:#}");
    assert_eq!(result(&v, "vips")["code"], "vip_unreachable");
    assert!(
        tls(&v)["detail"]
            .as_str()
            .unwrap()
            .contains("invalid peer certificate"),
        "{v:#}"
    );

    // The datapath blackholed: the TLS VIP is unreachable like the others.
    blackhole(&lab, true);
    let (code, v, _) = check(&lab, &["--only", "vips", "--config", &verified]);
    blackhole(&lab, false);
    assert_eq!(code, 1, "{v:#}");
    assert_eq!(tls(&v)["ok"], false, "{v:#}");
    let (code, v, _) = check(&lab, &["--only", "vips", "--config", &verified]);
    assert_eq!(code, 0, "recovers once the blackhole is lifted: {v:#}");
}

#[test]
fn a_wrong_profile_names_the_differences() {
    let lab = lab(|s| s.profile = Profile::V1_20);
    let (code, v, _) = check(&lab, &["--cilium", "1.16", "--only", "maps"]);
    assert_eq!(code, 1);
    let r = result(&v, "maps");
    assert_eq!(r["code"], "map_missing");
    let reason = r["reason"].as_str().unwrap();
    for n in [
        "cilium_ipcache",
        "cilium_tunnel_map",
        "cilium_ipcache_v2",
        "cilium_policy_v3_*",
        "looks like Cilium 1.20",
    ] {
        assert!(reason.contains(n), "{n} in {reason}");
    }
}

#[test]
fn a_config_change_without_a_restart_fails_until_the_restart() {
    let mut lab = lab(|_| {});
    let state = lab.state.run_dir.join("agent-state");
    let state_arg = state.to_string_lossy().into_owned();
    let (code, _, _) = check(&lab, &["--only", "config", "--state-dir", &state_arg]);
    assert_eq!(code, 0, "config in effect at first");
    // Judged from content (what the agent's API says it loaded), not timestamps: no need to
    // wait past a clock slack.
    lab.config_set(&[("devices".into(), "eth0 eth1 eth2".into())])
        .unwrap();
    let (code, v, _) = check(&lab, &["--only", "config", "--state-dir", &state_arg]);
    assert_eq!(code, 1);
    let r = result(&v, "config");
    assert_eq!(r["code"], "config_not_applied");
    assert!(
        r["reason"]
            .as_str()
            .unwrap()
            .contains("changed keys: devices"),
        "{r}"
    );
    lab.restart(&RestartOpts {
        down: Duration::from_millis(10),
        blackhole: true,
        ..Default::default()
    })
    .unwrap();
    let (code, v, _) = check(&lab, &["--only", "config", "--state-dir", &state_arg]);
    assert_eq!(code, 0, "{}", result(&v, "config"));
    // An edit that lands just before a restart is loaded by it: no false failure.
    lab.config_set(&[("devices".into(), "eth0 eth1".into())])
        .unwrap();
    lab.restart(&RestartOpts {
        down: Duration::from_millis(10),
        blackhole: true,
        ..Default::default()
    })
    .unwrap();
    let (code, v, _) = check(&lab, &["--only", "config", "--state-dir", &state_arg]);
    assert_eq!(code, 0, "{}", result(&v, "config"));
}

/// A per-node override (a CiliumNodeConfig), given with the lab's CLI: like Cilium's, it is
/// loaded when the agent next starts. The check sees the value the ConfigMap never had and
/// reports it as an override, never as "not applied".
#[test]
fn a_per_node_override_is_seen_not_failed() {
    let mut lab = lab(|_| {});
    let state = lab.state.run_dir.join("agent-state");
    let state_arg = state.to_string_lossy().into_owned();
    let (code, _, _) = check(&lab, &["--only", "config", "--state-dir", &state_arg]);
    assert_eq!(code, 0, "the ConfigMap as loaded, remembered");
    let prefix = lab.state.spec.prefix.clone();
    let out = sh(
        &bin("STEPGUARD_LAB_BIN", "stepguard-lab").to_string_lossy(),
        &[
            "config",
            "override",
            "--prefix",
            &prefix,
            "cluster-name=overridden-here",
        ],
    );
    assert!(out.contains("cluster-name=overridden-here"), "{out}");
    // The lab's state on disk carries the override into the next restart.
    lab.0 = stepguard_lab::Lab::open(&prefix).unwrap();
    lab.restart(&RestartOpts {
        down: Duration::from_millis(10),
        ..Default::default()
    })
    .unwrap();
    let (code, v, _) = check(&lab, &["--only", "config", "--state-dir", &state_arg]);
    let r = result(&v, "config");
    assert_eq!(code, 0, "{r}");
    assert!(
        r["reason"]
            .as_str()
            .unwrap()
            .contains("per-node overrides: cluster-name"),
        "{r}"
    );
}

/// Cilium reloads its datapath without reading its config again (a device change): new
/// program ids are no evidence that an edit was applied (the false pass of the old
/// timestamp rule). The check still names the key as not applied.
#[test]
fn a_reload_without_a_config_read_is_still_not_applied() {
    let mut lab = lab(|_| {});
    let state = lab.state.run_dir.join("agent-state");
    let state_arg = state.to_string_lossy().into_owned();
    let (code, _, _) = check(&lab, &["--only", "config", "--state-dir", &state_arg]);
    assert_eq!(code, 0);
    lab.config_set(&[("enable-ipv6".into(), "true".into())])
        .unwrap();
    lab.restart(&RestartOpts {
        down: Duration::from_millis(10),
        keep_config: true,
        ..Default::default()
    })
    .unwrap();
    let (code, v, _) = check(&lab, &["--only", "config", "--state-dir", &state_arg]);
    let r = result(&v, "config");
    assert_eq!(code, 1, "{r}");
    assert_eq!(r["code"], "config_not_applied", "{r}");
    assert!(
        r["reason"]
            .as_str()
            .unwrap()
            .contains("changed keys: enable-ipv6"),
        "{r}"
    );
}

#[test]
fn an_empty_bpffs_is_never_a_pass() {
    let lab = lab(|_| {});
    let empty = lab.state.run_dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let (code, v, _) = check(
        &lab,
        &[
            "--only",
            "maps,devices",
            "--bpffs",
            &empty.to_string_lossy(),
        ],
    );
    assert_ne!(code, 0);
    assert_eq!(result(&v, "maps")["code"], "bpffs_missing");
    // A bpffs without Cilium's pins: the profile's maps are all missing (with the version
    // given: `auto` cannot infer one from nothing, and says so, unknown).
    sh("mount", &["-t", "bpf", "bpf", &empty.to_string_lossy()]);
    let (code, v, _) = check(
        &lab,
        &["--only", "maps", "--bpffs", &empty.to_string_lossy()],
    );
    assert_eq!(code, 2, "{v}");
    assert_eq!(result(&v, "maps")["code"], "version_unknown");
    let (code, v, _) = check(
        &lab,
        &[
            "--only",
            "maps",
            "--cilium",
            "1.18",
            "--bpffs",
            &empty.to_string_lossy(),
        ],
    );
    sh("umount", &[&empty.to_string_lossy()]);
    assert_eq!(code, 1);
    assert_eq!(result(&v, "maps")["code"], "map_missing");
    let (code, v, _) = check(
        &lab,
        &[
            "--only",
            "maps",
            "--bpffs",
            &empty.to_string_lossy(),
            "--cilium",
            "auto",
        ],
    );
    assert_ne!(code, 0, "{v}");
}

#[test]
fn a_stopped_dns_server_is_never_a_pass() {
    let lab = lab(|_| {});
    let dnsmasq = lab
        .state
        .procs
        .iter()
        .find(|p| p.what == "dnsmasq")
        .unwrap();
    stepguard_lab::sys::process::stop(dnsmasq);
    let (code, v, _) = check(&lab, &["--only", "dns,vips"]);
    assert_eq!(code, 1, "{v:#}");
    assert_eq!(result(&v, "dns")["status"], "fail");
    assert!(
        result(&v, "dns")["reason"]
            .as_str()
            .unwrap()
            .contains("refused"),
        "{}",
        result(&v, "dns")
    );
}

#[test]
fn without_cap_bpf_and_cap_sys_admin_nothing_passes_overall() {
    let lab = lab(|_| {});
    let stepguard = bin("STEPGUARD_BIN", "stepguard");
    let out = std::process::Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", lab.node_ns()))
        .args(["--", "capsh", "--drop=cap_bpf,cap_sys_admin", "--", "-c"])
        .arg(format!(
            "{} check --format json --config {}",
            stepguard.display(),
            lab.stepguard_config().display()
        ))
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_ne!(out.status.code(), Some(0), "{v:#}");
    assert_eq!(result(&v, "devices")["status"], "unknown");
    assert_eq!(result(&v, "devices")["code"], "no_permission");
    // The config check asks the agent's API socket, which needs no BPF capability.
    assert_eq!(result(&v, "config")["status"], "pass", "{v:#}");
}

#[test]
fn bad_config_stops_with_one_line_naming_the_field_and_exit_2() {
    let lab = lab(|_| {});
    for (text, needle) in [
        (
            "targets:\n  - {name: gw, address: 198.51.100.999, probe: tcp, port: 80}\n",
            "targets",
        ),
        ("dns:\n  timeout: fast\n", "invalid duration"),
        ("frobnicate: true\n", "unknown field `frobnicate`"),
    ] {
        let path = lab.state.run_dir.join("bad.yaml");
        std::fs::write(&path, text).unwrap();
        let (code, v, err) = check(&lab, &["--config", &path.to_string_lossy()]);
        assert_eq!(code, 2);
        assert_eq!(v, serde_json::Value::Null, "nothing else runs");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains(needle), "{needle} in {err}");
    }
    let (code, _, err) = check(&lab, &["--config", "/nonexistent/stepguard.yaml"]);
    assert_eq!(code, 2);
    assert!(err.contains("/nonexistent/stepguard.yaml"), "{err}");
}

/// Everything the datapath holds: every pinned map's contents and every attachment.
fn datapath_fingerprint(lab: &stepguard_lab::Lab) -> String {
    let mut out = String::new();
    let globals = lab.state.bpffs.join("tc/globals");
    let mut names: Vec<_> = std::fs::read_dir(&globals)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    names.sort();
    for p in names {
        let info = bpftool_json(&["map", "show", "pinned", &p.to_string_lossy()]);
        out.push_str(&format!("{} {}\n", p.display(), info["id"]));
        if !matches!(
            info["type"].as_str(),
            Some("perf_event_array") | Some("prog_array")
        ) {
            out.push_str(&sh(
                "bpftool",
                &["map", "dump", "pinned", &p.to_string_lossy()],
            ));
        }
    }
    for d in ["eth0", "eth1", "cilium_host", "cilium_net"] {
        for dir in ["ingress", "egress"] {
            out.push_str(&sh(
                "tc",
                &["-n", &lab.node_ns(), "filter", "show", "dev", d, dir],
            ));
        }
    }
    for a in &lab.state.attachments {
        if let Some(pin) = &a.link_pin {
            out.push_str(&sh(
                "bpftool",
                &["link", "show", "pinned", &pin.to_string_lossy()],
            ));
        }
    }
    out
}

fn check_changes_nothing(attach: AttachMode) {
    let lab = lab(|s| s.attach = attach);
    let before = datapath_fingerprint(&lab);
    let (code, _, _) = check(&lab, &[]);
    assert_eq!(code, 0);
    assert_eq!(
        datapath_fingerprint(&lab),
        before,
        "maps and attachments are identical after a full check"
    );
}

#[test]
fn a_full_check_changes_no_map_and_no_attachment_tcx() {
    check_changes_nothing(AttachMode::Tcx);
}
#[test]
fn a_full_check_changes_no_map_and_no_attachment_tc() {
    check_changes_nothing(AttachMode::Tc);
}

#[test]
fn a_write_through_the_agents_map_handle_fails() {
    use aya::maps::{HashMap, Map, MapData};
    let lab = lab(|_| {});
    let pin = lab.state.bpffs.join("tc/globals/cilium_lb4_backends_v3");
    let fd = stepguard::kernel::bpf::obj_get_rdonly(&pin).expect("open read-only");
    let map = Map::HashMap(MapData::from_fd(fd).expect("aya from the read-only fd"));
    let mut backends: HashMap<_, u32, [u8; 12]> = HashMap::try_from(map).unwrap();
    assert!(
        backends.get(&1u32.to_be(), 0).is_ok() || backends.keys().count() > 0,
        "reads work"
    );
    let err = backends
        .insert(777u32, [0u8; 12], 0)
        .expect_err("the write must fail");
    assert!(
        format!("{err:?}").contains("PermissionDenied")
            || format!("{err}").to_lowercase().contains("permission")
            || format!("{err:?}").contains("os error 1"),
        "{err:?}"
    );
    let err = backends
        .remove(&1u32.to_be())
        .expect_err("delete must fail too");
    let _ = err;
    // And the map is unchanged.
    let dump = bpftool_json(&["map", "dump", "pinned", &pin.to_string_lossy()]);
    assert_eq!(dump.as_array().unwrap().len(), 2);
}

/// The features a node's configuration turns on decide the maps, as Cilium creates them.
/// An IPv6-only node (`enable-ipv4: false`) has no IPv4 conntrack or load-balancing maps
/// (`ctmap.Maps(ipv4, ipv6)`, `pkg/maps/ctmap/ctmap.go` l. 732; `BPFLBMaps.allMaps`,
/// `pkg/loadbalancer/maps/lbmaps.go` l. 314–369, 1.20.2): held to the IPv6 ones only, one of
/// those missing fails. `enable-node-port`, a key 1.19 removed, asks for no SNAT maps on 1.20;
/// on 1.18 it does (NodePort without kube-proxy replacement).
#[test]
fn the_maps_a_node_must_have_follow_its_families_and_its_release() {
    let v6 = lab(|s| {
        s.profile = Profile::V1_20;
        s.features.ipv4 = false;
        s.features.ipv6 = true;
    });
    let (code, v, err) = check(&v6, &["--only", "maps"]);
    let r = result(&v, "maps");
    assert_eq!(code, 0, "{r}\n{err}");
    assert_eq!(r["evidence"]["features"]["ipv4"], false, "{r}");
    let required = r["evidence"]["required"].as_array().unwrap();
    assert!(required.contains(&"cilium_ct6_global".into()), "{r}");
    assert!(
        !required.iter().any(|m| m.as_str().unwrap().contains('4')
            && m.as_str().unwrap().starts_with("cilium_ct")
            || m.as_str().unwrap().starts_with("cilium_lb4")),
        "no IPv4 map required: {r}"
    );
    std::fs::remove_file(v6.state.bpffs.join("tc/globals/cilium_lb6_services_v2")).unwrap();
    let (code, v, _) = check(&v6, &["--only", "maps"]);
    let r = result(&v, "maps");
    assert_eq!((code, r["code"].as_str()), (1, Some("map_missing")), "{r}");
    assert_eq!(
        r["evidence"]["missing"],
        serde_json::json!(["cilium_lb6_services_v2"])
    );
    drop(v6);

    for (profile, snat) in [(Profile::V1_20, false), (Profile::V1_18, true)] {
        let lab = lab(|s| {
            s.profile = profile;
            s.features.kube_proxy_replacement = false;
            s.features.l2_announcements = false;
        });
        lab.config_set(&[("enable-node-port".into(), "true".into())])
            .unwrap();
        let (code, v, err) = check(&lab, &["--only", "maps"]);
        let r = result(&v, "maps");
        assert_eq!(r["evidence"]["features"]["snat"], snat, "{profile}: {r}");
        if snat {
            assert_eq!((code, r["code"].as_str()), (1, Some("map_missing")), "{r}");
            assert!(
                r["reason"]
                    .as_str()
                    .unwrap()
                    .contains("cilium_snat_v4_external"),
                "{r}"
            );
        } else {
            assert_eq!(code, 0, "{profile}: {r}\n{err}");
        }
    }
}

/// Keys the agent does not wait for a restart to apply are never "merged but inert": one only
/// cilium-operator reads (`identity-gc-interval`), and `subnet-topology`, which a 1.20 agent in
/// hybrid routing watches while it runs (`pkg/subnet/cell.go`). A key the agent reads at its
/// start edited beside them still fails until the restart.
#[test]
fn keys_the_agent_applies_without_a_restart_are_not_merged_but_inert() {
    let mut lab = lab(|s| s.profile = Profile::V1_20);
    let state = lab.state.run_dir.join("agent-state");
    let state = state.to_string_lossy().into_owned();
    let one = |lab: &stepguard_lab::Lab| {
        let (code, v, err) = check(lab, &["--only", "config", "--state-dir", &state]);
        assert!(v.is_object(), "{err}");
        (code, result(&v, "config").clone())
    };
    lab.config_set(&[
        ("routing-mode".into(), "hybrid".into()),
        ("subnet-topology".into(), "192.0.2.0/24".into()),
        ("identity-gc-interval".into(), "15m0s".into()),
    ])
    .unwrap();
    lab.restart(&RestartOpts {
        down: Duration::from_millis(10),
        ..Default::default()
    })
    .unwrap();
    let (code, r) = one(&lab);
    assert_eq!(code, 0, "loaded at the restart: {r}");
    lab.config_set(&[
        (
            "subnet-topology".into(),
            "192.0.2.0/24,198.51.100.0/24".into(),
        ),
        ("identity-gc-interval".into(), "30m0s".into()),
    ])
    .unwrap();
    let (code, r) = one(&lab);
    assert_eq!(code, 0, "{r}");
    let reason = r["reason"].as_str().unwrap();
    assert!(
        reason.contains("applied while it runs (it reports its start value): subnet-topology"),
        "{r}"
    );
    assert!(reason.contains("keys only cilium-operator reads"), "{r}");
    assert!(
        r["evidence"]["operator_keys"]
            .as_array()
            .unwrap()
            .contains(&"identity-gc-interval".into()),
        "{r}"
    );
    // A key the agent reads only at its start, edited beside them.
    lab.config_set(&[("enable-l2-announcements".into(), "false".into())])
        .unwrap();
    let (code, r) = one(&lab);
    assert_eq!(
        (code, r["code"].as_str()),
        (1, Some("config_not_applied")),
        "{r}"
    );
    assert!(
        r["reason"]
            .as_str()
            .unwrap()
            .ends_with("changed keys: enable-l2-announcements"),
        "{r}"
    );
}
