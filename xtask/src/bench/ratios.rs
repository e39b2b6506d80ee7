//! The ratios: each cost of the agent (and of the witness) beside a minimal loop making
//! the same syscalls, taken `runs` times in one lab, each pair back to back (the agent, then
//! its reference), and reported as the median of the runs' ratios (one run's ratio spreads by
//! about ±0.2×), with every run's figures beside it.
use super::*;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

/// The agent's `stepguard_probe_send_delay_seconds` bounds (`metrics::SEND_DELAY_BUCKETS`);
/// `benchref` counts its wake-up lateness at the same bounds.
pub(super) const SEND_DELAY_BOUNDS_S: [f64; 11] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1,
];

/// A quantile of cumulative `(le, count)` buckets, interpolated linearly inside its bucket as
/// Prometheus' `histogram_quantile` does: the agent's histogram and the minimal loop's
/// lateness, bucketed at the same bounds, are read the same way.
pub(super) fn histogram_quantile(b: &[(f64, f64)], q: f64) -> f64 {
    let total = b.last().map_or(0.0, |x| x.1);
    if total <= 0.0 {
        return f64::NAN;
    }
    let rank = q * total;
    let mut prev = (0.0, 0.0);
    for &(le, c) in b {
        if c >= rank {
            if le.is_infinite() {
                return prev.0;
            }
            let inside = c - prev.1;
            return if inside <= 0.0 {
                le
            } else {
                prev.0 + (le - prev.0) * (rank - prev.1) / inside
            };
        }
        prev = (le, c);
    }
    f64::NAN
}

/// The median (the mean of the middle two for an even count); NaN when empty.
pub(super) fn median_of(v: &[f64]) -> f64 {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// One cost measured run after run: the agent's figure and its reference's.
#[derive(Default)]
pub(super) struct Series {
    pub agent: Vec<f64>,
    pub reference: Vec<f64>,
}

impl Series {
    pub fn push(&mut self, agent: f64, reference: f64) {
        self.agent.push(agent);
        self.reference.push(reference);
    }

    pub fn ratios(&self) -> Vec<f64> {
        self.agent
            .iter()
            .zip(&self.reference)
            .map(|(a, r)| a / r)
            .collect()
    }

    pub fn json(&self) -> Value {
        let ratios = self.ratios();
        json!({
            "agent": self.agent, "reference": self.reference, "ratios": ratios,
            "median_agent": median_of(&self.agent), "median_reference": median_of(&self.reference),
            "median_ratio": median_of(&ratios),
        })
    }
}

/// The node kept busy while probe send delays are measured: the way a real restart makes it
/// busy (the real cilium-agent restarted over and over on a real-agent lab node beside the
/// bench's node, compiling and loading its datapath each time), or, where the real agent
/// cannot be built, every core spinning.
pub(super) enum Load {
    Real {
        child: Child,
        flag: std::path::PathBuf,
        prefix: String,
        restarts: Arc<AtomicU32>,
    },
    Spin {
        stop: Arc<AtomicBool>,
        threads: Vec<std::thread::JoinHandle<()>>,
    },
}

impl Load {
    /// A real-agent node (`stepguard-lab real-node --restart-while`), up and idle; or the
    /// spinning load when it cannot come up (the reason printed).
    pub fn real_or_spin() -> Load {
        match Load::real() {
            Ok(l) => l,
            Err(e) => {
                println!(
                    "  the real cilium-agent cannot run here ({e:#}): every core kept busy instead"
                );
                Load::Spin {
                    stop: Arc::new(AtomicBool::new(false)),
                    threads: Vec::new(),
                }
            }
        }
    }

    fn real() -> Result<Load> {
        use std::io::BufRead;
        let kube = crate::kube::ensure()?;
        let release = crate::cilium::release("1.20")?;
        let (bin, _) = crate::cilium::ensure(release)?;
        let prefix = "sgbenchr".to_string();
        let _ = Command::new(lab_bin())
            .args(["down", "--prefix", &prefix])
            .output();
        let flag =
            std::env::temp_dir().join(format!("stepguard-bench-load-{}", std::process::id()));
        let _ = std::fs::remove_file(&flag);
        let mut child = Child(
            Command::new(lab_bin())
                .args([
                    "real-node",
                    "--prefix",
                    &prefix,
                    "--no-pods",
                    "--restart-while",
                ])
                .arg(&flag)
                .env("STEPGUARD_KUBE_BIN", kube)
                .env(crate::cilium::env_var(release), bin)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::null())
                .spawn()
                .context("start stepguard-lab real-node")?,
        );
        let out = child.0.stdout.take().context("stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        let restarts = Arc::new(AtomicU32::new(0));
        let counted = restarts.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(|l| l.ok()) {
                if line.starts_with("real-agent node") && line.contains(" up:") {
                    let _ = tx.send(());
                } else if line.starts_with("restart ") {
                    counted.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
        rx.recv_timeout(Duration::from_secs(300))
            .context("the real-agent node did not come up within 300 s")?;
        Ok(Load::Real {
            child,
            flag,
            prefix,
            restarts,
        })
    }

    pub fn describe(&self) -> String {
        match self {
            Load::Real { .. } => format!(
                "the real cilium-agent {} restarted over and over on a lab node beside this one (its datapath compiled and loaded at each start)",
                crate::cilium::release("1.20").map(|r| r.version).unwrap_or("1.20")
            ),
            Load::Spin { .. } => format!(
                "every core kept busy ({} spinning threads)",
                std::thread::available_parallelism().map_or(2, |n| n.get())
            ),
        }
    }

    pub fn restarts(&self) -> Option<u32> {
        match self {
            Load::Real { restarts, .. } => Some(restarts.load(Ordering::SeqCst)),
            Load::Spin { .. } => None,
        }
    }

    pub fn on(&mut self) -> Result<()> {
        match self {
            Load::Real { flag, .. } => {
                std::fs::write(flag, b"")?;
                // The first restart's compile under way.
                std::thread::sleep(Duration::from_secs(2));
            }
            Load::Spin { stop, threads } => {
                stop.store(false, Ordering::SeqCst);
                for _ in 0..std::thread::available_parallelism().map_or(2, |n| n.get()) {
                    let stop = stop.clone();
                    threads.push(std::thread::spawn(move || {
                        let mut x = 0u64;
                        while !stop.load(Ordering::Relaxed) {
                            x = std::hint::black_box(
                                x.wrapping_mul(6364136223846793005).wrapping_add(1),
                            );
                        }
                    }));
                }
            }
        }
        Ok(())
    }

    pub fn off(&mut self) {
        match self {
            Load::Real { flag, .. } => {
                let _ = std::fs::remove_file(flag);
            }
            Load::Spin { stop, threads } => {
                stop.store(true, Ordering::SeqCst);
                for t in threads.drain(..) {
                    let _ = t.join();
                }
            }
        }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.off();
        if let Load::Real { child, prefix, .. } = self {
            // SAFETY: signals our own child (stepguard-lab removes its node on SIGINT).
            unsafe { libc::kill(child.0.id() as i32, libc::SIGINT) };
            let t = Instant::now();
            while t.elapsed() < Duration::from_secs(60) {
                if matches!(child.0.try_wait(), Ok(Some(_))) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            let _ = Command::new(lab_bin())
                .args(["down", "--prefix", prefix])
                .output();
        }
    }
}

/// The minimal loop's wake-up lateness as cumulative `(le, count)` buckets.
pub(super) fn late_buckets(v: &Value) -> Vec<(f64, f64)> {
    let counts: Vec<f64> = v["late_buckets"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c.as_f64())
        .collect();
    SEND_DELAY_BOUNDS_S
        .iter()
        .copied()
        .chain([f64::INFINITY])
        .zip(counts)
        .collect()
}

/// Bucket differences between two scrapes of the agent's send-delay histogram.
pub(super) fn bucket_delta(before: &[(f64, f64)], after: &[(f64, f64)]) -> Vec<(f64, f64)> {
    after
        .iter()
        .map(|(le, a)| {
            let b = before.iter().find(|(l, _)| l == le).map_or(0.0, |x| x.1);
            (*le, a - b)
        })
        .collect()
}

pub(super) fn f2(v: &Value) -> String {
    match v.as_f64() {
        Some(x) if x.is_finite() => format!("{x:.2}"),
        _ => "—".into(),
    }
}

/// `a / b / c` of a series' field, each to 2 places.
pub(super) fn each(v: &Value, field: &str) -> String {
    v[field]
        .as_array()
        .into_iter()
        .flatten()
        .map(f2)
        .collect::<Vec<_>>()
        .join(" / ")
}

/// One row of the ratios table.
pub(super) fn ratio_row(what: &str, s: &Value, unit: &str, goal: &str) -> String {
    let met = s["median_ratio"].as_f64().is_some_and(|r| {
        goal.strip_prefix("≤ ")
            .and_then(|g| g.trim_end_matches('×').parse::<f64>().ok())
            .is_some_and(|g| r <= g)
    });
    format!(
        "| {what} | {} {unit} ({}) | {} {unit} ({}) | **{}×** ({}) | {goal} {} |\n",
        f2(&s["median_agent"]),
        each(s, "agent"),
        f2(&s["median_reference"]),
        each(s, "reference"),
        f2(&s["median_ratio"]),
        each(s, "ratios"),
        if met { "✓" } else { "missed" }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quantile_is_interpolated_inside_its_bucket() {
        // 100 observations: 50 at or below 1 ms, 90 at or below 2 ms, all at or below 5 ms.
        let b = [
            (0.001, 50.0),
            (0.002, 90.0),
            (0.005, 100.0),
            (f64::INFINITY, 100.0),
        ];
        assert!((histogram_quantile(&b, 0.5) - 0.001).abs() < 1e-12);
        // rank 99: 9 of the 10 in (2 ms, 5 ms].
        assert!((histogram_quantile(&b, 0.99) - 0.0047).abs() < 1e-9);
        assert!(histogram_quantile(&[], 0.99).is_nan());
        // Beyond the last finite bound: that bound.
        let tail = [(0.001, 1.0), (f64::INFINITY, 10.0)];
        assert_eq!(histogram_quantile(&tail, 0.99), 0.001);
    }

    #[test]
    fn the_median_of_runs() {
        assert_eq!(median_of(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median_of(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median_of(&[]).is_nan());
        let mut s = Series::default();
        s.push(6.0, 4.0);
        s.push(5.0, 5.0);
        s.push(12.0, 8.0);
        assert_eq!(s.json()["median_ratio"], 1.5);
    }
}
