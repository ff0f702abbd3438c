//! Host cores: how many this process may use, and pinning threads to them.

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
