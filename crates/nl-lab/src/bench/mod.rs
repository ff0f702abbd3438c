//! `ninelives bench`: each workload in a VM against the same code natively,
//! measured in the same invocation and reported as ratios.

pub mod checkpoint;
pub mod hostile;
pub mod net;
pub mod recovery;
pub mod rejuvenate;
pub mod rejuvenate_cache;
pub mod rejuvenate_ping;
pub mod rejuvenate_sandbox;
pub mod replicate;
pub mod sandbox;
pub mod sandbox_recovery;
pub mod sandbox_service_timeline;
pub mod sandbox_shared;
pub mod seccomp;
pub mod unit_costs;

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Result};
use serde::Serialize;

use crate::args::{BenchArgs, BenchMechanism};
use crate::json_out::{with_provenance, RunClock};
use crate::stats::{ratio_interval, Summary};
use nl_launch::args::{MachineArgs, PatternName, WorkloadArgs, WorkloadName};
use nl_launch::guest;
use nl_launch::run::run_vms;

/// One cell: `reps` native runs interleaved with as many guest runs.
#[derive(Serialize)]
struct Entry {
    workload: &'static str,
    /// What an op is (blkbench: a byte moved to or from the disk; filecache:
    /// a byte served).
    #[serde(skip_serializing_if = "Option::is_none")]
    unit: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pattern: Option<&'static str>,
    /// Medians.
    guest_ops_per_sec: f64,
    native_ops_per_sec: f64,
    /// median(guest) / median(native), with its 95% bootstrap interval.
    ratio: f64,
    ratio_ci95: [f64; 2],
    /// Every sample, in the order measured (native i ran just before guest i).
    guest: Summary,
    native: Summary,
    digest_ok: bool,
}

#[derive(Serialize)]
struct BootStats {
    runs: usize,
    median_ms: f64,
    min_ms: f64,
    max_ms: f64,
    samples_ms: Vec<f64>,
}

/// `reps` interleaved pairs (native, then guest) of one cell.
fn measure(
    w: &WorkloadArgs,
    pattern: Option<&'static str>,
    duration: f64,
    m: &MachineArgs,
    reps: u32,
) -> Result<Entry> {
    let (mut guest, mut native, mut digest_ok) = (Vec::new(), Vec::new(), true);
    let mut unit = None;
    for _ in 0..reps {
        let (g, n, ok, u) = measure_pair(w, duration, m)?;
        guest.push(g);
        native.push(n);
        digest_ok &= ok;
        unit = u;
    }
    let r = ratio_interval(&guest, &native);
    let (guest, native) = (Summary::of(&guest), Summary::of(&native));
    Ok(Entry {
        workload: w.workload.name(),
        unit,
        pattern,
        guest_ops_per_sec: guest.median,
        native_ops_per_sec: native.median,
        ratio: r.ratio,
        ratio_ci95: [r.lo, r.hi],
        guest,
        native,
        digest_ok,
    })
}

/// One native run and then one guest run: (guest ops/s, native ops/s,
/// digest ok, unit).
fn measure_pair(
    w: &WorkloadArgs,
    duration: f64,
    m: &MachineArgs,
) -> Result<(f64, f64, bool, Option<&'static str>)> {
    let params = guest::workload_params(w, duration)?;
    let d = Duration::from_secs_f64(duration);
    let mut m = m.clone();
    let mut _guest_disk = None;
    let native = if let Some(size) = guest::disk_needed(&params) {
        // Baseline: the same block requests as pread/pwrite on a host image
        // file like the guest's; the guest gets its own image.
        let size = size.max(guest::DEFAULT_DISK_BYTES);
        let host_disk = guest::TempDisk::with_size("bench-host", size)?;
        let file = std::fs::OpenOptions::new().read(true).write(true).open(&host_disk.0)?;
        let plat = nl_workloads::native::FileDiskPlatform::new(file);
        let r = nl_workloads::native::run_for_on(&params, 0, d, plat);
        let t = guest::TempDisk::with_size("bench-guest", size)?;
        m.disk = Some(t.0.clone());
        _guest_disk = Some(t);
        r
    } else {
        nl_workloads::native::run_for(&params, 0, d, m.timer_hz)
    }
    .map_err(anyhow::Error::msg)?;
    let config = guest::vm_config(&m, params, guest::kernel_image(&m)?, None)?;
    let r = run_vms(&[config], true)?.remove(0);
    if let Some(e) = &r.error {
        bail!("{} in the guest failed: {e}", w.workload.name());
    }
    let unit = guest::disk_needed(&params).map(|_| "bytes");
    Ok((r.ops_per_sec, native.ops_per_sec(), r.digest_ok, unit))
}

fn boot_times(n: u32, m: &MachineArgs) -> Result<BootStats> {
    let w = WorkloadArgs { workload: WorkloadName::Idle, ..WorkloadArgs::default() };
    let params = guest::workload_params(&w, 0.05)?;
    let mut v = Vec::new();
    for _ in 0..n.max(1) {
        let config = guest::vm_config(m, params, guest::kernel_image(m)?, None)?;
        let r = run_vms(&[config], true)?.remove(0);
        if let Some(b) = r.boot_ms {
            v.push(b);
        }
    }
    if v.is_empty() {
        bail!("no boot reached the workload");
    }
    let s = Summary::of(&v);
    Ok(BootStats { runs: s.n, median_ms: s.median, min_ms: s.min, max_ms: s.max, samples_ms: v })
}

pub fn bench(a: BenchArgs) -> Result<ExitCode> {
    match a.mechanism {
        Some(BenchMechanism::Checkpoint(c)) => return crate::bench::checkpoint::bench(c),
        Some(BenchMechanism::Rejuvenate(r)) => return crate::bench::rejuvenate::bench(r),
        Some(BenchMechanism::Replicate(c)) => return crate::bench::replicate::bench(c),
        Some(BenchMechanism::Recovery(c)) => return crate::bench::recovery::bench_recovery(c),
        Some(BenchMechanism::Hostile(c)) => return crate::bench::hostile::bench(c),
        Some(BenchMechanism::Sandbox(c)) => return crate::bench::sandbox::bench(c),
        Some(BenchMechanism::SandboxRecovery(c)) => {
            return crate::bench::sandbox_recovery::bench(c)
        }
        None => {}
    }
    if !(a.duration.is_finite() && a.duration > 0.0) {
        bail!("--duration must be a positive number of seconds");
    }
    let clock = RunClock::start();
    let m = MachineArgs::default();
    let wanted =
        if a.workloads.is_empty() { WorkloadName::ALL.to_vec() } else { a.workloads.clone() };
    let mut results: Vec<serde_json::Value> = Vec::new();
    let mut skipped = Vec::new();
    for w in wanted {
        if w == WorkloadName::Kv {
            let why = "measured with `ninelives kvload` against a kv guest, not by bench";
            skipped.push(serde_json::json!({ "workload": "kv", "reason": why }));
            println!("kv        skipped: {why}");
            continue;
        }
        if w == WorkloadName::Netbench {
            match crate::bench::net::measure(a.duration)? {
                Ok(e) => {
                    if !a.json {
                        println!(
                            "netbench  1 ms ping rtt  guest median {:.3} ms p99 {:.3} ms gap {:.1} ms  (rx-irq: median {:.3} ms p99 {:.3} ms gap {:.1} ms)  host baseline median {:.3} ms p99 {:.3} ms  ratio {:.2}",
                            e.guest.median_ms,
                            e.guest.p99_ms,
                            e.guest.longest_gap_ms,
                            e.guest_rx_irq.median_ms,
                            e.guest_rx_irq.p99_ms,
                            e.guest_rx_irq.longest_gap_ms,
                            e.host_baseline.median_ms,
                            e.host_baseline.p99_ms,
                            e.ratio
                        );
                    }
                    results.push(serde_json::to_value(e)?);
                }
                Err(why) => {
                    println!("netbench  skipped: {why}");
                    skipped.push(serde_json::json!({ "workload": "netbench", "reason": why }));
                }
            }
            continue;
        }
        let cases: Vec<(WorkloadArgs, Option<&'static str>)> = match w {
            WorkloadName::Memwrite => vec![
                (
                    WorkloadArgs { pattern: PatternName::Sequential, ..WorkloadArgs::default() },
                    Some("sequential"),
                ),
                (
                    WorkloadArgs { pattern: PatternName::Random, ..WorkloadArgs::default() },
                    Some("random"),
                ),
            ],
            other => vec![(WorkloadArgs { workload: other, ..WorkloadArgs::default() }, None)],
        };
        for (args, pattern) in cases {
            let e = measure(&args, pattern, a.duration, &m, a.reps)?;
            if !a.json {
                println!(
                    "{:<9} {:<11} guest {:>10.3e} [{:.3e}–{:.3e}] ops/s  native {:>10.3e} [{:.3e}–{:.3e}] ops/s  ratio {:.3} [{:.3}, {:.3}] (n={})",
                    e.workload,
                    e.pattern.unwrap_or(""),
                    e.guest.median,
                    e.guest.min,
                    e.guest.max,
                    e.native.median,
                    e.native.min,
                    e.native.max,
                    e.ratio,
                    e.ratio_ci95[0],
                    e.ratio_ci95[1],
                    e.guest.n
                );
            }
            results.push(serde_json::to_value(e)?);
        }
    }
    if a.workloads.is_empty() || a.workloads.contains(&WorkloadName::Exits) {
        let s = crate::bench::seccomp::measure(&m, a.duration)?;
        if !a.json {
            println!(
                "seccomp   exits       filters on/off ops/s ratio median {:.3} (min {:.3}, max {:.3}, {} interleaved pairs)  loadavg {}",
                s.ratio_median, s.ratio_min, s.ratio_max, s.reps, s.loadavg_before
            );
        }
        results.push(serde_json::json!({ "workload": "seccomp", "seccomp": s }));
    }
    let boot = boot_times(a.boots, &m)?;
    let p = clock.finish();
    if !a.json {
        println!(
            "boot to first workload instruction: median {:.2} ms (min {:.2}, max {:.2}, {} boots)",
            boot.median_ms, boot.min_ms, boot.max_ms, boot.runs
        );
        println!(
            "medians [min–max] of {} interleaved native/guest pairs; ratio [95% bootstrap interval]; loadavg {} → {}; revision {}",
            a.reps, p.loadavg_before, p.loadavg_after, p.git_revision
        );
    } else {
        let v = serde_json::json!({ "reps": a.reps, "results": results, "skipped": skipped, "boot": boot });
        println!("{}", with_provenance(v, &p));
    }
    Ok(ExitCode::SUCCESS)
}
