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
            .stderr(std::process::Stdio::null())
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

pub fn bench(quick: bool) -> Result<()> {
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
    let devmaps = devices_and_maps(&sizes, 5)?;
    let daemon = daemon(quick)?;
    let dir = root().join("target/bench");
    std::fs::create_dir_all(&dir)?;
    let all = json!({"devices_and_maps": devmaps, "daemon": daemon});
    std::fs::write(dir.join("report.json"), serde_json::to_vec_pretty(&all)?)?;
    let text = report(&devmaps) + &report_daemon(&daemon);
    std::fs::write(dir.join("report.md"), &text)?;
    println!("\n{text}\nwritten to {}", dir.join("report.md").display());
    Ok(())
}
