//! `ninelives bench sandbox`: Quest-V sandboxes. Fig. 9 (message passing):
//! chanbench between two sandboxes on two cores, polled from guest ring 3,
//! against the same channel code between two host threads pinned the same
//! way, measured in the same run, `--reps` times each (interleaved).
//! Reported per message size: one-way latency (half the median round trip)
//! and streaming throughput, each the median over the repetitions with its
//! minimum and maximum, and the load average before and after.
//!
//! Uses only `nl_sandbox`'s API (the bench code is being moved into its
//! own crate; this file is self-contained on purpose).

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Result};
use clap::Args;
use nl_sandbox::chanbench::{native, parse_console, SizeNumbers};
use nl_sandbox::{SandboxSet, SetConfig};
use serde::Serialize;

#[derive(Args, Clone, Debug)]
pub struct BenchSandboxArgs {
    /// Repetitions of each measurement (at least 3).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Largest message in bytes (a power of two, 8..=65536).
    #[arg(long, default_value_t = 65536)]
    pub max_msg: u64,
    /// wildwrite seeds of the isolation check (0: skip it).
    #[arg(long, default_value_t = 20)]
    pub seeds: u64,
    /// Print one JSON object as the last line of stdout.
    #[arg(long)]
    pub json: bool,
}

/// The isolation check over many seeds.
#[derive(Clone, Debug, Serialize)]
pub struct Isolation {
    pub seeds: u64,
    /// Seeds with no changed byte, every read-only write reported, and both
    /// sandboxes verified.
    pub clean_seeds: u64,
    pub changed_bytes: u64,
    pub aimed_readonly: u64,
    pub reported: u64,
    pub runs: Vec<nl_sandbox::isolation::WildwriteResult>,
}

/// A number over the repetitions.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

fn spread(mut v: Vec<f64>) -> Spread {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return Spread { median: f64::NAN, min: f64::NAN, max: f64::NAN };
    }
    Spread { median: v[v.len() / 2], min: v[0], max: v[v.len() - 1] }
}

#[derive(Clone, Debug, Serialize)]
pub struct SizeRow {
    pub size: usize,
    pub sandbox_one_way_ns: Spread,
    pub native_one_way_ns: Spread,
    pub sandbox_stream_gbps: Spread,
    pub native_stream_gbps: Spread,
    /// Medians: sandbox / native.
    pub one_way_ratio: f64,
    pub stream_ratio: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Fig9 {
    pub reps: usize,
    pub cores: [usize; 2],
    pub rows: Vec<SizeRow>,
    /// The issue's targets for the headline numbers (the paper's Fig. 9 is
    /// a plot with no values in its text).
    pub target_one_way_64b_ns: f64,
    pub target_stream_4k_gbps: f64,
    pub loadavg_before: String,
    pub loadavg_after: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct BenchSandbox {
    pub fig9: Fig9,
    pub isolation: Isolation,
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim().to_string()
}

fn config(cores: [usize; 2], max_msg: u64, seed: u64) -> Result<SetConfig> {
    let text = format!(
        r#"{{"sandboxes": [
            {{"name": "lead", "cores": [{}], "mem_mib": 64, "workload": {{"kind": "chanbench", "seed": {seed}, "max_msg": {max_msg}}}}},
            {{"name": "follow", "cores": [{}], "mem_mib": 64, "workload": {{"kind": "chanbench", "seed": {seed}, "max_msg": {max_msg}}}}}
        ], "channels": [{{"name": "c", "between": ["lead", "follow"]}}]}}"#,
        cores[0], cores[1]
    );
    Ok(SetConfig::parse(&text)?)
}

fn sandbox_run(
    kvm: &nl_sandbox::Kvm,
    cores: [usize; 2],
    max_msg: u64,
    seed: u64,
) -> Result<Vec<SizeNumbers>> {
    let set = SandboxSet::create(
        kvm,
        config(cores, max_msg, seed)?,
        &nl_launch::guest::sandbox_images(),
    )?;
    set.start_all()?;
    let report = set.supervise(Duration::from_secs(300));
    if !report.all_ok() {
        let why: Vec<String> = report
            .sandboxes
            .iter()
            .map(|s| format!("{}: {} {:?}", s.name, s.message, s.problem))
            .collect();
        bail!("chanbench in the sandboxes failed: {}", why.join("; "));
    }
    let lead = report
        .sandboxes
        .iter()
        .find(|s| s.name == "lead")
        .map(|s| s.console.clone())
        .unwrap_or_default();
    Ok(parse_console(&lead))
}

pub fn measure(a: &BenchSandboxArgs) -> Result<Fig9> {
    if a.reps < 3 {
        bail!("--reps must be at least 3");
    }
    let host = nl_sandbox::affinity::host_cores()?;
    if host.len() < 2 {
        bail!("the message-passing bench needs two cores, this process may use {}", host.len());
    }
    let cores = [host[0], host[1]];
    let kvm = nl_vmm::open_kvm()?;
    let loadavg_before = loadavg();
    let (mut guest, mut host_runs) = (Vec::new(), Vec::new());
    for rep in 0..a.reps {
        let seed = 11 + rep as u64;
        eprintln!("bench sandbox: repetition {}/{}", rep + 1, a.reps);
        guest.push(sandbox_run(&kvm, cores, a.max_msg, seed)?);
        host_runs.push(native(cores, seed, a.max_msg as usize)?);
    }
    let loadavg_after = loadavg();
    let sizes: Vec<usize> =
        guest.first().map(|g| g.iter().map(|s| s.size).collect()).unwrap_or_default();
    let pick = |runs: &[Vec<SizeNumbers>], size: usize, f: fn(&SizeNumbers) -> f64| {
        spread(runs.iter().filter_map(|r| r.iter().find(|s| s.size == size)).map(f).collect())
    };
    let rows = sizes
        .iter()
        .map(|&size| {
            let g1 = pick(&guest, size, |s| s.one_way_median_ns);
            let n1 = pick(&host_runs, size, |s| s.one_way_median_ns);
            let gs = pick(&guest, size, |s| s.stream_bytes_per_sec / 1e9);
            let ns = pick(&host_runs, size, |s| s.stream_bytes_per_sec / 1e9);
            SizeRow {
                size,
                one_way_ratio: g1.median / n1.median,
                stream_ratio: gs.median / ns.median,
                sandbox_one_way_ns: g1,
                native_one_way_ns: n1,
                sandbox_stream_gbps: gs,
                native_stream_gbps: ns,
            }
        })
        .collect();
    Ok(Fig9 {
        reps: a.reps,
        cores,
        rows,
        target_one_way_64b_ns: 1000.0,
        target_stream_4k_gbps: 2.0,
        loadavg_before,
        loadavg_after,
    })
}

pub fn isolation(seeds: u64) -> Result<Isolation> {
    let host = nl_sandbox::affinity::host_cores()?;
    let cores = [host[0], *host.last().unwrap_or(&host[0])];
    let kvm = nl_vmm::open_kvm()?;
    let images = nl_launch::guest::sandbox_images();
    let mut runs = Vec::new();
    for seed in 1..=seeds {
        runs.push(nl_sandbox::isolation::wildwrite_beside(&kvm, &images, seed, cores)?);
    }
    Ok(Isolation {
        seeds,
        clean_seeds: runs.iter().filter(|r| r.clean()).count() as u64,
        changed_bytes: runs.iter().map(|r| r.changed_bytes).sum(),
        aimed_readonly: runs.iter().map(|r| r.aimed_readonly).sum(),
        reported: runs.iter().map(|r| r.reported).sum(),
        runs,
    })
}

pub fn bench(a: BenchSandboxArgs) -> Result<ExitCode> {
    let f = measure(&a)?;
    println!(
        "Fig. 9, message passing: polled channel between sandboxes on cores {} and {}, {} repetitions (median [min, max])",
        f.cores[0], f.cores[1], f.reps
    );
    println!(
        "{:>7}  {:>26}  {:>26}  {:>6}  {:>24}  {:>24}  {:>6}",
        "bytes",
        "one-way ns sandbox",
        "one-way ns host threads",
        "ratio",
        "stream GB/s sandbox",
        "stream GB/s host thr.",
        "ratio"
    );
    let s = |x: Spread, p: usize| format!("{:.p$} [{:.p$}, {:.p$}]", x.median, x.min, x.max);
    for r in &f.rows {
        println!(
            "{:>7}  {:>26}  {:>26}  {:>6.2}  {:>24}  {:>24}  {:>6.2}",
            r.size,
            s(r.sandbox_one_way_ns, 0),
            s(r.native_one_way_ns, 0),
            r.one_way_ratio,
            s(r.sandbox_stream_gbps, 2),
            s(r.native_stream_gbps, 2),
            r.stream_ratio
        );
    }
    let row = |size: usize| f.rows.iter().find(|r| r.size == size);
    if let Some(r) = row(64) {
        println!(
            "64 B one-way: {:.0} ns median (target < {:.0} ns; the paper's Fig. 9 plots Quest-V Hi/Low on its own hardware without values in the text)",
            r.sandbox_one_way_ns.median, f.target_one_way_64b_ns
        );
    }
    if let Some(r) = row(4096) {
        println!(
            "4 KiB streaming: {:.2} GB/s median (target >= {:.1} GB/s)",
            r.sandbox_stream_gbps.median, f.target_stream_4k_gbps
        );
    }
    println!("load average before: {}; after: {}", f.loadavg_before, f.loadavg_after);
    let iso = isolation(a.seeds)?;
    println!(
        "Isolation (Fig. 10): {} wildwrite seeds, {} clean; {} bytes changed in the neighbour; {} writes aimed at read-only pages, {} reported",
        iso.seeds, iso.clean_seeds, iso.changed_bytes, iso.aimed_readonly, iso.reported
    );
    for r in iso.runs.iter().filter(|r| !r.clean()) {
        println!("  seed {}: not clean: {r:?}", r.seed);
    }
    if a.json {
        println!("{}", serde_json::to_string(&BenchSandbox { fig9: f, isolation: iso.clone() })?);
    }
    Ok(if iso.clean_seeds == iso.seeds { ExitCode::SUCCESS } else { ExitCode::from(1) })
}
