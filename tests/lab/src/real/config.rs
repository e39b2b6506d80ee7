//! The real node's Cilium configuration, the way a Cilium pod gets it:
//! - the ConfigMap `kube-system/cilium-config` is an object in the lab's API server, and its
//!   kubelet-style mount (`RealState::cilium_config`) is what stepguard's `cilium_config` reads,
//!   as the DaemonSet in `deploy/` mounts it;
//! - before every agent start, the agent pod's init container runs: the release's own
//!   `cilium-dbg build-config` merges the ConfigMap with the CiliumNodeConfigs that select the
//!   node (later sources win; it adds `config-sources`) into a fresh directory, the agent's
//!   `--config-dir` (the chart's `/tmp/cilium/config-map` emptyDir, new with each pod).
//!
//! So an edit of the ConfigMap reaches the agent only at its next start, and a per-node
//! override only through Cilium's own resolver (`pkg/option/resolver`), not the lab's reading
//! of it.
use super::*;
use k8s_openapi::api::core::v1::ConfigMap;

/// The ConfigMap the node's agent runs with (the chart's keys for this lab): kube-proxy
/// replacement, IPAM `kubernetes` (no operator), CRD identities, no Envoy, no Hubble, no
/// health checking, IPv4 only.
pub fn cilium_config(tunnel: bool) -> BTreeMap<String, String> {
    let mut m: BTreeMap<String, String> = [
        ("cluster-name", "stepguard-lab"),
        ("ipam", "kubernetes"),
        ("enable-ipv4", "true"),
        ("enable-ipv6", "false"),
        ("identity-allocation-mode", "crd"),
        ("enable-l7-proxy", "false"),
        ("enable-hubble", "false"),
        ("enable-health-checking", "false"),
        ("enable-endpoint-health-checking", "false"),
        ("kube-proxy-replacement", "true"),
        ("devices", "eth0 eth1"),
        ("enable-l2-announcements", "false"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    if tunnel {
        m.insert("routing-mode".into(), "tunnel".into());
        m.insert("tunnel-protocol".into(), "vxlan".into());
    } else {
        m.insert("routing-mode".into(), "native".into());
        m.insert("ipv4-native-routing-cidr".into(), POD_CIDR.into());
        m.insert("auto-direct-node-routes".into(), "false".into());
    }
    m
}

/// Cilium's namespace in the lab (the chart's default).
pub const CILIUM_NAMESPACE: &str = "kube-system";

impl RealNode {
    /// The directory `cilium-dbg build-config` writes and the agent reads (`--config-dir`).
    pub fn agent_config_dir(&self) -> PathBuf {
        self.state.run_dir.join("agent-config")
    }

    /// Creates the ConfigMap object (a cluster's node: only the mount) and its kubelet-style
    /// mount.
    pub(super) fn create_config(&self) -> Result<()> {
        if let Some(m) = &self.state.spec.member {
            // The cluster made the object; this node's kubelet mounts it.
            return crate::sim::ciliumconfig::write(&self.state.cilium_config, &m.config);
        }
        let values = cilium_config(self.state.spec.tunnel);
        self.kube().create(
            &self.kube().ns::<ConfigMap>(CILIUM_NAMESPACE),
            json!({"apiVersion": "v1", "kind": "ConfigMap",
                   "metadata": {"name": "cilium-config", "namespace": CILIUM_NAMESPACE},
                   "data": values}),
        )?;
        crate::sim::ciliumconfig::write(&self.state.cilium_config, &values)
    }

    /// The agent pod's init container: `cilium-dbg build-config` of the node's release into a
    /// fresh `agent_config_dir`, reaching the API server as the agent does (the node's
    /// kubeconfig, from its network namespace).
    pub(super) fn build_config(&self) -> Result<()> {
        let dest = self.agent_config_dir();
        if dest.exists() {
            std::fs::remove_dir_all(&dest)
                .with_context(|| format!("remove the last start's {}", dest.display()))?;
        }
        let out = Command::new("nsenter")
            .arg(format!(
                "--net={}",
                netns::netns_path(&self.node_ns()).display()
            ))
            .arg("--")
            .arg(self.state.spec.release.bin.join("cilium-dbg"))
            .arg("build-config")
            .arg(format!("--k8s-kubeconfig-path={}", self.kubeconfig.display()))
            .arg(format!("--dest={}", dest.display()))
            .arg(format!("--node-name={}", self.node_name()))
            .arg(format!(
                "--source=config-map:{CILIUM_NAMESPACE}/cilium-config,cilium-node-config:{CILIUM_NAMESPACE}"
            ))
            .env("K8S_NODE_NAME", self.node_name())
            .env("CILIUM_K8S_NAMESPACE", CILIUM_NAMESPACE)
            .output()
            .context("run cilium-dbg build-config")?;
        if !out.status.success() || !dest.join("config-sources").exists() {
            bail!(
                "cilium-dbg build-config failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
                    .lines()
                    .rev()
                    .take(5)
                    .collect::<Vec<_>>()
                    .join(" | ")
            );
        }
        Ok(())
    }

    /// Edits the ConfigMap (the object, and its mount as kubelet updates it); the agent reads
    /// it only at its next start. Returns the mount's values.
    pub fn config_set(&self, changes: &[(String, String)]) -> Result<BTreeMap<String, String>> {
        let data: serde_json::Map<String, Value> = changes
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect();
        self.kube().merge(
            &self.kube().ns::<ConfigMap>(CILIUM_NAMESPACE),
            "cilium-config",
            json!({ "data": data }),
            false,
        )?;
        crate::sim::ciliumconfig::set(&self.state.cilium_config, changes)
    }

    /// A per-node override: a CiliumNodeConfig `name` (v2) in Cilium's namespace selecting
    /// this node by its hostname label, with `values` as its defaults. The agent loads it at
    /// its next start (through `build-config`); the ConfigMap mount does not change.
    pub fn node_override(&self, name: &str, values: &[(String, String)]) -> Result<()> {
        let defaults: serde_json::Map<String, Value> = values
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect();
        let obj = json!({
            "apiVersion": "cilium.io/v2",
            "kind": "CiliumNodeConfig",
            "metadata": {"name": name, "namespace": CILIUM_NAMESPACE},
            "spec": {
                "nodeSelector": {"matchLabels": {"kubernetes.io/hostname": self.node_name()}},
                "defaults": defaults,
            },
        });
        let file = self
            .state
            .run_dir
            .join(format!("ciliumnodeconfig-{name}.json"));
        std::fs::write(&file, serde_json::to_vec_pretty(&obj)?)?;
        self.control_plane()
            .kubectl(&["apply", "-f", &file.display().to_string()])
            .with_context(|| format!("apply CiliumNodeConfig {name}"))?;
        Ok(())
    }
}
