//! The initial vCPU state: long mode, ring 0, at the kernel entry.
//!
//! The same state is accepted by PVM (see PLATFORM.md: CR0 with AM, CR4 with
//! FSGSBASE and without PCID, EFER with SCE and NXE) and by VMX/SVM (TR is our
//! own busy 64-bit TSS).

use kvm_bindings::{kvm_msr_entry, kvm_regs, kvm_segment, CpuId, Msrs};
use kvm_ioctls::VcpuFd;
use nl_abi::*;

use crate::gdt::{percpu_addr, tss_addr};
use crate::paging::CR3;
use crate::ArchError;

pub const MSR_IA32_APICBASE: u32 = 0x1b;
pub const MSR_IA32_TSC: u32 = 0x10;
pub const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
pub const MSR_PAT: u32 = 0x277;
pub const MSR_STAR: u32 = 0xc000_0081;
pub const MSR_LSTAR: u32 = 0xc000_0082;
pub const MSR_CSTAR: u32 = 0xc000_0083;
pub const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
pub const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
pub const MSR_TSC_AUX: u32 = 0xc000_0103;

/// KVM paravirtual MSRs a Linux guest enables (kvm-clock, async page
/// faults, steal time, PV EOI). Each is off while its bit 0 is clear, so
/// restoring a zero into a guest that never used it is harmless. (The wall
/// clock MSR is not saved: writing it makes KVM write guest memory.)
pub const MSR_KVM_SYSTEM_TIME_NEW: u32 = 0x4b56_4d01;
pub const MSR_KVM_ASYNC_PF_EN: u32 = 0x4b56_4d02;
pub const MSR_KVM_STEAL_TIME: u32 = 0x4b56_4d03;
pub const MSR_KVM_PV_EOI_EN: u32 = 0x4b56_4d04;

/// MSRs saved and restored with a vCPU's state (those KVM does not keep in
/// sregs or the LAPIC state).
pub const SAVED_MSRS: [u32; 13] = [
    MSR_IA32_TSC,
    MSR_PAT,
    MSR_STAR,
    MSR_LSTAR,
    MSR_CSTAR,
    MSR_SYSCALL_MASK,
    MSR_KERNEL_GS_BASE,
    MSR_TSC_AUX,
    MSR_IA32_MISC_ENABLE,
    MSR_KVM_SYSTEM_TIME_NEW,
    MSR_KVM_ASYNC_PF_EN,
    MSR_KVM_STEAL_TIME,
    MSR_KVM_PV_EOI_EN,
];

const CR0_PE: u64 = 1;
const CR0_MP: u64 = 1 << 1;
const CR0_ET: u64 = 1 << 4;
const CR0_NE: u64 = 1 << 5;
const CR0_WP: u64 = 1 << 16;
const CR0_AM: u64 = 1 << 18;
const CR0_PG: u64 = 1 << 31;
const CR4_PAE: u64 = 1 << 5;
const CR4_OSFXSR: u64 = 1 << 9;
const CR4_OSXMMEXCPT: u64 = 1 << 10;
const CR4_FSGSBASE: u64 = 1 << 16;
const EFER_SCE: u64 = 1;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;
const EFER_NXE: u64 = 1 << 11;

pub const CR0: u64 = CR0_PE | CR0_MP | CR0_ET | CR0_NE | CR0_WP | CR0_AM | CR0_PG;
pub const CR4: u64 = CR4_PAE | CR4_OSFXSR | CR4_OSXMMEXCPT | CR4_FSGSBASE;
pub const EFER: u64 = EFER_SCE | EFER_LME | EFER_LMA | EFER_NXE;

fn segment(selector: u16, code: bool) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_: if code { 11 } else { 3 },
        present: 1,
        dpl: (selector & 3) as u8,
        db: u8::from(!code),
        s: 1,
        l: u8::from(code),
        g: 1,
        ..Default::default()
    }
}

/// The CPUID vCPU `cpu` sees: what KVM supports, with its initial APIC id
/// in leaf 1 EBX[31:24] and leaves 0xb/0x1f, and x2APIC advertised.
pub fn vcpu_cpuid(supported: &CpuId, cpu: u64) -> CpuId {
    let mut cpuid = supported.clone();
    for e in cpuid.as_mut_slice() {
        match e.function {
            1 => {
                e.ebx = (e.ebx & 0x00ff_ffff) | ((cpu as u32) << 24);
                e.ecx |= 1 << 21;
            }
            0xb | 0x1f => e.edx = cpu as u32,
            _ => {}
        }
    }
    cpuid
}

/// Sets sregs, regs, MSRs and CPUID so vCPU `cpu` starts at `entry` in ring 0.
pub fn setup_vcpu(
    vcpu: &VcpuFd,
    cpu: u64,
    entry: u64,
    supported_cpuid: &CpuId,
) -> Result<(), ArchError> {
    let fail = |what| move |err| ArchError::VcpuSetup { what, err };

    vcpu.set_cpuid2(&vcpu_cpuid(supported_cpuid, cpu)).map_err(fail("CPUID"))?;

    let mut s = vcpu.get_sregs().map_err(fail("get sregs"))?;
    s.cr0 = CR0;
    s.cr3 = CR3;
    s.cr4 = CR4;
    s.efer = EFER;
    s.cs = segment(SEL_KERNEL_CODE, true);
    let data = segment(SEL_KERNEL_DATA, false);
    s.ss = data;
    s.ds = data;
    s.es = data;
    s.fs = data;
    s.gs = kvm_segment { base: percpu_addr(cpu), ..data };
    s.tr = kvm_segment {
        base: tss_addr(cpu),
        limit: 0x67,
        selector: SEL_TSS,
        type_: 11,
        present: 1,
        ..Default::default()
    };
    s.gdt.base = cpu_area(cpu);
    s.gdt.limit = GDT_LIMIT;
    s.idt.base = IDT_GPA;
    s.idt.limit = 0xfff;
    vcpu.set_sregs(&s).map_err(fail("sregs (CR0/CR4/EFER/segments)"))?;

    let regs = kvm_regs {
        rip: entry,
        rsp: kernel_stack_top(cpu),
        rdi: cpu,
        rsi: BOOT_INFO_GPA,
        rflags: 0x2,
        ..Default::default()
    };
    vcpu.set_regs(&regs).map_err(fail("regs"))?;

    let apic_base = 0xfee0_0000 | (1 << 11) | (1 << 10) | if cpu == 0 { 1 << 8 } else { 0 };
    let msrs = Msrs::from_entries(&[
        kvm_msr_entry { index: MSR_IA32_APICBASE, data: apic_base, ..Default::default() },
        kvm_msr_entry { index: MSR_KERNEL_GS_BASE, data: 0, ..Default::default() },
    ])
    .expect("two MSR entries fit");
    let n = vcpu.set_msrs(&msrs).map_err(fail("MSRs"))?;
    if n != 2 {
        return Err(ArchError::VcpuSetup {
            what: "MSRs (APIC base with x2APIC)",
            err: kvm_ioctls::Error::new(libc_einval()),
        });
    }
    Ok(())
}

fn libc_einval() -> i32 {
    22
}
