//! Which MAC address the kernel sends to for an IP: the neighbour (ARP) table, dumped once and
//! then followed through rtnetlink's neighbour notifications (no privileges needed). A
//! witness on the LAN uses it to see a VIP's L2-announcement lease move: the new holder's
//! gratuitous ARP replaces the MAC of the VIP's entry.
use futures_util::TryStreamExt;
use netlink_packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourMessage, NeighbourState,
};
use rtnetlink::packet_core::NetlinkPayload;
use rtnetlink::packet_route::RouteNetlinkMessage;
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// Transitions kept per address (a flapping entry cannot grow the log without bound).
const MAX_PER_ADDR: usize = 1024;

/// (unix seconds, MAC or None when the entry is gone, incomplete or failed).
pub type MacAt = (f64, Option<String>);

/// MAC transitions per watched address.
#[derive(Default)]
pub struct NeighLog {
    log: Mutex<BTreeMap<IpAddr, Vec<MacAt>>>,
}

impl NeighLog {
    fn record(&self, ip: IpAddr, at: f64, mac: Option<String>) {
        let mut log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        let Some(v) = log.get_mut(&ip) else { return };
        if v.last().map(|l| &l.1) == Some(&mac) {
            return;
        }
        if v.len() >= MAX_PER_ADDR {
            v.remove(0);
        }
        v.push((at, mac));
    }

    /// The MAC in use at `at` and every change after it, up to now.
    pub fn since(&self, ip: IpAddr, at: f64) -> Vec<MacAt> {
        let log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        let Some(v) = log.get(&ip) else {
            return vec![];
        };
        let first = v.iter().rposition(|x| x.0 <= at);
        let start = first.unwrap_or(0);
        v[start..]
            .iter()
            .map(|(t, m)| (t.max(at), m.clone()))
            .collect()
    }
}

fn mac_of(msg: &NeighbourMessage) -> (Option<IpAddr>, Option<String>) {
    let mut ip = None;
    let mut mac = None;
    for a in &msg.attributes {
        match a {
            NeighbourAttribute::Destination(NeighbourAddress::Inet(v4)) => {
                ip = Some(IpAddr::V4(*v4))
            }
            NeighbourAttribute::Destination(NeighbourAddress::Inet6(v6)) => {
                ip = Some(IpAddr::V6(*v6))
            }
            NeighbourAttribute::LinkLayerAddress(l) if l.len() == 6 => {
                mac = Some(
                    l.iter()
                        .map(|b| format!("{b:02x}"))
                        .collect::<Vec<_>>()
                        .join(":"),
                )
            }
            _ => {}
        }
    }
    let usable = !matches!(
        msg.header.state,
        NeighbourState::Incomplete | NeighbourState::Failed | NeighbourState::None
    );
    (ip, mac.filter(|_| usable))
}

/// Follows the neighbour entries of `watch` from now on. Errors (no netlink) are returned at
/// once; a watcher that dies later logs it, and the log simply stops changing.
pub async fn follow(watch: &[IpAddr]) -> std::io::Result<Arc<NeighLog>> {
    let log = Arc::new(NeighLog::default());
    {
        let mut l = log.log.lock().unwrap_or_else(|e| e.into_inner());
        for ip in watch {
            l.insert(*ip, Vec::new());
        }
    }
    let (conn, handle, mut messages) =
        rtnetlink::new_multicast_connection(&[rtnetlink::MulticastGroup::Neigh])?;
    tokio::spawn(conn);
    let now = super::clock::now();
    let mut dump = handle.neighbours().get().execute();
    while let Ok(Some(msg)) = dump.try_next().await {
        if let (Some(ip), mac) = mac_of(&msg) {
            log.record(ip, now, mac);
        }
    }
    let l2 = log.clone();
    tokio::spawn(async move {
        use futures_util::StreamExt;
        while let Some((m, _)) = messages.next().await {
            let at = super::clock::now();
            match m.payload {
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewNeighbour(n)) => {
                    if let (Some(ip), mac) = mac_of(&n) {
                        l2.record(ip, at, mac);
                    }
                }
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelNeighbour(n)) => {
                    if let (Some(ip), _) = mac_of(&n) {
                        l2.record(ip, at, None);
                    }
                }
                _ => {}
            }
        }
        tracing::warn!("the neighbour notification stream ended: MAC changes are no longer seen");
    });
    Ok(log)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_keeps_changes_only_and_answers_from_a_time() {
        let log = NeighLog::default();
        let ip: IpAddr = "192.0.2.7".parse().unwrap();
        log.log.lock().unwrap().insert(ip, vec![]);
        log.record(ip, 1.0, Some("aa".into()));
        log.record(ip, 2.0, Some("aa".into()));
        log.record(ip, 3.0, Some("bb".into()));
        log.record(ip, 4.0, None);
        assert_eq!(
            log.since(ip, 2.5),
            vec![
                (2.5, Some("aa".into())),
                (3.0, Some("bb".into())),
                (4.0, None)
            ]
        );
        assert_eq!(log.since(ip, 0.5).len(), 3, "from the first known entry");
        let other: IpAddr = "192.0.2.8".parse().unwrap();
        log.record(other, 1.0, Some("cc".into()));
        assert!(log.since(other, 0.0).is_empty(), "only watched addresses");
    }
}
