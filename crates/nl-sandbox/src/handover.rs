//! Carrying a running set to a new VMM process (a warm rejuvenation or a
//! microreboot of `ninelives host`, see [`nl_vmm::carry`]).
//!
//! The old process pauses every sandbox at once, saves each VM's vCPU and
//! device state and names its RAM memfd and each channel's memfd
//! ([`SandboxSet::suspend_for_handover`]). Nothing is copied: the new
//! process maps the same memfds ([`SandboxSet::from_handover`]), so both
//! output regions of every channel keep their generation, head and
//! acknowledgement words and neither end sees a resync. It re-creates the
//! channel windows over the inherited memfd, new doorbell eventfds wired
//! as before (ioeventfd in the sender, irqfd in the receiver), re-runs the
//! isolation audit over every slot, restores each sandbox's VM with its
//! windows, and carries each monitor's violation count and log. Starting
//! ([`SandboxSet::start_carried`]) pins the vCPUs again and re-applies the
//! budgets (a new cgroup: the throttling counters start over).
//!
//! A sandbox's TAP (its own `net`, or a service's TAP it holds) stays
//! attached across the handover: its descriptor is inherited and checked
//! to be attached to the interface the record names
//! ([`InheritedSet::taps`]); the sandbox's VM is rebuilt with a spare
//! virtio-net device and the TAP put behind it before it runs, as a
//! restart or a takeover moves a TAP. Nothing is re-opened by name (which
//! fails while the old process holds the TAP) and frames queued during the
//! pause wait in the TAP.
//!
//! A set's service registry ([`CarriedRegistry`]: per service its holder,
//! standby and takeovers so far) goes into the record, versioned, and is
//! checked against the configuration and the inherited TAPs on the way in
//! (the holder has the TAP, the standby a spare device); the standby's
//! monitor takes a later takeover in the new process as before.
//!
//! Not carried: sandboxes under `rollback` (their checkpoint supervisor
//! lives in the old process), services with a state region (its memfd and
//! slot are not in the record yet), a set while a takeover is half done
//! (refused: try again), and sets in which some sandbox has already ended;
//! a doorbell rung during the pause is not replayed (the receivers poll
//! their rings as well).

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use nl_sync::Lock;
use nl_vmm::carry::{FdRecord, InheritedSet, SetRecord};
use nl_vmm::handover::{memfd_of, mono_ns, MemorySource, VmRecord};
use nl_vmm::windows::Violation;
use nl_vmm::Vm;
use serde::{Deserialize, Serialize};

use crate::audit::{audit, Backing, Mapping};
use crate::channel::HostChannel;
use crate::config::{RecoveryPolicy, SetConfig};
use crate::monitor::Monitor;
use crate::set::{channel_windows, Images, Sandbox, SandboxSet};
use crate::{affinity, SandboxError};

/// What a set's record holds besides its VMs and memfds.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CarriedSandboxes {
    pub config: SetConfig,
    /// Per sandbox: the violations its monitor counted, and its log.
    pub violations: Vec<(u64, Vec<Violation>)>,
    /// The service registry, for a set with `services` (absent in records
    /// of sets without, and in records written before it was carried:
    /// such a record of a set with services is refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub services: Option<CarriedRegistry>,
}

/// The version of [`CarriedRegistry`] this binary writes and reads.
pub const REGISTRY_VERSION: u32 = 1;

/// A set's service registry in a handover record: per service (in the
/// configuration's order) who holds it, who stands by, the takeovers so
/// far. The holder's TAP is its VM's inherited TAP.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CarriedRegistry {
    pub version: u32,
    pub services: Vec<crate::service::ServiceReport>,
}

impl CarriedRegistry {
    /// Checks the registry against the set's configuration and the TAPs its
    /// VMs inherited (`has_tap`, by sandbox): the version; one entry per
    /// configured service, by name and in order; holder and standby the
    /// service's owner and standby (either way round, never one sandbox);
    /// the holder with a TAP and the standby without. Returns each
    /// service's (holder, standby, takeovers) by sandbox index.
    pub fn check(
        &self,
        config: &SetConfig,
        has_tap: &[bool],
    ) -> Result<Vec<(usize, usize, Vec<crate::service::Takeover>)>, String> {
        if self.version != REGISTRY_VERSION {
            return Err(format!(
                "service registry version {}; this binary reads version {REGISTRY_VERSION}",
                self.version
            ));
        }
        if self.services.len() != config.services.len() {
            return Err(format!(
                "{} services configured but {} in the registry",
                config.services.len(),
                self.services.len()
            ));
        }
        let index = |n: &str| config.sandboxes.iter().position(|s| s.name == n);
        let mut out = Vec::new();
        for (c, r) in config.services.iter().zip(&self.services) {
            if c.name != r.name {
                return Err(format!("service '{}' is '{}' in the registry", c.name, r.name));
            }
            let pair = [c.owner.as_str(), c.standby.as_str()];
            if r.holder == r.standby
                || !pair.contains(&r.holder.as_str())
                || !pair.contains(&r.standby.as_str())
            {
                return Err(format!(
                    "service '{}': holder '{}' and standby '{}' are not its owner '{}' and \
                     standby '{}'",
                    c.name, r.holder, r.standby, c.owner, c.standby
                ));
            }
            let (Some(h), Some(s)) = (index(&r.holder), index(&r.standby)) else {
                return Err(format!("service '{}' names an unknown sandbox", c.name));
            };
            if !has_tap.get(h).copied().unwrap_or(false) || has_tap.get(s).copied().unwrap_or(true)
            {
                return Err(format!(
                    "service '{}': its holder '{}' must have the service's TAP and its standby \
                     '{}' none",
                    c.name, r.holder, r.standby
                ));
            }
            out.push((h, s, r.takeovers.clone()));
        }
        Ok(out)
    }
}

impl SandboxSet {
    /// Why this set cannot be carried to a new process now, if it cannot.
    pub fn carry_blocker(&self) -> Option<String> {
        if let Some(l) = self.config.links.first() {
            return Some(format!(
                "shared link '{}' (its TAP and ports) is not passed to a new process yet",
                l.name
            ));
        }
        if let Some(svc) = self.config.services.iter().find(|v| v.state.is_some()) {
            return Some(format!(
                "service '{}' has a state region, which is not passed to a new process yet",
                svc.name
            ));
        }
        if let Some(sb) = self.sandboxes.iter().find(|sb| sb.monitor.handover_pending()) {
            return Some(format!(
                "a takeover by sandbox '{}' is in progress; try again",
                sb.config.name
            ));
        }
        for sb in &self.sandboxes {
            if sb.config.recovery.policy == RecoveryPolicy::Rollback {
                return Some(format!(
                    "sandbox '{}' runs under rollback recovery, whose checkpoint supervisor \
                     cannot move to a new process",
                    sb.config.name
                ));
            }
            if let Some(o) = sb.vm().poll_outcome() {
                return Some(format!(
                    "sandbox '{}' has ended ({}) while others run",
                    sb.config.name,
                    o.message()
                ));
            }
        }
        None
    }

    /// Pauses every sandbox (all asked at once) and describes the set for
    /// a new process: each VM's saved state and RAM memfd, each channel's
    /// memfd, `extra` (the front end's supervision) beside the
    /// configuration. On error every sandbox runs on.
    pub fn suspend_for_handover(
        &self,
        name: &str,
        extra: serde_json::Value,
    ) -> Result<SetRecord, SandboxError> {
        if let Some(why) = self.carry_blocker() {
            return Err(SandboxError::Resource(why));
        }
        let paused_at_ns = mono_ns();
        let vms: Vec<Arc<Vm>> = self.sandboxes.iter().map(|sb| sb.vm()).collect();
        for vm in &vms {
            vm.request_pause();
        }
        for vm in &vms {
            vm.pause();
        }
        let r = self.describe(name, &vms, paused_at_ns, extra);
        if r.is_err() {
            self.resume_after_handover();
        }
        r
    }

    fn describe(
        &self,
        name: &str,
        vms: &[Arc<Vm>],
        paused_at_ns: u64,
        extra: serde_json::Value,
    ) -> Result<SetRecord, SandboxError> {
        let mut violations = Vec::new();
        let mut records = Vec::new();
        for (sb, vm) in self.sandboxes.iter().zip(vms) {
            let err = |e: String| SandboxError::Vm(sb.config.name.clone(), e);
            if let Some(o) = vm.poll_outcome() {
                return Err(err(format!("ended ({}) as the handover paused it", o.message())));
            }
            let state = vm.save_state().map_err(|e| err(e.to_string()))?;
            let mut rec = VmRecord::describe_vm(vm, false);
            let (fd, ino) = memfd_of(vm.memory()).map_err(|e| err(e.to_string()))?;
            rec.memory = MemorySource::Memfd { fd, ino };
            rec.state = Some(String::from_utf8(state.to_bytes()).expect("JSON is UTF-8"));
            rec.paused_at_ns = paused_at_ns;
            // The TAP stays attached: frames queued meanwhile survive.
            rec.tap_fd = vm.tap_fd();
            records.push(rec);
            violations.push(sb.monitor.violation_state());
        }
        let mut channels = Vec::new();
        for c in &self.channels {
            use std::os::fd::AsRawFd;
            let f = c.file().ok_or_else(|| {
                SandboxError::Resource(format!("channel '{}' has no memfd", c.name))
            })?;
            channels.push(FdRecord { fd: f.as_raw_fd(), ino: c.backing.ino });
        }
        let services = if self.config.services.is_empty() {
            None
        } else {
            // Paused: no takeover can start now, but one may be half done
            // (the TAP between the two monitors): refused, try again.
            let has_tap: Vec<bool> = records.iter().map(|r| r.tap_fd.is_some()).collect();
            let names: Vec<String> = self.sandboxes.iter().map(|s| s.config.name.clone()).collect();
            let reg = CarriedRegistry {
                version: REGISTRY_VERSION,
                services: self.services.carried(&names),
            };
            if self.sandboxes.iter().any(|sb| sb.monitor.handover_pending()) {
                return Err(SandboxError::Resource(
                    "a service takeover is in progress; try again".into(),
                ));
            }
            reg.check(&self.config, &has_tap).map_err(SandboxError::Resource)?;
            Some(reg)
        };
        let carried = CarriedSandboxes { config: self.config.clone(), violations, services };
        let config = serde_json::json!({"sandboxes": carried, "frontend": extra});
        let mut r = SetRecord::new(name, config);
        r.vms = records;
        r.channels = channels;
        Ok(r)
    }

    /// The handover did not happen: every sandbox runs on here.
    pub fn resume_after_handover(&self) {
        for sb in &self.sandboxes {
            sb.vm().resume();
        }
    }

    /// Rebuilds a set in the new process from what it inherited (not
    /// started): the configuration checked again, the channels over their
    /// memfds, the audit over every slot, each sandbox's VM restored with
    /// its windows and its monitor's violations. Every mismatch between the
    /// record and what was inherited is refused by name.
    pub fn from_handover(
        set: InheritedSet,
        carried: CarriedSandboxes,
        images: &Images,
    ) -> Result<Self, SandboxError> {
        let InheritedSet { record, memories, states, taps, channels: files } = set;
        let config = carried.config;
        let bad = |m: String| Err(SandboxError::Config(format!("carried set: {m}")));
        config.validate(affinity::host_cores()?.len())?;
        let n = config.sandboxes.len();
        if record.vms.len() != n || memories.len() != n || states.len() != n || taps.len() != n {
            return bad(format!("{} sandboxes but {} VM records", n, record.vms.len()));
        }
        if carried.violations.len() != n {
            return bad(format!("{} sandboxes but {} monitors", n, carried.violations.len()));
        }
        let has_tap: Vec<bool> = taps.iter().map(Option::is_some).collect();
        let registry = match (&carried.services, config.services.is_empty()) {
            (None, true) => Vec::new(),
            (None, false) => return bad("its services have no registry in the record".into()),
            (Some(r), _) => r.check(&config, &has_tap).map_err(|e| {
                SandboxError::Config(format!("carried set: service registry refused: {e}"))
            })?,
        };
        if files.len() != config.channels.len() {
            return bad(format!(
                "{} channels but {} channel memfds",
                config.channels.len(),
                files.len()
            ));
        }
        let kvm = nl_vmm::open_kvm()
            .map_err(|e| SandboxError::Resource(format!("cannot open /dev/kvm: {e}")))?;
        let index_of = |n: &str| config.sandboxes.iter().position(|s| s.name == n);
        let mut channels = Vec::new();
        for (i, (c, f)) in config.channels.iter().zip(files).enumerate() {
            let (Some(a), Some(b)) = (index_of(&c.between[0]), index_of(&c.between[1])) else {
                return bad(format!("channel '{}' names an unknown sandbox", c.name));
            };
            channels.push(HostChannel::over_file(
                &c.name,
                i,
                [a, b],
                f,
                c.doorbell,
                c.doorbell_irqfd,
            )?);
        }
        let mut mappings = Vec::new();
        let mut plans = Vec::new();
        for ((i, s), memory) in config.sandboxes.iter().enumerate().zip(memories) {
            if record.vms[i].id != i as u32 || memory.size() != s.mem_mib << 20 {
                return bad(format!(
                    "sandbox '{}' is #{i} with {} MiB, its VM record #{} with {} bytes",
                    s.name,
                    s.mem_mib,
                    record.vms[i].id,
                    memory.size()
                ));
            }
            let backing = Backing::of(memory.fd())?;
            mappings.push(Mapping {
                sandbox: i,
                backing,
                offset: 0,
                len: memory.size(),
                writable: true,
                channel: None,
                what: "RAM".into(),
            });
            let windows = channel_windows(&config, &channels, i, &s.name, &mut mappings);
            plans.push((memory, windows, backing));
        }
        let names: Vec<String> = config.sandboxes.iter().map(|s| s.name.clone()).collect();
        audit(&mappings, &names)?;
        // The disk images again (the record re-opens them by path): still
        // regular files, still reachable from one sandbox only, and none of
        // them any sandbox's memory in this process.
        crate::disk::open_all(&config, &mappings)?;
        let vm_images =
            nl_vmm::handover::Images { kernel: images.kernel.clone(), user: images.user.clone() };
        let mut sandboxes = Vec::new();
        let mut taps = taps.into_iter();
        for (i, (memory, mut windows, ram_backing)) in plans.into_iter().enumerate() {
            let s = &config.sandboxes[i];
            let monitor = Monitor::new(&s.name, s.on_violation);
            let (count, log) = carried.violations[i].clone();
            monitor.carry_violations(count, log);
            windows.guard = Some(monitor.clone());
            let vm_cfg = record.vms[i].config(&vm_images);
            // The VM is rebuilt with a spare device (nothing opened by
            // name); the TAP its old VM had attached, inherited, goes
            // behind it before it runs.
            let spare = nl_vmm::VmConfig {
                net: vm_cfg.net.clone().map(|n| nl_vmm::NetConfig {
                    spare: true,
                    host_ip: None,
                    ..n
                }),
                ..vm_cfg.clone()
            };
            let vm = Vm::restore_with_windows(
                &kvm,
                i as u32,
                spare,
                memory,
                &states[i],
                windows.clone(),
            )
            .map_err(|e| SandboxError::Vm(s.name.clone(), format!("restore: {e}")))?;
            if let Some(tap) = taps.next().flatten() {
                if vm.attach_tap(tap).is_err() {
                    return bad(format!("sandbox '{}' has a TAP but no net device", s.name));
                }
                // Where the guest is did not change, but a switch or a
                // peer that lost its entry learns it again.
                vm.announce();
            }
            // A restart builds from the configured workload (the carried VM
            // may run a `replace` workload).
            let workload = s.workload.params().map_err(SandboxError::Config)?;
            sandboxes.push(Sandbox {
                index: i,
                config: s.clone(),
                vm: Lock::new("sandbox.vm", Arc::new(vm)),
                monitor,
                vm_config: nl_vmm::VmConfig { workload, ..vm_cfg },
                windows,
                ram_backing,
                script: Lock::new("sandbox.script", Vec::new()),
                live: Arc::new(nl_checkpoint::Live::default()),
            });
        }
        let budgets = Lock::new("sandbox.budgets", sandboxes.iter().map(|_| None).collect());
        let services = crate::service::Registry::new(&config);
        services.restore_carried(&registry);
        Ok(Self {
            config,
            sandboxes,
            channels,
            mappings,
            kvm,
            created: Instant::now(),
            stop: AtomicBool::new(false),
            budgets,
            services,
            // Refused by `carry_blocker`: a carried set has no link.
            links: Vec::new(),
        })
    }

    /// Starts the sandboxes of a carried set: pinned to their cores, their
    /// budgets applied again. On error every sandbox is stopped.
    pub fn start_carried(&self) -> Result<(), SandboxError> {
        for sb in &self.sandboxes {
            if let Err(e) = self.start_vm(sb) {
                self.stop_all();
                return Err(e);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::ServiceReport;

    fn config() -> SetConfig {
        SetConfig::parse(
            r#"{"sandboxes": [
                {"name": "web", "cores": [0], "workload": {"kind": "netbench"},
                 "net": {"tap": "nltap0", "mac": "52:54:00:5a:00:02", "ipv4": "10.0.0.2/24"}},
                {"name": "spare", "cores": [0], "workload": {"kind": "netbench"}}
            ], "services": [{"name": "echo", "owner": "web", "standby": "spare"}]}"#,
        )
        .unwrap()
    }

    fn registry(holder: &str, standby: &str) -> CarriedRegistry {
        CarriedRegistry {
            version: REGISTRY_VERSION,
            services: vec![ServiceReport {
                name: "echo".into(),
                holder: holder.into(),
                standby: standby.into(),
                takeovers: Vec::new(),
            }],
        }
    }

    #[test]
    fn a_carried_registry_is_checked_against_the_configuration_and_the_taps() {
        let c = config();
        assert_eq!(registry("web", "spare").check(&c, &[true, false]).unwrap()[0].0, 0);
        let swapped = registry("spare", "web").check(&c, &[false, true]).unwrap();
        assert_eq!((swapped[0].0, swapped[0].1), (1, 0));
        let cases = [
            (registry("web", "spare"), [false, true], "must have the service's TAP"),
            (registry("web", "web"), [true, false], "are not its owner"),
            (registry("web", "other"), [true, false], "are not its owner"),
            (
                CarriedRegistry { version: 2, ..registry("web", "spare") },
                [true, false],
                "version 2",
            ),
            (
                CarriedRegistry { services: vec![], ..registry("web", "spare") },
                [true, false],
                "1 services configured but 0",
            ),
        ];
        for (r, taps, want) in cases {
            let e = r.check(&c, &taps).unwrap_err();
            assert!(e.contains(want), "{e}");
        }
        let mut r = registry("web", "spare");
        r.services[0].name = "other".into();
        assert!(r.check(&c, &[true, false]).unwrap_err().contains("is 'other' in the registry"));
    }
}
