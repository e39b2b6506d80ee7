//! Pods on a real-agent node, made the way a kubelet's runtime makes them: a Pod
//! object bound to the node, a network namespace, then **CNI ADD** by the real `cilium-cni`
//! (the agent allocates the address, creates the `lxc` veth and the endpoint, and regenerates
//! it); the lab's servers run inside, and the lab's kubelet part reports the pod Running and
//! Ready with the address CNI returned, so the real EndpointSlice controller lists it behind the
//! Services that select it. Removing a pod is **CNI DEL**, then the namespace and the object.
//!
//! Services: `web` (ClusterIP [`WEB_CLUSTER_IP`], and a LoadBalancer `web-lb` whose ingress IP
//! [`WEB_LB_IP`] is set by hand on its status, as no LB-IPAM runs without the operator) selects
//! the nginx pods; `dns` ([`DNS_CLUSTER_IP`], UDP and TCP 53) the dnsmasq pod. A probe from
//! the node to these addresses goes through Cilium's real service maps and socket-LB.
use super::RealNode;
use crate::sim::servers;
use crate::sys::netns;
use crate::sys::process::{self, Proc};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::io::Write;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

/// The `web` Service's ClusterIP (in the control plane's service range, 198.51.100.0/24; set
/// explicitly so it never takes one of the fabric's VIPs).
pub const WEB_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 80);
/// The `web-lb` LoadBalancer's ingress IP, set by hand on its status.
pub const WEB_LB_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 100);
/// The `dns` Service's ClusterIP.
pub const DNS_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 54);
/// The namespace of the lab's pods.
pub const POD_NAMESPACE: &str = "default";

/// What a pod runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Workload {
    /// nginx on port 80 (`/healthz` answers 200).
    Web,
    /// dnsmasq on port 53 answering the lab's zone.
    Dns,
}

/// A pod made through CNI.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RealPod {
    pub name: String,
    pub uid: String,
    pub netns: String,
    pub container_id: String,
    pub ip: Ipv4Addr,
    pub workload: Workload,
    pub server: Option<Proc>,
}

impl RealNode {
    fn cni_env(&self, pod: &RealPod, command: &str) -> Vec<(String, String)> {
        vec![
            ("CNI_COMMAND".into(), command.into()),
            ("CNI_CONTAINERID".into(), pod.container_id.clone()),
            (
                "CNI_NETNS".into(),
                netns::netns_path(&pod.netns).display().to_string(),
            ),
            ("CNI_IFNAME".into(), "eth0".into()),
            (
                "CNI_PATH".into(),
                self.state.spec.release.bin.display().to_string(),
            ),
            (
                "CNI_ARGS".into(),
                format!(
                    "IgnoreUnknown=1;K8S_POD_NAMESPACE={POD_NAMESPACE};K8S_POD_NAME={};K8S_POD_INFRA_CONTAINER_ID={};K8S_POD_UID={}",
                    pod.name, pod.container_id, pod.uid
                ),
            ),
            (
                "CILIUM_SOCK".into(),
                self.agent_socket().display().to_string(),
            ),
        ]
    }

    /// Makes the node's pods through a primary plugin with `cilium-cni` chained after it, as
    /// Cilium's generic-veth chaining runs (aws-cni, Calico): `ptp` (a veth per pod, the
    /// host side named `veth…`, addresses from `host-local` in the top of the pod CIDR) from
    /// `plugins`, then `cilium-cni` with its result. The agent is told by its ConfigMap
    /// (`cni-chaining-mode: generic-veth`); it takes effect at its next start.
    pub fn chain_cni(&mut self, plugins: &std::path::Path) -> Result<()> {
        for p in ["ptp", "host-local"] {
            if !plugins.join(p).exists() {
                bail!(
                    "no {p} in {} (`cargo xtask cni-plugins` builds them)",
                    plugins.display()
                );
            }
        }
        self.config_set(&[("cni-chaining-mode".into(), "generic-veth".into())])?;
        self.state.cni_chain = Some(plugins.to_path_buf());
        self.save_state()
    }

    /// The primary plugin's network configuration (chaining).
    fn ptp_conf(&self) -> Value {
        let cidr = self.pod_cidr();
        let base = cidr.split('/').next().unwrap_or("10.0.0.0");
        let prefix: Vec<&str> = base.split('.').take(3).collect();
        let p = prefix.join(".");
        json!({
            "cniVersion": "1.0.0",
            "name": "generic-veth",
            "type": "ptp",
            "ipMasq": false,
            "ipam": {
                "type": "host-local",
                "dataDir": self.state.run_dir.join("host-local").display().to_string(),
                "ranges": [[{"subnet": cidr, "rangeStart": format!("{p}.200"), "rangeEnd": format!("{p}.250")}]],
                "routes": [{"dst": "0.0.0.0/0"}],
            },
        })
    }

    /// Runs `cilium-cni` as a runtime does (with chaining, the primary plugin first on ADD and
    /// last on DEL); returns the last result.
    fn cni(&self, pod: &RealPod, command: &str) -> Result<String> {
        let Some(plugins) = self.state.cni_chain.clone() else {
            let conf = json!({
                "cniVersion": "0.3.1",
                "name": "cilium",
                "type": "cilium-cni",
                "log-file": self.state.run_dir.join("cilium-cni.log").display().to_string(),
            });
            return self.run_plugin(pod, command, "cilium-cni", &conf, None);
        };
        let ptp = self.ptp_conf();
        let cilium = |prev: Option<Value>| {
            let mut c = json!({
                "cniVersion": "1.0.0",
                "name": "generic-veth",
                "type": "cilium-cni",
                "chaining-mode": "generic-veth",
                "log-file": self.state.run_dir.join("cilium-cni.log").display().to_string(),
            });
            if let Some(p) = prev {
                c["prevResult"] = p;
            }
            c
        };
        if command == "DEL" {
            let first = self.run_plugin(pod, "DEL", "cilium-cni", &cilium(None), Some(&plugins));
            let second = self.run_plugin(pod, "DEL", "ptp", &ptp, Some(&plugins));
            return first.and(second);
        }
        let out = self.run_plugin(pod, command, "ptp", &ptp, Some(&plugins))?;
        let prev: Value =
            serde_json::from_str(&out).with_context(|| format!("parse ptp's result {out:?}"))?;
        self.run_plugin(
            pod,
            command,
            "cilium-cni",
            &cilium(Some(prev)),
            Some(&plugins),
        )
    }

    /// One CNI plugin run as a runtime does it: in the node's network namespace (with its own
    /// sysfs), the network configuration on stdin; returns its stdout (the CNI result).
    fn run_plugin(
        &self,
        pod: &RealPod,
        command: &str,
        plugin: &str,
        conf: &Value,
        chain: Option<&std::path::Path>,
    ) -> Result<String> {
        let bin = match chain {
            Some(dir) if plugin != "cilium-cni" => dir.join(plugin),
            _ => self.state.spec.release.bin.join(plugin),
        };
        let mut env = self.cni_env(pod, command);
        if let Some(dir) = chain {
            for (k, v) in env.iter_mut() {
                if k == "CNI_PATH" {
                    *v = format!("{}:{v}", dir.display());
                }
            }
        }
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!(
            "--net={}",
            netns::netns_path(&self.node_ns()).display()
        ))
        .args([
            "--",
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            "mount -t sysfs sysfs /sys && exec \"$0\"",
        ])
        .arg(&bin)
        .envs(env)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        let mut child = cmd.spawn().with_context(|| format!("run {plugin}"))?;
        child
            .stdin
            .take()
            .with_context(|| format!("{plugin}'s stdin"))?
            .write_all(conf.to_string().as_bytes())?;
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "{plugin} {command} for pod {}: {} {}",
                pod.name,
                String::from_utf8_lossy(&out.stdout).trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Makes pod `name` running `workload`: the Pod object, its namespace, CNI ADD, its
    /// server, and its status (Running, Ready, the address CNI gave). Recorded before each
    /// part is made.
    pub fn add_pod(&mut self, name: &str, workload: Workload) -> Result<RealPod> {
        let app = match workload {
            Workload::Web => "web",
            Workload::Dns => "dns",
        };
        let k = self.kube();
        let api = k.ns::<k8s_openapi::api::core::v1::Pod>(POD_NAMESPACE);
        let created = k
            .create(
                &api,
                json!({"apiVersion": "v1", "kind": "Pod",
                       "metadata": {"name": name, "namespace": POD_NAMESPACE,
                                    "labels": {"app": app, crate::kube::kubelet::CNI_POD_LABEL: "cni"}},
                       "spec": {"nodeName": self.node_name(),
                                "containers": [{"name": app, "image": format!("stepguard.invalid/lab-{app}:1")}],
                                "terminationGracePeriodSeconds": 1}}),
            )
            .with_context(|| format!("create Pod {name}"))?;
        let uid = created.metadata.uid.clone().unwrap_or_default();
        let mut pod = RealPod {
            name: name.to_string(),
            netns: format!("{}-{name}", self.state.spec.prefix),
            container_id: format!("{:0>64}", uid.replace('-', "")),
            uid,
            ip: Ipv4Addr::UNSPECIFIED,
            workload,
            server: None,
        };
        self.state.netns.push(pod.netns.clone());
        self.state_pods().push(pod.clone());
        self.save_state()?;
        netns::add_netns(&pod.netns)?;
        let result = self.cni(&pod, "ADD")?;
        let v: Value = serde_json::from_str(&result)
            .with_context(|| format!("parse cilium-cni's result {result:?}"))?;
        let ip = v["ips"]
            .as_array()
            .and_then(|a| a.iter().find_map(|i| i["address"].as_str()))
            .and_then(|a| a.split('/').next())
            .and_then(|a| a.parse::<Ipv4Addr>().ok())
            .with_context(|| format!("no IPv4 address in cilium-cni's result {result}"))?;
        pod.ip = ip;
        self.replace_pod(&pod)?;
        let dir = self.state.run_dir.join("pods").join(name);
        std::fs::create_dir_all(&dir)?;
        let server = match workload {
            Workload::Web => servers::start_nginx(&pod.netns, &dir, &ip.to_string(), 80, None)?,
            Workload::Dns => {
                let z = crate::sim::addr::DNS_ZONE;
                let records = vec![
                    (
                        format!("gateway.{z}"),
                        crate::sim::addr::GATEWAY_VIP.to_string(),
                    ),
                    (format!("dns.{z}"), crate::sim::addr::DNS_VIP.to_string()),
                    (format!("web.{z}"), WEB_CLUSTER_IP.to_string()),
                ];
                servers::start_dnsmasq(&pod.netns, &dir, &ip.to_string(), &records)?
            }
        };
        pod.server = Some(server);
        self.replace_pod(&pod)?;
        self.report_ready(&pod)?;
        Ok(pod)
    }

    /// The kubelet's status report: Running and Ready with the pod's address.
    fn report_ready(&self, pod: &RealPod) -> Result<()> {
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let cond = |t: &str| json!({"type": t, "status": "True", "lastTransitionTime": now});
        let app = match pod.workload {
            Workload::Web => "web",
            Workload::Dns => "dns",
        };
        let k = self.kube();
        k.merge(
            &k.ns::<k8s_openapi::api::core::v1::Pod>(POD_NAMESPACE),
            &pod.name,
            json!({"status": {
                "phase": "Running",
                "hostIP": self.node_ip(),
                "podIP": pod.ip.to_string(),
                "podIPs": [{"ip": pod.ip.to_string()}],
                "startTime": now,
                "conditions": [cond("PodScheduled"), cond("Initialized"), cond("ContainersReady"), cond("Ready")],
                "containerStatuses": [{"name": app, "ready": true, "started": true, "restartCount": 0,
                    "image": format!("stepguard.invalid/lab-{app}:1"), "imageID": "",
                    "state": {"running": {"startedAt": now}}}]}}),
            true,
        )?;
        Ok(())
    }

    /// CNI DEL, then the pod's server, namespace and object.
    pub fn remove_pod(&mut self, name: &str) -> Result<()> {
        let Some(pod) = self.state_pods().iter().find(|p| p.name == name).cloned() else {
            bail!("no pod {name}");
        };
        let mut errors = Vec::new();
        if let Some(s) = &pod.server {
            process::stop(s);
        }
        // CNI DEL needs the agent (without it cilium-cni queues the deletion and waits):
        // a node whose agent is gone just loses the namespace.
        if self.agent_running() {
            if let Err(e) = self.cni(&pod, "DEL") {
                errors.push(format!("{e:#}"));
            }
        }
        if let Err(e) = netns::del_netns(&pod.netns) {
            errors.push(format!("{e:#}"));
        }
        self.state.netns.retain(|n| n != &pod.netns);
        self.state_pods().retain(|p| p.name != name);
        self.save_state()?;
        if let Some(k) = self.kube_opt() {
            let api = k.ns::<k8s_openapi::api::core::v1::Pod>(POD_NAMESPACE);
            let _ = k.block(api.delete(name, &Default::default()));
        }
        if errors.is_empty() {
            Ok(())
        } else {
            bail!("{}", errors.join("; "))
        }
    }

    fn replace_pod(&mut self, pod: &RealPod) -> Result<()> {
        for p in self.state_pods().iter_mut() {
            if p.name == pod.name {
                *p = pod.clone();
            }
        }
        self.save_state()
    }

    /// The Services: `web` and `web-lb` select the web pods, `dns` the DNS pod; `web-lb`'s
    /// ingress IP is set by hand. Waits until the agent serves each frontend (its service
    /// list has the address with a backend).
    pub fn add_services(&mut self) -> Result<()> {
        let k = self.kube();
        let api = k.ns::<k8s_openapi::api::core::v1::Service>(POD_NAMESPACE);
        let port = |name: &str, proto: &str, p: u16| json!({"name": name, "protocol": proto, "port": p, "targetPort": p});
        for (name, ty, ip, ports, app) in [
            (
                "web",
                "ClusterIP",
                WEB_CLUSTER_IP,
                vec![port("http", "TCP", 80)],
                "web",
            ),
            (
                "web-lb",
                "LoadBalancer",
                Ipv4Addr::new(198, 51, 100, 81),
                vec![port("http", "TCP", 80)],
                "web",
            ),
            (
                "dns",
                "ClusterIP",
                DNS_CLUSTER_IP,
                vec![port("dns", "UDP", 53), port("dns-tcp", "TCP", 53)],
                "dns",
            ),
        ] {
            k.create(
                &api,
                json!({"apiVersion": "v1", "kind": "Service",
                       "metadata": {"name": name, "namespace": POD_NAMESPACE},
                       "spec": {"type": ty, "clusterIP": ip.to_string(), "selector": {"app": app}, "ports": ports}}),
            )
            .with_context(|| format!("create Service {name}"))?;
        }
        self.state.services = true;
        self.save_state()?;
        let k = self.kube();
        let api = k.ns::<k8s_openapi::api::core::v1::Service>(POD_NAMESPACE);
        k.merge(
            &api,
            "web-lb",
            json!({"status": {"loadBalancer": {"ingress": [{"ip": WEB_LB_IP.to_string()}]}}}),
            true,
        )?;
        // A pod's endpoint starts with the identity `reserved:init` when the agent's pod
        // informer has not seen the pod yet ("Unable to fetch kubernetes labels ... not
        // found", measured); its labels are resolved about a second later. Until then a DNS
        // query through the ClusterIP was measured to time out: the lab waits for it.
        process::wait_until(
            "every pod's endpoint ready with its labels' identity",
            Duration::from_secs(60),
            || {
                if self.pods_settled()? {
                    Ok(())
                } else {
                    bail!("not yet")
                }
            },
        )?;
        for addr in [WEB_CLUSTER_IP, WEB_LB_IP, DNS_CLUSTER_IP] {
            self.wait_served(addr)?;
        }
        Ok(())
    }

    /// Whether every pod's endpoint is `ready` with an identity from its labels (`k8s:app=…`),
    /// not `reserved:init`.
    pub fn pods_settled(&self) -> Result<bool> {
        let (code, body) = super::api_get(&self.agent_socket(), "/v1/endpoint")?;
        if code != 200 {
            bail!("GET /v1/endpoint: {code}");
        }
        let eps: Value = serde_json::from_str(&body).context("parse /v1/endpoint")?;
        let eps = eps.as_array().context("/v1/endpoint is no list")?;
        Ok(self.state.pods.iter().all(|p| {
            eps.iter().any(|e| {
                let addrs = e["status"]["networking"]["addressing"].to_string();
                addrs.contains(&format!("\"{}\"", p.ip))
                    && e["status"]["state"] == "ready"
                    && e["status"]["identity"]["labels"]
                        .as_array()
                        .is_some_and(|l| {
                            l.iter()
                                .any(|x| x.as_str().is_some_and(|x| x.starts_with("k8s:app=")))
                        })
            })
        }))
    }

    /// Whether the agent's service list (`GET /v1/service`) has a frontend `addr` with at
    /// least one backend.
    pub fn serves(&self, addr: Ipv4Addr) -> Result<bool> {
        let (code, body) = super::api_get(&self.agent_socket(), "/v1/service")?;
        if code != 200 {
            bail!("GET /v1/service: {code}");
        }
        let v: Value = serde_json::from_str(&body).context("parse /v1/service")?;
        Ok(v.as_array().into_iter().flatten().any(|s| {
            s["spec"]["frontend-address"]["ip"].as_str() == Some(&addr.to_string())
                && s["spec"]["backend-addresses"]
                    .as_array()
                    .is_some_and(|b| !b.is_empty())
        }))
    }

    /// A ClusterIP Service `name` at `ip` (TCP 80) over the web pods, created as a user
    /// does, once the agent serves it with a backend.
    pub fn add_web_service(&self, name: &str, ip: Ipv4Addr) -> Result<()> {
        let k = self.kube();
        let api = k.ns::<k8s_openapi::api::core::v1::Service>(POD_NAMESPACE);
        k.create(
            &api,
            json!({"apiVersion": "v1", "kind": "Service",
                   "metadata": {"name": name, "namespace": POD_NAMESPACE},
                   "spec": {"type": "ClusterIP", "clusterIP": ip.to_string(), "selector": {"app": "web"},
                            "ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 80}]}}),
        )
        .with_context(|| format!("create Service {name}"))?;
        self.wait_served(ip)
    }

    /// Waits (up to a minute) until the agent serves the service at `addr` with a backend.
    fn wait_served(&self, addr: Ipv4Addr) -> Result<()> {
        process::wait_until(
            &format!("the agent's service {addr} with a backend"),
            Duration::from_secs(60),
            || {
                if self.serves(addr)? {
                    Ok(())
                } else {
                    bail!("not yet")
                }
            },
        )
    }

    /// Deletes a Service through the API server, as a user does.
    pub fn delete_service(&self, name: &str) -> Result<()> {
        self.control_plane()
            .kubectl(&[
                "-n",
                POD_NAMESPACE,
                "delete",
                "service",
                name,
                "--wait=false",
            ])
            .map(|_| ())
    }

    /// The pods, for tests.
    pub fn pods(&self) -> &[RealPod] {
        &self.state.pods
    }

    /// The stepguard targets of the Services (their VIPs through Cilium's service maps).
    pub fn service_targets_yaml() -> String {
        let z = crate::sim::addr::DNS_ZONE;
        format!(
            "\x20 - name: web-clusterip\n    address: {WEB_CLUSTER_IP}\n    port: 80\n    probe: http\n    path: /healthz\n    expect: 200\n    timeout: 500ms\n\
             \x20 - name: web-lb\n    address: {WEB_LB_IP}\n    port: 80\n    probe: http\n    path: /healthz\n    expect: 200\n    timeout: 500ms\n\
             \x20 - name: dns-svc\n    address: {DNS_CLUSTER_IP}\n    port: 53\n    probe: dns\n    query: web.{z}\n    timeout: 500ms\n"
        )
    }

    /// Where the pods' servers keep their files.
    pub fn pods_dir(&self) -> PathBuf {
        self.state.run_dir.join("pods")
    }
}
