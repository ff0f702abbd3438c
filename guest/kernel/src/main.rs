//! The ninelives reference guest kernel (ring 0).
//!
//! On PVM, ring-0 code is emulated instruction by instruction (~1-2 µs per
//! instruction), so this kernel does the bare minimum, almost all of it in
//! straight-line code (about 150 instructions from `_start` to the user
//! program): fill the IDT gates it needs, check the boot info, program the
//! syscall MSRs and the LAPIC timer, then drop to the user program in ring 3
//! and only come back for timer ticks, syscalls and fatal exceptions.
//!
//! The initial state (set by the VMM, see `nl_abi`): 64-bit mode, CPL 0,
//! RDI = vCPU index, RSI = boot info, RSP = this vCPU's kernel stack top,
//! GS_BASE = this vCPU's `PerCpu`, KERNEL_GS_BASE = 0, IF = 0, x2APIC on.
//! Memory is zeroed and the ELF segments are loaded by the VMM, so there is
//! no `.bss` clearing and no relocation.
//!
//! Conventions:
//! * GS is the kernel's (`PerCpu`) whenever ring 0 runs past an entry's
//!   `swapgs`; entries from ring 3 (CS RPL = 3 in the interrupt frame)
//!   `swapgs` on the way in and out.
//! * Ring 0 runs with IF = 0 except inside the `sti; hlt; cli` of SYS_HALT,
//!   on the kernel stack, so interrupts never nest on a user stack.
//! * Syscalls: `int3` (vector 3 is a DPL-3 gate; see the syscall entries for
//!   why not `syscall`) or `syscall`; number in RAX, arguments in RDI, RSI,
//!   result in RAX. RDX is clobbered (and RCX, R11 by `syscall` itself),
//!   every other register is preserved.
#![no_std]
#![no_main]

use core::arch::{asm, global_asm};
use core::ptr::{addr_of, read_volatile, write_volatile};

use nl_abi::{
    control_reg, reg, user_stack_top, BootInfo, PerCpu, BOOT_INFO_GPA, BOOT_MAGIC, BOOT_VERSION,
    CONTROL_BLOCK_SIZE, CONTROL_MMIO_GPA, DOORBELL_VECTOR, ERR_BAD_BOOT_INFO, ERR_EXCEPTION_BASE,
    ERR_KERNEL_PANIC, IDT_GPA, KERNEL_STACKS_GPA, KERNEL_STACK_SIZE, NET_VECTOR, PHASE_KERNEL_UP,
    SEL_KERNEL_CODE, SEL_SYSRET_BASE, SEL_USER_CODE, SEL_USER_DATA, SPURIOUS_VECTOR, SYS_ENOSYS,
    SYS_EXIT, SYS_HALT, SYS_HALT_IF, SYS_NET_IRQS, SYS_OUTL, SYS_TICKS, TIMER_VECTOR,
};

// MSRs.
const MSR_STAR: u32 = 0xc000_0081;
const MSR_LSTAR: u32 = 0xc000_0082;
const MSR_FMASK: u32 = 0xc000_0084;
const MSR_X2APIC_EOI: u32 = 0x80b;
const MSR_X2APIC_SVR: u32 = 0x80f;
const MSR_X2APIC_LVT_TIMER: u32 = 0x832;
const MSR_X2APIC_TIMER_INIT: u32 = 0x838;
const MSR_X2APIC_TIMER_DIV: u32 = 0x83e;

/// LVT timer mode bit: periodic.
const LVT_TIMER_PERIODIC: u64 = 1 << 17;
/// Divide configuration value for divide-by-1.
const TIMER_DIV_1: u64 = 0xb;
/// SVR: APIC software enable | spurious vector.
const SVR_VALUE: u64 = 0x100 | SPURIOUS_VECTOR as u64;

// RFLAGS bits.
const RFLAGS_TF: u64 = 1 << 8;
const RFLAGS_IF: u64 = 1 << 9;
const RFLAGS_DF: u64 = 1 << 10;
const RFLAGS_IOPL3: u64 = 3 << 12;
const RFLAGS_NT: u64 = 1 << 14;
const RFLAGS_AC: u64 = 1 << 18;
/// Reserved bit 1 of RFLAGS (always set).
const RFLAGS_FIXED: u64 = 1 << 1;

/// Interrupt gate, present, DPL 0 (type 0xE): byte 5 of the descriptor.
const GATE_INTERRUPT: u64 = 0x8e;
/// DPL 3 bits of a gate's low qword (callable with `int` from ring 3).
const GATE_DPL3: u64 = 3 << 45;
/// The syscall gate: `int3` (see the syscall entries below).
const SYSCALL_VECTOR: u8 = 3;

// Byte offsets of the `PerCpu` fields (asserted below).
const PERCPU_KERNEL_RSP: usize = 0;
const PERCPU_USER_RSP: usize = 8;
const PERCPU_CPU: usize = 16;
const PERCPU_TICKS: usize = 24;
const PERCPU_NET_IRQS: usize = 32;
const _: () = {
    assert!(core::mem::offset_of!(PerCpu, kernel_rsp) == PERCPU_KERNEL_RSP);
    assert!(core::mem::offset_of!(PerCpu, user_rsp) == PERCPU_USER_RSP);
    assert!(core::mem::offset_of!(PerCpu, cpu) == PERCPU_CPU);
    assert!(core::mem::offset_of!(PerCpu, ticks) == PERCPU_TICKS);
    assert!(core::mem::offset_of!(PerCpu, net_irqs) == PERCPU_NET_IRQS);
    assert!(CONTROL_BLOCK_SIZE.is_power_of_two());
    assert!(KERNEL_STACK_SIZE.is_power_of_two());
    // The gates of all 32 exception stubs share bits 16..63 of their
    // handler address (the stubs sit in one 512-byte aligned block).
    assert!(EXC_STUB_SIZE * 32 == 512);
    assert!(SYS_HALT == 0 && SYS_EXIT == 1 && SYS_OUTL == 2 && SYS_TICKS == 3);
};

/// Size of one exception entry stub (see `nl_exc_stubs` below).
const EXC_STUB_SIZE: u64 = 16;

// ---------------------------------------------------------------------------
// Entry points (assembly)
// ---------------------------------------------------------------------------

// Boot entry: record the kernel stack and the vCPU index in PerCpu (GS), then
// run `kmain(cpu, boot)`. The stack top is 16-byte aligned, so after the
// `call` kmain sees the ABI's alignment.
global_asm!(
    r#"
    .section .text.entry, "ax"
    .global _start
_start:
    mov gs:[{kernel_rsp}], rsp
    mov gs:[{cpu}], rdi
    call {kmain}
2:  cli
    hlt
    jmp 2b
    "#,
    kernel_rsp = const PERCPU_KERNEL_RSP,
    cpu = const PERCPU_CPU,
    kmain = sym kmain,
);

// Exceptions 0..=31: 16-byte stubs in one 512-byte aligned block, so the IDT
// gates can be filled by adding 16 to the first one. Each pushes a dummy
// error code when the CPU does not, then the vector, and jumps to the common
// handler, which reports ERR_EXCEPTION_BASE + vector (ERROR_INFO = faulting
// RIP) on this vCPU's control block and parks the vCPU. (Vector 3's gate
// points to the syscall entry instead; its stub only keeps the layout.)
global_asm!(
    r#"
    .section .text.exceptions, "ax"
    .macro NL_EXC_STUB vec, has_err
    .balign 16
    .if \has_err == 0
    push 0
    .endif
    push \vec
    jmp nl_exc_common
    .endm

    .balign 512
    .global nl_exc_stubs
nl_exc_stubs:
    NL_EXC_STUB 0, 0
    NL_EXC_STUB 1, 0
    NL_EXC_STUB 2, 0
    NL_EXC_STUB 3, 0
    NL_EXC_STUB 4, 0
    NL_EXC_STUB 5, 0
    NL_EXC_STUB 6, 0
    NL_EXC_STUB 7, 0
    NL_EXC_STUB 8, 1
    NL_EXC_STUB 9, 0
    NL_EXC_STUB 10, 1
    NL_EXC_STUB 11, 1
    NL_EXC_STUB 12, 1
    NL_EXC_STUB 13, 1
    NL_EXC_STUB 14, 1
    NL_EXC_STUB 15, 0
    NL_EXC_STUB 16, 0
    NL_EXC_STUB 17, 1
    NL_EXC_STUB 18, 0
    NL_EXC_STUB 19, 0
    NL_EXC_STUB 20, 0
    NL_EXC_STUB 21, 1
    NL_EXC_STUB 22, 0
    NL_EXC_STUB 23, 0
    NL_EXC_STUB 24, 0
    NL_EXC_STUB 25, 0
    NL_EXC_STUB 26, 0
    NL_EXC_STUB 27, 0
    NL_EXC_STUB 28, 0
    NL_EXC_STUB 29, 1
    NL_EXC_STUB 30, 1
    NL_EXC_STUB 31, 0
    .purgem NL_EXC_STUB

    // Stack: vector, error code, RIP, CS, RFLAGS, RSP, SS. Always on this
    // vCPU's kernel stack (RSP0 from ring 3, the current one in ring 0), so
    // the vCPU index comes from RSP: this works whatever GS holds, and the
    // vCPU parks, so GS is left as it is.
    .balign 16
nl_exc_common:
    mov rcx, rsp
    sub rcx, {kstacks}
    shr rcx, {kstack_shift}
    shl rcx, {block_shift}
    mov rax, {ctl_base}
    add rcx, rax
    mov rax, [rsp + 16]
    mov [rcx + {error_info}], rax
    mov rax, [rsp]
    add rax, {err_base}
    mov [rcx + {error}], rax
2:  cli
    hlt
    jmp 2b

    // Timer (TIMER_VECTOR): count the tick, EOI, return.
    .balign 16
    .global nl_timer_entry
nl_timer_entry:
    test byte ptr [rsp + 8], 3
    jz 7f
    swapgs
7:  inc qword ptr gs:[{ticks}]
    test byte ptr [rsp + 8], 3
    jz nl_eoi_return
    swapgs
    jmp nl_eoi_return

    // Device interrupt (NET_VECTOR): it only wakes a halted vCPU; count it
    // (SYS_NET_IRQS, SYS_HALT_IF), EOI, return.
    .balign 16
    .global nl_device_entry
nl_device_entry:
    test byte ptr [rsp + 8], 3
    jz 7f
    swapgs
7:  inc qword ptr gs:[{net_irqs}]
    test byte ptr [rsp + 8], 3
    jz nl_eoi_return
    swapgs
    jmp nl_eoi_return

    // Channel doorbell (DOORBELL_VECTOR): it only wakes a halted vCPU (the
    // ring-3 receiver waits in SYS_HALT_IF); EOI, return. Its body is the
    // tail the other device interrupts end in: EOI through the x2APIC MSR
    // (rax, rcx, rdx preserved), then iretq.
    .balign 16
    .global nl_doorbell_entry
nl_doorbell_entry:
nl_eoi_return:
    push rax
    push rcx
    push rdx
    mov ecx, {eoi}
    xor eax, eax
    xor edx, edx
    wrmsr
    pop rdx
    pop rcx
    pop rax
    iretq

    // Spurious interrupt (SPURIOUS_VECTOR): no EOI.
    .balign 16
    .global nl_spurious_entry
nl_spurious_entry:
    iretq
    "#,
    kstacks = const KERNEL_STACKS_GPA,
    kstack_shift = const KERNEL_STACK_SIZE.trailing_zeros(),
    block_shift = const CONTROL_BLOCK_SIZE.trailing_zeros(),
    ctl_base = const CONTROL_MMIO_GPA,
    error_info = const reg::ERROR_INFO,
    error = const reg::ERROR,
    err_base = const ERR_EXCEPTION_BASE,
    ticks = const PERCPU_TICKS,
    net_irqs = const PERCPU_NET_IRQS,
    eoi = const MSR_X2APIC_EOI,
);

// Syscall entries. Two ways in, the same numbers and registers:
//
// * `int3` through a DPL-3 interrupt gate at vector 3 (`nl_int3_entry`):
//   what the reference user program uses. It works on PVM and on VMX/SVM
//   alike. On the PVM backend of this project `syscall` from ring 3 does
//   not reach a non-PVM-aware kernel correctly (RIP becomes LSTAR but the
//   CPL stays 3, so the fetch faults) and `int n` raises #UD, while
//   exceptions, `int3` included, are delivered through the IDT normally.
//   `int3` is a trap: the frame's RIP is already past it.
// * `syscall` (`nl_syscall_entry`, LSTAR): kept for hardware-assisted
//   backends and for completeness.
//
// Both run with IF clear, so nothing interrupts the GS/stack juggling.
// SYS_OUTL needs neither GS nor a stack and is checked first (the `exits`
// workload's hot path without IOPL); SYS_HALT_IF second (every doorbell and
// network wait: each compare is about a microsecond of emulated ring 0). SYS_HALT waits on the kernel stack,
// never on the user's (its red zone may be live), with the kernel's GS (the
// timer handler uses it). SYS_EXIT parks the vCPU with IF clear.
global_asm!(
    r#"
    .section .text.syscall, "ax"
    .balign 16
    .global nl_int3_entry
nl_int3_entry:
    // An int3 in ring 0 is a kernel bug: report it as exception 3.
    test byte ptr [rsp + 8], 3
    jz 8f
    cmp rax, {sys_outl}
    je 5f
    cmp rax, {sys_halt_if}
    je 9f
    test rax, rax
    jz 3f
    cmp rax, {sys_ticks}
    je 4f
    cmp rax, {sys_exit}
    je 6f
    cmp rax, {sys_net_irqs}
    je 11f
    mov rax, {enosys}
    iretq
    // SYS_HALT (already on the kernel stack).
3:  swapgs
    sti
    hlt
    cli
    swapgs
    xor eax, eax
    iretq
    // SYS_TICKS
4:  swapgs
    mov rax, gs:[{ticks}]
    swapgs
    iretq
    // SYS_OUTL: port in RDI, value in RSI.
5:  mov edx, edi
    mov eax, esi
    out dx, eax
    xor eax, eax
    iretq
    // SYS_EXIT
6:  cli
    hlt
    jmp 6b
    // SYS_HALT_IF: halt (as SYS_HALT) only while the u16 at RDI equals SI.
    // Returns the timer ticks seen during the halt (0: another interrupt
    // woke it), or -1 when it did not halt. RDX is a syscall scratch register.
9:  movzx eax, word ptr [rdi]
    cmp ax, si
    jne 10f
    swapgs
    mov rdx, gs:[{ticks}]
    sti
    hlt
    cli
    mov rax, gs:[{ticks}]
    sub rax, rdx
    swapgs
    iretq
10: mov rax, -1
    iretq
    // SYS_NET_IRQS
11: swapgs
    mov rax, gs:[{net_irqs}]
    swapgs
    iretq
8:  push 0
    push 3
    jmp nl_exc_common

    // `syscall`: RCX = user RIP, R11 = user RFLAGS, RSP = user stack.
    .balign 16
    .global nl_syscall_entry
nl_syscall_entry:
    cmp rax, {sys_outl}
    je 5f
    swapgs
    test rax, rax
    jz 3f
    cmp rax, {sys_ticks}
    je 4f
    cmp rax, {sys_exit}
    je 6b
    mov rax, {enosys}
    swapgs
    sysretq
3:  mov gs:[{user_rsp}], rsp
    mov rsp, gs:[{kernel_rsp}]
    sti
    hlt
    cli
    mov rsp, gs:[{user_rsp}]
    swapgs
    xor eax, eax
    sysretq
4:  mov rax, gs:[{ticks}]
    swapgs
    sysretq
5:  mov edx, edi
    mov eax, esi
    out dx, eax
    xor eax, eax
    sysretq
    "#,
    sys_outl = const SYS_OUTL,
    sys_ticks = const SYS_TICKS,
    sys_halt_if = const SYS_HALT_IF,
    sys_net_irqs = const SYS_NET_IRQS,
    sys_exit = const SYS_EXIT,
    enosys = const SYS_ENOSYS as i64,
    net_irqs = const PERCPU_NET_IRQS,
    user_rsp = const PERCPU_USER_RSP,
    kernel_rsp = const PERCPU_KERNEL_RSP,
    ticks = const PERCPU_TICKS,
);

extern "C" {
    static nl_exc_stubs: [u8; 512];
    fn nl_timer_entry();
    fn nl_spurious_entry();
    fn nl_device_entry();
    fn nl_doorbell_entry();
    fn nl_syscall_entry();
    fn nl_int3_entry();
}

// ---------------------------------------------------------------------------
// Boot
// ---------------------------------------------------------------------------

/// Low 8 bytes of a 64-bit interrupt gate to `handler` (below 4 GiB, so the
/// high 8 bytes are zero, as the VMM left them).
#[inline(always)]
fn gate_low(handler: u64) -> u64 {
    (handler & 0xffff)
        | (u64::from(SEL_KERNEL_CODE) << 16)
        | (GATE_INTERRUPT << 40)
        | ((handler >> 16) << 48)
}

#[inline(always)]
unsafe fn wrmsr(msr: u32, value: u64) {
    asm!(
        "wrmsr",
        in("ecx") msr,
        in("eax") value as u32,
        in("edx") (value >> 32) as u32,
        options(nostack, preserves_flags),
    );
}

#[inline(always)]
unsafe fn ctl_write(cpu: u64, r: u64, value: u64) {
    write_volatile(control_reg(cpu, r) as *mut u64, value);
}

/// Parks this vCPU for good.
fn park() -> ! {
    loop {
        // SAFETY: halting with interrupts off only stops this vCPU.
        unsafe { asm!("cli", "hlt", options(nomem, nostack)) };
    }
}

extern "C" fn kmain(cpu: u64, boot: *const BootInfo) -> ! {
    // SAFETY: the VMM maps the boot info page and the control device, and
    // gives this vCPU exclusive use of its PerCpu, stacks and control block;
    // the IDT page is shared, and every vCPU writes the same gate values.
    unsafe {
        // IDT first, so that even a bad boot info pointer is reported. Every
        // vCPU fills it: idempotent (the same final value for every gate,
        // only the low qwords, each one atomic 8-byte store), and cheaper
        // than waiting for vCPU 0. Vector 3 (`int3`) is the syscall gate,
        // callable from ring 3; the other exceptions go to their stubs.
        let idt = IDT_GPA as *mut u64;
        let g0 = gate_low(addr_of!(nl_exc_stubs) as u64);
        let syscall_gate = gate_low(nl_int3_entry as *const () as u64) | GATE_DPL3;
        for v in 0..32u64 {
            let gate =
                if v == SYSCALL_VECTOR as u64 { syscall_gate } else { g0 + v * EXC_STUB_SIZE };
            write_volatile(idt.add(2 * v as usize), gate);
        }
        write_volatile(
            idt.add(2 * TIMER_VECTOR as usize),
            gate_low(nl_timer_entry as *const () as u64),
        );
        write_volatile(
            idt.add(2 * NET_VECTOR as usize),
            gate_low(nl_device_entry as *const () as u64),
        );
        write_volatile(
            idt.add(2 * DOORBELL_VECTOR as usize),
            gate_low(nl_doorbell_entry as *const () as u64),
        );
        write_volatile(
            idt.add(2 * SPURIOUS_VECTOR as usize),
            gate_low(nl_spurious_entry as *const () as u64),
        );

        let magic = read_volatile(addr_of!((*boot).magic));
        let version = read_volatile(addr_of!((*boot).version));
        if magic != BOOT_MAGIC || version != BOOT_VERSION {
            ctl_write(cpu, reg::ERROR_INFO, magic);
            ctl_write(cpu, reg::ERROR, ERR_BAD_BOOT_INFO);
            park();
        }

        // Syscalls.
        wrmsr(MSR_STAR, (u64::from(SEL_SYSRET_BASE) << 48) | (u64::from(SEL_KERNEL_CODE) << 32));
        wrmsr(MSR_LSTAR, nl_syscall_entry as *const () as u64);
        wrmsr(MSR_FMASK, RFLAGS_IF | RFLAGS_DF | RFLAGS_TF | RFLAGS_AC | RFLAGS_NT);

        // LAPIC timer. Software-enable the APIC first: while it is disabled
        // the LVT mask bits cannot be cleared.
        let count = read_volatile(addr_of!((*boot).lapic_timer_count));
        wrmsr(MSR_X2APIC_SVR, SVR_VALUE);
        wrmsr(MSR_X2APIC_TIMER_DIV, TIMER_DIV_1);
        wrmsr(MSR_X2APIC_LVT_TIMER, u64::from(TIMER_VECTOR) | LVT_TIMER_PERIODIC);
        wrmsr(MSR_X2APIC_TIMER_INIT, count);

        ctl_write(cpu, reg::PHASE, PHASE_KERNEL_UP);

        // Ring 3.
        let entry = read_volatile(addr_of!((*boot).user_entry));
        let mut rflags = RFLAGS_FIXED | RFLAGS_IF;
        if read_volatile(addr_of!((*boot).user_iopl)) != 0 {
            rflags |= RFLAGS_IOPL3;
        }
        asm!(
            "swapgs",
            "push {ss}",
            "push {rsp}",
            "push {rflags}",
            "push {cs}",
            "push {rip}",
            "iretq",
            ss = const SEL_USER_DATA,
            cs = const SEL_USER_CODE,
            rsp = in(reg) user_stack_top(cpu),
            rflags = in(reg) rflags,
            rip = in(reg) entry,
            in("rdi") cpu,
            in("rsi") BOOT_INFO_GPA,
            options(noreturn),
        );
    }
}

#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // Rust code only runs on this vCPU's kernel stack, which gives its index.
    let rsp: u64;
    // SAFETY: reads RSP only.
    unsafe { asm!("mov {}, rsp", out(reg) rsp, options(nomem, nostack, preserves_flags)) };
    let cpu = (rsp - KERNEL_STACKS_GPA) / KERNEL_STACK_SIZE;
    // SAFETY: the VMM maps this vCPU's control block.
    unsafe { ctl_write(cpu, reg::ERROR, ERR_KERNEL_PANIC) };
    park()
}

/// Referenced by the precompiled `core` when it is not optimized away (dev
/// builds without LTO); never called, since panics abort.
#[no_mangle]
extern "C" fn rust_eh_personality() {}
