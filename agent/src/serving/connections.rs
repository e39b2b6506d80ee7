//! Connections: slots, eviction for prompt newcomers, the probe slot, deadlines, shutdown
//! (see the serving module's documentation).
use super::*;

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
