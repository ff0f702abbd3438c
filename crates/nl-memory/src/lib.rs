//! Guest memory of one VM.
//!
//! All RAM of a VM lives in one memfd, mapped `MAP_SHARED | MAP_NORESERVE`
//! into the VMM: pages are allocated only when first touched (a 1 GiB VM does
//! not cost 1 GiB at start), the same memory can be mapped by another process
//! from the fd (microreboot and warm reboot hand the fd to a new VMM), and the
//! mapping can be registered with userfaultfd (copy-on-write checkpoints).
//!
//! RAM below [`nl_abi::MMIO_HOLE_START`] is one region at guest address 0; RAM
//! beyond it continues at [`nl_abi::HIGH_RAM_GPA`] as a second region, backed
//! by the same memfd at the following offset.
//!
//! [`mod@file`] is how every file ninelives is given gets read: regular files
//! only, each kind under its own size limit.

pub mod file;
mod memfd;
mod uffd;
pub mod write_protect;

pub use memfd::create as create_memfd;
pub use memfd::data_ranges as file_data_ranges;

use std::fs::File;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use vm_memory::{FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestRegionMmap};

pub use vm_memory;

/// The vm-memory type used for guest RAM everywhere in ninelives.
pub type GuestMem = GuestMemoryMmap<()>;

#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error(
        "guest memory of {got} bytes is too small: the reference layout needs at least {min} bytes"
    )]
    TooSmall { got: u64, min: u64 },
    #[error("guest memory of {got} bytes is too large: at most {max} bytes are supported")]
    TooLarge { got: u64, max: u64 },
    #[error("guest memory size {0} is not a multiple of 4096")]
    Unaligned(u64),
    #[error("cannot create memfd for guest memory: {0}")]
    Memfd(std::io::Error),
    #[error("cannot size memfd for guest memory: {0}")]
    Truncate(std::io::Error),
    #[error("memfd holds {got} bytes but the layout needs {need}")]
    FdTooSmall { got: u64, need: u64 },
    #[error("cannot map guest memory: {0}")]
    Map(String),
    #[error("{0}")]
    Image(String),
}

/// One contiguous range of guest RAM and where it lives in the memfd.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionInfo {
    /// Guest physical address of the first byte.
    pub gpa: u64,
    /// Length in bytes.
    pub size: u64,
    /// Offset of the first byte in the memfd.
    pub fd_offset: u64,
}

/// The RAM layout for a VM of `mem_bytes`.
pub fn layout(mem_bytes: u64) -> Vec<RegionInfo> {
    let low = mem_bytes.min(nl_abi::MMIO_HOLE_START);
    let mut regions = vec![RegionInfo { gpa: 0, size: low, fd_offset: 0 }];
    if mem_bytes > low {
        regions.push(RegionInfo {
            gpa: nl_abi::HIGH_RAM_GPA,
            size: mem_bytes - low,
            fd_offset: low,
        });
    }
    regions
}

/// Guest RAM of one VM: the memfd and its mapping.
#[derive(Clone, Debug)]
pub struct GuestMemory {
    fd: Arc<File>,
    mem_bytes: u64,
    regions: Vec<RegionInfo>,
    mmap: GuestMem,
    /// Mapped `MAP_PRIVATE` ([`GuestMemory::private_copy`]): writes stay
    /// in this mapping, the memfd is only read.
    private: bool,
}

impl GuestMemory {
    /// Checks a requested memory size against the reference layout.
    pub fn check_size(mem_bytes: u64) -> Result<(), MemoryError> {
        if mem_bytes < nl_abi::MIN_MEM_BYTES {
            return Err(MemoryError::TooSmall { got: mem_bytes, min: nl_abi::MIN_MEM_BYTES });
        }
        if mem_bytes > nl_abi::MAX_MEM_BYTES {
            return Err(MemoryError::TooLarge { got: mem_bytes, max: nl_abi::MAX_MEM_BYTES });
        }
        if !mem_bytes.is_multiple_of(4096) {
            return Err(MemoryError::Unaligned(mem_bytes));
        }
        Ok(())
    }

    /// Creates fresh, zeroed guest RAM of `mem_bytes` in a new memfd.
    pub fn new(name: &str, mem_bytes: u64) -> Result<Self, MemoryError> {
        Self::check_size(mem_bytes)?;
        let fd = memfd::create(name).map_err(MemoryError::Memfd)?;
        fd.set_len(mem_bytes).map_err(MemoryError::Truncate)?;
        Self::from_fd(Arc::new(fd), mem_bytes)
    }

    /// Maps existing guest RAM from a memfd (e.g. one handed over by another
    /// VMM process). The contents are left untouched.
    pub fn from_fd(fd: Arc<File>, mem_bytes: u64) -> Result<Self, MemoryError> {
        Self::check_size(mem_bytes)?;
        let got = fd.metadata().map_err(MemoryError::Truncate)?.len();
        if got < mem_bytes {
            return Err(MemoryError::FdTooSmall { got, need: mem_bytes });
        }
        let regions = layout(mem_bytes);
        let mmap = map_regions(&fd, &regions)?;
        Ok(Self { fd, mem_bytes, regions, mmap, private: false })
    }

    /// A copy-on-write view of this memory: a second mapping of the same
    /// memfd, `MAP_PRIVATE`, so it reads what the memfd holds until it
    /// writes a page, and its writes never reach the memfd (nor any other
    /// mapping of it). [`GuestMemory::reset_private`] drops its writes.
    /// COLO's secondary VM runs over such a copy of the backup's memory.
    pub fn private_copy(&self) -> Result<GuestMemory, MemoryError> {
        let mapped = self
            .regions
            .iter()
            .map(|r| {
                let region = vm_memory::MmapRegion::build(
                    Some(FileOffset::from_arc(self.fd.clone(), r.fd_offset)),
                    r.size as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_NORESERVE,
                )
                .map_err(|e| MemoryError::Map(e.to_string()))?;
                GuestRegionMmap::new(region, GuestAddress(r.gpa))
                    .ok_or_else(|| MemoryError::Map(format!("region at {:#x} wraps", r.gpa)))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mmap =
            GuestMemoryMmap::from_regions(mapped).map_err(|e| MemoryError::Map(e.to_string()))?;
        Ok(Self {
            fd: self.fd.clone(),
            mem_bytes: self.mem_bytes,
            regions: self.regions.clone(),
            mmap,
            private: true,
        })
    }

    /// Whether this is a [`GuestMemory::private_copy`].
    pub fn is_private(&self) -> bool {
        self.private
    }

    /// Drops every page this private copy wrote: it reads the memfd's
    /// contents again (`MADV_DONTNEED` on a private file mapping). Refused
    /// on shared memory, where it would not undo writes.
    pub fn reset_private(&self) -> Result<(), MemoryError> {
        if !self.private {
            return Err(MemoryError::Map("only a private copy can be reset".into()));
        }
        for r in self.mmap.iter() {
            memfd::discard(r.as_ptr() as u64, vm_memory::GuestMemoryRegion::len(r) as usize)
                .map_err(|e| MemoryError::Map(format!("cannot reset a private copy: {e}")))?;
        }
        Ok(())
    }

    /// The vm-memory view of guest RAM.
    pub fn mem(&self) -> &GuestMem {
        &self.mmap
    }

    /// The memfd backing all regions.
    pub fn fd(&self) -> &Arc<File> {
        &self.fd
    }

    /// Total RAM in bytes.
    pub fn size(&self) -> u64 {
        self.mem_bytes
    }

    /// The RAM regions in guest-address order.
    pub fn regions(&self) -> &[RegionInfo] {
        &self.regions
    }

    /// Host virtual address of each region's mapping, in [`Self::regions`] order.
    pub fn host_addrs(&self) -> Vec<u64> {
        self.mmap.iter().map(|r| r.as_ptr() as u64).collect()
    }

    /// Guest address ranges whose pages have ever been allocated (touched);
    /// everything else reads as zero and need not be copied.
    pub fn allocated_ranges(&self) -> Result<Vec<(u64, u64)>, MemoryError> {
        let data = memfd::data_ranges(&self.fd, self.mem_bytes).map_err(MemoryError::Truncate)?;
        let mut out = Vec::new();
        for (s, e) in data {
            for r in &self.regions {
                let (rs, re) = (r.fd_offset, r.fd_offset + r.size);
                let (a, b) = (s.max(rs), e.min(re));
                if a < b {
                    out.push((r.gpa + (a - rs), r.gpa + (b - rs)));
                }
            }
        }
        Ok(out)
    }

    /// Maps every allocated page into this process's page tables ahead of
    /// use. A process that takes over memory another one has filled (warm
    /// reboot) would otherwise take one page fault per page on first touch;
    /// holes stay holes. Returns the bytes populated.
    pub fn populate_allocated(&self) -> Result<u64, MemoryError> {
        let mut done = 0;
        for (gpa, end) in self.allocated_ranges()? {
            let host = self.mmap.get_host_address(GuestAddress(gpa)).map_err(|e| {
                MemoryError::Map(format!("cannot find the mapping of {gpa:#x}: {e}"))
            })?;
            memfd::populate(host as u64, end - gpa).map_err(|e| {
                MemoryError::Map(format!("cannot populate {gpa:#x}..{end:#x}: {e}"))
            })?;
            done += end - gpa;
        }
        Ok(done)
    }

    /// Writes all of guest RAM, region by region, to `out` (a save-to-disk image).
    pub fn dump_to(&self, out: &mut File) -> Result<(), MemoryError> {
        use vm_memory::Bytes;
        for (gpa, len) in self.chunks() {
            self.mmap
                .write_all_volatile_to(GuestAddress(gpa), out, len)
                .map_err(|e| MemoryError::Image(format!("cannot write guest memory image: {e}")))?;
        }
        Ok(())
    }

    /// Reads all of guest RAM from an image written by [`Self::dump_to`].
    pub fn load_from(&self, src: &mut File) -> Result<(), MemoryError> {
        use vm_memory::Bytes;
        let len = src.metadata().map_err(|e| MemoryError::Image(e.to_string()))?.len();
        if len != self.mem_bytes {
            return Err(MemoryError::Image(format!(
                "memory image holds {len} bytes, the VM has {}",
                self.mem_bytes
            )));
        }
        for (gpa, len) in self.chunks() {
            self.mmap
                .read_exact_volatile_from(GuestAddress(gpa), src, len)
                .map_err(|e| MemoryError::Image(format!("cannot read guest memory image: {e}")))?;
        }
        Ok(())
    }

    /// RAM in pieces of at most 64 MiB (one read or write system call moves
    /// less than 2 GiB).
    fn chunks(&self) -> Vec<(u64, usize)> {
        const CHUNK: u64 = 64 << 20;
        let mut v = Vec::new();
        for r in &self.regions {
            let mut off = 0;
            while off < r.size {
                let len = CHUNK.min(r.size - off);
                v.push((r.gpa + off, len as usize));
                off += len;
            }
        }
        v
    }

    /// A view of `[gpa, gpa + size)` as its own guest memory object, backed by
    /// the same memfd. Accesses outside the window fail, which makes it a safe
    /// target for loading untrusted images into a fixed range.
    pub fn window(&self, gpa: u64, size: u64) -> Result<GuestMem, MemoryError> {
        let region =
            self.regions.iter().find(|r| gpa >= r.gpa && gpa + size <= r.gpa + r.size).ok_or_else(
                || MemoryError::Map(format!("window {gpa:#x}+{size:#x} is not inside RAM")),
            )?;
        if self.private {
            return Err(MemoryError::Map("a private copy has no shared windows".into()));
        }
        let info = RegionInfo { gpa, size, fd_offset: region.fd_offset + (gpa - region.gpa) };
        map_regions(&self.fd, &[info])
    }
}

fn map_regions(fd: &Arc<File>, regions: &[RegionInfo]) -> Result<GuestMem, MemoryError> {
    let mapped = regions
        .iter()
        .map(|r| {
            GuestRegionMmap::from_range(
                GuestAddress(r.gpa),
                r.size as usize,
                Some(FileOffset::from_arc(fd.clone(), r.fd_offset)),
            )
            .map_err(|e| MemoryError::Map(e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    GuestMemoryMmap::from_regions(mapped).map_err(|e| MemoryError::Map(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestMemoryBackend as _};

    #[test]
    fn layout_splits_around_the_mmio_hole() {
        assert_eq!(layout(256 << 20).len(), 1);
        let l = layout(4 << 30);
        assert_eq!(l.len(), 2);
        assert_eq!(l[0].size, nl_abi::MMIO_HOLE_START);
        assert_eq!(l[1].gpa, nl_abi::HIGH_RAM_GPA);
        assert_eq!(l[1].fd_offset, nl_abi::MMIO_HOLE_START);
        assert_eq!(l[0].size + l[1].size, 4 << 30);
    }

    #[test]
    fn sizes_are_checked() {
        assert!(matches!(GuestMemory::new("t", 1 << 20), Err(MemoryError::TooSmall { .. })));
        assert!(matches!(GuestMemory::new("t", (64 << 20) + 1), Err(MemoryError::Unaligned(_))));
        assert!(matches!(GuestMemory::new("t", 1 << 40), Err(MemoryError::TooLarge { .. })));
    }

    #[test]
    fn memory_is_lazy_and_shared_through_the_fd() {
        // 4 GiB would be impossible to allocate eagerly in a test; lazily it is free.
        let m = GuestMemory::new("t", 4 << 30).unwrap();
        m.mem().write_obj(0xdead_beef_u64, GuestAddress(nl_abi::HIGH_RAM_GPA + 8)).unwrap();
        m.mem().write_obj(0x1234_u64, GuestAddress(0x3000)).unwrap();
        let other = GuestMemory::from_fd(m.fd().clone(), m.size()).unwrap();
        let v: u64 = other.mem().read_obj(GuestAddress(nl_abi::HIGH_RAM_GPA + 8)).unwrap();
        assert_eq!(v, 0xdead_beef);
        assert_eq!(other.mem().read_obj::<u64>(GuestAddress(0x3000)).unwrap(), 0x1234);
        assert_eq!(m.mem().num_regions(), 2);
    }

    #[test]
    fn a_private_copy_reads_the_memfd_keeps_its_writes_and_resets() {
        let m = GuestMemory::new("t", 4 << 30).unwrap();
        let (lo, hi) = (GuestAddress(0x3000), GuestAddress(nl_abi::HIGH_RAM_GPA + 8));
        m.mem().write_obj(7u64, lo).unwrap();
        let p = m.private_copy().unwrap();
        assert!(p.is_private() && !m.is_private());
        assert_eq!(p.mem().read_obj::<u64>(lo).unwrap(), 7);
        // Its writes stay its own, in both regions.
        p.mem().write_obj(8u64, lo).unwrap();
        p.mem().write_obj(9u64, hi).unwrap();
        assert_eq!(m.mem().read_obj::<u64>(lo).unwrap(), 7);
        assert_eq!(m.mem().read_obj::<u64>(hi).unwrap(), 0);
        // The memfd changes under a page it did not write.
        m.mem().write_obj(10u64, GuestAddress(0x5000)).unwrap();
        assert_eq!(p.mem().read_obj::<u64>(GuestAddress(0x5000)).unwrap(), 10);
        // A reset drops its writes: it reads the memfd again.
        m.mem().write_obj(11u64, lo).unwrap();
        p.reset_private().unwrap();
        assert_eq!(p.mem().read_obj::<u64>(lo).unwrap(), 11);
        assert_eq!(p.mem().read_obj::<u64>(hi).unwrap(), 0);
        assert!(m.reset_private().is_err(), "shared memory is never reset");
        assert!(p.window(0, 4096).is_err());
    }

    #[test]
    fn allocated_ranges_skip_holes() {
        let m = GuestMemory::new("t", 64 << 20).unwrap();
        assert!(m.allocated_ranges().unwrap().is_empty());
        m.mem().write_obj(1u64, GuestAddress(0x10_0008)).unwrap();
        let r = m.allocated_ranges().unwrap();
        assert!(r.iter().any(|&(s, e)| s <= 0x10_0008 && 0x10_0010 <= e), "{r:x?}");
        let total: u64 = r.iter().map(|(s, e)| e - s).sum();
        assert!(total < 4 << 20, "only the touched pages are data: {total}");
    }

    #[test]
    fn images_round_trip() {
        let m = GuestMemory::new("t", 200 << 20).unwrap();
        m.mem().write_obj(0x5a5a_u64, GuestAddress(0x10_0000)).unwrap();
        m.mem().write_obj(0x6b6b_u64, GuestAddress((200 << 20) - 8)).unwrap();
        let mut f = tempfile_in_tmp();
        m.dump_to(&mut f).unwrap();
        use std::io::Seek;
        f.rewind().unwrap();
        let n = GuestMemory::new("t2", 200 << 20).unwrap();
        n.load_from(&mut f).unwrap();
        assert_eq!(n.mem().read_obj::<u64>(GuestAddress(0x10_0000)).unwrap(), 0x5a5a);
        assert_eq!(n.mem().read_obj::<u64>(GuestAddress((200 << 20) - 8)).unwrap(), 0x6b6b);
        let small = GuestMemory::new("t3", 48 << 20).unwrap();
        f.rewind().unwrap();
        assert!(small.load_from(&mut f).is_err());
    }

    fn tempfile_in_tmp() -> File {
        // An anonymous memfd stands in for a file on disk.
        memfd::create("image").unwrap()
    }

    #[test]
    fn windows_are_bounded() {
        let m = GuestMemory::new("t", 64 << 20).unwrap();
        let w = m.window(0x20_0000, 0x1000).unwrap();
        w.write_obj(7u64, GuestAddress(0x20_0ff8)).unwrap();
        assert!(w.write_obj(7u64, GuestAddress(0x20_1000)).is_err());
        assert_eq!(m.mem().read_obj::<u64>(GuestAddress(0x20_0ff8)).unwrap(), 7);
        assert!(m.window(63 << 20, 2 << 20).is_err());
    }
}
