//! Stepping one node, as a pure state machine: the driver performs the action the machine
//! asks for and feeds back what happened; the machine decides. Every path (refusals aside,
//! which `plan` decides) is tested here: failures in each phase, timeouts, the lock lost,
//! and resuming an interrupted step without repeating it.
use serde::Serialize;
use std::collections::BTreeMap;

/// Where a node's step is.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "phase", rename_all = "snake_case")]
pub enum Phase {
    /// Begin a step on the node's agent.
    Begin,
    /// Delete the node's cilium pod (UID precondition).
    Delete {
        step: String,
    },
    /// Wait for the replacement pod to be Ready on the current revision.
    Replace {
        step: String,
        since: f64,
    },
    /// Wait for the agent's verdict.
    Verdict {
        step: String,
        since: f64,
    },
    Done(Outcome),
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    Passed {
        step: String,
        summary: String,
    },
    /// The step failed or could not be done: the rollout stops here.
    Failed {
        step: Option<String>,
        why: String,
    },
    /// The lock was lost or the stepper was told to stop: nothing more is touched.
    Stopped {
        why: String,
    },
    /// Nothing was deleted and no verdict of this step can prove the node: the node is
    /// planned again from what its agent says (another step was active on it; an
    /// interrupted step that is already over).
    Deferred {
        why: String,
    },
    /// The node left the cluster (its Node object was deleted) during the step: no verdict
    /// can prove it and none is owed; the rollout goes on without it.
    Gone {
        why: String,
    },
}

/// What the driver must do next.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    BeginStep,
    DeletePod,
    /// Look for the replacement pod (poll).
    FindReplacement,
    /// Ask the agent for the verdict (long-poll).
    WaitVerdict {
        step: String,
    },
    Finished,
}

/// What happened.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Begun(Result<String, String>),
    /// The agent refused the begin because another step is active there; the stepper waited
    /// for that step to end (what it saw).
    Busy(String),
    /// `Ok(true)`: deleted; `Ok(false)`: already gone (a resumed step); `Err`: refused (e.g. the
    /// UID precondition failed: another pod is there now).
    Deleted(Result<bool, String>),
    /// A Ready pod on the current revision replaced the old one.
    Replaced(bool),
    /// The replacement is there, its image being pulled since `started` (seconds): the time
    /// a pull takes is `--pull-timeout`'s, not `--replace-timeout`'s, which starts once the
    /// image is there.
    Pulling {
        started: f64,
    },
    /// `Ok(Some((status, summary)))` decided; `Ok(None)` not yet; `Err` unreachable.
    Verdict(Result<Option<(String, String)>, String>),
    /// Time passes (timeouts).
    Tick,
    LockLost,
    /// The node's Node object is gone (what was read), and whether a replacement pod had been
    /// created for it before (one that never turned Ready may be why the node was removed:
    /// an auto-repair of a node the new revision broke).
    NodeGone {
        why: String,
        replacement_seen: bool,
    },
    /// The pod was not deleted after all (another node of the batch failed meanwhile): why.
    NotDeleted(String),
}

/// Phase timeouts (seconds).
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    pub replace: f64,
    pub verdict: f64,
    pub pull: f64,
}

/// The action a phase asks for.
pub fn action(p: &Phase) -> Action {
    match p {
        Phase::Begin => Action::BeginStep,
        Phase::Delete { .. } => Action::DeletePod,
        Phase::Replace { .. } => Action::FindReplacement,
        Phase::Verdict { step, .. } => Action::WaitVerdict { step: step.clone() },
        Phase::Done(_) => Action::Finished,
    }
}

fn failed(step: Option<&str>, why: impl Into<String>) -> Phase {
    Phase::Done(Outcome::Failed {
        step: step.map(String::from),
        why: why.into(),
    })
}

/// Advances a node's step by one event at time `now`.
pub fn advance(p: Phase, ev: Event, now: f64, t: Timeouts) -> Phase {
    if ev == Event::LockLost {
        return match p {
            Phase::Done(o) => Phase::Done(o),
            _ => Phase::Done(Outcome::Stopped {
                why: "the rollout lock was lost (another stepper, or the API server refused the renewal): nothing more is touched".into(),
            }),
        };
    }
    match (p, ev) {
        // A node that left the cluster after its delete: its replacement never comes and its
        // agent is gone with it; nothing is owed.
        (
            Phase::Replace { step, .. },
            Event::NodeGone {
                why,
                replacement_seen: true,
            },
        ) => failed(
            Some(&step),
            format!(
                "{why}, after its replacement cilium pod was created and before it turned Ready"
            ),
        ),
        (
            Phase::Replace { step, .. } | Phase::Verdict { step, .. },
            Event::NodeGone { why, .. },
        ) => Phase::Done(Outcome::Gone {
            why: format!("step {step}: {why}"),
        }),
        (Phase::Delete { .. }, Event::NotDeleted(why)) => Phase::Done(Outcome::Deferred { why }),
        (Phase::Begin, Event::Begun(Ok(step))) => Phase::Delete { step },
        (Phase::Begin, Event::Busy(why)) => Phase::Done(Outcome::Deferred { why }),
        (Phase::Begin, Event::Begun(Err(e))) => failed(
            None,
            format!("could not begin a step on the node's agent: {e}"),
        ),
        (Phase::Delete { step }, Event::Deleted(Ok(_))) => Phase::Replace { step, since: now },
        (Phase::Delete { step }, Event::Deleted(Err(e))) => {
            failed(Some(&step), format!("could not delete the cilium pod: {e}"))
        }
        (Phase::Replace { step, .. }, Event::Replaced(true)) => Phase::Verdict { step, since: now },
        (Phase::Replace { step, .. }, Event::Pulling { started }) => {
            if now - started > t.pull {
                failed(
                    Some(&step),
                    format!(
                        "the replacement's image was still being pulled after {:.0}s (--pull-timeout)",
                        t.pull
                    ),
                )
            } else {
                Phase::Replace { step, since: now }
            }
        }
        (Phase::Replace { step, since }, Event::Replaced(false) | Event::Tick) => {
            if now - since > t.replace {
                failed(
                    Some(&step),
                    format!(
                        "no Ready cilium pod on the current revision within {:.0}s",
                        t.replace
                    ),
                )
            } else {
                Phase::Replace { step, since }
            }
        }
        (Phase::Verdict { step, .. }, Event::Verdict(Ok(Some((status, summary))))) => {
            if status == "passed" {
                Phase::Done(Outcome::Passed { step, summary })
            } else {
                failed(Some(&step), format!("step {status}: {summary}"))
            }
        }
        (Phase::Verdict { step, since }, Event::Verdict(Ok(None) | Err(_)) | Event::Tick) => {
            if now - since > t.verdict {
                failed(
                    Some(&step),
                    format!("no verdict from the node's agent within {:.0}s", t.verdict),
                )
            } else {
                Phase::Verdict { step, since }
            }
        }
        (Phase::Done(o), _) => Phase::Done(o),
        // An event that does not belong to the phase changes nothing.
        (p, _) => p,
    }
}

/// The interrupted step's old pod, as the API server shows it now.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OldPod {
    /// Still there and not being deleted: the delete never happened.
    Present,
    /// Deleted, within its grace period.
    Terminating,
    Gone,
}

/// What the node's agent says of an interrupted step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Known {
    /// Active: its verdict is still to come.
    Active,
    /// Over, with a verdict; whether it saw a datapath reload (a step that saw none ended
    /// before any restart and proves nothing about one).
    Finished { saw_reload: bool },
    /// Unknown to the agent (404).
    Unknown,
    /// The agent could not be asked: the record (written after the agent began the step)
    /// stands.
    Unasked,
}

/// Where an interrupted step resumes, from what the lock recorded and what is there now:
/// what the node's agent says of the step, the old pod, whether a Ready replacement on an
/// acceptable revision is there. A step that is over before its pod was deleted, that ended
/// without seeing a reload, or that the agent no longer knows, is not resumed: nothing is
/// deleted under it and its verdict is not read as this restart's; the node is planned again,
/// and its agent's proof for the pod there then decides (a restart a step saw is judged by
/// its verdict; one nobody saw is stepped again). A step that saw the restart its delete
/// caused is resumed, its verdict read.
pub fn resume(step: &str, known: Known, old: OldPod, replaced: bool, now: f64) -> Phase {
    let known = match (known, old) {
        (Known::Finished { saw_reload: true }, OldPod::Terminating | OldPod::Gone) => Known::Active,
        (k, _) => k,
    };
    match (known, old) {
        (Known::Unknown, OldPod::Present) => Phase::Begin,
        (Known::Unknown, _) => Phase::Done(Outcome::Deferred {
            why: format!(
                "the interrupted step {step} is unknown to the node's agent and the cilium pod was already deleted: the pod there now is judged by its agent's proof"
            ),
        }),
        (Known::Finished { .. }, _) => Phase::Done(Outcome::Deferred {
            why: format!(
                "the interrupted step {step} is already over on the node's agent{}: the pod there now is judged by its agent's proof",
                if old == OldPod::Present {
                    " and its pod was never deleted"
                } else {
                    ""
                }
            ),
        }),
        (_, OldPod::Present) => Phase::Delete { step: step.into() },
        (_, _) if replaced => Phase::Verdict {
            step: step.into(),
            since: now,
        },
        _ => Phase::Replace {
            step: step.into(),
            since: now,
        },
    }
}

/// Whether a replacement pod carrying revision `hash` answers a step that targeted `target`
/// (hash, number): the target itself, or a newer revision of the DaemonSet (the template
/// changed before the controller created the pod). `numbers`: the DaemonSet's revisions.
pub fn acceptable_revision(
    hash: &str,
    target: (&str, i64),
    numbers: &BTreeMap<String, i64>,
) -> bool {
    hash == target.0 || numbers.get(hash).is_some_and(|n| *n > target.1)
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Timeouts = Timeouts {
        replace: 60.0,
        verdict: 120.0,
        pull: 300.0,
    };

    #[test]
    fn a_slow_image_pull_is_timed_by_the_pull_timeout_not_the_replace_timeout() {
        let mut p = run(&[
            (Event::Begun(Ok("s".into())), 0.0),
            (Event::Deleted(Ok(true)), 1.0),
        ]);
        // Pulling from 10 s to 250 s: longer than the replace timeout, within the pull's.
        for now in (10..=250).step_by(10) {
            p = advance(p, Event::Pulling { started: 10.0 }, now as f64, T);
            assert_eq!(action(&p), Action::FindReplacement, "at {now}s");
        }
        // The replace timeout counts from the end of the pull.
        p = advance(p, Event::Replaced(false), 300.0, T);
        assert_eq!(action(&p), Action::FindReplacement);
        let late = advance(p.clone(), Event::Replaced(false), 311.0, T);
        assert!(
            matches!(late, Phase::Done(Outcome::Failed { .. })),
            "{late:?}"
        );
        assert_eq!(
            action(&advance(p, Event::Replaced(true), 305.0, T)),
            Action::WaitVerdict { step: "s".into() }
        );
        // A pull past its own timeout fails the step, saying so.
        let p = run(&[
            (Event::Begun(Ok("s".into())), 0.0),
            (Event::Deleted(Ok(true)), 1.0),
            (Event::Pulling { started: 2.0 }, 303.0),
        ]);
        match p {
            Phase::Done(Outcome::Failed { why, .. }) => {
                assert!(why.contains("--pull-timeout"), "{why}")
            }
            p => panic!("{p:?}"),
        }
    }

    fn run(events: &[(Event, f64)]) -> Phase {
        let mut p = Phase::Begin;
        for (e, now) in events {
            p = advance(p, e.clone(), *now, T);
        }
        p
    }

    #[test]
    fn a_healthy_step_passes_through_every_phase() {
        let mut p = Phase::Begin;
        assert_eq!(action(&p), Action::BeginStep);
        p = advance(p, Event::Begun(Ok("s1".into())), 0.0, T);
        assert_eq!(action(&p), Action::DeletePod);
        p = advance(p, Event::Deleted(Ok(true)), 1.0, T);
        assert_eq!(action(&p), Action::FindReplacement);
        p = advance(p, Event::Replaced(false), 5.0, T);
        p = advance(p, Event::Replaced(true), 9.0, T);
        assert_eq!(action(&p), Action::WaitVerdict { step: "s1".into() });
        p = advance(p, Event::Verdict(Ok(None)), 20.0, T);
        p = advance(
            p,
            Event::Verdict(Ok(Some(("passed".into(), "ok".into())))),
            30.0,
            T,
        );
        assert_eq!(
            p,
            Phase::Done(Outcome::Passed {
                step: "s1".into(),
                summary: "ok".into()
            })
        );
        assert_eq!(action(&p), Action::Finished);
    }

    #[test]
    fn each_phase_can_fail_and_stops_the_rollout() {
        let f = |p: Phase| matches!(p, Phase::Done(Outcome::Failed { .. }));
        assert!(f(run(&[(Event::Begun(Err("503".into())), 0.0)])));
        assert!(f(run(&[
            (Event::Begun(Ok("s".into())), 0.0),
            (Event::Deleted(Err("uid precondition".into())), 1.0)
        ])));
        assert!(
            f(run(&[
                (Event::Begun(Ok("s".into())), 0.0),
                (Event::Deleted(Ok(true)), 1.0),
                (Event::Tick, 62.0)
            ])),
            "replacement timeout"
        );
        assert!(
            f(run(&[
                (Event::Begun(Ok("s".into())), 0.0),
                (Event::Deleted(Ok(true)), 1.0),
                (Event::Replaced(true), 2.0),
                (Event::Verdict(Err("unreachable".into())), 130.0)
            ])),
            "verdict timeout"
        );
        let p = run(&[
            (Event::Begun(Ok("s".into())), 0.0),
            (Event::Deleted(Ok(true)), 1.0),
            (Event::Replaced(true), 2.0),
            (
                Event::Verdict(Ok(Some(("failed".into(), "map_emptied".into())))),
                3.0,
            ),
        ]);
        assert_eq!(
            p,
            Phase::Done(Outcome::Failed {
                step: Some("s".into()),
                why: "step failed: map_emptied".into()
            })
        );
        // Unreachable for a while is not a failure yet.
        let p = run(&[
            (Event::Begun(Ok("s".into())), 0.0),
            (Event::Deleted(Ok(true)), 1.0),
            (Event::Replaced(true), 2.0),
            (Event::Verdict(Err("x".into())), 50.0),
        ]);
        assert!(matches!(p, Phase::Verdict { .. }));
    }

    #[test]
    fn a_lost_lock_stops_in_any_phase_but_keeps_a_decided_outcome() {
        for prefix in [0usize, 1, 2, 3] {
            let evs = [
                (Event::Begun(Ok("s".into())), 0.0),
                (Event::Deleted(Ok(true)), 1.0),
                (Event::Replaced(true), 2.0),
            ];
            let mut v: Vec<(Event, f64)> = evs[..prefix].to_vec();
            v.push((Event::LockLost, 3.0));
            assert!(
                matches!(run(&v), Phase::Done(Outcome::Stopped { .. })),
                "after {prefix} events"
            );
        }
        let done = Phase::Done(Outcome::Passed {
            step: "s".into(),
            summary: String::new(),
        });
        assert_eq!(advance(done.clone(), Event::LockLost, 0.0, T), done);
    }

    #[test]
    fn an_interrupted_step_resumes_where_it_stopped_never_twice() {
        use OldPod::*;
        assert_eq!(
            resume("s", Known::Unknown, Present, false, 0.0),
            Phase::Begin,
            "the agent lost it before anything was touched: begin anew"
        );
        for old in [Terminating, Gone] {
            assert!(
                matches!(resume("s", Known::Unknown, old, true, 0.0), Phase::Done(Outcome::Deferred { ref why }) if why.contains("agent's proof")),
                "{old:?}: the restart happened and the step is lost: the proof decides"
            );
        }
        // A step already over is never resumed under a pod it did not see go (no delete
        // under it, its verdict not read), nor when it saw no reload at all; one that saw
        // the restart its delete caused is read.
        for old in [Present, Terminating, Gone] {
            assert!(
                matches!(
                    resume("s", Known::Finished { saw_reload: false }, old, true, 0.0),
                    Phase::Done(Outcome::Deferred { .. })
                ),
                "{old:?}"
            );
        }
        assert!(matches!(
            resume(
                "s",
                Known::Finished { saw_reload: true },
                Present,
                false,
                0.0
            ),
            Phase::Done(Outcome::Deferred { .. })
        ));
        assert_eq!(
            resume("s", Known::Finished { saw_reload: true }, Gone, true, 1.0),
            Phase::Verdict {
                step: "s".into(),
                since: 1.0
            }
        );
        for knows in [Known::Active, Known::Unasked] {
            assert_eq!(
                resume("s", knows, Present, false, 0.0),
                Phase::Delete { step: "s".into() }
            );
            for old in [Terminating, Gone] {
                assert_eq!(
                    resume("s", knows, old, false, 1.0),
                    Phase::Replace {
                        step: "s".into(),
                        since: 1.0
                    },
                    "{old:?}"
                );
                assert_eq!(
                    resume("s", knows, old, true, 1.0),
                    Phase::Verdict {
                        step: "s".into(),
                        since: 1.0
                    },
                    "{old:?}"
                );
            }
        }
        // A resumed delete whose pod is already gone goes on.
        let p = advance(
            Phase::Delete { step: "s".into() },
            Event::Deleted(Ok(false)),
            2.0,
            T,
        );
        assert_eq!(
            p,
            Phase::Replace {
                step: "s".into(),
                since: 2.0
            }
        );
    }

    #[test]
    fn a_replacement_on_the_target_or_a_newer_revision_answers_the_step() {
        let numbers: BTreeMap<String, i64> = [
            ("r1".to_string(), 1),
            ("r2".to_string(), 2),
            ("r3".to_string(), 3),
        ]
        .into();
        assert!(acceptable_revision("r2", ("r2", 2), &numbers));
        assert!(
            acceptable_revision("r3", ("r2", 2), &numbers),
            "the template changed before the pod was created"
        );
        assert!(
            !acceptable_revision("r1", ("r2", 2), &numbers),
            "an older pod is no replacement"
        );
        assert!(
            !acceptable_revision("rx", ("r2", 2), &numbers),
            "an unknown revision"
        );
    }

    /// A node deleted from the cluster after its pod was: neither a failure nor a pass, and
    /// before the delete the event changes nothing (the delete's own checks decide).
    #[test]
    fn a_node_that_left_the_cluster_during_its_step_is_gone_not_failed() {
        let gone = || Event::NodeGone {
            why: "Node n1 was deleted".into(),
            replacement_seen: false,
        };
        let replacing = run(&[
            (Event::Begun(Ok("s".into())), 0.0),
            (Event::Deleted(Ok(true)), 1.0),
        ]);
        let p = advance(replacing.clone(), gone(), 5.0, T);
        assert_eq!(
            p,
            Phase::Done(Outcome::Gone {
                why: "step s: Node n1 was deleted".into()
            })
        );
        let verdict = advance(replacing, Event::Replaced(true), 2.0, T);
        assert!(matches!(
            advance(verdict, gone(), 3.0, T),
            Phase::Done(Outcome::Gone { .. })
        ));
        assert_eq!(advance(Phase::Begin, gone(), 0.0, T), Phase::Begin);
        // Its replacement was created and never turned Ready, then the node vanished (an
        // auto-repair of a node the revision broke): a failure, never let go.
        let replacing = run(&[
            (Event::Begun(Ok("s".into())), 0.0),
            (Event::Deleted(Ok(true)), 1.0),
        ]);
        let p = advance(
            replacing,
            Event::NodeGone {
                why: "node n1 left the cluster".into(),
                replacement_seen: true,
            },
            5.0,
            T,
        );
        assert!(matches!(p, Phase::Done(Outcome::Failed { .. })), "{p:?}");
        // A pod not deleted after all (the batch halted meanwhile): deferred, nothing touched.
        assert_eq!(
            advance(
                Phase::Delete { step: "s".into() },
                Event::NotDeleted("node n2 of the batch failed".into()),
                1.0,
                T
            ),
            Phase::Done(Outcome::Deferred {
                why: "node n2 of the batch failed".into()
            })
        );
    }
}

#[cfg(test)]
mod busy_tests {
    use super::*;

    /// A begin refused because another step is active ends the node's turn without a delete:
    /// it is planned again once that step is over.
    #[test]
    fn a_busy_agent_defers_the_node_instead_of_failing_it() {
        let t = Timeouts {
            replace: 1.0,
            verdict: 1.0,
            pull: 1.0,
        };
        let p = advance(
            Phase::Begin,
            Event::Busy("step x was active".into()),
            0.0,
            t,
        );
        assert_eq!(
            p,
            Phase::Done(Outcome::Deferred {
                why: "step x was active".into()
            })
        );
    }
}
