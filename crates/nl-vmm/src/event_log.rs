//! The host's event log: what happened to the host and its VMs, in order,
//! for the API's event stream (`GET /v1/events`).
//!
//! Every event has a sequence number (from 1, increasing by one), a
//! timestamp (Unix time in milliseconds), a kind and a JSON body. The log
//! keeps the newest [`CAPACITY`] events; a reader that fell further behind
//! is told how many it missed. Kinds:
//!
//! | kind              | published by                                   |
//! |-------------------|------------------------------------------------|
//! | `vm_created`      | the host, when a VM starts (`create`, adoption) |
//! | `vm_paused`, `vm_resumed`, `vm_destroyed` | the host's API operations |
//! | `vm_ended`        | a VM's supervisor: its outcome (completed, guest error, crash, hang) |
//! | `detection`       | the VMM's detectors (panic, hang, seccomp)     |
//! | `recovery`        | a microreset or microreboot that completed     |
//! | `rejuvenation`    | a rejuvenation, with its report                |
//! | `host_started`    | a host process starting to serve (also after a handover) |
//!
//! Publishing never blocks for long and never fails the caller: an event
//! that cannot be logged within [`PUBLISH_WAIT`] (the log's lock is held by
//! a thread a recovery is about to discard) is dropped and counted.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nl_sync::Lock;
use serde::Serialize;

/// Events kept for readers.
pub const CAPACITY: usize = 1024;
/// Longest a publisher waits for the log.
pub const PUBLISH_WAIT: Duration = Duration::from_millis(20);

/// One event.
#[derive(Clone, Debug, Serialize)]
pub struct Event {
    pub seq: u64,
    /// Unix time, milliseconds.
    pub ts_ms: u64,
    pub kind: &'static str,
    pub data: serde_json::Value,
}

struct Log {
    events: Arc<Lock<VecDeque<Event>>>,
    next: AtomicU64,
    dropped: AtomicU64,
}

fn log() -> &'static Log {
    static L: OnceLock<Log> = OnceLock::new();
    L.get_or_init(|| Log {
        events: Lock::new("event_log", VecDeque::with_capacity(CAPACITY)),
        next: AtomicU64::new(1),
        dropped: AtomicU64::new(0),
    })
}

/// Appends an event.
pub fn publish(kind: &'static str, data: serde_json::Value) {
    tracing::debug!(target: "ninelives::event", kind, data = %data);
    let l = log();
    let ts_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    let Some(mut events) = l.events.try_lock_for(PUBLISH_WAIT) else {
        l.dropped.fetch_add(1, Relaxed);
        return;
    };
    // Numbered under the lock, so the log is in sequence order.
    let seq = l.next.fetch_add(1, Relaxed);
    if events.len() == CAPACITY {
        events.pop_front();
    }
    events.push_back(Event { seq, ts_ms, kind, data });
}

/// The events after `after` (a sequence number; 0 for all kept), oldest
/// first, and how many of those the log no longer holds.
pub fn since(after: u64) -> (Vec<Event>, u64) {
    let events = log().events.lock();
    let first = events.front().map_or(log().next.load(Relaxed), |e| e.seq);
    let missed = first.saturating_sub(after + 1);
    (events.iter().filter(|e| e.seq > after).cloned().collect(), missed)
}

/// The sequence number of the newest event (0 before the first).
pub fn last_seq() -> u64 {
    log().next.load(Relaxed) - 1
}

/// Events published so far, and events dropped because the log was busy.
pub fn counts() -> (u64, u64) {
    (last_seq(), log().dropped.load(Relaxed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readers_get_events_in_order_and_learn_what_they_missed() {
        let start = last_seq();
        for i in 0..(CAPACITY as u64 + 10) {
            publish("test", serde_json::json!({ "i": i }));
        }
        let (got, missed) = since(start);
        assert_eq!(got.len(), CAPACITY);
        assert!(missed >= 10, "missed {missed}");
        assert!(got.windows(2).all(|w| w[1].seq == w[0].seq + 1));
        let newest = got.last().unwrap().seq;
        assert_eq!(newest, last_seq());
        assert!(since(newest).0.is_empty());
        assert_eq!(since(newest - 1).0.len(), 1);
        assert_eq!(since(newest - 1).1, 0);
    }
}
