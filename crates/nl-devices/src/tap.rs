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

/// An `AF_INET` datagram socket for interface ioctls, in the calling
/// thread's network namespace.
fn control_socket() -> Option<File> {
    // SAFETY: socket(2) with constant arguments; the fd is checked and owned below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    (fd >= 0).then(|| unsafe { File::from_raw_fd(fd) })
}

/// A zeroed `ifreq` naming interface `name` (at most `IFNAMSIZ - 1` bytes:
/// longer names are refused where a TAP is opened).
fn ifreq_named(name: &str) -> libc::ifreq {
    // SAFETY: `ifreq` is plain data; all zeroes is a valid value.
    let mut r: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in r.ifr_name.iter_mut().take(libc::IFNAMSIZ - 1).zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    r
}

pub struct Tap {
    file: File,
    name: String,
    /// Where frames are sent if not to `file`: a shared link's TAP, which
    /// a port's device writes to directly ([`Tap::over_port`]).
    tx: Option<std::sync::Arc<File>>,
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
        Ok(Tap { file, name: name.to_string(), tx: None })
    }

    /// Brings the host end of the TAP up with address `ipv4/prefix`, so the
    /// guest is reachable without a manual `ip` step (needs CAP_NET_ADMIN,
    /// as creating the TAP does). An address the interface already has is
    /// left as it is.
    pub fn configure_host(&self, ipv4: [u8; 4], prefix: u8) -> Result<(), String> {
        if prefix == 0 || prefix > 30 {
            return Err(format!("host address prefix /{prefix} must be in 1..=30"));
        }
        let name = &self.name;
        let sys = |what: &str| {
            format!("cannot {what} on TAP {name}: {}", std::io::Error::last_os_error())
        };
        let sock = control_socket().ok_or_else(|| sys("open a socket to configure"))?;
        let ifreq = || ifreq_named(name);
        let sockaddr = |a: [u8; 4]| {
            // SAFETY: `sockaddr_in` is plain data; all zeroes is a valid value.
            let mut sin: libc::sockaddr_in = unsafe { std::mem::zeroed() };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_addr.s_addr = u32::from_ne_bytes(a);
            // SAFETY: sockaddr_in (16 bytes) fits in and is laid out as the
            // leading part of sockaddr (16 bytes).
            unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
        };
        let mask = (u32::MAX << (32 - u32::from(prefix))).to_be_bytes();
        for (req, what, value) in [
            (libc::SIOCSIFADDR, "set the address", ipv4),
            (libc::SIOCSIFNETMASK, "set the netmask", mask),
        ] {
            let mut r = ifreq();
            r.ifr_ifru.ifru_addr = sockaddr(value);
            // SAFETY: the ioctl reads one `ifreq`, which `r` is.
            if unsafe { libc::ioctl(sock.as_raw_fd(), req as _, &mut r) } < 0 {
                return Err(sys(what));
            }
        }
        let mut r = ifreq();
        // SAFETY: SIOCGIFFLAGS writes the flags into one `ifreq`, which `r` is.
        if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS as _, &mut r) } < 0 {
            return Err(sys("read the flags"));
        }
        // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
        unsafe { r.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short };
        // SAFETY: SIOCSIFFLAGS reads one `ifreq`, which `r` is.
        if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS as _, &mut r) } < 0 {
            return Err(sys("bring the interface up"));
        }
        Ok(())
    }

    /// Whether the host end of the TAP is up (for a hint when it is not),
    /// asked of the network namespace of the calling thread (the TAP's: it
    /// was attached there). `/sys/class/net` would show the namespace
    /// sysfs was mounted in instead, so a TAP in another namespace (a test's
    /// or a bench's) looked down.
    pub fn host_up(&self) -> bool {
        let Some(sock) = control_socket() else { return false };
        let mut r = ifreq_named(&self.name);
        // SAFETY: SIOCGIFFLAGS writes the flags into one `ifreq`, which `r` is.
        if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS as _, &mut r) } < 0 {
            return false;
        }
        // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
        let flags = unsafe { r.ifr_ifru.ifru_flags };
        flags & libc::IFF_UP as libc::c_short != 0
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
        Ok(Tap { file, name: name.to_string(), tx: None })
    }

    /// A stand-in for a TAP over a shared link's port ([`Port`]): frames
    /// come from the port's packet socket on the shared TAP, which the
    /// kernel fills with the frames the host sends out of it that are for
    /// this member (`nl_sandbox::shared_link`), one frame per read, and go
    /// straight to the shared TAP (one write per frame, as every writer of
    /// a TAP does). Non-blocking, like a TAP (the socket was opened so);
    /// `name` is the shared TAP's, for reports.
    pub fn over_port(port: &Port, name: &str) -> std::io::Result<Tap> {
        let rx = port.rx.try_clone()?;
        Ok(Tap { file: File::from(rx), name: name.to_string(), tx: Some(port.tx.clone()) })
    }

    /// Attaches a drop-all filter to the TAP's own queue (TUNATTACHFILTER:
    /// the kernel attaches it to every descriptor of the TAP, and to any
    /// attached later while the TAP exists). A frame the host sends out of
    /// the TAP still passes the packet taps (a shared link's members
    /// receive it there: [`crate::packet`]) but is then dropped and counted
    /// in the interface's TX `dropped` instead of waiting in a queue that
    /// nobody reads. Writes into the TAP are not filtered.
    pub fn drop_host_frames(&self) -> Result<(), String> {
        let f = crate::packet::Filter::new().drop_all();
        let prog = f.prog();
        // SAFETY: TUNATTACHFILTER reads one `sock_fprog`, which `prog` is;
        // its one instruction lives in `f`, borrowed across the call (the
        // kernel copies it).
        let r = unsafe { libc::ioctl(self.file.as_raw_fd(), libc::TUNATTACHFILTER as _, &prog) };
        if r < 0 {
            return Err(format!(
                "cannot attach a filter to TAP {}: {}",
                self.name,
                std::io::Error::last_os_error()
            ));
        }
        Ok(())
    }

    /// Detaches the TAP's own filter (TUNDETACHFILTER). tun keeps an
    /// attached filter on record for a persistent TAP and tries to attach
    /// it again to the next descriptor (from the user pointer it was given);
    /// on this kernel (6.18) a reopened TAP delivered frames all the same
    /// (checked), but detaching is what clears the record on any kernel.
    /// `false` if the kernel refused.
    pub fn keep_host_frames(&self) -> bool {
        // TUNDETACHFILTER reads no argument (its declared type is a
        // `sock_fprog`; an empty one is passed).
        let prog = libc::sock_fprog { len: 0, filter: std::ptr::null_mut() };
        // SAFETY: the ioctl takes a pointer to a `sock_fprog`, which `prog`
        // is, and does not read it.
        unsafe { libc::ioctl(self.file.as_raw_fd(), libc::TUNDETACHFILTER as _, &prog) == 0 }
    }

    /// A second handle on the same TAP (its frames can be written from
    /// both; for a shared link's ports).
    pub fn try_clone_file(&self) -> std::io::Result<File> {
        self.file.try_clone()
    }

    /// A stand-in for a TAP over one end of a `SOCK_SEQPACKET` socket pair
    /// (non-blocking; one frame per message), whose other end the VMM
    /// itself feeds: COLO's secondary VM receives the primary's input this
    /// way. `name` is for reports.
    pub fn over_socket(file: File, name: &str) -> Tap {
        Tap { file, name: name.to_string(), tx: None }
    }

    /// A stand-in over any file, for unit tests and fuzz targets of the
    /// devices above it (a socket pair stands in for the interface).
    #[cfg(any(test, fuzzing))]
    pub fn for_test(file: File) -> Tap {
        Tap { file, name: "test".into(), tx: None }
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
        match &self.tx {
            Some(t) => (&**t).write(frame).is_ok(),
            None => self.file.write(frame).is_ok(),
        }
    }
}

/// One member's port on a shared link: a non-blocking packet socket on
/// the shared TAP that the kernel fills with the frames for the member
/// (one frame per read: [`crate::packet::PacketSocket`]), and a handle on
/// the shared TAP the member's frames go out on. A VM's virtio-net device
/// uses it as its TAP ([`Tap::over_port`]). Clones share both; two ports
/// are equal only if they are one socket.
#[derive(Clone, Debug)]
pub struct Port {
    rx: std::sync::Arc<std::os::fd::OwnedFd>,
    tx: std::sync::Arc<File>,
}

impl Port {
    /// `rx` gives one frame per read and does not block.
    pub fn new(rx: std::os::fd::OwnedFd, tap: File) -> Port {
        Port { rx: std::sync::Arc::new(rx), tx: std::sync::Arc::new(tap) }
    }
}

impl PartialEq for Port {
    fn eq(&self, other: &Port) -> bool {
        std::sync::Arc::ptr_eq(&self.rx, &other.rx)
    }
}

impl Eq for Port {}
