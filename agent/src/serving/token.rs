//! The bearer token: checked from the headers in constant time, its file read again when it
//! changes.
use super::*;

/// Whether `headers` carry `Authorization: Bearer <token>` (always true without a token).
/// Constant-time comparison: the token is a secret.
pub fn bearer_ok(token: Option<&str>, headers: &HeaderMap) -> bool {
    let Some(token) = token else {
        return true;
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    given.is_some_and(|g| {
        g.len() == token.len()
            && g.bytes()
                .zip(token.bytes())
                .fold(0u8, |a, (x, y)| a | (x ^ y))
                == 0
    })
}

/// A bearer token, from a file that is read again when it changes (Kubernetes updates a
/// mounted Secret in place): a rotated token takes effect without a restart. A file that
/// cannot be read, or reads as no valid token, keeps the last good token (logged once).
#[derive(Clone, Default)]
pub struct Token {
    pub(super) inner: Arc<std::sync::Mutex<TokenState>>,
}

#[derive(Default)]
pub(super) struct TokenState {
    path: Option<std::path::PathBuf>,
    token: Option<String>,
    /// (modified, length, inode) of the file the token was read from.
    seen: Option<(std::time::SystemTime, u64, u64)>,
    pub(super) checked_at: Option<std::time::Instant>,
    last_error: Option<String>,
}

/// How often a token file is looked at again (a stat).
const TOKEN_RECHECK: Duration = Duration::from_secs(1);

impl Token {
    /// A fixed token (tests), or none.
    pub fn fixed(token: Option<String>) -> Token {
        Token {
            inner: Arc::new(std::sync::Mutex::new(TokenState {
                token,
                ..Default::default()
            })),
        }
    }

    /// The token in `path`, read now (an error if it is not a valid token), and again when
    /// the file changes.
    pub fn from_file(path: Option<&std::path::Path>) -> anyhow::Result<Token> {
        let token = crate::client::read_token(path)?;
        if let Some(p) = path {
            use std::os::unix::fs::PermissionsExt;
            if std::fs::metadata(p).is_ok_and(|m| m.permissions().mode() & 0o004 != 0) {
                tracing::warn!(file = %p.display(), "the token file is readable by every user of this host: make it readable by this process's user (or group) only, e.g. chmod 0400");
            }
        }
        let seen = path.and_then(file_stamp);
        Ok(Token {
            inner: Arc::new(std::sync::Mutex::new(TokenState {
                path: path.map(|p| p.to_path_buf()),
                token,
                seen,
                checked_at: Some(std::time::Instant::now()),
                last_error: None,
            })),
        })
    }

    /// Whether a token is required.
    pub fn required(&self) -> bool {
        self.current().is_some()
    }

    /// The token now (the file is looked at again at most once a second).
    pub fn current(&self) -> Option<String> {
        let mut s = crate::locks::lock(&self.inner);
        let due = s.checked_at.is_none_or(|t| t.elapsed() >= TOKEN_RECHECK);
        if let (true, Some(path)) = (due, s.path.clone()) {
            s.checked_at = Some(std::time::Instant::now());
            let stamp = file_stamp(&path);
            if stamp.is_some() && stamp != s.seen {
                match crate::client::read_token(Some(&path)) {
                    Ok(t) => {
                        tracing::info!(file = %path.display(), "token file changed: the new token is in effect");
                        s.token = t;
                        s.seen = stamp;
                        s.last_error = None;
                    }
                    Err(e) => {
                        let e = format!("{e:#}");
                        if s.last_error.as_deref() != Some(e.as_str()) {
                            tracing::warn!(error = %e, "token file changed but holds no valid token: the previous token stays in effect");
                            s.last_error = Some(e);
                        }
                    }
                }
            }
        }
        s.token.clone()
    }

    /// [`bearer_ok`] against the current token.
    pub fn ok(&self, headers: &HeaderMap) -> bool {
        bearer_ok(self.current().as_deref(), headers)
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.required() {
            "Token(set)"
        } else {
            "Token(none)"
        })
    }
}

fn file_stamp(p: &std::path::Path) -> Option<(std::time::SystemTime, u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(p).ok()?;
    Some((m.modified().ok()?, m.len(), m.ino()))
}
