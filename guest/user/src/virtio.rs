//! A ring-3 virtio-blk driver over virtio-mmio: the device's registers are
//! in the user-mapped device page and its queue in the DMA area, so no
//! supervisor code is involved. It polls: the VMM completes a request
//! during the QueueNotify write, so the used ring is up to date when the
//! write instruction retires. One request in flight at a time; buffers are
//! guest-physical = guest-virtual addresses of user memory.

use core::ptr::{read_volatile, write_volatile};
use core::sync::atomic::{fence, Ordering};

const MAGIC: u32 = 0x7472_6976;
const R_MAGIC: u64 = 0x000;
const R_VERSION: u64 = 0x004;
const R_DEVICE_ID: u64 = 0x008;
const R_DEVICE_FEATURES: u64 = 0x010;
const R_DEVICE_FEATURES_SEL: u64 = 0x014;
const R_DRIVER_FEATURES: u64 = 0x020;
const R_DRIVER_FEATURES_SEL: u64 = 0x024;
const R_QUEUE_SEL: u64 = 0x030;
const R_QUEUE_NUM_MAX: u64 = 0x034;
const R_QUEUE_NUM: u64 = 0x038;
const R_QUEUE_READY: u64 = 0x044;
const R_QUEUE_NOTIFY: u64 = 0x050;
const R_STATUS: u64 = 0x070;
const R_QUEUE_DESC_LOW: u64 = 0x080;
const R_QUEUE_DESC_HIGH: u64 = 0x084;
const R_QUEUE_AVAIL_LOW: u64 = 0x090;
const R_QUEUE_AVAIL_HIGH: u64 = 0x094;
const R_QUEUE_USED_LOW: u64 = 0x0a0;
const R_QUEUE_USED_HIGH: u64 = 0x0a4;
const R_CONFIG: u64 = 0x100;

const S_ACK: u32 = 1;
const S_DRIVER: u32 = 2;
const S_DRIVER_OK: u32 = 4;
const S_FEATURES_OK: u32 = 8;
const S_NEEDS_RESET: u32 = 0x40;

pub const F_NEXT: u16 = 1;
pub const F_WRITE: u16 = 2;

const T_IN: u32 = 0;
const T_OUT: u32 = 1;

/// Queue entries used (one request of three descriptors at a time).
pub const QSIZE: u16 = 16;

/// Why the device could not be set up (the step, reported to the VMM).
#[derive(Clone, Copy, Debug)]
pub struct InitError(pub u64);

pub struct Blk {
    base: u64,
    desc: u64,
    avail: u64,
    used: u64,
    hdr: u64,
    status: u64,
    avail_idx: u16,
    /// Capacity in 512-byte sectors.
    pub sectors: u64,
}

#[inline(always)]
fn r32(addr: u64) -> u32 {
    // SAFETY: the address is in the user-mapped device page (a device register).
    unsafe { read_volatile(addr as *const u32) }
}

#[inline(always)]
fn w32(addr: u64, v: u32) {
    // SAFETY: as in `r32`.
    unsafe { write_volatile(addr as *mut u32, v) }
}

#[inline(always)]
pub fn put<T>(addr: u64, v: T) {
    // SAFETY: the address is in this vCPU's DMA area (user memory set aside by the VMM).
    unsafe { write_volatile(addr as *mut T, v) }
}

#[inline(always)]
pub fn get<T>(addr: u64) -> T {
    // SAFETY: as in `put`.
    unsafe { read_volatile(addr as *const T) }
}

/// Resets and sets up the virtio-mmio device at `base` (device ID `id`)
/// with only VIRTIO_F_VERSION_1, queue i of [`QSIZE`] entries at `queues[i]`
/// (descriptors, then avail ring at +4 KiB and used ring at +8 KiB, all
/// zeroed here), and sets DRIVER_OK.
pub fn init_device(base: u64, id: u32, queues: &[u64]) -> Result<(), InitError> {
    if r32(base + R_MAGIC) != MAGIC || r32(base + R_VERSION) != 2 {
        return Err(InitError(1));
    }
    if r32(base + R_DEVICE_ID) != id {
        return Err(InitError(2));
    }
    w32(base + R_STATUS, 0);
    w32(base + R_STATUS, S_ACK);
    w32(base + R_STATUS, S_ACK | S_DRIVER);
    w32(base + R_DEVICE_FEATURES_SEL, 1);
    if r32(base + R_DEVICE_FEATURES) & 1 == 0 {
        return Err(InitError(3)); // no VIRTIO_F_VERSION_1
    }
    w32(base + R_DRIVER_FEATURES_SEL, 0);
    w32(base + R_DRIVER_FEATURES, 0);
    w32(base + R_DRIVER_FEATURES_SEL, 1);
    w32(base + R_DRIVER_FEATURES, 1);
    w32(base + R_STATUS, S_ACK | S_DRIVER | S_FEATURES_OK);
    if r32(base + R_STATUS) & S_FEATURES_OK == 0 {
        return Err(InitError(4));
    }
    for (i, &q) in queues.iter().enumerate() {
        w32(base + R_QUEUE_SEL, i as u32);
        if r32(base + R_QUEUE_NUM_MAX) < u32::from(QSIZE) {
            return Err(InitError(5));
        }
        for a in (q..q + 0x3000).step_by(8) {
            put(a, 0u64);
        }
        let (desc, avail, used) = (q, q + 0x1000, q + 0x2000);
        w32(base + R_QUEUE_NUM, u32::from(QSIZE));
        w32(base + R_QUEUE_DESC_LOW, desc as u32);
        w32(base + R_QUEUE_DESC_HIGH, (desc >> 32) as u32);
        w32(base + R_QUEUE_AVAIL_LOW, avail as u32);
        w32(base + R_QUEUE_AVAIL_HIGH, (avail >> 32) as u32);
        w32(base + R_QUEUE_USED_LOW, used as u32);
        w32(base + R_QUEUE_USED_HIGH, (used >> 32) as u32);
        w32(base + R_QUEUE_READY, 1);
    }
    w32(base + R_STATUS, S_ACK | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK);
    if r32(base + R_STATUS) & S_NEEDS_RESET != 0 {
        return Err(InitError(6));
    }
    Ok(())
}

/// Notifies queue `q` of the device at `base` (an exit: the VMM serves it
/// before the write completes).
pub fn notify(base: u64, q: u32) {
    w32(base + R_QUEUE_NOTIFY, q);
}

impl Blk {
    /// Sets the device at `base` up with its queue at `dma` (16 KiB:
    /// descriptors, avail ring, used ring, request header and status).
    pub fn init(base: u64, dma: u64) -> Result<Blk, InitError> {
        init_device(base, 2, &[dma])?;
        let (desc, avail, used) = (dma, dma + 0x1000, dma + 0x2000);
        let sectors = u64::from(r32(base + R_CONFIG)) | (u64::from(r32(base + R_CONFIG + 4)) << 32);
        Ok(Blk {
            base,
            desc,
            avail,
            used,
            hdr: dma + 0x3000,
            status: dma + 0x3010,
            avail_idx: 0,
            sectors,
        })
    }

    fn set_desc(&self, i: u64, addr: u64, len: u32, flags: u16, next: u16) {
        let d = self.desc + i * 16;
        put(d, addr);
        put(d + 8, len);
        put(d + 12, flags);
        put(d + 14, next);
    }

    /// One request of `len` bytes at `buf`; true if the device reports OK.
    fn request(&mut self, kind: u32, sector: u64, buf: u64, len: u32) -> bool {
        put(self.hdr, kind);
        put(self.hdr + 4, 0u32);
        put(self.hdr + 8, sector);
        put(self.status, 0xffu8);
        let data_flags = if kind == T_IN { F_NEXT | F_WRITE } else { F_NEXT };
        self.set_desc(0, self.hdr, 16, F_NEXT, 1);
        self.set_desc(1, buf, len, data_flags, 2);
        self.set_desc(2, self.status, 1, F_WRITE, 0);
        let slot = u64::from(self.avail_idx % QSIZE);
        put(self.avail + 4 + 2 * slot, 0u16);
        self.avail_idx = self.avail_idx.wrapping_add(1);
        fence(Ordering::SeqCst);
        put(self.avail + 2, self.avail_idx);
        fence(Ordering::SeqCst);
        w32(self.base + R_QUEUE_NOTIFY, 0);
        // The VMM has completed the request when the notify returns; poll a
        // bounded number of times in case another implementation is slower.
        for _ in 0..1_000_000u32 {
            fence(Ordering::SeqCst);
            if get::<u16>(self.used + 2) == self.avail_idx {
                return get::<u8>(self.status) == 0;
            }
            if r32(self.base + R_STATUS) & S_NEEDS_RESET != 0 {
                return false;
            }
            core::hint::spin_loop();
        }
        false
    }

    /// Submits the chain at descriptor 0 (already written); `bump` extra
    /// avail-index increments make the index bogus. Returns the status byte
    /// if the request was used, or None (with the device needing a reset, or not).
    fn submit_raw(&mut self, bump: u16) -> (Option<u8>, bool) {
        put(self.status, 0xffu8);
        let slot = u64::from(self.avail_idx % QSIZE);
        put(self.avail + 4 + 2 * slot, 0u16);
        self.avail_idx = self.avail_idx.wrapping_add(1).wrapping_add(bump);
        fence(Ordering::SeqCst);
        put(self.avail + 2, self.avail_idx);
        fence(Ordering::SeqCst);
        w32(self.base + R_QUEUE_NOTIFY, 0);
        fence(Ordering::SeqCst);
        let reset = r32(self.base + R_STATUS) & S_NEEDS_RESET != 0;
        let used = get::<u16>(self.used + 2) == self.avail_idx;
        (used.then(|| get::<u8>(self.status)), reset)
    }

    /// Test-only: drives the device with malformed requests and checks each
    /// gets the virtio error it must: IOERR for a buffer outside guest memory
    /// and for a buffer of the wrong direction, DEVICE_NEEDS_RESET for a
    /// descriptor loop and for a bogus avail index; after a reset the device
    /// works again. Returns the number of the first check that failed.
    pub fn malformed_checks(base: u64, dma: u64, scratch: u64) -> Result<Blk, u64> {
        const IOERR: Option<u8> = Some(1);
        let mut b = Blk::init(base, dma).map_err(|e| 100 + e.0)?;
        // 1: data buffer far outside guest memory.
        b.set_desc(0, b.hdr, 16, F_NEXT, 1);
        b.set_desc(1, 1 << 46, 512, F_NEXT | F_WRITE, 2);
        b.set_desc(2, b.status, 1, F_WRITE, 0);
        put(b.hdr, T_IN);
        put(b.hdr + 8, 0u64);
        if b.submit_raw(0) != (IOERR, false) {
            return Err(1);
        }
        // 2: a read into a device-readable (not writable) buffer.
        b.set_desc(1, scratch, 512, F_NEXT, 2);
        if b.submit_raw(0) != (IOERR, false) {
            return Err(2);
        }
        // 3: the device still serves a good request.
        let mut buf = [0u64; 64];
        if !b.read(0, &mut buf) {
            return Err(3);
        }
        // 4: a descriptor loop (0 -> 1 -> 0).
        b.set_desc(0, b.hdr, 16, F_NEXT, 1);
        b.set_desc(1, scratch, 512, F_NEXT | F_WRITE, 0);
        if !b.submit_raw(0).1 {
            return Err(4);
        }
        // 5: after a reset the device works again.
        let mut b = Blk::init(base, dma).map_err(|_| 5u64)?;
        if !b.read(0, &mut buf) {
            return Err(5);
        }
        // 6: an avail index more than a queue ahead of the device's.
        b.set_desc(0, b.hdr, 16, F_NEXT, 1);
        b.set_desc(1, scratch, 512, F_NEXT | F_WRITE, 2);
        b.set_desc(2, b.status, 1, F_WRITE, 0);
        if !b.submit_raw(QSIZE * 4).1 {
            return Err(6);
        }
        let mut b = Blk::init(base, dma).map_err(|_| 7u64)?;
        if !b.read(0, &mut buf) {
            return Err(7);
        }
        Ok(b)
    }

    pub fn read(&mut self, sector: u64, buf: &mut [u64]) -> bool {
        match u32::try_from(buf.len() * 8) {
            Ok(len) => self.request(T_IN, sector, buf.as_mut_ptr() as u64, len),
            Err(_) => false,
        }
    }

    pub fn write(&mut self, sector: u64, buf: &[u64]) -> bool {
        match u32::try_from(buf.len() * 8) {
            Ok(len) => self.request(T_OUT, sector, buf.as_ptr() as u64, len),
            Err(_) => false,
        }
    }
}
