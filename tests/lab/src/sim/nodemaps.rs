//! The node's pinned maps: created as Cilium pins them, filled, resized, recreated and
//! renamed across versions.
use super::*;

impl Lab {
    /// The maps of an agent coming back as `to`. An upgrade unpins the global maps the new
    /// version no longer has (1.18 unpins the tunnel map, the v1 node map and the v1 ipcache
    /// it migrates from); a downgrade leaves the newer version's pins alone (Cilium removes
    /// only pins it knows: a 1.17 agent after 1.18 keeps `cilium_ipcache_v2` and
    /// `cilium_policystats` pinned, unused). New maps are created and filled; per-endpoint
    /// policy maps follow the new name prefix (renamed on an upgrade, created beside the
    /// newer ones on a downgrade).
    pub(crate) fn upgrade_maps(&mut self, to: Profile) -> Result<()> {
        let s = &self.state.spec;
        let old: Vec<maps::MapSpec> = maps::global_maps(s.profile, s.features, s.capacity);
        let new: Vec<maps::MapSpec> = maps::global_maps(to, s.features, s.capacity);
        let globals = maps::globals_dir(&self.state.bpffs);
        let downgrade = (to as u8) < (s.profile as u8);
        if !downgrade {
            for m in old.iter().filter(|m| !new.iter().any(|n| n.name == m.name)) {
                let _ = std::fs::remove_file(globals.join(&m.name));
            }
        }
        let from = s.profile;
        self.state.spec.profile = to;
        for m in new.iter().filter(|m| !old.iter().any(|o| o.name == m.name)) {
            self.facts_and_create(Some(&m.name))?;
        }
        // Per-endpoint policy maps renamed by the new version: the old pins go.
        let eps: Vec<u16> = self
            .state
            .lxc
            .iter()
            .map(|l| l.1)
            .chain([self.state.host_endpoint])
            .collect();
        for ep in eps {
            let (a, b) = (
                maps::policy_map_name(from, ep),
                maps::policy_map_name(to, ep),
            );
            if a != b && globals.join(&a).exists() {
                if downgrade {
                    self.create_policy_map(ep)?;
                } else {
                    let _ = std::fs::rename(globals.join(&a), globals.join(&b));
                }
            }
        }
        self.save()
    }

    /// Recreates a global map with twice its max entries (a new id), refilled, as Cilium does
    /// when a map's properties change between versions or configurations.
    pub(crate) fn resize_map(&self, name: &str) -> Result<()> {
        let s = &self.state.spec;
        let Some(mut spec) = maps::global_maps(s.profile, s.features, s.capacity)
            .into_iter()
            .find(|m| m.name == name)
        else {
            bail!("--resize-map {name}: not a global map of this lab");
        };
        spec.max_entries *= 2;
        let fd = maps::create_pinned(&self.state.bpffs, &spec)?;
        let (pod_ips, node_ips, vips) = self.fact_data();
        let facts = maps::NodeFacts {
            pod_ips: &pod_ips,
            node_ips: &node_ips,
            vips: &vips,
        };
        maps::populate(&fd, &spec, &facts, s.ct_fill).map(|_| ())
    }

    /// Replaces the pinned ipcache with a new, empty map (new id).
    pub(crate) fn recreate_ipcache(&self) -> Result<()> {
        match self.global_map_like("cilium_ipcache") {
            Some(spec) => maps::create_pinned(&self.state.bpffs, &spec).map(|_| ()),
            None => Ok(()),
        }
    }

    pub(crate) fn global_map_like(&self, prefix: &str) -> Option<maps::MapSpec> {
        let s = &self.state.spec;
        maps::global_maps(s.profile, s.features, s.capacity)
            .into_iter()
            .find(|m| m.name.starts_with(prefix))
    }

    /// Fills the pinned map (as it is now) with the lab's facts.
    pub(crate) fn fill_map_named_like(&self, prefix: &str) -> Result<()> {
        let Some(spec) = self.global_map_like(prefix) else {
            return Ok(());
        };
        let fd = sys::bpf::obj_get(&maps::globals_dir(&self.state.bpffs).join(&spec.name))?;
        let (pod_ips, node_ips, vips) = self.fact_data();
        let facts = maps::NodeFacts {
            pod_ips: &pod_ips,
            node_ips: &node_ips,
            vips: &vips,
        };
        maps::populate(&fd, &spec, &facts, self.state.spec.ct_fill).map(|_| ())
    }

    /// The endpoint's policy map under the lab version's name, with one entry.
    pub(crate) fn create_policy_map(&self, ep: u16) -> Result<()> {
        let s = &self.state.spec;
        let policy = maps::MapSpec {
            name: maps::policy_map_name(s.profile, ep),
            map_type: if s.profile == Profile::V1_20 {
                maps::LPM_TRIE
            } else {
                maps::HASH
            },
            key_size: 12,
            value_size: 8,
            max_entries: 16384,
            flags: if s.profile == Profile::V1_20 {
                sys::bpf::BPF_F_NO_PREALLOC
            } else {
                0
            },
        };
        let fd = maps::create_pinned(&self.state.bpffs, &policy)?;
        let mut k = vec![0u8; 12];
        if s.profile == Profile::V1_20 {
            k[..4].copy_from_slice(&64u32.to_ne_bytes());
        }
        sys::bpf::map_update(&fd, &k, &[0u8; 8]).with_context(|| format!("write {}", policy.name))
    }

    pub(crate) fn create_maps(&self) -> Result<()> {
        self.facts_and_create(None)?;
        // Per-endpoint maps: policy + tail calls for every pod and the host endpoint.
        let eps = self
            .state
            .lxc
            .iter()
            .map(|l| l.1)
            .chain([self.state.host_endpoint]);
        for ep in eps {
            self.create_policy_map(ep)?;
            let calls = maps::MapSpec {
                name: format!("cilium_calls_{ep:05}"),
                map_type: maps::PROG_ARRAY,
                key_size: 4,
                value_size: 4,
                max_entries: 33,
                flags: 0,
            };
            maps::create_pinned(&self.state.bpffs, &calls)?;
        }
        Ok(())
    }

    /// `cilium_calls_netdev_<ifindex>`, `cilium_calls_hostns_<id>` (and `_xdp_` with XDP):
    /// Cilium re-creates these on every load and replaces the pin after attaching.
    pub(crate) fn create_tail_call_maps(&self) -> Result<()> {
        let node = self.node_ns();
        let mut names = vec![format!(
            "cilium_calls_hostns_{:05}",
            self.state.host_endpoint
        )];
        for d in &self.state.devices {
            if let Ok(idx) = netns::ifindex(&node, d) {
                names.push(format!("cilium_calls_netdev_{idx:05}"));
                if self.state.spec.xdp {
                    names.push(format!("cilium_calls_xdp_{idx:05}"));
                }
            }
        }
        for name in names {
            let m = maps::MapSpec {
                name,
                map_type: maps::PROG_ARRAY,
                key_size: 4,
                value_size: 4,
                max_entries: 33,
                flags: 0,
            };
            maps::create_pinned(&self.state.bpffs, &m)?;
        }
        Ok(())
    }
}
