//! A real Kubernetes control plane for the lab (issue 27, in progress): etcd, kube-apiserver
//! (token authentication, RBAC, Pod Security admission), kube-controller-manager (the
//! DaemonSet, garbage-collector, namespace and service-account controllers) and
//! kube-scheduler, all on 127.0.0.1, from the binaries `cargo xtask kube` builds (Go module
//! proxy, cached by version outside the clone).
//!
//! Users (a token file, as `--token-auth-file` reads it): `admin` (group `system:masters`),
//! the controller manager and the scheduler as their bootstrap RBAC users, and the stepper as
//! the ServiceAccount `deploy/rollout/rbac.yaml` binds, so the shipped RBAC is what the
//! stepper is tested with.
use crate::services::{self, Proc};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
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
        self.procs.push(services::spawn_logged(
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
        self.procs.push(services::spawn_logged(
            "kube-apiserver",
            bin.join("kube-apiserver").as_os_str(),
            &[
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
                format!("--service-account-key-file={}", s(&sa_key)),
                format!("--service-account-signing-key-file={}", s(&sa_key)),
                "--service-account-issuer=https://kubernetes.default.svc".into(),
                // Documentation range: allocated, never routed.
                "--service-cluster-ip-range=198.51.100.0/24".into(),
            ],
            &d.join("kube-apiserver.log"),
        )?);
        let ready = self.server.clone() + "/readyz";
        let tok = self.admin_token.clone();
        services::wait_until("kube-apiserver", Duration::from_secs(90), || {
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
        })?;
        kubeconfig(&d.join("kcm.kubeconfig"), &self.server, &cm_token)?;
        kubeconfig(&d.join("scheduler.kubeconfig"), &self.server, &sched_token)?;
        kubeconfig(&d.join("admin.kubeconfig"), &self.server, &self.admin_token)?;
        kubeconfig(
            &d.join("stepper.kubeconfig"),
            &self.server,
            &self.stepper_token,
        )?;
        self.procs.push(services::spawn_logged(
            "kube-controller-manager",
            bin.join("kube-controller-manager").as_os_str(),
            &[
                format!("--kubeconfig={}", s(&d.join("kcm.kubeconfig"))),
                "--controllers=daemonset-controller,garbage-collector-controller,namespace-controller,serviceaccount-controller,serviceaccount-token-controller".into(),
                "--leader-elect=false".into(),
                "--bind-address=127.0.0.1".into(),
                "--secure-port=0".into(),
                format!("--service-account-private-key-file={}", s(&sa_key)),
                format!("--root-ca-file={}", s(&d.join("certs/apiserver.crt"))),
            ],
            &d.join("kube-controller-manager.log"),
        )?);
        self.procs.push(services::spawn_logged(
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

    /// Stops every process it started (recorded by pid and start time).
    pub fn down(&mut self) {
        for p in self.procs.drain(..).rev() {
            services::stop(&p);
        }
    }
}
