//! Building a real-agent node: its namespaces and devices, the fabric's servers, the control
//! plane, and the stepguard config that points at it.
use super::*;
use crate::kube::{self as lkube, ControlPlane, Forward, Kube};
use crate::sim::servers;
use crate::sys::netns;
use anyhow::{bail, Context, Result};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Duration;

impl RealNode {
    pub(super) fn build(&mut self) -> Result<()> {
        let (node, fabric) = (self.node_ns(), self.fabric_ns());
        self.state.netns = vec![node.clone(), fabric.clone()];
        self.save()?;
        netns::add_netns(&node)?;
        netns::add_netns(&fabric)?;
        netns::add_veth(&node, "eth0", &fabric, "fab0")?;
        netns::add_addr(&node, "eth0", &format!("{NODE_IP}/25"))?;
        netns::add_addr(&fabric, "fab0", &format!("{FABRIC0}/25"))?;
        match &self.state.spec.member {
            // The second NIC on the cluster's LAN (a bridge port `n<index>`).
            Some(m) => {
                let port = format!("n{}", m.index);
                netns::add_veth(&node, "eth1", &m.lan_ns, &port)?;
                netns::ip(&m.lan_ns, &["link", "set", &port, "master", "br0"])?;
                netns::add_addr(
                    &node,
                    "eth1",
                    &format!("{}/25", cluster::node_lan_addr(m.index)),
                )?;
            }
            None => {
                netns::add_veth(&node, "eth1", &fabric, "fab1")?;
                netns::add_addr(&node, "eth1", &format!("{NODE_IP1}/25"))?;
                netns::add_addr(&fabric, "fab1", &format!("{FABRIC1}/25"))?;
            }
        }
        for vip in [crate::sim::addr::GATEWAY_VIP, crate::sim::addr::DNS_VIP] {
            netns::add_addr(&fabric, "lo", &format!("{vip}/32"))?;
        }
        netns::ip(
            &node,
            &["route", "add", "default", "via", FABRIC0, "dev", "eth0"],
        )?;
        netns::sysctl(&fabric, &["net.ipv4.ip_forward=1"])?;
        // The fabric returns pod traffic to the node.
        netns::ip(&fabric, &["route", "add", &self.pod_cidr(), "via", NODE_IP])?;

        // The VIPs' servers, as in the simulated lab: nginx on the gateway, dnsmasq on DNS; they
        // stand for other machines, so a restart's CPU load on this one must not slow them
        // ([`process::realtime`]).
        let dir = self.state.run_dir.join("servers");
        std::fs::create_dir_all(&dir)?;
        let z = crate::sim::addr::DNS_ZONE;
        let records = vec![
            (
                format!("gateway.{z}"),
                crate::sim::addr::GATEWAY_VIP.to_string(),
            ),
            (format!("dns.{z}"), crate::sim::addr::DNS_VIP.to_string()),
        ];
        let p = servers::start_dnsmasq(
            &fabric,
            &dir,
            &crate::sim::addr::DNS_VIP.to_string(),
            &records,
        )?;
        self.state.procs.push(p.clone());
        self.save()?;
        realtime_or_warn(&p);
        let p = servers::start_nginx(
            &fabric,
            &dir,
            &crate::sim::addr::GATEWAY_VIP.to_string(),
            crate::sim::addr::GATEWAY_PORT,
            None,
        )?;
        self.state.procs.push(p.clone());
        self.save()?;
        realtime_or_warn(&p);

        // The private bpffs.
        std::fs::create_dir_all(&self.state.bpffs)?;
        self.state.bpffs_mounted = true;
        self.save()?;
        netns::run(
            "mount",
            &[
                "-t",
                "bpf",
                "bpffs",
                &self.state.bpffs.display().to_string(),
            ],
        )?;

        // The node's cgroup: a child of the lab's own cgroup2 mount.
        std::fs::create_dir_all(&self.state.cgroup_mount)?;
        self.state.cgroup_mounted = true;
        self.save()?;
        netns::run(
            "mount",
            &[
                "-t",
                "cgroup2",
                "none",
                &self.state.cgroup_mount.display().to_string(),
            ],
        )?;
        self.state.cgroup_made = true;
        self.save()?;
        std::fs::create_dir(&self.state.cgroup)
            .with_context(|| format!("create cgroup {}", self.state.cgroup.display()))?;
        if !self.state.cgroup.join("cgroup.procs").exists() {
            bail!(
                "{} is no cgroup2 directory (no cgroup.procs): the agent would attach socket-LB to a shared cgroup",
                self.state.cgroup.display()
            );
        }

        // The control plane (a cluster's member uses the cluster's), Cilium's CRDs, the Node
        // with its pod CIDR.
        if self.state.spec.member.is_none() {
            let cp = ControlPlane::up(
                &self.state.run_dir.join("kube"),
                &self.state.spec.kube_bin.clone(),
            )?;
            self.state.control_plane = Some(cp);
            self.save()?;
            apply_crds(self.control_plane(), &self.state.spec.release)?;
        }
        let cp = self.control_plane();
        let server: std::net::SocketAddr = cp
            .server
            .trim_start_matches("https://")
            .parse()
            .context("the API server's address")?;
        let kube = Kube::connect(&cp.admin_kubeconfig())?;
        lkube::create_nodes(&kube, &[(self.node_name(), self.node_ip())])?;
        let cidr = self.pod_cidr();
        kube.merge(
            &kube.all::<k8s_openapi::api::core::v1::Node>(),
            &self.node_name(),
            json!({"spec": {"podCIDR": cidr, "podCIDRs": [cidr]}}),
            false,
        )?;
        self.kube = Some(kube);
        // The agent reaches the API server through a forward on its namespace's loopback.
        let fwd = Forward::start(&node, "127.0.0.1", server)?;
        self.control_plane()
            .kubeconfig_for(&self.kubeconfig, &format!("https://{}", fwd.addr))?;
        self.forward = Some(fwd);

        self.create_config()?;
        std::fs::create_dir_all(self.agent_run_dir())?;
        let sysctls = self.state.run_dir.join("sysctl-masks");
        std::fs::create_dir_all(&sysctls)?;
        for (f, v) in [
            ("unprivileged_bpf_disabled", "2\n"),
            ("timer_migration", "1\n"),
        ] {
            std::fs::write(sysctls.join(f), v)?;
        }
        if !Path::new("/run/cilium").exists() {
            self.state.made_run_cilium = true;
            self.save()?;
            std::fs::create_dir_all("/run/cilium")?;
        }
        self.start_agent()?;
        self.wait_ready(Duration::from_secs(180))?;
        let outside = self.cgroup_attachments_outside()?;
        if !outside.is_empty() {
            bail!("the agent attached programs outside its node's cgroup: {outside:?}");
        }
        Ok(())
    }

    /// A stepguard config for this node, as a user writes it from
    /// `deploy/stepguard.example.yaml`: the agent's bpffs, ConfigMap and API socket, the
    /// VIPs' targets and the DNS check.
    pub fn write_stepguard_config(&self) -> Result<PathBuf> {
        let p = self.state.run_dir.join("stepguard.yaml");
        let z = crate::sim::addr::DNS_ZONE;
        let yaml = format!(
            "# stepguard config for the real-agent node {prefix} (run it in {node})\n\
             bpffs: {bpffs}\n\
             cilium_config: {cfg}\n\
             cilium_api: {api}\n\
             cilium: auto\n\
             implicit_steps: {{settle: 1s, timeout: 120s}}\n\
             targets:\n\
             \x20 - name: gateway\n    address: {gw}\n    port: {gwp}\n    probe: http\n    path: /healthz\n    expect: 200\n    timeout: 500ms\n\
             \x20 - name: dns\n    address: {dns}\n    port: 53\n    probe: dns\n    query: gateway.{z}\n    timeout: 500ms\n\
             {services}\
             dns:\n  resolvers: [\"{dns}:53\"]\n  names: [\"gateway.{z}\", \"dns.{z}\"]\n",
            services = if self.state.services {
                Self::service_targets_yaml()
            } else {
                String::new()
            },
            prefix = self.state.spec.prefix,
            node = self.node_ns(),
            bpffs = self.state.bpffs.display(),
            cfg = self.state.cilium_config.display(),
            api = self.agent_socket().display(),
            gw = crate::sim::addr::GATEWAY_VIP,
            gwp = crate::sim::addr::GATEWAY_PORT,
            dns = crate::sim::addr::DNS_VIP,
        );
        std::fs::write(&p, yaml).context("write the stepguard config")?;
        Ok(p)
    }
}
