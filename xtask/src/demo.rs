//! `cargo xtask demo`: a simulated node, the agent running in it, and a simulated
//! cilium-agent restart. Until the step protocol lands (issue 4) it shows what exists today —
//! the lab's recorded blackhole window, program IDs before/after, and the kernel drops the
//! agent counted — and says plainly that verdicts are not implemented yet.
use crate::root;
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn lab(args: &[&str]) -> Result<String> {
    let out = Command::new(root().join("target/debug/stepguard-lab"))
        .args(args)
        .output()
        .context("run stepguard-lab")?;
    if !out.status.success() {
        bail!(
            "stepguard-lab {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

struct Cleanup {
    prefix: String,
    children: Vec<Child>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        match lab(&["down", "--prefix", &self.prefix]) {
            Ok(_) => println!("\nlab {} removed", self.prefix),
            Err(e) => eprintln!("lab down failed: {e:#}"),
        }
    }
}

fn nsenter(ns: &str) -> Command {
    let mut c = Command::new("nsenter");
    c.arg(format!("--net=/run/netns/{ns}")).arg("--");
    c
}

fn scrape(ns: &str, port: u16) -> Result<String> {
    let out = nsenter(ns)
        .args([
            "curl",
            "-s",
            "-m",
            "2",
            &format!("http://127.0.0.1:{port}/metrics"),
        ])
        .output()?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn drops(metrics: &str) -> std::collections::BTreeMap<String, f64> {
    metrics
        .lines()
        .filter_map(|l| l.strip_prefix("stepguard_kernel_drops_total{reason=\""))
        .filter_map(|l| {
            l.split_once("\"} ")
                .and_then(|(r, v)| v.parse().ok().map(|v| (r.to_string(), v)))
        })
        .collect()
}

fn restart(prefix: &str, ns: &str, extra: &[&str]) -> Result<Value> {
    // Some traffic to the gateway VIP while the datapath restarts, so there is something to drop.
    let mut ping = nsenter(ns)
        .args([
            "ping",
            "-q",
            "-i",
            "0.01",
            "-c",
            "150",
            "-W",
            "0.05",
            "198.51.100.10",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    std::thread::sleep(Duration::from_millis(200));
    let mut args = vec!["restart", "--prefix", prefix];
    args.extend_from_slice(extra);
    let report: Value = serde_json::from_str(&lab(&args)?)?;
    let _ = ping.wait();
    Ok(report)
}

fn print_report(r: &Value) {
    let start = r["blackhole_start_ns"].as_u64().unwrap_or(0);
    let end = r["blackhole_end_ns"].as_u64().unwrap_or(0);
    println!(
        "  blackhole (recorded by the lab): {:.1} ms",
        (end.saturating_sub(start)) as f64 / 1e6
    );
    let empty = vec![];
    let old = r["old_programs"].as_array().unwrap_or(&empty);
    let new = r["new_programs"].as_array().unwrap_or(&empty);
    for o in old.iter().filter(|o| o["program"] == "cil_from_netdev") {
        let n = new
            .iter()
            .find(|n| n["device"] == o["device"] && n["program"] == o["program"]);
        match n {
            Some(n) => println!(
                "  {:<6} cil_from_netdev  prog id {} -> {}",
                o["device"].as_str().unwrap_or(""),
                o["prog_id"],
                n["prog_id"]
            ),
            None => println!(
                "  {:<6} cil_from_netdev  prog id {} -> (not attached any more)",
                o["device"].as_str().unwrap_or(""),
                o["prog_id"]
            ),
        }
    }
}

pub fn demo() -> Result<()> {
    let t0 = Instant::now();
    let prefix = format!("sgdemo{}", std::process::id() % 100000);
    println!("== 1. a simulated Cilium 1.18 node (tcx), lab {prefix}");
    print!("{}", lab(&["up", "--prefix", &prefix])?);
    let mut cleanup = Cleanup {
        prefix: prefix.clone(),
        children: vec![],
    };
    let status: Value =
        serde_json::from_str(&lab(&["status", "--prefix", &prefix, "--format", "json"])?)?;
    let ns = status["node_netns"]
        .as_str()
        .context("node_netns")?
        .to_string();

    println!("\n== 2. stepguard agent in the node namespace");
    let port = 19969;
    let agent = nsenter(&ns)
        .arg(root().join("target/debug/stepguard"))
        .args(["agent", "--listen", &format!("127.0.0.1:{port}")])
        .stderr(Stdio::inherit())
        .spawn()
        .context("start stepguard agent")?;
    cleanup.children.push(agent);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !scrape(&ns, port)?.contains("stepguard_build_info") {
        if Instant::now() > deadline {
            bail!("the agent did not answer on 127.0.0.1:{port}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let before = drops(&scrape(&ns, port)?);

    println!(
        "\n== 3. cilium-agent restart with a 300 ms gap (traffic to the gateway VIP meanwhile)"
    );
    let r = restart(&prefix, &ns, &["--gap", "300ms"])?;
    print_report(&r);
    let after = drops(&scrape(&ns, port)?);
    println!("  kernel drops the agent counted during the restart (stepguard_kernel_drops_total):");
    for (reason, v) in &after {
        let d = v - before.get(reason).copied().unwrap_or(0.0);
        if d > 0.0 {
            println!("    {reason:<24} +{d}");
        }
    }

    println!("\n== 4. a faulty restart: the new datapath no longer attaches to eth1");
    let r = restart(&prefix, &ns, &["--gap", "100ms", "--drop-device", "eth1"])?;
    print_report(&r);

    println!("\n== verdicts");
    println!("  not yet implemented: the step protocol (pass/fail, measured gaps per VIP) arrives with the agent daemon (issue 4).");
    println!("  demo took {:.1} s", t0.elapsed().as_secs_f64());
    drop(cleanup);
    Ok(())
}
