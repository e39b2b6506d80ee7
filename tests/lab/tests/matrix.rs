//! The matrix: Cilium 1.16 … 1.20 × tunnel / native routing × kube-proxy
//! replacement on / off (L2 announcements only with KPR, as Cilium requires) × tcx / tc.
//! In every cell a healthy restart passes with no outage (the lab's restart is Cilium's: the
//! old programs keep forwarding while the agent is down, ipcache is recreated and refilled);
//! on tcx cells the upgrade to the next minor version passes; and each fault fails with its
//! reason code on a cell chosen so that the faults together cover every version and mode.
mod common;
use common::*;
use std::time::{Duration, Instant};
use stepguard_lab::{AttachMode, Profile, RestartOpts};

#[derive(Clone, Copy, Debug)]
struct Cell {
    version: Profile,
    tunnel: bool,
    kpr: bool,
    attach: AttachMode,
}

impl std::fmt::Display for Cell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Cilium {} {} KPR {} {:?}",
            self.version,
            if self.tunnel { "tunnel" } else { "native" },
            if self.kpr { "on" } else { "off" },
            self.attach
        )
    }
}

fn next(v: Profile) -> Option<Profile> {
    VERSIONS
        .iter()
        .position(|x| *x == v)
        .and_then(|i| VERSIONS.get(i + 1).copied())
}

fn cells() -> Vec<Cell> {
    let mut v = Vec::new();
    for version in VERSIONS {
        for tunnel in [true, false] {
            for kpr in [true, false] {
                for attach in [AttachMode::Tcx, AttachMode::Tc] {
                    v.push(Cell {
                        version,
                        tunnel,
                        kpr,
                        attach,
                    });
                }
            }
        }
    }
    v
}

/// A fault, the restart that produces it, the step body that judges it, and the reason the
/// step must fail with.
struct Fault {
    name: &'static str,
    opts: RestartOpts,
    body: &'static str,
    reason: &'static str,
    /// The cell it runs on (a lab of its own, after that cell's healthy restart).
    on: fn(&Cell) -> bool,
}

fn faults() -> Vec<Fault> {
    use AttachMode::*;
    use Profile::*;
    let ms = Duration::from_millis;
    let quick = r#"{"settle":"1s","timeout":"5s"}"#;
    vec![
        Fault {
            name: "blackhole while the agent is down, over a 100 ms budget",
            opts: RestartOpts {
                down: ms(300),
                blackhole: true,
                ..Default::default()
            },
            body: r#"{"settle":"1s","timeout":"20s","max_gap":"100ms"}"#,
            reason: "gap_over_budget",
            on: |c| c.version == V1_16 && c.tunnel && c.kpr && c.attach == Tc,
        },
        Fault {
            name: "no reload",
            opts: RestartOpts {
                down: ms(100),
                no_reload: true,
                ..Default::default()
            },
            body: quick,
            reason: "datapath_not_reloaded",
            on: |c| c.version == V1_17 && !c.tunnel && !c.kpr && c.attach == Tcx,
        },
        Fault {
            name: "the reloaded datapath skips eth1",
            opts: RestartOpts {
                down: ms(100),
                drop_device: Some("eth1".into()),
                ..Default::default()
            },
            body: r#"{"settle":"1s","timeout":"20s"}"#,
            reason: "device_set_changed",
            on: |c| c.version == V1_18 && c.tunnel && !c.kpr && c.attach == Tc,
        },
        Fault {
            name: "the endpoint map (1 entry) comes back empty",
            opts: RestartOpts {
                down: ms(100),
                flush_map: Some("cilium_lxc".into()),
                ..Default::default()
            },
            body: r#"{"settle":"1s","timeout":"20s"}"#,
            reason: "map_emptied",
            on: |c| c.version == V1_16 && !c.tunnel && !c.kpr && c.attach == Tcx,
        },
        Fault {
            name: "ipcache recreated and never refilled",
            opts: RestartOpts {
                down: ms(100),
                no_refill: true,
                ..Default::default()
            },
            body: r#"{"settle":"1s","timeout":"20s"}"#,
            reason: "map_emptied",
            on: |c| c.version == V1_19 && !c.tunnel && c.kpr && c.attach == Tcx,
        },
        Fault {
            name: "the services map disappears",
            opts: RestartOpts {
                down: ms(100),
                lose_map: Some("cilium_lb4_services_v2".into()),
                ..Default::default()
            },
            body: r#"{"settle":"1s","timeout":"20s"}"#,
            reason: "map_missing",
            on: |c| c.version == V1_20 && c.tunnel && c.kpr && c.attach == Tc,
        },
        Fault {
            name: "XDP keeps the old program",
            opts: RestartOpts {
                down: ms(100),
                stale: Some("cil_xdp_entry".into()),
                ..Default::default()
            },
            body: quick,
            reason: "datapath_not_reloaded",
            on: |c| c.version == V1_18 && !c.tunnel && c.kpr && c.attach == Tcx,
        },
        Fault {
            name: "the overlay keeps the old program",
            opts: RestartOpts {
                down: ms(100),
                stale: Some("cil_from_overlay".into()),
                ..Default::default()
            },
            body: quick,
            reason: "datapath_not_reloaded",
            on: |c| c.version == V1_20 && c.tunnel && !c.kpr && c.attach == Tcx,
        },
    ]
}

/// One cell: a lab, an agent, a healthy restart, the upgrade (tcx cells), a fault (when one is
/// assigned to the cell). Returns what went wrong, one line each.
fn run_cell(c: Cell, faults: &[Fault]) -> Vec<String> {
    let mut errors = Vec::new();
    let fault = faults.iter().find(|f| (f.on)(&c));
    let xdp = c.kpr && !c.tunnel;
    let mut lab = lab(|s| {
        s.profile = c.version;
        s.attach = c.attach;
        s.features.tunnel = c.tunnel;
        s.features.kube_proxy_replacement = c.kpr;
        s.features.l2_announcements = c.kpr;
        s.xdp = xdp;
        if fault.is_some_and(|f| f.opts.flush_map.as_deref() == Some("cilium_lxc")) {
            // The host endpoint only: one entry in cilium_lxc.
            s.pods = 0;
        }
    });
    let agent = AgentProc::start(&lab, &[]);

    // A healthy restart, as Cilium does one: no blackhole, ipcache refilled after 300 ms.
    let id = agent.begin_probing(r#"{"settle":"1s","timeout":"20s"}"#);
    lab.restart(&RestartOpts {
        down: Duration::from_millis(200),
        refill_after: Duration::from_millis(300),
        ..Default::default()
    })
    .unwrap();
    let v = agent.verdict(&id);
    if v["verdict"]["status"] != "passed" {
        errors.push(format!(
            "{c}: healthy restart {}: {}",
            v["verdict"]["status"], v["verdict"]["summary"]
        ));
    }
    for g in v["gaps"].as_array().into_iter().flatten() {
        if g["count"] != 0 {
            errors.push(format!("{c}: healthy restart had an outage: {g}"));
        }
    }
    for key in [
        Some("eth0"),
        Some("eth1"),
        c.tunnel.then_some("cilium_vxlan"),
        xdp.then_some("eth0:xdp"),
    ]
    .into_iter()
    .flatten()
    {
        if v["baseline"]["programs"][key].is_null() {
            errors.push(format!(
                "{c}: the reload did not follow {key}: {}",
                v["baseline"]["programs"]
            ));
        }
    }
    let m = &v["maps"];
    match m
        .get("cilium_ipcache")
        .or_else(|| m.get("cilium_ipcache_v2"))
    {
        Some(ipc) if ipc["class"] == "recreated" && ipc["recreated"] == true => {}
        other => errors.push(format!("{c}: ipcache not judged as recreated: {other:?}")),
    }

    // The upgrade to the next minor version, declared by the step.
    if let (AttachMode::Tcx, Some(to)) = (c.attach, next(c.version)) {
        let body = format!(r#"{{"settle":"1s","timeout":"20s","expect":{{"cilium":"{to}"}}}}"#);
        let id = agent.begin_probing(&body);
        lab.restart(&RestartOpts {
            down: Duration::from_millis(200),
            to: Some(to),
            ..Default::default()
        })
        .unwrap();
        let v = agent.verdict(&id);
        if v["verdict"]["status"] != "passed" {
            errors.push(format!(
                "{c}: upgrade to {to} {}: {}",
                v["verdict"]["status"], v["verdict"]["summary"]
            ));
        }
        if c.version == Profile::V1_17 {
            // ipcache is renamed: judged under its new name against the old one's baseline.
            if !m_judged(&v, "cilium_ipcache").starts_with("renamed by design")
                || !m_judged(&v, "cilium_ipcache_v2").starts_with("renamed from cilium_ipcache")
            {
                errors.push(format!(
                    "{c}: ipcache after the upgrade: {} / {}",
                    v["maps"]["cilium_ipcache"], v["maps"]["cilium_ipcache_v2"]
                ));
            }
            let mut gone = vec!["cilium_node_map"];
            if c.tunnel {
                gone.push("cilium_tunnel_map");
            }
            for name in gone {
                if !m_judged(&v, name).starts_with("removed by design") {
                    errors.push(format!(
                        "{c}: {name} after the upgrade: {}",
                        v["maps"][name]
                    ));
                }
            }
        }
    }

    if let Some(f) = fault {
        let id = agent.begin_probing(f.body);
        lab.restart(&f.opts).unwrap();
        let v = agent.verdict(&id);
        if v["verdict"]["status"] != "failed" || !reasons(&v).iter().any(|r| r == f.reason) {
            errors.push(format!(
                "{c}: fault {:?} should fail with {}: {} {:?} ({})",
                f.name,
                f.reason,
                v["verdict"]["status"],
                reasons(&v),
                v["verdict"]["summary"]
            ));
        }
    }
    errors
}

fn m_judged<'a>(v: &'a serde_json::Value, name: &str) -> &'a str {
    v["maps"][name]["judged"].as_str().unwrap_or("")
}

#[test]
fn every_version_mode_and_attachment_restarts_upgrades_and_fails_its_faults() {
    require_root();
    let faults = faults();
    let cells = cells();
    assert_eq!(cells.len(), 40);
    for f in &faults {
        assert_eq!(
            cells.iter().filter(|c| (f.on)(c)).count(),
            1,
            "fault {:?} names exactly one cell",
            f.name
        );
    }
    let t0 = Instant::now();
    let mut errors = Vec::new();
    for c in cells {
        let t = Instant::now();
        let e = run_cell(c, &faults);
        eprintln!(
            "matrix: {c}: {} in {:.1}s",
            if e.is_empty() { "ok" } else { "FAILED" },
            t.elapsed().as_secs_f64()
        );
        errors.extend(e);
    }
    eprintln!("matrix: 40 cells in {:.0}s", t0.elapsed().as_secs_f64());
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}
