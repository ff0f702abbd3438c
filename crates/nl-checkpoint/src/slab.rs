//! Page buffers carved out of anonymous mappings that are backed in bulk.
//!
//! On a host whose own page faults are slow (a PVM host is itself a guest
//! under shadow paging: 3 to 12 µs per first touch of a 4 KiB page), the
//! undo copies of a checkpoint must land in memory that is already backed.
//! [`carve`] maps a chunk, backs all of it with one
//! `madvise(MADV_POPULATE_WRITE)` per step (falling back to a write per
//! page on kernels without it), and hands out its pages one by one. Each
//! [`SlabPage`] owns one 4 KiB page of its chunk and keeps the chunk mapped;
//! the chunk is unmapped when its last page is dropped.
//!
//! This is the crate's only `unsafe` outside test code: a page is a raw
//! pointer into its chunk, unique to it.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::PAGE;

/// One mapping; unmapped on drop.
struct Chunk {
    addr: NonNull<u8>,
    len: usize,
    /// Bytes mapped by the chunks of one owner (decreased on drop).
    live: Arc<AtomicUsize>,
}

// SAFETY: a chunk is a plain anonymous mapping that is never read or
// written through the chunk itself; it is only unmapped by its drop, which
// runs once, when no page of it is left.
unsafe impl Send for Chunk {}
// SAFETY: as above.
unsafe impl Sync for Chunk {}

impl Drop for Chunk {
    fn drop(&mut self) {
        // SAFETY: [addr, addr + len) is the mapping made by `carve`, and no
        // page of it is left (each holds an Arc of the chunk).
        unsafe { libc::munmap(self.addr.as_ptr().cast(), self.len) };
        self.live.fetch_sub(self.len, Ordering::Relaxed);
    }
}

/// One 4 KiB page of a chunk, owned exclusively.
pub struct SlabPage {
    ptr: NonNull<[u8; PAGE]>,
    _chunk: Arc<Chunk>,
}

// SAFETY: the page's memory is reached only through this value (each page
// of a chunk is handed out once, by `carve`), so moving it to another thread
// moves the only access; `&SlabPage` gives read-only access.
unsafe impl Send for SlabPage {}
// SAFETY: as above.
unsafe impl Sync for SlabPage {}

impl std::ops::Deref for SlabPage {
    type Target = [u8; PAGE];
    fn deref(&self) -> &[u8; PAGE] {
        // SAFETY: `ptr` points at a mapped page (zero-filled by the kernel,
        // so initialized) that lives as long as `_chunk`, and only this
        // value reaches it.
        unsafe { self.ptr.as_ref() }
    }
}

impl std::ops::DerefMut for SlabPage {
    fn deref_mut(&mut self) -> &mut [u8; PAGE] {
        // SAFETY: as in `deref`; `&mut self` makes the access exclusive.
        unsafe { self.ptr.as_mut() }
    }
}

/// Pages backed per `madvise` call: the step at which [`carve`] checks
/// `stop` (64 pages: about 0.2 to 0.8 ms on the PVM host).
pub const STEP_PAGES: usize = 64;

/// Maps `pages` pages (rounded up to [`STEP_PAGES`]), backs them with host
/// memory, and returns them; `live` grows by the bytes mapped until the
/// chunk is unmapped. Between steps it calls `wait`, which may block (the
/// background backer waits there while a checkpoint's pause runs).
/// `None` when the mapping fails.
pub fn carve(
    pages: usize,
    live: &Arc<AtomicUsize>,
    mut wait: impl FnMut(),
) -> Option<Vec<SlabPage>> {
    let pages = pages.max(1).div_ceil(STEP_PAGES) * STEP_PAGES;
    let len = pages * PAGE;
    // SAFETY: a new private anonymous mapping; no existing memory is touched.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return None;
    }
    let addr = NonNull::new(raw.cast::<u8>())?;
    live.fetch_add(len, Ordering::Relaxed);
    let chunk = Arc::new(Chunk { addr, len, live: live.clone() });
    for step in 0..pages / STEP_PAGES {
        wait();
        let at = step * STEP_PAGES * PAGE;
        // SAFETY: [at, at + STEP_PAGES pages) lies inside the mapping made
        // above, which no page value reaches yet; populating writable only
        // backs it (the content stays zero).
        let r = unsafe {
            libc::madvise(
                addr.as_ptr().add(at).cast(),
                STEP_PAGES * PAGE,
                libc::MADV_POPULATE_WRITE,
            )
        };
        if r != 0 {
            // An older kernel: back each page by writing it (a read would
            // map the shared zero page).
            for p in 0..STEP_PAGES {
                // SAFETY: inside the mapping, which is readable and writable
                // and not yet reached by any page value.
                unsafe { std::ptr::write_volatile(addr.as_ptr().add(at + p * PAGE), 0) };
            }
        }
    }
    Some(
        (0..pages)
            .map(|p| SlabPage {
                // SAFETY: page `p` of the mapping: non-null, page aligned,
                // handed out once.
                ptr: unsafe { NonNull::new_unchecked(addr.as_ptr().add(p * PAGE).cast()) },
                _chunk: chunk.clone(),
            })
            .collect(),
    )
}

/// Backs the whole pages inside `bytes` with host memory in one call,
/// keeping their content; false if the kernel cannot (nothing is promised
/// then: the caller touches the pages itself).
pub fn populate(bytes: &mut [u8]) -> bool {
    let start = bytes.as_mut_ptr() as usize;
    let first = start.next_multiple_of(PAGE);
    let end = (start + bytes.len()) / PAGE * PAGE;
    if end <= first {
        return true;
    }
    // SAFETY: [first, end) lies inside `bytes`, which this call borrows
    // exclusively; MADV_POPULATE_WRITE only faults the pages in, writable,
    // and keeps their content, so no value Rust can see changes.
    unsafe {
        libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_POPULATE_WRITE) == 0
    }
}

/// Minor page faults of the calling thread so far (getrusage
/// RUSAGE_THREAD, so other threads do not count); for the tests of the
/// pool and of the shadow image's backing.
#[cfg(test)]
pub(crate) fn thread_minor_faults() -> i64 {
    // SAFETY: an all-zero `rusage` is a valid value of this plain C struct.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage fills the one `rusage` it is given, which lives
    // across the call.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) }, 0);
    u.ru_minflt
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_distinct_zeroed_writable_and_keep_their_chunk_mapped() {
        let live = Arc::new(AtomicUsize::new(0));
        let mut pages = carve(100, &live, || {}).unwrap();
        assert_eq!(pages.len(), 128, "rounded up to whole steps");
        assert_eq!(live.load(Ordering::Relaxed), 128 * PAGE);
        assert!(pages.iter().all(|p| p.iter().all(|&b| b == 0)));
        for (i, p) in pages.iter_mut().enumerate() {
            p.fill(i as u8);
        }
        // Each page kept its own content: no two share memory.
        for (i, p) in pages.iter().enumerate() {
            assert!(p.iter().all(|&b| b == i as u8), "page {i}");
        }
        // One page alone keeps its chunk mapped.
        let last = pages.pop().unwrap();
        drop(pages);
        assert_eq!(live.load(Ordering::Relaxed), 128 * PAGE);
        assert!(last.iter().all(|&b| b == 127));
        drop(last);
        assert_eq!(live.load(Ordering::Relaxed), 0, "unmapped with its last page");
    }
}
