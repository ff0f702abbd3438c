//! Running a VM under checkpointing: checkpoints at a fixed interval, error
//! detection, rollback in place, statistics.
//!
//! # Which checkpoint a rollback uses
//!
//! An error is detected some time after the fault that caused it: the
//! detection latency. With a short interval (50 ms) and a slow detector
//! (the hang timeout, 1 s by default), the newest checkpoints were taken
//! after the fault and already hold it; rolling back to them repeats the
//! error or, worse, ends in silent data corruption. Rather than refusing
//! intervals below the detection latency (which would forbid checkpointing
//! tens of times a second with a 1 s hang timeout), the supervisor keeps a
//! ring of checkpoints spanning at least the largest detection latency `L`
//! of every enabled detector (the hang timeout and the guest self-check's
//! bound T_B, `CheckpointConfig::latency_bound`) and rolls back to the newest
//! checkpoint taken at least `L` before the detection.
//!
//! `L` and checkpoint ages are measured on the guest's clock, the time its
//! vCPU threads ran guest code ([`nl_vmm::progress::GuestClock`]; `L` gets
//! one tick, the clock's resolution, added), not wall time: a
//! detector's latency is guest execution, and on a loaded host wall time
//! says nothing about how far the guest got. The rule is strict and holds
//! for every vCPU still working ([`rollback_target`]), so the target predates
//! the fault whichever vCPU consumed it. The first checkpoint of a run (the
//! guest as it started) always qualifies.
//!
//! # Errors found late, and errors that come back
//!
//! Not every error is found within `L`: a corrupted word that no round reads
//! again is only found by the guest's end-of-run self-check, and a result
//! that is wrong though nothing crashed only by the result check
//! ([`Supervisor::with_result_check`], run when the guest reports
//! completion). A rollback `L` back then lands after the fault, and the
//! error comes back. So a detection that comes back before the guest has
//! re-run what the last rollback undid (plus `L`) is a recurrence, and each
//! recurrence doubles how far back the next rollback goes (`L`, `2L`, `4L`,
//! ... up to the run's first checkpoint, which predates every fault). A
//! detection after the guest got past that point starts again at `L`.
//! `max_rollbacks` still ends a run whose error keeps coming back.
//!
//! Memory: the ring holds, per interval, the pre-write copies of the pages
//! written in it. The run's first checkpoint is kept to the end (the last
//! resort of a recurring error). When the ring holds more than
//! [`ring_capacity`] checkpoints, or more pages than twice the guest's
//! memory, its oldest entries after the first are merged (one checkpoint
//! fewer to choose from, pages written in both held once: the older copy).
//! So the ring costs at most twice the guest's memory, plus the running
//! interval's copies; in practice the pages written over the run (the first
//! checkpoint's copies) plus those written over the ring's recent span.
//!
//! # Hangs
//!
//! The guest is hung when it shows no progress (heartbeat or phase change)
//! while every working vCPU ran `hang_timeout` of guest code
//! ([`nl_vmm::progress::HangJudge`]): a descheduled or stopped VMM is not a
//! hung guest. A guest that halts for good does not run, so it is not found
//! by that rule; `time_limit` ends such a run.
//!
//! # Output
//!
//! With [`CheckpointConfig::output_commit`] the network device's output is
//! held until no rollback can undo the state that produced it
//! ([`crate::output_commit`]): a reply waits about `L` of guest time plus
//! one interval, and nothing the guest sent is forgotten by a rollback
//! (unless a recurrence or a ring merge goes back past released output:
//! counted in [`RollbackRecord::past_released_output`]). Without it frames
//! go straight out, and a rollback undoes state the network has seen.
//!
//! The same holds for a sandbox's channel regions given to
//! [`Supervisor::start_holding`] (`nl_workloads::channel`, "Held output"):
//! at each checkpoint the supervisor records their owner words (head,
//! acknowledgement, ...), publishes a checkpoint's words as the released
//! view when its output may leave by [`CheckpointConfig::commit_rule`],
//! and on a rollback writes the target's words back, so peers never read a
//! record, nor reuse ring space, that a rollback takes back.
//!
//! # Handing the VM over
//!
//! A VMM process that hands its guests to a new one (a warm rejuvenation,
//! a microreboot) cannot move the ring: it lives in this process's heap
//! and its write tracking in this process's mappings. So the run ends
//! instead ([`Live::request_handover`]): at its next step with no error
//! detected the supervisor pauses the VM, sends every frame and writes
//! every disk write it holds, drops the ring (its write protection lifted)
//! and returns with [`RunReport::handed_over`], the VM left paused. The
//! state at that pause becomes committed: nothing can roll it back any
//! more, because whoever supervises the guest next (a new supervisor here
//! if the handover fails, or one in the new process) starts a fresh ring
//! whose first checkpoint is taken before the vCPUs run again
//! ([`Supervisor::start`] over a started VM only pauses it; a VM that
//! never ran is started paused). No fault is injected while a handover is
//! asked for, and a run whose last rollback has not settled
//! ([`Live::settled`]: its error may still come back) goes on until it
//! has. An error already in the guest at the pause but found after it
//! cannot be undone past that first checkpoint, as for any state older
//! than released output.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nl_vmm::progress::{GuestClock, HangJudge};
use nl_vmm::state::VmState;
use nl_vmm::{Vm, VmOutcome};
use serde::Serialize;

use crate::engine::{Engine, Mode};
use crate::inject::{self, GuestFault, Rng};
use crate::output_commit::{OutputCommit, OutputCommitStats};
use crate::CheckpointError;
use nl_workloads::channel;

/// Consecutive checkpoints longer than the interval that end a run.
pub const MAX_OVERRUNS: u32 = 5;

/// Checkpoints the ring keeps at most: enough to span four detection
/// latencies at the interval (two doublings of a recurring error's
/// look-back), plus a margin, at most 4096.
pub fn ring_capacity(latency: Duration, interval: Duration) -> usize {
    let per = latency.as_nanos() / interval.as_nanos().max(1);
    (per.saturating_mul(4).saturating_add(16)).min(4096) as usize
}

/// A check of the guest's result, run when it reports completion (for the
/// reference guest: its digests replayed on the host). `Err` is a detected
/// error: the supervisor rolls back instead of accepting the result.
pub type ResultCheck<'a> = Box<dyn FnMut(&Vm) -> Result<(), String> + 'a>;

/// A detector of the caller's, polled while the guest runs (after the
/// supervisor's own: outcome and hang): `Some(reason)` is a detected error,
/// rolled back like any other. The flag is `true` on its first call and on
/// the first after each rollback: what it remembered of the guest is then
/// out of date (a sandbox's channel detectors, say).
pub type ExtraDetector<'a> = Box<dyn FnMut(&Vm, bool) -> Option<String> + 'a>;

/// How a VM is protected.
#[derive(Clone, Debug)]
pub struct CheckpointConfig {
    pub mode: Mode,
    /// Pages saved and unprotected per write fault (CoW modes; 1 = per page).
    pub block_pages: usize,
    pub interval: Duration,
    /// Guest faults to inject, spread at random over the run.
    pub inject: u32,
    /// Faults to inject at given times since the start (replaying a logged
    /// campaign, or a test); injected in addition to the random ones.
    pub script: Vec<(Duration, GuestFault)>,
    pub seed: u64,
    /// No heartbeat while every working vCPU ran this long (CPU time)
    /// counts as a detected error (hang).
    pub hang_timeout: Duration,
    /// The guest self-check's error-latency bound T_B (guest time), if
    /// known. Rollbacks go back at least max(hang_timeout, latency_bound).
    pub latency_bound: Option<Duration>,
    /// Give up after this many rollbacks (the error keeps coming back).
    pub max_rollbacks: u32,
    /// Stop the run after this long, whatever the guest does.
    pub time_limit: Duration,
    /// Write the committed checkpoint to `disk_path` every this many
    /// checkpoints (0: never).
    pub disk_every: u32,
    pub disk_path: Option<std::path::PathBuf>,
    /// Authenticate the disk checkpoints with this key (HMAC-SHA256 trailer).
    pub disk_key: Option<crate::disk::Key>,
    /// Hold the network device's output until no rollback can undo it
    /// ([`crate::output_commit`]).
    pub output_commit: bool,
    /// When held output leaves, and so how far a first rollback goes back
    /// (see [`CommitRule`]).
    pub commit_rule: CommitRule,
    /// Faults injected while the run goes, and its rollbacks so far, shared
    /// with another thread.
    pub live: Option<Arc<Live>>,
}

/// When output commit lets held output leave, and with it how far back a
/// rollback that is not a recurrence goes: the two must agree, or a
/// rollback undoes output that has left.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CommitRule {
    /// Once its checkpoint is a rollback target for any error the enabled
    /// detectors can find: `L` of guest time after it (the module doc).
    /// Safe against latent errors found up to `L` after their fault; a
    /// reply waits about `L` of guest time plus one interval.
    #[default]
    DetectionLatency,
    /// When the checkpoint after its own is taken, as Remus releases an
    /// epoch's output once the backup has its checkpoint: the assumption
    /// is that an error is found within one checkpoint interval of its
    /// fault (an exception, a triple fault, a write to a read-only window;
    /// also a fault that waits for the guest's next timer tick). A first
    /// rollback then goes back to the checkpoint before the newest (and a
    /// hang at least the time it observed). An error found later (a hang,
    /// a corruption read later) comes back after that rollback, and its
    /// recurrence goes back `L`, `2L`, ... past output that has left:
    /// counted (`rollbacks_past_released_output`), never hidden. A reply
    /// waits one to two intervals, however little the guest runs.
    NextCheckpoint,
}

/// How much guest time before a detection a rollback's target must
/// predate: the base latency `latency_ns` (`L`), at least `observed_ns`
/// (the latency this detection is known to have had), doubled per
/// recurrence. Under [`CommitRule::NextCheckpoint`] a first detection
/// goes back only `observed_ns` in guest time (the target is also at least
/// one checkpoint back: [`first_target_by_count`]) and recurrences go
/// back `L`, `2L`, ...
pub fn look_back_ns(rule: CommitRule, latency_ns: u64, observed_ns: u64, recurrence: u32) -> u64 {
    let doubled = |base: u64, times: u32| base.saturating_mul(1 << times.min(40));
    match (rule, recurrence) {
        (CommitRule::DetectionLatency, r) => doubled(latency_ns.max(observed_ns), r),
        (CommitRule::NextCheckpoint, 0) => observed_ns,
        (CommitRule::NextCheckpoint, r) => doubled(latency_ns.max(observed_ns), r - 1),
    }
}

/// Under [`CommitRule::NextCheckpoint`], a first rollback's target among
/// `kept` checkpoints (oldest first) goes back at least to the one before
/// the newest, whose output is the newest that may have left.
pub fn first_target_by_count(rule: CommitRule, recurrence: u32, kept: usize) -> Option<usize> {
    (rule == CommitRule::NextCheckpoint && recurrence == 0).then(|| kept.saturating_sub(2))
}

/// A running supervisor's link to other threads: faults to inject (the
/// supervisor owns the VM's pause and resume, so another thread must not
/// inject itself) and the rollbacks done so far.
#[derive(Debug, Default)]
pub struct Live {
    faults: Mutex<Vec<GuestFault>>,
    rollbacks: AtomicU64,
    /// The guest re-ran what the last rollback undid, plus `L`: a detection
    /// now is a new error, not a recurrence (see the module doc).
    settled: AtomicBool,
    /// The last run's output commit statistics (set when it ends).
    output_commit: Mutex<Option<OutputCommitStats>>,
    /// A handover asks the run to end with the VM paused and its output
    /// released ([`Live::request_handover`]).
    handover: AtomicBool,
}

impl Live {
    /// Injects `fault` at the supervisor's next step (within a few ms).
    pub fn inject(&self, fault: GuestFault) {
        self.faults.lock().unwrap_or_else(|e| e.into_inner()).push(fault);
    }

    fn take_faults(&self) -> Vec<GuestFault> {
        std::mem::take(&mut *self.faults.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Faults queued and not yet injected.
    pub fn pending_faults(&self) -> usize {
        self.faults.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Rollbacks completed so far (the VM running again).
    pub fn rollbacks(&self) -> u64 {
        self.rollbacks.load(Ordering::SeqCst)
    }

    /// Whether the guest has re-run what the last rollback undid, plus the
    /// detection latency (true before any rollback): a fault detected now
    /// starts again at `L` instead of doubling the look-back as a
    /// recurrence. On an idle guest this takes long in wall time (guest
    /// time only accrues while it runs).
    pub fn settled(&self) -> bool {
        self.rollbacks() == 0 || self.settled.load(Ordering::SeqCst)
    }

    /// Asks the running supervisor (or the next one to start) to end its
    /// run for a handover at its next step with no error detected: the VM
    /// paused, every frame and disk write it holds released, its ring
    /// dropped; the run's report says [`RunReport::handed_over`] (see the
    /// module doc). Stands until [`Live::cancel_handover`].
    pub fn request_handover(&self) {
        self.handover.store(true, Ordering::SeqCst);
    }

    /// Withdraws a handover request (the handover is over, or failed).
    pub fn cancel_handover(&self) {
        self.handover.store(false, Ordering::SeqCst);
    }

    pub fn handover_requested(&self) -> bool {
        self.handover.load(Ordering::SeqCst)
    }

    /// Counts `n` rollbacks done before this process supervised the guest
    /// (a previous VMM process's, carried over). They are settled: a run
    /// hands its VM over only once its last rollback is.
    pub fn carry_rollbacks(&self, n: u64) {
        self.rollbacks.fetch_add(n, Ordering::SeqCst);
        self.settled.store(true, Ordering::SeqCst);
    }

    /// The output commit statistics of the last run that ended (`None`:
    /// none ended yet, or its output was not held).
    pub fn output_commit(&self) -> Option<OutputCommitStats> {
        self.output_commit.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// One rollback.
#[derive(Clone, Debug, Serialize)]
pub struct RollbackRecord {
    pub at_ms: f64,
    pub reason: String,
    /// Time from detection to the VM running again.
    pub rollback_ms: f64,
    pub pages: usize,
    /// Intervals undone (1 = back to the newest checkpoint).
    pub levels: u32,
    /// How long before the detection the target was taken, on the guest's
    /// clock (the least over working vCPUs; above `detection_latency_ms`
    /// unless the target is the run's first checkpoint).
    pub target_age_cpu_ms: f64,
    /// The target is the run's first checkpoint.
    pub target_is_first: bool,
    /// The checkpoint rolled back to was taken after the last injected fault
    /// (it may hold the error): checkpoint corruption.
    pub checkpoint_after_fault: bool,
    /// Recurrences of the error before this rollback: it went back at least
    /// `2^recurrence` detection latencies.
    pub recurrence: u32,
    /// Output commit: the target is older than output already sent, which
    /// this rollback undid (also said in `reason`).
    pub past_released_output: bool,
}

/// One injected fault.
#[derive(Clone, Debug, Serialize)]
pub struct InjectionRecord {
    pub at_ms: f64,
    pub fault: GuestFault,
}

/// Everything a protected run measured.
#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    pub mode: &'static str,
    pub block_pages: usize,
    pub interval_ms: f64,
    /// The largest detection latency of the enabled detectors (guest CPU
    /// time): rollbacks go back at least this far.
    pub detection_latency_ms: f64,
    /// Most checkpoints kept at once, and most pages their ring held.
    pub ring_checkpoints_max: usize,
    pub ring_pages_max: usize,
    /// Ring entries merged to keep it within guest memory.
    pub ring_merges: u64,
    pub checkpoints: u64,
    pub faults_total: u64,
    pub faults_per_interval: f64,
    pub checkpoint_pages_avg: f64,
    pub checkpoint_pages_max: usize,
    pub checkpoint_pct_of_memory: f64,
    pub presaved_pages_avg: f64,
    /// The shadow engines: pages the checkpoints' scans visited, on average.
    pub scanned_pages_avg: f64,
    /// Intervals captured with the dirty log and with the fault-free
    /// compare, and the auto mode's switches between them.
    pub intervals_dirty_log: u64,
    pub intervals_compare: u64,
    pub capture_switches: u64,
    /// The auto mode's unit costs (its start-up calibration).
    pub unit_costs: Option<crate::policy::UnitCosts>,
    /// The shadow engines' undo buffers: allocated in pauses, backed ahead
    /// by the background backer, the memory they took (None: CoW modes).
    pub undo_buffers: Option<crate::engine::BufferStats>,
    /// VM paused per checkpoint.
    pub pause_ms_avg: f64,
    pub pause_ms_max: f64,
    pub rollbacks: Vec<RollbackRecord>,
    pub injections: Vec<InjectionRecord>,
    /// Disk checkpoints written; skipped because the previous write was
    /// still going; the longest pause a capture added; the last file's size.
    pub disk_writes: u64,
    pub disk_skipped: u64,
    pub disk_capture_ms_max: f64,
    pub disk_bytes_last: u64,
    /// Output commit's frames and hold times (`None`: output not held).
    pub output_commit: Option<OutputCommitStats>,
    /// The run ended for a handover ([`Live::request_handover`]): the VM
    /// is paused, its output released, the ring dropped (`outcome`:
    /// stopped).
    pub handed_over: bool,
    pub outcome: VmOutcome,
}

/// A sandbox channel region whose owner is the supervised VM and whose
/// output the supervisor holds (`nl_workloads::channel`, "Held output").
pub type HeldRegion = Arc<dyn channel::HeaderWords>;

/// One kept checkpoint's non-memory state, when it was taken (wall time,
/// for reports) and the guest's clock then.
struct Kept {
    /// Sequence number among the run's checkpoints (0: the first).
    id: u64,
    state: VmState,
    /// The held channel regions' owner words then (one per held region).
    channels: Vec<channel::HeaderSnapshot>,
    taken: Instant,
    clock: Vec<u64>,
    first: bool,
}

/// The index of the newest kept checkpoint a rollback may use, given each
/// kept checkpoint's guest clock (oldest first; `first`: the run's first
/// checkpoint, which always qualifies), the clock `now`, which vCPUs are
/// still working, and the largest detection latency `latency_ns`.
///
/// A checkpoint qualifies when, for every working vCPU, its clock then is
/// strictly more than `latency_ns` behind now: a fault that vCPU detected
/// within `latency_ns` of its own running happened after the checkpoint
/// (strictly: a vCPU that did not run between a checkpoint and a fault
/// cannot order them, so equality does not qualify).
pub fn rollback_target<'c>(
    kept: impl DoubleEndedIterator<Item = (&'c [u64], bool)> + ExactSizeIterator,
    now: &[u64],
    working: &[bool],
    latency_ns: u64,
) -> Option<usize> {
    let n = kept.len();
    kept.rev()
        .position(|(clock, first)| first || qualifies(clock, now, working, latency_ns))
        .map(|from_newest| n - 1 - from_newest)
}

/// Whether a checkpoint taken at guest clock `clock` is strictly more than
/// `latency_ns` behind `now` for every working vCPU ([`rollback_target`]'s
/// rule, also output commit's release rule).
pub fn qualifies(clock: &[u64], now: &[u64], working: &[bool], latency_ns: u64) -> bool {
    clock
        .iter()
        .zip(now)
        .zip(working)
        .filter(|(_, w)| **w)
        .all(|((c, t), _)| c.checked_add(latency_ns).is_some_and(|c_l| c_l < *t))
}

/// The guest time from clock `then` to `now`, least over the working vCPUs.
fn least_since(then: &[u64], now: &[u64], working: &[bool]) -> u64 {
    then.iter()
        .zip(now)
        .zip(working)
        .filter(|(_, w)| **w)
        .map(|((c, t), _)| t.saturating_sub(*c))
        .min()
        .unwrap_or(0)
}

/// The last rollback: the guest clock when it happened and how much guest
/// time it undid (least over working vCPUs).
struct LastRollback {
    at: Vec<u64>,
    undone_ns: u64,
}

impl LastRollback {
    /// Whether a detection at clock `now` is this rollback's error back:
    /// the guest has not yet re-run what it undid plus `latency_ns`.
    fn recurs(&self, now: &[u64], working: &[bool], latency_ns: u64) -> bool {
        least_since(&self.at, now, working) <= self.undone_ns.saturating_add(latency_ns)
    }
}

pub struct Supervisor<'a> {
    vm: &'a Vm,
    cfg: CheckpointConfig,
    result_check: Option<ResultCheck<'a>>,
    detector: Option<ExtraDetector<'a>>,
    /// Consecutive recurrences of an error (see the module doc).
    recurrence: u32,
    last_rollback: Option<LastRollback>,
    engine: Engine,
    /// Kept checkpoints, oldest first; `engine` holds one history entry per
    /// pair of neighbours.
    states: VecDeque<Kept>,
    clock: GuestClock,
    /// max(hang timeout, latency bound) in ns of guest time.
    latency_ns: u64,
    ring_checkpoints_max: usize,
    ring_pages_max: usize,
    ring_merges: u64,
    start: Instant,
    // statistics
    intervals: u64,
    faults: u64,
    pages_sum: u64,
    pages_max: usize,
    presaved_sum: u64,
    scanned_sum: u64,
    captures: [u64; 2],
    pauses: Vec<f64>,
    /// Consecutive checkpoints that took longer than the interval.
    overruns: u32,
    disk_writes: u64,
    disk_skipped: u64,
    disk_capture_ms_max: f64,
    disk_bytes_last: u64,
    disk_writer: Option<std::thread::JoinHandle<Result<u64, CheckpointError>>>,
    rollbacks: Vec<RollbackRecord>,
    injections: Vec<(Instant, InjectionRecord)>,
    /// Held output (with `cfg.output_commit`).
    output: Option<OutputCommit>,
    /// Channel regions whose output is held (with `cfg.output_commit`),
    /// and the checkpoint whose words they publish.
    held: Vec<HeldRegion>,
    held_released: Option<u64>,
    /// The next checkpoint's sequence number.
    next_id: u64,
    /// Run as a real-time thread ([`Supervisor::with_realtime`]).
    realtime: bool,
}

impl<'a> Supervisor<'a> {
    /// Starts the VM and takes checkpoint 0 before it runs: a VM never
    /// started is started paused; one already started (handed over by an
    /// earlier run of this process, paused) is paused. Either way checkpoint
    /// 0 is the state it runs on from, and every rollback keeps it.
    pub fn start(vm: &'a Vm, cfg: CheckpointConfig) -> Result<Self, CheckpointError> {
        Self::start_holding(vm, cfg, Vec::new())
    }

    /// [`Supervisor::start`] for a VM that owns the channel regions `held`
    /// (a sandbox's own output regions): with `cfg.output_commit` their
    /// output is held like the network's. What the guest publishes and
    /// acknowledges on them becomes visible to its peers once released by
    /// `cfg.commit_rule`, and a rollback writes its target's header words
    /// back (`nl_workloads::channel::{hold, release, restore}`). Without
    /// output commit `held` is ignored.
    pub fn start_holding(
        vm: &'a Vm,
        cfg: CheckpointConfig,
        held: Vec<HeldRegion>,
    ) -> Result<Self, CheckpointError> {
        let held = if cfg.output_commit { held } else { Vec::new() };
        if cfg.interval < Duration::from_millis(5) {
            return Err(CheckpointError::Config(format!(
                "--interval {:?} is too short: at least 5 ms",
                cfg.interval
            )));
        }
        if cfg.output_commit {
            // Before the first instruction: nothing leaves unheld.
            vm.hold_net_output(true);
        }
        // A writable disk is part of the state a rollback restores: its
        // writes are held like output (see `crate::output_commit`).
        let hold_disk = vm.disk_writable();
        if hold_disk {
            vm.hold_disk_writes(true)?;
        }
        // The devices' own writes to guest memory (virtio-blk's read data,
        // used rings, status bytes; virtio-net's received frames) are not in
        // KVM's dirty log: the shadow engines are told of them at each
        // checkpoint and rollback, or a rollback would leave, say, a used
        // ring ahead of the driver's restored view of it.
        vm.track_vmm_writes(true);
        // No visit (`Vm::hold_paused`) between here and checkpoint 0.
        let section = vm.exclusive();
        if !vm.started() {
            // Its vCPU threads park before their first instruction.
            vm.request_pause();
            vm.start()?;
        }
        vm.pause();
        // Before the guest's next instruction: checkpoint 0 is committed,
        // so what its regions show now is released (nothing, for a VM that
        // never ran; everything so far, for one handed over or resumed
        // after a failed handover) and the rest is held.
        let channels = held
            .iter()
            .map(|r| {
                channel::hold(&**r);
                // Checkpoint 0's words, released as they are.
                let words = channel::snapshot(&**r);
                channel::release(&**r, &words);
                words
            })
            .collect();
        let setup = (|| {
            let state = vm.save_state()?;
            let engine = Engine::start(cfg.mode, vm, cfg.block_pages)?;
            Ok::<_, CheckpointError>((state, engine))
        })();
        let (state, engine) = match setup {
            Ok(x) => x,
            Err(e) => {
                // Unsupervised from here: nothing is held any more.
                vm.track_vmm_writes(false);
                let _ = vm.hold_disk_writes(false);
                vm.resume();
                return Err(e);
            }
        };
        // Frames sent before checkpoint 0 are part of its state, which every
        // rollback keeps: they go out at once.
        let mut output = (cfg.output_commit || hold_disk).then(OutputCommit::new);
        if let Some(oc) = &mut output {
            let since = vm.net_output_since();
            let (frames, disk) = (vm.take_net_output(), vm.take_disk_writes());
            oc.push(0, &[], true, frames, disk, since, Instant::now());
        }
        vm.resume();
        drop(section);
        let now = Instant::now();
        let vcpus = vm.config().vcpus as usize;
        let latency = cfg.hang_timeout.max(cfg.latency_bound.unwrap_or_default());
        Ok(Self {
            vm,
            cfg,
            result_check: None,
            detector: None,
            recurrence: 0,
            last_rollback: None,
            engine,
            states: VecDeque::from([Kept {
                id: 0,
                state,
                channels,
                taken: now,
                clock: vec![0; vcpus],
                first: true,
            }]),
            clock: GuestClock::new(vcpus),
            // Plus one tick: the guest clock's resolution.
            latency_ns: (latency.as_nanos().min(u128::from(u64::MAX / 2)) as u64)
                + nl_vmm::progress::tick_ns(),
            ring_checkpoints_max: 1,
            ring_pages_max: 0,
            ring_merges: 0,
            start: now,
            intervals: 0,
            faults: 0,
            pages_sum: 0,
            pages_max: 0,
            presaved_sum: 0,
            scanned_sum: 0,
            captures: [0; 2],
            pauses: Vec::new(),
            overruns: 0,
            disk_writes: 0,
            disk_skipped: 0,
            disk_capture_ms_max: 0.0,
            disk_bytes_last: 0,
            disk_writer: None,
            rollbacks: Vec::new(),
            injections: Vec::new(),
            output,
            held,
            held_released: None,
            next_id: 1,
            realtime: false,
        })
        .map(|mut s| {
            s.release_output();
            s
        })
    }

    /// Tells [`Live::settled`] whether a detection now would be a
    /// recurrence (the same rule as in [`Supervisor::rollback`]).
    fn update_settled(&self) {
        let (Some(live), Some(last)) = (&self.cfg.live, &self.last_rollback) else { return };
        let recurs = last.recurs(self.clock.now(), &self.working(), self.latency_ns);
        live.settled.store(!recurs, Ordering::SeqCst);
    }

    /// Sends the held output whose checkpoint no rollback can undo any more
    /// (see [`crate::output_commit`]).
    fn release_output(&mut self) {
        self.release_channels();
        if self.output.as_ref().is_none_or(OutputCommit::is_empty) {
            return;
        }
        let working = self.working();
        let Some(oc) = self.output.as_mut() else { return };
        let out = match self.cfg.commit_rule {
            CommitRule::DetectionLatency => {
                oc.releasable(self.clock.now(), &working, self.latency_ns, Instant::now())
            }
            // Through the checkpoint before the newest: the newest a first
            // rollback may go back to.
            CommitRule::NextCheckpoint => match self.states.len() {
                n if n >= 2 => oc.release_through(self.states[n - 2].id, Instant::now()),
                _ => Default::default(),
            },
        };
        if !out.frames.is_empty() {
            self.vm.release_net_output(&out.frames);
        }
        self.vm.release_disk_writes(&out.disk);
        self.vm.serve_disk_if_unblocked();
    }

    /// Publishes the held channel regions' words of the newest checkpoint
    /// whose output may leave by the commit rule: the one a first rollback
    /// would go back to at most (`DetectionLatency`: the newest kept that
    /// qualifies with `L` now; `NextCheckpoint`: the one before the newest).
    fn release_channels(&mut self) {
        if self.held.is_empty() {
            return;
        }
        let at = match self.cfg.commit_rule {
            CommitRule::DetectionLatency => rollback_target(
                self.states.iter().map(|k| (k.clock.as_slice(), k.first)),
                self.clock.now(),
                &self.working(),
                self.latency_ns,
            ),
            CommitRule::NextCheckpoint => Some(self.states.len().saturating_sub(2)),
        };
        let Some(k) = at.and_then(|i| self.states.get(i)) else { return };
        if self.held_released.is_some_and(|r| r >= k.id) {
            return;
        }
        for (r, s) in self.held.iter().zip(&k.channels) {
            channel::release(&**r, s);
        }
        self.held_released = Some(k.id);
    }

    /// Checks the guest's result when it reports completion; a failed check
    /// is a detected error (see the module doc).
    pub fn with_result_check(mut self, check: ResultCheck<'a>) -> Self {
        self.result_check = Some(check);
        self
    }

    /// Polls `detector` as well while the guest runs (see
    /// [`ExtraDetector`]); its detections are rolled back like the
    /// supervisor's own. Its latency (fault to detection, in guest time)
    /// must be covered by the hang timeout or
    /// [`CheckpointConfig::latency_bound`], like every detector's.
    pub fn with_detector(mut self, detector: ExtraDetector<'a>) -> Self {
        self.detector = Some(detector);
        self
    }

    /// Runs as a real-time thread (`SCHED_FIFO` priority 1, ordinary
    /// again when [`Supervisor::run`] returns; threads it starts are
    /// ordinary: [`nl_vmm::sched::Realtime`]): for a supervisor that shares
    /// its core with the guest's vCPU threads, whose wake-ups could
    /// otherwise wait behind them for seconds on a PVM host (a sandbox's).
    /// Its work is bounded: the pause, and [`Engine::prepare`] for at most
    /// a quarter of each interval. Without the privilege it says so once
    /// and runs as an ordinary thread.
    pub fn with_realtime(mut self) -> Self {
        self.realtime = true;
        self
    }

    fn ms_since_start(&self, t: Instant) -> f64 {
        t.duration_since(self.start).as_secs_f64() * 1e3
    }

    /// Tells the engine of every page the devices wrote since the last
    /// call (the vCPUs stopped: the list is complete up to now).
    fn note_device_writes(&mut self) {
        for (gpa, len) in self.vm.take_vmm_writes() {
            let first = gpa & !(crate::PAGE as u64 - 1);
            let end = gpa.saturating_add(len.max(1));
            for page in (first..end).step_by(crate::PAGE) {
                self.engine.note_vmm_write(page);
            }
        }
    }

    /// Pause, checkpoint, resume.
    fn checkpoint(&mut self) -> Result<(), CheckpointError> {
        let t0 = Instant::now();
        let own_cpu = || nl_vmm::progress::own_cpu_ns().unwrap_or(0);
        let cpu0 = own_cpu();
        // A visit (`Vm::hold_paused`, a fault injected from outside) never
        // overlaps the pause, so it never resumes the guest mid-capture.
        let section = self.vm.exclusive();
        self.vm.pause();
        // The guest's channel words with its vCPUs out: this checkpoint's.
        let channels = self.held.iter().map(|r| channel::snapshot(&**r)).collect();
        let r = (|| {
            let state = self.vm.save_state()?;
            self.note_device_writes();
            let stats = self.engine.checkpoint(self.vm)?;
            self.maybe_write_disk()?;
            Ok::<_, CheckpointError>((state, stats))
        })();
        let clock = self.clock.update(&self.vm.vcpu_threads()).to_vec();
        let id = self.next_id;
        if let Some(oc) = self.output.as_mut() {
            // The frames transmitted and disk writes made since the last
            // checkpoint, with the VM paused: exactly this checkpoint's.
            let since = self.vm.net_output_since();
            let (frames, disk) = (self.vm.take_net_output(), self.vm.take_disk_writes());
            oc.push(id, &clock, false, frames, disk, since, Instant::now());
        }
        self.vm.resume();
        drop(section);
        let (state, stats) = r?;
        self.next_id += 1;
        let pause = t0.elapsed();
        self.pauses.push(pause.as_secs_f64() * 1e3);
        // Checkpoints whose own work (this thread's CPU time) keeps taking
        // longer than the interval mean the interval cannot be kept. A pause
        // stretched by a busy host (waiting for the CPU) is not counted.
        let work = Duration::from_nanos(own_cpu().saturating_sub(cpu0));
        if pause > self.cfg.interval && work > self.cfg.interval {
            self.overruns += 1;
            if self.overruns >= MAX_OVERRUNS {
                return Err(CheckpointError::Config(format!(
                    "{MAX_OVERRUNS} checkpoints in a row took longer than the {:.1} ms interval \
                     (the last {:.1} ms, {:.1} ms of it on a CPU): use a longer --interval",
                    self.cfg.interval.as_secs_f64() * 1e3,
                    pause.as_secs_f64() * 1e3,
                    work.as_secs_f64() * 1e3
                )));
            }
        } else {
            self.overruns = 0;
        }
        self.intervals += 1;
        self.faults += stats.faults;
        self.pages_sum += stats.pages as u64;
        self.pages_max = self.pages_max.max(stats.pages);
        self.presaved_sum += stats.presaved as u64;
        self.scanned_sum += stats.scanned as u64;
        match stats.capture {
            Some(crate::policy::Capture::DirtyLog) => self.captures[0] += 1,
            Some(crate::policy::Capture::Compare) => self.captures[1] += 1,
            None => {}
        }
        self.states.push_back(Kept { id, state, channels, taken: t0, clock, first: false });
        self.trim_ring();
        self.release_output();
        Ok(())
    }

    /// Which vCPUs are still working (not done with their workload).
    fn working(&self) -> Vec<bool> {
        self.vm.control().vcpus.iter().map(|r| r.snapshot().phase != nl_abi::PHASE_DONE).collect()
    }

    /// Merges the oldest entries after the run's first checkpoint while the
    /// ring holds more than [`ring_capacity`] checkpoints or more pages than
    /// twice the guest's memory (see the module doc).
    fn trim_ring(&mut self) {
        let budget = self.ring_budget_pages();
        let cap = ring_capacity(Duration::from_nanos(self.latency_ns), self.cfg.interval);
        while (self.engine.history_pages() > budget || self.states.len() > cap)
            && self.engine.history_len() >= 2
        {
            // Over the count only: first a checkpoint whose successor has
            // the same guest clock (an idle guest's, the clock's resolution
            // being a tick): it is a rollback target exactly when that
            // successor is, which is newer, so it never is one. Its loss
            // costs nothing, and the ring keeps spanning `L` of guest time
            // (else rollbacks, and released output, go back too far).
            // Under `NextCheckpoint` the one before the newest is the
            // first rollback's target whatever its clock: kept.
            let last = match self.cfg.commit_rule {
                CommitRule::DetectionLatency => self.states.len() - 1,
                CommitRule::NextCheckpoint => self.states.len().saturating_sub(2),
            };
            let j = (self.engine.history_pages() <= budget)
                .then(|| (1..last).find(|&j| self.states[j].clock == self.states[j + 1].clock))
                .flatten()
                .unwrap_or(1);
            self.engine.merge_at(j - 1);
            self.states.remove(j);
            self.ring_merges += 1;
        }
        debug_assert_eq!(self.engine.history_len() + 1, self.states.len());
        self.ring_checkpoints_max = self.ring_checkpoints_max.max(self.states.len());
        self.ring_pages_max = self.ring_pages_max.max(self.engine.history_pages());
    }

    /// The most pages the ring holds: twice the guest's memory.
    fn ring_budget_pages(&self) -> usize {
        2 * (self.vm.memory().size() / crate::PAGE as u64) as usize
    }

    /// Every `disk_every` checkpoints, with the VM paused right after a
    /// checkpoint: captures the checkpoint before it and hands it to a
    /// background thread that writes it to disk. A capture is skipped while
    /// the previous write is still going.
    fn maybe_write_disk(&mut self) -> Result<(), CheckpointError> {
        let Some(path) = self.cfg.disk_path.clone() else { return Ok(()) };
        let every = u64::from(self.cfg.disk_every.max(1));
        // `intervals` counts checkpoints before this one, which is not yet in
        // `states` (the engine's history already has its interval).
        if !(self.intervals + 1).is_multiple_of(every) || self.states.is_empty() {
            return Ok(());
        }
        self.reap_disk_writer()?;
        if self.disk_writer.is_some() {
            self.disk_skipped += 1;
            return Ok(());
        }
        let t0 = Instant::now();
        let cfg = self.vm.config();
        let header = crate::disk::DiskHeader {
            version: crate::disk::DISK_VERSION,
            mem_bytes: cfg.mem_bytes,
            vcpus: cfg.vcpus,
            timer_hz: cfg.timer_hz,
            workload: cfg.workload,
            pages: 0,
            linux: self.vm.linux_record().cloned(),
            disk: cfg.disk.clone(),
        };
        // The checkpoint before this one (as with two kept checkpoints).
        let idx = self.states.len() - 1;
        let state = &self.states[idx].state;
        let engine = &self.engine;
        let key = self.cfg.disk_key.clone();
        let image =
            crate::disk::capture(&header, state, self.vm.memory(), &|g| engine.page_at(idx, g))?;
        self.disk_capture_ms_max = self.disk_capture_ms_max.max(t0.elapsed().as_secs_f64() * 1e3);
        let writer = std::thread::Builder::new()
            .name("ckpt-disk".into())
            .spawn(move || {
                nl_vmm::seccomp::apply(nl_vmm::seccomp::Kind::Checkpoint);
                image.write(&path, key.as_ref())
            })
            .map_err(|e| CheckpointError::Config(format!("cannot start the disk writer: {e}")))?;
        self.disk_writer = Some(writer);
        Ok(())
    }

    /// Collects a finished background disk write (or, with `wait`, waits for it).
    fn reap_disk_writer_inner(&mut self, wait: bool) -> Result<(), CheckpointError> {
        if self.disk_writer.as_ref().is_some_and(|w| wait || w.is_finished()) {
            let w = self.disk_writer.take().expect("checked");
            let n =
                w.join().map_err(|_| CheckpointError::Config("disk writer panicked".into()))??;
            self.disk_writes += 1;
            self.disk_bytes_last = n;
        }
        Ok(())
    }

    fn reap_disk_writer(&mut self) -> Result<(), CheckpointError> {
        self.reap_disk_writer_inner(false)
    }

    /// Halts the vCPUs, restores memory and state to the newest checkpoint
    /// taken at least the detection latency before now (guest time), and
    /// lets the VM run again. Returns `Err(reason)` (the VM halted) when no
    /// kept checkpoint is old enough.
    ///
    /// `observed_ns`: the latency this detection is known to have had (a
    /// hang's CPU time since the last progress, which can exceed the timeout
    /// by a sampling step); the target is at least that old too.
    ///
    /// `all_working`: judge the target by every vCPU's clock, also those
    /// that reported completion (a result check failed: their results are
    /// what was wrong).
    fn rollback(
        &mut self,
        reason: String,
        observed_ns: u64,
        all_working: bool,
    ) -> Result<Result<(), String>, CheckpointError> {
        let t0 = Instant::now();
        let _section = self.vm.exclusive();
        self.clock.update(&self.vm.vcpu_threads());
        self.vm.halt_vcpus();
        let now = self.clock.now().to_vec();
        let working = if all_working { vec![true; now.len()] } else { self.working() };
        // A detection before the guest re-ran what the last rollback undid
        // (plus a detection latency) is the same error back: look further.
        self.recurrence = match &self.last_rollback {
            Some(last) if last.recurs(&now, &working, self.latency_ns) => {
                self.recurrence.saturating_add(1)
            }
            _ => 0,
        };
        let latency =
            look_back_ns(self.cfg.commit_rule, self.latency_ns, observed_ns, self.recurrence);
        let by_time = rollback_target(
            self.states.iter().map(|k| (k.clock.as_slice(), k.first)),
            &now,
            &working,
            latency,
        );
        let target =
            match first_target_by_count(self.cfg.commit_rule, self.recurrence, self.states.len()) {
                // No look-back in time (an error found at once): by count
                // alone. By time, a checkpoint "strictly older than now"
                // could be many back on an idle guest, whose clock moves
                // in ticks.
                Some(by_count) if latency == 0 => Some(by_count),
                Some(by_count) => by_time.map(|t| t.min(by_count)),
                None => by_time,
            };
        let Some(target) = target else {
            return Ok(Err(format!(
                "{reason}; no kept checkpoint is {:.0} ms of guest time older, \
                 so none is known to predate the fault",
                latency as f64 / 1e6
            )));
        };
        let undo = self.states.len() - 1 - target;
        self.note_device_writes();
        let stats = self.engine.rollback(self.vm, undo)?;
        self.states.truncate(target + 1);
        let kept = self.states.back().expect("the target is kept");
        let mut reason = reason;
        let mut past_released_output = false;
        if let Some(oc) = self.output.as_mut() {
            // The vCPUs are halted: what the device holds was sent after
            // the newest checkpoint, by a state this rollback undoes.
            let device_held = self.vm.take_net_output().len();
            let device_disk = self.vm.take_disk_writes().len();
            let (out, past) = oc.rollback(kept.id, device_held, device_disk, Instant::now());
            self.vm.release_net_output(&out.frames);
            // The image takes the target's writes; every later one is
            // dropped (reads see the image again).
            self.vm.release_disk_writes(&out.disk);
            self.vm.discard_disk_writes();
            if past {
                past_released_output = true;
                reason.push_str(
                    "; output commit: the target is older than output already sent, \
                     which this rollback undoes",
                );
            }
        }
        if !self.held.is_empty() {
            // The guest's channel words go back with its RAM (its vCPUs are
            // halted); the target's words are part of its state, so they
            // are released (nothing past them ever was, unless released
            // output is undone: counted as for frames).
            for (r, s) in self.held.iter().zip(&kept.channels) {
                channel::restore(&**r, s);
                channel::release(&**r, &channel::snapshot(&**r));
            }
            if self.held_released.is_some_and(|r| r > kept.id) {
                if !past_released_output {
                    if let Some(oc) = self.output.as_mut() {
                        oc.note_past_released();
                    }
                    reason.push_str(
                        "; output commit: the target is older than channel output already \
                         released, which this rollback undoes",
                    );
                }
                past_released_output = true;
            }
            self.held_released = Some(kept.id);
        }
        self.vm.restore_state(&kept.state)?;
        self.vm.relaunch()?;
        let age_ns = least_since(&kept.clock, &now, &working);
        self.last_rollback = Some(LastRollback { at: now.clone(), undone_ns: age_ns });
        let last_fault = self.injections.last().map(|(t, _)| *t);
        let (taken, first) = (kept.taken, kept.first);
        self.rollbacks.push(RollbackRecord {
            at_ms: self.ms_since_start(t0),
            reason,
            rollback_ms: t0.elapsed().as_secs_f64() * 1e3,
            pages: stats.pages,
            levels: stats.levels,
            target_age_cpu_ms: age_ns as f64 / 1e6,
            target_is_first: first,
            checkpoint_after_fault: last_fault.is_some_and(|f| taken > f),
            recurrence: self.recurrence,
            past_released_output,
        });
        if let Some(live) = &self.cfg.live {
            live.settled.store(false, Ordering::SeqCst);
            live.rollbacks.fetch_add(1, Ordering::SeqCst);
        }
        Ok(Ok(()))
    }

    /// Runs until the guest completes (or can't be saved), checkpointing and
    /// rolling back as needed.
    pub fn run(mut self) -> Result<RunReport, CheckpointError> {
        let mut rng = Rng::new(self.cfg.seed);
        let duration = Duration::from_millis(self.vm.config().workload.duration_ms);
        // Injection times: uniform over the workload's run, after boot.
        let mut plan: Vec<(Duration, Option<GuestFault>)> = (0..self.cfg.inject)
            .map(|_| {
                (Duration::from_micros(100_000 + rng.below(duration.as_micros() as u64)), None)
            })
            .collect();
        plan.extend(self.cfg.script.iter().map(|(t, f)| (*t, Some(f.clone()))));
        plan.sort_by_key(|(t, _)| *t);
        let mut plan = VecDeque::from(plan);
        let mut next = Instant::now() + self.cfg.interval;
        let mut judge =
            HangJudge::new(self.cfg.hang_timeout.as_nanos().min(u128::from(u64::MAX)) as u64);
        let mut observed_ns = 0;
        let mut handed_over = false;
        // The caller's detector has to forget what it knew (see
        // `ExtraDetector`).
        let mut fresh = true;
        let realtime = self.realtime.then(nl_vmm::sched::Realtime::enter);
        if realtime.as_ref().is_some_and(|r| !r.on()) {
            tracing::warn!(
                "checkpoint: cannot run the supervisor as a real-time thread (needs \
                 CAP_SYS_NICE); its wake-ups may wait behind the guest's vCPU threads"
            );
        }
        let outcome = loop {
            if let Some(e) = self.engine.error() {
                self.vm.halt_vcpus();
                return Err(CheckpointError::Uffd(e));
            }
            // No fault goes in while a handover is asked for: the state at
            // its pause becomes committed (queued faults wait in `live`).
            let handing_over = self.cfg.live.as_ref().is_some_and(|l| l.handover_requested());
            let live = match &self.cfg.live {
                Some(l) if !handing_over => l.take_faults(),
                _ => Vec::new(),
            };
            for fault in live.into_iter().rev() {
                plan.push_front((Duration::ZERO, Some(fault)));
            }
            if !handing_over && plan.front().is_some_and(|(t, _)| self.start.elapsed() >= *t) {
                let (_, scripted) = plan.pop_front().expect("checked");
                let fault = scripted.unwrap_or_else(|| inject::pick(&mut rng, self.vm));
                match inject::apply(self.vm, &fault) {
                    Ok(at) => {
                        if let Some(gpa) = at {
                            // Written code may straddle a page boundary.
                            self.engine.note_vmm_write(gpa);
                            self.engine.note_vmm_write(gpa + inject::MAX_WRITE as u64 - 1);
                        }
                        let now = Instant::now();
                        let rec = InjectionRecord { at_ms: self.ms_since_start(now), fault };
                        self.injections.push((now, rec));
                    }
                    // Not where it must be now: again at the next step.
                    Err(CheckpointError::NotNow(_)) => {
                        plan.push_front((Duration::ZERO, Some(fault)))
                    }
                    Err(e) => return Err(e),
                }
            }
            let mut all_working = false;
            let detected = match self.vm.poll_outcome() {
                Some(VmOutcome::Completed) => {
                    match self.result_check.as_mut().map(|c| c(self.vm)) {
                        Some(Err(why)) => {
                            all_working = true;
                            Some(format!("result check failed at completion: {why}"))
                        }
                        _ => break VmOutcome::Completed,
                    }
                }
                Some(VmOutcome::Stopped) => break VmOutcome::Stopped,
                Some(o) => Some(o.message()),
                None if self.vm.disk_waiting_at_cap() => {
                    // Held back by the VMM (its disk at the cap on held
                    // writes until releases come): not the guest's hang.
                    self.clock.update(&self.vm.vcpu_threads());
                    judge.reset();
                    None
                }
                None => {
                    let clock = self.clock.update(&self.vm.vcpu_threads()).to_vec();
                    judge
                        .observe(self.vm.progress_marker(), &clock, &self.clock.live())
                        .map(|h| {
                            observed_ns = h.ran_ns;
                            format!(
                                "guest stopped heartbeating while its vCPUs ran {} ms",
                                h.ran_ns / 1_000_000
                            )
                        })
                        .or_else(|| {
                            let d = self.detector.as_mut()?;
                            d(self.vm, std::mem::take(&mut fresh))
                        })
                }
            };
            if let Some(reason) = detected {
                if self.rollbacks.len() as u32 >= self.cfg.max_rollbacks {
                    self.vm.halt_vcpus();
                    break VmOutcome::Crashed {
                        cpu: 0,
                        message: format!(
                            "gave up after {} rollbacks; last error: {reason}",
                            self.rollbacks.len()
                        ),
                    };
                }
                let observed = std::mem::take(&mut observed_ns);
                if let Err(message) = self.rollback(reason, observed, all_working)? {
                    break VmOutcome::Crashed { cpu: 0, message };
                }
                judge.reset();
                fresh = true;
                next = Instant::now() + self.cfg.interval;
                continue;
            }
            // Not before the guest re-ran what its last rollback undid: that
            // error may come back, and the handover commits the state.
            if handing_over && self.cfg.live.as_ref().is_some_and(|l| l.settled()) {
                // Nothing detected just now: pause, and hand over unless an
                // error came in between (then roll back first).
                let section = self.vm.exclusive();
                self.vm.pause();
                if self.vm.poll_outcome().is_none() {
                    handed_over = true;
                    break VmOutcome::Stopped;
                }
                self.vm.resume();
                drop(section);
                continue;
            }
            if self.start.elapsed() > self.cfg.time_limit {
                self.vm.halt_vcpus();
                break VmOutcome::TimedOut { limit_ms: self.cfg.time_limit.as_millis() as u64 };
            }
            // Output commit: between checkpoints too (the clock was updated
            // above), so a reply waits about L plus one interval.
            self.release_output();
            self.update_settled();
            let now = Instant::now();
            if now >= next {
                if let Err(e) = self.checkpoint() {
                    self.vm.halt_vcpus();
                    return Err(e);
                }
                next += self.cfg.interval;
                if next < Instant::now() {
                    next = Instant::now() + self.cfg.interval;
                }
                // Work for the next checkpoint, while the guest runs (on
                // another core when the host has one free), for at most a
                // quarter of the time to it: on a busy host this thread
                // competes with the vCPUs for the cores.
                let until = Instant::now() + next.saturating_duration_since(Instant::now()) / 4;
                self.engine.prepare(until, self.ring_budget_pages());
            }
            std::thread::sleep(
                next.saturating_duration_since(Instant::now()).min(Duration::from_millis(2)),
            );
        };
        self.report(outcome, handed_over)
    }

    /// Ends the run: its output settled, its ring dropped with `self`
    /// (the write protection lifted).
    fn report(
        mut self,
        outcome: VmOutcome,
        handed_over: bool,
    ) -> Result<RunReport, CheckpointError> {
        self.vm.track_vmm_writes(false);
        if let Some(oc) = self.output.as_mut() {
            // A completed guest's output is final, and so is a handed-over
            // guest's (its state at the pause is committed: see the module
            // doc); any other run's is not (its state is lost with the run).
            let device_held = self.vm.hold_net_output(false);
            // The disk keeps the guest's last writes unless the run ended
            // in an error its state holds (then the image stays at the
            // newest checkpoint no rollback could undo).
            let keep_disk = !matches!(
                outcome,
                VmOutcome::GuestError { .. } | VmOutcome::Crashed { .. } | VmOutcome::Hung { .. }
            );
            let completed = outcome == VmOutcome::Completed || handed_over;
            if completed {
                // A completed guest's channel output is final too, and so
                // is a handed-over one's (the module doc).
                for r in &self.held {
                    channel::release(&**r, &channel::snapshot(&**r));
                }
            }
            let out = oc.finish(completed, keep_disk, device_held, Instant::now());
            self.vm.release_net_output(&out.frames);
            self.vm.release_disk_writes(&out.disk);
            if !keep_disk {
                self.vm.discard_disk_writes();
            }
            if let Err(e) = self.vm.hold_disk_writes(false) {
                tracing::warn!("checkpoint: the disk's last writes did not reach the image: {e}");
            }
        }
        let output_commit = self.output.as_ref().map(|oc| {
            let mut st = oc.stats();
            if let Some((blk, _, _)) = self.vm.blk_stats() {
                st.disk_held_bytes_max = blk.held_bytes_max;
                st.disk_hold_cap_waits = blk.hold_cap_waits;
            }
            st
        });
        if let Some(live) = &self.cfg.live {
            *live.output_commit.lock().unwrap_or_else(|e| e.into_inner()) = output_commit.clone();
        }
        self.reap_disk_writer_inner(true)?;
        let n = self.intervals.max(1) as f64;
        let mem_pages = (self.vm.memory().size() / crate::PAGE as u64) as f64;
        let pages_avg = self.pages_sum as f64 / n;
        Ok(RunReport {
            mode: self.cfg.mode.name(),
            block_pages: self.cfg.block_pages,
            interval_ms: self.cfg.interval.as_secs_f64() * 1e3,
            detection_latency_ms: self.latency_ns as f64 / 1e6,
            ring_checkpoints_max: self.ring_checkpoints_max,
            ring_pages_max: self.ring_pages_max,
            ring_merges: self.ring_merges,
            checkpoints: self.intervals,
            faults_total: self.faults,
            faults_per_interval: self.faults as f64 / n,
            checkpoint_pages_avg: pages_avg,
            checkpoint_pages_max: self.pages_max,
            checkpoint_pct_of_memory: 100.0 * pages_avg / mem_pages,
            presaved_pages_avg: self.presaved_sum as f64 / n,
            scanned_pages_avg: self.scanned_sum as f64 / n,
            intervals_dirty_log: self.captures[0],
            intervals_compare: self.captures[1],
            capture_switches: self.engine.policy().map_or(0, |p| p.switches),
            unit_costs: self.engine.policy().map(|p| p.costs),
            undo_buffers: self.engine.buffers(),
            pause_ms_avg: self.pauses.iter().sum::<f64>() / self.pauses.len().max(1) as f64,
            pause_ms_max: self.pauses.iter().copied().fold(0.0, f64::max),
            rollbacks: self.rollbacks,
            injections: self.injections.into_iter().map(|(_, r)| r).collect(),
            disk_writes: self.disk_writes,
            disk_skipped: self.disk_skipped,
            disk_capture_ms_max: self.disk_capture_ms_max,
            disk_bytes_last: self.disk_bytes_last,
            output_commit,
            handed_over,
            outcome,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{first_target_by_count, look_back_ns, rollback_target, CommitRule};

    const MS: u64 = 1_000_000;

    fn target(kept: &[(Vec<u64>, bool)], now: &[u64], working: &[bool], l: u64) -> Option<usize> {
        rollback_target(kept.iter().map(|(c, f)| (c.as_slice(), *f)), now, working, l)
    }

    /// Checkpoints every 50 ms of guest time, the first one the run's start.
    fn ring(n: u64) -> Vec<(Vec<u64>, bool)> {
        (0..n).map(|i| (vec![i * 50 * MS], i == 0)).collect()
    }

    #[test]
    fn the_target_predates_detection_by_more_than_the_latency() {
        // 40 checkpoints (0..1950 ms), detection at 2000 ms, latency 1000 ms:
        // the newest checkpoint strictly before 1000 ms is the one at 950 ms,
        // not one of the two newest (1900, 1950 ms) that can hold the fault.
        let kept = ring(40);
        let t = target(&kept, &[2000 * MS], &[true], 1000 * MS).unwrap();
        assert_eq!(kept[t].0[0], 950 * MS);
        assert!(kept[t].0[0] + 1000 * MS < 2000 * MS);
        // Exactly the latency old does not qualify (a vCPU that did not run
        // between a checkpoint and a fault cannot order them).
        let t = target(&kept, &[1950 * MS], &[true], 1000 * MS).unwrap();
        assert_eq!(kept[t].0[0], 900 * MS);
    }

    #[test]
    fn a_descheduled_vcpu_holds_the_target_back() {
        // vCPU 1 ran only 100 ms since the start: only the first checkpoint
        // is old enough for it, whatever vCPU 0 did.
        let kept: Vec<(Vec<u64>, bool)> =
            (0..40).map(|i| (vec![i * 50 * MS, i * 2 * MS], i == 0)).collect();
        assert_eq!(target(&kept, &[2000 * MS, 100 * MS], &[true, true], 1000 * MS), Some(0));
        // Unless it finished its workload.
        let t = target(&kept, &[2000 * MS, 100 * MS], &[true, false], 1000 * MS).unwrap();
        assert_eq!(kept[t].0[0], 950 * MS);
    }

    #[test]
    fn the_first_checkpoint_always_qualifies_and_others_may_not() {
        let kept = ring(5);
        assert_eq!(target(&kept, &[300 * MS], &[true], 1000 * MS), Some(0));
        // Without the run's first checkpoint nothing is old enough.
        assert_eq!(target(&kept[1..], &[300 * MS], &[true], 1000 * MS), None);
        assert_eq!(target(&[], &[300 * MS], &[true], 0), None);
    }

    #[test]
    fn next_checkpoint_a_first_rollback_goes_back_one_checkpoint_then_doubles_from_l() {
        let l = 100 * MS;
        let r = CommitRule::NextCheckpoint;
        // An error found at once: no look-back in time, one checkpoint by count.
        assert_eq!(look_back_ns(r, l, 0, 0), 0);
        assert_eq!(first_target_by_count(r, 0, 10), Some(8));
        assert_eq!(first_target_by_count(r, 0, 1), Some(0), "the run's first checkpoint");
        // A hang is known to be at least its observed latency old.
        assert_eq!(look_back_ns(r, l, 130 * MS, 0), 130 * MS);
        // It came back: L, then 2L, 4L, by time only.
        assert_eq!(first_target_by_count(r, 1, 10), None);
        assert_eq!(look_back_ns(r, l, 0, 1), l);
        assert_eq!(look_back_ns(r, l, 0, 2), 2 * l);
        assert_eq!(look_back_ns(r, l, 0, 3), 4 * l);
        // The default: L, 2L, 4L from the first detection, by time only.
        let d = CommitRule::DetectionLatency;
        assert_eq!(first_target_by_count(d, 0, 10), None);
        assert_eq!(look_back_ns(d, l, 0, 0), l);
        assert_eq!(look_back_ns(d, l, 130 * MS, 0), 130 * MS);
        assert_eq!(look_back_ns(d, l, 0, 2), 4 * l);
        assert_eq!(look_back_ns(d, l, 0, 99), u64::MAX, "saturates");
    }
}
