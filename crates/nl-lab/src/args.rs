//! The lab's command-line arguments: `ping` and `bench`.

use std::path::PathBuf;

use clap::{Args, Subcommand};

use nl_launch::args::{parse_duration, WorkloadName};

#[derive(Args, Clone, Debug)]
pub struct PingArgs {
    /// Target ADDR or ADDR:PORT (port 7 by default).
    #[arg(long)]
    pub target: String,
    /// Time between pings, e.g. 1ms, 500us, 0.01s.
    #[arg(long, default_value = "1ms", value_parser = parse_duration)]
    pub interval: std::time::Duration,
    /// How long to send for (a number of seconds, or e.g. 1.5s, 500ms, 2min).
    #[arg(long, default_value = "5", value_parser = nl_launch::args::secs)]
    pub duration: f64,
    /// Also stop sending when standard input reaches end of file (for a
    /// caller that ends the run; `--duration` still bounds it). Prints
    /// `sending` as the first line of stdout when the clock starts.
    #[arg(long)]
    pub until_stdin_eof: bool,
    /// Print one JSON object as the last line of stdout.
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand, Debug, Clone)]
pub enum BenchMechanism {
    /// VM-μCheckpoint: overhead matrix, write faults, checkpoint size, rollback.
    Checkpoint(BenchCheckpointArgs),
    /// Downtime of warm, cold and save-restore rejuvenation, and the paper's downtime model.
    Rejuvenate(crate::bench::rejuvenate::BenchRejuvenateArgs),
    /// Throughput under replication (memwrite, blkbench, kv) against the unreplicated VM: the defaults, each optimization turned off, epoch lengths; and a kill campaign.
    Replicate(crate::bench::replicate::BenchReplicateArgs),
    /// VMM recovery: ping-gap latency of microreset and microreboot, VMM CPU overhead.
    Recovery(crate::bench::recovery::BenchRecoveryArgs),
    /// Attack campaign: hostile API clients and replication peers against real
    /// host and backup processes, each try classified (clean refusal, crash,
    /// hang, wrong success, other VMs harmed).
    Hostile(crate::bench::hostile::BenchHostileArgs),
    /// Sandboxes (Quest-V): channel message passing (Fig. 9) against the
    /// same channel code between two host threads.
    Sandbox(crate::bench::sandbox::BenchSandboxArgs),
    /// Sandbox fault recovery (Quest-V): service gap and phases per policy
    /// (Table 1), a fault-injection campaign, Fig. 10.
    SandboxRecovery(crate::bench::sandbox_recovery::BenchSandboxRecoveryArgs),
}

#[derive(Args, Clone, Debug)]
pub struct BenchCheckpointArgs {
    /// Seconds each measured run lasts [default: 1.5; with --loaded 3, so
    /// an injected fault's error is detected (1 s hang timeout) and rolled
    /// back within the run].
    #[arg(long)]
    pub duration: Option<f64>,
    /// Intervals (ms) of the overhead matrix.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1000.0, 600.0, 200.0, 50.0])]
    pub intervals: Vec<f64>,
    /// Injected-fault runs for the recovery share and rollback latency.
    #[arg(long, default_value_t = 100)]
    pub faults: u32,
    /// Also draw the paper's Figure 3 (normalized time per interval) as SVG files here.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Instead of the matrix: default `checkpoint` runs on a host loaded with
    /// CPU hogs; counts rollbacks of healthy guests and SDC after a fault.
    #[arg(long)]
    pub loaded: bool,
    /// --loaded: busy-loop threads started for the load.
    #[arg(long, default_value_t = 4)]
    pub hogs: u32,
    /// --loaded: fault-free runs.
    #[arg(long, default_value_t = 20)]
    pub runs: u32,
    /// --loaded: runs with one injected guest fault (seeds 1..=N).
    #[arg(long, default_value_t = 20)]
    pub seeds: u32,
    /// Instead of the matrix: the worst cases (every memwrite pattern, 1 to
    /// 64 MiB, at 50 ms) under auto, dirty-log and CoW-P, --reps times,
    /// with this host's unit costs and each row's lower bound; with
    /// --loaded, beside --hogs busy-loop threads.
    #[arg(long)]
    pub worst: bool,
    /// Repetitions (at least 3) of each matrix group, each against its
    /// own unprotected runs (the matrix keeps every sample and each cell's
    /// median with its spread); --worst: of each row.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(3..))]
    pub reps: u32,
    /// Print one JSON object as the last line of stdout.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Clone, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub mechanism: Option<BenchMechanism>,
    /// Seconds each measurement runs (guest and native alike).
    #[arg(long, default_value_t = 2.0)]
    pub duration: f64,
    /// Only these workloads (default: all).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub workloads: Vec<WorkloadName>,
    /// Repetitions of every cell, each a native run followed by its guest
    /// run (interleaved, so both see the same load).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(3..=100))]
    pub reps: u32,
    /// Boots measured for the boot-time entry.
    #[arg(long, default_value_t = 5)]
    pub boots: u32,
    /// Print one JSON object as the last line of stdout.
    #[arg(long)]
    pub json: bool,
}
