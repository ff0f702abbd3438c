//! `filecache`: an in-memory cache of a data set that lives on the block
//! device, as a guest OS's page cache keeps file data (the warm-VM reboot
//! paper's Figure 8 measures such a cache's throughput after a reboot).
//!
//! The data set is `data_bytes / BLOCK_BYTES` blocks at [`DATA_OFFSET`] on
//! the disk; block `b` holds a PRNG stream seeded from `(seed, b)`, so every
//! read can be checked word by word. Sector 0 holds a superblock (magic,
//! seed, block count, block size, data offset, a check word).
//!
//! * Warm-up (round 0): if the superblock already describes this data set
//!   the disk is left alone (a rebooted guest finds its files on disk);
//!   otherwise the superblock is cleared, every block written, and the
//!   superblock written last. Either way the round's ops are `data_bytes`
//!   and the digest folds only the expected superblock, so the digest does
//!   not depend on what the disk held before.
//! * Measured rounds: one request each for a block chosen hot/cold (90% of
//!   the requests go to the first `hot_pct`% of the blocks). A hit is served
//!   from the cache; a miss reads the block from the disk into a cache slot
//!   chosen by CLOCK (second chance) and evicts what was there. Either way
//!   the served block is checked against its content. An op is one byte
//!   served, so ops/s is the cache's throughput.
//!
//! The working set (`ws_bytes`, the cache) holds `slots` block slots, one tag
//! word per slot (`block + 1`, 0 = empty, bit 63 = referenced) and one map
//! word per data block (`slot + 1`, 0 = not cached):
//! `slots = (ws_bytes / 8 - blocks) / (BLOCK_WORDS + 1)`. The warm-up clears
//! tags and map, so the cache starts empty whatever the memory held.

use crate::blk::{check, fill};
use crate::{below, fold, mix64, pct_of, wyrand, Platform, HOTCOLD_HOT_ACCESS_PCT};

/// Bytes per cached block (and per disk request of a miss).
pub const BLOCK_BYTES: u64 = 16 << 10;
pub const BLOCK_WORDS: usize = (BLOCK_BYTES / 8) as usize;
pub const SECTOR_BYTES: u64 = 512;
/// Disk offset of block 0 (the superblock is sector 0).
pub const DATA_OFFSET: u64 = 64 << 10;
/// The default data set.
pub const DEFAULT_DATA_BYTES: u64 = 192 << 20;
/// Largest data set.
pub const MAX_DATA_BYTES: u64 = 16 << 30;

const SUPER_MAGIC: u64 = u64::from_le_bytes(*b"9LFCACH1");
const SB_WORDS: usize = (SECTOR_BYTES / 8) as usize;
const REF: u64 = 1 << 63;

const _: () = assert!(BLOCK_WORDS >= SB_WORDS && DATA_OFFSET.is_multiple_of(SECTOR_BYTES));

/// Disk bytes a data set of `data_bytes` needs.
pub const fn disk_bytes(data_bytes: u64) -> u64 {
    DATA_OFFSET + data_bytes
}

/// Cache slots a working set of `ws_bytes` holds for a data set of `data_bytes`.
pub const fn cache_slots(ws_bytes: u64, data_bytes: u64) -> u64 {
    let words = ws_bytes / 8;
    let blocks = data_bytes / BLOCK_BYTES;
    if words <= blocks {
        0
    } else {
        (words - blocks) / (BLOCK_WORDS as u64 + 1)
    }
}

/// The working set (a multiple of 4096) that caches all of a data set of
/// `data_bytes`: the default cache size.
pub const fn ws_bytes_for(data_bytes: u64) -> u64 {
    let blocks = data_bytes / BLOCK_BYTES;
    let bytes = (blocks * (BLOCK_WORDS as u64 + 1) + blocks) * 8;
    bytes.div_ceil(4096) * 4096
}

/// Checks filecache's parameters.
pub fn validate(p: &nl_abi::WorkloadParams) -> Result<(), &'static str> {
    if p.data_bytes == 0 || !p.data_bytes.is_multiple_of(BLOCK_BYTES) {
        return Err("filecache: data_bytes must be a nonzero multiple of the 16 KiB block");
    }
    if p.data_bytes > MAX_DATA_BYTES {
        return Err("filecache: data_bytes is larger than 16 GiB");
    }
    if p.ws_bytes == 0 || !p.ws_bytes.is_multiple_of(4096) {
        return Err("filecache: ws_bytes must be a nonzero multiple of 4096");
    }
    if p.ws_bytes > nl_abi::MAX_MEM_BYTES || usize::try_from(p.ws_bytes / 8).is_err() {
        return Err("filecache: ws_bytes is larger than the largest guest memory");
    }
    if cache_slots(p.ws_bytes, p.data_bytes) == 0 {
        return Err("filecache: ws_bytes is too small for one cache slot and the block map");
    }
    if p.hot_pct == 0 || p.hot_pct > 100 {
        return Err("filecache: hot_pct must be in 1..=100");
    }
    Ok(())
}

// A block's content is the PRNG stream of its seed, written and checked as
// blkbench's files are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Warm {
    /// Next: read the superblock.
    Check,
    /// Writing the data set; the next block to write.
    Write(u64),
    Done,
}

/// filecache's state between rounds (the cache itself is in the working set).
pub(crate) struct FileCache {
    seed: u64,
    /// Data blocks, and how many of them (the first) are hot.
    blocks: u64,
    hot: u64,
    slots: usize,
    /// CLOCK hand: the next slot to consider for eviction.
    hand: usize,
    warm: Warm,
    /// The warm-up found the data set on the disk (not in the digest).
    pub(crate) found: bool,
    pub(crate) hits: u64,
    pub(crate) misses: u64,
    /// Words read (from the disk or the cache) that were not the block's
    /// content, plus corrupted cache metadata seen.
    pub(crate) mismatches: u64,
    /// Requests the device failed.
    pub(crate) io_errors: u64,
}

impl FileCache {
    /// For validated params.
    pub(crate) fn new(p: &nl_abi::WorkloadParams, seed: u64) -> Self {
        let blocks = p.data_bytes / BLOCK_BYTES;
        FileCache {
            seed,
            blocks,
            hot: (blocks * p.hot_pct / 100).clamp(1, blocks),
            slots: cache_slots(p.ws_bytes, p.data_bytes) as usize,
            hand: 0,
            warm: Warm::Check,
            found: false,
            hits: 0,
            misses: 0,
            mismatches: 0,
            io_errors: 0,
        }
    }

    /// Cache slots.
    pub(crate) fn slots(&self) -> usize {
        self.slots
    }

    fn block_seed(&self, b: u64) -> u64 {
        mix64(self.seed ^ (b + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    fn sector_of(b: u64) -> u64 {
        (DATA_OFFSET + b * BLOCK_BYTES) / SECTOR_BYTES
    }

    fn superblock(&self) -> [u64; 6] {
        let w = [SUPER_MAGIC, self.seed, self.blocks, BLOCK_BYTES, DATA_OFFSET];
        let check = mix64(w.iter().fold(0, |h, &x| fold(h, x)));
        [w[0], w[1], w[2], w[3], w[4], check]
    }

    fn read<P: Platform>(&mut self, p: &mut P, sector: u64, buf: &mut [u64]) {
        if !p.blk_read(sector, buf) {
            self.io_errors += 1;
        }
    }

    fn write<P: Platform>(&mut self, p: &mut P, sector: u64, buf: &[u64]) {
        if !p.blk_write(sector, buf) {
            self.io_errors += 1;
        }
    }

    /// One piece of the warm-up: checks the superblock, or writes up to
    /// `max_blocks` blocks of the data set. Returns the round's ops once the
    /// data set is on the disk, `None` while blocks remain. The first slot
    /// serves as the I/O buffer (the cache is still empty).
    pub(crate) fn warm_up_step<P: Platform>(
        &mut self,
        p: &mut P,
        mem: &mut [u64],
        max_blocks: usize,
        d: &mut u64,
    ) -> Option<u64> {
        let meta = self.slots * BLOCK_WORDS;
        let sb = self.superblock();
        match self.warm {
            Warm::Check => {
                mem[meta..meta + self.slots + self.blocks as usize].fill(0);
                let buf = &mut mem[..SB_WORDS];
                buf.fill(0);
                self.read(p, 0, buf);
                if mem[..sb.len()] == sb {
                    self.found = true;
                    self.warm = Warm::Done;
                } else {
                    // Invalidate first: a data set half written is never taken as whole.
                    mem[..SB_WORDS].fill(0);
                    self.write(p, 0, &mem[..SB_WORDS]);
                    self.warm = Warm::Write(0);
                }
            }
            Warm::Write(next) => {
                let end = next.saturating_add(max_blocks.max(1) as u64).min(self.blocks);
                for b in next..end {
                    fill(&mut mem[..BLOCK_WORDS], self.block_seed(b));
                    self.write(p, Self::sector_of(b), &mem[..BLOCK_WORDS]);
                }
                self.warm = Warm::Write(end);
                if end == self.blocks {
                    mem[..SB_WORDS].fill(0);
                    mem[..sb.len()].copy_from_slice(&sb);
                    self.write(p, 0, &mem[..SB_WORDS]);
                    let mut b = [0u64; SB_WORDS];
                    self.read(p, 0, &mut b);
                    self.mismatches += u64::from(b[..sb.len()] != sb);
                    self.warm = Warm::Done;
                }
            }
            Warm::Done => {}
        }
        if self.warm != Warm::Done {
            return None;
        }
        for w in sb {
            *d = fold(*d, w);
        }
        Some(self.blocks * BLOCK_BYTES)
    }

    /// The block of request `r`: 90% uniform over the hot blocks, 10% over
    /// the others (all uniform when every block is hot).
    fn pick(&self, r: u64) -> u64 {
        let cold = self.blocks - self.hot;
        if cold == 0 || pct_of(r & 0xFFFF_FFFF) < HOTCOLD_HOT_ACCESS_PCT {
            below(r, self.hot as usize) as u64
        } else {
            self.hot + below(r, cold as usize) as u64
        }
    }

    /// CLOCK: the first slot from the hand whose reference bit is clear,
    /// clearing the bits it passes (at most one sweep plus one slot).
    fn victim(&mut self, tags: &mut [u64]) -> usize {
        loop {
            let s = self.hand;
            self.hand = if s + 1 >= self.slots { 0 } else { s + 1 };
            let t = tags[s];
            if t & REF == 0 {
                return s;
            }
            tags[s] = t & !REF;
        }
    }

    /// One request; returns the bytes served.
    pub(crate) fn request<P: Platform>(
        &mut self,
        p: &mut P,
        mem: &mut [u64],
        rng: &mut u64,
        d: &mut u64,
    ) -> u64 {
        let b = self.pick(wyrand(rng));
        let (data, rest) = mem.split_at_mut(self.slots * BLOCK_WORDS);
        let (tags, rest) = rest.split_at_mut(self.slots);
        let map = &mut rest[..self.blocks as usize];
        let cached = map[b as usize];
        let slot = cached.wrapping_sub(1) as usize;
        let hit = cached != 0 && slot < self.slots && tags[slot] & !REF == b + 1;
        let slot = if hit {
            tags[slot] |= REF;
            self.hits += 1;
            slot
        } else {
            // Corrupted metadata (a map entry that does not match its slot's tag).
            self.mismatches += u64::from(cached != 0);
            let s = self.victim(tags);
            let old = tags[s] & !REF;
            if old != 0 {
                match map.get_mut(old as usize - 1) {
                    Some(m) => *m = 0,
                    None => self.mismatches += 1,
                }
            }
            let buf = &mut data[s * BLOCK_WORDS..(s + 1) * BLOCK_WORDS];
            if !p.blk_read(Self::sector_of(b), buf) {
                self.io_errors += 1;
            }
            tags[s] = (b + 1) | REF;
            map[b as usize] = s as u64 + 1;
            self.misses += 1;
            s
        };
        let (bad, h) =
            check(&data[slot * BLOCK_WORDS..(slot + 1) * BLOCK_WORDS], self.block_seed(b));
        self.mismatches += bad;
        *d = fold(fold(*d, h ^ b), u64::from(hit) | (bad << 1));
        BLOCK_BYTES
    }

    /// Digest contribution of the final state.
    pub(crate) fn state_digest(&self) -> u64 {
        let h = fold(fold(mix64(self.hits), self.misses), self.hand as u64);
        fold(fold(h, self.mismatches), self.io_errors)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(slots: usize) -> FileCache {
        let p = nl_abi::WorkloadParams {
            kind: nl_abi::WORKLOAD_FILECACHE,
            data_bytes: 64 * BLOCK_BYTES,
            ws_bytes: ((slots as u64 * (BLOCK_WORDS as u64 + 1) + 64) * 8).div_ceil(4096) * 4096,
            hot_pct: 10,
            ..Default::default()
        };
        let c = FileCache::new(&p, 1);
        assert_eq!(c.slots, slots);
        c
    }

    #[test]
    fn clock_gives_referenced_slots_a_second_chance() {
        let mut c = cache(4);
        // Empty slots are taken in order.
        let mut tags = [0u64; 4];
        assert_eq!(c.victim(&mut tags), 0);
        assert_eq!(c.victim(&mut tags), 1);
        // Slots 2 and 3 referenced, 0 not: the hand clears 2 and 3 and takes 0.
        let mut tags = [5, 6 | REF, 7 | REF, 8 | REF];
        c.hand = 2;
        assert_eq!(c.victim(&mut tags), 0);
        assert_eq!(tags, [5, 6 | REF, 7, 8]);
        assert_eq!(c.hand, 1);
        // Next: 1 loses its bit, 2 (now clear) is taken.
        assert_eq!(c.victim(&mut tags), 2);
        assert_eq!(tags, [5, 6, 7, 8]);
        // All referenced: one sweep clears them and the hand's slot goes.
        let mut tags = [1 | REF, 2 | REF, 3 | REF, 4 | REF];
        c.hand = 3;
        assert_eq!(c.victim(&mut tags), 3);
        assert_eq!(tags, [1, 2, 3, 4]);
    }

    #[test]
    fn sizes() {
        let data = 8 << 20;
        let ws = ws_bytes_for(data);
        assert!(ws.is_multiple_of(4096));
        assert_eq!(cache_slots(ws, data), data / BLOCK_BYTES);
        assert_eq!(cache_slots(ws - 4096 * 8, data), data / BLOCK_BYTES - 2);
        assert_eq!(cache_slots(4096, data), 0);
        assert_eq!(disk_bytes(data), data + DATA_OFFSET);
    }
}
