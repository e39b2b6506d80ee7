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

/// A corrupt step file and a 9 MiB file in the state dir: both set aside with a log
/// line, neither parsed on a request; good steps still load.
#[test]
fn corrupt_and_oversized_step_files_are_quarantined() {
    let root = std::env::temp_dir().join(format!("sg-store-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let store = StepStore::new(&root).unwrap();
    store.save(&bare(None)).unwrap();
    std::fs::write(root.join("steps/broken.json"), b"{not json").unwrap();
    std::fs::write(
        root.join("steps/huge.json"),
        vec![b' '; (MAX_STEP_FILE + 1) as usize],
    )
    .unwrap();
    let store = StepStore::new(&root).unwrap();
    assert_eq!(store.list().len(), 1);
    assert!(store.load("s").is_some());
    assert!(root.join("steps/broken.quarantined").exists());
    assert!(root.join("steps/huge.quarantined").exists());
    assert!(!root.join("steps/broken.json").exists());
    let _ = std::fs::remove_dir_all(&root);
}
