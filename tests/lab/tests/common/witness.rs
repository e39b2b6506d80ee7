//! `stepguard witness` in a LAN client namespace, for the tests that measure VIP gaps as LAN
//! clients see them (the imitated LAN lab's and the real agents' cluster).
use super::*;
use serde_json::Value;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running witness; killed on drop.
pub struct Witness {
    child: Child,
    pub url: String,
    ns: String,
}

impl Witness {
    /// Starts it in `ns` with `config`, listening on `addr`; returns once it answers and has
    /// probed each of its `targets` once. Unauthenticated unless `extra` names a token file.
    pub fn start_in(
        ns: &str,
        config: &std::path::Path,
        addr: &str,
        targets: usize,
        extra: &[&str],
    ) -> Witness {
        let child = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{ns}"))
            .arg("--")
            .arg(bin("STEPGUARD_BIN", "stepguard"))
            .args(["witness", "--config"])
            .arg(config)
            .args(["--listen", addr])
            .args(if extra.contains(&"--token-file") {
                &[][..]
            } else {
                &["--allow-unauthenticated"][..]
            })
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start stepguard witness");
        let w = Witness {
            child,
            url: format!("http://{addr}"),
            ns: ns.to_string(),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ok = w.get("/v1/status");
            if ok["latest"].as_object().is_some_and(|l| l.len() == targets) {
                return w;
            }
            assert!(
                Instant::now() < deadline,
                "the witness never became ready: {ok}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// A GET from its namespace, as JSON (Null when it does not answer).
    pub fn get(&self, path: &str) -> Value {
        let url = format!("{}{path}", self.url);
        stepguard_lab::sys::netns::in_netns(&self.ns, move || {
            let out = std::process::Command::new("curl")
                .args(["-s", "-m", "2", &url])
                .output()?;
            Ok(serde_json::from_slice::<Value>(&out.stdout).unwrap_or(Value::Null))
        })
        .unwrap_or(Value::Null)
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Witness {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A measured gap (`longest_s` ± `error_bound_s`) lies within the truth: the outage began in
/// `stopped` and ended in `resumed` (wall clock ns windows), give or take the bound and 5 ms.
pub fn assert_within_reported_bound(
    g: &Value,
    stopped: (u128, u128),
    resumed: (u128, u128),
    what: &str,
) {
    let s = |ns: u128| ns as f64 / 1e9;
    let longest = g["longest_s"].as_f64().unwrap();
    let bound = g["error_bound_s"].as_f64().unwrap();
    let (lo, hi) = (s(resumed.0) - s(stopped.1), s(resumed.1) - s(stopped.0));
    let slack = 0.005;
    eprintln!(
        "{what}: measured {:.1} ± {:.1} ms, truth {:.1}..{:.1} ms",
        longest * 1e3,
        bound * 1e3,
        lo * 1e3,
        hi * 1e3
    );
    assert!(
        longest >= lo - bound - slack && longest <= hi + bound + slack,
        "{what}: measured {:.1} ± {:.1} ms, the lab's truth {:.1}..{:.1} ms: {g}",
        longest * 1e3,
        bound * 1e3,
        lo * 1e3,
        hi * 1e3,
    );
}
