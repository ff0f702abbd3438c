//! A host TAP interface (Linux TUN/TAP, `IFF_TAP | IFF_NO_PI`), non-blocking.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNGETIFF: libc::c_ulong = 0x8004_54d2;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;

/// `struct ifreq` as TUNSETIFF reads it: the name, then the flags.
#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

pub struct Tap {
    file: File,
    name: String,
}

impl Tap {
    /// Attaches to (or creates) TAP interface `name` in this process's
    /// network namespace.
    pub fn open(name: &str) -> Result<Tap, String> {
        if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains(['/', ' ', '\0']) {
            return Err(format!("'{name}' is not a valid interface name"));
        }
        let path = c"/dev/net/tun";
        // SAFETY: opens a path from a valid C string; the fd is checked below.
        let fd =
            unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(format!("cannot open /dev/net/tun: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` is a freshly opened descriptor that nothing else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        let mut req =
            IfReq { name: [0; libc::IFNAMSIZ], flags: IFF_TAP | IFF_NO_PI, _pad: [0; 22] };
        req.name[..name.len()].copy_from_slice(name.as_bytes());
        // SAFETY: TUNSETIFF reads and writes one `struct ifreq`, which `req` is (40 bytes).
        let r = unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF as _, &mut req as *mut IfReq) };
        if r < 0 {
            return Err(format!("cannot attach TAP {name}: {}", std::io::Error::last_os_error()));
        }
        Ok(Tap { file, name: name.to_string() })
    }

    /// Takes over an already attached TAP descriptor (inherited across a
    /// microreboot's exec, so frames queued meanwhile are not lost), after
    /// checking that it is attached to interface `name`.
    pub fn from_attached(file: File, name: &str) -> Result<Tap, String> {
        let mut req = IfReq { name: [0; libc::IFNAMSIZ], flags: 0, _pad: [0; 22] };
        // SAFETY: TUNGETIFF writes one `struct ifreq`, which `req` is (40 bytes).
        let r = unsafe { libc::ioctl(file.as_raw_fd(), TUNGETIFF as _, &mut req as *mut IfReq) };
        if r < 0 {
            return Err(format!(
                "inherited descriptor is not an attached TAP: {}",
                std::io::Error::last_os_error()
            ));
        }
        let got: Vec<u8> = req.name.iter().copied().take_while(|&b| b != 0).collect();
        if got != name.as_bytes() {
            return Err(format!("inherited TAP is {}, not {name}", String::from_utf8_lossy(&got)));
        }
        Ok(Tap { file, name: name.to_string() })
    }

    /// A stand-in over any file, for unit tests and fuzz targets of the
    /// devices above it (a socket pair stands in for the interface).
    #[cfg(any(test, fuzzing))]
    pub fn for_test(file: File) -> Tap {
        Tap { file, name: "test".into() }
    }

    pub fn raw_fd(&self) -> std::os::fd::RawFd {
        self.file.as_raw_fd()
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Reads one frame; `Ok(None)` when none is waiting.
    pub fn recv(&mut self, buf: &mut [u8]) -> std::io::Result<Option<usize>> {
        match self.file.read(buf) {
            Ok(n) => Ok(Some(n)),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Sends one frame (dropped if the interface is down or its queue is full).
    pub fn send(&mut self, frame: &[u8]) -> bool {
        self.file.write(frame).is_ok()
    }
}
