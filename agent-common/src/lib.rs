//! Types shared between the agent's userspace and its eBPF programs.
//!
//! Everything here is `#[repr(C)]` plain data: the eBPF side writes it into maps, userspace
//! reads it back through aya. Keep layouts explicit (no implicit padding).
#![no_std]

/// Key of the `DROPS` per-CPU hash map: one counter per kernel drop reason per device.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DropKey {
    /// Value of the kernel's `enum skb_drop_reason`.
    pub reason: u32,
    /// `skb->dev->ifindex` at the time of the drop, 0 when the skb had no device.
    pub ifindex: u32,
}

/// Name of the per-CPU hash map counting drops, in the agent's eBPF object.
pub const DROPS_MAP: &str = "DROPS";
/// Capacity of the drops map: reasons (~120 on 6.x) times devices that actually drop.
pub const DROPS_MAP_ENTRIES: u32 = 8192;

/// Globals the agent patches into the eBPF object before loading (aya `override_global`).
/// Offsets come from the running kernel's BTF (`struct sk_buff`, `struct net_device`) or the
/// tracepoint's format file; `OFFSET_UNKNOWN` switches the corresponding read off.
pub mod globals {
    /// Byte offset of `dev` in `struct sk_buff`.
    pub const SKB_DEV_OFFSET: &str = "SKB_DEV_OFFSET";
    /// Byte offset of `ifindex` in `struct net_device`.
    pub const DEV_IFINDEX_OFFSET: &str = "DEV_IFINDEX_OFFSET";
    /// Byte offset of the `skbaddr` field in the tracefs `skb/kfree_skb` record.
    pub const TP_SKBADDR_OFFSET: &str = "TP_SKBADDR_OFFSET";
    /// Byte offset of the `reason` field in the tracefs `skb/kfree_skb` record.
    pub const TP_REASON_OFFSET: &str = "TP_REASON_OFFSET";
}

/// Marks an offset global the agent could not resolve.
pub const OFFSET_UNKNOWN: u32 = u32::MAX;

/// Program names in the agent's eBPF object.
pub mod programs {
    /// BTF-enabled tracepoint (`tp_btf/kfree_skb`): needs no tracefs.
    pub const KFREE_SKB_BTF: &str = "stepguard_kfree_skb_btf";
    /// Classic tracefs tracepoint (`skb:kfree_skb`): the fallback.
    pub const KFREE_SKB_TP: &str = "stepguard_kfree_skb_tp";
}

#[cfg(feature = "user")]
// SAFETY: DropKey is #[repr(C)], two u32 with no padding, valid for any bit pattern.
unsafe impl aya::Pod for DropKey {}
