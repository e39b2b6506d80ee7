use super::*;
use netlink_packet_route::link::LinkMessage;
use rtnetlink::packet_core::{Emitable, Parseable};

/// An RTM_NEWLINK for `name` of `kind`, as bytes the kernel sends, parsed back.
fn link_message(name: &str, kind: InfoKind) -> LinkMessage {
    let mut m = LinkMessage::default();
    m.header.index = 42;
    m.attributes.push(LinkAttribute::IfName(name.into()));
    m.attributes
        .push(LinkAttribute::LinkInfo(vec![LinkInfo::Kind(kind)]));
    let mut buf = vec![0u8; m.buffer_len()];
    m.emit(&mut buf);
    LinkMessage::parse(&buf[..]).expect("parse link message")
}

fn prog(id: u32, name: &str) -> bpf::ProgInfo {
    bpf::ProgInfo {
        id,
        prog_type: 3,
        name: name.into(),
        load_time_boot_ns: 0,
    }
}

/// A netkit endpoint (Cilium's `bpf.datapathMode: netkit`; this machine's kernel has no
/// netkit, so the kernel's answers are given here as it gives them): the link kind
/// `netkit` from the link message, programs queried at BPF_NETKIT_PEER and
/// BPF_NETKIT_PRIMARY on the primary's ifindex, kernel names truncated to 15 characters.
#[test]
fn a_netkit_endpoint_is_queried_at_the_netkit_attach_types() {
    let m = link_message("lxc1a2b3c", InfoKind::Netkit);
    let link = EndpointLink {
        name: "lxc1a2b3c".into(),
        kind: link_kind(&m),
    };
    assert_eq!(link.kind.as_deref(), Some("netkit"));
    let mut asked = vec![];
    let mut problems = vec![];
    let mut programs = query_endpoint(
        &link,
        |at| {
            asked.push(at);
            Ok(match at {
                bpf::BPF_NETKIT_PEER => vec![301],
                bpf::BPF_NETKIT_PRIMARY => vec![302],
                _ => vec![],
            })
        },
        &mut problems,
    )
    .expect("present");
    assert_eq!(asked, [bpf::BPF_NETKIT_PEER, bpf::BPF_NETKIT_PRIMARY]);
    assert!(problems.is_empty());
    let mut obs = Observation::default();
    let raced = fill_program_details(&link.name, &mut programs, &mut obs, |id| {
        Ok(prog(
            id,
            if id == 301 {
                "cil_from_contai"
            } else {
                "cil_to_containe"
            },
        ))
    });
    assert!(!raced);
    assert_eq!(
        (
            programs[0].hook,
            programs[0].via,
            programs[0].is("cil_from_container")
        ),
        ("netkit_peer", "netkit", true)
    );
    assert_eq!(
        (programs[1].hook, programs[1].is("cil_to_container")),
        ("netkit_primary", true)
    );
    // A veth endpoint is asked at tcx ingress and egress; a kernel without tcx (EINVAL)
    // has nothing attached that way, and a device deleted meanwhile (ENODEV) is gone.
    let veth = EndpointLink {
        name: "lxc9".into(),
        kind: link_kind(&link_message("lxc9", InfoKind::Veth)),
    };
    let mut asked = vec![];
    let p = query_endpoint(
        &veth,
        |at| {
            asked.push(at);
            Err(std::io::Error::from_raw_os_error(libc::EINVAL))
        },
        &mut problems,
    );
    assert_eq!(asked, [bpf::BPF_TCX_INGRESS, bpf::BPF_TCX_EGRESS]);
    assert!(p.is_some_and(|p| p.is_empty()) && problems.is_empty());
    let gone = query_endpoint(
        &veth,
        |_| Err(std::io::Error::from_raw_os_error(libc::ENODEV)),
        &mut problems,
    );
    assert!(gone.is_none());
    let denied = query_endpoint(
        &veth,
        |_| Err(std::io::Error::from_raw_os_error(libc::EPERM)),
        &mut problems,
    );
    assert!(denied.is_some() && problems.len() == 2, "{problems:?}");
}
