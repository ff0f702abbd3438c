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

#[cfg(test)]
mod tests {
    //! On a plain memfd guest memory, no KVM: the test thread's writes take
    //! the faults a vCPU would.
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;
    use vm_memory::{Bytes, GuestAddress};

    /// Records every fault (gpa, region gpa); unprotects the page, or
    /// fails without unprotecting anything when `fail` is set.
    struct Record {
        tx: mpsc::Sender<(u64, u64)>,
        fail: bool,
    }

    impl FaultHandler for Record {
        fn fault(&mut self, p: &Protector, gpa: u64, r: Range) -> Result<(), String> {
            let _ = self.tx.send((gpa, r.gpa));
            if self.fail {
                return Err(format!("handler refused {gpa:#x}"));
            }
            p.unprotect(gpa, PAGE)
        }
    }

    fn setup(mem: u64, fail: bool) -> (GuestMemory, WriteProtect, mpsc::Receiver<(u64, u64)>) {
        let m = GuestMemory::new("wp-test", mem).unwrap();
        let (tx, rx) = mpsc::channel();
        let wp = WriteProtect::new(&m, "wp-test", Record { tx, fail }).unwrap();
        (m, wp, rx)
    }

    /// Writes one byte at `gpa` on another thread; waits at most 30 s.
    fn write(m: &GuestMemory, gpa: u64, v: u8) {
        let mem = m.mem().clone();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            mem.write_obj(v, GuestAddress(gpa)).unwrap();
            let _ = tx.send(());
        });
        rx.recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| panic!("the write to {gpa:#x} stayed blocked"));
    }

    fn read(m: &GuestMemory, gpa: u64) -> u8 {
        m.mem().read_obj(GuestAddress(gpa)).unwrap()
    }

    #[test]
    fn a_write_to_a_protected_page_reaches_the_handler_with_its_guest_address() {
        let (m, wp, rx) = setup(64 << 20, false);
        let p = wp.protector();
        p.protect(0x3000, 2 * PAGE).unwrap();
        write(&m, 0x1234, 1); // not protected
        assert!(rx.try_recv().is_err());
        write(&m, 0x3123, 2);
        assert_eq!(rx.try_recv(), Ok((0x3000, 0)), "page-aligned gpa, region at 0");
        write(&m, 0x3456, 3); // that page is unprotected now
        write(&m, 0x4000, 4);
        assert_eq!(rx.try_recv(), Ok((0x4000, 0)));
        assert!(rx.try_recv().is_err());
        assert_eq!((read(&m, 0x3123), read(&m, 0x3456), read(&m, 0x4000)), (2, 3, 4));
        p.protect_all().unwrap();
        p.unprotect_all().unwrap();
        write(&m, 0x5000, 5);
        assert!(rx.try_recv().is_err(), "unprotect_all lifted everything");
        assert_eq!(wp.error(), None);
    }

    #[test]
    fn faults_above_the_mmio_hole_name_the_high_region() {
        let mem = nl_abi::MMIO_HOLE_START + (64 << 20);
        let (m, wp, rx) = setup(mem, false);
        let p = wp.protector();
        let high = nl_abi::HIGH_RAM_GPA;
        assert_eq!(p.ranges().len(), 2);
        assert_eq!(p.region_of(high + 0x5000).map(|r| (r.gpa, r.size)), Some((high, 64 << 20)));
        assert_eq!(p.region_of(0x5000).map(|r| r.gpa), Some(0));
        assert!(p.region_of(nl_abi::MMIO_HOLE_START).is_none(), "the hole is not RAM");
        assert!(p.region_of(high + (64 << 20)).is_none());
        p.protect_all().unwrap();
        write(&m, high + 0x5008, 9);
        assert_eq!(rx.try_recv(), Ok((high + 0x5000, high)));
        write(&m, nl_abi::MMIO_HOLE_START - 1, 8);
        assert_eq!(rx.try_recv(), Ok((nl_abi::MMIO_HOLE_START - PAGE, 0)));
        assert_eq!(read(&m, high + 0x5008), 9);
    }

    #[test]
    fn ranges_outside_guest_ram_are_refused() {
        let (_m, wp, _rx) = setup(64 << 20, false);
        let p = wp.protector();
        for (gpa, len) in [(64 << 20, PAGE), ((64 << 20) - PAGE, 2 * PAGE), (1 << 40, PAGE)] {
            let want = format!("{gpa:#x}+{len:#x} is not within guest RAM");
            assert_eq!(p.protect(gpa, len).unwrap_err(), want);
            assert_eq!(p.unprotect(gpa, len).unwrap_err(), want);
        }
        p.protect((64 << 20) - PAGE, PAGE).unwrap();
    }

    #[test]
    fn a_failing_handler_is_recorded_and_the_writer_still_goes_on() {
        let (m, wp, rx) = setup(64 << 20, true);
        wp.protector().protect(0x7000, PAGE).unwrap();
        write(&m, 0x7010, 7);
        assert_eq!(rx.try_recv(), Ok((0x7000, 0)));
        assert_eq!(read(&m, 0x7010), 7);
        assert_eq!(wp.error().as_deref(), Some("handler refused 0x7000"));
    }

    #[test]
    fn dropping_the_registration_lifts_every_protection() {
        let (m, wp, rx) = setup(64 << 20, true);
        wp.protector().protect_all().unwrap();
        drop(wp);
        write(&m, 0x9000, 1);
        write(&m, (64 << 20) - 1, 2);
        assert!(rx.try_recv().is_err(), "no fault after the drop");
    }
}
