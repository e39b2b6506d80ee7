//! `down` removes exactly what a lab created (also after a panic or a crashed creator);
//! bad `up`s stop with one line and create nothing; config changes look like kubelet's.
mod common;
use common::*;
use std::path::Path;
use std::process::Command;
use stepguard_lab::{Lab, LabSpec};

fn lab_bin() -> std::path::PathBuf {
    bin("STEPGUARD_LAB_BIN", "stepguard-lab")
}

/// Asserts that nothing of the lab `prefix` is left on the machine.
fn assert_gone(prefix: &str, pids: &[i32]) {
    let netns = sh("ip", &["netns", "list"]);
    assert!(
        !netns.lines().any(|l| l.starts_with(&format!("{prefix}-"))),
        "namespaces left:\n{netns}"
    );
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains(&format!("/stepguard-lab/{prefix}/")),
        "mount left"
    );
    assert!(
        !Path::new(stepguard_lab::RUN_ROOT).join(prefix).exists(),
        "run dir left"
    );
    for pid in pids {
        let alive = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| !s.contains(") Z"))
            .unwrap_or(false);
        assert!(!alive, "process {pid} left running");
    }
    // No interface named after the lab in the root namespace either.
    let links = sh("ip", &["-o", "link", "show"]);
    assert!(
        !links.contains(prefix),
        "root-namespace interface left:\n{links}"
    );
}

#[test]
fn down_leaves_no_namespace_interface_mount_or_process() {
    let mut lab = lab(|s| s.pods = 4);
    let prefix = lab.state.spec.prefix.clone();
    let pids: Vec<i32> = lab.state.procs.iter().map(|p| p.pid).collect();
    assert_eq!(pids.len(), 3, "dnsmasq, nginx and the agent API stand-in");
    let prog_ids: Vec<u32> = lab.state.attachments.iter().map(|a| a.prog_id).collect();
    lab.down().unwrap();
    assert_gone(&prefix, &pids);
    // Programs go with their links and filters. The kernel frees them asynchronously (after
    // an RCU grace period), so wait for it, bounded.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let progs = bpftool_json(&["prog", "show"]);
        let left: Vec<u64> = progs
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|p| p["id"].as_u64())
            .filter(|id| prog_ids.contains(&(*id as u32)))
            .collect();
        if left.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "programs left loaded 30 s after down: {left:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    lab.down().expect("down twice is harmless");
}

#[test]
fn a_test_that_panics_leaves_nothing_behind() {
    require_root();
    let prefix = stepguard_lab::unique_prefix();
    let p2 = prefix.clone();
    let pids = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let pids2 = pids.clone();
    let r = std::thread::spawn(move || {
        let lab = stepguard_lab::sys::fixture::Guard(Lab::up(LabSpec::new(p2)).unwrap());
        pids2
            .lock()
            .unwrap()
            .extend(lab.state.procs.iter().map(|p| p.pid));
        panic!("a test failing in the middle");
    })
    .join();
    assert!(r.is_err());
    assert_gone(&prefix, &pids.lock().unwrap());
}

#[test]
fn down_cleans_up_after_the_creating_process_was_killed_mid_way() {
    require_root();
    // Killed at different points of `up`: whatever it had created is recorded and removed.
    for delay_ms in [150u64, 400, 900] {
        let prefix = stepguard_lab::unique_prefix();
        let mut child = Command::new(lab_bin())
            .args(["up", "--prefix", &prefix, "--pods", "20"])
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        let _ = child.kill(); // SIGKILL: no destructor, no cleanup of its own
        let _ = child.wait();
        let pids: Vec<i32> = Lab::open(&prefix)
            .map(|l| l.state.procs.iter().map(|p| p.pid).collect())
            .unwrap_or_default();
        if Path::new(stepguard_lab::RUN_ROOT).join(&prefix).exists() {
            let out = Command::new(lab_bin())
                .args(["down", "--prefix", &prefix])
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "down after a kill at {delay_ms} ms: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        assert_gone(&prefix, &pids);
    }
}

#[test]
fn up_without_root_stops_with_one_line_and_creates_nothing() {
    require_root();
    let prefix = stepguard_lab::unique_prefix();
    let out = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
        ])
        .arg(lab_bin())
        .args(["up", "--prefix", &prefix])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(err.contains("needs root"), "{err}");
    assert_gone(&prefix, &[]);
}

#[test]
fn up_with_a_prefix_in_use_stops_with_one_line_and_touches_nothing() {
    let lab = lab(|_| {});
    let prefix = lab.state.spec.prefix.clone();
    let out = Command::new(lab_bin())
        .args(["up", "--prefix", &prefix])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(err.contains("already in use"), "{err}");
    // The existing lab is intact.
    assert_eq!(
        http_status_from_node(&lab, "http://198.51.100.10/healthz"),
        "200"
    );
    assert!(Lab::open(&prefix).unwrap().state.ready);
}

#[test]
fn two_labs_coexist_with_their_own_prefixes() {
    let a = lab(|_| {});
    let b = lab(|_| {});
    assert_ne!(a.state.spec.prefix, b.state.spec.prefix);
    for l in [&a, &b] {
        let dig = in_node(
            l,
            "dig",
            &[
                "+time=1",
                "+tries=2",
                "+short",
                "@198.51.100.53",
                "dns.lab.stepguard.test",
            ],
        );
        assert_eq!(String::from_utf8_lossy(&dig.stdout).trim(), "198.51.100.53");
    }
}

#[test]
fn config_set_swaps_the_data_symlink_like_kubelet() {
    let lab = lab(|_| {});
    let dir = lab.state.cilium_config.clone();
    let before = std::fs::read_link(dir.join("..data")).unwrap();
    let out = Command::new(lab_bin())
        .args([
            "config",
            "--prefix",
            &lab.state.spec.prefix,
            "set",
            "devices=eth+",
            "enable-bpf-masquerade=true",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let after = std::fs::read_link(dir.join("..data")).unwrap();
    assert_ne!(
        before, after,
        "..data points at a new timestamped directory"
    );
    assert!(
        !dir.join(&before).exists(),
        "the old data directory is gone"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("devices")).unwrap(),
        "eth+"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("enable-bpf-masquerade")).unwrap(),
        "true"
    );
    assert_eq!(
        std::fs::read_link(dir.join("enable-bpf-masquerade")).unwrap(),
        Path::new("..data/enable-bpf-masquerade")
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("kube-proxy-replacement")).unwrap(),
        "true",
        "other keys kept"
    );
}

#[test]
fn status_json_has_what_a_script_needs() {
    let lab = lab(|_| {});
    let out = Command::new(lab_bin())
        .args([
            "status",
            "--prefix",
            &lab.state.spec.prefix,
            "--format",
            "json",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for key in [
        "node_netns",
        "node_netns_path",
        "bpffs",
        "cilium_config",
        "devices",
        "vips",
        "profile",
        "attach",
        "stepguard_config",
    ] {
        assert!(!v[key].is_null(), "status has {key}: {v}");
    }
    assert_eq!(v["vips"]["gateway"]["address"], "198.51.100.10");
    assert_eq!(v["vips"]["dns"]["port"], 53);
    assert!(Path::new(v["stepguard_config"].as_str().unwrap()).exists());
    assert!(Path::new(v["node_netns_path"].as_str().unwrap()).exists());
}
