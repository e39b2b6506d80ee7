//! The Helm chart `deploy/helm/stepguard` is the kustomize base by another route: real Helm
//! (v4.3.2) lints it strictly and its schema refuses a mistyped key or a value of the wrong
//! type; it renders what `kubectl kustomize` renders of `deploy/base` (its defaults), of
//! `deploy/base` with `deploy/rollout` (`rollout.enabled`) and of `deploy/examples/cilium-config`
//! (`ciliumConfig.mount` in kube-system); and on a real control plane with Pod Security
//! admission on, `helm template` applied server-side and a real `helm install` both get their
//! pods admitted, a namespace enforcing `restricted` refuses them, and the stepper's requests
//! pass the chart's RBAC (the API server's audit log: its plan and status, every read; the
//! lock's writes are the base's rules, which the comparison holds equal and the rollout tests
//! exercise).
//!
//! How the renders are compared: both are read as JSON (kubectl, offline) and keyed by kind,
//! namespace and name; the chart's keys must be exactly kustomize's. Each object must then be
//! equal whole once what each tool adds by design is taken out: Helm's labels
//! (`app.kubernetes.io/instance`, `version`, `managed-by`, `helm.sh/chart`), the agents'
//! pod-template annotation `checksum/config` (how the chart rolls the agents on a config change,
//! as kustomize's content hash in the ConfigMap's name does; checked on its own) and that hash
//! wherever the name appears. The stepper runs the agents' image (one binary, one version) in
//! both. Everything else — images, args, securityContexts, volumes, RBAC rules, Service ports, the
//! PrometheusRule's groups, the config's text — must be equal as it is.
mod common;
use common::plane::{kube_bin, plane_for_manifests, pods_anywhere, wait_for};
use common::*;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Namespace;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use stepguard_lab::kube::{ControlPlane, Kube};

/// The labels Helm's chart convention adds; the base carries `name` and `part-of` only.
const HELM_LABELS: [&str; 4] = [
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
    "helm.sh/chart",
];

/// (kind, namespace, name): what an object is, across the two renders.
type Key = (String, String, String);

fn chart() -> PathBuf {
    common::cluster::repo_root().join("deploy/helm/stepguard")
}

/// Real Helm, as Cilium's chart is rendered with.
fn helm_bin() -> PathBuf {
    let var = stepguard_lab::kube::chart::HELM_ENV;
    PathBuf::from(std::env::var_os(var).unwrap_or_else(|| {
        panic!("{var}: Helm, built from helm.sh/helm/v4 (`cargo xtask helm`; `cargo xtask test` sets it)")
    }))
}

fn helm(args: &[&str]) -> Output {
    Command::new(helm_bin())
        .args(args)
        .output()
        .expect("run helm")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `helm template stepguard` of the chart into `namespace` with `args`; the YAML.
fn template(namespace: &str, args: &[&str]) -> String {
    let chart = chart();
    let mut a = vec![
        "template",
        "stepguard",
        chart.to_str().unwrap(),
        "--namespace",
        namespace,
    ];
    a.extend_from_slice(args);
    let o = helm(&a);
    assert!(o.status.success(), "helm {a:?}: {}", text(&o.stderr));
    text(&o.stdout)
}

/// The objects of a render, as JSON, keyed (kubectl reads the YAML offline: `--local`, no
/// server, no kubeconfig).
fn objects(yaml: &str, file: &Path) -> BTreeMap<Key, Value> {
    std::fs::write(file, yaml).unwrap();
    let o = Command::new(kube_bin().join("kubectl"))
        .args([
            "annotate",
            "--local",
            "--kubeconfig=/dev/null",
            "-o",
            "json",
        ])
        .arg("-f")
        .arg(file)
        .arg("stepguard.io/none-")
        .output()
        .expect("run kubectl");
    assert!(
        o.status.success(),
        "kubectl read {}: {}",
        file.display(),
        text(&o.stderr)
    );
    serde_json::Deserializer::from_slice(&o.stdout)
        .into_iter::<Value>()
        .map(|v| {
            let v = v.expect("kubectl's JSON");
            let s = |p: &str| {
                v.pointer(p)
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string()
            };
            (
                (s("/kind"), s("/metadata/namespace"), s("/metadata/name")),
                v,
            )
        })
        .collect()
}

fn kustomize(dir: &str, file: &Path) -> BTreeMap<Key, Value> {
    let root = common::cluster::repo_root();
    let o = Command::new(kube_bin().join("kubectl"))
        .arg("kustomize")
        .arg(root.join(dir))
        .output()
        .expect("run kubectl kustomize");
    assert!(
        o.status.success(),
        "kubectl kustomize {dir}: {}",
        text(&o.stderr)
    );
    objects(&text(&o.stdout), file)
}

/// Takes out what Helm or kustomize add by design (the module's comment), renaming kustomize's
/// hashed ConfigMap names (`renames`) back to the plain one wherever they appear.
fn normalise(o: &Value, renames: &[(String, String)]) -> Value {
    let mut s = o.to_string();
    for (from, to) in renames {
        s = s.replace(&format!("\"{from}\""), &format!("\"{to}\""));
    }
    let mut o: Value = serde_json::from_str(&s).unwrap();
    let drop_empty = |m: &mut Value, key: &str| {
        if m.get(key)
            .is_some_and(|v| v.as_object().is_some_and(|a| a.is_empty()))
        {
            m.as_object_mut().unwrap().remove(key);
        }
    };
    if let Some(labels) = o
        .pointer_mut("/metadata/labels")
        .and_then(Value::as_object_mut)
    {
        for l in HELM_LABELS {
            labels.remove(l);
        }
    }
    if let Some(a) = o
        .pointer_mut("/spec/template/metadata/annotations")
        .and_then(Value::as_object_mut)
    {
        a.remove("checksum/config");
    }
    for meta in ["/metadata", "/spec/template/metadata"] {
        if let Some(m) = o.pointer_mut(meta) {
            drop_empty(m, "annotations");
            drop_empty(m, "labels");
        }
    }
    o
}

/// Every JSON path where `a` and `b` differ.
fn differences(a: &Value, b: &Value, path: &str, out: &mut Vec<String>) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            for k in x.keys().chain(y.keys().filter(|k| !x.contains_key(*k))) {
                let p = format!("{path}/{k}");
                match (x.get(k), y.get(k)) {
                    (Some(u), Some(v)) => differences(u, v, &p, out),
                    (u, v) => out.push(format!("{p}: {u:?} ≠ {v:?}")),
                }
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            for (i, (u, v)) in x.iter().zip(y).enumerate() {
                differences(u, v, &format!("{path}/{i}"), out);
            }
        }
        _ if a != b => out.push(format!("{path}: {a} ≠ {b}")),
        _ => {}
    }
}

fn key(kind: &str, ns: &str, name: &str) -> Key {
    (kind.into(), ns.into(), name.into())
}

fn container<'a>(objs: &'a BTreeMap<Key, Value>, kind: &str, name: &str) -> &'a Value {
    let o = &objs[&key(kind, "stepguard", name)];
    &o["spec"]["template"]["spec"]["containers"][0]
}

fn args(c: &Value) -> Vec<String> {
    c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect()
}

/// `kubectl kustomize` of `dirs`, normalised, with kustomize's hashed ConfigMap name renamed to
/// the plain one (the chart's) wherever it appears.
fn kustomized(dirs: &[&str], scratch: &Path) -> BTreeMap<Key, Value> {
    let mut all = BTreeMap::new();
    for d in dirs {
        all.extend(kustomize(
            d,
            &scratch.join(format!("{}.yaml", d.replace('/', "-"))),
        ));
    }
    let hashed = |k: &Key| k.0 == "ConfigMap" && k.2.starts_with("stepguard-config-");
    let renames: Vec<(String, String)> = all
        .keys()
        .filter(|k| hashed(k))
        .map(|k| (k.2.clone(), "stepguard-config".to_string()))
        .collect();
    assert_eq!(
        renames.len(),
        1,
        "{dirs:?} generate one agent config: {renames:?}"
    );
    all.into_iter()
        .map(|(k, v)| {
            let name = if hashed(&k) {
                "stepguard-config".into()
            } else {
                k.2
            };
            ((k.0, k.1, name), normalise(&v, &renames))
        })
        .collect()
}

/// The chart's objects are kustomize's (kind, namespace, name), each equal whole once
/// normalised; every difference is listed by its JSON path.
fn same_objects(chart: &BTreeMap<Key, Value>, kustomized: &BTreeMap<Key, Value>, what: &str) {
    let keys = |m: &BTreeMap<Key, Value>| m.keys().cloned().collect::<Vec<_>>();
    assert_eq!(
        keys(chart),
        keys(kustomized),
        "{what} renders kustomize's objects (kind, namespace, name)"
    );
    let mut unequal = Vec::new();
    for (k, want) in kustomized {
        let got = normalise(&chart[k], &[]);
        let mut d = Vec::new();
        differences(&got, want, "", &mut d);
        if !d.is_empty() {
            unequal.push(format!("{k:?} (chart ≠ kustomize):\n  {}", d.join("\n  ")));
        }
    }
    assert!(unequal.is_empty(), "{what}:\n{}", unequal.join("\n"));
}

/// A directory of the test's own, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let d = std::env::temp_dir().join(format!("sg-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        Scratch(d)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn helm_lints_the_chart_strictly_and_its_schema_refuses_a_wrong_type_or_an_unknown_key() {
    let chart = chart();
    let c = chart.to_str().unwrap();
    for values in [
        vec![],
        vec!["--set", "rollout.enabled=true"],
        vec![
            "--set",
            "namespace.create=false,serviceMonitor.enabled=false,prometheusRule.enabled=false",
        ],
        vec!["--set", "namespace.create=false,ciliumConfig.mount=true"],
    ] {
        let mut a = vec!["lint", "--strict", c];
        a.extend_from_slice(&values);
        let o = helm(&a);
        let out = text(&o.stdout);
        assert!(
            o.status.success() && out.contains("1 chart(s) linted, 0 chart(s) failed"),
            "helm {a:?}:\n{out}{}",
            text(&o.stderr)
        );
        assert!(!out.contains("[WARNING]"), "{out}");
    }
    // The appVersion, and so the image's default tag, is the workspace's version.
    let shown = text(&helm(&["show", "chart", c]).stdout);
    assert!(
        shown
            .lines()
            .any(|l| l == format!("appVersion: {}", env!("CARGO_PKG_VERSION"))),
        "Chart.yaml's appVersion is the workspace's {}:\n{shown}",
        env!("CARGO_PKG_VERSION")
    );

    // Values the schema refuses, each with Helm's own account of why: a number where the
    // schema wants a string, a string where it wants a boolean, a mistyped top-level key and a
    // mistyped key below one.
    let schema = "values don't meet the specifications of the schema";
    for (set, why) in [
        ("image.tag=5", "at '/image/tag': got number, want string"),
        (
            "serviceMonitor.enabled=yes",
            "at '/serviceMonitor/enabled': got string, want boolean",
        ),
        (
            "imageTag=0.1.0",
            "additional properties 'imageTag' not allowed",
        ),
        (
            "rollout.enable=true",
            "at '/rollout': additional properties 'enable' not allowed",
        ),
    ] {
        let o = helm(&["template", "stepguard", c, "--set", set]);
        let err = text(&o.stderr);
        assert!(
            !o.status.success() && err.contains(schema) && err.contains(why),
            "helm template --set {set}: refused with {why:?}; got {:?}:\n{err}",
            o.status
        );
        let o = helm(&["lint", "--strict", c, "--set", set]);
        assert!(
            !o.status.success() && (text(&o.stdout) + &text(&o.stderr)).contains(why),
            "helm lint --strict --set {set}: refused with {why:?}:\n{}",
            text(&o.stdout)
        );
    }
}

#[test]
fn the_chart_renders_the_kustomize_bases_objects() {
    let scratch = Scratch::new("helm-render");
    let dir = &scratch.0;
    let chart = objects(
        &template("stepguard", &["--set", "rollout.enabled=true"]),
        &dir.join("chart.yaml"),
    );
    let kust = kustomized(&["deploy/base", "deploy/rollout"], dir);
    let kinds = |m: &BTreeMap<Key, Value>| m.keys().cloned().collect::<Vec<_>>();

    // The stepper's image is the agent's: the chart's default is the base's image and tag.
    let agent = container(&chart, "DaemonSet", "stepguard")["image"].clone();
    assert_eq!(agent, container(&kust, "DaemonSet", "stepguard")["image"]);
    assert_eq!(
        agent,
        format!("stepguard:{}", env!("CARGO_PKG_VERSION")).as_str()
    );
    for (name, objects) in [("the chart", &chart), ("deploy/rollout", &kust)] {
        assert_eq!(
            container(objects, "Deployment", "stepguard-rollout")["image"],
            agent,
            "{name}: the stepper runs the agents' image"
        );
    }

    same_objects(&chart, &kust, "the chart with rollout.enabled");

    // What that covered, spelled out: the config's text is the base's file, byte for byte.
    let config =
        std::fs::read_to_string(common::cluster::repo_root().join("deploy/base/config.yaml"))
            .unwrap();
    assert_eq!(
        chart[&key("ConfigMap", "stepguard", "stepguard-config")]["data"]["config.yaml"],
        config.as_str()
    );

    // By default the chart is the base alone, the stepper off; the switches take out what
    // they name.
    let defaults = objects(&template("stepguard", &[]), &dir.join("defaults.yaml"));
    same_objects(
        &defaults,
        &kustomized(&["deploy/base"], dir),
        "the chart's defaults",
    );
    let off = objects(
        &template(
            "stepguard",
            &[
                "--set",
                "namespace.create=false,serviceMonitor.enabled=false,prometheusRule.enabled=false",
                "--set",
                "rollout.enabled=true,rollout.deployment=false",
            ],
        ),
        &dir.join("off.yaml"),
    );
    let want: Vec<Key> = kust
        .keys()
        .filter(|k| {
            let off = ["Namespace", "ServiceMonitor", "PrometheusRule"].contains(&k.0.as_str())
                || (k.0 == "Deployment" && k.2 == "stepguard-rollout");
            !off
        })
        .cloned()
        .collect();
    assert_eq!(
        kinds(&off),
        want,
        "switched off: the namespace, monitoring, the Deployment"
    );

    // A config of the user's: its text in the ConfigMap, and a new checksum that rolls the
    // agents.
    let mine = "bpffs: /sys/fs/bpf\ncilium: \"1.20\"\nwitnesses: [\"http://192.0.2.7:9970\"]\n";
    let values = dir.join("values.yaml");
    std::fs::write(
        &values,
        format!("config: {}\n", serde_json::to_string(mine).unwrap()),
    )
    .unwrap();
    let changed = objects(
        &template("stepguard", &["-f", values.to_str().unwrap()]),
        &dir.join("changed.yaml"),
    );
    assert_eq!(
        changed[&key("ConfigMap", "stepguard", "stepguard-config")]["data"]["config.yaml"],
        mine
    );
    let sum = |o: &BTreeMap<Key, Value>| {
        o[&key("DaemonSet", "stepguard", "stepguard")]
            .pointer("/spec/template/metadata/annotations/checksum~1config")
            .and_then(Value::as_str)
            .expect("the agents' pod template carries checksum/config")
            .to_string()
    };
    assert_ne!(
        sum(&defaults),
        sum(&changed),
        "a changed config rolls the agents"
    );

    // In another namespace the stepper is told where the agents and its lock are; Cilium's
    // Role stays in Cilium's namespace.
    let other = objects(
        &template("sg-other", &["--set", "rollout.enabled=true"]),
        &dir.join("other.yaml"),
    );
    let stepper = &other[&key("Deployment", "sg-other", "stepguard-rollout")];
    let a = args(&stepper["spec"]["template"]["spec"]["containers"][0]);
    for want in ["--agents-namespace=sg-other", "--lock-namespace=sg-other"] {
        assert!(a.iter().any(|x| x == want), "{want} in {a:?}");
    }
    let binding = &other[&key("RoleBinding", "kube-system", "stepguard-rollout")];
    assert_eq!(binding["subjects"][0]["namespace"], "sg-other");
    let defaults_args = args(container(&chart, "Deployment", "stepguard-rollout"));
    assert!(
        !defaults_args
            .iter()
            .any(|x| x.starts_with("--agents-namespace")),
        "in stepguard the stepper's defaults hold: {defaults_args:?}"
    );

    // deploy/examples/cilium-config by values: in kube-system, no Namespace of its own, Cilium's
    // ConfigMap and runtime directory mounted, the example's config.
    let root = common::cluster::repo_root();
    let example_config = root.join("deploy/examples/cilium-config/config.yaml");
    let file = format!("config={}", example_config.display());
    let chart = objects(
        &template(
            "kube-system",
            &[
                "--set",
                "namespace.create=false,ciliumConfig.mount=true",
                "--set-file",
                &file,
            ],
        ),
        &dir.join("cilium-config.yaml"),
    );
    same_objects(
        &chart,
        &kustomized(&["deploy/examples/cilium-config"], dir),
        "the chart with ciliumConfig.mount in kube-system",
    );
}

/// `helm install` (`helm upgrade` with `verb`) of the chart as admin; Helm's output.
fn helm_install(cp: &ControlPlane, verb: &str, namespace: &str, args: &[&str]) -> String {
    let chart = chart();
    let kubeconfig = cp.admin_kubeconfig();
    let mut a = vec![
        verb,
        "stepguard",
        chart.to_str().unwrap(),
        "--namespace",
        namespace,
        "--kubeconfig",
        kubeconfig.to_str().unwrap(),
    ];
    a.extend_from_slice(args);
    let o = helm(&a);
    let out = text(&o.stdout);
    assert!(
        o.status.success() && out.contains("STATUS: deployed"),
        "helm {a:?}:\n{out}{}",
        text(&o.stderr)
    );
    out
}

fn enforce(k: &Kube, ns: &str) -> Option<String> {
    let ns = k.block(k.all::<Namespace>().get(ns)).unwrap();
    ns.metadata
        .labels
        .unwrap_or_default()
        .get("pod-security.kubernetes.io/enforce")
        .cloned()
}

fn pods_in(k: &Kube, ns: &str, selector: &str) -> usize {
    pods_anywhere(k, selector)
        .iter()
        .filter(|p| p.metadata.namespace.as_deref() == Some(ns))
        .count()
}

#[test]
fn the_chart_installs_on_a_real_control_plane_and_admission_admits_its_pods() {
    require_root();
    let (g, k) = plane_for_manifests(&kube_bin(), "helm-chart");
    let cp = &g.0;
    let events =
        |ns: &'static str| move || cp.kubectl(&["-n", ns, "get", "events"]).unwrap_or_default();

    // `helm template` applied server-side, with the stepper: as a GitOps tool applies it.
    let rendered = g.1.join("chart.yaml");
    std::fs::write(
        &rendered,
        template("stepguard", &["--set", "rollout.enabled=true"]),
    )
    .unwrap();
    let out = apply_server_side(cp, "stepguard-test", &["-f", rendered.to_str().unwrap()]);
    assert!(out.contains("serverside-applied"), "{out}");
    eprintln!("helm template | kubectl apply --server-side:\n{out}");
    assert_eq!(enforce(&k, "stepguard").as_deref(), Some("privileged"));
    for sel in [
        "app.kubernetes.io/name=stepguard",
        "app.kubernetes.io/name=stepguard-rollout",
    ] {
        wait_for(
            &format!("a pod {sel} admitted in stepguard"),
            || pods_in(&k, "stepguard", sel) > 0,
            events("stepguard"),
        );
    }
    let ev = events("stepguard")();
    assert!(!ev.contains("FailedCreate"), "{ev}");

    // The stepper, as the chart's ServiceAccount, reads Cilium's objects (rendered by Cilium's
    // own chart) through the chart's RBAC: its plan and view, then its status. Nothing
    // proves a node here (no agent runs), so the plan refuses; what matters is that the API
    // server refused none of its requests.
    common::cluster::install_cilium(cp, &g.1, &[], &[], false);
    let kubeconfig = cp.stepper_kubeconfig(&cp.server).unwrap();
    let stepper = |extra: &[&str]| {
        let o = Command::new(bin("STEPGUARD_BIN", "stepguard"))
            .args(["rollout", "--daemonset", "kube-system/cilium"])
            .args(extra)
            .env("KUBECONFIG", &kubeconfig)
            .output()
            .expect("run stepguard rollout");
        (o.status.code(), text(&o.stdout), text(&o.stderr))
    };
    let (code, out, err) = stepper(&["--dry-run", "--output", "json"]);
    let plan: Value = serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("--dry-run --output json ({code:?}): {e}\n{out}\n{err}"));
    assert_eq!(plan["view"]["update_strategy"], "OnDelete", "{plan}");
    let (code, out, err) = stepper(&["--status"]);
    assert_eq!(code, Some(0), "--status: {out}\n{err}");
    let reqs = cp.stepper_requests().expect("the audit log");
    let seen: Vec<String> = reqs
        .iter()
        .map(|r| {
            format!(
                "{} {} → {}",
                r["verb"].as_str().unwrap_or(""),
                r["requestURI"].as_str().unwrap_or(""),
                r["responseStatus"]["code"]
            )
        })
        .collect();
    eprintln!("the stepper's requests:\n  {}", seen.join("\n  "));
    assert!(
        seen.len() >= 5,
        "the stepper's requests are audited: {seen:#?}"
    );
    let denied: Vec<&String> = seen.iter().filter(|s| s.ends_with("→ 403")).collect();
    assert!(
        denied.is_empty(),
        "the chart's RBAC refused the stepper: {denied:#?}"
    );

    // A real `helm install` into a namespace Helm creates and the chart labels, as the chart's
    // README installs it (the stepper stays with the first install: its ClusterRole is one per
    // cluster).
    let out = helm_install(cp, "install", "sg-helm", &["--create-namespace"]);
    eprintln!("helm install:\n{out}");
    assert_eq!(enforce(&k, "sg-helm").as_deref(), Some("privileged"));
    wait_for(
        "the agent's pod admitted in sg-helm",
        || pods_in(&k, "sg-helm", "app.kubernetes.io/name=stepguard") > 0,
        events("sg-helm"),
    );
    let ev = events("sg-helm")();
    assert!(!ev.contains("FailedCreate"), "{ev}");
    // A changed config, through `helm upgrade`, changes the agents' pod template.
    let ds = || {
        k.block(k.ns::<DaemonSet>("sg-helm").get("stepguard"))
            .unwrap()
    };
    let generation = ds().metadata.generation;
    helm_install(
        cp,
        "upgrade",
        "sg-helm",
        &["--reuse-values", "--set-string", "config=cilium: \"1.20\""],
    );
    assert!(
        ds().metadata.generation > generation,
        "helm upgrade with a new config changes the DaemonSet's template"
    );

    // Admission is on, and the chart's label is what admits the agents: with `restricted` in
    // its place, the same chart's agent pod is refused.
    helm_install(
        cp,
        "install",
        "sg-restricted",
        &[
            "--create-namespace",
            "--set",
            "namespace.labels.pod-security\\.kubernetes\\.io/enforce=restricted",
        ],
    );
    assert_eq!(enforce(&k, "sg-restricted").as_deref(), Some("restricted"));
    wait_for(
        "the agent's pod refused in sg-restricted",
        || events("sg-restricted")().contains("violates PodSecurity"),
        events("sg-restricted"),
    );
    assert_eq!(
        pods_in(&k, "sg-restricted", "app.kubernetes.io/name=stepguard"),
        0
    );
}
