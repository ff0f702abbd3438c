//! A recovery point is current only once its registers are saved: a
//! signal that abandons the thread at any instant of entering or leaving
//! [`nl_vmm::recovery::point::call`] lands in a complete point (the new one
//! or the one around it), never in a half-made one (which would load zeros
//! into the stack pointer and crash the process).
//!
//! A thread enters and leaves points in a tight loop while another sends it
//! a signal whose handler calls `point::jump` as fast as it can. Bounded: a
//! fixed number of points and of signals.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nl_vmm::recovery::point::{self, Ended};

extern "C" fn on_signal(_: libc::c_int) {
    point::jump();
}

/// Unblocks SIGUSR2 after a jump out of its handler.
fn unblock() {
    // SAFETY: a signal set on this stack, changed only by these calls.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGUSR2);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
    }
}

#[test]
fn a_signal_at_any_instant_abandons_to_a_complete_point() {
    // SAFETY: a plain handler for SIGUSR2, which nothing else in this
    // test process uses; jump is async-signal-safe.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
        // Blocked while its handler runs (no nesting: a flood of nested
        // handlers would overflow the stack); a jump out of the handler
        // leaves it blocked, and the worker unblocks it (`unblock`).
        sa.sa_flags = 0;
        libc::sigemptyset(&mut sa.sa_mask);
        assert_eq!(libc::sigaction(libc::SIGUSR2, &sa, std::ptr::null_mut()), 0);
    }
    let done = Arc::new(AtomicBool::new(false));
    let tid = Arc::new(AtomicU64::new(0));
    let (abandoned, returned) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let worker = {
        let (done, tid, abandoned, returned) =
            (done.clone(), tid.clone(), abandoned.clone(), returned.clone());
        std::thread::spawn(move || {
            // SAFETY: pthread_self has no preconditions.
            tid.store(unsafe { libc::pthread_self() } as u64, SeqCst);
            // The outer point catches a signal that comes between inner ones.
            for _ in 0..200_000_000u32 {
                if done.load(SeqCst) {
                    break;
                }
                let r = point::call(|| point::call(|| std::hint::black_box(1u32)));
                match r {
                    Ended::Returned(Ended::Returned(_)) => returned.fetch_add(1, SeqCst),
                    _ => {
                        unblock();
                        abandoned.fetch_add(1, SeqCst)
                    }
                };
            }
        })
    };
    while tid.load(SeqCst) == 0 {
        std::thread::yield_now();
    }
    let t = Instant::now();
    let mut sent = 0u64;
    while sent < 200_000 && t.elapsed() < Duration::from_secs(30) {
        // SAFETY: the worker thread is alive until `done` is set, and it
        // is joined below, after the last signal.
        unsafe { libc::pthread_kill(tid.load(SeqCst) as libc::pthread_t, libc::SIGUSR2) };
        sent += 1;
    }
    done.store(true, SeqCst);
    worker.join().expect("the worker survived every signal");
    let (a, r) = (abandoned.load(SeqCst), returned.load(SeqCst));
    eprintln!("{sent} signals sent, {a} points abandoned, {r} returned");
    assert!(a > 0, "no signal abandoned a point: the test did not test anything");
}
