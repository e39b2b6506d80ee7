//! What can go wrong reading or writing the cluster, typed: whether it is worth retrying (the
//! API server failing, overloaded or not answering) and what exit status it ends a run with.
use crate::exit::ExitCode;

/// An error of the stepper's cluster access.
#[derive(Debug, thiserror::Error)]
pub enum RolloutError {
    /// The API server answered `what` (e.g. `get DaemonSet kube-system/cilium`) with an
    /// error, or did not answer.
    #[error("{what}: {error}")]
    Api { what: String, error: kube::Error },
    /// Anything else: an answer that cannot be used, a pod no longer the one planned, a lock
    /// record that cannot be read.
    #[error(transparent)]
    Other(#[from] anyhow::Error),
    /// The stepper's watch of `what` is down and has not listed again: not read until it
    /// is back.
    #[error("{what}: the watch is down ({why}); waiting for it to list again")]
    Stale { what: String, why: String },
}

impl RolloutError {
    /// An error the API server gave for `what`.
    pub fn api(what: impl Into<String>, error: kube::Error) -> RolloutError {
        RolloutError::Api {
            what: what.into(),
            error,
        }
    }

    /// Worth retrying: the API server failing or overloaded (5xx, 429) or not answering at
    /// all. A refusal (4xx), an answer that cannot be decoded or anything else is not.
    pub fn is_transient(&self) -> bool {
        match self {
            RolloutError::Api { error, .. } => match error {
                kube::Error::Api(s) => s.code >= 500 || s.code == 429,
                kube::Error::SerdeError(_) | kube::Error::BuildRequest(_) => false,
                _ => true,
            },
            RolloutError::Other(_) => false,
            RolloutError::Stale { .. } => true,
        }
    }

    /// The status a run ends with when this stops it: not decided (no node's verdict failed;
    /// the rollout could not go on).
    pub fn exit_code(&self) -> ExitCode {
        ExitCode::NotDecided
    }

    /// The API server's status code, when it answered with one.
    pub fn api_code(&self) -> Option<u16> {
        match self {
            RolloutError::Api {
                error: kube::Error::Api(s),
                ..
            } => Some(s.code),
            _ => None,
        }
    }
}

/// Names what a call to the API server was for.
pub trait ApiContext<T> {
    fn api(self, what: &str) -> Result<T, RolloutError>;
    fn api_with(self, what: impl FnOnce() -> String) -> Result<T, RolloutError>;
}

impl<T> ApiContext<T> for Result<T, kube::Error> {
    fn api(self, what: &str) -> Result<T, RolloutError> {
        self.map_err(|e| RolloutError::api(what, e))
    }
    fn api_with(self, what: impl FnOnce() -> String) -> Result<T, RolloutError> {
        self.map_err(|e| RolloutError::api(what(), e))
    }
}
