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
//! A shared link goes with its set (a set record of version 2): the
//! link's TAP descriptor and every one of its packet sockets cross exec
//! as they are, still bound to the TAP and filtered, so a frame the host
//! sends to a member during the pause waits in that member's socket and
//! nothing is re-opened (re-creating the sockets in the new process would
//! lose what the old ones held, and open a moment in which a frame reaches
//! neither). The new process checks the TAP's interface, that every socket
//! is a raw packet socket bound to it, and that each carries exactly the
//! filter of its role ([`crate::shared_link::SharedLink::adopt`]: a
//! member's socket swapped with another's is refused), attaches the TAP's
//! drop-all filter again, and puts each member's port behind its rebuilt
//! VM's spare device before it runs. The link's counters so far are in
//! the record ([`CarriedLinks`]); the old process, whose set stays
//! suspended, never takes the TAP's filter off.
//!
//! A service's state region goes the same way: its memfd (checked by inode,
//! to be a memfd, and of the configured size), and which sandbox has its
//! slot ([`CarriedStates`]: it must be the service's holder in the carried
//! registry). The new process maps the same memfd and gives the slot to
//! that sandbox's rebuilt VM before it runs; the standby still has none,
//! and a later takeover moves it as before.
//!
//! A sandbox under `rollback` goes too, but not its checkpoint ring: the
//! ring is in the old process's heap and its write tracking on the old
//! process's mapping of the guest's memory. The handover makes the state
//! at the pause the committed state instead:
//!
//! 1. Before any sandbox pauses, each rollback sandbox's supervisor is
//!    asked to end its run ([`nl_checkpoint::Live::request_handover`]). At
//!    its next step with no error detected it pauses the VM, sends every
//!    frame it holds to the TAP, writes every disk write it holds to the
//!    image, drops its ring (the write protection lifted) and returns; its
//!    monitor then waits at the sandbox's [`RollbackGate`]. The handover
//!    waits for that (bounded: [`QUIESCE_BOUND`]; a supervisor that does
//!    not answer fails the handover and everything runs on here).
//!    Releasing everything is safe because nothing will ever roll the
//!    guest back behind that pause: the next supervisor of this guest
//!    starts a fresh ring whose first checkpoint is taken with the vCPUs
//!    still parked, before they run again ([`nl_checkpoint::Supervisor::start`]).
//!    So nothing acknowledged to a client is lost (the reply left, and the
//!    state that sent it is the committed one), and nothing left that a
//!    rollback could undo.
//! 2. The other sandboxes pause as before; every VM's state is saved.
//! 3. In the new process the carried VM is not started with the others:
//!    its monitor starts a new supervisor over it, which starts it paused,
//!    takes checkpoint 0 (the carried state), holds output again and only
//!    then lets it run. A fault after the handover is rolled back in the
//!    new process; the rollbacks counted so far are carried
//!    ([`CarriedSandboxes::rollbacks`]) and the new process's detections
//!    and recoveries go to its monitor as for other policies.
//! 4. A handover that fails (the old process resumes its sets,
//!    [`SandboxSet::resume_after_handover`]) does not resume a rollback
//!    sandbox's VM itself: its gate tells the waiting monitor, which starts
//!    a new supervisor over the paused VM (a fresh ring, first checkpoint
//!    before it runs), as the new process would have.
//!
//! A microreboot takes the same path: the old process's microreboot
//! thread pauses and saves the sets before its exec, while the monitors
//! and supervisors still run, so each rollback supervisor releases its
//! output and disk writes as above, and the carried state is committed.
//! Had a supervisor not answered (its thread stuck in the fault), its
//! set is left behind with a report rather than carried: its memory might
//! be half rolled back, and the disk writes it held, which the guest
//! believes written, would be lost with the process. (Dropping only its
//! held frames would be safe, since the guest's TCP retransmits what no
//! client acknowledged, but the disk writes make carrying that state
//! wrong.) The cost: the handover commits whatever the guest did up to the
//! pause, so an error already in the guest then but found only after it
//! cannot be rolled back past the new run's first checkpoint (it recurs
//! and the sandbox gives up after `recovery.max_recoveries`), as for any
//! state whose output has left. A sandbox that rolled back and has not yet
//! re-run what the rollback undid (its error may still come back) blocks a
//! handover until it has ([`SandboxSet::carry_blocker`]).
//!
//! Not carried: a set while a takeover is half done (refused: try again),
//! a set with a rollback sandbox whose last rollback has not settled
//! (refused: try again), and sets in which some sandbox has already ended;
//! a doorbell rung during the pause is not replayed (the receivers poll
//! their rings as well).

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nl_sync::{Condvar, Lock};
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
    /// The shared links' counters, for a set with `links` (their
    /// descriptors are in the set record's `links`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub links: Option<CarriedLinks>,
    /// Who has each state region's slot, for a set whose services have
    /// state regions (their memfds are in the set record's
    /// `state_regions`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub states: Option<CarriedStates>,
    /// Per sandbox: the rollbacks its supervisors did so far (`rollback`
    /// sandboxes; absent in records written before they were carried).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rollbacks: Vec<u64>,
}

/// How long a handover waits for a `rollback` sandbox's supervisor to end
/// its run (it does at its next step, within milliseconds; a checkpoint or
/// a rollback in progress finishes first). Under a microreboot's recovery
/// limit (`nl_vmm::recovery::RECOVERY_LIMIT`, 2 s); a warm rejuvenation
/// that runs out of it fails, its sets run on, and may be tried again.
pub const QUIESCE_BOUND: Duration = Duration::from_secs(1);

/// Where a `rollback` sandbox's monitor waits once its supervisor ended its
/// run for a handover, until the handover is over (see the module doc).
pub struct RollbackGate {
    state: Arc<Lock<GateState>>,
    cond: Condvar,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GateState {
    /// Supervised (or about to be).
    Running,
    /// The supervisor's run ended for a handover: the VM paused, its
    /// output released, no ring.
    Quiesced,
    /// The handover failed: supervise the VM again here.
    Resume,
}

impl Default for RollbackGate {
    fn default() -> Self {
        Self { state: Lock::new("sandbox.rollback_gate", GateState::Running), cond: Condvar::new() }
    }
}

impl RollbackGate {
    /// A handover begins: forget how an earlier one ended.
    fn request(&self) {
        *self.state.lock() = GateState::Running;
    }

    /// Waits (at most `bound`) until the supervisor's run has ended for
    /// the handover.
    fn wait_quiesced(&self, bound: Duration) -> bool {
        let t = Instant::now();
        let mut g = self.state.lock();
        while *g != GateState::Quiesced {
            if t.elapsed() >= bound {
                return false;
            }
            g.wait_for(&self.cond, Duration::from_millis(20));
        }
        true
    }

    /// The handover failed: the waiting monitor supervises the VM again.
    fn resume(&self) {
        *self.state.lock() = GateState::Resume;
        self.cond.notify_all();
    }

    /// The monitor's side: its supervisor's run ended for a handover.
    /// Waits until the handover failed (`true`: supervise again) or
    /// `stop` says to end (`false`; the handover succeeded and this
    /// process ends, or the set is stopped or out of time).
    pub(crate) fn quiesced(&self, stop: impl Fn() -> bool) -> bool {
        let mut g = self.state.lock();
        if *g != GateState::Resume {
            *g = GateState::Quiesced;
            self.cond.notify_all();
        }
        loop {
            if *g == GateState::Resume {
                *g = GateState::Running;
                return true;
            }
            if stop() {
                return false;
            }
            g.wait_for(&self.cond, Duration::from_millis(50));
        }
    }
}

/// The version of [`CarriedLinks`] and [`CarriedStates`] this binary
/// writes and reads.
pub const SHARED_VERSION: u32 = 1;

/// A set's shared links in a handover record: per link (in configuration
/// order) its counters so far.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CarriedLinks {
    pub version: u32,
    pub links: Vec<crate::shared_link::LinkReport>,
}

/// One service's state region in a handover record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CarriedState {
    pub service: String,
    pub bytes: u64,
    /// The sandbox whose VM has the region's slot (the service's holder).
    pub mapped_in: String,
}

/// A set's state regions in a handover record, in the order of the
/// services that have one.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CarriedStates {
    pub version: u32,
    pub regions: Vec<CarriedState>,
}

impl CarriedStates {
    /// Checks the regions against the configuration and the carried
    /// registry (`holders`: each service's holder by sandbox index, in
    /// service order): the version; one entry per service with a state
    /// region, by name and in order, with its configured size; its slot in
    /// the service's holder. Returns each region's (service index, bytes,
    /// sandbox with the slot).
    pub fn check(
        &self,
        config: &SetConfig,
        holders: &[usize],
    ) -> Result<Vec<(usize, u64, usize)>, String> {
        if self.version != SHARED_VERSION {
            return Err(format!(
                "state regions version {}; this binary reads version {SHARED_VERSION}",
                self.version
            ));
        }
        let with: Vec<(usize, &crate::config::ServiceConfig)> =
            config.services.iter().enumerate().filter(|(_, v)| v.state.is_some()).collect();
        if with.len() != self.regions.len() {
            return Err(format!(
                "{} state regions configured but {} in the record",
                with.len(),
                self.regions.len()
            ));
        }
        let mut out = Vec::new();
        for ((k, v), r) in with.into_iter().zip(&self.regions) {
            let bytes = v.state.map_or(0, |st| st.mib << 20);
            if r.service != v.name || r.bytes != bytes {
                return Err(format!(
                    "state region of service '{}' ({} bytes) is '{}' ({} bytes) in the record",
                    v.name, bytes, r.service, r.bytes
                ));
            }
            let at = config.sandboxes.iter().position(|s| s.name == r.mapped_in);
            let holder = holders.get(k).copied();
            if at.is_none() || at != holder {
                return Err(format!(
                    "state region of service '{}' is mapped in '{}', not in its holder",
                    v.name, r.mapped_in
                ));
            }
            out.push((k, bytes, holder.unwrap_or_default()));
        }
        Ok(out)
    }
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
        if let Some(sb) = self.sandboxes.iter().find(|sb| sb.monitor.handover_pending()) {
            return Some(format!(
                "a takeover by sandbox '{}' is in progress; try again",
                sb.config.name
            ));
        }
        for sb in &self.sandboxes {
            // The handover commits the state at its pause (module doc): not
            // while the error a rollback undid may still come back.
            if sb.config.recovery.policy == RecoveryPolicy::Rollback && !sb.rollback_settled() {
                return Some(format!(
                    "sandbox '{}' rolled back and has not yet re-run what that rollback undid \
                     (its error may come back, and a handover would commit its state); try \
                     again",
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
        // A rollback sandbox's supervisor pauses its VM itself, its output
        // released and its ring dropped (it owns the VM's pauses: the
        // handover must not pause it under a checkpoint).
        let rollback = |sb: &Sandbox| sb.config.recovery.policy == RecoveryPolicy::Rollback;
        for sb in self.sandboxes.iter().filter(|sb| rollback(sb)) {
            sb.gate.request();
            sb.live.request_handover();
        }
        for (sb, vm) in self.sandboxes.iter().zip(&vms) {
            if !rollback(sb) {
                vm.request_pause();
            }
        }
        for (sb, vm) in self.sandboxes.iter().zip(&vms) {
            if !rollback(sb) {
                vm.pause();
            }
        }
        for sb in self.sandboxes.iter().filter(|sb| rollback(sb)) {
            if !sb.gate.wait_quiesced(QUIESCE_BOUND) {
                self.resume_after_handover();
                return Err(SandboxError::Resource(format!(
                    "sandbox '{}': its checkpoint supervisor did not stop for the handover \
                     within {} ms; try again",
                    sb.config.name,
                    QUIESCE_BOUND.as_millis()
                )));
            }
        }
        // From now on the set may live on in a new process over the same
        // TAPs: its links here never take a TAP's drop-all filter off.
        for l in &self.links {
            l.set_armed(false);
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
            // The TAP stays attached: frames queued meanwhile survive. A
            // link member's device is over its port (a socket of the link,
            // carried with the link's).
            let on_link = sb.config.net.as_ref().is_some_and(|n| n.link.is_some());
            rec.tap_fd = if on_link { None } else { vm.tap_fd() };
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
        let (link_records, link_counts): (Vec<_>, Vec<_>) =
            self.links.iter().map(|l| l.carried()).unzip();
        let links = (!self.links.is_empty())
            .then_some(CarriedLinks { version: SHARED_VERSION, links: link_counts });
        let (state_records, states) = self.carried_states()?;
        let rollbacks = self.sandboxes.iter().map(Sandbox::rollbacks).collect();
        let carried = CarriedSandboxes {
            config: self.config.clone(),
            violations,
            services,
            links,
            states,
            rollbacks,
        };
        let config = serde_json::json!({"sandboxes": carried, "frontend": extra});
        let mut r = SetRecord::new(name, config);
        r.vms = records;
        r.channels = channels;
        r.carry_shared(link_records, state_records);
        Ok(r)
    }

    /// The state regions' memfds and who has each one's slot (its holder:
    /// anything else is a takeover or restart in progress, refused).
    fn carried_states(&self) -> Result<(Vec<FdRecord>, Option<CarriedStates>), SandboxError> {
        use std::os::fd::AsRawFd;
        let names: Vec<String> = self.sandboxes.iter().map(|s| s.config.name.clone()).collect();
        let holders = self.services.report(&names);
        let mut fds = Vec::new();
        let mut regions = Vec::new();
        for (svc, h) in self.services.services.iter().zip(&holders) {
            let Some(st) = &svc.state else { continue };
            let mapped = st.mapped_in().and_then(|i| names.get(i));
            if mapped != Some(&h.holder) {
                return Err(SandboxError::Resource(format!(
                    "service '{}': its state region is not mapped in its holder '{}' now (a \
                     takeover or restart in progress); try again",
                    svc.name, h.holder
                )));
            }
            let f = st.file().ok_or_else(|| {
                SandboxError::Resource(format!(
                    "service '{}': its state region has no memfd",
                    svc.name
                ))
            })?;
            let ino = Backing::of(f)?.ino;
            fds.push(FdRecord { fd: f.as_raw_fd(), ino });
            regions.push(CarriedState {
                service: svc.name.clone(),
                bytes: st.bytes,
                mapped_in: h.holder.clone(),
            });
        }
        let states =
            (!regions.is_empty()).then_some(CarriedStates { version: SHARED_VERSION, regions });
        Ok((fds, states))
    }

    /// The handover did not happen: every sandbox runs on here (and its
    /// links own their TAPs' filters again). A rollback sandbox is not
    /// resumed here: its monitor starts a new supervisor over the paused
    /// VM, which takes a first checkpoint before it runs (module doc).
    pub fn resume_after_handover(&self) {
        for l in &self.links {
            l.set_armed(true);
        }
        for sb in &self.sandboxes {
            if sb.config.recovery.policy == RecoveryPolicy::Rollback {
                sb.live.cancel_handover();
                sb.gate.resume();
            } else {
                sb.vm().resume();
            }
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
        let InheritedSet {
            record,
            memories,
            states,
            taps,
            channels: files,
            links: inherited_links,
            state_regions,
        } = set;
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
        if !carried.rollbacks.is_empty() && carried.rollbacks.len() != n {
            return bad(format!("{} sandboxes but {} rollback counts", n, carried.rollbacks.len()));
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
        // Shared links: their descriptors and counters.
        if inherited_links.len() != config.links.len() {
            return bad(format!(
                "{} shared links configured but {} in the record",
                config.links.len(),
                inherited_links.len()
            ));
        }
        let link_counts = match (&carried.links, config.links.is_empty()) {
            (None, true) => Vec::new(),
            (None, false) => return bad("its shared links have no counters in the record".into()),
            (Some(c), _) if c.version != SHARED_VERSION => {
                return bad(format!(
                    "links version {}; this binary reads version {SHARED_VERSION}",
                    c.version
                ))
            }
            (Some(c), _) if c.links.len() != config.links.len() => {
                return bad(format!(
                    "{} shared links configured but {} counted in the record",
                    config.links.len(),
                    c.links.len()
                ))
            }
            (Some(c), _) => c.links.clone(),
        };
        // State regions: which service, its size, who has its slot.
        let holders: Vec<usize> = registry.iter().map(|r| r.0).collect();
        let with_state = config.services.iter().any(|v| v.state.is_some());
        let plan = match (&carried.states, with_state) {
            (None, false) => Vec::new(),
            (None, true) => return bad("its state regions are not in the record".into()),
            (Some(c), _) => c.check(&config, &holders).map_err(|e| {
                SandboxError::Config(format!("carried set: state regions refused: {e}"))
            })?,
        };
        if state_regions.len() != plan.len() {
            return bad(format!(
                "{} state regions but {} state-region memfds",
                plan.len(),
                state_regions.len()
            ));
        }
        let mut regions: Vec<Option<Arc<crate::state::StateRegion>>> =
            vec![None; config.services.len()];
        let mut slots = Vec::new();
        for (&(k, bytes, holder), f) in plan.iter().zip(state_regions) {
            let st = crate::state::StateRegion::over_file(&config.services[k].name, f, bytes)?;
            regions[k] = Some(Arc::new(st));
            slots.push((k, holder));
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
            let mut windows = channel_windows(&config, &channels, i, &s.name, &mut mappings);
            // A state region: in the owner's and the standby's windows (as
            // at creation), a slot (an audited mapping) in its holder's.
            for (v, st) in config.services.iter().zip(&regions) {
                let Some(st) = st else { continue };
                if v.owner == s.name || v.standby == s.name {
                    windows.state = Some(st.window());
                    windows.keep.push(st.keepalive());
                }
            }
            for &(k, holder) in &slots {
                if let (true, Some(st)) = (holder == i, &regions[k]) {
                    mappings.push(st.mapping(i));
                }
            }
            plans.push((memory, windows, backing));
        }
        let names: Vec<String> = config.sandboxes.iter().map(|s| s.name.clone()).collect();
        audit(&mappings, &names)?;
        // The disk images again (the record re-opens them by path): still
        // regular files, still reachable from one sandbox only, and none of
        // them any sandbox's memory in this process.
        crate::disk::open_all(&config, &mappings)?;
        // The links over their inherited TAPs and sockets, each socket's
        // filter checked, before any member's VM exists.
        let mut links = Vec::new();
        for ((l, inherited), counts) in config.links.iter().zip(inherited_links).zip(&link_counts) {
            links.push(crate::shared_link::SharedLink::adopt(&config, l, inherited, counts)?);
        }
        let vm_images =
            nl_vmm::handover::Images { kernel: images.kernel.clone(), user: images.user.clone() };
        let mut sandboxes = Vec::new();
        let mut taps = taps.into_iter();
        for (i, (memory, mut windows, ram_backing)) in plans.into_iter().enumerate() {
            let s = &config.sandboxes[i];
            let monitor = Monitor::new(&s.name, s.on_violation);
            let (count, log) = carried.violations[i].clone();
            monitor.carry_violations(count, log);
            let live = Arc::new(nl_checkpoint::Live::default());
            live.carry_rollbacks(carried.rollbacks.get(i).copied().unwrap_or(0));
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
            // A link member's device goes over its port on the link.
            let port = links.iter().find_map(|l| l.port(&s.name));
            let tap = match (taps.next().flatten(), &port, &vm_cfg.net) {
                (Some(_), Some(_), _) => {
                    return bad(format!(
                        "sandbox '{}' is on a link but has a TAP of its own",
                        s.name
                    ))
                }
                (Some(tap), None, _) => Some(tap),
                (None, Some(p), Some(n)) => {
                    Some(nl_devices::tap::Tap::over_port(p, &n.tap).map_err(|e| {
                        SandboxError::Resource(format!(
                            "sandbox '{}': cannot use its port on link TAP {}: {e}",
                            s.name, n.tap
                        ))
                    })?)
                }
                (None, Some(_), None) => {
                    return bad(format!("sandbox '{}' is on a link but its VM has no net", s.name))
                }
                (None, None, _) => None,
            };
            if let Some(tap) = tap {
                if vm.attach_tap(tap).is_err() {
                    return bad(format!("sandbox '{}' has a TAP but no net device", s.name));
                }
                // Where the guest is did not change, but a switch or a
                // peer that lost its entry learns it again.
                vm.announce();
            }
            // The state region it holds: its slot before it runs.
            for &(k, holder) in &slots {
                if let (true, Some(st)) = (holder == i, &regions[k]) {
                    st.map_into(i, &vm)?;
                }
            }
            // A restart builds from the configured workload (the carried VM
            // may run a `replace` workload), on the same port.
            let workload = s.workload.params().map_err(SandboxError::Config)?;
            let net = vm_cfg.net.clone().map(|n| nl_vmm::NetConfig { port: port.clone(), ..n });
            sandboxes.push(Sandbox {
                index: i,
                config: s.clone(),
                vm: Lock::new("sandbox.vm", Arc::new(vm)),
                monitor,
                vm_config: nl_vmm::VmConfig { workload, net, ..vm_cfg },
                windows,
                ram_backing,
                script: Lock::new("sandbox.script", Vec::new()),
                live,
                gate: Arc::new(RollbackGate::default()),
            });
        }
        let budgets = Lock::new("sandbox.budgets", sandboxes.iter().map(|_| None).collect());
        let services = crate::service::Registry::with_states(&config, regions);
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
            links,
        })
    }

    /// Starts the sandboxes of a carried set: pinned to their cores, their
    /// budgets applied again (a rollback sandbox starts under its new
    /// checkpoint supervisor when [`SandboxSet::supervise`] begins, first
    /// checkpoint before it runs); then its links are this process's
    /// (armed: dropped, they take their TAPs' drop-all filter off). On
    /// error every sandbox is stopped.
    pub fn start_carried(&self) -> Result<(), SandboxError> {
        for sb in &self.sandboxes {
            if let Err(e) = self.start(sb) {
                self.stop_all();
                return Err(e);
            }
        }
        for l in &self.links {
            l.set_armed(true);
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

    #[test]
    fn a_rollback_gate_lets_its_monitor_supervise_again_only_after_a_failed_handover() {
        use std::sync::atomic::Ordering::SeqCst;
        let g = Arc::new(RollbackGate::default());
        let stop = Arc::new(AtomicBool::new(false));
        let monitor = |g: &Arc<RollbackGate>| {
            let (g, stop) = (g.clone(), stop.clone());
            std::thread::spawn(move || g.quiesced(|| stop.load(SeqCst)))
        };
        // The handover waits until the supervisor's run has ended.
        g.request();
        assert!(!g.wait_quiesced(Duration::from_millis(30)));
        let m = monitor(&g);
        assert!(g.wait_quiesced(Duration::from_secs(10)));
        // It failed: the monitor supervises the paused VM again.
        g.resume();
        assert!(m.join().unwrap());
        // The handover gave up before the run ended: once it does, the
        // monitor goes on at once.
        g.request();
        g.resume();
        assert!(g.quiesced(|| false));
        // A resume left from an earlier handover does not let the monitor
        // of the next one go on: it waits until the set ends (the handover
        // succeeded and this process's set is stopped).
        g.resume();
        g.request();
        let m = monitor(&g);
        assert!(g.wait_quiesced(Duration::from_secs(10)));
        stop.store(true, SeqCst);
        assert!(!m.join().unwrap());
    }

    fn with_state() -> SetConfig {
        let mut c = config();
        c.services[0].state = Some(serde_json::from_value(serde_json::json!({"mib": 4})).unwrap());
        c
    }

    fn states(mapped_in: &str, bytes: u64) -> CarriedStates {
        CarriedStates {
            version: SHARED_VERSION,
            regions: vec![CarriedState {
                service: "echo".into(),
                bytes,
                mapped_in: mapped_in.into(),
            }],
        }
    }

    #[test]
    fn carried_state_regions_are_checked_against_the_configuration_and_the_holders() {
        let c = with_state();
        // Holder web (sandbox 0): the slot is in web's VM.
        assert_eq!(states("web", 4 << 20).check(&c, &[0]).unwrap(), vec![(0, 4 << 20, 0)]);
        // After a takeover spare holds the service, and the slot.
        assert_eq!(states("spare", 4 << 20).check(&c, &[1]).unwrap(), vec![(0, 4 << 20, 1)]);
        let cases = [
            (states("spare", 4 << 20), "mapped in 'spare', not in its holder"),
            (states("nobody", 4 << 20), "mapped in 'nobody'"),
            (states("web", 2 << 20), "is 'echo' (2097152 bytes) in the record"),
            (CarriedStates { version: 9, ..states("web", 4 << 20) }, "version 9"),
            (
                CarriedStates { regions: vec![], ..states("web", 4 << 20) },
                "1 state regions configured but 0",
            ),
        ];
        for (st, want) in cases {
            let e = st.check(&c, &[0]).unwrap_err();
            assert!(e.contains(want), "{e}");
        }
        // A service without a state region has no entry.
        let e = states("web", 4 << 20).check(&config(), &[0]).unwrap_err();
        assert!(e.contains("0 state regions configured but 1"), "{e}");
    }
}
