//! How Cilium names, selects and hooks host devices, from its configuration: the device
//! filter (`devices`), each release's selection rules, which settings require
//! `cil_to_netdev`, the overlay device a configuration asks for, and the reload keys of the
//! host hooks. The `devices` check holds the kernel to them.
use std::collections::BTreeMap;

/// Whether the datapath must also carry `cil_to_netdev` (egress) on every selected device:
/// Cilium's loader attaches it exactly when `AreDevicesRequired()` holds and detaches it
/// otherwise (docs/cilium-fidelity.md). `because`: the configuration keys that make it so;
/// empty: not required.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ToNetdev {
    pub because: Vec<String>,
    /// Judged from the ConfigMap alone (the agent's effective configuration could not be
    /// read: a per-node override may turn the requirement off): a missing `cil_to_netdev` is
    /// then `unknown`, not a failure.
    pub unconfirmed: bool,
}

/// A boolean setting as Go's `strconv.ParseBool` reads it (`1`, `t`, `T`, `TRUE`, `true`,
/// `True`), plus `strict` (kube-proxy-replacement's old value).
pub fn on(cfg: &BTreeMap<String, String>, k: &str) -> bool {
    cfg.get(k).is_some_and(|v| {
        matches!(
            v.trim(),
            "1" | "t" | "T" | "TRUE" | "true" | "True" | "strict"
        )
    })
}

/// `AreDevicesRequired()` from the effective configuration, at `release` (`1.18`) when known:
/// NodePort (`kube-proxy-replacement`, or `enable-node-port` before 1.19), host firewall,
/// WireGuard, L2 announcements, IPsec (`enable-ipsec`; 1.16: `enable-ipsec-encrypted-overlay`),
/// BPF masquerade (its own term since 1.19; before, it requires NodePort, so the same), and
/// high-scale ipcache up to 1.17.
pub fn to_netdev_required(cfg: &BTreeMap<String, String>, release: Option<&str>) -> ToNetdev {
    let minor = release.and_then(crate::cilium::profile::minor_of);
    let mut keys: Vec<&str> = vec![
        "kube-proxy-replacement",
        "enable-host-firewall",
        "enable-wireguard",
        "enable-l2-announcements",
        "enable-bpf-masquerade",
    ];
    if minor.is_none_or(|m| m <= 18) {
        keys.push("enable-node-port");
    }
    match minor {
        Some(16) => keys.push("enable-ipsec-encrypted-overlay"),
        _ => keys.push("enable-ipsec"),
    }
    if minor.is_some_and(|m| m <= 17) {
        keys.push("enable-high-scale-ipcache");
    }
    ToNetdev {
        because: keys
            .into_iter()
            .filter(|k| on(cfg, k))
            .map(String::from)
            .collect(),
        unconfirmed: false,
    }
}

/// Splits a cilium-config `devices` value (`eth0 eth1`, `eth0,eth1`, `eth+`).
pub fn split_devices(value: &str) -> Vec<String> {
    value
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect()
}

/// One entry of Cilium's device filter against a name (`tables.DeviceFilter.Match`): an entry
/// ending in `+` (every trailing `+` trimmed; a bare `+` matches all) is a prefix, otherwise
/// the exact name. A leading `!` is not part of the pattern (see [`filter_match`]).
pub fn matches(pattern: &str, name: &str) -> bool {
    let pattern = pattern.strip_prefix('!').unwrap_or(pattern);
    if pattern.ends_with('+') {
        name.starts_with(pattern.trim_end_matches('+'))
    } else {
        pattern == name
    }
}

/// Cilium's `DeviceFilter.Match` (1.19.7, 1.20.2 `pkg/datapath/tables/device.go`): the first
/// entry that matches decides; one written `!entry` excludes the device. Some(selected), or
/// None when no entry matches.
pub fn filter_match(filter: &[String], name: &str) -> Option<bool> {
    filter
        .iter()
        .find(|p| matches(p, name))
        .map(|p| !p.starts_with('!'))
}

/// What a Cilium release's device selection (`isSelectedDevice`) does beyond the rules all
/// releases share.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SelectionRules {
    /// The filter is matched before the address and flag checks (1.19+): a listed device
    /// without an address, or down, is selected.
    pub filter_first: bool,
    /// The filter also matches alternative names, and a VRF controller does not exclude a
    /// device (1.20+).
    pub alt_names_and_vrf: bool,
    /// IPoIB devices are never auto-detected (1.18+).
    pub ipoib_excluded: bool,
}

impl SelectionRules {
    /// For a release (`1.19`); the newest rules when the release is not known (no profile
    /// is older than the agent it judges, see `profile::newer_than_newest`).
    pub fn of(release: Option<&str>) -> SelectionRules {
        match release.and_then(crate::cilium::profile::minor_of) {
            Some(m) => SelectionRules {
                filter_first: m >= 19,
                alt_names_and_vrf: m >= 20,
                ipoib_excluded: m >= 18,
            },
            None => SelectionRules::newest(),
        }
    }

    /// The releases these rules are those of, for people.
    pub fn label(self) -> &'static str {
        match (
            self.filter_first,
            self.alt_names_and_vrf,
            self.ipoib_excluded,
        ) {
            (true, true, _) => "1.20+",
            (true, false, _) => "1.19",
            (false, _, true) => "1.18",
            (false, _, false) => "1.16-1.17",
        }
    }

    pub fn newest() -> SelectionRules {
        SelectionRules {
            filter_first: true,
            alt_names_and_vrf: true,
            ipoib_excluded: true,
        }
    }
}

/// Name prefixes Cilium never auto-selects (`defaults.ExcludedDevicePrefixes`).
pub const EXCLUDED_PREFIXES: [&str; 5] = ["cilium_", "lo", "lxc", "cni", "docker"];

/// Cilium's own devices (`cilium_host`, `cilium_net`, the overlay, `cilium_wg0`,
/// `cilium_ipip4/6`): they carry its programs by design and are never compared as host
/// devices (`cilium_wg0` carries `cil_from_netdev` up to 1.17).
pub fn ciliums_own(name: &str) -> bool {
    name.starts_with("cilium_")
}

/// Suffix of the reload-tracking key for a device's XDP program (`eth0:xdp`).
pub const XDP_KEY: &str = ":xdp";
/// Reload key suffix for a device's `cil_to_netdev` (egress), followed when it was there.
pub const TO_NETDEV_KEY: &str = ":to_netdev";

/// The step's reload key suffix for `cil_from_host` on `cilium_host`'s egress.
pub const FROM_HOST_KEY: &str = ":from_host";

/// The step's reload key suffix for `cil_to_overlay` on the overlay device's egress.
pub const TO_OVERLAY_KEY: &str = ":to_overlay";

/// Cilium's overlay devices (tunnel routing mode: VXLAN or Geneve), which carry
/// `cil_from_overlay`/`cil_to_overlay`.
pub fn is_overlay(name: &str) -> bool {
    matches!(name, "cilium_vxlan" | "cilium_geneve")
}

/// The overlay device a configuration asks for (Cilium's tunnel config, `pkg/datapath/tunnel`
/// `newConfig` and its enablers): tunnelling is on for `routing-mode=tunnel` (the agent's
/// default when the key is absent; the legacy `tunnel` key before it), for the egress gateway,
/// and for kube-proxy replacement with DSR dispatched over Geneve; the device is
/// `cilium_<tunnel-protocol>` (VXLAN by default). With tunnelling off Cilium removes both
/// overlay devices (`setupTunnelDevice`), so none may carry its programs.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OverlayIntent {
    /// `cilium_vxlan` or `cilium_geneve`; None: no overlay.
    pub device: Option<String>,
    /// The keys that decided it, as `key=value`.
    pub because: String,
    /// Whether the configuration asks for XDP on the host devices (`bpf-lb-acceleration`
    /// other than `disabled`, Cilium's default; the loader unloads XDP programs it no longer
    /// asks for: `maybeUnloadObsoleteXDPPrograms`, `pkg/datapath/loader/base.go`). None: not
    /// read with the overlay.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xdp: Option<bool>,
    /// Whether it asks for `cil_to_netdev` ([`to_netdev_required`]). None: not read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_netdev: Option<bool>,
}

impl OverlayIntent {
    /// The intent in a line: "cilium_vxlan (routing-mode=tunnel)" or "no overlay (…)", and
    /// the host hooks it does not ask for.
    pub fn describe(&self) -> String {
        let mut s = match &self.device {
            Some(d) => format!("{d} ({})", self.because),
            None => format!("no overlay ({})", self.because),
        };
        if self.xdp == Some(false) {
            s.push_str(", no XDP (bpf-lb-acceleration disabled)");
        }
        if self.to_netdev == Some(false) {
            s.push_str(", no cil_to_netdev (no setting requires devices)");
        }
        s
    }

    /// With the host hooks the configuration asks for, at the agent's `release` when known.
    pub fn with_hooks(mut self, cfg: &BTreeMap<String, String>, release: Option<&str>) -> Self {
        self.xdp = Some(
            cfg.get("bpf-lb-acceleration")
                .is_some_and(|v| !matches!(v.trim(), "" | "disabled")),
        );
        self.to_netdev = Some(!to_netdev_required(cfg, release).because.is_empty());
        self
    }

    /// Whether a reload key (`eth0:xdp`, `cilium_vxlan`, …) is one this intent does not ask
    /// for: an overlay other than its own, XDP or `cil_to_netdev` it has turned off.
    pub fn leaves_out(&self, key: &str) -> bool {
        let dev = key.split(':').next().unwrap_or(key);
        (is_overlay(dev) && Some(dev) != self.device.as_deref())
            || (self.xdp == Some(false) && key.ends_with(XDP_KEY))
            || (self.to_netdev == Some(false) && key.ends_with(TO_NETDEV_KEY))
    }
}

/// What a node's configuration asks of its endpoints and host hooks beside the overlay, read
/// as the overlay is (the agent's loaded configuration, or the ConfigMap without its API).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Asks {
    /// The endpoint health checker runs (its `lxc_health` endpoint):
    /// `enable-endpoint-health-checking`, on by Cilium's default.
    pub health_endpoint: bool,
    /// `bpf-lb-acceleration: best-effort`: the agent attaches XDP where the driver takes it and
    /// skips a device that refuses it (`reinitializeXDPLocked`,
    /// `pkg/datapath/loader/base.go`, 1.19.7 and 1.20.2); `native` fails the agent instead.
    pub xdp_best_effort: bool,
}

/// See [`Asks`].
pub fn asks(cfg: &BTreeMap<String, String>) -> Asks {
    let k = "enable-endpoint-health-checking";
    Asks {
        health_endpoint: !cfg.contains_key(k) || on(cfg, k),
        xdp_best_effort: cfg
            .get("bpf-lb-acceleration")
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("best-effort")),
    }
}

/// See [`OverlayIntent`].
pub fn overlay_intent(cfg: &BTreeMap<String, String>) -> OverlayIntent {
    let get = |k: &str| cfg.get(k).map(|v| v.trim().to_ascii_lowercase());
    let on = |k: &str| get(k).is_some_and(|v| matches!(v.as_str(), "true" | "strict"));
    let mut why = Vec::new();
    let tunnel_mode = match (get("routing-mode"), get("tunnel")) {
        (Some(m), _) => {
            why.push(format!("routing-mode={m}"));
            m != "native"
        }
        (None, Some(t)) => {
            why.push(format!("tunnel={t}"));
            t != "disabled"
        }
        (None, None) => {
            why.push("routing-mode unset: tunnel".to_string());
            true
        }
    };
    let egress_gw = on("enable-egress-gateway") || on("enable-ipv4-egress-gateway");
    if egress_gw {
        why.push("egress gateway on".into());
    }
    let dsr_geneve = on("kube-proxy-replacement")
        && matches!(get("bpf-lb-mode").as_deref(), Some("dsr" | "hybrid"))
        && get("bpf-lb-dsr-dispatch").as_deref() == Some("geneve");
    if dsr_geneve {
        why.push("DSR over Geneve".into());
    }
    let protocol = get("tunnel-protocol")
        .or_else(|| get("tunnel").filter(|t| t == "geneve" || t == "vxlan"))
        .unwrap_or_else(|| "vxlan".into());
    let device = (tunnel_mode || egress_gw || dsr_geneve).then(|| {
        why.push(format!("tunnel-protocol={protocol}"));
        if protocol == "geneve" {
            "cilium_geneve".to_string()
        } else {
            "cilium_vxlan".to_string()
        }
    });
    OverlayIntent {
        device,
        because: why.join(", "),
        xdp: None,
        to_netdev: None,
    }
}
