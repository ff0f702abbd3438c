//! Locks that VMM recovery can repair.
//!
//! A microreset abandons the threads that were running VMM code when an
//! error was detected: their stacks are discarded, so the guards they held
//! are never dropped. Every VMM lock is therefore a [`Lock`], which
//! - registers itself in one process-wide registry when it is created
//!   (the paper's "all static locks in one segment"),
//! - records the thread that owns it, so recovery releases only the locks
//!   of abandoned threads ([`force_release_owned_by`]),
//! - counts the locks each thread holds ([`held_by_current_thread`]), which
//!   tells whether a thread blocked somewhere is inside a critical section.
//!
//! The lock itself is a `parking_lot` mutex (no poisoning: a panic inside a
//! critical section is an error the detectors handle, not a state to carry).

use std::cell::Cell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicI32, Ordering::Relaxed};
use std::sync::{Arc, Weak};
use std::time::Duration;

pub use parking_lot::Condvar;

mod fault_hook;
pub use fault_hook::FaultHook;

thread_local! {
    static HELD: Cell<u32> = const { Cell::new(0) };
    static TID: Cell<i32> = const { Cell::new(0) };
}

/// The calling thread's kernel id (cached; async-signal-safe after first use).
pub fn tid() -> i32 {
    TID.with(|t| {
        if t.get() == 0 {
            // SAFETY: gettid has no arguments and cannot fail.
            t.set(unsafe { libc::gettid() });
        }
        t.get()
    })
}

/// Locks the calling thread holds now.
pub fn held_by_current_thread() -> u32 {
    HELD.with(Cell::get)
}

/// Sets the calling thread's count of held locks (recovery resets it to 0
/// for a thread whose stack was discarded together with its guards).
pub fn reset_held_count() {
    HELD.with(|h| h.set(0));
}

/// A registered, force-releasable mutex.
pub struct Lock<T: ?Sized> {
    name: &'static str,
    owner: AtomicI32,
    inner: parking_lot::Mutex<T>,
}

/// What the registry needs of a lock.
trait Releasable: Send + Sync {
    fn name(&self) -> &'static str;
    fn owner(&self) -> Option<i32>;
    /// Unlocks a lock whose guard was abandoned.
    ///
    /// # Safety
    /// The owner must never touch the guard again.
    unsafe fn release(&self);
}

impl<T: ?Sized + Send> Releasable for Lock<T> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn owner(&self) -> Option<i32> {
        self.inner.is_locked().then(|| self.owner.load(Relaxed))
    }

    unsafe fn release(&self) {
        if self.inner.is_locked() {
            self.owner.store(0, Relaxed);
            // SAFETY: the caller guarantees the owner abandoned its guard.
            unsafe { self.inner.force_unlock() };
        }
    }
}

fn registry() -> &'static parking_lot::Mutex<Vec<Weak<dyn Releasable>>> {
    static R: std::sync::OnceLock<parking_lot::Mutex<Vec<Weak<dyn Releasable>>>> =
        std::sync::OnceLock::new();
    R.get_or_init(Default::default)
}

impl<T: Send + 'static> Lock<T> {
    /// A new lock, registered for recovery under `name`.
    pub fn new(name: &'static str, value: T) -> Arc<Self> {
        let l = Arc::new(Self {
            name,
            owner: AtomicI32::new(0),
            inner: parking_lot::Mutex::new(value),
        });
        let weak: Weak<dyn Releasable> = Arc::downgrade(&l) as Weak<dyn Releasable>;
        let mut r = registry().lock();
        if r.len() >= 64 && r.len().is_power_of_two() {
            r.retain(|w| w.strong_count() > 0);
        }
        r.push(weak);
        l
    }
}

impl<T: ?Sized> Lock<T> {
    /// Acquires the lock.
    pub fn lock(&self) -> Guard<'_, T> {
        let g = self.inner.lock();
        self.acquired(g)
    }

    /// Acquires the lock, waiting at most `d`.
    pub fn try_lock_for(&self, d: Duration) -> Option<Guard<'_, T>> {
        self.inner.try_lock_for(d).map(|g| self.acquired(g))
    }

    /// Acquires the lock if it is free.
    pub fn try_lock(&self) -> Option<Guard<'_, T>> {
        self.inner.try_lock().map(|g| self.acquired(g))
    }

    fn acquired<'a>(&'a self, g: parking_lot::MutexGuard<'a, T>) -> Guard<'a, T> {
        self.owner.store(tid(), Relaxed);
        HELD.with(|h| h.set(h.get() + 1));
        Guard { lock: self, g }
    }

    pub fn name(&self) -> &'static str {
        self.name
    }

    pub fn is_locked(&self) -> bool {
        self.inner.is_locked()
    }
}

/// A held [`Lock`].
pub struct Guard<'a, T: ?Sized> {
    lock: &'a Lock<T>,
    g: parking_lot::MutexGuard<'a, T>,
}

impl<T: ?Sized> Guard<'_, T> {
    /// Waits on `cond`, releasing the lock meanwhile.
    pub fn wait(&mut self, cond: &Condvar) {
        HELD.with(|h| h.set(h.get().saturating_sub(1)));
        cond.wait(&mut self.g);
        self.reacquired();
    }

    /// Waits on `cond` for at most `d`, releasing the lock meanwhile.
    pub fn wait_for(&mut self, cond: &Condvar, d: Duration) {
        HELD.with(|h| h.set(h.get().saturating_sub(1)));
        cond.wait_for(&mut self.g, d);
        self.reacquired();
    }

    fn reacquired(&self) {
        self.lock.owner.store(tid(), Relaxed);
        HELD.with(|h| h.set(h.get() + 1));
    }
}

impl<T: ?Sized> Deref for Guard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.g
    }
}

impl<T: ?Sized> DerefMut for Guard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.g
    }
}

impl<T: ?Sized> Drop for Guard<'_, T> {
    fn drop(&mut self) {
        self.lock.owner.store(0, Relaxed);
        HELD.with(|h| h.set(h.get().saturating_sub(1)));
    }
}

/// A lock found held by an abandoned thread and released.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Released {
    pub name: &'static str,
    pub owner: i32,
}

/// Releases every registered lock held by one of `owners` (threads whose
/// stacks were discarded). Returns what it released.
///
/// # Safety
/// Every thread in `owners` must have abandoned its stack: none of them may
/// ever use a guard it held again.
pub unsafe fn force_release_owned_by(owners: &[i32]) -> Vec<Released> {
    // SAFETY: the caller's contract covers exactly the owners released.
    unsafe { release_where(|owner| owners.contains(&owner)) }
}

/// Releases every registered lock that is held, except those owned by one
/// of `keep` (threads that were not discarded and legitimately hold their
/// own locks). A lock whose owner field is stale (its holder was discarded
/// between acquiring it and recording itself, or between clearing the
/// owner and unlocking) is released too. Returns what it released.
///
/// # Safety
/// Every thread that is not in `keep` and could hold a registered lock must
/// have abandoned its stack: none of them may use a guard it held again.
pub unsafe fn force_release_all_but(keep: &[i32]) -> Vec<Released> {
    // SAFETY: the caller's contract covers every owner not kept.
    unsafe { release_where(|owner| !keep.contains(&owner)) }
}

/// Releases every held registered lock whose owner `release` picks.
///
/// # Safety
/// No thread `release` picks may use a guard it held again.
unsafe fn release_where(release: impl Fn(i32) -> bool) -> Vec<Released> {
    let locks: Vec<Arc<dyn Releasable>> = {
        let r = match registry().try_lock_for(Duration::from_millis(10)) {
            Some(r) => r,
            None => {
                // Held by a discarded thread that was creating a lock.
                // SAFETY: all other threads are held by recovery; its holder abandoned it.
                unsafe { registry().force_unlock() };
                registry().lock()
            }
        };
        r.iter().filter_map(Weak::upgrade).collect()
    };
    let mut out = Vec::new();
    for l in locks {
        if let Some(owner) = l.owner() {
            if release(owner) {
                // SAFETY: the owner abandoned its stack (the caller's contract).
                unsafe { l.release() };
                out.push(Released { name: l.name(), owner });
            }
        }
    }
    out
}

/// Registered locks that are held now, with their owners (for reports).
pub fn held_locks() -> Vec<Released> {
    let r = registry().try_lock_for(Duration::from_millis(10));
    r.map(|r| {
        r.iter()
            .filter_map(Weak::upgrade)
            .filter_map(|l| l.owner().map(|owner| Released { name: l.name(), owner }))
            .collect()
    })
    .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guards_count_and_release() {
        let l = Lock::new("test.a", 5u32);
        assert_eq!(held_by_current_thread(), 0);
        {
            let mut g = l.lock();
            *g += 1;
            assert_eq!(held_by_current_thread(), 1);
            assert_eq!(l.owner.load(Relaxed), tid());
        }
        assert_eq!(held_by_current_thread(), 0);
        assert_eq!(*l.lock(), 6);
    }

    #[test]
    fn abandoned_guards_are_released_only_for_their_owner() {
        let a = Lock::new("test.abandoned", 1u32);
        let b = Lock::new("test.kept", 2u32);
        std::mem::forget(a.lock());
        let gb = b.lock();
        // Another thread's locks are not released.
        // SAFETY: the locks this test forgot are never used through their guards again.
        let none = unsafe { force_release_owned_by(&[tid() + 100_000]) };
        assert!(none.iter().all(|r| r.name != "test.abandoned"));
        assert!(a.is_locked());
        drop(gb);
        std::mem::forget(b.lock());
        let me = tid();
        // SAFETY: the locks this test forgot are never used through their guards again.
        let released = unsafe { force_release_owned_by(&[me]) };
        let names: Vec<_> = released.iter().map(|r| r.name).collect();
        assert!(names.contains(&"test.abandoned") && names.contains(&"test.kept"), "{names:?}");
        assert!(!a.is_locked() && !b.is_locked());
        reset_held_count();
        assert_eq!(*a.lock() + *b.lock(), 3);
    }

    #[test]
    fn stale_owners_are_released_unless_kept() {
        let a = Lock::new("test.stale", 1u32);
        let b = Lock::new("test.keep", 2u32);
        std::mem::forget(a.lock());
        a.owner.store(0, Relaxed);
        std::mem::forget(b.lock());
        let me = tid();
        // Every live thread of this test binary is kept: the locks that
        // tests running in parallel hold are theirs, not stale, and must
        // not be released under them. Only the stale owner (0) is not kept.
        let mut keep: Vec<i32> = std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect();
        assert!(keep.contains(&me));
        keep.push(me);
        // SAFETY: the locks this test forgot are never used through their guards again.
        let released = unsafe { force_release_all_but(&keep) };
        assert!(released.iter().any(|r| r.name == "test.stale"), "{released:?}");
        assert!(!a.is_locked() && b.is_locked());
        // SAFETY: the locks this test forgot are never used through their guards again.
        unsafe { force_release_owned_by(&[me]) };
        reset_held_count();
    }

    #[test]
    fn condvar_wait_keeps_counts() {
        let l = Lock::new("test.cv", false);
        let cv = Condvar::new();
        let mut g = l.lock();
        g.wait_for(&cv, Duration::from_millis(1));
        assert_eq!(held_by_current_thread(), 1);
        drop(g);
        assert_eq!(held_by_current_thread(), 0);
    }

    #[test]
    fn unsized_devices_coerce() {
        trait Dev: Send {
            fn v(&self) -> u32;
        }
        struct D;
        impl Dev for D {
            fn v(&self) -> u32 {
                7
            }
        }
        let l: Arc<Lock<dyn Dev>> = Lock::new("test.dyn", D);
        assert_eq!(l.lock().v(), 7);
    }
}
