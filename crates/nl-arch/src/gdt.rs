//! Per-vCPU GDT, TSS and per-CPU kernel data in the vCPU's CPU area.

use nl_abi::*;
use vm_memory::{Bytes, GuestAddress};

use crate::{ArchError, Pod};

/// GDT entries in selector order (index = selector / 8).
const GDT: [u64; 8] = [
    0,
    0x00af_9b00_0000_ffff, // 0x08 kernel code, 64-bit
    0x00cf_9300_0000_ffff, // 0x10 kernel data
    0,
    0x00cf_fb00_0000_ffff, // 0x20 user code, 32-bit (SYSRET layout)
    0x00cf_f300_0000_ffff, // 0x28 user data
    0x00af_fb00_0000_ffff, // 0x30 user code, 64-bit
    0,
];

/// Guest address of vCPU `cpu`'s TSS.
pub fn tss_addr(cpu: u64) -> u64 {
    cpu_area(cpu) + CPU_AREA_TSS_OFFSET
}

/// Guest address of vCPU `cpu`'s PerCpu block (its GS base in ring 0).
pub fn percpu_addr(cpu: u64) -> u64 {
    cpu_area(cpu) + CPU_AREA_PERCPU_OFFSET
}

/// 16-byte system descriptor of a busy 64-bit TSS.
fn tss_descriptor(base: u64) -> [u64; 2] {
    let limit = 0x67u64;
    let low = limit
        | ((base & 0xff_ffff) << 16)
        | (0x8b << 40) // present, DPL 0, type 11 (64-bit TSS, busy)
        | (((base >> 24) & 0xff) << 56);
    [low, base >> 32]
}

/// Writes GDT, TSS (RSP0 = kernel stack top, no I/O bitmap) and PerCpu for `cpu`.
pub fn setup_cpu_area(mem: &nl_memory::GuestMem, cpu: u64) -> Result<(), ArchError> {
    let err = |e: vm_memory::GuestMemoryError| ArchError::GuestMemory(e.to_string());
    let base = cpu_area(cpu);
    mem.write_slice(&[0u8; CPU_AREA_SIZE as usize], GuestAddress(base)).map_err(err)?;
    for (i, e) in GDT.iter().enumerate() {
        mem.write_obj(*e, GuestAddress(base + i as u64 * 8)).map_err(err)?;
    }
    let [lo, hi] = tss_descriptor(tss_addr(cpu));
    mem.write_obj(lo, GuestAddress(base + SEL_TSS as u64)).map_err(err)?;
    mem.write_obj(hi, GuestAddress(base + SEL_TSS as u64 + 8)).map_err(err)?;
    // TSS: RSP0 at offset 4; I/O map base at 0x66 beyond the limit (no bitmap).
    let tss = tss_addr(cpu);
    mem.write_obj(kernel_stack_top(cpu), GuestAddress(tss + 4)).map_err(err)?;
    mem.write_obj(0x68u16, GuestAddress(tss + 0x66)).map_err(err)?;
    let percpu =
        PerCpu { kernel_rsp: kernel_stack_top(cpu), user_rsp: 0, cpu, ..PerCpu::default() };
    mem.write_obj(Pod(percpu), GuestAddress(percpu_addr(cpu))).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tss_descriptor_encodes_base_and_type() {
        let [lo, hi] = tss_descriptor(0x1234_5678_9abc);
        assert_eq!(lo & 0xffff, 0x67);
        assert_eq!((lo >> 16) & 0xff_ffff, 0x56_789abc & 0xff_ffff);
        assert_eq!((lo >> 40) & 0xff, 0x8b);
        assert_eq!((lo >> 56) & 0xff, 0x56);
        assert_eq!(hi, 0x1234);
    }
}
