//! The registry of VMM threads recovery acts on, and their states.
//!
//! Every long-lived VMM thread registers ([`enter`]) and spends its life
//! either running VMM code under a recovery point, or blocked at a declared
//! safe point ([`safe`]) where it holds no shared state. A microreset sends
//! the recovery signal to every thread: a thread running VMM code is
//! abandoned (jumps back to its recovery point), a thread at a safe point is
//! left where it is and checks the barrier when it wakes up. The registry is
//! a fixed array of atomics, so the signal handlers can use it.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicU8, Ordering::SeqCst};
use std::time::Duration;

use std::cell::Cell;

pub const MAX_THREADS: usize = 512;

/// Running VMM code (abandoned by a recovery signal).
pub const RUNNING: u8 = 1;
/// Blocked at a safe point (not abandoned; checks the barrier on waking).
pub const SAFE: u8 = 2;
/// A vCPU inside KVM_RUN (a recovery signal makes it leave).
pub const IN_GUEST: u8 = 3;
/// Held at the recovery barrier.
pub const BARRIER: u8 = 4;

pub struct Slot {
    pub tid: AtomicI32,
    pub pthread: AtomicU64,
    pub state: AtomicU8,
    pub vcpu: AtomicBool,
    /// Discarded by the current recovery (its locks are released).
    pub abandoned: AtomicBool,
    /// The thread's name (its first 15 bytes), kept here so a coordinator
    /// names it without opening /proc, which seccomp forbids a vCPU.
    pub name: [AtomicU8; 16],
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Slot = Slot {
    tid: AtomicI32::new(0),
    pthread: AtomicU64::new(0),
    state: AtomicU8::new(0),
    vcpu: AtomicBool::new(false),
    abandoned: AtomicBool::new(false),
    name: [const { AtomicU8::new(0) }; 16],
};

pub static SLOTS: [Slot; MAX_THREADS] = [EMPTY; MAX_THREADS];

/// A recovery is in progress (threads must not run VMM code).
pub static IN_PROGRESS: AtomicBool = AtomicBool::new(false);
/// The thread coordinating it.
pub static COORDINATOR: AtomicI32 = AtomicI32::new(0);
/// Recoveries completed in this process.
pub static COMPLETED: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static MINE: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// The name a registered thread `tid` had when it registered.
pub fn name_of(tid: i32) -> Option<String> {
    let s = SLOTS.iter().find(|s| s.tid.load(SeqCst) == tid)?;
    let b: Vec<u8> = s.name.iter().map(|b| b.load(SeqCst)).take_while(|&b| b != 0).collect();
    Some(String::from_utf8_lossy(&b).into_owned())
}

/// The calling thread's slot, if registered.
pub fn mine() -> Option<&'static Slot> {
    let i = MINE.with(Cell::get);
    SLOTS.get(i)
}

/// A registration; the slot is freed on drop.
pub struct Registration(usize);

impl Drop for Registration {
    fn drop(&mut self) {
        let s = &SLOTS[self.0];
        s.state.store(0, SeqCst);
        s.abandoned.store(false, SeqCst);
        s.tid.store(0, SeqCst);
        MINE.with(|m| m.set(usize::MAX));
    }
}

/// Registers the calling thread (a vCPU thread if `vcpu`). With no free
/// slot the thread runs unregistered: a recovery then cannot hold it.
pub fn enter(vcpu: bool) -> Option<Registration> {
    let tid = nl_sync::tid();
    for (i, s) in SLOTS.iter().enumerate() {
        if s.tid.compare_exchange(0, tid, SeqCst, SeqCst).is_ok() {
            // SAFETY: pthread_self has no preconditions.
            s.pthread.store(unsafe { libc::pthread_self() } as u64, SeqCst);
            s.vcpu.store(vcpu, SeqCst);
            s.abandoned.store(false, SeqCst);
            let name = std::thread::current().name().unwrap_or("").as_bytes().to_vec();
            for (j, b) in s.name.iter().enumerate() {
                b.store(if j < 15 { name.get(j).copied().unwrap_or(0) } else { 0 }, SeqCst);
            }
            s.state.store(RUNNING, SeqCst);
            MINE.with(|m| m.set(i));
            return Some(Registration(i));
        }
    }
    None
}

fn set_state(v: u8) {
    if let Some(s) = mine() {
        s.state.store(v, SeqCst);
    }
}

/// Waits while a recovery coordinated by another thread is in progress.
/// Returns whether it waited.
pub fn barrier() -> bool {
    if !IN_PROGRESS.load(SeqCst) || COORDINATOR.load(SeqCst) == nl_sync::tid() {
        return false;
    }
    set_state(BARRIER);
    // Bounded by the recovery's own time limit, which ends the process.
    while IN_PROGRESS.load(SeqCst) {
        std::thread::sleep(Duration::from_micros(20));
    }
    set_state(RUNNING);
    true
}

/// Runs `f`, a blocking wait during which the thread holds no shared state
/// and does nothing a recovery must stop; then waits at the barrier.
pub fn safe<R>(f: impl FnOnce() -> R) -> R {
    set_state(SAFE);
    let r = f();
    set_state(RUNNING);
    barrier();
    r
}

/// Runs `f`, a vCPU's KVM_RUN: the recovery signal interrupts it.
pub fn in_guest<R>(f: impl FnOnce() -> R) -> R {
    set_state(IN_GUEST);
    let r = f();
    set_state(RUNNING);
    barrier();
    r
}
