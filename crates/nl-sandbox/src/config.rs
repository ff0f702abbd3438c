//! The sandbox configuration file (JSON) and its checks. The schema is
//! published in docs/sandboxes.md.

use std::collections::BTreeSet;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::SandboxError;

/// Largest share of one core a budget may reserve (as in Linux's
/// `sched_rt_runtime_us` default of 95%).
pub const MAX_CORE_SHARE: f64 = 0.95;

/// A set of sandboxes and the channels between them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetConfig {
    pub sandboxes: Vec<SandboxConfig>,
    #[serde(default)]
    pub channels: Vec<ChannelConfig>,
    /// Services a standby sandbox takes over when their owner fails
    /// (remote recovery, [`crate::service`]).
    #[serde(default)]
    pub services: Vec<ServiceConfig>,
    /// Shared links: one host TAP several sandboxes are on, each with its
    /// own MAC and address (Quest-V's shared NIC driver,
    /// [`crate::shared_link`]); a sandbox names one in `net.link`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub links: Vec<LinkConfig>,
}

/// How a shared link hands the frames arriving on its TAP to the
/// sandboxes on it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LinkMode {
    /// By destination MAC, in each sandbox's packet filter on the TAP:
    /// each sandbox gets the frames for its MAC and every broadcast or
    /// multicast frame.
    #[default]
    Demux,
    /// Every frame to every sandbox on the link (its RX interrupt in
    /// each), each guest dropping what is not for its MAC (Quest-V's
    /// interrupt multicast, Table 3).
    Multicast,
}

/// A shared link: a host TAP that the set owns and its sandboxes share.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkConfig {
    pub name: String,
    /// The host TAP (attached, or created if missing, in the network
    /// namespace the set is created in); no sandbox's own `net.tap`.
    pub tap: String,
    #[serde(default)]
    pub mode: LinkMode,
    /// Bring the host end of the TAP up with this address, "10.0.0.1/24".
    #[serde(default)]
    pub host_ip: Option<String>,
}

/// A sandbox's own virtio-net device on a host TAP (see [`crate::net`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetSection {
    /// The host TAP interface (attached, or created if missing, in the
    /// network namespace the set is created in). No two sandboxes share one.
    /// Empty with `link`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub tap: String,
    /// A shared link of the set (`links[].name`) instead of a TAP of its
    /// own: the sandbox's device is a port on the link's TAP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link: Option<String>,
    /// The guest's MAC address, "52:54:00:12:34:56" (unicast).
    pub mac: String,
    /// The guest's address and prefix, "10.0.0.2/24".
    pub ipv4: String,
    /// Bring the host end of the TAP up with this address, "10.0.0.1/24".
    #[serde(default)]
    pub host_ip: Option<String>,
    /// Give the VM a receive thread (`vmN-netrx`) that moves arriving
    /// frames into the guest and interrupts it, so the guest halts while
    /// idle; the thread is in `budget.io` if there is one. Not for a
    /// service's owner (its standby's spare device has no TAP to start on).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub rx_irq: bool,
}

/// A service in the registry: its owner sandbox serves it on its `net`
/// identity (TAP, MAC, IPv4); on a fault in the owner, the standby takes
/// the TAP over and serves under the same identity.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceConfig {
    pub name: String,
    /// The sandbox serving it at the start; it needs a `net` section.
    pub owner: String,
    /// The sandbox that takes it over; it has no `net` of its own and runs
    /// with a spare virtio-net device under the owner's identity.
    pub standby: String,
    /// A state region (kv only): a memfd only the holder maps, read-write,
    /// moved to the standby at a takeover (`nl_sandbox::state`).
    #[serde(default)]
    pub state: Option<StateSection>,
}

/// A service's state region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateSection {
    /// Its size: an even number of MiB, at most 64.
    pub mib: u64,
}

/// One sandbox: a VM of its own.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxConfig {
    pub name: String,
    /// Guest RAM in MiB.
    #[serde(default = "default_mem_mib")]
    pub mem_mib: u64,
    /// Host cores its vCPUs are pinned to (vCPU i on `cores[i % len]`).
    pub cores: Vec<usize>,
    /// vCPUs (default: one per core).
    #[serde(default)]
    pub vcpus: Option<u32>,
    pub workload: WorkloadConfig,
    /// A file to back the sandbox's RAM instead of an anonymous memfd
    /// (created or truncated to `mem_mib`; e.g. under /dev/shm, to inspect
    /// the memory afterwards). No other sandbox may reach it.
    #[serde(default)]
    pub memory_file: Option<PathBuf>,
    /// A CPU reservation per vCPU thread.
    #[serde(default)]
    pub budget: Option<Budget>,
    /// What a write to a read-only channel page does.
    #[serde(default)]
    pub on_violation: ViolationPolicy,
    /// The sandbox monitor's detectors.
    #[serde(default)]
    pub detect: DetectConfig,
    /// What the monitor does when a detector fires.
    #[serde(default)]
    pub recovery: RecoveryConfig,
    /// A virtio-net device of its own on a host TAP.
    #[serde(default)]
    pub net: Option<NetSection>,
    /// A virtio-blk disk of its own (`crate::disk`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<DiskSection>,
}

/// A sandbox's own virtio-blk disk (see [`crate::disk`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskSection {
    /// The raw image (an absolute path; created sparse if missing). No
    /// other sandbox may reach it unless both have it read-only.
    pub path: PathBuf,
    /// Offer it read-only: the guest's writes fail with an I/O error.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub readonly: bool,
    /// Size of the image when the set creates it, in MiB (default 256).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_mib: Option<u64>,
}

/// The per-sandbox detectors' bounds (see `detect`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DetectConfig {
    /// Lost heartbeat: no guest progress while every live vCPU ran this
    /// long on a CPU (guest time, not wall time).
    #[serde(default = "default_heartbeat_cpu_ms")]
    pub heartbeat_cpu_ms: u64,
    /// Channel lag (Quest-V's ring-index check): words a peer has published
    /// on a channel that this sandbox has not consumed; `None`: off.
    #[serde(default)]
    pub channel_lag_words: Option<u64>,
    /// ... for at least this much of this sandbox's vCPU time without its
    /// consumption advancing.
    #[serde(default = "default_channel_lag_cpu_ms")]
    pub channel_lag_cpu_ms: u64,
    /// Output stall: none of this sandbox's own channel regions took a
    /// new record while its vCPUs ran this long (guest time); `None`: off.
    /// For a sandbox that streams on its channels (`chanstream`): it finds
    /// one that still heartbeats but no longer serves (a flipped register
    /// holding its send deadline), which the heartbeat cannot.
    #[serde(default)]
    pub output_stall_cpu_ms: Option<u64>,
    /// Channel check: the host reads every record this sandbox publishes
    /// on its channels and checks it (framing; a `chanstream` message byte
    /// for byte), and holds this sandbox's reports on its peers' streams
    /// against the host's own reading of them. `None`: on for `chanstream`
    /// sandboxes (low rates), off for others (a streaming `chanbench`
    /// would cost the host a core).
    #[serde(default)]
    pub channel_check: Option<bool>,
}

fn default_heartbeat_cpu_ms() -> u64 {
    1000
}
fn default_channel_lag_cpu_ms() -> u64 {
    100
}

impl Default for DetectConfig {
    fn default() -> Self {
        Self {
            heartbeat_cpu_ms: default_heartbeat_cpu_ms(),
            channel_lag_words: None,
            channel_lag_cpu_ms: default_channel_lag_cpu_ms(),
            output_stall_cpu_ms: None,
            channel_check: None,
        }
    }
}

/// The local recovery policy of a sandbox.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecoveryPolicy {
    /// Stop the sandbox and report (the default).
    #[default]
    Stop,
    /// Fresh memory, images reloaded, vCPUs and devices new; the channels
    /// stay (the sandbox's own output regions are withdrawn and it starts a
    /// new channel generation).
    Restart,
    /// `restart` with the workload `replace_with`.
    Replace,
    /// In-place μCheckpoint rollback (nl-checkpoint): the sandbox keeps its
    /// state.
    Rollback,
}

impl RecoveryPolicy {
    pub fn name(self) -> &'static str {
        match self {
            RecoveryPolicy::Stop => "stop",
            RecoveryPolicy::Restart => "restart",
            RecoveryPolicy::Replace => "replace",
            RecoveryPolicy::Rollback => "rollback",
        }
    }
}

/// What the monitor does when a detector fires, and its bounds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecoveryConfig {
    #[serde(default)]
    pub policy: RecoveryPolicy,
    /// `replace`: the workload the sandbox restarts with.
    #[serde(default)]
    pub replace_with: Option<WorkloadConfig>,
    /// At most this many recoveries within `window_ms`; one more fault
    /// stops the sandbox with a report instead of recovering again.
    #[serde(default = "default_max_recoveries")]
    pub max_recoveries: u32,
    #[serde(default = "default_window_ms")]
    pub window_ms: u64,
    /// `rollback`: the checkpoint interval.
    #[serde(default = "default_checkpoint_interval_ms")]
    pub checkpoint_interval_ms: u64,
    /// `rollback`: hold the sandbox's network output until no rollback can
    /// undo it (nl_checkpoint's output commit); `None`: on for `rollback`.
    /// A service under rollback then never loses what it acknowledged, and
    /// its replies wait about `detect.heartbeat_cpu_ms` of guest time plus
    /// one checkpoint interval.
    #[serde(default)]
    pub output_commit: Option<bool>,
    /// `rollback` with output commit: when held output leaves
    /// (`detection_latency`, the default: `detect.heartbeat_cpu_ms` of guest
    /// time after its checkpoint; `next_checkpoint`: when the checkpoint
    /// after its own is taken, assuming errors are found within one
    /// interval; see nl_checkpoint's `CommitRule`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release: Option<nl_checkpoint::CommitRule>,
}

impl RecoveryConfig {
    /// Whether the sandbox's output is held (`rollback` only; on unless
    /// `recovery.output_commit` is false).
    pub fn output_commit(&self) -> bool {
        self.policy == RecoveryPolicy::Rollback && self.output_commit.unwrap_or(true)
    }
}

fn default_max_recoveries() -> u32 {
    5
}
fn default_window_ms() -> u64 {
    10_000
}
fn default_checkpoint_interval_ms() -> u64 {
    100
}

impl Default for RecoveryConfig {
    fn default() -> Self {
        Self {
            policy: RecoveryPolicy::Stop,
            replace_with: None,
            max_recoveries: default_max_recoveries(),
            window_ms: default_window_ms(),
            checkpoint_interval_ms: default_checkpoint_interval_ms(),
            output_commit: None,
            release: None,
        }
    }
}

fn default_mem_mib() -> u64 {
    64
}

/// `runtime_us` of every `period_us` per vCPU thread: a cap (CFS
/// bandwidth), or with `reserve` also a reservation (real-time bandwidth:
/// the runtime is the sandbox's before any ordinary thread on its cores).
/// See [`crate::budget`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Budget {
    pub runtime_us: u64,
    pub period_us: u64,
    /// Reserve the runtime, not only cap it.
    #[serde(default)]
    pub reserve: bool,
    /// The budget of the sandbox's I/O threads (its net receive thread),
    /// in a cgroup of their own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub io: Option<IoBudget>,
}

impl Budget {
    pub fn share(&self) -> f64 {
        self.runtime_us as f64 / self.period_us as f64
    }
}

/// `runtime_us` of every `period_us` per I/O thread of a sandbox (device
/// and receive threads): a cap (CFS bandwidth) on a cgroup of their own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IoBudget {
    pub runtime_us: u64,
    pub period_us: u64,
}

impl IoBudget {
    pub fn share(&self) -> f64 {
        self.runtime_us as f64 / self.period_us as f64
    }
}

/// The error for a budget (`what`: `budget` or `budget.io`) of more than
/// [`MAX_CORE_SHARE`] of a core, if it is.
fn over_core_share(sandbox: &str, what: &str, runtime_us: u64, period_us: u64) -> Option<String> {
    let share = runtime_us as f64 / period_us as f64;
    (share > MAX_CORE_SHARE).then(|| {
        format!(
            "sandbox '{sandbox}': {what} {runtime_us} us every {period_us} us is {:.0}% of a core, more than the {:.0}% allowed",
            share * 100.0,
            MAX_CORE_SHARE * 100.0
        )
    })
}

/// The kernel's least CFS quota and period (µs).
pub const MIN_CFS_US: u64 = 1_000;

/// What the monitor does when its sandbox writes to a read-only channel page.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ViolationPolicy {
    /// Stop the sandbox and report (the default).
    #[default]
    Stop,
    /// Report, drop the write and let the sandbox run on (isolation tests).
    Report,
}

/// The workload a sandbox runs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkloadConfig {
    /// memwrite, compute, idle, chanbench, wildwrite, chanstream, doorbell,
    /// syscall, tlbwalk, periodic, storm, blkbench (needs a `disk`).
    pub kind: String,
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// memwrite, compute: how long the measured period lasts.
    #[serde(default = "default_duration_ms")]
    pub duration_ms: u64,
    /// memwrite: working set per vCPU in MiB.
    #[serde(default = "default_ws_mib")]
    pub ws_mib: u64,
    /// memwrite: percentage of writes.
    #[serde(default = "default_write_pct")]
    pub write_pct: u64,
    /// chanbench: the largest message in bytes (a power of two, 8..=65536).
    #[serde(default = "default_max_msg")]
    pub max_msg: u64,
    /// chanstream: a message on every channel every this many µs (0: as
    /// fast as the peers consume).
    #[serde(default = "default_send_every_us")]
    pub send_every_us: u64,
    /// chanstream: drain the receive side every this many µs (0: always).
    #[serde(default)]
    pub recv_every_us: u64,
    /// tlbwalk: pages walked (1..=65536), one access each at a 4,160-byte
    /// stride.
    #[serde(default = "default_pages")]
    pub pages: u64,
    /// tlbwalk: `load` (one checked load per page, Quest-V's Fig. 7) or
    /// `fetch` (one instruction fetched per page, Fig. 8).
    #[serde(default = "default_access")]
    pub access: String,
    /// periodic: the accounting period in µs (at least 1000).
    #[serde(default = "default_period_us")]
    pub period_us: u64,
    /// periodic: the CPU time per period it must get (its reservation), µs.
    #[serde(default = "default_reserve_us")]
    pub reserve_us: u64,
}

fn default_period_us() -> u64 {
    10_000
}

fn default_reserve_us() -> u64 {
    5_000
}

fn default_pages() -> u64 {
    64
}

fn default_access() -> String {
    "load".into()
}

fn default_send_every_us() -> u64 {
    1000
}

fn default_seed() -> u64 {
    1
}
fn default_duration_ms() -> u64 {
    500
}
fn default_ws_mib() -> u64 {
    8
}
fn default_write_pct() -> u64 {
    50
}
fn default_max_msg() -> u64 {
    nl_workloads::chanbench::MAX_SIZE as u64
}

/// A channel between two sandboxes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChannelConfig {
    pub name: String,
    /// The two ends: end 0 first.
    pub between: [String; 2],
    /// A doorbell each way: a write by one end to its doorbell page raises
    /// an interrupt in the other (an ioeventfd in the sender's VM sharing
    /// its eventfd with an irqfd in the receiver's).
    #[serde(default)]
    pub doorbell: bool,
    /// Diagnostic: `false` leaves the receivers' irqfds unregistered, so a
    /// ring reaches nobody (the `doorbell` workload then fails its check).
    #[serde(default = "yes")]
    pub doorbell_irqfd: bool,
}

fn yes() -> bool {
    true
}

impl WorkloadConfig {
    /// Whether the workload runs until the set stops it (a service:
    /// chanstream, netbench or kv with `duration_ms` 0), so its reporting
    /// completion is a failure.
    pub fn endless(&self) -> bool {
        self.duration_ms == 0 && matches!(self.kind.as_str(), "chanstream" | "netbench" | "kv")
    }

    /// The guest's workload parameters.
    pub fn params(&self) -> Result<nl_abi::WorkloadParams, String> {
        use nl_abi::*;
        let kind = match self.kind.as_str() {
            "memwrite" => WORKLOAD_MEMWRITE,
            "compute" => WORKLOAD_COMPUTE,
            "idle" => WORKLOAD_IDLE,
            "chanbench" => WORKLOAD_CHANBENCH,
            "wildwrite" => WORKLOAD_WILDWRITE,
            "chanstream" => WORKLOAD_CHANSTREAM,
            "doorbell" => WORKLOAD_DOORBELL,
            "syscall" => WORKLOAD_SYSCALL,
            "tlbwalk" => WORKLOAD_TLBWALK,
            "netbench" => WORKLOAD_NETBENCH,
            "kv" => WORKLOAD_KV,
            "periodic" => WORKLOAD_PERIODIC,
            "storm" => WORKLOAD_STORM,
            "blkbench" => WORKLOAD_BLKBENCH,
            k => {
                return Err(format!(
                    "unknown workload kind '{k}' (memwrite, compute, idle, chanbench, wildwrite, chanstream, doorbell, syscall, tlbwalk, netbench, kv, periodic, storm, blkbench)"
                ))
            }
        };
        if kind == WORKLOAD_CHANBENCH
            && (!self.max_msg.is_power_of_two()
                || !(8..=nl_workloads::chanbench::MAX_SIZE as u64).contains(&self.max_msg))
        {
            return Err(format!(
                "chanbench max_msg {} must be a power of two in 8..=65536",
                self.max_msg
            ));
        }
        if kind == WORKLOAD_PERIODIC
            && (!(1000..=1_000_000).contains(&self.period_us)
                || self.reserve_us == 0
                || self.reserve_us > self.period_us)
        {
            return Err(format!(
                "periodic period_us {} must be in 1000..=1000000 and reserve_us {} in 1..=period_us",
                self.period_us, self.reserve_us
            ));
        }
        if kind == WORKLOAD_TLBWALK && !(1..=nl_workloads::TLBWALK_MAX_PAGES).contains(&self.pages)
        {
            return Err(format!(
                "tlbwalk pages {} must be in 1..={}",
                self.pages,
                nl_workloads::TLBWALK_MAX_PAGES
            ));
        }
        let access = match self.access.as_str() {
            "load" => nl_abi::TLBWALK_LOADS,
            "fetch" if kind == WORKLOAD_TLBWALK => nl_abi::TLBWALK_FETCHES,
            a => return Err(format!("workload access '{a}': `load`, or `fetch` for tlbwalk")),
        };
        let p = WorkloadParams {
            kind,
            seed: self.seed,
            ws_bytes: match kind {
                WORKLOAD_MEMWRITE => self.ws_mib << 20,
                WORKLOAD_TLBWALK => {
                    nl_workloads::tlbwalk_ws_bytes(self.pages.min(nl_workloads::TLBWALK_MAX_PAGES))
                }
                WORKLOAD_KV => nl_workloads::kv::KV_WS_BYTES,
                WORKLOAD_BLKBENCH => nl_workloads::blk::BLKBENCH_WS_BYTES,
                _ => 0,
            },
            write_pct: self.write_pct,
            pattern: match kind {
                WORKLOAD_TLBWALK => access,
                _ => PATTERN_RANDOM,
            },
            stride: match kind {
                WORKLOAD_CHANBENCH => self.max_msg,
                WORKLOAD_CHANSTREAM => self.send_every_us,
                WORKLOAD_TLBWALK => self.pages,
                WORKLOAD_PERIODIC => self.period_us,
                _ => 8,
            },
            hot_pct: 10,
            // netbench, kv: 0 serves until the set is stopped.
            duration_ms: match (kind, self.duration_ms) {
                (WORKLOAD_NETBENCH | WORKLOAD_KV, 0) => u64::MAX / (1 << 24),
                (_, d) => d,
            },
            data_bytes: match kind {
                WORKLOAD_CHANSTREAM => self.recv_every_us,
                WORKLOAD_PERIODIC => self.reserve_us,
                _ => 0,
            },
        };
        nl_workloads::validate(&p).map_err(str::to_string)?;
        Ok(p)
    }
}

impl SandboxConfig {
    /// Whether its messages are `chanstream`'s, whichever workload it
    /// restarts with (`replace` may name another).
    pub fn streams_chanstream(&self) -> bool {
        self.workload.kind == "chanstream"
            && self.recovery.replace_with.as_ref().is_none_or(|w| w.kind == "chanstream")
    }

    /// Whether the `channel-check` detector runs for it
    /// (`detect.channel_check`, by default for `chanstream`).
    pub fn channel_check(&self) -> bool {
        self.detect.channel_check.unwrap_or_else(|| self.streams_chanstream())
    }

    pub fn vcpus(&self) -> u32 {
        self.vcpus.unwrap_or(self.cores.len() as u32)
    }
}

/// The recovery and detector settings of one sandbox.
fn check_recovery(s: &SandboxConfig) -> Result<(), SandboxError> {
    let bad = |m: String| Err(SandboxError::Config(format!("sandbox '{}': {m}", s.name)));
    let r = &s.recovery;
    match (r.policy, &r.replace_with) {
        (RecoveryPolicy::Replace, None) => {
            return bad("recovery policy 'replace' needs recovery.replace_with (a workload)".into())
        }
        (RecoveryPolicy::Replace, Some(w)) => {
            let p = w.params().map_err(|e| {
                SandboxError::Config(format!("sandbox '{}': recovery.replace_with: {e}", s.name))
            })?;
            if p.kind == nl_abi::WORKLOAD_MEMWRITE
                && u64::from(s.vcpus()) * p.ws_bytes + nl_abi::MIN_MEM_BYTES > s.mem_mib << 20
            {
                return bad("recovery.replace_with's working sets do not fit its memory".into());
            }
        }
        (_, Some(_)) => return bad("recovery.replace_with is only for the policy 'replace'".into()),
        _ => {}
    }
    if r.max_recoveries == 0 || r.max_recoveries > 1000 {
        return bad(format!("recovery.max_recoveries {} is not in 1..=1000", r.max_recoveries));
    }
    if r.window_ms == 0 {
        return bad("recovery.window_ms must be nonzero".into());
    }
    if !(5..=10_000).contains(&r.checkpoint_interval_ms) {
        return bad(format!(
            "recovery.checkpoint_interval_ms {} is not in 5..=10000",
            r.checkpoint_interval_ms
        ));
    }
    if r.output_commit.is_some() && r.policy != RecoveryPolicy::Rollback {
        return bad("recovery.output_commit is only for the policy 'rollback'".into());
    }
    if r.release.is_some() && !r.output_commit() {
        return bad("recovery.release is only for the policy 'rollback' with output_commit".into());
    }
    let d = &s.detect;
    if !(10..=600_000).contains(&d.heartbeat_cpu_ms) {
        return bad(format!(
            "detect.heartbeat_cpu_ms {} is not in 10..=600000",
            d.heartbeat_cpu_ms
        ));
    }
    if d.channel_lag_words == Some(0) {
        return bad("detect.channel_lag_words must be nonzero (leave it out to turn it off)".into());
    }
    if d.channel_lag_cpu_ms == 0 {
        return bad("detect.channel_lag_cpu_ms must be nonzero".into());
    }
    if let Some(ms) = d.output_stall_cpu_ms {
        if !(10..=600_000).contains(&ms) {
            return bad(format!("detect.output_stall_cpu_ms {ms} is not in 10..=600000"));
        }
    }
    Ok(())
}

impl SetConfig {
    /// Parses a configuration file's text.
    pub fn parse(text: &str) -> Result<Self, SandboxError> {
        serde_json::from_str(text)
            .map_err(|e| SandboxError::Config(format!("not a valid sandbox configuration: {e}")))
    }

    /// Reads and parses a configuration file.
    pub fn load(path: &std::path::Path) -> Result<Self, SandboxError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            SandboxError::Config(format!(
                "cannot read sandbox configuration {}: {e}",
                path.display()
            ))
        })?;
        Self::parse(&text)
    }

    /// Checks everything that can be checked without creating anything;
    /// `host_cores` is how many cores this process may run on.
    pub fn validate(&self, host_cores: usize) -> Result<(), SandboxError> {
        let bad = |m: String| Err(SandboxError::Config(m));
        if self.sandboxes.is_empty() {
            return bad("the configuration has no sandboxes".into());
        }
        let mut names = BTreeSet::new();
        let mut per_core = vec![0.0f64; host_cores];
        for s in &self.sandboxes {
            if s.name.is_empty() || !names.insert(s.name.as_str()) {
                return bad(format!("sandbox name '{}' is empty or used twice", s.name));
            }
            if s.cores.is_empty() {
                return bad(format!("sandbox '{}' names no cores", s.name));
            }
            if s.cores.len() > host_cores {
                return bad(format!(
                    "sandbox '{}' asks for {} cores, the host has {host_cores}",
                    s.name,
                    s.cores.len()
                ));
            }
            if let Some(c) = s.cores.iter().find(|&&c| c >= host_cores) {
                return bad(format!(
                    "sandbox '{}' names core {c}, the host has {host_cores} (cores 0..={})",
                    s.name,
                    host_cores - 1
                ));
            }
            let vcpus = s.vcpus();
            if vcpus == 0 || vcpus > nl_abi::MAX_VCPUS {
                return bad(format!(
                    "sandbox '{}': vcpus {vcpus} is not in 1..={}",
                    s.name,
                    nl_abi::MAX_VCPUS
                ));
            }
            let p = s
                .workload
                .params()
                .map_err(|e| SandboxError::Config(format!("sandbox '{}': {e}", s.name)))?;
            if matches!(
                p.kind,
                nl_abi::WORKLOAD_CHANBENCH
                    | nl_abi::WORKLOAD_WILDWRITE
                    | nl_abi::WORKLOAD_CHANSTREAM
                    | nl_abi::WORKLOAD_DOORBELL
                    | nl_abi::WORKLOAD_PERIODIC
                    | nl_abi::WORKLOAD_STORM
                    | nl_abi::WORKLOAD_NETBENCH
                    | nl_abi::WORKLOAD_KV
                    | nl_abi::WORKLOAD_BLKBENCH
            ) && vcpus != 1
            {
                return bad(format!(
                    "sandbox '{}': {} runs on exactly one vCPU",
                    s.name, s.workload.kind
                ));
            }
            let mem = s.mem_mib.saturating_mul(1 << 20);
            nl_memory::GuestMemory::check_size(mem).map_err(|e| {
                SandboxError::Config(format!("sandbox '{}': mem_mib {}: {e}", s.name, s.mem_mib))
            })?;
            if mem > nl_abi::MMIO_HOLE_START {
                return bad(format!(
                    "sandbox '{}': mem_mib {} is more than the {} MiB a sandbox may have below its channel windows",
                    s.name,
                    s.mem_mib,
                    nl_abi::MMIO_HOLE_START >> 20
                ));
            }
            if (p.kind == nl_abi::WORKLOAD_MEMWRITE
                || p.kind == nl_abi::WORKLOAD_TLBWALK
                || p.kind == nl_abi::WORKLOAD_KV
                || p.kind == nl_abi::WORKLOAD_BLKBENCH)
                && u64::from(vcpus) * p.ws_bytes + nl_abi::MIN_MEM_BYTES > mem
            {
                return bad(format!(
                    "sandbox '{}': {vcpus} working sets of {} KiB do not fit in {} MiB",
                    s.name,
                    p.ws_bytes >> 10,
                    s.mem_mib
                ));
            }
            if p.kind == nl_abi::WORKLOAD_DOORBELL || p.kind == nl_abi::WORKLOAD_STORM {
                let first = self.channels_of(&s.name).first().map(|c| &self.channels[c.0]);
                if !first.is_some_and(|c| c.doorbell) {
                    return bad(format!(
                        "sandbox '{}': the {} workload needs its first channel to have \"doorbell\": true",
                        s.name, s.workload.kind
                    ));
                }
            }
            check_recovery(s)?;
            if let Some(b) = s.budget {
                if b.period_us == 0 || b.runtime_us == 0 || b.runtime_us > b.period_us {
                    return bad(format!(
                        "sandbox '{}': budget runtime_us {} / period_us {} must be 0 < runtime <= period",
                        s.name, b.runtime_us, b.period_us
                    ));
                }
                if let Some(e) = over_core_share(&s.name, "budget", b.runtime_us, b.period_us) {
                    return bad(e);
                }
                if let Some(io) = b.io {
                    if io.runtime_us < MIN_CFS_US
                        || io.period_us < MIN_CFS_US
                        || io.runtime_us > io.period_us
                    {
                        return bad(format!(
                            "sandbox '{}': budget.io runtime_us {} / period_us {} must be {MIN_CFS_US} <= runtime <= period (the kernel's least CFS quota is {MIN_CFS_US} us)",
                            s.name, io.runtime_us, io.period_us
                        ));
                    }
                    if let Some(e) =
                        over_core_share(&s.name, "budget.io", io.runtime_us, io.period_us)
                    {
                        return bad(e);
                    }
                    if !s.net.as_ref().is_some_and(|n| n.rx_irq) {
                        return bad(format!(
                            "sandbox '{}': budget.io has no I/O thread to hold (only a net section with \"rx_irq\": true has one, its receive thread)",
                            s.name
                        ));
                    }
                }
                if b.reserve && vcpus as usize != s.cores.len() {
                    return bad(format!(
                        "sandbox '{}': a reserved budget needs one vCPU per core ({vcpus} vCPUs on {} cores)",
                        s.name,
                        s.cores.len()
                    ));
                }
                // vCPU i runs on cores[i % len]: add its share there. The
                // I/O threads may run on any of the sandbox's cores: their
                // budget counts on each.
                let io_share = b.io.map_or(0.0, |io| io.share());
                let shares = (0..vcpus as usize)
                    .map(|i| (s.cores[i % s.cores.len()], b.share()))
                    .chain(s.cores.iter().map(|&c| (c, io_share)));
                for (c, share) in shares {
                    per_core[c] += share;
                    if per_core[c] > MAX_CORE_SHARE + 1e-9 {
                        return bad(format!(
                            "budgets on core {c} add up to {:.0}% of it, more than the {:.0}% allowed (sandbox '{}' is the one over{})",
                            per_core[c] * 100.0,
                            MAX_CORE_SHARE * 100.0,
                            s.name,
                            if io_share > 0.0 { ", its budget.io included" } else { "" }
                        ));
                    }
                }
            }
        }
        let mut per_sandbox = std::collections::BTreeMap::<&str, usize>::new();
        let mut channel_names = BTreeSet::new();
        for c in &self.channels {
            if !channel_names.insert(c.name.as_str()) {
                return bad(format!("channel name '{}' is used twice", c.name));
            }
            for end in &c.between {
                if !names.contains(end.as_str()) {
                    return bad(format!("channel '{}' names unknown sandbox '{end}'", c.name));
                }
                let n = per_sandbox.entry(end.as_str()).or_default();
                *n += 1;
                if *n > nl_abi::MAX_CHANNELS {
                    return bad(format!(
                        "sandbox '{end}' is in more than {} channels",
                        nl_abi::MAX_CHANNELS
                    ));
                }
            }
            if c.between[0] == c.between[1] {
                return bad(format!(
                    "channel '{}' joins sandbox '{}' to itself",
                    c.name, c.between[0]
                ));
            }
        }
        for s in &self.sandboxes {
            let kind = s.workload.kind.as_str();
            if matches!(kind, "chanbench" | "chanstream")
                && !self.channels.iter().any(|c| c.between.contains(&s.name))
            {
                return bad(format!("sandbox '{}' runs {kind} but is in no channel", s.name));
            }
        }
        crate::service::validate(self)?;
        crate::net::validate(self)?;
        crate::disk::validate(self)?;
        Ok(())
    }

    /// The channels of sandbox `name` in the order its guest sees them
    /// (channel index, config index, which end it is).
    pub fn channels_of(&self, name: &str) -> Vec<(usize, u64)> {
        self.channels
            .iter()
            .enumerate()
            .filter_map(|(i, c)| {
                c.between.iter().position(|e| e == name).map(|end| (i, end as u64))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two(extra_a: &str, channels: &str) -> String {
        format!(
            r#"{{"sandboxes": [
                {{"name": "a", "cores": [0], "workload": {{"kind": "chanbench"}} {extra_a}}},
                {{"name": "b", "cores": [1], "workload": {{"kind": "chanbench"}}}}
            ], "channels": [{channels}]}}"#
        )
    }

    fn err(text: &str, cores: usize) -> String {
        match SetConfig::parse(text).and_then(|c| c.validate(cores)) {
            Ok(()) => panic!("accepted: {text}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn only_services_with_duration_0_run_without_end() {
        let w = |kind: &str, duration_ms| WorkloadConfig {
            kind: kind.into(),
            duration_ms,
            ..serde_json::from_str(r#"{"kind": "kv"}"#).unwrap()
        };
        for kind in ["chanstream", "netbench", "kv"] {
            assert!(w(kind, 0).endless(), "{kind}");
            assert!(!w(kind, 1000).endless(), "{kind} with a duration");
        }
        // memwrite with duration 0 measures nothing and completes at once.
        assert!(!w("memwrite", 0).endless());
    }

    #[test]
    fn a_good_configuration_is_accepted() {
        let c = SetConfig::parse(&two("", r#"{"name": "ab", "between": ["a", "b"]}"#)).unwrap();
        c.validate(2).unwrap();
        assert_eq!(c.channels_of("b"), vec![(0, 1)]);
    }

    #[test]
    fn io_budgets_are_checked_alone_and_summed_per_core() {
        let kv = |net: &str, budget: &str| {
            format!(
                r#"{{"sandboxes": [{{"name": "k", "cores": [0], "workload": {{"kind": "kv"}},
                "net": {{"tap": "t0", "mac": "52:54:00:00:00:02", "ipv4": "10.0.0.2/24" {net}}},
                "budget": {{"runtime_us": 5000, "period_us": 10000 {budget}}}}}]}}"#
            )
        };
        let rx = r#", "rx_irq": true"#;
        let io = |r: u64, p: u64| format!(r#", "io": {{"runtime_us": {r}, "period_us": {p}}}"#);
        let ok = SetConfig::parse(&kv(rx, &io(1000, 10_000))).unwrap();
        ok.validate(2).unwrap();
        let b = ok.sandboxes[0].budget.unwrap();
        assert_eq!(b.io, Some(IoBudget { runtime_us: 1000, period_us: 10_000 }));
        assert!(ok.sandboxes[0].net.as_ref().unwrap().rx_irq);
        // Alone: over 95% of a core, below the kernel's least quota.
        assert!(err(&kv(rx, &io(9_600, 10_000)), 2)
            .contains("budget.io 9600 us every 10000 us is 96% of a core"));
        assert!(err(&kv(rx, &io(500, 10_000)), 2).contains("must be 1000 <= runtime <= period"));
        assert!(err(&kv(rx, &io(2000, 1000)), 2).contains("must be 1000 <= runtime <= period"));
        // Summed with the vCPU budget on the core: 50% + 50%.
        assert!(err(&kv(rx, &io(5_000, 10_000)), 2)
            .contains("budgets on core 0 add up to 100% of it, more than the 95% allowed (sandbox 'k' is the one over, its budget.io included)"));
        // Nothing to hold without a receive thread.
        assert!(err(&kv("", &io(1000, 10_000)), 2).contains("budget.io has no I/O thread to hold"));
        assert!(err(&kv(rx, r#", "io": {"runtime_us": 1000}"#), 2).contains("period_us"));
    }

    #[test]
    fn bad_configurations_get_clear_errors() {
        let ch = r#"{"name": "ab", "between": ["a", "b"]}"#;
        assert!(err(&two("", r#"{"name": "ab", "between": ["a", "zz"]}"#), 2)
            .contains("unknown sandbox 'zz'"));
        assert!(err(&two("", ch), 1).contains("names core 1, the host has 1"));
        assert!(err(&two(r#", "budget": {"runtime_us": 9600, "period_us": 10000}"#, ch), 2)
            .contains("96% of a core"));
        let doorbell = r#""workload": {"kind": "doorbell"}"#;
        let no_bell = two("", ch).replace(r#""workload": {"kind": "chanbench"}"#, doorbell);
        assert!(err(&no_bell, 2).contains("needs its first channel to have \"doorbell\": true"));
        assert!(err(&two(r#", "vcpus": 1, "mem_mib": 1"#, ch), 2).contains("mem_mib 1"));
        assert!(err(&two(r#", "typo": 1"#, ch), 2).contains("unknown field `typo`"));
        assert!(err(&two("", ""), 2).contains("in no channel"));
        let three_cores =
            r#"{"sandboxes": [{"name": "a", "cores": [0, 1, 2], "workload": {"kind": "idle"}}]}"#;
        assert!(err(three_cores, 2).contains("asks for 3 cores, the host has 2"));
        let crowded = r#"{"sandboxes": [
            {"name": "a", "cores": [0], "workload": {"kind": "idle"}, "budget": {"runtime_us": 5000, "period_us": 10000}},
            {"name": "b", "cores": [0], "workload": {"kind": "idle"}, "budget": {"runtime_us": 5000, "period_us": 10000}}]}"#;
        assert!(err(crowded, 2).contains("budgets on core 0 add up to 100%"));
        let shared = r#"{"sandboxes": [{"name": "a", "cores": [0], "vcpus": 2, "workload": {"kind": "idle"},
            "budget": {"runtime_us": 2000, "period_us": 10000, "reserve": true}}]}"#;
        assert!(err(shared, 2).contains("a reserved budget needs one vCPU per core"));
        let periodic = |extra: &str| {
            format!(
                r#"{{"sandboxes": [{{"name": "a", "cores": [0], "workload": {{"kind": "periodic"{extra}}}}}]}}"#
            )
        };
        assert!(err(&periodic(r#", "period_us": 500"#), 2).contains("periodic period_us 500"));
        assert!(err(&periodic(r#", "reserve_us": 20000"#), 2).contains("reserve_us 20000"));
        let storm =
            r#"{"sandboxes": [{"name": "a", "cores": [0], "workload": {"kind": "storm"}}]}"#;
        assert!(err(storm, 2).contains("the storm workload needs its first channel"));
        let recovery = |r: &str| {
            format!(
                r#"{{"sandboxes": [{{"name": "a", "cores": [0], "workload": {{"kind": "idle"}}, "recovery": {r}}}]}}"#
            )
        };
        let only = "recovery.release is only for the policy 'rollback' with output_commit";
        assert!(err(&recovery(r#"{"policy": "restart", "release": "next_checkpoint"}"#), 2)
            .contains(only));
        let no_commit =
            r#"{"policy": "rollback", "output_commit": false, "release": "next_checkpoint"}"#;
        assert!(err(&recovery(no_commit), 2).contains(only));
        assert!(err(&recovery(r#"{"policy": "rollback", "release": "soon"}"#), 2)
            .contains("unknown variant `soon`"));
        let ok =
            SetConfig::parse(&recovery(r#"{"policy": "rollback", "release": "next_checkpoint"}"#))
                .expect("release next_checkpoint under rollback");
        ok.validate(2).expect("valid");
        assert_eq!(
            ok.sandboxes[0].recovery.release,
            Some(nl_checkpoint::CommitRule::NextCheckpoint)
        );
    }
}
