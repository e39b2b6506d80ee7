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
/// config checksum the Git approval names.
pub(super) fn approval(ds: &DaemonSet, current: &str) -> Option<String> {
    let named = annotations(&ds.metadata).get(ANN_APPROVE).cloned();
    if named.as_deref() != Some(current) && !current.is_empty() && template_approved(ds).is_ok() {
        return Some(current.to_string());
    }
    named
}

/// Whether the DaemonSet's template (the current revision, once the controller observed it)
/// carries what `stepguard.io/approve-image` and `stepguard.io/approve-config-checksum`
/// name; why not.
pub(super) fn template_approved(ds: &DaemonSet) -> Result<(), String> {
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
    match (sum, ann.get(ANN_APPROVE_CONFIG)) {
        // Without the chart's checksum a config change makes no revision at all.
        (None, _) => Ok(()),
        (Some(s), Some(a)) if &s == a => Ok(()),
        (Some(s), Some(a)) => Err(format!(
            "the template's config checksum is {s}, {ANN_APPROVE_CONFIG} names {a}"
        )),
        (Some(s), None) => Err(format!(
            "the template carries config checksum {s} and {ANN_APPROVE_CONFIG} is not set"
        )),
    }
}

/// Why the current revision is not approved, for people.
pub(super) fn unapproved_why(ds: &DaemonSet) -> String {
    let named = annotations(&ds.metadata)
        .get(ANN_APPROVE)
        .cloned()
        .unwrap_or_else(|| "not set".into());
    match template_approved(ds) {
        Err(e) if annotations(&ds.metadata).contains_key(ANN_APPROVE_IMAGE) => {
            format!("stepguard.io/approve-revision is {named}; {e}")
        }
        _ => format!("stepguard.io/approve-revision is {named}"),
    }
}

/// `--watch`: whether to start now (a revision not all nodes run, approved).
pub fn approved(view: &ClusterView, approved: Option<&str>) -> bool {
    let Some((rev, _)) = &view.revision else {
        return false;
    };
    approved == Some(rev.as_str()) && view.pods.iter().any(|p| &p.revision != rev)
}
