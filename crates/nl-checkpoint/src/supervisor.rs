//! Running a VM under checkpointing: checkpoints at a fixed interval, error
//! detection, rollback in place, statistics.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use nl_vmm::state::VmState;
use nl_vmm::{Vm, VmOutcome};
use serde::Serialize;

use crate::engine::{Engine, Mode};
use crate::inject::{self, GuestFault, Rng};
use crate::CheckpointError;

/// Consecutive checkpoints longer than the interval that end a run.
pub const MAX_OVERRUNS: u32 = 5;

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
    /// No heartbeat for this long counts as a detected error (hang).
    pub hang_timeout: Duration,
    /// Give up after this many rollbacks (the error keeps coming back).
    pub max_rollbacks: u32,
    /// Stop the run after this long, whatever the guest does.
    pub time_limit: Duration,
    /// Write the committed checkpoint to `disk_path` every this many
    /// checkpoints (0: never).
    pub disk_every: u32,
    pub disk_path: Option<std::path::PathBuf>,
}

/// One rollback.
#[derive(Clone, Debug, Serialize)]
pub struct RollbackRecord {
    pub at_ms: f64,
    pub reason: String,
    /// Time from detection to the VM running again.
    pub rollback_ms: f64,
    pub pages: usize,
    /// 2 = back to the older (committed) checkpoint.
    pub levels: u32,
    /// The checkpoint rolled back to was taken after the last injected fault
    /// (it may hold the error): checkpoint corruption.
    pub checkpoint_after_fault: bool,
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
    pub checkpoints: u64,
    pub faults_total: u64,
    pub faults_per_interval: f64,
    pub checkpoint_pages_avg: f64,
    pub checkpoint_pages_max: usize,
    pub checkpoint_pct_of_memory: f64,
    pub presaved_pages_avg: f64,
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
    pub outcome: VmOutcome,
}

pub struct Supervisor<'a> {
    vm: &'a Vm,
    cfg: CheckpointConfig,
    engine: Engine,
    /// The newest two checkpoints' non-memory state, oldest first, with their times.
    states: VecDeque<(VmState, Instant)>,
    start: Instant,
    // statistics
    intervals: u64,
    faults: u64,
    pages_sum: u64,
    pages_max: usize,
    presaved_sum: u64,
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
}

impl<'a> Supervisor<'a> {
    /// Starts the VM and takes checkpoint 0.
    pub fn start(vm: &'a Vm, cfg: CheckpointConfig) -> Result<Self, CheckpointError> {
        if cfg.interval < Duration::from_millis(5) {
            return Err(CheckpointError::Config(format!(
                "--interval {:?} is too short: at least 5 ms",
                cfg.interval
            )));
        }
        vm.start()?;
        vm.pause();
        let setup = (|| {
            let state = vm.save_state()?;
            let engine = Engine::start(cfg.mode, vm, cfg.block_pages)?;
            Ok::<_, CheckpointError>((state, engine))
        })();
        let (state, engine) = match setup {
            Ok(x) => x,
            Err(e) => {
                vm.resume();
                return Err(e);
            }
        };
        vm.resume();
        let now = Instant::now();
        Ok(Self {
            vm,
            cfg,
            engine,
            states: VecDeque::from([(state, now)]),
            start: now,
            intervals: 0,
            faults: 0,
            pages_sum: 0,
            pages_max: 0,
            presaved_sum: 0,
            pauses: Vec::new(),
            overruns: 0,
            disk_writes: 0,
            disk_skipped: 0,
            disk_capture_ms_max: 0.0,
            disk_bytes_last: 0,
            disk_writer: None,
            rollbacks: Vec::new(),
            injections: Vec::new(),
        })
    }

    fn ms_since_start(&self, t: Instant) -> f64 {
        t.duration_since(self.start).as_secs_f64() * 1e3
    }

    /// Pause, checkpoint, resume.
    fn checkpoint(&mut self) -> Result<(), CheckpointError> {
        let t0 = Instant::now();
        self.vm.pause();
        let r = (|| {
            let state = self.vm.save_state()?;
            let stats = self.engine.checkpoint(self.vm)?;
            self.maybe_write_disk()?;
            Ok::<_, CheckpointError>((state, stats))
        })();
        self.vm.resume();
        let (state, stats) = r?;
        let pause = t0.elapsed();
        self.pauses.push(pause.as_secs_f64() * 1e3);
        // One slow checkpoint on a busy host is noise; checkpoints that keep
        // taking longer than the interval mean the interval cannot be kept.
        if pause > self.cfg.interval {
            self.overruns += 1;
            if self.overruns >= MAX_OVERRUNS {
                return Err(CheckpointError::Config(format!(
                    "{MAX_OVERRUNS} checkpoints in a row took longer than the {:.1} ms interval \
                     (the last {:.1} ms): use a longer --interval",
                    self.cfg.interval.as_secs_f64() * 1e3,
                    pause.as_secs_f64() * 1e3
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
        self.states.push_back((state, t0));
        while self.states.len() > 2 {
            self.states.pop_front();
        }
        Ok(())
    }

    /// Every `disk_every` checkpoints, with the VM paused right after a
    /// checkpoint: captures the committed (older) checkpoint and hands it to
    /// a background thread that writes it to disk. A capture is skipped while
    /// the previous write is still going.
    fn maybe_write_disk(&mut self) -> Result<(), CheckpointError> {
        let Some(path) = self.cfg.disk_path.clone() else { return Ok(()) };
        let every = u64::from(self.cfg.disk_every.max(1));
        // `intervals` counts checkpoints before this one; the committed
        // state is the newest in `states` until this checkpoint is pushed.
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
        };
        let (state, _) = self.states.back().expect("checked");
        let engine = &self.engine;
        let image =
            crate::disk::capture(&header, state, self.vm.memory(), &|g| engine.committed_page(g))?;
        self.disk_capture_ms_max = self.disk_capture_ms_max.max(t0.elapsed().as_secs_f64() * 1e3);
        let writer = std::thread::Builder::new()
            .name("ckpt-disk".into())
            .spawn(move || {
                nl_vmm::seccomp::apply(nl_vmm::seccomp::Kind::Checkpoint);
                image.write(&path)
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

    /// Halts the vCPUs, restores memory and state to the committed
    /// checkpoint, and lets the VM run again.
    fn rollback(&mut self, reason: String) -> Result<(), CheckpointError> {
        let t0 = Instant::now();
        self.vm.halt_vcpus();
        let stats = self.engine.rollback(self.vm)?;
        // Two levels undone: the older state; one: the only one there is.
        let idx = if stats.levels == 2 { 0 } else { self.states.len() - 1 };
        let (state, taken) = self.states.remove(idx).expect("a checkpoint always exists");
        self.states.clear();
        self.vm.restore_state(&state)?;
        self.vm.relaunch()?;
        let last_fault = self.injections.last().map(|(t, _)| *t);
        self.rollbacks.push(RollbackRecord {
            at_ms: self.ms_since_start(t0),
            reason,
            rollback_ms: t0.elapsed().as_secs_f64() * 1e3,
            pages: stats.pages,
            levels: stats.levels,
            checkpoint_after_fault: last_fault.is_some_and(|f| taken > f),
        });
        self.states.push_back((state, taken));
        Ok(())
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
        let mut beats = self.vm.control().total_beats();
        let mut alive = Instant::now();
        let outcome = loop {
            if let Some(e) = self.engine.error() {
                self.vm.halt_vcpus();
                return Err(CheckpointError::Uffd(e));
            }
            if plan.front().is_some_and(|(t, _)| self.start.elapsed() >= *t) {
                let (_, scripted) = plan.pop_front().expect("checked");
                let fault = scripted.unwrap_or_else(|| inject::pick(&mut rng, self.vm));
                inject::apply(self.vm, &fault)?;
                if let GuestFault::Memory { gpa, .. } = fault {
                    self.engine.note_vmm_write(gpa);
                }
                let now = Instant::now();
                let rec = InjectionRecord { at_ms: self.ms_since_start(now), fault };
                self.injections.push((now, rec));
            }
            let detected = match self.vm.poll_outcome() {
                Some(VmOutcome::Completed) => break VmOutcome::Completed,
                Some(VmOutcome::Stopped) => break VmOutcome::Stopped,
                Some(o) => Some(o.message()),
                None => {
                    let b = self.vm.control().total_beats();
                    if b != beats {
                        beats = b;
                        alive = Instant::now();
                        None
                    } else if alive.elapsed() > self.cfg.hang_timeout {
                        Some(format!(
                            "guest stopped heartbeating for {} ms",
                            alive.elapsed().as_millis()
                        ))
                    } else {
                        None
                    }
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
                self.rollback(reason)?;
                alive = Instant::now();
                next = Instant::now() + self.cfg.interval;
                continue;
            }
            if self.start.elapsed() > self.cfg.time_limit {
                self.vm.halt_vcpus();
                break VmOutcome::TimedOut { limit_ms: self.cfg.time_limit.as_millis() as u64 };
            }
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
            }
            std::thread::sleep(
                next.saturating_duration_since(Instant::now()).min(Duration::from_millis(2)),
            );
        };
        self.report(outcome)
    }

    fn report(mut self, outcome: VmOutcome) -> Result<RunReport, CheckpointError> {
        self.reap_disk_writer_inner(true)?;
        let n = self.intervals.max(1) as f64;
        let mem_pages = (self.vm.memory().size() / crate::PAGE as u64) as f64;
        let pages_avg = self.pages_sum as f64 / n;
        Ok(RunReport {
            mode: self.cfg.mode.name(),
            block_pages: self.cfg.block_pages,
            interval_ms: self.cfg.interval.as_secs_f64() * 1e3,
            checkpoints: self.intervals,
            faults_total: self.faults,
            faults_per_interval: self.faults as f64 / n,
            checkpoint_pages_avg: pages_avg,
            checkpoint_pages_max: self.pages_max,
            checkpoint_pct_of_memory: 100.0 * pages_avg / mem_pages,
            presaved_pages_avg: self.presaved_sum as f64 / n,
            pause_ms_avg: self.pauses.iter().sum::<f64>() / self.pauses.len().max(1) as f64,
            pause_ms_max: self.pauses.iter().copied().fold(0.0, f64::max),
            rollbacks: self.rollbacks,
            injections: self.injections.into_iter().map(|(_, r)| r).collect(),
            disk_writes: self.disk_writes,
            disk_skipped: self.disk_skipped,
            disk_capture_ms_max: self.disk_capture_ms_max,
            disk_bytes_last: self.disk_bytes_last,
            outcome,
        })
    }
}
