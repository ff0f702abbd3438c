//! The per-sandbox monitor: receives its sandbox's isolation violations
//! from the VMM, and records what its detectors found ([`crate::detect`])
//! and what its recoveries did ([`crate::recovery`]). Each detection is
//! also printed on stderr and published in nl-vmm's event log.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use nl_sync::Lock;
use nl_vmm::windows::{GuardAction, Violation, WriteGuard};
use serde::Serialize;

use crate::config::ViolationPolicy;
use crate::detect::{Detection, Detector};
use crate::recovery::RecoveryRecord;

/// Violations kept in full per sandbox (all are counted).
pub const VIOLATION_LOG: usize = 64;

/// One sandbox's monitor.
pub struct Monitor {
    pub sandbox: String,
    pub policy: ViolationPolicy,
    count: AtomicU64,
    log: Arc<Lock<Vec<Violation>>>,
    detections: Arc<Lock<Vec<Detection>>>,
    recoveries: Arc<Lock<Vec<RecoveryRecord>>>,
    gave_up: Arc<Lock<Option<String>>>,
    /// A service's TAP handed over by a failed holder's monitor
    /// ([`crate::service`]), until this monitor takes it.
    handover: Arc<Lock<Option<crate::service::Handover>>>,
    /// The handover in the mailbox was refused (its sandbox cannot take it).
    refused: AtomicBool,
    /// What the monitor loop is doing and since when (set-elapsed ms): a
    /// takeover that times out names it.
    doing: Arc<Lock<(&'static str, f64)>>,
    /// The VM a restart of this sandbox starts, built ahead of the fault
    /// ([`crate::prepare`]).
    next_vm: Arc<Lock<Option<nl_vmm::Vm>>>,
}

/// What [`Monitor::doing`] says while the monitor rebuilds its sandbox's VM.
pub const REBUILDING: &str = "rebuilding its VM";
/// [`Monitor::doing`] once the monitor loop has ended (the sandbox's
/// outcome is final: a `rollback` sandbox's completion, say, was accepted
/// by its result check and not rolled back).
pub const ENDED: &str = "ended";

/// Detections and recoveries kept in full per sandbox (all are counted in
/// the campaign's own records).
pub const DETECTION_LOG: usize = 10_000;

/// A violation as reported: which sandbox, where, from which instruction.
#[derive(Clone, Debug, Serialize)]
pub struct ViolationReport {
    pub sandbox: String,
    pub cpu: usize,
    pub gpa: u64,
    pub rip: u64,
    pub len: usize,
}

impl Monitor {
    pub fn new(sandbox: &str, policy: ViolationPolicy) -> Arc<Self> {
        Arc::new(Self {
            sandbox: sandbox.into(),
            policy,
            count: AtomicU64::new(0),
            log: Lock::new("sandbox.violations", Vec::new()),
            detections: Lock::new("sandbox.detections", Vec::new()),
            recoveries: Lock::new("sandbox.recoveries", Vec::new()),
            gave_up: Lock::new("sandbox.gave_up", None),
            handover: Lock::new("sandbox.handover", None),
            refused: AtomicBool::new(false),
            doing: Lock::new("sandbox.doing", ("starting", 0.0)),
            next_vm: Lock::new("sandbox.next_vm", None),
        })
    }

    /// The violations counted and logged so far (a handover carries them).
    pub fn violation_state(&self) -> (u64, Vec<Violation>) {
        (self.count.load(Relaxed), self.log.lock().clone())
    }

    /// Takes over the violations a monitor of the previous VMM process
    /// counted and logged.
    pub fn carry_violations(&self, count: u64, mut log: Vec<Violation>) {
        log.truncate(VIOLATION_LOG);
        self.count.store(count, Relaxed);
        *self.log.lock() = log;
    }

    /// Puts a service's TAP into this (standby's) monitor's mailbox.
    pub fn hand_over(&self, h: crate::service::Handover) {
        self.refused.store(false, Relaxed);
        *self.handover.lock() = Some(h);
    }

    /// Takes the handover from the mailbox.
    pub fn take_handover(&self) -> Option<crate::service::Handover> {
        self.handover.lock().take()
    }

    /// Marks the handover in the mailbox as refused.
    pub fn refuse_handover(&self) {
        self.refused.store(true, Relaxed);
    }

    /// Notes what the monitor loop does from `at_ms` on (each pass of its
    /// loop notes "watching" anew).
    pub(crate) fn set_doing(&self, what: &'static str, at_ms: f64) {
        *self.doing.lock() = (what, at_ms);
    }

    /// What the monitor loop is doing and since when (set-elapsed ms).
    pub fn doing(&self) -> (&'static str, f64) {
        *self.doing.lock()
    }

    /// Whether the monitor loop has ended (see [`ENDED`]).
    pub fn ended(&self) -> bool {
        self.doing().0 == ENDED
    }

    /// Whether a VM for the next restart is ready.
    pub fn next_vm_ready(&self) -> bool {
        self.next_vm.lock().is_some()
    }

    /// Keeps `vm` for the next restart (one at most: a second is dropped).
    pub(crate) fn stash_next_vm(&self, vm: nl_vmm::Vm) {
        let mut slot = self.next_vm.lock();
        if slot.is_none() {
            *slot = Some(vm);
        }
    }

    /// The VM built for the next restart, if one is ready.
    pub(crate) fn take_next_vm(&self) -> Option<nl_vmm::Vm> {
        self.next_vm.lock().take()
    }

    /// A handover waits in the mailbox, not refused.
    pub fn handover_pending(&self) -> bool {
        self.handover.lock().is_some() && !self.refused.load(Relaxed)
    }

    /// Records a detection: in the log, on stderr and in the event log.
    pub fn detected(&self, detector: Detector, detail: String, at_ms: f64) -> Detection {
        let d = Detection { sandbox: self.sandbox.clone(), detector, detail, at_ms };
        eprintln!(
            "ninelives: sandbox '{}': detector {} fired at {:.1} ms: {}",
            d.sandbox,
            detector.name(),
            at_ms,
            d.detail
        );
        nl_vmm::event_log::publish(
            "sandbox_detection",
            serde_json::json!({"sandbox": d.sandbox, "detector": detector.name(), "detail": d.detail}),
        );
        let mut log = self.detections.lock();
        if log.len() < DETECTION_LOG {
            log.push(d.clone());
        }
        d
    }

    /// Records a recovery (also on stderr when it failed).
    pub fn recovered(&self, r: RecoveryRecord) {
        if let Some(e) = &r.error {
            eprintln!("ninelives: sandbox '{}': recovery failed: {e}", self.sandbox);
        }
        nl_vmm::event_log::publish(
            "sandbox_recovery",
            serde_json::json!({"sandbox": self.sandbox, "policy": r.policy, "ok": r.ok, "error": r.error}),
        );
        let mut log = self.recoveries.lock();
        if log.len() < DETECTION_LOG {
            log.push(r);
        }
    }

    /// The sandbox is stopped for good: a fault recurred beyond its bound.
    pub fn give_up(&self, why: String) {
        eprintln!("ninelives: sandbox '{}': {why}", self.sandbox);
        nl_vmm::event_log::publish(
            "sandbox_gave_up",
            serde_json::json!({"sandbox": self.sandbox, "why": why}),
        );
        *self.gave_up.lock() = Some(why);
    }

    pub fn detections(&self) -> Vec<Detection> {
        self.detections.lock().clone()
    }

    pub fn recoveries(&self) -> Vec<RecoveryRecord> {
        self.recoveries.lock().clone()
    }

    /// Successful recoveries so far.
    pub fn recovery_count(&self) -> usize {
        self.recoveries.lock().iter().filter(|r| r.ok).count()
    }

    pub fn gave_up_reason(&self) -> Option<String> {
        self.gave_up.lock().clone()
    }

    /// Violations so far.
    pub fn violations(&self) -> u64 {
        self.count.load(Relaxed)
    }

    /// The first [`VIOLATION_LOG`] violations.
    pub fn violation_log(&self) -> Vec<ViolationReport> {
        self.log
            .lock()
            .iter()
            .map(|v| ViolationReport {
                sandbox: self.sandbox.clone(),
                cpu: v.cpu,
                gpa: v.gpa,
                rip: v.rip,
                len: v.len,
            })
            .collect()
    }
}

impl WriteGuard for Monitor {
    fn violation(&self, v: Violation) -> GuardAction {
        let n = self.count.fetch_add(1, Relaxed);
        if n < VIOLATION_LOG as u64 {
            self.log.lock().push(v);
        }
        match self.policy {
            ViolationPolicy::Stop => GuardAction::Stop,
            ViolationPolicy::Report => GuardAction::Continue,
        }
    }
}
