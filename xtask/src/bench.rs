//! `cargo xtask bench`: speed and memory measured, never asserted; written to
//! `target/bench/report.md` (and `.json`). Each measurement runs side by side with a reference
//! doing the same work in the same run, on the same lab.
use crate::root;
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
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
    let dir = root().join("target/bench");
    std::fs::create_dir_all(&dir)?;
    let all = json!({"devices_and_maps": devmaps});
    std::fs::write(dir.join("report.json"), serde_json::to_vec_pretty(&all)?)?;
    let text = report(&devmaps);
    std::fs::write(dir.join("report.md"), &text)?;
    println!("\n{text}\nwritten to {}", dir.join("report.md").display());
    Ok(())
}
