//! The host's event loop: recurring events on one thread.
//!
//! Each event's handler runs when it is due and re-arms it by returning
//! `true` (like Xen's recurring timers, whose handlers re-activate them).
//! A handler discarded halfway by a microreset never re-arms its event; the
//! flag set on handler entry and cleared on exit lets the recovery find and
//! re-arm it ([`Events::rearm_interrupted`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nl_sync::Lock;

type Handler = Arc<dyn Fn() -> bool + Send + Sync>;

struct Event {
    id: u64,
    name: String,
    period: Duration,
    due: Instant,
    armed: bool,
    in_handler: Arc<AtomicBool>,
    handler: Handler,
}

/// The recurring events of a host, run by one `events` thread.
pub struct Events {
    list: Arc<Lock<Vec<Event>>>,
    next_id: AtomicU64,
    quit: AtomicBool,
}

/// Longest sleep of the loop (new events are picked up at least this often).
const TICK: Duration = Duration::from_millis(5);

impl Events {
    /// Creates the event list and starts its thread.
    pub fn start() -> std::io::Result<Arc<Self>> {
        let e = Arc::new(Self {
            list: Lock::new("events.list", Vec::new()),
            next_id: AtomicU64::new(1),
            quit: AtomicBool::new(false),
        });
        let w = Arc::downgrade(&e);
        std::thread::Builder::new().name("events".into()).spawn(move || {
            crate::seccomp::apply(crate::seccomp::Kind::Events);
            let _reg = crate::recovery::enter(false);
            let progress = crate::detect::track();
            loop {
                let Some(e) = w.upgrade() else { return };
                if e.quit.load(SeqCst) {
                    return;
                }
                progress.beat();
                // A discarded pass simply starts over.
                let _ = crate::recovery::protected(|| e.run_due());
                let wait = e.next_wait();
                drop(e);
                progress.wait();
                crate::recovery::safe(|| std::thread::sleep(wait));
                progress.resume();
            }
        })?;
        Ok(e)
    }

    /// Adds a recurring event; `handler` returns whether to run again.
    pub fn add(&self, name: String, period: Duration, handler: Handler) -> u64 {
        let id = self.next_id.fetch_add(1, SeqCst);
        self.list.lock().push(Event {
            id,
            name,
            period,
            due: Instant::now() + period,
            armed: true,
            in_handler: Arc::new(AtomicBool::new(false)),
            handler,
        });
        id
    }

    /// Removes an event (it may still be running once more).
    pub fn remove(&self, id: u64) {
        self.list.lock().retain(|e| e.id != id);
    }

    /// Names of the armed events.
    pub fn armed(&self) -> Vec<String> {
        self.list.lock().iter().filter(|e| e.armed).map(|e| e.name.clone()).collect()
    }

    pub fn stop(&self) {
        self.quit.store(true, SeqCst);
    }

    fn next_wait(&self) -> Duration {
        let now = Instant::now();
        self.list
            .lock()
            .iter()
            .filter(|e| e.armed)
            .map(|e| e.due.saturating_duration_since(now))
            .min()
            .unwrap_or(TICK)
            .min(TICK)
    }

    fn run_due(&self) {
        let now = Instant::now();
        let due: Vec<(u64, Arc<AtomicBool>, Handler)> = {
            let mut l = self.list.lock();
            l.iter_mut()
                .filter(|e| e.armed && e.due <= now)
                .map(|e| {
                    // Disarmed while it runs; the handler's return re-arms it.
                    e.armed = false;
                    (e.id, e.in_handler.clone(), e.handler.clone())
                })
                .collect()
        };
        for (id, flag, h) in due {
            flag.store(true, SeqCst);
            let again = h();
            flag.store(false, SeqCst);
            let mut l = self.list.lock();
            if again {
                if let Some(e) = l.iter_mut().find(|e| e.id == id) {
                    e.armed = true;
                    e.due = Instant::now() + e.period;
                }
            } else {
                l.retain(|e| e.id != id);
            }
        }
    }

    /// Re-arms every event whose handler was interrupted (a microreset
    /// repair). Returns how many.
    pub fn rearm_interrupted(&self) -> usize {
        let Some(mut l) = self.list.try_lock_for(Duration::from_millis(20)) else { return 0 };
        let mut n = 0;
        for e in l.iter_mut() {
            if e.in_handler.swap(false, SeqCst) && !e.armed {
                e.armed = true;
                e.due = Instant::now();
                n += 1;
            }
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn recurring_events_run_and_end() {
        let ev = Events::start().unwrap();
        let n = Arc::new(AtomicU32::new(0));
        let m = n.clone();
        ev.add(
            "count".into(),
            Duration::from_millis(1),
            Arc::new(move || m.fetch_add(1, SeqCst) < 2),
        );
        for _ in 0..2000 {
            if n.load(SeqCst) >= 3 && ev.armed().is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(n.load(SeqCst), 3);
        assert!(ev.armed().is_empty());
        ev.stop();
    }

    #[test]
    fn interrupted_handlers_are_rearmed() {
        let ev = Events {
            list: Lock::new("test.events", Vec::new()),
            next_id: 1.into(),
            quit: false.into(),
        };
        ev.add("e".into(), Duration::from_secs(1), Arc::new(|| true));
        {
            let mut l = ev.list.lock();
            l[0].armed = false;
            l[0].in_handler.store(true, SeqCst);
        }
        assert!(ev.armed().is_empty());
        assert_eq!(ev.rearm_interrupted(), 1);
        assert_eq!(ev.armed(), vec!["e".to_string()]);
        assert_eq!(ev.rearm_interrupted(), 0);
    }
}
