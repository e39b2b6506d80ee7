//! What a rollout leaves for every later run, on its lock Lease (pure): the steps in flight
//! (one per node of the batch in flight), a halt after a failed step, and the decisions people
//! took. A run never walks past a node whose verdict it did not read as passed: the interrupted
//! steps are finished first, and a halt stands until a person lifts it (`--retry NODE`,
//! `--skip NODE`, `--abort`) or approves a new revision.
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Plain annotations of the steps in flight, for `kubectl get lease -o yaml` readers (nodes
/// and steps comma-separated when a batch is in flight).
pub const ANN_NODE: &str = "stepguard.io/node";
pub const ANN_STEP: &str = "stepguard.io/step";
pub const ANN_REVISION: &str = "stepguard.io/revision";
/// The whole record of the steps in flight (JSON: one object for a single step, as older
/// steppers wrote and read it; a list for a batch).
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
    /// Every node of the batch the failed step was in, with its outcome (`node-a: passed`,
    /// `node-b: failed: …`, `node-c: not deleted: …`); empty for a step alone.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub batch: Vec<String>,
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
    /// The steps in flight: one per node of the batch (begun, and their pods possibly
    /// deleted), finished first by the next run.
    pub inflight: Vec<InFlight>,
    pub halt: Option<Halt>,
    /// Step this node again first (`--retry`).
    pub retry: Option<String>,
    pub skipped: Vec<Skip>,
    /// `--watch` does not start this revision again (`--abort`).
    pub aborted: Option<String>,
    pub decisions: Vec<Decision>,
    pub history: Vec<Told>,
}

/// A record that cannot be read: the annotation and why (never read as an empty record: a
/// halt must not vanish because it was mangled).
#[derive(Debug, thiserror::Error)]
#[error("annotation {key} of the rollout lock is not valid: {error}")]
pub struct RecordError {
    pub key: &'static str,
    error: serde_json::Error,
}

fn json<T: for<'de> Deserialize<'de>>(
    ann: &BTreeMap<String, String>,
    key: &'static str,
) -> Result<Option<T>, RecordError> {
    match ann.get(key) {
        None => Ok(None),
        Some(v) if v.is_empty() => Ok(None),
        Some(v) => serde_json::from_str(v)
            .map(Some)
            .map_err(|error| RecordError { key, error }),
    }
}

impl Record {
    /// Reads the record from the lock's annotations. A record that cannot be read is an error,
    /// never an empty record: a halt must not vanish because it was mangled.
    pub fn parse(ann: &BTreeMap<String, String>) -> Result<Record, RecordError> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum OneOrMany {
            One(Box<InFlight>),
            Many(Vec<InFlight>),
        }
        let mut inflight: Vec<InFlight> = match json(ann, ANN_INFLIGHT)? {
            None => vec![],
            Some(OneOrMany::One(i)) => vec![*i],
            Some(OneOrMany::Many(v)) => v,
        };
        if inflight.is_empty() {
            // A lock written by an older stepper: node, step and revision only.
            if let (Some(node), Some(step)) = (ann.get(ANN_NODE), ann.get(ANN_STEP)) {
                inflight.push(InFlight {
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
        let joined = |f: fn(&InFlight) -> &str| -> Option<String> {
            let mut seen: Vec<&str> = Vec::new();
            for i in &self.inflight {
                if !seen.contains(&f(i)) {
                    seen.push(f(i));
                }
            }
            (!seen.is_empty()).then(|| seen.join(","))
        };
        set(ANN_NODE, joined(|i| &i.node));
        set(ANN_STEP, joined(|i| &i.step));
        set(ANN_REVISION, joined(|i| &i.revision));
        set(
            ANN_INFLIGHT,
            match self.inflight.as_slice() {
                [] => None,
                [one] => Some(to(one)),
                many => Some(to(&many)),
            },
        );
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
        self.inflight.is_empty()
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

    /// The record without what was told (the part a later run decides by).
    pub fn without_history(&self) -> Record {
        Record {
            history: vec![],
            ..self.clone()
        }
    }

    /// Records `i` as in flight (replacing an earlier step of its node).
    pub fn begin(&mut self, i: InFlight) {
        self.inflight.retain(|x| x.node != i.node);
        self.inflight.push(i);
    }

    /// The node's step is no longer in flight (its verdict is in, or nothing was deleted).
    pub fn end(&mut self, node: &str) {
        self.inflight.retain(|x| x.node != node);
    }

    /// The nodes in flight, for people (`-` when none).
    pub fn inflight_nodes(&self) -> String {
        if self.inflight.is_empty() {
            return "-".into();
        }
        self.inflight
            .iter()
            .map(|i| format!("{} (step {})", i.node, i.step))
            .collect::<Vec<_>>()
            .join(", ")
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

/// How a halt reads for people, with the ways to lift it (and every node of its batch).
pub fn halt_text(h: &Halt) -> String {
    let batch = if h.batch.is_empty() {
        String::new()
    } else {
        format!(
            ". The failed step's batch, each node's verdict read before the halt: {}",
            h.batch.join("; ")
        )
    };
    format!(
        "the rollout is halted: the step on node {} ({}) failed at {} on revision {}: {}. \
         A person lifts the halt: `stepguard rollout --retry {} --reason WHY` steps the node again, \
         `--skip {} --reason WHY` leaves it as it is and goes on, `--abort` ends this rollout, \
         or approve a new revision (stepguard.io/approve-revision){batch}",
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
                if r.inflight.is_empty() {
                    String::new()
                } else {
                    format!(
                        " (steps in flight on {}: the next run finishes them, or `--abort`)",
                        r.inflight_nodes()
                    )
                }
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
                .or(r.inflight.first().map(|i| i.node.clone()));
            r.halt = None;
            r.inflight.clear();
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
mod tests;
