//! `restart` (with the blackhole fault) drops traffic for the recorded window and swaps program
//! IDs; without it no traffic breaks; each fault
//! variant does exactly what it claims. The test probes on its own (TCP connects to the gateway
//! VIP from the node namespace) and compares with the recorded, not the requested, window.
mod common;
use common::*;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};
use stepguard_lab::{AttachMode, Lab, RestartOpts, RestartReport};

/// Every program attached before the restart is attached afterwards with a new id (the
/// report lists them in the order they were swapped, the endpoints last).
fn assert_every_program_replaced(r: &RestartReport) {
    assert_eq!(r.old_programs.len(), r.new_programs.len());
    for o in &r.old_programs {
        let n = r
            .new_programs
            .iter()
            .find(|n| n.device == o.device && n.program == o.program && n.hook == o.hook)
            .unwrap_or_else(|| panic!("{} on {} is still attached", o.program, o.device));
        assert_ne!(
            o.prog_id, n.prog_id,
            "{} on {} was replaced",
            o.program, o.device
        );
    }
}

/// Probes the gateway VIP every ~2 ms while `restart` runs; returns (report, probes).
fn restart_while_probing(lab: &mut Lab, opts: RestartOpts) -> (RestartReport, Vec<(u128, bool)>) {
    let ns = lab.node_ns();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = stop.clone();
    // The prober starts counting from here (tests run one at a time).
    let prober = std::thread::spawn(move || {
        stepguard_lab::sys::netns::in_netns(&ns, move || {
            let vip: SocketAddr = "198.51.100.10:80".parse().unwrap();
            let mut probes = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(30);
            while !stop2.load(std::sync::atomic::Ordering::SeqCst) && Instant::now() < deadline {
                let sent = now_ns();
                let ok = TcpStream::connect_timeout(&vip, Duration::from_millis(5)).is_ok();
                probes.push((sent, ok));
                if ok {
                    OKS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Ok(probes)
        })
        .unwrap()
    });
    // Wait for the prober to have succeeded a few times (its first probes may still be
    // setting up), restart, then wait for a few successes after the blackhole.
    let seen = |lab_ok: &std::sync::atomic::AtomicUsize, n: usize| {
        let deadline = Instant::now() + Duration::from_secs(20);
        while lab_ok.load(std::sync::atomic::Ordering::SeqCst) < n {
            assert!(
                Instant::now() < deadline,
                "the prober never got {n} answers"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    let base = OKS.load(std::sync::atomic::Ordering::SeqCst);
    seen(&OKS, base + 5);
    let report = lab.restart(&opts).expect("restart");
    let after = OKS.load(std::sync::atomic::Ordering::SeqCst);
    seen(&OKS, after + 5);
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    (report, prober.join().unwrap())
}

/// Successful probes so far (the prober runs in its own thread).
static OKS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The outage the probes saw: (first failed send, next successful send) and the error bounds
/// of each edge: the probe intervals that bracket them.
fn observed_outage(probes: &[(u128, bool)]) -> ((u128, u128), (u128, u128)) {
    let first_fail = probes
        .iter()
        .position(|p| !p.1)
        .expect("probes saw an outage");
    assert!(first_fail > 0, "a successful probe before the outage");
    let recovered = first_fail
        + probes[first_fail..]
            .iter()
            .position(|p| p.1)
            .expect("probes saw the recovery");
    assert!(
        probes[..first_fail].iter().all(|p| p.1),
        "no failures before the blackhole"
    );
    let start_bound = probes[first_fail].0 - probes[first_fail - 1].0;
    let end_bound = probes[recovered].0 - probes[recovered - 1].0;
    (
        (probes[first_fail].0, probes[recovered].0),
        (start_bound, end_bound),
    )
}

fn gap_is_measured_within_the_probe_interval(attach: AttachMode) {
    let mut lab = lab(|s| s.attach = attach);
    let (r, probes) = restart_while_probing(
        &mut lab,
        RestartOpts {
            down: Duration::from_millis(500),
            blackhole: true,
            ..Default::default()
        },
    );
    let ((down, up), (start_bound, end_bound)) = observed_outage(&probes);
    let (start, on, off, end) = (
        r.blackhole_start_ns as i128,
        r.blackhole_on_ns as i128,
        r.blackhole_off_ns as i128,
        r.blackhole_end_ns as i128,
    );
    let (down, up) = (down as i128, up as i128);
    let (sb, eb) = (start_bound as i128, end_bound as i128);
    assert!(
        off - on >= 500_000_000,
        "blackhole lasted at least the requested gap"
    );
    // The probes' own bracketing intervals are the error bound; the lab's window is
    // [before set, after set] and [before lift, after lift].
    assert!(
        down >= start - sb && down <= on + sb,
        "outage began {} ms off the recorded start (bound {} ms)",
        (down - start) / 1_000_000,
        sb / 1_000_000
    );
    assert!(
        up >= off - eb && up <= end + eb,
        "outage ended {} ms off the recorded end (bound {} ms)",
        (up - end) / 1_000_000,
        eb / 1_000_000
    );
    // New program IDs everywhere, and the kernel agrees.
    assert_every_program_replaced(&r);
    let eth0 = r
        .new_programs
        .iter()
        .find(|a| a.device == "eth0" && a.program == "cil_from_netdev")
        .unwrap();
    match attach {
        AttachMode::Tc => {
            let f = sh(
                "tc",
                &[
                    "-n",
                    &lab.node_ns(),
                    "filter",
                    "show",
                    "dev",
                    "eth0",
                    "ingress",
                ],
            );
            assert!(
                f.contains(&format!(
                    "handle 0x1 cil_from_netdev-eth0 direct-action not_in_hw id {} ",
                    eth0.prog_id
                )),
                "{f}"
            );
        }
        AttachMode::Tcx => {
            let pin = eth0.link_pin.as_ref().unwrap();
            let link = bpftool_json(&["link", "show", "pinned", &pin.to_string_lossy()]);
            assert_eq!(link["prog_id"].as_u64(), Some(eth0.prog_id as u64));
        }
    }
}

#[test]
fn a_500ms_restart_blackholes_the_vip_for_the_recorded_window_tcx() {
    gap_is_measured_within_the_probe_interval(AttachMode::Tcx);
}

#[test]
fn a_500ms_restart_blackholes_the_vip_for_the_recorded_window_tc() {
    gap_is_measured_within_the_probe_interval(AttachMode::Tc);
}

#[test]
fn no_reload_keeps_every_program_id() {
    let mut lab = lab(|_| {});
    let r = lab
        .restart(&RestartOpts {
            down: Duration::from_millis(50),
            blackhole: true,
            no_reload: true,
            ..Default::default()
        })
        .unwrap();
    assert!(!r.reloaded);
    for (o, n) in r.old_programs.iter().zip(&r.new_programs) {
        assert_eq!(o.prog_id, n.prog_id);
        let pin = o.link_pin.as_ref().unwrap();
        assert_eq!(
            bpftool_json(&["link", "show", "pinned", &pin.to_string_lossy()])["prog_id"].as_u64(),
            Some(o.prog_id as u64)
        );
    }
    assert_eq!(
        http_status_from_node(&lab, "http://198.51.100.10/healthz"),
        "200",
        "traffic flows again after the blackhole"
    );
}

fn drop_device_detaches_only_that_device(attach: AttachMode) {
    let mut lab = lab(|s| s.attach = attach);
    let r = lab
        .restart(&RestartOpts {
            down: Duration::from_millis(50),
            blackhole: true,
            drop_device: Some("eth1".into()),
            ..Default::default()
        })
        .unwrap();
    assert!(r.new_programs.iter().all(|a| a.device != "eth1"));
    assert!(r.new_programs.iter().any(|a| a.device == "eth0"));
    let ns = lab.node_ns();
    match attach {
        AttachMode::Tc => {
            for dir in ["ingress", "egress"] {
                let f1 = sh("tc", &["-n", &ns, "filter", "show", "dev", "eth1", dir]);
                assert!(!f1.contains("cil_"), "eth1 {dir} has no program:\n{f1}");
                let f0 = sh("tc", &["-n", &ns, "filter", "show", "dev", "eth0", dir]);
                assert!(f0.contains("cil_"), "eth0 {dir} keeps its program:\n{f0}");
            }
        }
        AttachMode::Tcx => {
            assert!(!lab
                .state
                .bpffs
                .join("cilium/devices/eth1/links/cil_from_netdev")
                .exists());
            let old_eth1: Vec<u32> = r
                .old_programs
                .iter()
                .filter(|a| a.device == "eth1")
                .map(|a| a.prog_id)
                .collect();
            // The detached programs are gone from the kernel altogether.
            let progs = bpftool_json(&["prog", "show"]);
            assert!(progs
                .as_array()
                .unwrap()
                .iter()
                .all(|p| !old_eth1.contains(&(p["id"].as_u64().unwrap() as u32))));
        }
    }
}

#[test]
fn drop_device_eth1_leaves_eth1_without_the_datapath_tcx() {
    drop_device_detaches_only_that_device(AttachMode::Tcx);
}

#[test]
fn drop_device_eth1_leaves_eth1_without_the_datapath_tc() {
    drop_device_detaches_only_that_device(AttachMode::Tc);
}

#[test]
fn lose_map_removes_exactly_that_pin_and_flush_map_empties_exactly_that_map() {
    let mut lab = lab(|_| {});
    let globals = lab.state.bpffs.join("tc/globals");
    let count = |m: &str| {
        bpftool_json(&["map", "dump", "pinned", &globals.join(m).to_string_lossy()])
            .as_array()
            .unwrap()
            .len()
    };
    let before: Vec<String> = std::fs::read_dir(&globals)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let ct_before = count("cilium_ct4_global");
    assert!(ct_before > 0);
    assert!(count("cilium_ipcache_v2") > 0);

    lab.restart(&RestartOpts {
        down: Duration::from_millis(20),
        blackhole: true,
        lose_map: Some("cilium_lb4_services_v2".into()),
        ..Default::default()
    })
    .unwrap();
    let after: Vec<String> = std::fs::read_dir(&globals)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let gone: Vec<&String> = before.iter().filter(|m| !after.contains(m)).collect();
    assert_eq!(gone, vec!["cilium_lb4_services_v2"]);

    // Like Cilium, every restart recreates ipcache: a new map (new id), refilled.
    let id = |m: &str| {
        bpftool_json(&["map", "show", "pinned", &globals.join(m).to_string_lossy()])["id"]
            .as_u64()
            .unwrap()
    };
    let (ipc_id, ipc_n) = (id("cilium_ipcache_v2"), count("cilium_ipcache_v2"));
    lab.restart(&RestartOpts {
        down: Duration::from_millis(20),
        blackhole: true,
        flush_map: Some("cilium_lxc".into()),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(count("cilium_lxc"), 0, "flushed map is empty");
    assert_ne!(id("cilium_ipcache_v2"), ipc_id, "ipcache recreated");
    assert_eq!(count("cilium_ipcache_v2"), ipc_n, "and refilled");
    assert_eq!(
        count("cilium_ct4_global"),
        ct_before,
        "other maps keep their entries"
    );

    let err = lab
        .restart(&RestartOpts {
            lose_map: Some("cilium_nope".into()),
            ..Default::default()
        })
        .unwrap_err();
    assert!(
        err.to_string().contains("no pinned map cilium_nope"),
        "{err}"
    );
}

/// The lab's restart without a fault is Cilium's: while the agent is down the pinned links
/// and maps stay and the old programs keep forwarding, so traffic that does not depend on the
/// agent sees no outage; afterwards every program has a new id and ipcache a new map id.
fn a_restart_without_a_fault_breaks_no_traffic(attach: AttachMode) {
    let mut lab = lab(|s| s.attach = attach);
    let ipcache = lab.state.bpffs.join("tc/globals/cilium_ipcache_v2");
    let id_before = bpftool_json(&["map", "show", "pinned", &ipcache.to_string_lossy()])["id"]
        .as_u64()
        .unwrap();
    let (r, probes) = restart_while_probing(
        &mut lab,
        RestartOpts {
            down: Duration::from_millis(300),
            refill_after: Duration::from_millis(100),
            ..Default::default()
        },
    );
    assert!(!r.blackhole);
    let during = probes
        .iter()
        .filter(|p| p.0 >= r.blackhole_start_ns && p.0 <= r.blackhole_end_ns)
        .count();
    assert!(during >= 10, "probes while the agent was down: {during}");
    let failed: Vec<_> = probes.iter().filter(|p| !p.1).collect();
    assert!(
        failed.is_empty(),
        "{} probes failed: {failed:?}",
        failed.len()
    );
    assert_every_program_replaced(&r);
    let after = bpftool_json(&["map", "show", "pinned", &ipcache.to_string_lossy()]);
    assert_ne!(
        after["id"].as_u64().unwrap(),
        id_before,
        "ipcache recreated"
    );
    let dump = bpftool_json(&["map", "dump", "pinned", &ipcache.to_string_lossy()]);
    assert!(
        dump.as_array().is_some_and(|a| !a.is_empty()),
        "ipcache refilled: {dump}"
    );
}

#[test]
fn a_restart_without_a_fault_breaks_no_traffic_tcx() {
    a_restart_without_a_fault_breaks_no_traffic(AttachMode::Tcx);
}

#[test]
fn a_restart_without_a_fault_breaks_no_traffic_tc() {
    a_restart_without_a_fault_breaks_no_traffic(AttachMode::Tc);
}

/// The lab's restart follows Cilium's order (docs/cilium-fidelity.md, "Restart order"):
/// ipcache is recreated before the API serves — seen from outside: when the agent's socket
/// appears, the pinned ipcache already has a new id —, the host programs are replaced after
/// that, and the endpoints get new programs after the host's; every program has a new id.
#[test]
fn the_restart_recreates_ipcache_before_the_api_serves_then_the_host_then_the_endpoints() {
    let mut lab = lab(|s| s.pods = 60);
    let ipcache = lab.state.bpffs.join("tc/globals/cilium_ipcache_v2");
    let map_id = |p: &std::path::Path| {
        stepguard_lab::sys::bpf::obj_get(p)
            .and_then(|fd| stepguard_lab::sys::bpf::obj_id(&fd))
            .ok()
    };
    let before = map_id(&ipcache).expect("ipcache pinned");
    let sock = lab.agent_socket();
    let ipc = ipcache.clone();
    let watcher = std::thread::spawn(move || {
        // The socket goes at the stop; the first sight of it again is the API serving.
        let deadline = Instant::now() + Duration::from_secs(60);
        while sock.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(200));
        }
        while !sock.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(200));
        }
        map_id(&ipc)
    });
    let old = lab.state.attachments.clone();
    let r = lab
        .restart(&RestartOpts {
            down: Duration::from_millis(300),
            regenerate_every: Duration::from_millis(50),
            ..Default::default()
        })
        .unwrap();
    let at_api = watcher
        .join()
        .unwrap()
        .expect("ipcache pinned when the API served");
    assert_ne!(
        at_api, before,
        "ipcache was recreated before the API served"
    );
    let p = &r.phases;
    assert!(
        r.blackhole_start_ns < p.ipcache_recreated_ns
            && p.ipcache_recreated_ns < p.api_serving_ns
            && p.api_serving_ns < p.host_replaced_ns
            && p.host_replaced_ns < p.endpoints_regenerated_ns,
        "{p:?}"
    );
    // Two batches of 50 with a pause between: the endpoints came well after the host.
    assert!(
        p.endpoints_regenerated_ns - p.host_replaced_ns > 50_000_000,
        "{p:?}"
    );
    let endpoints = r
        .new_programs
        .iter()
        .filter(|a| a.endpoint.is_some())
        .count();
    assert_eq!(endpoints, 60, "every endpoint has its program");
    for a in &r.new_programs {
        let o = old
            .iter()
            .find(|o| o.device == a.device && o.program == a.program)
            .unwrap_or_else(|| panic!("{} {} was not there before", a.device, a.program));
        assert_ne!(
            o.prog_id, a.prog_id,
            "{} {} got a new program",
            a.device, a.program
        );
    }
}
