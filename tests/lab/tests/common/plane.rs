//! A control plane of a test's own to install the shipped manifests on (the kustomize base and
//! the Helm chart): the prometheus-operator CRDs from `third_party/` and one Node for the
//! controllers to place pods on (nobody runs them: admission is the point), and bounded waits
//! for what the controllers make.
use super::PlaneGuard;
use k8s_openapi::api::core::v1::Pod;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use stepguard_lab::kube::{ControlPlane, Kube};

/// `STEPGUARD_KUBE_BIN`: the control plane's binaries and kubectl.
pub fn kube_bin() -> PathBuf {
    PathBuf::from(std::env::var("STEPGUARD_KUBE_BIN").expect(
        "STEPGUARD_KUBE_BIN: the control plane's binaries (`cargo xtask kube`; `cargo xtask test` sets it)",
    ))
}

/// A fresh control plane under the temporary directory (`sg-{name}-PID`) with the CRDs from
/// `third_party/` established and the Node `node-a`.
pub fn plane_for_manifests(bin: &Path, name: &str) -> (PlaneGuard, Kube) {
    let dir = std::env::temp_dir().join(format!("sg-{name}-{}", std::process::id()));
    let g = PlaneGuard(ControlPlane::up(&dir, bin).expect("control plane up"), dir);
    let k = Kube::connect(&g.0.admin_kubeconfig()).unwrap();
    let crds = super::cluster::repo_root().join("third_party/prometheus-operator-v0.93.0");
    for f in std::fs::read_dir(&crds).unwrap() {
        let f = f.unwrap().path();
        if f.extension().is_some_and(|e| e == "yaml") {
            super::apply_server_side(&g.0, "stepguard-test", &["-f", f.to_str().unwrap()]);
        }
    }
    g.0.wait_crds_established(&["crd", "--all"], Duration::from_secs(30))
        .expect("CRDs established");
    stepguard_lab::kube::create_nodes(&k, &[("node-a".into(), "192.0.2.10".into())]).unwrap();
    (g, k)
}

/// Waits up to 60 s for `ok`, polling; panics with `context()` past that.
pub fn wait_for(what: &str, ok: impl Fn() -> bool, context: impl Fn() -> String) {
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

/// Pods with this selector in any namespace.
pub fn pods_anywhere(k: &Kube, selector: &str) -> Vec<Pod> {
    let lp = kube::api::ListParams::default().labels(selector);
    k.block(kube::Api::<Pod>::all(k.client.clone()).list(&lp))
        .unwrap()
        .items
}
