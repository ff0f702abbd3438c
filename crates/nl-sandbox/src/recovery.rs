//! Local recovery of one sandbox, run by its monitor thread while every
//! other sandbox runs on its own threads, untouched.
//!
//! * `stop`: the faulty sandbox is stopped and reported (the default).
//! * `restart`: its vCPUs are stopped and joined; its own output region of
//!   every channel is withdrawn (generation 0, ring cleared, the
//!   acknowledgement kept), which tells the peers at once; a new VM is built
//!   over fresh memory with the images reloaded and new vCPUs and devices,
//!   over the same channel windows and write guard; it starts pinned to the
//!   sandbox's cores and its guest rejoins its channels with a new
//!   generation (`nl_workloads::channel::Endpoint::rejoin`).
//! * `replace`: `restart` with the workload `recovery.replace_with`.
//! * `rollback`: the sandbox runs under nl-checkpoint's [`Supervisor`]
//!   (CoW-P μCheckpoints in 16-page blocks every
//!   `recovery.checkpoint_interval_ms`); a detected
//!   error rolls it back in place, so it keeps its state. Its network
//!   output, and what it publishes and acknowledges on its channels, are
//!   held until no rollback can undo them (`recovery.output_commit`, on by
//!   default; nl_checkpoint's `output_commit`; `nl_workloads::channel`,
//!   "Held output"). The supervisor runs on the sandbox's cores, beside
//!   its vCPU threads, as a real-time thread
//!   ([`Supervisor::with_realtime`]): an ordinary one's wake-up could wait
//!   behind them for seconds on a PVM host, and with no checkpoint nothing
//!   held is released.
//!
//! A recovery that fails leaves the sandbox stopped and reported, never
//! half-restored. More than `recovery.max_recoveries` faults within
//! `recovery.window_ms` stop the sandbox with a report instead of another
//! recovery.

use std::time::{Duration, Instant};

use nl_checkpoint::{CheckpointConfig, Mode, Supervisor};
use nl_vmm::{Vm, VmOutcome};
use serde::Serialize;

use crate::config::RecoveryPolicy;
use crate::detect::{Detection, Detector, Detectors};
use crate::set::{Sandbox, SandboxSet};

/// When each phase of a recovery ended, in ms after the detection (Quest-V's
/// Table 1). `None`: not reached (yet).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Phases {
    /// The faulty sandbox's vCPUs stopped and joined.
    pub stopped_ms: Option<f64>,
    /// Its own channel regions withdrawn: the peers see it at once.
    pub notified_ms: Option<f64>,
    /// A new VM over fresh memory, images loaded (restart, replace).
    pub image_ms: Option<f64>,
    /// That VM had been built ahead of the fault ([`crate::prepare`]).
    pub image_prepared: bool,
    /// Its vCPU threads started again (re-entry).
    pub reentry_ms: Option<f64>,
    /// The guest reinitialised: its workload began (channels rejoined).
    pub guest_init_ms: Option<f64>,
    /// The first message it published again (a heartbeat for a sandbox
    /// without channels).
    pub first_reply_ms: Option<f64>,
}

/// The detection latency of a sandbox's channel detectors that are on
/// (guest time), for the rollback supervisor's look-back.
fn channel_latency(d: &crate::config::DetectConfig) -> Option<Duration> {
    let lag = d.channel_lag_words.map(|_| d.channel_lag_cpu_ms);
    lag.into_iter().chain(d.output_stall_cpu_ms).max().map(Duration::from_millis)
}

/// Why a completion of the sandbox's guest is a failure, if it is: a
/// workload without end (a service) that reports completion was derailed
/// (a flipped stack pointer can return it into its exit), unless the set
/// is stopping.
fn completed_without_end(set: &SandboxSet, sb: &Sandbox) -> Option<String> {
    (sb.config.workload.endless() && !set.stop_requested()).then(|| {
        format!(
            "completed, but its workload ({}, duration_ms 0) runs without end",
            sb.config.workload.kind
        )
    })
}

/// Whether a completed sandbox's result is the one the host computes
/// (`verify::check`), and what is wrong if not.
fn verified(set: &SandboxSet, sb: &Sandbox, vm: &Vm) -> Result<(), String> {
    match crate::verify::check_vm(set, sb, vm) {
        (true, _) => Ok(()),
        (false, why) => Err(why.unwrap_or_else(|| "wrong result".into())),
    }
}

/// A `rollback` sandbox's result when its guest reports completion: a
/// workload without end (a service) must not complete, and one with an
/// end must have the result the host computes ([`verified`]).
fn result_check(set: &SandboxSet, sb: &Sandbox, vm: &Vm) -> Result<(), String> {
    if let Some(why) = completed_without_end(set, sb) {
        return Err(why);
    }
    verified(set, sb, vm)
}

/// Under `restart` and `replace`, why a completed sandbox's result is
/// wrong, if it is ([`verified`]): a derailed workload can return into
/// its own end early, or finish with corrupt data, and a fresh start runs it
/// again. Under `stop` the wrong result is reported as it is.
fn wrong_result(set: &SandboxSet, sb: &Sandbox, vm: &Vm) -> Option<String> {
    if !matches!(sb.config.recovery.policy, RecoveryPolicy::Restart | RecoveryPolicy::Replace)
        || set.stop_requested()
    {
        return None;
    }
    verified(set, sb, vm).err().map(|why| format!("result check failed at completion: {why}"))
}

/// One recovery.
#[derive(Clone, Debug, Serialize)]
pub struct RecoveryRecord {
    pub detection: Detection,
    pub policy: &'static str,
    pub ok: bool,
    pub error: Option<String>,
    pub phases: Phases,
}

fn ms_since(t: Instant) -> Option<f64> {
    Some(t.elapsed().as_secs_f64() * 1e3)
}

/// The monitor loop of one sandbox: detect, recover, until the sandbox
/// completes, is stopped, gives up or `limit` passes.
pub(crate) fn run(set: &SandboxSet, sb: &Sandbox, limit: Duration) -> VmOutcome {
    let outcome = if sb.config.recovery.policy == RecoveryPolicy::Rollback {
        run_rollback(set, sb, limit)
    } else {
        run_local(set, sb, limit)
    };
    sb.monitor.set_doing(crate::monitor::ENDED, set.elapsed_ms());
    outcome
}

/// The sandbox's detectors, as its config asks.
fn detectors(set: &SandboxSet, sb: &Sandbox) -> Detectors {
    Detectors::new(
        &sb.config.detect,
        sb.config.vcpus() as usize,
        &set.receives_of(sb.index),
        sb.config.channel_check(),
    )
}

/// [`run`] under the policies of a new VM (`stop`, `restart`, `replace`)
/// and remote takeover.
fn run_local(set: &SandboxSet, sb: &Sandbox, limit: Duration) -> VmOutcome {
    let deadline = Instant::now() + limit;
    let vcpus = sb.config.vcpus() as usize;
    let mut det = detectors(set, sb);
    // The recovery whose late phases (guest init, first reply) are pending.
    let mut pending: Option<Pending> = None;
    let mut recent: Vec<Instant> = Vec::new();
    // A service this sandbox is taking over (remote recovery).
    let mut watch = None;
    loop {
        let vm = sb.vm();
        if set.stop_requested() {
            vm.stop();
            finish(sb, &mut pending);
            crate::service::finish_watch(set, &mut watch);
            return VmOutcome::Stopped;
        }
        if Instant::now() > deadline {
            vm.stop();
            finish(sb, &mut pending);
            crate::service::finish_watch(set, &mut watch);
            return VmOutcome::TimedOut { limit_ms: limit.as_millis() as u64 };
        }
        sb.monitor.set_doing("watching", set.elapsed_ms());
        crate::service::standby_pass(set, sb, &mut watch);
        if let Some(p) = &mut pending {
            let regs = vm.control().vcpus[0].snapshot();
            let ph = &mut p.record.phases;
            if ph.guest_init_ms.is_none() && regs.phase >= nl_abi::PHASE_MEASURE_START {
                ph.guest_init_ms = ms_since(p.t0);
            }
            if ph.first_reply_ms.is_none() && set.replied(sb, regs.beats) {
                ph.first_reply_ms = ms_since(p.t0);
            }
            // A sandbox that is a service's standby now waits for a TAP
            // before its workload begins: a heartbeat is its first reply,
            // and its service's phases are the takeover's.
            let standby = set.services.is_standby(sb.index);
            if standby && ph.first_reply_ms.is_none() && regs.beats > 0 {
                ph.first_reply_ms = ms_since(p.t0);
            }
            if ph.first_reply_ms.is_some() && (ph.guest_init_ms.is_some() || standby) {
                finish(sb, &mut pending);
            }
        }
        let found = match det.poll(&vm, &set.channels) {
            None => {
                let nap = if pending.is_some() { 100 } else { 1000 };
                std::thread::sleep(Duration::from_micros(nap));
                continue;
            }
            // A service's completion is a failure, not an end; so is, under
            // a policy that recovers, a completion with a wrong result.
            Some(Err(o)) => {
                let failed = (o == VmOutcome::Completed)
                    .then(|| completed_without_end(set, sb).or_else(|| wrong_result(set, sb, &vm)))
                    .flatten();
                match failed {
                    Some(why) => (Detector::GuestError, why),
                    None => {
                        finish(sb, &mut pending);
                        crate::service::finish_watch(set, &mut watch);
                        return o;
                    }
                }
            }
            Some(Ok(f)) => f,
        };
        let t0 = Instant::now();
        finish(sb, &mut pending);
        let (detector, detail) = found;
        let detection = sb.monitor.detected(detector, detail.clone(), set.elapsed_ms());
        crate::trace(format_args!("{}: detected {}", sb.config.name, detector.name()));
        // Only this sandbox's vCPUs stop; the others run on their threads.
        vm.stop();
        let stopped_ms = ms_since(t0);
        crate::trace(format_args!("{}: stopped", sb.config.name));
        let outcome = match vm.poll_outcome() {
            Some(o) if o != VmOutcome::Stopped && o != VmOutcome::Completed => o,
            _ => match detector {
                Detector::LostHeartbeat => VmOutcome::Hung { silent_ms: 0 },
                _ => {
                    VmOutcome::Crashed { cpu: 0, message: format!("{}: {detail}", detector.name()) }
                }
            },
        };
        // Remote recovery: a service it holds moves to its standby first.
        if let Some(svc) = set.services.held_by(sb.index) {
            sb.monitor.set_doing("handing its service over", set.elapsed_ms());
            crate::service::finish_watch(set, &mut watch);
            crate::service::take_over(set, sb, svc, &detection, t0);
            crate::trace(format_args!("{}: take_over returned", sb.config.name));
        }
        let policy = sb.config.recovery.policy;
        if policy == RecoveryPolicy::Stop {
            return outcome;
        }
        let window = Duration::from_millis(sb.config.recovery.window_ms);
        recent.retain(|t| t.elapsed() < window);
        if recent.len() >= sb.config.recovery.max_recoveries as usize {
            sb.monitor.give_up(format!(
                "gave up: fault {} within {} ms after {} recoveries (recovery.max_recoveries); last: {} ({detail})",
                recent.len() + 1,
                window.as_millis(),
                recent.len(),
                detector.name()
            ));
            return outcome;
        }
        recent.push(t0);
        let mut phases = Phases { stopped_ms, ..Default::default() };
        sb.monitor.set_doing(crate::monitor::REBUILDING, set.elapsed_ms());
        let rebuilt = set.rebuild(sb, policy, t0, &mut phases);
        crate::trace(format_args!("{}: rebuild done ok={}", sb.config.name, rebuilt.is_ok()));
        match rebuilt {
            Ok(()) => {
                det.reset(vcpus);
                let record = RecoveryRecord {
                    detection,
                    policy: policy.name(),
                    ok: true,
                    error: None,
                    phases,
                };
                pending = Some(Pending { t0, record });
            }
            Err(e) => {
                sb.monitor.recovered(RecoveryRecord {
                    detection,
                    policy: policy.name(),
                    ok: false,
                    error: Some(e.to_string()),
                    phases,
                });
                // The old VM is stopped; no new one runs: stopped and reported.
                sb.vm().stop();
                return outcome;
            }
        }
    }
}

/// A recovery whose sandbox runs again, waiting for its late phases.
struct Pending {
    t0: Instant,
    record: RecoveryRecord,
}

/// Records the pending recovery (with the phases reached so far).
fn finish(sb: &Sandbox, pending: &mut Option<Pending>) {
    if let Some(p) = pending.take() {
        sb.monitor.recovered(p.record);
    }
}

/// `rollback`: the sandbox runs under nl-checkpoint's supervisor, which
/// checkpoints it, detects (outcome, vCPU-time heartbeat) and rolls back.
/// A handover ends the supervisor's run (the VM paused, its output
/// released, the ring dropped, [`crate::handover`]); if the handover fails
/// a new supervisor takes the paused VM over here with a fresh ring.
fn run_rollback(set: &SandboxSet, sb: &Sandbox, limit: Duration) -> VmOutcome {
    let vm = sb.vm();
    let r = &sb.config.recovery;
    let deadline = Instant::now() + limit;
    // The vCPU threads inherit this thread's affinity.
    if let Err(e) = crate::affinity::pin(0, &sb.config.cores) {
        return VmOutcome::Crashed { cpu: 0, message: e.to_string() };
    }
    loop {
        // Its guest runs only under a supervisor, which takes its first
        // checkpoint before the guest's next instruction (fresh, carried
        // by a handover, or after a failed one). Found running here, it
        // ran unsupervised: its output was not held and no checkpoint
        // covers what it did, so it is stopped and reported.
        if vm.started() && !vm.is_paused() && vm.poll_outcome().is_none() {
            vm.stop();
            let message = "its guest ran before its first checkpoint (unsupervised)".to_string();
            sb.monitor.give_up(message.clone());
            return VmOutcome::Crashed { cpu: 0, message };
        }
        let cfg = CheckpointConfig {
            // CoW-P in 16-page blocks: write faults cannot starve a writing
            // guest on a loaded host (nl-checkpoint's own tests do the same).
            mode: Mode::CowP,
            block_pages: 16,
            interval: Duration::from_millis(r.checkpoint_interval_ms),
            inject: 0,
            script: sb.take_script(),
            seed: 1,
            hang_timeout: Duration::from_millis(sb.config.detect.heartbeat_cpu_ms),
            // The channel detectors' own latencies, where they are on.
            latency_bound: channel_latency(&sb.config.detect),
            max_rollbacks: r.max_recoveries,
            time_limit: deadline.saturating_duration_since(Instant::now()),
            disk_every: 0,
            disk_path: None,
            disk_key: None,
            output_commit: r.output_commit(),
            commit_rule: r.release.unwrap_or_default(),
            live: Some(sb.live.clone()),
        };
        let start_ms = set.elapsed_ms();
        // Its own channel regions: what it publishes and acknowledges there
        // is held like its network output (nl_workloads::channel, "Held
        // output").
        let held = if r.output_commit() {
            set.own_regions_of(sb.index)
                .into_iter()
                .filter_map(|(c, region)| set.channels.get(c).map(|ch| ch.held_region(region)))
                .collect()
        } else {
            Vec::new()
        };
        // Beside the supervisor's own detectors (outcome, heartbeat): the
        // sandbox's channel detectors, as under the other policies, and its
        // result checked at completion, so a wrong result is rolled back
        // instead of reported as done.
        let vcpus = sb.config.vcpus() as usize;
        let mut det = detectors(set, sb);
        // The supervisor starts the VM, and after each rollback fresh vCPU
        // threads: they are placed (vCPU i on its core, the budget applied)
        // at its first polls once they are up. A budget that cannot be
        // applied stops the sandbox.
        let trivial = sb.config.cores.len() == 1 && sb.config.budget.is_none();
        let mut placed = trivial;
        let placing_failed = std::cell::RefCell::new(None);
        let detector = |vm: &Vm, fresh: bool| {
            if fresh {
                placed = trivial || placing_failed.borrow().is_some();
            }
            if !placed {
                match set.place_threads_when_up(sb, vm) {
                    Ok(done) => placed = done,
                    Err(e) => {
                        *placing_failed.borrow_mut() = Some(e.to_string());
                        placed = true;
                        vm.stop();
                        return None;
                    }
                }
            }
            if fresh {
                det.reset(vcpus);
            }
            det.poll_channels(vm, &set.channels)
        };
        let check = |vm: &Vm| result_check(set, sb, vm);
        let report = Supervisor::start_holding(&vm, cfg, held).and_then(|s| {
            s.with_realtime()
                .with_detector(Box::new(detector))
                .with_result_check(Box::new(check))
                .run()
        });
        if let Some(e) = placing_failed.take() {
            vm.stop();
            let message = format!("cannot place its threads or apply its budget: {e}");
            sb.monitor.give_up(message.clone());
            return VmOutcome::Crashed { cpu: 0, message };
        }
        let report = match report {
            Ok(r) => r,
            Err(e) => {
                vm.stop();
                let message = format!("rollback supervision failed: {e}");
                sb.monitor.give_up(message.clone());
                return VmOutcome::Crashed { cpu: 0, message };
            }
        };
        for rb in &report.rollbacks {
            let detector = Detector::of_reason(&rb.reason);
            let detection = sb.monitor.detected(detector, rb.reason.clone(), start_ms + rb.at_ms);
            sb.monitor.recovered(RecoveryRecord {
                detection,
                policy: "rollback",
                ok: true,
                error: None,
                phases: Phases {
                    reentry_ms: Some(rb.rollback_ms),
                    first_reply_ms: None,
                    ..Default::default()
                },
            });
        }
        if report.handed_over {
            sb.monitor.set_doing("handed over", set.elapsed_ms());
            // Until the handover fails (supervise again here) or this
            // process's set ends (it went on in the new process; or it is
            // destroyed, its VMs stopped).
            let stop =
                || set.stop_requested() || Instant::now() > deadline || vm.poll_outcome().is_some();
            if sb.gate.quiesced(stop) {
                continue;
            }
            vm.stop();
            return if set.stop_requested() {
                VmOutcome::Stopped
            } else {
                VmOutcome::TimedOut { limit_ms: limit.as_millis() as u64 }
            };
        }
        if let VmOutcome::Crashed { message, .. } = &report.outcome {
            if message.starts_with("gave up") {
                sb.monitor.give_up(message.clone());
            }
        }
        return report.outcome;
    }
}
