//! `cargo xtask layers`: imports point only down. The sources of the agent (`agent/src`), the
//! kernel crate (`kernel/src`) and the lab (`tests/lab/src`, its programs included) are read
//! with `syn`; every path outside test code that names a module of the same crate is an
//! import: `use` trees (groups, globs, renames), `crate::`, `self::` and `super::` chains,
//! paths written inline (expressions, types, patterns, bounds, impl headers), `a::b` sequences
//! in macro bodies, and the names of other crates standing for a module (`stepguard_kernel::`
//! in the agent, `stepguard_lab::` in the lab's programs). An import from one top-level module
//! to a module of a higher layer, a circle between modules, a module its table does not
//! place, or a workspace crate depending on a crate above it fails the check.
//!
//! Within one layer a module may use another (checks reads the Cilium API client), as long as
//! no circle forms. The crate root's own items are the pseudo-module `lib`, a crate's programs
//! `main` (`src/main.rs`) and `bin` (`src/bin/`); one the table does not place (the agent's
//! `lib.rs` and `main.rs`) stands above everything.
mod extract;
mod judge;
mod source;
mod tables;
#[cfg(test)]
mod tests;

pub use extract::imports;
pub use judge::{crate_deps, judge, judge_crates, placement};
pub use source::Tree;
pub use tables::*;

use anyhow::{bail, Result};
use std::path::Path;

/// A layer table: each layer's description and its modules, lowest first.
pub type Layers = &'static [(&'static str, &'static [&'static str])];
/// Modules judged as one unit (a name the layer table places), each with its members.
pub type Units = &'static [(&'static str, &'static [&'static str])];

/// A crate whose modules the check judges.
pub struct Crate {
    /// For messages: "agent", "kernel", "lab".
    pub name: &'static str,
    /// Its sources, from the workspace root.
    pub dir: &'static str,
    /// Its name in paths (its programs reach the library by it).
    pub ident: &'static str,
    pub layers: Layers,
    /// Modules judged as one (a circle the crate has today, placed whole).
    pub units: Units,
    /// Other crates whose paths stand for one of its modules.
    pub externs: &'static [(&'static str, &'static str)],
}

impl Crate {
    /// Whether its table places the module (itself or through its unit).
    pub fn places(&self, m: &str) -> bool {
        let unit = self
            .units
            .iter()
            .find(|(_, ms)| ms.contains(&m))
            .map_or(m, |(u, _)| *u);
        self.layers.iter().any(|(_, ms)| ms.contains(&unit))
    }
}

/// The crates' sources and the workspace's manifests, checked.
pub fn check(root: &Path) -> Result<()> {
    let mut problems = Vec::new();
    let mut counts = Vec::new();
    for krate in [&AGENT, &KERNEL, &LAB] {
        let tree = Tree::read(&root.join(krate.dir), krate.externs)?;
        let mut im = imports(krate, &tree);
        for i in &mut im {
            i.file = format!("{}/{}", krate.dir, i.file);
        }
        problems.extend(judge(krate.layers, krate.units, &im));
        problems.extend(placement(krate, &tree));
        if krate.name == AGENT.name {
            problems.extend(
                extract::impure_in(&tree, PURE)
                    .into_iter()
                    .map(|p| format!("{}/{p}", krate.dir)),
            );
        }
        counts.push(im.len());
    }
    let mut crates = Vec::new();
    for m in [
        "agent-common",
        "agent-ebpf",
        "tests/lab-ebpf",
        "kernel",
        "agent",
        "tests/lab",
        "xtask",
    ] {
        let manifest = root.join(m).join("Cargo.toml");
        if manifest.exists() {
            crates.push(crate_deps(&manifest)?);
        }
    }
    problems.extend(judge_crates(&crates));
    if !problems.is_empty() {
        bail!(
            "imports must point down ({} problems):\n  {}",
            problems.len(),
            problems.join("\n  ")
        );
    }
    println!(
        "== layers: {} imports between the agent's modules, {} between the kernel crate's and {} \
         between the lab's point down; {} crates in order; {} pure",
        counts[0],
        counts[1],
        counts[2],
        crates.len(),
        PURE.iter().map(|(m, _)| *m).collect::<Vec<_>>().join(", ")
    );
    Ok(())
}
