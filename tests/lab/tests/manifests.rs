//! The shipped manifests meet a real API server (issue 27): `deploy/base`, `deploy/rollout`
//! and every overlay in `deploy/examples`, applied server-side (the CRDs from `third_party/`
//! first) to kube-apiserver with RBAC and Pod Security admission on; the namespace keeps the
//! labels it ships with, and the pods the real controllers make from the workloads are
//! admitted (Pod Security enforces on pods, not on their templates). A namespace enforcing
//! `restricted` proves admission really runs here: the same agent pod is refused there.
mod common;
use common::*;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use stepguard_lab::kube::{ControlPlane, Kube};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

struct Guard(ControlPlane, PathBuf);
impl Drop for Guard {
    fn drop(&mut self) {
        self.0.down();
        let _ = std::fs::remove_dir_all(&self.1);
    }
}

fn pods(k: &Kube, ns: &str, selector: &str) -> Vec<Pod> {
    let lp = kube::api::ListParams::default().labels(selector);
    k.block(k.ns::<Pod>(ns).list(&lp)).unwrap().items
}

fn wait_for(what: &str, ok: impl Fn() -> bool, context: impl Fn() -> String) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ok() {
        assert!(
            Instant::now() < deadline,
            "{what}: not within 60 s\n{}",
            context()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn every_manifest_applies_server_side_and_admission_admits_its_pods() {
    require_root();
    let bin = PathBuf::from(std::env::var("STEPGUARD_KUBE_BIN").expect(
        "STEPGUARD_KUBE_BIN: the control plane's binaries (`cargo xtask kube`; `cargo xtask test` sets it)",
    ));
    let dir = std::env::temp_dir().join(format!("sg-manifests-{}", std::process::id()));
    let g = Guard(ControlPlane::up(&dir, &bin).expect("control plane up"), dir);
    let cp = &g.0;
    let k = Kube::connect(&cp.admin_kubeconfig()).unwrap();
    let root = repo_root();
    let apply = |args: &[&str]| {
        let mut a = vec!["apply", "--server-side", "--field-manager=stepguard-test"];
        a.extend_from_slice(args);
        cp.kubectl(&a)
            .unwrap_or_else(|e| panic!("server-side apply {args:?}: {e:#}"))
    };
    let crds = root.join("third_party/prometheus-operator-v0.93.0");
    for f in std::fs::read_dir(&crds).unwrap() {
        let f = f.unwrap().path();
        if f.extension().is_some_and(|e| e == "yaml") {
            apply(&["-f", f.to_str().unwrap()]);
        }
    }
    cp.kubectl(&[
        "wait",
        "--for=condition=Established",
        "--timeout=30s",
        "crd",
        "--all",
    ])
    .expect("CRDs established");
    // A node for the controllers to place pods on (nobody runs them: admission is the point).
    stepguard_lab::kube::create_nodes(&k, &[("node-a".into(), "192.0.2.10".into())]).unwrap();

    let mut overlays = vec!["deploy/base".to_string(), "deploy/rollout".to_string()];
    let mut examples: Vec<String> = std::fs::read_dir(root.join("deploy/examples"))
        .unwrap()
        .map(|d| {
            format!(
                "deploy/examples/{}",
                d.unwrap().file_name().to_string_lossy()
            )
        })
        .collect();
    examples.sort();
    assert!(!examples.is_empty());
    overlays.extend(examples);
    for o in &overlays {
        let out = apply(&["-k", root.join(o).to_str().unwrap()]);
        assert!(out.contains("serverside-applied"), "{o}: {out}");
        eprintln!("{o}: applied server-side\n{out}");
    }

    // The namespace as shipped.
    let ns = k.block(k.all::<Namespace>().get("stepguard")).unwrap();
    assert_eq!(
        ns.metadata
            .labels
            .unwrap_or_default()
            .get("pod-security.kubernetes.io/enforce")
            .map(String::as_str),
        Some("privileged"),
    );
    // The controllers' pods, admitted: the agent in stepguard's namespace and (the
    // cilium-config overlay) in kube-system, the stepper's Deployment.
    let events = || cp.kubectl(&["get", "events", "-A"]).unwrap_or_default();
    for (ns, sel) in [
        ("stepguard", "app.kubernetes.io/name=stepguard"),
        ("kube-system", "app.kubernetes.io/name=stepguard"),
        ("stepguard", "app.kubernetes.io/name=stepguard-rollout"),
    ] {
        wait_for(
            &format!("a pod {sel} admitted in {ns}"),
            || !pods(&k, ns, sel).is_empty(),
            events,
        );
    }
    let failed = events();
    assert!(!failed.contains("FailedCreate"), "{failed}");

    // Admission is on: the agent's pod is refused where `restricted` is enforced.
    cp.kubectl(&["create", "namespace", "sg-restricted"])
        .unwrap();
    cp.kubectl(&[
        "label",
        "namespace",
        "sg-restricted",
        "pod-security.kubernetes.io/enforce=restricted",
    ])
    .unwrap();
    let agent = pods(&k, "stepguard", "app.kubernetes.io/name=stepguard").remove(0);
    let spec = serde_json::to_value(agent.spec.unwrap()).unwrap();
    let mut spec = spec;
    for f in ["nodeName", "serviceAccountName", "serviceAccount"] {
        spec.as_object_mut().unwrap().remove(f);
    }
    wait_for(
        "the namespace's default ServiceAccount",
        || {
            cp.kubectl(&["-n", "sg-restricted", "get", "serviceaccount", "default"])
                .is_ok()
        },
        String::new,
    );
    let r = k.create(
        &k.ns::<Pod>("sg-restricted"),
        serde_json::json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "agent", "namespace": "sg-restricted"}, "spec": spec}),
    );
    let err = format!(
        "{:#}",
        r.expect_err("restricted refuses a host-network pod")
    );
    assert!(err.contains("violates PodSecurity"), "{err}");
}
