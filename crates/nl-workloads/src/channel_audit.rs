//! The host's audit of a channel region: a passive reader that checks what
//! a region's writer published, without acknowledging anything (the
//! writer's flow control follows its real receiver only).
//!
//! It checks the same framing as [`crate::channel`]'s receiver (a head
//! that went back, a length past the
//! published data, a sequence number other than the next one, a CRC
//! mismatch) and hands each good payload to the caller's check (for
//! `chanstream`, [`crate::chanstream::StreamCheck`]).
//!
//! A passive reader can fall behind: the writer reuses ring words once its
//! receiver consumed them. The audit never blames the writer for a record
//! it may have read while the writer was already rewriting it: after
//! reading a record it reads the head again, and when the writer may have
//! reached the record's words again (the head within half a ring, the
//! largest record, of a full ring past the record), it drops what it read,
//! counts a *lost track* and starts over at the head. Likewise a generation
//! that changed or went to 0 while it read (the writer restarted, or the
//! host withdrew the region) starts it over without a finding.

use core::sync::atomic::AtomicU64;
use core::sync::atomic::Ordering::{self, Acquire, Relaxed};

use crate::channel::{
    record_crc, record_words, HEADER_WORDS, HELD, MAGIC, PAD, RECORD_HEADER_WORDS, W_FLAGS, W_GEN,
    W_HEAD, W_MAGIC, W_REL_GEN, W_REL_HEAD,
};

/// A region's words as the audit reads them: host memory as atomics, or a
/// VMM's mapping of the channel's memfd.
pub trait Words {
    /// Words in the region.
    fn words(&self) -> usize;
    fn load(&self, word: usize, order: Ordering) -> u64;
}

impl Words for [AtomicU64] {
    fn words(&self) -> usize {
        self.len()
    }
    fn load(&self, word: usize, order: Ordering) -> u64 {
        self.get(word).map_or(0, |w| w.load(order))
    }
}

/// A finding: a record the writer published that is wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Finding {
    /// The writer's generation and the record's word position in it.
    pub generation: u64,
    pub pos: u64,
    /// The record's sequence number as read (when it had one).
    pub seq: u64,
    pub what: &'static str,
}

/// What one [`Audit::step`] found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Step {
    /// Records checked and found good.
    pub good: u64,
    /// Bad records (the first one in `first`).
    pub bad: u64,
    pub first: Option<Finding>,
    /// The audit fell behind the writer and started over at its head.
    pub lost_track: bool,
}

/// A check of one good record's payload: `generation`, the record's
/// sequence number, its payload; `Err` names what is wrong. `start` is
/// called when the audit starts reading a generation (`fresh`: from its
/// first record; else mid-stream, after a lost track).
pub trait PayloadCheck {
    fn start(&mut self, fresh: bool);
    fn check(&mut self, seq: u64, payload: &[u8]) -> Result<(), &'static str>;
}

/// No payload check: framing only.
pub struct FramingOnly;

impl PayloadCheck for FramingOnly {
    fn start(&mut self, _fresh: bool) {}
    fn check(&mut self, _seq: u64, _payload: &[u8]) -> Result<(), &'static str> {
        Ok(())
    }
}

/// The audit of one region (see the module doc).
#[derive(Clone, Debug, Default)]
pub struct Audit {
    /// The generation being read (0: none yet), the next record's word
    /// position and sequence number (`None`: take it as it comes).
    generation: u64,
    pos: u64,
    next_seq: Option<u64>,
    /// Totals over the audit's life.
    pub checked: u64,
    pub bad: u64,
    pub lost_track: u64,
    /// In the current generation: bad records and lost tracks (for
    /// [`Audit::clean_through`]).
    gen_bad: u64,
    gen_lost: u64,
}

impl Audit {
    pub fn new() -> Self {
        Self::default()
    }

    /// The generation being read and the word position checked up to.
    pub fn position(&self) -> (u64, u64) {
        (self.generation, self.pos)
    }

    /// Whether the audit read generation `generation` from its start up to
    /// at least word `pos` and found every record good: `Some(true)`;
    /// `Some(false)` when it found a bad one or lost track in it; `None`
    /// when it cannot tell (another generation, or not that far yet).
    pub fn clean_through(&self, generation: u64, pos: u64) -> Option<bool> {
        if generation == 0 || generation != self.generation {
            return None;
        }
        if self.gen_bad > 0 || self.gen_lost > 0 {
            return Some(false);
        }
        (self.pos >= pos).then_some(true)
    }

    fn start(&mut self, generation: u64, check: &mut impl PayloadCheck) {
        self.generation = generation;
        self.pos = 0;
        self.next_seq = Some(0);
        self.gen_bad = 0;
        self.gen_lost = 0;
        check.start(true);
    }

    fn lose_track(&mut self, head: u64, step: &mut Step, check: &mut impl PayloadCheck) {
        self.pos = head;
        self.next_seq = None;
        self.lost_track += 1;
        self.gen_lost += 1;
        step.lost_track = true;
        check.start(false);
    }

    fn found(&mut self, step: &mut Step, pos: u64, seq: u64, what: &'static str) {
        self.bad += 1;
        self.gen_bad += 1;
        step.bad += 1;
        step.first.get_or_insert(Finding { generation: self.generation, pos, seq, what });
    }

    /// Checks at most `limit` records published in `region` since the last
    /// step. `buf` holds one payload (a longer record is a finding).
    pub fn step(
        &mut self,
        region: &(impl Words + ?Sized),
        buf: &mut [u8],
        limit: usize,
        check: &mut impl PayloadCheck,
    ) -> Step {
        let mut step = Step::default();
        if region.words() < HEADER_WORDS + crate::channel::MIN_RING_WORDS {
            return step;
        }
        let n = (region.words() - HEADER_WORDS) as u64;
        let ring = |w: usize| region.load(HEADER_WORDS + w, Relaxed);
        // A record may be rewritten once the writer's head is within the
        // largest record (half a ring) of a ring past it.
        let safe = |head: u64, pos: u64| head.saturating_sub(pos) <= n / 2;
        for _ in 0..limit {
            let gen = region.load(W_GEN, Acquire);
            if gen == 0 || region.load(W_MAGIC, Relaxed) != MAGIC {
                return step;
            }
            // Held output (`crate::channel`, "Held output"): what the peer
            // reads, the released generation up to the released head; the
            // writer's own head says which words it may be rewriting.
            let held = region.load(W_FLAGS, Acquire) & HELD != 0;
            let moved = || {
                region.load(W_GEN, Acquire) != gen
                    || (held && region.load(W_REL_GEN, Acquire) != gen)
            };
            if held && region.load(W_REL_GEN, Acquire) != gen {
                return step;
            }
            if gen != self.generation {
                self.start(gen, check);
            }
            let raw = region.load(W_HEAD, Acquire);
            let head = if held { raw.min(region.load(W_REL_HEAD, Acquire)) } else { raw };
            // The writer re-initialised while we read the head.
            if moved() {
                continue;
            }
            if head == self.pos {
                return step;
            }
            if head < self.pos {
                self.found(&mut step, self.pos, 0, "its head went back");
                self.pos = head;
                self.next_seq = None;
                check.start(false);
                continue;
            }
            if !safe(raw, self.pos) {
                self.lose_track(head, &mut step, check);
                continue;
            }
            let off = self.pos % n;
            let w0 = ring(off as usize);
            let (len, crc) = ((w0 & 0xffff_ffff) as usize, (w0 >> 32) as u32);
            let words = if w0 == PAD { n - off } else { record_words(len) as u64 };
            let seq = ring(off as usize + 1);
            let fits = w0 == PAD || off + words <= n;
            let mut payload_ok = false;
            let mut copied = 0;
            if w0 != PAD && fits && self.pos + words <= head && len <= buf.len() {
                let start = off as usize + RECORD_HEADER_WORDS;
                for (i, c) in buf[..len].chunks_mut(8).enumerate() {
                    let b = ring(start + i).to_le_bytes();
                    c.copy_from_slice(&b[..c.len()]);
                }
                copied = len;
                payload_ok = record_crc(len as u32, seq, &buf[..len]) == crc;
            }
            // Read it again: the words may have been reused meanwhile, or
            // the writer restarted.
            let raw2 = region.load(W_HEAD, Acquire);
            if moved() || raw2 < raw {
                continue;
            }
            if !safe(raw2, self.pos) {
                self.lose_track(if held { head } else { raw2 }, &mut step, check);
                continue;
            }
            if w0 == PAD {
                if self.pos + words > head {
                    self.found(&mut step, self.pos, 0, "its padding runs past the published data");
                    self.pos = head;
                    self.next_seq = None;
                    check.start(false);
                } else {
                    self.pos += words;
                }
                continue;
            }
            if !fits || self.pos + words > head {
                self.found(
                    &mut step,
                    self.pos,
                    seq,
                    "its length runs past the region or the published data",
                );
                self.pos = head;
                self.next_seq = None;
                check.start(false);
                continue;
            }
            let (at, expected) = (self.pos, self.next_seq);
            self.pos += words;
            self.next_seq = Some(seq.wrapping_add(1));
            if expected.is_some_and(|e| e != seq) {
                self.found(&mut step, at, seq, "its sequence number is not the next one");
                continue;
            }
            if len > buf.len() {
                self.found(&mut step, at, seq, "it is longer than its workload's messages");
                continue;
            }
            if !payload_ok {
                self.found(&mut step, at, seq, "its CRC does not match");
                continue;
            }
            match check.check(seq, &buf[..copied]) {
                Ok(()) => {
                    self.checked += 1;
                    step.good += 1;
                }
                Err(what) => self.found(&mut step, at, seq, what),
            }
        }
        step
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::Endpoint;
    extern crate std;
    use std::vec::Vec;

    fn region(words: usize) -> Vec<AtomicU64> {
        (0..words).map(|_| AtomicU64::new(0)).collect()
    }

    #[test]
    fn a_good_stream_is_good_and_covered() {
        let (a, b) = (region(HEADER_WORDS + 256), region(HEADER_WORDS + 256));
        let mut tx = Endpoint::new(&a, &b, 7).unwrap();
        let mut rx = Endpoint::new(&b, &a, 9).unwrap();
        let mut audit = Audit::new();
        let mut buf = [0u8; 64];
        let mut got = [0u8; 64];
        for i in 0..100u8 {
            tx.send(&[i; 24]).unwrap();
            if i % 3 == 0 {
                let s = audit.step(a.as_slice(), &mut buf, 1000, &mut FramingOnly);
                assert_eq!((s.bad, s.lost_track), (0, false), "{s:?}");
            }
            while rx.recv(&mut got).is_some() {}
        }
        audit.step(a.as_slice(), &mut buf, 1000, &mut FramingOnly);
        assert_eq!((audit.checked, audit.bad), (100, 0));
        assert_eq!(audit.clean_through(7, a[W_HEAD].load(Relaxed)), Some(true));
        assert_eq!(audit.clean_through(8, 1), None);
    }

    #[test]
    fn a_corrupt_record_is_found_with_its_position() {
        let (a, b) = (region(HEADER_WORDS + 256), region(HEADER_WORDS + 256));
        let mut tx = Endpoint::new(&a, &b, 7).unwrap();
        for i in 0..4u8 {
            tx.send(&[i; 16]).unwrap();
        }
        // Record 2 starts at word 2 * 4; flip a payload bit.
        let w = &a[HEADER_WORDS + 2 * 4 + 2];
        w.store(w.load(Relaxed) ^ 1, Relaxed);
        let mut audit = Audit::new();
        let s = audit.step(a.as_slice(), &mut [0u8; 64], 1000, &mut FramingOnly);
        assert_eq!((s.good, s.bad), (3, 1));
        let f = s.first.unwrap();
        assert_eq!((f.generation, f.pos, f.seq, f.what), (7, 8, 2, "its CRC does not match"));
        assert_eq!(audit.clean_through(7, 1), Some(false));
    }

    #[test]
    fn a_skipped_sequence_number_and_a_payload_check_are_findings() {
        struct NoSevens;
        impl PayloadCheck for NoSevens {
            fn start(&mut self, _: bool) {}
            fn check(&mut self, _: u64, p: &[u8]) -> Result<(), &'static str> {
                if p[0] == 7 {
                    Err("a seven")
                } else {
                    Ok(())
                }
            }
        }
        let (a, b) = (region(HEADER_WORDS + 256), region(HEADER_WORDS + 256));
        let mut tx = Endpoint::new(&a, &b, 3).unwrap();
        tx.send(&[1; 8]).unwrap();
        tx.send(&[7; 8]).unwrap();
        let mut audit = Audit::new();
        let s = audit.step(a.as_slice(), &mut [0u8; 64], 1000, &mut NoSevens);
        assert_eq!((s.good, s.bad, s.first.unwrap().what), (1, 1, "a seven"));
        // A record whose sequence number skips one (rewritten in place with
        // a valid CRC, as a writer with a corrupted counter would).
        tx.send(&[2; 8]).unwrap();
        let at = HEADER_WORDS + 2 * 3;
        a[at + 1].store(5, Relaxed);
        let crc = record_crc(8, 5, &[2; 8]);
        a[at].store(8 | u64::from(crc) << 32, Relaxed);
        let s = audit.step(a.as_slice(), &mut [0u8; 64], 1000, &mut NoSevens);
        assert_eq!(s.first.unwrap().what, "its sequence number is not the next one");
    }

    #[test]
    fn falling_behind_or_a_restart_is_no_finding() {
        let (a, b) = (region(HEADER_WORDS + 64), region(HEADER_WORDS + 64));
        let mut tx = Endpoint::new(&a, &b, 1).unwrap();
        let mut rx = Endpoint::new(&b, &a, 2).unwrap();
        let mut audit = Audit::new();
        let mut buf = [0u8; 64];
        audit.step(a.as_slice(), &mut buf, 10, &mut FramingOnly);
        // The writer laps the audit several times (its receiver drains).
        for i in 0..40u8 {
            tx.send(&[i; 16]).unwrap();
            while rx.recv(&mut [0u8; 64]).is_some() {}
        }
        let s = audit.step(a.as_slice(), &mut buf, 100, &mut FramingOnly);
        assert!(s.lost_track && s.bad == 0, "{s:?}");
        assert_eq!(audit.clean_through(1, 1), Some(false), "a lost track is not clean");
        // A restart: a new generation is read from its start.
        let mut tx = Endpoint::new(&a, &b, 5).unwrap();
        tx.send(&[9; 16]).unwrap();
        let s = audit.step(a.as_slice(), &mut buf, 100, &mut FramingOnly);
        assert_eq!((s.good, s.bad, s.lost_track), (1, 0, false));
        assert_eq!(audit.clean_through(5, a[W_HEAD].load(Relaxed)), Some(true));
    }
}
