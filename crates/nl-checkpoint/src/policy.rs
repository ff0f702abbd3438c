//! Which capture the auto mode uses for the next interval, from the dirty
//! rate it observed and this host's unit costs.
//!
//! Two captures are weighed (both keep the shadow image of [`crate::shadow`]):
//!
//! * **dirty log**: KVM write-protects guest RAM; each first write to a page
//!   in an interval costs the guest a fault (`log_fault_us`), and the
//!   checkpoint copies the pages the log names (`copy_us` each, spread over
//!   the scan threads).
//! * **compare** (fault-free): no tracking while the guest runs; the
//!   checkpoint compares every allocated page with the shadow (`compare_us`
//!   each, spread over the scan threads) while the vCPUs are stopped.
//!
//! Copy-on-write is not a candidate: its userfaultfd fault costs 10 to 20
//! times the dirty log's on this host (PVM) and several times it on VMX, for
//! the same pages, so it never wins this comparison (it stays a `--mode`).
//!
//! The comparison is in time the guest loses per interval. A switch needs a
//! 25% margin, so noise does not make the engine flap.

use std::time::Instant;

use serde::Serialize;

use crate::PAGE;

/// A dirty-log first write on this host (PVM; `bench` measures it: about
/// 8 µs). Hardware with EPT/NPT A/D-bit or PML logging is cheaper; the
/// choice only has to be right within a factor of about two.
pub const LOG_FAULT_US: f64 = 8.0;

/// The capture an interval uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Capture {
    DirtyLog,
    Compare,
}

impl Capture {
    pub fn name(self) -> &'static str {
        match self {
            Capture::DirtyLog => "dirty-log",
            Capture::Compare => "compare",
        }
    }
}

/// Unit costs, in microseconds per page.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct UnitCosts {
    pub log_fault_us: f64,
    /// Reading a page from guest memory and copying it into the shadow.
    pub copy_us: f64,
    /// Reading a page from guest memory and comparing it with the shadow.
    pub compare_us: f64,
    /// Threads a checkpoint's scan runs on.
    pub threads: usize,
}

impl UnitCosts {
    /// Measures the copy and compare costs on this host (about 4 MiB of
    /// memory traffic, a few milliseconds); the fault cost is `log_fault_us`.
    pub fn calibrate(log_fault_us: f64, threads: usize) -> Self {
        const PAGES: usize = 512;
        let src: Vec<u8> = (0..PAGES * PAGE).map(|i| (i * 7 + i / PAGE) as u8).collect();
        let mut dst = src.clone();
        // Copy: best of three passes.
        let mut copy = f64::MAX;
        for _ in 0..3 {
            let t = Instant::now();
            for (d, s) in dst.chunks_exact_mut(PAGE).zip(src.chunks_exact(PAGE)) {
                d.copy_from_slice(std::hint::black_box(s));
            }
            std::hint::black_box(&dst);
            copy = copy.min(t.elapsed().as_secs_f64() * 1e6 / PAGES as f64);
        }
        // Compare (equal pages: the whole page is read): a read into a
        // buffer and a comparison, as the scan does.
        let mut buf = vec![0u8; PAGE];
        let mut cmp = f64::MAX;
        for _ in 0..3 {
            let t = Instant::now();
            let mut same = 0usize;
            for (d, s) in dst.chunks_exact(PAGE).zip(src.chunks_exact(PAGE)) {
                buf.copy_from_slice(std::hint::black_box(s));
                same += usize::from(std::hint::black_box(&buf[..]) == d);
            }
            std::hint::black_box(same);
            cmp = cmp.min(t.elapsed().as_secs_f64() * 1e6 / PAGES as f64);
        }
        Self { log_fault_us, copy_us: copy, compare_us: cmp, threads: threads.max(1) }
    }

    /// Guest time lost per interval (µs) with the dirty log, for `dirty`
    /// pages written per interval.
    pub fn log_cost_us(&self, dirty: usize) -> f64 {
        dirty as f64 * (self.log_fault_us + self.copy_us / self.threads as f64)
    }

    /// Guest time lost per interval (µs) with the compare capture over
    /// `allocated` pages of which `dirty` changed.
    pub fn compare_cost_us(&self, allocated: usize, dirty: usize) -> f64 {
        (allocated as f64 * self.compare_us + dirty as f64 * self.copy_us) / self.threads as f64
    }

    /// Folds a scan's measured cost (`us` of thread time for `visited`
    /// pages, `changed` of them copied) into the copy or compare cost: the
    /// start-up calibration runs on a quiet cache, the scans on the host as
    /// it is. Scans of fewer than 256 pages say too little.
    ///
    /// A scan whose threads took page faults on more than 1/16 of the
    /// pages visited paid one-time costs (undo buffers, shadow image or
    /// guest pages touched for the first time, 3 to 12 µs each on a PVM
    /// host) and is not learnt from: one such compare scan made the compare
    /// look dear for the rest of a run, which then stayed on the dirty log
    /// at 1/400 of its unprotected rate (the log's faults throttle the
    /// guest, so the dirty rate it sees stays low and the log looks cheap).
    pub fn learn_scan(
        &mut self,
        capture: Capture,
        us: f64,
        visited: usize,
        changed: usize,
        faults: u64,
    ) {
        if visited < 256 || !us.is_finite() || faults > visited as u64 / 16 {
            return;
        }
        match capture {
            Capture::DirtyLog => self.copy_us = 0.5 * self.copy_us + 0.5 * us / visited as f64,
            Capture::Compare => {
                let cmp = (us - changed as f64 * self.copy_us).max(0.0) / visited as f64;
                self.compare_us = 0.5 * self.compare_us + 0.5 * cmp;
            }
        }
    }
}

/// Chooses the next interval's capture.
#[derive(Clone, Debug)]
pub struct Policy {
    pub costs: UnitCosts,
    pub current: Capture,
    /// Intervals captured each way.
    pub intervals_log: u64,
    pub intervals_compare: u64,
    pub switches: u64,
}

/// A switch must save at least this share of the current capture's cost.
const MARGIN: f64 = 1.25;

impl Policy {
    /// Starts with the dirty log: the first interval measures the dirty rate.
    pub fn new(costs: UnitCosts) -> Self {
        Self {
            costs,
            current: Capture::DirtyLog,
            intervals_log: 0,
            intervals_compare: 0,
            switches: 0,
        }
    }

    /// The interval that just ended wrote `dirty` pages (as far as its
    /// capture saw) out of `allocated`; returns the capture for the next.
    pub fn next(&mut self, dirty: usize, allocated: usize) -> Capture {
        match self.current {
            Capture::DirtyLog => self.intervals_log += 1,
            Capture::Compare => self.intervals_compare += 1,
        }
        let log = self.costs.log_cost_us(dirty);
        let cmp = self.costs.compare_cost_us(allocated, dirty);
        let next = match self.current {
            Capture::DirtyLog if cmp * MARGIN < log => Capture::Compare,
            Capture::Compare if log * MARGIN < cmp => Capture::DirtyLog,
            c => c,
        };
        if next != self.current {
            self.switches += 1;
            self.current = next;
        }
        next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn costs() -> UnitCosts {
        UnitCosts { log_fault_us: 8.0, copy_us: 0.5, compare_us: 0.5, threads: 2 }
    }

    #[test]
    fn many_dirty_pages_switch_to_compare_and_few_switch_back() {
        let mut p = Policy::new(costs());
        // 16384 pages written of 20000 allocated: the log costs 135 ms of
        // faults, a compare 9 ms.
        assert_eq!(p.next(16384, 20000), Capture::Compare);
        assert_eq!(p.next(16000, 20000), Capture::Compare);
        // 100 pages: the log costs 0.8 ms, the compare 5 ms.
        assert_eq!(p.next(100, 20000), Capture::DirtyLog);
        assert_eq!(p.switches, 2);
        assert_eq!((p.intervals_log, p.intervals_compare), (1, 2));
    }

    #[test]
    fn a_near_tie_does_not_switch() {
        let c = costs();
        let mut p = Policy::new(c);
        // Find a dirty count where the compare is just cheaper (within the margin).
        let alloc = 20000;
        let d = (1..alloc).find(|&d| c.compare_cost_us(alloc, d) < c.log_cost_us(d)).unwrap();
        assert_eq!(p.next(d, alloc), Capture::DirtyLog);
    }

    #[test]
    fn a_slow_compare_scan_moves_the_choice_back_to_the_log() {
        let mut p = Policy::new(costs());
        // 2000 of 20000 pages: compare (5.5 ms) beats the log (16.5 ms).
        assert_eq!(p.next(2000, 20000), Capture::Compare);
        // The scans take 4 us per page on this host as loaded now.
        for _ in 0..4 {
            p.costs.learn_scan(Capture::Compare, 20000.0 * 4.0 + 2000.0 * 0.5, 20000, 2000, 0);
        }
        assert!(p.costs.compare_us > 3.0, "{}", p.costs.compare_us);
        assert_eq!(p.next(2000, 20000), Capture::DirtyLog);
    }

    /// Scans that took page faults on many of their pages (first touches)
    /// do not move the costs: compare stays chosen for a guest that writes
    /// many pages, however slow those scans were.
    #[test]
    fn scans_that_paid_one_time_faults_are_not_learnt_from() {
        let mut p = Policy::new(costs());
        assert_eq!(p.next(16000, 20000), Capture::Compare);
        for _ in 0..8 {
            // 15 µs per page, with a fault on 4000 of the 20000 pages.
            p.costs.learn_scan(Capture::Compare, 20000.0 * 15.0, 20000, 16000, 4000);
            p.costs.learn_scan(Capture::DirtyLog, 2000.0 * 20.0, 2000, 2000, 2000);
        }
        assert_eq!((p.costs.compare_us, p.costs.copy_us), (0.5, 0.5));
        assert_eq!(p.next(16000, 20000), Capture::Compare);
        // The same scans without faults are learnt from.
        p.costs.learn_scan(Capture::Compare, 20000.0 * 15.0, 20000, 16000, 0);
        assert!(p.costs.compare_us > 0.5);
    }

    #[test]
    fn calibration_measures_positive_costs() {
        let c = UnitCosts::calibrate(LOG_FAULT_US, 2);
        assert!(c.copy_us > 0.0 && c.copy_us.is_finite());
        assert!(c.compare_us > 0.0 && c.compare_us.is_finite());
    }
}
