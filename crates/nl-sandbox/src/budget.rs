//! CPU budgets: a sandbox's vCPU threads may run `runtime_us` of every
//! `period_us` (Quest-V's main-VCPU budget C per period T).
//!
//! SCHED_DEADLINE would be the closest match, but Linux refuses it for a
//! thread whose affinity is narrower than its root domain (checked here:
//! `sched_setattr` gives EPERM once the thread is pinned), and sandboxes are
//! pinned to their cores. So a budget is a CFS bandwidth limit on a cgroup
//! of the sandbox's own: `cpu.cfs_quota_us` = runtime per vCPU thread,
//! `cpu.cfs_period_us` = period, in cgroup v1's cpu controller, where each
//! thread is placed by its id. (A cgroup v2-only host is refused with a
//! clear error for now: moving single threads there needs a threaded
//! subtree.) The cgroup is removed when the budget is dropped. Its
//! `cpu.stat` counts the periods in which the sandbox was throttled.
//!
//! A CFS quota caps a sandbox but reserves nothing: on a busy core the
//! sandbox gets its fair share, which may be far below its budget. A budget
//! with `reserve: true` is also a reservation: the same cgroup gets
//! real-time bandwidth (`cpu.rt_period_us` = period, `cpu.rt_runtime_us` =
//! runtime, per core; the sandbox has one vCPU per core) and the vCPU
//! threads run `SCHED_FIFO` (priority 1) in it. They then run before any
//! ordinary thread on their cores for `runtime` of every `period`, and the
//! kernel's real-time throttling stops them for the rest of it. (Quest-V's
//! main VCPUs are sporadic servers with budget C per period T; this is the
//! closest the host offers to pinned threads.) All reserving cgroups
//! together may have at most the host's `sched_rt_runtime_us` share
//! (95%) of a period.

use std::path::{Path, PathBuf};

use crate::config::Budget;
use crate::SandboxError;

/// Where cgroup v1's cpu controller is mounted on most distributions.
const V1_CPU: &str = "/sys/fs/cgroup/cpu";

/// One sandbox's budget, applied: its cgroup holds its vCPU threads.
pub struct AppliedBudget {
    dir: PathBuf,
    pub budget: Budget,
}

/// How often the budget held a sandbox back (from the cgroup's `cpu.stat`).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct Throttling {
    pub periods: u64,
    pub throttled_periods: u64,
    pub throttled_us: u64,
}

fn write(path: &Path, what: &str) -> Result<(), SandboxError> {
    std::fs::write(path, what).map_err(|e| {
        SandboxError::Resource(format!("cannot write '{what}' to {}: {e}", path.display()))
    })
}

impl AppliedBudget {
    /// Creates the sandbox's cgroup (`ninelives-PID-SANDBOX` under the cpu
    /// controller), sets its quota for `threads` vCPU threads, and moves
    /// them into it.
    pub fn apply(sandbox: &str, budget: Budget, tids: &[i32]) -> Result<Self, SandboxError> {
        let root = Path::new(V1_CPU);
        if !root.join("cpu.cfs_quota_us").exists() {
            return Err(SandboxError::Resource(format!(
                "sandbox '{sandbox}' has a budget, but there is no cgroup v1 cpu controller at \
                 {V1_CPU} (cpu.cfs_quota_us) to enforce it; remove the budget or mount it"
            )));
        }
        let dir = root.join(format!("ninelives-{}-{sandbox}", std::process::id()));
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => {
                return Err(SandboxError::Resource(format!(
                    "sandbox '{sandbox}': cannot create the cgroup {} for its budget: {e} \
                     (budgets need root)",
                    dir.display()
                )))
            }
        }
        let applied = AppliedBudget { dir, budget };
        let n = tids.len().max(1) as u64;
        // The period first: a quota is checked against the current period.
        write(&applied.dir.join("cpu.cfs_period_us"), &budget.period_us.to_string())?;
        write(&applied.dir.join("cpu.cfs_quota_us"), &(budget.runtime_us * n).to_string())?;
        if budget.reserve {
            let rt = applied.dir.join("cpu.rt_runtime_us");
            if !rt.exists() {
                return Err(SandboxError::Resource(format!(
                    "sandbox '{sandbox}' reserves its budget, but the kernel has no real-time \
                     group scheduling ({} is missing); use a budget without \"reserve\"",
                    rt.display()
                )));
            }
            write(&applied.dir.join("cpu.rt_period_us"), &budget.period_us.to_string())?;
            write(&rt, &budget.runtime_us.to_string()).map_err(|e| {
                SandboxError::Resource(format!(
                    "sandbox '{sandbox}': cannot reserve {} us of every {} us: {e} (all \
                     reservations together may have at most the host's real-time share, \
                     /proc/sys/kernel/sched_rt_runtime_us of sched_rt_period_us)",
                    budget.runtime_us, budget.period_us
                ))
            })?;
        }
        applied.attach_threads(tids)?;
        Ok(applied)
    }

    /// Moves `tids` into the cgroup; with a reservation they become
    /// `SCHED_FIFO` there (after the move: the root group's real-time
    /// runtime is not theirs to use).
    fn attach_threads(&self, tids: &[i32]) -> Result<(), SandboxError> {
        for tid in tids {
            write(&self.dir.join("tasks"), &tid.to_string())?;
            if self.budget.reserve {
                crate::affinity::set_fifo(*tid)?;
            }
        }
        Ok(())
    }

    /// Moves more threads (a restarted sandbox's new vCPUs) into the cgroup;
    /// the quota stays the sandbox's (threads that ended left it).
    pub fn attach(&self, tids: &[i32]) -> Result<(), SandboxError> {
        let n = tids.len().max(1) as u64;
        write(&self.dir.join("cpu.cfs_quota_us"), &(self.budget.runtime_us * n).to_string())?;
        self.attach_threads(tids)
    }

    /// The cgroup's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Thread ids in the cgroup now.
    pub fn threads(&self) -> Vec<i32> {
        std::fs::read_to_string(self.dir.join("tasks"))
            .map(|t| t.lines().filter_map(|l| l.trim().parse().ok()).collect())
            .unwrap_or_default()
    }

    /// The real-time runtime reserved per period (µs; 0 without `reserve`).
    pub fn reserved_us(&self) -> u64 {
        std::fs::read_to_string(self.dir.join("cpu.rt_runtime_us"))
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Periods run and throttled so far.
    pub fn throttling(&self) -> Throttling {
        let text = std::fs::read_to_string(self.dir.join("cpu.stat")).unwrap_or_default();
        let get = |k: &str| {
            text.lines().find_map(|l| l.strip_prefix(k)?.trim().parse::<u64>().ok()).unwrap_or(0)
        };
        Throttling {
            periods: get("nr_periods "),
            throttled_periods: get("nr_throttled "),
            throttled_us: get("throttled_time ") / 1000,
        }
    }
}

impl Drop for AppliedBudget {
    fn drop(&mut self) {
        // Threads still in it go back to the root group; then it can go.
        let parent = self.dir.parent().map(|p| p.join("tasks"));
        if let Some(parent) = parent {
            for tid in self.threads() {
                let _ = std::fs::write(&parent, tid.to_string());
            }
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}
