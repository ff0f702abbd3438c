//! Several VMs in one VMM process, addressed by id.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use nl_sync::{Guard, Lock};
use std::time::Duration;

/// How often a hosted VM's supervision event runs.
const SUPERVISE_PERIOD: Duration = Duration::from_millis(20);

use kvm_ioctls::Kvm;
use serde::Serialize;

use crate::events::Events;
use crate::vm::{Supervision, Vm, VmOutcome, VmReport};
use crate::{VmConfig, VmmError};

/// A VM owned by the host, with the monitor that waits for its outcome.
pub struct HostedVm {
    pub vm: Arc<Vm>,
    pub outcome: Arc<Lock<Option<VmOutcome>>>,
    /// The recurring event that supervises the VM until it ends.
    supervisor: u64,
    /// Paused through the API (as opposed to paused by a mechanism).
    pub user_paused: std::sync::atomic::AtomicBool,
}

/// One line of `list`.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
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
    vms: Arc<Lock<BTreeMap<u32, Arc<HostedVm>>>>,
    next_id: AtomicU32,
    /// Handovers in this host's lineage (0 for a freshly started host).
    generation: AtomicU64,
    /// Recurring events (VM supervision).
    events: Arc<Events>,
    /// VMs that had ended before a microreboot: their last `stats`, as the
    /// previous process reported them.
    finished: Arc<Lock<BTreeMap<u32, serde_json::Value>>>,
}

fn state_of(h: &HostedVm) -> String {
    match &*h.outcome.lock() {
        Some(VmOutcome::Completed) => "completed".into(),
        Some(VmOutcome::Stopped) => "stopped".into(),
        Some(o) => format!("failed: {}", o.message()),
        None if h.vm.is_paused() => "paused".into(),
        None => "running".into(),
    }
}

impl Host {
    pub fn new() -> Result<Arc<Self>, VmmError> {
        let h = Arc::new(Self {
            kvm: crate::open_kvm()?,
            vms: Lock::new("host.vms", BTreeMap::new()),
            next_id: AtomicU32::new(0),
            generation: AtomicU64::new(0),
            events: Events::start()?,
            finished: Lock::new("host.finished", BTreeMap::new()),
        });
        crate::recovery::register_host(&h);
        Ok(h)
    }

    fn vms(&self) -> Guard<'_, BTreeMap<u32, Arc<HostedVm>>> {
        self.vms.lock()
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
        let outcome = Lock::new("vm.outcome", None);
        let (v, o) = (vm.clone(), outcome.clone());
        let sup = Lock::new(
            "vm.supervision",
            Supervision::new(&vm, Duration::from_secs(u64::from(u32::MAX))),
        );
        // Supervision is a recurring event: it records how the VM ends.
        let supervisor = self.events.add(
            format!("vm{id}-supervise"),
            SUPERVISE_PERIOD,
            Arc::new(move || {
                if o.lock().is_some() {
                    return false;
                }
                let r = v.supervise(&mut sup.lock());
                match r {
                    Some(r) => {
                        if r != VmOutcome::Completed {
                            v.stop();
                        }
                        *o.lock() = Some(r);
                        false
                    }
                    None => true,
                }
            }),
        );
        let h =
            Arc::new(HostedVm { vm: vm.clone(), outcome, supervisor, user_paused: paused.into() });
        self.vms().insert(id, h);
        // Started last, so a VM's downtime ends as close to this return as possible.
        if let Err(e) = vm.start() {
            self.vms().remove(&id);
            vm.stop();
            return Err(e);
        }
        Ok(vm)
    }

    /// The host's recurring events.
    pub fn events(&self) -> &Events {
        &self.events
    }

    /// Records a VM that had ended before a microreboot (its last `stats`).
    pub fn adopt_finished(&self, id: u32, stats: serde_json::Value) {
        self.next_id.fetch_max(id + 1, Relaxed);
        self.finished.lock().insert(id, stats);
    }

    /// VMs that ended before a handover or microreboot, with their last `stats`.
    pub fn finished(&self) -> Vec<(u32, serde_json::Value)> {
        self.finished.lock().iter().map(|(k, v)| (*k, v.clone())).collect()
    }

    /// The last `stats` (with a `summary`) of every VM that has ended, here
    /// or before a handover: what a new VMM process must keep answering for.
    pub fn ended_stats(&self) -> Result<Vec<serde_json::Value>, VmmError> {
        let mut out: Vec<serde_json::Value> = self.finished().into_iter().map(|(_, v)| v).collect();
        let list = self.list();
        for h in self.hosted() {
            if h.outcome.lock().is_none() {
                continue;
            }
            let id = h.vm.id();
            let mut stats = self.stats_value(id)?;
            stats["summary"] = serde_json::json!(list.iter().find(|s| s.id == id));
            out.push(stats);
        }
        Ok(out)
    }

    /// `stats` of a VM as JSON, including VMs that ended before a microreboot.
    pub fn stats_value(&self, id: u32) -> Result<serde_json::Value, VmmError> {
        if let Some(v) = self.finished.lock().get(&id) {
            return Ok(v.clone());
        }
        serde_json::to_value(self.stats(id)?).map_err(|e| VmmError::State(e.to_string()))
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
        self.events.remove(h.supervisor);
        Ok(())
    }

    pub fn list(&self) -> Vec<VmSummary> {
        let finished: Vec<VmSummary> = self
            .finished
            .lock()
            .values()
            .filter_map(|v| serde_json::from_value(v["summary"].clone()).ok())
            .collect();
        let mut live: Vec<VmSummary> = self
            .vms()
            .values()
            .map(|h| VmSummary {
                id: h.vm.id(),
                state: state_of(h),
                workload: h.vm.config().workload.kind,
                vcpus: h.vm.config().vcpus,
                mem_bytes: h.vm.config().mem_bytes,
            })
            .collect();
        live.extend(finished);
        live.sort_by_key(|v| v.id);
        live
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
        let outcome = h.outcome.lock().clone();
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
        self.events.remove(h.supervisor);
        let mut o = h.outcome.lock();
        if o.is_none() {
            *o = Some(h.vm.poll_outcome().unwrap_or(VmOutcome::Stopped));
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
