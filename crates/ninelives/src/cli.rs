//! Command-line syntax.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Parser, Debug)]
#[command(
    name = "ninelives",
    version,
    about = "A KVM virtual machine monitor built to keep its guests alive through faults."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Boot VMs with the reference guest, run a workload, verify its digest.
    Run(RunArgs),
    /// Guest/native throughput ratios of every workload.
    Bench(BenchArgs),
    /// A long-running VMM hosting several VMs, driven over a Unix socket API.
    Host(HostArgs),
    /// Send one request to a running host's API and print the reply.
    Api(ApiArgs),
    /// Replace a running host's VMM process (same or new binary) while its VMs survive.
    Rejuvenate(crate::cmd::rejuvenate::RejuvenateArgs),
}

impl Default for Command {
    fn default() -> Self {
        Command::Run(RunArgs::default())
    }
}

#[derive(
    Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum WorkloadName {
    /// Writes and reads a working set (the dirtying patterns checkpointing depends on).
    #[default]
    Memwrite,
    /// CPU-bound integer work.
    Compute,
    /// A steady mix of VM exits: port I/O, MMIO, halts with timer wake-ups.
    Exits,
    /// Halts until the timer wakes it.
    Idle,
}

#[derive(
    Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum PatternName {
    Sequential,
    Strided,
    #[default]
    Random,
    Hotcold,
}

/// What each VM runs.
#[derive(Args, Clone, Debug)]
pub struct WorkloadArgs {
    /// Workload to run in ring 3 of every VM.
    #[arg(long, value_enum, default_value_t = WorkloadName::Memwrite)]
    pub workload: WorkloadName,
    /// Seed of the workload (vCPU i uses a seed derived from it).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// memwrite: working-set size per vCPU (e.g. 64M, 1G).
    #[arg(long, default_value = "64M", value_parser = parse_size)]
    pub ws: u64,
    /// memwrite: percentage of accesses that are writes.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u64).range(0..=100))]
    pub write_pct: u64,
    /// memwrite: access pattern.
    #[arg(long, value_enum, default_value_t = PatternName::Random)]
    pub pattern: PatternName,
    /// memwrite strided: stride in bytes.
    #[arg(long, default_value_t = 4096)]
    pub stride: u64,
    /// memwrite hotcold: hot share of the working set in percent.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=100))]
    pub hot_pct: u64,
}

impl Default for WorkloadArgs {
    fn default() -> Self {
        Self {
            workload: WorkloadName::Memwrite,
            seed: 1,
            ws: 64 << 20,
            write_pct: 50,
            pattern: PatternName::Random,
            stride: 4096,
            hot_pct: 10,
        }
    }
}

/// How each VM is built.
#[derive(Args, Clone, Debug)]
pub struct MachineArgs {
    /// Guest memory per VM (e.g. 256M, 2G).
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    pub mem: u64,
    /// vCPUs per VM.
    #[arg(long, default_value_t = 1)]
    pub vcpus: u32,
    /// A kernel ELF to boot instead of the embedded reference kernel.
    #[arg(long)]
    pub kernel: Option<PathBuf>,
    /// Guest timer frequency in Hz.
    #[arg(long, default_value_t = 100)]
    pub timer_hz: u64,
    /// Declare a VM hung after this many seconds without a heartbeat.
    #[arg(long, default_value_t = 10.0)]
    pub heartbeat_timeout: f64,
}

impl Default for MachineArgs {
    fn default() -> Self {
        Self { mem: 256 << 20, vcpus: 1, kernel: None, timer_hz: 100, heartbeat_timeout: 10.0 }
    }
}

#[derive(Args, Clone, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten)]
    pub machine: MachineArgs,
    /// Number of VMs, all in this one VMM process.
    #[arg(long, default_value_t = 1)]
    pub vms: u32,
    /// Seconds each workload runs after its warm-up round.
    #[arg(long, default_value_t = 3.0)]
    pub duration: f64,
    /// Append the guests' console output to this file.
    #[arg(long)]
    pub console: Option<PathBuf>,
    /// Print one JSON object as the last line of stdout.
    #[arg(long)]
    pub json: bool,
}

impl Default for RunArgs {
    fn default() -> Self {
        Self {
            workload: WorkloadArgs::default(),
            machine: MachineArgs::default(),
            vms: 1,
            duration: 3.0,
            console: None,
            json: false,
        }
    }
}

#[derive(Args, Clone, Debug)]
pub struct BenchArgs {
    /// A benchmark suite of its own (default: the guest/native ratios).
    #[command(subcommand)]
    pub suite: Option<BenchSuite>,
    /// Seconds each measurement runs (guest and native alike).
    #[arg(long, default_value_t = 2.0)]
    pub duration: f64,
    /// Only these workloads (default: all).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub workloads: Vec<WorkloadName>,
    /// Boots measured for the boot-time entry.
    #[arg(long, default_value_t = 5)]
    pub boots: u32,
    /// Print one JSON object as the last line of stdout.
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand, Clone, Debug)]
pub enum BenchSuite {
    /// Downtime of warm, cold and save-restore rejuvenation, and the paper's downtime model.
    Rejuvenate(crate::cmd::bench_rejuvenate::BenchRejuvenateArgs),
}

#[derive(Args, Clone, Debug)]
pub struct HostArgs {
    /// Unix socket to serve the API on.
    #[arg(long)]
    pub api: PathBuf,
    /// Internal (rejuvenation): take VMs over from the handover record in this fd.
    #[arg(long, hide = true, requires = "handover_ctl")]
    pub handover_fd: Option<i32>,
    /// Internal (rejuvenation): control socket to the previous VMM process.
    #[arg(long, hide = true, requires = "handover_fd")]
    pub handover_ctl: Option<i32>,
}

#[derive(Args, Clone, Debug)]
pub struct ApiArgs {
    /// Unix socket of the host.
    #[arg(long)]
    pub api: PathBuf,
    /// The request, a JSON object such as '{"op":"list"}'.
    pub request: String,
}

/// Parses sizes such as 4096, 64K, 256M, 2G, 1GiB.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("'{s}' is not a size (e.g. 256M, 1G)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return Err(format!("'{s}': unknown unit '{unit}' (use K, M or G)")),
    };
    n.checked_mul(mult).ok_or_else(|| format!("'{s}' is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert!(parse_size("12X").is_err());
        assert!(parse_size("M").is_err());
        assert!(parse_size("99999999999G").is_err());
    }
}
