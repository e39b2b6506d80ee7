use super::*;

#[test]
fn the_whole_selector_becomes_a_label_selector() {
    let sel: k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector =
        serde_json::from_value(json!({
            "matchLabels": {"k8s-app": "cilium"},
            "matchExpressions": [
                {"key": "pool", "operator": "In", "values": ["a", "b"]},
                {"key": "debug", "operator": "NotIn", "values": ["true"]},
                {"key": "tier", "operator": "Exists"},
                {"key": "legacy", "operator": "DoesNotExist"}]}))
        .unwrap();
    assert_eq!(
        selector_string(&sel),
        "k8s-app=cilium,pool in (a,b),debug notin (true),tier,!legacy"
    );
}

fn ds(image: &str, checksum: Option<&str>, ann: Value) -> DaemonSet {
    let mut tmeta = json!({"labels": {"k8s-app": "cilium"}});
    if let Some(c) = checksum {
        tmeta["annotations"] = json!({ CONFIG_CHECKSUM: c });
    }
    serde_json::from_value(json!({
        "metadata": {"name": "cilium", "generation": 4, "annotations": ann},
        "spec": {"selector": {"matchLabels": {"k8s-app": "cilium"}},
                 "template": {"metadata": tmeta, "spec": {"containers": [{"name": "cilium-agent", "image": image}]}}},
        "status": {"observedGeneration": 4, "currentNumberScheduled": 0, "desiredNumberScheduled": 0,
                   "numberMisscheduled": 0, "numberReady": 0}
    }))
    .unwrap()
}

/// The revision before, as its ControllerRevision stores the template (the controller's
/// `$patch: replace`, a null creation time): an older image and config, nothing else.
fn prev() -> Value {
    json!({"$patch": "replace", "metadata": {"creationTimestamp": null, "labels": {"k8s-app": "cilium"},
           "annotations": { CONFIG_CHECKSUM: "c1" }},
           "spec": {"containers": [{"name": "cilium-agent", "image": "quay.io/cilium/cilium:v1.18.0", "resources": {}}]}})
}

fn approval(d: &DaemonSet, current: &str) -> Option<String> {
    super::approval(d, current, Some(&[prev()][..]))
}

#[test]
fn git_approves_the_image_and_config_checksum_a_revision_carries() {
    let img = "quay.io/cilium/cilium:v1.19.1@sha256:aa";
    let both = json!({ ANN_APPROVE_IMAGE: img, ANN_APPROVE_CONFIG: "c2" });
    assert_eq!(
        approval(&ds(img, Some("c2"), both.clone()), "h2").as_deref(),
        Some("h2")
    );
    // A config-only revision does not ride the approval of the earlier config.
    assert_eq!(approval(&ds(img, Some("c3"), both.clone()), "h3"), None);
    assert!(
        unapproved_why(&ds(img, Some("c3"), both.clone()), Some(&[prev()][..]))
            .contains("config checksum is c3")
    );
    // Another image; a checksum the approval does not name.
    assert_eq!(
        approval(&ds("cilium:v1.19.2", Some("c2"), both), "h4"),
        None
    );
    let image_only = json!({ ANN_APPROVE_IMAGE: img });
    assert_eq!(
        approval(&ds(img, Some("c2"), image_only.clone()), "h5"),
        None
    );
    // Without the chart's checksum, the image alone.
    assert_eq!(
        approval(&ds(img, None, image_only), "h6").as_deref(),
        Some("h6")
    );
    // The revision hash, as before; an older one stays what it names.
    let named = json!({ ANN_APPROVE: "h1" });
    assert_eq!(
        approval(&ds(img, None, named.clone()), "h1").as_deref(),
        Some("h1")
    );
    assert_eq!(approval(&ds(img, None, named), "h7").as_deref(), Some("h1"));
    // Not judged before the controller observed the template.
    let mut d = ds(img, None, json!({ ANN_APPROVE_IMAGE: img }));
    d.metadata.generation = Some(5);
    assert_eq!(approval(&d, "h8"), None);
}

/// A Git approval names an image and a config checksum: a revision that changes anything
/// else (arguments, env, an init container, `kubectl rollout restart`'s annotation) is not
/// covered by it, however long the annotations stay; nor is one whose predecessor is unknown.
#[test]
fn a_git_approval_covers_the_image_and_config_and_nothing_else() {
    let img = "quay.io/cilium/cilium:v1.19.1@sha256:aa";
    let both = json!({ ANN_APPROVE_IMAGE: img, ANN_APPROVE_CONFIG: "c2" });
    let changed = |f: &dyn Fn(&mut Value)| {
        let mut d = ds(img, Some("c2"), both.clone());
        let mut t = serde_json::to_value(&d.spec.as_ref().unwrap().template).unwrap();
        f(&mut t);
        d.spec.as_mut().unwrap().template = serde_json::from_value(t).unwrap();
        d
    };
    let args =
        changed(&|t| t["spec"]["containers"][0]["args"] = json!(["--enable-bpf-masquerade"]));
    assert_eq!(approval(&args, "h2"), None);
    assert!(
        unapproved_why(&args, Some(&[prev()][..])).contains("/spec/containers/0/args"),
        "{}",
        unapproved_why(&args, Some(&[prev()][..]))
    );
    let restart = changed(&|t| {
        t["metadata"]["annotations"]["kubectl.kubernetes.io/restartedAt"] =
            json!("2026-12-04T10:00:00Z")
    });
    assert_eq!(approval(&restart, "h3"), None);
    let init =
        changed(&|t| t["spec"]["initContainers"] = json!([{"name": "mount-cgroup", "image": img}]));
    assert_eq!(approval(&init, "h4"), None);
    // Images of every container may change (the chart uses one image for several).
    assert_eq!(
        other_changes(&prev(), &prev(), "quay.io/cilium/cilium:v1.18.0"),
        Vec::<String>::new()
    );
    // Another image beside the approved one (a sidecar swapped in the same commit): not
    // covered.
    let sidecar = changed(&|t| {
        t["spec"]["containers"]
            .as_array_mut()
            .unwrap()
            .push(json!({"name": "sidecar", "image": "evil:latest"}))
    });
    assert_eq!(approval(&sidecar, "h6"), None);
    // Judged from every revision a node runs: an unapproved change in a revision between
    // (here: an argument) is caught when some node still runs the one before it.
    let mut between = prev();
    between["spec"]["containers"][0]["args"] = json!(["--x"]);
    let d = ds(img, Some("c2"), both.clone());
    assert_eq!(
        super::approval(&d, "h7", Some(&[between.clone()][..])),
        None
    );
    assert_eq!(
        super::approval(&d, "h7", Some(&[prev(), between][..])),
        None
    );
    assert_eq!(
        super::approval(&d, "h7", Some(&[][..])).as_deref(),
        Some("h7"),
        "every node on it"
    );
    assert_eq!(
        super::approval(&ds(img, Some("c2"), both.clone()), "h5", None),
        None,
        "what else the revision changes is unknown"
    );
}

#[test]
fn the_minor_version_comes_from_the_image_tag() {
    assert_eq!(
        image_minor("quay.io/cilium/cilium:v1.18.2@sha256:abc").as_deref(),
        Some("1.18")
    );
    assert_eq!(image_minor("cilium:1.17.0").as_deref(), Some("1.17"));
    assert_eq!(image_minor("cilium:latest"), None);
    assert_eq!(image_minor("registry:5000/cilium"), None);
}

#[test]
fn watch_starts_only_an_approved_revision_not_yet_everywhere() {
    let mut v = ClusterView {
        revision: Some(("r2".into(), 2)),
        ..Default::default()
    };
    v.pods.push(CiliumPod {
        name: "p".into(),
        uid: "u".into(),
        node: "n".into(),
        revision: "r1".into(),
        ready: true,
        image: String::new(),
        bound: true,
        crash_looping: None,
        started_at: None,
    });
    let none = PlanOpts::default();
    assert!(!approved(&v, None, &none));
    assert!(!approved(&v, Some("r1"), &none), "an older approval");
    assert!(approved(&v, Some("r2"), &none));
    v.pods[0].revision = "r2".into();
    // On the revision without a proof it can read: waited on, not owed (a run would only
    // refuse); with an unproven one: owed (stepped to prove it).
    assert!(!approved(&v, Some("r2"), &none), "proof not read");
    let unproven: crate::step::proof::Proof = serde_json::from_value(json!({
        "started_at": 1.0, "status": "unproven", "step": null, "why": "no step"}))
    .unwrap();
    v.proofs.insert("n".into(), Ok(unproven));
    assert!(approved(&v, Some("r2"), &none), "on the revision, unproven");
    let passed: crate::step::proof::Proof = serde_json::from_value(json!({
        "started_at": 1.0, "status": "passed", "step": null, "why": "passed"}))
    .unwrap();
    v.proofs.insert("n".into(), Ok(passed));
    assert!(
        !approved(&v, Some("r2"), &none),
        "already everywhere, proven"
    );
    v.pods[0].revision = "r1".into();
    let skipped = PlanOpts {
        skip: ["n".to_string()].into(),
        ..Default::default()
    };
    assert!(!approved(&v, Some("r2"), &skipped), "skipped");
    let kept = PlanOpts {
        partition: 1,
        ..Default::default()
    };
    assert!(
        !approved(&v, Some("r2"), &kept),
        "the partition keeps the one node on its revision"
    );
    v.nodes.push(NodeInfo {
        name: "n".into(),
        ready: true,
        zone: None,
        control_plane: false,
        labels: [("pool".to_string(), "media".to_string())].into(),
    });
    let elsewhere = PlanOpts {
        node_selector: plan::scope::parse_selector("pool=web").unwrap(),
        ..Default::default()
    };
    assert!(!approved(&v, Some("r2"), &elsewhere), "out of scope");
    let here = PlanOpts {
        node_selector: plan::scope::parse_selector("pool=media").unwrap(),
        ..Default::default()
    };
    assert!(approved(&v, Some("r2"), &here), "in scope");
}

#[test]
fn a_pending_daemon_pod_belongs_to_the_node_its_affinity_names() {
    let p: Pod = serde_json::from_value(json!({
        "metadata": {"name": "cilium-x"},
        "spec": {"containers": [], "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-2"]}]}]}}}}
    }))
    .unwrap();
    assert_eq!(target_node(&p).as_deref(), Some("node-2"));
    let mut bound = p.clone();
    bound.spec.as_mut().unwrap().node_name = Some("node-3".into());
    assert_eq!(target_node(&bound).as_deref(), Some("node-3"));
}

#[test]
fn only_failures_of_the_api_server_itself_are_retried() {
    let api = |code: u16| -> RolloutError {
        RolloutError::api(
            "list the cilium pods",
            kube::Error::Api(Box::new(kube::core::Status {
                code,
                ..Default::default()
            })),
        )
    };
    assert!(api(500).is_transient());
    assert!(api(503).is_transient());
    assert!(api(429).is_transient());
    assert!(!api(403).is_transient());
    assert!(!api(404).is_transient());
    assert!(!RolloutError::from(anyhow::anyhow!("a plain error")).is_transient());
    // Every error that stops a run leaves it undecided, and says what the call was for.
    assert_eq!(api(503).exit_code(), crate::exit::ExitCode::NotDecided);
    assert_eq!(api(503).api_code(), Some(503));
    assert!(api(403).to_string().starts_with("list the cilium pods: "));
}

/// Two steppers on hosts of the same name with the same PID (PID 1 in two replicas) have
/// different lock identities; the host is still read back for people.
#[test]
fn two_replicas_with_one_hostname_and_pid_have_different_identities() {
    let (a, b) = (identity("stepper", 1), identity("stepper", 1));
    assert_ne!(a, b);
    assert!(a.starts_with("stepper-1-"), "{a}");
    assert_eq!(identity_host(&a), "stepper");
    assert_eq!(identity_host(&identity("my-host-x", 7)), "my-host-x");
}
