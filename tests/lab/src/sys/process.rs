//! The processes the lab starts: servers run detached (own session) so they outlive the
//! `lab up` process, identified beyond pid reuse by their start time and stopped by it; and
//! waiting until something started is ready.
use crate::sys::netns::netns_path;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A process the lab started, identified beyond pid reuse by its start time.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Proc {
    pub what: String,
    pub pid: i32,
    pub start_ticks: u64,
}

/// Field 22 of /proc/PID/stat: start time in clock ticks since boot.
pub fn start_ticks(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 2..];
    after.split_whitespace().nth(19)?.parse().ok()
}

pub fn spawn_in(ns: &str, what: &str, program: &str, args: &[String], log: &Path) -> Result<Proc> {
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net={}", netns_path(ns).display()))
        .arg("--")
        .arg(program)
        .args(args);
    // nsenter execs the server in place: the pid is the server's.
    spawn_detached(cmd, what, log)
}

/// Runs a lab server and its child processes (nginx's workers) under `SCHED_RR` priority 1:
/// the real-agent lab's fabric stands for **other machines** (the LAN's gateway and DNS), which
/// a node's restart does not slow. On the lab's two cores they share the CPU with the restarting
/// cilium-agent's clang jobs and the control plane: measured in the real-agent rollout, dnsmasq
/// answered queries that had reached it on time (pcap on both ends of the veth) in batches up to
/// 0.6 s late, and stepguard rightly reported 0.6–2.5 s gaps of a datapath that had none. They
/// use little CPU (a probe every 10 ms at most), and the kernel's RT throttling bounds them.
pub fn realtime(p: &Proc) -> Result<()> {
    let mut pids = vec![p.pid];
    let tasks = format!("/proc/{}/task", p.pid);
    for t in std::fs::read_dir(&tasks)
        .with_context(|| format!("read {tasks}"))?
        .flatten()
    {
        let children = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
        pids.extend(
            children
                .split_whitespace()
                .filter_map(|c| c.parse::<i32>().ok()),
        );
    }
    for pid in pids {
        let param = libc::sched_param { sched_priority: 1 };
        // SAFETY: sched_setscheduler on a pid with a valid parameter struct.
        if unsafe { libc::sched_setscheduler(pid, libc::SCHED_RR, &param) } != 0 {
            bail!(
                "SCHED_RR for {} (pid {pid}): {}",
                p.what,
                std::io::Error::last_os_error()
            );
        }
    }
    Ok(())
}

/// Starts `program args` in the host's namespaces, output to `log`, in a session of its own
/// (see [`spawn_detached`]) but tied to the calling thread: it is killed when that thread ends,
/// so a test killed mid-run leaves no control plane behind. It runs at nice 10.
pub fn spawn_logged(
    what: &str,
    program: &std::ffi::OsStr,
    args: &[String],
    log: &Path,
) -> Result<Proc> {
    let mut cmd = Command::new(program);
    cmd.args(args);
    // SAFETY: prctl and setpriority are async-signal-safe; they set this child's parent-death
    // signal and its niceness. At nice 10 the control plane yields the lab's own servers and
    // agents the CPU on a 2-core machine (DNS answers slowed by a busy apiserver would be a
    // latency verdict about the lab, not the datapath).
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            libc::setpriority(libc::PRIO_PROCESS, 0, 10);
            Ok(())
        });
    }
    spawn_detached(cmd, what, log)
}

/// Starts `cmd` detached (own session, so it outlives `lab up`), output to `log`; records its
/// pid and start time.
pub fn spawn_detached(mut cmd: Command, what: &str, log: &Path) -> Result<Proc> {
    let out = File::create(log).with_context(|| format!("create {}", log.display()))?;
    let err = out.try_clone()?;
    cmd.stdin(Stdio::null()).stdout(out).stderr(err);
    // SAFETY: setsid is async-signal-safe; detaches the server from our session and terminal.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let child = cmd
        .spawn()
        .with_context(|| format!("start {what}: is it installed? (cargo xtask setup)"))?;
    let pid = child.id() as i32;
    std::thread::sleep(Duration::from_millis(20));
    let start_ticks = start_ticks(pid)
        .with_context(|| format!("{what} exited at once; see {}", log.display()))?;
    Ok(Proc {
        what: what.into(),
        pid,
        start_ticks,
    })
}

/// Stops a recorded process if it is still the one we started: SIGTERM, then SIGKILL.
pub fn stop(p: &Proc) {
    if start_ticks(p.pid) != Some(p.start_ticks) {
        return; // gone, or the pid now belongs to someone else
    }
    // SAFETY: plain kill(2) on a pid we verified is ours.
    unsafe { libc::kill(p.pid, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline {
        if start_ticks(p.pid) != Some(p.start_ticks) || is_zombie(p.pid) {
            reap(p.pid);
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    unsafe { libc::kill(p.pid, libc::SIGKILL) };
    reap(p.pid);
}

fn is_zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rfind(')').map(|i| s[i + 2..].starts_with('Z')))
        .unwrap_or(false)
}

fn reap(pid: i32) {
    // Only reaps if it is our child (same process started it); harmless otherwise.
    let mut status = 0;
    unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
}

/// Waits until `check` succeeds, up to `timeout`.
pub fn wait_until(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> Result<()>,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        match check() {
            Ok(()) => return Ok(()),
            Err(e) if Instant::now() >= deadline => {
                bail!("{what} not ready after {timeout:?}: {e:#}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}
