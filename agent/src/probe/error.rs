//! What can go wrong with a probe, typed: behaviour (does the result say anything about the
//! target?) branches on the variant, never on the message.
use std::io;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    /// The probe could not be sent at all (no socket, EMFILE, no permission, a source address
    /// that cannot be bound, a name that cannot be encoded): says nothing about the target.
    #[error("{context}: {message}")]
    CannotRun {
        context: String,
        message: String,
        errno: Option<i32>,
    },
    /// No answer within the probe's timeout.
    #[error("timeout after {ms}ms")]
    Timeout { ms: u128 },
    /// The exchange failed on the wire (refused, reset, unreachable).
    #[error("{context}: {message}")]
    Exchange {
        context: String,
        message: String,
        errno: Option<i32>,
    },
    /// An answer came, and it is wrong (status, DNS rcode, record, another question).
    #[error("{0}")]
    Answer(String),
}

impl ProbeError {
    pub fn cannot_run(context: impl Into<String>, e: &io::Error) -> Self {
        ProbeError::CannotRun {
            context: context.into(),
            message: e.to_string(),
            errno: e.raw_os_error(),
        }
    }

    /// A local limitation that is not an io::Error (IPv6 echo, an unencodable name).
    pub fn unsupported(context: impl Into<String>, message: impl Into<String>) -> Self {
        ProbeError::CannotRun {
            context: context.into(),
            message: message.into(),
            errno: None,
        }
    }

    pub fn exchange(context: impl Into<String>, e: &io::Error) -> Self {
        ProbeError::Exchange {
            context: context.into(),
            message: e.to_string(),
            errno: e.raw_os_error(),
        }
    }

    pub fn timeout(t: std::time::Duration) -> Self {
        ProbeError::Timeout { ms: t.as_millis() }
    }

    /// Whether the probe ran: false when it could not even be sent.
    pub fn ran(&self) -> bool {
        !matches!(self, ProbeError::CannotRun { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether a probe ran is decided by the variant: rewording a message changes nothing
    /// (before, `could_not_run` matched message prefixes such as "udp socket").
    #[test]
    fn whether_a_probe_ran_is_the_variant_not_the_wording() {
        let emfile = io::Error::from_raw_os_error(libc::EMFILE);
        assert!(!ProbeError::cannot_run("anything at all", &emfile).ran());
        assert!(ProbeError::exchange("socket: looks like a setup error", &emfile).ran());
        assert!(ProbeError::timeout(std::time::Duration::from_millis(5)).ran());
        assert_eq!(
            ProbeError::timeout(std::time::Duration::from_millis(5)).to_string(),
            "timeout after 5ms"
        );
    }
}
