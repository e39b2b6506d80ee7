//! The Kubernetes side the rollout tests share (`rollout.rs` with the imitated LAN lab,
//! `real_rollout.rs` with real agents): the shipped manifests, the Cilium DaemonSet's
//! revisions and template, bounded waits.
use k8s_openapi::api::apps::v1::{ControllerRevision, DaemonSet};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use stepguard_lab::kube::chart::CiliumChart;
use stepguard_lab::kube::{ControlPlane, Kube};
use stepguard_lab::lan::LeaseTimings;

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

/// The Cilium chart values a rollout lab installs with: the tests' agent and operator images
/// (whose approval the stepper judges), L2 announcements with the lab's lease timings (in
/// `cilium-config`, where the stepper reads them), and `extra`.
pub fn cilium_values(
    image: &str,
    operator: &str,
    lease: &LeaseTimings,
    extra: &[&str],
) -> Vec<String> {
    let ms = |d: Duration| format!("{}ms", d.as_millis());
    let mut v = vec![
        format!("image.override={image}"),
        format!("operator.image.override={operator}"),
        "l2announcements.enabled=true".to_string(),
        format!("l2announcements.leaseDuration={}", ms(lease.duration)),
        format!("l2announcements.leaseRenewDeadline={}", ms(lease.renew)),
        format!("l2announcements.leaseRetryPeriod={}", ms(lease.retry)),
    ];
    v.extend(extra.iter().map(|e| e.to_string()));
    v
}

/// Cilium as its own chart renders it (real Helm; [`CiliumChart`]) with `values` and `strings`
/// (`--set-string`), applied server-side into `dir/cilium-N.yaml`: the DaemonSet the stepper
/// steps, `cilium-config`, the operator, their ServiceAccounts and RBAC. A render is made once
/// per test process for the same values (Helm takes a second; the labs install the same
/// Cilium many times). `keep_config`: the cluster's own `cilium-config` stays (real agents run
/// with it; the chart's would configure them for a cluster the lab is not), the rendered one
/// is left out.
pub fn install_cilium(
    cp: &ControlPlane,
    dir: &std::path::Path,
    values: &[String],
    strings: &[String],
    keep_config: bool,
) {
    static RENDERS: Mutex<Vec<(Vec<String>, String)>> = Mutex::new(Vec::new());
    let key: Vec<String> = values
        .iter()
        .chain(strings)
        .cloned()
        .chain([strings.len().to_string()])
        .collect();
    let cached = RENDERS
        .lock()
        .unwrap()
        .iter()
        .find(|(k, _)| *k == key)
        .map(|(_, y)| y.clone());
    let yaml = cached.unwrap_or_else(|| {
        let chart = CiliumChart::from_env().unwrap_or_else(|e| panic!("{e:#}"));
        let v: Vec<&str> = values.iter().map(String::as_str).collect();
        let s: Vec<&str> = strings.iter().map(String::as_str).collect();
        let yaml = chart.render(&v, &s).unwrap_or_else(|e| panic!("{e:#}"));
        RENDERS.lock().unwrap().push((key, yaml.clone()));
        yaml
    });
    let yaml = if keep_config {
        yaml.split("\n---\n")
            .filter(|d| {
                !(d.contains("\nkind: ConfigMap\n") && d.contains("\n  name: cilium-config\n"))
            })
            .collect::<Vec<_>>()
            .join("\n---\n")
    } else {
        yaml
    };
    static APPLIED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = APPLIED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let file = dir.join(format!("cilium-{n}.yaml"));
    let t = Instant::now();
    stepguard_lab::kube::chart::apply_rendered(cp, &file, &yaml)
        .unwrap_or_else(|e| panic!("install Cilium's chart: {e:#}"));
    eprintln!(
        "Cilium's chart applied ({}) in {:.1}s",
        file.display(),
        t.elapsed().as_secs_f64()
    );
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
