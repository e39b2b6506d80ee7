use super::*;

/// `burst_interval 10s` with `max_gap 1s` used to pass a 3 s outage as `0±10000ms`: a
/// cadence that cannot resolve the budget is refused, naming the field.
#[test]
fn a_cadence_coarser_than_the_budget_is_refused() {
    let burst = Duration::from_millis(10);
    let req = StepRequest {
        burst_interval: Some("10s".into()),
        max_gap: Some("1s".into()),
        ..Default::default()
    };
    let e = StepParams::from_request(&req, burst, &[]).unwrap_err();
    assert_eq!(e.field, "burst_interval", "{e}");
    // A target's own budget counts too.
    let req = StepRequest {
        burst_interval: Some("100ms".into()),
        ..Default::default()
    };
    assert!(StepParams::from_request(&req, burst, &[]).is_ok());
    let e = StepParams::from_request(&req, burst, &[Duration::from_millis(150)]).unwrap_err();
    assert_eq!(e.field, "burst_interval");
    assert!(StepParams::from_request(&req, burst, &[Duration::from_millis(200)]).is_ok());
}

/// Each spelling of one witness is one witness (and one metric series).
#[test]
fn witness_urls_are_normalised() {
    let req = StepRequest {
        witnesses: Some(vec![
            "http://W.example:9970".into(),
            "http://w.example:9970/".into(),
        ]),
        ..Default::default()
    };
    let (_, p) = StepParams::from_request(&req, Duration::from_millis(10), &[]).unwrap();
    assert_eq!(p.witnesses, vec!["http://w.example:9970".to_string()]);
    let req = StepRequest {
        witnesses: Some(vec!["http://u1@w.example:9970".into()]),
        ..Default::default()
    };
    let e = StepParams::from_request(&req, Duration::from_millis(10), &[]).unwrap_err();
    assert_eq!(e.field, "witnesses", "{e}");
}

#[test]
fn requests_are_validated_with_the_field_named() {
    let burst = Duration::from_millis(10);
    let (_, p) = StepParams::from_request(&StepRequest::default(), burst, &[]).unwrap();
    assert_eq!(p.timeout, StepParams::DEFAULT_TIMEOUT);
    for (req, field) in [
        (
            StepRequest {
                timeout: Some("soon".into()),
                ..Default::default()
            },
            "timeout",
        ),
        (
            StepRequest {
                timeout: Some("100h".into()),
                ..Default::default()
            },
            "timeout",
        ),
        (
            StepRequest {
                settle: Some("20m".into()),
                timeout: Some("10m".into()),
                ..Default::default()
            },
            "settle",
        ),
        (
            StepRequest {
                max_gap: Some("0ms".into()),
                ..Default::default()
            },
            "max_gap",
        ),
        (
            StepRequest {
                id: Some("../etc".into()),
                ..Default::default()
            },
            "id",
        ),
        (
            StepRequest {
                dns_slower_ratio: Some(0.5),
                ..Default::default()
            },
            "dns_slower_ratio",
        ),
    ] {
        let e = StepParams::from_request(&req, burst, &[]).unwrap_err();
        assert_eq!(e.field, field, "{e}");
        assert!(e.to_string().starts_with(field), "{e}");
        assert_eq!(e.to_string().lines().count(), 1);
    }
}

fn bare(boot: Option<&str>) -> Step {
    let (_, params) =
        StepParams::from_request(&StepRequest::default(), Duration::from_millis(10), &[]).unwrap();
    let mut s = Step::new(
        "s".into(),
        0.0,
        params,
        Baseline::default(),
        BTreeMap::new(),
    );
    s.updated_at = 5.0;
    s.boot_id = boot.map(str::to_string);
    s
}

/// The readings taken every second are taken at every decision once a pass is near: not
/// before the step has been green for all but the lead of its settle window, always when the
/// window itself is that short.
#[test]
fn a_pass_is_near_only_within_the_lead_of_the_settle_window() {
    let mut s = bare(None);
    s.params.settle = Duration::from_secs(5);
    assert!(!s.pass_near(100.0, 1.5), "not green: no pass this tick");
    s.green_since = Some(97.0);
    assert!(!s.pass_near(100.0, 1.5), "green 3 s of 5");
    s.green_since = Some(96.5);
    assert!(s.pass_near(100.0, 1.5), "green 3.5 s of 5");
    s.green_since = Some(90.0);
    assert!(s.pass_near(100.0, 1.5));
    s.green_since = None;
    s.params.settle = Duration::from_secs(1);
    assert!(
        s.pass_near(100.0, 1.5),
        "a 1 s window can pass at any green tick"
    );
}

/// A step persisted on one boot and resumed on another (the node rebooted with the
/// agent): CLOCK_BOOTTIME restarted and nothing was watched, so incomplete evidence
/// (before the fix the boot was not recorded and the step could pass).
#[test]
fn a_step_resumed_on_another_boot_is_incomplete_evidence() {
    let mut s = bare(Some("boot-a"));
    s.resume(9.0, Some("boot-a"));
    assert_eq!(s.holes, vec![(5.0, 9.0)]);
    // Any hole in the step window blocks a pass (before, a hole with no datapath change
    // and no outage running at the kill passed: a 3 s outage while the agent was down
    // went unseen).
    assert!(s
        .evidence_incomplete
        .as_deref()
        .unwrap()
        .contains("down for 4.0s"));
    let mut s = bare(Some("boot-a"));
    s.resume(9.0, Some("boot-b"));
    assert!(s.evidence_incomplete.unwrap().contains("rebooted"));
}

#[test]
fn only_failing_or_regressed_node_checks_block_a_step() {
    let now = [
        crate::checks::CheckResult::unknown(
            "config",
            crate::checks::Code::NoCiliumConfig,
            "",
            serde_json::json!({}),
        ),
        crate::checks::CheckResult::unknown(
            "maps",
            crate::checks::Code::NoPermission,
            "",
            serde_json::json!({}),
        ),
        crate::checks::CheckResult::fail(
            "devices",
            crate::checks::Code::DeviceMissing,
            "",
            serde_json::json!({}),
        ),
        crate::checks::CheckResult::pass(
            "vips",
            crate::checks::Code::Ok,
            "",
            serde_json::json!({}),
        ),
    ];
    let baseline: BTreeMap<String, String> = [
        ("config", "unknown"),
        ("maps", "pass"),
        ("devices", "pass"),
        ("vips", "pass"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let b = super::lifecycle::blocking_node_checks(&now, &baseline);
    assert_eq!(b.len(), 2, "{b:?}");
    assert!(b[0].starts_with("maps unknown") && b[1].starts_with("devices fail"));
}

/// Drops count from the baseline, except `cilium_metrics` recreated at the restart (a new
/// map id): its counters restarted from zero and count from there. A source unreadable now
/// is named unknown, never counted as zero drops.
#[test]
fn drops_count_from_the_baseline_or_from_a_recreated_map() {
    let mut b = Baseline::default();
    b.cilium_drops.insert("POLICY_DENIED".into(), 10);
    b.kernel_drops.insert("NOT_SPECIFIED".into(), 5);
    b.map_ids.insert("cilium_metrics".into(), 7);
    let now: BTreeMap<String, u64> = [("POLICY_DENIED".to_string(), 12)].into();
    let kernel: BTreeMap<String, u64> = [("NOT_SPECIFIED".to_string(), 5)].into();
    let same: BTreeMap<String, u32> = [("cilium_metrics".to_string(), 7)].into();
    let (d, unknown) = lifecycle::drops_since(&b, Some(&kernel), Some(&now), Some(&same));
    assert_eq!(d, [("cilium:POLICY_DENIED".to_string(), 2)].into());
    assert!(unknown.is_empty());
    let recreated: BTreeMap<String, u32> = [("cilium_metrics".to_string(), 8)].into();
    let (d, _) = lifecycle::drops_since(&b, Some(&kernel), Some(&now), Some(&recreated));
    assert_eq!(d["cilium:POLICY_DENIED"], 12);
    let (d, unknown) = lifecycle::drops_since(&b, None, Some(&now), Some(&same));
    assert_eq!(unknown, vec!["kernel".to_string()]);
    assert_eq!(d.len(), 1);
}

/// A witness that answers as another instance, or no longer knows the step, has lost its
/// evidence for good; one that could not be reached is only asked again.
#[test]
fn a_witness_that_restarted_has_lost_its_evidence() {
    let mut s = bare(None);
    s.witnesses.insert(
        "http://w".into(),
        WitnessTrack {
            instance: "a".into(),
            ..Default::default()
        },
    );
    let report = |instance: &str| crate::wire::WitnessReport {
        id: "s".into(),
        instance: instance.into(),
        created_at: 0.0,
        complete_until: 0.0,
        ended: false,
        burst_interval: Duration::from_millis(10),
        gaps: vec![],
        macs: BTreeMap::new(),
        probes: BTreeMap::new(),
        latency_ms: BTreeMap::new(),
    };
    use lifecycle::WitnessPollError;
    s.witness_answered(
        "http://w",
        Err(WitnessPollError::Failed("down".into())),
        1.0,
    );
    assert_eq!(s.witnesses["http://w"].last_error.as_deref(), Some("down"));
    assert!(s.witnesses["http://w"].lost.is_none());
    s.witness_answered("http://w", Ok(report("a")), 2.0);
    assert_eq!(s.witnesses["http://w"].last_ok_at, Some(2.0));
    assert!(s.witnesses["http://w"].last_error.is_none());
    s.witness_answered("http://w", Ok(report("b")), 3.0);
    assert!(s.witnesses["http://w"]
        .lost
        .as_deref()
        .unwrap()
        .contains("restarted"));
    let mut t = bare(None);
    t.witnesses
        .insert("http://w".into(), WitnessTrack::default());
    t.witness_answered(
        "http://w",
        Err(WitnessPollError::Unknown("no such step".into())),
        1.0,
    );
    assert!(t.witnesses["http://w"]
        .lost
        .as_deref()
        .unwrap()
        .contains("no longer knows"));
}

/// Cancelling decides a step once; an older unfinished step beside a newer one is decided
/// as incomplete evidence, naming the newer.
#[test]
fn cancel_and_abandon_decide_a_step_once() {
    let mut s = bare(None);
    assert!(s.cancel(9.0));
    assert_eq!(s.verdict.as_ref().unwrap().status, Status::Cancelled);
    assert!(!s.cancel(10.0));
    assert_eq!(s.verdict.as_ref().unwrap().finished_at, 9.0);
    let mut old = bare(None);
    old.abandon("step-new", 20.0);
    let v = old.verdict.unwrap();
    assert_eq!(
        (v.status, v.reasons),
        (Status::Failed, vec![Reason::EvidenceIncomplete])
    );
    assert!(v.summary.contains("step-new"), "{}", v.summary);
}

/// At the agent's start, a snapshot on another boot or with other program ids is a restart
/// nobody watched; the same boot and ids is none.
#[test]
fn a_restart_while_the_agent_was_down_is_found_at_its_start() {
    let old = implicit::Steady {
        at: 100.0,
        boot_id: Some("boot-a".into()),
        baseline: Baseline::default(),
    };
    assert!(implicit::found_at_start(&old, &[], Some("boot-a"), 130.0).is_none());
    let (trigger, why) =
        implicit::found_at_start(&old, &["eth0".to_string()], Some("boot-a"), 130.0).unwrap();
    assert!(trigger.contains("new program ids on eth0"), "{trigger}");
    assert!(why.contains("30s ago"), "{why}");
    let (trigger, _) = implicit::found_at_start(&old, &[], Some("boot-b"), 130.0).unwrap();
    assert!(trigger.contains("rebooted"), "{trigger}");
    assert_eq!(
        implicit::trigger(true, &["eth0".to_string()]).unwrap(),
        "the cilium-agent API socket stopped answering (stopped, or starting)"
    );
    assert!(implicit::trigger(false, &[]).is_none());
}

/// One step at a time: the active id re-posted the same way is the same step, with another
/// parameter a conflict naming it; another id is busy; a finished id is never begun again.
#[test]
fn a_posted_step_is_admitted_once() {
    use admission::{admit, Admission};
    let active = bare(None);
    let p = active.params.clone();
    assert!(matches!(
        admit(Some("s"), &p, Some(&active), None),
        Admission::Same(_)
    ));
    assert!(matches!(
        admit(Some("t"), &p, Some(&active), None),
        Admission::Busy(_)
    ));
    let mut other = p.clone();
    other.settle += Duration::from_secs(1);
    assert!(matches!(
        admit(Some("s"), &other, Some(&active), None),
        Admission::SameIdOtherParams {
            field: "settle",
            ..
        }
    ));
    let mut done = bare(None);
    done.cancel(1.0);
    assert!(matches!(
        admit(Some("s"), &p, Some(&done), Some(&done)),
        Admission::Finished(_)
    ));
    assert!(matches!(
        admit(Some("u"), &p, Some(&done), Some(&done)),
        Admission::Begin
    ));
    assert!(matches!(admit(None, &p, None, None), Admission::Begin));
    assert!(admission::valid_id("step-1.a_b") && !admission::valid_id(".hidden"));
    assert!(!admission::valid_id("a/b") && !admission::valid_id(&"x".repeat(65)));
}

/// Endpoints are the devices carrying `cil_from_container`: `lxc*` from the endpoint scan,
/// and any host device carrying it (a chained plugin's `cali*` veth, a renamed `lxc`);
/// host devices without it are none.
#[test]
fn a_host_device_carrying_cil_from_container_is_an_endpoint() {
    use crate::kernel::links::{AttachedProgram, Device, EndpointDevice, Observation};
    let prog = |hook: &'static str, name: &str, id: u32| AttachedProgram {
        hook,
        via: "tcx",
        prog_id: id,
        name: Some(name.into()),
        filter: None,
        loaded_at: None,
        link_pin: None,
    };
    let dev = |name: &str, ifindex: u32, programs: Vec<AttachedProgram>| Device {
        name: name.into(),
        ifindex,
        programs,
        ..Default::default()
    };
    let obs = Observation {
        devices: vec![
            dev("eth0", 2, vec![prog("ingress", "cil_from_netdev", 5)]),
            dev(
                "cali1234",
                7,
                vec![
                    prog("ingress", "cil_from_container", 9),
                    prog("egress", "cil_to_container", 10),
                ],
            ),
        ],
        endpoints: vec![EndpointDevice {
            name: "lxc1".into(),
            ifindex: 8,
            kind: Some("veth".into()),
            programs: vec![prog("ingress", "cil_from_container", 11)],
            raced: false,
        }],
        ..Default::default()
    };
    let eps = observe::endpoint_programs(&obs);
    assert_eq!(eps.keys().collect::<Vec<_>>(), vec!["cali1234", "lxc1"]);
    assert_eq!(eps["cali1234"].from_container, Some(9));
    assert_eq!(eps["cali1234"].to_container, Some(10));
    assert_eq!(eps["cali1234"].ifindex, 7);
}

/// Every reason is named in JSON as `as_str` names it, and docs/reference/checks.md lists
/// each; a reason missing from `Reason::ALL` makes the count wrong.
#[test]
fn every_reason_is_named_alike_and_documented() {
    let readme = include_str!("../../../docs/reference/checks.md");
    let mut names = std::collections::BTreeSet::new();
    for r in Reason::ALL {
        assert_eq!(serde_json::to_value(r).unwrap(), r.as_str());
        assert!(names.insert(r.as_str()));
        assert!(
            readme.contains(&format!("`{}`", r.as_str())),
            "docs/reference/checks.md does not name `{}`",
            r.as_str()
        );
    }
    // As many as the enum has: `as_str`'s match is exhaustive; this counts its arms.
    let arms = include_str!("mod.rs")
        .matches("            Reason::")
        .count();
    assert_eq!(names.len(), arms, "Reason::ALL misses a reason");
}
