//! A step's parameters: the request as posted, checked into `StepParams` (every field optional,
//! unknown ones refused, each problem naming its field).
use super::*;

/// `POST /v1/steps` body. Every field optional; unknown fields are rejected.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepRequest {
    pub id: Option<String>,
    pub timeout: Option<String>,
    pub settle: Option<String>,
    pub max_gap: Option<String>,
    /// Budget for a target's loss outside its longest outage (failed / sent), 0 to 1.
    pub max_loss: Option<f64>,
    /// Budget for a target's outages added up (default: twice `max_gap`).
    pub max_total_gap: Option<String>,
    pub burst_interval: Option<String>,
    pub dns_slower_ratio: Option<f64>,
    /// Budget per drop reason for the step window, e.g. {"TC_INGRESS": 1000, "202_host_datapath_not_ready": 500}.
    pub drops_budget: Option<BTreeMap<String, u64>>,
    /// What the node should look like after the restart, when a rollout changes it on purpose.
    pub expect: Option<ExpectRequest>,
    /// Witnesses (`http://HOST:PORT` of `stepguard witness` on the LAN) that burst-probe the
    /// VIPs as LAN clients during the step; their gaps are part of the verdict.
    pub witnesses: Option<Vec<String>>,
}

/// `expect` of a step request: the device set and/or Cilium version after the restart.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpectRequest {
    /// Host devices that must carry the datapath after the restart (exact names).
    pub devices: Option<Vec<String>>,
    /// The Cilium version that must come back (an upgrade step), e.g. "1.18".
    pub cilium: Option<String>,
    /// Hooks the restart removes on purpose (a config step: tunnel → native, XDP off,
    /// `cil_to_netdev` no longer required): reload keys (`cilium_vxlan`,
    /// `cilium_vxlan:to_overlay`, `eth0:xdp`, `eth0:to_netdev`) or a device name for all of
    /// its keys. They must be gone after the restart.
    pub gone: Option<Vec<String>>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct StepParams {
    #[serde(with = "secs")]
    pub timeout: Duration,
    #[serde(with = "secs")]
    pub settle: Duration,
    #[serde(with = "secs")]
    pub max_gap: Duration,
    /// Loss budget (failed / sent outside the longest outage), see [`DEFAULT_MAX_LOSS`].
    #[serde(default = "default_max_loss")]
    pub max_loss: f64,
    /// Total outage budget, seconds (None in steps persisted before it existed: not judged).
    #[serde(default)]
    pub max_total_gap: Option<f64>,
    #[serde(with = "secs")]
    pub burst_interval: Duration,
    pub dns_slower_ratio: f64,
    pub drops_budget: BTreeMap<String, u64>,
    /// Declared device set after the restart (None: as before).
    #[serde(default)]
    pub expect_devices: Option<Vec<String>>,
    /// Declared Cilium version after the restart (None: whatever comes back, inferred).
    #[serde(default)]
    pub expect_cilium: Option<String>,
    /// Reload keys (or devices) declared gone after the restart (see [`ExpectRequest::gone`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub expect_gone: Vec<String>,
    /// Witness URLs (see [`StepRequest::witnesses`]).
    #[serde(default)]
    pub witnesses: Vec<String>,
}

/// A target may lose this share of its probes outside its longest outage (which `max_gap`
/// judges): 5 % — a node that drops probes at random (a lossy datapath) fails, a clean outage
/// does not count twice, and an outage split in two by one answer at its edge stays within.
pub const DEFAULT_MAX_LOSS: f64 = 0.05;

/// Lost probes outside the longest outage below this count never fail a step (one stray
/// timeout on a busy node is not a lossy datapath).
pub const LOSS_MIN_FAILURES: u64 = 3;

pub(super) fn default_max_loss() -> f64 {
    DEFAULT_MAX_LOSS
}

/// Validates a loss budget (a share of probes).
pub fn check_loss(field: &'static str, v: f64) -> Result<f64, RequestError> {
    if v.is_finite() && (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(RequestError::new(
            field,
            format!("{v} is not a share of probes between 0 and 1 (e.g. 0.02 for 2 %)"),
        ))
    }
}

/// A step request that cannot be taken (400), naming the field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct RequestError {
    pub field: &'static str,
    pub problem: String,
}

impl RequestError {
    pub fn new(field: &'static str, problem: impl ToString) -> Self {
        RequestError {
            field,
            problem: problem.to_string(),
        }
    }
}

impl StepParams {
    /// The first parameter in which `other` differs (a re-POST of the active id must ask for
    /// the same step).
    pub fn differing_field(&self, other: &StepParams) -> Option<&'static str> {
        [
            ("timeout", self.timeout != other.timeout),
            ("settle", self.settle != other.settle),
            ("max_gap", self.max_gap != other.max_gap),
            ("max_loss", self.max_loss != other.max_loss),
            ("max_total_gap", self.max_total_gap != other.max_total_gap),
            (
                "burst_interval",
                self.burst_interval != other.burst_interval,
            ),
            (
                "dns_slower_ratio",
                self.dns_slower_ratio != other.dns_slower_ratio,
            ),
            ("drops_budget", self.drops_budget != other.drops_budget),
            (
                "expect",
                self.expect_devices != other.expect_devices
                    || self.expect_cilium != other.expect_cilium
                    || self.expect_gone != other.expect_gone,
            ),
            ("witnesses", self.witnesses != other.witnesses),
        ]
        .into_iter()
        .find(|(_, d)| *d)
        .map(|(f, _)| f)
    }

    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

    /// Validates a request; errors name the field, on one line.
    /// `target_budgets`: the targets' own `max_gap`s, which the cadence must resolve too.
    pub fn from_request(
        r: &StepRequest,
        default_burst: Duration,
        target_budgets: &[Duration],
    ) -> Result<(Option<String>, StepParams), RequestError> {
        let dur = |field: &'static str,
                   v: &Option<String>,
                   default: Duration,
                   min: Duration,
                   max: Duration|
         -> Result<Duration, RequestError> {
            let d = match v {
                None => default,
                Some(s) => duration::parse(s).map_err(|e| RequestError::new(field, e))?,
            };
            duration::within(d, min, max).map_err(|e| RequestError::new(field, e))
        };
        let timeout = dur(
            "timeout",
            &r.timeout,
            Self::DEFAULT_TIMEOUT,
            Duration::from_secs(1),
            Duration::from_secs(6 * 3600),
        )?;
        // Settle is how long everything must stay green: a window shorter than one decision
        // (every 100 ms) would pass on a single look.
        let settle = dur(
            "settle",
            &r.settle,
            Duration::from_secs(10),
            Duration::from_millis(100),
            Duration::from_secs(3600),
        )?;
        if settle >= timeout {
            return Err(RequestError::new(
                "settle",
                format!(
                    "{} must be shorter than timeout {}",
                    duration::human(settle),
                    duration::human(timeout)
                ),
            ));
        }
        let max_gap = dur(
            "max_gap",
            &r.max_gap,
            Duration::from_secs(5),
            Duration::from_millis(1),
            Duration::from_secs(3600),
        )?;
        let max_loss = check_loss("max_loss", r.max_loss.unwrap_or(DEFAULT_MAX_LOSS))?;
        let max_total_gap = dur(
            "max_total_gap",
            &r.max_total_gap,
            max_gap * 2,
            Duration::from_millis(1),
            Duration::from_secs(6 * 3600),
        )?;
        let burst_interval = dur(
            "burst_interval",
            &r.burst_interval,
            default_burst,
            Duration::from_millis(1),
            Duration::from_secs(10),
        )?;
        let dns_slower_ratio = r.dns_slower_ratio.unwrap_or(2.0);
        if !(1.0..=100.0).contains(&dns_slower_ratio) {
            return Err(RequestError::new(
                "dns_slower_ratio",
                "must be between 1 and 100",
            ));
        }
        // The cadence must resolve the budget: a gap is known only to within a probe
        // interval, so a cadence coarser than half the budget cannot tell a gap within the
        // budget from one over it (10 s probes against a 1 s budget would "pass" a 3 s outage).
        let smallest = target_budgets
            .iter()
            .copied()
            .fold(max_gap, |a: Duration, b| a.min(b));
        if burst_interval * 2 > smallest {
            return Err(RequestError::new(
                "burst_interval",
                format!(
                    "{} cannot resolve a gap budget of {} (at most half the smallest budget: max_gap or a target's max_gap)",
                    duration::human(burst_interval),
                    duration::human(smallest)
                ),
            ));
        }
        let expect = r.expect.clone().unwrap_or_default();
        let expect_devices = match expect.devices {
            Some(d) if d.is_empty() => {
                return Err(RequestError::new(
                    "expect.devices",
                    "an empty device set would expect no datapath at all",
                ))
            }
            Some(d)
                if d.iter()
                    .any(|x| x.is_empty() || x.len() > 15 || x.contains('/')) =>
            {
                return Err(RequestError::new(
                    "expect.devices",
                    "device names are 1-15 characters without '/'",
                ))
            }
            Some(mut d) => {
                d.sort();
                d.dedup();
                Some(d)
            }
            None => None,
        };
        let expect_cilium = match expect.cilium {
            Some(v) if crate::cilium::profile::CiliumVersion::parse(&v).is_none() => {
                return Err(RequestError::new(
                    "expect.cilium",
                    format!("{v:?} is not 1.16, 1.17, 1.18, 1.19 or 1.20"),
                ))
            }
            v => v,
        };
        let mut expect_gone = expect.gone.clone().unwrap_or_default();
        if let Some(bad) = expect_gone.iter().find(|k| {
            k.is_empty()
                || k.len() > 40
                || !k
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_-.:".contains(&b))
        }) {
            return Err(RequestError::new(
                "expect.gone",
                format!("{bad:?} is no reload key or device (e.g. cilium_vxlan, eth0:xdp)"),
            ));
        }
        expect_gone.sort();
        expect_gone.dedup();
        let mut witnesses = r.witnesses.clone().unwrap_or_default();
        if witnesses.len() > MAX_WITNESSES {
            return Err(RequestError::new(
                "witnesses",
                format!("at most {MAX_WITNESSES} witnesses per step"),
            ));
        }
        // One spelling per witness (`http://host:port`): its metric series and its track.
        for w in witnesses.iter_mut() {
            match crate::wire::AgentUrl::parse(w) {
                Ok(a) => *w = a.canonical(),
                Err(e) => return Err(RequestError::new("witnesses", format!("{e:#}"))),
            }
        }
        witnesses.sort();
        witnesses.dedup();
        if let Some(id) = &r.id {
            if !super::admission::valid_id(id) {
                return Err(RequestError::new(
                    "id",
                    format!("{id:?} must be {}", super::admission::ID_RULE),
                ));
            }
        }
        Ok((
            r.id.clone(),
            StepParams {
                timeout,
                settle,
                max_gap,
                max_loss,
                max_total_gap: Some(max_total_gap.as_secs_f64()),
                burst_interval,
                dns_slower_ratio,
                drops_budget: r.drops_budget.clone().unwrap_or_default(),
                expect_devices: expect_devices.clone(),
                expect_cilium: expect_cilium.clone(),
                expect_gone,
                witnesses,
            },
        ))
    }
}

impl Budgets {
    pub fn of(p: &StepParams) -> Budgets {
        Budgets {
            max_gap: p.max_gap,
            max_loss: Some(p.max_loss),
            max_total_gap: p
                .max_total_gap
                .and_then(|s| Duration::try_from_secs_f64(s).ok()),
        }
    }
}
