//! The agent's own eBPF counts kernel drops per reason: N packets to a closed port raise
//! `stepguard_kernel_drops_total{reason="NO_SOCKET"}` by at least N; N packets into the lab's
//! blackhole raise the TC drop reason by at least N, and the lab's `cilium_metrics` shows them
//! under Cilium's reason 202.
mod common;
use common::*;
use std::net::UdpSocket;
use std::time::Duration;
use stepguard_lab::RestartOpts;

#[test]
fn packets_to_a_closed_port_raise_no_socket_drops_by_at_least_n() {
    // The agent in a lab's node namespace: its tracepoint counts drops host-wide, so those of
    // the host's loopback below.
    let lab = lab(|_| {});
    let agent = AgentProc::start(&lab, &[]);
    let before = agent.kernel_drops("NO_SOCKET");
    // A port nobody listens on: bind one, learn its number, close it.
    let closed = UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    let n = 200;
    for _ in 0..n {
        let _ = sock.send_to(b"stepguard", closed);
    }
    // The counters are per-CPU map values read on scrape: poll until they show the drops.
    let after = poll_until(|| agent.kernel_drops("NO_SOCKET"), |v| v - before >= n);
    assert!(
        after - before >= n,
        "NO_SOCKET drops went from {before} to {after}, expected +{n}"
    );
}

/// Reads `read` until `done` holds or 10 s pass; returns the last value (the caller asserts).
fn poll_until(read: impl Fn() -> u64, done: impl Fn(u64) -> bool) -> u64 {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let v = read();
        if done(v) || std::time::Instant::now() > deadline {
            return v;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sum of Cilium's per-CPU drop counters for reason 202 in the lab's `cilium_metrics`.
fn cilium_drops_202(lab: &stepguard_lab::Lab) -> u64 {
    let pin = lab.state.bpffs.join("tc/globals/cilium_metrics");
    let dump = bpftool_json(&["map", "dump", "pinned", &pin.to_string_lossy()]);
    dump.as_array()
        .unwrap()
        .iter()
        .filter(|e| e["key"][0].as_str() == Some("0xca")) // struct metrics_key.reason = 202
        .flat_map(|e| e["values"].as_array().unwrap().iter())
        .map(|v| {
            let b: Vec<u8> = v["value"].as_array().unwrap()[..8]
                .iter()
                .map(|x| {
                    u8::from_str_radix(x.as_str().unwrap().trim_start_matches("0x"), 16).unwrap()
                })
                .collect();
            u64::from_le_bytes(b.try_into().unwrap())
        })
        .sum()
}

fn blackholed_packets_are_counted(attach: stepguard_lab::AttachMode) {
    let mut lab = lab(|s| s.attach = attach);
    let agent = AgentProc::start(&lab, &[]);
    let tc_before = agent.kernel_drops("TC_INGRESS");
    let c202_before = cilium_drops_202(&lab);
    let n = 100u64;
    let fabric = lab.fabric_ns();
    let bpffs = lab.state.bpffs.clone();
    // From the fabric into the node: each packet hits cil_from_netdev on eth0 while blackholed.
    // (Had the blackhole not dropped them, they would show up as NO_SOCKET instead.)
    let sender = std::thread::spawn(move || {
        wait_for_blackhole(&bpffs);
        stepguard_lab::sys::netns::in_netns(&fabric, move || {
            let s = UdpSocket::bind("192.0.2.254:0")?;
            for _ in 0..n {
                s.send_to(b"into the blackhole", "192.0.2.1:5353")?;
            }
            Ok(crate::now_ns())
        })
        .unwrap()
    });
    let r = lab
        .restart(&RestartOpts {
            down: Duration::from_millis(2000),
            blackhole: true,
            ..Default::default()
        })
        .unwrap();
    let last_sent = sender.join().unwrap();
    assert!(
        last_sent < r.blackhole_end_ns,
        "all packets were sent inside the blackhole window"
    );
    let tc_after = poll_until(|| agent.kernel_drops("TC_INGRESS"), |v| v - tc_before >= n);
    assert!(
        tc_after - tc_before >= n,
        "TC_INGRESS drops went from {tc_before} to {tc_after}, expected +{n}"
    );
    let c202_after = poll_until(|| cilium_drops_202(&lab), |v| v - c202_before >= n);
    assert!(
        c202_after - c202_before >= n,
        "cilium_metrics reason 202 went from {c202_before} to {c202_after}, expected +{n}"
    );
}

#[test]
fn blackholed_packets_raise_tc_ingress_drops_and_cilium_reason_202_tcx() {
    blackholed_packets_are_counted(stepguard_lab::AttachMode::Tcx);
}

#[test]
fn blackholed_packets_raise_tc_ingress_drops_and_cilium_reason_202_tc() {
    blackholed_packets_are_counted(stepguard_lab::AttachMode::Tc);
}

#[test]
fn drops_are_unknown_not_zero_when_the_agent_lacks_capabilities() {
    require_root();
    let stepguard = bin("STEPGUARD_BIN", "stepguard");
    // Root uid, but without CAP_BPF, CAP_PERFMON and CAP_SYS_ADMIN.
    let out = std::process::Command::new("capsh")
        .args(["--drop=cap_bpf,cap_perfmon,cap_sys_admin", "--"])
        .arg("-c")
        .arg(format!("{} drops --seconds 0", stepguard.display()))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(2), "exit 2 (unknown): {stdout}");
    assert!(stdout.contains("kernel drops: unknown ("), "{stdout}");
}
