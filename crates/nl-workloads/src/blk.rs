//! `blkbench`: a tiny extent-based file store on a block device, exercised
//! with creates, copies, reads, overwrites and removes of 1 MiB files.
//!
//! Everything goes to the device (no caching): file data is read back from
//! the disk on every read or copy and checked word by word against the
//! content it must have (a PRNG stream from the file's content seed). The
//! metadata (superblock, inode table) is written through on every change;
//! the free-space map is derived from the inodes and kept in memory.
//!
//! On-disk layout inside the first [`BLKBENCH_DISK_BYTES`] of the device
//! (whatever it held before is ignored; the warm-up round formats it):
//!
//! * unit 0 (64 KiB): superblock in sector 0, inode table from
//!   [`INODE_TABLE_SECTOR`] ([`MAX_FILES`] inodes of [`INODE_WORDS`] words:
//!   used flag, content seed, extent count, extents as `start << 32 | len`
//!   in units);
//! * units 1..: file data, allocated first-fit from a rotating cursor in
//!   runs of free units, at most [`MAX_EXTENTS`] extents per file.
//!
//! An op is one byte moved to or from the device (data and metadata), so
//! ops/s is the workload's block throughput.

use crate::{fold, mix64, wyrand, Platform};

/// Bytes of the device the file store uses (the disk must be at least this big).
pub const BLKBENCH_DISK_BYTES: u64 = 128 << 20;
/// Size of every file.
pub const FILE_BYTES: u64 = 1 << 20;
/// Allocation unit.
pub const UNIT_BYTES: u64 = 64 << 10;
pub const SECTOR_BYTES: u64 = 512;
/// Inode slots.
pub const MAX_FILES: usize = 64;
/// Most extents of one file (a 1 MiB file has 16 units, so it always fits).
pub const MAX_EXTENTS: usize = 16;
/// Words per on-disk inode (3 header words + extents, padded).
pub const INODE_WORDS: usize = 32;
/// First sector of the inode table.
pub const INODE_TABLE_SECTOR: u64 = 8;
/// Working-set bytes blkbench needs: one file buffer plus a 4 KiB metadata buffer.
pub const BLKBENCH_WS_BYTES: u64 = FILE_BYTES + META_BYTES;

const META_BYTES: u64 = 4096;
const FILE_WORDS: usize = (FILE_BYTES / 8) as usize;
const META_WORDS: usize = (META_BYTES / 8) as usize;
const UNITS: usize = (BLKBENCH_DISK_BYTES / UNIT_BYTES) as usize;
const FILE_UNITS: u32 = (FILE_BYTES / UNIT_BYTES) as u32;
const SECTORS_PER_UNIT: u64 = UNIT_BYTES / SECTOR_BYTES;
const INODES_PER_META: usize = META_WORDS / INODE_WORDS;
const SUPER_MAGIC: u64 = u64::from_le_bytes(*b"9LBLKFS1");
/// Files alive at once stay between these.
const MIN_LIVE: usize = 4;
const MAX_LIVE: usize = 48;

const _: () = {
    assert!(
        MAX_FILES * INODE_WORDS * 8 <= (UNIT_BYTES - INODE_TABLE_SECTOR * SECTOR_BYTES) as usize
    );
    assert!(MAX_FILES.is_multiple_of(INODES_PER_META));
    assert!(MAX_LIVE as u32 * FILE_UNITS < UNITS as u32 - 1);
};

#[derive(Clone, Copy, Default)]
struct Inode {
    used: bool,
    seed: u64,
    n: usize,
    /// (start unit, units).
    ext: [(u32, u32); MAX_EXTENTS],
}

/// The file store's in-memory state.
pub(crate) struct FileStore {
    inodes: [Inode; MAX_FILES],
    /// One bit per unit: in use.
    used: [u64; UNITS / 64],
    cursor: usize,
    live: usize,
    serial: u64,
    /// Reads whose data was not what was written.
    pub(crate) mismatches: u64,
    /// Requests the device failed.
    pub(crate) io_errors: u64,
    /// Operations done, by kind: create, copy, read, overwrite, remove.
    pub(crate) counts: [u64; 5],
}

/// Op kinds (also folded into the digest).
const OP_CREATE: usize = 0;
const OP_COPY: usize = 1;
const OP_READ: usize = 2;
const OP_WRITE: usize = 3;
const OP_REMOVE: usize = 4;

/// The file content of seed `seed`: a PRNG stream, never all zero.
pub(crate) fn fill(buf: &mut [u64], seed: u64) {
    let mut s = seed;
    for w in buf {
        *w = wyrand(&mut s);
    }
}

/// Compares `buf` with the content of seed `seed`; returns (mismatching
/// words, digest of a sample of what was read).
pub(crate) fn check(buf: &[u64], seed: u64) -> (u64, u64) {
    let mut s = seed;
    let mut bad = 0u64;
    let mut h = 0u64;
    for (i, w) in buf.iter().enumerate() {
        let want = wyrand(&mut s);
        bad += u64::from(*w != want);
        if i % 512 == 0 {
            h = fold(h, *w);
        }
    }
    (bad, h)
}

impl FileStore {
    pub(crate) fn new() -> Self {
        FileStore {
            inodes: [Inode::default(); MAX_FILES],
            used: [0; UNITS / 64],
            cursor: 1,
            live: 0,
            serial: 0,
            mismatches: 0,
            io_errors: 0,
            counts: [0; 5],
        }
    }

    fn is_used(&self, u: usize) -> bool {
        self.used[u / 64] & (1 << (u % 64)) != 0
    }

    fn set_used(&mut self, u: usize, on: bool) {
        if on {
            self.used[u / 64] |= 1 << (u % 64);
        } else {
            self.used[u / 64] &= !(1 << (u % 64));
        }
    }

    fn write<P: Platform>(&mut self, p: &mut P, sector: u64, buf: &[u64]) -> u64 {
        if !p.blk_write(sector, buf) {
            self.io_errors += 1;
        }
        buf.len() as u64 * 8
    }

    fn read<P: Platform>(&mut self, p: &mut P, sector: u64, buf: &mut [u64]) -> u64 {
        if !p.blk_read(sector, buf) {
            self.io_errors += 1;
        }
        buf.len() as u64 * 8
    }

    /// Warm-up round: formats the store (superblock and an empty inode
    /// table) and reads the superblock back.
    pub(crate) fn format<P: Platform>(&mut self, p: &mut P, meta: &mut [u64], d: &mut u64) -> u64 {
        let meta = &mut meta[..META_WORDS];
        let mut ops = 0;
        meta.fill(0);
        for i in 0..(MAX_FILES / INODES_PER_META) as u64 {
            ops += self.write(p, INODE_TABLE_SECTOR + i * (META_BYTES / SECTOR_BYTES), meta);
        }
        let sb = &mut meta[..(SECTOR_BYTES / 8) as usize];
        sb[0] = SUPER_MAGIC;
        sb[1] = BLKBENCH_DISK_BYTES;
        sb[2] = UNIT_BYTES;
        sb[3] = MAX_FILES as u64;
        ops += self.write(p, 0, sb);
        sb.fill(0);
        ops += self.read(p, 0, sb);
        if sb[0] != SUPER_MAGIC || sb[1] != BLKBENCH_DISK_BYTES {
            self.mismatches += 1;
        }
        *d = fold(*d, sb[0] ^ sb[1]);
        self.set_used(0, true);
        ops
    }

    /// Writes the 4 KiB of the inode table that holds inode `slot`.
    fn write_inode<P: Platform>(&mut self, p: &mut P, meta: &mut [u64], slot: usize) -> u64 {
        let first = slot / INODES_PER_META * INODES_PER_META;
        let meta = &mut meta[..META_WORDS];
        meta.fill(0);
        for (k, w) in meta.chunks_exact_mut(INODE_WORDS).enumerate() {
            let ino = &self.inodes[first + k];
            if !ino.used {
                continue;
            }
            w[0] = 1;
            w[1] = ino.seed;
            w[2] = ino.n as u64;
            for (e, (s, l)) in ino.ext[..ino.n].iter().enumerate() {
                w[3 + e] = (u64::from(*s) << 32) | u64::from(*l);
            }
        }
        let sector =
            INODE_TABLE_SECTOR + (first / INODES_PER_META) as u64 * (META_BYTES / SECTOR_BYTES);
        self.write(p, sector, meta)
    }

    /// Allocates FILE_UNITS units into a free inode slot; None when full.
    fn alloc(&mut self, seed: u64) -> Option<usize> {
        let slot = self.inodes.iter().position(|i| !i.used)?;
        let free = (1..UNITS).filter(|&u| !self.is_used(u)).count();
        if free < FILE_UNITS as usize {
            return None;
        }
        let mut ino = Inode { used: true, seed, ..Inode::default() };
        let mut need = FILE_UNITS;
        let mut u = self.cursor;
        while need > 0 {
            if u >= UNITS {
                u = 1;
            }
            if self.is_used(u) {
                u += 1;
                continue;
            }
            let start = u;
            while u < UNITS && !self.is_used(u) && ((u - start) as u32) < need {
                self.set_used(u, true);
                u += 1;
            }
            let len = (u - start) as u32;
            if ino.n == MAX_EXTENTS {
                // Cannot happen (16 units fit in 16 extents); undo to be safe.
                for &(s, l) in &ino.ext {
                    for x in s..s + l {
                        self.set_used(x as usize, false);
                    }
                }
                for x in start..u {
                    self.set_used(x, false);
                }
                return None;
            }
            ino.ext[ino.n] = (start as u32, len);
            ino.n += 1;
            need -= len;
        }
        self.cursor = u;
        self.inodes[slot] = ino;
        self.live += 1;
        Some(slot)
    }

    fn free(&mut self, slot: usize) {
        let ino = self.inodes[slot];
        for &(s, l) in &ino.ext[..ino.n] {
            for x in s..s + l {
                self.set_used(x as usize, false);
            }
        }
        self.inodes[slot] = Inode::default();
        self.live -= 1;
    }

    /// Writes `data` to file `slot`'s extents.
    fn write_data<P: Platform>(&mut self, p: &mut P, slot: usize, data: &[u64]) -> u64 {
        let ino = self.inodes[slot];
        let mut off = 0;
        let mut ops = 0;
        for &(s, l) in &ino.ext[..ino.n] {
            let words = (u64::from(l) * UNIT_BYTES / 8) as usize;
            ops += self.write(p, u64::from(s) * SECTORS_PER_UNIT, &data[off..off + words]);
            off += words;
        }
        ops
    }

    /// Reads file `slot` into `data` and checks it.
    fn read_data<P: Platform>(
        &mut self,
        p: &mut P,
        slot: usize,
        data: &mut [u64],
        d: &mut u64,
    ) -> u64 {
        let ino = self.inodes[slot];
        let mut off = 0;
        let mut ops = 0;
        for &(s, l) in &ino.ext[..ino.n] {
            let words = (u64::from(l) * UNIT_BYTES / 8) as usize;
            ops += self.read(p, u64::from(s) * SECTORS_PER_UNIT, &mut data[off..off + words]);
            off += words;
        }
        let (bad, h) = check(data, ino.seed);
        self.mismatches += bad;
        *d = fold(fold(*d, h), bad);
        ops
    }

    /// The `n`th live file (0-based).
    fn nth_live(&self, n: usize) -> usize {
        self.inodes.iter().enumerate().filter(|(_, i)| i.used).nth(n).map_or(0, |(k, _)| k)
    }

    /// One file operation chosen by `rng`; returns the bytes moved.
    pub(crate) fn op<P: Platform>(
        &mut self,
        p: &mut P,
        mem: &mut [u64],
        seed: u64,
        rng: &mut u64,
        d: &mut u64,
    ) -> u64 {
        let (data, meta) = mem.split_at_mut(FILE_WORDS);
        let r = wyrand(rng);
        let pick = if self.live < MIN_LIVE {
            OP_CREATE
        } else if self.live >= MAX_LIVE {
            OP_REMOVE
        } else {
            match r % 100 {
                0..25 => OP_CREATE,
                25..40 => OP_COPY,
                40..70 => OP_READ,
                70..85 => OP_WRITE,
                _ => OP_REMOVE,
            }
        };
        let victim =
            if self.live > 0 { self.nth_live(((r >> 32) % self.live as u64) as usize) } else { 0 };
        let mut ops = 0;
        let done = match pick {
            OP_CREATE => {
                self.serial += 1;
                let fseed = mix64(seed ^ self.serial.wrapping_mul(0x9E37_79B9_7F4A_7C15));
                match self.alloc(fseed) {
                    Some(slot) => {
                        fill(data, fseed);
                        ops += self.write_data(p, slot, data);
                        ops += self.write_inode(p, meta, slot);
                        *d = fold(*d, fseed ^ slot as u64);
                        OP_CREATE
                    }
                    None => OP_READ,
                }
            }
            OP_COPY => {
                ops += self.read_data(p, victim, data, d);
                match self.alloc(self.inodes[victim].seed) {
                    Some(slot) => {
                        ops += self.write_data(p, slot, data);
                        ops += self.write_inode(p, meta, slot);
                        *d = fold(*d, slot as u64);
                        OP_COPY
                    }
                    // No space: the copy was a read.
                    None => {
                        self.counts[OP_READ] += 1;
                        *d = fold(*d, OP_READ as u64);
                        return ops;
                    }
                }
            }
            OP_WRITE => {
                self.serial += 1;
                let fseed = mix64(seed ^ self.serial.wrapping_mul(0x9E37_79B9_7F4A_7C15));
                self.inodes[victim].seed = fseed;
                fill(data, fseed);
                ops += self.write_data(p, victim, data);
                ops += self.write_inode(p, meta, victim);
                *d = fold(*d, fseed);
                OP_WRITE
            }
            OP_REMOVE => {
                self.free(victim);
                ops += self.write_inode(p, meta, victim);
                *d = fold(*d, victim as u64 + 1);
                OP_REMOVE
            }
            _ => OP_READ,
        };
        if done == OP_READ && self.live > 0 {
            ops += self.read_data(p, victim, data, d);
        }
        self.counts[done] += 1;
        *d = fold(*d, done as u64);
        ops
    }

    /// Digest contribution of the final state (the inode table).
    pub(crate) fn state_digest(&self) -> u64 {
        let mut h = mix64(self.live as u64);
        for (k, i) in self.inodes.iter().enumerate() {
            if i.used {
                h = fold(h, i.seed ^ k as u64);
                for &(s, l) in &i.ext[..i.n] {
                    h = fold(h, (u64::from(s) << 32) | u64::from(l));
                }
            }
        }
        fold(fold(h, self.mismatches), self.io_errors)
    }
}
