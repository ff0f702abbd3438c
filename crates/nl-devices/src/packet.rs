//! The kernel's packet taps on a host TAP: `AF_PACKET` sockets with a
//! classic BPF filter, which a shared link's members receive from instead
//! of from a thread that reads the TAP (`nl_sandbox::shared_link`).
//!
//! A frame the host sends out of a TAP passes `dev_queue_xmit_nit` before
//! tun's transmit: every `AF_PACKET` socket bound to the TAP (protocol
//! `ETH_P_ALL`) whose filter accepts the frame gets a copy of it, with
//! packet type `PACKET_OUTGOING`. A frame written into the TAP's fd (a
//! member transmitting) is a frame the host *receives*: packet taps see it
//! too, but with type `PACKET_HOST`, `_BROADCAST`, `_MULTICAST` or
//! `_OTHERHOST`, so a filter that requires `PACKET_OUTGOING` keeps every
//! member's own and other members' transmitted frames out (checked on this
//! kernel, 6.18: docs/sandboxes.md, "Shared links").
//!
//! The filter is built here ([`Filter`]), checked on the host by a small
//! interpreter of the instructions it uses ([`Filter::accepts`]), and
//! attached before the socket is bound ([`PacketSocket::open`]): a packet
//! socket created with protocol 0 is on no packet-type list, so no frame
//! reaches it until `bind`, and from then on only through the filter.
//!
//! Every hand-written libc call of shared links is in this module and in
//! `tap.rs` (the TAP's own filter: [`crate::tap::Tap::drop_host_frames`]).

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// `PACKET_OUTGOING` (linux/if_packet.h): a frame the host sends.
pub const PACKET_OUTGOING: u8 = 4;
/// `PACKET_HOST`, `PACKET_BROADCAST`, `PACKET_MULTICAST`,
/// `PACKET_OTHERHOST`: frames the host receives (for tests).
pub const PACKET_HOST: u8 = 0;
pub const PACKET_BROADCAST: u8 = 1;
pub const PACKET_OTHERHOST: u8 = 3;
/// `PACKET_STATISTICS` (linux/if_packet.h), at level `SOL_PACKET`.
const PACKET_STATISTICS: libc::c_int = 6;
/// `SO_GET_FILTER` (asm-generic/socket.h: the same number as
/// `SO_ATTACH_FILTER`), read with `getsockopt`.
const SO_GET_FILTER: libc::c_int = libc::SO_ATTACH_FILTER;
/// The snap length an accepting filter returns (whole frames).
const ACCEPT: u32 = 0x4_0000;

// Classic BPF opcodes (linux/filter.h, linux/bpf_common.h).
const LD_W_ABS: u16 = 0x20;
const LD_H_ABS: u16 = 0x28;
const LD_B_ABS: u16 = 0x30;
const LD_W_LEN: u16 = 0x80;
const JEQ_K: u16 = 0x15;
const JGT_K: u16 = 0x25;
const JGE_K: u16 = 0x35;
const JSET_K: u16 = 0x45;
const RET_K: u16 = 0x06;
/// The ancillary load of the packet type (`SKF_AD_OFF + SKF_AD_PKTTYPE`).
const AD_PKTTYPE: u32 = (libc::SKF_AD_OFF + libc::SKF_AD_PKTTYPE) as u32;

/// A classic BPF program for a packet socket (or a TAP), built from a few
/// checks. Every jump is local (over at most 3 instructions), so a
/// program of any length stays within the 8-bit jump offsets.
#[derive(Clone, Debug, Default)]
pub struct Filter(Vec<libc::sock_filter>);

/// A condition a [`Filter`] tests on the value loaded last.
#[derive(Clone, Copy, Debug)]
pub enum Cond {
    Eq(u32),
    Gt(u32),
    Ge(u32),
    /// Any of these bits set.
    Set(u32),
}

impl Cond {
    fn code(self) -> (u16, u32) {
        match self {
            Cond::Eq(k) => (JEQ_K, k),
            Cond::Gt(k) => (JGT_K, k),
            Cond::Ge(k) => (JGE_K, k),
            Cond::Set(k) => (JSET_K, k),
        }
    }
}

impl Filter {
    pub fn new() -> Filter {
        Filter::default()
    }

    fn op(mut self, code: u16, jt: u8, jf: u8, k: u32) -> Filter {
        self.0.push(libc::sock_filter { code, jt, jf, k });
        self
    }

    /// Loads the frame's length.
    pub fn len(self) -> Filter {
        self.op(LD_W_LEN, 0, 0, 0)
    }

    /// Loads the frame's packet type (`PACKET_OUTGOING`, ...).
    pub fn pkttype(self) -> Filter {
        self.op(LD_B_ABS, 0, 0, AD_PKTTYPE)
    }

    /// Loads the byte at `offset` (a frame too short for it is refused).
    pub fn byte(self, offset: u32) -> Filter {
        self.op(LD_B_ABS, 0, 0, offset)
    }

    /// Loads the big-endian 16-bit word at `offset`.
    pub fn half(self, offset: u32) -> Filter {
        self.op(LD_H_ABS, 0, 0, offset)
    }

    /// Loads the big-endian 32-bit word at `offset`.
    pub fn word(self, offset: u32) -> Filter {
        self.op(LD_W_ABS, 0, 0, offset)
    }

    /// Refuses the frame unless `c` holds.
    pub fn require(self, c: Cond) -> Filter {
        let (code, k) = c.code();
        self.op(code, 1, 0, k).op(RET_K, 0, 0, 0)
    }

    /// Refuses the frame if `c` holds.
    pub fn refuse(self, c: Cond) -> Filter {
        let (code, k) = c.code();
        self.op(code, 0, 1, k).op(RET_K, 0, 0, 0)
    }

    /// Accepts the frame if `c` holds.
    pub fn accept_if(self, c: Cond) -> Filter {
        let (code, k) = c.code();
        self.op(code, 0, 1, k).op(RET_K, 0, 0, ACCEPT)
    }

    /// Accepts the frame unless `c` holds.
    pub fn accept_unless(self, c: Cond) -> Filter {
        let (code, k) = c.code();
        self.op(code, 1, 0, k).op(RET_K, 0, 0, ACCEPT)
    }

    /// Refuses the frame if its destination MAC (bytes 0..6) is `mac`;
    /// leaves the accumulator undefined.
    pub fn refuse_dst(self, mac: [u8; 6]) -> Filter {
        let (hi, lo) = mac_words(mac);
        // High half equal? Then test the low word; if not, skip the 3
        // instructions of that test.
        self.half(0).op(JEQ_K, 0, 3, hi).word(2).refuse(Cond::Eq(lo))
    }

    /// Refuses the frame unless its destination MAC is `mac`.
    pub fn require_dst(self, mac: [u8; 6]) -> Filter {
        let (hi, lo) = mac_words(mac);
        self.half(0).require(Cond::Eq(hi)).word(2).require(Cond::Eq(lo))
    }

    /// Ends the program: accepts what got this far.
    pub fn accept(self) -> Filter {
        self.op(RET_K, 0, 0, ACCEPT)
    }

    /// Ends the program: refuses what got this far.
    pub fn drop_all(self) -> Filter {
        self.op(RET_K, 0, 0, 0)
    }

    pub fn instructions(&self) -> usize {
        self.0.len()
    }

    /// The kernel's view of the program (valid while `self` lives).
    pub(crate) fn prog(&self) -> libc::sock_fprog {
        libc::sock_fprog { len: self.0.len() as u16, filter: self.0.as_ptr().cast_mut() }
    }

    /// Runs the program on `frame` of packet type `pkttype`, as the
    /// kernel would for the opcodes [`Filter`] emits (for tests; an
    /// opcode it does not know refuses).
    pub fn accepts(&self, frame: &[u8], pkttype: u8) -> bool {
        let (mut a, mut pc) = (0u32, 0usize);
        let at = |k: u32, n: usize| -> Option<u32> {
            let k = k as usize;
            let b = frame.get(k..k.checked_add(n)?)?;
            Some(b.iter().fold(0u32, |v, &x| v << 8 | u32::from(x)))
        };
        while let Some(i) = self.0.get(pc) {
            pc += 1;
            let jump = |hit: bool| usize::from(if hit { i.jt } else { i.jf });
            match i.code {
                LD_W_LEN => a = frame.len() as u32,
                LD_B_ABS if i.k == AD_PKTTYPE => a = u32::from(pkttype),
                LD_B_ABS | LD_H_ABS | LD_W_ABS => {
                    let n = match i.code {
                        LD_B_ABS => 1,
                        LD_H_ABS => 2,
                        _ => 4,
                    };
                    match at(i.k, n) {
                        Some(v) => a = v,
                        None => return false,
                    }
                }
                JEQ_K => pc += jump(a == i.k),
                JGT_K => pc += jump(a > i.k),
                JGE_K => pc += jump(a >= i.k),
                JSET_K => pc += jump(a & i.k != 0),
                RET_K => return i.k != 0,
                _ => return false,
            }
        }
        false
    }
}

fn mac_words(m: [u8; 6]) -> (u32, u32) {
    (u32::from(u16::from_be_bytes([m[0], m[1]])), u32::from_be_bytes([m[2], m[3], m[4], m[5]]))
}

/// The index of interface `name` in the calling thread's network
/// namespace.
pub fn ifindex(name: &str) -> std::io::Result<u32> {
    let c = std::ffi::CString::new(name)
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: if_nametoindex reads one NUL-terminated string, which `c` is.
    match unsafe { libc::if_nametoindex(c.as_ptr()) } {
        0 => Err(std::io::Error::last_os_error()),
        i => Ok(i),
    }
}

/// A non-blocking `AF_PACKET` socket (`SOCK_RAW`: whole Ethernet frames,
/// one per read) on one interface, behind a filter.
#[derive(Debug)]
pub struct PacketSocket(File);

impl PacketSocket {
    /// Opens a socket on interface `ifindex` that takes the frames
    /// `filter` accepts. The filter is attached before the socket is bound
    /// to the interface, so no frame reaches it unfiltered. With
    /// `rcvbuf`, the socket's receive buffer is set to that many bytes
    /// (the kernel's minimum if smaller): a socket that is only counted
    /// ([`PacketSocket::take_stats`]) holds a frame or two, then drops
    /// and counts the rest.
    pub fn open(ifindex: u32, filter: &Filter, rcvbuf: Option<usize>) -> std::io::Result<Self> {
        let sys = std::io::Error::last_os_error;
        // SAFETY: socket(2) with constant arguments; protocol 0 puts the
        // socket on no packet-type list until `bind` below.
        let fd = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                0,
            )
        };
        if fd < 0 {
            return Err(sys());
        }
        // SAFETY: `fd` is a fresh descriptor nothing else owns.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        let fd = file.as_raw_fd();
        // The filter's instructions live in `filter`, borrowed across the
        // call (the kernel copies them).
        set_socket_option(fd, libc::SO_ATTACH_FILTER, &filter.prog())?;
        if let Some(bytes) = rcvbuf {
            let v = bytes.min(i32::MAX as usize) as libc::c_int;
            set_socket_option(fd, libc::SO_RCVBUF, &v)?;
        }
        // SAFETY: `sockaddr_ll` is plain data; all zeroes is a valid value.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = (libc::ETH_P_ALL as u16).to_be();
        sll.sll_ifindex = ifindex as i32;
        // SAFETY: bind reads one `sockaddr_ll` of the length given, which `sll` is.
        let r = unsafe {
            libc::bind(
                fd,
                (&sll as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        if r < 0 {
            return Err(sys());
        }
        Ok(PacketSocket(file))
    }

    /// Frames the filter accepted and frames the socket dropped (its
    /// buffer was full) since the last call: `PACKET_STATISTICS`, which
    /// the kernel resets on each read. The accepted count includes the
    /// dropped.
    pub fn take_stats(&self) -> std::io::Result<(u64, u64)> {
        // struct tpacket_stats { unsigned tp_packets, tp_drops; }
        let mut st = [0u32; 2];
        let mut len = std::mem::size_of_val(&st) as libc::socklen_t;
        // SAFETY: PACKET_STATISTICS writes at most `len` bytes (one
        // `tpacket_stats`, 8 bytes) into `st`, which has that many.
        let r = unsafe {
            libc::getsockopt(
                self.0.as_raw_fd(),
                libc::SOL_PACKET,
                PACKET_STATISTICS,
                st.as_mut_ptr().cast(),
                &mut len,
            )
        };
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok((u64::from(st[0]), u64::from(st[1])))
    }

    /// Sends one frame out of the interface, as the host does (for
    /// tests: packet taps see it as `PACKET_OUTGOING`; the sending socket
    /// does not get it back).
    pub fn send(&self, frame: &[u8]) -> std::io::Result<usize> {
        (&self.0).write(frame)
    }

    /// A second descriptor on the socket.
    pub fn try_clone_fd(&self) -> std::io::Result<OwnedFd> {
        Ok(OwnedFd::from(self.0.try_clone()?))
    }

    pub fn raw_fd(&self) -> std::os::fd::RawFd {
        self.0.as_raw_fd()
    }

    /// Takes over a descriptor inherited across exec (a shared link carried
    /// to a new VMM process) after checking that it is what
    /// [`PacketSocket::open`] made: an `AF_PACKET` `SOCK_RAW` socket bound
    /// to interface `ifindex` for every protocol (`ETH_P_ALL`). Made
    /// non-blocking again (a device reads it so). The message says what it
    /// is instead.
    pub fn from_inherited(file: File, ifindex: u32) -> Result<Self, String> {
        let fd = file.as_raw_fd();
        let domain =
            get_int_option(fd, libc::SO_DOMAIN).map_err(|e| format!("not a socket ({e})"))?;
        let kind = get_int_option(fd, libc::SO_TYPE).map_err(|e| format!("not a socket ({e})"))?;
        if domain != libc::AF_PACKET || kind != libc::SOCK_RAW {
            return Err(format!(
                "not a raw packet socket (domain {domain}, type {kind}; want {}, {})",
                libc::AF_PACKET,
                libc::SOCK_RAW
            ));
        }
        // SAFETY: `sockaddr_ll` is plain data; all zeroes is a valid value.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
        // SAFETY: getsockname writes at most `len` bytes (one `sockaddr_ll`)
        // into `sll`, which has that many, and the length into `len`.
        let r =
            unsafe { libc::getsockname(fd, (&mut sll as *mut libc::sockaddr_ll).cast(), &mut len) };
        if r < 0 {
            return Err(format!("cannot read its address: {}", std::io::Error::last_os_error()));
        }
        let protocol = u16::from_be(sll.sll_protocol);
        if sll.sll_family != libc::AF_PACKET as u16
            || sll.sll_ifindex != ifindex as i32
            || protocol != libc::ETH_P_ALL as u16
        {
            return Err(format!(
                "bound to interface {} for protocol {protocol:#06x}, not to interface {ifindex} \
                 for every protocol",
                sll.sll_ifindex
            ));
        }
        set_nonblocking(fd).map_err(|e| format!("cannot make it non-blocking: {e}"))?;
        Ok(PacketSocket(file))
    }

    /// Whether the socket's filter is `filter`, instruction for
    /// instruction (`SO_GET_FILTER`: the classic program as attached).
    /// False without a filter.
    pub fn has_filter(&self, filter: &Filter) -> std::io::Result<bool> {
        let fd = self.0.as_raw_fd();
        // The option's length is counted in instructions, not bytes.
        let mut n: libc::socklen_t = 0;
        // SAFETY: with a length of 0 the kernel writes no instruction, only
        // the program's length into `n`.
        let r = unsafe {
            libc::getsockopt(fd, libc::SOL_SOCKET, SO_GET_FILTER, std::ptr::null_mut(), &mut n)
        };
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if n as usize != filter.0.len() {
            return Ok(false);
        }
        let mut got = vec![libc::sock_filter { code: 0, jt: 0, jf: 0, k: 0 }; filter.0.len()];
        let mut len = got.len() as libc::socklen_t;
        // SAFETY: the kernel writes at most `len` instructions (it refuses a
        // longer program) into `got`, which holds that many.
        let r = unsafe {
            libc::getsockopt(fd, libc::SOL_SOCKET, SO_GET_FILTER, got.as_mut_ptr().cast(), &mut len)
        };
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let same = |a: &libc::sock_filter, b: &libc::sock_filter| {
            (a.code, a.jt, a.jf, a.k) == (b.code, b.jt, b.jf, b.k)
        };
        Ok(len as usize == got.len() && got.iter().zip(&filter.0).all(|(a, b)| same(a, b)))
    }
}

/// `getsockopt(fd, SOL_SOCKET, name)` of an option whose value is an `int`.
fn get_int_option(fd: libc::c_int, name: libc::c_int) -> std::io::Result<libc::c_int> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes (one `int`) into `v`.
    let r = unsafe {
        libc::getsockopt(fd, libc::SOL_SOCKET, name, (&mut v as *mut libc::c_int).cast(), &mut len)
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(v)
}

/// Sets `O_NONBLOCK` on `fd`'s open file description.
fn set_nonblocking(fd: libc::c_int) -> std::io::Result<()> {
    // SAFETY: F_GETFL/F_SETFL only read and write the file status flags of fd.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `setsockopt(fd, SOL_SOCKET, name, value)` for an option whose value is
/// one `T` (`SO_ATTACH_FILTER`: a `sock_fprog`; `SO_RCVBUF`: an `int`).
fn set_socket_option<T>(fd: libc::c_int, name: libc::c_int, value: &T) -> std::io::Result<()> {
    // SAFETY: the kernel reads `size_of::<T>()` bytes from `value`, one
    // `T`, which is what the option named by the caller takes.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            name,
            (value as *const T).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: [u8; 6] = [0x52, 0x54, 0, 0, 0, 2];
    const B: [u8; 6] = [0x52, 0x54, 0, 0, 0, 3];

    fn frame(dst: [u8; 6], len: usize) -> Vec<u8> {
        let mut f = vec![0u8; len];
        let n = len.min(6);
        f[..n].copy_from_slice(&dst[..n]);
        f
    }

    #[test]
    fn the_interpreter_follows_the_checks() {
        let f = Filter::new()
            .len()
            .require(Cond::Ge(14))
            .refuse(Cond::Gt(1514))
            .pkttype()
            .require(Cond::Eq(u32::from(PACKET_OUTGOING)))
            .byte(0)
            .accept_if(Cond::Set(1))
            .require_dst(A)
            .accept();
        let out = PACKET_OUTGOING;
        assert!(f.accepts(&frame(A, 60), out));
        assert!(f.accepts(&frame(A, 14), out));
        assert!(f.accepts(&frame(A, 1514), out));
        assert!(!f.accepts(&frame(A, 13), out));
        assert!(!f.accepts(&frame(A, 1515), out));
        assert!(!f.accepts(&frame(A, 0), out));
        assert!(!f.accepts(&frame(B, 60), out));
        assert!(!f.accepts(&frame([0x52, 0x55, 0, 0, 0, 2], 60), out));
        assert!(f.accepts(&frame([0xff; 6], 60), out));
        assert!(f.accepts(&frame([0x33, 0x33, 0, 0, 0, 1], 60), out));
        for t in [PACKET_HOST, PACKET_BROADCAST, PACKET_OTHERHOST] {
            assert!(!f.accepts(&frame(A, 60), t));
            assert!(!f.accepts(&frame([0xff; 6], 60), t));
        }
    }

    #[test]
    fn refuse_dst_skips_other_macs_and_stops_at_its_own() {
        let f = Filter::new().refuse_dst(A).refuse_dst(B).accept();
        assert!(!f.accepts(&frame(A, 60), 0));
        assert!(!f.accepts(&frame(B, 60), 0));
        assert!(f.accepts(&frame([0x52, 0x54, 0, 0, 0, 4], 60), 0));
        // Same high half as A, other low word; other high half, A's low word.
        assert!(f.accepts(&frame([0x52, 0x54, 1, 0, 0, 2], 60), 0));
        assert!(f.accepts(&frame([0x53, 0x54, 0, 0, 0, 2], 60), 0));
        // Too short to hold a MAC: refused, as the kernel does.
        assert!(!f.accepts(&frame(A, 4), 0));
    }

    /// An inherited descriptor is taken as a link's socket only if it is a
    /// raw packet socket bound to the interface named, and its filter is
    /// read back as attached (on loopback, in the test's namespace; skipped
    /// without the right to open packet sockets).
    #[test]
    fn inherited_packet_sockets_are_checked_and_their_filters_read_back() {
        let lo = ifindex("lo").expect("loopback");
        let f = Filter::new().pkttype().require(Cond::Eq(u32::from(PACKET_OUTGOING))).accept();
        let s = match PacketSocket::open(lo, &f, Some(1)) {
            Ok(s) => s,
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => return,
            Err(e) => panic!("{e}"),
        };
        let dup = || File::from(s.try_clone_fd().unwrap());
        let back = PacketSocket::from_inherited(dup(), lo).unwrap();
        assert!(back.has_filter(&f).unwrap());
        assert!(!back.has_filter(&Filter::new().drop_all()).unwrap());
        let other = Filter::new().pkttype().require(Cond::Eq(u32::from(PACKET_HOST))).accept();
        assert!(!back.has_filter(&other).unwrap(), "same length, another constant");
        let e = PacketSocket::from_inherited(dup(), lo + 1000).unwrap_err();
        assert!(e.contains(&format!("not to interface {}", lo + 1000)), "{e}");
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let e = PacketSocket::from_inherited(File::from(OwnedFd::from(udp)), lo).unwrap_err();
        assert!(e.contains("not a raw packet socket"), "{e}");
        let file = tempfile::tempfile().unwrap();
        let e = PacketSocket::from_inherited(file, lo).unwrap_err();
        assert!(e.contains("not a socket"), "{e}");
    }

    #[test]
    fn long_programs_keep_every_jump_local() {
        let mut f = Filter::new();
        for i in 0..200u8 {
            f = f.refuse_dst([2, 0, 0, 0, 0, i]);
        }
        let f = f.accept();
        assert!(f.0.iter().all(|i| i.jt <= 3 && i.jf <= 3));
        assert!(!f.accepts(&frame([2, 0, 0, 0, 0, 199], 60), 0));
        assert!(f.accepts(&frame([2, 0, 0, 0, 1, 199], 60), 0));
    }
}
