//! Which nodes a rollout covers (pure): a node selector (`--node-selector`, as
//! `kubectl get nodes -l` takes one: `k=v`, `k!=v`, `k`, `!k`, comma-separated) and a
//! partition (`--partition N`: N nodes in scope stay on an older revision, as OpenKruise's
//! Advanced DaemonSet keeps them).
use super::{ClusterView, PlanOpts};

/// One term of a node selector.
#[derive(Clone, Debug, PartialEq)]
pub enum LabelTerm {
    Is(String, String),
    IsNot(String, String),
    Has(String),
    HasNot(String),
}

/// A node selector as given on the command line.
#[derive(Clone, Debug, PartialEq)]
pub struct Selector(pub Vec<LabelTerm>);

impl Selector {
    pub fn parse(s: &str) -> Result<Selector, String> {
        parse_selector(s).map(Selector)
    }
}

/// Parses `k=v,k!=v,k,!k` (`k==v` as `k=v`); an empty selector selects every node.
pub fn parse_selector(s: &str) -> Result<Vec<LabelTerm>, String> {
    let mut out = Vec::new();
    for t in s.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let key_ok = |k: &str| {
            !k.is_empty()
                && k.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
        };
        let term = if let Some((k, v)) = t.split_once("!=") {
            LabelTerm::IsNot(k.trim().into(), v.trim().into())
        } else if let Some((k, v)) = t.split_once("==").or_else(|| t.split_once('=')) {
            LabelTerm::Is(k.trim().into(), v.trim().into())
        } else if let Some(k) = t.strip_prefix('!') {
            LabelTerm::HasNot(k.trim().into())
        } else {
            LabelTerm::Has(t.into())
        };
        let (LabelTerm::Is(k, _)
        | LabelTerm::IsNot(k, _)
        | LabelTerm::Has(k)
        | LabelTerm::HasNot(k)) = &term;
        if !key_ok(k) || t.contains(" in ") || t.contains(" notin ") || t.contains('(') {
            return Err(format!(
                "node selector term {t:?}: use KEY=VALUE, KEY!=VALUE, KEY or !KEY, comma-separated"
            ));
        }
        out.push(term);
    }
    Ok(out)
}

/// Whether a node's labels match every term.
pub fn matches(terms: &[LabelTerm], labels: &std::collections::BTreeMap<String, String>) -> bool {
    terms.iter().all(|t| match t {
        LabelTerm::Is(k, v) => labels.get(k) == Some(v),
        LabelTerm::IsNot(k, v) => labels.get(k) != Some(v),
        LabelTerm::Has(k) => labels.contains_key(k),
        LabelTerm::HasNot(k) => !labels.contains_key(k),
    })
}

/// Whether a node is in the rollout's scope (a node not read is in scope only when no
/// selector is given).
pub fn in_scope(v: &ClusterView, o: &PlanOpts, node: &str) -> bool {
    if o.node_selector.is_empty() {
        return true;
    }
    v.nodes
        .iter()
        .find(|n| n.name == node)
        .is_some_and(|n| matches(&o.node_selector, &n.labels))
}

/// How many nodes the rollout covers: the cilium pods on nodes in scope (what a percentage
/// of `--max-unavailable` is of).
pub fn size(v: &ClusterView, o: &PlanOpts) -> usize {
    v.pods.iter().filter(|p| in_scope(v, o, &p.node)).count()
}

/// How many nodes in scope may still go on to revision `rev`: those on another revision
/// less the partition (the ones `--skip` left count among the partition's).
pub fn movable(v: &ClusterView, o: &PlanOpts, rev: &str) -> usize {
    let old = v
        .pods
        .iter()
        .filter(|p| p.revision != rev && in_scope(v, o, &p.node))
        .count();
    old.saturating_sub(o.partition)
}
