//! Serving the API with bounds, so that no client can take the agent down or hold it up.
//! A new connection first waits, without a slot, until its request starts to arrive (at most
//! the header timeout); only then does it take one of `max_connections` slots. Connections
//! waiting so are bounded too, and when they are all taken the oldest waiter is closed: idle
//! connections (a flood, half-open sockets) can never hold the slots that serve requests, and
//! a client that sends its request at once (`/readyz`, `/metrics`) is served under a flood.
//! Request headers have a read timeout; shutdown finishes within the pod's grace period.
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, Semaphore};

/// The API's limits (flags of `stepguard agent`).
#[derive(Clone, Debug)]
pub struct Limits {
    /// Connections served at once (their request has started to arrive).
    pub max_connections: usize,
    /// Connections waiting for their first bytes; beyond it the oldest waiter is closed.
    pub waiting: usize,
    /// Time a client has to send its request headers (also between keep-alive requests).
    pub header_timeout: Duration,
    /// After SIGTERM, how long open connections get before the agent exits anyway.
    pub shutdown_grace: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 256,
            waiting: 128,
            header_timeout: Duration::from_secs(5),
            shutdown_grace: Duration::from_secs(5),
        }
    }
}

/// Connections waiting for their first bytes, oldest first, each with its eviction signal.
type Waiters = Arc<std::sync::Mutex<std::collections::VecDeque<(u64, oneshot::Sender<()>)>>>;

/// Serves `router` on `listener` until `shutdown` completes, then closes within the grace.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let waiters: Waiters = Default::default();
    let graceful = GracefulShutdown::new();
    let mut next_id: u64 = 0;
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
        next_id += 1;
        let id = next_id;
        let (cancel_tx, cancel_rx) = oneshot::channel();
        {
            let mut w = waiters.lock().unwrap_or_else(|e| e.into_inner());
            if w.len() >= limits.waiting.max(1) {
                // The oldest waiter has sent nothing for the longest: it goes.
                if let Some((_, oldest)) = w.pop_front() {
                    let _ = oldest.send(());
                }
            }
            w.push_back((id, cancel_tx));
        }
        let (slots, waiters, watcher, router) = (
            slots.clone(),
            waiters.clone(),
            graceful.watcher(),
            router.clone(),
        );
        let header_timeout = limits.header_timeout;
        tokio::spawn(async move {
            let mut first = [0u8; 1];
            let arrived = tokio::select! {
                // Peek: a request byte has really arrived (0 = the client closed).
                r = tokio::time::timeout(header_timeout, sock.peek(&mut first)) => matches!(r, Ok(Ok(n)) if n > 0),
                _ = cancel_rx => false,
            };
            waiters
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|(w, _)| *w != id);
            if !arrived {
                return; // idle, evicted or broken: closed, having held no slot
            }
            let Ok(permit) = slots.try_acquire_owned() else {
                return; // every slot serves a request: closed at once
            };
            let _ = sock.set_nodelay(true);
            let svc = TowerToHyperService::new(router);
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .max_buf_size(64 * 1024)
                .serve_connection(TokioIo::new(sock), svc);
            let _ = watcher.watch(conn).await;
            drop(permit);
        });
    }
    drop(listener);
    // Waiting connections are closed; served ones finish their request within the grace.
    for (_, w) in waiters.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
        let _ = w.send(());
    }
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(limits.shutdown_grace) => {
            tracing::warn!(grace = ?limits.shutdown_grace, "connections still open at the end of the shutdown grace: closing them");
        }
    }
}
