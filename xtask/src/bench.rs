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
        // Counted while it streams: a 2.5M-entry dump parsed whole took 14 GB.
        entries += count_streamed(
            Command::new("bpftool")
                .args(["-j", "map", "dump", "pinned"])
                .arg(&p),
            b"\"key\":",
        )?;
    }
    Ok((t.elapsed(), entries))
}

/// Occurrences of `needle` in a command's output, read as it streams.
fn count_streamed(cmd: &mut Command, needle: &[u8]) -> Result<u64> {
    use std::io::Read;
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let mut out = child.stdout.take().context("stdout")?;
    let mut buf = vec![0u8; 1 << 16];
    let mut carry: Vec<u8> = Vec::new();
    let mut n = 0u64;
    loop {
        let k = out.read(&mut buf)?;
        if k == 0 {
            break;
        }
        carry.extend_from_slice(&buf[..k]);
        n += carry.windows(needle.len()).filter(|w| *w == needle).count() as u64;
        let keep = carry.len().min(needle.len() - 1);
        carry.drain(..carry.len() - keep);
    }
    if !child.wait()?.success() {
        bail!("{cmd:?} failed");
    }
    Ok(n)
}

struct Size {
    pods: u32,
    ct_fill: u32,
}

fn benchref_bin() -> std::path::PathBuf {
    root().join("target/release/benchref")
}

/// Runs `cmd` to completion: (stdout, wall time, peak RSS in KiB). The peak is the child's
/// VmHWM, polled while it runs: wait4's `ru_maxrss` also counts what the child shared with
/// this process before its exec.
fn run_measured(cmd: &mut Command) -> Result<(Vec<u8>, Duration, u64)> {
    use std::io::Read;
    let t = Instant::now();
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let pid = child.id();
    let mut out_pipe = child.stdout.take().context("stdout")?;
    let reader = std::thread::spawn(move || {
        let mut out = Vec::new();
        let _ = out_pipe.read_to_end(&mut out);
        out
    });
    let mut hwm = 0u64;
    while child.try_wait()?.is_none() {
        if let Ok(st) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
            // Only after the exec (nsenter execs stepguard): the new image's own peak.
            if st
                .lines()
                .any(|l| l.starts_with("Name:") && l.contains("stepguard"))
            {
                if let Some(v) = st
                    .lines()
                    .find_map(|l| l.strip_prefix("VmHWM:"))
                    .and_then(|v| v.split_whitespace().next()?.parse().ok())
                {
                    hwm = hwm.max(v);
                }
            }
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let took = t.elapsed();
    let out = reader.join().unwrap_or_default();
    Ok((out, took, hwm))
}

fn devices_and_maps(sizes: &[Size], runs: usize, quick: bool) -> Result<Value> {
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
        let ct_slots = s.ct_fill.next_power_of_two().max(65536);
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
            &ct_slots.to_string(),
            "--ct-fill",
            &s.ct_fill.to_string(),
        ]))?;
        let up = t.elapsed();
        let guard = scopeguard(prefix.clone());
        let run_dir = std::path::Path::new("/run/stepguard-lab").join(&prefix);
        let cfg = run_dir.join("stepguard.yaml");
        let bpffs = run_dir.join("bpffs");
        let globals = bpffs.join("tc/globals");
        let pinned = std::fs::read_dir(&globals)?.count();
        let ns = format!("{prefix}-node");
        let mut ours = Vec::new();
        let mut internal = Vec::new();
        let mut our_entries = 0u64;
        let mut check_rss = 0u64;
        for _ in 0..runs {
            let (out, took, rss) = run_measured(
                nsenter(&ns)
                    .arg(stepguard_bin())
                    .args([
                        "check",
                        "--only",
                        "devices,maps",
                        "--format",
                        "json",
                        "--config",
                    ])
                    .arg(&cfg),
            )?;
            ours.push(took);
            check_rss = check_rss.max(rss);
            let v: Value = serde_json::from_slice(&out).context("parse check output")?;
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
        // The physical limit: the same syscalls in a minimal loop.
        let minimal: Value = serde_json::from_slice(
            &run_ok(
                nsenter(&ns)
                    .arg(benchref_bin())
                    .arg("observe")
                    .arg(&bpffs)
                    .arg(runs.to_string()),
            )?
            .stdout,
        )?;
        // bpftool takes minutes at the largest size: fewer runs there.
        let bpftool_runs = if s.pods >= 5000 { 1 } else { runs.min(3) };
        let mut refs = Vec::new();
        let mut ref_entries = 0;
        for _ in 0..bpftool_runs {
            let (d, e) = bpftool_same_work(&ns, &globals)?;
            refs.push(d);
            ref_entries = e;
        }
        // The agent itself on this node: steady CPU and RSS.
        let state = run_dir.join("bench-growth-state");
        let agent = Child(
            nsenter(&ns)
                .arg(stepguard_bin())
                .args(["agent", "--config"])
                .arg(&cfg)
                .arg("--state-dir")
                .arg(&state)
                .args(["--listen", "127.0.0.1:19971"])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()?,
        );
        std::thread::sleep(Duration::from_secs(12));
        let (agent_cpu, agent_rss) = measure(
            agent.0.id(),
            Duration::from_secs(if quick { 10 } else { 30 }),
        )?;
        drop(agent);
        let (o, i, r) = (median(ours), median(internal), median(refs));
        let min_ms = minimal["median_ms"].as_f64().unwrap_or(f64::NAN);
        println!(
            "  stepguard {:.1} ms (checks {:.1} ms, RSS {:.1} MiB) vs minimal loop {min_ms:.1} ms vs bpftool {:.1} ms; agent steady {agent_cpu:.2}% / {:.1} MiB",
            ms(o), ms(i), check_rss as f64 / 1024.0, ms(r), agent_rss as f64 / 1024.0
        );
        rows.push(json!({
            "pods": s.pods, "pinned_maps": pinned, "ct_entries": s.ct_fill, "lab_up_ms": ms(up),
            "stepguard_process_ms": ms(o), "stepguard_checks_ms": ms(i), "check_rss_mib": check_rss as f64 / 1024.0,
            "minimal_loop_ms": min_ms, "minimal_entries": minimal["entries"],
            "bpftool_ms": ms(r), "speedup": r.as_secs_f64() / o.as_secs_f64(), "entries_counted": our_entries, "entries_bpftool": ref_entries,
            "agent_steady_cpu_percent": agent_cpu, "agent_steady_rss_mib": agent_rss as f64 / 1024.0,
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

/// Nanoseconds on a CPU of the threads of `pid` whose name starts with `comm` (schedstat:
/// exact, not tick-sampled).
fn thread_cpu_ns(pid: u32, comm: &str) -> u64 {
    let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    rd.flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.starts_with(comm))
        })
        .filter_map(|t| {
            std::fs::read_to_string(t.path().join("schedstat"))
                .ok()?
                .split_whitespace()
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
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

/// The bench's VIP targets: 4 http, 3 tcp, 2 dns, 1 icmp (as a gateway, DNS and a media
/// VIP would be configured), as agent config lines and as `benchref` arguments.
fn bench_targets() -> (String, Vec<String>) {
    let mut y = String::new();
    let mut r = Vec::new();
    for i in 0..4 {
        y.push_str(&format!("  - {{name: gw-http-{i}, address: 198.51.100.10, probe: http, path: /healthz, timeout: 500ms}}\n"));
        r.push("http:198.51.100.10:80/healthz".to_string());
    }
    for i in 0..3 {
        y.push_str(&format!("  - {{name: gw-tcp-{i}, address: 198.51.100.10, port: 80, probe: tcp, timeout: 500ms}}\n"));
        r.push("tcp:198.51.100.10:80".to_string());
    }
    for i in 0..2 {
        y.push_str(&format!("  - {{name: dns-vip-{i}, address: 198.51.100.53, probe: dns, query: gateway.lab.stepguard.test, timeout: 500ms}}\n"));
        r.push("dns:198.51.100.53:53:gateway.lab.stepguard.test".to_string());
    }
    y.push_str("  - {name: gw-icmp, address: 198.51.100.10, probe: icmp, timeout: 500ms}\n");
    r.push("icmp:198.51.100.10".to_string());
    (y, r)
}

fn bench_config(
    run_dir: &std::path::Path,
    name: &str,
    targets: &str,
) -> Result<std::path::PathBuf> {
    let y = format!(
        "bpffs: {rd}/bpffs\ncilium_config: {rd}/cilium-config\ncilium: \"1.18\"\ntargets:\n{targets}dns:\n  resolvers: [\"198.51.100.53\", \"198.51.100.53:53\", \"198.51.100.53:0053\"]\n  names: [gateway.lab.stepguard.test]\n",
        rd = run_dir.display()
    );
    let path = run_dir.join(name);
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

/// An agent on the lab node (release build), its log in the run directory.
fn start_agent(
    ns: &str,
    cfg: &std::path::Path,
    run_dir: &std::path::Path,
    port: u16,
) -> Result<Child> {
    let state = run_dir.join(format!("bench-state-{port}"));
    let _ = std::fs::remove_dir_all(&state);
    Ok(Child(
        nsenter(ns)
            .arg(stepguard_bin())
            .args(["agent", "--config"])
            .arg(cfg)
            .arg("--state-dir")
            .arg(&state)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(
                run_dir.join(format!("bench-agent-{port}.log")),
            )?)
            .spawn()?,
    ))
}

/// Sum of every sample of a metric family (`name{...} v` and `name v`).
fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|r| r.starts_with('{') || r.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Cumulative buckets (le, count) of an unlabelled histogram.
fn buckets(text: &str, name: &str) -> Vec<(f64, f64)> {
    let prefix = format!("{name}_bucket{{le=\"");
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(&prefix)?;
            let (le, v) = rest.split_once("\"} ")?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, v.trim().parse().ok()?))
        })
        .collect()
}

/// The smallest bucket bound holding fraction `q` of the observations between two scrapes,
/// and the fraction at or below 1 ms.
fn quantile_bound(before: &[(f64, f64)], after: &[(f64, f64)], q: f64) -> (f64, f64, f64) {
    let d: Vec<(f64, f64)> = after
        .iter()
        .map(|(le, a)| {
            let b = before.iter().find(|(l, _)| l == le).map_or(0.0, |x| x.1);
            (*le, a - b)
        })
        .collect();
    let total = d.last().map_or(0.0, |x| x.1);
    let bound = d
        .iter()
        .find(|(_, c)| total > 0.0 && *c / total >= q)
        .map_or(f64::NAN, |x| x.0);
    let within_1ms = d
        .iter()
        .find(|(le, _)| (*le - 0.001).abs() < 1e-12)
        .map_or(
            f64::NAN,
            |x| if total > 0.0 { x.1 / total } else { f64::NAN },
        );
    (bound, within_1ms, total)
}

fn benchref(ns: &str, args: &[&str]) -> Result<Value> {
    let out = run_ok(nsenter(ns).arg(benchref_bin()).args(args))?;
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// fping at 10 ms per target over `window`: (CPU percent, echoes it sent, µs per echo).
/// `-i 1`: fping's default minimum interval between any two pings is 10 ms, which would cap
/// ten targets at 100 echoes a second (an earlier bench divided that cost by 1,000). The
/// echoes are counted from fping's own summary (printed on SIGINT), not assumed.
fn fping_cost(ns: &str, addrs: &[&str], window: Duration) -> Result<(f64, u64, f64)> {
    let err_path =
        std::env::temp_dir().join(format!("stepguard-bench-fping-{}.err", std::process::id()));
    let mut child = Child(
        nsenter(ns)
            .args(["fping", "-l", "-q", "-p", "10", "-i", "1", "-t", "500"])
            .args(addrs)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&err_path)?)
            .spawn()?,
    );
    std::thread::sleep(Duration::from_secs(1));
    let pid = child.0.id();
    // nsenter execs fping: the pid is fping's.
    let t = Instant::now();
    let (cpu, _) = measure(pid, window)?;
    let ran = t.elapsed().as_secs_f64() + 1.0;
    // SAFETY: signals our own child.
    unsafe { libc::kill(pid as i32, libc::SIGINT) };
    let _ = child.0.wait();
    let summary = std::fs::read_to_string(&err_path).unwrap_or_default();
    let _ = std::fs::remove_file(&err_path);
    let sent: u64 = summary
        .lines()
        .filter_map(|l| l.split("xmt/rcv/%loss = ").nth(1))
        .filter_map(|r| r.split('/').next()?.trim().parse::<u64>().ok())
        .sum();
    if sent == 0 {
        bail!(
            "fping printed no summary: {}",
            summary.lines().last().unwrap_or("")
        );
    }
    // CPU was measured over `window`, the echoes over the whole run: scale to the window.
    let per_s = sent as f64 / ran;
    let us = cpu / 100.0 * 1e6 / per_s;
    Ok((cpu, sent, us))
}

/// One step at `cadence` open for `window`: CPU, RSS, probes sent, µs per probe.
fn burst(ns: &str, url: &str, pid: u32, id: &str, window: Duration) -> Result<Value> {
    curl(
        ns,
        &[
            "-X",
            "POST",
            "-d",
            &format!(r#"{{"id":"{id}","timeout":"10m","settle":"5s"}}"#),
            &format!("{url}/v1/steps"),
        ],
    )?;
    std::thread::sleep(Duration::from_secs(2));
    let m0 = curl(ns, &[&format!("{url}/metrics")])?;
    // The probe engine's thread alone (kernel names it from "stepguard-probes"): the part of
    // the agent doing what the minimal loop does; the rest is the step runner observing the
    // node, deciding and persisting, and the runtime.
    let p0 = (thread_cpu_ns(pid, "stepguard-probe"), Instant::now());
    let (cpu, rss) = measure(pid, window)?;
    let probe_thread = (thread_cpu_ns(pid, "stepguard-probe") - p0.0) as f64
        / p0.1.elapsed().as_nanos() as f64
        * 100.0;
    let m1 = curl(ns, &[&format!("{url}/metrics")])?;
    curl(ns, &["-X", "DELETE", &format!("{url}/v1/steps/{id}")])?;
    let probes = metric_sum(&m1, "stepguard_probe_duration_seconds_count")
        - metric_sum(&m0, "stepguard_probe_duration_seconds_count");
    let us = cpu / 100.0 * window.as_secs_f64() * 1e6 / probes.max(1.0);
    let thread_us = probe_thread / 100.0 * window.as_secs_f64() * 1e6 / probes.max(1.0);
    Ok(
        json!({"cpu_percent": cpu, "rss_mib": rss as f64 / 1024.0, "probes": probes, "us_per_probe": us,
               "probe_thread_cpu_percent": probe_thread, "probe_thread_us_per_probe": thread_us}),
    )
}

/// Gap error over `reps` restarts with a 300 ms datapath outage, per target.
fn gap_accuracy(
    ns: &str,
    url: &str,
    prefix: &str,
    reps: usize,
    id: &str,
) -> Result<serde_json::Map<String, Value>> {
    let mut errors: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for i in 0..reps {
        let body = format!(r#"{{"id":"{id}-{i}","timeout":"60s","settle":"1s"}}"#);
        curl(ns, &["-X", "POST", "-d", &body, &format!("{url}/v1/steps")])?;
        std::thread::sleep(Duration::from_millis(300));
        let r: Value = serde_json::from_slice(
            &run_ok(Command::new(lab_bin()).args([
                "restart",
                "--prefix",
                prefix,
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
            serde_json::from_str(&curl(ns, &[&format!("{url}/v1/steps/{id}-{i}?wait=90s")])?)?;
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
        println!("  {t}: mean error {mean:.1} ms, worst {worst:.1} ms");
        acc.insert(
            t.clone(),
            json!({"mean_error_ms": mean, "worst_error_ms": worst, "runs": e.len()}),
        );
    }
    Ok(acc)
}

fn daemon(quick: bool) -> Result<Value> {
    let prefix = "sgbenchd".to_string();
    let (pods, ct) = if quick {
        (100u32, 50_000u32)
    } else {
        (1000, 500_000)
    };
    let _ = Command::new(lab_bin())
        .args(["down", "--prefix", &prefix])
        .output();
    println!("bench: big-node lab ({pods} endpoints, {ct} conntrack entries)");
    run_ok(Command::new(lab_bin()).args([
        "up",
        "--prefix",
        &prefix,
        "--pods",
        &pods.to_string(),
        "--ct-entries",
        "524288",
        "--ct-fill",
        &ct.to_string(),
    ]))?;
    let _guard = scopeguard(prefix.clone());
    let run_dir = std::path::Path::new("/run/stepguard-lab").join(&prefix);
    let ns = format!("{prefix}-node");
    let pinned = std::fs::read_dir(run_dir.join("bpffs/tc/globals"))?.count();
    let (targets, ref_targets) = bench_targets();
    let refs: Vec<&str> = ref_targets.iter().map(String::as_str).collect();
    let cfg = bench_config(&run_dir, "bench-agent.yaml", &targets)?;
    let port = 19970;
    let url = format!("http://127.0.0.1:{port}");
    let agent = start_agent(&ns, &cfg, &run_dir, port)?;
    let pid = agent.0.id();
    // The first slow-loop round (and its memory released) before measuring.
    std::thread::sleep(Duration::from_secs(15));
    let window = Duration::from_secs(if quick { 15 } else { 60 });
    let win_s = window.as_secs().to_string();

    println!("bench: agent steady state ({pods} endpoints, {pinned} pinned maps, 10 targets at 1 s, 3 resolvers) for {win_s}s");
    let (steady_cpu, steady_rss) = measure(pid, window)?;
    let mut args = vec!["probes", "--interval", "1s", "--seconds", &win_s];
    args.extend(&refs);
    let steady_ref = benchref(&ns, &args)?;
    println!(
        "  CPU {steady_cpu:.2}% of a core, RSS {:.1} MiB; the same probes in a minimal loop: {:.3}%",
        steady_rss as f64 / 1024.0,
        steady_ref["cpu_percent"].as_f64().unwrap_or(f64::NAN)
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

    let bwin = Duration::from_secs(if quick { 10 } else { 30 });
    let bwin_s = bwin.as_secs().to_string();
    println!("bench: burst (a step open, 10 targets at 10 ms) for {bwin_s}s, against the minimal loop and fping");
    let burst_agent = burst(&ns, &url, pid, "bench-burst", bwin)?;
    let mut args = vec!["probes", "--interval", "10ms", "--seconds", &bwin_s];
    args.extend(&refs);
    let burst_ref = benchref(&ns, &args)?;
    println!(
        "  agent {:.2}% ({:.1} µs/probe; its probe thread {:.2}%) vs minimal loop {:.2}% ({:.1} µs/probe)",
        burst_agent["cpu_percent"].as_f64().unwrap_or(f64::NAN),
        burst_agent["us_per_probe"].as_f64().unwrap_or(f64::NAN),
        burst_agent["probe_thread_cpu_percent"].as_f64().unwrap_or(f64::NAN),
        burst_ref["cpu_percent"].as_f64().unwrap_or(f64::NAN),
        burst_ref["us_per_probe"].as_f64().unwrap_or(f64::NAN)
    );
    // Per kind: the minimal loop alone, and ICMP against fping.
    let mut per_kind = serde_json::Map::new();
    for (kind, t) in [
        ("http", "http:198.51.100.10:80/healthz"),
        ("tcp", "tcp:198.51.100.10:80"),
        ("dns", "dns:198.51.100.53:53:gateway.lab.stepguard.test"),
        ("icmp", "icmp:198.51.100.10"),
    ] {
        let v = benchref(&ns, &["probes", "--interval", "1ms", "--seconds", "5", t])?;
        per_kind.insert(kind.into(), v["us_per_probe"].clone());
    }
    let icmp10: String = (0..10)
        .map(|i| {
            format!("  - {{name: icmp-{i}, address: 198.51.100.10, probe: icmp, timeout: 500ms}}\n")
        })
        .collect();
    let icmp_cfg = bench_config(&run_dir, "bench-icmp.yaml", &icmp10)?;
    let icmp_agent = {
        let a = start_agent(&ns, &icmp_cfg, &run_dir, port + 1)?;
        std::thread::sleep(Duration::from_secs(5));
        burst(
            &ns,
            &format!("http://127.0.0.1:{}", port + 1),
            a.0.id(),
            "bench-icmp",
            bwin,
        )?
    };
    let (fping_cpu, fping_sent, fping_us) = fping_cost(&ns, &["198.51.100.10"; 10], bwin)?;
    let fping_rate = fping_sent as f64 / (bwin.as_secs_f64() + 1.0);
    println!(
        "  icmp: agent {:.1} µs/echo, minimal loop {:.1}, fping -p 10 -i 1 {fping_us:.1} ({fping_cpu:.2}% at {fping_rate:.0} echoes/s)",
        icmp_agent["us_per_probe"].as_f64().unwrap_or(f64::NAN),
        per_kind["icmp"].as_f64().unwrap_or(f64::NAN)
    );

    println!("bench: probe send times while the big node's devices+maps check runs (GET /v1/checks in a loop) for {bwin_s}s");
    curl(
        &ns,
        &[
            "-X",
            "POST",
            "-d",
            r#"{"id":"bench-jitter","timeout":"10m","settle":"5s"}"#,
            &format!("{url}/v1/steps"),
        ],
    )?;
    std::thread::sleep(Duration::from_secs(2));
    let m0 = curl(&ns, &[&format!("{url}/metrics")])?;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let checks = {
        let (stop, ns, url) = (stop.clone(), ns.clone(), url.clone());
        std::thread::spawn(move || {
            let mut n = 0u32;
            let mut took = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let t = Instant::now();
                if curl(&ns, &[&format!("{url}/v1/checks")]).is_ok() {
                    n += 1;
                    took.push(t.elapsed());
                }
                // /v1/checks reuses a result for 1 s: ask again just after.
                std::thread::sleep(Duration::from_millis(1050).saturating_sub(t.elapsed()));
            }
            (n, took)
        })
    };
    std::thread::sleep(bwin);
    let m1 = curl(&ns, &[&format!("{url}/metrics")])?;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let (checks_run, check_times) = checks.join().unwrap_or_default();
    curl(
        &ns,
        &["-X", "DELETE", &format!("{url}/v1/steps/bench-jitter")],
    )?;
    let name = "stepguard_probe_send_delay_seconds";
    let (b0, b1) = (buckets(&m0, name), buckets(&m1, name));
    let (p50, _, _) = quantile_bound(&b0, &b1, 0.5);
    let (p99, within_1ms, sends) = quantile_bound(&b0, &b1, 0.99);
    // The reference: the minimal loop's own wake-up lateness under the same kind of work
    // (`stepguard check` of the big node, as processes, in a loop).
    let stop2 = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let loader = {
        let (stop2, ns, cfg) = (stop2.clone(), ns.clone(), run_dir.join("stepguard.yaml"));
        std::thread::spawn(move || {
            while !stop2.load(std::sync::atomic::Ordering::SeqCst) {
                let _ = nsenter(&ns)
                    .arg(stepguard_bin())
                    .args(["check", "--only", "devices,maps", "--config"])
                    .arg(&cfg)
                    .output();
            }
        })
    };
    let mut args = vec!["probes", "--interval", "10ms", "--seconds", &bwin_s];
    args.extend(&refs);
    let jitter_ref = benchref(&ns, &args)?;
    stop2.store(true, std::sync::atomic::Ordering::SeqCst);
    let _ = loader.join();
    let check_ms = median(check_times.clone()).as_secs_f64() * 1e3;
    println!(
        "  {sends:.0} sends, {checks_run} checks ({check_ms:.0} ms each): send delay p50 ≤ {:.2} ms, p99 ≤ {:.2} ms, {:.2}% within 1 ms; minimal loop's wake-up lateness p99 {:.2} ms",
        p50 * 1e3,
        p99 * 1e3,
        within_1ms * 100.0,
        jitter_ref["late_p99_us"].as_f64().unwrap_or(f64::NAN) / 1e3
    );

    let reps = if quick { 5 } else { 20 };
    println!(
        "bench: gap accuracy at the default 10 ms cadence over {reps} restarts with a 300 ms gap"
    );
    let acc = gap_accuracy(&ns, &url, &prefix, reps, "acc")?;
    drop(agent);

    // Critical targets at 1 ms: two sets, each 4 targets.
    let mut critical = serde_json::Map::new();
    for (set, yaml, refs) in [
        (
            "4 icmp",
            (0..4)
                .map(|i| format!("  - {{name: crit-icmp-{i}, address: 198.51.100.10, probe: icmp, timeout: 200ms, burst_interval: 1ms}}\n"))
                .collect::<String>(),
            vec!["icmp:198.51.100.10"; 4],
        ),
        (
            "tcp + http + dns + icmp",
            "  - {name: crit-tcp, address: 198.51.100.10, port: 80, probe: tcp, timeout: 200ms, burst_interval: 1ms}\n  - {name: crit-http, address: 198.51.100.10, probe: http, path: /healthz, timeout: 200ms, burst_interval: 1ms}\n  - {name: crit-dns, address: 198.51.100.53, probe: dns, query: gateway.lab.stepguard.test, timeout: 200ms, burst_interval: 1ms}\n  - {name: crit-icmp, address: 198.51.100.10, probe: icmp, timeout: 200ms, burst_interval: 1ms}\n".to_string(),
            vec![
                "tcp:198.51.100.10:80",
                "http:198.51.100.10:80/healthz",
                "dns:198.51.100.53:53:gateway.lab.stepguard.test",
                "icmp:198.51.100.10",
            ],
        ),
    ] {
        println!("bench: critical targets at 1 ms ({set})");
        let c = bench_config(&run_dir, "bench-critical.yaml", &yaml)?;
        let p = port + 2;
        let a = start_agent(&ns, &c, &run_dir, p)?;
        std::thread::sleep(Duration::from_secs(5));
        let u = format!("http://127.0.0.1:{p}");
        let b = burst(&ns, &u, a.0.id(), "bench-crit", bwin)?;
        println!(
            "  CPU {:.2}% ({:.1} µs/probe, {:.0} probes)",
            b["cpu_percent"].as_f64().unwrap_or(f64::NAN),
            b["us_per_probe"].as_f64().unwrap_or(f64::NAN),
            b["probes"].as_f64().unwrap_or(0.0)
        );
        // The same probes at 1 ms in the minimal loop (the agent stopped: one prober at a time).
        drop(a);
        let mut args = vec!["probes", "--interval", "1ms", "--seconds", &bwin_s];
        args.extend(&refs);
        let r = benchref(&ns, &args)?;
        println!(
            "  minimal loop {:.2}% ({:.1} µs/probe)",
            r["cpu_percent"].as_f64().unwrap_or(f64::NAN),
            r["us_per_probe"].as_f64().unwrap_or(f64::NAN)
        );
        let a = start_agent(&ns, &c, &run_dir, p)?;
        std::thread::sleep(Duration::from_secs(5));
        let acc = gap_accuracy(&ns, &u, &prefix, if quick { 3 } else { 10 }, "crit")?;
        drop(a);
        critical.insert(set.into(), json!({"burst": b, "minimal_loop": r, "gap_accuracy": acc}));
    }

    Ok(json!({
        "node": {"endpoints": pods, "pinned_maps": pinned, "ct_entries": ct},
        "steady": {"cpu_percent": steady_cpu, "rss_mib": steady_rss as f64 / 1024.0, "window_s": window.as_secs(), "minimal_loop_cpu_percent": steady_ref["cpu_percent"]},
        "burst": {"agent": burst_agent, "minimal_loop": burst_ref, "minimal_us_per_probe_by_kind": per_kind,
                  "icmp": {"agent_us_per_echo": icmp_agent["us_per_probe"], "agent_cpu_percent": icmp_agent["cpu_percent"], "minimal_us_per_echo": per_kind["icmp"], "fping_us_per_echo": fping_us, "fping_cpu_percent": fping_cpu, "fping_echoes_per_s": fping_rate}},
        "jitter": {"sends": sends, "checks": checks_run, "check_ms": check_ms, "p50_le_ms": p50 * 1e3, "p99_le_ms": p99 * 1e3, "within_1ms": within_1ms, "minimal_loop_late_p99_ms": jitter_ref["late_p99_us"].as_f64().map(|v| v / 1e3)},
        "metrics_under_load": {"p50": p50_str(&wrk_out, "50%"), "p99": p50_str(&wrk_out, "99%"), "requests_per_s": rps},
        "gap_accuracy": acc,
        "critical": critical,
    }))
}

fn p50_str(wrk: &str, label: &str) -> String {
    wrk.lines()
        .find(|l| l.trim_start().starts_with(label))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or("?")
        .to_string()
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
            .args(["witness", "--allow-unauthenticated", "--config"])
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

/// The config check's read of the agent's loaded settings (`GET /v1/debuginfo`, which lists
/// every endpoint) on a big node, each a fresh process (a cold read, as after every agent
/// start), beside the raw read of the same answer with curl (the physical limit).
fn config_read(quick: bool) -> Result<Value> {
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
        // The devices check observes every endpoint's programs too (issue 25): beside
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

fn report_config(v: &Value) -> String {
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

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

fn report_daemon(d: &Value) -> String {
    let n = &d["node"];
    let mut r = format!(
        "\n## agent daemon on a big node\n\nLab node with {} endpoints (lxc veths, each in its own namespace), {} pinned maps, {} conntrack entries; release build; 10 VIP targets (4 http, 3 tcp, 2 dns, 1 icmp), 3 resolvers. References run in the same lab in the same run: `benchref` (the same syscalls in a minimal loop, no runtime: the physical limit) and `fping`.\n\n",
        n["endpoints"], n["pinned_maps"], n["ct_entries"]
    );
    r.push_str("| measurement | stepguard | reference | goal |\n|---|---:|---:|---|\n");
    r.push_str(&format!(
        "| CPU steady (probes at 1 s, checks at 10 s) | {:.2} % of a core | minimal loop, same probes: {:.3} % | < 0.5 % |\n",
        f(&d["steady"]["cpu_percent"]),
        f(&d["steady"]["minimal_loop_cpu_percent"])
    ));
    r.push_str(&format!(
        "| RSS steady | {:.1} MiB | — | < 16 MiB |\n",
        f(&d["steady"]["rss_mib"])
    ));
    let b = &d["burst"];
    r.push_str(&format!(
        "| CPU burst (10 targets at 10 ms) | {:.2} % of a core, {:.1} µs per probe (probe thread {:.2} %, {:.1} µs per probe) | minimal loop: {:.2} %, {:.1} µs per probe | < 3 % |\n",
        f(&b["agent"]["cpu_percent"]),
        f(&b["agent"]["us_per_probe"]),
        f(&b["agent"]["probe_thread_cpu_percent"]),
        f(&b["agent"]["probe_thread_us_per_probe"]),
        f(&b["minimal_loop"]["cpu_percent"]),
        f(&b["minimal_loop"]["us_per_probe"])
    ));
    r.push_str(&format!(
        "| µs per probe by kind, minimal loop | — | http {:.1}, tcp {:.1}, dns {:.1}, icmp {:.1} | — |\n",
        f(&b["minimal_us_per_probe_by_kind"]["http"]),
        f(&b["minimal_us_per_probe_by_kind"]["tcp"]),
        f(&b["minimal_us_per_probe_by_kind"]["dns"]),
        f(&b["minimal_us_per_probe_by_kind"]["icmp"])
    ));
    r.push_str(&format!(
        "| ICMP echo, 10 targets at 10 ms | {:.1} µs per echo ({:.2} %) | fping -p 10 -i 1: {:.1} µs per echo ({:.2} %); minimal loop {:.1} | — |\n",
        f(&b["icmp"]["agent_us_per_echo"]),
        f(&b["icmp"]["agent_cpu_percent"]),
        f(&b["icmp"]["fping_us_per_echo"]),
        f(&b["icmp"]["fping_cpu_percent"]),
        f(&b["icmp"]["minimal_us_per_echo"])
    ));
    r.push_str(&format!(
        "| RSS burst | {:.1} MiB | — | < 16 MiB |\n",
        f(&b["agent"]["rss_mib"])
    ));
    let j = &d["jitter"];
    r.push_str(&format!(
        "| probe send delay during devices+maps checks of this node ({:.0} sends, {} checks of {:.0} ms) | p50 ≤ {:.2} ms, p99 ≤ {:.2} ms ({:.2} % within 1 ms) | minimal loop's wake-up lateness under `stepguard check` load: p99 {:.2} ms | p99 < 1 ms |\n",
        f(&j["sends"]),
        j["checks"],
        f(&j["check_ms"]),
        f(&j["p50_le_ms"]),
        f(&j["p99_le_ms"]),
        f(&j["within_1ms"]) * 100.0,
        f(&j["minimal_loop_late_p99_ms"])
    ));
    r.push_str(&format!(
        "| /metrics under wrk (2 threads, 10 connections) | p50 {} / p99 {}, {} req/s | — | — |\n",
        d["metrics_under_load"]["p50"].as_str().unwrap_or("?"),
        d["metrics_under_load"]["p99"].as_str().unwrap_or("?"),
        d["metrics_under_load"]["requests_per_s"]
            .as_str()
            .unwrap_or("?")
    ));
    if let Some(acc) = d["gap_accuracy"].as_object() {
        for (t, a) in acc {
            r.push_str(&format!("| gap error at 10 ms, {t} ({} runs, 300 ms gap) | mean {:.1} ms, worst {:.1} ms | lab's recorded window | ≤ cadence + 10 ms |\n", a["runs"], f(&a["mean_error_ms"]), f(&a["worst_error_ms"])));
        }
    }
    if let Some(c) = d["critical"].as_object() {
        for (set, v) in c {
            r.push_str(&format!(
                "| critical targets at 1 ms ({set}): CPU | {:.2} % of a core, {:.1} µs per probe (probe thread {:.2} %, {:.1} µs per probe) | the same probes at 1 ms in the minimal loop: {:.2} %, {:.1} µs per probe | < 5 % |\n",
                f(&v["burst"]["cpu_percent"]),
                f(&v["burst"]["us_per_probe"]),
                f(&v["burst"]["probe_thread_cpu_percent"]),
                f(&v["burst"]["probe_thread_us_per_probe"]),
                f(&v["minimal_loop"]["cpu_percent"]),
                f(&v["minimal_loop"]["us_per_probe"])
            ));
            if let Some(acc) = v["gap_accuracy"].as_object() {
                for (t, a) in acc {
                    r.push_str(&format!("| critical ({set}), gap error, {t} ({} runs) | mean {:.1} ms, worst {:.1} ms | lab's recorded window | ≤ 1 ms + 2 ms |\n", a["runs"], f(&a["mean_error_ms"]), f(&a["worst_error_ms"])));
                }
            }
        }
    }
    r
}

fn report(devmaps: &Value) -> String {
    let mut r = String::from("# stepguard benchmarks\n\nMeasured by `cargo xtask bench` on this machine (2 cores, shared: treat as indicative). Medians.\n\n");
    r.push_str("## devices + maps check: growth, against the physical limit and bpftool\n\n");
    r.push_str("Legacy-tc lab. stepguard: `stepguard check --only devices,maps` as a process (checks = the checks' own time; every map's entries counted, as a person asking gets). Minimal loop: `benchref observe`, the same syscalls (rtnetlink dumps, tcx/tc queries, program info, map opens, batched lookups) with nothing decoded. bpftool: `bpftool net show` + `bpftool map show` + `bpftool map dump` of every global map. Agent: the daemon on the same node, steady.\n\n");
    r.push_str("| endpoints | pinned maps | ct entries | stepguard process ms | checks ms | minimal loop ms | check RSS MiB | bpftool ms | agent CPU steady | agent RSS |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    let rows = devmaps.as_array().cloned().unwrap_or_default();
    for row in &rows {
        r.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.1} | {:.1} | {} | {:.2} % | {:.1} MiB |\n",
            row["pods"],
            row["pinned_maps"],
            row["ct_entries"],
            row["stepguard_process_ms"],
            row["stepguard_checks_ms"],
            f(&row["minimal_loop_ms"]),
            f(&row["check_rss_mib"]),
            row["bpftool_ms"],
            f(&row["agent_steady_cpu_percent"]),
            f(&row["agent_steady_rss_mib"])
        ));
    }
    if let (Some(first), Some(last)) = (rows.first(), rows.last()) {
        let grow =
            |k: &str| last[k].as_f64().unwrap_or(0.0) / first[k].as_f64().unwrap_or(1.0).max(1e-9);
        let size = last["pods"].as_f64().unwrap_or(1.0) / first["pods"].as_f64().unwrap_or(1.0);
        r.push_str(&format!(
            "\nGrowth from the smallest to the largest size ({size:.0}x endpoints, maps and entries): stepguard checks {:.1}x, stepguard process {:.1}x, minimal loop {:.1}x, bpftool {:.1}x, agent RSS {:.1}x. Goal: linear (or better).\n",
            grow("stepguard_checks_ms"), grow("stepguard_process_ms"), grow("minimal_loop_ms"), grow("bpftool_ms"), grow("agent_steady_rss_mib")
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
                pods: 1000,
                ct_fill: 500_000,
            },
            Size {
                pods: 5000,
                ct_fill: 2_500_000,
            },
        ]
    };
    let devmaps = if want("devmaps") {
        devices_and_maps(&sizes, 5, quick)?
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
    let config = if want("config") {
        config_read(quick)?
    } else {
        Value::Null
    };
    let dir = root().join("target/bench");
    std::fs::create_dir_all(&dir)?;
    let all = json!({"devices_and_maps": devmaps, "daemon": daemon, "witness": witness, "config": config});
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
    if want("config") {
        text += &report_config(&config);
    }
    std::fs::write(dir.join("report.md"), &text)?;
    println!("\n{text}\nwritten to {}", dir.join("report.md").display());
    Ok(())
}
