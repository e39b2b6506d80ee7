//! Read-only bpf(2) access: open pinned objects with BPF_F_RDONLY, read program/map/link info,
//! query tcx attachments, and count map entries cheaply (batched lookups). Nothing here writes
//! to a map, link or program: the agent never changes Cilium's datapath.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::time::{Duration, SystemTime};

const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_PROG_GET_NEXT_ID: libc::c_long = 11;
const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_PROG_QUERY: libc::c_long = 16;
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;

/// `file_flags` for BPF_OBJ_GET: the returned fd cannot write.
pub const BPF_F_RDONLY: u32 = 1 << 3;
pub const BPF_TCX_INGRESS: u32 = 46;
pub const BPF_TCX_EGRESS: u32 = 47;
/// netkit's attach types (kernel >= 6.7): programs on the primary (host-side) device's
/// ifindex for traffic leaving the primary, and for traffic leaving the peer (the pod).
pub const BPF_NETKIT_PRIMARY: u32 = 54;
pub const BPF_NETKIT_PEER: u32 = 55;

pub const MAP_TYPE_HASH: u32 = 1;
pub const MAP_TYPE_ARRAY: u32 = 2;
pub const MAP_TYPE_PROG_ARRAY: u32 = 3;
pub const MAP_TYPE_PERF_EVENT_ARRAY: u32 = 4;
pub const MAP_TYPE_PERCPU_HASH: u32 = 5;
pub const MAP_TYPE_PERCPU_ARRAY: u32 = 6;
pub const MAP_TYPE_LRU_HASH: u32 = 9;
pub const MAP_TYPE_LRU_PERCPU_HASH: u32 = 10;
pub const MAP_TYPE_LPM_TRIE: u32 = 11;

pub fn map_type_name(t: u32) -> &'static str {
    match t {
        1 => "hash",
        2 => "array",
        3 => "prog_array",
        4 => "perf_event_array",
        5 => "percpu_hash",
        6 => "percpu_array",
        9 => "lru_hash",
        10 => "lru_percpu_hash",
        11 => "lpm_trie",
        12 => "array_of_maps",
        13 => "hash_of_maps",
        27 => "ringbuf",
        _ => "other",
    }
}

fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    // SAFETY: attr is a #[repr(C)] prefix of union bpf_attr for `cmd`, valid for the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut T as *mut libc::c_void,
            std::mem::size_of::<T>(),
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn owned(r: libc::c_long) -> OwnedFd {
    // SAFETY: the kernel just returned this fd; nothing else owns it.
    unsafe { OwnedFd::from_raw_fd(r as RawFd) }
}

#[repr(C)]
struct ObjAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
}

fn obj_get(path: &Path, file_flags: u32) -> io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(io::Error::other)?;
    let mut attr = ObjAttr {
        pathname: c.as_ptr() as u64,
        bpf_fd: 0,
        file_flags,
    };
    bpf(BPF_OBJ_GET, &mut attr).map(owned)
}

/// BPF_OBJ_GET with BPF_F_RDONLY: a pinned map, opened read-only (writes through it fail).
pub fn obj_get_rdonly(path: &Path) -> io::Result<OwnedFd> {
    obj_get(path, BPF_F_RDONLY)
}

/// BPF_OBJ_GET of a pinned link. Links have no read-only mode (the kernel rejects
/// BPF_F_RDONLY for them); stepguard only ever reads their info through this fd.
pub fn obj_get_link(path: &Path) -> io::Result<OwnedFd> {
    obj_get(path, 0)
}

#[repr(C)]
struct IdAttr {
    id: u32,
    next_id: u32,
    open_flags: u32,
}

pub fn prog_fd_by_id(id: u32) -> io::Result<OwnedFd> {
    let mut attr = IdAttr {
        id,
        next_id: 0,
        open_flags: 0,
    };
    bpf(BPF_PROG_GET_FD_BY_ID, &mut attr).map(owned)
}

#[repr(C)]
struct InfoAttr {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

fn info(fd: &impl AsRawFd, buf: &mut [u8]) -> io::Result<()> {
    let mut attr = InfoAttr {
        bpf_fd: fd.as_raw_fd() as u32,
        info_len: buf.len() as u32,
        info: buf.as_mut_ptr() as u64,
    };
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr).map(|_| ())
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_ne_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}
fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_ne_bytes(b[o..o + 8].try_into().unwrap_or([0; 8]))
}
fn name_at(b: &[u8], o: usize) -> String {
    let raw = &b[o..o + 16];
    let end = raw.iter().position(|&c| c == 0).unwrap_or(16);
    String::from_utf8_lossy(&raw[..end]).into_owned()
}

/// `struct bpf_map_info`, the fields stepguard reports.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct MapInfo {
    pub id: u32,
    pub map_type: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
    pub flags: u32,
    /// The kernel's (15-character) name; the pin name is the full one.
    pub name: String,
}

pub fn map_info(fd: &impl AsRawFd) -> io::Result<MapInfo> {
    let mut b = [0u8; 128];
    info(fd, &mut b)?;
    Ok(MapInfo {
        map_type: u32_at(&b, 0),
        id: u32_at(&b, 4),
        key_size: u32_at(&b, 8),
        value_size: u32_at(&b, 12),
        max_entries: u32_at(&b, 16),
        flags: u32_at(&b, 20),
        name: name_at(&b, 24),
    })
}

/// `struct bpf_prog_info`, the fields stepguard reports.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ProgInfo {
    pub id: u32,
    pub prog_type: u32,
    /// 15-character kernel name (`cil_from_contai` for `cil_from_container`).
    pub name: String,
    /// Load time, nanoseconds since boot (CLOCK_BOOTTIME).
    pub load_time_boot_ns: u64,
}

impl ProgInfo {
    /// Wall-clock load time.
    pub fn loaded_at(&self) -> SystemTime {
        boot_ns_to_wall(self.load_time_boot_ns)
    }
}

/// Converts a CLOCK_BOOTTIME instant to wall clock (the agent's clock, see `crate::clock`).
pub fn boot_ns_to_wall(boot_ns: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs_f64(crate::clock::from_boot_ns(boot_ns).max(0.0))
}

pub fn prog_info(fd: &impl AsRawFd) -> io::Result<ProgInfo> {
    let mut b = [0u8; 256];
    info(fd, &mut b)?;
    Ok(ProgInfo {
        prog_type: u32_at(&b, 0),
        id: u32_at(&b, 4),
        load_time_boot_ns: u64_at(&b, 40),
        name: name_at(&b, 64),
    })
}

/// The highest program id above `start` (None: no program was loaded since `start` was the
/// highest). The kernel allocates program ids cyclically upwards (`idr_alloc_cyclic` in
/// `bpf_prog_alloc_id`), so a program loaded after `start` was seen has a higher id: one
/// syscall tells whether anything was loaded, without dumping any device. Needs
/// CAP_SYS_ADMIN (EPERM otherwise).
pub fn highest_prog_id_above(start: u32) -> io::Result<Option<u32>> {
    let mut highest = None;
    let mut at = start;
    loop {
        let mut attr = IdAttr {
            id: at,
            next_id: 0,
            open_flags: 0,
        };
        match bpf(BPF_PROG_GET_NEXT_ID, &mut attr) {
            Ok(_) => {
                highest = Some(attr.next_id);
                at = attr.next_id;
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(highest),
            Err(e) => return Err(e),
        }
    }
}

/// Program info by id (needs CAP_SYS_ADMIN on current kernels).
pub fn prog_info_by_id(id: u32) -> io::Result<ProgInfo> {
    prog_info(&prog_fd_by_id(id)?)
}

/// `struct bpf_link_info`: type, id, prog_id, and for tcx links the ifindex and attach type.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkInfo {
    pub link_type: u32,
    pub id: u32,
    pub prog_id: u32,
    pub ifindex: u32,
    pub attach_type: u32,
}

pub fn link_info(fd: &impl AsRawFd) -> io::Result<LinkInfo> {
    let mut b = [0u8; 128];
    info(fd, &mut b)?;
    Ok(LinkInfo {
        link_type: u32_at(&b, 0),
        id: u32_at(&b, 4),
        prog_id: u32_at(&b, 8),
        ifindex: u32_at(&b, 16),
        attach_type: u32_at(&b, 20),
    })
}

#[repr(C)]
#[derive(Default)]
struct QueryAttr {
    target_ifindex: u32,
    attach_type: u32,
    query_flags: u32,
    attach_flags: u32,
    prog_ids: u64,
    count: u32,
    _pad: u32,
    prog_attach_flags: u64,
    link_ids: u64,
    link_attach_flags: u64,
    revision: u64,
}

/// Program ids attached by tcx to `ifindex` (in the caller's network namespace).
pub fn tcx_prog_ids(ifindex: u32, attach_type: u32) -> io::Result<Vec<u32>> {
    let mut ids = vec![0u32; 64];
    let mut attr = QueryAttr {
        target_ifindex: ifindex,
        attach_type,
        prog_ids: ids.as_mut_ptr() as u64,
        count: ids.len() as u32,
        ..Default::default()
    };
    bpf(BPF_PROG_QUERY, &mut attr)?;
    ids.truncate(attr.count as usize);
    Ok(ids)
}

#[repr(C)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

#[repr(C)]
struct ElemAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value_or_next: u64,
    flags: u64,
}

/// Parses `/sys/devices/system/cpu/possible` (`0-3`, `0`, `0-3,8-11`).
pub fn parse_possible(text: &str) -> Option<usize> {
    text.trim()
        .split(',')
        .map(|r| match r.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (a.parse::<usize>().ok()?, b.parse::<usize>().ok()?);
                b.checked_sub(a).map(|d| d + 1)
            }
            None => r.parse::<usize>().ok().map(|_| 1),
        })
        .sum::<Option<usize>>()
        .filter(|n| *n > 0)
}

/// The number of possible CPUs: how many values the kernel writes for one key of a per-CPU
/// map. Read once and cached; never guessed. (A fallback of 1 when the file could not be read,
/// e.g. with the process out of file descriptors, let the kernel write past a one-CPU buffer:
/// heap corruption, found by the EMFILE abuse test.) Call early, while descriptors are free.
pub fn possible_cpus() -> io::Result<usize> {
    static CPUS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    if let Some(n) = CPUS.get() {
        return Ok(*n);
    }
    let path = "/sys/devices/system/cpu/possible";
    let text = std::fs::read_to_string(path)?;
    let n = parse_possible(&text).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{path}: cannot parse {:?}", text.trim()),
        )
    })?;
    Ok(*CPUS.get_or_init(|| n))
}

/// Entries in a map. Hash-like maps are counted with batched lookups (a few syscalls per
/// thousand entries), falling back to walking keys; arrays report `None` (every slot exists).
pub fn count_entries(fd: &impl AsRawFd, info: &MapInfo) -> io::Result<Option<u64>> {
    match info.map_type {
        MAP_TYPE_ARRAY
        | MAP_TYPE_PERCPU_ARRAY
        | MAP_TYPE_PROG_ARRAY
        | MAP_TYPE_PERF_EVENT_ARRAY => return Ok(None),
        _ => {}
    }
    match count_batched(fd, info) {
        Ok(n) => Ok(Some(n)),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EINVAL) | Some(ENOTSUPP_KERNEL) | Some(libc::EOPNOTSUPP)
            ) =>
        {
            count_by_keys(fd, info).map(Some)
        }
        Err(e) => Err(e),
    }
}

const ENOTSUPP_KERNEL: i32 = 524;

/// The size of one value slot as the kernel copies it out: per-CPU maps give each possible
/// CPU a slot rounded up to 8 bytes.
fn value_slot(info: &MapInfo) -> io::Result<usize> {
    let percpu = matches!(
        info.map_type,
        MAP_TYPE_PERCPU_HASH | MAP_TYPE_LRU_PERCPU_HASH | MAP_TYPE_PERCPU_ARRAY
    );
    Ok(if percpu {
        (info.value_size as usize).div_ceil(8) * 8 * possible_cpus()?
    } else {
        info.value_size as usize
    })
}

fn count_batched(fd: &impl AsRawFd, info: &MapInfo) -> io::Result<u64> {
    for_each_batched(fd, info, |_, _| {})
}

/// Visits every entry (key, value) of a map with batched lookups: one syscall per chunk of
/// up to 8,192 entries (the key walk costs two per entry). Per-CPU values are the kernel's
/// layout: one 8-byte-aligned slot per possible CPU. Returns the number of entries.
fn for_each_batched(
    fd: &impl AsRawFd,
    info: &MapInfo,
    mut f: impl FnMut(&[u8], &[u8]),
) -> io::Result<u64> {
    let key_size = info.key_size as usize;
    let value_size = value_slot(info)?;
    let chunk = (1 << 20) / (key_size + value_size).max(1);
    // No bigger than the map can hold (a small map read every 100 ms needs no 200 KB buffer).
    let chunk = chunk
        .clamp(64, 8192)
        .min((info.max_entries as usize).max(64));
    let mut keys = vec![0u8; chunk * key_size];
    let mut values = vec![0u8; chunk * value_size];
    // The batch token is opaque and its size depends on the map: hash maps use a 4-byte
    // bucket index, but maps served by the kernel's generic batch code (LPM tries such as
    // `cilium_ipcache`) copy a whole key (`key_size` bytes) into it. An 8-byte token let the
    // kernel write past it (stack corruption: release builds crashed counting ipcache).
    let token_len = key_size.max(8);
    let mut in_token = vec![0u8; token_len];
    let mut out_token = vec![0u8; token_len];
    let mut total = 0u64;
    let mut first = true;
    loop {
        let mut attr = BatchAttr {
            in_batch: if first {
                0
            } else {
                in_token.as_mut_ptr() as u64
            },
            out_batch: out_token.as_mut_ptr() as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: chunk as u32,
            map_fd: fd.as_raw_fd() as u32,
            elem_flags: 0,
            flags: 0,
        };
        let r = bpf(BPF_MAP_LOOKUP_BATCH, &mut attr);
        let got = (attr.count as usize).min(chunk);
        for i in 0..got {
            f(
                &keys[i * key_size..(i + 1) * key_size],
                &values[i * value_size..(i + 1) * value_size],
            );
        }
        total += got as u64;
        match r {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(total),
            Err(e) if e.raw_os_error() == Some(ENOTSUPP_KERNEL) => {
                return Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP))
            }
            Err(e) => return Err(e),
        }
        in_token.copy_from_slice(&out_token);
        first = false;
    }
}

/// Visits every entry (key, value) of a hash-like map, as [`for_each_batched`] does, falling
/// back to walking the keys and looking each up where the kernel has no batched lookup for
/// the map (before 5.6, or a map type without it). Nothing is written to the map. A walk
/// stops after `limit` entries.
pub fn for_each_entry(
    fd: &impl AsRawFd,
    info: &MapInfo,
    limit: usize,
    mut f: impl FnMut(&[u8], &[u8]),
) -> io::Result<u64> {
    let mut seen = 0usize;
    match for_each_batched(fd, info, |k, v| {
        if seen < limit {
            seen += 1;
            f(k, v)
        }
    }) {
        Ok(n) => return Ok(n.min(limit as u64)),
        // Nothing was handed out before these errors (a refused first call).
        Err(e)
            if seen == 0
                && matches!(
                    e.raw_os_error(),
                    Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) | Some(libc::ENOSPC)
                ) => {}
        Err(e) => return Err(e),
    }
    for_each_walked(fd, info, limit, f)
}

/// Visits entries by walking the keys and looking each up (two syscalls per entry).
fn for_each_walked(
    fd: &impl AsRawFd,
    info: &MapInfo,
    limit: usize,
    mut f: impl FnMut(&[u8], &[u8]),
) -> io::Result<u64> {
    let mut value = vec![0u8; value_slot(info)?];
    let mut n = 0u64;
    for k in keys(fd, info.key_size, limit)? {
        if lookup(fd, &k, &mut value)? {
            f(&k, &value);
            n += 1;
        }
    }
    Ok(n)
}

fn count_by_keys(fd: &impl AsRawFd, info: &MapInfo) -> io::Result<u64> {
    let mut key = vec![0u8; info.key_size as usize];
    let mut next = vec![0u8; info.key_size as usize];
    let mut n = 0u64;
    let mut first = true;
    loop {
        let mut attr = ElemAttr {
            map_fd: fd.as_raw_fd() as u32,
            _pad: 0,
            key: if first { 0 } else { key.as_ptr() as u64 },
            value_or_next: next.as_mut_ptr() as u64,
            flags: 0,
        };
        match bpf(BPF_MAP_GET_NEXT_KEY, &mut attr) {
            Ok(_) => n += 1,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(n),
            Err(e) => return Err(e),
        }
        std::mem::swap(&mut key, &mut next);
        first = false;
        if n > u32::MAX as u64 {
            return Ok(n);
        }
    }
}

/// Reads one value (used for per-CPU counters such as `cilium_metrics`).
pub fn lookup(fd: &impl AsRawFd, key: &[u8], value: &mut [u8]) -> io::Result<bool> {
    let mut attr = ElemAttr {
        map_fd: fd.as_raw_fd() as u32,
        _pad: 0,
        key: key.as_ptr() as u64,
        value_or_next: value.as_mut_ptr() as u64,
        flags: 0,
    };
    match bpf(BPF_MAP_LOOKUP_ELEM, &mut attr) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Every key of a map (small maps only, e.g. `cilium_metrics`).
pub fn keys(fd: &impl AsRawFd, key_size: u32, limit: usize) -> io::Result<Vec<Vec<u8>>> {
    let mut out: Vec<Vec<u8>> = Vec::new();
    loop {
        let mut next = vec![0u8; key_size as usize];
        let prev = out.last();
        let mut attr = ElemAttr {
            map_fd: fd.as_raw_fd() as u32,
            _pad: 0,
            key: prev.map(|k| k.as_ptr() as u64).unwrap_or(0),
            value_or_next: next.as_mut_ptr() as u64,
            flags: 0,
        };
        match bpf(BPF_MAP_GET_NEXT_KEY, &mut attr) {
            Ok(_) => out.push(next),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(out),
            Err(e) => return Err(e),
        }
        if out.len() >= limit {
            return Ok(out);
        }
    }
}

/// True when `path` is on a bpf filesystem.
pub fn is_bpffs(path: &Path) -> bool {
    const BPF_FS_MAGIC: i64 = 0xcafe4a11;
    let Ok(c) = CString::new(path.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: statfs writes into st; c is NUL-terminated.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    unsafe { libc::statfs(c.as_ptr(), &mut st) == 0 && st.f_type as i64 == BPF_FS_MAGIC }
}

#[cfg(test)]
mod tests;
