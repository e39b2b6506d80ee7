//! The documented example config parses, so documentation and code cannot drift apart.
#[test]
fn the_example_config_in_deploy_parses() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/stepguard.example.yaml"
    );
    let cfg = stepguard::config::Config::load(std::path::Path::new(path)).unwrap();
    assert_eq!(cfg.targets.len(), 3);
    assert_eq!(cfg.dns.resolvers.len(), 1);
}

/// The witness's example config parses too, and has only what a witness reads.
#[test]
fn the_example_witness_config_parses() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/witness/witness.example.yaml"
    );
    let cfg = stepguard::config::Config::load(std::path::Path::new(path)).unwrap();
    assert_eq!(cfg.targets.len(), 4);
    assert!(cfg.dns.resolvers.is_empty());
}
