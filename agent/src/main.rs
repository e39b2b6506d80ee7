//! `stepguard`: the per-node agent and its command-line hooks.
use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use stepguard::checks::exit_code;
use stepguard::config::Config;
use stepguard::kernel::drops::KernelDrops;
use stepguard::metrics::Metrics;
use stepguard::node::NodeOptions;
use stepguard::report;
use stepguard::server::{router, AppState};

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
    /// Run the agent: serves /metrics, /livez, /readyz.
    Agent {
        /// Address to serve on (9962-9965 are Cilium's metrics ports; 9969 is stepguard's).
        #[arg(long, default_value = "0.0.0.0:9969", env = "STEPGUARD_LISTEN")]
        listen: SocketAddr,
    },
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
        Some(p) => Config::load(p)?,
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

fn check(args: CheckArgs) -> Result<i32> {
    let cfg = load_config(&args)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start tokio runtime")?;
    let only: BTreeSet<String> = args.only.iter().cloned().collect();
    let opts = NodeOptions {
        state_dir: args.state_dir.clone(),
    };
    let (results, _) = rt.block_on(stepguard::node::run(&cfg, &opts, &only));
    match args.format {
        OutputFormat::Text => print!("{}", report::text(&results)),
        OutputFormat::Json => {
            println!("{}", serde_json::to_string_pretty(&report::json(&results))?)
        }
    }
    Ok(exit_code(&results))
}

fn init_logging(format: LogFormat) {
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
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
            2
        }
    };
    std::process::exit(code);
}

fn run(cmd: Cmd) -> Result<i32> {
    match cmd {
        Cmd::Agent { listen } => agent(listen),
        Cmd::Check(args) => check(args),
        Cmd::Drops { seconds } => {
            let drops = KernelDrops::start();
            if let Some(reason) = drops.unavailable_reason() {
                println!("kernel drops: unknown ({reason})");
                return Ok(2);
            }
            std::thread::sleep(std::time::Duration::from_secs(seconds));
            println!(
                "kernel drops in {seconds}s via {}:",
                drops.attach_point().unwrap_or("?")
            );
            for (reason, n) in drops.by_reason()? {
                println!("  {reason:<32} {n}");
            }
            Ok(0)
        }
    }
}

fn agent(listen: SocketAddr) -> Result<i32> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("start tokio runtime")?;
    rt.block_on(async move {
        let drops = KernelDrops::start();
        match (drops.attach_point(), drops.unavailable_reason()) {
            (Some(at), _) => tracing::info!(attach = at, "kernel drop accounting active"),
            (_, Some(r)) => tracing::warn!(
                reason = r,
                "kernel drop accounting unavailable: the drops signal is unknown"
            ),
            _ => {}
        }
        let state = Arc::new(AppState {
            ready: false.into(),
            metrics: Mutex::new(Metrics::new()),
            drops: Mutex::new(drops),
        });
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("listen on {listen}"))?;
        tracing::info!(%listen, "serving /metrics /livez /readyz");
        state.ready.store(true, Ordering::SeqCst);
        let s2 = state.clone();
        axum::serve(listener, router(state))
            .with_graceful_shutdown(async move {
                shutdown_signal().await;
                // Readiness goes false first, so load balancers stop sending before we close.
                s2.ready.store(false, Ordering::SeqCst);
                tracing::info!("shutting down");
            })
            .await
            .context("serve HTTP")?;
        Ok(0)
    })
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = term.recv() => {},
        _ = tokio::signal::ctrl_c() => {},
    }
}
