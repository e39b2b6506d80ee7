//! L2 announcements by the **real cilium-agents** of two nodes: a
//! `CiliumL2AnnouncementPolicy`, the agents' leases in the real API server, a LoadBalancer
//! VIP answered by the holder's BPF ARP responder (`stepguard_lab::real::cluster`). A
//! witness in the LAN client namespace measures the VIP as a LAN client sees it; the lab's
//! ground truth is what it observes, never decides: the lease's holder, each node's pinned
//! responder entry, and the client's neighbour table (rtnetlink), each change time-stamped.
//!
//! One cluster, three cases in turn (each case's measured behaviour is in
//! `docs/cilium-fidelity.md`, "L2 announcements on two real agents"):
//! 1. **the holder crash-restarts** (SIGKILL, started again at once): its lease is still its
//!    own, so it leads again; its responder's full reconciliation at start deletes the VIP's
//!    entry first. The lab makes the LAN client forget its entry the moment the entry is gone:
//!    the VIP is silent for the client until the holder re-adds it with a gratuitous ARP. The
//!    witness's gap, in a step on the holder's stepguard agent, is within its reported bound
//!    of that truth; the node's own probes see nothing and the step passes;
//! 2. **the holder restarts gracefully** (SIGTERM): it withdraws its responder entry and
//!    releases the lease at once; the other node takes it at its next jittered retry and moves
//!    the client with a gratuitous ARP — or the restarted agent, whose announcer runs ~1.4 s
//!    after its start, takes it back first (both were measured). Either way the witness, in a
//!    step on the holder, sees no outage: the old holder's datapath forwards it meanwhile;
//! 3. **the holder crashes and drops off the LAN** (SIGKILL, its cable pulled): nothing is
//!    released; the lease expires, the other node takes it and moves the client: the witness's
//!    outage around the move matches the truth (the cable pulled → the client's entry on the
//!    new holder's MAC) within its cadence.
//!
//! It runs with `cargo xtask test --real-extended` (two real agents; beyond CI's budget,
//! TESTING.md); a plain `cargo xtask test` lists it as ignored.
mod common;
use common::real::*;
use common::witness::*;
use common::*;
use serde_json::Value;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use stepguard_lab::real::cluster::{
    fmt_mac, RealCluster, Timeline, LAN_CLIENT, LAN_SERVICE, WITNESS_PORT,
};

const CADENCE_S: f64 = 0.1;

fn witness(c: &RealCluster) -> Witness {
    let addr = format!("{LAN_CLIENT}:{WITNESS_PORT}");
    Witness::start_in(
        &c.client_ns(),
        &c.witness_config(),
        &addr,
        1,
        &["--probe-interval", "100ms"],
    )
}

/// stepguard's agent on node `i`, with the node's config and the witness.
fn stepguard_on(c: &RealCluster, i: u8, w: &Witness) -> AgentProc {
    real_agent_with(
        &c.nodes[usize::from(i)],
        &format!("witnesses: [\"{}\"]\n", w.url),
    )
}

/// The witness's gap row for the VIP in a step's verdict.
fn witness_gap<'a>(v: &'a Value, w: &Witness) -> &'a Value {
    let gaps = v["witnesses"][&w.url]["report"]["gaps"]
        .as_array()
        .unwrap_or_else(|| panic!("no witness report: {v:#}"));
    gaps.iter()
        .find(|g| g["target"] == LAN_SERVICE)
        .unwrap_or_else(|| panic!("no gap for {LAN_SERVICE}: {gaps:?}"))
}

/// Waits (bounded) until `cond` holds, polling every 50 ms.
fn wait_for(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    t0.elapsed()
}

/// The witness's moves of the VIP after `after` (seconds since the epoch).
fn moves_after(w: &Witness, after: f64) -> Vec<Value> {
    let m = w.get("/v1/moves");
    m["moves"]
        .as_array()
        .unwrap_or_else(|| panic!("no moves from the witness: {m}"))
        .iter()
        .filter(|m| m["target"] == LAN_SERVICE && m["at"].as_f64().unwrap_or(0.0) > after)
        .cloned()
        .collect()
}

fn secs(ns: u128) -> f64 {
    ns as f64 / 1e9
}

fn show(what: &str, t: &Timeline, t0: u128) {
    eprintln!(
        "--- {what} (the lab's observations, from the fault) ---\n{}",
        t.render(t0)
    );
}

#[test]
#[ignore = "two real cilium-agents: run with `cargo xtask test --real-extended`"]
fn two_real_agents_move_the_vip_and_the_witness_measures_it() {
    let mut c = real_cluster(2, "real_l2");
    let w = witness(&c);
    let h = c.holder().unwrap().expect("a holder");
    let o = 1 - h;
    let (mac_h, mac_o) = (c.node_mac(h).unwrap(), c.node_mac(o).unwrap());
    eprintln!(
        "holder node {h} ({}), other node {o} ({})",
        fmt_mac(mac_h),
        fmt_mac(mac_o)
    );

    // 1. The holder crash-restarts: the responder's flush at start, the lease kept.
    let sg = stepguard_on(&c, h, &w);
    // The client's entry must be older than the kernel's locktime (1 s) for a GARP to
    // replace it (see witness.rs, `restart_lan`).
    std::thread::sleep(Duration::from_millis(1100));
    let id = sg.begin_probing(&format!(
        r#"{{"settle":"2s","timeout":"120s","max_gap":"30s","witnesses":["{}"]}}"#,
        w.url
    ));
    let watch = c.watch().unwrap();
    let t_kill = now_ns();
    {
        let n = &mut c.nodes[usize::from(h)];
        n.stop_agent(libc::SIGKILL, Duration::from_secs(5)).unwrap();
        n.start_agent().unwrap();
    }
    let t_started = now_ns();
    let gone = c.wait_responder_gone(h, Duration::from_secs(60)).unwrap();
    let forgot = c.forget_client_entry().unwrap();
    let ready = c.nodes[usize::from(h)]
        .wait_ready(Duration::from_secs(180))
        .unwrap();
    wait_for("the holder's entry back", Duration::from_secs(30), || {
        c.responder_has(h).unwrap_or(false)
    });
    let v = sg.verdict(&id);
    let _ = std::fs::write(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../target/real-cilium/real_l2-step1.json"),
        serde_json::to_vec_pretty(&v).unwrap(),
    );
    std::thread::sleep(Duration::from_millis(500));
    let t = watch.stop().unwrap();
    show("1. holder crash-restart", &t, t_kill);
    eprintln!(
        "agent ready {:.1}s after start (API {:.1}s); entry gone {:.3}s after start",
        ready.ready.as_secs_f64(),
        ready.api.as_secs_f64(),
        secs(gone) - secs(t_started)
    );
    assert_eq!(
        t.holder_became(Some(o), t_kill),
        None,
        "the lease stayed with node {h}"
    );
    let readded = t
        .responder_changed(h, true, gone)
        .expect("the holder re-added its entry");
    let resolved = t
        .client_on(mac_h, forgot.1)
        .unwrap_or_else(|| panic!("the client resolved the VIP to node {h}: {:?}", t.neigh));
    eprintln!(
        "re-added {:.3}s after the flush; the client resolved {:.3}s after it forgot",
        secs(readded) - secs(gone),
        secs(resolved) - secs(forgot.1)
    );
    // The reconciler sends the gratuitous ARP, then creates the entry (`l2responder.go`
    // `cycle`: `garpOnNewEntry` before `arMap.Create`): the client may resolve first.
    assert!(
        resolved > gone && resolved < readded + 100_000_000,
        "the client resolved the VIP with the re-added entry's gratuitous ARP"
    );
    let g = witness_gap(&v, &w);
    assert_within_reported_bound(
        g,
        forgot,
        (resolved - 2_000_000, resolved),
        "1. the holder's flush at start",
    );
    assert_eq!(v["verdict"]["status"], "passed", "{:#}", v["verdict"]);
    for g in v["gaps"].as_array().unwrap() {
        assert_eq!(g["count"], 0, "the node's own probes see nothing: {g}");
    }

    // 2. The holder restarts gracefully: it withdraws its entry and releases the lease; the
    // other node takes it at its next jittered retry — or the restarted agent, whose
    // announcer runs ~1.4 s after its start, takes it back first (both measured). Either way
    // the witness, which had resolved the VIP, sees no outage: the old holder forwards it
    // until a gratuitous ARP says otherwise.
    std::thread::sleep(Duration::from_millis(1100));
    let id = sg.begin_probing(&format!(
        r#"{{"settle":"2s","timeout":"120s","max_gap":"30s","witnesses":["{}"]}}"#,
        w.url
    ));
    let watch = c.watch().unwrap();
    let t_term = now_ns();
    let exited = c.nodes[usize::from(h)]
        .stop_agent(libc::SIGTERM, Duration::from_secs(10))
        .unwrap();
    c.nodes[usize::from(h)].start_agent().unwrap();
    c.nodes[usize::from(h)]
        .wait_ready(Duration::from_secs(180))
        .unwrap();
    wait_for(
        "a holder answering for the VIP again",
        Duration::from_secs(30),
        || {
            c.holder()
                .ok()
                .flatten()
                .is_some_and(|x| c.responder_has(x).unwrap_or(false))
        },
    );
    let v = sg.verdict(&id);
    std::thread::sleep(Duration::from_millis(500));
    let t = watch.stop().unwrap();
    show("2. holder graceful restart", &t, t_term);
    let now = c.holder().unwrap().expect("a holder");
    let taken = t
        .holder_became(Some(now), t_term)
        .expect("the lease taken after its release");
    let withdrawn = t
        .responder_changed(h, false, t_term)
        .expect("the old holder's entry withdrawn");
    let released = t.holder_became(None, t_term).expect("the lease released");
    eprintln!(
        "exited in {:.2}s; entry withdrawn {:.3}s, lease released {:.3}s and taken by node {now} {:.3}s after SIGTERM",
        exited.as_secs_f64(),
        secs(withdrawn) - secs(t_term),
        secs(released) - secs(t_term),
        secs(taken) - secs(t_term)
    );
    // Measured: the stopping agent withdrew its entry at once, then released the lease; the
    // taker came after (docs/cilium-fidelity.md; the LAN lab imitates it since).
    assert!(
        secs(withdrawn) - secs(t_term) < 1.0 && withdrawn < taken && released < taken,
        "withdrawn, released, then taken"
    );
    let m = moves_after(&w, secs(t_term));
    eprintln!("witness moves: {m:?}");
    if now == o {
        let moved = t
            .client_on(mac_o, t_term)
            .unwrap_or_else(|| panic!("the client moved to node {o}: {:?}", t.neigh));
        let mv = m
            .iter()
            .find(|m| m["to"] == fmt_mac(mac_o))
            .unwrap_or_else(|| panic!("the witness saw the move to node {o}: {m:?}"));
        let at = mv["at"].as_f64().unwrap();
        assert!(
            at >= secs(moved) - 0.01 && at <= secs(moved) + CADENCE_S + 0.05,
            "the witness saw the move at {:.3}s, the client's kernel at {:.3}s",
            at - secs(t_term),
            secs(moved) - secs(t_term)
        );
        assert!(mv["gap_s"].is_null(), "no outage around the move: {mv}");
    } else {
        // Taken back: the restarted holder re-added its entry with a gratuitous ARP of its
        // own MAC; the client never moved.
        assert!(
            t.responder_changed(h, true, withdrawn).is_some(),
            "the restarted holder re-added its entry"
        );
        assert!(
            m.iter().all(|m| m["to"] != fmt_mac(mac_o)),
            "no move to node {o}: {m:?}"
        );
    }
    let g = witness_gap(&v, &w);
    assert_eq!(g["count"], 0, "no outage for a resolved client: {g}");
    assert_eq!(v["verdict"]["status"], "passed", "{:#}", v["verdict"]);
    drop(sg);
    let (h, o) = (now, 1 - now);
    let mac_o = c.node_mac(o).unwrap();

    // 3. The holder crashes and drops off the LAN: the lease expires first.
    std::thread::sleep(Duration::from_millis(1100));
    let watch = c.watch().unwrap();
    let t_crash = now_ns();
    c.nodes[usize::from(h)]
        .stop_agent(libc::SIGKILL, Duration::from_secs(5))
        .unwrap();
    let cut = c.unplug(h).unwrap();
    wait_for(
        "the survivor holding the lease",
        Duration::from_secs(40),
        || c.holder().ok().flatten() == Some(o) && c.responder_has(o).unwrap_or(false),
    );
    wait_for(
        "the VIP answering the client again",
        Duration::from_secs(10),
        || c.client_get_ok().unwrap_or(false),
    );
    std::thread::sleep(Duration::from_millis(1000));
    let t = watch.stop().unwrap();
    show("3. holder crash off the LAN", &t, t_crash);
    let taken = t
        .holder_became(Some(o), t_crash)
        .expect("the survivor took it");
    let moved = t
        .client_on(mac_o, cut.1)
        .unwrap_or_else(|| panic!("the client moved to node {o}: {:?}", t.neigh));
    eprintln!(
        "taken {:.3}s and the client moved {:.3}s after the crash",
        secs(taken) - secs(t_crash),
        secs(moved) - secs(t_crash)
    );
    let lease = c.state.spec.lease;
    assert!(
        secs(taken) - secs(t_crash) >= lease.duration.as_secs_f64() - lease.renew.as_secs_f64(),
        "nothing was released: the lease expired first"
    );
    let m = moves_after(&w, secs(t_crash));
    eprintln!("witness moves: {m:?}");
    let mv = m
        .iter()
        .find(|m| m["to"] == fmt_mac(mac_o))
        .unwrap_or_else(|| panic!("the witness saw the move to node {o}: {m:?}"));
    let g = serde_json::json!({
        "longest_s": mv["gap_s"], "error_bound_s": mv["error_bound_s"],
    });
    assert!(!mv["gap_s"].is_null(), "an outage around the move: {mv}");
    // The bound the witness gives, plus its cadence: the probe that first finds the VIP
    // silent may be sent up to one interval after the cable was pulled.
    let start = mv["outage_start"].as_f64().unwrap();
    assert!(
        start >= secs(cut.0) - 0.01 && start <= secs(cut.1) + CADENCE_S + 0.01,
        "the outage began {:.3}s after the cable was pulled: {mv}",
        start - secs(cut.0)
    );
    assert_within_reported_bound(
        &g,
        cut,
        (moved - 2_000_000, moved),
        "3. the holder crashed off the LAN",
    );
    // The crashed node back: on the LAN, its agent started, ready.
    c.plug(h).unwrap();
    c.nodes[usize::from(h)].start_agent().unwrap();
    c.nodes[usize::from(h)]
        .wait_ready(Duration::from_secs(180))
        .unwrap();
    assert!(
        c.client_get_ok().unwrap(),
        "the VIP answers after all three"
    );
}
