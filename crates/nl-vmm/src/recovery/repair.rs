//! The steps of a microreset: hold every thread, then the repairs.

use std::sync::atomic::Ordering::SeqCst;
use std::time::{Duration, Instant};

use serde_json::json;

use super::threads::{self, SLOTS};
use super::{Repairs, Steps};

pub(crate) struct Held {
    /// Threads whose execution was discarded.
    pub abandoned: Vec<i32>,
    pub abandoned_names: Vec<String>,
    /// Every registered thread but the coordinator.
    pub all: Vec<i32>,
    /// Registered threads that were not discarded (at safe points, in guest).
    pub kept: Vec<i32>,
}

/// From the thread's registration: the coordinator may be a vCPU thread,
/// whose seccomp filter forbids opening /proc.
fn thread_name(tid: i32) -> String {
    threads::name_of(tid).filter(|n| !n.is_empty()).unwrap_or_else(|| format!("tid {tid}"))
}

/// Sends the recovery signal to every registered thread that runs VMM code
/// or guest code, until each is held (at the barrier or a safe point).
pub(crate) fn hold_all(me: i32) -> Result<Held, String> {
    let start = Instant::now();
    let mut last_signal: Option<Instant> = None;
    loop {
        let mut pending = Vec::new();
        for s in SLOTS.iter() {
            let tid = s.tid.load(SeqCst);
            if tid == 0 || tid == me {
                continue;
            }
            let st = s.state.load(SeqCst);
            if st == threads::RUNNING || st == threads::IN_GUEST {
                pending.push((tid, s.pthread.load(SeqCst)));
            }
        }
        if pending.is_empty() {
            break;
        }
        if start.elapsed() > super::RECOVERY_LIMIT / 2 {
            let names: Vec<String> = pending.iter().map(|(t, _)| thread_name(*t)).collect();
            return Err(format!("threads {names:?} could not be held"));
        }
        if last_signal.is_none_or(|t| t.elapsed() > Duration::from_millis(1)) {
            for (_, pt) in &pending {
                // SAFETY: the thread is registered (alive); a signal to a thread that
                // just ended fails with ESRCH, which is ignored.
                unsafe { libc::pthread_kill(*pt as libc::pthread_t, super::recovery_signal()) };
            }
            last_signal = Some(Instant::now());
        }
        std::thread::sleep(Duration::from_micros(20));
    }
    let mut held = Held {
        abandoned: Vec::new(),
        abandoned_names: Vec::new(),
        all: Vec::new(),
        kept: Vec::new(),
    };
    for s in SLOTS.iter() {
        let tid = s.tid.load(SeqCst);
        if tid == 0 || tid == me {
            continue;
        }
        held.all.push(tid);
        if s.abandoned.load(SeqCst) {
            held.abandoned.push(tid);
            held.abandoned_names.push(thread_name(tid));
        } else {
            held.kept.push(tid);
        }
    }
    Ok(held)
}

/// Runs the switched-on repairs, recording each one's time and result.
pub(crate) fn run(
    r: Repairs,
    abandoned: &[i32],
    kept: &[i32],
    steps: &mut Steps,
) -> Result<(), String> {
    if r.locks {
        // SAFETY: every registered thread not in `kept` jumped back to its
        // recovery point (or is this one, which did, or the watchdog, which
        // holds none): none will use the guards it held.
        let released = unsafe { nl_sync::force_release_all_but(kept) };
        let names: Vec<&str> = released.iter().map(|l| l.name).collect();
        steps.done("release_locks", json!(names));
    }
    if r.counters {
        // Each discarded thread clears its own counters as it leaves the barrier.
        steps.done("clear_counters", json!(abandoned.len()));
    }
    let hosts = super::live_hosts();
    if r.metadata {
        let mut fixed = Vec::new();
        for h in &hosts {
            for hv in h.hosted() {
                fixed.extend(hv.vm.repair_metadata());
            }
        }
        steps.done("metadata", json!(fixed));
    }
    if r.timers {
        let n: usize = hosts.iter().map(|h| h.events().rearm_interrupted()).sum();
        steps.done("rearm_timers", json!(n));
    }
    if r.memory {
        let (mut pages, mut problems) = (0u64, Vec::new());
        for h in &hosts {
            for hv in h.hosted() {
                let (p, mut e) = hv.vm.check_memory();
                pages += p;
                problems.append(&mut e);
            }
        }
        steps.done("memory_check", json!({"pages": pages, "problems": problems}));
    }
    Ok(())
}
