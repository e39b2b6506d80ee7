//! What is attached where: host devices from an rtnetlink link/address dump, their tcx
//! programs (BPF_PROG_QUERY), legacy clsact filters (rtnetlink filter dump: name and program
//! id), XDP programs (link attribute), and Cilium's pinned tcx links. Read-only.
mod endpoints;
pub mod events;
mod programs;
mod routes;
mod topology;
use super::bpf;
pub use endpoints::*;
use futures_util::TryStreamExt;
use netlink_packet_route::address::AddressAttribute;
use netlink_packet_route::link::{InfoKind, LinkAttribute, LinkFlags, LinkInfo, LinkXdp};
use netlink_packet_route::tc::{TcAttribute, TcFilterBpfOption, TcOption};
pub use programs::*;
pub use routes::*;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
pub use topology::*;

#[derive(Clone, Debug, Serialize)]
pub struct AttachedProgram {
    /// `ingress`, `egress` or `xdp`.
    pub hook: &'static str,
    /// `tcx`, `tc` or `xdp`.
    pub via: &'static str,
    pub prog_id: u32,
    /// Kernel program name (15 characters at most), when readable.
    pub name: Option<String>,
    /// Legacy tc filter name (`cil_from_netdev-eth0`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub filter: Option<String>,
    /// Load time, unix seconds (wall clock), when readable.
    pub loaded_at: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub link_pin: Option<PathBuf>,
}

impl AttachedProgram {
    /// The program's Cilium name: from the kernel name, or the tc filter name `<prog>-<dev>`.
    pub fn cilium_name(&self) -> Option<&str> {
        self.name.as_deref().or_else(|| {
            self.filter
                .as_deref()
                .and_then(|f| f.rsplit_once('-').map(|(p, _)| p))
        })
    }
    /// True if this is `prog` (matching the kernel's 15-character truncation).
    pub fn is(&self, prog: &str) -> bool {
        let short = &prog[..prog.len().min(15)];
        self.cilium_name().is_some_and(|n| n == prog || n == short)
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Device {
    pub name: String,
    pub ifindex: u32,
    pub up: bool,
    /// IFF_LOOPBACK.
    pub loopback: bool,
    /// IFF_SLAVE (a bond port).
    pub port: bool,
    /// Link kind (`veth`, `bridge`, ...), when the kernel says.
    pub kind: Option<String>,
    /// Enslaved to a bridge/bond/VRF.
    pub has_controller: bool,
    /// The controller's (master's) ifindex, when enslaved (Cilium 1.20 keeps a device under a
    /// VRF).
    pub controller: Option<u32>,
    /// Alternative names (`ip link property add altname`; Cilium 1.20 matches its `devices`
    /// filter against them too).
    pub alt_names: Vec<String>,
    /// Addresses of any scope (Cilium rejects a device without any).
    pub addresses: usize,
    pub global_addrs: Vec<IpAddr>,
    /// A route in the main table with destination 0.0.0.0/0 or ::/0 through this device
    /// (Cilium's `tables.HasDefaultRoute`: a veth without one is not auto-selected).
    pub default_route: bool,
    /// A route in any table through this device whose destination is global unicast
    /// (Cilium's auto-detection needs one; a global address gives one in the local table).
    pub global_route: bool,
    pub programs: Vec<AttachedProgram>,
}

impl Device {
    /// Whether a program named `program` (see [`AttachedProgram::is`]) is attached at `hook`
    /// (`ingress`, `egress`, `xdp`).
    pub fn carries(&self, hook: &str, program: &str) -> bool {
        self.programs
            .iter()
            .any(|p| p.hook == hook && p.is(program))
    }
}

/// Everything observed, plus what could not be read (each entry one line).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Observation {
    pub devices: Vec<Device>,
    /// lxc* devices seen (counted here; their programs are in `endpoints`).
    pub endpoint_devices: usize,
    /// Every endpoint device with its programs (not serialized: a node has thousands).
    #[serde(skip)]
    pub endpoints: Vec<EndpointDevice>,
    /// Endpoint programs that could not be queried (one line each, the first few).
    #[serde(skip)]
    pub endpoint_problems: Vec<String>,
    pub problems: Vec<String>,
    /// Pinned links that could not be opened: reported, but they do not make the device
    /// observation unknown (the tcx query is the source of truth for what is attached).
    pub link_pin_problems: Vec<String>,
    /// A program id was seen but its details were unreadable (permissions).
    pub prog_details_unreadable: bool,
    /// A program or link went away between listing and lookup (a reload in progress): the
    /// observation is not a consistent snapshot and is taken again.
    #[serde(skip)]
    pub raced: bool,
}

/// Observes the current network namespace. `bpffs` is where Cilium pins its tcx links.
/// Netlink could not be asked (the devices are unknown, not absent).
#[derive(Clone, Debug, thiserror::Error)]
pub enum LinkError {
    #[error("open rtnetlink socket: {0}")]
    Socket(String),
    #[error("rtnetlink {what} dump: {message}")]
    Dump { what: &'static str, message: String },
}

pub async fn observe(bpffs: &Path) -> Result<Observation, LinkError> {
    let (conn, handle, _) =
        rtnetlink::new_connection().map_err(|e| LinkError::Socket(e.to_string()))?;
    let task = tokio::spawn(conn);
    let mut r = observe_with(&handle, bpffs).await;
    for _ in 1..RACE_RETRIES {
        match &r {
            Ok((o, _)) if o.raced => r = observe_with(&handle, bpffs).await,
            _ => break,
        }
    }
    let r = match r {
        Ok((mut o, t)) => {
            if o.raced {
                o.prog_details_unreadable = true;
                o.problems.push(format!(
                    "programs kept changing during {RACE_RETRIES} observations in a row (a reload in progress)"
                ));
            }
            scan_endpoints(
                &handle,
                &t,
                &mut o,
                &mut ProgNames::default(),
                &EndpointScan::All,
            )
            .await;
            Ok(o)
        }
        Err(e) => Err(e),
    };
    task.abort();
    r
}

async fn observe_with(
    handle: &rtnetlink::Handle,
    bpffs: &Path,
) -> Result<(Observation, Topology), LinkError> {
    let t = topology(handle).await?;
    let o = programs(handle, bpffs, &t, &mut ProgNames::default()).await?;
    Ok((o, t))
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod endpoint_tests;

#[cfg(test)]
mod topology_tests;
