//! Before the lock is taken: a halt on the record, a node whose current pod failed its
//! verification, or a plan that refuses stop a run here; `--dry-run` prints the plan.
use super::super::*;
use crate::exit::ExitCode;

/// The cluster as read before the lock is taken, and the plan for it.
pub(super) struct Start {
    pub(super) opts: PlanOpts,
    pub(super) view: ClusterView,
    pub(super) ds: DaemonSet,
    /// The DaemonSet's newest revision (hash, number).
    pub(super) current: (String, i64),
    /// The revision approved now, if any.
    pub(super) approve: Option<String>,
    pub(super) first: Result<Vec<PlannedStep>, Vec<plan::Refusal>>,
}

/// Whether a run may take the lock.
pub(super) enum Gated {
    Go(Box<Start>),
    /// It ends here (told to the user), with this status.
    Stop(ExitCode),
}

/// Reads the cluster and the record: a halt on the record, a node whose current pod failed
/// its verification, or a plan that refuses stop the run before the lock is taken (told, with
/// the verdict of a halt); `--dry-run` prints the plan and stops.
pub(super) async fn gate(c: &Cluster) -> Result<Gated> {
    let json_out = c.args.output == "json";
    let mut opts = plan_opts(c);
    let start = Duration::from_secs(60);
    let (view, ds) = patient("read the cluster", start, None, || c.view()).await?;
    let (_, rec) = patient("read the rollout lock", start, None, || read_lock(c)).await?;
    let current = view.revision.clone().unwrap_or_default();
    let (approve, _) = c.approval_now(&ds, &current.0, &view).await;
    if let Gate::Halted(msg) = record::gate(&rec, &current.0, approve.as_deref(), &stamp()) {
        if json_out {
            println!(
                "{}",
                serde_json::to_string_pretty(&json!({"halted": rec.halt, "message": msg,
                "verdict": match &rec.halt {
                    Some(h) => Some(halt_verdict(c, &view, h).await),
                    None => None,
                }}))?
            );
        } else {
            println!("refusing to start the rollout of {}: {msg}", view.daemonset);
            if let Some(h) = &rec.halt {
                println!("  {}", halt_verdict(c, &view, h).await);
            }
        }
        return Ok(Gated::Stop(ExitCode::NotDecided));
    }
    opts.skip = rec.skipped_on(&current.0).into_iter().collect();
    opts.again = rec.retry.clone();
    let first = plan::plan(&view, &opts);
    let failed: Vec<&plan::Refusal> = match &first {
        Err(r) => r.iter().filter(|r| r.halts()).collect(),
        Ok(_) => vec![],
    };
    if rec.inflight.is_empty() && !failed.is_empty() {
        // A node's current pod holds a failed verdict: nothing is stepped past it, whatever
        // the record says (an abort, a deleted lock, an approved newer revision).
        let text = failed
            .iter()
            .map(|r| format!("  - {r}"))
            .collect::<Vec<_>>()
            .join("\n");
        if json_out {
            println!(
                "{}",
                serde_json::to_string_pretty(&json!({"halted_on": failed, "view": view}))?
            );
        } else {
            if c.args.dry_run {
                print_dry_run(false, &view, &rec, &first, &current.0, None)?;
            }
            println!(
                "stepguard rollout of {} halted: a node's current cilium pod failed its verification:\n{text}",
                view.daemonset
            );
        }
        if !c.args.dry_run {
            c.event(
                &ds,
                true,
                "StepguardRolloutHalted",
                &format!(
                    "a node's current cilium pod failed its verification: {}",
                    failed
                        .iter()
                        .map(|r| r.to_string())
                        .collect::<Vec<_>>()
                        .join("; ")
                ),
            )
            .await;
        }
        return Ok(Gated::Stop(ExitCode::Failed));
    }
    let only_waits = first
        .as_ref()
        .err()
        .is_some_and(|r| r.iter().all(|r| r.waits()));
    if let (true, Err(refusals), false) = (rec.inflight.is_empty(), &first, only_waits) {
        if json_out {
            println!(
                "{}",
                serde_json::to_string_pretty(&json!({"refused": refusals, "view": view}))?
            );
        } else {
            println!(
                "refusing to start the rollout of {}:\n{}",
                view.daemonset,
                refusals_text(refusals)
            );
        }
        return Ok(Gated::Stop(ExitCode::NotDecided));
    }
    if c.args.dry_run {
        let max = c.args.max_unavailable.of(plan::scope::size(&view, &opts));
        print_dry_run(
            json_out,
            &view,
            &rec,
            &first,
            &current.0,
            Some((&opts, c.args.max_unavailable, max)),
        )?;
        return Ok(Gated::Stop(ExitCode::Ok));
    }
    Ok(Gated::Go(Box::new(Start {
        opts,
        view,
        ds,
        current,
        approve,
        first,
    })))
}
