//! `ninelives bench replicate`: throughput under replication relative to the
//! unreplicated VM measured in the same run (memwrite sequential and random
//! over 64 MiB, sequential over 8 MiB, blkbench with its disk replicated, kv
//! under kvload), per optimization and epoch length; and a kill campaign:
//! primaries running kv killed mid-epoch or mid-send while kvload checks
//! that no acknowledged write is lost and a 1 ms UDP ping (`ninelives ping`
//! at the guest's echo port) measures the longest gap in replies across the
//! kill and the backup's takeover.
//!
//! memwrite and blkbench run on loopback with the backup in this process. kv and the
//! kill campaign need root: three network namespaces of the
//! bench's own. P (primary) and B (backup) are joined by a veth
//! (10.9.0.1 - 10.9.0.2) for the replication stream; each holds a bridge
//! with a persistent TAP for the guest and a veth to the client namespace C,
//! whose bridge carries 10.0.0.1/24 (the guest is 10.0.0.2). Bridges flood
//! (ageing 0), and a TAP with no VMM attached has no carrier, so frames
//! reach whichever copy of the guest runs: the backup takes the guest's
//! network identity over by attaching to its TAP. Only those addresses are
//! used; the VMMs and kvload are this binary, started inside their namespace (`setns`).

use std::net::{SocketAddr, TcpListener};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use nl_replicate::auth::Key;
use nl_replicate::backup::{serve, BackupConfig, BackupEnd, HANDSHAKE_TIME};
use nl_vmm::{Vm, VmOutcome};
use serde::Serialize;

use crate::netns::Netns;
use crate::ping::{gap_across, lost, PingRun};
use crate::process::Proc;
use crate::stats::median;
use nl_launch::args::{MachineArgs, PatternName, WorkloadArgs, WorkloadName};
use nl_launch::guest;
use nl_launch::replicate::{run_primary, PrimaryArgs, PrimaryRun};
use nl_launch::verify::verify_vcpus;

#[derive(Args, Clone, Debug)]
pub struct BenchReplicateArgs {
    /// Seconds per memwrite run (and per kvload run of the kv rows).
    #[arg(long, default_value_t = 1.5)]
    pub duration: f64,
    /// Epoch lengths (ms) for the sweep of the defaults (the other rows run at 20 ms).
    #[arg(long, value_delimiter = ',', default_values_t = vec![20u64, 50, 100, 200])]
    pub epochs: Vec<u64>,
    /// Epochs in flight at most in the pipelined rows.
    #[arg(long, default_value_t = 2)]
    pub pipeline: u32,
    /// Primary kills in the kill campaign (kv under kvload; 0: skip).
    /// Even kills are SIGKILLs at a random time (mid-epoch), odd ones make the
    /// primary kill itself half-way through sending an epoch (mid-send).
    #[arg(long, default_value_t = 20)]
    pub kills: u32,
    /// Seconds of kvload per kill.
    #[arg(long, default_value_t = 3.0)]
    pub kill_load: f64,
    /// Kill campaign: the backups build the VM only in the takeover, not
    /// ahead of it (the old path, for comparison).
    #[arg(long, hide = true)]
    pub no_prebuild: bool,
    /// Kill campaign: the lease of both ends (ms, at least 200): how long
    /// the backup waits without a frame before it declares the primary
    /// gone, so most of the gap a client sees across a kill.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(200..))]
    pub kill_lease_ms: u64,
    /// The kill campaign under COLO (`--colo --net-rx-irq` on the primary,
    /// `--colo --net-rx-irq` on the backup): the secondary VM takes over.
    #[arg(long)]
    pub kill_colo: bool,
    /// Skip the throughput rows (only the kill campaign).
    #[arg(long)]
    pub no_throughput: bool,
    /// Skip the kv rows of the throughput part.
    #[arg(long)]
    pub no_kv: bool,
    /// Seed of the workloads' PRNG.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Repetitions of every throughput cell (at least 3): each repetition
    /// measures the unreplicated baseline, then every replicated cell, so
    /// cells and baseline interleave. Every sample is kept (`samples`);
    /// `rows` holds each cell's median-ratio sample with the spread.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(3..))]
    pub reps: u32,
    /// Only these throughput workloads (memwrite-sequential,
    /// memwrite-random, memwrite-sequential-8M, blkbench; default: all).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Print the results as one JSON object (last line of stdout).
    #[arg(long)]
    pub json: bool,
    /// Only the cells the report's HBFT figures read: the defaults, the
    /// unoptimized baseline (`--no-selective --no-predict`), Histase, and
    /// the epoch sweep of the defaults; kv: the defaults, the old rule of
    /// output-triggered epochs (`--output-epoch-ms 2 --output-spacing-rate
    /// 0`, every one 2 ms apart) and without them (`--no-output-epochs`)
    /// (`ninelives report --quick`).
    #[arg(long)]
    pub core: bool,
    /// Extra kv cells at 20 ms, each the `replicate primary` flags that
    /// change the defaults, e.g. `--kv-cell "--pipeline 1"`
    /// (repeatable; kept with --core).
    #[arg(long = "kv-cell", allow_hyphen_values = true)]
    pub kv_cells: Vec<String>,
    /// Extra throughput cells (memwrite, blkbench) at 20 ms, each the
    /// `replicate primary` flags that change the defaults, e.g. `--cell
    /// --compare --cell --auto-capture` (repeatable; kept with --core; a
    /// cell the run has already is not repeated).
    #[arg(long = "cell", allow_hyphen_values = true)]
    pub cells: Vec<String>,
    /// Run the throughput rows (kv too) beside busy-loop threads of the
    /// bench's own; the kill campaign runs without them.
    #[arg(long)]
    pub loaded: bool,
    /// --loaded: busy-loop threads started for the load.
    #[arg(long, default_value_t = 2)]
    pub hogs: u32,
}

/// A throughput row over its repetitions: the ratio's median and spread,
/// the lower bound this host's unit costs imply at the row's pages per
/// epoch, and the median's share of that bound.
#[derive(Serialize)]
struct Summary {
    workload: &'static str,
    config: String,
    epoch_ms: u64,
    reps: usize,
    verified: usize,
    ratio_median: f64,
    ratio_min: f64,
    ratio_max: f64,
    pages_per_epoch: f64,
    /// [`super::unit_costs::UnitCosts::replication_bound`] with the row's
    /// median pages per epoch as both the pages written and the pages
    /// allocated (so the compare capture's scan is underestimated: the
    /// bound stays a bound).
    bound: f64,
    /// ratio_median / bound (1: at the bound).
    of_bound: f64,
}

#[derive(Clone, Serialize)]
struct Row {
    workload: &'static str,
    /// The cell: "default", or the `replicate primary` flags that change
    /// the defaults.
    config: String,
    epoch_ms: u64,
    pipeline: u32,
    ok: bool,
    /// Which repetition this sample is (0-based); in `rows`, the median's.
    rep: u32,
    /// In `rows`: the cell's ratio in every repetition, in run order, and
    /// their spread (empty / NaN in `samples`).
    ratio_samples: Vec<f64>,
    ratio_min: f64,
    ratio_max: f64,
    ops_per_sec: f64,
    unreplicated_ops_per_sec: f64,
    ratio: f64,
    epochs: u64,
    /// Average time between epoch boundaries (longer than the epoch when
    /// the backup falls behind and the boundary waits).
    interval_ms_avg: f64,
    pages_per_epoch: f64,
    write_faults_per_epoch: f64,
    pause_ms_avg: f64,
    pause_ms_max: f64,
    collect_ms_avg: f64,
    copy_ms_avg: f64,
    state_ms_avg: f64,
    send_in_pause_ms_avg: f64,
    /// Shares of the pause spent copying pages and sending.
    copy_share_of_pause: f64,
    send_share_of_pause: f64,
    send_after_ms_avg: f64,
    ack_wait_ms_avg: f64,
    stall_ms_avg: f64,
    commit_ms_avg: f64,
    commit_ms_max: f64,
    /// Output commit of the guest's frames (kv: the phases of a reply):
    /// epochs with frames, epochs ended early because frames waited, from
    /// the oldest held frame to the boundary and to the release, and from a
    /// release to the next held frame (client and guest turnaround).
    output_epochs: u64,
    output_triggered_epochs: u64,
    output_spaced_epochs: u64,
    output_wait_ms_avg: f64,
    output_wake_ms_avg: f64,
    stop_ms_avg: f64,
    output_stop_ms_avg: f64,
    output_held_ms_avg: f64,
    turnaround_ms_avg: f64,
    predicted_per_epoch: f64,
    fake_dirty_per_epoch: f64,
    precision: Option<f64>,
    recall: Option<f64>,
    /// The predictor's gate: epochs on and off, times it turned itself off,
    /// probed, and stayed on after a probe (null without prediction).
    prediction_gate: serde_json::Value,
    /// The compare capture (`--compare`): pages compared per epoch and the
    /// scan's time per epoch, in the pause (null without it).
    compared_per_epoch: Option<f64>,
    compare_ms_avg: Option<f64>,
    /// `--auto-capture`: epochs on the log and on the compare, switches.
    auto_capture: serde_json::Value,
    /// `--colo`: frames released by the comparison and by epochs.
    colo: serde_json::Value,
}

/// A row from a primary's report (as JSON: the kv primaries are processes).
fn row(
    workload: &'static str,
    config: &str,
    epoch: u64,
    ok: bool,
    ops: f64,
    base: f64,
    p: &serde_json::Value,
) -> Row {
    let f = |k: &str| p[k].as_f64().unwrap_or(f64::NAN);
    let share = |x: f64| if f("pause_ms_avg") > 0.0 { x / f("pause_ms_avg") } else { 0.0 };
    Row {
        workload,
        config: config.to_string(),
        epoch_ms: epoch,
        pipeline: p["options"]["pipeline"].as_u64().unwrap_or(0) as u32,
        ok,
        rep: 0,
        ratio_samples: Vec::new(),
        ratio_min: f64::NAN,
        ratio_max: f64::NAN,
        ops_per_sec: ops,
        unreplicated_ops_per_sec: base,
        ratio: if base > 0.0 { ops / base } else { 0.0 },
        epochs: p["epochs"].as_u64().unwrap_or(0),
        interval_ms_avg: f("interval_ms_avg"),
        pages_per_epoch: f("pages_per_epoch"),
        write_faults_per_epoch: f("write_faults_per_epoch"),
        pause_ms_avg: f("pause_ms_avg"),
        pause_ms_max: f("pause_ms_max"),
        collect_ms_avg: f("collect_ms_avg"),
        copy_ms_avg: f("copy_ms_avg"),
        state_ms_avg: f("state_ms_avg"),
        send_in_pause_ms_avg: f("send_in_pause_ms_avg"),
        copy_share_of_pause: share(f("copy_ms_avg")),
        send_share_of_pause: share(f("send_in_pause_ms_avg")),
        send_after_ms_avg: f("send_after_ms_avg"),
        ack_wait_ms_avg: f("ack_wait_ms_avg"),
        stall_ms_avg: f("stall_ms_avg"),
        commit_ms_avg: f("commit_ms_avg"),
        commit_ms_max: f("commit_ms_max"),
        output_epochs: p["output_epochs"].as_u64().unwrap_or(0),
        output_triggered_epochs: p["output_triggered_epochs"].as_u64().unwrap_or(0),
        output_spaced_epochs: p["output_spaced_epochs"].as_u64().unwrap_or(0),
        output_wait_ms_avg: f("output_wait_ms_avg"),
        output_wake_ms_avg: f("output_wake_ms_avg"),
        stop_ms_avg: f("stop_ms_avg"),
        output_stop_ms_avg: f("output_stop_ms_avg"),
        output_held_ms_avg: f("output_held_ms_avg"),
        turnaround_ms_avg: f("turnaround_ms_avg"),
        predicted_per_epoch: f("predicted_per_epoch"),
        fake_dirty_per_epoch: f("fake_dirty_per_epoch"),
        precision: p["precision"].as_f64(),
        recall: p["recall"].as_f64(),
        prediction_gate: p["prediction_gate"].clone(),
        compared_per_epoch: p["compared_per_epoch"].as_f64(),
        compare_ms_avg: p["compare_ms_avg"].as_f64(),
        auto_capture: p["auto_capture"].clone(),
        colo: p["colo"].clone(),
    }
}

/// A reply's phases under output commit (rows whose guest sent frames).
fn phases(r: &Row) -> String {
    if r.output_epochs == 0 {
        return String::new();
    }
    format!(
        "; replies: {} epochs with output ({} output-triggered, {} of them spaced), held {:.2} \
         ms = wait for the boundary {:.2} (wake-up {:.2}, vCPU stop {:.2}) + pause {:.2} + send \
         {:.2} + ack {:.2} (+ release), then {:.2} ms client/guest turnaround",
        r.output_epochs,
        r.output_triggered_epochs,
        r.output_spaced_epochs,
        r.output_held_ms_avg,
        r.output_wait_ms_avg,
        r.output_wake_ms_avg,
        r.output_stop_ms_avg,
        r.pause_ms_avg,
        r.send_after_ms_avg,
        r.ack_wait_ms_avg,
        r.turnaround_ms_avg
    )
}

fn print_row(r: &Row) {
    eprintln!(
        "{} {} @{} ms (pipeline {}): {:.3} of unreplicated ({:.3e} / {:.3e} ops/s), epoch every {:.1} ms, \
         {:.0} pages and {:.0} faults/epoch, pause {:.2} ms (copy {:.2} = {:.0}%, send {:.2} = {:.0}%), \
         send {:.2}, ack wait {:.2}, stall {:.2}, output held {:.1} ms{}{}{}{}",
        r.workload, r.config, r.epoch_ms, r.pipeline, r.ratio, r.ops_per_sec,
        r.unreplicated_ops_per_sec, r.interval_ms_avg, r.pages_per_epoch,
        r.write_faults_per_epoch, r.pause_ms_avg, r.copy_ms_avg, 100.0 * r.copy_share_of_pause,
        r.send_in_pause_ms_avg, 100.0 * r.send_share_of_pause, r.send_after_ms_avg,
        r.ack_wait_ms_avg, r.stall_ms_avg, r.commit_ms_avg,
        match (r.precision, r.recall) {
            (Some(p), Some(rc)) => format!(
                ", predicted {:.0}/epoch, precision {p:.2}, recall {rc:.2}, fake dirty {:.0}/epoch{}",
                r.predicted_per_epoch,
                r.fake_dirty_per_epoch,
                match &r.prediction_gate {
                    g if g.is_object() => format!(
                        ", prediction on {} / off {} epochs (off {}x, probes {}, back on {}x)",
                        g["epochs_on"], g["epochs_off"], g["disabled"], g["probes"], g["reenabled"]
                    ),
                    _ => String::new(),
                }
            ),
            _ => String::new(),
        },
        match (r.compared_per_epoch, r.compare_ms_avg) {
            (Some(n), Some(t)) => format!(", compared {n:.0} pages/epoch in {t:.2} ms"),
            _ => String::new(),
        } + &match &r.auto_capture {
            a if a.is_object() => format!(
                " (auto: {} epochs on the log, {} on the compare, {} switches, {} undone{})",
                a["epochs_log"],
                a["epochs_compare"],
                a["switches"],
                a["undone"],
                match a["last_judged_ops_per_sec"].as_array().map(|r| {
                    r.iter().map(|v| v.as_f64().unwrap_or(0.0)).collect::<Vec<_>>()
                }) {
                    Some(r) if r.len() == 2 => format!(
                        "; last judged switch: {:.3e} ops/s on the log, {:.3e} on the compare",
                        r[0], r[1]
                    ),
                    _ => String::new(),
                }
            ),
            _ => String::new(),
        } + &match &r.colo {
            c if c.is_object() => format!(
                "; colo: {} frames released as matched (waited {:.2} ms on average), {} by \
                 epochs ({} differed, {} timed out, {} periodic)",
                c["matched"],
                c["match_wait_ms_avg"].as_f64().unwrap_or(f64::NAN),
                c["released_by_epoch"],
                c["divergences"],
                c["timeouts"],
                c["periodic"]
            ) + &match c["secondary_down"].as_str() {
                Some(why) => format!("; THE SECONDARY STOPPED ({why}): epochs released the rest"),
                None => String::new(),
            },
            _ => String::new(),
        },
        phases(r),
        if r.ok { "" } else { " NOT VERIFIED" }
    );
}

/// One replicated configuration: `replicate primary`'s defaults
/// ([`nl_replicate::primary::Options::recommended`]) with `flags` on top.
#[derive(Clone)]
struct Case {
    /// "default", or the flags.
    name: String,
    epoch: u64,
    flags: Vec<String>,
}

impl Case {
    fn new(epoch: u64, flags: &[&str]) -> Case {
        let name = if flags.is_empty() { "default".to_string() } else { flags.join(" ") };
        Case { name, epoch, flags: flags.iter().map(|f| f.to_string()).collect() }
    }

    /// Under another name (the flags stay what they are).
    fn named(mut self, name: &str) -> Case {
        self.name = name.to_string();
        self
    }
}

/// The output-triggered epochs before the small-epoch rule: every one
/// spaced 2 ms from the last boundary. A kv cell of every run, so the rule
/// is compared at equal load, interleaved rep by rep.
const OLD_OUTPUT_RULE: [&str; 4] = ["--output-epoch-ms", "2", "--output-spacing-rate", "0"];

/// Every row of a workload at 20 ms: the defaults, each optimization of the
/// defaults turned off (prediction, then selective re-protection too: the
/// paper's unoptimized baseline), pipelining added, the old default
/// (pipelined, nothing else), sending from guest memory in the pause,
/// Histase over userfaultfd, the fault-free compare capture, the choice
/// between the log and the compare epoch by epoch, the parallel copy; then the epoch sweep of the
/// defaults (Figure 13). kv also with the old rule of output-triggered
/// epochs (always 2 ms apart) and without them. `quick`: the 20 ms rows only.
fn cases(a: &BenchReplicateArgs, kv: bool, quick: bool) -> Vec<Case> {
    let p = a.pipeline.to_string();
    let mut v = vec![
        Case::new(20, &[]),
        Case::new(20, &["--no-predict"]),
        Case::new(20, &["--no-selective", "--no-predict"]),
        Case::new(20, &["--pipeline", &p]),
        Case::new(20, &["--pipeline", &p, "--no-selective", "--no-predict"])
            .named(&format!("old default (--pipeline {p} --no-selective --no-predict)")),
        Case::new(20, &["--no-predict", "--direct"]),
        Case::new(20, &["--histase"]),
        Case::new(20, &["--compare"]),
        Case::new(20, &["--no-auto-capture"]),
        Case::new(20, &["--parallel-copy"]),
    ];
    if kv {
        v.push(Case::new(20, &OLD_OUTPUT_RULE));
        v.push(Case::new(20, &["--no-output-epochs"]));
    }
    if !quick {
        for &e in a.epochs.iter().filter(|&&e| e != 20) {
            v.push(Case::new(e, &[]));
        }
    }
    if a.core {
        const CORE: [&str; 3] = ["default", "--no-selective --no-predict", "--histase"];
        let old = OLD_OUTPUT_RULE.join(" ");
        v.retain(|c| match kv {
            true => {
                c.epoch == 20 && [CORE[0], &old, "--no-output-epochs"].contains(&c.name.as_str())
            }
            false => CORE.contains(&c.name.as_str()),
        });
    }
    let extra = if kv { &a.kv_cells } else { &a.cells };
    for flags in extra {
        let flags: Vec<&str> = flags.split_whitespace().collect();
        let c = Case::new(20, &flags);
        if !v.iter().any(|o| o.name == c.name && o.epoch == 20) {
            v.push(c);
        }
    }
    v
}

fn free_port() -> Result<SocketAddr> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?)
}

/// The machine of a throughput row: the default, with `disk` if given.
fn machine(disk: Option<&std::path::Path>) -> MachineArgs {
    MachineArgs { disk: disk.map(|d| d.to_path_buf()), ..Default::default() }
}

fn unreplicated(w: &WorkloadArgs, duration: f64, disk: Option<&std::path::Path>) -> Result<f64> {
    let m = machine(disk);
    let config =
        guest::vm_config(&m, guest::workload_params(w, duration)?, guest::kernel_image(&m)?, None)?;
    let kvm = nl_vmm::open_kvm()?;
    let vm = Vm::create(&kvm, 0, config)?;
    vm.start()?;
    let o = vm.wait(Duration::from_secs_f64(duration * 4.0 + 60.0));
    if o != VmOutcome::Completed {
        bail!("unreplicated run: {}", o.message());
    }
    let regs: Vec<_> = vm.control().vcpus.iter().map(|r| r.snapshot()).collect();
    let tsc = nl_arch::read_boot_info(vm.memory().mem())?.tsc_khz;
    Ok(verify_vcpus(&vm.config().workload, &regs, tsc).iter().map(|v| v.ops_per_sec).sum())
}

/// `replicate primary` as its parser sees the case's flags (the kv rows
/// pass the same flags on a command line).
#[derive(clap::Parser)]
struct PrimaryCli {
    #[command(flatten)]
    a: PrimaryArgs,
}

fn primary_args(
    backup: SocketAddr,
    key_file: &std::path::Path,
    w: &WorkloadArgs,
    duration: f64,
    c: &Case,
    disk: Option<&std::path::Path>,
) -> Result<PrimaryArgs> {
    use clap::Parser;
    let (backup, epoch) = (backup.to_string(), c.epoch.to_string());
    let key = key_file.to_str().context("the key's path is not UTF-8")?;
    let mut argv = vec!["primary", "--backup", &backup, "--key-file", key, "--epoch", &epoch];
    argv.extend(["--lease-ms", "2000"]);
    argv.extend(c.flags.iter().map(String::as_str));
    let mut a = PrimaryCli::try_parse_from(argv)
        .with_context(|| format!("the bench's flags for '{}'", c.name))?
        .a;
    a.workload = w.clone();
    a.machine = machine(disk);
    a.duration = duration;
    a.json = true;
    Ok(a)
}

/// A workload replicated on loopback, the backup a thread of this process;
/// `disks`: the primary's image and the backup's copy.
fn replicated(
    w: &WorkloadArgs,
    duration: f64,
    c: &Case,
    disks: Option<(&std::path::Path, &std::path::Path)>,
) -> Result<PrimaryRun> {
    let addr = free_port()?;
    let m = MachineArgs::default();
    let key = BenchKey::new()?;
    let cfg = BackupConfig {
        listen: addr,
        allow: None,
        key: Key::load(&key.0).map_err(anyhow::Error::msg)?,
        mem_bytes: m.mem,
        vcpus: m.vcpus,
        disk: disks.map(|d| d.1.to_path_buf()),
        lease: Duration::from_secs(2),
        heartbeat: Duration::from_millis(100),
        handshake: HANDSHAKE_TIME,
        colo: false,
        colo_test_perturb: 0,
        colo_test_fail_at: 0,
        colo_test_crash_at: 0,
    };
    let backup = std::thread::spawn(move || serve(&cfg, &mut |_| {}));
    // The primary connects once: wait (bounded, 10 s) until the backup
    // listens. The probe never authenticates, so it never takes the slot.
    // A fixed sleep lost this race on a loaded host and left the backup
    // waiting for a primary that had given up.
    let listening = (0..200).any(|_| {
        if backup.is_finished() {
            return true;
        }
        let ok = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok();
        if !ok {
            std::thread::sleep(Duration::from_millis(50));
        }
        ok
    });
    if backup.is_finished() || !listening {
        match backup.is_finished().then(|| backup.join()) {
            Some(Ok(Err(e))) => bail!("bench backup: {e}"),
            _ => bail!("the bench backup did not listen on {addr} within 10 s"),
        }
    }
    let r = primary_args(addr, &key.0, w, duration, c, disks.map(|d| d.0))
        .and_then(|a| run_primary(&a, true));
    match backup.join() {
        Ok(Ok(BackupEnd::PrimaryFinished { .. })) => {}
        Ok(Ok(_)) => bail!("the bench backup did not end with the primary"),
        Ok(Err(e)) => bail!("bench backup: {e}"),
        Err(_) => bail!("bench backup thread panicked"),
    }
    r
}

/// A replication key file of the bench's own (made by `Key::generate`,
/// mode 0600), deleted on drop.
struct BenchKey(std::path::PathBuf);

impl BenchKey {
    fn new() -> Result<BenchKey> {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("nl-bench-{}-{n}.key", std::process::id()));
        Key::generate(&path).map_err(anyhow::Error::msg)?;
        Ok(BenchKey(path))
    }

    fn arg(&self) -> &str {
        self.0.to_str().expect("a temp path is UTF-8")
    }
}

impl Drop for BenchKey {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The three namespaces (see the module documentation), deleted on drop,
/// and the replication key of their primary and backup.
struct Topo {
    c: Netns,
    p: Netns,
    b: Netns,
    key: BenchKey,
}

const TAP: &str = "nlrtap0";
const GUEST: &str = "10.0.0.2";

impl Topo {
    fn new() -> Result<Topo, String> {
        if let Some(why) = crate::netns::unavailable() {
            return Err(why);
        }
        let build = || -> Result<Topo> {
            let id = std::process::id();
            let t = Topo {
                c: Netns::new(&format!("nlrb-{id}-c"))?,
                p: Netns::new(&format!("nlrb-{id}-p"))?,
                b: Netns::new(&format!("nlrb-{id}-b"))?,
                key: BenchKey::new()?,
            };
            t.c.bridge("br0")?;
            t.c.addr("br0", "10.0.0.1/24")?;
            t.c.up("br0")?;
            t.p.veth(("rep0", Some("10.9.0.1/24")), &t.b, ("rep1", Some("10.9.0.2/24")))?;
            for (n, peer) in [(&t.p, "cp"), (&t.b, "cb")] {
                n.bridge("br0")?;
                n.up("br0")?;
                n.tap(TAP)?;
                n.set_master(TAP, "br0")?;
                n.up(TAP)?;
                n.veth(("up0", None), &t.c, (peer, None))?;
                n.set_master("up0", "br0")?;
                t.c.set_master(peer, "br0")?;
            }
            Ok(t)
        };
        build().map_err(|e| format!("{e:#}"))
    }

    fn exe(ns: &Netns, args: &[&str]) -> Result<Command> {
        let mut c = ns.ninelives()?;
        c.args(args);
        Ok(c)
    }

    fn spawn(ns: &Netns, args: &[&str]) -> Result<Proc> {
        Proc::spawn(Self::exe(ns, args)?).context("cannot start a helper")
    }
}

/// Waits up to `secs` for a helper (then kills it); its exit and output.
fn finish(mut p: Proc, secs: f64) -> Output {
    let mut status = p.wait_for(Duration::from_secs_f64(secs));
    if status.is_none() {
        p.kill();
        status = p.wait_for(Duration::from_secs(5));
    }
    Output {
        status: status.unwrap_or_default(),
        stdout: p.stdout.text().into_bytes(),
        stderr: p.stderr.text().into_bytes(),
    }
}

fn last_json(o: &Output) -> Option<serde_json::Value> {
    crate::json_out::last_json(&String::from_utf8_lossy(&o.stdout))
}

/// kvload from C against the guest for `secs`; its JSON report.
fn kvload(t: &Topo, secs: f64, connections: u32, timeout: &str) -> Result<Proc> {
    let d = format!("{secs}");
    let n = connections.to_string();
    Topo::spawn(
        &t.c,
        &[
            "kvload",
            "--target",
            GUEST,
            "--duration",
            &d,
            "--connections",
            &n,
            "--keys",
            "400",
            "--timeout",
            timeout,
            "--json",
        ],
    )
}

const KV_NET: [&str; 6] = ["--workload", "kv", "--net-tap", TAP, "--net-ip", "10.0.0.2/24"];

/// Waits (bounded: 10 s) until the backup in B accepts connections from P;
/// a fixed sleep lost this race on a loaded host. The probe never
/// authenticates, so it never takes the primary's slot.
fn wait_backup_listens(t: &Topo) -> bool {
    let addr: SocketAddr = "10.9.0.2:7070".parse().expect("a literal address");
    (0..50).any(|_| {
        let up =
            t.p.run_in(|| {
                Ok(std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok())
            })
            .unwrap_or(false);
        if !up {
            std::thread::sleep(Duration::from_millis(200));
        }
        up
    })
}

/// kv ops/s under kvload: unreplicated, then under each replicated case. A
/// case that fails (a primary without a report on a loaded host) is
/// reported in `failed`, not the end of the bench.
fn kv_rows(
    a: &BenchReplicateArgs,
    t: &Topo,
    rows: &mut Vec<Row>,
    failed: &mut Vec<String>,
) -> Result<bool> {
    let load = a.duration.max(1.0);
    // The VM outlives the load: it starts first, and the load waits for it.
    let life = format!("{}", load + 4.0);
    let mut args = vec!["run", "--duration", &life];
    args.extend(KV_NET);
    let vm = Topo::spawn(&t.p, &args)?;
    std::thread::sleep(Duration::from_millis(800));
    let o = finish(kvload(t, load, 8, "5s")?, load + 60.0);
    drop(vm);
    let j = last_json(&o).context("kvload printed no report")?;
    let base = j["ops_per_sec"].as_f64().unwrap_or(0.0);
    let mut ok = j["ok"].as_bool().unwrap_or(false);
    eprintln!("kv: unreplicated {base:.3e} ops/s (8 connections)");
    for c in cases(a, true, false) {
        match kv_case(a, t, &c, base) {
            Ok((r, kv_ok)) => {
                ok &= kv_ok;
                print_row(&r);
                rows.push(r);
            }
            Err(e) => {
                eprintln!("kv {} @{} ms: FAILED: {e:#}", c.name, c.epoch);
                failed.push(format!("kv {} @{} ms: {e:#}", c.name, c.epoch));
                ok = false;
            }
        }
    }
    Ok(ok)
}

/// One kv cell: its row and whether kvload verified every reply.
fn kv_case(a: &BenchReplicateArgs, t: &Topo, c: &Case, base: f64) -> Result<(Row, bool)> {
    let load = a.duration.max(1.0);
    {
        let mut bargs = vec!["replicate", "backup", "--listen", "10.9.0.2:7070"];
        bargs.extend(["--lease-ms", "2000", "--key-file", t.key.arg(), "--json"]);
        // A COLO primary needs a backup that runs the secondary VM, and a
        // guest taking network interrupts a backup that builds it so.
        for f in ["--colo", "--net-rx-irq"] {
            if c.flags.iter().any(|g| g == f) {
                bargs.push(f);
            }
        }
        let backup = Topo::spawn(&t.b, &bargs)?;
        if !wait_backup_listens(t) {
            bail!("the backup did not listen within 10 s");
        }
        // The read-back after the load takes a commit per request: long
        // epochs need a longer-lived VM.
        let life = format!("{}", load + 4.0 + 100.0 * c.epoch as f64 / 1000.0);
        let e = c.epoch.to_string();
        let mut args = vec!["replicate", "primary", "--backup", "10.9.0.2:7070", "--json"];
        args.extend(["--epoch", &e, "--duration", &life, "--lease-ms", "2000"]);
        args.extend(["--key-file", t.key.arg()]);
        args.extend(c.flags.iter().map(String::as_str));
        args.extend(KV_NET);
        let primary = Topo::spawn(&t.p, &args)?;
        std::thread::sleep(Duration::from_millis(800));
        let ko = finish(kvload(t, load, 8, "5s")?, load + 90.0);
        let po = finish(primary, load + 120.0);
        let _ = finish(backup, 10.0);
        let kj = last_json(&ko).context("kvload printed no report")?;
        let pj = last_json(&po).with_context(|| {
            format!("the kv primary printed no report: {}", String::from_utf8_lossy(&po.stderr))
        })?;
        let kv_ok = kj["ok"].as_bool().unwrap_or(false);
        let ops = kj["ops_per_sec"].as_f64().unwrap_or(0.0);
        Ok((row("kv", &c.name, c.epoch, kv_ok, ops, base, &pj), kv_ok))
    }
}

#[derive(Serialize)]
struct Kill {
    kind: &'static str,
    /// When the kill came (ms after the load started, or after the primary
    /// started for mid-send kills).
    at_ms: u64,
    activated: bool,
    /// Why the backup took over (a mid-send kill shows a truncated frame).
    reason: Option<String>,
    epoch: Option<u64>,
    /// Detection to the VM's vCPUs started on the backup.
    takeover_ms: Option<f64>,
    /// The primary's last frame to the VM's vCPUs started on the backup:
    /// detection (the lease) plus the takeover.
    since_last_frame_ms: Option<f64>,
    /// The primary's last frame to the backup declaring it gone (the lease
    /// and how late the backup noticed it ran out):
    /// `since_last_frame_ms - takeover_ms`.
    detection_ms: Option<f64>,
    /// The backup had built the VM ahead (after the full copy): the
    /// takeover only loaded the last state and started it.
    prebuilt: Option<bool>,
    /// The backup's takeover phases (its JSON's `takeover`).
    takeover: serde_json::Value,
    /// COLO: the secondary VM took over (not a VM built from the last epoch).
    colo_secondary: Option<bool>,
    /// Acknowledged writes the client did not find (GETs during the load and
    /// the read-back after it).
    lost_acked_writes: u64,
    digest_ok: Option<bool>,
    unverified: u64,
    /// The longest request seen by the client (the failover gap).
    client_max_latency_ms: f64,
    client_errors: u64,
    client_ops: u64,
    /// The 1 ms ping from C (UDP echo, answered by the kv guest): the
    /// longest gap between replies that overlaps the kill (from the kill, or
    /// for a mid-send kill from the time the primary was told to die, until
    /// its exit was seen). Null, with `ping_note`, when the ping could not
    /// run or the guest had not answered it before the kill.
    ping_gap_ms: Option<f64>,
    /// When that gap began, relative to the kill (the last reply before it).
    ping_gap_start_after_kill_ms: Option<f64>,
    /// The longest gap of the same run away from the kill (more than 100 ms
    /// before it or after the exit; not the wait for the first reply): the
    /// gaps this load shows anyway, for comparison.
    ping_gap_elsewhere_ms: Option<f64>,
    /// Pings of the whole run (from the start of the load to its end).
    ping_sent: Option<u64>,
    ping_lost: Option<u64>,
    /// The guest answered pings again after the primary's exit (the backup's copy).
    ping_answered_again: Option<bool>,
    /// Round trip; under replication about an epoch (output commit).
    ping_rtt_median_ms: Option<f64>,
    ping_note: Option<String>,
    ok: bool,
    note: Option<String>,
}

/// The ping's part of a [`Kill`].
#[derive(Default)]
struct PingAcross {
    gap_ms: Option<f64>,
    gap_start_after_kill_ms: Option<f64>,
    gap_elsewhere_ms: Option<f64>,
    sent: Option<u64>,
    lost: Option<u64>,
    answered_again: Option<bool>,
    rtt_median_ms: Option<f64>,
    note: Option<String>,
}

/// Starts `ninelives ping` from C at the guest, 1 ms apart, until stopped.
fn start_ping(t: &Topo) -> Result<PingRun> {
    let mut args = vec!["ping", "--target", GUEST, "--interval", "1ms", "--duration", "600"];
    args.extend(["--until-stdin-eof", "--json"]);
    PingRun::start(Topo::exe(&t.c, &args)?)
}

/// Ends the ping of one kill; the kill lasted from `begin` to `end` (the
/// primary's exit seen).
fn end_ping(run: Result<PingRun, String>, begin: Instant, end: Instant) -> PingAcross {
    let run = match run {
        Ok(r) => r,
        Err(why) => return PingAcross { note: Some(why), ..Default::default() },
    };
    let r = match run.finish() {
        Ok(r) => r,
        Err(err) => return PingAcross { note: Some(format!("{err:#}")), ..Default::default() },
    };
    let (b, e, j) = (r.ms_at(begin), r.ms_at(end), r.report);
    let gap = gap_across(&j, b, e);
    let elsewhere = j["long_gaps"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|g| Some((g["start_ms"].as_f64()?, g["ms"].as_f64()?)))
        .filter(|&(s, len)| s > 0.0 && (s + len < b - 100.0 || s > e + 100.0))
        .map(|g| g.1)
        .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x))));
    let mut p = PingAcross {
        gap_ms: gap.map(|g| g.ms),
        gap_start_after_kill_ms: gap.map(|g| g.start_ms - b),
        gap_elsewhere_ms: elsewhere,
        sent: j["sent"].as_u64(),
        lost: lost(&j).as_u64(),
        answered_again: Some(j["last_reply_ms"].as_f64().is_some_and(|l| l > e)),
        rtt_median_ms: j["rtt_median_ms"].as_f64(),
        note: None,
    };
    match gap {
        // A gap from the first send: the guest never answered before the kill.
        Some(g) if g.start_ms <= 0.0 => {
            p.gap_ms = None;
            p.gap_start_after_kill_ms = None;
            p.note = Some("the guest had not answered a ping before the kill".into());
        }
        Some(_) => {}
        None => p.note = Some("no gap of 3 ms or more across the kill".into()),
    }
    p
}

/// splitmix64.
fn rnd(s: &mut u64) -> u64 {
    *s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *s;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The flags of `--kill-colo`, for the primary and the backup alike.
const KILL_COLO: [&str; 2] = ["--colo", "--net-rx-irq"];

/// One kill: kv primary in P, backup in B, kvload in C.
fn kill_once(t: &Topo, i: u32, a: &BenchReplicateArgs, seed: &mut u64) -> Result<Kill> {
    let load = a.kill_load.max(1.5);
    let lease = a.kill_lease_ms.to_string();
    let mid_send = i % 2 == 1;
    let life = format!("{}", load + 4.0);
    let backup = Topo::spawn(
        &t.b,
        &[
            &[
                "replicate",
                "backup",
                "--listen",
                "10.9.0.2:7070",
                "--allow-primary",
                "10.9.0.1",
                "--net-tap",
                TAP,
                "--net-ip",
                "10.0.0.2/24",
                "--key-file",
                t.key.arg(),
                "--lease-ms",
                &lease,
                "--json",
            ][..],
            if a.no_prebuild { &["--no-prebuild"] } else { &[] },
            if a.kill_colo { &KILL_COLO } else { &[] },
        ]
        .concat(),
    )?;
    std::thread::sleep(Duration::from_millis(300));
    let startup = 800u64;
    // The kill lands in the middle 60% of the load.
    let at = (load * 1000.0 * 0.2) as u64 + rnd(seed) % ((load * 1000.0 * 0.6) as u64).max(1);
    let die = (startup + at).to_string();
    let mut args = vec!["replicate", "primary", "--backup", "10.9.0.2:7070", "--json"];
    // The defaults (output-triggered epochs included), at 20 ms.
    args.extend(["--epoch", "20", "--duration", &life, "--lease-ms", &lease]);
    args.extend(["--key-file", t.key.arg()]);
    if mid_send {
        args.extend(["--test-die-mid-send-ms", &die]);
    }
    if a.kill_colo {
        args.extend(KILL_COLO);
    }
    args.extend(KV_NET);
    let mut primary = Topo::spawn(&t.p, &args)?;
    let spawned = Instant::now();
    std::thread::sleep(Duration::from_millis(startup));
    let client = kvload(t, load, 8, "10s")?;
    // The ping runs across the kill and the takeover, until the load ends.
    let ping = start_ping(t).map_err(|e| format!("the ping did not run: {e:#}"));
    let killed_at = if mid_send {
        // The primary counts from its own start, a little after the spawn.
        spawned + Duration::from_millis(startup + at)
    } else {
        std::thread::sleep(Duration::from_millis(at));
        primary.kill();
        Instant::now()
    };
    let po = finish(primary, load + 30.0);
    let exited = Instant::now();
    let ko = finish(client, load + 90.0);
    let pa = end_ping(ping, killed_at, exited);
    let bo = finish(backup, load + 60.0);
    let kj = last_json(&ko).unwrap_or_default();
    let bj = last_json(&bo).unwrap_or_default();
    let killed = po.status.code().is_none();
    let lost =
        kj["mismatches"].as_u64().unwrap_or(0) + kj["readback_mismatches"].as_u64().unwrap_or(0);
    let activated = bj["activated"].as_bool().unwrap_or(false);
    let digest_ok = kj["digest_ok"].as_bool();
    let unverified = kj["unverified"].as_u64().unwrap_or(0);
    let note = if !killed {
        Some(format!("the primary was not killed: {}", String::from_utf8_lossy(&po.stderr)))
    } else if kj.is_null() {
        Some(format!("kvload printed no report: {}", String::from_utf8_lossy(&ko.stderr)))
    } else if !activated {
        Some(format!("the backup did not take over: {}", String::from_utf8_lossy(&bo.stderr)))
    } else {
        None
    };
    let ok = note.is_none() && lost == 0 && digest_ok == Some(true) && unverified == 0;
    Ok(Kill {
        kind: if mid_send { "mid-send" } else { "mid-epoch" },
        at_ms: if mid_send { startup + at } else { at },
        activated,
        reason: bj["reason"].as_str().map(str::to_string),
        epoch: bj["epoch"].as_u64(),
        takeover_ms: bj["takeover_ms"].as_f64(),
        since_last_frame_ms: bj["since_last_frame_ms"].as_f64(),
        detection_ms: bj["since_last_frame_ms"]
            .as_f64()
            .zip(bj["takeover_ms"].as_f64())
            .map(|(s, t)| s - t),
        prebuilt: bj["prebuilt"].as_bool(),
        takeover: bj["takeover"].clone(),
        colo_secondary: bj["colo_secondary"].as_bool(),
        lost_acked_writes: lost,
        digest_ok,
        unverified,
        client_max_latency_ms: kj["latency_us"]["max"].as_f64().unwrap_or(f64::NAN) / 1e3,
        client_errors: kj["errors"].as_u64().unwrap_or(0),
        client_ops: kj["ops"].as_u64().unwrap_or(0),
        ping_gap_ms: pa.gap_ms,
        ping_gap_start_after_kill_ms: pa.gap_start_after_kill_ms,
        ping_gap_elsewhere_ms: pa.gap_elsewhere_ms,
        ping_sent: pa.sent,
        ping_lost: pa.lost,
        ping_answered_again: pa.answered_again,
        ping_rtt_median_ms: pa.rtt_median_ms,
        ping_note: pa.note,
        ok,
        note,
    })
}

pub fn bench(a: BenchReplicateArgs) -> Result<ExitCode> {
    let t0 = Instant::now();
    let clock = crate::json_out::RunClock::start();
    let mut rows = Vec::new();
    let mut failed: Vec<String> = Vec::new();
    let mut all_ok = true;
    let topo = if a.kills > 0 || (!a.no_throughput && !a.no_kv) { Some(Topo::new()) } else { None };
    let mut summaries = Vec::new();
    let hogs = if a.loaded && !a.no_throughput {
        Some(super::checkpoint::Hogs::start(a.hogs)?)
    } else {
        None
    };
    let mut load = vec![super::checkpoint::loadavg()];
    let costs = if a.no_throughput { None } else { Some(super::unit_costs::UnitCosts::measure()?) };
    if let Some(c) = &costs {
        super::unit_costs::print(c);
    }
    if let Some(costs) = costs.as_ref().filter(|_| !a.no_throughput) {
        // blkbench: the guest's disk writes replicated too (its own images).
        let pdisk = guest::TempDisk::with_size("bench-primary", guest::DEFAULT_DISK_BYTES)?;
        let bdisk = guest::TempDisk::with_size("bench-backup", guest::DEFAULT_DISK_BYTES)?;
        let blk = WorkloadArgs { workload: WorkloadName::Blkbench, ..Default::default() };
        for (name, w, disks) in [
            (
                "memwrite-sequential",
                WorkloadArgs { pattern: PatternName::Sequential, ..Default::default() },
                None,
            ),
            ("memwrite-random", WorkloadArgs::default(), None),
            // The 64 MiB rows rewrite their whole working set every epoch
            // (a worst case); this one has an 8 MiB writable working set.
            (
                "memwrite-sequential-8M",
                WorkloadArgs {
                    pattern: PatternName::Sequential,
                    ws: Some(8 << 20),
                    ..Default::default()
                },
                None,
            ),
            ("blkbench", blk, Some((pdisk.0.as_path(), bdisk.0.as_path()))),
        ] {
            if !a.only.is_empty() && !a.only.iter().any(|o| o == name) {
                continue;
            }
            let cs = cases(&a, false, disks.is_some());
            let mut per: Vec<Vec<(f64, f64, bool)>> = cs.iter().map(|_| Vec::new()).collect();
            for rep in 0..a.reps {
                let base = unreplicated(&w, a.duration, disks.map(|d| d.0))?;
                eprintln!("{name} (rep {rep}): unreplicated {base:.3e} ops/s");
                for (i, c) in cs.iter().enumerate() {
                    // A failed sample (a fenced primary on a loaded host)
                    // is reported and counted, not the end of the bench.
                    let r = match replicated(&w, a.duration, c, disks) {
                        Ok(r) => r,
                        Err(e) => {
                            eprintln!(
                                "{name} {} @{} ms (rep {rep}): FAILED: {e:#}",
                                c.name, c.epoch
                            );
                            failed.push(format!(
                                "{name} {} @{} ms rep {rep}: {e:#}",
                                c.name, c.epoch
                            ));
                            all_ok = false;
                            continue;
                        }
                    };
                    all_ok &= r.ok;
                    let rep_json = serde_json::to_value(&r.report)?;
                    let mut row = row(name, &c.name, c.epoch, r.ok, r.ops_per_sec, base, &rep_json);
                    row.rep = rep;
                    print_row(&row);
                    per[i].push((row.ratio, row.pages_per_epoch, row.ok));
                    rows.push(row);
                }
                load.push(super::checkpoint::loadavg());
            }
            for (c, p) in cs.iter().zip(&per).filter(|(_, p)| !p.is_empty()) {
                let ratios: Vec<f64> = p.iter().map(|x| x.0).collect();
                let pages: Vec<f64> = p.iter().map(|x| x.1).collect();
                let (med, lo, hi) = super::checkpoint::spread(&ratios);
                let pages = super::checkpoint::spread(&pages).0;
                let bound = costs.replication_bound(pages, pages, c.epoch as f64);
                let s = Summary {
                    workload: name,
                    config: c.name.clone(),
                    epoch_ms: c.epoch,
                    reps: p.len(),
                    verified: p.iter().filter(|x| x.2).count(),
                    ratio_median: med,
                    ratio_min: lo,
                    ratio_max: hi,
                    pages_per_epoch: pages,
                    bound,
                    of_bound: if bound > 0.0 { med / bound } else { 0.0 },
                };
                eprintln!(
                    "SUMMARY {} {} @{} ms: {:.3} ({:.3}..{:.3}) of unreplicated over {} reps \
                     ({} verified), {:.0} pages/epoch, bound {:.3}, {:.2} of the bound",
                    s.workload,
                    s.config,
                    s.epoch_ms,
                    s.ratio_median,
                    s.ratio_min,
                    s.ratio_max,
                    s.reps,
                    s.verified,
                    s.pages_per_epoch,
                    s.bound,
                    s.of_bound
                );
                summaries.push(s);
            }
        }
    }
    let mut kv_skipped = None;
    if !a.no_throughput && !a.no_kv {
        match topo.as_ref().expect("made above") {
            Ok(t) => {
                for rep in 0..a.reps {
                    let from = rows.len();
                    // A repetition whose baseline failed (kvload without a
                    // report on a saturated host) is reported, not the end.
                    match kv_rows(&a, t, &mut rows, &mut failed) {
                        Ok(ok) => all_ok &= ok,
                        Err(e) => {
                            eprintln!("kv (rep {rep}): FAILED: {e:#}");
                            failed.push(format!("kv rep {rep}: {e:#}"));
                            all_ok = false;
                        }
                    }
                    rows[from..].iter_mut().for_each(|r| r.rep = rep);
                    load.push(super::checkpoint::loadavg());
                }
            }
            Err(why) => kv_skipped = Some(why.clone()),
        }
    }
    drop(hogs);
    let mut kills = Vec::new();
    let mut kills_skipped = None;
    if a.kills > 0 {
        match topo.as_ref().expect("made above") {
            Ok(t) => {
                let mut seed = a.seed;
                for i in 0..a.kills {
                    let k = kill_once(t, i, &a, &mut seed)?;
                    eprintln!(
                        "kill {i} ({}, at {} ms): {}, epoch {:?}, takeover {:.1} ms after detection ({}), \
                         lost acknowledged writes {}, client gap (longest request) {:.0} ms, {} client errors, \
                         {}{}",
                        k.kind, k.at_ms, if k.activated { "backup took over" } else { "NO TAKEOVER" },
                        k.epoch, k.takeover_ms.unwrap_or(f64::NAN),
                        match k.colo_secondary {
                            Some(true) => "the COLO secondary, running, moved to the TAP".into(),
                            _ => describe_takeover(&k.takeover),
                        },
                        k.lost_acked_writes,
                        k.client_max_latency_ms, k.client_errors, describe_ping(&k),
                        k.note.as_ref().map_or(String::new(), |n| format!(" ({n})"))
                    );
                    all_ok &= k.ok;
                    kills.push(k);
                }
            }
            Err(why) => kills_skipped = Some(why.clone()),
        }
    }
    let lost: u64 = kills.iter().map(|k| k.lost_acked_writes).sum();
    let gaps: Vec<f64> = kills.iter().map(|k| k.client_max_latency_ms).collect();
    let takeovers = kills.iter().filter(|k| k.activated).count();
    let prebuilt = kills.iter().filter(|k| k.prebuilt == Some(true)).count();
    let takeover_ms: Vec<f64> = kills.iter().filter_map(|k| k.takeover_ms).collect();
    let detection_ms: Vec<f64> = kills.iter().filter_map(|k| k.detection_ms).collect();
    let min = |v: &[f64]| v.iter().copied().fold(f64::NAN, f64::min);
    let ping_gaps: Vec<f64> = kills.iter().filter_map(|k| k.ping_gap_ms).collect();
    let elsewhere: Vec<f64> = kills.iter().filter_map(|k| k.ping_gap_elsewhere_ms).collect();
    let answered_again = kills.iter().filter(|k| k.ping_answered_again == Some(true)).count();
    let max = |v: &[f64]| v.iter().copied().fold(f64::NAN, f64::max);
    if !kills.is_empty() {
        eprintln!(
            "kill campaign: takeover median {:.1} ms [{:.1}, {:.1}] after detection ({} of {} VMs built ahead)",
            median(&takeover_ms),
            min(&takeover_ms),
            max(&takeover_ms),
            prebuilt,
            takeovers
        );
        eprintln!(
            "kill campaign: detection median {:.1} ms [{:.1}, {:.1}] after the primary's last frame \
             (lease {} ms); failover = detection + takeover",
            median(&detection_ms),
            min(&detection_ms),
            max(&detection_ms),
            a.kill_lease_ms
        );
        eprintln!(
            "kill campaign: {} kills, {} takeovers, {} lost acknowledged writes, client gap median {:.0} ms, \
             max {:.0} ms; ping gap median {:.0} ms, max {:.0} ms ({} kills measured; away from \
             the kills median {:.0} ms, max {:.0} ms), answered pings again after {} kills",
            kills.len(),
            takeovers,
            lost,
            median(&gaps),
            max(&gaps),
            median(&ping_gaps),
            max(&ping_gaps),
            ping_gaps.len(),
            median(&elsewhere),
            max(&elsewhere),
            answered_again
        );
    }
    let (load_lo, load_hi) =
        load.iter().fold((f64::MAX, f64::MIN), |(l, h), x| (l.min(*x), h.max(*x)));
    eprintln!(
        "throughput rows: {} reps, {}; load average {load_lo:.1}..{load_hi:.1}",
        a.reps,
        if a.loaded { format!("loaded ({} hogs)", a.hogs) } else { "quiet".into() }
    );
    let samples = rows;
    let rows = medians(&samples);
    for r in &rows {
        eprintln!(
            "{} {} @{} ms: ratio median {:.3} [{:.3}, {:.3}] over {} reps{}",
            r.workload,
            r.config,
            r.epoch_ms,
            r.ratio,
            r.ratio_min,
            r.ratio_max,
            r.ratio_samples.len(),
            if r.workload == "kv" { format!(" (median rep{})", phases(r)) } else { String::new() }
        );
    }
    let out = serde_json::json!({
        "reps": a.reps,
        "failed_samples": failed,
        "rows": rows,
        "summary": summaries,
        "loaded": a.loaded,
        "hogs": if a.loaded { a.hogs } else { 0 },
        "loadavg_min": load_lo,
        "loadavg_max": load_hi,
        "unit_costs": costs,
        "samples": samples,
        "kv_skipped": kv_skipped,
        "kills": kills,
        "kills_skipped": kills_skipped,
        "kill_summary": {
            "kills": kills.len(),
            "lease_ms": a.kill_lease_ms,
            "takeovers": takeovers,
            "prebuilt": prebuilt,
            "takeover_ms_median": finite(median(&takeover_ms)),
            "takeover_ms_min": finite(min(&takeover_ms)),
            "takeover_ms_max": finite(max(&takeover_ms)),
            "detection_ms_median": finite(median(&detection_ms)),
            "detection_ms_min": finite(min(&detection_ms)),
            "detection_ms_max": finite(max(&detection_ms)),
            "lost_acked_writes": lost,
            "client_gap_ms_max": gaps.iter().copied().fold(0.0, f64::max),
            "client_gap_ms_median": median(&gaps),
            "ping_gap_ms_max": finite(max(&ping_gaps)),
            "ping_gap_ms_median": finite(median(&ping_gaps)),
            "ping_gaps_measured": ping_gaps.len(),
            "ping_gap_elsewhere_ms_median": finite(median(&elsewhere)),
            "ping_gap_elsewhere_ms_max": finite(max(&elsewhere)),
            "ping_answered_again": answered_again,
            "ping_lost": kills.iter().filter_map(|k| k.ping_lost).sum::<u64>(),
        },
        "ok": all_ok,
        "host_ms": t0.elapsed().as_secs_f64() * 1e3,
    });
    if a.json {
        println!("{}", crate::json_out::with_provenance(out, &clock.finish()));
    }
    Ok(if all_ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// One row per cell (workload, config, epoch, pipeline), in first-seen
/// order: the sample with the median ratio (the lower middle for an even
/// count), with every sample's ratio and their min and max.
fn medians(samples: &[Row]) -> Vec<Row> {
    let key = |r: &Row| (r.workload, r.config.clone(), r.epoch_ms, r.pipeline);
    let mut keys = Vec::new();
    for r in samples {
        if !keys.contains(&key(r)) {
            keys.push(key(r));
        }
    }
    keys.into_iter()
        .map(|k| {
            let cell: Vec<&Row> = samples.iter().filter(|r| key(r) == k).collect();
            let mut by_ratio = cell.clone();
            by_ratio.sort_by(|a, b| a.ratio.total_cmp(&b.ratio));
            let mut m = by_ratio[(by_ratio.len() - 1) / 2].clone();
            m.ratio_samples = cell.iter().map(|r| r.ratio).collect();
            m.ratio_min = by_ratio[0].ratio;
            m.ratio_max = by_ratio[by_ratio.len() - 1].ratio;
            m.ok = cell.iter().all(|r| r.ok);
            m
        })
        .collect()
}

/// JSON null for NaN (no value measured).
fn finite(x: f64) -> Option<f64> {
    x.is_finite().then_some(x)
}

/// The ping's part of a kill's line.
/// The backup's takeover phases in a few words.
fn describe_takeover(t: &serde_json::Value) -> String {
    let f = |k: &str| t[k].as_f64().unwrap_or(f64::NAN);
    let how = if t["prebuilt"] == true {
        format!(
            "built ahead, waited {:.1} ms for it, TAP {:.2} ms",
            f("wait_prebuild_ms"),
            f("tap_ms")
        )
    } else {
        format!(
            "built in the takeover in {:.1} ms: {}",
            f("build_ms"),
            t["fallback"].as_str().unwrap_or("?")
        )
    };
    format!(
        "{how}; handoff {:.2} ms, restore_state {:.2} ms, start {:.2} ms, first exit {:.1} ms later",
        f("handoff_ms"),
        f("restore_state_ms"),
        f("start_ms"),
        f("first_exit_ms")
    )
}

fn describe_ping(k: &Kill) -> String {
    match (k.ping_gap_ms, &k.ping_note) {
        (Some(g), _) => format!(
            "ping gap {g:.0} ms (elsewhere in the run up to {:.0} ms; {} of {} pings lost, rtt median {:.1} ms){}",
            k.ping_gap_elsewhere_ms.unwrap_or(f64::NAN),
            k.ping_lost.unwrap_or(0),
            k.ping_sent.unwrap_or(0),
            k.ping_rtt_median_ms.unwrap_or(f64::NAN),
            if k.ping_answered_again == Some(true) { "" } else { ", NOT ANSWERED AGAIN" }
        ),
        (None, Some(n)) => format!("ping: {n}"),
        (None, None) => "ping: no result".into(),
    }
}

use std::process::ExitCode;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_keep_one_row_per_cell_with_every_ratio_and_the_spread() {
        let p = serde_json::json!({});
        let mk = |cfg: &'static str, rep: u32, ops: f64| {
            let mut r = row("w", cfg, 20, true, ops, 100.0, &p);
            r.rep = rep;
            r
        };
        let samples = vec![
            mk("none", 0, 30.0),
            mk("a", 0, 60.0),
            mk("none", 1, 10.0),
            mk("a", 1, 50.0),
            mk("none", 2, 20.0),
            mk("a", 2, 70.0),
        ];
        let m = medians(&samples);
        assert_eq!(m.len(), 2);
        assert_eq!((m[0].config.as_str(), m[0].rep, m[0].ratio), ("none", 2, 0.2));
        assert_eq!(m[0].ratio_samples, vec![0.3, 0.1, 0.2]);
        assert_eq!((m[0].ratio_min, m[0].ratio_max), (0.1, 0.3));
        assert_eq!((m[1].config.as_str(), m[1].ratio), ("a", 0.6));
    }

    #[test]
    fn core_cells_are_the_ones_the_report_reads() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            a: BenchReplicateArgs,
        }
        let a = <Cli as clap::Parser>::parse_from(["x", "--core", "--epochs", "20,100"]).a;
        let names =
            |kv| cases(&a, kv, false).iter().map(|c| (c.name.clone(), c.epoch)).collect::<Vec<_>>();
        let d = "default".to_string();
        assert_eq!(
            names(false),
            vec![
                (d.clone(), 20),
                ("--no-selective --no-predict".to_string(), 20),
                ("--histase".to_string(), 20),
                (d.clone(), 100)
            ]
        );
        // Extra cells come after them, once each.
        let b = <Cli as clap::Parser>::parse_from([
            "x",
            "--core",
            "--epochs",
            "20",
            "--cell",
            "--compare",
            "--cell",
            "--compare",
            "--cell",
            "--histase",
        ])
        .a;
        let extra: Vec<String> = cases(&b, false, false).iter().map(|c| c.name.clone()).collect();
        assert_eq!(extra, ["default", "--no-selective --no-predict", "--histase", "--compare"]);
        assert_eq!(
            names(true),
            vec![
                (d, 20),
                ("--output-epoch-ms 2 --output-spacing-rate 0".to_string(), 20),
                ("--no-output-epochs".to_string(), 20)
            ]
        );
        let all = <Cli as clap::Parser>::parse_from(["x", "--epochs", "20,100"]).a;
        assert_eq!(cases(&all, true, false).len(), 13);
    }
}
