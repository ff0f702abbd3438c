//! The ninelives VMM core.
//!
//! * [`vm`]: one VM: guest memory, devices, vCPUs; create, start, pause,
//!   resume, save and restore state, stop.
//! * [`vcpu`]: the per-vCPU thread and its exit loop, with the pause protocol
//!   that stops every vCPU at a consistent point (no exit half-handled).
//! * [`linux`]: Linux guests: their boot, platform devices, console-based
//!   supervision and crash reports.
//! * [`state`]: vCPU, device and VM state as versioned, serializable data.
//! * [`detect`]: error detectors (fatal signals, panics, hang watchdog).
//! * [`recovery`]: microreset and microreboot of the VMM after a detected error.
//! * [`events`]: the host's recurring events (VM supervision).
//! * [`progress`]: guest progress in vCPU-thread CPU time (hang judgement).
//! * [`seccomp`]: a seccomp-bpf filter per VMM thread kind.
//! * [`sched`]: real-time and ordinary scheduling of host threads.
//! * [`kick`]: interrupting a vCPU thread out of KVM_RUN with a signal.
//! * [`windows`]: memory windows beside RAM (sandbox channels), read-only
//!   ones guarded: a guest write to one is a reported violation.
//! * [`host`]: several VMs in one VMM process, addressed by id.
//! * [`api`]: the Unix-socket API of `ninelives host`.
//! * [`handover`]: handing running VMs (memfds, state, the API socket) to a
//!   new VMM process; [`rejuvenate`]: warm, cold and save-restore restarts
//!   of a host over it.
//!
//! The mechanisms (checkpointing, replication, recovery, rejuvenation,
//! sandboxes, fault injection) build on these hooks: [`vm::Vm::pause`],
//! [`vm::Vm::save_state`], [`vm::Vm::restore_state`], [`vm::Vm::memory`] and
//! the device bus.

pub mod api;
pub mod carry;
pub mod config;
mod dirty;
pub mod error;
pub mod handover;
pub mod host;
mod irq_routes;

pub mod detect;
pub mod event_log;
pub mod events;
pub mod kick;
pub mod linux;
mod memslots;
mod netrx;
pub mod progress;
pub mod recovery;
pub mod rejuvenate;
pub mod sched;
pub mod seccomp;
pub mod selftest;
pub mod state;
pub mod successor;
pub mod vcpu;
pub mod vm;
pub mod windows;

pub use config::{DiskConfig, NetConfig, VmConfig};
pub use error::VmmError;
pub use vm::{PauseHold, Vm, VmOutcome};

/// Environment variable naming another KVM device node than /dev/kvm.
pub const KVM_DEVICE_ENV: &str = "NINELIVES_KVM_DEVICE";

/// Opens /dev/kvm (or `$NINELIVES_KVM_DEVICE`) with a clear error when it is
/// missing or not usable.
pub fn open_kvm() -> Result<kvm_ioctls::Kvm, VmmError> {
    let path = std::env::var(KVM_DEVICE_ENV).unwrap_or_else(|_| "/dev/kvm".into());
    let c = std::ffi::CString::new(path.clone())
        .map_err(|_| VmmError::NoKvm(format!("{path}: invalid path")))?;
    kvm_ioctls::Kvm::new_with_path(&c).map_err(|e| VmmError::NoKvm(format!("{path}: {e}")))
}
