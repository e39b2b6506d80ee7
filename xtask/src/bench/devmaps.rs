//! Devices and maps: `stepguard check --only devices,maps` against `benchref observe` and
//! bpftool on labs of growing size.
use super::*;

pub(super) fn devices_and_maps(sizes: &[Size], runs: usize, quick: bool) -> Result<Value> {
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

pub(super) fn report(devmaps: &Value) -> String {
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
