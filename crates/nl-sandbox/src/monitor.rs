//! The per-sandbox monitor: receives its sandbox's isolation violations
//! from the VMM and applies the sandbox's policy. It is where per-sandbox
//! detectors and recovery policies attach (issue 19).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use nl_sync::Lock;
use nl_vmm::windows::{GuardAction, Violation, WriteGuard};
use serde::Serialize;

use crate::config::ViolationPolicy;

/// Violations kept in full per sandbox (all are counted).
pub const VIOLATION_LOG: usize = 64;

/// One sandbox's monitor.
pub struct Monitor {
    pub sandbox: String,
    pub policy: ViolationPolicy,
    count: AtomicU64,
    log: Arc<Lock<Vec<Violation>>>,
}

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
        })
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
