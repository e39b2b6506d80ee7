use super::*;
use axum::body::Body;
use http_body_util::BodyExt;
use tower::ServiceExt;

fn witness(token: Option<&str>) -> Arc<Witness> {
    let cfg: Config = crate::probe::parse(
        "targets:\n  - {name: gw, address: 127.0.0.1, port: 9, probe: tcp, timeout: 100ms}\n",
    )
    .unwrap();
    Witness::new(
        cfg,
        WitnessOptions {
            probe_interval: Duration::from_secs(1),
            burst_interval: Duration::from_millis(10),
            token: crate::serving::Token::fixed(token.map(String::from)),
        },
        None,
    )
    .unwrap()
}

/// A witness is not made from a configuration it cannot probe: no targets, or a cadence
/// out of range, each refused with the field named.
#[test]
fn a_witness_refuses_what_it_cannot_probe() {
    let opts = |probe_ms: u64, burst_ms: u64| WitnessOptions {
        probe_interval: Duration::from_millis(probe_ms),
        burst_interval: Duration::from_millis(burst_ms),
        token: crate::serving::Token::fixed(None),
    };
    let empty: Config = crate::probe::parse("targets: []\n").unwrap();
    let e = Witness::new(empty, opts(1000, 10), None).err().unwrap();
    assert!(e.to_string().contains("a witness needs `targets`"), "{e}");
    let cfg: Config = crate::probe::parse(
        "targets:\n  - {name: gw, address: 127.0.0.1, port: 9, probe: tcp, timeout: 100ms}\n",
    )
    .unwrap();
    let e = Witness::new(cfg.clone(), opts(5, 10), None).err().unwrap();
    assert!(e.to_string().contains("--probe-interval"), "{e}");
    let e = Witness::new(cfg, opts(1000, 20_000), None).err().unwrap();
    assert!(e.to_string().contains("--burst-interval"), "{e}");
}

async fn call(
    w: &Arc<Witness>,
    method: &str,
    uri: &str,
    body: &str,
    auth: Option<&str>,
) -> (u16, serde_json::Value) {
    let mut req = axum::http::Request::builder().method(method).uri(uri);
    if let Some(a) = auth {
        req = req.header("authorization", format!("Bearer {a}"));
    }
    let resp = router(w.clone())
        .oneshot(req.body(Body::from(body.to_string())).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
    )
}

#[tokio::test]
async fn steps_begin_once_report_gaps_and_end() {
    let w = witness(Some("s3cret"));
    assert_eq!(
        call(&w, "POST", "/v1/steps", r#"{"id":"a"}"#, None).await.0,
        401
    );
    let (s, b) = call(
        &w,
        "POST",
        "/v1/steps",
        r#"{"id":"a","burst_interval":"5ms"}"#,
        Some("s3cret"),
    )
    .await;
    assert_eq!(s, 201, "{b}");
    assert_eq!(b["instance"], w.instance.as_str());
    let (s2, b2) = call(
        &w,
        "POST",
        "/v1/steps",
        r#"{"id":"a","burst_interval":"5ms"}"#,
        Some("s3cret"),
    )
    .await;
    assert_eq!(
        (s2, &b2["created_at"]),
        (201, &b["created_at"]),
        "idempotent"
    );
    // The same id with other parameters (a step planted with a 1 h budget): 409.
    let (s3, b3) = call(
        &w,
        "POST",
        "/v1/steps",
        r#"{"id":"a","max_gap":"3600000ms","timeout":"1h"}"#,
        Some("s3cret"),
    )
    .await;
    assert_eq!(s3, 409, "{b3}");
    // Step data needs the token too.
    assert_eq!(call(&w, "GET", "/v1/steps/a", "", None).await.0, 401);
    assert_eq!(w.interval(), Duration::from_millis(5), "bursting");
    // Samples: ok, two failures, ok: one outage.
    let t0 = b["created_at"].as_f64().unwrap();
    let tgt = w.cfg.targets[0].clone();
    for (dt, ok) in [(0.01, true), (0.02, false), (0.03, false), (0.04, true)] {
        w.record(
            &tgt,
            &ProbeOutcome {
                ok,
                sent_at: t0 + dt,
                latency: Duration::from_millis(1),
                detail: String::new(),
                ran: true,
                answers: None,
            },
        );
    }
    let r = w.report("a", Some(t0), None).unwrap();
    assert_eq!(r.probes["gw"].sent, 4);
    // The probe series carry the agent's labels (no `vantage` on the witness: the scrape
    // target says it).
    let text = w.encode_metrics();
    assert!(
        text.contains(r#"stepguard_probe_failures_total{kind="tcp",target="gw"} 2"#),
        "{text}"
    );
    assert!(
        text.contains(r#"stepguard_probe_duration_seconds_count{kind="tcp",target="gw"} 4"#),
        "{text}"
    );
    assert!(!text.contains("vantage"), "{text}");
    let (s, v) = call(&w, "GET", "/v1/steps/a?after=x", "", Some("s3cret")).await;
    assert_eq!(s, 400, "{v}");
    assert_eq!(
        call(&w, "GET", "/v1/steps/nope", "", Some("s3cret"))
            .await
            .0,
        404
    );
    assert_eq!(
        call(&w, "DELETE", "/v1/steps/a", "", Some("s3cret"))
            .await
            .0,
        200
    );
    assert_eq!(w.interval(), Duration::from_secs(1), "steady again");
    let r = w.report("a", None, None).unwrap();
    assert!(r.ended);
    assert_eq!(r.gaps[0].count, 1, "{:?}", r.gaps);
    assert!((r.gaps[0].longest_s - 0.02).abs() < 1e-6, "{:?}", r.gaps);
    // An agent whose own step began after that outage (the witness's step was begun
    // earlier under the same id) gets the gaps of its own window only.
    let r = w.report("a", None, Some(t0 + 2.5)).unwrap();
    assert_eq!(r.gaps[0].count, 0, "{:?}", r.gaps);
    // A `from` within the clocks' slack of the witness's own start clips nothing.
    let r = w.report("a", None, Some(t0 + 1.0)).unwrap();
    assert_eq!(r.gaps[0].count, 1, "{:?}", r.gaps);
    // (t0 came through JSON: compared to the millisecond.)
    assert!(
        (r.created_at - t0).abs() < 1e-3,
        "the witness's own start is reported: {} vs {t0}",
        r.created_at
    );
    let (s, v) = call(&w, "GET", "/v1/steps/a?from=x", "", Some("s3cret")).await;
    assert_eq!(s, 400, "{v}");
    let (s, v) = call(
        &w,
        "POST",
        "/v1/steps",
        r#"{"id":"b","max_gap":"soon"}"#,
        Some("s3cret"),
    )
    .await;
    assert_eq!(s, 400);
    assert!(v["error"].as_str().unwrap().starts_with("max_gap:"), "{v}");
    let (s, _) = call(
        &w,
        "POST",
        "/v1/steps",
        r#"{"id":"b","extra":1}"#,
        Some("s3cret"),
    )
    .await;
    assert_eq!(s, 400, "unknown fields are refused");
    // The agent's id rule: nothing that could name a hidden file.
    for id in [".hidden", "a/b", ""] {
        let body = format!(r#"{{"id":"{id}"}}"#);
        let (s, v) = call(&w, "POST", "/v1/steps", &body, Some("s3cret")).await;
        assert_eq!(s, 400, "{id:?}: {v}");
        assert!(v["error"].as_str().unwrap().starts_with("id: 1-64"), "{v}");
    }
}

#[test]
fn steps_stay_bounded() {
    let w = witness(None);
    for i in 0..(MAX_STEPS + 5) {
        w.begin(&WitnessStepRequest {
            id: format!("s{i}"),
            ..Default::default()
        })
        .unwrap();
    }
    assert_eq!(lock(&w.steps).len(), MAX_STEPS);
}
