use super::*;

fn lines(s: &str) -> Vec<String> {
    s.lines().map(str::to_string).collect()
}

#[test]
fn output_is_read_per_target() {
    let out = lines(
        "   Compiling x v0.1.0\n\
         \x20    Running unittests src/lib.rs (target/debug/deps/stepguard-1)\n\
         running 3 tests\n\
         test a ... ok\n\
         test b ... ignored, needs cilium-agent 1.19: cargo xtask test --real-extended\n\
         test c ... ok\n\
         test result: ok. 2 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.01s\n\
         \x20    Running tests/deploy.rs (target/debug/deps/deploy-2)\n\
         running 3 tests\n\
         test result: FAILED. 2 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out\n\
         \x20  Doc-tests stepguard\n\
         test result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out\n",
    );
    let r = parse_output(&out);
    assert_eq!(r.len(), 3);
    assert_eq!(r[0].0, "src/lib.rs");
    assert_eq!(
        r[0].1,
        Outcome {
            passed: 2,
            failed: 0,
            ignored: 1,
            ignored_for_flag: 1,
            ok: true,
            secs: 0.01,
        }
    );
    assert_eq!(r[1].0, "tests/deploy.rs");
    assert!(!r[1].1.ok && r[1].1.failed == 1 && r[1].1.passed == 2);
    assert_eq!(r[2].0, "doc:stepguard");
}

fn target(pkg: &str, kind: Kind, src: &str) -> Target {
    Target {
        package: pkg.into(),
        kind,
        name: src
            .trim_start_matches("tests/")
            .trim_end_matches(".rs")
            .into(),
        src: src.into(),
        privileged: false,
    }
}

/// An ignored test must name the flag that runs it; a target whose every test waits for
/// that flag is accounted for, one with an unexplained ignore is not.
#[test]
fn an_ignored_test_must_name_the_flag_that_runs_it() {
    let out = lines(
        "     Running tests/real_upgrade.rs (target/debug/deps/real_upgrade-1)\n\
         test up ... ignored, needs cilium-agent 1.19: cargo xtask test --real-extended\n\
         test result: ok. 0 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out\n\
         \x20    Running tests/other.rs (target/debug/deps/other-2)\n\
         test quiet ... ignored\n\
         test fine ... ok\n\
         test result: ok. 1 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out\n",
    );
    let mut l = Ledger::new([
        target("a", Kind::Integration, "tests/real_upgrade.rs"),
        target("a", Kind::Integration, "tests/other.rs"),
    ]);
    l.record("a", &parse_output(&out));
    let p = l.problems();
    assert_eq!(p.len(), 1, "{p:?}");
    assert!(
        p[0].contains("tests/other.rs") && p[0].contains("does not name"),
        "{p:?}"
    );
    assert!(l.table().contains("1 ignored (they run with"));
}

#[test]
fn a_target_without_a_result_or_without_tests_is_a_problem() {
    let mut l = Ledger::new([
        target("a", Kind::Unit, "src/lib.rs"),
        target("a", Kind::Integration, "tests/one.rs"),
        target("a", Kind::Integration, "tests/two.rs"),
        target("b", Kind::Integration, "tests/one.rs"),
    ]);
    let ok = |n| Outcome {
        passed: n,
        ok: true,
        ..Default::default()
    };
    l.record(
        "a",
        &[
            ("src/lib.rs".into(), ok(0)),
            ("tests/one.rs".into(), ok(3)),
            ("tests/two.rs".into(), ok(0)),
        ],
    );
    let p = l.problems();
    assert_eq!(p.len(), 2, "{p:?}");
    assert!(p[0].contains("a: tests/two.rs") && p[0].contains("ran no test"));
    assert!(p[1].contains("b: tests/one.rs") && p[1].contains("did not run"));
    assert!(l.table().contains("NOT RUN"));
}

/// The table shows each target's seconds, every stage, and the slowest targets first.
#[test]
fn the_table_shows_seconds_per_target_and_stage_and_the_slowest() {
    let out = lines(
        "     Running tests/fast.rs (target/debug/deps/fast-1)\n\
         test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 2.50s\n\
         \x20    Running tests/slow.rs (target/debug/deps/slow-2)\n\
         test result: ok. 3 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 748.77s\n",
    );
    let mut l = Ledger::new([
        target("a", Kind::Integration, "tests/fast.rs"),
        target("a", Kind::Integration, "tests/slow.rs"),
    ]);
    l.record("a", &parse_output(&out));
    l.stages.push(("the workspace's build".into(), 61.0));
    let t = l.table();
    assert!(t.contains("  748.8s  3 passed"), "{t}");
    assert!(
        t.contains("the workspace's build") && t.contains("61.0s"),
        "{t}"
    );
    let slowest = t.split("== the slowest ten targets\n").nth(1).unwrap();
    let first = slowest.lines().next().unwrap();
    assert!(first.contains("tests/slow.rs"), "{t}");
}

/// The real workspace: every `tests/*.rs` on disk is a discovered target, and a test file
/// cargo would not run (a package with autotests off) is refused.
#[test]
fn discovery_finds_every_test_file_and_refuses_one_it_would_not_run() {
    let root = crate::root();
    let pkgs = discover(&root).expect("discover the workspace");
    let lab = pkgs.iter().find(|p| p.name == "stepguard-lab").unwrap();
    assert!(lab
        .targets
        .iter()
        .any(|t| t.src == "tests/steps.rs" && t.privileged));
    let agent = pkgs.iter().find(|p| p.name == "stepguard").unwrap();
    assert!(agent
        .targets
        .iter()
        .any(|t| t.src == "tests/deploy.rs" && !t.privileged));

    let dir = std::env::temp_dir().join(format!("xtask-discover-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("p/src")).unwrap();
    std::fs::create_dir_all(dir.join("p/tests")).unwrap();
    std::fs::write(
        dir.join("Cargo.toml"),
        "[workspace]\nmembers = [\"p\"]\nresolver = \"2\"\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("p/Cargo.toml"),
        "[package]\nname = \"p\"\nversion = \"0.1.0\"\nedition = \"2021\"\nautotests = false\n",
    )
    .unwrap();
    std::fs::write(dir.join("p/src/lib.rs"), "").unwrap();
    std::fs::write(dir.join("p/tests/hidden.rs"), "#[test] fn t() {}\n").unwrap();
    let e = discover(&dir).unwrap_err().to_string();
    assert!(e.contains("p/tests/hidden.rs is not a test target"), "{e}");
    // With autotests on, the same file is a target.
    std::fs::write(
        dir.join("p/Cargo.toml"),
        "[package]\nname = \"p\"\nversion = \"0.1.0\"\nedition = \"2021\"\n",
    )
    .unwrap();
    let pkgs = discover(&dir).unwrap();
    assert!(pkgs[0]
        .targets
        .iter()
        .any(|t| t.kind == Kind::Integration && t.src == "tests/hidden.rs"));
    // A crate outside the workspace is refused too.
    std::fs::create_dir_all(dir.join("stray/src")).unwrap();
    std::fs::write(
        dir.join("stray/Cargo.toml"),
        "[package]\nname = \"stray\"\nversion = \"0.1.0\"\nedition = \"2021\"\n",
    )
    .unwrap();
    let e = discover(&dir).unwrap_err().to_string();
    assert!(e.contains("outside the workspace"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A target run in parts reports once per part: the ledger keeps the sum, and a failure in
/// either part fails the target.
#[test]
fn the_parts_of_a_target_add_up() {
    let mut l = Ledger::new([target("a", Kind::Integration, "tests/rollout/main.rs")]);
    let part = |passed, failed| {
        vec![(
            "tests/rollout/main.rs".to_string(),
            Outcome {
                passed,
                failed,
                ok: failed == 0,
                secs: 10.0,
                ..Default::default()
            },
        )]
    };
    l.record("a", &part(9, 0));
    l.record("a", &part(13, 0));
    assert!(l.problems().is_empty(), "{:?}", l.problems());
    assert!(l.table().contains("22 passed"), "{}", l.table());
    l.record("a", &part(0, 1));
    let p = l.problems();
    assert_eq!(p.len(), 1, "{p:?}");
    assert!(p[0].contains("1 failed"), "{p:?}");
}
