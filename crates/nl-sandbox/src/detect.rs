//! The per-sandbox detectors. Each detection names the sandbox and the
//! detector that fired; the monitor logs it, prints it on stderr, publishes
//! it in nl-vmm's event log and applies the sandbox's recovery policy.
//!
//! * `channel-violation`: a write to a read-only channel page (reported by
//!   the VMM through [`crate::monitor::Monitor`]'s write guard; policy
//!   `on_violation: stop` ends the vCPU with `ERR_CHANNEL_VIOLATION`).
//! * `guest-error`, `guest-exception`: the guest reported an error or an
//!   unhandled exception through the control device; `guest-error` also
//!   when a workload without end (`duration_ms` 0, a service) reports that
//!   it completed (`crate::recovery::run`).
//! * `triple-fault`, `emulation-failure`, `vcpu-crash`: the vCPU loop ended
//!   on KVM_EXIT_SHUTDOWN, KVM_EXIT_INTERNAL_ERROR or another crash.
//! * `lost-heartbeat`: no guest progress (heartbeats or control events)
//!   while every live vCPU ran `detect.heartbeat_cpu_ms` on a CPU; judged
//!   on the vCPU threads' guest time ([`nl_vmm::progress::HangJudge`]), so
//!   a sandbox that is merely descheduled on a loaded host is never blamed.
//! * `channel-lag`: a peer published more than `detect.channel_lag_words`
//!   words on a channel that this sandbox did not consume while its vCPUs
//!   ran `detect.channel_lag_cpu_ms` (Quest-V's ring-index check).
//! * `output-stall`: none of this sandbox's own channel regions took a new
//!   record while its vCPUs ran `detect.output_stall_cpu_ms` (off unless
//!   set): a streaming sandbox that still heartbeats but no longer serves.
//! * `channel-check` (`detect.channel_check`, on for `chanstream`): the
//!   host reads every record the sandbox publishes on its channels
//!   (`nl_workloads::channel_audit`) and finds one that is wrong (framing,
//!   or a `chanstream` message not byte for byte what its sender must
//!   send); or the sandbox reports corrupt, lost or duplicated messages in
//!   a peer's stream that the host read intact, in the same generation,
//!   with no record rejected meanwhile (its own receive state is wrong).
//!   Each sandbox's monitor only ever blames its own sandbox: a bad record
//!   its writer's, a wrong report its reporter's. What the host cannot
//!   tell (it fell behind the writer, the peer restarted in between) is
//!   no detection.

use std::time::{Duration, Instant};

use nl_vmm::progress::{GuestClock, HangJudge};
use nl_vmm::{Vm, VmOutcome};
use serde::Serialize;

use crate::channel::HostChannel;
use crate::config::DetectConfig;

/// Which detector fired.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Detector {
    ChannelViolation,
    GuestError,
    GuestException,
    TripleFault,
    EmulationFailure,
    VcpuCrash,
    LostHeartbeat,
    ChannelLag,
    OutputStall,
    ChannelCheck,
}

impl Detector {
    pub fn name(self) -> &'static str {
        match self {
            Detector::ChannelViolation => "channel-violation",
            Detector::GuestError => "guest-error",
            Detector::GuestException => "guest-exception",
            Detector::TripleFault => "triple-fault",
            Detector::EmulationFailure => "emulation-failure",
            Detector::VcpuCrash => "vcpu-crash",
            Detector::LostHeartbeat => "lost-heartbeat",
            Detector::ChannelLag => "channel-lag",
            Detector::OutputStall => "output-stall",
            Detector::ChannelCheck => "channel-check",
        }
    }

    /// The detector behind a rollback reason of nl-checkpoint's supervisor
    /// (an outcome's message or its hang verdict).
    pub fn of_reason(reason: &str) -> Self {
        // The channel detectors' own (`Detectors::poll_channels`).
        for d in [Detector::OutputStall, Detector::ChannelCheck, Detector::ChannelLag] {
            if reason.strip_prefix(d.name()).is_some_and(|r| r.starts_with(':')) {
                return d;
            }
        }
        if reason.contains("isolation violation") {
            Detector::ChannelViolation
        } else if reason.contains("heartbeating") {
            Detector::LostHeartbeat
        } else if reason.contains("triple fault") {
            Detector::TripleFault
        } else if reason.contains("emulat") || reason.contains("internal error") {
            Detector::EmulationFailure
        } else if reason.contains("crashed") {
            Detector::VcpuCrash
        } else if reason.contains("exception") {
            Detector::GuestException
        } else {
            Detector::GuestError
        }
    }
}

/// One detection.
#[derive(Clone, Debug, Serialize)]
pub struct Detection {
    pub sandbox: String,
    pub detector: Detector,
    pub detail: String,
    /// Since the set started supervising.
    pub at_ms: f64,
}

/// The detector for a finished VM's outcome (`None`: not a fault).
pub fn of_outcome(o: &VmOutcome) -> Option<(Detector, String)> {
    let d = match o {
        VmOutcome::Completed | VmOutcome::Stopped | VmOutcome::TimedOut { .. } => return None,
        VmOutcome::GuestError { code, .. } if *code == nl_abi::ERR_CHANNEL_VIOLATION => {
            Detector::ChannelViolation
        }
        VmOutcome::GuestError { code, .. }
            if (nl_abi::ERR_EXCEPTION_BASE..nl_abi::ERR_EXCEPTION_BASE + 256).contains(code) =>
        {
            Detector::GuestException
        }
        VmOutcome::GuestError { .. } => Detector::GuestError,
        VmOutcome::Crashed { message, .. } => Detector::of_reason(message),
        VmOutcome::Hung { .. } => Detector::LostHeartbeat,
    };
    Some((d, o.message()))
}

/// A channel this sandbox receives on: which channel, and which region is
/// the peer's (the sandbox acknowledges in the other one).
#[derive(Clone, Copy, Debug)]
struct LagWatch {
    channel: usize,
    peer_region: usize,
    /// The acknowledgement and the sandbox's clock when the lag was first
    /// seen above the bound (or the ack last moved).
    since: Option<(u64, u64)>,
}

/// A channel this sandbox receives on, for the channel check: its report
/// (corrupt + lost + duplicated, rejected, the peer generation it read)
/// when last looked at.
#[derive(Clone, Copy, Debug)]
struct ReportWatch {
    channel: usize,
    peer_region: usize,
    last: Option<(u64, u64, u64)>,
}

/// The running detectors of one sandbox's VM (outcome, heartbeat, channel
/// lag). Reset after each recovery.
pub struct Detectors {
    cfg: DetectConfig,
    clock: GuestClock,
    judge: HangJudge,
    lag: Vec<LagWatch>,
    /// The sandbox's own regions (channel, region), and the sum of their
    /// heads with the sandbox's clock when that sum last changed.
    own: Vec<(usize, usize)>,
    stall_since: Option<(u64, u64)>,
    /// The channel check (`None`: off).
    reports: Option<Vec<ReportWatch>>,
    next_slow: Instant,
}

/// How often the detectors that read /proc and the channel headers run.
pub const SLOW_PERIOD: Duration = Duration::from_millis(5);

impl Detectors {
    /// `receives`: (channel index, the peer's region) for each of the
    /// sandbox's channels (its own region is the other one).
    /// `check`: run the channel check (`detect.channel_check` resolved for
    /// the sandbox's workload).
    pub fn new(cfg: &DetectConfig, vcpus: usize, receives: &[(usize, usize)], check: bool) -> Self {
        Self {
            cfg: cfg.clone(),
            clock: GuestClock::new(vcpus),
            judge: HangJudge::new(cfg.heartbeat_cpu_ms.saturating_mul(1_000_000)),
            lag: receives
                .iter()
                .map(|&(channel, peer_region)| LagWatch { channel, peer_region, since: None })
                .collect(),
            own: receives.iter().map(|&(c, peer)| (c, 1 - peer)).collect(),
            stall_since: None,
            reports: check.then(|| {
                receives
                    .iter()
                    .map(|&(channel, peer_region)| ReportWatch { channel, peer_region, last: None })
                    .collect()
            }),
            next_slow: Instant::now(),
        }
    }

    /// Forgets all history (a new VM, or a rollback).
    pub fn reset(&mut self, vcpus: usize) {
        self.clock = GuestClock::new(vcpus);
        self.judge.reset();
        for l in &mut self.lag {
            l.since = None;
        }
        self.stall_since = None;
        for r in self.reports.iter_mut().flatten() {
            r.last = None;
        }
    }

    /// One round: the VM's outcome if it ended (`Err`: not a fault, e.g.
    /// completed), else the heartbeat and channel-lag detectors.
    pub fn poll(
        &mut self,
        vm: &Vm,
        channels: &[HostChannel],
    ) -> Option<Result<(Detector, String), VmOutcome>> {
        if let Some(o) = vm.poll_outcome() {
            return Some(of_outcome(&o).ok_or(o));
        }
        let (clock, live) = self.slow_round(vm)?;
        if let Some(h) = self.judge.observe(vm.progress_marker(), &clock, &live) {
            return Some(Ok((
                Detector::LostHeartbeat,
                format!("no heartbeat while its vCPUs ran {} ms", h.ran_ns / 1_000_000),
            )));
        }
        self.channel_detectors(channels, &clock, &live).map(Ok)
    }

    /// The detectors on the sandbox's channels alone (output stall, channel
    /// check, channel lag), for a sandbox whose outcome and heartbeat
    /// another supervisor watches (`rollback`: nl-checkpoint's). Its
    /// detections name the detector first (`channel-check: ...`), which
    /// [`Detector::of_reason`] reads back.
    pub fn poll_channels(&mut self, vm: &Vm, channels: &[HostChannel]) -> Option<String> {
        let (clock, live) = self.slow_round(vm)?;
        self.channel_detectors(channels, &clock, &live)
            .map(|(d, why)| format!("{}: {why}", d.name()))
    }

    /// The vCPUs' clocks and which are live, for a round of the detectors
    /// that read /proc and the channel headers (`None`: not yet
    /// [`SLOW_PERIOD`] since the last, or the VM paused: nothing to judge).
    fn slow_round(&mut self, vm: &Vm) -> Option<(Vec<u64>, Vec<bool>)> {
        if Instant::now() < self.next_slow {
            return None;
        }
        self.next_slow = Instant::now() + SLOW_PERIOD;
        let clock = self.clock.update(&vm.vcpu_threads()).to_vec();
        if vm.is_paused() {
            self.judge.reset();
            return None;
        }
        Some((clock, self.clock.live()))
    }

    fn channel_detectors(
        &mut self,
        channels: &[HostChannel],
        clock: &[u64],
        live: &[bool],
    ) -> Option<(Detector, String)> {
        let now = clock.iter().zip(live).filter(|(_, l)| **l).map(|(c, _)| *c).min()?;
        if let Some(f) = self.output_stall(channels, now) {
            return Some(f);
        }
        if let Some(f) = self.channel_check(channels) {
            return Some(f);
        }
        let bound = self.cfg.channel_lag_words?;
        let grace = self.cfg.channel_lag_cpu_ms.saturating_mul(1_000_000);
        for l in &mut self.lag {
            let Some(c) = channels.get(l.channel) else { continue };
            let peer = c.header(l.peer_region);
            let own = c.header(1 - l.peer_region);
            if peer.generation == 0 {
                l.since = None;
                continue;
            }
            let ack = if own.ack_generation == peer.generation { own.ack_words } else { 0 };
            let lag = peer.head_words.saturating_sub(ack);
            if lag <= bound {
                l.since = None;
                continue;
            }
            match l.since {
                Some((a, t)) if a == ack => {
                    if now.saturating_sub(t) >= grace {
                        return Some((
                            Detector::ChannelLag,
                            format!(
                                "channel '{}': {lag} words published by the peer not consumed (bound {bound}) while the sandbox ran {} ms",
                                c.name,
                                now.saturating_sub(t) / 1_000_000
                            ),
                        ));
                    }
                }
                _ => l.since = Some((ack, now)),
            }
        }
        None
    }

    /// The channel-check detector (see the module doc).
    fn channel_check(&mut self, channels: &[HostChannel]) -> Option<(Detector, String)> {
        let reports = self.reports.as_mut()?;
        for &(c, r) in &self.own {
            let Some(ch) = channels.get(c) else { continue };
            ch.check_region(r);
            if let Some(f) = ch.take_finding(r) {
                return Some((
                    Detector::ChannelCheck,
                    format!(
                        "channel '{}': the host's check of its output found a bad record (seq {}, word {} of generation {:#x}): {}",
                        ch.name, f.seq, f.pos, f.generation, f.what
                    ),
                ));
            }
        }
        for w in reports.iter_mut() {
            let Some(ch) = channels.get(w.channel) else { continue };
            // Its own header first, then the peer's: whatever it consumed
            // was published by the peer's head read after.
            let own = ch.header(1 - w.peer_region);
            let peer = ch.header(w.peer_region);
            let sum = own.corrupt + own.lost + own.duplicated;
            let Some((last, rejected, gen)) =
                w.last.replace((sum, own.rejected, own.ack_generation))
            else {
                continue;
            };
            if sum <= last {
                continue;
            }
            // What it consumed, read by the host up to the peer's head.
            let _ = ch.check_region(w.peer_region);
            let same_stream = own.ack_generation == gen && peer.generation == gen;
            if own.rejected != rejected || !same_stream {
                continue;
            }
            if ch.region_clean_through(w.peer_region, gen, peer.head_words) == Some(true) {
                return Some((
                    Detector::ChannelCheck,
                    format!(
                        "channel '{}': it reported {} more corrupt, lost or duplicated messages in its peer's stream, which the host read intact up to word {}: its own receive state is wrong",
                        ch.name,
                        sum - last,
                        peer.head_words
                    ),
                ));
            }
        }
        None
    }

    /// The output-stall detector at the sandbox's clock `now`.
    fn output_stall(&mut self, channels: &[HostChannel], now: u64) -> Option<(Detector, String)> {
        let bound = self.cfg.output_stall_cpu_ms?.saturating_mul(1_000_000);
        if self.own.is_empty() {
            return None;
        }
        // A peer that does not drain (its ack over half a ring behind) holds
        // the sender back: that is not this sandbox's stall.
        let ring = nl_abi::CHANNEL_REGION_BYTES / 8 - nl_workloads::channel::HEADER_WORDS as u64;
        let blocked = self.own.iter().any(|&(c, r)| {
            channels.get(c).is_some_and(|ch| {
                let (mine, peer) = (ch.header(r), ch.header(1 - r));
                let ack = if peer.ack_generation == mine.generation { peer.ack_words } else { 0 };
                mine.head_words.saturating_sub(ack) > ring / 2
            })
        });
        if blocked {
            self.stall_since = None;
            return None;
        }
        // A withdrawn region (generation 0, a restart under way) or a new
        // generation changes the sum too: only an unchanged one stalls.
        let heads = self
            .own
            .iter()
            .filter_map(|&(c, r)| channels.get(c).map(|ch| ch.header(r)))
            .fold(0u64, |a, h| a.wrapping_add(h.head_words).wrapping_add(h.generation));
        match self.stall_since {
            Some((h, t)) if h == heads => (now.saturating_sub(t) >= bound).then(|| {
                (
                    Detector::OutputStall,
                    format!(
                        "no record sent on its channels while it ran {} ms",
                        now.saturating_sub(t) / 1_000_000
                    ),
                )
            }),
            _ => {
                self.stall_since = Some((heads, now));
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_map_to_their_detectors() {
        let ge = |code| VmOutcome::GuestError { cpu: 0, code, info: 0, message: "x".into() };
        assert_eq!(
            of_outcome(&ge(nl_abi::ERR_CHANNEL_VIOLATION)).unwrap().0,
            Detector::ChannelViolation
        );
        assert_eq!(
            of_outcome(&ge(nl_abi::ERR_EXCEPTION_BASE + 13)).unwrap().0,
            Detector::GuestException
        );
        assert_eq!(of_outcome(&ge(nl_abi::ERR_SELF_CHECK)).unwrap().0, Detector::GuestError);
        let crash = |m: &str| VmOutcome::Crashed { cpu: 0, message: m.into() };
        assert_eq!(
            of_outcome(&crash("guest triple fault (last rip 0x1)")).unwrap().0,
            Detector::TripleFault
        );
        assert_eq!(
            of_outcome(&crash("KVM_EXIT_INTERNAL_ERROR: emulation failure")).unwrap().0,
            Detector::EmulationFailure
        );
        assert_eq!(
            of_outcome(&VmOutcome::Hung { silent_ms: 5 }).unwrap().0,
            Detector::LostHeartbeat
        );
        assert!(of_outcome(&VmOutcome::Completed).is_none());
        assert!(of_outcome(&VmOutcome::Stopped).is_none());
    }
}
