//! The rollout lock: a `coordination.k8s.io` Lease held as client-go's leader election holds
//! one (k8s.io/client-go v0.37.2, `tools/leaderelection`): renewed every retry period until a
//! renew deadline, taken over only after its record stayed the same for a lease duration
//! observed on the local clock, written with the resourceVersion read, released with no holder.
//! It carries the rollout's record (`record.rs`).
use super::error::{ApiContext, RolloutError};
use super::record::Record;
use super::{annotations, api_code, micro_now, patient, Cluster};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{DeleteParams, PostParams, Preconditions};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The lock Lease and the record it carries (a record that cannot be read is an error).
pub(super) async fn read_lock(c: &Cluster) -> Result<(Option<Lease>, Record), RolloutError> {
    let l = c
        .leases()
        .get_opt(&c.lock_name())
        .await
        .api("read the rollout lock")?;
    let rec = match &l {
        Some(l) => Record::parse(&annotations(&l.metadata)).map_err(|e| {
            anyhow::anyhow!(
                "{e}: fix or remove it (`kubectl -n {} edit lease {}`), or `stepguard rollout --abort`",
                c.args.lock_namespace,
                c.lock_name()
            )
        })?,
        None => Record::default(),
    };
    Ok((l, rec))
}

/// The lock's timings, as client-go's leader election derives them (its defaults: a 15 s
/// lease, a 10 s renew deadline, a 2 s retry period): the holder renews every retry period
/// and gives the lock up once it has not renewed for the renew deadline; a candidate takes
/// the lock only after it observed the same record for a full lease duration.
#[derive(Clone, Copy, Debug)]
pub(super) struct LockTimes {
    pub(super) duration: Duration,
    pub(super) renew_deadline: Duration,
    pub(super) retry: Duration,
}

pub(super) fn lock_times(c: &Cluster) -> LockTimes {
    let duration = c.args.lock_duration.max(Duration::from_secs(1));
    LockTimes {
        duration,
        renew_deadline: duration * 2 / 3,
        retry: (duration * 2 / 15).max(Duration::from_millis(100)),
    }
}

/// What identifies a lock record: a holder that renews changes it (its renewTime), so an
/// unchanged record for a lease duration means the holder is gone — judged by the local
/// monotonic clock, never by comparing the holder's timestamps with ours (client-go,
/// `tools/leaderelection/leaderelection.go`, `tryAcquireOrRenew` and `isLeaseValid`).
fn lock_record(l: &Lease) -> (String, Duration) {
    let spec = l.spec.clone().unwrap_or_default();
    let raw = serde_json::to_string(&spec).unwrap_or_default();
    let secs = spec.lease_duration_seconds.unwrap_or(0).max(0) as u64;
    (raw, Duration::from_secs(secs))
}

pub(super) fn holder(l: &Lease) -> String {
    l.spec
        .as_ref()
        .and_then(|s| s.holder_identity.clone())
        .unwrap_or_default()
}

/// What watching a lock another stepper holds showed.
pub(super) enum Watched {
    /// Its record stayed the same for a full lease duration: its holder is gone (the lease
    /// as read, for the takeover).
    Stale(Box<Lease>),
    /// It changed: its holder renews it (the holder), or let it go, or it was deleted (why).
    Live(String),
}

/// Watches a lock another stepper holds until its record stayed the same for a full lease
/// duration, or as soon as it changed.
pub(super) async fn observe(c: &Cluster, first: Lease) -> Result<Watched, RolloutError> {
    let (raw, dur) = lock_record(&first);
    let who = holder(&first);
    eprintln!(
        "the rollout lock is held by {who}: watching it for up to {}s to see whether its holder still renews it",
        dur.as_secs()
    );
    let t0 = Instant::now();
    let retry = lock_times(c).retry;
    loop {
        if t0.elapsed() >= dur {
            return Ok(Watched::Stale(Box::new(first)));
        }
        tokio::time::sleep(retry.min(dur.saturating_sub(t0.elapsed()))).await;
        let now = patient(
            "read the rollout lock",
            Duration::from_secs(30),
            None,
            || async {
                c.leases()
                    .get_opt(&c.lock_name())
                    .await
                    .api("read the rollout lock")
            },
        )
        .await?;
        match now {
            None => {
                return Ok(Watched::Live(
                    "the lock was deleted while watching it: run again".into(),
                ))
            }
            Some(l) if lock_record(&l).0 != raw => {
                let h = holder(&l);
                return Ok(Watched::Live(if h.is_empty() {
                    format!("{who} released the lock while watching it: run again")
                } else {
                    h
                }));
            }
            Some(_) => {}
        }
    }
}

/// What trying to take the lock came to.
pub(super) enum Taken {
    /// Taken: the record as written.
    Held(Box<Record>),
    /// Not taken (why): another stepper holds it, or the record refuses (a halt).
    Refused(String),
}

/// Takes the lock when free, or held by a stepper that stopped renewing it (observed for a
/// lease duration); a live lock of another stepper refuses. `admit` sees the record under the
/// lock (it may change it, or refuse: a halt recorded meanwhile).
pub(super) async fn acquire(
    c: &Cluster,
    admit: impl Fn(&mut Record) -> Result<(), String>,
) -> Result<Taken, RolloutError> {
    let api = c.leases();
    let name = c.lock_name();
    let dur = lock_times(c).duration.as_secs().max(1) as i32;
    let (mut lease, _) = read_lock(c).await?;
    if let Some(l) = lease.take() {
        let h = holder(&l);
        if h.is_empty() || h == c.identity {
            lease = Some(l);
        } else {
            match observe(c, l).await? {
                Watched::Stale(stale) => {
                    tracing::warn!(holder = %h, "the rollout lock was not renewed for a lease duration: taking it over");
                    eprintln!("{h} did not renew the lock for a lease duration: taking it over");
                    lease = Some(*stale);
                }
                Watched::Live(live) => {
                    let (_, rec) = read_lock(c).await?;
                    return Ok(Taken::Refused(format!(
                        "another rollout holds the lock {}/{name}: {live}, in flight: {}; wait for it, or `stepguard rollout --abort` if it is gone",
                        c.args.lock_namespace,
                        rec.inflight_nodes(),
                    )));
                }
            }
        }
    }
    let mut rec = match &lease {
        Some(l) => Record::parse(&annotations(&l.metadata)).map_err(|e| {
            anyhow::anyhow!(
                "{e}: fix or remove it (`kubectl -n {} edit lease {name}`), or `stepguard rollout --abort`",
                c.args.lock_namespace
            )
        })?,
        None => Record::default(),
    };
    if let Err(why) = admit(&mut rec) {
        return Ok(Taken::Refused(why));
    }
    let taken_from = lease.as_ref().map(holder).filter(|h| !h.is_empty());
    let mut l = lease.unwrap_or_else(|| Lease {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: Some(c.args.lock_namespace.clone()),
            ..Default::default()
        },
        ..Default::default()
    });
    let mut ann = annotations(&l.metadata);
    rec.write(&mut ann);
    l.metadata.annotations = Some(ann.into_iter().collect());
    let s = l.spec.get_or_insert_with(Default::default);
    if taken_from.as_deref() != Some(c.identity.as_str()) {
        s.lease_transitions = Some(s.lease_transitions.unwrap_or(0) + 1);
    }
    s.holder_identity = Some(c.identity.clone());
    s.lease_duration_seconds = Some(dur);
    s.acquire_time = Some(micro_now());
    s.renew_time = Some(micro_now());
    // The replace carries the resourceVersion read (observed): a stepper that changed the
    // lock meanwhile makes it fail (409) instead of being overwritten.
    let r = if l.metadata.resource_version.is_some() {
        api.replace(&name, &PostParams::default(), &l).await
    } else {
        api.create(&PostParams::default(), &l).await
    };
    match r {
        Ok(_) => Ok(Taken::Held(Box::new(rec))),
        Err(e) if api_code(&e) == Some(409) => Ok(Taken::Refused(
            "another stepper took the lock just now".into(),
        )),
        Err(e) => Err(e).api("take the rollout lock"),
    }
}

enum RenewError {
    /// Someone else holds the lock: stop touching anything now.
    NotOurs(String),
    /// The API server did not take the renewal; the lock holds until the renew deadline.
    Failed(String),
}

/// Renews the lock and writes the record as it is at each attempt (a 409 retry never writes
/// an older copy over a newer one), giving up at `within`: a renewal must not outlive the
/// lock it renews.
async fn renew(c: &Cluster, shared: &Mutex<Record>, within: Duration) -> Result<(), RenewError> {
    match tokio::time::timeout(within.max(Duration::from_millis(100)), renew_now(c, shared)).await {
        Ok(r) => r,
        Err(_) => Err(RenewError::Failed(format!(
            "the API server did not answer the renewal within {:.1}s",
            within.as_secs_f64()
        ))),
    }
}

async fn renew_now(c: &Cluster, shared: &Mutex<Record>) -> Result<(), RenewError> {
    let api = c.leases();
    let name = c.lock_name();
    for _ in 0..3 {
        let mut l = api.get(&name).await.map_err(|e| match api_code(&e) {
            Some(404) => RenewError::NotOurs("the lock was deleted (`--abort`?)".into()),
            _ => RenewError::Failed(format!("read the lock: {e}")),
        })?;
        let h = holder(&l);
        if h != c.identity {
            return Err(RenewError::NotOurs(format!(
                "the lock is held by {}",
                if h.is_empty() {
                    "nobody (released by `--abort`?)"
                } else {
                    &h
                }
            )));
        }
        let rec = crate::locks::lock(shared).clone();
        let mut ann = annotations(&l.metadata);
        rec.write(&mut ann);
        l.metadata.annotations = Some(ann.into_iter().collect());
        l.spec.get_or_insert_with(Default::default).renew_time = Some(micro_now());
        match api.replace(&name, &PostParams::default(), &l).await {
            Ok(_) => return Ok(()),
            Err(e) if api_code(&e) == Some(409) => continue,
            Err(e) => return Err(RenewError::Failed(format!("renew the lock: {e}"))),
        }
    }
    Err(RenewError::Failed(
        "the lock kept changing under us (409 three times)".into(),
    ))
}

/// The lock's standing, shared by the renewer and the steps: lost for good, or held as of
/// the start of the last renewal that succeeded.
pub(super) struct Held {
    pub(super) lost: AtomicBool,
    last_ok: Mutex<Instant>,
    /// One write of the record at a time (a batch's steps persist side by side), and what
    /// the last one wrote: a step whose record is already on the lock, written within
    /// [`FRESH`], writes nothing more.
    writing: tokio::sync::Mutex<Option<(Record, Instant)>>,
}

/// A renewal this recent counts as "right now" for a write that changes nothing (a lease
/// lasts seconds at least, and a takeover waits a whole one).
const FRESH: Duration = Duration::from_millis(1000);

impl Held {
    pub(super) fn new() -> Held {
        Held {
            lost: AtomicBool::new(false),
            last_ok: Mutex::new(Instant::now()),
            writing: tokio::sync::Mutex::new(None),
        }
    }
    pub(super) fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }
}

/// One renewal attempt within what is left of the renew deadline; on success the lock is
/// held as of the attempt's start (the write took effect after that), on a lock no longer
/// ours, or the deadline passed, it is lost.
pub(super) async fn renew_held(c: &Cluster, shared: &Mutex<Record>, held: &Held) -> bool {
    if held.is_lost() {
        return false;
    }
    let t = lock_times(c);
    let started = Instant::now();
    let last = *crate::locks::lock(&held.last_ok);
    let left = t.renew_deadline.saturating_sub(last.elapsed());
    match renew(c, shared, left).await {
        Ok(()) => {
            *crate::locks::lock(&held.last_ok) = started;
            true
        }
        Err(RenewError::NotOurs(e)) => {
            tracing::error!(error = %e, "the rollout lock was lost");
            eprintln!("the rollout lock was lost: {e}");
            held.lost.store(true, Ordering::SeqCst);
            false
        }
        Err(RenewError::Failed(e)) => {
            if last.elapsed() >= t.renew_deadline {
                tracing::error!(error = %e, "the rollout lock was not renewed within its renew deadline: taken as lost");
                eprintln!(
                    "the rollout lock was lost: not renewed within {:.1}s ({e})",
                    t.renew_deadline.as_secs_f64()
                );
                held.lost.store(true, Ordering::SeqCst);
            } else {
                tracing::warn!(error = %e, "renewing the rollout lock; retrying");
            }
            false
        }
    }
}

/// Writes the record now (renewing the lock), retrying every retry period until it is
/// written or the lock is lost. Also the check right before a pod is deleted: the lock was
/// renewed just now, not only some renew period ago.
pub(super) async fn persist(c: &Cluster, shared: &Mutex<Record>, held: &Held) -> bool {
    let mut last = held.writing.lock().await;
    let fresh = FRESH.min(lock_times(c).duration / 10);
    loop {
        let now = crate::locks::lock(shared).clone();
        if let Some((written, at)) = last.as_ref() {
            // Another step of the batch wrote this very record just now (what was told since
            // goes with the renewer's next write).
            if written.without_history() == now.without_history()
                && at.elapsed() < fresh
                && !held.is_lost()
            {
                return true;
            }
        }
        let started = Instant::now();
        if renew_held(c, shared, held).await {
            // What the renewal wrote is the record as it was at its start or later.
            *last = Some((now, started));
            return true;
        }
        if held.is_lost() {
            return false;
        }
        tokio::time::sleep(lock_times(c).retry).await;
    }
}

/// Gives the lock up, leaving the record for the next run (the Lease is deleted when there is
/// nothing to leave), as client-go releases: an update of the Lease as last read (its
/// resourceVersion the precondition) with no holder and a one-second duration, or a delete
/// with that resourceVersion; a lock that is no longer ours is not touched.
pub(super) async fn release(c: &Cluster, rec: &Record) {
    let api = c.leases();
    let name = c.lock_name();
    for attempt in 0..10 {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let mut l = match api.get(&name).await {
            Ok(l) => l,
            Err(e) if api_code(&e) == Some(404) => return,
            Err(_) => continue,
        };
        if holder(&l) != c.identity {
            return;
        }
        let r = if rec.is_empty() {
            let dp = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: None,
                    resource_version: l.metadata.resource_version.clone(),
                }),
                ..Default::default()
            };
            api.delete(&name, &dp).await.map(|_| ())
        } else {
            let mut ann = annotations(&l.metadata);
            rec.write(&mut ann);
            l.metadata.annotations = Some(ann.into_iter().collect());
            let s = l.spec.get_or_insert_with(Default::default);
            s.holder_identity = None;
            s.lease_duration_seconds = Some(1);
            s.renew_time = Some(micro_now());
            api.replace(&name, &PostParams::default(), &l)
                .await
                .map(|_| ())
        };
        match r {
            Ok(()) => return,
            Err(e) if api_code(&e) == Some(404) => return,
            // Changed since read: read again (and leave it if it is no longer ours).
            Err(e) if api_code(&e) == Some(409) => continue,
            Err(e) => tracing::warn!(error = %e, "releasing the rollout lock; retrying"),
        }
    }
    tracing::error!("could not release the rollout lock: it expires by itself");
}
