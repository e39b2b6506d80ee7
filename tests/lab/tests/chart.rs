//! Cilium's own Helm chart (`install/kubernetes/cilium` of the Cilium module the tests build the
//! agent from), rendered by real Helm (built from `helm.sh/helm/v4`, pinned) as a user's
//! `helm template`/`helm upgrade` renders it with `updateStrategy.type: OnDelete` and
//! `rollOutCiliumPods: true`, and applied server-side to a real control plane: the DaemonSet the
//! stepper steps, its cilium-config, the operator. A change of a value that lands in
//! cilium-config changes the chart's checksum annotation on the pod template, so the DaemonSet
//! controller makes a new revision — the revision the stepper then rolls out — and the
//! stepper's own read of the cluster (`stepguard rollout --dry-run --output json`) sees the
//! chart's objects as they are: OnDelete, the newest revision, the release's minor, the
//! operator. With the lab kubelet running the pods, real `helm install`/`helm upgrade` show
//! what Helm 4's `--wait` does to an OnDelete DaemonSet and what `--wait=legacy` does, and the
//! approval post-renderer shipped in `deploy/helm/stepguard-approve` runs in a real `helm
//! upgrade`.
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

/// `helm` as a user runs it against the test's cluster: its own config, cache and plugin
/// directories (`plugins`), kubectl on PATH (the post-renderer runs `kubectl kustomize`).
fn helm(
    chart: &CiliumChart,
    cp: &ControlPlane,
    home: &Path,
    plugins: &Path,
    args: &[&str],
) -> std::process::Output {
    let kube_bin = cp.bin.to_str().unwrap();
    let path = format!("{kube_bin}:{}", std::env::var("PATH").unwrap_or_default());
    Command::new(&chart.helm)
        .args(args)
        .args([
            "--kubeconfig",
            cp.admin_kubeconfig().to_str().unwrap(),
            "--namespace",
            "kube-system",
        ])
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_DATA_HOME", home.join("data"))
        .env("HELM_PLUGINS", plugins)
        .env("PATH", path)
        .output()
        .expect("run helm")
}

/// `helm install`/`upgrade cilium` of the chart with the OnDelete values, one operator replica,
/// `extra` (`--set`) and `args`.
fn helm_release(
    chart: &CiliumChart,
    cp: &ControlPlane,
    home: &Path,
    verb: &str,
    extra: &[&str],
    args: &[&str],
) -> std::process::Output {
    let mut a: Vec<&str> = vec![verb, "cilium", chart.chart.to_str().unwrap()];
    for v in stepguard_lab::kube::chart::ONDELETE
        .iter()
        .chain(&["operator.replicas=1"])
        .chain(extra)
    {
        a.extend(["--set", v]);
    }
    a.extend(args);
    helm(chart, cp, home, &home.join("plugins"), &a)
}

fn text(o: &std::process::Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The chart's DaemonSet's newest revision's hash and the hashes its pods run.
fn pods_and_revision(k: &Kube) -> (String, Vec<String>) {
    use k8s_openapi::api::core::v1::Pod;
    let newest = revisions(k, 1).pop().unwrap().0;
    let lp = kube::api::ListParams::default().labels("k8s-app=cilium");
    let pods = k
        .block(k.ns::<Pod>("kube-system").list(&lp))
        .unwrap()
        .items
        .into_iter()
        .filter_map(|p| p.metadata.labels?.get("controller-revision-hash").cloned())
        .collect();
    (newest, pods)
}

/// Helm 4's `--wait` (the kstatus watcher) holds an OnDelete DaemonSet InProgress while its
/// pods run the old template — every pod until the stepper has stepped them all — so an
/// upgrade that changes the template times out and fails, and `--rollback-on-failure` then
/// puts the old template back under the stepper; `--wait=legacy` (Helm 3's ready checker)
/// passes an OnDelete DaemonSet at once and still waits for the operator's Deployment.
#[test]
fn helm_wait_times_out_on_the_ondelete_daemonset_and_legacy_wait_does_not() {
    require_root();
    let chart = CiliumChart::from_env().unwrap_or_else(|e| panic!("{e:#}"));
    let kube_bin = PathBuf::from(
        std::env::var("STEPGUARD_KUBE_BIN")
            .expect("STEPGUARD_KUBE_BIN: the control plane (`cargo xtask test` sets it)"),
    );
    let dir = std::env::temp_dir().join(format!("sg-helm-wait-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("plugins")).unwrap();
    let g = PlaneGuard(
        ControlPlane::up(&dir.join("cp"), &kube_bin).expect("control plane up"),
        dir.clone(),
    );
    let k = Kube::connect(&g.0.admin_kubeconfig()).unwrap();
    let nodes: Vec<(String, String)> = vec![
        ("node-a".into(), "192.0.2.10".into()),
        ("node-b".into(), "192.0.2.11".into()),
    ];
    stepguard_lab::kube::create_nodes(&k, &nodes).unwrap();
    // The lab kubelet reports the pods bound to the nodes Running and Ready; nobody deletes a
    // cilium pod here, so its restart hook never runs.
    let _kubelet = stepguard_lab::kube::kubelet::Kubelet::start(
        &g.0.admin_kubeconfig(),
        nodes.into_iter().collect(),
        std::sync::Arc::new(|node: &str, _| panic!("nobody deleted {node}'s cilium pod")),
        None,
    )
    .expect("lab kubelet");

    // Installed, waited for: every pod Ready.
    let o = helm_release(
        &chart,
        &g.0,
        &dir,
        "install",
        &[],
        &["--wait", "--timeout", "90s"],
    );
    assert!(o.status.success(), "helm install --wait: {}", text(&o));
    let (installed, pods) = pods_and_revision(&k);
    assert_eq!(
        pods,
        vec![installed.clone(); 2],
        "both pods on the installed revision"
    );
    let installed_sum = checksum(&daemonset(&k));

    // A value that lands in cilium-config: a new template, which no pod runs until stepped.
    let t = Instant::now();
    let o = helm_release(
        &chart,
        &g.0,
        &dir,
        "upgrade",
        &["debug.enabled=true"],
        &["--wait", "--timeout", "10s"],
    );
    assert!(
        !o.status.success(),
        "helm upgrade --wait on an OnDelete DaemonSet: {}",
        text(&o)
    );
    assert!(
        t.elapsed() >= Duration::from_secs(10),
        "it failed by timing out: {}",
        text(&o)
    );
    let err = String::from_utf8_lossy(&o.stderr);
    eprintln!(
        "helm upgrade --wait on the OnDelete DaemonSet: {}",
        text(&o)
    );
    assert!(
        err.contains("resource DaemonSet/kube-system/cilium not ready")
            && err.contains("Updated: 0/2"),
        "the wait names what it waited for: {}",
        text(&o)
    );
    let (upgraded, pods) = pods_and_revision(&k);
    assert_ne!(
        upgraded, installed,
        "the failed upgrade's template is applied"
    );
    assert_eq!(
        pods,
        vec![installed.clone(); 2],
        "no pod replaced (OnDelete)"
    );
    let status = helm(
        &chart,
        &g.0,
        &dir,
        &dir.join("plugins"),
        &["status", "cilium"],
    );
    assert!(
        String::from_utf8_lossy(&status.stdout).contains("STATUS: failed"),
        "the release is failed: {}",
        text(&status)
    );

    // With a rollback on failure (a HelmRelease's remediation), the timeout puts the old
    // template back: the revision the stepper was about to roll out is gone.
    let o = helm_release(
        &chart,
        &g.0,
        &dir,
        "upgrade",
        &["debug.enabled=true", "debug.verbose=flow"],
        &["--wait", "--timeout", "10s", "--rollback-on-failure"],
    );
    assert!(!o.status.success(), "{}", text(&o));
    let ds = daemonset(&k);
    let cm = k
        .block(k.ns::<ConfigMap>("kube-system").get("cilium-config"))
        .unwrap();
    let data = cm.data.unwrap_or_default();
    assert_eq!(
        data.get("debug-verbose").map(String::as_str),
        None,
        "rolled back: cilium-config without the upgrade's value; {}",
        text(&o)
    );
    assert_eq!(
        checksum(&ds),
        installed_sum,
        "the installed template's checksum again"
    );
    let (newest, _) = pods_and_revision(&k);
    assert_eq!(
        newest, installed,
        "the controller's newest revision is the installed template again"
    );

    // Helm 3's ready checker: an OnDelete DaemonSet is ready at once; the upgrade succeeds
    // with the pods on the old template, and the stepper has a revision to roll out.
    let t = Instant::now();
    let o = helm_release(
        &chart,
        &g.0,
        &dir,
        "upgrade",
        &["debug.enabled=true"],
        &["--wait=legacy", "--timeout", "60s"],
    );
    assert!(
        o.status.success(),
        "helm upgrade --wait=legacy: {}",
        text(&o)
    );
    assert!(t.elapsed() < Duration::from_secs(60));
    let (newest, pods) = pods_and_revision(&k);
    assert_ne!(newest, installed);
    assert_eq!(pods, vec![installed; 2], "the pods wait for the stepper");
}

/// The post-renderer in `deploy/helm/stepguard-approve` (a strategic-merge patch by `kubectl
/// kustomize`) puts both approval annotations on the chart's DaemonSet through a real `helm
/// upgrade --post-renderer`, with and without the chart's `annotations:` value; a JSON6902
/// `add` below `/metadata/annotations` — kustomize's, as a HelmRelease's `postRenderers` run
/// it — fails on the chart as shipped (no `metadata.annotations` to add to) and works only
/// with that value set.
#[test]
fn the_approval_post_renderer_works_with_and_without_the_charts_annotations_value() {
    require_root();
    let chart = CiliumChart::from_env().unwrap_or_else(|e| panic!("{e:#}"));
    let kube_bin = PathBuf::from(
        std::env::var("STEPGUARD_KUBE_BIN")
            .expect("STEPGUARD_KUBE_BIN: the control plane (`cargo xtask test` sets it)"),
    );
    let dir = std::env::temp_dir().join(format!("sg-helm-post-{}", std::process::id()));
    let plugins = dir.join("plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    std::os::unix::fs::symlink(
        common::cluster::repo_root().join("deploy/helm/stepguard-approve"),
        plugins.join("stepguard-approve"),
    )
    .unwrap();
    let g = PlaneGuard(
        ControlPlane::up(&dir.join("cp"), &kube_bin).expect("control plane up"),
        dir.clone(),
    );
    let k = Kube::connect(&g.0.admin_kubeconfig()).unwrap();
    let image = "quay.io/cilium/cilium:v1.20.2@sha256:00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
    let image_value = format!("image.override={image}");
    let approve = |extra: &[&str], sum: &str, verb: &str| {
        let mut values = vec![image_value.as_str()];
        values.extend(extra);
        helm_release(
            &chart,
            &g.0,
            &dir,
            verb,
            &values,
            &[
                "--post-renderer",
                "stepguard-approve",
                "--post-renderer-args",
                image,
                "--post-renderer-args",
                sum,
            ],
        )
    };
    let sum_of = |extra: &[&str]| {
        let mut values = vec!["operator.replicas=1", image_value.as_str()];
        values.extend(extra);
        stepguard_lab::kube::chart::checksum(&chart.render(&values, &[]).unwrap()).unwrap()
    };
    let approval = |k: &Kube| {
        let ann = daemonset(k).metadata.annotations.unwrap_or_default();
        (
            ann.get("stepguard.io/approve-image").cloned(),
            ann.get("stepguard.io/approve-config-checksum").cloned(),
            ann.get("example.com/owner").cloned(),
        )
    };

    // Without the chart's `annotations:` value.
    let sum = sum_of(&[]);
    let o = approve(&[], &sum, "install");
    assert!(
        o.status.success(),
        "helm install --post-renderer: {}",
        text(&o)
    );
    assert_eq!(
        approval(&k),
        (Some(image.to_string()), Some(sum.clone()), None)
    );
    assert_eq!(
        checksum(&daemonset(&k)),
        sum,
        "the approval names the rendered checksum"
    );

    // With it (and a new config): the chart's own annotation and the approval side by side.
    let owner = ["annotations.example\\.com/owner=net", "debug.enabled=true"];
    let sum2 = sum_of(&owner);
    assert_ne!(sum2, sum);
    let o = approve(&owner, &sum2, "upgrade");
    assert!(
        o.status.success(),
        "helm upgrade --post-renderer: {}",
        text(&o)
    );
    assert_eq!(
        approval(&k),
        (
            Some(image.to_string()),
            Some(sum2.clone()),
            Some("net".to_string())
        )
    );
    assert_eq!(checksum(&daemonset(&k)), sum2);

    // The plugin refuses to run without its two arguments: the upgrade fails naming it (Helm
    // does not pass the plugin's own line on) and changes nothing.
    let o = helm_release(
        &chart,
        &g.0,
        &dir,
        "upgrade",
        &[],
        &["--post-renderer", "stepguard-approve"],
    );
    assert!(!o.status.success(), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("\"stepguard-approve\" exited with error"),
        "{}",
        text(&o)
    );
    assert_eq!(approval(&k).1, Some(sum2.clone()), "nothing applied");

    // A JSON6902 `add` of the same annotation on the chart as shipped (no
    // `metadata.annotations`): kustomize applies it — it keeps annotations of its own on every
    // resource while it works, so the parent is there — but a plain RFC 6902 applier
    // (`kubectl patch --local --type json`) refuses it for the missing parent. The
    // strategic-merge patch above depends on neither.
    let d = dir.join("json6902");
    std::fs::create_dir_all(&d).unwrap();
    let rendered = d.join("rendered.yaml");
    render(&chart, &rendered, &[], &[]);
    let add = r#"[{"op": "add", "path": "/metadata/annotations/stepguard.io~1approve-image", "value": "x"}]"#;
    std::fs::write(
        d.join("kustomization.yaml"),
        format!(
            "resources: [rendered.yaml]\npatches:\n\
             - target: {{group: apps, version: v1, kind: DaemonSet, name: cilium}}\n  patch: '{add}'\n"
        ),
    )
    .unwrap();
    let out =
        g.0.kubectl(&["kustomize", d.to_str().unwrap()])
            .expect("kustomize applies the add below /metadata/annotations");
    assert!(out.contains("stepguard.io/approve-image: x"), "{out}");
    let ds = d.join("daemonset.yaml");
    let text = std::fs::read_to_string(&rendered).unwrap();
    let doc = text
        .split("\n---\n")
        .find(|d| d.contains("\nkind: DaemonSet\n") && d.contains("\n  name: cilium\n"))
        .expect("the rendered DaemonSet");
    std::fs::write(&ds, doc).unwrap();
    let e =
        g.0.kubectl(&[
            "patch",
            "--local",
            "-f",
            ds.to_str().unwrap(),
            "--type",
            "json",
            "-p",
            add,
            "-o",
            "yaml",
        ])
        .expect_err("an RFC 6902 add with no parent");
    assert!(
        format!("{e:#}").contains("missing path"),
        "the applier names the missing parent: {e:#}"
    );
}
