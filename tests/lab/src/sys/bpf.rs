//! The few bpf(2) commands the lab needs that aya does not expose: creating maps with Cilium's
//! names and shapes, writing their entries, pinning, and swapping a link's program.
//! Raw syscalls on purpose: the lab plays cilium-agent, which writes; the agent never does.
//!
//! Not shared with the kernel crate's `bpf` (`kernel/src/bpf/`): that one is read-only by
//! contract (BPF_F_RDONLY opens, info and counting; the agent never writes), and these are the
//! writing commands it must not offer. aya does not cover them either: it creates a map only
//! from an `aya_obj::Map` (a crate the lab does not depend on), writes only typed, fixed-size
//! entries (Cilium's shapes differ by release), and swaps a pinned link's program only by
//! taking the link over into that program's own links (`attach_to_link`), where the lab swaps
//! by fd and leaves the pin as Cilium does. The few reads kept here (`obj_id`, `link_prog_id`,
//! `map_key_size`) serve the same fds.
use super::fd_result;
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_LINK_UPDATE: libc::c_long = 29;

pub const BPF_F_NO_PREALLOC: u32 = 1;

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

#[repr(C)]
#[derive(Default)]
struct MapCreate {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
    inner_map_fd: u32,
    numa_node: u32,
    map_name: [u8; 16],
}

/// BPF_MAP_CREATE. `name` is truncated to the kernel's 15 characters, as it is for Cilium.
pub fn map_create(
    map_type: u32,
    key: u32,
    value: u32,
    max: u32,
    flags: u32,
    name: &str,
) -> io::Result<OwnedFd> {
    let mut attr = MapCreate {
        map_type,
        key_size: key,
        value_size: value,
        max_entries: max,
        map_flags: flags,
        ..Default::default()
    };
    for (d, s) in attr.map_name.iter_mut().zip(
        name.bytes()
            .filter(|b| b.is_ascii_alphanumeric() || *b == b'_' || *b == b'.')
            .take(15),
    ) {
        *d = s;
    }
    bpf(BPF_MAP_CREATE, &mut attr).map(fd_result)
}

#[repr(C)]
struct MapElem {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

pub fn map_update(fd: &OwnedFd, key: &[u8], value: &[u8]) -> io::Result<()> {
    let mut attr = MapElem {
        map_fd: fd.as_raw_fd() as u32,
        _pad: 0,
        key: key.as_ptr() as u64,
        value: value.as_ptr() as u64,
        flags: 0,
    };
    bpf(BPF_MAP_UPDATE_ELEM, &mut attr).map(|_| ())
}

pub fn map_delete(fd: &OwnedFd, key: &[u8]) -> io::Result<()> {
    let mut attr = MapElem {
        map_fd: fd.as_raw_fd() as u32,
        _pad: 0,
        key: key.as_ptr() as u64,
        value: 0,
        flags: 0,
    };
    bpf(BPF_MAP_DELETE_ELEM, &mut attr).map(|_| ())
}

/// BPF_MAP_GET_NEXT_KEY; `None` at the end of the map.
pub fn map_next_key(fd: &OwnedFd, key: Option<&[u8]>, next: &mut [u8]) -> io::Result<bool> {
    let mut attr = MapElem {
        map_fd: fd.as_raw_fd() as u32,
        _pad: 0,
        key: key.map(|k| k.as_ptr() as u64).unwrap_or(0),
        value: next.as_mut_ptr() as u64,
        flags: 0,
    };
    match bpf(BPF_MAP_GET_NEXT_KEY, &mut attr) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

#[repr(C)]
struct ObjAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
}

pub fn obj_pin(fd: &impl AsRawFd, path: &Path) -> io::Result<()> {
    let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(io::Error::other)?;
    let mut attr = ObjAttr {
        pathname: c.as_ptr() as u64,
        bpf_fd: fd.as_raw_fd() as u32,
        file_flags: 0,
    };
    bpf(BPF_OBJ_PIN, &mut attr).map(|_| ())
}

pub fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(io::Error::other)?;
    let mut attr = ObjAttr {
        pathname: c.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
    };
    bpf(BPF_OBJ_GET, &mut attr).map(fd_result)
}

#[repr(C)]
struct LinkUpdate {
    link_fd: u32,
    new_prog_fd: u32,
    flags: u32,
    old_prog_fd: u32,
}

/// BPF_LINK_UPDATE: atomically replace the program behind a link (what Cilium does on restart).
pub fn link_update(link: &impl AsRawFd, prog: &impl AsRawFd) -> io::Result<()> {
    let mut attr = LinkUpdate {
        link_fd: link.as_raw_fd() as u32,
        new_prog_fd: prog.as_raw_fd() as u32,
        flags: 0,
        old_prog_fd: 0,
    };
    bpf(BPF_LINK_UPDATE, &mut attr).map(|_| ())
}

#[repr(C)]
struct InfoAttr {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

fn info_by_fd(fd: &impl AsRawFd, buf: &mut [u8]) -> io::Result<()> {
    let mut attr = InfoAttr {
        bpf_fd: fd.as_raw_fd() as u32,
        info_len: buf.len() as u32,
        info: buf.as_mut_ptr() as u64,
    };
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr).map(|_| ())
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_ne_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// ID of a program, map or link fd (the `id` field sits at offset 4 in all three info structs).
pub fn obj_id(fd: &impl AsRawFd) -> io::Result<u32> {
    let mut buf = [0u8; 256];
    info_by_fd(fd, &mut buf)?;
    Ok(u32_at(&buf, 4))
}

/// `prog_id` of a link (struct bpf_link_info: type, id, prog_id).
pub fn link_prog_id(link: &impl AsRawFd) -> io::Result<u32> {
    let mut buf = [0u8; 256];
    info_by_fd(link, &mut buf)?;
    Ok(u32_at(&buf, 8))
}

/// `key_size` of a map (struct bpf_map_info: type, id, key_size, value_size, ...).
pub fn map_key_size(map: &impl AsRawFd) -> io::Result<u32> {
    let mut buf = [0u8; 256];
    info_by_fd(map, &mut buf)?;
    Ok(u32_at(&buf, 8))
}
