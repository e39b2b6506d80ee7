//! The node's devices and pinned maps as the slow loop last saw them.
use super::{DeviceLabels, KindLabels, MapLabels};
use crate::families::Registrar;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

pub struct NodeMetrics {
    pub device_selected: Family<DeviceLabels, Gauge>,
    pub map_present: Family<MapLabels, Gauge>,
    pub map_entries: Family<MapLabels, Gauge>,
    pub endpoint_maps: Family<KindLabels, Gauge>,
}

impl NodeMetrics {
    pub fn register(r: &mut Registrar) -> NodeMetrics {
        let device_selected = Family::<DeviceLabels, Gauge>::default();
        r.register(
            "device_selected",
            "1 when the host device carries cil_from_netdev",
            device_selected.clone(),
        );
        let map_present = Family::<MapLabels, Gauge>::default();
        r.register(
            "bpf_map_present",
            "1 when the global pinned map is present and opens",
            map_present.clone(),
        );
        let map_entries = Family::<MapLabels, Gauge>::default();
        r.register(
            "bpf_map_entries",
            "Entries in the global pinned map (hash-like maps)",
            map_entries.clone(),
        );
        let endpoint_maps = Family::<KindLabels, Gauge>::default();
        r.register(
            "bpf_endpoint_maps",
            "Per-endpoint pinned maps by kind",
            endpoint_maps.clone(),
        );
        NodeMetrics {
            device_selected,
            map_present,
            map_entries,
            endpoint_maps,
        }
    }
}
