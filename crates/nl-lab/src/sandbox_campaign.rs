//! `ninelives inject --setup sandbox`: fault-injection campaigns into one
//! sandbox of a Quest-V sandbox set (`nl_sandbox`), classified as the VMM
//! campaigns are, sharded and merged the same way ([`crate::shards`]).
//!
//! Each run creates its own set of three sandboxes in this process:
//!
//! * `svc`, the target: `chanstream` for `--duration` seconds (then it
//!   completes and verifies itself: every message it received from `p`
//!   intact and in order), under the sandbox recovery policy of
//!   `--recovery` (`restart`, `replace`, `rollback`; `none` is the
//!   baseline policy `stop`);
//! * `p` and `q`, the healthy pair: `chanstream` over channel `pq` until
//!   the run stops them; `p` also serves `svc` over channel `sp`.
//!
//! Once both channels stream, ONE fault of the model `--sandbox-fault`
//! goes into `svc` ([`nl_sandbox::faults::pick_model`]): a guest memory or
//! register bit flip, a store to its read-only peer window of `sp`, or a
//! broken driver (an MMIO storm). The run waits until `svc` completes, is
//! given up, or its recovery fails (bounded), checks the healthy pair kept
//! going, stops the set and classifies:
//!
//! * `other_harmed`: `p` or `q` was touched: a detection or recovery in
//!   them, a message on their own channel `pq` rejected, corrupt, lost or
//!   duplicated (each end's receive counters of `pq`, which it publishes in
//!   its own region's header, see `nl_workloads::channel`), one of them
//!   paused or given new vCPU threads, channel `pq` restarted (its
//!   generation changed) or stalled after the fault, or one of them not
//!   running when the run stopped it. Checked first: it overrides every
//!   other class. What `p` rejected or found wrong on channel `sp` came
//!   from the faulty `svc` itself: it is recorded (`from_faulty`) as
//!   evidence of the isolation working, not as harm;
//! * `recovered`: `svc`'s monitor detected the fault, every recovery
//!   succeeded, and `svc` completed and verified;
//! * `not_manifested`: nothing detected, `svc` completed and verified;
//! * `sdc`: `svc` completed but verified wrong;
//! * `service_failed`: `svc` did not complete (stopped by its policy, given
//!   up, a failed recovery, or the run's time bound).
//!
//! The success rate is recovered / detected with its 95% Wilson interval,
//! and the harm rate other_harmed / runs with its interval.

use std::io::Write;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::ValueEnum;
use nl_sandbox::channel::RegionStats;
use nl_sandbox::config::RecoveryPolicy;
use nl_sandbox::faults::{self, FaultModel, Rng, SandboxFault};
use nl_sandbox::{SandboxSet, SetConfig};
use nl_vmm::VmOutcome;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::campaign::InjectArgs;
use crate::process::CANCEL;
use crate::shards::{Input, Missing, Shard};
use crate::stats::wilson;

/// `--sandbox-fault`: the fault model of a sandbox campaign.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SandboxFaultArg {
    /// A bit flip in guest memory (user image, stacks), as
    /// `--inject-guest-fault` picks it.
    MemoryFlip,
    /// A bit flip in a register (GPRs, RIP, RFLAGS).
    RegisterFlip,
    /// A store to the target's read-only view of its peer's channel page.
    ViolatingWrite,
    /// A broken driver: an endless storm of MMIO stores to an address no
    /// device claims.
    BrokenDriver,
    /// The workload's own end over its next ring-3 instruction: it
    /// completes early, with a wrong result.
    PrematureExit,
    /// Each run picks one of the five by its seed.
    Mixed,
    /// (control) The host makes `q`'s region of channel `pq` announce
    /// records `q` never wrote, as a broken isolation would: `p` rejects
    /// them on its own channel, so the run must be classified other_harmed.
    #[value(hide = true)]
    HarmControl,
    /// (control) The same on `svc`'s region of channel `sp`, as a broken
    /// driver in `svc` would: `p` rejects them, which is the isolation
    /// working, not harm.
    #[value(hide = true)]
    BadRecords,
}

impl SandboxFaultArg {
    pub fn name(self) -> &'static str {
        match self {
            SandboxFaultArg::Mixed => "mixed",
            SandboxFaultArg::HarmControl => "harm-control",
            SandboxFaultArg::BadRecords => "bad-records",
            m => m.model().map_or("?", FaultModel::name),
        }
    }

    fn model(self) -> Option<FaultModel> {
        match self {
            SandboxFaultArg::MemoryFlip => Some(FaultModel::MemoryFlip),
            SandboxFaultArg::RegisterFlip => Some(FaultModel::RegisterFlip),
            SandboxFaultArg::ViolatingWrite => Some(FaultModel::ViolatingWrite),
            SandboxFaultArg::BrokenDriver => Some(FaultModel::BrokenDriver),
            SandboxFaultArg::PrematureExit => Some(FaultModel::PrematureExit),
            SandboxFaultArg::Mixed | SandboxFaultArg::HarmControl | SandboxFaultArg::BadRecords => {
                None
            }
        }
    }
}

/// The outcome counts of a sandbox campaign (or of one fault model in it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcomes {
    pub recovered: u64,
    pub not_manifested: u64,
    pub service_failed: u64,
    pub other_harmed: u64,
    pub sdc: u64,
    /// Runs in which svc's monitor detected something (any class).
    pub detected: u64,
}

impl Outcomes {
    fn runs(&self) -> u64 {
        self.recovered + self.not_manifested + self.service_failed + self.other_harmed + self.sdc
    }

    fn count(&mut self, outcome: &str, detected: bool) {
        match outcome {
            "recovered" => self.recovered += 1,
            "not_manifested" => self.not_manifested += 1,
            "service_failed" => self.service_failed += 1,
            "other_harmed" => self.other_harmed += 1,
            "sdc" => self.sdc += 1,
            _ => return,
        }
        if detected {
            self.detected += 1;
        }
    }

    fn add(&mut self, o: &Outcomes) {
        self.recovered += o.recovered;
        self.not_manifested += o.not_manifested;
        self.service_failed += o.service_failed;
        self.other_harmed += o.other_harmed;
        self.sdc += o.sdc;
        self.detected += o.detected;
    }
}

/// What one healthy sandbox looked like at the end of a run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct HealthyView {
    pub name: String,
    pub outcome: String,
    /// Messages it received on all its channels.
    pub ops: u64,
    /// Its own end of channel `pq`: what it received, rejected, and found
    /// corrupt, lost or duplicated there.
    pub pq: RegionStats,
    pub detections: usize,
    pub recoveries: usize,
    /// Seen paused by the run's 1 ms watcher.
    pub paused: bool,
    /// Its vCPU threads were replaced during the run.
    pub new_threads: bool,
}

/// What the target looked like at the end of a run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct TargetView {
    /// Its current VM's outcome (`None`: still running at the time bound).
    pub outcome: Option<String>,
    pub completed: bool,
    pub verified: bool,
    pub problem: Option<String>,
    pub detections: Vec<String>,
    pub recoveries: usize,
    pub failed_recoveries: usize,
    pub gave_up: Option<String>,
}

/// The evidence a run's class is decided on (see the module documentation).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Evidence {
    pub target: TargetView,
    pub healthy: Vec<HealthyView>,
    /// `p`'s end of channel `sp`: what the faulty `svc` sent it, and what
    /// of that `p` rejected or found wrong (evidence, not harm).
    pub from_faulty: RegionStats,
    /// Channel pq's two generations changed (p or q restarted).
    pub pq_restarted: bool,
    /// Channel pq after the target's run ended.
    pub pq_watch: PqWatch,
}

/// Whether channel `pq` made progress after the target's run, judged on
/// the CPU time the healthy pair's vCPUs got (as the lost-heartbeat
/// detector judges a sandbox), not on wall time: on a loaded host a
/// sandbox's vCPU thread can wait for a CPU for many seconds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PqWatch {
    /// `progressed`: [`PQ_PROGRESS`] messages arrived on pq; `stalled`:
    /// they did not while both `p` and `q` ran [`PQ_CPU`] on a CPU;
    /// neither within [`PQ_WALL`]: `starved` when the one that did not
    /// run waited runnable for a CPU at least half the time (no verdict),
    /// else `blocked` (its vCPU thread neither ran nor waited: harm).
    pub verdict: PqVerdict,
    /// Messages received on pq (both ends) during the watch.
    pub messages: u64,
    /// The watch's wall time.
    pub wall_ms: u64,
    /// CPU time `p`'s and `q`'s vCPU threads got during it.
    pub cpu_ms: [u64; 2],
    /// Time they waited runnable for a CPU during it (schedstat's
    /// run_delay): starvation shows here, a blocked thread does not.
    pub wait_ms: [u64; 2],
    /// After [`PQ_SAMPLE`] without a verdict: `p`'s and `q`'s vCPU 0
    /// threads' scheduler state, wait channel and kernel stack (where a
    /// thread that neither runs nor waits for a CPU is blocked).
    pub blocked_in: Option<[String; 2]>,
}

/// When a watch without a verdict samples where the pair's threads are.
const PQ_SAMPLE: Duration = Duration::from_secs(5);

/// `(run_ns, run_delay_ns)` of thread `tid` of this process.
fn schedstat(tid: i32) -> Option<(u64, u64)> {
    let t = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).ok()?;
    let mut f = t.split_whitespace().map(|x| x.parse::<u64>().ok());
    Some((f.next()??, f.next()??))
}

/// State, wait channel and kernel stack of sandbox `name`'s first vCPU
/// thread, on one line.
fn where_is(s: &SandboxSet, name: &str) -> String {
    let Some(tid) = s.get(name).and_then(|b| b.vm().vcpu_threads().into_iter().flatten().next())
    else {
        return "no vCPU thread".into();
    };
    let read = |f: &str| std::fs::read_to_string(format!("/proc/self/task/{}/{f}", tid.tid));
    let state = read("stat")
        .ok()
        .and_then(|t| t.rsplit_once(") ").map(|(_, r)| r.chars().take(1).collect::<String>()))
        .unwrap_or_default();
    let wchan = read("wchan").unwrap_or_default();
    let stack: Vec<String> = read("stack")
        .unwrap_or_default()
        .lines()
        .take(8)
        .map(|l| l.split_whitespace().last().unwrap_or("").to_string())
        .collect();
    format!("state {state} wchan {wchan} stack {}", stack.join(" < "))
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PqVerdict {
    #[default]
    Progressed,
    Stalled,
    Starved,
    Blocked,
}

/// Messages on pq that count as progress.
const PQ_PROGRESS: u64 = 5;
/// CPU time each of `p` and `q` must have had for a missing progress to
/// be a stall (the target's `heartbeat_cpu_ms`).
const PQ_CPU: Duration = Duration::from_millis(200);
/// The watch's wall bound.
const PQ_WALL: Duration = Duration::from_secs(120);

/// The verdict on channel pq after `messages` arrived on it while `p` and
/// `q` ran `cpu_ms` on a CPU: `None` while neither progress nor a stall is
/// proven (however long the wall time: a vCPU waiting for the CPU is not a
/// stalled channel).
fn judge_pq(messages: u64, cpu_ms: [u64; 2]) -> Option<PqVerdict> {
    if messages >= PQ_PROGRESS {
        Some(PqVerdict::Progressed)
    } else if cpu_ms.iter().all(|&ms| ms >= PQ_CPU.as_millis() as u64) {
        Some(PqVerdict::Stalled)
    } else {
        None
    }
}

/// `(cpu_ns, run_delay_ns)` of sandbox `name`'s vCPU threads, from the
/// host's scheduler statistics.
fn vcpu_sched_ns(s: &SandboxSet, name: &str) -> (u64, u64) {
    s.get(name).map_or((0, 0), |b| {
        b.vm()
            .vcpu_threads()
            .iter()
            .flatten()
            .filter_map(|t| schedstat(t.tid))
            .fold((0, 0), |a, x| (a.0 + x.0, a.1 + x.1))
    })
}

/// Watches channel pq (bounded by [`PQ_WALL`]) until it progressed, or
/// stalled while `healthy` both had the CPU.
fn watch_pq(s: &SandboxSet, healthy: &[&str; 2]) -> PqWatch {
    let received = || -> u64 {
        healthy.iter().filter_map(|n| end_of(s, "pq", n).ok()).map(|r| r.received).sum()
    };
    let cpu = || healthy.map(|n| vcpu_sched_ns(s, n));
    let (m0, c0, t0) = (received(), cpu(), Instant::now());
    let mut w = PqWatch::default();
    let mut verdict = None;
    wait_for(PQ_WALL, || {
        let c = cpu();
        w.messages = received().saturating_sub(m0);
        w.cpu_ms = [0, 1].map(|i| c[i].0.saturating_sub(c0[i].0) / 1_000_000);
        w.wait_ms = [0, 1].map(|i| c[i].1.saturating_sub(c0[i].1) / 1_000_000);
        if w.blocked_in.is_none() && t0.elapsed() > PQ_SAMPLE {
            w.blocked_in = Some(healthy.map(|n| where_is(s, n)));
        }
        verdict = judge_pq(w.messages, w.cpu_ms);
        verdict.is_some()
    });
    w.wall_ms = t0.elapsed().as_millis() as u64;
    w.verdict = verdict.unwrap_or_else(|| {
        let short = (0..2).filter(|&i| w.cpu_ms[i] < PQ_CPU.as_millis() as u64);
        if short.clone().count() > 0 && short.clone().all(|i| 2 * w.wait_ms[i] >= w.wall_ms) {
            PqVerdict::Starved
        } else {
            PqVerdict::Blocked
        }
    });
    w
}

/// The class of a run and why.
pub fn classify(e: &Evidence) -> (&'static str, String) {
    let mut harm = Vec::new();
    for h in &e.healthy {
        let mut why = Vec::new();
        if h.outcome != "stopped" {
            why.push(format!("ended {}", h.outcome));
        }
        let pq = &h.pq;
        if pq.errors() > 0 {
            why.push(format!(
                "on pq {} rejected, {} corrupt, {} lost, {} duplicated",
                pq.rejected, pq.corrupt, pq.lost, pq.duplicated
            ));
        }
        if pq.received == 0 {
            why.push("received nothing on pq".to_string());
        }
        if h.detections > 0 || h.recoveries > 0 {
            why.push(format!("{} detections, {} recoveries", h.detections, h.recoveries));
        }
        if h.paused {
            why.push("paused".to_string());
        }
        if h.new_threads {
            why.push("new vCPU threads".to_string());
        }
        if !why.is_empty() {
            harm.push(format!("{}: {}", h.name, why.join(", ")));
        }
    }
    if e.pq_restarted {
        harm.push("channel pq restarted".to_string());
    }
    let w = &e.pq_watch;
    if w.verdict == PqVerdict::Stalled {
        harm.push(format!(
            "channel pq stalled after the fault: {} messages while p and q ran {} and {} ms",
            w.messages, w.cpu_ms[0], w.cpu_ms[1]
        ));
    }
    if w.verdict == PqVerdict::Blocked {
        harm.push(format!(
            "channel pq: {} messages in {} ms while p and q neither ran (CPU {} and {} ms) nor waited for a CPU ({} and {} ms): blocked in {:?}",
            w.messages, w.wall_ms, w.cpu_ms[0], w.cpu_ms[1], w.wait_ms[0], w.wait_ms[1], w.blocked_in
        ));
    }
    if !harm.is_empty() {
        return ("other_harmed", harm.join("; "));
    }
    if w.verdict == PqVerdict::Starved {
        // Not counted: the host did not run the healthy pair enough to
        // tell a stall from a wait for the CPU.
        return (
            "skipped",
            format!(
                "no verdict on the healthy pair: in {} ms its vCPUs got only {} and {} ms of CPU (under {} ms each; they waited for one {} and {} ms) and pq {} messages",
                w.wall_ms,
                w.cpu_ms[0],
                w.cpu_ms[1],
                PQ_CPU.as_millis(),
                w.wait_ms[0],
                w.wait_ms[1],
                w.messages
            ),
        );
    }
    let t = &e.target;
    let detected = !t.detections.is_empty();
    let what = t.detections.join(", ");
    if t.completed && !t.verified {
        let p = t.problem.clone().unwrap_or_default();
        return ("sdc", if detected { format!("{what}; then verified wrong: {p}") } else { p });
    }
    if !t.completed {
        let why = t
            .gave_up
            .clone()
            .or_else(|| t.outcome.clone())
            .unwrap_or_else(|| "still running at the run's time bound".into());
        return ("service_failed", if detected { format!("{what}; {why}") } else { why });
    }
    if !detected {
        return ("not_manifested", String::new());
    }
    if t.failed_recoveries > 0 || t.recoveries == 0 {
        return ("service_failed", format!("{what}; completed without a successful recovery"));
    }
    ("recovered", what)
}

/// One run's record (a JSON line).
#[derive(Clone, Debug, Serialize)]
pub struct RunRecord {
    pub run: u32,
    pub seed: u64,
    pub setup: &'static str,
    pub recovery: &'static str,
    pub model: &'static str,
    pub fault: Option<SandboxFault>,
    /// recovered, not_manifested, service_failed, other_harmed, sdc, or
    /// skipped (the fault did not go in).
    pub outcome: &'static str,
    pub detected: bool,
    pub reason: String,
    pub evidence: Option<Evidence>,
    /// Where the run's time went: the set created and started, both
    /// channels streaming, the fault in, the target's run over.
    pub phases_ms: Phases,
    pub elapsed_ms: u64,
}

/// Milestones of one run, in ms after its start.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Phases {
    pub created: u64,
    pub streaming: u64,
    pub injected: u64,
    pub target_done: u64,
}

struct Campaign {
    policy: RecoveryPolicy,
    model: SandboxFaultArg,
    duration: f64,
}

fn config(c: &Campaign, cores: [usize; 2]) -> String {
    let [c0, c1] = cores;
    let ms = (c.duration * 1e3) as u64;
    let replace = if c.policy == RecoveryPolicy::Replace {
        format!(
            r#""replace_with": {{"kind": "chanstream", "duration_ms": {ms}, "send_every_us": 500}},"#
        )
    } else {
        String::new()
    };
    format!(
        r#"{{"sandboxes": [
            {{"name": "svc", "cores": [{c0}], "mem_mib": 48,
              "recovery": {{{replace} "policy": "{}", "checkpoint_interval_ms": 50}},
              "detect": {{"heartbeat_cpu_ms": 200}},
              "workload": {{"kind": "chanstream", "duration_ms": {ms}, "send_every_us": 1000}}}},
            {{"name": "p", "cores": [{c1}], "mem_mib": 48, "workload": {{"kind": "chanstream", "duration_ms": 0, "send_every_us": 1000}}}},
            {{"name": "q", "cores": [{c0}], "mem_mib": 48, "workload": {{"kind": "chanstream", "duration_ms": 0, "send_every_us": 1000}}}}
        ], "channels": [{{"name": "sp", "between": ["svc", "p"]}}, {{"name": "pq", "between": ["p", "q"]}}]}}"#,
        c.policy.name()
    )
}

/// Words both ends of channel `c` consumed.
fn consumed(s: &SandboxSet, c: usize) -> u64 {
    let a = s.channels[c].header(0);
    let b = s.channels[c].header(1);
    a.ack_words + b.ack_words
}

/// With `writer` paused, makes its region of `channel` announce twice a
/// ring more than it wrote until `reader` rejected some of it (bounded),
/// then puts the head back and resumes `writer`.
fn forge_head(s: &SandboxSet, channel: &str, writer: &str, reader: &str) -> Result<()> {
    let c = s.channels.iter().find(|c| c.name == channel).context("no such channel")?;
    let w = s.get(writer).context("no such sandbox")?;
    let region = c.ends.iter().position(|&e| e == w.index).context("not an end")?;
    let rejected0 = end_of(s, channel, reader)?.rejected;
    let vm = w.vm();
    vm.pause();
    let head = c.header(region).head_words;
    c.set_head(region, head + 2 * (nl_abi::CHANNEL_REGION_BYTES / 8));
    let seen = wait_for(Duration::from_secs(30), || {
        end_of(s, channel, reader).is_ok_and(|r| r.rejected > rejected0)
    });
    c.set_head(region, head);
    vm.resume();
    if !seen {
        bail!("{reader} did not read {writer}'s forged head on {channel} within 30 s");
    }
    Ok(())
}

/// The header of `sandbox`'s own region of `channel`: its receive report
/// on that channel.
fn end_of(s: &SandboxSet, channel: &str, sandbox: &str) -> Result<RegionStats> {
    let c = s.channels.iter().find(|c| c.name == channel).context("no such channel")?;
    let sb = s.get(sandbox).context("no such sandbox")?;
    let end = c.ends.iter().position(|&e| e == sb.index).context("not an end of the channel")?;
    Ok(c.header(end))
}

fn wait_for(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < limit && !CANCEL.load(Relaxed) {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    f()
}

fn outcome_name(o: &VmOutcome) -> String {
    match o {
        VmOutcome::Completed => "completed".into(),
        VmOutcome::Stopped => "stopped".into(),
        o => o.message(),
    }
}

/// How long a run may take once the fault is in (target run, recoveries
/// on a loaded host).
const RUN_BOUND: Duration = Duration::from_secs(90);

fn run_one(c: &Campaign, run: u32, seed: u64) -> RunRecord {
    let t0 = Instant::now();
    let mut rec = RunRecord {
        run,
        seed,
        setup: "sandbox",
        recovery: recovery_name(c.policy),
        model: c.model.name(),
        fault: None,
        outcome: "skipped",
        detected: false,
        reason: String::new(),
        evidence: None,
        phases_ms: Phases::default(),
        elapsed_ms: 0,
    };
    if let Err(e) = run_body(c, seed, t0, &mut rec) {
        rec.outcome = "skipped";
        rec.reason = format!("run error: {e:#}");
    }
    rec.elapsed_ms = t0.elapsed().as_millis() as u64;
    rec
}

fn run_body(c: &Campaign, seed: u64, t0: Instant, rec: &mut RunRecord) -> Result<()> {
    let ms = || t0.elapsed().as_millis() as u64;
    let host = nl_sandbox::affinity::host_cores()?;
    let cores = [host[0], *host.last().context("no host core")?];
    let kvm = nl_vmm::open_kvm()?;
    let set = SandboxSet::create(
        &kvm,
        SetConfig::parse(&config(c, cores))?,
        &nl_launch::guest::sandbox_images(),
    )?;
    let s = &set;
    s.start_all()?;
    rec.phases_ms.created = ms();
    let done = AtomicBool::new(false);
    let paused = [AtomicBool::new(false), AtomicBool::new(false)];
    let healthy = ["p", "q"];
    let tids = |n: &str| -> Vec<Option<i32>> {
        s.get(n).map_or(Vec::new(), |b| {
            b.vm().vcpu_threads().iter().map(|t| t.map(|t| t.tid)).collect()
        })
    };
    let mut rng = Rng::new(seed);
    std::thread::scope(|scope| -> Result<()> {
        let sup = scope.spawn(|| s.supervise(RUN_BOUND * 2));
        // The healthy pair must never be paused: watched every 1 ms.
        let watcher = scope.spawn(|| {
            while !done.load(Relaxed) {
                for (i, n) in healthy.iter().enumerate() {
                    if s.get(n).is_some_and(|b| b.vm().is_paused()) {
                        paused[i].store(true, Relaxed);
                    }
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        let body = (|| -> Result<Option<Evidence>> {
            if !wait_for(Duration::from_secs(60), || consumed(s, 0) > 200 && consumed(s, 1) > 200) {
                bail!("the sandboxes did not start streaming within 60 s");
            }
            rec.phases_ms.streaming = ms();
            let tids0: Vec<_> = healthy.iter().map(|n| tids(n)).collect();
            let gens0 = [s.channels[1].header(0).generation, s.channels[1].header(1).generation];
            // A random moment within the target's first half run.
            let model = match c.model {
                SandboxFaultArg::Mixed => {
                    Some(FaultModel::ALL[rng.below(FaultModel::ALL.len() as u64) as usize])
                }
                m => m.model(),
            };
            std::thread::sleep(Duration::from_millis(rng.below((c.duration * 300.0) as u64)));
            let svc = s.get("svc").context("no svc")?;
            if svc.vm().poll_outcome().is_some() {
                rec.reason = "the target ended before the fault went in".into();
                return Ok(None);
            }
            match model {
                Some(m) => {
                    let fault = faults::pick_model(s, "svc", m, &mut rng)?;
                    rec.fault = Some(fault.clone());
                    faults::apply(s, "svc", &fault)?;
                }
                // The controls: a writer's region announces records it
                // never wrote until the reader `p` rejected some.
                None if c.model == SandboxFaultArg::HarmControl => forge_head(s, "pq", "q", "p")?,
                None => forge_head(s, "sp", "svc", "p")?,
            }
            rec.phases_ms.injected = ms();
            // The target's run plays out: it completes (perhaps after
            // recoveries), is given up, or its recovery fails. A completion
            // counts once its monitor has ended: until then it may still be
            // found wrong and recovered (a `rollback` sandbox's result
            // check rolls a wrong completion back).
            let end = Instant::now() + RUN_BOUND;
            let policy = c.policy;
            wait_for(RUN_BOUND, || {
                let o = svc.vm().poll_outcome();
                (o == Some(VmOutcome::Completed) && svc.monitor.ended())
                    || svc.monitor.gave_up_reason().is_some()
                    || svc.monitor.recoveries().iter().any(|r| !r.ok)
                    || (policy == RecoveryPolicy::Stop
                        && o.is_some()
                        && !svc.monitor.detections().is_empty())
                    || Instant::now() > end
            });
            rec.phases_ms.target_done = ms();
            // The healthy pair keeps going after it.
            let pq_watch = watch_pq(s, &healthy);
            let pq_restarted =
                [s.channels[1].header(0).generation, s.channels[1].header(1).generation] != gens0;
            let new_threads: Vec<bool> =
                healthy.iter().zip(&tids0).map(|(n, t0)| tids(n) != *t0).collect();
            Ok(Some(Evidence {
                pq_restarted,
                pq_watch,
                healthy: healthy
                    .iter()
                    .enumerate()
                    .map(|(i, n)| HealthyView {
                        name: n.to_string(),
                        new_threads: new_threads[i],
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            }))
        })();
        // Read the target before the stop: its current VM's own outcome.
        let svc_outcome = s.get("svc").and_then(|b| b.vm().poll_outcome());
        s.request_stop();
        let report = sup.join().map_err(|_| anyhow::anyhow!("the supervision panicked"))?;
        done.store(true, Relaxed);
        let _ = watcher.join();
        let Some(mut ev) = body? else { return Ok(()) };
        ev.from_faulty = end_of(s, "sp", "p")?;
        let svc = s.get("svc").context("no svc")?;
        let completed = svc_outcome == Some(VmOutcome::Completed);
        let (verified, problem) =
            if completed { nl_sandbox::verify::check_vm(s, svc, &svc.vm()) } else { (false, None) };
        let rs = svc.monitor.recoveries();
        ev.target = TargetView {
            outcome: svc_outcome.as_ref().map(outcome_name),
            completed,
            verified,
            problem,
            detections: svc
                .monitor
                .detections()
                .iter()
                .map(|d| d.detector.name().to_string())
                .collect(),
            recoveries: rs.iter().filter(|r| r.ok).count(),
            failed_recoveries: rs.iter().filter(|r| !r.ok).count(),
            gave_up: svc.monitor.gave_up_reason(),
        };
        for (i, h) in ev.healthy.iter_mut().enumerate() {
            let r = report.sandboxes.iter().find(|r| r.name == h.name).context("no report")?;
            h.outcome = outcome_name(&r.outcome);
            h.ops = r.ops;
            h.pq = end_of(s, "pq", &h.name)?;
            h.detections = r.detections.len();
            h.recoveries = r.recoveries.len();
            h.paused = paused[i].load(Relaxed);
        }
        let (outcome, reason) = classify(&ev);
        rec.outcome = outcome;
        rec.reason = reason;
        rec.detected = !ev.target.detections.is_empty();
        rec.evidence = Some(ev);
        Ok(())
    })
}

fn recovery_name(p: RecoveryPolicy) -> &'static str {
    match p {
        RecoveryPolicy::Stop => "none",
        p => p.name(),
    }
}

fn round4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

/// The summary of `o` (the shape `inject merge` reads back).
fn summary(
    model: &str,
    recovery: &str,
    o: &Outcomes,
    per_fault: &std::collections::BTreeMap<String, Outcomes>,
    skipped: u64,
    elapsed_s: f64,
    seed: u64,
) -> Value {
    let runs = o.runs();
    let (rate, ci) = if o.detected > 0 {
        let (lo, hi) = wilson(o.recovered, o.detected);
        (json!(round4(o.recovered as f64 / o.detected as f64)), json!([round4(lo), round4(hi)]))
    } else {
        (Value::Null, Value::Null)
    };
    let (hlo, hhi) = wilson(o.other_harmed, runs);
    json!({
        "runs": runs, "fault": model, "setup": "sandbox", "recovery": recovery,
        "outcomes": o, "per_fault": per_fault,
        "success_rate": rate, "success_ci95": ci,
        "harmed_rate": round4(o.other_harmed as f64 / runs.max(1) as f64),
        "harmed_ci95": [round4(hlo), round4(hhi)],
        "runs_per_min": round4(if elapsed_s > 0.0 { (runs + skipped) as f64 * 60.0 / elapsed_s } else { 0.0 }),
        "skipped": skipped, "elapsed_s": round4(elapsed_s), "seed": seed,
    })
}

fn table(s: &Value) -> String {
    use std::fmt::Write;
    let o = &s["outcomes"];
    let n = |k: &str| o[k].as_u64().unwrap_or(0);
    let runs = s["runs"].as_u64().unwrap_or(0);
    let mut t = String::new();
    let _ = writeln!(
        t,
        "sandbox campaign: fault {} recovery {}: {} runs ({} skipped), {:.1} runs/min",
        s["fault"].as_str().unwrap_or("?"),
        s["recovery"].as_str().unwrap_or("?"),
        runs,
        s["skipped"],
        s["runs_per_min"].as_f64().unwrap_or(0.0)
    );
    let _ = writeln!(t, "  {:<30} {:>6} {:>7}", "outcome", "runs", "share");
    for (label, k) in [
        ("recovered", "recovered"),
        ("fault not manifested", "not_manifested"),
        ("service failed", "service_failed"),
        ("another sandbox harmed", "other_harmed"),
        ("silent data corruption", "sdc"),
        ("(detected, any class)", "detected"),
    ] {
        let pct = 100.0 * n(k) as f64 / runs.max(1) as f64;
        let _ = writeln!(t, "  {label:<30} {:>6} {pct:>6.1}%", n(k));
    }
    match (s["success_rate"].as_f64(), s["success_ci95"][0].as_f64(), s["success_ci95"][1].as_f64())
    {
        (Some(r), Some(lo), Some(hi)) => {
            let _ = writeln!(
                t,
                "  recovered / detected: {r:.3}, 95% Wilson interval [{lo:.3}, {hi:.3}] over {} detected",
                n("detected")
            );
        }
        _ => {
            let _ = writeln!(t, "  no fault was detected, so there is no recovery rate");
        }
    }
    let _ = writeln!(
        t,
        "  another sandbox harmed: {} of {runs}, 95% Wilson interval [{:.3}, {:.3}]",
        n("other_harmed"),
        s["harmed_ci95"][0].as_f64().unwrap_or(0.0),
        s["harmed_ci95"][1].as_f64().unwrap_or(1.0)
    );
    if let Some(m) = s["per_fault"].as_object().filter(|m| m.len() > 1) {
        for (k, v) in m {
            let _ = writeln!(
                t,
                "  {k:<16} runs {:>4}: recovered {}, not manifested {}, service failed {}, harmed {}, sdc {}",
                ["recovered", "not_manifested", "service_failed", "other_harmed", "sdc"]
                    .iter()
                    .map(|x| v[x].as_u64().unwrap_or(0))
                    .sum::<u64>(),
                v["recovered"],
                v["not_manifested"],
                v["service_failed"],
                v["other_harmed"],
                v["sdc"]
            );
        }
    }
    t
}

/// `ninelives inject --setup sandbox ...`.
pub fn inject(a: InjectArgs, policy: RecoveryPolicy) -> Result<ExitCode> {
    let duration = a.duration.unwrap_or(1.5);
    let mut log = crate::campaign::start_campaign(&a, duration)?;
    let model = a.sandbox_fault;
    let cfg = Arc::new(Campaign { policy, model, duration });
    let shard = a.shard.unwrap_or(Shard::ALL);
    let indices = Arc::new(shard.runs(a.runs));
    let start = Instant::now();
    let limit = a.time_limit.map(Duration::from_secs_f64);
    let next = Arc::new(AtomicU32::new(0));
    let (tx, rx) = std::sync::mpsc::channel::<RunRecord>();
    let mut workers = Vec::new();
    for _ in 0..a.jobs.min(indices.len() as u32) {
        let (cfg, next, tx, indices) = (cfg.clone(), next.clone(), tx.clone(), indices.clone());
        let seed0 = a.seed;
        workers.push(std::thread::spawn(move || loop {
            let k = next.fetch_add(1, Relaxed) as usize;
            let Some(&i) = indices.get(k) else { return };
            if CANCEL.load(Relaxed) || limit.is_some_and(|l| start.elapsed() > l) {
                return;
            }
            let rec = run_one(&cfg, i, seed0 + u64::from(i));
            if CANCEL.load(Relaxed) {
                return; // an interrupted run is not classified
            }
            let _ = tx.send(rec);
        }));
    }
    drop(tx);
    let mut o = Outcomes::default();
    let mut per_fault = std::collections::BTreeMap::<String, Outcomes>::new();
    let mut skipped = 0;
    let mut done = Vec::new();
    let total = indices.len();
    for rec in rx {
        done.push(rec.run);
        if rec.outcome == "skipped" {
            skipped += 1;
        } else {
            o.count(rec.outcome, rec.detected);
            let kind = rec.fault.as_ref().map_or("?", SandboxFault::name).to_string();
            per_fault.entry(kind).or_default().count(rec.outcome, rec.detected);
        }
        let line = serde_json::to_string(&rec).unwrap_or_default();
        if let Some(f) = log.as_mut() {
            let _ = writeln!(f, "{line}");
        }
        if a.json {
            println!("{line}");
        } else {
            eprintln!(
                "run {}/{total} (seed {}): {} {}",
                done.len(),
                rec.seed,
                rec.fault.as_ref().map_or("-", SandboxFault::name),
                rec.outcome
            );
        }
    }
    for w in workers {
        if w.join().is_err() {
            bail!("a campaign worker panicked");
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    let recovery = recovery_name(policy);
    let mut s = summary(model.name(), recovery, &o, &per_fault, skipped, elapsed, a.seed);
    done.sort_unstable();
    s["campaign"] = crate::shards::identity(
        model.name(),
        "sandbox",
        recovery,
        "-",
        "svc",
        duration,
        a.seed,
        a.runs,
    );
    s["shard"] = json!(shard);
    s["run_indices"] = json!(done);
    s["loadavg"] = json!(crate::json_out::loadavg());
    let interrupted = CANCEL.load(Relaxed);
    if interrupted {
        s["interrupted"] = json!(true);
    }
    if a.json {
        println!("{s}");
    } else {
        print!("{}", table(&s));
        if interrupted {
            println!("  interrupted: runs under way were not counted");
        }
    }
    Ok(if interrupted { ExitCode::from(130) } else { ExitCode::SUCCESS })
}

/// `inject merge` of sandbox campaign shards (already checked by
/// [`crate::shards::check`]).
pub fn merge(
    inputs: &[Input],
    identity: Option<Value>,
    missing: &Missing,
    json_out: bool,
) -> Result<ExitCode> {
    let mut total = Outcomes::default();
    let mut per_fault = std::collections::BTreeMap::<String, Outcomes>::new();
    let (mut skipped, mut elapsed, mut seed) = (0u64, 0f64, u64::MAX);
    for inp in inputs {
        let s = &inp.summary;
        let o: Outcomes = serde_json::from_value(s["outcomes"].clone())
            .with_context(|| format!("{}: malformed outcomes", inp.name))?;
        total.add(&o);
        if let Some(m) = s["per_fault"].as_object() {
            for (k, v) in m {
                let o: Outcomes = serde_json::from_value(v.clone())
                    .with_context(|| format!("{}: malformed per_fault {k}", inp.name))?;
                per_fault.entry(k.clone()).or_default().add(&o);
            }
        }
        skipped += s["skipped"].as_u64().unwrap_or(0);
        elapsed += s["elapsed_s"].as_f64().unwrap_or(0.0);
        seed = seed.min(s["seed"].as_u64().unwrap_or(0));
    }
    let get = |k: &str| inputs[0].summary[k].as_str().unwrap_or("").to_string();
    let mut s =
        summary(&get("fault"), &get("recovery"), &total, &per_fault, skipped, elapsed, seed);
    if let Some(id) = identity {
        s["campaign"] = id;
    }
    s["merged"] = json!({"files": inputs.len(), "missing": missing});
    if json_out {
        println!("{s}");
    } else {
        print!("{}", table(&s));
        if !missing.shards.is_empty() || missing.runs > 0 {
            println!(
                "  partial: shard(s) not given: [{}]; runs not completed: {}",
                missing.shards.join(", "),
                missing.runs
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn healthy(name: &str) -> HealthyView {
        HealthyView {
            name: name.into(),
            outcome: "stopped".into(),
            ops: 100,
            pq: RegionStats { received: 100, ..Default::default() },
            ..Default::default()
        }
    }

    fn evidence() -> Evidence {
        Evidence {
            target: TargetView {
                outcome: Some("completed".into()),
                completed: true,
                verified: true,
                ..Default::default()
            },
            healthy: vec![healthy("p"), healthy("q")],
            from_faulty: RegionStats { received: 50, ..Default::default() },
            pq_restarted: false,
            pq_watch: PqWatch { messages: 40, wall_ms: 30, cpu_ms: [25, 25], ..Default::default() },
        }
    }

    #[test]
    fn a_clean_run_is_not_manifested_and_a_detected_recovered_one_is_recovered() {
        assert_eq!(classify(&evidence()).0, "not_manifested");
        let mut e = evidence();
        e.target.detections = vec!["guest-exception".into()];
        e.target.recoveries = 1;
        assert_eq!(classify(&e).0, "recovered");
        e.target.failed_recoveries = 1;
        assert_eq!(classify(&e).0, "service_failed");
    }

    #[test]
    fn any_sign_of_harm_in_the_healthy_pair_overrides_the_target_class() {
        let harms: [fn(&mut Evidence); 12] = [
            |e| e.healthy[0].pq.rejected = 1,
            |e| e.healthy[1].pq.corrupt = 1,
            |e| e.healthy[0].pq.lost = 1,
            |e| e.healthy[1].pq.duplicated = 1,
            |e| e.healthy[1].pq.received = 0,
            |e| e.healthy[1].paused = true,
            |e| e.healthy[0].detections = 1,
            |e| e.healthy[1].outcome = "guest error".into(),
            |e| e.healthy[0].new_threads = true,
            |e| e.pq_restarted = true,
            |e| {
                e.pq_watch = PqWatch {
                    verdict: PqVerdict::Stalled,
                    messages: 2,
                    wall_ms: 900,
                    cpu_ms: [200, 230],
                    ..Default::default()
                }
            },
            |e| {
                e.pq_watch =
                    PqWatch { verdict: PqVerdict::Blocked, wall_ms: 120_000, ..Default::default() }
            },
        ];
        for h in harms {
            let mut e = evidence();
            e.target.detections = vec!["guest-exception".into()];
            e.target.recoveries = 1;
            h(&mut e);
            let (c, why) = classify(&e);
            assert_eq!(c, "other_harmed", "{why}");
        }
    }

    #[test]
    fn pq_stalls_only_when_the_pair_had_the_cpu() {
        // The old rule's stalls: no progress within a wall-time bound, while
        // the host ran p and q for a few ms (measured in the campaign).
        assert_eq!(judge_pq(0, [3, 40]), None);
        assert_eq!(judge_pq(4, [0, 1000]), None);
        assert_eq!(judge_pq(4, [200, 200]), Some(PqVerdict::Stalled));
        assert_eq!(judge_pq(5, [0, 0]), Some(PqVerdict::Progressed));
    }

    #[test]
    fn a_healthy_pair_starved_of_the_cpu_gets_no_verdict() {
        let mut e = evidence();
        e.pq_watch = PqWatch {
            verdict: PqVerdict::Starved,
            messages: 1,
            wall_ms: 120_000,
            cpu_ms: [3, 150],
            wait_ms: [119_000, 100_000],
            ..Default::default()
        };
        let (c, why) = classify(&e);
        assert_eq!(c, "skipped", "{why}");
        assert!(why.contains("3 and 150 ms of CPU"), "{why}");
        // Any harm still overrides it.
        e.healthy[1].pq.lost = 1;
        assert_eq!(classify(&e).0, "other_harmed");
    }

    #[test]
    fn bad_records_from_the_faulty_sandbox_are_evidence_not_harm() {
        let mut e = evidence();
        e.target.detections = vec!["guest-exception".into()];
        e.target.recoveries = 1;
        e.from_faulty = RegionStats {
            received: 40,
            rejected: 3,
            corrupt: 1,
            lost: 7,
            duplicated: 1,
            ..Default::default()
        };
        // p's total over its channels counts them; its own pq is clean.
        e.healthy[0].ops = 140;
        assert_eq!(classify(&e).0, "recovered");
    }

    #[test]
    fn a_wrong_or_missing_target_result_is_sdc_or_service_failed() {
        let mut e = evidence();
        e.target.verified = false;
        e.target.problem = Some("chanstream: 1 corrupt".into());
        assert_eq!(classify(&e).0, "sdc");
        let mut e = evidence();
        e.target.completed = false;
        e.target.outcome = Some("stopped".into());
        e.target.detections = vec!["channel-violation".into()];
        assert_eq!(classify(&e).0, "service_failed");
    }

    #[test]
    fn the_summary_gives_wilson_intervals_and_merges_by_sum() {
        let o = Outcomes {
            recovered: 9,
            not_manifested: 5,
            service_failed: 1,
            detected: 10,
            ..Default::default()
        };
        let s = summary("mixed", "restart", &o, &Default::default(), 0, 60.0, 1);
        assert_eq!(s["success_rate"], 0.9);
        assert_eq!(s["success_ci95"], json!([0.5958, 0.9821]));
        assert_eq!(s["runs"], 15);
        let t = table(&s);
        assert!(t.contains("another sandbox harmed: 0 of 15"), "{t}");
        let mut a = o;
        a.add(&o);
        assert_eq!(a.runs(), 30);
    }
}
