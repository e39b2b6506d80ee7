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

/// Parts of targets run in parts (`SHARDS`) that join a `ONE_LANE` group (named by its first
/// target): the rollout tests' halts and interrupted steps restart lab nodes under replace
/// timeouts of a few seconds, and a restart that waits on the RTNL lock the endpoint tests
/// hold missed them.
const PART_IN_GROUP: [(&str, usize, &str); 1] = [("rollout", 1, "witness")];

/// Targets run in two parts, each a unit of its own in the lanes: the tests whose names contain
/// one of the prefixes, then every other one (`--skip` each prefix), so each test runs exactly
/// once; with each part's running time on the reference machine. The rollout tests are the
/// longest target, and alone they were the whole run's floor. Not when the run has a filter of
/// its own (libtest runs a test matching any filter).
pub const SHARDS: [(&str, &[&str], f64, f64); 1] = [(
    "rollout",
    &["halts::", "interrupted::", "lock::"],
    450.0,
    510.0,
)];

/// What a lane runs: a target, or one part of it (its test filter arguments).
#[derive(Clone, Debug)]
pub struct Unit<'a> {
    pub target: &'a Target,
    /// Arguments after the stage's: the part's filters.
    pub args: Vec<String>,
    /// (this part, of how many), for a target run in parts.
    pub part: Option<(usize, usize)>,
    secs: f64,
}

impl<'a> Unit<'a> {
    fn whole(target: &'a Target) -> Unit<'a> {
        Unit {
            target,
            args: vec![],
            part: None,
            secs: expected(&target.name),
        }
    }

    /// The target whole, or its parts when it is one of [`SHARDS`] and `shard`.
    fn of(target: &'a Target, shard: bool) -> Vec<Unit<'a>> {
        match SHARDS.iter().find(|s| s.0 == target.name).filter(|_| shard) {
            Some((_, prefixes, first, rest)) => vec![
                Unit {
                    target,
                    args: prefixes.iter().map(|p| p.to_string()).collect(),
                    part: Some((1, 2)),
                    secs: *first,
                },
                Unit {
                    target,
                    args: prefixes
                        .iter()
                        .flat_map(|p| ["--skip".to_string(), p.to_string()])
                        .collect(),
                    part: Some((2, 2)),
                    secs: *rest,
                },
            ],
            None => vec![Unit::whole(target)],
        }
    }

    /// The target's source, and the part.
    pub fn label(&self) -> String {
        match self.part {
            Some((i, n)) => format!(
                "{} (part {i} of {n}: {})",
                self.target.src,
                self.args.join(" ")
            ),
            None => self.target.src.clone(),
        }
    }
}

/// Each target's running time in the default run on the reference machine (2 cores, beside
/// the other lanes), seconds: how the lanes are balanced (longest first, to the least loaded
/// lane). A target not listed counts 30 s. Targets whose tests all wait for
/// `--real-extended` count what they take without it (nothing): that flag's run is balanced
/// less well and has the time for it.
const EXPECTED_SECS: [(&str, f64); 22] = [
    ("rollout", 960.0),
    ("matrix", 290.0),
    ("versions", 210.0),
    ("witness", 210.0),
    ("endpoints", 135.0),
    ("abuse", 125.0),
    ("real_cilium", 100.0),
    ("chart", 55.0),
    ("checks", 40.0),
    ("implicit", 34.0),
    ("eastwest", 30.0),
    ("manifests", 18.0),
    ("lab_restart", 17.0),
    ("effective", 12.0),
    ("prometheus", 13.0),
    ("lab_lifecycle", 12.0),
    ("helm_chart", 11.0),
    ("flux", 1.0),
    ("real_faults", 1.0),
    ("real_l2", 1.0),
    ("real_rollout", 1.0),
    ("real_upgrade", 1.0),
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

/// Splits targets into `n` lanes (longest first to the least loaded lane) and the solo ones;
/// with `shard`, the targets of [`SHARDS`] in parts.
pub fn plan<'a>(
    targets: &[&'a Target],
    n: usize,
    shard: bool,
) -> (Vec<Vec<Unit<'a>>>, Vec<Unit<'a>>) {
    let (solo, mut rest): (Vec<&Target>, Vec<&Target>) = targets
        .iter()
        .partition(|t| n > 1 && SOLO.contains(&t.name.as_str()));
    // The real cilium-agent's targets share one lane: one real agent at a time; so do the
    // targets of each of `ONE_LANE`'s groups.
    let mut shared: BTreeMap<&str, Vec<Unit>> = BTreeMap::new();
    let mut groups: Vec<(f64, Vec<Unit>)> = Vec::new();
    for t in rest.drain(..) {
        let name = t.name.as_str();
        let group = if name.starts_with("real_") {
            Some("real_")
        } else {
            ONE_LANE.iter().find(|g| g.contains(&name)).map(|g| g[0])
        };
        match group {
            Some(g) => shared.entry(g).or_default().push(Unit::whole(t)),
            None => {
                for u in Unit::of(t, shard && n > 1) {
                    let joins = PART_IN_GROUP.iter().find(|(target, part, _)| {
                        *target == name && u.part.is_some_and(|(p, _)| p == *part)
                    });
                    match joins {
                        Some((_, _, g)) => shared.entry(g).or_default().push(u),
                        None => groups.push((u.secs, vec![u])),
                    }
                }
            }
        }
    }
    for (_, g) in shared {
        groups.push((g.iter().map(|u| u.secs).sum(), g));
    }
    groups.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut lanes: Vec<(f64, Vec<Unit>)> = vec![(0.0, vec![]); n.max(1)];
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
        solo.into_iter().map(Unit::whole).collect(),
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
fn run_one(pkg: &Package, u: &Unit, exe: &Path, stage: &Stage) -> (bool, Vec<String>) {
    let mut lines = vec![format!("     Running {} ({})", u.target.src, exe.display())];
    let mut cmd = Command::new(exe);
    cmd.current_dir(&pkg.dir)
        .args(&stage.test_args)
        .args(&u.args)
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
    // A filter of the run's own: every target whole (libtest ORs filters).
    let filtered = stage.test_args.iter().any(|a| !a.starts_with("--"));
    let (lanes, solo) = plan(targets, lanes_wanted(), !filtered);
    let names = |l: &[Unit]| {
        l.iter()
            .map(|u| match u.part {
                Some((i, n)) => format!("{} ({i}/{n})", u.target.name),
                None => u.target.name.clone(),
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    for (i, l) in lanes.iter().enumerate() {
        println!("== lane {}: {}", i + 1, names(l));
    }
    if !solo.is_empty() {
        println!("== then alone: {}", names(&solo));
    }
    let printed = Mutex::new(());
    let results: Mutex<Vec<(bool, Vec<String>)>> = Mutex::new(Vec::new());
    let lane_secs: Mutex<Vec<(String, f64)>> = Mutex::new(Vec::new());
    let run_lane = |label: &str, lane: &[Unit]| {
        let t0 = Instant::now();
        for u in lane {
            let Some(exe) = exes.get(&u.target.name) else {
                results.lock().unwrap().push((
                    false,
                    vec![format!("no executable was built for {}", u.target.src)],
                ));
                continue;
            };
            let t1 = Instant::now();
            let (ok, lines) = run_one(pkg, u, exe, stage);
            {
                let _g = printed.lock().unwrap_or_else(|e| e.into_inner());
                let mut o = std::io::stdout().lock();
                let _ = writeln!(o, "== {label}: {} (its output follows)", u.label());
                for l in &lines {
                    let _ = writeln!(o, "{l}");
                }
                let _ = writeln!(
                    o,
                    "== {label}: {} {} in {:.0}s",
                    u.label(),
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
    for u in &solo {
        run_lane("alone", std::slice::from_ref(u));
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

    /// The rollout tests' first part runs in the lane of the witness and endpoint tests (the
    /// RTNL lock's holder), after them; the second part in a lane of its own choosing.
    #[test]
    fn the_rollout_restarts_run_beside_the_rtnl_holder_not_against_it() {
        let all: Vec<Target> = ["rollout", "witness", "endpoints", "matrix", "versions"]
            .into_iter()
            .map(t)
            .collect();
        let refs: Vec<&Target> = all.iter().collect();
        let (lanes, _) = plan(&refs, 3, true);
        let lane_of = |name: &str, part: Option<usize>| {
            lanes
                .iter()
                .position(|l| {
                    l.iter()
                        .any(|u| u.target.name == name && u.part.map(|(p, _)| p) == part)
                })
                .unwrap_or_else(|| panic!("{name} {part:?} in no lane"))
        };
        let rtnl = lane_of("endpoints", None);
        assert_eq!(lane_of("witness", None), rtnl);
        assert_eq!(lane_of("rollout", Some(1)), rtnl);
        let _ = lane_of("rollout", Some(2));
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
        let (lanes, solo) = plan(&refs, 3, false);
        let mut seen: Vec<&str> = lanes
            .iter()
            .flatten()
            .chain(solo.iter())
            .map(|u| u.target.name.as_str())
            .collect();
        seen.sort();
        let mut want: Vec<&str> = all.iter().map(|t| t.name.as_str()).collect();
        want.sort();
        assert_eq!(seen, want);
        assert_eq!(
            solo.iter()
                .map(|u| u.target.name.as_str())
                .collect::<Vec<_>>(),
            ["steps", "budgets"]
        );
        assert_eq!(lanes.len(), 3);
        assert_eq!(lanes[0][0].target.name, "rollout");
        assert!(
            lanes[0].len() == 1,
            "rollout alone fills its lane: {lanes:?}"
        );
        let lane_of = |name: &str| {
            lanes
                .iter()
                .position(|l| l.iter().any(|u| u.target.name == name))
        };
        assert_eq!(lane_of("real_cilium"), lane_of("real_faults"), "{lanes:?}");
        assert_eq!(lane_of("witness"), lane_of("endpoints"), "{lanes:?}");
        let (one, solo) = plan(&refs, 1, true);
        assert!(solo.is_empty());
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].len(), all.len(), "one lane: every target whole");
    }

    /// A sharded target runs in two parts in different lanes, whose filters select every test
    /// exactly once: the prefixes, then `--skip` of each.
    #[test]
    fn a_sharded_target_runs_in_two_parts_that_cover_it_once() {
        let all: Vec<Target> = ["rollout", "matrix", "versions", "x"]
            .into_iter()
            .map(t)
            .collect();
        let refs: Vec<&Target> = all.iter().collect();
        let (lanes, _) = plan(&refs, 3, true);
        let parts: Vec<(usize, &Unit)> = lanes
            .iter()
            .enumerate()
            .flat_map(|(i, l)| l.iter().map(move |u| (i, u)))
            .filter(|(_, u)| u.target.name == "rollout")
            .collect();
        assert_eq!(parts.len(), 2, "{lanes:?}");
        assert_ne!(
            parts[0].0, parts[1].0,
            "the parts run side by side: {lanes:?}"
        );
        let (prefixes, skips): (Vec<&Unit>, Vec<&Unit>) = parts
            .iter()
            .map(|(_, u)| *u)
            .partition(|u| u.part == Some((1, 2)));
        let (p, k) = (&prefixes[0].args, &skips[0].args);
        assert!(
            !p.is_empty() && p.iter().all(|a| a.ends_with("::")),
            "{p:?}"
        );
        let skipped: Vec<&String> = k.iter().skip(1).step_by(2).collect();
        assert!(k.iter().step_by(2).all(|a| a == "--skip"), "{k:?}");
        assert_eq!(skipped, p.iter().collect::<Vec<_>>());
        assert!(prefixes[0].label().contains("part 1 of 2"));
        // With a filter of the run's own, or one lane, the target stays whole.
        let (lanes, _) = plan(&refs, 3, false);
        assert_eq!(
            lanes
                .iter()
                .flatten()
                .filter(|u| u.target.name == "rollout")
                .count(),
            1
        );
    }
}
