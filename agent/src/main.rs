//! `stepguard`: the per-node agent and its command-line hooks.
#![deny(unsafe_code)]

/// `println!` that tolerates a closed stdout (`stepguard wait | head -1`): the exit code stays
/// the verdict's (0/1/2), never a panic's 101.
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($t)*);
    }};
}

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;
use stepguard::checks::exit_code;
use stepguard::config::Config;
use stepguard::daemon::api::router;
use stepguard::daemon::{spawn_loops, Daemon, DaemonOptions};
use stepguard::kernel::drops::KernelDrops;
use stepguard::node::NodeOptions;
use stepguard::report;

#[derive(Parser)]
#[command(
    name = "stepguard",
    version,
    about = "Verifies a node's Cilium datapath before and after a cilium-agent restart",
    long_about = "stepguard verifies a node's Cilium datapath (devices, pinned maps, VIPs, DNS) before and \
after the cilium-agent on that node restarts, and measures how long traffic was broken, so a rollout \
stepper moves to the next node only when this one is proven healthy."
)]
struct Cli {
    /// Log format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the agent: probes, node checks, the step protocol; serves the HTTP API and /metrics.
    Agent(AgentArgs),
    /// Probe the VIPs as a LAN client does, from a machine that is not a Cilium node (a NAS,
    /// a router, a small VM): a node cannot see its own L2-announcement lease move. Serves the
    /// witness side of the step protocol; the stepped node's agent collects its gaps.
    Witness(WitnessArgs),
    /// Begin a step on an agent (POST /v1/steps); prints the step id on the last line.
    Step(stepguard::hooks::StepArgs),
    /// Step a Cilium DaemonSet (updateStrategy OnDelete) node by node, each verified by the
    /// node's agent. A failed step halts the rollout for every later run until a person
    /// lifts it (--retry NODE, --skip NODE, --abort); an interrupted run's step is finished
    /// first. Exit 0 all passed, 1 a step failed (halted), 2 refused / halted / paused /
    /// interrupted / usage.
    Rollout(Box<stepguard::rollout::RolloutArgs>),
    /// Wait for a step's verdict; exit 0 passed, 1 failed, 2 timed out / agent unreachable / usage.
    Wait(stepguard::hooks::WaitArgs),
    /// Run the node checks once and print the result; exit 0 all pass, 1 any fail, 2 any unknown or usage/config error.
    Check(CheckArgs),
    /// Count kernel packet drops by reason for a while and print them (needs CAP_BPF+CAP_PERFMON).
    Drops {
        /// How long to count.
        #[arg(long, default_value = "5", value_name = "SECONDS")]
        seconds: u64,
    },
}

#[derive(clap::Args)]
struct AgentArgs {
    /// YAML config (see deploy/stepguard.example.yaml).
    #[arg(long, env = "STEPGUARD_CONFIG")]
    config: Option<PathBuf>,
    /// Address to serve on (9962-9965 are Cilium's metrics ports; 9969 is stepguard's).
    #[arg(long, default_value = "0.0.0.0:9969", env = "STEPGUARD_LISTEN")]
    listen: SocketAddr,
    /// Where steps and cilium-config snapshots are kept (survives agent restarts).
    #[arg(
        long,
        default_value = "/var/lib/stepguard",
        env = "STEPGUARD_STATE_DIR"
    )]
    state_dir: PathBuf,
    /// File holding a bearer token that POST/DELETE requests must carry (read again when
    /// the file changes: a rotated Kubernetes Secret takes effect without a restart).
    #[arg(long, env = "STEPGUARD_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// VIP and DNS probe cadence outside steps.
    #[arg(long, default_value = "1s", value_parser = parse_dur)]
    probe_interval: Duration,
    /// Cadence of the devices/maps/config checks.
    #[arg(long, default_value = "10s", value_parser = parse_dur)]
    slow_interval: Duration,
    /// VIP probe cadence during a step (a step may ask for its own).
    #[arg(long, default_value = "10ms", value_parser = parse_dur)]
    burst_interval: Duration,
    /// HTTP connections served at once. A connection takes a slot only once its request
    /// starts to arrive; idle ones wait without a slot (at most 128; the oldest is closed
    /// first), so /readyz and /metrics answer under a flood of idle connections.
    #[arg(long, default_value = "256")]
    max_connections: usize,
    /// Time a client has to send its request headers.
    #[arg(long, default_value = "5s", value_parser = parse_dur)]
    header_timeout: Duration,
    /// A response the client does not read for this long closes its connection (a slow
    /// reader holds no slot); one connection serves at most 64 requests, then closes.
    #[arg(long, default_value = "5s", value_parser = parse_dur)]
    write_timeout: Duration,
    /// Long-polls (`GET /v1/steps/{id}?wait=`) held at once; more are answered at once.
    #[arg(long, default_value = "64")]
    max_long_polls: usize,
    /// After SIGTERM, how long open connections get before the agent exits (keep it below
    /// the pod's terminationGracePeriodSeconds).
    #[arg(long, default_value = "5s", value_parser = parse_dur)]
    shutdown_grace: Duration,
}

#[derive(clap::Args)]
struct WitnessArgs {
    /// YAML config: only `targets` is used (the VIPs as LAN clients reach them).
    #[arg(long, env = "STEPGUARD_CONFIG")]
    config: PathBuf,
    /// Address to serve on.
    #[arg(long, default_value = "0.0.0.0:9970", env = "STEPGUARD_LISTEN")]
    listen: SocketAddr,
    /// File holding the bearer token every step request (begin, read, end) must carry (the
    /// node agents send their own `--token-file`'s token); read again when it changes.
    /// Required unless `--allow-unauthenticated`.
    #[arg(long, env = "STEPGUARD_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// Serve steps without a token: anyone on the LAN may then begin, read and end them.
    #[arg(long)]
    allow_unauthenticated: bool,
    /// Probe cadence outside steps.
    #[arg(long, default_value = "1s", value_parser = parse_dur)]
    probe_interval: Duration,
    /// Probe cadence during a step (a step may ask for its own).
    #[arg(long, default_value = "10ms", value_parser = parse_dur)]
    burst_interval: Duration,
}

fn parse_dur(s: &str) -> Result<Duration, stepguard::duration::DurationError> {
    stepguard::duration::parse(s)
}

#[derive(clap::Args)]
struct CheckArgs {
    /// YAML config (see deploy/stepguard.example.yaml). Without it: a default Cilium node at /sys/fs/bpf.
    #[arg(long, env = "STEPGUARD_CONFIG")]
    config: Option<PathBuf>,
    /// bpffs root holding Cilium's pins (overrides the config).
    #[arg(long)]
    bpffs: Option<PathBuf>,
    /// Mounted cilium-config ConfigMap directory (overrides the config).
    #[arg(long)]
    cilium_config: Option<PathBuf>,
    /// Cilium version whose map profile to expect: auto, 1.16, 1.18, 1.20 (overrides the config).
    #[arg(long, value_parser = ["auto", "1.16", "1.18", "1.20"])]
    cilium: Option<String>,
    /// Only these checks (repeat or comma-separate): devices, maps, vips, dns, config.
    #[arg(long, value_delimiter = ',', value_parser = ["devices", "maps", "vips", "dns", "config"])]
    only: Vec<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
    format: OutputFormat,
    /// Directory for the agent's state (cilium-config snapshots, to name changed keys).
    #[arg(long)]
    state_dir: Option<PathBuf>,
}

#[derive(Clone, Copy, ValueEnum)]
enum OutputFormat {
    Text,
    Json,
}

fn load_config(args: &CheckArgs) -> Result<Config> {
    let mut cfg = match &args.config {
        Some(p) => stepguard::probe::load(p)?,
        None => Config::default(),
    };
    if let Some(b) = &args.bpffs {
        cfg.bpffs = b.clone();
    }
    if let Some(c) = &args.cilium_config {
        cfg.cilium_config = Some(c.clone());
    }
    if let Some(v) = &args.cilium {
        cfg.cilium = v.clone();
    }
    Ok(cfg)
}

fn check(args: CheckArgs) -> Result<stepguard::exit::ExitCode> {
    let cfg = load_config(&args)?;
    cfg.check_paths()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start tokio runtime")?;
    let only: BTreeSet<String> = args.only.iter().cloned().collect();
    let opts = NodeOptions {
        state_dir: args.state_dir.clone(),
        count_all: true,
        topology: None,
    };
    let (results, _) = rt.block_on(stepguard::node::run(&cfg, &opts, &only));
    match args.format {
        OutputFormat::Text => {
            use std::io::Write as _;
            let _ = write!(std::io::stdout(), "{}", report::text(&results));
        }
        OutputFormat::Json => {
            say!("{}", serde_json::to_string_pretty(&report::json(&results))?)
        }
    }
    Ok(exit_code(&results))
}

fn init_logging(format: LogFormat) {
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => b.init(),
        LogFormat::Json => b.json().init(),
    }
}

fn main() {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    let code = match run(cli.cmd) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("stepguard: {e:#}");
            stepguard::exit::ExitCode::NotDecided
        }
    };
    std::process::exit(code.code());
}

fn run(cmd: Cmd) -> Result<stepguard::exit::ExitCode> {
    match cmd {
        Cmd::Agent(args) => agent(args),
        Cmd::Witness(args) => witness(args),
        Cmd::Rollout(args) => stepguard::rollout::run(*args),
        Cmd::Step(args) => stepguard::hooks::step(args),
        Cmd::Wait(args) => stepguard::hooks::wait(args),
        Cmd::Check(args) => check(args),
        Cmd::Drops { seconds } => {
            let drops = KernelDrops::start();
            if let Some(reason) = drops.unavailable_reason() {
                say!("kernel drops: unknown ({reason})");
                return Ok(stepguard::exit::ExitCode::NotDecided);
            }
            std::thread::sleep(std::time::Duration::from_secs(seconds));
            say!(
                "kernel drops in {seconds}s via {}:",
                drops.attach_point().unwrap_or("?")
            );
            for (reason, n) in drops.by_reason()? {
                say!("  {reason:<32} {n}");
            }
            Ok(stepguard::exit::ExitCode::Ok)
        }
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("start tokio runtime")
}

/// The agent's cadences, each within its range (a zero interval would panic a worker or
/// busy-loop while the agent reports ready).
fn check_intervals(args: &AgentArgs) -> Result<()> {
    use stepguard::limits::{BURST_INTERVAL, PROBE_INTERVAL};
    let ms = Duration::from_millis;
    stepguard::duration::flags(&[
        ("--probe-interval", args.probe_interval, PROBE_INTERVAL),
        (
            "--slow-interval",
            args.slow_interval,
            (ms(100), ms(3_600_000)),
        ),
        ("--burst-interval", args.burst_interval, BURST_INTERVAL),
        (
            "--header-timeout",
            args.header_timeout,
            (ms(100), ms(60_000)),
        ),
        ("--shutdown-grace", args.shutdown_grace, (ms(0), ms(60_000))),
    ])
    .map_err(anyhow::Error::msg)?;
    if args.max_connections == 0 || args.max_connections > 65_536 {
        anyhow::bail!("--max-connections: must be between 1 and 65536");
    }
    if args.max_long_polls > args.max_connections {
        anyhow::bail!("--max-long-polls: must not exceed --max-connections");
    }
    if args.listen.port() == 0 {
        anyhow::bail!("--listen: port 0 is not a port a stepper can find");
    }
    Ok(())
}

fn agent(args: AgentArgs) -> Result<stepguard::exit::ExitCode> {
    check_intervals(&args)?;
    let cfg = match &args.config {
        Some(p) => stepguard::probe::load(p)?,
        None => Config::default(),
    };
    cfg.check_paths()?;
    cfg.check_probe_budget(args.burst_interval, args.probe_interval)?;
    let token = stepguard::serving::Token::from_file(args.token_file.as_deref())?;
    let opts = DaemonOptions {
        state_dir: args.state_dir.clone(),
        probe_interval: args.probe_interval,
        slow_interval: args.slow_interval,
        burst_interval: args.burst_interval,
        token,
        drop_accounting: true,
        max_long_polls: args.max_long_polls,
    };
    runtime()?.block_on(async move {
        let d = Daemon::new(cfg, opts)?;
        match d.drop_accounting() {
            Ok(at) => tracing::info!(attach = at, "kernel drop accounting active"),
            Err(r) => tracing::warn!(reason = r, "kernel drop accounting unavailable: the drops signal is unknown"),
        }
        let listener = tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("listen on {}", args.listen))?;
        spawn_loops(&d);
        stepguard::kernel::release_freed_memory();
        tracing::info!(listen = %args.listen, state_dir = %args.state_dir.display(), targets = d.config().targets.len(), "stepguard agent serving");
        let readiness = d.readiness();
        readiness.set(true);
        let d2 = d.clone();
        let limits = stepguard::serving::Limits {
            max_connections: args.max_connections,
            header_timeout: args.header_timeout,
            shutdown_grace: args.shutdown_grace,
            write_timeout: args.write_timeout,
            ..Default::default()
        };
        stepguard::serving::serve(listener, router(d), limits, async move {
            shutdown_signal().await;
            d2.shut_down();
            tracing::info!("shutting down");
            tokio::time::sleep(Duration::from_millis(200)).await;
        })
        .await;
        Ok(stepguard::exit::ExitCode::Ok)
    })
}

fn witness(args: WitnessArgs) -> Result<stepguard::exit::ExitCode> {
    stepguard::witness::check_intervals(args.probe_interval, args.burst_interval)?;
    if args.listen.port() == 0 {
        anyhow::bail!("--listen: port 0 is not a port an agent can find");
    }
    let cfg = stepguard::probe::load(&args.config)?;
    stepguard::witness::check_config(&cfg).with_context(|| args.config.display().to_string())?;
    match (&args.token_file, args.allow_unauthenticated) {
        (None, false) => anyhow::bail!(
            "a witness needs --token-file (the token the node agents send); to serve steps to anyone on the LAN, say --allow-unauthenticated"
        ),
        (Some(_), true) => anyhow::bail!("--token-file and --allow-unauthenticated: choose one"),
        (None, true) => tracing::warn!("serving steps without a token (--allow-unauthenticated): anyone on the LAN may begin, read and end them"),
        (Some(_), false) => {}
    }
    let token = stepguard::serving::Token::from_file(args.token_file.as_deref())?;
    let opts = stepguard::witness::WitnessOptions {
        probe_interval: args.probe_interval,
        burst_interval: args.burst_interval,
        token,
    };
    runtime()?.block_on(async move {
        let neigh = match stepguard::kernel::neigh::follow(&stepguard::witness::Witness::watched(&cfg)).await {
            Ok(n) => Some(n),
            Err(e) => {
                tracing::warn!(error = %e, "cannot follow the neighbour table: reports carry no MAC addresses");
                None
            }
        };
        let w = stepguard::witness::Witness::new(cfg, opts, neigh)?;
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("listen on {}", args.listen))?;
        stepguard::witness::spawn_loops(&w);
        tracing::info!(listen = %args.listen, targets = w.cfg.targets.len(), instance = %w.instance, "stepguard witness serving");
        stepguard::serving::serve(
            listener,
            stepguard::witness::router(w),
            stepguard::serving::Limits::default(),
            shutdown_signal(),
        )
        .await;
        Ok(stepguard::exit::ExitCode::Ok)
    })
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    // SIGHUP (a terminal closing, a habit of reloading daemons) would end the process by
    // default: it is handled, and ignored with a line saying so.
    let mut hup = signal(SignalKind::hangup()).ok();
    loop {
        tokio::select! {
            _ = term.recv() => return,
            _ = tokio::signal::ctrl_c() => return,
            Some(()) = async { match hup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => {
                tracing::warn!("SIGHUP ignored: the configuration is read at start; restart the process to apply a change (the token file is read again whenever it changes)");
            }
        }
    }
}
