//! What a command's exit status says, the same for every command (`check`, `step`, `wait`,
//! `drops`, `rollout`): a script branches on three outcomes.

/// A command's outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExitCode {
    /// 0: passed, done, or nothing to do.
    Ok,
    /// 1: failed (a check failed, a verdict failed, a node's verification failed).
    Failed,
    /// 2: not decided (unknown, refused, halted, interrupted, or the command itself could not
    /// run).
    NotDecided,
}

impl ExitCode {
    /// Every outcome, in the order of their numbers.
    pub const ALL: [ExitCode; 3] = [ExitCode::Ok, ExitCode::Failed, ExitCode::NotDecided];

    /// The process exit status.
    pub fn code(self) -> i32 {
        match self {
            ExitCode::Ok => 0,
            ExitCode::Failed => 1,
            ExitCode::NotDecided => 2,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ExitCode;

    #[test]
    fn the_three_outcomes_keep_their_numbers() {
        assert_eq!(
            [ExitCode::Ok, ExitCode::Failed, ExitCode::NotDecided].map(ExitCode::code),
            [0, 1, 2]
        );
    }
}
