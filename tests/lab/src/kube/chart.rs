//! Cilium's own Helm chart, rendered by real Helm: the DaemonSet, `cilium-config`, the operator
//! Deployment, RBAC and the rest of what a user's `helm template`/`helm upgrade` of Cilium puts
//! in a cluster, with the values a user of an OnDelete rollout sets
//! (`updateStrategy.type=OnDelete`, `rollOutCiliumPods=true`). Helm is built from
//! `helm.sh/helm/v4` and the chart is `install/kubernetes/cilium` of the Cilium module
//! (`cargo xtask helm`; `cargo xtask test` gives both to the tests as [`HELM_ENV`] and
//! [`CHART_ENV`]).
use super::ControlPlane;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The environment variable that names the `helm` binary.
pub const HELM_ENV: &str = "STEPGUARD_HELM";
/// The environment variable that names Cilium's chart directory.
pub const CHART_ENV: &str = "STEPGUARD_CILIUM_CHART";

/// The values every render sets: the DaemonSet is stepped by hand (OnDelete) and a change of
/// `cilium-config` changes the pod template's checksum annotation, so it is a new revision.
pub const ONDELETE: [&str; 2] = ["updateStrategy.type=OnDelete", "rollOutCiliumPods=true"];

/// Real Helm and Cilium's chart.
#[derive(Clone, Debug)]
pub struct CiliumChart {
    pub helm: PathBuf,
    pub chart: PathBuf,
}

impl CiliumChart {
    /// From [`HELM_ENV`] and [`CHART_ENV`].
    pub fn from_env() -> Result<CiliumChart> {
        let var = |name: &str, what: &str| {
            std::env::var_os(name).map(PathBuf::from).with_context(|| {
                format!("{name} is unset: {what} (`cargo xtask test` builds and sets it)")
            })
        };
        let c = CiliumChart {
            helm: var(HELM_ENV, "Helm, built from helm.sh/helm/v4")?,
            chart: var(CHART_ENV, "Cilium's chart, from the Cilium module")?,
        };
        if !c.chart.join("Chart.yaml").is_file() {
            bail!(
                "{} has no Chart.yaml: not Cilium's chart",
                c.chart.display()
            );
        }
        Ok(c)
    }

    /// `helm template cilium` into kube-system with [`ONDELETE`], `values` (`--set`) and
    /// `strings` (`--set-string`); the rendered YAML.
    pub fn render(&self, values: &[&str], strings: &[&str]) -> Result<String> {
        let mut args: Vec<&str> = vec!["template", "cilium"];
        args.push(self.chart.to_str().context("chart path is not UTF-8")?);
        args.extend(["--namespace", "kube-system"]);
        for v in ONDELETE.iter().chain(values) {
            args.extend(["--set", v]);
        }
        for s in strings {
            args.extend(["--set-string", s]);
        }
        let o = Command::new(&self.helm)
            .args(&args)
            .output()
            .with_context(|| format!("run {}", self.helm.display()))?;
        if !o.status.success() {
            bail!(
                "helm {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&o.stderr).trim()
            );
        }
        String::from_utf8(o.stdout).context("helm template wrote non-UTF-8")
    }

    /// Renders as [`CiliumChart::render`] into `file` and applies it server-side (field manager
    /// `helm`, as a GitOps controller or `helm template | kubectl apply` would).
    pub fn apply(
        &self,
        cp: &ControlPlane,
        file: &Path,
        values: &[&str],
        strings: &[&str],
    ) -> Result<()> {
        let yaml = self.render(values, strings)?;
        apply_rendered(cp, file, &yaml)
    }
}

/// Writes a render to `file` and applies it server-side.
pub fn apply_rendered(cp: &ControlPlane, file: &Path, yaml: &str) -> Result<()> {
    std::fs::write(file, yaml).with_context(|| format!("write {}", file.display()))?;
    cp.kubectl(&[
        "apply",
        "--server-side",
        "--field-manager",
        "helm",
        "-f",
        file.to_str().context("path is not UTF-8")?,
    ])
    .with_context(|| format!("apply {}", file.display()))?;
    Ok(())
}

/// The pod template's `cilium.io/cilium-configmap-checksum` in a render (the sha256 of the
/// rendered `cilium-config`, which `rollOutCiliumPods` puts there): what a Git approval names as
/// `stepguard.io/approve-config-checksum`.
pub fn checksum(yaml: &str) -> Option<String> {
    yaml.lines().find_map(|l| {
        let v = l
            .trim()
            .strip_prefix("cilium.io/cilium-configmap-checksum:")?;
        Some(v.trim().trim_matches('"').to_string())
    })
}
