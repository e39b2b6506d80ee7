//! The agent daemon on a big node: steady, `/metrics` under load, burst, per-kind probe
//! costs, send delays while checks run, gap accuracy; beside the minimal loop and fping.
use super::*;

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

pub(super) fn daemon(quick: bool) -> Result<Value> {
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

pub(super) fn report_daemon(d: &Value) -> String {
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
