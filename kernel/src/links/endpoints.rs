//! Endpoint devices (`lxc*`) and the programs attached to each, queried per device.
use super::*;

/// An endpoint device as the link dump or a notification named it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointLink {
    pub name: String,
    /// IFLA_INFO_KIND (`veth`, `netkit`), when the kernel says.
    pub kind: Option<String>,
}

/// An endpoint's host-side device (`lxc*`: a veth, or netkit in Cilium's netkit datapath
/// mode) and the programs on it.
#[derive(Clone, Debug, Serialize)]
pub struct EndpointDevice {
    pub name: String,
    pub ifindex: u32,
    pub kind: Option<String>,
    pub programs: Vec<AttachedProgram>,
    /// A program was replaced between the query and its lookup (a regeneration in progress):
    /// this endpoint's programs are not a consistent snapshot this time.
    pub raced: bool,
}

/// Where an endpoint's programs are queried, by device kind (docs/cilium-fidelity.md,
/// "Endpoints"): netkit's peer and primary attach types on a netkit device (Cilium attaches
/// `cil_from_container` to the peer, `cil_to_container` to the primary), tcx ingress and
/// egress otherwise (legacy tc filters when tcx has none). `(hook, attach type)`.
pub fn endpoint_hooks(kind: Option<&str>) -> [(&'static str, u32); 2] {
    if kind == Some("netkit") {
        [
            ("netkit_peer", bpf::BPF_NETKIT_PEER),
            ("netkit_primary", bpf::BPF_NETKIT_PRIMARY),
        ]
    } else {
        [
            ("ingress", bpf::BPF_TCX_INGRESS),
            ("egress", bpf::BPF_TCX_EGRESS),
        ]
    }
}

/// Endpoint devices are never host devices and are not inspected one by one.
pub fn is_endpoint_device(name: &str) -> bool {
    name.starts_with("lxc")
}

/// Which endpoint devices an observation queries (two program queries each: with 1,000
/// endpoints the largest part of an observation's kernel time).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum EndpointScan {
    /// Every endpoint device.
    #[default]
    All,
    /// Only these (by device name); the others are left out of the observation.
    Only(BTreeSet<String>),
}

impl EndpointScan {
    fn wants(&self, name: &str) -> bool {
        match self {
            EndpointScan::All => true,
            EndpointScan::Only(set) => set.contains(name),
        }
    }
}

/// The endpoint devices `scan` selects, with their programs, into `obs` (once per
/// observation).
pub(super) async fn scan_endpoints(
    handle: &rtnetlink::Handle,
    t: &Topology,
    obs: &mut Observation,
    names: &mut ProgNames,
    scan: &EndpointScan,
) {
    for (ifindex, link) in &t.endpoints {
        if !scan.wants(&link.name) {
            continue;
        }
        if let Some(ep) = endpoint_programs(handle, *ifindex, link, obs, names).await {
            obs.endpoints.push(ep);
        }
    }
    // Forget replaced programs only after a look at every endpoint (a partial scan would
    // forget the others' and look them up again).
    if *scan == EndpointScan::All {
        names.prune();
    }
}

/// At most this many endpoint problems are kept (a node has thousands of endpoints).
pub(super) const ENDPOINT_PROBLEMS_MAX: usize = 5;

/// The programs `query` (BPF_PROG_QUERY on the device's ifindex, by attach type) finds on
/// one endpoint device at its hooks ([`endpoint_hooks`]); None when the device went away
/// since it was listed (ENODEV: a pod deleted). Problems are one line each.
pub fn query_endpoint(
    link: &EndpointLink,
    mut query: impl FnMut(u32) -> std::io::Result<Vec<u32>>,
    problems: &mut Vec<String>,
) -> Option<Vec<AttachedProgram>> {
    let netkit = link.kind.as_deref() == Some("netkit");
    let via = if netkit { "netkit" } else { "tcx" };
    let mut programs = Vec::new();
    for (hook, at) in endpoint_hooks(link.kind.as_deref()) {
        match query(at) {
            Ok(ids) => programs.extend(ids.into_iter().map(|id| AttachedProgram {
                hook,
                via,
                prog_id: id,
                name: None,
                filter: None,
                loaded_at: None,
                link_pin: None,
            })),
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => return None,
            // Not on this kernel (no tcx, no netkit): nothing attached that way.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINVAL) | Some(libc::EOPNOTSUPP)
                ) => {}
            Err(e) => problems.push(format!(
                "{via} query on endpoint {} {hook}: {}",
                link.name,
                super::super::io_reason("bpf prog query", &e).0
            )),
        }
    }
    Some(programs)
}

/// One endpoint device's programs with their names; None when the device went away.
pub(super) async fn endpoint_programs(
    handle: &rtnetlink::Handle,
    ifindex: u32,
    link: &EndpointLink,
    obs: &mut Observation,
    names: &mut ProgNames,
) -> Option<EndpointDevice> {
    let mut problems = Vec::new();
    let mut programs = query_endpoint(link, |at| bpf::tcx_prog_ids(ifindex, at), &mut problems)?;
    // Cilium on tcx removes an endpoint's legacy filters: only a veth endpoint without tcx
    // programs is dumped for them (a netlink dump per hook per endpoint otherwise).
    if link.kind.as_deref() != Some("netkit") && programs.is_empty() {
        for hook in ["ingress", "egress"] {
            match tc_filters(handle, ifindex, hook).await {
                Ok(Some(mut p)) => programs.append(&mut p),
                // Deleted since it was listed (a pod deleted): gone, not a problem.
                Ok(None) => return None,
                Err(e) => problems.push(format!(
                    "tc filter dump on endpoint {} {hook}: {e}",
                    link.name
                )),
            }
        }
    }
    let mut scratch = Observation::default();
    let raced = fill_program_details(&link.name, &mut programs, &mut scratch, |id| {
        names.lookup(id)
    });
    problems.extend(scratch.problems);
    // An endpoint read only in part is not a consistent snapshot either: judged next time.
    let raced = raced || !problems.is_empty();
    for line in problems {
        if obs.endpoint_problems.len() < ENDPOINT_PROBLEMS_MAX {
            obs.endpoint_problems.push(line);
        }
    }
    Some(EndpointDevice {
        name: link.name.clone(),
        ifindex,
        kind: link.kind.clone(),
        programs,
        raced,
    })
}
