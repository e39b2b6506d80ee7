//! Runs the node checks: reads what several checks share once (device observation, maps,
//! cilium-config), then decides each check on its own.
use crate::checks::{self, CheckResult};
use crate::ciliumconfig::{self, SnapshotStore};
use crate::config::Config;
use crate::kernel::{bpffs, links};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Instant;

/// Everything the node checks need beyond the config file.
#[derive(Clone, Debug, Default)]
pub struct NodeOptions {
    /// Where the agent keeps state (cilium-config snapshots); None = remember nothing.
    pub state_dir: Option<PathBuf>,
    /// Count every map's entries (a person's one-off check), not only those a verdict judges.
    pub count_all: bool,
    /// The agent's topology cache (dumps only when rtnetlink reports a host-device change).
    pub topology: Option<links::SharedTopology>,
}

/// What the last run observed, for callers that need more than verdicts (metrics, steps).
#[derive(Clone, Debug, Default)]
pub struct NodeObservation {
    pub links: Option<links::Observation>,
    pub maps: Option<bpffs::MapsObservation>,
    /// The version the running cilium-agent's API reported (None: not asked, not
    /// answering, or not reported).
    pub agent_version: Option<String>,
    /// The overlay the node's configuration asks for (the agent's loaded configuration, or
    /// the ConfigMap when no API socket is configured), and when it was read (unix seconds,
    /// before the read began). None: not known.
    pub overlay: Option<(crate::cilium::devices::OverlayIntent, f64)>,
    /// What the node's configuration asks of its endpoints and host hooks (the endpoint
    /// health checker, XDP's mode), read as `overlay` is. None: not known.
    pub asks: Option<crate::cilium::devices::Asks>,
}

/// Runs the registered checks named in `only` (all when empty), in registry order: reads what
/// the wanted checks need once (devices, maps, cilium-config), then decides each on its own.
pub async fn run(
    cfg: &Config,
    opts: &NodeOptions,
    only: &BTreeSet<String>,
) -> (Vec<CheckResult>, NodeObservation) {
    let wanted: Vec<&checks::NodeCheck> = checks::REGISTRY
        .iter()
        .copied()
        .filter(|c| only.is_empty() || only.contains(c.name))
        .collect();
    let needs = wanted
        .iter()
        .fold(checks::Needs::default(), |a, c| checks::Needs {
            links: a.links || c.needs.links,
            maps: a.maps || c.needs.maps,
            agent: a.agent || c.needs.agent,
            status: a.status || c.needs.status,
        });
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
    // Observation time counts towards the first check that needs it.
    let t = Instant::now();
    let links = if needs.links {
        Some(links::observe_via(opts.topology.as_ref(), &cfg.bpffs).await)
    } else {
        None
    };
    let links_took = t.elapsed();
    let t = Instant::now();
    let maps = if needs.maps {
        Some(checks::maps::observe(&cfg.bpffs, opts.count_all).await)
    } else {
        None
    };
    let maps_took = t.elapsed();
    // What the running cilium-agent loaded (read once per start of it), and with it the
    // effective configuration the checks expect.
    let t = Instant::now();
    let read_at = crate::kernel::clock::now();
    let loaded = match &cfg.cilium_api {
        Some(sock) if needs.agent => Some(crate::ciliumapi::loaded_settings_cached(sock).await),
        _ => None,
    };
    // What it selected (its status: read again at a restart, or when 10 s old).
    let status = match &cfg.cilium_api {
        Some(sock) if needs.status => Some(crate::ciliumapi::agent_status_cached(sock).await),
        _ => None,
    };
    let loaded_took = t.elapsed();
    let effective = match (cilium_snap, &loaded) {
        (Some(s), Some(Ok(l))) => Some(checks::config::effective(
            s,
            Some(&l.settings),
            l.started_at,
            store.as_ref(),
        )),
        _ => None,
    };
    let inputs = checks::Inputs {
        cfg,
        cilium: cilium_cfg.as_ref().map(|r| r.as_ref()),
        store: store.as_ref(),
        loaded: loaded.as_ref().map(|r| r.as_ref()),
        effective: effective.as_ref(),
        status: status.as_ref().map(|r| r.as_ref()),
        links: links.as_ref(),
        maps: maps.as_ref(),
    };
    let mut results = Vec::new();
    let (mut links_counted, mut maps_counted) = (false, false);
    // The agent's settings are read once for all: their time counts towards the last check
    // that uses them (`config`, when it runs: it is read for it first).
    let loaded_to = wanted.iter().rev().find(|c| c.needs.agent).map(|c| c.name);
    for c in wanted {
        let t = Instant::now();
        let mut r = (c.evaluate)(&inputs).await;
        r.duration_ms = t.elapsed();
        if c.needs.links && !links_counted {
            r.duration_ms += links_took;
            links_counted = true;
        }
        if loaded_to == Some(c.name) {
            r.duration_ms += loaded_took;
        }
        if c.needs.maps && !maps_counted {
            r.duration_ms += maps_took;
            maps_counted = true;
        }
        results.push(r);
    }
    // What the node's configuration asks for: what the agent loaded, or the ConfigMap when no
    // API socket is configured (it alone decides then).
    let intended = match (&cfg.cilium_api, effective.as_ref(), cilium_snap) {
        (Some(_), Some(e), _) => Some(e),
        (None, _, Some(s)) => Some(s),
        _ => None,
    };
    let release = loaded
        .as_ref()
        .and_then(|l| l.as_ref().ok())
        .and_then(|l| l.version.as_deref())
        .and_then(crate::cilium::profile::release_of);
    let overlay = intended.map(|s| {
        let i = crate::cilium::devices::overlay_intent(&s.values)
            .with_hooks(&s.values, release.as_deref());
        (i, read_at)
    });
    let asks = intended.map(|s| crate::cilium::devices::asks(&s.values));
    let obs = NodeObservation {
        overlay,
        asks,
        links: links.and_then(|o| o.ok()),
        maps: maps.and_then(|o| o.ok()),
        agent_version: loaded
            .as_ref()
            .and_then(|l| l.as_ref().ok())
            .and_then(|l| l.version.clone()),
    };
    (results, obs)
}
