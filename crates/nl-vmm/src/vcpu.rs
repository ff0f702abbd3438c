//! The vCPU thread: KVM_RUN, exit dispatch to the buses, and the pause
//! protocol.
//!
//! Pausing is cooperative and consistent: the pauser raises a flag and kicks
//! the threads; a thread that sees the flag re-enters KVM_RUN once with
//! `immediate_exit` set, which completes any port or MMIO access still owed to
//! the guest, and only then parks. A parked vCPU's state is therefore exactly
//! the guest's architectural state, and its `VcpuFd` is free for state calls.

use std::sync::atomic::{
    AtomicBool, AtomicI32, AtomicU32, AtomicU64, Ordering::Relaxed, Ordering::SeqCst,
};
use std::sync::Arc;

use nl_sync::{Condvar, Guard, Lock};
use std::time::Duration;

use kvm_ioctls::{VcpuExit, VcpuFd};
use nl_devices::control::ControlState;
use nl_devices::Bus;
use serde::Serialize;

/// Why a vCPU thread ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum VcpuStop {
    /// The guest wrote PHASE_DONE.
    Done,
    /// The guest reported an error through the control device.
    GuestError,
    /// KVM_EXIT_SHUTDOWN: a triple fault.
    TripleFault { rip: u64 },
    /// The vCPU executed HLT with nothing to wake it (no in-kernel wake-up).
    Halted { rip: u64 },
    /// KVM could not run or emulate the guest.
    Internal(String),
    /// The VMM asked the thread to stop.
    Stopped,
}

impl VcpuStop {
    /// A stop that means the guest crashed.
    pub fn is_crash(&self) -> bool {
        matches!(
            self,
            VcpuStop::TripleFault { .. } | VcpuStop::Halted { .. } | VcpuStop::Internal(_)
        )
    }
}

/// What an emulation failure's message says before the instruction bytes
/// KVM's emulator fetched (when KVM reports them), in hex.
pub const EMULATOR_SAW: &str = "the emulator saw: ";

/// Exit counters of one vCPU (read by stats and, later, by the VMM watchdog).
#[derive(Default, Debug)]
pub struct VcpuStats {
    pub io: AtomicU64,
    pub mmio: AtomicU64,
    pub intr: AtomicU64,
    pub other: AtomicU64,
    /// Kernel id of the thread running this vCPU now (0: none); its CPU time
    /// is the guest's clock for hang detection (see [`crate::progress`]).
    pub tid: AtomicI32,
}

#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct VcpuStatsSnapshot {
    pub io_exits: u64,
    pub mmio_exits: u64,
    pub interrupted: u64,
    pub other_exits: u64,
}

impl VcpuStats {
    pub fn snapshot(&self) -> VcpuStatsSnapshot {
        VcpuStatsSnapshot {
            io_exits: self.io.load(Relaxed),
            mmio_exits: self.mmio.load(Relaxed),
            interrupted: self.intr.load(Relaxed),
            other_exits: self.other.load(Relaxed),
        }
    }
}

#[derive(Default)]
struct Counts {
    /// vCPU threads currently alive.
    active: u32,
    /// Threads parked because of a pause request.
    parked: u32,
}

/// Run control shared by the VM and all its vCPU threads.
///
/// Two kinds of pause keep the vCPUs parked: the pause flag
/// ([`Self::pause`], [`Self::resume`]: one owner at a time, as the
/// checkpoint supervisor, a handover or the API use it), and holds
/// ([`Self::hold`], [`Self::release_hold`]: counted, for a short visit
/// such as a fault injection). A resume clears the flag only: while a hold
/// is out the vCPUs stay parked, and a hold's release never lets a VM run
/// that someone else paused.
pub struct RunControl {
    pause: AtomicBool,
    holds: AtomicU32,
    stop: AtomicBool,
    counts: Arc<Lock<Counts>>,
    cond: Condvar,
}

impl Default for RunControl {
    fn default() -> Self {
        Self {
            pause: AtomicBool::new(false),
            holds: AtomicU32::new(0),
            stop: AtomicBool::new(false),
            counts: Lock::new("vm.run_counts", Counts::default()),
            cond: Condvar::new(),
        }
    }
}

impl RunControl {
    fn counts(&self) -> Guard<'_, Counts> {
        self.counts.lock()
    }

    pub(crate) fn thread_started(&self) {
        self.counts().active += 1;
    }

    fn thread_ended(&self) {
        self.counts().active -= 1;
        self.cond.notify_all();
    }

    fn park(&self) {
        let mut c = self.counts();
        c.parked += 1;
        self.cond.notify_all();
        while self.parks() && !self.stop.load(Relaxed) {
            c.wait(&self.cond);
        }
        c.parked -= 1;
        self.cond.notify_all();
    }

    /// Raises the pause flag without waiting; [`Self::pause`] then waits.
    pub(crate) fn request_pause(&self) {
        self.pause.store(true, Relaxed);
    }

    /// Raises the pause flag and waits until every live vCPU thread has parked,
    /// calling `kick` (which interrupts KVM_RUN) every millisecond meanwhile.
    pub(crate) fn pause(&self, kick: impl Fn()) {
        self.pause.store(true, Relaxed);
        self.wait_parked(kick);
    }

    /// Takes a hold (see the type's doc) and waits until every live vCPU
    /// thread has parked.
    pub(crate) fn hold(&self, kick: impl Fn()) {
        self.holds.fetch_add(1, Relaxed);
        self.wait_parked(kick);
    }

    /// Gives a hold back; the vCPUs run again only if nothing else keeps
    /// them parked.
    pub(crate) fn release_hold(&self) {
        let _c = self.counts();
        let _ = self.holds.fetch_update(Relaxed, Relaxed, |h| h.checked_sub(1));
        self.cond.notify_all();
    }

    /// Whether a vCPU thread must park: the pause flag or a hold.
    fn parks(&self) -> bool {
        self.pause.load(Relaxed) || self.holds.load(Relaxed) > 0
    }

    /// Waits until every live vCPU thread has parked, calling `kick`
    /// (which interrupts KVM_RUN) every millisecond meanwhile.
    fn wait_parked(&self, kick: impl Fn()) {
        loop {
            let c = self.counts();
            if c.parked >= c.active {
                return;
            }
            drop(c);
            kick();
            let mut c = self.counts();
            c.wait_for(&self.cond, Duration::from_millis(1));
        }
    }

    pub(crate) fn resume(&self) {
        let _c = self.counts();
        self.pause.store(false, Relaxed);
        self.cond.notify_all();
    }

    pub(crate) fn request_stop(&self) {
        let _c = self.counts();
        self.stop.store(true, Relaxed);
        self.cond.notify_all();
    }

    /// Makes the run counts consistent with the `live` vCPU threads (a
    /// microreset repair: a thread discarded inside `park` left `parked`
    /// counted). An unpaused VM has no parked thread. Returns what changed.
    pub(crate) fn repair_counts(&self, live: u32) -> Option<String> {
        let mut c = self.counts.try_lock_for(Duration::from_millis(20))?;
        let parked = if self.parks() { c.parked.min(live) } else { 0 };
        if c.active == live && c.parked == parked {
            return None;
        }
        let m = format!("run counts active {} parked {} -> {live} {parked}", c.active, c.parked);
        c.active = live;
        c.parked = parked;
        self.cond.notify_all();
        Some(m)
    }

    /// Clears pause and stop requests before new threads start.
    pub(crate) fn reset(&self) {
        let c = self.counts();
        debug_assert_eq!(c.active, 0);
        self.pause.store(false, Relaxed);
        self.stop.store(false, Relaxed);
    }

    /// Undoes `thread_started` for a thread that could not be spawned.
    pub(crate) fn thread_ended_without_running(&self) {
        self.thread_ended();
    }

    pub(crate) fn paused(&self) -> bool {
        self.parks()
    }

    /// A stop was requested (and not yet cleared by a relaunch).
    pub(crate) fn stopping(&self) -> bool {
        self.stop.load(Relaxed)
    }
}

/// What a vCPU thread needs besides its fd.
pub struct VcpuContext {
    pub io_bus: Arc<Bus>,
    pub mmio_bus: Arc<Bus>,
    pub control: Arc<ControlState>,
    pub run: Arc<RunControl>,
    /// The VM's console (its output is undone when an exit is re-executed).
    pub console: nl_devices::serial::Console,
    /// Sandbox channel windows: writes to read-only ones are violations.
    pub windows: Option<Arc<crate::windows::VmWindows>>,
}

/// The undo log of the exit a vCPU thread is handling: whether one is in
/// flight, and the console mark to undo its output back to, so that a
/// microreset re-executes it exactly once.
struct ExitLog {
    in_flight: AtomicBool,
    /// [`NOT_LOGGED`] unless undo logging recorded a mark for this exit.
    console_mark: AtomicU64,
}

/// The console mark of an exit handled without undo logging (a policy
/// other than a retrying microreset): there is nothing to undo, and undoing
/// back to 0 would cut the whole console file.
const NOT_LOGGED: u64 = u64::MAX;

impl Default for ExitLog {
    fn default() -> Self {
        ExitLog { in_flight: AtomicBool::new(false), console_mark: AtomicU64::new(NOT_LOGGED) }
    }
}

/// Dispatches again the port or MMIO exit that `vcpu`'s run structure
/// still describes (KVM completes it on the next KVM_RUN).
fn retry_exit(vcpu: &mut VcpuFd, cpu: usize, ctx: &VcpuContext) -> Option<VcpuStop> {
    let run = vcpu.get_kvm_run();
    match run.exit_reason {
        kvm_bindings::KVM_EXIT_IO => {
            // SAFETY: exit_reason is KVM_EXIT_IO, so `io` is the live member.
            let io = unsafe { run.__bindgen_anon_1.io };
            let len = usize::from(io.size) * io.count as usize;
            let off = io.data_offset as usize;
            // The data lies in the run mapping's second page (KVM_PIO_PAGE_OFFSET).
            if len == 0 || off < std::mem::size_of::<kvm_bindings::kvm_run>() || off + len > 8192 {
                return None;
            }
            // SAFETY: the range was checked to lie inside the vCPU's run mapping,
            // which lives as long as `vcpu` and is not aliased while we hold it.
            let data = unsafe {
                std::slice::from_raw_parts_mut(
                    (run as *mut kvm_bindings::kvm_run).cast::<u8>().add(off),
                    len,
                )
            };
            if io.direction == kvm_bindings::KVM_EXIT_IO_OUT as u8 {
                ctx.io_bus.write(cpu, u64::from(io.port), data);
            } else {
                ctx.io_bus.read(cpu, u64::from(io.port), data);
            }
        }
        kvm_bindings::KVM_EXIT_MMIO => {
            // SAFETY: exit_reason is KVM_EXIT_MMIO, so `mmio` is the live member.
            let m = unsafe { &mut run.__bindgen_anon_1.mmio };
            let len = (m.len as usize).min(8);
            if m.is_write != 0 {
                ctx.mmio_bus.write(cpu, m.phys_addr, &m.data[..len]);
            } else {
                ctx.mmio_bus.read(cpu, m.phys_addr, &mut m.data[..len]);
            }
        }
        _ => return None,
    }
    let regs = &ctx.control.vcpus[cpu];
    if regs.error.load(Relaxed) != 0 {
        return Some(VcpuStop::GuestError);
    }
    if regs.phase.load(Relaxed) == nl_abi::PHASE_DONE {
        return Some(VcpuStop::Done);
    }
    None
}

fn rip(fd: &VcpuFd) -> u64 {
    fd.get_regs().map(|r| r.rip).unwrap_or(0)
}

/// Body of vCPU thread `cpu`. Returns why it ended.
pub fn run_vcpu(
    cpu: usize,
    fd: Arc<Lock<VcpuFd>>,
    ctx: Arc<VcpuContext>,
    stats: Arc<VcpuStats>,
) -> VcpuStop {
    let _reg = crate::recovery::enter(true);
    stats.tid.store(nl_sync::tid(), SeqCst);
    crate::seccomp::apply(crate::seccomp::Kind::Vcpu);
    // Hang watchdog: busy while handling an exit, waiting inside KVM_RUN or parked.
    let progress = crate::detect::track();
    let log = ExitLog::default();
    let mut retry = false;
    let stop = loop {
        let r = crate::recovery::protected(|| {
            vcpu_loop(cpu, &fd, &ctx, &stats, &progress, &log, std::mem::take(&mut retry))
        });
        match r {
            crate::recovery::Outcome::Done(stop) => break stop,
            crate::recovery::Outcome::Recovered { retry: r } => {
                retry = r && log.in_flight.load(SeqCst);
            }
        }
    };
    stats.tid.store(0, SeqCst);
    ctx.run.thread_ended();
    ctx.control.poke();
    stop
}

fn lock(fd: &Lock<VcpuFd>) -> Guard<'_, VcpuFd> {
    fd.lock()
}

fn vcpu_loop(
    cpu: usize,
    fd: &Lock<VcpuFd>,
    ctx: &VcpuContext,
    stats: &VcpuStats,
    progress: &crate::detect::Progress,
    log: &ExitLog,
    retry: bool,
) -> VcpuStop {
    let regs = &ctx.control.vcpus[cpu];
    let undo_logging = crate::recovery::undo_logging();
    let mut vcpu = lock(fd);
    progress.resume();
    if retry {
        // Re-execute the exit this thread was discarded in, after undoing
        // its logged partial effects.
        let mark = log.console_mark.load(SeqCst);
        if mark != NOT_LOGGED {
            ctx.console.undo_to(mark);
        }
        if let Some(stop) = retry_exit(&mut vcpu, cpu, ctx) {
            return stop;
        }
    }
    loop {
        log.in_flight.store(false, SeqCst);
        progress.beat();
        if ctx.run.stop.load(Relaxed) {
            return VcpuStop::Stopped;
        }
        if ctx.run.parks() {
            // Complete any I/O still owed to the guest, then park with the fd unlocked.
            vcpu.set_kvm_immediate_exit(1);
            let _ = vcpu.run();
            vcpu.set_kvm_immediate_exit(0);
            drop(vcpu);
            progress.wait();
            crate::recovery::safe(|| ctx.run.park());
            vcpu = lock(fd);
            progress.resume();
            continue;
        }
        // From here until the next pass the run structure may hold an exit
        // not yet handled: a thread discarded in between re-executes it (its
        // console output after this mark undone first).
        if undo_logging {
            log.console_mark.store(ctx.console.mark(), SeqCst);
        }
        log.in_flight.store(true, SeqCst);
        progress.wait();
        let exit = crate::recovery::in_guest(|| vcpu.run());
        progress.resume();
        match exit {
            Ok(VcpuExit::IoOut(port, data)) => {
                stats.io.fetch_add(1, Relaxed);
                ctx.io_bus.write(cpu, u64::from(port), data);
            }
            Ok(VcpuExit::IoIn(port, data)) => {
                stats.io.fetch_add(1, Relaxed);
                ctx.io_bus.read(cpu, u64::from(port), data);
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                stats.mmio.fetch_add(1, Relaxed);
                ctx.mmio_bus.read(cpu, addr, data);
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                stats.mmio.fetch_add(1, Relaxed);
                if let Some(w) = ctx.windows.as_ref().filter(|w| w.readonly_at(addr)) {
                    // The guest's write is dropped; the guard decides the rest.
                    let len = data.len();
                    match w.violation(cpu, addr, len, rip(&vcpu)) {
                        crate::windows::GuardAction::Continue => continue,
                        crate::windows::GuardAction::Stop => {
                            regs.error_info.store(addr, Relaxed);
                            regs.error.store(nl_abi::ERR_CHANNEL_VIOLATION, Relaxed);
                            return VcpuStop::GuestError;
                        }
                    }
                }
                ctx.mmio_bus.write(cpu, addr, data);
                if regs.error.load(Relaxed) != 0 {
                    return VcpuStop::GuestError;
                }
                if regs.phase.load(Relaxed) == nl_abi::PHASE_DONE {
                    return VcpuStop::Done;
                }
            }
            Ok(VcpuExit::Shutdown) => return VcpuStop::TripleFault { rip: rip(&vcpu) },
            Ok(VcpuExit::Hlt) => return VcpuStop::Halted { rip: rip(&vcpu) },
            Ok(VcpuExit::InternalError) => {
                // SAFETY: the exit reason is KVM_EXIT_INTERNAL_ERROR, so `internal` is the live member.
                let sub = unsafe { vcpu.get_kvm_run().__bindgen_anon_1.internal.suberror };
                // SAFETY: as above; for suberror 1 (KVM_INTERNAL_ERROR_EMULATION)
                // `emulation_failure` is the live member, and its flag says
                // whether the instruction bytes are filled in.
                let saw = (sub == kvm_bindings::KVM_INTERNAL_ERROR_EMULATION).then(|| unsafe {
                    let f = vcpu.get_kvm_run().__bindgen_anon_1.emulation_failure;
                    let b = f.__bindgen_anon_1.__bindgen_anon_1;
                    let has = f.flags
                        & u64::from(
                            kvm_bindings::KVM_INTERNAL_ERROR_EMULATION_FLAG_INSTRUCTION_BYTES,
                        )
                        != 0;
                    (has && f.ndata >= 3 && b.insn_size > 0)
                        .then(|| b.insn_bytes[..usize::from(b.insn_size.min(15))].to_vec())
                });
                let saw = match saw.flatten() {
                    Some(b) => format!(
                        "; {EMULATOR_SAW}{}",
                        b.iter().map(|x| format!("{x:02x}")).collect::<Vec<_>>().join(" ")
                    ),
                    None => String::new(),
                };
                return VcpuStop::Internal(format!(
                    "KVM internal error (suberror {sub}: {}) at rip {:#x}{saw}",
                    if sub == 1 { "instruction emulation failed" } else { "see host kernel log" },
                    rip(&vcpu)
                ));
            }
            Ok(VcpuExit::FailEntry(reason, _)) => {
                return VcpuStop::Internal(format!(
                    "KVM could not enter the guest (hardware reason {reason:#x})"
                ));
            }
            Ok(VcpuExit::SystemEvent(kind, _)) => {
                return VcpuStop::Internal(format!(
                    "guest system event {kind} (reset or shutdown)"
                ));
            }
            Ok(VcpuExit::Intr) => {
                stats.intr.fetch_add(1, Relaxed);
            }
            Ok(_) => {
                stats.other.fetch_add(1, Relaxed);
            }
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                stats.intr.fetch_add(1, Relaxed);
            }
            Err(e) => return VcpuStop::Internal(format!("KVM_RUN failed: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// A stand-in vCPU thread on `run`: counts steps while it may run,
    /// parks as a vCPU thread does, ends when stopped (bounded).
    fn stand_in(run: &Arc<RunControl>, steps: &Arc<AtomicU64>) -> std::thread::JoinHandle<()> {
        run.thread_started();
        let (run, steps) = (run.clone(), steps.clone());
        std::thread::spawn(move || {
            for _ in 0..100_000_000u64 {
                if run.stop.load(Relaxed) {
                    break;
                }
                if run.parks() {
                    run.park();
                    continue;
                }
                steps.fetch_add(1, Relaxed);
                std::thread::yield_now();
            }
            run.thread_ended();
        })
    }

    /// Waits (bounded: 10 s) until the stand-in takes a step.
    fn runs_again(steps: &AtomicU64) -> bool {
        let (s, t) = (steps.load(Relaxed), Instant::now());
        while t.elapsed() < Duration::from_secs(10) {
            if steps.load(Relaxed) > s {
                return true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        false
    }

    /// No step while parked: sampled before and after a short wait.
    fn stays_parked(steps: &AtomicU64) -> bool {
        let s = steps.load(Relaxed);
        std::thread::sleep(Duration::from_millis(30));
        steps.load(Relaxed) == s
    }

    /// A supervisor's resume does not end a fault injector's hold, and the
    /// hold's release does not resume a VM the supervisor paused: the
    /// vCPUs run only when neither keeps them parked.
    #[test]
    fn a_resume_does_not_end_a_hold_nor_a_release_a_pause() {
        let run = Arc::new(RunControl::default());
        let steps = Arc::new(AtomicU64::new(0));
        let t = stand_in(&run, &steps);
        assert!(runs_again(&steps), "the stand-in never ran");

        // The injector holds; the supervisor pauses and resumes meanwhile.
        run.hold(|| {});
        run.pause(|| {});
        run.resume();
        assert!(run.paused(), "a resume ended the hold");
        assert!(stays_parked(&steps), "the vCPU ran during a hold");
        run.release_hold();
        assert!(runs_again(&steps), "the release did not let the vCPU run");

        // The supervisor pauses; the injector holds and releases meanwhile.
        run.pause(|| {});
        run.hold(|| {});
        run.release_hold();
        assert!(run.paused(), "the release ended the pause");
        assert!(stays_parked(&steps), "the vCPU ran during a pause");
        run.resume();
        assert!(runs_again(&steps), "the resume did not let the vCPU run");

        // A release without a hold never underflows into a hold.
        run.release_hold();
        assert!(!run.paused());
        run.request_stop();
        t.join().unwrap();
    }
}
