//! rtnetlink: legacy tc filters, named the way Cilium names them.
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const RTM_NEWTFILTER: u16 = 44;
const RTM_DELTFILTER: u16 = 45;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_CREATE: u16 = 0x400;
const TCA_KIND: u16 = 1;
const TCA_OPTIONS: u16 = 2;
const TCA_BPF_FD: u16 = 6;
const TCA_BPF_NAME: u16 = 7;
const TCA_BPF_FLAGS: u16 = 8;
const TCA_BPF_FLAG_ACT_DIRECT: u32 = 1;
const NLA_F_NESTED: u16 = 0x8000;
const TC_H_CLSACT: u32 = 0xffff_fff1;
const TC_H_MIN_INGRESS: u32 = 0xfff2;
const TC_H_MIN_EGRESS: u32 = 0xfff3;
const ETH_P_ALL: u16 = 0x0003;

fn nla(buf: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    let len = 4 + payload.len();
    buf.extend_from_slice(&(len as u16).to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(payload);
    while !buf.len().is_multiple_of(4) {
        buf.push(0);
    }
}

/// Adds/replaces (`prog = Some`) or deletes (`None`) the direct-action bpf filter at priority 1,
/// handle 1 on the clsact hook of `ifindex`, named `name` (e.g. `cil_from_netdev-eth0`).
/// Runs in the calling thread's network namespace.
pub fn tc_filter(ifindex: u32, egress: bool, prog: Option<(&dyn AsRawFd, &str)>) -> io::Result<()> {
    let parent = (TC_H_CLSACT & 0xffff_0000)
        | if egress {
            TC_H_MIN_EGRESS
        } else {
            TC_H_MIN_INGRESS
        };
    let mut body = Vec::new();
    // struct tcmsg: family, pad[3], ifindex, handle, parent, info (prio << 16 | protocol)
    body.extend_from_slice(&[libc::AF_UNSPEC as u8, 0, 0, 0]);
    body.extend_from_slice(&(ifindex as i32).to_ne_bytes());
    body.extend_from_slice(&1u32.to_ne_bytes());
    body.extend_from_slice(&parent.to_ne_bytes());
    body.extend_from_slice(&((1u32 << 16) | ETH_P_ALL.to_be() as u32).to_ne_bytes());
    nla(&mut body, TCA_KIND, b"bpf\0");
    let (msg_type, flags) = match prog {
        Some((fd, name)) => {
            let mut opts = Vec::new();
            nla(
                &mut opts,
                TCA_BPF_FD,
                &(fd.as_raw_fd() as u32).to_ne_bytes(),
            );
            let mut n = name.as_bytes().to_vec();
            n.push(0);
            nla(&mut opts, TCA_BPF_NAME, &n);
            nla(
                &mut opts,
                TCA_BPF_FLAGS,
                &TCA_BPF_FLAG_ACT_DIRECT.to_ne_bytes(),
            );
            nla(&mut body, TCA_OPTIONS | NLA_F_NESTED, &opts);
            (RTM_NEWTFILTER, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE)
        }
        None => (RTM_DELTFILTER, NLM_F_REQUEST | NLM_F_ACK),
    };
    let mut msg = Vec::with_capacity(16 + body.len());
    msg.extend_from_slice(&((16 + body.len()) as u32).to_ne_bytes());
    msg.extend_from_slice(&msg_type.to_ne_bytes());
    msg.extend_from_slice(&flags.to_ne_bytes());
    msg.extend_from_slice(&1u32.to_ne_bytes()); // seq
    msg.extend_from_slice(&0u32.to_ne_bytes()); // pid
    msg.extend_from_slice(&body);
    netlink_request(&msg)
}

/// Sends one rtnetlink request and waits for its ACK.
fn netlink_request(msg: &[u8]) -> io::Result<()> {
    // SAFETY: plain socket/send/recv on an fd we own; buffers outlive the calls.
    unsafe {
        let fd = libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        );
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let sock = OwnedFd::from_raw_fd(fd);
        if libc::send(
            sock.as_raw_fd(),
            msg.as_ptr() as *const libc::c_void,
            msg.len(),
            0,
        ) < 0
        {
            return Err(io::Error::last_os_error());
        }
        let mut buf = [0u8; 4096];
        let n = libc::recv(
            sock.as_raw_fd(),
            buf.as_mut_ptr() as *mut libc::c_void,
            buf.len(),
            0,
        );
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n >= 20 && u16::from_ne_bytes([buf[4], buf[5]]) == libc::NLMSG_ERROR as u16 {
            let err = i32::from_ne_bytes([buf[16], buf[17], buf[18], buf[19]]);
            if err != 0 {
                return Err(io::Error::from_raw_os_error(-err));
            }
        }
        Ok(())
    }
}
