//! The ninelives reference guest's user program (ring 3, native speed on PVM).
//!
//! Runs the vCPU's workload from `nl-workloads` over its working set and
//! reports to the VMM through the vCPU's control-device block (MMIO, 64-bit
//! volatile accesses): PHASE_WORKLOAD_START first of all, the warm-up round,
//! PHASE_MEASURE_START, measured rounds for `duration_ms` with a heartbeat at
//! least every HEARTBEAT_MS, then OPS, CYCLES, ROUNDS, DIGEST, PHASE_DONE and
//! SYS_EXIT.
//!
//! Entered by the kernel's `iretq` with RDI = vCPU index, RSI = boot info,
//! RSP = this vCPU's user stack top.
#![no_std]
#![no_main]

use core::arch::{asm, global_asm};
use core::fmt::{self, Write};
use core::ptr::{read_volatile, write_volatile};

use nl_abi::{
    control_reg, reg, BootInfo, BOOT_MAGIC, BOOT_VERSION, DEVERR_BLK_INIT, DEVERR_BLK_IO,
    DEVERR_BLK_SMALL, DEVERR_NO_BLK, DMA_BLK_QUEUE, ERR_BAD_BOOT_INFO, ERR_DEVICE, ERR_SELF_CHECK,
    ERR_USER_PANIC, EXITS_PORT, HEARTBEAT_MS, PHASE_DONE, PHASE_MEASURE_START,
    PHASE_WORKLOAD_START, SYS_EXIT, SYS_HALT, SYS_OUTL, USER_STACKS_GPA, USER_STACK_SIZE,
    VIRTIO_BLK_MMIO_GPA, WORKLOAD_BLKBENCH, WORKLOAD_FILECACHE, WORKLOAD_MEMWRITE,
};
use nl_abi::{
    BLK_TEST_MALFORMED, DEVERR_NET_INIT, DEVERR_NO_NET, DMA_NET_BUFS, DMA_NET_RXQ, DMA_NET_TXQ,
    NET_RX_IRQ, NET_STANDBY, SYS_HALT_IF, SYS_NET_IRQS, VIRTIO_NET_MMIO_GPA,
    WORKLOAD_CHANBENCH, WORKLOAD_CHANSTREAM, WORKLOAD_KV, WORKLOAD_NETBENCH, WORKLOAD_WILDWRITE,
};
use nl_workloads::{Platform, Workload};

mod chan;
mod kv;
mod mem;
mod net;
mod virtio;

// The stack top is 16-byte aligned; `call` gives `main` the ABI's alignment.
global_asm!(
    r#"
    .section .text.entry, "ax"
    .global _start
_start:
    and rsp, -16
    call {main}
    ud2
    "#,
    main = sym main,
);

/// Writes control-device register `r` of vCPU `cpu`.
#[inline(always)]
fn ctl_write(cpu: u64, r: u64, value: u64) {
    // SAFETY: the control device page is mapped user-accessible by the VMM;
    // each vCPU only uses its own block.
    unsafe { write_volatile(control_reg(cpu, r) as *mut u64, value) }
}

/// Reads control-device register `r` of vCPU `cpu`.
#[inline(always)]
fn ctl_read(cpu: u64, r: u64) -> u64 {
    // SAFETY: as for `ctl_write`.
    unsafe { read_volatile(control_reg(cpu, r) as *const u64) }
}

#[inline(always)]
fn rdtsc() -> u64 {
    let lo: u32;
    let hi: u32;
    // SAFETY: rdtsc has no side effects (CR4.TSD is clear).
    unsafe {
        asm!("rdtsc", out("eax") lo, out("edx") hi, options(nomem, nostack, preserves_flags))
    };
    (u64::from(hi) << 32) | u64::from(lo)
}

/// RFLAGS.IOPL = 3.
const RFLAGS_IOPL3: u64 = 3 << 12;

/// Current RFLAGS. On PVM the hardware runs ring 3 with IOPL 0 whatever the
/// kernel asked for, so the guest checks before using `in`/`out` directly.
#[inline(always)]
fn rflags() -> u64 {
    let f: u64;
    // SAFETY: pushfq/pop only touch the stack slot they use.
    unsafe { asm!("pushfq", "pop {}", out(reg) f, options(nomem, preserves_flags)) };
    f
}

/// A syscall with up to two arguments, made with `int3`: on the PVM backend
/// `syscall` from ring 3 does not reach a plain (non-PVM-aware) kernel, while
/// `int3` through the kernel's DPL-3 gate at vector 3 does, on every backend.
/// The kernel clobbers RDX.
#[inline(always)]
fn syscall2(nr: u64, a0: u64, a1: u64) -> u64 {
    let ret: u64;
    // SAFETY: the kernel's syscalls touch no user memory (the interrupt frame
    // goes on the kernel stack).
    unsafe {
        asm!(
            "int3",
            inlateout("rax") nr => ret,
            in("rdi") a0,
            in("rsi") a1,
            lateout("rdx") _,
            options(nostack),
        );
    }
    ret
}

/// Ends this vCPU's run (the kernel parks it).
fn exit() -> ! {
    syscall2(SYS_EXIT, 0, 0);
    // SYS_EXIT does not return; should it ever, fault visibly.
    loop {
        // SAFETY: ud2 just raises #UD, which the kernel reports.
        unsafe { asm!("ud2", options(nomem, nostack)) };
    }
}

/// Reports a fatal error to the VMM and exits.
fn fail(cpu: u64, error: u64, info: u64) -> ! {
    ctl_write(cpu, reg::ERROR_INFO, info);
    ctl_write(cpu, reg::ERROR, error);
    exit()
}

/// The machine as the workload engine sees it from guest ring 3.
struct Guest<'s> {
    cpu: u64,
    /// netbench's network stack.
    net: Option<net::Stack<'s>>,
    /// The kv workload's TCP server.
    kv: Option<kv::Server<'s>>,
    /// Received frames arrive without a notify and raise an interrupt:
    /// halt when a poll found nothing to do.
    rx_irq: bool,
    /// Idle halts of the net poll that a net interrupt ended with a frame
    /// received during the halt (the receive path woke the guest), and the
    /// other idle halts (the timer tick, or the interrupt of the guest's own
    /// transmit: frames the guest's notify delivers are in the ring before
    /// it halts).
    irq_wakes: u64,
    other_wakes: u64,
    tsc_khz: u64,
    /// Ring 3 runs with IOPL 3 and may use `in`/`out` itself (BootInfo asked
    /// for it and RFLAGS shows it).
    iopl: bool,
    /// The virtio-blk driver (blkbench and filecache only).
    blk: Option<virtio::Blk>,
}

impl Platform for Guest<'_> {
    #[inline(always)]
    fn port_echo(&mut self, v: u32) -> u32 {
        if self.iopl {
            let r: u32;
            // SAFETY: IOPL 3 allows port I/O in ring 3; the echo port has no
            // other effect.
            unsafe {
                asm!(
                    "out dx, eax",
                    "in eax, dx",
                    in("dx") EXITS_PORT,
                    inlateout("eax") v => r,
                    options(nomem, nostack, preserves_flags),
                );
            }
            r
        } else {
            // Without IOPL the `in` cannot be done; the kernel does the `out`
            // and the result is what a correct device would return.
            syscall2(SYS_OUTL, u64::from(EXITS_PORT), u64::from(v));
            !v
        }
    }

    #[inline(always)]
    fn mmio_echo(&mut self, v: u64) -> u64 {
        ctl_write(self.cpu, reg::SCRATCH, v);
        ctl_read(self.cpu, reg::SCRATCH)
    }

    #[inline(always)]
    fn halt(&mut self) {
        syscall2(SYS_HALT, 0, 0);
    }

    fn null_syscall(&mut self) -> u64 {
        syscall2(nl_abi::SYS_NULL, 0, 0)
    }

    fn run_code(&mut self, code: &[u64], arg: u64) -> Option<u64> {
        // User memory is mapped without NX (nl_arch::paging), and the
        // working set holds only what tlbwalk's warm-up wrote there.
        if code.is_empty() {
            return None;
        }
        core::sync::atomic::compiler_fence(core::sync::atomic::Ordering::SeqCst);
        // SAFETY: `code` is this vCPU's working set, where tlbwalk's warm-up
        // wrote a chain of `add rax, imm32; jmp rel32` that stays inside it
        // and ends in `ret`, touching no memory and no register but RAX and
        // the flags (`nl_workloads::fetch_chain_point`).
        let f: extern "sysv64" fn(u64) -> u64 = unsafe { core::mem::transmute(code.as_ptr()) };
        Some(f(arg))
    }

    fn blk_read(&mut self, sector: u64, buf: &mut [u64]) -> bool {
        self.blk.as_mut().is_some_and(|b| b.read(sector, buf))
    }

    fn blk_write(&mut self, sector: u64, buf: &[u64]) -> bool {
        self.blk.as_mut().is_some_and(|b| b.write(sector, buf))
    }

    fn net_poll(&mut self) -> u64 {
        let now = smoltcp::time::Instant::from_millis((rdtsc() / self.tsc_khz.max(1)) as i64);
        let (served, watch) = if let Some(k) = self.kv.as_mut() {
            let n = k.poll(now);
            (n, (n == 0 && k.dev.rx_empty()).then(|| k.dev.rx_watch()))
        } else if let Some(s) = self.net.as_mut() {
            let n = s.poll(now);
            (n, (n == 0 && s.dev.rx_empty()).then(|| s.dev.rx_watch()))
        } else {
            (0, None)
        };
        if let (true, Some((addr, used))) = (self.rx_irq, watch) {
            // Halt until the next frame's interrupt or timer tick, unless a
            // frame arrived since the check (its interrupt may be gone).
            let irqs = syscall2(SYS_NET_IRQS, 0, 0);
            let halted = syscall2(SYS_HALT_IF, addr, u64::from(used)) != u64::MAX;
            let net_irq = syscall2(SYS_NET_IRQS, 0, 0) != irqs;
            // SAFETY: `addr` is the receive used ring's index, in this
            // vCPU's DMA area, mapped user-readable.
            let received = unsafe { core::ptr::read_volatile(addr as *const u16) } != used;
            match (halted, net_irq && received) {
                (false, _) => {}
                (true, true) => self.irq_wakes += 1,
                (true, false) => self.other_wakes += 1,
            }
        }
        served
    }
}

/// Sets up the virtio-blk driver for blkbench or filecache (vCPU 0's DMA area).
fn blk_setup(cpu: u64, boot: &BootInfo) -> virtio::Blk {
    if boot.has_blk == 0 {
        fail(cpu, ERR_DEVICE, DEVERR_NO_BLK << 32);
    }
    let dma = boot.dma_start + DMA_BLK_QUEUE;
    if dma < boot.heap_end || dma + 0x4000 > boot.dma_end {
        fail(cpu, ERR_BAD_BOOT_INFO, dma);
    }
    if boot.workload.kind == WORKLOAD_BLKBENCH && boot.workload.pattern == BLK_TEST_MALFORMED {
        // Test-only mode: malformed requests first; blkbench then runs as usual.
        let scratch = boot.ws_base(cpu);
        match virtio::Blk::malformed_checks(VIRTIO_BLK_MMIO_GPA, dma, scratch) {
            Ok(_) => print(cpu, format_args!("virtio-blk: malformed-request checks passed\n")),
            Err(step) => {
                print(cpu, format_args!("virtio-blk: malformed-request check {step} failed\n"));
                fail(cpu, ERR_SELF_CHECK, step)
            }
        }
    }
    let blk = match virtio::Blk::init(VIRTIO_BLK_MMIO_GPA, dma) {
        Ok(b) => b,
        Err(virtio::InitError(step)) => fail(cpu, ERR_DEVICE, (DEVERR_BLK_INIT << 32) | step),
    };
    let need = if boot.workload.kind == WORKLOAD_FILECACHE {
        nl_workloads::filecache::disk_bytes(boot.workload.data_bytes)
    } else {
        nl_workloads::blk::BLKBENCH_DISK_BYTES
    };
    if blk.sectors.saturating_mul(512) < need {
        fail(cpu, ERR_DEVICE, (DEVERR_BLK_SMALL << 32) | (blk.sectors >> 11));
    }
    blk
}

/// Sets up the virtio-net driver (netbench, kv) in vCPU 0's DMA area. A
/// standby (a spare device, [`NET_STANDBY`]) first waits, heartbeating,
/// until the VMM attaches a TAP (the link comes up): it is taking over the
/// service.
fn net_setup(cpu: u64, boot: &BootInfo) -> net::NetDev {
    if boot.has_net == 0 {
        fail(cpu, ERR_DEVICE, DEVERR_NO_NET << 32);
    }
    if boot.has_net == NET_STANDBY {
        let khz = boot.tsc_khz.max(1);
        let mut last_beat = rdtsc();
        while !net::link_up(VIRTIO_NET_MMIO_GPA) {
            // About 200 us between looks (each look is an exit).
            let t = rdtsc();
            while rdtsc().wrapping_sub(t) < 200 * khz / 1000 {
                core::hint::spin_loop();
            }
            if rdtsc().wrapping_sub(last_beat) >= HEARTBEAT_MS * khz {
                ctl_write(cpu, reg::HEARTBEAT, 0);
                last_beat = rdtsc();
            }
        }
    }
    let d = boot.dma_start;
    if d < boot.heap_end || d + DMA_NET_BUFS + 0x1_0000 > boot.dma_end {
        fail(cpu, ERR_BAD_BOOT_INFO, d);
    }
    match net::NetDev::init(VIRTIO_NET_MMIO_GPA, d + DMA_NET_RXQ, d + DMA_NET_TXQ, d + DMA_NET_BUFS)
    {
        Ok(dev) => dev,
        Err(virtio::InitError(step)) => fail(cpu, ERR_DEVICE, (DEVERR_NET_INIT << 32) | step),
    }
}

/// kv: the working set split into the table's words and the socket buffers.
fn kv_memory(cpu: u64, boot: &BootInfo) -> (&'static mut [u64], &'static mut [u8]) {
    use nl_workloads::kv::{KV_BUF_BYTES, KV_TABLE_BYTES, KV_WS_BYTES};
    let base = boot.ws_base(cpu);
    let end = base.checked_add(KV_WS_BYTES);
    if boot.workload.ws_bytes != KV_WS_BYTES
        || end.is_none_or(|end| base < boot.heap_start || end > boot.heap_end)
    {
        fail(cpu, ERR_BAD_BOOT_INFO, base);
    }
    // SAFETY: [base, base + KV_WS_BYTES) is inside the user heap, mapped
    // user-writable and vCPU `cpu`'s alone; the two slices do not overlap.
    unsafe {
        (
            core::slice::from_raw_parts_mut(base as *mut u64, (KV_TABLE_BYTES / 8) as usize),
            core::slice::from_raw_parts_mut(
                (base + KV_TABLE_BYTES) as *mut u8,
                KV_BUF_BYTES as usize,
            ),
        )
    }
}

/// kv: the service's state region as words, if the boot info names one.
fn state_region(cpu: u64, boot: &BootInfo) -> Option<&'static mut [u64]> {
    if boot.state_bytes == 0 {
        return None;
    }
    if boot.state_gpa != nl_abi::STATE_REGION_GPA
        || boot.state_bytes > nl_abi::MAX_STATE_BYTES
        || !boot.state_bytes.is_multiple_of(4096)
    {
        fail(cpu, ERR_BAD_BOOT_INFO, boot.state_gpa);
    }
    // SAFETY: the VMM maps [state_gpa, state_gpa + state_bytes) user-writable
    // in the page tables and, once this sandbox holds the service, puts its
    // state region's memory slot behind it; only vCPU 0 serves kv.
    Some(unsafe {
        core::slice::from_raw_parts_mut(boot.state_gpa as *mut u64, (boot.state_bytes / 8) as usize)
    })
}

/// blkbench, filecache: stops the run at the first failed request or bad read.
fn blk_check(cpu: u64, w: &Workload, name: &str) {
    let (mismatches, io_errors) = w.blk_errors();
    if io_errors > 0 {
        print(cpu, format_args!("{name}: {io_errors} virtio-blk requests failed\n"));
        fail(cpu, ERR_DEVICE, (DEVERR_BLK_IO << 32) | io_errors.min(0xffff_ffff));
    }
    if mismatches > 0 {
        print(cpu, format_args!("{name}: {mismatches} words read back wrong\n"));
        fail(cpu, ERR_SELF_CHECK, w.rounds_done());
    }
}

/// filecache: publishes the hit and miss counts (before the heartbeat
/// that goes with them).
fn cache_report(cpu: u64, w: &Workload) {
    let (hits, misses) = w.cache_counts();
    ctl_write(cpu, reg::CACHE_HITS, hits);
    ctl_write(cpu, reg::CACHE_MISSES, misses);
}

/// Pages the warm-up maps between two heartbeats (about 8 µs a page on PVM,
/// so roughly 2 ms; the heartbeat is one MMIO exit).
const WARM_UP_PAGES_PER_BEAT: usize = 256;

extern "C" fn main(cpu: u64, boot: *const BootInfo) -> ! {
    ctl_write(cpu, reg::PHASE, PHASE_WORKLOAD_START);

    // SAFETY: the boot info page is mapped read-only for ring 3 and never
    // changes while the guest runs.
    let boot = unsafe { &*boot };
    if boot.magic != BOOT_MAGIC || boot.version != BOOT_VERSION {
        fail(cpu, ERR_BAD_BOOT_INFO, boot.magic);
    }
    let params = boot.workload;
    match params.kind {
        WORKLOAD_CHANBENCH => chan::chanbench(cpu, boot),
        WORKLOAD_WILDWRITE => chan::wildwrite(cpu, boot),
        WORKLOAD_CHANSTREAM => chan::chanstream(cpu, boot),
        nl_abi::WORKLOAD_DOORBELL => chan::doorbell(cpu, boot),
        nl_abi::WORKLOAD_PERIODIC => chan::periodic(cpu, boot),
        nl_abi::WORKLOAD_STORM => chan::storm(cpu, boot),
        _ => {}
    }

    // The working set: memwrite's memory, blkbench's I/O buffers,
    // filecache's cache; the other kinds get none.
    let filecache = params.kind == WORKLOAD_FILECACHE;
    let disk = params.kind == WORKLOAD_BLKBENCH || filecache;
    let name = if filecache { "filecache" } else { "blkbench" };
    let ws: &mut [u64] = if params.kind == WORKLOAD_MEMWRITE
        || params.kind == nl_abi::WORKLOAD_TLBWALK
        || disk
    {
        let base = boot.ws_base(cpu);
        let end = base.checked_add(params.ws_bytes);
        if end.is_none_or(|end| base < boot.heap_start || end > boot.heap_end) {
            fail(cpu, ERR_BAD_BOOT_INFO, base);
        }
        // SAFETY: [base, base + ws_bytes) is inside the user heap, mapped
        // user-writable, and vCPU `cpu`'s alone.
        unsafe { core::slice::from_raw_parts_mut(base as *mut u64, (params.ws_bytes / 8) as usize) }
    } else {
        &mut []
    };
    let mut w = match Workload::new(&params, cpu, ws) {
        Ok(w) => w,
        Err(e) => {
            print(cpu, format_args!("workload rejected: {e}\n"));
            fail(cpu, ERR_BAD_BOOT_INFO, params.kind)
        }
    };
    let blk = if disk { Some(blk_setup(cpu, boot)) } else { None };
    // netbench and kv: the network stack's storage lives in this frame
    // (main never returns); the UDP echo's buffers serve both.
    let mut sockets = [smoltcp::iface::SocketStorage::EMPTY; 1];
    let mut kv_sockets = [const { smoltcp::iface::SocketStorage::EMPTY }; kv::SOCKETS];
    let mut rx_meta = [smoltcp::socket::udp::PacketMetadata::EMPTY; 16];
    let mut tx_meta = [smoltcp::socket::udp::PacketMetadata::EMPTY; 16];
    let mut rx_buf = [0u8; 16384];
    let mut tx_buf = [0u8; 16384];
    let echo = ((&mut rx_meta[..], &mut rx_buf[..]), (&mut tx_meta[..], &mut tx_buf[..]));
    // (Read after net_setup: a standby waits there for its TAP.)
    let now = || smoltcp::time::Instant::from_millis((rdtsc() / boot.tsc_khz.max(1)) as i64);
    let addr = ((boot.net_ipv4 as u32).to_be_bytes(), boot.net_prefix as u8);
    let standby = boot.has_net == NET_STANDBY;
    let (mut net, mut kv) = match params.kind {
        WORKLOAD_NETBENCH => {
            let dev = net_setup(cpu, boot);
            let seed = params.seed ^ rdtsc();
            (Some(net::Stack::new(dev, addr, seed, now(), &mut sockets, echo)), None)
        }
        // kv: the table and the TCP sockets' buffers are in the working set.
        WORKLOAD_KV => {
            let dev = net_setup(cpu, boot);
            let (table, bufs) = kv_memory(cpu, boot);
            // A service's state region (mapped once the link is up, for a
            // standby taking over) holds the table instead of the working set.
            let table = state_region(cpu, boot).unwrap_or(table);
            let Some((table, loaded)) = nl_workloads::kv::Table::load(table) else {
                fail(cpu, ERR_BAD_BOOT_INFO, params.ws_bytes)
            };
            if boot.state_bytes != 0 {
                print(
                    cpu,
                    format_args!(
                        "kv: state region loaded: {} entries kept, {} corrupt dropped, journal {}, {}\n",
                        loaded.kept,
                        loaded.dropped,
                        if loaded.replayed { "replayed" } else { "clean" },
                        if loaded.formatted { "formatted" } else { "found" },
                    ),
                );
            }
            let seed = params.seed ^ rdtsc();
            match kv::Server::new(dev, addr, seed, now(), &mut kv_sockets, bufs, echo, table) {
                Some(s) => (None, Some(s)),
                None => fail(cpu, ERR_BAD_BOOT_INFO, params.ws_bytes),
            }
        }
        _ => (None, None),
    };
    // A standby that took the service over announces it under the
    // service's identity (the device's MAC, the boot info's address).
    if standby {
        if let Some(dev) = net.as_mut().map(|s| &mut s.dev).or(kv.as_mut().map(|k| &mut k.dev)) {
            dev.announce(addr.0);
        }
    }
    let mut platform = Guest {
        cpu,
        net,
        kv,
        rx_irq: boot.has_net == NET_RX_IRQ,
        irq_wakes: 0,
        other_wakes: 0,
        tsc_khz: boot.tsc_khz,
        iopl: boot.user_iopl != 0 && rflags() & RFLAGS_IOPL3 == RFLAGS_IOPL3,
        blk,
    };

    // Warm-up round (maps the working set), in pieces with a heartbeat
    // between them: mapping a large working set takes seconds.
    let warmup = loop {
        if let Some(ops) = w.warm_up_step(&mut platform, WARM_UP_PAGES_PER_BEAT) {
            break ops;
        }
        ctl_write(cpu, reg::HEARTBEAT, 0);
    };
    if disk {
        blk_check(cpu, &w, name);
    }
    if filecache {
        let found = if w.cache_data_found() { "found on the disk" } else { "written to the disk" };
        print(
            cpu,
            format_args!(
                "filecache: data set of {} MiB {found}, cache of {} blocks\n",
                params.data_bytes >> 20,
                w.cache_slots()
            ),
        );
    }
    ctl_write(cpu, reg::WARMUP_OPS, warmup);

    // Measured period.
    let khz = boot.tsc_khz;
    let duration = params.duration_ms.saturating_mul(khz);
    let heartbeat = HEARTBEAT_MS.saturating_mul(khz);
    ctl_write(cpu, reg::PHASE, PHASE_MEASURE_START);
    let start = rdtsc();
    let mut now = start;
    let mut last_beat = start;
    let mut ops = 0u64;
    while now.wrapping_sub(start) < duration {
        ops = ops.wrapping_add(w.round(&mut platform));
        if w.self_check_failures() != 0 {
            fail(cpu, ERR_SELF_CHECK, w.rounds_done());
        }
        if disk {
            blk_check(cpu, &w, name);
        }
        now = rdtsc();
        if now.wrapping_sub(last_beat) >= heartbeat {
            if filecache {
                cache_report(cpu, &w);
            }
            ctl_write(cpu, reg::HEARTBEAT, ops);
            last_beat = now;
        }
    }
    let cycles = now.wrapping_sub(start);

    if params.kind == WORKLOAD_NETBENCH {
        print(cpu, format_args!("netbench: answered {} packets\n", w.net_answered()));
    }
    if platform.net.is_some() || platform.kv.is_some() {
        ctl_write(cpu, reg::NET_IRQS, syscall2(SYS_NET_IRQS, 0, 0));
        ctl_write(cpu, reg::NET_IRQ_WAKES, platform.irq_wakes);
        ctl_write(cpu, reg::NET_OTHER_WAKES, platform.other_wakes);
    }
    if let Some(k) = &platform.kv {
        let c = k.counts;
        let (keys, sum) = k.table.digest(b"");
        print(
            cpu,
            format_args!(
                "kv: {} connections, {} PUT, {} GET, {} other, {} errors, {} UDP echoes; table {keys} keys, digest {sum:016x}\n",
                c.connections, c.puts, c.gets, c.other, c.errors, c.echoes
            ),
        );
    }
    if filecache {
        let (hits, misses) = w.cache_counts();
        print(cpu, format_args!("filecache: {hits} hits, {misses} misses\n"));
        cache_report(cpu, &w);
    }
    // A corrupted word no round read again is found here, before the
    // digest is reported as a result.
    if w.final_self_check() != 0 {
        fail(cpu, ERR_SELF_CHECK, w.rounds_done());
    }
    let digest = w.finish();
    ctl_write(cpu, reg::OPS, ops);
    ctl_write(cpu, reg::CYCLES, cycles);
    ctl_write(cpu, reg::ROUNDS, w.rounds_done());
    ctl_write(cpu, reg::DIGEST, digest);
    ctl_write(cpu, reg::PHASE, PHASE_DONE);
    exit()
}

/// Console output through the control device's PRINT register (one MMIO
/// exit per byte: for diagnostics only).
struct Console(u64);

impl Write for Console {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        for b in s.bytes() {
            ctl_write(self.0, reg::PRINT, u64::from(b));
        }
        Ok(())
    }
}

fn print(cpu: u64, args: fmt::Arguments) {
    let _ = Console(cpu).write_fmt(args);
}

/// This vCPU's index, from the user stack the stack pointer is in (the
/// image is shared by all vCPUs, so it has no per-vCPU globals).
fn current_cpu() -> u64 {
    let rsp: u64;
    // SAFETY: reads RSP only.
    unsafe { asm!("mov {}, rsp", out(reg) rsp, options(nomem, nostack, preserves_flags)) };
    rsp.wrapping_sub(USER_STACKS_GPA) / USER_STACK_SIZE
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    let cpu = current_cpu();
    print(cpu, format_args!("guest user panic: {info}\n"));
    let line = info.location().map_or(0, |l| u64::from(l.line()));
    fail(cpu, ERR_USER_PANIC, line)
}

/// Referenced by the precompiled `core` when it is not optimized away (dev
/// builds without LTO); never called, since panics abort.
#[no_mangle]
extern "C" fn rust_eh_personality() {}
