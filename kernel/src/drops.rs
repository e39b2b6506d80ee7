//! Kernel drop accounting: loads the agent's passive eBPF program on `skb:kfree_skb` (BTF
//! tracepoint first, tracefs tracepoint as fallback), and reads its per-CPU counters as
//! drops per kernel drop reason, named from the kernel's own BTF or the tracepoint's format.
//! If it cannot load, the reason is kept and the signal is reported as unknown.
use super::btf::Btf;
use agent_common::{globals, programs, DropKey, DROPS_MAP, OFFSET_UNKNOWN};
use anyhow::{anyhow, Context, Result};
use aya::programs::{BtfTracePoint, TracePoint};
use aya::{Ebpf, EbpfLoader};
use std::collections::BTreeMap;
use std::os::fd::AsFd;

static AGENT_EBPF: &[u8] = aya::include_bytes_aligned!(env!("AGENT_EBPF_OBJ"));

const TRACEFS_FORMATS: [&str; 2] = [
    "/sys/kernel/tracing/events/skb/kfree_skb/format",
    "/sys/kernel/debug/tracing/events/skb/kfree_skb/format",
];

/// Kernel drop counters as the agent sees them.
pub enum KernelDrops {
    Active {
        ebpf: Box<Ebpf>,
        attach: &'static str,
        reasons: BTreeMap<u32, String>,
    },
    Unavailable {
        reason: String,
    },
}

/// Offsets and names read from a tracepoint format file.
#[derive(Debug, Default, PartialEq)]
pub struct TpFormat {
    pub skbaddr_offset: Option<u32>,
    pub reason_offset: Option<u32>,
    pub reasons: BTreeMap<u32, String>,
}

/// Parses `events/skb/kfree_skb/format`: field offsets and `__print_symbolic` reason names.
pub fn parse_tp_format(text: &str) -> TpFormat {
    let mut f = TpFormat::default();
    for line in text.lines() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("field:") {
            let decl = rest.split(';').next().unwrap_or("");
            let name = decl
                .split_whitespace()
                .last()
                .unwrap_or("")
                .trim_start_matches('*');
            let offset = rest
                .split(';')
                .find_map(|p| p.trim().strip_prefix("offset:"))
                .and_then(|o| o.parse().ok());
            match name {
                "skbaddr" => f.skbaddr_offset = offset,
                "reason" => f.reason_offset = offset,
                _ => {}
            }
        }
    }
    // print fmt: ... __print_symbolic(REC->reason, { 2, "NOT_SPECIFIED" }, { 3, "NO_SOCKET" }, ...)
    if let Some(start) = text.find("__print_symbolic(REC->reason") {
        let mut rest = &text[start..];
        while let Some(open) = rest.find('{') {
            rest = &rest[open + 1..];
            let Some(close) = rest.find('}') else { break };
            let item = &rest[..close];
            if let Some((num, name)) = item.split_once(',') {
                if let Ok(n) = num.trim().parse::<u32>() {
                    f.reasons
                        .insert(n, name.trim().trim_matches('"').to_string());
                }
            }
            rest = &rest[close + 1..];
        }
    }
    f
}

fn btf_reason_names(btf: &Btf) -> Result<BTreeMap<u32, String>> {
    Ok(btf
        .enum_values("skb_drop_reason")?
        .into_iter()
        .filter(|(v, _)| *v >= 0)
        .map(|(v, n)| {
            (
                v as u32,
                n.trim_start_matches("SKB_DROP_REASON_").to_string(),
            )
        })
        .collect())
}

impl KernelDrops {
    /// Loads and attaches; never fails: a failure becomes `Unavailable` with its reason.
    pub fn start() -> Self {
        match Self::try_start() {
            Ok(d) => d,
            Err(e) => KernelDrops::Unavailable {
                reason: format!("{e:#}"),
            },
        }
    }

    fn try_start() -> Result<Self> {
        if AGENT_EBPF.is_empty() {
            anyhow::bail!("this stepguard was built without its eBPF object (a stub): build it with `cargo xtask build`");
        }
        let vmlinux = std::fs::read("/sys/kernel/btf/vmlinux").ok();
        let own_btf = vmlinux
            .as_deref()
            .map(Btf::parse)
            .transpose()
            .context("parse /sys/kernel/btf/vmlinux")?;
        let tp_format = TRACEFS_FORMATS
            .iter()
            .find_map(|p| std::fs::read_to_string(p).ok())
            .map(|t| parse_tp_format(&t));
        let (skb_dev, dev_ifindex) = match &own_btf {
            Some(b) => (
                b.member_offset("sk_buff", "dev").ok(),
                b.member_offset("net_device", "ifindex").ok(),
            ),
            None => (None, None),
        };
        let reasons = match &own_btf {
            Some(b) => btf_reason_names(b).ok(),
            None => None,
        }
        .or_else(|| {
            tp_format
                .as_ref()
                .map(|f| f.reasons.clone())
                .filter(|r| !r.is_empty())
        })
        .unwrap_or_default();
        let tp = tp_format.as_ref();
        let (skb_dev, dev_ifindex) = (
            skb_dev.unwrap_or(OFFSET_UNKNOWN),
            dev_ifindex.unwrap_or(OFFSET_UNKNOWN),
        );
        let tp_skb = tp.and_then(|f| f.skbaddr_offset).unwrap_or(OFFSET_UNKNOWN);
        let tp_reason = tp.and_then(|f| f.reason_offset).unwrap_or(OFFSET_UNKNOWN);
        let mut ebpf = EbpfLoader::new()
            .override_global(globals::SKB_DEV_OFFSET, &skb_dev, true)
            .override_global(globals::DEV_IFINDEX_OFFSET, &dev_ifindex, true)
            .override_global(globals::TP_SKBADDR_OFFSET, &tp_skb, true)
            .override_global(globals::TP_REASON_OFFSET, &tp_reason, true)
            .load(AGENT_EBPF)
            .context(
                "load the agent's eBPF object (needs CAP_BPF and CAP_PERFMON, or CAP_SYS_ADMIN)",
            )?;

        let btf_err = match aya::Btf::from_sys_fs() {
            Ok(btf) => {
                let r = (|| -> Result<()> {
                    let p: &mut BtfTracePoint = ebpf
                        .program_mut(programs::KFREE_SKB_BTF)
                        .context("program missing")?
                        .try_into()?;
                    p.load("kfree_skb", &btf)?;
                    p.attach()?;
                    Ok(())
                })();
                match r {
                    Ok(()) => {
                        return Ok(KernelDrops::Active {
                            ebpf: Box::new(ebpf),
                            attach: "tp_btf/kfree_skb",
                            reasons,
                        })
                    }
                    Err(e) => format!("tp_btf/kfree_skb: {e:#}"),
                }
            }
            Err(e) => format!("kernel BTF: {e}"),
        };
        if tp_reason == OFFSET_UNKNOWN {
            return Err(anyhow!("{btf_err}; tracepoint skb:kfree_skb: no readable format file (is tracefs mounted?)"));
        }
        let p: &mut TracePoint = ebpf
            .program_mut(programs::KFREE_SKB_TP)
            .context("program missing")?
            .try_into()?;
        p.load()
            .map_err(|e| anyhow!("{btf_err}; load tracepoint skb:kfree_skb: {e}"))?;
        p.attach("skb", "kfree_skb")
            .map_err(|e| anyhow!("{btf_err}; attach tracepoint skb:kfree_skb: {e}"))?;
        Ok(KernelDrops::Active {
            ebpf: Box::new(ebpf),
            attach: "tracepoint/skb/kfree_skb",
            reasons,
        })
    }

    /// Drops per reason name since the program was attached (summed over CPUs and devices).
    pub fn by_reason(&self) -> Result<BTreeMap<String, u64>> {
        let per_key = self.by_key()?;
        let names = match self {
            KernelDrops::Active { reasons, .. } => reasons,
            KernelDrops::Unavailable { .. } => unreachable!("by_key failed"),
        };
        let mut out = BTreeMap::new();
        for (k, v) in per_key {
            let name = names
                .get(&k.reason)
                .cloned()
                .unwrap_or_else(|| format!("reason_{}", k.reason));
            *out.entry(name).or_insert(0) += v;
        }
        Ok(out)
    }

    /// Raw counters per (reason, ifindex).
    pub fn by_key(&self) -> Result<BTreeMap<DropKey, u64>> {
        let ebpf = match self {
            KernelDrops::Active { ebpf, .. } => ebpf,
            KernelDrops::Unavailable { reason } => {
                return Err(anyhow!("kernel drop accounting unavailable: {reason}"))
            }
        };
        let fd = match ebpf
            .map(DROPS_MAP)
            .context("DROPS map missing from the agent's object")?
        {
            aya::maps::Map::PerCpuHashMap(m) => m.fd().as_fd(),
            _ => return Err(anyhow!("DROPS is not a per-CPU hash map")),
        };
        // Read in batches: one key per (reason, device) grows with the node's endpoints
        // (1,000 on a big node), and a step reads this every 100 ms.
        let info = super::bpf::map_info(&fd).context("DROPS map info")?;
        if info.key_size != 8 || info.value_size != 8 {
            return Err(anyhow!(
                "DROPS map layout {}x{} (want 8x8)",
                info.key_size,
                info.value_size
            ));
        }
        let mut out = BTreeMap::new();
        super::bpf::for_each_entry(&fd, &info, info.max_entries as usize, |k, v| {
            let key = DropKey {
                reason: u32::from_ne_bytes(k[0..4].try_into().unwrap_or([0; 4])),
                ifindex: u32::from_ne_bytes(k[4..8].try_into().unwrap_or([0; 4])),
            };
            let n: u64 = v
                .chunks(8)
                .map(|c| u64::from_ne_bytes(c.try_into().unwrap_or([0; 8])))
                .sum();
            *out.entry(key).or_insert(0) += n;
        })
        .context("read DROPS map")?;
        Ok(out)
    }

    pub fn unavailable_reason(&self) -> Option<&str> {
        match self {
            KernelDrops::Unavailable { reason } => Some(reason),
            KernelDrops::Active { .. } => None,
        }
    }

    pub fn attach_point(&self) -> Option<&'static str> {
        match self {
            KernelDrops::Active { attach, .. } => Some(attach),
            KernelDrops::Unavailable { .. } => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FORMAT: &str = r#"name: kfree_skb
ID: 1234
format:
	field:unsigned short common_type;	offset:0;	size:2;	signed:0;
	field:unsigned char common_flags;	offset:2;	size:1;	signed:0;
	field:unsigned char common_preempt_count;	offset:3;	size:1;	signed:0;
	field:int common_pid;	offset:4;	size:4;	signed:1;

	field:void * skbaddr;	offset:8;	size:8;	signed:0;
	field:void * location;	offset:16;	size:8;	signed:0;
	field:unsigned short protocol;	offset:24;	size:2;	signed:0;
	field:enum skb_drop_reason reason;	offset:28;	size:4;	signed:0;

print fmt: "skbaddr=%p protocol=%u location=%pS reason: %s", REC->skbaddr, REC->protocol, REC->location, __print_symbolic(REC->reason, { 2, "NOT_SPECIFIED" }, { 3, "NO_SOCKET" }, { 84, "TC_INGRESS" })
"#;

    #[test]
    fn tracepoint_format_gives_offsets_and_reason_names() {
        let f = parse_tp_format(FORMAT);
        assert_eq!(f.skbaddr_offset, Some(8));
        assert_eq!(f.reason_offset, Some(28));
        assert_eq!(f.reasons.get(&3).map(String::as_str), Some("NO_SOCKET"));
        assert_eq!(f.reasons.get(&84).map(String::as_str), Some("TC_INGRESS"));
        assert_eq!(f.reasons.len(), 3);
    }

    #[test]
    fn a_format_without_reason_yields_nothing_to_attach_with() {
        let f = parse_tp_format("format:\n\tfield:void * skbaddr;\toffset:8;\tsize:8;\n");
        assert_eq!(f.reason_offset, None);
        assert!(f.reasons.is_empty());
    }
}
