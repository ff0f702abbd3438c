//! Several VMs in one VMM process, addressed by id.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
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
    /// Paused through the API (as opposed to paused by a mechanism).
    pub user_paused: std::sync::atomic::AtomicBool,
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
    /// Inode of the guest-memory memfd: the same before and after a warm
    /// handover (the memory was not copied).
    pub memfd_ino: u64,
    /// The workload's parameters (to replay and verify it on the host).
    pub workload: nl_abi::WorkloadParams,
    #[serde(flatten)]
    pub report: VmReport,
}

pub struct Host {
    kvm: Kvm,
    vms: Mutex<BTreeMap<u32, Arc<HostedVm>>>,
    next_id: AtomicU32,
    /// Handovers in this host's lineage (0 for a freshly started host).
    generation: AtomicU64,
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
            generation: AtomicU64::new(0),
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
        let vm = Vm::create(&self.kvm, id, config)?;
        self.adopt(vm, false)?;
        Ok(id)
    }

    /// Starts a VM built elsewhere (restored by a handover) and hosts it
    /// under its own id. A VM adopted `paused` stays paused.
    pub fn adopt(&self, vm: Vm, paused: bool) -> Result<Arc<Vm>, VmmError> {
        let id = vm.id();
        if self.vms().contains_key(&id) {
            return Err(VmmError::Vm(id, "a VM with this id exists already".into()));
        }
        self.next_id.fetch_max(id + 1, Relaxed);
        let vm = Arc::new(vm);
        if paused {
            // Raised before any vCPU thread exists: they park at once.
            vm.pause();
        }
        let outcome = Arc::new(Mutex::new(None));
        let (v, o) = (vm.clone(), outcome.clone());
        let monitor =
            std::thread::Builder::new().name(format!("vm{id}-monitor")).spawn(move || {
                let r = v.wait(Duration::from_secs(u64::from(u32::MAX)));
                *o.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
            })?;
        let h = Arc::new(HostedVm {
            vm: vm.clone(),
            outcome,
            monitor: Mutex::new(Some(monitor)),
            user_paused: paused.into(),
        });
        self.vms().insert(id, h);
        // Started last, so a VM's downtime ends as close to this return as possible.
        if let Err(e) = vm.start() {
            self.vms().remove(&id);
            vm.stop();
            return Err(e);
        }
        Ok(vm)
    }

    /// The KVM system fd.
    pub fn kvm(&self) -> &Kvm {
        &self.kvm
    }

    /// The id the next created VM gets.
    pub fn next_id(&self) -> u32 {
        self.next_id.load(Relaxed)
    }

    /// Makes sure ids below `next` are never handed out again.
    pub fn reserve_ids(&self, next: u32) {
        self.next_id.fetch_max(next, Relaxed);
    }

    pub fn generation(&self) -> u64 {
        self.generation.load(Relaxed)
    }

    pub fn set_generation(&self, g: u64) {
        self.generation.store(g, Relaxed);
    }

    /// Every hosted VM, running or finished.
    pub fn hosted(&self) -> Vec<Arc<HostedVm>> {
        self.vms().values().cloned().collect()
    }

    /// Stops a VM *without* letting it run again and forgets it: after a
    /// paused VM is released its memory and state are exactly as saved.
    pub fn release(&self, id: u32) -> Result<(), VmmError> {
        let h = self.vms().remove(&id).ok_or_else(|| VmmError::Vm(id, "no such VM".into()))?;
        h.vm.stop();
        // The monitor notices on its own; joining it here would only add
        // its polling delay to the handover's downtime.
        drop(h.monitor.lock().unwrap_or_else(|p| p.into_inner()).take());
        Ok(())
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
        let h = self.get(id)?;
        h.user_paused.store(true, Relaxed);
        h.vm.pause();
        Ok(())
    }

    pub fn resume(&self, id: u32) -> Result<(), VmmError> {
        let h = self.get(id)?;
        h.user_paused.store(false, Relaxed);
        h.vm.resume();
        Ok(())
    }

    pub fn stats(&self, id: u32) -> Result<VmStats, VmmError> {
        let h = self.get(id)?;
        let outcome = h.outcome.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let memfd_ino = std::os::unix::fs::MetadataExt::ino(&h.vm.memory().fd().metadata()?);
        Ok(VmStats {
            state: state_of(&h),
            outcome,
            memfd_ino,
            workload: h.vm.config().workload,
            report: h.vm.report(),
        })
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
