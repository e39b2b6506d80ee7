use super::*;
use crate::step::{Baseline, StepParams, TargetTimeline};
use std::time::Duration;

fn step() -> Step {
    let mut s = bare_step();
    s.targets.get_mut("gw").unwrap().samples = timeline(70.0, None);
    s
}

fn bare_step() -> Step {
    let mut s = Step::new(
        "s".into(),
        0.0,
        StepParams {
            timeout: Duration::from_secs(60),
            settle: Duration::from_secs(5),
            max_gap: Duration::from_secs(2),
            max_loss: crate::step::DEFAULT_MAX_LOSS,
            max_total_gap: Some(4.0),
            burst_interval: Duration::from_millis(10),
            dns_slower_ratio: 2.0,
            drops_budget: BTreeMap::new(),
            expect_devices: None,
            expect_cilium: None,
            expect_gone: vec![],
            witnesses: vec![],
        },
        Baseline {
            programs: [("eth0".to_string(), 10u32), ("eth1".to_string(), 11u32)].into(),
            maps: [
                ("cilium_ct4_global".to_string(), Some(100u64)),
                ("cilium_lxc".to_string(), Some(4)),
            ]
            .into(),
            dns_p50_ms: Some(1.0),
            ..Default::default()
        },
        [(
            "gw".to_string(),
            TargetTimeline {
                kind: "http".into(),
                budget: 2.0,
                loss_budget: Some(crate::step::DEFAULT_MAX_LOSS),
                total_budget: Some(4.0),
                ..Default::default()
            },
        )]
        .into(),
    );
    s.boot_id = None;
    s
}

/// Observes the step at `ticks`, the datapath reloading at 1.2 s; the verdict once decided.
fn reload_at_1_2(s: &mut Step, ticks: &[f64]) -> Option<Verdict> {
    for &t in ticks {
        let p = if t < 1.2 {
            progs(Some(10), Some(11))
        } else {
            progs(Some(20), Some(21))
        };
        decide(s, &obs(t, p));
        if s.verdict.is_some() {
            break;
        }
    }
    s.verdict.clone()
}

fn ep(ifindex: u32, from: u32, to: Option<u32>) -> crate::step::EndpointPrograms {
    crate::step::EndpointPrograms {
        ifindex,
        from_container: Some(from),
        to_container: to,
        raced: false,
    }
}

/// Four endpoints at the baseline (lxc3 also has `cil_to_container`).
fn with_endpoints() -> Step {
    let mut s = step();
    std::sync::Arc::make_mut(&mut s.baseline).endpoints_followed =
        crate::step::EndpointsFollowed::Followed;
    std::sync::Arc::make_mut(&mut s.baseline).endpoints = [
        ("lxc0", ep(100, 10, None)),
        ("lxc1", ep(101, 11, None)),
        ("lxc2", ep(102, 12, None)),
        ("lxc3", ep(103, 13, Some(23))),
    ]
    .into_iter()
    .map(|(n, e)| (n.to_string(), e))
    .collect();
    s
}

fn eps(
    list: &[(&str, crate::step::EndpointPrograms)],
) -> Option<BTreeMap<String, crate::step::EndpointPrograms>> {
    Some(
        list.iter()
            .map(|(n, e)| (n.to_string(), e.clone()))
            .collect(),
    )
}

/// Cilium regenerates every restored endpoint on each start: a restart whose host
/// datapath reloaded but some endpoints kept their old programs fails at the step's
/// timeout (its only deadline), naming them; while it waits — past settle too — the check
/// says how far it got. An endpoint deleted meanwhile is not a failure.
#[test]
fn endpoints_that_keep_their_old_programs_fail_the_step_at_its_timeout() {
    let mut s = with_endpoints();
    let stalled = [
        ("lxc0", ep(100, 40, None)),
        ("lxc1", ep(101, 11, None)),
        ("lxc2", ep(102, 12, None)),
    ];
    let mut v = None;
    for t in [
        0.0, 1.0, 1.2, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 20.0, 40.0, 59.0, 60.5,
    ] {
        if t == 59.0 {
            assert!(s.verdict.is_none(), "slow inside the timeout is no failure");
        }
        let p = if t < 1.2 {
            progs(Some(10), Some(11))
        } else {
            progs(Some(20), Some(21))
        };
        let mut o = obs(t, p);
        o.endpoints = if t < 1.5 {
            eps(&[
                ("lxc0", ep(100, 10, None)),
                ("lxc1", ep(101, 11, None)),
                ("lxc2", ep(102, 12, None)),
                ("lxc3", ep(103, 13, Some(23))),
            ])
        } else {
            eps(&stalled)
        };
        decide(&mut s, &o);
        if t == 3.0 {
            let c = &s.checks["endpoints"];
            assert_eq!(c.status, CheckStatus::Fail);
            assert!(
                c.reason.contains(
                    "1 of 3 endpoints regenerated; waiting for lxc1, lxc2; 1 deleted meanwhile"
                ),
                "{}",
                c.reason
            );
            assert!(s.verdict.is_none(), "not green while endpoints are pending");
        }
        if s.verdict.is_some() {
            v = s.verdict.clone();
            break;
        }
    }
    let v = v.expect("decided");
    assert_eq!(v.status, Status::Failed);
    assert_eq!(v.reasons, vec![Reason::EndpointsNotRegenerated], "{v:?}");
    assert!(
        v.summary.contains("2 of 3 endpoints") && v.summary.contains("lxc1, lxc2"),
        "{}",
        v.summary
    );
    assert!(s.verdict.as_ref().unwrap().finished_at >= 60.0);
}

/// An endpoint's device renamed while the agent was down (the same ifindex, its old programs
/// still on it): Cilium cannot find it and drops the endpoint, the pod is unreachable. It is
/// not "deleted meanwhile": it is followed under its new name and fails at the timeout,
/// named; an endpoint whose device is really gone is still a deletion.
#[test]
fn an_endpoint_renamed_keeping_its_old_programs_is_no_deletion() {
    let mut s = with_endpoints();
    let mut v = None;
    for t in [0.0, 1.0, 1.5, 3.0, 20.0, 59.0, 60.5] {
        let p = if t < 1.2 {
            progs(Some(10), Some(11))
        } else {
            progs(Some(20), Some(21))
        };
        let mut o = obs(t, p);
        o.endpoints = if t < 1.5 {
            eps(&[
                ("lxc0", ep(100, 10, None)),
                ("lxc1", ep(101, 11, None)),
                ("lxc2", ep(102, 12, None)),
                ("lxc3", ep(103, 13, Some(23))),
            ])
        } else {
            // lxc1 renamed (ifindex 101, old program 11); lxc3 gone.
            eps(&[
                ("lxc0", ep(100, 40, None)),
                ("old-lxc1", ep(101, 11, None)),
                ("lxc2", ep(102, 42, None)),
            ])
        };
        decide(&mut s, &o);
        if t == 3.0 {
            let c = &s.checks["endpoints"];
            assert!(
                c.reason.contains(
                    "2 of 3 endpoints regenerated; waiting for lxc1; 1 deleted meanwhile"
                ),
                "{}",
                c.reason
            );
        }
        if s.verdict.is_some() {
            v = s.verdict.clone();
            break;
        }
    }
    let v = v.expect("decided");
    assert_eq!(v.status, Status::Failed, "{v:?}");
    assert_eq!(v.reasons, vec![Reason::EndpointsNotRegenerated], "{v:?}");
    assert!(
        v.summary.contains("lxc1 (renamed old-lxc1)"),
        "{}",
        v.summary
    );
    assert_eq!(s.endpoints.gone.iter().collect::<Vec<_>>(), vec!["lxc3"]);
}

/// Endpoints that regenerate in batches long after settle (a big node: Cilium regenerates
/// at its own concurrency) pass once all have, inside the timeout: settle is how long the
/// step must then stay green, not a deadline.
#[test]
fn endpoints_regenerating_past_settle_pass_within_the_timeout() {
    let mut s = with_endpoints();
    let mut v = None;
    for t in [
        0.0, 1.0, 1.2, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0, 18.0, 20.0, 22.0,
    ] {
        let p = if t < 1.2 {
            progs(Some(10), Some(11))
        } else {
            progs(Some(20), Some(21))
        };
        let mut o = obs(t, p);
        // One endpoint more every 3.5 s after the reload.
        let done = |i: u32| t >= 1.2 + 3.5 * f64::from(i + 1);
        o.endpoints = eps(&[
            ("lxc0", ep(100, if done(0) { 40 } else { 10 }, None)),
            ("lxc1", ep(101, if done(1) { 41 } else { 11 }, None)),
            ("lxc2", ep(102, if done(2) { 42 } else { 12 }, None)),
            (
                "lxc3",
                if done(3) {
                    ep(103, 43, Some(53))
                } else {
                    ep(103, 13, Some(23))
                },
            ),
        ]);
        decide(&mut s, &o);
        if t == 10.0 {
            assert!(
                s.verdict.is_none(),
                "past settle, still regenerating: waited for"
            );
            assert!(
                s.checks["endpoints"]
                    .reason
                    .contains("2 of 4 endpoints regenerated; waiting for"),
                "{}",
                s.checks["endpoints"].reason
            );
        }
        if s.verdict.is_some() {
            v = s.verdict.clone();
            break;
        }
    }
    let v = v.expect("decided inside the timeout");
    assert_eq!(v.status, Status::Passed, "{v:?}");
    assert!(
        v.finished_at >= 1.2 + 3.5 * 4.0 + 5.0,
        "green for settle after the last: {v:?}"
    );
}

/// A healthy regeneration passes, with the slowest endpoint named; `cil_to_container`
/// detached on the reload (the endpoint no longer needs it) is regenerated, kept with
/// its old id is not; a new device under an old name was deleted and recreated; an
/// endpoint read while its program was being replaced waits for the next observation.
#[test]
fn endpoint_regeneration_rules() {
    let base = with_endpoints().baseline.endpoints.clone();
    let mut p = crate::step::EndpointProgress::default();
    let mut raced = ep(102, 52, None);
    raced.raced = true;
    let now = eps(&[
        ("lxc0", ep(100, 40, None)),
        ("lxc1", ep(201, 41, None)),
        ("lxc2", raced),
        ("lxc3", ep(103, 43, Some(23))),
    ])
    .unwrap();
    update_endpoints(&mut p, &base, &now, false, 2.0);
    assert_eq!(p.regenerated.keys().collect::<Vec<_>>(), ["lxc0"]);
    assert_eq!(p.gone.iter().collect::<Vec<_>>(), ["lxc1"]);
    let now = eps(&[
        ("lxc0", ep(100, 40, None)),
        ("lxc2", ep(102, 52, None)),
        ("lxc3", ep(103, 43, None)),
    ])
    .unwrap();
    update_endpoints(&mut p, &base, &now, false, 3.5);
    assert_eq!(p.regenerated.len(), 3);
    assert_eq!(p.regenerated["lxc0"], 2.0, "first seen, not last");
    let mut s = with_endpoints();
    s.endpoints = p;
    s.reload.changed.insert("eth0".into(), (20, 1.2));
    s.reload.complete_at = Some(1.7);
    let j = check_endpoints(&s, 4.0);
    assert!(j.green(), "{j:?}");
    let r = &j.shown.unwrap().reason;
    assert!(r.contains("3 of 3 endpoints regenerated (slowest lxc3, 2.3s after the host datapath); 1 deleted meanwhile"), "{r}");
    // Pending endpoints not read consistently since the step's timeout (every read
    // raced, or failed): no evidence either way, unknown, never a confident failure.
    let mut s = with_endpoints();
    s.reload.complete_at = Some(1.0);
    s.endpoints.old_seen_at.insert("lxc0".into(), 50.0);
    let j = check_endpoints(&s, 60.5);
    assert!(j.fatal.is_none(), "{j:?}");
    assert_eq!(j.shown.as_ref().unwrap().status, CheckStatus::Unknown);
    assert_eq!(
        j.at_timeout.as_ref().unwrap().0,
        Some(Reason::EvidenceIncomplete)
    );
    // Before the timeout it is waited for, however long after settle.
    assert!(check_endpoints(&s, 30.0).fatal.is_none());
    // Read again at the deadline, still old: now it is evidence.
    s.endpoints.old_seen_at.insert("lxc0".into(), 59.5);
    let j = check_endpoints(&s, 60.5);
    let (code, why) = j.fatal.expect("fatal");
    assert_eq!(code, Reason::EndpointsNotRegenerated);
    assert!(
        why.starts_with("1 of 4 endpoints") && why.contains(": lxc0"),
        "{why}"
    );
    // No endpoints at the start, or a record of an older agent: nothing to wait for;
    // endpoint programs unreadable at the start: unknown, never a pass.
    let mut s = step();
    assert!(check_endpoints(&s, 1.0).green());
    std::sync::Arc::make_mut(&mut s.baseline).endpoints_followed =
        crate::step::EndpointsFollowed::Followed;
    assert!(check_endpoints(&s, 1.0).green());
    std::sync::Arc::make_mut(&mut s.baseline).endpoints_followed =
        crate::step::EndpointsFollowed::Unknown("EPERM".into());
    let j = check_endpoints(&s, 1.0);
    assert!(!j.green() && j.shown.unwrap().status == CheckStatus::Unknown);
}

/// The health endpoint turned off by the configuration (`enable-endpoint-health-checking:
/// false`): Cilium leaves `lxc_health` without its programs; that is a removal by design, not
/// a stall. With the checker on, the same device without programs is waited for.
#[test]
fn the_health_endpoint_turned_off_is_removed_by_design() {
    let mut base = with_endpoints().baseline.endpoints.clone();
    base.insert("lxc_health".into(), ep(150, 15, None));
    let bare = crate::step::EndpointPrograms {
        ifindex: 150,
        from_container: None,
        to_container: None,
        raced: false,
    };
    let now = eps(&[
        ("lxc0", ep(100, 40, None)),
        ("lxc1", ep(101, 41, None)),
        ("lxc2", ep(102, 42, None)),
        ("lxc3", ep(103, 43, None)),
        ("lxc_health", bare),
    ])
    .unwrap();
    let mut p = crate::step::EndpointProgress::default();
    update_endpoints(&mut p, &base, &now, true, 2.0);
    assert_eq!(p.gone.iter().collect::<Vec<_>>(), ["lxc_health"]);
    let mut p = crate::step::EndpointProgress::default();
    update_endpoints(&mut p, &base, &now, false, 2.0);
    assert!(
        p.gone.is_empty() && p.old_seen_at.contains_key("lxc_health"),
        "{p:?}"
    );
}

/// Sets a target's samples and its counts, as the runner records them.
fn record<S: Into<super::super::gaps::Sample>>(s: &mut Step, samples: Vec<S>) {
    let samples: Vec<super::super::gaps::Sample> = samples.into_iter().map(Into::into).collect();
    let t = s.targets.get_mut("gw").unwrap();
    t.probes = samples.len() as u64;
    t.failures = samples.iter().filter(|x| !x.ok).count() as u64;
    t.samples = samples;
}

/// A datapath that loses every other probe after the reload passes no budget of the
/// longest outage (each is 10 ms) but fails its loss budget, naming it.
#[test]
fn a_lossy_datapath_fails_its_loss_budget() {
    let mut s = step();
    let samples: Vec<(f64, bool)> = (0..=900)
        .map(|i| i as f64 * 0.01)
        .map(|t| (t, t < 1.2 || ((t * 100.0).round() as u64).is_multiple_of(2)))
        .collect();
    record(&mut s, samples);
    let v = reload_at_1_2(&mut s, &[0.0, 1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 8.0]).expect("decided");
    assert_eq!(v.status, Status::Failed);
    assert_eq!(v.reasons, vec![Reason::LossOverBudget], "{v:?}");
    assert!(v.summary.contains("max_loss"), "{}", v.summary);
}

/// Probes held in a neighbour queue until 2.0 end the outage there, and the row
/// says how long the answer that ended it was held.
#[test]
fn a_gap_row_ends_at_the_release_of_held_answers_and_says_so() {
    use super::super::gaps::Sample;
    let t = super::super::TargetTimeline {
        samples: (0..300)
            .map(|i| {
                let sent = i as f64 * 0.01;
                if !(1.0..2.0).contains(&sent) {
                    Sample::answered(sent, 0.001, 0.001)
                } else if sent > 1.8 + 1e-9 {
                    Sample::answered(sent, 2.0 - sent + 0.001, 0.001)
                } else {
                    Sample::failed(sent)
                }
            })
            .collect(),
        failures: 81,
        probes: 300,
        ..Default::default()
    };
    let g = gap_row("gw", &t, 0.01, 3.0);
    assert!((g.longest_s - 1.0).abs() < 1e-6, "{g:?}");
    assert!(g.error_bound_s > 0.19, "{g:?}");
    assert!(g.longest_held_s.is_some_and(|h| h > 0.18), "{g:?}");
    assert_eq!(g.longest_end.map(|e| (e * 1e3).round()), Some(2000.0));
}

/// Many short outages within max_gap add up over max_total_gap.
#[test]
fn outages_that_add_up_fail_the_total_budget() {
    let mut s = step();
    // Loss is its own budget: here only the total is held.
    s.targets.get_mut("gw").unwrap().loss_budget = Some(1.0);
    // 0.5 s outages every 1.5 s from 1.5 s: the ninth passes 4 s in all.
    let samples: Vec<(f64, bool)> = (0..=1500)
        .map(|i| i as f64 * 0.01)
        .map(|t| (t, t < 1.5 || (t - 1.5) % 1.5 >= 0.5))
        .collect();
    record(&mut s, samples);
    let v = reload_at_1_2(
        &mut s,
        &[0.0, 1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 8.0, 11.0, 14.0, 15.0],
    )
    .expect("decided");
    assert_eq!(v.reasons, vec![Reason::GapOverBudget], "{v:?}");
    assert!(v.summary.contains("max_total_gap"), "{}", v.summary);
}

/// One probe that failed inside the settle window, recorded after ticks that looked green
/// (a timeout is recorded late, under its send time), restarts settle.
#[test]
fn a_probe_lost_inside_settle_restarts_it() {
    let mut s = step();
    record(&mut s, timeline(20.0, None));
    let p = || progs(Some(20), Some(21));
    decide(&mut s, &obs(0.0, progs(Some(10), Some(11))));
    for t in [1.0, 2.0, 2.5, 3.0, 4.0] {
        decide(&mut s, &obs(t, p()));
    }
    // Green since ~3.0 (reload at 1.0 + 1 s quiet... ); a probe sent at 5.0 failed and is
    // recorded only now.
    let t = s.targets.get_mut("gw").unwrap();
    for x in t.samples.iter_mut().filter(|x| (x.sent - 5.0).abs() < 1e-6) {
        x.ok = false;
    }
    t.failures = 1;
    let since = s.green_since.unwrap();
    decide(&mut s, &obs(since + 5.05, p()));
    assert!(
        s.verdict.is_none(),
        "a failure inside the settle window must restart it: {:?}",
        s.verdict
    );
    decide(&mut s, &obs(5.01 + 5.1, p()));
    let v = s.verdict.as_ref().expect("passed after a full window");
    assert_eq!(v.status, Status::Passed, "{v:?}");
}
fn progs(a: Option<u32>, b: Option<u32>) -> Option<BTreeMap<String, Option<u32>>> {
    Some([("eth0".to_string(), a), ("eth1".to_string(), b)].into())
}
fn maps(ct: u64) -> Option<BTreeMap<String, Option<u64>>> {
    Some(
        [
            ("cilium_ct4_global".to_string(), Some(ct)),
            ("cilium_lxc".to_string(), Some(4)),
        ]
        .into(),
    )
}
/// Probes every 10 ms from 0 to `until`, failing inside `down`.
fn timeline(until: f64, down: Option<(f64, f64)>) -> Vec<super::super::gaps::Sample> {
    (0..=(until * 100.0) as usize)
        .map(|i| i as f64 * 0.01)
        .map(|t| (t, !down.is_some_and(|(a, b)| t >= a - 1e-9 && t < b - 1e-9)).into())
        .collect()
}
fn obs(now: f64, p: Option<BTreeMap<String, Option<u32>>>) -> Observed {
    Observed {
        now,
        programs: p,
        maps: maps(100),
        dns_p50_after_ms: Some(1.2),
        complete_until: now,
        ..Default::default()
    }
}

#[test]
fn a_clean_restart_passes_after_the_settle_window() {
    let mut s = step();
    s.targets.get_mut("gw").unwrap().samples = timeline(9.0, Some((1.0, 1.3)));
    for t in [0.0, 1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 7.0] {
        decide(
            &mut s,
            &obs(
                t,
                if t < 1.2 {
                    progs(Some(10), Some(11))
                } else {
                    progs(Some(20), Some(21))
                },
            ),
        );
    }
    assert!(s.verdict.is_none(), "not settled yet");
    decide(&mut s, &obs(8.1, progs(Some(20), Some(21))));
    let v = s.verdict.as_ref().unwrap();
    assert_eq!(v.status, Status::Passed, "{v:?}");
    assert!((s.gaps[0].longest_s - 0.3).abs() < 1e-9);
}

#[test]
fn no_reload_fails_at_the_timeout() {
    let mut s = step();
    for t in [0.0, 30.0, 60.0] {
        decide(&mut s, &obs(t, progs(Some(10), Some(11))));
    }
    assert_eq!(
        s.verdict.unwrap().reasons,
        vec![Reason::DatapathNotReloaded]
    );
}

#[test]
fn a_dropped_device_is_a_changed_device_set() {
    let mut s = step();
    decide(&mut s, &obs(1.0, progs(Some(20), None)));
    decide(&mut s, &obs(2.5, progs(Some(20), None)));
    assert_eq!(s.verdict.unwrap().reasons, vec![Reason::DeviceSetChanged]);
}

#[test]
fn a_gap_over_budget_fails_at_once() {
    let mut s = step();
    s.targets.get_mut("gw").unwrap().samples = timeline(4.0, Some((1.0, 3.5)));
    decide(&mut s, &obs(4.0, progs(Some(10), Some(11))));
    assert_eq!(s.verdict.unwrap().reasons, vec![Reason::GapOverBudget]);
}

#[test]
fn lost_and_emptied_maps_fail_after_the_reload() {
    let mut s = step();
    let mut o = obs(1.0, progs(Some(20), Some(21)));
    decide(&mut s, &o);
    o.now = 2.5;
    o.complete_until = 2.5;
    o.maps = Some([("cilium_ct4_global".to_string(), Some(100u64))].into());
    decide(&mut s, &o);
    assert_eq!(s.verdict.clone().unwrap().reasons, vec![Reason::MapMissing]);
    // Wrong pass 6: the endpoint map came back empty; it held only 4 entries, under the
    // old 8-entry threshold, and passed. Kept state emptied fails at any size.
    let mut s = step();
    decide(&mut s, &obs(1.0, progs(Some(20), Some(21))));
    let mut o = obs(2.5, progs(Some(20), Some(21)));
    o.maps = Some(
        [
            ("cilium_ct4_global".to_string(), Some(100u64)),
            ("cilium_lxc".to_string(), Some(0)),
        ]
        .into(),
    );
    decide(&mut s, &o);
    let v = s.verdict.unwrap();
    assert_eq!(v.reasons, vec![Reason::MapEmptied], "{v:?}");
    assert!(
        v.summary.contains("cilium_lxc came back empty (4→0)"),
        "{v:?}"
    );
}

/// Connection tracking is churn: flushed, it is reported, never a failure by itself.
#[test]
fn churn_maps_are_reported_not_judged() {
    let mut s = step();
    for t in [1.0, 2.5, 5.0, 8.0] {
        let mut o = obs(t, progs(Some(20), Some(21)));
        o.maps = maps(0);
        decide(&mut s, &o);
    }
    assert_eq!(
        s.verdict.as_ref().unwrap().status,
        Status::Passed,
        "{:?}",
        s.verdict
    );
    assert!(
        s.maps["cilium_ct4_global"].judged.contains("100→0"),
        "{:?}",
        s.maps
    );
}

fn ipcache_step() -> Step {
    let mut s = step();
    std::sync::Arc::make_mut(&mut s.baseline)
        .maps
        .insert("cilium_ipcache_v2".into(), Some(30));
    std::sync::Arc::make_mut(&mut s.baseline)
        .map_ids
        .insert("cilium_ipcache_v2".into(), 7);
    s
}

fn with_ipcache(t: f64, entries: u64, id: u32) -> Observed {
    let mut o = obs(t, progs(Some(20), Some(21)));
    let mut m = maps(100).unwrap();
    m.insert("cilium_ipcache_v2".into(), Some(entries));
    o.maps = Some(m);
    o.map_ids = Some([("cilium_ipcache_v2".to_string(), id)].into());
    o
}

/// ipcache is recreated on every Cilium start (new id, refilled): refilled inside the
/// timeout passes, even long after settle; still empty at the timeout fails.
#[test]
fn ipcache_recreated_must_refill_within_the_timeout() {
    let mut s = ipcache_step();
    for (t, n) in [
        (1.0, 0),
        (2.5, 0),
        (4.0, 12),
        (6.0, 30),
        (9.0, 30),
        (11.5, 30),
    ] {
        decide(&mut s, &with_ipcache(t, n, 8));
    }
    let v = s.verdict.clone().unwrap();
    assert_eq!(v.status, Status::Passed, "{v:?}");
    assert!(s.maps["cilium_ipcache_v2"].recreated);
    // Refilled 20 s after the reload (settle is 5 s): a pass, not a false alarm.
    let mut s = ipcache_step();
    for (t, n) in [
        (1.0, 0),
        (2.5, 0),
        (7.6, 0),
        (15.0, 0),
        (21.0, 30),
        (24.0, 30),
        (27.0, 30),
    ] {
        decide(&mut s, &with_ipcache(t, n, 8));
        if t == 15.0 {
            assert!(s.verdict.is_none(), "refilling past settle is waited for");
        }
    }
    let v = s.verdict.clone().unwrap();
    assert_eq!(v.status, Status::Passed, "{v:?}");
    let mut s = ipcache_step();
    for t in [1.0, 2.5, 5.0, 7.6, 30.0, 59.0] {
        decide(&mut s, &with_ipcache(t, 0, 8));
    }
    assert!(s.verdict.is_none(), "inside the timeout");
    decide(&mut s, &with_ipcache(60.5, 0, 8));
    let v = s.verdict.unwrap();
    assert_eq!(v.reasons, vec![Reason::MapEmptied], "{v:?}");
    assert!(
        v.summary
            .contains("not refilled within the step's timeout (30→0)"),
        "{v:?}"
    );
}

/// The reload follows XDP and the overlay device too: with a declared device set, each
/// declared device must get XDP again when the node had XDP, and the overlay stays.
#[test]
fn declared_devices_carry_xdp_and_the_overlay_along() {
    let mut s = step();
    for k in ["eth0:xdp", "cilium_vxlan", "cilium_host"] {
        std::sync::Arc::make_mut(&mut s.baseline)
            .programs
            .insert(k.into(), 9);
    }
    s.params.expect_devices = Some(vec!["eth0".into(), "eth2".into()]);
    let w: Vec<String> = wanted_devices(&s).into_iter().collect();
    assert_eq!(
        w,
        [
            "cilium_host",
            "cilium_vxlan",
            "eth0",
            "eth0:xdp",
            "eth2",
            "eth2:xdp"
        ]
    );
    s.params.expect_devices = None;
    assert!(wanted_devices(&s).contains("eth0:xdp"));
}

/// `bpf-lb-acceleration: best-effort`: the agent skips a device that refuses XDP, so a
/// declared device is held to XDP only where it had it before the restart.
#[test]
fn best_effort_xdp_is_wanted_only_where_it_was_attached() {
    let mut s = step();
    for k in ["eth0:xdp", "eth1"] {
        std::sync::Arc::make_mut(&mut s.baseline)
            .programs
            .insert(k.into(), 9);
    }
    s.params.expect_devices = Some(vec!["eth0".into(), "eth1".into(), "eth2".into()]);
    assert!(
        wanted_devices(&s).contains("eth1:xdp"),
        "native: every device"
    );
    s.reload.xdp_best_effort = true;
    let w: Vec<String> = wanted_devices(&s).into_iter().collect();
    assert_eq!(w, ["eth0", "eth0:xdp", "eth1", "eth2"]);
}

/// The real 1.20.2 agent after a per-node override dropped eth1: the overlay device reloads
/// first, eth0 about five seconds later, and eth1's programs are detached only after that.
/// Judged at the first quiet second after the overlay, the step failed
/// `device_set_changed` ("still attached to eth1"); the device set is judged once the
/// wanted devices have reloaded.
#[test]
fn a_dropped_device_is_judged_after_the_wanted_ones_reloaded() {
    let mut s = step();
    s.params.expect_devices = Some(vec!["eth0".into()]);
    std::sync::Arc::make_mut(&mut s.baseline)
        .programs
        .insert("cilium_vxlan".into(), 12);
    let at = |t: f64| -> Option<BTreeMap<String, Option<u32>>> {
        let (vx, e0, e1) = match t {
            t if t < 1.0 => (12, Some(10), Some(11)),
            t if t < 6.0 => (32, Some(10), Some(11)),
            t if t < 6.2 => (32, Some(20), Some(11)),
            _ => (32, Some(20), None),
        };
        Some(
            [
                ("eth0".to_string(), e0),
                ("eth1".to_string(), e1),
                ("cilium_vxlan".to_string(), Some(vx)),
            ]
            .into(),
        )
    };
    for t in [0.5, 1.0, 2.5, 4.0, 6.0, 6.2, 7.5, 9.0, 12.0, 14.0] {
        decide(&mut s, &obs(t, at(t)));
        if t < 6.0 {
            assert!(s.verdict.is_none(), "decided at {t}: {:?}", s.verdict);
        }
    }
    assert_eq!(
        s.verdict.as_ref().map(|v| v.status),
        Some(Status::Passed),
        "{:?}",
        s.verdict
    );
}

/// A rollout that drops eth1 on purpose: declared, the node coming back without eth1
/// passes; coming back as before (eth1 reloaded too) fails with device_set_changed.
#[test]
fn a_declared_device_set_is_what_the_node_is_held_to() {
    let expect = |s: &mut Step| s.params.expect_devices = Some(vec!["eth0".into()]);
    let mut s = step();
    expect(&mut s);
    for t in [1.0, 2.5, 5.0, 8.0] {
        decide(&mut s, &obs(t, progs(Some(20), None)));
    }
    assert_eq!(
        s.verdict.as_ref().unwrap().status,
        Status::Passed,
        "{:?}",
        s.verdict
    );
    let mut s = step();
    expect(&mut s);
    for t in [1.0, 2.5] {
        decide(&mut s, &obs(t, progs(Some(20), Some(21))));
    }
    let v = s.verdict.unwrap();
    assert_eq!(v.reasons, vec![Reason::DeviceSetChanged], "{v:?}");
    assert!(v.summary.contains("still attached to eth1"), "{v:?}");
    // Without a declaration, losing eth1 is the failure it always was.
    let mut s = step();
    for t in [1.0, 2.5] {
        decide(&mut s, &obs(t, progs(Some(20), None)));
    }
    assert_eq!(s.verdict.unwrap().reasons, vec![Reason::DeviceSetChanged]);
}

/// An upgrade step that declared 1.18: the node coming back with 1.16's maps fails, at the
/// timeout (the only deadline: until then the new agent may still be pinning its maps, and
/// a maps reading may predate its start), and it is never green meanwhile.
#[test]
fn a_declared_version_is_what_the_maps_are_held_to() {
    let mut s = step();
    s.params.expect_cilium = Some("1.18".into());
    for t in [1.0, 2.5, 10.0, 30.0] {
        decide(&mut s, &obs(t, progs(Some(20), Some(21))));
        assert!(s.verdict.is_none(), "decided at {t}s: {:?}", s.verdict);
    }
    assert!(
        s.checks["baseline"].reason.contains("cilium_ipcache_v2"),
        "{:?}",
        s.checks
    );
    decide(&mut s, &obs(61.0, progs(Some(20), Some(21))));
    let v = s.verdict.unwrap();
    assert_eq!(v.reasons, vec![Reason::MapMissing], "{v:?}");
    assert!(v.summary.contains("expected Cilium 1.18"), "{v:?}");
}

/// An upgrade to 1.18 unpins the tunnel map and the v1 node map by design.
#[test]
fn maps_removed_by_design_in_the_new_version_are_expected() {
    let s = restarted_without("cilium_tunnel_map", Some(3), true);
    assert_eq!(
        s.verdict.as_ref().unwrap().status,
        Status::Passed,
        "{:?}",
        s.verdict
    );
    assert!(s.maps["cilium_tunnel_map"]
        .judged
        .contains("removed by design: Cilium 1.18"));
}

/// A step whose baseline had `extra` (with `before` entries) through a restart that comes back
/// without it; with `v1_18`, the maps now name the release (`cilium_ipcache_v2`).
fn restarted_without(extra: &str, before: Option<u64>, v1_18: bool) -> Step {
    let mut s = step();
    std::sync::Arc::make_mut(&mut s.baseline)
        .maps
        .insert(extra.into(), before);
    for t in [1.0, 2.5, 5.0, 8.0] {
        let mut o = obs(t, progs(Some(20), Some(21)));
        if v1_18 {
            let mut m = maps(100).unwrap();
            m.insert("cilium_ipcache_v2".into(), Some(5));
            o.maps = Some(m);
        }
        decide(&mut s, &o);
    }
    s
}

/// A map no profile knows is never said to be removed by design: its vanishing is reported
/// as not known (it is not kept state stepguard counts); a retired name still is by design.
#[test]
fn a_map_no_profile_knows_is_not_removed_by_design() {
    let run = |extra: &str| restarted_without(extra, Some(4), true);
    let s = run("cilium_lb_affinity_match");
    assert_eq!(
        s.verdict.as_ref().unwrap().status,
        Status::Passed,
        "{:?}",
        s.verdict
    );
    let judged = &s.maps["cilium_lb_affinity_match"].judged;
    assert!(judged.starts_with("vanished (reported only)"), "{judged}");
    assert!(!judged.contains("by design:"), "{judged}");
    let s = run("cilium_lb4_backends_v2");
    assert!(s.maps["cilium_lb4_backends_v2"]
        .judged
        .contains("removed by design"));
}

/// The real 1.20.2 agent's start-up sweep unpins `cilium_l2_responder_v6` and
/// `cilium_lb4_maglev` on an IPv4-only node without Maglev while its program loads may pin
/// them again (a SIGKILL restart failed `map_missing` on the real agent): their vanishing is
/// no failure; another map's still is.
#[test]
fn maps_swept_for_a_disabled_feature_may_vanish() {
    let run = |extra: &str| restarted_without(extra, None, false);
    for m in ["cilium_l2_responder_v6", "cilium_lb4_maglev"] {
        let s = run(m);
        assert_eq!(
            s.verdict.as_ref().unwrap().status,
            Status::Passed,
            "{m}: {:?}",
            s.verdict
        );
        assert!(
            s.maps[m].judged.contains("start-up sweep"),
            "{:?}",
            s.maps[m]
        );
    }
    let s = run("cilium_lb4_source_range_x");
    assert_eq!(s.verdict.unwrap().reasons, vec![Reason::MapMissing]);
    // A swept map the node's features require (IPv6 on: `cilium_ct6_global`) is no sweep.
    let mut s = step();
    std::sync::Arc::make_mut(&mut s.baseline)
        .maps
        .insert("cilium_ct6_global".into(), Some(3));
    for t in [1.0, 2.5, 5.0, 8.0] {
        let mut o = obs(t, progs(Some(20), Some(21)));
        o.required_maps = Some(["cilium_ct6_global".to_string()].into_iter().collect());
        decide(&mut s, &o);
    }
    assert_eq!(s.verdict.unwrap().reasons, vec![Reason::MapMissing]);
    assert_eq!(s.maps["cilium_ct6_global"].judged, "missing");
}

#[test]
fn incomplete_evidence_is_never_a_pass() {
    let mut s = step();
    s.evidence_incomplete =
        Some("the agent was down from 1.0 to 3.0 while the datapath reloaded".into());
    decide(&mut s, &obs(10.0, progs(Some(20), Some(21))));
    assert_eq!(s.verdict.unwrap().reasons, vec![Reason::EvidenceIncomplete]);
}

#[test]
fn slower_dns_keeps_a_step_from_settling() {
    let mut s = step();
    let mut o = obs(1.0, progs(Some(20), Some(21)));
    o.dns_p50_after_ms = Some(9.0);
    for t in [1.0, 2.5, 10.0, 61.0] {
        o.now = t;
        o.complete_until = t;
        decide(&mut s, &o);
    }
    let v = s.verdict.unwrap();
    assert!(v.reasons.contains(&Reason::DnsSlower), "{v:?}");
}

/// Probes in flight at the end of the settle window: the step waits until they have
/// answered (before the fix it passed once probes sent at the start of settle had).
#[test]
fn a_step_does_not_pass_while_probes_of_the_settle_window_are_in_flight() {
    let mut s = step();
    s.targets.get_mut("gw").unwrap().samples = timeline(6.5, None);
    let reload = progs(Some(20), Some(21));
    for t in [1.0, 2.5] {
        decide(&mut s, &obs(t, reload.clone()));
    }
    // Green since 2.5, settle 5 s: at 7.6 the window has run, but probes sent after 6.5
    // have not all answered yet (complete only up to 6.5).
    let mut o = obs(7.6, reload.clone());
    o.complete_until = 6.5;
    decide(&mut s, &o);
    assert!(s.verdict.is_none(), "{:?}", s.verdict);
    s.targets.get_mut("gw").unwrap().samples = timeline(7.6, None);
    decide(&mut s, &obs(7.6, reload));
    assert_eq!(s.verdict.unwrap().status, Status::Passed);
}

fn witness_report(complete_until: f64, longest: f64) -> crate::wire::WitnessReport {
    crate::wire::WitnessReport {
        id: "s".into(),
        instance: "w1".into(),
        created_at: 0.0,
        complete_until,
        ended: false,
        burst_interval: Duration::from_millis(10),
        gaps: vec![TargetGap {
            target: "gw".into(),
            kind: "http".into(),
            longest_s: longest,
            error_bound_s: 0.01,
            total_s: longest,
            count: usize::from(longest > 0.0),
            budget_s: 2.0,
            open: false,
            ..Default::default()
        }],
        macs: BTreeMap::new(),
        probes: BTreeMap::new(),
        latency_ms: BTreeMap::new(),
    }
}

/// A witness's evidence is part of the verdict: over budget fails naming it and the
/// target; a witness that restarted is a hole; stale evidence never passes; covered
/// evidence within budget passes.
#[test]
fn witnesses_are_judged_like_the_nodes_own_probes() {
    let run = |track: super::super::WitnessTrack, fresh: bool| {
        let mut s = step();
        s.witnesses.insert("http://w:9970".into(), track.clone());
        let mut last = None;
        for t in [1.0, 2.5, 5.0, 9.0, 15.0] {
            if fresh {
                let mut tr = track.clone();
                if let Some(r) = tr.report.as_mut() {
                    r.complete_until = t - 0.3;
                }
                s.witnesses.insert("http://w:9970".into(), tr);
            }
            decide(&mut s, &obs(t, progs(Some(20), Some(21))));
            last = s.verdict.clone();
        }
        last
    };
    let ok = super::super::WitnessTrack {
        instance: "w1".into(),
        report: Some(witness_report(0.0, 0.5)),
        ..Default::default()
    };
    let v = run(ok.clone(), true).expect("decided");
    assert_eq!(v.status, Status::Passed, "{v:?}");
    assert!(v.summary.contains("as a LAN client sees it"), "{v:?}");
    let over = super::super::WitnessTrack {
        report: Some(witness_report(0.0, 3.0)),
        ..ok.clone()
    };
    let v = run(over, true).expect("decided");
    assert_eq!(v.reasons, vec![Reason::GapOverBudget]);
    assert!(v.summary.contains("witness http://w:9970: gw"), "{v:?}");
    // A witness step planted by someone else with a 1 h budget: the step's own budget
    // (2 s) judges the LAN gap.
    let mut planted = witness_report(0.0, 3.0);
    planted.gaps[0].budget_s = 3600.0;
    let planted = super::super::WitnessTrack {
        report: Some(planted),
        ..ok.clone()
    };
    let v = run(planted, true).expect("decided");
    assert_eq!(v.reasons, vec![Reason::GapOverBudget], "{v:?}");
    let lost = super::super::WitnessTrack {
        lost: Some("restarted".into()),
        ..ok.clone()
    };
    let v = run(lost, true).expect("decided");
    assert_eq!(v.reasons, vec![Reason::EvidenceIncomplete]);
    // Stale: the witness's evidence stops at 0 (unreachable): not passed by 15 s.
    let v = run(ok, false);
    assert!(
        v.as_ref().is_none_or(|v| v.status != Status::Passed),
        "{v:?}"
    );
}

/// Probes that could not even be sent (EMFILE, no permission) are a hole, never noise:
/// five of them end the step as evidence_incomplete, whatever the gaps say.
#[test]
fn probes_that_could_not_run_are_a_hole() {
    let mut s = step();
    s.targets.get_mut("gw").unwrap().not_run = NOT_RUN_LIMIT - 1;
    decide(&mut s, &obs(1.0, progs(Some(20), Some(21))));
    assert!(s.evidence_incomplete.is_none(), "under the limit");
    let t = s.targets.get_mut("gw").unwrap();
    t.not_run = NOT_RUN_LIMIT;
    t.not_run_detail = Some("Too many open files".into());
    decide(&mut s, &obs(2.5, progs(Some(20), Some(21))));
    let v = s.verdict.expect("decided");
    assert_eq!(v.reasons, vec![Reason::EvidenceIncomplete]);
    assert!(
        v.summary.contains("could not run (Too many open files)"),
        "{v:?}"
    );
}

/// The probe loop stalled for 400 ms (or probes could not run): a hole, never a pass.
#[test]
fn a_stalled_probe_loop_is_a_hole_in_the_evidence() {
    let mut s = step();
    let samples: Vec<super::super::gaps::Sample> = timeline(70.0, None)
        .into_iter()
        .filter(|x| !(x.sent > 3.0 && x.sent < 3.4))
        .collect();
    s.targets.get_mut("gw").unwrap().samples = samples;
    for t in [1.0, 2.5, 5.0, 9.0] {
        decide(&mut s, &obs(t, progs(Some(20), Some(21))));
    }
    let v = s.verdict.unwrap();
    assert_eq!(v.reasons, vec![Reason::EvidenceIncomplete], "{v:?}");
    assert!(
        v.summary.contains("no probe of gw was sent for 400ms"),
        "{v:?}"
    );
    // Lateness under the limit is not a hole: 150 ms without a probe at a 10 ms cadence
    // (scheduler noise on a busy node).
    let mut s = step();
    s.targets.get_mut("gw").unwrap().samples = timeline(70.0, None)
        .into_iter()
        .filter(|x| !(x.sent > 3.0 && x.sent < 3.15))
        .collect();
    for t in [1.0, 2.5, 5.0, 9.0] {
        decide(&mut s, &obs(t, progs(Some(20), Some(21))));
    }
    assert_eq!(s.verdict.unwrap().status, Status::Passed);
    // No probe at all (every probe failed to run): a hole too.
    let mut s = bare_step();
    decide(&mut s, &obs(1.0, progs(Some(20), Some(21))));
    assert_eq!(s.verdict.unwrap().reasons, vec![Reason::EvidenceIncomplete]);
}

/// A drop budget on a counter that cannot be read is never a pass (before: "0 drops in
/// the window", and the budget passed).
#[test]
fn a_budget_on_unknown_drop_counters_cannot_pass() {
    let mut s = step();
    s.params.drops_budget.insert("TC_INGRESS".into(), 10);
    for t in [1.0, 2.5, 8.0, 61.0] {
        let mut o = obs(t, progs(Some(20), Some(21)));
        o.drops_unknown = vec!["kernel".into()];
        decide(&mut s, &o);
    }
    let v = s.verdict.unwrap();
    assert!(v.reasons.contains(&Reason::DropsOverBudget), "{v:?}");
    assert!(
        v.summary.contains("kernel drop counters are unknown"),
        "{v:?}"
    );
}

#[test]
fn drops_over_budget_are_reported() {
    let mut s = step();
    s.params.drops_budget.insert("TC_INGRESS".into(), 10);
    let mut o = obs(1.0, progs(Some(20), Some(21)));
    o.drops.insert("kernel:TC_INGRESS".into(), 50);
    for t in [1.0, 2.5, 61.0] {
        o.now = t;
        o.complete_until = t;
        decide(&mut s, &o);
    }
    assert!(s
        .verdict
        .unwrap()
        .reasons
        .contains(&Reason::DropsOverBudget));
}

/// Kept state that vanished within the tolerance (one service frontend of six) does not fail
/// the step, and is never silent: the pass's summary names it in Cilium's terms and carries
/// the `kept_state_lost` warning, saying that Cilium's intent was not read.
#[test]
fn kept_state_lost_under_the_tolerance_is_named_on_the_pass() {
    let mut s = step();
    {
        let b = std::sync::Arc::make_mut(&mut s.baseline);
        b.maps.insert("cilium_lb4_services_v2".into(), Some(6));
        b.map_entries.insert(
            "cilium_lb4_services_v2".into(),
            vec![
                "198.51.100.10:80/TCP".into(),
                "198.51.100.70:443/TCP".into(),
            ],
        );
    }
    for t in [0.0, 1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 7.0, 9.0] {
        let p = if t < 1.2 {
            progs(Some(10), Some(11))
        } else {
            progs(Some(20), Some(21))
        };
        let mut o = obs(t, p);
        let mut m = maps(100).unwrap();
        m.insert(
            "cilium_lb4_services_v2".into(),
            Some(if t < 1.2 { 6 } else { 4 }),
        );
        o.maps = Some(m);
        o.map_entries.insert(
            "cilium_lb4_services_v2".into(),
            vec!["198.51.100.10:80/TCP".into()],
        );
        decide(&mut s, &o);
        if s.verdict.is_some() {
            break;
        }
    }
    let v = s.verdict.clone().expect("decided");
    assert_eq!(v.status, Status::Passed, "{v:?}");
    assert_eq!(v.warnings, vec![Reason::KeptStateLost], "{v:?}");
    assert!(
        v.summary.contains("KEPT STATE LOST")
            && v.summary.contains(
                "2 service frontends of cilium_lb4_services_v2 (6→4): 198.51.100.70:443/TCP"
            )
            && v.summary
                .contains("whether Cilium still intends it was not read"),
        "{}",
        v.summary
    );
    // A clean pass has none.
    let mut s = step();
    let v = reload_at_1_2(&mut s, &[0.0, 1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 7.0, 9.0]).unwrap();
    assert!(
        v.warnings.is_empty() && !v.summary.contains("KEPT"),
        "{v:?}"
    );
}

/// With the agent's services read: a frontend gone from the services map that the agent no
/// longer lists was deleted (a Service deleted in Kubernetes) — the step passes without a
/// loss, its reverse NAT entry with it; one the agent still lists is a loss: the step is not
/// green while it is missing and fails `kept_state_lost` at its timeout, naming it.
#[test]
fn a_frontend_gone_is_a_deletion_or_a_loss_by_the_agents_services() {
    let run = |listed: &[&str]| {
        let mut s = step();
        {
            let b = std::sync::Arc::make_mut(&mut s.baseline);
            b.maps.insert("cilium_lb4_services_v2".into(), Some(4));
            b.maps.insert("cilium_lb4_reverse_nat".into(), Some(2));
            b.map_entries.insert(
                "cilium_lb4_services_v2".into(),
                vec![
                    "198.51.100.10:80/TCP".into(),
                    "198.51.100.10:80/TCP backend slot 1".into(),
                    "198.51.100.70:443/TCP".into(),
                    "198.51.100.70:443/TCP backend slot 1".into(),
                ],
            );
        }
        let mut agent = crate::ciliumapi::AgentServices::default();
        for f in listed {
            agent.frontends.insert(f.to_string());
        }
        for t in [
            0.0, 1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 7.0, 9.0, 30.0, 59.0, 60.5,
        ] {
            let p = if t < 1.2 {
                progs(Some(10), Some(11))
            } else {
                progs(Some(20), Some(21))
            };
            let mut o = obs(t, p);
            let mut m = maps(100).unwrap();
            let after = t >= 1.5;
            m.insert(
                "cilium_lb4_services_v2".into(),
                Some(if after { 2 } else { 4 }),
            );
            m.insert(
                "cilium_lb4_reverse_nat".into(),
                Some(if after { 1 } else { 2 }),
            );
            o.maps = Some(m);
            if after {
                o.map_entries.insert(
                    "cilium_lb4_services_v2".into(),
                    vec![
                        "198.51.100.10:80/TCP".into(),
                        "198.51.100.10:80/TCP backend slot 1".into(),
                    ],
                );
                o.services = Some(agent.clone());
            }
            decide(&mut s, &o);
            if t == 30.0 && listed.len() == 2 {
                assert!(
                    s.verdict.is_none(),
                    "not green while a held frontend is missing"
                );
            }
            if s.verdict.is_some() {
                break;
            }
        }
        s
    };
    // Deleted: the agent lists only the other service.
    let s = run(&["198.51.100.10:80/TCP"]);
    let v = s.verdict.clone().expect("decided");
    assert_eq!(v.status, Status::Passed, "{v:?}");
    assert!(
        v.warnings.is_empty() && !v.summary.contains("KEPT"),
        "{v:?}"
    );
    let e = &s.maps["cilium_lb4_services_v2"];
    assert_eq!(e.deleted, 2, "{e:?}");
    assert!(
        e.judged
            .contains("deleted by the agent meanwhile: 198.51.100.70:443/TCP"),
        "{e:?}"
    );
    assert_eq!(s.maps["cilium_lb4_reverse_nat"].deleted, 1);
    // Lost: the agent still holds it.
    let s = run(&["198.51.100.10:80/TCP", "198.51.100.70:443/TCP"]);
    let v = s.verdict.clone().expect("decided");
    assert_eq!(v.status, Status::Failed, "{v:?}");
    assert_eq!(v.reasons, vec![Reason::KeptStateLost], "{v:?}");
    assert!(
        v.summary
            .contains("cilium_lb4_services_v2 lacks 2 entries the cilium-agent still holds")
            && v.summary.contains("198.51.100.70:443/TCP"),
        "{}",
        v.summary
    );
    assert!(v.finished_at >= 60.0, "only at the timeout: {v:?}");
}

/// Maglev's outer map is kept state: emptied across the restart it fails `map_emptied`; a
/// table gone with a service the agent deleted is no loss.
#[test]
fn a_maglev_table_is_kept_state() {
    assert_eq!(
        profile::map_class("cilium_lb4_maglev"),
        profile::MapClass::Kept
    );
    let run = |after: u64, agent: Option<crate::ciliumapi::AgentServices>| {
        let mut s = step();
        {
            let b = std::sync::Arc::make_mut(&mut s.baseline);
            b.maps.insert("cilium_lb4_maglev".into(), Some(3));
            b.maps.insert("cilium_lb4_services_v2".into(), Some(3));
            b.map_entries.insert(
                "cilium_lb4_services_v2".into(),
                vec![
                    "198.51.100.10:80/TCP".into(),
                    "198.51.100.11:80/TCP".into(),
                    "198.51.100.12:80/TCP".into(),
                ],
            );
        }
        for t in [0.0, 1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 7.0, 9.0] {
            let p = if t < 1.2 {
                progs(Some(10), Some(11))
            } else {
                progs(Some(20), Some(21))
            };
            let mut o = obs(t, p);
            let mut m = maps(100).unwrap();
            let later = t >= 1.5;
            m.insert(
                "cilium_lb4_maglev".into(),
                Some(if later { after } else { 3 }),
            );
            m.insert(
                "cilium_lb4_services_v2".into(),
                Some(if later { 2 } else { 3 }),
            );
            o.maps = Some(m);
            if later {
                o.map_entries.insert(
                    "cilium_lb4_services_v2".into(),
                    vec!["198.51.100.10:80/TCP".into(), "198.51.100.11:80/TCP".into()],
                );
                o.services = agent.clone();
            }
            decide(&mut s, &o);
            if s.verdict.is_some() {
                break;
            }
        }
        s
    };
    let s = run(0, None);
    let v = s.verdict.clone().expect("decided");
    assert_eq!(v.reasons, vec![Reason::MapEmptied], "{v:?}");
    assert!(v.summary.contains("cilium_lb4_maglev"), "{}", v.summary);
    // One service deleted in Kubernetes: its frontend and its table gone, no loss.
    let mut agent = crate::ciliumapi::AgentServices::default();
    agent.frontends.insert("198.51.100.10:80/TCP".into());
    agent.frontends.insert("198.51.100.11:80/TCP".into());
    let s = run(2, Some(agent));
    let v = s.verdict.clone().expect("decided");
    assert_eq!(v.status, Status::Passed, "{v:?}");
    assert!(v.warnings.is_empty(), "{v:?}");
    assert_eq!(s.maps["cilium_lb4_maglev"].deleted, 1);
}

/// A config step may declare hooks going away (tunnel → native: the overlay device and its
/// egress hook): the step is judged against the declaration — gone as declared passes, the
/// overlay still attached (the override not followed) fails naming it; undeclared, its loss
/// is a changed device set.
#[test]
fn hooks_declared_gone_are_judged_against_the_declaration() {
    let with_overlay = |gone: &[&str]| {
        let mut s = step();
        for k in ["cilium_vxlan", "cilium_vxlan:to_overlay"] {
            std::sync::Arc::make_mut(&mut s.baseline)
                .programs
                .insert(k.into(), 9);
        }
        s.params.expect_gone = gone.iter().map(|g| g.to_string()).collect();
        s
    };
    let run = |s: &mut Step, overlay_after: Option<u32>| {
        for t in [0.0, 1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 7.0, 9.0, 61.0] {
            let mut p = if t < 1.2 {
                progs(Some(10), Some(11))
            } else {
                progs(Some(20), Some(21))
            }
            .unwrap();
            let ov = if t < 1.2 { Some(9) } else { overlay_after };
            p.insert("cilium_vxlan".into(), ov);
            p.insert("cilium_vxlan:to_overlay".into(), ov);
            decide(s, &obs(t, Some(p)));
            if s.verdict.is_some() {
                break;
            }
        }
        s.verdict.clone().unwrap()
    };
    // Declared by device name (all its keys): gone passes.
    let mut s = with_overlay(&["cilium_vxlan"]);
    assert!(!wanted_devices(&s).contains("cilium_vxlan:to_overlay"));
    assert_eq!(run(&mut s, None).status, Status::Passed);
    // Declared, still attached (reloaded): fails naming it.
    let mut s = with_overlay(&["cilium_vxlan", "cilium_vxlan:to_overlay"]);
    let v = run(&mut s, Some(30));
    assert_eq!(v.reasons, vec![Reason::DeviceSetChanged], "{v:?}");
    assert!(
        v.summary.contains("cilium_vxlan") && v.summary.contains("declared it gone"),
        "{v:?}"
    );
    // Not declared: the overlay's loss is a changed device set.
    let mut s = with_overlay(&[]);
    let v = run(&mut s, None);
    assert_eq!(v.reasons, vec![Reason::DeviceSetChanged], "{v:?}");
    assert!(
        v.summary.contains("no longer attached to cilium_vxlan"),
        "{v:?}"
    );
}

/// A tunnel node (eth0, eth1, the VXLAN overlay's two hooks) restarted; the overlay's ids
/// after the reload (None: gone) and the configuration the observation read, and when.
fn overlay_run(
    overlay_after: Option<u32>,
    intent: Option<(&str, f64)>,
    ticks: &[f64],
) -> (Step, Option<Verdict>) {
    let mut s = step();
    s.params.settle = Duration::from_secs(2);
    s.params.timeout = Duration::from_secs(20);
    let mut b = (*s.baseline).clone();
    b.programs.insert("cilium_vxlan".into(), 30);
    b.programs.insert("cilium_vxlan:to_overlay".into(), 31);
    s.baseline = std::sync::Arc::new(b);
    let cfg = |mode: &str| {
        crate::cilium::devices::overlay_intent(
            &[("routing-mode".to_string(), mode.to_string())].into(),
        )
    };
    for &t in ticks {
        let mut p = if t < 1.2 {
            progs(Some(10), Some(11)).unwrap()
        } else {
            progs(Some(20), Some(21)).unwrap()
        };
        let (a, b) = if t < 1.2 {
            (Some(30), Some(31))
        } else {
            (overlay_after, overlay_after.map(|i| i + 1))
        };
        p.insert("cilium_vxlan".into(), a);
        p.insert("cilium_vxlan:to_overlay".into(), b);
        let mut o = obs(t, Some(p));
        // Before the restart the configuration asked for the tunnel; from `at` on it reads
        // the restarted agent's.
        o.overlay = Some(match intent {
            Some((mode, at)) if t >= at => (cfg(mode), t),
            _ => (cfg("tunnel"), t.min(1.0)),
        });
        decide(&mut s, &o);
        if s.verdict.is_some() {
            break;
        }
    }
    let v = s.verdict.clone();
    (s, v)
}

/// The restarted agent's configuration decides the overlay: native routing followed (the
/// overlay gone) passes; not followed (still attached) fails naming it; an overlay lost
/// while the new configuration was not yet read waits for it, and fails at the timeout if it
/// never comes.
#[test]
fn the_restarted_agents_configuration_decides_the_overlay() {
    let ticks: Vec<f64> = (0..=250).map(|i| i as f64 * 0.1).collect();
    let (_, v) = overlay_run(None, Some(("native", 1.5)), &ticks);
    let v = v.expect("decided");
    assert_eq!(v.status, Status::Passed, "native followed: {v:?}");

    // The configuration read late (4 s after the reload): no failure meanwhile.
    let (_, v) = overlay_run(None, Some(("native", 5.2)), &ticks);
    let v = v.expect("decided");
    assert_eq!(v.status, Status::Passed, "read late: {v:?}");

    let (_, v) = overlay_run(Some(40), Some(("native", 1.5)), &ticks);
    let v = v.expect("decided");
    assert_eq!(v.status, Status::Failed, "{v:?}");
    assert_eq!(v.reasons, vec![Reason::DeviceSetChanged]);
    assert!(
        v.summary.contains("cilium_vxlan") && v.summary.contains("routing-mode=native"),
        "{}",
        v.summary
    );

    // Tunnel kept, tunnel asked for: a pass.
    let (_, v) = overlay_run(Some(40), Some(("tunnel", 1.5)), &ticks);
    assert_eq!(v.expect("decided").status, Status::Passed);

    // The overlay lost and the restarted agent's configuration never read: not a pass, and
    // not a failure before the timeout; at the timeout the lost overlay fails.
    let (s, v) = overlay_run(None, None, &ticks[..60]);
    assert!(v.is_none(), "waits for the configuration: {v:?}");
    assert!(
        s.checks["reload"]
            .reason
            .contains("waiting for the restarted agent's configuration"),
        "{:?}",
        s.checks
    );
    let (_, v) = overlay_run(None, None, &ticks);
    let v = v.expect("decided at the timeout");
    assert_eq!(v.reasons, vec![Reason::DeviceSetChanged], "{v:?}");

    // Tunnel kept but the configuration never read again after the restart: no pass.
    let (_, v) = overlay_run(Some(40), None, &ticks);
    let v = v.expect("decided at the timeout");
    assert_eq!(v.status, Status::Failed, "{v:?}");
}

/// From native to tunnel: the new overlay's hooks are wanted once the restarted agent's
/// configuration asks for them.
#[test]
fn an_overlay_the_configuration_adds_is_wanted() {
    let mut s = step();
    s.params.settle = Duration::from_secs(2);
    s.params.timeout = Duration::from_secs(10);
    let intent = |mode: &str| {
        crate::cilium::devices::overlay_intent(
            &[("routing-mode".to_string(), mode.to_string())].into(),
        )
    };
    for i in 0..=110 {
        let t = i as f64 * 0.1;
        let mut p = if t < 1.2 {
            progs(Some(10), Some(11)).unwrap()
        } else {
            progs(Some(20), Some(21)).unwrap()
        };
        // The overlay never appears.
        p.insert("cilium_vxlan".into(), None);
        p.insert("cilium_vxlan:to_overlay".into(), None);
        let mut o = obs(t, Some(p));
        o.overlay = Some((intent(if t < 1.2 { "native" } else { "tunnel" }), t));
        decide(&mut s, &o);
        if s.verdict.is_some() {
            break;
        }
    }
    let v = s.verdict.expect("decided");
    assert_eq!(v.status, Status::Failed, "{v:?}");
    assert!(v.summary.contains("cilium_vxlan"), "{}", v.summary);
}

/// XDP turned off by the restarted agent's configuration (`bpf-lb-acceleration: disabled`)
/// or `cil_to_netdev` no longer required: the hooks going away are what it asks for, not a
/// changed device set; one it no longer asks for that stays attached fails, naming why.
#[test]
fn hooks_the_restarted_agents_configuration_turns_off_are_meant_to_go() {
    const BEFORE: [(&str, &str); 3] = [
        ("routing-mode", "native"),
        ("bpf-lb-acceleration", "native"),
        ("kube-proxy-replacement", "true"),
    ];
    let run = |gone_after: bool, off: &[(&str, &str)]| {
        let mut s = step();
        s.params.settle = Duration::from_secs(2);
        s.params.timeout = Duration::from_secs(20);
        let mut b = (*s.baseline).clone();
        b.programs.insert("eth0:xdp".into(), 30);
        b.programs.insert("eth0:to_netdev".into(), 31);
        s.baseline = std::sync::Arc::new(b);
        let intent = |pairs: &[(&str, &str)]| {
            let cfg: std::collections::BTreeMap<String, String> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            crate::cilium::devices::overlay_intent(&cfg).with_hooks(&cfg, Some("1.20"))
        };
        for i in 0..=250 {
            let t = i as f64 * 0.1;
            let mut p = if t < 1.2 {
                progs(Some(10), Some(11)).unwrap()
            } else {
                progs(Some(20), Some(21)).unwrap()
            };
            let (x, n) = match (t < 1.2, gone_after) {
                (true, _) => (Some(30), Some(31)),
                (false, true) => (None, None),
                (false, false) => (Some(30), Some(31)),
            };
            p.insert("eth0:xdp".into(), x);
            p.insert("eth0:to_netdev".into(), n);
            let mut o = obs(t, Some(p));
            o.overlay = Some(if t >= 1.5 {
                (intent(off), t)
            } else {
                (intent(&BEFORE), t.min(1.0))
            });
            decide(&mut s, &o);
            if s.verdict.is_some() {
                break;
            }
        }
        s.verdict.expect("decided")
    };
    let off = [
        ("routing-mode", "native"),
        ("bpf-lb-acceleration", "disabled"),
        ("kube-proxy-replacement", "false"),
    ];
    let v = run(true, &off);
    assert_eq!(v.status, Status::Passed, "{v:?}");
    // Left attached although the configuration turned them off: the datapath did not follow.
    let v = run(false, &off);
    assert_eq!(v.reasons, vec![Reason::DeviceSetChanged], "{v:?}");
    assert!(
        v.summary.contains("eth0:xdp") && v.summary.contains("no XDP"),
        "{}",
        v.summary
    );
    // Lost while the configuration still asks for them: a changed device set, as before.
    let v = run(true, &BEFORE);
    assert_eq!(v.reasons, vec![Reason::DeviceSetChanged], "{v:?}");
}
