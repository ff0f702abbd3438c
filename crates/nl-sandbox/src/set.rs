//! A set of sandboxes: creation (checks, audit, VMs), start with pinning,
//! supervision by one monitor thread per sandbox (detection and recovery,
//! see [`crate::recovery`]), and reports.

use std::fs::OpenOptions;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nl_abi::WorkloadParams;
use nl_checkpoint::inject::GuestFault;
use nl_memory::GuestMemory;
use nl_sync::Lock;
use nl_vmm::windows::VmWindows;
use nl_vmm::{Vm, VmConfig, VmOutcome};
use serde::Serialize;

use crate::audit::{audit, Backing, Mapping};
use crate::channel::{ChannelStats, HostChannel};
use crate::config::{RecoveryPolicy, SandboxConfig, SetConfig};
use crate::detect::Detection;
use crate::monitor::{Monitor, ViolationReport};
use crate::recovery::{Phases, RecoveryRecord};
use crate::{affinity, verify, SandboxError};

/// The guest images every sandbox boots.
#[derive(Clone)]
pub struct Images {
    pub kernel: Arc<Vec<u8>>,
    pub user: Arc<Vec<u8>>,
}

/// One sandbox: its VM (replaced by a new one when it restarts), its
/// monitor, its configuration.
pub struct Sandbox {
    pub index: usize,
    pub config: SandboxConfig,
    pub(crate) vm: Arc<Lock<Arc<Vm>>>,
    pub monitor: Arc<Monitor>,
    /// What every VM of this sandbox is built from.
    pub(crate) vm_config: VmConfig,
    pub(crate) windows: VmWindows,
    /// The backing of its RAM the audit checked (a `memory_file` must
    /// still be that file when the sandbox restarts).
    pub(crate) ram_backing: Backing,
    /// `rollback`: faults its checkpoint supervisor injects (tests, bench).
    pub(crate) script: Arc<Lock<Vec<(Duration, GuestFault)>>>,
    /// `rollback`: faults injected through its supervisor while it runs,
    /// and its rollbacks so far.
    pub(crate) live: Arc<nl_checkpoint::Live>,
    /// `rollback`: where its monitor waits while a handover has its
    /// supervisor's run ended ([`crate::handover`]).
    pub(crate) gate: Arc<crate::handover::RollbackGate>,
}

impl Sandbox {
    /// The sandbox's current VM.
    pub fn vm(&self) -> Arc<Vm> {
        self.vm.lock().clone()
    }

    /// The workload its current VM runs.
    pub fn params(&self) -> WorkloadParams {
        self.vm().config().workload
    }

    /// `rollback` sandboxes: faults to inject at these times after its
    /// supervision starts (before [`SandboxSet::supervise`]).
    pub fn set_script(&self, script: Vec<(Duration, GuestFault)>) {
        *self.script.lock() = script;
    }

    pub(crate) fn take_script(&self) -> Vec<(Duration, GuestFault)> {
        std::mem::take(&mut *self.script.lock())
    }

    /// `rollback` sandboxes: rollbacks done so far by the running
    /// supervisor (its recovery records come when the supervised run ends).
    pub fn rollbacks(&self) -> u64 {
        self.live.rollbacks()
    }

    /// `rollback` sandboxes: whether the guest re-ran what its last
    /// rollback undid (a fault detected now is a new one, not a recurrence
    /// that doubles the look-back; [`nl_checkpoint::Live::settled`]).
    pub fn rollback_settled(&self) -> bool {
        self.live.settled()
    }

    /// `rollback` sandboxes with `recovery.output_commit`: what output
    /// commit did in the last supervised run that ended.
    pub fn output_commit(&self) -> Option<nl_checkpoint::output_commit::OutputCommitStats> {
        self.live.output_commit()
    }
}

/// A running set of sandboxes and their channels.
pub struct SandboxSet {
    pub config: SetConfig,
    pub sandboxes: Vec<Sandbox>,
    pub channels: Vec<HostChannel>,
    /// What the audit checked.
    pub mappings: Vec<Mapping>,
    pub(crate) kvm: kvm_ioctls::Kvm,
    pub(crate) created: Instant,
    pub(crate) stop: AtomicBool,
    /// Each sandbox's CPU budget once applied (by sandbox index).
    pub(crate) budgets: Arc<Lock<Vec<Option<crate::budget::AppliedBudget>>>>,
    /// The service registry (remote recovery).
    pub services: crate::service::Registry,
    /// The set's shared links and their threads.
    pub links: Vec<crate::shared_link::SharedLink>,
}

/// How one sandbox's run ended, and what its monitor saw.
#[derive(Clone, Debug, Serialize)]
pub struct SandboxReport {
    pub name: String,
    pub outcome: VmOutcome,
    pub message: String,
    /// The workload's result checked (digest against the host's replay or
    /// expectation; wildwrite: every read-only write reported).
    pub verified: bool,
    pub problem: Option<String>,
    pub cores: Vec<usize>,
    pub ops: u64,
    pub cycles: u64,
    pub digest: u64,
    pub violations: u64,
    pub violation_log: Vec<ViolationReport>,
    /// The sandbox was stopped because of an isolation violation.
    pub stopped_for_violation: bool,
    /// What its detectors found, and what its recoveries did.
    pub detections: Vec<Detection>,
    pub recoveries: Vec<RecoveryRecord>,
    /// Why the monitor stopped recovering it (a fault recurring beyond
    /// its bound, a failed rollback supervision).
    pub gave_up: Option<String>,
    /// Its CPU budget's throttling counters (with a budget).
    pub throttling: Option<crate::budget::Throttling>,
    /// Its virtio-net device's counters (with a `net` section or as a
    /// service's standby).
    pub net: Option<nl_devices::virtio::net::NetStats>,
    /// Times its virtio-net device interrupted it (its RX interrupts with
    /// `net.rx_irq`).
    pub net_interrupts: Option<u64>,
    /// Its virtio-blk device's counters (with a `disk`), of its current VM
    /// (a restart starts them over).
    pub disk: Option<nl_devices::virtio::blk::BlkStats>,
    /// A `periodic` sandbox's CPU per period against its reservation.
    pub periods: Option<crate::periodic::PeriodReport>,
    /// A `rollback` sandbox's held network output (`recovery.output_commit`).
    pub output_commit: Option<nl_checkpoint::output_commit::OutputCommitStats>,
    pub console: String,
}

/// A set's report.
#[derive(Clone, Debug, Serialize)]
pub struct SetReport {
    pub sandboxes: Vec<SandboxReport>,
    pub channels: Vec<ChannelStats>,
    /// Each service's holder, standby and takeovers.
    pub services: Vec<crate::service::ServiceReport>,
    /// Each shared link's counters.
    pub links: Vec<crate::shared_link::LinkReport>,
}

impl SetReport {
    /// Every sandbox completed and verified.
    pub fn all_ok(&self) -> bool {
        self.sandboxes.iter().all(|s| s.outcome == VmOutcome::Completed && s.verified)
    }
}

/// A new memfd of `bytes` for sandbox `name`'s RAM.
pub(crate) fn anonymous_ram(name: &str, bytes: u64) -> Result<GuestMemory, SandboxError> {
    GuestMemory::new(&format!("sandbox-{name}"), bytes)
        .map_err(|e| SandboxError::Resource(format!("sandbox '{name}': {e}")))
}

fn open_memory_file(s: &SandboxConfig) -> Result<Option<std::fs::File>, SandboxError> {
    let Some(path) = &s.memory_file else { return Ok(None) };
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map(Some)
        .map_err(|e| {
            SandboxError::Config(format!(
                "sandbox '{}': cannot open memory_file {}: {e}",
                s.name,
                path.display()
            ))
        })
}

impl SandboxSet {
    /// Checks the configuration, creates the channels, audits every memory
    /// slot of every sandbox, then creates the VMs (not started).
    pub fn create(
        kvm: &kvm_ioctls::Kvm,
        config: SetConfig,
        images: &Images,
    ) -> Result<Self, SandboxError> {
        let host = affinity::host_cores()?;
        config.validate(host.len())?;
        // An owned handle: restarts create VMs long after `kvm` is gone.
        let own_kvm = nl_vmm::open_kvm()
            .map_err(|e| SandboxError::Resource(format!("cannot open /dev/kvm: {e}")))?;
        let index_of = |n: &str| config.sandboxes.iter().position(|s| s.name == n);
        let mut channels = Vec::new();
        for (i, c) in config.channels.iter().enumerate() {
            let ends = [index_of(&c.between[0]), index_of(&c.between[1])];
            let [Some(a), Some(b)] = ends else {
                return Err(SandboxError::Config(format!(
                    "channel '{}' names an unknown sandbox",
                    c.name
                )));
            };
            let ch = HostChannel::create(&c.name, i, [a, b], c.doorbell, c.doorbell_irqfd)?;
            for (region, end) in [a, b].into_iter().enumerate() {
                ch.check_as_stream(region, config.sandboxes[end].streams_chanstream());
            }
            channels.push(ch);
        }
        // Each service's state region (a memfd, mapped by its holder only).
        let states = config
            .services
            .iter()
            .map(|v| match v.state {
                Some(st) => crate::state::check_size(st.mib)
                    .map_err(SandboxError::Config)
                    .and_then(|b| crate::state::StateRegion::create(&v.name, b))
                    .map(|r| Some(Arc::new(r))),
                None => Ok(None),
            })
            .collect::<Result<Vec<_>, _>>()?;
        // Memory and windows of every sandbox, audited before any VM exists.
        let mut mappings = Vec::new();
        let mut plans = Vec::new();
        for (i, s) in config.sandboxes.iter().enumerate() {
            let mem_bytes = s.mem_mib << 20;
            // RAM: a fresh memfd, or the named file (zeroed only once the
            // audit has passed, so a refused set leaves the file alone).
            let file = open_memory_file(s)?;
            let (memory, backing, what) = match file {
                Some(f) => {
                    let path =
                        s.memory_file.as_ref().map_or(String::new(), |p| p.display().to_string());
                    let b = Backing::of(&f)?;
                    (Err(f), b, format!("RAM in {path}"))
                }
                None => {
                    let m = GuestMemory::new(&format!("sandbox-{}", s.name), mem_bytes).map_err(
                        |e| SandboxError::Resource(format!("sandbox '{}': {e}", s.name)),
                    )?;
                    let b = Backing::of(m.fd())?;
                    (Ok(m), b, "RAM".to_string())
                }
            };
            mappings.push(Mapping {
                sandbox: i,
                backing,
                offset: 0,
                len: mem_bytes,
                writable: true,
                channel: None,
                what,
            });
            let mut windows = channel_windows(&config, &channels, i, &s.name, &mut mappings);
            // A service's state region: in the owner's and the standby's
            // page tables and boot info; a slot in the owner's VM only.
            for (v, st) in config.services.iter().zip(&states) {
                let Some(st) = st else { continue };
                if v.owner == s.name || v.standby == s.name {
                    windows.state = Some(st.window());
                    windows.keep.push(st.keepalive());
                }
                if v.owner == s.name {
                    mappings.push(st.mapping(i));
                }
            }
            plans.push((memory, windows, backing));
        }
        let names: Vec<String> = config.sandboxes.iter().map(|s| s.name.clone()).collect();
        audit(&mappings, &names)?;
        // Disks after the memory exists: an image that is any sandbox's
        // memory (RAM, memory_file, channel, state region) is refused too.
        let disks = crate::disk::open_all(&config, &mappings)?;
        let links = config
            .links
            .iter()
            .map(|l| crate::shared_link::SharedLink::open(&config, l))
            .collect::<Result<Vec<_>, _>>()?;
        let mut sandboxes = Vec::new();
        for (((i, s), (memory, mut windows, ram_backing)), disk) in
            config.sandboxes.iter().enumerate().zip(plans).zip(disks)
        {
            let params = s.workload.params().map_err(SandboxError::Config)?;
            let mem_bytes = s.mem_mib << 20;
            let memory = match memory {
                Ok(m) => m,
                Err(f) => {
                    // Zeroed: the guest starts from empty RAM.
                    let zero = f.set_len(0).and_then(|_| f.set_len(mem_bytes));
                    zero.map_err(|e| {
                        SandboxError::Resource(format!("sandbox '{}': memory_file: {e}", s.name))
                    })?;
                    GuestMemory::from_fd(Arc::new(f), mem_bytes)
                        .map_err(|e| SandboxError::Resource(format!("sandbox '{}': {e}", s.name)))?
                }
            };
            let monitor = Monitor::new(&s.name, s.on_violation);
            windows.guard = Some(monitor.clone());
            let vm_config = VmConfig {
                mem_bytes,
                vcpus: s.vcpus(),
                workload: params,
                kernel: images.kernel.clone(),
                user: images.user.clone(),
                console_path: None,
                timer_hz: 100,
                heartbeat_timeout: Duration::from_secs(20),
                disk,
                net: crate::net::first_vm_net(&config, &s.name)?.map(|n| nl_vmm::NetConfig {
                    port: links.iter().find_map(|l| l.port(&s.name)),
                    ..n
                }),
            };
            let vm = Vm::create_with_windows(
                kvm,
                i as u32,
                vm_config.clone(),
                Some(memory),
                Some(windows.clone()),
            )
            .map_err(|e| SandboxError::Vm(s.name.clone(), e.to_string()))?;
            for (v, st) in config.services.iter().zip(&states) {
                if let Some(st) = st.as_ref().filter(|_| v.owner == s.name) {
                    st.map_into(i, &vm)?;
                }
            }
            sandboxes.push(Sandbox {
                index: i,
                config: s.clone(),
                vm: Lock::new("sandbox.vm", Arc::new(vm)),
                monitor,
                vm_config,
                windows,
                ram_backing,
                script: Lock::new("sandbox.script", Vec::new()),
                live: Arc::new(nl_checkpoint::Live::default()),
                gate: Arc::new(crate::handover::RollbackGate::default()),
            });
        }
        let budgets = Lock::new("sandbox.budgets", sandboxes.iter().map(|_| None).collect());
        let services = crate::service::Registry::with_states(&config, states);
        Ok(Self {
            services,
            config,
            sandboxes,
            channels,
            mappings,
            kvm: own_kvm,
            created: Instant::now(),
            stop: AtomicBool::new(false),
            budgets,
            links,
        })
    }

    /// Milliseconds since the set was created.
    pub fn elapsed_ms(&self) -> f64 {
        self.created.elapsed().as_secs_f64() * 1e3
    }

    /// Ends supervision: every sandbox is stopped and its monitor returns
    /// (for service workloads that run until stopped).
    pub fn request_stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        for sb in &self.sandboxes {
            sb.vm().stop();
        }
    }

    pub fn stop_requested(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// Injects `fault` into sandbox `name`'s running VM (paused around it).
    /// A `rollback` sandbox's supervisor injects it at its next step
    /// (it owns the VM's pauses): `Ok(None)` then, and the fault waits
    /// until that supervisor runs.
    pub fn inject(&self, name: &str, fault: &GuestFault) -> Result<Option<u64>, SandboxError> {
        let sb =
            self.get(name).ok_or_else(|| SandboxError::Config(format!("no sandbox '{name}'")))?;
        if sb.config.recovery.policy == RecoveryPolicy::Rollback {
            // Its supervisor pauses and resumes the VM for checkpoints: it
            // injects the fault itself, at its next step (within ms).
            sb.live.inject(fault.clone());
            return Ok(None);
        }
        // A fault that needs the vCPU in ring 3 (`Exit`) waits for it there,
        // a bounded while (1 s).
        let mut tries = 0;
        loop {
            match nl_checkpoint::inject::apply(&sb.vm(), fault) {
                Err(nl_checkpoint::CheckpointError::NotNow(_)) if tries < 1000 => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                r => {
                    return r.map_err(|e| {
                        SandboxError::Vm(name.into(), format!("fault injection: {e}"))
                    })
                }
            }
        }
    }

    /// Sandbox `i`'s channels it receives on: (channel index, the peer's
    /// region).
    pub fn receives_of(&self, i: usize) -> Vec<(usize, usize)> {
        self.channels
            .iter()
            .enumerate()
            .filter_map(|(ci, c)| c.ends.iter().position(|&e| e == i).map(|end| (ci, 1 - end)))
            .collect()
    }

    /// Sandbox `i`'s own output regions: (channel index, region).
    pub fn own_regions_of(&self, i: usize) -> Vec<(usize, usize)> {
        self.receives_of(i).into_iter().map(|(c, peer)| (c, 1 - peer)).collect()
    }

    /// Whether a restarted sandbox serves again: a message published in one
    /// of its (withdrawn, so new) own regions, or for a sandbox without
    /// channels a heartbeat (`beats` of its vCPU 0).
    pub(crate) fn replied(&self, sb: &Sandbox, beats: u64) -> bool {
        let own = self.own_regions_of(sb.index);
        if own.is_empty() {
            return beats > 0;
        }
        own.iter().any(|&(c, r)| {
            let h = self.channels[c].header(r);
            h.generation != 0 && h.head_words > 0
        })
    }

    /// Fresh RAM for sandbox `sb`: a new memfd, or its `memory_file`
    /// reopened (it must still be the audited file) and zeroed.
    fn fresh_memory(&self, sb: &Sandbox) -> Result<GuestMemory, SandboxError> {
        let s = &sb.config;
        let bytes = s.mem_mib << 20;
        let err = |e: String| SandboxError::Resource(format!("sandbox '{}': {e}", s.name));
        match open_memory_file(s)? {
            None => anonymous_ram(&s.name, bytes),
            Some(f) => {
                if Backing::of(&f)? != sb.ram_backing {
                    return Err(SandboxError::Isolation(format!(
                        "sandbox '{}': memory_file is no longer the file the audit checked",
                        s.name
                    )));
                }
                f.set_len(0)
                    .and_then(|_| f.set_len(bytes))
                    .map_err(|e| err(format!("memory_file: {e}")))?;
                GuestMemory::from_fd(Arc::new(f), bytes).map_err(|e| err(e.to_string()))
            }
        }
    }

    /// What a restart VM of `sb` by `policy` is built from: the workload of
    /// `recovery.replace_with` for `replace`, and a spare net device (the
    /// TAP the old VM still has, none after a takeover, moves to it, never
    /// re-opened by name). Owned, so a builder thread can keep it
    /// ([`crate::prepare`]).
    pub(crate) fn restart_recipe(
        sb: &Sandbox,
        policy: RecoveryPolicy,
    ) -> Result<crate::prepare::Recipe, SandboxError> {
        let mut config = sb.vm_config.clone();
        if policy == RecoveryPolicy::Replace {
            if let Some(w) = &sb.config.recovery.replace_with {
                config.workload = w.params().map_err(SandboxError::Config)?;
            }
        }
        config.net = config.net.map(|n| nl_vmm::NetConfig { spare: true, host_ip: None, ..n });
        Ok(crate::prepare::Recipe {
            index: sb.index as u32,
            name: sb.config.name.clone(),
            config,
            windows: sb.windows.clone(),
            mem_bytes: sb.config.mem_mib << 20,
        })
    }

    /// A new VM for a restart of `sb` by `policy`, built now over fresh
    /// memory with the images loaded. Not started.
    pub(crate) fn next_vm(&self, sb: &Sandbox, policy: RecoveryPolicy) -> Result<Vm, SandboxError> {
        Self::restart_recipe(sb, policy)?.create(&self.kvm, self.fresh_memory(sb)?)
    }

    /// `restart` / `replace` after the sandbox's vCPUs were stopped: its
    /// own channel regions withdrawn, a new VM over fresh memory (the
    /// images reloaded; the workload of `recovery.replace_with` for
    /// `replace`), the same windows and monitor, started pinned. On error
    /// nothing runs: the old VM stays the (stopped) current one.
    pub(crate) fn rebuild(
        &self,
        sb: &Sandbox,
        policy: RecoveryPolicy,
        t0: Instant,
        phases: &mut Phases,
    ) -> Result<(), SandboxError> {
        let ms = || Some(t0.elapsed().as_secs_f64() * 1e3);
        for (c, r) in self.own_regions_of(sb.index) {
            self.channels[c].withdraw(r);
        }
        phases.notified_ms = ms();
        // Built ahead when it could be (crate::prepare), else now.
        let vm = match sb.monitor.take_next_vm() {
            Some(vm) => {
                phases.image_prepared = true;
                vm
            }
            None => self.next_vm(sb, policy)?,
        };
        phases.image_ms = ms();
        // A state region this sandbox holds moves to its new VM. The old VM
        // is stopped for good: its slot goes with it (removing it would wait
        // for the kernel: StateRegion::release_stopped).
        let state = self.services.state_mapped_in(sb.index);
        if let Some(st) = &state {
            st.release_stopped(sb.index);
            if let Err(e) = st.map_into(sb.index, &vm) {
                let _ = st.reclaim_stopped(sb.index);
                return Err(e);
            }
        }
        if let Some(tap) = sb.vm().take_tap() {
            vm.attach_tap(tap).map_err(|_| {
                SandboxError::Vm(
                    sb.config.name.clone(),
                    "restart: its new VM has no net device".into(),
                )
            })?;
        }
        let old = std::mem::replace(&mut *sb.vm.lock(), Arc::new(vm));
        crate::trace(format_args!("{}: rebuild: starting new VM", sb.config.name));
        if let Err(e) = self.start_vm(sb) {
            sb.vm().stop();
            if let Some(tap) = sb.vm().take_tap() {
                let _ = old.attach_tap(tap);
            }
            if let Some(st) = &state {
                st.unmap_from(sb.index, &sb.vm());
                // The old VM kept its slot (release_stopped).
                let _ = st.reclaim_stopped(sb.index);
            }
            *sb.vm.lock() = old;
            return Err(e);
        }
        phases.reentry_ms = ms();
        // The old VM (stopped) is released after the new one runs, on a
        // thread of its own: tearing a KVM VM down waits for the kernel's
        // grace periods, seconds on a busy host of this kernel (see
        // crate::prepare), and the monitor must watch the new VM meanwhile.
        release_in_background(&sb.config.name, old);
        Ok(())
    }

    /// The sandbox called `name`.
    pub fn get(&self, name: &str) -> Option<&Sandbox> {
        self.sandboxes.iter().find(|s| s.config.name == name)
    }

    /// Starts one sandbox with its vCPU threads pinned to its cores. A
    /// `rollback` sandbox starts under its checkpoint supervisor when
    /// [`SandboxSet::supervise`] begins.
    pub fn start(&self, sb: &Sandbox) -> Result<(), SandboxError> {
        if sb.config.recovery.policy == RecoveryPolicy::Rollback {
            return Ok(());
        }
        self.start_vm(sb)
    }

    pub(crate) fn start_vm(&self, sb: &Sandbox) -> Result<(), SandboxError> {
        let vm = sb.vm();
        // The vCPU threads inherit the affinity of the thread creating them.
        let before = affinity::host_cores()?;
        affinity::pin(0, &sb.config.cores)?;
        let started = vm.start();
        affinity::pin(0, &before)?;
        started.map_err(|e| SandboxError::Vm(sb.config.name.clone(), e.to_string()))?;
        if sb.config.cores.len() == 1 && sb.config.budget.is_none() {
            return Ok(());
        }
        // The vCPU threads' ids, once they are up (bounded: 1 s).
        let mut tids = Vec::new();
        for _ in 0..1000 {
            let threads = vm.vcpu_threads();
            if threads.iter().all(|t| t.as_ref().is_some_and(|t| t.tid > 0)) {
                tids = threads.iter().flatten().map(|t| t.tid).collect();
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if tids.is_empty() {
            vm.stop();
            return Err(SandboxError::Vm(
                sb.config.name.clone(),
                "its vCPU threads did not start within 1 s".into(),
            ));
        }
        // The I/O threads (the net receive thread) on the sandbox's cores
        // (they were started there; pinned again by id as the vCPUs are),
        // once they report their ids (bounded: 1 s).
        let mut io_tids = vm.io_threads();
        for _ in 0..1000 {
            if io_tids.iter().all(|&t| t > 0) {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
            io_tids = vm.io_threads();
        }
        if io_tids.iter().any(|&t| t <= 0) {
            vm.stop();
            return Err(SandboxError::Vm(
                sb.config.name.clone(),
                "its I/O threads did not start within 1 s".into(),
            ));
        }
        self.place_threads(sb, &vm, &tids, &io_tids)
    }

    /// Under `rollback` (its supervisor starts the VM): pins its vCPU and
    /// I/O threads and applies its budget, once those threads are up.
    /// `Ok(false)`: not yet (call again); `Ok(true)`: done.
    pub(crate) fn place_threads_when_up(
        &self,
        sb: &Sandbox,
        vm: &nl_vmm::Vm,
    ) -> Result<bool, SandboxError> {
        let threads = vm.vcpu_threads();
        let io_tids = vm.io_threads();
        if !threads.iter().all(|t| t.as_ref().is_some_and(|t| t.tid > 0))
            || io_tids.iter().any(|&t| t <= 0)
        {
            return Ok(false);
        }
        let tids: Vec<i32> = threads.iter().flatten().map(|t| t.tid).collect();
        self.place_threads(sb, vm, &tids, &io_tids).map(|()| true)
    }

    /// vCPU i on `cores[i % len]`, the I/O threads on the sandbox's cores,
    /// and its budget on all of them; the VM is stopped if the budget
    /// cannot be applied.
    fn place_threads(
        &self,
        sb: &Sandbox,
        vm: &nl_vmm::Vm,
        tids: &[i32],
        io_tids: &[i32],
    ) -> Result<(), SandboxError> {
        for (i, tid) in tids.iter().enumerate() {
            affinity::pin(*tid, &[sb.config.cores[i % sb.config.cores.len()]])?;
        }
        for tid in io_tids {
            affinity::pin(*tid, &sb.config.cores)?;
        }
        if let Some(b) = sb.config.budget {
            let mut budgets = self.budgets.lock();
            // A restarted sandbox's new threads join the cgroups it has.
            let r = match &budgets[sb.index] {
                Some(applied) => applied.attach(tids, io_tids),
                None => crate::budget::AppliedBudget::apply(&sb.config.name, b, tids, io_tids)
                    .map(|a| budgets[sb.index] = Some(a)),
            };
            r.inspect_err(|_| vm.stop())?;
        }
        Ok(())
    }

    /// How often sandbox `index`'s budget held it back (`None`: no budget).
    pub fn throttling(&self, index: usize) -> Option<crate::budget::Throttling> {
        let b = self.budgets.lock();
        b.get(index)?.as_ref().map(|b| b.throttling())
    }

    /// Starts every sandbox. First, while none of the set's vCPUs runs,
    /// it builds each restart or replace sandbox's first restart VM
    /// (`prepare::prebuild`: quick now, slow once vCPUs keep the CPUs busy).
    pub fn start_all(&self) -> Result<(), SandboxError> {
        for sb in &self.sandboxes {
            crate::prepare::prebuild(sb);
        }
        for sb in &self.sandboxes {
            self.start(sb)?;
        }
        Ok(())
    }

    /// Supervises every sandbox (one monitor thread each: detection and
    /// its recovery policy) until it completes, is stopped for good, the set
    /// is asked to stop ([`SandboxSet::request_stop`]) or `limit` passes; a
    /// failed sandbox is recovered or stopped and reported while the others
    /// run on.
    pub fn supervise(&self, limit: Duration) -> SetReport {
        let outcomes: Vec<VmOutcome> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .sandboxes
                .iter()
                .map(|sb| {
                    std::thread::Builder::new()
                        .name(format!("monitor-{}", sb.config.name))
                        .spawn_scoped(s, move || {
                            // Its restart VMs are built ahead, beside it.
                            let prep = crate::prepare::start(sb);
                            let outcome = crate::recovery::run(self, sb, limit);
                            if let Some(p) = prep {
                                p.finish();
                            }
                            outcome
                        })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| match h {
                    Ok(h) => h.join().unwrap_or(VmOutcome::Crashed {
                        cpu: 0,
                        message: "monitor thread panicked".into(),
                    }),
                    Err(e) => VmOutcome::Crashed {
                        cpu: 0,
                        message: format!("cannot start a monitor thread: {e}"),
                    },
                })
                .collect()
        });
        self.report(&outcomes)
    }

    /// The report for the sandboxes' outcomes (in sandbox order).
    pub fn report(&self, outcomes: &[VmOutcome]) -> SetReport {
        let sandboxes = self
            .sandboxes
            .iter()
            .zip(outcomes)
            .map(|(sb, o)| {
                let vm = sb.vm();
                let regs: Vec<_> = vm.control().vcpus.iter().map(|r| r.snapshot()).collect();
                let (verified, problem) = match o {
                    VmOutcome::Completed => verify::check(self, sb, &regs),
                    o => (false, Some(o.message())),
                };
                let stopped_for_violation = matches!(o, VmOutcome::GuestError { code, .. } if *code == nl_abi::ERR_CHANNEL_VIOLATION);
                SandboxReport {
                    name: sb.config.name.clone(),
                    outcome: o.clone(),
                    message: o.message(),
                    verified,
                    problem,
                    cores: sb.config.cores.clone(),
                    ops: regs.iter().map(|r| r.ops).sum(),
                    cycles: regs.first().map_or(0, |r| r.cycles),
                    digest: regs.first().map_or(0, |r| r.digest),
                    violations: sb.monitor.violations(),
                    violation_log: sb.monitor.violation_log(),
                    stopped_for_violation,
                    detections: sb.monitor.detections(),
                    recoveries: sb.monitor.recoveries(),
                    gave_up: sb.monitor.gave_up_reason(),
                    throttling: self.throttling(sb.index),
                    net: vm.net_stats().map(|n| n.0),
                    net_interrupts: vm.virtio_interrupts().1,
                    disk: vm.blk_stats().map(|b| b.0),
                    periods: (sb.params().kind == nl_abi::WORKLOAD_PERIODIC)
                        .then(|| crate::periodic::PeriodReport::parse(&vm.console().tail()))
                        .flatten(),
                    output_commit: sb.live.output_commit(),
                    console: vm.console().tail(),
                }
            })
            .collect();
        let names: Vec<String> = self.sandboxes.iter().map(|s| s.config.name.clone()).collect();
        SetReport {
            sandboxes,
            channels: self.channel_stats(),
            services: self.services.report(&names),
            links: self.links.iter().map(|l| l.report()).collect(),
        }
    }

    /// Every channel's region headers.
    pub fn channel_stats(&self) -> Vec<ChannelStats> {
        let names: Vec<String> = self.sandboxes.iter().map(|s| s.config.name.clone()).collect();
        self.channels.iter().map(|c| c.stats(&names)).collect()
    }

    /// Stops every sandbox.
    pub fn stop_all(&self) {
        for sb in &self.sandboxes {
            sb.vm().stop();
        }
    }
}

/// The channel windows of sandbox `i` (named `name`): each channel end it
/// has, its doorbells, and the channels kept alive while it runs; the
/// mappings they add go to `mappings` for the isolation audit.
pub(crate) fn channel_windows(
    config: &SetConfig,
    channels: &[HostChannel],
    i: usize,
    name: &str,
    mappings: &mut Vec<Mapping>,
) -> VmWindows {
    let mut windows = VmWindows { sandbox: i as u64, ..Default::default() };
    for (k, (ci, end)) in config.channels_of(name).into_iter().enumerate() {
        let e = channels[ci].windows_for(end as usize, k as u64);
        windows.windows.extend(e.windows);
        windows.channels.push(e.info);
        windows.doorbells.extend(e.doorbells);
        windows.keep.push(channels[ci].keepalive());
        mappings.extend(e.mappings);
    }
    windows
}

/// Drops `vm` on a detached thread (inline if no thread can be started:
/// the refused closure, and `vm` with it, is dropped here).
fn release_in_background(name: &str, vm: Arc<Vm>) {
    let _ = std::thread::Builder::new().name(format!("release-{name}")).spawn(move || {
        crate::trace(format_args!("release old VM: begin"));
        drop(vm);
        crate::trace(format_args!("release old VM: end"));
    });
}
