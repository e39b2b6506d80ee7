//! The HTTP serving layer the agent and the witness share, so that no client can take either
//! down or hold it up: bounded connections, authentication from the headers (before any body
//! is read) with a token file that is read again when it changes, bodies read under a size
//! limit and a deadline, response writes under a deadline, and pipelined requests bounded.
//!
//! Connections:
//! A new connection first waits, without a slot, until its request starts to arrive (at most
//! the header timeout); only then does it take one of `max_connections` slots. Connections
//! waiting so are bounded too, and when they are all taken the oldest waiter is closed: idle
//! connections (a flood, half-open sockets) can never hold the slots that serve requests, and
//! a client that sends its request at once (`/readyz`, `/metrics`) is served under a flood.
//! When every slot is held, a newcomer whose request has arrived takes the slot of a stalled
//! writer, else of the oldest connection not answering a request (idle keep-alive, headers
//! arriving a byte at a time); one source holds at most `per_source` slots.
//! Request headers have a read timeout; a response the client does not read within
//! `write_timeout` closes the connection (a slow reader with a tiny receive buffer holds no
//! slot); one connection serves at most `max_requests` requests (pipelined or not), then
//! closes; shutdown finishes within the pod's grace period.
mod connections;
mod requests;
mod token;

pub use connections::{serve, Limits};
pub use requests::{read_body, read_json, BODY_LIMIT, BODY_TIMEOUT};
pub use token::{bearer_ok, Token};

use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, Semaphore};

/// What the shared admin routes serve for a process (the agent, the witness): its metrics
/// and its readiness. The serving layer knows nothing else of either.
pub trait Admin: Send + Sync + 'static {
    /// The metrics, in OpenMetrics text.
    fn metrics(&self) -> String;
    /// Ready (the body to answer with), or why not (answered 503).
    fn ready(&self) -> Result<String, String>;
}

/// Whether a process is ready for traffic: set once it serves, cleared first when it shuts
/// down (so nothing new is sent its way before it closes). Clones share one flag.
#[derive(Clone, Debug, Default)]
pub struct Readiness(Arc<std::sync::atomic::AtomicBool>);

impl Readiness {
    pub fn set(&self, ready: bool) {
        self.0.store(ready, std::sync::atomic::Ordering::SeqCst);
    }
    pub fn is_ready(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// How long an encoded `/metrics` answer is served again: each encoding walks every series,
/// and hundreds of clients pipelining `/metrics` would otherwise starve the process; a scrape
/// (every 15 s or so) sees values at most this old.
pub const METRICS_REUSE: Duration = Duration::from_millis(100);

/// An encoded `/metrics` answer and when it was encoded.
type Encoded = (std::time::Instant, Arc<str>);

/// A JSON error answer, `{"error": msg}`, with `status` (the agent's and the witness's API).
pub fn error(status: StatusCode, msg: impl Into<String>) -> axum::response::Response {
    use axum::response::IntoResponse;
    (status, axum::Json(serde_json::json!({"error": msg.into()}))).into_response()
}

/// A process's API: its `routes`, an unknown route answered 404 with `routes_help` (where to
/// look instead), request bodies capped at [`BODY_LIMIT`], and the [`admin`] routes.
pub fn api<S: Admin>(routes: Router<Arc<S>>, state: Arc<S>, routes_help: &'static str) -> Router {
    routes
        .fallback(move || async move { error(StatusCode::NOT_FOUND, routes_help) })
        .layer(axum::extract::DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(state.clone())
        .merge(admin(state))
}

/// `/metrics`, `/livez` and `/readyz` for `state`, to merge into a process's own router.
pub fn admin<S: Admin>(state: Arc<S>) -> Router {
    use axum::extract::State;
    use axum::response::IntoResponse;
    use axum::routing::get;
    // One encoding at a time, its answer reused for a moment (coalesced, as `/v1/checks`).
    let last: Arc<tokio::sync::Mutex<Option<Encoded>>> = Default::default();
    Router::new()
        .route(
            "/metrics",
            get(move |State(s): State<Arc<S>>| async move {
                let body = {
                    let mut last = last.lock().await;
                    match last.as_ref() {
                        Some((at, body)) if at.elapsed() < METRICS_REUSE => body.clone(),
                        _ => {
                            let body: Arc<str> = s.metrics().into();
                            *last = Some((std::time::Instant::now(), body.clone()));
                            body
                        }
                    }
                };
                (
                    [(
                        header::CONTENT_TYPE,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    body.to_string(),
                )
                    .into_response()
            }),
        )
        .route("/livez", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(|State(s): State<Arc<S>>| async move {
                match s.ready() {
                    Ok(body) => (StatusCode::OK, body).into_response(),
                    Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why).into_response(),
                }
            }),
        )
        .with_state(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rotated_token_file_takes_effect() {
        let dir = std::env::temp_dir().join(format!("sg-token-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("token");
        std::fs::write(&f, "first-token-0123456789\n").unwrap();
        let t = Token::from_file(Some(&f)).unwrap();
        let with = |tok: &str| {
            let mut h = HeaderMap::new();
            h.insert(
                header::AUTHORIZATION,
                HeaderValue::from_str(&format!("Bearer {tok}")).unwrap(),
            );
            h
        };
        assert!(t.ok(&with("first-token-0123456789")));
        // Kubernetes swaps the file: a new inode with the new token.
        let tmp = dir.join("token.new");
        std::fs::write(&tmp, "second-token-0123456789").unwrap();
        std::fs::rename(&tmp, &f).unwrap();
        t.inner.lock().unwrap().checked_at = None;
        assert!(t.ok(&with("second-token-0123456789")));
        assert!(!t.ok(&with("first-token-0123456789")));
        // A broken rotation keeps the last good token.
        std::fs::write(&tmp, "short").unwrap();
        std::fs::rename(&tmp, &f).unwrap();
        t.inner.lock().unwrap().checked_at = None;
        assert!(t.ok(&with("second-token-0123456789")));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
