//! Flux on the lab's control plane: the real kustomize-controller (built from its module by
//! `cargo xtask flux`), reconciling Kustomizations from a Git repository the lab serves over
//! smart HTTP ([`super::git`]).
//!
//! source-controller is not built (v1.9.6 needs a module the proxy here refuses; see
//! `xtask/src/flux.rs`), so the lab plays its part for the repository ([`GitSource`]): it polls
//! the branch over smart HTTP, packs the commit's tree as source-controller packs an artifact
//! (a gzipped tarball, its sha256 digest, the revision `BRANCH@sha1:COMMIT`), serves it on
//! 127.0.0.1 and writes it into an `ExternalArtifact`'s status — the source kind
//! kustomize-controller takes from sources other than source-controller (feature gate
//! `ExternalArtifact`).
use super::git::{git, read_request, response};
use super::ControlPlane;
use crate::sys::process::{self, Proc};
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The environment variable that names the Flux directory (`bin/kustomize-controller`,
/// `crds/`); `cargo xtask test --real-extended` builds and sets it.
pub const FLUX_ENV: &str = "STEPGUARD_FLUX";

/// The namespace of the Flux objects.
pub const NAMESPACE: &str = "flux-system";

/// The Flux directory from [`FLUX_ENV`].
pub fn flux_dir() -> Result<PathBuf> {
    let d = std::env::var_os(FLUX_ENV).map(PathBuf::from).with_context(|| {
        format!("{FLUX_ENV} is unset: Flux's controllers (`cargo xtask test --real-extended` builds and sets it)")
    })?;
    if !d.join("bin/kustomize-controller").is_file() {
        bail!(
            "no bin/kustomize-controller in {}: `cargo xtask flux`",
            d.display()
        );
    }
    Ok(d)
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")
        .context("find a free port")?
        .local_addr()?
        .port())
}

/// The real kustomize-controller, as admin, with the Flux CRDs applied and its namespace made;
/// stopped (the process it started, by pid and start time) when dropped.
pub struct KustomizeController {
    pub proc: Proc,
    pub log: PathBuf,
}

impl KustomizeController {
    pub fn start(cp: &ControlPlane, flux: &Path, dir: &Path) -> Result<KustomizeController> {
        let crds = flux.join("crds");
        cp.kubectl(&[
            "apply",
            "--server-side",
            "-f",
            crds.to_str().context("UTF-8")?,
        ])
        .context("apply Flux's CRDs")?;
        cp.wait_crds_established(
            &[
                "crd/kustomizations.kustomize.toolkit.fluxcd.io",
                "crd/externalartifacts.source.toolkit.fluxcd.io",
                "crd/gitrepositories.source.toolkit.fluxcd.io",
                "crd/ocirepositories.source.toolkit.fluxcd.io",
                "crd/buckets.source.toolkit.fluxcd.io",
            ],
            Duration::from_secs(30),
        )?;
        let ns = format!(
            "{{\"apiVersion\":\"v1\",\"kind\":\"Namespace\",\"metadata\":{{\"name\":\"{NAMESPACE}\"}}}}"
        );
        let f = dir.join("flux-namespace.json");
        std::fs::write(&f, ns)?;
        cp.kubectl(&["apply", "--server-side", "-f", f.to_str().context("UTF-8")?])?;
        let log = dir.join("kustomize-controller.log");
        let mut cmd = Command::new(flux.join("bin/kustomize-controller"));
        cmd.env("KUBECONFIG", cp.admin_kubeconfig())
            .env("RUNTIME_NAMESPACE", NAMESPACE)
            .args([
                format!("--metrics-addr=127.0.0.1:{}", free_port()?),
                format!("--health-addr=127.0.0.1:{}", free_port()?),
                "--enable-leader-election=false".into(),
                "--watch-all-namespaces=true".into(),
                "--feature-gates=ExternalArtifact=true".into(),
                "--log-level=info".into(),
            ]);
        // SAFETY: prctl is async-signal-safe; the controller dies with the test.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let proc = process::spawn_detached(cmd, "kustomize-controller", &log)?;
        Ok(KustomizeController { proc, log })
    }
}

impl Drop for KustomizeController {
    fn drop(&mut self) {
        process::stop(&self.proc);
    }
}

/// What [`GitSource`] published last.
#[derive(Clone, Debug, Default)]
pub struct Published {
    /// `BRANCH@sha1:COMMIT`.
    pub revision: String,
    /// Publications so far.
    pub count: usize,
    /// The last error (the source tries again on its next poll).
    pub error: Option<String>,
}

/// source-controller's part for one branch of one repository, as an `ExternalArtifact`
/// named `name` in [`NAMESPACE`]; stops when dropped.
pub struct GitSource {
    pub name: String,
    pub published: Arc<Mutex<Published>>,
    stop: Arc<AtomicBool>,
    addr: SocketAddr,
    threads: Vec<std::thread::JoinHandle<()>>,
}

/// A poll of the branch, at most this often.
const POLL: Duration = Duration::from_secs(1);

impl GitSource {
    pub fn start(
        cp: &ControlPlane,
        url: &str,
        branch: &str,
        name: &str,
        dir: &Path,
    ) -> Result<GitSource> {
        let store = dir.join("artifacts");
        std::fs::create_dir_all(&store)?;
        let f = dir.join(format!("externalartifact-{name}.json"));
        std::fs::write(
            &f,
            json!({"apiVersion": "source.toolkit.fluxcd.io/v1", "kind": "ExternalArtifact",
                   "metadata": {"name": name, "namespace": NAMESPACE}, "spec": {}})
            .to_string(),
        )?;
        cp.kubectl(&["apply", "--server-side", "-f", f.to_str().context("UTF-8")?])
            .context("create the ExternalArtifact")?;
        let listener = TcpListener::bind("127.0.0.1:0").context("bind the artifact server")?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let published: Arc<Mutex<Published>> = Arc::default();
        let serve = {
            let (stop, store) = (stop.clone(), store.clone());
            std::thread::spawn(move || serve_artifacts(listener, &store, &stop))
        };
        let poll = {
            let (stop, published, cp) = (stop.clone(), published.clone(), cp.clone());
            let (url, branch, name, work) = (
                url.to_string(),
                branch.to_string(),
                name.to_string(),
                dir.join(format!("source-{name}")),
            );
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    let last = published.lock().unwrap().revision.clone();
                    let r = publish(&cp, &url, &branch, &name, &work, &store, addr, &last);
                    let mut p = published.lock().unwrap();
                    match r {
                        Ok(Some(rev)) => {
                            p.revision = rev;
                            p.count += 1;
                            p.error = None;
                        }
                        Ok(None) => p.error = None,
                        Err(e) => p.error = Some(format!("{e:#}")),
                    }
                    drop(p);
                    std::thread::sleep(POLL);
                }
            })
        };
        Ok(GitSource {
            name: name.into(),
            published,
            stop,
            addr,
            threads: vec![serve, poll],
        })
    }

    pub fn published(&self) -> Published {
        self.published.lock().unwrap().clone()
    }
}

impl Drop for GitSource {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// One poll: when the branch's head is not `last`, fetch it over HTTP, pack its tree, store
/// it and write the ExternalArtifact's status; the new revision.
#[allow(clippy::too_many_arguments)]
fn publish(
    cp: &ControlPlane,
    url: &str,
    branch: &str,
    name: &str,
    work: &Path,
    store: &Path,
    addr: SocketAddr,
    last: &str,
) -> Result<Option<String>> {
    let here = std::env::temp_dir();
    let ls = git(&here, &["ls-remote", url, &format!("refs/heads/{branch}")])?;
    let Some(commit) = ls.split_whitespace().next().map(String::from) else {
        return Ok(None); // no such branch yet
    };
    let revision = format!("{branch}@sha1:{commit}");
    if revision == last {
        return Ok(None);
    }
    if !work.join(".git").exists() {
        git(
            &here,
            &[
                "clone",
                "-q",
                "--no-checkout",
                url,
                work.to_str().context("UTF-8")?,
            ],
        )?;
    }
    git(work, &["fetch", "-q", "origin", branch])?;
    git(work, &["checkout", "-q", "--force", "--detach", &commit])?;
    let file = format!("{commit}.tar.gz");
    let tarball = store.join(&file);
    let out = Command::new("tar")
        .args([
            "--sort=name",
            "--mtime=@0",
            "--owner=0",
            "--group=0",
            "--numeric-owner",
        ])
        .args(["--exclude=.git", "-czf"])
        .arg(&tarball)
        .arg("-C")
        .arg(work)
        .arg(".")
        .output()
        .context("run tar")?;
    if !out.status.success() {
        bail!("tar: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    let bytes = std::fs::read(&tarball)?;
    let sum = Command::new("sha256sum")
        .arg(&tarball)
        .output()
        .context("run sha256sum")?;
    let digest = String::from_utf8_lossy(&sum.stdout)
        .split_whitespace()
        .next()
        .context("sha256sum's output")?
        .to_string();
    let now =
        k8s_openapi::jiff::Timestamp::from_second(k8s_openapi::jiff::Timestamp::now().as_second())?
            .to_string();
    let status: Value = json!({"status": {
        "conditions": [{"type": "Ready", "status": "True", "reason": "Succeeded",
                        "message": format!("stored artifact for revision '{revision}'"),
                        "lastTransitionTime": now, "observedGeneration": 1}],
        "artifact": {"path": file, "url": format!("http://{addr}/{file}"), "revision": revision,
                     "digest": format!("sha256:{digest}"), "lastUpdateTime": now,
                     "size": bytes.len()}}});
    cp.kubectl(&[
        "-n",
        NAMESPACE,
        "patch",
        "externalartifact",
        name,
        "--subresource=status",
        "--type=merge",
        "-p",
        &status.to_string(),
    ])
    .context("write the ExternalArtifact's status")?;
    Ok(Some(revision))
}

/// Serves the files of `store` by name (GET), one connection at a time (the controller
/// downloads an artifact per reconcile).
fn serve_artifacts(listener: TcpListener, store: &Path, stop: &AtomicBool) {
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(mut conn) = conn else { continue };
        let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
        let _ = conn.set_write_timeout(Some(Duration::from_secs(10)));
        let reply = match read_request(&mut conn) {
            Ok(r) if r.method == "GET" => {
                let name = r.path.trim_start_matches('/');
                if name.is_empty() || name.contains('/') || name.starts_with('.') {
                    response(404, &[], b"")
                } else {
                    match std::fs::read(store.join(name)) {
                        Ok(b) => response(
                            200,
                            &[("Content-Type".into(), "application/gzip".into())],
                            &b,
                        ),
                        Err(_) => response(404, &[], b""),
                    }
                }
            }
            Ok(_) => response(400, &[], b""),
            Err(e) => response(400, &[], format!("{e:#}\n").as_bytes()),
        };
        let _ = conn.write_all(&reply);
    }
}
