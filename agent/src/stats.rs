//! Small statistics used by verdicts: quantiles over latencies.

/// Nearest-rank quantile (q in 0..=1) of unsorted samples (latencies as durations or
/// milliseconds; a value not equal to itself, a NaN, sorts above every other); None when empty.
pub fn quantile<T: Copy + PartialOrd>(samples: &[T], q: f64) -> Option<T> {
    if samples.is_empty() {
        return None;
    }
    // A total order even with NaNs (an inconsistent comparator may make `sort_by` panic).
    #[allow(clippy::eq_op)]
    let nan = |x: &T| x != x;
    let mut v = samples.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or_else(|| nan(a).cmp(&nan(b))));
    let rank = ((q.clamp(0.0, 1.0) * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    #[test]
    fn nearest_rank_quantiles() {
        let ms = |v: &[u64]| {
            v.iter()
                .map(|m| Duration::from_millis(*m))
                .collect::<Vec<_>>()
        };
        let s = ms(&[5, 1, 3, 2, 4]);
        assert_eq!(quantile(&s, 0.5), Some(Duration::from_millis(3)));
        assert_eq!(quantile(&s, 0.99), Some(Duration::from_millis(5)));
        assert_eq!(quantile(&s, 0.0), Some(Duration::from_millis(1)));
        assert_eq!(quantile::<Duration>(&[], 0.5), None);
        assert_eq!(quantile(&[3.0f32, 1.0, 2.0], 0.5), Some(2.0));
        let with_nan = [f32::NAN, 3.0, 1.0, f32::NAN, 2.0];
        assert_eq!(quantile(&with_nan, 0.5), Some(3.0), "NaNs sort last");
        let hundred: Vec<u64> = (1..=100).collect();
        assert_eq!(
            quantile(&ms(&hundred), 0.99),
            Some(Duration::from_millis(99))
        );
    }
}
