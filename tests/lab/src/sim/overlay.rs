//! The overlay between lab nodes (VXLAN devices, tunnel entries) and endpoint routes.
use super::*;

impl Lab {
    /// The overlay between LAN nodes: an address on `cilium_vxlan`, a flood entry and a route
    /// to the pod CIDR of every peer; the node forwards; the health endpoint's namespace
    /// routes through `cilium_host`'s address (a permanent neighbour: the host side's MAC).
    pub(crate) fn build_overlay(&self, peers: &[u8]) -> Result<()> {
        let node = self.node_ns();
        let me = self.node_index();
        netns::add_addr(&node, OVERLAY, &format!("{}/24", overlay_ip(me)))?;
        for j in peers {
            self.tunnel_entry("append", *j)?;
            netns::ip(
                &node,
                &[
                    "route",
                    "add",
                    &pod_cidr(*j),
                    "via",
                    &overlay_ip(*j).to_string(),
                    "dev",
                    OVERLAY,
                ],
            )?;
        }
        netns::sysctl(&node, &["net.ipv4.ip_forward=1"])?;
        self.endpoint_routes(&self.health_ns(), "lxc_health", health_ip(me))
    }

    /// An endpoint namespace's `eth0` with its address and a default route through
    /// `cilium_host`'s address, a permanent neighbour for it (the host side's MAC: Cilium's
    /// datapath answers that ARP), so the endpoint answers traffic from other nodes.
    pub(crate) fn endpoint_routes(&self, ns: &str, host_dev: &str, ip: Ipv4Addr) -> Result<()> {
        let link = netns::ip(&self.node_ns(), &["-o", "link", "show", "dev", host_dev])?;
        let mac = link
            .split("link/ether ")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .with_context(|| format!("{host_dev} has no MAC address"))?
            .to_string();
        self.ip_batch(
            Some(ns),
            &format!(
                "link set lo up
link set eth0 up
addr add {ip}/32 dev eth0
route add {CILIUM_HOST_IP} dev eth0 scope link
route add default via {CILIUM_HOST_IP} dev eth0
neigh add {CILIUM_HOST_IP} lladdr {mac} dev eth0 nud permanent
"
            ),
        )
    }

    /// The overlay fault: this node's tunnel entries to its peers are gone (as when the
    /// agent comes back without the other nodes' tunnel endpoints), so nothing reaches
    /// another node's pods from here, nor their answers back.
    pub(crate) fn break_overlay(&self) -> Result<()> {
        let peers = self.overlay_peers();
        if peers.is_empty() {
            bail!("--break-overlay: this lab has no overlay between nodes (a LAN lab with --east-west)");
        }
        for j in peers {
            self.tunnel_entry("del", j)?;
        }
        Ok(())
    }

    /// Adds (`append`) or deletes (`del`) the overlay's flood entry towards node `peer`.
    pub(crate) fn tunnel_entry(&self, op: &str, peer: u8) -> Result<()> {
        let dst = node_addr(peer).to_string();
        netns::run(
            "bridge",
            &[
                "-n",
                &self.node_ns(),
                "fdb",
                op,
                "00:00:00:00:00:00",
                "dev",
                OVERLAY,
                "dst",
                &dst,
            ],
        )
        .map(|_| ())
    }
}
