//! `stepguard-lab` (also `cargo xtask lab`): bring up, inspect, restart, reconfigure and remove
//! simulated Cilium nodes.
mod cli;
mod fleet;
mod real;
mod status;

use anyhow::{bail, Context, Result};
use clap::Parser;
use cli::{parse_forget_at, parse_forget_on, Cli, Cmd};
use real::real_node;
use status::{pick, print_status};
use stepguard_lab::{Lab, LabSpec, RestartOpts};

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
        Cmd::Fleet {
            nodes,
            max_unavailable,
            restart,
            settle,
            fail_rate,
            stepguard,
            repo,
            agent_port,
        } => fleet::fleet(fleet::FleetOpts {
            nodes,
            max_unavailable,
            restart,
            settle,
            fail_rate,
            stepguard,
            repo,
            agent_port,
        })?,
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
