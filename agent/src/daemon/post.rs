//! A step posted to the agent: validated, admitted against the step the runner has, its
//! baseline taken and its witnesses begun, then handed to the runner, which alone installs it.
//! The HTTP handler only reads the request and renders the answer.
use super::runner::{Begun, Command};
use super::{watch, Daemon};
use crate::kernel::clock;
use crate::step::admission::{self, Admission};
use crate::step::{Step, StepParams, StepRequest};
use std::sync::Arc;
use std::time::Duration;

/// What became of a posted step.
#[derive(Debug)]
pub enum Posted {
    /// Begun: the step as installed.
    Created(Step),
    /// The request is not a step this agent can run (why).
    Invalid(String),
    /// The active step is this one, asked for the same way (the request is idempotent).
    Same(Step),
    /// The active step has this id but another value of `field`.
    OtherParams { active: String, field: &'static str },
    /// Another step (this id) is active.
    Busy(String),
    /// This id already finished (its step, with its verdict).
    Finished(Step),
    /// It could not begin now (the baseline could not be taken, the disk refused it, the
    /// runner is not running): why.
    Unavailable(String),
    /// The admission rule let it begin yet it was refused: a fault of the agent's.
    NotBegun,
}

impl Posted {
    /// The answer for a step not begun, from the admission rule.
    fn refused(a: Admission) -> Posted {
        match a {
            Admission::Same(s) => Posted::Same(s.clone()),
            Admission::SameIdOtherParams { active, field } => Posted::OtherParams {
                active: active.id.clone(),
                field,
            },
            Admission::Busy(s) => Posted::Busy(s.id.clone()),
            Admission::Finished(s) => Posted::Finished(s.clone()),
            // Not a refusal: the caller begins the step.
            Admission::Begin => Posted::NotBegun,
        }
    }
}

impl Daemon {
    /// Begins a posted step, one begin at a time: a request is admitted (against the step the
    /// runner has) only once the previous begin has been installed or refused, so concurrent
    /// posts never contact witnesses for steps that cannot begin.
    pub async fn post_step(self: &Arc<Self>, req: StepRequest) -> Posted {
        let budgets: Vec<Duration> = self.cfg.targets.iter().filter_map(|t| t.max_gap).collect();
        let (id, params) = match StepParams::from_request(&req, self.opts.burst_interval, &budgets)
        {
            Ok(v) => v,
            Err(e) => return Posted::Invalid(format!("invalid step request: {e}")),
        };
        let longest_timeout = self.cfg.targets.iter().map(|t| t.timeout).max();
        if let Some(why) = admission::cadence_refused(&params, longest_timeout) {
            return Posted::Invalid(why);
        }
        let _one = self.begin_lock.lock().await;
        let active = self.current_step();
        let finished = id.as_deref().and_then(|i| self.store.load(i));
        match admission::admit(id.as_deref(), &params, active.as_deref(), finished.as_ref()) {
            Admission::Begin => {}
            refused => return Posted::refused(refused),
        }
        let id = id.unwrap_or_else(|| super::store::new_id(clock::now()));
        let s = match watch::begin(self, id, params.clone()).await {
            Ok(s) => s,
            Err(e) => return Posted::Unavailable(e.to_string()),
        };
        // Not installed (another step won, the disk refused it): what its begin started on
        // the witnesses is ended.
        let begun_on = s.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let sent = self
            .ports
            .commands
            .send(Command::Begin {
                step: Box::new(s),
                reply: tx,
            })
            .await;
        let answer = rx.await;
        if !matches!(answer, Ok(Begun::Created(_))) {
            watch::end_witnesses(self, &begun_on);
        }
        match (sent, answer) {
            (Ok(()), Ok(Begun::Created(s))) => Posted::Created(*s),
            (Ok(()), Ok(Begun::Existing(s))) => {
                Posted::refused(admission::admit(Some(&s.id), &params, Some(&s), None))
            }
            (Ok(()), Ok(Begun::Conflict(active))) => Posted::Busy(active),
            (Ok(()), Ok(Begun::NotSaved(e))) => Posted::Unavailable(format!(
                "cannot save the step in the state directory, so it would not survive an agent restart: {e}"
            )),
            _ => Posted::Unavailable("the step runner is not running".into()),
        }
    }
}
