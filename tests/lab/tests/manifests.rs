//! The shipped manifests meet a real API server: `deploy/base` with
//! `deploy/rollout`, and every overlay in `deploy/examples`, each on a cluster of its own,
//! applied server-side (the CRDs from `third_party/` first) to kube-apiserver with RBAC and Pod Security admission on; the namespace keeps the
//! labels it ships with, and the pods the real controllers make from the workloads are
//! admitted (Pod Security enforces on pods, not on their templates). A namespace enforcing
//! `restricted` proves admission really runs here: the same agent pod is refused there.
mod common;
use common::cluster::repo_root;
use common::plane::{kube_bin, plane_for_manifests, pods_anywhere, wait_for};
use common::*;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use stepguard_lab::kube::{ControlPlane, Kube};

fn pods(k: &Kube, ns: &str, selector: &str) -> Vec<Pod> {
    let lp = kube::api::ListParams::default().labels(selector);
    k.block(k.ns::<Pod>(ns).list(&lp)).unwrap().items
}

fn apply(cp: &ControlPlane, args: &[&str]) -> String {
    apply_server_side(cp, "stepguard-test", args)
}

#[test]
fn every_manifest_applies_server_side_and_admission_admits_its_pods() {
    require_root();
    let bin = kube_bin();
    let root = repo_root();
    // Each as a user would install it, on a cluster of its own: the base with the stepper, and
    // every example overlay (they replace the base's config, which would roll the base's pods).
    let mut installs: Vec<Vec<String>> = vec![vec!["deploy/base".into(), "deploy/rollout".into()]];
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
    installs.extend(examples.into_iter().map(|e| vec![e]));
    for (n, install) in installs.iter().enumerate() {
        let (g, k) = plane_for_manifests(&bin, &format!("manifests-{n}"));
        let cp = &g.0;
        for o in install {
            let out = apply(cp, &["-k", root.join(o).to_str().unwrap()]);
            assert!(out.contains("serverside-applied"), "{o}: {out}");
            eprintln!("{o}: applied server-side\n{out}");
        }
        // The controllers' pods, admitted: the agent (wherever the overlay puts it) and, with
        // deploy/rollout, the stepper's Deployment.
        let events = || cp.kubectl(&["get", "events", "-A"]).unwrap_or_default();
        let mut selectors = vec!["app.kubernetes.io/name=stepguard"];
        if install.iter().any(|o| o == "deploy/rollout") {
            selectors.push("app.kubernetes.io/name=stepguard-rollout");
        }
        for sel in selectors {
            wait_for(
                &format!("{install:?}: a pod {sel} admitted"),
                || !pods_anywhere(&k, sel).is_empty(),
                events,
            );
        }
        let ev = events();
        assert!(!ev.contains("FailedCreate"), "{install:?}: {ev}");
        if n > 0 {
            continue;
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
        let mut spec = serde_json::to_value(agent.spec.unwrap()).unwrap();
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
}
