//! A Git server on 127.0.0.1 for the GitOps tests: the bare repositories under one directory,
//! served over Git's smart HTTP by Debian's own `git http-backend`, run as a CGI per request
//! (as Apache or nginx with fcgiwrap run it). Fetch and clone only; a test commits into the
//! bare repository by its path. Everything is bounded: connections at once, header and body
//! sizes, a request's time and the backend's.
use anyhow::{bail, Context, Result};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Debian's `git http-backend`.
pub const HTTP_BACKEND: &str = "/usr/lib/git-core/git-http-backend";

/// A request line and its headers, at most.
const MAX_HEAD: usize = 16 * 1024;
/// A request body (a fetch's negotiation), at most.
const MAX_BODY: usize = 8 << 20;
/// A response (a pack), at most.
const MAX_RESPONSE: usize = 256 << 20;
/// Connections served at once; more are answered 503.
const MAX_CONNECTIONS: usize = 8;
/// A client's reads and writes, and the backend's run.
const IO_TIMEOUT: Duration = Duration::from_secs(10);
const BACKEND_TIMEOUT: Duration = Duration::from_secs(60);

/// The server; stops when dropped.
pub struct GitServer {
    pub addr: SocketAddr,
    pub root: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl GitServer {
    /// Serves the repositories under `root` on a free port of 127.0.0.1.
    pub fn start(root: &Path) -> Result<GitServer> {
        if !Path::new(HTTP_BACKEND).exists() {
            bail!("no {HTTP_BACKEND}: install Debian's git (cargo xtask setup)");
        }
        let listener = TcpListener::bind("127.0.0.1:0").context("bind the Git server")?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let (s, r) = (stop.clone(), root.to_path_buf());
        let thread = std::thread::Builder::new()
            .name("git-server".into())
            .spawn(move || serve(listener, &r, &s))
            .context("start the Git server's thread")?;
        Ok(GitServer {
            addr,
            root: root.to_path_buf(),
            stop,
            thread: Some(thread),
        })
    }

    /// The HTTP URL of the repository `name` (`NAME.git` under the root).
    pub fn url(&self, name: &str) -> String {
        format!("http://{}/{name}.git", self.addr)
    }
}

impl Drop for GitServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(listener: TcpListener, root: &Path, stop: &AtomicBool) {
    let busy = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(mut conn) = conn else { continue };
        if busy.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            busy.fetch_sub(1, Ordering::SeqCst);
            let _ = conn.write_all(&response(503, &[], b"busy\n"));
            continue;
        }
        let (mine, root) = (busy.clone(), root.to_path_buf());
        let spawned = std::thread::Builder::new()
            .name("git-request".into())
            .spawn(move || {
                let _ = conn.set_read_timeout(Some(IO_TIMEOUT));
                let _ = conn.set_write_timeout(Some(IO_TIMEOUT));
                let reply = match read_request(&mut conn).and_then(|r| backend(&root, &r)) {
                    Ok(r) => r,
                    Err(e) => response(400, &[], format!("{e:#}\n").as_bytes()),
                };
                let _ = conn.write_all(&reply);
                mine.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            // The closure (and its count) went with the failed spawn.
            busy.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// A parsed HTTP/1.1 request.
#[derive(Debug, Default)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub query: String,
    /// Header names lower-cased, in order.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Reads one request (a `Content-Length` or chunked body), bounded by [`MAX_HEAD`] and
/// [`MAX_BODY`].
pub fn read_request(conn: impl Read) -> Result<Request> {
    let mut r = BufReader::new(conn.take((MAX_HEAD + MAX_BODY + 64 * 1024) as u64));
    let mut head = 0;
    let mut line = String::new();
    let mut next_line = |r: &mut BufReader<_>, line: &mut String| -> Result<()> {
        line.clear();
        let n = r.read_line(line).context("read the request")?;
        head += n;
        if n == 0 || head > MAX_HEAD {
            bail!("the request's head is cut short or over {MAX_HEAD} bytes");
        }
        Ok(())
    };
    next_line(&mut r, &mut line)?;
    let mut parts = line.split_whitespace();
    let (method, target) = match (parts.next(), parts.next()) {
        (Some(m), Some(t)) => (m.to_string(), t.to_string()),
        _ => bail!("not an HTTP request line: {line:?}"),
    };
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p.to_string(), q.to_string()),
        None => (target, String::new()),
    };
    let mut req = Request {
        method,
        path,
        query,
        ..Default::default()
    };
    loop {
        next_line(&mut r, &mut line)?;
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        let (n, v) = l.split_once(':').context("a header without ':'")?;
        req.headers
            .push((n.trim().to_ascii_lowercase(), v.trim().to_string()));
    }
    if req
        .header("transfer-encoding")
        .is_some_and(|t| t.eq_ignore_ascii_case("chunked"))
    {
        loop {
            next_line(&mut r, &mut line)?;
            let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
                .context("a chunk size")?;
            if req.body.len() + size > MAX_BODY {
                bail!("the request's body is over {MAX_BODY} bytes");
            }
            if size == 0 {
                next_line(&mut r, &mut line)?;
                break;
            }
            let from = req.body.len();
            req.body.resize(from + size, 0);
            r.read_exact(&mut req.body[from..]).context("a chunk")?;
            next_line(&mut r, &mut line)?;
        }
    } else if let Some(n) = req.header("content-length") {
        let n: usize = n.parse().context("Content-Length")?;
        if n > MAX_BODY {
            bail!("the request's body is over {MAX_BODY} bytes");
        }
        req.body.resize(n, 0);
        r.read_exact(&mut req.body).context("the request's body")?;
    }
    Ok(req)
}

/// Runs `git http-backend` for `req` as a CGI; the HTTP response it makes.
fn backend(root: &Path, req: &Request) -> Result<Vec<u8>> {
    if req.path.split('/').any(|s| s == "..") {
        return Ok(response(403, &[], b"no\n"));
    }
    let mut cmd = Command::new(HTTP_BACKEND);
    cmd.env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("GIT_PROJECT_ROOT", root)
        .env("GIT_HTTP_EXPORT_ALL", "1")
        .env("GATEWAY_INTERFACE", "CGI/1.1")
        .env("SERVER_PROTOCOL", "HTTP/1.1")
        .env("REQUEST_METHOD", &req.method)
        .env("PATH_INFO", &req.path)
        .env("QUERY_STRING", &req.query)
        .env("REMOTE_ADDR", "127.0.0.1")
        .env("CONTENT_LENGTH", req.body.len().to_string());
    if let Some(t) = req.header("content-type") {
        cmd.env("CONTENT_TYPE", t);
    }
    // HTTP_* as CGI gives them: http-backend reads Content-Encoding (a gzipped negotiation)
    // and Git-Protocol (protocol v2) from there.
    for (n, v) in &req.headers {
        if n != "content-type" && n != "content-length" {
            cmd.env(
                format!("HTTP_{}", n.to_ascii_uppercase().replace('-', "_")),
                v,
            );
        }
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("run {HTTP_BACKEND}"))?;
    let mut stdin = child.stdin.take().context("the backend's stdin")?;
    let body = req.body.clone();
    let writer = std::thread::spawn(move || stdin.write_all(&body));
    let mut stdout = child.stdout.take().context("the backend's stdout")?;
    let reader = std::thread::spawn(move || {
        let mut out = Vec::new();
        let r = (&mut stdout)
            .take(MAX_RESPONSE as u64 + 1)
            .read_to_end(&mut out);
        r.map(|_| out)
    });
    let mut stderr = child.stderr.take().context("the backend's stderr")?;
    let errs = std::thread::spawn(move || {
        let mut e = Vec::new();
        let _ = (&mut stderr).take(64 * 1024).read_to_end(&mut e);
        e
    });
    let deadline = Instant::now() + BACKEND_TIMEOUT;
    let status = loop {
        if let Some(s) = child.try_wait().context("wait for the backend")? {
            break s;
        }
        if Instant::now() > deadline {
            // The child this request started, by its handle.
            let _ = child.kill();
            let _ = child.wait();
            bail!("{HTTP_BACKEND} ran over {BACKEND_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let _ = writer.join();
    let out = reader
        .join()
        .map_err(|_| anyhow::anyhow!("the backend's reader panicked"))?
        .context("read the backend's output")?;
    let err = errs.join().unwrap_or_default();
    if out.len() > MAX_RESPONSE {
        bail!("the backend's response is over {MAX_RESPONSE} bytes");
    }
    if !status.success() && out.is_empty() {
        bail!(
            "{HTTP_BACKEND} {status}: {}",
            String::from_utf8_lossy(&err).trim()
        );
    }
    cgi_response(&out)
}

/// Turns a CGI's output (headers, a blank line, the body) into an HTTP response: its
/// `Status:` (200 when absent) and its other headers.
pub fn cgi_response(out: &[u8]) -> Result<Vec<u8>> {
    let (end, skip) = match (find(out, b"\r\n\r\n"), find(out, b"\n\n")) {
        (Some(a), Some(b)) if b < a => (b, 2),
        (Some(a), _) => (a, 4),
        (None, Some(b)) => (b, 2),
        (None, None) => bail!("the CGI's output has no end of headers"),
    };
    let head = String::from_utf8_lossy(&out[..end]);
    let mut status = 200;
    let mut headers = Vec::new();
    for l in head.lines() {
        let (n, v) = l.split_once(':').context("a CGI header without ':'")?;
        if n.trim().eq_ignore_ascii_case("status") {
            status = v
                .split_whitespace()
                .next()
                .and_then(|c| c.parse().ok())
                .context("the CGI's Status")?;
        } else {
            headers.push((n.trim().to_string(), v.trim().to_string()));
        }
    }
    Ok(response(status, &headers, &out[end + skip..]))
}

fn find(h: &[u8], n: &[u8]) -> Option<usize> {
    h.windows(n.len()).position(|w| w == n)
}

pub(crate) fn response(status: u16, headers: &[(String, String)], body: &[u8]) -> Vec<u8> {
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        503 => "Service Unavailable",
        _ => "",
    };
    let mut r = format!("HTTP/1.1 {status} {reason}\r\n");
    for (n, v) in headers {
        r += &format!("{n}: {v}\r\n");
    }
    r += &format!(
        "Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let mut r = r.into_bytes();
    r.extend_from_slice(body);
    r
}

/// `git` with `args` in `dir` (a commit needs no user configuration: the lab's author is set).
pub fn git(dir: &Path, args: &[&str]) -> Result<String> {
    let o = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .env("GIT_AUTHOR_NAME", "stepguard lab")
        .env("GIT_AUTHOR_EMAIL", "lab@stepguard.invalid")
        .env("GIT_COMMITTER_NAME", "stepguard lab")
        .env("GIT_COMMITTER_EMAIL", "lab@stepguard.invalid")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_TERMINAL_PROMPT", "0")
        .output()
        .context("run git")?;
    if !o.status.success() {
        bail!(
            "git {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&o.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&o.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cgi_status_and_headers_become_the_http_response() {
        let r =
            cgi_response(b"Status: 404 Not Found\r\nContent-Type: text/plain\r\n\r\nnope").unwrap();
        let r = String::from_utf8(r).unwrap();
        assert!(r.starts_with("HTTP/1.1 404 Not Found\r\n"), "{r}");
        assert!(r.contains("Content-Type: text/plain\r\n"), "{r}");
        assert!(
            r.ends_with("Content-Length: 4\r\nConnection: close\r\n\r\nnope"),
            "{r}"
        );
        let r = String::from_utf8(cgi_response(b"Expires: 0\n\nok").unwrap()).unwrap();
        assert!(
            r.starts_with("HTTP/1.1 200 OK\r\n") && r.ends_with("\r\n\r\nok"),
            "{r}"
        );
        assert!(cgi_response(b"no end").is_err());
    }

    #[test]
    fn a_chunked_request_is_read_whole_and_an_oversized_one_refused() {
        let req = read_request(
            &b"POST /r.git/git-upload-pack HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Type: x\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"[..],
        )
        .unwrap();
        assert_eq!(
            (req.path.as_str(), req.body.as_slice()),
            ("/r.git/git-upload-pack", &b"abcde"[..])
        );
        assert_eq!(req.header("content-type"), Some("x"));
        let big = format!(
            "POST / HTTP/1.1\r\nContent-Length: {}\r\n\r\n",
            MAX_BODY + 1
        );
        assert!(read_request(big.as_bytes()).is_err());
        let long = format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(MAX_HEAD));
        assert!(read_request(long.as_bytes()).is_err());
    }

    /// A clone over smart HTTP from the server, and a fetch of a later commit.
    #[test]
    fn git_clones_and_fetches_over_smart_http() {
        let dir = std::env::temp_dir().join(format!("stepguard-git-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (bare, work, clone) = (dir.join("repo.git"), dir.join("work"), dir.join("clone"));
        git(
            &dir,
            &["init", "-q", "--bare", "-b", "main", bare.to_str().unwrap()],
        )
        .unwrap();
        git(&dir, &["init", "-q", "-b", "main", work.to_str().unwrap()]).unwrap();
        std::fs::write(work.join("a"), "one\n").unwrap();
        git(&work, &["add", "a"]).unwrap();
        git(&work, &["commit", "-q", "-m", "one"]).unwrap();
        git(&work, &["push", "-q", bare.to_str().unwrap(), "main"]).unwrap();
        let s = GitServer::start(&dir).unwrap();
        git(
            &dir,
            &["clone", "-q", &s.url("repo"), clone.to_str().unwrap()],
        )
        .unwrap();
        assert_eq!(std::fs::read_to_string(clone.join("a")).unwrap(), "one\n");
        std::fs::write(work.join("a"), "two\n").unwrap();
        git(&work, &["commit", "-q", "-am", "two"]).unwrap();
        git(&work, &["push", "-q", bare.to_str().unwrap(), "main"]).unwrap();
        git(&clone, &["pull", "-q", "--ff-only"]).unwrap();
        assert_eq!(std::fs::read_to_string(clone.join("a")).unwrap(), "two\n");
        // Smart HTTP: the refs come as the upload-pack service's advertisement (a dumb server
        // would serve `info/refs` as a file, which this bare repository does not have).
        let mut c = TcpStream::connect(s.addr).unwrap();
        c.write_all(b"GET /repo.git/info/refs?service=git-upload-pack HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut adv = String::new();
        c.read_to_string(&mut adv).unwrap();
        assert!(adv.starts_with("HTTP/1.1 200 OK\r\n"), "{adv}");
        assert!(
            adv.contains("Content-Type: application/x-git-upload-pack-advertisement"),
            "{adv}"
        );
        let head = git(&work, &["rev-parse", "HEAD"]).unwrap();
        assert!(adv.contains(head.trim()), "{adv}");
        drop(s);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
