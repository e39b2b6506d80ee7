use super::*;
use crate::checks::CheckResult;

#[test]
fn only_failing_or_regressed_node_checks_block_a_step() {
    let now = [
        CheckResult::unknown("config", "no_cilium_config", "", serde_json::json!({})),
        CheckResult::unknown("maps", "no_permission", "", serde_json::json!({})),
        CheckResult::fail("devices", "device_missing", "", serde_json::json!({})),
        CheckResult::pass("vips", "ok", "", serde_json::json!({})),
    ];
    let baseline: BTreeMap<String, String> = [
        ("config", "unknown"),
        ("maps", "pass"),
        ("devices", "pass"),
        ("vips", "pass"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let b = blocking_node_checks(&now, &baseline);
    assert_eq!(b.len(), 2, "{b:?}");
    assert!(b[0].starts_with("maps unknown") && b[1].starts_with("devices fail"));
}
