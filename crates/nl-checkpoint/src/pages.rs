//! The pre-write copies of guest pages saved during one checkpoint interval.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::slab::{self, SlabPage};
use crate::PAGE;

/// One saved page: a buffer of the allocator's, or a page of a chunk the
/// [`Backer`] backed in bulk ahead of need.
pub enum Page {
    Heap(Box<[u8; PAGE]>),
    Slab(SlabPage),
    /// A page of zeros, held without a buffer (the undo copy of a page the
    /// guest had never written: the interval in which a guest first fills
    /// its working set needs no buffers for them).
    Zero,
}

static ZERO: [u8; PAGE] = [0; PAGE];

impl Page {
    /// A fresh zeroed buffer from the allocator (its first touch faults).
    pub fn heap() -> Self {
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
    /// A [`Page::Zero`] becomes a buffer of its own first.
    fn deref_mut(&mut self) -> &mut [u8; PAGE] {
        if matches!(self, Page::Zero) {
            *self = Page::heap();
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
/// costs a fault and a page clear per page saved, several times the copy:
/// buffers of dropped checkpoints are kept here and filled again.
#[derive(Default)]
pub struct PagePool {
    free: Vec<Page>,
}

impl PagePool {
    /// A buffer (content unspecified).
    pub fn take(&mut self) -> Page {
        self.free.pop().unwrap_or_else(Page::heap)
    }

    /// Up to `n` buffers for a worker thread.
    pub fn take_many(&mut self, n: usize) -> Vec<Page> {
        let at = self.free.len().saturating_sub(n);
        self.free.split_off(at)
    }

    /// Keeps `page`'s buffer for reuse (a [`Page::Zero`] has none).
    pub fn give(&mut self, page: Page) {
        if !matches!(page, Page::Zero) {
            self.free.push(page);
        }
    }

    pub fn give_all(&mut self, pages: impl IntoIterator<Item = Page>) {
        self.free.extend(pages.into_iter().filter(|p| !matches!(p, Page::Zero)));
    }

    /// Allocates buffers (each touched, so it is backed by host memory)
    /// until the pool holds `target` or `deadline` passes. Run between
    /// checkpoints, while the guest runs, so that the next checkpoint's
    /// copies land in memory that is already backed: on this host a first
    /// touch costs a page fault of 3 to 6 µs, several times the copy. (The
    /// shadow engines use a [`Backer`] instead, when it could be started.)
    pub fn fill_to(&mut self, target: usize, deadline: std::time::Instant) {
        const STEP: usize = 64;
        while self.free.len() < target && std::time::Instant::now() < deadline {
            let n = (target - self.free.len()).min(STEP);
            self.free.extend((0..n).map(|_| Page::heap()));
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

/// Pages the backer maps and backs per chunk (2 MiB).
const CHUNK_PAGES: usize = 512;

/// A background thread that backs page buffers in bulk while the guest
/// runs, so that a checkpoint's pause finds them ready instead of taking a
/// first-touch page fault per undo copy (3 to 12 µs each on a PVM host,
/// several times the copy itself).
///
/// It keeps up to [`Backer::set_want`] pages ready (a chunk more at most),
/// is one thread (never more than one core), and stops between steps of
/// [`slab::STEP_PAGES`] pages while a [`Backer::hold`] is held: the
/// checkpoint's scan has the host's cores to itself.
pub struct Backer {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

struct Shared {
    state: Mutex<State>,
    cv: Condvar,
    ready: Mutex<Vec<SlabPage>>,
    /// Bytes mapped by the chunks backed so far and not yet unmapped.
    live: Arc<AtomicUsize>,
    /// The most `live` has been.
    live_max: AtomicUsize,
    /// Pages backed in total.
    backed: AtomicU64,
}

#[derive(Default)]
struct State {
    want: usize,
    holds: usize,
    stop: bool,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn ready(&self) -> std::sync::MutexGuard<'_, Vec<SlabPage>> {
        self.ready.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Blocks while a hold is held (not once stopping).
    fn wait_unheld(&self) {
        let mut s = self.lock();
        while s.holds > 0 && !s.stop {
            s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn run(&self) {
        loop {
            let missing = {
                let mut s = self.lock();
                loop {
                    if s.stop {
                        return;
                    }
                    let have = self.ready().len();
                    if s.holds == 0 && have < s.want {
                        break s.want - have;
                    }
                    // Woken by set_want, a released hold or stop; the
                    // timeout only guards against a missed wake-up.
                    s = self
                        .cv
                        .wait_timeout(s, Duration::from_millis(100))
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            };
            match slab::carve(missing.min(CHUNK_PAGES), &self.live, || self.wait_unheld()) {
                Some(pages) => {
                    self.backed.fetch_add(pages.len() as u64, Ordering::Relaxed);
                    self.live_max.fetch_max(self.live.load(Ordering::Relaxed), Ordering::Relaxed);
                    self.ready().extend(pages);
                }
                // Out of address space or memory: try again later.
                None => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }
}

/// While held, the backer backs nothing (see [`Backer::hold`]).
pub struct Hold(Arc<Shared>);

impl Drop for Hold {
    fn drop(&mut self) {
        self.0.lock().holds -= 1;
        self.0.cv.notify_all();
    }
}

impl Backer {
    /// Starts the thread (`ckpt-backer`, under the checkpoint seccomp
    /// filter), with nothing wanted yet.
    pub fn start() -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
            ready: Mutex::new(Vec::new()),
            live: Arc::new(AtomicUsize::new(0)),
            live_max: AtomicUsize::new(0),
            backed: AtomicU64::new(0),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new().name("ckpt-backer".into()).spawn(move || {
            nl_vmm::seccomp::apply(nl_vmm::seccomp::Kind::Checkpoint);
            s.run();
        })?;
        Ok(Self { shared, thread: Some(thread) })
    }

    /// Keep `pages` pages ready (beyond those already taken).
    pub fn set_want(&self, pages: usize) {
        self.shared.lock().want = pages;
        self.shared.cv.notify_all();
    }

    /// Stops the backing until the returned value is dropped (within one
    /// step of [`slab::STEP_PAGES`] pages).
    pub fn hold(&self) -> Hold {
        self.shared.lock().holds += 1;
        Hold(self.shared.clone())
    }

    /// Takes every page backed so far.
    pub fn take_ready(&self) -> Vec<Page> {
        std::mem::take(&mut *self.shared.ready()).into_iter().map(Page::Slab).collect()
    }

    /// Pages ready to be taken.
    pub fn ready_len(&self) -> usize {
        self.shared.ready().len()
    }

    /// Pages backed in total, and the most bytes its chunks had mapped at
    /// once (the pages in the ring and the pool, and the chunks they keep).
    pub fn backed_pages(&self) -> u64 {
        self.shared.backed.load(Ordering::Relaxed)
    }

    pub fn mapped_bytes_max(&self) -> usize {
        self.shared.live_max.load(Ordering::Relaxed)
    }
}

impl Drop for Backer {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
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
        let mut b = Page::heap();
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

/// The background backer.
#[cfg(test)]
mod backer_tests {
    use super::*;
    use crate::slab::thread_minor_faults;
    use std::time::{Duration, Instant};

    /// Waits (without a time assertion: at most a minute, for a loaded
    /// host) until the backer has `n` pages ready.
    fn wait_ready(b: &Backer, n: usize) -> usize {
        let t = Instant::now();
        while b.ready_len() < n && t.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(2));
        }
        b.ready_len()
    }

    /// The backer backs what is wanted (and at most a chunk more), in
    /// pages that are backed already: writing them takes no page faults
    /// here. Its memory is counted and given back when the pages go.
    #[test]
    fn the_backer_backs_what_is_wanted_ahead_of_use() {
        let b = Backer::start().unwrap();
        b.set_want(3000);
        let got = wait_ready(&b, 3000);
        assert!((3000..3000 + CHUNK_PAGES).contains(&got), "{got} pages ready for 3000 wanted");
        let mut pages = b.take_ready();
        assert_eq!(pages.len(), got);
        assert!(b.mapped_bytes_max() >= got * PAGE);
        assert_eq!(b.backed_pages(), got as u64);
        let before = thread_minor_faults();
        for (i, p) in pages.iter_mut().enumerate() {
            assert!(matches!(p, Page::Slab(_)));
            p[0] = i as u8;
            p[PAGE - 1] = 1;
        }
        let faults = thread_minor_faults() - before;
        assert!(faults < (got / 16) as i64, "{faults} faults writing {got} backed pages");
        // Taken pages are not backed again.
        b.set_want(0);
        assert_eq!(b.ready_len(), 0);
        drop(pages);
        assert_eq!(b.shared.live.load(Ordering::Relaxed), 0, "unmapped with the pages");
    }

    /// While a hold is held nothing new becomes ready (a chunk being
    /// backed when the hold came may finish, no more); released, the
    /// backer goes on.
    #[test]
    fn a_hold_stops_the_backer_until_it_is_released() {
        let b = Backer::start().unwrap();
        let hold = b.hold();
        b.set_want(4 * CHUNK_PAGES);
        // The backer sees the hold before it starts: nothing at all.
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(b.ready_len(), 0, "backed while held");
        drop(hold);
        assert!(wait_ready(&b, 2 * CHUNK_PAGES) >= 2 * CHUNK_PAGES);
        // Held while backing: at most the chunk under way finishes.
        b.set_want(64 * CHUNK_PAGES);
        let hold = b.hold();
        let at = b.ready_len();
        std::thread::sleep(Duration::from_millis(300));
        let later = b.ready_len();
        assert!(later <= at + CHUNK_PAGES, "{at} pages ready at the hold, {later} after");
        drop(hold);
        assert!(wait_ready(&b, later + CHUNK_PAGES) > later);
        b.set_want(0);
    }

    /// The pool keeps no zero pages (they have no buffer) and a zero page
    /// reads as zeros and becomes a buffer of its own when written.
    #[test]
    fn zero_pages_hold_no_buffer() {
        let mut p = PagePool::default();
        p.give(Page::Zero);
        p.give_all([Page::Zero, Page::heap()]);
        assert_eq!(p.len(), 1);
        let mut z = Page::Zero;
        assert!(z.iter().all(|&b| b == 0));
        z[7] = 1;
        assert!(matches!(z, Page::Heap(_)));
        assert_eq!(z[7], 1);
    }
}
