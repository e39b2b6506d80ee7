//! `cargo xtask layers`: imports point only down. Every `crate::`, `super::` and
//! `stepguard_kernel::` path in the agent's source outside test code (`use` groups, `super::`
//! chains and paths written inline) is read; an import from one top-level module of the agent
//! to a module of a higher layer, a circle between modules, a module the table below does not
//! place, or a workspace crate depending on a crate above it fails the check.
//!
//! Within one layer a module may use another (checks reads the Cilium API client), as long as
//! no circle forms. The CLI (`main.rs`) and the crate root (`lib.rs`) stand above everything.
use anyhow::{bail, Context, Result};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The agent's layers, lowest first (see `docs/architecture.md`).
pub const AGENT_LAYERS: &[(&str, &[&str])] = &[
    (
        "base: durations, statistics, limits, locks, durable files",
        &["duration", "stats", "limits", "locks", "durable"],
    ),
    (
        "cilium: Cilium's own rules per release (maps, drop reasons, device selection and hooks)",
        &["cilium"],
    ),
    (
        "wire: what agent, witness and stepper send each other; agent URLs and the HTTP client",
        &["wire", "client"],
    ),
    ("config", &["config"]),
    (
        "kernel: syscalls only (sockets, epoll, bpf, netlink, clocks)",
        &["kernel"],
    ),
    (
        "probes: one file per kind, their registry and the engine",
        &["probe"],
    ),
    (
        "timeline: recording probe outcomes, rings, gaps, seeding (agent and witness)",
        &["timeline"],
    ),
    (
        "checks and their evidence",
        &["ciliumapi", "ciliumconfig", "checks", "node", "report"],
    ),
    (
        "step: params, state, baseline, observation rules, verdict",
        &["step"],
    ),
    (
        "serving: auth, limits, health and metrics",
        &["serving", "metrics"],
    ),
    (
        "the agent, the witness, the stepper and the command-line hooks",
        &["daemon", "witness", "rollout", "hooks"],
    ),
];

/// Modules that must stay pure: no clock, file, socket, process, randomness or runtime, so
/// their rules are tested without a daemon (the caller passes the time and the readings in).
/// Each with the paths its code (outside tests) must not name.
pub const PURE: &[(&str, &[&str])] = &[(
    "step",
    &[
        "std::fs",
        "std::net::Tcp",
        "std::net::Udp",
        "std::process",
        "std::thread",
        "SystemTime",
        "Instant::now",
        "unix_now",
        "clock::",
        "getrandom",
        "tokio",
        "bpffs::read",
        "observe_via",
    ],
)];

/// Workspace crates, lowest first: a crate may depend only on crates before it.
pub const CRATES: &[&str] = &[
    "agent-common",
    "agent-ebpf",
    "lab-ebpf",
    "stepguard-kernel",
    "stepguard",
    "stepguard-lab",
    "xtask",
];

/// External crates whose paths stand for one of the agent's layers.
const CRATE_MODULES: &[(&str, &str)] = &[("stepguard_kernel", "kernel")];

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Import {
    pub file: String,
    pub line: usize,
    pub from: String,
    pub to: String,
    pub path: String,
}

/// Removes comments, string and char literals (their text is no import), keeping newlines.
fn strip_comments_and_strings(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if b[i] == b'\n' {
                        out.push('\n');
                    }
                    i += 1;
                }
            }
        } else if c == b'r'
            && matches!(b.get(i + 1), Some(b'"') | Some(b'#'))
            && !ident_before(b, i)
        {
            // Raw string: r"..." or r#"..."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&b'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&b'"') {
                out.push(c as char);
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == b'"' && (0..hashes).all(|h| b.get(j + 1 + h) == Some(&b'#')) {
                    j += 1 + hashes;
                    break;
                }
                if b[j] == b'\n' {
                    out.push('\n');
                }
                j += 1;
            }
            out.push_str("\"\"");
            i = j;
        } else if c == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    i += 1;
                }
                if i < b.len() && b[i] == b'\n' {
                    out.push('\n');
                }
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == b'\'' {
            // A char literal ('x', '\n', '\u{..}') or a lifetime ('a).
            let close = if b.get(i + 1) == Some(&b'\\') {
                b[i + 2..]
                    .iter()
                    .position(|&x| x == b'\'')
                    .map(|p| i + 2 + p)
            } else if b.get(i + 2) == Some(&b'\'') {
                Some(i + 2)
            } else {
                None
            };
            match close {
                Some(end) => {
                    out.push_str("' '");
                    i = end + 1;
                }
                None => {
                    out.push('\'');
                    i += 1;
                }
            }
        } else {
            let ch = src[i..].chars().next().unwrap_or(' ');
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    out
}

fn ident_before(b: &[u8], i: usize) -> bool {
    i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')
}

/// Blanks every item under `#[cfg(test)]` (a test module or function), keeping newlines.
fn strip_test_items(src: &str) -> String {
    let mut s = src.to_string();
    while let Some(at) = s.find("#[cfg(test)]") {
        let b = s.as_bytes();
        // The item ends at its closing brace, or at a `;` before any brace (`mod tests;`).
        let mut i = at + "#[cfg(test)]".len();
        let mut depth = 0usize;
        let mut end = b.len();
        while i < b.len() {
            match b[i] {
                b'{' => depth += 1,
                b'}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = i + 1;
                        break;
                    }
                }
                b';' if depth == 0 => {
                    end = i + 1;
                    break;
                }
                _ => {}
            }
            i += 1;
        }
        let blank: String = s[at..end]
            .chars()
            .map(|c| if c == '\n' { '\n' } else { ' ' })
            .collect();
        s.replace_range(at..end, &blank);
    }
    s
}

/// The first identifiers of a use tree's top level: `{a, b::{c, d}, self}` → a, b, self.
fn group_heads(tree: &str) -> Vec<String> {
    let mut heads = Vec::new();
    let mut depth = 0;
    let mut cur = String::new();
    let mut taking = true;
    for c in tree.chars() {
        match c {
            '{' => {
                depth += 1;
                if depth > 1 {
                    taking = false;
                }
            }
            '}' => {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
            ',' if depth == 1 => {
                if !cur.is_empty() {
                    heads.push(std::mem::take(&mut cur));
                }
                taking = true;
            }
            c if depth == 1 && taking && (c.is_ascii_alphanumeric() || c == '_') => cur.push(c),
            ':' if depth == 1 => taking = false,
            c if depth == 1 && !c.is_whitespace() => taking = false,
            _ => {}
        }
    }
    if !cur.is_empty() {
        heads.push(cur);
    }
    heads
}

fn ident_at(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect()
}

/// Every reference from the file at `module` (its path from the crate root, `mod.rs` as its
/// directory) to another top-level module: (line, target, the path as written).
pub fn references(module: &[String], src: &str) -> Vec<(usize, String, String)> {
    let code = strip_test_items(&strip_comments_and_strings(src));
    let mut out = Vec::new();
    let line_of = |at: usize| code[..at].matches('\n').count() + 1;
    let bytes = code.as_bytes();
    let mut i = 0;
    while i < code.len() {
        if !code.is_char_boundary(i) || ident_before(bytes, i) {
            i += 1;
            continue;
        }
        let rest = &code[i..];
        // `crate::` or an external crate standing for a layer.
        let mut root: Option<(Vec<String>, usize)> = None;
        if let Some(r) = rest.strip_prefix("crate::") {
            root = Some((Vec::new(), rest.len() - r.len()));
        } else if rest.starts_with("super::") {
            let mut n = 0;
            let mut r = rest;
            while let Some(x) = r.strip_prefix("super::") {
                n += 1;
                r = x;
            }
            let keep = module.len().saturating_sub(n);
            root = Some((module[..keep].to_vec(), rest.len() - r.len()));
        } else {
            for (krate, layer_module) in CRATE_MODULES {
                if let Some(r) = rest.strip_prefix(krate).and_then(|r| r.strip_prefix("::")) {
                    let written = format!("{krate}::{}", ident_at(r));
                    out.push((line_of(i), layer_module.to_string(), written));
                    i += krate.len();
                }
            }
        }
        let Some((base, skip)) = root else {
            i += 1;
            continue;
        };
        let after = &rest[skip..];
        let mut heads = Vec::new();
        if after.starts_with('{') {
            heads.extend(group_heads(after));
        } else {
            heads.push(ident_at(after));
        }
        for h in heads {
            if h.is_empty() || h == "self" {
                continue;
            }
            let mut path = base.clone();
            path.push(h.clone());
            let written = format!("{}{h}", &rest[..skip]);
            out.push((line_of(i), path[0].clone(), written));
        }
        i += skip;
    }
    out
}

/// The module path of a source file under `src` (`a/mod.rs` → [a], `a/b.rs` → [a, b]).
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap_or(file);
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for e in std::fs::read_dir(dir).with_context(|| format!("read {}", dir.display()))? {
        let p = e?.path();
        if p.is_dir() {
            rust_files(&p, out)?;
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    Ok(())
}

/// Files declared as test modules (`#[cfg(test)] mod tests;`): test code, like an inline
/// `#[cfg(test)] mod tests { .. }`.
fn test_files(src: &Path, files: &[PathBuf]) -> Result<BTreeSet<PathBuf>> {
    let mut out = BTreeSet::new();
    for f in files {
        let text = std::fs::read_to_string(f).with_context(|| format!("read {}", f.display()))?;
        let code = strip_comments_and_strings(&text);
        // The directory a file's child modules live in.
        let dir = match f.file_name().and_then(|n| n.to_str()) {
            Some("mod.rs" | "lib.rs" | "main.rs") => f.parent().unwrap_or(src).to_path_buf(),
            _ => f.with_extension(""),
        };
        let mut rest = code.as_str();
        while let Some(at) = rest.find("#[cfg(test)]") {
            let after = rest[at + "#[cfg(test)]".len()..].trim_start();
            let after = after.strip_prefix("pub ").unwrap_or(after);
            if let Some(m) = after.strip_prefix("mod ") {
                let name = ident_at(m);
                if m[name.len()..].trim_start().starts_with(';') {
                    out.insert(dir.join(format!("{name}.rs")));
                    out.insert(dir.join(&name).join("mod.rs"));
                }
            }
            rest = &rest[at + 1..];
        }
    }
    Ok(out)
}

/// Where the pure modules (`rules`) name what they must not, outside test code: one line each.
pub fn impure(src: &Path, rules: &[(&str, &[&str])]) -> Result<Vec<String>> {
    let mut files = Vec::new();
    rust_files(src, &mut files)?;
    files.sort();
    let tests = test_files(src, &files)?;
    let mut out = Vec::new();
    for f in files.iter().filter(|f| !tests.contains(*f)) {
        let module = module_path(src, f);
        let Some((m, banned)) = rules
            .iter()
            .find(|(m, _)| module.first().map(String::as_str) == Some(*m))
        else {
            continue;
        };
        let text = std::fs::read_to_string(f).with_context(|| format!("read {}", f.display()))?;
        let code = strip_test_items(&strip_comments_and_strings(&text));
        for (n, line) in code.lines().enumerate() {
            for b in banned.iter().filter(|b| line.contains(**b)) {
                out.push(format!(
                    "{}:{}: `{m}` must stay pure, but names `{b}` (pass the time or the reading in)",
                    f.strip_prefix(src).unwrap_or(f).display(),
                    n + 1
                ));
            }
        }
    }
    Ok(out)
}

/// Every import between top-level modules of the crate whose sources are in `src`.
pub fn imports(src: &Path) -> Result<Vec<Import>> {
    let mut files = Vec::new();
    rust_files(src, &mut files)?;
    files.sort();
    let tests = test_files(src, &files)?;
    let mut out = Vec::new();
    for f in files {
        if tests.contains(&f) {
            continue;
        }
        let module = module_path(src, &f);
        let from = match module.first().map(String::as_str) {
            None | Some("lib") | Some("main") | Some("bin") => continue,
            Some(m) => m.to_string(),
        };
        let text = std::fs::read_to_string(&f).with_context(|| format!("read {}", f.display()))?;
        for (line, to, path) in references(&module, &text) {
            if to != from {
                out.push(Import {
                    file: f.strip_prefix(src).unwrap_or(&f).display().to_string(),
                    line,
                    from: from.clone(),
                    to,
                    path,
                });
            }
        }
    }
    Ok(out)
}

/// The problems with `imports` under `layers` (empty: imports point only down).
pub fn judge(layers: &[(&str, &[&str])], imports: &[Import]) -> Vec<String> {
    let layer_of: BTreeMap<&str, usize> = layers
        .iter()
        .enumerate()
        .flat_map(|(i, (_, ms))| ms.iter().map(move |m| (*m, i)))
        .collect();
    let mut problems = Vec::new();
    let mut unplaced = BTreeSet::new();
    for im in imports {
        for m in [&im.from, &im.to] {
            if !layer_of.contains_key(m.as_str()) && unplaced.insert(m.clone()) {
                problems.push(format!(
                    "module `{m}` ({}:{}) has no layer: place it in xtask/src/layers.rs",
                    im.file, im.line
                ));
            }
        }
        if let (Some(&a), Some(&b)) = (layer_of.get(im.from.as_str()), layer_of.get(im.to.as_str()))
        {
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
    for im in imports {
        graph.entry(&im.from).or_default().insert(&im.to);
    }
    for circle in circles(&graph) {
        let why: Vec<String> = imports
            .iter()
            .filter(|im| circle.contains(&im.from.as_str()) && circle.contains(&im.to.as_str()))
            .map(|im| {
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
fn crate_deps(manifest: &Path) -> Result<(String, Vec<String>)> {
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
                "crate `{name}` has no place in xtask/src/layers.rs CRATES"
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

/// The agent's sources and the workspace's manifests, checked.
pub fn check(root: &Path) -> Result<()> {
    let agent = imports(&root.join("agent/src"))?;
    let mut problems = judge(AGENT_LAYERS, &agent);
    problems.extend(impure(&root.join("agent/src"), PURE)?);
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
        "== layers: {} imports between the agent's modules point down; {} crates in order; {} pure",
        agent.len(),
        crates.len(),
        PURE.iter().map(|(m, _)| *m).collect::<Vec<_>>().join(", ")
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LAYERS: &[(&str, &[&str])] = &[
        ("base", &["base"]),
        ("low", &["low", "peer"]),
        ("high", &["high"]),
    ];

    fn planted(files: &[(&str, &str)]) -> Vec<String> {
        let dir = std::env::temp_dir().join(format!(
            "stepguard-layers-{}-{}",
            std::process::id(),
            files.len() ^ files.iter().map(|f| f.1.len()).sum::<usize>()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        for (path, text) in files {
            let p = dir.join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        let im = imports(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        judge(LAYERS, &im)
    }

    /// A pure module naming the clock or a file fails, with the file and line; the same in
    /// its tests, a comment or a string passes.
    #[test]
    fn a_pure_module_reading_the_clock_or_a_file_fails() {
        let dir = std::env::temp_dir().join(format!("stepguard-pure-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("step")).unwrap();
        std::fs::write(
            dir.join("step/mod.rs"),
            "mod a;\n#[cfg(test)]\nmod tests;\n// std::fs is fine in a comment\nconst S: &str = \"unix_now\";\n",
        )
        .unwrap();
        std::fs::write(
            dir.join("step/a.rs"),
            "fn f() -> f64 { crate::probe::unix_now() }\nfn g() { let _ = std::fs::read(\"x\"); }\n#[cfg(test)]\nmod t { fn h() { std::fs::read(\"y\"); } }\n",
        )
        .unwrap();
        std::fs::write(
            dir.join("step/tests.rs"),
            "fn t() { std::fs::read(\"z\"); }\n",
        )
        .unwrap();
        std::fs::write(dir.join("other.rs"), "fn o() { std::fs::read(\"z\"); }\n").unwrap();
        let p = impure(&dir, &[("step", &["std::fs", "unix_now"])]).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(p.len(), 2, "{p:?}");
        assert!(
            p[0].starts_with("step/a.rs:1:") && p[0].contains("unix_now"),
            "{p:?}"
        );
        assert!(
            p[1].starts_with("step/a.rs:2:") && p[1].contains("std::fs"),
            "{p:?}"
        );
    }

    #[test]
    fn a_use_group_reaching_up_fails() {
        let p = planted(&[
            ("low.rs", "use crate::{base::X, high::{Y, Z}};\n"),
            ("base.rs", ""),
            ("high.rs", ""),
        ]);
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(
            p[0].contains("upward import: low.rs:1 `crate::high`"),
            "{p:?}"
        );
    }

    #[test]
    fn a_super_chain_reaching_up_fails() {
        let p = planted(&[
            ("low/mod.rs", "pub mod deep;\n"),
            (
                "low/deep.rs",
                "fn f() {\n    let _ = super::super::high::thing();\n    super::sibling();\n}\n",
            ),
            ("high.rs", ""),
        ]);
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].contains("low/deep.rs:2 `super::super::high`"), "{p:?}");
    }

    #[test]
    fn an_inline_path_reaching_up_fails_and_a_downward_one_passes() {
        let p = planted(&[
            (
                "low.rs",
                "fn f() -> u8 { crate::base::one() + crate::high::two() }\n",
            ),
            ("base.rs", ""),
            ("high.rs", ""),
        ]);
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].contains("`crate::high`"), "{p:?}");
    }

    #[test]
    fn a_use_super_group_is_resolved_per_item() {
        let p = planted(&[(
            "high/part.rs",
            "use super::{other, super::low::X};\nuse super::super::{base, high};\n",
        )]);
        assert!(p.is_empty(), "{p:?}");
        let p = planted(&[("low/part.rs", "use super::super::{base, high};\n")]);
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].contains("`super::super::high`"), "{p:?}");
    }

    #[test]
    fn a_circle_within_a_layer_fails() {
        let p = planted(&[
            ("low.rs", "use crate::peer::A;\n"),
            ("peer.rs", "pub fn f() { crate::low::g() }\n"),
        ]);
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].starts_with("import circle over low, peer"), "{p:?}");
    }

    #[test]
    fn a_module_without_a_layer_fails() {
        let p = planted(&[("newthing.rs", "use crate::base::X;\n")]);
        assert!(p[0].contains("module `newthing`"), "{p:?}");
    }

    #[test]
    fn tests_comments_and_strings_are_not_imports() {
        let p = planted(&[(
            "low.rs",
            "// crate::high::in_a_comment\n/* crate::high::block */\n\
             /// See [`crate::high`].\n\
             fn f() -> &'static str { \"crate::high::in_a_string\" }\n\
             fn g() -> char { '\"' }\n\
             #[cfg(test)]\nmod tests {\n    use crate::high::Helper;\n    fn t() { super::super::high::x(); }\n}\n",
        )]);
        assert!(p.is_empty(), "{p:?}");
    }

    #[test]
    fn a_test_module_in_its_own_file_is_test_code() {
        let p = planted(&[
            ("low/mod.rs", "#[cfg(test)]\nmod tests;\npub fn f() {}\n"),
            ("low/tests.rs", "use crate::high::Helper;\n"),
            ("base.rs", "#[cfg(test)]\nmod base_tests;\n"),
            ("base/base_tests.rs", "use crate::high::Helper;\n"),
            ("high.rs", ""),
        ]);
        assert!(p.is_empty(), "{p:?}");
        // Declared without #[cfg(test)], the same file is code like any other.
        let p = planted(&[
            ("low/mod.rs", "mod helpers;\n"),
            ("low/helpers.rs", "use crate::high::Helper;\n"),
            ("high.rs", ""),
        ]);
        assert_eq!(p.len(), 1, "{p:?}");
    }

    #[test]
    fn an_external_crate_standing_for_a_layer_counts() {
        let refs = references(&["duration".into()], "use stepguard_kernel::sock;\n");
        assert_eq!(
            refs,
            vec![(1, "kernel".into(), "stepguard_kernel::sock".into())]
        );
    }

    #[test]
    fn a_crate_depending_upward_fails() {
        let p = judge_crates(&[
            ("stepguard".into(), vec!["agent-common".into()]),
            ("agent-common".into(), vec!["stepguard".into()]),
            ("mystery".into(), vec![]),
        ]);
        assert_eq!(p.len(), 2, "{p:?}");
        assert!(
            p[0].contains("`agent-common` depends on `stepguard`"),
            "{p:?}"
        );
        assert!(p[1].contains("`mystery`"), "{p:?}");
    }

    #[test]
    fn the_workspace_passes() {
        check(&crate::root()).unwrap();
    }
}
