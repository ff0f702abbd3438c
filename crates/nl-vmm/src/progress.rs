//! Guest progress measured in the CPU time its vCPU threads actually ran.
//!
//! A guest is hung when it makes no progress (no heartbeat, no control event)
//! while its vCPUs are running. Wall time cannot tell that: on a loaded host
//! a runnable vCPU thread may wait on the run queue for seconds, and a
//! stopped process (SIGSTOP, a debugger) does not run at all; neither is a
//! hung guest. So the clock here is the time each vCPU thread ran in guest
//! mode (`guest_time`, field 43 of `/proc/self/task/TID/stat`, sampled by
//! the kernel at each tick: 10 ms resolution). Not the thread's whole CPU
//! time: on a loaded host with checkpoints the vCPU thread can spend most of
//! its CPU in the host kernel (copy-on-write faults, exits, ring-0
//! emulation on PVM) while the guest gets nowhere, and that is not the
//! guest's failure to make progress either.
//!
//! * [`GuestClock`]: per-vCPU CPU time accumulated across vCPU threads (a
//!   rollback or a microreboot starts new threads; the clock continues).
//! * [`HangJudge`]: the hang decision, a pure function of the progress
//!   marker and the clock samples (unit-tested without a VM).

/// Resolution of [`thread_guest_ns`]: one clock tick.
pub fn tick_ns() -> u64 {
    // SAFETY: sysconf has no memory effects.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    1_000_000_000 / u64::try_from(hz).ok().filter(|h| *h > 0).unwrap_or(100)
}

/// Nanoseconds thread `tid` of this process has run guest code (KVM_RUN in
/// guest mode), or `None` if there is no such thread (it ended).
pub fn thread_guest_ns(tid: i32) -> Option<u64> {
    if tid <= 0 {
        return None;
    }
    let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).ok()?;
    guest_ns_from_stat(&s, tick_ns())
}

/// `guest_time` (field 43, in ticks) of a `/proc/.../stat` line, in ns.
fn guest_ns_from_stat(stat: &str, tick_ns: u64) -> Option<u64> {
    // Fields after the command name (which may hold spaces) start at field 3.
    let (_, rest) = stat.rsplit_once(") ")?;
    let ticks: u64 = rest.split_whitespace().nth(43 - 3)?.parse().ok()?;
    Some(ticks.saturating_mul(tick_ns))
}

/// Nanoseconds the calling thread has run on a CPU.
pub fn own_cpu_ns() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    s.split_whitespace().next()?.parse().ok()
}

/// One sample of one vCPU thread: its kernel id and CPU time (ns).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ThreadSample {
    pub tid: i32,
    pub cpu_ns: u64,
}

/// Per-vCPU CPU time, continued across thread restarts: the guest's own
/// clock of opportunity to make progress.
#[derive(Clone, Debug, Default)]
pub struct GuestClock {
    acc: Vec<u64>,
    last: Vec<Option<ThreadSample>>,
}

impl GuestClock {
    pub fn new(vcpus: usize) -> Self {
        Self { acc: vec![0; vcpus], last: vec![None; vcpus] }
    }

    /// Takes one sample per vCPU (`None`: no running thread) and returns the
    /// accumulated clock. A new thread (another tid, or a CPU time below the
    /// last one: the tid was reused) adds all its CPU time.
    pub fn update(&mut self, samples: &[Option<ThreadSample>]) -> &[u64] {
        if samples.len() > self.acc.len() {
            self.acc.resize(samples.len(), 0);
            self.last.resize(samples.len(), None);
        }
        for (i, s) in samples.iter().enumerate() {
            if let Some(s) = s {
                self.acc[i] += match self.last[i] {
                    Some(l) if l.tid == s.tid && s.cpu_ns >= l.cpu_ns => s.cpu_ns - l.cpu_ns,
                    _ => s.cpu_ns,
                };
            }
            self.last[i] = *s;
        }
        &self.acc
    }

    /// The accumulated clock (ns per vCPU).
    pub fn now(&self) -> &[u64] {
        &self.acc
    }

    /// Which vCPUs had a running thread at the last sample.
    pub fn live(&self) -> Vec<bool> {
        self.last.iter().map(Option::is_some).collect()
    }
}

/// A hang: no progress while every live vCPU ran at least this long.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hang {
    /// The least CPU time a live vCPU ran since the last progress (ns).
    pub ran_ns: u64,
}

/// Decides whether a guest is hung from its progress marker (heartbeats,
/// control events) and its vCPUs' CPU-time clock.
///
/// The guest is hung when the marker did not change while every live vCPU
/// ran at least `timeout_ns` on a CPU. A vCPU that was descheduled or stopped
/// accrues no CPU time, so it is never the reason for a hang verdict. The
/// least of the vCPUs (not the most) is used so that a vCPU spinning on a
/// lock held by a descheduled peer does not make the guest look hung.
#[derive(Clone, Debug)]
pub struct HangJudge {
    timeout_ns: u64,
    marker: Option<u64>,
    since: Vec<u64>,
}

impl HangJudge {
    pub fn new(timeout_ns: u64) -> Self {
        Self { timeout_ns, marker: None, since: Vec::new() }
    }

    pub fn timeout_ns(&self) -> u64 {
        self.timeout_ns
    }

    /// Forgets the progress history (after a rollback or a pause that the
    /// guest must not be blamed for): the next observation starts afresh.
    pub fn reset(&mut self) {
        self.marker = None;
    }

    /// One observation: the progress marker, the clock (ns per vCPU) and
    /// which vCPUs have a running thread.
    pub fn observe(&mut self, marker: u64, clock: &[u64], live: &[bool]) -> Option<Hang> {
        if self.marker != Some(marker) || self.since.len() != clock.len() {
            self.marker = Some(marker);
            self.since = clock.to_vec();
            return None;
        }
        let ran = clock
            .iter()
            .zip(&self.since)
            .zip(live)
            .filter(|(_, l)| **l)
            .map(|((c, s), _)| c.saturating_sub(*s))
            .min()?;
        (ran >= self.timeout_ns).then_some(Hang { ran_ns: ran })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn guest_time_is_field_43() {
        let mut f: Vec<String> = (3..=52).map(|i| i.to_string()).collect();
        f[43 - 3] = "245".into();
        let line = format!("4242 (vm0 vcpu) {}", f.join(" "));
        assert_eq!(guest_ns_from_stat(&line, 10_000_000), Some(2_450_000_000));
        assert_eq!(guest_ns_from_stat("garbage", 1), None);
    }

    fn s(tid: i32, ms: u64) -> Option<ThreadSample> {
        Some(ThreadSample { tid, cpu_ns: ms * MS })
    }

    #[test]
    fn a_descheduled_vcpu_is_never_hung() {
        // The vCPU's CPU time does not advance (it waits on the run queue,
        // or the process is stopped) for any number of observations, however
        // long they take in wall time: not hung.
        let mut j = HangJudge::new(1000 * MS);
        let mut c = GuestClock::new(1);
        for _ in 0..10_000 {
            let clock = c.update(&[s(7, 40)]).to_vec();
            assert_eq!(j.observe(5, &clock, &c.live()), None);
        }
    }

    #[test]
    fn a_vcpu_that_ran_past_the_timeout_without_progress_is_hung() {
        let mut j = HangJudge::new(1000 * MS);
        let mut c = GuestClock::new(1);
        let mut verdict = None;
        for ms in (0..=1200).step_by(100) {
            let clock = c.update(&[s(7, ms)]).to_vec();
            verdict = verdict.or(j.observe(5, &clock, &c.live()).map(|h| (ms, h)));
        }
        assert_eq!(verdict, Some((1000, Hang { ran_ns: 1000 * MS })));
    }

    #[test]
    fn progress_restarts_the_count() {
        let mut j = HangJudge::new(1000 * MS);
        let mut c = GuestClock::new(1);
        for (i, ms) in (0..5000).step_by(100).enumerate() {
            let clock = c.update(&[s(7, ms)]).to_vec();
            // A beat every 900 ms of CPU time.
            assert_eq!(j.observe((i / 9) as u64, &clock, &c.live()), None, "at {ms} ms");
        }
    }

    #[test]
    fn the_least_running_vcpu_decides() {
        // vCPU 1 spins (runs 2 s) while vCPU 0 is descheduled: not hung.
        let mut j = HangJudge::new(1000 * MS);
        let mut c = GuestClock::new(2);
        for ms in (0..=2000).step_by(100) {
            let clock = c.update(&[s(1, 10), s(2, ms)]).to_vec();
            assert_eq!(j.observe(3, &clock, &c.live()), None);
        }
        // Once vCPU 0 also runs a second without progress: hung.
        let mut hung = false;
        for ms in (0..=1100).step_by(100) {
            let clock = c.update(&[s(1, 10 + ms), s(2, 2000 + ms)]).to_vec();
            hung |= j.observe(3, &clock, &c.live()).is_some();
        }
        assert!(hung);
        // A vCPU without a thread (finished) does not hold the verdict back.
        let mut j = HangJudge::new(1000 * MS);
        let mut c = GuestClock::new(2);
        let mut hung = false;
        for ms in (0..=1100).step_by(100) {
            let clock = c.update(&[None, s(2, ms)]).to_vec();
            hung |= j.observe(3, &clock, &c.live()).is_some();
        }
        assert!(hung);
    }

    #[test]
    fn the_clock_continues_across_new_threads() {
        let mut c = GuestClock::new(1);
        c.update(&[s(7, 100)]);
        c.update(&[s(7, 300)]);
        assert_eq!(c.now(), &[300 * MS]);
        c.update(&[None]); // halted for a rollback
        assert_eq!(c.live(), vec![false]);
        c.update(&[s(9, 20)]); // a new thread
        assert_eq!(c.now(), &[320 * MS]);
        c.update(&[s(9, 10)]); // the tid was reused by a newer thread
        assert_eq!(c.now(), &[330 * MS]);
    }
}
