//! A full shadow image of guest RAM (its content at the newest checkpoint)
//! and the parallel scan that brings it up to date.
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

/// Pages read from guest memory per call during a scan.
const CHUNK_PAGES: u64 = 16;

/// Guest RAM at the newest checkpoint, all regions end to end.
pub struct Shadow {
    image: Vec<u8>,
    /// Per region: (gpa, size, offset in `image`).
    regions: Vec<(u64, u64, usize)>,
    /// [`Shadow::prefault`]: the image pages it backed (empty until then).
    backed: Vec<bool>,
}

/// What one scan found.
#[derive(Clone, Copy, Debug, Default)]
pub struct ScanStats {
    /// Candidate pages visited.
    pub visited: usize,
    /// Pages whose content differed from the shadow.
    pub changed: usize,
    /// Undo buffers allocated during the scan (the pool ran out): each
    /// costs a first-touch page fault in the pause.
    pub fresh: usize,
    /// The scan threads' CPU time, summed (µs; None where the kernel does
    /// not report it): unlike wall time, it leaves out the time they waited
    /// for a core on a busy host.
    pub cpu_us: Option<f64>,
    /// Page faults the scan threads took: first touches of undo buffers, of
    /// the shadow image or of guest pages new to the VMM's mapping.
    pub faults: u64,
}

impl Shadow {
    /// A shadow holding `view`'s content now.
    pub fn capture(view: &GuestMemory) -> Result<Self, CheckpointError> {
        let mut regions = Vec::new();
        let mut off = 0usize;
        for r in view.regions() {
            regions.push((r.gpa, r.size, off));
            off += r.size as usize;
        }
        // Zeroed (untouched pages of the image cost nothing); only pages the
        // guest's memory has allocated are read: reading a hole of a shared
        // memfd mapping would allocate it.
        let mut sh = Self { image: vec![0u8; off], regions, backed: Vec::new() };
        for (s, e, o) in sh.clip(&view.allocated_ranges()?) {
            view.mem()
                .read_slice(&mut sh.image[o..o + (e - s) as usize], GuestAddress(s))
                .map_err(|e| CheckpointError::GuestMemory { gpa: s, why: e.to_string() })?;
        }
        Ok(sh)
    }

    /// Backs the image's pages of the guest's allocated `ranges` with host
    /// memory, until `deadline`; returns whether all of them are backed.
    ///
    /// The image starts out as untouched zero pages (only the pages the
    /// guest had allocated at the start are read in). On a host whose own
    /// page faults are slow (a PVM host is itself a guest: about 3 to 6 µs
    /// per first touch), the first scan to copy a page the guest allocated
    /// since would pay that fault inside the pause; this pays it between
    /// checkpoints, while the guest runs. Pages the guest never allocated
    /// are left alone (backing them would cost the host for nothing).
    pub fn prefault(&mut self, ranges: &[(u64, u64)], deadline: std::time::Instant) -> bool {
        let pages = self.image.len() / PAGE;
        if self.backed.len() != pages {
            self.backed = vec![false; pages];
        }
        // In runs of up to 64 unbacked pages, one madvise each.
        const RUN: usize = 64;
        for (s, e, o) in self.clip(ranges) {
            let (first, end) = (o / PAGE, o / PAGE + (e - s) as usize / PAGE);
            let mut p = first;
            while p < end {
                if self.backed[p] {
                    p += 1;
                    continue;
                }
                if std::time::Instant::now() >= deadline {
                    return false;
                }
                let mut q = p;
                while q < end && q - p < RUN && !self.backed[q] {
                    q += 1;
                }
                // One page more on each side: the image need not start on
                // a host page boundary, and populate rounds inwards.
                let (a, b) = (p.saturating_sub(1) * PAGE, ((q + 1).min(pages)) * PAGE);
                if !crate::slab::populate(&mut self.image[a..b]) {
                    for r in p..q {
                        // A write (of the byte already there) backs the
                        // page; a read would map the shared zero page.
                        let v = self.image[r * PAGE];
                        self.image[r * PAGE] = std::hint::black_box(v);
                    }
                }
                self.backed[p..q].fill(true);
                p = q;
            }
        }
        true
    }

    /// Offset in the image of `[gpa, gpa + len)`, if that lies in one
    /// region of guest RAM.
    fn offset(&self, gpa: u64, len: usize) -> Option<usize> {
        self.regions
            .iter()
            .find(|&&(g, size, _)| gpa >= g && gpa + len as u64 <= g + size)
            .map(|&(g, _, o)| o + (gpa - g) as usize)
    }

    /// The shadow copy of page `gpa`.
    pub fn page(&self, gpa: u64) -> Option<&[u8]> {
        self.slice(gpa, PAGE)
    }

    /// The shadow's copy of `[gpa, gpa + len)`, if that lies in one region
    /// of guest RAM.
    pub fn slice(&self, gpa: u64, len: usize) -> Option<&[u8]> {
        self.offset(gpa, len).map(|at| &self.image[at..at + len])
    }

    /// Overwrites the shadow copy of page `gpa`.
    pub fn set_page(&mut self, gpa: u64, data: &[u8]) -> Result<(), CheckpointError> {
        let o = self
            .offset(gpa, PAGE)
            .ok_or(CheckpointError::GuestMemory { gpa, why: "not guest RAM".into() })?;
        self.image[o..o + PAGE].copy_from_slice(&data[..PAGE]);
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
                    out.push((a, b, o + (a - g) as usize));
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
        pool: Option<&mut PagePool>,
        undo: &mut PageSet,
        changed: &mut Vec<u64>,
    ) -> Result<ScanStats, CheckpointError> {
        let keep = if pool.is_some() { Keep::Undo } else { Keep::List };
        self.scan_keeping(view, ranges, threads, keep, pool, undo, changed)
    }

    /// Visits the pages of `ranges` on `threads` threads, lists in `changed`
    /// each page whose content in `view` differs from the shadow and
    /// updates its shadow copy, keeping no old copy: the shadow then equals
    /// `view` over `ranges`. Replication's fault-free capture: the shadow is
    /// what the backup has, and `changed` what it must be sent.
    pub fn sync(
        &mut self,
        view: &GuestMemory,
        ranges: &[(u64, u64)],
        threads: usize,
        changed: &mut Vec<u64>,
    ) -> Result<ScanStats, CheckpointError> {
        let mut none = PageSet::default();
        self.scan_keeping(view, ranges, threads, Keep::Sync, None, &mut none, changed)
    }

    #[allow(clippy::too_many_arguments)]
    fn scan_keeping(
        &mut self,
        view: &GuestMemory,
        ranges: &[(u64, u64)],
        threads: usize,
        keep: Keep,
        mut pool: Option<&mut PagePool>,
        undo: &mut PageSet,
        changed: &mut Vec<u64>,
    ) -> Result<ScanStats, CheckpointError> {
        let work = self.clip(ranges);
        let total: u64 = work.iter().map(|(s, e, _)| (e - s) / PAGE as u64).sum();
        let threads = threads.clamp(1, 16).min(total.max(1) as usize);
        // Cut the work into `threads` groups of about equal pages; each group
        // gets the part of the image its ranges lie in (ranges are sorted by
        // image offset and do not overlap).
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
                o += (end - s) as usize;
                s = end;
            }
        }
        // Split the image at each group's first offset.
        let mut parts = Vec::new();
        let mut rest: &mut [u8] = &mut self.image;
        let mut base = 0usize;
        for (i, g) in groups.iter().enumerate() {
            let end = groups.get(i + 1).and_then(|n| n.first()).map_or(base + rest.len(), |r| r.2);
            let (mine, tail) = rest.split_at_mut(end - base);
            parts.push((g.as_slice(), base, mine));
            rest = tail;
            base = end;
        }
        // One pool for all threads, taken in batches: the changes may all
        // lie in one thread's part (a hot set), which must not run out of
        // buffers while the others' sit unused.
        let shared = std::sync::Mutex::new(
            pool.as_deref_mut().map_or_else(Vec::new, |p| p.take_many(p.len())),
        );
        let measured = &|(g, base, img): Part<'_>| {
            let (cpu0, faults0) = (nl_vmm::progress::own_cpu_ns(), own_faults());
            let mut r = scan_part(view, g, base, img, keep, &shared)?;
            r.cpu_ns = cpu0.zip(nl_vmm::progress::own_cpu_ns()).map(|(a, b)| b.saturating_sub(a));
            r.faults = own_faults().saturating_sub(faults0);
            Ok(r)
        };
        // The first part runs on this thread, which is already on a core: on
        // a busy host a new thread can wait milliseconds for one (profiled:
        // up to 8 ms, in the pause).
        let mut parts = parts.into_iter();
        let first = parts.next();
        let results: Vec<Result<PartResult, CheckpointError>> = std::thread::scope(|sc| {
            let handles: Vec<_> = parts.map(|part| sc.spawn(move || measured(part))).collect();
            let mut out: Vec<Result<PartResult, CheckpointError>> =
                first.into_iter().map(measured).collect();
            out.extend(handles.into_iter().map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(CheckpointError::Config("a scan thread panicked".into()))
                })
            }));
            out
        });
        if let Some(p) = pool.as_deref_mut() {
            p.give_all(shared.into_inner().unwrap_or_else(|e| e.into_inner()));
        }
        let mut stats = ScanStats { cpu_us: Some(0.0), ..ScanStats::default() };
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
            stats.fresh += r.fresh;
            stats.faults += r.faults;
            stats.cpu_us = stats.cpu_us.zip(r.cpu_ns).map(|(a, b)| a + b as f64 / 1e3);
            stats.changed += r.found.len() + r.diff.len();
            for (gpa, old) in r.found {
                if let Some(dup) = undo.insert_page(gpa, old) {
                    if let Some(p) = pool.as_deref_mut() {
                        p.give(dup);
                    }
                }
            }
            if let Some(p) = pool.as_deref_mut() {
                p.give_all(r.spare);
            }
            changed.extend(r.diff);
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

/// What a scan does with a page whose content differs from the shadow.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Keep {
    /// List it; the shadow stays as it was.
    List,
    /// Save the shadow's copy as the page's undo copy, then update it.
    Undo,
    /// List it and update the shadow, saving nothing.
    Sync,
}

/// One scan thread's work: its ranges (with their image offsets), the
/// image offset its part starts at, and that part of the image.
type Part<'a> = (&'a [(u64, u64, usize)], usize, &'a mut [u8]);

/// What one scan thread found.
struct PartResult {
    visited: usize,
    /// Updating: (gpa, old shadow copy) of each changed page.
    found: Vec<(u64, Page)>,
    /// Not updating: the changed pages.
    diff: Vec<u64>,
    /// Buffers taken from the shared pool and not used.
    spare: Vec<Page>,
    /// Buffers allocated because those handed in ran out.
    fresh: usize,
    /// The thread's CPU time and page faults during the scan.
    cpu_ns: Option<u64>,
    faults: u64,
}

/// Minor page faults of the calling thread so far (field 10 of
/// `/proc/thread-self/stat`; 0 where it cannot be read).
fn own_faults() -> u64 {
    let s = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
    // The command name (field 2) may hold spaces: count after its ')'.
    let after = s.rsplit_once(')').map_or("", |(_, a)| a);
    after.split_whitespace().nth(7).and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// Buffers a scan thread takes from the shared pool at a time.
const POOL_BATCH: usize = 64;

/// One scan thread: its ranges, the image offset its part starts at, that
/// part, and the shared pool of buffers for old copies (more are allocated
/// when it runs out).
fn scan_part(
    view: &GuestMemory,
    ranges: &[(u64, u64, usize)],
    base: usize,
    img: &mut [u8],
    keep: Keep,
    shared: &std::sync::Mutex<Vec<Page>>,
) -> Result<PartResult, CheckpointError> {
    let mut spare: Vec<Page> = Vec::new();
    let mut buf = vec![0u8; CHUNK_PAGES as usize * PAGE];
    let (mut visited, mut found, mut diff) = (0usize, Vec::new(), Vec::new());
    let mut fresh = 0usize;
    for &(s, e, o) in ranges {
        let mut gpa = s;
        while gpa < e {
            let n = ((e - gpa) / PAGE as u64).min(CHUNK_PAGES) as usize;
            let chunk = &mut buf[..n * PAGE];
            view.mem()
                .read_slice(chunk, GuestAddress(gpa))
                .map_err(|e| CheckpointError::GuestMemory { gpa, why: e.to_string() })?;
            let at = o + (gpa - s) as usize - base;
            for (i, now) in chunk.chunks_exact(PAGE).enumerate() {
                let shadow = &mut img[at + i * PAGE..at + (i + 1) * PAGE];
                if shadow != now {
                    let page = gpa + (i * PAGE) as u64;
                    if keep == Keep::Sync {
                        shadow.copy_from_slice(now);
                        diff.push(page);
                    } else if keep == Keep::Undo {
                        let old = if shadow.iter().all(|&b| b == 0) {
                            Page::Zero
                        } else {
                            if spare.is_empty() {
                                let mut all = shared.lock().unwrap_or_else(|e| e.into_inner());
                                let at = all.len().saturating_sub(POOL_BATCH);
                                spare = all.split_off(at);
                            }
                            let mut old = spare.pop().unwrap_or_else(|| {
                                fresh += 1;
                                Page::heap()
                            });
                            old.copy_from_slice(shadow);
                            old
                        };
                        shadow.copy_from_slice(now);
                        found.push((page, old));
                    } else {
                        diff.push(page);
                    }
                }
            }
            visited += n;
            gpa += (n * PAGE) as u64;
        }
    }
    Ok(PartResult { visited, found, diff, spare, fresh, cpu_ns: None, faults: 0 })
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

    fn last_gpa(view: &GuestMemory) -> u64 {
        view.regions().last().map(|r| r.gpa + r.size - PAGE as u64).unwrap()
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

    /// A scan takes its undo buffers from the pool, whichever thread's part
    /// the changes lie in, and allocates none while it lasts; pages that
    /// were zero need no buffer. With an empty pool each changed page that
    /// held data costs a fresh buffer (counted).
    #[test]
    fn a_scan_takes_undo_buffers_from_the_pool_and_none_for_zero_pages() {
        let view = mem(40);
        let base = view.regions()[0].gpa;
        let page = |p: u64| base + p * PAGE as u64;
        // 300 pages with data at the first checkpoint, all in the first
        // thread's part.
        for p in 0..300 {
            write(&view, page(p), 1);
        }
        let mut shadow = Shadow::capture(&view).unwrap();
        let all: Vec<(u64, u64)> = view.regions().iter().map(|r| (r.gpa, r.gpa + r.size)).collect();
        // Interval 1: those change and 200 zero pages get data.
        for p in 0..500 {
            write(&view, page(p) + 8, 2);
        }
        let mut pool = PagePool::default();
        pool.give_all((0..300).map(|_| Page::heap()));
        let (mut undo, mut changed) = (PageSet::new(), Vec::new());
        let st = shadow.scan(&view, &all, 2, Some(&mut pool), &mut undo, &mut changed).unwrap();
        assert_eq!((st.changed, st.fresh), (500, 0), "the pool covers the 300 copies with data");
        assert!(pool.is_empty());
        for p in 0..500 {
            let old = undo.get(page(p)).unwrap();
            assert_eq!((old[0], old[8]), (u8::from(p < 300), 0), "page {p}");
        }
        // Interval 2 with an empty pool: every copy (now all data) is fresh.
        for p in 0..500 {
            write(&view, page(p) + 8, 3);
        }
        let mut undo2 = PageSet::new();
        let st = shadow.scan(&view, &all, 2, Some(&mut pool), &mut undo2, &mut changed).unwrap();
        assert_eq!((st.changed, st.fresh), (500, 500));
        assert_eq!(undo2.get(page(499)).unwrap()[8], 2);
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

    /// Replication's sync lists every changed page on any thread count,
    /// keeps no undo copy, and leaves the shadow equal to memory: the next
    /// sync finds only what changed since.
    #[test]
    fn a_sync_lists_changed_pages_and_leaves_the_shadow_equal_to_memory() {
        let view = mem(40);
        let all: Vec<(u64, u64)> = vec![(0, u64::MAX / 2)];
        let base = view.regions()[0].gpa;
        for threads in [1, 2, 5] {
            let mut shadow = Shadow::capture(&view).unwrap();
            let want: Vec<u64> =
                [3u64, 16, 17, 900].iter().map(|k| base + k * PAGE as u64).collect();
            for (i, &g) in want.iter().enumerate() {
                write(&view, g + 9, 0x40 + i as u8 + threads as u8);
            }
            let mut changed = Vec::new();
            shadow.sync(&view, &all, threads, &mut changed).unwrap();
            changed.sort_unstable();
            assert_eq!(changed, want, "{threads} threads");
            for &g in &want {
                let mut now = vec![0u8; PAGE];
                view.mem().read_slice(&mut now, GuestAddress(g)).unwrap();
                assert_eq!(shadow.page(g).unwrap(), &now[..]);
            }
            let run = shadow.slice(want[1], 2 * PAGE).unwrap();
            assert_eq!(&run[..PAGE], shadow.page(want[1]).unwrap());
            assert_eq!(&run[PAGE..], shadow.page(want[2]).unwrap());
            assert!(shadow.slice(last_gpa(&view), 2 * PAGE).is_none(), "past the end of RAM");
            let mut again = Vec::new();
            shadow.sync(&view, &all, threads, &mut again).unwrap();
            assert!(again.is_empty(), "{again:?}");
            write(&view, want[1] + 9, 0);
            shadow.sync(&view, &all, threads, &mut again).unwrap();
            assert_eq!(again, vec![want[1]]);
        }
    }
}

/// Backing the image between checkpoints.
#[cfg(test)]
mod prefault_tests {
    use super::*;
    use crate::slab::thread_minor_faults;
    use std::time::{Duration, Instant};

    /// A prefault of the allocated ranges with time to finish backs those
    /// pages: the guest-side writes that follow (here, this thread writing
    /// each page's first byte) take no page faults; with no time left
    /// nothing happens; the content is kept.
    #[test]
    fn prefault_backs_the_allocated_pages_and_keeps_their_content() {
        let view = GuestMemory::new("prefault-test", 128 << 20).unwrap();
        let mut shadow = Shadow::capture(&view).unwrap();
        let base = view.regions()[0].gpa;
        let ranges = vec![(base, base + (48 << 20))];
        assert!(!shadow.prefault(&ranges, Instant::now()), "no time: not done");
        assert!(shadow.prefault(&ranges, Instant::now() + Duration::from_secs(120)));
        let want = (48 << 20) / PAGE;
        let before = thread_minor_faults();
        for p in 0..want {
            let v = shadow.image[p * PAGE];
            shadow.image[p * PAGE] = std::hint::black_box(v);
        }
        let faults = thread_minor_faults() - before;
        assert!(
            faults < (want / 16) as i64,
            "{faults} faults writing {want} prefaulted pages: they were not backed"
        );
        assert!(shadow.image.iter().all(|&b| b == 0));
    }
}
