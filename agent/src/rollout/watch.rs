//! `--watch`: a rollout begins when a person approves the current revision.
use super::approval::owed as plan_owed;
use super::*;

/// `--watch`: never ends on an error; a line is logged whenever what it waits for changes.
pub(super) async fn watch(c: &Cluster) -> Result<crate::exit::ExitCode> {
    let mut last = String::new();
    let mut announced = String::new();
    loop {
        let note = match watch_tick(c, &mut announced).await {
            Ok(n) => n,
            Err(e) => format!("cannot read the cluster (retrying every tick): {e:#}"),
        };
        if note != last && !note.is_empty() {
            tracing::warn!("{note}");
            eprintln!("stepguard rollout --watch: {note}");
        }
        last = note;
        let until = Instant::now() + c.args.watch_interval;
        while Instant::now() < until {
            if TERMINATING.load(Ordering::SeqCst) {
                tracing::warn!("stopped by a signal");
                eprintln!("stepguard rollout --watch: stopped by a signal");
                return Ok(crate::exit::ExitCode::Ok);
            }
            tokio::time::sleep(Duration::from_millis(200).min(until - Instant::now())).await;
        }
    }
}

/// One `--watch` tick: what it is waiting for, or the end of the rollout it ran. A revision
/// waiting for approval is told once in an Event (`announced`: the revision told last).
pub(super) async fn watch_tick(c: &Cluster, announced: &mut String) -> Result<String> {
    let (v, ds) = c.view().await?;
    let (_, rec) = read_lock(c).await?;
    let cur = v.revision.clone().map(|r| r.0).unwrap_or_default();
    let (approve, unapproved) = c.approval_now(&ds, &cur, &v).await;
    // A retry of a node that no longer runs a cilium pod is owed nothing (the run clears it).
    let retry_owed = rec
        .retry
        .as_ref()
        .is_some_and(|n| v.pods.iter().any(|p| &p.node == n));
    let owed = !rec.inflight.is_empty() || retry_owed;
    if let Gate::Halted(m) = record::gate(&rec, &cur, approve.as_deref(), &stamp()) {
        return Ok(m);
    }
    let mut opts = plan_opts(c);
    opts.skip = rec.skipped_on(&cur).into_iter().collect();
    opts.again = rec.retry.clone();
    if !owed && !plan_owed(&v, &opts) {
        return Ok(String::new());
    }
    if !owed && rec.aborted.as_deref() == Some(cur.as_str()) {
        return Ok(format!(
            "the rollout of revision {cur} was aborted: approve a new revision to start again (or run `stepguard rollout` by hand)"
        ));
    }
    // An interrupted step is always finished (its delete waits for an approval itself); a
    // retry alone waits for the revision to be approved, instead of a run per tick that
    // pauses at once.
    if let (true, Some(n)) = (
        rec.inflight.is_empty(),
        rec.retry.as_ref().filter(|_| retry_owed),
    ) {
        if approve.as_deref() != Some(cur.as_str()) {
            return Ok(format!(
                "node {n} is to be stepped again but the DaemonSet's revision {cur} is not approved ({}): waiting",
                unapproved
            ));
        }
    }
    if rec.inflight.is_empty() && approve.as_deref() == Some(cur.as_str()) {
        // A node whose current pod failed its verification halts the watch until a person
        // decides; told once in an Event, not by a rollout run per tick.
        if let Err(refusals) = plan::plan(&v, &opts) {
            let halts: Vec<String> = refusals
                .iter()
                .filter(|r| r.halts())
                .map(|r| r.to_string())
                .collect();
            if !halts.is_empty() {
                let note = format!(
                    "halted: a node's current cilium pod failed its verification: {}",
                    halts.join("; ")
                );
                if *announced != note {
                    c.event(&ds, true, "StepguardRolloutHalted", &note).await;
                    *announced = note.clone();
                }
                return Ok(note);
            }
        }
    }
    if owed || approved(&v, approve.as_deref(), &opts) {
        let code = rollout(c, true).await?;
        return Ok(format!("rollout ended with exit code {}", code.code()));
    }
    let note = format!("revision {cur} is not approved ({}): waiting", unapproved);
    if *announced != cur {
        c.event(&ds, false, "StepguardApprovalAwaited", &format!("{note}; approve it with stepguard.io/approve-revision: {cur}, or stepguard.io/approve-image and stepguard.io/approve-config-checksum in the commit that changes the template"))
            .await;
        *announced = cur;
    }
    Ok(note)
}
