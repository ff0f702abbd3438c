//! VM-μCheckpoint on ninelives (see `../shared/papers/vm-ucheckpoint-in-memory-checkpointing.txt`).
//!
//! A running VM is checkpointed into the VMM's own memory every interval.
//! Two checkpoints are always kept; when an error is detected the VM is
//! rolled back in place to the older (committed) one and continues.
//!
//! * [`pages`]: the pre-write page copies of one interval (DP_i in the paper),
//!   the pool of buffers they reuse and the background thread that backs
//!   new ones in bulk ahead of need.
//! * [`slab`]: page buffers carved from anonymous mappings backed in bulk
//!   (the crate's one `unsafe` module).
//! * [`tracker`]: userfaultfd write-protection of guest RAM and the fault
//!   thread that saves a page before its first write.
//! * [`engine`]: the ways to take checkpoints: CoW-B, CoW-P, the KVM
//!   dirty-log baseline, the fault-free compare capture and `auto`, which
//!   picks dirty log or compare interval by interval; each rolls memory back
//!   along a ring of checkpoints.
//! * [`shadow`]: the full shadow image of the dirty-log/compare/auto engines
//!   and its parallel scan.
//! * [`policy`]: the auto mode's choice from the dirty rate and unit costs.
//! * [`supervisor`]: runs a VM under checkpointing: the interval timer,
//!   error detection, rollback, statistics.
//! * [`output_commit`]: the network output a rollback could undo, held
//!   until it cannot.
//! * [`inject`]: guest fault injection (bit flips in memory or registers).
//! * [`disk`]: the checkpoint file: written in the background, read back
//!   without trusting it (size and kind limits, every header field checked
//!   against the state, optional HMAC-SHA256 under a key file).

pub mod disk;
pub mod engine;
pub mod inject;
pub mod output_commit;
pub mod pages;
pub mod policy;
pub mod shadow;
pub mod slab;
pub mod supervisor;
pub mod tracker;

pub use engine::Mode;
pub use supervisor::{
    CheckpointConfig, CommitRule, ExtraDetector, HeldRegion, Live, RollbackRecord, RunReport,
    Supervisor,
};

/// Guest page size.
pub const PAGE: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("userfaultfd: {0}")]
    Uffd(String),
    #[error(transparent)]
    Vmm(#[from] nl_vmm::VmmError),
    #[error(transparent)]
    Memory(#[from] nl_memory::MemoryError),
    #[error("guest memory access at {gpa:#x}: {why}")]
    GuestMemory { gpa: u64, why: String },
    #[error("{0}")]
    Config(String),
    /// A fault that cannot be applied at this moment (the vCPU is not where
    /// it must be): try again.
    #[error("{0}")]
    NotNow(String),
}
