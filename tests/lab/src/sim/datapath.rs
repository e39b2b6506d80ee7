//! The fake Cilium datapath: loads the lab's eBPF object once per device (so every device has
//! its own program IDs, as Cilium's per-device compiled objects do), attaches the programs where
//! Cilium attaches them, and replaces them atomically on a simulated restart.
use crate::sys;
use crate::sys::netns::in_netns;
use anyhow::{bail, Context, Result};
use aya::programs::links::{FdLink, LinkOrder};
use aya::programs::tc::{self, TcAttachOptions};
use aya::programs::{SchedClassifier, TcAttachType, Xdp, XdpMode};
use aya::{Ebpf, EbpfLoader};
use serde::{Deserialize, Serialize};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

/// The lab's eBPF object, built by `cargo xtask build`.
static LAB_EBPF: &[u8] = aya::include_bytes_aligned!(env!("LAB_EBPF_OBJ"));

/// How Cilium attaches its tc programs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttachMode {
    /// bpf_link on tcx (kernel >= 6.6, Cilium >= 1.16 with enable-tcx), links pinned in bpffs.
    Tcx,
    /// Legacy clsact qdisc with direct-action filters `<prog>-<dev>`, handle 1.
    Tc,
}

impl std::str::FromStr for AttachMode {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "tcx" => Ok(Self::Tcx),
            "tc" => Ok(Self::Tc),
            _ => bail!("unknown attach mode {s:?}: expected tcx or tc"),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Hook {
    Ingress,
    Egress,
    Xdp,
}

/// One program on one device, as the lab attached it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Attachment {
    pub device: String,
    pub program: String,
    pub hook: Hook,
    /// Endpoint id for lxc devices (their tcx links live under `cilium/endpoints/<id>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<u16>,
    /// `tcx`, `tc` or `xdp` (XDP always uses a bpf_link).
    pub via: String,
    pub prog_id: u32,
    /// Pinned bpf_link (tcx and XDP).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_pin: Option<PathBuf>,
}

impl Attachment {
    pub fn tc_filter_name(&self) -> String {
        format!("{}-{}", self.program, self.device)
    }
}

/// What goes where: `(device, program, hook, endpoint id)`.
pub type Plan = Vec<(String, &'static str, Hook, Option<u16>)>;

/// Where Cilium attaches what, for one lab (docs/cilium-fidelity.md, "Devices").
#[derive(Clone, Copy, Debug)]
pub struct PlanOpts {
    /// `cil_xdp_entry` on the host devices (XDP acceleration).
    pub xdp: bool,
    /// `cil_to_netdev` on the host devices: only when devices are required (`AreDevicesRequired`:
    /// NodePort/KPR, L2 announcements, ...).
    pub to_netdev: bool,
    /// `cilium_host`/`cilium_net`, and the overlay device when tunnelling.
    pub host: bool,
    pub overlay: Option<&'static str>,
}

/// The attachments for host devices, endpoints and (with `host`) Cilium's own devices.
pub fn plan(host_devices: &[String], lxc: &[(String, u16)], o: PlanOpts) -> Plan {
    let mut p: Plan = Vec::new();
    for d in host_devices {
        p.push((d.clone(), "cil_from_netdev", Hook::Ingress, None));
        if o.to_netdev {
            p.push((d.clone(), "cil_to_netdev", Hook::Egress, None));
        }
        if o.xdp {
            p.push((d.clone(), "cil_xdp_entry", Hook::Xdp, None));
        }
    }
    if o.host {
        p.push(("cilium_host".into(), "cil_to_host", Hook::Ingress, None));
        p.push(("cilium_host".into(), "cil_from_host", Hook::Egress, None));
        p.push(("cilium_net".into(), "cil_to_host", Hook::Ingress, None));
        if let Some(dev) = o.overlay {
            p.push((dev.into(), "cil_from_overlay", Hook::Ingress, None));
            p.push((dev.into(), "cil_to_overlay", Hook::Egress, None));
        }
    }
    for (dev, ep) in lxc {
        p.push((dev.clone(), "cil_from_container", Hook::Ingress, Some(*ep)));
    }
    p
}

pub fn blackhole_pin(bpffs: &Path) -> PathBuf {
    bpffs.join("stepguard-lab/blackhole")
}

/// Fails with one line when this binary was built without the lab's eBPF object (a stub).
pub fn require_object() -> Result<()> {
    if LAB_EBPF.is_empty() {
        anyhow::bail!("this stepguard-lab was built without the lab's eBPF object: run `cargo xtask build` (it builds the eBPF crates with Debian's rustc-web)");
    }
    Ok(())
}

fn load_object(bpffs: &Path) -> Result<Ebpf> {
    require_object()?;
    let metrics = bpffs.join("tc/globals/cilium_metrics");
    let blackhole = blackhole_pin(bpffs);
    EbpfLoader::new()
        .map_pin_path("cilium_metrics", metrics.as_path())
        .map_pin_path("LAB_BLACKHOLE", blackhole.as_path())
        .load(LAB_EBPF)
        .context("load the lab's eBPF object")
}

fn link_pin_path(bpffs: &Path, device: &str, program: &str, endpoint: Option<u16>) -> PathBuf {
    match endpoint {
        Some(ep) => bpffs.join(format!("cilium/endpoints/{ep}/links/{program}")),
        None => bpffs.join(format!(
            "cilium/devices/{}/links/{program}",
            device.replace('.', "-")
        )),
    }
}

fn tc_attach_type(h: Hook) -> TcAttachType {
    if h == Hook::Egress {
        TcAttachType::Egress
    } else {
        TcAttachType::Ingress
    }
}

/// A loaded (not yet attached) program instance for one plan entry.
struct Loaded {
    obj: Ebpf,
    entry: (String, &'static str, Hook, Option<u16>),
}

impl Loaded {
    fn prog_fd(&self) -> Result<std::os::fd::BorrowedFd<'_>> {
        let p = self
            .obj
            .program(self.entry.1)
            .context("program missing from object")?;
        Ok(p.fd().context("program fd")?.as_fd())
    }
}

fn load_entry(bpffs: &Path, entry: &(String, &'static str, Hook, Option<u16>)) -> Result<Loaded> {
    let mut obj = load_object(bpffs)?;
    let name = entry.1;
    let prog = obj
        .program_mut(name)
        .with_context(|| format!("program {name} in lab object"))?;
    match entry.2 {
        Hook::Xdp => {
            let p: &mut Xdp = prog.try_into()?;
            p.load().with_context(|| format!("load {name}"))?;
        }
        _ => {
            let p: &mut SchedClassifier = prog.try_into()?;
            p.load().with_context(|| format!("load {name}"))?;
        }
    }
    Ok(Loaded {
        obj,
        entry: entry.clone(),
    })
}

/// Attaches one freshly loaded instance per plan entry; returns what was attached.
pub fn attach_all(
    ns: &str,
    bpffs: &Path,
    mode: AttachMode,
    plan: &Plan,
) -> Result<Vec<Attachment>> {
    attach_all_xdp(ns, bpffs, mode, plan, false)
}

/// [`attach_all`], with `xdp_best_effort` as Cilium's `bpf-lb-acceleration: best-effort`: a
/// device whose driver refuses XDP is skipped (`reinitializeXDPLocked`,
/// `pkg/datapath/loader/base.go`: "Failed to attach XDP program, ignoring due to best-effort
/// mode"); otherwise its refusal fails the whole attach, as `native` fails the agent.
pub fn attach_all_xdp(
    ns: &str,
    bpffs: &Path,
    mode: AttachMode,
    plan: &Plan,
    xdp_best_effort: bool,
) -> Result<Vec<Attachment>> {
    let bpffs_owned = bpffs.to_path_buf();
    let plan_owned = plan.clone();
    let atts = in_netns(ns, move || {
        let bpffs = bpffs_owned.as_path();
        let mut atts = Vec::new();
        let mut qdisc_done = std::collections::BTreeSet::new();
        for entry in &plan_owned {
            let mut l = load_entry(bpffs, entry)?;
            let (dev, name, hook, ep) = entry.clone();
            let prog = l.obj.program_mut(name).context("program")?;
            let prog_id = prog.info()?.id();
            let (via, link_pin) = match (hook, mode) {
                (Hook::Xdp, _) => {
                    let p: &mut Xdp = prog.try_into()?;
                    let id = match p.attach(&dev, XdpMode::Default) {
                        Ok(id) => id,
                        Err(e) if xdp_best_effort => {
                            eprintln!("lab agent: failed to attach {name} (XDP) to {dev}, ignoring due to best-effort mode: {e}");
                            continue;
                        }
                        Err(e) => {
                            return Err(e).with_context(|| format!("attach {name} (XDP) to {dev}"))
                        }
                    };
                    let link =
                        FdLink::try_from(p.take_link(id)?).context("XDP link is not a bpf_link")?;
                    let pin = link_pin_path(bpffs, &dev, name, ep);
                    std::fs::create_dir_all(pin.parent().unwrap())?;
                    link.pin(&pin)
                        .with_context(|| format!("pin link {}", pin.display()))?;
                    ("xdp", Some(pin))
                }
                (_, AttachMode::Tcx) => {
                    let p: &mut SchedClassifier = prog.try_into()?;
                    let id = p
                        .attach_with_options(
                            &dev,
                            tc_attach_type(hook),
                            TcAttachOptions::TcxOrder(LinkOrder::last()),
                        )
                        .with_context(|| format!("attach {name} (tcx) to {dev}"))?;
                    let link =
                        FdLink::try_from(p.take_link(id)?).context("tcx link is not a bpf_link")?;
                    let pin = link_pin_path(bpffs, &dev, name, ep);
                    std::fs::create_dir_all(pin.parent().unwrap())?;
                    link.pin(&pin)
                        .with_context(|| format!("pin link {}", pin.display()))?;
                    ("tcx", Some(pin))
                }
                (_, AttachMode::Tc) => {
                    if qdisc_done.insert(dev.clone()) {
                        if let Err(e) = tc::qdisc_add_clsact(&dev) {
                            if !e.to_string().contains("exists") {
                                return Err(anyhow::anyhow!("add clsact qdisc on {dev}: {e}"));
                            }
                        }
                    }
                    let fd = prog.fd()?.as_fd();
                    tc_set(&dev, hook, Some((&fd, &format!("{name}-{dev}"))))?;
                    ("tc", None)
                }
            };
            atts.push(Attachment {
                device: dev,
                program: name.into(),
                hook,
                endpoint: ep,
                via: via.into(),
                prog_id,
                link_pin,
            });
            drop(l);
        }
        Ok(atts)
    })?;
    Ok(atts)
}

/// Adds/replaces or deletes the legacy tc filter of `hook` on `dev` (current thread's netns).
fn tc_set(dev: &str, hook: Hook, prog: Option<(&dyn std::os::fd::AsRawFd, &str)>) -> Result<()> {
    let c = std::ffi::CString::new(dev)?;
    // SAFETY: if_nametoindex reads a NUL-terminated string.
    let idx = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if idx == 0 {
        bail!("no device {dev}");
    }
    let what = if prog.is_some() { "replace" } else { "delete" };
    sys::tc::tc_filter(idx, hook == Hook::Egress, prog)
        .with_context(|| format!("{what} tc filter on {dev} {hook:?}"))
}

/// New program instances, loaded ahead of a restart so the swap itself is quick.
pub struct Prepared {
    loaded: Vec<Loaded>,
}

/// Loads a new instance of every attached program `keep` does not hold back.
pub fn prepare(
    ns: &str,
    bpffs: &Path,
    atts: &[Attachment],
    keep: impl Fn(&Attachment) -> bool,
) -> Result<Prepared> {
    let bpffs = bpffs.to_path_buf();
    let entries: Vec<_> = atts
        .iter()
        .filter(|a| !keep(a))
        .map(|a| {
            Ok((
                a.device.clone(),
                program_static(&a.program)?,
                a.hook,
                a.endpoint,
            ))
        })
        .collect::<Result<_>>()?;
    let _ = ns;
    let loaded = entries
        .iter()
        .map(|e| load_entry(&bpffs, e))
        .collect::<Result<Vec<_>>>()?;
    Ok(Prepared { loaded })
}

fn program_static(name: &str) -> Result<&'static str> {
    const ALL: [&str; 8] = [
        "cil_from_netdev",
        "cil_from_overlay",
        "cil_to_overlay",
        "cil_to_netdev",
        "cil_to_host",
        "cil_from_host",
        "cil_from_container",
        "cil_xdp_entry",
    ];
    ALL.iter()
        .copied()
        .find(|p| *p == name)
        .with_context(|| format!("unknown lab program {name}"))
}

/// Swaps every prepared program in (tcx/XDP: BPF_LINK_UPDATE on the pinned link; tc: filter
/// replace at the same handle and priority), and detaches everything on `drop_device`.
/// Returns the attachments as they are afterwards (those not prepared keep their old program).
pub fn replace(
    ns: &str,
    atts: &[Attachment],
    prepared: Prepared,
    drop_device: Option<&str>,
) -> Result<Vec<Attachment>> {
    let atts = atts.to_vec();
    let drop_device = drop_device.map(str::to_string);
    in_netns(ns, move || {
        let mut out = Vec::new();
        for l in &prepared.loaded {
            let (dev, name, hook, _) = &l.entry;
            let old = atts
                .iter()
                .find(|a| &a.device == dev && a.program == *name && a.hook == *hook)
                .context("prepared program has no attachment")?;
            let prog_fd = l.prog_fd()?;
            let new_id = sys::bpf::obj_id(&prog_fd)?;
            match &old.link_pin {
                Some(pin) => {
                    let link = sys::bpf::obj_get(pin)
                        .with_context(|| format!("open pinned link {}", pin.display()))?;
                    sys::bpf::link_update(&link, &prog_fd)
                        .with_context(|| format!("update link {}", pin.display()))?;
                }
                None => tc_set(dev, *hook, Some((&prog_fd, &old.tc_filter_name())))?,
            }
            out.push(Attachment {
                prog_id: new_id,
                ..old.clone()
            });
        }
        for a in &atts {
            let replaced = prepared
                .loaded
                .iter()
                .any(|l| l.entry.0 == a.device && l.entry.1 == a.program && l.entry.2 == a.hook);
            if !replaced && drop_device.as_deref() != Some(a.device.as_str()) {
                out.push(a.clone());
            }
        }
        if let Some(drop) = &drop_device {
            let gone: Vec<&Attachment> = atts.iter().filter(|a| &a.device == drop).collect();
            detach_here(&gone)?;
        }
        drop(prepared);
        Ok(out)
    })
}

/// Swaps one new instance of a program into every attachment `which` selects (all of one
/// program and hook: a batch of endpoints regenerated at once). Each endpoint gets a program
/// id other than its old one; the batch shares it (Cilium compiles one per endpoint: the lab
/// loads one object per batch, which makes regenerating 1,000 endpoints take well under a
/// second instead of ~16 s). Returns the attachments as they are afterwards.
pub fn replace_shared(
    ns: &str,
    bpffs: &Path,
    atts: &[Attachment],
    which: impl Fn(&Attachment) -> bool,
) -> Result<Vec<Attachment>> {
    let chosen: Vec<usize> = (0..atts.len()).filter(|i| which(&atts[*i])).collect();
    let Some(first) = chosen.first().map(|i| &atts[*i]) else {
        return Ok(atts.to_vec());
    };
    if chosen
        .iter()
        .any(|i| atts[*i].program != first.program || atts[*i].hook != first.hook)
    {
        bail!("a shared replacement must be of one program and hook");
    }
    let loaded = load_entry(
        bpffs,
        &(
            first.device.clone(),
            program_static(&first.program)?,
            first.hook,
            first.endpoint,
        ),
    )?;
    let atts = atts.to_vec();
    in_netns(ns, move || {
        let prog_fd = loaded.prog_fd()?;
        let new_id = sys::bpf::obj_id(&prog_fd)?;
        let mut out = atts.clone();
        for i in &chosen {
            let old = &atts[*i];
            match &old.link_pin {
                Some(pin) => {
                    let link = sys::bpf::obj_get(pin)
                        .with_context(|| format!("open pinned link {}", pin.display()))?;
                    sys::bpf::link_update(&link, &prog_fd)
                        .with_context(|| format!("update link {}", pin.display()))?;
                }
                None => tc_set(
                    &old.device,
                    old.hook,
                    Some((&prog_fd, &old.tc_filter_name())),
                )?,
            }
            out[*i].prog_id = new_id;
        }
        drop(loaded);
        Ok(out)
    })
}

/// Detaches these attachments, in the calling thread's network namespace.
fn detach_here(atts: &[&Attachment]) -> Result<()> {
    for a in atts {
        match &a.link_pin {
            // Only the pin holds the link: removing it detaches the program.
            Some(pin) => {
                std::fs::remove_file(pin).with_context(|| format!("unpin {}", pin.display()))?
            }
            None => tc_set(&a.device, a.hook, None)?,
        }
    }
    Ok(())
}

/// Detaches these attachments in namespace `ns`.
pub fn detach(ns: &str, atts: &[Attachment]) -> Result<()> {
    if atts.is_empty() {
        return Ok(());
    }
    let atts = atts.to_vec();
    in_netns(ns, move || detach_here(&atts.iter().collect::<Vec<_>>()))
}

/// Sets or clears the lab's blackhole flag.
pub fn set_blackhole(bpffs: &Path, on: bool) -> Result<()> {
    let pin = blackhole_pin(bpffs);
    let fd =
        sys::bpf::obj_get(&pin).with_context(|| format!("open blackhole map {}", pin.display()))?;
    sys::bpf::map_update(&fd, &0u32.to_ne_bytes(), &(on as u32).to_ne_bytes())
        .context("write blackhole flag")
}
