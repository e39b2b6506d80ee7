//! Human durations in config and on the command line: `500ms`, `2s`, `1.5s`, `250us`, `1m`.
use serde::{Deserialize, Deserializer};
use std::time::Duration;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DurationError {
    #[error("invalid duration {0:?}: expected a number with a unit, e.g. 500ms, 2s, 1m")]
    Syntax(String),
    #[error("invalid duration {0:?}: unit must be us, ms, s, m or h")]
    Unit(String),
    #[error("duration {0:?} is out of range (at most 24h)")]
    Range(String),
}

pub fn parse(s: &str) -> Result<Duration, DurationError> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() || unit.is_empty() {
        return Err(DurationError::Syntax(s.into()));
    }
    let n: f64 = num.parse().map_err(|_| DurationError::Syntax(s.into()))?;
    let secs = match unit {
        "us" | "µs" => n / 1e6,
        "ms" => n / 1e3,
        "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(DurationError::Unit(s.into())),
    };
    if !secs.is_finite() || secs > 86400.0 {
        return Err(DurationError::Range(s.into()));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Formats for humans: `300ms`, `1.5s`, `2m5s`.
pub fn human(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1000.0;
    if d.is_zero() {
        "0s".into()
    } else if ms < 1.0 {
        format!("{}us", d.as_micros())
    } else if ms < 1000.0 {
        format!("{:.0}ms", ms)
    } else if ms < 60_000.0 {
        format!("{:.2}s", ms / 1000.0).replace(".00s", "s")
    } else {
        format!("{}m{}s", d.as_secs() / 60, d.as_secs() % 60)
    }
}

/// `d` when within `min..=max`, else the one-line reason ("5ms is out of range (10ms to
/// 60m0s)"), for the caller to prefix with the field or flag.
pub fn within(d: Duration, min: Duration, max: Duration) -> Result<Duration, String> {
    if d < min || d > max {
        return Err(format!(
            "{} is out of range ({} to {})",
            human(d),
            human(min),
            human(max)
        ));
    }
    Ok(d)
}

/// Command-line durations, each `(flag, value, (min, max))`: the first out of range, named
/// ("--probe-interval: 5ms is out of range (10ms to 60m0s)").
pub fn flags(items: &[(&str, Duration, (Duration, Duration))]) -> Result<(), String> {
    for (flag, v, (min, max)) in items {
        within(*v, *min, *max).map_err(|e| format!("{flag}: {e}"))?;
    }
    Ok(())
}

/// A request's optional duration field: `default` when absent, else parsed; either way within
/// `min..=max`. The error names `field`.
pub fn field(
    field: &str,
    v: Option<&str>,
    default: Duration,
    min: Duration,
    max: Duration,
) -> Result<Duration, String> {
    let d = match v {
        None => default,
        Some(s) => parse(s).map_err(|e| format!("{field}: {e}"))?,
    };
    within(d, min, max).map_err(|e| format!("{field}: {e}"))
}

pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let s = String::deserialize(d)?;
    parse(&s).map_err(serde::de::Error::custom)
}

pub fn deserialize_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    let s: Option<String> = Option::deserialize(d)?;
    s.map(|s| parse(&s).map_err(serde::de::Error::custom))
        .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn parses_the_usual_units_and_rejects_the_rest() {
        assert_eq!(parse("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse("250us").unwrap(), Duration::from_micros(250));
        assert!(matches!(parse("5"), Err(DurationError::Syntax(_))));
        assert!(matches!(parse("5 parsecs"), Err(DurationError::Unit(_))));
        assert!(matches!(parse("ms"), Err(DurationError::Syntax(_))));
        assert!(matches!(parse("48h"), Err(DurationError::Range(_))));
        assert!(matches!(parse("-1s"), Err(DurationError::Syntax(_))));
    }
    #[test]
    fn formats_for_humans() {
        assert_eq!(human(Duration::ZERO), "0s");
        assert_eq!(human(Duration::from_millis(300)), "300ms");
        assert_eq!(human(Duration::from_millis(1500)), "1.50s");
        assert_eq!(human(Duration::from_secs(2)), "2s");
    }

    #[test]
    fn a_field_is_its_default_or_parsed_and_within_its_range() {
        let ms = Duration::from_millis;
        assert_eq!(field("t", None, ms(50), ms(10), ms(100)), Ok(ms(50)));
        assert_eq!(
            field("t", Some("20ms"), ms(50), ms(10), ms(100)),
            Ok(ms(20))
        );
        assert_eq!(
            field("t", Some("5ms"), ms(50), ms(10), ms(100)),
            Err("t: 5ms is out of range (10ms to 100ms)".into())
        );
        assert!(
            field("t", Some("soon"), ms(50), ms(10), ms(100)).is_err_and(|e| e.starts_with("t: "))
        );
        assert_eq!(within(ms(10), ms(10), ms(10)), Ok(ms(10)));
    }
}
