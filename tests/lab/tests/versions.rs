//! Every map judged under its own version's name across upgrades and downgrades,
//! declared versions enforced (from the agent's API, or from the pinned names where they can
//! tell), one version inference for checks and steps, small kept-state losses seen and named,
//! and no tunnel map required where the routing mode is unknown.
mod common;
use common::*;
use serde_json::Value;
use std::time::Duration;
use stepguard_lab::{Lab, Profile, RestartOpts};

fn status(v: &Value) -> &str {
    v["verdict"]["status"].as_str().unwrap_or("")
}

fn restart(lab: &mut Lab, o: RestartOpts) {
    lab.restart(&RestartOpts {
        down: Duration::from_millis(150),
        ..o
    })
    .unwrap();
}

/// The lab's stepguard config with the `key:` line left out (no agent API socket, or no
/// cilium-config mounted), written beside it.
fn config_without(lab: &Lab, key: &str) -> std::path::PathBuf {
    let text = std::fs::read_to_string(lab.stepguard_config()).unwrap();
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with(&format!("{key}:")))
        .collect();
    assert_ne!(
        kept.len(),
        text.lines().count(),
        "no {key}: in the lab config"
    );
    let p = lab
        .state
        .run_dir
        .join(format!("stepguard-no-{}.yaml", key.replace('_', "-")));
    std::fs::write(&p, kept.join("\n") + "\n").unwrap();
    p
}

fn daemon_without_api(lab: &Lab) -> AgentProc {
    AgentProc::start_with(
        lab.node_ns(),
        config_without(lab, "cilium_api"),
        lab.state.run_dir.join("agent-state-no-api"),
        free_port(),
        &[],
    )
}

/// Item 1: On every upgrade pair, a returning version whose ipcache (under its own name, renamed or
/// not) is never refilled fails `map_emptied` naming that map; the healthy upgrade passes and
/// judges the renamed map against its predecessor.
#[test]
fn an_upgrade_judges_the_maps_of_the_returning_version_under_their_own_names() {
    let mut errors = vec![];
    for pair in VERSIONS.windows(2) {
        let (from, to) = (pair[0], pair[1]);
        let own = if to.before_1_18() {
            "cilium_ipcache"
        } else {
            "cilium_ipcache_v2"
        };
        let mut lab = lab(|s| s.profile = from);
        let agent = AgentProc::start(&lab, &[]);
        let body = format!(r#"{{"settle":"2s","timeout":"20s","expect":{{"cilium":"{to}"}}}}"#);
        let id = agent.begin_probing(&body);
        restart(
            &mut lab,
            RestartOpts {
                to: Some(to),
                no_refill: true,
                ..Default::default()
            },
        );
        let v = agent.verdict(&id);
        let summary = v["verdict"]["summary"].as_str().unwrap_or("");
        if status(&v) != "failed"
            || !reasons(&v).iter().any(|r| r == "map_emptied")
            || !summary.contains(own)
        {
            errors.push(format!(
                "{from}→{to} --no-refill: {} {:?} {summary} (maps: {})",
                status(&v),
                reasons(&v),
                v["maps"]
            ));
        }
        if v["maps"][own]["class"] != "recreated" {
            errors.push(format!("{from}→{to}: {own} not judged: {}", v["maps"]));
        }
        // Back to `from` with a fresh lab for the healthy upgrade of the same pair.
        drop(agent);
        drop(lab);
        let mut lab = self::lab(|s| s.profile = from);
        let agent = AgentProc::start(&lab, &[]);
        let id = agent.begin_probing(&body);
        restart(
            &mut lab,
            RestartOpts {
                to: Some(to),
                refill_after: Duration::from_millis(200),
                ..Default::default()
            },
        );
        let v = agent.verdict(&id);
        if status(&v) != "passed" {
            errors.push(format!(
                "{from}→{to} healthy: {} {}",
                status(&v),
                v["verdict"]["summary"]
            ));
        }
        if from == Profile::V1_17
            && !v["maps"]["cilium_ipcache_v2"]["judged"]
                .as_str()
                .unwrap_or("")
                .starts_with("renamed from cilium_ipcache")
        {
            errors.push(format!(
                "1.17→1.18: cilium_ipcache_v2 not judged against cilium_ipcache: {}",
                v["maps"]["cilium_ipcache_v2"]
            ));
        }
        if to == Profile::V1_20 && v["maps"]["cilium_policy_v3_*"]["judged"].is_null() {
            errors.push(format!(
                "1.19→1.20: the renamed policy maps are not judged: {}",
                v["maps"]
            ));
        }
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

/// (lab version, restart to, declared, expected status, expected reason)
type Case = (
    Profile,
    Option<Profile>,
    &'static str,
    &'static str,
    Option<&'static str>,
);

/// Item 2: A declared version is enforced, from the agent's API: up, down, a restart that did not
/// upgrade, and a pair the names cannot tell apart (with and without the API socket).
#[test]
fn a_declared_version_is_enforced() {
    let mut errors = vec![];
    let cases: [Case; 5] = [
        // A 1.18 node that restarted without upgrading, declared 1.20.
        (
            Profile::V1_18,
            None,
            "1.20",
            "failed",
            Some("cilium_version_mismatch"),
        ),
        // Up one minor, declared two.
        (
            Profile::V1_18,
            Some(Profile::V1_19),
            "1.20",
            "failed",
            Some("cilium_version_mismatch"),
        ),
        // Down: declared the version it left.
        (
            Profile::V1_19,
            Some(Profile::V1_18),
            "1.19",
            "failed",
            Some("cilium_version_mismatch"),
        ),
        // Down, declared right.
        (Profile::V1_19, Some(Profile::V1_18), "1.18", "passed", None),
        // 1.18 → 1.19: the names cannot tell them apart; the API can.
        (Profile::V1_18, Some(Profile::V1_19), "1.19", "passed", None),
    ];
    for (from, to, declared, want, reason) in cases {
        let mut lab = lab(|s| s.profile = from);
        let agent = AgentProc::start(&lab, &[]);
        let id = agent.begin_probing(&format!(
            r#"{{"settle":"1s","timeout":"15s","expect":{{"cilium":"{declared}"}}}}"#
        ));
        restart(
            &mut lab,
            RestartOpts {
                to,
                ..Default::default()
            },
        );
        let v = agent.verdict(&id);
        let summary = v["verdict"]["summary"].as_str().unwrap_or("");
        let ok = status(&v) == want
            && reason.is_none_or(|r| reasons(&v).iter().any(|x| x == r))
            && (want == "passed"
                || (summary.contains(declared)
                    && summary.contains(&to.unwrap_or(from).to_string())));
        if !ok {
            errors.push(format!(
                "{from}→{to:?} declared {declared}: want {want} {reason:?}, got {} {:?}: {summary}",
                status(&v),
                reasons(&v)
            ));
        }
        if want == "passed"
            && !v["cilium_after_from"]
                .as_str()
                .unwrap_or("")
                .starts_with("agent API")
        {
            errors.push(format!(
                "{from}→{to:?}: the release did not come from the agent API: {}",
                v["cilium_after_from"]
            ));
        }
    }
    // Without the API socket: 1.18 → 1.19 declared 1.19 cannot be verified by names
    // (never passed); 1.19 → 1.20 declared 1.18 is told apart by names and fails.
    for (from, to, declared, want, reason) in [
        (
            Profile::V1_18,
            Profile::V1_19,
            "1.19",
            "failed",
            "evidence_incomplete",
        ),
        (
            Profile::V1_19,
            Profile::V1_20,
            "1.18",
            "failed",
            "cilium_version_mismatch",
        ),
        (Profile::V1_19, Profile::V1_20, "1.20", "passed", ""),
    ] {
        let mut lab = lab(|s| s.profile = from);
        let agent = daemon_without_api(&lab);
        let id = agent.begin_probing(&format!(
            r#"{{"settle":"1s","timeout":"8s","expect":{{"cilium":"{declared}"}}}}"#
        ));
        restart(
            &mut lab,
            RestartOpts {
                to: Some(to),
                ..Default::default()
            },
        );
        let v = agent.verdict(&id);
        if status(&v) != want || (!reason.is_empty() && !reasons(&v).iter().any(|x| x == reason)) {
            errors.push(format!(
                "no API, {from}→{to} declared {declared}: want {want} {reason}, got {} {:?}: {}",
                status(&v),
                reasons(&v),
                v["verdict"]["summary"]
            ));
        }
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

/// Item 3: One inference for checks and steps, on every version: with the API the step names the
/// release; without it the step and `stepguard check` name the same version from the names.
/// After a downgrade 1.18 → 1.17 the newer pins left behind do not make the node look newer.
#[test]
fn steps_and_checks_name_the_same_version_on_every_release() {
    let mut errors = vec![];
    for v in VERSIONS {
        let mut lab = lab(|s| s.profile = v);
        let with_api = AgentProc::start(&lab, &[]);
        let id = with_api.begin_probing(r#"{"settle":"1s","timeout":"15s"}"#);
        let no_api = daemon_without_api(&lab);
        let id2 = no_api.begin_probing(r#"{"settle":"1s","timeout":"15s"}"#);
        restart(&mut lab, RestartOpts::default());
        let a = with_api.verdict(&id);
        let b = no_api.verdict(&id2);
        let (code, check, _) = check(&lab, &[]);
        let checked = result(&check, "maps")["evidence"]["cilium"]
            .as_str()
            .unwrap_or("");
        let release = v.to_string();
        if a["baseline"]["cilium"] != release.as_str() || a["cilium_after"] != release.as_str() {
            errors.push(format!(
                "{v} with the API: baseline {} after {}",
                a["baseline"]["cilium"], a["cilium_after"]
            ));
        }
        let label = b["cilium_after"].as_str().unwrap_or("");
        if !label.split('/').any(|x| x == release) || b["baseline"]["cilium"] != label {
            errors.push(format!(
                "{v} from names: baseline {} after {label}",
                b["baseline"]["cilium"]
            ));
        }
        // The check names the pair's older version; the step's label must contain it.
        if !label.split('/').any(|x| x == checked) {
            errors.push(format!("{v}: the check says {checked}, the step {label}"));
        }
        if status(&a) != "passed" || status(&b) != "passed" || code != 0 {
            errors.push(format!(
                "{v}: healthy restart {} / {} / check exit {code}",
                a["verdict"]["summary"], b["verdict"]["summary"]
            ));
        }
    }
    // The downgrade 1.18 → 1.17: cilium_ipcache_v2 and cilium_policystats stay pinned.
    let mut lab = lab(|s| s.profile = Profile::V1_18);
    let agent = daemon_without_api(&lab);
    let id = agent.begin_probing(r#"{"settle":"1s","timeout":"15s","expect":{"cilium":"1.17"}}"#);
    restart(
        &mut lab,
        RestartOpts {
            to: Some(Profile::V1_17),
            ..Default::default()
        },
    );
    let v = agent.verdict(&id);
    let globals = lab.state.bpffs.join("tc/globals");
    assert!(
        globals.join("cilium_ipcache_v2").exists() && globals.join("cilium_policystats").exists(),
        "the lab's downgrade must leave the newer pins"
    );
    if v["cilium_after"] != "1.16/1.17" {
        errors.push(format!(
            "after the downgrade 1.18→1.17 the step says {} ({})",
            v["cilium_after"], v["cilium_after_from"]
        ));
    }
    if !v["maps"]["cilium_ipcache"]["judged"]
        .as_str()
        .unwrap_or("")
        .starts_with("renamed from cilium_ipcache_v2")
    {
        errors.push(format!(
            "after the downgrade cilium_ipcache is not judged against cilium_ipcache_v2: {}",
            v["maps"]
        ));
    }
    // Names cannot tell 1.17 from 1.16: a declaration they cannot verify is never a pass.
    if status(&v) == "passed" {
        errors.push(format!(
            "downgrade declared 1.17 without the API passed: {}",
            v["verdict"]["summary"]
        ));
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

/// Item 4: Losing most of a small kept-state map fails and names what was lost; a pod deleted
/// during the restart (one of three endpoints) still passes.
#[test]
fn small_kept_state_losses_are_seen_and_named() {
    let mut errors = vec![];
    // (map, entries to delete, lab pods, expected status, a word the summary names)
    let cases = [
        ("cilium_lb4_services_v2", 3, 3, "failed", "198.51.100."),
        ("cilium_lb4_backends_v3", 2, 3, "failed", "backend "),
        ("cilium_lxc", 3, 3, "failed", "endpoint "),
        // Under the failing share: a pass, never silent (named, and warned of).
        ("cilium_lxc", 1, 3, "passed", "endpoint "),
    ];
    for (map, n, pods, want, named) in cases {
        let mut lab = lab(|s| {
            s.profile = Profile::V1_18;
            s.pods = pods;
        });
        let agent = AgentProc::start(&lab, &[]);
        let id = agent.begin_probing(r#"{"settle":"1s","timeout":"15s"}"#);
        let before = agent.get_json(&format!("/v1/steps/{id}")).1["baseline"]["maps"][map].clone();
        restart(
            &mut lab,
            RestartOpts {
                lose_entries: Some((map.to_string(), n)),
                ..Default::default()
            },
        );
        let v = agent.verdict(&id);
        let summary = v["verdict"]["summary"].as_str().unwrap_or("");
        let ok = status(&v) == want
            && summary.contains(map)
            && summary.contains(named)
            && if want == "passed" {
                v["verdict"]["warnings"] == serde_json::json!(["kept_state_lost"])
                    && summary.contains("KEPT STATE LOST")
            } else {
                reasons(&v).iter().any(|r| r == "map_emptied")
            };
        if !ok {
            errors.push(format!(
                "{map} losing {n} of {before}: want {want} naming {named:?}, got {} {:?}: {summary}",
                status(&v),
                reasons(&v)
            ));
        }
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

/// Item 5: A native-routing 1.17 node without a mounted cilium-config: the routing mode is
/// unknown, so the tunnel map is not required (it was a false alarm).
#[test]
fn a_native_node_without_cilium_config_is_not_held_to_the_tunnel_map() {
    let lab = lab(|s| {
        s.profile = Profile::V1_17;
        s.features.tunnel = false;
    });
    let cfg = config_without(&lab, "cilium_config");
    let (code, v, stderr) = check(&lab, &["--config", cfg.to_str().unwrap()]);
    let maps = result(&v, "maps");
    assert_eq!(maps["status"], "pass", "{maps} {stderr}");
    assert!(
        !maps["evidence"]["required"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m == "cilium_tunnel_map"),
        "{maps}"
    );
    assert!(
        maps["evidence"]["features"]["tunnel"].is_null(),
        "the routing mode is unknown: {}",
        maps["evidence"]["features"]
    );
    // Other checks may be unknown without a cilium-config; the maps check decides here.
    assert!(code == 0 || code == 2, "exit {code}");
}
