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
pub(super) async fn status(c: &Cluster) -> Result<i32> {
    let (lease, rec) = patient(
        "read the rollout lock",
        Duration::from_secs(30),
        None,
        || read_lock(c),
    )
    .await?;
    let Some(lease) = lease else {
        println!(
            "no rollout lock {}/{}: no rollout has run, or its record was removed",
            c.args.lock_namespace,
            c.lock_name()
        );
        return Ok(0);
    };
    let spec = lease.spec.clone().unwrap_or_default();
    let verdict = match &rec.halt {
        Some(h) => match c.view().await {
            Ok((v, _)) => Some(halt_verdict(c, &v, h).await),
            Err(e) => Some(format!(
                "cannot read the cluster for the failed node's verdict: {e:#}"
            )),
        },
        None => None,
    };
    if c.args.output == "json" {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "holder": spec.holder_identity, "renew_time": spec.renew_time.map(|t| t.0.to_string()),
                "inflight": rec.inflight, "halt": rec.halt, "halt_verdict": verdict,
                "retry": rec.retry, "skipped": rec.skipped, "aborted": rec.aborted,
                "decisions": rec.decisions, "history": rec.history}))?
        );
        return Ok(0);
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
    if let Some(i) = &rec.inflight {
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
    Ok(0)
}

/// Who takes a decision: the Kubernetes user (SelfSubjectReview) and the local user.
pub(super) async fn who(c: &Cluster) -> String {
    let user = ["SUDO_USER", "USER", "LOGNAME"]
        .iter()
        .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
        .unwrap_or_else(|| "unknown".into());
    let local = format!(
        "{user}@{}",
        c.identity.rsplit_once('-').map(|h| h.0).unwrap_or("")
    );
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
