//! Copy-on-write of guest RAM for checkpoints, over userfaultfd
//! write-protection ([`nl_memory::write_protect`]): the first write to a
//! protected page stops until the fault thread has saved the aligned block
//! around it into the current interval's [`PageSet`] and lifted the block's
//! protection.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};

use nl_memory::write_protect::{FaultHandler, Protector, Range, WriteProtect};
use nl_memory::{GuestMem, GuestMemory};
use vm_memory::{Bytes, GuestAddress};

use crate::pages::PageSet;
use crate::{CheckpointError, PAGE};

/// What the fault thread shares with the checkpoint engine.
struct Shared {
    cur: Mutex<PageSet>,
    faults: AtomicU64,
}

/// Saves the aligned block of `block` bytes around each fault.
struct SaveBlock {
    shared: Arc<Shared>,
    mem: GuestMem,
    block: u64,
    buf: Vec<u8>,
}

impl FaultHandler for SaveBlock {
    fn fault(&mut self, p: &Protector, gpa: u64, r: Range) -> Result<(), String> {
        // The aligned block around the fault, clipped to the region.
        let start = (gpa & !(self.block - 1)).max(r.gpa);
        let end = (start + self.block).min(r.gpa + r.size);
        let mut failed = None;
        let mut cur = self.shared.cur.lock().unwrap_or_else(|p| p.into_inner());
        for page in (start..end).step_by(PAGE) {
            if !cur.contains(page) {
                match self.mem.read_slice(&mut self.buf, GuestAddress(page)) {
                    Ok(()) => {
                        cur.save_once(page, &self.buf);
                    }
                    Err(e) => {
                        failed.get_or_insert(format!("saving page {page:#x}: {e}"));
                    }
                }
            }
        }
        self.shared.faults.fetch_add(1, Relaxed);
        // Unprotected while the interval is still locked: a checkpoint or
        // rollback that takes the interval and re-protects memory cannot run
        // in between, which would leave this block writable in the next
        // interval with no saved copy.
        let r = p.unprotect(start, end - start);
        drop(cur);
        r?;
        failed.map_or(Ok(()), Err)
    }

    fn on_start(&mut self) {
        nl_vmm::seccomp::apply(nl_vmm::seccomp::Kind::Checkpoint);
    }
}

/// Write-protection of a VM's RAM with copy-on-write into the current
/// interval's page set.
pub struct WriteTracker {
    wp: WriteProtect,
    shared: Arc<Shared>,
}

impl WriteTracker {
    /// Registers all of `memory` for write-protect faults and starts the fault
    /// thread. A fault saves and unprotects the aligned block of
    /// `block_pages` pages around it (1: page-granular copy-on-write).
    pub fn new(memory: &GuestMemory, block_pages: usize) -> Result<Self, CheckpointError> {
        if !block_pages.is_power_of_two() || block_pages > 512 {
            return Err(CheckpointError::Config(format!(
                "block of {block_pages} pages: must be a power of two up to 512"
            )));
        }
        let shared =
            Arc::new(Shared { cur: Mutex::new(PageSet::new()), faults: AtomicU64::new(0) });
        let handler = SaveBlock {
            shared: shared.clone(),
            mem: memory.mem().clone(),
            block: (block_pages * PAGE) as u64,
            buf: vec![0u8; PAGE],
        };
        let wp =
            WriteProtect::new(memory, "ckpt-faults", handler).map_err(CheckpointError::Uffd)?;
        Ok(Self { wp, shared })
    }

    /// Write-protects all guest RAM.
    pub fn protect_all(&self) -> Result<(), CheckpointError> {
        self.wp.protector().protect_all().map_err(CheckpointError::Uffd)
    }

    /// Removes write protection from `[gpa, gpa + len)`.
    pub fn unprotect(&self, gpa: u64, len: u64) -> Result<(), CheckpointError> {
        self.wp.protector().unprotect(gpa, len).map_err(CheckpointError::Uffd)
    }

    /// Removes write protection from all guest RAM.
    pub fn unprotect_all(&self) -> Result<(), CheckpointError> {
        self.wp.protector().unprotect_all().map_err(CheckpointError::Uffd)
    }

    /// The current interval's saved pages.
    pub fn current(&self) -> MutexGuard<'_, PageSet> {
        self.shared.cur.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Write-protect faults served so far.
    pub fn faults(&self) -> u64 {
        self.shared.faults.load(Relaxed)
    }

    /// An error met by the fault thread, if any.
    pub fn error(&self) -> Option<String> {
        self.wp.error()
    }
}
