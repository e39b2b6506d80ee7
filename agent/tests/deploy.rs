//! The deployment, validated offline: every overlay renders with `kubectl kustomize`; every
//! built-in object passes `kubernetes-validate --strict`; ServiceMonitor and PrometheusRule
//! pass the prometheus-operator CRD schemas; the DaemonSet has the security settings it
//! promises; the rules pass `promtool check rules` and their unit tests. (The dashboard's
//! metric names are checked against a real agent in tests/lab/tests/prometheus.rs.)
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn tool(name: &str) -> PathBuf {
    let p = root().join("target/tools/venv/bin").join(name);
    assert!(
        p.exists(),
        "{} is missing: run `cargo xtask setup` (it installs the pinned PyPI tools)",
        p.display()
    );
    p
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

fn overlays() -> Vec<PathBuf> {
    let mut v = vec![root().join("deploy/base")];
    let mut ex: Vec<PathBuf> = std::fs::read_dir(root().join("deploy/examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    ex.sort();
    v.extend(ex);
    v
}

/// Rendered objects of an overlay, as JSON values.
fn render(dir: &Path) -> Vec<Value> {
    let yaml = run(Command::new(tool("kubectl")).arg("kustomize").arg(dir));
    serde_yaml_ng::Deserializer::from_str(&yaml)
        .map(|d| {
            let v: serde_yaml_ng::Value = serde::Deserialize::deserialize(d).unwrap();
            serde_json::to_value(v).unwrap()
        })
        .filter(|v| !v.is_null())
        .collect()
}

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sg-deploy-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn every_overlay_renders_and_validates_offline() {
    // Vendored in the project (see its README: version and licence), so a bare clone validates.
    let crds = root().join("third_party/prometheus-operator-v0.93.0");
    assert!(
        crds.join("monitoring.coreos.com_servicemonitors.yaml").exists(),
        "CRD schemas not found in {}: ServiceMonitor/PrometheusRule cannot be validated — failing rather than skipping",
        crds.display()
    );
    for overlay in overlays()
        .into_iter()
        .chain([root().join("deploy/rollout")])
    {
        let objects = render(&overlay);
        assert!(
            objects.len() >= 5,
            "{}: {} objects",
            overlay.display(),
            objects.len()
        );
        let dir = tmpdir("kv");
        let mut builtin = Vec::new();
        for (i, o) in objects.iter().enumerate() {
            let kind = o["kind"].as_str().unwrap();
            let path = dir.join(format!("{i}-{kind}.json"));
            std::fs::write(&path, serde_json::to_vec(o).unwrap()).unwrap();
            match kind {
                "ServiceMonitor" | "PrometheusRule" => {
                    let crd = crds.join(format!(
                        "monitoring.coreos.com_{}s.yaml",
                        kind.to_lowercase()
                    ));
                    let script = "import json,sys,yaml,jsonschema\n\
                        crd=yaml.safe_load(open(sys.argv[1]))\n\
                        obj=json.load(open(sys.argv[2]))\n\
                        v=[x for x in crd['spec']['versions'] if x['name']==obj['apiVersion'].split('/')[1]][0]\n\
                        schema=v['schema']['openAPIV3Schema']\n\
                        jsonschema.validators.validator_for(schema)(schema).validate(obj)\n\
                        print('valid', obj['kind'])\n";
                    let out = run(Command::new(tool("python3"))
                        .args(["-c", script])
                        .arg(&crd)
                        .arg(&path));
                    assert!(out.contains("valid"), "{out}");
                }
                _ => builtin.push(path),
            }
        }
        let out = run(Command::new(tool("kubernetes-validate"))
            .arg("--strict")
            .args(&builtin));
        assert!(
            !out.contains("Couldn't find schema"),
            "{}: a built-in kind without schema:\n{out}",
            overlay.display()
        );
        assert_eq!(
            out.matches(" passed for resource ").count(),
            builtin.len(),
            "{out}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn the_daemonset_is_least_privilege() {
    for overlay in overlays() {
        let objects = render(&overlay);
        let text = serde_json::to_string(&objects).unwrap();
        assert!(
            !text.contains("\"privileged\":true"),
            "no privileged: true in {}",
            overlay.display()
        );
        assert!(
            !text.contains("hostPID"),
            "no hostPID in {}",
            overlay.display()
        );
        for o in &objects {
            let kind = o["kind"].as_str().unwrap();
            assert!(
                !matches!(
                    kind,
                    "ClusterRole" | "ClusterRoleBinding" | "Role" | "RoleBinding"
                ),
                "the agent needs no RBAC: {kind}"
            );
        }
        let ds = objects
            .iter()
            .find(|o| o["kind"] == "DaemonSet")
            .expect("a DaemonSet");
        let spec = &ds["spec"]["template"]["spec"];
        assert_eq!(spec["hostNetwork"], true);
        assert_eq!(spec["automountServiceAccountToken"], false);
        assert_eq!(
            spec["tolerations"],
            serde_json::json!([{"operator": "Exists"}]),
            "runs on every node"
        );
        assert!(spec["priorityClassName"].as_str().is_some());
        assert_eq!(
            ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"],
            1
        );
        let c = &spec["containers"][0];
        let sc = &c["securityContext"];
        assert_eq!(sc["runAsUser"], 0);
        assert_eq!(sc["allowPrivilegeEscalation"], false);
        assert_eq!(sc["readOnlyRootFilesystem"], true);
        assert_eq!(sc["capabilities"]["drop"], serde_json::json!(["ALL"]));
        let mut add: Vec<String> = sc["capabilities"]["add"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect();
        add.sort();
        assert_eq!(add, ["BPF", "NET_ADMIN", "NET_RAW", "PERFMON", "SYS_ADMIN"]);
        assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/livez");
        assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
        assert!(
            c["resources"]["requests"]["memory"].is_string()
                && c["resources"]["limits"]["memory"].is_string()
        );
        let vols = spec["volumes"].as_array().unwrap();
        assert!(
            vols.iter().any(|v| v["hostPath"]["path"] == "/sys/fs/bpf"),
            "hostPath bpffs"
        );
        assert!(
            vols.iter()
                .any(|v| v["hostPath"]["path"] == "/var/lib/stepguard"),
            "hostPath state directory"
        );
        // Secure by default: mutating routes need the token from a required Secret.
        let args: Vec<&str> = c["args"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|a| a.as_str())
            .collect();
        let token_arg = args
            .iter()
            .find_map(|a| a.strip_prefix("--token-file="))
            .unwrap_or_else(|| panic!("--token-file in {args:?} ({})", overlay.display()));
        let token_vol = vols
            .iter()
            .find(|v| v["secret"]["secretName"].is_string())
            .expect("a Secret volume for the token");
        assert_eq!(
            token_vol["secret"]["optional"], false,
            "the token Secret is required"
        );
        let token_mount = c["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == token_vol["name"])
            .expect("the token volume is mounted");
        assert!(
            token_arg.starts_with(token_mount["mountPath"].as_str().unwrap()),
            "{token_arg} lies in the token mount"
        );
        let bpffs_mount = c["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["mountPath"] == "/sys/fs/bpf")
            .unwrap();
        assert_eq!(bpffs_mount["readOnly"], true);
        let svc = objects.iter().find(|o| o["kind"] == "Service").unwrap();
        assert_eq!(svc["spec"]["clusterIP"], "None");
        assert_eq!(svc["spec"]["publishNotReadyAddresses"], true);
    }
}

#[test]
fn the_alert_rules_check_and_their_unit_tests_pass() {
    let objects = render(&root().join("deploy/base"));
    let rule = objects
        .iter()
        .find(|o| o["kind"] == "PrometheusRule")
        .unwrap();
    let dir = tmpdir("rules");
    let groups = serde_json::json!({"groups": rule["spec"]["groups"]});
    std::fs::write(
        dir.join("rules.yaml"),
        serde_yaml_ng::to_string(&groups).unwrap(),
    )
    .unwrap();
    std::fs::copy(
        root().join("deploy/prometheus/rules.test.yaml"),
        dir.join("rules.test.yaml"),
    )
    .unwrap();
    let out = run(Command::new("promtool")
        .args(["check", "rules"])
        .arg(dir.join("rules.yaml")));
    assert!(out.contains("SUCCESS"), "{out}");
    let out = run(Command::new("promtool")
        .args(["test", "rules", "rules.test.yaml"])
        .current_dir(&dir));
    assert!(out.contains("SUCCESS"), "{out}");
    // Every alert has a test, and a summary and a description.
    let tests = std::fs::read_to_string(dir.join("rules.test.yaml")).unwrap();
    for g in rule["spec"]["groups"].as_array().unwrap() {
        for r in g["rules"].as_array().unwrap() {
            let name = r["alert"].as_str().unwrap();
            assert!(
                tests.contains(&format!("alertname: {name}")),
                "{name} has a unit test"
            );
            assert!(
                r["annotations"]["summary"].is_string()
                    && r["annotations"]["description"].is_string(),
                "{name}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The stepper's RBAC is exactly what it uses: nodes listed cluster-wide; in kube-system the
/// cilium DaemonSet read, revisions and pods listed, cilium pods deleted, Leases only read,
/// Events created; in stepguard's namespace its lock Lease written. Never write access to
/// kube-system Leases (the control plane's leader elections live there).
#[test]
fn the_rollout_rbac_is_least_privilege() {
    let objects = render(&root().join("deploy/rollout"));
    let rules = |kind: &str, ns: Option<&str>| -> Vec<(String, Vec<String>)> {
        let o = objects
            .iter()
            .find(|o| o["kind"] == kind && ns.is_none_or(|n| o["metadata"]["namespace"] == n))
            .unwrap_or_else(|| panic!("{kind} in {ns:?}"));
        o["rules"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|r| {
                let verbs: Vec<String> = r["verbs"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_str().unwrap().to_string())
                    .collect();
                r["resources"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(move |res| (res.as_str().unwrap().to_string(), verbs.clone()))
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let v = |x: &[&str]| x.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        rules("ClusterRole", None),
        [
            ("nodes".to_string(), v(&["list", "watch"])),
            ("services".to_string(), v(&["list", "watch"])),
            ("endpointslices".to_string(), v(&["list"]))
        ]
    );
    let ks = rules("Role", Some("kube-system"));
    assert!(
        ks.contains(&("pods".into(), v(&["get", "list", "watch", "delete"]))),
        "{ks:?}"
    );
    assert!(
        ks.contains(&("leases".into(), v(&["list", "watch"]))),
        "kube-system Leases read only: {ks:?}"
    );
    assert!(ks.contains(&("events".into(), v(&["create"]))), "{ks:?}");
    assert!(!ks.iter().any(|(r, _)| r == "secrets"), "{ks:?}");
    let sg = rules("Role", Some("stepguard"));
    assert!(
        sg.contains(&("leases".into(), v(&["get", "create", "update", "delete"]))),
        "{sg:?}"
    );
    let text = serde_json::to_string(&objects).unwrap();
    assert!(!text.contains("\"*\""), "no wildcards");
    let d = objects
        .iter()
        .find(|o| o["kind"] == "Deployment")
        .expect("the --watch Deployment");
    assert_eq!(d["spec"]["replicas"], 1);
    assert!(
        serde_json::to_string(&d["spec"]["template"]["spec"]["containers"][0]["args"])
            .unwrap()
            .contains("--watch")
    );
}
