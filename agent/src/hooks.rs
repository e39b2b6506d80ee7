//! The command-line hooks a stepper scripts: `stepguard step` begins a step on a node's
//! agent, `stepguard wait` waits for its verdict; exit codes 0 passed, 1 failed, 2 unknown.
use anyhow::{Context, Result};
use std::path::PathBuf;
use std::time::Duration;

/// `println!` that tolerates a closed stdout (`stepguard wait | head -1`): the exit code stays
/// the verdict's (0/1/2), never a panic's 101.
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($t)*);
    }};
}

fn parse_dur(s: &str) -> Result<Duration, crate::duration::DurationError> {
    crate::duration::parse(s)
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start tokio runtime")
}

#[derive(clap::Args)]
pub struct StepArgs {
    /// The agent, e.g. http://10.0.0.5:9969
    #[arg(long)]
    pub agent: String,
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// Step id (default: the agent makes one). Re-using the active id is idempotent.
    #[arg(long)]
    pub id: Option<String>,
    /// The step's only deadline: the reload, refills and regenerations may take until
    /// then; what is still pending at it fails with its own reason.
    #[arg(long)]
    pub timeout: Option<String>,
    /// How long everything must stay green, once nothing is pending, before the step passes
    /// (a window, not a deadline).
    #[arg(long)]
    pub settle: Option<String>,
    /// Longest acceptable outage per target (targets may set their own).
    #[arg(long)]
    pub max_gap: Option<String>,
    /// Probe cadence during the step.
    #[arg(long)]
    pub burst_interval: Option<String>,
    /// The host devices that must carry the datapath after the restart, when the rollout
    /// changes them on purpose (comma-separated, exact names). Default: as before.
    #[arg(long, value_delimiter = ',')]
    pub expect_devices: Option<Vec<String>>,
    /// The Cilium version that must come back (an upgrade step), e.g. 1.18.
    #[arg(long)]
    pub expect_cilium: Option<String>,
    /// Hooks the restart removes on purpose (comma-separated reload keys or devices:
    /// cilium_vxlan for tunnel → native, eth0:xdp for XDP off, eth0:to_netdev); they must be
    /// gone after it.
    #[arg(long, value_delimiter = ',')]
    pub expect_gone: Option<Vec<String>>,
    /// A witness (`stepguard witness` on a LAN machine, http://HOST:PORT) that probes the VIPs
    /// as LAN clients do during the step; repeat for several. Its gaps are part of the verdict.
    #[arg(long = "witness", value_name = "URL")]
    pub witnesses: Vec<String>,
}

#[derive(clap::Args)]
pub struct WaitArgs {
    #[arg(long)]
    pub agent: String,
    #[arg(long)]
    pub step: String,
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// Stop waiting after this long (exit 2).
    #[arg(long, default_value = "15m", value_parser = parse_dur)]
    pub timeout: Duration,
}

/// `stepguard step`: begins a step on the agent; prints its id (exit 0), or why not (2).
pub fn step(args: StepArgs) -> Result<crate::exit::ExitCode> {
    let token = crate::client::read_token(args.token_file.as_deref())?;
    let agent = crate::client::Agent::new(&args.agent, token)?;
    let mut body = serde_json::Map::new();
    for (k, v) in [
        ("id", &args.id),
        ("timeout", &args.timeout),
        ("settle", &args.settle),
        ("max_gap", &args.max_gap),
        ("burst_interval", &args.burst_interval),
    ] {
        if let Some(v) = v {
            body.insert(k.into(), serde_json::Value::String(v.clone()));
        }
    }
    let mut expect = serde_json::Map::new();
    if let Some(d) = &args.expect_devices {
        expect.insert("devices".into(), serde_json::json!(d));
    }
    if let Some(c) = &args.expect_cilium {
        expect.insert("cilium".into(), serde_json::json!(c));
    }
    if let Some(g) = &args.expect_gone {
        expect.insert("gone".into(), serde_json::json!(g));
    }
    if !expect.is_empty() {
        body.insert("expect".into(), serde_json::Value::Object(expect));
    }
    if !args.witnesses.is_empty() {
        body.insert("witnesses".into(), serde_json::json!(args.witnesses));
    }
    let (status, v) = runtime()?.block_on(agent.call(
        "POST",
        "/v1/steps",
        Some(serde_json::Value::Object(body)),
        Duration::from_secs(60),
    ))?;
    match status {
        200 | 201 => {
            say!(
                "step begun on {} (baseline: {} devices, {} maps)",
                args.agent,
                v["baseline"]["programs"]
                    .as_object()
                    .map(|o| o.len())
                    .unwrap_or(0),
                v["baseline"]["maps"]
                    .as_object()
                    .map(|o| o.len())
                    .unwrap_or(0)
            );
            say!("{}", v["id"].as_str().unwrap_or(""));
            Ok(crate::exit::ExitCode::Ok)
        }
        _ => {
            eprintln!(
                "stepguard: agent answered {status}: {}",
                v["error"]
                    .as_str()
                    .map(String::from)
                    .unwrap_or_else(|| v.to_string())
            );
            Ok(crate::exit::ExitCode::NotDecided)
        }
    }
}

/// `stepguard wait`: long-polls the step until its verdict: 0 passed, 1 failed, 2 not
/// decided in time or unreachable.
pub fn wait(args: WaitArgs) -> Result<crate::exit::ExitCode> {
    let token = crate::client::read_token(args.token_file.as_deref())?;
    let agent = crate::client::Agent::new(&args.agent, token)?;
    let deadline = std::time::Instant::now() + args.timeout;
    let rt = runtime()?;
    let mut last_line = String::new();
    let mut last_err = String::new();
    let mut pace = crate::client::Pace::default();
    let mut retry_after = None;
    loop {
        // At most two requests a second, and not before a Retry-After.
        rt.block_on(pace.wait(retry_after.take()));
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            eprintln!(
                "stepguard: step {} not decided within {}{}",
                args.step,
                crate::duration::human(args.timeout),
                if last_err.is_empty() {
                    String::new()
                } else {
                    format!(" (last error: {last_err})")
                }
            );
            return Ok(crate::exit::ExitCode::NotDecided);
        }
        let wait = left.min(Duration::from_secs(20));
        let path = format!("/v1/steps/{}?wait={}ms", args.step, wait.as_millis().max(1));
        let answer = rt
            .block_on(agent.call_paced("GET", &path, None, wait + Duration::from_secs(10)))
            .map(|(s, v, ra)| {
                retry_after = ra;
                (s, v)
            });
        match answer {
            Ok((200, v)) => {
                let view: crate::step::view::StepView =
                    serde_json::from_value(v).context("the agent's step response is not a step")?;
                say!("{}", view.text());
                return Ok(match view.verdict.map(|v| v.status) {
                    Some(crate::step::Status::Passed) => crate::exit::ExitCode::Ok,
                    _ => crate::exit::ExitCode::Failed,
                });
            }
            Ok((202, v)) => {
                let line = format!(
                    "{}: {}",
                    v["phase"].as_str().unwrap_or("?"),
                    v["checks"]["reload"]["reason"]
                        .as_str()
                        .unwrap_or("taking baseline")
                );
                if line != last_line {
                    say!("{line}");
                    last_line = line;
                }
            }
            Ok((404, _)) => {
                eprintln!("stepguard: the agent has no step {}", args.step);
                return Ok(crate::exit::ExitCode::NotDecided);
            }
            Ok((status, v)) => {
                last_err = format!("{status}: {}", v["error"].as_str().unwrap_or(""));
                retry_after = retry_after.or(Some(Duration::from_secs(1)));
            }
            Err(e) => {
                // The agent may be restarting (it resumes the step from disk): keep trying.
                last_err = format!("{e:#}");
                retry_after = Some(Duration::from_secs(1));
            }
        }
    }
}
