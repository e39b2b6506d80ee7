use super::*;
use crate::checks::Status;

fn snap(t: f64, values: &[(&str, &str)]) -> Snapshot {
    Snapshot {
        changed_at: t,
        version: format!("..{t}"),
        values: values
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    }
}
fn loaded(values: &[(&str, &str)]) -> BTreeMap<String, String> {
    values
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}
fn store(name: &str) -> (SnapshotStore, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("sg-cfg-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    (SnapshotStore::new(&dir), dir)
}

/// The headline case: the ConfigMap was edited (devices), the agent was not restarted
/// and still runs with the old value: not applied, naming the key.
#[test]
fn an_edit_the_agent_has_not_loaded_is_named() {
    let (st, dir) = store("inert");
    st.remember(&snap(50.0, &[("devices", "eth0 eth1")]))
        .unwrap();
    let now = snap(200.0, &[("devices", "eth0"), ("enable-ipv4", "true")]);
    st.remember(&now).unwrap();
    let l = loaded(&[("devices", "eth0 eth1"), ("enable-ipv4", "True")]);
    let r = evaluate(Some(Ok(&now)), Some(Ok(&l)), None, Some(&st));
    assert_eq!(
        (r.status, r.code.as_str()),
        (Status::Fail, "config_not_applied")
    );
    assert!(r.reason.contains("changed keys: devices"), "{}", r.reason);
    // After the restart the agent loaded it: applied (bools compare like Go's).
    let l = loaded(&[("devices", "eth0"), ("enable-ipv4", "true")]);
    let r = evaluate(Some(Ok(&now)), Some(Ok(&l)), None, Some(&st));
    assert_eq!(r.status, Status::Pass, "{}", r.reason);
    let _ = std::fs::remove_dir_all(dir);
}

/// A value the ConfigMap never had, on a node with a CiliumNodeConfig source: a per-node
/// override, seen and reported, not a failure.
#[test]
fn a_per_node_override_is_seen() {
    let (st, dir) = store("override");
    let now = snap(100.0, &[("devices", "eth0 eth1")]);
    st.remember(&now).unwrap();
    let l = loaded(&[
        ("devices", "eth0"),
        (
            "config-sources",
            "config-map:kube-system/cilium-config,cilium-node-config:kube-system/n1",
        ),
    ]);
    let r = evaluate(Some(Ok(&now)), Some(Ok(&l)), None, Some(&st));
    assert_eq!(r.status, Status::Pass, "{}", r.reason);
    assert!(
        r.reason.contains("per-node overrides: devices"),
        "{}",
        r.reason
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A CiliumNodeConfig keeping a value the ConfigMap once had (`devices: eth0 eth1` moved
/// to `eth0` in the ConfigMap): an agent that started after the edit read the new value,
/// so what it loaded instead is the per-node source's, an override; one that started
/// before cannot be told apart from an edit waiting for a restart (unknown, never "not
/// applied"), and the effective configuration is what it loaded. Without a per-node
/// source the old rule stands.
#[test]
fn a_node_config_keeping_an_earlier_value_is_an_override_once_the_agent_read_the_edit() {
    let (st, dir) = store("kept");
    st.remember(&snap(50.0, &[("devices", "eth0 eth1")]))
        .unwrap();
    let now = snap(200.0, &[("devices", "eth0")]);
    st.remember(&now).unwrap();
    assert_eq!(st.declared_since("devices", "eth0"), Some(200.0));
    assert_eq!(st.declared_since("devices", "eth0 eth1"), None);
    let cnc = r#"[{"kind":"config-map","namespace":"kube-system","name":"cilium-config"},{"kind":"cilium-node-config","namespace":"kube-system","name":"lab-node-0-nic"}]"#;
    let l = loaded(&[("devices", "eth0 eth1"), ("config-sources", cnc)]);
    let after = Some(200.0 + BUILD_MARGIN_SECS + 1.0);
    let r = evaluate(Some(Ok(&now)), Some(Ok(&l)), after, Some(&st));
    assert_eq!(r.status, Status::Pass, "{}", r.reason);
    assert!(
        r.reason.contains("per-node overrides: devices"),
        "{}",
        r.reason
    );
    assert_eq!(
        effective(&now, Some(&l), after, Some(&st)).values["devices"],
        "eth0 eth1"
    );
    // Started before the edit (or too close to it to be sure).
    for before in [Some(100.0), Some(210.0), None] {
        let r = evaluate(Some(Ok(&now)), Some(Ok(&l)), before, Some(&st));
        assert_eq!(
            (r.status, r.code.as_str()),
            (Status::Unknown, "config_unverified"),
            "{before:?}: {}",
            r.reason
        );
        assert!(r.reason.contains("CiliumNodeConfig"), "{}", r.reason);
        assert_eq!(
            effective(&now, Some(&l), before, Some(&st)).values["devices"],
            "eth0 eth1",
            "the agent's value is what the node runs"
        );
    }
    // No per-node source: an agent from before the edit did not apply it.
    let plain = loaded(&[("devices", "eth0 eth1")]);
    let r = evaluate(Some(Ok(&now)), Some(Ok(&plain)), Some(100.0), Some(&st));
    assert_eq!(r.code, "config_not_applied", "{}", r.reason);
    let _ = std::fs::remove_dir_all(dir);
}

/// The effective configuration carries the overrides (declared keys and, with a per-node
/// source, undeclared keys off their default); without a per-node source, the ConfigMap.
#[test]
fn the_effective_configuration_is_the_configmap_with_the_overrides() {
    let (st, dir) = store("effective");
    let now = snap(100.0, &[("devices", "eth0 eth1"), ("enable-ipv6", "false")]);
    st.remember(&now).unwrap();
    let mut l = loaded(&[
        ("devices", "eth0"),
        ("enable-ipv6", "false"),
        ("bpf-lb-acceleration", "native"),
        ("enable-host-firewall", "false"),
        (
            "config-sources",
            "config-map:kube-system/cilium-config,cilium-node-config:kube-system/n1",
        ),
    ]);
    let e = effective(&now, Some(&l), None, Some(&st));
    assert_eq!(e.values["devices"], "eth0");
    assert_eq!(e.values["bpf-lb-acceleration"], "native");
    assert!(
        !e.values.contains_key("enable-host-firewall"),
        "a default is no override"
    );
    l.insert(
        "config-sources".into(),
        "config-map:kube-system/cilium-config".into(),
    );
    let e = effective(&now, Some(&l), None, Some(&st));
    assert_eq!(
        e.values["devices"], "eth0 eth1",
        "no per-node source: the ConfigMap"
    );
    assert_eq!(effective(&now, None, None, Some(&st)), now);
    // Without the history, a per-node source still decides.
    l.insert(
        "config-sources".into(),
        "config-map:kube-system/cilium-config,cilium-node-config:kube-system/n1".into(),
    );
    assert_eq!(
        effective(&now, Some(&l), None, None).values["devices"],
        "eth0"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// Keys the agent does not report are listed, never counted as verified; without the
/// agent's API nothing can be said (unknown, not pass).
#[test]
fn what_cannot_be_verified_is_never_a_pass() {
    let now = snap(1.0, &[("devices", "eth0"), ("some-new-key", "x")]);
    let l = loaded(&[("devices", "eth0")]);
    let r = evaluate(Some(Ok(&now)), Some(Ok(&l)), None, None);
    assert_eq!(r.evidence["unverifiable_keys"], json!(["some-new-key"]));
    assert_eq!(r.evidence["verified"], 1);
    assert_eq!(
        evaluate(Some(Ok(&now)), None, None, None).status,
        Status::Unknown
    );
    assert_eq!(
        evaluate(None, Some(Ok(&l)), None, None).status,
        Status::Unknown
    );
}

/// The JSON form the real agent reports (1.19/1.20): a Node-label source is per-node too,
/// the ConfigMap alone is not.
#[test]
fn config_sources_as_the_real_agent_writes_them() {
    let with = |v: &str| BTreeMap::from([("config-sources".to_string(), v.to_string())]);
    assert!(!per_node(&with(
        r#"[{"kind":"config-map","namespace":"kube-system","name":"cilium-config"}]"#
    )));
    assert!(per_node(&with(
        r#"[{"kind":"config-map","namespace":"kube-system","name":"cilium-config"},{"kind":"node","namespace":"","name":"n1"}]"#
    )));
    assert!(per_node(&with(
        r#"[{"kind":"config-map","namespace":"kube-system","name":"cilium-config"},{"kind":"cilium-node-config","namespace":"kube-system","name":"n1"}]"#
    )));
    assert!(per_node(&with(
        "config-map:kube-system/cilium-config,node:/n1"
    )));
}

/// An edit of a key only cilium-operator reads is not the agent's to apply: never
/// "merged but inert", whatever the agent still reports for it.
#[test]
fn operator_keys_are_not_the_agents_to_apply() {
    assert!(OPERATOR_KEYS.windows(2).all(|w| w[0] < w[1]), "sorted");
    let (st, dir) = store("operator");
    st.remember(&snap(50.0, &[("identity-gc-interval", "15m0s")]))
        .unwrap();
    let now = snap(
        200.0,
        &[("identity-gc-interval", "30m0s"), ("devices", "eth0")],
    );
    st.remember(&now).unwrap();
    let l = loaded(&[("identity-gc-interval", "15m0s"), ("devices", "eth0")]);
    let r = evaluate(Some(Ok(&now)), Some(Ok(&l)), None, Some(&st));
    assert_eq!(r.status, Status::Pass, "{}", r.reason);
    assert!(
        r.reason.contains("1 keys only cilium-operator reads"),
        "{}",
        r.reason
    );
    assert_eq!(r.evidence["operator_keys"], json!(["identity-gc-interval"]));
    assert_eq!(r.evidence["verified_keys"], json!(["devices"]));
    let _ = std::fs::remove_dir_all(dir);
}

/// `subnet-topology` is applied while the agent runs in hybrid routing (its reported
/// value stays the start value); in another routing mode, or with dynamic configuration
/// off, an edit the agent has not loaded is not applied.
#[test]
fn a_key_applied_while_the_agent_runs_is_not_merged_but_inert() {
    let (st, dir) = store("live");
    st.remember(&snap(50.0, &[("subnet-topology", "192.0.2.0/24")]))
        .unwrap();
    let now = snap(200.0, &[("subnet-topology", "198.51.100.0/24")]);
    st.remember(&now).unwrap();
    let mut l = loaded(&[
        ("subnet-topology", "192.0.2.0/24"),
        ("routing-mode", "hybrid"),
    ]);
    let r = evaluate(Some(Ok(&now)), Some(Ok(&l)), None, Some(&st));
    assert_eq!(r.status, Status::Pass, "{}", r.reason);
    assert!(
        r.reason
            .contains("applied while it runs (it reports its start value): subnet-topology"),
        "{}",
        r.reason
    );
    assert_eq!(
        r.evidence["applied_live"][0]["why"],
        "watched in hybrid routing"
    );
    l.insert("enable-dynamic-config".into(), "false".into());
    let r = evaluate(Some(Ok(&now)), Some(Ok(&l)), None, Some(&st));
    assert_eq!(r.code, "config_not_applied", "{}", r.reason);
    l.remove("enable-dynamic-config");
    l.insert("routing-mode".into(), "native".into());
    let r = evaluate(Some(Ok(&now)), Some(Ok(&l)), None, Some(&st));
    assert_eq!(r.code, "config_not_applied", "{}", r.reason);
    let l = loaded(&[
        ("dynamic-lifecycle-config", "[]"),
        ("enable-dynamic-lifecycle-manager", "true"),
    ]);
    assert!(applied_live("dynamic-lifecycle-config", &l).is_some());
    assert!(applied_live("devices", &l).is_none());
    let _ = std::fs::remove_dir_all(dir);
}
