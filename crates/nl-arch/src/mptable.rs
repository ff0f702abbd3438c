//! An Intel MultiProcessor table (MP specification 1.4) for a Linux guest
//! with more than one vCPU: without ACPI, it is how the kernel learns its
//! processors (their local APIC ids), the IOAPIC and how ISA interrupts
//! reach it.
//!
//! The floating pointer structure (`_MP_`) and the configuration table
//! (`PCMP`) right after it go at [`MPTABLE_START`] (0x9fc00: the last KiB
//! below 640 KiB, one of the ranges Linux's `smp_scan_config` searches),
//! which the e820 map ([`crate::linux::e820_map`]) leaves out of RAM.
//!
//! Entries: one processor per vCPU (APIC ids 0..N, the boot flag on 0),
//! bus 0 = ISA, the IOAPIC of KVM's in-kernel irqchip at 0xfec00000 with
//! id N, an I/O interrupt entry per ISA IRQ 0-15 (IOAPIC pin = IRQ, KVM's
//! default GSI routing) and per further line given (virtio-mmio), and the
//! local interrupts (ExtINT on LINT0 of the BSP, NMI on LINT1 of all).
//!
//! No crate on crates.io writes these for a vm-memory 0.18 guest: the
//! Firecracker and cloud-hypervisor modules are not published, and
//! `dbs-boot` brings its own vm-memory and Dragonball's layout.

use vm_memory::{ByteValued, Bytes, GuestAddress};

use crate::ArchError;

/// Where the floating pointer goes (the configuration table follows it).
pub const MPTABLE_START: u64 = 0x9fc00;
/// The end of the range the table must fit in (the VGA hole starts here).
pub const MPTABLE_END: u64 = 0xa0000;
/// Most vCPUs the table describes.
pub const MAX_CPUS: u32 = 32;
/// The default local APIC base.
pub const APIC_DEFAULT_PHYS_BASE: u32 = 0xfee0_0000;
/// Where KVM's in-kernel IOAPIC sits.
pub const IO_APIC_DEFAULT_PHYS_BASE: u32 = 0xfec0_0000;
/// ISA IRQs routed through the IOAPIC (pins 0-15).
pub const ISA_IRQS: u8 = 16;
/// Pins of KVM's IOAPIC.
pub const IOAPIC_PINS: u32 = 24;

const SMP_MAGIC: [u8; 4] = *b"_MP_";
const MPC_SIGNATURE: [u8; 4] = *b"PCMP";
const MPC_SPEC: u8 = 4;
const MP_PROCESSOR: u8 = 0;
const MP_BUS: u8 = 1;
const MP_IOAPIC: u8 = 2;
const MP_INTSRC: u8 = 3;
const MP_LINTSRC: u8 = 4;
const CPU_ENABLED: u8 = 1;
const CPU_BOOTPROCESSOR: u8 = 2;
const APIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
const MPC_APIC_USABLE: u8 = 1;
const MP_IRQ_INT: u8 = 0;
const MP_IRQ_NMI: u8 = 1;
const MP_IRQ_EXTINT: u8 = 3;
/// Polarity and trigger "conform to the bus" (ISA: active high, edge).
const MP_IRQDIR_DEFAULT: u16 = 0;
const BUS_ID_ISA: u8 = 0;
/// Family 6 (stepping/model/family signature of the processor entries).
const CPU_SIGNATURE: u32 = 0x600;
/// CPUID.1 EDX: FPU and APIC.
const CPU_FEATURES: u32 = (1 << 0) | (1 << 9);

/// The MP floating pointer structure (16 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MpfIntel {
    pub signature: [u8; 4],
    pub physptr: u32,
    pub length: u8,
    pub specification: u8,
    pub checksum: u8,
    pub feature1: u8,
    pub feature2: u8,
    pub feature3: u8,
    pub feature4: u8,
    pub feature5: u8,
}

/// The configuration table header (44 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MpcTable {
    pub signature: [u8; 4],
    pub length: u16,
    pub spec: u8,
    pub checksum: u8,
    pub oem: [u8; 8],
    pub productid: [u8; 12],
    pub oemptr: u32,
    pub oemsize: u16,
    pub oemcount: u16,
    pub lapic: u32,
    pub reserved: u32,
}

/// A processor entry (20 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MpcCpu {
    pub type_: u8,
    pub apicid: u8,
    pub apicver: u8,
    pub cpuflag: u8,
    pub cpufeature: u32,
    pub featureflag: u32,
    pub reserved: [u32; 2],
}

/// A bus entry (8 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MpcBus {
    pub type_: u8,
    pub busid: u8,
    pub bustype: [u8; 6],
}

/// An IOAPIC entry (8 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MpcIoapic {
    pub type_: u8,
    pub apicid: u8,
    pub apicver: u8,
    pub flags: u8,
    pub apicaddr: u32,
}

/// An I/O interrupt entry (8 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MpcIntsrc {
    pub type_: u8,
    pub irqtype: u8,
    pub irqflag: u16,
    pub srcbus: u8,
    pub srcbusirq: u8,
    pub dstapic: u8,
    pub dstirq: u8,
}

/// A local interrupt entry (8 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MpcLintsrc {
    pub type_: u8,
    pub irqtype: u8,
    pub irqflag: u16,
    pub srcbusid: u8,
    pub srcbusirq: u8,
    pub destapic: u8,
    pub destapiclint: u8,
}

// The layouts have no padding (every field at its natural alignment): the
// sizes are the specification's.
const _: () = assert!(std::mem::size_of::<MpfIntel>() == 16);
const _: () = assert!(std::mem::size_of::<MpcTable>() == 44);
const _: () = assert!(std::mem::size_of::<MpcCpu>() == 20);
const _: () = assert!(std::mem::size_of::<MpcBus>() == 8);
const _: () = assert!(std::mem::size_of::<MpcIoapic>() == 8);
const _: () = assert!(std::mem::size_of::<MpcIntsrc>() == 8);
const _: () = assert!(std::mem::size_of::<MpcLintsrc>() == 8);

// SAFETY: repr(C) structs of integers and byte arrays without padding
// (sizes asserted above): every byte pattern is a valid value.
unsafe impl ByteValued for MpfIntel {}
// SAFETY: as above.
unsafe impl ByteValued for MpcTable {}
// SAFETY: as above.
unsafe impl ByteValued for MpcCpu {}
// SAFETY: as above.
unsafe impl ByteValued for MpcBus {}
// SAFETY: as above.
unsafe impl ByteValued for MpcIoapic {}
// SAFETY: as above.
unsafe impl ByteValued for MpcIntsrc {}
// SAFETY: as above.
unsafe impl ByteValued for MpcLintsrc {}

/// The byte that makes `bytes` sum to 0 (mod 256) when put in its
/// checksum field (which must hold 0 while summing).
pub fn checksum(bytes: &[u8]) -> u8 {
    bytes.iter().fold(0u8, |s, b| s.wrapping_add(*b)).wrapping_neg()
}

/// The IOAPIC's id: the one after the CPUs'.
pub fn ioapic_id(num_cpus: u32) -> u8 {
    num_cpus as u8
}

/// The floating pointer and configuration table for `num_cpus` vCPUs as
/// they go at [`MPTABLE_START`]; `extra_irqs` are further IOAPIC lines
/// (virtio-mmio) to announce besides ISA IRQs 0-15.
pub fn build(num_cpus: u32, extra_irqs: &[u32]) -> Result<Vec<u8>, ArchError> {
    if num_cpus == 0 || num_cpus > MAX_CPUS {
        return Err(ArchError::MpTable(format!(
            "{num_cpus} vCPUs: a Linux guest's MP table describes 1 to {MAX_CPUS}"
        )));
    }
    if let Some(irq) = extra_irqs.iter().find(|&&i| i >= IOAPIC_PINS) {
        return Err(ArchError::MpTable(format!(
            "interrupt line {irq} is beyond the IOAPIC's {IOAPIC_PINS} pins"
        )));
    }
    let ioapic = ioapic_id(num_cpus);
    let mut entries: Vec<u8> = Vec::new();
    let mut count: u16 = 0;
    let mut push = |bytes: &[u8]| {
        entries.extend_from_slice(bytes);
        count += 1;
    };
    for cpu in 0..num_cpus {
        let flag = if cpu == 0 { CPU_ENABLED | CPU_BOOTPROCESSOR } else { CPU_ENABLED };
        push(
            MpcCpu {
                type_: MP_PROCESSOR,
                apicid: cpu as u8,
                apicver: APIC_VERSION,
                cpuflag: flag,
                cpufeature: CPU_SIGNATURE,
                featureflag: CPU_FEATURES,
                reserved: [0; 2],
            }
            .as_slice(),
        );
    }
    push(MpcBus { type_: MP_BUS, busid: BUS_ID_ISA, bustype: *b"ISA   " }.as_slice());
    push(
        MpcIoapic {
            type_: MP_IOAPIC,
            apicid: ioapic,
            apicver: IOAPIC_VERSION,
            flags: MPC_APIC_USABLE,
            apicaddr: IO_APIC_DEFAULT_PHYS_BASE,
        }
        .as_slice(),
    );
    let mut lines: Vec<u8> = (0..ISA_IRQS).collect();
    for &i in extra_irqs {
        if !lines.contains(&(i as u8)) {
            lines.push(i as u8);
        }
    }
    for irq in lines {
        push(
            MpcIntsrc {
                type_: MP_INTSRC,
                irqtype: MP_IRQ_INT,
                irqflag: MP_IRQDIR_DEFAULT,
                srcbus: BUS_ID_ISA,
                srcbusirq: irq,
                dstapic: ioapic,
                dstirq: irq,
            }
            .as_slice(),
        );
    }
    // The 8259's output on the BSP's LINT0 (virtual wire), NMI on LINT1.
    push(
        MpcLintsrc {
            type_: MP_LINTSRC,
            irqtype: MP_IRQ_EXTINT,
            irqflag: MP_IRQDIR_DEFAULT,
            srcbusid: BUS_ID_ISA,
            srcbusirq: 0,
            destapic: 0,
            destapiclint: 0,
        }
        .as_slice(),
    );
    push(
        MpcLintsrc {
            type_: MP_LINTSRC,
            irqtype: MP_IRQ_NMI,
            irqflag: MP_IRQDIR_DEFAULT,
            srcbusid: BUS_ID_ISA,
            srcbusirq: 0,
            destapic: 0xff,
            destapiclint: 1,
        }
        .as_slice(),
    );

    let fp_len = std::mem::size_of::<MpfIntel>();
    let table_len = std::mem::size_of::<MpcTable>() + entries.len();
    let total = fp_len + table_len;
    if total as u64 > MPTABLE_END - MPTABLE_START {
        return Err(ArchError::MpTable(format!(
            "the MP table takes {total} bytes; {} fit below 640 KiB",
            MPTABLE_END - MPTABLE_START
        )));
    }
    let mut header = MpcTable {
        signature: MPC_SIGNATURE,
        length: table_len as u16,
        spec: MPC_SPEC,
        checksum: 0,
        oem: *b"NINELIVE",
        productid: *b"000000000000",
        oemptr: 0,
        oemsize: 0,
        oemcount: count,
        lapic: APIC_DEFAULT_PHYS_BASE,
        reserved: 0,
    };
    let mut table = header.as_slice().to_vec();
    table.extend_from_slice(&entries);
    header.checksum = checksum(&table);
    table[..std::mem::size_of::<MpcTable>()].copy_from_slice(header.as_slice());

    let mut fp = MpfIntel {
        signature: SMP_MAGIC,
        physptr: (MPTABLE_START + fp_len as u64) as u32,
        length: 1,
        specification: MPC_SPEC,
        ..Default::default()
    };
    fp.checksum = checksum(fp.as_slice());
    let mut out = fp.as_slice().to_vec();
    out.extend_from_slice(&table);
    Ok(out)
}

/// Writes the MP table for `num_cpus` vCPUs (and `extra_irqs`) at
/// [`MPTABLE_START`].
pub fn write(
    mem: &nl_memory::GuestMem,
    num_cpus: u32,
    extra_irqs: &[u32],
) -> Result<(), ArchError> {
    let bytes = build(num_cpus, extra_irqs)?;
    mem.write_slice(&bytes, GuestAddress(MPTABLE_START))
        .map_err(|e| ArchError::GuestMemory(format!("MP table: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(b: &[u8]) -> u8 {
        b.iter().fold(0u8, |s, x| s.wrapping_add(*x))
    }

    /// The table parsed back: (floating pointer, header, entries by type).
    fn parse(bytes: &[u8]) -> (MpfIntel, MpcTable, Vec<(u8, Vec<u8>)>) {
        let fp = *MpfIntel::from_slice(&bytes[..16]).unwrap();
        let off = (fp.physptr as u64 - MPTABLE_START) as usize;
        let h = *MpcTable::from_slice(&bytes[off..off + 44]).unwrap();
        let mut entries = Vec::new();
        let mut p = off + 44;
        for _ in 0..h.oemcount {
            let len = if bytes[p] == MP_PROCESSOR { 20 } else { 8 };
            entries.push((bytes[p], bytes[p..p + len].to_vec()));
            p += len;
        }
        assert_eq!(p, off + h.length as usize, "the entries fill the table's length");
        (fp, h, entries)
    }

    #[test]
    fn floating_pointer_and_table_check_out() {
        for n in [1, 2, 4, MAX_CPUS] {
            let b = build(n, &[5, 6]).unwrap();
            let (fp, h, entries) = parse(&b);
            assert_eq!(&fp.signature, b"_MP_");
            assert_eq!(fp.length, 1, "in 16-byte units");
            assert_eq!(fp.specification, 4);
            assert_eq!(fp.physptr as u64, MPTABLE_START + 16);
            assert_eq!(fp.feature1, 0, "a configuration table is present");
            assert_eq!(sum(&b[..16]), 0, "floating pointer checksum");
            assert_eq!(&h.signature, b"PCMP");
            assert_eq!(h.spec, 4);
            assert_eq!(h.lapic, 0xfee0_0000);
            assert_eq!(sum(&b[16..16 + h.length as usize]), 0, "table checksum");
            assert_eq!(b.len(), 16 + h.length as usize);
            assert!(MPTABLE_START + b.len() as u64 <= MPTABLE_END);
            let count = |t| entries.iter().filter(|(k, _)| *k == t).count();
            assert_eq!(count(MP_PROCESSOR), n as usize);
            assert_eq!(count(MP_BUS), 1);
            assert_eq!(count(MP_IOAPIC), 1);
            // ISA 0-15 (5 and 6, the virtio lines, among them).
            assert_eq!(count(MP_INTSRC), 16);
            assert_eq!(count(MP_LINTSRC), 2);
            assert_eq!(entries.len(), h.oemcount as usize);
        }
    }

    #[test]
    fn processors_have_apic_ids_0_to_n_and_only_0_boots() {
        let n = 5;
        let (_, _, entries) = parse(&build(n, &[]).unwrap());
        let cpus: Vec<MpcCpu> = entries
            .iter()
            .filter(|(k, _)| *k == MP_PROCESSOR)
            .map(|(_, e)| *MpcCpu::from_slice(e).unwrap())
            .collect();
        assert_eq!(cpus.iter().map(|c| u32::from(c.apicid)).collect::<Vec<_>>(), [0, 1, 2, 3, 4]);
        for c in &cpus {
            assert_eq!(c.cpuflag & CPU_ENABLED, CPU_ENABLED);
            assert_eq!(c.cpuflag & CPU_BOOTPROCESSOR != 0, c.apicid == 0, "{c:?}");
        }
        let io: Vec<MpcIoapic> = entries
            .iter()
            .filter(|(k, _)| *k == MP_IOAPIC)
            .map(|(_, e)| *MpcIoapic::from_slice(e).unwrap())
            .collect();
        assert_eq!(io[0].apicid, 5, "the IOAPIC's id follows the CPUs'");
        assert_eq!(io[0].apicaddr, 0xfec0_0000);
        let src: Vec<MpcIntsrc> = entries
            .iter()
            .filter(|(k, _)| *k == MP_INTSRC)
            .map(|(_, e)| *MpcIntsrc::from_slice(e).unwrap())
            .collect();
        for (i, s) in src.iter().enumerate() {
            assert_eq!((s.srcbusirq as usize, s.dstirq as usize, s.dstapic), (i, i, 5));
        }
    }

    #[test]
    fn lines_above_isa_get_entries_and_bad_counts_are_refused() {
        let (_, _, entries) = parse(&build(2, &[5, 17]).unwrap());
        let src: Vec<u8> = entries
            .iter()
            .filter(|(k, _)| *k == MP_INTSRC)
            .map(|(_, e)| MpcIntsrc::from_slice(e).unwrap().dstirq)
            .collect();
        assert_eq!(src.len(), 17);
        assert_eq!(src.last(), Some(&17));
        assert!(build(0, &[]).unwrap_err().to_string().contains("1 to 32"));
        assert!(build(33, &[]).unwrap_err().to_string().contains("1 to 32"));
        assert!(build(2, &[24]).unwrap_err().to_string().contains("24 pins"));
    }

    #[test]
    fn the_table_lands_where_e820_has_no_ram() {
        let mem = nl_memory::GuestMemory::new("mptable-test", 64 << 20).unwrap();
        write(mem.mem(), 2, &[]).unwrap();
        let mut sig = [0u8; 4];
        mem.mem().read_slice(&mut sig, GuestAddress(MPTABLE_START)).unwrap();
        assert_eq!(&sig, b"_MP_");
        for e in crate::linux::e820_map(mem.regions()) {
            let (a, end) = (e.addr, e.addr + e.size);
            assert!(end <= MPTABLE_START || a >= MPTABLE_END, "RAM {a:#x}..{end:#x}");
        }
    }
}
