//! The stepguard configs a LAN lab writes: one per node, and the LAN client's witness.
use super::*;
use crate::sim::Lab;
use anyhow::{Context, Result};

impl LanLab {
    pub(super) fn write_node_config(&self, i: u8, node: &Lab) -> Result<()> {
        let yaml = format!(
            "# stepguard config for node {i} of LAN lab {prefix} (run the agent in {ns})\n\
             bpffs: {bpffs}\n\
             cilium_config: {cfg}\n\
             cilium_api: {api}\n\
             cilium: auto\n\
             implicit_steps: {{settle: 1s, timeout: 20s}}\n\
             {targets}\
             dns:\n  resolvers: [{resolvers}]\n  names: [\"gateway.{ZONE}\"]\n",
            resolvers = if self.state.spec.ipv6 {
                format!("\"203.0.113.53:53\", \"[{}]:53\"", vips6()[1].addr)
            } else {
                "\"203.0.113.53:53\"".into()
            },
            prefix = self.state.spec.prefix,
            ns = node.node_ns(),
            bpffs = node.state.bpffs.display(),
            cfg = node.state.cilium_config.display(),
            api = node.agent_socket().display(),
            targets = targets_yaml(&self.vips())
                + &if self.state.spec.east_west {
                    east_west_yaml(i, self.state.spec.nodes)
                } else {
                    String::new()
                },
        );
        std::fs::write(self.node_config(i), yaml).context("write a node's stepguard config")
    }

    pub(super) fn write_witness_config(&self) -> Result<()> {
        let yaml = format!(
            "# stepguard witness config for LAN lab {prefix} (run it in {ns}, a LAN client)\n{targets}",
            prefix = self.state.spec.prefix,
            ns = self.client_ns(),
            targets = targets_yaml(&self.vips()),
        );
        std::fs::write(self.witness_config(), yaml).context("write the witness config")
    }
}

/// The LAN's VIPs as stepguard targets; an IPv6 gateway also gets an ICMPv6 echo target,
/// and an IPv6 resolver is asked for the IPv6 gateway's AAAA record.
fn targets_yaml(vips: &[LanVip]) -> String {
    let mut out = String::from("targets:\n");
    for v in vips {
        match v.probe.as_str() {
            "http" => {
                out.push_str(&format!(
                    "  - name: {}\n    address: \"{}\"\n    port: {}\n    probe: http\n    path: /healthz\n    expect: 200\n    timeout: 200ms\n",
                    v.name, v.addr, v.port
                ));
                if v.addr.is_ipv6() {
                    out.push_str(&format!(
                        "  - name: {}-echo\n    address: \"{}\"\n    probe: icmp\n    timeout: 200ms\n",
                        v.name, v.addr
                    ));
                }
            }
            _ if v.addr.is_ipv6() => out.push_str(&format!(
                "  - name: {}\n    address: \"{}\"\n    port: {}\n    probe: dns\n    query: gateway6.{ZONE}\n    record: AAAA\n    answers: [\"{}\"]\n    timeout: 200ms\n",
                v.name, v.addr, v.port, vips6()[0].addr
            )),
            _ => out.push_str(&format!(
                "  - name: {}\n    address: {}\n    port: {}\n    probe: dns\n    query: gateway.{ZONE}\n    timeout: 200ms\n",
                v.name, v.addr, v.port
            )),
        }
    }
    out
}

/// Node `i`'s east-west targets: every other node's health endpoint (HTTP on 4240, as
/// cilium-health probes it) and its first pod (ICMP), reached through the overlay.
fn east_west_yaml(i: u8, nodes: u8) -> String {
    let mut out = String::new();
    for j in (0..nodes).filter(|j| *j != i) {
        out.push_str(&format!(
            "  - name: health-n{j}\n    address: {}\n    port: {}\n    probe: http\n    path: /hello\n    expect: 200\n    timeout: 200ms\n    east_west: true\n",
            crate::sim::addr::health_ip(j),
            crate::sim::addr::HEALTH_PORT
        ));
        out.push_str(&format!(
            "  - name: pod0-n{j}\n    address: {}\n    probe: icmp\n    timeout: 200ms\n    east_west: true\n",
            crate::sim::addr::pod_addr(j, 0)
        ));
    }
    out
}
