//! The scheduling policy of host threads: `SCHED_FIFO` for the threads that
//! must get their core when they wake (a sandbox's reserved budget, a
//! supervisor beside its guest's vCPU threads), and back to ordinary.

/// Makes thread `tid` (0: the calling thread) `SCHED_FIFO` at `priority`.
/// Threads it starts afterwards inherit that policy.
pub fn set_fifo(tid: i32, priority: i32) -> std::io::Result<()> {
    set_policy(tid, libc::SCHED_FIFO, priority)
}

/// Makes thread `tid` an ordinary (`SCHED_OTHER`) thread again.
pub fn set_other(tid: i32) -> std::io::Result<()> {
    set_policy(tid, libc::SCHED_OTHER, 0)
}

fn set_policy(tid: i32, policy: i32, priority: i32) -> std::io::Result<()> {
    let param = libc::sched_param { sched_priority: priority };
    // SAFETY: sched_setscheduler only reads `param`, a valid sched_param
    // that outlives the call; a bad tid is an error return, not UB.
    let r = unsafe { libc::sched_setscheduler(tid, policy, &param) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A real-time stretch: while it lives the calling thread is `SCHED_FIFO`
/// at priority 1, with `SCHED_RESET_ON_FORK` (so threads it starts
/// meanwhile, vCPU threads among them, are ordinary), and it is ordinary
/// again when dropped.
///
/// For a thread that sleeps between short pieces of work on a core whose
/// other threads run a guest: on a PVM host an ordinary thread woken there
/// may wait behind a vCPU thread for seconds, a real-time one does not
/// (docs/sandboxes.md, "The `rollback` row's late stalls"). Measured there:
/// being real-time only while asleep, and ordinary for the work, was worse
/// than being ordinary throughout; real-time throughout removed the late
/// stalls. So the guard is meant to span the thread's whole loop.
#[must_use = "the thread is real-time only while the guard lives"]
pub struct Realtime {
    on: bool,
}

impl Realtime {
    /// Enters it; without the privilege (`CAP_SYS_NICE`, or an `RLIMIT_RTPRIO`
    /// of at least 1) the thread stays ordinary and [`Realtime::on`] says so.
    pub fn enter() -> Self {
        let on = set_policy(0, libc::SCHED_FIFO | libc::SCHED_RESET_ON_FORK, 1).is_ok();
        Realtime { on }
    }

    /// Whether the thread is real-time now.
    pub fn on(&self) -> bool {
        self.on
    }
}

impl Drop for Realtime {
    fn drop(&mut self) {
        if self.on {
            let _ = set_other(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calling thread's scheduling policy (`libc::SCHED_*`).
    fn policy() -> i32 {
        // SAFETY: sched_getscheduler takes a tid and touches no memory.
        unsafe { libc::sched_getscheduler(0) }
    }

    #[test]
    fn a_realtime_stretch_is_fifo_while_it_lives_and_ordinary_after() {
        std::thread::spawn(|| {
            assert_eq!(policy(), libc::SCHED_OTHER);
            let rt = Realtime::enter();
            if !rt.on() {
                // Without the privilege: refused, and the thread unchanged.
                assert_eq!(policy(), libc::SCHED_OTHER);
                return;
            }
            assert_eq!(policy() & !libc::SCHED_RESET_ON_FORK, libc::SCHED_FIFO);
            // A thread started meanwhile is ordinary.
            let child = std::thread::spawn(policy).join().unwrap();
            assert_eq!(child, libc::SCHED_OTHER);
            drop(rt);
            assert_eq!(policy(), libc::SCHED_OTHER);
        })
        .join()
        .unwrap();
    }
}
