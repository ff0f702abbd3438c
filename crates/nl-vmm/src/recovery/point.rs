//! Recovery points: where a thread's abandoned execution resumes.
//!
//! [`call`] saves the callee-saved registers, the stack pointer and the
//! return address, then runs a function. [`jump`] (from a signal handler,
//! on any stack) restores them, so the `call` returns 1 as if the function
//! had returned: every frame in between is discarded without running its
//! destructors (locks they held stay held; recovery releases them). This is
//! the user-space form of NiLiHype discarding a CPU's hypervisor stack.
//!
//! Only `call`'s own frame is ever returned into, and only once, so nothing
//! "returns twice" in the compiler's view.

use std::cell::Cell;
use std::ffi::c_void;

/// Registers and control state saved by [`call`].
#[repr(C, align(16))]
#[derive(Default)]
pub struct JumpBuf {
    // rbx, rbp, r12, r13, r14, r15, rsp after return, return address, mxcsr|fpu cw
    regs: [u64; 9],
}

core::arch::global_asm!(
    ".pushsection .text.nl_recovery,\"ax\",@progbits",
    ".p2align 4",
    ".globl nl_recovery_call",
    ".hidden nl_recovery_call",
    ".type nl_recovery_call,@function",
    "nl_recovery_call:",
    "mov [rdi], rbx",
    "mov [rdi + 8], rbp",
    "mov [rdi + 16], r12",
    "mov [rdi + 24], r13",
    "mov [rdi + 32], r14",
    "mov [rdi + 40], r15",
    "lea rax, [rsp + 8]",
    "mov [rdi + 48], rax",
    "mov rax, [rsp]",
    "mov [rdi + 56], rax",
    "stmxcsr [rdi + 64]",
    "fnstcw [rdi + 68]",
    "sub rsp, 8",
    "mov rax, rsi",
    "mov rdi, rdx",
    "call rax",
    "add rsp, 8",
    "xor eax, eax",
    "ret",
    ".size nl_recovery_call, . - nl_recovery_call",
    ".p2align 4",
    ".globl nl_recovery_jump",
    ".hidden nl_recovery_jump",
    ".type nl_recovery_jump,@function",
    "nl_recovery_jump:",
    "cld",
    "ldmxcsr [rdi + 64]",
    "fldcw [rdi + 68]",
    "mov rbx, [rdi]",
    "mov rbp, [rdi + 8]",
    "mov r12, [rdi + 16]",
    "mov r13, [rdi + 24]",
    "mov r14, [rdi + 32]",
    "mov r15, [rdi + 40]",
    "mov rsp, [rdi + 48]",
    "mov eax, 1",
    "jmp qword ptr [rdi + 56]",
    ".size nl_recovery_jump, . - nl_recovery_jump",
    ".popsection",
);

extern "C" {
    fn nl_recovery_call(buf: *mut JumpBuf, f: extern "C" fn(*mut c_void), arg: *mut c_void) -> u32;
    fn nl_recovery_jump(buf: *const JumpBuf) -> !;
}

thread_local! {
    /// The innermost recovery point of this thread (null outside one).
    static CURRENT: Cell<*const JumpBuf> = const { Cell::new(std::ptr::null()) };
}

/// How a call under a recovery point ended.
pub enum Ended<R> {
    Returned(R),
    /// The body panicked (unwound to the recovery point; guards were dropped).
    Panicked,
    /// The body was discarded by [`jump`].
    Abandoned,
}

struct Call<F, R> {
    body: Option<F>,
    out: Option<std::thread::Result<R>>,
    /// The point being entered, made current by the trampoline.
    buf: *const JumpBuf,
}

extern "C" fn trampoline<F: FnOnce() -> R, R>(arg: *mut c_void) {
    // SAFETY: `arg` is the `Call` that `call` passed, alive for the whole call.
    let c = unsafe { &mut *arg.cast::<Call<F, R>>() };
    // Only now, with its registers saved, is the point current: a jump
    // until here goes to the point around this one (it abandons the thread
    // before it entered this one), never to a half-made point.
    CURRENT.with(|p| p.set(c.buf));
    if let Some(f) = c.body.take() {
        c.out = Some(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
    }
}

/// Runs `body` under a recovery point of the calling thread.
pub fn call<R>(body: impl FnOnce() -> R) -> Ended<R> {
    fn inner<F: FnOnce() -> R, R>(body: F) -> Ended<R> {
        let mut buf = JumpBuf::default();
        let mut c = Call::<F, R> { body: Some(body), out: None, buf: &buf };
        let prev = CURRENT.with(Cell::get);
        // SAFETY: `buf` and `c` outlive the call; the trampoline matches `c`'s type;
        // a jump back only discards frames below this one.
        let jumped = unsafe {
            nl_recovery_call(&mut buf, trampoline::<F, R>, (&mut c as *mut Call<F, R>).cast())
        };
        CURRENT.with(|p| p.set(prev));
        match (jumped, c.out.take()) {
            (0, Some(Ok(r))) => Ended::Returned(r),
            (0, Some(Err(_))) => Ended::Panicked,
            _ => Ended::Abandoned,
        }
    }
    inner(body)
}

/// Whether the calling thread is inside a recovery point.
pub fn active() -> bool {
    CURRENT.with(|p| !p.get().is_null())
}

/// Discards the calling thread's execution back to its innermost recovery
/// point. Async-signal-safe; returns only if there is no recovery point.
pub fn jump() {
    let buf = CURRENT.with(Cell::get);
    if !buf.is_null() {
        // SAFETY: `buf` belongs to a `call` frame of this thread that is still live.
        unsafe { nl_recovery_jump(buf) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn returns_and_abandons() {
        assert!(matches!(call(|| 5), Ended::Returned(5)));
        let lock = nl_sync::Lock::new("test.point", 0u32);
        let r = call(|| {
            let _g = lock.lock();
            let v: Vec<u8> = vec![1, 2, 3];
            if v.len() == 3 {
                jump();
            }
            7
        });
        assert!(matches!(r, Ended::Abandoned));
        // The abandoned guard was never dropped.
        assert!(lock.is_locked());
        // SAFETY: this thread abandoned the guard above.
        unsafe { nl_sync::force_release_owned_by(&[nl_sync::tid()]) };
        nl_sync::reset_held_count();
        assert_eq!(*lock.lock(), 0);
        assert!(!active());
        // Nested points unwind to the innermost one.
        let r = call(|| match call(jump) {
            Ended::Abandoned => 1,
            _ => 2,
        });
        assert!(matches!(r, Ended::Returned(1)));
    }

    /// The panic hook (process-wide) is left alone: swapping it would
    /// silence the panics of tests running in parallel. The "boom" line
    /// goes to this test's captured output.
    #[test]
    fn panics_are_caught() {
        let r = call(|| -> u32 { panic!("boom") });
        assert!(matches!(r, Ended::Panicked));
    }
}
