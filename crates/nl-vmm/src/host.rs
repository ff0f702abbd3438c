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
    /// The supervisor's view: how long the guest has shown no progress.
    supervision: Arc<Lock<Supervision>>,
}

impl HostedVm {
    /// Time since the guest last showed progress (a heartbeat, a phase
    /// change; a paused VM counts as alive), as its supervisor last saw it.
    pub fn heartbeat_age(&self) -> Duration {
        self.supervision.lock().silent_for()
    }
}

/// One line of `list`.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct VmSummary {
    pub id: u32,
    pub state: String,
    /// The workload's name (`memwrite`, `compute`, ...).
    #[serde(deserialize_with = "workload_name_or_kind")]
    pub workload: String,
    pub vcpus: u32,
    pub mem_bytes: u64,
}

/// A summary's workload: its name, or the number older processes handed
/// over.
fn workload_name_or_kind<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    use serde::Deserialize;
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum NameOrKind {
        Name(String),
        Kind(u64),
    }
    Ok(match NameOrKind::deserialize(d)? {
        NameOrKind::Name(n) => n,
        NameOrKind::Kind(k) => nl_abi::workload_name(k).into(),
    })
}

/// `stats` of one VM.
#[derive(Clone, Debug, Serialize)]
pub struct VmStats {
    pub state: String,
    pub outcome: Option<VmOutcome>,
    /// Inode of the guest-memory memfd: the same before and after a warm
    /// handover (the memory was not copied).
    pub memfd_ino: u64,
    /// The workload's parameters (to replay and verify it on the host),
    /// with its kind and access pattern by name ([`named_workload`]).
    #[serde(serialize_with = "named_workload")]
    pub workload: nl_abi::WorkloadParams,
    /// The virtio-net device's counters (frames, drops, announcements), if
    /// the VM has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub net: Option<nl_devices::virtio::net::NetStats>,
    #[serde(flatten)]
    pub report: VmReport,
}

/// A workload's parameters as the API shows them: `kind` and `pattern`
/// by name (`"memwrite"`, `"random"`: `nl_abi::workload_name`,
/// `nl_abi::pattern_name`), every other field as it is.
fn named_workload<S: serde::Serializer>(
    w: &nl_abi::WorkloadParams,
    s: S,
) -> Result<S::Ok, S::Error> {
    #[derive(Serialize)]
    struct Named {
        kind: &'static str,
        seed: u64,
        ws_bytes: u64,
        write_pct: u64,
        pattern: &'static str,
        stride: u64,
        hot_pct: u64,
        duration_ms: u64,
        data_bytes: u64,
    }
    Named {
        kind: nl_abi::workload_name(w.kind),
        seed: w.seed,
        ws_bytes: w.ws_bytes,
        write_pct: w.write_pct,
        pattern: nl_abi::pattern_name(w.pattern),
        stride: w.stride,
        hot_pct: w.hot_pct,
        duration_ms: w.duration_ms,
        data_bytes: w.data_bytes,
    }
    .serialize(s)
}

/// What a host admits: its guest-memory and vCPU budgets and the limits
/// of its API (see the [`crate::api`] module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Limits {
    /// Guest memory (bytes) the hosted VMs may commit together.
    pub mem_budget: u64,
    /// vCPUs the hosted VMs may have together.
    pub vcpu_budget: u32,
    /// API connections served at once; more are refused.
    pub max_connections: usize,
    /// Time from a request's first byte to its newline.
    pub request_timeout: Duration,
    /// An API connection with no request for this long is closed.
    pub idle_timeout: Duration,
    /// Also serve the deprecated JSON-lines protocol (`host --api-legacy`).
    /// Absent from the records of older processes: off.
    #[serde(default)]
    pub json_lines: bool,
}

/// Guest memory kept out of the default budget: this much, or a tenth of
/// the available memory if that is more.
pub const MEM_MARGIN: u64 = 1 << 30;
/// Default vCPU budget: this many per online host CPU (at least one
/// largest VM, [`nl_abi::MAX_VCPUS`]).
pub const VCPUS_PER_CPU: u32 = 16;
/// Default cap on concurrent API connections.
pub const MAX_CONNECTIONS: usize = 64;
/// Default time limit of one API request, from its first byte.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Default idle time after which an API connection is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(600);

impl Limits {
    /// The defaults on this machine: the memory available now (MemAvailable
    /// of /proc/meminfo, or MemTotal) minus [`MEM_MARGIN`] (or a tenth),
    /// [`VCPUS_PER_CPU`] vCPUs per online CPU, and the API defaults.
    pub fn from_system() -> Self {
        let avail = available_memory().unwrap_or(0);
        let online = std::thread::available_parallelism().map_or(1, |n| n.get());
        let online = u32::try_from(online).unwrap_or(u32::MAX);
        Self {
            mem_budget: avail.saturating_sub(MEM_MARGIN.max(avail / 10)),
            vcpu_budget: online.saturating_mul(VCPUS_PER_CPU).max(nl_abi::MAX_VCPUS),
            max_connections: MAX_CONNECTIONS,
            request_timeout: REQUEST_TIMEOUT,
            idle_timeout: IDLE_TIMEOUT,
            json_lines: false,
        }
    }
}

/// MemAvailable (or MemTotal) of /proc/meminfo, in bytes.
pub fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| {
        info.lines().find_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix(':')?;
            let kib: u64 = rest.trim().strip_suffix("kB")?.trim().parse().ok()?;
            kib.checked_mul(1024)
        })
    };
    field("MemAvailable").or_else(|| field("MemTotal"))
}

/// Guest memory and vCPUs of a VM being created, admitted but not yet in
/// the host's table; released when dropped.
struct Reservation<'a> {
    host: &'a Host,
    token: u64,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        self.host.pending.lock().remove(&self.token);
    }
}

pub struct Host {
    kvm: Kvm,
    /// Budgets and API limits.
    limits: Arc<Lock<Limits>>,
    /// Admitted creations not yet in `vms`: (guest memory, vCPUs) by token.
    /// Admission checks and inserts under this lock, so two creations
    /// cannot both pass against the same headroom.
    pending: Arc<Lock<BTreeMap<u64, (u64, u32)>>>,
    next_token: AtomicU64,
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
        Some(VmOutcome::TimedOut { limit_ms }) if h.vm.linux_record().is_some() => {
            crate::linux::time_limit_state(*limit_ms)
        }
        Some(o) => format!("failed: {}", o.message()),
        None if h.vm.is_paused() => "paused".into(),
        None => "running".into(),
    }
}

impl Host {
    pub fn new() -> Result<Arc<Self>, VmmError> {
        let h = Arc::new(Self {
            kvm: crate::open_kvm()?,
            limits: Lock::new("host.limits", Limits::from_system()),
            pending: Lock::new("host.pending", BTreeMap::new()),
            next_token: AtomicU64::new(0),
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
        self.vms().get(&id).cloned().ok_or(VmmError::NoSuchVm(id))
    }

    /// The host's budgets and API limits.
    pub fn limits(&self) -> Limits {
        *self.limits.lock()
    }

    /// The limits for a handover record (a successor process keeps them);
    /// None if the lock is not free soon (a recovery after an error on
    /// another thread must not wait on it): the successor uses its defaults.
    pub fn limits_for_handover(&self) -> Option<Limits> {
        self.limits.try_lock_for(Duration::from_millis(100)).map(|l| *l)
    }

    /// Sets the host's budgets and API limits (VMs already hosted stay,
    /// even over a smaller budget; new ones are admitted against it).
    pub fn set_limits(&self, l: Limits) {
        *self.limits.lock() = l;
    }

    /// Guest memory and vCPUs committed now: every hosted VM until it is
    /// destroyed, and every creation admitted but not yet hosted.
    pub fn committed(&self) -> (u64, u32) {
        let pending = self.pending.lock();
        self.committed_with(&pending)
    }

    fn committed_with(&self, pending: &BTreeMap<u64, (u64, u32)>) -> (u64, u32) {
        let (mut mem, mut vcpus) = pending
            .values()
            .fold((0u64, 0u32), |(m, v), (pm, pv)| (m.saturating_add(*pm), v.saturating_add(*pv)));
        for h in self.vms().values() {
            mem = mem.saturating_add(h.vm.config().mem_bytes);
            vcpus = vcpus.saturating_add(h.vm.config().vcpus);
        }
        (mem, vcpus)
    }

    /// Admits a VM of this configuration against the budgets, or says why not.
    fn admit(&self, config: &VmConfig) -> Result<Reservation<'_>, VmmError> {
        let (mem, vcpus) = (config.mem_bytes, config.vcpus);
        if vcpus == 0 || vcpus > nl_abi::MAX_VCPUS {
            return Err(VmmError::Config(format!(
                "vcpus {vcpus} is out of range: a VM has 1 to {} vCPUs",
                nl_abi::MAX_VCPUS
            )));
        }
        let limits = self.limits();
        // Checked and recorded under one lock: concurrent creations see
        // each other's reservations.
        let mut pending = self.pending.lock();
        let (used_mem, used_vcpus) = self.committed_with(&pending);
        let mib = |b: u64| b >> 20;
        if used_mem.saturating_add(mem) > limits.mem_budget {
            return Err(VmmError::Refused(format!(
                "not enough guest memory: the VM needs {} MiB, {} MiB of this host's budget \
                 of {} MiB are committed (host --mem-budget); destroy a VM or ask for less",
                mib(mem),
                mib(used_mem),
                mib(limits.mem_budget)
            )));
        }
        if used_vcpus.saturating_add(vcpus) > limits.vcpu_budget {
            return Err(VmmError::Refused(format!(
                "not enough vCPUs: the VM needs {vcpus}, {used_vcpus} of this host's budget \
                 of {} vCPUs are committed (host --vcpu-budget); destroy a VM or ask for fewer",
                limits.vcpu_budget
            )));
        }
        let token = self.next_token.fetch_add(1, Relaxed);
        pending.insert(token, (mem, vcpus));
        Ok(Reservation { host: self, token })
    }

    /// Creates and starts a VM; a monitor thread records how it ends.
    /// Refused if it does not fit the host's budgets ([`Limits`]).
    pub fn create(&self, config: VmConfig) -> Result<u32, VmmError> {
        // Released once the VM is in the table (or its creation failed).
        let _reserved = self.admit(&config)?;
        let id = self.next_id.fetch_add(1, Relaxed);
        let vm = Vm::create(&self.kvm, id, config)?;
        self.adopt(vm, false)?;
        Ok(id)
    }

    /// Creates and starts a VM that boots the Linux kernel in
    /// `config.kernel` with `boot` ([`Vm::create_linux`]), admitted as
    /// [`Host::create`] admits a VM. It is supervised without a heartbeat
    /// (`crate::linux::supervise`): it ends when the guest resets or stops.
    /// A kernel image or command line the boot path refuses is a
    /// configuration error (the API answers 400).
    pub fn create_linux(
        &self,
        config: VmConfig,
        boot: &crate::linux::LinuxBoot,
    ) -> Result<u32, VmmError> {
        let _reserved = self.admit(&config)?;
        let id = self.next_id.fetch_add(1, Relaxed);
        let vm = Vm::create_linux(&self.kvm, id, config, boot).map_err(|e| match e {
            VmmError::Arch(a) => VmmError::Config(format!("Linux kernel: {a}")),
            e => e,
        })?;
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
        let supervision = Lock::new(
            "vm.supervision",
            Supervision::new(&vm, Duration::from_secs(u64::from(u32::MAX))),
        );
        let sup = supervision.clone();
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
                        crate::event_log::publish(
                            "vm_ended",
                            serde_json::json!({"vm": v.id(), "outcome": &r, "message": r.message()}),
                        );
                        *o.lock() = Some(r);
                        false
                    }
                    None => true,
                }
            }),
        );
        let h = Arc::new(HostedVm {
            vm: vm.clone(),
            outcome,
            supervisor,
            user_paused: paused.into(),
            supervision,
        });
        self.vms().insert(id, h);
        // Started last, so a VM's downtime ends as close to this return as possible.
        if let Err(e) = vm.start() {
            self.vms().remove(&id);
            vm.stop();
            return Err(e);
        }
        crate::event_log::publish(
            "vm_created",
            serde_json::json!({"vm": id, "vcpus": vm.config().vcpus,
                               "mem_bytes": vm.config().mem_bytes, "paused": paused}),
        );
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
        let h = self.vms().remove(&id).ok_or(VmmError::NoSuchVm(id))?;
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
                workload: if h.vm.linux_record().is_some() {
                    "linux".into()
                } else {
                    nl_abi::workload_name(h.vm.config().workload.kind).into()
                },
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
        crate::event_log::publish("vm_paused", serde_json::json!({"vm": id}));
        Ok(())
    }

    pub fn resume(&self, id: u32) -> Result<(), VmmError> {
        let h = self.get(id)?;
        h.user_paused.store(false, Relaxed);
        h.vm.resume();
        crate::event_log::publish("vm_resumed", serde_json::json!({"vm": id}));
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
            net: h.vm.net_stats().map(|(s, _, _)| s),
            report: h.vm.report(),
        })
    }

    /// The VM itself, for mechanisms that act on a hosted VM.
    pub fn vm(&self, id: u32) -> Result<Arc<Vm>, VmmError> {
        Ok(self.get(id)?.vm.clone())
    }

    /// Stops a VM and forgets it.
    pub fn destroy(&self, id: u32) -> Result<(), VmmError> {
        let h = self.vms().remove(&id).ok_or(VmmError::NoSuchVm(id))?;
        h.vm.resume();
        h.vm.stop();
        self.events.remove(h.supervisor);
        let mut o = h.outcome.lock();
        if o.is_none() {
            *o = Some(h.vm.poll_outcome().unwrap_or(VmOutcome::Stopped));
        }
        drop(o);
        crate::event_log::publish("vm_destroyed", serde_json::json!({"vm": id}));
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
