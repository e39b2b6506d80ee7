//! `cargo xtask bench`: speed and memory measured, never asserted; written to
//! `target/bench/report.md` (and `.json`). Each measurement runs side by side with a reference
//! doing the same work in the same run, on the same lab.
mod config;
mod daemon;
mod devmaps;
mod fleet;
mod ratios;
mod witness;
use crate::root;
use anyhow::{bail, Context, Result};
use config::*;
use daemon::*;
use devmaps::*;
use fleet::*;
use ratios::*;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant};
use witness::*;

fn lab_bin() -> std::path::PathBuf {
    crate::buildcache::target_dir().join("release/stepguard-lab")
}
fn stepguard_bin() -> std::path::PathBuf {
    crate::buildcache::target_dir().join("release/stepguard")
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
    crate::buildcache::target_dir().join("release/benchref")
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

/// A process's CPU time in nanoseconds, exactly: the process is moved into a cpu-accounting
/// cgroup of its own (cgroup v1 `cpuacct`, or cgroup v2 `cpu.stat`), which also counts the
/// threads that exited (a runtime's blocking threads come and go). Where neither can be made,
/// `/proc/PID/stat` in clock ticks (10 ms each: ±20 ms per window, too coarse for the steady
/// figures, so the report says which was used).
struct CpuMeter {
    pid: u32,
    cgroup: Option<(std::path::PathBuf, bool)>,
}

impl CpuMeter {
    fn new(pid: u32) -> CpuMeter {
        let name = format!("stepguard-bench-{}-{pid}", std::process::id());
        for (root, v2) in [
            ("/sys/fs/cgroup/cpuacct", false),
            ("/sys/fs/cgroup/unified", true),
            ("/sys/fs/cgroup", true),
        ] {
            let dir = std::path::Path::new(root).join(&name);
            let usable = if v2 {
                std::path::Path::new(root)
                    .join("cgroup.controllers")
                    .exists()
            } else {
                std::path::Path::new(root).join("cpuacct.usage").exists()
            };
            if usable
                && std::fs::create_dir_all(&dir).is_ok()
                && std::fs::write(dir.join("cgroup.procs"), pid.to_string()).is_ok()
            {
                return CpuMeter {
                    pid,
                    cgroup: Some((dir, v2)),
                };
            }
            let _ = std::fs::remove_dir(&dir);
        }
        CpuMeter { pid, cgroup: None }
    }

    fn exact(&self) -> bool {
        self.cgroup.is_some()
    }

    /// CPU time so far, in nanoseconds.
    fn cpu_ns(&self) -> Result<u64> {
        match &self.cgroup {
            Some((dir, false)) => Ok(std::fs::read_to_string(dir.join("cpuacct.usage"))?
                .trim()
                .parse()?),
            Some((dir, true)) => std::fs::read_to_string(dir.join("cpu.stat"))?
                .lines()
                .find_map(|l| l.strip_prefix("usage_usec "))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map(|us| us * 1000)
                .context("cpu.stat has no usage_usec"),
            None => Ok(proc_usage(self.pid)?.0 * 10_000_000),
        }
    }
}

impl Drop for CpuMeter {
    fn drop(&mut self) {
        if let Some((dir, _)) = &self.cgroup {
            // Whatever is still in it goes back to the parent; then the cgroup is removed.
            let parent = dir.parent().map(|p| p.join("cgroup.procs"));
            if let (Ok(procs), Some(parent)) =
                (std::fs::read_to_string(dir.join("cgroup.procs")), parent)
            {
                for p in procs.lines() {
                    let _ = std::fs::write(&parent, p);
                }
            }
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// CPU share of one core and peak RSS over `window`.
fn measure(pid: u32, window: Duration) -> Result<(f64, u64)> {
    let meter = CpuMeter::new(pid);
    measure_with(&meter, window)
}

fn measure_with(meter: &CpuMeter, window: Duration) -> Result<(f64, u64)> {
    let pid = meter.pid;
    let (c0, mut peak) = (meter.cpu_ns()?, proc_usage(pid)?.1);
    let start = Instant::now();
    while start.elapsed() < window {
        std::thread::sleep(Duration::from_millis(500));
        peak = peak.max(proc_usage(pid)?.1);
    }
    let (c1, rss) = (meter.cpu_ns()?, proc_usage(pid)?.1);
    Ok((
        (c1 - c0) as f64 / 1e9 / start.elapsed().as_secs_f64() * 100.0,
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

pub fn bench(quick: bool, only: &[String], runs: usize) -> Result<()> {
    let runs = runs.max(1);
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
        daemon(quick, runs)?
    } else {
        Value::Null
    };
    let witness = if want("witness") {
        witness(quick, runs)?
    } else {
        Value::Null
    };
    let config = if want("config") {
        config_read(quick)?
    } else {
        Value::Null
    };
    let fleet = if want("fleet") {
        fleet(quick)?
    } else {
        Value::Null
    };
    let dir = root().join("target/bench");
    std::fs::create_dir_all(&dir)?;
    let all = json!({"devices_and_maps": devmaps, "daemon": daemon, "witness": witness, "config": config, "fleet": fleet});
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
    if want("fleet") {
        text += &report_fleet(&fleet);
    }
    std::fs::write(dir.join("report.md"), &text)?;
    println!("\n{text}\nwritten to {}", dir.join("report.md").display());
    Ok(())
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}
