//! A TCP forwarder from a lab namespace to the API server on the host's loopback.
use anyhow::{Context, Result};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A TCP forwarder: listens on `ip` inside network namespace `netns` and carries each
/// connection, byte for byte, to `target` in the host's namespace. Stops (and cuts its
/// connections) when dropped.
pub struct Forward {
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
    conns: Arc<std::sync::Mutex<Vec<TcpStream>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Forward {
    pub fn start(netns: &str, ip: &str, target: SocketAddr) -> Result<Forward> {
        let ip = ip.to_string();
        let listener =
            crate::sys::netns::in_netns(netns, move || Ok(TcpListener::bind((ip.as_str(), 0))?))
                .with_context(|| format!("listen in {netns}"))?;
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let conns: Arc<std::sync::Mutex<Vec<TcpStream>>> = Arc::default();
        let (st, cs) = (stop.clone(), conns.clone());
        let thread = std::thread::spawn(move || {
            while !st.load(Ordering::Relaxed) {
                let (client, _) = match listener.accept() {
                    Ok(c) => c,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    }
                    Err(_) => continue,
                };
                let _ = client.set_nonblocking(false);
                let Ok(server) = TcpStream::connect_timeout(&target, Duration::from_secs(2)) else {
                    continue; // the client sees its connection closed, as with no server
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                {
                    let mut cs = cs.lock().unwrap_or_else(|e| e.into_inner());
                    cs.retain(|c| c.peer_addr().is_ok());
                    cs.extend(client.try_clone().ok());
                    cs.extend(server.try_clone().ok());
                }
                for (mut from, mut to) in [
                    (client.try_clone(), server.try_clone()),
                    (server.try_clone(), client.try_clone()),
                ]
                .into_iter()
                .filter_map(|(a, b)| Some((a.ok()?, b.ok()?)))
                {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Write);
                    });
                }
            }
        });
        Ok(Forward {
            addr,
            stop,
            conns,
            thread: Some(thread),
        })
    }
}

impl Drop for Forward {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for c in self.conns.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
