//! The stand-in agent's configuration: its run dir and settings, the effective config with
//! overrides, following a ConfigMap change, and the cilium-config / stepguard config files.
use super::*;

impl Lab {
    /// The lab agent's runtime directory (Cilium's `/var/run/cilium`).
    pub fn agent_run_dir(&self) -> PathBuf {
        self.state.run_dir.join("cilium-run")
    }

    /// The lab agent's API socket (Cilium's `/var/run/cilium/cilium.sock`).
    pub fn agent_socket(&self) -> PathBuf {
        self.agent_run_dir().join("cilium.sock")
    }

    pub(crate) fn agent_settings(&self) -> PathBuf {
        self.agent_run_dir().join("loaded-settings.json")
    }

    /// The lab's agent (re)starts: it loads the cilium-config as it is now, with the per-node
    /// overrides (Cilium: `cilium-dbg build-config` merges the ConfigMap and matching
    /// CiliumNodeConfigs, later sources winning, and records `config-sources`).
    pub(crate) fn load_agent_config(&self) -> Result<()> {
        let mut values = self.effective_config(true)?;
        // As `cilium-dbg build-config` records it (JSON, `pkg/option/resolver/resolver.go`;
        // the real 1.20.2 agent reports this form).
        let mut sources = vec![
            serde_json::json!({"kind": "config-map", "namespace": "kube-system", "name": "cilium-config"}),
        ];
        if !self.state.spec.node_overrides.is_empty() {
            sources.push(serde_json::json!({"kind": "cilium-node-config", "namespace": "kube-system", "name": "lab-node"}));
        }
        values.insert(
            "config-sources".into(),
            serde_json::Value::Array(sources).to_string(),
        );
        std::fs::create_dir_all(self.agent_run_dir())?;
        std::fs::write(
            agentapi::agent_endpoints_file(&self.agent_settings()),
            self.state.lxc.len().to_string(),
        )?;
        std::fs::write(self.agent_settings(), serde_json::to_vec(&values)?)
            .context("write the lab agent's loaded settings")
    }

    /// The configuration the agent builds at its start: the mounted ConfigMap, with the
    /// per-node overrides on top when `with_overrides`.
    pub fn effective_config(&self, with_overrides: bool) -> Result<BTreeMap<String, String>> {
        let mut values = ciliumconfig::read(&self.state.cilium_config)?;
        if with_overrides {
            for (k, v) in &self.state.spec.node_overrides {
                values.insert(k.clone(), v.clone());
            }
        }
        Ok(values)
    }

    /// The host-device programs a configuration asks for (Cilium's loader: `cil_from_netdev`
    /// on every selected device, `cil_to_netdev` when devices are required, `cil_xdp_entry`
    /// with `bpf-lb-acceleration`), over the lab's devices.
    pub(crate) fn host_plan(
        &self,
        cfg: &BTreeMap<String, String>,
        dropped: Option<&str>,
    ) -> datapath::Plan {
        let patterns: Vec<&str> = cfg
            .get("devices")
            .map(|d| d.split([' ', ',']).filter(|p| !p.is_empty()).collect())
            .unwrap_or_default();
        let selected: Vec<String> = self
            .state
            .devices
            .iter()
            .filter(|d| Some(d.as_str()) != dropped)
            .filter(|d| {
                patterns.is_empty()
                    || patterns.iter().any(|p| match p.strip_suffix('+') {
                        Some(prefix) => d.starts_with(prefix),
                        None => d == p,
                    })
            })
            .cloned()
            .collect();
        let xdp = cfg
            .get("bpf-lb-acceleration")
            .is_some_and(|v| v != "disabled" && !v.is_empty());
        datapath::plan(
            &selected,
            &[],
            datapath::PlanOpts {
                xdp,
                to_netdev: maps::devices_required_by(cfg),
                host: false,
                overlay: None,
            },
        )
    }

    /// After a restart's reload: the host devices carry what `cfg` asks for — programs it no
    /// longer asks for detached, new ones attached.
    /// `dropped`: the `--drop-device` fault's device stays without programs.
    pub(crate) fn follow_config(
        &mut self,
        cfg: &BTreeMap<String, String>,
        dropped: Option<&str>,
    ) -> Result<()> {
        let want = self.host_plan(cfg, dropped);
        let host_prog =
            |p: &str| matches!(p, "cil_from_netdev" | "cil_to_netdev" | "cil_xdp_entry");
        let (keep, gone): (Vec<Attachment>, Vec<Attachment>) =
            self.state.attachments.iter().cloned().partition(|a| {
                !(self.state.devices.contains(&a.device) && host_prog(&a.program))
                    || want
                        .iter()
                        .any(|w| w.0 == a.device && w.1 == a.program && w.2 == a.hook)
            });
        let missing: datapath::Plan = want
            .into_iter()
            .filter(|w| {
                !keep
                    .iter()
                    .any(|a| a.device == w.0 && a.program == w.1 && a.hook == w.2)
            })
            .collect();
        datapath::detach(&self.node_ns(), &gone)?;
        let best_effort = cfg
            .get("bpf-lb-acceleration")
            .is_some_and(|v| v.trim() == "best-effort");
        let added = datapath::attach_all_xdp(
            &self.node_ns(),
            &self.state.bpffs,
            self.state.spec.attach,
            &missing,
            best_effort,
        )?;
        self.state.attachments = keep.into_iter().chain(added).collect();
        self.save()?;
        self.follow_routing_mode(cfg)
    }

    /// The routing mode a configuration asks for, followed: Cilium creates its overlay
    /// device in tunnel mode and removes it otherwise (`setupTunnelDevice`,
    /// `pkg/datapath/loader/netlink.go`), attaching `cil_from_overlay`/`cil_to_overlay` to
    /// it (`reinitializeOverlay`). The lab's overlay is VXLAN; a LAN lab whose nodes reach
    /// each other over it keeps its routing mode.
    fn follow_routing_mode(&mut self, cfg: &BTreeMap<String, String>) -> Result<()> {
        let want = cfg
            .get("routing-mode")
            .map(|m| m.trim() != "native")
            .unwrap_or(true);
        if want == self.state.spec.features.tunnel {
            return Ok(());
        }
        if !self.overlay_peers().is_empty() {
            bail!("routing-mode: a lab with an overlay between its nodes keeps tunnel routing");
        }
        let node = self.node_ns();
        if want {
            netns::ip(
                &node,
                &[
                    "link", "add", OVERLAY, "type", "vxlan", "external", "dstport", "8472",
                ],
            )?;
            netns::ip(&node, &["link", "set", OVERLAY, "up"])?;
            let plan: datapath::Plan = vec![
                (
                    OVERLAY.into(),
                    "cil_from_overlay",
                    datapath::Hook::Ingress,
                    None,
                ),
                (
                    OVERLAY.into(),
                    "cil_to_overlay",
                    datapath::Hook::Egress,
                    None,
                ),
            ];
            let added =
                datapath::attach_all(&node, &self.state.bpffs, self.state.spec.attach, &plan)?;
            self.state.attachments.extend(added);
        } else {
            let (gone, keep): (Vec<Attachment>, Vec<Attachment>) = self
                .state
                .attachments
                .iter()
                .cloned()
                .partition(|a| a.device == OVERLAY);
            datapath::detach(&node, &gone)?;
            netns::ip(&node, &["link", "del", OVERLAY])?;
            self.state.attachments = keep;
        }
        self.state.spec.features.tunnel = want;
        self.save()
    }

    pub(crate) fn write_cilium_config(&self) -> Result<()> {
        let s = &self.state.spec;
        let b = |v: bool| {
            if v {
                "true".to_string()
            } else {
                "false".to_string()
            }
        };
        let values: BTreeMap<String, String> = [
            ("cluster-name", "stepguard-lab".to_string()),
            ("devices", self.state.devices.join(" ")),
            ("enable-ipv4", b(s.features.ipv4)),
            ("enable-ipv6", b(s.features.ipv6)),
            (
                "kube-proxy-replacement",
                b(s.features.kube_proxy_replacement),
            ),
            ("enable-l2-announcements", b(s.features.l2_announcements)),
            (
                "routing-mode",
                if s.features.tunnel {
                    "tunnel".into()
                } else {
                    "native".into()
                },
            ),
            ("enable-tcx", b(s.attach == AttachMode::Tcx)),
            (
                "bpf-lb-acceleration",
                if s.xdp && s.xdp_best_effort {
                    "best-effort".into()
                } else if s.xdp {
                    "native".into()
                } else {
                    "disabled".into()
                },
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        ciliumconfig::write(&self.state.cilium_config, &values)
    }

    /// A ready stepguard config for this lab (schema: deploy/stepguard.example.yaml).
    pub(crate) fn write_stepguard_config(&self) -> Result<()> {
        let s = &self.state;
        let yaml = format!(
            "# stepguard config for lab {prefix} (written by the lab; run the agent in {node})\n\
             bpffs: {bpffs}\n\
             cilium_config: {cfg}\n\
             cilium_api: {api}\n\
             cilium: auto\n\
             implicit_steps: {{settle: 1s, timeout: 20s}}\n\
             targets:\n\
             \x20 - name: gateway\n    address: {gw}\n    port: {gwp}\n    probe: http\n    path: /healthz\n    expect: 200\n    timeout: 500ms\n\
             \x20 - name: dns\n    address: {dns}\n    port: {dnsp}\n    probe: dns\n    query: gateway.{zone}\n    timeout: 500ms\n\
             dns:\n  resolvers: [\"{dns}:{dnsp}\"]\n  names: [\"gateway.{zone}\", \"dns.{zone}\"]\n",
            prefix = s.spec.prefix,
            node = self.node_ns(),
            bpffs = s.bpffs.display(),
            cfg = s.cilium_config.display(),
            api = self.agent_socket().display(),
            gw = GATEWAY_VIP,
            gwp = GATEWAY_PORT,
            dns = DNS_VIP,
            dnsp = DNS_PORT,
            zone = DNS_ZONE,
        );
        std::fs::write(self.stepguard_config(), yaml).context("write stepguard config")
    }

    pub fn stepguard_config(&self) -> PathBuf {
        self.state.run_dir.join("stepguard.yaml")
    }

    /// `lab config set KEY=VALUE...`, the way kubelet updates a mounted ConfigMap.
    pub fn config_set(&self, changes: &[(String, String)]) -> Result<BTreeMap<String, String>> {
        ciliumconfig::set(&self.state.cilium_config, changes)
    }
}
