//! The cluster's ground truth through an L2 move: the lease holder, each node's responder
//! entry and the LAN client's neighbour table, recorded while a test acts, and the timeline
//! they make.
use super::*;
use crate::kube::Kube;
use crate::sys::netns;
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

impl RealCluster {
    /// Starts the lab's ground-truth recording: the lease holder (API server, every 20 ms),
    /// each node's responder entry for the VIP (pinned map, every 2 ms), the LAN client's
    /// neighbour table (rtnetlink).
    pub fn watch(&self) -> Result<Watch> {
        let stop = Arc::new(AtomicBool::new(false));
        let neigh = crate::sys::neigh::NeighWatch::start(&netns::netns_path(&self.client_ns()))
            .context("watch the LAN client's neighbour table")?;
        let kubeconfig = self.control_plane().admin_kubeconfig();
        let flag = stop.clone();
        let leases = std::thread::spawn(move || -> Result<HolderChanges> {
            let k = Kube::connect(&kubeconfig)?;
            let mut out: HolderChanges = Vec::new();
            let mut errors = 0;
            while !flag.load(Ordering::SeqCst) {
                match lease_holder(&k) {
                    Ok(h) => {
                        if out.last().map(|l| l.1) != Some(h) {
                            out.push((crate::sys::now_ns(), h));
                        }
                    }
                    Err(e) => {
                        errors += 1;
                        if errors > 50 {
                            return Err(e.context("read the lease 50 times"));
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(out)
        });
        let pins: Vec<PathBuf> = self.nodes.iter().map(|n| n.state.bpffs.clone()).collect();
        let flag = stop.clone();
        let responders = std::thread::spawn(move || {
            let mut out: Vec<(u128, u8, bool)> = Vec::new();
            let mut last: Vec<Option<bool>> = vec![None; pins.len()];
            while !flag.load(Ordering::SeqCst) {
                for (i, p) in pins.iter().enumerate() {
                    // A map that cannot be read (the agent recreating it) counts as no entry.
                    let has = responder_has(p, LAN_VIP).unwrap_or(false);
                    if last[i] != Some(has) {
                        out.push((crate::sys::now_ns(), i as u8, has));
                        last[i] = Some(has);
                    }
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            out
        });
        Ok(Watch {
            stop,
            neigh,
            leases,
            responders,
        })
    }
}

/// The lease holder's changes: (wall clock ns, node index; None: released or none).
type HolderChanges = Vec<(u128, Option<u8>)>;

/// The lab's ground-truth recording; [`Watch::stop`] returns it.
pub struct Watch {
    stop: Arc<AtomicBool>,
    neigh: crate::sys::neigh::NeighWatch,
    leases: std::thread::JoinHandle<Result<HolderChanges>>,
    responders: std::thread::JoinHandle<Vec<(u128, u8, bool)>>,
}

/// What the lab saw, each change with its wall clock (ns since the epoch).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Timeline {
    /// The lease holder (node index; None: released or none).
    pub holder: Vec<(u128, Option<u8>)>,
    /// Node `i`'s responder has the VIP (true) or not.
    pub responder: Vec<(u128, u8, bool)>,
    /// The LAN client's neighbour entries for the VIP.
    pub neigh: Vec<crate::sys::neigh::NeighEvent>,
}

impl Watch {
    pub fn stop(self) -> Result<Timeline> {
        self.stop.store(true, Ordering::SeqCst);
        let neigh = self
            .neigh
            .stop()
            .context("the LAN client's neighbour watch")?
            .into_iter()
            .filter(|e| e.addr == LAN_VIP)
            .collect();
        let holder = self
            .leases
            .join()
            .map_err(|_| anyhow::anyhow!("the lease watcher panicked"))??;
        let responder = self
            .responders
            .join()
            .map_err(|_| anyhow::anyhow!("the responder watcher panicked"))?;
        Ok(Timeline {
            holder,
            responder,
            neigh,
        })
    }
}

impl Timeline {
    /// The first time after `after` the client's entry for the VIP became valid with `mac`.
    pub fn client_on(&self, mac: [u8; 6], after: u128) -> Option<u128> {
        self.neigh
            .iter()
            .find(|e| e.at_ns > after && e.valid() && e.lladdr == Some(mac))
            .map(|e| e.at_ns)
    }
    /// The first time after `after` the holder became `who`.
    pub fn holder_became(&self, who: Option<u8>, after: u128) -> Option<u128> {
        self.holder
            .iter()
            .find(|(t, h)| *t > after && *h == who)
            .map(|(t, _)| *t)
    }
    /// The first time after `after` node `i`'s responder entry appeared (`has`) or vanished.
    pub fn responder_changed(&self, i: u8, has: bool, after: u128) -> Option<u128> {
        self.responder
            .iter()
            .find(|(t, n, h)| *t > after && *n == i && *h == has)
            .map(|(t, _, _)| *t)
    }
    /// Readable, relative to `t0` (for the test's output and the note).
    pub fn render(&self, t0: u128) -> String {
        let s = |t: u128| (t as f64 - t0 as f64) / 1e9;
        let mut rows: Vec<(f64, String)> = Vec::new();
        for (t, h) in &self.holder {
            rows.push((s(*t), format!("lease holder: {h:?}")));
        }
        for (t, n, h) in &self.responder {
            rows.push((
                s(*t),
                format!(
                    "node {n} responder: {}",
                    if *h { "has the VIP" } else { "no entry" }
                ),
            ));
        }
        for e in &self.neigh {
            rows.push((
                s(e.at_ns),
                format!(
                    "client neighbour: state {:#x}{} {}",
                    e.state,
                    if e.deleted { " deleted" } else { "" },
                    e.lladdr.map(fmt_mac).unwrap_or_default()
                ),
            ));
        }
        rows.sort_by(|a, b| a.0.total_cmp(&b.0));
        rows.iter()
            .map(|(t, r)| format!("{t:+9.3}s {r}"))
            .collect::<Vec<_>>()
            .join("\n")
    }
}
