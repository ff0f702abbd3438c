//! Sandbox channels: records over shared memory, one output region per end.
//!
//! A channel joins two sandboxes. Its memory (one memfd on the host) holds
//! two *output regions*, one per end. Each end writes only its own region
//! and maps the peer's read-only, so neither side can corrupt what the other
//! has written; a misbehaving peer can only corrupt its own output, and a
//! receiver checks everything it reads from there.
//!
//! This module is the one implementation both sides use: the guest's ring-3
//! workloads over the channel windows named in the boot info, and the host
//! (unit tests here, native baselines in the bench) over ordinary memory. It
//! works on `&[AtomicU64]`: shared memory another agent writes concurrently,
//! read and written word by word. The only `unsafe` here is the call of the
//! SSE4.2 CRC after CPUID said the CPU has it ("The record CRC" below).
//!
//! # Region layout (64-bit words)
//!
//! | word | field | written by |
//! |---|---|---|
//! | 0 | [`MAGIC`] | the owner, at [`Endpoint::new`] |
//! | 1 | generation: nonzero, new each time the owner (re)starts | owner |
//! | 2 | head: word position (monotonic) up to which records are published | owner's sender |
//! | 3 | ack generation: the peer generation `ack` refers to | owner's receiver |
//! | 4 | ack: word position consumed in the peer's stream | owner's receiver |
//! | 5 | records delivered from the peer ([`RecvStats::received`]) | owner's receiver |
//! | 6 | records rejected from the peer ([`RecvStats::rejected`]) | owner's receiver |
//! | 7 | the owner's workload's verdict on what it was delivered ([`Endpoint::report`]; chanstream: `nl_workloads::chanstream::pack`) | owner's workload |
//! | 8 | flags: [`HELD`] (the owner's output is held, below) | the host |
//! | 9, 10 | released generation and head | the host's checkpoint supervisor |
//! | 11, 12 | released ack generation and ack | the host's checkpoint supervisor |
//! | 13..16 | reserved (0) | |
//! | 16.. | ring of records | owner's sender |
//!
//! A record starts on a word: word 0 = `len | crc << 32`, word 1 = sequence
//! number (0, 1, 2, ... per generation), then `ceil(len / 8)` payload words
//! (little-endian bytes). The CRC ([`record_crc`], CRC-32C) covers `len`
//! (4 bytes LE), the sequence number (8 bytes LE) and the payload. A record
//! never wraps: when it does not fit before the end of the ring, the sender
//! writes [`PAD`] and continues at ring offset 0.
//!
//! # The record CRC
//!
//! CRC-32C (Castagnoli; [`crc32c`]), computed with the SSE4.2 `crc32`
//! instruction when CPUID leaf 1 says the CPU has it
//! ([`crc32c_in_hardware`], asked once), else with portable slice-by-8
//! tables; both give the same value, so a host and a guest (or two CPUs)
//! always agree. The guest is built for baseline x86-64 (its ring 0 is
//! emulated on PVM and must not meet SSE4 or AVX), so a compile-time choice
//! would give the guest the tables: the CRC was what held its streaming to
//! about 1 GB/s (docs/sandboxes.md, Fig. 9). The instruction works on
//! general-purpose registers only, so it needs no vector state, and it runs
//! only in guest ring 3 (natively, on PVM) or on the host: the guest kernel
//! does not link this crate. The reference guest's vCPUs see KVM's supported
//! CPUID unmasked (`nl_arch::regs::vcpu_cpuid`), so a host with SSE4.2 shows
//! it to guest ring 3; a guest without it computes the same CRC in tables.
//!
//! # What the receiver checks
//!
//! Everything it reads from the peer's region: a head that ran more than a
//! ring ahead (bad header), a length that runs past the published data or
//! the region (bad length), a sequence number other than the next one (bad
//! sequence: stale or missing), a CRC mismatch (bad CRC; the payload is
//! copied out first and the CRC checked on the copy). A bad record is
//! counted in [`RecvStats`] and skipped; when its length cannot be trusted
//! the receiver resynchronises at the peer's head. It never panics and never
//! indexes outside the slices it was given. When the peer's generation
//! changes (the peer restarted), the receiver starts over at the beginning
//! of the new stream and counts a resync.
//!
//! # Held output (a sandbox under `rollback` with output commit)
//!
//! A sandbox rolled back to a checkpoint must not have published anything
//! the rollback undoes: its guest's sender state (head, next sequence
//! number) and receiver state (what it consumed) go back with its RAM, the
//! region does not. So when the host sets [`HELD`] in a region, what its
//! peer sees of it is only what the host's checkpoint supervisor
//! *released* (by the same rule as the sandbox's network output):
//!
//! * the peer's receiver reads the owner's records up to
//!   min(head, released head), and only while the region's generation is
//!   the released generation;
//! * the peer's sender takes the released acknowledgement (generation and
//!   position) as what the owner consumed, so it never reuses ring space
//!   the owner may re-read after a rollback.
//!
//! The supervisor records each region's owner words ([`HeaderSnapshot`],
//! words 0..8) at every checkpoint with the VM paused, publishes a
//! checkpoint's words once its output may leave ([`release`]) and, on a
//! rollback to checkpoint `j`, writes `j`'s words back ([`restore`]), so
//! the region agrees with the guest's restored RAM; records past `j`'s head
//! were never visible and re-execution rewrites them. A region without
//! [`HELD`] (every sandbox not under `rollback` with output commit) is read
//! as before. The released words are checked like everything else read
//! from a peer: a torn or garbage released view is counted or skipped,
//! never trusted past the ring.
//!
//! Words 5..8 are this end's receive report on the channel (zero at each
//! [`Endpoint::new`]): published in its own region, so the host reads each
//! channel's counters separately and without any exit of the VM, and only
//! this end can write them (a faulty peer cannot forge them).

use core::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use core::sync::atomic::{fence, AtomicU64};

/// Region word 0 of an initialised region: "9LCHAN01".
pub const MAGIC: u64 = u64::from_le_bytes(*b"9LCHAN01");
/// Header words before the ring.
pub const HEADER_WORDS: usize = 16;
/// Header words the owner writes (and a checkpoint records): 0..8.
pub const OWNER_WORDS: usize = 8;
pub(crate) const W_MAGIC: usize = 0;
pub(crate) const W_GEN: usize = 1;
pub(crate) const W_HEAD: usize = 2;
const W_ACK_GEN: usize = 3;
const W_ACK: usize = 4;
/// Header word: flags set by the host ([`HELD`]).
pub const W_FLAGS: usize = 8;
/// Header words: the released generation and head (see "Held output").
pub const W_REL_GEN: usize = 9;
pub const W_REL_HEAD: usize = 10;
/// Header words: the released acknowledgement generation and position.
pub const W_REL_ACK_GEN: usize = 11;
pub const W_REL_ACK: usize = 12;
/// [`W_FLAGS`] bit: the owner's output is held; peers read the released
/// words.
pub const HELD: u64 = 1;
/// Header word: records this end's receiver delivered (the host reads it).
pub const W_DELIVERED: usize = 5;
/// Header word: records this end's receiver rejected.
pub const W_REJECTED: usize = 6;
/// Header word: the owner's workload's verdict ([`Endpoint::report`]).
pub const W_VERDICT: usize = 7;
/// Record word 0 of padding up to the end of the ring.
pub const PAD: u64 = u64::MAX;
/// Words of a record before its payload.
pub const RECORD_HEADER_WORDS: usize = 2;
/// Smallest ring (words) an endpoint accepts.
pub const MIN_RING_WORDS: usize = 64;

/// Payload words of a `len`-byte record.
pub const fn payload_words(len: usize) -> usize {
    len.div_ceil(8)
}

/// Ring words a `len`-byte record takes.
pub const fn record_words(len: usize) -> usize {
    RECORD_HEADER_WORDS + payload_words(len)
}

/// The largest payload a region of `region_words` words carries (half its
/// ring, so a record always fits after at most one pad).
pub const fn max_payload(region_words: usize) -> usize {
    let ring = region_words.saturating_sub(HEADER_WORDS);
    (ring / 2).saturating_sub(RECORD_HEADER_WORDS) * 8
}

/// Why a send did not happen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendError {
    /// The peer has not consumed enough yet: try again later.
    Full,
    /// The payload is larger than [`max_payload`] of this region.
    TooLarge,
}

/// Counters of a receiver. Every record read from the peer's region ends
/// in exactly one of `received`, `bad_*` or `too_long`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecvStats {
    /// Records delivered.
    pub received: u64,
    /// Payload bytes delivered.
    pub bytes: u64,
    /// The peer's head ran more than a ring ahead or went backwards.
    pub bad_header: u64,
    /// A record whose length runs past the published data or the region.
    pub bad_length: u64,
    /// A record whose sequence number was not the next one (stale or ahead).
    pub bad_seq: u64,
    /// A record whose CRC did not match.
    pub bad_crc: u64,
    /// A well-formed record larger than the caller's buffer (skipped).
    pub too_long: u64,
    /// Times the receiver started over: a new peer generation, or after a
    /// record whose length could not be trusted.
    pub resyncs: u64,
}

impl RecvStats {
    /// Records rejected for any reason.
    pub fn rejected(&self) -> u64 {
        self.bad_header + self.bad_length + self.bad_seq + self.bad_crc + self.too_long
    }
}

/// CRC-32C of a record: length (4 bytes LE), sequence number (8 bytes
/// LE), payload. See "The record CRC" in the module docs.
pub fn record_crc(len: u32, seq: u64, payload: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if crc32c_in_hardware() {
        #[allow(unsafe_code)]
        // SAFETY: `crc32c_in_hardware` saw CPUID.1:ECX.SSE4_2, so the CPU
        // executes the `crc32` instruction `record_crc_sse42` is compiled to.
        return unsafe { record_crc_sse42(len, seq, payload) };
    }
    record_crc_portable(len, seq, payload)
}

/// CRC-32C (Castagnoli) of `data`: initial value and final XOR all ones,
/// reflected polynomial [`CRC32C_POLY`]. The same value on every CPU:
/// [`crc32c_in_hardware`] only decides how it is computed.
pub fn crc32c(data: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if crc32c_in_hardware() {
        #[allow(unsafe_code)]
        // SAFETY: as in `record_crc`.
        return !unsafe { crc32c_sse42(!0, data) };
    }
    !crc32c_portable(!0, data)
}

/// The reflected CRC-32C polynomial (0x1EDC6F41 bit-reversed).
pub const CRC32C_POLY: u32 = 0x82F6_3B78;

/// Whether this CPU computes CRC-32C with the SSE4.2 `crc32` instruction
/// (CPUID leaf 1, ECX bit 20), asked once and remembered. Only ring-3 code
/// and the host call it: the guest kernel does not link this crate (ring 0
/// is emulated on PVM and must not meet SSE4.2 instructions).
pub fn crc32c_in_hardware() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use core::sync::atomic::AtomicU8;
        // 0: not asked yet; 1: no; 2: yes.
        static SSE42: AtomicU8 = AtomicU8::new(0);
        match SSE42.load(Relaxed) {
            1 => false,
            2 => true,
            _ => {
                // An `unsafe` call on older compilers (the workspace's
                // minimum is 1.87), a safe one on newer ones.
                #[allow(unsafe_code, unused_unsafe)]
                // SAFETY: CPUID exists on every x86-64 CPU; leaf 1 reads
                // feature bits and has no other effect.
                let leaf1 = unsafe { core::arch::x86_64::__cpuid(1) };
                let yes = leaf1.ecx & (1 << 20) != 0;
                SSE42.store(if yes { 2 } else { 1 }, Relaxed);
                yes
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Slice-by-8 tables of the portable CRC-32C: `T[k][b]` is the CRC of byte
/// `b` followed by `k` zero bytes.
static CRC32C_TABLES: [[u32; 256]; 8] = crc32c_tables();

const fn crc32c_tables() -> [[u32; 256]; 8] {
    let mut t = [[0u32; 256]; 8];
    let mut b = 0;
    while b < 256 {
        let mut c = b as u32;
        let mut i = 0;
        while i < 8 {
            c = if c & 1 != 0 { (c >> 1) ^ CRC32C_POLY } else { c >> 1 };
            i += 1;
        }
        t[0][b] = c;
        b += 1;
    }
    let mut k = 1;
    while k < 8 {
        let mut b = 0;
        while b < 256 {
            let prev = t[k - 1][b];
            t[k][b] = (prev >> 8) ^ t[0][(prev & 0xff) as usize];
            b += 1;
        }
        k += 1;
    }
    t
}

/// The CRC-32C register after `data`, from register `crc` (no inversion
/// here: the callers invert at the start and the end), in portable code.
fn crc32c_portable(mut crc: u32, data: &[u8]) -> u32 {
    let t = &CRC32C_TABLES;
    let mut words = data.chunks_exact(8);
    for w in &mut words {
        let mut b = [0u8; 8];
        b.copy_from_slice(w);
        let lo = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) ^ crc;
        let hi = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        crc = t[7][(lo & 0xff) as usize]
            ^ t[6][((lo >> 8) & 0xff) as usize]
            ^ t[5][((lo >> 16) & 0xff) as usize]
            ^ t[4][(lo >> 24) as usize]
            ^ t[3][(hi & 0xff) as usize]
            ^ t[2][((hi >> 8) & 0xff) as usize]
            ^ t[1][((hi >> 16) & 0xff) as usize]
            ^ t[0][(hi >> 24) as usize];
    }
    for &b in words.remainder() {
        crc = (crc >> 8) ^ t[0][((crc ^ u32::from(b)) & 0xff) as usize];
    }
    crc
}

fn record_crc_portable(len: u32, seq: u64, payload: &[u8]) -> u32 {
    let c = crc32c_portable(!0, &len.to_le_bytes());
    let c = crc32c_portable(c, &seq.to_le_bytes());
    !crc32c_portable(c, payload)
}

/// [`crc32c_portable`] with the SSE4.2 `crc32` instruction: eight bytes per
/// instruction, general-purpose registers only (no vector state).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
fn crc32c_sse42(crc: u32, data: &[u8]) -> u32 {
    use core::arch::x86_64::{_mm_crc32_u64, _mm_crc32_u8};
    let mut c = u64::from(crc);
    let mut words = data.chunks_exact(8);
    for w in &mut words {
        let mut b = [0u8; 8];
        b.copy_from_slice(w);
        c = _mm_crc32_u64(c, u64::from_le_bytes(b));
    }
    let mut c = c as u32;
    for &b in words.remainder() {
        c = _mm_crc32_u8(c, b);
    }
    c
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
fn record_crc_sse42(len: u32, seq: u64, payload: &[u8]) -> u32 {
    use core::arch::x86_64::{_mm_crc32_u32, _mm_crc32_u64};
    let c = _mm_crc32_u32(!0, len);
    let c = _mm_crc32_u64(u64::from(c), seq) as u32;
    !crc32c_sse42(c, payload)
}

/// One end of a channel: sends into its own region, receives from the
/// peer's (read-only to it). Its state lives in its owner's memory (a
/// guest's RAM: a rollback takes it back with the RAM; `Clone` is what the
/// tests use for that).
#[derive(Clone)]
pub struct Endpoint<'a> {
    own: &'a [AtomicU64],
    peer: &'a [AtomicU64],
    /// This end's generation (nonzero).
    gen: u64,
    /// Sender: word position of the next record, and its sequence number.
    head: u64,
    seq: u64,
    /// Receiver: the peer generation being read (0: none yet), the word
    /// position and sequence number of the next record.
    peer_gen: u64,
    pos: u64,
    next_seq: u64,
    stats: RecvStats,
}

impl<'a> Endpoint<'a> {
    /// Initialises this end's region (`own`) with generation `gen` (nonzero,
    /// different from the previous one after a restart) and attaches to the
    /// peer's region. The peer's region is only ever read.
    pub fn new(
        own: &'a [AtomicU64],
        peer: &'a [AtomicU64],
        gen: u64,
    ) -> Result<Self, &'static str> {
        if gen == 0 {
            return Err("channel: the generation must be nonzero");
        }
        if own.len() < HEADER_WORDS + MIN_RING_WORDS || peer.len() < HEADER_WORDS + MIN_RING_WORDS {
            return Err("channel: a region is smaller than its header plus the smallest ring");
        }
        // Withdraw the old generation first, so the peer never sees the new
        // generation with the old head.
        own[W_GEN].store(0, Release);
        // Every later store (this generation's records too) is ordered
        // after the withdrawal for a reader that sees it ([`Endpoint::recv`]
        // re-reads the generation after reading a record).
        fence(Release);
        own[W_HEAD].store(0, Relaxed);
        own[W_ACK_GEN].store(0, Relaxed);
        own[W_ACK].store(0, Relaxed);
        // Its receive report; the host's words (8..) are not the owner's.
        for w in &own[W_ACK + 1..OWNER_WORDS] {
            w.store(0, Relaxed);
        }
        own[W_MAGIC].store(MAGIC, Relaxed);
        own[W_GEN].store(gen, Release);
        Ok(Self {
            own,
            peer,
            gen,
            head: 0,
            seq: 0,
            peer_gen: 0,
            pos: 0,
            next_seq: 0,
            stats: RecvStats::default(),
        })
    }

    /// [`Endpoint::new`] for an end that restarts while its peer runs on:
    /// when this end's region still acknowledges the peer's current
    /// generation (the host kept the acknowledgement words, see
    /// [`withdraw`]), the receiver resumes at that position instead of the
    /// beginning of the peer's stream, so it neither re-reads records the
    /// peer has since overwritten nor stalls the peer's sender. Without such
    /// an acknowledgement (a first start) it is [`Endpoint::new`].
    pub fn rejoin(
        own: &'a [AtomicU64],
        peer: &'a [AtomicU64],
        gen: u64,
    ) -> Result<Self, &'static str> {
        let ack_gen = own.get(W_ACK_GEN).map_or(0, |w| w.load(Acquire));
        let ack = own.get(W_ACK).map_or(0, |w| w.load(Acquire));
        let mut ep = Self::new(own, peer, gen)?;
        let peer_gen = peer[W_GEN].load(Acquire);
        let head = peer[W_HEAD].load(Acquire);
        if ack_gen != 0
            && ack_gen == peer_gen
            && peer[W_MAGIC].load(Relaxed) == MAGIC
            && ack <= head
            && head - ack <= Self::ring_words(peer)
        {
            ep.peer_gen = peer_gen;
            ep.pos = ack;
            // The next record's sequence number is taken as it comes.
            ep.next_seq = u64::MAX;
            ep.ack();
        }
        Ok(ep)
    }

    fn ring_words(r: &[AtomicU64]) -> u64 {
        (r.len() - HEADER_WORDS) as u64
    }

    /// The largest payload this end can send.
    pub fn max_payload(&self) -> usize {
        max_payload(self.own.len())
    }

    /// This end's generation.
    pub fn generation(&self) -> u64 {
        self.gen
    }

    /// The receiver's counters.
    pub fn stats(&self) -> RecvStats {
        self.stats
    }

    /// The peer's head word (it changes whenever the peer publishes): what
    /// a receiver that halts instead of polling waits on.
    pub fn peer_head(&self) -> &AtomicU64 {
        &self.peer[W_HEAD]
    }

    /// Records sent so far in this generation.
    pub fn sent(&self) -> u64 {
        self.seq
    }

    /// Words of this end's ring the peer has not consumed yet, or `None`
    /// when its acknowledgement cannot be trusted (then nothing is sent).
    fn in_flight(&self) -> Option<u64> {
        let (ack_gen, ack) = peer_ack(self.peer)?;
        // A peer that has not acknowledged this generation yet has consumed
        // nothing of it.
        let ack = if ack_gen == self.gen { ack } else { 0 };
        let used = self.head.checked_sub(ack)?;
        (used <= Self::ring_words(self.own)).then_some(used)
    }

    /// Sends one record. Never blocks: [`SendError::Full`] when the peer is
    /// behind.
    pub fn send(&mut self, payload: &[u8]) -> Result<(), SendError> {
        let len = payload.len();
        if len > self.max_payload() {
            return Err(SendError::TooLarge);
        }
        let n = Self::ring_words(self.own);
        let words = record_words(len) as u64;
        let off = self.head % n;
        let pad = if off + words > n { n - off } else { 0 };
        let used = self.in_flight().ok_or(SendError::Full)?;
        if n - used < pad + words {
            return Err(SendError::Full);
        }
        let ring = &self.own[HEADER_WORDS..];
        let mut at = off as usize;
        if pad > 0 {
            ring[at].store(PAD, Relaxed);
            at = 0;
        }
        let body = &ring[at + RECORD_HEADER_WORDS..at + words as usize];
        let mut chunks = payload.chunks_exact(8);
        for (w, c) in body.iter().zip(&mut chunks) {
            let mut b = [0u8; 8];
            b.copy_from_slice(c);
            w.store(u64::from_le_bytes(b), Relaxed);
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut b = [0u8; 8];
            b[..rest.len()].copy_from_slice(rest);
            body[body.len() - 1].store(u64::from_le_bytes(b), Relaxed);
        }
        let crc = record_crc(len as u32, self.seq, payload);
        ring[at].store(len as u64 | (u64::from(crc) << 32), Relaxed);
        ring[at + 1].store(self.seq, Relaxed);
        self.head += pad + words;
        self.seq += 1;
        self.own[W_HEAD].store(self.head, Release);
        Ok(())
    }

    /// Whether the peer's generation is no longer `gen`: what was read
    /// since `gen` was read may be torn by a withdrawal or a restart, and is
    /// dropped, never counted as a bad record (pairs with the `Release`
    /// fences in [`Endpoint::new`] and [`withdraw`]).
    fn peer_moved(&self, gen: u64) -> bool {
        fence(Acquire);
        self.peer[W_GEN].load(Relaxed) != gen
            || (is_held(self.peer) && self.peer[W_REL_GEN].load(Relaxed) != gen)
    }

    fn resync(&mut self, head: u64) {
        self.pos = head;
        self.stats.resyncs += 1;
        // The next record's sequence number is taken as it comes.
        self.next_seq = u64::MAX;
        self.ack();
    }

    fn ack(&self) {
        self.own[W_ACK_GEN].store(self.peer_gen, Relaxed);
        self.own[W_ACK].store(self.pos, Release);
    }

    /// Publishes the receiver's counters in this end's header.
    fn publish(&self) {
        self.own[W_DELIVERED].store(self.stats.received, Relaxed);
        self.own[W_REJECTED].store(self.stats.rejected(), Relaxed);
    }

    /// Publishes the workload's verdict on what this end was delivered
    /// (header word 7; a workload-defined encoding, 0 = nothing wrong).
    pub fn report(&self, verdict: u64) {
        self.own[W_VERDICT].store(verdict, Relaxed);
    }

    /// Receives the next good record into `buf` and returns its length, or
    /// `None` when nothing (more) is published. Bad records on the way are
    /// counted and skipped.
    pub fn recv(&mut self, buf: &mut [u8]) -> Option<usize> {
        let r = self.recv_one(buf);
        self.publish();
        r
    }

    fn recv_one(&mut self, buf: &mut [u8]) -> Option<usize> {
        // Each pass consumes at least one record or returns; a ring holds at
        // most `n / 2` records, so this bounds the work of one call.
        let n = Self::ring_words(self.peer);
        for _ in 0..n {
            let gen = self.peer[W_GEN].load(Acquire);
            if gen == 0 || self.peer[W_MAGIC].load(Relaxed) != MAGIC {
                return None;
            }
            // Held output: only the released generation is read; a newer
            // one (not released yet) or an older one (a rollback restored
            // it, the release follows) is waited for.
            if is_held(self.peer) && self.peer[W_REL_GEN].load(Acquire) != gen {
                return None;
            }
            if gen != self.peer_gen {
                if self.peer_gen != 0 {
                    self.stats.resyncs += 1;
                }
                self.peer_gen = gen;
                self.pos = 0;
                self.next_seq = 0;
                self.ack();
            }
            let head = published_head(self.peer);
            if self.peer_moved(gen) {
                continue;
            }
            if head == self.pos {
                return None;
            }
            if head < self.pos || head - self.pos > n {
                self.stats.bad_header += 1;
                self.resync(head);
                continue;
            }
            let ring = &self.peer[HEADER_WORDS..];
            let off = self.pos % n;
            let w0 = ring[off as usize].load(Relaxed);
            if w0 == PAD {
                if self.peer_moved(gen) {
                    continue;
                }
                if self.pos + (n - off) > head {
                    self.stats.bad_length += 1;
                    self.resync(head);
                } else {
                    self.pos += n - off;
                    self.ack();
                }
                continue;
            }
            let len = (w0 & 0xffff_ffff) as usize;
            let crc = (w0 >> 32) as u32;
            let words = record_words(len) as u64;
            if off + words > n || self.pos + words > head {
                if self.peer_moved(gen) {
                    continue;
                }
                self.stats.bad_length += 1;
                self.resync(head);
                continue;
            }
            let seq = ring[off as usize + 1].load(Relaxed);
            if self.next_seq != u64::MAX && seq != self.next_seq {
                if self.peer_moved(gen) {
                    continue;
                }
                self.stats.bad_seq += 1;
                self.resync(head);
                continue;
            }
            let start = off as usize + RECORD_HEADER_WORDS;
            let body = &ring[start..start + payload_words(len)];
            if len > buf.len() && self.peer_moved(gen) {
                continue;
            }
            self.pos += words;
            self.next_seq = seq.wrapping_add(1);
            if len > buf.len() {
                self.stats.too_long += 1;
                self.ack();
                continue;
            }
            let out = &mut buf[..len];
            let mut chunks = out.chunks_exact_mut(8);
            for (c, w) in (&mut chunks).zip(body) {
                c.copy_from_slice(&w.load(Relaxed).to_le_bytes());
            }
            let rest = chunks.into_remainder();
            if !rest.is_empty() {
                let last = body[body.len() - 1].load(Relaxed).to_le_bytes();
                let k = rest.len();
                rest.copy_from_slice(&last[..k]);
            }
            if self.peer_moved(gen) {
                // Read while the peer was withdrawn or restarted: its words
                // may be half old, half cleared or new. Not a record.
                continue;
            }
            self.ack();
            if record_crc(len as u32, seq, out) != crc {
                self.stats.bad_crc += 1;
                continue;
            }
            self.stats.received += 1;
            self.stats.bytes += len as u64;
            return Some(len);
        }
        None
    }
}

/// Whether the host holds region `r`'s output ([`HELD`]).
fn is_held(r: &[AtomicU64]) -> bool {
    r[W_FLAGS].load(Acquire) & HELD != 0
}

/// The head a reader of region `r` may read up to: the owner's head, and
/// with held output at most the released head (the caller checks the
/// released generation before and after).
fn published_head(r: &[AtomicU64]) -> u64 {
    let head = r[W_HEAD].load(Acquire);
    if is_held(r) {
        head.min(r[W_REL_HEAD].load(Acquire))
    } else {
        head
    }
}

/// What region `r`'s owner has consumed of its peer's stream: (the peer
/// generation it refers to, word position); with held output, the
/// released acknowledgement, or `None` when it changed while read.
fn peer_ack(r: &[AtomicU64]) -> Option<(u64, u64)> {
    if !is_held(r) {
        return Some((r[W_ACK_GEN].load(Acquire), r[W_ACK].load(Acquire)));
    }
    let gen = r[W_REL_ACK_GEN].load(Acquire);
    let ack = r[W_REL_ACK].load(Acquire);
    fence(Acquire);
    (r[W_REL_ACK_GEN].load(Relaxed) == gen).then_some((gen, ack))
}

/// A region's header words as the host's checkpoint supervisor reads and
/// writes them: host memory as atomics, or a VMM's mapping of the
/// channel's memfd. Loads acquire, stores release.
pub trait HeaderWords: Send + Sync {
    fn load(&self, word: usize) -> u64;
    fn store(&self, word: usize, value: u64);
}

impl HeaderWords for [AtomicU64] {
    fn load(&self, word: usize) -> u64 {
        self.get(word).map_or(0, |w| w.load(Acquire))
    }
    fn store(&self, word: usize, value: u64) {
        if let Some(w) = self.get(word) {
            w.store(value, Release);
        }
    }
}

/// The owner's header words (0..[`OWNER_WORDS`]) of a region at a
/// checkpoint, taken with the owner's vCPUs paused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HeaderSnapshot {
    pub words: [u64; OWNER_WORDS],
}

impl HeaderSnapshot {
    /// The owner's generation then (0: not initialised).
    pub fn generation(&self) -> u64 {
        if self.words[W_MAGIC] == MAGIC {
            self.words[W_GEN]
        } else {
            0
        }
    }

    /// The owner's head then.
    pub fn head(&self) -> u64 {
        self.words[W_HEAD]
    }
}

/// Holds region `r`'s output from now on (before its owner runs): nothing
/// is released yet, so its peer reads none of its records and reuses none
/// of its own ring space until [`release`].
pub fn hold(r: &(impl HeaderWords + ?Sized)) {
    r.store(W_REL_GEN, 0);
    r.store(W_REL_ACK_GEN, 0);
    fence(Release);
    r.store(W_REL_HEAD, 0);
    r.store(W_REL_ACK, 0);
    r.store(W_FLAGS, HELD);
}

/// Region `r`'s owner words now (its owner paused).
pub fn snapshot(r: &(impl HeaderWords + ?Sized)) -> HeaderSnapshot {
    let mut s = HeaderSnapshot::default();
    for (i, w) in s.words.iter_mut().enumerate() {
        *w = r.load(i);
    }
    s
}

/// Publishes `s` (a checkpoint's words) as region `r`'s released view:
/// its peer reads its records up to `s`'s head and reuses its ring up to
/// `s`'s acknowledgement. A generation that changes is withdrawn first,
/// so no reader pairs a new generation with an old position.
pub fn release(r: &(impl HeaderWords + ?Sized), s: &HeaderSnapshot) {
    let pairs = [
        (W_REL_GEN, W_REL_HEAD, s.generation(), s.head()),
        (W_REL_ACK_GEN, W_REL_ACK, s.words[W_ACK_GEN], s.words[W_ACK]),
    ];
    for (w_gen, w_pos, gen, pos) in pairs {
        if r.load(w_gen) != gen {
            r.store(w_gen, 0);
            fence(Release);
        }
        r.store(w_pos, pos);
        r.store(w_gen, gen);
    }
}

/// The released view of region `r`: (generation, head, ack generation,
/// ack).
pub fn released(r: &(impl HeaderWords + ?Sized)) -> [u64; 4] {
    [W_REL_GEN, W_REL_HEAD, W_REL_ACK_GEN, W_REL_ACK].map(|w| r.load(w))
}

/// Writes `s` (the words of the checkpoint a rollback goes back to) over
/// region `r`'s owner words, its owner halted: the region agrees with the
/// owner's restored RAM again. The generation is withdrawn first, so a
/// reader drops what it read meanwhile. When the owner had not initialised
/// its end at that checkpoint (it will [`Endpoint::rejoin`]), the
/// acknowledgement words are the released ones: the peer's stream is
/// intact from there on.
pub fn restore(r: &(impl HeaderWords + ?Sized), s: &HeaderSnapshot) {
    r.store(W_GEN, 0);
    fence(Release);
    let mut words = s.words;
    if s.generation() == 0 {
        words[W_ACK_GEN] = r.load(W_REL_ACK_GEN);
        words[W_ACK] = r.load(W_REL_ACK);
    }
    for (i, w) in words.iter().enumerate().skip(W_HEAD) {
        r.store(i, *w);
    }
    r.store(W_MAGIC, words[W_MAGIC]);
    r.store(W_GEN, words[W_GEN]);
}

/// Withdraws a region whose writer has stopped (the host does this when it
/// restarts a sandbox): generation 0 (readers stop reading it at once),
/// head 0 and the ring cleared. The acknowledgement words stay, so the
/// restarted writer can [`Endpoint::rejoin`] the peer's stream where it
/// left it.
pub fn withdraw(own: &[AtomicU64]) {
    if let Some(g) = own.get(W_GEN) {
        g.store(0, Release);
    }
    // Ordered before the clearing for a reader that sees a cleared word.
    fence(Release);
    if let Some(h) = own.get(W_HEAD) {
        h.store(0, Release);
    }
    for w in own.iter().skip(HEADER_WORDS) {
        w.store(0, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::vec::Vec;

    fn region(words: usize) -> Vec<AtomicU64> {
        (0..words).map(|_| AtomicU64::new(0)).collect()
    }

    fn payload(i: u64, len: usize) -> Vec<u8> {
        (0..len).map(|k| (i as u8).wrapping_mul(31).wrapping_add(k as u8)).collect()
    }

    #[test]
    fn records_of_every_size_arrive_in_order_across_many_wraps() {
        let (a, b) = (region(HEADER_WORDS + 512), region(HEADER_WORDS + 512));
        let mut x = Endpoint::new(&a, &b, 1).unwrap();
        let mut y = Endpoint::new(&b, &a, 2).unwrap();
        let mut buf = [0u8; 2048];
        let max = x.max_payload();
        assert_eq!(max, (256 - 2) * 8);
        for i in 0..5000u64 {
            let len = (i as usize * 37) % (max + 1);
            let p = payload(i, len);
            x.send(&p).unwrap();
            assert_eq!(y.recv(&mut buf), Some(len), "record {i}");
            assert_eq!(&buf[..len], &p[..]);
        }
        assert_eq!(y.recv(&mut buf), None);
        let s = y.stats();
        assert_eq!((s.received, s.rejected(), s.resyncs), (5000, 0, 0));
    }

    #[test]
    fn a_full_ring_refuses_until_the_peer_consumes() {
        let (a, b) = (region(HEADER_WORDS + 64), region(HEADER_WORDS + 64));
        let mut x = Endpoint::new(&a, &b, 1).unwrap();
        let mut y = Endpoint::new(&b, &a, 2).unwrap();
        let mut sent = 0;
        while x.send(&[7u8; 40]).is_ok() {
            sent += 1;
            assert!(sent < 100, "the ring never filled");
        }
        assert_eq!(x.send(&[7u8; 40]), Err(SendError::Full));
        assert_eq!(x.send(&[0u8; 1000]), Err(SendError::TooLarge));
        let mut buf = [0u8; 64];
        assert_eq!(y.recv(&mut buf), Some(40));
        assert!(x.send(&[7u8; 40]).is_ok(), "space freed by the ack is reused");
        let mut got = 0;
        while y.recv(&mut buf).is_some() {
            got += 1;
        }
        assert_eq!(got, sent);
    }

    /// Two ends over regions of `words` words (leaked: they live as long
    /// as the test process).
    fn pair(words: usize) -> (Endpoint<'static>, Endpoint<'static>) {
        let a: &'static [AtomicU64] = std::boxed::Box::leak(region(words).into_boxed_slice());
        let b: &'static [AtomicU64] = std::boxed::Box::leak(region(words).into_boxed_slice());
        (Endpoint::new(a, b, 1).unwrap(), Endpoint::new(b, a, 2).unwrap())
    }

    fn ring<'a>(e: &Endpoint<'a>) -> &'a [AtomicU64] {
        &e.own[HEADER_WORDS..]
    }

    #[test]
    fn a_length_past_the_region_is_rejected_and_counted() {
        let (mut x, mut y) = pair(HEADER_WORDS + 64);
        x.send(&[1u8; 16]).unwrap();
        // Claim 1 MiB: past the published data and the region.
        let w0 = ring(&x)[0].load(Relaxed);
        ring(&x)[0].store((w0 & !0xffff_ffff) | (1 << 20), Relaxed);
        let mut buf = [0u8; 64];
        assert_eq!(y.recv(&mut buf), None);
        assert_eq!(y.stats().bad_length, 1);
        assert_eq!(y.stats().received, 0);
        // The receiver resynchronised at the head: the next record arrives.
        x.send(&[2u8; 8]).unwrap();
        assert_eq!(y.recv(&mut buf), Some(8));
        assert_eq!(&buf[..8], &[2u8; 8]);
    }

    #[test]
    fn a_length_u32_max_or_a_head_past_the_ring_never_panics() {
        let (mut x, mut y) = pair(HEADER_WORDS + 64);
        x.send(&[1u8; 16]).unwrap();
        ring(&x)[0].store(0xffff_fffe, Relaxed);
        let mut buf = [0u8; 64];
        assert_eq!(y.recv(&mut buf), None);
        assert_eq!(y.stats().bad_length, 1);
        // A head a whole ring ahead, then a head that went backwards.
        x.own[W_HEAD].store(y.pos + 10_000, Release);
        assert_eq!(y.recv(&mut buf), None);
        assert_eq!(y.stats().bad_header, 1);
        x.own[W_HEAD].store(1, Release);
        assert_eq!(y.recv(&mut buf), None);
        assert_eq!(y.stats().bad_header, 2);
    }

    /// CRC-32C check values: the catalogue's "123456789" and RFC 3720
    /// (iSCSI) B.4.
    fn crc32c_vectors() -> Vec<(Vec<u8>, u32)> {
        std::vec![
            (Vec::new(), 0),
            (b"123456789".to_vec(), 0xE306_9283),
            (std::vec![0u8; 32], 0x8A91_36AA),
            (std::vec![0xffu8; 32], 0x62A8_AB43),
            ((0..32u8).collect(), 0x46DD_794E),
            ((0..32u8).rev().collect(), 0x113F_DB5C),
        ]
    }

    #[test]
    fn crc32c_gives_the_known_check_values_in_both_implementations() {
        for (data, want) in crc32c_vectors() {
            assert_eq!(!crc32c_portable(!0, &data), want, "portable, {data:?}");
            assert_eq!(crc32c(&data), want, "dispatched, {data:?}");
            #[cfg(target_arch = "x86_64")]
            if crc32c_in_hardware() {
                #[allow(unsafe_code)]
                // SAFETY: the CPU has SSE4.2 (checked just above).
                let hw = !unsafe { crc32c_sse42(!0, &data) };
                assert_eq!(hw, want, "sse4.2, {data:?}");
            }
        }
        // A record's CRC is that of its length, sequence number and payload
        // laid end to end.
        let mut r = Vec::from(9u32.to_le_bytes());
        r.extend_from_slice(&7u64.to_le_bytes());
        r.extend_from_slice(b"123456789");
        assert_eq!(record_crc(9, 7, b"123456789"), crc32c(&r));
        assert_eq!(record_crc_portable(9, 7, b"123456789"), crc32c(&r));
    }

    #[test]
    fn the_sse42_crc_equals_the_portable_one_at_every_length_and_alignment() {
        #[cfg(target_arch = "x86_64")]
        {
            if !crc32c_in_hardware() {
                std::eprintln!("no SSE4.2 on this CPU: only the portable CRC-32C runs here");
                return;
            }
            let mut x = 0x5EED_u64;
            let buf: Vec<u8> = (0..20_000)
                .map(|_| {
                    x = crate::mix64(x);
                    x as u8
                })
                .collect();
            let lens = (0..=300).chain([511, 512, 513, 4095, 4096, 4097, 16_384, 19_990]);
            for len in lens {
                for align in 0..8 {
                    let d = &buf[align..align + len];
                    #[allow(unsafe_code)]
                    // SAFETY: the CPU has SSE4.2 (checked above).
                    let (hw, rec) = unsafe {
                        (crc32c_sse42(0x1234_5678, d), record_crc_sse42(len as u32, x, d))
                    };
                    assert_eq!(hw, crc32c_portable(0x1234_5678, d), "len {len} align {align}");
                    assert_eq!(
                        rec,
                        record_crc_portable(len as u32, x, d),
                        "len {len} align {align}"
                    );
                    x = crate::mix64(x);
                }
            }
        }
    }

    #[test]
    fn a_corrupt_crc_or_tail_byte_is_rejected_and_counted_every_time() {
        // Odd lengths: the last payload word is partly padding, and its
        // bytes go through the CRC's byte-at-a-time tail.
        let (mut x, mut y) = pair(HEADER_WORDS + 4096);
        let mut buf = [0u8; 512];
        let mut bad = 0;
        for (i, len) in [1usize, 7, 13, 300, 301].into_iter().enumerate() {
            let p = payload(i as u64, len);
            // One corrupt record, then the same payload intact.
            x.send(&p).unwrap();
            let at = (x.head - record_words(len) as u64) as usize;
            let (w, bit) = if i % 2 == 0 {
                // A bit of the stored CRC.
                (&ring(&x)[at], 1u64 << 40)
            } else {
                // A bit of the payload's last byte.
                (&ring(&x)[at + record_words(len) - 1], 1u64 << (8 * ((len - 1) % 8)))
            };
            w.store(w.load(Relaxed) ^ bit, Relaxed);
            x.send(&p).unwrap();
            bad += 1;
            // The corrupt record is skipped; the next one arrives.
            assert_eq!(y.recv(&mut buf), Some(len), "length {len}");
            assert_eq!(&buf[..len], &p[..]);
            let s = y.stats();
            assert_eq!((s.bad_crc, s.rejected(), s.received), (bad, bad, bad), "length {len}");
        }
        assert_eq!(y.recv(&mut buf), None);
    }

    #[test]
    fn a_bad_crc_is_rejected_and_the_next_record_still_arrives() {
        let (mut x, mut y) = pair(HEADER_WORDS + 256);
        x.send(&[1u8; 24]).unwrap();
        x.send(&[2u8; 24]).unwrap();
        // Flip one payload bit of the first record.
        let w = &ring(&x)[RECORD_HEADER_WORDS];
        w.store(w.load(Relaxed) ^ 4, Relaxed);
        let mut buf = [0u8; 64];
        assert_eq!(y.recv(&mut buf), Some(24));
        assert_eq!(&buf[..24], &[2u8; 24]);
        assert_eq!(y.stats().bad_crc, 1);
        assert_eq!(y.stats().received, 1);
    }

    #[test]
    fn each_receiver_publishes_its_counters_in_its_own_header() {
        let (mut x, mut y) = pair(HEADER_WORDS + 256);
        x.send(&[1u8; 24]).unwrap();
        x.send(&[2u8; 24]).unwrap();
        x.send(&[3u8; 24]).unwrap();
        let w = &ring(&x)[RECORD_HEADER_WORDS];
        w.store(w.load(Relaxed) ^ 4, Relaxed);
        let mut buf = [0u8; 64];
        while y.recv(&mut buf).is_some() {}
        y.report(0x55);
        let word = |r: &[AtomicU64], i: usize| r[i].load(Relaxed);
        assert_eq!(
            [W_DELIVERED, W_REJECTED, W_VERDICT].map(|i| word(y.own, i)),
            [2, 1, 0x55],
            "y's own header"
        );
        assert_eq!(
            [W_DELIVERED, W_REJECTED, W_VERDICT].map(|i| word(x.own, i)),
            [0, 0, 0],
            "x received nothing: its header says so"
        );
        // A new generation starts its report over.
        let own = y.own;
        let peer = y.peer;
        let _y = Endpoint::new(own, peer, 9).unwrap();
        assert_eq!([W_DELIVERED, W_REJECTED, W_VERDICT].map(|i| word(own, i)), [0, 0, 0]);
    }

    #[test]
    fn a_stale_sequence_number_is_rejected() {
        let (mut x, mut y) = pair(HEADER_WORDS + 256);
        let mut buf = [0u8; 64];
        x.send(&[1u8; 8]).unwrap();
        assert_eq!(y.recv(&mut buf), Some(8));
        // A replay: the second record carries the first one's sequence
        // number (with a CRC that matches, so only the number is wrong).
        x.send(&[2u8; 8]).unwrap();
        let at = record_words(8);
        ring(&x)[at + 1].store(0, Relaxed);
        let crc = record_crc(8, 0, &[2u8; 8]);
        ring(&x)[at].store(8 | (u64::from(crc) << 32), Relaxed);
        assert_eq!(y.recv(&mut buf), None);
        assert_eq!(y.stats().bad_seq, 1);
        x.send(&[3u8; 8]).unwrap();
        assert_eq!(y.recv(&mut buf), Some(8));
        assert_eq!(buf[0], 3);
    }

    #[test]
    fn a_record_longer_than_the_buffer_is_skipped_and_counted() {
        let (mut x, mut y) = pair(HEADER_WORDS + 256);
        x.send(&[1u8; 100]).unwrap();
        x.send(&[2u8; 10]).unwrap();
        let mut buf = [0u8; 16];
        assert_eq!(y.recv(&mut buf), Some(10));
        assert_eq!(y.stats().too_long, 1);
    }

    #[test]
    fn a_peer_restart_with_a_new_generation_is_followed() {
        let (a, b) = (region(HEADER_WORDS + 128), region(HEADER_WORDS + 128));
        let mut x = Endpoint::new(&a, &b, 1).unwrap();
        let mut y = Endpoint::new(&b, &a, 2).unwrap();
        let mut buf = [0u8; 64];
        for i in 0..50u8 {
            x.send(&[i; 32]).unwrap();
            assert_eq!(y.recv(&mut buf), Some(32));
        }
        // x restarts: new generation, its stream starts again at 0.
        let mut x = Endpoint::new(&a, &b, 3).unwrap();
        x.send(&[99u8; 16]).unwrap();
        assert_eq!(y.recv(&mut buf), Some(16));
        assert_eq!(buf[0], 99);
        assert_eq!(y.stats().resyncs, 1);
        assert_eq!(y.stats().rejected(), 0);
        // y restarts: x sees no acknowledgement for its generation until y
        // has read, and nothing is lost or rejected.
        let mut y = Endpoint::new(&b, &a, 4).unwrap();
        x.send(&[5u8; 8]).unwrap();
        assert_eq!(y.recv(&mut buf), Some(16), "the new y reads x's stream from its start");
        assert_eq!(y.recv(&mut buf), Some(8));
        assert_eq!(y.stats().rejected(), 0);
    }

    #[test]
    fn a_restarted_end_rejoins_the_peers_stream_at_its_acknowledgement() {
        let (a, b) = (region(HEADER_WORDS + 128), region(HEADER_WORDS + 128));
        let mut x = Endpoint::new(&a, &b, 1).unwrap();
        let mut y = Endpoint::new(&b, &a, 2).unwrap();
        let mut buf = [0u8; 64];
        // Many wraps, so position 0 of x's stream is long overwritten.
        for i in 0..500u64 {
            x.send(&payload(i, 40)).unwrap();
            assert_eq!(y.recv(&mut buf), Some(40));
        }
        x.send(&payload(500, 40)).unwrap();
        // y dies; the host withdraws its region (keeping the ack); it restarts.
        withdraw(&b);
        assert_eq!(b[W_GEN].load(Relaxed), 0);
        let mut y = Endpoint::rejoin(&b, &a, 3).unwrap();
        assert_eq!(y.recv(&mut buf), Some(40));
        assert_eq!(&buf[..40], &payload(500, 40)[..]);
        for i in 501..700u64 {
            x.send(&payload(i, 40)).unwrap();
            assert_eq!(y.recv(&mut buf), Some(40), "record {i}");
        }
        assert_eq!((y.stats().rejected(), y.stats().resyncs), (0, 0));
        // Without the kept ack (a plain new endpoint) the stale ring is read
        // from position 0 and records are rejected.
        withdraw(&b);
        b[W_ACK_GEN].store(0, Relaxed);
        let mut z = Endpoint::rejoin(&b, &a, 4).unwrap();
        while z.recv(&mut buf).is_some() {}
        assert!(z.stats().rejected() > 0);
    }

    #[test]
    fn garbage_in_the_peer_region_never_panics() {
        let (a, b) = (region(HEADER_WORDS + 128), region(HEADER_WORDS + 128));
        let mut y = Endpoint::new(&b, &a, 2).unwrap();
        let mut buf = [0u8; 64];
        let mut r = 0x1234_5678_9abc_def0u64;
        for round in 0..2000 {
            for w in a.iter() {
                r ^= r << 13;
                r ^= r >> 7;
                r ^= r << 17;
                w.store(if round % 3 == 0 { r % 300 } else { r }, Relaxed);
            }
            a[W_MAGIC].store(MAGIC, Relaxed);
            a[W_GEN].store(1 + round % 4, Relaxed);
            a[W_HEAD].store(r % 4096, Relaxed);
            let _ = y.recv(&mut buf);
        }
        assert!(y.stats().rejected() > 0);
    }

    #[test]
    fn two_threads_stream_through_a_channel() {
        let (a, b) = (region(HEADER_WORDS + 4096), region(HEADER_WORDS + 4096));
        let n = 20_000u64;
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut x = Endpoint::new(&a, &b, 1).unwrap();
                let mut i = 0;
                let mut spins = 0u64;
                while i < n {
                    match x.send(&payload(i, (i as usize % 300) + 1)) {
                        Ok(()) => i += 1,
                        Err(_) => {
                            spins += 1;
                            assert!(spins < 1 << 32, "receiver stalled");
                            std::hint::spin_loop();
                        }
                    }
                }
            });
            let mut y = Endpoint::new(&b, &a, 2).unwrap();
            let mut buf = [0u8; 512];
            let mut i = 0;
            let start = std::time::Instant::now();
            while i < n {
                assert!(start.elapsed().as_secs() < 60, "sender stalled at {i}");
                if let Some(len) = y.recv(&mut buf) {
                    assert_eq!(&buf[..len], &payload(i, (i as usize % 300) + 1)[..]);
                    i += 1;
                }
            }
            assert_eq!(y.stats().rejected(), 0);
        });
    }

    /// A writer withdrawn by the host and restarted with a new generation
    /// while the receiver is in the middle of reading one of its records
    /// (the sandbox `restart` policy) is a restart, never a bad record: a
    /// read that overlapped the withdrawal is dropped, not counted.
    #[test]
    fn a_writer_withdrawn_mid_read_is_no_bad_record() {
        let (a, b) = (region(HEADER_WORDS + 256), region(HEADER_WORDS + 256));
        let rounds = 3_000u64;
        let done = core::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                for g in 1..=rounds {
                    let mut x = Endpoint::new(&a, &b, g).unwrap();
                    for i in 0..8 {
                        let _ = x.send(&payload(i, 200));
                    }
                    withdraw(&a);
                }
                done.store(true, Release);
            });
            let mut y = Endpoint::new(&b, &a, 1 << 40).unwrap();
            let mut buf = [0u8; 512];
            let start = std::time::Instant::now();
            while !done.load(Acquire) {
                assert!(start.elapsed().as_secs() < 60, "writer stalled");
                if let Some(len) = y.recv(&mut buf) {
                    assert_eq!(len, 200);
                }
            }
            assert_eq!(y.stats().rejected(), 0, "{:?}", y.stats());
        });
    }

    /// x's region held (x is under rollback with output commit): a
    /// checkpoint of x is its endpoint's state (its RAM) and its header.
    fn held_pair(ring: usize) -> (Endpoint<'static>, Endpoint<'static>) {
        let (x, y) = pair(HEADER_WORDS + ring);
        hold(x.own);
        (x, y)
    }

    #[test]
    fn a_receiver_never_sees_past_the_released_head() {
        let (mut x, mut y) = held_pair(256);
        let mut buf = [0u8; 64];
        for i in 0..3u64 {
            x.send(&payload(i, 24)).unwrap();
        }
        assert_eq!(y.recv(&mut buf), None, "nothing is released before the first checkpoint");
        let k = snapshot(x.own);
        x.send(&payload(3, 24)).unwrap();
        x.send(&payload(4, 24)).unwrap();
        release(x.own, &k);
        for i in 0..3u64 {
            assert_eq!(y.recv(&mut buf), Some(24));
            assert_eq!(&buf[..24], &payload(i, 24)[..]);
        }
        assert_eq!(y.recv(&mut buf), None, "records 3 and 4 are not released");
        release(x.own, &snapshot(x.own));
        assert_eq!(y.recv(&mut buf), Some(24));
        assert_eq!(&buf[..24], &payload(3, 24)[..]);
        assert_eq!(y.recv(&mut buf), Some(24));
        assert_eq!(y.recv(&mut buf), None);
        assert_eq!((y.stats().rejected(), y.stats().resyncs), (0, 0));
        // A region that is not held reads as before: y's, unheld, is read
        // by x at once.
        y.send(&[9u8; 8]).unwrap();
        assert_eq!(x.recv(&mut buf), Some(8));
    }

    #[test]
    fn a_sender_never_reuses_space_past_the_released_ack() {
        // x (held) receives y's stream: y may reuse only what x's released
        // acknowledgement frees.
        let (mut x, mut y) = held_pair(64);
        release(x.own, &snapshot(x.own));
        let mut sent = 0u64;
        while y.send(&payload(sent, 40)).is_ok() {
            sent += 1;
            assert!(sent < 100, "the ring never filled");
        }
        let mut buf = [0u8; 64];
        let mut got = 0;
        while x.recv(&mut buf).is_some() {
            got += 1;
        }
        assert_eq!(got, sent, "x consumed everything");
        assert_ne!(x.own[W_ACK].load(Relaxed), 0);
        assert_eq!(y.send(&payload(sent, 40)), Err(SendError::Full), "x's ack is not released");
        release(x.own, &snapshot(x.own));
        assert!(y.send(&payload(sent, 40)).is_ok(), "released: the space is reused");
    }

    #[test]
    fn a_rollback_of_the_header_republishes_identically() {
        // Both directions: x (held) sends to y and receives y's stream, in a
        // small ring so y's sender reuses space; x is checkpointed, runs
        // on, and rolls back to the checkpoint twice.
        let (mut x, mut y) = held_pair(128);
        let mut buf = [0u8; 64];
        let (mut xs, mut ys) = (0u64, 0u64);
        let mut y_got = Vec::new();
        for round in 0..40u64 {
            // Checkpoint: x's RAM and its header; what came before is
            // released (as at the next checkpoint).
            let (saved, k) = (x.clone(), snapshot(x.own));
            release(x.own, &k);
            let saved_xs = xs;
            for attempt in 0..3 {
                for _ in 0..3 {
                    if x.send(&payload(xs, 24)).is_ok() {
                        xs += 1;
                    }
                    if y.send(&payload(1000 + ys, 16)).is_ok() {
                        ys += 1;
                    }
                    while let Some(len) = x.recv(&mut buf) {
                        assert_eq!(len, 16);
                    }
                    while let Some(len) = y.recv(&mut buf) {
                        y_got.push(buf[..len].to_vec());
                    }
                }
                if attempt < 2 && round % 3 != 0 {
                    // A fault: back to the checkpoint, as the supervisor
                    // does it (the restored words are released).
                    restore(x.own, &k);
                    release(x.own, &snapshot(x.own));
                    x = saved.clone();
                    xs = saved_xs;
                }
            }
        }
        release(x.own, &snapshot(x.own));
        while let Some(len) = y.recv(&mut buf) {
            y_got.push(buf[..len].to_vec());
        }
        // y saw x's stream once, in order, never a record a rollback undid.
        assert_eq!(y_got.len() as u64, xs);
        for (i, m) in y_got.iter().enumerate() {
            assert_eq!(m, &payload(i as u64, 24), "record {i}");
        }
        assert_eq!((y.stats().rejected(), y.stats().resyncs), (0, 0), "{:?}", y.stats());
        // x re-read what y's sender could not have reused.
        assert_eq!(x.stats().rejected(), 0, "{:?}", x.stats());
    }

    #[test]
    fn without_the_hold_a_rolled_back_sender_stalls_behind_its_peers_ack() {
        // The defect the hold closes, the same rollback without it: the
        // peer consumed (and acknowledged) a record the rollback undid, so
        // the rolled-back sender's head is behind the peer's ack and it
        // can send nothing; the peer also delivered a record that, in the
        // sender's history now, was never sent.
        let (mut x, mut y) = pair(HEADER_WORDS + 256);
        let mut buf = [0u8; 64];
        let saved = x.clone();
        x.send(&payload(0, 24)).unwrap();
        assert_eq!(y.recv(&mut buf), Some(24));
        let mut x = saved;
        assert_eq!(x.send(&payload(7, 24)), Err(SendError::Full));
    }

    #[test]
    fn garbage_in_the_released_words_is_contained_never_a_panic() {
        let (mut x, mut y) = held_pair(128);
        let mut buf = [0u8; 64];
        let mut r = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            r ^= r << 13;
            r ^= r >> 7;
            r ^= r << 17;
            r
        };
        for i in 0..3000u64 {
            let _ = x.send(&payload(i, (i % 60) as usize));
            let _ = y.send(&payload(i, (i % 60) as usize));
            for w in [W_FLAGS, W_REL_GEN, W_REL_HEAD, W_REL_ACK_GEN, W_REL_ACK] {
                let v = next();
                let v = match i % 4 {
                    0 => v,
                    1 => v % 512,
                    // The right generation, a head anywhere.
                    2 if w == W_REL_GEN => x.gen,
                    2 if w == W_REL_ACK_GEN => y.gen,
                    _ => x.own[w].load(Relaxed) ^ (v & 0xff),
                };
                x.own[w].store(v, Relaxed);
            }
            let _ = y.recv(&mut buf);
            let _ = x.recv(&mut buf);
        }
        // Bad views were counted, not delivered as good records.
        assert!(y.stats().rejected() > 0, "{:?}", y.stats());
        // A sane view again: the stream goes on.
        hold(x.own);
        let mut x = Endpoint::new(x.own, x.peer, 77).unwrap();
        x.send(&payload(1, 24)).unwrap();
        release(x.own, &snapshot(x.own));
        let mut tries = 0;
        let got = loop {
            tries += 1;
            if let Some(len) = y.recv(&mut buf) {
                break Some(len);
            }
            if tries > 10 {
                break None;
            }
        };
        assert_eq!(got, Some(24));
        assert_eq!(&buf[..24], &payload(1, 24)[..]);
    }

    #[test]
    fn a_rollback_to_before_the_owner_initialised_keeps_the_released_ack() {
        // x (held) is rolled back to its first checkpoint, taken before it
        // set up its end: it rejoins y's stream at the released ack.
        let (a, b) = (region(HEADER_WORDS + 128), region(HEADER_WORDS + 128));
        hold(&a[..]);
        let first = snapshot(&a[..]);
        let mut y = Endpoint::new(&b, &a, 2).unwrap();
        let mut x = Endpoint::rejoin(&a, &b, 1).unwrap();
        let mut buf = [0u8; 64];
        for i in 0..200u64 {
            let _ = y.send(&payload(i, 40));
            while x.recv(&mut buf).is_some() {}
            if i % 10 == 0 {
                release(&a[..], &snapshot(&a[..]));
            }
        }
        let rel = released(&a[..]);
        restore(&a[..], &first);
        release(&a[..], &snapshot(&a[..]));
        assert_eq!(a[W_GEN].load(Relaxed), 0);
        assert_eq!([a[W_ACK_GEN].load(Relaxed), a[W_ACK].load(Relaxed)], [rel[2], rel[3]]);
        let mut x = Endpoint::rejoin(&a, &b, 3).unwrap();
        while x.recv(&mut buf).is_some() {}
        assert_eq!(x.stats().rejected(), 0, "{:?}", x.stats());
        assert!(x.stats().received > 0);
    }
}
