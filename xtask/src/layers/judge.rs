//! Judging imports against a layer table, and the workspace's crates against their order.
use super::extract::Import;
use super::source::{Tree, ROOT};
use super::{Crate, Layers, Units, CRATES};
use anyhow::{Context, Result};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The unit a module is judged as: the unit that groups it (see [`Crate::units`]), or itself.
fn unit_of(units: Units, m: &str) -> &str {
    units
        .iter()
        .find(|(_, ms)| ms.contains(&m))
        .map(|(u, _)| *u)
        .unwrap_or(m)
}

/// The problems with `imports` under `layers` (empty: imports point only down). Modules a unit
/// of `units` groups are judged as that unit: imports between them are not judged, and the
/// table places the unit.
pub fn judge(layers: Layers, units: Units, imports: &[Import]) -> Vec<String> {
    let layer_of: BTreeMap<&str, usize> = layers
        .iter()
        .enumerate()
        .flat_map(|(i, (_, ms))| ms.iter().map(move |m| (*m, i)))
        .collect();
    let imports: Vec<(&str, &str, &Import)> = imports
        .iter()
        .map(|im| (unit_of(units, &im.from), unit_of(units, &im.to), im))
        .filter(|(a, b, _)| a != b)
        .collect();
    let mut problems = Vec::new();
    let mut unplaced = BTreeSet::new();
    for &(from, to, im) in &imports {
        if to == ROOT && !layer_of.contains_key(ROOT) {
            problems.push(format!(
                "upward import: {}:{} `{}` — {} uses the crate root's own items (lib.rs), which \
                 stand above every module",
                im.file, im.line, im.path, im.from
            ));
            continue;
        }
        for m in [from, to] {
            if !layer_of.contains_key(m) && unplaced.insert(m) {
                problems.push(format!(
                    "module `{m}` ({}:{}) has no layer: place it in xtask/src/layers/tables.rs",
                    im.file, im.line
                ));
            }
        }
        if let (Some(&a), Some(&b)) = (layer_of.get(from), layer_of.get(to)) {
            if b > a {
                problems.push(format!(
                    "upward import: {}:{} `{}` — {} (layer {}, {}) uses {} (layer {}, {})",
                    im.file,
                    im.line,
                    im.path,
                    im.from,
                    a + 1,
                    layers[a].0,
                    im.to,
                    b + 1,
                    layers[b].0
                ));
            }
        }
    }
    // Circles (within a layer, where imports are allowed both ways).
    let mut graph: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for &(from, to, _) in &imports {
        graph.entry(from).or_default().insert(to);
    }
    for circle in circles(&graph) {
        let why: Vec<String> = imports
            .iter()
            .filter(|(a, b, _)| circle.contains(a) && circle.contains(b))
            .map(|(_, _, im)| {
                format!(
                    "{} -> {} ({}:{} `{}`)",
                    im.from, im.to, im.file, im.line, im.path
                )
            })
            .collect();
        let more = why.len().saturating_sub(12);
        problems.push(format!(
            "import circle over {}: {}{}",
            circle.join(", "),
            why[..why.len().min(12)].join("; "),
            if more > 0 {
                format!("; and {more} more")
            } else {
                String::new()
            }
        ));
    }
    problems
}

/// What the table says of the modules `lib.rs` declares: each has a place (an unplaced one
/// fails even if nothing imports it yet), and each module the table places exists.
pub fn placement(krate: &Crate, tree: &Tree) -> Vec<String> {
    let mut problems = Vec::new();
    if !tree.files.iter().any(|f| f.rel == "lib.rs") {
        return problems;
    }
    for m in &tree.root.declared {
        if !krate.places(m) {
            problems.push(format!(
                "module `{m}` ({}/lib.rs) has no layer: place it in xtask/src/layers/tables.rs",
                krate.dir
            ));
        }
    }
    let placed = krate
        .layers
        .iter()
        .flat_map(|(_, ms)| ms.iter())
        .flat_map(|m| {
            krate
                .units
                .iter()
                .find(|(u, _)| u == m)
                .map(|(_, ms)| ms.to_vec())
                .unwrap_or_else(|| vec![*m])
        });
    for m in placed {
        let exists = m == ROOT
            || (m == "bin" && tree.files.iter().any(|f| f.rel.starts_with("bin/")))
            || (m == "main" && tree.files.iter().any(|f| f.rel == "main.rs"))
            || tree.root.is_module(m);
        if !exists {
            problems.push(format!(
                "xtask/src/layers/tables.rs places `{m}`, which {}/lib.rs does not declare",
                krate.dir
            ));
        }
    }
    problems
}

/// Strongly connected components with more than one module.
fn circles<'a>(g: &BTreeMap<&'a str, BTreeSet<&'a str>>) -> Vec<Vec<&'a str>> {
    // Kosaraju: order by finish time, then walk the reversed graph.
    let nodes: BTreeSet<&str> = g
        .keys()
        .copied()
        .chain(g.values().flatten().copied())
        .collect();
    let mut seen = BTreeSet::new();
    let mut order = Vec::new();
    for &n in &nodes {
        if seen.contains(n) {
            continue;
        }
        let mut stack = vec![(n, false)];
        while let Some((v, done)) = stack.pop() {
            if done {
                order.push(v);
                continue;
            }
            if !seen.insert(v) {
                continue;
            }
            stack.push((v, true));
            for &w in g.get(v).into_iter().flatten() {
                if !seen.contains(w) {
                    stack.push((w, false));
                }
            }
        }
    }
    let mut rev: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (&a, bs) in g {
        for &b in bs {
            rev.entry(b).or_default().push(a);
        }
    }
    let mut assigned = BTreeSet::new();
    let mut out = Vec::new();
    for &v in order.iter().rev() {
        if assigned.contains(v) {
            continue;
        }
        let mut comp = Vec::new();
        let mut stack = vec![v];
        assigned.insert(v);
        while let Some(x) = stack.pop() {
            comp.push(x);
            for &w in rev.get(x).into_iter().flatten() {
                if assigned.insert(w) {
                    stack.push(w);
                }
            }
        }
        if comp.len() > 1 {
            comp.sort();
            out.push(comp);
        }
    }
    out
}

/// A workspace crate's name and its `[dependencies]` among the workspace's crates.
pub fn crate_deps(manifest: &Path) -> Result<(String, Vec<String>)> {
    let text = std::fs::read_to_string(manifest)
        .with_context(|| format!("read {}", manifest.display()))?;
    let mut name = None;
    let mut deps = Vec::new();
    let mut section = String::new();
    for line in text.lines() {
        let l = line.trim();
        if l.starts_with('[') {
            section = l.to_string();
            continue;
        }
        let key = l.split('=').next().unwrap_or("").trim();
        if section == "[package]" && key == "name" && name.is_none() {
            name = l
                .split('=')
                .nth(1)
                .map(|v| v.trim().trim_matches('"').to_string());
        }
        if section == "[dependencies]" && CRATES.contains(&key) {
            deps.push(key.to_string());
        }
    }
    Ok((
        name.with_context(|| format!("{} has no package name", manifest.display()))?,
        deps,
    ))
}

/// The crates' problems: a dependency on a crate above, or a crate the table does not place.
pub fn judge_crates(crates: &[(String, Vec<String>)]) -> Vec<String> {
    let rank = |n: &str| CRATES.iter().position(|c| *c == n);
    let mut problems = Vec::new();
    for (name, deps) in crates {
        let Some(me) = rank(name) else {
            problems.push(format!(
                "crate `{name}` has no place in xtask/src/layers/tables.rs CRATES"
            ));
            continue;
        };
        for d in deps {
            if rank(d).is_some_and(|r| r >= me) {
                problems.push(format!(
                    "crate `{name}` depends on `{d}`, which is not below it"
                ));
            }
        }
    }
    problems
}
