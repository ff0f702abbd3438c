//! The fault-free compare capture for replication epochs
//! (`Options::compare`): no write tracking at all, so the guest takes no
//! write fault. At each boundary, with the vCPUs stopped, every page the
//! guest's memory has allocated is compared with a shadow of what the
//! backup has (`nl_checkpoint::shadow`, spread over the host's cores), and
//! the pages that differ are the epoch's; the shadow is updated as they are
//! found. It costs a compare of the whole working set per epoch, whatever
//! the guest wrote: it pays where the guest writes most of its working set
//! every epoch and each write fault costs more than a page compare (on this
//! PVM host a dirty-log first write costs about 8 µs, a compare under 1 µs).

use std::time::Instant;

use nl_checkpoint::policy::Capture;
use nl_checkpoint::shadow::{scan_threads, ScanStats, Shadow};
use nl_memory::GuestMemory;

/// The shadow of what the backup has, and what the scans cost.
pub(crate) struct Compare {
    shadow: Option<Shadow>,
    /// Pages compared, over every boundary so far.
    pub(crate) scanned: u64,
    /// Boundaries scanned.
    pub(crate) scans: u64,
    /// Wall time of the scans, summed (ms).
    pub(crate) scan_ms: f64,
    /// The last scan's stats, until the auto capture reads them.
    pub(crate) last_scan: Option<ScanStats>,
}

impl Compare {
    pub(crate) fn new() -> Self {
        Compare { shadow: None, scanned: 0, scans: 0, scan_ms: 0.0, last_scan: None }
    }

    /// At a full copy (VM paused): the backup gets memory as it is now.
    pub(crate) fn restart(&mut self, mem: &GuestMemory) -> Result<(), String> {
        self.shadow = Some(Shadow::capture(mem).map_err(|e| format!("compare capture: {e}"))?);
        Ok(())
    }

    /// What the backup has (and, after a boundary's scan, this epoch's
    /// pages) of `[gpa, gpa + len)`: an epoch can be sent from here, with
    /// the vCPUs running, until the next boundary's scan.
    pub(crate) fn slice(&self, gpa: u64, len: usize) -> Result<&[u8], String> {
        self.shadow
            .as_ref()
            .and_then(|s| s.slice(gpa, len))
            .ok_or_else(|| format!("{gpa:#x}+{len:#x} is not in the compare's shadow"))
    }

    /// Drops the shadow (the log tracks the epochs from now on).
    pub(crate) fn forget(&mut self) {
        self.shadow = None;
    }

    /// At a boundary (VM paused): the pages whose content changed since
    /// the last boundary (or full copy), sorted; the shadow then equals
    /// memory.
    pub(crate) fn take(&mut self, mem: &GuestMemory) -> Result<Vec<u64>, String> {
        let t = Instant::now();
        let shadow =
            self.shadow.as_mut().ok_or("compare capture: a boundary before the full copy")?;
        let ranges = mem.allocated_ranges().map_err(|e| format!("compare capture: {e}"))?;
        let mut changed = Vec::new();
        let st = shadow
            .sync(mem, &ranges, scan_threads(), &mut changed)
            .map_err(|e| format!("compare capture: {e}"))?;
        changed.sort_unstable();
        self.scanned += st.visited as u64;
        self.scans += 1;
        self.scan_ms += t.elapsed().as_secs_f64() * 1e3;
        self.last_scan = Some(st);
        Ok(changed)
    }
}

/// Which capture an epoch uses under `Options::auto_capture`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// KVM's dirty log, selective re-protection and prediction.
    Log,
    /// The compare capture (the dirty log stays on, never cleared: a page
    /// faults once, then stays writable).
    Compare,
}

/// Counts of the auto capture's epochs, for the primary's report.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct AutoStats {
    pub epochs_log: u64,
    pub epochs_compare: u64,
    pub switches: u64,
}

/// The epoch-by-epoch choice between the dirty log and the compare capture
/// (`Options::auto_capture`), in the guest time each loses per epoch with
/// this host's unit costs (`nl_checkpoint::policy::UnitCosts`):
///
/// * the log: the epoch's write faults (prediction leaves pages it guessed
///   writable: they take none), at `log_fault_us` each;
/// * the compare: a compare of every allocated page and a shadow copy of
///   each changed one, spread over the scan threads, in the pause.
///
/// While comparing, the log's faults are estimated from the changed pages
/// and the share of shipped pages that faulted in the last log epochs.
/// Into the compare, a switch needs a 25% margin in two epochs in a row;
/// back to the log, which costs a fault on every page the guest then
/// writes (all are protected again) and prediction starting afresh, a
/// margin of 4 in four epochs in a row (a guest that stops writing goes
/// back; one that writes a thousand pages an epoch stays). Epochs in which
/// the guest's memory grew do not count towards going back (they counted
/// both ways in one measured version, which then reached the compare only
/// after 13 to 16 epochs on the log). The first epochs after a switch
/// (prediction warming up, the shadow just taken) are not judged. Measured:
/// with back-switches as easy as forth, a 64 MiB writer flapped 3 to 5
/// times in 1.5 s and ran at 0.51 to 0.58 of unreplicated, under both
/// captures alone (docs/performance.md).
pub(crate) struct Auto {
    costs: nl_checkpoint::policy::UnitCosts,
    pub(crate) mode: Mode,
    /// Write faults per shipped page in the log epochs (smoothed).
    fault_share: f64,
    /// Epochs in a row that favoured the other capture.
    streak: u32,
    /// Epochs since the last switch.
    since: u32,
    /// The guest's allocated pages at the last epoch.
    allocated: usize,
    pub(crate) stats: AutoStats,
}

/// A switch to the compare must save at least this share of the log's cost.
const MARGIN: f64 = 1.25;
/// A switch back to the log must save at least this share of the
/// compare's: the model counts the log's faults at a quiet host's cost and
/// leaves out what prediction costs when it fails (fake-dirty copies),
/// which is where the log loses most under load (measured with 2: a 64 MiB
/// writer beside two busy loops went back to the log and ran at 0.15 of
/// unreplicated, against 0.43 under the compare alone).
const MARGIN_BACK: f64 = 4.0;
/// Epochs in a row that must favour the other capture.
const STREAK: u32 = 2;
const STREAK_BACK: u32 = 4;
/// Epochs after a switch that are not judged.
const SETTLE: u32 = 2;

impl Auto {
    pub(crate) fn new() -> Self {
        let costs = nl_checkpoint::policy::UnitCosts::calibrate(
            nl_checkpoint::policy::LOG_FAULT_US,
            scan_threads(),
        );
        Auto {
            costs,
            mode: Mode::Log,
            fault_share: 1.0,
            streak: 0,
            since: 0,
            allocated: 0,
            stats: AutoStats::default(),
        }
    }

    /// After a full copy: the log, from the start.
    pub(crate) fn reset(&mut self) {
        self.mode = Mode::Log;
        self.streak = 0;
        self.since = 0;
    }

    /// The log's and the compare's costs (µs) of an epoch that wrote
    /// `changed` pages with `faults` write faults, `allocated` pages in all.
    fn costs(&self, changed: usize, faults: f64, allocated: usize) -> (f64, f64) {
        (faults * self.costs.log_fault_us, self.costs.compare_cost_us(allocated, changed))
    }

    /// The epoch that just ended; returns the capture of the next.
    /// `shipped`: pages collected; `faults`: the log's write faults (log
    /// epochs); `scan`: the compare scan's stats (compare epochs);
    /// `allocated`: the guest's allocated pages.
    pub(crate) fn next(
        &mut self,
        shipped: usize,
        faults: u64,
        scan: Option<ScanStats>,
        allocated: usize,
    ) -> Mode {
        self.since += 1;
        // An epoch in which the guest's memory grew by over 1/16 does not
        // count towards going back to the log: first touches of new memory (a host page fault each)
        // slow the guest whatever the capture, so it changes few pages and
        // the compare's scan looks dear (measured: 64 MiB writers went back
        // to the log while growing, then had to come back).
        let growing = allocated > self.allocated + self.allocated / 16;
        self.allocated = allocated;
        let (log, cmp) = match self.mode {
            Mode::Log => {
                self.stats.epochs_log += 1;
                if shipped >= 64 && self.since > 1 {
                    let share = (faults as f64 / shipped as f64).min(1.0);
                    self.fault_share = 0.5 * self.fault_share + 0.5 * share;
                }
                self.costs(shipped, faults as f64, allocated)
            }
            Mode::Compare => {
                self.stats.epochs_compare += 1;
                // Learnt from as nl-checkpoint's auto mode learns from its
                // compare scans (one-time faults left out).
                if let Some((s, us)) = scan.and_then(|s| s.cpu_us.map(|us| (s, us))) {
                    self.costs.learn_scan(Capture::Compare, us, s.visited, s.changed, s.faults);
                }
                self.costs(shipped, shipped as f64 * self.fault_share, allocated)
            }
        };
        let other = match self.mode {
            Mode::Log if cmp * MARGIN < log => Some((Mode::Compare, STREAK)),
            Mode::Compare if log * MARGIN_BACK < cmp => Some((Mode::Log, STREAK_BACK)),
            _ => None,
        };
        match other {
            Some((m, streak)) if self.since > SETTLE && !(growing && m == Mode::Log) => {
                self.streak += 1;
                if self.streak >= streak {
                    self.mode = m;
                    self.streak = 0;
                    self.since = 0;
                    self.stats.switches += 1;
                }
            }
            _ => self.streak = 0,
        }
        self.mode
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auto() -> Auto {
        let mut a = Auto::new();
        a.costs = nl_checkpoint::policy::UnitCosts {
            log_fault_us: 8.0,
            copy_us: 0.5,
            compare_us: 0.5,
            threads: 2,
        };
        a
    }

    /// A guest that faults on thousands of pages an epoch (64 MiB written
    /// all over) moves to the compare after two judged epochs; one whose
    /// writes prediction catches (few faults) stays on the log; back on
    /// the log once the compare finds few changed pages.
    #[test]
    fn many_faults_move_to_the_compare_and_few_changes_move_back() {
        let mut a = auto();
        for i in 0..SETTLE + STREAK - 1 {
            assert_eq!(a.next(6700, 2600, None, 11500), Mode::Log, "epoch {i}");
        }
        assert_eq!(a.next(6700, 2600, None, 11500), Mode::Compare);
        for _ in 0..5 {
            assert_eq!(a.next(4000, 0, None, 11500), Mode::Compare);
        }
        // The guest now writes 50 pages an epoch.
        for i in 0..STREAK_BACK - 1 {
            assert_eq!(a.next(50, 0, None, 11500), Mode::Compare, "epoch {i}");
        }
        assert_eq!(a.next(50, 0, None, 11500), Mode::Log);
        assert_eq!(a.stats.switches, 2);

        // Sequential 8 MiB under prediction: 2000 pages, 35 faults.
        let mut b = auto();
        for _ in 0..10 {
            assert_eq!(b.next(2000, 35, None, 3000), Mode::Log);
        }
        assert_eq!(b.stats.switches, 0);
    }

    /// While the guest's memory grows, few changed pages do not move it
    /// back to the log; once it stops growing, they do. Growth does not
    /// hold back the move to the compare.
    #[test]
    fn growing_memory_is_not_judged() {
        let mut g = auto();
        let mut alloc = 2000;
        for _ in 0..SETTLE + STREAK {
            alloc += alloc / 8;
            g.next(6700, 2600, None, alloc);
        }
        assert_eq!(g.mode, Mode::Compare);
        let mut a = auto();
        for _ in 0..SETTLE + STREAK {
            a.next(6700, 2600, None, 11500);
        }
        assert_eq!(a.mode, Mode::Compare);
        let mut alloc = 11500;
        for _ in 0..10 {
            alloc += alloc / 8;
            assert_eq!(a.next(50, 0, None, alloc), Mode::Compare);
        }
        for _ in 0..STREAK_BACK {
            a.next(50, 0, None, alloc);
        }
        assert_eq!(a.mode, Mode::Log);
    }

    /// A single epoch either way does not switch (noise).
    #[test]
    fn one_odd_epoch_does_not_switch() {
        let mut a = auto();
        for i in 0..20 {
            let faults = if i % 2 == 0 { 5000 } else { 10 };
            assert_eq!(a.next(6000, faults, None, 11500), Mode::Log, "epoch {i}");
        }
    }
}
