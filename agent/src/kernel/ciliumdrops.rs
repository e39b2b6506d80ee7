//! Cilium's own drop counters from the pinned per-CPU `cilium_metrics` map (opened read-only):
//! key `struct metrics_key {u8 reason; u8 dir; u16 line; u8 file; u8 reserved[3]}`, value
//! `struct metrics_value {u64 count; u64 bytes}` per CPU. Summed per drop reason.
use super::bpf;
use std::collections::BTreeMap;
use std::path::Path;

/// Cilium's name for a drop reason (pkg/monitor/api/drop.go), for the ones that matter most.
pub fn reason_name(code: u8) -> String {
    let name = match code {
        130 => "invalid_source_mac",
        131 => "invalid_destination_mac",
        132 => "invalid_source_ip",
        133 => "policy_denied",
        134 => "invalid_packet",
        135 => "ct_truncated_or_invalid_header",
        136 => "ct_missing_tcp_ack_flag",
        137 => "ct_unknown_l4_protocol",
        139 => "unsupported_l3_protocol",
        140 => "missed_tail_call",
        141 => "error_writing_to_packet",
        142 => "unknown_l4_protocol",
        143 => "unknown_icmpv4_code",
        144 => "unknown_icmpv4_type",
        149 => "ct_map_insertion_failed",
        150 => "reached_edt_rate_limiting_drop_horizon",
        151 => "unknown_connection_tracking_state",
        153 => "fib_lookup_failed",
        158 => "no_tunnel_or_encapsulation_endpoint",
        160 => "no_mapping_for_nat_masquerade",
        161 => "unsupported_protocol_for_nat_masquerade",
        162 => "fib_lookup_failed",
        164 => "service_backend_not_found",
        181 => "policy_denied_by_denylist",
        189 => "policy_deny",
        202 => "host_datapath_not_ready",
        203 => "endpoint_policy_program_not_available",
        _ => "",
    };
    if name.is_empty() {
        format!("{code}")
    } else {
        format!("{code}_{name}")
    }
}

/// True for drop reasons (0 is "forwarded"; Cilium's drops are 2 and ≥ 130).
fn is_drop(code: u8) -> bool {
    code == 2 || code >= 130
}

/// `cilium_metrics` could not be read (the drops signal is unknown).
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: unexpected layout {key}x{value} (want 8x16)")]
    Layout { path: String, key: u32, value: u32 },
}

/// Drops per reason label (`202_host_datapath_not_ready`), summed over CPUs, direction, line.
pub fn read(bpffs: &Path) -> Result<BTreeMap<String, u64>, ReadError> {
    let path = bpffs.join("tc/globals/cilium_metrics");
    let io = |what: &'static str| {
        let path = path.display().to_string();
        move |source| ReadError::Io { what, path, source }
    };
    let fd = bpf::obj_get_rdonly(&path).map_err(io("open"))?;
    let info = bpf::map_info(&fd).map_err(io("map info"))?;
    if info.key_size != 8 || info.value_size != 16 {
        return Err(ReadError::Layout {
            path: path.display().to_string(),
            key: info.key_size,
            value: info.value_size,
        });
    }
    let ncpu = bpf::possible_cpus().map_err(io("count the possible CPUs for"))?;
    let keys = bpf::keys(&fd, 8, 4096).map_err(io("walk"))?;
    let mut out = BTreeMap::new();
    let mut value = vec![0u8; 16 * ncpu];
    for k in keys {
        if !is_drop(k[0]) {
            continue;
        }
        if !bpf::lookup(&fd, &k, &mut value).map_err(io("read"))? {
            continue;
        }
        let count: u64 = value
            .chunks(16)
            .map(|c| u64::from_ne_bytes(c[..8].try_into().unwrap_or([0; 8])))
            .sum();
        *out.entry(reason_name(k[0])).or_insert(0) += count;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn possible_cpus_are_parsed_never_guessed() {
        use crate::kernel::bpf::parse_possible;
        assert_eq!(parse_possible("0-1\n"), Some(2));
        assert_eq!(parse_possible("0"), Some(1));
        assert_eq!(parse_possible("0-3,8-11"), Some(8));
        assert_eq!(parse_possible(""), None);
        assert_eq!(parse_possible("3-1"), None);
        assert!(crate::kernel::bpf::possible_cpus().unwrap() >= 1);
    }

    #[test]
    fn reasons_are_named_with_their_code() {
        assert_eq!(super::reason_name(202), "202_host_datapath_not_ready");
        assert_eq!(super::reason_name(250), "250");
        assert!(super::is_drop(133) && !super::is_drop(0));
    }
}
