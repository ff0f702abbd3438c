//! The contract between the ninelives VMM (the host side) and the reference
//! guest (kernel in ring 0, workloads in ring 3).
//!
//! Everything both sides must agree on lives here and nowhere else: the guest
//! physical memory layout, the [`BootInfo`] page the VMM fills in as the
//! "bootloader", the initial vCPU state, the syscall numbers, and the register
//! map of the paravirtual control device.
//!
//! Guest virtual addresses equal guest physical addresses (identity map built
//! by the VMM). Ranges below [`USER_BASE`] are supervisor-only (no U bit, so
//! ring 3 cannot touch them and SMEP keeps ring 0 off user pages); everything
//! from [`USER_BASE`] to the end of RAM, the boot-info page (read-only) and the
//! control device page carry the U bit.
#![no_std]

// ---------------------------------------------------------------------------
// Guest physical memory layout
// ---------------------------------------------------------------------------

/// Boot information page ([`BootInfo`]), written by the VMM before the first
/// instruction. Mapped read-only and user-accessible.
pub const BOOT_INFO_GPA: u64 = 0x1000;
/// Shared interrupt descriptor table (256 x 16 bytes), zeroed by the VMM and
/// filled by the kernel.
pub const IDT_GPA: u64 = 0x2000;
/// Per-vCPU area: GDT at offset 0, TSS at [`CPU_AREA_TSS_OFFSET`], per-CPU
/// kernel data ([`PerCpu`]) at [`CPU_AREA_PERCPU_OFFSET`].
pub const CPU_AREA_GPA: u64 = 0x10000;
pub const CPU_AREA_SIZE: u64 = 0x1000;
pub const CPU_AREA_TSS_OFFSET: u64 = 0x80;
pub const CPU_AREA_PERCPU_OFFSET: u64 = 0x100;
/// Most vCPUs a VM may have.
pub const MAX_VCPUS: u32 = 32;
/// Page tables built by the VMM live in [PAGE_TABLES_GPA, LOW_END).
pub const PAGE_TABLES_GPA: u64 = 0x40000;
/// End of the low area mapped with 4 KiB pages.
pub const LOW_END: u64 = 0x20_0000;
/// The kernel ELF is linked and loaded here (supervisor-only).
pub const KERNEL_BASE: u64 = 0x20_0000;
/// Per-vCPU kernel stacks, [`KERNEL_STACK_SIZE`] each; vCPU i's stack top is
/// `KERNEL_STACKS_GPA + (i + 1) * KERNEL_STACK_SIZE`.
pub const KERNEL_STACKS_GPA: u64 = 0x60_0000;
pub const KERNEL_STACK_SIZE: u64 = 0x4000;
/// First user-accessible address; the user ELF is linked and loaded here.
pub const USER_BASE: u64 = 0x80_0000;
/// Per-vCPU user stacks, [`USER_STACK_SIZE`] each (top = base + (i+1)*size).
pub const USER_STACKS_GPA: u64 = 0x100_0000;
pub const USER_STACK_SIZE: u64 = 0x4_0000;
/// Start of the user heap: the workloads' working sets are carved from here.
pub const USER_HEAP_GPA: u64 = 0x200_0000;
/// Smallest guest memory the layout needs (heap of at least 1 MiB plus the
/// device DMA area).
pub const MIN_MEM_BYTES: u64 = USER_HEAP_GPA + 0x20_0000;
/// RAM above this address is placed at [`HIGH_RAM_GPA`] and up.
pub const MMIO_HOLE_START: u64 = 0xC000_0000;
pub const HIGH_RAM_GPA: u64 = 0x1_0000_0000;
/// Most guest memory supported by the page-table layout.
pub const MAX_MEM_BYTES: u64 = 64 << 30;

// ---------------------------------------------------------------------------
// Initial vCPU state (set by the VMM with KVM_SET_SREGS / REGS / MSRS)
// ---------------------------------------------------------------------------
//
// * 64-bit long mode, CPL 0, RIP = kernel ELF entry, RFLAGS = 0x2 (IF clear).
// * RSP = this vCPU's kernel stack top, RDI = vCPU index, RSI = BOOT_INFO_GPA.
// * GDTR = this vCPU's CPU area (limit GDT_LIMIT); TR = SEL_TSS, a 64-bit busy
//   TSS at CPU area + CPU_AREA_TSS_OFFSET whose RSP0 = the kernel stack top.
// * IDTR = IDT_GPA, limit 0xfff (all gates not present until the kernel fills them).
// * GS_BASE = this vCPU's PerCpu, KERNEL_GS_BASE = 0 (kernel swaps before user).
// * APIC_BASE MSR: enabled, x2APIC mode. The kernel programs the LAPIC timer
//   through x2APIC MSRs (LVT timer 0x832, initial count 0x838, divide 0x83e,
//   EOI 0x80b) with BootInfo::lapic_timer_count at divide-by-1 (0xb).
// * CR0 = PE|MP|ET|NE|WP|AM|PG, CR4 = PAE|FSGSBASE|OSFXSR|OSXMMEXCPT,
//   EFER = SCE|LME|LMA|NXE.

/// GDT selectors (the same GDT layout on every vCPU).
pub const SEL_KERNEL_CODE: u16 = 0x08;
pub const SEL_KERNEL_DATA: u16 = 0x10;
/// STAR[63:48]: SYSRET loads SS = this + 8 and CS = this + 16 (both RPL 3).
pub const SEL_SYSRET_BASE: u16 = 0x23;
pub const SEL_USER_DATA: u16 = 0x2b;
pub const SEL_USER_CODE: u16 = 0x33;
pub const SEL_TSS: u16 = 0x40;
pub const GDT_LIMIT: u16 = 0x4f;

/// Timer interrupt vector programmed into the LAPIC LVT timer.
pub const TIMER_VECTOR: u8 = 0x20;
/// Spurious interrupt vector.
pub const SPURIOUS_VECTOR: u8 = 0xff;

/// Per-vCPU kernel data, pointed to by GS base while in ring 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PerCpu {
    /// Kernel stack top for this vCPU (used by the syscall entry).
    pub kernel_rsp: u64,
    /// Scratch slot: user RSP saved by the syscall entry.
    pub user_rsp: u64,
    /// vCPU index.
    pub cpu: u64,
    /// Timer interrupts taken on this vCPU.
    pub ticks: u64,
    /// Device interrupts ([`NET_VECTOR`]) taken on this vCPU.
    pub net_irqs: u64,
}

// ---------------------------------------------------------------------------
// Syscalls: number in RAX, arguments in RDI, RSI; result in RAX.
//
// Ring 3 enters the kernel with `int3` (vector 3 is a DPL-3 gate into the
// syscall entry): on PVM the `syscall` instruction from guest ring 3 does not
// switch to ring 0, and `int 0x80` raises #UD, while exceptions through the IDT
// work. The `syscall` path (LSTAR/STAR/FMASK) is also set up for VMX/SVM.
// PVM also runs ring 3 with IOPL 0 whatever RFLAGS asks, so the user program
// checks its IOPL and falls back to SYS_OUTL for port output.
// ---------------------------------------------------------------------------

/// Wait (sti; hlt) until the next interrupt, then return to the caller.
pub const SYS_HALT: u64 = 0;
/// The workload is finished: the vCPU parks forever (cli; hlt).
pub const SYS_EXIT: u64 = 1;
/// Port output on behalf of ring 3: port in RDI, 32-bit value in RSI.
pub const SYS_OUTL: u64 = 2;
/// Timer ticks seen by this vCPU so far.
pub const SYS_TICKS: u64 = 3;
/// SYS_HALT unless the u16 at RDI (user memory, e.g. a used-ring index)
/// differs from SI: checked with interrupts off, so an interrupt that
/// changed it just before cannot be missed (a lost wake-up). Returns the
/// vCPU's timer ticks during the halt (0: another interrupt, such as a
/// doorbell or a received frame, ended it), or `u64::MAX` when it did not
/// halt.
pub const SYS_HALT_IF: u64 = 4;
/// [`PerCpu::net_irqs`]: device interrupts ([`NET_VECTOR`]) this vCPU took.
/// Read before and after [`SYS_HALT_IF`], it says whether one came during
/// the halt.
pub const SYS_NET_IRQS: u64 = 5;
/// The null syscall (what the `syscall` workload times): not a syscall
/// number, so the kernel answers [`SYS_ENOSYS`] at once.
pub const SYS_NULL: u64 = 0x4e55_4c4c;
/// Unknown syscall numbers return this.
pub const SYS_ENOSYS: u64 = u64::MAX;

// ---------------------------------------------------------------------------
// Paravirtual control device (MMIO, user-accessible page)
// ---------------------------------------------------------------------------

/// Base of the control device; vCPU i uses the 0x100-byte block at
/// `CONTROL_MMIO_GPA + i * CONTROL_BLOCK_SIZE`.
pub const CONTROL_MMIO_GPA: u64 = 0xD000_0000;
pub const CONTROL_BLOCK_SIZE: u64 = 0x100;
pub const CONTROL_MMIO_SIZE: u64 = CONTROL_BLOCK_SIZE * MAX_VCPUS as u64;

/// Register offsets inside a vCPU's block. All registers are 64-bit.
pub mod reg {
    /// R: [`super::CONTROL_MAGIC`].
    pub const MAGIC: u64 = 0x00;
    /// W: liveness; value = ops completed so far. Written at least every
    /// [`super::HEARTBEAT_MS`] while a workload runs.
    pub const HEARTBEAT: u64 = 0x08;
    /// W: one of the `PHASE_*` values.
    pub const PHASE: u64 = 0x10;
    /// W: ops completed in the measured period.
    pub const OPS: u64 = 0x18;
    /// W: the workload's result digest.
    pub const DIGEST: u64 = 0x20;
    /// W: a guest-detected error (`ERR_*`); the VMM treats it as fatal for the VM.
    pub const ERROR: u64 = 0x28;
    /// W: detail for the error (e.g. faulting RIP); write before ERROR.
    pub const ERROR_INFO: u64 = 0x30;
    /// W: TSC cycles spent in the measured period.
    pub const CYCLES: u64 = 0x38;
    /// W: workload rounds completed (warm-up round included).
    pub const ROUNDS: u64 = 0x40;
    /// RW: reads return the last value written (exercised by the `exits` workload).
    pub const SCRATCH: u64 = 0x48;
    /// W: low byte appended to the VM console.
    pub const PRINT: u64 = 0x50;
    /// W: ops completed in the warm-up round (excluded from the measured period).
    pub const WARMUP_OPS: u64 = 0x58;
    /// W: filecache: requests served from the in-memory cache so far
    /// (measured period), written with every heartbeat and at the end.
    pub const CACHE_HITS: u64 = 0x60;
    /// W: filecache: requests read from the disk so far (measured period),
    /// written with every heartbeat and at the end.
    pub const CACHE_MISSES: u64 = 0x68;
    /// W: netbench, kv: [`super::NET_VECTOR`] interrupts this vCPU took so
    /// far (written at the end of the run).
    pub const NET_IRQS: u64 = 0x70;
    /// W: with [`super::NET_RX_IRQ`]: the idle halts of the net poll that a
    /// [`super::NET_VECTOR`] interrupt ended with a frame received during
    /// the halt, i.e. woken by the VMM's receive path (written at the end
    /// of the run).
    pub const NET_IRQ_WAKES: u64 = 0x78;
    /// W: with [`super::NET_RX_IRQ`]: the other idle halts (ended by the
    /// timer tick, or by the interrupt of the guest's own notify; written
    /// at the end of the run).
    pub const NET_OTHER_WAKES: u64 = 0x80;
}

// ---------------------------------------------------------------------------
// virtio-mmio devices (virtio 1.x "modern" MMIO transport, version 2)
// ---------------------------------------------------------------------------
//
// They live in the same user-accessible 2 MiB device page as the control
// device, so the ring-3 driver reaches their registers directly. A queue
// notify (a write to QueueNotify) is processed synchronously by the VMM
// before the guest's write instruction completes, so a driver that notifies
// and then reads the used ring sees the completion without interrupts.

/// virtio-blk MMIO window (4 KiB, present when the VM has a disk).
pub const VIRTIO_BLK_MMIO_GPA: u64 = 0xD000_4000;
/// virtio-net MMIO window (4 KiB, present when the VM has a network device).
pub const VIRTIO_NET_MMIO_GPA: u64 = 0xD000_5000;
/// The virtio devices' interrupts: GSIs their irqfds are registered on.
/// KVM's default routing sends GSIs 16..=23 to IOAPIC pins 16..=23 only
/// (0..=15 also reach the 8259 PIC, whose reset state would deliver them
/// to a guest that never programmed it); the pins stay masked until the
/// guest programs their redirection entries.
pub const VIRTIO_BLK_GSI: u32 = 16;
pub const VIRTIO_NET_GSI: u32 = 17;
/// The vector the VMM routes the virtio-net interrupt to when it delivers
/// received frames itself (`BootInfo::has_net` = [`NET_RX_IRQ`]).
pub const NET_VECTOR: u8 = 0x21;
/// `BootInfo::has_net` value: a virtio-net device whose received frames
/// arrive without a notify and raise [`NET_VECTOR`]; the guest may halt
/// when idle.
pub const NET_RX_IRQ: u64 = 2;
/// `BootInfo::has_net` value: a spare virtio-net device (a standby
/// sandbox's): its link is down until the VMM attaches a TAP; the guest
/// waits for the link (config status) before it brings its service up.
pub const NET_STANDBY: u64 = 3;
pub const VIRTIO_MMIO_SIZE: u64 = 0x1000;

/// Bytes at the top of the user heap reserved for device rings and request
/// headers ([`BootInfo::dma_start`]..[`BootInfo::dma_end`]).
pub const DMA_BYTES: u64 = 0x10_0000;
/// Offsets inside the DMA area: virtio-blk queue 0 (descriptor table, avail
/// ring, used ring, each 4 KiB aligned) and its request header/status block.
pub const DMA_BLK_QUEUE: u64 = 0;
pub const DMA_BLK_REQ: u64 = 0x3000;
/// virtio-net: receive queue, transmit queue, then packet buffers.
pub const DMA_NET_RXQ: u64 = 0x1_0000;
pub const DMA_NET_TXQ: u64 = 0x1_3000;
pub const DMA_NET_BUFS: u64 = 0x2_0000;

/// Value of [`reg::MAGIC`]: "NINELIVE" in little-endian bytes.
pub const CONTROL_MAGIC: u64 = u64::from_le_bytes(*b"NINELIVE");

pub const PHASE_KERNEL_UP: u64 = 1;
/// Written as the very first action of the workload (boot-time mark).
pub const PHASE_WORKLOAD_START: u64 = 2;
/// Warm-up round done, working set mapped: the measured period starts.
pub const PHASE_MEASURE_START: u64 = 3;
/// OPS, CYCLES, ROUNDS and DIGEST are final.
pub const PHASE_DONE: u64 = 4;

/// Guest-detected errors written to [`reg::ERROR`].
/// An unhandled CPU exception: ERR_EXCEPTION_BASE + vector (ERROR_INFO = RIP).
pub const ERR_EXCEPTION_BASE: u64 = 0x100;
/// The workload's own self-check failed (ERROR_INFO = round number).
pub const ERR_SELF_CHECK: u64 = 0x200;
/// The boot info page was not valid.
pub const ERR_BAD_BOOT_INFO: u64 = 0x201;
/// The kernel panicked.
pub const ERR_KERNEL_PANIC: u64 = 0x202;
/// The user program panicked.
pub const ERR_USER_PANIC: u64 = 0x203;
/// A device the workload needs is missing or failed (ERROR_INFO = detail).
pub const ERR_DEVICE: u64 = 0x204;
/// ERR_DEVICE details (ERROR_INFO = DEVERR_* << 32 | detail).
pub const DEVERR_NO_BLK: u64 = 1;
/// Detail: the step of the virtio initialization that failed.
pub const DEVERR_BLK_INIT: u64 = 2;
/// Detail: the disk's size in MiB.
pub const DEVERR_BLK_SMALL: u64 = 3;
/// Detail: the number of failed requests.
pub const DEVERR_BLK_IO: u64 = 4;
pub const DEVERR_NO_NET: u64 = 5;
/// Detail: the step of the virtio initialization that failed.
pub const DEVERR_NET_INIT: u64 = 6;

/// A write to a read-only channel window (ERROR_INFO = guest-physical
/// address): set by the VMM, not the guest, when the sandbox's policy stops
/// it on an isolation violation.
pub const ERR_CHANNEL_VIOLATION: u64 = 0x205;

/// Heartbeat period the guest keeps while a workload runs.
pub const HEARTBEAT_MS: u64 = 10;

/// Port of the `exits` workload's port-I/O target (echo device): a 32-bit
/// `out` stores the value, a 32-bit `in` returns it with every bit inverted.
pub const EXITS_PORT: u16 = 0x510;
/// 16550 UART used as the console (vm-superio).
pub const SERIAL_PORT: u16 = 0x3f8;

// ---------------------------------------------------------------------------
// Boot information
// ---------------------------------------------------------------------------

pub const BOOT_MAGIC: u64 = u64::from_le_bytes(*b"9LIVBOOT");
pub const BOOT_VERSION: u64 = 2;

/// Workload kinds (`WorkloadParams::kind`).
pub const WORKLOAD_MEMWRITE: u64 = 1;
pub const WORKLOAD_COMPUTE: u64 = 2;
pub const WORKLOAD_EXITS: u64 = 3;
pub const WORKLOAD_IDLE: u64 = 4;
/// File operations on the virtio-blk disk (needs one vCPU and a disk).
pub const WORKLOAD_BLKBENCH: u64 = 5;
/// Answers UDP packets on [`NETBENCH_UDP_PORT`] with their payload
/// (needs one vCPU and a network device).
pub const WORKLOAD_NETBENCH: u64 = 6;
/// UDP port netbench echoes on.
pub const NETBENCH_UDP_PORT: u16 = 7;
/// A key-value server over TCP on [`KV_TCP_PORT`] (needs one vCPU and a
/// network device); its table lives in the working set.
pub const WORKLOAD_KV: u64 = 7;
/// TCP port the kv workload listens on.
pub const KV_TCP_PORT: u16 = 7000;
/// A file cache in the working set over a data set on the virtio-blk disk
/// (needs one vCPU and a disk of `data_bytes` plus a header).
pub const WORKLOAD_FILECACHE: u64 = 8;
/// Ping-pong and streaming over the sandbox's first channel
/// ([`BootInfo::channels`]); the end with `end == 0` leads. Self-verifying:
/// every payload is checked against what the peer must have sent.
pub const WORKLOAD_CHANBENCH: u64 = 9;
/// Random writes over everything the sandbox can reach from ring 3: its
/// user heap, its channels' own windows and their read-only peer windows
/// (test-only: the VMM must trap and count every write to a read-only
/// window, and nothing may reach another sandbox).
pub const WORKLOAD_WILDWRITE: u64 = 10;
/// A message service over every channel of the sandbox
/// (`nl_workloads::chanstream`): sends a checkable message every
/// `stride` µs and receives every `data_bytes` µs, for `duration_ms`
/// (0: until stopped).
pub const WORKLOAD_CHANSTREAM: u64 = 11;
/// Ping-pong over the sandbox's first channel without polling: each end
/// rings the channel's doorbell after it sends and halts until the peer's
/// head moves (`nl_workloads::doorbell`). Needs a channel with a doorbell.
pub const WORKLOAD_DOORBELL: u64 = 12;
/// A syscall-heavy loop (Quest-V's forkwait analogue): `SYS_TICKS` round
/// trips through the guest kernel interleaved with ring-3 work
/// (`nl_workloads::syscall`).
pub const WORKLOAD_SYSCALL: u64 = 13;
/// Data and instruction accesses over `ws_bytes / TLBWALK_STRIDE` pages at
/// a [`TLBWALK_STRIDE`]-byte stride (Quest-V's TLB experiment,
/// `nl_workloads::tlbwalk`).
pub const WORKLOAD_TLBWALK: u64 = 14;
/// The stride of `tlbwalk`: one page and one cache line, so every access
/// is on another page and another cache set.
pub const TLBWALK_STRIDE: u64 = 4160;
/// `tlbwalk`'s `pattern`: one checked 8-byte load per page (Quest-V's
/// Fig. 7, data TLB).
pub const TLBWALK_LOADS: u64 = 0;
/// `tlbwalk`'s `pattern`: one instruction fetch per page, a chain of
/// `add rax, imm32; jmp` through every page (Quest-V's Fig. 8,
/// instruction TLB).
pub const TLBWALK_FETCHES: u64 = 1;
/// A sandbox with a CPU reservation: greedy ring-3 work on vCPU 0 that
/// accounts, with the TSC, the CPU time it got in every period of `stride`
/// µs and compares it with its reservation of `data_bytes` µs
/// (`nl_workloads::periodic`), for `duration_ms`.
pub const WORKLOAD_PERIODIC: u64 = 15;
/// A doorbell storm: vCPU 0 rings its first channel's doorbell as fast as
/// it can for `duration_ms` (`nl_workloads::periodic::storm_digest`).
pub const WORKLOAD_STORM: u64 = 16;

/// The name of a workload kind (`WORKLOAD_*`), as the CLI and the API
/// spell it; "unknown" for anything else.
pub fn workload_name(kind: u64) -> &'static str {
    match kind {
        WORKLOAD_MEMWRITE => "memwrite",
        WORKLOAD_COMPUTE => "compute",
        WORKLOAD_EXITS => "exits",
        WORKLOAD_IDLE => "idle",
        WORKLOAD_BLKBENCH => "blkbench",
        WORKLOAD_NETBENCH => "netbench",
        WORKLOAD_KV => "kv",
        WORKLOAD_FILECACHE => "filecache",
        WORKLOAD_CHANBENCH => "chanbench",
        WORKLOAD_WILDWRITE => "wildwrite",
        WORKLOAD_CHANSTREAM => "chanstream",
        WORKLOAD_DOORBELL => "doorbell",
        WORKLOAD_SYSCALL => "syscall",
        WORKLOAD_TLBWALK => "tlbwalk",
        WORKLOAD_PERIODIC => "periodic",
        WORKLOAD_STORM => "storm",
        _ => "unknown",
    }
}

/// The workload kind (`WORKLOAD_*`) named `name` by [`workload_name`].
pub fn workload_kind(name: &str) -> Option<u64> {
    (WORKLOAD_MEMWRITE..=WORKLOAD_STORM).find(|&k| workload_name(k) == name)
}

/// The name of a memwrite access pattern (`PATTERN_*`), as the CLI and the
/// API spell it; "unknown" for anything else.
pub fn pattern_name(pattern: u64) -> &'static str {
    match pattern {
        PATTERN_SEQUENTIAL => "sequential",
        PATTERN_STRIDED => "strided",
        PATTERN_RANDOM => "random",
        PATTERN_HOTCOLD => "hotcold",
        _ => "unknown",
    }
}

/// The access pattern (`PATTERN_*`) named `name` by [`pattern_name`].
pub fn pattern_of(name: &str) -> Option<u64> {
    (PATTERN_SEQUENTIAL..=PATTERN_HOTCOLD).find(|&p| pattern_name(p) == name)
}

/// Access patterns of `memwrite` (`WorkloadParams::pattern`).
pub const PATTERN_SEQUENTIAL: u64 = 0;
pub const PATTERN_STRIDED: u64 = 1;
pub const PATTERN_RANDOM: u64 = 2;
pub const PATTERN_HOTCOLD: u64 = 3;
/// blkbench with this `pattern` (which blkbench otherwise ignores): the
/// guest first drives the virtio-blk device with malformed requests and
/// checks the error status of each (test-only).
pub const BLK_TEST_MALFORMED: u64 = 0x6d616c66;

/// What a vCPU's workload does. Identical on the host (native run and
/// digest verification) and in the guest.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct WorkloadParams {
    /// `WORKLOAD_*`.
    pub kind: u64,
    /// Seed; vCPU i runs with `seed_for_cpu(seed, i)`.
    pub seed: u64,
    /// memwrite: working-set bytes per vCPU (multiple of 4096); filecache:
    /// the cache's bytes (block slots and their index).
    pub ws_bytes: u64,
    /// memwrite: percentage (0..=100) of accesses that are writes.
    pub write_pct: u64,
    /// memwrite: `PATTERN_*`.
    pub pattern: u64,
    /// memwrite strided: stride in bytes (multiple of 8).
    pub stride: u64,
    /// memwrite hot/cold: share of the working set that is hot, in percent;
    /// filecache: share of the data set's blocks that is hot.
    pub hot_pct: u64,
    /// How long the guest keeps running rounds after the warm-up round.
    pub duration_ms: u64,
    /// filecache: bytes of the data set on the disk. Records written
    /// before this field existed parse with 0.
    #[cfg_attr(feature = "serde", serde(default))]
    pub data_bytes: u64,
}

// ---------------------------------------------------------------------------
// Sandbox channels
// ---------------------------------------------------------------------------
//
// A sandbox's channels are mapped in the MMIO hole below the devices: channel
// i's own output region (read-write) at `channel_own_gpa(i)` and the peer's
// (read-only, KVM_MEM_READONLY) at `channel_peer_gpa(i)`, each
// [`CHANNEL_REGION_BYTES`], with user-accessible, writable 2 MiB page-table
// entries: a write to the peer's window reaches the read-only memory slot and
// exits to the VMM instead of faulting in the guest. The record format is
// `nl_workloads::channel`.

/// Most channels one sandbox may have.
pub const MAX_CHANNELS: usize = 8;
/// Bytes of one output region (one 2 MiB page).
pub const CHANNEL_REGION_BYTES: u64 = 2 << 20;
/// Where the channel windows start.
pub const CHANNEL_WINDOWS_GPA: u64 = MMIO_HOLE_START;

/// Guest-physical address of channel `i`'s own (read-write) output region.
pub const fn channel_own_gpa(i: u64) -> u64 {
    CHANNEL_WINDOWS_GPA + 2 * i * CHANNEL_REGION_BYTES
}

/// Guest-physical address of channel `i`'s peer (read-only) output region.
pub const fn channel_peer_gpa(i: u64) -> u64 {
    channel_own_gpa(i) + CHANNEL_REGION_BYTES
}

/// One channel as the guest sees it ([`BootInfo::channels`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChannelWindow {
    /// Own output region: read-write.
    pub own_gpa: u64,
    /// The peer's output region: read-only.
    pub peer_gpa: u64,
    /// Bytes of each region.
    pub bytes: u64,
    /// Which end this sandbox is (0 or 1; end 0 leads in chanbench).
    pub end: u64,
    /// The peer sandbox's index in its set.
    pub peer: u64,
    /// Guest-physical address of this end's doorbell
    /// ([`channel_doorbell_gpa`]): an 8-byte write there raises
    /// [`DOORBELL_VECTOR`] in the peer. 0: the channel has no doorbell.
    pub doorbell: u64,
}

// Channel doorbells: a write by ring 3 to `channel_doorbell_gpa(i)` (no
// memory slot there) is matched by KVM against an ioeventfd and signals an
// eventfd that the peer's VM has registered as an irqfd on [`DOORBELL_GSI`],
// which the VMM routes by MSI to [`DOORBELL_VECTOR`] on vCPU 0. Neither VMM
// runs on that path.

/// Where the doorbell pages start (one 2 MiB user-writable page-table entry
/// above the channel windows; no memory behind it).
pub const DOORBELLS_GPA: u64 = channel_own_gpa(MAX_CHANNELS as u64);
/// Bytes of the doorbell area.
pub const DOORBELLS_BYTES: u64 = 2 << 20;
/// Channel `i`'s doorbell (its own 4 KiB page).
pub const fn channel_doorbell_gpa(i: u64) -> u64 {
    DOORBELLS_GPA + i * 4096
}
// A service's state region (remote recovery, `nl_sandbox::state`): a memfd
// the holder of the service maps read-write at [`STATE_REGION_GPA`] (user
// page tables map the range in every sandbox of the service; only the
// holder's VM has a memory slot behind it). [`BootInfo::state_gpa`] and
// [`BootInfo::state_bytes`] name it; zero without one.

/// Where a service's state region is mapped.
pub const STATE_REGION_GPA: u64 = 0xC400_0000;
/// Largest state region.
pub const MAX_STATE_BYTES: u64 = 64 << 20;

/// The GSI every doorbell irqfd of a sandbox is registered on.
pub const DOORBELL_GSI: u32 = 20;
/// The vector the VMM routes [`DOORBELL_GSI`] to.
pub const DOORBELL_VECTOR: u8 = 0x22;

/// Seed of vCPU `cpu` derived from the run seed.
pub const fn seed_for_cpu(seed: u64, cpu: u64) -> u64 {
    seed ^ cpu.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// The page at [`BOOT_INFO_GPA`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BootInfo {
    pub magic: u64,
    pub version: u64,
    /// Total guest RAM in bytes.
    pub mem_bytes: u64,
    pub num_vcpus: u64,
    /// TSC frequency in kHz (KVM_GET_TSC_KHZ), for ring-3 timekeeping with rdtsc.
    pub tsc_khz: u64,
    /// LAPIC timer initial count for one tick at divide-by-1.
    pub lapic_timer_count: u64,
    /// Timer ticks per second that `lapic_timer_count` gives.
    pub timer_hz: u64,
    /// Entry point of the user program (ring 3).
    pub user_entry: u64,
    /// Usable user heap [heap_start, heap_end); vCPU i's working set starts at
    /// `heap_start + i * workload.ws_bytes`.
    pub heap_start: u64,
    pub heap_end: u64,
    /// Nonzero: ring 3 runs with IOPL 3 and may use `in`/`out` directly;
    /// zero: port I/O goes through SYS_OUTL.
    pub user_iopl: u64,
    pub workload: WorkloadParams,
    /// Device DMA area [dma_start, dma_end) ([`DMA_BYTES`], above the heap):
    /// virtio rings and request headers, user-accessible.
    pub dma_start: u64,
    pub dma_end: u64,
    /// Nonzero when a virtio-blk device is at [`VIRTIO_BLK_MMIO_GPA`].
    pub has_blk: u64,
    /// Nonzero when a virtio-net device is at [`VIRTIO_NET_MMIO_GPA`].
    pub has_net: u64,
    /// The guest's IPv4 address (network byte order in the low 32 bits, as
    /// `u32::from_be_bytes(octets)`) and prefix length, when it has a network device.
    pub net_ipv4: u64,
    pub net_prefix: u64,
    /// Sandboxes: this sandbox's index in its set (0 for a plain VM).
    /// This and the fields below were appended to version 2; a VM without
    /// channels has them zero.
    pub sandbox: u64,
    /// Sandboxes: how many entries of `channels` are valid.
    pub num_channels: u64,
    pub channels: [ChannelWindow; MAX_CHANNELS],
    /// A service's state region ([`STATE_REGION_GPA`]) and its bytes; zero
    /// without one. Appended after `channels`.
    pub state_gpa: u64,
    pub state_bytes: u64,
}

impl BootInfo {
    /// Start of vCPU `cpu`'s working set.
    pub const fn ws_base(&self, cpu: u64) -> u64 {
        self.heap_start + cpu * self.workload.ws_bytes
    }
}

/// Kernel stack top of vCPU `cpu`.
pub const fn kernel_stack_top(cpu: u64) -> u64 {
    KERNEL_STACKS_GPA + (cpu + 1) * KERNEL_STACK_SIZE
}

/// User stack top of vCPU `cpu`.
pub const fn user_stack_top(cpu: u64) -> u64 {
    USER_STACKS_GPA + (cpu + 1) * USER_STACK_SIZE
}

/// Address of vCPU `cpu`'s CPU area.
pub const fn cpu_area(cpu: u64) -> u64 {
    CPU_AREA_GPA + cpu * CPU_AREA_SIZE
}

/// Address of vCPU `cpu`'s control-device register `reg`.
pub const fn control_reg(cpu: u64, reg: u64) -> u64 {
    CONTROL_MMIO_GPA + cpu * CONTROL_BLOCK_SIZE + reg
}

// Compile-time checks of the layout.
const _: () = {
    assert!(CPU_AREA_GPA + MAX_VCPUS as u64 * CPU_AREA_SIZE <= PAGE_TABLES_GPA);
    assert!(kernel_stack_top(MAX_VCPUS as u64 - 1) <= USER_BASE);
    assert!(user_stack_top(MAX_VCPUS as u64 - 1) <= USER_HEAP_GPA);
    assert!(core::mem::size_of::<BootInfo>() <= 4096);
    assert!(core::mem::size_of::<PerCpu>() <= (CPU_AREA_SIZE - CPU_AREA_PERCPU_OFFSET) as usize);
    assert!(CONTROL_MMIO_SIZE <= 0x2000);
    assert!(CONTROL_MMIO_GPA + CONTROL_MMIO_SIZE <= VIRTIO_BLK_MMIO_GPA);
    assert!(VIRTIO_BLK_MMIO_GPA + VIRTIO_MMIO_SIZE <= VIRTIO_NET_MMIO_GPA);
    assert!(MIN_MEM_BYTES >= USER_HEAP_GPA + DMA_BYTES);
    assert!(channel_peer_gpa(MAX_CHANNELS as u64 - 1) + CHANNEL_REGION_BYTES <= CONTROL_MMIO_GPA);
    assert!(CHANNEL_WINDOWS_GPA.is_multiple_of(CHANNEL_REGION_BYTES));
    assert!(DOORBELLS_GPA + DOORBELLS_BYTES <= CONTROL_MMIO_GPA);
    assert!(channel_doorbell_gpa(MAX_CHANNELS as u64) <= DOORBELLS_GPA + DOORBELLS_BYTES);
    assert!(STATE_REGION_GPA >= DOORBELLS_GPA + DOORBELLS_BYTES);
    assert!(STATE_REGION_GPA + MAX_STATE_BYTES <= CONTROL_MMIO_GPA);
};

#[cfg(test)]
mod name_tests {
    use super::*;

    #[test]
    fn workload_and_pattern_names_round_trip() {
        for k in WORKLOAD_MEMWRITE..=WORKLOAD_STORM {
            assert_eq!(workload_kind(workload_name(k)), Some(k), "kind {k}");
        }
        for p in PATTERN_SEQUENTIAL..=PATTERN_HOTCOLD {
            assert_eq!(pattern_of(pattern_name(p)), Some(p), "pattern {p}");
        }
        assert_eq!(workload_kind("unknown"), None);
        assert_eq!(pattern_of("zigzag"), None);
    }
}
