//! `real-node`: a node running the real cilium-agent, in the foreground until interrupted.
use anyhow::{Context, Result};

static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_interrupt(_: libc::c_int) {
    INTERRUPTED.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// `real-node`: up, tell the user how to use it, wait for Ctrl-C (or SIGTERM), down.
pub fn real_node(
    prefix: Option<String>,
    release: &str,
    routing: &str,
    pods: bool,
    restart_while: Option<&std::path::Path>,
) -> Result<()> {
    use stepguard_lab::real::{RealNode, RealSpec, Release};
    stepguard_lab::sys::check_root()?;
    let kube_bin = std::env::var_os("STEPGUARD_KUBE_BIN")
        .map(std::path::PathBuf::from)
        .context("STEPGUARD_KUBE_BIN: the control plane's binaries (`cargo xtask lab real-node` sets it)")?;
    let spec = RealSpec {
        prefix: prefix.unwrap_or_else(stepguard_lab::unique_prefix),
        release: Release::from_env(release)?,
        kube_bin,
        tunnel: routing == "tunnel",
        member: None,
    };
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(
            libc::SIGINT,
            on_interrupt as *const () as libc::sighandler_t,
        );
        libc::signal(
            libc::SIGTERM,
            on_interrupt as *const () as libc::sighandler_t,
        );
    }
    let mut node = RealNode::up(spec)?;
    if pods {
        let made = (|| -> Result<()> {
            use stepguard_lab::real::pods::Workload;
            for (name, w) in [
                ("web-0", Workload::Web),
                ("web-1", Workload::Web),
                ("dns-0", Workload::Dns),
            ] {
                let p = node.add_pod(name, w)?;
                println!("pod {name}: {} (CNI ADD)", p.ip);
            }
            node.add_services()
        })();
        if let Err(e) = made {
            let _ = node.down();
            return Err(e);
        }
    }
    let cfg = node.write_stepguard_config()?;
    let cgroup = node.in_node_cgroup();
    println!(
        "real-agent node {p} up: cilium-agent {v} in network namespace {ns}\n\n\
         stepguard check, on the node (its netns and cgroup, under the node's socket-LB):\n  \
         nsenter --net=/run/netns/{ns} -- sh -c '{wrap}' sh target/debug/stepguard check --config {cfg}\n\
         the agent's log: {log}\nits API socket: {sock}\n\
         kubectl: {kubectl} --kubeconfig {kc}\n\nCtrl-C removes it.",
        wrap = cgroup[2],
        p = node.state.spec.prefix,
        v = node.state.spec.release.version,
        ns = node.node_ns(),
        cfg = cfg.display(),
        log = node.agent_log().display(),
        sock = node.agent_socket().display(),
        kubectl = node.state.spec.kube_bin.join("kubectl").display(),
        kc = node.control_plane().admin_kubeconfig().display(),
    );
    let mut restarts = 0u32;
    while !INTERRUPTED.load(std::sync::atomic::Ordering::SeqCst) {
        std::thread::sleep(std::time::Duration::from_millis(200));
        if restart_while.is_some_and(|f| f.exists()) {
            let restarted = (|| -> Result<std::time::Duration> {
                node.stop_agent(libc::SIGTERM, std::time::Duration::from_secs(10))?;
                node.start_agent()?;
                Ok(node.wait_ready(std::time::Duration::from_secs(120))?.ready)
            })();
            restarts += 1;
            match restarted {
                Ok(ready) => {
                    println!("restart {restarts}: the cilium-agent was ready after {ready:.1?}")
                }
                Err(e) => {
                    eprintln!("restart {restarts} failed: {e:#}");
                    break;
                }
            }
            continue;
        }
        if !node.agent_running() {
            eprintln!(
                "the cilium-agent exited; see {}",
                node.agent_log().display()
            );
            break;
        }
    }
    node.down()?;
    println!("real-agent node removed");
    Ok(())
}
