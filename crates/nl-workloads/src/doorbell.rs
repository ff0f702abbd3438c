//! `doorbell`: a ping-pong over a sandbox channel ([`crate::channel`])
//! without polling. Each end sends, rings the channel's doorbell, and waits
//! for the peer's reply by halting until the peer's head word moves (the
//! guest's `SYS_HALT_IF`, checked with interrupts off, so a ring that came
//! just before cannot be lost). The doorbell's interrupt is what wakes it;
//! without one only the periodic timer would.
//!
//! The leader (end 0) sends [`ITERS`] messages of [`SIZE`] bytes and times
//! each round trip; the follower echoes them. Every message is the
//! seed-derived reference of `chanbench` with its sequence number stamped
//! in, checked in full at both ends. The digest folds each end's role and
//! the sequence numbers it checked (see [`expected_digest`]).

use core::sync::atomic::AtomicU64;
use core::sync::atomic::Ordering::Acquire;

use crate::chanbench::{fill_reference, ChanError};
use crate::channel::{Endpoint, SendError};
use crate::{fold, mix64};

/// Round trips per run.
pub const ITERS: usize = 400;
/// Bytes per message.
pub const SIZE: usize = 64;

/// What the environment provides.
pub trait Bell {
    /// A monotonic cycle counter (TSC).
    fn now(&mut self) -> u64;
    /// Rings the peer's doorbell.
    fn ring(&mut self);
    /// Waits until the low 16 bits of `head` differ from `seen`, or an
    /// interrupt arrives. Returns whether it halted and, if so, whether a
    /// timer tick came during the halt.
    fn wait(&mut self, head: &AtomicU64, seen: u64) -> Wait;
    /// Called at least every few milliseconds while the benchmark runs.
    fn beat(&mut self);
    /// Cycles after which a silent peer is an error.
    fn patience(&self) -> u64;
}

/// How one wait ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    /// The head had moved already: no halt.
    NoHalt,
    /// Halted; no timer tick came before it was woken (the doorbell).
    Woken,
    /// Halted; at least one timer tick came (it may have woken it).
    Ticked,
}

/// A run's summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// Round trips (leader only), in cycles: median, minimum, 90th percentile.
    pub rtt_median: u64,
    pub rtt_min: u64,
    pub rtt_p90: u64,
    /// Halts, and those that ended without a timer tick.
    pub halts: u64,
    pub woken: u64,
    /// Messages this end received and checked.
    pub messages: u64,
    pub digest: u64,
}

fn seed_digest(seed: u64, end: u64) -> u64 {
    mix64(seed ^ 0x0D00_BE11 ^ end)
}

/// The digest an end reports after a clean run.
pub fn expected_digest(seed: u64, end: u64) -> u64 {
    (0..ITERS as u64).fold(seed_digest(seed, end), fold)
}

fn recv<B: Bell>(
    ep: &mut Endpoint,
    bell: &mut B,
    buf: &mut [u8],
    seq: u64,
    s: &mut Summary,
) -> Result<usize, ChanError> {
    let start = bell.now();
    loop {
        // The head is read before the receive attempt: if the peer
        // publishes after it, the wait sees a changed head and returns.
        let seen = ep.peer_head().load(Acquire);
        if let Some(n) = ep.recv(buf) {
            return Ok(n);
        }
        match bell.wait(ep.peer_head(), seen) {
            Wait::NoHalt => {}
            Wait::Woken => {
                s.halts += 1;
                s.woken += 1;
            }
            Wait::Ticked => s.halts += 1,
        }
        let now = bell.now();
        if now.wrapping_sub(start) > bell.patience() {
            return Err(ChanError::PeerSilent { size: SIZE, seq });
        }
        bell.beat();
    }
}

fn send<B: Bell>(ep: &mut Endpoint, bell: &mut B, msg: &[u8], seq: u64) -> Result<(), ChanError> {
    // Ping-pong keeps at most one message in flight: the ring is never full
    // for long.
    let start = bell.now();
    loop {
        match ep.send(msg) {
            Ok(()) => {
                bell.ring();
                return Ok(());
            }
            Err(SendError::TooLarge) => return Err(ChanError::TooLarge { size: SIZE }),
            Err(SendError::Full) => {
                if bell.now().wrapping_sub(start) > bell.patience() {
                    return Err(ChanError::PeerSilent { size: SIZE, seq });
                }
                core::hint::spin_loop();
            }
        }
    }
}

/// Runs one end (`end` 0 leads). `msg`, `reference` and `rx` are scratch
/// buffers of at least [`SIZE`] bytes, `rtts` at least [`ITERS`] entries.
#[allow(clippy::too_many_arguments)]
pub fn run<B: Bell>(
    ep: &mut Endpoint,
    bell: &mut B,
    end: u64,
    seed: u64,
    msg: &mut [u8],
    reference: &mut [u8],
    rx: &mut [u8],
    rtts: &mut [u64],
) -> Result<Summary, ChanError> {
    if msg.len() < SIZE || reference.len() < SIZE || rx.len() < SIZE || rtts.len() < ITERS {
        return Err(ChanError::TooLarge { size: SIZE });
    }
    fill_reference(seed, SIZE, reference);
    let mut s = Summary { digest: seed_digest(seed, end), ..Summary::default() };
    for (i, rtt) in rtts[..ITERS].iter_mut().enumerate() {
        let seq = i as u64;
        msg[..SIZE].copy_from_slice(&reference[..SIZE]);
        msg[..8].copy_from_slice(&seq.to_le_bytes());
        let t0 = bell.now();
        if end == 0 {
            send(ep, bell, &msg[..SIZE], seq)?;
        }
        let n = recv(ep, bell, rx, seq, &mut s)?;
        if rx[..n] != msg[..SIZE] {
            return Err(ChanError::BadPayload { size: SIZE, seq });
        }
        s.messages += 1;
        s.digest = fold(s.digest, seq);
        if end == 0 {
            *rtt = bell.now().wrapping_sub(t0);
        } else {
            send(ep, bell, &rx[..n], seq)?;
        }
    }
    if end == 0 {
        let r = &mut rtts[..ITERS];
        r.sort_unstable();
        s.rtt_median = r[ITERS / 2];
        s.rtt_min = r[0];
        s.rtt_p90 = r[ITERS * 9 / 10];
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use std::vec;
    use std::vec::Vec;

    /// Two host threads; the "doorbell" is a counter, and a wait spins
    /// until the head moves (a halt that the ring ends).
    struct HostBell {
        rung: Arc<AtomicU64>,
        t0: std::time::Instant,
    }

    impl Bell for HostBell {
        fn now(&mut self) -> u64 {
            self.t0.elapsed().as_nanos() as u64
        }
        fn ring(&mut self) {
            self.rung.fetch_add(1, Ordering::Release);
        }
        fn wait(&mut self, head: &AtomicU64, seen: u64) -> Wait {
            if head.load(Acquire) & 0xffff != seen & 0xffff {
                return Wait::NoHalt;
            }
            let t = std::time::Instant::now();
            while head.load(Acquire) & 0xffff == seen & 0xffff {
                if t.elapsed() > std::time::Duration::from_secs(10) {
                    break;
                }
                std::thread::yield_now();
            }
            Wait::Woken
        }
        fn beat(&mut self) {}
        fn patience(&self) -> u64 {
            20_000_000_000
        }
    }

    fn region() -> Vec<AtomicU64> {
        (0..4096).map(|_| AtomicU64::new(0)).collect()
    }

    #[test]
    fn both_ends_check_every_message_and_report_the_expected_digests() {
        let r0: &'static [AtomicU64] = region().leak();
        let r1: &'static [AtomicU64] = region().leak();
        let rung = Arc::new(AtomicU64::new(0));
        let ends: Vec<_> = [(r0, r1, 0u64), (r1, r0, 1u64)]
            .into_iter()
            .map(|(own, peer, end)| {
                let rung = rung.clone();
                std::thread::spawn(move || {
                    let mut ep = Endpoint::new(own, peer, 7 + end).unwrap();
                    let mut bell = HostBell { rung, t0: std::time::Instant::now() };
                    let (mut a, mut b, mut c) = (vec![0; SIZE], vec![0; SIZE], vec![0; SIZE]);
                    let mut rtts = vec![0; ITERS];
                    run(&mut ep, &mut bell, end, 42, &mut a, &mut b, &mut c, &mut rtts).unwrap()
                })
            })
            .collect();
        for (end, h) in ends.into_iter().enumerate() {
            let s = h.join().unwrap();
            assert_eq!(s.messages, ITERS as u64);
            assert_eq!(s.digest, expected_digest(42, end as u64));
            assert_ne!(s.digest, expected_digest(43, end as u64));
        }
        // One ring per message sent, at both ends.
        assert_eq!(rung.load(Ordering::Acquire), 2 * ITERS as u64);
    }
}
