//! What a rollout leaves for every later run, on its lock Lease (pure): the step in flight, a
//! halt after a failed step, and the decisions people took. A run never walks past a node whose
//! verdict it did not read as passed: the interrupted step is finished first, and a halt stands
//! until a person lifts it (`--retry NODE`, `--skip NODE`, `--abort`) or approves a new
//! revision.
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Plain annotations of the step in flight, for `kubectl get lease -o yaml` readers.
pub const ANN_NODE: &str = "stepguard.io/node";
pub const ANN_STEP: &str = "stepguard.io/step";
pub const ANN_REVISION: &str = "stepguard.io/revision";
/// The whole record of the step in flight (JSON).
pub const ANN_INFLIGHT: &str = "stepguard.io/inflight";
pub const ANN_HALT: &str = "stepguard.io/halt";
pub const ANN_RETRY: &str = "stepguard.io/retry";
pub const ANN_SKIPPED: &str = "stepguard.io/skipped";
pub const ANN_ABORTED: &str = "stepguard.io/aborted-revision";
pub const ANN_DECISIONS: &str = "stepguard.io/decisions";
/// What the rollouts told in Events, kept beyond the Events' TTL (JSON, newest last).
pub const ANN_HISTORY: &str = "stepguard.io/history";
/// The decisions kept (newest last).
pub const DECISIONS_KEPT: usize = 20;
/// The history kept (newest last): a few rollouts of a dozen nodes.
pub const HISTORY_KEPT: usize = 60;

/// The step in flight: recorded after the node's agent began it and before the pod is
/// deleted, so a resumed run finishes exactly this step.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct InFlight {
    pub node: String,
    pub step: String,
    /// The pod deleted (or to delete) and its UID.
    #[serde(default)]
    pub pod: String,
    #[serde(default)]
    pub pod_uid: String,
    /// The revision the step targets: its hash and number.
    pub revision: String,
    #[serde(default)]
    pub revision_number: i64,
    #[serde(default)]
    pub why: String,
}

/// A failed step: every run refuses until a person lifts it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Halt {
    pub node: String,
    pub step: Option<String>,
    pub revision: String,
    pub reason: String,
    pub at: String,
}

/// A node left as it is for a revision (`--skip`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Skip {
    pub node: String,
    pub revision: String,
    pub by: String,
    pub why: String,
}

/// Who decided what, and why.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    pub action: String,
    pub node: Option<String>,
    pub revision: Option<String>,
    pub by: String,
    pub why: String,
    pub at: String,
}

/// One thing a rollout told (an Event's reason and message), when.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Told {
    pub at: String,
    pub reason: String,
    pub message: String,
    #[serde(default)]
    pub warning: bool,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Record {
    pub inflight: Option<InFlight>,
    pub halt: Option<Halt>,
    /// Step this node again first (`--retry`).
    pub retry: Option<String>,
    pub skipped: Vec<Skip>,
    /// `--watch` does not start this revision again (`--abort`).
    pub aborted: Option<String>,
    pub decisions: Vec<Decision>,
    pub history: Vec<Told>,
}

fn json<T: for<'de> Deserialize<'de>>(
    ann: &BTreeMap<String, String>,
    key: &str,
) -> Result<Option<T>, String> {
    match ann.get(key) {
        None => Ok(None),
        Some(v) if v.is_empty() => Ok(None),
        Some(v) => serde_json::from_str(v)
            .map(Some)
            .map_err(|e| format!("annotation {key} of the rollout lock is not valid: {e}")),
    }
}

impl Record {
    /// Reads the record from the lock's annotations. A record that cannot be read is an error,
    /// never an empty record: a halt must not vanish because it was mangled.
    pub fn parse(ann: &BTreeMap<String, String>) -> Result<Record, String> {
        let mut inflight: Option<InFlight> = json(ann, ANN_INFLIGHT)?;
        if inflight.is_none() {
            // A lock written by an older stepper: node, step and revision only.
            if let (Some(node), Some(step)) = (ann.get(ANN_NODE), ann.get(ANN_STEP)) {
                inflight = Some(InFlight {
                    node: node.clone(),
                    step: step.clone(),
                    revision: ann.get(ANN_REVISION).cloned().unwrap_or_default(),
                    ..Default::default()
                });
            }
        }
        Ok(Record {
            inflight,
            halt: json(ann, ANN_HALT)?,
            retry: ann.get(ANN_RETRY).filter(|s| !s.is_empty()).cloned(),
            skipped: json(ann, ANN_SKIPPED)?.unwrap_or_default(),
            aborted: ann.get(ANN_ABORTED).filter(|s| !s.is_empty()).cloned(),
            decisions: json(ann, ANN_DECISIONS)?.unwrap_or_default(),
            history: json(ann, ANN_HISTORY)?.unwrap_or_default(),
        })
    }

    /// Writes the record into the lock's annotations (others are left alone).
    pub fn write(&self, ann: &mut BTreeMap<String, String>) {
        let mut set = |k: &str, v: Option<String>| match v {
            Some(v) => {
                ann.insert(k.to_string(), v);
            }
            None => {
                ann.remove(k);
            }
        };
        set(ANN_NODE, self.inflight.as_ref().map(|i| i.node.clone()));
        set(ANN_STEP, self.inflight.as_ref().map(|i| i.step.clone()));
        set(
            ANN_REVISION,
            self.inflight.as_ref().map(|i| i.revision.clone()),
        );
        set(ANN_INFLIGHT, self.inflight.as_ref().map(to));
        set(ANN_HALT, self.halt.as_ref().map(to));
        set(ANN_RETRY, self.retry.clone());
        set(
            ANN_SKIPPED,
            (!self.skipped.is_empty()).then(|| to(&self.skipped)),
        );
        set(ANN_ABORTED, self.aborted.clone());
        set(
            ANN_DECISIONS,
            (!self.decisions.is_empty()).then(|| to(&self.decisions)),
        );
        set(
            ANN_HISTORY,
            (!self.history.is_empty()).then(|| to(&self.history)),
        );
    }

    /// Nothing for a later run to know: the lock can be deleted on release.
    pub fn is_empty(&self) -> bool {
        self.inflight.is_none()
            && self.halt.is_none()
            && self.retry.is_none()
            && self.skipped.is_empty()
            && self.aborted.is_none()
            && self.decisions.is_empty()
            && self.history.is_empty()
    }

    /// Keeps what was told (a long message cut), the newest `HISTORY_KEPT`.
    pub fn tell(&mut self, at: &str, warning: bool, reason: &str, message: &str) {
        let message: String = if message.chars().count() > 400 {
            message.chars().take(399).chain(['…']).collect()
        } else {
            message.to_string()
        };
        self.history.push(Told {
            at: at.to_string(),
            reason: reason.to_string(),
            message,
            warning,
        });
        let n = self.history.len();
        if n > HISTORY_KEPT {
            self.history.drain(..n - HISTORY_KEPT);
        }
    }

    /// The nodes `--skip` left as they are on `revision`.
    pub fn skipped_on(&self, revision: &str) -> Vec<String> {
        self.skipped
            .iter()
            .filter(|s| s.revision == revision)
            .map(|s| s.node.clone())
            .collect()
    }

    pub fn decide(&mut self, d: Decision) {
        self.decisions.push(d);
        let n = self.decisions.len();
        if n > DECISIONS_KEPT {
            self.decisions.drain(..n - DECISIONS_KEPT);
        }
    }

    /// A new revision leaves only its own skips and the decisions.
    pub fn forget_other_revisions(&mut self, current: &str) {
        self.skipped.retain(|s| s.revision == current);
        if self.aborted.as_deref().is_some_and(|a| a != current) {
            self.aborted = None;
        }
    }
}

fn to<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_default()
}

/// How a halt reads for people, with the ways to lift it.
pub fn halt_text(h: &Halt) -> String {
    format!(
        "the rollout is halted: the step on node {} ({}) failed at {} on revision {}: {}. \
         A person lifts the halt: `stepguard rollout --retry {} --reason WHY` steps the node again, \
         `--skip {} --reason WHY` leaves it as it is and goes on, `--abort` ends this rollout, \
         or approve a new revision (stepguard.io/approve-revision)",
        h.node,
        h.step.as_deref().unwrap_or("not begun"),
        h.at,
        h.revision,
        h.reason,
        h.node,
        h.node
    )
}

/// Whether a run may go on, before it takes the lock.
#[derive(Clone, Debug, PartialEq)]
pub enum Gate {
    /// Go on; `lift` is set when a newly approved revision lifts a standing halt.
    Go {
        lift: Option<Decision>,
    },
    Halted(String),
}

/// A halt stands until a person lifts it, or until a revision other than the halted one is
/// current and approved by the DaemonSet's annotation.
pub fn gate(r: &Record, current: &str, approved: Option<&str>, now: &str) -> Gate {
    match &r.halt {
        None => Gate::Go { lift: None },
        Some(h) if h.revision != current && approved == Some(current) => Gate::Go {
            lift: Some(Decision {
                action: "approved".into(),
                node: Some(h.node.clone()),
                revision: Some(current.to_string()),
                by: "stepguard.io/approve-revision".into(),
                why: format!(
                    "revision {current} is approved and is not the halted revision {}; every node's current pod is still judged by its agent's verdict",
                    h.revision
                ),
                at: now.to_string(),
            }),
        },
        Some(h) => Gate::Halted(halt_text(h)),
    }
}

/// A person's decision on a halted (or stuck) rollout.
#[derive(Clone, Debug, PartialEq)]
pub enum Lift {
    Retry(String),
    Skip(String),
    Abort,
}

/// Applies a person's decision; what the next run will do, or why the decision does not apply.
pub fn lift(
    r: &mut Record,
    l: &Lift,
    by: &str,
    why: &str,
    current: &str,
    now: &str,
    world: Option<&Halt>,
) -> Result<String, String> {
    let decision = |action: &str, node: Option<&str>, revision: &str| Decision {
        action: action.into(),
        node: node.map(String::from),
        revision: Some(revision.to_string()),
        by: by.to_string(),
        why: why.to_string(),
        at: now.to_string(),
    };
    // A node whose current pod failed its verification (`world`, read from its agent) is
    // halted whatever the record holds (an abort, a deleted lock).
    let halted_at = |r: &Record, node: &str| -> Result<Halt, String> {
        if let Some(w) = world.filter(|w| w.node == node) {
            return match &r.halt {
                // Another node's halt stands: the gate refuses until a person decides there.
                Some(h) if h.node != node => Err(format!(
                    "the halt is at node {}, not {node}: decide on the node whose step failed first",
                    h.node
                )),
                // This node's current pod failed: judged on the revision it runs now.
                _ => Ok(w.clone()),
            };
        }
        match &r.halt {
            None => Err(format!(
                "no halt stands{}: there is nothing to lift",
                r.inflight
                    .as_ref()
                    .map(|i| format!(
                        " (a step on node {} is in flight: the next run finishes it, or `--abort`)",
                        i.node
                    ))
                    .unwrap_or_default()
            )),
            Some(h) if h.node != node => Err(format!(
                "the halt is at node {}, not {node}: decide on the node whose step failed",
                h.node
            )),
            Some(h) => Ok(h.clone()),
        }
    };
    match l {
        Lift::Retry(node) => {
            let h = halted_at(r, node)?;
            if r.halt.as_ref().is_some_and(|x| &x.node == node) {
                r.halt = None;
            }
            r.retry = Some(node.clone());
            r.decide(decision("retry", Some(node), &h.revision));
            Ok(format!(
                "halt lifted: the next run (`stepguard rollout`, or the next `--watch` tick) steps node {node} again first"
            ))
        }
        Lift::Skip(node) => {
            let h = halted_at(r, node)?;
            if r.halt.as_ref().is_some_and(|x| &x.node == node) {
                r.halt = None;
            }
            if r.retry.as_ref() == Some(node) {
                r.retry = None;
            }
            r.skipped.push(Skip {
                node: node.clone(),
                revision: h.revision.clone(),
                by: by.to_string(),
                why: why.to_string(),
            });
            r.decide(decision("skip", Some(node), &h.revision));
            Ok(format!(
                "halt lifted: node {node} is left as it is on revision {}; the next run goes on with the other nodes",
                h.revision
            ))
        }
        Lift::Abort => {
            let node = r
                .halt
                .as_ref()
                .map(|h| h.node.clone())
                .or(r.inflight.as_ref().map(|i| i.node.clone()));
            r.halt = None;
            r.inflight = None;
            r.retry = None;
            r.aborted = Some(current.to_string());
            r.decide(decision("abort", node.as_deref(), current));
            Ok(format!(
                "rollout of revision {current} aborted: `--watch` does not start it again until a new revision is approved; a person running `stepguard rollout` starts it anew"
            ))
        }
    }
}

/// After a node, whether the run may go on to the DaemonSet's current revision: its own, or
/// one the DaemonSet's annotation approves. Anything else pauses the rollout.
pub fn may_adopt(run_revision: &str, current: &str, approved: Option<&str>) -> bool {
    current == run_revision || approved == Some(current)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn halted() -> Record {
        Record {
            halt: Some(Halt {
                node: "n2".into(),
                step: Some("s2".into()),
                revision: "r2".into(),
                reason: "step failed: map_emptied".into(),
                at: "t".into(),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_record_survives_the_annotations_and_a_mangled_one_is_an_error() {
        let mut r = halted();
        r.inflight = Some(InFlight {
            node: "n1".into(),
            step: "s1".into(),
            pod: "cilium-x".into(),
            pod_uid: "u".into(),
            revision: "r2".into(),
            revision_number: 2,
            why: "worker".into(),
        });
        r.skipped.push(Skip {
            node: "n3".into(),
            revision: "r2".into(),
            by: "me".into(),
            why: "broken disk".into(),
        });
        r.retry = Some("n2".into());
        r.aborted = Some("r1".into());
        let mut ann = BTreeMap::new();
        ann.insert("other".to_string(), "kept".to_string());
        r.write(&mut ann);
        assert_eq!(ann[ANN_NODE], "n1");
        assert_eq!(Record::parse(&ann).unwrap(), r);
        assert_eq!(ann["other"], "kept");
        Record::default().write(&mut ann);
        assert_eq!(ann.len(), 1, "an empty record removes its keys: {ann:?}");

        let mut bad = BTreeMap::new();
        bad.insert(ANN_HALT.to_string(), "{not json".to_string());
        let e = Record::parse(&bad).unwrap_err();
        assert!(e.contains(ANN_HALT), "{e}");

        // An older stepper's lock: the step in flight from the plain annotations.
        let mut old = BTreeMap::new();
        old.insert(ANN_NODE.to_string(), "n1".to_string());
        old.insert(ANN_STEP.to_string(), "s1".to_string());
        old.insert(ANN_REVISION.to_string(), "r2".to_string());
        let i = Record::parse(&old).unwrap().inflight.unwrap();
        assert_eq!((i.node.as_str(), i.pod_uid.as_str()), ("n1", ""));
    }

    #[test]
    fn a_halt_stands_until_a_new_revision_is_approved() {
        let r = halted();
        assert!(
            matches!(gate(&r, "r2", Some("r2"), "t"), Gate::Halted(m) if m.contains("--retry n2"))
        );
        assert!(
            matches!(gate(&r, "r3", None, "t"), Gate::Halted(_)),
            "a new revision alone does not lift it"
        );
        assert!(
            matches!(gate(&r, "r3", Some("r2"), "t"), Gate::Halted(_)),
            "an approval of the halted revision does not either"
        );
        match gate(&r, "r3", Some("r3"), "t") {
            Gate::Go { lift: Some(d) } => assert_eq!(d.action, "approved"),
            g => panic!("{g:?}"),
        }
        assert_eq!(
            gate(&Record::default(), "r2", None, "t"),
            Gate::Go { lift: None }
        );
    }

    #[test]
    fn people_lift_a_halt_on_the_failed_node_only_and_are_recorded() {
        let mut r = halted();
        let e = lift(
            &mut r,
            &Lift::Retry("n1".into()),
            "me",
            "x",
            "r2",
            "t",
            None,
        )
        .unwrap_err();
        assert!(e.contains("the halt is at node n2"), "{e}");
        assert!(r.halt.is_some());
        lift(
            &mut r,
            &Lift::Retry("n2".into()),
            "me",
            "fixed the NIC",
            "r2",
            "t",
            None,
        )
        .unwrap();
        assert_eq!((r.halt.is_none(), r.retry.as_deref()), (true, Some("n2")));
        assert_eq!(r.decisions[0].by, "me");
        assert_eq!(r.decisions[0].why, "fixed the NIC");
        let e = lift(&mut r, &Lift::Skip("n2".into()), "me", "x", "r2", "t", None).unwrap_err();
        assert!(e.contains("no halt stands"), "{e}");

        let mut r = halted();
        lift(
            &mut r,
            &Lift::Skip("n2".into()),
            "you",
            "known bad",
            "r2",
            "t",
            None,
        )
        .unwrap();
        assert_eq!(r.skipped_on("r2"), ["n2"]);
        assert!(r.skipped_on("r3").is_empty());
        r.forget_other_revisions("r3");
        assert!(r.skipped.is_empty());

        let mut r = halted();
        lift(&mut r, &Lift::Abort, "me", "giving up", "r2", "t", None).unwrap();
        assert_eq!((r.halt.is_none(), r.aborted.as_deref()), (true, Some("r2")));
        for _ in 0..30 {
            r.decide(Decision::default());
        }
        assert_eq!(r.decisions.len(), DECISIONS_KEPT);
    }

    /// A node whose current pod failed its verification can be decided on whatever the
    /// record holds (its halt aborted, or the lock deleted): the world's halt stands in.
    #[test]
    fn a_failed_node_without_a_halt_on_the_record_can_be_decided_on() {
        let world = Halt {
            node: "n3".into(),
            step: Some("implicit-1".into()),
            revision: "r2".into(),
            reason: "map_emptied".into(),
            at: "t".into(),
        };
        let mut r = Record::default();
        let e = lift(&mut r, &Lift::Skip("n3".into()), "me", "x", "r2", "t", None).unwrap_err();
        assert!(e.contains("no halt stands"), "{e}");
        lift(
            &mut r,
            &Lift::Skip("n3".into()),
            "me",
            "drained",
            "r2",
            "t",
            Some(&world),
        )
        .unwrap();
        assert_eq!(r.skipped_on("r2"), ["n3"]);
        let mut r = halted();
        let e = lift(
            &mut r,
            &Lift::Retry("n1".into()),
            "me",
            "x",
            "r2",
            "t",
            Some(&world),
        )
        .unwrap_err();
        assert!(e.contains("the halt is at node n2"), "{e}");
        // Another node's halt stands: decide there first (the gate would refuse anyway).
        let e = lift(
            &mut r,
            &Lift::Retry("n3".into()),
            "me",
            "x",
            "r2",
            "t",
            Some(&world),
        )
        .unwrap_err();
        assert!(e.contains("the halt is at node n2"), "{e}");
        assert_eq!(r.halt.as_ref().map(|h| h.node.as_str()), Some("n2"));
        // The same node halted on an older revision: its current verdict decides; another
        // node's retry is kept.
        let mut r = halted();
        r.retry = Some("n1".into());
        let now = Halt {
            node: "n2".into(),
            revision: "r3".into(),
            ..world.clone()
        };
        lift(
            &mut r,
            &Lift::Skip("n2".into()),
            "me",
            "x",
            "r3",
            "t",
            Some(&now),
        )
        .unwrap();
        assert_eq!(r.skipped_on("r3"), ["n2"]);
        assert_eq!(r.retry.as_deref(), Some("n1"));
    }

    #[test]
    fn a_run_goes_on_only_to_its_own_or_an_approved_revision() {
        assert!(may_adopt("r2", "r2", None));
        assert!(!may_adopt("r2", "r3", None));
        assert!(!may_adopt("r2", "r3", Some("r2")));
        assert!(may_adopt("r2", "r3", Some("r3")));
    }
}
