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
    /// A response write that makes no progress for this long closes the connection.
    pub write_timeout: Duration,
    /// Requests one connection may send (pipelined or one after another) before it is closed.
    pub max_requests: usize,
    /// Slots one source address may hold; beyond it its own oldest idle connection gives one
    /// up, or the newcomer is closed.
    pub per_source: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 256,
            waiting: 128,
            header_timeout: Duration::from_secs(5),
            shutdown_grace: Duration::from_secs(5),
            write_timeout: Duration::from_secs(5),
            max_requests: 64,
            per_source: 64,
        }
    }
}

/// Connections waiting for their first bytes, oldest first, each with its eviction signal.
type Waiters = Arc<std::sync::Mutex<std::collections::VecDeque<(u64, oneshot::Sender<()>)>>>;

/// A connection holding a slot.
struct Held {
    id: u64,
    source: std::net::IpAddr,
    /// A response write is stalled (the client does not read).
    stalled: Arc<std::sync::atomic::AtomicBool>,
    /// A request is being answered (headers read, response not yet produced); otherwise the
    /// connection is reading a request's headers or idle between keep-alive requests.
    in_request: Arc<std::sync::atomic::AtomicBool>,
    evict: oneshot::Sender<()>,
}

/// Connections holding a slot, oldest first.
type Serving = Arc<std::sync::Mutex<Vec<Held>>>;

/// How long a new request waits for the slot an evicted connection gives up.
const EVICTION_WAIT: Duration = Duration::from_millis(200);

/// Closes the oldest connection `which` selects; false when none is selected.
fn evict(serving: &Serving, which: impl Fn(&Held) -> bool) -> bool {
    let mut s = crate::locks::lock(serving);
    let Some(i) = s.iter().position(which) else {
        return false;
    };
    let h = s.remove(i);
    let _ = h.evict.send(());
    true
}

/// A connection that gives its slot up to a newcomer whose request has arrived: one whose
/// response write is stalled, else the oldest that is not answering a request (idle between
/// keep-alive requests, or still sending its headers a byte at a time).
fn evict_for_newcomer(serving: &Serving, source: Option<std::net::IpAddr>) -> bool {
    use std::sync::atomic::Ordering::Relaxed;
    let mine = |h: &Held| source.is_none_or(|s| h.source == s);
    evict(serving, |h| mine(h) && h.stalled.load(Relaxed))
        || evict(serving, |h| mine(h) && !h.in_request.load(Relaxed))
}

/// How long a newcomer whose request has arrived waits for a slot to be given up before it is
/// closed (every held connection may be answering a request at that moment).
const NEWCOMER_PATIENCE: Duration = Duration::from_millis(500);

/// A slot for a newcomer from `source` whose request has arrived: a free one, else one given
/// up by a connection [`evict_for_newcomer`] picks (within the source's share, one of its
/// own), as soon as one can be, for up to [`NEWCOMER_PATIENCE`]. None: closed.
async fn take_slot(
    slots: &Arc<Semaphore>,
    serving: &Serving,
    source: std::net::IpAddr,
    per_source: usize,
) -> Option<tokio::sync::OwnedSemaphorePermit> {
    let deadline = tokio::time::Instant::now() + NEWCOMER_PATIENCE;
    loop {
        let over_share = crate::locks::lock(serving)
            .iter()
            .filter(|h| h.source == source)
            .count()
            >= per_source;
        if !over_share {
            if let Ok(p) = slots.clone().try_acquire_owned() {
                return Some(p);
            }
        }
        let evicted = evict_for_newcomer(serving, over_share.then_some(source));
        if evicted {
            // The evicted connection's task gives its permit back as it ends.
            if let Ok(Ok(p)) =
                tokio::time::timeout(EVICTION_WAIT, slots.clone().acquire_owned()).await
            {
                return Some(p);
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        if !evicted {
            tokio::time::sleep(Duration::from_millis(10)).await;
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
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    // One slot beyond them for the probes (`GET /livez`, `GET /readyz`) when every other is
    // held by connections answering requests.
    let probe_slot = Arc::new(Semaphore::new(1));
    let waiters: Waiters = Default::default();
    let serving: Serving = Default::default();
    let graceful = GracefulShutdown::new();
    let mut next_id: u64 = 0;
    tokio::pin!(shutdown);
    loop {
        let (sock, peer) = tokio::select! {
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
            let mut w = crate::locks::lock(&waiters);
            if w.len() >= limits.waiting.max(1) {
                // The oldest waiter has sent nothing for the longest: it goes.
                if let Some((_, oldest)) = w.pop_front() {
                    let _ = oldest.send(());
                }
            }
            w.push_back((id, cancel_tx));
        }
        let probe_slot = probe_slot.clone();
        let (slots, waiters, serving, watcher, router) = (
            slots.clone(),
            waiters.clone(),
            serving.clone(),
            graceful.watcher(),
            router.clone(),
        );
        let header_timeout = limits.header_timeout;
        let (write_timeout, max_requests) = (limits.write_timeout, limits.max_requests.max(1));
        let (source, per_source) = (peer.ip().to_canonical(), limits.per_source.max(1));
        tokio::spawn(async move {
            let mut first = [0u8; 1];
            let arrived = tokio::select! {
                // Peek: a request byte has really arrived (0 = the client closed).
                r = tokio::time::timeout(header_timeout, sock.peek(&mut first)) => matches!(r, Ok(Ok(n)) if n > 0),
                _ = cancel_rx => false,
            };
            crate::locks::lock(&waiters).retain(|(w, _)| *w != id);
            if !arrived {
                return; // idle, evicted or broken: closed, having held no slot
            }
            // A probe is known from its request line (in the same packet as its first byte).
            let mut line = [0u8; 12];
            let seen = sock.peek(&mut line).await.unwrap_or(0);
            let head = &line[..seen];
            let probe = head.starts_with(b"GET /livez") || head.starts_with(b"GET /readyz");
            let reserved = || {
                slots
                    .clone()
                    .try_acquire_owned()
                    .or_else(|_| probe_slot.clone().try_acquire_owned())
                    .ok()
            };
            let permit = match probe.then(reserved).flatten() {
                Some(p) => p,
                None => match take_slot(&slots, &serving, source, per_source).await {
                    Some(p) => p,
                    None => return, // nothing gave a slot up in time: closed
                },
            };
            let stalled = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let in_request = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let (evict_tx, evict_rx) = oneshot::channel::<()>();
            crate::locks::lock(&serving).push(Held {
                id,
                source,
                stalled: stalled.clone(),
                in_request: in_request.clone(),
                evict: evict_tx,
            });
            let _ = sock.set_nodelay(true);
            // The last request a connection may send is answered with `Connection: close`.
            let served = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let answering = in_request.clone();
            let router = tower::ServiceExt::<hyper::Request<hyper::body::Incoming>>::map_request(
                router,
                move |r: hyper::Request<hyper::body::Incoming>| {
                    answering.store(true, std::sync::atomic::Ordering::Relaxed);
                    r
                },
            );
            let svc = TowerToHyperService::new(tower::ServiceExt::<
                hyper::Request<hyper::body::Incoming>,
            >::map_response(
                router,
                move |mut r: axum::response::Response| {
                    in_request.store(false, std::sync::atomic::Ordering::Relaxed);
                    let n = served.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                    if n >= max_requests {
                        r.headers_mut()
                            .insert(header::CONNECTION, HeaderValue::from_static("close"));
                    }
                    r
                },
            ));
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .max_buf_size(16 * 1024)
                .serve_connection(
                    TokioIo::new(WriteDeadline::new(sock, write_timeout, stalled)),
                    svc,
                );
            tokio::select! {
                _ = watcher.watch(conn) => {}
                _ = evict_rx => {}
            }
            crate::locks::lock(&serving).retain(|h| h.id != id);
            drop(permit);
        });
    }
    drop(listener);
    // Waiting connections are closed; served ones finish their request within the grace.
    for (_, w) in crate::locks::lock(&waiters).drain(..) {
        let _ = w.send(());
    }
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(limits.shutdown_grace) => {
            tracing::warn!(grace = ?limits.shutdown_grace, "connections still open at the end of the shutdown grace: closing them");
        }
    }
}

/// A stream whose writes fail once one has made no progress for `limit`: a client that does
/// not read its responses (a full receive buffer) cannot hold its connection.
struct WriteDeadline<T> {
    io: T,
    limit: Duration,
    stalled: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    /// Set while a write waits for the client to read (the connection may be evicted).
    flag: Arc<std::sync::atomic::AtomicBool>,
}

impl<T> WriteDeadline<T> {
    fn new(io: T, limit: Duration, flag: Arc<std::sync::atomic::AtomicBool>) -> Self {
        WriteDeadline {
            io,
            limit,
            stalled: None,
            flag,
        }
    }

    /// Pending: start (or keep) the stall clock, and fail once it runs out.
    fn stall<R>(
        &mut self,
        cx: &mut std::task::Context<'_>,
        r: std::task::Poll<std::io::Result<R>>,
    ) -> std::task::Poll<std::io::Result<R>> {
        use std::task::Poll;
        match r {
            Poll::Ready(x) => {
                self.stalled = None;
                self.flag.store(false, std::sync::atomic::Ordering::Relaxed);
                Poll::Ready(x)
            }
            Poll::Pending => {
                self.flag.store(true, std::sync::atomic::Ordering::Relaxed);
                let limit = self.limit;
                let s = self
                    .stalled
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
                match s.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "the client did not read its response in time",
                    ))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for WriteDeadline<T> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for WriteDeadline<T> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let r = std::pin::Pin::new(&mut self.io).poll_write(cx, buf);
        self.stall(cx, r)
    }
    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let r = std::pin::Pin::new(&mut self.io).poll_flush(cx);
        self.stall(cx, r)
    }
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let r = std::pin::Pin::new(&mut self.io).poll_shutdown(cx);
        self.stall(cx, r)
    }
}

/// Largest request body either server reads.
pub const BODY_LIMIT: usize = 16 * 1024;
/// How long a client has to send a request body.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(5);

/// Reads a request body under [`BODY_LIMIT`] and [`BODY_TIMEOUT`]; call it only once the
/// request is authenticated (a client without the token cannot hold a slot by trickling).
pub async fn read_body(body: axum::body::Body) -> Result<axum::body::Bytes, (StatusCode, String)> {
    match tokio::time::timeout(BODY_TIMEOUT, axum::body::to_bytes(body, BODY_LIMIT)).await {
        Ok(Ok(b)) => Ok(b),
        Ok(Err(_)) => Err((
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("request body over {} KiB", BODY_LIMIT / 1024),
        )),
        Err(_) => Err((
            StatusCode::REQUEST_TIMEOUT,
            format!("request body not sent within {}s", BODY_TIMEOUT.as_secs()),
        )),
    }
}

/// A request body as one JSON value of `T` (an empty body: `T::default()`), read by
/// [`read_body`]; anything after the value but whitespace, a wrong field or type is a 400
/// naming where (`invalid {what}: {path}: {why}`).
pub async fn read_json<T: serde::de::DeserializeOwned + Default>(
    body: axum::body::Body,
    what: &str,
) -> Result<T, axum::response::Response> {
    let body = read_body(body).await.map_err(|(s, why)| error(s, why))?;
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return Ok(T::default());
    }
    let bad = |why: String| error(StatusCode::BAD_REQUEST, format!("invalid {what}: {why}"));
    let de = &mut serde_json::Deserializer::from_slice(&body);
    match serde_path_to_error::deserialize(&mut *de) {
        Ok(r) => match de.end() {
            Ok(()) => Ok(r),
            Err(e) => Err(bad(format!("more after the JSON body ({e})"))),
        },
        Err(e) => {
            let path = e.path().to_string();
            let inner = e.into_inner();
            Err(bad(if path == "." {
                inner.to_string()
            } else {
                format!("{path}: {inner}")
            }))
        }
    }
}

/// Whether `headers` carry `Authorization: Bearer <token>` (always true without a token).
/// Constant-time comparison: the token is a secret.
pub fn bearer_ok(token: Option<&str>, headers: &HeaderMap) -> bool {
    let Some(token) = token else {
        return true;
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    given.is_some_and(|g| {
        g.len() == token.len()
            && g.bytes()
                .zip(token.bytes())
                .fold(0u8, |a, (x, y)| a | (x ^ y))
                == 0
    })
}

/// A bearer token, from a file that is read again when it changes (Kubernetes updates a
/// mounted Secret in place): a rotated token takes effect without a restart. A file that
/// cannot be read, or reads as no valid token, keeps the last good token (logged once).
#[derive(Clone, Default)]
pub struct Token {
    inner: Arc<std::sync::Mutex<TokenState>>,
}

#[derive(Default)]
struct TokenState {
    path: Option<std::path::PathBuf>,
    token: Option<String>,
    /// (modified, length, inode) of the file the token was read from.
    seen: Option<(std::time::SystemTime, u64, u64)>,
    checked_at: Option<std::time::Instant>,
    last_error: Option<String>,
}

/// How often a token file is looked at again (a stat).
const TOKEN_RECHECK: Duration = Duration::from_secs(1);

impl Token {
    /// A fixed token (tests), or none.
    pub fn fixed(token: Option<String>) -> Token {
        Token {
            inner: Arc::new(std::sync::Mutex::new(TokenState {
                token,
                ..Default::default()
            })),
        }
    }

    /// The token in `path`, read now (an error if it is not a valid token), and again when
    /// the file changes.
    pub fn from_file(path: Option<&std::path::Path>) -> anyhow::Result<Token> {
        let token = crate::client::read_token(path)?;
        if let Some(p) = path {
            use std::os::unix::fs::PermissionsExt;
            if std::fs::metadata(p).is_ok_and(|m| m.permissions().mode() & 0o004 != 0) {
                tracing::warn!(file = %p.display(), "the token file is readable by every user of this host: make it readable by this process's user (or group) only, e.g. chmod 0400");
            }
        }
        let seen = path.and_then(file_stamp);
        Ok(Token {
            inner: Arc::new(std::sync::Mutex::new(TokenState {
                path: path.map(|p| p.to_path_buf()),
                token,
                seen,
                checked_at: Some(std::time::Instant::now()),
                last_error: None,
            })),
        })
    }

    /// Whether a token is required.
    pub fn required(&self) -> bool {
        self.current().is_some()
    }

    /// The token now (the file is looked at again at most once a second).
    pub fn current(&self) -> Option<String> {
        let mut s = crate::locks::lock(&self.inner);
        let due = s.checked_at.is_none_or(|t| t.elapsed() >= TOKEN_RECHECK);
        if let (true, Some(path)) = (due, s.path.clone()) {
            s.checked_at = Some(std::time::Instant::now());
            let stamp = file_stamp(&path);
            if stamp.is_some() && stamp != s.seen {
                match crate::client::read_token(Some(&path)) {
                    Ok(t) => {
                        tracing::info!(file = %path.display(), "token file changed: the new token is in effect");
                        s.token = t;
                        s.seen = stamp;
                        s.last_error = None;
                    }
                    Err(e) => {
                        let e = format!("{e:#}");
                        if s.last_error.as_deref() != Some(e.as_str()) {
                            tracing::warn!(error = %e, "token file changed but holds no valid token: the previous token stays in effect");
                            s.last_error = Some(e);
                        }
                    }
                }
            }
        }
        s.token.clone()
    }

    /// [`bearer_ok`] against the current token.
    pub fn ok(&self, headers: &HeaderMap) -> bool {
        bearer_ok(self.current().as_deref(), headers)
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.required() {
            "Token(set)"
        } else {
            "Token(none)"
        })
    }
}

fn file_stamp(p: &std::path::Path) -> Option<(std::time::SystemTime, u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(p).ok()?;
    Some((m.modified().ok()?, m.len(), m.ino()))
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
