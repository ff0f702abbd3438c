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

use std::time::{Duration, Instant};

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
    /// Whether the guest's measured progress was judging switches at the
    /// end (`Gate`); false for a guest without a heartbeat, or idle.
    pub by_progress: bool,
    /// Switches undone because the guest ran slower after them.
    pub undone: u64,
    /// The guest's ops/s under the log and under the compare around the
    /// last judged switch.
    pub last_judged_ops_per_sec: Option<[f64; 2]>,
}

/// The epoch-by-epoch choice between the dirty log and the compare capture
/// (`Options::auto_capture`, on by default). A cost model proposes each
/// switch, in the guest time each capture loses per epoch with this host's
/// unit costs (`nl_checkpoint::policy::UnitCosts`), and the guest's
/// measured progress (the reference guest's heartbeat) keeps or undoes it
/// ([`Gate`]); a guest without such a count (Linux) stays on the log. The
/// model:
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
/// captures alone (docs/performance.md). Beside two busy loops the model
/// alone once went back to the log and the guest ran at 0.07 of
/// unreplicated against 0.41 under the compare: the gate is there to undo
/// such a switch (no bench run has made one since it came). A
/// chooser by progress alone (each capture measured in turn) was tried
/// and not kept: its first windows closed only after 16 to 20 epochs of a
/// growing 64 MiB writer, which then ran at 0.22 to 0.55 against 0.85
/// under the compare.
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
    gate: Gate,
    /// Whether the model's switches need the gate (always, but in the
    /// model's own unit tests).
    gated: bool,
    /// The counts kept here; the gate's are added by [`Auto::stats`].
    stats: AutoStats,
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
            gate: Gate::new(),
            gated: true,
            stats: AutoStats::default(),
        }
    }

    /// After a full copy: the log, from the start.
    pub(crate) fn reset(&mut self) {
        self.mode = Mode::Log;
        self.streak = 0;
        self.since = 0;
        self.gate = Gate::new();
    }

    /// What the progress gate measured and decided at the last epoch, if
    /// it did (a judged switch).
    pub(crate) fn take_note(&mut self) -> Option<String> {
        Some(std::mem::take(&mut self.gate.note)).filter(|n| !n.is_empty())
    }

    /// The counts for the primary's report.
    pub(crate) fn stats(&self) -> AutoStats {
        AutoStats {
            undone: self.gate.undone,
            last_judged_ops_per_sec: self.gate.judged.map(|(l, c)| [l, c]),
            ..self.stats
        }
    }

    fn switch(&mut self, m: Mode) {
        self.mode = m;
        self.streak = 0;
        self.since = 0;
        self.stats.switches += 1;
    }

    /// The log's and the compare's costs (µs) of an epoch that wrote
    /// `changed` pages with `faults` write faults, `allocated` pages in all.
    fn costs(&self, changed: usize, faults: f64, allocated: usize) -> (f64, f64) {
        (faults * self.costs.log_fault_us, self.costs.compare_cost_us(allocated, changed))
    }

    /// The epoch that just ended; returns the capture of the next.
    /// `shipped`: pages collected; `faults`: the log's write faults (log
    /// epochs); `scan`: the compare scan's stats (compare epochs);
    /// `allocated`: the guest's allocated pages; `progress`: the guest's
    /// operations so far by its heartbeat, and now (`None` for a guest
    /// that keeps no such count): with them its measured progress keeps or
    /// undoes the model's switches ([`Gate`]).
    pub(crate) fn next(
        &mut self,
        shipped: usize,
        faults: u64,
        scan: Option<ScanStats>,
        allocated: usize,
        progress: Option<(u64, Instant)>,
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
        if let Some((ops, now)) = progress {
            if let Some(m) = self.gate.step(self.mode, ops, allocated, now) {
                self.switch(m);
                return self.mode;
            }
        }
        // A silent guest's switches are not judged: the model waits.
        let progress = progress.filter(|_| !self.gate.silent);
        self.stats.by_progress = progress.is_some();
        let other = match self.mode {
            Mode::Log if cmp * MARGIN < log => Some((Mode::Compare, STREAK)),
            Mode::Compare if log * MARGIN_BACK < cmp => Some((Mode::Log, STREAK_BACK)),
            _ => None,
        };
        match other {
            Some((m, streak))
                if self.since > SETTLE
                    && !(growing && m == Mode::Log)
                    && (!self.gated
                        || progress.is_some_and(|(_, now)| self.gate.allows(m, now))) =>
            {
                self.streak += 1;
                if self.streak >= streak {
                    let from = self.mode;
                    self.switch(m);
                    self.gate.switched(from);
                }
            }
            _ => self.streak = 0,
        }
        self.mode
    }
}

/// A progress window lasts at least this many epochs and this long.
const WINDOW_EPOCHS: u32 = 5;
const WINDOW_MIN: Duration = Duration::from_millis(100);
/// A switch is undone if the guest then runs slower than before it by this
/// factor: the heartbeat that gives the rate is written every
/// `nl_abi::HEARTBEAT_MS` of guest time, so a 100 ms window's rate is only
/// good to about a tenth.
const REVERT_MARGIN: f64 = 1.15;
/// How long the model may not switch into a capture whose trial was
/// undone; doubled at each further undo of a switch into it.
const HOLD: Duration = Duration::from_millis(500);
const HOLD_MAX: Duration = Duration::from_secs(8);

/// A window of progress: the guest's ops and the time at its start, its
/// epochs, the allocated pages at its start, whether memory grew in it.
#[derive(Clone, Copy, Debug)]
struct Window {
    ops: u64,
    at: Instant,
    epochs: u32,
    allocated: usize,
    grew: bool,
}

/// The progress gate of `--auto-capture`: the cost model proposes each
/// switch, and the guest's own measured progress (its heartbeat's
/// operations per second of wall time, pauses included) decides whether it
/// stays. The rate under the capture in use is measured in windows; after
/// a switch (and `SETTLE` epochs: the shadow being taken, every page
/// faulting once more on the way back to the log) one window is measured
/// under the new capture, and if the guest runs `REVERT_MARGIN` slower
/// than in the last window before the switch, the switch is undone and the
/// model may not make it again for `HOLD` (doubled at each further undo).
/// A window over which memory grew by over 1/16 (first touches slow a
/// guest whatever the capture) judges nothing. While a guest's count does
/// not move over a window (an idle guest; Linux writes none) it is
/// [`Gate::silent`] and the model does not switch it.
pub(crate) struct Gate {
    window: Option<Window>,
    /// The last closed window: the capture it was under, its rate, and
    /// whether memory grew in it.
    last: Option<(Mode, f64, bool)>,
    /// The switch being judged: the capture left and the rate under it.
    judging: Option<(Mode, f64)>,
    /// Model switches into [`Mode::Log`] and [`Mode::Compare`] wait until
    /// then, and the hold of the next undo.
    blocked: [Option<Instant>; 2],
    hold: [Duration; 2],
    /// Epochs since the last switch.
    since: u32,
    pub(crate) silent: bool,
    /// The last judged switch's rates (log, compare), for the report.
    pub(crate) judged: Option<(f64, f64)>,
    /// Switches undone.
    pub(crate) undone: u64,
    /// What the last step measured and decided, if it did (taken by the
    /// primary's log).
    pub(crate) note: String,
}

fn slot(m: Mode) -> usize {
    match m {
        Mode::Log => 0,
        Mode::Compare => 1,
    }
}

fn name(m: Mode) -> &'static str {
    match m {
        Mode::Log => "the dirty log",
        Mode::Compare => "the compare capture",
    }
}

fn other(m: Mode) -> Mode {
    match m {
        Mode::Log => Mode::Compare,
        Mode::Compare => Mode::Log,
    }
}

impl Gate {
    pub(crate) fn new() -> Self {
        Gate {
            window: None,
            last: None,
            judging: None,
            blocked: [None, None],
            hold: [HOLD, HOLD],
            since: 0,
            silent: false,
            judged: None,
            undone: 0,
            note: String::new(),
        }
    }

    /// Whether the model may switch into `m` now: not while held off, and
    /// only once a window under the capture in use has closed (the rate
    /// the switch is judged against), unless memory is growing (then no
    /// window would judge it anyway, and waiting for one kept a growing
    /// 64 MiB writer on the log for 9 to 10 epochs).
    pub(crate) fn allows(&self, m: Mode, now: Instant) -> bool {
        let measured = self.last.is_some() || self.window.is_some_and(|w| w.grew);
        measured && self.blocked[slot(m)].is_none_or(|until| now >= until)
    }

    /// The model switched from `from`: the switch is judged against the
    /// last window before it, if that was under `from` and memory did not
    /// grow in it.
    pub(crate) fn switched(&mut self, from: Mode) {
        self.judging = match self.last {
            Some((m, rate, false)) if m == from => Some((from, rate)),
            _ => None,
        };
        self.window = None;
        self.last = None;
        self.since = 0;
    }

    /// The epoch under `mode` that just ended, with the guest's ops so far
    /// and its allocated pages; returns the capture to go back to if the
    /// switch being judged made the guest slower.
    pub(crate) fn step(
        &mut self,
        mode: Mode,
        ops: u64,
        allocated: usize,
        now: Instant,
    ) -> Option<Mode> {
        self.since += 1;
        if self.since <= SETTLE {
            return None;
        }
        let fresh = Window { ops, at: now, epochs: 0, allocated, grew: false };
        let Some(w) = self.window.as_mut() else {
            self.window = Some(fresh);
            return None;
        };
        w.epochs += 1;
        w.grew |= allocated > w.allocated + w.allocated / 16;
        if ops < w.ops {
            // The count went back (the workload's measured period began).
            self.window = Some(fresh);
            return None;
        }
        let span = now.saturating_duration_since(w.at);
        if w.epochs < WINDOW_EPOCHS || span < WINDOW_MIN {
            return None;
        }
        let (done, grew) = (ops - w.ops, w.grew);
        self.window = Some(fresh);
        // Silent until the count moves again (an idle guest, or one
        // without a count).
        self.silent = done == 0;
        if self.silent {
            return None;
        }
        let rate = done as f64 / span.as_secs_f64();
        self.last = Some((mode, rate, grew));
        let (left, before) = self.judging.take().filter(|_| !grew)?;
        let (log, cmp) = if mode == Mode::Log { (rate, before) } else { (before, rate) };
        self.judged = Some((log, cmp));
        self.note = format!(
            "the guest ran {:.3e} ops/s under {} and {:.3e} under {} before",
            rate,
            name(mode),
            before,
            name(left)
        );
        if rate * REVERT_MARGIN >= before {
            self.hold[slot(mode)] = HOLD;
            return None;
        }
        let s = slot(mode);
        self.blocked[s] = Some(now + self.hold[s]);
        self.note += &format!("; {} held off for {} ms", name(mode), self.hold[s].as_millis());
        self.hold[s] = (self.hold[s] * 2).min(HOLD_MAX);
        self.undone += 1;
        // The window just closed is the judged rate under `mode`: the
        // way back is not judged (it restores what was measured).
        self.since = 0;
        self.window = None;
        self.last = None;
        Some(other(mode))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The model alone (its switches not gated).
    fn model() -> Auto {
        Auto { gated: false, ..auto() }
    }

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
        let mut a = model();
        for i in 0..SETTLE + STREAK - 1 {
            assert_eq!(a.next(6700, 2600, None, 11500, None), Mode::Log, "epoch {i}");
        }
        assert_eq!(a.next(6700, 2600, None, 11500, None), Mode::Compare);
        for _ in 0..5 {
            assert_eq!(a.next(4000, 0, None, 11500, None), Mode::Compare);
        }
        // The guest now writes 50 pages an epoch.
        for i in 0..STREAK_BACK - 1 {
            assert_eq!(a.next(50, 0, None, 11500, None), Mode::Compare, "epoch {i}");
        }
        assert_eq!(a.next(50, 0, None, 11500, None), Mode::Log);
        assert_eq!(a.stats().switches, 2);

        // Sequential 8 MiB under prediction: 2000 pages, 35 faults.
        let mut b = model();
        for _ in 0..10 {
            assert_eq!(b.next(2000, 35, None, 3000, None), Mode::Log);
        }
        assert_eq!(b.stats().switches, 0);
    }

    /// While the guest's memory grows, few changed pages do not move it
    /// back to the log; once it stops growing, they do. Growth does not
    /// hold back the move to the compare.
    #[test]
    fn growing_memory_is_not_judged() {
        let mut g = model();
        let mut alloc = 2000;
        for _ in 0..SETTLE + STREAK {
            alloc += alloc / 8;
            g.next(6700, 2600, None, alloc, None);
        }
        assert_eq!(g.mode, Mode::Compare);
        let mut a = model();
        for _ in 0..SETTLE + STREAK {
            a.next(6700, 2600, None, 11500, None);
        }
        assert_eq!(a.mode, Mode::Compare);
        let mut alloc = 11500;
        for _ in 0..10 {
            alloc += alloc / 8;
            assert_eq!(a.next(50, 0, None, alloc, None), Mode::Compare);
        }
        for _ in 0..STREAK_BACK {
            a.next(50, 0, None, alloc, None);
        }
        assert_eq!(a.mode, Mode::Log);
    }

    /// Drives `a` for `epochs` 20 ms epochs of a 64 MiB writer that faults
    /// on every page under the log (the model wants the compare) and makes
    /// `rate(mode)` ops per epoch; returns the modes the epochs ran under.
    fn drive(
        a: &mut Auto,
        ops: &mut u64,
        at: &mut Instant,
        epochs: u32,
        rate: impl Fn(Mode) -> u64,
    ) -> Vec<Mode> {
        let mut ran = Vec::new();
        for _ in 0..epochs {
            ran.push(a.mode);
            *ops += rate(a.mode);
            *at += Duration::from_millis(20);
            a.next(6700, 2600, None, 11500, Some((*ops, *at)));
        }
        ran
    }

    /// A switch after which the guest runs slower is undone, and the model
    /// may not make it again until a hold has passed; the next undo holds
    /// it off twice as long.
    #[test]
    fn a_switch_that_slows_the_guest_is_undone_and_held_off() {
        let (mut a, mut ops, mut at) = (auto(), 0, Instant::now());
        let rate = |m| if m == Mode::Compare { 10 } else { 40 };
        // (time, mode of the next epoch, undone so far) after each epoch.
        let mut seen = Vec::new();
        for _ in 0..200 {
            drive(&mut a, &mut ops, &mut at, 1, rate);
            seen.push((at, a.mode, a.stats().undone));
        }
        let undo = |n| seen.iter().find(|e| e.2 == n).map(|e| e.0).expect("an undo");
        let next_try = |from: Instant| {
            seen.iter().find(|e| e.0 > from && e.1 == Mode::Compare).map(|e| e.0).expect("a retry")
        };
        let (u1, u2) = (undo(1), undo(2));
        assert!(next_try(u1) >= u1 + HOLD, "tried again before the hold");
        assert!(next_try(u2) >= u2 + 2 * HOLD, "the second hold was not doubled");
        assert_eq!(a.mode, Mode::Log);
        let [log, cmp] = a.stats().last_judged_ops_per_sec.expect("a judged switch");
        assert!(log > 3.0 * cmp, "{log} {cmp}");
        assert!(a.stats().by_progress);
    }

    /// A switch after which the guest runs faster is kept.
    #[test]
    fn a_switch_that_speeds_the_guest_is_kept() {
        let (mut a, mut ops, mut at) = (auto(), 0, Instant::now());
        let ran =
            drive(&mut a, &mut ops, &mut at, 60, |m| if m == Mode::Compare { 40 } else { 10 });
        assert_eq!(a.mode, Mode::Compare, "{ran:?}");
        assert_eq!((a.stats().undone, a.stats().switches), (0, 1));
        let [log, cmp] = a.stats().last_judged_ops_per_sec.expect("a judged switch");
        assert!(cmp > 3.0 * log, "{log} {cmp}");
    }

    /// A window over which memory grew judges nothing (the switch stays
    /// even though the guest ran slower); a guest whose count never moves
    /// is silent, and stays on the log whatever the model says (as does
    /// one without a count) until its count moves again.
    #[test]
    fn growing_memory_judges_nothing_and_a_silent_guest_stays_on_the_log() {
        let (mut a, mut at) = (auto(), Instant::now());
        let (mut alloc, mut ops) = (1000usize, 0u64);
        for _ in 0..40 {
            alloc += alloc / 8;
            at += Duration::from_millis(20);
            ops += if a.mode == Mode::Compare { 10 } else { 40 };
            a.next(6700, 2600, None, alloc, Some((ops, at)));
        }
        assert_eq!((a.mode, a.stats().undone), (Mode::Compare, 0));
        let mut b = auto();
        for _ in 0..30 {
            at += Duration::from_millis(20);
            b.next(6700, 2600, None, 11500, Some((7, at)));
        }
        assert!(b.gate.silent && !b.stats().by_progress);
        assert_eq!((b.mode, b.stats().switches), (Mode::Log, 0));
        // Its count moves again: the model may switch it.
        let mut ops = 7;
        for _ in 0..30 {
            at += Duration::from_millis(20);
            ops += 40;
            b.next(6700, 2600, None, 11500, Some((ops, at)));
        }
        assert!(!b.gate.silent && b.stats().by_progress);
        assert_eq!(b.mode, Mode::Compare);
        let mut c = auto();
        for _ in 0..30 {
            c.next(6700, 2600, None, 11500, None);
        }
        assert_eq!((c.mode, c.stats().switches), (Mode::Log, 0));
    }

    /// A single epoch either way does not switch (noise).
    #[test]
    fn one_odd_epoch_does_not_switch() {
        let mut a = model();
        for i in 0..20 {
            let faults = if i % 2 == 0 { 5000 } else { 10 };
            assert_eq!(a.next(6000, faults, None, 11500, None), Mode::Log, "epoch {i}");
        }
    }
}
