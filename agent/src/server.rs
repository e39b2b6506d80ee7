//! The agent's HTTP server (axum): `/metrics`, `/livez`, `/readyz`. Readiness is the agent's
//! own (serving and its signals set up), never the node verdict.
use crate::kernel::drops::KernelDrops;
use crate::metrics::Metrics;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

pub struct AppState {
    pub ready: AtomicBool,
    pub metrics: Mutex<Metrics>,
    pub drops: Mutex<KernelDrops>,
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/livez", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(state)
}

async fn metrics(State(s): State<Arc<AppState>>) -> impl IntoResponse {
    let body = {
        let drops = s.drops.lock().unwrap_or_else(|e| e.into_inner());
        let mut m = s.metrics.lock().unwrap_or_else(|e| e.into_inner());
        m.refresh_kernel_drops(&drops);
        m.encode()
    };
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        body,
    )
}

async fn readyz(State(s): State<Arc<AppState>>) -> impl IntoResponse {
    if s.ready.load(Ordering::SeqCst) {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}
