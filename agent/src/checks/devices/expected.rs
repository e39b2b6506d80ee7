//! The devices the datapath must be on: the expected set (the running agent's answer, a
//! configured list or Cilium's own selection rules on this node's devices), which devices
//! carry Cilium's program now, and which Cilium would select.
use super::*;

/// Where the expected set came from.
#[derive(Clone, Debug, PartialEq)]
pub enum Expected {
    /// Names/patterns and where they were read.
    Patterns {
        patterns: Vec<String>,
        source: String,
        /// cilium-config `force-device-detection`: devices not matching the filter still go
        /// through auto-detection (selected = listed + detected).
        force: bool,
    },
    /// Cilium's auto-detection (no list configured anywhere).
    Auto,
    /// The devices the running cilium-agent reports it selected (its status): Cilium's own
    /// answer, which the kernel is then held to.
    Reported {
        devices: Vec<String>,
        /// The attach mode it reports (`tcx`, `tc`), when it does.
        attach_mode: Option<String>,
        /// Cilium's selection rules (the fallback) on the same node, for the evidence.
        rules: Box<Expected>,
    },
}

impl Expected {
    /// Where the expectation came from, for a reason line.
    pub fn decided_by(&self, rules: SelectionRules) -> String {
        match self {
            Expected::Reported { .. } => "the devices the cilium-agent reports it selected".into(),
            Expected::Patterns { source, .. } if source.starts_with("config ") => {
                format!("stepguard's {source}")
            }
            Expected::Patterns { source, .. } => {
                format!("Cilium {}'s selection rules on {source}", rules.label())
            }
            Expected::Auto => format!("Cilium {}'s auto-detection rules", rules.label()),
        }
    }
}

/// Cilium never auto-selects these as host devices (a controller other than a VRF from 1.20;
/// IPoIB from 1.18).
pub fn excluded(d: &Device, all: &[Device], rules: SelectionRules) -> bool {
    let controlled = d.has_controller
        && !(rules.alt_names_and_vrf
            && d.controller.is_some_and(|c| {
                all.iter()
                    .any(|m| m.ifindex == c && m.kind.as_deref() == Some("vrf"))
            }));
    EXCLUDED_PREFIXES.iter().any(|p| d.name.starts_with(p))
        || controlled
        || d.loopback
        || d.port
        || matches!(d.kind.as_deref(), Some("bridge") | Some("openvswitch"))
        || (rules.ipoib_excluded && d.kind.as_deref() == Some("ipoib"))
}

/// Cilium's `isSelectedDevice` (devices controller; 1.19.7 and 1.20.2 read, older releases
/// as cited in docs/cilium-fidelity.md). A device without a name is rejected. With a filter
/// (`devices`), a device matching it (its name, or from 1.20 an alternative name; the first
/// matching entry decides, `!` excludes) is selected or excluded **before** any other check
/// from 1.19 (up to 1.18 the address and up checks come first); one not matching is rejected
/// unless `force-device-detection` is on. Then auto-detection: an address, up, not a loopback
/// or bond port, no controller (from 1.20 a VRF is allowed), not an excluded prefix, not a
/// bridge, Open vSwitch or IPoIB device, not a veth without a default route (only when no
/// filter is set), and a route with a global-unicast destination. `all`: the node's devices
/// (a controller's kind).
pub fn selected_by_cilium(
    d: &Device,
    all: &[Device],
    filter: &[String],
    force: bool,
    rules: SelectionRules,
) -> bool {
    if d.name.is_empty() {
        return false;
    }
    let basic = d.addresses > 0 && d.up;
    if !rules.filter_first && !basic {
        return false;
    }
    if !filter.is_empty() {
        let mut m = filter_match(filter, &d.name);
        if m.is_none() && rules.alt_names_and_vrf {
            m = d.alt_names.iter().find_map(|a| filter_match(filter, a));
        }
        if let Some(selected) = m {
            return selected;
        }
        if !force {
            return false;
        }
    }
    if !basic || excluded(d, all, rules) {
        return false;
    }
    if filter.is_empty() && d.kind.as_deref() == Some("veth") && !d.default_route {
        return false;
    }
    d.global_route
}

/// Devices carrying `cil_from_netdev` on ingress (Cilium's own devices included).
pub fn carrying(devices: &[Device]) -> BTreeSet<String> {
    devices
        .iter()
        .filter(|d| d.carries("ingress", "cil_from_netdev"))
        .map(|d| d.name.clone())
        .collect()
}

/// The device names Cilium would select on this node.
pub fn expected_set(devices: &[Device], exp: &Expected) -> BTreeSet<String> {
    expected_set_by(devices, exp, SelectionRules::newest())
}

/// [`expected_set`] by a release's selection rules.
pub fn expected_set_by(
    devices: &[Device],
    exp: &Expected,
    rules: SelectionRules,
) -> BTreeSet<String> {
    let (filter, force): (&[String], bool) = match exp {
        Expected::Patterns {
            patterns, force, ..
        } => (patterns, *force),
        Expected::Auto => (&[], false),
        Expected::Reported { devices: names, .. } => {
            return devices
                .iter()
                .filter(|d| !ciliums_own(&d.name) && names.contains(&d.name))
                .map(|d| d.name.clone())
                .collect()
        }
    };
    devices
        .iter()
        .filter(|d| !ciliums_own(&d.name) && selected_by_cilium(d, devices, filter, force, rules))
        .map(|d| d.name.clone())
        .collect()
}

/// Names listed explicitly that are not on this node: Cilium only warns ("Link does not
/// exist") and runs without them, so they are reported, not failed.
pub fn listed_but_absent(devices: &[Device], exp: &Expected) -> Vec<String> {
    match exp {
        Expected::Patterns { patterns, .. } => patterns
            .iter()
            .filter(|p| {
                !p.ends_with('+')
                    && !p.starts_with('!')
                    && !devices
                        .iter()
                        .any(|d| &d.name == *p || d.alt_names.iter().any(|a| a == *p))
            })
            .cloned()
            .collect(),
        Expected::Reported { devices: names, .. } => names
            .iter()
            .filter(|n| !devices.iter().any(|d| &d.name == *n))
            .cloned()
            .collect(),
        Expected::Auto => vec![],
    }
}

/// The expectation when the running agent's status answered with the devices it selected:
/// its answer, unless stepguard's own configuration lists the devices (the operator's word
/// wins). Otherwise the re-derived rules, and why the agent's answer was not used.
pub fn expected_from_agent(
    rules: Expected,
    status: Option<Result<&crate::ciliumapi::AgentStatus, &crate::ciliumapi::ApiError>>,
) -> (Expected, Option<String>) {
    if matches!(&rules, Expected::Patterns { source, .. } if source.starts_with("config ")) {
        return (rules, None);
    }
    match status {
        None => (
            rules,
            Some("not asked (no `cilium_api` socket configured)".into()),
        ),
        Some(Err(e)) => (rules, Some(format!("not read: {e}"))),
        Some(Ok(s)) => match &s.devices {
            None => (
                rules,
                Some("the agent's status lists no devices (kube-proxy-replacement.deviceList absent: an agent still starting, or one that does not report them)".into()),
            ),
            Some(devices) => (
                Expected::Reported {
                    devices: devices.clone(),
                    attach_mode: s.attach_mode.clone(),
                    rules: Box::new(rules),
                },
                None,
            ),
        },
    }
}

/// The devices the node is expected to select: the agent config's list, else cilium-config's
/// `devices` key, else Cilium's auto-detection.
pub fn expected_devices(
    cfg: &crate::config::Config,
    cilium_cfg: Option<&crate::ciliumconfig::Snapshot>,
) -> Expected {
    let force = cilium_cfg
        .and_then(|s| s.values.get("force-device-detection"))
        .is_some_and(|v| v.trim() == "true");
    if !cfg.devices.expected.is_empty() {
        return Expected::Patterns {
            patterns: cfg.devices.expected.clone(),
            source: "config devices.expected".into(),
            force,
        };
    }
    if let Some(v) = cilium_cfg
        .and_then(|s| s.values.get("devices"))
        .map(|v| split_devices(v))
        .filter(|v| !v.is_empty())
    {
        return Expected::Patterns {
            patterns: v,
            source: "cilium-config key `devices`".into(),
            force,
        };
    }
    Expected::Auto
}
