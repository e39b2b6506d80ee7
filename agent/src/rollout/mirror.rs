//! The stepper's view of the cluster, kept by watches instead of lists each turn: one list,
//! then a watch from its resourceVersion, resumed from the last version seen when it ends
//! (the API server closes a watch after its timeout), listed again when that version is too
//! old (410 Gone), as client-go's reflector does (`tools/cache/reflector.go`,
//! `ListAndWatch`, v0.37.2). A mirror that lost its watch and has not listed again since is
//! not read: its reader waits (a transient error), never decides on what may be stale.
use super::error::RolloutError;
use futures_util::StreamExt;
use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long a watch is asked to stay open (the API server's limit is
/// `--min-request-timeout` × [1, 2), 1800 s by default; client-go asks for 5 to 10 minutes).
const WATCH_TIMEOUT_S: u32 = 290;

/// One kind of object, mirrored.
pub struct Mirror<K> {
    inner: Arc<Inner<K>>,
    task: tokio::task::JoinHandle<()>,
}

struct Inner<K> {
    what: String,
    objects: Mutex<BTreeMap<String, K>>,
    /// Listed, and watching since (or resuming a watch that just ended).
    live: AtomicBool,
    /// Why it is not live (the last error).
    problem: Mutex<Option<String>>,
    /// Lists and watches made (for the benchmark and the logs).
    lists: AtomicU64,
    watches: AtomicU64,
}

/// What is kept of an object: all of it but its managed fields (who set which field: not read
/// here, and most of a pod's bytes).
fn kept<K: kube::Resource>(mut o: K) -> K {
    o.meta_mut().managed_fields = None;
    o
}

fn key<K: kube::Resource>(o: &K) -> String {
    format!(
        "{}/{}",
        o.meta().namespace.as_deref().unwrap_or(""),
        o.meta().name.as_deref().unwrap_or("")
    )
}

impl<K> Mirror<K>
where
    K: kube::Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
{
    /// Starts mirroring what `api` lists with the label selector `labels` and the field
    /// selector `fields`; `what` names it in errors ("the cilium pods").
    pub fn start(
        api: Api<K>,
        labels: Option<String>,
        fields: Option<String>,
        what: &str,
    ) -> Mirror<K> {
        let inner = Arc::new(Inner {
            what: what.to_string(),
            objects: Mutex::new(BTreeMap::new()),
            live: AtomicBool::new(false),
            problem: Mutex::new(Some("not listed yet".into())),
            lists: AtomicU64::new(0),
            watches: AtomicU64::new(0),
        });
        let task = tokio::spawn(run(api, labels, fields, inner.clone()));
        Mirror { inner, task }
    }

    /// Every object now, or why the mirror cannot be trusted now (transient: it lists again).
    pub fn list(&self) -> Result<Vec<K>, RolloutError> {
        self.check()?;
        Ok(crate::locks::lock(&self.inner.objects)
            .values()
            .cloned()
            .collect())
    }

    /// The objects `keep` accepts (only they are copied), or why the mirror cannot be trusted
    /// now.
    pub fn matching(&self, keep: impl Fn(&K) -> bool) -> Result<Vec<K>, RolloutError> {
        self.check()?;
        Ok(crate::locks::lock(&self.inner.objects)
            .values()
            .filter(|o| keep(o))
            .cloned()
            .collect())
    }

    /// The object `namespace/name` (None: there is none), or why the mirror cannot be
    /// trusted now.
    pub fn get(&self, namespace: &str, name: &str) -> Result<Option<K>, RolloutError> {
        self.check()?;
        Ok(crate::locks::lock(&self.inner.objects)
            .get(&format!("{namespace}/{name}"))
            .cloned())
    }

    fn check(&self) -> Result<(), RolloutError> {
        if self.inner.live.load(Ordering::SeqCst) {
            return Ok(());
        }
        Err(RolloutError::Stale {
            what: self.inner.what.clone(),
            why: crate::locks::lock(&self.inner.problem)
                .clone()
                .unwrap_or_default(),
        })
    }

    /// Waits until the first list is in (bounded); whether it is.
    pub async fn synced(&self, within: Duration) -> bool {
        let t0 = std::time::Instant::now();
        while !self.inner.live.load(Ordering::SeqCst) {
            if t0.elapsed() > within {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        true
    }

    /// (lists, watches) made so far.
    pub fn requests(&self) -> (u64, u64) {
        (
            self.inner.lists.load(Ordering::Relaxed),
            self.inner.watches.load(Ordering::Relaxed),
        )
    }
}

impl<K> Drop for Mirror<K> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What ended a watch.
enum Ended {
    /// Its time was up, or the connection closed: resume from the last version seen.
    Resume,
    /// It broke or ended with an error: not read until resumed, after a pause.
    Broken,
    /// The version is too old (410): list again.
    Relist,
}

async fn run<K>(api: Api<K>, labels: Option<String>, fields: Option<String>, inner: Arc<Inner<K>>)
where
    K: kube::Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
{
    let mut backoff = Duration::from_millis(200);
    let fail = |inner: &Inner<K>, why: String| {
        inner.live.store(false, Ordering::SeqCst);
        *crate::locks::lock(&inner.problem) = Some(why);
    };
    loop {
        // List: the whole state, and the version to watch from.
        let mut lp = ListParams::default();
        if let Some(l) = &labels {
            lp = lp.labels(l);
        }
        if let Some(f) = &fields {
            lp = lp.fields(f);
        }
        inner.lists.fetch_add(1, Ordering::Relaxed);
        let listed = match api.list(&lp).await {
            Ok(l) => l,
            Err(e) => {
                fail(&inner, format!("list {}: {e}", inner.what));
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(15));
                continue;
            }
        };
        let mut version = listed.metadata.resource_version.clone().unwrap_or_default();
        *crate::locks::lock(&inner.objects) = listed
            .items
            .into_iter()
            .map(|o| (key(&o), kept(o)))
            .collect();
        *crate::locks::lock(&inner.problem) = None;
        inner.live.store(true, Ordering::SeqCst);
        backoff = Duration::from_millis(200);
        // Watch from there, resuming as long as the version holds.
        loop {
            let mut wp = WatchParams::default().timeout(WATCH_TIMEOUT_S);
            if let Some(l) = &labels {
                wp = wp.labels(l);
            }
            if let Some(f) = &fields {
                wp = wp.fields(f);
            }
            inner.watches.fetch_add(1, Ordering::Relaxed);
            let ended = match api.watch(&wp, &version).await {
                Err(kube::Error::Api(s)) if s.code == 410 => Ended::Relist,
                Err(e) => {
                    // The API server away: the objects may be going stale. Not read until a
                    // watch is back (resumed from the version, or listed again).
                    fail(&inner, format!("watch {}: {e}", inner.what));
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(15));
                    Ended::Resume
                }
                Ok(stream) => {
                    // The watch resumed from the last version seen: live again (an outage's
                    // missed changes come first on it, or a 410 that lists again).
                    if !inner.live.load(Ordering::SeqCst) {
                        *crate::locks::lock(&inner.problem) = None;
                        inner.live.store(true, Ordering::SeqCst);
                    }
                    let mut stream = std::pin::pin!(stream);
                    let mut ended = Ended::Resume;
                    let mut events = 0u64;
                    while let Some(ev) = stream.next().await {
                        events += 1;
                        match ev {
                            Ok(WatchEvent::Added(o)) | Ok(WatchEvent::Modified(o)) => {
                                if let Some(v) = &o.meta().resource_version {
                                    version = v.clone();
                                }
                                crate::locks::lock(&inner.objects).insert(key(&o), kept(o));
                            }
                            Ok(WatchEvent::Deleted(o)) => {
                                if let Some(v) = &o.meta().resource_version {
                                    version = v.clone();
                                }
                                crate::locks::lock(&inner.objects).remove(&key(&o));
                            }
                            Ok(WatchEvent::Bookmark(b)) => {
                                version = b.metadata.resource_version;
                            }
                            Ok(WatchEvent::Error(s)) if s.code == 410 => {
                                ended = Ended::Relist;
                                break;
                            }
                            Ok(WatchEvent::Error(s)) => {
                                fail(&inner, format!("watch {}: {}", inner.what, s.message));
                                ended = Ended::Broken;
                                break;
                            }
                            Err(e) => {
                                fail(&inner, format!("watch {}: {e}", inner.what));
                                ended = Ended::Broken;
                                break;
                            }
                        }
                    }
                    if events > 0 && matches!(ended, Ended::Resume) {
                        backoff = Duration::from_millis(200);
                    }
                    ended
                }
            };
            if matches!(ended, Ended::Broken) {
                // Not read until a watch is back; resumed after a pause that grows.
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(15));
                continue;
            }
            if matches!(ended, Ended::Relist) {
                tracing::info!(what = %inner.what, "the watch's version is too old: listing again");
                // What is kept is older than what the API server still has: not read until
                // listed again.
                fail(
                    &inner,
                    format!("{}: listing again (its version is too old)", inner.what),
                );
                break;
            }
        }
    }
}
