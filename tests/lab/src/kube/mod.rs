//! A real Kubernetes control plane for the lab: etcd, kube-apiserver (token
//! authentication, RBAC, Pod Security admission, an audit log of the stepper's requests),
//! kube-controller-manager (the DaemonSet, garbage-collector, namespace and service-account
//! controllers) and kube-scheduler, all on 127.0.0.1, from the binaries `cargo xtask kube`
//! builds (Go module proxy, cached by version outside the clone). The lab's nodes become Node
//! objects; Cilium's objects are its own chart's, rendered by real Helm ([`chart`]) with an
//! OnDelete DaemonSet, and the real controller makes its ControllerRevisions and pods. Pods
//! bound to lab nodes are run by the lab kubelet ([`crate::kube::kubelet`]).
//!
//! Users (a token file, as `--token-auth-file` reads it): `admin` (group `system:masters`),
//! the controller manager and the scheduler as their bootstrap RBAC users, and the stepper as
//! the ServiceAccount `deploy/rollout/rbac.yaml` binds, so the shipped RBAC is what the
//! stepper is tested with.
//!
//! The stepper runs in the LAN client's network namespace (it must reach the agents on the lab
//! nodes); [`Forward`] carries its connections from a lab address there to the API server on
//! the host's loopback, byte for byte (TLS end to end).
pub mod chart;
mod client;
pub mod fleet;
pub mod flux;
mod forward;
pub mod git;
pub mod kubelet;

pub use client::*;
pub use forward::Forward;

use crate::sys::process::{self, Proc};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The stepper's ServiceAccount (namespace, name), as `deploy/rollout/rbac.yaml` names it.
pub const STEPPER_SA: (&str, &str) = ("stepguard", "stepguard-rollout");

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ControlPlane {
    pub dir: PathBuf,
    /// `https://127.0.0.1:PORT`.
    pub server: String,
    pub admin_token: String,
    pub stepper_token: String,
    pub procs: Vec<Proc>,
    /// The binaries' directory, and the API server's arguments (for a restart).
    pub bin: PathBuf,
    pub apiserver_args: Vec<String>,
    /// When the API server was restarted and when it was ready again (Unix seconds): it
    /// serves before its authorization caches are filled, refusing (403) what RBAC allows.
    #[serde(default)]
    pub unready: Vec<(f64, f64)>,
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The DaemonSet controller's user (kube-controller-manager with service account credentials).
pub const DS_CONTROLLER_USER: &str = "system:serviceaccount:kube-system:daemon-set-controller";

/// The stepper's user name, as authenticated.
pub fn stepper_user() -> String {
    format!("system:serviceaccount:{}:{}", STEPPER_SA.0, STEPPER_SA.1)
}

fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("find a free port")?;
    Ok(l.local_addr()?.port())
}

fn token() -> Result<String> {
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .context("read /dev/urandom")?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// A kubeconfig for `server` with a bearer token (the serving certificate is self-signed:
/// not verified, loopback only).
fn kubeconfig(path: &Path, server: &str, token: &str) -> Result<()> {
    std::fs::write(
        path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: lab\n  cluster:\n    server: {server}\n    insecure-skip-tls-verify: true\n\
             users:\n- name: u\n  user:\n    token: {token}\ncontexts:\n- name: lab\n  context:\n    cluster: lab\n    user: u\ncurrent-context: lab\n"
        ),
    )
    .with_context(|| format!("write {}", path.display()))
}

impl ControlPlane {
    /// Starts the control plane under `dir` with the binaries in `bin`; returns once the API
    /// server is ready and the controllers run.
    pub fn up(dir: &Path, bin: &Path) -> Result<ControlPlane> {
        for b in [
            "etcd",
            "kube-apiserver",
            "kube-controller-manager",
            "kube-scheduler",
        ] {
            if !bin.join(b).exists() {
                bail!(
                    "no {b} in {}: build the control plane with `cargo xtask kube`",
                    bin.display()
                );
            }
        }
        std::fs::create_dir_all(dir)?;
        let mut cp = ControlPlane {
            dir: dir.to_path_buf(),
            server: String::new(),
            admin_token: token()?,
            stepper_token: token()?,
            procs: vec![],
            bin: bin.to_path_buf(),
            apiserver_args: vec![],
            unready: vec![],
        };
        match cp.start(bin) {
            Ok(()) => Ok(cp),
            Err(e) => {
                cp.down();
                Err(e)
            }
        }
    }

    fn start(&mut self, bin: &Path) -> Result<()> {
        let d = self.dir.clone();
        let (client, peer, api) = (free_port()?, free_port()?, free_port()?);
        let etcd_url = format!("http://127.0.0.1:{client}");
        self.procs.push(process::spawn_logged(
            "etcd",
            bin.join("etcd").as_os_str(),
            &[
                "--data-dir".into(),
                d.join("etcd").display().to_string(),
                "--listen-client-urls".into(),
                etcd_url.clone(),
                "--advertise-client-urls".into(),
                etcd_url.clone(),
                "--listen-peer-urls".into(),
                format!("http://127.0.0.1:{peer}"),
                "--initial-advertise-peer-urls".into(),
                format!("http://127.0.0.1:{peer}"),
                "--initial-cluster".into(),
                format!("default=http://127.0.0.1:{peer}"),
                "--unsafe-no-fsync".into(),
            ],
            &d.join("etcd.log"),
        )?);
        // The service-account signing key.
        let sa_key = d.join("sa.key");
        let out = std::process::Command::new("openssl")
            .args(["genrsa", "-out"])
            .arg(&sa_key)
            .arg("2048")
            .output()
            .context("run openssl")?;
        if !out.status.success() {
            bail!("openssl genrsa: {}", String::from_utf8_lossy(&out.stderr));
        }
        let (cm_token, sched_token) = (token()?, token()?);
        let (ns, sa) = STEPPER_SA;
        std::fs::write(
            d.join("tokens.csv"),
            format!(
                "{},admin,admin-uid,\"system:masters\"\n\
                 {cm_token},system:kube-controller-manager,kcm-uid\n\
                 {sched_token},system:kube-scheduler,sched-uid\n\
                 {},system:serviceaccount:{ns}:{sa},stepper-uid,\"system:serviceaccounts,system:serviceaccounts:{ns},system:authenticated\"\n",
                self.admin_token, self.stepper_token
            ),
        )?;
        self.server = format!("https://127.0.0.1:{api}");
        let s = |p: &Path| p.display().to_string();
        // Every request of the stepper's user is audited (metadata: verb, resource, code), so
        // a test can assert the shipped RBAC let every call through; and the DaemonSet
        // controller's, which the fleet benchmark counts beside the stepper's.
        std::fs::write(
            d.join("audit-policy.yaml"),
            format!(
                "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [\"RequestReceived\"]\nrules:\n- level: Metadata\n  users: [\"{}\", \"{DS_CONTROLLER_USER}\"]\n- level: None\n",
                stepper_user()
            ),
        )?;
        self.apiserver_args = vec![
            format!("--etcd-servers={etcd_url}"),
            "--bind-address=127.0.0.1".into(),
            "--advertise-address=127.0.0.1".into(),
            // v1.37 refuses a loopback advertise address with the endpoint reconciler
            // ("may not be in the loopback range"): nothing here needs the `kubernetes`
            // Service's endpoints.
            "--endpoint-reconciler-type=none".into(),
            format!("--secure-port={api}"),
            format!("--cert-dir={}", s(&d.join("certs"))),
            format!("--token-auth-file={}", s(&d.join("tokens.csv"))),
            "--authorization-mode=RBAC".into(),
            "--anonymous-auth=false".into(),
            "--enable-admission-plugins=PodSecurity".into(),
            // As every cluster a CNI runs on (kubeadm, k3s): the cilium-agent's pod, as Cilium's
            // chart renders it, has privileged init containers.
            "--allow-privileged=true".into(),
            format!("--service-account-key-file={}", s(&sa_key)),
            format!("--service-account-signing-key-file={}", s(&sa_key)),
            "--service-account-issuer=https://kubernetes.default.svc".into(),
            // Documentation range: allocated, never routed.
            "--service-cluster-ip-range=198.51.100.0/24".into(),
            format!("--audit-policy-file={}", s(&d.join("audit-policy.yaml"))),
            format!("--audit-log-path={}", s(&self.audit_log())),
            "--audit-log-mode=blocking".into(),
        ];
        self.start_apiserver()?;
        kubeconfig(&d.join("kcm.kubeconfig"), &self.server, &cm_token)?;
        kubeconfig(&d.join("scheduler.kubeconfig"), &self.server, &sched_token)?;
        kubeconfig(&d.join("admin.kubeconfig"), &self.server, &self.admin_token)?;
        kubeconfig(
            &d.join("stepper.kubeconfig"),
            &self.server,
            &self.stepper_token,
        )?;
        self.procs.push(process::spawn_logged(
            "kube-controller-manager",
            bin.join("kube-controller-manager").as_os_str(),
            &[
                format!("--kubeconfig={}", s(&d.join("kcm.kubeconfig"))),
                "--controllers=daemonset-controller,deployment-controller,replicaset-controller,garbage-collector-controller,namespace-controller,serviceaccount-controller,serviceaccount-token-controller,endpointslice-controller".into(),
                "--leader-elect=false".into(),
                // Each controller as its own ServiceAccount with its bootstrap RBAC role, as
                // kubeadm runs it (the manager's own user may not write ControllerRevisions).
                "--use-service-account-credentials=true".into(),
                "--bind-address=127.0.0.1".into(),
                "--secure-port=0".into(),
                format!("--service-account-private-key-file={}", s(&sa_key)),
                format!("--root-ca-file={}", s(&d.join("certs/apiserver.crt"))),
            ],
            &d.join("kube-controller-manager.log"),
        )?);
        self.procs.push(process::spawn_logged(
            "kube-scheduler",
            bin.join("kube-scheduler").as_os_str(),
            &[
                format!("--kubeconfig={}", s(&d.join("scheduler.kubeconfig"))),
                "--leader-elect=false".into(),
                "--bind-address=127.0.0.1".into(),
                "--secure-port=0".into(),
            ],
            &d.join("kube-scheduler.log"),
        )?);
        Ok(())
    }

    fn start_apiserver(&mut self) -> Result<()> {
        let p = process::spawn_logged(
            "kube-apiserver",
            self.bin.join("kube-apiserver").as_os_str(),
            &self.apiserver_args,
            &self
                .dir
                .join(format!("kube-apiserver.{}.log", self.procs.len())),
        )?;
        self.procs.push(p);
        self.wait_ready()
    }

    fn wait_ready(&self) -> Result<()> {
        let ready = self.server.clone() + "/readyz";
        let tok = self.admin_token.clone();
        process::wait_until("kube-apiserver", Duration::from_secs(90), || {
            let o = std::process::Command::new("curl")
                .args(["-sk", "-m", "2", "-H"])
                .arg(format!("Authorization: Bearer {tok}"))
                .arg(&ready)
                .output()?;
            if String::from_utf8_lossy(&o.stdout).trim() == "ok" {
                Ok(())
            } else {
                bail!("{}", String::from_utf8_lossy(&o.stdout))
            }
        })
    }

    /// The audit log (JSON lines) of the stepper's requests.
    pub fn audit_log(&self) -> PathBuf {
        self.dir.join("audit.log")
    }

    /// The stepper's audited requests that were answered (ResponseComplete), as JSON.
    pub fn stepper_requests(&self) -> Result<Vec<Value>> {
        self.requests_of(&stepper_user())
    }

    /// The audit log's events of `user`, as JSON.
    pub fn requests_of(&self, user: &str) -> Result<Vec<Value>> {
        let text = std::fs::read_to_string(self.audit_log())
            .with_context(|| format!("read {}", self.audit_log().display()))?;
        Ok(text
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["user"]["username"] == user)
            .collect())
    }

    fn proc(&self, what: &str) -> Result<&Proc> {
        self.procs
            .iter()
            .rev()
            .find(|p| p.what == what)
            .with_context(|| format!("no {what} in this control plane"))
    }

    fn signal(&self, what: &str, sig: i32) -> Result<()> {
        let p = self.proc(what)?;
        if process::start_ticks(p.pid) != Some(p.start_ticks) {
            bail!("{what} (pid {}) is not running", p.pid);
        }
        // SAFETY: kill(2) on a pid verified to be the process we started.
        if unsafe { libc::kill(p.pid, sig) } != 0 {
            bail!("signal {what}: {}", std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Freezes a component (SIGSTOP): `kube-controller-manager`, `kube-scheduler`, ….
    pub fn pause(&self, what: &str) -> Result<()> {
        self.signal(what, libc::SIGSTOP)
    }

    pub fn resume(&self, what: &str) -> Result<()> {
        self.signal(what, libc::SIGCONT)
    }

    /// Stops the API server and starts it again on the same port, etcd and certificates (an
    /// apiserver upgrade as clients see it: refused connections, then the same cluster).
    /// Returns once it is ready again.
    pub fn restart_apiserver(&mut self, down_for: Duration) -> Result<()> {
        let p = self.proc("kube-apiserver")?.clone();
        let from = unix_now();
        process::stop(&p);
        self.procs.retain(|q| q.pid != p.pid);
        std::thread::sleep(down_for);
        let r = self.start_apiserver();
        self.unready.push((from, unix_now()));
        r
    }

    /// Whether an audited request was received while the API server was restarting (see
    /// `unready`).
    pub fn while_restarting(&self, audit_event: &Value) -> bool {
        let Some(t) = audit_event["requestReceivedTimestamp"]
            .as_str()
            .and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok())
        else {
            return false;
        };
        let t = t.as_microsecond() as f64 / 1e6;
        self.unready.iter().any(|(a, b)| *a <= t && t <= *b)
    }

    /// Waits until the CRDs `crds` (`crd/<name>`, or `crd --all`) are established, for up to
    /// `timeout`. A CRD created a moment ago may have no `status.conditions` yet, which
    /// `kubectl wait` reports as an error rather than waiting for: asked again until the
    /// deadline.
    pub fn wait_crds_established(&self, crds: &[&str], timeout: Duration) -> Result<()> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let mut args = vec!["wait", "--for=condition=Established", "--timeout=5s"];
            args.extend_from_slice(crds);
            match self.kubectl(&args) {
                Ok(_) => return Ok(()),
                Err(e) if std::time::Instant::now() < deadline => {
                    let e = format!("{e:#}");
                    if !(e.contains("accessor error") || e.contains("timed out")) {
                        return Err(anyhow::anyhow!(e)).context("CRDs established");
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => return Err(e).context("CRDs established"),
            }
        }
    }

    /// `kubectl` (the one built beside the control plane) as admin.
    pub fn kubectl(&self, args: &[&str]) -> Result<String> {
        let out = std::process::Command::new(self.bin.join("kubectl"))
            .arg(format!(
                "--kubeconfig={}",
                self.dir.join("admin.kubeconfig").display()
            ))
            .args(args)
            .output()
            .context("run kubectl")?;
        if !out.status.success() {
            bail!(
                "kubectl {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    pub fn admin_kubeconfig(&self) -> PathBuf {
        self.dir.join("admin.kubeconfig")
    }

    /// An admin kubeconfig at `path` reaching the API server at `server` (e.g. a
    /// [`Forward`]'s address in a node's namespace, for a real cilium-agent).
    pub fn kubeconfig_for(&self, path: &Path, server: &str) -> Result<()> {
        kubeconfig(path, server, &self.admin_token)
    }

    /// A kubeconfig for the stepper's ServiceAccount token, reaching the API server at
    /// `server` (e.g. a [`Forward`]'s address).
    pub fn stepper_kubeconfig(&self, server: &str) -> Result<PathBuf> {
        let p = self.dir.join("stepper-forwarded.kubeconfig");
        kubeconfig(&p, server, &self.stepper_token)?;
        Ok(p)
    }

    /// Stops every process it started (recorded by pid and start time).
    pub fn down(&mut self) {
        for p in &self.procs {
            // A paused component cannot take its SIGTERM.
            if process::start_ticks(p.pid) == Some(p.start_ticks) {
                unsafe { libc::kill(p.pid, libc::SIGCONT) };
            }
        }
        for p in self.procs.drain(..).rev() {
            process::stop(&p);
        }
    }
}
