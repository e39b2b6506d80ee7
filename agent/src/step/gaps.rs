//! Gap arithmetic: from a target's probe timeline (send time, success) to its outages.
//! An outage runs from the send time of the first failed probe to the send time of the next
//! successful one; its error bound is the probe cadence (the edges are only known to within
//! one probe interval).
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Outage {
    /// Send time of the first failed probe (unix seconds).
    pub start: f64,
    /// Send time of the next successful probe; None while still failing.
    pub end: Option<f64>,
}

impl Outage {
    pub fn duration(&self, now: f64) -> f64 {
        self.end.unwrap_or(now) - self.start
    }
}

/// Summary of a target's outages.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GapSummary {
    /// Longest single outage, seconds.
    pub longest: f64,
    /// ± this many seconds (the probe cadence).
    pub error_bound: f64,
    pub total: f64,
    pub count: usize,
    /// An outage is still going on.
    pub open: bool,
}

/// Outages in a timeline of `(send time, ok)`; samples need not be sorted.
pub fn outages(samples: &[(f64, bool)]) -> Vec<Outage> {
    let mut s: Vec<(f64, bool)> = samples.to_vec();
    s.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut out = Vec::new();
    let mut open: Option<f64> = None;
    for (t, ok) in s {
        match (ok, open) {
            (false, None) => open = Some(t),
            (true, Some(start)) => {
                out.push(Outage {
                    start,
                    end: Some(t),
                });
                open = None;
            }
            _ => {}
        }
    }
    if let Some(start) = open {
        out.push(Outage { start, end: None });
    }
    out
}

pub fn summarize(outages: &[Outage], cadence: f64, now: f64) -> GapSummary {
    GapSummary {
        longest: outages.iter().map(|o| o.duration(now)).fold(0.0, f64::max),
        error_bound: cadence,
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
            o,
            vec![
                Outage {
                    start: 0.2,
                    end: Some(0.3)
                },
                Outage {
                    start: 0.4,
                    end: Some(0.9)
                }
            ]
        );
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
                end: None
            }]
        );
        let g = summarize(&o, 0.01, 3.0);
        assert!(g.open && (g.longest - 2.0).abs() < 1e-9);
    }

    #[test]
    fn no_failures_no_gap() {
        let g = summarize(&outages(&[(0.0, true), (0.1, true)]), 0.01, 1.0);
        assert_eq!((g.longest, g.count), (0.0, 0));
    }
}
