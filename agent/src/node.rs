//! Runs the node checks: reads what several checks share once (device observation, maps,
//! cilium-config), then decides each check on its own.
use crate::checks::{self, config as config_check, devices, dns, maps, vips, CheckResult};
use crate::ciliumconfig::{self, SnapshotStore};
use crate::config::Config;
use crate::kernel::{bpffs, links};
use crate::profile::{CiliumVersion, Features};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Instant;

/// Everything the node checks need beyond the config file.
#[derive(Clone, Debug, Default)]
pub struct NodeOptions {
    /// Where the agent keeps state (cilium-config snapshots); None = remember nothing.
    pub state_dir: Option<PathBuf>,
}

/// What the last run observed, for callers that need more than verdicts (metrics, steps).
#[derive(Clone, Debug, Default)]
pub struct NodeObservation {
    pub links: Option<links::Observation>,
    pub maps: Option<bpffs::MapsObservation>,
}

fn features(cfg: &Config, cilium_cfg: Option<&ciliumconfig::Snapshot>) -> (Features, String) {
    let mut base = Features::default();
    if let Some(v) = cfg.maps.ipv6 {
        base.ipv6 = v;
    }
    if let Some(v) = cfg.maps.snat {
        base.snat = v;
    }
    if let Some(v) = cfg.maps.l2_announcements {
        base.l2_announcements = v;
    }
    match cilium_cfg {
        Some(s) => (
            Features::from_cilium_config(&s.values, base),
            "cilium-config".into(),
        ),
        None => (base, "agent config / defaults".into()),
    }
}

fn expected_devices(
    cfg: &Config,
    cilium_cfg: Option<&ciliumconfig::Snapshot>,
) -> devices::Expected {
    if !cfg.devices.expected.is_empty() {
        return devices::Expected::Patterns {
            patterns: cfg.devices.expected.clone(),
            source: "config devices.expected".into(),
        };
    }
    if let Some(v) = cilium_cfg
        .and_then(|s| s.values.get("devices"))
        .map(|v| devices::split_devices(v))
        .filter(|v| !v.is_empty())
    {
        return devices::Expected::Patterns {
            patterns: v,
            source: "cilium-config key `devices`".into(),
        };
    }
    devices::Expected::Auto
}

/// Runs the checks named in `only` (all when empty), in the order of NODE_CHECKS.
pub async fn run(
    cfg: &Config,
    opts: &NodeOptions,
    only: &BTreeSet<String>,
) -> (Vec<CheckResult>, NodeObservation) {
    let wanted = |c: &str| only.is_empty() || only.contains(c);
    let mut obs = NodeObservation::default();
    let cilium_cfg = cfg
        .cilium_config
        .as_ref()
        .map(|d| ciliumconfig::read_named(d));
    let cilium_snap = cilium_cfg.as_ref().and_then(|r| r.as_ref().ok());
    let store = opts.state_dir.as_ref().map(|d| SnapshotStore::new(d));
    if let (Some(store), Some(s)) = (&store, cilium_snap) {
        if let Err(e) = store.remember(s) {
            tracing::warn!(error = %e, "cannot remember the cilium-config snapshot");
        }
    }

    let mut results = Vec::new();
    let mut link_obs: Option<Result<links::Observation, links::LinkError>> = None;
    if wanted("devices") || wanted("config") {
        let t = Instant::now();
        let o = links::observe(&cfg.bpffs).await;
        if wanted("devices") {
            let mut r = match &o {
                Ok(o) => devices::evaluate(o, &expected_devices(cfg, cilium_snap)),
                Err(e) => CheckResult::unknown(
                    devices::CHECK,
                    "netlink_error",
                    e.to_string(),
                    serde_json::json!({}),
                ),
            };
            r.duration_ms = t.elapsed();
            results.push(r);
        }
        link_obs = Some(o);
    }
    if wanted("maps") {
        let t = Instant::now();
        let o = bpffs::observe_blocking(&cfg.bpffs, true).await;
        let (features, features_from) = features(cfg, cilium_snap);
        let exp = maps::MapsExpectation {
            // A version newer than the newest profile is checked against the newest (the
            // maps check says so): never failed for names the profile does not know.
            version: CiliumVersion::parse(&cfg.cilium).or_else(|| {
                CiliumVersion::newer_than_newest(&cfg.cilium).then_some(CiliumVersion::NEWEST)
            }),
            newer: CiliumVersion::newer_than_newest(&cfg.cilium).then(|| cfg.cilium.clone()),
            features,
            features_from,
            required: cfg.maps.required.clone(),
            optional: cfg.maps.optional.clone(),
        };
        let mut r = maps::evaluate(o.as_ref(), &exp);
        r.duration_ms = t.elapsed();
        results.push(r);
        obs.maps = o.ok();
    }
    if wanted("vips") {
        let t = Instant::now();
        let mut r = vips::run(&cfg.targets).await;
        r.duration_ms = t.elapsed();
        results.push(r);
    }
    if wanted("dns") {
        let t = Instant::now();
        let mut r = dns::run(&cfg.dns).await;
        r.duration_ms = t.elapsed();
        results.push(r);
    }
    if wanted("config") {
        let t = Instant::now();
        let loaded = match &link_obs {
            Some(Ok(o)) if !o.prog_details_unreadable => devices::datapath_loaded_at(o),
            _ => None,
        };
        let current = cilium_cfg.as_ref().map(|r| r.as_ref());
        let mut r = config_check::evaluate(current, loaded, store.as_ref());
        r.duration_ms = t.elapsed();
        results.push(r);
    }
    obs.links = link_obs.and_then(|o| o.ok());
    results.sort_by_key(|r| checks::NODE_CHECKS.iter().position(|c| *c == r.check));
    (results, obs)
}
