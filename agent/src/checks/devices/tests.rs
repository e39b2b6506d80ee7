use super::*;
use crate::checks::Status;
use crate::kernel::links::AttachedProgram;

fn prog(hook: &'static str, name: &str) -> AttachedProgram {
    AttachedProgram {
        hook,
        via: "tcx",
        prog_id: 7,
        name: Some(name.into()),
        filter: None,
        loaded_at: Some(1.0),
        link_pin: None,
    }
}
fn dev(name: &str, progs: &[(&'static str, &str)]) -> Device {
    Device {
        name: name.into(),
        ifindex: 2,
        up: true,
        loopback: false,
        port: false,
        kind: Some("veth".into()),
        has_controller: false,
        controller: None,
        alt_names: vec![],
        addresses: 1,
        global_addrs: vec!["192.0.2.1".parse().unwrap()],
        default_route: true,
        global_route: true,
        programs: progs.iter().map(|(h, n)| prog(h, n)).collect(),
    }
}
fn sel(d: &Device, filter: &[String], force: bool) -> bool {
    selected_by_cilium(d, &[], filter, force, SelectionRules::newest())
}
fn node(extra: Vec<Device>) -> Observation {
    let mut devices = vec![
        dev(
            "eth0",
            &[("ingress", "cil_from_netdev"), ("egress", "cil_to_netdev")],
        ),
        dev("eth1", &[("ingress", "cil_from_netdev")]),
        dev(
            "cilium_host",
            &[("ingress", "cil_to_host"), ("egress", "cil_from_host")],
        ),
        dev("lo", &[]),
    ];
    devices.extend(extra);
    Observation {
        devices,
        ..Default::default()
    }
}
fn pats(p: &[&str]) -> Expected {
    Expected::Patterns {
        patterns: p.iter().map(|s| s.to_string()).collect(),
        source: "test".into(),
        force: false,
    }
}

fn cfg(pairs: &[(&str, &str)]) -> std::collections::BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// `AreDevicesRequired()` per condition and release (docs/cilium-fidelity.md).
#[test]
fn to_netdev_is_required_per_condition_and_release() {
    let req = |pairs: &[(&str, &str)], r: Option<&str>| to_netdev_required(&cfg(pairs), r).because;
    for k in [
        "kube-proxy-replacement",
        "enable-host-firewall",
        "enable-wireguard",
        "enable-l2-announcements",
        "enable-bpf-masquerade",
    ] {
        for r in [Some("1.16"), Some("1.18"), Some("1.20"), None] {
            assert_eq!(req(&[(k, "true")], r), [k], "{k} at {r:?}");
        }
    }
    assert_eq!(
        req(&[("kube-proxy-replacement", "strict")], None),
        ["kube-proxy-replacement"]
    );
    for v in ["1", "t", "T", "TRUE", "True"] {
        assert_eq!(
            req(&[("enable-host-firewall", v)], None),
            ["enable-host-firewall"],
            "{v}"
        );
    }
    assert_eq!(
        req(&[("enable-node-port", "true")], Some("1.18")),
        ["enable-node-port"]
    );
    assert!(
        req(&[("enable-node-port", "true")], Some("1.19")).is_empty(),
        "gone on main"
    );
    assert_eq!(
        req(&[("enable-ipsec", "true")], Some("1.17")),
        ["enable-ipsec"]
    );
    assert!(req(&[("enable-ipsec", "true")], Some("1.16")).is_empty());
    assert_eq!(
        req(&[("enable-ipsec-encrypted-overlay", "true")], Some("1.16")),
        ["enable-ipsec-encrypted-overlay"]
    );
    assert_eq!(
        req(&[("enable-high-scale-ipcache", "true")], Some("1.17")),
        ["enable-high-scale-ipcache"]
    );
    assert!(req(&[("enable-high-scale-ipcache", "true")], Some("1.18")).is_empty());
    assert!(req(&[("enable-high-scale-ipcache", "true")], None).is_empty());
    for k in ["enable-bandwidth-manager", "enable-ipv4-egress-gateway"] {
        assert!(
            req(&[(k, "true")], Some("1.18")).is_empty(),
            "{k} is no condition"
        );
    }
    assert!(req(&[("kube-proxy-replacement", "false")], None).is_empty());
}

#[test]
fn a_required_cil_to_netdev_must_be_on_every_selected_device() {
    let exp = pats(&["eth0", "eth1"]);
    let mut need = ToNetdev {
        because: vec!["enable-host-firewall".into()],
        unconfirmed: false,
    };
    let r = evaluate_with(&node(vec![]), &exp, &need);
    assert_eq!(
        (r.status, r.code.as_str()),
        (Status::Fail, "to_netdev_missing")
    );
    assert_eq!(r.evidence["to_netdev_missing"], json!(["eth1"]));
    assert!(
        r.reason.contains("enable-host-firewall=true"),
        "{}",
        r.reason
    );
    need.unconfirmed = true;
    let r = evaluate_with(&node(vec![]), &exp, &need);
    assert_eq!(
        (r.status, r.code.as_str()),
        (Status::Unknown, "to_netdev_unconfirmed"),
        "the ConfigMap alone, the agent unread"
    );
    let r = evaluate_with(&node(vec![]), &exp, &ToNetdev::default());
    assert_eq!(r.status, Status::Pass, "not required: {}", r.reason);
}

#[test]
fn patterns_match_like_cilium() {
    assert!(matches("eth+", "eth12"));
    assert!(!matches("eth+", "ens3"));
    assert!(matches("eth0", "eth0") && !matches("eth0", "eth01"));
    assert_eq!(
        split_devices("eth0 eth1,bond0"),
        vec!["eth0", "eth1", "bond0"]
    );
}

#[test]
fn the_expected_set_passes_with_program_evidence() {
    let r = evaluate(&node(vec![]), &pats(&["eth+"]));
    assert_eq!(r.status, Status::Pass, "{r:?}");
    assert_eq!(r.evidence["selected"], json!(["eth0", "eth1"]));
}

#[test]
fn a_missing_device_is_named() {
    let mut o = node(vec![]);
    o.devices[1].programs.clear();
    let r = evaluate(&o, &pats(&["eth0", "eth1"]));
    assert_eq!(
        (r.status, r.code.as_str()),
        (Status::Fail, "device_missing")
    );
    assert!(r.reason.contains("eth1"), "{}", r.reason);
}

#[test]
fn an_unexpected_device_is_named() {
    let r = evaluate(
        &node(vec![dev("eth2", &[("ingress", "cil_from_netdev")])]),
        &pats(&["eth0", "eth1"]),
    );
    assert_eq!(
        (r.status, r.code.as_str()),
        (Status::Fail, "device_unexpected")
    );
    assert!(r.reason.contains("eth2"));
}

#[test]
fn an_explicit_device_that_does_not_exist_is_reported_not_failed() {
    // Cilium warns and runs without it: not a failure here either.
    let r = evaluate(&node(vec![]), &pats(&["eth0", "eth1", "bond0"]));
    assert_eq!(r.code, "devices_ok", "{}", r.reason);
    assert_eq!(
        r.evidence["listed_but_absent"],
        serde_json::json!(["bond0"])
    );
}

/// Cilium's selection order (devices controller): no address or down is rejected first;
/// a filter match is then selected whatever its kind; OVS is excluded by its real kind
/// name; Cilium's own devices carrying its programs are not "unexpected".
#[test]
fn selection_follows_ciliums_is_selected_device() {
    let mut br = dev("br-ext", &[]);
    br.kind = Some("bridge".into());
    assert!(
        sel(&br, &["br-ext".into()], false),
        "a listed bridge is selected"
    );
    assert!(!sel(&br, &[], false), "but never auto-detected");
    let mut bare = dev("eth5", &[]);
    bare.addresses = 0;
    assert!(
        sel(&bare, &["eth+".into()], false),
        "1.19+: a listed device is selected before the address check"
    );
    let r118 = SelectionRules::of(Some("1.18"));
    assert!(
        !selected_by_cilium(&bare, &[], &["eth+".into()], false, r118),
        "up to 1.18: no address is rejected first"
    );
    assert!(
        !sel(&bare, &[], false),
        "never auto-detected without an address"
    );
    let mut ovs = dev("ovs0", &[]);
    ovs.kind = Some("openvswitch".into());
    assert!(!sel(&ovs, &[], false));
    let mut lo = dev("eth7", &[]);
    lo.loopback = true;
    assert!(!sel(&lo, &[], false));
    assert!(matches("+", "anything") && matches("eth++", "eth3") && !matches("eth", "eth0"));
    // cilium_wg0 carries cil_from_netdev (WireGuard with KPR, up to 1.17): not unexpected.
    let wg = dev("cilium_wg0", &[("ingress", "cil_from_netdev")]);
    let r = evaluate(&node(vec![wg]), &pats(&["eth0", "eth1"]));
    assert_eq!(r.code, "devices_ok", "{}", r.reason);
    assert_eq!(
        r.evidence["ciliums_own_devices_with_cil_from_netdev"],
        serde_json::json!(["cilium_wg0"])
    );
}

#[test]
fn auto_detection_follows_ciliums_rules() {
    let mut br = dev("br0", &[]);
    br.kind = Some("bridge".into());
    let mut down = dev("eth9", &[]);
    down.up = false;
    let o = node(vec![br, down]);
    assert_eq!(
        expected_set(&o.devices, &Expected::Auto),
        ["eth0", "eth1"].iter().map(|s| s.to_string()).collect()
    );
}

/// A veth without a default route is not auto-detected, but a filter selects it; a
/// device without a global-unicast route is never auto-detected; with
/// `force-device-detection` the listed devices are joined by the detected ones.
#[test]
fn veths_routes_and_forced_detection_follow_cilium() {
    let mut v = dev("eth3", &[]);
    v.default_route = false;
    assert!(!sel(&v, &[], false), "veth, no default route");
    assert!(sel(&v, &["eth3".into()], false), "listed");
    let mut dummy = v.clone();
    dummy.kind = Some("dummy".into());
    assert!(
        sel(&dummy, &[], false),
        "not a veth: no default route needed"
    );
    let mut local = dev("eth4", &[]);
    local.global_route = false;
    assert!(!sel(&local, &[], false), "no global-unicast route");
    let o = node(vec![]);
    let forced = Expected::Patterns {
        patterns: vec!["eth0".into()],
        source: "test".into(),
        force: true,
    };
    assert_eq!(
        expected_set(&o.devices, &forced),
        ["eth0", "eth1"].iter().map(|s| s.to_string()).collect(),
        "eth1 is detected although not listed"
    );
    assert_eq!(
        expected_set(&o.devices, &pats(&["eth0"])),
        ["eth0"].iter().map(|s| s.to_string()).collect()
    );
}

#[test]
fn unreadable_program_details_are_unknown_never_pass() {
    let mut o = node(vec![]);
    o.prog_details_unreadable = true;
    o.problems
        .push("program 7 on eth0: permission denied".into());
    assert_eq!(evaluate(&o, &pats(&["eth+"])).status, Status::Unknown);
}

#[test]
fn a_node_without_cilium_host_fails() {
    let mut o = node(vec![]);
    o.devices.retain(|d| d.name != "cilium_host");
    assert_eq!(evaluate(&o, &pats(&["eth+"])).code, "host_device_missing");
}

#[test]
fn truncated_kernel_names_and_tc_filter_names_are_recognised() {
    let p = AttachedProgram {
        hook: "ingress",
        via: "tc",
        prog_id: 1,
        name: None,
        filter: Some("cil_from_container-lxc12".into()),
        loaded_at: None,
        link_pin: None,
    };
    assert!(p.is("cil_from_container"));
    let p = AttachedProgram {
        name: Some("cil_from_contai".into()),
        filter: None,
        ..p
    };
    assert!(p.is("cil_from_container"));
}

/// Cilium's tunnel config: tunnel routing (the default when unset), the egress gateway, or
/// DSR over Geneve turn the overlay on; the protocol names the device.
#[test]
fn the_overlay_follows_cilium_s_tunnel_config() {
    let dev = |pairs: &[(&str, &str)]| overlay_intent(&cfg(pairs)).device;
    assert_eq!(dev(&[]), Some("cilium_vxlan".into()));
    assert_eq!(
        dev(&[("routing-mode", "tunnel")]),
        Some("cilium_vxlan".into())
    );
    assert_eq!(
        dev(&[("routing-mode", "tunnel"), ("tunnel-protocol", "geneve")]),
        Some("cilium_geneve".into())
    );
    assert_eq!(dev(&[("routing-mode", "native")]), None);
    assert_eq!(dev(&[("tunnel", "disabled")]), None);
    assert_eq!(dev(&[("tunnel", "geneve")]), Some("cilium_geneve".into()));
    assert_eq!(
        dev(&[
            ("routing-mode", "native"),
            ("enable-egress-gateway", "true")
        ]),
        Some("cilium_vxlan".into())
    );
    let dsr = [
        ("routing-mode", "native"),
        ("kube-proxy-replacement", "true"),
        ("bpf-lb-mode", "dsr"),
        ("bpf-lb-dsr-dispatch", "geneve"),
        ("tunnel-protocol", "geneve"),
    ];
    assert_eq!(dev(&dsr), Some("cilium_geneve".into()));
    assert_eq!(dev(&dsr[..3]), None, "DSR over IP options needs no tunnel");
}

/// The node check holds the overlay to the configuration: a stray overlay under native
/// routing and a missing one under tunnel routing fail; as asked passes.
#[test]
fn the_overlay_is_judged_against_the_configuration() {
    let tunnel = overlay_intent(&cfg(&[("routing-mode", "tunnel")]));
    let native = overlay_intent(&cfg(&[("routing-mode", "native")]));
    let vxlan = || {
        dev(
            "cilium_vxlan",
            &[
                ("ingress", "cil_from_overlay"),
                ("egress", "cil_to_overlay"),
            ],
        )
    };
    assert_eq!(overlay_mismatch(&node(vec![vxlan()]), &tunnel), None);
    assert_eq!(overlay_mismatch(&node(vec![]), &native), None);
    let (code, why) = overlay_mismatch(&node(vec![vxlan()]), &native).unwrap();
    assert_eq!(code, "overlay_unexpected");
    assert!(
        why.contains("cilium_vxlan") && why.contains("routing-mode=native"),
        "{why}"
    );
    let (code, _) = overlay_mismatch(&node(vec![]), &tunnel).unwrap();
    assert_eq!(code, "overlay_missing");
    let geneve = overlay_intent(&cfg(&[
        ("routing-mode", "tunnel"),
        ("tunnel-protocol", "geneve"),
    ]));
    let (code, why) = overlay_mismatch(&node(vec![vxlan()]), &geneve).unwrap();
    assert_eq!(code, "overlay_unexpected", "{why}");
    // A leftover overlay device without programs is not Cilium's datapath.
    assert_eq!(
        overlay_mismatch(&node(vec![dev("cilium_vxlan", &[])]), &native),
        None
    );

    // In the check: a passing devices result fails on the overlay; the intent is evidence.
    let ok = evaluate_with(
        &node(vec![vxlan()]),
        &pats(&["eth0", "eth1"]),
        &ToNetdev::default(),
    );
    assert_eq!(ok.status, Status::Pass, "{ok:?}");
    let r = with_overlay(ok.clone(), &node(vec![vxlan()]), Some(&native));
    assert_eq!(
        (r.status, r.code.as_str()),
        (Status::Fail, "overlay_unexpected")
    );
    assert_eq!(r.evidence["overlay"]["wanted"], serde_json::Value::Null);
    let r = with_overlay(ok.clone(), &node(vec![vxlan()]), None);
    assert_eq!(
        r.status,
        Status::Pass,
        "not judged without the agent's configuration"
    );
    assert_eq!(r.evidence["overlay"]["judged"], false);
}

/// Cilium's filter: the first matching entry decides and `!` excludes (`"!eth2 eth+"` leaves
/// eth2 alone); 1.20 matches alternative names and keeps a VRF's devices; IPoIB is never
/// auto-detected from 1.18; a down or unaddressed listed device is selected from 1.19.
#[test]
fn the_device_filter_negates_matches_alternative_names_and_keeps_vrf_devices() {
    let f = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(filter_match(&f(&["!eth2", "eth+"]), "eth2"), Some(false));
    assert_eq!(filter_match(&f(&["!eth2", "eth+"]), "eth3"), Some(true));
    assert_eq!(
        filter_match(&f(&["eth+", "!eth2"]), "eth2"),
        Some(true),
        "first entry wins"
    );
    assert_eq!(filter_match(&f(&["eth+"]), "ens3"), None);
    let o = node(vec![dev("eth2", &[("ingress", "cil_from_netdev")])]);
    let r = evaluate(&o, &pats(&["!eth2", "eth+"]));
    assert_eq!(r.code, "device_unexpected", "{}", r.reason);
    let r = evaluate(&node(vec![dev("eth2", &[])]), &pats(&["!eth2", "eth+"]));
    assert_eq!(r.code, "devices_ok", "{}", r.reason);
    assert_eq!(r.evidence["listed_but_absent"], serde_json::json!([]));

    let mut alt = dev("enp1s0", &[]);
    alt.alt_names = vec!["eth9".into()];
    let r120 = SelectionRules::of(Some("1.20"));
    let r119 = SelectionRules::of(Some("1.19"));
    assert!(selected_by_cilium(&alt, &[], &f(&["eth9"]), false, r120));
    assert!(!selected_by_cilium(&alt, &[], &f(&["eth9"]), false, r119));

    let mut vrf = dev("vrf-blue", &[]);
    vrf.kind = Some("vrf".into());
    vrf.ifindex = 40;
    let mut inside = dev("eth6", &[]);
    inside.has_controller = true;
    inside.controller = Some(40);
    let all = vec![vrf.clone(), inside.clone()];
    assert!(selected_by_cilium(&inside, &all, &[], false, r120));
    assert!(!selected_by_cilium(&inside, &all, &[], false, r119));
    let mut bridged = inside.clone();
    bridged.controller = Some(41);
    let mut br = dev("br1", &[]);
    br.kind = Some("bridge".into());
    br.ifindex = 41;
    assert!(!selected_by_cilium(
        &bridged,
        &[br, bridged.clone()],
        &[],
        false,
        r120
    ));

    let mut ib = dev("ib0", &[]);
    ib.kind = Some("ipoib".into());
    assert!(!selected_by_cilium(&ib, &[], &[], false, r120));
    assert!(selected_by_cilium(
        &ib,
        &[],
        &[],
        false,
        SelectionRules::of(Some("1.17"))
    ));
    assert!(
        selected_by_cilium(&ib, &[], &f(&["ib0"]), false, r120),
        "listed"
    );

    let mut down = dev("eth8", &[]);
    down.up = false;
    assert!(selected_by_cilium(&down, &[], &f(&["eth+"]), false, r119));
    assert!(!selected_by_cilium(&down, &[], &[], false, r119));
}

/// With the agent's status answering, its selected devices are the expectation, whatever the
/// re-derived rules would say; stepguard's own list still wins; without an answer the rules
/// decide and the evidence says why.
#[test]
fn the_agents_reported_devices_decide_when_it_answers() {
    use crate::ciliumapi::{AgentStatus, ApiError};
    // eth2: up, no address, carrying Cilium's programs (a `devices: eth+` 1.19+ agent does).
    let mut eth2 = dev("eth2", &[("ingress", "cil_from_netdev")]);
    eth2.addresses = 0;
    eth2.global_addrs.clear();
    let obs = node(vec![eth2]);
    let status = AgentStatus {
        devices: Some(vec!["eth0".into(), "eth1".into(), "eth2".into()]),
        attach_mode: Some("tcx".into()),
    };
    // The 1.18 rules would not expect eth2 (no address): the agent's word decides.
    let old = SelectionRules::of(Some("1.18"));
    let (exp, why) = expected_from_agent(pats(&["eth+"]), Some(Ok(&status)));
    assert_eq!(why, None);
    let r = evaluate_by(&obs, &exp, &ToNetdev::default(), old);
    assert_eq!(r.status, Status::Pass, "{r:?}");
    assert!(
        r.reason.contains("the cilium-agent reports it selected"),
        "{}",
        r.reason
    );
    assert_eq!(r.evidence["expected_from"]["rules_agree"], false);
    assert_eq!(
        r.evidence["expected_from"]["rules_would_expect"],
        json!(["eth0", "eth1"])
    );
    // The kernel is held to the answer: the agent says eth2, eth2 lacks the programs.
    let mut bare = dev("eth2", &[]);
    bare.addresses = 0;
    let r = evaluate_by(&node(vec![bare]), &exp, &ToNetdev::default(), old);
    assert_eq!(r.code, "device_missing", "{r:?}");
    assert!(r.reason.contains("eth2"), "{}", r.reason);
    // A device carrying programs the agent did not select.
    let only = AgentStatus {
        devices: Some(vec!["eth0".into()]),
        attach_mode: None,
    };
    let (exp, _) = expected_from_agent(pats(&["eth+"]), Some(Ok(&only)));
    let r = evaluate_by(&node(vec![]), &exp, &ToNetdev::default(), old);
    assert_eq!(r.code, "device_unexpected", "{r:?}");
    // stepguard's own list wins over the agent's answer.
    let own = Expected::Patterns {
        patterns: vec!["eth0".into()],
        source: "config devices.expected".into(),
        force: false,
    };
    let (exp, why) = expected_from_agent(own.clone(), Some(Ok(&status)));
    assert_eq!((exp, why), (own, None));
    // No answer: the rules, and why.
    let err = ApiError::Timeout {
        path: "/run/cilium/cilium.sock".into(),
        ms: 2000,
    };
    let (exp, why) = expected_from_agent(pats(&["eth+"]), Some(Err(&err)));
    assert_eq!(exp, pats(&["eth+"]));
    assert!(why.unwrap().contains("no answer within"));
    let (_, why) = expected_from_agent(pats(&["eth+"]), None);
    assert!(why.unwrap().contains("not asked"));
    let starting = AgentStatus::default();
    let (exp, why) = expected_from_agent(Expected::Auto, Some(Ok(&starting)));
    assert_eq!(exp, Expected::Auto);
    assert!(why.unwrap().contains("lists no devices"));
}
