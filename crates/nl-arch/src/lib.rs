//! x86_64 support for ninelives: the VMM plays bootloader.
//!
//! * [`paging`]: identity page tables with the user/supervisor split of the
//!   reference layout (see `nl_abi`).
//! * [`gdt`]: per-vCPU GDT and 64-bit TSS.
//! * [`image`]: loading kernel and user ELF images into fixed, bounded ranges.
//! * [`linux`]: the Linux 64-bit boot protocol (bzImage/vmlinux, zero page,
//!   e820, identity map and GDT, CPUID for PVM, System.map symbols).
//! * [`mptable`]: the Intel MP table that shows a Linux guest its vCPUs and
//!   IOAPIC.
//! * [`regs`]: the initial vCPU state (sregs, regs, MSRs, CPUID), valid on
//!   PVM and on VMX/SVM.
//! * [`backend`]: which KVM backend serves /dev/kvm.

pub mod backend;
pub mod gdt;
pub mod image;
pub mod linux;
pub mod mptable;
pub mod paging;
pub mod regs;

use nl_abi::BootInfo;
use vm_memory::{ByteValued, Bytes, GuestAddress};

#[derive(Debug, thiserror::Error)]
pub enum ArchError {
    #[error("{what} is not a valid ELF image: {why}")]
    BadElf { what: &'static str, why: String },
    #[error("{what} does not fit its range {start:#x}..{end:#x}: {why}")]
    ImageDoesNotFit { what: &'static str, start: u64, end: u64, why: String },
    #[error("cannot write boot structures into guest memory: {0}")]
    GuestMemory(String),
    #[error("KVM refused the initial vCPU state ({what}): {err}")]
    VcpuSetup { what: &'static str, err: kvm_ioctls::Error },
    #[error("MP table: {0}")]
    MpTable(String),
    #[error("{0} vCPUs requested; between 1 and {max} are supported", max = nl_abi::MAX_VCPUS)]
    BadVcpuCount(u32),
}

/// Plain-old-data wrapper so vm-memory can copy ABI structs into guest memory.
#[derive(Clone, Copy, Default)]
#[repr(transparent)]
pub struct Pod<T>(pub T);
// SAFETY: only instantiated for #[repr(C)] structs of plain u64 fields (BootInfo, PerCpu).
unsafe impl ByteValued for Pod<BootInfo> {}
// SAFETY: as above.
unsafe impl ByteValued for Pod<nl_abi::PerCpu> {}

/// Writes the boot-info page.
pub fn write_boot_info(mem: &nl_memory::GuestMem, info: &BootInfo) -> Result<(), ArchError> {
    mem.write_obj(Pod(*info), GuestAddress(nl_abi::BOOT_INFO_GPA))
        .map_err(|e| ArchError::GuestMemory(e.to_string()))
}

/// Reads the boot-info page back (used by state checks and tests).
pub fn read_boot_info(mem: &nl_memory::GuestMem) -> Result<BootInfo, ArchError> {
    mem.read_obj::<Pod<BootInfo>>(GuestAddress(nl_abi::BOOT_INFO_GPA))
        .map(|p| p.0)
        .map_err(|e| ArchError::GuestMemory(e.to_string()))
}

/// Builds everything in guest memory that does not depend on a vCPU:
/// page tables and the zeroed IDT (the kernel fills the gates).
pub fn setup_memory(mem: &nl_memory::GuestMem, mem_bytes: u64) -> Result<(), ArchError> {
    paging::build_identity_map(mem, mem_bytes)?;
    mem.write_slice(&[0u8; 4096], GuestAddress(nl_abi::IDT_GPA))
        .map_err(|e| ArchError::GuestMemory(e.to_string()))
}
