//! `status`: the lab to act on, and how a lab is shown.
use anyhow::{bail, Result};
use stepguard_lab::Lab;

/// The lab to act on: the given prefix, or the only one there is.
pub fn pick(prefix: Option<String>) -> Result<Lab> {
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

pub fn print_status(lab: &Lab) {
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
