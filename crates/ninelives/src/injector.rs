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

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::ptrace;
use nix::sys::signal::Signal;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use serde::Serialize;

/// The fault to inject.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
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
    /// The API threads (the accept loop and connection threads).
    Api,
    /// Any VMM thread.
    Any,
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

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in 0..n (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Everything random about one injection, derived from its seed.
#[derive(Clone, Debug, Serialize)]
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
        let thread_pick = r.next();
        let (slot, bit) = match fault {
            Fault::Code => (r.below(15), r.below(8)),
            _ => (r.below(REGISTERS.len() as u64), r.below(64)),
        };
        Plan { seed, fault, trigger_ms, steps, thread_pick, slot, bit }
    }
}

/// What was injected where (the replayable log entry).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Injection {
    pub thread: String,
    pub tid: i32,
    /// User-mode instructions actually stepped.
    pub stepped: u64,
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
    /// Set when no fault went in (target gone, cancelled, ...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
}

/// The threads of `pid` matching `target`, sorted by name then tid.
pub fn candidate_threads(pid: i32, target: Target) -> Vec<(String, i32)> {
    let mut v = Vec::new();
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return v };
    for e in dir.flatten() {
        let Some(tid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(comm) = std::fs::read_to_string(e.path().join("comm")) else { continue };
        let name = comm.trim().to_string();
        let is_vcpu = name.starts_with("vm") && name.contains("-vcpu");
        let is_api = name == "ninelives" || name == "api-conn";
        let ok = match target {
            Target::Vcpu => is_vcpu,
            Target::Api => is_api,
            Target::Any => true,
        };
        if ok {
            v.push((name, tid));
        }
    }
    v.sort();
    v
}

/// Why stepping ended early.
enum Stop {
    Gone,
    Cancelled,
}

/// A seized thread; detached on drop whatever state it is in.
struct Traced {
    tid: Pid,
    /// Whether the thread is in a ptrace stop now.
    stopped: bool,
    /// A signal owed to the thread (seen in a signal-delivery stop).
    pending: Option<Signal>,
    gone: bool,
}

impl Traced {
    fn seize(tid: i32) -> nix::Result<Traced> {
        let tid = Pid::from_raw(tid);
        ptrace::seize(tid, ptrace::Options::empty())?;
        let mut t = Traced { tid, stopped: false, pending: None, gone: false };
        if let Err(e) = ptrace::interrupt(tid) {
            t.gone = e == Errno::ESRCH;
            return Err(e);
        }
        Ok(t)
    }

    /// Waits (polling, so it can be cancelled) for the next stop.
    /// Returns true for a single-step trap, false for any other stop.
    fn wait_stop(&mut self, cancel: &AtomicBool, deadline: Instant) -> Result<bool, Stop> {
        let mut spins = 0u32;
        loop {
            match waitpid(self.tid, Some(WaitPidFlag::__WALL | WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) => {}
                Ok(WaitStatus::Stopped(_, Signal::SIGTRAP)) => {
                    self.stopped = true;
                    return Ok(true);
                }
                Ok(WaitStatus::Stopped(_, sig)) => {
                    // Signal-delivery stop: the signal is delivered with the next resume.
                    self.stopped = true;
                    self.pending = Some(sig);
                    return Ok(false);
                }
                Ok(WaitStatus::PtraceEvent(..)) | Ok(WaitStatus::PtraceSyscall(_)) => {
                    self.stopped = true;
                    return Ok(false);
                }
                Ok(WaitStatus::Exited(..)) | Ok(WaitStatus::Signaled(..)) | Err(_) => {
                    self.gone = true;
                    return Err(Stop::Gone);
                }
                Ok(WaitStatus::Continued(_)) => {}
            }
            if cancel.load(Relaxed) || Instant::now() > deadline {
                return Err(Stop::Cancelled);
            }
            spins += 1;
            if spins < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }

    /// Single-steps one user-mode instruction (signal-delivery stops do not count).
    fn step(&mut self, cancel: &AtomicBool, deadline: Instant) -> Result<(), Stop> {
        loop {
            let sig = self.pending.take();
            if ptrace::step(self.tid, sig).is_err() {
                self.gone = true;
                return Err(Stop::Gone);
            }
            self.stopped = false;
            if self.wait_stop(cancel, deadline)? {
                return Ok(());
            }
        }
    }
}

impl Drop for Traced {
    fn drop(&mut self) {
        if self.gone {
            return;
        }
        if !self.stopped {
            // Running (e.g. blocked in a syscall mid-step): stop it to detach it.
            if ptrace::interrupt(self.tid).is_err() {
                return;
            }
            let never = AtomicBool::new(false);
            let limit = Instant::now() + Duration::from_secs(10);
            loop {
                match self.wait_stop(&never, limit) {
                    Ok(_) => break,
                    Err(Stop::Gone) => return,
                    // Still not stopped after 10 s: the thread must be in an
                    // uninterruptible wait; keep asking.
                    Err(Stop::Cancelled) => {
                        let _ = ptrace::interrupt(self.tid);
                    }
                }
            }
        }
        let _ = ptrace::detach(self.tid, self.pending.take());
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

/// Injects `plan` into the thread `(name, tid)`: seize, step, inject, detach.
pub fn inject_thread(
    plan: &Plan,
    name: &str,
    tid: i32,
    cancel: &AtomicBool,
    deadline: Instant,
) -> Injection {
    let mut rec = Injection { thread: name.to_string(), tid, ..Default::default() };
    let mut t = match Traced::seize(tid) {
        Ok(t) => t,
        Err(e) => {
            rec.skipped = Some(format!("cannot seize thread {tid}: {e}"));
            return rec;
        }
    };
    // The interrupt stop.
    match t.wait_stop(cancel, deadline) {
        Ok(_) => {}
        Err(Stop::Gone) => {
            rec.skipped = Some("target thread ended".into());
            return rec;
        }
        Err(Stop::Cancelled) => {
            rec.skipped = Some("cancelled".into());
            return rec;
        }
    }
    while rec.stepped < plan.steps {
        match t.step(cancel, deadline) {
            Ok(()) => rec.stepped += 1,
            Err(Stop::Gone) => {
                rec.skipped = Some("target thread ended while stepping".into());
                return rec;
            }
            Err(Stop::Cancelled) => {
                rec.skipped = Some("cancelled while stepping".into());
                return rec;
            }
        }
    }
    let Ok(mut regs) = ptrace::getregs(t.tid) else {
        rec.skipped = Some("cannot read registers".into());
        return rec;
    };
    rec.rip = format!("{:#x}", regs.rip);
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
                    // SAFETY: POKETEXT writes one word of the tracee's memory, not ours.
                    let w = unsafe {
                        ptrace::write(t.tid, word_addr as ptrace::AddressType, new as *mut _)
                    };
                    if w.is_ok() {
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
    drop(t);
    rec
}

/// Puts back the code word a `code` fault changed (best effort: the process
/// may be gone). Seizes any live thread of `pid` for it, then detaches.
pub fn repair(pid: i32, rec: &Injection) -> bool {
    let Some(addr) = rec.repair_addr else { return true };
    for (_, tid) in candidate_threads(pid, Target::Any) {
        let Ok(mut t) = Traced::seize(tid) else { continue };
        let never = AtomicBool::new(false);
        if t.wait_stop(&never, Instant::now() + Duration::from_secs(5)).is_err() {
            continue;
        }
        // SAFETY: POKETEXT writes one word of the tracee's memory, not ours.
        let ok =
            unsafe { ptrace::write(t.tid, addr as ptrace::AddressType, rec.repair_word as *mut _) }
                .is_ok();
        return ok;
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
    fn register_flip() {
        // SAFETY: user_regs_struct is plain integers; all-zero is valid.
        let mut regs: libc::user_regs_struct = unsafe { std::mem::zeroed() };
        assert_eq!(flip_register(&mut regs, 7, 3), (0, 8));
        assert_eq!(regs.rsp, 8);
        assert_eq!(flip_register(&mut regs, 17, 63), (0, 1 << 63));
    }
}
