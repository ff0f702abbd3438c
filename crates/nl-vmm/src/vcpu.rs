//! The vCPU thread: KVM_RUN, exit dispatch to the buses, and the pause
//! protocol.
//!
//! Pausing is cooperative and consistent: the pauser raises a flag and kicks
//! the threads; a thread that sees the flag re-enters KVM_RUN once with
//! `immediate_exit` set, which completes any port or MMIO access still owed to
//! the guest, and only then parks. A parked vCPU's state is therefore exactly
//! the guest's architectural state, and its `VcpuFd` is free for state calls.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
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

/// Exit counters of one vCPU (read by stats and, later, by the VMM watchdog).
#[derive(Default, Debug)]
pub struct VcpuStats {
    pub io: AtomicU64,
    pub mmio: AtomicU64,
    pub intr: AtomicU64,
    pub other: AtomicU64,
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
#[derive(Default)]
pub struct RunControl {
    pause: AtomicBool,
    stop: AtomicBool,
    counts: Mutex<Counts>,
    cond: Condvar,
}

impl RunControl {
    fn counts(&self) -> MutexGuard<'_, Counts> {
        self.counts.lock().unwrap_or_else(|p| p.into_inner())
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
        while self.pause.load(Relaxed) && !self.stop.load(Relaxed) {
            c = self.cond.wait(c).unwrap_or_else(|p| p.into_inner());
        }
        c.parked -= 1;
        self.cond.notify_all();
    }

    /// Raises the pause flag and waits until every live vCPU thread has parked,
    /// calling `kick` (which interrupts KVM_RUN) every millisecond meanwhile.
    pub(crate) fn pause(&self, kick: impl Fn()) {
        self.pause.store(true, Relaxed);
        loop {
            let c = self.counts();
            if c.parked >= c.active {
                return;
            }
            drop(c);
            kick();
            let c = self.counts();
            let _ = self.cond.wait_timeout(c, Duration::from_millis(1));
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
        self.pause.load(Relaxed)
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
}

fn rip(fd: &VcpuFd) -> u64 {
    fd.get_regs().map(|r| r.rip).unwrap_or(0)
}

/// Body of vCPU thread `cpu`. Returns why it ended.
pub fn run_vcpu(
    cpu: usize,
    fd: Arc<Mutex<VcpuFd>>,
    ctx: Arc<VcpuContext>,
    stats: Arc<VcpuStats>,
) -> VcpuStop {
    let stop = vcpu_loop(cpu, &fd, &ctx, &stats);
    ctx.run.thread_ended();
    ctx.control.poke();
    stop
}

fn lock(fd: &Mutex<VcpuFd>) -> MutexGuard<'_, VcpuFd> {
    fd.lock().unwrap_or_else(|p| p.into_inner())
}

fn vcpu_loop(cpu: usize, fd: &Mutex<VcpuFd>, ctx: &VcpuContext, stats: &VcpuStats) -> VcpuStop {
    let regs = &ctx.control.vcpus[cpu];
    // Hang watchdog: busy while handling an exit, waiting inside KVM_RUN or parked.
    let progress = crate::detect::track();
    let mut vcpu = lock(fd);
    loop {
        progress.beat();
        if ctx.run.stop.load(Relaxed) {
            return VcpuStop::Stopped;
        }
        if ctx.run.pause.load(Relaxed) {
            // Complete any I/O still owed to the guest, then park with the fd unlocked.
            vcpu.set_kvm_immediate_exit(1);
            let _ = vcpu.run();
            vcpu.set_kvm_immediate_exit(0);
            drop(vcpu);
            progress.wait();
            ctx.run.park();
            vcpu = lock(fd);
            progress.resume();
            continue;
        }
        progress.wait();
        let exit = vcpu.run();
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
                return VcpuStop::Internal(format!(
                    "KVM internal error (suberror {sub}: {}) at rip {:#x}",
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
