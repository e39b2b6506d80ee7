//! A blocking client of the API server, and the Nodes the lab creates through it.
use anyhow::{Context, Result};
use serde::Serialize;
use serde_json::{json, Value};
use std::path::Path;

/// A blocking handle on the API server for the lab and the tests (the kube crate on a
/// runtime of its own).
pub struct Kube {
    rt: tokio::runtime::Runtime,
    pub client: ::kube::Client,
}

impl Kube {
    pub fn connect(kubeconfig: &Path) -> Result<Kube> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let kc = ::kube::config::Kubeconfig::read_from(kubeconfig)
            .with_context(|| format!("read {}", kubeconfig.display()))?;
        let client = rt.block_on(async {
            let cfg = ::kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?;
            anyhow::Ok(::kube::Client::try_from(cfg)?)
        })?;
        Ok(Kube { rt, client })
    }

    pub fn block<F: std::future::Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }

    pub fn all<K>(&self) -> ::kube::Api<K>
    where
        K: ::kube::Resource<Scope = k8s_openapi::ClusterResourceScope>,
        <K as ::kube::Resource>::DynamicType: Default,
    {
        ::kube::Api::all(self.client.clone())
    }

    pub fn ns<K>(&self, ns: &str) -> ::kube::Api<K>
    where
        K: ::kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as ::kube::Resource>::DynamicType: Default,
    {
        ::kube::Api::namespaced(self.client.clone(), ns)
    }

    /// Creates the object given as JSON.
    pub fn create<K>(&self, api: &::kube::Api<K>, obj: Value) -> Result<K>
    where
        K: ::kube::Resource + Clone + serde::de::DeserializeOwned + Serialize + std::fmt::Debug,
    {
        let o: K = serde_json::from_value(obj).context("object JSON")?;
        self.block(api.create(&Default::default(), &o))
            .context("create")
    }

    /// A JSON merge patch (`status`: on the status subresource).
    pub fn merge<K>(
        &self,
        api: &::kube::Api<K>,
        name: &str,
        patch: Value,
        status: bool,
    ) -> Result<K>
    where
        K: ::kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        let pp = ::kube::api::PatchParams::default();
        let p = ::kube::api::Patch::Merge(&patch);
        if status {
            self.block(api.patch_status(name, &pp, &p))
        } else {
            self.block(api.patch(name, &pp, &p))
        }
        .with_context(|| format!("patch {name}"))
    }
}

/// The lab's nodes as Node objects (name → InternalIP), Ready, with room for pods.
pub fn create_nodes(k: &Kube, nodes: &[(String, String)]) -> Result<()> {
    let api = k.all::<k8s_openapi::api::core::v1::Node>();
    for (name, ip) in nodes {
        k.create(
            &api,
            json!({"apiVersion": "v1", "kind": "Node",
                   "metadata": {"name": name, "labels": {
                       "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                       "kubernetes.io/arch": "amd64"}}}),
        )
        .with_context(|| format!("create Node {name}"))?;
        set_node_ready(k, name, ip, true)?;
    }
    Ok(())
}

/// Sets a Node's status: Ready (or not), its address and capacity.
pub fn set_node_ready(k: &Kube, name: &str, ip: &str, ready: bool) -> Result<()> {
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let cap = json!({"cpu": "4", "memory": "8Gi", "pods": "110"});
    k.merge(
        &k.all::<k8s_openapi::api::core::v1::Node>(),
        name,
        json!({"status": {
            "capacity": cap, "allocatable": cap,
            "addresses": [{"type": "InternalIP", "address": ip}, {"type": "Hostname", "address": name}],
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" },
                            "reason": if ready { "KubeletReady" } else { "KubeletNotReady" },
                            "lastHeartbeatTime": now, "lastTransitionTime": now}]}}),
        true,
    )
    .with_context(|| format!("set Node {name} status"))?;
    Ok(())
}
