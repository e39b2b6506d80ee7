//! Cilium from Git by Flux, stepped by `stepguard rollout --watch`: the real kustomize-controller
//! (v1.9.6, built from its module) on the real control plane reconciles two Kustomizations from
//! a Git repository the lab serves over smart HTTP on 127.0.0.1 (`git http-backend`). The
//! repository holds Cilium's own chart rendered by real Helm (OnDelete, `rollOutCiliumPods`)
//! with a kustomization.yaml — how a user without helm-controller keeps Cilium in Git; no
//! HelmRelease runs here, helm-controller is refused by the module proxy. One commit changes a
//! value (`debug.enabled`) and carries the approval (`stepguard.io/approve-image` and
//! `stepguard.io/approve-config-checksum` through the chart's `annotations:` value), and the
//! stepper with the shipped Deployment's arguments steps every node on simulated Cilium nodes.
//!
//! The source: source-controller v1.9.6 cannot be built here (the proxy refuses its dependency
//! `github.com/fluxcd/pkg/artifact` v0.18.3), so the lab plays its part for the repository
//! (`stepguard_lab::kube::flux::GitSource`): fetches the branch over smart HTTP, packs the
//! commit's tree as an artifact with its digest and revision `main@sha1:COMMIT`, and hands it
//! to kustomize-controller as an `ExternalArtifact`. Everything from the artifact on (kustomize
//! build, server-side apply, health checks, kstatus, the Ready condition) is Flux's own.
#[path = "common/mod.rs"]
mod common;
#[path = "common/stepping.rs"]
mod stepping;
use common::cluster::*;
use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};
use stepguard_lab::kube::chart::CiliumChart;
use stepguard_lab::kube::flux::{flux_dir, GitSource, KustomizeController, NAMESPACE};
use stepguard_lab::kube::git::{git, GitServer};
use stepping::*;

const CILIUM_IMAGE: &str = "quay.io/cilium/cilium:v1.18.2@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
const OPERATOR_IMAGE: &str = "quay.io/cilium/operator-generic:v1.18.2@sha256:fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210";
const NODES: u8 = 2;
const CHECKSUM: &str = "cilium.io/cilium-configmap-checksum";

/// The chart rendered with the lab's values and `extra` (`--set`) and `strings`
/// (`--set-string`), and the config checksum its DaemonSet's template carries.
fn render(chart: &CiliumChart, extra: &[&str], strings: &[&str]) -> (String, String) {
    let values = cilium_values(CILIUM_IMAGE, OPERATOR_IMAGE, &short_leases(), extra);
    let v: Vec<&str> = values.iter().map(String::as_str).collect();
    let yaml = chart
        .render(&v, strings)
        .unwrap_or_else(|e| panic!("{e:#}"));
    let sum = stepguard_lab::kube::chart::checksum(&yaml)
        .expect("the rendered DaemonSet's template carries the config checksum");
    (yaml, sum)
}

/// Writes the rendered chart and its kustomization.yaml into the work tree, commits and pushes
/// to the bare repository the server serves; the commit.
fn commit(work: &Path, bare: &Path, yaml: &str, message: &str) -> String {
    std::fs::create_dir_all(work.join("cilium")).unwrap();
    std::fs::write(work.join("cilium/cilium.yaml"), yaml).unwrap();
    std::fs::write(
        work.join("cilium/kustomization.yaml"),
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n- cilium.yaml\n",
    )
    .unwrap();
    git(work, &["add", "-A"]).unwrap();
    git(work, &["commit", "-q", "-m", message]).unwrap();
    git(work, &["push", "-q", bare.to_str().unwrap(), "main"]).unwrap();
    git(work, &["rev-parse", "HEAD"])
        .unwrap()
        .trim()
        .to_string()
}

/// A Kustomization of `./cilium` from the ExternalArtifact `source`.
fn kustomization(name: &str, source: &str, extra: Value) -> Value {
    let mut spec = json!({
        "interval": "10s", "retryInterval": "3s", "timeout": "15s", "path": "./cilium",
        "sourceRef": {"kind": "ExternalArtifact", "name": source, "namespace": NAMESPACE},
    });
    for (k, v) in extra.as_object().unwrap() {
        spec[k] = v.clone();
    }
    json!({"apiVersion": "kustomize.toolkit.fluxcd.io/v1", "kind": "Kustomization",
           "metadata": {"name": name, "namespace": NAMESPACE}, "spec": spec})
}

/// A Kustomization's Ready condition (status, reason, message) and its last applied revision.
fn ready(e: &Stepped, name: &str) -> (String, String, String, String) {
    let out =
        e.cp.lock()
            .unwrap()
            .kubectl(&["-n", NAMESPACE, "get", "kustomization", name, "-o", "json"])
            .unwrap_or_default();
    let v: Value = serde_json::from_str(&out).unwrap_or_default();
    let c = v["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "Ready").cloned())
        .unwrap_or_default();
    let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
    (
        s(&c["status"]),
        s(&c["reason"]),
        s(&c["message"]),
        s(&v["status"]["lastAppliedRevision"]),
    )
}

fn daemonset(e: &Stepped) -> Value {
    serde_json::to_value(
        e.k.block(
            e.k.ns::<k8s_openapi::api::apps::v1::DaemonSet>(KS)
                .get("cilium"),
        )
        .unwrap(),
    )
    .unwrap()
}

/// Waits (bounded) until `ok`, sampling the advised Kustomization's Ready condition meanwhile.
fn wait_sampling(
    e: &Stepped,
    samples: &mut Vec<(String, String, String)>,
    what: &str,
    limit: Duration,
    ok: impl Fn() -> bool,
    context: impl Fn() -> String,
) {
    let deadline = Instant::now() + limit;
    loop {
        let (st, reason, msg, _) = ready(e, "cilium");
        samples.push((st, reason, msg));
        if ok() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {limit:?}\n{}",
            context()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// One commit changes a Cilium value and approves the revision it makes; Flux applies it, the
/// stalled revision is reported, `rollout --watch` steps every node, the Kustomization set up
/// as docs/rollout.md advises stays Ready all along, and one with `wait: true` is held not
/// Ready while the OnDelete DaemonSet's pods are old and turns Ready once they are stepped.
#[test]
#[ignore = "needs Flux's controllers: cargo xtask test --real-extended"]
fn a_commit_with_its_approval_is_applied_by_flux_and_stepped_while_the_advised_kustomization_stays_ready(
) {
    let started = Instant::now();
    let flux = flux_dir().unwrap_or_else(|e| panic!("{e:#}"));
    let chart = CiliumChart::from_env().unwrap_or_else(|e| panic!("{e:#}"));
    let e = Stepped::up(NODES);
    let cp = e.cp.lock().unwrap().clone();

    // The repository: the chart rendered as installed, served over smart HTTP.
    let repos = e.run_dir.join("git");
    let (bare, work) = (repos.join("fleet.git"), e.run_dir.join("fleet"));
    std::fs::create_dir_all(&repos).unwrap();
    git(
        &repos,
        &["init", "-q", "--bare", "-b", "main", bare.to_str().unwrap()],
    )
    .unwrap();
    git(
        &e.run_dir,
        &["init", "-q", "-b", "main", work.to_str().unwrap()],
    )
    .unwrap();
    let (first_yaml, first_sum) = render(&chart, &[], &[]);
    commit(
        &work,
        &bare,
        &first_yaml,
        "Cilium, OnDelete, rollOutCiliumPods",
    );
    let server = GitServer::start(&repos).expect("the Git server");
    // The controller first: it brings the Flux CRDs and namespace the source's object needs.
    let controller =
        KustomizeController::start(&cp, &flux, &e.run_dir).expect("kustomize-controller");
    let source = GitSource::start(&cp, &server.url("fleet"), "main", "fleet", &e.run_dir)
        .expect("the Git source");
    let log = || {
        let t = std::fs::read_to_string(&controller.log).unwrap_or_default();
        let l: Vec<&str> = t.lines().collect();
        format!(
            "source: {:?}\n--- kustomize-controller (last 20 lines)\n{}",
            source.published(),
            l[l.len().saturating_sub(20)..].join("\n")
        )
    };

    // As docs/rollout.md advises: no `wait`, health checks on what must be healthy only (the
    // operator), not the OnDelete DaemonSet. And the wedge it warns of: `wait: true`.
    let advised = kustomization(
        "cilium",
        &source.name,
        json!({"prune": true, "wait": false, "healthChecks": [
            {"apiVersion": "apps/v1", "kind": "Deployment", "name": "cilium-operator", "namespace": KS}]}),
    );
    let waiting = kustomization(
        "cilium-wait",
        &source.name,
        json!({"prune": false, "wait": true}),
    );
    for (name, k) in [("advised", &advised), ("wait", &waiting)] {
        let f = e.run_dir.join(format!("kustomization-{name}.json"));
        std::fs::write(&f, k.to_string()).unwrap();
        cp.kubectl(&["apply", "--server-side", "-f", f.to_str().unwrap()])
            .unwrap_or_else(|err| panic!("{err:#}"));
    }

    // The install: both Ready on the first commit, every node on the first revision.
    let first_rev = wait_for_revision(&e, &log);
    wait_until(
        "both Kustomizations Ready on the first commit, every node's cilium pod Ready",
        Duration::from_secs(120),
        || {
            ready(&e, "cilium").0 == "True"
                && ready(&e, "cilium-wait").0 == "True"
                && e.all_on(&first_rev)
        },
        || {
            format!(
                "{:?} {:?}\n{}",
                ready(&e, "cilium"),
                ready(&e, "cilium-wait"),
                log()
            )
        },
    );
    let installed = source.published().revision;

    // The change: `debug.enabled` lands in cilium-config (a new checksum, so a new revision),
    // approved in the same commit. The checksum is computed before the commit; the approval
    // annotation itself does not move it (it is on the DaemonSet, not in cilium-config).
    let approve = |sum: &str| {
        vec![
            format!("annotations.stepguard\\.io/approve-image={CILIUM_IMAGE}"),
            format!("annotations.stepguard\\.io/approve-config-checksum={sum}"),
        ]
    };
    let (_, sum) = render(&chart, &["debug.enabled=true"], &[]);
    assert_ne!(
        sum, first_sum,
        "debug.enabled changes cilium-config's checksum"
    );
    let strings = approve(&sum);
    let s: Vec<&str> = strings.iter().map(String::as_str).collect();
    let (change, sum_with_approval) = render(&chart, &["debug.enabled=true"], &s);
    assert_eq!(
        sum_with_approval, sum,
        "the approval does not change the checksum it names"
    );
    let commit2 = commit(
        &work,
        &bare,
        &change,
        "Cilium: debug on, approved for stepguard",
    );
    let applied = format!("main@sha1:{commit2}");
    assert_ne!(applied, installed);

    // Flux applies it: the approval on the DaemonSet's metadata, a new revision.
    let mut samples = Vec::new();
    wait_sampling(
        &e,
        &mut samples,
        "Flux applies the change commit",
        Duration::from_secs(90),
        || {
            ready(&e, "cilium").3 == applied
                && revision_now(&e.k).is_some_and(|(r, _)| r != first_rev)
                && observed(&e.k)
        },
        || format!("{:?}\n{}", ready(&e, "cilium"), log()),
    );
    let ds = daemonset(&e);
    let ann = &ds["metadata"]["annotations"];
    assert_eq!(ann["stepguard.io/approve-image"], CILIUM_IMAGE, "{ann}");
    assert_eq!(
        ann["stepguard.io/approve-config-checksum"],
        sum.as_str(),
        "{ann}"
    );
    assert_eq!(
        ds["spec"]["template"]["metadata"]["annotations"][CHECKSUM],
        sum.as_str()
    );
    let new_rev = current_revision(&e.k).0;

    // Unstepped: what CiliumRolloutStalled's expression reads (updated < desired), and what
    // `--status` tells, before any stepper runs. The `wait: true` Kustomization is wedged.
    let st = &ds["status"];
    assert!(
        st["updatedNumberScheduled"].as_i64().unwrap_or(0)
            < st["desiredNumberScheduled"].as_i64().unwrap_or(0),
        "an OnDelete revision nobody stepped: updated < desired, what the stall alert fires on: {st}"
    );
    let (code, status) = e.rollout(&["--status"]);
    assert_eq!(code, 0, "{status}");
    for i in 0..NODES {
        assert!(
            status
                .lines()
                .any(|l| l.starts_with(&format!("node {}: pod ", node_name(i)))
                    && l.contains(&format!("on revision {first_rev}: to be stepped"))),
            "--status names node {i}'s pod on the old revision, to be stepped:\n{status}"
        );
    }
    wait_sampling(
        &e,
        &mut samples,
        "the `wait: true` Kustomization held not Ready by the OnDelete DaemonSet",
        Duration::from_secs(90),
        || ready(&e, "cilium-wait").0 == "False",
        || format!("{:?}\n{}", ready(&e, "cilium-wait"), log()),
    );
    let wedged = ready(&e, "cilium-wait");
    eprintln!("the `wait: true` Kustomization while the pods are old: {wedged:?}");
    assert!(e.deletions().is_empty(), "nothing stepped yet");

    // The stepper, as the shipped Deployment runs it, at the test's pace.
    let from_del = e.deletions().len();
    let stepper = e.watch(
        "rollout-watch",
        &[
            "--watch-interval",
            "1s",
            "--lock-duration",
            "3s",
            "--settle",
            "1s",
            "--step-timeout",
            "30s",
            "--replace-timeout",
            "30s",
        ],
    );
    wait_sampling(
        &e,
        &mut samples,
        "every node stepped to the new revision and proven",
        Duration::from_secs(240),
        || e.all_on(&new_rev) && event_nodes(&e.k, "StepguardStepPassed").len() == NODES as usize,
        || format!("{:?}\n{}", cilium_pods_in(&e.k), stepper.output()),
    );
    let mut stepped = e.deletions()[from_del..].to_vec();
    stepped.sort();
    let all: Vec<String> = (0..NODES).map(node_name).collect();
    assert_eq!(
        stepped,
        all,
        "each node's pod deleted once: {}",
        stepper.output()
    );
    assert!(
        event_nodes(&e.k, "StepguardStepPassed")
            .values()
            .all(|n| *n == 1),
        "one passed verdict per node"
    );

    // The `wait: true` one recovers once every pod runs the DaemonSet's revision.
    wait_sampling(
        &e,
        &mut samples,
        "the `wait: true` Kustomization Ready again",
        Duration::from_secs(90),
        || ready(&e, "cilium-wait").0 == "True",
        || format!("{:?}\n{}", ready(&e, "cilium-wait"), log()),
    );
    assert_eq!(ready(&e, "cilium-wait").3, applied);

    // The advised one was never not Ready (Unknown is a reconcile in progress).
    let bad: Vec<_> = samples.iter().filter(|(s, _, _)| s == "False").collect();
    assert!(
        bad.is_empty(),
        "the advised Kustomization stayed Ready while stepguard stepped: {bad:?}"
    );
    assert!(samples.iter().filter(|(s, _, _)| s == "True").count() > samples.len() / 2);
    let (code, status) = e.rollout(&["--status"]);
    assert_eq!(code, 0, "{status}");
    for i in 0..NODES {
        assert!(
            status
                .lines()
                .any(|l| l.starts_with(&format!("node {}: pod ", node_name(i)))
                    && l.contains("proven")),
            "--status: node {i} proven on the new revision:\n{status}"
        );
    }
    let count = |v: &str| samples.iter().filter(|(s, _, _)| s == v).count();
    eprintln!(
        "Flux scenario: the advised Kustomization sampled {} times (Ready {}, Unknown {}), {:.0} s",
        samples.len(),
        count("True"),
        count("Unknown"),
        started.elapsed().as_secs_f64()
    );
    drop(stepper);
    drop(controller);
    drop(source);
    drop(server);
}

/// The DaemonSet's first revision, once Flux created it.
fn wait_for_revision(e: &Stepped, log: &dyn Fn() -> String) -> String {
    wait_until(
        "Flux creates the DaemonSet and the controller its first revision",
        Duration::from_secs(120),
        || {
            e.k.block(
                e.k.ns::<k8s_openapi::api::apps::v1::DaemonSet>(KS)
                    .get_opt("cilium"),
            )
            .ok()
            .flatten()
            .is_some()
                && observed(&e.k)
                && revision_now(&e.k).is_some()
        },
        log,
    );
    current_revision(&e.k).0
}
