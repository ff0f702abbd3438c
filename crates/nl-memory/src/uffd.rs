//! The part of the userfaultfd ABI (`linux/userfaultfd.h`, `userfaultfd(2)`,
//! `ioctl_userfaultfd(2)`) that [`crate::write_protect`] uses: open a
//! userfaultfd with the features it needs, register ranges for write-protect
//! faults, protect / unprotect ranges and read fault events.
//!
//! Spoken directly through `libc` (and vmm-sys-util's ioctl helpers) instead
//! of the `userfaultfd` crate, whose `userfaultfd-sys` build script runs
//! bindgen (libclang) and a C compiler: the workspace must build with only a
//! Rust toolchain. The structs mirror the kernel header field for field and
//! their sizes are checked at compile time; the ioctl numbers are checked
//! against the kernel's values in the tests.

use std::fs::{File, OpenOptions};
use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};

use vmm_sys_util::ioctl::{ioctl_with_mut_ref, ioctl_with_val};
use vmm_sys_util::{ioctl_io_nr, ioctl_ior_nr, ioctl_iowr_nr};

/// The ioctl type of userfaultfd's ioctls (`UFFDIO`, also `USERFAULTFD_IOC`).
const UFFDIO: u32 = 0xAA;
/// The API version handed to UFFDIO_API.
const UFFD_API: u64 = 0xAA;

/// Feature: faults report `UFFD_PAGEFAULT_FLAG_WP` (write-protect mode).
pub const UFFD_FEATURE_PAGEFAULT_FLAG_WP: u64 = 1 << 0;
/// Feature: write protection of hugetlbfs and shmem (memfd) mappings (5.19+).
pub const UFFD_FEATURE_WP_HUGETLBFS_SHMEM: u64 = 1 << 12;

const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;
const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;
const UFFDIO_WRITEPROTECT_MODE_DONTWAKE: u64 = 1 << 1;

const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
/// Page fault flag: the access was a write (write_protect.rs needs only WP).
#[cfg_attr(not(test), allow(dead_code))]
pub const UFFD_PAGEFAULT_FLAG_WRITE: u64 = 1 << 0;
/// Page fault flag: the fault is a write-protect fault (not a missing page).
pub const UFFD_PAGEFAULT_FLAG_WP: u64 = 1 << 1;

#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct uffdio_api {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct uffdio_range {
    start: u64,
    len: u64,
}

#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct uffdio_register {
    range: uffdio_range,
    mode: u64,
    ioctls: u64,
}

#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct uffdio_writeprotect {
    range: uffdio_range,
    mode: u64,
}

/// `uffd_msg.arg.pagefault` (its `feat` union has the one member `ptid`).
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct uffd_msg_pagefault {
    flags: u64,
    address: u64,
    ptid: u32,
}

/// `uffd_msg.arg`: only the page fault arm is read; `reserved` is the
/// header's 24-byte arm and gives the union its size.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy)]
union uffd_msg_arg {
    pagefault: uffd_msg_pagefault,
    reserved: [u64; 3],
}

/// `struct uffd_msg` (`__attribute__((packed))` in the header).
#[allow(non_camel_case_types)]
#[repr(C, packed)]
#[derive(Clone, Copy)]
struct uffd_msg {
    event: u8,
    reserved1: u8,
    reserved2: u16,
    reserved3: u32,
    arg: uffd_msg_arg,
}

const _: () = assert!(size_of::<uffdio_api>() == 24);
const _: () = assert!(size_of::<uffdio_range>() == 16);
const _: () = assert!(size_of::<uffdio_register>() == 32);
const _: () = assert!(size_of::<uffdio_writeprotect>() == 24);
const _: () = assert!(size_of::<uffd_msg_pagefault>() == 24);
const _: () = assert!(size_of::<uffd_msg_arg>() == 24);
const _: () = assert!(size_of::<uffd_msg>() == 32);
const _: () = assert!(std::mem::offset_of!(uffd_msg, arg) == 8);

ioctl_iowr_nr!(UFFDIO_API, UFFDIO, 0x3F, uffdio_api);
ioctl_iowr_nr!(UFFDIO_REGISTER, UFFDIO, 0x00, uffdio_register);
ioctl_ior_nr!(UFFDIO_UNREGISTER, UFFDIO, 0x01, uffdio_range);
ioctl_iowr_nr!(UFFDIO_WRITEPROTECT, UFFDIO, 0x06, uffdio_writeprotect);
// `/dev/userfaultfd`'s one ioctl (Linux 6.1+): _IO(USERFAULTFD_IOC, 0x00),
// taking the userfaultfd(2) flags as its integer argument.
ioctl_io_nr!(USERFAULTFD_IOC_NEW, UFFDIO, 0x00);

/// One event read from a userfaultfd.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// A page fault at `address` (page aligned), `flags` being
    /// `UFFD_PAGEFAULT_FLAG_*`.
    Pagefault { flags: u64, address: u64 },
    /// Any other event (only delivered for features not requested here).
    Other(u8),
}

/// An open userfaultfd (closed on drop).
#[derive(Debug)]
pub struct Uffd {
    file: File,
}

impl AsRawFd for Uffd {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

impl Uffd {
    /// Opens a userfaultfd with `flags` (`O_CLOEXEC`, `O_NONBLOCK`,
    /// `UFFD_USER_MODE_ONLY`) and completes the API handshake requiring
    /// `features` (`UFFD_FEATURE_*`). Like the `userfaultfd` crate, it
    /// asks `/dev/userfaultfd` first (its file mode decides access) and falls
    /// back to the `userfaultfd(2)` system call.
    pub fn new(flags: libc::c_int, features: u64) -> io::Result<Self> {
        let uffd = match OpenOptions::new().read(true).write(true).open("/dev/userfaultfd") {
            Ok(dev) => {
                // SAFETY: USERFAULTFD_IOC_NEW on the opened device takes an
                // integer argument (the flags) and touches no memory of ours.
                let fd =
                    unsafe { ioctl_with_val(&dev, USERFAULTFD_IOC_NEW(), flags as libc::c_ulong) };
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                // SAFETY: fd was just returned by the kernel and is owned by
                // nobody else.
                Self { file: unsafe { File::from_raw_fd(fd) } }
            }
            Err(dev_err) => {
                // SAFETY: userfaultfd(2) takes an integer argument and touches
                // no memory of ours.
                let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
                if fd < 0 {
                    let e = io::Error::last_os_error();
                    return Err(io::Error::new(
                        e.kind(),
                        format!("userfaultfd(2): {e} (/dev/userfaultfd: {dev_err})"),
                    ));
                }
                let fd = RawFd::try_from(fd).map_err(io::Error::other)?;
                // SAFETY: fd was just returned by the kernel and is owned by
                // nobody else.
                Self { file: unsafe { File::from_raw_fd(fd) } }
            }
        };
        let mut api = uffdio_api { api: UFFD_API, features, ioctls: 0 };
        // SAFETY: UFFDIO_API reads and writes one uffdio_api, the size its
        // request number encodes; `api` is a live exclusive borrow.
        let r = unsafe { ioctl_with_mut_ref(&uffd.file, UFFDIO_API(), &mut api) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        // The kernel fails with EINVAL on unsupported features; checked
        // again so an old or odd kernel cannot slip through.
        if api.features & features != features {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("the kernel lacks userfaultfd features {:#x}", features & !api.features),
            ));
        }
        Ok(uffd)
    }

    /// Registers `[start, start + len)` of this process's memory for
    /// write-protect faults (nothing is protected yet).
    pub fn register_wp(&self, start: u64, len: u64) -> io::Result<()> {
        let mut reg = uffdio_register {
            range: uffdio_range { start, len },
            mode: UFFDIO_REGISTER_MODE_WP,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_REGISTER reads and writes one uffdio_register, the
        // size its request number encodes. Registering only changes how
        // faults in the range are delivered; the kernel validates the range.
        let r = unsafe { ioctl_with_mut_ref(&self.file, UFFDIO_REGISTER(), &mut reg) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Unregisters `[start, start + len)` (which also lifts its protection).
    pub fn unregister(&self, start: u64, len: u64) -> io::Result<()> {
        let mut range = uffdio_range { start, len };
        // SAFETY: UFFDIO_UNREGISTER reads one uffdio_range, the size its
        // request number encodes.
        let r = unsafe { ioctl_with_mut_ref(&self.file, UFFDIO_UNREGISTER(), &mut range) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Write-protects `[start, start + len)` (registered before).
    pub fn write_protect(&self, start: u64, len: u64) -> io::Result<()> {
        self.writeprotect(start, len, UFFDIO_WRITEPROTECT_MODE_WP)
    }

    /// Lifts the write protection of `[start, start + len)`, waking the
    /// writers blocked on it if `wake`.
    pub fn remove_write_protection(&self, start: u64, len: u64, wake: bool) -> io::Result<()> {
        self.writeprotect(start, len, if wake { 0 } else { UFFDIO_WRITEPROTECT_MODE_DONTWAKE })
    }

    fn writeprotect(&self, start: u64, len: u64, mode: u64) -> io::Result<()> {
        let mut wp = uffdio_writeprotect { range: uffdio_range { start, len }, mode };
        // SAFETY: UFFDIO_WRITEPROTECT reads one uffdio_writeprotect, the size
        // its request number encodes. Protection only makes writes to the
        // range wait for this userfaultfd; it changes no memory.
        let r = unsafe { ioctl_with_mut_ref(&self.file, UFFDIO_WRITEPROTECT(), &mut wp) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Waits up to `ms` milliseconds for the userfaultfd to have events.
    pub fn wait_readable(&self, ms: i32) -> bool {
        let mut p = libc::pollfd { fd: self.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd on the stack, count 1.
        let n = unsafe { libc::poll(&mut p, 1, ms) };
        n > 0 && p.revents & libc::POLLIN != 0
    }

    /// Reads one event; `None` if there is none (the fd is non-blocking).
    pub fn read_event(&self) -> io::Result<Option<Event>> {
        let mut msg = uffd_msg {
            event: 0,
            reserved1: 0,
            reserved2: 0,
            reserved3: 0,
            arg: uffd_msg_arg { reserved: [0; 3] },
        };
        // SAFETY: read(2) writes at most size_of::<uffd_msg>() bytes into
        // `msg`, which is exclusively borrowed, and every byte pattern is a
        // valid uffd_msg (integers only).
        let n = unsafe {
            libc::read(
                self.file.as_raw_fd(),
                (&raw mut msg).cast::<libc::c_void>(),
                size_of::<uffd_msg>(),
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock => Ok(None),
                _ => Err(e),
            };
        }
        if n as usize != size_of::<uffd_msg>() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "a userfaultfd read returned {n} bytes, not one {}-byte message",
                    size_of::<uffd_msg>()
                ),
            ));
        }
        if msg.event != UFFD_EVENT_PAGEFAULT {
            return Ok(Some(Event::Other(msg.event)));
        }
        // Copy the union out of the packed struct before reading it.
        let arg = msg.arg;
        // SAFETY: the kernel filled the pagefault arm (event is PAGEFAULT),
        // and any bit pattern is valid for its integer fields.
        let pf = unsafe { arg.pagefault };
        Ok(Some(Event::Pagefault { flags: pf.flags, address: pf.address }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    const PAGE: u64 = 4096;

    /// The values of linux/userfaultfd.h's request macros (x86-64: _IOC
    /// direction bits 31..30, size 29..16, type 15..8, number 7..0).
    #[test]
    fn ioctl_numbers_are_the_kernels() {
        assert_eq!(UFFDIO_API(), 0xc018_aa3f);
        assert_eq!(UFFDIO_REGISTER(), 0xc020_aa00);
        assert_eq!(UFFDIO_UNREGISTER(), 0x8010_aa01);
        assert_eq!(UFFDIO_WRITEPROTECT(), 0xc018_aa06);
        assert_eq!(USERFAULTFD_IOC_NEW(), 0xaa00);
    }

    /// A shared memfd mapping of `pages` pages (unmapped on drop).
    struct Mapping {
        addr: u64,
        len: usize,
        _fd: File,
    }

    impl Mapping {
        fn new(pages: u64) -> Self {
            let fd = crate::memfd::create("uffd-test").expect("memfd");
            let len = (pages * PAGE) as usize;
            fd.set_len(len as u64).expect("memfd size");
            // SAFETY: a fresh shared mapping of our own memfd at an address
            // the kernel picks; unmapped only by Drop.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd.as_raw_fd(),
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED, "mmap: {}", io::Error::last_os_error());
            Self { addr: p as u64, len, _fd: fd }
        }
    }

    impl Drop for Mapping {
        fn drop(&mut self) {
            // A failed assertion may leave a writer blocked on the mapping
            // (closing the userfaultfd wakes it): leak it rather than have
            // that write hit unmapped memory.
            if std::thread::panicking() {
                return;
            }
            // SAFETY: the mapping made in new(), no longer used.
            unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
        }
    }

    fn poll_event(uffd: &Uffd, timeout: Duration) -> Option<Event> {
        let until = Instant::now() + timeout;
        while Instant::now() < until {
            if let Some(ev) = uffd.read_event().expect("read_event") {
                return Some(ev);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        None
    }

    /// Writes from another thread to a write-protected memfd page (one
    /// already populated, one never touched) stop with exactly one WP fault
    /// at that page, and complete once the page is unprotected; the other
    /// page stays protected meanwhile.
    #[test]
    fn write_protect_faults_once_and_unprotect_lets_the_write_finish() {
        // The mapping outlives the userfaultfd (see Mapping's Drop).
        let m = Mapping::new(2);
        let uffd = Uffd::new(
            libc::O_CLOEXEC | libc::O_NONBLOCK,
            UFFD_FEATURE_PAGEFAULT_FLAG_WP | UFFD_FEATURE_WP_HUGETLBFS_SHMEM,
        )
        .expect("userfaultfd with shmem write protection (Linux 5.19+, root)");
        // SAFETY: page 0 of our own live mapping.
        unsafe { *(m.addr as *mut u8) = 1 };
        uffd.register_wp(m.addr, 2 * PAGE).expect("register");
        uffd.write_protect(m.addr, 2 * PAGE).expect("protect");
        assert_eq!(uffd.read_event().expect("read_event"), None);

        for page in [0, 1] {
            let target = m.addr + page * PAGE + 123;
            let (tx, rx) = mpsc::channel();
            let writer = std::thread::spawn(move || {
                // SAFETY: inside the live mapping, which outlives the join
                // below (and the userfaultfd).
                unsafe { std::ptr::write_volatile(target as *mut u8, 0x5a) };
                let _ = tx.send(());
            });
            let ev = poll_event(&uffd, Duration::from_secs(10)).expect("no fault event in 10 s");
            let Event::Pagefault { flags, address } = ev else { panic!("unexpected {ev:?}") };
            assert_eq!(address, m.addr + page * PAGE, "page {page}");
            assert_eq!(flags & UFFD_PAGEFAULT_FLAG_WP, UFFD_PAGEFAULT_FLAG_WP, "page {page}");
            assert_eq!(flags & UFFD_PAGEFAULT_FLAG_WRITE, UFFD_PAGEFAULT_FLAG_WRITE);
            assert!(
                rx.recv_timeout(Duration::from_millis(100)).is_err(),
                "the write to page {page} finished while protected"
            );
            assert_eq!(uffd.read_event().expect("read_event"), None, "a second event");
            uffd.remove_write_protection(m.addr + page * PAGE, PAGE, true).expect("unprotect");
            rx.recv_timeout(Duration::from_secs(10)).expect("the write did not finish");
            writer.join().expect("writer");
            // SAFETY: our own live mapping.
            assert_eq!(unsafe { *(target as *const u8) }, 0x5a);
        }
        assert_eq!(uffd.read_event().expect("read_event"), None);
        uffd.unregister(m.addr, 2 * PAGE).expect("unregister");
    }
}
