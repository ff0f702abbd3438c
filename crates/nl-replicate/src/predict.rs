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

/// Turns prediction off when its guesses stop being right, and probes
/// again later, with exponential back-off, so that it cannot get stuck.
///
/// A predicted page that is not written in the epoch still costs a copy
/// and a comparison at the boundary (about 2.4 µs on this host) to save one
/// write fault when it is written (about 8 µs): below a precision of about
/// 0.25 prediction costs more than it saves. When the guest's pattern
/// changes, or it slows down so much (under load) that a page is written
/// only once in many epochs, nearly every predicted page is such a waste,
/// and the copies slow the guest further.
///
/// On, the gate measures each epoch's precision (predicted pages really
/// written, over predicted pages; epochs with fewer than
/// [`Gate::MIN_SAMPLE`] predictions say nothing). After [`Gate::LOW_EPOCHS`]
/// epochs in a row below [`Gate::OFF_BELOW`] it turns prediction off: every
/// page logged is re-protected at the next boundary (plain selective
/// tracking). Off, it waits `2^n` epochs ([`Gate::FIRST_WAIT`] doubled at
/// each failure in a row, at most [`Gate::MAX_WAIT`]), then turns
/// prediction on as a probe: after [`Gate::PROBE_SAMPLES`] sampled epochs at
/// [`Gate::OFF_BELOW`] or better it stays on; otherwise it turns off again
/// and waits twice as long. A failure counts as "in a row" when prediction
/// had stayed on for less than [`Gate::STABLE_EPOCHS`] since its last
/// probe, so a pattern whose probes look good but whose steady state is
/// bad does not make it flap.
#[derive(Clone, Debug)]
pub(crate) struct Gate {
    pub(crate) on: bool,
    /// On: consecutive sampled epochs below [`Gate::OFF_BELOW`].
    low: u32,
    /// Off: epochs left before the next probe.
    wait: u64,
    /// Failures in a row (the back-off's exponent).
    failures: u32,
    /// On as a probe: (sampled epochs, predicted, hits, epochs).
    probe: Option<(u32, u64, u64, u32)>,
    /// Epochs on since the last probe started.
    on_since_probe: u64,
    pub(crate) stats: GateStats,
}

/// What the gate did over a run (in the primary's report).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct GateStats {
    /// Epochs with prediction on (predicting), and off.
    pub epochs_on: u64,
    pub epochs_off: u64,
    /// Times prediction turned itself off.
    pub disabled: u64,
    /// Probes: times it turned itself on again to test its guesses.
    pub probes: u64,
    /// Probes whose guesses were right: prediction stayed on.
    pub reenabled: u64,
}

impl Gate {
    pub(crate) const OFF_BELOW: f64 = 0.25;
    /// Sampled epochs in a row below [`Gate::OFF_BELOW`] that turn it off.
    pub(crate) const LOW_EPOCHS: u32 = 3;
    /// Epochs with fewer predictions than this say nothing about precision.
    pub(crate) const MIN_SAMPLE: u64 = 32;
    /// Sampled epochs a probe takes to decide.
    pub(crate) const PROBE_SAMPLES: u32 = 2;
    /// A probe without enough samples in this many epochs ends on: the guest
    /// writes (almost) nothing again, and what is not predicted costs nothing.
    const PROBE_EPOCHS: u32 = 16;
    /// Epochs off after the first failure; doubled at each failure in a row.
    pub(crate) const FIRST_WAIT: u64 = 4;
    pub(crate) const MAX_WAIT: u64 = 256;
    /// Prediction on for this long since its probe: the next failure starts
    /// the back-off from [`Gate::FIRST_WAIT`] again.
    pub(crate) const STABLE_EPOCHS: u64 = 64;

    pub(crate) fn new() -> Self {
        Gate {
            on: true,
            low: 0,
            wait: 0,
            failures: 0,
            probe: None,
            // The first epochs are no probe: a failure there is the first.
            on_since_probe: Self::STABLE_EPOCHS,
            stats: GateStats::default(),
        }
    }

    /// One epoch: `predicted` pages guessed, of which `hits` were written.
    /// Returns whether prediction is on for the next epoch.
    pub(crate) fn observe(&mut self, predicted: u64, hits: u64) -> bool {
        if !self.on {
            self.stats.epochs_off += 1;
            self.wait = self.wait.saturating_sub(1);
            if self.wait == 0 {
                self.on = true;
                self.low = 0;
                self.probe = Some((0, 0, 0, 0));
                self.on_since_probe = 0;
                self.stats.probes += 1;
            }
            return self.on;
        }
        self.stats.epochs_on += 1;
        self.on_since_probe += 1;
        let sampled = predicted >= Self::MIN_SAMPLE;
        let hits = hits.min(predicted);
        if let Some((n, p, h, e)) = self.probe.as_mut() {
            *e += 1;
            if sampled {
                *n += 1;
                *p += predicted;
                *h += hits;
            }
            if *n >= Self::PROBE_SAMPLES {
                let good = *h as f64 >= Self::OFF_BELOW * *p as f64;
                self.probe = None;
                if good {
                    self.stats.reenabled += 1;
                } else {
                    self.turn_off();
                }
            } else if *e >= Self::PROBE_EPOCHS {
                self.probe = None;
                self.stats.reenabled += 1;
            }
            return self.on;
        }
        if sampled {
            if (hits as f64) < Self::OFF_BELOW * predicted as f64 {
                self.low += 1;
            } else {
                self.low = 0;
            }
            if self.low >= Self::LOW_EPOCHS {
                self.turn_off();
            }
        }
        self.on
    }

    fn turn_off(&mut self) {
        if self.on_since_probe >= Self::STABLE_EPOCHS {
            self.failures = 0;
        }
        self.failures += 1;
        self.wait = (Self::FIRST_WAIT << (self.failures - 1).min(16)).min(Self::MAX_WAIT);
        self.on = false;
        self.low = 0;
        self.stats.disabled += 1;
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
            gate: Gate::new(),
            counts: Counts::default(),
        }
    }

    /// Whether the next boundary re-protects every logged page (prediction
    /// off: plain selective tracking) instead of leaving them writable.
    pub(crate) fn reprotects_all(&self) -> bool {
        !self.gate.on
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
        let kept = self.shadow.sift(view, runs, buf, |g, i, changed| {
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
        let predicted = self.counts.predicted - before_predicted;
        let hits = self.counts.hits - before_hits;
        if !self.gate.observe(predicted, hits) {
            // Off: nothing is predicted any more. The pages left writable
            // now keep their dirty bit, so the next boundary (which
            // re-protects every logged page) copies them whether or not
            // the guest writes them meanwhile.
            self.writable.iter_mut().for_each(|w| *w = false);
            self.to_clear.clear();
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

    use crate::ram::runs;
    use vm_memory::{Bytes, GuestAddress};

    /// The primary's boundary over a model of KVM's dirty log with manual
    /// protection, on real guest memory: a write sets its page's dirty bit
    /// (it faults first when the page was re-protected); a boundary reads
    /// the log, copies the logged pages, clears (re-protects) the bits the
    /// predictor says, and filters. The backup's image is kept from what
    /// is shipped and checked against guest memory at every boundary.
    struct Sim {
        mem: GuestMemory,
        view: RamView,
        pred: Predictor,
        dirty: Vec<bool>,
        backup: Vec<u8>,
        /// Gate on before each boundary.
        on: Vec<bool>,
        stamp: u64,
        faults: u64,
        /// Pages copied at each boundary.
        copied: Vec<usize>,
    }

    /// Pages the simulated guest writes (the first 16 MiB of its 64).
    const PAGES: usize = 4096;

    impl Sim {
        fn new() -> Sim {
            let mem = GuestMemory::new("t", 64 << 20).unwrap();
            let view = RamView::new(&mem);
            let pred = Predictor::new(&view);
            let backup = view.slice(0, PAGES * PAGE).unwrap().to_vec();
            Sim {
                mem,
                view,
                pred,
                dirty: vec![false; PAGES],
                backup,
                on: Vec::new(),
                stamp: 0,
                faults: 0,
                copied: Vec::new(),
            }
        }

        /// One epoch: the guest writes `pages` (new content each time),
        /// then the boundary.
        fn epoch(&mut self, pages: impl IntoIterator<Item = usize>) {
            for i in pages {
                self.stamp += 1;
                let g = (i * PAGE) as u64;
                if !self.dirty[i] {
                    self.faults += 1;
                }
                self.mem.mem().write_obj(self.stamp, GuestAddress(g)).unwrap();
                self.dirty[i] = true;
            }
            self.on.push(self.pred.gate.on);
            // The primary's boundary (see `Primary::boundary`).
            let clear = self.pred.reprotects_all();
            let logged: Vec<u64> =
                (0..PAGES).filter(|&i| self.dirty[i]).map(|i| (i * PAGE) as u64).collect();
            self.copied.push(logged.len());
            let rr = runs(&logged, 256);
            let mut buf = Vec::new();
            for &(g, n) in &rr {
                buf.extend_from_slice(self.view.slice(g, n as usize * PAGE).unwrap());
            }
            let cleared = if clear {
                self.pred.to_clear.clear();
                logged.clone()
            } else {
                std::mem::take(&mut self.pred.to_clear)
            };
            for &g in &cleared {
                self.dirty[g as usize / PAGE] = false;
            }
            let kept = self.pred.filter(&self.view, &rr, &mut buf, &logged, &cleared);
            let mut at = 0;
            for (g, n) in kept {
                let len = n as usize * PAGE;
                self.backup[g as usize..g as usize + len].copy_from_slice(&buf[at..at + len]);
                at += len;
            }
            assert_eq!(at, buf.len(), "shipped data and runs disagree");
            assert!(
                self.backup == self.view.slice(0, PAGES * PAGE).unwrap(),
                "the backup's image differs from guest memory after a boundary"
            );
        }

        fn stats(&self) -> GateStats {
            self.pred.gate.stats
        }
    }

    /// splitmix64: the random write pattern.
    fn rnd(s: &mut u64) -> u64 {
        *s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn random_pages(seed: &mut u64, n: usize) -> Vec<usize> {
        (0..n).map(|_| (rnd(seed) % PAGES as u64) as usize).collect()
    }

    /// A sequential sweep over a working set the guest rewrites every epoch
    /// (memwrite sequential on a quiet host): the guesses are right,
    /// prediction stays on, and after the first epoch the writes take no
    /// faults.
    #[test]
    fn a_sequential_stream_keeps_prediction_on() {
        let mut s = Sim::new();
        for _ in 0..200 {
            s.epoch(0..1024);
        }
        let st = s.stats();
        assert_eq!((st.disabled, st.probes), (0, 0), "{st:?}");
        assert!(s.on.iter().all(|&o| o));
        assert_eq!(st.epochs_on, 200);
        // One fault per page, in the first epoch only.
        assert_eq!(s.faults, 1024);
        let c = s.pred.counts;
        assert!(c.hits as f64 >= 0.99 * c.predicted as f64, "{c:?}");
    }

    /// Random writes over the whole memory: most predicted pages are not
    /// written again. Prediction turns itself off within a few epochs, then
    /// probes with growing waits (each probe fails), and spends nearly all
    /// the time off.
    #[test]
    fn random_writes_turn_prediction_off_and_it_probes_with_back_off() {
        let mut s = Sim::new();
        let mut seed = 7;
        for _ in 0..600 {
            let w = random_pages(&mut seed, 256);
            s.epoch(w);
        }
        let st = s.stats();
        // Off after LOW_EPOCHS sampled epochs (the first has no prediction yet).
        let first_off = s.on.iter().position(|&o| !o).expect("prediction never turned off");
        assert!(first_off <= 1 + Gate::LOW_EPOCHS as usize + 1, "off only at epoch {first_off}");
        assert!(st.disabled >= 3, "{st:?}");
        assert_eq!(st.reenabled, 0, "a probe of random writes kept prediction on: {st:?}");
        assert_eq!(st.probes, st.disabled - u64::from(!s.pred.gate.on), "{st:?}");
        // Back-off: waits 4, 8, 16, ... 256 epochs between probes: about
        // 600 epochs hold at most 7 probes, and prediction is off nearly
        // all the time.
        assert!(st.probes <= 7, "{st:?}");
        assert!(st.epochs_off >= 500, "{st:?}");
        // Off, it is plain selective tracking: a boundary copies what the
        // epoch wrote (256 writes), and what the epoch before left
        // writable, not every page ever written.
        let worst_off = (1..600).filter(|&i| !s.on[i - 1] && !s.on[i]).map(|i| s.copied[i]).max();
        assert!(worst_off.unwrap() <= 512, "copied {worst_off:?} pages in an epoch while off");
        // Waits double: the gaps between successive turn-offs grow.
        let offs: Vec<usize> = (1..s.on.len()).filter(|&i| s.on[i - 1] && !s.on[i]).collect();
        let gaps: Vec<usize> = offs.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps.windows(2).all(|g| g[1] > g[0]), "turn-offs at {offs:?}");
    }

    /// A pattern that becomes predictable again (random writes, then the
    /// guest settles on rewriting a working set): prediction comes back on
    /// at its next probe and stays on.
    #[test]
    fn prediction_comes_back_when_the_pattern_is_predictable_again() {
        let mut s = Sim::new();
        let mut seed = 11;
        for _ in 0..60 {
            let w = random_pages(&mut seed, 256);
            s.epoch(w);
        }
        let before = s.stats();
        assert!(before.disabled >= 2 && !s.on[59], "{before:?}");
        for _ in 0..200 {
            s.epoch(512..1536);
        }
        let st = s.stats();
        assert_eq!(st.reenabled, 1, "{st:?}");
        assert_eq!(st.disabled, before.disabled, "turned off again: {st:?}");
        // Back on within the longest wait so far (at most 2^n epochs) plus
        // the probe, and on from then to the end.
        let back = s.on[60..].iter().position(|&o| o).expect("never on again");
        assert!(back <= 64, "on again only after {back} epochs");
        assert!(s.on[60 + back..].iter().all(|&o| o));
    }

    /// A probe that looks good but whose steady state is bad (here: a
    /// working set rewritten only every fifth epoch, so a page left
    /// writable is mostly copied for nothing) must not flap on and off at
    /// the shortest wait: a failure soon after a probe doubles the wait.
    #[test]
    fn a_flapping_pattern_backs_off() {
        let mut s = Sim::new();
        for e in 0..600 {
            let w: Vec<usize> = if e % 5 == 0 { (0..2048).collect() } else { Vec::new() };
            s.epoch(w);
        }
        let st = s.stats();
        assert!(st.disabled >= 2, "{st:?}");
        assert!(st.probes <= 10, "{st:?}");
        assert!(st.epochs_off >= 400, "{st:?}");
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
