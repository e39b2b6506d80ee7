//! `config`: is the cilium-config declared now what the running cilium-agent loaded? The
//! agent reads its config only at start, so an edit without a restart is "merged but inert"
//! (the seeds' incident: green everywhere, inert for a day). Judged from content, not
//! timestamps: the declared keys (the mounted ConfigMap) against the settings the agent
//! reports it loaded (its API, `GET /v1/debuginfo`). A key whose loaded value is an earlier
//! value of the ConfigMap was not applied; a loaded value the ConfigMap never had, on a node
//! whose config sources include a CiliumNodeConfig, is a per-node override (reported). Keys
//! the agent does not report cannot be verified (listed, never counted as a pass).
use super::CheckResult;
use crate::checks::Code;
use crate::ciliumconfig::{Snapshot, SnapshotStore};
use serde_json::json;
use std::collections::BTreeMap;

pub const CHECK: &str = "config";

/// The evidence key with the version the running agent reports (`cilium-version`).
pub const AGENT_VERSION: &str = "agent_version";

/// The synthetic key `cilium-dbg build-config` adds (where the settings came from).
const CONFIG_SOURCES: &str = "config-sources";

fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.trim(), b.trim());
    a == b
        || (matches!(a.to_ascii_lowercase().as_str(), "true" | "false")
            && a.eq_ignore_ascii_case(b))
}

/// Keys of the cilium-config that only cilium-operator reads: the agent loads them with the
/// rest (its settings list every key of its configuration directory) but never uses them, so
/// an edit needs the operator's restart, never the agent's. Those the Helm chart writes
/// (`install/kubernetes/cilium/templates/cilium-configmap.yaml`) that are registered under
/// `operator/` and named nowhere in `daemon/`, `pkg/` or `plugins/`, at 1.19.7 and 1.20.2
/// (docs/cilium-fidelity.md, "Keys the agent does not wait for").
pub const OPERATOR_KEYS: [&str; 73] = [
    "auto-create-cilium-pod-ip-pools",
    "aws-enable-prefix-delegation",
    "aws-release-excess-ips",
    "azure-use-primary-address",
    "azure-user-assigned-identity-id",
    "ces-rate-limits",
    "cilium-endpoint-gc-interval",
    "cluster-pool-ipv4-cidr",
    "cluster-pool-ipv4-mask-size",
    "cluster-pool-ipv6-cidr",
    "cluster-pool-ipv6-mask-size",
    "ec2-api-endpoint",
    "enable-gateway-api-alpn",
    "enable-gateway-api-app-protocol",
    "enable-gateway-api-proxy-protocol",
    "enable-gateway-api-secrets-sync",
    "enable-ingress-proxy-protocol",
    "enable-ingress-secrets-sync",
    "enable-metrics",
    "enforce-ingress-https",
    "eni-gc-interval",
    "eni-gc-tags",
    "eni-tags",
    "gateway-api-hostnetwork-enabled",
    "gateway-api-hostnetwork-nodelabelselector",
    "gateway-api-service-externaltrafficpolicy",
    "gateway-api-use-remote-address",
    "gateway-api-xff-num-trusted-hops",
    "identity-gc-interval",
    "identity-heartbeat-timeout",
    "ingress-default-lb-mode",
    "ingress-default-secret-name",
    "ingress-default-secret-namespace",
    "ingress-default-xff-num-trusted-hops",
    "ingress-hostnetwork-enabled",
    "ingress-hostnetwork-http-listener-port",
    "ingress-hostnetwork-https-listener-port",
    "ingress-hostnetwork-nodelabelselector",
    "ingress-hostnetwork-shared-listener-port",
    "ingress-hostnetwork-tls-passthrough-listener-port",
    "ingress-lb-annotation-prefixes",
    "ingress-shared-lb-service-name",
    "ingress-use-remote-address",
    "instance-tags-filter",
    "limit-ipam-api-burst",
    "limit-ipam-api-qps",
    "loadbalancer-l7",
    "loadbalancer-l7-algorithm",
    "loadbalancer-l7-ports",
    "mesh-auth-mutual-enabled",
    "mesh-auth-spire-agent-socket",
    "mesh-auth-spire-server-address",
    "mesh-auth-spire-server-connection-timeout",
    "nodes-gc-interval",
    "operator-api-serve-addr",
    "operator-k8s-client-burst",
    "operator-k8s-client-qps",
    "operator-pprof",
    "operator-pprof-address",
    "operator-pprof-block-profile-rate",
    "operator-pprof-mutex-profile-fraction",
    "operator-pprof-port",
    "operator-prometheus-enable-tls",
    "operator-prometheus-serve-addr",
    "operator-prometheus-tls-cert-file",
    "operator-prometheus-tls-client-ca-files",
    "operator-prometheus-tls-key-file",
    "pod-restart-selector",
    "subnet-ids-filter",
    "subnet-tags-filter",
    "synchronize-k8s-nodes",
    "unmanaged-pod-watcher-interval",
    "ztunnel-ca-type",
];

/// Whether the agent reads `key` only at the operator's side.
pub fn operator_only(key: &str) -> bool {
    OPERATOR_KEYS.binary_search(&key).is_ok()
}

/// Why the running agent applies an edit of `key` without a restart, if it does: Cilium's
/// dynamic configuration (`enable-dynamic-config`, on by default) reflects the ConfigMap into
/// a table the agent watches (`pkg/dynamicconfig/reflectors.go`), and two keys are read from
/// it while the agent runs: `subnet-topology` in hybrid routing (1.20: `pkg/subnet/cell.go`
/// `registerSubnetWatcher`) and `dynamic-lifecycle-config` with the dynamic lifecycle manager
/// on (1.19, 1.20: `pkg/dynamiclifecycle/watcher.go` `registerWatcher`). The settings the
/// agent reports keep the value it started with.
pub fn applied_live(key: &str, loaded: &BTreeMap<String, String>) -> Option<&'static str> {
    let get = |k: &str| loaded.get(k).map(|v| v.trim().to_ascii_lowercase());
    if get("enable-dynamic-config").as_deref() == Some("false") {
        return None;
    }
    match key {
        "subnet-topology" if get("routing-mode").as_deref() == Some("hybrid") => {
            Some("watched in hybrid routing")
        }
        "dynamic-lifecycle-config"
            if get("enable-dynamic-lifecycle-manager").as_deref() == Some("true") =>
        {
            Some("watched by the dynamic lifecycle manager")
        }
        _ => None,
    }
}

/// The declared keys against the loaded ones.
struct Classified {
    sources: String,
    verified: usize,
    /// The verified keys, by name (the count is `verified`).
    verified_keys: Vec<String>,
    /// Rows `{key, declared, loaded}`.
    not_applied: Vec<serde_json::Value>,
    overrides: Vec<serde_json::Value>,
    unsure: Vec<serde_json::Value>,
    unverifiable: Vec<String>,
    /// Keys only the operator reads (never the agent's to apply).
    operator: Vec<String>,
    /// Rows `{key, declared, loaded, why}` of keys the agent applies while it runs, whose
    /// start value it still reports.
    live: Vec<serde_json::Value>,
}

/// Whether the agent's config came with a per-node source (a CiliumNodeConfig, Node labels).
/// `cilium-dbg build-config` writes `config-sources` as JSON, `[{"kind": …, "namespace": …,
/// "name": …}]` with kinds `config-map`, `cilium-node-config`, `node` (1.19.7 and 1.20.2:
/// `pkg/option/resolver/resolver.go` l. 33-46, 110; measured on the real 1.20.2 agent); the
/// `KIND:NS/NAME` list (`ConfigSource.String()`) is read too.
fn per_node(loaded: &BTreeMap<String, String>) -> bool {
    let sources = loaded.get(CONFIG_SOURCES).map(String::as_str).unwrap_or("");
    if let Ok(serde_json::Value::Array(list)) = serde_json::from_str(sources) {
        return list
            .iter()
            .any(|s| matches!(s["kind"].as_str(), Some("cilium-node-config" | "node")));
    }
    sources.contains("cilium-node-config") || sources.contains("node:")
}

/// How long before its API socket appears a starting agent may have built its configuration
/// (`cilium-dbg build-config` in the DaemonSet's first init container, then the other init
/// containers and the agent's start up to its API): an agent whose socket is younger than a
/// value's declaration by more than this read that value at its start.
pub const BUILD_MARGIN_SECS: f64 = 30.0;

fn classify(
    snap: &Snapshot,
    loaded: &BTreeMap<String, String>,
    started_at: Option<f64>,
    store: Option<&SnapshotStore>,
) -> Classified {
    let sources = loaded.get(CONFIG_SOURCES).cloned().unwrap_or_default();
    let per_node = per_node(loaded);
    let mut c = Classified {
        sources,
        verified: 0,
        verified_keys: vec![],
        not_applied: vec![],
        overrides: vec![],
        unsure: vec![],
        unverifiable: vec![],
        operator: vec![],
        live: vec![],
    };
    for (k, want) in snap
        .values
        .iter()
        .filter(|(k, _)| k.as_str() != CONFIG_SOURCES)
    {
        if operator_only(k) {
            c.operator.push(k.clone());
            continue;
        }
        let Some(have) = loaded.get(k) else {
            c.unverifiable.push(k.clone());
            continue;
        };
        if same(have, want) {
            c.verified += 1;
            c.verified_keys.push(k.clone());
            continue;
        }
        if let Some(why) = applied_live(k, loaded) {
            c.live
                .push(json!({"key": k, "declared": want, "loaded": have, "why": why}));
            continue;
        }
        let earlier = store
            .map(|s| s.history(k))
            .unwrap_or_default()
            .iter()
            .any(|v| same(v, have));
        let row = json!({"key": k, "declared": want, "loaded": have});
        // The agent started after the ConfigMap declared this value (the mount is written
        // after the API server has it, so Cilium's build-config read it too): whatever it
        // loaded instead came from another source, not from an edit that missed it.
        let declared_at = store
            .and_then(|s| s.declared_since(k, want))
            .unwrap_or(snap.changed_at)
            .min(snap.changed_at);
        let read_declared = started_at.is_some_and(|t| t > declared_at + BUILD_MARGIN_SECS);
        match (earlier, per_node && store.is_some()) {
            // A value the ConfigMap once had, kept by a per-node source (a CiliumNodeConfig)
            // the agent read at a start after the edit: an override.
            (true, true) if read_declared => c.overrides.push(row),
            // Started before the edit, with a per-node source: either the edit waits for a
            // restart or a per-node source keeps the old value (which keys a source sets is
            // not reported). Unknown, never "not applied".
            (true, true) => c.unsure.push(row),
            // Started after the edit with no per-node source named: something else (a flag)
            // sets it; unknown.
            (true, false) if read_declared => c.unsure.push(row),
            // The agent runs with a value the ConfigMap had before: the edit did not reach it.
            (true, false) => c.not_applied.push(row),
            // A value the ConfigMap never had, from a per-node source: an override.
            (false, true) => c.overrides.push(row),
            // A value the mounted ConfigMap never had, and no per-node source: the mount may
            // lag behind (kubelet syncs it late; the restarted agent built its config from the
            // API server), or there is no history to tell. Unknown, never "not applied".
            (false, false) => c.unsure.push(row),
        }
    }
    c
}

/// Keys checks read, with Cilium's defaults: on a node with a per-node source, a loaded value
/// other than the default for a key the ConfigMap does not declare is an override too.
const DEFAULTS: [(&str, &str); 10] = [
    ("devices", ""),
    ("bpf-lb-acceleration", "disabled"),
    ("enable-l2-announcements", "false"),
    ("enable-host-firewall", "false"),
    ("enable-bpf-masquerade", "false"),
    ("enable-wireguard", "false"),
    ("enable-ipsec", "false"),
    ("enable-node-port", "false"),
    ("kube-proxy-replacement", "false"),
    // Cilium's own default is on (`defaults.EnableIPv6`); Helm writes false.
    ("enable-ipv6", "true"),
];

/// The effective configuration: the declared ConfigMap with the per-node overrides the
/// running agent loaded (Cilium's `build-config` merges the ConfigMap and the matching
/// CiliumNodeConfigs, later sources winning). Without the agent's answer, the ConfigMap.
pub fn effective(
    snap: &Snapshot,
    loaded: Option<&BTreeMap<String, String>>,
    started_at: Option<f64>,
    store: Option<&SnapshotStore>,
) -> Snapshot {
    let mut out = snap.clone();
    let Some(loaded) = loaded.filter(|l| per_node(l)) else {
        return out;
    };
    let c = classify(snap, loaded, started_at, store);
    // With a per-node source, a value the ConfigMap never had is the override; so is one the
    // check cannot place for want of history (no state directory): the agent loaded it.
    for row in c.overrides.iter().chain(&c.unsure) {
        if let (Some(k), Some(v)) = (row["key"].as_str(), row["loaded"].as_str()) {
            out.values.insert(k.to_string(), v.to_string());
        }
    }
    for (k, default) in DEFAULTS {
        if let Some(v) = loaded.get(k).filter(|_| !snap.values.contains_key(k)) {
            if !same(v, default) {
                out.values.insert(k.to_string(), v.clone());
            }
        }
    }
    out
}

pub fn evaluate(
    declared: Option<Result<&Snapshot, &crate::ciliumconfig::ReadError>>,
    loaded: Option<Result<&BTreeMap<String, String>, &crate::ciliumapi::ApiError>>,
    started_at: Option<f64>,
    store: Option<&SnapshotStore>,
) -> CheckResult {
    let snap = match declared {
        None => {
            return CheckResult::unknown(
                CHECK,
                Code::NoCiliumConfig,
                "no cilium-config directory configured (`cilium_config` / --cilium-config)",
                json!({}),
            )
        }
        Some(Err(e)) => {
            return CheckResult::unknown(
                CHECK,
                Code::CiliumConfigUnreadable,
                e.to_string(),
                json!({}),
            )
        }
        Some(Ok(s)) => s,
    };
    let loaded = match loaded {
        None => {
            return CheckResult::unknown(
                CHECK,
                Code::NoAgentApi,
                "cannot tell what the running cilium-agent loaded: set `cilium_api` to its API socket (/var/run/cilium/cilium.sock)",
                json!({"config_version": snap.version, "keys": snap.values.len()}),
            )
        }
        Some(Err(e)) => {
            return CheckResult::unknown(
                CHECK,
                Code::AgentApiUnreachable,
                format!("cannot ask the running cilium-agent what it loaded: {e}"),
                json!({"config_version": snap.version}),
            )
        }
        Some(Ok(l)) => l,
    };
    let Classified {
        sources,
        verified,
        verified_keys,
        not_applied,
        overrides,
        unsure,
        unverifiable,
        operator,
        live,
    } = classify(snap, loaded, started_at, store);
    let keys = |v: &[serde_json::Value]| {
        v.iter()
            .filter_map(|r| r["key"].as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let evidence = json!({
        "config_version": snap.version,
        "config_sources": sources,
        "verified": verified,
        "verified_keys": verified_keys,
        "not_applied": not_applied,
        "per_node_overrides": overrides,
        "override_or_not_applied": unsure,
        "unverifiable_keys": unverifiable,
        "operator_keys": operator,
        "applied_live": live,
    });
    if !not_applied.is_empty() {
        return CheckResult::fail(
            CHECK,
            Code::ConfigNotApplied,
            format!(
                "cilium-config changed but the running cilium-agent still has the old value: merged but inert until it restarts; changed keys: {}",
                keys(&not_applied)
            ),
            evidence,
        );
    }
    if !unsure.is_empty() {
        return CheckResult::unknown(
            CHECK,
            Code::ConfigUnverified,
            format!(
                "the running cilium-agent runs with values the mounted cilium-config does not declare on {}: {}",
                keys(&unsure),
                if store.is_none() {
                    "the mount may lag behind an edit, or a per-node override applies; to tell them apart give the agent's state directory (`--state-dir`, where the ConfigMap's history is kept)"
                } else if per_node(loaded) {
                    "the agent started before the edit and a per-node source (a CiliumNodeConfig) was loaded with it: either the edit waits for a restart or that source keeps the value (which keys it sets is not reported)"
                } else {
                    "values the ConfigMap never had, or the agent started after the edit and still runs another value (a flag, not the ConfigMap, sets it)"
                }
            ),
            evidence,
        );
    }
    let mut reason = format!(
        "the running cilium-agent loaded the declared cilium-config ({verified} keys verified"
    );
    if !overrides.is_empty() {
        reason.push_str(&format!("; per-node overrides: {}", keys(&overrides)));
    }
    if !live.is_empty() {
        reason.push_str(&format!(
            "; applied while it runs (it reports its start value): {}",
            keys(&live)
        ));
    }
    if !unverifiable.is_empty() {
        reason.push_str(&format!("; {} keys it does not report", unverifiable.len()));
    }
    if !operator.is_empty() {
        reason.push_str(&format!(
            "; {} keys only cilium-operator reads",
            operator.len()
        ));
    }
    reason.push(')');
    CheckResult::pass(CHECK, Code::ConfigApplied, reason, evidence)
}

/// The `config` node check: asks the agent's API what it loaded.
pub const NODE_CHECK: super::NodeCheck = super::NodeCheck {
    name: CHECK,
    needs: super::Needs {
        links: false,
        maps: false,
        agent: true,
        status: false,
    },
    from_probes: None,
    evaluate: evaluate_node,
    render: super::generic_lines,
};

fn evaluate_node<'a>(i: &'a super::Inputs<'a>) -> super::Evaluating<'a> {
    Box::pin(async move {
        let loaded = i.loaded;
        let mut r = evaluate(
            i.cilium,
            loaded.map(|r| r.map(|info| &info.settings)),
            loaded.and_then(|r| r.ok()).and_then(|info| info.started_at),
            i.store,
        );
        // The running agent's version, whatever the config verdict: a step reads it (the
        // release a declared upgrade is held to).
        if let (Some(Ok(info)), Some(obj)) = (loaded, r.evidence.as_object_mut()) {
            obj.insert(AGENT_VERSION.into(), json!(info.version));
        }
        r
    })
}

#[cfg(test)]
mod tests;
