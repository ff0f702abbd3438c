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
//! with `reserve: true` is also a reservation, a floor and a ceiling at
//! once: `runtime` of CPU in every `period`, opened on a fixed grid by a
//! server thread that makes the vCPU threads `SCHED_FIFO` for `runtime` and
//! ordinary threads again for the rest of the period ([`crate::reserve`],
//! which says why the kernel's real-time throttling alone, checked at the
//! 4 ms scheduler tick, is not a floor). The cgroup then gets real-time
//! bandwidth a little above the runtime (`cpu.rt_period_us` = period,
//! `cpu.rt_runtime_us` = [`crate::reserve::safety_net_us`], per core; the
//! sandbox has one vCPU per core) as a safety net, and a CFS quota of 1 ms
//! per second per thread for the time outside its windows. All reserving
//! cgroups together may have at most the host's `sched_rt_runtime_us`
//! share (95%) of a period.
//!
//! `budget.io` caps the sandbox's I/O threads (its net receive thread,
//! `vmN-netrx`) the same way, in a sibling cgroup of their own
//! (`ninelives-PID-SANDBOX-io`: `cpu.cfs_quota_us` = runtime per I/O
//! thread, `cpu.cfs_period_us` = period), pinned to the sandbox's cores: a
//! flood of frames into its TAP then costs the host at most that budget,
//! on the sandbox's cores.

use std::path::{Path, PathBuf};

use crate::config::{Budget, IoBudget};
use crate::SandboxError;

/// Where cgroup v1's cpu controller is mounted on most distributions.
const V1_CPU: &str = "/sys/fs/cgroup/cpu";

/// One sandbox's budget, applied: its cgroup holds its vCPU threads.
pub struct AppliedBudget {
    dir: PathBuf,
    pub budget: Budget,
    /// A reserving budget's window server.
    reservation: Option<crate::reserve::Reservation>,
    /// `budget.io`'s cgroup, holding the I/O threads.
    io: Option<IoCgroup>,
}

/// The cgroup of a sandbox's I/O threads (`budget.io`).
struct IoCgroup {
    dir: PathBuf,
    budget: IoBudget,
}

/// How often `budget.io` held the sandbox's I/O threads back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct IoThrottling {
    pub runtime_us: u64,
    pub period_us: u64,
    /// I/O threads in its cgroup now.
    pub threads: u64,
    pub periods: u64,
    pub throttled_periods: u64,
    pub throttled_us: u64,
    /// CPU used so far by the I/O threads in it now (their
    /// `/proc/self/task/TID/schedstat`; a restart's new threads start at 0;
    /// µs).
    pub cpu_us: u64,
}

/// How often the budget held a sandbox back (from the cgroup's `cpu.stat`).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct Throttling {
    pub periods: u64,
    pub throttled_periods: u64,
    pub throttled_us: u64,
    /// A reserving budget's windows, by the host's account.
    pub reserved: Option<crate::reserve::ReserveStats>,
    /// `budget.io`'s cgroup.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub io: Option<IoThrottling>,
}

/// A cgroup's `cpu.stat` counters: (periods, throttled periods, throttled µs).
fn cpu_stat(dir: &Path) -> (u64, u64, u64) {
    let text = std::fs::read_to_string(dir.join("cpu.stat")).unwrap_or_default();
    let get = |k: &str| {
        text.lines().find_map(|l| l.strip_prefix(k)?.trim().parse::<u64>().ok()).unwrap_or(0)
    };
    (get("nr_periods "), get("nr_throttled "), get("throttled_time ") / 1000)
}

fn tasks(dir: &Path) -> Vec<i32> {
    std::fs::read_to_string(dir.join("tasks"))
        .map(|t| t.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
}

/// Creates a cgroup under the cpu controller (there already is fine).
fn make_cgroup(sandbox: &str, dir: &Path) -> Result<(), SandboxError> {
    match std::fs::create_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(SandboxError::Resource(format!(
            "sandbox '{sandbox}': cannot create the cgroup {} for its budget: {e} \
             (budgets need root)",
            dir.display()
        ))),
    }
}

/// Removes the budget cgroups of `ninelives` processes that are gone (a
/// host killed, or one that died before it removed them): empty, their
/// owner's pid no longer alive. A reserved budget's real-time runtime stays
/// allotted while its cgroup exists, so a stale one would refuse every
/// reservation after it. Returns the ones removed.
pub fn sweep_stale(root: &Path) -> Vec<std::path::PathBuf> {
    let Ok(entries) = std::fs::read_dir(root) else { return Vec::new() };
    let mut removed = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix("ninelives-")) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        let dir = e.path();
        let gone = !Path::new(&format!("/proc/{pid}")).exists();
        if gone && dir.is_dir() && tasks(&dir).is_empty() && std::fs::remove_dir(&dir).is_ok() {
            removed.push(dir);
        }
    }
    removed
}

/// Moves the threads still in `dir` back to its parent, then removes it.
fn remove_cgroup(dir: &Path) {
    if let Some(parent) = dir.parent().map(|p| p.join("tasks")) {
        for tid in tasks(dir) {
            let _ = std::fs::write(&parent, tid.to_string());
        }
    }
    let _ = std::fs::remove_dir(dir);
}

impl IoCgroup {
    /// Sets the quota for `n` I/O threads (the period first: a quota is
    /// checked against the current period).
    fn set_quota(&self, n: usize) -> Result<(), SandboxError> {
        let n = n.max(1) as u64;
        write(&self.dir.join("cpu.cfs_period_us"), &self.budget.period_us.to_string())?;
        write(&self.dir.join("cpu.cfs_quota_us"), &(self.budget.runtime_us * n).to_string())
    }

    fn attach(&self, tids: &[i32]) -> Result<(), SandboxError> {
        self.set_quota(tids.len())?;
        for tid in tids {
            write(&self.dir.join("tasks"), &tid.to_string())?;
        }
        Ok(())
    }

    fn throttling(&self) -> IoThrottling {
        let (periods, throttled_periods, throttled_us) = cpu_stat(&self.dir);
        let threads = tasks(&self.dir);
        let cpu_ns: u64 = threads.iter().filter_map(|&t| crate::periodic::thread_cpu_ns(t)).sum();
        IoThrottling {
            runtime_us: self.budget.runtime_us,
            period_us: self.budget.period_us,
            threads: threads.len() as u64,
            periods,
            throttled_periods,
            throttled_us,
            cpu_us: cpu_ns / 1000,
        }
    }
}

impl Drop for IoCgroup {
    fn drop(&mut self) {
        remove_cgroup(&self.dir);
    }
}

fn write(path: &Path, what: &str) -> Result<(), SandboxError> {
    std::fs::write(path, what).map_err(|e| {
        SandboxError::Resource(format!("cannot write '{what}' to {}: {e}", path.display()))
    })
}

impl AppliedBudget {
    /// Creates the sandbox's cgroup (`ninelives-PID-SANDBOX` under the cpu
    /// controller), sets its quota for `threads` vCPU threads, and moves
    /// them into it; with `budget.io`, the same for `io_tids` (the I/O
    /// threads) in `ninelives-PID-SANDBOX-io`.
    pub fn apply(
        sandbox: &str,
        budget: Budget,
        tids: &[i32],
        io_tids: &[i32],
    ) -> Result<Self, SandboxError> {
        let root = Path::new(V1_CPU);
        if !root.join("cpu.cfs_quota_us").exists() {
            return Err(SandboxError::Resource(format!(
                "sandbox '{sandbox}' has a budget, but there is no cgroup v1 cpu controller at \
                 {V1_CPU} (cpu.cfs_quota_us) to enforce it; remove the budget or mount it"
            )));
        }
        for stale in sweep_stale(root) {
            eprintln!(
                "ninelives: removed the stale budget cgroup {} (its process is gone)",
                stale.display()
            );
        }
        let dir = root.join(format!("ninelives-{}-{sandbox}", std::process::id()));
        make_cgroup(sandbox, &dir)?;
        let mut applied = AppliedBudget { dir, budget, reservation: None, io: None };
        if let Some(io) = budget.io {
            let dir = root.join(format!("ninelives-{}-{sandbox}-io", std::process::id()));
            make_cgroup(sandbox, &dir)?;
            let cg = IoCgroup { dir, budget: io };
            cg.attach(io_tids)?;
            applied.io = Some(cg);
        }
        let n = tids.len().max(1) as u64;
        // The period first: a quota is checked against the current period.
        // A reservation's threads get 1 ms per second as ordinary threads
        // (outside their windows); a cap's get the runtime per period.
        let (cfs_period, cfs_quota) = if budget.reserve {
            (1_000_000, 1_000 * n)
        } else {
            (budget.period_us, budget.runtime_us * n)
        };
        write(&applied.dir.join("cpu.cfs_period_us"), &cfs_period.to_string())?;
        write(&applied.dir.join("cpu.cfs_quota_us"), &cfs_quota.to_string())?;
        if budget.reserve {
            let rt = applied.dir.join("cpu.rt_runtime_us");
            if !rt.exists() {
                return Err(SandboxError::Resource(format!(
                    "sandbox '{sandbox}' reserves its budget, but the kernel has no real-time \
                     group scheduling ({} is missing); use a budget without \"reserve\"",
                    rt.display()
                )));
            }
            let net = crate::reserve::safety_net_us(budget.runtime_us, budget.period_us);
            write(&applied.dir.join("cpu.rt_period_us"), &budget.period_us.to_string())?;
            // A cgroup removed just before (a set that ended, or a stale
            // one swept above) gives its real-time runtime back only once
            // the kernel has freed it: retry, bounded (0.5 s).
            let mut r = write(&rt, &net.to_string());
            for _ in 0..50 {
                if r.is_ok() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
                r = write(&rt, &net.to_string());
            }
            r.map_err(|e| {
                SandboxError::Resource(format!(
                    "sandbox '{sandbox}': cannot reserve {} us of every {} us ({net} us of \
                     real-time runtime): {e} (all reservations together may have at most the \
                     host's real-time share, /proc/sys/kernel/sched_rt_runtime_us of \
                     sched_rt_period_us)",
                    budget.runtime_us, budget.period_us
                ))
            })?;
        }
        applied.attach_threads(tids)?;
        if budget.reserve {
            applied.reservation = Some(crate::reserve::Reservation::start(
                sandbox,
                budget.runtime_us,
                budget.period_us,
                tids,
            )?);
        }
        Ok(applied)
    }

    /// Moves `tids` into the cgroup (a reservation's server makes them
    /// `SCHED_FIFO` in their windows).
    fn attach_threads(&self, tids: &[i32]) -> Result<(), SandboxError> {
        for tid in tids {
            write(&self.dir.join("tasks"), &tid.to_string())?;
        }
        Ok(())
    }

    /// Moves more threads (a restarted sandbox's new vCPUs, and its new
    /// I/O threads into the I/O cgroup) into the cgroup; the quota stays
    /// the sandbox's (threads that ended left it).
    pub fn attach(&self, tids: &[i32], io_tids: &[i32]) -> Result<(), SandboxError> {
        if let Some(io) = &self.io {
            io.attach(io_tids)?;
        }
        let n = tids.len().max(1) as u64;
        let quota = if self.budget.reserve { 1_000 * n } else { self.budget.runtime_us * n };
        write(&self.dir.join("cpu.cfs_quota_us"), &quota.to_string())?;
        self.attach_threads(tids)?;
        match &self.reservation {
            Some(r) => r.attach(tids),
            None => Ok(()),
        }
    }

    /// The cgroup's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Thread ids in the cgroup now.
    pub fn threads(&self) -> Vec<i32> {
        tasks(&self.dir)
    }

    /// The I/O cgroup's directory and thread ids now (with `budget.io`).
    pub fn io_cgroup(&self) -> Option<(&Path, Vec<i32>)> {
        self.io.as_ref().map(|io| (io.dir.as_path(), tasks(&io.dir)))
    }

    /// The cgroup's real-time runtime per period (µs; 0 without
    /// `reserve`): the reservation's safety net, a little above its runtime.
    pub fn rt_runtime_us(&self) -> u64 {
        std::fs::read_to_string(self.dir.join("cpu.rt_runtime_us"))
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Periods run and throttled so far.
    pub fn throttling(&self) -> Throttling {
        let (periods, throttled_periods, throttled_us) = cpu_stat(&self.dir);
        Throttling {
            periods,
            throttled_periods,
            throttled_us,
            reserved: self.reservation.as_ref().map(|r| r.stats()),
            io: self.io.as_ref().map(|io| io.throttling()),
        }
    }
}

impl Drop for AppliedBudget {
    fn drop(&mut self) {
        // The server first (it leaves its thread an ordinary one).
        self.reservation = None;
        self.io = None;
        // Threads still in it go back to the root group; then it can go.
        if let Some(parent) = self.dir.parent().map(|p| p.join("tasks")) {
            for tid in self.threads() {
                let _ = std::fs::write(&parent, tid.to_string());
            }
        }
        // Its real-time runtime is released now: a removed cgroup may
        // linger a while, and its runtime would still count against the
        // host's share (the next set's reservation was refused with EINVAL).
        let _ = std::fs::write(self.dir.join("cpu.rt_runtime_us"), "0");
        let _ = std::fs::remove_dir(&self.dir);
    }
}
