//! `cargo xtask test` runs every test target of the workspace and proves it did: the targets
//! are discovered (cargo metadata, plus every `tests/*.rs` on disk), each is run by name, the
//! output is read for each target's `Running …` / `test result` lines, and the run fails when
//! a target exists that did not report a result (or an integration target ran no test).
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// What a target is, for the ledger.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// A library's or binary's unit tests (`src/...`).
    Unit,
    /// An integration test file (`tests/*.rs`).
    Integration,
    /// The doc tests of a library.
    Doc,
}

/// One test target of one package.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Target {
    pub package: String,
    pub kind: Kind,
    /// Cargo's target name (`--test NAME`); the package name for doc tests.
    pub name: String,
    /// Source path relative to the package directory, as cargo prints it in `Running`.
    pub src: String,
    /// Needs root and runs one test at a time against the lab.
    pub privileged: bool,
}

impl Target {
    pub fn label(&self) -> String {
        match self.kind {
            Kind::Doc => format!("{} (doc tests)", self.package),
            _ => format!("{}: {}", self.package, self.src),
        }
    }
}

/// A package of the workspace and its test targets.
#[derive(Debug)]
pub struct Package {
    pub name: String,
    pub dir: PathBuf,
    pub has_lib: bool,
    pub has_bins: bool,
    pub targets: Vec<Target>,
}

/// Packages whose integration tests need root and the lab (run one at a time).
const PRIVILEGED_PACKAGES: [&str; 1] = ["stepguard-lab"];

/// Discovers every package and test target; fails when a `tests/*.rs` file on disk is not a
/// target cargo knows, or a crate in the tree is outside the workspace (its tests would never run).
pub fn discover(root: &Path) -> Result<Vec<Package>> {
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(root)
        .args([
            "metadata",
            "--no-deps",
            "--format-version",
            "1",
            "--offline",
        ])
        .output()
        .context("run cargo metadata")?;
    if !out.status.success() {
        bail!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let meta: Value = serde_json::from_slice(&out.stdout).context("parse cargo metadata")?;
    let members: Vec<&str> = meta["workspace_members"]
        .as_array()
        .map(|a| a.iter().filter_map(|v| v.as_str()).collect())
        .unwrap_or_default();
    let mut packages = Vec::new();
    for p in meta["packages"].as_array().into_iter().flatten() {
        if !members.contains(&p["id"].as_str().unwrap_or("")) {
            continue;
        }
        packages.push(package_from_metadata(p)?);
    }
    check_disk(root, &packages)?;
    Ok(packages)
}

fn package_from_metadata(p: &Value) -> Result<Package> {
    let name = p["name"].as_str().unwrap_or_default().to_string();
    let manifest = PathBuf::from(p["manifest_path"].as_str().unwrap_or_default());
    let dir = manifest
        .parent()
        .context("manifest path without a directory")?
        .to_path_buf();
    let privileged = PRIVILEGED_PACKAGES.contains(&name.as_str());
    let mut pkg = Package {
        name: name.clone(),
        dir: dir.clone(),
        has_lib: false,
        has_bins: false,
        targets: vec![],
    };
    for t in p["targets"].as_array().into_iter().flatten() {
        let kinds: Vec<&str> = t["kind"]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_str()).collect())
            .unwrap_or_default();
        let src_abs = PathBuf::from(t["src_path"].as_str().unwrap_or_default());
        let src = src_abs
            .strip_prefix(&dir)
            .unwrap_or(&src_abs)
            .to_string_lossy()
            .into_owned();
        let tname = t["name"].as_str().unwrap_or_default().to_string();
        let tests_enabled = t["test"].as_bool().unwrap_or(true);
        if kinds.iter().any(|k| k.contains("lib")) {
            pkg.has_lib = true;
            if tests_enabled {
                pkg.targets.push(Target {
                    package: name.clone(),
                    kind: Kind::Unit,
                    name: tname.clone(),
                    src: src.clone(),
                    privileged: false,
                });
            }
            if t["doctest"].as_bool().unwrap_or(false) {
                pkg.targets.push(Target {
                    package: name.clone(),
                    kind: Kind::Doc,
                    name: tname.clone(),
                    src: src.clone(),
                    privileged: false,
                });
            }
        } else if kinds.contains(&"bin") {
            pkg.has_bins = true;
            if tests_enabled {
                pkg.targets.push(Target {
                    package: name.clone(),
                    kind: Kind::Unit,
                    name: tname,
                    src,
                    privileged: false,
                });
            }
        } else if kinds.contains(&"test") {
            pkg.targets.push(Target {
                package: name.clone(),
                kind: Kind::Integration,
                name: tname,
                src,
                privileged,
            });
        }
    }
    Ok(pkg)
}

/// Every `tests/*.rs` (and `tests/*/main.rs`) under a package must be a target, and every
/// crate in the tree must be a workspace member (or an eBPF crate, which has no host tests).
fn check_disk(root: &Path, packages: &[Package]) -> Result<()> {
    let mut problems = Vec::new();
    for p in packages {
        let tests_dir = p.dir.join("tests");
        let Ok(rd) = std::fs::read_dir(&tests_dir) else {
            continue;
        };
        for e in rd.flatten() {
            let path = e.path();
            let candidate = if path.is_dir() {
                path.join("main.rs")
            } else {
                path.clone()
            };
            if candidate.extension().is_none_or(|x| x != "rs") || !candidate.is_file() {
                continue;
            }
            let rel = candidate
                .strip_prefix(&p.dir)
                .unwrap_or(&candidate)
                .to_string_lossy()
                .into_owned();
            if !p
                .targets
                .iter()
                .any(|t| t.kind == Kind::Integration && t.src == rel)
            {
                problems.push(format!(
                    "{}/{rel} is not a test target cargo would run (autotests off, or a [[test]] missing)",
                    p.name
                ));
            }
        }
    }
    let member_dirs: Vec<PathBuf> = packages.iter().map(|p| p.dir.clone()).collect();
    for manifest in find_manifests(root, 3) {
        let dir = manifest.parent().unwrap_or(root).to_path_buf();
        if dir == root || member_dirs.contains(&dir) {
            continue;
        }
        let ebpf = dir
            .file_name()
            .is_some_and(|n| n.to_string_lossy().ends_with("-ebpf"));
        if ebpf && !dir.join("tests").exists() {
            continue; // bpfel-unknown-none crates: built by `cargo xtask build`, no host tests
        }
        problems.push(format!(
            "{} is a crate outside the workspace: its tests would never run (add it to [workspace] members)",
            manifest.display()
        ));
    }
    if !problems.is_empty() {
        bail!(
            "test targets that `cargo xtask test` would not run:\n  {}",
            problems.join("\n  ")
        );
    }
    Ok(())
}

fn find_manifests(dir: &Path, depth: usize) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in rd.flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if p.is_dir() {
            if depth > 0 && !name.starts_with('.') && name != "target" {
                out.extend(find_manifests(&p, depth - 1));
            }
        } else if name == "Cargo.toml" {
            out.push(p);
        }
    }
    out
}

/// A target's outcome as read from the output.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Outcome {
    pub passed: u64,
    pub failed: u64,
    pub ignored: u64,
    /// Ignored tests whose reason names the flag that runs them ([`RUNS_IGNORED`]).
    pub ignored_for_flag: u64,
    pub ok: bool,
    /// The target's own running time (`finished in …s`), build time excluded.
    pub secs: f64,
}

/// The `cargo xtask test` flag that runs the `#[ignore]`d tests; an ignored test's reason
/// must name it, or the run fails.
pub const RUNS_IGNORED: &str = "cargo xtask test --real-extended";

/// Reads cargo test output: `Running <src> (…)` or `Doc-tests <crate>` opens a target, the
/// next `test result:` line closes it. Returns (key, outcome) in order; key is the src path
/// or `doc:<crate>`.
pub fn parse_output(lines: &[String]) -> Vec<(String, Outcome)> {
    let mut out = Vec::new();
    let mut open: Option<String> = None;
    let mut flagged = 0;
    for line in lines {
        let l = line.trim();
        if l.starts_with("test ") && l.contains(" ... ignored") {
            if l.contains(RUNS_IGNORED) {
                flagged += 1;
            }
        } else if let Some(rest) = l.strip_prefix("Running ") {
            flagged = 0;
            let rest = rest.strip_prefix("unittests ").unwrap_or(rest);
            let src = rest.split(" (").next().unwrap_or(rest).trim();
            open = Some(src.to_string());
        } else if let Some(krate) = l.strip_prefix("Doc-tests ") {
            flagged = 0;
            open = Some(format!("doc:{}", krate.trim()));
        } else if let Some(rest) = l.strip_prefix("test result: ") {
            if let Some(key) = open.take() {
                let num = |word: &str| -> u64 {
                    rest.split(';')
                        .find_map(|part| {
                            let part = part
                                .trim()
                                .trim_start_matches("ok.")
                                .trim_start_matches("FAILED.")
                                .trim();
                            part.strip_suffix(word).and_then(|n| n.trim().parse().ok())
                        })
                        .unwrap_or(0)
                };
                out.push((
                    key,
                    Outcome {
                        passed: num("passed"),
                        failed: num("failed"),
                        ignored: num("ignored"),
                        ignored_for_flag: std::mem::take(&mut flagged),
                        ok: rest.starts_with("ok"),
                        secs: rest
                            .rsplit("finished in ")
                            .next()
                            .filter(|_| rest.contains("finished in "))
                            .and_then(|t| t.trim().trim_end_matches('s').parse().ok())
                            .unwrap_or(0.0),
                    },
                ));
            }
        }
    }
    out
}

/// Runs a command with its stdout and stderr merged, returning (success, lines); `echo`
/// streams each line to our stdout as it comes (a lane collects its output quietly instead).
pub fn run_capturing(cmd: &mut Command, echo: bool) -> Result<(bool, Vec<String>)> {
    let (reader, writer) = std::io::pipe().context("pipe")?;
    let writer2 = writer.try_clone().context("pipe")?;
    cmd.stdout(writer).stderr(writer2);
    let shown = format!("{cmd:?}");
    let mut child = cmd.spawn().with_context(|| format!("start {shown}"))?;
    // Our copies of the write end must be gone, or the reader never sees EOF.
    cmd.stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let mut lines = Vec::new();
    let stdout = std::io::stdout();
    for line in BufReader::new(reader).lines() {
        let line = line.unwrap_or_default();
        if echo {
            let mut o = stdout.lock();
            let _ = writeln!(o, "{line}");
        }
        lines.push(line);
    }
    let status = child.wait().with_context(|| format!("wait {shown}"))?;
    Ok((status.success(), lines))
}

/// The ledger: every expected target and what happened to it, and how long each stage of
/// the run took.
pub struct Ledger {
    pub rows: BTreeMap<Target, Option<Outcome>>,
    /// (stage, seconds) in the order the stages ran.
    pub stages: Vec<(String, f64)>,
}

impl Ledger {
    pub fn new(targets: impl IntoIterator<Item = Target>) -> Self {
        Ledger {
            rows: targets.into_iter().map(|t| (t, None)).collect(),
            stages: Vec::new(),
        }
    }

    /// Records how long a stage of the run took.
    pub fn stage(&mut self, name: impl Into<String>, since: Instant) {
        self.stages
            .push((name.into(), since.elapsed().as_secs_f64()));
    }

    /// Records the results of one run over `package`'s targets.
    pub fn record(&mut self, package: &str, results: &[(String, Outcome)]) {
        for (key, outcome) in results {
            let found = self.rows.iter_mut().find(|(t, _)| {
                t.package == package
                    && match t.kind {
                        Kind::Doc => key == &format!("doc:{}", t.name),
                        _ => key == &t.src,
                    }
            });
            if let Some((_, slot)) = found {
                // A target run in parts (`lanes::SHARDS`) reports once per part: the sum.
                *slot = Some(match slot.take() {
                    Some(before) => Outcome {
                        passed: before.passed + outcome.passed,
                        failed: before.failed + outcome.failed,
                        ignored: before.ignored + outcome.ignored,
                        ignored_for_flag: before.ignored_for_flag + outcome.ignored_for_flag,
                        ok: before.ok && outcome.ok,
                        secs: before.secs + outcome.secs,
                    },
                    None => outcome.clone(),
                });
            }
        }
    }

    /// Problems: targets with no result, failures, integration targets with no test.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        for (t, o) in &self.rows {
            match o {
                None => p.push(format!("{}: did not run", t.label())),
                Some(o) if !o.ok || o.failed > 0 => {
                    p.push(format!("{}: {} failed", t.label(), o.failed))
                }
                Some(o) if o.ignored > o.ignored_for_flag => p.push(format!(
                    "{}: {} ignored test(s) whose reason does not name `{RUNS_IGNORED}`",
                    t.label(),
                    o.ignored - o.ignored_for_flag
                )),
                // A target whose every test waits for the flag is accounted for (the table
                // says so); one that ran nothing else is not.
                Some(o)
                    if t.kind == Kind::Integration && o.passed == 0 && o.ignored_for_flag == 0 =>
                {
                    p.push(format!(
                        "{}: ran no test (an integration target must test something)",
                        t.label()
                    ))
                }
                _ => {}
            }
        }
        p
    }

    pub fn table(&self) -> String {
        let mut s = String::from("== every test target\n");
        for (t, o) in &self.rows {
            let what = match o {
                None => "NOT RUN".to_string(),
                Some(o) => format!(
                    "{} passed, {} failed{}",
                    o.passed,
                    o.failed,
                    if o.ignored > 0 {
                        format!(", {} ignored (they run with `{RUNS_IGNORED}`)", o.ignored)
                    } else {
                        String::new()
                    }
                ),
            };
            let secs = o
                .as_ref()
                .map(|o| format!("{:>7.1}s", o.secs))
                .unwrap_or_else(|| format!("{:>8}", "-"));
            s.push_str(&format!("  {:<58} {secs}  {what}\n", t.label()));
        }
        if !self.stages.is_empty() {
            s.push_str("== every stage\n");
            for (name, secs) in &self.stages {
                s.push_str(&format!("  {name:<58} {secs:>7.1}s\n"));
            }
        }
        let mut slow: Vec<(&Target, f64)> = self
            .rows
            .iter()
            .filter_map(|(t, o)| o.as_ref().map(|o| (t, o.secs)))
            .filter(|(_, secs)| *secs > 0.0)
            .collect();
        slow.sort_by(|a, b| b.1.total_cmp(&a.1));
        if !slow.is_empty() {
            s.push_str("== the slowest ten targets\n");
            for (t, secs) in slow.into_iter().take(10) {
                s.push_str(&format!("  {:<58} {secs:>7.1}s\n", t.label()));
            }
        }
        s
    }
}

/// How a stage runs a package's targets.
pub struct Stage<'a> {
    pub title: &'a str,
    pub envs: Vec<(String, PathBuf)>,
    pub test_args: Vec<String>,
}

/// Runs `targets` of `pkg` in one cargo invocation; records into the ledger.
pub fn run_targets(
    root: &Path,
    pkg: &Package,
    targets: &[&Target],
    stage: &Stage,
    ledger: &mut Ledger,
) -> Result<bool> {
    if targets.is_empty() {
        return Ok(true);
    }
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    // Every target runs even when an earlier one fails: the ledger shows them all.
    cmd.current_dir(root)
        .args(["test", "--no-fail-fast", "-p", &pkg.name]);
    for (k, v) in &stage.envs {
        cmd.env(k, v);
    }
    if targets.iter().any(|t| t.kind == Kind::Doc) {
        cmd.arg("--doc");
    } else {
        for t in targets {
            match t.kind {
                Kind::Unit if pkg.has_lib && t.src.starts_with("src/lib") => {
                    cmd.arg("--lib");
                }
                Kind::Unit => {
                    cmd.args(["--bin", &t.name]);
                }
                Kind::Integration => {
                    cmd.args(["--test", &t.name]);
                }
                Kind::Doc => {}
            }
        }
    }
    if !stage.test_args.is_empty() {
        cmd.arg("--").args(&stage.test_args);
    }
    println!(
        "== {}: {} ({})",
        stage.title,
        pkg.name,
        targets
            .iter()
            .map(|t| match t.kind {
                Kind::Doc => "doc tests",
                _ => t.src.as_str(),
            })
            .collect::<Vec<_>>()
            .join(", ")
    );
    let started = Instant::now();
    let (ok, lines) = run_capturing(&mut cmd, true)?;
    ledger.record(&pkg.name, &parse_output(&lines));
    println!(
        "== {}: {} took {:.0}s",
        stage.title,
        pkg.name,
        started.elapsed().as_secs_f64()
    );
    Ok(ok)
}

#[cfg(test)]
mod tests;
