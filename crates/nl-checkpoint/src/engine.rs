//! The checkpoint engines: CoW-B, CoW-P and the dirty-log baseline.
//!
//! Each keeps the pages needed to take memory back to the previous two
//! checkpoints: DP_prev (pre-write copies from the interval that ended at the
//! last checkpoint) and DP_cur (from the interval running now). Rollback
//! writes DP_cur and then DP_prev back (the paper's equation 2). Restores go
//! through a second mapping of the memfd that is not registered with
//! userfaultfd, so they never fault on the protection they are undoing.

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
    /// 2: back to the older checkpoint; 1: only one checkpoint existed.
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
                    prev: None,
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

    /// Restores memory to the older checkpoint; the vCPUs must be halted.
    pub fn rollback(&mut self, vm: &Vm) -> Result<RollbackStats, CheckpointError> {
        match self {
            Engine::Cow(e) => e.rollback(),
            Engine::DirtyLog(e) => e.rollback(vm),
        }
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

    /// The content page `gpa` had at the committed (older) checkpoint, if it
    /// differs from memory at the newest one: memory at the committed
    /// checkpoint is current memory (at a checkpoint) overlaid with these.
    pub fn committed_page(&self, gpa: u64) -> Option<[u8; PAGE]> {
        let page = match self {
            Engine::Cow(e) => e.prev.as_ref()?.get(gpa)?,
            Engine::DirtyLog(e) => e.undo.get(gpa)?,
        };
        Some(*page)
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
    prev: Option<PageSet>,
    /// Pages pre-saved at the start of the running interval (CoW-P).
    presaved: Vec<u64>,
    view: GuestMemory,
    faults_at_start: u64,
}

impl CowEngine {
    fn checkpoint(&mut self) -> Result<IntervalStats, CheckpointError> {
        let mut ended = std::mem::take(&mut *self.tracker.current());
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
        self.prev = Some(ended);

        // The new interval: everything protected but the predicted pages,
        // which are copied now (the VM is paused) and left writable.
        self.tracker.protect_all()?;
        {
            let mut cur = self.tracker.current();
            for &gpa in &predicted {
                read_page(&self.view, gpa, &mut buf)?;
                cur.save_once(gpa, &buf);
            }
        }
        for (start, len) in runs(&predicted) {
            self.tracker.unprotect(start, len)?;
        }
        self.presaved = predicted;
        Ok(stats)
    }

    fn rollback(&mut self) -> Result<RollbackStats, CheckpointError> {
        let cur = std::mem::take(&mut *self.tracker.current());
        let mut pages = 0;
        for (gpa, data) in cur.iter() {
            write_page(&self.view, gpa, data)?;
            pages += 1;
        }
        let mut levels = 1;
        if let Some(prev) = self.prev.take() {
            for (gpa, data) in prev.iter() {
                write_page(&self.view, gpa, data)?;
                pages += 1;
            }
            levels = 2;
        }
        // A new interval starts from the restored state, all protected.
        self.presaved.clear();
        self.tracker.protect_all()?;
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
/// brought up to date at every checkpoint (with an undo log of the pages it
/// overwrote, to reach back two checkpoints like the CoW engines).
pub struct DirtyLogEngine {
    shadow: Vec<Vec<u8>>,
    undo: PageSet,
    /// Whether a checkpoint older than the shadow image exists (via `undo`).
    has_prev: bool,
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
        Ok(Self {
            shadow,
            undo: PageSet::new(),
            has_prev: false,
            vmm_dirty: Default::default(),
            view,
        })
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
        self.undo = undo;
        self.has_prev = true;
        Ok(IntervalStats { pages: dirty.len(), faults: 0, presaved: 0 })
    }

    fn rollback(&mut self, vm: &Vm) -> Result<RollbackStats, CheckpointError> {
        let dirty = self.dirty_pages(vm)?;
        let mut pages = 0;
        for &(region, page) in &dirty {
            let gpa = self.view.regions()[region].gpa + (page * PAGE) as u64;
            let off = page * PAGE;
            write_page(&self.view, gpa, &self.shadow[region][off..off + PAGE])?;
            pages += 1;
        }
        let undo = std::mem::take(&mut self.undo);
        let levels = if std::mem::take(&mut self.has_prev) { 2 } else { 1 };
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
        Ok(RollbackStats { pages, levels })
    }
}

#[cfg(test)]
mod tests {
    use super::runs;

    #[test]
    fn runs_coalesce_contiguous_pages() {
        assert_eq!(runs(&[]), vec![]);
        assert_eq!(
            runs(&[0x1000, 0x2000, 0x3000, 0x5000]),
            vec![(0x1000, 0x3000), (0x5000, 0x1000)]
        );
    }
}
