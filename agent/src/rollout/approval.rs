//! What a person approved: a revision named on the DaemonSet, or the image and config checksum
//! Git wrote into the template in the commit that changes it.
use super::*;

/// On the DaemonSet: `--watch` starts a rollout when this equals the current revision's hash.
pub const ANN_APPROVE: &str = "stepguard.io/approve-revision";

/// Approval from Git, in the commit that changes the template (before its revision exists):
/// the cilium-agent image the template must carry ...
pub const ANN_APPROVE_IMAGE: &str = "stepguard.io/approve-image";

/// ... and the cilium-config checksum the chart puts on it (`rollOutCiliumPods`), so a
/// config-only revision cannot ride an older approval.
pub const ANN_APPROVE_CONFIG: &str = "stepguard.io/approve-config-checksum";

/// The chart's annotation on the pod template: the sha256 of the rendered cilium-config.
pub const CONFIG_CHECKSUM: &str = "cilium.io/cilium-configmap-checksum";

pub(super) fn annotations(meta: &ObjectMeta) -> BTreeMap<String, String> {
    meta.annotations
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect()
}

/// What a person approved, as a revision hash: the one `stepguard.io/approve-revision`
/// names, or the current revision (`current`) when its template carries the image and the
/// config checksum the Git approval names and changes nothing else from any revision a node
/// runs now (`prev`: those revisions' pod templates, from their ControllerRevisions; None
/// when one cannot be read).
pub(super) fn approval(ds: &DaemonSet, current: &str, prev: Option<&[Value]>) -> Option<String> {
    let named = annotations(&ds.metadata).get(ANN_APPROVE).cloned();
    if named.as_deref() != Some(current)
        && !current.is_empty()
        && template_approved(ds, prev).is_ok()
    {
        return Some(current.to_string());
    }
    named
}

/// What differs between two pod templates besides the chart's config checksum and the
/// images that moved from `prev`'s cilium-agent image to the `approved` one (the two things a
/// Git approval names; the chart runs several containers on the cilium image): JSON paths,
/// at most a few. Any other image change is a difference.
pub fn other_changes(prev: &Value, cur: &Value, approved: &str) -> Vec<String> {
    /// Nulls, empty objects and empty lists are absent (the API server and the controller
    /// write a default either way); the strategic-merge directive the controller stores is
    /// no part of the template.
    fn clean(v: &Value) -> Option<Value> {
        match v {
            Value::Null => None,
            Value::Object(m) => {
                let m: serde_json::Map<String, Value> = m
                    .iter()
                    .filter(|(k, _)| k.as_str() != "$patch")
                    .filter_map(|(k, v)| Some((k.clone(), clean(v)?)))
                    .collect();
                (!m.is_empty()).then_some(Value::Object(m))
            }
            Value::Array(a) if a.is_empty() => None,
            Value::Array(a) => Some(Value::Array(
                a.iter().map(|x| clean(x).unwrap_or(Value::Null)).collect(),
            )),
            v => Some(v.clone()),
        }
    }
    let agent_image = |t: &Value| -> Option<String> {
        let cs = t.pointer("/spec/containers")?.as_array()?;
        let c = cs
            .iter()
            .find(|c| c["name"] == "cilium-agent")
            .or(cs.first())?;
        c["image"].as_str().map(String::from)
    };
    let from = agent_image(prev).unwrap_or_default();
    let strip = |v: &Value, image: &str| -> Value {
        let mut v = v.clone();
        if let Some(a) = v
            .pointer_mut("/metadata/annotations")
            .and_then(|a| a.as_object_mut())
        {
            a.remove(CONFIG_CHECKSUM);
            if a.is_empty() {
                v["metadata"]
                    .as_object_mut()
                    .map(|m| m.remove("annotations"));
            }
        }
        for list in ["containers", "initContainers", "ephemeralContainers"] {
            if let Some(cs) = v
                .pointer_mut(&format!("/spec/{list}"))
                .and_then(|c| c.as_array_mut())
            {
                for c in cs {
                    if c["image"].as_str() == Some(image) {
                        c.as_object_mut().map(|c| c.remove("image"));
                    }
                }
            }
        }
        clean(&v).unwrap_or(Value::Null)
    };
    fn diff(a: &Value, b: &Value, path: String, out: &mut Vec<String>) {
        if out.len() >= 4 || a == b {
            return;
        }
        match (a, b) {
            (Value::Object(x), Value::Object(y)) => {
                let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
                for k in keys {
                    diff(
                        x.get(k).unwrap_or(&Value::Null),
                        y.get(k).unwrap_or(&Value::Null),
                        format!("{path}/{k}"),
                        out,
                    );
                }
            }
            (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
                for (i, (a, b)) in x.iter().zip(y).enumerate() {
                    diff(a, b, format!("{path}/{i}"), out);
                }
            }
            _ => out.push(if path.is_empty() { "/".into() } else { path }),
        }
    }
    let mut out = Vec::new();
    diff(
        &strip(prev, &from),
        &strip(cur, approved),
        String::new(),
        &mut out,
    );
    out
}

/// Whether the DaemonSet's template (the current revision, once the controller observed it)
/// carries what `stepguard.io/approve-image` and `stepguard.io/approve-config-checksum`
/// name; why not.
pub(super) fn template_approved(ds: &DaemonSet, prev: Option<&[Value]>) -> Result<(), String> {
    let ann = annotations(&ds.metadata);
    let Some(want) = ann.get(ANN_APPROVE_IMAGE) else {
        return Err(format!("{ANN_APPROVE_IMAGE} is not set"));
    };
    let observed = ds.status.as_ref().and_then(|s| s.observed_generation) >= ds.metadata.generation;
    if !observed {
        return Err("the DaemonSet controller has not observed the template yet".into());
    }
    let tmpl = ds.spec.as_ref().map(|s| &s.template);
    let have = agent_image(tmpl.and_then(|t| t.spec.as_ref()));
    if &have != want {
        return Err(format!(
            "the template's image is {have}, {ANN_APPROVE_IMAGE} names {want}"
        ));
    }
    let sum = tmpl
        .and_then(|t| t.metadata.as_ref())
        .map(annotations)
        .and_then(|a| a.get(CONFIG_CHECKSUM).cloned());
    let named = match (sum, ann.get(ANN_APPROVE_CONFIG)) {
        // Without the chart's checksum a config change makes no revision at all.
        (None, _) => Ok(()),
        (Some(s), Some(a)) if &s == a => Ok(()),
        (Some(s), Some(a)) => Err(format!(
            "the template's config checksum is {s}, {ANN_APPROVE_CONFIG} names {a}"
        )),
        (Some(s), None) => Err(format!(
            "the template carries config checksum {s} and {ANN_APPROVE_CONFIG} is not set"
        )),
    };
    named?;
    // The approval names an image and a config, nothing else: a revision that also changes
    // arguments, env, volumes, init containers, another image or a restart annotation, from
    // any revision a node runs now, is not covered.
    let Some(prev) = prev else {
        return Err(
            "a revision the nodes run cannot be read, so what else the template changes is unknown"
                .into(),
        );
    };
    let cur = serde_json::to_value(tmpl).unwrap_or_default();
    let other: Vec<String> = prev
        .iter()
        .flat_map(|p| other_changes(p, &cur, want))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    if other.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "the template changes more than the image and config checksum the approval names ({}); approve it by revision",
            other.join(", ")
        ))
    }
}

/// Why the current revision is not approved, for people.
pub(super) fn unapproved_why(ds: &DaemonSet, prev: Option<&[Value]>) -> String {
    let named = annotations(&ds.metadata)
        .get(ANN_APPROVE)
        .cloned()
        .unwrap_or_else(|| "not set".into());
    match template_approved(ds, prev) {
        Err(e) if annotations(&ds.metadata).contains_key(ANN_APPROVE_IMAGE) => {
            format!("stepguard.io/approve-revision is {named}; {e}")
        }
        _ => format!("stepguard.io/approve-revision is {named}"),
    }
}

/// `--watch`: whether to start now: the current revision is approved and a node in scope
/// (not left as it is by a person: `o.skip`) is not on it, or is on it without a passed proof.
pub fn approved(view: &ClusterView, approved: Option<&str>, o: &PlanOpts) -> bool {
    let Some((rev, _)) = &view.revision else {
        return false;
    };
    approved == Some(rev.as_str()) && owed(view, o)
}

/// Whether some node's cilium pod in scope is not done: on another revision beyond the
/// partition, or on the current one without a passed proof from its agent. `o.skip`: nodes
/// a person left as they are.
pub fn owed(view: &ClusterView, o: &PlanOpts) -> bool {
    let Some((rev, _)) = &view.revision else {
        return false;
    };
    let movable = plan::scope::movable(view, o, rev) > 0;
    view.pods
        .iter()
        .filter(|p| !o.skip.contains(&p.node) && plan::scope::in_scope(view, o, &p.node))
        // A proof that could not be read is waited on, not owed: a run would only refuse.
        .any(|p| {
            (&p.revision != rev && movable)
                || (&p.revision == rev
                    && matches!(
                        view.proofs.get(&p.node),
                        Some(Ok(pr)) if pr.status != plan::ProofStatus::Passed
                    ))
        })
}

impl Cluster {
    /// The pod templates of the revisions other than `current` that the DaemonSet's pods run
    /// now (`running`: their hashes), from their ControllerRevisions; None when one of them
    /// cannot be read (its history pruned, or the API failing).
    pub(super) async fn running_templates(
        &self,
        ds: &DaemonSet,
        current: &str,
        running: &std::collections::BTreeSet<String>,
    ) -> Option<Vec<Value>> {
        let revs = self.owned_revisions(ds).await.ok()?;
        running
            .iter()
            .filter(|h| h.as_str() != current)
            .map(|h| {
                revs.iter()
                    .find(|(rh, _)| rh == h)
                    .and_then(|(_, r)| r.data.as_ref()?.0.pointer("/spec/template").cloned())
            })
            .collect()
    }

    /// What a person approved now (see [`approval`]), and why the current revision is not,
    /// for people. `view`: the pods whose revisions the change is judged from.
    pub(super) async fn approval_now(
        &self,
        ds: &DaemonSet,
        current: &str,
        view: &ClusterView,
    ) -> (Option<String>, String) {
        let running: std::collections::BTreeSet<String> =
            view.pods.iter().map(|p| p.revision.clone()).collect();
        let prev = self.running_templates(ds, current, &running).await;
        (
            approval(ds, current, prev.as_deref()),
            unapproved_why(ds, prev.as_deref()),
        )
    }
}
