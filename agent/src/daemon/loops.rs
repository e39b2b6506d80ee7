//! The agent's loops: the probe engine fed by the daemon as a vantage point, the steady DNS
//! queries, the slow loop of node checks, the runner and the implicit-step watcher.
use super::*;

/// Steady DNS queries (`dns.burst` per name and type per interval) into the window.
pub(super) async fn dns_loop(d: Arc<Daemon>, resolver: std::net::SocketAddr) {
    let mut tick = tokio::time::interval(d.opts.probe_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tick.tick().await;
        // `dns.burst` queries per name and type each interval, as the one-shot check sends.
        for name in &d.cfg.dns.names {
            for t in d
                .cfg
                .dns
                .types
                .iter()
                .flat_map(|t| std::iter::repeat_n(t, d.cfg.dns.burst as usize))
            {
                let kind = dns_probe::RecordKind::parse(t).unwrap_or(dns_probe::RecordKind::A);
                let at = unix_now();
                let start = Instant::now();
                let expect = d.cfg.dns.expect.get(name);
                let r = dns_probe::query(
                    resolver,
                    name,
                    kind,
                    d.cfg.dns.timeout,
                    expect.and_then(|a| a.set()),
                    None,
                )
                .await;
                // `baseline`: a changed answer during a step is a failed query.
                let r = match (expect, r) {
                    (Some(crate::config::Answers::Baseline), Ok(mut a)) => {
                        a.addresses.sort();
                        match d.answer_changed(&format!("{resolver}/{name}/{t}"), &a.addresses) {
                            Some(p) => Err(crate::probe::ProbeError::Answer(p)),
                            None => Ok(a),
                        }
                    }
                    (_, r) => r,
                };
                let latency = start.elapsed();
                {
                    let m = lock(&d.metrics);
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
    crate::timeline::start_probes(&d.engine, d);
    for r in d.cfg.dns.resolver_addrs().unwrap_or_default() {
        tokio::spawn(dns_loop(d.clone(), r));
    }
    tokio::spawn(slow_loop(d.clone()));
    tokio::spawn(runner::run(d.clone()));
    // The implicit-step watcher observes the kernel every second: on the kernel runtime.
    d.kernel.spawn(implicit::run(d.clone()));
}
