//! The lab's fake Cilium datapath. Each program carries the name Cilium gives it, passes every
//! packet, and while the lab's blackhole flag is set drops it instead and counts the drop in
//! `cilium_metrics` with Cilium's own key layout under reason 202 ("host datapath not ready"),
//! the way a real node looks while its cilium-agent restarts.
#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::{xdp_action, TC_ACT_OK, TC_ACT_SHOT},
    macros::{classifier, map, xdp},
    maps::{Array, PerCpuHashMap},
    programs::{TcContext, XdpContext},
};

/// `struct metrics_key` of Cilium ≥ 1.16 (bpf/lib/common.h): 8 bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct MetricsKey {
    reason: u8,
    dir: u8,
    line: u16,
    file: u8,
    reserved: [u8; 3],
}

/// `struct metrics_value`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct MetricsValue {
    count: u64,
    bytes: u64,
}

const DROP_HOST_NOT_READY: u8 = 202;
const METRIC_INGRESS: u8 = 1;
const METRIC_EGRESS: u8 = 2;
/// Made-up source file id for the lab (Cilium numbers its bpf/*.c files from 1).
const LAB_FILE_ID: u8 = 99;

#[map(name = "cilium_metrics")]
static CILIUM_METRICS: PerCpuHashMap<MetricsKey, MetricsValue> =
    PerCpuHashMap::with_max_entries(1024, 0);

/// Index 0: non-zero while the lab blackholes the datapath. The lab's own map, never Cilium's.
#[map(name = "LAB_BLACKHOLE")]
static LAB_BLACKHOLE: Array<u32> = Array::with_max_entries(1, 0);

#[inline(always)]
fn blackholed() -> bool {
    matches!(LAB_BLACKHOLE.get(0), Some(v) if *v != 0)
}

#[inline(always)]
fn count_drop(dir: u8, line: u16, bytes: u64) {
    let key = MetricsKey {
        reason: DROP_HOST_NOT_READY,
        dir,
        line,
        file: LAB_FILE_ID,
        reserved: [0; 3],
    };
    if let Some(v) = CILIUM_METRICS.get_ptr_mut(&key) {
        unsafe {
            (*v).count += 1;
            (*v).bytes += bytes;
        }
    } else {
        let _ = CILIUM_METRICS.insert(&key, &MetricsValue { count: 1, bytes }, 0);
    }
}

#[inline(always)]
fn tc_verdict(ctx: &TcContext, dir: u8, line: u16) -> i32 {
    if blackholed() {
        count_drop(dir, line, ctx.len() as u64);
        TC_ACT_SHOT
    } else {
        TC_ACT_OK
    }
}

#[classifier]
pub fn cil_from_netdev(ctx: TcContext) -> i32 {
    tc_verdict(&ctx, METRIC_INGRESS, line!() as u16)
}

#[classifier]
pub fn cil_to_netdev(ctx: TcContext) -> i32 {
    tc_verdict(&ctx, METRIC_EGRESS, line!() as u16)
}

#[classifier]
pub fn cil_to_host(ctx: TcContext) -> i32 {
    tc_verdict(&ctx, METRIC_INGRESS, line!() as u16)
}

#[classifier]
pub fn cil_from_host(ctx: TcContext) -> i32 {
    tc_verdict(&ctx, METRIC_EGRESS, line!() as u16)
}

#[classifier]
pub fn cil_from_container(ctx: TcContext) -> i32 {
    tc_verdict(&ctx, METRIC_INGRESS, line!() as u16)
}

#[classifier]
pub fn cil_from_overlay(ctx: TcContext) -> i32 {
    tc_verdict(&ctx, METRIC_INGRESS, line!() as u16)
}

#[classifier]
pub fn cil_to_overlay(ctx: TcContext) -> i32 {
    tc_verdict(&ctx, METRIC_EGRESS, line!() as u16)
}

#[xdp]
pub fn cil_xdp_entry(ctx: XdpContext) -> u32 {
    if blackholed() {
        count_drop(METRIC_INGRESS, line!() as u16, (ctx.data_end() - ctx.data()) as u64);
        xdp_action::XDP_DROP
    } else {
        xdp_action::XDP_PASS
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[link_section = "license"]
#[no_mangle]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
