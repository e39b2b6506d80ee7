//! The ICMP and ICMPv6 echo wire format: the request the echo transport sends, and the
//! judgement of what comes back (an echo reply from the probed address, an unreachable
//! quoting one of ours, or not ours at all).
use std::net::{Ipv4Addr, Ipv6Addr};

fn checksum(b: &[u8]) -> u16 {
    let mut sum = 0u32;
    for c in b.chunks(2) {
        sum += u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]) as u32;
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An echo request (type 8) with this ident and sequence number, checksummed.
pub fn echo_request(ident: u16, seq: u16) -> [u8; 16] {
    let mut pkt = [0u8; 16];
    pkt[0] = 8;
    pkt[4..6].copy_from_slice(&ident.to_be_bytes());
    pkt[6..8].copy_from_slice(&seq.to_be_bytes());
    pkt[8..16].copy_from_slice(b"stepgrd!");
    let c = checksum(&pkt);
    pkt[2..4].copy_from_slice(&c.to_be_bytes());
    pkt
}

/// An ICMPv6 echo request (type 128) with this ident and sequence number. The checksum is
/// left zero: it covers the IPv6 pseudo-header, and the kernel fills it in for ping and raw
/// ICMPv6 sockets alike (RFC 3542 section 3.1; Linux `rawv6_init_sk`).
pub fn echo_request_v6(ident: u16, seq: u16) -> [u8; 16] {
    let mut pkt = echo_request(ident, seq);
    pkt[0] = 128;
    pkt[2] = 0;
    pkt[3] = 0;
    pkt
}

/// What a received ICMP message means for the probe that sent (`ident`, `seq`) to `dst`.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply {
    /// The echo reply to this probe.
    Echo,
    /// A Destination Unreachable about this probe's own request (the quoted packet matches).
    Unreachable(u8),
    /// Anything else: another probe's reply, another host's, an error about other traffic.
    NotMine,
}

/// Classifies an ICMP message (from its first byte) received from `from`. A raw socket sees
/// every ICMP message of the host, so the ident is checked there; a ping socket's ident is
/// the kernel's and only the sequence number is ours.
/// The sequence number of the echo an ICMP message may answer: an echo reply's own, or the
/// quoted request's in a destination unreachable. Only a key to find the echo in flight:
/// [`classify`] still judges the message against it.
pub fn answered_seq(icmp: &[u8]) -> Option<u16> {
    match *icmp.first()? {
        0 => Some(u16::from_be_bytes([*icmp.get(6)?, *icmp.get(7)?])),
        3 => {
            let quoted = icmp.get(8..)?;
            let ihl = ((quoted.first()? & 0x0f) as usize) * 4;
            let inner = quoted.get(ihl..ihl + 8)?;
            (ihl >= 20 && inner[0] == 8).then(|| u16::from_be_bytes([inner[6], inner[7]]))
        }
        _ => None,
    }
}

pub fn classify(
    icmp: &[u8],
    from: Ipv4Addr,
    dst: Ipv4Addr,
    ident: u16,
    seq: u16,
    raw: bool,
) -> Reply {
    let ours = Ours { ident, seq, raw };
    // The quoted datagram: its IP header, then the first 8 bytes of our echo request.
    ours.judge(icmp, (0, 3, 8), from == dst, |quoted| {
        let ihl = ((*quoted.first()? & 0x0f) as usize) * 4;
        let qdst = Ipv4Addr::from(<[u8; 4]>::try_from(quoted.get(16..20)?).ok()?);
        (ihl >= 20 && quoted[9] == libc::IPPROTO_ICMP as u8 && qdst == dst)
            .then(|| quoted.get(ihl..ihl + 8))
            .flatten()
    })
}

/// [`classify`] for ICMPv6 (RFC 4443): an echo reply is type 129; a Destination Unreachable
/// (type 1) quotes our request after its fixed IPv6 header (40 bytes, next header 58, no
/// extension headers: we send none). Raw and ping ICMPv6 sockets alike deliver the message
/// without the IPv6 header.
pub fn classify_v6(
    icmp: &[u8],
    from: Ipv6Addr,
    dst: Ipv6Addr,
    ident: u16,
    seq: u16,
    raw: bool,
) -> Reply {
    let ours = Ours { ident, seq, raw };
    ours.judge(icmp, (129, 1, 128), from == dst, |quoted| {
        let qdst = Ipv6Addr::from(<[u8; 16]>::try_from(quoted.get(24..40)?).ok()?);
        (quoted[0] >> 4 == 6 && quoted[6] == libc::IPPROTO_ICMPV6 as u8 && qdst == dst)
            .then(|| quoted.get(40..48))
            .flatten()
    })
}

/// The echo a probe sent: a raw socket's replies must carry our ident (a ping socket's ident
/// is the kernel's), and every reply our sequence number.
struct Ours {
    ident: u16,
    seq: u16,
    raw: bool,
}

impl Ours {
    fn matches(&self, echo: &[u8]) -> bool {
        (!self.raw || echo[4..6] == self.ident.to_be_bytes())
            && echo[6..8] == self.seq.to_be_bytes()
    }

    /// Judges `icmp` with the family's (echo reply, destination unreachable, echo request)
    /// types; `quoted` finds, in an unreachable's quoted datagram, the first 8 bytes of the
    /// request it quotes when that datagram went to the probed address.
    fn judge<'a>(
        &self,
        icmp: &'a [u8],
        (reply, unreachable, request): (u8, u8, u8),
        from_dst: bool,
        quoted: impl Fn(&'a [u8]) -> Option<&'a [u8]>,
    ) -> Reply {
        if icmp.len() < 8 {
            return Reply::NotMine;
        }
        if icmp[0] == reply {
            return if from_dst && self.matches(icmp) {
                Reply::Echo
            } else {
                Reply::NotMine
            };
        }
        if icmp[0] == unreachable {
            if let Some(inner) = quoted(&icmp[8..]) {
                if inner[0] == request && self.matches(inner) {
                    return Reply::Unreachable(icmp[1]);
                }
            }
        }
        Reply::NotMine
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DST: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 7);

    fn echo_reply(ident: u16, seq: u16) -> Vec<u8> {
        let mut p = vec![0u8, 0, 0, 0];
        p.extend_from_slice(&ident.to_be_bytes());
        p.extend_from_slice(&seq.to_be_bytes());
        p
    }

    /// Destination Unreachable quoting an echo request (ident, seq) to `to`.
    fn unreachable(to: Ipv4Addr, proto: u8, ident: u16, seq: u16) -> Vec<u8> {
        let mut p = vec![3u8, 1, 0, 0, 0, 0, 0, 0];
        let mut ip = vec![0x45u8, 0, 0, 28, 0, 0, 0, 0, 64, proto, 0, 0, 192, 0, 2, 1];
        ip.extend_from_slice(&to.octets());
        p.extend(ip);
        p.extend([8u8, 0, 0, 0]);
        p.extend_from_slice(&ident.to_be_bytes());
        p.extend_from_slice(&seq.to_be_bytes());
        p
    }

    #[test]
    fn an_unrelated_destination_unreachable_does_not_fail_the_probe() {
        // Another host unreachable, or a UDP datagram's error: not about this probe.
        let other = Ipv4Addr::new(203, 0, 113, 9);
        assert_eq!(
            classify(&unreachable(other, 1, 7, 42), other, DST, 7, 42, true),
            Reply::NotMine
        );
        assert_eq!(
            classify(&unreachable(DST, 17, 7, 42), DST, DST, 7, 42, true),
            Reply::NotMine
        );
        // Another probe's request (another sequence number) to the same host.
        assert_eq!(
            classify(&unreachable(DST, 1, 7, 41), DST, DST, 7, 42, true),
            Reply::NotMine
        );
        // This probe's own request quoted: it fails, with the code.
        assert_eq!(
            classify(
                &unreachable(DST, 1, 7, 42),
                Ipv4Addr::new(192, 0, 2, 1),
                DST,
                7,
                42,
                true
            ),
            Reply::Unreachable(1)
        );
    }

    /// The key to the echo in flight: a reply's own sequence number, an unreachable's quoted
    /// one; nothing for other messages or truncated ones.
    #[test]
    fn the_answered_sequence_number_is_read_from_replies_and_quoted_requests() {
        assert_eq!(answered_seq(&echo_reply(7, 42)), Some(42));
        assert_eq!(answered_seq(&unreachable(DST, 1, 7, 4242)), Some(4242));
        assert_eq!(answered_seq(&echo_reply(7, 42)[..7]), None);
        assert_eq!(answered_seq(&unreachable(DST, 1, 7, 42)[..30]), None);
        let mut request = echo_reply(7, 42);
        request[0] = 8; // our own echo request, seen by a raw socket
        assert_eq!(answered_seq(&request), None);
        assert_eq!(answered_seq(&[]), None);
    }

    #[test]
    fn an_echo_reply_counts_only_from_the_probed_address() {
        assert_eq!(
            classify(&echo_reply(7, 42), DST, DST, 7, 42, true),
            Reply::Echo
        );
        let spoof = Ipv4Addr::new(192, 0, 2, 66);
        assert_eq!(
            classify(&echo_reply(7, 42), spoof, DST, 7, 42, true),
            Reply::NotMine
        );
        // Raw sockets check the ident; ping sockets (kernel-chosen ident) only the sequence.
        assert_eq!(
            classify(&echo_reply(8, 42), DST, DST, 7, 42, true),
            Reply::NotMine
        );
        assert_eq!(
            classify(&echo_reply(8, 42), DST, DST, 7, 42, false),
            Reply::Echo
        );
        assert_eq!(
            classify(&echo_reply(7, 43), DST, DST, 7, 42, false),
            Reply::NotMine
        );
        assert_eq!(classify(&[0u8, 0], DST, DST, 7, 42, false), Reply::NotMine);
    }

    const DST6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 7);

    /// ICMPv6 Destination Unreachable (code 3: address unreachable) quoting an echo request
    /// (ident, seq) to `to` with next header `next`.
    fn unreachable_v6(to: Ipv6Addr, next: u8, ident: u16, seq: u16) -> Vec<u8> {
        let mut p = vec![1u8, 3, 0, 0, 0, 0, 0, 0];
        let mut ip = vec![0x60u8, 0, 0, 0, 0, 16, next, 64];
        ip.extend_from_slice(&Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1).octets());
        ip.extend_from_slice(&to.octets());
        p.extend(ip);
        p.extend([128u8, 0, 0, 0]);
        p.extend_from_slice(&ident.to_be_bytes());
        p.extend_from_slice(&seq.to_be_bytes());
        p
    }

    #[test]
    fn icmpv6_echo_requests_carry_type_128_and_leave_the_checksum_to_the_kernel() {
        let p = echo_request_v6(7, 42);
        assert_eq!(p[0], 128);
        assert_eq!(&p[2..4], &[0, 0]);
        assert_eq!(&p[4..8], &[0, 7, 0, 42]);
        // The IPv4 request is unchanged: type 8 with its checksum.
        let v4 = echo_request(7, 42);
        assert_eq!(v4[0], 8);
        assert_eq!(checksum(&v4), 0);
    }

    #[test]
    fn icmpv6_replies_and_unreachables_are_judged_like_icmp_ones() {
        let mut reply = echo_reply(7, 42);
        reply[0] = 129;
        assert_eq!(classify_v6(&reply, DST6, DST6, 7, 42, true), Reply::Echo);
        // Only from the probed address, with our sequence number (and ident, on raw sockets).
        let other = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 66);
        assert_eq!(
            classify_v6(&reply, other, DST6, 7, 42, true),
            Reply::NotMine
        );
        assert_eq!(classify_v6(&reply, DST6, DST6, 8, 42, true), Reply::NotMine);
        assert_eq!(classify_v6(&reply, DST6, DST6, 8, 42, false), Reply::Echo);
        assert_eq!(
            classify_v6(&reply, DST6, DST6, 7, 43, false),
            Reply::NotMine
        );
        // An IPv4 echo reply's type (0) means nothing in ICMPv6; nor does a neighbour
        // advertisement (136) a raw socket also sees.
        assert_eq!(
            classify_v6(&echo_reply(7, 42), DST6, DST6, 7, 42, true),
            Reply::NotMine
        );
        let mut na = echo_reply(7, 42);
        na[0] = 136;
        assert_eq!(classify_v6(&na, DST6, DST6, 7, 42, true), Reply::NotMine);
        // This probe's request quoted: a failure with its code, from whichever router.
        assert_eq!(
            classify_v6(&unreachable_v6(DST6, 58, 7, 42), other, DST6, 7, 42, true),
            Reply::Unreachable(3)
        );
        // Another destination, another protocol (UDP), another sequence, a truncated quote.
        assert_eq!(
            classify_v6(&unreachable_v6(other, 58, 7, 42), other, DST6, 7, 42, true),
            Reply::NotMine
        );
        assert_eq!(
            classify_v6(&unreachable_v6(DST6, 17, 7, 42), other, DST6, 7, 42, true),
            Reply::NotMine
        );
        assert_eq!(
            classify_v6(&unreachable_v6(DST6, 58, 7, 41), other, DST6, 7, 42, true),
            Reply::NotMine
        );
        assert_eq!(
            classify_v6(
                &unreachable_v6(DST6, 58, 7, 42)[..50],
                other,
                DST6,
                7,
                42,
                true
            ),
            Reply::NotMine
        );
    }
}
