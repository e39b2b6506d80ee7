//! `stepguard-lab` (also `cargo xtask lab`): bring up, inspect, restart, reconfigure and remove
//! simulated Cilium nodes.
use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use std::time::Duration;
use stepguard_lab::{AttachMode, Lab, LabSpec, Profile, RestartOpts};

#[derive(Parser)]
#[command(
    name = "stepguard-lab",
    version,
    about = "A simulated Cilium node in network namespaces (needs root)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

// Parsed once per run: the size of `Restart`'s flags costs nothing worth boxing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Cmd {
    /// (internal) Serve the lab agent's API on a unix socket, as `lab up` starts it.
    #[command(hide = true)]
    AgentApi {
        #[arg(long)]
        socket: std::path::PathBuf,
        #[arg(long)]
        settings: std::path::PathBuf,
    },
    /// Create a lab: namespaces, devices, bpffs with Cilium's maps, fake datapath, DNS/HTTP VIPs.
    Up {
        /// Unique name prefix for the lab's namespaces (default: a fresh `sglabXXXXX`).
        #[arg(long)]
        prefix: Option<String>,
        /// Cilium version whose maps the lab imitates: 1.16, 1.17, 1.18, 1.19 or 1.20.
        #[arg(long, default_value = "1.18")]
        cilium: Profile,
        /// How the datapath attaches: tcx (bpf_link, pinned) or tc (legacy clsact filters).
        #[arg(long, default_value = "tcx")]
        attach: AttachMode,
        /// Also attach cil_xdp_entry to the host devices.
        #[arg(long)]
        xdp: bool,
        /// Number of pods (lxc veths, each into its own namespace).
        #[arg(long, default_value_t = 3)]
        pods: u32,
        /// enable-ipv6 (adds the IPv6 maps); a LAN lab (--nodes 2+, --cilium 1.19 or 1.20) is
        /// then dual-stack, with IPv6 VIPs (gateway6, dns6) announced over NDP.
        #[arg(long)]
        ipv6: bool,
        /// Turn kube-proxy replacement off (no SNAT map; with --no-l2, no cil_to_netdev).
        /// Cilium needs KPR for L2 announcements, so this needs --no-l2.
        #[arg(long)]
        no_kpr: bool,
        /// Turn L2 announcements off (no L2 responder map).
        #[arg(long)]
        no_l2: bool,
        /// routing-mode: tunnel (VXLAN overlay device cilium_vxlan; the tunnel map up to
        /// 1.17) or native.
        #[arg(long, default_value = "tunnel", value_parser = ["tunnel", "native"])]
        routing: String,
        /// max_entries of cilium_ct4_global (LRU, preallocated).
        #[arg(long, default_value_t = 65536)]
        ct_entries: u32,
        /// Entries written into cilium_ct4_global.
        #[arg(long, default_value_t = 64)]
        ct_fill: u32,
        /// 2 to 4: a LAN lab — that many nodes with their eth1 on one segment, a LAN client
        /// namespace for a witness, and L2-announced VIPs (gateway, dns-a, dns-b) whose leases
        /// move as Cilium's do.
        #[arg(long, default_value_t = 1)]
        nodes: u8,
        /// LAN lab: l2-announcements-lease-duration.
        #[arg(long, default_value = "15s", value_parser = parse_duration)]
        lease_duration: std::time::Duration,
        /// LAN lab: l2-announcements-renew-deadline.
        #[arg(long, default_value = "5s", value_parser = parse_duration)]
        lease_renew: std::time::Duration,
        /// LAN lab: l2-announcements-retry-period.
        #[arg(long, default_value = "2s", value_parser = parse_duration)]
        lease_retry: std::time::Duration,
        /// LAN lab: the nodes reach each other's pods over the overlay (cilium_vxlan); each
        /// has a health endpoint (HTTP on 4240), which the other nodes' agents probe as
        /// east-west targets.
        #[arg(long)]
        east_west: bool,
        /// LAN lab with --ipv6: the unsolicited neighbour advertisement a taker sends,
        /// `standard` (v1.19.5+, v1.20: Override, Target link-layer address; moves clients)
        /// or `early` (v1.19.0–v1.19.4: neither; clients keep the old holder's MAC).
        #[arg(long, default_value = "standard")]
        unsolicited_na: stepguard_lab::lan::UnsolicitedNa,
    },
    /// Show a lab (or all labs) as text or JSON.
    Status {
        #[arg(long)]
        prefix: Option<String>,
        #[arg(long, default_value = "text", value_parser = ["text", "json"])]
        format: String,
    },
    /// Simulate a cilium-agent restart; prints what really happened as JSON.
    Restart {
        #[arg(long)]
        prefix: Option<String>,
        /// How long the agent is down (e.g. 300ms, 2s). As in Cilium, the old programs keep
        /// forwarding meanwhile, unless --blackhole.
        #[arg(long, alias = "gap", default_value = "500ms", value_parser = parse_duration)]
        down: std::time::Duration,
        /// Fault: the datapath drops all traffic while the agent is down (a measurable
        /// outage; a real Cilium restart does not do this).
        #[arg(long)]
        blackhole: bool,
        /// How long after the reload the recreated ipcache is refilled.
        #[arg(long, default_value = "0s", value_parser = parse_duration)]
        refill_after: std::time::Duration,
        /// Fault: this program keeps its old instance on every device (e.g. cil_xdp_entry,
        /// cil_from_overlay) while the rest is reloaded.
        #[arg(long, value_name = "PROGRAM")]
        stale: Option<String>,
        /// Fault: the programs are reloaded but the agent does not read its config again.
        #[arg(long)]
        keep_config: bool,
        /// Fault: this program (e.g. cil_to_netdev) is no longer attached after the reload.
        #[arg(long, value_name = "PROGRAM")]
        lose_program: Option<String>,
        /// Fault: the agent loads the per-node overrides but its datapath follows the
        /// ConfigMap alone.
        #[arg(long)]
        ignore_override: bool,
        /// Fault: endpoint regeneration stalls: the first N endpoints (or all) keep the
        /// programs they had before the restart.
        #[arg(long, value_name = "N|all", value_parser = parse_stall)]
        stall_endpoints: Option<u32>,
        /// Fault (a LAN lab with --east-west): after the reload this node's tunnel entries
        /// to the other nodes are gone: their pods are unreachable from it.
        #[arg(long)]
        break_overlay: bool,
        /// How long each batch of 50 endpoint regenerations takes (after the host
        /// programs are replaced), e.g. 200ms: a slow regeneration.
        #[arg(long, default_value = "0s", value_parser = parse_duration)]
        regenerate_every: std::time::Duration,
        /// LAN lab: restart the agent on this node (its leases move as Cilium's do).
        #[arg(long)]
        node: Option<u8>,
        /// LAN lab: the agent crashes (its leases are not released; they expire).
        #[arg(long, requires = "node")]
        crash: bool,
        /// LAN lab: the pod's termination grace (the Helm chart's 1 s, preStop included).
        #[arg(long, requires = "node", default_value = "1s", value_parser = parse_duration)]
        grace: std::time::Duration,
        /// LAN lab: how long a graceful stop takes to release the leases; not under
        /// --grace: killed first, nothing released (the leases expire as after a crash).
        #[arg(long, requires = "node", default_value = "0s", value_parser = parse_duration)]
        release_takes: std::time::Duration,
        /// LAN lab: how the new agent's L2 responder reconciles its map at start: `all`
        /// (every entry deleted: v1.19.7 and v1.20.2, after cilium/cilium#45197), `last`
        /// (1.16 to 1.19.0-dev: only the entry iterated last, #45068), `none`.
        #[arg(long, requires = "node", default_value = "all")]
        responder_flush: stepguard_lab::lan::ResponderFlush,
        /// LAN lab: from the new agent's start to its leases re-acquired, when it re-adds
        /// missing responder entries with a gratuitous ARP.
        #[arg(long, requires = "node", default_value = "1s", value_parser = parse_duration)]
        reacquire_after: std::time::Duration,
        /// LAN lab: forget neighbour entries during the restart: `client` (the LAN client's,
        /// for the VIPs) or `node<i>` (node i's, for the other nodes); see --forget-at.
        #[arg(long, requires = "node", value_name = "client|node<i>")]
        forget_neighbours: Option<String>,
        /// When to forget them: `flush` (right after the responder's reconciliation at the
        /// agent's start) or a time after the agent went down (e.g. 500ms).
        #[arg(
            long,
            requires = "forget_neighbours",
            value_name = "flush|DURATION",
            default_value = "flush"
        )]
        forget_at: String,
        /// Fault: nothing is replaced (same program IDs afterwards).
        #[arg(long)]
        no_reload: bool,
        /// Fault: the new datapath is no longer attached to this device.
        #[arg(long, value_name = "DEV")]
        drop_device: Option<String>,
        /// Fault: this pinned map disappears from tc/globals.
        #[arg(long, value_name = "NAME")]
        lose_map: Option<String>,
        /// Fault: this map comes back empty.
        #[arg(long, value_name = "NAME")]
        flush_map: Option<String>,
        /// Fault: N entries of this map are deleted while the agent is down (as
        /// `bpftool map delete` would; a pod deleted during the restart is one `cilium_lxc`
        /// entry).
        #[arg(long, value_name = "MAP:N", value_parser = parse_lose_entries)]
        lose_entries: Option<(String, u32)>,
        /// Fault: after the reload, packets to the VIPs are dropped at random with this
        /// probability (0 to 1) for `--loss-for`: a lossy datapath.
        #[arg(long, value_name = "P")]
        loss: Option<f64>,
        /// How long `--loss` lasts.
        #[arg(long, value_name = "DURATION", default_value = "3s", value_parser = parse_duration)]
        loss_for: std::time::Duration,
        /// Fault: ipcache is recreated (as on every Cilium start) but never refilled.
        #[arg(long)]
        no_refill: bool,
        /// An upgrade restart: the agent comes back as this Cilium version (1.16 … 1.20),
        /// with that version's maps.
        #[arg(long, value_name = "VERSION")]
        to: Option<Profile>,
        /// A property change: this map is recreated with twice its size (new id), refilled.
        #[arg(long, value_name = "NAME")]
        resize_map: Option<String>,
    },
    /// The lab's cilium-config: `config set KEY=VALUE...` edits the ConfigMap the way kubelet
    /// updates its mount; `config override KEY=VALUE...` adds a per-node override (a
    /// CiliumNodeConfig), loaded like the ConfigMap when the agent next restarts; `show`.
    Config {
        #[arg(long)]
        prefix: Option<String>,
        #[arg(value_parser = ["set", "override", "show"])]
        action: String,
        /// KEY=VALUE pairs (`set`, `override`; `override KEY=` removes an override).
        pairs: Vec<String>,
    },
    /// Add a host device (a veth into the fabric) carrying the datapath: `device add eth2`.
    Device {
        #[arg(long)]
        prefix: Option<String>,
        #[arg(value_parser = ["add"])]
        action: String,
        name: String,
    },
    /// A lab node running the real cilium-agent (built by `cargo xtask cilium`) against its
    /// own real control plane, in the foreground until Ctrl-C (then everything is removed):
    /// prints how to run stepguard on it. `cargo xtask lab real-node` builds what is missing
    /// and sets STEPGUARD_CILIUM_1_20 and STEPGUARD_KUBE_BIN.
    RealNode {
        #[arg(long)]
        prefix: Option<String>,
        /// The Cilium minor (its bin dir from STEPGUARD_CILIUM_<MINOR>, e.g. STEPGUARD_CILIUM_1_20).
        #[arg(long, default_value = "1.20")]
        release: String,
        /// routing-mode: tunnel (VXLAN) or native.
        #[arg(long, default_value = "tunnel", value_parser = ["tunnel", "native"])]
        routing: String,
        /// No pods (by default two nginx pods and a dnsmasq pod are made through cilium-cni,
        /// with Services over them whose VIPs are stepguard targets).
        #[arg(long)]
        no_pods: bool,
        /// Restart the cilium-agent (SIGTERM, then a new agent, until it is ready) over and
        /// over while this file exists: the load of a real restart, its datapath compiled,
        /// for `cargo xtask bench`. Checked every 200 ms.
        #[arg(long, value_name = "FILE")]
        restart_while: Option<std::path::PathBuf>,
    },
    /// Remove a lab and everything it created.
    Down {
        #[arg(long)]
        prefix: Option<String>,
        /// Remove every lab on this machine.
        #[arg(long)]
        all: bool,
    },
}

/// The lab to act on: the given prefix, or the only one there is.
fn pick(prefix: Option<String>) -> Result<Lab> {
    match prefix {
        Some(p) => Lab::open(&p),
        None => {
            let labs = Lab::list();
            match labs.as_slice() {
                [one] => Lab::open(one),
                [] => bail!("no lab is up: run `cargo xtask lab up`"),
                many => bail!("several labs are up ({}): pass --prefix", many.join(", ")),
            }
        }
    }
}

fn print_status(lab: &Lab) {
    let s = lab.status();
    println!(
        "lab {}  ({}, Cilium {} profile, {} attach{})",
        s["prefix"].as_str().unwrap_or(""),
        if lab.state.ready {
            "ready"
        } else {
            "NOT ready"
        },
        lab.state.spec.profile,
        s["attach"].as_str().unwrap_or(""),
        if lab.state.spec.xdp { ", XDP" } else { "" }
    );
    println!(
        "  node namespace   {}  ({})",
        lab.node_ns(),
        s["node_netns_path"].as_str().unwrap_or("")
    );
    println!("  bpffs            {}", lab.state.bpffs.display());
    println!("  cilium-config    {}", lab.state.cilium_config.display());
    println!("  devices          {}", lab.state.devices.join(", "));
    println!("  pods (lxc)       {}", lab.state.lxc.len());
    println!(
        "  gateway VIP      {}:{} (http /healthz)",
        stepguard_lab::GATEWAY_VIP,
        stepguard_lab::GATEWAY_PORT
    );
    println!(
        "  DNS VIP          {}:{} (gateway.{})",
        stepguard_lab::DNS_VIP,
        stepguard_lab::DNS_PORT,
        stepguard_lab::DNS_ZONE
    );
    println!("  stepguard config {}", lab.stepguard_config().display());
    println!(
        "  run the agent:   nsenter --net={} -- stepguard check --config {}",
        s["node_netns_path"].as_str().unwrap_or(""),
        lab.stepguard_config().display()
    );
}

static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_interrupt(_: libc::c_int) {
    INTERRUPTED.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// `real-node`: up, tell the user how to use it, wait for Ctrl-C (or SIGTERM), down.
fn real_node(
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

fn main() {
    if let Err(e) = real_main() {
        eprintln!("stepguard-lab: {e:#}");
        std::process::exit(1);
    }
}

fn real_main() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::RealNode {
            prefix,
            release,
            routing,
            no_pods,
            restart_while,
        } => real_node(
            prefix,
            &release,
            &routing,
            !no_pods,
            restart_while.as_deref(),
        )?,
        Cmd::AgentApi { socket, settings } => {
            stepguard_lab::sim::agentapi::serve_agent_api(&socket, &settings)?;
        }
        Cmd::Up {
            prefix,
            cilium,
            attach,
            xdp,
            pods,
            ipv6,
            no_kpr,
            no_l2,
            routing,
            ct_entries,
            ct_fill,
            nodes,
            lease_duration,
            lease_renew,
            lease_retry,
            east_west,
            unsolicited_na,
        } => {
            stepguard_lab::sys::check_root()?;
            if east_west && nodes < 2 {
                bail!("--east-west needs a LAN lab: --nodes 2 to 4");
            }
            if nodes > 1 {
                let mut spec = stepguard_lab::lan::LanSpec::new(
                    prefix.unwrap_or_else(stepguard_lab::unique_prefix),
                );
                spec.nodes = nodes;
                spec.east_west = east_west;
                spec.ipv6 = ipv6;
                spec.na = unsolicited_na;
                spec.profile = cilium;
                spec.attach = attach;
                spec.lease = stepguard_lab::lan::LeaseTimings {
                    duration: lease_duration,
                    renew: lease_renew,
                    retry: lease_retry,
                };
                let lan = stepguard_lab::lan::LanLab::up(spec)?;
                println!("{}", serde_json::to_string_pretty(&lan.status())?);
                return Ok(());
            }
            let mut spec = LabSpec::new(prefix.unwrap_or_else(stepguard_lab::unique_prefix));
            spec.profile = cilium;
            spec.attach = attach;
            spec.xdp = xdp;
            spec.pods = pods;
            spec.features.ipv6 = ipv6;
            spec.features.kube_proxy_replacement = !no_kpr;
            spec.features.l2_announcements = !no_l2;
            spec.features.tunnel = routing == "tunnel";
            spec.capacity.ct_entries = ct_entries;
            spec.ct_fill = ct_fill;
            let lab = Lab::up(spec)?;
            print_status(&lab);
        }
        Cmd::Status { prefix, format } => {
            if let Some(p) = prefix
                .as_deref()
                .filter(|p| stepguard_lab::lan::LanLab::list().iter().any(|l| l == p))
            {
                let lan = stepguard_lab::lan::LanLab::open(p)?;
                println!("{}", serde_json::to_string_pretty(&lan.status())?);
                return Ok(());
            }
            let labs: Vec<Lab> = match prefix {
                Some(p) => vec![Lab::open(&p)?],
                None => Lab::list()
                    .iter()
                    .map(|p| Lab::open(p))
                    .collect::<Result<_>>()?,
            };
            if format == "json" {
                let v: Vec<_> = labs.iter().map(|l| l.status()).collect();
                let out = if v.len() == 1 {
                    v[0].clone()
                } else {
                    serde_json::Value::Array(v)
                };
                println!("{}", serde_json::to_string_pretty(&out)?);
            } else if labs.is_empty() {
                println!("no lab is up");
            } else {
                labs.iter().for_each(print_status);
            }
        }
        Cmd::Restart {
            prefix,
            down,
            blackhole,
            refill_after,
            stale,
            keep_config,
            lose_program,
            ignore_override,
            stall_endpoints,
            regenerate_every,
            break_overlay,
            no_reload,
            drop_device,
            lose_map,
            flush_map,
            lose_entries,
            loss,
            loss_for,
            no_refill,
            to,
            resize_map,
            node,
            crash,
            grace,
            release_takes,
            responder_flush,
            reacquire_after,
            forget_neighbours,
            forget_at,
        } => {
            let opts = RestartOpts {
                down,
                blackhole,
                refill_after,
                stale,
                keep_config,
                lose_program,
                ignore_override,
                stall_endpoints,
                regenerate_every,
                break_overlay,
                no_reload,
                drop_device,
                lose_map,
                flush_map,
                lose_entries,
                loss,
                loss_for,
                no_refill,
                to,
                resize_map,
            };
            if let Some(i) = node {
                let p = match prefix {
                    Some(p) => p,
                    None => match stepguard_lab::lan::LanLab::list().as_slice() {
                        [one] => one.clone(),
                        [] => bail!("no LAN lab is up: `stepguard-lab up --nodes 2`"),
                        many => bail!(
                            "several LAN labs are up ({}): pass --prefix",
                            many.join(", ")
                        ),
                    },
                };
                let mut lan = stepguard_lab::lan::LanLab::open(&p)?;
                let lo = stepguard_lab::lan::LanRestartOpts {
                    crash,
                    grace,
                    release_takes,
                    flush: responder_flush,
                    reacquire_after,
                    forget: match forget_neighbours {
                        Some(on) => Some(stepguard_lab::lan::Forget {
                            on: parse_forget_on(&on)?,
                            after: parse_forget_at(&forget_at)?,
                        }),
                        None => None,
                    },
                };
                let r = lan.restart_lan(i, &opts, &lo)?;
                println!("{}", serde_json::to_string_pretty(&r)?);
                return Ok(());
            }
            let mut lab = pick(prefix)?;
            let r = lab.restart(&opts)?;
            println!("{}", serde_json::to_string_pretty(&r)?);
        }
        Cmd::Config {
            prefix,
            action,
            pairs,
        } => {
            let mut lab = pick(prefix)?;
            let changes = pairs
                .iter()
                .map(|p| {
                    p.split_once('=')
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .with_context(|| format!("{p:?} is not KEY=VALUE"))
                })
                .collect::<Result<Vec<_>>>()?;
            if action != "show" && changes.is_empty() {
                bail!("config {action} needs KEY=VALUE pairs");
            }
            let values = match action.as_str() {
                "set" => lab.config_set(&changes)?,
                "override" => {
                    lab.config_override(&changes)?;
                    println!("# per-node overrides (loaded at the agent's next restart):");
                    lab.state.spec.node_overrides.clone()
                }
                _ => stepguard_lab::sim::ciliumconfig::read(&lab.state.cilium_config)?,
            };
            for (k, v) in values {
                println!("{k}={v}");
            }
        }
        Cmd::Device {
            prefix,
            action: _,
            name,
        } => {
            let mut lab = pick(prefix)?;
            lab.add_host_device(&name)?;
            println!(
                "device {name} added to lab {} with the datapath attached",
                lab.state.spec.prefix
            );
        }
        Cmd::Down { prefix, all } => {
            stepguard_lab::sys::check_root()?;
            let lans = stepguard_lab::lan::LanLab::list();
            if let Some(p) = prefix.as_deref().filter(|p| lans.iter().any(|l| l == p)) {
                stepguard_lab::lan::LanLab::open(p)?.down()?;
                println!("LAN lab {p} removed");
                return Ok(());
            }
            use stepguard_lab::real::cluster::RealCluster;
            let clusters = RealCluster::list();
            if let Some(p) = prefix
                .as_deref()
                .filter(|p| clusters.iter().any(|l| l == p))
            {
                RealCluster::open(p)?.down()?;
                println!("real-agent cluster {p} removed");
                return Ok(());
            }
            if all {
                for p in &clusters {
                    RealCluster::open(p)?.down()?;
                    println!("real-agent cluster {p} removed");
                }
            }
            let reals = stepguard_lab::real::RealNode::list();
            if let Some(p) = prefix.as_deref().filter(|p| reals.iter().any(|l| l == p)) {
                stepguard_lab::real::RealNode::open(p)?.down()?;
                println!("real-agent node {p} removed");
                return Ok(());
            }
            if all {
                for p in &reals {
                    stepguard_lab::real::RealNode::open(p)?.down()?;
                    println!("real-agent node {p} removed");
                }
                for p in &lans {
                    stepguard_lab::lan::LanLab::open(p)?.down()?;
                    println!("LAN lab {p} removed");
                }
            }
            let prefixes = if all {
                Lab::list()
            } else {
                vec![pick(prefix)?.state.spec.prefix]
            };
            for p in prefixes {
                Lab::open(&p)?.down()?;
                println!("lab {p} removed");
            }
        }
    }
    Ok(())
}

/// `MAP:N` of `--lose-entries`.
/// `all` (every endpoint) or a count.
fn parse_stall(s: &str) -> Result<u32, String> {
    if s == "all" {
        return Ok(u32::MAX);
    }
    s.parse()
        .map_err(|_| format!("invalid --stall-endpoints {s:?}: a number of endpoints or `all`"))
}

fn parse_lose_entries(s: &str) -> Result<(String, u32), String> {
    let (m, n) = s
        .rsplit_once(':')
        .ok_or_else(|| format!("{s:?}: expected MAP:N (e.g. cilium_lb4_services_v2:3)"))?;
    let n: u32 = n
        .parse()
        .map_err(|_| format!("{s:?}: N must be a count of entries"))?;
    if m.is_empty() || n == 0 {
        return Err(format!("{s:?}: expected MAP:N with N ≥ 1"));
    }
    Ok((m.to_string(), n))
}

/// `client` → None; `node1` → Some(1).
fn parse_forget_on(s: &str) -> Result<Option<u8>> {
    match s {
        "client" => Ok(None),
        _ => match s.strip_prefix("node").map(str::parse::<u8>) {
            Some(Ok(i)) => Ok(Some(i)),
            _ => bail!("--forget-neighbours {s:?}: expected client or node<i> (e.g. node0)"),
        },
    }
}

/// `flush` → None; a duration → Some.
fn parse_forget_at(s: &str) -> Result<Option<std::time::Duration>> {
    if s == "flush" {
        Ok(None)
    } else {
        parse_duration(s).map(Some)
    }
}

/// Parses `500ms`, `2s`, `1.5s`, `300us`, `1m`.
fn parse_duration(s: &str) -> Result<Duration> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .parse()
        .with_context(|| format!("invalid duration {s:?}: expected e.g. 500ms or 2s"))?;
    let secs = match unit {
        "ns" => n / 1e9,
        "us" | "µs" => n / 1e6,
        "ms" => n / 1e3,
        "s" => n,
        "m" => n * 60.0,
        _ => bail!("invalid duration {s:?}: unit must be ns, us, ms, s or m"),
    };
    if !(0.0..=3600.0).contains(&secs) {
        bail!("duration {s:?} out of range (0 to 1h)");
    }
    Ok(Duration::from_secs_f64(secs))
}
