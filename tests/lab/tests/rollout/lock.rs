//! The rollout lock: held only within its renew deadline, not taken from a live holder by a
//! skewed clock, and a paused holder finds it taken over and stops.
use super::*;

/// A stepper in the background, once it holds the lock and deleted a pod (deletions past
/// `from`).
fn stepping(e: &Env, name: &str, extra: &[&str], from: usize) -> Stepper {
    let s = Stepper::spawn(e, name, extra);
    wait_until(
        "the stepper holds the lock and deleted its first pod",
        Duration::from_secs(60),
        || !lock_holder(e).is_empty() && deletions(e).len() > from,
        || s.output(),
    );
    s
}

/// The shared library that shifts a process's clock (Debian's faketime package).
const FAKETIME_LIB: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1";

#[test]
fn the_lock_outlives_a_paused_api_server_only_within_its_renew_deadline() {
    let e = env();
    eprintln!("test: the API server paused (SIGSTOP) across renewals, within the renew deadline");
    // A 9 s lock: renewed every 1.2 s, lost after 6 s without a renewal. Paused 2 s.
    let target = current_revision(&e.k).0;
    let (from, ev) = (deletions(&e).len(), events(&e));
    let mut s = stepping(&e, "apiserver-paused", &["--lock-duration", "9s"], from);
    e.cp.lock().unwrap().pause("kube-apiserver").unwrap();
    std::thread::sleep(Duration::from_secs(2));
    e.cp.lock().unwrap().resume("kube-apiserver").unwrap();
    let code = exit_code(&mut s, Duration::from_secs(120));
    assert_eq!(code, 0, "{}", s.output());
    each_node_once_every_verdict_read(&e, from, &ev, &target, &s.output());

    eprintln!("test: the API server paused beyond the renew deadline");
    // A 3 s lock: lost 2 s after the last renewal. Paused 5 s: the stepper gives the lock up
    // while the API server is away and touches nothing once it is back.
    let rev = bump(&e, false);
    let (from, ev) = (deletions(&e).len(), events(&e));
    let mut s = stepping(&e, "apiserver-paused-long", &[], from);
    e.cp.lock().unwrap().pause("kube-apiserver").unwrap();
    std::thread::sleep(Duration::from_secs(5));
    let gone_while_paused = s.running();
    e.cp.lock().unwrap().resume("kube-apiserver").unwrap();
    let code = exit_code(&mut s, Duration::from_secs(60));
    assert_eq!(code, 2, "{}", s.output());
    assert!(
        s.output().contains("the rollout lock was lost"),
        "{}",
        s.output()
    );
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        deletions_since(&e, from).len(),
        1,
        "nothing more touched (still running when the API server came back: {gone_while_paused}): {}",
        s.output()
    );
    let interrupted = deletions_since(&e, from)[0].clone();
    the_next_run_finishes(&e, &interrupted, from, &ev, &rev, "API server paused");
    assert_rbac_sufficed(&e);
}

#[test]
fn a_second_stepper_with_a_skewed_clock_does_not_take_a_live_lock() {
    let e = env();
    eprintln!("test: a second stepper whose clock is ten minutes ahead");
    // Judged by the holder's renewTime against its own clock, the lock would look expired to
    // it; observed as client-go does (a record that changes is alive) it is not.
    let rev = bump(&e, false);
    let (from, ev) = (deletions(&e).len(), events(&e));
    let mut a = stepping(&e, "holder", &[], from);
    let mut cmd = rollout_cmd(&e, &[]);
    cmd.env("LD_PRELOAD", FAKETIME_LIB)
        .env("FAKETIME", "+10m")
        .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
    let out = cmd.output().expect("the skewed stepper");
    let skewed =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{skewed}");
    assert!(
        skewed.contains("another rollout holds the lock"),
        "{skewed}"
    );
    let code = exit_code(&mut a, Duration::from_secs(120));
    assert_eq!(
        code,
        0,
        "the holder was not disturbed: {}\n{skewed}",
        a.output()
    );
    each_node_once_every_verdict_read(&e, from, &ev, &rev, &a.output());
    assert_rbac_sufficed(&e);
}

#[test]
fn a_stepper_paused_before_its_delete_finds_its_lock_taken_over_and_stops() {
    let e = env();
    let hook = begun_webhook(&e);
    eprintln!("test: a stepper paused before its delete, its lock taken over meanwhile");
    // The first stepper stops (SIGSTOP) right before it deletes its first pod (its
    // StepguardStepBegun Event held by the webhook); a second one sees the lock unchanged for
    // a lease duration, takes it over and finishes the rollout. The first, resumed, finds the
    // lock no longer its own right before the delete and stops.
    let rev = bump(&e, false);
    let (from, ev) = (deletions(&e).len(), events(&e));
    hook.hold.lock().unwrap().next = Some(("StepguardStepBegun".into(), Duration::from_secs(6)));
    let mut a = Stepper::spawn(&e, "paused-stepper", &[]);
    wait_until(
        "the first stepper is about to delete",
        Duration::from_secs(60),
        || hook.hold.lock().unwrap().holding,
        || a.output(),
    );
    signal(&a, libc::SIGSTOP);
    let a_id = lock_holder(&e);
    // The paused stepper's lock expires (3 s) before the second one starts.
    std::thread::sleep(Duration::from_millis(3500));
    let mut b = Stepper::spawn(&e, "taker", &[]);
    wait_until(
        "the second stepper takes the lock over",
        Duration::from_secs(30),
        || {
            let h = lock_holder(&e);
            !h.is_empty() && h != a_id
        },
        || b.output(),
    );
    signal(&a, libc::SIGCONT);
    let code_a = exit_code(&mut a, Duration::from_secs(60));
    let code_b = exit_code(&mut b, Duration::from_secs(120));
    assert_eq!(code_a, 2, "{}", a.output());
    assert!(
        a.output().contains("the rollout lock was lost"),
        "{}",
        a.output()
    );
    assert_eq!(code_b, 0, "{}", b.output());
    assert!(
        b.output().contains("taking it over")
            && b.output().contains("resuming the rollout interrupted"),
        "{}",
        b.output()
    );
    each_node_once_every_verdict_read(
        &e,
        from,
        &ev,
        &rev,
        &format!("{}\n{}", a.output(), b.output()),
    );
    assert_rbac_sufficed(&e);
}
