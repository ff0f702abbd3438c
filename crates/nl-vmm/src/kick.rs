//! Kicking vCPU threads out of KVM_RUN.
//!
//! A real-time signal with an empty handler makes a blocked KVM_RUN return
//! EINTR. Kicks may be lost if they arrive while the thread is outside
//! KVM_RUN, so callers repeat them until the thread acknowledges.

use std::sync::Once;
use std::thread::JoinHandle;

use vmm_sys_util::signal::{register_signal_handler, Killable, SIGRTMIN};

/// The signal used for kicks.
pub fn kick_signal() -> i32 {
    SIGRTMIN()
}

extern "C" fn noop(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// Installs the kick handler once per process.
pub fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        register_signal_handler(kick_signal(), noop).expect("SIGRTMIN is a valid signal");
    });
}

/// Sends a kick to a vCPU thread (ignored if it has exited).
pub fn kick<T>(thread: &JoinHandle<T>) {
    let _ = thread.kill(kick_signal());
}
