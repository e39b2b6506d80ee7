//! Gap arithmetic: from a target's probe timeline to its outages.
//! An outage runs from the send time of the first failed probe to the moment the next answer
//! shows the path working again. Its edges are only known to within what brackets them: the
//! outage began after the last successful probe before it was sent and the first failed one
//! was sent at or after that; it ended after the last failed probe was sent and, at the
//! latest, when the first answer after it shows the path working. The error bound of a
//! measured outage is the larger of those two intervals — the cadence when probes went out on
//! time, wider when they were late (a stalled loop, a busy machine, an agent restart in
//! between) or when the answers that ended it were held back.
//!
//! Held answers: a probe sent into an outage is not always lost. The client's
//! kernel queues packets for a neighbour entry that is resolving (INCOMPLETE: up to
//! `unres_qlen_bytes`, for up to ~3 s of ARP probes) and sends them the moment an answer or a
//! gratuitous ARP resolves it; a probe sent up to its timeout before the path came back is
//! then answered in time. Counting it at its send time would end the outage up to a timeout
//! early while claiming the cadence as the bound. So an answer counts at the latest moment it
//! allows for the path to have come back: its send time plus whatever its round trip took
//! beyond the target's usual one ([`RttFloor`]), i.e. when the held packet was released. An
//! answer that was only slow (a busy server) is counted late the same way: the gap may come
//! out longer, never shorter, and the bound reaches back to the last failed probe, because
//! from the outside a held probe and a slow answer look the same.
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Outage {
    /// Send time of the first failed probe (unix seconds).
    pub start: f64,
    /// When the answer that ended it shows the path working again (its send time plus its
    /// round trip beyond the target's usual one); None while still failing.
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
    /// How long the answer that ended it was held beyond the target's usual round trip
    /// (seconds), when more than the usual jitter: the probe was queued (a resolving
    /// neighbour entry) or the answer slow, so the end is the answer's, not the send time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held: Option<f64>,
}

fn longer(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

/// An answer held less than this beyond the usual round trip is ordinary jitter (not shown as
/// held; it still counts at its release time).
pub const HELD_MIN_S: f64 = 0.002;

/// One probe's evidence for the gap arithmetic.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    /// Send time (unix seconds).
    pub sent: f64,
    pub ok: bool,
    /// Answered: the latest moment the answer allows for the path to have come back (the send
    /// time plus the round trip beyond the target's usual one). Failed: the send time.
    pub up_by: f64,
}

impl Sample {
    /// A probe that failed (or was judged failed), sent at `sent`.
    pub fn failed(sent: f64) -> Sample {
        Sample {
            sent,
            ok: false,
            up_by: sent,
        }
    }

    /// A probe answered after `rtt` seconds, when the target usually answers in `floor`.
    pub fn answered(sent: f64, rtt: f64, floor: f64) -> Sample {
        Sample {
            sent,
            ok: true,
            up_by: sent + (rtt - floor).max(0.0),
        }
    }

    /// A probe's sample from its outcome, its round trip judged against `floor` (which must
    /// already include this answer, see [`RttFloor::observe`]).
    pub fn of(sent: f64, ok: bool, rtt: f64, floor: f64) -> Sample {
        if ok {
            Sample::answered(sent, rtt, floor)
        } else {
            Sample::failed(sent)
        }
    }

    /// Held beyond the usual round trip (seconds).
    pub fn held(&self) -> f64 {
        (self.up_by - self.sent).max(0.0)
    }
}

/// `(send time, ok)`, answered in the usual time (tests, and evidence without round trips).
impl From<(f64, bool)> for Sample {
    fn from((sent, ok): (f64, bool)) -> Sample {
        Sample {
            sent,
            ok,
            up_by: sent,
        }
    }
}

/// The fastest round trip a target answered in lately: the minimum over the last
/// [`RttFloor::WINDOW_S`] seconds, kept per second (bounded memory). A held answer cannot
/// lower it, and a path that became slower for good raises it within the window.
#[derive(Clone, Debug, Default)]
pub struct RttFloor {
    /// (whole second, fastest round trip answered in it).
    buckets: std::collections::VecDeque<(i64, f64)>,
}

impl RttFloor {
    pub const WINDOW_S: f64 = 60.0;

    /// Takes in an answer sent at `at` with round trip `rtt`; returns the floor, this answer
    /// included. After a minute without answers (a long outage) the last floor known stays
    /// for the second that ends it, so the held answers that end the outage are judged
    /// against the usual round trip, not against each other.
    pub fn observe(&mut self, at: f64, rtt: f64) -> f64 {
        let sec = at.floor() as i64;
        // Probes finish out of order: an answer may belong to an older second (kept in the
        // newest bucket when that second has none).
        let newest = self.buckets.back().map(|b| b.0);
        match newest {
            Some(n) if n < sec => self.buckets.push_back((sec, rtt)),
            None => self.buckets.push_back((sec, rtt)),
            Some(_) => {
                let b = self
                    .buckets
                    .iter_mut()
                    .rev()
                    .find(|b| b.0 <= sec)
                    .filter(|b| b.0 == sec);
                match b {
                    Some(b) => b.1 = b.1.min(rtt),
                    None => {
                        if let Some(b) = self.buckets.back_mut() {
                            b.1 = b.1.min(rtt);
                        }
                    }
                }
            }
        }
        let oldest = sec - Self::WINDOW_S as i64;
        let mut pruned: Option<f64> = None;
        while let Some(b) = self.buckets.front().filter(|b| b.0 < oldest).copied() {
            pruned = Some(pruned.map_or(b.1, |p: f64| p.min(b.1)));
            self.buckets.pop_front();
        }
        if let Some(p) = pruned.filter(|_| self.buckets.len() == 1) {
            self.buckets.push_front((oldest, p));
        }
        self.floor().unwrap_or(rtt)
    }

    pub fn floor(&self) -> Option<f64> {
        self.buckets.iter().map(|b| b.1).reduce(f64::min)
    }
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
            held: None,
        }
    }

    /// Ends it with the answer `s` (the first after it, or one sent before its end that shows
    /// the path working earlier). `held` is the longest hold among the answers that ended it:
    /// answers released together come back in any order, so the earliest release may be one
    /// sent just before it, held only a moment.
    fn close_with(&mut self, s: &Sample) {
        let held = Some(s.held()).filter(|h| *h >= HELD_MIN_S);
        if self.end.is_some_and(|e| e <= s.up_by) {
            // Released together with the answer that ended it (within the jitter).
            if self.end.is_some_and(|e| s.up_by - e < HELD_MIN_S) {
                self.held = longer(self.held, held);
            }
            return;
        }
        self.end = Some(s.up_by.max(self.last_failed.unwrap_or(self.start)));
        self.held = longer(self.held, held);
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

/// Outages in a timeline; samples need not be sorted.
pub fn outages<S: Copy + Into<Sample>>(samples: &[S]) -> Vec<Outage> {
    outages_after(samples, None)
}

/// As [`outages`], knowing the send time of the last successful probe before `samples`.
pub fn outages_after<S: Copy + Into<Sample>>(samples: &[S], last_ok: Option<f64>) -> Vec<Outage> {
    outages_continuing(None, samples, last_ok)
}

/// As [`outages_after`], continuing from `prev`, the last outage of the samples before these
/// (folded into a record, or from before an agent restart): an open one goes on or ends, a
/// closed one whose end comes after some of these samples' send times is reopened or ended
/// earlier by them, exactly as if the samples had never been split. Returns `prev` (as it
/// ends up) first, then the outages that follow.
pub fn outages_continuing<S: Copy + Into<Sample>>(
    prev: Option<Outage>,
    samples: &[S],
    mut last_ok: Option<f64>,
) -> Vec<Outage> {
    let mut s: Vec<Sample> = samples.iter().map(|x| (*x).into()).collect();
    s.sort_by(|a, b| a.sent.total_cmp(&b.sent));
    let mut out: Vec<Outage> = Vec::new();
    let mut open: Option<Outage> = None;
    match prev {
        Some(p) if p.end.is_none() => open = Some(p),
        Some(p) => out.push(p),
        None => {}
    }
    for x in s {
        // A probe sent before the last outage's end (the answer that ended it was held):
        // a failure reopens it, an answer may show the path working earlier.
        let before_last_end =
            open.is_none() && out.last().and_then(|o| o.end).is_some_and(|e| x.sent < e);
        match (x.ok, open.as_mut()) {
            (false, Some(o)) => {
                o.last_failed = Some(x.sent);
                o.failed += 1;
            }
            (false, None) if before_last_end => {
                let mut o = out.pop().expect("checked above");
                o.end = None;
                o.held = None;
                o.last_failed = Some(x.sent);
                o.failed += 1;
                open = Some(o);
            }
            (false, None) => open = Some(Outage::begin(x.sent, last_ok)),
            (true, _) => {
                if let Some(mut o) = open.take() {
                    o.close_with(&x);
                    out.push(o);
                } else if before_last_end {
                    if let Some(o) = out.last_mut() {
                        o.close_with(&x);
                    }
                }
                last_ok = Some(x.sent);
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
                held: None,
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

    /// A client's neighbour entry is INCOMPLETE while the path is down
    /// (probes every 10 ms, timeout 200 ms, usual round trip 1 ms). The packets queue; the
    /// gratuitous ARP at 2.0 releases them, so every probe sent in [1.8, 2.0) is answered in
    /// time — held until 2.0. Counted at their send times the outage would end at 1.8, 200 ms
    /// early, with a 10 ms bound; counted when released it ends at 2.0, and the bound reaches
    /// back to the last probe that failed.
    #[test]
    fn answers_held_in_a_neighbour_queue_end_the_outage_when_released() {
        let (down, up, rtt) = (1.0, 2.0, 0.001);
        let mut floor = RttFloor::default();
        let mut samples = Vec::new();
        for i in 0..300 {
            let sent = i as f64 * 0.01;
            let s = if sent < down || sent >= up {
                Sample::answered(sent, rtt, floor.observe(sent, rtt))
            } else if sent >= up - 0.2 + 1e-9 {
                // Released at `up`, answered one usual round trip later.
                let r = up - sent + rtt;
                Sample::answered(sent, r, floor.observe(sent, r))
            } else {
                Sample::failed(sent)
            };
            samples.push(s);
        }
        let o = outages(&samples);
        assert_eq!(o.len(), 1, "{o:?}");
        let g = summarize(&o, 0.01, 3.0);
        let truth = up - down;
        assert!((g.longest - truth).abs() < 1e-6, "{g:?}");
        assert!(
            g.error_bound >= 0.19 && g.error_bound <= 0.21,
            "the bound reaches back to the last failure: {g:?}"
        );
        assert!(o[0].held.is_some_and(|h| (h - 0.19).abs() < 0.011), "{o:?}");
        // Naive arithmetic: the same probes counted at their send times.
        let naive: Vec<(f64, bool)> = samples.iter().map(|s| (s.sent, s.ok)).collect();
        let n = summarize(&outages(&naive), 0.01, 3.0);
        assert!(
            truth - n.longest > n.error_bound + 0.1,
            "counted at send time the outage is short beyond its bound: {n:?}"
        );
    }

    /// Answers in the usual time (jitter under a millisecond) change nothing: the end is the
    /// first answer's send time within the jitter, the bound the cadence.
    #[test]
    fn answers_in_the_usual_time_keep_the_cadence_bound() {
        let mut floor = RttFloor::default();
        let samples: Vec<Sample> = timeline((0.3, 0.6))
            .into_iter()
            .enumerate()
            .map(|(i, (t, ok))| {
                let rtt = 0.001 + (i % 3) as f64 * 0.0002;
                Sample::of(t, ok, rtt, floor.observe(t, rtt))
            })
            .collect();
        let o = outages(&samples);
        let g = summarize(&o, 0.01, 1.0);
        assert!((g.longest - 0.3).abs() <= 0.0005, "{g:?}");
        assert!(g.error_bound <= 0.0105, "{g:?}");
        assert_eq!(o[0].held, None);
    }

    /// Answers released together end the outage at the earliest release, whichever was sent
    /// last; the row still says they were held.
    #[test]
    fn answers_released_together_keep_the_hold() {
        // Held from 1.8 to 2.0; the one sent at 1.999 comes back a hair before the others.
        let s = vec![
            Sample::answered(0.9, 0.001, 0.001),
            Sample::failed(1.0),
            Sample::failed(1.7),
            Sample::answered(1.8, 0.2015, 0.001),
            Sample::answered(1.9, 0.1015, 0.001),
            Sample::answered(1.999, 0.0015, 0.001),
        ];
        let o = outages(&s);
        assert_eq!(o.len(), 1);
        assert!((o[0].end.unwrap() - 1.9995).abs() < 1e-9, "{o:?}");
        assert!(
            o[0].held.is_some_and(|h| (h - 0.2005).abs() < 1e-6),
            "{o:?}"
        );
        assert!(o[0].error_bound(0.01) > 0.29, "{o:?}");
    }

    /// A slow answer sent before the end of an outage closed by a held one shows the path
    /// working earlier; a failure sent before that end reopens the outage.
    #[test]
    fn answers_and_failures_sent_before_a_held_end() {
        // Outage from 1.0; the probe sent at 1.1 was held until 1.5; one sent at 1.2 was
        // answered promptly (the path worked by 1.2).
        let s = vec![
            Sample::answered(0.9, 0.001, 0.001),
            Sample::failed(1.0),
            Sample::answered(1.1, 0.401, 0.001),
            Sample::answered(1.2, 0.001, 0.001),
        ];
        let o = outages(&s);
        assert_eq!(o.len(), 1);
        assert!((o[0].end.unwrap() - 1.2).abs() < 1e-9, "{o:?}");
        // A failure sent at 1.3, before the held end at 1.5: the outage goes on.
        let s = vec![
            Sample::answered(0.9, 0.001, 0.001),
            Sample::failed(1.0),
            Sample::answered(1.1, 0.401, 0.001),
            Sample::failed(1.3),
            Sample::answered(1.4, 0.001, 0.001),
        ];
        let o = outages(&s);
        assert_eq!(o.len(), 1, "{o:?}");
        assert_eq!((o[0].last_failed, o[0].failed), (Some(1.3), 2));
        assert!((o[0].end.unwrap() - 1.4).abs() < 1e-9, "{o:?}");
    }

    #[test]
    fn the_rtt_floor_is_the_fastest_answer_of_the_last_minute() {
        let mut f = RttFloor::default();
        assert_eq!(f.observe(10.2, 0.005), 0.005);
        assert_eq!(f.observe(10.5, 0.002), 0.002);
        assert_eq!(
            f.observe(11.0, 0.300),
            0.002,
            "a held answer does not raise it"
        );
        assert_eq!(f.observe(10.9, 0.001), 0.001, "out of order, same second");
        // A minute later the old seconds are gone: a slower path is the new usual, once the
        // second that ends a minute without answers is over.
        assert_eq!(
            f.observe(72.0, 0.150),
            0.001,
            "after a long silence, held answers"
        );
        assert_eq!(f.observe(72.5, 0.004), 0.001);
        assert_eq!(f.observe(73.0, 0.004), 0.004);
        assert!(f.buckets.len() <= 62);
    }
}
