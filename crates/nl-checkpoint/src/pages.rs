//! The pre-write copies of guest pages saved during one checkpoint interval.

use std::collections::HashMap;

use crate::slab::SlabPage;
use crate::PAGE;

/// One saved page: from the allocator (the copy-on-write engines' fault
/// thread) or from a pre-backed slab (the shadow engines' pool), or a page
/// of zeros that holds no buffer (the shadow engines' undo copy of a page
/// the guest had not allocated).
pub enum Page {
    Heap(Box<[u8; PAGE]>),
    Slab(SlabPage),
    Zero,
}

static ZERO: [u8; PAGE] = [0; PAGE];

impl Page {
    /// A fresh zeroed page from the allocator (its first touch may fault).
    pub fn fresh() -> Self {
        Page::Heap(Box::new([0u8; PAGE]))
    }
}

impl std::ops::Deref for Page {
    type Target = [u8; PAGE];
    fn deref(&self) -> &[u8; PAGE] {
        match self {
            Page::Heap(b) => b,
            Page::Slab(s) => s,
            Page::Zero => &ZERO,
        }
    }
}

impl std::ops::DerefMut for Page {
    /// A [`Page::Zero`] written to becomes a buffer of its own first.
    fn deref_mut(&mut self) -> &mut [u8; PAGE] {
        if matches!(self, Page::Zero) {
            *self = Page::fresh();
        }
        match self {
            Page::Heap(b) => b,
            Page::Slab(s) => s,
            Page::Zero => unreachable!("replaced above"),
        }
    }
}

/// Page buffers to reuse. On a host whose own page faults are slow (a PVM
/// host is itself a guest under shadow paging), a freshly allocated buffer
/// costs a fault per page saved, many times the copy: buffers come from
/// slab chunks backed ahead of use ([`crate::slab`]), between checkpoints,
/// and those of dropped checkpoints are kept here and filled again.
#[derive(Default)]
pub struct PagePool {
    free: Vec<Page>,
    /// Pages backed by this pool so far (free or handed out).
    backed: usize,
    /// Buffers a scan had to allocate because the pool ran dry.
    fresh: u64,
}

impl PagePool {
    /// A buffer (content unspecified).
    pub fn take(&mut self) -> Page {
        self.free.pop().unwrap_or_else(|| {
            self.fresh += 1;
            Page::fresh()
        })
    }

    /// Up to `n` buffers for a worker thread.
    pub fn take_many(&mut self, n: usize) -> Vec<Page> {
        let at = self.free.len().saturating_sub(n);
        self.free.split_off(at)
    }

    /// Takes back a buffer ([`Page::Zero`] holds none and is dropped).
    pub fn give(&mut self, page: Page) {
        if !matches!(page, Page::Zero) {
            self.free.push(page);
        }
    }

    pub fn give_all(&mut self, pages: impl IntoIterator<Item = Page>) {
        self.free.extend(pages.into_iter().filter(|p| !matches!(p, Page::Zero)));
    }

    /// Counts buffers a scan allocated itself (the pool had too few).
    pub fn note_fresh(&mut self, n: usize) {
        self.fresh += n as u64;
    }

    /// Buffers allocated in scans so far, because the pool ran dry.
    pub fn fresh(&self) -> u64 {
        self.fresh
    }

    /// Pages the pool has backed itself (free now or in use).
    pub fn backed(&self) -> usize {
        self.backed
    }

    /// Backs buffers (2 MiB slab blocks, touched) until the pool holds
    /// `target` or `deadline` passes. Run between checkpoints, while the
    /// guest runs, so that the next checkpoint's copies land in memory that
    /// is already backed.
    pub fn fill_to(&mut self, target: usize, deadline: std::time::Instant) {
        while self.free.len() < target && std::time::Instant::now() < deadline {
            match crate::slab::carve(1) {
                Some(pages) => {
                    self.backed += pages.len();
                    self.free.extend(pages.into_iter().map(Page::Slab));
                }
                None => {
                    // No mapping to be had: the allocator, 64 at a time.
                    let n = (target - self.free.len()).min(64);
                    self.backed += n;
                    self.free.extend((0..n).map(|_| Page::fresh()));
                }
            }
        }
    }

    /// Frees buffers beyond `keep`.
    pub fn trim(&mut self, keep: usize) {
        if self.free.len() > keep {
            self.backed -= (self.free.len() - keep).min(self.backed);
            self.free.truncate(keep);
        }
    }

    /// Buffers held.
    pub fn len(&self) -> usize {
        self.free.len()
    }

    pub fn is_empty(&self) -> bool {
        self.free.is_empty()
    }
}

/// Saved page contents keyed by guest physical address (page aligned).
#[derive(Default)]
pub struct PageSet {
    pages: HashMap<u64, Page>,
}

impl PageSet {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn contains(&self, gpa: u64) -> bool {
        self.pages.contains_key(&gpa)
    }

    /// Saves `content` for `gpa` unless a copy is already there (the first
    /// copy is the pre-write one). Returns whether it was inserted.
    pub fn save_once(&mut self, gpa: u64, content: &[u8]) -> bool {
        if self.pages.contains_key(&gpa) {
            return false;
        }
        let mut b = Page::fresh();
        b.copy_from_slice(&content[..PAGE]);
        self.pages.insert(gpa, b);
        true
    }

    pub fn get(&self, gpa: u64) -> Option<&[u8; PAGE]> {
        self.pages.get(&gpa).map(|b| &**b)
    }

    pub fn remove(&mut self, gpa: u64) {
        self.pages.remove(&gpa);
    }

    pub fn len(&self) -> usize {
        self.pages.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, &[u8; PAGE])> {
        self.pages.iter().map(|(g, b)| (*g, &**b))
    }

    /// Inserts an already filled page for `gpa` unless a copy is there;
    /// gives `page` back if it was not inserted.
    pub fn insert_page(&mut self, gpa: u64, page: Page) -> Option<Page> {
        match self.pages.entry(gpa) {
            std::collections::hash_map::Entry::Occupied(_) => Some(page),
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(page);
                None
            }
        }
    }

    /// Takes every page out, leaving the set empty.
    pub fn drain(&mut self) -> impl Iterator<Item = (u64, Page)> + '_ {
        self.pages.drain()
    }

    pub fn gpas(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.pages.keys().copied().collect();
        v.sort_unstable();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_copy_wins() {
        let mut s = PageSet::new();
        assert!(s.save_once(0x1000, &[1u8; PAGE]));
        assert!(!s.save_once(0x1000, &[2u8; PAGE]));
        assert_eq!(s.iter().next().unwrap().1[0], 1);
        assert_eq!(s.len(), 1);
        s.remove(0x1000);
        assert!(s.is_empty());
    }
}

/// The pool's refill between checkpoints.
#[cfg(test)]
mod fill_tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn fill_reaches_its_target_and_trim_frees_the_rest() {
        let mut p = PagePool::default();
        p.fill_to(300, Instant::now() + Duration::from_secs(60));
        // Whole 2 MiB slab blocks: at least the target, at most a block more.
        assert!(p.len() >= 300 && p.len() < 300 + crate::slab::BLOCK_PAGES, "{}", p.len());
        assert_eq!(p.backed(), p.len());
        let n = p.len();
        // Already full: nothing more.
        p.fill_to(100, Instant::now() + Duration::from_secs(60));
        assert_eq!(p.len(), n);
        p.trim(120);
        assert_eq!(p.len(), 120);
    }

    /// Buffers come from the filled pool, and only an empty pool makes
    /// fresh ones (counted: each may fault inside a pause).
    #[test]
    fn a_filled_pool_hands_out_backed_buffers_and_counts_fresh_ones() {
        let mut p = PagePool::default();
        p.fill_to(10, Instant::now() + Duration::from_secs(60));
        let n = p.len();
        let taken: Vec<Page> = (0..n).map(|_| p.take()).collect();
        assert!(taken.iter().all(|pg| matches!(pg, Page::Slab(_))));
        assert_eq!(p.fresh(), 0);
        let extra = p.take();
        assert!(matches!(extra, Page::Heap(_)));
        assert_eq!(p.fresh(), 1);
        p.give_all(taken);
        p.give(extra);
        assert_eq!(p.len(), n + 1);
    }

    #[test]
    fn fill_stops_at_its_deadline() {
        let mut p = PagePool::default();
        p.fill_to(1 << 30, Instant::now());
        assert!(p.is_empty());
    }
}
