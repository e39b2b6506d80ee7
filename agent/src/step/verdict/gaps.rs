//! The gaps check: every target's longest outage, total outage and loss within its budgets.
use super::*;

pub(super) fn gap_rows(step: &Step, now: f64) -> Vec<TargetGap> {
    step.targets
        .iter()
        .map(|(name, t)| gap_row(name, t, step.params.burst_interval.as_secs_f64(), now))
        .collect()
}

/// `gaps`: the longest outage can only grow, so one over its budget is final at once; an
/// outage still open keeps the step from settling.
/// The budgets a target's gaps are held to.
#[derive(Clone, Copy, Debug)]
pub struct Budget {
    pub longest_s: f64,
    pub loss: Option<f64>,
    pub total_s: Option<f64>,
}

/// Which budget a target's gaps exceed, named: the longest outage (`gap_over_budget`), all
/// outages added up (`gap_over_budget`, "total"), or the loss outside the longest outage
/// (`loss_over_budget`, from [`super::super::LOSS_MIN_FAILURES`] lost probes up).
pub fn over_budget(g: &TargetGap, b: Budget) -> Option<(Reason, String)> {
    if g.longest_s > b.longest_s {
        return Some((
            Reason::GapOverBudget,
            format!(
                "{}{} longest outage {:.0}ms > max_gap {:.0}ms",
                g.target,
                if g.east_west {
                    " (east-west: another node through the overlay)"
                } else {
                    ""
                },
                g.longest_s * 1e3,
                b.longest_s * 1e3
            ),
        ));
    }
    if let Some(total) = b.total_s.filter(|t| g.total_s > *t) {
        return Some((
            Reason::GapOverBudget,
            format!(
                "{} outages add up to {:.0}ms over {} outages > max_total_gap {:.0}ms",
                g.target,
                g.total_s * 1e3,
                g.count,
                total * 1e3
            ),
        ));
    }
    if let Some(l) = b
        .loss
        .filter(|l| g.loss > *l && g.lost_outside_longest >= super::super::LOSS_MIN_FAILURES)
    {
        return Some((
            Reason::LossOverBudget,
            format!(
                "{} lost {:.1} % of its probes outside its longest outage ({} lost) > max_loss {:.1} %",
                g.target,
                g.loss * 100.0,
                g.lost_outside_longest,
                l * 100.0
            ),
        ));
    }
    None
}

pub fn check_gaps(step: &Step) -> Judged {
    let over: Vec<(Reason, String)> = step
        .gaps
        .iter()
        .filter_map(|g| {
            over_budget(
                g,
                Budget {
                    longest_s: g.budget_s,
                    loss: g.loss_budget,
                    total_s: g.total_budget_s,
                },
            )
        })
        .collect();
    if let Some((code, _)) = over.first() {
        return Judged::fatal(
            *code,
            format!(
                "over budget: {}",
                over.iter()
                    .map(|(_, w)| w.as_str())
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
        );
    }
    let open: Vec<&str> = step
        .gaps
        .iter()
        .filter(|g| g.open)
        .map(|g| g.target.as_str())
        .collect();
    if open.is_empty() {
        Judged::pass("every outage within its budget")
    } else {
        Judged::not_yet(
            CheckStatus::Fail,
            format!("still failing: {}", open.join(", ")),
            None,
        )
    }
}
