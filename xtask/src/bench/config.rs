//! The config check on a big node, and the devices check with every endpoint's programs.
use super::*;

/// The config check's read of the agent's loaded settings (`GET /v1/debuginfo`, which lists
/// every endpoint) on a big node, each a fresh process (a cold read, as after every agent
/// start), beside the raw read of the same answer with curl (the physical limit).
pub(super) fn config_read(quick: bool) -> Result<Value> {
    let prefix = "sgbenchc".to_string();
    let pods = if quick { 100u32 } else { 1000 };
    let _ = Command::new(lab_bin())
        .args(["down", "--prefix", &prefix])
        .output();
    println!("bench: config read on a {pods}-endpoint lab");
    run_ok(Command::new(lab_bin()).args(["up", "--prefix", &prefix, "--pods", &pods.to_string()]))?;
    let _guard = scopeguard(prefix.clone());
    let run_dir = std::path::Path::new("/run/stepguard-lab").join(&prefix);
    let cfg = run_dir.join("stepguard.yaml");
    let sock = run_dir.join("cilium-run/cilium.sock");
    let ns = format!("{prefix}-node");
    let (mut checks, mut raw) = (Vec::new(), Vec::new());
    let (mut devices, mut bpftool) = (Vec::new(), Vec::new());
    let mut bytes = 0u64;
    for _ in 0..5 {
        let out = run_ok(
            nsenter(&ns)
                .arg(stepguard_bin())
                .args(["check", "--only", "config", "--format", "json", "--config"])
                .arg(&cfg),
        )?;
        let v: Value = serde_json::from_slice(&out.stdout).context("parse check output")?;
        if v["checks"][0]["status"] != "pass" {
            bail!("the config check did not pass on the bench lab: {v}");
        }
        checks.push(v["checks"][0]["duration_ms"].as_f64().unwrap_or(f64::NAN));
        let out = run_ok(Command::new("curl").args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{time_total} %{size_download}",
            "--unix-socket",
            &sock.to_string_lossy(),
            "http://localhost/v1/debuginfo",
        ]))?;
        let t = String::from_utf8_lossy(&out.stdout).into_owned();
        let mut it = t.split_whitespace();
        raw.push(
            it.next()
                .and_then(|x| x.parse::<f64>().ok())
                .unwrap_or(f64::NAN)
                * 1e3,
        );
        bytes = it.next().and_then(|x| x.parse().ok()).unwrap_or(0);
        // The devices check observes every endpoint's programs too: beside
        // bpftool's listing of every device's tc/tcx/XDP programs in the same namespace.
        let out = run_ok(
            nsenter(&ns)
                .arg(stepguard_bin())
                .args(["check", "--only", "devices", "--format", "json", "--config"])
                .arg(&cfg),
        )?;
        let v: Value = serde_json::from_slice(&out.stdout).context("parse check output")?;
        if v["checks"][0]["evidence"]["endpoint_devices"].as_u64() != Some(pods as u64) {
            bail!("the devices check did not see the bench lab's {pods} endpoints: {v}");
        }
        devices.push(v["checks"][0]["duration_ms"].as_f64().unwrap_or(f64::NAN));
        let t = std::time::Instant::now();
        run_ok(nsenter(&ns).args(["bpftool", "-j", "net", "show"]))?;
        bpftool.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let (c, r) = (med(&mut checks), med(&mut raw));
    let (dv, bt) = (med(&mut devices), med(&mut bpftool));
    println!(
        "  devices check with {pods} endpoints' programs {dv:.1} ms vs bpftool net show {bt:.1} ms"
    );
    println!(
        "  config check {c:.1} ms (median of 5 cold reads) vs curl {r:.1} ms, debuginfo {:.1} MiB",
        bytes as f64 / 1048576.0
    );
    Ok(
        json!({"endpoints": pods, "check_ms": c, "curl_ms": r, "debuginfo_bytes": bytes, "timeout_ms": 2000, "devices_ms": dv, "bpftool_net_ms": bt}),
    )
}

pub(super) fn report_config(v: &Value) -> String {
    format!(
        "\n## config check on a big node\n\n`stepguard check --only config` (a fresh process each time: a cold read of `GET /v1/debuginfo`, as after every cilium-agent start; the daemon reads it once per agent start) on a lab with {} endpoints, whose stand-in debuginfo lists every endpoint as Cilium's does ({:.1} MiB). Reference in the same run: `curl --unix-socket` of the same answer.\n\n| measure | stepguard | reference | goal |\n|---|---|---|---|\n| config check, median of 5 | {:.1} ms | curl {:.1} ms | within its 2 s timeout |\n| devices check with every endpoint's programs (a fresh process: every program looked up), median of 5 | {:.1} ms | `bpftool net show` {:.1} ms | at most the reference |\n",
        v["endpoints"],
        v["debuginfo_bytes"].as_f64().unwrap_or(0.0) / 1048576.0,
        v["check_ms"].as_f64().unwrap_or(f64::NAN),
        v["curl_ms"].as_f64().unwrap_or(f64::NAN),
        v["devices_ms"].as_f64().unwrap_or(f64::NAN),
        v["bpftool_net_ms"].as_f64().unwrap_or(f64::NAN),
    )
}
