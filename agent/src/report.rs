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
        crate::exit::ExitCode::Ok => Status::Pass,
        crate::exit::ExitCode::Failed => Status::Fail,
        crate::exit::ExitCode::NotDecided => Status::Unknown,
    }
}

pub fn json(results: &[CheckResult]) -> Value {
    json!({
        "node": hostname(),
        "checked_at": crate::kernel::clock::now(),
        "status": overall(results),
        "exit_code": exit_code(results).code(),
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

fn evidence_lines(r: &CheckResult) -> Vec<String> {
    crate::checks::registered(r.check)
        .map(|c| (c.render)(r))
        .unwrap_or_else(|| generic_lines(r))
}

pub use crate::checks::generic_lines;
