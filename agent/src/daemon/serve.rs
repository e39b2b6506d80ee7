//! Serving the API with bounds, so that no client can take the agent down or hold it up:
//! a connection limit (with a small reserve that only clients sending their request at once
//! can use, so `/readyz` and `/metrics` keep answering under a flood of idle connections), a
//! request-header read timeout, and a shutdown that finishes within the pod's grace period.
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// The API's limits (flags of `stepguard agent`).
#[derive(Clone, Debug)]
pub struct Limits {
    /// Connections served at once (beyond them, only the reserve).
    pub max_connections: usize,
    /// Connections beyond the limit that are served only if their request arrives at once.
    pub reserve: usize,
    /// Time a client has to send its request headers (also between keep-alive requests).
    pub header_timeout: Duration,
    /// ... on a reserve connection.
    pub reserve_header_timeout: Duration,
    /// After SIGTERM, how long open connections get before the agent exits anyway.
    pub shutdown_grace: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 256,
            reserve: 32,
            header_timeout: Duration::from_secs(5),
            reserve_header_timeout: Duration::from_millis(500),
            shutdown_grace: Duration::from_secs(5),
        }
    }
}

/// Serves `router` on `listener` until `shutdown` completes, then closes within the grace.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) {
    let main = Arc::new(Semaphore::new(limits.max_connections));
    let reserve = Arc::new(Semaphore::new(limits.reserve));
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (sock, _) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning; nothing is lost.
                    tracing::warn!(error = %e, "cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let (permit, header_timeout) = match main.clone().try_acquire_owned() {
            Ok(p) => (p, limits.header_timeout),
            Err(_) => match reserve.clone().try_acquire_owned() {
                Ok(p) => (p, limits.reserve_header_timeout),
                Err(_) => {
                    drop(sock); // over every limit: closed at once, costs nothing
                    continue;
                }
            },
        };
        let _ = sock.set_nodelay(true);
        let svc = TowerToHyperService::new(router.clone());
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(header_timeout)
            .max_buf_size(64 * 1024)
            .serve_connection(TokioIo::new(sock), svc);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
            drop(permit);
        });
    }
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(limits.shutdown_grace) => {
            tracing::warn!(grace = ?limits.shutdown_grace, "connections still open at the end of the shutdown grace: closing them");
        }
    }
}
