//! Gap arithmetic: from a target's probe timeline (send time, success) to its outages.
//! An outage runs from the send time of the first failed probe to the send time of the next
//! successful one. Its edges are only known to within the probe intervals that bracket them:
//! the outage began after the last successful probe before it was sent and the first failed
//! one was sent at or after that; it ended after the last failed probe was sent. The error
//! bound of a measured outage is the larger of those two intervals — the cadence when probes
//! went out on time, wider when they were late (a stalled loop, a busy machine, an agent
//! restart in between).
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Outage {
    /// Send time of the first failed probe (unix seconds).
    pub start: f64,
    /// Send time of the next successful probe; None while still failing.
    pub end: Option<f64>,
    /// Send time of the last successful probe before the outage, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after_ok: Option<f64>,
    /// Send time of the last failed probe of the outage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failed: Option<f64>,
    /// Failed probes in it (0 in records from before it was counted).
    #[serde(default)]
    pub failed: u64,
}

impl Outage {
    /// An outage beginning with a failed probe sent at `start`.
    pub fn begin(start: f64, after_ok: Option<f64>) -> Outage {
        Outage {
            start,
            end: None,
            after_ok,
            last_failed: Some(start),
            failed: 1,
        }
    }

    pub fn duration(&self, now: f64) -> f64 {
        self.end.unwrap_or(now) - self.start
    }

    /// How far the measured start may lie from the true one (None: not bracketed).
    pub fn start_error(&self) -> Option<f64> {
        self.after_ok.map(|a| (self.start - a).max(0.0))
    }

    /// How far the measured end may lie from the true one (None: still open, or not bracketed).
    pub fn end_error(&self) -> Option<f64> {
        let end = self.end?;
        Some((end - self.last_failed.unwrap_or(self.start)).max(0.0))
    }

    /// The error bound of this outage's duration: the larger edge interval; `cadence` stands
    /// in for an edge that is not bracketed.
    pub fn error_bound(&self, cadence: f64) -> f64 {
        self.start_error()
            .unwrap_or(cadence)
            .max(self.end_error().unwrap_or(cadence))
    }
}

/// Summary of a target's outages.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GapSummary {
    /// Longest single outage, seconds.
    pub longest: f64,
    /// ± this many seconds: the longest outage's edge intervals (the cadence when on time).
    pub error_bound: f64,
    pub total: f64,
    pub count: usize,
    /// An outage is still going on.
    pub open: bool,
}

/// Outages in a timeline of `(send time, ok)`; samples need not be sorted.
pub fn outages(samples: &[(f64, bool)]) -> Vec<Outage> {
    outages_after(samples, None)
}

/// As [`outages`], knowing the send time of the last successful probe before `samples`.
pub fn outages_after(samples: &[(f64, bool)], mut last_ok: Option<f64>) -> Vec<Outage> {
    let mut s: Vec<(f64, bool)> = samples.to_vec();
    s.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut out = Vec::new();
    let mut open: Option<Outage> = None;
    for (t, ok) in s {
        match (ok, open.as_mut()) {
            (false, None) => open = Some(Outage::begin(t, last_ok)),
            (false, Some(o)) => {
                o.last_failed = Some(t);
                o.failed += 1;
            }
            (true, _) => {
                if let Some(mut o) = open.take() {
                    o.end = Some(t);
                    out.push(o);
                }
                last_ok = Some(t);
            }
        }
    }
    out.extend(open);
    out
}

pub fn summarize(outages: &[Outage], cadence: f64, now: f64) -> GapSummary {
    let longest = outages
        .iter()
        .max_by(|a, b| a.duration(now).total_cmp(&b.duration(now)));
    GapSummary {
        longest: longest.map(|o| o.duration(now)).unwrap_or(0.0),
        error_bound: longest.map_or(cadence, |o| o.error_bound(cadence)),
        total: outages.iter().map(|o| o.duration(now)).sum(),
        count: outages.len(),
        open: outages.iter().any(|o| o.end.is_none()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Probes every 10 ms over 1 s; the target is down during [0.3, 0.6).
    fn timeline(down: (f64, f64)) -> Vec<(f64, bool)> {
        (0..100)
            .map(|i| i as f64 * 0.01)
            .map(|t| (t, !(t >= down.0 - 1e-9 && t < down.1 - 1e-9)))
            .collect()
    }

    #[test]
    fn a_300ms_blackhole_is_measured_as_300ms_within_the_cadence() {
        let o = outages(&timeline((0.3, 0.6)));
        assert_eq!(o.len(), 1);
        let g = summarize(&o, 0.01, 1.0);
        assert!((g.longest - 0.3).abs() <= 0.01 + 1e-9, "{g:?}");
        assert_eq!(g.count, 1);
        assert!(!g.open);
    }

    #[test]
    fn unsorted_samples_and_several_outages() {
        let mut s = vec![
            (0.0, true),
            (0.2, false),
            (0.1, true),
            (0.3, true),
            (0.5, false),
            (0.4, false),
            (0.9, true),
        ];
        s.reverse();
        let o = outages(&s);
        assert_eq!(
            o.iter().map(|o| (o.start, o.end)).collect::<Vec<_>>(),
            vec![(0.2, Some(0.3)), (0.4, Some(0.9))]
        );
        // The second outage began after the ok probe at 0.3 and its last failure was at 0.5.
        assert_eq!((o[1].after_ok, o[1].last_failed), (Some(0.3), Some(0.5)));
        let g = summarize(&o, 0.01, 1.0);
        assert!((g.longest - 0.5).abs() < 1e-9 && (g.total - 0.6).abs() < 1e-9 && g.count == 2);
    }

    #[test]
    fn an_outage_still_going_counts_up_to_now() {
        let o = outages(&[(0.0, true), (1.0, false), (1.5, false)]);
        assert_eq!(
            o,
            vec![Outage {
                start: 1.0,
                end: None,
                after_ok: Some(0.0),
                last_failed: Some(1.5),
                failed: 2,
            }]
        );
        let g = summarize(&o, 0.01, 3.0);
        assert!(g.open && (g.longest - 2.0).abs() < 1e-9);
    }

    #[test]
    fn late_probes_widen_the_error_bound_of_the_gap_they_touch() {
        // On time at 10 ms: the bound is the cadence.
        let g = summarize(&outages(&timeline((0.3, 0.6))), 0.01, 1.0);
        assert!((g.error_bound - 0.01).abs() < 1e-9, "{g:?}");
        // The probe loop stalled for 80 ms just before the outage ended: the end is only
        // known to within 80 ms, and the bound says so.
        let mut s: Vec<(f64, bool)> = timeline((0.3, 0.6))
            .into_iter()
            .filter(|(t, _)| !(*t > 0.515 && *t < 0.595))
            .collect();
        s.sort_by(|a, b| a.0.total_cmp(&b.0));
        let g = summarize(&outages(&s), 0.01, 1.0);
        assert!((g.error_bound - 0.09).abs() < 1e-6, "{g:?}");
        // Without a successful probe before the outage, its start is not bracketed: the
        // cadence stands in.
        let g = summarize(&outages(&[(1.0, false), (1.01, true)]), 0.01, 2.0);
        assert!((g.error_bound - 0.01).abs() < 1e-9, "{g:?}");
    }

    #[test]
    fn no_failures_no_gap() {
        let g = summarize(&outages(&[(0.0, true), (0.1, true)]), 0.01, 1.0);
        assert_eq!((g.longest, g.count), (0.0, 0));
    }
}
