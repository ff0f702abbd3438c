//! Self-test fault points for the tests of VMM recovery: a place in the
//! VMM that, once armed, runs a hook (a crash, a panic, a hang) on the N-th
//! pass from then on, and never otherwise.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;

/// One fault point. Unarmed, a pass costs one relaxed load.
pub struct FaultHook {
    /// Passes still to go before the hook runs (0: unarmed or spent).
    countdown: AtomicU64,
    hook: OnceLock<fn()>,
}

impl FaultHook {
    pub const fn new() -> Self {
        FaultHook { countdown: AtomicU64::new(0), hook: OnceLock::new() }
    }

    /// The `after`-th pass from now runs `hook` (the first hook armed stays).
    pub fn arm(&self, after: u64, hook: fn()) {
        let _ = self.hook.set(hook);
        self.countdown.store(after.max(1), std::sync::atomic::Ordering::SeqCst);
    }

    /// One pass: runs the hook if this is the armed one.
    #[inline]
    pub fn pass(&self) {
        if self.countdown.load(Relaxed) == 0 {
            return;
        }
        if self.countdown.fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1)) == Ok(1) {
            if let Some(h) = self.hook.get() {
                h();
            }
        }
    }
}

impl Default for FaultHook {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    static RAN: AtomicU32 = AtomicU32::new(0);

    #[test]
    fn runs_once_on_the_armed_pass() {
        let f = FaultHook::new();
        f.pass();
        f.arm(3, || {
            RAN.fetch_add(1, Relaxed);
        });
        f.pass();
        f.pass();
        assert_eq!(RAN.load(Relaxed), 0);
        f.pass();
        assert_eq!(RAN.load(Relaxed), 1);
        for _ in 0..5 {
            f.pass();
        }
        assert_eq!(RAN.load(Relaxed), 1);
    }
}
