//! A Gigan-style fault injector for a VMM process, from outside it (ptrace).
//!
//! One injection: wait for the first-level trigger (a time), pick a thread of
//! the target process by name, seize and interrupt it, single-step it a
//! planned number of user-mode instructions (the second-level trigger), then
//! inject one fault and detach:
//!
//! * `failstop`: RIP = 0;
//! * `register`: flip one bit of one of the 16 general-purpose registers
//!   (RSP among them), RFLAGS or RIP;
//! * `code`: flip one bit of one of the 15 bytes at RIP (PEEKTEXT/POKETEXT);
//!   the original word is kept so [`repair`] can put it back.
//!
//! Everything random comes from the run's seed ([`Plan::from_seed`]), so a run
//! can be replayed. The tracee is always detached before returning, also
//! when `cancel` is raised or the deadline passes; a thread that is running
//! is interrupted first.
//!
//! Single-stepping slows the target thread down by three orders of magnitude,
//! which the rest of the VMM must not mistake for a fault:
//!
//! * the VMM's hang watchdog is held stopped (seized too) while the target is
//!   stepped, so the stepped thread's missing heartbeats are not a "hang";
//! * a step that blocks (the thread is inside KVM_RUN with an idle guest, or
//!   in a blocking syscall) is cut after [`STEP_BLOCK_LIMIT`]: the thread is
//!   interrupted and the syscall counts as its one instruction;
//! * stepping has a wall-time budget: when it runs out, the fault goes in
//!   where the thread is (`budget_hit` in the log), so a stepped vCPU thread
//!   stalls its VM for a bounded time (the 3vm ping tolerates ~1 s: the TAP
//!   queues 1000 frames) and the thread cannot outlive its VM while stepped.
//!
//! The wait for each stop is a blocking `waitpid` (woken by the tracee's
//! stop, so steps are fast on a busy 2-core host), bounded by an [`Alarm`]
//! thread that interrupts it with a signal every few milliseconds.

pub mod sentinel;

use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering::Relaxed};
use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::ptrace;
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

/// The fault to inject.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Fault {
    /// RIP = 0.
    Failstop,
    /// A bit flip in a register.
    Register,
    /// A bit flip in the code at RIP (repaired once detected).
    Code,
    /// No injection: a control run (false-positive rate of the classifier).
    None,
}

impl Fault {
    pub fn name(self) -> &'static str {
        match self {
            Fault::Failstop => "failstop",
            Fault::Register => "register",
            Fault::Code => "code",
            Fault::None => "none",
        }
    }
}

/// Which threads of the VMM may be targeted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Target {
    /// A vCPU thread (vm*-vcpu*): it runs the exit handlers.
    Vcpu,
    /// The API event loop (the main thread's accept loop).
    Api,
    /// Any long-lived VMM thread: vCPUs, device threads (vm*-netrx), VM
    /// monitors, the watchdog and the accept loop. Short-lived threads
    /// (API connection threads) and kernel workers (kvm-nx-lpage-recovery)
    /// are never targets: they end or cannot be stepped.
    Any,
}

/// The kind of a VMM thread, from its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThreadKind {
    Vcpu,
    Device,
    Monitor,
    Watchdog,
    EventLoop,
    /// Short-lived, unknown, or not stepable: never a target.
    Other,
}

/// Classifies thread `tid` of process `pid` named `name`.
pub fn thread_kind(pid: i32, tid: i32, name: &str) -> ThreadKind {
    let vm_thread = |suffix: &str| {
        name.strip_prefix("vm").and_then(|r| r.split_once('-')).is_some_and(|(id, rest)| {
            !id.is_empty()
                && id.bytes().all(|b| b.is_ascii_digit())
                && rest.strip_prefix(suffix).is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
        })
    };
    if vm_thread("vcpu") {
        ThreadKind::Vcpu
    } else if vm_thread("netrx") {
        ThreadKind::Device
    } else if vm_thread("monitor") || name == "events" {
        // The host's event loop runs every VM's supervision.
        ThreadKind::Monitor
    } else if name == "watchdog" {
        ThreadKind::Watchdog
    } else if tid == pid {
        ThreadKind::EventLoop
    } else {
        ThreadKind::Other
    }
}

/// Kernel threads and user workers (PF_KTHREAD, PF_USER_WORKER) show up in
/// /proc/PID/task (KVM's kvm-nx-lpage-recovery is one) but never run user code.
fn is_kernel_worker(pid: i32, tid: i32) -> bool {
    const PF_USER_WORKER: u64 = 0x4000;
    const PF_KTHREAD: u64 = 0x0020_0000;
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")) else {
        return true;
    };
    // Fields after the command: state ppid pgrp session tty tpgid flags.
    let flags = stat
        .rsplit_once(") ")
        .and_then(|(_, r)| r.split_whitespace().nth(6))
        .and_then(|f| f.parse::<u64>().ok())
        .unwrap_or(0);
    flags & (PF_USER_WORKER | PF_KTHREAD) != 0
}

/// The registers a `register` fault may hit, in `REGISTERS` order.
pub const REGISTERS: [&str; 18] = [
    "rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp", "r8", "r9", "r10", "r11", "r12", "r13",
    "r14", "r15", "rflags", "rip",
];

/// splitmix64: small, seedable, the same everywhere.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x6e69_6e65_6c69_7665)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in 0..n (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// Everything random about one injection, derived from its seed.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Plan {
    pub seed: u64,
    pub fault: Fault,
    /// First-level trigger, from the start of the window.
    pub trigger_ms: u64,
    /// Second-level trigger: user-mode instructions single-stepped.
    pub steps: u64,
    /// Index into the sorted candidate threads (modulo their number).
    pub thread_pick: u64,
    /// `register`: index into [`REGISTERS`]; `code`: byte offset 0..15.
    pub slot: u64,
    /// The bit flipped (0..64 for registers, 0..8 for code bytes).
    pub bit: u64,
}

/// The most user-mode instructions stepped before injecting.
pub const MAX_STEPS: u64 = 20_000;

impl Plan {
    pub fn from_seed(seed: u64, fault: Fault, window_ms: (u64, u64)) -> Plan {
        let mut r = Rng::new(seed);
        let (lo, hi) = window_ms;
        let trigger_ms = lo + r.below(hi.saturating_sub(lo) + 1);
        let steps = r.below(MAX_STEPS + 1);
        let thread_pick = r.next_u64();
        let (slot, bit) = match fault {
            Fault::Code => (r.below(15), r.below(8)),
            _ => (r.below(REGISTERS.len() as u64), r.below(64)),
        };
        Plan { seed, fault, trigger_ms, steps, thread_pick, slot, bit }
    }
}

/// What was injected where (the replayable log entry).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Injection {
    pub thread: String,
    pub tid: i32,
    /// User-mode instructions actually stepped.
    pub stepped: u64,
    /// Wall time spent stepping (ms).
    pub step_ms: f64,
    /// Steps that blocked in a syscall and were cut (see [`STEP_BLOCK_LIMIT`]).
    pub blocked_steps: u64,
    /// The stepping budget ran out before `steps`: injected after `stepped`.
    pub budget_hit: bool,
    /// Whether the VMM's watchdog was held stopped while stepping.
    pub watchdog_held: bool,
    pub rip: String,
    /// `register`: the register; `code`: "code+N" (byte N after RIP).
    pub location: String,
    pub bit: u64,
    pub old: String,
    pub new: String,
    /// `code`: the word to write back at `repair_addr` (hex).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repair_addr: Option<u64>,
    #[serde(skip)]
    pub repair_word: i64,
    /// `code` under recovery: how the sentinel repaired it (see [`sentinel`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repair: Option<serde_json::Value>,
    /// Set when no fault went in (target gone, cancelled, ...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
}

/// The threads of `pid` matching `target`, sorted by name then tid.
pub fn candidate_threads(pid: i32, target: Target) -> Vec<(String, i32)> {
    let mut v: Vec<(String, i32)> = threads(pid)
        .into_iter()
        .filter(|(name, tid)| {
            let kind = thread_kind(pid, *tid, name);
            let ok = match target {
                Target::Vcpu => kind == ThreadKind::Vcpu,
                Target::Api => kind == ThreadKind::EventLoop,
                Target::Any => kind != ThreadKind::Other,
            };
            ok && !is_kernel_worker(pid, *tid)
        })
        .collect();
    v.sort();
    v
}

/// Yama's `ptrace_scope` (0 classic, 1 restricted to descendants, 2 admin
/// only, 3 none), or None where the kernel has no Yama.
pub fn yama_ptrace_scope() -> Option<u32> {
    std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope").ok()?.trim().parse().ok()
}

/// Makes the process `cmd` starts traceable by this process and its
/// descendants (the injector in this process, a sentinel it starts) where
/// Yama's `ptrace_scope` is 1: there, without CAP_SYS_PTRACE, only an
/// ancestor may trace, and a sentinel is the target's sibling. The child
/// declares this process its tracer with `prctl(PR_SET_PTRACER)` before it
/// executes; the declaration lasts across `exec`. On a kernel without Yama
/// the call fails with EINVAL, which is ignored (nothing to allow).
pub fn traceable_by_us(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    let tracer = std::process::id() as libc::c_ulong;
    // SAFETY: between fork and exec the closure only calls prctl(2), which
    // is async-signal-safe; it allocates nothing and takes no locks.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PTRACER, tracer, 0, 0, 0) != 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EINVAL) {
                    return Err(e);
                }
            }
            Ok(())
        });
    }
}

/// All threads of `pid` with their names.
pub fn threads(pid: i32) -> Vec<(String, i32)> {
    let mut v = Vec::new();
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return v };
    for e in dir.flatten() {
        let Some(tid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(comm) = std::fs::read_to_string(e.path().join("comm")) else { continue };
        v.push((comm.trim().to_string(), tid));
    }
    v
}

/// How long one single-step may block before the thread is interrupted (it
/// is then inside a blocking syscall or KVM_RUN, not running VMM code).
pub const STEP_BLOCK_LIMIT: Duration = Duration::from_millis(20);

/// How often the [`Alarm`] interrupts a blocked `waitpid`.
const ALARM_PERIOD: Duration = Duration::from_millis(5);

/// Why waiting or stepping ended early.
#[derive(Debug, PartialEq, Eq)]
enum Stop {
    Gone,
    Cancelled,
    /// The step did not complete within its limit (the thread is blocked).
    Blocked,
}

/// The signal the [`Alarm`] sends; its handler does nothing, and is
/// installed without SA_RESTART so it makes a blocked `waitpid` return EINTR.
const ALARM_SIGNAL: libc::c_int = libc::SIGUSR2;

extern "C" fn on_alarm(_: libc::c_int) {}

fn gettid() -> i32 {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::gettid() }
}

/// A thread that, while armed, sends [`ALARM_SIGNAL`] to the thread that
/// created it every [`ALARM_PERIOD`]: a bound for blocking waits.
struct Alarm {
    /// 1 while the owner waits, 0 otherwise, -1 to end the thread.
    state: Arc<AtomicI32>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Alarm {
    fn new() -> Alarm {
        static HANDLER: Once = Once::new();
        HANDLER.call_once(|| {
            // SAFETY: a zeroed sigaction is a valid start; the handler is an
            // empty extern "C" fn (async-signal-safe); no SA_RESTART on purpose.
            unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_alarm as *const () as usize;
                libc::sigemptyset(&mut sa.sa_mask);
                libc::sigaction(ALARM_SIGNAL, &sa, std::ptr::null_mut());
            }
        });
        let state = Arc::new(AtomicI32::new(0));
        let (st, owner) = (state.clone(), gettid());
        // SAFETY: getpid has no arguments and cannot fail.
        let pid = unsafe { libc::getpid() };
        let thread = std::thread::Builder::new()
            .name("inject-alarm".into())
            .spawn(move || loop {
                std::thread::sleep(ALARM_PERIOD);
                match st.load(Relaxed) {
                    -1 => return,
                    // SAFETY: tgkill to a thread of our own process, whose
                    // handler for this signal does nothing.
                    1 => unsafe {
                        libc::syscall(libc::SYS_tgkill, pid, owner, ALARM_SIGNAL);
                    },
                    _ => {}
                }
            })
            .ok();
        Alarm { state, thread }
    }

    fn arm(&self, on: bool) {
        self.state.store(i32::from(on), Relaxed);
    }
}

impl Drop for Alarm {
    fn drop(&mut self) {
        self.state.store(-1, Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What one wait for a tracee returned. Raw signal numbers: the VMM's
/// real-time signals (its kicks) have no `nix` `Signal`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Event {
    /// The thread ended.
    Ended,
    /// A single-step trap (or a SIGTRAP).
    Trap,
    /// A signal-delivery stop for this signal.
    Signal(i32),
    /// A ptrace event stop (`PTRACE_EVENT_*`).
    Ptrace(i32),
}

impl Event {
    /// For a signal-delivery stop, the signal the thread is owed.
    fn signal(self) -> Option<i32> {
        match self {
            Event::Trap => Some(libc::SIGTRAP),
            Event::Signal(s) => Some(s),
            Event::Ended | Event::Ptrace(_) => None,
        }
    }
}

/// Waits (blocking; EINTR when interrupted) for the next stop or the end of
/// tracee `tid`, or of any tracee for -1.
fn wait_event(tid: i32) -> Result<(Pid, Event), Errno> {
    let mut status = 0;
    // SAFETY: waitpid writes the status into a local int.
    let r = unsafe { libc::waitpid(tid, &mut status, libc::__WALL) };
    if r < 0 {
        return Err(Errno::last());
    }
    let ev = if !libc::WIFSTOPPED(status) {
        Event::Ended
    } else if status >> 16 != 0 {
        Event::Ptrace(status >> 16)
    } else if libc::WSTOPSIG(status) == libc::SIGTRAP {
        Event::Trap
    } else {
        Event::Signal(libc::WSTOPSIG(status))
    };
    Ok((Pid::from_raw(r), ev))
}

/// Resumes a stopped tracee (`PTRACE_CONT`, `PTRACE_SINGLESTEP` or
/// `PTRACE_DETACH`), delivering `sig`.
fn resume(request: libc::c_uint, tid: Pid, sig: Option<i32>) -> bool {
    let sig = sig.unwrap_or(0) as usize;
    // SAFETY: these requests read no memory; `data` is a signal number.
    unsafe { libc::ptrace(request, tid.as_raw(), 0usize, sig) == 0 }
}

/// A seized thread; detached on drop whatever state it is in.
struct Traced {
    tid: Pid,
    /// Whether the thread is in a ptrace stop now.
    stopped: bool,
    /// A signal owed to the thread (seen in a signal-delivery stop).
    pending: Option<i32>,
    gone: bool,
    /// Detached or ended and collected: nothing left to do on drop.
    settled: bool,
    alarm: Rc<Alarm>,
}

impl Traced {
    /// Seizes `tid` and interrupts it (its stop is still to be waited for).
    fn seize(tid: i32, alarm: &Rc<Alarm>) -> nix::Result<Traced> {
        let t = Traced::attach(tid, ptrace::Options::empty(), alarm)?;
        if let Err(e) = ptrace::interrupt(t.tid) {
            let mut t = t;
            t.gone = e == Errno::ESRCH;
            return Err(e);
        }
        Ok(t)
    }

    /// Seizes `tid` and leaves it running: it stops at its next signal or event.
    fn attach(tid: i32, options: ptrace::Options, alarm: &Rc<Alarm>) -> nix::Result<Traced> {
        let tid = Pid::from_raw(tid);
        ptrace::seize(tid, options)?;
        Ok(Traced::adopt(tid, alarm))
    }

    /// A thread traced already (auto-attached at its creation), running.
    fn adopt(tid: Pid, alarm: &Rc<Alarm>) -> Traced {
        Traced {
            tid,
            stopped: false,
            pending: None,
            gone: false,
            settled: false,
            alarm: alarm.clone(),
        }
    }

    /// Records a stop: for a signal-delivery stop, the signal to pass on.
    fn stop_for(&mut self, sig: Option<i32>) {
        self.stopped = true;
        self.pending = sig;
    }

    /// Detaches a stopped thread, delivering the signal it stopped for.
    fn detach(&mut self) {
        let _ = resume(libc::PTRACE_DETACH, self.tid, self.pending.take());
        self.settle();
    }

    /// Marks the thread as needing nothing more from us.
    fn settle(&mut self) {
        self.settled = true;
    }

    /// Resumes a stopped thread, delivering the signal it stopped for.
    fn resume(&mut self) {
        if resume(libc::PTRACE_CONT, self.tid, self.pending.take()) {
            self.stopped = false;
        } else {
            self.gone = true;
        }
    }

    /// Waits for the next stop, at most until `limit` (then [`Stop::Blocked`])
    /// or `deadline`/`cancel` (then [`Stop::Cancelled`]).
    /// Returns true for a single-step trap, false for any other stop.
    fn wait_stop(
        &mut self,
        cancel: &AtomicBool,
        deadline: Instant,
        limit: Option<Instant>,
    ) -> Result<bool, Stop> {
        // A blocking wait, not polling: the tracee's stop wakes us at once
        // (polling with sleeps or yields was slower on a busy 2-core host).
        loop {
            if cancel.load(Relaxed) || Instant::now() > deadline {
                return Err(Stop::Cancelled);
            }
            if limit.is_some_and(|l| Instant::now() > l) {
                return Err(Stop::Blocked);
            }
            self.alarm.arm(true);
            let r = wait_event(self.tid.as_raw());
            self.alarm.arm(false);
            match r {
                Err(Errno::EINTR) => {}
                Ok((_, ev)) => return self.took(ev),
                Err(_) => return self.took(Event::Ended),
            }
        }
    }

    /// Records what a wait returned: true for a single-step trap.
    fn took(&mut self, ev: Event) -> Result<bool, Stop> {
        match ev {
            Event::Trap => {
                self.stopped = true;
                Ok(true)
            }
            Event::Signal(sig) => {
                // Signal-delivery stop: the signal is delivered with the next resume.
                self.stopped = true;
                self.pending = Some(sig);
                Ok(false)
            }
            Event::Ptrace(_) => {
                self.stopped = true;
                Ok(false)
            }
            Event::Ended => {
                self.gone = true;
                Err(Stop::Gone)
            }
        }
    }

    /// Stops a running thread (interrupt, then wait for the stop, bounded by
    /// `deadline`; the thread is re-interrupted every second meanwhile).
    fn halt(&mut self, cancel: &AtomicBool, deadline: Instant) -> Result<(), Stop> {
        while !self.stopped {
            if ptrace::interrupt(self.tid).is_err() {
                self.gone = true;
                return Err(Stop::Gone);
            }
            let again = Instant::now() + Duration::from_secs(1);
            match self.wait_stop(cancel, deadline, Some(again)) {
                Ok(_) | Err(Stop::Blocked) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Single-steps one user-mode instruction (signal-delivery and other
    /// stops do not count). A step still blocked after [`STEP_BLOCK_LIMIT`]
    /// (a blocking syscall) is interrupted and counts; returns whether it was.
    fn step(&mut self, cancel: &AtomicBool, deadline: Instant) -> Result<bool, Stop> {
        loop {
            if !resume(libc::PTRACE_SINGLESTEP, self.tid, self.pending.take()) {
                self.gone = true;
                return Err(Stop::Gone);
            }
            self.stopped = false;
            match self.wait_stop(cancel, deadline, Some(Instant::now() + STEP_BLOCK_LIMIT)) {
                Ok(true) => return Ok(false),
                Ok(false) => {}
                Err(Stop::Blocked) => {
                    self.halt(cancel, deadline)?;
                    return Ok(true);
                }
                Err(e) => return Err(e),
            }
        }
    }
}

impl Drop for Traced {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        if !self.gone && !self.stopped {
            // Running (e.g. blocked in a syscall mid-step): stop it to detach it.
            // An uninterruptible wait can delay the stop; keep asking (bounded).
            let never = AtomicBool::new(false);
            let limit = Instant::now() + Duration::from_secs(60);
            let _ = self.halt(&never, limit);
        }
        if !self.gone && resume(libc::PTRACE_DETACH, self.tid, self.pending.take()) {
            return;
        }
        // The thread died while traced (its process ended): its exit must be
        // collected by us, the tracer, or the process stays a zombie that its
        // parent cannot reap. Bounded; ECHILD once there is nothing to collect.
        let limit = Instant::now() + Duration::from_secs(10);
        while Instant::now() < limit {
            self.alarm.arm(true);
            let r = wait_event(self.tid.as_raw());
            self.alarm.arm(false);
            match r {
                Err(Errno::EINTR) => {}
                Ok((_, Event::Ended)) | Err(_) => return,
                // A stop of a thread still alive: try to detach it again.
                Ok((_, ev)) => {
                    let sig = if let Event::Signal(s) = ev { Some(s) } else { None };
                    if resume(libc::PTRACE_DETACH, self.tid, sig) {
                        return;
                    }
                }
            }
        }
    }
}

/// Threads held stopped for a while (the VMM's watchdog while its target is
/// stepped), released on drop.
struct Hold(Vec<Traced>);

impl Hold {
    fn threads(tids: &[i32], alarm: &Rc<Alarm>, cancel: &AtomicBool, deadline: Instant) -> Hold {
        let mut held = Vec::new();
        for &tid in tids {
            let Ok(mut t) = Traced::seize(tid, alarm) else { continue };
            let limit = Instant::now() + Duration::from_secs(2);
            if t.wait_stop(cancel, deadline.min(limit), None).is_ok() {
                held.push(t);
            }
            // Otherwise dropping `t` detaches it.
        }
        Hold(held)
    }
}

fn flip_register(regs: &mut libc::user_regs_struct, slot: usize, bit: u64) -> (u64, u64) {
    let r: &mut u64 = match slot {
        0 => &mut regs.rax,
        1 => &mut regs.rbx,
        2 => &mut regs.rcx,
        3 => &mut regs.rdx,
        4 => &mut regs.rsi,
        5 => &mut regs.rdi,
        6 => &mut regs.rbp,
        7 => &mut regs.rsp,
        8 => &mut regs.r8,
        9 => &mut regs.r9,
        10 => &mut regs.r10,
        11 => &mut regs.r11,
        12 => &mut regs.r12,
        13 => &mut regs.r13,
        14 => &mut regs.r14,
        15 => &mut regs.r15,
        16 => &mut regs.eflags,
        _ => &mut regs.rip,
    };
    let old = *r;
    *r ^= 1 << bit;
    (old, *r)
}

/// Injects `plan` into the thread `(name, tid)` of process `pid`: seize,
/// step (at most `budget` of wall time), inject, detach. The process's
/// watchdog thread is held stopped while the target is stepped.
pub fn inject_thread(
    plan: &Plan,
    pid: i32,
    target: (&str, i32),
    budget: Duration,
    cancel: &AtomicBool,
    deadline: Instant,
) -> Injection {
    let alarm = Rc::new(Alarm::new());
    inject_traced(plan, pid, target, budget, cancel, deadline, &alarm, &mut |_| {}).release()
}

/// An injection whose target and held watchdog are still traced and stopped.
struct Injected {
    rec: Injection,
    hold: Hold,
    target: Option<Traced>,
}

impl Injected {
    /// Lets the process run untraced again.
    fn release(self) -> Injection {
        // The watchdog first, while the target is still stopped (the watchdog
        // excuses a stopped thread): once detached, the target may end the
        // process at once, and a thread still traced then would be ours to reap.
        drop(self.hold);
        drop(self.target);
        self.rec
    }
}

/// [`inject_thread`] without the detach. `before_fault` runs once the target
/// has been stepped, with the tids traced so far (target and watchdogs),
/// just before the fault goes in.
#[allow(clippy::too_many_arguments)]
fn inject_traced(
    plan: &Plan,
    pid: i32,
    (name, tid): (&str, i32),
    budget: Duration,
    cancel: &AtomicBool,
    deadline: Instant,
    alarm: &Rc<Alarm>,
    before_fault: &mut dyn FnMut(&[i32]),
) -> Injected {
    let mut rec = Injection { thread: name.to_string(), tid, ..Default::default() };
    let watchdogs: Vec<i32> = threads(pid)
        .into_iter()
        .filter(|(n, t)| *t != tid && thread_kind(pid, *t, n) == ThreadKind::Watchdog)
        .map(|(_, t)| t)
        .collect();
    // Held first, so the watchdog does not see the target stopped.
    let hold = Hold::threads(&watchdogs, alarm, cancel, deadline);
    rec.watchdog_held = !hold.0.is_empty();
    let mut t = match Traced::seize(tid, alarm) {
        Ok(t) => t,
        Err(e) => {
            rec.skipped = Some(format!("cannot seize thread {tid}: {e}"));
            return Injected { rec, hold, target: None };
        }
    };
    // The interrupt stop.
    match t.wait_stop(cancel, deadline, None) {
        Ok(_) => {}
        Err(Stop::Gone) => {
            rec.skipped = Some("target thread ended".into());
            return Injected { rec, hold, target: Some(t) };
        }
        Err(_) => {
            rec.skipped = Some("cancelled".into());
            return Injected { rec, hold, target: Some(t) };
        }
    }
    let t_step = Instant::now();
    while rec.stepped < plan.steps {
        if t_step.elapsed() > budget {
            rec.budget_hit = true;
            break;
        }
        match t.step(cancel, deadline) {
            Ok(blocked) => {
                rec.stepped += 1;
                rec.blocked_steps += u64::from(blocked);
            }
            Err(Stop::Gone) => {
                rec.skipped = Some("target thread ended while stepping".into());
                return Injected { rec, hold, target: Some(t) };
            }
            Err(_) => {
                rec.skipped = Some("cancelled while stepping".into());
                return Injected { rec, hold, target: Some(t) };
            }
        }
    }
    rec.step_ms = t_step.elapsed().as_secs_f64() * 1e3;
    let Ok(mut regs) = ptrace::getregs(t.tid) else {
        rec.skipped = Some("cannot read registers".into());
        return Injected { rec, hold, target: Some(t) };
    };
    rec.rip = format!("{:#x}", regs.rip);
    let mut traced: Vec<i32> = hold.0.iter().map(|h| h.tid.as_raw()).collect();
    traced.push(tid);
    before_fault(&traced);
    match plan.fault {
        Fault::None => rec.skipped = Some("control run: no fault".into()),
        Fault::Failstop => {
            rec.location = "rip".into();
            rec.old = format!("{:#x}", regs.rip);
            regs.rip = 0;
            rec.new = "0x0".into();
            if ptrace::setregs(t.tid, regs).is_err() {
                rec.skipped = Some("cannot write registers".into());
            }
        }
        Fault::Register => {
            let (old, new) = flip_register(&mut regs, plan.slot as usize, plan.bit);
            rec.location = REGISTERS[plan.slot as usize].into();
            rec.bit = plan.bit;
            (rec.old, rec.new) = (format!("{old:#x}"), format!("{new:#x}"));
            if ptrace::setregs(t.tid, regs).is_err() {
                rec.skipped = Some("cannot write registers".into());
            }
        }
        Fault::Code => {
            let addr = regs.rip.wrapping_add(plan.slot);
            let word_addr = addr & !7;
            let shift = (addr - word_addr) * 8 + plan.bit;
            rec.location = format!("code+{}", plan.slot);
            rec.bit = plan.bit;
            match ptrace::read(t.tid, word_addr as ptrace::AddressType) {
                Ok(word) => {
                    let new = word ^ (1i64 << shift);
                    rec.old = format!("{:#04x}", (word >> ((addr - word_addr) * 8)) as u8);
                    rec.new = format!("{:#04x}", (new >> ((addr - word_addr) * 8)) as u8);
                    if poke(t.tid, word_addr, new) {
                        rec.repair_addr = Some(word_addr);
                        rec.repair_word = word;
                    } else {
                        rec.skipped = Some(format!("cannot write code at {word_addr:#x}"));
                    }
                }
                Err(e) => rec.skipped = Some(format!("cannot read code at {word_addr:#x}: {e}")),
            }
        }
    }
    Injected { rec, hold, target: Some(t) }
}

/// Writes one word of a stopped tracee's memory (its code too: POKETEXT).
fn poke(tid: Pid, addr: u64, word: i64) -> bool {
    // SAFETY: POKETEXT writes one word of the tracee's memory, not ours.
    unsafe { ptrace::write(tid, addr as ptrace::AddressType, word as *mut _) }.is_ok()
}

/// Puts back the code word a `code` fault changed (best effort: the process
/// may be gone). Seizes any live thread of `pid` for it, then detaches.
pub fn repair(pid: i32, rec: &Injection) -> bool {
    let Some(addr) = rec.repair_addr else { return true };
    let alarm = Rc::new(Alarm::new());
    for (_, tid) in candidate_threads(pid, Target::Any) {
        let Ok(mut t) = Traced::seize(tid, &alarm) else { continue };
        let never = AtomicBool::new(false);
        if t.wait_stop(&never, Instant::now() + Duration::from_secs(5), None).is_err() {
            continue;
        }
        return poke(t.tid, addr, rec.repair_word);
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_are_replayable_and_in_range() {
        for seed in 0..500 {
            let a = Plan::from_seed(seed, Fault::Code, (100, 900));
            let b = Plan::from_seed(seed, Fault::Code, (100, 900));
            assert_eq!(
                (a.trigger_ms, a.steps, a.slot, a.bit),
                (b.trigger_ms, b.steps, b.slot, b.bit)
            );
            assert!((100..=900).contains(&a.trigger_ms));
            assert!(a.steps <= MAX_STEPS && a.slot < 15 && a.bit < 8);
            let r = Plan::from_seed(seed, Fault::Register, (0, 0));
            assert!(r.slot < 18 && r.bit < 64 && r.trigger_ms == 0);
        }
    }

    #[test]
    fn thread_kinds() {
        use ThreadKind::*;
        for (name, tid, kind) in [
            ("vm0-vcpu0", 11, Vcpu),
            ("vm12-vcpu3", 11, Vcpu),
            ("vm1-netrx", 11, Device),
            ("vm2-monitor", 11, Monitor),
            ("events", 11, Monitor),
            ("watchdog", 11, Watchdog),
            ("ninelives", 10, EventLoop),
            ("api-conn", 11, Other),
            ("kvm-nx-lpage-re", 11, Other),
            ("vmx-vcpu0", 11, Other),
            ("vm0-vcpu", 11, Vcpu),
            ("vm-vcpu0", 11, Other),
        ] {
            assert_eq!(thread_kind(10, tid, name), kind, "{name}");
        }
    }

    fn tracer_of(pid: i32) -> Option<String> {
        let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        s.lines().find_map(|l| l.strip_prefix("TracerPid:").map(|v| v.trim().to_string()))
    }

    /// A thread blocked in a syscall cannot be stepped: each step is cut
    /// after STEP_BLOCK_LIMIT, the budget ends the stepping, and the thread
    /// is left running and untraced.
    #[test]
    fn stepping_a_blocked_thread_is_bounded() {
        let mut child = std::process::Command::new("sleep").arg("60").spawn().expect("sleep runs");
        let pid = child.id() as i32;
        // Wait (bounded) until it sleeps: its start-up code can be stepped.
        for _ in 0..500 {
            let st = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            if st.rsplit_once(") ").is_some_and(|(_, r)| r.starts_with('S')) {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let plan = Plan {
            seed: 0,
            fault: Fault::None,
            trigger_ms: 0,
            steps: MAX_STEPS,
            thread_pick: 0,
            slot: 0,
            bit: 0,
        };
        let never = AtomicBool::new(false);
        let deadline = Instant::now() + Duration::from_secs(30);
        let rec =
            inject_thread(&plan, pid, ("sleep", pid), Duration::from_millis(200), &never, deadline);
        let tracer = tracer_of(pid);
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(rec.skipped.as_deref(), Some("control run: no fault"), "{rec:?}");
        assert!(rec.budget_hit && rec.blocked_steps >= 1, "{rec:?}");
        assert!(rec.stepped < MAX_STEPS && !rec.watchdog_held, "{rec:?}");
        assert_eq!(tracer.as_deref(), Some("0"), "still traced: {rec:?}");
    }

    /// A stop for a real-time signal (the VMM's kicks are SIGRTMIN) is a
    /// signal-delivery stop like any other, not the thread's end.
    #[test]
    fn real_time_signal_stops_are_seen() {
        let mut child = std::process::Command::new("sleep").arg("60").spawn().expect("sleep runs");
        let pid = child.id() as i32;
        let alarm = Rc::new(Alarm::new());
        let never = AtomicBool::new(false);
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut t = Traced::attach(pid, ptrace::Options::empty(), &alarm).expect("seize");
        let rt = libc::SIGRTMIN() + 1;
        // SAFETY: kill(2) to our own child.
        unsafe { libc::kill(pid, rt) };
        let got = t.wait_stop(&never, deadline, None);
        let pending = t.pending;
        // Detach without the signal (its default action would end `sleep`).
        t.pending = None;
        drop(t);
        let tracer = tracer_of(pid);
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(got, Ok(false));
        assert_eq!(pending, Some(rt));
        assert_eq!(tracer.as_deref(), Some("0"));
    }

    #[test]
    fn register_flip() {
        // SAFETY: user_regs_struct is plain integers; all-zero is valid.
        let mut regs: libc::user_regs_struct = unsafe { std::mem::zeroed() };
        assert_eq!(flip_register(&mut regs, 7, 3), (0, 8));
        assert_eq!(regs.rsp, 8);
        assert_eq!(flip_register(&mut regs, 17, 63), (0, 1 << 63));
    }
}
