use super::*;

fn device(ids: &[u32]) -> Device {
    Device {
        name: "eth0".into(),
        ifindex: 2,
        up: true,
        loopback: false,
        port: false,
        kind: None,
        has_controller: false,
        controller: None,
        alt_names: vec![],
        addresses: 0,
        global_addrs: vec![],
        default_route: false,
        global_route: false,
        programs: ids
            .iter()
            .map(|id| AttachedProgram {
                hook: "ingress",
                via: "tcx",
                prog_id: *id,
                name: None,
                filter: None,
                loaded_at: None,
                link_pin: None,
            })
            .collect(),
    }
}

fn info(id: u32) -> bpf::ProgInfo {
    bpf::ProgInfo {
        id,
        prog_type: 3,
        name: "cil_from_netdev".into(),
        load_time_boot_ns: 0,
    }
}

/// Program 10 was replaced between the tcx query and the info lookup (ENOENT), as during
/// every Cilium restart: a race to observe again, not a missing permission (before the
/// fix: `prog_details_unreadable`, the devices check `unknown`, a step begun then 503).
#[test]
fn a_program_replaced_between_query_and_lookup_is_a_race_not_a_permission_problem() {
    let mut obs = Observation::default();
    let mut d = device(&[10, 11]);
    let raced = fill_details(&mut d, &mut obs, |id| {
        if id == 10 {
            Err(std::io::Error::from_raw_os_error(libc::ENOENT))
        } else {
            Ok(info(id))
        }
    });
    assert!(raced);
    assert!(!obs.prog_details_unreadable && obs.problems.is_empty());
    assert_eq!(d.programs[1].name.as_deref(), Some("cil_from_netdev"));
    // A real permission problem stays one.
    let mut obs = Observation::default();
    let mut d = device(&[10]);
    let raced = fill_details(&mut d, &mut obs, |_| {
        Err(std::io::Error::from_raw_os_error(libc::EPERM))
    });
    assert!(!raced && obs.prog_details_unreadable);
    assert_eq!(obs.problems.len(), 1);
}
