//! Building a simulated node: namespaces, devices, the overlay, pods, bpffs and maps, the
//! datapath's programs and the fabric's servers.
use super::*;

impl Lab {
    pub(super) fn build(&mut self) -> Result<()> {
        let p = self.state.spec.prefix.clone();
        let node = self.node_ns();
        let fabric = self.fabric_ns();
        // Namespaces: recorded first, then made.
        let pods: Vec<String> = (0..self.state.spec.pods)
            .map(|i| format!("{p}-pod{i}"))
            .collect();
        self.state.netns = [node.clone(), fabric.clone()]
            .into_iter()
            .chain(pods.iter().cloned())
            .collect();
        self.save()?;
        for ns in [&node, &fabric] {
            netns::add_netns(ns)?;
        }
        let mut batch = String::new();
        for ns in &pods {
            batch.push_str(&format!("netns add {ns}\n"));
        }
        self.ip_batch(None, &batch)?;

        // Host devices: eth0/eth1 are veths into the fabric, which holds the VIPs.
        netns::add_veth(&node, "eth0", &fabric, "fab0")?;
        netns::add_addr(&node, "eth0", &format!("{NODE_ETH0}/24"))?;
        netns::add_addr(&fabric, "fab0", &format!("{FABRIC_ETH0}/24"))?;
        match self.state.spec.lan.clone() {
            None => {
                netns::add_veth(&node, "eth1", &fabric, "fab1")?;
                netns::add_addr(&node, "eth1", &format!("{NODE_ETH1}/24"))?;
                netns::add_addr(&fabric, "fab1", &format!("{FABRIC_ETH1}/24"))?;
            }
            Some(port) => {
                // eth1 is this node's NIC on the shared LAN; ARP is answered only for
                // addresses on the NIC itself (the L2-announced VIPs), see `lan`.
                let peer = format!("n{}", port.index);
                netns::add_veth(&node, "eth1", &port.ns, &peer)?;
                netns::ip(&port.ns, &["link", "set", &peer, "master", "br0"])?;
                netns::add_addr(&node, "eth1", &format!("{}/24", node_addr(port.index)))?;
                netns::sysctl(
                    &node,
                    &[
                        "net.ipv4.conf.all.arp_ignore=1",
                        "net.ipv4.conf.eth1.arp_ignore=1",
                    ],
                )?;
            }
        }
        for dev in &self.state.spec.xdp_refused {
            let peer = match (dev.as_str(), &self.state.spec.lan) {
                ("eth0", _) => "fab0".to_string(),
                ("eth1", None) => "fab1".to_string(),
                ("eth1", Some(port)) => format!("n{}", port.index),
                _ => bail!("xdp_refused: {dev} is no host device of the lab (eth0, eth1)"),
            };
            let ns = match &self.state.spec.lan {
                Some(port) if dev == "eth1" => port.ns.clone(),
                _ => fabric.clone(),
            };
            netns::ip(&ns, &["link", "set", &peer, "mtu", "9000"])?;
        }
        for vip in [GATEWAY_VIP, DNS_VIP] {
            netns::add_addr(&fabric, "lo", &format!("{vip}/32"))?;
        }
        netns::ip(
            &node,
            &[
                "route",
                "add",
                "198.51.100.0/24",
                "via",
                FABRIC_ETH0,
                "dev",
                "eth0",
            ],
        )?;
        // Default routes through both NICs (Cilium does not auto-detect a veth without one).
        self.ip_batch(
            Some(&node),
            &format!(
                "route add default via {FABRIC_ETH0} dev eth0 metric 100\nroute add default via {} dev eth1 metric 200\n",
                if self.state.spec.lan.is_some() { LAN_ROUTER } else { FABRIC_ETH1 }
            ),
        )?;
        // cilium_host/cilium_net are a veth pair in Cilium too.
        netns::ip(
            &node,
            &[
                "link",
                "add",
                "cilium_host",
                "type",
                "veth",
                "peer",
                "name",
                "cilium_net",
            ],
        )?;
        netns::ip(&node, &["link", "set", "cilium_host", "up"])?;
        let peers = self.overlay_peers();
        if self.state.spec.features.tunnel {
            // The overlay device, as Cilium creates it in tunnel mode (VXLAN, port 8472).
            // Cilium's is `external` (its programs set the tunnel key per packet); a LAN lab
            // whose nodes reach each other's pods uses the kernel's own VXLAN forwarding
            // instead (a VNI, the node's LAN address, one flood entry per peer), since the
            // lab's programs do not route.
            if peers.is_empty() {
                netns::ip(
                    &node,
                    &[
                        "link", "add", OVERLAY, "type", "vxlan", "external", "dstport", "8472",
                    ],
                )?;
            } else {
                let local = node_addr(self.node_index()).to_string();
                netns::ip(
                    &node,
                    &[
                        "link",
                        "add",
                        OVERLAY,
                        "type",
                        "vxlan",
                        "id",
                        "2",
                        "dstport",
                        "8472",
                        "local",
                        &local,
                        "dev",
                        "eth1",
                        "nolearning",
                    ],
                )?;
            }
            netns::ip(&node, &["link", "set", OVERLAY, "up"])?;
        } else if !peers.is_empty() {
            bail!("an overlay between LAN nodes needs tunnel routing");
        }
        netns::ip(&node, &["link", "set", "cilium_net", "up"])?;
        netns::add_addr(&node, "cilium_host", &format!("{CILIUM_HOST_IP}/32"))?;

        // Pods: lxc veths into their own namespaces, with a /32 route each (as Cilium does).
        let mut node_batch = String::new();
        let mut lxc = Vec::new();
        for (i, ns) in pods.iter().enumerate() {
            let name = lxc_name(&p, i as u32);
            let ip = Ipv4Addr::from(pod_ip(self.node_index(), i as u32));
            node_batch.push_str(&format!("link add {name} type veth peer name eth0 netns {ns}\nlink set {name} up\nroute add {ip}/32 dev {name}\n"));
            lxc.push((name, 1000 + i as u16));
        }
        if !peers.is_empty() {
            // Cilium's health endpoint (`lxc_health`, an address from the pod CIDR).
            let health = self.health_ns();
            self.state.netns.push(health.clone());
            self.save()?;
            netns::add_netns(&health)?;
            let ip = health_ip(self.node_index());
            node_batch.push_str(&format!(
                "link add lxc_health type veth peer name eth0 netns {health}
link set lxc_health up
route add {ip}/32 dev lxc_health
"
            ));
            lxc.push(("lxc_health".to_string(), HEALTH_ENDPOINT_ID));
        }
        self.ip_batch(Some(&node), &node_batch)?;
        if !peers.is_empty() {
            self.build_overlay(&peers)?;
        }
        for (i, ns) in pods.iter().enumerate() {
            let ip = Ipv4Addr::from(pod_ip(self.node_index(), i as u32));
            if peers.is_empty() {
                self.ip_batch(
                    Some(ns),
                    &format!("link set eth0 up\naddr add {ip}/32 dev eth0\n"),
                )?;
            } else {
                // Reachable from the other nodes' pods over the overlay.
                self.endpoint_routes(ns, &lxc_name(&p, i as u32), ip)?;
            }
        }
        self.state.lxc = lxc;
        self.save()?;

        // Private bpffs, outside /sys.
        std::fs::create_dir_all(&self.state.bpffs)?;
        self.state.bpffs_mounted = true;
        self.save()?;
        netns::run(
            "mount",
            &["-t", "bpf", "bpffs", &self.state.bpffs.to_string_lossy()],
        )?;
        std::fs::create_dir_all(maps::globals_dir(&self.state.bpffs))?;
        std::fs::create_dir_all(self.state.bpffs.join("stepguard-lab"))?;

        self.create_maps()?;
        self.write_cilium_config()?;

        let plan = datapath::plan(&self.state.devices, &self.state.lxc, self.plan_opts(true));
        self.state.attachments = datapath::attach_all_xdp(
            &node,
            &self.state.bpffs,
            self.state.spec.attach,
            &plan,
            self.state.spec.xdp_best_effort,
        )?;
        self.create_tail_call_maps()?;
        self.save()?;

        self.start_services()?;
        if !peers.is_empty() {
            let dir = self.state.run_dir.join("services-health");
            std::fs::create_dir_all(&dir)?;
            let ip = health_ip(self.node_index()).to_string();
            let p = servers::start_nginx(&self.health_ns(), &dir, &ip, HEALTH_PORT, None)?;
            self.state.procs.push(p);
            self.save()?;
        }
        self.write_stepguard_config()?;
        self.state.ready = true;
        self.save()
    }

    /// This node's index on a LAN (0 for a single-node lab).
    pub(super) fn node_index(&self) -> u8 {
        self.state.spec.lan.as_ref().map_or(0, |l| l.index)
    }

    pub(super) fn overlay_peers(&self) -> Vec<u8> {
        self.state
            .spec
            .lan
            .as_ref()
            .map(|l| l.peers.clone())
            .unwrap_or_default()
    }

    /// The namespace of this node's health endpoint (LAN labs with an overlay).
    pub fn health_ns(&self) -> String {
        format!("{}-health", self.state.spec.prefix)
    }

    pub(super) fn plan_opts(&self, host: bool) -> datapath::PlanOpts {
        let s = &self.state.spec;
        datapath::PlanOpts {
            xdp: s.xdp,
            to_netdev: s.features.devices_required(),
            host,
            overlay: s.features.tunnel.then_some(OVERLAY),
        }
    }

    pub(super) fn ip_batch(&self, ns: Option<&str>, cmds: &str) -> Result<()> {
        if cmds.is_empty() {
            return Ok(());
        }
        let file = self.state.run_dir.join("ip-batch");
        std::fs::write(&file, cmds)?;
        let f = file.to_string_lossy().into_owned();
        let r = match ns {
            Some(ns) => netns::run("ip", &["-n", ns, "-batch", &f]),
            None => netns::run("ip", &["-batch", &f]),
        };
        let _ = std::fs::remove_file(&file);
        r.map(|_| ())
    }

    /// What the maps are filled with: pod IPs, node IPs, VIPs.
    #[allow(clippy::type_complexity)]
    pub(super) fn fact_data(&self) -> (Vec<[u8; 4]>, [[u8; 4]; 2], [([u8; 4], u16); 2]) {
        (
            (0..self.state.spec.pods)
                .map(|i| pod_ip(self.node_index(), i))
                // The health endpoint is an endpoint like the pods (in cilium_lxc).
                .chain(
                    (!self.overlay_peers().is_empty())
                        .then(|| health_ip(self.node_index()).octets()),
                )
                .collect(),
            [[192, 0, 2, 1], [203, 0, 113, 1]],
            [
                (GATEWAY_VIP.octets(), GATEWAY_PORT),
                (DNS_VIP.octets(), DNS_PORT),
            ],
        )
    }

    pub(super) fn facts_and_create(&self, only: Option<&str>) -> Result<()> {
        let (pod_ips, node_ips, vips) = self.fact_data();
        let facts = maps::NodeFacts {
            pod_ips: &pod_ips,
            node_ips: &node_ips,
            vips: &vips,
        };
        let s = &self.state.spec;
        for m in maps::global_maps(s.profile, s.features, s.capacity) {
            if only.is_some_and(|o| o != m.name) {
                continue;
            }
            let fd = maps::create_pinned(&self.state.bpffs, &m)?;
            maps::populate(&fd, &m, &facts, s.ct_fill)?;
        }
        Ok(())
    }

    pub(super) fn start_services(&mut self) -> Result<()> {
        let dir = self.state.run_dir.join("services");
        std::fs::create_dir_all(&dir)?;
        let fabric = self.fabric_ns();
        let records = [
            (format!("gateway.{DNS_ZONE}"), GATEWAY_VIP.to_string()),
            (format!("dns.{DNS_ZONE}"), DNS_VIP.to_string()),
            (format!("media.{DNS_ZONE}"), "198.51.100.20".to_string()),
        ];
        let p = servers::start_dnsmasq(&fabric, &dir, &DNS_VIP.to_string(), &records)?;
        self.state.procs.push(p);
        self.save()?;
        // The gateway also serves TLS on 443, with a certificate of the lab's own CA.
        let (_, cert, key) = servers::lab_certificate(&dir, &format!("gateway.{DNS_ZONE}"))?;
        let tls = servers::Tls {
            port: GATEWAY_TLS_PORT,
            cert,
            key,
        };
        let p = servers::start_nginx(
            &fabric,
            &dir,
            &GATEWAY_VIP.to_string(),
            GATEWAY_PORT,
            Some(&tls),
        )?;
        self.state.procs.push(p);
        self.save()?;
        // The "agent" loads its config at start, as Cilium's does (the init container merges
        // the ConfigMap into what the agent reads); its API tells what it loaded.
        self.load_agent_config()?;
        std::fs::create_dir_all(self.agent_run_dir())?;
        self.start_agent_api()?;
        // Ready means reachable from the node namespace, through eth0 and the fake datapath.
        let node = self.node_ns();
        process::wait_until("gateway VIP (nginx)", Duration::from_secs(10), || {
            netns::in_netns(&node, || {
                std::net::TcpStream::connect_timeout(
                    &(GATEWAY_VIP, GATEWAY_PORT).into(),
                    Duration::from_millis(500),
                )?;
                Ok(())
            })
        })?;
        let node = self.node_ns();
        process::wait_until("DNS VIP (dnsmasq)", Duration::from_secs(10), || {
            let out = netns::run(
                "nsenter",
                &[
                    &format!("--net={}", netns::netns_path(&node).display()),
                    "--",
                    "dig",
                    "+time=1",
                    "+tries=1",
                    "+short",
                    &format!("@{DNS_VIP}"),
                    &format!("gateway.{DNS_ZONE}"),
                ],
            )?;
            if out.trim() == GATEWAY_VIP.to_string() {
                Ok(())
            } else {
                bail!("unexpected answer {out:?}")
            }
        })
    }
}
