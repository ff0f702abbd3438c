//! Page buffers carved out of large anonymous mappings.
//!
//! On a host whose own page faults are slow (a PVM host is itself a guest
//! under shadow paging: about 12 µs per first touch of a 4 KiB page), the
//! undo copies of a checkpoint must land in memory that is already backed.
//! A chunk is one anonymous mapping of whole 2 MiB blocks, touched when it
//! is made (between checkpoints), so a page taken from it never faults.
//! Each [`SlabPage`] owns one 4 KiB page of a chunk and keeps the chunk
//! mapped; the chunk is unmapped when its last page is dropped. (Huge pages
//! were tried for the chunks: on this host a 2 MiB fault cost 0.7 to 23 µs
//! per 4 KiB, 11 on average over 8 probes, against 3.4 to 8.2 µs for 4 KiB
//! faults: not used.)
//!
//! [`guest_bytes`] reads guest memory in place (the scan compares pages
//! without copying them into a bounce buffer first).
//!
//! This is the crate's only `unsafe` besides test code: a page is a raw
//! pointer into its chunk, unique to it.

use std::ptr::NonNull;
use std::sync::Arc;

use crate::PAGE;

/// Pages per 2 MiB block.
pub const BLOCK_PAGES: usize = 512;
const BLOCK: usize = BLOCK_PAGES * PAGE;

/// One mapping; unmapped on drop.
struct Chunk {
    addr: NonNull<u8>,
    len: usize,
}

// SAFETY: a chunk is a plain anonymous mapping; it is only unmapped by its
// drop, which runs once, when no page of it is left.
unsafe impl Send for Chunk {}
// SAFETY: as above; the chunk itself is never read or written through.
unsafe impl Sync for Chunk {}

impl Drop for Chunk {
    fn drop(&mut self) {
        // SAFETY: [addr, addr + len) is the mapping made by `carve`, and no
        // page of it is left (each holds an Arc of the chunk).
        unsafe { libc::munmap(self.addr.as_ptr().cast(), self.len) };
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
        // SAFETY: `ptr` points at a mapped, initialized (touched) page that
        // lives as long as `_chunk`, and only this value reaches it.
        unsafe { self.ptr.as_ref() }
    }
}

impl std::ops::DerefMut for SlabPage {
    fn deref_mut(&mut self) -> &mut [u8; PAGE] {
        // SAFETY: as in `deref`; `&mut self` makes the access exclusive.
        unsafe { self.ptr.as_mut() }
    }
}

/// Maps `blocks` 2 MiB blocks, backs every page by writing to it, and
/// returns the pages. `None` when the mapping fails (the caller falls back
/// to the allocator).
pub fn carve(blocks: usize) -> Option<Vec<SlabPage>> {
    let blocks = blocks.max(1);
    let len = blocks * BLOCK;
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
    let start = raw as usize;
    let addr = NonNull::new(start as *mut u8)?;
    // Back every page now (a write: a read would map the zero page).
    for p in 0..blocks * BLOCK_PAGES {
        // SAFETY: inside the mapping, which is readable and writable.
        unsafe { std::ptr::write_volatile(addr.as_ptr().add(p * PAGE), 0) };
    }
    let chunk = Arc::new(Chunk { addr, len });
    Some(
        (0..blocks * BLOCK_PAGES)
            .map(|p| SlabPage {
                // SAFETY: page `p` of the mapping, non-null, page aligned.
                ptr: unsafe { NonNull::new_unchecked(addr.as_ptr().add(p * PAGE).cast()) },
                _chunk: chunk.clone(),
            })
            .collect(),
    )
}

/// `len` bytes of guest memory at `gpa`, in place, for reading while the
/// vCPUs are stopped (the checkpoint scan).
pub fn guest_bytes(
    view: &nl_memory::GuestMemory,
    gpa: u64,
    len: usize,
) -> Result<&[u8], vm_memory::GuestMemoryError> {
    use vm_memory::{GuestAddress, GuestMemoryBackend};
    let slice = view.mem().get_slice(GuestAddress(gpa), len)?;
    let ptr = slice.ptr_guard().as_ptr();
    // SAFETY: `get_slice` checked that [gpa, gpa + len) lies in one mapped
    // region of `view`, which stays mapped while `view` is borrowed. Guest
    // memory is shared with the guest and the VMM's device threads, so its
    // bytes may change under a reader: the scan reads only while the vCPUs
    // are stopped, and a device write during the scan races exactly as it
    // does with vm-memory's own `read_slice` (a `memcpy` from the same
    // mapping), which the scan used before. Bytes have no invalid values.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_distinct_writable_and_outlive_the_carve() {
        let mut pages = carve(1).unwrap();
        assert_eq!(pages.len(), BLOCK_PAGES);
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
        assert!(last.iter().all(|&b| b == (BLOCK_PAGES - 1) as u8));
    }
}
