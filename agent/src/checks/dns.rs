//! `dns`: resolvers × names × record types, queried in a short burst with a real DNS client
//! (hickory-proto messages over UDP): no cache, no retries. Success ratio and p50/p99 latency
//! against configured thresholds. SERVFAIL, wrong answers and timeouts are failures.
use super::CheckResult;
use crate::checks::Code;
use crate::config::DnsConfig;
use crate::probe::dns::{self, RecordKind};
use crate::stats::quantile;
use serde_json::json;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

pub const CHECK: &str = "dns";

/// One resolver query in the agent's steady DNS window.
#[derive(Clone, Debug)]
pub struct DnsSample {
    pub at: f64,
    pub resolver: String,
    pub latency: Option<Duration>,
    pub error: Option<String>,
    /// The query timed out (no answer at all).
    pub timed_out: bool,
}

/// The `dns` check looks at this recent window of the agent's steady queries, so it
/// recovers soon after an outage.
pub const WINDOW_S: f64 = 10.0;

/// One resolver's burst.
#[derive(Clone, Debug, Default)]
pub struct ResolverSample {
    pub resolver: String,
    pub sent: u32,
    pub ok: u32,
    pub not_run: u32,
    /// Failures that were timeouts (no answer at all).
    pub timeouts: u32,
    pub latencies: Vec<Duration>,
    pub errors: Vec<String>,
}

pub async fn burst(resolver: SocketAddr, cfg: &DnsConfig) -> ResolverSample {
    let mut s = ResolverSample {
        resolver: resolver.to_string(),
        ..Default::default()
    };
    for name in &cfg.names {
        for t in &cfg.types {
            let kind = RecordKind::parse(t).unwrap_or(RecordKind::A);
            for _ in 0..cfg.burst {
                let start = Instant::now();
                let expect = cfg.expect.get(name).and_then(|a| a.set());
                let r = dns::query(resolver, name, kind, cfg.timeout, expect, None).await;
                s.sent += 1;
                match r {
                    Ok(_) => {
                        s.ok += 1;
                        s.latencies.push(start.elapsed());
                    }
                    Err(e) => {
                        if !e.ran() {
                            s.not_run += 1;
                        }
                        if matches!(e, crate::probe::ProbeError::Timeout { .. }) {
                            s.timeouts += 1;
                        }
                        let e = e.to_string();
                        if s.errors.len() < 3 && !s.errors.contains(&e) {
                            s.errors.push(e);
                        }
                    }
                }
            }
        }
    }
    s
}

pub async fn run(cfg: &DnsConfig) -> CheckResult {
    let resolvers = match cfg.resolver_addrs() {
        Ok(r) => r,
        Err(e) => return CheckResult::unknown(CHECK, Code::ConfigError, e.to_string(), json!({})),
    };
    if resolvers.is_empty() || cfg.names.is_empty() {
        return CheckResult::unknown(
            CHECK,
            Code::NoResolvers,
            "no DNS resolvers/names configured (`dns.resolvers`, `dns.names`)",
            json!({}),
        );
    }
    let samples = futures_util::future::join_all(resolvers.iter().map(|r| burst(*r, cfg))).await;
    evaluate(cfg, &samples)
}

fn ms(d: Option<Duration>) -> Option<f64> {
    d.map(|d| (d.as_secs_f64() * 1e6).round() / 1e3)
}

pub fn evaluate(cfg: &DnsConfig, samples: &[ResolverSample]) -> CheckResult {
    let sent: u32 = samples.iter().map(|s| s.sent).sum();
    let ok: u32 = samples.iter().map(|s| s.ok).sum();
    let not_run: u32 = samples.iter().map(|s| s.not_run).sum();
    let all: Vec<Duration> = samples
        .iter()
        .flat_map(|s| s.latencies.iter().copied())
        .collect();
    let (p50, p99) = (quantile(&all, 0.5), quantile(&all, 0.99));
    let ratio = if sent == 0 {
        0.0
    } else {
        ok as f64 / sent as f64
    };
    let evidence = json!({
        "queries": sent, "answered": ok, "success_ratio": ratio,
        "p50_ms": ms(p50), "p99_ms": ms(p99),
        "min_success_ratio": cfg.min_success_ratio, "max_p99_ms": cfg.max_p99.as_millis() as u64,
        "names": cfg.names, "types": cfg.types, "burst": cfg.burst,
        "resolvers": samples.iter().map(|s| json!({
            "resolver": s.resolver, "queries": s.sent, "answered": s.ok,
            "p50_ms": ms(quantile(&s.latencies, 0.5)), "p99_ms": ms(quantile(&s.latencies, 0.99)), "errors": s.errors,
        })).collect::<Vec<_>>(),
    });
    if sent == 0 || not_run == sent {
        let why = samples
            .iter()
            .flat_map(|s| s.errors.first())
            .next()
            .cloned()
            .unwrap_or_else(|| "no queries sent".into());
        return CheckResult::unknown(
            CHECK,
            Code::ProbeNotRun,
            format!("could not query: {why}"),
            evidence,
        );
    }
    if ratio < cfg.min_success_ratio {
        let worst: Vec<String> = samples
            .iter()
            .filter(|s| s.ok < s.sent)
            .map(|s| {
                format!(
                    "{}: {}/{} answered ({})",
                    s.resolver,
                    s.ok,
                    s.sent,
                    s.errors.join("; ")
                )
            })
            .collect();
        let code = if ok == 0 && samples.iter().all(|s| s.timeouts == s.sent - s.ok) {
            Code::DnsTimeout
        } else {
            Code::DnsFailures
        };
        return CheckResult::fail(
            CHECK,
            code,
            format!(
                "success {:.0}% < {:.0}%: {}",
                ratio * 100.0,
                cfg.min_success_ratio * 100.0,
                worst.join(" | ")
            ),
            evidence,
        );
    }
    if let Some(p) = p99.filter(|p| *p > cfg.max_p99) {
        return CheckResult::fail(
            CHECK,
            Code::DnsSlow,
            format!(
                "p99 {:.1}ms > {}ms",
                p.as_secs_f64() * 1e3,
                cfg.max_p99.as_millis()
            ),
            evidence,
        );
    }
    CheckResult::pass(
        CHECK,
        Code::DnsOk,
        format!(
            "{ok}/{sent} answered, p50 {:.1}ms, p99 {:.1}ms",
            p50.unwrap_or_default().as_secs_f64() * 1e3,
            p99.unwrap_or_default().as_secs_f64() * 1e3
        ),
        evidence,
    )
}

/// The `dns` check from the agent's recent window of steady resolver queries
/// ([`WINDOW_S`]). Resolvers that never answered since the agent started are unknown, not
/// failed.
pub fn from_probes(w: &super::ProbeWindows) -> CheckResult {
    let resolvers = w.cfg.dns.resolver_addrs().unwrap_or_default();
    if resolvers.is_empty() || w.cfg.dns.names.is_empty() {
        return CheckResult::unknown(
            CHECK,
            Code::NoResolvers,
            "no DNS resolvers/names configured (`dns.resolvers`, `dns.names`)",
            json!({}),
        );
    }
    let mut samples = Vec::new();
    let mut ever_answered = false;
    for r in &resolvers {
        let key = r.to_string();
        let mut s = ResolverSample {
            resolver: key.clone(),
            ..Default::default()
        };
        for d in w.dns.iter().filter(|d| d.resolver == key) {
            ever_answered |= d.latency.is_some();
            if d.at < w.now - WINDOW_S {
                continue;
            }
            s.sent += 1;
            s.timeouts += d.timed_out as u32;
            match (&d.latency, &d.error) {
                (Some(l), _) => {
                    s.ok += 1;
                    s.latencies.push(*l);
                }
                (None, Some(e)) if s.errors.len() < 3 && !s.errors.contains(e) => {
                    s.errors.push(e.clone())
                }
                _ => {}
            }
        }
        samples.push(s);
    }
    if samples.iter().all(|s| s.sent == 0) {
        return CheckResult::unknown(
            CHECK,
            Code::NoProbeYet,
            "no DNS query in the last 10s yet",
            json!({}),
        );
    }
    let r = evaluate(&w.cfg.dns, &samples);
    if r.status == super::Status::Fail && !ever_answered {
        return CheckResult::unknown(
            CHECK,
            Code::ResolverNeverAnswered,
            format!(
                "no resolver has answered since the agent started: {}",
                r.reason
            ),
            r.evidence,
        );
    }
    r
}

/// The `dns` node check: a burst of queries per resolver (in the agent: its steady window).
pub const NODE_CHECK: super::NodeCheck = super::NodeCheck {
    name: CHECK,
    needs: super::Needs {
        links: false,
        maps: false,
        agent: false,
        status: false,
    },
    from_probes: Some(from_probes),
    evaluate: |i| Box::pin(run(&i.cfg.dns)),
    render,
};

/// The `dns` check's evidence as lines for people.
pub fn render(r: &CheckResult) -> Vec<String> {
    let e = &r.evidence;
    let s = super::show;
    let mut l = Vec::new();
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
    l
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::Status;

    fn sample(ok: u32, sent: u32, lat_ms: u64, err: &str) -> ResolverSample {
        ResolverSample {
            resolver: "192.0.2.53:53".into(),
            sent,
            ok,
            not_run: 0,
            timeouts: if err.starts_with("timeout") {
                sent - ok
            } else {
                0
            },
            latencies: vec![Duration::from_millis(lat_ms); ok as usize],
            errors: if err.is_empty() {
                vec![]
            } else {
                vec![err.into()]
            },
        }
    }

    #[test]
    fn thresholds_decide() {
        let cfg = DnsConfig {
            names: vec!["a.test".into()],
            resolvers: vec!["192.0.2.53".into()],
            ..Default::default()
        };
        assert_eq!(evaluate(&cfg, &[sample(5, 5, 2, "")]).status, Status::Pass);
        let r = evaluate(&cfg, &[sample(4, 5, 2, "Server Failure for a.test")]);
        assert_eq!((r.status, r.code.as_str()), (Status::Fail, "dns_failures"));
        let r = evaluate(&cfg, &[sample(0, 5, 0, "timeout after 1000ms")]);
        assert_eq!(r.code, Code::DnsTimeout);
        // The code follows the counted timeouts, not the wording of the errors.
        let mut reworded = sample(0, 5, 0, "no answer in time");
        reworded.timeouts = 5;
        assert_eq!(evaluate(&cfg, &[reworded]).code, Code::DnsTimeout);
        let r = evaluate(&cfg, &[sample(5, 5, 900, "")]);
        assert_eq!(r.code, "dns_slow");
    }

    /// The `dns` check with `dns.expect`: a resolver answering 127.0.0.1 fails it (before, any
    /// answer passed the check).
    #[tokio::test]
    async fn a_resolver_giving_the_wrong_answer_fails_the_check() {
        let answer =
            std::sync::Arc::new(std::sync::Mutex::new(std::net::Ipv4Addr::new(127, 0, 0, 1)));
        let server = crate::probe::dns::testserver::start(answer.clone());
        let cfg = crate::config::Config::parse(&format!(
            "dns: {{resolvers: [\"{server}\"], names: [gw.test], burst: 2, timeout: 500ms, expect: {{gw.test: [198.51.100.10]}}}}\n"
        ))
        .unwrap()
        .dns;
        let r = run(&cfg).await;
        assert_eq!(
            (r.status, r.code.as_str()),
            (Status::Fail, "dns_failures"),
            "{}",
            r.reason
        );
        assert!(r.reason.contains("wrong answer"), "{}", r.reason);
        *answer.lock().unwrap() = std::net::Ipv4Addr::new(198, 51, 100, 10);
        assert_eq!(run(&cfg).await.status, Status::Pass);
    }

    #[test]
    fn queries_that_could_not_be_sent_are_unknown() {
        let cfg = DnsConfig::default();
        let mut s = sample(0, 5, 0, "udp socket: permission denied");
        s.not_run = 5;
        assert_eq!(evaluate(&cfg, &[s]).status, Status::Unknown);
    }
}
