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
    /// seccomp-bpf filters on the VMM's threads (vCPU, device, events,
    /// watchdog, API, microreboot): a forbidden syscall is detected like a
    /// fatal signal. `off` turns them off.
    #[arg(long, global = true, value_enum, default_value_t = OnOff::On)]
    pub seccomp: OnOff,
}

/// A switch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Default)]
pub enum OnOff {
    #[default]
    On,
    Off,
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
    /// Run a VM under VM-μCheckpoint (in-memory checkpoints, rollback on error).
    Checkpoint(CheckpointArgs),
    /// Restore a VM from a disk checkpoint file and run it to completion.
    Restore(RestoreArgs),
    /// UDP ping at a fixed interval: sent, received, longest gap between
    /// replies, and every 1-second window whose reception dropped below 90%.
    Ping(PingArgs),
    /// Replace a running host's VMM process (same or new binary) while its VMs survive.
    Rejuvenate(crate::cmd::rejuvenate::RejuvenateArgs),
    /// Primary/backup replication (HBFT): run a VM protected by a backup VMM, or be that backup.
    #[command(subcommand)]
    Replicate(crate::cmd::replicate::ReplicateCmd),
    /// Fault-injection campaign against `ninelives host` processes (ptrace).
    Inject(crate::cmd::inject::InjectArgs),
    /// Load and check a kv server: ops/s, latency percentiles, and every
    /// read checked against the last acknowledged write.
    Kvload(crate::cmd::kvload::KvloadArgs),
    /// Internal (bench): a host UDP echo responder, the netbench baseline.
    #[command(hide = true)]
    EchoServer(crate::cmd::echo_server::EchoServerArgs),
}

#[derive(Args, Clone, Debug)]
pub struct PingArgs {
    /// Target ADDR or ADDR:PORT (port 7 by default).
    #[arg(long)]
    pub target: String,
    /// Time between pings, e.g. 1ms, 500us, 0.01s.
    #[arg(long, default_value = "1ms", value_parser = parse_duration)]
    pub interval: std::time::Duration,
    /// Seconds to send for.
    #[arg(long, default_value_t = 5.0)]
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

/// Parses durations such as 1ms, 500us, 2s, 0.5s.
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("'{s}' is not a duration (e.g. 1ms)"))?;
    let secs = match unit {
        "s" | "" => n,
        "ms" => n / 1e3,
        "us" => n / 1e6,
        _ => return Err(format!("'{s}': unknown unit '{unit}' (use s, ms or us)")),
    };
    if !(secs.is_finite() && secs > 0.0 && secs <= 3600.0) {
        return Err(format!("'{s}' is out of range"));
    }
    Ok(std::time::Duration::from_secs_f64(secs))
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
    /// Creates, copies, reads, overwrites and removes 1 MiB files on the
    /// virtio-blk disk (a tiny extent-based file store), verifying every read.
    Blkbench,
    /// Answers UDP packets to port 7 (needs --net-tap and --net-ip).
    Netbench,
    /// A key-value server on TCP port 7000 (needs --net-tap and --net-ip;
    /// `ninelives kvload` drives and checks it).
    Kv,
    /// A file cache in guest memory over a data set on the virtio-blk disk
    /// (--data; --ws is the cache): hot/cold block requests, hits served
    /// from memory, misses read from the disk, every block checked.
    Filecache,
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
    /// memwrite: working-set size per vCPU (e.g. 64M, 1G; default 64M);
    /// filecache: the cache's size (default: room for the whole data set).
    #[arg(long, value_parser = parse_size)]
    pub ws: Option<u64>,
    /// memwrite: percentage of accesses that are writes.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u64).range(0..=100))]
    pub write_pct: u64,
    /// memwrite: access pattern.
    #[arg(long, value_enum, default_value_t = PatternName::Random)]
    pub pattern: PatternName,
    /// memwrite strided: stride in bytes.
    #[arg(long, default_value_t = 4096)]
    pub stride: u64,
    /// memwrite hotcold: hot share of the working set in percent;
    /// filecache: hot share of the data set's blocks (90% of the requests).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=100))]
    pub hot_pct: u64,
    /// filecache: size of the data set on the disk (a multiple of 16K).
    #[arg(long, default_value = "192M", value_parser = parse_size)]
    pub data: u64,
}

impl Default for WorkloadArgs {
    fn default() -> Self {
        Self {
            workload: WorkloadName::Memwrite,
            seed: 1,
            ws: None,
            write_pct: 50,
            pattern: PatternName::Random,
            stride: 4096,
            hot_pct: 10,
            data: nl_workloads::filecache::DEFAULT_DATA_BYTES,
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
    /// A raw disk image for a virtio-blk device (created sparse, 256 MiB or
    /// what filecache's data set needs, if missing). blkbench and filecache
    /// without --disk use a temporary image per VM.
    #[arg(long)]
    pub disk: Option<PathBuf>,
    /// Offer the disk read-only (guest writes fail with the virtio error status).
    #[arg(long)]
    pub disk_readonly: bool,
    /// Give the VM a virtio-net device on this host TAP interface (attached,
    /// or created, in the VMM's network namespace).
    #[arg(long)]
    pub net_tap: Option<String>,
    /// The guest's IPv4 address and prefix, e.g. 10.0.0.2/24.
    #[arg(long, default_value = "10.0.0.2/24")]
    pub net_ip: String,
    /// Experimental: a VMM thread delivers received frames and raises the
    /// net interrupt; the reference guest halts when idle instead of spinning.
    #[arg(long)]
    pub net_rx_irq: bool,
}

impl Default for MachineArgs {
    fn default() -> Self {
        Self {
            mem: 256 << 20,
            vcpus: 1,
            kernel: None,
            timer_hz: 100,
            heartbeat_timeout: 10.0,
            disk: None,
            disk_readonly: false,
            net_tap: None,
            net_ip: "10.0.0.2/24".into(),
            net_rx_irq: false,
        }
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
    /// Linux kernel command line, when --kernel is a Linux bzImage or
    /// vmlinux (see docs/linux-guests.md; --duration is then its time limit).
    #[arg(long, default_value = crate::cmd::run_linux::DEFAULT_CMDLINE)]
    pub cmdline: String,
    /// An initrd (initramfs) for a Linux kernel.
    #[arg(long)]
    pub initrd: Option<PathBuf>,
    /// The Linux kernel's System.map: names the guest function where it stopped.
    #[arg(long)]
    pub system_map: Option<PathBuf>,
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
            cmdline: crate::cmd::run_linux::DEFAULT_CMDLINE.into(),
            initrd: None,
            system_map: None,
        }
    }
}

#[derive(Subcommand, Debug, Clone)]
pub enum BenchMechanism {
    /// VM-μCheckpoint: overhead matrix, write faults, checkpoint size, rollback.
    Checkpoint(BenchCheckpointArgs),
    /// Downtime of warm, cold and save-restore rejuvenation, and the paper's downtime model.
    Rejuvenate(crate::cmd::bench_rejuvenate::BenchRejuvenateArgs),
    /// memwrite under replication against the unreplicated VM, per optimization and epoch length.
    Replicate(crate::cmd::bench_replicate::BenchReplicateArgs),
    /// VMM recovery: ping-gap latency of microreset and microreboot, VMM CPU overhead.
    Recovery(crate::cmd::bench_recovery::BenchRecoveryArgs),
    /// Attack campaign: hostile API clients and replication peers against real
    /// host and backup processes, each try classified (clean refusal, crash,
    /// hang, wrong success, other VMs harmed).
    Hostile(crate::cmd::bench_hostile::BenchHostileArgs),
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
    /// Boots measured for the boot-time entry.
    #[arg(long, default_value_t = 5)]
    pub boots: u32,
    /// Print one JSON object as the last line of stdout.
    #[arg(long)]
    pub json: bool,
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
    /// What to do when a detector (fatal signal, panic, hang) fires.
    #[arg(long, value_enum, default_value_t = RecoveryName::None)]
    pub recovery: RecoveryName,
    /// The repairs a microreset makes: all, none, or a comma-separated list
    /// of counters, locks, retry, metadata, timers, memory.
    #[arg(long, default_value = "all", value_parser = parse_repairs)]
    pub repairs: nl_vmm::recovery::Repairs,
    /// Internal (microreboot): the recovery record in this fd.
    #[arg(long, hide = true, requires = "reboot_checksum")]
    pub reboot_record: Option<i32>,
    /// Internal (microreboot): the record's checksum (hex).
    #[arg(long, hide = true, value_parser = parse_hex)]
    pub reboot_checksum: Option<u64>,
    /// Guest memory the hosted VMs may commit together, e.g. 16G; `create`
    /// is refused past it [default: the host's available memory at start
    /// minus 1 GiB or a tenth, whichever is more]. This and the limits
    /// below carry over to the process that takes over after a
    /// rejuvenation or microreboot, unless given to it again.
    #[arg(long, value_parser = parse_size)]
    pub mem_budget: Option<u64>,
    /// vCPUs the hosted VMs may have together [default: 16 per online CPU,
    /// at least 32].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub vcpu_budget: Option<u32>,
    /// API connections served at once; one more is refused with an error
    /// line [default: 64].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_connections: Option<u32>,
    /// Time limit of one API request from its first byte to its newline
    /// (e.g. 10s, 500ms); a slower request is refused and its connection
    /// closed [default: 10s].
    #[arg(long, value_parser = parse_duration)]
    pub request_timeout: Option<std::time::Duration>,
    /// An API connection with no request for this long is closed [default: 600s].
    #[arg(long, value_parser = parse_duration)]
    pub idle_timeout: Option<std::time::Duration>,
}

pub fn parse_repairs(s: &str) -> Result<nl_vmm::recovery::Repairs, String> {
    nl_vmm::recovery::Repairs::parse(s)
}

fn parse_hex(s: &str) -> Result<u64, String> {
    u64::from_str_radix(s, 16).map_err(|e| format!("not a hex number: {e}"))
}

/// Recovery policies after a detected VMM error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Default)]
pub enum RecoveryName {
    /// End the VMM and its VMs (exit status 86): the baseline.
    #[default]
    None,
    /// NiLiHype: discard the VMM's threads, repair its state, resume in place.
    Microreset,
    /// ReHype: exec a fresh VMM process that takes the VMs over.
    Microreboot,
}

impl RecoveryName {
    pub fn policy(self, repairs: nl_vmm::recovery::Repairs) -> nl_vmm::recovery::Policy {
        match self {
            RecoveryName::None => nl_vmm::recovery::Policy::None,
            RecoveryName::Microreset => nl_vmm::recovery::Policy::Microreset(repairs),
            RecoveryName::Microreboot => nl_vmm::recovery::Policy::Microreboot,
        }
    }

    pub fn name(self) -> &'static str {
        self.policy(nl_vmm::recovery::Repairs::ALL).name()
    }
}

#[derive(Args, Clone, Debug)]
pub struct ApiArgs {
    /// Unix socket of the host.
    #[arg(long)]
    pub api: PathBuf,
    /// The request, a JSON object such as '{"op":"list"}'.
    pub request: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CkptMode {
    /// Copy-on-write: write-protect all memory at each checkpoint.
    CowB,
    /// Copy-on-write with dirty-page prediction and pre-saving.
    CowP,
    /// KVM dirty logging into a full shadow image (the baseline).
    DirtyLog,
}

#[derive(Args, Clone, Debug)]
pub struct CheckpointArgs {
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten)]
    pub machine: MachineArgs,
    /// Seconds the workload runs after its warm-up round.
    #[arg(long, default_value_t = 3.0)]
    pub duration: f64,
    /// Checkpoint interval in milliseconds (default: 50, or above the latency bound).
    #[arg(long)]
    pub interval: Option<f64>,
    /// How checkpoints are taken.
    #[arg(long, value_enum, default_value_t = CkptMode::CowP)]
    pub mode: CkptMode,
    /// CoW modes: pages saved and unprotected per write fault (a power of
    /// two; 1 = page-granular copy-on-write exactly as in the paper).
    #[arg(long, default_value_t = 16)]
    pub block_pages: usize,
    /// Inject this many guest faults (random bit flips in memory or registers).
    #[arg(long, default_value_t = 0)]
    pub inject_guest_fault: u32,
    /// Error-latency bound T_B in milliseconds; the interval must exceed it.
    #[arg(long)]
    pub latency_bound: Option<f64>,
    /// File of measured error latencies (ms, one per line); T_B is their 95th percentile.
    #[arg(long)]
    pub latency_file: Option<PathBuf>,
    /// Seconds without a heartbeat that count as a detected error.
    #[arg(long, default_value_t = 1.0)]
    pub hang_timeout: f64,
    /// Write the committed checkpoint to --disk-path every N checkpoints.
    #[arg(long, default_value_t = 0)]
    pub disk_every: u32,
    /// File for --disk-every (replaced atomically each time).
    #[arg(long, default_value = "ninelives.ckpt")]
    pub disk_path: PathBuf,
    /// Authenticate the disk checkpoints with an HMAC-SHA256 under this key
    /// (a file of at least 32 bytes, mode 0600 or stricter); `restore` then
    /// needs the same --key-file.
    #[arg(long)]
    pub key_file: Option<PathBuf>,
    /// Append the guest's console output to this file.
    #[arg(long)]
    pub console: Option<PathBuf>,
    /// Print one JSON object as the last line of stdout.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Clone, Debug)]
pub struct RestoreArgs {
    /// A file written by `checkpoint --disk-every`.
    pub file: PathBuf,
    /// The key the file was written with (`checkpoint --key-file`): its MAC
    /// must verify. An authenticated file is refused without it, and an
    /// unauthenticated file is refused with it.
    #[arg(long)]
    pub key_file: Option<PathBuf>,
    /// Append the guest's console output to this file.
    #[arg(long)]
    pub console: Option<PathBuf>,
    /// Print one JSON object as the last line of stdout.
    #[arg(long)]
    pub json: bool,
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
