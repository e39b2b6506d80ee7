use super::*;

/// A flapping target (an outage every 40 ms for 200 s): the record stays bounded and the
/// gap summary (longest, total, count) is what it would be with every outage kept.
#[test]
fn a_flapping_target_keeps_a_bounded_record() {
    let samples: Vec<(f64, bool)> = (0..20_000)
        .map(|i| (i as f64 * 0.01, i % 4 != 0 || i == 8_000))
        .map(|(t, ok)| {
            (
                t,
                if (8_000..8_050).contains(&((t * 100.0) as i64)) {
                    false
                } else {
                    ok
                },
            )
        })
        .collect();
    let samples: Vec<gaps::Sample> = samples.into_iter().map(Into::into).collect();
    let full = TargetTimeline {
        samples: samples.clone(),
        ..Default::default()
    };
    let want = gaps::summarize(&full.outages(), 0.01, 200.0);
    let mut t = TargetTimeline::default();
    for chunk in samples.chunks(500) {
        t.samples.extend_from_slice(chunk);
        t.compact(chunk[0].sent);
    }
    t.compact(1e9);
    assert!(t.prior.len() <= MAX_OUTAGES, "{}", t.prior.len());
    let mut got = gaps::summarize(&t.outages(), 0.01, 200.0);
    got.count += t.dropped_outages as usize;
    got.total += t.dropped_total_s;
    assert_eq!(got.count, want.count);
    assert!((got.total - want.total).abs() < 1e-6);
    assert!(
        (got.longest - want.longest).abs() < 1e-9,
        "{got:?} vs {want:?}"
    );
}

#[test]
fn compacting_a_timeline_keeps_its_outages() {
    let samples: Vec<(f64, bool)> = (0..1000)
        .map(|i| (i as f64 * 0.01, !(300..600).contains(&i) && i != 800))
        .collect();
    let samples: Vec<gaps::Sample> = samples.into_iter().map(Into::into).collect();
    let full = TargetTimeline {
        samples: samples.clone(),
        ..Default::default()
    };
    let mut compacted = TargetTimeline::default();
    for chunk in samples.chunks(37) {
        compacted.samples.extend_from_slice(chunk);
        let cutoff = chunk[0].sent;
        compacted.compact(cutoff);
    }
    assert_eq!(compacted.outages(), full.outages());
    assert!(compacted.samples.len() < 100, "memory stays bounded");
}

/// Held answers across a compaction cutoff: an outage whose end (the release of the held
/// answers) lies after the cutoff, with a failure and a prompt answer sent before that end
/// among the kept samples, comes out as if nothing had been folded, wherever the cutoffs
/// fall.
#[test]
fn compacting_through_held_answers_keeps_the_outages() {
    let mut samples: Vec<gaps::Sample> = Vec::new();
    for i in 0..600 {
        let sent = i as f64 * 0.01;
        samples.push(if (100..200).contains(&i) || i == 215 {
            gaps::Sample::failed(sent)
        } else if (200..215).contains(&i) {
            // Held until 2.3 (answered one usual round trip after).
            gaps::Sample::answered(sent, 2.3 - sent + 0.001, 0.001)
        } else if (300..400).contains(&i) {
            gaps::Sample::failed(sent)
        } else if (400..420).contains(&i) {
            gaps::Sample::answered(sent, 4.25 - sent + 0.001, 0.001)
        } else {
            gaps::Sample::answered(sent, 0.001, 0.001)
        });
    }
    let full = TargetTimeline {
        samples: samples.clone(),
        ..Default::default()
    }
    .outages();
    assert_eq!(full.len(), 2, "{full:?}");
    assert!(
        (full[1].end.unwrap() - 4.2).abs() < 1e-6,
        "a prompt answer at 4.20: {full:?}"
    );
    for chunk in [1, 7, 13, 37, 101] {
        let mut t = TargetTimeline::default();
        for c in samples.chunks(chunk) {
            t.samples.extend_from_slice(c);
            t.compact(c[0].sent);
        }
        assert_eq!(t.outages(), full, "chunks of {chunk}");
    }
}

#[test]
fn outages_continue_across_an_agent_restart() {
    let mut t = TargetTimeline {
        prior: vec![Outage::begin(1.0, None)],
        ..Default::default()
    };
    t.samples = vec![(5.0, false).into(), (6.0, true).into()];
    let o = t.outages();
    assert_eq!((o.len(), o[0].start, o[0].end), (1, 1.0, Some(6.0)));
    assert_eq!(o[0].last_failed, Some(5.0));
    let mut t = TargetTimeline {
        prior: vec![Outage {
            start: 1.0,
            end: Some(2.0),
            after_ok: None,
            last_failed: Some(1.5),
            failed: 2,
            held: None,
        }],
        ..Default::default()
    };
    t.samples = vec![(5.0, true).into(), (6.0, false).into(), (7.0, true).into()];
    assert_eq!(t.outages().len(), 2);
}
