//! A full shadow image of guest RAM (its content at the newest checkpoint)
//! and the parallel scan that brings it up to date.
//!
//! The image is one slot per guest page: a page buffer, or nothing for a
//! page that was zero (never allocated, or cleared). A changed page gets a
//! new buffer from the pool with its new content, and its old buffer goes
//! into the interval's undo set as it is: one copy per changed page, not
//! two (old shadow content into an undo buffer, then new content over the
//! shadow), and a page the guest allocated since needs no undo buffer at
//! all (its undo copy is [`Page::Zero`]). The image's buffers come from the
//! pool too, backed between checkpoints, so a scan touches no fresh memory
//! while the pool lasts.
//!
//! The dirty-log, compare and auto engines keep one: a checkpoint visits
//! candidate pages (the dirty log's pages, or every allocated page for the
//! fault-free compare capture), and each candidate whose content differs
//! from the shadow has its shadow copy saved into the interval's undo set
//! and the shadow overwritten with the new content. The scan is split over
//! several threads (the vCPUs are stopped while it runs, so the host's cores
//! are free); each thread owns a disjoint part of the shadow.

use nl_memory::GuestMemory;
use vm_memory::{Bytes, GuestAddress};

use crate::pages::{Page, PagePool, PageSet};
use crate::{CheckpointError, PAGE};

/// Pages looked up in guest memory at a time during a scan.
const CHUNK_PAGES: u64 = 256;

/// Guest RAM at the newest checkpoint, all regions end to end, a slot per
/// page (`None`: the page is zero).
pub struct Shadow {
    slots: Vec<Option<Page>>,
    /// Per region: (gpa, size, index of its first slot).
    regions: Vec<(u64, u64, usize)>,
}

/// What one scan found.
#[derive(Clone, Copy, Debug, Default)]
pub struct ScanStats {
    /// Candidate pages visited.
    pub visited: usize,
    /// Pages whose content differed from the shadow.
    pub changed: usize,
    /// Buffers the scan allocated itself: the pool had too few (each may
    /// cost a page fault inside the pause).
    pub fresh: usize,
}

static ZERO: [u8; PAGE] = [0; PAGE];

impl Shadow {
    /// A shadow holding `view`'s content now.
    pub fn capture(view: &GuestMemory) -> Result<Self, CheckpointError> {
        let mut regions = Vec::new();
        let mut slot = 0usize;
        for r in view.regions() {
            regions.push((r.gpa, r.size, slot));
            slot += (r.size / PAGE as u64) as usize;
        }
        let mut sh = Self { slots: (0..slot).map(|_| None).collect(), regions };
        // Only pages the guest's memory has allocated are read: reading a
        // hole of a shared memfd mapping would allocate it.
        for (s, e, o) in sh.clip(&view.allocated_ranges()?) {
            let bytes = crate::slab::guest_bytes(view, s, (e - s) as usize)
                .map_err(|e| CheckpointError::GuestMemory { gpa: s, why: e.to_string() })?;
            for (i, now) in bytes.chunks_exact(PAGE).enumerate() {
                if now != ZERO {
                    let mut p = Page::fresh();
                    p.copy_from_slice(now);
                    sh.slots[o + i] = Some(p);
                }
            }
        }
        Ok(sh)
    }

    /// Slot of `gpa`, if it is guest RAM.
    fn slot(&self, gpa: u64) -> Option<usize> {
        self.regions
            .iter()
            .find(|(g, s, _)| gpa >= *g && gpa < *g + *s)
            .map(|(g, _, o)| o + ((gpa - g) / PAGE as u64) as usize)
    }

    /// The shadow copy of page `gpa`.
    pub fn page(&self, gpa: u64) -> Option<&[u8]> {
        self.slot(gpa).map(|i| self.slots[i].as_deref().map_or(&ZERO[..], |p| &p[..]))
    }

    /// Overwrites the shadow copy of page `gpa`.
    pub fn set_page(&mut self, gpa: u64, data: &[u8]) -> Result<(), CheckpointError> {
        let i = self
            .slot(gpa)
            .ok_or(CheckpointError::GuestMemory { gpa, why: "not guest RAM".into() })?;
        self.slots[i].get_or_insert_with(Page::fresh).copy_from_slice(&data[..PAGE]);
        Ok(())
    }

    /// Page-aligned `[start, end)` ranges of guest RAM, clipped to RAM and
    /// sorted, from any ranges.
    fn clip(&self, ranges: &[(u64, u64)]) -> Vec<(u64, u64, usize)> {
        let mut out = Vec::new();
        for &(s, e) in ranges {
            let (s, e) = (s & !(PAGE as u64 - 1), e.div_ceil(PAGE as u64) * PAGE as u64);
            for &(g, size, o) in &self.regions {
                let (a, b) = (s.max(g), e.min(g + size));
                if a < b {
                    out.push((a, b, o + ((a - g) / PAGE as u64) as usize));
                }
            }
        }
        out.sort_unstable_by_key(|r| r.2);
        out
    }

    /// Visits the pages of `ranges` on `threads` threads. Each page whose
    /// content in `view` differs from the shadow has its shadow copy saved in
    /// `undo` (unless there already is one, in buffers from `pool`) and the
    /// shadow updated, when a pool is given; otherwise the differing pages
    /// are only listed in `changed` (a rollback writes the shadow back to
    /// them).
    pub fn scan(
        &mut self,
        view: &GuestMemory,
        ranges: &[(u64, u64)],
        threads: usize,
        mut pool: Option<&mut PagePool>,
        undo: &mut PageSet,
        changed: &mut Vec<u64>,
    ) -> Result<ScanStats, CheckpointError> {
        let update = pool.is_some();
        let work = self.clip(ranges);
        let total: u64 = work.iter().map(|(s, e, _)| (e - s) / PAGE as u64).sum();
        let threads = threads.clamp(1, 16).min(total.max(1) as usize);
        // Cut the work into `threads` groups of about equal pages; each group
        // gets the part of the image its ranges lie in (ranges are sorted by
        // slot and do not overlap).
        let per = total.div_ceil(threads as u64).max(1);
        let mut groups: Vec<Vec<(u64, u64, usize)>> = vec![Vec::new()];
        let mut in_group = 0u64;
        for (mut s, e, mut o) in work {
            while s < e {
                if in_group == per && groups.len() < threads {
                    groups.push(Vec::new());
                    in_group = 0;
                }
                let take = ((e - s) / PAGE as u64).min(per - in_group);
                let end = s + take * PAGE as u64;
                groups.last_mut().expect("one group at least").push((s, end, o));
                in_group += take;
                o += take as usize;
                s = end;
            }
        }
        // Split the image at each group's first slot.
        let mut parts = Vec::new();
        let mut rest: &mut [Option<Page>] = &mut self.slots;
        let mut base = 0usize;
        for (i, g) in groups.iter().enumerate() {
            let end = groups.get(i + 1).and_then(|n| n.first()).map_or(base + rest.len(), |r| r.2);
            let (mine, tail) = rest.split_at_mut(end - base);
            parts.push((g.as_slice(), base, mine));
            rest = tail;
            base = end;
        }
        // The pool's buffers, shared: the threads take them in batches as
        // they find changed pages (which may all lie in one thread's part).
        let shared = std::sync::Mutex::new(
            pool.as_deref_mut().map_or_else(Vec::new, |p| p.take_many(p.len())),
        );
        let shared = &shared;
        let results: Vec<Result<PartResult, CheckpointError>> = std::thread::scope(|sc| {
            let handles: Vec<_> = parts
                .into_iter()
                .map(|(g, base, img)| {
                    sc.spawn(move || scan_part(view, g, base, img, update, shared))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(CheckpointError::Config("a scan thread panicked".into()))
                    })
                })
                .collect()
        });
        let mut stats = ScanStats::default();
        let mut first_err = None;
        for r in results {
            let r = match r {
                Ok(r) => r,
                Err(e) => {
                    first_err.get_or_insert(e);
                    continue;
                }
            };
            stats.visited += r.visited;
            stats.changed += r.found.len() + r.diff.len();
            stats.fresh += r.fresh;
            for (gpa, old) in r.found {
                if let Some(dup) = undo.insert_page(gpa, old) {
                    if let Some(p) = pool.as_deref_mut() {
                        p.give(dup);
                    }
                }
            }
            if let Some(p) = pool.as_deref_mut() {
                p.give_all(r.spare);
                p.note_fresh(r.fresh);
            }
            changed.extend(r.diff);
        }
        if let Some(p) = pool {
            p.give_all(std::mem::take(&mut *shared.lock().unwrap_or_else(|e| e.into_inner())));
        }
        first_err.map_or(Ok(stats), Err)
    }

    /// Writes the shadow copy of each page in `gpas` back to guest memory.
    pub fn restore(&self, view: &GuestMemory, gpas: &[u64]) -> Result<(), CheckpointError> {
        for &gpa in gpas {
            let data = self
                .page(gpa)
                .ok_or(CheckpointError::GuestMemory { gpa, why: "not guest RAM".into() })?;
            view.mem()
                .write_slice(data, GuestAddress(gpa))
                .map_err(|e| CheckpointError::GuestMemory { gpa, why: e.to_string() })?;
        }
        Ok(())
    }
}

/// What one scan thread found.
struct PartResult {
    visited: usize,
    /// Updating: (gpa, old shadow copy) of each changed page.
    found: Vec<(u64, Page)>,
    /// Not updating: the changed pages.
    diff: Vec<u64>,
    /// Buffers handed in and not used.
    spare: Vec<Page>,
    /// Buffers allocated because `spare` ran out.
    fresh: usize,
}

/// Buffers a scan thread takes from the shared pool at a time.
const BATCH: usize = 64;

/// One scan thread: its ranges, the slot its part of the image starts at,
/// that part, and the pool's buffers for new shadow copies (more are
/// allocated when they run out).
fn scan_part(
    view: &GuestMemory,
    ranges: &[(u64, u64, usize)],
    base: usize,
    slots: &mut [Option<Page>],
    update: bool,
    pool: &std::sync::Mutex<Vec<Page>>,
) -> Result<PartResult, CheckpointError> {
    let (mut visited, mut found, mut diff, mut fresh) = (0usize, Vec::new(), Vec::new(), 0);
    let mut spare: Vec<Page> = Vec::new();
    for &(s, e, o) in ranges {
        let mut gpa = s;
        while gpa < e {
            let n = ((e - gpa) / PAGE as u64).min(CHUNK_PAGES) as usize;
            // Compared in place: no bounce copy of every visited page.
            let chunk = crate::slab::guest_bytes(view, gpa, n * PAGE)
                .map_err(|e| CheckpointError::GuestMemory { gpa, why: e.to_string() })?;
            let at = o + ((gpa - s) / PAGE as u64) as usize - base;
            for (i, now) in chunk.chunks_exact(PAGE).enumerate() {
                let slot = &mut slots[at + i];
                let same = match slot {
                    Some(p) => p[..] == *now,
                    None => *now == ZERO,
                };
                if same {
                    continue;
                }
                let page = gpa + (i * PAGE) as u64;
                if update {
                    if spare.is_empty() {
                        let mut p = pool.lock().unwrap_or_else(|e| e.into_inner());
                        let at = p.len().saturating_sub(BATCH);
                        spare = p.split_off(at);
                    }
                    let mut new = spare.pop().unwrap_or_else(|| {
                        fresh += 1;
                        Page::fresh()
                    });
                    new.copy_from_slice(now);
                    // The old copy goes to the undo set as it is.
                    found.push((page, slot.replace(new).unwrap_or(Page::Zero)));
                } else {
                    diff.push(page);
                }
            }
            visited += n;
            gpa += (n * PAGE) as u64;
        }
    }
    Ok(PartResult { visited, found, diff, spare, fresh })
}

/// Host threads a scan may use: the host's cores (the vCPUs are stopped).
pub fn scan_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get()).min(8)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mem(mib: u64) -> GuestMemory {
        GuestMemory::new("shadow-test", mib << 20).unwrap()
    }

    fn write(view: &GuestMemory, gpa: u64, byte: u8) {
        view.mem().write_slice(&[byte], GuestAddress(gpa)).unwrap();
    }

    /// Every changed page is found, on any thread count, wherever it lies
    /// (first and last page of RAM, the edges of scan chunks and of the
    /// threads' parts), and the shadow then equals memory.
    #[test]
    fn a_scan_finds_every_changed_page_on_any_thread_count() {
        let view = mem(40);
        let pages = view.size() / PAGE as u64;
        let last = view.regions().last().map(|r| r.gpa + r.size - PAGE as u64).unwrap();
        for threads in [1, 2, 3, 7] {
            let mut shadow = Shadow::capture(&view).unwrap();
            // Recycled buffers hold stale content: the undo copies must not.
            let mut pool = PagePool::default();
            for _ in 0..5 {
                pool.give(Page::Heap(Box::new([0xEE; PAGE])));
            }
            let first = view.regions()[0].gpa;
            let mut want: Vec<u64> = vec![first, last];
            for k in [15u64, 16, 17, 511, 512, 1000, pages / 2, pages / 2 + 1] {
                let gpa = first + (k % pages) * PAGE as u64;
                if view.regions().iter().any(|r| gpa >= r.gpa && gpa < r.gpa + r.size) {
                    want.push(gpa);
                }
            }
            want.sort_unstable();
            want.dedup();
            for (i, &g) in want.iter().enumerate() {
                write(&view, g + 100, 0xA0 + i as u8);
            }
            let all: Vec<(u64, u64)> =
                view.regions().iter().map(|r| (r.gpa, r.gpa + r.size)).collect();
            let (mut undo, mut changed) = (PageSet::new(), Vec::new());
            let st = shadow
                .scan(&view, &all, threads, Some(&mut pool), &mut undo, &mut changed)
                .unwrap();
            assert_eq!(undo.gpas(), want, "{threads} threads");
            assert_eq!(st.visited as u64, pages, "{threads} threads");
            for &g in &want {
                assert_eq!(undo.get(g).unwrap()[100], 0, "the undo copy is the old content");
                let mut now = [0u8; PAGE];
                view.mem().read_slice(&mut now, GuestAddress(g)).unwrap();
                assert_eq!(shadow.page(g).unwrap(), &now[..]);
            }
            // Nothing changed since: a second scan finds nothing.
            let (mut undo2, mut changed2) = (PageSet::new(), Vec::new());
            shadow.scan(&view, &all, threads, Some(&mut pool), &mut undo2, &mut changed2).unwrap();
            assert!(undo2.is_empty());
            // Restore the memory for the next thread count.
            for &g in &want {
                write(&view, g + 100, 0);
            }
        }
    }

    /// With enough buffers in the pool a scan allocates none in the pause;
    /// with an empty pool every undo copy is a fresh allocation, counted.
    /// The undo copies are the old content either way.
    #[test]
    fn a_scan_takes_its_undo_buffers_from_the_pool() {
        let view = mem(40);
        let base = view.regions()[0].gpa;
        let all: Vec<(u64, u64)> = view.regions().iter().map(|r| (r.gpa, r.gpa + r.size)).collect();
        for (filled, threads) in [(true, 2), (false, 2), (true, 1)] {
            let mut shadow = Shadow::capture(&view).unwrap();
            let mut pool = PagePool::default();
            if filled {
                pool.fill_to(600, std::time::Instant::now() + std::time::Duration::from_secs(60));
            }
            let gpas: Vec<u64> = (0..600u64).map(|k| base + (k * 7 + 3) * PAGE as u64).collect();
            for &g in &gpas {
                write(&view, g + 9, 0x5A);
            }
            let (mut undo, mut changed) = (PageSet::new(), Vec::new());
            let st = shadow
                .scan(&view, &all, threads, Some(&mut pool), &mut undo, &mut changed)
                .unwrap();
            assert_eq!(st.changed, gpas.len());
            assert_eq!(st.fresh, if filled { 0 } else { gpas.len() }, "filled: {filled}");
            assert_eq!(pool.fresh() as usize, st.fresh);
            for &g in &gpas {
                assert_eq!(undo.get(g).unwrap()[9], 0, "the undo copy is the old content");
                assert_eq!(shadow.page(g).unwrap()[9], 0x5A);
            }
            // The first changes' undo copies were zero pages: no buffers.
            assert!(undo.iter().all(|(_, p)| p.iter().all(|&b| b == 0)));
            pool.give_all(undo.drain().map(|(_, p)| p));
            if filled {
                pool.fill_to(
                    gpas.len(),
                    std::time::Instant::now() + std::time::Duration::from_secs(60),
                );
            }
            // Again over pages that hold data now: the undo copies are the
            // shadow's buffers of the last checkpoint, moved, not the new
            // content.
            let before = pool.fresh();
            for &g in &gpas {
                write(&view, g + 9, 0x77);
            }
            let (mut undo, mut changed) = (PageSet::new(), Vec::new());
            let st = shadow
                .scan(&view, &all, threads, Some(&mut pool), &mut undo, &mut changed)
                .unwrap();
            assert_eq!(st.changed, gpas.len());
            for &g in &gpas {
                assert_eq!(undo.get(g).unwrap()[9], 0x5A, "the undo copy is the old content");
                assert_eq!(shadow.page(g).unwrap()[9], 0x77);
            }
            if filled {
                assert_eq!(pool.fresh(), before, "the pool had the buffers");
            }
            // Restoring from the shadow and the undo set gives each state back.
            shadow.restore(&view, &gpas).unwrap();
            let mut b = [0u8; 1];
            view.mem().read_slice(&mut b, GuestAddress(gpas[0] + 9)).unwrap();
            assert_eq!(b[0], 0x77);
            for &g in &gpas {
                write(&view, g + 9, 0);
            }
        }
    }

    /// A scan without update lists the changed pages and leaves the shadow
    /// alone; restoring writes the old content back.
    #[test]
    fn a_rollback_scan_lists_and_restores_changed_pages() {
        let view = mem(40);
        let mut shadow = Shadow::capture(&view).unwrap();
        let g = view.regions()[0].gpa + 37 * PAGE as u64;
        write(&view, g, 7);
        let all: Vec<(u64, u64)> = vec![(0, u64::MAX / 2)];
        let (mut undo, mut changed) = (PageSet::new(), Vec::new());
        shadow.scan(&view, &all, 2, None, &mut undo, &mut changed).unwrap();
        assert_eq!(changed, vec![g]);
        assert!(undo.is_empty());
        shadow.restore(&view, &changed).unwrap();
        let mut b = [1u8; 1];
        view.mem().read_slice(&mut b, GuestAddress(g)).unwrap();
        assert_eq!(b[0], 0);
    }
}
