//! The witness's HTTP API: steps (begin, report, end; bearer token), status, moves, metrics.
use super::*;

pub(super) use crate::serving::error as err;

pub fn router(w: Arc<Witness>) -> Router {
    crate::serving::api(
        Router::new()
            .route("/v1/status", get(status))
            .route("/v1/moves", get(moves))
            .route("/v1/steps", axum::routing::post(post_step))
            .route("/v1/steps/{id}", get(get_step).delete(delete_step)),
        w,
        "no such route; see /v1/status, /v1/steps, /metrics",
    )
}

/// The witness's `/metrics` and `/readyz` (always ready once serving), by the shared admin
/// routes.
impl crate::serving::Admin for Witness {
    fn metrics(&self) -> String {
        self.encode_metrics()
    }

    fn ready(&self) -> Result<String, String> {
        Ok("ok\n".into())
    }
}

pub(super) async fn moves(State(w): State<Arc<Witness>>) -> Response {
    axum::Json(json!({"moves": w.moves()})).into_response()
}

pub(super) async fn status(State(w): State<Arc<Witness>>, headers: HeaderMap) -> Response {
    let now = clock::now();
    let macs: BTreeMap<String, Option<String>> = match &w.neigh {
        Some(n) => w
            .cfg
            .targets
            .iter()
            .map(|t| {
                (
                    t.name.clone(),
                    n.since(t.address, now).last().and_then(|c| c.1.clone()),
                )
            })
            .collect(),
        None => BTreeMap::new(),
    };
    axum::Json(json!({
        "role": "witness",
        "instance": w.instance,
        "started_at": w.started_at,
        "targets": w.cfg.targets.iter().map(|t| &t.name).collect::<Vec<_>>(),
        "latest": w.host.recorder.latest(),
        "macs": macs,
        "neighbour_table": if w.neigh.is_some() { "followed" } else { "unavailable: reports carry no MAC addresses" },
        // Step ids only to those who may read steps.
        "steps": if w.opts.token.ok(&headers) {
            json!(lock(&w.steps).keys().cloned().collect::<Vec<_>>())
        } else {
            json!("needs the token")
        },
    }))
    .into_response()
}

/// 401 unless the request carries the witness's token (checked from the headers, before any
/// body is read).
pub(super) fn unauthorized(w: &Witness, headers: &HeaderMap) -> Option<Response> {
    (!w.opts.token.ok(headers)).then(|| {
        err(
            StatusCode::UNAUTHORIZED,
            "this witness needs `Authorization: Bearer <token>`",
        )
    })
}

pub(super) async fn post_step(
    State(w): State<Arc<Witness>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    if let Some(r) = unauthorized(&w, &headers) {
        return r;
    }
    let r: WitnessStepRequest = match crate::serving::read_json(body, "witness step request").await
    {
        Ok(r) => r,
        Err(r) => return r,
    };
    match w.begin(&r) {
        Ok(b) => (StatusCode::CREATED, axum::Json(b)).into_response(),
        Err(BeginRefused::Invalid(e)) => err(StatusCode::BAD_REQUEST, e),
        Err(BeginRefused::Conflict(e)) => err(StatusCode::CONFLICT, e),
    }
}

pub(super) async fn get_step(
    State(w): State<Arc<Witness>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if let Some(r) = unauthorized(&w, &headers) {
        return r;
    }
    let after = match q.get("after").map(|a| a.parse::<f64>()) {
        None => None,
        Some(Ok(a)) if a.is_finite() => Some(a),
        Some(_) => return err(StatusCode::BAD_REQUEST, "after: a unix time in seconds"),
    };
    let from = match q.get("from").map(|a| a.parse::<f64>()) {
        None => None,
        Some(Ok(a)) if a.is_finite() => Some(a),
        Some(_) => return err(StatusCode::BAD_REQUEST, "from: a unix time in seconds"),
    };
    match w.report(&id, after, from) {
        Some(r) => axum::Json(r).into_response(),
        None => err(
            StatusCode::NOT_FOUND,
            format!("this witness (instance {}) has no step {id:?}", w.instance),
        ),
    }
}

pub(super) async fn delete_step(
    State(w): State<Arc<Witness>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Some(r) = unauthorized(&w, &headers) {
        return r;
    }
    if w.end(&id) {
        axum::Json(json!({"id": id, "ended": true})).into_response()
    } else {
        err(StatusCode::NOT_FOUND, format!("no step {id:?}"))
    }
}
