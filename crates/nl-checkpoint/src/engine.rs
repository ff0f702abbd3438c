//! The checkpoint engines: CoW-B, CoW-P and the dirty-log baseline.
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

use crate::pages::PageSet;
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
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::CowB => "cow-b",
            Mode::CowP => "cow-p",
            Mode::DirtyLog => "dirty-log",
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
    DirtyLog(DirtyLogEngine),
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
            Mode::DirtyLog => Engine::DirtyLog(DirtyLogEngine::start(vm, view)?),
        })
    }

    /// Takes a checkpoint; the VM must be paused.
    pub fn checkpoint(&mut self, vm: &Vm) -> Result<IntervalStats, CheckpointError> {
        match self {
            Engine::Cow(e) => e.checkpoint(),
            Engine::DirtyLog(e) => e.checkpoint(vm),
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
            Engine::DirtyLog(e) => e.rollback(vm, undo),
        }
    }

    fn history(&self) -> &VecDeque<PageSet> {
        match self {
            Engine::Cow(e) => &e.history,
            Engine::DirtyLog(e) => &e.history,
        }
    }

    fn history_mut(&mut self) -> &mut VecDeque<PageSet> {
        match self {
            Engine::Cow(e) => &mut e.history,
            Engine::DirtyLog(e) => &mut e.history,
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

    /// Merges history entry 1 into entry 0: checkpoint 1 can no longer be
    /// rolled back to, and the pages both saved are held once (the older
    /// copy, which is what checkpoint 0 needs). Returns the pages freed.
    pub fn merge_oldest(&mut self) -> usize {
        merge_oldest(self.history_mut())
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
        if let Engine::DirtyLog(e) = self {
            e.vmm_dirty.insert(gpa & !(PAGE as u64 - 1));
        }
    }

    /// Pages held right now for the running interval.
    pub fn current_pages(&self) -> usize {
        match self {
            Engine::Cow(e) => e.tracker.current().len(),
            Engine::DirtyLog(_) => 0,
        }
    }

    /// An error met asynchronously (by the fault thread).
    pub fn error(&self) -> Option<String> {
        match self {
            Engine::Cow(e) => e.tracker.error(),
            Engine::DirtyLog(_) => None,
        }
    }
}

/// Merges history entry 1 into entry 0 (see [`Engine::merge_oldest`]):
/// entry 0's copy of a page is the older one and wins; pages only entry 1
/// saved join it. Returns the pages freed.
fn merge_oldest(h: &mut VecDeque<PageSet>) -> usize {
    if h.len() < 2 {
        return 0;
    }
    let newer = h.remove(1).expect("checked");
    let older = &mut h[0];
    let mut freed = 0;
    for (gpa, data) in newer.iter() {
        if !older.save_once(gpa, data) {
            freed += 1;
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

/// The baseline: KVM dirty logging and a full shadow copy of guest memory,
/// brought up to date at every checkpoint (with an undo log per interval of
/// the pages it overwrote, to reach back along the ring like the CoW engines).
pub struct DirtyLogEngine {
    shadow: Vec<Vec<u8>>,
    /// Per interval between kept checkpoints, oldest first: the shadow's
    /// pages before that interval's checkpoint overwrote them.
    history: VecDeque<PageSet>,
    /// Pages the VMM wrote since the last checkpoint (not in KVM's log).
    vmm_dirty: std::collections::BTreeSet<u64>,
    view: GuestMemory,
}

impl DirtyLogEngine {
    fn start(vm: &Vm, view: GuestMemory) -> Result<Self, CheckpointError> {
        vm.set_dirty_logging(true)?;
        let mut shadow = Vec::new();
        for r in view.regions() {
            let mut img = vec![0u8; r.size as usize];
            view.mem()
                .read_slice(&mut img, GuestAddress(r.gpa))
                .map_err(|e| CheckpointError::GuestMemory { gpa: r.gpa, why: e.to_string() })?;
            shadow.push(img);
        }
        vm.dirty_bitmaps()?; // clears the log: tracking starts now
        Ok(Self { shadow, history: VecDeque::new(), vmm_dirty: Default::default(), view })
    }

    /// Pages written since the last checkpoint, by the guest (KVM's log) or
    /// by the VMM, as (region, page index); clears both.
    fn dirty_pages(&mut self, vm: &Vm) -> Result<Vec<(usize, usize)>, CheckpointError> {
        let mut out = Vec::new();
        for gpa in std::mem::take(&mut self.vmm_dirty) {
            if let Some(region) =
                self.view.regions().iter().position(|r| gpa >= r.gpa && gpa < r.gpa + r.size)
            {
                out.push((region, ((gpa - self.view.regions()[region].gpa) as usize) / PAGE));
            }
        }
        for (region, bitmap) in vm.dirty_bitmaps()?.iter().enumerate() {
            for (w, word) in bitmap.iter().enumerate() {
                let mut bits = *word;
                while bits != 0 {
                    let b = bits.trailing_zeros() as usize;
                    out.push((region, w * 64 + b));
                    bits &= bits - 1;
                }
            }
        }
        out.sort_unstable();
        out.dedup();
        Ok(out)
    }

    fn checkpoint(&mut self, vm: &Vm) -> Result<IntervalStats, CheckpointError> {
        let dirty = self.dirty_pages(vm)?;
        let mut undo = PageSet::new();
        let mut buf = vec![0u8; PAGE];
        for &(region, page) in &dirty {
            let gpa = self.view.regions()[region].gpa + (page * PAGE) as u64;
            let off = page * PAGE;
            undo.save_once(gpa, &self.shadow[region][off..off + PAGE]);
            read_page(&self.view, gpa, &mut buf)?;
            self.shadow[region][off..off + PAGE].copy_from_slice(&buf);
        }
        self.history.push_back(undo);
        Ok(IntervalStats { pages: dirty.len(), faults: 0, presaved: 0 })
    }

    fn rollback(&mut self, vm: &Vm, undo_n: usize) -> Result<RollbackStats, CheckpointError> {
        let dirty = self.dirty_pages(vm)?;
        let mut pages = 0;
        for &(region, page) in &dirty {
            let gpa = self.view.regions()[region].gpa + (page * PAGE) as u64;
            let off = page * PAGE;
            write_page(&self.view, gpa, &self.shadow[region][off..off + PAGE])?;
            pages += 1;
        }
        for _ in 0..undo_n {
            let undo = self.history.pop_back().expect("checked by Engine::rollback");
            pages += self.undo_one(&undo)?;
        }
        Ok(RollbackStats { pages, levels: undo_n as u32 + 1 })
    }

    /// Writes one interval's undo log back to memory and the shadow.
    fn undo_one(&mut self, undo: &PageSet) -> Result<usize, CheckpointError> {
        let mut pages = 0;
        for (gpa, data) in undo.iter() {
            write_page(&self.view, gpa, data)?;
            let region = self
                .view
                .regions()
                .iter()
                .position(|r| gpa >= r.gpa && gpa < r.gpa + r.size)
                .ok_or(CheckpointError::GuestMemory { gpa, why: "not guest RAM".into() })?;
            let off = (gpa - self.view.regions()[region].gpa) as usize;
            self.shadow[region][off..off + PAGE].copy_from_slice(data);
            pages += 1;
        }
        Ok(pages)
    }
}

#[cfg(test)]
mod tests {
    use super::{merge_oldest, runs, undo_intervals};
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
                    merge_oldest(&mut r.history);
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
        assert_eq!(merge_oldest(&mut h), 1);
        assert_eq!(h.len(), 1);
        assert_eq!(h[0].get(0).unwrap()[0], 1);
        assert_eq!(h[0].get(PAGE as u64).unwrap()[0], 3);
        assert_eq!(merge_oldest(&mut h), 0);
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
