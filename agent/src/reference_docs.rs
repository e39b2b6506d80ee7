//! The reference docs hold to the code, both ways: every node check code, step reason, exit
//! status, metric family and HTTP route the code has is documented where a reader looks for
//! it, every one the docs name exists, and every relative link in the docs resolves.
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The part of `text` under the heading `heading` (a whole line), up to the next heading of
/// the same or a higher level.
fn section<'a>(text: &'a str, heading: &str) -> &'a str {
    let level = heading.chars().take_while(|c| *c == '#').count();
    let start = text
        .find(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("no heading {heading:?}"))
        + heading.len()
        + 2;
    let rest = &text[start..];
    let end = rest
        .match_indices("\n#")
        .find(|(i, _)| {
            let hashes = rest[i + 1..].chars().take_while(|c| *c == '#').count();
            hashes <= level && rest[i + 1 + hashes..].starts_with(' ')
        })
        .map(|(i, _)| i)
        .unwrap_or(rest.len());
    &rest[..end]
}

/// The first cells of a section's table rows that are one word in backticks.
fn rows(section: &str) -> BTreeSet<String> {
    section
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split_once("` |"))
        .map(|(w, _)| w.to_string())
        .collect()
}

/// Headings of the form ``### `METHOD /path` ``.
fn route_headings(section: &str) -> BTreeSet<String> {
    section
        .lines()
        .filter_map(|l| l.strip_prefix("### `"))
        .filter_map(|l| l.strip_suffix('`'))
        .filter(|r| r.contains(" /"))
        .map(String::from)
        .collect()
}

/// Both ways: what the code has and what the docs name, with what each misses.
fn same(what: &str, code: BTreeSet<String>, docs: BTreeSet<String>) {
    let undocumented: Vec<_> = code.difference(&docs).collect();
    let unknown: Vec<_> = docs.difference(&code).collect();
    assert!(
        undocumented.is_empty() && unknown.is_empty(),
        "{what}: in the code but not the docs {undocumented:?}; in the docs but not the code {unknown:?}"
    );
}

/// The routes a router file declares: `.route("PATH", get(..).post(..))` → `GET PATH`, ...
fn declared_routes(src: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = src;
    while let Some(i) = rest.find(".route(") {
        rest = &rest[i + ".route(".len()..];
        let Some(q0) = rest.find('"') else { break };
        let Some(q1) = rest[q0 + 1..].find('"') else {
            break;
        };
        let path = &rest[q0 + 1..q0 + 1 + q1];
        // The arguments up to the matching parenthesis.
        let (mut depth, mut end) = (1, rest.len());
        for (j, c) in rest.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        end = j;
                        break;
                    }
                }
                _ => {}
            }
        }
        let args = &rest[q0 + 1 + q1..end];
        for m in ["get", "post", "put", "delete", "patch"] {
            let called = args.match_indices(&format!("{m}(")).any(|(k, _)| {
                k == 0 || !args[..k].ends_with(|c: char| c.is_alphanumeric() || c == '_')
            });
            if called {
                out.insert(format!("{} {path}", m.to_uppercase()));
            }
        }
        rest = &rest[end..];
    }
    out
}

#[test]
fn every_node_check_code_and_step_reason_is_documented_and_exists() {
    let checks = read("docs/reference/checks.md");
    same(
        "node check codes (docs/reference/checks.md, Node check codes)",
        crate::checks::Code::ALL
            .iter()
            .map(|c| c.as_str().to_string())
            .collect(),
        rows(section(&checks, "## Node check codes")),
    );
    same(
        "step reasons (docs/reference/checks.md, Step reason codes)",
        crate::step::Reason::ALL
            .iter()
            .map(|r| r.as_str().to_string())
            .collect(),
        rows(section(&checks, "### Step reason codes")),
    );
}

#[test]
fn every_exit_status_is_documented_and_exists() {
    let code: BTreeSet<String> = crate::exit::ExitCode::ALL
        .iter()
        .map(|c| c.code().to_string())
        .collect();
    same(
        "exit statuses (docs/reference/cli.md)",
        code.clone(),
        rows(section(&read("docs/reference/cli.md"), "## Exit codes")),
    );
    same(
        "exit statuses (README.md)",
        code,
        rows(section(&read("README.md"), "## Exit codes")),
    );
}

#[test]
fn every_metric_family_is_documented_and_exists() {
    let metrics = read("docs/reference/metrics.md");
    let agent = crate::metrics::Metrics::new();
    same(
        "the agent's metric families (docs/reference/metrics.md, Agent)",
        agent.families().iter().cloned().collect(),
        rows(section(&metrics, "## Agent")),
    );
    let cfg = crate::config::Config::parse(
        "targets:\n  - {name: gw, address: 192.0.2.1, port: 80, probe: tcp}\n",
    )
    .unwrap();
    let w = crate::witness::Witness::new(
        cfg,
        crate::witness::WitnessOptions {
            probe_interval: std::time::Duration::from_millis(100),
            burst_interval: std::time::Duration::from_millis(10),
            token: crate::serving::Token::fixed(None),
        },
        None,
    )
    .unwrap();
    same(
        "the witness's metric families (docs/reference/metrics.md, Witness)",
        w.metric_families().iter().cloned().collect(),
        rows(section(&metrics, "## Witness")),
    );
}

#[test]
fn every_http_route_is_documented_and_exists() {
    let api = read("docs/reference/api.md");
    let admin = declared_routes(&read("agent/src/serving/mod.rs"));
    assert_eq!(admin.len(), 3, "the admin routes: {admin:?}");
    for (who, file, heading) in [
        (
            "the agent",
            "agent/src/daemon/api/mod.rs",
            "## Agent (`:9969`)",
        ),
        (
            "the witness",
            "agent/src/witness/api.rs",
            "## Witness (`:9970`)",
        ),
    ] {
        let mut code = declared_routes(&read(file));
        code.extend(admin.iter().cloned());
        same(
            &format!("{who}'s routes (docs/reference/api.md)"),
            code,
            route_headings(section(&api, heading)),
        );
    }
}

#[test]
fn the_route_scan_reads_methods_and_paths() {
    let src = r#".route("/a", get(x).post(y))
        .route("/b/{id}", axum::routing::delete(z))
        .route("/c", get(move |s| async move { s.forget() }))"#;
    assert_eq!(
        declared_routes(src),
        ["DELETE /b/{id}", "GET /a", "GET /c", "POST /a"]
            .map(String::from)
            .into()
    );
}

/// Every relative link (`](path)`) in the Markdown files the project ships resolves.
#[test]
fn every_relative_link_in_the_docs_resolves() {
    let mut files = vec![PathBuf::from("README.md")];
    for f in [
        "CONTRIBUTING.md",
        "TESTING.md",
        "CHANGELOG.md",
        "deploy/README.md",
    ] {
        if root().join(f).exists() {
            files.push(f.into());
        }
    }
    let mut dirs = vec![PathBuf::from("docs")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(root().join(&d)).unwrap().flatten() {
            let p = d.join(e.file_name());
            if e.path().is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "md") {
                files.push(p);
            }
        }
    }
    let mut broken = Vec::new();
    for f in &files {
        let text = read(f.to_str().unwrap());
        for (i, _) in text.match_indices("](") {
            let target = &text[i + 2..];
            let Some(end) = target.find(')') else {
                continue;
            };
            let target = target[..end].split('#').next().unwrap_or("").trim();
            if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let resolved = root().join(f).parent().unwrap().join(target);
            if !resolved.exists() {
                broken.push(format!("{}: {target}", f.display()));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "links that resolve to nothing:\n{}",
        broken.join("\n")
    );
}
