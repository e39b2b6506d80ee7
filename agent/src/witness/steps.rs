//! The witness's steps: begun by a node's agent (idempotent per id, bounded in number and
//! length), reported with their gaps, MAC changes and probe counts, ended by the agent or
//! by their own timeout.
use super::*;

/// How much earlier than the asking agent's own step a witness's step must have begun before
/// its report is clipped to the agent's window (clocks of two machines on a LAN differ).
pub const CLIP_SLACK_S: f64 = 2.0;

impl Witness {
    /// Begins (or finds) the step `id`.
    pub fn begin(&self, r: &WitnessStepRequest) -> Result<WitnessBegun, BeginRefused> {
        self.begin_checked(r).map_err(BeginRefused::Invalid)?;
        let now = clock::now();
        if let Some(s) = lock(&self.steps).get(&r.id) {
            return if s.request == *r {
                Ok(WitnessBegun {
                    id: r.id.clone(),
                    instance: self.instance.clone(),
                    created_at: s.created_at,
                })
            } else {
                Err(BeginRefused::Conflict(format!(
                    "step {:?} exists on this witness with other parameters: begin it with the same ones, or use another id",
                    r.id
                )))
            };
        }
        let _ = now;
        self.begin_new(r).map_err(BeginRefused::Invalid)
    }

    /// Validates a request (the field named on one line).
    fn begin_checked(&self, r: &WitnessStepRequest) -> Result<(), String> {
        self.params(r).map(|_| ())
    }

    fn params(&self, r: &WitnessStepRequest) -> Result<(Duration, Duration, Duration), String> {
        if !crate::step::admission::valid_id(&r.id) {
            return Err(format!("id: {}", crate::step::admission::ID_RULE));
        }
        let d = |field: &str, v: &Option<String>, default, min, max| {
            crate::duration::field(field, v.as_deref(), default, min, max)
        };
        let ms = Duration::from_millis;
        let burst = d(
            "burst_interval",
            &r.burst_interval,
            self.opts.burst_interval,
            ms(1),
            ms(10_000),
        )?;
        let timeout = d("timeout", &r.timeout, ms(900_000), ms(1_000), MAX_STEP)?;
        let max_gap = d("max_gap", &r.max_gap, ms(5_000), ms(1), ms(3_600_000))?;
        Ok((burst, timeout, max_gap))
    }

    fn begin_new(&self, r: &WitnessStepRequest) -> Result<WitnessBegun, String> {
        let (burst, timeout, max_gap) = self.params(r)?;
        let now = clock::now();
        let mut steps = lock(&self.steps);
        if let Some(s) = steps.get(&r.id) {
            // Begun by a concurrent request meanwhile.
            return Ok(WitnessBegun {
                id: r.id.clone(),
                instance: self.instance.clone(),
                created_at: s.created_at,
            });
        }
        // Forget the oldest ended steps, then the oldest, to stay bounded.
        while steps.len() >= MAX_STEPS {
            let victim = steps
                .iter()
                .filter(|(_, s)| !s.active(now))
                .min_by(|a, b| a.1.created_at.total_cmp(&b.1.created_at))
                .or_else(|| {
                    steps
                        .iter()
                        .min_by(|a, b| a.1.created_at.total_cmp(&b.1.created_at))
                })
                .map(|(k, _)| k.clone());
            match victim {
                Some(k) => steps.remove(&k),
                None => break,
            };
        }
        let mut targets = crate::step::timelines(
            &self.cfg.targets,
            crate::step::Budgets {
                max_gap,
                max_loss: None,
                max_total_gap: None,
            },
        );
        let created_at = match r.since {
            Some(t) if t.is_finite() && t < now && t >= now - RING_S => {
                self.host.recorder.seed(&mut targets, t);
                t
            }
            _ => now,
        };
        steps.insert(
            r.id.clone(),
            WStep {
                request: r.clone(),
                created_at,
                until: now + timeout.as_secs_f64(),
                ended_at: None,
                burst,
                targets,
                latencies: BTreeMap::new(),
            },
        );
        drop(steps);
        self.changed.send_modify(|v| *v += 1);
        self.host.wake();
        Ok(WitnessBegun {
            id: r.id.clone(),
            instance: self.instance.clone(),
            created_at,
        })
    }

    /// The lease moves seen lately, each with the outage around it (continuous probes).
    pub fn moves(&self) -> Vec<Move> {
        let cadence = self.opts.probe_interval.as_secs_f64();
        let now = clock::now();
        lock(&self.moves)
            .iter()
            .map(|m| {
                let samples = self
                    .host
                    .recorder
                    .window(&m.target, m.at - 60.0, m.at + 60.0);
                let outage = crate::step::gaps::outages(&samples)
                    .into_iter()
                    .filter(|o| o.start <= m.at + 1.0 && o.end.unwrap_or(now) >= m.at - 1.0)
                    .max_by(|a, b| a.duration(now).total_cmp(&b.duration(now)));
                Move {
                    gap_s: outage.as_ref().map(|o| o.duration(now)),
                    error_bound_s: outage.as_ref().map(|o| o.error_bound(cadence)),
                    outage_start: outage.as_ref().map(|o| o.start),
                    outage_end: outage.as_ref().and_then(|o| o.end),
                    ..m.clone()
                }
            })
            .collect()
    }

    /// Ends the step (its evidence stays readable). False when unknown.
    pub fn end(&self, id: &str) -> bool {
        let now = clock::now();
        let found = lock(&self.steps).get_mut(id).map(|s| {
            if s.ended_at.is_none() {
                s.ended_at = Some(now);
            }
        });
        self.changed.send_modify(|v| *v += 1);
        found.is_some()
    }

    /// The report of step `id`; `after`: where the "after" latencies start; `from`: the
    /// asking agent's own step window starts there, so the gaps count only probes sent from
    /// then (a step begun earlier under the same id, by anyone, cannot bring in an outage
    /// from before the agent's step).
    pub fn report(&self, id: &str, after: Option<f64>, from: Option<f64>) -> Option<WitnessReport> {
        let now = clock::now();
        let steps = lock(&self.steps);
        let s = steps.get(id)?;
        let end = s.ended_at.unwrap_or(now).min(s.until);
        let complete_until = crate::timeline::complete_until(now, &self.cfg.targets)
            .min(end)
            .max(s.created_at);
        let cadence = s.burst.as_secs_f64();
        // Clipped only when this witness's step clearly began before the asking agent's (by
        // someone else, under the same id): `from` is on the agent's clock, and a witness
        // whose clock is a little behind must not lose the start of its evidence.
        let from = from.filter(|f| *f > s.created_at + CLIP_SLACK_S);
        let gaps = s
            .targets
            .iter()
            .map(|(name, t)| match from {
                Some(f) => {
                    let mut clipped = t.clone();
                    clipped.samples.retain(|x| x.sent >= f);
                    // An outage already folded away that runs into the window counts from
                    // the window's start.
                    clipped.prior.retain(|o| o.end.is_none_or(|e| e > f));
                    for o in &mut clipped.prior {
                        o.start = o.start.max(f);
                    }
                    // The counts the loss is judged on, over the window too.
                    clipped.probes = clipped.samples.len() as u64;
                    clipped.failures = clipped.samples.iter().filter(|x| !x.ok).count() as u64;
                    gap_row(name, &clipped, cadence, complete_until)
                }
                None => gap_row(name, t, cadence, complete_until),
            })
            .collect();
        let probes = s
            .targets
            .iter()
            .map(|(k, t)| (k.clone(), t.count()))
            .collect();
        let steady = lock(&self.steady);
        let mut latency_ms = BTreeMap::new();
        for t in &self.cfg.targets {
            let before: Vec<f32> = steady
                .get(&t.name)
                .map(|q| {
                    q.iter()
                        .filter(|x| x.0 < s.created_at && x.0 >= s.created_at - 60.0)
                        .map(|x| x.1)
                        .collect()
                })
                .unwrap_or_default();
            let after_v: Vec<f32> = match after {
                Some(a) => s
                    .latencies
                    .get(&t.name)
                    .map(|q| q.iter().filter(|x| x.0 >= a).map(|x| x.1).collect())
                    .unwrap_or_default(),
                None => vec![],
            };
            latency_ms.insert(
                t.name.clone(),
                Latency {
                    before_p50_ms: quantile_ms(&before, 0.5),
                    before_p99_ms: quantile_ms(&before, 0.99),
                    after_p50_ms: quantile_ms(&after_v, 0.5),
                    after_p99_ms: quantile_ms(&after_v, 0.99),
                },
            );
        }
        let macs = match &self.neigh {
            Some(n) => self
                .cfg
                .targets
                .iter()
                .map(|t| {
                    (
                        t.name.clone(),
                        n.since(t.address, s.created_at)
                            .into_iter()
                            .filter(|c| c.0 <= end)
                            .map(|(at, mac)| MacChange { at, mac })
                            .collect(),
                    )
                })
                .collect(),
            None => BTreeMap::new(),
        };
        Some(WitnessReport {
            id: id.to_string(),
            instance: self.instance.clone(),
            created_at: s.created_at,
            complete_until,
            ended: s.ended_at.is_some() || now >= s.until,
            burst_interval: s.burst,
            gaps,
            macs,
            probes,
            latency_ms,
        })
    }
}
