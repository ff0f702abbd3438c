//! Write tracking with userfaultfd write-protection.
//!
//! Guest RAM (the VM's own `MAP_SHARED` memfd mapping, which KVM also uses)
//! is registered for write-protect faults. While a page is protected, the
//! first write to it, by a vCPU through KVM or by the VMM, stops in the
//! kernel; the fault thread copies the page's content into the current
//! interval's [`PageSet`] and lifts the protection, which lets the write
//! proceed. Faults taken inside the kernel (KVM's writes) are only delivered
//! to a userfaultfd opened without `UFFD_USER_MODE_ONLY`.

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use nl_memory::{GuestMem, GuestMemory};
use userfaultfd::{Event, FaultKind, FeatureFlags, RegisterMode, Uffd, UffdBuilder};
use vm_memory::{Bytes, GuestAddress};

use crate::pages::PageSet;
use crate::{CheckpointError, PAGE};

/// UFFD_FEATURE_WP_HUGETLBFS_SHMEM: write-protect faults on shmem (memfd).
const FEATURE_WP_SHMEM: u64 = 1 << 12;

#[derive(Clone, Copy)]
struct Range {
    gpa: u64,
    size: u64,
    host: u64,
}

struct Shared {
    cur: Mutex<PageSet>,
    faults: AtomicU64,
    stop: AtomicBool,
    /// The first error the fault thread met (it then keeps unprotecting so
    /// the guest never deadlocks, but the checkpoint is no longer valid).
    error: Mutex<Option<String>>,
}

/// Write-protection of a VM's RAM and the thread that serves its faults.
pub struct WriteTracker {
    uffd: Arc<Uffd>,
    ranges: Vec<Range>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

fn uffd_err(what: &str) -> impl Fn(userfaultfd::Error) -> CheckpointError + '_ {
    move |e| CheckpointError::Uffd(format!("{what}: {e}"))
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
        let uffd = UffdBuilder::new()
            .close_on_exec(true)
            .non_blocking(true)
            .user_mode_only(false)
            .require_features(
                FeatureFlags::PAGEFAULT_FLAG_WP | FeatureFlags::from_bits_retain(FEATURE_WP_SHMEM),
            )
            .create()
            .map_err(|e| {
                CheckpointError::Uffd(format!(
                    "cannot open a userfaultfd with shmem write-protect support ({e}); \
                     it needs Linux 5.19+ and root or vm.unprivileged_userfaultfd=1"
                ))
            })?;
        let ranges: Vec<Range> = memory
            .regions()
            .iter()
            .zip(memory.host_addrs())
            .map(|(r, host)| Range { gpa: r.gpa, size: r.size, host })
            .collect();
        for r in &ranges {
            uffd.register_with_mode(r.host as *mut _, r.size as usize, RegisterMode::WRITE_PROTECT)
                .map_err(uffd_err("register guest RAM"))?;
        }
        let uffd = Arc::new(uffd);
        let shared = Arc::new(Shared {
            cur: Mutex::new(PageSet::new()),
            faults: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            error: Mutex::new(None),
        });
        let (u, s, mem, rs) = (uffd.clone(), shared.clone(), memory.mem().clone(), ranges.clone());
        let thread = std::thread::Builder::new()
            .name("ckpt-faults".into())
            .spawn(move || fault_loop(&u, &s, &mem, &rs, block_pages))
            .map_err(|e| CheckpointError::Uffd(format!("cannot start the fault thread: {e}")))?;
        Ok(Self { uffd, ranges, shared, thread: Some(thread) })
    }

    /// Write-protects all guest RAM.
    pub fn protect_all(&self) -> Result<(), CheckpointError> {
        for r in &self.ranges {
            self.uffd
                .write_protect(r.host as *mut _, r.size as usize)
                .map_err(uffd_err("write-protect guest RAM"))?;
        }
        Ok(())
    }

    /// Removes write protection from `[gpa, gpa + len)`.
    pub fn unprotect(&self, gpa: u64, len: u64) -> Result<(), CheckpointError> {
        let host = self.host(gpa)?;
        self.uffd
            .remove_write_protection(host as *mut _, len as usize, true)
            .map_err(uffd_err("unprotect"))
    }

    /// Removes write protection from all guest RAM.
    pub fn unprotect_all(&self) -> Result<(), CheckpointError> {
        for r in &self.ranges {
            self.uffd
                .remove_write_protection(r.host as *mut _, r.size as usize, true)
                .map_err(uffd_err("unprotect guest RAM"))?;
        }
        Ok(())
    }

    fn host(&self, gpa: u64) -> Result<u64, CheckpointError> {
        self.ranges
            .iter()
            .find(|r| gpa >= r.gpa && gpa < r.gpa + r.size)
            .map(|r| r.host + (gpa - r.gpa))
            .ok_or(CheckpointError::GuestMemory { gpa, why: "not guest RAM".into() })
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
        self.shared.error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl Drop for WriteTracker {
    fn drop(&mut self) {
        // Never leave the guest blocked on a protection nobody will lift.
        let _ = self.unprotect_all();
        self.shared.stop.store(true, Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        for r in &self.ranges {
            let _ = self.uffd.unregister(r.host as *mut _, r.size as usize);
        }
    }
}

fn fault_loop(uffd: &Uffd, s: &Shared, mem: &GuestMem, ranges: &[Range], block_pages: usize) {
    let block = (block_pages * PAGE) as u64;
    let mut buf = vec![0u8; PAGE];
    while !s.stop.load(Relaxed) {
        if !wait_readable(uffd, 50) {
            continue;
        }
        loop {
            let ev = match uffd.read_event() {
                Ok(Some(ev)) => ev,
                Ok(None) => break,
                Err(e) => {
                    record(s, format!("reading a fault: {e}"));
                    break;
                }
            };
            let Event::Pagefault { kind, addr, .. } = ev else { continue };
            let host = (addr as u64) & !(PAGE as u64 - 1);
            let Some(r) = ranges.iter().find(|r| host >= r.host && host < r.host + r.size) else {
                record(s, format!("fault outside guest RAM at {host:#x}"));
                continue;
            };
            // The aligned block around the fault, clipped to the region.
            let gpa = r.gpa + (host - r.host);
            let start = (gpa & !(block - 1)).max(r.gpa);
            let end = (start + block).min(r.gpa + r.size);
            if kind == FaultKind::WriteProtected {
                let mut cur = s.cur.lock().unwrap_or_else(|p| p.into_inner());
                for page in (start..end).step_by(PAGE) {
                    if !cur.contains(page) {
                        match mem.read_slice(&mut buf, GuestAddress(page)) {
                            Ok(()) => {
                                cur.save_once(page, &buf);
                            }
                            Err(e) => record(s, format!("saving page {page:#x}: {e}")),
                        }
                    }
                }
                drop(cur);
                s.faults.fetch_add(1, Relaxed);
            }
            let host_start = r.host + (start - r.gpa);
            if let Err(e) =
                uffd.remove_write_protection(host_start as *mut _, (end - start) as usize, true)
            {
                record(s, format!("unprotecting {start:#x}..{end:#x}: {e}"));
            }
        }
    }
}

fn record(s: &Shared, msg: String) {
    let mut e = s.error.lock().unwrap_or_else(|p| p.into_inner());
    e.get_or_insert(msg);
}

/// Waits up to `ms` for the userfaultfd to have events.
fn wait_readable(uffd: &Uffd, ms: i32) -> bool {
    let mut p = libc::pollfd { fd: uffd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd on the stack, count 1.
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    n > 0 && p.revents & libc::POLLIN != 0
}
