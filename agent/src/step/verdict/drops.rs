//! The drops check: kernel and Cilium drops during the step within their budgets.
use super::*;

/// `drops`: drops in the step window within each configured budget.
pub fn check_drops(step: &Step, o: &Observed) -> Judged {
    if !step.params.drops_budget.is_empty() && !o.drops_unknown.is_empty() {
        return Judged::not_yet(
            CheckStatus::Unknown,
            format!(
                "drop budgets are set but the {} drop counters are unknown: they cannot pass",
                o.drops_unknown.join(" and ")
            ),
            Some(Reason::DropsOverBudget),
        );
    }
    let over: Vec<String> = step
        .params
        .drops_budget
        .iter()
        .filter_map(|(reason, budget)| {
            let n = o
                .drops
                .iter()
                .filter(|(k, _)| k.ends_with(&format!(":{reason}")) || *k == reason)
                .map(|(_, v)| *v)
                .sum::<u64>();
            (n > *budget).then(|| format!("{reason} {n} > {budget}"))
        })
        .collect();
    if over.is_empty() {
        Judged::pass(format!(
            "{} drops in the window",
            o.drops.values().sum::<u64>()
        ))
    } else {
        Judged::not_yet(
            CheckStatus::Fail,
            over.join(", "),
            Some(Reason::DropsOverBudget),
        )
    }
}
