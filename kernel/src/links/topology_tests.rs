use super::*;

fn ip(args: &str) {
    let st = std::process::Command::new("ip")
        .args(args.split_whitespace())
        .status()
        .expect("run ip");
    assert!(st.success(), "ip {args}");
}

/// In a network namespace of its own (root): the topology is dumped once and reused while
/// nothing about host devices changes; endpoint devices coming and going are counted
/// without a dump; an address, a new host device or a route change makes the next
/// observation dump again and see it.
#[test]
fn the_topology_is_dumped_again_only_when_host_devices_change() {
    std::thread::spawn(|| {
        // SAFETY: moves only this thread (and the processes it starts) to a new netns.
        let r = unsafe { libc::unshare(libc::CLONE_NEWNET) };
        assert_eq!(
            r,
            0,
            "unshare(CLONE_NEWNET) needs root: {}",
            std::io::Error::last_os_error()
        );
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            ip("link add hst0 type veth peer name hst1");
            ip("link add lxc1 type veth peer name lxc2");
            let bpffs = Path::new("/nonexistent-bpffs");
            let mut c = TopologyCache::new();
            assert!(c.events.is_some(), "subscribed");
            let o = c.observe(bpffs).await.unwrap();
            assert_eq!(c.dumps, 1);
            assert_eq!(o.endpoint_devices, 2);
            assert!(o.devices.iter().any(|d| d.name == "hst0"));
            c.observe(bpffs).await.unwrap();
            assert_eq!(c.dumps, 1, "nothing changed: no dump");
            // Endpoints come and go: counted, no dump.
            ip("link add lxc3 type veth peer name lxc4");
            ip("link set lxc3 up");
            let o = c.observe(bpffs).await.unwrap();
            assert_eq!((c.dumps, o.endpoint_devices), (1, 4));
            ip("link del lxc1");
            let o = c.observe(bpffs).await.unwrap();
            assert_eq!((c.dumps, o.endpoint_devices), (1, 2));
            // A host device's link state is read on every observation, without a dump.
            ip("link set hst0 up");
            let o = c.observe(bpffs).await.unwrap();
            let hst0 = o.devices.iter().find(|d| d.name == "hst0").unwrap();
            assert!(hst0.up);
            let dumps = c.dumps;
            // An address on a host device: dumped again, and seen.
            ip("addr add 192.0.2.1/24 dev hst0");
            let o = c.observe(bpffs).await.unwrap();
            assert_eq!(c.dumps, dumps + 1);
            let hst0 = o.devices.iter().find(|d| d.name == "hst0").unwrap();
            assert_eq!(
                hst0.global_addrs,
                vec!["192.0.2.1".parse::<IpAddr>().unwrap()]
            );
            // A default route through it.
            ip("route add default via 192.0.2.254 dev hst0");
            let o = c.observe(bpffs).await.unwrap();
            assert_eq!(c.dumps, dumps + 2);
            assert!(
                o.devices
                    .iter()
                    .find(|d| d.name == "hst0")
                    .unwrap()
                    .default_route
            );
            // A new host device.
            ip("link add hst2 type veth peer name hst3");
            let o = c.observe(bpffs).await.unwrap();
            assert!(o.devices.iter().any(|d| d.name == "hst2"));
            assert_eq!(c.dumps, dumps + 3);
            c.observe(bpffs).await.unwrap();
            assert_eq!(c.dumps, dumps + 3);
        });
    })
    .join()
    .expect("the topology test thread");
}
