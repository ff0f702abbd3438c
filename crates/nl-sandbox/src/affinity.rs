//! Host cores: how many this process may use, pinning threads to them, and
//! the real-time policy of a reserving budget's threads.

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

/// Makes thread `tid` `SCHED_FIFO` at priority 1 (a reserving budget's
/// vCPU threads, [`crate::budget`]).
pub fn set_fifo(tid: i32) -> Result<(), SandboxError> {
    let param = libc::sched_param { sched_priority: 1 };
    // SAFETY: sched_setscheduler only reads `param`, a valid sched_param
    // that outlives the call; a bad tid is an error return, not UB.
    let r = unsafe { libc::sched_setscheduler(tid, libc::SCHED_FIFO, &param) };
    if r != 0 {
        return Err(SandboxError::Resource(format!(
            "cannot make thread {tid} SCHED_FIFO for its reserved budget: {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}
