//! `ninelives bench sandbox`: Quest-V sandboxes. Fig. 9 (message passing):
//! chanbench between two sandboxes on two cores, polled from guest ring 3,
//! against the same channel code between two host threads pinned the same
//! way, measured in the same run, `--reps` times each (interleaved).
//! Reported per message size: one-way latency (half the median round trip)
//! and streaming throughput, each the median over the repetitions with its
//! minimum and maximum, and the load average before and after. Beside it
//! the doorbell round trip (the `doorbell` workload: halting receivers
//! woken by an ioeventfd-to-irqfd doorbell) and the polled 64-byte round
//! trip of the same repetition.
//!
//! Table 2 (`syscall` in a sandbox against the same guest in a plain VM)
//! and Figs. 7/8 (`tlbwalk` in a sandbox against the same engine run
//! natively on the same core, per page count), interleaved per repetition,
//! each with the paper's figure beside ours.
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
    /// Page counts of the TLB rows (Figs. 7/8), 1..=65536 each.
    #[arg(long, value_delimiter = ',', default_values_t = vec![8, 64, 512, 2048, 8192])]
    pub pages: Vec<u64>,
    /// The TLB series: `load` (data, Fig. 7) and `fetch` (instructions,
    /// Fig. 8).
    #[arg(long, value_delimiter = ',', default_values_t = ["load".to_string(), "fetch".to_string()])]
    pub tlb_access: Vec<String>,
    /// What to measure: any of fig9 (with the doorbell), budgets (Fig. 9's
    /// Hi and Low budget curves), table2, tlb, isolation, storm (the budget
    /// storm), tapflood (a TAP flood beside a reserved sandbox), interrupts
    /// (Table 3: pings on a private against a multicast shared TAP),
    /// shared-driver (Fig. 11: UDP echo throughput through a shared
    /// against private TAPs, 1 to 4 sandboxes); the last three need root
    /// for their network namespaces and are not in the default.
    #[arg(long, value_delimiter = ',', default_values_t = ["fig9".to_string(), "budgets".to_string(), "table2".to_string(), "tlb".to_string(), "isolation".to_string(), "storm".to_string()])]
    pub parts: Vec<String>,
    /// Milliseconds of each storm run and of each budget-curve window.
    #[arg(long, default_value_t = 3000)]
    pub storm_ms: u64,
    /// Budget curves (`budgets`): the unbudgeted receiver sends one message
    /// back every this many µs (0: as fast as the sender drains them, the
    /// first version's setting, in which the sender's budget went mostly
    /// into draining the receiver's flood).
    #[arg(long, default_value_t = 100_000)]
    pub budget_echo_us: u64,
    /// Pings (3 ms apart) per Table 3 run (`interrupts`).
    #[arg(long, default_value_t = 1500)]
    pub pings: u64,
    /// Measured milliseconds of each Fig. 11 throughput run
    /// (`shared-driver`).
    #[arg(long, default_value_t = 1000)]
    pub net_ms: u64,
    /// Measured milliseconds of each syscall and tlbwalk run.
    #[arg(long, default_value_t = 1000)]
    pub duration_ms: u64,
    /// Print one JSON object as the last line of stdout.
    #[arg(long)]
    pub json: bool,
    /// The storm part: run the host core stall probe (`nl_lab::stalls`) on
    /// the shared core and report its stalls. Off by default: its
    /// wake-ups change what it measures.
    #[arg(long)]
    pub stall_probe: bool,
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

pub(crate) fn spread(mut v: Vec<f64>) -> Spread {
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

/// The doorbell's round trip over the repetitions, beside the polled one.
#[derive(Clone, Debug, Serialize)]
pub struct DoorbellRow {
    pub doorbell_rtt_us: Spread,
    pub doorbell_rtt_min_us: Spread,
    /// Per repetition: halts the doorbell ended / halts.
    pub woken_share: Spread,
    /// The polled 64-byte round trip of the same repetitions.
    pub polled_rtt_64b_us: Spread,
    pub target_doorbell_rtt_us: f64,
    pub samples: Vec<nl_sandbox::chanbench::DoorbellNumbers>,
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
    pub doorbell: Option<DoorbellRow>,
    pub loadavg_before: String,
    pub loadavg_after: String,
}

/// Table 2: the syscall workload, sandbox against plain VM.
#[derive(Clone, Debug, Serialize)]
pub struct Table2 {
    pub reps: usize,
    /// Syscalls (with their ring-3 work) per second.
    pub sandbox_ops_per_sec: Spread,
    pub plain_ops_per_sec: Spread,
    /// Per repetition: sandbox / plain (throughput; 1.0 = no overhead).
    pub ratio: Spread,
    pub sandbox_samples: Vec<f64>,
    pub plain_samples: Vec<f64>,
    /// The paper's Table 2: forkwait in a sandbox takes 1.9% longer than
    /// without sandboxing (throughput ratio 1/1.019).
    pub paper_ratio: f64,
    /// The issue's target: within 2%.
    pub target_within: f64,
    pub loadavg_before: String,
    pub loadavg_after: String,
}

/// Figs. 7/8: one page count.
#[derive(Clone, Debug, Serialize)]
pub struct TlbRow {
    /// `load` (Fig. 7) or `fetch` (Fig. 8).
    pub access: String,
    pub pages: u64,
    /// Nanoseconds per access.
    pub sandbox_ns: Spread,
    pub native_ns: Spread,
    /// Per repetition: sandbox / native time per access (1.0 = native).
    pub ratio: Spread,
    pub sandbox_samples: Vec<f64>,
    pub native_samples: Vec<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Tlb {
    pub reps: usize,
    pub core: usize,
    pub stride_bytes: u64,
    pub rows: Vec<TlbRow>,
    /// The issue's reading of the paper's Figs. 7/8: within 5% of native up
    /// to 512 pages.
    pub target_within: f64,
    pub loadavg_before: String,
    pub loadavg_after: String,
}

/// One arm of the storm: the periodic sandbox's periods over the
/// repetitions.
/// The periodic sandbox of the storm and TAP-flood parts: its period and
/// the CPU it needs in each (µs).
const PERIOD_US: u64 = 10_000;
const NEED_US: u64 = 6_000;

/// How the periodic sandbox fared over the repetitions of one arm (the
/// storm and the TAP-flood parts judge it alike).
#[derive(Clone, Debug, Serialize)]
pub struct PeriodicShares {
    /// Per repetition: the worst complete period's CPU over what it needs.
    pub worst_over_need: Spread,
    /// Per repetition: the share of periods that got what it needs.
    pub met_share: Spread,
    /// Per repetition: the mean CPU per period over the period.
    pub mean_share: Spread,
    /// With a reservation, per repetition, by the host's account of the
    /// periodic sandbox's vCPU thread: the worst window's CPU over the
    /// runtime, the share of windows that gave the runtime, and windows
    /// opened more than 200 µs late.
    pub host_worst_over_runtime: Option<Spread>,
    pub host_met_share: Option<Spread>,
    pub host_late_windows: Option<Spread>,
}

/// [`PeriodicShares`] of one arm's repetitions: the guest's period report
/// and, with a reservation, the host's account.
fn periodic_shares(
    runs: &[(&nl_sandbox::periodic::PeriodReport, Option<&nl_sandbox::reserve::ReserveStats>)],
) -> PeriodicShares {
    let guest = |f: &dyn Fn(&nl_sandbox::periodic::PeriodReport) -> f64| {
        spread(runs.iter().map(|r| f(r.0)).collect())
    };
    let host = |f: fn(&nl_sandbox::reserve::ReserveStats) -> f64| {
        let x: Vec<f64> = runs.iter().filter_map(|r| r.1.map(f)).collect();
        (!x.is_empty()).then(|| spread(x))
    };
    PeriodicShares {
        worst_over_need: guest(&|p| p.worst_us as f64 / NEED_US as f64),
        met_share: guest(&|p| p.met as f64 / p.periods.max(1) as f64),
        mean_share: guest(&|p| p.total_us as f64 / (p.periods.max(1) * PERIOD_US) as f64),
        host_worst_over_runtime: host(|r| r.worst_us as f64 / r.runtime_us.max(1) as f64),
        host_met_share: host(|r| r.met as f64 / r.periods.max(1) as f64),
        host_late_windows: host(|r| r.late as f64),
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct StormArm {
    pub what: String,
    /// The periodic sandbox's reserved budget and the storm's cap (runtime,
    /// period µs).
    pub reservation: Option<(u64, u64)>,
    pub storm_budget: Option<(u64, u64)>,
    #[serde(flatten)]
    pub periodic: PeriodicShares,
    /// Per repetition: the storm's rings per second, and its periods
    /// throttled by its budget.
    pub storm_rings_per_sec: Spread,
    pub storm_throttled_periods: Spread,
    /// Per repetition: host core stalls of the core (wake-ups of a
    /// real-time probe more than 20 ms late, `nl_lab::stalls`), each a
    /// stretch in which no thread of the host got that core.
    pub host_core_stalls: Option<Spread>,
    pub samples: Vec<nl_sandbox::periodic::PeriodReport>,
    pub reserved: Vec<nl_sandbox::reserve::ReserveStats>,
}

/// The budget storm: a periodic sandbox beside a doorbell storm on one core.
#[derive(Clone, Debug, Serialize)]
pub struct Storm {
    pub reps: usize,
    pub core: usize,
    pub period_us: u64,
    /// CPU per period the periodic sandbox needs (its reservation's worth
    /// of ring-3 work).
    pub need_us: u64,
    pub arms: Vec<StormArm>,
    pub loadavg_before: String,
    pub loadavg_after: String,
}

/// Fig. 9's Hi and Low curves: chanstream throughput with the sender under
/// a high and a low reserved budget. The paper's Hi is 50% utilization
/// (sender and receiver, 100 ms periods); its Low's budget is not in the
/// text we have. Here the sender alone is budgeted (10 ms periods), so the
/// difference is the sender's budget's; the receiver sends back only one
/// message every `echo_us` (chanstream ends both send and receive).
#[derive(Clone, Debug, Serialize)]
pub struct BudgetCurves {
    pub reps: usize,
    pub cores: [usize; 2],
    pub hi: (u64, u64),
    pub low: (u64, u64),
    /// The receiver's send period in µs (0: as fast as it can).
    pub echo_us: u64,
    /// Messages per second the budgeted sender drained from the receiver
    /// over the window (its budget's other use).
    pub hi_tx_drained_per_sec: Spread,
    pub low_tx_drained_per_sec: Spread,
    /// 64-byte messages per second received from the sender.
    pub hi_msgs_per_sec: Spread,
    pub low_msgs_per_sec: Spread,
    /// Per repetition: Hi / Low throughput, against Hi / Low budget.
    pub throughput_ratio: Spread,
    pub budget_ratio: f64,
    /// Per repetition: messages per second of the sender's budget
    /// (throughput / budget share), Hi and Low: equal if the budget alone
    /// explains the difference.
    pub hi_msgs_per_budget_sec: Spread,
    pub low_msgs_per_budget_sec: Spread,
    /// Per repetition: the sender's host CPU over the window's wall time
    /// (what its budget gave it).
    pub hi_tx_cpu_share: Spread,
    pub low_tx_cpu_share: Spread,
    /// The sender's reservation windows, Hi runs then Low runs.
    pub reserved: Vec<nl_sandbox::reserve::ReserveStats>,
    pub loadavg_before: String,
    pub loadavg_after: String,
}

/// The report's budget row: the CPU share the reserved periodic sandbox
/// got in the storm (its ring-3 account), against its reservation.
#[derive(Clone, Debug, Serialize)]
pub struct BudgetRow {
    pub share: Spread,
    pub target: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct BenchSandbox {
    pub budget: Option<BudgetRow>,
    pub budgets: Option<BudgetCurves>,
    pub storm: Option<Storm>,
    pub tapflood: Option<TapFlood>,
    pub table3: Option<super::sandbox_shared::Table3>,
    pub fig11: Option<super::sandbox_shared::Fig11>,
    pub fig9: Option<Fig9>,
    pub table2: Option<Table2>,
    pub tlb: Option<Tlb>,
    pub isolation: Option<Isolation>,
}

pub(crate) fn loadavg() -> String {
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
    let (report, _) = run_set(kvm, config(cores, max_msg, seed)?, "chanbench")?;
    let lead = report
        .sandboxes
        .iter()
        .find(|s| s.name == "lead")
        .map(|s| s.console.clone())
        .unwrap_or_default();
    Ok(parse_console(&lead))
}

/// Runs a set to its end; every sandbox must complete and verify. Returns
/// the report and the guests' TSC frequency (kHz).
fn run_set(
    kvm: &nl_sandbox::Kvm,
    config: SetConfig,
    what: &str,
) -> Result<(nl_sandbox::SetReport, u64)> {
    let set = SandboxSet::create(kvm, config, &nl_launch::guest::sandbox_images())?;
    let khz = set
        .sandboxes
        .first()
        .and_then(|sb| nl_arch::read_boot_info(sb.vm().memory().mem()).ok())
        .map_or(0, |b| b.tsc_khz);
    set.start_all()?;
    let report = set.supervise(Duration::from_secs(300));
    if !report.all_ok() {
        let why: Vec<String> = report
            .sandboxes
            .iter()
            .map(|s| format!("{}: {} {:?}", s.name, s.message, s.problem))
            .collect();
        bail!("{what} in the sandboxes failed: {}", why.join("; "));
    }
    Ok((report, khz))
}

fn doorbell_run(
    kvm: &nl_sandbox::Kvm,
    cores: [usize; 2],
    seed: u64,
) -> Result<nl_sandbox::chanbench::DoorbellNumbers> {
    let text = format!(
        r#"{{"sandboxes": [
            {{"name": "lead", "cores": [{}], "workload": {{"kind": "doorbell", "seed": {seed}}}}},
            {{"name": "follow", "cores": [{}], "workload": {{"kind": "doorbell", "seed": {seed}}}}}
        ], "channels": [{{"name": "c", "between": ["lead", "follow"], "doorbell": true}}]}}"#,
        cores[0], cores[1]
    );
    let (report, _) = run_set(kvm, SetConfig::parse(&text)?, "doorbell")?;
    let lead = report.sandboxes.iter().find(|s| s.name == "lead").map(|s| s.console.as_str());
    nl_sandbox::chanbench::parse_doorbell(lead.unwrap_or_default())
        .ok_or_else(|| anyhow::anyhow!("the doorbell leader printed no result"))
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
    let (mut guest, mut host_runs, mut bells) = (Vec::new(), Vec::new(), Vec::new());
    for rep in 0..a.reps {
        let seed = 11 + rep as u64;
        eprintln!("bench sandbox: repetition {}/{}", rep + 1, a.reps);
        guest.push(sandbox_run(&kvm, cores, a.max_msg, seed)?);
        host_runs.push(native(cores, seed, a.max_msg as usize)?);
        bells.push(doorbell_run(&kvm, cores, seed)?);
    }
    let doorbell = Some(DoorbellRow {
        doorbell_rtt_us: spread(bells.iter().map(|b| b.rtt_median_ns / 1e3).collect()),
        doorbell_rtt_min_us: spread(bells.iter().map(|b| b.rtt_min_ns / 1e3).collect()),
        woken_share: spread(bells.iter().map(|b| b.woken as f64 / b.halts.max(1) as f64).collect()),
        polled_rtt_64b_us: spread(
            guest
                .iter()
                .filter_map(|g| g.iter().find(|s| s.size == 64))
                .map(|s| s.rtt_median_ns / 1e3)
                .collect(),
        ),
        target_doorbell_rtt_us: 100.0,
        samples: bells,
    });
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
        doorbell,
        loadavg_before,
        loadavg_after,
    })
}

/// A plain VM (no windows, not pinned) running `params` to its end:
/// ops per TSC cycle, its digest checked against the host's replay.
/// Its vCPU thread runs on `core` (the thread that starts it is pinned
/// there meanwhile, as the sandbox set does), so both sides of Table 2 get
/// the same core and only the sandbox features differ.
fn plain_vm_ops_per_cycle(
    kvm: &nl_sandbox::Kvm,
    core: usize,
    params: nl_abi::WorkloadParams,
) -> Result<f64> {
    let images = nl_launch::guest::sandbox_images();
    let config = nl_vmm::VmConfig {
        mem_bytes: 64 << 20,
        vcpus: 1,
        workload: params,
        kernel: images.kernel,
        user: images.user,
        console_path: None,
        timer_hz: 100,
        heartbeat_timeout: Duration::from_secs(20),
        disk: None,
        net: None,
    };
    let vm = nl_vmm::Vm::create(kvm, 0, config)?;
    let before = nl_sandbox::affinity::host_cores()?;
    nl_sandbox::affinity::pin(0, &[core])?;
    let started = vm.start();
    nl_sandbox::affinity::pin(0, &before)?;
    started?;
    let out = vm.wait(Duration::from_secs(300));
    let r = vm.control().vcpus[0].snapshot();
    vm.stop();
    if out != nl_vmm::VmOutcome::Completed {
        bail!("the plain VM did not complete: {out:?}");
    }
    let rep = nl_workloads::native::replay(&params, 0, r.rounds, 0)
        .map_err(|e| anyhow::anyhow!("cannot replay: {e}"))?;
    if rep.digest != r.digest {
        bail!("the plain VM's digest {:#x} is not the replay's {:#x}", r.digest, rep.digest);
    }
    Ok(r.ops as f64 / r.cycles.max(1) as f64)
}

/// One sandbox on `core` running `workload` (JSON): ops per TSC cycle and
/// the TSC frequency.
fn sandbox_ops_per_cycle(
    kvm: &nl_sandbox::Kvm,
    core: usize,
    mem_mib: u64,
    workload: &str,
) -> Result<(f64, u64, nl_abi::WorkloadParams)> {
    let text = format!(
        r#"{{"sandboxes": [{{"name": "s", "cores": [{core}], "mem_mib": {mem_mib}, "workload": {workload}}}], "channels": []}}"#
    );
    let config = SetConfig::parse(&text)?;
    let params = config.sandboxes[0].workload.params().map_err(anyhow::Error::msg)?;
    let (report, khz) = run_set(kvm, SetConfig::parse(&text)?, "the workload")?;
    let s = &report.sandboxes[0];
    Ok((s.ops as f64 / s.cycles.max(1) as f64, khz, params))
}

pub fn table2(a: &BenchSandboxArgs) -> Result<Table2> {
    let host = nl_sandbox::affinity::host_cores()?;
    let kvm = nl_vmm::open_kvm()?;
    let loadavg_before = loadavg();
    let (mut sb, mut plain, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
    for rep in 0..a.reps {
        eprintln!("bench sandbox: Table 2 repetition {}/{}", rep + 1, a.reps);
        let w = format!(
            r#"{{"kind": "syscall", "seed": {}, "duration_ms": {}}}"#,
            21 + rep,
            a.duration_ms
        );
        let (s, khz, params) = sandbox_ops_per_cycle(&kvm, host[0], 64, &w)?;
        let p = plain_vm_ops_per_cycle(&kvm, host[0], params)?;
        let per_sec = |x: f64| x * khz as f64 * 1e3;
        sb.push(per_sec(s));
        plain.push(per_sec(p));
        ratio.push(s / p);
    }
    Ok(Table2 {
        reps: a.reps,
        sandbox_ops_per_sec: spread(sb.clone()),
        plain_ops_per_sec: spread(plain.clone()),
        ratio: spread(ratio),
        sandbox_samples: sb,
        plain_samples: plain,
        paper_ratio: 1.0 / 1.019,
        target_within: 0.02,
        loadavg_before,
        loadavg_after: loadavg(),
    })
}

/// The same tlbwalk natively on `core` (a thread pinned there): ns per access.
fn native_tlbwalk_ns(core: usize, params: nl_abi::WorkloadParams, ms: u64) -> Result<f64> {
    let t = std::thread::spawn(move || -> Result<f64> {
        nl_sandbox::affinity::pin(0, &[core])?;
        let r = nl_workloads::native::run_for(&params, 0, Duration::from_millis(ms), 0)
            .map_err(|e| anyhow::anyhow!("native tlbwalk refused: {e}"))?;
        Ok(r.measured_ns as f64 / r.ops.max(1) as f64)
    });
    t.join().map_err(|_| anyhow::anyhow!("the native tlbwalk thread panicked"))?
}

pub fn tlb(a: &BenchSandboxArgs) -> Result<Tlb> {
    let host = nl_sandbox::affinity::host_cores()?;
    let core = host[0];
    let kvm = nl_vmm::open_kvm()?;
    let loadavg_before = loadavg();
    for x in &a.tlb_access {
        if !["load", "fetch"].contains(&x.as_str()) {
            anyhow::bail!("--tlb-access {x}: `load` or `fetch`");
        }
    }
    let series: Vec<(&str, u64)> =
        a.tlb_access.iter().flat_map(|x| a.pages.iter().map(move |&p| (x.as_str(), p))).collect();
    let n = series.len();
    let (mut sb, mut nat) = (vec![Vec::new(); n], vec![Vec::new(); n]);
    for rep in 0..a.reps {
        eprintln!("bench sandbox: Figs. 7/8 repetition {}/{}", rep + 1, a.reps);
        for (i, &(access, pages)) in series.iter().enumerate() {
            let w = format!(
                r#"{{"kind": "tlbwalk", "seed": {}, "pages": {pages}, "access": "{access}", "duration_ms": {}}}"#,
                31 + rep,
                a.duration_ms
            );
            let mem_mib = 64 + (nl_workloads::tlbwalk_ws_bytes(pages) >> 20) + 1;
            let (per_cycle, khz, params) = sandbox_ops_per_cycle(&kvm, core, mem_mib, &w)?;
            sb[i].push(1e6 / (per_cycle * khz.max(1) as f64));
            nat[i].push(native_tlbwalk_ns(core, params, a.duration_ms)?);
        }
    }
    let rows = series
        .iter()
        .enumerate()
        .map(|(i, &(access, pages))| TlbRow {
            access: access.to_string(),
            pages,
            sandbox_ns: spread(sb[i].clone()),
            native_ns: spread(nat[i].clone()),
            ratio: spread(sb[i].iter().zip(&nat[i]).map(|(s, n)| s / n).collect()),
            sandbox_samples: sb[i].clone(),
            native_samples: nat[i].clone(),
        })
        .collect();
    Ok(Tlb {
        reps: a.reps,
        core,
        stride_bytes: nl_abi::TLBWALK_STRIDE,
        rows,
        target_within: 0.05,
        loadavg_before,
        loadavg_after: loadavg(),
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
    const PARTS: [&str; 9] = [
        "fig9",
        "budgets",
        "table2",
        "tlb",
        "isolation",
        "storm",
        "tapflood",
        "interrupts",
        "shared-driver",
    ];
    if let Some(p) = a.parts.iter().find(|p| !PARTS.contains(&p.as_str())) {
        bail!("unknown part '{p}' ({})", PARTS.join(", "));
    }
    if !(1..=100_000).contains(&a.pings) {
        bail!("--pings {} is not in 1..=100000", a.pings);
    }
    if !(100..=60_000).contains(&a.net_ms) {
        bail!("--net-ms {} is not in 100..=60000", a.net_ms);
    }
    if a.reps < 3 {
        bail!("--reps {} is fewer than 3", a.reps);
    }
    if let Some(&p) = a.pages.iter().find(|&&p| !(1..=nl_workloads::TLBWALK_MAX_PAGES).contains(&p))
    {
        bail!("--pages {p} is not in 1..={}", nl_workloads::TLBWALK_MAX_PAGES);
    }
    let part = |p: &str| a.parts.iter().any(|x| x == p);
    let s = |x: Spread, p: usize| format!("{:.p$} [{:.p$}, {:.p$}]", x.median, x.min, x.max);
    let fig9 = if part("fig9") { Some(measure(&a)?) } else { None };
    if let Some(f) = &fig9 {
        print_fig9(f);
    }
    let budgets = if part("budgets") { Some(budget_curves(&a)?) } else { None };
    if let Some(b) = &budgets {
        print_budgets(b);
    }
    let storm = if part("storm") { Some(storm(&a)?) } else { None };
    if let Some(st) = &storm {
        print_storm(st);
    }
    let tapflood = if part("tapflood") { Some(tapflood(&a)?) } else { None };
    if let Some(t) = &tapflood {
        print_tapflood(t);
    }
    let table3 = if part("interrupts") { Some(super::sandbox_shared::table3(&a)?) } else { None };
    if let Some(t) = &table3 {
        super::sandbox_shared::print_table3(t);
    }
    let fig11 = if part("shared-driver") { Some(super::sandbox_shared::fig11(&a)?) } else { None };
    if let Some(f) = &fig11 {
        super::sandbox_shared::print_fig11(f);
    }
    let t2 = if part("table2") { Some(table2(&a)?) } else { None };
    if let Some(t2) = &t2 {
        println!(
            "Table 2, syscall workload ({} null syscalls per round with ring-3 work), core {}, {} repetitions interleaved (median [min, max]):",
            nl_workloads::SYSCALL_PER_ROUND,
            nl_sandbox::affinity::host_cores()?[0],
            t2.reps
        );
        println!(
            "  sandbox {} syscalls/s, plain VM {} syscalls/s, sandbox/plain {} (paper: {:.3}, +1.9% time; target within {:.0}%)",
            s(t2.sandbox_ops_per_sec, 0),
            s(t2.plain_ops_per_sec, 0),
            s(t2.ratio, 3),
            t2.paper_ratio,
            t2.target_within * 100.0
        );
        println!("  load average before: {}; after: {}", t2.loadavg_before, t2.loadavg_after);
    }
    let tl = if part("tlb") { Some(tlb(&a)?) } else { None };
    if let Some(tl) = &tl {
        println!(
            "Figs. 7/8, tlbwalk (one access per page at a {}-byte stride: a checked load, Fig. 7, or a fetched `add; jmp`, Fig. 8) on core {}, sandbox against native, {} repetitions interleaved (median [min, max]):",
            tl.stride_bytes, tl.core, tl.reps
        );
        println!(
            "{:>6}  {:>7}  {:>24}  {:>24}  {:>24}",
            "access", "pages", "ns/access sandbox", "ns/access native", "sandbox/native"
        );
        for r in &tl.rows {
            println!(
                "{:>6}  {:>7}  {:>24}  {:>24}  {:>24}",
                r.access,
                r.pages,
                s(r.sandbox_ns, 2),
                s(r.native_ns, 2),
                s(r.ratio, 3)
            );
        }
        println!(
            "  paper (Figs. 7/8, plots): sandboxes within {:.0}% of native up to 512 pages; load average before: {}; after: {}",
            tl.target_within * 100.0,
            tl.loadavg_before,
            tl.loadavg_after
        );
    }
    let iso = if part("isolation") { Some(isolation(a.seeds)?) } else { None };
    if let Some(iso) = &iso {
        println!(
            "Isolation (Fig. 10): {} wildwrite seeds, {} clean; {} bytes changed in the neighbour; {} writes aimed at read-only pages, {} reported",
            iso.seeds, iso.clean_seeds, iso.changed_bytes, iso.aimed_readonly, iso.reported
        );
        for r in iso.runs.iter().filter(|r| !r.clean()) {
            println!("  seed {}: not clean: {r:?}", r.seed);
        }
    }
    let clean = iso.as_ref().is_none_or(|i| i.clean_seeds == i.seeds);
    if a.json {
        let budget = storm.as_ref().and_then(|st| st.arms.first()).and_then(|arm| {
            let (r, p) = arm.reservation?;
            Some(BudgetRow { share: arm.periodic.mean_share, target: r as f64 / p as f64 })
        });
        let all = BenchSandbox {
            budget,
            budgets,
            storm,
            tapflood,
            table3,
            fig11,
            fig9,
            table2: t2,
            tlb: tl,
            isolation: iso,
        };
        println!("{}", serde_json::to_string(&all)?);
    }
    Ok(if clean { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

fn print_fig9(f: &Fig9) {
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
    if let Some(d) = &f.doorbell {
        println!(
            "doorbell round trip (64 B, halting receivers woken by ioeventfd->irqfd): {} us median [min, max over reps]; best single {:.1} us; {:.0}% of halts ended by the doorbell; polled 64 B round trip {} us (target < {:.0} us)",
            s(d.doorbell_rtt_us, 1),
            d.doorbell_rtt_min_us.min,
            d.woken_share.median * 100.0,
            s(d.polled_rtt_64b_us, 2),
            d.target_doorbell_rtt_us
        );
    }
    println!("load average before: {}; after: {}", f.loadavg_before, f.loadavg_after);
}

/// The storm's arms: the periodic sandbox with its reservation beside the
/// capped storm, and without a reservation (the storm still capped), per
/// repetition interleaved.
pub fn storm(a: &BenchSandboxArgs) -> Result<Storm> {
    use nl_sandbox::periodic::StormSet;
    let core = nl_sandbox::affinity::host_cores()?[0];
    let arms = [
        (
            "reserved 7 ms/10 ms, storm capped 1 ms/10 ms",
            Some((7_000, PERIOD_US)),
            Some((1_000, PERIOD_US)),
        ),
        ("no reservation, storm capped 1 ms/10 ms", None, Some((1_000, PERIOD_US))),
    ];
    let loadavg_before = loadavg();
    let kvm = nl_vmm::open_kvm()?;
    type Sample = (
        nl_sandbox::periodic::PeriodReport,
        u64,
        u64,
        Option<nl_sandbox::reserve::ReserveStats>,
        Option<u64>,
    );
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); arms.len()];
    for _ in 0..a.reps {
        for (k, (what, reservation, storm_budget)) in arms.iter().enumerate() {
            let set = StormSet {
                core,
                period_us: PERIOD_US,
                need_us: NEED_US,
                reservation: *reservation,
                storm_budget: *storm_budget,
                duration_ms: a.storm_ms,
            };
            let probe = crate::stalls::StallProbe::start_if(a.stall_probe, &[core]);
            let (report, _) = run_set(&kvm, SetConfig::parse(&set.config())?, what)?;
            let stalls = probe.finish();
            let stalls = stalls.ran().then(|| stalls.stalls().len() as u64);
            let p = report.sandboxes[0].periods.clone().ok_or_else(|| {
                anyhow::anyhow!("{what}: the periodic sandbox reported no periods")
            })?;
            let st = &report.sandboxes[1];
            let throttled = st.throttling.map_or(0, |t| t.throttled_periods);
            let reserved = report.sandboxes[0].throttling.and_then(|t| t.reserved);
            samples[k].push((p, st.ops, throttled, reserved, stalls));
        }
    }
    let secs = a.storm_ms as f64 / 1e3;
    let arms = arms
        .iter()
        .zip(samples)
        .map(|((what, reservation, storm_budget), v)| StormArm {
            what: what.to_string(),
            reservation: *reservation,
            storm_budget: *storm_budget,
            periodic: periodic_shares(&v.iter().map(|s| (&s.0, s.3.as_ref())).collect::<Vec<_>>()),
            storm_rings_per_sec: spread(v.iter().map(|s| s.1 as f64 / secs).collect()),
            storm_throttled_periods: spread(v.iter().map(|s| s.2 as f64).collect()),
            host_core_stalls: v
                .iter()
                .map(|s| s.4.map(|n| n as f64))
                .collect::<Option<Vec<f64>>>()
                .map(spread),
            reserved: v.iter().filter_map(|s| s.3).collect(),
            samples: v.into_iter().map(|s| s.0).collect(),
        })
        .collect();
    Ok(Storm {
        reps: a.reps,
        core,
        period_us: PERIOD_US,
        need_us: NEED_US,
        arms,
        loadavg_before,
        loadavg_after: loadavg(),
    })
}

fn print_storm(st: &Storm) {
    let s = |x: Spread, p: usize| format!("{:.p$} [{:.p$}, {:.p$}]", x.median, x.min, x.max);
    println!(
        "Budget storm: a periodic sandbox needing {} us of every {} us (guest TSC accounting) beside a sandbox ringing its doorbell, both on core {}, {} repetitions interleaved (median [min, max]):",
        st.need_us, st.period_us, st.core, st.reps
    );
    for arm in &st.arms {
        println!(
            "  {}: worst period / need {}, periods that got it {}, mean CPU share {}; storm {} rings/s, {} periods throttled{}",
            arm.what,
            s(arm.periodic.worst_over_need, 3),
            s(arm.periodic.met_share, 3),
            s(arm.periodic.mean_share, 3),
            s(arm.storm_rings_per_sec, 0),
            s(arm.storm_throttled_periods, 0),
            arm.host_core_stalls
                .map(|h| format!("; host core stalls over 20 ms {} (--stall-probe)", s(h, 0)))
                .unwrap_or_default()
        );
        if let (Some(w), Some(m), Some(l)) = (
            arm.periodic.host_worst_over_runtime,
            arm.periodic.host_met_share,
            arm.periodic.host_late_windows,
        ) {
            println!(
                "    host account of its reservation's windows: worst window / runtime {}, windows that gave the runtime {}, windows opened > 200 us late {}",
                s(w, 3),
                s(m, 3),
                s(l, 0)
            );
        }
    }
    println!(
        "  issue's target: the periodic sandbox never drops below its reservation (guest worst / need >= 1; host worst window / runtime >= 0.99); load average before: {}; after: {}",
        st.loadavg_before, st.loadavg_after
    );
}

fn chanstream_pair(
    cores: [usize; 2],
    budget: (u64, u64),
    ms: u64,
    echo_us: u64,
) -> Result<SetConfig> {
    let (r, p) = budget;
    let text = format!(
        r#"{{"sandboxes": [
            {{"name": "tx", "cores": [{}], "mem_mib": 48, "budget": {{"runtime_us": {r}, "period_us": {p}, "reserve": true}},
              "workload": {{"kind": "chanstream", "duration_ms": {ms}, "send_every_us": 0}}}},
            {{"name": "rx", "cores": [{}], "mem_mib": 48,
              "workload": {{"kind": "chanstream", "duration_ms": {ms}, "send_every_us": {echo_us}}}}}
        ], "channels": [{{"name": "c", "between": ["tx", "rx"]}}]}}"#,
        cores[0], cores[1]
    );
    Ok(SetConfig::parse(&text)?)
}

/// One budget-curve run: the messages per second the receiver got from
/// the budgeted sender over a window of `ms` while both stream, the
/// sender's host CPU share over it, and its reservation's windows.
struct StreamSample {
    msgs_per_sec: f64,
    tx_drained_per_sec: f64,
    tx_cpu_share: f64,
    reserved: Option<nl_sandbox::reserve::ReserveStats>,
}

/// Runs the pair as services (until stopped) and measures a window once
/// both stream: the sender boots under its budget (the guest kernel is
/// emulated, slow at 20% of a core), so the workload's own duration would
/// count its boot against it (the first version's Low run ended before its
/// sender had booted: "0 messages").
fn stream_window(
    kvm: &nl_sandbox::Kvm,
    cores: [usize; 2],
    budget: (u64, u64),
    ms: u64,
    echo_us: u64,
) -> Result<StreamSample> {
    use std::sync::atomic::Ordering::Relaxed;
    let set = SandboxSet::create(
        kvm,
        chanstream_pair(cores, budget, 0, echo_us)?,
        &nl_launch::guest::sandbox_images(),
    )?;
    set.start_all()?;
    let regs = |name: &str| set.get(name).map(|sb| sb.vm().control().clone());
    let (Some(tx), Some(rx)) = (regs("tx"), regs("rx")) else {
        bail!("the chanstream pair has no tx or rx sandbox");
    };
    let tid = set
        .get("tx")
        .and_then(|sb| sb.vm().vcpu_threads().first().cloned().flatten())
        .map_or(0, |t| t.tid);
    let (measured, report) = std::thread::scope(|s| {
        let supervisor = s.spawn(|| set.supervise(Duration::from_secs(600)));
        let measured = (|| {
            // Both stream once the receiver counts messages from the
            // sender (bounded: 120 s for the budgeted boot), then 200 ms
            // to settle.
            let t = std::time::Instant::now();
            while rx.vcpus[0].ops.load(Relaxed) == 0 {
                if t.elapsed() > Duration::from_secs(120) || supervisor.is_finished() {
                    bail!("the receiver got no message from the sender within 120 s");
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            std::thread::sleep(Duration::from_millis(200));
            let cpu = || nl_sandbox::periodic::thread_cpu_ns(tid).unwrap_or(0);
            // The guests publish what they received (OPS) every 2 ms.
            let (rx_ops, tx_ops) = (&rx.vcpus[0].ops, &tx.vcpus[0].ops);
            let (t0, rx0, tx0, cpu0) =
                (std::time::Instant::now(), rx_ops.load(Relaxed), tx_ops.load(Relaxed), cpu());
            std::thread::sleep(Duration::from_millis(ms));
            let (dt, rx1, tx1, cpu1) =
                (t0.elapsed(), rx_ops.load(Relaxed), tx_ops.load(Relaxed), cpu());
            let errors = rx.vcpus[0].digest.load(Relaxed) + tx.vcpus[0].digest.load(Relaxed);
            if errors != 0 {
                bail!("{errors} messages were corrupt, lost or duplicated");
            }
            Ok((
                rx1.saturating_sub(rx0) as f64 / dt.as_secs_f64(),
                tx1.saturating_sub(tx0) as f64 / dt.as_secs_f64(),
                cpu1.saturating_sub(cpu0) as f64 / dt.as_nanos() as f64,
            ))
        })();
        set.request_stop();
        let report = supervisor.join().map_err(|_| anyhow::anyhow!("the supervisor panicked"));
        (measured, report)
    });
    let (msgs_per_sec, tx_drained_per_sec, tx_cpu_share) = measured?;
    let report = report?;
    let reserved = report
        .sandboxes
        .iter()
        .find(|s| s.name == "tx")
        .and_then(|s| s.throttling)
        .and_then(|t| t.reserved);
    Ok(StreamSample { msgs_per_sec, tx_drained_per_sec, tx_cpu_share, reserved })
}

/// Fig. 9's Hi and Low budget curves: 64-byte chanstream messages from a
/// sender under a reserved Hi (5 ms/10 ms) or Low (2 ms/10 ms) budget to a
/// receiver on the other core, interleaved per repetition.
pub fn budget_curves(a: &BenchSandboxArgs) -> Result<BudgetCurves> {
    let host = nl_sandbox::affinity::host_cores()?;
    let cores = [host[0], *host.last().unwrap_or(&host[0])];
    let (hi, low) = ((5_000, 10_000), (2_000, 10_000));
    let loadavg_before = loadavg();
    let kvm = nl_vmm::open_kvm()?;
    let (mut his, mut lows) = (Vec::new(), Vec::new());
    for _ in 0..a.reps {
        for (b, out) in [(hi, &mut his), (low, &mut lows)] {
            out.push(stream_window(&kvm, cores, b, a.storm_ms, a.budget_echo_us)?);
        }
    }
    let share = |b: (u64, u64)| b.0 as f64 / b.1 as f64;
    let rate = |v: &[StreamSample]| v.iter().map(|x| x.msgs_per_sec).collect::<Vec<_>>();
    let (hr, lr) = (rate(&his), rate(&lows));
    Ok(BudgetCurves {
        reps: a.reps,
        cores,
        hi,
        low,
        echo_us: a.budget_echo_us,
        hi_tx_drained_per_sec: spread(his.iter().map(|x| x.tx_drained_per_sec).collect()),
        low_tx_drained_per_sec: spread(lows.iter().map(|x| x.tx_drained_per_sec).collect()),
        throughput_ratio: spread(hr.iter().zip(&lr).map(|(h, l)| h / l.max(1.0)).collect()),
        budget_ratio: share(hi) / share(low),
        hi_msgs_per_budget_sec: spread(hr.iter().map(|h| h / share(hi)).collect()),
        low_msgs_per_budget_sec: spread(lr.iter().map(|l| l / share(low)).collect()),
        hi_msgs_per_sec: spread(hr),
        low_msgs_per_sec: spread(lr),
        hi_tx_cpu_share: spread(his.iter().map(|x| x.tx_cpu_share).collect()),
        low_tx_cpu_share: spread(lows.iter().map(|x| x.tx_cpu_share).collect()),
        reserved: his.iter().chain(&lows).filter_map(|x| x.reserved).collect(),
        loadavg_before,
        loadavg_after: loadavg(),
    })
}

fn print_budgets(b: &BudgetCurves) {
    let s = |x: Spread, p: usize| format!("{:.p$} [{:.p$}, {:.p$}]", x.median, x.min, x.max);
    println!(
        "Fig. 9 Hi/Low: 64 B chanstream messages from a sender on core {} under a reserved budget to a receiver on core {}, {} repetitions interleaved (median [min, max]):",
        b.cores[0], b.cores[1], b.reps
    );
    println!(
        "  Hi ({} us/{} us): {} msgs/s ({} per budget-second); Low ({} us/{} us): {} msgs/s ({} per budget-second)",
        b.hi.0,
        b.hi.1,
        s(b.hi_msgs_per_sec, 0),
        s(b.hi_msgs_per_budget_sec, 0),
        b.low.0,
        b.low.1,
        s(b.low_msgs_per_sec, 0),
        s(b.low_msgs_per_budget_sec, 0)
    );
    println!(
        "  the sender's host CPU share: Hi {}, Low {}",
        s(b.hi_tx_cpu_share, 3),
        s(b.low_tx_cpu_share, 3)
    );
    println!(
        "  the receiver sends back one message every {} us (0: as fast as it can); the sender drained from it: Hi {} msgs/s, Low {} msgs/s",
        b.echo_us,
        s(b.hi_tx_drained_per_sec, 0),
        s(b.low_tx_drained_per_sec, 0)
    );
    println!(
        "  Hi / Low throughput {} against a budget ratio of {:.2}; load average before: {}; after: {}",
        s(b.throughput_ratio, 2),
        b.budget_ratio,
        b.loadavg_before,
        b.loadavg_after
    );
}

/// One arm of the TAP flood: the periodic sandbox's periods (as in the
/// storm's rows) and what the flood cost the flooded sandbox's receive
/// thread.
#[derive(Clone, Debug, Serialize)]
pub struct TapFloodArm {
    pub what: String,
    pub reservation: Option<(u64, u64)>,
    pub flooded_budget: Option<(u64, u64)>,
    pub io_budget: Option<(u64, u64)>,
    #[serde(flatten)]
    pub periodic: PeriodicShares,
    /// Per repetition: datagrams sent per second, the receive thread's CPU
    /// over the flood's wall time, and the io cgroup's throttled periods.
    pub sent_per_sec: Spread,
    pub netrx_cpu_share: Spread,
    pub io_throttled_periods: Spread,
    pub reserved: Vec<nl_sandbox::reserve::ReserveStats>,
}

#[derive(Clone, Debug, Serialize)]
pub struct TapFlood {
    pub reps: usize,
    pub core: usize,
    pub period_us: u64,
    pub need_us: u64,
    pub flood_ms: u64,
    pub arms: Vec<TapFloodArm>,
    pub loadavg_before: String,
    pub loadavg_after: String,
}

/// One TAP-flood run: (periods, reservation windows, sent, flood wall
/// time, the receive thread's CPU in it (ns), io throttled periods).
type FloodSample = (
    nl_sandbox::periodic::PeriodReport,
    Option<nl_sandbox::reserve::ReserveStats>,
    u64,
    Duration,
    u64,
    u64,
);

fn flood_run(
    kvm: &nl_sandbox::Kvm,
    set: &nl_sandbox::periodic::TapFloodSet,
    sender_core: usize,
    flood_ms: u64,
) -> Result<FloodSample> {
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
    use std::time::Instant;
    let ns = crate::netns::Netns::with_tap(
        &format!("nl-bench-tapflood-{}", std::process::id()),
        &set.tap,
    )?;
    ns.run_in(|| {
        let s = SandboxSet::create(
            kvm,
            SetConfig::parse(&set.config())?,
            &nl_launch::guest::sandbox_images(),
        )?;
        s.start_all()?;
        std::thread::scope(|scope| {
            let h = scope.spawn(|| s.supervise(Duration::from_secs(300)));
            let body = || -> Result<(u64, Duration, u64)> {
                // Bounded: 600 tries, 90 s.
                if !crate::ping::answers_within("10.0.0.2:7".parse()?, Duration::from_secs(90)) {
                    bail!("the flooded sandbox never answered");
                }
                let periodic = s.get("periodic").expect("periodic");
                if periodic.vm().poll_outcome().is_some() {
                    bail!("the periodic sandbox ended before the flood (raise --storm-ms)");
                }
                let tid = s.get("flooded").expect("flooded").vm().io_threads()[0];
                let cpu0 = nl_sandbox::periodic::thread_cpu_ns(tid).unwrap_or(0);
                let t0 = Instant::now();
                let stop = AtomicBool::new(false);
                let sent = std::thread::scope(|sc| {
                    sc.spawn(|| {
                        let _ = nl_sandbox::affinity::pin(0, &[sender_core]);
                        let sock = std::net::UdpSocket::bind("10.0.0.1:0")?;
                        let mut sent = 0u64;
                        // Bounded: 20 M datagrams or flood_ms.
                        for i in 0..20_000_000u64 {
                            if i % 1024 == 0
                                && (stop.load(Relaxed)
                                    || t0.elapsed().as_millis() as u64 >= flood_ms)
                            {
                                break;
                            }
                            sent += u64::from(sock.send_to(&[0x5a; 18], "10.0.0.2:9").is_ok());
                        }
                        anyhow::Ok(sent)
                    })
                    .join()
                    .map_err(|_| anyhow::anyhow!("the sender panicked"))?
                })?;
                let window = t0.elapsed();
                let cpu = nl_sandbox::periodic::thread_cpu_ns(tid).unwrap_or(cpu0) - cpu0;
                // The periodic sandbox ends by itself (bounded: 120 s).
                for _ in 0..1200 {
                    if periodic.vm().poll_outcome().is_some() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                Ok((sent, window, cpu))
            };
            let r = body();
            s.request_stop();
            let report = h.join().map_err(|_| anyhow::anyhow!("supervision panicked"))?;
            let (sent, window, cpu) = r?;
            let p = &report.sandboxes[0];
            if !p.verified {
                bail!("the periodic sandbox did not verify: {} {:?}", p.message, p.problem);
            }
            let periods = p
                .periods
                .clone()
                .ok_or_else(|| anyhow::anyhow!("the periodic sandbox reported no periods"))?;
            let io = report.sandboxes[1].throttling.and_then(|t| t.io);
            Ok((
                periods,
                p.throttling.and_then(|t| t.reserved),
                sent,
                window,
                cpu,
                io.map_or(0, |i| i.throttled_periods),
            ))
        })
    })
}

/// The TAP flood's arms (issue 18's "a sandbox flooding its TAP"): the
/// reserved periodic sandbox beside a netbench sandbox with a receive
/// thread whose TAP the host floods, with and without an io budget, per
/// repetition interleaved.
pub fn tapflood(a: &BenchSandboxArgs) -> Result<TapFlood> {
    use nl_sandbox::periodic::TapFloodSet;
    let cores = nl_sandbox::affinity::host_cores()?;
    let (core, sender_core) = (cores[0], *cores.last().expect("a core"));
    let reservation = Some((7_000, PERIOD_US));
    let flooded = Some((1_000, PERIOD_US));
    let arms = [
        ("reserved 7 ms/10 ms, io budget 1 ms/100 ms", Some((1_000, 100_000))),
        ("reserved 7 ms/10 ms, no io budget", None),
    ];
    let loadavg_before = loadavg();
    let kvm = nl_vmm::open_kvm()?;
    let mut samples: Vec<Vec<FloodSample>> = vec![Vec::new(); arms.len()];
    for _ in 0..a.reps {
        for (k, (_, io)) in arms.iter().enumerate() {
            let set = TapFloodSet {
                core,
                period_us: PERIOD_US,
                need_us: NEED_US,
                reservation,
                flooded_budget: flooded,
                io_budget: *io,
                // Its boot and the flooded sandbox's, then the flood.
                duration_ms: a.storm_ms * 2 + 6_000,
                tap: "nltap0".into(),
            };
            samples[k].push(flood_run(&kvm, &set, sender_core, a.storm_ms)?);
        }
    }
    let arms = arms
        .iter()
        .zip(samples)
        .map(|((what, io), v)| TapFloodArm {
            what: what.to_string(),
            reservation,
            flooded_budget: flooded,
            io_budget: *io,
            periodic: periodic_shares(&v.iter().map(|s| (&s.0, s.1.as_ref())).collect::<Vec<_>>()),
            sent_per_sec: spread(v.iter().map(|s| s.2 as f64 / s.3.as_secs_f64()).collect()),
            netrx_cpu_share: spread(
                v.iter().map(|s| s.4 as f64 / s.3.as_nanos().max(1) as f64).collect(),
            ),
            io_throttled_periods: spread(v.iter().map(|s| s.5 as f64).collect()),
            reserved: v.iter().filter_map(|s| s.1).collect(),
        })
        .collect();
    Ok(TapFlood {
        reps: a.reps,
        core,
        period_us: PERIOD_US,
        need_us: NEED_US,
        flood_ms: a.storm_ms,
        arms,
        loadavg_before,
        loadavg_after: loadavg(),
    })
}

fn print_tapflood(t: &TapFlood) {
    let s = |x: Spread, p: usize| format!("{:.p$} [{:.p$}, {:.p$}]", x.median, x.min, x.max);
    println!(
        "TAP flood: a periodic sandbox needing {} us of every {} us beside a netbench sandbox (vCPU budget 1 ms/10 ms, receive thread) whose TAP the host floods for {} ms, both on core {}, {} repetitions interleaved (median [min, max]):",
        t.need_us, t.period_us, t.flood_ms, t.core, t.reps
    );
    for arm in &t.arms {
        println!(
            "  {}: worst period / need {}, periods that got it {}, mean CPU share {}; {} datagrams/s sent, receive thread CPU share {}, io periods throttled {}",
            arm.what,
            s(arm.periodic.worst_over_need, 3),
            s(arm.periodic.met_share, 3),
            s(arm.periodic.mean_share, 3),
            s(arm.sent_per_sec, 0),
            s(arm.netrx_cpu_share, 4),
            s(arm.io_throttled_periods, 0)
        );
        if let (Some(w), Some(m)) =
            (arm.periodic.host_worst_over_runtime, arm.periodic.host_met_share)
        {
            println!(
                "    host account of its reservation's windows: worst window / runtime {}, windows that gave the runtime {}",
                s(w, 3),
                s(m, 3)
            );
        }
    }
    println!("  load average before: {}; after: {}", t.loadavg_before, t.loadavg_after);
}
