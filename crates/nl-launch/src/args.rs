//! The command-line arguments that describe a VM (workload, machine) and
//! the runs the CLI and the lab both start: `run`, `checkpoint`, `restore`,
//! and the recovery policy of a host.

use std::path::PathBuf;

use clap::{Args, ValueEnum};

/// Parses durations such as 1ms, 500us, 2s, 0.5s.
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let d = duration_in(s, 1.0)?;
    if d.is_zero() || d > std::time::Duration::from_secs(3600) {
        return Err(format!("'{s}' is out of range (0, 1h]"));
    }
    Ok(d)
}

/// Every duration flag goes through here: a bare number is in the flag's
/// own unit (`bare_unit` seconds: 1.0 for seconds, 1e-3 for milliseconds,
/// as the flag's help says), anything else is a humantime duration such as
/// `1.5s`, `500ms`, `2min` or `1h 30m`. At most one week.
pub fn duration_in(s: &str, bare_unit: f64) -> Result<std::time::Duration, String> {
    let t = s.trim();
    let secs = if let Ok(n) = t.parse::<f64>() {
        n * bare_unit
    } else if let Ok(d) = humantime::parse_duration(t) {
        d.as_secs_f64()
    } else {
        // humantime takes whole numbers only: also accept a decimal with one unit.
        let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let scale = match unit.trim() {
            "h" => 3600.0,
            "min" | "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" => 1e-6,
            _ => return Err(format!("'{s}' is not a duration (e.g. 1.5s, 500ms, 2min)")),
        };
        num.parse::<f64>()
            .map_err(|_| format!("'{s}' is not a duration (e.g. 1.5s, 500ms, 2min)"))?
            * scale
    };
    if !(secs.is_finite() && (0.0..=7.0 * 86400.0).contains(&secs)) {
        return Err(format!("'{s}' is out of range (0 to one week)"));
    }
    Ok(std::time::Duration::from_secs_f64(secs))
}

/// A duration flag whose bare numbers are seconds, as f64 seconds.
pub fn secs(s: &str) -> Result<f64, String> {
    duration_in(s, 1.0).map(|d| d.as_secs_f64())
}

/// A duration flag whose bare numbers are milliseconds, as f64 milliseconds.
pub fn millis_f64(s: &str) -> Result<f64, String> {
    duration_in(s, 1e-3).map(|d| d.as_secs_f64() * 1e3)
}

/// A duration flag whose bare numbers are milliseconds, as whole milliseconds.
pub fn millis(s: &str) -> Result<u64, String> {
    let d = duration_in(s, 1e-3)?;
    let ms = d.as_secs_f64() * 1e3;
    if ms.fract() != 0.0 {
        return Err(format!("'{s}' is not a whole number of milliseconds"));
    }
    Ok(ms as u64)
}

#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    ValueEnum,
    Default,
    serde::Serialize,
    serde::Deserialize,
    schemars::JsonSchema,
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
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    ValueEnum,
    Default,
    serde::Serialize,
    serde::Deserialize,
    schemars::JsonSchema,
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
    /// How long a guest may go without a heartbeat before it counts as hung
    /// (a number of seconds, or e.g. 1.5s, 500ms, 2min). A VM's supervisor
    /// counts wall time and ends the run (default 10 s); under `checkpoint`
    /// it is guest CPU time and a hang is rolled back (default 1 s).
    /// `--hang-timeout` is the same option (its former name under checkpoint).
    #[arg(long, alias = "hang-timeout", value_parser = secs)]
    pub heartbeat_timeout: Option<f64>,
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
    /// Bring the host end of --net-tap up with this address, e.g.
    /// 10.0.0.1/24, so the guest is reachable at once (needs root, as
    /// creating the TAP does). Without it the TAP is left as it is, with a
    /// warning if it is down.
    #[arg(long)]
    pub net_host_ip: Option<String>,
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
            heartbeat_timeout: None,
            disk: None,
            disk_readonly: false,
            net_tap: None,
            net_ip: "10.0.0.2/24".into(),
            net_host_ip: None,
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
    /// How long each workload runs after its warm-up round (a number of seconds, or e.g. 1.5s, 500ms, 2min).
    #[arg(long, default_value = "3", value_parser = secs)]
    pub duration: f64,
    /// Append the guests' console output to this file.
    #[arg(long)]
    pub console: Option<PathBuf>,
    /// Print one JSON object as the last line of stdout.
    #[arg(long)]
    pub json: bool,
    /// Linux kernel command line, when --kernel is a Linux bzImage or
    /// vmlinux (see docs/linux-guests.md; --duration is then its time limit).
    #[arg(long, default_value = crate::run_linux::DEFAULT_CMDLINE)]
    pub cmdline: String,
    /// An initrd (initramfs) for a Linux kernel.
    #[arg(long)]
    pub initrd: Option<PathBuf>,
    /// The Linux kernel's System.map: names the guest function where it stopped.
    #[arg(long)]
    pub system_map: Option<PathBuf>,
    /// Run the VMs this configuration file describes instead (JSON:
    /// {"vms": [...]}, each VM as in the host API's POST /v1/vms, its
    /// duration 3 s unless given; see docs/config.md). The options that
    /// describe a VM cannot be given with it.
    #[arg(long, conflicts_with_all = CONFIG_CONFLICTS)]
    pub config: Option<PathBuf>,
}

/// The `run` options a configuration file replaces.
const CONFIG_CONFLICTS: [&str; 22] = [
    "workload",
    "seed",
    "ws",
    "write_pct",
    "pattern",
    "stride",
    "hot_pct",
    "data",
    "mem",
    "vcpus",
    "kernel",
    "timer_hz",
    "heartbeat_timeout",
    "disk",
    "disk_readonly",
    "net_tap",
    "net_ip",
    "net_host_ip",
    "net_rx_irq",
    "vms",
    "duration",
    "console",
];

impl Default for RunArgs {
    fn default() -> Self {
        Self {
            workload: WorkloadArgs::default(),
            machine: MachineArgs::default(),
            vms: 1,
            duration: 3.0,
            console: None,
            json: false,
            cmdline: crate::run_linux::DEFAULT_CMDLINE.into(),
            initrd: None,
            system_map: None,
            config: None,
        }
    }
}

pub fn parse_repairs(s: &str) -> Result<nl_vmm::recovery::Repairs, String> {
    nl_vmm::recovery::Repairs::parse(s)
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

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CkptMode {
    /// Copy-on-write: write-protect all memory at each checkpoint.
    CowB,
    /// Copy-on-write with dirty-page prediction and pre-saving.
    CowP,
    /// KVM dirty logging into a full shadow image (the baseline).
    DirtyLog,
    /// Fault-free: no write tracking; each checkpoint compares every
    /// allocated page with a full shadow image on all host cores.
    Compare,
    /// Dirty log or compare, chosen each interval from the dirty rate and
    /// this host's unit costs (measured at start-up).
    Auto,
}

#[derive(Args, Clone, Debug)]
pub struct CheckpointArgs {
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten)]
    pub machine: MachineArgs,
    /// How long the workload runs after its warm-up round (a number of seconds, or e.g. 1.5s, 500ms, 2min).
    #[arg(long, default_value = "3", value_parser = secs)]
    pub duration: f64,
    /// Checkpoint interval (default 50 ms) (a number of milliseconds, or e.g. 20ms, 1.5s).
    #[arg(long, value_parser = millis_f64)]
    pub interval: Option<f64>,
    /// How checkpoints are taken.
    #[arg(long, value_enum, default_value_t = CkptMode::Auto)]
    pub mode: CkptMode,
    /// CoW modes: pages saved and unprotected per write fault (a power of
    /// two; 1 = page-granular copy-on-write exactly as in the paper).
    #[arg(long, default_value_t = 16)]
    pub block_pages: usize,
    /// Inject this many guest faults (random bit flips in memory or registers).
    #[arg(long, default_value_t = 0)]
    pub inject_guest_fault: u32,
    /// Error-latency bound T_B of the guest's self-check (a number of milliseconds, or e.g. 20ms, 1.5s); rollbacks go back
    /// at least this far (and at least the hang timeout).
    #[arg(long, value_parser = millis_f64)]
    pub latency_bound: Option<f64>,
    /// File of measured error latencies (ms, one per line); T_B is their 95th percentile.
    #[arg(long)]
    pub latency_file: Option<PathBuf>,
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

impl MachineArgs {
    /// A VM supervisor's heartbeat timeout (s): wall time without a heartbeat.
    pub const HEARTBEAT_TIMEOUT: f64 = 10.0;

    /// `--heartbeat-timeout`, or the VM supervisor's default.
    pub fn heartbeat_timeout(&self) -> f64 {
        self.heartbeat_timeout.unwrap_or(Self::HEARTBEAT_TIMEOUT)
    }
}

impl CheckpointArgs {
    /// The checkpoint supervisor's default hang timeout (s of guest CPU time).
    pub const HANG_TIMEOUT: f64 = 1.0;

    /// Guest CPU time without a heartbeat that counts as a hang, rolled
    /// back (`--heartbeat-timeout`, alias `--hang-timeout`).
    pub fn hang_timeout(&self) -> f64 {
        self.machine.heartbeat_timeout.unwrap_or(Self::HANG_TIMEOUT)
    }
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
    /// A Linux VM's file: seconds the restored VM runs unless it resets or
    /// stops first (default 60). A reference-guest VM runs its workload to
    /// the end instead.
    #[arg(long)]
    pub duration: Option<f64>,
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
