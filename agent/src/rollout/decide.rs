//! `--abort`, `--retry NODE`, `--skip NODE`: a person's decisions, recorded on the lock.
use super::*;

/// `--abort`, `--retry NODE`, `--skip NODE`: a person's decision, recorded on the lock with
/// who took it and why, and told in an Event.
pub(super) async fn decide(c: &Cluster, l: Lift) -> Result<crate::exit::ExitCode> {
    let by = who(c).await;
    let why = c
        .args
        .reason
        .clone()
        .unwrap_or_else(|| "no reason given".into());
    let ds = patient("read the DaemonSet", Duration::from_secs(30), None, || {
        c.daemonset()
    })
    .await?;
    let (view, _) = patient("read the cluster", Duration::from_secs(30), None, || {
        c.view()
    })
    .await?;
    let current = view.revision.clone().map(|r| r.0).unwrap_or_default();
    // The node's own failed verdict, whatever the record says.
    let world = match &l {
        Lift::Retry(n) | Lift::Skip(n) => view
            .pods
            .iter()
            .find(|p| &p.node == n && p.revision == current)
            .and_then(|_| match view.proofs.get(n) {
                Some(Ok(pr)) if pr.status == plan::ProofStatus::Failed => Some(record::Halt {
                    node: n.clone(),
                    step: pr.step.as_ref().map(|s| s.id.clone()),
                    revision: current.clone(),
                    reason: pr.why.clone(),
                    at: stamp(),
                    batch: vec![],
                }),
                _ => None,
            }),
        Lift::Abort => None,
    };
    let api = c.leases();
    let name = c.lock_name();
    for _ in 0..5 {
        let lease = api.get_opt(&name).await.context("read the rollout lock")?;
        let (mut lease, create) = match lease {
            Some(l) => (l, false),
            // The lock was deleted: a decision on a node that failed is recorded on a new one.
            None if world.is_some() => (
                Lease {
                    metadata: ObjectMeta {
                        name: Some(name.clone()),
                        namespace: Some(c.args.lock_namespace.clone()),
                        ..Default::default()
                    },
                    spec: Some(Default::default()),
                },
                true,
            ),
            None => (Default::default(), true),
        };
        if create && world.is_none() {
            if l == Lift::Abort {
                println!(
                    "no rollout lock {}/{name}: nothing to abort",
                    c.args.lock_namespace
                );
                return Ok(crate::exit::ExitCode::Ok);
            }
            eprintln!(
                "no halt stands (there is no rollout lock {}/{name}): nothing to lift",
                c.args.lock_namespace
            );
            return Ok(crate::exit::ExitCode::NotDecided);
        };
        let mut ann = annotations(&lease.metadata);
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().unwrap_or_default();
        let mut rec = match Record::parse(&ann) {
            Ok(r) => r,
            // An unreadable record: only `--abort` may clear it.
            Err(e) if l == Lift::Abort => {
                println!("the lock's record is unreadable and is cleared: {e}");
                Record::default()
            }
            Err(e) => bail!("{e}: `stepguard rollout --abort` clears it"),
        };
        if l == Lift::Abort {
            println!(
                "releasing the lock held by {} (renewed {}), in flight: {}{}",
                if holder.is_empty() { "nobody" } else { &holder },
                spec.renew_time.map(|t| t.0.to_string()).unwrap_or_default(),
                rec.inflight_nodes(),
                rec.halt
                    .as_ref()
                    .map(|h| format!("; lifting the halt at node {}", h.node))
                    .unwrap_or_default()
            );
        } else if !holder.is_empty() {
            // Whether its holder still renews it, observed as client-go does.
            if let Watched::Live(live) = observe(c, lease.clone()).await? {
                eprintln!(
                    "a rollout is running ({live}): decide when it has ended, or `--abort` it"
                );
                return Ok(crate::exit::ExitCode::NotDecided);
            }
        }
        let next = match record::lift(&mut rec, &l, &by, &why, &current, &stamp(), world.as_ref()) {
            Ok(n) => n,
            Err(e) => {
                eprintln!("stepguard rollout: {e}");
                return Ok(crate::exit::ExitCode::NotDecided);
            }
        };
        for k in [
            record::ANN_NODE,
            record::ANN_STEP,
            record::ANN_REVISION,
            record::ANN_INFLIGHT,
            record::ANN_HALT,
            record::ANN_RETRY,
            record::ANN_SKIPPED,
            record::ANN_ABORTED,
            record::ANN_DECISIONS,
            record::ANN_HISTORY,
        ] {
            ann.remove(k);
        }
        if let Some(d) = rec.decisions.last() {
            rec.tell(
                &stamp(),
                false,
                if l == Lift::Abort {
                    "StepguardRolloutAborted"
                } else {
                    "StepguardHaltLifted"
                },
                &format!("{} by {}: {}", d.action, d.by, d.why),
            );
        }
        rec.write(&mut ann);
        lease.metadata.annotations = Some(ann.into_iter().collect());
        if l == Lift::Abort {
            lease
                .spec
                .get_or_insert_with(Default::default)
                .holder_identity = None;
        }
        let written = if create {
            api.create(&PostParams::default(), &lease).await
        } else {
            api.replace(&name, &PostParams::default(), &lease).await
        };
        match written {
            Ok(_) => {}
            Err(e) if api_code(&e) == Some(409) => continue,
            Err(e) => return Err(e).context("record the decision on the rollout lock"),
        }
        let d = rec.decisions.last().cloned().unwrap_or_default();
        c.event(
            &ds,
            false,
            if l == Lift::Abort {
                "StepguardRolloutAborted"
            } else {
                "StepguardHaltLifted"
            },
            &format!(
                "{} {} by {}: {}",
                d.action,
                d.node
                    .as_deref()
                    .map(|n| format!("node {n}"))
                    .unwrap_or_default(),
                d.by,
                d.why
            ),
        )
        .await;
        println!("{next}");
        return Ok(crate::exit::ExitCode::Ok);
    }
    bail!("the rollout lock kept changing while recording the decision: try again")
}
