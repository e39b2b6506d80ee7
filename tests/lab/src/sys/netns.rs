//! Network namespaces, veths and addresses, made with iproute2 (`ip`), and a way to run Rust
//! code inside a namespace (a thread that `setns`-es, so the caller's namespace is untouched).
use anyhow::{bail, Context, Result};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Runs a command, failing with its stderr when it exits non-zero. The command dies with the
/// lab process (a killed `lab up` must not leave an `ip -batch` creating namespaces after
/// `down` has removed the recorded ones).
pub fn run(program: &str, args: &[&str]) -> Result<String> {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(program);
    cmd.args(args);
    // SAFETY: prctl is async-signal-safe; it only sets this child's parent-death signal.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let out = cmd
        .output()
        .with_context(|| format!("run {program}: is it installed? (cargo xtask setup)"))?;
    if !out.status.success() {
        bail!(
            "`{program} {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `ip` in the given namespace (`ip -n NS ...`).
pub fn ip(ns: &str, args: &[&str]) -> Result<String> {
    let mut a = vec!["-n", ns];
    a.extend_from_slice(args);
    run("ip", &a)
}

/// `sysctl -qw` of these settings in namespace `ns` (nsenter keeps the host's /sys).
pub fn sysctl(ns: &str, settings: &[&str]) -> Result<String> {
    let net = format!("--net={}", netns_path(ns).display());
    let mut args = vec![net.as_str(), "--", "sysctl", "-qw"];
    args.extend_from_slice(settings);
    run("nsenter", &args)
}

pub fn netns_path(name: &str) -> PathBuf {
    Path::new("/run/netns").join(name)
}

pub fn netns_exists(name: &str) -> bool {
    netns_path(name).exists()
}

pub fn add_netns(name: &str) -> Result<()> {
    run("ip", &["netns", "add", name])?;
    ip(name, &["link", "set", "lo", "up"])?;
    Ok(())
}

pub fn del_netns(name: &str) -> Result<()> {
    if netns_exists(name) {
        run("ip", &["netns", "del", name])?;
    }
    Ok(())
}

/// A veth pair with one end in each namespace, both up.
pub fn add_veth(ns_a: &str, name_a: &str, ns_b: &str, name_b: &str) -> Result<()> {
    ip(
        ns_a,
        &[
            "link", "add", name_a, "type", "veth", "peer", "name", name_b, "netns", ns_b,
        ],
    )?;
    ip(ns_a, &["link", "set", name_a, "up"])?;
    ip(ns_b, &["link", "set", name_b, "up"])?;
    Ok(())
}

pub fn add_addr(ns: &str, dev: &str, cidr: &str) -> Result<()> {
    ip(ns, &["addr", "add", cidr, "dev", dev]).map(|_| ())
}

/// Ifindex of `dev` inside `ns`.
pub fn ifindex(ns: &str, dev: &str) -> Result<u32> {
    let out = ip(ns, &["-o", "link", "show", "dev", dev])?;
    out.split(':')
        .next()
        .and_then(|s| s.trim().parse().ok())
        .with_context(|| format!("parse ifindex of {dev} in {ns} from {out:?}"))
}

/// Runs `f` on a fresh thread that has joined the network namespace `ns`.
pub fn in_netns<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let path = netns_path(ns);
    let file =
        File::open(&path).with_context(|| format!("open network namespace {}", path.display()))?;
    std::thread::spawn(move || -> Result<T> {
        // SAFETY: setns on this thread only; the fd is valid for the call.
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            bail!(
                "setns into {}: {}",
                path.display(),
                std::io::Error::last_os_error()
            );
        }
        f()
    })
    .join()
    .map_err(|_| anyhow::anyhow!("thread in network namespace {ns} panicked"))?
}
