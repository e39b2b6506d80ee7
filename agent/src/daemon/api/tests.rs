use super::*;
use crate::config::Config;
use crate::daemon::runner::Begun;
use crate::daemon::DaemonOptions;
use crate::kernel::clock;
use crate::step::StepParams;
use axum::body::Body;
use axum::http::Request;
use std::sync::atomic::Ordering;
use tower::ServiceExt;

fn daemon(token: Option<&str>) -> Arc<Daemon> {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "sg-api-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("bpffs")).unwrap();
    let cfg = Config::parse(&format!("bpffs: {}\n", dir.join("bpffs").display())).unwrap();
    Daemon::new(
        cfg,
        DaemonOptions {
            state_dir: dir.join("state"),
            probe_interval: Duration::from_secs(1),
            slow_interval: Duration::from_secs(10),
            burst_interval: Duration::from_millis(10),
            token: crate::serving::Token::fixed(token.map(str::to_string)),
            drop_accounting: false,
            max_long_polls: 4,
        },
    )
    .unwrap()
    .with_runner()
}

trait WithRunner {
    fn with_runner(self) -> Self;
}
impl WithRunner for Arc<Daemon> {
    fn with_runner(self) -> Self {
        tokio::spawn(crate::daemon::runner::run(self.clone()));
        self
    }
}

async fn call(
    d: &Arc<Daemon>,
    method: &str,
    uri: &str,
    body: &str,
    token: Option<&str>,
) -> (StatusCode, Value) {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let resp = router(d.clone())
        .oneshot(req.body(Body::from(body.to_string())).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .unwrap();
    let v = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
    (status, v)
}

/// Hands the runner a step (as POST does after taking a baseline); returns its answer.
async fn send_begin(d: &Arc<Daemon>, id: &str) -> Begun {
    let (_, params) =
        StepParams::from_request(&StepRequest::default(), Duration::from_millis(10), &[]).unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel();
    d.ports
        .commands
        .send(Command::Begin {
            step: Box::new(Step::new(
                id.into(),
                clock::now(),
                params,
                Default::default(),
                Default::default(),
            )),
            reply: tx,
        })
        .await
        .unwrap();
    rx.await.unwrap()
}

/// Installs a step through the runner.
async fn active(d: &Arc<Daemon>, id: &str) {
    assert!(matches!(send_begin(d, id).await, Begun::Created(_)));
}

#[tokio::test]
async fn every_documented_status_code() {
    let d = daemon(None);
    assert_eq!(call(&d, "GET", "/livez", "", None).await.0, StatusCode::OK);
    assert_eq!(
        call(&d, "GET", "/readyz", "", None).await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    d.readiness().set(true);
    assert_eq!(call(&d, "GET", "/readyz", "", None).await.0, StatusCode::OK);
    let (s, v) = call(&d, "GET", "/no/such/route", "", None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert!(v["error"].is_string());
    // Nothing checked yet: the node verdict is not a pass.
    let (s, v) = call(&d, "GET", "/v1/verdict", "", None).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert!(v["checks"].is_array());
    let (s, v) = call(&d, "GET", "/metrics", "", None).await;
    assert_eq!(s, StatusCode::OK);
    assert!(v.as_str().unwrap().ends_with("# EOF\n"));

    // Malformed requests: 400 with one line naming the problem; oversized: 413.
    for (body, needle) in [
        ("{not json", "invalid step request"),
        (r#"{"frobnicate": 1}"#, "unknown field `frobnicate`"),
        (r#"{"timeout": "soon"}"#, "timeout"),
        (r#"{"id": "../x"}"#, "id"),
        (r#"{"id": "b1"} xx"#, "more after the JSON body"),
        (r#"{"settle": "0s"}"#, "settle: 0s is out of range (100ms"),
    ] {
        let (s, v) = call(&d, "POST", "/v1/steps", body, None).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body}: {v}");
        let e = v["error"].as_str().unwrap();
        assert!(e.contains(needle) && e.lines().count() == 1, "{body}: {e}");
    }
    let big = format!("{{\"id\": \"{}\"}}", "x".repeat(20_000));
    assert_eq!(
        call(&d, "POST", "/v1/steps", &big, None).await.0,
        StatusCode::PAYLOAD_TOO_LARGE
    );
    // No Cilium datapath here: no baseline can be taken, 503 naming why.
    let (s, v) = call(&d, "POST", "/v1/steps", "{}", None).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert!(v["error"]
        .as_str()
        .unwrap()
        .contains("cannot take a baseline"));

    // With a step active: its id is idempotent (200), another id conflicts (409).
    active(&d, "one").await;
    let (s, v) = call(&d, "POST", "/v1/steps", r#"{"id":"one"}"#, None).await;
    assert_eq!((s, v["id"].as_str()), (StatusCode::OK, Some("one")));
    let (s, v) = call(&d, "POST", "/v1/steps", r#"{"id":"two"}"#, None).await;
    assert_eq!(
        (s, v["active_id"].as_str()),
        (StatusCode::CONFLICT, Some("one"))
    );
    let (s, v) = call(&d, "GET", "/v1/steps/one", "", None).await;
    assert_eq!(
        (s, v["phase"].as_str()),
        (StatusCode::ACCEPTED, Some("watching"))
    );
    for bad in ["/v1/steps/one?wait=forever", "/v1/steps/one?wait=1000h"] {
        assert_eq!(
            call(&d, "GET", bad, "", None).await.0,
            StatusCode::BAD_REQUEST
        );
    }
    assert_eq!(
        call(&d, "GET", "/v1/steps/nope", "", None).await.0,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        call(&d, "DELETE", "/v1/steps/nope", "", None).await.0,
        StatusCode::NOT_FOUND
    );
    let (s, v) = call(&d, "DELETE", "/v1/steps/one", "", None).await;
    assert_eq!(
        (s, v["verdict"]["status"].as_str()),
        (StatusCode::OK, Some("cancelled"))
    );
    let (s, v) = call(&d, "GET", "/v1/steps/one?wait=5s", "", None).await;
    assert_eq!(
        (s, v["verdict"]["status"].as_str()),
        (StatusCode::OK, Some("cancelled"))
    );
    let (s, v) = call(&d, "GET", "/v1/steps", "", None).await;
    assert_eq!(
        (s, v["steps"][0]["id"].as_str()),
        (StatusCode::OK, Some("one"))
    );
    // A finished id is 409 naming its verdict (before: 200 with the old verdict, so a
    // later `wait` answered PASSED for a restart it never watched).
    let (s, v) = call(&d, "POST", "/v1/steps", r#"{"id":"one"}"#, None).await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert!(v["error"]
        .as_str()
        .unwrap()
        .contains("already finished (cancelled)"));
    assert_eq!(v["verdict"]["status"], "cancelled");
}

/// A state directory that cannot be written (read-only, full, or not a directory): the
/// step is refused, never answered 201 and then lost on the next agent restart.
#[tokio::test]
async fn a_step_whose_first_save_fails_is_refused() {
    let d = daemon(None);
    let steps = d.opts.state_dir.join("steps");
    std::fs::remove_dir_all(&steps).unwrap();
    std::fs::write(&steps, b"not a directory").unwrap();
    match send_begin(&d, "lost").await {
        Begun::NotSaved(e) => assert!(!e.is_empty()),
        _ => panic!("a step that cannot be saved was taken"),
    }
    assert!(d.current_step().is_none(), "nothing became active");
    assert_eq!(
        call(&d, "GET", "/v1/steps/lost", "", None).await.0,
        StatusCode::NOT_FOUND
    );
}

/// Re-POSTing the active id with other parameters is 409 naming the field (before, the
/// old parameters were kept silently).
#[tokio::test]
async fn a_re_post_with_other_parameters_names_the_differing_field() {
    let d = daemon(None);
    active(&d, "one").await;
    let (s, v) = call(
        &d,
        "POST",
        "/v1/steps",
        r#"{"id":"one","settle":"3s"}"#,
        None,
    )
    .await;
    assert_eq!(
        (s, v["field"].as_str()),
        (StatusCode::CONFLICT, Some("settle")),
        "{v}"
    );
    // The same parameters (all defaults) are idempotent.
    assert_eq!(
        call(&d, "POST", "/v1/steps", r#"{"id":"one"}"#, None)
            .await
            .0,
        StatusCode::OK
    );
    // A cadence that cannot resolve the budget: 400 naming burst_interval.
    let (s, v) = call(
        &d,
        "POST",
        "/v1/steps",
        r#"{"id":"two","burst_interval":"10s","max_gap":"1s"}"#,
        None,
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(
        v["error"].as_str().unwrap().contains("burst_interval"),
        "{v}"
    );
}

#[tokio::test]
async fn mutating_routes_need_the_token_when_one_is_configured() {
    let d = daemon(Some("s3cret"));
    assert_eq!(
        call(&d, "POST", "/v1/steps", "{}", None).await.0,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        call(&d, "POST", "/v1/steps", "{}", Some("wrong")).await.0,
        StatusCode::UNAUTHORIZED
    );
    active(&d, "tok").await;
    assert_eq!(
        call(&d, "DELETE", "/v1/steps/tok", "", None).await.0,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        call(&d, "GET", "/v1/steps/tok", "", None).await.0,
        StatusCode::ACCEPTED,
        "reads need no token"
    );
    assert_eq!(
        call(&d, "DELETE", "/v1/steps/tok", "", Some("s3cret"))
            .await
            .0,
        StatusCode::OK
    );
}
