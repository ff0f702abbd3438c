//! The checkpoint engines: CoW-B, CoW-P, and the shadow-image engines
//! (dirty-log baseline, fault-free compare, auto).
//!
//! Each keeps a ring of checkpoints: DP_cur (pre-write copies from the
//! interval running now) and a history DP_0 .. DP_n-1 of the intervals
//! between kept checkpoints (DP_i holds memory at checkpoint i of every page
//! written before checkpoint i+1). Rolling back k intervals writes DP_cur and
//! then the newest k-1 history entries back, newest first (the paper's
//! equation 2, generalized from two checkpoints to a ring). The supervisor
//! decides how long the ring is (see `supervisor`); two adjacent entries can
//! be merged (the older copy of a page wins) to bound its memory. Restores
//! go through a second mapping of the memfd that is not registered with
//! userfaultfd, so they never fault on the protection they are undoing.

use std::collections::VecDeque;

use nl_memory::GuestMemory;
use nl_vmm::Vm;
use serde::{Deserialize, Serialize};
use vm_memory::{Bytes, GuestAddress};

use crate::pages::{Backer, PagePool, PageSet};
use crate::policy::{Capture, Policy, UnitCosts};
use crate::shadow::Shadow;
use crate::tracker::WriteTracker;
use crate::{CheckpointError, PAGE};

/// How checkpoints are taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Copy-on-write basic: write-protect all RAM at each checkpoint.
    CowB,
    /// Copy-on-write with dirty-page prediction and pre-saving.
    CowP,
    /// KVM dirty logging, copying dirty pages into a full shadow image.
    DirtyLog,
    /// Fault-free: no write tracking; each checkpoint compares every
    /// allocated page with a full shadow image, on all host cores, while the
    /// vCPUs are stopped.
    Compare,
    /// Dirty log or compare, chosen interval by interval from the dirty rate
    /// and this host's unit costs ([`crate::policy`]).
    Auto,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::CowB => "cow-b",
            Mode::CowP => "cow-p",
            Mode::DirtyLog => "dirty-log",
            Mode::Compare => "compare",
            Mode::Auto => "auto",
        }
    }
}

/// What one checkpoint found about the interval that just ended.
#[derive(Clone, Copy, Debug, Default)]
pub struct IntervalStats {
    /// Pages the interval's checkpoint data holds (written pages' pre-write copies).
    pub pages: usize,
    /// Write-protect faults taken in the interval (0 for dirty-log).
    pub faults: u64,
    /// Pages pre-saved at the start of the next interval (CoW-P).
    pub presaved: usize,
    /// The shadow engines: how the interval was captured.
    pub capture: Option<Capture>,
    /// The shadow engines: pages the checkpoint's scan visited.
    pub scanned: usize,
}

/// What a rollback did.
#[derive(Clone, Copy, Debug, Default)]
pub struct RollbackStats {
    pub pages: usize,
    /// Intervals undone: 1 = back to the newest checkpoint, k = back to the
    /// checkpoint k-1 history entries older.
    pub levels: u32,
}

pub enum Engine {
    Cow(CowEngine),
    /// The dirty-log, compare and auto modes.
    Shadow(ShadowEngine),
}

impl Engine {
    /// Sets up tracking; the VM must be paused (this is checkpoint 0).
    /// `block_pages` > 1 makes the CoW engines save and unprotect whole
    /// aligned blocks per fault (pages that did not change are dropped from
    /// the checkpoint when the interval ends).
    pub fn start(mode: Mode, vm: &Vm, block_pages: usize) -> Result<Self, CheckpointError> {
        let view = GuestMemory::from_fd(vm.memory().fd().clone(), vm.memory().size())?;
        Ok(match mode {
            Mode::CowB | Mode::CowP => {
                let tracker = WriteTracker::new(vm.memory(), block_pages)?;
                tracker.protect_all()?;
                Engine::Cow(CowEngine {
                    predict: mode == Mode::CowP,
                    drop_unchanged: block_pages > 1,
                    tracker,
                    history: VecDeque::new(),
                    presaved: Vec::new(),
                    view,
                    faults_at_start: 0,
                })
            }
            Mode::DirtyLog | Mode::Compare | Mode::Auto => {
                Engine::Shadow(ShadowEngine::start(vm, view, mode)?)
            }
        })
    }

    /// Takes a checkpoint; the VM must be paused.
    pub fn checkpoint(&mut self, vm: &Vm) -> Result<IntervalStats, CheckpointError> {
        match self {
            Engine::Cow(e) => e.checkpoint(),
            Engine::Shadow(e) => e.checkpoint(vm),
        }
    }

    /// Restores memory to the checkpoint `undo` history entries older than
    /// the newest (0: the newest checkpoint) and forgets the entries undone;
    /// the vCPUs must be halted.
    pub fn rollback(&mut self, vm: &Vm, undo: usize) -> Result<RollbackStats, CheckpointError> {
        if undo > self.history_len() {
            return Err(CheckpointError::Config(format!(
                "rollback of {undo} intervals asked, {} kept",
                self.history_len()
            )));
        }
        match self {
            Engine::Cow(e) => e.rollback(undo),
            Engine::Shadow(e) => e.rollback(vm, undo),
        }
    }

    fn history(&self) -> &VecDeque<PageSet> {
        match self {
            Engine::Cow(e) => &e.history,
            Engine::Shadow(e) => &e.history,
        }
    }

    /// History entries kept: the checkpoints one can roll back to, less one.
    pub fn history_len(&self) -> usize {
        self.history().len()
    }

    /// Pages the history holds (its memory cost, in pages).
    pub fn history_pages(&self) -> usize {
        self.history().iter().map(PageSet::len).sum()
    }

    /// Merges history entry `i + 1` into entry `i`: kept checkpoint `i + 1`
    /// can no longer be rolled back to, and the pages both saved are held
    /// once (the older copy, which is what checkpoint `i` needs). Returns
    /// the pages freed.
    pub fn merge_at(&mut self, i: usize) -> usize {
        match self {
            Engine::Shadow(e) => merge_at(&mut e.history, i, Some(&mut e.pool)),
            Engine::Cow(e) => merge_at(&mut e.history, i, None),
        }
    }

    /// The content page `gpa` had at kept checkpoint `idx` (0 = the oldest
    /// kept; `history_len()` = the newest), if it differs from memory at the
    /// newest: memory at checkpoint `idx` is memory at the newest checkpoint
    /// overlaid with these.
    pub fn page_at(&self, idx: usize, gpa: u64) -> Option<[u8; PAGE]> {
        self.history().iter().skip(idx).find_map(|s| s.get(gpa)).copied()
    }

    /// Tells the engine the VMM itself wrote guest page `gpa` (device DMA,
    /// fault injection). KVM's dirty log only sees writes made by the guest,
    /// so the dirty-log engine must add these; the CoW engines already saw
    /// the write through the write-protected mapping.
    pub fn note_vmm_write(&mut self, gpa: u64) {
        if let Engine::Shadow(e) = self {
            e.vmm_dirty.insert(gpa & !(PAGE as u64 - 1));
        }
    }

    /// Work done between checkpoints, while the guest runs, so that the next
    /// pause does less (until `deadline`): the shadow engines back their
    /// shadow image and fill their buffer pool for the next checkpoint's
    /// undo copies, up to what the last interval needed, within
    /// `budget_pages` (the ring's page budget).
    pub fn prepare(&mut self, deadline: std::time::Instant, budget_pages: usize) {
        if let Engine::Shadow(e) = self {
            e.prepare(deadline, budget_pages);
        }
    }

    /// The shadow engines' undo buffers so far (None for the CoW engines).
    pub fn buffers(&self) -> Option<BufferStats> {
        match self {
            Engine::Shadow(e) => Some(e.buffers()),
            Engine::Cow(_) => None,
        }
    }

    /// Pages held right now for the running interval.
    pub fn current_pages(&self) -> usize {
        match self {
            Engine::Cow(e) => e.tracker.current().len(),
            Engine::Shadow(_) => 0,
        }
    }

    /// The auto mode's choices so far (None for the other modes).
    pub fn policy(&self) -> Option<&Policy> {
        match self {
            Engine::Shadow(e) => e.policy.as_ref(),
            Engine::Cow(_) => None,
        }
    }

    /// Makes the shadow engines capture the running interval with `capture`
    /// (the auto mode then goes on choosing from there). Only right after
    /// [`Engine::start`] or a checkpoint or rollback, with the VM paused:
    /// writes made before the switch would not be in the new capture's view.
    pub fn set_capture(&mut self, vm: &Vm, capture: Capture) -> Result<(), CheckpointError> {
        match self {
            Engine::Shadow(e) => e.switch(vm, capture),
            Engine::Cow(_) => Err(CheckpointError::Config(
                "copy-on-write engines have no capture to choose".into(),
            )),
        }
    }

    /// An error met asynchronously (by the fault thread).
    pub fn error(&self) -> Option<String> {
        match self {
            Engine::Cow(e) => e.tracker.error(),
            Engine::Shadow(_) => None,
        }
    }
}

/// The shadow engines' undo buffers over a run: where they came from and
/// the memory they took.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct BufferStats {
    /// Buffers a checkpoint's scan had to allocate itself, in the pause
    /// (the pool ran out): each a first-touch page fault there.
    pub fresh_in_pause: u64,
    /// Buffers the background backer backed ahead of need (0: it could not
    /// be started, and the pool was filled between checkpoints instead).
    pub backed_ahead: u64,
    /// The most bytes the backer's chunks had mapped at once (the ring's
    /// and the pool's buffers, and the chunks they keep mapped).
    pub backed_bytes_max: usize,
    /// The most buffers the pool held at a checkpoint's start.
    pub pool_max: usize,
}

/// Merges history entry `i + 1` into entry `i` (see [`Engine::merge_at`]):
/// entry `i`'s copy of a page is the older one and wins; pages only entry
/// `i + 1` saved join it. Returns the pages freed.
/// Pages are moved, not copied; the duplicates' buffers go to `pool`.
fn merge_at(h: &mut VecDeque<PageSet>, i: usize, mut pool: Option<&mut PagePool>) -> usize {
    if h.len() < i + 2 {
        return 0;
    }
    let mut newer = h.remove(i + 1).expect("checked");
    let older = &mut h[i];
    let mut freed = 0;
    for (gpa, page) in newer.drain() {
        if let Some(dup) = older.insert_page(gpa, page) {
            freed += 1;
            if let Some(p) = pool.as_deref_mut() {
                p.give(dup);
            }
        }
    }
    freed
}

/// Writes back `cur` (the running interval's pre-write copies) and then the
/// newest `undo` history entries, newest first, removing them: a page saved
/// in several of them ends with the copy of the oldest, which is its content
/// at the target checkpoint. Returns the pages written.
fn undo_intervals<E>(
    cur: &PageSet,
    history: &mut VecDeque<PageSet>,
    undo: usize,
    mut write: impl FnMut(u64, &[u8; PAGE]) -> Result<(), E>,
) -> Result<usize, E> {
    let mut pages = 0;
    for (gpa, data) in cur.iter() {
        write(gpa, data)?;
        pages += 1;
    }
    for _ in 0..undo {
        let set = history.pop_back().expect("checked by Engine::rollback");
        for (gpa, data) in set.iter() {
            write(gpa, data)?;
            pages += 1;
        }
    }
    Ok(pages)
}

fn write_page(view: &GuestMemory, gpa: u64, data: &[u8]) -> Result<(), CheckpointError> {
    view.mem()
        .write_slice(data, GuestAddress(gpa))
        .map_err(|e| CheckpointError::GuestMemory { gpa, why: e.to_string() })
}

fn read_page(view: &GuestMemory, gpa: u64, buf: &mut [u8]) -> Result<(), CheckpointError> {
    view.mem()
        .read_slice(buf, GuestAddress(gpa))
        .map_err(|e| CheckpointError::GuestMemory { gpa, why: e.to_string() })
}

pub struct CowEngine {
    predict: bool,
    /// Saved pages may not have been written (block saves): compare and drop.
    drop_unchanged: bool,
    tracker: WriteTracker,
    /// DP of each interval between kept checkpoints, oldest first.
    history: VecDeque<PageSet>,
    /// Pages pre-saved at the start of the running interval (CoW-P).
    presaved: Vec<u64>,
    view: GuestMemory,
    faults_at_start: u64,
}

impl CowEngine {
    fn checkpoint(&mut self) -> Result<IntervalStats, CheckpointError> {
        // The interval stays locked until memory is protected again, so the
        // fault thread saves each page into exactly one of the two intervals
        // and never unprotects one of the new interval unsaved.
        let mut cur = self.tracker.current();
        let mut ended = std::mem::take(&mut *cur);
        let mut buf = vec![0u8; PAGE];
        // A pre-saved page (or, with block saves, any saved page) whose
        // content did not change was not written: it is not part of this
        // interval's checkpoint, and is write-protected rather than pre-saved
        // next time.
        let candidates = if self.drop_unchanged {
            ended.gpas()
        } else if self.predict {
            std::mem::take(&mut self.presaved)
        } else {
            Vec::new()
        };
        for gpa in candidates {
            read_page(&self.view, gpa, &mut buf)?;
            if ended.get(gpa).is_some_and(|p| p[..] == buf[..]) {
                ended.remove(gpa);
            }
        }
        let faults = self.tracker.faults();
        let stats = IntervalStats {
            pages: ended.len(),
            faults: faults - self.faults_at_start,
            presaved: if self.predict { ended.len() } else { 0 },
            capture: None,
            scanned: 0,
        };
        self.faults_at_start = faults;
        let predicted = if self.predict { ended.gpas() } else { Vec::new() };
        self.history.push_back(ended);

        // The new interval: everything protected but the predicted pages,
        // which are copied now (the VM is paused) and left writable.
        self.tracker.protect_all()?;
        for &gpa in &predicted {
            read_page(&self.view, gpa, &mut buf)?;
            cur.save_once(gpa, &buf);
        }
        drop(cur);
        for (start, len) in runs(&predicted) {
            self.tracker.unprotect(start, len)?;
        }
        self.presaved = predicted;
        Ok(stats)
    }

    fn rollback(&mut self, undo: usize) -> Result<RollbackStats, CheckpointError> {
        // Locked until memory is protected again (see `checkpoint`): a fault
        // served in between would save a page's pre-rollback content.
        let mut guard = self.tracker.current();
        let cur = std::mem::take(&mut *guard);
        let view = &self.view;
        let pages = undo_intervals(&cur, &mut self.history, undo, |g, d| write_page(view, g, d))?;
        let levels = undo as u32 + 1;
        // A new interval starts from the restored state, all protected.
        self.presaved.clear();
        self.tracker.protect_all()?;
        drop(guard);
        self.faults_at_start = self.tracker.faults();
        Ok(RollbackStats { pages, levels })
    }
}

/// Pages in `[start, end)` ranges (page-aligned, as
/// `GuestMemory::allocated_ranges` gives them).
pub fn pages_in(ranges: &[(u64, u64)]) -> usize {
    ranges.iter().map(|(s, e)| ((e - s) / PAGE as u64) as usize).sum()
}

/// Coalesces sorted page addresses into (start, length) runs.
fn runs(gpas: &[u64]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &g in gpas {
        match out.last_mut() {
            Some((s, l)) if *s + *l == g => *l += PAGE as u64,
            _ => out.push((g, PAGE as u64)),
        }
    }
    out
}

/// The shadow-image engines: the dirty-log baseline, the fault-free compare
/// capture and the auto mode that switches between them interval by
/// interval ([`crate::policy`]). A full shadow of guest memory is brought up
/// to date at every checkpoint by a parallel scan ([`crate::shadow`]) of the
/// dirty log's pages or of every allocated page, with an undo set per
/// interval of the pages it overwrote, to reach back along the ring like the
/// CoW engines.
pub struct ShadowEngine {
    shadow: Shadow,
    /// Per interval between kept checkpoints, oldest first: the shadow's
    /// pages before that interval's checkpoint overwrote them.
    history: VecDeque<PageSet>,
    /// Pages the VMM wrote since the last checkpoint (not in KVM's log).
    vmm_dirty: std::collections::BTreeSet<u64>,
    view: GuestMemory,
    /// The running interval's capture.
    capture: Capture,
    /// Auto mode: chooses each interval's capture.
    policy: Option<Policy>,
    threads: usize,
    /// Buffers of dropped undo pages, filled again by later checkpoints.
    pool: PagePool,
    /// Pages the last checkpoint saved (what the next may need from `pool`).
    last_changed: usize,
    /// Backs `pool`'s buffers in bulk while the guest runs (None: it could
    /// not be started; `prepare` fills the pool itself then).
    backer: Option<Backer>,
    buffers: BufferStats,
    /// Pages the guest has allocated, as of the last compare capture or
    /// [`ShadowEngine::prepare`]: the policy's count, which the pause need
    /// not find itself (walking the memfd for it took 2 to 6 ms of each
    /// dirty-log pause, 8% of a profiled run's samples).
    allocated: usize,
}

impl ShadowEngine {
    fn start(vm: &Vm, view: GuestMemory, mode: Mode) -> Result<Self, CheckpointError> {
        let threads = crate::shadow::scan_threads();
        let (capture, policy) = match mode {
            Mode::Compare => (Capture::Compare, None),
            Mode::Auto => {
                let p = Policy::new(UnitCosts::calibrate(crate::policy::LOG_FAULT_US, threads));
                (p.current, Some(p))
            }
            _ => (Capture::DirtyLog, None),
        };
        if capture == Capture::DirtyLog {
            vm.set_dirty_logging(true)?;
        }
        let shadow = Shadow::capture(&view)?;
        if capture == Capture::DirtyLog {
            vm.dirty_bitmaps()?; // clears the log: tracking starts now
        }
        Ok(Self {
            shadow,
            history: VecDeque::new(),
            vmm_dirty: Default::default(),
            view,
            capture,
            policy,
            threads,
            pool: PagePool::default(),
            last_changed: 0,
            backer: Backer::start()
                .map_err(|e| tracing::warn!("checkpoint: no background buffer backer: {e}"))
                .ok(),
            buffers: BufferStats::default(),
            allocated: 0,
        })
    }

    fn buffers(&self) -> BufferStats {
        let mut b = self.buffers;
        if let Some(k) = &self.backer {
            b.backed_ahead = k.backed_pages();
            b.backed_bytes_max = k.mapped_bytes_max();
        }
        b
    }

    /// The pages that may differ from the shadow, as ranges: the dirty log's
    /// (clearing it) and the VMM's own writes, or with the compare capture
    /// every allocated page.
    fn candidates(&mut self, vm: &Vm) -> Result<(Vec<(u64, u64)>, usize), CheckpointError> {
        if self.capture == Capture::Compare {
            self.vmm_dirty.clear();
            let r = self.view.allocated_ranges()?;
            let n = pages_in(&r);
            self.allocated = n;
            return Ok((r, n));
        }
        let mut gpas: Vec<u64> = std::mem::take(&mut self.vmm_dirty).into_iter().collect();
        for (region, bitmap) in vm.dirty_bitmaps()?.iter().enumerate() {
            let base = self.view.regions()[region].gpa;
            for (w, word) in bitmap.iter().enumerate() {
                let mut bits = *word;
                while bits != 0 {
                    let b = bits.trailing_zeros() as usize;
                    gpas.push(base + ((w * 64 + b) * PAGE) as u64);
                    bits &= bits - 1;
                }
            }
        }
        gpas.sort_unstable();
        gpas.dedup();
        let n = gpas.len();
        Ok((runs(&gpas).into_iter().map(|(s, l)| (s, s + l)).collect(), n))
    }

    fn checkpoint(&mut self, vm: &Vm) -> Result<IntervalStats, CheckpointError> {
        // The scan gets the host's cores: the backer waits until it is done,
        // and what it backed so far joins the pool.
        let _hold = self.backer.as_ref().map(Backer::hold);
        if let Some(b) = &self.backer {
            self.pool.give_all(b.take_ready());
        }
        self.buffers.pool_max = self.buffers.pool_max.max(self.pool.len());
        let (ranges, candidates) = self.candidates(vm)?;
        let t0 = std::time::Instant::now();
        let mut undo = PageSet::new();
        let st = self.shadow.scan(
            &self.view,
            &ranges,
            self.threads,
            Some(&mut self.pool),
            &mut undo,
            &mut Vec::new(),
        )?;
        self.history.push_back(undo);
        self.last_changed = st.changed;
        self.buffers.fresh_in_pause += st.fresh as u64;
        let captured = self.capture;
        if let Some(p) = &mut self.policy {
            // The scan's cost as measured now (the host's load changes it):
            // per page visited, on one thread. Its threads' CPU time, not
            // wall time: on a busy host they wait for a core, which says
            // nothing about the capture. Scans that paid one-time costs
            // are left out ([`UnitCosts::learn_scan`](crate::policy::UnitCosts::learn_scan)).
            let us =
                st.cpu_us.unwrap_or_else(|| t0.elapsed().as_secs_f64() * 1e6 * self.threads as f64);
            p.costs.learn_scan(captured, us, st.visited, st.changed, st.faults);
            // Faults are paid per page written, changed or not: the log's
            // count; the compare capture sees the pages that changed.
            let dirty = if captured == Capture::DirtyLog { candidates } else { st.changed };
            let allocated = if captured == Capture::Compare {
                candidates
            } else {
                if self.allocated == 0 {
                    self.allocated = pages_in(&self.view.allocated_ranges()?);
                }
                self.allocated
            };
            let next = p.next(dirty, allocated);
            self.switch(vm, next)?;
        }
        Ok(IntervalStats {
            pages: st.changed,
            faults: 0,
            presaved: 0,
            capture: Some(captured),
            scanned: st.visited,
        })
    }

    fn rollback(&mut self, vm: &Vm, undo_n: usize) -> Result<RollbackStats, CheckpointError> {
        let _hold = self.backer.as_ref().map(Backer::hold);
        // The pages written since the newest checkpoint get their shadow
        // copies back: all the dirty log names, or those a compare finds.
        let (ranges, _) = self.candidates(vm)?;
        let mut changed = Vec::new();
        if self.capture == Capture::Compare {
            self.shadow.scan(
                &self.view,
                &ranges,
                self.threads,
                None,
                &mut PageSet::new(),
                &mut changed,
            )?;
        } else {
            for (s, e) in ranges {
                changed.extend((s..e).step_by(PAGE));
            }
        }
        self.shadow.restore(&self.view, &changed)?;
        let mut pages = changed.len();
        for _ in 0..undo_n {
            let mut undo = self.history.pop_back().expect("checked by Engine::rollback");
            pages += self.undo_one(&undo)?;
            self.pool.give_all(undo.drain().map(|(_, p)| p));
        }
        Ok(RollbackStats { pages, levels: undo_n as u32 + 1 })
    }

    /// See [`Engine::prepare`]. The next checkpoint may need the last
    /// interval's pages and a quarter more; the pool holds at most
    /// `budget_pages` less what the ring holds, plus one interval (the ring
    /// is merged back under its budget after each checkpoint).
    ///
    /// With the backer, twice that need is backed ahead in its thread (a
    /// guest that writes more each interval still finds buffers ready), and
    /// this thread only sets the target; without it, the pool is filled here
    /// until `deadline`.
    fn prepare(&mut self, deadline: std::time::Instant, budget_pages: usize) {
        let held: usize = self.history.iter().map(PageSet::len).sum();
        let room = budget_pages.saturating_sub(held) + self.last_changed;
        let want = (self.last_changed + self.last_changed / 4 + 64).min(room);
        let ahead = if self.backer.is_some() { (2 * want).min(room) } else { want };
        if self.pool.len() > 2 * ahead {
            self.pool.trim(2 * ahead);
        }
        match &self.backer {
            Some(b) => b.set_want(ahead.saturating_sub(self.pool.len())),
            None => self.pool.fill_to(want, deadline),
        }
        if let Ok(r) = self.view.allocated_ranges() {
            self.allocated = pages_in(&r);
            self.shadow.prefault(&r, deadline);
        }
    }

    /// Switches the running interval's capture (at a checkpoint: the shadow
    /// equals memory now).
    fn switch(&mut self, vm: &Vm, next: Capture) -> Result<(), CheckpointError> {
        if next != self.capture {
            match next {
                Capture::Compare => vm.set_dirty_logging(false)?,
                Capture::DirtyLog => {
                    vm.set_dirty_logging(true)?;
                    vm.dirty_bitmaps()?; // clears the log: tracking starts now
                }
            }
            self.vmm_dirty.clear();
            self.capture = next;
        }
        if let Some(p) = &mut self.policy {
            p.current = next;
        }
        Ok(())
    }

    /// Writes one interval's undo log back to memory and the shadow.
    fn undo_one(&mut self, undo: &PageSet) -> Result<usize, CheckpointError> {
        let mut pages = 0;
        for (gpa, data) in undo.iter() {
            write_page(&self.view, gpa, data)?;
            self.shadow.set_page(gpa, data)?;
            pages += 1;
        }
        Ok(pages)
    }
}

#[cfg(test)]
mod tests {
    use super::{merge_at, runs, undo_intervals};
    use crate::pages::PageSet;
    use crate::PAGE;
    use std::collections::VecDeque;

    const PAGES: usize = 24;
    const INTERVALS: usize = 8;

    /// A copy-on-write run over a small memory, without a VM: each interval
    /// writes pseudo-random pages (so pages are written in several
    /// intervals, and several times in one), saving each page's pre-write
    /// copy on its first write in the interval; each checkpoint moves the
    /// running interval's copies into the history and snapshots memory.
    /// Returns memory now (mid-interval), the history, the running
    /// interval's copies and the snapshot at each checkpoint (0 = start).
    struct Run {
        mem: Vec<u8>,
        history: VecDeque<PageSet>,
        cur: PageSet,
        snaps: Vec<Vec<u8>>,
    }

    fn run() -> Run {
        let mut mem: Vec<u8> = (0..PAGES * PAGE).map(|i| (i / PAGE) as u8).collect();
        let (mut history, mut cur) = (VecDeque::new(), PageSet::new());
        let mut snaps = vec![mem.clone()];
        let mut x: u64 = 0x2545_F491_4F6C_DD1D;
        for interval in 0..=INTERVALS {
            for w in 0..10 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let page = (x % PAGES as u64) as usize;
                let gpa = (page * PAGE) as u64;
                cur.save_once(gpa, &mem[page * PAGE..(page + 1) * PAGE]);
                let off = page * PAGE + (x >> 32) as usize % PAGE;
                mem[off] = (interval * 16 + w + 1) as u8;
            }
            if interval < INTERVALS {
                history.push_back(std::mem::take(&mut cur));
                snaps.push(mem.clone());
            }
        }
        Run { mem, history, cur, snaps }
    }

    fn roll_back(r: &mut Run, undo: usize) {
        let Run { mem, history, cur, .. } = r;
        undo_intervals::<()>(cur, history, undo, |gpa, data| {
            mem[gpa as usize..gpa as usize + PAGE].copy_from_slice(data);
            Ok(())
        })
        .unwrap();
    }

    /// Rolling back any number of intervals, with or without merged ring
    /// entries, gives memory byte for byte as it was at the target
    /// checkpoint.
    #[test]
    fn ring_rollback_restores_each_kept_checkpoint_exactly() {
        // Pages are written in several intervals: the order matters.
        let r = run();
        let multi = (0..PAGES as u64)
            .filter(|p| r.history.iter().filter(|s| s.contains(p * PAGE as u64)).count() > 1)
            .count();
        assert!(multi > PAGES / 2, "only {multi} pages written in more than one interval");
        for merges in 0..INTERVALS {
            // Kept checkpoints: 0 and merges+1 ..= INTERVALS.
            let kept: Vec<usize> = std::iter::once(0).chain(merges + 1..=INTERVALS).collect();
            for undo in 0..kept.len() {
                let mut r = run();
                for _ in 0..merges {
                    merge_at(&mut r.history, 0, None);
                }
                assert_eq!(r.history.len() + 1, kept.len());
                roll_back(&mut r, undo);
                let target = kept[kept.len() - 1 - undo];
                for p in 0..PAGES {
                    assert!(
                        r.mem[p * PAGE..(p + 1) * PAGE]
                            == r.snaps[target][p * PAGE..(p + 1) * PAGE],
                        "{merges} merges, {undo} intervals undone: page {p} differs from \
                         checkpoint {target}"
                    );
                }
                assert_eq!(r.history.len() + 1, kept.len() - undo);
            }
        }
    }

    #[test]
    fn merging_keeps_the_older_copy_and_frees_duplicates() {
        let mut h = VecDeque::new();
        let (mut a, mut b) = (PageSet::new(), PageSet::new());
        a.save_once(0, &[1u8; PAGE]);
        b.save_once(0, &[2u8; PAGE]);
        b.save_once(PAGE as u64, &[3u8; PAGE]);
        h.push_back(a);
        h.push_back(b);
        assert_eq!(merge_at(&mut h, 0, None), 1);
        assert_eq!(h.len(), 1);
        assert_eq!(h[0].get(0).unwrap()[0], 1);
        assert_eq!(h[0].get(PAGE as u64).unwrap()[0], 3);
        assert_eq!(merge_at(&mut h, 0, None), 0);
    }

    #[test]
    fn merging_in_the_middle_keeps_the_neighbours() {
        // Entries 0..3; merging 2 into 1 leaves 0 and 3 as they were.
        let mut h: VecDeque<PageSet> = (0..4u8)
            .map(|i| {
                let mut p = PageSet::new();
                p.save_once(0, &[i; PAGE]);
                p.save_once(PAGE as u64 * (u64::from(i) + 1), &[i; PAGE]);
                p
            })
            .collect();
        assert_eq!(merge_at(&mut h, 1, None), 1);
        assert_eq!(h.len(), 3);
        assert_eq!(
            (h[0].get(0).unwrap()[0], h[1].get(0).unwrap()[0], h[2].get(0).unwrap()[0]),
            (0, 1, 3)
        );
        assert_eq!(h[1].get(3 * PAGE as u64).unwrap()[0], 2, "the newer entry's own page kept");
        assert_eq!(merge_at(&mut h, 2, None), 0, "no entry after the last");
    }

    #[test]
    fn runs_coalesce_contiguous_pages() {
        assert_eq!(runs(&[]), vec![]);
        assert_eq!(
            runs(&[0x1000, 0x2000, 0x3000, 0x5000]),
            vec![(0x1000, 0x3000), (0x5000, 0x1000)]
        );
    }
}
