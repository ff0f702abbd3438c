//! The ninelives reference guest, embedded.
//!
//! `build.rs` builds the `guest/` workspace (a `no_std` ring-0 kernel and the
//! ring-3 program that runs the `nl-workloads` engine) and this crate exposes
//! the two static ELF executables. The VMM loads their `PT_LOAD` segments at
//! their physical addresses (`nl_abi`'s layout: the kernel at
//! `KERNEL_BASE`, the user program at `USER_BASE`), starts every vCPU at the
//! kernel's entry point and puts the user program's entry point in
//! `BootInfo::user_entry`.
//!
//! What the VMM can rely on (see guest/kernel and guest/user):
//! * the kernel fills IDT gates 0..=31, TIMER_VECTOR and SPURIOUS_VECTOR,
//!   reports any exception as `ERR_EXCEPTION_BASE + vector` (ERROR_INFO =
//!   RIP), writes `PHASE_KERNEL_UP`, and enters ring 3; the user program
//!   writes `PHASE_WORKLOAD_START` first, then the sequence of `nl_abi::reg`.
//! * After `PHASE_DONE` (or any ERROR) the vCPU parks with `cli; hlt`, so
//!   with an in-kernel LAPIC KVM_RUN does not return on its own.
//! * Syscalls from ring 3 use `int3` (vector 3 is a DPL-3 gate): on PVM
//!   `syscall` from ring 3 does not reach a non-PVM-aware kernel and `int n`
//!   raises #UD. The `syscall` entry is still programmed (LSTAR) for
//!   hardware-assisted backends.
//! * On PVM, ring 3 runs with IOPL 0 whatever `BootInfo::user_iopl` says;
//!   the user program checks RFLAGS and falls back to `SYS_OUTL` (the echo
//!   port then sees only the `out`).
//! * No heartbeats during the warm-up round (one engine round: for a large
//!   memwrite working set, about 8 µs per page on PVM).
#![no_std]

/// The guest kernel (ring 0): static, `ET_EXEC`, linked at `KERNEL_BASE`.
pub static KERNEL_ELF: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/kernel.elf"));

/// The guest user program (ring 3): static, `ET_EXEC`, linked at `USER_BASE`.
pub static USER_ELF: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/user.elf"));

#[cfg(test)]
mod tests {
    use super::{KERNEL_ELF, USER_ELF};
    use nl_abi::{KERNEL_BASE, KERNEL_STACKS_GPA, USER_BASE, USER_STACKS_GPA};

    const PT_LOAD: u32 = 1;

    fn u16_at(b: &[u8], off: usize) -> u16 {
        u16::from_le_bytes(b[off..off + 2].try_into().unwrap())
    }
    fn u32_at(b: &[u8], off: usize) -> u32 {
        u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
    }
    fn u64_at(b: &[u8], off: usize) -> u64 {
        u64::from_le_bytes(b[off..off + 8].try_into().unwrap())
    }

    /// A static x86-64 executable whose segments are all PT_LOAD, identity
    /// placed (vaddr == paddr) inside [lo, hi), with its entry point in one.
    fn check_image(elf: &[u8], lo: u64, hi: u64) {
        assert_eq!(&elf[..4], b"\x7fELF");
        assert_eq!(elf[4], 2, "ELFCLASS64");
        assert_eq!(elf[5], 1, "little endian");
        assert_eq!(u16_at(elf, 16), 2, "ET_EXEC");
        assert_eq!(u16_at(elf, 18), 62, "EM_X86_64");
        let entry = u64_at(elf, 24);
        let phoff = u64_at(elf, 32) as usize;
        let phentsize = u16_at(elf, 54) as usize;
        let phnum = u16_at(elf, 56) as usize;
        assert!(phnum > 0);
        let mut entry_in_text = false;
        for i in 0..phnum {
            let ph = &elf[phoff + i * phentsize..][..phentsize];
            assert_eq!(u32_at(ph, 0), PT_LOAD, "program header {i} is not PT_LOAD");
            let flags = u32_at(ph, 4);
            let offset = u64_at(ph, 8);
            let vaddr = u64_at(ph, 16);
            let paddr = u64_at(ph, 24);
            let filesz = u64_at(ph, 32);
            let memsz = u64_at(ph, 40);
            assert_eq!(vaddr, paddr);
            assert!(filesz <= memsz);
            assert!(offset + filesz <= elf.len() as u64);
            assert!(vaddr >= lo && vaddr + memsz <= hi, "segment {vaddr:#x}+{memsz:#x}");
            if flags & 1 != 0 && (vaddr..vaddr + memsz).contains(&entry) {
                entry_in_text = true;
            }
        }
        assert!(entry_in_text, "entry {entry:#x} is not in an executable segment");
    }

    #[test]
    fn kernel_image_fits_its_range() {
        check_image(KERNEL_ELF, KERNEL_BASE, KERNEL_STACKS_GPA);
        assert_eq!(u64_at(KERNEL_ELF, 24), KERNEL_BASE, "kernel entry");
    }

    #[test]
    fn user_image_fits_its_range() {
        check_image(USER_ELF, USER_BASE, USER_STACKS_GPA);
    }
}
