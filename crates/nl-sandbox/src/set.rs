//! A set of sandboxes: creation (checks, audit, VMs), start with pinning,
//! supervision by one monitor thread per sandbox, and reports.

use std::fs::OpenOptions;
use std::sync::Arc;
use std::time::Duration;

use nl_abi::WorkloadParams;
use nl_memory::GuestMemory;
use nl_vmm::windows::VmWindows;
use nl_vmm::{Vm, VmConfig, VmOutcome};
use serde::Serialize;

use crate::audit::{audit, Backing, Mapping};
use crate::channel::{ChannelStats, HostChannel};
use crate::config::{SandboxConfig, SetConfig};
use crate::monitor::{Monitor, ViolationReport};
use crate::{affinity, verify, SandboxError};

/// The guest images every sandbox boots.
#[derive(Clone)]
pub struct Images {
    pub kernel: Arc<Vec<u8>>,
    pub user: Arc<Vec<u8>>,
}

/// One sandbox: its VM, its monitor, its configuration.
pub struct Sandbox {
    pub index: usize,
    pub config: SandboxConfig,
    pub params: WorkloadParams,
    pub vm: Vm,
    pub monitor: Arc<Monitor>,
}

/// A running set of sandboxes and their channels.
pub struct SandboxSet {
    pub config: SetConfig,
    pub sandboxes: Vec<Sandbox>,
    pub channels: Vec<HostChannel>,
    /// What the audit checked.
    pub mappings: Vec<Mapping>,
    /// Each sandbox's CPU budget once applied (by sandbox index).
    budgets: std::sync::Mutex<Vec<Option<crate::budget::AppliedBudget>>>,
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
    /// Its CPU budget's throttling counters (with a budget).
    pub throttling: Option<crate::budget::Throttling>,
    pub console: String,
}

/// A set's report.
#[derive(Clone, Debug, Serialize)]
pub struct SetReport {
    pub sandboxes: Vec<SandboxReport>,
    pub channels: Vec<ChannelStats>,
}

impl SetReport {
    /// Every sandbox completed and verified.
    pub fn all_ok(&self) -> bool {
        self.sandboxes.iter().all(|s| s.outcome == VmOutcome::Completed && s.verified)
    }
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
            channels.push(HostChannel::create(&c.name, i, [a, b])?);
        }
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
            let mut windows = VmWindows { sandbox: i as u64, ..Default::default() };
            for (k, (ci, end)) in config.channels_of(&s.name).into_iter().enumerate() {
                let (w, info, m) = channels[ci].windows_for(end as usize, k as u64);
                windows.windows.extend(w);
                windows.channels.push(info);
                windows.keep.push(channels[ci].keepalive());
                mappings.extend(m);
            }
            plans.push((memory, windows));
        }
        let names: Vec<String> = config.sandboxes.iter().map(|s| s.name.clone()).collect();
        audit(&mappings, &names)?;
        let mut sandboxes = Vec::new();
        for ((i, s), (memory, mut windows)) in config.sandboxes.iter().enumerate().zip(plans) {
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
                disk: None,
                net: None,
            };
            let vm = Vm::create_with_windows(kvm, i as u32, vm_config, Some(memory), Some(windows))
                .map_err(|e| SandboxError::Vm(s.name.clone(), e.to_string()))?;
            sandboxes.push(Sandbox { index: i, config: s.clone(), params, vm, monitor });
        }
        let budgets = std::sync::Mutex::new(sandboxes.iter().map(|_| None).collect());
        Ok(Self { config, sandboxes, channels, mappings, budgets })
    }

    /// The sandbox called `name`.
    pub fn get(&self, name: &str) -> Option<&Sandbox> {
        self.sandboxes.iter().find(|s| s.config.name == name)
    }

    /// Starts one sandbox with its vCPU threads pinned to its cores.
    pub fn start(&self, sb: &Sandbox) -> Result<(), SandboxError> {
        // The vCPU threads inherit the affinity of the thread creating them.
        let before = affinity::host_cores()?;
        affinity::pin(0, &sb.config.cores)?;
        let started = sb.vm.start();
        affinity::pin(0, &before)?;
        started.map_err(|e| SandboxError::Vm(sb.config.name.clone(), e.to_string()))?;
        if sb.config.cores.len() == 1 && sb.config.budget.is_none() {
            return Ok(());
        }
        // The vCPU threads' ids, once they are up (bounded: 1 s).
        let mut tids = Vec::new();
        for _ in 0..1000 {
            let threads = sb.vm.vcpu_threads();
            if threads.iter().all(|t| t.as_ref().is_some_and(|t| t.tid > 0)) {
                tids = threads.iter().flatten().map(|t| t.tid).collect();
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if tids.is_empty() {
            sb.vm.stop();
            return Err(SandboxError::Vm(
                sb.config.name.clone(),
                "its vCPU threads did not start within 1 s".into(),
            ));
        }
        // vCPU i on cores[i % len].
        for (i, tid) in tids.iter().enumerate() {
            affinity::pin(*tid, &[sb.config.cores[i % sb.config.cores.len()]])?;
        }
        if let Some(b) = sb.config.budget {
            let applied = crate::budget::AppliedBudget::apply(&sb.config.name, b, &tids);
            let applied = applied.inspect_err(|_| sb.vm.stop())?;
            self.budgets.lock().unwrap_or_else(std::sync::PoisonError::into_inner)[sb.index] =
                Some(applied);
        }
        Ok(())
    }

    /// How often sandbox `index`'s budget held it back (`None`: no budget).
    pub fn throttling(&self, index: usize) -> Option<crate::budget::Throttling> {
        let b = self.budgets.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        b.get(index)?.as_ref().map(|b| b.throttling())
    }

    /// Starts every sandbox.
    pub fn start_all(&self) -> Result<(), SandboxError> {
        for sb in &self.sandboxes {
            self.start(sb)?;
        }
        Ok(())
    }

    /// Waits for every sandbox (one monitor thread each) until it completes,
    /// fails or `limit` passes; a failed sandbox is stopped and reported
    /// while the others run on.
    pub fn supervise(&self, limit: Duration) -> SetReport {
        let outcomes: Vec<VmOutcome> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .sandboxes
                .iter()
                .map(|sb| {
                    std::thread::Builder::new()
                        .name(format!("monitor-{}", sb.config.name))
                        .spawn_scoped(s, move || sb.vm.wait(limit))
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
                let regs: Vec<_> = sb.vm.control().vcpus.iter().map(|r| r.snapshot()).collect();
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
                    throttling: self.throttling(sb.index),
                    console: sb.vm.console().tail(),
                }
            })
            .collect();
        SetReport { sandboxes, channels: self.channel_stats() }
    }

    /// Every channel's region headers.
    pub fn channel_stats(&self) -> Vec<ChannelStats> {
        let names: Vec<String> = self.sandboxes.iter().map(|s| s.config.name.clone()).collect();
        self.channels.iter().map(|c| c.stats(&names)).collect()
    }

    /// Stops every sandbox.
    pub fn stop_all(&self) {
        for sb in &self.sandboxes {
            sb.vm.stop();
        }
    }
}
