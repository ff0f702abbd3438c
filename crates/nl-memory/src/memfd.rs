//! The system calls vm-memory and vmm-sys-util do not wrap for us.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::FromRawFd;

/// Creates an empty, close-on-exec memfd. Handing it to another process is an
/// explicit step (clearing FD_CLOEXEC or SCM_RIGHTS), never an accident.
pub fn create(name: &str) -> io::Result<File> {
    let name = CString::new(format!("ninelives-{name}")).map_err(io::Error::other)?;
    // SAFETY: name is a valid NUL-terminated string; the flags are constants.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just returned by memfd_create and is owned by nobody else.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// The byte ranges of `file` that hold data (SEEK_DATA / SEEK_HOLE): pages
/// never written are holes and need not be read.
pub fn data_ranges(file: &File, len: u64) -> io::Result<Vec<(u64, u64)>> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    let mut out = Vec::new();
    let mut at: u64 = 0;
    while at < len {
        // SAFETY: lseek on a valid fd; no memory is passed.
        let start = unsafe { libc::lseek(fd, at as libc::off_t, libc::SEEK_DATA) };
        if start < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break; // no data after `at`
            }
            return Err(e);
        }
        // SAFETY: as above.
        let end = unsafe { libc::lseek(fd, start, libc::SEEK_HOLE) };
        if end < 0 {
            return Err(io::Error::last_os_error());
        }
        let (s, e) = (start as u64, (end as u64).min(len));
        if e > s {
            out.push((s, e));
        }
        at = e.max(s + 1);
    }
    Ok(out)
}

/// Fills the page tables of `len` bytes mapped at `addr` (MADV_POPULATE_WRITE,
/// Linux 5.14+), so the first accesses through this mapping do not fault.
/// Used only on ranges of a shared memfd mapping that already hold data, so
/// no page is allocated.
pub fn populate(addr: u64, len: u64) -> io::Result<()> {
    // SAFETY: madvise only changes the page tables of the caller's own mapping
    // at [addr, addr + len), which the caller keeps mapped; it writes no memory.
    let r = unsafe {
        libc::madvise(addr as *mut libc::c_void, len as usize, libc::MADV_POPULATE_WRITE)
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Drops the pages of `len` bytes mapped at `addr` (`MADV_DONTNEED`). On a
/// private file mapping this throws away the mapping's own copies, so the
/// range reads the file again. Callers pass only ranges of a private copy
/// they own ([`crate::GuestMemory::reset_private`]).
pub fn discard(addr: u64, len: usize) -> io::Result<()> {
    // SAFETY: madvise changes only the page tables of the caller's own
    // mapping at [addr, addr + len), which stays mapped; no Rust reference
    // into it is live across the call (guest memory is accessed through
    // volatile slices), and a private file mapping then reads the file.
    let r = unsafe { libc::madvise(addr as *mut libc::c_void, len, libc::MADV_DONTNEED) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
