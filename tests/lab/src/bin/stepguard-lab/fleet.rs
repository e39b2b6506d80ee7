//! `stepguard-lab fleet`: one rollout of a fleet measured two ways on one real control plane —
//! the DaemonSet controller's own RollingUpdate with a `maxUnavailable` (the anchor: it
//! verifies nothing), then `stepguard rollout --max-unavailable` of the same change on
//! OnDelete — with each one's wall time and API requests (from the audit log, by verb and
//! resource) and the stepper's CPU time and peak RSS. The nodes' kubelet and agents are the
//! fleet simulation of `stepguard_lab::kube::fleet` (said so in its docs, and why).
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use stepguard_lab::kube::fleet::{create_fleet_nodes, Fleet, FleetSpec};
use stepguard_lab::kube::{ControlPlane, Kube, DS_CONTROLLER_USER};

pub struct FleetOpts {
    pub nodes: usize,
    pub max_unavailable: String,
    pub restart: Duration,
    pub settle: Duration,
    pub fail_rate: f64,
    pub stepguard: PathBuf,
    pub repo: PathBuf,
    pub agent_port: u16,
}

fn stamp() -> String {
    k8s_openapi::jiff::Timestamp::now().to_string()
}

/// The audited requests of `user` received in [`from`, `to`] (RFC 3339 stamps), by
/// `verb resource`; watches counted once (their first audit event).
fn requests(cp: &ControlPlane, user: &str, from: &str, to: &str) -> Result<BTreeMap<String, u64>> {
    let parse = |s: &str| s.parse::<k8s_openapi::jiff::Timestamp>().ok();
    let (from, to) = (parse(from), parse(to));
    let mut seen = std::collections::BTreeSet::new();
    let mut by: BTreeMap<String, u64> = BTreeMap::new();
    for v in cp.requests_of(user)? {
        let at = v["requestReceivedTimestamp"].as_str().and_then(parse);
        if at < from || at > to {
            continue;
        }
        let id = v["auditID"].as_str().unwrap_or("").to_string();
        if !seen.insert(id) {
            continue;
        }
        let r = &v["objectRef"];
        let res = match r["subresource"].as_str() {
            Some(sub) => format!("{}/{sub}", r["resource"].as_str().unwrap_or("?")),
            None => r["resource"].as_str().unwrap_or("?").to_string(),
        };
        *by.entry(format!("{} {res}", v["verb"].as_str().unwrap_or("?")))
            .or_default() += 1;
    }
    Ok(by)
}

fn total(m: &BTreeMap<String, u64>) -> u64 {
    m.values().sum()
}

/// Waits (bounded) until `ok`.
fn wait(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) -> Result<Duration> {
    let t0 = Instant::now();
    while !ok() {
        if t0.elapsed() > limit {
            bail!("{what}: not within {}s", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(t0.elapsed())
}

/// The cilium DaemonSet is on its newest template everywhere, every pod Ready.
fn rolled(k: &Kube, n: usize) -> bool {
    let Ok(ds) = k.block(
        k.ns::<k8s_openapi::api::apps::v1::DaemonSet>("kube-system")
            .get("cilium"),
    ) else {
        return false;
    };
    let st = ds.status.unwrap_or_default();
    st.observed_generation >= ds.metadata.generation
        && st.updated_number_scheduled.unwrap_or(0) as usize == n
        && st.number_available.unwrap_or(0) as usize == n
        && st.number_ready as usize == n
        && st.desired_number_scheduled as usize == n
}

fn bump(k: &Kube, n: u32, strategy: Value) -> Result<()> {
    k.merge(
        &k.ns::<k8s_openapi::api::apps::v1::DaemonSet>("kube-system"),
        "cilium",
        json!({"spec": {"updateStrategy": strategy,
               "template": {"metadata": {"annotations": {"bench.stepguard.io/change": n.to_string()}}}}}),
        false,
    )
    .map(|_| ())
}

pub fn fleet(o: FleetOpts) -> Result<()> {
    let kube_bin = PathBuf::from(
        std::env::var("STEPGUARD_KUBE_BIN")
            .context("STEPGUARD_KUBE_BIN: the control plane's binaries (`cargo xtask kube`)")?,
    );
    let dir = std::env::temp_dir().join(format!("sg-fleet-{}", std::process::id()));
    let mut cp = ControlPlane::up(&dir, &kube_bin)?;
    let r = run(&cp, &o);
    cp.down();
    let _ = std::fs::remove_dir_all(&dir);
    let out = r?;
    println!("{}", serde_json::to_string(&out)?);
    Ok(())
}

fn run(cp: &ControlPlane, o: &FleetOpts) -> Result<Value> {
    let k = Kube::connect(&cp.admin_kubeconfig())?;
    let n = o.nodes;
    cp.kubectl(&["create", "namespace", "stepguard"])?;
    let rbac = o.repo.join("deploy/rollout/rbac.yaml");
    cp.kubectl(&[
        "apply",
        "--server-side",
        "-f",
        rbac.to_str().unwrap_or_default(),
    ])?;
    let t = Instant::now();
    create_fleet_nodes(&k, n)?;
    eprintln!("fleet: {n} Nodes in {:.1}s", t.elapsed().as_secs_f64());
    let _fleet = Fleet::start(
        &k,
        FleetSpec {
            nodes: n,
            restart: o.restart,
            fail_rate: o.fail_rate,
            agent_port: o.agent_port,
        },
    )?;
    let ds = |ns: &str, name: &str, labels: Value, image: &str, strategy: Value| {
        json!({"apiVersion": "apps/v1", "kind": "DaemonSet",
               "metadata": {"name": name, "namespace": ns, "labels": labels.clone()},
               "spec": {"selector": {"matchLabels": labels.clone()}, "updateStrategy": strategy,
                        "template": {"metadata": {"labels": labels},
                                     "spec": {"hostNetwork": true, "terminationGracePeriodSeconds": 1,
                                              "tolerations": [{"operator": "Exists"}],
                                              "containers": [{"name": if name == "cilium" { "cilium-agent" } else { "agent" },
                                                              "image": image}]}}}})
    };
    let rolling =
        json!({"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": o.max_unavailable}});
    k.create(
        &k.ns::<k8s_openapi::api::apps::v1::DaemonSet>("stepguard"),
        ds(
            "stepguard",
            "stepguard",
            json!({"app.kubernetes.io/name": "stepguard"}),
            "stepguard:bench",
            json!({"type": "RollingUpdate"}),
        ),
    )?;
    k.create(
        &k.ns::<k8s_openapi::api::apps::v1::DaemonSet>("kube-system"),
        ds(
            "kube-system",
            "cilium",
            json!({"k8s-app": "cilium"}),
            "quay.io/cilium/cilium:v1.20.2",
            rolling.clone(),
        ),
    )?;
    let limit = Duration::from_secs(120 + n as u64);
    let up = wait("every node's cilium pod Ready", limit, || rolled(&k, n))?;
    eprintln!("fleet: {n} cilium pods Ready in {:.1}s", up.as_secs_f64());

    // The anchor: the controller's own RollingUpdate of one template change.
    let from = stamp();
    let t0 = Instant::now();
    bump(&k, 1, rolling)?;
    std::thread::sleep(Duration::from_millis(500));
    wait("the controller's RollingUpdate", limit * 4, || {
        rolled(&k, n)
    })?;
    let anchor_wall = t0.elapsed();
    let to = stamp();
    let anchor = requests(cp, DS_CONTROLLER_USER, &from, &to)?;
    eprintln!(
        "fleet: the DaemonSet controller rolled {n} nodes in {:.1}s with {} requests",
        anchor_wall.as_secs_f64(),
        total(&anchor)
    );

    // The same change again, stepped by stepguard on OnDelete.
    bump(&k, 2, json!({"type": "OnDelete", "rollingUpdate": null}))?;
    wait(
        "the controller observes the change",
        Duration::from_secs(60),
        || {
            k.block(
                k.ns::<k8s_openapi::api::apps::v1::DaemonSet>("kube-system")
                    .get("cilium"),
            )
            .is_ok_and(|d| d.status.and_then(|s| s.observed_generation) >= d.metadata.generation)
        },
    )?;
    let kubeconfig = cp.stepper_kubeconfig(&cp.server)?;
    let from = stamp();
    let t0 = Instant::now();
    let mut child = std::process::Command::new(&o.stepguard)
        .args([
            "rollout",
            "--max-unavailable",
            &o.max_unavailable,
            "--settle",
            &format!("{}ms", o.settle.as_millis()),
            "--operator",
            "",
            "--agent-port",
            &o.agent_port.to_string(),
            "--step-timeout",
            "5m",
        ])
        .env("KUBECONFIG", &kubeconfig)
        .env("HOME", std::env::temp_dir())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("run stepguard rollout")?;
    let pid = child.id() as i32;
    // Its output is read while it runs (a full pipe would stall it), its resource use from
    // wait4 once it exits.
    let read = |r: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut r) = r {
                let _ = r.read_to_string(&mut s);
            }
            s
        })
    };
    let stdout = read(
        child
            .stdout
            .take()
            .map(|r| Box::new(r) as Box<dyn std::io::Read + Send>),
    );
    let stderr = read(
        child
            .stderr
            .take()
            .map(|r| Box::new(r) as Box<dyn std::io::Read + Send>),
    );
    let mut status = 0;
    // SAFETY: an all-zero rusage is valid; wait4 fills it for our own child.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `pid` is our child, not yet reaped (wait_with_output then finds it reaped).
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
    let wall = t0.elapsed();
    let to = stamp();
    let text = stdout.join().unwrap_or_default() + &stderr.join().unwrap_or_default();
    let code = if r == pid && libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        -1
    };
    let batches = text
        .lines()
        .filter(|l| l.trim_start().starts_with("batch "))
        .count();
    if code != 0 || !rolled(&k, n) {
        bail!(
            "stepguard rollout exited {code}, the DaemonSet rolled: {}:\n{text}",
            rolled(&k, n)
        );
    }
    let stepper = requests(cp, &stepguard_lab::kube::stepper_user(), &from, &to)?;
    let controller = requests(cp, DS_CONTROLLER_USER, &from, &to)?;
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    let cpu = secs(ru.ru_utime) + secs(ru.ru_stime);
    eprintln!(
        "fleet: stepguard stepped {n} nodes in {batches} batches in {:.1}s with {} requests ({:.1}s CPU, {} MiB peak)",
        wall.as_secs_f64(),
        total(&stepper),
        cpu,
        ru.ru_maxrss / 1024
    );
    Ok(json!({
        "nodes": n, "max_unavailable": o.max_unavailable,
        "restart_s": o.restart.as_secs_f64(), "settle_s": o.settle.as_secs_f64(),
        "anchor": {"wall_s": anchor_wall.as_secs_f64(), "requests": anchor, "total": total(&anchor)},
        "stepguard": {"wall_s": wall.as_secs_f64(), "batches": batches,
                      "settle_s_total": batches as f64 * o.settle.as_secs_f64(),
                      "requests": stepper, "total": total(&stepper),
                      "cpu_s": cpu, "max_rss_kib": ru.ru_maxrss,
                      "agent_requests": _fleet.answered()},
        "controller_during_stepguard": {"requests": controller, "total": total(&controller)},
    }))
}
