use super::extract::{resolve, written};
use super::source::RootNames;
use super::*;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

const LAYERS: Layers = &[
    ("base", &["base"]),
    ("low", &["low", "peer"]),
    ("high", &["high"]),
];

const TEST: Crate = Crate {
    name: "test",
    dir: "src",
    ident: "stepguard",
    layers: LAYERS,
    units: &[],
    externs: CRATE_MODULES,
};

/// A fresh source tree holding `files`.
fn plant(files: &[(&str, &str)]) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "stepguard-layers-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    for (path, text) in files {
        let p = dir.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    dir
}

/// The problems `krate`'s table finds in a planted tree.
fn planted_in(krate: &Crate, files: &[(&str, &str)]) -> Vec<String> {
    let dir = plant(files);
    let tree = Tree::read(&dir, krate.externs).unwrap();
    let im = imports(krate, &tree);
    let mut p = judge(krate.layers, krate.units, &im);
    p.extend(placement(krate, &tree));
    std::fs::remove_dir_all(&dir).unwrap();
    p
}

fn impure(src: &std::path::Path, rules: &[(&str, &[&str])]) -> anyhow::Result<Vec<String>> {
    Ok(super::extract::impure_in(&Tree::read(src, &[])?, rules))
}

fn planted(files: &[(&str, &str)]) -> Vec<String> {
    planted_in(&TEST, files)
}

/// Every reference the file at `module` makes to a module of its crate (a tree with no
/// `lib.rs`: a name after `crate::` is a module): (line, target, the path as written).
fn references(module: &[String], src: &str) -> Vec<(usize, String, String)> {
    let file = syn::parse_file(src).unwrap();
    let root = RootNames::default();
    written(&file, module.to_vec())
        .iter()
        .filter_map(|w| {
            let (to, k) = resolve(w, &root, CRATE_MODULES, "", false, false)?;
            Some((w.lines[k], to, w.segs[..=k].join("::")))
        })
        .collect()
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

/// What the text search missed: a `use` group's leaves, a macro's tokens, a method's name.
#[test]
fn a_pure_module_naming_the_clock_in_a_group_or_a_macro_fails() {
    let dir = plant(&[(
        "step/mod.rs",
        "use std::{fs, net::TcpStream};\n\
         fn f() { tokio::select! { _ = g() => {} } }\n\
         fn h() { let _ = format!(\"{}\", Instant::now().elapsed()); }\n\
         fn k(c: &C) -> f64 { c.unix_now() }\n\
         #[test]\nfn t() { std::fs::read(\"y\"); }\n",
    )]);
    let p = impure(
        &dir,
        &[(
            "step",
            &[
                "std::fs",
                "std::net::Tcp",
                "tokio",
                "Instant::now",
                "unix_now",
            ],
        )],
    )
    .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let lines: Vec<&str> = p.iter().map(|l| l.split(": `").next().unwrap()).collect();
    assert_eq!(
        lines,
        [
            "step/mod.rs:1",
            "step/mod.rs:1",
            "step/mod.rs:2",
            "step/mod.rs:3",
            "step/mod.rs:4"
        ],
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
         #[cfg(test)]\nmod tests {\n    use crate::high::Helper;\n    fn t() { super::super::high::x(); }\n}\n\
         #[test]\nfn t() { crate::high::x(); }\n\
         struct S;\nimpl S {\n    #[cfg(test)]\n    fn helper() { crate::high::x(); }\n}\n\
         #[cfg(all(test, feature = \"x\"))]\nuse crate::high::Y;\n",
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

/// A test module's own modules are test code too, in files or inline.
#[test]
fn a_test_module_s_children_are_test_code() {
    let p = planted(&[
        ("low/mod.rs", "#[cfg(test)]\nmod tests;\n"),
        ("low/tests/mod.rs", "mod fixtures;\n"),
        ("low/tests/fixtures.rs", "use crate::high::Helper;\n"),
        ("base.rs", "#[cfg(test)]\nmod t {\n    mod deep;\n}\n"),
        ("base/t/deep.rs", "use crate::high::Helper;\n"),
        ("high.rs", ""),
    ]);
    assert!(p.is_empty(), "{p:?}");
}

#[test]
fn an_external_crate_standing_for_a_layer_counts() {
    let refs = references(&["duration".into()], "use stepguard_kernel::sock;\n");
    assert_eq!(
        refs,
        vec![(1, "kernel".into(), "stepguard_kernel::sock".into())]
    );
}

/// `use` renames, globs, nested groups and `self`; macro bodies; paths in types, patterns,
/// bounds and impl headers; an inline module's `super`.
#[test]
fn every_form_of_path_is_read() {
    let src = "use crate::{a::{self as x, b::*}, c as d};\n\
               use self::super::e;\n\
               fn f<T: crate::g::Bound>(v: crate::h::Ty) -> super::i::Out {\n\
                   match v { crate::j::Pat(_) => {} }\n\
                   tokio::select! { _ = crate::k::wait() => {} }\n\
                   let _ = format!(\"{}\", super::super::l::now());\n\
                   stepguard_kernel::sock::open();\n\
               }\n\
               impl crate::m::Trait for crate::n::Type {}\n\
               mod inner { use super::super::o::P; }\n\
               pub(crate) fn q() {}\n\
               pub(super) fn r() {}\n";
    let refs = references(&["p".into(), "deep".into()], src);
    let got: Vec<(usize, &str, &str)> = refs
        .iter()
        .filter(|(_, to, _)| to != "p")
        .map(|(l, t, p)| (*l, t.as_str(), p.as_str()))
        .collect();
    assert_eq!(
        got,
        [
            (1, "a", "crate::a"),
            (1, "a", "crate::a"),
            (1, "c", "crate::c"),
            (3, "g", "crate::g"),
            (3, "h", "crate::h"),
            (4, "j", "crate::j"),
            (5, "k", "crate::k"),
            (6, "l", "super::super::l"),
            (7, "kernel", "stepguard_kernel::sock"),
            (9, "m", "crate::m"),
            (9, "n", "crate::n"),
        ],
        "{refs:?}"
    );
    // `self::super::e` and `super::i` from p/deep stay in p; `super::super::o` from the inline
    // module p::deep::inner does too.
    assert!(refs
        .iter()
        .any(|(l, t, p)| *l == 2 && t == "p" && p == "self::super"));
    assert!(refs
        .iter()
        .any(|(l, t, p)| *l == 10 && t == "p" && p == "super::super"));
}

/// Item 4: a file two levels down is judged by its top-level module.
#[test]
fn a_sub_module_two_levels_deep_reaching_up_fails() {
    let p = planted_in(
        &AGENT,
        &[
            ("probe/mod.rs", "pub mod engine;\n"),
            (
                "probe/engine/mod.rs",
                "mod scheduler;\nuse super::kind::Kind;\nuse crate::timeline::Vantage;\n",
            ),
            (
                "probe/engine/scheduler.rs",
                "use super::*;\nuse crate::kernel::sock;\n\
                 fn run() {\n    tokio::select! {\n        _ = crate::daemon::Daemon::tick() => {}\n    }\n}\n",
            ),
            (
                "probe/engine/echo.rs",
                "use crate::{config::Config, daemon::Daemon};\n",
            ),
        ],
    );
    assert_eq!(p.len(), 3, "{p:?}");
    assert!(
        p[0].contains("upward import: probe/engine/echo.rs:1 `crate::daemon` — probe (layer 6"),
        "{p:?}"
    );
    assert!(
        p[1].contains("probe/engine/mod.rs:3 `crate::timeline` — probe (layer 6"),
        "{p:?}"
    );
    assert!(
        p[2].contains("probe/engine/scheduler.rs:5 `crate::daemon` — probe"),
        "{p:?}"
    );
}

/// A kernel module using one above it in the kernel's table fails; a module using the
/// crate root's helpers (`super::boottime`, `super::super::io_reason`) passes.
#[test]
fn a_kernel_module_reaching_up_fails() {
    let files = [
        (
            "lib.rs",
            "pub mod bpf;\npub mod bpffs;\npub mod btf;\npub mod clock;\npub mod counters;\n\
             pub mod drops;\npub mod links;\npub mod neigh;\npub mod sock;\n\
             pub fn boottime() -> f64 { 0.0 }\npub fn io_reason() {}\n",
        ),
        ("clock.rs", "fn b() -> f64 { super::boottime() }\n"),
        ("bpf/mod.rs", "use crate::clock;\n"),
        ("links/mod.rs", "mod programs;\nuse super::bpf;\n"),
        (
            "links/programs.rs",
            "use super::*;\nfn e() { super::super::io_reason(); }\n",
        ),
    ];
    let p = planted_in(&KERNEL, &files);
    assert!(p.is_empty(), "{p:?}");
    let mut up = files;
    up[2].1 = "use crate::clock;\nfn f() { crate::links::dump(); }\n";
    let p = planted_in(&KERNEL, &up);
    assert_eq!(p.len(), 2, "{p:?}");
    assert!(
        p[0].contains("upward import: bpf/mod.rs:2 `crate::links` — bpf (layer 3"),
        "{p:?}"
    );
    // links uses bpf: the planted import closes a circle too.
    assert!(p[1].starts_with("import circle over bpf, links"), "{p:?}");
}

const LAB_LIB: &str = "pub mod kube;\npub mod lan;\npub mod real;\npub mod sim;\npub mod sys;\n\
    pub use sim::{Lab, RestartOpts};\npub use sys::now_ns;\n";

/// A lab of rooms: a file is judged as its room (`sim/restart.rs` is `sim`); the root's
/// re-exports stand for their room; its programs reach it as `stepguard_lab::`.
fn lab_rooms() -> [(&'static str, &'static str); 7] {
    [
        ("lib.rs", LAB_LIB),
        ("sys/mod.rs", "pub mod netns;\npub fn now_ns() -> u128 { 0 }\n"),
        ("sys/netns.rs", "pub fn enter() {}\n"),
        (
            "sim/mod.rs",
            "mod restart;\npub use restart::*;\nuse crate::sys::netns;\npub struct Lab;\n",
        ),
        (
            "sim/restart.rs",
            "use super::*;\npub struct RestartOpts;\nfn f() { netns::enter(); super::super::sys::now_ns(); }\n",
        ),
        (
            "lan/mod.rs",
            "use crate::sim::{Lab, RestartOpts};\nfn t() -> u128 { crate::now_ns() }\n",
        ),
        (
            "bin/stepguard-lab/main.rs",
            "mod cli;\nuse stepguard_lab::{lan, RestartOpts};\nfn main() { stepguard_lab::sys::netns::enter(); cli::run(); }\n",
        ),
    ]
}

/// The lab's rooms pass as they point down; a planted import from a lower room to a higher
/// one fails.
#[test]
fn a_lab_module_reaching_up_fails() {
    let files = lab_rooms();
    let p = planted_in(&LAB, &files);
    assert!(p.is_empty(), "{p:?}");
    let mut up = files;
    up[2].1 = "pub fn enter() {}\nfn t() -> crate::Lab { crate::sim::Lab }\n";
    let p = planted_in(&LAB, &up);
    assert_eq!(p.len(), 3, "{p:?}");
    assert!(
        p[0].contains("upward import: sys/netns.rs:2 `crate::Lab` — sys (layer 1"),
        "{p:?}"
    );
    assert!(
        p[1].contains("upward import: sys/netns.rs:2 `crate::sim` — sys (layer 1"),
        "{p:?}"
    );
    // sim uses sys: the planted import closes a circle too.
    assert!(p[2].starts_with("import circle over sim, sys"), "{p:?}");
}

/// The lab's imports as the check reads them: through a room's own paths, the root's
/// re-exports and the program's `stepguard_lab::`; within a room nothing is an import.
#[test]
fn the_lab_root_s_names_resolve() {
    let dir = plant(&lab_rooms());
    let tree = Tree::read(&dir, LAB.externs).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let got: Vec<String> = imports(&LAB, &tree)
        .iter()
        .map(|i| format!("{}:{} {} -> {} `{}`", i.file, i.line, i.from, i.to, i.path))
        .collect();
    assert_eq!(
        got,
        [
            "bin/stepguard-lab/main.rs:2 bin -> lan `stepguard_lab::lan`",
            "bin/stepguard-lab/main.rs:2 bin -> sim `stepguard_lab::RestartOpts`",
            "bin/stepguard-lab/main.rs:3 bin -> sys `stepguard_lab::sys`",
            "lan/mod.rs:1 lan -> sim `crate::sim`",
            "lan/mod.rs:2 lan -> sys `crate::now_ns`",
            "sim/mod.rs:3 sim -> sys `crate::sys`",
            "sim/restart.rs:3 sim -> sys `super::super::sys`",
        ],
    );
}

/// Two rooms naming each other form a circle, whatever their layers.
#[test]
fn a_circle_between_lab_rooms_fails() {
    let p = planted_in(
        &LAB,
        &[
            ("lib.rs", LAB_LIB),
            ("kube/mod.rs", "use crate::real::Pod;\n"),
            ("real/mod.rs", "use crate::kube::Kube;\n"),
            ("bin/stepguard-lab/main.rs", "fn main() {}\n"),
        ],
    );
    assert_eq!(p.len(), 2, "{p:?}");
    assert!(
        p[0].contains("upward import: kube/mod.rs:1 `crate::real` — kube (layer 2"),
        "{p:?}"
    );
    assert!(p[1].starts_with("import circle over kube, real"), "{p:?}");
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
