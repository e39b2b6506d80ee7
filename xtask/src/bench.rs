//! `cargo xtask bench`: speed and memory measured, never asserted; written to
//! `target/bench/report.md` (and `.json`). Each measurement runs side by side with a reference
//! doing the same work in the same run, on the same lab.
use crate::root;
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant};

fn lab_bin() -> std::path::PathBuf {
    root().join("target/release/stepguard-lab")
}
fn stepguard_bin() -> std::path::PathBuf {
    root().join("target/release/stepguard")
}

fn run_ok(cmd: &mut Command) -> Result<std::process::Output> {
    let shown = format!("{cmd:?}");
    let out = cmd.output().with_context(|| format!("run {shown}"))?;
    if !out.status.success() {
        bail!("{shown}: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(out)
}

fn nsenter(ns: &str) -> Command {
    let mut c = Command::new("nsenter");
    c.arg(format!("--net=/run/netns/{ns}")).arg("--");
    c
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e5).round() / 100.0
}

/// The reference: what an operator would run to get the same facts with bpftool — legacy tc
/// attachments via `bpftool net show`, the map list via `bpftool map show`, entry counts by
/// dumping every global map.
fn bpftool_same_work(ns: &str, globals: &std::path::Path) -> Result<(Duration, u64)> {
    let t = Instant::now();
    run_ok(nsenter(ns).args(["bpftool", "-j", "net", "show"]))?;
    run_ok(Command::new("bpftool").args(["-j", "map", "show"]))?;
    let mut entries = 0u64;
    let mut names: Vec<_> = std::fs::read_dir(globals)?
        .flatten()
        .map(|e| e.path())
        .collect();
    names.sort();
    for p in names {
        let name = p
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        // Per-endpoint maps are only listed, as stepguard does.
        if name.starts_with("cilium_policy_") || name.starts_with("cilium_calls_") {
            continue;
        }
        let info: Value = serde_json::from_slice(
            &run_ok(
                Command::new("bpftool")
                    .args(["-j", "map", "show", "pinned"])
                    .arg(&p),
            )?
            .stdout,
        )?;
        if matches!(
            info["type"].as_str(),
            Some("perf_event_array") | Some("prog_array") | Some("array")
        ) {
            continue;
        }
        let dump: Value = serde_json::from_slice(
            &run_ok(
                Command::new("bpftool")
                    .args(["-j", "map", "dump", "pinned"])
                    .arg(&p),
            )?
            .stdout,
        )?;
        entries += dump.as_array().map(|a| a.len() as u64).unwrap_or(0);
    }
    Ok((t.elapsed(), entries))
}

struct Size {
    pods: u32,
    ct_fill: u32,
}

fn devices_and_maps(sizes: &[Size], runs: usize) -> Result<Value> {
    let mut rows = Vec::new();
    for s in sizes {
        let prefix = format!("sgbench{}", s.pods);
        println!(
            "bench: lab with {} pods, {} conntrack entries (legacy tc mode)",
            s.pods, s.ct_fill
        );
        let _ = Command::new(lab_bin())
            .args(["down", "--prefix", &prefix])
            .output();
        let t = Instant::now();
        run_ok(Command::new(lab_bin()).args([
            "up",
            "--prefix",
            &prefix,
            "--attach",
            "tc",
            "--pods",
            &s.pods.to_string(),
            "--ct-entries",
            "524288",
            "--ct-fill",
            &s.ct_fill.to_string(),
        ]))?;
        let up = t.elapsed();
        let guard = scopeguard(prefix.clone());
        let run_dir = std::path::Path::new("/run/stepguard-lab").join(&prefix);
        let cfg = run_dir.join("stepguard.yaml");
        let globals = run_dir.join("bpffs/tc/globals");
        let pinned = std::fs::read_dir(&globals)?.count();
        let ns = format!("{prefix}-node");
        let mut ours = Vec::new();
        let mut internal = Vec::new();
        let mut our_entries = 0u64;
        for _ in 0..runs {
            let t = Instant::now();
            let out = nsenter(&ns)
                .arg(stepguard_bin())
                .args([
                    "check",
                    "--only",
                    "devices,maps",
                    "--format",
                    "json",
                    "--config",
                ])
                .arg(&cfg)
                .output()?;
            ours.push(t.elapsed());
            let v: Value = serde_json::from_slice(&out.stdout).context("parse check output")?;
            if v["exit_code"] != 0 {
                bail!("check did not pass on the bench lab: {v}");
            }
            let sum: f64 = v["checks"]
                .as_array()
                .map(|a| a.iter().filter_map(|c| c["duration_ms"].as_f64()).sum())
                .unwrap_or(0.0);
            internal.push(Duration::from_secs_f64(sum / 1e3));
            our_entries = v["checks"][1]["evidence"]["maps"]
                .as_array()
                .map(|a| a.iter().filter_map(|m| m["entries"].as_u64()).sum())
                .unwrap_or(0);
        }
        let mut refs = Vec::new();
        let mut ref_entries = 0;
        for _ in 0..runs.min(3) {
            let (d, e) = bpftool_same_work(&ns, &globals)?;
            refs.push(d);
            ref_entries = e;
        }
        let (o, i, r) = (median(ours), median(internal), median(refs));
        println!(
            "  stepguard {:.1} ms (checks {:.1} ms) vs bpftool {:.1} ms: {:.1}x faster; entries {} vs {}",
            ms(o), ms(i), ms(r), r.as_secs_f64() / o.as_secs_f64(), our_entries, ref_entries
        );
        rows.push(json!({
            "pods": s.pods, "pinned_maps": pinned, "ct_entries": s.ct_fill, "lab_up_ms": ms(up),
            "stepguard_process_ms": ms(o), "stepguard_checks_ms": ms(i), "bpftool_ms": ms(r),
            "speedup": r.as_secs_f64() / o.as_secs_f64(), "entries_counted": our_entries, "entries_bpftool": ref_entries,
        }));
        drop(guard);
    }
    Ok(Value::Array(rows))
}

struct LabDown(String);
impl Drop for LabDown {
    fn drop(&mut self) {
        let _ = Command::new(lab_bin())
            .args(["down", "--prefix", &self.0])
            .output();
    }
}
fn scopeguard(prefix: String) -> LabDown {
    LabDown(prefix)
}

fn curl(ns: &str, args: &[&str]) -> Result<String> {
    let out = run_ok(nsenter(ns).args(["curl", "-s", "-m", "120"]).args(args))?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// (utime+stime ticks, RSS KiB) of a process.
fn proc_usage(pid: u32) -> Result<(u64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after = &stat[stat.rfind(')').context("stat")? + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = f[11].parse::<u64>()? + f[12].parse::<u64>()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    Ok((ticks, rss))
}

/// CPU share of one core and peak RSS over `window`.
fn measure(pid: u32, window: Duration) -> Result<(f64, u64)> {
    let hz = 100.0; // USER_HZ on Linux
    let (t0, mut peak) = proc_usage(pid)?;
    let start = Instant::now();
    while start.elapsed() < window {
        std::thread::sleep(Duration::from_millis(500));
        peak = peak.max(proc_usage(pid)?.1);
    }
    let (t1, rss) = proc_usage(pid)?;
    Ok((
        (t1 - t0) as f64 / hz / start.elapsed().as_secs_f64() * 100.0,
        peak.max(rss),
    ))
}

fn bench_config(run_dir: &std::path::Path) -> Result<std::path::PathBuf> {
    let mut y = format!(
        "bpffs: {}/bpffs\ncilium_config: {}/cilium-config\ncilium: \"1.18\"\ntargets:\n",
        run_dir.display(),
        run_dir.display()
    );
    for i in 0..4 {
        y.push_str(&format!("  - {{name: gw-http-{i}, address: 198.51.100.10, probe: http, path: /healthz, timeout: 500ms}}\n"));
    }
    for i in 0..3 {
        y.push_str(&format!("  - {{name: gw-tcp-{i}, address: 198.51.100.10, port: 80, probe: tcp, timeout: 500ms}}\n"));
    }
    for i in 0..2 {
        y.push_str(&format!("  - {{name: dns-vip-{i}, address: 198.51.100.53, probe: dns, query: gateway.lab.stepguard.test, timeout: 500ms}}\n"));
    }
    y.push_str("  - {name: gw-icmp, address: 198.51.100.10, probe: icmp, timeout: 500ms}\n");
    y.push_str("dns:\n  resolvers: [\"198.51.100.53\", \"198.51.100.53:53\", \"198.51.100.53:0053\"]\n  names: [gateway.lab.stepguard.test]\n");
    let path = run_dir.join("bench-agent.yaml");
    std::fs::write(&path, y)?;
    Ok(path)
}

struct Child(std::process::Child);
impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn daemon(quick: bool) -> Result<Value> {
    let prefix = "sgbenchd".to_string();
    let _ = Command::new(lab_bin())
        .args(["down", "--prefix", &prefix])
        .output();
    run_ok(Command::new(lab_bin()).args(["up", "--prefix", &prefix]))?;
    let _guard = scopeguard(prefix.clone());
    let run_dir = std::path::Path::new("/run/stepguard-lab").join(&prefix);
    let ns = format!("{prefix}-node");
    let cfg = bench_config(&run_dir)?;
    let port = "19970";
    let url = format!("http://127.0.0.1:{port}");
    let agent = Child(
        nsenter(&ns)
            .arg(stepguard_bin())
            .args(["agent", "--config"])
            .arg(&cfg)
            .args(["--state-dir"])
            .arg(run_dir.join("bench-state"))
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create("/tmp/stepguard-bench-agent.log")?)
            .spawn()?,
    );
    let pid = agent.0.id();
    std::thread::sleep(Duration::from_secs(5));
    let window = if quick {
        Duration::from_secs(10)
    } else {
        Duration::from_secs(30)
    };
    println!(
        "bench: agent steady state (10 VIP targets at 1 s, 3 resolvers) for {}s",
        window.as_secs()
    );
    let (steady_cpu, steady_rss) = measure(pid, window)?;
    println!(
        "  CPU {steady_cpu:.2}% of a core, RSS {:.1} MiB",
        steady_rss as f64 / 1024.0
    );
    println!("bench: /metrics under load (wrk, 2 threads, 10 connections, 10 s)");
    let wrk = run_ok(nsenter(&ns).args([
        "wrk",
        "-t2",
        "-c10",
        "-d10s",
        "--latency",
        &format!("{url}/metrics"),
    ]))?;
    let wrk_out = String::from_utf8_lossy(&wrk.stdout).into_owned();
    let pick = |label: &str| {
        wrk_out
            .lines()
            .find(|l| l.trim_start().starts_with(label))
            .and_then(|l| l.split_whitespace().nth(1))
            .unwrap_or("?")
            .to_string()
    };
    let (p50, p99, rps) = (
        pick("50%"),
        pick("99%"),
        wrk_out
            .lines()
            .find(|l| l.starts_with("Requests/sec"))
            .and_then(|l| l.split_whitespace().nth(1))
            .unwrap_or("?")
            .to_string(),
    );
    println!("  p50 {p50}, p99 {p99}, {rps} requests/s");
    println!(
        "bench: agent in burst mode (a step open, 10 ms cadence) for {}s",
        window.as_secs() / 2
    );
    curl(
        &ns,
        &[
            "-X",
            "POST",
            "-d",
            r#"{"id":"bench-burst","timeout":"10m","settle":"5s"}"#,
            &format!("{url}/v1/steps"),
        ],
    )?;
    std::thread::sleep(Duration::from_secs(2));
    let (burst_cpu, burst_rss) = measure(pid, window / 2)?;
    curl(
        &ns,
        &["-X", "DELETE", &format!("{url}/v1/steps/bench-burst")],
    )?;
    println!(
        "  CPU {burst_cpu:.2}% of a core, RSS {:.1} MiB",
        burst_rss as f64 / 1024.0
    );

    let reps = if quick { 5 } else { 20 };
    println!("bench: gap accuracy over {reps} restarts with a 300 ms gap");
    let mut errors: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for i in 0..reps {
        let body = format!(r#"{{"id":"acc-{i}","timeout":"60s","settle":"1s"}}"#);
        curl(
            &ns,
            &["-X", "POST", "-d", &body, &format!("{url}/v1/steps")],
        )?;
        std::thread::sleep(Duration::from_millis(300));
        let r: Value = serde_json::from_slice(
            &run_ok(Command::new(lab_bin()).args([
                "restart",
                "--prefix",
                &prefix,
                "--down",
                "300ms",
                "--blackhole",
            ]))?
            .stdout,
        )?;
        let window = (r["blackhole_end_ns"].as_u64().unwrap_or(0)
            - r["blackhole_start_ns"].as_u64().unwrap_or(0)) as f64
            / 1e9;
        let v: Value =
            serde_json::from_str(&curl(&ns, &[&format!("{url}/v1/steps/acc-{i}?wait=90s")])?)?;
        if v["verdict"]["status"] != "passed" {
            bail!("accuracy run {i} did not pass: {}", v["verdict"]);
        }
        for g in v["gaps"].as_array().cloned().unwrap_or_default() {
            let err = (g["longest_s"].as_f64().unwrap_or(0.0) - window).abs() * 1e3;
            errors
                .entry(g["target"].as_str().unwrap_or("").to_string())
                .or_default()
                .push(err);
        }
    }
    let mut acc = serde_json::Map::new();
    for (t, e) in &errors {
        let mean = e.iter().sum::<f64>() / e.len() as f64;
        let worst = e.iter().cloned().fold(0.0, f64::max);
        println!(
            "  {t}: mean error {mean:.1} ms, worst {worst:.1} ms (bound: cadence 10 ms + 10 ms)"
        );
        acc.insert(
            t.clone(),
            json!({"mean_error_ms": mean, "worst_error_ms": worst, "runs": e.len()}),
        );
    }
    drop(agent);
    Ok(json!({
        "steady": {"cpu_percent": steady_cpu, "rss_mib": steady_rss as f64 / 1024.0, "window_s": window.as_secs()},
        "burst": {"cpu_percent": burst_cpu, "rss_mib": burst_rss as f64 / 1024.0},
        "metrics_under_load": {"p50": p50, "p99": p99, "requests_per_s": rps},
        "gap_accuracy": acc,
    }))
}

/// `stepguard witness` in a LAN lab: CPU and RSS with 10 targets at 1 s and during a step at
/// 10 ms, and the LAN gap it measures across lease moves with Cilium's default lease timings
/// (15 s / 5 s / 2 s; `--quick`: 2 s / 1 s / 500 ms), against the lab's ground truth.
fn witness(quick: bool) -> Result<Value> {
    let prefix = "sgbenchw".to_string();
    let _ = Command::new(lab_bin())
        .args(["down", "--prefix", &prefix])
        .output();
    let (lease, renew, retry) = if quick {
        ("2s", "1s", "500ms")
    } else {
        ("15s", "5s", "2s")
    };
    let status: Value = serde_json::from_slice(
        &run_ok(Command::new(lab_bin()).args([
            "up",
            "--prefix",
            &prefix,
            "--nodes",
            "2",
            "--lease-duration",
            lease,
            "--lease-renew",
            renew,
            "--lease-retry",
            retry,
        ]))?
        .stdout,
    )?;
    let _guard = scopeguard(prefix.clone());
    let client = status["client_netns"]
        .as_str()
        .context("client_netns")?
        .to_string();
    let run_dir = std::path::Path::new("/run/stepguard-lab").join(&prefix);
    let mut y = String::from("targets:\n");
    for i in 0..4 {
        y.push_str(&format!("  - {{name: gw-http-{i}, address: 203.0.113.200, probe: http, path: /healthz, timeout: 200ms}}\n"));
    }
    for i in 0..3 {
        y.push_str(&format!("  - {{name: gw-tcp-{i}, address: 203.0.113.200, port: 80, probe: tcp, timeout: 200ms}}\n"));
    }
    for (i, a) in ["203.0.113.53", "203.0.113.54"].iter().enumerate() {
        y.push_str(&format!("  - {{name: dns-{i}, address: {a}, probe: dns, query: gateway.lab.stepguard.test, timeout: 200ms}}\n"));
    }
    y.push_str("  - {name: gw-icmp, address: 203.0.113.200, probe: icmp, timeout: 200ms}\n");
    let cfg = run_dir.join("bench-witness.yaml");
    std::fs::write(&cfg, y)?;
    let addr = "203.0.113.100:9310";
    let w = Child(
        nsenter(&client)
            .arg(stepguard_bin())
            .args(["witness", "--config"])
            .arg(&cfg)
            .args(["--listen", addr])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?,
    );
    let pid = w.0.id();
    std::thread::sleep(Duration::from_secs(3));
    let window = if quick {
        Duration::from_secs(10)
    } else {
        Duration::from_secs(30)
    };
    println!(
        "bench: witness steady state (10 targets at 1 s) for {}s",
        window.as_secs()
    );
    let (steady_cpu, steady_rss) = measure(pid, window)?;
    println!(
        "  CPU {steady_cpu:.2}% of a core, RSS {:.1} MiB",
        steady_rss as f64 / 1024.0
    );
    let post = |id: &str| {
        curl(
            &client,
            &[
                "-X",
                "POST",
                "-d",
                &format!(r#"{{"id":"{id}","burst_interval":"10ms","timeout":"10m"}}"#),
                &format!("http://{addr}/v1/steps"),
            ],
        )
    };
    post("bench-burst")?;
    println!(
        "bench: witness during a step (10 targets at 10 ms) for {}s",
        window.as_secs() / 2
    );
    let (burst_cpu, burst_rss) = measure(pid, window / 2)?;
    println!(
        "  CPU {burst_cpu:.2}% of a core, RSS {:.1} MiB",
        burst_rss as f64 / 1024.0
    );
    curl(
        &client,
        &[
            "-X",
            "DELETE",
            &format!("http://{addr}/v1/steps/bench-burst"),
        ],
    )?;

    // Lease moves with these timings: graceful restart of the holder (node 0), then a crash
    // of the new holder (node 1), each with its datapath down past the takeover.
    let secs = stepguard_lab_duration;
    let mut moves = Vec::new();
    for (node, crash, down) in [
        ("0", false, secs(retry) + 1.0),
        ("1", true, secs(lease) + secs(retry) + 1.0),
    ] {
        let id = format!("bench-lease-{node}");
        post(&id)?;
        std::thread::sleep(Duration::from_millis(500));
        let mut args = vec![
            "restart".to_string(),
            "--prefix".into(),
            prefix.clone(),
            "--node".into(),
            node.into(),
            "--down".into(),
            format!("{}ms", (down * 1e3) as u64),
            "--blackhole".into(),
        ];
        if crash {
            args.push("--crash".into());
        }
        let r: Value =
            serde_json::from_slice(&run_ok(Command::new(lab_bin()).args(&args))?.stdout)?;
        std::thread::sleep(Duration::from_secs(2));
        let rep: Value =
            serde_json::from_str(&curl(&client, &[&format!("http://{addr}/v1/steps/{id}")])?)?;
        curl(
            &client,
            &["-X", "DELETE", &format!("http://{addr}/v1/steps/{id}")],
        )?;
        for v in r["vips"].as_array().into_iter().flatten() {
            let (Some(st), Some(re)) = (v["stopped"][0].as_u64(), v["resumed"][0].as_u64()) else {
                continue;
            };
            let truth = (re.saturating_sub(st)) as f64 / 1e9;
            let target = match v["name"].as_str() {
                Some("gateway") => "gw-http-0",
                Some("dns-a") => "dns-0",
                Some("dns-b") => "dns-1",
                _ => continue,
            };
            let measured = rep["gaps"]
                .as_array()
                .and_then(|g| g.iter().find(|g| g["target"] == target))
                .and_then(|g| g["longest_s"].as_f64())
                .unwrap_or(f64::NAN);
            println!(
                "  {} restart of node {node}: {} lost for {:.0} ms (lab), witness {:.0} ms",
                if crash { "crash" } else { "graceful" },
                v["name"].as_str().unwrap_or("?"),
                truth * 1e3,
                measured * 1e3
            );
            moves.push(json!({"restart": if crash {"crash"} else {"graceful"}, "vip": v["name"], "truth_ms": truth * 1e3, "witness_ms": measured * 1e3, "error_ms": (measured - truth).abs() * 1e3}));
        }
    }
    drop(w);
    Ok(json!({
        "lease": {"duration": lease, "renew": renew, "retry": retry},
        "steady": {"cpu_percent": steady_cpu, "rss_mib": steady_rss as f64 / 1024.0},
        "burst": {"cpu_percent": burst_cpu, "rss_mib": burst_rss as f64 / 1024.0},
        "lease_moves": moves,
    }))
}

/// `2s`, `500ms` as seconds.
fn stepguard_lab_duration(s: &str) -> f64 {
    match s.strip_suffix("ms") {
        Some(ms) => ms.parse::<f64>().unwrap_or(0.0) / 1e3,
        None => s.trim_end_matches('s').parse().unwrap_or(0.0),
    }
}

fn report_witness(w: &Value) -> String {
    let mut r = format!(
        "\n## witness\n\n`stepguard witness` in the LAN lab's client namespace, 10 targets (4 http, 3 tcp, 2 dns, 1 icmp); lease timings {} / {} / {}.\n\n| measurement | figure | target |\n|---|---:|---|\n",
        w["lease"]["duration"].as_str().unwrap_or("?"),
        w["lease"]["renew"].as_str().unwrap_or("?"),
        w["lease"]["retry"].as_str().unwrap_or("?")
    );
    r.push_str(&format!(
        "| RSS steady (1 s) | {:.1} MiB | < 20 MiB |\n| CPU steady | {:.2} % of a core | < 1 % |\n| RSS during a step (10 ms) | {:.1} MiB | < 20 MiB |\n| CPU during a step | {:.2} % of a core | < 5 % |\n",
        w["steady"]["rss_mib"].as_f64().unwrap_or(0.0),
        w["steady"]["cpu_percent"].as_f64().unwrap_or(0.0),
        w["burst"]["rss_mib"].as_f64().unwrap_or(0.0),
        w["burst"]["cpu_percent"].as_f64().unwrap_or(0.0)
    ));
    for m in w["lease_moves"].as_array().into_iter().flatten() {
        r.push_str(&format!(
            "| LAN gap, {} restart, {} | witness {:.0} ms vs lab {:.0} ms (error {:.1} ms) | ≤ cadence + 10 ms |\n",
            m["restart"].as_str().unwrap_or("?"),
            m["vip"].as_str().unwrap_or("?"),
            m["witness_ms"].as_f64().unwrap_or(f64::NAN),
            m["truth_ms"].as_f64().unwrap_or(f64::NAN),
            m["error_ms"].as_f64().unwrap_or(f64::NAN)
        ));
    }
    r
}

fn report_daemon(d: &Value) -> String {
    let mut r = String::from("\n## agent daemon\n\nLab node, release build, 10 VIP targets (4 http, 3 tcp, 2 dns, 1 icmp) probed every 1 s, 3 resolvers queried every 1 s.\n\n");
    r.push_str("| measurement | figure | target |\n|---|---:|---|\n");
    r.push_str(&format!(
        "| RSS steady | {:.1} MiB | < 20 MiB |\n",
        d["steady"]["rss_mib"].as_f64().unwrap_or(0.0)
    ));
    r.push_str(&format!(
        "| CPU steady | {:.2} % of a core | < 1 % |\n",
        d["steady"]["cpu_percent"].as_f64().unwrap_or(0.0)
    ));
    r.push_str(&format!(
        "| RSS burst (step open, 10 ms cadence) | {:.1} MiB | < 20 MiB |\n",
        d["burst"]["rss_mib"].as_f64().unwrap_or(0.0)
    ));
    r.push_str(&format!(
        "| CPU burst | {:.2} % of a core | < 5 % |\n",
        d["burst"]["cpu_percent"].as_f64().unwrap_or(0.0)
    ));
    r.push_str(&format!(
        "| /metrics under wrk (2 threads, 10 connections) | p50 {} / p99 {}, {} req/s | — |\n",
        d["metrics_under_load"]["p50"].as_str().unwrap_or("?"),
        d["metrics_under_load"]["p99"].as_str().unwrap_or("?"),
        d["metrics_under_load"]["requests_per_s"]
            .as_str()
            .unwrap_or("?")
    ));
    if let Some(acc) = d["gap_accuracy"].as_object() {
        for (t, a) in acc {
            r.push_str(&format!("| gap error, {t} ({} runs, 300 ms gap) | mean {:.1} ms, worst {:.1} ms | ≤ 20 ms |\n", a["runs"], a["mean_error_ms"].as_f64().unwrap_or(0.0), a["worst_error_ms"].as_f64().unwrap_or(0.0)));
        }
    }
    r
}

fn report(devmaps: &Value) -> String {
    let mut r = String::from("# stepguard benchmarks\n\nMeasured by `cargo xtask bench` on this machine (2 cores, shared: treat as indicative). Medians.\n\n");
    r.push_str("## devices + maps check vs bpftool doing the same work\n\n");
    r.push_str("Legacy-tc lab. stepguard: `stepguard check --only devices,maps` as a process (checks = the checks' own time). bpftool: `bpftool net show` + `bpftool map show` + `bpftool map dump` of every global map to count entries.\n\n");
    r.push_str("| lxc veths | pinned maps | ct entries | stepguard process ms | stepguard checks ms | bpftool ms | speed-up |\n|---:|---:|---:|---:|---:|---:|---:|\n");
    let rows = devmaps.as_array().cloned().unwrap_or_default();
    for row in &rows {
        r.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {:.1}x |\n",
            row["pods"],
            row["pinned_maps"],
            row["ct_entries"],
            row["stepguard_process_ms"],
            row["stepguard_checks_ms"],
            row["bpftool_ms"],
            row["speedup"].as_f64().unwrap_or(0.0)
        ));
    }
    if let (Some(first), Some(last)) = (rows.first(), rows.last()) {
        let grow =
            |k: &str| last[k].as_f64().unwrap_or(0.0) / first[k].as_f64().unwrap_or(1.0).max(1e-9);
        let size = last["pods"].as_f64().unwrap_or(1.0) / first["pods"].as_f64().unwrap_or(1.0);
        r.push_str(&format!(
            "\nGrowth from the smallest to the largest size ({size:.0}x devices, maps and entries): stepguard checks {:.1}x, stepguard process {:.1}x, bpftool {:.1}x. Target: faster than bpftool, linear (or better) growth.\n",
            grow("stepguard_checks_ms"), grow("stepguard_process_ms"), grow("bpftool_ms")
        ));
    }
    r
}

pub fn bench(quick: bool, only: &[String]) -> Result<()> {
    let want = |part: &str| only.is_empty() || only.iter().any(|o| o == part);
    let sizes: Vec<Size> = if quick {
        vec![
            Size {
                pods: 20,
                ct_fill: 10_000,
            },
            Size {
                pods: 100,
                ct_fill: 50_000,
            },
        ]
    } else {
        vec![
            Size {
                pods: 100,
                ct_fill: 50_000,
            },
            Size {
                pods: 500,
                ct_fill: 250_000,
            },
            Size {
                pods: 1000,
                ct_fill: 500_000,
            },
        ]
    };
    let devmaps = if want("devmaps") {
        devices_and_maps(&sizes, 5)?
    } else {
        Value::Null
    };
    let daemon = if want("daemon") {
        daemon(quick)?
    } else {
        Value::Null
    };
    let witness = if want("witness") {
        witness(quick)?
    } else {
        Value::Null
    };
    let dir = root().join("target/bench");
    std::fs::create_dir_all(&dir)?;
    let all = json!({"devices_and_maps": devmaps, "daemon": daemon, "witness": witness});
    std::fs::write(dir.join("report.json"), serde_json::to_vec_pretty(&all)?)?;
    let mut text = String::new();
    if want("devmaps") {
        text += &report(&devmaps);
    } else {
        text += "# stepguard benchmarks (partial run)\n";
    }
    if want("daemon") {
        text += &report_daemon(&daemon);
    }
    if want("witness") {
        text += &report_witness(&witness);
    }
    std::fs::write(dir.join("report.md"), &text)?;
    println!("\n{text}\nwritten to {}", dir.join("report.md").display());
    Ok(())
}
