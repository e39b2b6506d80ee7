//! A replacement cilium pod on its way to Ready (pure): its stage from its status, and the
//! stages a step saw, timed, so an image pull is told apart from the agent starting.
use super::pod_ready;
use k8s_openapi::api::core::v1::Pod;

/// Where a replacement cilium pod is on its way to Ready, as its status shows.
#[derive(Clone, Debug, PartialEq)]
pub enum Stage {
    /// Created, not bound to the node yet (the scheduler).
    Unbound,
    /// Bound; its containers being created: the image pulled (the kubelet reports
    /// `ContainerCreating` while it pulls, then `ErrImagePull`/`ImagePullBackOff` when a pull
    /// fails).
    Pulling(String),
    /// Its init containers running: `done` of `of` finished.
    Initializing {
        done: usize,
        of: usize,
    },
    /// Its containers running, not Ready (the agent starting, or failing its probes).
    Running,
    Ready,
}

impl Stage {
    pub fn label(&self) -> String {
        match self {
            Stage::Unbound => "Pending, not bound".into(),
            Stage::Pulling(r) => format!("pulling the image ({r})"),
            Stage::Initializing { done, of } => format!("init containers ({done} of {of} done)"),
            Stage::Running => "running, not Ready".into(),
            Stage::Ready => "Ready".into(),
        }
    }
    /// The stage's name in the timing summary.
    fn kind(&self) -> &'static str {
        match self {
            Stage::Unbound => "Pending",
            Stage::Pulling(_) => "pulling",
            Stage::Initializing { .. } => "init containers",
            Stage::Running => "running until Ready",
            Stage::Ready => "Ready",
        }
    }
}

/// The stage of a replacement pod from its status.
pub fn stage(p: &Pod) -> Stage {
    if pod_ready(p) {
        return Stage::Ready;
    }
    let bound = p
        .spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .is_some_and(|n| !n.is_empty());
    if !bound {
        return Stage::Unbound;
    }
    let st = p.status.clone().unwrap_or_default();
    let waiting = |c: &k8s_openapi::api::core::v1::ContainerStatus| {
        c.state
            .as_ref()
            .and_then(|s| s.waiting.as_ref())
            .and_then(|w| w.reason.clone())
    };
    let pulling = |r: &str| matches!(r, "ContainerCreating" | "ErrImagePull" | "ImagePullBackOff");
    let inits = st.init_container_statuses.clone().unwrap_or_default();
    let of = p
        .spec
        .as_ref()
        .and_then(|s| s.init_containers.as_ref())
        .map_or(0, |v| v.len());
    let done = inits
        .iter()
        .filter(|c| {
            c.state
                .as_ref()
                .and_then(|s| s.terminated.as_ref())
                .is_some_and(|t| t.exit_code == 0)
        })
        .count();
    if let Some(r) = inits
        .iter()
        .filter_map(waiting)
        .chain(st.container_statuses.iter().flatten().filter_map(waiting))
        .find(|r| pulling(r))
    {
        return Stage::Pulling(r);
    }
    if done < of {
        return Stage::Initializing { done, of };
    }
    if st.container_statuses.as_ref().is_none_or(|c| c.is_empty())
        && st.phase.as_deref() == Some("Pending")
    {
        return Stage::Pulling("ContainerCreating".into());
    }
    Stage::Running
}

/// The stages a replacement went through, each with when it began (unix seconds).
#[derive(Default)]
pub struct Stages(Vec<(Stage, f64)>);

impl Stages {
    /// Whether a replacement pod was seen at all.
    pub fn seen(&self) -> bool {
        !self.0.is_empty()
    }

    /// Records the stage seen now; true when it is a new one.
    pub fn enter(&mut self, s: &Stage, now: f64) -> bool {
        if self.0.last().is_some_and(|(l, _)| l == s) {
            return false;
        }
        self.0.push((s.clone(), now));
        true
    }
    /// When the current pull began (the first of a run of pulling stages).
    pub fn pulling_since(&self) -> Option<f64> {
        let mut since = None;
        for (s, t) in &self.0 {
            match s {
                Stage::Pulling(_) => {
                    since.get_or_insert(*t);
                }
                _ => since = None,
            }
        }
        since
    }
    /// Each stage kind and how long it lasted, in order (Ready last, with no duration).
    pub fn durations(&self) -> Vec<(String, f64)> {
        let mut out: Vec<(String, f64)> = Vec::new();
        for (i, (s, t)) in self.0.iter().enumerate() {
            let end = self.0.get(i + 1).map(|(_, e)| *e).unwrap_or(*t);
            match out.last_mut() {
                Some((k, d)) if k == s.kind() => *d += end - t,
                _ => out.push((s.kind().to_string(), end - t)),
            }
        }
        out
    }
    pub fn summary(&self) -> String {
        let parts: Vec<String> = self
            .durations()
            .iter()
            .filter(|(k, _)| k != "Ready")
            .map(|(k, d)| format!("{k} {d:.1}s"))
            .collect();
        if parts.is_empty() {
            "at once".into()
        } else {
            parts.join(", ")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    #[test]
    fn a_replacement_is_seen_through_its_stages() {
        let pod = |v: Value| -> Pod { serde_json::from_value(v).unwrap() };
        let spec = json!({"nodeName": "n1", "initContainers": [{"name": "mount-bpf-fs"}, {"name": "clean-cilium-state"}],
                          "containers": [{"name": "cilium-agent"}]});
        assert_eq!(
            stage(&pod(json!({"spec": {"containers": []}}))),
            Stage::Unbound
        );
        let pulling = pod(json!({"spec": spec, "status": {"phase": "Pending",
            "initContainerStatuses": [{"name": "mount-bpf-fs", "image": "", "imageID": "", "ready": false, "restartCount": 0,
                "state": {"waiting": {"reason": "ErrImagePull"}}}]}}));
        assert_eq!(stage(&pulling), Stage::Pulling("ErrImagePull".into()));
        let init = pod(json!({"spec": spec, "status": {"phase": "Pending",
            "initContainerStatuses": [
                {"name": "mount-bpf-fs", "image": "", "imageID": "", "ready": false, "restartCount": 0,
                 "state": {"terminated": {"exitCode": 0}}},
                {"name": "clean-cilium-state", "image": "", "imageID": "", "ready": false, "restartCount": 0,
                 "state": {"running": {}}}]}}));
        assert_eq!(stage(&init), Stage::Initializing { done: 1, of: 2 });
        let running = pod(
            json!({"spec": {"nodeName": "n1", "containers": [{"name": "cilium-agent"}]},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "False"}],
                "containerStatuses": [{"name": "cilium-agent", "image": "", "imageID": "", "ready": false,
                    "restartCount": 0, "state": {"running": {}}}]}}),
        );
        assert_eq!(stage(&running), Stage::Running);
        let mut st = Stages::default();
        assert!(st.enter(&Stage::Unbound, 0.0));
        assert!(st.enter(&Stage::Pulling("ContainerCreating".into()), 1.0));
        assert!(st.enter(&Stage::Pulling("ErrImagePull".into()), 4.0));
        assert!(!st.enter(&Stage::Pulling("ErrImagePull".into()), 5.0));
        assert_eq!(st.pulling_since(), Some(1.0));
        assert!(st.enter(&Stage::Running, 9.0));
        assert_eq!(st.pulling_since(), None);
        assert!(st.enter(&Stage::Ready, 10.5));
        assert_eq!(
            st.summary(),
            "Pending 1.0s, pulling 8.0s, running until Ready 1.5s"
        );
    }
}
