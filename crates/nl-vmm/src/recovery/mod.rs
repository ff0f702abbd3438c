//! Recovery of the VMM itself after a detected error (NiLiHype, ReHype).
//!
//! * `microreset` ([`Policy::Microreset`]): every VMM thread that was
//!   running VMM code is discarded back to its recovery point
//!   ([`point`]); threads blocked at safe points are held where they are;
//!   vCPUs are held out of KVM_RUN ([`threads`]). The thread that detected
//!   the error then repairs the VMM's state ([`repair`]) and lets all
//!   resume. Each repair is switchable ([`Repairs`]) to measure its effect.
//! * `microreboot` ([`Policy::Microreboot`]): the same hold, then the
//!   process saves its VMs' vCPU and device state and execs a fresh copy of
//!   itself, which maps the same guest memfds and re-creates the VMs
//!   ([`reboot`]).
//!
//! Every recovery prints one line on stderr, [`RECOVERED_PREFIX`] and a JSON
//! object with the per-step times (the paper's Tables II and III), or a
//! [`crate::detect::REPORT_PREFIX`] line with `"recovery_failed"` when it
//! cannot recover; then the process ends with [`crate::detect::DETECTED_EXIT`]
//! and no core dump.

pub mod point;
pub(crate) mod reboot;
pub(crate) mod repair;
pub mod threads;

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering::SeqCst};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use serde::Serialize;

pub use threads::{barrier, enter, in_guest, safe, Registration};

/// Start of the line a successful recovery prints on stderr.
pub const RECOVERED_PREFIX: &str = "NINELIVES-RECOVERED ";

/// The repairs of a microreset, in the order of the paper's Table I.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Repairs {
    /// Reset per-thread nesting counters (device-access depth, held-lock
    /// count): the paper's "clear IRQ count".
    pub counters: bool,
    /// Release every lock held by a discarded thread.
    pub locks: bool,
    /// Re-execute the VM exit each discarded vCPU was handling, after undoing
    /// its logged partial effects (console output).
    pub retry: bool,
    /// Make redundant metadata consistent from its most reliable copy
    /// (virtio queue indices from the guest-visible used ring; vCPU run
    /// counts from the thread registry).
    pub metadata: bool,
    /// Re-arm recurring events whose handlers were interrupted.
    pub timers: bool,
    /// Check and repair memory-tracking metadata (the page-frame check).
    pub memory: bool,
}

impl Repairs {
    pub const NAMES: [&'static str; 6] =
        ["counters", "locks", "retry", "metadata", "timers", "memory"];

    pub const ALL: Repairs = Repairs {
        counters: true,
        locks: true,
        retry: true,
        metadata: true,
        timers: true,
        memory: true,
    };
    pub const NONE: Repairs = Repairs {
        counters: false,
        locks: false,
        retry: false,
        metadata: false,
        timers: false,
        memory: false,
    };

    fn bits(self) -> u32 {
        [self.counters, self.locks, self.retry, self.metadata, self.timers, self.memory]
            .iter()
            .enumerate()
            .map(|(i, &b)| u32::from(b) << i)
            .sum()
    }

    fn from_bits(b: u32) -> Self {
        let on = |i: u32| b & (1 << i) != 0;
        Repairs {
            counters: on(0),
            locks: on(1),
            retry: on(2),
            metadata: on(3),
            timers: on(4),
            memory: on(5),
        }
    }

    /// Parses `all`, `none`, or a comma-separated list of [`Repairs::NAMES`].
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "all" => return Ok(Self::ALL),
            "none" | "" => return Ok(Self::NONE),
            _ => {}
        }
        let mut r = Self::NONE;
        for n in s.split(',').map(str::trim) {
            match n {
                "counters" => r.counters = true,
                "locks" => r.locks = true,
                "retry" => r.retry = true,
                "metadata" => r.metadata = true,
                "timers" => r.timers = true,
                "memory" => r.memory = true,
                o => {
                    return Err(format!(
                        "unknown repair \"{o}\" (all, none, or a list of {})",
                        Self::NAMES.join(", ")
                    ))
                }
            }
        }
        Ok(r)
    }

    /// The comma-separated names of the repairs that are on.
    pub fn describe(self) -> String {
        let v: Vec<&str> = Self::NAMES
            .iter()
            .enumerate()
            .filter(|(i, _)| self.bits() & (1 << i) != 0)
            .map(|(_, n)| *n)
            .collect();
        if v.is_empty() {
            "none".into()
        } else {
            v.join(",")
        }
    }
}

/// What the VMM does once an error is detected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Policy {
    /// End the VMM process (and its VMs): the baseline.
    #[default]
    None,
    Microreset(Repairs),
    Microreboot,
}

impl Policy {
    pub fn name(self) -> &'static str {
        match self {
            Policy::None => "none",
            Policy::Microreset(_) => "microreset",
            Policy::Microreboot => "microreboot",
        }
    }
}

static POLICY: AtomicU8 = AtomicU8::new(0);
static REPAIRS: AtomicU32 = AtomicU32::new(0);

/// Sets the process's policy (done once, by the detectors' installer).
pub(crate) fn set_policy(p: Policy) {
    let (k, r) = match p {
        Policy::None => (0, Repairs::NONE),
        Policy::Microreset(r) => (1, r),
        Policy::Microreboot => (2, Repairs::ALL),
    };
    REPAIRS.store(r.bits(), SeqCst);
    POLICY.store(k, SeqCst);
}

pub fn policy() -> Policy {
    match POLICY.load(SeqCst) {
        1 => Policy::Microreset(repairs()),
        2 => Policy::Microreboot,
        _ => Policy::None,
    }
}

/// Whether vCPU threads keep the undo log of each exit (only when a
/// microreset re-executes exits).
pub fn undo_logging() -> bool {
    matches!(policy(), Policy::Microreset(r) if r.retry)
}

/// Records the API socket a microreboot hands to the fresh process.
pub fn set_api(fd: i32, path: &std::path::Path) {
    API_TID.store(nl_sync::tid(), SeqCst);
    reboot::set_api(fd, path)
}

/// The thread serving the API (its accept loop), for a self-test.
static API_TID: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

fn repairs() -> Repairs {
    Repairs::from_bits(REPAIRS.load(SeqCst))
}

/// The signal that interrupts every VMM thread at the start of a recovery
/// (the paper's IPI to the other CPUs).
pub fn recovery_signal() -> libc::c_int {
    vmm_sys_util::signal::SIGRTMIN() + 1
}

extern "C" fn on_recovery_signal(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    let Some(slot) = threads::mine() else { return };
    if !threads::IN_PROGRESS.load(SeqCst) || slot.state.load(SeqCst) != threads::RUNNING {
        return;
    }
    if point::active() {
        slot.abandoned.store(true, SeqCst);
        // Held from here on: the coordinator re-sends the signal every
        // millisecond to threads still RUNNING, and one arriving once it
        // is unblocked below would nest another handler before the jump
        // (tests/recovery_threads.rs crashed with SIGSEGV inside the nested
        // handler's pthread_sigmask in about 1 run in 50; 0 in 300 with
        // this). The barrier the thread goes to after the jump keeps this
        // state.
        slot.state.store(threads::BARRIER, SeqCst);
        unblock(recovery_signal());
        point::jump();
    }
}

/// Unblocks `sig` for the calling thread (a handler leaving by a jump never
/// returns through sigreturn, which would restore the mask).
fn unblock(sig: libc::c_int) {
    // SAFETY: a zeroed sigset is valid input to sigemptyset; sigaddset and
    // pthread_sigmask are async-signal-safe and only touch this thread's mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, sig);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
    }
}

fn injector_flag() -> Option<&'static std::path::Path> {
    static F: std::sync::OnceLock<Option<std::path::PathBuf>> = std::sync::OnceLock::new();
    F.get_or_init(|| std::env::var_os(INJECTOR_REPAIR_ENV).map(Into::into)).as_deref()
}

/// Time the last wait for the injector took (µs), reported as a step.
static INJECTOR_WAIT_US: AtomicU64 = AtomicU64::new(0);

/// Under a fault injector: waits (bounded) until it has repaired an injected
/// code fault, as Gigan does at detection, before any more VMM code runs on
/// this thread (the recovery itself could run the corrupted instruction).
fn await_injector_repair() {
    let Some(flag) = injector_flag() else { return };
    let w = Instant::now();
    while !flag.exists() && w.elapsed() < INJECTOR_REPAIR_WAIT {
        std::thread::sleep(Duration::from_micros(100));
    }
    let _ = std::fs::remove_file(flag);
    INJECTOR_WAIT_US.store(w.elapsed().as_micros() as u64, SeqCst);
}

/// Installs the recovery signal's handler.
pub(crate) fn install() {
    let _ = injector_flag();
    // SAFETY: a zeroed sigaction is a valid start; the handler is
    // async-signal-safe and runs on the alternate stack.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_recovery_signal as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_RESTART;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(recovery_signal(), &sa, std::ptr::null_mut());
    }
    if policy() == Policy::Microreboot {
        reboot::prepare();
    }
}

/// Called from the fatal-signal handler on the faulting thread after the
/// report: discards the thread's execution to its recovery point when a
/// recovery policy is set and the thread has one. Returns if it cannot
/// (the caller then ends the process).
pub(crate) fn on_fatal_signal(sig: libc::c_int) {
    if POLICY.load(SeqCst) == 0 || !point::active() {
        return;
    }
    let Some(slot) = threads::mine() else { return };
    if threads::IN_PROGRESS.load(SeqCst) && threads::COORDINATOR.load(SeqCst) == nl_sync::tid() {
        // An error in the recovery itself: give up.
        return;
    }
    // While a recovery runs, an error on another thread (the same error
    // showing twice, as when two threads ran the same corrupted code before
    // it was caught) discards work the recovery discards anyway: the thread
    // goes back to its recovery point and waits at the barrier there.
    slot.abandoned.store(true, SeqCst);
    unblock(sig);
    point::jump();
}

/// Whether a panic on the calling thread can be recovered from: the thread
/// runs under a recovery point and no recovery is in progress. The panic
/// then unwinds to the recovery point.
pub(crate) fn panic_recoverable() -> bool {
    POLICY.load(SeqCst) != 0
        && point::active()
        && threads::mine().is_some()
        && !threads::IN_PROGRESS.load(SeqCst)
}

/// How a protected call ended.
pub enum Outcome<R> {
    Done(R),
    /// Discarded by a recovery (this thread's or another's); the caller
    /// resumes from its recovery point. `retry` says whether to re-execute
    /// the work that was in flight.
    Recovered {
        retry: bool,
    },
}

/// Runs `body` under the calling thread's recovery point. When the body is
/// discarded (an error on this thread, or a recovery started elsewhere),
/// this waits for the recovery to end (or runs it, on the thread that
/// detected the error) and returns [`Outcome::Recovered`].
pub fn protected<R>(body: impl FnOnce() -> R) -> Outcome<R> {
    let ended = point::call(body);
    let detected_here = match ended {
        point::Ended::Returned(r) => return Outcome::Done(r),
        // The panic hook reported it; unwinding released this thread's guards.
        point::Ended::Panicked => true,
        point::Ended::Abandoned => !threads::IN_PROGRESS.load(SeqCst),
    };
    if detected_here {
        await_injector_repair();
    }
    if let Some(s) = threads::mine() {
        s.abandoned.store(true, SeqCst);
    }
    if detected_here {
        coordinate(&format!("error on thread {}", thread_name()));
    } else {
        threads::barrier();
    }
    let r = repairs();
    if r.counters {
        nl_sync::reset_held_count();
        nl_devices::bus::reset_access_depth();
    }
    if let Some(s) = threads::mine() {
        s.abandoned.store(false, SeqCst);
    }
    Outcome::Recovered { retry: r.retry }
}

fn thread_name() -> String {
    std::thread::current().name().unwrap_or("unnamed").to_string()
}

/// Starts a recovery from a thread that is not itself discarded (the hang
/// watchdog) after `what` was detected. Returns once the VMM runs again;
/// ends the process if it cannot recover.
pub fn recover_from_watchdog(what: &str) {
    await_injector_repair();
    coordinate(what);
}

/// The hosts whose VMs recovery repairs (and microreboot hands over).
fn hosts() -> &'static nl_sync::Lock<Vec<Weak<crate::host::Host>>> {
    static H: std::sync::OnceLock<Arc<nl_sync::Lock<Vec<Weak<crate::host::Host>>>>> =
        std::sync::OnceLock::new();
    H.get_or_init(|| nl_sync::Lock::new("recovery.hosts", Vec::new()))
}

pub(crate) fn register_host(h: &Arc<crate::host::Host>) {
    let mut v = hosts().lock();
    v.retain(|w| w.strong_count() > 0);
    v.push(Arc::downgrade(h));
}

pub(crate) fn live_hosts() -> Vec<Arc<crate::host::Host>> {
    hosts().lock().iter().filter_map(Weak::upgrade).collect()
}

/// One timed step of a recovery.
#[derive(Clone, Debug, Serialize)]
pub struct Step {
    pub step: &'static str,
    pub us: f64,
    pub detail: serde_json::Value,
}

/// Set by a fault injector to a path it creates once it has repaired an
/// injected code fault: a recovery waits for it (at most
/// [`INJECTOR_REPAIR_WAIT`]) before it lets the VMM run again.
pub const INJECTOR_REPAIR_ENV: &str = "NINELIVES_INJECTOR_REPAIR_FLAG";
pub const INJECTOR_REPAIR_WAIT: Duration = Duration::from_millis(500);

/// Self-test fault point of recovery (see [`crate::selftest`]).
pub use crate::selftest::FAULT_IN_RECOVERY_ENV;

/// The timed steps of one recovery: each step ends when it is recorded.
pub(crate) struct Steps {
    pub list: Vec<Step>,
    since: Instant,
}

impl Steps {
    fn new(start: Instant) -> Self {
        Self { list: Vec::new(), since: start }
    }

    /// Times the next step from now.
    pub(crate) fn restart(&mut self) {
        self.since = Instant::now();
    }

    /// Records the step that ran from the previous one's end until now.
    pub(crate) fn done(&mut self, step: &'static str, detail: serde_json::Value) {
        let now = Instant::now();
        let us = now.duration_since(self.since).as_secs_f64() * 1e6;
        self.list.push(Step { step, us, detail });
        self.since = now;
    }
}

/// Times of recent recoveries, to refuse a storm (an error that recurs
/// right after every recovery).
static RECENT: [AtomicU64; 4] =
    [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];
/// More recoveries than [`RECENT`] holds within this window is a storm.
const STORM_WINDOW: Duration = Duration::from_secs(5);
/// A recovery that takes longer than this is abandoned (the process ends).
pub const RECOVERY_LIMIT: Duration = Duration::from_secs(2);

pub(crate) fn fail(why: &str) -> ! {
    crate::detect::report_line(&serde_json::json!({
        "detector": "recovery_failed", "thread": thread_name(), "tid": nl_sync::tid(),
        "policy": policy().name(), "message": why,
    }));
    // SAFETY: _exit ends the process at once, without a core dump.
    unsafe { libc::_exit(crate::detect::DETECTED_EXIT) }
}

/// Arms a timer that ends the process if this recovery does not finish.
fn arm_deadline() {
    extern "C" fn on_alarm(_: libc::c_int) {
        let msg = b"NINELIVES-DETECTED {\"detector\":\"recovery_failed\",\"message\":\"recovery did not finish in time\"}\n";
        // SAFETY: write and _exit are async-signal-safe.
        unsafe {
            libc::write(2, msg.as_ptr().cast(), msg.len());
            libc::_exit(crate::detect::DETECTED_EXIT);
        }
    }
    // SAFETY: installs an async-signal-safe handler and arms a one-shot real-time timer.
    unsafe {
        libc::signal(libc::SIGALRM, on_alarm as *const () as usize);
        let t = libc::itimerval {
            it_interval: libc::timeval { tv_sec: 0, tv_usec: 0 },
            it_value: libc::timeval {
                tv_sec: RECOVERY_LIMIT.as_secs() as i64,
                tv_usec: RECOVERY_LIMIT.subsec_micros() as i64,
            },
        };
        libc::setitimer(libc::ITIMER_REAL, &t, std::ptr::null_mut());
    }
}

pub(crate) fn disarm_deadline() {
    // SAFETY: disarms the timer armed by arm_deadline.
    unsafe {
        let t: libc::itimerval = std::mem::zeroed();
        libc::setitimer(libc::ITIMER_REAL, &t, std::ptr::null_mut());
    }
}

/// Runs a recovery on the calling thread (the one that detected the error).
fn coordinate(what: &str) {
    let me = nl_sync::tid();
    let policy = policy();
    if policy == Policy::None {
        fail(what);
    }
    if threads::IN_PROGRESS.compare_exchange(false, true, SeqCst, SeqCst).is_err() {
        // Another thread is recovering already: be held like the others.
        threads::barrier();
        return;
    }
    threads::COORDINATOR.store(me, SeqCst);
    arm_deadline();
    let t0 = Instant::now();
    let now_ms = crate::handover::mono_ns() / 1_000_000;
    let oldest = RECENT.iter().map(|a| a.load(SeqCst)).min().unwrap_or(0);
    if oldest != 0 && now_ms.saturating_sub(oldest) < STORM_WINDOW.as_millis() as u64 {
        fail(&format!(
            "{what}: {} recoveries within {} s, the error recurs",
            RECENT.len() + 1,
            STORM_WINDOW.as_secs()
        ));
    }
    let slot = RECENT.iter().min_by_key(|a| a.load(SeqCst)).expect("not empty");
    slot.store(now_ms, SeqCst);
    let mut steps = Steps::new(t0);
    let selftest = std::env::var_os(FAULT_IN_RECOVERY_ENV);
    let api_tid = API_TID.load(SeqCst);
    if selftest.as_deref().is_some_and(|v| v == "other") && api_tid != 0 && api_tid != me {
        // Self-test: the error shows on a second thread (the API's accept
        // loop) as the recovery starts.
        // SAFETY: tgkill to a thread of this process, whose handler expects it.
        unsafe { libc::syscall(libc::SYS_tgkill, libc::getpid(), api_tid, libc::SIGSEGV) };
        // Its handler finds this recovery in progress and waits at the
        // barrier: let it get there (bounded), so the test always sees the
        // second error inside this recovery, never after it on a slow host.
        let t = Instant::now();
        let at_barrier = || {
            threads::SLOTS
                .iter()
                .any(|s| s.tid.load(SeqCst) == api_tid && s.state.load(SeqCst) == threads::BARRIER)
        };
        while !at_barrier() && t.elapsed() < Duration::from_millis(500) {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    // 1. Hold every thread: discard those running VMM code, keep vCPUs out of KVM_RUN.
    let held = match repair::hold_all(me) {
        Ok(h) => h,
        Err(e) => fail(&format!("{what}: {e}")),
    };
    steps.done("hold_threads", serde_json::json!({"abandoned": held.abandoned_names}));
    if selftest.is_some_and(|v| v != "other") {
        // Self-test: a second error inside the recovery itself.
        // SAFETY: raising a signal on the calling thread has no memory effects.
        unsafe { libc::raise(libc::SIGSEGV) };
    }
    let waited = INJECTOR_WAIT_US.swap(0, SeqCst);
    if injector_flag().is_some() {
        steps.list.push(Step {
            step: "await_injector_repair",
            us: waited as f64,
            detail: serde_json::json!(null),
        });
    }
    let mut abandoned = held.abandoned.clone();
    abandoned.push(me);
    let result = match policy {
        // The repairs of a microreset let the discarded threads finish their
        // work (an exit in flight must complete before its vCPU's state can
        // be saved); then a fresh process replaces this one.
        Policy::Microreboot | Policy::Microreset(_) => {
            let r = if policy == Policy::Microreboot { Repairs::ALL } else { repairs() };
            repair::run(r, &abandoned, &held.kept, &mut steps)
        }
        Policy::None => unreachable!("checked above"),
    };
    if let Err(e) = result {
        fail(&format!("{what}: {e}"));
    }
    if policy == Policy::Microreboot {
        reboot::start(what.to_string(), t0, steps);
        threads::COMPLETED.fetch_add(1, SeqCst);
        disarm_deadline();
        arm_deadline();
        threads::COORDINATOR.store(0, SeqCst);
        threads::IN_PROGRESS.store(false, SeqCst);
        return;
    }
    let total_us = t0.elapsed().as_secs_f64() * 1e6;
    let n = threads::COMPLETED.fetch_add(1, SeqCst) + 1;
    report_recovered(&serde_json::json!({
        "policy": policy.name(), "repairs": repairs().describe(), "cause": what,
        "coordinator": thread_name(), "recovery": n, "total_us": total_us, "steps": steps.list,
    }));
    disarm_deadline();
    threads::COORDINATOR.store(0, SeqCst);
    threads::IN_PROGRESS.store(false, SeqCst);
}

fn report_recovered(v: &serde_json::Value) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{RECOVERED_PREFIX}{v}");
    crate::event_log::publish("recovery", v.clone());
}

#[cfg(test)]
mod mutation_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repairs_parse_and_describe() {
        assert_eq!(Repairs::parse("all").unwrap(), Repairs::ALL);
        assert_eq!(Repairs::parse("none").unwrap(), Repairs::NONE);
        let r = Repairs::parse("locks, counters").unwrap();
        assert!(r.locks && r.counters && !r.retry && !r.memory);
        assert_eq!(r.describe(), "counters,locks");
        assert_eq!(Repairs::ALL.describe(), Repairs::NAMES.join(","));
        assert_eq!(Repairs::from_bits(Repairs::ALL.bits()), Repairs::ALL);
        let e = Repairs::parse("locks,irq").unwrap_err();
        assert!(e.contains("unknown repair \"irq\""), "{e}");
    }
}
