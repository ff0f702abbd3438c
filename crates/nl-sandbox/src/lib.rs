//! Quest-V style sandboxes on ninelives.
//!
//! A *sandbox* is one VM (its own KVM VM, memfd and memory slots) whose
//! vCPU threads are pinned to the host cores its configuration names. A
//! *channel* joins two sandboxes: one memfd holding two output regions, each
//! mapped read-write in the end that writes it and read-only
//! (`KVM_MEM_READONLY`) in the other, at the guest-physical addresses of
//! [`nl_abi::channel_own_gpa`] / [`nl_abi::channel_peer_gpa`] listed in the
//! boot info. The record format both sides use is
//! [`nl_workloads::channel`].
//!
//! * [`config`]: the configuration file (JSON; schema in docs/sandboxes.md)
//!   and its checks.
//! * [`audit`]: the creation-time isolation audit over every memory slot.
//! * [`chanbench`]: chanbench numbers from a guest console, and the same
//!   benchmark between two host threads (the bench's baseline).
//! * [`channel`]: a channel's memfd and the windows each end maps.
//! * [`isolation`]: the wildwrite isolation check (test and bench).
//! * [`monitor`]: the per-sandbox monitor: violation reports, detections,
//!   recoveries.
//! * [`detect`]: the per-sandbox detectors (violation, guest error and
//!   crash, lost heartbeat on vCPU time, channel lag).
//! * [`faults`]: fault injection into one sandbox (bit flips, violating
//!   writes, a broken driver).
//! * [`recovery`]: the local recovery policies (`stop`, `restart`,
//!   `replace`, `rollback`).
//! * [`net`]: a sandbox's own virtio-net device on a host TAP.
//! * [`disk`]: a sandbox's own virtio-blk disk, and the audit that keeps
//!   one image from being reachable by two sandboxes.
//! * [`shared_link`]: one host TAP shared by several sandboxes, each
//!   with its own MAC and address (demultiplexed by MAC, or multicast).
//! * [`service`]: remote recovery: the service registry and the takeover
//!   of a failed owner's TAP by a standby sandbox.
//! * [`state`]: a service's state region (a memfd only its holder maps,
//!   moved at a takeover; kv keeps its table there).
//! * [`set`]: creating, starting (pinned), supervising and reporting a set.
//! * [`handover`]: carrying a running set to a new VMM process (warm
//!   rejuvenation, microreboot).
//! * [`verify`]: checking a finished sandbox's result.
//! * [`affinity`]: host cores and pinning.
//! * [`budget`]: CPU budgets (a CFS bandwidth cgroup per sandbox); with
//!   `reserve`, [`reserve`]: a reservation that is a floor and a ceiling
//!   (a server thread opens a `SCHED_FIFO` window of `runtime` in every
//!   `period`).
//! * [`periodic`]: what a `periodic` sandbox got per period (the storm
//!   test's measure), and the host's CPU account of a thread.
//!
//! Isolation: each sandbox's RAM is its own memfd, so no guest-physical
//! address of one reaches another's RAM; the audit checks exactly that for
//! every slot before any VM exists. A write to a read-only channel page
//! exits to the VMM ([`nl_vmm::windows`]), which hands it to the sandbox's
//! [`monitor::Monitor`]: reported with sandbox, address and RIP, and by
//! default the sandbox is stopped.

pub mod affinity;
pub mod audit;
pub mod budget;
pub mod chanbench;
pub mod channel;
pub mod config;
pub mod detect;
pub mod disk;
pub mod faults;
pub mod handover;
pub mod isolation;
pub mod monitor;
pub mod net;
pub mod periodic;
pub mod prepare;
pub mod recovery;
pub mod reserve;
pub mod service;
pub mod set;
pub mod shared_link;
pub mod state;
pub mod verify;

pub use config::SetConfig;
/// The KVM handle [`SandboxSet::create`] takes (`nl_vmm::open_kvm`).
pub use kvm_ioctls::Kvm;
/// What output commit did for a `rollback` sandbox (`recovery.output_commit`).
pub use nl_checkpoint::output_commit::OutputCommitStats;
pub use set::{Images, SandboxReport, SandboxSet, SetReport};

/// Why a sandbox set could not be created or run.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The configuration is wrong.
    #[error("{0}")]
    Config(String),
    /// The isolation audit refused the set.
    #[error("isolation audit: {0}")]
    Isolation(String),
    /// A host resource (memfd, mapping, affinity) failed.
    #[error("{0}")]
    Resource(String),
    /// Creating or starting a sandbox's VM failed.
    #[error("sandbox '{0}': {1}")]
    Vm(String, String),
}

/// Debug trace of the recovery path (`NL_SANDBOX_TRACE=1`): one line on
/// stderr per event, `trace <unix ms> <thread> <event>`, so that events of
/// the monitors, the VM builders and a bench's clients can be placed on
/// one clock. Off (one relaxed load) unless the variable is set.
pub fn trace(event: std::fmt::Arguments) {
    use std::sync::atomic::{AtomicU8, Ordering::Relaxed};
    static ON: AtomicU8 = AtomicU8::new(2);
    let on = match ON.load(Relaxed) {
        2 => {
            let v = u8::from(std::env::var_os("NL_SANDBOX_TRACE").is_some_and(|v| v == "1"));
            ON.store(v, Relaxed);
            v
        }
        v => v,
    };
    if on == 1 {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64() * 1e3);
        let t = std::thread::current();
        eprintln!("trace {now:.3} {} {event}", t.name().unwrap_or("-"));
    }
}
