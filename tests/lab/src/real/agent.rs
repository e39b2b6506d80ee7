//! The real node's cilium-agent: starting it (as the agent pod would), stopping, signalling and
//! switching its release, its devices and readiness, and its API socket.
use super::*;
use crate::sys::netns;
use crate::sys::process::{self, Proc};
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// [`process::realtime`], or a warning when the kernel refuses it (RT group scheduling
/// without a budget): the lab still works, but gaps under load may then be the lab's servers.
pub(super) fn realtime_or_warn(p: &Proc) {
    if let Err(e) = process::realtime(p) {
        eprintln!(
            "real node: {e:#}: the fabric's servers share the CPU with the restarting agent (a gap under load may be theirs)"
        );
    }
}

/// Spawns `cmd` from a thread that lives as long as the process. The agent dies with the lab
/// (`PR_SET_PDEATHSIG`), and the kernel sends that signal when the **thread** that forked it
/// exits: an agent started from a short-lived thread (the lab kubelet's restart hook) would be
/// killed as soon as the hook returned.
fn spawn_durable(cmd: Command) -> std::io::Result<Child> {
    use std::sync::mpsc::{channel, Sender};
    use std::sync::{Mutex, OnceLock};
    type Job = (Command, Sender<std::io::Result<Child>>);
    static SPAWNER: OnceLock<Mutex<Sender<Job>>> = OnceLock::new();
    let gone = || std::io::Error::other("the lab's agent spawner thread is gone");
    let jobs = SPAWNER.get_or_init(|| {
        let (tx, rx) = channel::<Job>();
        std::thread::Builder::new()
            .name("agent-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("start the lab's agent spawner thread");
        Mutex::new(tx)
    });
    let (tx, rx) = channel();
    jobs.lock()
        .unwrap_or_else(|e| e.into_inner())
        .send((cmd, tx))
        .map_err(|_| gone())?;
    rx.recv().map_err(|_| gone())?
}

/// One HTTP/1.0 GET on the agent's API socket: (status, body).
pub fn api_get(socket: &Path, path: &str) -> Result<(u16, String)> {
    let mut s =
        UnixStream::connect(socket).with_context(|| format!("connect {}", socket.display()))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.set_write_timeout(Some(Duration::from_secs(5)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
    let mut buf = Vec::new();
    s.take(16 << 20).read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("no HTTP status from {path}: {head:?}"))?;
    Ok((status, body.to_string()))
}

impl RealNode {
    /// The agent's command line: per-node paths as flags, everything else from the ConfigMap.
    fn agent_args(&self) -> Vec<String> {
        let s = &self.state;
        vec![
            format!("--config-dir={}", self.agent_config_dir().display()),
            format!("--k8s-kubeconfig-path={}", self.kubeconfig.display()),
            format!("--bpf-root={}", s.bpffs.display()),
            format!("--cgroup-root={}", self.agent_cgroup_root().display()),
            format!("--state-dir={}", self.agent_run_dir().display()),
            format!("--lib-dir={}", s.spec.release.lib.display()),
            format!("--socket-path={}", self.agent_socket().display()),
        ]
    }

    /// Where the agent mounts cgroup2 inside its cgroup namespace (the node's cgroup is its root).
    fn agent_cgroup_root(&self) -> PathBuf {
        self.state.run_dir.join("cgroup-agent")
    }

    /// Starts the agent: into the node's cgroup first, then a new cgroup and mount namespace
    /// in the node's network namespace, then its mounts, then `cilium-agent`. One process
    /// throughout (each step execs the next), so its pid is the agent's.
    pub fn start_agent(&mut self) -> Result<()> {
        self.start_agent_with(true)
    }

    /// Starts the agent; `clang: false` leaves clang off its PATH (a fault: it cannot compile
    /// its datapath).
    pub fn start_agent_with(&mut self, clang: bool) -> Result<()> {
        if self.agent_running() {
            bail!("the agent is already running");
        }
        // The pod's init container, then the agent.
        self.build_config()?;
        let s = &self.state;
        std::fs::create_dir_all(self.agent_cgroup_root())?;
        let sysctls = s.run_dir.join("sysctl-masks");
        let inner = format!(
            "set -e\n\
             mount -t sysfs sysfs /sys\n\
             mount -t cgroup2 none {cg}\n\
             mount --bind {run} /run/cilium\n\
             mount --bind {masks}/unprivileged_bpf_disabled /proc/sys/kernel/unprivileged_bpf_disabled\n\
             mount --bind {masks}/timer_migration /proc/sys/kernel/timer_migration\n\
             exec \"$0\" \"$@\"",
            cg = self.agent_cgroup_root().display(),
            run = self.agent_run_dir().display(),
            masks = sysctls.display(),
        );
        let outer = format!(
            "echo $$ > {procs} && exec nsenter --net={net} -- unshare --mount --cgroup --propagation private -- sh -c \"$0\" \"$@\"",
            procs = s.cgroup.join("cgroup.procs").display(),
            net = netns::netns_path(&self.node_ns()).display(),
        );
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.agent_log())?;
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(outer)
            .arg(inner)
            .arg(s.spec.release.bin.join("cilium-agent"))
            .args(self.agent_args())
            .env("K8S_NODE_NAME", self.node_name())
            // The chart sets it from the pod's namespace: where the agent keeps its
            // L2-announcement leases (`l2announcer.go` `leaseNamespace`; "default" without).
            .env("CILIUM_K8S_NAMESPACE", config::CILIUM_NAMESPACE)
            .env(
                "PATH",
                format!(
                    "{}/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    if clang {
                        format!("{}:", clang_dir().display())
                    } else {
                        String::new()
                    }
                ),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        // SAFETY: prctl is async-signal-safe; the agent dies with the lab process.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = spawn_durable(cmd).context("start cilium-agent")?;
        let pid = child.id() as i32;
        self.child = Some(child);
        std::thread::sleep(Duration::from_millis(50));
        let start_ticks = process::start_ticks(pid).context("the agent exited at once")?;
        self.state.agent = Some(Proc {
            what: "cilium-agent".into(),
            pid,
            start_ticks,
        });
        self.save()
    }

    /// Whether the agent process is alive (not exited, not a zombie).
    pub fn agent_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Sends `sig` to the agent and, for SIGTERM/SIGKILL, waits until it exited (up to
    /// `limit`; then SIGKILL). Returns how long it took to exit.
    pub fn stop_agent(&mut self, sig: i32, limit: Duration) -> Result<Duration> {
        let Some(mut child) = self.child.take() else {
            bail!("no agent to stop");
        };
        let t0 = Instant::now();
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(child.id() as i32, sig) };
        loop {
            if child.try_wait()?.is_some() {
                break;
            }
            if t0.elapsed() > limit {
                let _ = child.kill();
                let _ = child.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.state.agent = None;
        self.save()?;
        Ok(t0.elapsed())
    }

    /// Runs another release at the next start (an upgrade or a downgrade): applies that
    /// release's CRDs (server-side, as its chart or operator would) and switches the binaries
    /// and lib dir. The agent must be stopped.
    pub fn switch_release(&mut self, release: Release) -> Result<()> {
        if self.agent_running() {
            bail!("stop the agent before switching its release");
        }
        for v in ["v2", "v2alpha1"] {
            let dir = release
                .lib
                .join("pkg/k8s/apis/cilium.io/client/crds")
                .join(v);
            self.control_plane()
                .kubectl(&[
                    "apply",
                    "--server-side",
                    "--force-conflicts",
                    "-f",
                    &dir.display().to_string(),
                ])
                .with_context(|| format!("apply Cilium {}'s CRDs", release.version))?;
        }
        self.state.spec.release = release;
        self.save()
    }

    /// Sends a signal (SIGSTOP, SIGCONT) to the running agent without waiting.
    pub fn signal_agent(&self, sig: i32) -> Result<()> {
        let p = self.state.agent.as_ref().context("no agent running")?;
        if process::start_ticks(p.pid) != Some(p.start_ticks) {
            bail!("the agent is gone");
        }
        // SAFETY: kill(2) on a pid verified to be our agent.
        unsafe { libc::kill(p.pid, sig) };
        Ok(())
    }

    /// The devices the agent was started with: `devices` as `build-config` resolved it (a
    /// per-node override included).
    pub fn agent_devices(&self) -> Vec<String> {
        std::fs::read_to_string(self.agent_config_dir().join("devices"))
            .unwrap_or_else(|_| "eth0 eth1".into())
            .split([' ', ','])
            .filter(|d| !d.is_empty())
            .map(String::from)
            .collect()
    }

    /// The devices the running agent reports it selected (its status,
    /// `kube-proxy-replacement.deviceList`). None: not answering or not reported yet.
    pub fn selected_devices(&self) -> Option<Vec<String>> {
        let (code, body) = api_get(&self.agent_socket(), "/v1/healthz").ok()?;
        if code != 200 {
            return None;
        }
        let v: Value = serde_json::from_str(&body).ok()?;
        let list = v["kube-proxy-replacement"]["deviceList"].as_array()?;
        let mut names: Vec<String> = list
            .iter()
            .filter_map(|d| d["name"].as_str().map(String::from))
            .collect();
        names.sort();
        Some(names)
    }

    /// Waits until the agent's API says it is healthy and the host datapath is attached on
    /// the devices it was started with (the pinned tcx links of `cil_from_netdev`); with a
    /// pattern (`eth+`, `!eth2`) in its `devices`, on those it reports it selected.
    pub fn wait_ready(&mut self, limit: Duration) -> Result<Readiness> {
        let t0 = Instant::now();
        let listed = self.agent_devices();
        let patterns = listed
            .iter()
            .any(|d| d.ends_with('+') || d.starts_with('!'));
        let mut api_at = None;
        loop {
            if !self.agent_running() {
                bail!(
                    "the agent exited ({}); see {}",
                    self.child
                        .as_mut()
                        .and_then(|c| c.try_wait().ok().flatten())
                        .map(|s| s.to_string())
                        .unwrap_or_else(|| "not started".into()),
                    self.agent_log().display()
                );
            }
            if api_at.is_none()
                && api_get(&self.agent_socket(), "/v1/healthz").is_ok_and(|(c, _)| c == 200)
            {
                api_at = Some(t0.elapsed());
            }
            let devices = if patterns {
                self.selected_devices()
                    .filter(|d| !d.is_empty())
                    .unwrap_or_else(|| vec!["(the agent's selection)".into()])
            } else {
                listed.clone()
            };
            let attached = devices.iter().all(|d| {
                self.state
                    .bpffs
                    .join("cilium/devices")
                    .join(d)
                    .join("links/cil_from_netdev")
                    .exists()
            });
            if let (Some(api), true) = (api_at, attached) {
                if let Ok(ready) = self.endpoints_ready() {
                    if ready {
                        return Ok(Readiness {
                            api,
                            ready: t0.elapsed(),
                        });
                    }
                }
            }
            if t0.elapsed() > limit {
                bail!(
                    "the agent was not ready after {limit:?} (API healthy: {api_at:?}, host datapath attached: {attached}); see {}",
                    self.agent_log().display()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// A command prefix that moves the process into the node's cgroup, then execs the rest:
    /// what runs "on the node" (stepguard's agent, as a hostNetwork pod does) is under the
    /// cgroup the node's socket-LB is attached to, as on a real node (Cilium attaches at the
    /// host's cgroup2 root), so its connects to Service addresses are translated by it.
    pub fn in_node_cgroup(&self) -> Vec<String> {
        vec![
            "sh".into(),
            "-c".into(),
            format!(
                "echo $$ > {} && exec \"$@\"",
                self.state.cgroup.join("cgroup.procs").display()
            ),
            "sh".into(),
        ]
    }
}

/// How long an agent start took until its API answered healthy and until it was ready (host
/// datapath attached, every endpoint regenerated).
#[derive(Clone, Copy, Debug)]
pub struct Readiness {
    pub api: Duration,
    pub ready: Duration,
}

/// The directory whose `clang` the agent runs: Debian's clang-19 (`/usr/lib/llvm-19/bin`),
/// a version Cilium 1.19/1.20 support (LLVM ≥ 18.1).
pub fn clang_dir() -> PathBuf {
    PathBuf::from("/usr/lib/llvm-19/bin")
}
