//! Command-line syntax of the `ninelives` binary: its subcommands and the
//! host's arguments. The arguments that describe a VM are in
//! [`nl_launch::args`], the lab's in [`nl_lab::args`].

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

pub use nl_lab::args::{BenchArgs, PingArgs};
pub use nl_launch::args::*;

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
    /// The least severe log events written to stderr.
    #[arg(long, global = true, value_enum, default_value_t = crate::logging::LogLevel::Info)]
    pub log_level: crate::logging::LogLevel,
    /// How log events are written: text lines, or one JSON object per line.
    #[arg(long, global = true, value_enum, default_value_t = crate::logging::LogFormat::Text)]
    pub log_format: crate::logging::LogFormat,
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
    Replicate(nl_launch::replicate::ReplicateCmd),
    /// Fault-injection campaign against `ninelives host` processes (ptrace).
    Inject(nl_lab::campaign::InjectArgs),
    /// Load and check a kv server: ops/s, latency percentiles, and every
    /// read checked against the last acknowledged write.
    Kvload(nl_lab::kvload::KvloadArgs),
    /// Run every bench and campaign (or read their JSON) and write an HTML
    /// report with SVG figures, the papers' numbers beside ours.
    Report(nl_lab::report::ReportArgs),
    /// Start a set of sandboxes (isolated VMs joined by shared-memory
    /// channels) from a configuration file and supervise them.
    Sandbox(crate::cmd::sandbox::SandboxArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions {
        /// The shell to complete for.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Write man pages (ninelives.1 and one per subcommand) into DIR.
    Man {
        /// Directory to write the pages into (created if missing).
        dir: PathBuf,
    },
    /// Internal (bench): a host UDP echo responder, the netbench baseline.
    #[command(hide = true)]
    EchoServer(nl_lab::echo_server::EchoServerArgs),
}

impl Default for Command {
    fn default() -> Self {
        Command::Run(RunArgs::default())
    }
}

#[derive(Args, Clone, Debug)]
pub struct HostArgs {
    /// Unix socket to serve the API on.
    #[arg(long)]
    pub api: PathBuf,
    /// Create the VMs this configuration file describes (JSON: {"vms":
    /// [...]}, each VM as in POST /v1/vms; see docs/config.md) before
    /// serving the API. The whole file is checked first.
    #[arg(long, conflicts_with_all = ["handover_fd", "reboot_record"])]
    pub config: Option<PathBuf>,
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
    /// Also serve the JSON-lines protocol of earlier releases on the API
    /// socket (deprecated: kept for one release; HTTP is always served).
    /// Carries over to the process that takes over, like the limits above.
    #[arg(long)]
    pub api_legacy: bool,
}

fn parse_hex(s: &str) -> Result<u64, String> {
    u64::from_str_radix(s, 16).map_err(|e| format!("not a hex number: {e}"))
}

#[derive(Args, Clone, Debug)]
pub struct ApiArgs {
    /// Unix socket of the host.
    #[arg(long, required_unless_present = "openapi")]
    pub api: Option<PathBuf>,
    /// The request, a JSON object such as '{"op":"list"}' or
    /// '{"op":"stats","id":0}', sent as the HTTP request it stands for
    /// (docs/api.md lists both forms); the reply is printed with "ok".
    #[arg(required_unless_present = "openapi")]
    pub request: Option<String>,
    /// Print the OpenAPI document of the host's HTTP API (docs/api.yaml) and exit.
    #[arg(long, conflicts_with_all = ["api", "request"])]
    pub openapi: bool,
}
