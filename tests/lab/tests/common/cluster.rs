//! The Kubernetes side the rollout tests share (`rollout.rs` with the imitated LAN lab,
//! `real_rollout.rs` with real agents): the shipped manifests, the Cilium DaemonSet's
//! revisions and template, bounded waits.
use k8s_openapi::api::apps::v1::{ControllerRevision, DaemonSet};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use stepguard_lab::kube::{ControlPlane, Kube};

pub const KS: &str = "kube-system";

pub fn repo_root() -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The manifests as shipped (server-side apply): the Prometheus operator's CRDs they use,
/// `deploy/base` (the namespace, the agents' DaemonSet) and `deploy/rollout` (the stepper's
/// ServiceAccount and RBAC).
pub fn apply_shipped_manifests(c: &ControlPlane) {
    let root = repo_root();
    for crd in [
        "monitoring.coreos.com_servicemonitors.yaml",
        "monitoring.coreos.com_prometheusrules.yaml",
    ] {
        let f = root
            .join("third_party/prometheus-operator-v0.93.0")
            .join(crd);
        c.kubectl(&["apply", "--server-side", "-f", f.to_str().unwrap()])
            .expect("CRD");
    }
    c.wait_crds_established(
        &[
            "crd/servicemonitors.monitoring.coreos.com",
            "crd/prometheusrules.monitoring.coreos.com",
        ],
        Duration::from_secs(30),
    )
    .expect("CRDs established");
    for d in ["deploy/base", "deploy/rollout"] {
        c.kubectl(&[
            "apply",
            "--server-side",
            "-k",
            root.join(d).to_str().unwrap(),
        ])
        .unwrap_or_else(|e| panic!("apply {d}: {e:#}"));
    }
}

pub fn current_revision(k: &Kube) -> (String, i64) {
    revision_now(k).expect("the DaemonSet has a revision")
}

pub fn revision_now(k: &Kube) -> Option<(String, i64)> {
    let ds = k.block(k.ns::<DaemonSet>(KS).get("cilium")).unwrap();
    let uid = ds.metadata.uid.clone().unwrap();
    let revs = k
        .block(k.ns::<ControllerRevision>(KS).list(&Default::default()))
        .unwrap();
    revs.items
        .iter()
        .filter(|r| {
            r.metadata
                .owner_references
                .iter()
                .flatten()
                .any(|o| o.uid == uid)
        })
        .max_by_key(|r| r.revision)
        .map(|r| {
            (
                r.metadata.labels.as_ref().unwrap()["controller-revision-hash"].clone(),
                r.revision,
            )
        })
}

pub fn observed(k: &Kube) -> bool {
    let ds = k.block(k.ns::<DaemonSet>(KS).get("cilium")).unwrap();
    ds.status.and_then(|s| s.observed_generation) == ds.metadata.generation
}

/// Merges `patch` into the DaemonSet; the current revision's hash once the controller
/// observed it.
pub fn patch_daemonset(k: &Kube, patch: Value) -> String {
    k.merge(&k.ns::<DaemonSet>(KS), "cilium", patch, false)
        .expect("change the DaemonSet");
    wait_until(
        "the controller observes the template",
        Duration::from_secs(20),
        || observed(k),
        String::new,
    );
    current_revision(k).0
}

/// Sets the template's bump annotation (a new template, or back to an old one); returns the
/// revision the controller made or reused for it, once observed.
pub fn set_template(k: &Kube, bump: u32, approve: bool) -> String {
    let hash = patch_daemonset(
        k,
        json!({"spec": {"template": {"metadata": {"annotations": {"stepguard.test/bump": bump.to_string()}}}}}),
    );
    if approve {
        approve_revision(k, &hash);
    }
    hash
}

pub fn approve_revision(k: &Kube, hash: &str) {
    k.merge(
        &k.ns::<DaemonSet>(KS),
        "cilium",
        json!({"metadata": {"annotations": {"stepguard.io/approve-revision": hash}}}),
        false,
    )
    .expect("approve");
}

/// Waits (bounded) until `ok`; panics with `what` and `context()` otherwise.
pub fn wait_until(
    what: &str,
    limit: Duration,
    ok: impl Fn() -> bool,
    context: impl Fn() -> String,
) {
    let deadline = Instant::now() + limit;
    while !ok() {
        assert!(
            Instant::now() < deadline,
            "{what}: not within {limit:?}\n{}",
            context()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The cilium pods: name → (node it is for, revision hash, Ready, Terminating).
pub fn cilium_pods_in(k: &Kube) -> BTreeMap<String, (String, String, bool, bool)> {
    let lp = kube::api::ListParams::default().labels("k8s-app=cilium");
    let pods = k.block(k.ns::<Pod>(KS).list(&lp)).unwrap();
    pods.items
        .into_iter()
        .map(|p| {
            let ready = p
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
                .is_some_and(|c| c.status == "True");
            (
                p.metadata.name.clone().unwrap(),
                (
                    stepguard_lab::kube::kubelet::target_node(&p).unwrap_or_default(),
                    p.metadata
                        .labels
                        .as_ref()
                        .and_then(|l| l.get("controller-revision-hash").cloned())
                        .unwrap_or_default(),
                    ready,
                    p.metadata.deletion_timestamp.is_some(),
                ),
            )
        })
        .collect()
}
