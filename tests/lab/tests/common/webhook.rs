//! A validating admission webhook for the rollout tests: the real API server calls it (HTTPS,
//! a certificate made for the test) before it stores an Event the stepper creates with a
//! chosen reason, and the webhook holds that request for a while before allowing it. A slow
//! webhook is a production fault of its own; here it stops the stepper at an exact point (the
//! step begun and recorded, its pod not yet deleted) so a test can kill it there.
#![allow(dead_code)]
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use serde_json::{json, Value};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Default, Debug)]
pub struct Hold {
    /// Hold the next Event create with this reason this long (once).
    pub next: Option<(String, Duration)>,
    /// A held request is in flight.
    pub holding: bool,
    pub held: usize,
    pub reviews: usize,
}

pub struct Webhook {
    pub hold: Arc<Mutex<Hold>>,
    pub port: u16,
    pub cert_pem: Vec<u8>,
    _thread: std::thread::JoinHandle<()>,
}

fn base64(data: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in data.chunks(3) {
        let n = (c[0] as u32) << 16
            | (*c.get(1).unwrap_or(&0) as u32) << 8
            | *c.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            if i <= c.len() {
                out.push(T[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

async fn review(hold: Arc<Mutex<Hold>>, body: Bytes) -> Value {
    let v: Value = serde_json::from_slice(&body).unwrap_or_default();
    let uid = v["request"]["uid"].clone();
    let reason = v["request"]["object"]["reason"]
        .as_str()
        .unwrap_or("")
        .to_string();
    let wait = {
        let mut h = hold.lock().unwrap();
        h.reviews += 1;
        match h.next.clone() {
            Some((r, d)) if r == reason => {
                h.next = None;
                h.holding = true;
                h.held += 1;
                Some(d)
            }
            _ => None,
        }
    };
    if let Some(d) = wait {
        tokio::time::sleep(d).await;
        hold.lock().unwrap().holding = false;
    }
    json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
           "response": {"uid": uid, "allowed": true}})
}

impl Webhook {
    /// Serves on 127.0.0.1 (a free port) with a certificate made under `dir`.
    pub fn start(dir: &Path) -> Webhook {
        let (cert, key) = (dir.join("webhook.crt"), dir.join("webhook.key"));
        let out = std::process::Command::new("openssl")
            .args([
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=127.0.0.1",
                "-addext",
                "subjectAltName=IP:127.0.0.1",
                "-keyout",
            ])
            .arg(&key)
            .arg("-out")
            .arg(&cert)
            .output()
            .expect("run openssl");
        assert!(
            out.status.success(),
            "openssl req: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        use tokio_rustls::rustls::pki_types::pem::PemObject;
        use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&cert)
            .unwrap()
            .map(|c| c.unwrap())
            .collect();
        let key = PrivateKeyDer::from_pem_file(&key).unwrap();
        let cfg = tokio_rustls::rustls::ServerConfig::builder_with_provider(Arc::new(
            tokio_rustls::rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let hold: Arc<Mutex<Hold>> = Arc::default();
        let h = hold.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let l = tokio::net::TcpListener::from_std(listener).unwrap();
                loop {
                    let Ok((tcp, _)) = l.accept().await else {
                        continue;
                    };
                    let (acceptor, h) = (acceptor.clone(), h.clone());
                    tokio::spawn(async move {
                        let Ok(tls) = acceptor.accept(tcp).await else {
                            return;
                        };
                        let svc = hyper::service::service_fn(
                            move |req: hyper::Request<hyper::body::Incoming>| {
                                let h = h.clone();
                                async move {
                                    let body = req
                                        .into_body()
                                        .collect()
                                        .await
                                        .map(|b| b.to_bytes())
                                        .unwrap_or_default();
                                    let v = review(h, body).await;
                                    Ok::<_, std::convert::Infallible>(
                                        hyper::Response::builder()
                                            .header("content-type", "application/json")
                                            .body(Full::new(Bytes::from(v.to_string())))
                                            .unwrap(),
                                    )
                                }
                            },
                        );
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(hyper_util::rt::TokioIo::new(tls), svc)
                            .await;
                    });
                }
            });
        });
        Webhook {
            hold,
            port,
            cert_pem: std::fs::read(&cert).unwrap(),
            _thread: thread,
        }
    }

    /// The ValidatingWebhookConfiguration that sends the API server's Event creates with
    /// `reason` here (and nothing else: a CEL match condition); failurePolicy Ignore, so the
    /// rest of the test never depends on it.
    pub fn configuration(&self, reason: &str) -> Value {
        json!({"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": "stepguard-test-slow-events"},
            "webhooks": [{
                "name": "slow-events.stepguard.test",
                "clientConfig": {"url": format!("https://127.0.0.1:{}/", self.port),
                                 "caBundle": base64(&self.cert_pem)},
                "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                           "resources": ["events"], "scope": "Namespaced"}],
                "matchConditions": [{"name": "reason", "expression": format!("object.reason == '{reason}'")}],
                "failurePolicy": "Ignore", "sideEffects": "None",
                "admissionReviewVersions": ["v1"], "timeoutSeconds": 15}]})
    }
}
