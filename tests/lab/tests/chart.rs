//! Cilium's own Helm chart (`install/kubernetes/cilium` of the Cilium module the tests build the
//! agent from), rendered by real Helm (built from `helm.sh/helm/v4`, pinned) as a user's
//! `helm template`/`helm upgrade` renders it with `updateStrategy.type: OnDelete` and
//! `rollOutCiliumPods: true`, and applied server-side to a real control plane: the DaemonSet the
//! stepper steps, its cilium-config, the operator. A change of a value that lands in
//! cilium-config changes the chart's checksum annotation on the pod template, so the DaemonSet
//! controller makes a new revision — the revision the stepper then rolls out — and the
//! stepper's own read of the cluster (`stepguard rollout --dry-run --output json`) sees the
//! chart's objects as they are: OnDelete, the newest revision, the release's minor, the
//! operator.
mod common;
use common::*;
use k8s_openapi::api::apps::v1::{ControllerRevision, DaemonSet};
use k8s_openapi::api::core::v1::ConfigMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use stepguard_lab::kube::chart::CiliumChart;
use stepguard_lab::kube::{ControlPlane, Kube};

/// The annotation Cilium's chart puts on the agent's pod template with `rollOutCiliumPods`.
const CHECKSUM: &str = "cilium.io/cilium-configmap-checksum";

/// `helm template` of Cilium's chart into `out`, with the values a user of OnDelete sets, one
/// operator replica, `extra` values and `strings` (`--set-string`).
fn render(chart: &CiliumChart, out: &Path, extra: &[&str], strings: &[&str]) {
    let mut values = vec!["operator.replicas=1"];
    values.extend(extra);
    let yaml = chart
        .render(&values, strings)
        .unwrap_or_else(|e| panic!("{e:#}"));
    std::fs::write(out, yaml).unwrap();
}

/// The `metadata:` block of the rendered object of `kind` named `name` (what a post-renderer
/// patches: the chart's output, before the API server adds anything).
fn rendered_metadata(file: &Path, kind: &str, name: &str) -> String {
    let text = std::fs::read_to_string(file).unwrap();
    let doc = text
        .split("\n---\n")
        .find(|d| {
            d.contains(&format!("\nkind: {kind}\n")) && d.contains(&format!("\n  name: {name}\n"))
        })
        .unwrap_or_else(|| panic!("no {kind} {name} in {}", file.display()));
    let mut block = String::from("metadata:");
    for line in doc
        .lines()
        .skip_while(|l| *l != "metadata:")
        .skip(1)
        .take_while(|l| l.starts_with(' '))
    {
        block.push('\n');
        block.push_str(line);
    }
    block
}

fn apply(cp: &ControlPlane, file: &Path) {
    apply_server_side(cp, "helm", &["-f", file.to_str().unwrap()]);
}

fn daemonset(k: &Kube) -> DaemonSet {
    k.block(k.ns::<DaemonSet>("kube-system").get("cilium"))
        .expect("the chart's DaemonSet kube-system/cilium")
}

fn checksum(ds: &DaemonSet) -> String {
    ds.spec
        .as_ref()
        .and_then(|s| s.template.metadata.as_ref())
        .and_then(|m| m.annotations.as_ref())
        .and_then(|a| a.get(CHECKSUM).cloned())
        .unwrap_or_else(|| panic!("the pod template carries no {CHECKSUM}"))
}

/// The DaemonSet's revisions, (hash, number), once the controller has made `n`.
fn revisions(k: &Kube, n: usize) -> Vec<(String, i64)> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let lp = kube::api::ListParams::default().labels("k8s-app=cilium");
        let mut revs: Vec<(String, i64)> = k
            .block(k.ns::<ControllerRevision>("kube-system").list(&lp))
            .unwrap()
            .items
            .into_iter()
            .map(|r| {
                let hash = r
                    .metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get("controller-revision-hash").cloned())
                    .unwrap_or_default();
                (hash, r.revision)
            })
            .collect();
        revs.sort_by_key(|r| r.1);
        if revs.len() >= n {
            return revs;
        }
        assert!(
            Instant::now() < deadline,
            "the DaemonSet controller made {} revisions of the chart's DaemonSet within 60 s, not {n}: {revs:?}",
            revs.len()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The stepper's view of the cluster (`--dry-run --output json`): with no agent to prove a
/// node the plan refuses, and the view comes with the refusals.
fn stepper_view(cp: &ControlPlane) -> serde_json::Value {
    let o = Command::new(bin("STEPGUARD_BIN", "stepguard"))
        .args([
            "rollout",
            "--daemonset",
            "kube-system/cilium",
            "--dry-run",
            "--output",
            "json",
        ])
        .env("KUBECONFIG", cp.admin_kubeconfig())
        .output()
        .expect("run stepguard rollout");
    let out = String::from_utf8_lossy(&o.stdout);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| {
        panic!(
            "stepguard rollout --dry-run --output json: {e}\nstdout: {out}\nstderr: {}",
            String::from_utf8_lossy(&o.stderr)
        )
    });
    v["view"].clone()
}

#[test]
fn a_cilium_config_value_changed_in_the_real_chart_is_a_new_revision_the_stepper_sees() {
    require_root();
    let chart = CiliumChart::from_env().unwrap_or_else(|e| panic!("{e:#}"));
    let kube_bin = PathBuf::from(
        std::env::var("STEPGUARD_KUBE_BIN")
            .expect("STEPGUARD_KUBE_BIN: the control plane (`cargo xtask test` sets it)"),
    );
    let dir = std::env::temp_dir().join(format!("sg-chart-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let g = PlaneGuard(
        ControlPlane::up(&dir.join("cp"), &kube_bin).expect("control plane up"),
        dir.clone(),
    );
    let k = Kube::connect(&g.0.admin_kubeconfig()).unwrap();
    stepguard_lab::kube::create_nodes(&k, &[("node-a".into(), "192.0.2.10".into())]).unwrap();

    // As installed.
    let first = dir.join("cilium-1.yaml");
    render(&chart, &first, &[], &[]);
    apply(&g.0, &first);
    let ds = daemonset(&k);
    let strategy = ds.spec.as_ref().and_then(|s| s.update_strategy.clone());
    assert_eq!(
        strategy.and_then(|s| s.type_).as_deref(),
        Some("OnDelete"),
        "the chart's DaemonSet with updateStrategy.type=OnDelete"
    );
    let sum1 = checksum(&ds);
    let revs1 = revisions(&k, 1);
    assert_eq!(revs1.len(), 1, "one revision as installed: {revs1:?}");
    let view = stepper_view(&g.0);
    assert_eq!(view["update_strategy"], "OnDelete", "{view}");
    assert_eq!(view["revision"][0], revs1[0].0.as_str(), "{view}");
    assert_eq!(view["cilium_version"], "1.20", "the chart's image: {view}");

    // One value that lands in cilium-config: the ConfigMap changes, and with it the checksum
    // on the pod template, so the controller makes a new revision.
    let second = dir.join("cilium-2.yaml");
    render(&chart, &second, &["debug.enabled=true"], &[]);
    apply(&g.0, &second);
    let cm = k
        .block(k.ns::<ConfigMap>("kube-system").get("cilium-config"))
        .expect("the chart's cilium-config");
    assert_eq!(
        cm.data
            .as_ref()
            .and_then(|d| d.get("debug"))
            .map(String::as_str),
        Some("true"),
        "the chart's cilium-config carries the new value"
    );
    let sum2 = checksum(&daemonset(&k));
    assert_ne!(sum1, sum2, "the checksum annotation follows cilium-config");
    let revs2 = revisions(&k, 2);
    assert_eq!(
        revs2.len(),
        2,
        "a new revision for the config change: {revs2:?}"
    );
    assert!(revs2[1].1 > revs1[0].1);
    let view = stepper_view(&g.0);
    assert_eq!(
        view["revision"][0],
        revs2[1].0.as_str(),
        "the stepper goes on to the chart's newest revision: {view}"
    );

    // The same values again: no new revision (the checksum is of the ConfigMap's content).
    apply(&g.0, &second);
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(revisions(&k, 2).len(), 2, "re-applying the same render");

    // A Git approval through the chart's own `annotations:` value (docs/rollout.md): the two
    // annotations land on the DaemonSet's metadata — which the chart renders only when that
    // value is set, so a JSON6902 `add` below `/metadata/annotations` has no parent without it
    // — and not on the pod template, so the approval makes no revision of its own.
    let meta = rendered_metadata(&second, "DaemonSet", "cilium");
    assert!(
        !meta.contains("\n  annotations:"),
        "without `annotations:` the chart renders the DaemonSet without metadata.annotations:\n{meta}"
    );
    let ds = daemonset(&k);
    let image = ds
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.containers.iter().find(|c| c.name == "cilium-agent"))
        .and_then(|c| c.image.clone())
        .expect("the cilium-agent container's image");
    let approve_image = format!("annotations.stepguard\\.io/approve-image={image}");
    let approve_sum = format!("annotations.stepguard\\.io/approve-config-checksum={sum2}");
    let third = dir.join("cilium-3.yaml");
    render(
        &chart,
        &third,
        &["debug.enabled=true"],
        &[&approve_image, &approve_sum],
    );
    apply(&g.0, &third);
    let ds = daemonset(&k);
    let ann = ds.metadata.annotations.clone().unwrap_or_default();
    assert_eq!(
        ann.get("stepguard.io/approve-image"),
        Some(&image),
        "{ann:?}"
    );
    assert_eq!(
        ann.get("stepguard.io/approve-config-checksum"),
        Some(&sum2),
        "{ann:?}"
    );
    let template = ds
        .spec
        .as_ref()
        .and_then(|s| s.template.metadata.as_ref())
        .and_then(|m| m.annotations.clone())
        .unwrap_or_default();
    assert!(
        !template.keys().any(|k| k.starts_with("stepguard.io/")),
        "the approval is not on the pod template: {template:?}"
    );
    assert_eq!(checksum(&ds), sum2);
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(revisions(&k, 2).len(), 2, "the approval made no revision");
}
