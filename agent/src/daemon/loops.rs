//! The agent's loops: the probe engine fed by the daemon as a vantage point, the steady DNS
//! queries, the slow loop of node checks, the runner and the implicit-step watcher.
use super::*;

/// Steady DNS queries (`dns.burst` per name and type per interval) into the window: one
/// round per interval, sent one after another on one blocking-pool task.
pub(super) async fn dns_loop(d: Arc<Daemon>, resolver: std::net::SocketAddr) {
    let mut tick = tokio::time::interval(d.opts.probe_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    // `dns.burst` queries per name and type each interval, as the one-shot check sends.
    let dns = &d.cfg.dns;
    let round: Vec<(String, String)> = dns
        .names
        .iter()
        .flat_map(|name| {
            dns.types.iter().flat_map(move |t| {
                std::iter::repeat_n((name.clone(), t.clone()), dns.burst as usize)
            })
        })
        .collect();
    loop {
        tick.tick().await;
        let questions = round
            .iter()
            .map(|(name, t)| dns_probe::RoundQuestion {
                name: name.clone(),
                kind: dns_probe::RecordKind::parse(t).unwrap_or(dns_probe::RecordKind::A),
                expect: d
                    .cfg
                    .dns
                    .expect
                    .get(name)
                    .and_then(|a| a.set())
                    .map(<[std::net::IpAddr]>::to_vec),
            })
            .collect();
        let answers = dns_probe::query_round(resolver, questions, d.cfg.dns.timeout).await;
        for ((name, t), a) in round.iter().zip(answers) {
            // `baseline`: a changed answer during a step is a failed query.
            let r = match (d.cfg.dns.expect.get(name), a.result) {
                (Some(crate::config::Answers::Baseline), Ok(mut ans)) => {
                    ans.addresses.sort();
                    match d.answer_changed(&format!("{resolver}/{name}/{t}"), &ans.addresses) {
                        Some(p) => Err(crate::probe::ProbeError::Answer(p)),
                        None => Ok(ans),
                    }
                }
                (_, r) => r,
            };
            let latency = a.latency;
            {
                let m = &d.metrics;
                let l = ProbeLabels {
                    kind: "dns_resolver".into(),
                    target: resolver.to_string(),
                };
                m.probes
                    .duration
                    .get_or_create(&l)
                    .observe(latency.as_secs_f64());
                if r.is_err() {
                    m.probes.failures.get_or_create(&l).inc();
                }
            }
            let mut p = lock(&d.probes);
            let at = a.at;
            p.dns.push_back(DnsSample {
                at,
                resolver: resolver.to_string(),
                latency: r.as_ref().ok().map(|_| latency),
                timed_out: matches!(r, Err(crate::probe::ProbeError::Timeout { .. })),
                error: r.err().map(|e| e.to_string()),
            });
            while p.dns.front().is_some_and(|s| s.at < at - DNS_WINDOW_S) {
                p.dns.pop_front();
            }
        }
    }
}

pub(super) async fn slow_loop(d: Arc<Daemon>) {
    loop {
        let d2 = d.clone();
        let _ = d
            .kernel
            .spawn(async move {
                d2.refresh_node().await;
                crate::kernel::release_freed_memory();
            })
            .await;
        tokio::select! {
            _ = tokio::time::sleep(d.opts.slow_interval) => {}
            _ = d.wake_slow.notified() => {}
        }
    }
}

/// Starts every loop; returns when they are running.
pub fn spawn_loops(d: &Arc<Daemon>) {
    d.host.start(d);
    for r in d.cfg.dns.resolver_addrs().unwrap_or_default() {
        tokio::spawn(dns_loop(d.clone(), r));
    }
    tokio::spawn(slow_loop(d.clone()));
    tokio::spawn(runner::run(d.clone()));
    // The implicit-step watcher observes the kernel every second: on the kernel runtime.
    d.kernel.spawn(implicit::run(d.clone()));
}
