//! What the tests read of a real node: its pinned maps, endpoints, cgroup attachments, and
//! the sampler that watches a restart from outside the agent.
use super::*;
use crate::sys::netns;
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

impl RealNode {
    /// Deletes every entry of the pinned global map `name` with bpftool (a fault made from
    /// outside the agent; stepguard itself never writes Cilium's maps). Returns how many.
    pub fn empty_map(&self, name: &str) -> Result<usize> {
        self.delete_map_entries(name, |_| true)
    }

    /// Deletes the entries of a pinned global map whose key `pick` chooses (bpftool, behind
    /// the agent's back); how many.
    pub fn delete_map_entries(&self, name: &str, pick: impl Fn(&[u8]) -> bool) -> Result<usize> {
        let pin = self.state.bpffs.join("tc/globals").join(name);
        let pin = pin.display().to_string();
        let dump: Value = serde_json::from_str(&netns::run(
            "bpftool",
            &["-j", "map", "dump", "pinned", &pin],
        )?)
        .context("parse bpftool's dump")?;
        let mut n = 0;
        for e in dump.as_array().into_iter().flatten() {
            let key: Vec<String> = e["key"]
                .as_array()
                .context("a key as bytes")?
                .iter()
                .filter_map(|b| b.as_str().map(|s| s.trim_start_matches("0x").to_string()))
                .collect();
            let bytes: Vec<u8> = key
                .iter()
                .filter_map(|b| u8::from_str_radix(b, 16).ok())
                .collect();
            if !pick(&bytes) {
                continue;
            }
            let mut args = vec!["map", "delete", "pinned", &pin, "key", "hex"];
            args.extend(key.iter().map(String::as_str));
            netns::run("bpftool", &args)?;
            n += 1;
        }
        Ok(n)
    }

    /// Entries of the pinned global map `name` (bpftool).
    pub fn map_entries(&self, name: &str) -> Result<usize> {
        let pin = self.state.bpffs.join("tc/globals").join(name);
        let dump: Value = serde_json::from_str(&netns::run(
            "bpftool",
            &["-j", "map", "dump", "pinned", &pin.display().to_string()],
        )?)
        .context("parse bpftool's dump")?;
        Ok(dump.as_array().map(|a| a.len()).unwrap_or(0))
    }

    pub fn sampler(&self) -> Sampler {
        Sampler {
            socket: self.agent_socket(),
            bpffs: self.state.bpffs.clone(),
        }
    }

    /// Whether every endpoint the agent knows is `ready` (at least the host endpoint).
    pub fn endpoints_ready(&self) -> Result<bool> {
        let (code, body) = api_get(&self.agent_socket(), "/v1/endpoint")?;
        if code != 200 {
            bail!("GET /v1/endpoint: {code}");
        }
        let eps: Value = serde_json::from_str(&body).context("parse /v1/endpoint")?;
        let eps = eps.as_array().context("/v1/endpoint is no list")?;
        Ok(!eps.is_empty()
            && eps
                .iter()
                .all(|e| e["status"]["state"].as_str() == Some("ready")))
    }

    /// Programs attached to cgroups other than the node's own (or its descendants), as
    /// `bpftool cgroup tree` lists them from the lab's cgroup2 mount: empty when the agent's
    /// socket-LB is confined to its node.
    pub fn cgroup_attachments_outside(&self) -> Result<Vec<String>> {
        let out = netns::run(
            "bpftool",
            &[
                "cgroup",
                "tree",
                &self.state.cgroup_mount.display().to_string(),
            ],
        )?;
        let mine = self.state.cgroup.display().to_string();
        let mut outside = Vec::new();
        let mut current = String::new();
        // `bpftool cgroup tree`: a header, then each cgroup's path followed by its programs
        // (ID, attach type, flags, name). Cilium's programs are named `cil_*`.
        for line in out.lines() {
            let t = line.trim();
            if t.starts_with("CgroupPath") || t.starts_with("ID") || t.is_empty() {
                continue;
            }
            if t.starts_with('/') {
                current = t.to_string();
            } else if t
                .split_whitespace()
                .last()
                .is_some_and(|n| n.starts_with("cil_"))
                && !current.starts_with(&mine)
                && !another_nodes_cgroup(&self.state.cgroup_mount, &current)
            {
                outside.push(format!("{current}: {t}"));
            }
        }
        Ok(outside)
    }

    /// Programs attached to the node's own cgroup (the agent's socket-LB).
    pub fn cgroup_attachments(&self) -> Result<String> {
        netns::run(
            "bpftool",
            &["cgroup", "show", &self.state.cgroup.display().to_string()],
        )
    }
}

/// What a restart looks like from outside the agent, sampled: the API socket, the ids of the
/// recreated ipcache map, of `cilium_lxc`, and of the programs behind `eth0`'s and
/// `cilium_host`'s pinned links.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample {
    pub api: bool,
    pub ipcache: Option<u32>,
    pub lxc: Option<u32>,
    pub eth0_prog: Option<u32>,
    pub host_prog: Option<u32>,
}

/// Paths the sampler reads (cloneable into a thread).
#[derive(Clone, Debug)]
pub struct Sampler {
    socket: PathBuf,
    bpffs: PathBuf,
}

impl Sampler {
    pub fn sample(&self) -> Sample {
        let map_id = |name: &str| {
            crate::sys::bpf::obj_get(&self.bpffs.join("tc/globals").join(name))
                .and_then(|fd| crate::sys::bpf::obj_id(&fd))
                .ok()
        };
        let link_prog = |dev: &str, prog: &str| {
            crate::sys::bpf::obj_get(
                &self
                    .bpffs
                    .join("cilium/devices")
                    .join(dev)
                    .join("links")
                    .join(prog),
            )
            .and_then(|fd| crate::sys::bpf::link_prog_id(&fd))
            .ok()
        };
        Sample {
            api: UnixStream::connect(&self.socket).is_ok(),
            ipcache: map_id("cilium_ipcache_v2"),
            lxc: map_id("cilium_lxc"),
            eth0_prog: link_prog("eth0", "cil_from_netdev"),
            host_prog: link_prog("cilium_host", "cil_to_host"),
        }
    }

    /// Samples every `every` until `stop` is set; returns each change with its time since
    /// `t0`: `(seconds, what changed)`.
    pub fn timeline(
        &self,
        t0: Instant,
        every: Duration,
        stop: &std::sync::atomic::AtomicBool,
    ) -> Vec<(f64, String)> {
        let mut out = Vec::new();
        let mut last = self.sample();
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            std::thread::sleep(every);
            let now = self.sample();
            let at = t0.elapsed().as_secs_f64();
            let mut note = |what: String| out.push((at, what));
            if now.api != last.api {
                note(format!(
                    "API socket {}",
                    if now.api { "accepts" } else { "refuses" }
                ));
            }
            if now.ipcache != last.ipcache {
                note(format!(
                    "cilium_ipcache_v2 id {:?} -> {:?}",
                    last.ipcache, now.ipcache
                ));
            }
            if now.lxc != last.lxc {
                note(format!("cilium_lxc id {:?} -> {:?}", last.lxc, now.lxc));
            }
            if now.eth0_prog != last.eth0_prog {
                note(format!(
                    "eth0 cil_from_netdev program {:?} -> {:?}",
                    last.eth0_prog, now.eth0_prog
                ));
            }
            if now.host_prog != last.host_prog {
                note(format!(
                    "cilium_host cil_to_host program {:?} -> {:?}",
                    last.host_prog, now.host_prog
                ));
            }
            last = now;
        }
        out
    }
}

/// Whether `path` (a cgroup as `bpftool cgroup tree` prints it from the lab's mount `mount`)
/// is another real-agent node's cgroup: `<mount>/<prefix>-node` with a recorded real node of
/// that prefix. Such a node's socket-LB is confined to it as this one's is; only attachments
/// at the root or elsewhere reach other processes.
fn another_nodes_cgroup(mount: &Path, path: &str) -> bool {
    let p = Path::new(path);
    p.parent() == Some(mount)
        && p.file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix("-node"))
            .is_some_and(|prefix| {
                Path::new(crate::sys::fixture::RUN_ROOT)
                    .join(prefix)
                    .join("real.json")
                    .exists()
            })
}
