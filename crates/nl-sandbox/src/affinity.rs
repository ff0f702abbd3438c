//! Host cores: how many this process may use, pinning threads to them, the
//! scheduling policy of a reserving budget's threads, and the absolute
//! sleeps of its server ([`crate::reserve`]).

use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
use nix::unistd::Pid;

use crate::SandboxError;

/// The cores this process may run on.
pub fn host_cores() -> Result<Vec<usize>, SandboxError> {
    let set = sched_getaffinity(Pid::from_raw(0)).map_err(|e| {
        SandboxError::Resource(format!("cannot read this process's CPU affinity: {e}"))
    })?;
    Ok((0..CpuSet::count()).filter(|&c| set.is_set(c).unwrap_or(false)).collect())
}

fn set_of(cores: &[usize]) -> Result<CpuSet, SandboxError> {
    let mut set = CpuSet::new();
    for &c in cores {
        set.set(c).map_err(|e| SandboxError::Config(format!("core {c}: {e}")))?;
    }
    Ok(set)
}

/// Pins thread `tid` (0: the calling thread) to `cores`.
pub fn pin(tid: i32, cores: &[usize]) -> Result<(), SandboxError> {
    sched_setaffinity(Pid::from_raw(tid), &set_of(cores)?).map_err(|e| {
        SandboxError::Resource(format!("cannot pin thread {tid} to cores {cores:?}: {e}"))
    })
}

/// Makes thread `tid` (0: the calling thread) `SCHED_FIFO` at `priority`
/// (a reserving budget's vCPU threads in their window, and the server that
/// opens and closes it, [`crate::reserve`]).
pub fn set_fifo(tid: i32, priority: i32) -> Result<(), SandboxError> {
    nl_vmm::sched::set_fifo(tid, priority).map_err(|e| {
        SandboxError::Resource(format!(
            "cannot make thread {tid} SCHED_FIFO (priority {priority}) for its reserved budget: {e}"
        ))
    })
}

/// Makes thread `tid` an ordinary (`SCHED_OTHER`) thread again.
pub fn set_other(tid: i32) -> std::io::Result<()> {
    nl_vmm::sched::set_other(tid)
}

/// `CLOCK_MONOTONIC` now, in nanoseconds.
pub fn monotonic_ns() -> u64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given, which lives
    // across the call; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// Sleeps until `CLOCK_MONOTONIC` reads `deadline_ns` (an absolute
/// deadline: a late wake-up does not shift the next one).
pub fn sleep_until(deadline_ns: u64) {
    let t = libc::timespec {
        tv_sec: (deadline_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (deadline_ns % 1_000_000_000) as libc::c_long,
    };
    // Bounded: an interrupted sleep resumes toward the same deadline, and
    // a signal storm cannot keep it past it by more than its own count.
    for _ in 0..1000 {
        // SAFETY: clock_nanosleep only reads `t`, which outlives the call;
        // with TIMER_ABSTIME the remainder pointer may be null.
        let r = unsafe {
            libc::clock_nanosleep(
                libc::CLOCK_MONOTONIC,
                libc::TIMER_ABSTIME,
                &t,
                std::ptr::null_mut(),
            )
        };
        if r != libc::EINTR {
            return;
        }
    }
}
