//! The node checks' machine codes: one variant each, its name in JSON and its meaning. The
//! "Node check codes" table of docs/reference/checks.md lists every one (a test holds it to
//! this list).

/// Declares [`Code`] with its names and documentation in one place.
macro_rules! codes {
    ($( $(#[doc = $doc:expr])+ $variant:ident = $name:literal, )+) => {
        /// A node check's stable machine code (`device_missing`), beside its one-line reason.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum Code {
            $( $(#[doc = $doc])+ $variant, )+
        }

        impl Code {
            /// Every code, in the order of the reference table (docs/reference/checks.md).
            pub const ALL: &[Code] = &[$(Code::$variant),+];

            /// The code as JSON and Prometheus labels spell it.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Code::$variant => $name,)+
                }
            }

            /// Its meaning, one line (the first of its documentation).
            pub fn meaning(self) -> &'static str {
                match self {
                    $(Code::$variant => first_line(&[$($doc),+]).trim_ascii(),)+
                }
            }
        }
    };
}

const fn first_line(doc: &[&'static str]) -> &'static str {
    doc[0]
}

codes! {
    /// Passed (a generic pass, for checks with nothing more to say).
    Ok = "ok",
    /// Not judged yet: the agent has just started.
    NotCheckedYet = "not_checked_yet",
    /// devices: `cil_from_netdev` is on every expected device and no other.
    DevicesOk = "devices_ok",
    /// devices: an expected device lacks `cil_from_netdev`.
    DeviceMissing = "device_missing",
    /// devices: `cil_from_netdev` is on a device not expected.
    DeviceUnexpected = "device_unexpected",
    /// devices: both missing and unexpected devices.
    DeviceSetMismatch = "device_set_mismatch",
    /// devices: `cilium_host` is absent or lacks `cil_to_host`/`cil_from_host`.
    HostDeviceMissing = "host_device_missing",
    /// devices: `cil_to_netdev` is missing on a selected device while the configuration requires it.
    ToNetdevMissing = "to_netdev_missing",
    /// devices: `cil_to_netdev` is missing and only the ConfigMap (not the agent) says it is required.
    ToNetdevUnconfirmed = "to_netdev_unconfirmed",
    /// devices: the overlay device the configuration asks for lacks `cil_from_overlay`.
    OverlayMissing = "overlay_missing",
    /// devices: an overlay device the configuration does not ask for still carries Cilium's programs.
    OverlayUnexpected = "overlay_unexpected",
    /// devices: none configured and none auto-detected, so nothing to compare.
    NoExpectedDevices = "no_expected_devices",
    /// devices, maps: the agent lacks the capability to read programs or pinned maps.
    NoPermission = "no_permission",
    /// devices: the kernel refused a read the observation needed.
    KernelError = "kernel_error",
    /// devices: the netlink dump failed.
    NetlinkError = "netlink_error",
    /// devices, maps: no observation yet.
    NotObserved = "not_observed",
    /// maps: every map the node's release and features require is pinned.
    MapsOk = "maps_ok",
    /// maps: a required pinned map is absent.
    MapMissing = "map_missing",
    /// maps: a pinned map could not be read.
    MapUnreadable = "map_unreadable",
    /// maps: the bpffs (or its `tc/globals`) is not there.
    BpffsMissing = "bpffs_missing",
    /// maps: the Cilium release could not be told (not configured, not inferred from the maps).
    VersionUnknown = "version_unknown",
    /// vips: every VIP target answered.
    VipsOk = "vips_ok",
    /// vips: a VIP target did not answer.
    VipUnreachable = "vip_unreachable",
    /// vips: an east-west target routes locally, so it proves nothing about the fabric.
    EastWestTargetLocal = "east_west_target_local",
    /// vips: the routes of the east-west targets are not known yet.
    EastWestUnconfirmed = "east_west_unconfirmed",
    /// vips: no targets configured.
    NoTargets = "no_targets",
    /// vips, dns: a probe could not be sent (no socket, no permission).
    ProbeNotRun = "probe_not_run",
    /// vips, dns: no probe has finished yet.
    NoProbeYet = "no_probe_yet",
    /// dns: the resolvers answered, within the latency bound.
    DnsOk = "dns_ok",
    /// dns: the resolvers' p99 latency is over the bound.
    DnsSlow = "dns_slow",
    /// dns: too few queries answered, some with errors.
    DnsFailures = "dns_failures",
    /// dns: too few queries answered, every failure a timeout.
    DnsTimeout = "dns_timeout",
    /// dns: no resolver has answered since the agent started.
    ResolverNeverAnswered = "resolver_never_answered",
    /// dns: no resolvers or names configured.
    NoResolvers = "no_resolvers",
    /// dns: the node's resolver configuration could not be read.
    ConfigError = "config_error",
    /// config: the running cilium-agent loaded the ConfigMap's values.
    ConfigApplied = "config_applied",
    /// config: the running cilium-agent runs with values other than the ConfigMap's.
    ConfigNotApplied = "config_not_applied",
    /// config: some values could not be compared (not in what the agent reports).
    ConfigUnverified = "config_unverified",
    /// config: no cilium-config directory configured.
    NoCiliumConfig = "no_cilium_config",
    /// config: the cilium-config directory could not be read.
    CiliumConfigUnreadable = "cilium_config_unreadable",
    /// config: no cilium-agent API socket configured.
    NoAgentApi = "no_agent_api",
    /// config: the cilium-agent API did not answer.
    AgentApiUnreachable = "agent_api_unreachable",
}

impl std::fmt::Display for Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Compared with its name (tests and callers holding a name read from JSON).
impl PartialEq<&str> for Code {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl serde::Serialize for Code {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::Code;

    /// Every code has its own name, and the reference table (docs/reference/checks.md) lists
    /// each with its meaning.
    #[test]
    fn every_code_is_in_the_reference_table() {
        let readme = include_str!("../../../docs/reference/checks.md");
        let mut seen = std::collections::BTreeSet::new();
        for c in Code::ALL {
            assert!(seen.insert(c.as_str()), "{} twice", c.as_str());
            let row = format!("| `{}` |", c.as_str());
            assert!(
                readme.lines().any(|l| l.starts_with(&row)),
                "docs/reference/checks.md has no row {row} …: add `{row} {} |`",
                c.meaning()
            );
        }
    }
}
