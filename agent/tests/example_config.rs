//! The documented example config parses, so documentation and code cannot drift apart.
#[test]
fn the_example_config_in_deploy_parses() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/stepguard.example.yaml"
    );
    let cfg = stepguard::probe::load(std::path::Path::new(path)).unwrap();
    assert_eq!(cfg.targets.len(), 4);
    assert_eq!(
        cfg.targets
            .iter()
            .filter(|t| t.east_west)
            .map(|t| t.name.as_str())
            .collect::<Vec<_>>(),
        ["health-node2"]
    );
    assert_eq!(cfg.dns.resolvers.len(), 1);
}

/// The witness's example config parses too, and has only what a witness reads.
#[test]
fn the_example_witness_config_parses() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/witness/witness.example.yaml"
    );
    let cfg = stepguard::probe::load(std::path::Path::new(path)).unwrap();
    assert_eq!(cfg.targets.len(), 4);
    assert!(cfg.dns.resolvers.is_empty());
}

/// The shipped witness unit sets a token up (and never runs unauthenticated).
#[test]
fn the_witness_unit_file_runs_with_a_token() {
    let unit = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/witness/stepguard-witness.service"
    ))
    .unwrap();
    let exec: Vec<&str> = unit
        .lines()
        .filter(|l| l.starts_with("ExecStart="))
        .collect();
    assert_eq!(exec.len(), 1, "{exec:?}");
    assert!(exec[0].contains("--token-file"), "{exec:?}");
    assert!(
        !unit.contains("--allow-unauthenticated\n") && !exec[0].contains("--allow-unauthenticated")
    );
    assert!(
        unit.contains("LoadCredential=token:"),
        "the token reaches the dynamic user"
    );
}
