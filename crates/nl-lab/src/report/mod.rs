//! `ninelives report`: runs every bench and campaign (or reads their JSON
//! from an earlier run) and writes `report/index.html`, one SVG per figure
//! and the JSON behind each, with the papers' numbers beside ours.
//!
//! - [`steps`]: what is measured, as child processes of this binary with
//!   `--json` (`--quick` and `--full` sizes), each result kept as
//!   `data/<step>.json`;
//! - [`papers`]: the papers' quoted numbers, each with its table or figure;
//! - [`sections`]: per paper, our rows beside the paper's and the figures;
//! - [`html`]: the page, and the ahead/behind classification of a row;
//! - [`bars`]: bar charts (categories with intervals, stacked outcomes).

pub mod bars;
pub mod html;
pub mod papers;
pub mod sections;
pub mod steps;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;
use serde_json::Value;

use crate::json_out::{loadavg, GIT_REVISION};

/// `ninelives report` arguments.
#[derive(Args, Clone, Debug)]
pub struct ReportArgs {
    /// Small campaigns and short runs (under 20 minutes on 2 cores; wide
    /// intervals, shown as such). The default.
    #[arg(long, conflicts_with = "full")]
    pub quick: bool,
    /// Larger campaigns and longer runs, for an idle machine (hours).
    #[arg(long)]
    pub full: bool,
    /// Measure nothing: read the results of an earlier run from DIR
    /// (`DIR/data/<step>.json` or `DIR/<step>.json`, e.g. a previous
    /// report directory). A step without a file is shown as not measured.
    #[arg(long)]
    pub from: Option<PathBuf>,
    /// Directory to write index.html, the figures and their JSON into.
    #[arg(long, default_value = "report")]
    pub out: PathBuf,
    /// Only these steps (comma-separated names; default: all; an unknown
    /// name is refused with the list of steps).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
}

/// The campaign size a report runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Size {
    Quick,
    Full,
}

/// The machine a report's numbers were measured on.
#[derive(Clone, Debug, Serialize, serde::Deserialize, Default)]
pub struct Machine {
    pub cpu: String,
    pub cores: usize,
    pub mem_gib: f64,
    pub kernel: String,
    /// `PVM`, `VMX`, `SVM` or `none` (which KVM module is loaded).
    pub kvm_backend: String,
    pub loadavg_before: String,
    pub loadavg_after: String,
    pub git_revision: String,
    /// RFC 3339, UTC.
    pub date: String,
    /// quick or full.
    pub size: String,
    /// Wall time of the measurements (seconds).
    pub elapsed_s: f64,
    /// Per step: wall time (s) and its exit status.
    pub steps: BTreeMap<String, StepRun>,
}

/// How one step ran.
#[derive(Clone, Debug, Serialize, serde::Deserialize, Default)]
pub struct StepRun {
    pub command: String,
    pub elapsed_s: f64,
    pub exit_ok: bool,
    pub loadavg_before: String,
    pub loadavg_after: String,
}

/// `PVM` / `VMX` / `SVM` from the loaded KVM module, `none` without one.
pub fn kvm_backend() -> String {
    let loaded = |m: &str| Path::new("/sys/module").join(m).exists();
    if loaded("kvm_pvm") {
        "PVM".into()
    } else if loaded("kvm_intel") {
        "VMX".into()
    } else if loaded("kvm_amd") {
        "SVM".into()
    } else {
        "none".into()
    }
}

impl Machine {
    /// This machine, now.
    pub fn here(size: Size) -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name")?.split_once(':').map(|x| x.1.trim()))
            .unwrap_or("unknown")
            .to_string();
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let mem_kib: f64 = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:")?.split_whitespace().next()?.parse().ok())
            .unwrap_or(0.0);
        Machine {
            cpu,
            cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
            mem_gib: mem_kib / (1024.0 * 1024.0),
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .unwrap_or_default()
                .trim()
                .to_string(),
            kvm_backend: kvm_backend(),
            loadavg_before: loadavg(),
            loadavg_after: String::new(),
            git_revision: GIT_REVISION.to_string(),
            date: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
            size: match size {
                Size::Quick => "quick".into(),
                Size::Full => "full".into(),
            },
            elapsed_s: 0.0,
            steps: BTreeMap::new(),
        }
    }
}

/// Every step's result by step name (a step that did not run or failed
/// is absent).
pub type Data = BTreeMap<String, Value>;

/// Reads `dir/data/<step>.json` or `dir/<step>.json` for every step, and
/// `machine.json` if there is one.
pub fn read_results(dir: &Path) -> Result<(Data, Option<Machine>)> {
    if !dir.is_dir() {
        bail!("--from {}: not a directory", dir.display());
    }
    let mut data = Data::new();
    for s in steps::STEPS {
        for p in [
            dir.join("data").join(format!("{}.json", s.name)),
            dir.join(format!("{}.json", s.name)),
        ] {
            if p.is_file() {
                let text = nl_memory::file::read_limited(&p, "step result", 64 << 20)
                    .with_context(|| format!("cannot read {}", p.display()))?;
                let v: Value = serde_json::from_slice(&text)
                    .with_context(|| format!("{}: not JSON", p.display()))?;
                data.insert(s.name.to_string(), v);
                break;
            }
        }
    }
    let mut machine = None;
    for p in [dir.join("data").join("machine.json"), dir.join("machine.json")] {
        if p.is_file() {
            let text = nl_memory::file::read_limited(&p, "machine record", 1 << 20)?;
            machine = Some(
                serde_json::from_slice(&text)
                    .with_context(|| format!("{}: not a machine record", p.display()))?,
            );
            break;
        }
    }
    Ok((data, machine))
}

/// `ninelives report`.
pub fn report(a: ReportArgs) -> Result<ExitCode> {
    let size = if a.full { Size::Full } else { Size::Quick };
    for name in &a.only {
        if !steps::STEPS.iter().any(|s| s.name == name) {
            let names: Vec<&str> = steps::STEPS.iter().map(|s| s.name).collect();
            bail!("--only: no step named {name:?} (steps: {})", names.join(", "));
        }
    }
    let data_dir = a.out.join("data");
    std::fs::create_dir_all(&data_dir)
        .with_context(|| format!("cannot create {}", data_dir.display()))?;
    let (data, machine, measured_here) = match &a.from {
        Some(dir) => {
            let (data, machine) = read_results(dir)?;
            eprintln!("report: read {} step result(s) from {}", data.len(), dir.display());
            (data, machine, false)
        }
        None => {
            let (data, machine) = steps::run_all(size, &a.only, &data_dir)?;
            (data, Some(machine), true)
        }
    };
    // The JSON behind the page: every step's result and the machine.
    for (name, v) in &data {
        let p = data_dir.join(format!("{name}.json"));
        if a.from.as_deref().map(|d| d.join("data")) != Some(data_dir.clone()) {
            std::fs::write(&p, serde_json::to_string_pretty(v)?)
                .with_context(|| format!("cannot write {}", p.display()))?;
        }
    }
    let machine = machine.unwrap_or_else(|| {
        let mut m = Machine::here(size);
        m.size = "unknown (results read with --from, no machine.json)".into();
        m
    });
    std::fs::write(data_dir.join("machine.json"), serde_json::to_string_pretty(&machine)?)?;
    let secs = sections::build(&data, &a.out)?;
    let page = html::page(&machine, &secs, measured_here);
    let index = a.out.join("index.html");
    std::fs::write(&index, page).with_context(|| format!("cannot write {}", index.display()))?;
    eprintln!("report: wrote {}", index.display());
    Ok(ExitCode::SUCCESS)
}
