//! `stepguard rollout` end to end (issues 13 and 23): a fake Kubernetes API server that plays
//! the DaemonSet controller's part as the real one does (a deleted pod Terminating for its
//! grace period, the replacement Pending and unbound, then bound, then Ready once the matching
//! node of a three-node LAN lab restarted); real stepguard agents on the lab nodes; the stepper
//! as a process in the LAN client namespace. Each test is one promise: the stepper never walks
//! past a node whose verdict it did not read as passed.
mod common;
use common::fakekube::{Bump, FakeKube, FakePod, Moment, World};
use common::*;
use serde_json::Value;
use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use stepguard_lab::lan::{LanGuard, LanLab, LanSpec, LeaseTimings};
use stepguard_lab::RestartOpts;

fn node_name(i: u8) -> String {
    format!("node-{i}")
}

struct Env {
    // Dropped in this order: the agents, then the API server, then the lab.
    _agents: Vec<Daemon>,
    kube: FakeKube,
    kubeconfig: std::path::PathBuf,
    client_ns: String,
    run_dir: std::path::PathBuf,
    _lan: Arc<Mutex<LanGuard>>,
    /// When set, the restart for this many-th deletion (1-based, over the world's life)
    /// empties the node's endpoint map.
    fault_at: Arc<Mutex<Option<usize>>>,
}

/// Cilium's L2 leases in the fake API, as the lab's holders are now.
fn sync_leases(w: &mut World, lan: &LanLab) {
    for (vip, holder) in &lan.state.holders {
        let name = format!("cilium-l2announce-default-{vip}");
        w.leases.insert(
            ("kube-system".into(), name.clone()),
            serde_json::json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": name, "namespace": "kube-system", "resourceVersion": "1"},
                "spec": {"holderIdentity": node_name(*holder), "leaseDurationSeconds": 2}}),
        );
    }
}

fn env() -> Env {
    require_root();
    let mut spec = LanSpec::new(stepguard_lab::unique_prefix());
    spec.nodes = 3;
    spec.lease = LeaseTimings {
        duration: Duration::from_secs(2),
        renew: Duration::from_secs(1),
        retry: Duration::from_millis(500),
    };
    let lan = LanGuard(LanLab::up(spec).expect("LAN lab up"));
    let mut agents = Vec::new();
    let mut world = World {
        revision: ("rev2".into(), 2),
        generation: 2,
        observed_generation: 2,
        image: "quay.io/cilium/cilium:v1.18.2@sha256:0123".into(),
        grace: Duration::from_millis(1000),
        create_after: Duration::from_millis(300),
        bind_after: Duration::from_millis(300),
        ..Default::default()
    };
    for i in 0..3u8 {
        let node = lan.node(i).unwrap();
        let addr = std::net::SocketAddr::new(stepguard_lab::lan::node_addr(i).into(), 9969);
        agents.push(Daemon::start_at(
            node.node_ns(),
            lan.node_config(i),
            lan.state.run_dir.join(format!("agent-state-n{i}")),
            addr,
            &[],
            &[],
        ));
        world.nodes.insert(node_name(i), true);
        world.pods.insert(
            format!("cilium-{i}"),
            FakePod::running(&format!("uid-{i}"), &node_name(i), "rev1"),
        );
        world
            .agents
            .insert(node_name(i), stepguard_lab::lan::node_addr(i).to_string());
    }
    sync_leases(&mut world, &lan);
    let client_ns = lan.client_ns();
    let run_dir = lan.state.run_dir.clone();
    let lan = Arc::new(Mutex::new(lan));
    let fault_at: Arc<Mutex<Option<usize>>> = Arc::new(Mutex::new(None));
    let world_cell: Arc<Mutex<Option<Arc<Mutex<World>>>>> = Arc::new(Mutex::new(None));
    let hook = {
        let (lan, fault_at, world_cell) = (lan.clone(), fault_at.clone(), world_cell.clone());
        Arc::new(move |node: &str| {
            let i: u8 = node.trim_start_matches("node-").parse().unwrap();
            let w = world_cell.lock().unwrap().clone().unwrap();
            let nth = w.lock().unwrap().deletions.len();
            let mut opts = RestartOpts {
                down: Duration::from_millis(300),
                ..Default::default()
            };
            if *fault_at.lock().unwrap() == Some(nth) {
                opts.flush_map = Some("cilium_lxc".into());
            }
            eprintln!(
                "the lab restarts {node} for deletion {nth}{}",
                if opts.flush_map.is_some() {
                    ", emptying cilium_lxc"
                } else {
                    ""
                }
            );
            let mut l = lan.lock().unwrap();
            l.restart(i, &opts, false).expect("lab restart");
            sync_leases(&mut w.lock().unwrap(), &l);
        })
    };
    let kube = FakeKube::start(
        &client_ns,
        &stepguard_lab::lan::CLIENT_ADDR.to_string(),
        world,
        hook,
    );
    *world_cell.lock().unwrap() = Some(kube.world.clone());
    let kubeconfig = kube.kubeconfig(&run_dir);
    Env {
        _lan: lan,
        _agents: agents,
        kube,
        kubeconfig,
        client_ns,
        run_dir,
        fault_at,
    }
}

/// The API server's hook holds the lab too, so the guard alone would never drop: take the
/// lab down when the test ends (also on a panic).
impl Drop for Env {
    fn drop(&mut self) {
        let mut lan = self._lan.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = lan.0.down() {
            eprintln!("LAN lab down: {e:#}");
        }
    }
}

fn rollout_cmd(e: &Env, extra: &[&str]) -> Command {
    let mut c = Command::new("nsenter");
    c.arg(format!("--net=/run/netns/{}", e.client_ns))
        .arg("--")
        .arg(bin("STEPGUARD_BIN", "stepguard"))
        .arg("rollout");
    // The test's pace, unless the case sets its own.
    for (flag, value) in [
        ("--lock-duration", "3s"),
        ("--settle", "1s"),
        ("--step-timeout", "30s"),
        ("--replace-timeout", "30s"),
    ] {
        if !extra.contains(&flag) {
            c.args([flag, value]);
        }
    }
    c.args(extra)
        .env("KUBECONFIG", &e.kubeconfig)
        .env("RUST_LOG", "warn");
    c
}

fn rollout(e: &Env, extra: &[&str]) -> (i32, String) {
    let out = rollout_cmd(e, extra)
        .output()
        .expect("run stepguard rollout");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

/// A stepper in the background, its output in a file of the lab's run directory.
struct Stepper {
    child: Child,
    log: std::path::PathBuf,
}

impl Stepper {
    fn spawn(e: &Env, name: &str, extra: &[&str]) -> Stepper {
        let log = e.run_dir.join(format!("{name}.log"));
        let f = std::fs::File::create(&log).unwrap();
        let child = rollout_cmd(e, extra)
            .stdout(Stdio::from(f.try_clone().unwrap()))
            .stderr(Stdio::from(f))
            .spawn()
            .expect("spawn stepguard rollout");
        Stepper { child, log }
    }
    fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
    fn running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
    fn kill9(&mut self) {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

impl Drop for Stepper {
    fn drop(&mut self) {
        if self.running() {
            self.kill9();
        }
    }
}

fn deletions_since(e: &Env, from: usize) -> Vec<String> {
    e.kube.world.lock().unwrap().deletions[from..].to_vec()
}

fn counts(v: &[String]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for n in v {
        *m.entry(n.clone()).or_insert(0) += 1;
    }
    m
}

/// Every node runs one Ready cilium pod on `rev`, none being deleted.
fn all_on(e: &Env, rev: &str) -> bool {
    let w = e.kube.world.lock().unwrap();
    w.pods.len() == 3
        && w.pods
            .values()
            .all(|p| p.revision == rev && p.ready && !p.terminating)
}

fn events(e: &Env) -> usize {
    e.kube.world.lock().unwrap().events.len()
}

/// The nodes of the Events with `reason` since the `from`-th Event.
fn event_nodes(e: &Env, from: usize, reason: &str) -> Vec<String> {
    e.kube.world.lock().unwrap().events[from..]
        .iter()
        .filter(|v| v["reason"] == reason)
        .filter_map(|v| {
            let m = v["message"].as_str()?;
            Some(m.strip_prefix("node ")?.split(':').next()?.to_string())
        })
        .collect()
}

fn reasons_since(e: &Env, from: usize) -> Vec<String> {
    e.kube.world.lock().unwrap().events[from..]
        .iter()
        .filter_map(|v| v["reason"].as_str().map(String::from))
        .collect()
}

/// The rollout lock, if any.
fn lock(e: &Env) -> Option<Value> {
    e.kube
        .world
        .lock()
        .unwrap()
        .leases
        .iter()
        .find(|((ns, _), _)| ns == "stepguard")
        .map(|(_, l)| l.clone())
}

fn lock_annotation(e: &Env, key: &str) -> Option<String> {
    lock(e).and_then(|l| l["metadata"]["annotations"][key].as_str().map(String::from))
}

/// Waits (bounded) until `ok`; panics with `what` and `context()` otherwise.
fn wait_until(what: &str, limit: Duration, ok: impl Fn() -> bool, context: impl Fn() -> String) {
    let deadline = Instant::now() + limit;
    while !ok() {
        assert!(
            Instant::now() < deadline,
            "{what}: not within {limit:?}\n{}",
            context()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Every node stepped exactly once since `from_del`, and every verdict read (one passed Event
/// per node since `from_ev`), all on `rev`.
fn each_node_once_every_verdict_read(
    e: &Env,
    from_del: usize,
    from_ev: usize,
    rev: &str,
    out: &str,
) {
    let d = deletions_since(e, from_del);
    assert_eq!(
        counts(&d).values().copied().collect::<Vec<_>>(),
        [1, 1, 1],
        "each node deleted once: {d:?}\n{out}"
    );
    let mut passed = event_nodes(e, from_ev, "StepguardStepPassed");
    passed.sort();
    assert_eq!(
        passed,
        [node_name(0), node_name(1), node_name(2)],
        "every node's verdict read, once: {:?}\n{out}",
        reasons_since(e, from_ev)
    );
    assert!(all_on(e, rev), "{:?}", e.kube.world.lock().unwrap().pods);
}

#[test]
fn rollouts_plan_step_verify_and_replan_on_an_approved_revision() {
    let e = env();

    // The plan, and the refusals in their documented order.
    let (code, out) = rollout(&e, &["--dry-run"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("3 of 3 nodes to step") && out.contains("moves L2 VIPs"),
        "{out}"
    );
    {
        let mut w = e.kube.world.lock().unwrap();
        w.nodes.insert(node_name(1), false);
        w.agents.remove(&node_name(2));
        w.observed_generation = 1;
    }
    let (code, out) = rollout(&e, &["--dry-run"]);
    assert_eq!(code, 2, "{out}");
    let (a, b, c) = (
        out.find("status is stale").expect(&out),
        out.find("node node-1 is NotReady").expect(&out),
        out.find("no stepguard agent on node node-2").expect(&out),
    );
    assert!(a < b && b < c, "refusals in order: {out}");
    {
        let mut w = e.kube.world.lock().unwrap();
        w.nodes.insert(node_name(1), true);
        w.agents
            .insert(node_name(2), stepguard_lab::lan::node_addr(2).to_string());
        w.observed_generation = w.generation;
    }

    // A three-node rollout passes: each node stepped once, verified, the lock released.
    let (code, out) = rollout(&e, &[]);
    assert_eq!(code, 0, "{out}");
    each_node_once_every_verdict_read(&e, 0, 0, "rev2", &out);
    assert!(out.contains("3 nodes stepped and verified"), "{out}");
    assert!(lock(&e).is_none(), "the lock is released: {:?}", lock(&e));

    // An approved revision change mid-rollout: the node already stepped to the superseded
    // revision is stepped again.
    let from = e.kube.world.lock().unwrap().deletions.len();
    {
        let mut w = e.kube.world.lock().unwrap();
        w.bump_revision(); // rev3
        w.bumps.push(Bump {
            deletion: from + 1,
            at: Moment::Ready,
            approve: true,
        }); // rev4, approved, right after the first replacement
    }
    let (code, out) = rollout(&e, &[]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("moved to approved revision rev4"), "{out}");
    let d = deletions_since(&e, from);
    assert_eq!(d.len(), 4, "{d:?}\n{out}");
    assert_eq!(
        counts(&d)[&d[0]],
        2,
        "the first node is stepped again: {d:?}"
    );
    assert!(all_on(&e, "rev4"));
}

/// Where the stepper is killed.
#[derive(Clone, Copy, Debug)]
enum KillAt {
    /// The step begun on the agent and recorded; the pod not deleted yet.
    BeforeDelete,
    /// The old pod Terminating, no replacement yet.
    Terminating,
    /// The replacement Pending, unbound.
    Pending,
    /// The replacement Ready, its verdict not read.
    ReadyBeforeVerdict,
}

#[test]
fn a_stepper_killed_in_any_phase_finishes_that_node_first_and_steps_none_twice() {
    let e = env();
    for at in [
        KillAt::BeforeDelete,
        KillAt::Terminating,
        KillAt::Pending,
        KillAt::ReadyBeforeVerdict,
    ] {
        let (from_del, from_ev, rev) = {
            let mut w = e.kube.world.lock().unwrap();
            w.bump_revision();
            match at {
                KillAt::BeforeDelete => {
                    w.slow_event = Some(("StepguardStepBegun".into(), Duration::from_secs(5)))
                }
                KillAt::Terminating => w.create_after = Duration::from_secs(3),
                KillAt::Pending => w.bind_after = Duration::from_secs(3),
                KillAt::ReadyBeforeVerdict => {}
            }
            (w.deletions.len(), w.events.len(), w.revision.0.clone())
        };
        let mut s = Stepper::spawn(&e, &format!("kill-{at:?}"), &[]);
        let in_flight = || lock_annotation(&e, "stepguard.io/node");
        wait_until(
            &format!("{at:?}: the stepper reaches the phase"),
            Duration::from_secs(60),
            || {
                let Some(node) = in_flight() else {
                    return false;
                };
                let w = e.kube.world.lock().unwrap();
                let deleted = w.deletions.len() > from_del;
                let old_terminating = w.pods.values().any(|p| p.node == node && p.terminating);
                let fresh: Vec<&FakePod> = w
                    .pods
                    .values()
                    .filter(|p| p.node == node && !p.terminating && p.revision == rev)
                    .collect();
                match at {
                    KillAt::BeforeDelete => w.holding_event && !deleted,
                    KillAt::Terminating => deleted && old_terminating && fresh.is_empty(),
                    KillAt::Pending => fresh.iter().any(|p| !p.bound),
                    KillAt::ReadyBeforeVerdict => fresh.iter().any(|p| p.ready),
                }
            },
            || s.output(),
        );
        if let KillAt::ReadyBeforeVerdict = at {
            assert!(
                event_nodes(&e, from_ev, "StepguardStepPassed").is_empty(),
                "killed before the verdict was read"
            );
        }
        s.kill9();
        let killed_at = in_flight().expect("the lock records the step in flight");
        {
            let mut w = e.kube.world.lock().unwrap();
            w.create_after = Duration::from_millis(300);
            w.bind_after = Duration::from_millis(300);
        }
        // The lock expires (3 s); the next run finishes the interrupted node first.
        std::thread::sleep(Duration::from_millis(3500));
        let (code, out) = rollout(&e, &[]);
        assert_eq!(code, 0, "{at:?}: {out}");
        assert!(
            out.contains(&format!(
                "resuming the rollout interrupted at node {killed_at}"
            )),
            "{at:?}: {out}"
        );
        let first = out
            .lines()
            .find(|l| l.starts_with("[ 1]"))
            .unwrap_or_default()
            .to_string();
        assert!(
            first.contains(&killed_at),
            "{at:?}: the interrupted node comes first: {out}"
        );
        each_node_once_every_verdict_read(&e, from_del, from_ev, &rev, &format!("{at:?}: {out}"));
    }
}

#[test]
fn a_failed_step_halts_every_later_run_until_a_person_lifts_it() {
    let e = env();
    // A fault on the second node (its endpoint map comes back empty): the rollout halts there,
    // exit 1, and the third node is untouched.
    let from = e.kube.world.lock().unwrap().deletions.len();
    *e.fault_at.lock().unwrap() = Some(from + 2);
    let (code, out) = rollout(&e, &[]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("map_emptied"), "{out}");
    let d = deletions_since(&e, from);
    assert_eq!(d.len(), 2, "halted at the second node: {d:?}\n{out}");
    let failed = d[1].clone();
    let halt = lock_annotation(&e, "stepguard.io/halt").expect("the halt is on the lock");
    assert!(
        halt.contains(&failed) && halt.contains("map_emptied"),
        "{halt}"
    );
    assert!(reasons_since(&e, 0)
        .iter()
        .any(|r| r == "StepguardRolloutHalted"));

    // The next run refuses, and so does --dry-run, naming the halt and how to lift it.
    let (code, out) = rollout(&e, &[]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("halted") && out.contains(&format!("--retry {failed}")),
        "{out}"
    );
    let (code, out) = rollout(&e, &["--dry-run"]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("halted") && out.contains(&failed), "{out}");
    assert_eq!(deletions_since(&e, from).len(), 2, "nothing stepped");

    // `--watch` on an approved revision does not step either while the halt stands.
    e.kube.world.lock().unwrap().approve_current();
    let mut watch = Stepper::spawn(&e, "watch-halted", &["--watch", "--watch-interval", "1s"]);
    std::thread::sleep(Duration::from_secs(4));
    assert!(watch.running(), "{}", watch.output());
    assert_eq!(
        deletions_since(&e, from).len(),
        2,
        "the watch steps nothing while halted: {}",
        watch.output()
    );
    assert!(watch.output().contains("halted"), "{}", watch.output());

    // Only the failed node's halt can be lifted, with a reason; the decision is recorded.
    let other = (0..3).map(node_name).find(|n| *n != failed).unwrap();
    let (code, out) = rollout(&e, &["--retry", &other, "--reason", "wrong node"]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains(&format!("the halt is at node {failed}")),
        "{out}"
    );
    let (code, out) = rollout(&e, &["--retry", &failed]);
    assert_ne!(code, 0, "a decision needs a reason: {out}");
    let ev = events(&e);
    let (code, out) = rollout(
        &e,
        &["--retry", &failed, "--reason", "flushed by hand, fixed"],
    );
    assert_eq!(code, 0, "{out}");
    let decisions = lock_annotation(&e, "stepguard.io/decisions").unwrap_or_default();
    assert!(
        decisions.contains("fake-stepper") && decisions.contains("flushed by hand, fixed"),
        "who and why: {decisions}"
    );
    assert!(reasons_since(&e, ev)
        .iter()
        .any(|r| r == "StepguardHaltLifted"));

    // The watch goes on: the failed node stepped again first, then the third.
    wait_until(
        "the watch finishes the rollout after the retry",
        Duration::from_secs(90),
        || deletions_since(&e, from).len() >= 4 && all_on(&e, "rev2"),
        || watch.output(),
    );
    let d = deletions_since(&e, from);
    assert_eq!(d[2], failed, "the retried node first: {d:?}");
    assert_eq!(counts(&d)[&failed], 2, "{d:?}");
    wait_until(
        "the watch's rollout ends (lock released)",
        Duration::from_secs(60),
        || {
            lock(&e).is_some_and(|l| {
                l["spec"]["holderIdentity"]
                    .as_str()
                    .unwrap_or("")
                    .is_empty()
            })
        },
        || watch.output(),
    );
    assert!(
        event_nodes(&e, ev, "StepguardStepPassed").contains(&failed),
        "the retried step's verdict read: {}",
        watch.output()
    );
    watch.kill9();

    // `--skip`: a halt on a new revision lifted by leaving the node as it is.
    let from = e.kube.world.lock().unwrap().deletions.len();
    e.kube.world.lock().unwrap().bump_approved(); // rev3
                                                  // The fault on the run's second node: the first is the node emptied above, whose map the
                                                  // lab leaves empty (it does not regenerate endpoints), so emptying it again changes nothing.
    let emptied = failed;
    *e.fault_at.lock().unwrap() = Some(from + 2);
    let (code, out) = rollout(&e, &[]);
    assert_eq!(code, 1, "{out}");
    let failed = deletions_since(&e, from)[1].clone();
    assert_ne!(failed, emptied, "{out}");
    let (code, out) = rollout(&e, &["--skip", &failed, "--reason", "known bad NIC"]);
    assert_eq!(code, 0, "{out}");
    let (code, out) = rollout(&e, &[]);
    assert_eq!(code, 0, "{out}");
    let d = deletions_since(&e, from);
    assert_eq!(
        counts(&d).get(&failed),
        Some(&1),
        "the skipped node is not stepped again: {d:?}"
    );
    assert_eq!(d.len(), 3, "{d:?}");
}

#[test]
fn a_template_change_before_the_replacement_is_judged_by_the_revision_it_carries() {
    let e = env();
    // The template changes (approved) while the first old pod is Terminating: its replacement
    // carries the newer revision, and that is a replacement, not a timeout.
    let (from, ev) = {
        let mut w = e.kube.world.lock().unwrap();
        w.approve_current();
        w.bumps.push(Bump {
            deletion: 1,
            at: Moment::Terminating,
            approve: true,
        }); // rev3
        (w.deletions.len(), w.events.len())
    };
    let (code, out) = rollout(&e, &["--replace-timeout", "20s"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("carries revision rev3"), "{out}");
    assert!(
        !reasons_since(&e, ev)
            .iter()
            .any(|r| r == "StepguardStepFailed"),
        "{out}"
    );
    each_node_once_every_verdict_read(&e, from, ev, "rev3", &out);

    // Unapproved, by hand: the step is finished and its verdict read, then the run stops
    // (exit 2) instead of going on to a revision nobody approved.
    let (from, ev) = {
        let mut w = e.kube.world.lock().unwrap();
        w.bump_approved(); // rev4
        let n = w.deletions.len();
        w.bumps.push(Bump {
            deletion: n + 1,
            at: Moment::Pending,
            approve: false,
        }); // rev5
        (n, w.events.len())
    };
    let (code, out) = rollout(&e, &["--replace-timeout", "20s"]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("revision rev5 of the DaemonSet is not approved"),
        "{out}"
    );
    let d = deletions_since(&e, from);
    assert_eq!(d.len(), 1, "{d:?}\n{out}");
    assert_eq!(event_nodes(&e, ev, "StepguardStepPassed"), d, "{out}");
}

#[test]
fn watch_pauses_at_an_unapproved_revision_until_it_is_approved() {
    let e = env();
    let ev = {
        let mut w = e.kube.world.lock().unwrap();
        w.approve_current(); // rev2
        w.bumps.push(Bump {
            deletion: 1,
            at: Moment::Ready,
            approve: false,
        }); // rev3, not approved, as the first replacement turns Ready
        w.events.len()
    };
    let mut watch = Stepper::spawn(&e, "watch-pause", &["--watch", "--watch-interval", "1s"]);
    wait_until(
        "the watch pauses with an Event",
        Duration::from_secs(60),
        || {
            reasons_since(&e, ev)
                .iter()
                .any(|r| r == "StepguardRolloutPaused")
        },
        || watch.output(),
    );
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        deletions_since(&e, 0).len(),
        1,
        "paused: {}",
        watch.output()
    );
    assert!(watch.running());
    assert!(
        watch.output().contains("rev3"),
        "a log line: {}",
        watch.output()
    );
    e.kube.world.lock().unwrap().approve_current();
    wait_until(
        "the watch goes on once rev3 is approved",
        Duration::from_secs(90),
        || all_on(&e, "rev3"),
        || watch.output(),
    );
    let d = deletions_since(&e, 0);
    assert_eq!(d.len(), 4, "{d:?}");
    assert_eq!(
        counts(&d)[&d[0]],
        2,
        "the first node again, for rev3: {d:?}"
    );
}

#[test]
fn transient_api_errors_mid_rollout_are_waited_out() {
    let e = env();
    let mut s = Stepper::spawn(&e, "flaky", &["--lock-duration", "10s"]);
    wait_until(
        "the first pod deleted",
        Duration::from_secs(60),
        || !deletions_since(&e, 0).is_empty(),
        || s.output(),
    );
    e.kube.world.lock().unwrap().fail_until = Some(Instant::now() + Duration::from_secs(4));
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "the rollout ends: {}",
            s.output()
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let out = s.output();
    assert_eq!(status.code(), Some(0), "{out}");
    assert!(
        e.kube.world.lock().unwrap().failed_requests > 0,
        "the server failed"
    );
    each_node_once_every_verdict_read(&e, 0, 0, "rev2", &out);
}
