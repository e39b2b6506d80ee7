//! `https`: a TLS handshake (rustls), then a GET; the status line is the answer — a Gateway
//! VIP on 443 as its clients reach it. Options: `path` and `expect` as for `http`;
//! `server_name` (sent as SNI, checked against the certificate with `ca`, and the Host
//! header; default: the address, no SNI); `ca` (a PEM file of the CA certificates the
//! Gateway's chain must lead to: then the certificate is verified, expiry included). Without
//! `ca` the handshake must complete but the certificate is not verified, and every answer
//! says so. Port 443 unless given. A failed handshake (an alert, a certificate that does not
//! verify, a close) is a failed probe, like a wrong status.
use super::contract::{would_block, Progress};
use super::contract::{Exchange, Probe, Transport};
use super::kind::{Kind, Problem};
use super::ProbeError;
use crate::config::Target;
use crate::kernel::sock::{recv, send};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, ClientConnection, DigitallySignedStruct, RootCertStore};
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::path::PathBuf;
use std::sync::Arc;

pub struct Https;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Options {
    #[serde(default)]
    path: Option<String>,
    #[serde(default)]
    expect: Option<u16>,
    #[serde(default)]
    server_name: Option<String>,
    #[serde(default)]
    ca: Option<PathBuf>,
}

impl Kind for Https {
    fn name(&self) -> &'static str {
        "https"
    }
    fn default_port(&self) -> Option<u16> {
        Some(443)
    }
    fn prepare(&self, t: &Target) -> Result<Arc<dyn Probe>, Problem> {
        let o: Options = super::kind::options(t)?;
        let http = super::http::Options {
            path: o.path,
            expect: o.expect,
        };
        let (request, expect) = http.request(t, o.server_name.as_deref())?;
        let name = match &o.server_name {
            Some(n) => ServerName::try_from(n.clone()).map_err(|e| {
                Problem::new(
                    "server_name",
                    format!("{n:?} is not a DNS name or an address: {e}"),
                )
            })?,
            None => ServerName::IpAddress(t.address.into()),
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| Problem::new("", format!("TLS: {e}")))?;
        let (config, verified) = match &o.ca {
            Some(path) => {
                let roots = read_roots(path).map_err(|e| Problem::new("ca", e))?;
                (
                    builder.with_root_certificates(roots).with_no_client_auth(),
                    true,
                )
            }
            None => (
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(Unverified(provider)))
                    .with_no_client_auth(),
                false,
            ),
        };
        Ok(Arc::new(Tls {
            config: Arc::new(config),
            name,
            request,
            expect,
            verified,
        }))
    }
}

/// The CA certificates in a PEM file (at least one).
fn read_roots(path: &std::path::Path) -> Result<RootCertStore, String> {
    let certs =
        CertificateDer::pem_file_iter(path).map_err(|e| format!("read {}: {e}", path.display()))?;
    let mut roots = RootCertStore::empty();
    for c in certs {
        let c = c.map_err(|e| format!("{}: {e}", path.display()))?;
        roots
            .add(c)
            .map_err(|e| format!("{}: not a CA certificate: {e}", path.display()))?;
    }
    if roots.is_empty() {
        return Err(format!("{}: no PEM certificate in it", path.display()));
    }
    Ok(roots)
}

/// Without `ca`: any certificate, but the handshake's signatures are still checked (the server
/// holds the key of the certificate it showed).
#[derive(Debug)]
struct Unverified(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }
    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

struct Tls {
    config: Arc<ClientConfig>,
    name: ServerName<'static>,
    request: Vec<u8>,
    expect: u16,
    verified: bool,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("name", &self.name)
            .field("expect", &self.expect)
            .field("verified", &self.verified)
            .finish()
    }
}

impl Probe for Tls {
    fn transport(&self) -> Transport {
        Transport::Stream
    }
    fn exchange(self: Arc<Self>, _addr: SocketAddr) -> Box<dyn Exchange> {
        let conn = ClientConnection::new(self.config.clone(), self.name.clone())
            .map_err(|e| ProbeError::unsupported("TLS", e.to_string()));
        Box::new(Handshaking {
            tls: self,
            conn,
            buf: Vec::new(),
        })
    }
}

struct Handshaking {
    tls: Arc<Tls>,
    conn: Result<ClientConnection, ProbeError>,
    /// The plaintext answer so far.
    buf: Vec<u8>,
}

/// The probe's socket as the byte stream rustls reads and writes.
struct Socket(RawFd);

impl Read for Socket {
    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        recv(self.0, b).map(|(n, _)| n)
    }
}

impl Write for Socket {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        send(self.0, b)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn wait(conn: &ClientConnection) -> Progress {
    let out = if conn.wants_write() {
        libc::EPOLLOUT as u32
    } else {
        0
    };
    Progress::Wait(libc::EPOLLIN as u32 | out)
}

impl Handshaking {
    fn drive(&mut self, fd: RawFd) -> Progress {
        let conn = match &mut self.conn {
            Ok(c) => c,
            Err(e) => return Progress::Done(Err(e.clone())),
        };
        let mut sock = Socket(fd);
        loop {
            while conn.wants_write() {
                match conn.write_tls(&mut sock) {
                    Ok(_) => {}
                    // A full send buffer: read what came meanwhile before waiting (epoll is
                    // level-triggered: unread data would wake the engine again at once).
                    Err(e) if would_block(&e) => break,
                    Err(e) => return Progress::Done(Err(ProbeError::exchange("TLS send", &e))),
                }
            }
            match conn.read_tls(&mut sock) {
                Ok(0) => {
                    return Progress::Done(Err(ProbeError::Answer(if conn.is_handshaking() {
                        "connection closed during the TLS handshake".into()
                    } else {
                        "connection closed before a status line".into()
                    })))
                }
                Ok(_) => {}
                Err(e) if would_block(&e) => return wait(conn),
                Err(e) => return Progress::Done(Err(ProbeError::exchange("TLS receive", &e))),
            }
            if let Err(e) = conn.process_new_packets() {
                // Tell the server why (the alert rustls queued), then fail the probe.
                let _ = conn.write_tls(&mut sock);
                return Progress::Done(Err(ProbeError::Answer(format!("TLS: {e}"))));
            }
            let mut chunk = [0u8; 2048];
            loop {
                match conn.reader().read(&mut chunk) {
                    Ok(0) => {
                        return Progress::Done(Err(ProbeError::Answer(
                            "TLS closed before a status line".into(),
                        )))
                    }
                    Ok(n) => {
                        self.buf.extend_from_slice(&chunk[..n]);
                        if let Some(done) =
                            super::http::judge_status(&self.buf, self.tls.expect, "HTTPS")
                        {
                            let version = conn
                                .protocol_version()
                                .map(|v| format!("{v:?}"))
                                .unwrap_or_default();
                            let cert = if self.tls.verified {
                                "certificate verified"
                            } else {
                                "certificate not verified: no ca"
                            };
                            return Progress::Done(
                                done.map(|(d, a)| (format!("{d} ({version}, {cert})"), a)),
                            );
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) => return Progress::Done(Err(ProbeError::Answer(format!("TLS: {e}")))),
                }
            }
        }
    }
}

impl Exchange for Handshaking {
    fn open(&mut self, fd: RawFd) -> Progress {
        // Queued until the handshake completes, then sent as the first application data.
        if let Ok(c) = &mut self.conn {
            if let Err(e) = c.writer().write_all(&self.tls.request) {
                return Progress::Done(Err(ProbeError::unsupported("TLS", e.to_string())));
            }
        }
        self.drive(fd)
    }
    fn ready(&mut self, fd: RawFd) -> Progress {
        self.drive(fd)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::pki_types::PrivateKeyDer;
    use std::path::Path;

    fn openssl(args: &[&str]) {
        let out = std::process::Command::new("openssl")
            .args(args)
            .output()
            .expect("openssl (Debian's openssl package)");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A CA named `ca` and a Gateway certificate for `name` it signs (openssl, as an operator
    /// would make them): (CA certificate, leaf certificate, leaf key).
    fn certificates(dir: &Path, ca: &str, name: &str) -> (PathBuf, PathBuf, PathBuf) {
        let p = |f: &str| dir.join(f).display().to_string();
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        let (ca_pem, ca_key) = (p(&format!("{ca}.pem")), p(&format!("{ca}.key")));
        openssl(
            &[
                &["req", "-x509"][..],
                &ec,
                &["-days", "2", "-subj", &format!("/CN={ca}")],
                &["-keyout", &ca_key, "-out", &ca_pem],
            ]
            .concat(),
        );
        let (csr, key, leaf) = (
            p(&format!("{name}.csr")),
            p(&format!("{name}.key")),
            p(&format!("{name}.pem")),
        );
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
        );
        let ext = p(&format!("{name}.ext"));
        std::fs::write(
            &ext,
            format!("subjectAltName=DNS:{name}\nbasicConstraints=CA:FALSE\n"),
        )
        .unwrap();
        openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &ca_pem,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &ext,
            "-out",
            &leaf,
        ]);
        (ca_pem.into(), leaf.into(), key.into())
    }

    /// A TLS server (rustls's server side) answering each connection with `status`, on
    /// 127.0.0.1; `conns` connections, then it stops.
    fn server(cert: &Path, key: &Path, status: &'static str, conns: usize) -> u16 {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
            .unwrap()
            .map(|c| c.unwrap())
            .collect();
        let key = PrivateKeyDer::from_pem_file(key).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = Arc::new(
            rustls::ServerConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_no_client_auth()
                .with_single_cert(certs, key)
                .unwrap(),
        );
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for s in l.incoming().take(conns) {
                let Ok(mut s) = s else { continue };
                let _ = s.set_read_timeout(Some(std::time::Duration::from_secs(2)));
                let mut conn = rustls::ServerConnection::new(config.clone()).unwrap();
                let mut tls = rustls::Stream::new(&mut conn, &mut s);
                let mut req = [0u8; 1024];
                if tls.read(&mut req).is_ok() {
                    let _ = tls.write_all(
                        format!("HTTP/1.1 {status}\r\nContent-Length: 0\r\n\r\n").as_bytes(),
                    );
                    let _ = tls.flush();
                }
            }
        });
        port
    }

    fn probe(yaml: &str) -> crate::probe::ProbeOutcome {
        let t = crate::probe::parse(&format!("targets:\n  - {yaml}\n"))
            .unwrap()
            .targets
            .remove(0);
        crate::probe::engine::run_once(&crate::probe::engine::Spec::new(&t))
    }

    #[test]
    fn a_gateway_answering_tls_is_verified_against_its_ca_and_judged_by_status() {
        let dir = std::env::temp_dir().join(format!("stepguard-https-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (ca, cert, key) = certificates(&dir, "lab-ca", "gw.test");
        let (other, _, _) = certificates(&dir, "other-ca", "other.test");
        let port = server(&cert, &key, "204 No Content", 5);
        let base =
            format!("{{name: gw, address: 127.0.0.1, port: {port}, probe: https, timeout: 2s");

        let o = probe(&format!(
            "{base}, server_name: gw.test, ca: {}, expect: 204}}",
            ca.display()
        ));
        assert!(o.ok, "{o:?}");
        assert!(
            o.detail
                .starts_with("HTTPS 204 (TLSv1_3, certificate verified)"),
            "{o:?}"
        );

        let o = probe(&format!("{base}, expect: 204}}"));
        assert!(o.ok, "{o:?}");
        assert!(
            o.detail.contains("certificate not verified: no ca"),
            "{o:?}"
        );

        // A certificate its CA did not sign, and a name the certificate does not carry.
        let o = probe(&format!(
            "{base}, server_name: gw.test, ca: {}, expect: 204}}",
            other.display()
        ));
        assert!(!o.ok && o.ran, "{o:?}");
        assert!(
            o.detail.starts_with("TLS: invalid peer certificate"),
            "{o:?}"
        );
        let o = probe(&format!(
            "{base}, server_name: nope.test, ca: {}, expect: 204}}",
            ca.display()
        ));
        assert!(
            !o.ok && o.detail.contains("invalid peer certificate"),
            "{o:?}"
        );

        // The handshake completes, the status is not the one expected.
        let o = probe(&format!("{base}}}"));
        assert!(!o.ok, "{o:?}");
        assert_eq!(o.detail, "HTTPS 204, expected 200");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_plain_http_server_on_443_fails_the_handshake() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        std::thread::spawn(move || {
            if let Some(Ok(mut s)) = l.incoming().next() {
                let mut b = [0u8; 512];
                let _ = s.read(&mut b);
                let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
            }
        });
        let o = probe(&format!(
            "{{name: gw, address: 127.0.0.1, port: {port}, probe: https, timeout: 2s}}"
        ));
        assert!(!o.ok && o.ran, "{o:?}");
        assert!(o.detail.starts_with("TLS: "), "{o:?}");
    }
}
