//! `cargo xtask bench --only fleet`: one template change rolled out over a simulated fleet on
//! a real control plane, by the DaemonSet controller's own RollingUpdate (the anchor: it
//! verifies nothing) and by `stepguard rollout --max-unavailable 10%` (each node verified),
//! side by side in one run (`stepguard-lab fleet`): wall time, API requests by verb and
//! resource from the audit log, the stepper's CPU time and peak RSS; at 100 and 1,000 nodes.
use super::*;

/// The restart a simulated node's cilium pod takes, and the settle each verdict waits.
const RESTART: &str = "2s";
const SETTLE_S: u64 = 5;

pub(super) fn fleet(quick: bool) -> Result<Value> {
    let kube = crate::kube::ensure()?;
    let sizes: &[usize] = if quick { &[100] } else { &[100, 1000] };
    let mut rows = Vec::new();
    for &n in sizes {
        eprintln!("bench: fleet of {n} nodes (minutes at 1,000)");
        let out = run_ok(
            Command::new(lab_bin())
                .args([
                    "fleet",
                    "--nodes",
                    &n.to_string(),
                    "--max-unavailable",
                    "10%",
                    "--restart",
                    RESTART,
                    "--settle",
                    &format!("{SETTLE_S}s"),
                    "--stepguard",
                ])
                .arg(stepguard_bin())
                .arg("--repo")
                .arg(root())
                .env("STEPGUARD_KUBE_BIN", &kube),
        )?;
        let v: Value = serde_json::from_slice(&out.stdout)
            .context("stepguard-lab fleet's report is not JSON")?;
        rows.push(v);
    }
    Ok(json!({"restart": RESTART, "settle_s": SETTLE_S, "rows": rows}))
}

pub(super) fn report_fleet(v: &Value) -> String {
    let mut s = format!(
        "\n## a fleet rollout beside the DaemonSet controller\n\n`stepguard-lab fleet`: a real kube-apiserver, etcd, kube-controller-manager and kube-scheduler; N Nodes; a watching kubelet that starts each cilium pod {} after it is bound; a **simulated** agent per node (its verdict `--settle` {}s after the restart it saw). One template change rolled by the DaemonSet controller's RollingUpdate (`maxUnavailable: 10%`, the anchor: it verifies nothing), then the same change stepped by `stepguard rollout --max-unavailable 10%` on OnDelete. Requests from the audit log: the DaemonSet controller's user for the anchor, the stepper's for its rollout (the controller's own requests during it, creating the replacements, beside them).\n\n| nodes | controller wall | stepguard wall | batches | stepguard wall less the settles | ratio (goal ≤ 1.1) | controller requests | stepguard requests | controller's during stepguard | stepguard CPU | stepguard peak RSS |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
        v["restart"].as_str().unwrap_or("?"),
        v["settle_s"]
    );
    for r in v["rows"].as_array().into_iter().flatten() {
        let a = f(&r["anchor"]["wall_s"]);
        let w = f(&r["stepguard"]["wall_s"]);
        let settles = f(&r["stepguard"]["settle_s_total"]);
        s += &format!(
            "| {} | {:.1} s | {:.1} s | {} | {:.1} s | {:.2} | {} | {} | {} | {:.1} s | {:.0} MiB |\n",
            r["nodes"],
            a,
            w,
            r["stepguard"]["batches"],
            w - settles,
            (w - settles) / a,
            r["anchor"]["total"],
            r["stepguard"]["total"],
            r["controller_during_stepguard"]["total"],
            f(&r["stepguard"]["cpu_s"]),
            f(&r["stepguard"]["max_rss_kib"]) / 1024.0,
        );
    }
    for r in v["rows"].as_array().into_iter().flatten() {
        s += &format!(
            "\n{} nodes, requests by verb and resource — controller: {}; stepguard: {}\n",
            r["nodes"], r["anchor"]["requests"], r["stepguard"]["requests"]
        );
    }
    s
}
