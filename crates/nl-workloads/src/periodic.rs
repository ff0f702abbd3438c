//! `periodic` and `storm`: the two sides of the budget storm test.
//!
//! `periodic` is a sandbox with a CPU reservation: vCPU 0 works greedily in
//! ring 3 and accounts, with the TSC, how much CPU time it got in every
//! period. Between two reads of the TSC it does one small unit of work (an
//! "op", a few nanoseconds); a step between two reads longer than the gap
//! ([`GAP_US`]) means the vCPU did not run (its thread was preempted on the
//! host, or the guest kernel took an interrupt), so only steps up to the gap
//! count as CPU time got. Periods are consecutive windows of `period`
//! cycles from the workload's start; a window the vCPU slept through
//! entirely counts 0. [`Accounting`] is the bookkeeping, shared by the
//! guest and the host's unit tests.
//!
//! `storm` rings its first channel's doorbell as fast as it can: every ring
//! is an MMIO exit into the host kernel (ioeventfd) and an interrupt into
//! the peer (irqfd), the "spinning on doorbells" of the Quest-V storm.
//!
//! Both are self-verifying in what they compute: `periodic`'s digest folds
//! one [`mix64`] per op, so the host checks the op count against the digest
//! ([`periodic_digest`]); `storm`'s folds the ring count
//! ([`storm_digest`]). How much CPU the periodic sandbox got is a
//! measurement, not a check: it is reported ([`Summary`]), and the storm
//! test and bench judge it.

use crate::{fold, mix64};

/// A step between two TSC reads longer than this (µs) is time the vCPU did
/// not run.
pub const GAP_US: u64 = 20;

/// Most periods whose CPU time is kept one by one (for the report's list).
pub const MAX_PERIODS: usize = 1024;

/// What a run's periods got.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// Complete periods.
    pub periods: u64,
    /// Of those, periods that got at least the reservation.
    pub met: u64,
    /// The least CPU (cycles) any complete period got.
    pub worst: u64,
    /// CPU (cycles) got over all complete periods.
    pub total: u64,
}

/// Per-period CPU accounting from TSC reads.
pub struct Accounting<'a> {
    period: u64,
    reserve: u64,
    gap: u64,
    /// The current period's end.
    end: u64,
    /// The last TSC read.
    last: u64,
    /// CPU got in the current period.
    got: u64,
    summary: Summary,
    /// CPU got per complete period (the first [`MAX_PERIODS`]).
    log: &'a mut [u64],
}

impl<'a> Accounting<'a> {
    /// Starts at TSC `start` with periods of `period` cycles, a
    /// reservation of `reserve` cycles per period and a gap of `gap`
    /// cycles. `log` receives each complete period's CPU (as many as fit).
    pub fn new(start: u64, period: u64, reserve: u64, gap: u64, log: &'a mut [u64]) -> Self {
        let period = period.max(1);
        Accounting {
            period,
            reserve,
            gap,
            end: start.wrapping_add(period),
            last: start,
            got: 0,
            summary: Summary { worst: u64::MAX, ..Summary::default() },
            log,
        }
    }

    fn close(&mut self) {
        let s = &mut self.summary;
        if let Some(slot) = self.log.get_mut(s.periods as usize) {
            *slot = self.got;
        }
        s.periods += 1;
        s.met += u64::from(self.got >= self.reserve);
        s.worst = s.worst.min(self.got);
        s.total += self.got;
        self.got = 0;
    }

    /// Accounts the step from the last read to `now`: CPU time if it is at
    /// most the gap, and every period end it crosses closes a period.
    pub fn observe(&mut self, now: u64) {
        let running = now.wrapping_sub(self.last) <= self.gap;
        let mut from = self.last;
        // Bounded: one pass per period end crossed (a long gap crosses many).
        while now >= self.end {
            if running {
                self.got += self.end - from;
            }
            from = self.end;
            self.close();
            self.end += self.period;
        }
        if running {
            self.got += now - from;
        }
        self.last = now;
    }

    /// The complete periods so far (the current one is left out).
    pub fn summary(&self) -> Summary {
        let mut s = self.summary;
        if s.periods == 0 {
            s.worst = 0;
        }
        s
    }

    /// CPU got in each complete period (the first [`MAX_PERIODS`]).
    pub fn log(&self) -> &[u64] {
        let n = (self.summary.periods as usize).min(self.log.len());
        &self.log[..n]
    }
}

/// One op of `periodic`: the value op `i` folds into the digest.
#[inline(always)]
pub fn op(seed: u64, i: u64) -> u64 {
    mix64(seed ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// The digest from the running sum (`seed` plus [`op`] of every op, wrapping)
/// and the op count.
pub fn finish(sum: u64, ops: u64) -> u64 {
    fold(sum, ops)
}

/// The digest of `ops` ops of `periodic` with `seed` (what the guest
/// reports; the host recomputes it).
pub fn periodic_digest(seed: u64, ops: u64) -> u64 {
    let mut d = seed;
    for i in 0..ops {
        d = d.wrapping_add(op(seed, i));
    }
    finish(d, ops)
}

/// The digest of a storm that rang `rings` times with `seed`.
pub fn storm_digest(seed: u64, rings: u64) -> u64 {
    fold(fold(seed, 0x5354_4f52_4d00_0000), rings)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steady_running_gets_whole_periods() {
        let mut log = [0u64; 8];
        let mut a = Accounting::new(1000, 100, 60, 5, &mut log);
        for t in (1000..=1450).step_by(5) {
            a.observe(t);
        }
        let s = a.summary();
        assert_eq!(s.periods, 4);
        assert_eq!((s.met, s.worst, s.total), (4, 100, 400));
        assert_eq!(a.log(), &[100, 100, 100, 100]);
    }

    #[test]
    fn gaps_are_not_counted_and_slept_periods_get_nothing() {
        let mut log = [0u64; 8];
        let mut a = Accounting::new(0, 100, 60, 5, &mut log);
        // Runs 0..50, preempted 50..80 (one step of 30), runs 80..100.
        for t in (5..=50).step_by(5) {
            a.observe(t);
        }
        a.observe(80);
        for t in (85..=100).step_by(5) {
            a.observe(t);
        }
        // Then asleep from 100 to 330: periods 1 and 2 get 0 and period 3
        // starts with a gap.
        a.observe(330);
        for t in (335..=400).step_by(5) {
            a.observe(t);
        }
        let s = a.summary();
        assert_eq!(a.log(), &[70, 0, 0, 70]);
        assert_eq!((s.periods, s.met, s.worst, s.total), (4, 2, 0, 140));
    }

    #[test]
    fn a_running_step_across_a_period_end_is_split() {
        let mut log = [0u64; 4];
        let mut a = Accounting::new(0, 100, 10, 50, &mut log);
        // 0..90 is one long step (not running); 90..130 runs across the
        // end at 100; 130..200 is a long step again.
        a.observe(90);
        a.observe(130);
        a.observe(200);
        assert_eq!(a.log(), &[10, 30]);
        let mut log = [0u64; 4];
        let mut a = Accounting::new(0, 100, 10, 50, &mut log);
        a.observe(40);
        a.observe(80);
        a.observe(120);
        a.observe(160);
        a.observe(200);
        assert_eq!(a.log(), &[100, 100]);
    }

    #[test]
    fn digests_depend_on_every_input() {
        assert_ne!(periodic_digest(1, 100), periodic_digest(1, 101));
        assert_ne!(periodic_digest(1, 100), periodic_digest(2, 100));
        assert_ne!(storm_digest(1, 5), storm_digest(1, 6));
        assert_ne!(storm_digest(1, 5), storm_digest(2, 5));
    }
}
