//! A node's step, driven: the state machine (`machine.rs`) says what to do next, and the
//! actions are performed through one interface, [`Actions`]. The stepper performs them on the
//! cluster and the node's agent ([`Live`]); the tests below drive the same loop through a
//! scripted implementation.
use super::*;

/// What a node's step does, one action at a time.
pub(super) trait Actions {
    /// The lock is lost: every phase then ends as stopped, nothing more is touched.
    fn lock_lost(&self) -> bool;
    /// Now, in seconds (the machine's timeouts).
    fn now(&self) -> f64;
    /// The phase about to be acted on (to tell people).
    fn show(&mut self, phase: &Phase);
    async fn begin_step(&mut self) -> Event;
    /// Whether the pod may be deleted now (the DaemonSet read again right before, the
    /// batch's other steps not failed); the step's outcome, nothing deleted, otherwise.
    async fn may_delete(&mut self) -> Result<(), Outcome>;
    async fn delete_pod(&mut self) -> Event;
    async fn find_replacement(&mut self) -> Event;
    async fn wait_verdict(&mut self, step: &str) -> Event;
}

/// Runs a node's step from `phase` to its outcome.
pub(super) async fn drive<A: Actions>(a: &mut A, mut phase: Phase, t: Timeouts) -> Outcome {
    loop {
        // Decided (also by a lost lock, which turns every phase into Done): nothing more to do.
        if let Phase::Done(o) = phase {
            return o;
        }
        a.show(&phase);
        let ev = if a.lock_lost() {
            Event::LockLost
        } else {
            match machine::action(&phase) {
                machine::Action::BeginStep => a.begin_step().await,
                machine::Action::DeletePod => match a.may_delete().await {
                    Ok(()) => a.delete_pod().await,
                    Err(o) => return o,
                },
                machine::Action::FindReplacement => a.find_replacement().await,
                machine::Action::WaitVerdict { step } => a.wait_verdict(&step).await,
                machine::Action::Finished => continue,
            }
        };
        phase = machine::advance(phase, ev, a.now(), t);
    }
}

/// The stepper's actions: the node's agent over HTTP, the cluster through kube.
pub(super) struct Live<'a, 'b> {
    pub(super) cx: &'a StepCx<'b>,
    pub(super) view: &'a ClusterView,
    pub(super) st: PlannedStep,
    pub(super) target: (String, i64),
    pub(super) agent: crate::client::Agent,
    pub(super) sel: String,
    pub(super) stages: Stages,
    pub(super) t0: Instant,
    /// The verdict's polls: at most two a second, and not before the agent's Retry-After.
    pace: crate::client::Pace,
    retry_after: Option<Duration>,
    step_id: String,
    /// A newer revision the replacement carries (told once).
    carried: Option<String>,
    last_shown: String,
    /// Replacement polls that found none (the node's presence is read every tenth).
    empty_polls: usize,
}

impl<'a, 'b> Live<'a, 'b> {
    pub(super) fn new(
        cx: &'a StepCx<'b>,
        view: &'a ClusterView,
        st: PlannedStep,
        target: (String, i64),
        agent: crate::client::Agent,
        t0: Instant,
    ) -> Self {
        // The run id first: a long node name is cut, never the part that makes the id new.
        let step_id = format!("rollout-{}-{}-{}", cx.run_id, target.0, st.node)
            .chars()
            .filter(|ch| ch.is_ascii_alphanumeric() || "-_.".contains(*ch))
            .take(64)
            .collect::<String>();
        Live {
            cx,
            view,
            st,
            target,
            agent,
            sel: Cluster::selector(cx.ds),
            stages: Stages::default(),
            t0,
            pace: crate::client::Pace::default(),
            retry_after: None,
            step_id,
            carried: None,
            last_shown: String::new(),
            empty_polls: 0,
        }
    }

    fn line(&self, what: &str) {
        say(
            self.cx.json_out,
            format!(
                "[{:>2}] {:<20} {what} ({:.1}s)",
                self.cx.n,
                self.st.node,
                self.t0.elapsed().as_secs_f64()
            ),
        );
    }
}

impl Live<'_, '_> {
    /// Waits (long-polls) until step `id` on the node's agent is over, at most its timeout
    /// and a minute; what was seen.
    async fn wait_active(&mut self, id: &str) -> String {
        let limit = self.cx.c.args.step_timeout + Duration::from_secs(60);
        let t0 = Instant::now();
        while t0.elapsed() < limit && !self.lock_lost() {
            match self
                .agent
                .call(
                    "GET",
                    &format!("/v1/steps/{id}?wait=20s"),
                    None,
                    Duration::from_secs(30),
                )
                .await
            {
                Ok((200, v)) => {
                    return format!(
                        "it ended {}",
                        v["verdict"]["status"].as_str().unwrap_or("?")
                    )
                }
                Ok((404, _)) => return "it is gone".into(),
                Ok((202, _)) => {}
                _ => tokio::time::sleep(Duration::from_secs(1)).await,
            }
        }
        format!("still active after {:.0}s", t0.elapsed().as_secs_f64())
    }
}

impl Actions for Live<'_, '_> {
    fn lock_lost(&self) -> bool {
        self.cx.held.lost.load(Ordering::SeqCst) || TERMINATING.load(Ordering::SeqCst)
    }

    fn now(&self) -> f64 {
        now_s()
    }

    fn show(&mut self, phase: &Phase) {
        let shown = match phase {
            Phase::Begin => "beginning the step".to_string(),
            Phase::Delete { step } => format!("deleting pod {} (step {step})", self.st.pod),
            Phase::Replace { .. } => "waiting for the replacement pod".to_string(),
            Phase::Verdict { .. } => "waiting for the verdict".to_string(),
            Phase::Done(_) => String::new(),
        };
        if shown != self.last_shown && !shown.is_empty() {
            self.line(&shown);
            self.last_shown = shown;
        }
    }

    async fn begin_step(&mut self) -> Event {
        let (c, cx, st) = (self.cx.c, self.cx, &self.st);
        let mut body = json!({
            "id": self.step_id,
            "settle": format!("{}ms", c.args.settle.as_millis()),
            "timeout": format!("{}ms", c.args.step_timeout.as_millis()),
        });
        let mut expect = serde_json::Map::new();
        if let Some(v) = &self.view.cilium_version {
            expect.insert("cilium".into(), json!(v));
        }
        if let Some(d) = &c.args.expect_devices {
            expect.insert("devices".into(), json!(d));
        }
        if let Some(g) = &c.args.expect_gone {
            expect.insert("gone".into(), json!(g));
        }
        if !expect.is_empty() {
            body["expect"] = Value::Object(expect);
        }
        if !c.args.witnesses.is_empty() {
            body["witnesses"] = json!(c.args.witnesses);
        }
        // The id is idempotent: a begin that got no answer is asked again.
        let mut r = Err(anyhow::anyhow!("not asked"));
        for attempt in 0..3 {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            r = self
                .agent
                .call(
                    "POST",
                    "/v1/steps",
                    Some(body.clone()),
                    Duration::from_secs(60),
                )
                .await;
            if !matches!(&r, Err(_) | Ok((503, _))) {
                break;
            }
        }
        // This node's begin is over (begun or not): the batch's record is written once all are.
        let _ = cx
            .begins_left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| {
                Some(v.saturating_sub(1))
            });
        if let Ok((409, v)) = &r {
            if let Some(active) = v["active_id"].as_str().filter(|a| *a != self.step_id) {
                // Another step is active on the node (an implicit step after a restart
                // nobody stepped, or an orphan of an earlier run): its verdict may be this
                // pod's proof. Waited for, nothing deleted; the node is then planned again.
                let active = active.to_string();
                self.line(&format!(
                    "step {active} is active on the node's agent: waiting for its verdict before planning the node again"
                ));
                let seen = self.wait_active(&active).await;
                return Event::Busy(format!(
                    "step {active} was active on the node's agent ({seen})"
                ));
            }
        }
        let ev = Event::Begun(match r {
            Ok((200 | 201, v)) => v["id"]
                .as_str()
                .map(String::from)
                .ok_or_else(|| "no step id".to_string()),
            Ok((s, v)) => Err(format!(
                "agent answered {s}: {}",
                v["error"].as_str().unwrap_or("")
            )),
            Err(e) => Err(format!("{e:#}")),
        });
        if let Event::Begun(Ok(id)) = &ev {
            // Recorded before the pod is deleted: a resumed run finishes this step.
            crate::locks::lock(cx.shared).begin(InFlight {
                node: st.node.clone(),
                step: id.clone(),
                pod: st.pod.clone(),
                pod_uid: st.pod_uid.clone(),
                revision: self.target.0.clone(),
                revision_number: self.target.1,
                why: st.why.clone(),
            });
            // The batch's steps are all begun (or refused) before the record is written: one
            // write carries them all (bounded: a begin is a minute at most).
            let t0 = Instant::now();
            while cx.begins_left.load(Ordering::SeqCst) > 0
                && t0.elapsed() < Duration::from_secs(180)
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if persist(c, cx.shared, cx.held).await {
                if cx.batch == 1 {
                    c.event(
                        cx.ds,
                        false,
                        "StepguardStepBegun",
                        &format!(
                            "node {}: step {id} begun ({}); deleting pod {}",
                            st.node, st.why, st.pod
                        ),
                    )
                    .await;
                } else if !cx.begun_told.swap(true, Ordering::SeqCst) {
                    // A batch tells its begun steps in one Event (each node's outcome has its own).
                    let begun = crate::locks::lock(cx.shared)
                        .inflight
                        .iter()
                        .map(|i| format!("{} (step {}, pod {})", i.node, i.step, i.pod))
                        .collect::<Vec<_>>()
                        .join(", ");
                    c.event(
                        cx.ds,
                        false,
                        "StepguardBatchBegun",
                        &format!(
                            "batch of {}: steps begun on {begun}; deleting their pods",
                            cx.batch
                        ),
                    )
                    .await;
                }
            }
        }
        ev
    }

    async fn may_delete(&mut self) -> Result<(), Outcome> {
        if let Some(o) = self.held_back().await {
            return Err(o);
        }
        self.may_delete_now()
            .await
            .map_err(|why| Outcome::Stopped { why })
    }

    async fn delete_pod(&mut self) -> Event {
        // Read again right before the delete: another node of the batch may have failed
        // while this one read the DaemonSet.
        if let Some(Outcome::Deferred { why }) = self.held_back().await {
            return Event::NotDeleted(why);
        }
        self.delete_now().await
    }

    async fn find_replacement(&mut self) -> Event {
        let c = self.cx.c;
        // The replacement's stage, shown and timed as it changes.
        let (found, now_stage) = c
            .replaced(
                self.cx.ds,
                &self.sel,
                &self.st.node,
                &self.st.pod_uid,
                (&self.target.0, self.target.1),
            )
            .await
            .unwrap_or((None, None));
        if let Some(stg) = now_stage {
            if self.stages.enter(&stg, now_s()) {
                let line = if stg == Stage::Ready {
                    format!("replacement Ready: {}", self.stages.summary())
                } else {
                    format!("replacement: {}", stg.label())
                };
                self.line(&line);
            }
        }
        if found.is_none() {
            self.empty_polls += 1;
            if self.empty_polls.is_multiple_of(10) {
                if let Some(why) = c.node_gone(&self.st.node).await {
                    return Event::NodeGone {
                        why,
                        replacement_seen: self.stages.seen(),
                    };
                }
            }
        }
        match &found {
            None => tokio::time::sleep(Duration::from_millis(500)).await,
            Some(h) if *h != self.target.0 && self.carried.is_none() => {
                self.line(&format!(
                    "the replacement carries revision {h}, newer than the step's {}: the template changed before it was created",
                    self.target.0
                ));
                self.carried = Some(h.clone());
            }
            Some(_) => {}
        }
        match self.stages.pulling_since() {
            Some(started) if found.is_none() => Event::Pulling { started },
            _ => Event::Replaced(found.is_some()),
        }
    }

    async fn wait_verdict(&mut self, step: &str) -> Event {
        self.pace.wait(self.retry_after.take()).await;
        let r = self
            .agent
            .call_paced(
                "GET",
                &format!("/v1/steps/{step}?wait=20s"),
                None,
                Duration::from_secs(30),
            )
            .await;
        let r = r.map(|(s, v, ra)| {
            self.retry_after = ra;
            (s, v)
        });
        match r {
            Ok((200, v)) => {
                let reasons: Vec<&str> = v["verdict"]["reasons"]
                    .as_array()
                    .map(|a| a.iter().filter_map(|r| r.as_str()).collect())
                    .unwrap_or_default();
                let summary = v["verdict"]["summary"].as_str().unwrap_or("");
                // A pass's warnings (`kept_state_lost`) lead its line, as reasons lead a
                // failure's.
                let warnings: Vec<&str> = v["verdict"]["warnings"]
                    .as_array()
                    .map(|a| a.iter().filter_map(|r| r.as_str()).collect())
                    .unwrap_or_default();
                let reasons: Vec<&str> = reasons.into_iter().chain(warnings).collect();
                Event::Verdict(Ok(Some((
                    v["verdict"]["status"].as_str().unwrap_or("?").to_string(),
                    if reasons.is_empty() {
                        summary.to_string()
                    } else {
                        format!("{} — {summary}", reasons.join(", "))
                    },
                ))))
            }
            Ok((202, _)) => Event::Verdict(Ok(None)),
            Ok((s, v)) => {
                self.retry_after = self.retry_after.or(Some(Duration::from_secs(1)));
                Event::Verdict(Err(format!("agent answered {s}: {v}")))
            }
            Err(e) => {
                // An agent that cannot be reached may have left with its node.
                if let Some(why) = self.cx.c.node_gone(&self.st.node).await {
                    return Event::NodeGone {
                        why,
                        replacement_seen: true,
                    };
                }
                self.retry_after = Some(Duration::from_secs(1));
                Event::Verdict(Err(format!("{e:#}")))
            }
        }
    }
}

impl Live<'_, '_> {
    /// When another node of the batch failed: this node's pod is not deleted, and the step
    /// begun on its agent is ended (DELETE) so it leaves no verdict behind; the node is
    /// planned again once a person decided. None: go on.
    async fn held_back(&mut self) -> Option<Outcome> {
        let why = crate::locks::lock(self.cx.halting).clone()?;
        let step = self.step_id.clone();
        let ended = self
            .agent
            .call(
                "DELETE",
                &format!("/v1/steps/{step}"),
                None,
                Duration::from_secs(10),
            )
            .await;
        let ended = match ended {
            Ok((200 | 204 | 404, _)) => String::new(),
            Ok((s, v)) => format!(" (ending step {step} on its agent: {s} {v})"),
            Err(e) => format!(" (ending step {step} on its agent: {e:#})"),
        };
        Some(Outcome::Deferred {
            why: format!("{why}; pod {} kept{ended}", self.st.pod),
        })
    }

    /// Deletes the pod (UID precondition), the lock renewed right before.
    async fn delete_now(&mut self) -> Event {
        let (c, cx) = (self.cx.c, self.cx);
        let (pod, uid) = (&self.st.pod, &self.st.pod_uid);
        let halting = cx.halting;
        // Right before the delete, the lock is renewed (it is ours now, not only as of the
        // last renewal: a stepper paused since then may have lost it), and the batch is read
        // again (a retried delete after another node failed is not made).
        let r = patient(
            "delete the cilium pod",
            c.args.replace_timeout,
            Some(&cx.held.lost),
            || async {
                if !persist(c, cx.shared, cx.held).await {
                    return Err(
                        anyhow::anyhow!("the rollout lock was lost before the delete").into(),
                    );
                }
                if let Some(why) = crate::locks::lock(halting).clone() {
                    return Err(anyhow::anyhow!("{why}").into());
                }
                c.delete_pod(pod, uid).await
            },
        )
        .await;
        match r {
            Err(_) if cx.held.is_lost() => Event::LockLost,
            // Not deleted, and another node of the batch failed meanwhile: held back.
            Err(e) => match self.held_back().await {
                Some(Outcome::Deferred { why }) => Event::NotDeleted(why),
                _ => Event::Deleted(Err(format!("{e:#}"))),
            },
            Ok(d) => Event::Deleted(Ok(d)),
        }
    }
}

impl Live<'_, '_> {
    /// Whether the delete may go on: the revision it would start, read right before.
    async fn may_delete_now(&mut self) -> Result<(), String> {
        let c = self.cx.c;
        // A template edited but not yet observed by the controller has no revision yet: the
        // delete waits for it (bounded), or the highest revision would not be the one the
        // replacement is made from.
        let t0 = Instant::now();
        let (ds, numbers) = loop {
            let fresh = patient(
                "read the DaemonSet before the delete",
                Duration::from_secs(60),
                Some(&self.cx.held.lost),
                || async { c.before_delete().await },
            )
            .await;
            let (ds, numbers) = match fresh {
                Ok(f) => f,
                Err(e) => {
                    return Err(format!(
                        "cannot read the DaemonSet right before the delete: {e:#}"
                    ))
                }
            };
            let observed =
                ds.status.as_ref().and_then(|s| s.observed_generation) >= ds.metadata.generation;
            if observed {
                break (ds, numbers);
            }
            if t0.elapsed() > Duration::from_secs(30) {
                return Err(format!(
                    "the DaemonSet's template changed and its controller has not observed it for {:.0}s: pod {} not deleted",
                    t0.elapsed().as_secs_f64(),
                    self.st.pod
                ));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        let current = numbers
            .iter()
            .max_by_key(|(_, n)| **n)
            .map(|(h, _)| h.clone())
            .unwrap_or_default();
        let (approved, _) = c.approval_now(&ds, &current, self.view).await;
        may_delete_on(&self.target.0, &current, approved.as_deref(), &self.st.pod)
    }
}

/// Whether a step targeting revision `target` may delete `pod` while the DaemonSet's
/// current revision is `current` (read right before), approved as `approved`.
pub(super) fn may_delete_on(
    target: &str,
    current: &str,
    approved: Option<&str>,
    pod: &str,
) -> Result<(), String> {
    if record::may_adopt(target, current, approved) {
        return Ok(());
    }
    // The DaemonSet moved to a revision nobody approved since the step was planned:
    // deleting now would start that revision.
    Err(format!(
        "the DaemonSet moved to revision {} (not approved) before pod {pod} was deleted: paused; approve it to go on",
        if current.is_empty() { "?" } else { current },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The delete is judged by the revision read right before it: a template changed since
    /// the plan (unapproved) stops the step before the pod is touched.
    #[test]
    fn the_revision_is_read_again_right_before_the_delete() {
        assert!(may_delete_on("r2", "r2", None, "p").is_ok());
        assert!(may_delete_on("r2", "r3", Some("r3"), "p").is_ok());
        let e = may_delete_on("r2", "r3", None, "cilium-x").unwrap_err();
        assert!(
            e.contains("revision r3 (not approved) before pod cilium-x"),
            "{e}"
        );
    }

    /// Actions played from a script: what each call answers, and the calls made. An imitation
    /// on purpose: these tests pin the driver's order and its stops (a lost lock between two
    /// calls, a refused delete) exactly; the live actions against the real API server,
    /// controller and agents are `tests/lab/tests/rollout.rs`.
    struct Scripted {
        events: std::collections::VecDeque<Event>,
        calls: Vec<String>,
        now: f64,
        /// The lock is lost once this many calls were made.
        lost_after: Option<usize>,
        refuse_delete: Option<String>,
    }

    impl Scripted {
        fn new(events: Vec<Event>) -> Self {
            Scripted {
                events: events.into(),
                calls: vec![],
                now: 0.0,
                lost_after: None,
                refuse_delete: None,
            }
        }
        fn next(&mut self, call: &str) -> Event {
            self.calls.push(call.to_string());
            self.now += 1.0;
            self.events.pop_front().unwrap_or(Event::Tick)
        }
    }

    impl Actions for Scripted {
        fn lock_lost(&self) -> bool {
            self.lost_after.is_some_and(|n| self.calls.len() >= n)
        }
        fn now(&self) -> f64 {
            self.now
        }
        fn show(&mut self, _phase: &Phase) {}
        async fn begin_step(&mut self) -> Event {
            self.next("begin")
        }
        async fn may_delete(&mut self) -> Result<(), Outcome> {
            self.refuse_delete
                .clone()
                .map_or(Ok(()), |why| Err(Outcome::Stopped { why }))
        }
        async fn delete_pod(&mut self) -> Event {
            self.next("delete")
        }
        async fn find_replacement(&mut self) -> Event {
            self.next("replacement")
        }
        async fn wait_verdict(&mut self, step: &str) -> Event {
            self.next(&format!("verdict {step}"))
        }
    }

    const T: Timeouts = Timeouts {
        replace: 100.0,
        verdict: 100.0,
        pull: 100.0,
    };

    fn run(a: &mut Scripted, from: Phase) -> Outcome {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(drive(a, from, T))
    }

    #[test]
    fn a_step_is_begun_deleted_replaced_and_judged_in_that_order() {
        let mut a = Scripted::new(vec![
            Event::Begun(Ok("s1".into())),
            Event::Deleted(Ok(true)),
            Event::Replaced(false),
            Event::Replaced(true),
            Event::Verdict(Ok(None)),
            Event::Verdict(Ok(Some(("passed".into(), "gap 0.3s".into())))),
        ]);
        let o = run(&mut a, Phase::Begin);
        assert_eq!(
            o,
            Outcome::Passed {
                step: "s1".into(),
                summary: "gap 0.3s".into()
            }
        );
        assert_eq!(
            a.calls,
            [
                "begin",
                "delete",
                "replacement",
                "replacement",
                "verdict s1",
                "verdict s1"
            ]
        );
    }

    #[test]
    fn a_lost_lock_touches_nothing_more() {
        let mut a = Scripted::new(vec![
            Event::Begun(Ok("s1".into())),
            Event::Deleted(Ok(true)),
        ]);
        a.lost_after = Some(1);
        let o = run(&mut a, Phase::Begin);
        assert!(matches!(o, Outcome::Stopped { .. }), "{o:?}");
        assert_eq!(a.calls, ["begin"], "no delete after the lock was lost");
    }

    #[test]
    fn a_refused_delete_stops_before_the_pod_is_touched() {
        let mut a = Scripted::new(vec![]);
        a.refuse_delete = Some("the DaemonSet moved".into());
        let o = run(&mut a, Phase::Delete { step: "s1".into() });
        assert_eq!(
            o,
            Outcome::Stopped {
                why: "the DaemonSet moved".into()
            }
        );
        assert!(a.calls.is_empty(), "{:?}", a.calls);
    }

    #[test]
    fn a_failed_begin_ends_the_step_without_a_delete() {
        let mut a = Scripted::new(vec![Event::Begun(Err("agent answered 409".into()))]);
        let o = run(&mut a, Phase::Begin);
        assert!(matches!(o, Outcome::Failed { step: None, .. }), "{o:?}");
        assert_eq!(a.calls, ["begin"]);
    }
}
