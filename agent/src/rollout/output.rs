//! What the stepper tells people: `--status` (the record, the halt with the failed node's
//! verdict, the plan), who is acting, and the progress lines.
use super::*;

/// The failed node's verdict for a halt, read from its agent: the verdict line and each
/// check that did not pass; or why it cannot be read.
pub(super) async fn halt_verdict(c: &Cluster, view: &ClusterView, h: &record::Halt) -> String {
    let Some(step) = &h.step else {
        return "no step was begun on the node (nothing to read)".into();
    };
    let Some(url) = view.agents.get(&h.node) else {
        return format!(
            "no stepguard agent on node {} to ask for step {step}",
            h.node
        );
    };
    let r = match c.agent(url) {
        Ok(a) => {
            a.call(
                "GET",
                &format!("/v1/steps/{step}"),
                None,
                Duration::from_secs(5),
            )
            .await
        }
        Err(e) => Err(e),
    };
    match r {
        Ok((200 | 202, v)) => {
            let verdict = &v["verdict"];
            let mut out = format!(
                "node {}'s verdict for step {step}: {} — {}",
                h.node,
                verdict["status"].as_str().unwrap_or("none yet"),
                verdict["summary"].as_str().unwrap_or("")
            );
            if let Some(checks) = v["checks"].as_object() {
                for (name, ch) in checks {
                    if ch["status"] != "pass" {
                        out.push_str(&format!(
                            "\n    {name}: {} — {}",
                            ch["status"].as_str().unwrap_or("?"),
                            ch["reason"].as_str().unwrap_or("")
                        ));
                    }
                }
            }
            out
        }
        Ok((404, _)) => format!(
            "node {}'s agent no longer knows step {step} (restarted without its state?)",
            h.node
        ),
        Ok((code, v)) => format!("node {}'s agent answered {code}: {v}", h.node),
        Err(e) => format!("cannot ask node {}'s agent for step {step}: {e:#}", h.node),
    }
}

/// `--status`: the rollout's record on its lock, for people (or `--output json`).
pub(super) async fn status(c: &Cluster) -> Result<crate::exit::ExitCode> {
    let (lease, rec) = patient(
        "read the rollout lock",
        Duration::from_secs(30),
        None,
        || read_lock(c),
    )
    .await?;
    let view = c.view().await.map(|(v, _)| v);
    let Some(lease) = lease else {
        println!(
            "no rollout lock {}/{}: no rollout has run, or its record was removed",
            c.args.lock_namespace,
            c.lock_name()
        );
        // The nodes' proofs are the world's, not the lock's: told all the same.
        match &view {
            Ok(v) => node_lines(v).iter().for_each(|l| println!("{l}")),
            Err(e) => println!("cannot read the cluster for the nodes' proofs: {e:#}"),
        }
        return Ok(crate::exit::ExitCode::Ok);
    };
    let spec = lease.spec.clone().unwrap_or_default();
    let verdict = match (&rec.halt, &view) {
        (Some(h), Ok(v)) => Some(halt_verdict(c, v, h).await),
        (Some(_), Err(e)) => Some(format!(
            "cannot read the cluster for the failed node's verdict: {e:#}"
        )),
        (None, _) => None,
    };
    let nodes = match &view {
        Ok(v) => node_lines(v),
        Err(e) => vec![format!(
            "cannot read the cluster for the nodes' proofs: {e:#}"
        )],
    };
    if c.args.output == "json" {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "holder": spec.holder_identity, "renew_time": spec.renew_time.map(|t| t.0.to_string()),
                "inflight": rec.inflight, "halt": rec.halt, "halt_verdict": verdict,
                "nodes": nodes,
                "retry": rec.retry, "skipped": rec.skipped, "aborted": rec.aborted,
                "decisions": rec.decisions, "history": rec.history}))?
        );
        return Ok(crate::exit::ExitCode::Ok);
    }
    let h = spec.holder_identity.clone().unwrap_or_default();
    println!(
        "rollout lock {}/{}: {}",
        c.args.lock_namespace,
        c.lock_name(),
        if h.is_empty() {
            "free".to_string()
        } else {
            format!(
                "held by {h} (renewed {})",
                spec.renew_time.map(|t| t.0.to_string()).unwrap_or_default()
            )
        }
    );
    for i in &rec.inflight {
        println!(
            "step in flight: node {}, step {}, revision {} ({})",
            i.node, i.step, i.revision, i.why
        );
    }
    if let Some(halt) = &rec.halt {
        println!("{}", record::halt_text(halt));
        if let Some(v) = &verdict {
            println!("  {v}");
        }
    }
    for l in &nodes {
        println!("{l}");
    }
    if let Some(n) = &rec.retry {
        println!("node {n} is to be stepped again first (--retry)");
    }
    for sk in &rec.skipped {
        println!(
            "node {} left as it is on revision {} by {}: {}",
            sk.node, sk.revision, sk.by, sk.why
        );
    }
    if let Some(a) = &rec.aborted {
        println!("the rollout of revision {a} was aborted");
    }
    for d in &rec.decisions {
        println!(
            "decision {} {}: {} {} by {}: {}",
            d.at,
            d.action,
            d.node.as_deref().unwrap_or("-"),
            d.revision.as_deref().unwrap_or(""),
            d.by,
            d.why
        );
    }
    if rec.history.is_empty() {
        println!("no history recorded");
    } else {
        println!("history (oldest first, the last {}):", record::HISTORY_KEPT);
        for t in &rec.history {
            println!(
                "  {} {:<26} {}{}",
                t.at,
                t.reason,
                if t.warning { "WARNING " } else { "" },
                t.message
            );
        }
    }
    Ok(crate::exit::ExitCode::Ok)
}

/// Each node's cilium pod against the current revision and its agent's proof, one line
/// each: what the stepper will do with it.
pub(super) fn node_lines(v: &ClusterView) -> Vec<String> {
    let Some((rev, _)) = &v.revision else {
        return vec!["the DaemonSet has no current revision".into()];
    };
    let mut pods: Vec<&CiliumPod> = v.pods.iter().collect();
    pods.sort_by(|a, b| a.node.cmp(&b.node));
    pods.iter()
        .map(|p| {
            let what = if &p.revision != rev {
                format!("on revision {}: to be stepped", p.revision)
            } else {
                match v.proofs.get(&p.node) {
                    Some(Ok(pr)) => match pr.status {
                        plan::ProofStatus::Passed => format!("proven: {}", pr.why),
                        plan::ProofStatus::Failed => format!("FAILED its verification: {}", pr.why),
                        plan::ProofStatus::Pending => format!("being verified: {}", pr.why),
                        plan::ProofStatus::Unproven => {
                            format!("not proven, to be stepped: {}", pr.why)
                        }
                    },
                    Some(Err(e)) => format!("proof unknown: {e}"),
                    None if !v.agents.contains_key(&p.node) => "no stepguard agent".into(),
                    None => "not proven, to be stepped: its container reports no start".into(),
                }
            };
            format!("node {}: pod {} {what}", p.node, p.name)
        })
        .collect()
}

/// Who takes a decision: the Kubernetes user (SelfSubjectReview) and the local user.
pub(super) async fn who(c: &Cluster) -> String {
    let user = ["SUDO_USER", "USER", "LOGNAME"]
        .iter()
        .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
        .unwrap_or_else(|| "unknown".into());
    let local = format!("{user}@{}", identity_host(&c.identity));
    let review = Api::<SelfSubjectReview>::all(c.client.clone())
        .create(&PostParams::default(), &SelfSubjectReview::default())
        .await;
    match review
        .ok()
        .and_then(|r| r.status?.user_info?.username)
        .filter(|u| !u.is_empty())
    {
        Some(u) => format!("{u} ({local})"),
        None => local,
    }
}

pub(super) fn say(json: bool, line: String) {
    if json {
        eprintln!("{line}");
    } else {
        println!("{line}");
    }
}

/// A rollout waiting out something (a transient failure, a plan that refuses to go on): each
/// new reason told once, the pause growing from 0.5 s to 15 s.
#[derive(Default)]
pub(super) struct Waiting {
    pub(super) note: String,
    pub(super) delay: Duration,
}

impl Waiting {
    pub(super) async fn wait(&mut self, json_out: bool, note: String) {
        if note != self.note {
            say(json_out, note.clone());
            self.note = note;
        }
        let d = self.delay.max(Duration::from_millis(500));
        tokio::time::sleep(d).await;
        self.delay = (d * 2).min(Duration::from_secs(15));
    }
}

/// The refusals of a plan, one line each.
pub(super) fn refusals_text(r: &[plan::Refusal]) -> String {
    r.iter()
        .map(|r| format!("  - {r}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `--dry-run`: the interrupted step finished first, the nodes skipped on this revision,
/// then the plan (or why it refuses to go on).
pub(super) fn print_dry_run(
    json_out: bool,
    view: &ClusterView,
    rec: &Record,
    first: &Result<Vec<PlannedStep>, Vec<plan::Refusal>>,
    current: &str,
    batching: Option<(&PlanOpts, plan::Budget, usize)>,
) -> Result<()> {
    // The batches the plan would make were every verdict to pass (the live run re-plans
    // before each batch).
    let batches: Option<Vec<Vec<String>>> = match (batching, first) {
        (Some((o, _, max)), Ok(steps)) if max > 1 => Some(
            plan::batch::simulate(view, o, steps, max)
                .into_iter()
                .map(|b| b.into_iter().map(|s| s.node).collect())
                .collect(),
        ),
        _ => None,
    };
    if json_out {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "interrupted": rec.inflight, "retry": rec.retry, "skipped": rec.skipped,
                "plan": first.as_ref().ok(), "batches": batches,
                "refused": first.as_ref().err(), "view": view}))?
        );
    } else {
        for i in &rec.inflight {
            println!(
                "first, the interrupted step on node {} (step {}, revision {}) is finished: its replacement awaited and its verdict read",
                i.node, i.step, i.revision
            );
        }
        for s in rec.skipped.iter().filter(|s| s.revision == current) {
            println!(
                "node {} is left as it is on this revision (skipped by {}: {})",
                s.node, s.by, s.why
            );
        }
        match &first {
            Ok(p) => print!("{}", plan::render(view, p)),
            Err(r) => println!("after it, the plan refuses to go on:\n{}", refusals_text(r)),
        }
        if let (Some(b), Some((o, budget, max))) = (&batches, batching) {
            println!(
                "in batches of up to {max} nodes (--max-unavailable {budget}{}), growing from 1 while every verdict passes; were every verdict to pass:",
                o.per_domain
                    .map(|d| format!(", at most {d} of one {} per batch", o.domain_label))
                    .unwrap_or_default()
            );
            for (i, nodes) in b.iter().enumerate() {
                println!("  batch {:>2}: {}", i + 1, nodes.join(", "));
            }
        }
    }
    Ok(())
}

/// The rollout's end: the summary and a row per node stepped (or the JSON of it), and the
/// halt when there is one.
pub(super) fn print_end(
    json_out: bool,
    code: crate::exit::ExitCode,
    summary: &str,
    elapsed: Duration,
    results: &[NodeResult],
    rec: &Record,
) -> Result<()> {
    if json_out {
        println!(
            "{}",
            serde_json::to_string_pretty(
                &json!({"exit_code": code.code(), "summary": summary, "elapsed_s": elapsed.as_secs_f64(), "nodes": results, "halt": rec.halt})
            )?
        );
    } else {
        println!("\n{summary} in {:.0}s", elapsed.as_secs_f64());
        println!(
            "  {:<20} {:<22} {:<10} {:>8}  DETAIL",
            "NODE", "WHY", "OUTCOME", "TIME"
        );
        for r in results {
            let (o, d) = match &r.outcome {
                Outcome::Passed { summary, .. } => ("passed", summary.clone()),
                Outcome::Failed { why, .. } => ("FAILED", why.clone()),
                Outcome::Stopped { why } => ("stopped", why.clone()),
                Outcome::Deferred { why } => ("deferred", why.clone()),
                Outcome::Gone { why } => ("gone", why.clone()),
            };
            println!(
                "  {:<20} {:<22} {:<10} {:>7.0}s  {d}",
                r.node, r.why, o, r.elapsed_s
            );
            if let Some(b) = &r.blip {
                println!(
                    "  {:<20} {}; measured: {}",
                    "",
                    b.text(),
                    measured_lan_gaps(&r.outcome)
                );
            }
        }
        if let Some(h) = &rec.halt {
            println!("\n{}", record::halt_text(h));
        }
    }
    Ok(())
}

/// The witnesses' part of a passed step's summary (`as a LAN client sees it …`), or why there
/// is none.
fn measured_lan_gaps(o: &Outcome) -> String {
    match o {
        Outcome::Passed { summary, .. } => match summary.find("as a LAN client sees it") {
            Some(i) => summary[i..].to_string(),
            None => "no witness (--witness URL measures it as LAN clients see it)".into(),
        },
        Outcome::Failed { .. }
        | Outcome::Stopped { .. }
        | Outcome::Deferred { .. }
        | Outcome::Gone { .. } => "no verdict".into(),
    }
}
