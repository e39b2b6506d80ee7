//! What a step reads of a kernel observation: the programs it follows for the reload, the
//! endpoints' programs, the maps' counts and ids, and the baseline taken from them. Pure:
//! the daemon makes the observations (and the reads they need) and passes them in.
use super::{Baseline, EndpointPrograms, EndpointsFollowed};
use crate::checks::CheckResult;
use crate::cilium::devices::{self, FROM_HOST_KEY, TO_NETDEV_KEY, TO_OVERLAY_KEY, XDP_KEY};
use crate::cilium::profile;
use crate::kernel::bpffs::MapsObservation;
use crate::kernel::links;
use std::collections::BTreeMap;

/// What the reload check follows under a tracking key: the device and the program (Cilium's
/// entry points, bpf/bpf_host.c, bpf_overlay.c, bpf_xdp.c): `cil_from_netdev` on a host
/// device, `cil_to_host` on cilium_host, `cil_from_overlay` on the overlay device, and
/// `cil_xdp_entry` for `<dev>:xdp`, `cil_to_netdev` (egress) for `<dev>:to_netdev`.
pub fn tracked_program(key: &str) -> (&str, &'static str, &'static str) {
    if let Some(dev) = key.strip_suffix(XDP_KEY) {
        (dev, "xdp", "cil_xdp_entry")
    } else if let Some(dev) = key.strip_suffix(TO_NETDEV_KEY) {
        (dev, "egress", "cil_to_netdev")
    } else if let Some(dev) = key.strip_suffix(FROM_HOST_KEY) {
        (dev, "egress", "cil_from_host")
    } else if let Some(dev) = key.strip_suffix(TO_OVERLAY_KEY) {
        (dev, "egress", "cil_to_overlay")
    } else if key == "cilium_host" || key == "cilium_net" {
        (key, "ingress", "cil_to_host")
    } else if devices::is_overlay(key) {
        (key, "ingress", "cil_from_overlay")
    } else {
        (key, "ingress", "cil_from_netdev")
    }
}

/// Program id per tracking key (see [`tracked_program`]). None when the program is gone.
pub fn current_programs(
    obs: &links::Observation,
    keys: &[String],
) -> BTreeMap<String, Option<u32>> {
    keys.iter()
        .map(|key| {
            let (dev, hook, prog) = tracked_program(key);
            let id = obs
                .devices
                .iter()
                .find(|d| d.name == dev)
                .and_then(|d| d.programs.iter().find(|p| p.hook == hook && p.is(prog)))
                .map(|p| p.prog_id);
            (key.clone(), id)
        })
        .collect()
}

/// Cilium's programs on every endpoint device, by device name (see
/// `links::endpoint_hooks`): `cil_from_container` on ingress or netkit's peer hook,
/// `cil_to_container` on egress or netkit's primary hook.
///
/// A host device carrying `cil_from_container` on ingress is an endpoint too, whatever its
/// name: under CNI chaining (generic-veth: `cali*`, `eni*`) Cilium attaches its endpoint
/// programs to the primary plugin's host veth, and an `lxc` device renamed keeps them.
pub fn endpoint_programs(obs: &links::Observation) -> BTreeMap<String, EndpointPrograms> {
    let chained = obs.devices.iter().filter_map(|d| {
        let find = |hook: &str, prog: &str| {
            d.programs
                .iter()
                .find(|p| p.hook == hook && p.is(prog))
                .map(|p| p.prog_id)
        };
        let from = find("ingress", "cil_from_container")?;
        Some((
            d.name.clone(),
            EndpointPrograms {
                ifindex: d.ifindex,
                from_container: Some(from),
                to_container: find("egress", "cil_to_container"),
                raced: false,
            },
        ))
    });
    obs.endpoints
        .iter()
        .map(|e| {
            let [(entry, _), (exit, _)] = links::endpoint_hooks(e.kind.as_deref());
            let find = |hook: &str, prog: &str| {
                e.programs
                    .iter()
                    .find(|p| p.hook == hook && p.is(prog))
                    .map(|p| p.prog_id)
            };
            (
                e.name.clone(),
                EndpointPrograms {
                    ifindex: e.ifindex,
                    from_container: find(entry, "cil_from_container"),
                    to_container: find(exit, "cil_to_container"),
                    raced: e.raced,
                },
            )
        })
        .chain(chained)
        .collect()
}

/// The endpoints' programs as a step reads them during its course: [`endpoint_programs`],
/// and every other device of the node by name with none (an endpoint's device renamed or
/// stripped of its programs still exists: by its ifindex it is no deletion).
pub fn endpoint_readings(obs: &links::Observation) -> BTreeMap<String, EndpointPrograms> {
    let mut out = endpoint_programs(obs);
    for d in &obs.devices {
        out.entry(d.name.clone()).or_insert(EndpointPrograms {
            ifindex: d.ifindex,
            from_container: None,
            to_container: None,
            raced: false,
        });
    }
    out
}

/// The endpoints a step follows: those carrying `cil_from_container` at the start, read
/// consistently; unknown when endpoint programs could not be queried.
pub fn endpoint_baseline(
    obs: &links::Observation,
) -> (BTreeMap<String, EndpointPrograms>, EndpointsFollowed, usize) {
    if let Some(p) = obs.endpoint_problems.first() {
        return (BTreeMap::new(), EndpointsFollowed::Unknown(p.clone()), 0);
    }
    let all = endpoint_programs(obs);
    let eps: BTreeMap<_, _> = all
        .iter()
        .filter(|(_, e)| e.from_container.is_some() && !e.raced)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let excluded = all.len() - eps.len();
    // Cilium attaches cil_from_container to every endpoint: endpoint devices of which none
    // carries it were not read as they are (a hook or kind not understood).
    if eps.is_empty() && !all.is_empty() {
        return (
            eps,
            EndpointsFollowed::Unknown(format!(
                "{} endpoint devices, none carrying cil_from_container where Cilium attaches it",
                all.len()
            )),
            excluded,
        );
    }
    (eps, EndpointsFollowed::Followed, excluded)
}

/// The keys a step follows for the reload — every hook Cilium attaches on the devices it
/// manages (docs/cilium-fidelity.md, "Hooks per device"): the selected host devices
/// (`cil_from_netdev`), `<dev>:to_netdev` (`cil_to_netdev`) and `<dev>:xdp`
/// (`cil_xdp_entry`) where they carry them; `cilium_host` (`cil_to_host` on ingress) and
/// `cilium_host:from_host` (`cil_from_host` on egress); `cilium_net` (`cil_to_host`); the
/// overlay device (`cil_from_overlay`) and `<overlay>:to_overlay` (`cil_to_overlay`). Cilium
/// reloads all of them on every start, so each must carry a new program id after it.
pub fn reload_keys(obs: &links::Observation, selected: &[String]) -> Vec<String> {
    let mut keys = selected.to_vec();
    let carries = |name: &str, hook: &str, prog: &str| {
        obs.devices
            .iter()
            .any(|d| d.name == name && d.programs.iter().any(|p| p.hook == hook && p.is(prog)))
    };
    if obs.devices.iter().any(|x| x.name == "cilium_host") {
        keys.push("cilium_host".into());
        if carries("cilium_host", "egress", "cil_from_host") {
            keys.push(format!("cilium_host{FROM_HOST_KEY}"));
        }
    }
    if carries("cilium_net", "ingress", "cil_to_host") {
        keys.push("cilium_net".into());
    }
    for d in obs.devices.iter().filter(|d| devices::is_overlay(&d.name)) {
        if carries(&d.name, "ingress", "cil_from_overlay") {
            keys.push(d.name.clone());
        }
        if carries(&d.name, "egress", "cil_to_overlay") {
            keys.push(format!("{}{TO_OVERLAY_KEY}", d.name));
        }
    }
    for dev in selected {
        if carries(dev, "xdp", "cil_xdp_entry") {
            keys.push(format!("{dev}{XDP_KEY}"));
        }
        if carries(dev, "egress", "cil_to_netdev") {
            keys.push(format!("{dev}{TO_NETDEV_KEY}"));
        }
    }
    keys
}

/// Map ids of the global maps.
pub fn map_ids(m: &MapsObservation) -> BTreeMap<String, u32> {
    m.globals.iter().map(|(k, v)| (k.clone(), v.id)).collect()
}

pub fn map_counts(m: &MapsObservation) -> BTreeMap<String, Option<u64>> {
    m.globals
        .iter()
        .map(|(k, v)| (k.clone(), v.entries))
        .collect()
}

/// Why a step cannot begin: no baseline can be taken (503).
#[derive(Debug, thiserror::Error)]
pub enum BeginError {
    #[error("cannot take a baseline: {0}")]
    Links(#[from] links::LinkError),
    #[error("cannot take a baseline: {0}")]
    ProgramsUnreadable(String),
    #[error("cannot take a baseline: no device carries cil_from_netdev")]
    NoDatapath,
    #[error("witness {url}: {problem} (the step was not begun)")]
    Witness { url: String, problem: String },
}

/// What a baseline is taken from besides the devices: the maps' observation and what the
/// daemon read around it.
pub struct BaselineInputs<'a> {
    pub maps: Option<&'a MapsObservation>,
    /// The entries of [`entries_to_name`]'s maps in Cilium's terms.
    pub map_entries: BTreeMap<String, Vec<String>>,
    /// The version the agent's API reported (None: not configured or not answering).
    pub agent_version: Option<String>,
    pub node_checks: &'a [CheckResult],
    pub kernel_drops: Option<BTreeMap<String, u64>>,
    pub cilium_drops: Option<BTreeMap<String, u64>>,
    /// DNS p50 over the last minute, milliseconds.
    pub dns_p50_ms: Option<f64>,
}

/// The small kept-state maps whose entries a baseline names (so a loss can be named; maps
/// above `profile::NAMED_ENTRIES_MAX` entries are only counted).
pub fn entries_to_name(maps: Option<&MapsObservation>) -> Vec<String> {
    let Some(m) = maps else { return vec![] };
    map_counts(m)
        .into_iter()
        .filter(|(name, n)| {
            profile::names_entries(name) && n.is_some_and(|n| n <= profile::NAMED_ENTRIES_MAX)
        })
        .map(|(n, _)| n)
        .collect()
}

impl Baseline {
    /// The baseline from an observation of the devices and `i` (taken now, or kept from the
    /// steady cadence for an implicit step).
    pub fn take(obs: &links::Observation, i: BaselineInputs) -> Result<Baseline, BeginError> {
        if obs.prog_details_unreadable {
            return Err(BeginError::ProgramsUnreadable(
                obs.problems.first().cloned().unwrap_or_default(),
            ));
        }
        // Host devices only: Cilium's own devices change programs by design across versions
        // (cilium_wg0: cil_from_netdev up to 1.17, cil_from_wireguard from 1.18).
        let selected: Vec<String> = obs
            .devices
            .iter()
            .filter(|d| d.carries("ingress", "cil_from_netdev") && !devices::ciliums_own(&d.name))
            .map(|d| d.name.clone())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        if selected.is_empty() {
            return Err(BeginError::NoDatapath);
        }
        let tracked = reload_keys(obs, &selected);
        let programs: BTreeMap<String, u32> = current_programs(obs, &tracked)
            .into_iter()
            .filter_map(|(k, v)| v.map(|v| (k, v)))
            .collect();
        let maps = i.maps.map(map_counts).unwrap_or_default();
        let map_ids = i.maps.map(map_ids).unwrap_or_default();
        let endpoint_maps = i.maps.map(|m| m.endpoint_maps.clone()).unwrap_or_default();
        let (cilium, cilium_from) = match &i.agent_version {
            Some(full) => (
                profile::release_of(full),
                Some(super::verdict::VersionSource::AgentApi(full.clone()).describe()),
            ),
            None => (None, None),
        };
        let (cilium, cilium_from) = match cilium {
            Some(c) => (Some(c), cilium_from),
            None => (
                profile::version_label(&profile::names_for_inference(maps.keys(), &endpoint_maps)),
                Some("pinned map names".to_string()),
            ),
        };
        let node_checks = i
            .node_checks
            .iter()
            .map(|r| (r.check.to_string(), r.status.as_str().to_string()))
            .collect();
        let (endpoints, endpoints_followed, endpoints_excluded) = endpoint_baseline(obs);
        Ok(Baseline {
            endpoints,
            endpoints_followed,
            endpoints_excluded,
            cilium,
            cilium_from,
            endpoint_maps,
            map_entries: i.map_entries,
            programs,
            selected,
            maps,
            dns_p50_ms: i.dns_p50_ms,
            drops_unknown_at_start: [
                ("kernel", i.kernel_drops.is_none()),
                ("cilium", i.cilium_drops.is_none()),
            ]
            .into_iter()
            .filter(|(_, unknown)| *unknown)
            .map(|(s, _)| s.to_string())
            .collect(),
            kernel_drops: i.kernel_drops.unwrap_or_default(),
            cilium_drops: i.cilium_drops.unwrap_or_default(),
            node_checks,
            map_ids,
        })
    }
}
