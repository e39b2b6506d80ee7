//! The programs on host devices: tcx links, tc filters, XDP, with their details from bpf(2).
use super::*;

/// How many times an observation is retaken when a reload races it.
pub(super) const RACE_RETRIES: usize = 5;

/// Fills name and load time of every program on `d` from `lookup` (by id). A program that no
/// longer exists (ENOENT: replaced since the query, as during every Cilium restart) is not a
/// permission problem: returns true (raced) so the caller observes again. Any other error
/// makes the details unreadable, named in `obs.problems`.
pub fn fill_details(
    d: &mut Device,
    obs: &mut Observation,
    lookup: impl FnMut(u32) -> std::io::Result<bpf::ProgInfo>,
) -> bool {
    fill_program_details(&d.name, &mut d.programs, obs, lookup)
}

pub(super) fn fill_program_details(
    device: &str,
    programs: &mut [AttachedProgram],
    obs: &mut Observation,
    mut lookup: impl FnMut(u32) -> std::io::Result<bpf::ProgInfo>,
) -> bool {
    let mut raced = false;
    for p in programs {
        match lookup(p.prog_id) {
            Ok(info) => {
                p.name = Some(info.name.clone());
                p.loaded_at = info
                    .loaded_at()
                    .duration_since(std::time::UNIX_EPOCH)
                    .ok()
                    .map(|d| d.as_secs_f64());
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => raced = true,
            Err(e) => {
                obs.prog_details_unreadable = true;
                let (line, _) =
                    super::super::io_reason(&format!("program {} on {device}", p.prog_id), &e);
                if !obs.problems.contains(&line) {
                    obs.problems.push(line);
                }
            }
        }
    }
    raced
}

/// The observation from a topology: each host device's tc/tcx programs queried now.
pub(super) async fn programs(
    handle: &rtnetlink::Handle,
    bpffs: &Path,
    t: &Topology,
    names: &mut ProgNames,
) -> Result<Observation, LinkError> {
    let mut obs = Observation {
        endpoint_devices: t.endpoints.len(),
        ..Default::default()
    };
    let mut devices = t.devices.clone();
    let pins = pinned_tcx_links(bpffs, &mut obs.link_pin_problems);
    for d in &mut devices {
        for (hook, at) in [
            ("ingress", bpf::BPF_TCX_INGRESS),
            ("egress", bpf::BPF_TCX_EGRESS),
        ] {
            match bpf::tcx_prog_ids(d.ifindex, at) {
                Ok(ids) => {
                    for id in ids {
                        d.programs.push(AttachedProgram {
                            hook,
                            via: "tcx",
                            prog_id: id,
                            name: None,
                            filter: None,
                            loaded_at: None,
                            link_pin: pins.get(&id).cloned(),
                        });
                    }
                }
                // No tcx on this kernel: nothing attached that way.
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINVAL) | Some(libc::EOPNOTSUPP)
                    ) => {}
                Err(e) => obs.problems.push(format!(
                    "tcx query on {} {hook}: {}",
                    d.name,
                    super::super::io_reason("bpf prog query", &e).0
                )),
            }
        }
        for hook in ["ingress", "egress"] {
            match tc_filters(handle, d.ifindex, hook).await {
                Ok(Some(mut p)) => d.programs.append(&mut p),
                Ok(None) => obs.problems.push(format!(
                    "tc filter dump on {} {hook}: the device went away",
                    d.name
                )),
                Err(e) => obs
                    .problems
                    .push(format!("tc filter dump on {} {hook}: {e}", d.name)),
            }
        }
        if fill_details(d, &mut obs, |id| names.lookup(id)) {
            obs.raced = true;
        }
    }
    obs.devices = devices;
    Ok(obs)
}

/// The legacy clsact filters of one hook: (name, program id) each. No qdisc: none; the
/// device gone (ENODEV): None.
pub(super) async fn tc_filters(
    handle: &rtnetlink::Handle,
    ifindex: u32,
    hook: &'static str,
) -> Result<Option<Vec<AttachedProgram>>, String> {
    let req = handle.traffic_filter(ifindex as i32).get();
    let req = if hook == "ingress" {
        req.ingress()
    } else {
        req.egress()
    };
    let mut stream = req.execute();
    let mut out = Vec::new();
    loop {
        match stream.try_next().await {
            Ok(Some(msg)) => {
                let (mut name, mut id) = (None, None);
                for a in &msg.attributes {
                    if let TcAttribute::Options(opts) = a {
                        for o in opts {
                            match o {
                                TcOption::Bpf(TcFilterBpfOption::ProgName(n)) => {
                                    name = Some(n.clone())
                                }
                                TcOption::Bpf(TcFilterBpfOption::ProgId(i)) => id = Some(*i),
                                _ => {}
                            }
                        }
                    }
                }
                if let Some(id) = id {
                    out.push(AttachedProgram {
                        hook,
                        via: "tc",
                        prog_id: id,
                        name: None,
                        filter: name,
                        loaded_at: None,
                        link_pin: None,
                    });
                }
            }
            Ok(None) => return Ok(Some(out)),
            // No clsact qdisc on this device: no filters.
            Err(rtnetlink::Error::NetlinkError(e))
                if matches!(e.raw_code().abs(), libc::EINVAL | libc::ENOENT) =>
            {
                return Ok(Some(out))
            }
            Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code().abs() == libc::ENODEV => {
                return Ok(None)
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// Cilium's pinned tcx links (`<bpffs>/cilium/devices/<dev>/links/<prog>`), by program id.
pub(super) fn pinned_tcx_links(bpffs: &Path, problems: &mut Vec<String>) -> BTreeMap<u32, PathBuf> {
    let mut out = BTreeMap::new();
    let Ok(devs) = std::fs::read_dir(bpffs.join("cilium/devices")) else {
        return out;
    };
    for dev in devs.flatten() {
        let Ok(links) = std::fs::read_dir(dev.path().join("links")) else {
            continue;
        };
        for l in links.flatten() {
            let path = l.path();
            match bpf::obj_get_link(&path).and_then(|fd| bpf::link_info(&fd)) {
                Ok(info) => {
                    out.insert(info.prog_id, path);
                }
                // Unpinned since the directory was read (a reload): nothing to report.
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => problems.push(format!("open pinned link {}: {e}", path.display())),
            }
        }
    }
    out
}
