//! A microreset's thread handling, in a process of its own (no VM, no KVM):
//! the policy the detectors were installed with, the thread registry's
//! names, the recovery barrier, and a recovery started by the watchdog's
//! entry point that holds threads of this test process with the recovery
//! signal. A thread running VMM code must be discarded to its recovery
//! point (also one that enters its recovery point after the first signal);
//! a thread at a safe point and a "vCPU" in guest code must be kept.
//!
//! Everything runs in one test function: a recovery acts on every
//! registered thread of the process, so nothing else may run beside it.
//! Every wait is bounded; the recovery's own deadline ends the process if
//! a thread cannot be held. The detectors' panic hook ends the process on a
//! failed assertion (a panic outside a recovery point is fatal there), which
//! `cargo test` reports as a failure of this test binary.

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use nl_vmm::recovery::{self, threads, Outcome, Policy, Repairs};

/// Longest any thread of this test waits for anything.
const BOUND: Duration = Duration::from_secs(10);

/// Spawns a named thread that registers with the recovery registry and
/// then runs `body`; returns its tid (once registered) and its handle.
fn registered<R: Send + 'static>(
    name: &str,
    vcpu: bool,
    body: impl FnOnce() -> R + Send + 'static,
) -> (i32, std::thread::JoinHandle<R>) {
    let (tx, rx) = mpsc::channel();
    let h = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let _reg = recovery::enter(vcpu).expect("a free registry slot");
            tx.send(nl_sync::tid()).unwrap();
            body()
        })
        .unwrap();
    (rx.recv_timeout(BOUND).expect("the thread registered"), h)
}

fn slot_state(tid: i32) -> Option<u8> {
    threads::SLOTS.iter().find(|s| s.tid.load(SeqCst) == tid).map(|s| s.state.load(SeqCst))
}

/// Waits (bounded) until `cond` holds.
fn wait_for(what: &str, cond: impl Fn() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(t.elapsed() < BOUND, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_microreset_discards_running_threads_and_keeps_safe_and_guest_ones() {
    nl_vmm::detect::install(Policy::Microreset(Repairs::ALL));
    assert_eq!(recovery::policy(), Policy::Microreset(Repairs::ALL));
    assert!(recovery::undo_logging());

    // --- names: the first 15 bytes of the registered thread's name.
    let (tid, h) = registered("nl-name-of-a-long-thread", false, || ());
    h.join().unwrap();
    assert_eq!(threads::name_of(tid), None, "a finished thread's slot is freed");
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let (tid, h) = registered("nl-name-of-a-long-thread", false, move || {
        recovery::safe(|| go_rx.recv_timeout(BOUND))
    });
    assert_eq!(threads::name_of(tid).as_deref(), Some("nl-name-of-a-lo"));
    assert_eq!(threads::name_of(i32::MAX), None);
    go_tx.send(()).unwrap();
    h.join().unwrap().unwrap();

    // --- the barrier: no recovery, no wait.
    assert!(!threads::barrier(), "barrier waited with no recovery in progress");
    // A recovery coordinated by this thread: this thread does not wait.
    let me = nl_sync::tid();
    threads::COORDINATOR.store(me, SeqCst);
    threads::IN_PROGRESS.store(true, SeqCst);
    let (done_tx, done_rx) = mpsc::channel();
    let waiter = std::thread::spawn(move || {
        // Another thread taking the coordinator's tid is what the check
        // compares: run the check with this thread's tid as coordinator.
        threads::COORDINATOR.store(nl_sync::tid(), SeqCst);
        let waited = threads::barrier();
        done_tx.send(waited).unwrap();
    });
    let coordinator_waited = done_rx.recv_timeout(Duration::from_secs(2));
    if coordinator_waited.is_err() {
        threads::IN_PROGRESS.store(false, SeqCst);
    }
    waiter.join().unwrap();
    assert_eq!(coordinator_waited, Ok(false), "the coordinator waited at its own barrier");
    // One coordinated by another thread: a registered thread waits there
    // (state BARRIER) until the recovery ends, and says it waited.
    threads::COORDINATOR.store(me, SeqCst);
    let (tid, h) = registered("nl-barrier", false, || {
        let waited = threads::barrier();
        (waited, threads::IN_PROGRESS.load(SeqCst))
    });
    wait_for("the thread at the barrier", || slot_state(tid) == Some(threads::BARRIER));
    std::thread::sleep(Duration::from_millis(20));
    assert!(!h.is_finished(), "the barrier let a thread go during a recovery");
    threads::IN_PROGRESS.store(false, SeqCst);
    threads::COORDINATOR.store(0, SeqCst);
    assert_eq!(h.join().unwrap(), (true, false));

    // --- a recovery: one thread running VMM code, one at a safe point, one
    // "vCPU" in guest code (it leaves when the recovery starts, as KVM_RUN
    // does on the signal), all registered.
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let (run_tid, running) = registered("nl-running", false, move || {
        let t = Instant::now();
        let r = recovery::protected(|| {
            while !s.load(SeqCst) && t.elapsed() < BOUND {
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        (matches!(r, Outcome::Recovered { .. }), threads::IN_PROGRESS.load(SeqCst))
    });
    let (safe_tx, safe_rx) = mpsc::channel::<u32>();
    let (safe_tid, at_safe) = registered("nl-at-safe", false, move || {
        let r = recovery::protected(|| recovery::safe(|| safe_rx.recv_timeout(BOUND)));
        match r {
            Outcome::Done(v) => Some(v.ok()),
            Outcome::Recovered { .. } => None,
        }
    });
    let (guest_tid, in_guest) = registered("nl-in-guest", true, move || {
        let t = Instant::now();
        let r = recovery::protected(|| {
            recovery::in_guest(|| {
                while !threads::IN_PROGRESS.load(SeqCst) && t.elapsed() < BOUND {
                    std::thread::sleep(Duration::from_millis(1));
                }
            })
        });
        matches!(r, Outcome::Done(()))
    });
    // A thread that enters its recovery point only once the recovery has
    // started: the first signal finds it outside one, so only the
    // coordinator's repeated signal discards it.
    let s = stop.clone();
    let (_, late) = registered("nl-late", false, move || {
        let t = Instant::now();
        while !threads::IN_PROGRESS.load(SeqCst) && t.elapsed() < BOUND {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(5));
        let r = recovery::protected(|| {
            while !s.load(SeqCst) && t.elapsed() < BOUND {
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        matches!(r, Outcome::Recovered { .. })
    });
    wait_for("the threads to take their places", || {
        slot_state(safe_tid) == Some(threads::SAFE)
            && slot_state(guest_tid) == Some(threads::IN_GUEST)
    });
    assert_eq!(slot_state(run_tid), Some(threads::RUNNING));
    let seq = nl_vmm::event_log::last_seq();
    let completed = threads::COMPLETED.load(SeqCst);

    // The coordinator is a registered thread too (a vCPU or the API in
    // the VMM): it must not signal itself.
    let coordinator = recovery::enter(false).expect("a free registry slot");
    recovery::recover_from_watchdog("mutation test");
    drop(coordinator);

    assert_eq!(threads::COMPLETED.load(SeqCst), completed + 1);
    assert!(!threads::IN_PROGRESS.load(SeqCst));
    let (events, _) = nl_vmm::event_log::since(seq);
    let rec = events.iter().find(|e| e.kind == "recovery").expect("a recovery event");
    let hold = &rec.data["steps"][0];
    assert_eq!(hold["step"], "hold_threads", "{}", rec.data);
    // Only the thread that ran VMM code was discarded (named from the
    // registry); the safe one and the vCPU were kept.
    let mut abandoned: Vec<&str> = hold["detail"]["abandoned"]
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    abandoned.sort_unstable();
    assert_eq!(abandoned, ["nl-late", "nl-running"], "{}", rec.data);
    assert_eq!(rec.data["cause"], "mutation test");

    // The discarded thread came back through its recovery point, and only
    // once the recovery had ended (it waited at the barrier).
    stop.store(true, SeqCst);
    assert_eq!(running.join().unwrap(), (true, false));
    assert!(late.join().unwrap(), "the late thread was not discarded");
    // The vCPU left guest code, waited, and finished its call normally.
    assert!(in_guest.join().unwrap(), "the vCPU in guest code was discarded");
    // The safe thread still waits where it was, undisturbed.
    safe_tx.send(7).unwrap();
    assert_eq!(at_safe.join().unwrap(), Some(Some(7)), "the thread at a safe point was discarded");
}
