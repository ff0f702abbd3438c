//! Output commit for virtio-blk: guest writes held in memory until released.
//!
//! While replication holds the disk's output, a guest write does not reach
//! the image: it is kept here (and read back by later reads of its sectors)
//! until the replicator releases it, which it does once the backup
//! acknowledged the epoch the write belongs to. The replicator takes each
//! epoch's writes in order with [`HeldWrites::take`] and ships them with
//! the epoch; a released write goes to the image only if no newer held
//! write has replaced the sectors meanwhile.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::blk::SECTOR;

/// One held guest write (or flush), in guest order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskWrite {
    /// Order number among the device's held writes.
    pub seq: u64,
    /// First sector written.
    pub sector: u64,
    /// The data, a whole number of sectors; empty for a flush.
    pub data: Arc<[u8]>,
}

impl DiskWrite {
    pub fn is_flush(&self) -> bool {
        self.data.is_empty()
    }

    pub fn sectors(&self) -> u64 {
        self.data.len() as u64 / SECTOR
    }
}

/// A held sector: the seq of its write, the write's data and the sector's
/// offset in it.
type HeldSector = (u64, Arc<[u8]>, usize);

/// The writes held since output commit started.
#[derive(Debug, Default)]
pub struct HeldWrites {
    next_seq: u64,
    /// Writes not yet taken by the replicator, in order.
    journal: Vec<DiskWrite>,
    /// The newest held content of each sector.
    sectors: BTreeMap<u64, HeldSector>,
    /// Bytes of the writes held and not yet released (taken or not): what
    /// holding costs in memory, bounded by the device's cap.
    bytes: u64,
}

impl HeldWrites {
    /// Holds a write of `data` (whole sectors) at `sector`.
    pub fn write(&mut self, sector: u64, data: Vec<u8>) {
        let data: Arc<[u8]> = data.into();
        self.bytes += data.len() as u64;
        let seq = self.next_seq;
        self.next_seq += 1;
        for i in 0..data.len() / SECTOR as usize {
            self.sectors.insert(sector + i as u64, (seq, data.clone(), i * SECTOR as usize));
        }
        self.journal.push(DiskWrite { seq, sector, data });
    }

    /// Holds a flush (ordered after the writes before it).
    pub fn flush(&mut self) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.journal.push(DiskWrite { seq, sector: 0, data: Arc::from(Vec::new()) });
    }

    /// The writes since the last call, in order (they stay readable here
    /// until released).
    pub fn take(&mut self) -> Vec<DiskWrite> {
        std::mem::take(&mut self.journal)
    }

    /// Calls `f(offset in the request, sector data)` for each held sector
    /// in `sector .. sector + count`, in order: what a read of that range
    /// must return instead of the image's content.
    pub fn overlay(&self, sector: u64, count: u64, mut f: impl FnMut(usize, &[u8])) {
        let end = sector.saturating_add(count);
        for (&s, (_, data, off)) in self.sectors.range(sector..end) {
            f(((s - sector) * SECTOR) as usize, &data[*off..*off + SECTOR as usize]);
        }
    }

    /// After `w` reached the image: forgets its sectors unless a newer
    /// held write replaced them.
    pub fn released(&mut self, w: &DiskWrite) {
        self.bytes = self.bytes.saturating_sub(w.data.len() as u64);
        for s in w.sector..w.sector + w.sectors() {
            if self.sectors.get(&s).is_some_and(|(seq, _, _)| *seq == w.seq) {
                self.sectors.remove(&s);
            }
        }
    }

    /// Every held sector with its newest content, and whether a flush is
    /// among the writes not yet taken: what the image needs when holding
    /// stops (older writes not released yet are superseded by this).
    /// Each entry: the sector and its [`HeldSector`].
    pub fn drain(self) -> (Vec<(u64, HeldSector)>, bool) {
        let flush = self.journal.iter().any(DiskWrite::is_flush);
        (self.sectors.into_iter().collect(), flush)
    }

    pub fn is_empty(&self) -> bool {
        self.sectors.is_empty() && self.journal.is_empty()
    }

    /// Bytes of the writes held and not yet released.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(h: &HeldWrites, sector: u64, count: u64, base: &[u8]) -> Vec<u8> {
        let mut out = base.to_vec();
        h.overlay(sector, count, |off, d| out[off..off + d.len()].copy_from_slice(d));
        out
    }

    #[test]
    fn newer_writes_win_and_release_keeps_them() {
        let mut h = HeldWrites::default();
        h.write(10, vec![1u8; 1024]); // sectors 10, 11
        h.flush();
        h.write(11, vec![2u8; 512]); // replaces sector 11
        let base = vec![0u8; 2048];
        let r = read(&h, 9, 4, &base);
        assert_eq!((r[0], r[512], r[1024], r[1536]), (0, 1, 2, 0));
        let taken = h.take();
        assert_eq!(taken.len(), 3);
        assert!(taken[1].is_flush() && !taken[0].is_flush());
        assert!(h.take().is_empty());
        // The first write reaches the image: sector 10 is no longer held,
        // sector 11 still is (the newer write is not released yet).
        h.released(&taken[0]);
        let r = read(&h, 10, 2, &[7u8; 1024]);
        assert_eq!((r[0], r[512]), (7, 2));
        assert_eq!(h.bytes(), 512, "the second write is not released yet");
        h.released(&taken[2]);
        assert!(h.is_empty());
        assert_eq!(h.bytes(), 0);
    }

    #[test]
    fn drain_gives_the_newest_content_of_each_sector() {
        let mut h = HeldWrites::default();
        h.write(0, vec![1u8; 1024]);
        let _ = h.take();
        h.write(1, vec![3u8; 512]);
        h.flush();
        let (sectors, flush) = h.drain();
        assert!(flush);
        let got: Vec<(u64, u8)> = sectors.iter().map(|(s, (_, d, o))| (*s, d[*o])).collect();
        assert_eq!(got, vec![(0, 1), (1, 3)]);
    }
}
