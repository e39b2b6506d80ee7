//! The privileged test targets side by side: built once, then run in lanes, each lane one
//! target at a time (and each target one test at a time, as ever), so a long target (the
//! rollout tests against a control plane) runs beside the others instead of before them.
//!
//! Labs do not share kernel state: each has its own namespaces (a unique prefix), its own
//! bpffs and run directory, and its own loopback or lab addresses inside its namespaces. What
//! is host-wide is counted in the solo targets, which run afterwards with nothing beside them:
//! kernel drop accounting counts every drop on the host (`kernel_drops`, the step tests' drop
//! budgets), and the step tests measure gaps to within the probe cadence, which a loaded CPU
//! would blur. The host's RTNL lock is shared as well: a target that holds it for seconds runs
//! in one lane with the targets whose timing it would break (`ONE_LANE`).
//! `STEPGUARD_TEST_LANES=1` runs everything one target at a time.
use crate::testrun::{parse_output, run_capturing, Ledger, Package, Stage, Target};
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::Instant;

/// Targets that run alone, after the lanes (see the module's comment).
pub const SOLO: [&str; 3] = ["steps", "kernel_drops", "budgets"];

/// Targets that run in one lane, one after the other. The witness's LAN lab moves leases on a
/// timeline of kernel changes that each wait for the host's RTNL lock, which the endpoint
/// tests (a thousand pods' interfaces made and removed) hold for seconds at a time.
const ONE_LANE: [&[&str]; 1] = [&["witness", "endpoints"]];

/// Each target's running time on the reference machine (2 cores), seconds: how the lanes are
/// balanced (longest first, to the least loaded lane). A target not listed counts 30 s.
const EXPECTED_SECS: [(&str, f64); 17] = [
    ("rollout", 750.0),
    ("matrix", 290.0),
    ("versions", 210.0),
    ("witness", 190.0),
    ("endpoints", 115.0),
    ("real_cilium", 100.0),
    ("chart", 75.0),
    ("abuse", 70.0),
    ("flux", 65.0),
    ("checks", 40.0),
    ("eastwest", 25.0),
    ("implicit", 25.0),
    ("manifests", 20.0),
    ("lab_restart", 17.0),
    ("helm_chart", 15.0),
    ("prometheus", 13.0),
    ("lab_lifecycle", 12.0),
];

/// Lanes to use: `STEPGUARD_TEST_LANES`, else 3.
pub fn lanes_wanted() -> usize {
    std::env::var("STEPGUARD_TEST_LANES")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n: &usize| *n >= 1)
        .unwrap_or(3)
}

fn expected(name: &str) -> f64 {
    EXPECTED_SECS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, s)| *s)
        .unwrap_or(30.0)
}

/// Splits targets into `n` lanes (longest first to the least loaded lane) and the solo ones.
pub fn plan<'a>(targets: &[&'a Target], n: usize) -> (Vec<Vec<&'a Target>>, Vec<&'a Target>) {
    let (solo, mut rest): (Vec<&Target>, Vec<&Target>) = targets
        .iter()
        .partition(|t| n > 1 && SOLO.contains(&t.name.as_str()));
    // The real cilium-agent's targets share one lane: one real agent at a time; so do the
    // targets of each of `ONE_LANE`'s groups.
    let mut shared: BTreeMap<&str, Vec<&Target>> = BTreeMap::new();
    let mut groups: Vec<(f64, Vec<&Target>)> = Vec::new();
    for t in rest.drain(..) {
        let name = t.name.as_str();
        let group = if name.starts_with("real_") {
            Some("real_")
        } else {
            ONE_LANE.iter().find(|g| g.contains(&name)).map(|g| g[0])
        };
        match group {
            Some(g) => shared.entry(g).or_default().push(t),
            None => groups.push((expected(name), vec![t])),
        }
    }
    for (_, g) in shared {
        groups.push((g.iter().map(|t| expected(&t.name)).sum(), g));
    }
    groups.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut lanes: Vec<(f64, Vec<&Target>)> = vec![(0.0, vec![]); n.max(1)];
    for (secs, g) in groups {
        let lane = lanes
            .iter_mut()
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .expect("at least one lane");
        lane.0 += secs;
        lane.1.extend(g);
    }
    (
        lanes
            .into_iter()
            .map(|(_, l)| l)
            .filter(|l| !l.is_empty())
            .collect(),
        solo,
    )
}

/// Builds the test executables of `targets` once; their paths by target name.
fn build(root: &Path, pkg: &Package, targets: &[&Target]) -> Result<BTreeMap<String, PathBuf>> {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(root).args([
        "test",
        "--no-run",
        "--message-format=json-render-diagnostics",
        "-p",
        &pkg.name,
    ]);
    for t in targets {
        cmd.args(["--test", &t.name]);
    }
    cmd.stderr(std::process::Stdio::inherit());
    let out = cmd.output().context("build the test executables")?;
    if !out.status.success() {
        bail!("building {}'s test executables failed", pkg.name);
    }
    let mut exes = BTreeMap::new();
    for line in out.stdout.split(|b| *b == b'\n') {
        let Ok(v) = serde_json::from_slice::<Value>(line) else {
            continue;
        };
        if v["reason"] != "compiler-artifact" {
            continue;
        }
        if let (Some(name), Some(exe)) = (v["target"]["name"].as_str(), v["executable"].as_str()) {
            if v["target"]["kind"]
                .as_array()
                .is_some_and(|k| k.iter().any(|k| k == "test"))
            {
                exes.insert(name.to_string(), PathBuf::from(exe));
            }
        }
    }
    Ok(exes)
}

/// Runs one test executable the way cargo does (from the package's directory, with the
/// stage's environment); returns its output as cargo would print it (a `Running` line first)
/// and whether it succeeded.
fn run_one(pkg: &Package, t: &Target, exe: &Path, stage: &Stage) -> (bool, Vec<String>) {
    let mut lines = vec![format!("     Running {} ({})", t.src, exe.display())];
    let mut cmd = Command::new(exe);
    cmd.current_dir(&pkg.dir)
        .args(&stage.test_args)
        .env("CARGO_MANIFEST_DIR", &pkg.dir)
        .env("CARGO_PKG_NAME", &pkg.name);
    for (k, v) in &stage.envs {
        cmd.env(k, v);
    }
    match run_capturing(&mut cmd, false) {
        Ok((ok, out)) => {
            lines.extend(out);
            (ok, lines)
        }
        Err(e) => {
            lines.push(format!("{e:#}"));
            (false, lines)
        }
    }
}

/// Runs the privileged `targets` of `pkg` in lanes, then the solo ones; records into the
/// ledger (with each lane's time as a stage). Every target runs even when another fails.
pub fn run(
    root: &Path,
    pkg: &Package,
    targets: &[&Target],
    stage: &Stage,
    ledger: &mut Ledger,
) -> Result<bool> {
    if targets.is_empty() {
        return Ok(true);
    }
    let started = Instant::now();
    println!(
        "== {}: building {}'s test executables",
        stage.title, pkg.name
    );
    let exes = build(root, pkg, targets)?;
    ledger.stage(
        format!("{}: the build of {}", stage.title, pkg.name),
        started,
    );
    let (lanes, solo) = plan(targets, lanes_wanted());
    for (i, l) in lanes.iter().enumerate() {
        println!(
            "== lane {}: {}",
            i + 1,
            l.iter()
                .map(|t| t.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    if !solo.is_empty() {
        println!(
            "== then alone: {}",
            solo.iter()
                .map(|t| t.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let printed = Mutex::new(());
    let results: Mutex<Vec<(bool, Vec<String>)>> = Mutex::new(Vec::new());
    let lane_secs: Mutex<Vec<(String, f64)>> = Mutex::new(Vec::new());
    let run_lane = |label: &str, lane: &[&Target]| {
        let t0 = Instant::now();
        for t in lane {
            let Some(exe) = exes.get(&t.name) else {
                results.lock().unwrap().push((
                    false,
                    vec![format!("no executable was built for {}", t.src)],
                ));
                continue;
            };
            let t1 = Instant::now();
            let (ok, lines) = run_one(pkg, t, exe, stage);
            {
                let _g = printed.lock().unwrap_or_else(|e| e.into_inner());
                let mut o = std::io::stdout().lock();
                let _ = writeln!(o, "== {label}: {} (its output follows)", t.src);
                for l in &lines {
                    let _ = writeln!(o, "{l}");
                }
                let _ = writeln!(
                    o,
                    "== {label}: {} {} in {:.0}s",
                    t.src,
                    if ok { "passed" } else { "FAILED" },
                    t1.elapsed().as_secs_f64()
                );
            }
            results.lock().unwrap().push((ok, lines));
        }
        lane_secs
            .lock()
            .unwrap()
            .push((label.to_string(), t0.elapsed().as_secs_f64()));
    };
    let t_lanes = Instant::now();
    std::thread::scope(|s| {
        for (i, lane) in lanes.iter().enumerate() {
            let run_lane = &run_lane;
            s.spawn(move || run_lane(&format!("lane {}", i + 1), lane));
        }
    });
    let mut secs = std::mem::take(&mut *lane_secs.lock().unwrap());
    secs.sort_by(|a, b| a.0.cmp(&b.0));
    for (label, s) in secs {
        ledger.stages.push((format!("{}: {label}", stage.title), s));
    }
    ledger.stage(format!("{}: the lanes side by side", stage.title), t_lanes);
    let t_solo = Instant::now();
    for t in &solo {
        run_lane("alone", std::slice::from_ref(t));
    }
    if !solo.is_empty() {
        ledger.stage(format!("{}: the solo targets", stage.title), t_solo);
    }
    let mut all_ok = true;
    for (ok, lines) in results.into_inner().unwrap() {
        all_ok &= ok;
        ledger.record(&pkg.name, &parse_output(&lines));
    }
    Ok(all_ok)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testrun::Kind;

    fn t(name: &str) -> Target {
        Target {
            package: "p".into(),
            kind: Kind::Integration,
            name: name.into(),
            src: format!("tests/{name}.rs"),
            privileged: true,
        }
    }

    /// Every target lands in exactly one lane or the solo list; the longest targets spread
    /// over the lanes; one lane runs everything in order, solo ones included.
    #[test]
    fn lanes_hold_every_target_once_and_spread_the_long_ones() {
        let all: Vec<Target> = [
            "rollout",
            "matrix",
            "versions",
            "witness",
            "endpoints",
            "steps",
            "budgets",
            "x",
            "y",
            "real_cilium",
            "real_faults",
        ]
        .into_iter()
        .map(t)
        .collect();
        let refs: Vec<&Target> = all.iter().collect();
        let (lanes, solo) = plan(&refs, 3);
        let mut seen: Vec<&str> = lanes
            .iter()
            .flatten()
            .chain(solo.iter())
            .map(|t| t.name.as_str())
            .collect();
        seen.sort();
        let mut want: Vec<&str> = all.iter().map(|t| t.name.as_str()).collect();
        want.sort();
        assert_eq!(seen, want);
        assert_eq!(
            solo.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(),
            ["steps", "budgets"]
        );
        assert_eq!(lanes.len(), 3);
        assert_eq!(lanes[0][0].name, "rollout");
        assert!(
            lanes[0].len() == 1,
            "rollout alone fills its lane: {lanes:?}"
        );
        let lane_of = |name: &str| lanes.iter().position(|l| l.iter().any(|t| t.name == name));
        assert_eq!(lane_of("real_cilium"), lane_of("real_faults"), "{lanes:?}");
        assert_eq!(lane_of("witness"), lane_of("endpoints"), "{lanes:?}");
        let (one, solo) = plan(&refs, 1);
        assert!(solo.is_empty());
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].len(), all.len());
    }
}
