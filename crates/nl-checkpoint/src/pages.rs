//! The pre-write copies of guest pages saved during one checkpoint interval.

use std::collections::HashMap;

use crate::PAGE;

/// One saved page.
pub type Page = Box<[u8; PAGE]>;

/// Page buffers to reuse. On a host whose own page faults are slow (a PVM
/// host is itself a guest under shadow paging), a freshly allocated buffer
/// costs a fault and a page clear per page saved, several times the copy:
/// buffers of dropped checkpoints are kept here and filled again.
#[derive(Default)]
pub struct PagePool {
    free: Vec<Page>,
}

impl PagePool {
    /// A buffer (content unspecified).
    pub fn take(&mut self) -> Page {
        self.free.pop().unwrap_or_else(|| Box::new([0u8; PAGE]))
    }

    /// Up to `n` buffers for a worker thread.
    pub fn take_many(&mut self, n: usize) -> Vec<Page> {
        let at = self.free.len().saturating_sub(n);
        self.free.split_off(at)
    }

    pub fn give(&mut self, page: Page) {
        self.free.push(page);
    }

    pub fn give_all(&mut self, pages: impl IntoIterator<Item = Page>) {
        self.free.extend(pages);
    }

    /// Allocates buffers (each touched, so it is backed by host memory)
    /// until the pool holds `target` or `deadline` passes. Run between
    /// checkpoints, while the guest runs, so that the next checkpoint's
    /// copies land in memory that is already backed: on this host a first
    /// touch costs a page fault of 3 to 6 µs, several times the copy.
    pub fn fill_to(&mut self, target: usize, deadline: std::time::Instant) {
        const STEP: usize = 64;
        while self.free.len() < target && std::time::Instant::now() < deadline {
            let n = (target - self.free.len()).min(STEP);
            self.free.extend((0..n).map(|_| Box::new([0u8; PAGE])));
        }
    }

    /// Frees buffers beyond `keep`.
    pub fn trim(&mut self, keep: usize) {
        self.free.truncate(keep);
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
        let mut b = Box::new([0u8; PAGE]);
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
        assert_eq!(p.len(), 300);
        // Already full: nothing more.
        p.fill_to(100, Instant::now() + Duration::from_secs(60));
        assert_eq!(p.len(), 300);
        p.trim(120);
        assert_eq!(p.len(), 120);
    }

    #[test]
    fn fill_stops_at_its_deadline() {
        let mut p = PagePool::default();
        p.fill_to(1 << 30, Instant::now());
        assert!(p.is_empty());
    }
}
