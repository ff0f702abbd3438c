//! What a `periodic` sandbox got: its per-period CPU accounting
//! (`nl_workloads::periodic`), read from the lines its guest prints when it
//! finishes, and the host's own account of a thread's CPU time to hold it
//! against.

use serde::Serialize;

/// The periodic sandbox's periods: how much CPU (µs, by the guest's TSC
/// accounting) each complete period got against the reservation.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PeriodReport {
    pub period_us: u64,
    pub reserve_us: u64,
    /// Complete periods, and those that got at least the reservation.
    pub periods: u64,
    pub met: u64,
    /// The least CPU any complete period got.
    pub worst_us: u64,
    /// CPU got over all complete periods.
    pub total_us: u64,
    /// CPU got per period (the first `nl_workloads::periodic::MAX_PERIODS`).
    pub got_us: Vec<u64>,
}

impl PeriodReport {
    /// Parses the `periodic ...` lines of a console; `None` without a
    /// summary line.
    pub fn parse(console: &str) -> Option<Self> {
        let mut r = PeriodReport::default();
        let mut summary = false;
        for line in console.lines() {
            if let Some(list) = line.strip_prefix("periodic got_us=") {
                let list = list.trim().trim_start_matches('[').trim_end_matches(']');
                r.got_us.extend(list.split(',').filter_map(|v| v.trim().parse::<u64>().ok()));
            } else if let Some(rest) = line.strip_prefix("periodic ") {
                summary = true;
                for kv in rest.split_whitespace() {
                    let Some((k, v)) = kv.split_once('=') else { continue };
                    let Ok(v) = v.parse::<u64>() else { continue };
                    match k {
                        "periods" => r.periods = v,
                        "met" => r.met = v,
                        "worst_us" => r.worst_us = v,
                        "total_us" => r.total_us = v,
                        "reserve_us" => r.reserve_us = v,
                        "period_us" => r.period_us = v,
                        _ => {}
                    }
                }
            }
        }
        summary.then_some(r)
    }

    /// The worst period's CPU over the reservation (1.0: exactly kept).
    pub fn worst_over_reserve(&self) -> f64 {
        self.worst_us as f64 / self.reserve_us.max(1) as f64
    }
}

/// CPU time (ns) the host has accounted to thread `tid` of this process
/// (`/proc/self/task/TID/schedstat`, first field); `None` once it is gone.
pub fn thread_cpu_ns(tid: i32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).ok()?;
    text.split_whitespace().next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_guest_lines() {
        let c = "boot\nperiodic got_us=[9000, 8000]\nperiodic got_us=[7000]\n\
                 periodic periods=3 met=2 worst_us=7000 total_us=24000 reserve_us=7500 period_us=10000 ops=5\n";
        let r = PeriodReport::parse(c).unwrap();
        assert_eq!(r.got_us, vec![9000, 8000, 7000]);
        assert_eq!((r.periods, r.met, r.worst_us, r.total_us), (3, 2, 7000, 24000));
        assert_eq!((r.reserve_us, r.period_us), (7500, 10000));
        assert!((r.worst_over_reserve() - 7000.0 / 7500.0).abs() < 1e-9);
        assert!(PeriodReport::parse("periodic got_us=[1]\n").is_none());
    }

    #[test]
    fn this_thread_has_cpu_time() {
        let tid = nix::unistd::gettid().as_raw();
        let a = thread_cpu_ns(tid).unwrap();
        let mut x = 0u64;
        // The kernel adds a running thread's time at ticks and switches:
        // a short sleep after the work makes it count (bounded retries).
        let mut grew = false;
        for _ in 0..100 {
            for i in 0..2_000_000u64 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
            if thread_cpu_ns(tid).unwrap() > a {
                grew = true;
                break;
            }
        }
        assert!(grew, "no CPU time accounted to this thread ({x})");
        assert!(thread_cpu_ns(i32::MAX).is_none());
    }
}

/// The storm set of the test and the bench: a `periodic` sandbox and a
/// `storm` sandbox ringing the periodic one's doorbell, both on one host
/// core.
#[derive(Clone, Copy, Debug)]
pub struct StormSet {
    pub core: usize,
    /// The periodic sandbox's accounting period and the CPU per period it
    /// needs (µs).
    pub period_us: u64,
    pub need_us: u64,
    /// The periodic sandbox's budget (runtime, period µs), reserved.
    pub reservation: Option<(u64, u64)>,
    /// The storm's budget (runtime, period µs), a cap.
    pub storm_budget: Option<(u64, u64)>,
    pub duration_ms: u64,
}

impl StormSet {
    /// The set's configuration (JSON).
    pub fn config(&self) -> String {
        let StormSet { core, period_us, need_us, duration_ms, .. } = *self;
        let budget = |b: Option<(u64, u64)>, reserve: bool| {
            b.map_or(String::new(), |(r, p)| {
                format!(
                    r#", "budget": {{"runtime_us": {r}, "period_us": {p}, "reserve": {reserve}}}"#
                )
            })
        };
        let (rb, sb) = (budget(self.reservation, true), budget(self.storm_budget, false));
        format!(
            r#"{{"sandboxes": [
            {{"name": "periodic", "cores": [{core}], "mem_mib": 48,
              "workload": {{"kind": "periodic", "duration_ms": {duration_ms}, "period_us": {period_us}, "reserve_us": {need_us}}}{rb}}},
            {{"name": "storm", "cores": [{core}], "mem_mib": 48,
              "workload": {{"kind": "storm", "duration_ms": {duration_ms}}}{sb}}}
        ], "channels": [{{"name": "bell", "between": ["storm", "periodic"], "doorbell": true}}]}}"#
        )
    }
}

/// The TAP-flood set of the test and the bench: a `periodic` sandbox and a
/// `netbench` sandbox with a receive thread (`net.rx_irq`) on TAP `tap`,
/// both on one host core; the host floods the netbench sandbox's TAP.
#[derive(Clone, Debug)]
pub struct TapFloodSet {
    pub core: usize,
    pub period_us: u64,
    pub need_us: u64,
    /// The periodic sandbox's budget (runtime, period µs), reserved.
    pub reservation: Option<(u64, u64)>,
    /// The flooded sandbox's vCPU budget and its `budget.io` (runtime,
    /// period µs), caps; without a vCPU budget there is no io budget.
    pub flooded_budget: Option<(u64, u64)>,
    pub io_budget: Option<(u64, u64)>,
    pub duration_ms: u64,
    pub tap: String,
}

impl TapFloodSet {
    /// The flooded sandbox's address (its host end is .1).
    pub const GUEST_IP: [u8; 4] = [10, 0, 0, 2];

    /// The set's configuration (JSON).
    pub fn config(&self) -> String {
        let TapFloodSet { core, period_us, need_us, duration_ms, .. } = *self;
        let rb = self.reservation.map_or(String::new(), |(r, p)| {
            format!(r#", "budget": {{"runtime_us": {r}, "period_us": {p}, "reserve": true}}"#)
        });
        let io = self.io_budget.map_or(String::new(), |(r, p)| {
            format!(r#", "io": {{"runtime_us": {r}, "period_us": {p}}}"#)
        });
        let fb = self.flooded_budget.map_or(String::new(), |(r, p)| {
            format!(r#", "budget": {{"runtime_us": {r}, "period_us": {p}{io}}}"#)
        });
        let tap = &self.tap;
        format!(
            r#"{{"sandboxes": [
            {{"name": "periodic", "cores": [{core}], "mem_mib": 48,
              "workload": {{"kind": "periodic", "duration_ms": {duration_ms}, "period_us": {period_us}, "reserve_us": {need_us}}}{rb}}},
            {{"name": "flooded", "cores": [{core}],
              "workload": {{"kind": "netbench", "duration_ms": 0}},
              "net": {{"tap": "{tap}", "mac": "52:54:00:f1:00:02", "ipv4": "10.0.0.2/24", "rx_irq": true}}{fb}}}
        ]}}"#
        )
    }
}
