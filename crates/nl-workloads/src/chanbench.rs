//! `chanbench`: ping-pong and streaming over a sandbox channel
//! ([`crate::channel`]), message sizes from 8 B to 64 KiB, self-verifying.
//!
//! Both ends run the same schedule. For each size in [`sizes`]: the leader
//! (end 0) sends [`PING_ITERS`] messages and waits for each to come back
//! (the follower echoes it), timing every round trip; then it streams
//! [`stream_count`] messages which the follower receives and checks, timing
//! bursts of [`STREAM_BURST`], and reports the median burst back. Every message
//! is a reference buffer derived from the seed and the size with the
//! message's sequence number in its first 8 bytes; every receiver compares
//! the whole message, on top of the channel's CRC. The digest folds each
//! end's schedule and counts (see [`expected_digest`]): equal digests and
//! no error mean everything arrived intact.
//!
//! Polled from ring 3: no VM exit on the data path.

use crate::channel::{Endpoint, SendError};
use crate::{fold, mix64};

/// Largest message.
pub const MAX_SIZE: usize = 64 << 10;
/// Round trips timed per size.
pub const PING_ITERS: usize = 1000;
/// Bytes streamed per size (fewer for small messages: at most
/// [`STREAM_MAX_MSGS`] messages).
pub const STREAM_BYTES: u64 = 32 << 20;
pub const STREAM_MAX_MSGS: u64 = 50_000;
/// Streaming is timed per burst of this many messages (see [`SizeResult`]).
pub const STREAM_BURST: u64 = 16;
/// Most sizes in one run.
pub const MAX_SIZES: usize = 14;

/// The sizes measured with `max` as the largest (powers of two from 8).
pub fn sizes(max: usize) -> impl Iterator<Item = usize> {
    (3..=16u32).map(|s| 1usize << s).filter(move |&s| s <= max.min(MAX_SIZE))
}

/// Messages streamed at `size`.
pub fn stream_count(size: usize) -> u64 {
    (STREAM_BYTES / size as u64).clamp(64, STREAM_MAX_MSGS)
}

/// What the environment provides: a cycle clock, a heartbeat, and how long
/// to wait for the peer.
pub trait Env {
    /// A monotonic cycle counter (TSC).
    fn now(&mut self) -> u64;
    /// Called at least every few milliseconds while the benchmark runs.
    fn beat(&mut self);
    /// Cycles after which a silent peer is an error.
    fn patience(&self) -> u64;
}

/// One size's results (the leader's view; the follower fills `size` only).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SizeResult {
    pub size: usize,
    /// Round trips: median, minimum and 90th percentile, in cycles.
    pub rtt_median: u64,
    pub rtt_min: u64,
    pub rtt_p90: u64,
    /// Streaming, measured at the receiver in bursts of [`STREAM_BURST`]
    /// messages: the bytes of one burst and the median burst's cycles
    /// (from the arrival of its first message to the next burst's first).
    pub stream_bytes: u64,
    pub stream_cycles: u64,
}

/// What went wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChanError {
    /// The peer sent nothing (or took nothing) for [`Env::patience`] cycles.
    PeerSilent { size: usize, seq: u64 },
    /// A message differed from what the peer must have sent.
    BadPayload { size: usize, seq: u64 },
    /// The channel region is too small for the largest size.
    TooLarge { size: usize },
}

/// A run's summary.
#[derive(Clone, Copy, Debug)]
pub struct Summary {
    pub results: [SizeResult; MAX_SIZES],
    pub count: usize,
    /// Messages this end received and checked.
    pub messages: u64,
    pub digest: u64,
}

/// The reference contents for `size` (before the sequence number is stamped).
pub fn fill_reference(seed: u64, size: usize, buf: &mut [u8]) {
    let mut x = mix64(seed ^ (size as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    for c in buf[..size].chunks_mut(8) {
        x = mix64(x);
        let b = x.to_le_bytes();
        let n = c.len();
        c.copy_from_slice(&b[..n]);
    }
}

fn stamp(msg: &mut [u8], seq: u64) {
    let n = msg.len().min(8);
    msg[..n].copy_from_slice(&seq.to_le_bytes()[..n]);
}

fn check(got: &[u8], reference: &[u8], seq: u64) -> bool {
    let n = got.len().min(8);
    got.len() == reference.len() && got[..n] == seq.to_le_bytes()[..n] && got[n..] == reference[n..]
}

/// The digest both ends report after a clean run with `max` as the
/// largest size: end 0 and end 1 differ only in the role salt.
pub fn expected_digest(seed: u64, max: usize, end: u64) -> u64 {
    let mut d = mix64(seed ^ 0xC4A7_BE9C ^ end);
    let mut msgs = 0;
    for size in sizes(max) {
        msgs += PING_ITERS as u64 + if end == 1 { stream_count(size) } else { 1 };
        d = fold(d, size as u64 ^ (msgs << 20));
    }
    d
}

struct Run<'e, 'a, E: Env> {
    ep: &'e mut Endpoint<'a>,
    env: &'e mut E,
    last_beat: u64,
}

impl<E: Env> Run<'_, '_, E> {
    fn tick(&mut self, now: u64) {
        // About every 1 ms at 1 GHz and up: cheap, and far below any watchdog.
        if now.wrapping_sub(self.last_beat) > 1 << 21 {
            self.env.beat();
            self.last_beat = now;
        }
    }

    fn send(&mut self, msg: &[u8], size: usize, seq: u64) -> Result<(), ChanError> {
        let start = self.env.now();
        loop {
            match self.ep.send(msg) {
                Ok(()) => return Ok(()),
                Err(SendError::TooLarge) => return Err(ChanError::TooLarge { size }),
                Err(SendError::Full) => {
                    let now = self.env.now();
                    if now.wrapping_sub(start) > self.env.patience() {
                        return Err(ChanError::PeerSilent { size, seq });
                    }
                    self.tick(now);
                    core::hint::spin_loop();
                }
            }
        }
    }

    /// The next message's length, and the time it arrived.
    fn recv(&mut self, buf: &mut [u8], size: usize, seq: u64) -> Result<(usize, u64), ChanError> {
        let start = self.env.now();
        loop {
            if let Some(n) = self.ep.recv(buf) {
                return Ok((n, self.env.now()));
            }
            let now = self.env.now();
            if now.wrapping_sub(start) > self.env.patience() {
                return Err(ChanError::PeerSilent { size, seq });
            }
            self.tick(now);
            core::hint::spin_loop();
        }
    }
}

/// Runs the benchmark at one end (`end` 0 leads). `msg`, `reference` and
/// `rx` are scratch buffers of at least `max` bytes; `rtts` holds the round
/// trips of one size (at least [`PING_ITERS`]).
#[allow(clippy::too_many_arguments)]
pub fn run<E: Env>(
    ep: &mut Endpoint,
    env: &mut E,
    end: u64,
    seed: u64,
    max: usize,
    msg: &mut [u8],
    reference: &mut [u8],
    rx: &mut [u8],
    rtts: &mut [u64],
) -> Result<Summary, ChanError> {
    let mut s = Summary {
        results: [SizeResult::default(); MAX_SIZES],
        count: 0,
        messages: 0,
        digest: mix64(seed ^ 0xC4A7_BE9C ^ end),
    };
    let last_beat = env.now();
    let mut r = Run { ep, env, last_beat };
    for size in sizes(max) {
        if size > msg.len() || size > reference.len() || size > rx.len() || rtts.len() < PING_ITERS
        {
            return Err(ChanError::TooLarge { size });
        }
        fill_reference(seed, size, reference);
        let reference = &reference[..size];
        let msg = &mut msg[..size];
        msg.copy_from_slice(reference);
        let mut res = SizeResult { size, ..Default::default() };
        // Ping-pong.
        for i in 0..PING_ITERS as u64 {
            stamp(msg, i);
            if end == 0 {
                let t0 = r.env.now();
                r.send(msg, size, i)?;
                let (n, t1) = r.recv(rx, size, i)?;
                if !check(&rx[..n], reference, i) {
                    return Err(ChanError::BadPayload { size, seq: i });
                }
                rtts[i as usize] = t1.wrapping_sub(t0);
            } else {
                let (n, _) = r.recv(rx, size, i)?;
                if !check(&rx[..n], reference, i) {
                    return Err(ChanError::BadPayload { size, seq: i });
                }
                r.send(msg, size, i)?;
            }
            s.messages += 1;
        }
        if end == 0 {
            let t = &mut rtts[..PING_ITERS];
            t.sort_unstable();
            res.rtt_min = t[0];
            res.rtt_median = t[PING_ITERS / 2];
            res.rtt_p90 = t[PING_ITERS * 9 / 10];
        }
        // Streaming: the leader sends, the follower checks and reports.
        let count = stream_count(size);
        if end == 0 {
            for i in 0..count {
                stamp(msg, i);
                r.send(msg, size, i)?;
            }
            let (n, _) = r.recv(rx, size, count)?;
            if n != 16 {
                return Err(ChanError::BadPayload { size, seq: count });
            }
            let word = |k: usize| {
                let mut b = [0u8; 8];
                b.copy_from_slice(&rx[k * 8..k * 8 + 8]);
                u64::from_le_bytes(b)
            };
            res.stream_bytes = word(0);
            res.stream_cycles = word(1);
            s.messages += 1;
        } else {
            // Timed in bursts of STREAM_BURST messages: the median burst is
            // the channel's rate, unaffected by a preemption of either end
            // (on a loaded host a whole-stream time measures the scheduler).
            let mut burst_start = 0;
            let mut bursts = 0usize;
            for i in 0..count {
                let (n, t) = r.recv(rx, size, i)?;
                if !check(&rx[..n], reference, i) {
                    return Err(ChanError::BadPayload { size, seq: i });
                }
                if i % STREAM_BURST == 0 {
                    if i > 0 && bursts < rtts.len() {
                        rtts[bursts] = t.wrapping_sub(burst_start);
                        bursts += 1;
                    }
                    burst_start = t;
                }
                s.messages += 1;
            }
            let median = if bursts == 0 {
                0
            } else {
                let b = &mut rtts[..bursts];
                b.sort_unstable();
                b[bursts / 2]
            };
            let mut report = [0u8; 16];
            report[..8].copy_from_slice(&(STREAM_BURST * size as u64).to_le_bytes());
            report[8..].copy_from_slice(&median.to_le_bytes());
            r.send(&report, size, count)?;
        }
        s.digest = fold(s.digest, size as u64 ^ (s.messages << 20));
        s.results[s.count] = res;
        s.count += 1;
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::HEADER_WORDS;
    use core::sync::atomic::AtomicU64;
    use std::vec;
    use std::vec::Vec;

    struct HostEnv(std::time::Instant);
    impl Env for HostEnv {
        fn now(&mut self) -> u64 {
            self.0.elapsed().as_nanos() as u64
        }
        fn beat(&mut self) {}
        fn patience(&self) -> u64 {
            30_000_000_000
        }
    }

    fn region() -> Vec<AtomicU64> {
        (0..HEADER_WORDS + (256 << 10)).map(|_| AtomicU64::new(0)).collect()
    }

    fn side(
        own: &[AtomicU64],
        peer: &[AtomicU64],
        end: u64,
        max: usize,
    ) -> Result<Summary, ChanError> {
        let mut ep = Endpoint::new(own, peer, end + 1).unwrap();
        let (mut a, mut b, mut c) = (vec![0u8; max], vec![0u8; max], vec![0u8; max]);
        let mut rtts = vec![0u64; PING_ITERS];
        let mut env = HostEnv(std::time::Instant::now());
        run(&mut ep, &mut env, end, 42, max, &mut a, &mut b, &mut c, &mut rtts)
    }

    #[test]
    fn both_ends_finish_with_the_expected_digests() {
        let (x, y) = (region(), region());
        let max = 4096;
        let (l, f) = std::thread::scope(|s| {
            let f = s.spawn(|| side(&y, &x, 1, max));
            (side(&x, &y, 0, max), f.join().unwrap())
        });
        let (l, f) = (l.unwrap(), f.unwrap());
        assert_eq!(l.count, sizes(max).count());
        assert_eq!(l.digest, expected_digest(42, max, 0));
        assert_eq!(f.digest, expected_digest(42, max, 1));
        for r in &l.results[..l.count] {
            assert!(r.rtt_min > 0 && r.rtt_min <= r.rtt_median && r.rtt_median <= r.rtt_p90);
            assert_eq!(r.stream_bytes, STREAM_BURST * r.size as u64);
            assert!(r.stream_cycles > 0);
        }
    }

    #[test]
    fn a_message_with_the_wrong_contents_is_a_bad_payload() {
        // A well-formed record (its CRC matches) whose sequence stamp is
        // wrong: only the benchmark's own check can catch it.
        let (x, y) = (region(), region());
        let mut ep = Endpoint::new(&x, &y, 1).unwrap();
        let mut msg = vec![0u8; 8];
        fill_reference(42, 8, &mut msg);
        stamp(&mut msg, 1);
        ep.send(&msg).unwrap();
        assert_eq!(side(&y, &x, 1, 8).unwrap_err(), ChanError::BadPayload { size: 8, seq: 0 });
    }
}
