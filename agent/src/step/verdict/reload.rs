//! The reload check: the datapath's programs were replaced on every device that had them, and
//! stayed quiet since.
use super::*;
use crate::cilium::devices;

/// How long nothing may change before a reload counts as complete (Cilium attaches devices one
/// after another).
pub const RELOAD_QUIET_S: f64 = 1.0;

/// The reload keys that must carry the datapath after the restart: the declared device set
/// (with XDP on each when the node had XDP, and `cilium_host` and the overlay device when
/// it had them), or the baseline's keys ("as before"). See `watch::tracked_program`.
pub fn wanted_devices(step: &Step) -> std::collections::BTreeSet<String> {
    let mut w = wanted_before_gone(step);
    // The restarted agent's configuration decides the overlay (tunnel or native, VXLAN or
    // Geneve): the overlays it does not ask for are not wanted, a new one is.
    if let Some(i) = &step.reload.overlay_intent {
        w.retain(|k| !i.leaves_out(k));
        if let Some(d) = &i.device {
            if !w.contains(d) {
                w.insert(d.clone());
                w.insert(format!("{d}{}", devices::TO_OVERLAY_KEY));
            }
        }
    }
    // Hooks the step declared gone are not wanted (and must be gone: `check_reload`).
    let gone = &step.params.expect_gone;
    w.retain(|k| !gone.contains(k) && !gone.iter().any(|g| k.split(':').next() == Some(g)));
    w
}

/// Keys of the baseline the restarted agent's configuration no longer asks for (an overlay,
/// XDP, `cil_to_netdev`).
fn not_intended(step: &Step) -> Vec<String> {
    let Some(i) = &step.reload.overlay_intent else {
        return vec![];
    };
    step.baseline
        .programs
        .keys()
        .filter(|k| i.leaves_out(k))
        .cloned()
        .collect()
}

/// A key the restarted agent's configuration may turn off: an overlay always (read whenever
/// the node's configuration is), XDP and `cil_to_netdev` once the configuration was readable.
fn intent_decides(step: &Step, key: &str) -> bool {
    devices::is_overlay(key.split(':').next().unwrap_or(key))
        || (step.reload.intent_readable
            && (key.ends_with(devices::XDP_KEY) || key.ends_with(devices::TO_NETDEV_KEY)))
}

/// Takes the overlay the node's configuration asks for from an observation: a read begun
/// once the datapath had begun to change is the restarted agent's (the previous agent stopped
/// before the new one loaded anything); an earlier read is the previous agent's.
pub fn note_overlay_intent(step: &mut Step, o: &Observed) {
    if let Some(a) = o.asks {
        step.reload.xdp_best_effort = a.xdp_best_effort;
    }
    let Some((intent, read_at)) = &o.overlay else {
        return;
    };
    step.reload.intent_readable = true;
    let began = step
        .reload
        .changed
        .values()
        .map(|(_, at)| *at)
        .min_by(|a, b| a.total_cmp(b));
    if began.is_some_and(|b| *read_at >= b) {
        step.reload.overlay_intent = Some(intent.clone());
    }
}

fn wanted_before_gone(step: &Step) -> std::collections::BTreeSet<String> {
    use crate::cilium::devices::XDP_KEY;
    let base = &step.baseline.programs;
    match &step.params.expect_devices {
        Some(d) => {
            let mut w: std::collections::BTreeSet<String> = d.iter().cloned().collect();
            if base.keys().any(|k| k.ends_with(XDP_KEY)) {
                // Best-effort XDP is wanted where it was attached before: a device that
                // refused it refuses again, a new one may.
                w.extend(
                    d.iter()
                        .map(|d| format!("{d}{XDP_KEY}"))
                        .filter(|k| !step.reload.xdp_best_effort || base.contains_key(k)),
                );
            }
            let to_netdev = crate::cilium::devices::TO_NETDEV_KEY;
            if base.keys().any(|k| k.ends_with(to_netdev)) {
                w.extend(d.iter().map(|d| format!("{d}{to_netdev}")));
            }
            w.extend(
                base.keys()
                    .filter(|k| {
                        let dev = k.split(':').next().unwrap_or(k);
                        dev == "cilium_host"
                            || dev == "cilium_net"
                            || crate::cilium::devices::is_overlay(dev)
                    })
                    .cloned(),
            );
            w
        }
        None => base.keys().cloned().collect(),
    }
}

/// Folds an observation of program ids into the reload state: a wanted device has reloaded
/// when it carries a program id other than its baseline one (any id, for a device new to it).
pub fn update_reload(
    r: &mut Reload,
    baseline: &BTreeMap<String, u32>,
    want: &std::collections::BTreeSet<String>,
    current: &BTreeMap<String, Option<u32>>,
    now: f64,
) {
    if &r.last_seen != current {
        if !r.last_seen.is_empty() || current.iter().any(|(d, id)| baseline.get(d) != id.as_ref()) {
            r.last_change_at = Some(now);
        }
        r.last_seen = current.clone();
    }
    for (dev, id) in current {
        match (id, baseline.get(dev)) {
            (Some(id), base) if base != Some(id) => {
                r.changed.entry(dev.clone()).or_insert((*id, now));
                r.lost.retain(|d| d != dev);
            }
            (None, _) if want.contains(dev) && !r.lost.contains(dev) => r.lost.push(dev.clone()),
            _ => {}
        }
    }
    let all_changed = want
        .iter()
        .all(|d| r.changed.contains_key(d) && !r.lost.contains(d));
    let quiet = r.last_change_at.is_some_and(|t| now - t >= RELOAD_QUIET_S);
    if all_changed && quiet && r.complete_at.is_none() {
        r.complete_at = Some(now);
    }
}

/// `reload`: every tracked device got a new program id and nothing changed for the quiet
/// period; a device whose program vanished once the rest reloaded is a changed device set.
pub fn check_reload(step: &Step, now: f64) -> Judged {
    let r = &step.reload;
    let want = wanted_devices(step);
    let quiet = r.last_change_at.is_some_and(|t| now - t >= RELOAD_QUIET_S);
    let declared = step.params.expect_devices.is_some() || !step.params.expect_gone.is_empty();
    let not_intended = not_intended(step);
    // Only wanted keys count as lost: an overlay the configuration no longer asks for is
    // meant to go. An overlay lost before the restarted agent's configuration was read waits
    // for it (until the timeout) rather than failing on the previous agent's intent.
    let lost: Vec<&String> = r.lost.iter().filter(|d| want.contains(*d)).collect();
    let awaiting_intent =
        step.reload.overlay_intent.is_none() && lost.iter().any(|d| intent_decides(step, d));
    // The rest of the datapath reloaded: every wanted device that still carries it has new
    // ids. Cilium reloads the overlay device seconds before the host devices, and detaches
    // devices it no longer selects only after attaching the others (the real 1.20.2 agent,
    // docs/cilium-fidelity.md): a device set is judged once that pass is over, not at the
    // first quiet second after the overlay.
    let rest_reloaded = !r.changed.is_empty()
        && want
            .iter()
            .filter(|d| !r.lost.contains(*d))
            .all(|d| r.changed.contains_key(d));
    if awaiting_intent && quiet && rest_reloaded {
        let lost = lost
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join(", ");
        return Judged {
            shown: Some(StepCheck {
                status: CheckStatus::Fail,
                reason: format!(
                    "waiting for the restarted agent's configuration: {lost} lost, meant to go only if it no longer asks for them"
                ),
            }),
            fatal: None,
            at_timeout: Some((
                Some(Reason::DeviceSetChanged),
                format!(
                    "the reloaded datapath is no longer attached to {lost}, and the restarted agent's configuration was not read to say whether they were meant to go"
                ),
            )),
        };
    }
    if !lost.is_empty() && quiet && rest_reloaded {
        return Judged::fatal(
            Reason::DeviceSetChanged,
            format!(
                "the reloaded datapath is no longer attached to {}{}",
                lost.iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                if declared {
                    " (declared in expect)"
                } else {
                    ""
                }
            ),
        );
    }
    // Devices the step declared gone that still carry the datapath after the reload: the
    // node came back as before, not as the rollout intended.
    let unwanted: Vec<&String> = r
        .last_seen
        .iter()
        .filter(|(d, id)| id.is_some() && !want.contains(*d))
        .map(|(d, _)| d)
        .collect();
    // Overlays the restarted agent's configuration no longer asks for that still carry it:
    // the datapath did not follow the configuration.
    let unintended: Vec<&str> = unwanted
        .iter()
        .filter(|d| not_intended.contains(*d))
        .map(|d| d.as_str())
        .collect();
    if quiet && rest_reloaded && !unintended.is_empty() {
        let because = step
            .reload
            .overlay_intent
            .as_ref()
            .map(|i| i.describe())
            .unwrap_or_default();
        return Judged::fatal(
            Reason::DeviceSetChanged,
            format!(
                "the datapath is still attached to {} although the restarted agent's configuration asks for {because}",
                unintended.join(", ")
            ),
        );
    }
    if declared && quiet && rest_reloaded && !unwanted.is_empty() {
        return Judged::fatal(
            Reason::DeviceSetChanged,
            format!(
                "the datapath is still attached to {} although the step declared it gone (expected only {})",
                unwanted
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                want.iter().cloned().collect::<Vec<_>>().join(", ")
            ),
        );
    }
    // A pass needs the restarted agent's intent once the configuration could be read: its
    // overlay is judged against it, not against the previous agent's.
    if r.complete_at.is_some() && r.intent_readable && r.overlay_intent.is_none() {
        return Judged {
            shown: Some(StepCheck {
                status: CheckStatus::Fail,
                reason: "waiting for the restarted agent's configuration (which overlay it asks for)"
                    .into(),
            }),
            fatal: None,
            at_timeout: Some((
                Some(Reason::DeviceSetChanged),
                "the restarted agent's configuration was not read before the timeout: its overlay could not be judged"
                    .into(),
            )),
        };
    }
    if r.complete_at.is_some() {
        return Judged::pass(format!(
            "new program ids on {}",
            want.iter().cloned().collect::<Vec<_>>().join(", ")
        ));
    }
    let unchanged: Vec<String> = want
        .iter()
        .filter(|d| !r.changed.contains_key(*d))
        .cloned()
        .collect();
    let why = if r.changed.is_empty() {
        "no device got new program ids before the timeout".to_string()
    } else {
        format!(
            "no new program ids on {} before the timeout",
            unchanged.join(", ")
        )
    };
    Judged {
        shown: Some(StepCheck {
            status: CheckStatus::Fail,
            reason: format!("waiting for new program ids on {}", unchanged.join(", ")),
        }),
        fatal: None,
        at_timeout: Some((Some(Reason::DatapathNotReloaded), why)),
    }
}
