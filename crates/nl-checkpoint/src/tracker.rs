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

#[cfg(test)]
mod tests {
    //! Copy-on-write on a plain memfd guest memory (no KVM): the test
    //! thread's own writes take the write-protect faults a vCPU would.
    use super::*;
    use std::time::Duration;

    const MEM: u64 = 64 << 20;

    fn filled(fill: u8) -> [u8; PAGE] {
        [fill; PAGE]
    }

    /// Writes `fill` over the page at `gpa` on another thread and waits for
    /// the write to finish (at most 30 s: a fault nobody serves blocks the
    /// writer for ever).
    fn write_page(m: &GuestMemory, gpa: u64, fill: u8) {
        let mem = m.mem().clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            mem.write_slice(&filled(fill), GuestAddress(gpa)).unwrap();
            let _ = tx.send(());
        });
        rx.recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| panic!("the write to {gpa:#x} stayed blocked on its fault"));
    }

    fn read_page(m: &GuestMemory, gpa: u64) -> [u8; PAGE] {
        let mut b = [0u8; PAGE];
        m.mem().read_slice(&mut b, GuestAddress(gpa)).unwrap();
        b
    }

    #[test]
    fn the_first_write_to_a_protected_page_saves_its_old_content_once() {
        let m = GuestMemory::new("tracker-test", MEM).unwrap();
        m.mem().write_slice(&filled(0x11), GuestAddress(0x4000)).unwrap();
        let t = WriteTracker::new(&m, 1).unwrap();
        t.protect_all().unwrap();
        assert_eq!(t.faults(), 0);
        write_page(&m, 0x4000, 0x22);
        assert_eq!(t.faults(), 1);
        assert_eq!(read_page(&m, 0x4000), filled(0x22), "the write went through");
        assert_eq!(t.current().gpas(), vec![0x4000]);
        assert_eq!(t.current().get(0x4000), Some(&filled(0x11)), "the pre-write copy");
        // The page is writable now: a second write takes no fault and
        // leaves the saved copy alone.
        write_page(&m, 0x4000, 0x33);
        assert_eq!(t.faults(), 1);
        assert_eq!(t.current().get(0x4000), Some(&filled(0x11)));
        // Another page: its own fault, its own (zero) copy.
        write_page(&m, 0x9000, 0x44);
        assert_eq!(t.faults(), 2);
        assert_eq!(t.current().gpas(), vec![0x4000, 0x9000]);
        assert_eq!(t.current().get(0x9000), Some(&filled(0)));
        assert_eq!(t.error(), None);
    }

    #[test]
    fn a_fault_saves_and_unprotects_the_aligned_block_around_it() {
        let m = GuestMemory::new("tracker-test", MEM).unwrap();
        for (i, gpa) in (0x8000..0x1_0000u64).step_by(PAGE).enumerate() {
            m.mem().write_slice(&filled(i as u8 + 1), GuestAddress(gpa)).unwrap();
        }
        let t = WriteTracker::new(&m, 4).unwrap();
        t.protect_all().unwrap();
        write_page(&m, 0xa000, 0x77); // in the block 0x8000..0xc000
        assert_eq!(t.faults(), 1);
        assert_eq!(t.current().gpas(), vec![0x8000, 0x9000, 0xa000, 0xb000]);
        for (i, gpa) in (0x8000..0xc000u64).step_by(PAGE).enumerate() {
            assert_eq!(t.current().get(gpa), Some(&filled(i as u8 + 1)), "copy of {gpa:#x}");
        }
        // The whole block is writable; the next block is still protected.
        write_page(&m, 0x8000, 0x78);
        write_page(&m, 0xb000, 0x79);
        assert_eq!(t.faults(), 1);
        write_page(&m, 0xc000, 0x7a);
        assert_eq!(t.faults(), 2);
        assert_eq!(t.current().len(), 8);
        assert_eq!(t.current().get(0xc000), Some(&filled(5)));
    }

    #[test]
    fn a_block_is_clipped_to_the_end_of_guest_ram() {
        let m = GuestMemory::new("tracker-test", MEM).unwrap();
        let t = WriteTracker::new(&m, 512).unwrap();
        t.protect_all().unwrap();
        let last = MEM - PAGE as u64;
        write_page(&m, last, 1);
        let gpas = t.current().gpas();
        assert_eq!(gpas.len(), 512, "a 2 MiB block, aligned, ending at the end of RAM");
        assert_eq!((gpas[0], gpas[511]), (MEM - (512 * PAGE) as u64, last));
        assert_eq!(t.error(), None);
    }

    #[test]
    fn unprotected_memory_takes_no_faults() {
        let m = GuestMemory::new("tracker-test", MEM).unwrap();
        let t = WriteTracker::new(&m, 1).unwrap();
        write_page(&m, 0x1000, 1); // never protected
        t.protect_all().unwrap();
        t.unprotect(0x2000, 2 * PAGE as u64).unwrap();
        write_page(&m, 0x2000, 2);
        write_page(&m, 0x3000, 3);
        assert_eq!(t.faults(), 0);
        write_page(&m, 0x4000, 4); // just past the unprotected range
        assert_eq!(t.faults(), 1);
        t.unprotect_all().unwrap();
        write_page(&m, 0x5000, 5);
        assert_eq!(t.faults(), 1);
        assert_eq!(t.current().gpas(), vec![0x4000]);
        let e = t.unprotect(MEM, PAGE as u64).unwrap_err().to_string();
        assert!(e.contains("is not within guest RAM"), "{e}");
    }

    #[test]
    fn block_sizes_must_be_powers_of_two_up_to_512_pages() {
        let m = GuestMemory::new("tracker-test", MEM).unwrap();
        for bad in [0, 3, 6, 1024] {
            let e = WriteTracker::new(&m, bad).err().unwrap().to_string();
            assert_eq!(e, format!("block of {bad} pages: must be a power of two up to 512"));
        }
        WriteTracker::new(&m, 512).unwrap();
    }
}
