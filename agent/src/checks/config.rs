//! `config`: a ConfigMap change newer than the running datapath is "merged but inert" — the
//! cilium-agent reads cilium-config only at startup, so the change is not in effect until the
//! agent restarts (the seeds' incident: green everywhere, inert for a day). Names the keys that
//! differ from what the datapath started with when an earlier snapshot is known.
use super::CheckResult;
use crate::ciliumconfig::{changed_keys, Snapshot, SnapshotStore};
use serde_json::json;

pub const CHECK: &str = "config";

/// Clock slack between kubelet's symlink swap and the agent's program loads.
const SLACK_SECONDS: f64 = 1.0;

pub fn evaluate(
    current: Option<Result<&Snapshot, &crate::ciliumconfig::ReadError>>,
    datapath_loaded_at: Option<f64>,
    store: Option<&SnapshotStore>,
) -> CheckResult {
    let snap = match current {
        None => {
            return CheckResult::unknown(
                CHECK,
                "no_cilium_config",
                "no cilium-config directory configured (`cilium_config` / --cilium-config)",
                json!({}),
            )
        }
        Some(Err(e)) => {
            return CheckResult::unknown(
                CHECK,
                "cilium_config_unreadable",
                e.to_string(),
                json!({}),
            )
        }
        Some(Ok(s)) => s,
    };
    let Some(loaded) = datapath_loaded_at else {
        return CheckResult::unknown(CHECK, "datapath_unknown", "cannot tell when the running datapath was loaded (no readable cil_from_netdev programs)", json!({"config_changed_at": snap.changed_at}));
    };
    let mut evidence = json!({
        "config_changed_at": snap.changed_at,
        "config_version": snap.version,
        "datapath_loaded_at": loaded,
        "keys": snap.values.len(),
    });
    if snap.changed_at <= loaded + SLACK_SECONDS {
        return CheckResult::pass(
            CHECK,
            "config_applied",
            format!(
                "cilium-config unchanged since the datapath loaded ({:.0}s before it)",
                loaded - snap.changed_at
            ),
            evidence,
        );
    }
    let age = snap.changed_at - loaded;
    let before = store.and_then(|s| s.in_effect_at(loaded + SLACK_SECONDS));
    let keys = before
        .as_ref()
        .map(|b| changed_keys(&b.values, &snap.values));
    evidence["changed_keys"] = json!(keys);
    let which = match &keys {
        Some(k) if !k.is_empty() => format!("changed keys: {}", k.join(", ")),
        Some(_) => "no key differs from the snapshot taken when the datapath loaded (content rewritten unchanged)".into(),
        None => "changed keys unknown (no snapshot from before the datapath loaded)".into(),
    };
    if keys.as_ref().is_some_and(|k| k.is_empty()) {
        return CheckResult::pass(CHECK, "config_applied", which, evidence);
    }
    CheckResult::fail(CHECK, "config_not_applied", format!("cilium-config changed {age:.0}s after the running datapath loaded: merged but inert until cilium-agent restarts; {which}"), evidence)
}

/// The `config` node check: needs the device observation (when the datapath was loaded).
pub const NODE_CHECK: super::NodeCheck = super::NodeCheck {
    name: CHECK,
    needs: super::Needs {
        links: true,
        maps: false,
    },
    from_probes: false,
    evaluate: evaluate_node,
    render: crate::report::generic_lines,
};

fn evaluate_node<'a>(i: &'a super::Inputs<'a>) -> super::Evaluating<'a> {
    Box::pin(async move {
        let loaded = match i.links {
            Some(Ok(o)) if !o.prog_details_unreadable => super::devices::datapath_loaded_at(o),
            _ => None,
        };
        evaluate(i.cilium, loaded, i.store)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::Status;

    fn snap(t: f64, devices: &str) -> Snapshot {
        Snapshot {
            changed_at: t,
            version: format!("..{t}"),
            values: [("devices".to_string(), devices.to_string())].into(),
        }
    }

    #[test]
    fn a_change_after_the_datapath_loaded_is_inert() {
        let r = evaluate(Some(Ok(&snap(200.0, "eth+"))), Some(100.0), None);
        assert_eq!(
            (r.status, r.code.as_str()),
            (Status::Fail, "config_not_applied")
        );
        assert!(r.reason.contains("changed keys unknown"));
        let r = evaluate(Some(Ok(&snap(50.0, "eth+"))), Some(100.0), None);
        assert_eq!(r.status, Status::Pass);
    }

    #[test]
    fn a_snapshot_names_the_keys() {
        let dir = std::env::temp_dir().join(format!("sg-cfg-{}", std::process::id()));
        let store = SnapshotStore::new(&dir);
        store.remember(&snap(50.0, "eth0 eth1")).unwrap();
        let r = evaluate(Some(Ok(&snap(200.0, "eth+"))), Some(100.0), Some(&store));
        assert!(r.reason.contains("changed keys: devices"), "{}", r.reason);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn without_a_directory_or_datapath_it_is_unknown() {
        assert_eq!(evaluate(None, Some(1.0), None).status, Status::Unknown);
        assert_eq!(
            evaluate(Some(Ok(&snap(1.0, "x"))), None, None).status,
            Status::Unknown
        );
    }
}
