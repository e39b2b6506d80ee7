//! The cluster as the stepper sees it, read in one pass: the DaemonSet and its newest
//! revision, the nodes, the cilium pods (foreign ones shown, never lost), the operator, each
//! node's agent and its selected devices, the L2-announcement leases.
use super::*;

/// How many agents the stepper asks at once when it reads the cluster.
const AGENTS_AT_ONCE: usize = 32;

impl Cluster {
    /// Everything the plan needs, read now.
    pub async fn view(&self) -> Result<(ClusterView, DaemonSet), RolloutError> {
        let ds = self.daemonset().await?;
        let sel = Self::selector(&ds);
        let numbers = self.revisions(&ds).await?;
        let revision = numbers
            .iter()
            .max_by_key(|(_, n)| **n)
            .map(|(h, n)| (h.clone(), *n));
        let image = agent_image(ds.spec.as_ref().and_then(|s| s.template.spec.as_ref()));
        let ds_uid = ds.metadata.uid.clone().unwrap_or_default();
        let mirrors = self.mirrors.get();
        let nodes = match mirrors {
            Some(m) => m.nodes.list()?,
            None => {
                Api::<Node>::all(self.client.clone())
                    .list(&ListParams::default())
                    .await
                    .api("list Nodes")?
                    .items
            }
        };
        let nodes: Vec<NodeInfo> = nodes
            .into_iter()
            .map(|n| {
                let labels = n.metadata.labels.clone().unwrap_or_default();
                NodeInfo {
                    name: n.metadata.name.clone().unwrap_or_default(),
                    ready: n
                        .status
                        .as_ref()
                        .and_then(|s| s.conditions.as_ref())
                        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
                        .is_some_and(|c| c.status == "True"),
                    zone: labels.get("topology.kubernetes.io/zone").cloned(),
                    control_plane: labels.contains_key("node-role.kubernetes.io/control-plane"),
                    labels: labels.into_iter().collect(),
                }
            })
            .collect();
        let listed = self.cilium_pods(&sel).await?;
        let mut foreign = Vec::new();
        let mut pods: Vec<CiliumPod> = Vec::new();
        for p in listed {
            if p.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let name = p.metadata.name.clone().unwrap_or_default();
            if !owned(&p, &ds_uid) {
                foreign.push(name);
                continue;
            }
            // A pod of the DaemonSet for no node it names, or without a revision label, is
            // the controller's business (it deletes or relabels it); it is shown, never lost.
            let (Some(node), Some(revision)) = (target_node(&p), pod_revision(&p)) else {
                foreign.push(format!("{name} (no node or revision)"));
                continue;
            };
            pods.push(CiliumPod {
                name,
                uid: p.metadata.uid.clone().unwrap_or_default(),
                node,
                revision,
                ready: pod_ready(&p),
                image: agent_image(p.spec.as_ref()),
                bound: p
                    .spec
                    .as_ref()
                    .and_then(|s| s.node_name.as_deref())
                    .is_some_and(|n| !n.is_empty()),
                crash_looping: crash_looping(&p),
                started_at: agent_started_at(&p),
            });
        }
        let operator = self.operator().await;
        let agent_pods = match mirrors {
            Some(m) => m.agents.list()?,
            None => {
                Api::<Pod>::namespaced(self.client.clone(), &self.args.agents_namespace)
                    .list(&ListParams::default().labels(&self.args.agents_selector))
                    .await
                    .api("list the stepguard agents")?
                    .items
            }
        };
        let mut agents = BTreeMap::new();
        for p in agent_pods {
            let (Some(node), Some(ip)) = (
                p.spec.as_ref().and_then(|s| s.node_name.clone()),
                p.status.as_ref().and_then(|s| s.pod_ip.clone()),
            ) else {
                continue;
            };
            let host = if ip.contains(':') {
                format!("[{ip}]")
            } else {
                ip
            };
            agents.insert(node, format!("http://{host}:{}", self.args.agent_port));
        }
        // The agents are asked side by side (a fleet's worth, AGENTS_AT_ONCE at a time).
        use futures_util::StreamExt;
        let devices: BTreeMap<String, Result<Vec<String>, String>> =
            futures_util::stream::iter(agents.iter())
                .map(|(node, url)| async move { (node.clone(), self.devices_of(url).await) })
                .buffer_unordered(AGENTS_AT_ONCE)
                .collect()
                .await;
        let asked: Vec<(String, String, f64)> = match &revision {
            Some((rev, _)) => pods
                .iter()
                .filter(|p| &p.revision == rev)
                .filter_map(|p| Some((p.node.clone(), agents.get(&p.node)?.clone(), p.started_at?)))
                .collect(),
            None => vec![],
        };
        let proofs: BTreeMap<String, Result<plan::Proof, String>> =
            futures_util::stream::iter(asked)
                .map(|(node, url, at)| async move { (node, self.proof_of(&url, at).await) })
                .buffer_unordered(AGENTS_AT_ONCE)
                .collect()
                .await;
        let leases = match mirrors {
            Some(m) => m.leases.list()?,
            None => {
                Api::<Lease>::namespaced(self.client.clone(), &self.ns)
                    .list(&ListParams::default())
                    .await
                    .api("list the L2-announcement Leases")?
                    .items
            }
        };
        let leases = leases
            .into_iter()
            .filter_map(|l| {
                let name = l.metadata.name.clone()?;
                let service = name.strip_prefix(L2_PREFIX)?.to_string();
                let spec = l.spec.clone().unwrap_or_default();
                Some(L2Lease {
                    service,
                    holder: spec.holder_identity.filter(|h| !h.is_empty()),
                    duration: Duration::from_secs(
                        spec.lease_duration_seconds.unwrap_or(15).max(0) as u64
                    ),
                    local_backends: None,
                })
            })
            .collect::<Vec<_>>();
        let mut leases = leases;
        self.local_backends(&mut leases).await;
        let l2_timings = self.l2_timings(&ds).await;
        let status = ds.status.clone().unwrap_or_default();
        let view = ClusterView {
            daemonset: format!("{}/{}", self.ns, self.ds),
            update_strategy: ds
                .spec
                .as_ref()
                .and_then(|s| s.update_strategy.as_ref())
                .and_then(|u| u.type_.clone())
                .unwrap_or_else(|| "RollingUpdate".into()),
            number_unavailable: status.number_unavailable.unwrap_or(0),
            operator,
            foreign,
            generation: ds.metadata.generation.unwrap_or(0),
            observed_generation: ds
                .status
                .as_ref()
                .and_then(|s| s.observed_generation)
                .unwrap_or(0),
            revision,
            cilium_version: image_minor(&image),
            nodes,
            pods,
            agents,
            devices,
            leases,
            l2_timings,
            proofs,
        };
        Ok((view, ds))
    }

    /// Cilium's L2-announcement renew deadline and retry period from its ConfigMap
    /// (`cilium-config` in the DaemonSet's namespace, the chart's name), else Cilium's
    /// defaults with the reason; the agent pod's grace from the DaemonSet's template.
    /// For the leases of Services with `externalTrafficPolicy: Local`, the nodes with a ready
    /// backend (the Service's EndpointSlices; an endpoint without a `ready` condition is
    /// ready, as the API says). A read that fails leaves them unknown: the estimate is then
    /// the lease timings' alone, and a warning says why.
    async fn local_backends(&self, leases: &mut [L2Lease]) {
        use k8s_openapi::api::core::v1::Service;
        use k8s_openapi::api::discovery::v1::EndpointSlice;
        if leases.is_empty() {
            return;
        }
        let listed = match self.mirrors.get() {
            Some(m) => m.services.list().map_err(|e| e.to_string()),
            None => Api::<Service>::all(self.client.clone())
                .list(&ListParams::default())
                .await
                .map(|l| l.items)
                .map_err(|e| e.to_string()),
        };
        let services = match listed {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list Services: each expected blip assumes another node may take its VIP over");
                return;
            }
        };
        for l in leases.iter_mut() {
            let Some((ns, name)) = services.iter().find_map(|s| {
                let (ns, name) = (
                    s.metadata.namespace.as_deref()?,
                    s.metadata.name.as_deref()?,
                );
                let local = s.spec.as_ref()?.external_traffic_policy.as_deref() == Some("Local");
                (local && format!("{ns}-{name}") == l.service).then_some((ns, name))
            }) else {
                continue;
            };
            let lp = ListParams::default().labels(&format!("kubernetes.io/service-name={name}"));
            match Api::<EndpointSlice>::namespaced(self.client.clone(), ns)
                .list(&lp)
                .await
            {
                Ok(slices) => {
                    let nodes: std::collections::BTreeSet<String> = slices
                        .items
                        .iter()
                        .flat_map(|s| s.endpoints.iter())
                        .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) != Some(false))
                        .filter_map(|e| e.node_name.clone())
                        .collect();
                    l.local_backends = Some(nodes.into_iter().collect());
                }
                Err(e) => {
                    tracing::warn!(service = %format!("{ns}/{name}"), error = %e, "cannot list the EndpointSlices of a Service with externalTrafficPolicy Local: its expected blip assumes another node may take its VIP over")
                }
            }
        }
    }

    async fn l2_timings(&self, ds: &DaemonSet) -> plan::L2Timings {
        let mut t = plan::L2Timings::default();
        if let Some(pod) = ds.spec.as_ref().and_then(|s| s.template.spec.as_ref()) {
            // The API's default when the template sets none.
            let g = pod.termination_grace_period_seconds.unwrap_or(30).max(0);
            t.grace = Duration::from_secs(g as u64);
        }
        let cm =
            Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(self.client.clone(), &self.ns)
                .get_opt("cilium-config")
                .await;
        t.source = match cm {
            Ok(Some(cm)) => {
                let data = cm.data.unwrap_or_default();
                let mut bad = Vec::new();
                for (key, slot) in [
                    ("l2-announcements-renew-deadline", &mut t.renew),
                    ("l2-announcements-retry-period", &mut t.retry),
                ] {
                    if let Some(v) = data.get(key) {
                        match crate::duration::parse(v) {
                            Ok(d) => *slot = d,
                            Err(e) => bad.push(format!("{key}: {e}")),
                        }
                    }
                }
                if bad.is_empty() {
                    format!("{}/cilium-config", self.ns)
                } else {
                    format!(
                        "{}/cilium-config, Cilium's defaults for {}",
                        self.ns,
                        bad.join("; ")
                    )
                }
            }
            Ok(None) => format!("Cilium's defaults ({}/cilium-config not found)", self.ns),
            Err(e) => format!("Cilium's defaults ({}/cilium-config: {e})", self.ns),
        };
        t
    }

    /// The cilium-operator Deployment's readiness (`--operator`).
    pub(super) async fn operator(&self) -> plan::Operator {
        let Some((ns, name)) = self.args.operator.split_once('/') else {
            return plan::Operator::NotChecked;
        };
        let full = self.args.operator.clone();
        match Api::<k8s_openapi::api::apps::v1::Deployment>::namespaced(self.client.clone(), ns)
            .get_opt(name)
            .await
        {
            Ok(Some(d)) => plan::Operator::Found {
                name: full,
                ready: d
                    .status
                    .as_ref()
                    .and_then(|s| s.ready_replicas)
                    .unwrap_or(0),
                desired: d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1),
            },
            Ok(None) => plan::Operator::Unknown {
                name: full,
                problem: "no such Deployment".into(),
            },
            Err(e) => plan::Operator::Unknown {
                name: full,
                problem: format!("cannot read it: {e}"),
            },
        }
    }

    pub(super) fn agent(&self, url: &str) -> Result<crate::client::Agent> {
        crate::client::Agent::new(url, self.token.clone())
    }

    /// The agent's proof for the cilium-agent container started at `started_at`.
    pub(super) async fn proof_of(&self, url: &str, started_at: f64) -> Result<plan::Proof, String> {
        let a = self.agent(url).map_err(|e| format!("{e:#}"))?;
        let (code, v) = a
            .call(
                "GET",
                &format!("/v1/proof?started_at={started_at:.3}"),
                None,
                Duration::from_secs(5),
            )
            .await
            .map_err(|e| format!("{e:#}"))?;
        if code != 200 {
            return Err(format!(
                "the agent answered {code}: {}",
                v["error"].as_str().unwrap_or("")
            ));
        }
        serde_json::from_value(v).map_err(|e| format!("the agent's proof cannot be read: {e}"))
    }

    pub(super) async fn devices_of(&self, url: &str) -> Result<Vec<String>, String> {
        let a = self.agent(url).map_err(|e| format!("{e:#}"))?;
        let (_, v) = a
            .call("GET", "/v1/verdict", None, Duration::from_secs(5))
            .await
            .map_err(|e| format!("{e:#}"))?;
        let check = v["checks"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["check"] == "devices"))
            .ok_or("the agent reports no devices check")?;
        check["evidence"]["selected"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|d| d.as_str().map(String::from))
                    .collect()
            })
            .ok_or_else(|| {
                format!(
                    "devices unknown: {}",
                    check["reason"].as_str().unwrap_or("")
                )
            })
    }
}
