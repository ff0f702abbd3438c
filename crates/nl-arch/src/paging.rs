//! Identity page tables for the reference layout.
//!
//! * `[0, 2 MiB)`: 4 KiB pages; page 0 is not present (null guard), the
//!   boot-info page is user-readable and read-only, the rest supervisor-only.
//! * `[2 MiB, USER_BASE)`: supervisor-only 2 MiB pages (kernel image, stacks).
//! * `[USER_BASE, end of RAM)` and high RAM: user read-write 2 MiB pages.
//! * The control device at `CONTROL_MMIO_GPA`: one user 2 MiB page, uncached.

use nl_abi::*;
use vm_memory::{Bytes, GuestAddress};

use crate::ArchError;

const P: u64 = 1;
const RW: u64 = 1 << 1;
const US: u64 = 1 << 2;
const PCD: u64 = 1 << 4;
const PS: u64 = 1 << 7;

const PML4: u64 = PAGE_TABLES_GPA;
const PDPT: u64 = PAGE_TABLES_GPA + 0x1000;
const PT_LOW: u64 = PAGE_TABLES_GPA + 0x2000;
const PD_BASE: u64 = PAGE_TABLES_GPA + 0x3000;
const TWO_MIB: u64 = 2 << 20;
const ONE_GIB: u64 = 1 << 30;

/// CR3 value for the tables built by [`build_identity_map`].
pub const CR3: u64 = PML4;

/// Page-directory pages needed to map `mem_bytes` of RAM plus the control device.
fn pd_count(mem_bytes: u64) -> u64 {
    let top = if mem_bytes > MMIO_HOLE_START {
        HIGH_RAM_GPA + (mem_bytes - MMIO_HOLE_START)
    } else {
        CONTROL_MMIO_GPA + TWO_MIB
    };
    top.div_ceil(ONE_GIB).max(CONTROL_MMIO_GPA / ONE_GIB + 1)
}

/// Builds the identity map for a VM with `mem_bytes` of RAM.
pub fn build_identity_map(mem: &nl_memory::GuestMem, mem_bytes: u64) -> Result<(), ArchError> {
    let pds = pd_count(mem_bytes);
    debug_assert!(PD_BASE + pds * 0x1000 <= LOW_END);
    let mut w = Writer { mem, err: None };

    w.put(PML4, PDPT | P | RW | US);
    for g in 0..pds {
        w.put(PDPT + g * 8, (PD_BASE + g * 0x1000) | P | RW | US);
    }
    // Low 2 MiB with 4 KiB pages.
    w.put(PD_BASE, PT_LOW | P | RW | US);
    for page in 1..512u64 {
        let addr = page * 0x1000;
        let flags = if addr == BOOT_INFO_GPA { P | US } else { P | RW };
        w.put(PT_LOW + page * 8, addr | flags);
    }
    // RAM with 2 MiB pages.
    for region in nl_memory::layout(mem_bytes) {
        let mut addr = region.gpa.max(LOW_END);
        while addr < region.gpa + region.size {
            let user = if addr >= USER_BASE { US } else { 0 };
            w.put(pde_addr(addr), addr | P | RW | PS | user);
            addr += TWO_MIB;
        }
    }
    // The control device page, reachable from ring 3.
    w.put(pde_addr(CONTROL_MMIO_GPA), CONTROL_MMIO_GPA | P | RW | US | PS | PCD);
    w.finish()
}

/// Maps `[gpa, gpa + size)` in the MMIO hole (below [`CONTROL_MMIO_GPA`],
/// 2 MiB aligned) with user-accessible, writable 2 MiB pages, for sandbox
/// channel windows. Writable even where the memory slot behind it is
/// read-only: a write must reach the slot and exit to the VMM (the
/// isolation report), not fault inside the guest.
pub fn map_user_window(mem: &nl_memory::GuestMem, gpa: u64, size: u64) -> Result<(), ArchError> {
    let end = gpa.saturating_add(size);
    if !gpa.is_multiple_of(TWO_MIB)
        || !size.is_multiple_of(TWO_MIB)
        || gpa < MMIO_HOLE_START
        || end > CONTROL_MMIO_GPA
    {
        return Err(ArchError::GuestMemory(format!(
            "window {gpa:#x}+{size:#x} is not 2 MiB aligned inside [{MMIO_HOLE_START:#x}, {CONTROL_MMIO_GPA:#x})"
        )));
    }
    let mut w = Writer { mem, err: None };
    let mut addr = gpa;
    while addr < end {
        w.put(pde_addr(addr), addr | P | RW | US | PS);
        addr += TWO_MIB;
    }
    w.finish()
}

fn pde_addr(addr: u64) -> u64 {
    PD_BASE + (addr / ONE_GIB) * 0x1000 + ((addr % ONE_GIB) / TWO_MIB) * 8
}

struct Writer<'a> {
    mem: &'a nl_memory::GuestMem,
    err: Option<String>,
}

impl Writer<'_> {
    fn put(&mut self, at: u64, val: u64) {
        if self.err.is_none() {
            if let Err(e) = self.mem.write_obj(val, GuestAddress(at)) {
                self.err = Some(format!("page table entry at {at:#x}: {e}"));
            }
        }
    }
    fn finish(self) -> Result<(), ArchError> {
        self.err.map_or(Ok(()), |e| Err(ArchError::GuestMemory(e)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn walk(mem: &nl_memory::GuestMem, va: u64) -> Option<(u64, u64)> {
        let rd = |a: u64| mem.read_obj::<u64>(GuestAddress(a)).unwrap();
        let e4 = rd(CR3 + ((va >> 39) & 511) * 8);
        let e3 = rd((e4 & !0xfff) + ((va >> 30) & 511) * 8);
        if e3 & P == 0 {
            return None;
        }
        let e2 = rd((e3 & !0xfff) + ((va >> 21) & 511) * 8);
        if e2 & P == 0 {
            return None;
        }
        let flags = e4 & e3 & e2 & (US | RW);
        if e2 & PS != 0 {
            return Some(((e2 & !0x1f_ffff & !(1 << 63)) + (va & 0x1f_ffff), flags));
        }
        let e1 = rd((e2 & !0xfff) + ((va >> 12) & 511) * 8);
        if e1 & P == 0 {
            return None;
        }
        Some(((e1 & !0xfff) + (va & 0xfff), flags & e1))
    }

    #[test]
    fn identity_map_with_user_split() {
        let m = nl_memory::GuestMemory::new("pt", 256 << 20).unwrap();
        build_identity_map(m.mem(), m.size()).unwrap();
        let mem = m.mem();
        assert_eq!(walk(mem, 0), None, "null page must not be mapped");
        assert_eq!(walk(mem, BOOT_INFO_GPA + 8), Some((BOOT_INFO_GPA + 8, US)));
        assert_eq!(walk(mem, KERNEL_BASE + 0x123), Some((KERNEL_BASE + 0x123, RW)));
        assert_eq!(walk(mem, USER_BASE), Some((USER_BASE, RW | US)));
        let last = (256 << 20) - 8;
        assert_eq!(walk(mem, last), Some((last, RW | US)));
        assert_eq!(walk(mem, 256 << 20), None);
        assert_eq!(walk(mem, CONTROL_MMIO_GPA + 0x48), Some((CONTROL_MMIO_GPA + 0x48, RW | US)));
    }

    #[test]
    fn a_user_window_is_mapped_writable_and_nothing_else_moves() {
        let m = nl_memory::GuestMemory::new("pt", 256 << 20).unwrap();
        build_identity_map(m.mem(), m.size()).unwrap();
        let w = MMIO_HOLE_START + (4 << 20);
        assert_eq!(walk(m.mem(), w), None);
        map_user_window(m.mem(), w, 4 << 20).unwrap();
        assert_eq!(walk(m.mem(), w + 8), Some((w + 8, RW | US)));
        assert_eq!(walk(m.mem(), w + (4 << 20) - 8), Some((w + (4 << 20) - 8, RW | US)));
        assert_eq!(walk(m.mem(), w + (4 << 20)), None);
        assert!(map_user_window(m.mem(), w + 4096, 2 << 20).is_err());
        assert!(map_user_window(m.mem(), CONTROL_MMIO_GPA, 2 << 20).is_err());
        assert!(map_user_window(m.mem(), 0, 2 << 20).is_err());
    }

    #[test]
    fn high_ram_is_mapped() {
        let m = nl_memory::GuestMemory::new("pt", 5 << 30).unwrap();
        build_identity_map(m.mem(), m.size()).unwrap();
        let top = HIGH_RAM_GPA + (5 << 30) - MMIO_HOLE_START - 8;
        assert_eq!(walk(m.mem(), top), Some((top, RW | US)));
        assert_eq!(walk(m.mem(), MMIO_HOLE_START - 8), Some((MMIO_HOLE_START - 8, RW | US)));
    }
}
