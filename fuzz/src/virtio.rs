//! A hostile guest driver against the virtio-mmio transport and the blk and
//! net device models: the fuzzer writes descriptor tables, rings, request
//! headers and registers as it likes, and notifies queues.
//!
//! Properties checked for every input:
//! - no panic, and every notify returns (the chain walk is bounded);
//! - the device never publishes more used buffers than were made available;
//! - after any sequence, a driver reset and a well-formed request work again
//!   (a hostile driver cannot wedge the device for good).

use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixDatagram;
use std::sync::OnceLock;

use arbitrary::Arbitrary;
use nl_devices::virtio::blk::Block;
use nl_devices::virtio::net::Net;
use nl_devices::virtio::{regs, GuestMem, MmioTransport, VirtioDevice, STATUS_NEEDS_RESET};
use nl_devices::Device;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// Guest memory: 1 MiB at 0, and a 64 KiB island at 2 MiB (a hole between).
const MEM: u64 = 1 << 20;
const ISLAND: u64 = 2 << 20;
const DESC: u64 = 0x1000;
const AVAIL: u64 = 0x3000;
const USED: u64 = 0x5000;
const HDR: u64 = 0x8000;
const BUF: u64 = 0x10000;
const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;

/// Where a descriptor points.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Addr {
    Header(u16),
    Buffer(u32),
    /// Near the end of the low region (straddling it with a long length).
    End(u16),
    Island(u16),
    Hole(u32),
    Raw(u64),
}

impl Addr {
    fn gpa(self) -> u64 {
        match self {
            Addr::Header(o) => HDR + u64::from(o % 0x1000),
            Addr::Buffer(o) => BUF + u64::from(o) % (MEM - BUF),
            Addr::End(o) => MEM - 1 - u64::from(o % 0x2000),
            Addr::Island(o) => ISLAND + u64::from(o),
            Addr::Hole(o) => MEM + u64::from(o) % (ISLAND - MEM),
            Addr::Raw(a) => a,
        }
    }
}

/// One action of the hostile driver.
#[derive(Arbitrary, Debug)]
pub enum Op {
    /// Writes a descriptor of the table.
    Desc { i: u8, addr: Addr, len: u32, flags: u16, next: u16 },
    /// Offers a chain head on the available ring.
    Offer { q: u8, head: u16 },
    /// Sets the available index to anything.
    AvailIdx { q: u8, idx: u16 },
    /// Writes raw bytes into guest memory (headers, buffers, rings).
    Poke { at: Addr, bytes: Vec<u8> },
    Notify { q: u8 },
    /// Writes any transport register.
    Reg { offset: u16, value: u32 },
    /// Reads any transport register (config space included).
    Read { offset: u16, len: u8 },
    /// Lays the queue out at the standard addresses with this size.
    Setup { q: u8, size: u16 },
    /// A frame arrives on the TAP (virtio-net).
    Frame(Vec<u8>),
    /// The device's state is saved and restored (a handover).
    SaveRestore,
}

/// The transport around one device, with its guest memory.
pub struct Rig<D: VirtioDevice> {
    t: MmioTransport<D>,
    mem: GuestMem,
    queues: u32,
    offered: Vec<u16>,
}

fn w32<D: VirtioDevice>(t: &mut MmioTransport<D>, off: u64, v: u32) {
    t.write(0, off, &v.to_le_bytes());
}

fn r32<D: VirtioDevice>(t: &mut MmioTransport<D>, off: u64) -> u32 {
    let mut b = [0u8; 4];
    t.read(0, off, &mut b);
    u32::from_le_bytes(b)
}

/// Queue `q`'s rings: each queue gets its own 8 KiB slice of each area.
fn ring(base: u64, q: u32) -> u64 {
    base + u64::from(q) * 0x1000 / 2
}

impl<D: VirtioDevice> Rig<D> {
    pub fn new(dev: D) -> Self {
        let mem = GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0), MEM as usize),
            (GuestAddress(ISLAND), 0x10000),
        ])
        .expect("guest memory");
        let queues = dev.queue_max_sizes().len() as u32;
        let t = MmioTransport::new(dev, mem.clone());
        let mut r = Rig { t, mem, queues, offered: vec![0; queues as usize] };
        r.driver_init(16);
        r
    }

    /// A well-behaved driver's initialisation, every queue of `size`.
    fn driver_init(&mut self, size: u16) {
        w32(&mut self.t, regs::STATUS, 0);
        w32(&mut self.t, regs::STATUS, 1 | 2);
        w32(&mut self.t, regs::DRIVER_FEATURES_SEL, 1);
        w32(&mut self.t, regs::DRIVER_FEATURES, 1);
        w32(&mut self.t, regs::STATUS, 1 | 2 | 8);
        for q in 0..self.queues {
            self.setup(q, size);
        }
        w32(&mut self.t, regs::STATUS, 1 | 2 | 8 | 4);
        self.offered.iter_mut().for_each(|o| *o = 0);
    }

    fn setup(&mut self, q: u32, size: u16) {
        let _ = self.mem.write_slice(&[0u8; 0x800], GuestAddress(ring(AVAIL, q)));
        let _ = self.mem.write_slice(&[0u8; 0x800], GuestAddress(ring(USED, q)));
        w32(&mut self.t, regs::QUEUE_SEL, q);
        w32(&mut self.t, regs::QUEUE_NUM, u32::from(size));
        w32(&mut self.t, regs::QUEUE_DESC_LOW, ring(DESC, q) as u32);
        w32(&mut self.t, regs::QUEUE_AVAIL_LOW, ring(AVAIL, q) as u32);
        w32(&mut self.t, regs::QUEUE_USED_LOW, ring(USED, q) as u32);
        w32(&mut self.t, regs::QUEUE_READY, 1);
    }

    fn desc(&self, q: u32, i: u16, gpa: u64, len: u32, flags: u16, next: u16) {
        let a = GuestAddress(ring(DESC, q) + u64::from(i % 128) * 16);
        let mut d = [0u8; 16];
        d[..8].copy_from_slice(&gpa.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&flags.to_le_bytes());
        d[14..].copy_from_slice(&next.to_le_bytes());
        let _ = self.mem.write_slice(&d, a);
    }

    fn offer(&mut self, q: u32, head: u16) {
        let n = &mut self.offered[q as usize];
        let slot = ring(AVAIL, q) + 4 + 2 * u64::from(*n % 16);
        let _ = self.mem.write_obj(head, GuestAddress(slot));
        *n = n.wrapping_add(1);
        let _ = self.mem.write_obj(*n, GuestAddress(ring(AVAIL, q) + 2));
    }

    fn used(&self, q: u32) -> u16 {
        self.mem.read_obj(GuestAddress(ring(USED, q) + 2)).unwrap_or(0)
    }

    fn needs_reset(&mut self) -> bool {
        r32(&mut self.t, regs::STATUS) & STATUS_NEEDS_RESET != 0
    }

    /// Runs the hostile driver's actions; `frame` delivers a TAP frame.
    pub fn run(&mut self, ops: &[Op], mut frame: impl FnMut(&[u8])) {
        for op in ops {
            match op {
                Op::Desc { i, addr, len, flags, next } => {
                    self.desc(0, u16::from(*i), addr.gpa(), *len, *flags, *next);
                    self.desc(1 % self.queues, u16::from(*i), addr.gpa(), *len, *flags, *next);
                }
                Op::Offer { q, head } => self.offer(u32::from(*q) % self.queues, *head),
                Op::AvailIdx { q, idx } => {
                    let q = u32::from(*q) % self.queues;
                    let _ = self.mem.write_obj(*idx, GuestAddress(ring(AVAIL, q) + 2));
                }
                Op::Poke { at, bytes } => {
                    let _ = self.mem.write_slice(&bytes[..bytes.len().min(4096)], GuestAddress(at.gpa()));
                }
                Op::Notify { q } => {
                    let q = u32::from(*q) % self.queues;
                    let before = self.used(q);
                    let healthy = !self.needs_reset();
                    w32(&mut self.t, regs::QUEUE_NOTIFY, q);
                    // A healthy device publishes at most what was offered.
                    let after = self.used(q);
                    let avail: u16 =
                        self.mem.read_obj(GuestAddress(ring(AVAIL, q) + 2)).unwrap_or(0);
                    if healthy && !self.needs_reset() {
                        let published = after.wrapping_sub(before);
                        let outstanding = avail.wrapping_sub(before);
                        assert!(
                            published <= outstanding || published == 0,
                            "device published {published} used buffers, {outstanding} offered"
                        );
                    }
                }
                Op::Reg { offset, value } => w32(&mut self.t, u64::from(*offset % 0x200), *value),
                Op::Read { offset, len } => {
                    let mut b = [0u8; 8];
                    let n = (usize::from(*len) % 8) + 1;
                    self.t.read(0, u64::from(*offset % 0x200), &mut b[..n]);
                }
                Op::Setup { q, size } => self.setup(u32::from(*q) % self.queues, *size),
                Op::Frame(f) => frame(&f[..f.len().min(70000)]),
                Op::SaveRestore => {
                    let saved = self.t.save();
                    self.t.restore(&saved).expect("a device's own saved state restores");
                }
            }
        }
    }
}

/// A virtio-blk device over a scratch 1 MiB image.
pub fn blk(data: &[u8]) {
    let Ok(ops) = arbitrary::Unstructured::new(data).arbitrary::<Vec<Op>>() else { return };
    // One scratch image for the process (its contents do not matter).
    static DISK: OnceLock<tempfile::TempPath> = OnceLock::new();
    let path = DISK.get_or_init(|| {
        let f = tempfile::NamedTempFile::new().expect("disk image");
        f.as_file().set_len(1 << 20).expect("disk size");
        f.into_temp_path()
    });
    let mut r = Rig::new(Block::open(path, false).expect("disk"));
    r.run(&ops, |_| {});
    // Recovery: reset, re-initialise, and one well-formed read of sector 0.
    r.driver_init(16);
    let _ = r.mem.write_slice(&[0u8; 16], GuestAddress(HDR)); // VIRTIO_BLK_T_IN, sector 0
    r.desc(0, 0, HDR, 16, F_NEXT, 1);
    r.desc(0, 1, BUF, 512, F_NEXT | F_WRITE, 2);
    r.desc(0, 2, HDR + 0x100, 1, F_WRITE, 0);
    let _ = r.mem.write_obj(0xffu8, GuestAddress(HDR + 0x100));
    r.offer(0, 0);
    w32(&mut r.t, regs::QUEUE_NOTIFY, 0);
    assert_eq!(r.used(0), 1, "a reset device serves a well-formed request");
    let status: u8 = r.mem.read_obj(GuestAddress(HDR + 0x100)).unwrap_or(0xff);
    assert_eq!(status, 0, "the well-formed read succeeds after a reset");
}

/// A virtio-net device whose TAP is one end of a datagram socket pair.
pub fn net(data: &[u8]) {
    let Ok(ops) = arbitrary::Unstructured::new(data).arbitrary::<Vec<Op>>() else { return };
    let (dev_end, host_end) = UnixDatagram::pair().expect("socket pair");
    dev_end.set_nonblocking(true).expect("nonblocking");
    host_end.set_nonblocking(true).expect("nonblocking");
    let tap = nl_devices::tap::Tap::for_test(File::from(OwnedFd::from(dev_end)));
    let mut r = Rig::new(Net::new(tap, [2, 0, 0, 0, 0, 1]));
    r.run(&ops, |f| {
        let _ = host_end.send(f);
    });
    // Drain what the guest transmitted (bounded: the socket buffer).
    let mut buf = vec![0u8; 65536];
    while host_end.recv(&mut buf).is_ok() {}
    // Recovery: reset, and one well-formed frame transmitted.
    r.driver_init(16);
    let _ = r.mem.write_slice(&[0u8; 12], GuestAddress(HDR));
    let _ = r.mem.write_slice(&[0xabu8; 60], GuestAddress(BUF));
    r.desc(1, 0, HDR, 12, F_NEXT, 1);
    r.desc(1, 1, BUF, 60, 0, 0);
    r.offer(1, 0);
    w32(&mut r.t, regs::QUEUE_NOTIFY, 1);
    assert_eq!(r.used(1), 1, "a reset device transmits a well-formed frame");
    let n = host_end.recv(&mut buf).expect("the frame reached the TAP");
    assert_eq!(&buf[..n], &[0xabu8; 60][..]);
}
