//! virtio-blk backed by a raw image file on the host.
//!
//! Requests are served synchronously with positioned reads and writes on
//! the image, straight between the file and guest memory (no copy through
//! a VMM buffer). Supported: IN, OUT, FLUSH (fdatasync), GET_ID; a
//! read-only disk offers VIRTIO_BLK_F_RO and fails OUT with IOERR.
//!
//! For replication and rollback the device can hold the guest's writes
//! (output commit, see [`super::held_writes`]): they are kept in memory,
//! read back by later reads, and reach the image only when released. What
//! is held is capped ([`DEFAULT_HOLD_CAP`]): at the cap the device takes no
//! more requests from the guest (they wait in the ring, as on a disk whose
//! write cache is full) until releases bring it under, so a guest that
//! writes faster than its writes can be released costs bounded memory.

use std::fs::File;
use std::io::{Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::path::Path;

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_RO, VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK,
    VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN,
    VIRTIO_BLK_T_OUT,
};
use virtio_queue::{desc::split::Descriptor, DescriptorChain, Queue};
use vm_memory::{Address, Bytes, GuestMemory, Permissions};

use super::held_writes::{DiskWrite, HeldWrites};
use super::{for_each_chain_while, GuestMem, QueueError, VirtioDevice};

pub const SECTOR: u64 = 512;
/// Largest data transfer of one request; bigger ones fail with IOERR.
pub const MAX_REQUEST_BYTES: u64 = 4 << 20;
/// Queue size offered.
pub const QUEUE_SIZE: u16 = 256;
/// Held, unreleased write bytes at which a holding device stops taking
/// requests (256 MiB).
pub const DEFAULT_HOLD_CAP: u64 = 256 << 20;
/// Longest descriptor chain accepted (header + data + status).
const MAX_CHAIN: usize = 66;

/// Per-device counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct BlkStats {
    pub reads: u64,
    pub writes: u64,
    pub flushes: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Requests failed with IOERR or UNSUPP.
    pub errors: u64,
    /// Held writes (output commit) that reached the image, and those that
    /// failed to (the host's image could not be written).
    pub released: u64,
    pub release_errors: u64,
    /// Times the device left the guest's requests in the ring because the
    /// held writes had reached the cap, and the most bytes ever held.
    pub hold_cap_waits: u64,
    pub held_bytes_max: u64,
}

/// The block device model.
pub struct Block {
    name: String,
    file: File,
    readonly: bool,
    sectors: u64,
    id: [u8; VIRTIO_BLK_ID_BYTES as usize],
    stats: BlkStats,
    /// Output commit: the guest's writes held until released.
    held: Option<HeldWrites>,
    /// See [`DEFAULT_HOLD_CAP`].
    hold_cap: u64,
    /// Requests were left in the ring at the cap (serve them once under).
    waiting: bool,
    /// Guest ranges written by the device since the last `take_written`.
    dma: Vec<(u64, u64)>,
}

/// The outcome of one request: status byte and bytes written to guest memory.
struct Done {
    status: u8,
    written: u32,
}

impl Block {
    /// Opens `path` (read-write unless `readonly`); its size, rounded down
    /// to whole sectors, is the capacity.
    pub fn open(path: &Path, readonly: bool) -> Result<Self, String> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(!readonly)
            .open(path)
            .map_err(|e| format!("cannot open disk image {}: {e}", path.display()))?;
        let len = file
            .metadata()
            .map_err(|e| format!("cannot stat disk image {}: {e}", path.display()))?
            .len();
        if len < SECTOR {
            return Err(format!("disk image {} is smaller than one sector", path.display()));
        }
        Ok(Self::from_file(file, len / SECTOR, readonly))
    }

    pub fn from_file(file: File, sectors: u64, readonly: bool) -> Self {
        let mut id = [0u8; VIRTIO_BLK_ID_BYTES as usize];
        let s = b"ninelives-disk";
        id[..s.len()].copy_from_slice(s);
        Block {
            name: "virtio-blk".into(),
            file,
            readonly,
            sectors,
            id,
            stats: BlkStats::default(),
            held: None,
            hold_cap: DEFAULT_HOLD_CAP,
            waiting: false,
            dma: Vec::new(),
        }
    }

    /// Output commit: holds the guest's writes from now on (`true`), or
    /// stops holding (`false`): every held sector is then written to the
    /// image with its newest content (and synced if a flush was held), so
    /// writes taken but not released are superseded.
    pub fn hold_writes(&mut self, on: bool) -> Result<(), String> {
        if on {
            self.held.get_or_insert_with(HeldWrites::default);
            return Ok(());
        }
        let Some(h) = self.held.take() else { return Ok(()) };
        let (sectors, flush) = h.drain();
        for (s, (_, data, off)) in sectors {
            self.file
                .write_all_at(&data[off..off + SECTOR as usize], s * SECTOR)
                .map_err(|e| format!("writing held sector {s} to the disk image: {e}"))?;
        }
        if flush {
            self.file.sync_data().map_err(|e| format!("syncing the disk image: {e}"))?;
        }
        Ok(())
    }

    /// The writes held since the last call, in order.
    pub fn take_held(&mut self) -> Vec<DiskWrite> {
        self.held.as_mut().map(HeldWrites::take).unwrap_or_default()
    }

    /// Writes released writes (taken with [`Block::take_held`], in order)
    /// to the image. Without holding (stopped meanwhile) they are stale and
    /// skipped. A failed write is counted and the rest still go out.
    pub fn release(&mut self, writes: &[DiskWrite]) {
        let Some(h) = self.held.as_mut() else { return };
        for w in writes {
            let r = if w.is_flush() {
                self.file.sync_data()
            } else {
                self.file.write_all_at(&w.data, w.sector * SECTOR)
            };
            if r.is_ok() {
                self.stats.released += 1;
            } else {
                self.stats.release_errors += 1;
            }
            h.released(w);
        }
    }

    /// Sets the cap on held, unreleased write bytes (a request is taken
    /// while the held bytes are under it, so with nothing held any request
    /// fits).
    pub fn set_hold_cap(&mut self, bytes: u64) {
        self.hold_cap = bytes.max(1);
    }

    /// Whether requests were left in the ring at the cap and the held
    /// writes are now under it (or no longer held): the caller then
    /// services the queue. Clears the flag.
    pub fn take_unblocked(&mut self) -> bool {
        let go = self.waiting && !self.at_cap();
        if go {
            self.waiting = false;
        }
        go
    }

    /// Whether the held, unreleased writes have reached the cap.
    fn at_cap(&self) -> bool {
        self.held.as_ref().is_some_and(|h| h.bytes() >= self.hold_cap)
    }

    /// Whether the device may take the guest's next request: not at the
    /// cap; at the cap the request stays in the ring, and the device waits.
    fn room_for_a_request(&mut self) -> bool {
        if self.at_cap() {
            self.waiting = true;
            self.stats.hold_cap_waits += 1;
            return false;
        }
        true
    }

    /// Whether the device stopped taking requests at the cap and has not
    /// been unblocked since (the guest may be waiting for it).
    pub fn is_waiting(&self) -> bool {
        self.waiting
    }

    /// Drops every held write unwritten (the VM is stopped: its epoch was
    /// never acknowledged and another copy may have taken over).
    pub fn discard_held(&mut self) {
        if self.held.is_some() {
            self.held = Some(HeldWrites::default());
        }
    }

    /// Whether the guest's writes fail (a read-only disk).
    pub fn is_readonly(&self) -> bool {
        self.readonly
    }

    /// The image file (to find its data ranges).
    pub fn image(&self) -> &File {
        &self.file
    }

    /// Reads `buf.len()` bytes of the image at `sector` (held writes not
    /// included: stop holding first for a consistent image).
    pub fn read_image(&self, sector: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.file.read_exact_at(buf, sector * SECTOR)
    }

    pub fn stats(&self) -> BlkStats {
        self.stats
    }

    pub fn capacity_sectors(&self) -> u64 {
        self.sectors
    }

    fn fail(&mut self, status: u32) -> Done {
        self.stats.errors += 1;
        Done { status: status as u8, written: 0 }
    }

    /// Serves one request whose header and data descriptors are `descs`
    /// (status descriptor already split off).
    fn serve(&mut self, mem: &GuestMem, descs: &[Descriptor]) -> Done {
        let Some((hdr, data)) = descs.split_first() else {
            return self.fail(VIRTIO_BLK_S_IOERR);
        };
        if hdr.is_write_only() || hdr.len() < 16 {
            return self.fail(VIRTIO_BLK_S_IOERR);
        }
        let (Ok(kind), Ok(sector)) = (
            mem.read_obj::<u32>(hdr.addr()),
            hdr.addr().checked_add(8).map_or(Err(()), |a| mem.read_obj::<u64>(a).map_err(|_| ())),
        ) else {
            return self.fail(VIRTIO_BLK_S_IOERR);
        };
        let total: u64 = data.iter().map(|d| u64::from(d.len())).sum();
        // Every data buffer must lie in guest memory, in the right direction.
        let want_write_only = kind != VIRTIO_BLK_T_OUT;
        for d in data {
            let perm = if want_write_only { Permissions::Write } else { Permissions::Read };
            if d.is_write_only() != want_write_only
                || !mem.check_range(d.addr(), d.len() as usize, perm)
            {
                return self.fail(VIRTIO_BLK_S_IOERR);
            }
        }
        match kind {
            VIRTIO_BLK_T_IN | VIRTIO_BLK_T_OUT => {
                let write = kind == VIRTIO_BLK_T_OUT;
                if write && self.readonly {
                    return self.fail(VIRTIO_BLK_S_IOERR);
                }
                if total > MAX_REQUEST_BYTES || !total.is_multiple_of(SECTOR) {
                    return self.fail(VIRTIO_BLK_S_IOERR);
                }
                let end = sector.checked_add(total / SECTOR);
                if end.is_none_or(|e| e > self.sectors) {
                    return self.fail(VIRTIO_BLK_S_IOERR);
                }
                if write && self.held.is_some() {
                    // Output commit: into the held writes, not the image.
                    let mut buf = vec![0u8; total as usize];
                    let mut at = 0usize;
                    for d in data {
                        let n = d.len() as usize;
                        if mem.read_slice(&mut buf[at..at + n], d.addr()).is_err() {
                            return self.fail(VIRTIO_BLK_S_IOERR);
                        }
                        at += n;
                    }
                    if let Some(h) = self.held.as_mut() {
                        h.write(sector, buf);
                        self.stats.held_bytes_max = self.stats.held_bytes_max.max(h.bytes());
                    }
                } else {
                    if self.file.seek(SeekFrom::Start(sector * SECTOR)).is_err() {
                        return self.fail(VIRTIO_BLK_S_IOERR);
                    }
                    for d in data {
                        let n = d.len() as usize;
                        let r = if write {
                            mem.write_all_volatile_to(d.addr(), &mut self.file, n)
                        } else {
                            mem.read_exact_volatile_from(d.addr(), &mut self.file, n)
                        };
                        if r.is_err() {
                            return self.fail(VIRTIO_BLK_S_IOERR);
                        }
                    }
                }
                if !write {
                    if let Some(h) = &self.held {
                        // Held sectors read back their held content.
                        let mut bad = false;
                        h.overlay(sector, total / SECTOR, |off, d| {
                            bad |= write_at(mem, data, off, d).is_err();
                        });
                        if bad {
                            return self.fail(VIRTIO_BLK_S_IOERR);
                        }
                    }
                    self.dma.extend(data.iter().map(|d| (d.addr().0, u64::from(d.len()))));
                }
                if write {
                    self.stats.writes += 1;
                    self.stats.bytes_written += total;
                    Done { status: VIRTIO_BLK_S_OK as u8, written: 0 }
                } else {
                    self.stats.reads += 1;
                    self.stats.bytes_read += total;
                    Done { status: VIRTIO_BLK_S_OK as u8, written: total as u32 }
                }
            }
            VIRTIO_BLK_T_FLUSH => {
                if let Some(h) = self.held.as_mut() {
                    h.flush();
                } else if !self.readonly && self.file.sync_data().is_err() {
                    return self.fail(VIRTIO_BLK_S_IOERR);
                }
                self.stats.flushes += 1;
                Done { status: VIRTIO_BLK_S_OK as u8, written: 0 }
            }
            VIRTIO_BLK_T_GET_ID => {
                let mut left = &self.id[..];
                let mut written = 0u32;
                for d in data {
                    if left.is_empty() {
                        break;
                    }
                    let n = left.len().min(d.len() as usize);
                    if mem.write_slice(&left[..n], d.addr()).is_err() {
                        return self.fail(VIRTIO_BLK_S_IOERR);
                    }
                    self.dma.push((d.addr().0, n as u64));
                    left = &left[n..];
                    written += n as u32;
                }
                Done { status: VIRTIO_BLK_S_OK as u8, written }
            }
            _ => self.fail(VIRTIO_BLK_S_UNSUPP),
        }
    }

    /// Handles one chain; returns (head, bytes written) for the used ring.
    fn chain(
        &mut self,
        mem: &GuestMem,
        chain: DescriptorChain<&GuestMem>,
    ) -> Result<(u16, u32), QueueError> {
        let (head, mut descs) = super::collect_chain(chain, MAX_CHAIN)?;
        let Some(status) = descs.pop() else {
            return Err(QueueError(format!("descriptor chain at {head} is empty or unreadable")));
        };
        if !status.is_write_only()
            || status.len() < 1
            || !mem.check_range(status.addr(), 1, Permissions::Write)
        {
            return Err(QueueError(format!(
                "descriptor chain at {head} has no writable status byte"
            )));
        }
        let done = self.serve(mem, &descs);
        mem.write_obj(done.status, status.addr())
            .map_err(|e| QueueError(format!("cannot write the status byte: {e}")))?;
        self.dma.push((status.addr().0, 1));
        Ok((head, done.written.saturating_add(1)))
    }
}

impl VirtioDevice for Block {
    fn name(&self) -> &str {
        &self.name
    }

    fn device_id(&self) -> u32 {
        2
    }

    fn features(&self) -> u64 {
        let mut f = 1u64 << VIRTIO_BLK_F_FLUSH;
        if self.readonly {
            f |= 1 << VIRTIO_BLK_F_RO;
        }
        f
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // struct virtio_blk_config: capacity (u64) at 0, the rest zero.
        let mut cfg = [0u8; 64];
        cfg[..8].copy_from_slice(&self.sectors.to_le_bytes());
        let off = offset as usize;
        for (i, b) in data.iter_mut().enumerate() {
            *b = off.checked_add(i).and_then(|k| cfg.get(k)).copied().unwrap_or(0);
        }
    }

    fn process(
        &mut self,
        _idx: usize,
        queue: &mut Queue,
        mem: &GuestMem,
    ) -> Result<bool, QueueError> {
        // At the cap, the requests stay in the ring until releases bring
        // the held writes under it ([`Block::take_unblocked`]).
        for_each_chain_while(queue, mem, self, Block::room_for_a_request, |b, c| b.chain(mem, c))
    }

    /// Only requests left in the ring at the cap are device state (the
    /// rest is served within its notify): `{"waiting": true}` then, else
    /// nothing, as before the cap existed.
    fn save(&self) -> serde_json::Value {
        if self.waiting {
            serde_json::json!({ "waiting": true })
        } else {
            serde_json::Value::Null
        }
    }

    fn restore(&mut self, state: &serde_json::Value) -> Result<(), String> {
        self.waiting = match state {
            serde_json::Value::Null => false,
            v => match v.get("waiting") {
                Some(serde_json::Value::Bool(w)) => *w,
                _ => return Err(format!("virtio-blk state {v} is not {{\"waiting\": bool}}")),
            },
        };
        Ok(())
    }

    fn stats(&self) -> serde_json::Value {
        serde_json::to_value(self.stats).unwrap_or_default()
    }

    fn take_written(&mut self, out: &mut Vec<(u64, u64)>) {
        out.append(&mut self.dma);
    }
}

/// Writes `bytes` at byte offset `off` of a request's data buffers.
fn write_at(
    mem: &GuestMem,
    data: &[Descriptor],
    mut off: usize,
    mut bytes: &[u8],
) -> Result<(), ()> {
    for d in data {
        let n = d.len() as usize;
        if off >= n {
            off -= n;
            continue;
        }
        let k = (n - off).min(bytes.len());
        let at = d.addr().checked_add(off as u64).ok_or(())?;
        mem.write_slice(&bytes[..k], at).map_err(|_| ())?;
        bytes = &bytes[k..];
        off = 0;
        if bytes.is_empty() {
            return Ok(());
        }
    }
    if bytes.is_empty() {
        Ok(())
    } else {
        Err(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bus::Device;
    use crate::virtio::{regs, MmioTransport, STATUS_NEEDS_RESET};
    use vm_memory::{GuestAddress, GuestMemoryMmap};

    const MEM: u64 = 1 << 20;
    const DESC: u64 = 0x1000;
    const AVAIL: u64 = 0x2000;
    const USED: u64 = 0x3000;
    const HDR: u64 = 0x4000;
    const STATUS: u64 = 0x4100;
    const BUF: u64 = 0x10000;
    const F_NEXT: u16 = 1;
    const F_WRITE: u16 = 2;

    struct Rig {
        t: MmioTransport<Block>,
        mem: GuestMem,
        avail: u16,
        _dir: tempfile::TempDir,
    }

    fn w32(t: &mut MmioTransport<Block>, off: u64, v: u32) {
        t.write(0, off, &v.to_le_bytes());
    }

    fn r32(t: &mut MmioTransport<Block>, off: u64) -> u32 {
        let mut b = [0u8; 4];
        t.read(0, off, &mut b);
        u32::from_le_bytes(b)
    }

    /// A driven device over a 1 MiB guest memory and a 1 MiB disk image.
    fn rig(readonly: bool, qsize: u32) -> Rig {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM as usize)]).unwrap();
        let dev = Block::open(&path, readonly).unwrap();
        let mut t = MmioTransport::new(dev, mem.clone());
        assert_eq!(r32(&mut t, regs::MAGIC), 0x7472_6976);
        assert_eq!(r32(&mut t, regs::DEVICE_ID), 2);
        w32(&mut t, regs::STATUS, 0);
        w32(&mut t, regs::STATUS, 1 | 2);
        w32(&mut t, regs::DRIVER_FEATURES_SEL, 1);
        w32(&mut t, regs::DRIVER_FEATURES, 1);
        w32(&mut t, regs::STATUS, 1 | 2 | 8);
        assert_eq!(r32(&mut t, regs::STATUS) & 8, 8, "features accepted");
        w32(&mut t, regs::QUEUE_SEL, 0);
        assert_eq!(r32(&mut t, regs::QUEUE_NUM_MAX), u32::from(QUEUE_SIZE));
        w32(&mut t, regs::QUEUE_NUM, qsize);
        w32(&mut t, regs::QUEUE_DESC_LOW, DESC as u32);
        w32(&mut t, regs::QUEUE_AVAIL_LOW, AVAIL as u32);
        w32(&mut t, regs::QUEUE_USED_LOW, USED as u32);
        w32(&mut t, regs::QUEUE_READY, 1);
        w32(&mut t, regs::STATUS, 1 | 2 | 8 | 4);
        Rig { t, mem, avail: 0, _dir: dir }
    }

    impl Rig {
        fn desc(&self, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
            let a = GuestAddress(DESC + u64::from(i) * 16);
            self.mem.write_obj(addr, a).unwrap();
            self.mem.write_obj(len, a.unchecked_add(8)).unwrap();
            self.mem.write_obj(flags, a.unchecked_add(12)).unwrap();
            self.mem.write_obj(next, a.unchecked_add(14)).unwrap();
        }

        /// Submits the chain at descriptor `head` and notifies; returns the
        /// status byte if the request was used.
        fn submit(&mut self, head: u16, qsize: u16) -> Option<u8> {
            self.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
            let slot = AVAIL + 4 + 2 * u64::from(self.avail % qsize);
            self.mem.write_obj(head, GuestAddress(slot)).unwrap();
            self.avail = self.avail.wrapping_add(1);
            self.mem.write_obj(self.avail, GuestAddress(AVAIL + 2)).unwrap();
            w32(&mut self.t, regs::QUEUE_NOTIFY, 0);
            let used: u16 = self.mem.read_obj(GuestAddress(USED + 2)).unwrap();
            (used == self.avail).then(|| self.mem.read_obj(GuestAddress(STATUS)).unwrap())
        }

        /// A standard request: header, one data buffer, status.
        fn request(&mut self, kind: u32, sector: u64, buf: u64, len: u32) -> Option<u8> {
            self.mem.write_obj(kind, GuestAddress(HDR)).unwrap();
            self.mem.write_obj(sector, GuestAddress(HDR + 8)).unwrap();
            let dflags = if kind == VIRTIO_BLK_T_OUT { F_NEXT } else { F_NEXT | F_WRITE };
            self.desc(0, HDR, 16, F_NEXT, 1);
            self.desc(1, buf, len, dflags, 2);
            self.desc(2, STATUS, 1, F_WRITE, 0);
            self.submit(0, 16)
        }

        fn needs_reset(&mut self) -> bool {
            r32(&mut self.t, regs::STATUS) & STATUS_NEEDS_RESET != 0
        }
    }

    const OK: Option<u8> = Some(VIRTIO_BLK_S_OK as u8);
    const IOERR: Option<u8> = Some(VIRTIO_BLK_S_IOERR as u8);

    #[test]
    fn used_buffers_and_resets_signal_the_irqfd() {
        use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
        let mut r = rig(false, 16);
        let irq = EventFd::new(EFD_NONBLOCK).unwrap();
        r.t.set_irq(irq.try_clone().unwrap());
        assert!(irq.read().is_err(), "nothing signalled yet");
        assert_eq!(r.request(VIRTIO_BLK_T_IN, 0, BUF, 512), OK);
        assert_eq!(r.request(VIRTIO_BLK_T_IN, 1, BUF, 512), OK);
        assert_eq!(irq.read().unwrap(), 2, "one signal per used buffer");
        assert_eq!(r32(&mut r.t, regs::INTERRUPT_STATUS) & 1, 1);
        w32(&mut r.t, regs::INTERRUPT_ACK, 1);
        assert_eq!(r32(&mut r.t, regs::INTERRUPT_STATUS), 0);
        // VIRTQ_AVAIL_F_NO_INTERRUPT: the driver polls, no signal.
        r.mem.write_obj(1u16, GuestAddress(AVAIL)).unwrap();
        assert_eq!(r.request(VIRTIO_BLK_T_IN, 2, BUF, 512), OK);
        assert!(irq.read().is_err(), "suppressed by the driver");
        assert_eq!(r32(&mut r.t, regs::INTERRUPT_STATUS) & 1, 1, "the status still shows it");
        // A device that needs a reset raises a configuration interrupt.
        r.mem.write_obj(0u16, GuestAddress(AVAIL)).unwrap();
        r.desc(0, HDR, 16, F_NEXT, 0);
        r.desc(0, HDR, 16, F_NEXT, 0);
        let _ = r.submit(0, 16);
        assert!(r.needs_reset());
        assert_eq!(r32(&mut r.t, regs::INTERRUPT_STATUS) & 2, 2);
        assert_eq!(irq.read().unwrap(), 1);
        assert_eq!(r.t.interrupts(), 3);
    }

    #[test]
    fn write_then_read_round_trips() {
        let mut r = rig(false, 16);
        let data: Vec<u8> = (0..8192u32).map(|i| (i * 7) as u8).collect();
        r.mem.write_slice(&data, GuestAddress(BUF)).unwrap();
        assert_eq!(r.request(VIRTIO_BLK_T_OUT, 10, BUF, 8192), OK);
        assert_eq!(r.request(VIRTIO_BLK_T_IN, 10, BUF + 0x10000, 8192), OK);
        let mut back = vec![0u8; 8192];
        r.mem.read_slice(&mut back, GuestAddress(BUF + 0x10000)).unwrap();
        assert_eq!(back, data);
        assert_eq!(r.request(VIRTIO_BLK_T_FLUSH, 0, BUF, 0), OK);
        assert_eq!(r.request(99, 0, BUF, 512), Some(VIRTIO_BLK_S_UNSUPP as u8));
        let s = r.t.device().stats();
        assert_eq!((s.reads, s.writes, s.bytes_read, s.errors), (1, 1, 8192, 1));
        // The capacity in the config space.
        let mut cap = [0u8; 8];
        r.t.read(0, regs::CONFIG, &mut cap);
        assert_eq!(u64::from_le_bytes(cap), 2048);
        // Save/restore of the transport round-trips into a fresh device
        // (reset, queue not set up): after the restore it serves the
        // driver's next request on the same ring where the old one left off.
        let saved = r.t.save();
        let dev = Block::open(&r._dir.path().join("disk.img"), false).unwrap();
        let mut fresh = MmioTransport::new(dev, r.mem.clone());
        assert_ne!(fresh.save(), saved, "a fresh device must differ for this to mean anything");
        assert!(fresh.restore(&serde_json::json!({"x": 1})).is_err());
        fresh.restore(&saved).unwrap();
        assert_eq!(fresh.save(), saved);
        r.t = fresh;
        assert_eq!(r.request(VIRTIO_BLK_T_IN, 10, BUF + 0x20000, 512), OK);
        let mut back = vec![0u8; 512];
        r.mem.read_slice(&mut back, GuestAddress(BUF + 0x20000)).unwrap();
        assert_eq!(back, data[..512], "the restored device reads the disk");
    }

    #[test]
    fn per_request_errors_get_ioerr_and_the_device_keeps_working() {
        let mut r = rig(false, 16);
        // Data buffer outside guest memory.
        assert_eq!(r.request(VIRTIO_BLK_T_IN, 0, MEM - 512, 4096), IOERR);
        assert_eq!(r.request(VIRTIO_BLK_T_OUT, 0, u64::MAX - 100, 512), IOERR);
        // Past the end of the disk, and wrapping sector numbers.
        assert_eq!(r.request(VIRTIO_BLK_T_IN, 2047, BUF, 1024), IOERR);
        assert_eq!(r.request(VIRTIO_BLK_T_IN, u64::MAX, BUF, 512), IOERR);
        // Not a whole number of sectors.
        assert_eq!(r.request(VIRTIO_BLK_T_IN, 0, BUF, 100), IOERR);
        // Oversized: more than MAX_REQUEST_BYTES in one request.
        assert_eq!(r.request(VIRTIO_BLK_T_IN, 0, BUF, (MAX_REQUEST_BYTES + 512) as u32), IOERR);
        // Data buffer with the wrong direction (device-readable for IN).
        r.desc(0, HDR, 16, F_NEXT, 1);
        r.mem.write_obj(VIRTIO_BLK_T_IN, GuestAddress(HDR)).unwrap();
        r.desc(1, BUF, 512, F_NEXT, 2);
        r.desc(2, STATUS, 1, F_WRITE, 0);
        assert_eq!(r.submit(0, 16), IOERR);
        assert!(!r.needs_reset());
        assert_eq!(r.request(VIRTIO_BLK_T_IN, 0, BUF, 512), OK);
        assert_eq!(r.t.device().stats().errors, 7);
    }

    fn image(r: &Rig, sector: u64, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        r.t.device().read_image(sector, &mut b).unwrap();
        b
    }

    #[test]
    fn held_writes_reach_the_image_only_when_released() {
        let mut r = rig(false, 16);
        r.t.device_mut().hold_writes(true).unwrap();
        r.mem.write_slice(&[5u8; 1024], GuestAddress(BUF)).unwrap();
        assert_eq!(r.request(VIRTIO_BLK_T_OUT, 4, BUF, 1024), OK);
        assert_eq!(r.request(VIRTIO_BLK_T_FLUSH, 0, BUF, 0), OK);
        assert_eq!(image(&r, 4, 1024), vec![0u8; 1024], "held, not on the image");
        // A read over the held sectors and their neighbours sees the held data.
        r.t.track_writes(true);
        assert_eq!(r.request(VIRTIO_BLK_T_IN, 3, BUF + 0x10000, 2048), OK);
        let mut back = vec![0u8; 2048];
        r.mem.read_slice(&mut back, GuestAddress(BUF + 0x10000)).unwrap();
        assert_eq!((back[0], back[512], back[1535], back[1536]), (0, 5, 5, 0));
        // The device reports what it wrote into guest memory (replication).
        let dma = r.t.take_writes();
        assert!(dma.contains(&(BUF + 0x10000, 2048)) && dma.contains(&(STATUS, 1)), "{dma:?}");
        let taken = r.t.device_mut().take_held();
        assert_eq!(taken.len(), 2);
        r.t.device_mut().release(&taken);
        assert_eq!(image(&r, 4, 1024), vec![5u8; 1024]);
        assert_eq!(r.t.device().stats().released, 2);
        // Discarded writes never reach the image; stopping to hold writes
        // out what is still held.
        r.mem.write_slice(&[6u8; 512], GuestAddress(BUF)).unwrap();
        assert_eq!(r.request(VIRTIO_BLK_T_OUT, 4, BUF, 512), OK);
        r.t.device_mut().discard_held();
        assert_eq!(image(&r, 4, 512), vec![5u8; 512]);
        r.mem.write_slice(&[7u8; 512], GuestAddress(BUF)).unwrap();
        assert_eq!(r.request(VIRTIO_BLK_T_OUT, 5, BUF, 512), OK);
        let stale = r.t.device_mut().take_held();
        r.t.device_mut().hold_writes(false).unwrap();
        assert_eq!(image(&r, 5, 512), vec![7u8; 512]);
        // Releasing after holding stopped changes nothing.
        r.t.device_mut().release(&stale);
        assert_eq!(r.request(VIRTIO_BLK_T_OUT, 6, BUF, 512), OK);
        assert_eq!(image(&r, 6, 512), vec![7u8; 512], "written straight through again");
    }

    /// At the cap on held bytes the device takes no more requests: they
    /// wait in the ring (no status, nothing used) until releases bring the
    /// held writes under the cap, and are then served in order.
    #[test]
    fn at_the_hold_cap_requests_wait_in_the_ring_until_releases() {
        let mut r = rig(false, 16);
        r.t.device_mut().hold_writes(true).unwrap();
        r.t.device_mut().set_hold_cap(1024);
        r.mem.write_slice(&[1u8; 1024], GuestAddress(BUF)).unwrap();
        assert_eq!(r.request(VIRTIO_BLK_T_OUT, 0, BUF, 1024), OK, "under the cap: taken");
        assert!(!r.t.device_mut().take_unblocked(), "nothing waits");
        r.mem.write_slice(&[2u8; 512], GuestAddress(BUF)).unwrap();
        assert_eq!(r.request(VIRTIO_BLK_T_OUT, 8, BUF, 512), None, "at the cap: left in the ring");
        assert_eq!(r.t.device().stats().writes, 1);
        assert!(!r.t.device_mut().take_unblocked(), "still at the cap");
        let taken = r.t.device_mut().take_held();
        r.t.device_mut().release(&taken);
        assert!(r.t.device_mut().take_unblocked());
        r.t.service(0);
        let used: u16 = r.mem.read_obj(GuestAddress(USED + 2)).unwrap();
        assert_eq!(used, r.avail, "the waiting request was served");
        assert_eq!(r.mem.read_obj::<u8>(GuestAddress(STATUS)).unwrap(), VIRTIO_BLK_S_OK as u8);
        let s = r.t.device().stats();
        assert_eq!((s.writes, s.held_bytes_max), (2, 1024));
        assert!(s.hold_cap_waits >= 1);
        // A discard, and the end of holding, unblock too.
        r.mem.write_slice(&[3u8; 1024], GuestAddress(BUF)).unwrap();
        assert_eq!(r.request(VIRTIO_BLK_T_OUT, 16, BUF, 1024), OK, "512 held: under the cap");
        assert_eq!(r.request(VIRTIO_BLK_T_OUT, 24, BUF, 512), None);
        r.t.device_mut().discard_held();
        assert!(r.t.device_mut().take_unblocked());
        r.t.service(0);
        assert_eq!(r.t.device().stats().writes, 4);
        assert_eq!(image(&r, 16, 512), vec![0u8; 512], "discarded, never written");
        // A request waiting at the cap is device state: a device restored
        // from a state saved then serves it once under the cap (a rollback,
        // a takeover, a carried VM), and one saved without waits does not.
        assert_eq!(r.request(VIRTIO_BLK_T_OUT, 32, BUF, 1024), OK);
        assert_eq!(r.request(VIRTIO_BLK_T_OUT, 40, BUF, 512), None);
        let saved = r.t.save();
        let dev = Block::open(&r._dir.path().join("disk.img"), false).unwrap();
        let mut fresh = MmioTransport::new(dev, r.mem.clone());
        fresh.restore(&saved).unwrap();
        fresh.device_mut().hold_writes(true).unwrap();
        assert!(fresh.device().is_waiting());
        assert!(fresh.device_mut().take_unblocked(), "nothing held in the new device");
        fresh.service(0);
        let used: u16 = r.mem.read_obj(GuestAddress(USED + 2)).unwrap();
        assert_eq!(used, r.avail, "the restored device served the waiting request");
        assert!(!fresh.device().is_waiting());
        let dev = Block::open(&r._dir.path().join("disk.img"), false).unwrap();
        let mut again = MmioTransport::new(dev, r.mem.clone());
        again.restore(&fresh.save()).unwrap();
        assert!(!again.device().is_waiting());
        let mut bad = saved.clone();
        bad["device"] = serde_json::json!({"waiting": 1});
        assert!(again.restore(&bad).is_err(), "a malformed device state is refused");
    }

    #[test]
    fn writes_to_a_readonly_disk_fail() {
        let mut r = rig(true, 16);
        let mut f = [0u8; 4];
        r.t.read(0, regs::DEVICE_FEATURES, &mut f);
        assert_ne!(u32::from_le_bytes(f) & (1 << VIRTIO_BLK_F_RO), 0);
        assert_eq!(r.request(VIRTIO_BLK_T_OUT, 0, BUF, 512), IOERR);
        assert_eq!(r.request(VIRTIO_BLK_T_IN, 0, BUF, 512), OK);
    }

    #[test]
    fn descriptor_loops_and_missing_status_need_a_reset() {
        let mut r = rig(false, 16);
        r.mem.write_obj(VIRTIO_BLK_T_IN, GuestAddress(HDR)).unwrap();
        // 0 -> 1 -> 0 -> ...
        r.desc(0, HDR, 16, F_NEXT, 1);
        r.desc(1, BUF, 512, F_NEXT | F_WRITE, 0);
        assert_eq!(r.submit(0, 16), None);
        assert!(r.needs_reset());
        assert!(r.t.last_error().unwrap().contains("loops"), "{:?}", r.t.last_error());
        // Notifies are ignored until the driver resets the device.
        assert_eq!(r.request(VIRTIO_BLK_T_IN, 0, BUF, 512), None);
        // After a reset and set-up it works again.
        let mut r = rig(false, 16);
        assert_eq!(r.request(VIRTIO_BLK_T_IN, 0, BUF, 512), OK);
        // A chain whose last descriptor is not writable has no status byte.
        r.desc(0, HDR, 16, F_NEXT, 1);
        r.desc(1, BUF, 512, 0, 0);
        assert_eq!(r.submit(0, 16), None);
        assert!(r.needs_reset());
        // A next index beyond the queue size.
        let mut r = rig(false, 16);
        r.desc(0, HDR, 16, F_NEXT, 200);
        assert_eq!(r.submit(0, 16), None);
        assert!(r.needs_reset());
        // A descriptor table entry the head index cannot name.
        let mut r = rig(false, 16);
        assert_eq!(r.submit(40, 16), None);
        assert!(r.needs_reset());
    }

    #[test]
    fn bad_queue_setup_needs_a_reset() {
        // Rings outside guest memory.
        let mut r = rig(false, 16);
        let mut t = r.t;
        w32(&mut t, regs::STATUS, 0);
        w32(&mut t, regs::STATUS, 1 | 2);
        w32(&mut t, regs::DRIVER_FEATURES_SEL, 1);
        w32(&mut t, regs::DRIVER_FEATURES, 1);
        w32(&mut t, regs::STATUS, 1 | 2 | 8);
        w32(&mut t, regs::QUEUE_NUM, 16);
        w32(&mut t, regs::QUEUE_DESC_LOW, 0xffff_f000);
        w32(&mut t, regs::QUEUE_DESC_HIGH, 0xffff_ffff);
        w32(&mut t, regs::QUEUE_AVAIL_LOW, AVAIL as u32);
        w32(&mut t, regs::QUEUE_USED_LOW, USED as u32);
        w32(&mut t, regs::QUEUE_READY, 1);
        w32(&mut t, regs::STATUS, 1 | 2 | 8 | 4);
        w32(&mut t, regs::QUEUE_NOTIFY, 0);
        assert_ne!(r32(&mut t, regs::STATUS) & STATUS_NEEDS_RESET, 0);
        r.t = t;
        // Queue sizes that are not powers of two or above the maximum.
        for qsize in [0u32, 3, 512, 0x1_0000] {
            let mut r = rig(false, qsize);
            w32(&mut r.t, regs::QUEUE_NOTIFY, 0);
            assert!(r.needs_reset(), "queue size {qsize}");
        }
        // An avail index far ahead of the device's.
        let mut r = rig(false, 16);
        r.mem.write_obj(1000u16, GuestAddress(AVAIL + 2)).unwrap();
        w32(&mut r.t, regs::QUEUE_NOTIFY, 0);
        assert!(r.needs_reset());
        // Notifies of queues that do not exist and odd-sized accesses are ignored.
        let mut r = rig(false, 16);
        w32(&mut r.t, regs::QUEUE_NOTIFY, 7);
        r.t.write(0, regs::STATUS, &[0xff]);
        assert!(!r.needs_reset());
        // Features without VERSION_1 are refused.
        let mut t = rig(false, 16).t;
        w32(&mut t, regs::STATUS, 0);
        w32(&mut t, regs::STATUS, 1 | 2 | 8);
        assert_eq!(r32(&mut t, regs::STATUS) & 8, 0);
    }
}
