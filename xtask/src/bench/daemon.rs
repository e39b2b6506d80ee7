//! The agent daemon on a big node: steady, `/metrics` under load, burst, per-kind probe
//! costs, send delays while checks run, gap accuracy; beside the minimal loop and fping.
use super::*;

/// Opens step `id` on the agent at `url` (10 min timeout, 5 s settle): its probes burst.
fn open_step(ns: &str, url: &str, id: &str) -> Result<()> {
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
    Ok(())
}

/// One step at `cadence` open for `window`: CPU, RSS, probes sent, µs per probe.
fn burst(ns: &str, url: &str, pid: u32, id: &str, window: Duration) -> Result<Value> {
    open_step(ns, url, id)?;
    std::thread::sleep(Duration::from_secs(2));
    let m0 = curl(ns, &[&format!("{url}/metrics")])?;
    // The probe engine's thread alone (kernel names it from "stepguard-probes"): the part of
    // the agent doing what the minimal loop does; the rest is the step runner observing the
    // node, deciding and persisting, and the runtime.
    let p0 = (thread_cpu_ns(pid, "stepguard-probe"), Instant::now());
    let perf = perf_profile(pid, id, window)?;
    let (cpu, rss) = measure(pid, window)?;
    if let Some(mut p) = perf {
        let _ = p.wait();
    }
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

/// With `STEPGUARD_BENCH_PERF=DIR`, a `perf record` of the agent's threads for the window
/// into `DIR/<id>.data` (it costs the agent a little: a profile, not a figure to report). Read
/// it with `perf report -i DIR/<id>.data --sort comm,dso,sym`.
fn perf_profile(pid: u32, id: &str, window: Duration) -> Result<Option<std::process::Child>> {
    let Some(dir) = std::env::var_os("STEPGUARD_BENCH_PERF") else {
        return Ok(None);
    };
    std::fs::create_dir_all(&dir)?;
    let out = std::path::Path::new(&dir).join(format!("{id}.data"));
    println!("  perf record of pid {pid} into {}", out.display());
    Ok(Some(
        Command::new("perf")
            .args(["record", "-q", "-F", "1999", "-p", &pid.to_string(), "-o"])
            .arg(&out)
            .args(["--", "sleep", &window.as_secs().to_string()])
            .stdout(std::process::Stdio::null())
            .spawn()
            .context("start perf record (Debian's linux-perf)")?,
    ))
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

pub(super) fn daemon(quick: bool, runs: usize) -> Result<Value> {
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
    let steady_win = Duration::from_secs(if quick { 15 } else { 40 });
    let bwin = Duration::from_secs(if quick { 8 } else { 20 });
    let bwin_s = bwin.as_secs().to_string();
    let exact = CpuMeter::new(pid).exact();

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
    let rps = wrk_out
        .lines()
        .find(|l| l.starts_with("Requests/sec"))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or("?")
        .to_string();
    println!(
        "  p50 {}, p99 {}, {rps} requests/s",
        p50_str(&wrk_out, "50%"),
        p50_str(&wrk_out, "99%")
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

    // The maps the steady agent counts (it exports their entries) and the drop counters it
    // reads: what the steady minimal loop counts too.
    let metrics = curl(&ns, &[&format!("{url}/metrics")])?;
    let mut counted: Vec<String> = metrics
        .lines()
        .filter_map(|l| l.strip_prefix("stepguard_bpf_map_entries{map=\""))
        .filter_map(|r| r.split('"').next())
        .map(str::to_string)
        .collect();
    counted.push("cilium_metrics".into());
    counted.sort();
    counted.dedup();
    let counted = counted.join(",");
    let bpffs = run_dir.join("bpffs").display().to_string();
    let steady_s = steady_win.as_secs().to_string();
    let mut steady_args = vec![
        "probes",
        "--interval",
        "1s",
        "--seconds",
        &steady_s,
        "--observe",
        &bpffs,
        "--count",
        &counted,
        "--watch",
    ];
    steady_args.extend(&refs);
    // The three resolvers' steady queries: `dns.burst` (5) each a second.
    steady_args.extend(std::iter::repeat_n(
        "dns:198.51.100.53:53:gateway.lab.stepguard.test",
        15,
    ));
    let mut burst_args = vec!["probes", "--interval", "10ms", "--seconds", &bwin_s];
    burst_args.extend(&refs);

    let critical_sets = critical_sets();
    let (mut steady, mut burst_s, mut rss, mut steady_rss) = (
        Series::default(),
        Series::default(),
        Vec::<f64>::new(),
        Vec::<f64>::new(),
    );
    let mut crit: Vec<Series> = critical_sets.iter().map(|_| Series::default()).collect();
    let mut burst_runs = Vec::new();
    for run in 1..=runs {
        println!(
            "bench: ratios, run {run} of {runs}: steady ({}s each), burst and critical ({bwin_s}s each), agent then its minimal loop",
            steady_win.as_secs()
        );
        let (cpu, srss) = measure(pid, steady_win)?;
        steady_rss.push(srss as f64 / 1024.0);
        let r = benchref(&ns, &steady_args)?;
        steady.push(cpu, f(&r["cpu_percent"]));
        println!(
            "  steady: agent {cpu:.3}%, minimal loop (probes, resolvers, {} observations, the watcher) {:.3}%",
            r["observations"],
            f(&r["cpu_percent"])
        );
        let b = burst(&ns, &url, pid, &format!("bench-burst-{run}"), bwin)?;
        let r = benchref(&ns, &burst_args)?;
        burst_s.push(f(&b["cpu_percent"]), f(&r["cpu_percent"]));
        rss.push(f(&b["rss_mib"]));
        println!(
            "  burst: agent {:.2}% (probe thread {:.2}%, RSS {:.1} MiB), minimal loop {:.2}%",
            f(&b["cpu_percent"]),
            f(&b["probe_thread_cpu_percent"]),
            f(&b["rss_mib"]),
            f(&r["cpu_percent"])
        );
        burst_runs.push(json!({"agent": b, "minimal_loop": r}));
        for ((set, yaml, crefs), series) in critical_sets.iter().zip(crit.iter_mut()) {
            let c = bench_config(&run_dir, "bench-critical.yaml", yaml)?;
            let p = port + 2;
            let a = start_agent(&ns, &c, &run_dir, p)?;
            std::thread::sleep(Duration::from_secs(5));
            let b = burst(
                &ns,
                &format!("http://127.0.0.1:{p}"),
                a.0.id(),
                "bench-crit",
                bwin,
            )?;
            // One prober at a time: the agent stopped before its reference.
            drop(a);
            let mut args = vec!["probes", "--interval", "1ms", "--seconds", &bwin_s];
            args.extend(crefs);
            let r = benchref(&ns, &args)?;
            series.push(f(&b["cpu_percent"]), f(&r["cpu_percent"]));
            println!(
                "  critical ({set}): agent {:.2}% (probe thread {:.2}%), minimal loop {:.2}%",
                f(&b["cpu_percent"]),
                f(&b["probe_thread_cpu_percent"]),
                f(&r["cpu_percent"])
            );
        }
    }

    // Probe send delay against the minimal loop's wake-up lateness, both under the load of a
    // real restart.
    println!("bench: probe send delay under load, {runs} runs of {bwin_s}s each");
    let mut load = Load::real_or_spin();
    let load_said = load.describe();
    println!("  load: {load_said}");
    let mut delay = Series::default();
    let mut delay_runs = Vec::new();
    for run in 1..=runs {
        load.on()?;
        let id = format!("bench-delay-{run}");
        open_step(&ns, &url, &id)?;
        std::thread::sleep(Duration::from_secs(1));
        let name = "stepguard_probe_send_delay_seconds";
        let restarts0 = load.restarts();
        let m0 = curl(&ns, &[&format!("{url}/metrics")])?;
        std::thread::sleep(bwin);
        let m1 = curl(&ns, &[&format!("{url}/metrics")])?;
        curl(&ns, &["-X", "DELETE", &format!("{url}/v1/steps/{id}")])?;
        let d = bucket_delta(&buckets(&m0, name), &buckets(&m1, name));
        let agent_p99 = histogram_quantile(&d, 0.99) * 1e3;
        let r = benchref(&ns, &burst_args)?;
        let restarts1 = load.restarts();
        load.off();
        let ref_p99 = histogram_quantile(&late_buckets(&r), 0.99) * 1e3;
        delay.push(agent_p99, ref_p99);
        let sends = d.last().map_or(0.0, |x| x.1);
        println!(
            "  run {run}: {sends:.0} sends, send delay p99 {agent_p99:.3} ms; minimal loop's wake-up lateness p99 {ref_p99:.3} ms (exact: {:.3} ms){}",
            f(&r["late_p99_us"]) / 1e3,
            match (restarts0, restarts1) {
                (Some(a), Some(b)) => format!("; real agent restarts completed meanwhile: {}", b - a),
                _ => String::new(),
            }
        );
        delay_runs.push(json!({"sends": sends, "agent_p99_ms": agent_p99, "minimal_loop_late_p99_ms": ref_p99,
            "minimal_loop_late_p99_exact_ms": f(&r["late_p99_us"]) / 1e3, "agent_buckets": d.iter().map(|x| x.1).collect::<Vec<_>>()}));
    }
    drop(load);
    // After the ratios: each finished step stays in the agent's memory (up to
    // `KEEP_STEPS`), so the figures above are of an agent with no step behind it yet.
    let reps = if quick { 5 } else { 20 };
    println!(
        "bench: gap accuracy at the default 10 ms cadence over {reps} restarts with a 300 ms gap"
    );
    let acc = gap_accuracy(&ns, &url, &prefix, reps, "acc")?;
    let after_steps = proc_usage(pid)?.1 as f64 / 1024.0;
    println!("  the agent's RSS after {reps} more steps: {after_steps:.1} MiB");
    drop(agent);

    // Gap accuracy of the critical targets (once).
    let mut critical = serde_json::Map::new();
    for ((set, yaml, _), series) in critical_sets.iter().zip(&crit) {
        let c = bench_config(&run_dir, "bench-critical.yaml", yaml)?;
        let p = port + 2;
        let a = start_agent(&ns, &c, &run_dir, p)?;
        std::thread::sleep(Duration::from_secs(5));
        let u = format!("http://127.0.0.1:{p}");
        println!("bench: critical targets at 1 ms ({set}): gap accuracy");
        let acc = gap_accuracy(&ns, &u, &prefix, if quick { 3 } else { 10 }, "crit")?;
        drop(a);
        critical.insert(
            set.to_string(),
            json!({"cpu": series.json(), "gap_accuracy": acc}),
        );
    }

    Ok(json!({
        "node": {"endpoints": pods, "pinned_maps": pinned, "ct_entries": ct},
        "runs": runs, "cpu_exact": exact,
        "windows_s": {"steady": steady_win.as_secs(), "burst": bwin.as_secs()},
        "steady": steady.json(), "steady_rss_mib": steady_rss, "median_steady_rss_mib": median_of(&steady_rss),
        "burst": {"cpu": burst_s.json(), "rss_mib": rss, "median_rss_mib": median_of(&rss), "runs": burst_runs,
                  "minimal_us_per_probe_by_kind": per_kind,
                  "icmp": {"agent_us_per_echo": icmp_agent["us_per_probe"], "agent_cpu_percent": icmp_agent["cpu_percent"], "minimal_us_per_echo": per_kind["icmp"], "fping_us_per_echo": fping_us, "fping_cpu_percent": fping_cpu, "fping_echoes_per_s": fping_rate}},
        "send_delay": {"load": load_said, "p99_ms": delay.json(), "runs": delay_runs},
        "metrics_under_load": {"p50": p50_str(&wrk_out, "50%"), "p99": p50_str(&wrk_out, "99%"), "requests_per_s": rps},
        "gap_accuracy": acc, "rss_after_accuracy_steps_mib": after_steps,
        "critical": critical,
    }))
}

/// The two sets of critical targets (4 each, at 1 ms): yaml, and `benchref` targets.
fn critical_sets() -> Vec<(&'static str, String, Vec<&'static str>)> {
    vec![
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
    ]
}

fn p50_str(wrk: &str, label: &str) -> String {
    wrk.lines()
        .find(|l| l.trim_start().starts_with(label))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or("?")
        .to_string()
}

pub(super) fn report_daemon(d: &Value) -> String {
    let n = &d["node"];
    let mut r = format!(
        "\n## agent daemon on a big node\n\nLab node with {} endpoints (lxc veths, each in its own namespace), {} pinned maps, {} conntrack entries; release build; 10 VIP targets (4 http, 3 tcp, 2 dns, 1 icmp), 3 resolvers. References run in the same lab in the same run: `benchref` (the same syscalls in a minimal loop, no runtime: the physical limit) and `fping`.\n\n",
        n["endpoints"], n["pinned_maps"], n["ct_entries"]
    );
    r.push_str(&format!(
        "### Against the minimal loop: the median of {} runs\n\nEach run measures the agent, then its reference, back to back; the ratio is taken per run and the median of the runs' ratios reported (each run's figure in brackets). Windows: steady {} s, the others {} s. CPU {}.\n\n",
        d["runs"],
        d["windows_s"]["steady"],
        d["windows_s"]["burst"],
        if d["cpu_exact"].as_bool() == Some(true) {
            "from the agent's own cpu-accounting cgroup (nanoseconds, exited threads included); the minimal loop's from getrusage"
        } else {
            "in clock ticks (no cpu-accounting cgroup could be made: ±20 ms per window)"
        }
    ));
    r.push_str("| cost | stepguard: median (runs) | minimal loop: median (runs) | ratio: median (runs) | goal |\n|---|---:|---:|---:|---|\n");
    r.push_str(&ratio_row(
        "CPU burst (a step open, 10 targets at 10 ms), % of a core",
        &d["burst"]["cpu"],
        "%",
        "≤ 1.2×",
    ));
    if let Some(c) = d["critical"].as_object() {
        for (set, v) in c {
            r.push_str(&ratio_row(
                &format!("CPU, critical targets at 1 ms ({set})"),
                &v["cpu"],
                "%",
                "≤ 1.2×",
            ));
        }
    }
    r.push_str(&ratio_row(
        "CPU steady (probes at 1 s, 3 resolvers × 5 queries a second, node checks every 10 s; the loop makes the same observation: every device's and endpoint's programs, every pin opened, the counted maps' entries, the watcher's program-id query)",
        &d["steady"],
        "%",
        "≤ 1.5×",
    ));
    let sd = &d["send_delay"];
    r.push_str(&ratio_row(
        &format!(
            "probe send delay p99 (a step open, 10 targets at 10 ms) against the loop's wake-up lateness p99, under load: {}",
            sd["load"].as_str().unwrap_or("?")
        ),
        &sd["p99_ms"],
        "ms",
        "≤ 1.2×",
    ));
    let steady_cpu = d["steady"]["median_agent"].as_f64().unwrap_or(f64::NAN);
    let rss = d["burst"]["median_rss_mib"].as_f64().unwrap_or(f64::NAN);
    r.push_str(&format!(
        "\n| absolute | stepguard: median (runs) | goal |\n|---|---:|---|\n| CPU steady | {steady_cpu:.3} % of a core ({}) | ≤ 0.25 % {} |\n| RSS burst | {rss:.1} MiB ({}) | ≤ 16 MiB {} |\n| RSS steady | {:.1} MiB | — |\n| RSS after the gap-accuracy steps (finished steps are kept in memory) | {:.1} MiB | — |\n",
        each(&d["steady"], "agent"),
        if steady_cpu <= 0.25 { "✓" } else { "missed" },
        d["burst"]["rss_mib"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|v| format!("{:.1}", f(v)))
            .collect::<Vec<_>>()
            .join(" / "),
        if rss <= 16.0 { "✓" } else { "missed" },
        f(&d["median_steady_rss_mib"]),
        f(&d["rss_after_accuracy_steps_mib"]),
    ));
    r.push_str("\n### Once per bench\n\n| measurement | stepguard | reference | goal |\n|---|---:|---:|---|\n");
    let b = &d["burst"];
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
            if let Some(acc) = v["gap_accuracy"].as_object() {
                for (t, a) in acc {
                    r.push_str(&format!("| critical ({set}), gap error, {t} ({} runs) | mean {:.1} ms, worst {:.1} ms | lab's recorded window | ≤ 1 ms + 2 ms |\n", a["runs"], f(&a["mean_error_ms"]), f(&a["worst_error_ms"])));
                }
            }
        }
    }
    r
}
