//! One rollout run: `gate` (the record's halt, a failed node, the plan's refusals, a dry
//! run), `take_lock` (the lock, its renewer, the start told), then `next` and `step` batch by
//! batch (one node at a time unless `--max-unavailable` allows more; the batch's nodes stepped
//! side by side, each to its own verdict) until the plan is done or something stops it, and
//! `finish` (the summary, the Events, the lock given up). What each node's step does is
//! `node.rs`; what the plan allows, `plan/`; what the record holds, `record/`.
use super::*;
use crate::exit::ExitCode;
use gate::{gate, Gated, Start};
use std::collections::BTreeSet;

mod gate;

/// A rollout run; `watched`: started by `--watch`, which goes on only to approved revisions.
pub(super) async fn rollout(c: &Cluster, watched: bool) -> Result<ExitCode> {
    let gated = match gate(c).await? {
        Gated::Go(g) => g,
        Gated::Stop(code) => return Ok(code),
    };
    let Some(mut run) = Run::take_lock(c, *gated, watched).await? else {
        return Ok(ExitCode::NotDecided);
    };
    let (code, ending) = loop {
        match run.next().await {
            Next::Batch(b) => {
                if let Some(end) = run.step(*b).await {
                    break end;
                }
            }
            Next::Again => {}
            Next::End(code, ending) => break (code, ending),
        }
    };
    run.finish(code, ending).await
}

/// A run holding the lock.
struct Run<'a> {
    c: &'a Cluster,
    watched: bool,
    json_out: bool,
    opts: PlanOpts,
    ds: DaemonSet,
    held: Arc<Held>,
    /// The record, shared with the renewer (which writes it to the lock).
    shared: Arc<Mutex<Record>>,
    renewer: tokio::task::JoinHandle<()>,
    /// The interrupted steps to finish first.
    pending: Vec<InFlight>,
    /// The revision this run goes on to: under `--watch` only an approved one.
    run_rev: String,
    run_id: String,
    t0: Instant,
    results: Vec<NodeResult>,
    /// Nodes stepped and passed in this run.
    stepped: BTreeSet<String>,
    /// Begins deferred in a row.
    deferred: usize,
    waiting: Waiting,
    /// The size of the last batch whose verdicts all passed (batches grow from it).
    grown: Option<usize>,
    /// The last batch moved L2-announced VIPs.
    after_holders: bool,
    batches: usize,
}

/// A node to step: the step, its revision (hash, number), and the interrupted step it
/// finishes.
struct NextStep {
    st: PlannedStep,
    target: (String, i64),
    resumed: Option<InFlight>,
}

/// The nodes to step side by side, and the cluster as read for them.
struct NextBatch {
    view: ClusterView,
    steps: Vec<NextStep>,
    /// The batch size allowed now (for people).
    size: usize,
}

enum Next {
    Batch(Box<NextBatch>),
    /// Waited (a transient failure, a plan that refuses for now): ask again.
    Again,
    /// The run ends: its status and why (none: the plan is done).
    End(ExitCode, Option<String>),
}

/// The end of a run: its status and why.
type End = (ExitCode, Option<String>);

impl<'a> Run<'a> {
    /// Takes the lock (the record's gate judged again under it), starts its renewer and tells
    /// the start; `None` when the lock was refused (told).
    async fn take_lock(c: &'a Cluster, g: Start, watched: bool) -> Result<Option<Run<'a>>> {
        let json_out = c.args.output == "json";
        let Start {
            opts,
            view,
            ds,
            current,
            approve,
            first,
        } = g;
        let now = stamp();
        let (cur_hash, approve2) = (current.0.clone(), approve.clone());
        let taken = patient(
            "take the rollout lock",
            Duration::from_secs(60),
            None,
            || {
                acquire(c, |r| {
                    match record::gate(r, &cur_hash, approve2.as_deref(), &now) {
                        Gate::Halted(m) => Err(m),
                        Gate::Go { lift } => {
                            if let Some(d) = lift {
                                r.halt = None;
                                r.decide(d);
                            }
                            r.forget_other_revisions(&cur_hash);
                            // A retry of a node that no longer runs a cilium pod is done with.
                            if r.retry
                                .as_ref()
                                .is_some_and(|n| !view.pods.iter().any(|p| &p.node == n))
                            {
                                r.retry = None;
                            }
                            if !watched {
                                // A person runs the rollout again: an earlier `--abort` no
                                // longer holds.
                                r.aborted = None;
                            }
                            Ok(())
                        }
                    }
                })
            },
        )
        .await?;
        let rec = match taken {
            Taken::Held(r) => *r,
            Taken::Refused(why) => {
                say(json_out, format!("refusing to start: {why}"));
                return Ok(None);
            }
        };
        // The lock is renewed in the background every retry period (with the record); losing
        // it stops everything.
        let held = Arc::new(Held::new());
        let shared = Arc::new(Mutex::new(rec.clone()));
        *crate::locks::lock(&c.told) = Some(shared.clone());
        let renewer = {
            let (held, shared) = (held.clone(), shared.clone());
            let c2 = Cluster {
                client: c.client.clone(),
                ns: c.ns.clone(),
                ds: c.ds.clone(),
                args: c.args.clone(),
                token: c.token.clone(),
                identity: c.identity.clone(),
                told: Mutex::new(None),
                mirrors: c.mirrors.clone(),
                before_delete: tokio::sync::Mutex::new(None),
            };
            tokio::spawn(async move {
                let every = lock_times(&c2).retry;
                while !held.is_lost() {
                    tokio::time::sleep(every).await;
                    renew_held(&c2, &shared, &held).await;
                }
            })
        };
        if rec.halt.is_none() {
            if let Some(d) = rec
                .decisions
                .last()
                .filter(|d| d.action == "approved" && d.at == now)
            {
                c.event(
                    &ds,
                    false,
                    "StepguardHaltLifted",
                    &format!("{}: {}", d.by, d.why),
                )
                .await;
            }
        }
        for i in &rec.inflight {
            say(
                json_out,
                format!(
                    "resuming the rollout interrupted at node {} (step {}, revision {})",
                    i.node, i.step, i.revision
                ),
            );
        }
        c.event(
            &ds,
            false,
            "StepguardRolloutStarted",
            &format!(
                "stepguard rollout of revision {} started: {} nodes to step",
                current.0,
                first.as_ref().map(|p| p.len()).unwrap_or(0) + rec.inflight.len()
            ),
        )
        .await;
        let run_rev = if !watched || approve.as_deref() == Some(current.0.as_str()) {
            current.0.clone()
        } else {
            String::new()
        };
        Ok(Some(Run {
            c,
            watched,
            json_out,
            opts,
            ds,
            held,
            shared,
            renewer,
            pending: rec.inflight.clone(),
            run_rev,
            run_id: format!("{:x}", (now_s() * 1000.0) as u64 % 0xffffff),
            t0: Instant::now(),
            results: Vec::new(),
            stepped: BTreeSet::new(),
            deferred: 0,
            waiting: Waiting::default(),
            grown: None,
            after_holders: false,
            batches: 0,
        }))
    }

    /// The next node to step, from the cluster read now: the interrupted step first, else
    /// the plan's first node on the run's revision. Transient failures and a plan that
    /// refuses to go on are waited out (the lock is renewed meanwhile); only a failed step
    /// or a person stops a rollout.
    async fn next(&mut self) -> Next {
        let (c, json_out) = (self.c, self.json_out);
        if self.held.is_lost() {
            return Next::End(
                ExitCode::NotDecided,
                Some("the rollout lock was lost: nothing more is touched".into()),
            );
        }
        if TERMINATING.load(Ordering::SeqCst) {
            return Next::End(
                ExitCode::NotDecided,
                Some("stopped by a signal: the next run goes on from the record".into()),
            );
        }
        if c.args.max_nodes.is_some_and(|m| self.results.len() >= m) {
            return Next::End(ExitCode::Ok, None);
        }
        let (view, ds_now) = match c.view().await {
            Ok(v) => v,
            Err(e) if e.is_transient() => {
                self.waiting
                    .wait(
                        json_out,
                        format!("cannot read the cluster (retrying): {e:#}"),
                    )
                    .await;
                return Next::Again;
            }
            Err(e) => {
                return Next::End(
                    e.exit_code(),
                    Some(format!("cannot read the cluster: {e:#}")),
                )
            }
        };
        self.ds = ds_now;
        if !self.pending.is_empty() {
            // The interrupted batch is finished first, at most this run's batch size at a
            // time (an interrupted step may still have its pod to delete).
            let max = c
                .args
                .max_unavailable
                .of(plan::scope::size(&view, &self.opts));
            let n = max.min(self.pending.len());
            let steps: Vec<NextStep> = self
                .pending
                .drain(..n)
                .map(|i| NextStep {
                    st: resumed_step(&i),
                    target: (i.revision.clone(), i.revision_number),
                    resumed: Some(i),
                })
                .collect();
            let size = steps.len();
            return Next::Batch(Box::new(NextBatch { view, steps, size }));
        }
        let Some(cur) = view.revision.clone() else {
            return Next::End(
                ExitCode::NotDecided,
                Some("the DaemonSet has no ControllerRevision any more".into()),
            );
        };
        if cur.0 != self.run_rev {
            let (approved_now, unapproved) = c.approval_now(&self.ds, &cur.0, &view).await;
            if record::may_adopt(&self.run_rev, &cur.0, approved_now.as_deref()) {
                say(
                    json_out,
                    format!(
                        "the DaemonSet moved to approved revision {}: re-planning",
                        cur.0
                    ),
                );
                self.run_rev = cur.0.clone();
                crate::locks::lock(&self.shared).forget_other_revisions(&self.run_rev);
            } else {
                let why = format!(
                    "revision {} of the DaemonSet is not approved ({}): the rollout pauses after node {}; approve it to go on{}",
                    cur.0,
                    unapproved,
                    self.results.last().map(|r| r.node.as_str()).unwrap_or("-"),
                    if self.watched { "" } else { ", or run `stepguard rollout` again" }
                );
                c.event(&self.ds, true, "StepguardRolloutPaused", &why)
                    .await;
                return Next::End(ExitCode::NotDecided, Some(why));
            }
        }
        {
            let r = crate::locks::lock(&self.shared);
            self.opts.skip = r.skipped_on(&self.run_rev).into_iter().collect();
            self.opts.again = r.retry.clone();
        }
        self.opts.max_nodes = None;
        match plan::plan(&view, &self.opts) {
            Ok(steps) if steps.is_empty() => Next::End(ExitCode::Ok, None),
            Ok(steps) => {
                let max = c
                    .args
                    .max_unavailable
                    .of(plan::scope::size(&view, &self.opts));
                let mut size = plan::batch::next_size(self.grown, max);
                if let Some(m) = c.args.max_nodes {
                    size = size.min(m.saturating_sub(self.results.len()).max(1));
                }
                let batch = plan::batch::batch(&view, &self.opts, &steps, size);
                if let Some(s) = batch.iter().find(|s| {
                    self.stepped.contains(&s.node)
                        && self.opts.again.as_deref() != Some(s.node.as_str())
                        && view
                            .pods
                            .iter()
                            .any(|p| p.node == s.node && p.revision == cur.0)
                }) {
                    // Stepped and passed in this run, yet its agent does not vouch for the
                    // pod's start: never stepped round and round.
                    let why = format!(
                        "node {} was stepped in this run and its verdict passed, but its agent does not prove the current pod's start ({}): stopping instead of stepping it again",
                        s.node, s.why
                    );
                    c.event(&self.ds, true, "StepguardRolloutStopped", &why)
                        .await;
                    return Next::End(ExitCode::NotDecided, Some(why));
                }
                let steps = batch
                    .into_iter()
                    .map(|st| NextStep {
                        st,
                        target: cur.clone(),
                        resumed: None,
                    })
                    .collect();
                Next::Batch(Box::new(NextBatch { view, steps, size }))
            }
            Err(refusals) if refusals.iter().any(|r| r.halts()) => {
                let text = refusals
                    .iter()
                    .filter(|r| r.halts())
                    .map(|r| r.to_string())
                    .collect::<Vec<_>>()
                    .join("; ");
                c.event(&self.ds, true, "StepguardRolloutHalted", &text)
                    .await;
                Next::End(ExitCode::Failed, Some(text))
            }
            Err(refusals) => {
                let note = format!(
                    "waiting: the plan refuses to go on:\n{}",
                    refusals_text(&refusals)
                );
                self.waiting.wait(json_out, note).await;
                Next::Again
            }
        }
    }

    /// Steps a batch, its nodes side by side, and records each outcome once every verdict of
    /// the batch is in (a failure halts the rollout on the lock before anything else
    /// happens, naming every node of the batch; a node not yet deleted when another failed
    /// is not deleted); the run's end when it stops here.
    async fn step(&mut self, b: NextBatch) -> Option<End> {
        let NextBatch { view, steps, size } = b;
        let (c, json_out) = (self.c, self.json_out);
        self.waiting = Waiting::default();
        let plain: Vec<PlannedStep> = steps.iter().map(|n| n.st.clone()).collect();
        let pause = plan::batch::pause(
            &view,
            &self.opts,
            self.results.is_empty(),
            self.after_holders,
            &plain,
        );
        if !pause.is_zero() {
            let holders = plain.iter().any(|s| !s.moves.is_empty()) && self.after_holders;
            say(
                json_out,
                format!(
                    "pausing {}s before {}{}",
                    pause.as_secs(),
                    plain
                        .iter()
                        .map(|s| format!("{} ({})", s.node, s.why))
                        .collect::<Vec<_>>()
                        .join(", "),
                    if holders {
                        ": lease holders after lease holders wait at least the longest lease"
                    } else {
                        ""
                    }
                ),
            );
            tokio::time::sleep(pause).await;
        }
        self.batches += 1;
        let batched = steps.len() > 1 || c.args.max_unavailable != plan::Budget::Count(1);
        if batched {
            say(
                json_out,
                format!(
                    "batch {}: {} (up to {size} now, --max-unavailable {})",
                    self.batches,
                    plain
                        .iter()
                        .map(|s| s.node.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                    c.args.max_unavailable
                ),
            );
        }
        let targets: BTreeMap<String, String> = steps
            .iter()
            .map(|n| (n.st.node.clone(), n.target.0.clone()))
            .collect();
        let halting: Mutex<Option<String>> = Mutex::new(None);
        let begun_told = AtomicBool::new(false);
        let begins_left = std::sync::atomic::AtomicUsize::new(
            steps.iter().filter(|n| n.resumed.is_none()).count(),
        );
        let base = self.results.len();
        let cxs: Vec<StepCx> = (0..steps.len())
            .map(|i| StepCx {
                c,
                ds: &self.ds,
                held: &self.held,
                shared: &self.shared,
                run_id: &self.run_id,
                n: base + i + 1,
                json_out,
                halting: &halting,
                begins_left: &begins_left,
                batch: steps.len(),
                begun_told: &begun_told,
            })
            .collect();
        let results: Vec<NodeResult> =
            futures_util::future::join_all(cxs.iter().zip(steps).map(|(cx, n)| {
                let view = &view;
                async move { step_node(cx, view, &n.st, n.target, n.resumed).await }
            }))
            .await;
        drop(cxs);
        let target = self.run_rev.clone();
        let mut code = ExitCode::Ok;
        let mut failed: Option<(String, Option<String>, String)> = None;
        let mut any_deferred = None;
        let mut all_passed = true;
        {
            let mut rec = crate::locks::lock(&self.shared);
            for r in &results {
                match &r.outcome {
                    Outcome::Passed { .. } => {
                        rec.end(&r.node);
                        if rec.retry.as_deref() == Some(r.node.as_str()) {
                            rec.retry = None;
                        }
                        self.stepped.insert(r.node.clone());
                    }
                    Outcome::Failed { step, why } => {
                        all_passed = false;
                        code = ExitCode::Failed;
                        rec.end(&r.node);
                        if failed.is_none() {
                            failed = Some((r.node.clone(), step.clone(), why.clone()));
                        }
                    }
                    Outcome::Stopped { .. } => {
                        all_passed = false;
                        if code == ExitCode::Ok {
                            code = ExitCode::NotDecided;
                        }
                    }
                    Outcome::Gone { .. } => {
                        // No verdict is owed by a node that left; its end is recorded. No
                        // verdict passed either: the batches do not grow on it.
                        all_passed = false;
                        rec.end(&r.node);
                    }
                    Outcome::Deferred { why } => {
                        // Nothing was deleted: the node is planned again from what its
                        // agent says.
                        all_passed = false;
                        rec.end(&r.node);
                        any_deferred = Some((r.node.clone(), why.clone()));
                    }
                }
            }
            if let Some((node, step, why)) = &failed {
                rec.retry = None;
                rec.halt = Some(record::Halt {
                    node: node.clone(),
                    step: step.clone(),
                    revision: targets.get(node).cloned().unwrap_or(target.clone()),
                    reason: why.clone(),
                    at: stamp(),
                    batch: if results.len() > 1 {
                        results.iter().map(batch_line).collect()
                    } else {
                        vec![]
                    },
                });
            }
        }
        // A halt is on the lock before anything else happens (release may not get through;
        // a later run must see it); the steps' ends too.
        if code != ExitCode::NotDecided {
            persist(c, &self.shared, &self.held).await;
        }
        if failed.is_some() {
            let h = crate::locks::lock(&self.shared).halt.clone();
            if let Some(h) = h {
                c.event(
                    &self.ds,
                    true,
                    "StepguardRolloutHalted",
                    &record::halt_text(&h),
                )
                .await;
            }
        }
        let passed = results
            .iter()
            .filter(|r| matches!(r.outcome, Outcome::Passed { .. }))
            .count();
        if passed > 0 {
            self.after_holders = results.iter().any(|r| !r.moves.is_empty());
        }
        if all_passed {
            self.grown = Some(size);
        }
        let only_deferred = code == ExitCode::Ok && passed == 0;
        for r in results {
            if !matches!(r.outcome, Outcome::Deferred { .. }) {
                self.results.push(r);
            }
        }
        if let Some((node, why)) = any_deferred.filter(|_| only_deferred) {
            say(json_out, format!("{node}: {why}; re-planning"));
            self.deferred += 1;
            if self.deferred > 20 {
                return Some((
                    ExitCode::NotDecided,
                    Some(format!("node {node} could not be begun: {why}")),
                ));
            }
            return None;
        }
        self.deferred = 0;
        (code != ExitCode::Ok).then_some((code, None))
    }

    /// Ends the run: the summary told (an Event, the output), the end kept on the record,
    /// then the lock given up.
    async fn finish(self, code: ExitCode, ending: Option<String>) -> Result<ExitCode> {
        let (c, results) = (self.c, &self.results);
        let rec_halt = crate::locks::lock(&self.shared).halt.clone();
        let summary = match code {
            ExitCode::Ok => format!(
                "stepguard rollout finished: {} nodes stepped and verified",
                self.stepped.len()
            ),
            ExitCode::Failed => match (&ending, &rec_halt) {
                (Some(e), _) => format!(
                    "stepguard rollout halted: {e}; no further node is touched until a person decides"
                ),
                (None, Some(h)) if !h.batch.is_empty() => format!(
                    "stepguard rollout halted: the step on {} failed; its batch: {}; no further node is touched until a person decides (`--retry`, `--skip`, `--abort`)",
                    h.node,
                    h.batch.join("; ")
                ),
                (None, h) => format!(
                    "stepguard rollout halted: the step on {} failed; no further node is touched until a person decides (`--retry`, `--skip`, `--abort`)",
                    h.as_ref()
                        .map(|h| h.node.as_str())
                        .or(results.last().map(|r| r.node.as_str()))
                        .unwrap_or("?")
                ),
            },
            ExitCode::NotDecided => format!(
                "stepguard rollout interrupted: {}",
                ending.unwrap_or_else(|| "the lock was lost".into())
            ),
        };
        c.event(
            &self.ds,
            code != ExitCode::Ok,
            if code == ExitCode::Ok {
                "StepguardRolloutDone"
            } else {
                "StepguardRolloutStopped"
            },
            &summary,
        )
        .await;
        if let Some(m) = c.mirrors.get() {
            tracing::info!(requests = ?m.requests(), "the watches' lists and watches so far");
        }
        // The rollout's end is on the record too; then the lock is given up.
        self.renewer.abort();
        *crate::locks::lock(&c.told) = None;
        let rec = crate::locks::lock(&self.shared).clone();
        if !self.held.is_lost() {
            release(c, &rec).await;
        }
        print_end(
            self.json_out,
            code,
            &summary,
            self.t0.elapsed(),
            results,
            &rec,
        )?;
        Ok(code)
    }
}

/// A node of a halted batch, for the halt's record.
fn batch_line(r: &NodeResult) -> String {
    match &r.outcome {
        Outcome::Passed { .. } => format!("{}: passed", r.node),
        Outcome::Failed { why, .. } => format!("{}: failed: {why}", r.node),
        Outcome::Stopped { why } => format!("{}: stopped: {why}", r.node),
        Outcome::Deferred { why } => format!("{}: not deleted: {why}", r.node),
        Outcome::Gone { why } => format!("{}: gone: {why}", r.node),
    }
}
