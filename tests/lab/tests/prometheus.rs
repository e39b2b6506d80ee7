//! A real Prometheus (Debian's package, started here on loopback in the lab's node namespace,
//! with its own config and data directory) scrapes the agent; and promtool's lint of the
//! exposition reports nothing beyond the documented OpenMetrics-vs-promtool-2.42 difference.
mod common;
use common::*;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use stepguard_lab::RestartOpts;

struct Prometheus {
    child: std::process::Child,
    port: u16,
    ns: String,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    fn start(lab: &stepguard_lab::Lab, agent: &AgentProc) -> Prometheus {
        let dir = lab.state.run_dir.join("prometheus");
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = dir.join("prometheus.yml");
        std::fs::write(&cfg, format!("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n  - job_name: stepguard\n    static_configs:\n      - targets: [\"{}\"]\n", agent.addr)).unwrap();
        let port = free_port();
        let child = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", lab.node_ns()))
            .args(["--", "prometheus"])
            .arg(format!("--config.file={}", cfg.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start prometheus (Debian package `prometheus`)");
        Prometheus {
            child,
            port,
            ns: lab.node_ns(),
        }
    }

    fn query(&self, q: &str) -> Vec<serde_json::Value> {
        let enc: String = q
            .bytes()
            .map(|b| {
                if b.is_ascii_alphanumeric() || b == b'_' {
                    (b as char).to_string()
                } else {
                    format!("%{b:02X}")
                }
            })
            .collect();
        let (s, body) = http(
            &self.ns,
            format!("127.0.0.1:{}", self.port).parse().unwrap(),
            "GET",
            &format!("/api/v1/query?query={enc}"),
            None,
            None,
        );
        if s != 200 {
            return vec![];
        }
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        v["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    /// Polls a query until it returns at least `n` series (bounded).
    fn wait_for(&self, q: &str, n: usize) -> Vec<serde_json::Value> {
        let deadline = Instant::now() + Duration::from_secs(45);
        loop {
            let up = {
                let (ns, port) = (self.ns.clone(), self.port);
                stepguard_lab::sys::netns::in_netns(&ns, move || {
                    Ok(std::net::TcpStream::connect(("127.0.0.1", port)).is_ok())
                })
                .unwrap_or(false)
            };
            if up {
                let r = self.query(q);
                if r.len() >= n {
                    return r;
                }
            }
            assert!(
                Instant::now() < deadline,
                "Prometheus never returned {n} series for {q}"
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

#[test]
fn a_real_prometheus_scrapes_check_and_step_metrics() {
    let mut lab = lab(|_| {});
    let agent = AgentProc::start(&lab, &[]);
    let prom = Prometheus::start(&lab, &agent);
    let checks = prom.wait_for("stepguard_check_passed", 5);
    let names: std::collections::BTreeSet<String> = checks
        .iter()
        .map(|r| r["metric"]["check"].as_str().unwrap().to_string())
        .collect();
    for c in ["devices", "maps", "vips", "dns", "config"] {
        assert!(names.contains(c), "{c} in {names:?}");
    }
    let id = agent.begin_probing(r#"{"settle":"1s","timeout":"30s"}"#);
    let r = lab
        .restart(&RestartOpts {
            down: Duration::from_millis(200),
            blackhole: true,
            ..Default::default()
        })
        .unwrap();
    let verdict = agent.verdict(&id);
    assert_eq!(verdict["verdict"]["status"], "passed");
    let steps = prom.wait_for("stepguard_steps_total{verdict=\"passed\"}", 1);
    assert_eq!(steps[0]["value"][1], "1");
    let gaps = prom.wait_for("stepguard_last_step_gap_seconds", 2);
    for g in gaps {
        let v: f64 = g["value"][1].as_str().unwrap().parse().unwrap();
        let target = g["metric"]["target"].as_str().unwrap();
        // Prometheus has exactly the gap of the verdict, and that gap is the lab's window
        // within the agent's own error bound.
        let measured = verdict["gaps"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["target"] == target)
            .unwrap_or_else(|| panic!("no gap for {target} in {verdict}"));
        assert!(
            (v - measured["longest_s"].as_f64().unwrap()).abs() < 1e-6,
            "Prometheus has {v} for {target}, the verdict {measured}"
        );
        assert_gap_matches(measured, &r, target);
    }
    prom.wait_for(
        "stepguard_probe_duration_seconds_bucket{target=\"gateway\",le=\"0.001\"}",
        1,
    );
    prom.wait_for("stepguard_cilium_drops_total", 1);
}

#[test]
fn promtool_finds_nothing_but_the_documented_counter_naming_difference() {
    let lab = lab(|_| {});
    let agent = AgentProc::start(&lab, &[]);
    // Make every counter family have samples.
    agent.begin(r#"{"id":"lint","settle":"1s","timeout":"30s"}"#);
    agent.delete("/v1/steps/lint", None);
    let (_, exposition) = agent.get("/metrics");
    assert!(
        exposition.ends_with("# EOF\n"),
        "OpenMetrics ends with # EOF"
    );
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian package `prometheus`)");
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(exposition.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let problems =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    // OpenMetrics puts HELP/TYPE on the counter family (`x`) and samples on `x_total`;
    // promtool 2.42 parses the classic text format, where the family is `x_total`, so it
    // reports each counter as "no help text". That is the only difference allowed.
    for line in problems.lines().filter(|l| !l.trim().is_empty()) {
        let (name, problem) = line.split_once(' ').unwrap_or((line, ""));
        assert_eq!(
            problem, "no help text",
            "unexpected promtool finding: {line}"
        );
        let family = name
            .strip_suffix("_total")
            .unwrap_or_else(|| panic!("only counters may differ: {line}"));
        assert!(
            exposition.contains(&format!("# TYPE {family} counter")),
            "{family} is a counter with HELP: {line}"
        );
        assert!(exposition.contains(&format!("# HELP {family} ")), "{line}");
    }
}
