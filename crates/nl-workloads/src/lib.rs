//! The ninelives workload engine.
//!
//! One deterministic engine, run in two places:
//!
//! * inside the VM, in guest ring 3, where the VMM measures its throughput;
//! * natively on the host (feature `std`, module `native`), to verify the
//!   guest's digest by replaying the same number of rounds and to measure the
//!   native throughput the guest's is compared with.
//!
//! Everything a workload does is a function of `(params, cpu, rounds)`: the
//! seed of vCPU `cpu` is [`nl_abi::seed_for_cpu`]`(params.seed, cpu)`, all
//! randomness comes from a PRNG seeded from it, and the working set starts all
//! zero. Round 0 is the warm-up round (for `memwrite` it maps the whole
//! working set); the measured period is rounds 1 and up.
//!
//! The workloads (an "op" is what the throughput counts):
//!
//! * `memwrite`: op = one 8-byte access to the working set. Round 0 stores
//!   one word in every 4 KiB page (ops = pages). Later rounds make a fixed
//!   number of accesses (`MEMWRITE_*_OPS_PER_ROUND`, at most one per word of
//!   the working set) at addresses from the pattern: sequential, strided
//!   (every word eventually), random (uniform) or hot/cold (90% in the first
//!   `hot_pct`% of the pages). Exactly `write_pct` of every 100 consecutive
//!   accesses are stores, spread evenly; the others are loads folded into the
//!   digest. [`Workload::finish`] hashes the whole working set.
//! * `compute`: op = one iteration of four chained multiply/xorshift streams,
//!   [`COMPUTE_ITERS_PER_ROUND`] per round; no memory traffic.
//! * `exits`: op = one [`Platform`] call: 32 `port_echo` + 32 `mmio_echo`
//!   per round plus one `halt` every [`EXITS_HALT_EVERY`]th round; the digest
//!   folds the values the platform returns.
//! * `idle`: op = one `halt` per round.
//! * `netbench`: op = one poll of the network (one round); answers UDP
//!   packets to port 7 with their payload. The digest only covers the
//!   rounds: what arrives depends on the outside world, which the external
//!   sender (`ninelives ping`) checks.
//! * `kv`: op = one poll of the network (one round), like netbench; the
//!   guest serves a key-value protocol over TCP ([`kv`]) from a table in
//!   its working set ([`kv::KV_WS_BYTES`]). The digest only covers the
//!   rounds; what was stored is checked by the client (`ninelives kvload`),
//!   which reads every key back and compares the table's digest.
//! * `blkbench`: op = one byte moved to or from the block device; one file
//!   operation (create, copy, read, overwrite, remove of a 1 MiB file in the
//!   [`blk`] file store) per round, every read checked. The working set is
//!   the I/O buffer ([`blk::BLKBENCH_WS_BYTES`]); the warm-up round formats
//!   the store.
//! * `periodic`, `storm`: the budget storm test's two sandboxes
//!   ([`periodic`]): per-period CPU accounting against a reservation, and a
//!   doorbell storm. Run by the guest's channel code, not the round engine.
//! * `filecache`: op = one byte served from a file cache ([`filecache`]):
//!   one request for a 16 KiB block of a data set on the block device per
//!   round, served from the cache in the working set (a hit) or read from the
//!   disk into it (a miss, CLOCK eviction), every served block checked. The
//!   warm-up round writes the data set unless the disk already holds it, with
//!   the same digest either way. Hits and misses are part of the digest.
//!
//! The crate is `no_std` and allocation-free; the hot loops avoid indirect
//! calls ([`Platform`] is a generic parameter) and bounds checks where the
//! index is not provably in range only cost a predictable branch.
#![no_std]
#![deny(unsafe_code)]

#[cfg(any(feature = "std", test))]
extern crate std;

#[cfg(feature = "std")]
pub mod native;

pub mod blk;
pub mod chanbench;
pub mod channel;
pub mod channel_audit;
pub mod chanstream;
pub mod doorbell;
pub mod filecache;
pub mod kv;
pub mod periodic;
pub mod wildwrite;

#[cfg(test)]
mod tests;

use nl_abi::{
    WorkloadParams, MAX_MEM_BYTES, PATTERN_HOTCOLD, PATTERN_RANDOM, PATTERN_SEQUENTIAL,
    PATTERN_STRIDED, WORKLOAD_BLKBENCH, WORKLOAD_CHANBENCH, WORKLOAD_CHANSTREAM, WORKLOAD_COMPUTE,
    WORKLOAD_DOORBELL, WORKLOAD_EXITS, WORKLOAD_FILECACHE, WORKLOAD_IDLE, WORKLOAD_KV,
    WORKLOAD_MEMWRITE, WORKLOAD_NETBENCH, WORKLOAD_SYSCALL, WORKLOAD_TLBWALK, WORKLOAD_WILDWRITE,
};

/// What a workload needs from the machine it runs on.
///
/// In the guest these are real VM exits; natively (see `native`) they are
/// emulated, each with one cheap syscall as the analog of an exit.
pub trait Platform {
    /// A 32-bit `out` of `v` to the echo port ([`nl_abi::EXITS_PORT`]) then a
    /// 32-bit `in` from it. A correct device returns `!v`.
    fn port_echo(&mut self, v: u32) -> u32;
    /// A 64-bit write of `v` to the control device's SCRATCH register, then a
    /// read of it. A correct device returns `v`.
    fn mmio_echo(&mut self, v: u64) -> u64;
    /// Waits for the next timer tick (`sti; hlt` in the guest).
    fn halt(&mut self);
    /// Reads `buf.len() * 8` bytes (a multiple of 512) from the block device
    /// starting at 512-byte sector `sector`. False if the device failed.
    fn blk_read(&mut self, sector: u64, buf: &mut [u64]) -> bool {
        let _ = (sector, buf);
        false
    }
    /// Writes `buf` to the block device at `sector`. False if the device failed.
    fn blk_write(&mut self, sector: u64, buf: &[u64]) -> bool {
        let _ = (sector, buf);
        false
    }
    /// Services the network once (netbench): receives what arrived and
    /// answers it. Returns the packets answered.
    fn net_poll(&mut self) -> u64 {
        0
    }
    /// The null syscall ([`nl_abi::SYS_NULL`]): a round trip through the
    /// guest kernel, which answers [`nl_abi::SYS_ENOSYS`].
    fn null_syscall(&mut self) -> u64 {
        nl_abi::SYS_ENOSYS
    }
    /// Calls the machine code at the start of `code` (tlbwalk's fetch
    /// chain, [`fetch_chain_point`]) with `arg` in RDI and returns its RAX;
    /// `None` where code cannot be run from this memory.
    fn run_code(&mut self, code: &[u64], arg: u64) -> Option<u64> {
        let _ = (code, arg);
        None
    }
}

/// tlbwalk with [`nl_abi::TLBWALK_FETCHES`]: the two words of machine code at
/// point `i` of `pages` (byte offset `i * TLBWALK_STRIDE`, so word-aligned),
/// and the immediate it adds to RAX. The first point moves RDI into RAX;
/// every point adds its immediate, then jumps to the next point, the last
/// returns. Unused bytes are `int3`.
pub fn fetch_chain_point(seed: u64, i: u64, pages: u64) -> ([u64; 2], u32) {
    let imm = (mix64(seed ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15)) as u32) & 0x7fff_ffff;
    let mut b = [0xccu8; 16];
    // mov rax, rdi (the first point only)
    let head = if i == 0 { 3 } else { 0 };
    b[..head].copy_from_slice(&[0x48, 0x89, 0xf8][..head]);
    // add rax, imm32
    b[head..head + 2].copy_from_slice(&[0x48, 0x05]);
    b[head + 2..head + 6].copy_from_slice(&imm.to_le_bytes());
    let at = head + 6;
    if i + 1 == pages {
        b[at] = 0xc3; // ret
    } else {
        // jmp rel32 to the next point, relative to the end of the jmp.
        let rel = (nl_abi::TLBWALK_STRIDE - (at as u64 + 5)) as u32;
        b[at] = 0xe9;
        b[at + 1..at + 5].copy_from_slice(&rel.to_le_bytes());
    }
    let w = |k: usize| u64::from_le_bytes(b[k..k + 8].try_into().unwrap_or([0xcc; 8]));
    ([w(0), w(8)], imm)
}

/// Bytes in a page: the granularity of the VMM's dirty tracking.
pub const PAGE_BYTES: u64 = 4096;
const PAGE_WORDS: usize = (PAGE_BYTES / 8) as usize;

/// memwrite, sequential pattern: accesses per measured round (fewer for a
/// small working set: at most one access per word of it).
pub const MEMWRITE_SEQUENTIAL_OPS_PER_ROUND: u64 = 1 << 20;
/// memwrite, strided pattern (a new cache line, often a new page, per access
/// but prefetchable): accesses per measured round (fewer for a small working
/// set: at most one access per word of it).
pub const MEMWRITE_STRIDED_OPS_PER_ROUND: u64 = 1 << 17;
/// memwrite, random and hot/cold patterns (mostly cache and TLB misses):
/// accesses per measured round (fewer for a small working set: at most one
/// access per word of it).
pub const MEMWRITE_RANDOM_OPS_PER_ROUND: u64 = 1 << 16;
/// memwrite hot/cold: percentage of accesses that go to the hot part.
pub const HOTCOLD_HOT_ACCESS_PCT: u64 = 90;
/// compute: mixing iterations per round.
pub const COMPUTE_ITERS_PER_ROUND: u64 = 1 << 19;
/// exits: `port_echo` calls per round.
pub const EXITS_PORT_PER_ROUND: u64 = 32;
/// exits: `mmio_echo` calls per round.
pub const EXITS_MMIO_PER_ROUND: u64 = 32;
/// syscall: null syscalls per round, each followed by
/// [`SYSCALL_WORK_ITERS`] ring-3 mixing iterations.
pub const SYSCALL_PER_ROUND: u64 = 64;
/// syscall: ring-3 mixing iterations after each syscall.
pub const SYSCALL_WORK_ITERS: u64 = 64;
/// tlbwalk: accesses per measured round (whole passes over the pages, at
/// least one).
pub const TLBWALK_ACCESSES_PER_ROUND: u64 = 1 << 16;
/// tlbwalk: most pages.
pub const TLBWALK_MAX_PAGES: u64 = 65_536;

/// tlbwalk: the working set of `pages` accesses at a
/// [`nl_abi::TLBWALK_STRIDE`]-byte stride (whole 4 KiB pages).
pub const fn tlbwalk_ws_bytes(pages: u64) -> u64 {
    (pages * nl_abi::TLBWALK_STRIDE).div_ceil(PAGE_BYTES) * PAGE_BYTES
}

/// exits: rounds `r` with `r % EXITS_HALT_EVERY == EXITS_HALT_EVERY - 1`
/// also make one `halt()` call.
pub const EXITS_HALT_EVERY: u64 = 8;

/// The disk a workload needs (blkbench, filecache), in bytes, if it needs one.
pub fn disk_needed(w: &WorkloadParams) -> Option<u64> {
    match w.kind {
        WORKLOAD_BLKBENCH => Some(blk::BLKBENCH_DISK_BYTES),
        WORKLOAD_FILECACHE => Some(filecache::disk_bytes(w.data_bytes)),
        _ => None,
    }
}

/// Checks that `params` describe a workload this engine can run.
pub fn validate(params: &WorkloadParams) -> Result<(), &'static str> {
    match params.kind {
        WORKLOAD_MEMWRITE => validate_memwrite(params),
        WORKLOAD_COMPUTE | WORKLOAD_EXITS | WORKLOAD_IDLE | WORKLOAD_NETBENCH => Ok(()),
        // Run by the guest's channel code, not by the round engine.
        WORKLOAD_CHANBENCH | WORKLOAD_WILDWRITE | WORKLOAD_CHANSTREAM | WORKLOAD_DOORBELL => Ok(()),
        nl_abi::WORKLOAD_STORM => Ok(()),
        nl_abi::WORKLOAD_PERIODIC
            if params.stride >= 1000 && params.data_bytes > 0 && params.data_bytes <= params.stride =>
        {
            Ok(())
        }
        nl_abi::WORKLOAD_PERIODIC => Err(
            "periodic: stride (the period, µs) must be at least 1000 and data_bytes (the reservation, µs) in 1..=stride",
        ),
        WORKLOAD_BLKBENCH if params.ws_bytes == blk::BLKBENCH_WS_BYTES => Ok(()),
        WORKLOAD_BLKBENCH => Err("blkbench: ws_bytes must be blk::BLKBENCH_WS_BYTES"),
        WORKLOAD_SYSCALL => Ok(()),
        WORKLOAD_TLBWALK
            if (1..=TLBWALK_MAX_PAGES).contains(&params.stride)
                && params.ws_bytes == tlbwalk_ws_bytes(params.stride)
                && [nl_abi::TLBWALK_LOADS, nl_abi::TLBWALK_FETCHES].contains(&params.pattern) =>
        {
            Ok(())
        }
        WORKLOAD_TLBWALK => {
            Err("tlbwalk: stride (pages) must be 1..=65536, ws_bytes tlbwalk_ws_bytes(pages), and pattern TLBWALK_LOADS or TLBWALK_FETCHES")
        }
        WORKLOAD_KV if params.ws_bytes == kv::KV_WS_BYTES => Ok(()),
        WORKLOAD_KV => Err("kv: ws_bytes must be kv::KV_WS_BYTES"),
        WORKLOAD_FILECACHE => filecache::validate(params),
        _ => Err("unknown workload kind"),
    }
}

fn validate_memwrite(p: &WorkloadParams) -> Result<(), &'static str> {
    if p.ws_bytes == 0 {
        return Err("memwrite: ws_bytes must be nonzero");
    }
    if !p.ws_bytes.is_multiple_of(PAGE_BYTES) {
        return Err("memwrite: ws_bytes must be a multiple of 4096");
    }
    if p.ws_bytes > MAX_MEM_BYTES || usize::try_from(p.ws_bytes / 8).is_err() {
        return Err("memwrite: ws_bytes is larger than the largest guest memory");
    }
    if p.write_pct > 100 {
        return Err("memwrite: write_pct must be at most 100");
    }
    match p.pattern {
        PATTERN_SEQUENTIAL | PATTERN_RANDOM => Ok(()),
        PATTERN_STRIDED => {
            if p.stride == 0 {
                Err("memwrite strided: stride must be nonzero")
            } else if !p.stride.is_multiple_of(8) {
                Err("memwrite strided: stride must be a multiple of 8")
            } else if p.stride >= p.ws_bytes {
                Err("memwrite strided: stride must be smaller than ws_bytes")
            } else {
                Ok(())
            }
        }
        PATTERN_HOTCOLD => {
            if p.hot_pct == 0 || p.hot_pct > 100 {
                Err("memwrite hotcold: hot_pct must be in 1..=100")
            } else {
                Ok(())
            }
        }
        _ => Err("memwrite: unknown pattern"),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Memwrite,
    Compute,
    Exits,
    Idle,
    Blkbench,
    Netbench,
    Kv,
    Filecache,
    Syscall,
    Tlbwalk,
}

/// One vCPU's workload: its state between rounds.
pub struct Workload<'m> {
    kind: Kind,
    /// The working set (memwrite only; ignored by the other kinds).
    mem: &'m mut [u64],
    seed: u64,
    rng: u64,
    /// Running digest: reads (memwrite) or returned echoes (exits).
    digest: u64,
    rounds: u64,
    // memwrite
    pattern: u64,
    write_pct: u64,
    /// Write/read decision accumulator (see [`Mix::access`]).
    wacc: u64,
    /// Strided: stride in words (1 for sequential).
    stride: usize,
    /// Sequential/strided: next word to access.
    pos: usize,
    /// Strided: offset (0..stride) of the current pass over the working set.
    col: usize,
    /// Hot/cold: words in the hot part (a whole number of pages).
    hot_words: usize,
    /// Accesses per measured round.
    ops_per_round: u64,
    /// memwrite: pages of round 0 done so far by [`Workload::warm_up_step`].
    warm_pos: usize,
    // compute
    lanes: [u64; 4],
    // exits
    mismatches: u64,
    // blkbench
    store: blk::FileStore,
    // filecache
    cache: Option<filecache::FileCache>,
    // netbench
    net_answered: u64,
}

impl<'m> Workload<'m> {
    /// Validates params (kind known; memwrite: ws_bytes a nonzero multiple of
    /// 4096 and == mem.len()*8, write_pct <= 100, pattern known, stride
    /// multiple of 8 and > 0 and < ws_bytes for strided, hot_pct 1..=100 for
    /// hotcold).
    ///
    /// `mem` is the working set (memwrite) and must be all zero; the other
    /// kinds ignore it (pass `&mut []`).
    pub fn new(
        params: &WorkloadParams,
        cpu: u64,
        mem: &'m mut [u64],
    ) -> Result<Self, &'static str> {
        validate(params)?;
        let kind = match params.kind {
            WORKLOAD_MEMWRITE => Kind::Memwrite,
            WORKLOAD_COMPUTE => Kind::Compute,
            WORKLOAD_EXITS => Kind::Exits,
            WORKLOAD_BLKBENCH => Kind::Blkbench,
            WORKLOAD_NETBENCH => Kind::Netbench,
            WORKLOAD_KV => Kind::Kv,
            WORKLOAD_FILECACHE => Kind::Filecache,
            WORKLOAD_SYSCALL => Kind::Syscall,
            WORKLOAD_TLBWALK => Kind::Tlbwalk,
            _ => Kind::Idle,
        };
        let seed = nl_abi::seed_for_cpu(params.seed, cpu);
        let mut stride = 1;
        let mut hot_words = 0;
        let mut ops_per_round = 0;
        if kind == Kind::Blkbench && (mem.len() as u64).checked_mul(8) != Some(params.ws_bytes) {
            return Err("blkbench: the memory slice must be exactly ws_bytes long");
        }
        if kind == Kind::Filecache && (mem.len() as u64).checked_mul(8) != Some(params.ws_bytes) {
            return Err("filecache: the memory slice must be exactly ws_bytes long");
        }
        if kind == Kind::Tlbwalk {
            if (mem.len() as u64).checked_mul(8) != Some(params.ws_bytes) {
                return Err("tlbwalk: the memory slice must be exactly ws_bytes long");
            }
            // `stride` holds the pages; the walk's stride is in words.
            stride = (nl_abi::TLBWALK_STRIDE / 8) as usize;
            let passes = (TLBWALK_ACCESSES_PER_ROUND / params.stride).max(1);
            ops_per_round = passes * params.stride;
            hot_words = params.stride as usize;
        }
        if kind == Kind::Memwrite {
            if (mem.len() as u64).checked_mul(8) != Some(params.ws_bytes) {
                return Err("memwrite: the memory slice must be exactly ws_bytes long");
            }
            ops_per_round = match params.pattern {
                PATTERN_SEQUENTIAL => MEMWRITE_SEQUENTIAL_OPS_PER_ROUND,
                PATTERN_STRIDED => MEMWRITE_STRIDED_OPS_PER_ROUND,
                _ => MEMWRITE_RANDOM_OPS_PER_ROUND,
            }
            .min(mem.len() as u64);
            if params.pattern == PATTERN_STRIDED {
                stride = (params.stride / 8) as usize;
            }
            if params.pattern == PATTERN_HOTCOLD {
                let pages = params.ws_bytes / PAGE_BYTES;
                let hot_pages = (pages * params.hot_pct / 100).max(1);
                hot_words = hot_pages as usize * PAGE_WORDS;
            }
        }
        let salt = params.kind.wrapping_mul(0xD6E8_FEB8_6659_FD93);
        let mut lanes = [0u64; 4];
        for (i, l) in lanes.iter_mut().enumerate() {
            *l = mix64(seed ^ salt ^ (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        }
        Ok(Workload {
            kind,
            mem,
            seed,
            rng: mix64(seed ^ salt ^ 0x5851_F42D_4C95_7F2D),
            digest: mix64(seed.wrapping_add(salt)),
            rounds: 0,
            pattern: params.pattern,
            write_pct: params.write_pct,
            wacc: 0,
            stride,
            pos: 0,
            col: 0,
            hot_words,
            ops_per_round,
            warm_pos: 0,
            lanes,
            mismatches: 0,
            store: blk::FileStore::new(),
            cache: (kind == Kind::Filecache).then(|| filecache::FileCache::new(params, seed)),
            net_answered: 0,
        })
    }

    /// Runs one round and returns the ops it did. Round 0 is the warm-up.
    pub fn round<P: Platform>(&mut self, p: &mut P) -> u64 {
        let ops = match self.kind {
            Kind::Memwrite if self.rounds == 0 => self.warm_up(),
            Kind::Memwrite => self.memwrite_round(),
            Kind::Compute => self.compute_round(),
            Kind::Exits => self.exits_round(p),
            Kind::Syscall => self.syscall_round(p),
            Kind::Tlbwalk if self.rounds == 0 => self.tlbwalk_warm_up(),
            Kind::Tlbwalk => self.tlbwalk_round(p),
            Kind::Idle => {
                p.halt();
                1
            }
            Kind::Netbench | Kind::Kv => {
                self.net_answered += p.net_poll();
                1
            }
            Kind::Blkbench if self.rounds == 0 => {
                let meta = &mut self.mem[(blk::FILE_BYTES / 8) as usize..];
                self.store.format(p, meta, &mut self.digest)
            }
            Kind::Blkbench => {
                self.store.op(p, self.mem, self.seed, &mut self.rng, &mut self.digest)
            }
            Kind::Filecache => match self.cache.as_mut() {
                Some(c) if self.rounds == 0 => loop {
                    if let Some(ops) = c.warm_up_step(p, self.mem, usize::MAX, &mut self.digest) {
                        break ops;
                    }
                },
                Some(c) => c.request(p, self.mem, &mut self.rng, &mut self.digest),
                None => 0,
            },
        };
        self.rounds += 1;
        ops
    }

    /// Rounds run so far (warm-up included).
    pub fn rounds_done(&self) -> u64 {
        self.rounds
    }

    /// Echoes (exits workload) whose returned value was not the correct one
    /// so far: a self-check the guest can report as `ERR_SELF_CHECK`. The
    /// digest folds the returned values, so it shows the same thing.
    pub fn echo_mismatches(&self) -> u64 {
        self.mismatches
    }

    /// Failed self-checks so far: wrong echoes (exits) or corrupted words
    /// read from the working set (memwrite). The guest reports a nonzero
    /// count as `ERR_SELF_CHECK`, which is how a bit flip in guest memory
    /// becomes a detected error within the error latency of the next read.
    pub fn self_check_failures(&self) -> u64 {
        self.mismatches
    }

    /// blkbench: words read back that differed from what was written, and
    /// requests the device failed, so far (both should stay 0).
    pub fn blk_errors(&self) -> (u64, u64) {
        match &self.cache {
            Some(c) => (c.mismatches, c.io_errors),
            None => (self.store.mismatches, self.store.io_errors),
        }
    }

    /// filecache: requests served from the cache and read from the disk so
    /// far ((0, 0) for the other workloads).
    pub fn cache_counts(&self) -> (u64, u64) {
        self.cache.as_ref().map_or((0, 0), |c| (c.hits, c.misses))
    }

    /// filecache: whether the warm-up found the data set already on the
    /// disk (and did not write it). Not part of the digest.
    pub fn cache_data_found(&self) -> bool {
        self.cache.as_ref().is_some_and(|c| c.found)
    }

    /// filecache: the cache's block slots.
    pub fn cache_slots(&self) -> usize {
        self.cache.as_ref().map_or(0, |c| c.slots())
    }

    /// netbench: packets answered so far (not part of the digest: it
    /// depends on what the network brought).
    pub fn net_answered(&self) -> u64 {
        self.net_answered
    }

    /// blkbench: file operations done so far by kind (create, copy, read,
    /// overwrite, remove).
    pub fn blk_counts(&self) -> [u64; 5] {
        self.store.counts
    }

    /// The end-of-run self-check: memwrite checks the seal of every word of
    /// the working set (a corrupted word that no round happened to read
    /// again would otherwise only show in the digest) and adds the corrupted
    /// words to [`Self::self_check_failures`]. Returns the failures so far.
    /// Other workloads have nothing more to check here. Does not change the
    /// digest.
    pub fn final_self_check(&mut self) -> u64 {
        if self.kind == Kind::Memwrite {
            self.mismatches += self.mem.iter().filter(|w| !sealed_ok(**w)).count() as u64;
        }
        self.mismatches
    }

    /// Final digest (folds a sweep over the working set for memwrite).
    ///
    /// Does not change the state: calling it twice gives the same value.
    /// For memwrite it reads the whole working set (about 1 ns per 8 bytes).
    pub fn finish(&mut self) -> u64 {
        let mut h = fold(self.digest, mix64(self.rounds ^ 0xA24B_AED4_963E_E407));
        match self.kind {
            Kind::Memwrite => h = fold(h, sweep(self.mem)),
            Kind::Compute => {
                for l in self.lanes {
                    h = fold(h, l);
                }
            }
            Kind::Blkbench => h = fold(h, self.store.state_digest()),
            Kind::Filecache => {
                h = fold(h, self.cache.as_ref().map_or(0, |c| c.state_digest()));
            }
            Kind::Syscall => {
                for l in self.lanes {
                    h = fold(h, l);
                }
            }
            Kind::Tlbwalk => h = fold(h, sweep(self.mem)),
            Kind::Exits | Kind::Idle | Kind::Netbench | Kind::Kv => {}
        }
        mix64(h)
    }

    /// Round 0 of memwrite: one store in every page, so the whole working
    /// set is mapped before the measured period. Ops = pages.
    fn warm_up(&mut self) -> u64 {
        let pages = self.mem.len() / PAGE_WORDS;
        self.warm_pages(0, pages);
        pages as u64
    }

    /// The warm-up's stores for pages `[from, to)`; each page's store depends
    /// only on the seed and the page's index, so the warm-up can be done in
    /// any number of pieces with the same result.
    fn warm_pages(&mut self, from: usize, to: usize) {
        for (i, page) in self.mem.chunks_exact_mut(PAGE_WORDS).enumerate().take(to).skip(from) {
            let h = mix64(self.seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            page[(h >> 40) as usize & (PAGE_WORDS - 1)] = seal(h);
        }
    }

    /// Round 0 in pieces of at most `max_pages` pages, so the guest can keep
    /// heartbeating while a large working set is first mapped (about 8 µs a
    /// page on PVM: a 2 GiB working set takes seconds). Returns the round's
    /// ops once round 0 is complete, with exactly the effect of [`Self::round`]
    /// for round 0; `None` while pages remain. filecache writes at most
    /// `max_pages` blocks of its data set per piece; other workloads run
    /// their round 0 whole.
    pub fn warm_up_step<P: Platform>(&mut self, p: &mut P, max_pages: usize) -> Option<u64> {
        if let (Kind::Filecache, 0, Some(c)) = (self.kind, self.rounds, self.cache.as_mut()) {
            let ops = c.warm_up_step(p, self.mem, max_pages, &mut self.digest)?;
            self.rounds = 1;
            return Some(ops);
        }
        if self.kind != Kind::Memwrite || self.rounds != 0 {
            return Some(self.round(p));
        }
        let pages = self.mem.len() / PAGE_WORDS;
        let to = self.warm_pos.saturating_add(max_pages.max(1)).min(pages);
        self.warm_pages(self.warm_pos, to);
        self.warm_pos = to;
        if to < pages {
            return None;
        }
        self.rounds = 1;
        Some(pages as u64)
    }

    fn memwrite_round(&mut self) -> u64 {
        // Values written this round: distinct per round and per access, never 0.
        let wbase = mix64(self.seed ^ self.rounds.wrapping_mul(0xC2B2_AE3D_27D4_EB4F));
        let ops = self.ops_per_round;
        match self.pattern {
            PATTERN_SEQUENTIAL | PATTERN_STRIDED => self.strided(ops as usize, wbase),
            PATTERN_RANDOM => self.random(ops, wbase),
            _ => self.hotcold(ops, wbase),
        }
        ops
    }

    /// Sequential (stride 1) and strided accesses: passes over the working
    /// set at offsets 0, stride, 2*stride, ... then 1, 1+stride, ... so every
    /// word is hit once every `words` accesses; continues across rounds.
    fn strided(&mut self, mut left: usize, wbase: u64) {
        let mut m = self.mix(wbase);
        let mem = &mut *self.mem;
        let n = mem.len();
        let s = self.stride;
        let (mut pos, mut col) = (self.pos, self.col);
        while left > 0 {
            // Accesses left in this pass: pos, pos+s, ... < n.
            let avail = (n - 1 - pos) / s + 1;
            let take = avail.min(left);
            for w in mem[pos..].iter_mut().step_by(s).take(take) {
                m.access(w);
            }
            left -= take;
            if take == avail {
                col += 1;
                if col == s {
                    col = 0;
                }
                pos = col;
            } else {
                pos += take * s;
            }
        }
        (self.pos, self.col) = (pos, col);
        self.unmix(m);
    }

    /// Uniformly random accesses over the whole working set.
    fn random(&mut self, ops: u64, wbase: u64) {
        let mut m = self.mix(wbase);
        let mem = &mut *self.mem;
        let n = mem.len();
        let mut rng = self.rng;
        for _ in 0..ops {
            m.access(&mut mem[below(wyrand(&mut rng), n)]);
        }
        self.rng = rng;
        self.unmix(m);
    }

    /// 90% of the accesses uniform in the hot part (the first hot_pct% of
    /// the pages), 10% uniform in the rest.
    fn hotcold(&mut self, ops: u64, wbase: u64) {
        let mut m = self.mix(wbase);
        let mem = &mut *self.mem;
        let hot = self.hot_words;
        let cold = mem.len() - hot;
        // With no cold part every access is hot.
        let hot_thresh = if cold == 0 { 100 } else { HOTCOLD_HOT_ACCESS_PCT };
        let mut rng = self.rng;
        for _ in 0..ops {
            let r = wyrand(&mut rng);
            // The low half decides hot or cold; `below` depends (almost only)
            // on the high half.
            let (base, len) =
                if pct_of(r & 0xFFFF_FFFF) < hot_thresh { (0, hot) } else { (hot, cold) };
            m.access(&mut mem[base + below(r, len)]);
        }
        self.rng = rng;
        self.unmix(m);
    }

    fn mix(&self, wbase: u64) -> Mix {
        Mix { bad: 0, acc: self.wacc, pct: self.write_pct, v: wbase, d: self.digest }
    }

    fn unmix(&mut self, m: Mix) {
        (self.wacc, self.digest) = (m.acc, m.d);
        self.mismatches += m.bad;
    }

    fn compute_round(&mut self) -> u64 {
        let mut l = self.lanes;
        let base = self.rounds.wrapping_mul(COMPUTE_ITERS_PER_ROUND);
        for k in 0..COMPUTE_ITERS_PER_ROUND {
            let i = base.wrapping_add(k);
            // Four independent multiply/xorshift chains keep the multiplier
            // busy; the counter keeps 0 from being a fixed point.
            l[0] = (l[0] ^ (l[0] >> 29) ^ i).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            l[1] = (l[1] ^ (l[1] >> 31) ^ i).wrapping_mul(0x94D0_49BB_1331_11EB);
            l[2] = (l[2] ^ (l[2] >> 27) ^ i).wrapping_mul(0xD6E8_FEB8_6659_FD93);
            l[3] = (l[3] ^ (l[3] >> 33) ^ i).wrapping_mul(0xFF51_AFD7_ED55_8CCD);
        }
        // Cross the lanes once per round.
        l = [
            l[0] ^ l[3].rotate_left(17),
            l[1] ^ l[0].rotate_left(29),
            l[2] ^ l[1].rotate_left(41),
            l[3] ^ l[2].rotate_left(53),
        ];
        self.lanes = core::hint::black_box(l);
        COMPUTE_ITERS_PER_ROUND
    }

    /// syscall: [`SYSCALL_PER_ROUND`] null syscalls, each checked and
    /// followed by a little ring-3 work. Ops = syscalls.
    fn syscall_round<P: Platform>(&mut self, p: &mut P) -> u64 {
        let mut l = self.lanes;
        let base = self.rounds.wrapping_mul(SYSCALL_PER_ROUND);
        for k in 0..SYSCALL_PER_ROUND {
            let r = p.null_syscall();
            if r != nl_abi::SYS_ENOSYS {
                self.mismatches += 1;
            }
            l[0] ^= r ^ base.wrapping_add(k);
            for i in 0..SYSCALL_WORK_ITERS {
                l[i as usize & 3] = (l[i as usize & 3] ^ (l[(i as usize + 1) & 3] >> 29) ^ i)
                    .wrapping_mul(0xBF58_476D_1CE4_E5B9);
            }
        }
        self.lanes = core::hint::black_box(l);
        SYSCALL_PER_ROUND
    }

    /// tlbwalk round 0: one sealed word at every access position (maps
    /// every page), or under [`nl_abi::TLBWALK_FETCHES`] the fetch chain's
    /// code. Ops = pages.
    fn tlbwalk_warm_up(&mut self) -> u64 {
        let (n, step) = (self.hot_words, self.stride);
        if self.pattern == nl_abi::TLBWALK_FETCHES {
            let mut sum = 0u64;
            for i in 0..n {
                let (code, imm) = fetch_chain_point(self.seed, i as u64, n as u64);
                if let Some(w) = self.mem.get_mut(i * step..i * step + 2) {
                    w.copy_from_slice(&code);
                }
                sum = sum.wrapping_add(u64::from(imm));
            }
            // What one call adds to its argument (kept where the load
            // walk's nothing is: the lanes).
            self.lanes[0] = sum;
            return n as u64;
        }
        for i in 0..n {
            let h = mix64(self.seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            if let Some(w) = self.mem.get_mut(i * step) {
                *w = seal(h);
            }
        }
        n as u64
    }

    /// tlbwalk: whole passes over the pages, one 8-byte load per page at a
    /// `TLBWALK_STRIDE`-byte stride, each checked against its seal.
    fn tlbwalk_round<P: Platform>(&mut self, p: &mut P) -> u64 {
        let (n, step) = (self.hot_words, self.stride);
        let passes = self.ops_per_round / n as u64;
        let (mut d, mut bad) = (self.digest, 0);
        if self.pattern == nl_abi::TLBWALK_FETCHES {
            // One call runs the chain: one fetch per page, each checked by
            // the sum of the immediates it added.
            for k in 0..passes {
                let arg = fold(d, k);
                match p.run_code(self.mem, arg) {
                    Some(r) => {
                        bad += u64::from(r != arg.wrapping_add(self.lanes[0]));
                        d = fold(d, r);
                    }
                    None => bad += 1,
                }
            }
            self.digest = d;
            self.mismatches += bad;
            return self.ops_per_round;
        }
        for _ in 0..passes {
            let mut acc = 0u64;
            for i in 0..n {
                let w = self.mem.get(i * step).copied().unwrap_or(0);
                bad += u64::from(!sealed_ok(w));
                acc = acc.wrapping_add(w).rotate_left(1);
            }
            d = fold(d, acc);
        }
        self.digest = d;
        self.mismatches += bad;
        self.ops_per_round
    }

    fn exits_round<P: Platform>(&mut self, p: &mut P) -> u64 {
        let (mut rng, mut d, mut bad) = (self.rng, self.digest, 0);
        for _ in 0..EXITS_PORT_PER_ROUND.max(EXITS_MMIO_PER_ROUND) {
            let v = wyrand(&mut rng);
            let a = p.port_echo(v as u32);
            bad += u64::from(a != !(v as u32));
            d = fold(d, u64::from(a));
            let b = p.mmio_echo(v.rotate_left(32) ^ self.rounds);
            bad += u64::from(b != v.rotate_left(32) ^ self.rounds);
            d = fold(d, b);
        }
        let mut ops = EXITS_PORT_PER_ROUND + EXITS_MMIO_PER_ROUND;
        if self.rounds % EXITS_HALT_EVERY == EXITS_HALT_EVERY - 1 {
            p.halt();
            ops += 1;
        }
        (self.rng, self.digest) = (rng, d);
        self.mismatches += bad;
        ops
    }
}

/// The read/write mix of memwrite, kept in registers during a round.
struct Mix {
    /// Reads whose word failed its self-check (a corrupted word).
    bad: u64,
    /// Accumulator: an access is a write when adding `pct` carries past 100,
    /// so exactly `pct` of every 100 consecutive accesses are writes, evenly
    /// spread (a pattern the branch predictor can follow, unlike a coin flip).
    acc: u64,
    pct: u64,
    /// Last value written.
    v: u64,
    /// Running digest.
    d: u64,
}

impl Mix {
    /// One memwrite access to `w`: a write of the next value (never 0), or a
    /// read folded into the digest.
    #[inline(always)]
    fn access(&mut self, w: &mut u64) {
        self.acc += self.pct;
        if self.acc >= 100 {
            self.acc -= 100;
            self.v = self.v.wrapping_add(0x9E37_79B9_7F4A_7C15);
            *w = seal(self.v);
        } else {
            let x = *w;
            self.d = fold(self.d, x);
            self.bad += u64::from(!sealed_ok(x));
        }
    }
}

/// A memwrite word: the high half carries the value, the low half a check of
/// it (odd, so a written word is never 0). Any bit flip in a word breaks the
/// check, so corrupted memory is detected when the word is next read.
#[inline(always)]
fn seal(v: u64) -> u64 {
    let hi = (v >> 32) as u32;
    (u64::from(hi) << 32) | u64::from(check32(hi))
}

#[inline(always)]
fn check32(hi: u32) -> u32 {
    (hi.wrapping_mul(0x9E37_79B1) ^ 0x7F4A_7C15) | 1
}

/// Whether a word read from the working set is 0 (never written) or sealed.
#[inline(always)]
fn sealed_ok(x: u64) -> bool {
    x == 0 || x as u32 == check32((x >> 32) as u32)
}

/// Maps a 32-bit value uniformly onto 0..100.
#[inline(always)]
fn pct_of(x32: u64) -> u64 {
    (x32 * 100) >> 32
}

/// Maps `r` onto 0..n (Lemire's multiply-shift; no division).
#[inline(always)]
fn below(r: u64, n: usize) -> usize {
    ((u128::from(r) * n as u128) >> 64) as usize
}

/// wyrand: a fast 64-bit PRNG (one 64x64->128 multiply per output).
#[inline(always)]
fn wyrand(s: &mut u64) -> u64 {
    *s = s.wrapping_add(0xA076_1D64_78BD_642F);
    let t = u128::from(*s) * u128::from(*s ^ 0xE703_7ED1_A0B4_28DB);
    (t >> 64) as u64 ^ t as u64
}

/// Folds `v` into the running hash `d`: a bijection of `d` for a fixed `v`
/// and of `v` for a fixed `d`, so any single changed input changes `d`.
#[inline(always)]
fn fold(d: u64, v: u64) -> u64 {
    (d ^ v).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(23)
}

/// The splitmix64 finalizer.
#[inline]
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Order-sensitive hash of the whole working set, eight lanes wide.
fn sweep(mem: &[u64]) -> u64 {
    let mut a = [0u64; 8];
    for (i, l) in a.iter_mut().enumerate() {
        *l = mix64(i as u64 + 1);
    }
    let mut chunks = mem.chunks_exact(8);
    for c in &mut chunks {
        for (l, w) in a.iter_mut().zip(c) {
            *l = fold(*l, *w);
        }
    }
    let mut h = mix64(mem.len() as u64);
    for w in chunks.remainder() {
        h = fold(h, *w);
    }
    for l in a {
        h = fold(h, l);
    }
    mix64(h)
}
