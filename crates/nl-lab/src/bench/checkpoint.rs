//! `ninelives bench checkpoint`: VM-μCheckpoint measured against the same
//! workload unprotected in the same invocation (the paper's Figure 3), the
//! write faults CoW-P saves over CoW-B, checkpoint sizes, and rollback
//! latency and recovery over injected guest faults.

use std::process::ExitCode;

use anyhow::{bail, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use serde_json::json;

use crate::args::BenchCheckpointArgs;
use nl_launch::args::{
    CheckpointArgs, CkptMode, MachineArgs, PatternName, WorkloadArgs, WorkloadName,
};
use nl_launch::checkpoint::protected_run;
use nl_launch::guest;
use nl_launch::run::run_vms;

/// Checkpoint interval of the fault-injection runs.
const INJECT_INTERVAL_MS: f64 = 250.0;

struct Case {
    name: &'static str,
    args: WorkloadArgs,
}

fn cases() -> Vec<Case> {
    let d = WorkloadArgs::default();
    vec![
        // Good locality: a 4 MiB working set swept in order, re-dirtied every interval.
        Case {
            name: "memwrite-locality",
            args: WorkloadArgs { pattern: PatternName::Sequential, ws: Some(1 << 20), ..d.clone() },
        },
        // Worst case: uniform random writes over 64 MiB.
        Case {
            name: "memwrite-random",
            args: WorkloadArgs { pattern: PatternName::Random, ws: Some(64 << 20), ..d.clone() },
        },
        Case { name: "compute", args: WorkloadArgs { workload: WorkloadName::Compute, ..d } },
    ]
}

#[derive(Clone, Serialize)]
struct Cell {
    workload: &'static str,
    mode: &'static str,
    block_pages: usize,
    interval_ms: f64,
    baseline_ops_per_sec: f64,
    ops_per_sec: f64,
    normalized_time: f64,
    overhead_pct: f64,
    faults_per_interval: f64,
    checkpoint_pages_avg: f64,
    checkpoint_pct_of_memory: f64,
    pause_ms_avg: f64,
    digest_ok: bool,
    /// Which repetition this sample is (0-based); in `matrix`, the
    /// median's.
    rep: u32,
    /// In `matrix`: the normalized time of every repetition, in run order,
    /// and their spread (empty / NaN in `samples`).
    normalized_samples: Vec<f64>,
    normalized_min: f64,
    normalized_max: f64,
}

/// One cell per (workload, mode, block, interval), in first-seen order:
/// the sample with the median normalized time (the lower middle for an
/// even count), with every sample's value and their min and max.
fn matrix_medians(samples: &[Cell]) -> Vec<Cell> {
    let same = |a: &Cell, b: &Cell| {
        a.workload == b.workload
            && a.mode == b.mode
            && a.block_pages == b.block_pages
            && a.interval_ms == b.interval_ms
    };
    let mut out: Vec<Cell> = Vec::new();
    for c in samples {
        if out.iter().any(|o| same(o, c)) {
            continue;
        }
        let mut group: Vec<&Cell> = samples.iter().filter(|s| same(s, c)).collect();
        let values: Vec<f64> = group.iter().map(|s| s.normalized_time).collect();
        group.sort_by(|a, b| a.normalized_time.total_cmp(&b.normalized_time));
        let mut m = group[(group.len() - 1) / 2].clone();
        m.normalized_min = group[0].normalized_time;
        m.normalized_max = group[group.len() - 1].normalized_time;
        m.normalized_samples = values;
        m.digest_ok = group.iter().all(|s| s.digest_ok);
        out.push(m);
    }
    out
}

/// The checkpoint arguments of a bench run (the lab's one place for them).
pub(crate) fn ckpt_args(
    w: &WorkloadArgs,
    duration: f64,
    interval: f64,
    mode: CkptMode,
    block: usize,
    inject: u32,
) -> CheckpointArgs {
    CheckpointArgs {
        workload: w.clone(),
        // Hangs are judged on the vCPUs' CPU time, so a slow run is not one.
        // Injection runs: a hang is found after 100 ms of guest time (10
        // missed heartbeats), and rollbacks go back at least that far.
        machine: MachineArgs {
            heartbeat_timeout: Some(if inject > 0 { 0.1 } else { CheckpointArgs::HANG_TIMEOUT }),
            ..MachineArgs::default()
        },
        duration,
        interval: Some(interval),
        mode,
        block_pages: block,
        inject_guest_fault: inject,
        latency_bound: None,
        latency_file: None,
        disk_every: 0,
        disk_path: "unused".into(),
        key_file: None,
        console: None,
        json: true,
    }
}

pub(crate) fn baseline(w: &WorkloadArgs, duration: f64) -> Result<f64> {
    let m = MachineArgs::default();
    let config =
        guest::vm_config(&m, guest::workload_params(w, duration)?, guest::kernel_image(&m)?, None)?;
    let r = run_vms(&[config], true)?.remove(0);
    if let Some(e) = r.error {
        bail!("baseline {} failed: {e}", w.workload.name());
    }
    Ok(r.ops_per_sec)
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1]
}

pub fn bench(mut a: BenchCheckpointArgs) -> Result<ExitCode> {
    let duration = a.duration.unwrap_or(if a.loaded { 3.0 } else { 1.5 });
    a.duration = Some(duration);
    if !(duration.is_finite() && duration > 0.1) {
        bail!("--duration must be more than 0.1 seconds");
    }
    if a.worst {
        return worst(&a);
    }
    if a.loaded {
        return loaded(&a);
    }
    let variants =
        [(CkptMode::CowB, 1), (CkptMode::CowP, 1), (CkptMode::CowB, 16), (CkptMode::CowP, 16)];
    let cases = cases();
    let groups = a.intervals.len() as u64 + 1;
    let total = cases.len() as u64
        * u64::from(a.reps)
        * (2 * groups + a.intervals.len() as u64 * variants.len() as u64 + 1)
        + u64::from(a.faults);
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} runs {msg} [{elapsed}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut cells = Vec::new();
    for case in &cases {
        // Each group of runs is normalized by unprotected runs measured just
        // around it, so drift on a shared machine largely cancels out.
        let mut groups: Vec<Vec<(f64, CkptMode, usize)>> = a
            .intervals
            .iter()
            .map(|&i| variants.iter().map(|&(m, b)| (i, m, b)).collect())
            .collect();
        groups.push(vec![(50.0, CkptMode::DirtyLog, 1)]);
        for (rep_no, group) in (0..a.reps).flat_map(|r| groups.iter().map(move |g| (r, g))) {
            bar.set_message(format!("{} baseline (rep {})", case.name, rep_no + 1));
            let before = baseline(&case.args, duration)?;
            bar.inc(1);
            let mut results = Vec::new();
            for &(interval, mode, block) in group {
                bar.set_message(format!(
                    "{} {} x{block} {interval} ms",
                    case.name,
                    mode.mode().name()
                ));
                // At least three intervals, so CoW-P's prediction has intervals to work on.
                let duration = duration.max(3.0 * interval / 1000.0);
                let r = protected_run(
                    &ckpt_args(&case.args, duration, interval, mode, block, 0),
                    true,
                )?;
                bar.inc(1);
                results.push((interval, r));
            }
            // The unprotected rate just before and just after the group; the
            // higher one (less disturbed by the shared machine) is the baseline.
            let base = before.max(baseline(&case.args, duration)?);
            for (interval, r) in results {
                let rep = &r.report;
                let norm = if r.ops_per_sec > 0.0 { base / r.ops_per_sec } else { f64::INFINITY };
                cells.push(Cell {
                    workload: case.name,
                    mode: rep.mode,
                    block_pages: rep.block_pages,
                    interval_ms: interval,
                    baseline_ops_per_sec: base,
                    ops_per_sec: r.ops_per_sec,
                    normalized_time: norm,
                    overhead_pct: (norm - 1.0) * 100.0,
                    faults_per_interval: rep.faults_per_interval,
                    checkpoint_pages_avg: rep.checkpoint_pages_avg,
                    checkpoint_pct_of_memory: rep.checkpoint_pct_of_memory,
                    pause_ms_avg: rep.pause_ms_avg,
                    digest_ok: r.digest_ok,
                    rep: rep_no,
                    normalized_samples: Vec::new(),
                    normalized_min: f64::NAN,
                    normalized_max: f64::NAN,
                });
            }
        }
    }

    let samples = cells;
    let cells = matrix_medians(&samples);

    // Injected guest faults: one per run, good-locality memwrite, CoW-P. The
    // interval (250 ms) is above the error latency of every detector here
    // (self-check: one pass over 1 MiB; hang: 100 ms), as the paper requires.
    let locality = &cases[0].args;
    let (mut recovered, mut non_manifested, mut failed, mut detected, mut corrupt) =
        (0u32, 0u32, 0u32, 0u32, 0u32);
    let (mut rollback_ms, mut latency_ms) = (Vec::new(), Vec::new());
    let mut failures = Vec::new();
    for i in 0..a.faults {
        bar.set_message(format!("injected fault {}/{}", i + 1, a.faults));
        let w = WorkloadArgs { seed: 1000 + u64::from(i), ..locality.clone() };
        let r =
            protected_run(&ckpt_args(&w, 1.0, INJECT_INTERVAL_MS, CkptMode::CowP, 16, 1), true)?;
        bar.inc(1);
        let rep = &r.report;
        if !rep.rollbacks.is_empty() {
            detected += 1;
        }
        corrupt += u32::from(rep.rollbacks.iter().any(|r| r.checkpoint_after_fault));
        rollback_ms.extend(rep.rollbacks.iter().map(|r| r.rollback_ms));
        if let (Some(inj), Some(rb)) = (rep.injections.first(), rep.rollbacks.first()) {
            latency_ms.push(rb.at_ms - inj.at_ms);
        }
        match (r.digest_ok, rep.rollbacks.is_empty()) {
            (true, false) => recovered += 1,
            (true, true) => non_manifested += 1,
            (false, _) => {
                failed += 1;
                failures
                    .push(json!({"seed": w.seed, "injections": rep.injections, "error": r.error}));
            }
        }
    }
    bar.finish_and_clear();

    let find = |w: &str, m: &str, b: usize, i: f64| {
        cells
            .iter()
            .find(|c| c.workload == w && c.mode == m && c.block_pages == b && c.interval_ms == i)
    };
    let reduction = |b: usize| -> Option<f64> {
        let (cb, cp) = (
            find("memwrite-locality", "cow-b", b, 50.0)?,
            find("memwrite-locality", "cow-p", b, 50.0)?,
        );
        (cb.faults_per_interval > 0.0)
            .then(|| 100.0 * (1.0 - cp.faults_per_interval / cb.faults_per_interval))
    };
    let n = a.faults.max(1) as f64;
    let rollback = json!({
        "runs": a.faults,
        "interval_ms": INJECT_INTERVAL_MS,
        "guest_mem_mib": MachineArgs::default().mem >> 20,
        "detected": detected,
        "recovered": recovered,
        "non_manifested": non_manifested,
        "failed": failed,
        "recovered_share": f64::from(recovered + non_manifested) / n,
        "recovered_of_detected": if detected > 0 { f64::from(recovered) / f64::from(detected) } else { 0.0 },
        "checkpoint_corruption": corrupt,
        "rollback_ms": pct(&mut rollback_ms.clone(), 0.5),
        "rollback_ms_avg": rollback_ms.iter().sum::<f64>() / rollback_ms.len().max(1) as f64,
        "rollback_ms_max": rollback_ms.iter().copied().fold(0.0, f64::max),
        "error_latency_ms_p50": pct(&mut latency_ms.clone(), 0.5),
        "error_latency_ms_p95": pct(&mut latency_ms, 0.95),
        "failures": failures,
    });

    if let Some(dir) = &a.plot {
        for case in &cases {
            let series: Vec<crate::figures::Series> = variants
                .iter()
                .map(|&(m, b)| crate::figures::Series {
                    label: format!("{} (block {b})", m.mode().name()),
                    points: cells
                        .iter()
                        .filter(|c| {
                            c.workload == case.name
                                && c.mode == m.mode().name()
                                && c.block_pages == b
                        })
                        .map(|c| (c.interval_ms, c.normalized_time))
                        .collect(),
                })
                .collect();
            let path = crate::figures::line_chart(
                dir,
                &format!("figure3-{}", case.name),
                &format!("{}: normalized execution time under VM-uCheckpoint", case.name),
                "checkpoint interval (ms)",
                "protected / unprotected time (log)",
                &series,
            )?;
            eprintln!("wrote {}", path.display());
        }
    }
    if !a.json {
        println!(
            "{:<18} {:<9} {:>5} {:>8} {:>26} {:>9} {:>10} {:>10} {:>8}",
            "workload",
            "mode",
            "block",
            "interval",
            "norm.time median [min,max]",
            "faults/iv",
            "pages/iv",
            "% of mem",
            "pause ms"
        );
        for c in &cells {
            println!(
                "{:<18} {:<9} {:>5} {:>8.0} {:>26} {:>9.1} {:>10.1} {:>10.3} {:>8.2}{}",
                c.workload,
                c.mode,
                c.block_pages,
                c.interval_ms,
                format!(
                    "{:.3} [{:.3}, {:.3}]",
                    c.normalized_time, c.normalized_min, c.normalized_max
                ),
                c.faults_per_interval,
                c.checkpoint_pages_avg,
                c.checkpoint_pct_of_memory,
                c.pause_ms_avg,
                if c.digest_ok { "" } else { "  DIGEST WRONG" }
            );
        }
        for b in [1, 16] {
            if let Some(r) = reduction(b) {
                println!("CoW-P removes {r:.1}% of CoW-B's write faults at 50 ms (memwrite-locality, block {b})");
            }
        }
        println!("{}", serde_json::to_string_pretty(&rollback)?);
    } else {
        println!(
            "{}",
            json!({"checkpoint": {
                "matrix": cells,
                "reps": a.reps,
                "samples": samples,
                "cow_p_fault_reduction_pct_50ms": {"block_1": reduction(1), "block_16": reduction(16)},
                "rollback": rollback,
            }})
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// CPU hogs: busy-loop threads, stopped (and joined) on drop.
pub(crate) struct Hogs {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Hogs {
    pub(crate) fn start(n: u32) -> Result<Self> {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut threads = Vec::new();
        for i in 0..n {
            let stop = stop.clone();
            threads.push(std::thread::Builder::new().name(format!("hog{i}")).spawn(move || {
                let mut x = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    for _ in 0..10_000 {
                        x = std::hint::black_box(
                            x.wrapping_mul(6364136223846793005).wrapping_add(1),
                        );
                    }
                }
            })?);
        }
        Ok(Self { stop, threads })
    }
}

impl Drop for Hogs {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// How a protected run ended: "ok" (digest verified), "SDC" (the guest
/// finished with a wrong digest), "cut short" (it did not finish within the
/// run's time limit) or "other failure" (a detected crash or error).
fn run_class(r: &nl_launch::checkpoint::ProtectedRun) -> &'static str {
    match (r.digest_ok, &r.report.outcome, r.error.as_deref()) {
        (true, ..) => "ok",
        (false, _, Some(e)) if e.contains("silent data corruption") => "SDC",
        (false, nl_vmm::VmOutcome::TimedOut { .. }, _) => "cut short",
        _ => "other failure",
    }
}

pub(crate) fn loadavg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(f64::NAN)
}

/// `bench checkpoint --loaded`: the default `checkpoint` configuration
/// (auto, 50 ms interval, 1 s hang timeout, memwrite) on a host loaded with
/// CPU hogs: fault-free runs must not roll back, and runs with one injected
/// guest fault must not end in silent data corruption.
fn loaded(a: &BenchCheckpointArgs) -> Result<ExitCode> {
    let d = WorkloadArgs::default();
    let args = |seed: u64, inject: u32| {
        let w = WorkloadArgs { seed, ..d.clone() };
        let duration = a.duration.unwrap_or(3.0);
        CheckpointArgs {
            // The default interval, and the default 1 s hang timeout even
            // with a fault injected (the default configuration is checked).
            interval: None,
            machine: MachineArgs {
                heartbeat_timeout: Some(CheckpointArgs::HANG_TIMEOUT),
                ..MachineArgs::default()
            },
            ..ckpt_args(&w, duration, 50.0, CkptMode::Auto, 16, inject)
        }
    };
    let hogs = Hogs::start(a.hogs)?;
    let mut loads = vec![loadavg()];
    let (mut clean_rollbacks, mut clean_runs_rolled_back) = (0usize, 0u32);
    // A fault-free run that ends with a wrong digest is silent data
    // corruption caused by checkpointing itself; one that did not finish
    // (cut short by the run's time limit) or failed otherwise is not.
    let (mut clean_sdc, mut clean_cut_short, mut clean_other) = (0u32, 0u32, 0u32);
    let mut clean_errors = Vec::new();
    for i in 0..a.runs {
        let r = protected_run(&args(1 + u64::from(i), 0), true)?;
        clean_rollbacks += r.report.rollbacks.len();
        clean_runs_rolled_back += u32::from(!r.report.rollbacks.is_empty());
        let class = run_class(&r);
        match class {
            "SDC" => clean_sdc += 1,
            "cut short" => clean_cut_short += 1,
            "other failure" => clean_other += 1,
            _ => {}
        }
        loads.push(loadavg());
        eprintln!(
            "fault-free run {}/{}: {} rollbacks, {class}{}",
            i + 1,
            a.runs,
            r.report.rollbacks.len(),
            r.error.as_deref().map_or(String::new(), |e| format!(" ({e})"))
        );
        clean_errors.extend(r.error.clone());
    }
    let (mut recovered, mut non_manifested, mut sdc, mut detected_failure, mut corrupt) =
        (0u32, 0u32, 0u32, 0u32, 0u32);
    let mut cut_short = 0u32;
    let mut faults = Vec::new();
    for seed in 1..=u64::from(a.seeds) {
        let r = protected_run(&args(seed, 1), true)?;
        let rep = &r.report;
        corrupt += u32::from(rep.rollbacks.iter().any(|r| r.checkpoint_after_fault));
        let class = match (run_class(&r), rep.rollbacks.is_empty()) {
            ("ok", false) => {
                recovered += 1;
                "recovered"
            }
            ("ok", true) => {
                non_manifested += 1;
                "not manifested"
            }
            ("SDC", _) => {
                sdc += 1;
                "SDC"
            }
            ("cut short", _) => {
                cut_short += 1;
                "cut short"
            }
            _ => {
                detected_failure += 1;
                "detected failure"
            }
        };
        loads.push(loadavg());
        eprintln!(
            "seed {seed}: {class}, {} rollbacks{}",
            rep.rollbacks.len(),
            r.error.as_deref().map_or(String::new(), |e| format!(" ({e})"))
        );
        faults.push(json!({
            "seed": seed, "outcome": class, "rollbacks": rep.rollbacks.len(),
            "injections": rep.injections, "error": r.error,
        }));
    }
    drop(hogs);
    let lo = loads.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = loads.iter().copied().fold(0.0, f64::max);
    let out = json!({"checkpoint_loaded": {
        "hogs": a.hogs, "duration_s": a.duration, "interval_ms": 50.0, "hang_timeout_s": 1.0,
        "loadavg_min": lo, "loadavg_max": hi,
        "fault_free": {"runs": a.runs, "runs_rolled_back": clean_runs_rolled_back,
                       "rollbacks": clean_rollbacks, "sdc": clean_sdc,
                       "cut_short": clean_cut_short, "other_failure": clean_other,
                       "errors": clean_errors},
        "injected": {"seeds": a.seeds, "recovered": recovered, "not_manifested": non_manifested,
                     "detected_failure": detected_failure, "sdc": sdc, "cut_short": cut_short,
                     "rolled_back_to_a_checkpoint_after_the_fault": corrupt, "runs": faults},
    }});
    if a.json {
        println!("{out}");
    } else {
        println!("loaded host: {} hogs, load average {lo:.1}..{hi:.1} (1 min)", a.hogs);
        println!(
            "{:<24} {:>4} {:>10} {:>10} {:>4} {:>10} {:>7}",
            "runs", "n", "rollbacks", "recovered", "SDC", "cut short", "other"
        );
        println!(
            "{:<24} {:>4} {:>10} {:>10} {:>4} {:>10} {:>7}",
            "fault-free", a.runs, clean_rollbacks, "-", clean_sdc, clean_cut_short, clean_other
        );
        println!(
            "{:<24} {:>4} {:>10} {:>10} {:>4} {:>10} {:>7}",
            "--inject-guest-fault 1", a.seeds, "-", recovered, sdc, cut_short, detected_failure
        );
        println!("({non_manifested} injected faults did not manifest)");
        println!("{out}");
    }
    Ok(if clean_rollbacks == 0 && clean_sdc + clean_cut_short + clean_other == 0 && sdc == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Median, least and greatest of `v`.
pub(crate) fn spread(v: &[f64]) -> (f64, f64, f64) {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    s.sort_by(f64::total_cmp);
    let n = s.len();
    let med = if n % 2 == 1 { s[n / 2] } else { (s[n / 2 - 1] + s[n / 2]) / 2.0 };
    (med, s[0], s[n - 1])
}

#[derive(Serialize)]
struct WorstRow {
    workload: String,
    mode: &'static str,
    reps: usize,
    normalized_time_median: f64,
    normalized_time_min: f64,
    normalized_time_max: f64,
    lower_bound: f64,
    to_bound: f64,
    pages_per_interval: f64,
    intervals_compare_share: f64,
    pause_ms_avg: f64,
    rollbacks: usize,
    digest_failures: usize,
}

/// Per mode: normalized times, pages, compare share, pauses, rollbacks,
/// wrong digests.
type Samples = (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, usize, usize);

/// `bench checkpoint --worst`: see [`BenchCheckpointArgs::worst`].
fn worst(a: &BenchCheckpointArgs) -> Result<ExitCode> {
    let duration = a.duration.unwrap_or(1.5);
    let reps = a.reps.max(1);
    let d = WorkloadArgs::default();
    let mib = |m: u64| Some(m << 20);
    let w = |pattern, ws| WorkloadArgs { pattern, ws, ..d.clone() };
    let cases: Vec<(String, WorkloadArgs)> = vec![
        ("locality seq 1M".into(), w(PatternName::Sequential, mib(1))),
        ("sequential 8M".into(), w(PatternName::Sequential, mib(8))),
        ("sequential 64M".into(), w(PatternName::Sequential, mib(64))),
        ("strided 64M".into(), w(PatternName::Strided, mib(64))),
        ("random 64M".into(), w(PatternName::Random, mib(64))),
        ("hotcold 64M".into(), w(PatternName::Hotcold, mib(64))),
    ];
    let modes = [(CkptMode::Auto, 1), (CkptMode::DirtyLog, 1), (CkptMode::CowP, 16)];
    let hogs = if a.loaded { Some(Hogs::start(a.hogs)?) } else { None };
    let mut load = vec![loadavg()];
    let costs = super::unit_costs::UnitCosts::measure()?;
    if !a.json {
        super::unit_costs::print(&costs);
    }
    let bar = ProgressBar::new(cases.len() as u64 * u64::from(reps) * (modes.len() as u64 + 1));
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} runs {msg} [{elapsed}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut rows = Vec::new();
    for (name, args) in &cases {
        // Per mode: normalized times, pages, compare share, pause, rollbacks, bad digests.
        let mut per: Vec<Samples> = modes.iter().map(|_| Default::default()).collect();
        let (mut logged, mut allocated) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            bar.set_message(format!("{name} baseline"));
            let base = baseline(args, duration)?;
            bar.inc(1);
            for (i, &(mode, block)) in modes.iter().enumerate() {
                bar.set_message(format!("{name} {}", mode.mode().name()));
                let r = protected_run(&ckpt_args(args, duration, 50.0, mode, block, 0), true)?;
                bar.inc(1);
                let rep = &r.report;
                let p = &mut per[i];
                p.0.push(if r.ops_per_sec > 0.0 { base / r.ops_per_sec } else { f64::INFINITY });
                p.1.push(rep.checkpoint_pages_avg);
                let n = (rep.intervals_compare + rep.intervals_dirty_log).max(1) as f64;
                p.2.push(rep.intervals_compare as f64 / n);
                p.3.push(rep.pause_ms_avg);
                p.4 += rep.rollbacks.len();
                p.5 += usize::from(!r.digest_ok);
                if mode == CkptMode::DirtyLog {
                    logged.push(rep.scanned_pages_avg);
                }
                if mode == CkptMode::Auto && rep.intervals_compare > 0 {
                    allocated.push(rep.scanned_pages_avg);
                }
            }
            load.push(loadavg());
        }
        // Pages written per interval: what the dirty log saw; allocated:
        // what the compare capture scanned (else as many as were written).
        let dirty = spread(&logged).0;
        let alloc = if allocated.is_empty() { dirty } else { spread(&allocated).0 };
        let bound = costs.checkpoint_bound(dirty, alloc, 50.0);
        for (i, &(mode, _)) in modes.iter().enumerate() {
            let p = &per[i];
            let (med, lo, hi) = spread(&p.0);
            rows.push(WorstRow {
                workload: name.clone(),
                mode: mode.mode().name(),
                reps: p.0.len(),
                normalized_time_median: med,
                normalized_time_min: lo,
                normalized_time_max: hi,
                lower_bound: bound,
                to_bound: med / bound,
                pages_per_interval: spread(&p.1).0,
                intervals_compare_share: spread(&p.2).0,
                pause_ms_avg: spread(&p.3).0,
                rollbacks: p.4,
                digest_failures: p.5,
            });
        }
    }
    bar.finish_and_clear();
    drop(hogs);
    let (lo, hi) = load.iter().fold((f64::MAX, f64::MIN), |(l, h), x| (l.min(*x), h.max(*x)));
    if !a.json {
        println!(
            "checkpoints at 50 ms, {reps} reps, {}; load average {lo:.1}..{hi:.1}",
            if a.loaded { format!("loaded ({} hogs)", a.hogs) } else { "quiet".into() }
        );
        println!(
            "{:<16} {:<9} {:>9} {:>17} {:>7} {:>8} {:>9} {:>8} {:>8} {:>4}",
            "workload",
            "mode",
            "norm.med",
            "(min..max)",
            "bound",
            "x bound",
            "pages/iv",
            "compare",
            "pause ms",
            "rb"
        );
        for r in &rows {
            println!(
                "{:<16} {:<9} {:>9.3} {:>17} {:>7.3} {:>8.2} {:>9.0} {:>7.0}% {:>8.2} {:>4}{}",
                r.workload,
                r.mode,
                r.normalized_time_median,
                format!("({:.3}..{:.3})", r.normalized_time_min, r.normalized_time_max),
                r.lower_bound,
                r.to_bound,
                r.pages_per_interval,
                r.intervals_compare_share * 100.0,
                r.pause_ms_avg,
                r.rollbacks,
                if r.digest_failures > 0 { "  DIGEST WRONG" } else { "" }
            );
        }
    }
    println!(
        "{}",
        json!({"checkpoint_worst": {
            "interval_ms": 50.0, "reps": reps, "duration_s": duration,
            "loaded": a.loaded, "hogs": if a.loaded { a.hogs } else { 0 },
            "loadavg_min": lo, "loadavg_max": hi, "unit_costs": costs, "rows": rows,
        }})
    );
    let bad = rows.iter().any(|r| r.digest_failures > 0 || r.rollbacks > 0);
    Ok(if bad { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(mode: &'static str, rep: u32, norm: f64, digest_ok: bool) -> Cell {
        Cell {
            workload: "w",
            mode,
            block_pages: 1,
            interval_ms: 50.0,
            baseline_ops_per_sec: 1.0,
            ops_per_sec: 1.0 / norm,
            normalized_time: norm,
            overhead_pct: (norm - 1.0) * 100.0,
            faults_per_interval: 0.0,
            checkpoint_pages_avg: 0.0,
            checkpoint_pct_of_memory: 0.0,
            pause_ms_avg: 0.0,
            digest_ok,
            rep,
            normalized_samples: Vec::new(),
            normalized_min: f64::NAN,
            normalized_max: f64::NAN,
        }
    }

    #[test]
    fn the_matrix_keeps_one_cell_per_configuration_with_every_repetition() {
        let samples = vec![
            cell("cow-b", 0, 3.0, true),
            cell("cow-p", 0, 1.2, true),
            cell("cow-b", 1, 1.0, true),
            cell("cow-p", 1, 1.1, false),
            cell("cow-b", 2, 2.0, true),
            cell("cow-p", 2, 1.3, true),
        ];
        let m = matrix_medians(&samples);
        assert_eq!(m.len(), 2);
        assert_eq!((m[0].mode, m[0].rep, m[0].normalized_time), ("cow-b", 2, 2.0));
        assert_eq!(m[0].normalized_samples, vec![3.0, 1.0, 2.0]);
        assert_eq!((m[0].normalized_min, m[0].normalized_max), (1.0, 3.0));
        assert!(m[0].digest_ok);
        assert_eq!((m[1].mode, m[1].normalized_time), ("cow-p", 1.2));
        // One wrong digest in any repetition shows on the cell.
        assert!(!m[1].digest_ok);
    }
}
