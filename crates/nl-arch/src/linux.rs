//! Booting a Linux kernel directly in 64-bit mode, Firecracker-style.
//!
//! The VMM plays bootloader for the kernel's 64-bit boot protocol
//! (Documentation/arch/x86/boot.rst): it loads the vmlinux ELF at its
//! physical addresses, writes a zero page (`boot_params`: setup header,
//! e820 map, command line and initrd pointers), an identity map of the
//! first GiB and a boot GDT, and starts the boot vCPU at the ELF entry
//! (`startup_64`) with RSI pointing at the zero page.
//!
//! A bzImage is decompressed on the host: its payload is an xz stream
//! (with the x86 BCJ filter) holding the vmlinux ELF. Its setup header is
//! copied into the zero page, as a bootloader would.
//!
//! Low-memory layout (Firecracker's):
//!
//! | address | what |
//! | --- | --- |
//! | 0x500 | boot GDT: null, null, 64-bit code (0x10), data (0x18) |
//! | 0x520 | empty boot IDT |
//! | 0x7000 | zero page |
//! | 0x8ff0 | initial stack (grows down) |
//! | 0x9000, 0xa000, 0xb000 | PML4, PDPT, PD: 2 MiB pages over the first GiB |
//! | 0x20000 | command line |
//! | 0x9fc00..0x100000 | EBDA, VGA hole, BIOS: not RAM in the e820 map |
//! | 0x1000000 | the kernel (its ELF physical addresses) |
//! | below the end of low RAM | the initrd, page aligned |

use std::io::{Cursor, Read};

use kvm_bindings::{kvm_msr_entry, kvm_regs, kvm_segment, CpuId, Msrs};
use kvm_ioctls::VcpuFd;
use linux_loader::cmdline::Cmdline;
use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params, setup_header};
use linux_loader::loader::{elf::Elf, load_cmdline, KernelLoader};
use vm_memory::{ByteValued, Bytes, GuestAddress};

use crate::regs::{MSR_IA32_APICBASE, MSR_IA32_MISC_ENABLE};
use crate::ArchError;

pub const BOOT_GDT: u64 = 0x500;
pub const BOOT_IDT: u64 = 0x520;
pub const ZERO_PAGE: u64 = 0x7000;
pub const BOOT_STACK: u64 = 0x8ff0;
pub const PML4: u64 = 0x9000;
pub const PDPT: u64 = 0xa000;
pub const PD: u64 = 0xb000;
pub const CMDLINE: u64 = 0x20000;
/// Linux's COMMAND_LINE_SIZE on x86_64.
pub const CMDLINE_MAX: usize = 2048;
pub const EBDA_START: u64 = 0x9fc00;
pub const HIMEM_START: u64 = 0x10_0000;
/// Where a relocatable kernel goes when its ELF says nothing lower.
pub const KERNEL_MIN: u64 = 0x100_0000;

pub const SEL_CODE: u16 = 0x10;
pub const SEL_DATA: u16 = 0x18;

const BOOT_FLAG_MAGIC: u16 = 0xaa55;
const HDR_MAGIC: u32 = 0x5372_6448; // "HdrS"
const LOADER_UNDEFINED: u8 = 0xff;
const E820_RAM: u32 = 1;
/// Offset of the setup header in a bzImage (and in the zero page).
const SETUP_HEADER_OFFSET: usize = 0x1f1;
const XZ_MAGIC: &[u8] = b"\xfd7zXZ\0";

/// What kind of image `--kernel` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImageKind {
    /// A bzImage (boot sector with the "HdrS" setup header).
    BzImage,
    /// A vmlinux ELF (an ELF that holds Linux's version banner).
    Vmlinux,
    /// Anything else (the reference kernel is an ELF without the banner).
    Other,
}

/// Tells a Linux kernel image from the reference guest's kernel.
pub fn image_kind(image: &[u8]) -> ImageKind {
    if image.len() > 0x206 && &image[0x202..0x206] == b"HdrS" && image[0x1fe..0x200] == [0x55, 0xaa]
    {
        ImageKind::BzImage
    } else if image.starts_with(b"\x7fELF") && find(image, b"Linux version ").is_some() {
        ImageKind::Vmlinux
    } else {
        ImageKind::Other
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn bad(why: impl Into<String>) -> ArchError {
    ArchError::BadElf { what: "Linux kernel", why: why.into() }
}

fn mem_err(e: impl std::fmt::Display) -> ArchError {
    ArchError::GuestMemory(e.to_string())
}

/// A Linux kernel ready to load: the vmlinux ELF and, for a bzImage, its
/// setup header.
pub struct Kernel {
    pub vmlinux: Vec<u8>,
    pub setup_header: Option<setup_header>,
}

/// Prepares `image` (a bzImage or a vmlinux ELF) for loading.
pub fn prepare(image: &[u8]) -> Result<Kernel, ArchError> {
    match image_kind(image) {
        ImageKind::Vmlinux => Ok(Kernel { vmlinux: image.to_vec(), setup_header: None }),
        ImageKind::BzImage => decompress_bzimage(image),
        ImageKind::Other => {
            Err(bad("neither a bzImage (no \"HdrS\" header) nor a vmlinux ELF with a Linux banner"))
        }
    }
}

/// Decompresses a bzImage's xz payload into the vmlinux ELF.
pub fn decompress_bzimage(image: &[u8]) -> Result<Kernel, ArchError> {
    let hdr_len = std::mem::size_of::<setup_header>();
    let hdr_bytes = image
        .get(SETUP_HEADER_OFFSET..SETUP_HEADER_OFFSET + hdr_len)
        .ok_or_else(|| bad("bzImage shorter than its setup header"))?;
    let hdr = setup_header::from_slice(hdr_bytes).copied().ok_or_else(|| bad("setup header"))?;
    let version = hdr.version;
    if version < 0x208 {
        return Err(bad(format!(
            "boot protocol {version:#x} is too old: 2.08 (payload fields) is needed"
        )));
    }
    // setup_sects == 0 means 4 (boot.rst).
    let setup_sects = if hdr.setup_sects == 0 { 4 } else { usize::from(hdr.setup_sects) };
    let pm_start = (setup_sects + 1) * 512;
    let off = pm_start + hdr.payload_offset as usize;
    let payload = image
        .get(off..off + hdr.payload_length as usize)
        .ok_or_else(|| bad("payload_offset/payload_length point outside the bzImage"))?;
    if !payload.starts_with(XZ_MAGIC) {
        return Err(bad(format!(
            "the bzImage payload is not xz-compressed (starts {:02x?}); only xz is supported",
            &payload[..payload.len().min(6)]
        )));
    }
    // The kernel build appends the decompressed size (32-bit little endian).
    let size_bytes = payload.get(payload.len().saturating_sub(4)..).unwrap_or_default();
    let size = u32::from_le_bytes(size_bytes.try_into().map_err(|_| bad("payload too short"))?);
    if size as usize > 1 << 30 {
        return Err(bad(format!("payload claims {size} bytes decompressed (over 1 GiB)")));
    }
    let mut out = vec![0u8; size as usize];
    let mut xz = lzma_rust2::XzReader::new(Cursor::new(&payload[..payload.len() - 4]), false);
    xz.read_exact(&mut out).map_err(|e| bad(format!("decompressing the xz payload: {e}")))?;
    if !out.starts_with(b"\x7fELF") {
        return Err(bad("the decompressed payload is not an ELF"));
    }
    Ok(Kernel { vmlinux: out, setup_header: Some(hdr) })
}

/// What the kernel gets besides its image.
#[derive(Clone, Debug, Default)]
pub struct BootConfig {
    pub cmdline: String,
    pub initrd: Option<Vec<u8>>,
}

/// Builds the kernel command line (linux-loader's checks: printable, no
/// more than Linux accepts).
pub fn cmdline(s: &str) -> Result<Cmdline, ArchError> {
    Cmdline::try_from(s, CMDLINE_MAX)
        .map_err(|e| ArchError::GuestMemory(format!("kernel command line {s:?}: {e}")))
}

/// A virtio-mmio device the kernel is told about on its command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VirtioMmio {
    pub base: u64,
    pub size: u64,
    pub irq: u32,
}

/// `cmdline` with one `virtio_mmio.device=<size>@<base>:<irq>` per device
/// (linux-loader's `Cmdline::add_virtio_mmio_device`, Firecracker's
/// convention; the kernel needs `CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES`).
pub fn with_virtio_mmio(cmdline: &str, devices: &[VirtioMmio]) -> Result<String, ArchError> {
    let mut c = self::cmdline(cmdline)?;
    for d in devices {
        c.add_virtio_mmio_device(d.size, GuestAddress(d.base), d.irq, None).map_err(|e| {
            ArchError::GuestMemory(format!(
                "kernel command line: virtio-mmio device at {:#x}: {e}",
                d.base
            ))
        })?;
    }
    let s =
        c.as_cstring().map_err(|e| ArchError::GuestMemory(format!("kernel command line: {e}")))?;
    Ok(s.to_string_lossy().into_owned())
}

/// The e820 map of guest RAM: low memory below the EBDA, then every RAM
/// region from 1 MiB on (the MMIO hole is left out).
pub fn e820_map(regions: &[nl_memory::RegionInfo]) -> Vec<boot_e820_entry> {
    let mut out = Vec::new();
    for r in regions {
        let end = r.gpa + r.size;
        if r.gpa < HIMEM_START {
            out.push(boot_e820_entry { addr: r.gpa, size: EBDA_START - r.gpa, r#type: E820_RAM });
            if end > HIMEM_START {
                out.push(boot_e820_entry {
                    addr: HIMEM_START,
                    size: end - HIMEM_START,
                    r#type: E820_RAM,
                });
            }
        } else {
            out.push(boot_e820_entry { addr: r.gpa, size: r.size, r#type: E820_RAM });
        }
    }
    out
}

/// Writes the identity map of the first GiB (2 MiB pages, supervisor only)
/// and the boot GDT/IDT.
fn write_tables(mem: &nl_memory::GuestMem) -> Result<(), ArchError> {
    mem.write_obj(PDPT | 0x3, GuestAddress(PML4)).map_err(mem_err)?;
    mem.write_obj(PD | 0x3, GuestAddress(PDPT)).map_err(mem_err)?;
    for i in 0..512u64 {
        // Present, writable, 2 MiB page.
        mem.write_obj((i << 21) | 0x83, GuestAddress(PD + i * 8)).map_err(mem_err)?;
    }
    let gdt: [u64; 4] = [0, 0, 0x00af_9b00_0000_ffff, 0x00cf_9300_0000_ffff];
    for (i, e) in gdt.iter().enumerate() {
        mem.write_obj(*e, GuestAddress(BOOT_GDT + i as u64 * 8)).map_err(mem_err)?;
    }
    mem.write_obj(0u64, GuestAddress(BOOT_IDT)).map_err(mem_err)
}

/// Loads the kernel, initrd, command line and boot structures into guest
/// memory. Returns the 64-bit entry point.
pub fn load(
    memory: &nl_memory::GuestMemory,
    kernel: &Kernel,
    boot: &BootConfig,
) -> Result<u64, ArchError> {
    let mem = memory.mem();
    let low_end = memory.regions().first().map_or(0, |r| r.gpa + r.size);
    if low_end < 64 << 20 {
        return Err(ArchError::ImageDoesNotFit {
            what: "Linux kernel",
            start: 0,
            end: low_end,
            why: "a Linux guest needs at least 64 MiB of memory".into(),
        });
    }
    write_tables(mem)?;
    let res =
        Elf::load(mem, None, &mut Cursor::new(&kernel.vmlinux), Some(GuestAddress(HIMEM_START)))
            .map_err(|e| bad(format!("loading the vmlinux ELF: {e}")))?;
    let kernel_end = res.kernel_end;
    let entry = res.kernel_load.0;

    let cmd = cmdline(&boot.cmdline)?;
    load_cmdline(mem, GuestAddress(CMDLINE), &cmd).map_err(mem_err)?;

    let mut params = boot_params::default();
    if let Some(h) = kernel.setup_header {
        params.hdr = h;
    }
    params.hdr.type_of_loader = LOADER_UNDEFINED;
    params.hdr.boot_flag = BOOT_FLAG_MAGIC;
    params.hdr.header = HDR_MAGIC;
    params.hdr.cmd_line_ptr = CMDLINE as u32;
    params.hdr.cmdline_size = (boot.cmdline.len() + 1) as u32;
    params.hdr.kernel_alignment = KERNEL_MIN as u32;
    if let Some(initrd) = &boot.initrd {
        let size = initrd.len() as u64;
        let top = low_end.min(crate::linux::INITRD_MAX_END);
        let addr = top.checked_sub(size).map(|a| a & !0xfff).filter(|&a| a >= kernel_end);
        let Some(addr) = addr else {
            return Err(ArchError::ImageDoesNotFit {
                what: "initrd",
                start: kernel_end,
                end: top,
                why: format!("{} MiB do not fit above the kernel", size >> 20),
            });
        };
        mem.write_slice(initrd, GuestAddress(addr)).map_err(mem_err)?;
        params.hdr.ramdisk_image = addr as u32;
        params.hdr.ramdisk_size = size as u32;
    }
    let e820 = e820_map(memory.regions());
    if e820.len() > params.e820_table.len() {
        return Err(mem_err("too many memory regions for the zero page's e820 table"));
    }
    params.e820_entries = e820.len() as u8;
    params.e820_table[..e820.len()].copy_from_slice(&e820);
    LinuxBootConfigurator::write_bootparams::<nl_memory::GuestMem>(
        &BootParams::new::<boot_params>(&params, GuestAddress(ZERO_PAGE)),
        mem,
    )
    .map_err(mem_err)?;
    Ok(entry)
}

/// Initrds stay below 2 GiB minus a page (initrd_addr_max of old kernels).
pub const INITRD_MAX_END: u64 = 0x7fff_f000;

/// Reads the zero page back (tests, state checks).
pub fn read_boot_params(mem: &nl_memory::GuestMem) -> Result<boot_params, ArchError> {
    mem.read_obj(GuestAddress(ZERO_PAGE)).map_err(mem_err)
}

/// CPUID leaf 1 ECX features a Linux guest must not see on PVM: its ring-0
/// emulator cannot run `cmpxchg16b` (CX16) nor `xsave`/`xrstor` and the
/// AVX family (XSAVE, OSXSAVE, AVX, FMA, F16C).
const LEAF1_ECX_HIDDEN: u32 = (1 << 12) | (1 << 13) | (1 << 26) | (1 << 27) | (1 << 28) | (1 << 29);
/// Leaf 7 EBX: AVX2, SMAP (the emulator stops on `clac`), AVX-512 (F, DQ,
/// IFMA, PF, ER, CD, BW, VL).
const LEAF7_EBX_HIDDEN: u32 = (1 << 5)
    | (1 << 20)
    | (1 << 16)
    | (1 << 17)
    | (1 << 21)
    | (1 << 26)
    | (1 << 27)
    | (1 << 28)
    | (1 << 30)
    | (1 << 31);
/// Leaf 7 ECX: AVX-512 VBMI, VBMI2, VNNI, BITALG, VPOPCNTDQ; VAES, VPCLMULQDQ.
const LEAF7_ECX_HIDDEN: u32 =
    (1 << 1) | (1 << 6) | (1 << 9) | (1 << 10) | (1 << 11) | (1 << 12) | (1 << 14);
/// Leaf 7 EDX: AVX-512 4VNNIW, 4FMAPS, VP2INTERSECT, FP16; AMX.
const LEAF7_EDX_HIDDEN: u32 = (1 << 2) | (1 << 3) | (1 << 8) | (1 << 22) | (1 << 23) | (1 << 24);

/// Kernel parameters a Linux guest needs on PVM, whose ring-0 emulator
/// cannot run `xsave`/`xrstor`, `clac`/`stac`, `popcnt` nor `cmpxchg16b`,
/// and where the VMM's CPUID mask does not reach the kernel's view of
/// those features (measured: with SMAP hidden from CPUID the kernel still
/// patched in `clac`). `clearcpuid=` (Linux 5.19 and later take names) and
/// `noxsave` make the kernel itself not use them. (`nosmap` is not a 6.1
/// parameter: the kernel lists it as unknown.)
pub const PVM_CMDLINE: &str = "noxsave clearcpuid=smap,smep,popcnt,cx16";

/// The command line a Linux guest boots with: `user`, plus on PVM the
/// parameters of [`PVM_CMDLINE`] it does not already name.
pub fn boot_cmdline(user: &str, backend: crate::backend::Backend) -> String {
    if backend != crate::backend::Backend::Pvm {
        return user.to_string();
    }
    let mut s = user.trim_end().to_string();
    for p in PVM_CMDLINE.split(' ') {
        let key = p.split('=').next().unwrap_or(p);
        let named = s.split_whitespace().any(|w| w == key || w.starts_with(&format!("{key}=")));
        if !named {
            s.push(' ');
            s.push_str(p);
        }
    }
    s.trim_start().to_string()
}

/// Whether to hide what the PVM ring-0 emulator cannot run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuidPolicy {
    /// KVM's supported CPUID as it is (VMX/SVM run everything natively).
    AsSupported,
    /// Hide CX16, XSAVE and the AVX family, and clear leaf 0xd.
    PvmSafe,
}

/// The CPUID a Linux vCPU sees: KVM's supported CPUID with its APIC id and
/// x2APIC, and under [`CpuidPolicy::PvmSafe`] what PVM cannot emulate hidden.
pub fn linux_cpuid(supported: &CpuId, cpu: u64, policy: CpuidPolicy) -> CpuId {
    let mut cpuid = crate::regs::vcpu_cpuid(supported, cpu);
    if policy == CpuidPolicy::AsSupported {
        return cpuid;
    }
    for e in cpuid.as_mut_slice() {
        match (e.function, e.index) {
            (1, _) => e.ecx &= !LEAF1_ECX_HIDDEN,
            (7, 0) => {
                e.ebx &= !LEAF7_EBX_HIDDEN;
                e.ecx &= !LEAF7_ECX_HIDDEN;
                e.edx &= !LEAF7_EDX_HIDDEN;
            }
            (7, 1) => e.eax &= !((1 << 4) | (1 << 5)), // AVX-VNNI, AVX512-BF16
            (0xd, _) => {
                e.eax = 0;
                e.ebx = 0;
                e.ecx = 0;
                e.edx = 0;
            }
            _ => {}
        }
    }
    cpuid
}

fn segment(selector: u16, code: bool) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_: if code { 11 } else { 3 },
        present: 1,
        dpl: 0,
        db: u8::from(!code),
        s: 1,
        l: u8::from(code),
        g: 1,
        ..Default::default()
    }
}

/// Sets the boot vCPU's state for the 64-bit entry: long mode with the
/// identity map, the boot GDT, RSI = zero page. CR0/CR4/EFER are the values
/// PVM accepts (see [`crate::regs`]). The TR stays KVM's reset value (a
/// busy 64-bit TSS at 0, accepted by PVM and VMX alike).
pub fn setup_boot_vcpu(vcpu: &VcpuFd, entry: u64, cpuid: &CpuId) -> Result<(), ArchError> {
    let fail = |what| move |err| ArchError::VcpuSetup { what, err };
    vcpu.set_cpuid2(cpuid).map_err(fail("CPUID"))?;
    let mut s = vcpu.get_sregs().map_err(fail("get sregs"))?;
    s.cr0 = crate::regs::CR0;
    s.cr3 = PML4;
    s.cr4 = crate::regs::CR4;
    s.efer = crate::regs::EFER;
    s.cs = segment(SEL_CODE, true);
    let data = segment(SEL_DATA, false);
    s.ds = data;
    s.es = data;
    s.fs = data;
    s.gs = data;
    s.ss = data;
    s.gdt.base = BOOT_GDT;
    s.gdt.limit = 4 * 8 - 1;
    s.idt.base = BOOT_IDT;
    s.idt.limit = 7;
    vcpu.set_sregs(&s).map_err(fail("sregs (CR0/CR4/EFER/segments)"))?;
    let regs = kvm_regs {
        rip: entry,
        rsp: BOOT_STACK,
        rbp: BOOT_STACK,
        rsi: ZERO_PAGE,
        rflags: 0x2,
        ..Default::default()
    };
    vcpu.set_regs(&regs).map_err(fail("regs"))?;
    // xAPIC enabled, BSP. Not x2APIC: a kernel finding x2APIC enabled by
    // firmware but no ACPI MADT keeps the xAPIC driver and reads its MMIO
    // page, which it has not mapped (an oops in native_apic_mem_read).
    let apic_base = 0xfee0_0000 | (1 << 11) | (1 << 8);
    let msrs = Msrs::from_entries(&[
        kvm_msr_entry { index: MSR_IA32_APICBASE, data: apic_base, ..Default::default() },
        // Fast strings enabled, as firmware leaves it.
        kvm_msr_entry { index: MSR_IA32_MISC_ENABLE, data: 1, ..Default::default() },
    ])
    .expect("two MSR entries fit");
    let n = vcpu.set_msrs(&msrs).map_err(fail("MSRs"))?;
    if n != 2 {
        return Err(ArchError::VcpuSetup {
            what: "MSRs (APIC base, MISC_ENABLE)",
            err: kvm_ioctls::Error::new(22),
        });
    }
    Ok(())
}

/// Sets up an application processor of a Linux VM: its CPUID (the APIC id
/// in it is the vCPU's) and the wait-for-SIPI state
/// (`KVM_MP_STATE_INIT_RECEIVED`). The kernel starts it with INIT and
/// SIPI through the in-kernel LAPIC, in real mode at its trampoline.
pub fn setup_ap_vcpu(vcpu: &VcpuFd, cpuid: &CpuId) -> Result<(), ArchError> {
    let fail = |what| move |err| ArchError::VcpuSetup { what, err };
    vcpu.set_cpuid2(cpuid).map_err(fail("CPUID"))?;
    vcpu.set_mp_state(kvm_bindings::kvm_mp_state {
        mp_state: kvm_bindings::KVM_MP_STATE_INIT_RECEIVED,
    })
    .map_err(fail("MP state (wait for SIPI)"))
}

/// Guest symbols from a System.map (`address type name` lines).
#[derive(Clone, Debug, Default)]
pub struct SystemMap(Vec<(u64, String)>);

impl SystemMap {
    pub fn parse(text: &str) -> Self {
        let mut v: Vec<(u64, String)> = text
            .lines()
            .filter_map(|l| {
                let mut it = l.split_whitespace();
                let addr = u64::from_str_radix(it.next()?, 16).ok()?;
                let kind = it.next()?;
                let name = it.next()?;
                matches!(kind, "t" | "T" | "w" | "W").then(|| (addr, name.to_string()))
            })
            .collect();
        v.sort();
        Self(v)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `symbol+0xoff` for a code address, if one precedes it.
    pub fn symbolize(&self, addr: u64) -> Option<String> {
        let i = self.0.partition_point(|(a, _)| *a <= addr);
        let (a, name) = self.0.get(i.checked_sub(1)?)?;
        Some(format!("{name}+{:#x}", addr - a))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn virtio_mmio_devices_are_announced_on_the_command_line() {
        let d = [
            VirtioMmio { base: 0xd000_4000, size: 0x1000, irq: 5 },
            VirtioMmio { base: 0xd000_5000, size: 0x1000, irq: 6 },
        ];
        assert_eq!(
            with_virtio_mmio("console=ttyS0", &d).unwrap(),
            "console=ttyS0 virtio_mmio.device=4K@0xd0004000:5 virtio_mmio.device=4K@0xd0005000:6"
        );
        assert_eq!(with_virtio_mmio("quiet", &[]).unwrap(), "quiet");
        let long = "x".repeat(CMDLINE_MAX - 10);
        assert!(with_virtio_mmio(&long, &d).unwrap_err().to_string().contains("virtio-mmio"));
    }

    #[test]
    fn pvm_parameters_are_added_once_and_only_on_pvm() {
        use crate::backend::Backend;
        assert_eq!(boot_cmdline("console=ttyS0", Backend::Vmx), "console=ttyS0");
        assert_eq!(
            boot_cmdline("console=ttyS0", Backend::Pvm),
            "console=ttyS0 noxsave clearcpuid=smap,smep,popcnt,cx16"
        );
        // A parameter the user gave is kept as given.
        assert_eq!(
            boot_cmdline("noxsave clearcpuid=smap console=ttyS0", Backend::Pvm),
            "noxsave clearcpuid=smap console=ttyS0"
        );
    }

    #[test]
    fn kinds_are_told_apart() {
        let mut bz = vec![0u8; 0x300];
        bz[0x1fe] = 0x55;
        bz[0x1ff] = 0xaa;
        bz[0x202..0x206].copy_from_slice(b"HdrS");
        assert_eq!(image_kind(&bz), ImageKind::BzImage);
        let mut elf = b"\x7fELF".to_vec();
        elf.extend_from_slice(&[0; 64]);
        assert_eq!(image_kind(&elf), ImageKind::Other);
        elf.extend_from_slice(b"Linux version 6.1");
        assert_eq!(image_kind(&elf), ImageKind::Vmlinux);
        assert!(prepare(b"garbage").is_err());
    }

    #[test]
    fn a_bzimage_with_a_bad_payload_is_refused_with_a_reason() {
        let mut bz = vec![0u8; 0x2000];
        bz[0x1fe] = 0x55;
        bz[0x1ff] = 0xaa;
        bz[0x202..0x206].copy_from_slice(b"HdrS");
        bz[0x206..0x208].copy_from_slice(&0x20fu16.to_le_bytes()); // version
        bz[0x1f1] = 1; // setup_sects
        bz[0x248..0x24c].copy_from_slice(&0x10u32.to_le_bytes()); // payload_offset
        bz[0x24c..0x250].copy_from_slice(&0x100000u32.to_le_bytes()); // payload_length
        let e = decompress_bzimage(&bz).err().expect("refused").to_string();
        assert!(e.contains("outside the bzImage"), "{e}");
        bz[0x24c..0x250].copy_from_slice(&0x100u32.to_le_bytes());
        let e = decompress_bzimage(&bz).err().expect("refused").to_string();
        assert!(e.contains("not xz"), "{e}");
    }

    #[test]
    fn e820_leaves_out_the_bios_area_and_the_hole() {
        let regions = nl_memory::layout(4 << 30);
        let m = e820_map(&regions);
        let m: Vec<(u64, u64)> = m.iter().map(|e| (e.addr, e.size)).collect();
        assert_eq!(m[0], (0, EBDA_START));
        assert_eq!(m[1].0, HIMEM_START);
        assert_eq!(m[1].0 + m[1].1, nl_abi::MMIO_HOLE_START);
        assert_eq!(m.iter().map(|e| e.1).sum::<u64>(), (4 << 30) - HIMEM_START + EBDA_START);
    }

    #[test]
    fn pvm_policy_hides_cx16_xsave_avx_and_leaf_0xd() {
        let supported = CpuId::from_entries(&[
            kvm_bindings::kvm_cpuid_entry2 { function: 1, ecx: u32::MAX, ..Default::default() },
            kvm_bindings::kvm_cpuid_entry2 { function: 7, ebx: u32::MAX, ..Default::default() },
            kvm_bindings::kvm_cpuid_entry2 { function: 0xd, eax: 7, ..Default::default() },
        ])
        .unwrap();
        let c = linux_cpuid(&supported, 0, CpuidPolicy::PvmSafe);
        let e = c.as_slice();
        assert_eq!(e[0].ecx & (1 << 13), 0, "CX16");
        assert_eq!(e[0].ecx & (1 << 26), 0, "XSAVE");
        assert_eq!(e[0].ecx & (1 << 28), 0, "AVX");
        assert_ne!(e[0].ecx & (1 << 21), 0, "x2APIC stays");
        assert_ne!(e[0].ecx & 1, 0, "SSE3 stays");
        assert_eq!(e[1].ebx & (1 << 5), 0, "AVX2");
        assert_eq!(e[2].eax, 0, "leaf 0xd");
        let c = linux_cpuid(&supported, 0, CpuidPolicy::AsSupported);
        assert_ne!(c.as_slice()[0].ecx & (1 << 13), 0);
    }

    #[test]
    fn system_map_symbolizes() {
        let m = SystemMap::parse(
            "ffffffff81000000 T _text\nffffffff81000100 T startup_64\nffffffff82000000 D data\n",
        );
        assert_eq!(m.symbolize(0xffff_ffff_8100_0105).as_deref(), Some("startup_64+0x5"));
        assert_eq!(m.symbolize(0x10), None);
    }
}
