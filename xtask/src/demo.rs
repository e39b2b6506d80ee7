//! `cargo xtask demo`: a simulated node, the stepguard agent in it, and steps around simulated
//! cilium-agent restarts: a healthy one, one with a measured outage, and a faulty one (a device
//! left without the datapath) that fails with its reason; then a two-node LAN with
//! L2-announced VIPs, where a witness on the LAN measures the lease move that the lease
//! holder's own probes cannot see.
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn lab(args: &[&str]) -> Result<String> {
    let out = Command::new(crate::buildcache::target_dir().join("debug/stepguard-lab"))
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

fn stepguard(ns: &str, args: &[&str]) -> Result<(i32, String)> {
    let out = nsenter(ns)
        .arg(crate::buildcache::target_dir().join("debug/stepguard"))
        .args(args)
        .output()
        .context("run stepguard")?;
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    Ok((out.status.code().unwrap_or(-1), text))
}

/// One step: begin, restart the lab's datapath, wait for the verdict.
fn step_around_restart(prefix: &str, ns: &str, agent: &str, restart_args: &[&str]) -> Result<i32> {
    let (code, out) = stepguard(
        ns,
        &[
            "step",
            "--agent",
            agent,
            "--settle",
            "3s",
            "--timeout",
            "30s",
        ],
    )?;
    if code != 0 {
        bail!("stepguard step failed: {out}");
    }
    let id = out.lines().last().unwrap_or("").trim().to_string();
    println!("  stepguard step  -> {id}");
    std::thread::sleep(Duration::from_millis(300));
    let mut args = vec!["restart", "--prefix", prefix];
    args.extend_from_slice(restart_args);
    let r: Value = serde_json::from_str(&lab(&args)?)?;
    let window = (r["blackhole_end_ns"]
        .as_u64()
        .unwrap_or(0)
        .saturating_sub(r["blackhole_start_ns"].as_u64().unwrap_or(0))) as f64
        / 1e6;
    if r["blackhole"].as_bool().unwrap_or(false) {
        println!(
            "  lab restart {}  (the lab recorded a {window:.1} ms blackhole)",
            restart_args.join(" ")
        );
    } else {
        println!(
            "  lab restart {}  (agent down {window:.1} ms; the old programs kept forwarding, as Cilium's do)",
            restart_args.join(" ")
        );
    }
    let (code, out) = stepguard(
        ns,
        &["wait", "--agent", agent, "--step", &id, "--timeout", "60s"],
    )?;
    println!("  stepguard wait  -> exit {code}\n");
    for l in out.lines() {
        println!("    {l}");
    }
    Ok(code)
}

/// Part two: a LAN of two nodes with L2-announced VIPs (short leases), a witness in the LAN
/// client namespace, and a step on the lease holder whose datapath is down for 1.5 s.
fn lan_demo(prefix: &str) -> Result<i32> {
    println!("\n== 6. a LAN: two nodes with L2-announced VIPs (gateway, dns-a on node 0; dns-b on node 1), lab {prefix}");
    let status: Value = serde_json::from_str(&lab(&[
        "up",
        "--prefix",
        prefix,
        "--nodes",
        "2",
        "--lease-duration",
        "2s",
        "--lease-renew",
        "1s",
        "--lease-retry",
        "500ms",
    ])?)?;
    let mut cleanup = Cleanup {
        prefix: prefix.to_string(),
        children: vec![],
    };
    let client = status["client_netns"]
        .as_str()
        .context("client_netns")?
        .to_string();
    let node_ns = status["nodes"][0]["netns"]
        .as_str()
        .context("node netns")?
        .to_string();
    let node_cfg = status["nodes"][0]["stepguard_config"]
        .as_str()
        .context("node config")?
        .to_string();
    let witness_url = format!(
        "http://{}:9310",
        status["client_address"].as_str().unwrap_or("203.0.113.100")
    );
    println!("   stepguard witness in the LAN client namespace ({witness_url}); the agent on node 0 (the lease holder)");
    let w = nsenter(&client)
        .arg(crate::buildcache::target_dir().join("debug/stepguard"))
        .args([
            "witness",
            // The demo's agents run without a token; a real witness has one
            // (deploy/witness/stepguard-witness.service).
            "--allow-unauthenticated",
            "--config",
            status["witness_config"]
                .as_str()
                .context("witness_config")?,
            "--listen",
            witness_url.trim_start_matches("http://"),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("start stepguard witness")?;
    cleanup.children.push(w);
    let a = nsenter(&node_ns)
        .arg(crate::buildcache::target_dir().join("debug/stepguard"))
        .args([
            "agent",
            "--config",
            &node_cfg,
            "--state-dir",
            &format!("/run/stepguard-lab/{prefix}/agent-state"),
            "--listen",
            "127.0.0.1:19969",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("start stepguard agent")?;
    cleanup.children.push(a);
    let agent_url = "http://127.0.0.1:19969";
    let deadline = Instant::now() + Duration::from_secs(20);
    let id = loop {
        let (code, out) = stepguard(
            &node_ns,
            &[
                "step",
                "--agent",
                agent_url,
                "--settle",
                "2s",
                "--timeout",
                "30s",
                "--witness",
                &witness_url,
            ],
        )?;
        if code == 0 {
            break out.lines().last().unwrap_or("").trim().to_string();
        }
        if Instant::now() > deadline {
            bail!("could not begin the LAN step: {out}");
        }
        std::thread::sleep(Duration::from_millis(300));
    };
    println!("   stepguard step --witness {witness_url}  -> {id}");
    std::thread::sleep(Duration::from_millis(500));
    let r: Value = serde_json::from_str(&lab(&[
        "restart",
        "--prefix",
        prefix,
        "--node",
        "0",
        "--down",
        "1500ms",
        "--blackhole",
    ])?)?;
    for v in r["vips"].as_array().into_iter().flatten() {
        if let (Some(s), Some(e)) = (v["stopped"][0].as_u64(), v["resumed"][0].as_u64()) {
            println!(
                "   lab: {} moved from node {} to node {}; LAN clients lost it for {:.0} ms (ground truth)",
                v["name"].as_str().unwrap_or("?"),
                v["holder_before"],
                v["holder_after"],
                (e.saturating_sub(s)) as f64 / 1e6
            );
        }
    }
    let (code, out) = stepguard(
        &node_ns,
        &[
            "wait",
            "--agent",
            agent_url,
            "--step",
            &id,
            "--timeout",
            "60s",
        ],
    )?;
    println!("   stepguard wait  -> exit {code}\n");
    for l in out.lines() {
        println!("    {l}");
    }
    drop(cleanup);
    Ok(code)
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
    let cfg = status["stepguard_config"]
        .as_str()
        .context("stepguard_config")?
        .to_string();
    let state = format!("/run/stepguard-lab/{prefix}/agent-state");

    println!("\n== 2. stepguard agent in the node namespace (probes every 1s, 10ms during a step)");
    let port = 19969;
    let agent_url = format!("http://127.0.0.1:{port}");
    let agent = nsenter(&ns)
        .arg(crate::buildcache::target_dir().join("debug/stepguard"))
        .args([
            "agent",
            "--config",
            &cfg,
            "--state-dir",
            &state,
            "--listen",
            &format!("127.0.0.1:{port}"),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("start stepguard agent")?;
    cleanup.children.push(agent);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = nsenter(&ns)
            .args([
                "curl",
                "-s",
                "-m",
                "2",
                &format!("{agent_url}/v1/verdict?format=text"),
            ])
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if text.starts_with("node")
            && !text.contains("not checked yet")
            && !text.contains("not probed yet")
            && !text.contains("no DNS query")
        {
            println!("  curl {agent_url}/v1/verdict?format=text");
            for l in text.lines().take(8) {
                println!("    {l}");
            }
            break;
        }
        if Instant::now() > deadline {
            bail!("the agent did not report a verdict on {agent_url}");
        }
        std::thread::sleep(Duration::from_millis(250));
    }

    println!("\n== 3. a step around a healthy cilium-agent restart (agent down 300 ms)");
    let healthy = step_around_restart(&prefix, &ns, &agent_url, &["--down", "300ms"])?;

    println!(
        "== 4. a step around a restart that broke traffic for 300 ms (the lab's --blackhole fault)"
    );
    let first = step_around_restart(
        &prefix,
        &ns,
        &agent_url,
        &["--down", "300ms", "--blackhole"],
    )?;

    println!("== 5. a step around a faulty restart: the new datapath no longer attaches to eth1");
    let second = step_around_restart(
        &prefix,
        &ns,
        &agent_url,
        &["--down", "100ms", "--drop-device", "eth1"],
    )?;

    println!("== the metrics a Prometheus would scrape (excerpt)");
    let m = scrape(&ns, port)?;
    for l in m.lines().filter(|l| {
        l.starts_with("stepguard_last_step_gap_seconds")
            || l.starts_with("stepguard_steps_total")
            || l.starts_with("stepguard_cilium_drops_total")
    }) {
        println!("    {l}");
    }
    drop(cleanup);

    let lan_exit = lan_demo(&format!("sgdl{}", std::process::id() % 100000))?;
    println!("\ndemo took {:.1} s; step exits: healthy {healthy}, 300 ms outage {first} (0 = passed), dropped device {second} (1 = failed), lease holder with a witness {lan_exit} (0 = passed)", t0.elapsed().as_secs_f64());
    if healthy != 0 || first != 0 || second != 1 || lan_exit != 0 {
        bail!("the demo's steps did not end as expected (the first two should pass, the third fail, the LAN step pass)");
    }
    Ok(())
}
