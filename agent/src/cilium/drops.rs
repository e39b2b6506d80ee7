//! Cilium's drop reasons, and where its drop counters are: the pinned per-CPU
//! `cilium_metrics` map, key `struct metrics_key {u8 reason; u8 dir; u16 line; u8 file; u8
//! reserved[3]}`, value `struct metrics_value {u64 count; u64 bytes}` per CPU.
use std::collections::BTreeMap;

/// Where a node's counters are pinned, under its bpffs.
pub const METRICS_MAP: &str = "tc/globals/cilium_metrics";

/// `cilium_metrics`'s key and (per-CPU) value sizes, in bytes; the count is the value's first
/// `u64`, the reason the key's first byte.
pub const METRICS_LAYOUT: (u32, u32) = (8, 16);

/// Cilium's drop reasons (codes 130–207) with their names: Cilium's own descriptions from
/// `pkg/monitor/api/drop.go` (`errors` table), snake-cased; 159 has no description there and
/// takes its C name (`DROP_UNSUPP_SERVICE_PROTO`). Read at the 1.16–1.19 release tags and on
/// main (docs/cilium-fidelity.md: 204 from 1.16.2, 205 from 1.18, 206 never released, 207 on
/// main only). Code 2 is Go's `DropInvalid`.
pub const DROP_REASONS: [(u8, &str); 78] = [
    (130, "invalid_source_mac"),
    (131, "invalid_destination_mac"),
    (132, "invalid_source_ip"),
    (133, "policy_denied"),
    (134, "invalid_packet"),
    (135, "ct_truncated_or_invalid_header"),
    (136, "fragmentation_needed"),
    (137, "ct_unknown_l4_protocol"),
    (138, "ct_can_t_create_entry_from_packet"),
    (139, "unsupported_l3_protocol"),
    (140, "missed_tail_call"),
    (141, "error_writing_to_packet"),
    (142, "unknown_l4_protocol"),
    (143, "unknown_icmpv4_code"),
    (144, "unknown_icmpv4_type"),
    (145, "unknown_icmpv6_code"),
    (146, "unknown_icmpv6_type"),
    (147, "error_retrieving_tunnel_key"),
    (148, "error_retrieving_tunnel_options"),
    (149, "invalid_geneve_option"),
    (150, "unknown_l3_target_address"),
    (151, "stale_or_unroutable_ip"),
    (152, "no_matching_local_container_found"),
    (153, "error_while_correcting_l3_checksum"),
    (154, "error_while_correcting_l4_checksum"),
    (155, "ct_map_insertion_failed"),
    (156, "invalid_ipv6_extension_header"),
    (157, "ip_fragmentation_not_supported"),
    (158, "service_backend_not_found"),
    (159, "unsupported_service_protocol"),
    (160, "no_tunnel_encapsulation_endpoint_datapath_bug"),
    (161, "nat_46_64_not_enabled"),
    (162, "reached_edt_rate_limiting_drop_horizon"),
    (163, "unknown_connection_tracking_state"),
    (164, "local_host_is_unreachable"),
    (165, "no_configuration_available_to_perform_policy_decision"),
    (166, "unsupported_l2_protocol"),
    (167, "no_mapping_for_nat_masquerade"),
    (168, "unsupported_protocol_for_nat_masquerade"),
    (169, "fib_lookup_failed"),
    (170, "encapsulation_traffic_is_prohibited"),
    (171, "invalid_identity"),
    (172, "unknown_sender"),
    (173, "nat_not_needed"),
    (174, "is_a_clusterip"),
    (175, "first_logical_datagram_fragment_not_found"),
    (176, "forbidden_icmpv6_message"),
    (177, "denied_by_lb_src_range_check"),
    (178, "socket_lookup_failed"),
    (179, "socket_assign_failed"),
    (180, "proxy_redirection_not_supported_for_protocol"),
    (181, "policy_denied_by_denylist"),
    (182, "vlan_traffic_disallowed_by_vlan_filter"),
    (183, "incorrect_vni_from_vtep"),
    (184, "failed_to_update_or_lookup_tc_buffer"),
    (185, "no_sid_was_found_for_the_ip_address"),
    (186, "srv6_state_was_removed_during_tail_call"),
    (187, "l3_translation_from_ipv4_to_ipv6_failed_nat46"),
    (188, "l3_translation_from_ipv6_to_ipv4_failed_nat64"),
    (189, "authentication_required"),
    (190, "no_conntrack_map_found"),
    (191, "no_nat_map_found"),
    (192, "invalid_clusterid"),
    (193, "unsupported_packet_protocol_for_dsr_encapsulation"),
    (194, "no_egress_gateway_found"),
    (195, "traffic_is_unencrypted"),
    (196, "ttl_exceeded"),
    (197, "no_node_id_found"),
    (198, "rate_limited"),
    (199, "igmp_handled"),
    (200, "igmp_subscribed"),
    (201, "multicast_handled"),
    (202, "host_datapath_not_ready"),
    (203, "endpoint_policy_program_not_available"),
    (204, "no_egress_ip_configured"),
    (205, "punt_to_proxy"),
    (206, "no_device"),
    (207, "first_logical_datagram_fragment_not_found_from_world"),
];

/// Cilium's label for a drop reason: `<code>_<name>`, or the bare code when unknown.
pub fn reason_name(code: u8) -> String {
    let name = if code == 2 {
        Some("invalid_packet")
    } else {
        DROP_REASONS
            .iter()
            .find(|(c, _)| *c == code)
            .map(|(_, n)| *n)
    };
    match name {
        Some(n) => format!("{code}_{n}"),
        None => format!("{code}"),
    }
}

/// True for drop reasons (0 is "forwarded"; Cilium's drops are 2 and ≥ 130).
fn is_drop(code: u8) -> bool {
    code == 2 || code >= 130
}

/// Drops per reason label (`202_host_datapath_not_ready`) from counts per reason code (summed
/// over CPUs, directions and lines); codes that are not drops are left out.
pub fn by_reason(by_code: BTreeMap<u8, u64>) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for (code, n) in by_code.into_iter().filter(|(c, _)| is_drop(*c)) {
        *out.entry(reason_name(code)).or_insert(0) += n;
    }
    out
}

#[cfg(test)]
mod tests {
    /// Every code Cilium defines (130..=207) has its name, and the names that were wrong
    /// before (136, 150, 151, 153, 158, 160–164, 189) are Cilium's.
    #[test]
    fn every_cilium_drop_code_has_its_name() {
        for code in 130u8..=207 {
            let n = super::reason_name(code);
            assert!(n.len() > 4, "{code} has no name: {n}");
        }
        for (code, name) in [
            (136, "136_fragmentation_needed"),
            (150, "150_unknown_l3_target_address"),
            (151, "151_stale_or_unroutable_ip"),
            (153, "153_error_while_correcting_l3_checksum"),
            (158, "158_service_backend_not_found"),
            (160, "160_no_tunnel_encapsulation_endpoint_datapath_bug"),
            (161, "161_nat_46_64_not_enabled"),
            (162, "162_reached_edt_rate_limiting_drop_horizon"),
            (163, "163_unknown_connection_tracking_state"),
            (164, "164_local_host_is_unreachable"),
            (169, "169_fib_lookup_failed"),
            (189, "189_authentication_required"),
            (202, "202_host_datapath_not_ready"),
        ] {
            assert_eq!(super::reason_name(code), name);
        }
        let codes: Vec<u8> = super::DROP_REASONS.iter().map(|(c, _)| *c).collect();
        assert_eq!(
            codes,
            (130u8..=207).collect::<Vec<_>>(),
            "no gaps, no duplicates"
        );
    }

    #[test]
    fn counts_become_drops_per_reason() {
        let counts = std::collections::BTreeMap::from([(0, 9), (2, 1), (133, 4), (202, 5)]);
        let by = super::by_reason(counts);
        assert_eq!(
            by.into_iter().collect::<Vec<_>>(),
            [
                ("133_policy_denied".to_string(), 4),
                ("202_host_datapath_not_ready".to_string(), 5),
                ("2_invalid_packet".to_string(), 1),
            ]
        );
    }

    #[test]
    fn reasons_are_named_with_their_code() {
        assert_eq!(super::reason_name(202), "202_host_datapath_not_ready");
        assert_eq!(super::reason_name(250), "250");
        assert!(super::is_drop(133) && !super::is_drop(0));
    }
}
