//! The witness on the LAN lab: its probes in a step, and its measured gaps against the
//! lab's ground truth.
use super::*;

/// `stepguard witness` in a LAN lab: CPU and RSS with 10 targets at 1 s and during a step at
/// 10 ms, and the LAN gap it measures across lease moves with Cilium's default lease timings
/// (15 s / 5 s / 2 s; `--quick`: 2 s / 1 s / 500 ms), against the lab's ground truth.
pub(super) fn witness(quick: bool, runs: usize) -> Result<Value> {
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
    // During a step, against a minimal loop of the witness's own probes at the same cadence
    // from the same namespace, `runs` times.
    let refs = [
        vec!["http:203.0.113.200:80/healthz"; 4],
        vec!["tcp:203.0.113.200:80"; 3],
        vec![
            "dns:203.0.113.53:53:gateway.lab.stepguard.test",
            "dns:203.0.113.54:53:gateway.lab.stepguard.test",
        ],
        vec!["icmp:203.0.113.200"],
    ]
    .concat();
    let bwin = window / 2;
    let bwin_s = bwin.as_secs().to_string();
    let mut args = vec!["probes", "--interval", "10ms", "--seconds", &bwin_s];
    args.extend(&refs);
    let (mut in_step, mut rss) = (Series::default(), Vec::new());
    for run in 1..=runs {
        let id = format!("bench-burst-{run}");
        post(&id)?;
        println!(
            "bench: witness during a step (10 targets at 10 ms) for {}s, then its minimal loop, run {run} of {runs}",
            bwin.as_secs()
        );
        let (cpu, r) = measure(pid, bwin)?;
        curl(
            &client,
            &["-X", "DELETE", &format!("http://{addr}/v1/steps/{id}")],
        )?;
        let reference = benchref(&client, &args)?;
        println!(
            "  CPU {cpu:.2}% of a core, RSS {:.1} MiB; minimal loop {:.2}%",
            r as f64 / 1024.0,
            f(&reference["cpu_percent"])
        );
        in_step.push(cpu, f(&reference["cpu_percent"]));
        rss.push(r as f64 / 1024.0);
    }

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
        "burst": {"cpu": in_step.json(), "rss_mib": rss, "median_rss_mib": median_of(&rss)},
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

pub(super) fn report_witness(w: &Value) -> String {
    let mut r = format!(
        "\n## witness\n\n`stepguard witness` in the LAN lab's client namespace, 10 targets (4 http, 3 tcp, 2 dns, 1 icmp); lease timings {} / {} / {}.\n\n| measurement | figure | target |\n|---|---:|---|\n",
        w["lease"]["duration"].as_str().unwrap_or("?"),
        w["lease"]["renew"].as_str().unwrap_or("?"),
        w["lease"]["retry"].as_str().unwrap_or("?")
    );
    r.push_str(&format!(
        "| RSS steady (1 s) | {:.1} MiB | < 20 MiB |\n| CPU steady | {:.2} % of a core | < 1 % |\n| RSS during a step (10 ms), median | {:.1} MiB | < 20 MiB |\n| CPU during a step, median | {:.2} % of a core | < 5 % |\n",
        w["steady"]["rss_mib"].as_f64().unwrap_or(0.0),
        w["steady"]["cpu_percent"].as_f64().unwrap_or(0.0),
        w["burst"]["median_rss_mib"].as_f64().unwrap_or(0.0),
        w["burst"]["cpu"]["median_agent"].as_f64().unwrap_or(0.0)
    ));
    r.push_str("\n| cost | witness: median (runs) | minimal loop of its probes: median (runs) | ratio: median (runs) | goal |\n|---|---:|---:|---:|---|\n");
    r.push_str(&ratio_row(
        "CPU during a step (10 targets at 10 ms), % of a core",
        &w["burst"]["cpu"],
        "%",
        "≤ 1.2×",
    ));
    r.push_str("\n| lease move | figure | target |\n|---|---:|---|\n");
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
