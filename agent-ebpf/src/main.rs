//! stepguard's own kernel-side program: counts kernel packet drops per drop reason and device.
//!
//! Passive by construction: it only reads the tracepoint's arguments and updates its own map.
#![no_std]
#![no_main]

use agent_common::{DropKey, DROPS_MAP_ENTRIES, OFFSET_UNKNOWN};
use aya_ebpf::{
    helpers::bpf_probe_read_kernel,
    macros::{btf_tracepoint, map, tracepoint},
    maps::PerCpuHashMap,
    programs::{BtfTracePointContext, TracePointContext},
};

#[map(name = "DROPS")]
static DROPS: PerCpuHashMap<DropKey, u64> = PerCpuHashMap::with_max_entries(DROPS_MAP_ENTRIES, 0);

// Patched by the agent before load (see agent_common::globals). Read volatile so the compiler
// cannot fold the defaults in.
#[no_mangle]
static SKB_DEV_OFFSET: u32 = OFFSET_UNKNOWN;
#[no_mangle]
static DEV_IFINDEX_OFFSET: u32 = OFFSET_UNKNOWN;
#[no_mangle]
static TP_SKBADDR_OFFSET: u32 = OFFSET_UNKNOWN;
#[no_mangle]
static TP_REASON_OFFSET: u32 = OFFSET_UNKNOWN;

#[inline(always)]
fn global(v: &u32) -> u32 {
    unsafe { core::ptr::read_volatile(v) }
}

/// `skb->dev->ifindex`, or 0 when the offsets are unknown or the skb has no device.
#[inline(always)]
fn skb_ifindex(skb: *const u8) -> u32 {
    let dev_off = global(&SKB_DEV_OFFSET);
    let idx_off = global(&DEV_IFINDEX_OFFSET);
    if skb.is_null() || dev_off == OFFSET_UNKNOWN || idx_off == OFFSET_UNKNOWN {
        return 0;
    }
    let dev: *const u8 =
        match unsafe { bpf_probe_read_kernel(skb.wrapping_add(dev_off as usize) as *const *const u8) } {
            Ok(d) => d,
            Err(_) => return 0,
        };
    if dev.is_null() {
        return 0;
    }
    unsafe { bpf_probe_read_kernel(dev.wrapping_add(idx_off as usize) as *const i32) }
        .map(|i| i as u32)
        .unwrap_or(0)
}

#[inline(always)]
fn count(reason: u32, ifindex: u32) {
    let key = DropKey { reason, ifindex };
    if let Some(v) = DROPS.get_ptr_mut(&key) {
        unsafe { *v += 1 };
    } else {
        let _ = DROPS.insert(&key, &1, 0);
    }
}

/// tp_btf/kfree_skb: (struct sk_buff *skb, void *location, enum skb_drop_reason reason, ...).
#[btf_tracepoint(function = "kfree_skb")]
pub fn stepguard_kfree_skb_btf(ctx: BtfTracePointContext) -> i32 {
    let skb: *const u8 = ctx.arg(0);
    let reason: u32 = ctx.arg::<u64>(2) as u32;
    count(reason, skb_ifindex(skb));
    0
}

/// tracefs skb:kfree_skb, field offsets read by the agent from the event's format file.
#[tracepoint(category = "skb", name = "kfree_skb")]
pub fn stepguard_kfree_skb_tp(ctx: TracePointContext) -> i32 {
    let reason_off = global(&TP_REASON_OFFSET);
    if reason_off == OFFSET_UNKNOWN {
        return 0;
    }
    let reason: u32 = match unsafe { ctx.read_at::<u32>(reason_off as usize) } {
        Ok(r) => r,
        Err(_) => return 0,
    };
    let skb_off = global(&TP_SKBADDR_OFFSET);
    let skb: *const u8 = if skb_off == OFFSET_UNKNOWN {
        core::ptr::null()
    } else {
        unsafe { ctx.read_at::<u64>(skb_off as usize) }.unwrap_or(0) as *const u8
    };
    count(reason, skb_ifindex(skb));
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[link_section = "license"]
#[no_mangle]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
