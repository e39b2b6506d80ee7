//! A cluster of real-agent nodes on one LAN: one control plane, N
//! [`RealNode`]s whose `eth1` share a bridge with a LAN client, and a LoadBalancer VIP the
//! nodes' **real** cilium-agents announce with L2 announcements (a
//! `CiliumL2AnnouncementPolicy`, leases in the real API server, the holder's BPF ARP responder).
//!
//! Topology (documentation ranges only):
//! - `<prefix>-lan`: bridge `br0`; node *i*'s `eth1` at `192.0.2.<129+i>/25` (its InternalIP:
//!   every node's `eth0` has the same address into a fabric of its own, as alone);
//! - `<prefix>-client`: `eth0` at [`LAN_CLIENT`], where a witness runs;
//! - the Service `web-lan` (LoadBalancer, `externalTrafficPolicy: Local`, its ingress IP
//!   [`LAN_VIP`] set by hand on its status: no LB-IPAM runs without the operator) over one nginx
//!   pod per node, made through CNI. `Local` keeps the VIP's traffic on the node that answers
//!   ARP (the announcer only considers nodes with a local backend), so the nodes need no
//!   routes to each other's pods.
//!
//! Nothing here decides a lease move: the agents do. The lab only observes, as ground truth:
//! the lease's holder in the API server, each node's pinned `cilium_l2_responder_v4` (read,
//! never written), and the LAN client's neighbour table (rtnetlink) — [`RealCluster::watch`].
mod watch;

pub use watch::{Timeline, Watch};

use super::pods::{Workload, POD_NAMESPACE};
use super::{apply_crds, cilium_config, Member, RealNode, RealSpec, Release};
use crate::kube::{ControlPlane, Kube};
use crate::lan::LeaseTimings;
use crate::sys::netns;
use crate::sys::process;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The LAN client, where a witness runs.
pub const LAN_CLIENT: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 200);
/// The L2-announced LoadBalancer VIP.
pub const LAN_VIP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 240);
/// The `web-lan` Service's ClusterIP (the control plane's service range).
pub const LAN_SVC_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 90);
/// The announced Service.
pub const LAN_SERVICE: &str = "web-lan";
/// The port a witness in the client namespace listens on.
pub const WITNESS_PORT: u16 = 9310;

/// Node `i`'s address on the LAN (`eth1`), its InternalIP.
pub fn node_lan_addr(i: u8) -> Ipv4Addr {
    Ipv4Addr::new(192, 0, 2, 129 + i)
}

/// The agents' lease for the Service: `cilium-l2announce-<ns>-<svc>` in Cilium's namespace
/// (`pkg/l2announcer/l2announcer.go` `newLeaseLock`).
pub fn lease_name() -> String {
    format!("cilium-l2announce-{POD_NAMESPACE}-{LAN_SERVICE}")
}

/// The cluster's ConfigMap: the single node's, with L2 announcements on and `lease`'s timings.
pub fn cluster_config(lease: &LeaseTimings) -> BTreeMap<String, String> {
    let mut m = cilium_config(false);
    let ms = |d: Duration| format!("{}ms", d.as_millis());
    m.insert("enable-l2-announcements".into(), "true".into());
    m.insert("l2-announcements-lease-duration".into(), ms(lease.duration));
    m.insert("l2-announcements-renew-deadline".into(), ms(lease.renew));
    m.insert("l2-announcements-retry-period".into(), ms(lease.retry));
    m
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ClusterSpec {
    pub prefix: String,
    pub release: Release,
    pub kube_bin: PathBuf,
    pub nodes: u8,
    pub lease: LeaseTimings,
}

/// Everything the cluster made itself (its nodes record their own), recorded before it is made.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ClusterState {
    pub spec: ClusterSpec,
    pub run_dir: PathBuf,
    pub netns: Vec<String>,
    pub control_plane: Option<ControlPlane>,
    /// The nodes' prefixes (`<prefix>n<i>`).
    pub nodes: Vec<String>,
    pub ready: bool,
}

pub struct RealCluster {
    pub state: ClusterState,
    pub nodes: Vec<RealNode>,
    kube: Option<Kube>,
}

/// Takes the cluster down when dropped.
pub type ClusterGuard = crate::sys::fixture::Guard<RealCluster>;

impl crate::sys::fixture::Fixture for RealCluster {
    const KIND: &'static str = "real cluster";
    fn prefix(&self) -> &str {
        &self.state.spec.prefix
    }
    fn down(&mut self) -> Result<()> {
        RealCluster::down(self)
    }
}

impl RealCluster {
    pub fn lan_ns(&self) -> String {
        format!("{}-lan", self.state.spec.prefix)
    }
    pub fn client_ns(&self) -> String {
        format!("{}-client", self.state.spec.prefix)
    }
    pub fn control_plane(&self) -> &ControlPlane {
        self.state
            .control_plane
            .as_ref()
            .expect("a cluster has a control plane")
    }
    pub fn kube(&self) -> &Kube {
        self.kube.as_ref().expect("a cluster has an API client")
    }
    /// The stepguard config for a witness in the client namespace: the VIP.
    pub fn witness_config(&self) -> PathBuf {
        self.state.run_dir.join("witness.yaml")
    }

    fn save(&self) -> Result<()> {
        crate::sys::fixture::save(&self.state.run_dir.join("cluster.json"), &self.state)
    }

    /// Real-agent clusters with a state file (`cluster.json`).
    pub fn list() -> Vec<String> {
        crate::sys::fixture::list("cluster.json")
    }

    /// The recorded state, e.g. to take down a cluster whose process died.
    pub fn open(prefix: &str) -> Result<RealCluster> {
        let state: ClusterState =
            crate::sys::fixture::read("real-agent cluster", prefix, "cluster.json")?;
        let mut nodes = Vec::new();
        for p in &state.nodes {
            // A node whose `up` failed removed itself (no state file): nothing to open.
            if Path::new(crate::sys::fixture::RUN_ROOT)
                .join(p)
                .join("real.json")
                .exists()
            {
                nodes.push(RealNode::open(p)?);
            }
        }
        Ok(RealCluster {
            state,
            nodes,
            kube: None,
        })
    }

    /// Builds the LAN, the control plane and every node (each agent healthy and ready), a web
    /// pod per node, the Service and the policy; returns once the VIP has a lease holder whose
    /// responder answers for it and the LAN client reaches it. On error, what was made is
    /// removed again.
    pub fn up(spec: ClusterSpec) -> Result<RealCluster> {
        crate::sys::check_root()?;
        // Each node's pod CIDR is a /26 of 203.0.113.0/24.
        if !(2..=4).contains(&spec.nodes) {
            bail!("a real cluster has 2 to 4 nodes, not {}", spec.nodes);
        }
        let run_dir = Path::new(crate::sys::fixture::RUN_ROOT).join(&spec.prefix);
        // Everything the cluster and its nodes will name must be free: `down` removes what
        // the state records, and must never remove another lab's.
        let mut taken: Vec<String> = [
            format!("{}-lan", spec.prefix),
            format!("{}-client", spec.prefix),
        ]
        .into_iter()
        .filter(|ns| netns::netns_exists(ns))
        .collect();
        for i in 0..spec.nodes {
            let p = format!("{}n{i}", spec.prefix);
            if Path::new(crate::sys::fixture::RUN_ROOT).join(&p).exists()
                || netns::netns_exists(&format!("{p}-node"))
                || netns::netns_exists(&format!("{p}-fabric"))
            {
                taken.push(p);
            }
        }
        if run_dir.exists() || !taken.is_empty() {
            bail!(
                "lab prefix {:?} is already in use ({})",
                spec.prefix,
                taken.join(", ")
            );
        }
        std::fs::create_dir_all(&run_dir)
            .with_context(|| format!("create {}", run_dir.display()))?;
        let mut c = RealCluster {
            state: ClusterState {
                spec,
                run_dir,
                netns: vec![],
                control_plane: None,
                nodes: vec![],
                ready: false,
            },
            nodes: vec![],
            kube: None,
        };
        c.save()?;
        match c.build() {
            Ok(()) => Ok(c),
            Err(e) => {
                if let Err(d) = c.down() {
                    eprintln!("real cluster: cleanup after a failed up also failed: {d:#}");
                }
                Err(e)
            }
        }
    }

    fn build(&mut self) -> Result<()> {
        let (lan, client) = (self.lan_ns(), self.client_ns());
        self.state.netns = vec![lan.clone(), client.clone()];
        self.save()?;
        netns::add_netns(&lan)?;
        netns::ip(&lan, &["link", "add", "br0", "type", "bridge"])?;
        netns::ip(&lan, &["link", "set", "br0", "up"])?;
        netns::add_netns(&client)?;
        netns::add_veth(&client, "eth0", &lan, "client")?;
        netns::ip(&lan, &["link", "set", "client", "master", "br0"])?;
        netns::add_addr(&client, "eth0", &format!("{LAN_CLIENT}/25"))?;

        let spec = self.state.spec.clone();
        let cp = ControlPlane::up(&self.state.run_dir.join("kube"), &spec.kube_bin)?;
        self.state.control_plane = Some(cp.clone());
        self.save()?;
        apply_crds(&cp, &spec.release)?;
        self.kube = Some(Kube::connect(&cp.admin_kubeconfig())?);
        let config = cluster_config(&spec.lease);
        self.kube().create(
            &self
                .kube()
                .ns::<k8s_openapi::api::core::v1::ConfigMap>(super::config::CILIUM_NAMESPACE),
            json!({"apiVersion": "v1", "kind": "ConfigMap",
                   "metadata": {"name": "cilium-config", "namespace": super::config::CILIUM_NAMESPACE},
                   "data": config}),
        )?;

        // The nodes one after another: each agent's start compiles its datapath (two cores).
        for i in 0..spec.nodes {
            let prefix = format!("{}n{i}", spec.prefix);
            self.state.nodes.push(prefix.clone());
            self.save()?;
            let t0 = Instant::now();
            let node = RealNode::up(RealSpec {
                prefix,
                release: spec.release.clone(),
                kube_bin: spec.kube_bin.clone(),
                tunnel: false,
                member: Some(Member {
                    index: i,
                    lan_ns: lan.clone(),
                    control_plane: cp.clone(),
                    config: config.clone(),
                }),
            })
            .with_context(|| format!("node {i}"))?;
            eprintln!(
                "real cluster: node {i} ({}) up in {:.1}s",
                node.node_name(),
                t0.elapsed().as_secs_f64()
            );
            self.nodes.push(node);
        }
        for i in 0..self.nodes.len() {
            let name = format!("web-n{i}");
            self.nodes[i]
                .add_pod(&name, Workload::Web)
                .with_context(|| format!("pod {name}"))?;
        }
        self.add_service()?;
        self.write_witness_config()?;
        // Ready: a holder whose responder has the VIP, and the VIP answers the LAN client.
        process::wait_until(
            "a lease holder answering ARP for the VIP",
            Duration::from_secs(90),
            || match self.holder()? {
                Some(h) if self.responder_has(h)? => Ok(()),
                h => bail!("holder {h:?}"),
            },
        )?;
        process::wait_until(
            "the VIP from the LAN client",
            Duration::from_secs(30),
            || {
                if self.client_get_ok()? {
                    Ok(())
                } else {
                    bail!("no answer")
                }
            },
        )?;
        self.state.ready = true;
        self.save()
    }

    /// The `web-lan` Service (its ingress IP set by hand), the policy announcing it on
    /// `eth1`, and every node's agent serving the VIP with its local backend.
    fn add_service(&self) -> Result<()> {
        let k = self.kube();
        let api = k.ns::<k8s_openapi::api::core::v1::Service>(POD_NAMESPACE);
        k.create(
            &api,
            json!({"apiVersion": "v1", "kind": "Service",
                   "metadata": {"name": LAN_SERVICE, "namespace": POD_NAMESPACE, "labels": {"l2": "lan"}},
                   "spec": {"type": "LoadBalancer", "clusterIP": LAN_SVC_CLUSTER_IP.to_string(),
                            "externalTrafficPolicy": "Local", "selector": {"app": "web"},
                            "ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 80}]}}),
        )
        .context("create the Service")?;
        k.merge(
            &api,
            LAN_SERVICE,
            json!({"status": {"loadBalancer": {"ingress": [{"ip": LAN_VIP.to_string()}]}}}),
            true,
        )?;
        let policy = json!({
            "apiVersion": "cilium.io/v2alpha1",
            "kind": "CiliumL2AnnouncementPolicy",
            "metadata": {"name": "lan"},
            "spec": {
                "serviceSelector": {"matchLabels": {"l2": "lan"}},
                "interfaces": ["^eth1$"],
                "loadBalancerIPs": true,
            },
        });
        let file = self.state.run_dir.join("l2-policy.json");
        std::fs::write(&file, serde_json::to_vec_pretty(&policy)?)?;
        self.control_plane()
            .kubectl(&["apply", "-f", &file.display().to_string()])
            .context("apply the CiliumL2AnnouncementPolicy")?;
        for n in &self.nodes {
            process::wait_until(
                &format!(
                    "{}: its pod's identity and the VIP with a backend",
                    n.node_name()
                ),
                Duration::from_secs(60),
                || {
                    if n.pods_settled()? && n.serves(LAN_VIP)? {
                        Ok(())
                    } else {
                        bail!("not yet")
                    }
                },
            )?;
        }
        Ok(())
    }

    fn write_witness_config(&self) -> Result<()> {
        let yaml = format!(
            "# stepguard witness config for the real-agent cluster {prefix} (run it in {ns}, a LAN client)\n\
             targets:\n\
             \x20 - name: {LAN_SERVICE}\n    address: {LAN_VIP}\n    port: 80\n    probe: http\n    path: /healthz\n    expect: 200\n    timeout: 200ms\n",
            prefix = self.state.spec.prefix,
            ns = self.client_ns(),
        );
        std::fs::write(self.witness_config(), yaml).context("write the witness config")
    }

    /// The lease's holder as the API server has it (`None`: no lease, or released).
    pub fn holder(&self) -> Result<Option<u8>> {
        lease_holder(self.kube())
    }

    /// Whether node `i`'s pinned `cilium_l2_responder_v4` has an entry for the VIP.
    pub fn responder_has(&self, i: u8) -> Result<bool> {
        responder_has(&self.nodes[usize::from(i)].state.bpffs, LAN_VIP)
    }

    /// Node `i`'s LAN MAC (`eth1`).
    pub fn node_mac(&self, i: u8) -> Result<[u8; 6]> {
        let ns = self.nodes[usize::from(i)].node_ns();
        let out = netns::ip(&ns, &["-j", "link", "show", "eth1"])?;
        let v: Value = serde_json::from_str(&out).context("parse ip -j link")?;
        let s = v[0]["address"].as_str().context("no address on eth1")?;
        parse_mac(s)
    }

    /// One HTTP GET of the VIP's `/healthz` from the LAN client (500 ms).
    pub fn client_get_ok(&self) -> Result<bool> {
        let out = netns::run(
            "ip",
            &[
                "netns",
                "exec",
                &self.client_ns(),
                "curl",
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "-m",
                "0.5",
                &format!("http://{LAN_VIP}/healthz"),
            ],
        );
        Ok(out.is_ok_and(|c| c.trim() == "200"))
    }

    /// Cuts node `i` off the LAN (its bridge port down: a pulled cable); returns the wall
    /// clock just before and just after.
    pub fn unplug(&self, i: u8) -> Result<(u128, u128)> {
        let t0 = crate::sys::now_ns();
        netns::ip(&self.lan_ns(), &["link", "set", &format!("n{i}"), "down"])?;
        Ok((t0, crate::sys::now_ns()))
    }

    pub fn plug(&self, i: u8) -> Result<()> {
        netns::ip(&self.lan_ns(), &["link", "set", &format!("n{i}"), "up"])?;
        Ok(())
    }

    /// Deletes the LAN client's neighbour entry for the VIP (its kernel must resolve it again
    /// for the next packet); returns the wall clock just before and just after.
    pub fn forget_client_entry(&self) -> Result<(u128, u128)> {
        let t0 = crate::sys::now_ns();
        // `ip neigh del` of an entry that is not there fails: not an error here.
        let _ = netns::ip(
            &self.client_ns(),
            &["neigh", "del", &LAN_VIP.to_string(), "dev", "eth0"],
        );
        Ok((t0, crate::sys::now_ns()))
    }

    /// Waits (polling every millisecond, up to `limit`) until node `i`'s responder has no
    /// entry for the VIP; returns when it was seen gone (wall clock ns).
    pub fn wait_responder_gone(&self, i: u8, limit: Duration) -> Result<u128> {
        let t0 = Instant::now();
        let bpffs = self.nodes[usize::from(i)].state.bpffs.clone();
        loop {
            if !responder_has(&bpffs, LAN_VIP).unwrap_or(true) {
                return Ok(crate::sys::now_ns());
            }
            if t0.elapsed() > limit {
                bail!("node {i}'s responder kept the VIP for {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Removes the nodes (each removes exactly what it made), the control plane, the LAN and
    /// the client, the run dir.
    pub fn down(&mut self) -> Result<()> {
        let mut errors = Vec::new();
        let mut nodes = std::mem::take(&mut self.nodes);
        for p in &self.state.nodes {
            let recorded = Path::new(crate::sys::fixture::RUN_ROOT)
                .join(p)
                .join("real.json")
                .exists();
            if recorded && !nodes.iter().any(|n| &n.state.spec.prefix == p) {
                match RealNode::open(p) {
                    Ok(n) => nodes.push(n),
                    Err(e) => errors.push(format!("node {p}: {e:#}")),
                }
            }
        }
        for mut n in nodes.into_iter().rev() {
            if let Err(e) = n.down() {
                errors.push(format!("node {}: {e:#}", n.state.spec.prefix));
            }
        }
        self.kube = None;
        if let Some(mut cp) = self.state.control_plane.take() {
            cp.down();
        }
        for ns in self.state.netns.drain(..).rev() {
            if let Err(e) = netns::del_netns(&ns) {
                errors.push(format!("{e:#}"));
            }
        }
        if errors.is_empty() {
            let _ = std::fs::remove_dir_all(&self.state.run_dir);
            Ok(())
        } else {
            let _ = self.save();
            bail!("{}", errors.join("; "))
        }
    }
}

/// The holder of the VIP's lease, from its `holderIdentity` `lab-node-<i>`.
fn lease_holder(k: &Kube) -> Result<Option<u8>> {
    let api = k.ns::<k8s_openapi::api::coordination::v1::Lease>(super::config::CILIUM_NAMESPACE);
    let Some(lease) = k
        .block(api.get_opt(&lease_name()))
        .context("get the lease")?
    else {
        return Ok(None);
    };
    let who = lease
        .spec
        .and_then(|s| s.holder_identity)
        .unwrap_or_default();
    if who.is_empty() {
        return Ok(None);
    }
    who.strip_prefix("lab-node-")
        .and_then(|i| i.parse().ok())
        .map(Some)
        .with_context(|| format!("a lease holder that is no lab node: {who:?}"))
}

/// Whether the pinned `cilium_l2_responder_v4` under `bpffs` has a key for `vip` (its key:
/// the IPv4 address in network order, then the ifindex; `bpf/lib/l2_responder.h`). Read only.
pub fn responder_has(bpffs: &Path, vip: Ipv4Addr) -> Result<bool> {
    let pin = bpffs.join("tc/globals/cilium_l2_responder_v4");
    let fd = crate::sys::bpf::obj_get(&pin).with_context(|| format!("open {}", pin.display()))?;
    let size = crate::sys::bpf::map_key_size(&fd)? as usize;
    if size < 4 {
        bail!("{}: a key of {size} bytes", pin.display());
    }
    let mut key: Option<Vec<u8>> = None;
    let mut next = vec![0u8; size];
    for _ in 0..65_536 {
        if !crate::sys::bpf::map_next_key(&fd, key.as_deref(), &mut next)? {
            return Ok(false);
        }
        if next[..4] == vip.octets() {
            return Ok(true);
        }
        key = Some(next.clone());
    }
    bail!("{}: more than 65536 keys", pin.display())
}

pub fn parse_mac(s: &str) -> Result<[u8; 6]> {
    let b: Vec<u8> = s
        .split(':')
        .map(|x| u8::from_str_radix(x, 16))
        .collect::<std::result::Result<_, _>>()
        .with_context(|| format!("a MAC address: {s:?}"))?;
    b.try_into()
        .map_err(|_| anyhow::anyhow!("a MAC address: {s:?}"))
}

pub fn fmt_mac(m: [u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}
