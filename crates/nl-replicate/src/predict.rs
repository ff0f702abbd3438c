//! Write-fault prediction (HBFT's Histase and the fake-dirty check).
//!
//! * [`Predictor`]: over KVM's dirty log, which has no per-fault hook: pages
//!   the guest really changed in an epoch are left writable (not
//!   re-protected) for the next one.
//! * [`Histase`]: the paper's per-fault algorithm over userfaultfd
//!   write-protection: on a write fault, the pages up to `his_stride` ahead
//!   and `his_stride / 3` behind in the same 2 MiB table are made writable
//!   too, and treated as dirty.
//!
//! Both copy predicted pages at the boundary as dirty and drop those whose
//! content equals what the backup already has ([`Shadow`]) as fake dirty.

use std::sync::{Arc, Mutex};

use nl_memory::write_protect::{FaultHandler, Protector, Range, WriteProtect};
use nl_memory::GuestMemory;

use crate::protocol::PAGE;
use crate::ram::{runs_of, RamView};

/// A writable page found unchanged this many epochs in a row is
/// re-protected (a page the guest wrote comes back only after a sweep of
/// its working set, which under write faults takes several epochs).
const IDLE_EPOCHS: u8 = 8;

/// What the backup holds of each page shipped so far (flat RAM offsets),
/// to tell really changed pages from fake dirty ones.
pub(crate) struct Shadow {
    data: Vec<u8>,
    known: Vec<bool>,
}

impl Shadow {
    pub(crate) fn new(view: &RamView) -> Self {
        let n = view.total();
        // Zeroed allocation: only pages ever shipped get memory.
        Shadow { data: vec![0u8; n], known: vec![false; n / PAGE] }
    }

    pub(crate) fn pages(&self) -> usize {
        self.known.len()
    }

    /// After a full copy: nothing known.
    pub(crate) fn forget(&mut self) {
        self.known.iter_mut().for_each(|k| *k = false);
    }

    /// Goes through a staged epoch (`runs`, their data in `buf`): calls
    /// `seen(gpa, page index, changed)` for each page, keeps the changed
    /// ones (compacting `buf`, recording their content) and returns their
    /// runs; the unchanged ones are fake dirty and dropped.
    pub(crate) fn sift(
        &mut self,
        view: &RamView,
        runs: &[(u64, u32)],
        buf: &mut Vec<u8>,
        mut seen: impl FnMut(u64, usize, bool),
    ) -> Vec<(u64, u32)> {
        let mut kept = Vec::new();
        let (mut at, mut w) = (0usize, 0usize);
        for &(g0, n) in runs {
            for k in 0..n as u64 {
                let g = g0 + k * PAGE as u64;
                let Some(i) = view.flat(g).map(|o| o / PAGE) else { continue };
                let page = at..at + PAGE;
                at += PAGE;
                let off = i * PAGE;
                let changed = !self.known[i] || buf[page.clone()] != self.data[off..off + PAGE];
                if changed {
                    self.data[off..off + PAGE].copy_from_slice(&buf[page.clone()]);
                    self.known[i] = true;
                    buf.copy_within(page, w);
                    w += PAGE;
                    kept.push(g);
                }
                seen(g, i, changed);
            }
        }
        buf.truncate(w);
        runs_of(&kept)
    }
}

/// Turns prediction off when its guesses stop being right, and on again
/// once they would be right again.
///
/// A predicted page that is not written in the epoch still costs a copy
/// (and a comparison) at the boundary; when the guest's pattern changes, or
/// it slows down so much (under load) that a page is written only once in
/// many epochs, nearly every predicted page is such a waste, and the copies
/// slow the guest further. The gate follows the precision of each epoch
/// (predicted pages really written, over predicted pages), smoothed; below
/// [`Gate::OFF_BELOW`] prediction stops (every page is re-protected at each
/// boundary, and a write costs its fault again). While off, it follows the
/// precision prediction *would* have had (pages written in two epochs in a
/// row, over pages written in the first) and turns back on above
/// [`Gate::ON_ABOVE`].
#[derive(Clone, Debug)]
pub(crate) struct Gate {
    pub(crate) on: bool,
    precision: f64,
    pub(crate) switches: u64,
    pub(crate) epochs_off: u64,
}

impl Gate {
    pub(crate) const OFF_BELOW: f64 = 0.25;
    pub(crate) const ON_ABOVE: f64 = 0.6;
    /// Epochs with fewer predictions than this say nothing about precision.
    const MIN_SAMPLE: u64 = 32;
    /// Weight of the newest epoch in the smoothed precision.
    const WEIGHT: f64 = 0.5;

    pub(crate) fn new() -> Self {
        Gate { on: true, precision: 1.0, switches: 0, epochs_off: 0 }
    }

    /// One epoch: `predicted` pages guessed (or that would have been), of
    /// which `hits` were written. Returns whether prediction is on for the
    /// next epoch.
    pub(crate) fn observe(&mut self, predicted: u64, hits: u64) -> bool {
        if !self.on {
            self.epochs_off += 1;
        }
        if predicted >= Self::MIN_SAMPLE {
            let p = hits.min(predicted) as f64 / predicted as f64;
            self.precision = Self::WEIGHT * p + (1.0 - Self::WEIGHT) * self.precision;
            let next = if self.on {
                self.precision >= Self::OFF_BELOW
            } else {
                self.precision > Self::ON_ABOVE
            };
            if next != self.on {
                self.switches += 1;
                self.on = next;
            }
        }
        self.on
    }
}

/// Write-fault prediction over KVM's dirty log (see [`crate::primary::Options::predict`]).
pub(crate) struct Predictor {
    shadow: Shadow,
    /// Pages left writable (not re-protected) at the last boundary.
    pub(crate) writable: Vec<bool>,
    /// Pages found unchanged: re-protect at the next boundary.
    pub(crate) to_clear: Vec<u64>,
    /// Consecutive epochs each writable page was found unchanged.
    idle: Vec<u8>,
    /// Pages really written in the last epoch (what prediction would leave
    /// writable), for the gate's precision while prediction is off.
    last_written: Vec<bool>,
    last_written_list: Vec<usize>,
    pub(crate) gate: Gate,
    pub(crate) counts: Counts,
}

/// Prediction counters: pages predicted, predicted pages really written
/// (hits), pages really written, fake dirty pages dropped.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Counts {
    pub(crate) predicted: u64,
    pub(crate) hits: u64,
    pub(crate) written: u64,
    pub(crate) fake: u64,
}

impl Predictor {
    pub(crate) fn new(view: &RamView) -> Self {
        let shadow = Shadow::new(view);
        let n = shadow.pages();
        Predictor {
            shadow,
            writable: vec![false; n],
            to_clear: Vec::new(),
            idle: vec![0; n],
            last_written: vec![false; n],
            last_written_list: Vec::new(),
            gate: Gate::new(),
            counts: Counts::default(),
        }
    }

    /// After a full copy (every log cleared): nothing known, nothing writable.
    pub(crate) fn reset(&mut self) {
        self.shadow.forget();
        self.writable.iter_mut().for_each(|k| *k = false);
        self.to_clear.clear();
    }

    /// Drops the pages of a staged epoch whose content the backup already
    /// has (compacting `buf`), records what is shipped, and decides which
    /// pages stay writable. `logged`: the pages KVM reported; `cleared`:
    /// the pages re-protected at this boundary.
    pub(crate) fn filter(
        &mut self,
        view: &RamView,
        runs: &[(u64, u32)],
        buf: &mut Vec<u8>,
        logged: &[u64],
        cleared: &[u64],
    ) -> Vec<(u64, u32)> {
        let idx = |g: u64| view.flat(g).map(|o| o / PAGE);
        let mut in_log = vec![false; self.writable.len()];
        let mut was_cleared = vec![false; self.writable.len()];
        for &g in logged {
            if let Some(i) = idx(g) {
                in_log[i] = true;
            }
        }
        for &g in cleared {
            if let Some(i) = idx(g) {
                was_cleared[i] = true;
            }
        }
        let (writable, idle, to_clear, c) =
            (&mut self.writable, &mut self.idle, &mut self.to_clear, &mut self.counts);
        let (before_predicted, before_hits) = (c.predicted, c.hits);
        // Would-be precision: pages written last epoch and again in this one.
        let would_predict = self.last_written_list.len() as u64;
        let (last_written, mut written_now, mut would_hit) =
            (&mut self.last_written, Vec::new(), 0u64);
        let mut now_writable = Vec::new();
        let kept = self.shadow.sift(view, runs, buf, |g, i, changed| {
            if changed {
                would_hit += u64::from(last_written[i]);
                written_now.push(i);
            }
            // Writable through the epoch: predicted (left writable at the
            // last boundary, or cleared only now, after the copy).
            let predicted = writable[i];
            if in_log[i] {
                c.predicted += u64::from(predicted);
                c.hits += u64::from(predicted && changed);
                c.written += u64::from(changed || !predicted);
            }
            // Logged and not re-protected now: writable for the next epoch.
            writable[i] = in_log[i] && !was_cleared[i];
            if writable[i] {
                now_writable.push((i, g));
            }
            if changed {
                idle[i] = 0;
            } else {
                c.fake += 1;
                idle[i] = idle[i].saturating_add(1);
                if writable[i] && idle[i] >= IDLE_EPOCHS {
                    // Fake dirty for long enough: re-protected at the
                    // next boundary.
                    to_clear.push(g);
                }
            }
        });
        for &i in &self.last_written_list {
            self.last_written[i] = false;
        }
        for &i in &written_now {
            self.last_written[i] = true;
        }
        self.last_written_list = written_now;
        let (predicted, hits) = if self.gate.on {
            (self.counts.predicted - before_predicted, self.counts.hits - before_hits)
        } else {
            (would_predict, would_hit)
        };
        if !self.gate.observe(predicted, hits) {
            // Off: nothing stays writable; every page logged now is
            // re-protected at the next boundary.
            for (i, g) in now_writable {
                if self.writable[i] {
                    self.writable[i] = false;
                    self.to_clear.push(g);
                }
            }
            self.to_clear.sort_unstable();
            self.to_clear.dedup();
        }
        kept
    }
}

/// Pages under one L1 shadow page table (2 MiB): Histase keeps one stride
/// history per table.
const TABLE_PAGES: u64 = 512;
const TABLE_BYTES: u64 = TABLE_PAGES * PAGE as u64;
/// Weight of the history in `his_stride = α·his_stride + (1−α)·ave_stride`.
const ALPHA: f64 = 0.7;

/// Where each RAM region's pages and tables start when numbered across
/// all regions.
#[derive(Clone)]
struct Layout {
    /// gpa, size, first flat page, first table.
    regions: Vec<(u64, u64, usize, usize)>,
    tables: usize,
    pages: usize,
}

impl Layout {
    fn new(memory: &GuestMemory) -> Self {
        let (mut page, mut table) = (0usize, 0usize);
        let mut regions = Vec::new();
        for r in memory.regions() {
            regions.push((r.gpa, r.size, page, table));
            page += (r.size / PAGE as u64) as usize;
            table += r.size.div_ceil(TABLE_BYTES) as usize;
        }
        Layout { regions, tables: table, pages: page }
    }

    /// Flat page index and table index of `gpa`, and the table's bounds.
    fn locate(&self, gpa: u64) -> Option<(usize, usize, u64, u64)> {
        let &(g, size, page, table) =
            self.regions.iter().find(|&&(g, size, _, _)| gpa >= g && gpa < g + size)?;
        let off = gpa - g;
        let t_start = g + off / TABLE_BYTES * TABLE_BYTES;
        let t_end = (t_start + TABLE_BYTES).min(g + size);
        Some((
            page + (off / PAGE as u64) as usize,
            table + (off / TABLE_BYTES) as usize,
            t_start,
            t_end,
        ))
    }
}

/// What the fault thread and the epoch loop share.
struct HistState {
    /// Pages made writable this epoch (faulted or predicted).
    marked: Vec<bool>,
    /// Of those, the ones that took the fault.
    faulted: Vec<bool>,
    /// The marked pages' addresses.
    list: Vec<u64>,
    /// his_stride per table (negative: no history yet).
    his: Vec<f64>,
    faults: u64,
}

/// The fault side of Histase: a write fault makes the page and its
/// predicted neighbours writable, all marked dirty.
struct HistaseFaults {
    state: Arc<Mutex<HistState>>,
    layout: Layout,
}

impl FaultHandler for HistaseFaults {
    fn fault(&mut self, p: &Protector, gpa: u64, _r: Range) -> Result<(), String> {
        let (i, t, t_start, t_end) =
            self.layout.locate(gpa).ok_or_else(|| format!("fault at {gpa:#x} outside RAM"))?;
        // Marking and unprotecting under the lock: an epoch boundary sees
        // either both or neither.
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let (start, end) = window(gpa, st.his[t], t_start, t_end);
        for g in (start..end).step_by(PAGE) {
            let k = i + (g / PAGE as u64) as usize - (gpa / PAGE as u64) as usize;
            if !st.marked[k] {
                st.marked[k] = true;
                st.list.push(g);
            }
        }
        st.faulted[i] = true;
        st.faults += 1;
        p.unprotect(start, end - start)
    }

    fn on_start(&mut self) {
        nl_vmm::seccomp::apply(nl_vmm::seccomp::Kind::Checkpoint);
    }
}

/// The pages a write fault at `gpa` makes writable: up to `his` pages
/// ahead and `his / 3` behind, within the table `[t_start, t_end)`.
fn window(gpa: u64, his: f64, t_start: u64, t_end: u64) -> (u64, u64) {
    let h = his.max(0.0);
    let (ahead, behind) = (h.round() as u64, (h / 3.0) as u64);
    let page = PAGE as u64;
    let start = gpa.saturating_sub(behind * page).max(t_start);
    let end = gpa.saturating_add((ahead + 1) * page).min(t_end);
    (start, end)
}

/// Folds one epoch's written pages (sorted) into each table's his_stride:
/// `his = α·his + (1−α)·ave_stride`, ave_stride being the mean length of
/// the table's runs of consecutive written pages (0 when none was
/// written); a table's first ave_stride starts its history (negative:
/// none yet).
fn learn(layout: &Layout, his: &mut [f64], written: &[u64]) {
    let mut pages = vec![0u64; layout.tables];
    let mut runs = vec![0u64; layout.tables];
    let mut prev: Option<(u64, usize)> = None;
    for &g in written {
        let Some((_, t, ..)) = layout.locate(g) else { continue };
        pages[t] += 1;
        if !prev.is_some_and(|(pg, pt)| pt == t && pg + PAGE as u64 == g) {
            runs[t] += 1;
        }
        prev = Some((g, t));
    }
    for (t, h) in his.iter_mut().enumerate() {
        let ave = if runs[t] > 0 { pages[t] as f64 / runs[t] as f64 } else { 0.0 };
        *h = match (*h < 0.0, runs[t] > 0) {
            (true, true) => ave,
            (true, false) => -1.0,
            (false, _) => ALPHA * *h + (1.0 - ALPHA) * ave,
        };
    }
}

/// One epoch's tracked pages, taken at its boundary.
pub(crate) struct Tracked {
    /// Every page made writable (sorted).
    pub(crate) pages: Vec<u64>,
    /// The ones that took a write fault (sorted).
    pub(crate) faulted: Vec<u64>,
    pub(crate) faults: u64,
}

/// Histase over userfaultfd write-protection (see the module docs).
pub(crate) struct Histase {
    wp: WriteProtect,
    state: Arc<Mutex<HistState>>,
    layout: Layout,
    shadow: Shadow,
    pub(crate) counts: Counts,
}

impl Histase {
    /// Registers the VM's RAM (nothing protected until [`Histase::restart`]).
    pub(crate) fn new(memory: &GuestMemory, view: &RamView) -> Result<Self, String> {
        let layout = Layout::new(memory);
        let state = Arc::new(Mutex::new(HistState {
            marked: vec![false; layout.pages],
            faulted: vec![false; layout.pages],
            list: Vec::new(),
            his: vec![-1.0; layout.tables],
            faults: 0,
        }));
        let handler = HistaseFaults { state: state.clone(), layout: layout.clone() };
        let wp = WriteProtect::new(memory, "repl-faults", handler)?;
        Ok(Histase { wp, state, layout, shadow: Shadow::new(view), counts: Counts::default() })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HistState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// At a full copy (VM paused): all RAM protected, nothing marked,
    /// nothing known to the backup but what this copy sends.
    pub(crate) fn restart(&mut self) -> Result<(), String> {
        let mut st = self.lock();
        for g in std::mem::take(&mut st.list) {
            if let Some((i, ..)) = self.layout.locate(g) {
                st.marked[i] = false;
                st.faulted[i] = false;
            }
        }
        st.faults = 0;
        self.wp.protector().protect_all()?;
        drop(st);
        self.shadow.forget();
        self.error()
    }

    /// At an epoch boundary (VM paused): the pages made writable during the
    /// epoch, protected again before they are copied (a write after this
    /// faults into the next epoch).
    pub(crate) fn take(&mut self) -> Result<Tracked, String> {
        let mut st = self.lock();
        let mut pages = std::mem::take(&mut st.list);
        pages.sort_unstable();
        let mut faulted = Vec::new();
        for &g in &pages {
            if let Some((i, ..)) = self.layout.locate(g) {
                if st.faulted[i] {
                    faulted.push(g);
                }
                st.marked[i] = false;
                st.faulted[i] = false;
            }
        }
        for (g, n) in runs_of(&pages) {
            self.wp.protector().protect(g, u64::from(n) * PAGE as u64)?;
        }
        let faults = std::mem::take(&mut st.faults);
        drop(st);
        self.error()?;
        Ok(Tracked { pages, faulted, faults })
    }

    /// After the resume: drops the fake dirty pages of the staged epoch,
    /// counts the prediction's hits, and updates each table's his_stride
    /// from the runs of pages really written (faulted, or changed).
    pub(crate) fn filter(
        &mut self,
        view: &RamView,
        runs: &[(u64, u32)],
        buf: &mut Vec<u8>,
        t: &Tracked,
    ) -> Vec<(u64, u32)> {
        let is_faulted = |g: u64| t.faulted.binary_search(&g).is_ok();
        let is_tracked = |g: u64| t.pages.binary_search(&g).is_ok();
        let mut written = Vec::new();
        let c = &mut self.counts;
        let kept = self.shadow.sift(view, runs, buf, |g, _, changed| {
            let faulted = is_faulted(g);
            if is_tracked(g) && !faulted {
                c.predicted += 1;
                c.hits += u64::from(changed);
            }
            if faulted || changed {
                written.push(g);
                c.written += 1;
            } else {
                c.fake += 1;
            }
        });
        self.learn(&written);
        kept
    }

    fn learn(&self, written: &[u64]) {
        learn(&self.layout, &mut self.lock().his, written);
    }

    fn error(&self) -> Result<(), String> {
        self.wp.error().map_or(Ok(()), |e| Err(format!("write tracking: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Precision collapses (the guest stopped rewriting what it wrote):
    /// prediction turns itself off within a few epochs, stays off while the
    /// would-be guesses are wrong, and turns back on once they are right.
    #[test]
    fn a_collapsed_predictor_turns_off_and_back_on() {
        let mut g = Gate::new();
        // Good guesses: on.
        for _ in 0..5 {
            assert!(g.observe(1000, 900));
        }
        // Collapse: 1% precision. Off within three epochs.
        let off_after = (1..=3).find(|_| !g.observe(10_000, 100));
        assert!(off_after.is_some(), "still on after three collapsed epochs");
        // Still wrong: stays off; tiny samples change nothing.
        for _ in 0..10 {
            assert!(!g.observe(10_000, 500));
            assert!(!g.observe(3, 3));
        }
        // A middling precision (between the thresholds) keeps it off.
        for _ in 0..5 {
            assert!(!g.observe(1000, 400));
        }
        // Right again: back on within three epochs.
        let on_after = (1..=3).find(|_| g.observe(1000, 950));
        assert!(on_after.is_some(), "still off after three good epochs");
        assert_eq!(g.switches, 2);
        assert!(g.epochs_off >= 25);
    }

    const P: u64 = PAGE as u64;

    #[test]
    fn windows_follow_the_stride_and_stay_in_their_table() {
        let t = (0x20_0000, 0x40_0000);
        // No history: the faulting page alone.
        assert_eq!(window(0x30_0000, -1.0, t.0, t.1), (0x30_0000, 0x30_0000 + P));
        // his_stride 9: 9 pages ahead, 3 behind.
        assert_eq!(window(0x30_0000, 9.0, t.0, t.1), (0x30_0000 - 3 * P, 0x30_0000 + 10 * P));
        // Clipped at both ends of the table.
        assert_eq!(window(t.0, 512.0, t.0, t.1), (t.0, t.1));
        assert_eq!(window(t.1 - P, 512.0, t.0, t.1), (t.1 - P - 170 * P, t.1));
    }

    #[test]
    fn strides_are_learned_per_table_with_history() {
        let mem = GuestMemory::new("t", 64 << 20).unwrap();
        let layout = Layout::new(&mem);
        assert_eq!((layout.tables, layout.pages), (32, 16384));
        let mut his = vec![-1.0; layout.tables];
        // Table 0: runs of 4 and 2 pages (ave 3); table 1: one run of 8.
        let mut w: Vec<u64> = (0..4).chain(10..12).map(|p| p * P).collect();
        w.extend((512..520).map(|p| p * P));
        learn(&layout, &mut his, &w);
        assert_eq!((his[0], his[1], his[2]), (3.0, 8.0, -1.0));
        // Next epoch: table 0 written as one run of 13, table 1 not at all.
        let w: Vec<u64> = (0..13).map(|p| p * P).collect();
        learn(&layout, &mut his, &w);
        assert!((his[0] - (0.7 * 3.0 + 0.3 * 13.0)).abs() < 1e-9);
        assert!((his[1] - 0.7 * 8.0).abs() < 1e-9);
        assert_eq!(his[2], -1.0);
        // A run crossing a table boundary counts in each table.
        let mut his = vec![-1.0; layout.tables];
        let w: Vec<u64> = (508..516).map(|p| p * P).collect();
        learn(&layout, &mut his, &w);
        assert_eq!((his[0], his[1]), (4.0, 4.0));
    }
}
