//! Host core stalls: when a core was not available even to a real-time
//! thread.
//!
//! On this host (KVM on the `kvm_pvm` backend, inside a VM itself) a core
//! that runs a guest is at times held for about 100 ms at a stretch, and
//! neither a `SCHED_FIFO` thread that wakes on that core nor a signal to
//! the vCPU thread gets it back earlier (docs/performance.md, "Host core
//! stalls"). A service on such a core is silent for that long, whatever
//! its VMM does. The probe lets a bench tell those silences from its own:
//! one thread per core, pinned and `SCHED_FIFO` at priority 50 when it may
//! be, sleeps 1 ms at a time and records every wake-up late by more than
//! [`STALL_MS`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;

/// A wake-up later than this is a stall.
pub const STALL_MS: f64 = 20.0;
/// The probe's sleep.
const TICK: Duration = Duration::from_millis(1);
/// At most this many stalls are kept per core.
const MAX_STALLS: usize = 4096;

/// One stall: the core, when the probe woke (ms since the Unix epoch) and
/// how late.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Stall {
    pub core: usize,
    pub end_unix_ms: f64,
    pub ms: f64,
}

impl Stall {
    /// When it began (ms since the Unix epoch).
    pub fn start_unix_ms(&self) -> f64 {
        self.end_unix_ms - self.ms
    }
}

/// What the probe saw on one core.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CoreStalls {
    pub core: usize,
    /// Whether its thread ran `SCHED_FIFO` (else an ordinary thread: its
    /// stalls include waiting behind other ordinary threads).
    pub realtime: bool,
    pub wakeups: u64,
    pub late_over_5ms: u64,
    pub worst_ms: f64,
    pub stalls: Vec<Stall>,
}

/// The probe's report.
#[derive(Clone, Debug, Default, Serialize)]
pub struct StallReport {
    pub threshold_ms: f64,
    pub cores: Vec<CoreStalls>,
}

impl StallReport {
    /// Whether the probe ran (on at least one core).
    pub fn ran(&self) -> bool {
        !self.cores.is_empty()
    }

    /// Every stall, by start time.
    pub fn stalls(&self) -> Vec<Stall> {
        let mut v: Vec<Stall> = self.cores.iter().flat_map(|c| c.stalls.iter().copied()).collect();
        v.sort_by(|a, b| a.start_unix_ms().total_cmp(&b.start_unix_ms()));
        v
    }

    /// How much of `from..to` (ms since the Unix epoch) the stalls cover,
    /// summed over the cores, ms.
    pub fn covering(&self, from: f64, to: f64) -> f64 {
        self.stalls()
            .iter()
            .map(|s| (s.end_unix_ms.min(to) - s.start_unix_ms().max(from)).max(0.0))
            .fold(0.0, |a, b| a + b)
    }

    /// The longest stall that overlaps `from..to` (ms since the Unix
    /// epoch), if any.
    pub fn overlapping(&self, from: f64, to: f64) -> Option<Stall> {
        self.stalls()
            .into_iter()
            .filter(|s| s.start_unix_ms() < to && s.end_unix_ms > from)
            .max_by(|a, b| a.ms.total_cmp(&b.ms))
    }
}

/// A running probe; [`StallProbe::finish`] stops it.
pub struct StallProbe {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<CoreStalls>>,
}

impl StallProbe {
    /// Starts one probe thread on each of `cores` (a core it cannot be
    /// pinned to gets none; none at all when `on` is false). The probe
    /// changes what it measures: its wake-ups are scheduling points on
    /// every core (see docs/sandboxes.md, "The `rollback` row's late
    /// stalls"), so benches run it only on request (`--stall-probe`).
    pub fn start_if(on: bool, cores: &[usize]) -> StallProbe {
        StallProbe::start(if on { cores } else { &[] })
    }

    /// Starts one probe thread on each of `cores` (a core it cannot be
    /// pinned to gets none).
    pub fn start(cores: &[usize]) -> StallProbe {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = cores
            .iter()
            .filter_map(|&core| {
                let stop = stop.clone();
                std::thread::Builder::new()
                    .name(format!("stall-probe-{core}"))
                    .spawn(move || probe(core, &stop))
                    .ok()
            })
            .collect();
        StallProbe { stop, threads }
    }

    /// Stops the probe and returns what it saw.
    pub fn finish(mut self) -> StallReport {
        self.stop.store(true, Ordering::Relaxed);
        StallReport {
            threshold_ms: STALL_MS,
            cores: std::mem::take(&mut self.threads)
                .into_iter()
                .filter_map(|t| t.join().ok())
                .collect(),
        }
    }
}

/// A probe given up on (a bench that failed before [`StallProbe::finish`])
/// stops its threads; they end within a millisecond.
impl Drop for StallProbe {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn probe(core: usize, stop: &AtomicBool) -> CoreStalls {
    let mut c = CoreStalls { core, ..Default::default() };
    if nl_sandbox::affinity::pin(0, &[core]).is_err() {
        return c;
    }
    c.realtime = nl_sandbox::affinity::set_fifo(0, 50).is_ok();
    while !stop.load(Ordering::Relaxed) {
        let t = Instant::now();
        std::thread::sleep(TICK);
        let late = (t.elapsed().saturating_sub(TICK)).as_secs_f64() * 1e3;
        c.wakeups += 1;
        if late > 5.0 {
            c.late_over_5ms += 1;
        }
        c.worst_ms = c.worst_ms.max(late);
        if late > STALL_MS && c.stalls.len() < MAX_STALLS {
            c.stalls.push(Stall {
                core,
                end_unix_ms: crate::ping::unix_ms(std::time::SystemTime::now()),
                ms: late,
            });
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlapping_picks_the_longest_stall_that_meets_the_interval() {
        let s = |core, end_unix_ms, ms| Stall { core, end_unix_ms, ms };
        let r = StallReport {
            threshold_ms: STALL_MS,
            cores: vec![
                CoreStalls { core: 0, stalls: vec![s(0, 1100.0, 100.0)], ..Default::default() },
                CoreStalls {
                    core: 1,
                    stalls: vec![s(1, 1050.0, 30.0), s(1, 2000.0, 25.0)],
                    ..Default::default()
                },
            ],
        };
        assert_eq!(r.overlapping(1090.0, 1200.0).map(|s| s.core), Some(0));
        assert_eq!(r.overlapping(1030.0, 1040.0).map(|s| s.ms), Some(100.0));
        assert!(r.overlapping(1200.0, 1900.0).is_none());
        assert_eq!(r.covering(1030.0, 1060.0), 30.0 + 20.0);
        assert_eq!(r.covering(1200.0, 1900.0), 0.0);
        assert_eq!(r.stalls().len(), 3);
    }

    #[test]
    fn a_dropped_probe_stops_its_threads() {
        let core = nl_sandbox::affinity::host_cores().expect("this process's cores")[0];
        let p = StallProbe::start(&[core]);
        let stop = p.stop.clone();
        drop(p);
        assert!(stop.load(Ordering::Relaxed), "a dropped probe left its threads running");
    }

    #[test]
    fn the_probe_reports_a_core_held_by_a_higher_priority_thread() {
        // A SCHED_FIFO thread at priority 60 spins 60 ms on the probe's
        // core: the probe (priority 50) cannot run meanwhile.
        let core = nl_sandbox::affinity::host_cores().expect("this process's cores")[0];
        let p = StallProbe::start(&[core]);
        std::thread::sleep(Duration::from_millis(20));
        std::thread::spawn(move || {
            nl_sandbox::affinity::pin(0, &[core]).expect("pin the spinner");
            nl_sandbox::affinity::set_fifo(0, 60).expect("SCHED_FIFO needs root (CAP_SYS_NICE)");
            let t = Instant::now();
            while t.elapsed() < Duration::from_millis(60) {
                std::hint::spin_loop();
            }
        })
        .join()
        .expect("the spinner");
        std::thread::sleep(Duration::from_millis(20));
        let r = p.finish();
        assert!(r.cores[0].realtime, "{r:?}");
        let worst = r.stalls().iter().map(|s| s.ms).fold(0.0, f64::max);
        assert!(worst >= 40.0, "the probe missed a 60 ms hold of its core: {r:?}");
    }
}
