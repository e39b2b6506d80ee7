//! Check results for people (a table, then the evidence that matters) and for machines (JSON
//! with stable field names: `status`, `exit_code`, `checks[].{check,status,code,reason,
//! duration_ms,evidence}`).
use crate::checks::{exit_code, CheckResult, Status};
use serde_json::{json, Value};

pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

fn overall(results: &[CheckResult]) -> Status {
    match exit_code(results) {
        0 => Status::Pass,
        1 => Status::Fail,
        _ => Status::Unknown,
    }
}

pub fn json(results: &[CheckResult]) -> Value {
    json!({
        "node": hostname(),
        "checked_at": crate::probe::unix_now(),
        "status": overall(results),
        "exit_code": exit_code(results),
        "checks": results,
    })
}

/// A table an on-call engineer reads at 3 a.m., then one evidence block per check.
pub fn text(results: &[CheckResult]) -> String {
    let mut out = String::new();
    let status = overall(results);
    out.push_str(&format!(
        "node {}: {}\n\n",
        hostname(),
        status.as_str().to_uppercase()
    ));
    out.push_str(&format!(
        "{:<8} {:<8} {:<22} {}\n",
        "CHECK", "STATUS", "CODE", "REASON"
    ));
    for r in results {
        out.push_str(&format!(
            "{:<8} {:<8} {:<22} {}\n",
            r.check,
            r.status.as_str(),
            r.code,
            r.reason
        ));
    }
    for r in results {
        out.push_str(&format!(
            "\n[{}] {:.1} ms\n",
            r.check,
            r.duration_ms.as_secs_f64() * 1e3
        ));
        for line in evidence_lines(r) {
            out.push_str(&format!("  {line}\n"));
        }
    }
    out
}

fn s(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

fn evidence_lines(r: &CheckResult) -> Vec<String> {
    let e = &r.evidence;
    let mut l = Vec::new();
    match r.check {
        "devices" => {
            l.push(format!(
                "expected {} (from {})",
                s(&e["expected"]),
                s(&e["expected_from"]["source"])
            ));
            l.push(format!("selected {}", s(&e["selected"])));
            for d in e["devices"].as_array().into_iter().flatten() {
                let progs: Vec<String> = d["programs"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|p| {
                        format!(
                            "{}:{}#{}({})",
                            p["hook"].as_str().unwrap_or(""),
                            p["name"].as_str().or(p["filter"].as_str()).unwrap_or("?"),
                            p["prog_id"],
                            p["via"].as_str().unwrap_or("")
                        )
                    })
                    .collect();
                l.push(format!(
                    "{:<14} {}",
                    s(&d["device"]),
                    if progs.is_empty() {
                        "-".into()
                    } else {
                        progs.join(" ")
                    }
                ));
            }
            if let Some(n) = e["endpoint_devices"].as_u64() {
                l.push(format!("endpoint devices (lxc*): {n}"));
            }
        }
        "maps" => {
            l.push(format!(
                "Cilium {} ({}), features from {}",
                s(&e["cilium"]),
                s(&e["cilium_from"]),
                s(&e["features_from"])
            ));
            for m in e["maps"].as_array().into_iter().flatten() {
                l.push(format!(
                    "{:<28} {:<16} {:>3}/{:<4} max {:<8} entries {}",
                    s(&m["name"]),
                    s(&m["type"]),
                    m["key_size"],
                    m["value_size"],
                    m["max_entries"],
                    s(&m["entries"])
                ));
            }
            l.push(format!("per-endpoint maps: {}", s(&e["endpoint_maps"])));
        }
        "vips" => {
            for t in e["targets"].as_array().into_iter().flatten() {
                l.push(format!(
                    "{:<12} {}:{} {:<5} {} in {} ms: {}",
                    s(&t["name"]),
                    s(&t["address"]),
                    t["port"],
                    s(&t["probe"]),
                    if t["ok"] == true { "ok" } else { "FAILED" },
                    t["latency_ms"],
                    s(&t["detail"])
                ));
            }
        }
        "dns" => {
            for r in e["resolvers"].as_array().into_iter().flatten() {
                l.push(format!(
                    "{:<22} {}/{} answered, p50 {} ms, p99 {} ms {}",
                    s(&r["resolver"]),
                    r["answered"],
                    r["queries"],
                    s(&r["p50_ms"]),
                    s(&r["p99_ms"]),
                    s(&r["errors"])
                ));
            }
        }
        _ => {
            if let Some(o) = e.as_object() {
                for (k, v) in o {
                    l.push(format!("{k}: {}", s(v)));
                }
            }
        }
    }
    l
}
