//! Write tracking of guest RAM with userfaultfd write-protection.
//!
//! Guest RAM (the VM's own `MAP_SHARED` memfd mapping, which KVM also uses)
//! is registered for write-protect faults. While a page is protected, the
//! first write to it, by a vCPU through KVM or by the VMM, stops in the
//! kernel until a fault thread has served it: the thread calls the user's
//! [`FaultHandler`] with the faulting guest address, and the handler lifts
//! the protection of whatever range it chooses (the page, an aligned block,
//! a predicted window), which lets the write proceed. Faults taken inside
//! the kernel (KVM's writes) are only delivered to a userfaultfd opened
//! without `UFFD_USER_MODE_ONLY`.
//!
//! Users: copy-on-write checkpoints (`nl-checkpoint`) and write-fault
//! prediction for replication (`nl-replicate`).

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::uffd::{
    Event, Uffd, UFFD_FEATURE_PAGEFAULT_FLAG_WP, UFFD_FEATURE_WP_HUGETLBFS_SHMEM,
    UFFD_PAGEFAULT_FLAG_WP,
};
use crate::GuestMemory;
pub const PAGE: u64 = 4096;

#[derive(Clone, Copy, Debug)]
pub struct Range {
    pub gpa: u64,
    pub size: u64,
    host: u64,
}

/// Protects and unprotects guest ranges (shared by the owner and the fault
/// thread).
#[derive(Clone)]
pub struct Protector {
    uffd: Arc<Uffd>,
    ranges: Vec<Range>,
}

impl Protector {
    /// The RAM regions (guest address, size).
    pub fn ranges(&self) -> &[Range] {
        &self.ranges
    }

    /// The RAM region holding `gpa`.
    pub fn region_of(&self, gpa: u64) -> Option<Range> {
        self.ranges.iter().copied().find(|r| gpa >= r.gpa && gpa < r.gpa + r.size)
    }

    fn host(&self, gpa: u64, len: u64) -> Result<u64, String> {
        self.region_of(gpa)
            .filter(|r| gpa + len <= r.gpa + r.size)
            .map(|r| r.host + (gpa - r.gpa))
            .ok_or_else(|| format!("{gpa:#x}+{len:#x} is not within guest RAM"))
    }

    /// Write-protects `[gpa, gpa + len)` (within one RAM region).
    pub fn protect(&self, gpa: u64, len: u64) -> Result<(), String> {
        let host = self.host(gpa, len)?;
        self.uffd
            .write_protect(host, len)
            .map_err(|e| format!("write-protecting {gpa:#x}+{len:#x}: {e}"))
    }

    /// Lifts the write protection of `[gpa, gpa + len)` and wakes writers.
    pub fn unprotect(&self, gpa: u64, len: u64) -> Result<(), String> {
        let host = self.host(gpa, len)?;
        self.uffd
            .remove_write_protection(host, len, true)
            .map_err(|e| format!("unprotecting {gpa:#x}+{len:#x}: {e}"))
    }

    /// Write-protects all guest RAM.
    pub fn protect_all(&self) -> Result<(), String> {
        self.ranges.iter().try_for_each(|r| self.protect(r.gpa, r.size))
    }

    /// Lifts the protection of all guest RAM.
    pub fn unprotect_all(&self) -> Result<(), String> {
        self.ranges.iter().try_for_each(|r| self.unprotect(r.gpa, r.size))
    }
}

/// Serves one write-protect fault at `gpa` (page aligned) in `region`: it
/// must lift the protection of at least that page (or the writer waits for
/// ever). An error is recorded; the fault thread then lifts the page's
/// protection itself so the guest never deadlocks.
pub trait FaultHandler: Send + 'static {
    fn fault(&mut self, p: &Protector, gpa: u64, region: Range) -> Result<(), String>;

    /// Called first on the fault thread, before it serves any fault (the
    /// users install the thread's seccomp filter here).
    fn on_start(&mut self) {}
}

/// Registration of a VM's RAM for write-protect faults, and the thread that
/// serves them.
pub struct WriteProtect {
    protector: Protector,
    stop: Arc<AtomicBool>,
    error: Arc<Mutex<Option<String>>>,
    thread: Option<JoinHandle<()>>,
}

impl WriteProtect {
    /// Registers all of `memory` (nothing protected yet) and starts the
    /// fault thread `name` with `handler`.
    pub fn new(
        memory: &GuestMemory,
        name: &str,
        handler: impl FaultHandler,
    ) -> Result<Self, String> {
        // Not UFFD_USER_MODE_ONLY: KVM's writes to guest RAM fault in the
        // kernel and must be delivered too.
        let uffd = Uffd::new(
            libc::O_CLOEXEC | libc::O_NONBLOCK,
            UFFD_FEATURE_PAGEFAULT_FLAG_WP | UFFD_FEATURE_WP_HUGETLBFS_SHMEM,
        )
        .map_err(|e| {
            format!(
                "cannot open a userfaultfd with shmem write-protect support ({e}); \
                 it needs Linux 5.19+ and root or vm.unprivileged_userfaultfd=1"
            )
        })?;
        let ranges: Vec<Range> = memory
            .regions()
            .iter()
            .zip(memory.host_addrs())
            .map(|(r, host)| Range { gpa: r.gpa, size: r.size, host })
            .collect();
        for r in &ranges {
            uffd.register_wp(r.host, r.size)
                .map_err(|e| format!("cannot register guest RAM for write protection: {e}"))?;
        }
        let protector = Protector { uffd: Arc::new(uffd), ranges };
        let stop = Arc::new(AtomicBool::new(false));
        let error = Arc::new(Mutex::new(None));
        let (p, s, e) = (protector.clone(), stop.clone(), error.clone());
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || fault_loop(&p, &s, &e, handler))
            .map_err(|e| format!("cannot start the fault thread: {e}"))?;
        Ok(Self { protector, stop, error, thread: Some(thread) })
    }

    pub fn protector(&self) -> &Protector {
        &self.protector
    }

    /// The first error the fault thread met, if any.
    pub fn error(&self) -> Option<String> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl Drop for WriteProtect {
    fn drop(&mut self) {
        // Never leave the guest blocked on a protection nobody will lift.
        let _ = self.protector.unprotect_all();
        self.stop.store(true, Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        for r in &self.protector.ranges {
            let _ = self.protector.uffd.unregister(r.host, r.size);
        }
    }
}

fn fault_loop(
    p: &Protector,
    stop: &AtomicBool,
    error: &Mutex<Option<String>>,
    mut handler: impl FaultHandler,
) {
    handler.on_start();
    let record = |msg: String| {
        error.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(msg);
    };
    while !stop.load(Relaxed) {
        if !p.uffd.wait_readable(50) {
            continue;
        }
        loop {
            let ev = match p.uffd.read_event() {
                Ok(Some(ev)) => ev,
                Ok(None) => break,
                Err(e) => {
                    record(format!("reading a fault: {e}"));
                    break;
                }
            };
            let Event::Pagefault { flags, address } = ev else { continue };
            let host = address & !(PAGE - 1);
            let Some(r) =
                p.ranges.iter().copied().find(|r| host >= r.host && host < r.host + r.size)
            else {
                record(format!("fault outside guest RAM at {host:#x}"));
                continue;
            };
            let gpa = r.gpa + (host - r.host);
            let served = if flags & UFFD_PAGEFAULT_FLAG_WP != 0 {
                handler.fault(p, gpa, r)
            } else {
                p.unprotect(gpa, PAGE)
            };
            if let Err(e) = served {
                record(e);
                let _ = p.unprotect(gpa, PAGE);
            }
        }
    }
}
