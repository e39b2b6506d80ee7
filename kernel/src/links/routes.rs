//! Routes: which devices carry default and node routes, and where an address's route ends.
use super::*;

/// Output devices of default routes (main table) and of routes with a global-unicast
/// destination (any table), IPv4 and IPv6, as Cilium's devices controller reads them.
/// Multipath routes name their devices in nexthops and are not followed.
pub(super) async fn routes(
    handle: &rtnetlink::Handle,
) -> Result<(BTreeSet<u32>, BTreeSet<u32>), LinkError> {
    use netlink_packet_route::route::{RouteAddress, RouteAttribute, RouteHeader};
    let (mut default, mut global) = (BTreeSet::new(), BTreeSet::new());
    for msg in [
        rtnetlink::RouteMessageBuilder::<std::net::Ipv4Addr>::new().build(),
        rtnetlink::RouteMessageBuilder::<std::net::Ipv6Addr>::new().build(),
    ] {
        let mut dump = handle.route().get(msg).execute();
        while let Some(r) = dump.try_next().await.map_err(|e| LinkError::Dump {
            what: "route",
            message: e.to_string(),
        })? {
            let mut table = u32::from(r.header.table);
            let (mut oif, mut dst) = (None, None);
            for a in &r.attributes {
                match a {
                    RouteAttribute::Table(t) => table = *t,
                    RouteAttribute::Oif(i) => oif = Some(*i),
                    RouteAttribute::Destination(RouteAddress::Inet(ip)) => {
                        dst = Some(IpAddr::V4(*ip))
                    }
                    RouteAttribute::Destination(RouteAddress::Inet6(ip)) => {
                        dst = Some(IpAddr::V6(*ip))
                    }
                    _ => {}
                }
            }
            let Some(oif) = oif else { continue };
            if r.header.destination_prefix_length == 0
                && table == u32::from(RouteHeader::RT_TABLE_MAIN)
            {
                default.insert(oif);
            }
            if dst.is_some_and(|ip| global_unicast(&ip)) {
                global.insert(oif);
            }
        }
    }
    Ok((default, global))
}

/// Where this node's routing ends for `addr` (`ip route get`, in the current network
/// namespace): `Some(why)` when on this node — a local address, or a route out of an
/// endpoint device (`lxc*`: a local pod) — and None when it leaves the node.
pub async fn route_ends_here(addr: IpAddr) -> Result<Option<String>, String> {
    use netlink_packet_route::route::{RouteAttribute, RouteType};
    let (conn, handle, _) = rtnetlink::new_connection().map_err(|e| e.to_string())?;
    let task = tokio::spawn(conn);
    let msg = match addr {
        IpAddr::V4(a) => rtnetlink::RouteMessageBuilder::<std::net::Ipv4Addr>::new()
            .destination_prefix(a, 32)
            .build(),
        IpAddr::V6(a) => rtnetlink::RouteMessageBuilder::<std::net::Ipv6Addr>::new()
            .destination_prefix(a, 128)
            .build(),
    };
    let r = async {
        let mut answers = handle.route().get(msg).execute();
        let Some(route) = answers
            .try_next()
            .await
            .map_err(|e| format!("route lookup of {addr}: {e}"))?
        else {
            return Err(format!("route lookup of {addr}: no answer"));
        };
        if route.header.kind == RouteType::Local {
            return Ok(Some("a local address of this node".to_string()));
        }
        let Some(oif) = route.attributes.iter().find_map(|a| match a {
            RouteAttribute::Oif(i) => Some(*i),
            _ => None,
        }) else {
            return Ok(None);
        };
        let mut links = handle.link().get().match_index(oif).execute();
        let name = match links.try_next().await {
            Ok(Some(m)) => device_of(&m).name,
            Ok(None) => return Err(format!("route lookup of {addr}: no device {oif}")),
            Err(e) => return Err(format!("route lookup of {addr}: device {oif}: {e}")),
        };
        Ok(is_endpoint_device(&name).then(|| format!("routed to the local endpoint {name}")))
    }
    .await;
    task.abort();
    r
}
