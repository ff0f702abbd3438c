//! Several VMs in one VMM process, addressed by id.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use kvm_ioctls::Kvm;
use serde::Serialize;

use crate::vm::{Vm, VmOutcome, VmReport};
use crate::{VmConfig, VmmError};

/// A VM owned by the host, with the monitor that waits for its outcome.
pub struct HostedVm {
    pub vm: Arc<Vm>,
    pub outcome: Arc<Mutex<Option<VmOutcome>>>,
    monitor: Mutex<Option<JoinHandle<()>>>,
}

/// One line of `list`.
#[derive(Clone, Debug, Serialize)]
pub struct VmSummary {
    pub id: u32,
    pub state: String,
    pub workload: u64,
    pub vcpus: u32,
    pub mem_bytes: u64,
}

/// `stats` of one VM.
#[derive(Clone, Debug, Serialize)]
pub struct VmStats {
    pub state: String,
    pub outcome: Option<VmOutcome>,
    #[serde(flatten)]
    pub report: VmReport,
}

pub struct Host {
    kvm: Kvm,
    vms: Mutex<BTreeMap<u32, Arc<HostedVm>>>,
    next_id: AtomicU32,
}

fn state_of(h: &HostedVm) -> String {
    match &*h.outcome.lock().unwrap_or_else(|p| p.into_inner()) {
        Some(VmOutcome::Completed) => "completed".into(),
        Some(VmOutcome::Stopped) => "stopped".into(),
        Some(o) => format!("failed: {}", o.message()),
        None if h.vm.is_paused() => "paused".into(),
        None => "running".into(),
    }
}

impl Host {
    pub fn new() -> Result<Arc<Self>, VmmError> {
        Ok(Arc::new(Self {
            kvm: crate::open_kvm()?,
            vms: Mutex::default(),
            next_id: AtomicU32::new(0),
        }))
    }

    fn vms(&self) -> MutexGuard<'_, BTreeMap<u32, Arc<HostedVm>>> {
        self.vms.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn get(&self, id: u32) -> Result<Arc<HostedVm>, VmmError> {
        self.vms().get(&id).cloned().ok_or_else(|| VmmError::Vm(id, "no such VM".into()))
    }

    /// Creates and starts a VM; a monitor thread records how it ends.
    pub fn create(&self, config: VmConfig) -> Result<u32, VmmError> {
        let id = self.next_id.fetch_add(1, Relaxed);
        let vm = Arc::new(Vm::create(&self.kvm, id, config)?);
        vm.start()?;
        let outcome = Arc::new(Mutex::new(None));
        let (v, o) = (vm.clone(), outcome.clone());
        let monitor =
            std::thread::Builder::new().name(format!("vm{id}-monitor")).spawn(move || {
                let r = v.wait(Duration::from_secs(u64::from(u32::MAX)));
                *o.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
            })?;
        let h = Arc::new(HostedVm { vm, outcome, monitor: Mutex::new(Some(monitor)) });
        self.vms().insert(id, h);
        Ok(id)
    }

    pub fn list(&self) -> Vec<VmSummary> {
        self.vms()
            .values()
            .map(|h| VmSummary {
                id: h.vm.id(),
                state: state_of(h),
                workload: h.vm.config().workload.kind,
                vcpus: h.vm.config().vcpus,
                mem_bytes: h.vm.config().mem_bytes,
            })
            .collect()
    }

    pub fn pause(&self, id: u32) -> Result<(), VmmError> {
        self.get(id)?.vm.pause();
        Ok(())
    }

    pub fn resume(&self, id: u32) -> Result<(), VmmError> {
        self.get(id)?.vm.resume();
        Ok(())
    }

    pub fn stats(&self, id: u32) -> Result<VmStats, VmmError> {
        let h = self.get(id)?;
        let outcome = h.outcome.lock().unwrap_or_else(|p| p.into_inner()).clone();
        Ok(VmStats { state: state_of(&h), outcome, report: h.vm.report() })
    }

    /// The VM itself, for mechanisms that act on a hosted VM.
    pub fn vm(&self, id: u32) -> Result<Arc<Vm>, VmmError> {
        Ok(self.get(id)?.vm.clone())
    }

    /// Stops a VM and forgets it.
    pub fn destroy(&self, id: u32) -> Result<(), VmmError> {
        let h = self.vms().remove(&id).ok_or_else(|| VmmError::Vm(id, "no such VM".into()))?;
        h.vm.resume();
        h.vm.stop();
        if let Some(m) = h.monitor.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = m.join();
        }
        Ok(())
    }

    /// Destroys every VM.
    pub fn shutdown(&self) {
        let ids: Vec<u32> = self.vms().keys().copied().collect();
        for id in ids {
            let _ = self.destroy(id);
        }
    }
}
