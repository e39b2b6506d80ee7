//! One rollout run: `gate` (the record's halt, a failed node, the plan's refusals, a dry
//! run), `take_lock` (the lock, its renewer, the start told), then `next` and `step` node by
//! node until the plan is done or something stops it, and `finish` (the summary, the Events,
//! the lock given up). What each node's step does is `node.rs`; what the plan allows,
//! `plan/`; what the record holds, `record/`.
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
            Next::Step(n) => {
                if let Some(end) = run.step(*n).await {
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
    /// The interrupted step to finish first.
    pending: Option<InFlight>,
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
}

/// A node to step: the cluster as read, the step, its revision (hash, number), and the
/// interrupted step it finishes.
struct NextStep {
    view: ClusterView,
    st: PlannedStep,
    target: (String, i64),
    resumed: Option<InFlight>,
}

enum Next {
    Step(Box<NextStep>),
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
        if let Some(i) = &rec.inflight {
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
                first.as_ref().map(|p| p.len()).unwrap_or(0) + usize::from(rec.inflight.is_some())
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
        if let Some(i) = self.pending.take() {
            let st = resumed_step(&i);
            let target = (i.revision.clone(), i.revision_number);
            return Next::Step(Box::new(NextStep {
                view,
                st,
                target,
                resumed: Some(i),
            }));
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
            Ok(steps) => match steps.into_iter().next() {
                Some(s)
                    if self.stepped.contains(&s.node)
                        && self.opts.again.as_deref() != Some(s.node.as_str())
                        && view
                            .pods
                            .iter()
                            .any(|p| p.node == s.node && p.revision == cur.0) =>
                {
                    // Stepped and passed in this run, yet its agent does not vouch for the
                    // pod's start: never stepped round and round.
                    let why = format!(
                        "node {} was stepped in this run and its verdict passed, but its agent does not prove the current pod's start ({}): stopping instead of stepping it again",
                        s.node, s.why
                    );
                    c.event(&self.ds, true, "StepguardRolloutStopped", &why)
                        .await;
                    Next::End(ExitCode::NotDecided, Some(why))
                }
                Some(st) => Next::Step(Box::new(NextStep {
                    view,
                    st,
                    target: cur,
                    resumed: None,
                })),
                None => Next::End(ExitCode::Ok, None),
            },
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

    /// Steps one node and records its outcome (a failure halts the rollout on the lock
    /// before anything else happens); the run's end when it stops here.
    async fn step(&mut self, n: NextStep) -> Option<End> {
        let NextStep {
            view,
            st,
            target,
            resumed,
        } = n;
        let (c, json_out) = (self.c, self.json_out);
        self.waiting = Waiting::default();
        if !self.results.is_empty() && !st.pause_before.is_zero() {
            say(
                json_out,
                format!(
                    "pausing {}s before {} ({})",
                    st.pause_before.as_secs(),
                    st.node,
                    st.why
                ),
            );
            tokio::time::sleep(st.pause_before).await;
        }
        let cx = StepCx {
            c,
            ds: &self.ds,
            held: &self.held,
            shared: &self.shared,
            run_id: &self.run_id,
            n: self.results.len() + 1,
            json_out,
        };
        let r = step_node(&cx, &view, &st, target.clone(), resumed).await;
        if let Outcome::Deferred { why } = &r.outcome {
            // Nothing was deleted: the node is planned again from what its agent says.
            say(json_out, format!("{}: {why}; re-planning", st.node));
            crate::locks::lock(&self.shared).inflight = None;
            persist(c, &self.shared, &self.held).await;
            self.deferred += 1;
            if self.deferred > 20 {
                return Some((
                    ExitCode::NotDecided,
                    Some(format!("node {} could not be begun: {why}", st.node)),
                ));
            }
            return None;
        }
        self.deferred = 0;
        let stop = !matches!(r.outcome, Outcome::Passed { .. });
        if !stop {
            self.stepped.insert(st.node.clone());
        }
        let mut code = ExitCode::Ok;
        {
            let mut rec = crate::locks::lock(&self.shared);
            match &r.outcome {
                Outcome::Passed { .. } => {
                    rec.inflight = None;
                    if rec.retry.as_deref() == Some(st.node.as_str()) {
                        rec.retry = None;
                    }
                }
                Outcome::Failed { step, why } => {
                    code = ExitCode::Failed;
                    rec.inflight = None;
                    rec.retry = None;
                    rec.halt = Some(record::Halt {
                        node: st.node.clone(),
                        step: step.clone(),
                        revision: target.0.clone(),
                        reason: why.clone(),
                        at: stamp(),
                    });
                }
                Outcome::Stopped { .. } => code = ExitCode::NotDecided,
                Outcome::Deferred { .. } => {}
            }
        }
        if let Outcome::Failed { .. } = &r.outcome {
            // The halt is on the lock before anything else happens (release may not get
            // through; a later run must see it).
            persist(c, &self.shared, &self.held).await;
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
        } else if !stop {
            persist(c, &self.shared, &self.held).await;
        }
        self.results.push(r);
        stop.then_some((code, None))
    }

    /// Ends the run: the summary told (an Event, the output), the end kept on the record,
    /// then the lock given up.
    async fn finish(self, code: ExitCode, ending: Option<String>) -> Result<ExitCode> {
        let (c, results) = (self.c, &self.results);
        let summary = match code {
            ExitCode::Ok => format!(
                "stepguard rollout finished: {} nodes stepped and verified",
                self.stepped.len()
            ),
            ExitCode::Failed => match (&ending, results.last()) {
                (Some(e), _) => format!(
                    "stepguard rollout halted: {e}; no further node is touched until a person decides"
                ),
                (None, last) => format!(
                    "stepguard rollout halted: the step on {} failed; no further node is touched until a person decides (`--retry`, `--skip`, `--abort`)",
                    last.map(|r| r.node.as_str()).unwrap_or("?")
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
