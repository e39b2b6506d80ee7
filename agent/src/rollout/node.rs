//! One node's step: begin it on the node's agent, delete the cilium pod under a UID
//! precondition, follow the replacement and the verdict through the state machine
//! (`machine.rs`), the record on the lock kept current throughout.
use super::*;

/// What every step of a run shares.
pub(super) struct StepCx<'a> {
    pub(super) c: &'a Cluster,
    pub(super) ds: &'a DaemonSet,
    pub(super) held: &'a Held,
    pub(super) shared: &'a Mutex<Record>,
    pub(super) run_id: &'a str,
    pub(super) n: usize,
    pub(super) json_out: bool,
    /// Set by the first step of the batch that fails (its node and why): the batch's nodes
    /// not yet deleted are then not deleted.
    pub(super) halting: &'a Mutex<Option<String>>,
    /// The batch's steps still to be begun (a resumed step begins nothing).
    pub(super) begins_left: &'a std::sync::atomic::AtomicUsize,
    /// The batch's size, and whether its begun steps were told (one Event for a batch).
    pub(super) batch: usize,
    pub(super) begun_told: &'a AtomicBool,
}

pub(super) async fn step_node(
    cx: &StepCx<'_>,
    view: &ClusterView,
    st: &PlannedStep,
    target: (String, i64),
    resumed: Option<InFlight>,
) -> NodeResult {
    let t0 = Instant::now();
    let c = cx.c;
    let (n, json_out) = (cx.n, cx.json_out);
    let lost = &cx.held.lost;
    let mut st = st.clone();
    let result = |st: &PlannedStep, outcome: Outcome, stages: &Stages| NodeResult {
        node: st.node.clone(),
        why: st.why.clone(),
        moves: st.moves.clone(),
        outcome,
        elapsed_s: t0.elapsed().as_secs_f64(),
        replacement: stages.durations(),
        blip: st.blip.clone(),
    };
    let stages = Stages::default();
    let sel = Cluster::selector(cx.ds);
    let agent = match view
        .agents
        .get(&st.node)
        .ok_or_else(|| anyhow::anyhow!("no stepguard agent on node {}", st.node))
        .and_then(|url| c.agent(url))
    {
        Ok(a) => a,
        Err(e) => {
            let why = format!("cannot reach the node's agent to verify the step: {e:#}");
            // The batch's other steps neither wait for this begin nor delete after it.
            let _ = cx
                .begins_left
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| {
                    Some(v.saturating_sub(1))
                });
            halt_batch(
                cx,
                &st,
                resumed.as_ref().map(|i| i.step.clone()),
                &why,
                &target.0,
            )
            .await;
            return result(
                &st,
                Outcome::Failed {
                    step: resumed.as_ref().map(|i| i.step.clone()),
                    why,
                },
                &stages,
            );
        }
    };
    let t = Timeouts {
        replace: c.args.replace_timeout.as_secs_f64(),
        verdict: c.args.step_timeout.as_secs_f64() + 60.0,
        pull: c.args.pull_timeout.as_secs_f64(),
    };
    let forever = Duration::MAX;
    let phase = match &resumed {
        Some(i) => {
            // 200: the step is over (its verdict is in); 202: still active.
            let knows = match agent
                .call(
                    "GET",
                    &format!("/v1/steps/{}", i.step),
                    None,
                    Duration::from_secs(5),
                )
                .await
            {
                Ok((200, v)) => machine::Known::Finished {
                    saw_reload: v["reload"]["changed"]
                        .as_object()
                        .is_some_and(|c| !c.is_empty()),
                },
                Ok((202, _)) => machine::Known::Active,
                Ok((404, _)) => machine::Known::Unknown,
                _ => machine::Known::Unasked,
            };
            let old = patient(
                "read the interrupted step's pod",
                forever,
                Some(lost),
                || c.old_pod(&sel, i),
            )
            .await;
            match old {
                Ok((old, pod)) => {
                    if let Some((name, uid)) = pod {
                        st.pod = name;
                        st.pod_uid = uid;
                    }
                    let replaced = c
                        .replaced(cx.ds, &sel, &st.node, &st.pod_uid, (&target.0, target.1))
                        .await
                        .is_ok_and(|(found, _)| found.is_some());
                    machine::resume(&i.step, knows, old, replaced, now_s())
                }
                Err(e) if lost.load(Ordering::SeqCst) => Phase::Done(Outcome::Stopped {
                    why: format!("the rollout lock was lost: {e:#}"),
                }),
                Err(e) => Phase::Done(Outcome::Failed {
                    step: Some(i.step.clone()),
                    why: format!("cannot read the interrupted step's pod: {e:#}"),
                }),
            }
        }
        None => Phase::Begin,
    };
    let target_rev = target.0.clone();
    let mut live = actions::Live::new(cx, view, st, target, agent, t0);
    let outcome = match actions::drive(&mut live, phase, t).await {
        // The driver stops on a signal as on a lost lock: say which it was.
        Outcome::Stopped { .. } if TERMINATING.load(Ordering::SeqCst) && !lost.load(Ordering::SeqCst) => {
            Outcome::Stopped {
                why: "stopped by a signal: nothing more is touched; the step in flight stays on the record for the next run".into(),
            }
        }
        o => o,
    };
    let (st, stages) = (live.st, live.stages);
    if let Outcome::Failed { step, why } = &outcome {
        halt_batch(cx, &st, step.clone(), why, &target_rev).await;
    }
    let (warn, reason, msg) = match &outcome {
        Outcome::Passed { step, summary } => (
            false,
            "StepguardStepPassed",
            format!("node {}: step {step} passed: {summary}", st.node),
        ),
        Outcome::Failed { step, why } => (
            true,
            "StepguardStepFailed",
            format!(
                "node {}: step {} failed: {why}; the rollout halts here",
                st.node,
                step.as_deref().unwrap_or("-")
            ),
        ),
        Outcome::Stopped { why } => (
            true,
            "StepguardRolloutStopped",
            format!("node {}: {why}", st.node),
        ),
        Outcome::Deferred { why } => (
            false,
            "StepguardStepDeferred",
            format!("node {}: {why}; planned again", st.node),
        ),
        Outcome::Gone { why } => (
            true,
            "StepguardNodeGone",
            format!("node {}: {why}; the rollout goes on without it", st.node),
        ),
    };
    c.event(cx.ds, warn, reason, &msg).await;
    say(
        json_out,
        format!(
            "[{n:>2}] {:<20} {} ({:.1}s)",
            st.node,
            match &outcome {
                Outcome::Passed { summary, .. } => format!("passed: {summary}"),
                Outcome::Failed { why, .. } => format!("FAILED: {why}"),
                Outcome::Stopped { why } => format!("stopped: {why}"),
                Outcome::Deferred { why } => format!("deferred: {why}"),
                Outcome::Gone { why } => format!("gone: {why}"),
            },
            t0.elapsed().as_secs_f64()
        ),
    );
    result(&st, outcome, &stages)
}

/// A step of the batch failed: the batch's other nodes delete nothing more, and (in a batch)
/// the halt is on the lock at once, before the other verdicts are in (the run completes it
/// with every node of the batch; a stepper stopped meanwhile leaves it standing).
async fn halt_batch(
    cx: &StepCx<'_>,
    st: &PlannedStep,
    step: Option<String>,
    why: &str,
    revision: &str,
) {
    {
        let mut h = crate::locks::lock(cx.halting);
        if h.is_some() {
            return;
        }
        *h = Some(format!("node {} of the batch failed: {why}", st.node));
    }
    if cx.batch > 1 {
        {
            let mut rec = crate::locks::lock(cx.shared);
            rec.end(&st.node);
            if rec.halt.is_none() {
                rec.halt = Some(record::Halt {
                    node: st.node.clone(),
                    step,
                    revision: revision.to_string(),
                    reason: why.to_string(),
                    at: stamp(),
                    batch: vec![format!(
                        "{}: failed: {why} (the batch's other verdicts awaited)",
                        st.node
                    )],
                });
            }
        }
        persist(cx.c, cx.shared, cx.held).await;
    }
}
