//! The one system call vm-memory and vmm-sys-util do not wrap for us.

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
