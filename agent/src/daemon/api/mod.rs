//! The HTTP API (axum): `/metrics`, `/livez`, `/readyz`, `/v1/verdict`, `/v1/checks`,
//! `/v1/steps[/{id}]`. Malformed input gets a 4xx with one line; bodies are size-limited;
//! mutating routes need the bearer token when one is configured.

use super::runner::Command;
use super::{Daemon, Posted};
use crate::checks::{exit_code, CheckResult};
use crate::duration;
use crate::node::{self, NodeOptions};
use crate::report;
use crate::serving::error as err;
use crate::step::admission::valid_id;
use crate::step::view::StepView;
use crate::step::{Step, StepRequest};
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde_json::{json, Value};
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

const MAX_WAIT: Duration = Duration::from_secs(900);

pub fn router(d: Arc<Daemon>) -> Router {
    crate::serving::api(
        Router::new()
            .route("/v1/verdict", get(verdict))
            .route("/v1/checks", get(checks))
            .route("/v1/steps", get(list_steps).post(post_step))
            .route("/v1/steps/{id}", get(get_step).delete(delete_step))
            .route("/v1/proof", get(proof)),
        d,
        "no such route; see /v1/verdict, /v1/checks, /v1/steps, /v1/proof, /metrics",
    )
}

fn wants_text(headers: &HeaderMap, q: &HashMap<String, String>) -> bool {
    if let Some(f) = q.get("format") {
        return f == "text";
    }
    headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("text/plain") && !a.contains("json"))
}

fn authorized(d: &Daemon, headers: &HeaderMap) -> Result<(), Box<Response>> {
    let ok = d.opts.token.ok(headers);
    if ok {
        Ok(())
    } else {
        Err(Box::new(err(
            StatusCode::UNAUTHORIZED,
            "missing or wrong bearer token (Authorization: Bearer <token>)",
        )))
    }
}

/// The agent's `/metrics` and `/readyz`, served by the shared admin routes.
impl crate::serving::Admin for Daemon {
    fn metrics(&self) -> String {
        let m = &self.metrics;
        m.set_drops(
            self.kernel_drops_now().as_ref(),
            self.cilium_drops_now().as_ref(),
        );
        for r in self.probe_results() {
            m.checks.record(&r);
        }
        m.encode()
    }

    fn ready(&self) -> Result<String, String> {
        if let Some(why) = self.store.write_problem() {
            // Verdicts are served from memory but would not survive a restart.
            return Err(format!(
                "not ready: the state dir cannot be written ({why})\n"
            ));
        }
        if self.ready.is_ready() {
            Ok("ready\n".into())
        } else {
            Err("not ready\n".into())
        }
    }
}

fn last_step(d: &Daemon) -> Option<Step> {
    d.current_step()
        .map(|s| (*s).clone())
        .or_else(|| d.store.list().into_iter().next())
}

fn step_json(s: &Step) -> Value {
    serde_json::to_value(StepView::of(s)).unwrap_or(Value::Null)
}

/// The step for people: the one rendering of [`StepView::text`].
pub fn gaps_text(s: &Step) -> String {
    StepView::of(s).text()
}

async fn verdict(
    State(d): State<Arc<Daemon>>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let results = d.node_results();
    let code = if exit_code(&results) == crate::exit::ExitCode::Ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let step = last_step(&d);
    if wants_text(&headers, &q) {
        let mut body = report::text(&results);
        body.push('\n');
        match &step {
            Some(s) => body.push_str(&gaps_text(s)),
            None => body.push_str("no step yet\n"),
        }
        return (
            code,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            body,
        )
            .into_response();
    }
    let mut v = report::json(&results);
    v["last_step"] = step.as_ref().map(step_json).unwrap_or(Value::Null);
    (code, axum::Json(v)).into_response()
}

async fn checks(
    State(d): State<Arc<Daemon>>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let results = on_demand_checks(&d).await;
    if wants_text(&headers, &q) {
        return (
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            report::text(&results),
        )
            .into_response();
    }
    axum::Json(report::json(&results)).into_response()
}

/// How long an on-demand run of every check is reused.
const ON_DEMAND_REUSE: Duration = Duration::from_secs(2);

/// `GET /v1/checks` runs every check, probes included: one run at a time, reused for
/// [`ON_DEMAND_REUSE`], so clients cannot multiply the probes (which would load the resolvers
/// and skew what a step compares against).
async fn on_demand_checks(d: &Daemon) -> Vec<CheckResult> {
    let mut cached = d.on_demand.lock().await;
    if let Some((at, results)) = cached.as_ref() {
        if at.elapsed() < ON_DEMAND_REUSE {
            return results.clone();
        }
    }
    let opts = NodeOptions {
        state_dir: Some(d.opts.state_dir.clone()),
        count_all: true,
        // A person asking gets fresh dumps.
        topology: None,
    };
    let (results, _): (Vec<CheckResult>, _) = node::run(&d.cfg, &opts, &BTreeSet::new()).await;
    *cached = Some((std::time::Instant::now(), results.clone()));
    results
}

/// `GET /v1/proof?started_at=UNIX_SECONDS`: which step covers the cilium-agent container
/// started then (`step::proof`), for the stepper's proof that a node is done.
async fn proof(State(d): State<Arc<Daemon>>, Query(q): Query<HashMap<String, String>>) -> Response {
    let Some(raw) = q.get("started_at") else {
        return err(
            StatusCode::BAD_REQUEST,
            "started_at is required: the cilium-agent container's start, unix seconds",
        );
    };
    let started_at = match raw.parse::<f64>() {
        Ok(t) if t.is_finite() && t > 0.0 => t,
        _ => {
            return err(
                StatusCode::BAD_REQUEST,
                format!("started_at {raw:?} is not a time in unix seconds"),
            )
        }
    };
    // Judged over the steps in place (a node's store holds up to a hundred): the active one
    // as the runner holds it now, the others as stored.
    let active = d.current_step();
    let stored = d.store.mem();
    let steps = stored
        .values()
        .filter(|s| active.as_ref().is_none_or(|a| a.id != s.id))
        .chain(active.as_deref());
    let proof = crate::step::proof::covering(steps, started_at);
    drop(stored);
    axum::Json(proof).into_response()
}

async fn list_steps(State(d): State<Arc<Daemon>>) -> Response {
    let steps: Vec<Value> = d.store.list().iter().take(20).map(|s| json!({"id": s.id, "origin": s.origin, "created_at": s.created_at, "phase": s.phase, "verdict": s.verdict.as_ref().map(|v| v.status)})).collect();
    axum::Json(json!({"steps": steps})).into_response()
}

async fn post_step(
    State(d): State<Arc<Daemon>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    // The token is checked before the body is read, and the body must arrive in time: a
    // client without the token cannot hold a connection by trickling a body.
    if let Err(r) = authorized(&d, &headers) {
        return *r;
    }
    let req: StepRequest = match crate::serving::read_json(body, "step request").await {
        Ok(r) => r,
        Err(r) => return r,
    };
    posted(d.post_step(req).await)
}

/// The answer to a posted step: 201 with it begun; the active one again when re-posted the
/// same way (200, idempotent); 409 naming what is in the way; 400 for a request that is not a
/// step; 503 when it cannot begin now.
fn posted(p: Posted) -> Response {
    match p {
        Posted::Same(active) => (StatusCode::OK, axum::Json(step_json(&active))).into_response(),
        Posted::OtherParams { active, field } => (
            StatusCode::CONFLICT,
            axum::Json(json!({
                "error": format!("step {active} is active with another {field}; wait for it, DELETE it, or re-POST the same parameters"),
                "active_id": active,
                "field": field,
            })),
        )
            .into_response(),
        Posted::Busy(active) => conflict(&active),
        Posted::Finished(done) => {
            let status = done
                .verdict
                .as_ref()
                .map(|v| v.status.as_str())
                .unwrap_or("?");
            (
                StatusCode::CONFLICT,
                axum::Json(json!({
                    "error": format!("step {} already finished ({status}); begin a new step with a new id", done.id),
                    "verdict": done.verdict,
                })),
            )
                .into_response()
        }
        Posted::Created(s) => (StatusCode::CREATED, axum::Json(step_json(&s))).into_response(),
        Posted::Invalid(why) => err(StatusCode::BAD_REQUEST, why),
        Posted::Unavailable(why) => err(StatusCode::SERVICE_UNAVAILABLE, why),
        Posted::NotBegun => err(StatusCode::INTERNAL_SERVER_ERROR, "the step was not begun"),
    }
}

fn conflict(active: &str) -> Response {
    (
        StatusCode::CONFLICT,
        axum::Json(json!({"error": format!("step {active} is active; wait for it or DELETE it"), "active_id": active})),
    )
        .into_response()
}

fn find(d: &Daemon, id: &str) -> Option<Step> {
    d.current_step()
        .filter(|s| s.id == id)
        .map(|s| (*s).clone())
        .or_else(|| d.store.load(id))
}

async fn get_step(
    State(d): State<Arc<Daemon>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if !valid_id(&id) {
        return err(StatusCode::BAD_REQUEST, format!("invalid step id {id:?}"));
    }
    let wait = match q.get("wait").map(|w| duration::parse(w)) {
        None => Duration::ZERO,
        Some(Ok(w)) if w <= MAX_WAIT => w,
        Some(Ok(_)) => {
            return err(
                StatusCode::BAD_REQUEST,
                format!("wait: at most {}", duration::human(MAX_WAIT)),
            )
        }
        Some(Err(e)) => return err(StatusCode::BAD_REQUEST, format!("wait: {e}")),
    };
    // Long-polls are bounded: beyond the limit, or while shutting down, the answer comes at
    // once (202 with the phase), and the stepper polls again.
    let mut shutdown = d.shutting_down.subscribe();
    let _permit = match d.long_polls.clone().try_acquire_owned() {
        Ok(p) if !*shutdown.borrow() => Some(p),
        _ => None,
    };
    let wait = if _permit.is_some() {
        wait
    } else {
        Duration::ZERO
    };
    let deadline = tokio::time::Instant::now() + wait;
    let mut rx = d.changed.subscribe();
    let mut stop = false;
    loop {
        let Some(s) = find(&d, &id) else {
            return err(StatusCode::NOT_FOUND, format!("no step {id}"));
        };
        let done = s.is_final();
        if done || stop || tokio::time::Instant::now() >= deadline {
            let code = if done {
                StatusCode::OK
            } else {
                StatusCode::ACCEPTED
            };
            let mut r = if wants_text(&headers, &q) {
                (
                    code,
                    [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
                    gaps_text(&s),
                )
                    .into_response()
            } else {
                (code, axum::Json(step_json(&s))).into_response()
            };
            // Answered at once because every long-poll slot is held (or shutting down):
            // waiters come back in a second, not at once.
            if !done && _permit.is_none() {
                r.headers_mut()
                    .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
            }
            return r;
        }
        tokio::select! {
            _ = tokio::time::sleep_until(deadline) => {}
            r = rx.changed() => { if r.is_err() { tokio::time::sleep_until(deadline).await; } }
            _ = shutdown.changed() => stop = true,
        }
    }
}

async fn delete_step(
    State(d): State<Arc<Daemon>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Err(r) = authorized(&d, &headers) {
        return *r;
    }
    if !valid_id(&id) {
        return err(StatusCode::BAD_REQUEST, format!("invalid step id {id:?}"));
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    if d.ports
        .commands
        .send(Command::Cancel {
            id: id.clone(),
            reply: tx,
        })
        .await
        .is_err()
    {
        return err(
            StatusCode::SERVICE_UNAVAILABLE,
            "the step runner is not running",
        );
    }
    if let Ok(Some(s)) = rx.await {
        return axum::Json(step_json(&s)).into_response();
    }
    match d.store.load(&id) {
        Some(s) => axum::Json(step_json(&s)).into_response(),
        None => err(StatusCode::NOT_FOUND, format!("no step {id}")),
    }
}

#[cfg(test)]
mod tests;
