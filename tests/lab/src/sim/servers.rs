//! Real servers behind the lab's VIPs, run in the fabric namespace: dnsmasq (Debian's
//! dnsmasq-base) answering a few names on the DNS VIP, and nginx on the gateway VIP.
//! They run detached (own session) so they outlive the `lab up` process; `down` stops them
//! by the pid and start time recorded in the lab's state.
use crate::sys::process::{spawn_in, Proc};
use anyhow::{bail, Context, Result};
use std::path::Path;
use std::process::Command;

pub fn start_dnsmasq(
    ns: &str,
    dir: &Path,
    vip: &str,
    records: &[(String, String)],
) -> Result<Proc> {
    let mut args: Vec<String> = vec![
        "--keep-in-foreground".into(),
        "--conf-file=/dev/null".into(),
        "--no-resolv".into(),
        "--no-hosts".into(),
        "--no-negcache".into(),
        "--bind-interfaces".into(),
        format!("--listen-address={vip}"),
        "--port=53".into(),
        "--cache-size=0".into(),
        "--pid-file=".into(),
        "--log-facility=-".into(),
        "--user=root".into(),
        "--local=/lab.stepguard.test/".into(),
    ];
    for (name, addr) in records {
        args.push(format!("--host-record={name},{addr}"));
    }
    spawn_in(ns, "dnsmasq", "dnsmasq", &args, &dir.join("dnsmasq.log"))
}

/// The gateway's TLS listener (a Gateway VIP on 443): its port and certificate.
pub struct Tls {
    pub port: u16,
    pub cert: std::path::PathBuf,
    pub key: std::path::PathBuf,
}

fn openssl(args: &[&str]) -> Result<()> {
    let out = Command::new("openssl")
        .args(args)
        .output()
        .context("run openssl (Debian package openssl)")?;
    if !out.status.success() {
        bail!(
            "openssl {}: {}",
            args.first().unwrap_or(&""),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// A lab CA and a certificate it signs for `name` (EC P-256, two days): (CA certificate,
/// certificate, key), in `dir`.
pub fn lab_certificate(
    dir: &Path,
    name: &str,
) -> Result<(std::path::PathBuf, std::path::PathBuf, std::path::PathBuf)> {
    let p = |f: &str| dir.join(f).display().to_string();
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let (ca, ca_key) = (p("lab-ca.pem"), p("lab-ca.key"));
    let (csr, key, cert, ext) = (p("tls.csr"), p("tls.key"), p("tls.pem"), p("tls.ext"));
    openssl(
        &[
            &["req", "-x509"][..],
            &ec,
            &[
                "-days",
                "2",
                "-subj",
                "/CN=stepguard lab CA",
                "-keyout",
                &ca_key,
                "-out",
                &ca,
            ],
        ]
        .concat(),
    )?;
    openssl(
        &[
            &["req", "-new"][..],
            &ec,
            &[
                "-subj",
                &format!("/CN={name}"),
                "-keyout",
                &key,
                "-out",
                &csr,
            ],
        ]
        .concat(),
    )?;
    std::fs::write(
        &ext,
        format!("subjectAltName=DNS:{name}\nbasicConstraints=CA:FALSE\n"),
    )?;
    openssl(&[
        "x509",
        "-req",
        "-in",
        &csr,
        "-CA",
        &ca,
        "-CAkey",
        &ca_key,
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        &ext,
        "-out",
        &cert,
    ])?;
    Ok((ca.into(), cert.into(), key.into()))
}

pub fn start_nginx(ns: &str, dir: &Path, vip: &str, port: u16, tls: Option<&Tls>) -> Result<Proc> {
    let tmp = dir.join("nginx-tmp");
    std::fs::create_dir_all(&tmp)?;
    let tls_server = match tls {
        Some(t) => format!(
            r#"    server {{
        listen {vip}:{port} ssl;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        location = /healthz {{ return 200 "ok\n"; }}
        location / {{ return 200 "stepguard lab gateway (tls)\n"; }}
    }}
"#,
            port = t.port,
            cert = t.cert.display(),
            key = t.key.display()
        ),
        None => String::new(),
    };
    let conf = format!(
        r#"daemon off;
master_process on;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/nginx-error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    server {{
        listen {vip}:{port};
        location = /healthz {{ return 200 "ok\n"; }}
        location = /unhealthy {{ return 503 "not ready\n"; }}
        location / {{ return 200 "stepguard lab gateway\n"; }}
    }}
{tls_server}}}
"#,
        dir = dir.display(),
        tmp = tmp.display()
    );
    let conf_path = dir.join("nginx.conf");
    std::fs::write(&conf_path, conf)?;
    let args = vec![
        "-e".into(),
        dir.join("nginx-error.log").display().to_string(),
        "-c".into(),
        conf_path.display().to_string(),
    ];
    spawn_in(ns, "nginx", "nginx", &args, &dir.join("nginx.log"))
}
