//! The `seccomp` row of `ninelives bench`: the exits workload (the one that
//! leaves the guest most often, so makes the most VMM syscalls per op) in a
//! VM with the seccomp filters on and off, interleaved in one run.

use anyhow::{bail, Result};
use serde::Serialize;

use crate::json_out::loadavg;
use crate::stats::Summary;
use nl_launch::args::{MachineArgs, WorkloadArgs, WorkloadName};
use nl_launch::guest;
use nl_launch::run::run_vms;

/// Pairs measured (on, off, on, off, ...).
pub const REPS: usize = 5;

#[derive(Serialize)]
pub struct SeccompOverhead {
    pub workload: &'static str,
    pub reps: usize,
    /// exits ops/s of each run with the filters on, then off.
    pub on_ops_per_sec: Vec<f64>,
    pub off_ops_per_sec: Vec<f64>,
    /// on/off of each interleaved pair, and their median, min and max.
    pub pair_ratios: Vec<f64>,
    pub ratio_median: f64,
    pub ratio_min: f64,
    pub ratio_max: f64,
    /// /proc/loadavg before and after.
    pub loadavg_before: String,
    pub loadavg_after: String,
}

fn one(m: &MachineArgs, duration: f64, on: bool) -> Result<f64> {
    let w = WorkloadArgs { workload: WorkloadName::Exits, ..WorkloadArgs::default() };
    let params = guest::workload_params(&w, duration)?;
    let config = guest::vm_config(m, params, guest::kernel_image(m)?, None)?;
    // vCPU threads install their filter at start: the switch applies to this run.
    nl_vmm::seccomp::set_enabled(on);
    let r = run_vms(&[config], true);
    let r = r?.remove(0);
    if let Some(e) = &r.error {
        bail!("exits in the guest failed: {e}");
    }
    Ok(r.ops_per_sec)
}

pub fn measure(m: &MachineArgs, duration: f64) -> Result<SeccompOverhead> {
    let before = nl_vmm::seccomp::enabled();
    let loadavg_before = loadavg();
    let (mut on, mut off) = (Vec::new(), Vec::new());
    let r = (|| -> Result<()> {
        for _ in 0..REPS {
            on.push(one(m, duration, true)?);
            off.push(one(m, duration, false)?);
        }
        Ok(())
    })();
    nl_vmm::seccomp::set_enabled(before);
    r?;
    let pair_ratios: Vec<f64> =
        on.iter().zip(&off).map(|(a, b)| if *b > 0.0 { a / b } else { 0.0 }).collect();
    let spread = Summary::of(&pair_ratios);
    Ok(SeccompOverhead {
        workload: "exits",
        reps: REPS,
        on_ops_per_sec: on,
        off_ops_per_sec: off,
        ratio_median: spread.median,
        ratio_min: spread.min,
        ratio_max: spread.max,
        pair_ratios,
        loadavg_before,
        loadavg_after: loadavg(),
    })
}
