use super::*;

fn set(v: &[&str]) -> BTreeSet<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[test]
fn names_follow_the_version_changes_in_cilium_facts() {
    let f = Features::default();
    let v16 = required_maps(CiliumVersion::V1_16, f);
    let v18 = required_maps(CiliumVersion::V1_18, f);
    assert!(v16.contains("cilium_ipcache"));
    assert!(
        v18.contains("cilium_ipcache_v2")
            && !v18.contains("cilium_tunnel_map")
            && !v18.contains("cilium_ipcache")
    );
    assert_eq!(policy_prefix(CiliumVersion::V1_20), "cilium_policy_v3_");
    // Helm defaults: no kube-proxy replacement, so no SNAT maps.
    assert!(!v18.contains("cilium_snat_v4_external"));
    assert!(!v18.contains("cilium_l2_responder_v4"));
    assert!(!v18.contains("cilium_ct6_global"));
    // Corrections read from Cilium's source (docs/cilium-fidelity.md): policy stats only
    // from 1.18; the tunnel map only in tunnel mode up to 1.17; the v1 node map until 1.18.
    assert!(!v16.contains("cilium_policystats") && v18.contains("cilium_policystats"));
    let native = Features {
        tunnel: Some(false),
        ..f
    };
    assert!(!required_maps(CiliumVersion::V1_17, native).contains("cilium_tunnel_map"));
    // No cilium-config: the routing mode is unknown, the tunnel map is not required.
    assert!(!required_maps(CiliumVersion::V1_17, f).contains("cilium_tunnel_map"));
    let tunnel = Features {
        tunnel: Some(true),
        ..f
    };
    assert!(required_maps(CiliumVersion::V1_16, tunnel).contains("cilium_tunnel_map"));
    assert!(v16.contains("cilium_node_map") && !v18.contains("cilium_node_map"));
    assert_eq!(
        required_maps(CiliumVersion::V1_17, f),
        v16,
        "1.17 has 1.16's global maps"
    );
    assert_eq!(required_maps(CiliumVersion::V1_19, f), v18);
    let kpr = Features { snat: true, ..f };
    assert!(required_maps(CiliumVersion::V1_20, kpr).contains("cilium_snat_v4_external"));
}

#[test]
fn map_classes_follow_what_cilium_does_on_start() {
    assert_eq!(map_class("cilium_lxc"), MapClass::Kept);
    assert_eq!(map_class("cilium_lb4_services_v2"), MapClass::Kept);
    assert_eq!(map_class("cilium_ipcache_v2"), MapClass::Recreated);
    assert_eq!(map_class("cilium_ct4_global"), MapClass::Churn);
    assert_eq!(map_class("cilium_runtime_config"), MapClass::Other);
    // Gone after an upgrade to 1.18 by design; a service map gone is not.
    let v18 = CiliumVersion::V1_18;
    assert!(removed_by_design("cilium_tunnel_map", v18));
    assert!(removed_by_design("cilium_node_map", v18));
    assert!(!removed_by_design("cilium_lb4_services_v2", v18));
    assert!(CiliumVersion::newer_than_newest("1.21") && !CiliumVersion::newer_than_newest("1.20"));
}

#[test]
fn features_come_from_cilium_config_keys() {
    let cfg: BTreeMap<String, String> = [
        ("enable-ipv6", "true"),
        ("kube-proxy-replacement", "false"),
        ("enable-l2-announcements", "true"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let f = Features::from_cilium_config(&cfg, Features::default());
    assert!(f.ipv6 && f.l2_announcements && !f.snat);
    let m = required_maps(CiliumVersion::V1_18, f);
    assert!(
        m.contains("cilium_lb6_services_v2")
            && m.contains("cilium_l2_responder_v4")
            && !m.contains("cilium_snat_v4_external")
    );
}

/// `enable-node-port` was removed in 1.19: from then on it asks for no SNAT map (kube-proxy
/// replacement and BPF masquerade do); up to 1.18, or when the release is not known, it does.
#[test]
fn enable_node_port_counts_only_up_to_1_18() {
    let cfg: BTreeMap<String, String> = [("enable-node-port", "true")]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let at = |r: Option<&str>| Features::from_cilium_config_at(&cfg, Features::default(), r).snat;
    assert!(at(Some("1.18")) && at(None));
    assert!(!at(Some("1.19")) && !at(Some("1.20")));
}

#[test]
fn the_version_is_inferred_from_names_present() {
    assert_eq!(
        infer_version(&set(&["cilium_ipcache_v2", "cilium_policy_v3_00012"]))
            .unwrap()
            .0,
        CiliumVersion::V1_20
    );
    assert_eq!(
        infer_version(&set(&["cilium_ipcache_v2", "cilium_policy_v2_00012"]))
            .unwrap()
            .0,
        CiliumVersion::V1_18
    );
    assert_eq!(
        infer_version(&set(&["cilium_ipcache", "cilium_node_map_v2"]))
            .unwrap()
            .0,
        CiliumVersion::V1_16
    );
    assert!(infer_version(&set(&["something_else"])).is_none());
}

/// After a downgrade Cilium removes only the pins it knows: the newer version's names
/// that stay behind do not make the node look newer.
#[test]
fn a_downgraded_nodes_leftover_pins_do_not_make_it_look_newer() {
    let v17 = set(&[
        "cilium_ipcache",
        "cilium_node_map_v2",
        "cilium_ipcache_v2",
        "cilium_policystats",
        "cilium_policy_v2_00012",
    ]);
    assert_eq!(infer_version(&v17).unwrap().0, CiliumVersion::V1_16);
    let v19 = set(&[
        "cilium_ipcache_v2",
        "cilium_policy_v2_00012",
        "cilium_policy_v3_00012",
    ]);
    assert_eq!(infer_version(&v19).unwrap().0, CiliumVersion::V1_18);
    assert!(names_ambiguous(&v19) && !names_ambiguous(&v17));
    let eps: BTreeMap<String, u64> = [("policy_v3".to_string(), 4), ("calls".into(), 9)]
        .into_iter()
        .collect();
    let names = names_for_inference(&set(&["cilium_ipcache_v2"]), &eps);
    assert_eq!(infer_version(&names).unwrap().0, CiliumVersion::V1_20);
    assert_eq!(version_label(&names).as_deref(), Some("1.20"));
}

#[test]
fn kept_entries_are_named_in_ciliums_terms() {
    let mut k = vec![198, 51, 100, 10, 0, 80, 0, 0, 6, 0, 0, 0];
    assert_eq!(
        describe_entry("cilium_lb4_services_v2", &k, &[]).as_deref(),
        Some("198.51.100.10:80/TCP")
    );
    k[6] = 2;
    assert_eq!(
        describe_entry("cilium_lb4_services_v2", &k, &[]).as_deref(),
        Some("198.51.100.10:80/TCP backend slot 2")
    );
    let v = [10, 0, 1, 5, 0x1f, 0x90, 6, 0, 0, 0, 0, 0];
    assert_eq!(
        describe_entry("cilium_lb4_backends_v3", &7u32.to_ne_bytes(), &v).as_deref(),
        Some("backend 7 = 10.0.1.5:8080")
    );
    let mut e = vec![0u8; 20];
    e[..4].copy_from_slice(&[10, 0, 1, 9]);
    e[16] = 1;
    assert_eq!(
        describe_entry("cilium_lxc", &e, &[]).as_deref(),
        Some("endpoint 10.0.1.9")
    );
    assert_eq!(describe_entry("cilium_lxc", &[0; 4], &[]), None);
    assert_eq!(describe_entry("cilium_ct4_global", &[0; 14], &[]), None);
}

#[test]
fn renamed_maps_and_releases() {
    let g = rename_group("cilium_ipcache_v2").unwrap();
    assert_eq!(rename_group("cilium_ipcache"), Some(g));
    assert_eq!(name_in(g, CiliumVersion::V1_17), "cilium_ipcache");
    assert_eq!(name_in(g, CiliumVersion::V1_18), "cilium_ipcache_v2");
    assert_eq!(name_in(g, CiliumVersion::V1_20), "cilium_ipcache_v2");
    assert!(rename_group("cilium_lxc").is_none());
    assert_eq!(
        release_of("1.18.4 6a4b1e4f 2025-11-02T10:01:02+00:00 go version go1.24.9 linux/amd64")
            .as_deref(),
        Some("1.18")
    );
    assert_eq!(release_of("v1.20.0-rc.1").as_deref(), Some("1.20"));
    assert_eq!(release_of("").as_deref(), None);
    assert_eq!(release_of("garbage").as_deref(), None);
}

#[test]
fn a_wrong_profile_names_the_other_versions_maps() {
    let present = set(&["cilium_ipcache_v2", "cilium_policy_v3_01000"]);
    let f = foreign_names(CiliumVersion::V1_16, Features::default(), &present);
    assert!(f.contains(&"cilium_ipcache_v2".to_string()), "{f:?}");
    assert!(f.contains(&"cilium_policy_v3_*".to_string()), "{f:?}");
}

#[test]
fn per_endpoint_maps_are_recognised() {
    assert_eq!(is_per_endpoint("cilium_policy_v2_00123"), Some("policy_v2"));
    assert_eq!(is_per_endpoint("cilium_policy_v3_00123"), Some("policy_v3"));
    assert_eq!(is_per_endpoint("cilium_calls_netdev_00002"), Some("calls"));
    assert_eq!(is_per_endpoint("cilium_calls_01000"), Some("calls"));
    assert_eq!(is_per_endpoint("cilium_lxc"), None);
    assert_eq!(is_per_endpoint("cilium_policystats"), None);
}
