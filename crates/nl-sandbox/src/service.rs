//! Remote recovery (Quest-V): the service registry and the takeover of a
//! failed owner's service by a standby sandbox.
//!
//! A service (`services[]` in the set's configuration) has a name, an owner
//! sandbox whose `net` section is the service's identity (TAP, MAC, IPv4),
//! and a standby sandbox running the same kind of service workload on a
//! *spare* virtio-net device under that identity (no TAP behind it, link
//! down; its guest waits for the link, heartbeating).
//!
//! On a fault in the current holder (any detector), its monitor, after
//! stopping the holder's vCPUs, takes the TAP from the holder's virtio-net
//! device (the same open TAP: nothing is re-opened by name and no frame
//! queue is torn down) and hands it to the standby's monitor
//! ([`crate::monitor::Monitor::hand_over`]). The standby's monitor attaches
//! it to its own VM's device: the link comes up, the standby's ring-3
//! driver initialises, brings the service up under the same MAC and
//! address and sends a gratuitous ARP. The failed sandbox then recovers by
//! its own policy (`restart`, `replace`) with a spare device and becomes the
//! new standby. No other sandbox is touched.
//!
//! A takeover whose standby cannot take the TAP (it is stopped, or its
//! monitor does not answer within [`HANDOVER_WAIT`], or [`REBUILD_WAIT`]
//! while it rebuilds the standby's own VM) is recorded as failed
//! ("no standby available"), and the TAP goes back to the failed sandbox,
//! whose local recovery keeps serving on it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nl_devices::tap::Tap;
use nl_sync::Lock;
use serde::{Deserialize, Serialize};

use crate::config::{RecoveryPolicy, SetConfig};
use crate::detect::Detection;
use crate::set::{Sandbox, SandboxSet};
use crate::SandboxError;

/// How long a failed holder's monitor waits for the standby's monitor to
/// take the TAP.
pub const HANDOVER_WAIT: Duration = Duration::from_secs(2);

/// How long it waits for a standby whose monitor is rebuilding the
/// standby's VM (a restart of its own; building a VM can take seconds on a
/// busy host, see [`crate::prepare`]).
pub const REBUILD_WAIT: Duration = Duration::from_secs(30);

/// Checks the registry: names unique, owner and standby known, distinct,
/// in one service at most; the owner has a `net` section, the standby none
/// and the owner's workload kind; neither recovers by `rollback` (a
/// rolled-back sandbox never gives its device up).
pub fn validate(c: &SetConfig) -> Result<(), SandboxError> {
    let bad = |m: String| Err(SandboxError::Config(m));
    let mut seen = std::collections::BTreeSet::new();
    let mut used = std::collections::BTreeSet::new();
    for v in &c.services {
        if v.name.is_empty() || !seen.insert(v.name.as_str()) {
            return bad(format!("service name '{}' is empty or used twice", v.name));
        }
        let find = |n: &str| c.sandboxes.iter().find(|s| s.name == n);
        let (Some(owner), Some(standby)) = (find(&v.owner), find(&v.standby)) else {
            let which = if find(&v.owner).is_none() { &v.owner } else { &v.standby };
            return bad(format!("service '{}' names unknown sandbox '{which}'", v.name));
        };
        if owner.name == standby.name {
            return bad(format!("service '{}': owner and standby are one sandbox", v.name));
        }
        for s in [owner, standby] {
            if !used.insert(s.name.as_str()) {
                return bad(format!("sandbox '{}' is in more than one service", s.name));
            }
            if s.recovery.policy == RecoveryPolicy::Rollback {
                return bad(format!(
                    "sandbox '{}' of service '{}': recovery policy 'rollback' cannot hand a service over (use restart or replace)",
                    s.name, v.name
                ));
            }
        }
        if owner.net.is_none() {
            return bad(format!(
                "service '{}': its owner '{}' has no net section (the service's identity)",
                v.name, owner.name
            ));
        }
        if standby.net.is_some() {
            return bad(format!(
                "service '{}': its standby '{}' has a net section of its own; a standby takes the owner's",
                v.name, standby.name
            ));
        }
        if let Some(st) = v.state {
            crate::state::check_size(st.mib)
                .map_err(|e| SandboxError::Config(format!("service '{}': {e}", v.name)))?;
            if owner.workload.kind != "kv" {
                return bad(format!(
                    "service '{}': a state region needs the kv workload, not {}",
                    v.name, owner.workload.kind
                ));
            }
        }
        if standby.workload.kind != owner.workload.kind {
            return bad(format!(
                "service '{}': standby '{}' runs {}, the owner runs {}",
                v.name, standby.name, standby.workload.kind, owner.workload.kind
            ));
        }
    }
    Ok(())
}

/// One takeover, in ms after the detection in the failed holder.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Takeover {
    pub service: String,
    pub from: String,
    pub to: String,
    /// The detector that fired in `from`.
    pub detector: String,
    pub ok: bool,
    pub error: Option<String>,
    /// The TAP taken from `from`'s stopped VM and handed to `to`'s monitor.
    pub notified_ms: Option<f64>,
    /// `to`'s monitor attached it to its VM (the link is up).
    pub attached_ms: Option<f64>,
    /// `to`'s guest sent its gratuitous ARP.
    pub announced_ms: Option<f64>,
    /// `to`'s guest sent another frame (its first reply).
    pub first_reply_ms: Option<f64>,
}

/// A service and who holds it now.
pub struct Service {
    pub name: String,
    holder: AtomicUsize,
    standby: AtomicUsize,
    takeovers: Arc<Lock<Vec<Takeover>>>,
    /// Its state region, if it has one ([`crate::state`]).
    pub state: Option<Arc<crate::state::StateRegion>>,
}

/// A service's state in the set's report (and in a handover record).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ServiceReport {
    pub name: String,
    /// The sandbox serving it now.
    pub holder: String,
    pub standby: String,
    pub takeovers: Vec<Takeover>,
}

/// The set's service registry.
#[derive(Default)]
pub struct Registry {
    pub services: Vec<Service>,
}

/// What a standby's monitor is handed: the TAP and when it all began.
pub struct Handover {
    pub service: usize,
    pub tap: Tap,
    pub t0: Instant,
    pub record: Takeover,
}

/// A takeover whose late phases (announce, first reply) the standby's
/// monitor is still watching for. Its record is in the service's list
/// from the moment the TAP is attached; the watch fills in its phases.
pub(crate) struct Watch {
    service: usize,
    /// The record's index in the service's takeovers.
    at: usize,
    t0: Instant,
    /// The device's counters when the TAP was attached.
    tx0: u64,
    arp0: u64,
}

fn ms(t0: Instant) -> Option<f64> {
    Some(t0.elapsed().as_secs_f64() * 1e3)
}

impl Registry {
    /// The registry of `c`'s services, without state regions.
    pub fn new(c: &SetConfig) -> Registry {
        Self::with_states(c, Vec::new())
    }

    /// The registry of `c`'s services, with their state regions (by
    /// service, in order).
    pub fn with_states(
        c: &SetConfig,
        states: Vec<Option<Arc<crate::state::StateRegion>>>,
    ) -> Registry {
        let index = |n: &str| c.sandboxes.iter().position(|s| s.name == n).unwrap_or(0);
        let mut states = states.into_iter();
        Registry {
            services: c
                .services
                .iter()
                .map(|v| Service {
                    state: states.next().flatten(),
                    name: v.name.clone(),
                    holder: AtomicUsize::new(index(&v.owner)),
                    standby: AtomicUsize::new(index(&v.standby)),
                    takeovers: Lock::new("sandbox.takeovers", Vec::new()),
                })
                .collect(),
        }
    }

    /// Every service as a handover record carries it: who holds it now,
    /// who stands by, the takeovers so far.
    pub fn carried(&self, names: &[String]) -> Vec<ServiceReport> {
        self.report(names)
    }

    /// Sets each service's holder, standby and takeovers from a carried
    /// registry (checked by the caller against the configuration).
    pub fn restore_carried(&self, carried: &[(usize, usize, Vec<Takeover>)]) {
        for (s, (holder, standby, takeovers)) in self.services.iter().zip(carried) {
            s.holder.store(*holder, Ordering::SeqCst);
            s.standby.store(*standby, Ordering::SeqCst);
            *s.takeovers.lock() = takeovers.clone();
        }
    }

    /// The service sandbox `i` holds now, if any.
    pub fn held_by(&self, i: usize) -> Option<usize> {
        self.services.iter().position(|s| s.holder.load(Ordering::SeqCst) == i)
    }

    /// The state region whose slot is in sandbox `i`'s VM now.
    pub fn state_mapped_in(&self, i: usize) -> Option<Arc<crate::state::StateRegion>> {
        self.services.iter().filter_map(|s| s.state.clone()).find(|st| st.mapped_in() == Some(i))
    }

    /// Whether sandbox `i` is a service's standby now.
    pub fn is_standby(&self, i: usize) -> bool {
        self.services.iter().any(|s| s.standby.load(Ordering::SeqCst) == i)
    }

    /// Every service's holder, standby and takeovers.
    pub fn report(&self, names: &[String]) -> Vec<ServiceReport> {
        let name = |i: usize| names.get(i).cloned().unwrap_or_default();
        self.services
            .iter()
            .map(|s| ServiceReport {
                name: s.name.clone(),
                holder: name(s.holder.load(Ordering::SeqCst)),
                standby: name(s.standby.load(Ordering::SeqCst)),
                takeovers: s.takeovers.lock().clone(),
            })
            .collect()
    }
}

/// Run by the failed holder `sb`'s monitor after its vCPUs stopped: hands
/// service `svc`'s TAP to the standby's monitor and waits (bounded) until
/// it took it. On failure the TAP goes back into `sb`'s stopped VM, so its
/// local recovery keeps it, and the takeover is recorded as failed.
pub(crate) fn take_over(
    set: &SandboxSet,
    sb: &Sandbox,
    svc: usize,
    detection: &Detection,
    t0: Instant,
) {
    let s = &set.services.services[svc];
    let to = s.standby.load(Ordering::SeqCst);
    let standby = &set.sandboxes[to];
    let mut record = Takeover {
        service: s.name.clone(),
        from: sb.config.name.clone(),
        to: standby.config.name.clone(),
        detector: detection.detector.name().into(),
        ..Default::default()
    };
    let fail = |mut record: Takeover, why: String| {
        eprintln!("ninelives: service '{}': takeover by '{}' failed: {why}", s.name, record.to);
        record.error = Some(why);
        s.takeovers.lock().push(record);
    };
    let Some(tap) = sb.vm().take_tap() else {
        return fail(record, format!("sandbox '{}' holds no TAP", sb.config.name));
    };
    // The state region leaves the failed holder before the standby may map
    // it. Its VM is stopped for good (the monitor stopped it; it is replaced
    // by a restart, never run again): the slot stays in it, unreachable,
    // and goes with it. Removing the slot here would wait for the kernel
    // (see StateRegion::release_stopped) with the TAP not yet handed over.
    if let Some(st) = &s.state {
        st.release_stopped(sb.index);
    }
    record.notified_ms = ms(t0);
    crate::trace(format_args!("{}: TAP handed to {}", sb.config.name, standby.config.name));
    standby.monitor.hand_over(Handover { service: svc, tap, t0, record });
    // A standby whose monitor is rebuilding its VM (its own restart) takes
    // the TAP once that ends: worth waiting for up to REBUILD_WAIT, since
    // the failed holder's own restart would need a new VM as well.
    let start = Instant::now();
    for _ in 0..(REBUILD_WAIT.as_millis() * 10) {
        let waited = start.elapsed();
        let rebuilding = standby.monitor.doing().0 == crate::monitor::REBUILDING;
        if !standby.monitor.handover_pending()
            || waited > REBUILD_WAIT
            || (waited > HANDOVER_WAIT && !rebuilding)
        {
            break;
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    if let Some(h) = standby.monitor.take_handover() {
        let (doing, since) = standby.monitor.doing();
        let _ = sb.vm().attach_tap(h.tap);
        // Its stopped VM still has the slot (release_stopped above).
        if let Some(st) = &s.state {
            if let Err(e) = st.reclaim_stopped(sb.index) {
                eprintln!("ninelives: service '{}': {e}", s.name);
            }
        }
        fail(
            h.record,
            format!(
                "no standby available: '{}' did not take the TAP within {:.0} ms (its monitor: \
                 {doing} for {:.0} ms)",
                standby.config.name,
                start.elapsed().as_secs_f64() * 1e3,
                set.elapsed_ms() - since
            ),
        );
    }
}

/// Run by a standby's monitor on every pass: attaches a handed-over TAP to
/// its VM (then the service is its own, the failed holder becomes the
/// standby, and the takeover is recorded), and follows a running
/// takeover's late phases until both are seen (no time limit: with no
/// client traffic the first reply comes with the first client).
pub(crate) fn standby_pass(set: &SandboxSet, sb: &Sandbox, watch: &mut Option<Watch>) {
    if let Some(h) = sb.monitor.take_handover() {
        let s = &set.services.services[h.service];
        let vm = sb.vm();
        let tx = vm.net_stats().map(|n| n.0).unwrap_or_default();
        // The state region first: the guest reaches it once the link is up.
        if let Some(st) = &s.state {
            if let Err(e) = st.map_into(sb.index, &vm) {
                eprintln!("ninelives: service '{}': standby '{}': {e}", s.name, sb.config.name);
                sb.monitor.hand_over(h);
                sb.monitor.refuse_handover();
                return;
            }
        }
        match vm.attach_tap(h.tap) {
            Ok(()) => {
                let mut record = h.record;
                record.attached_ms = ms(h.t0);
                crate::trace(format_args!("{}: TAP attached", sb.config.name));
                // The service is this sandbox's now: recorded at once, so a
                // takeover with no client traffic is seen without delay.
                record.ok = true;
                let at = {
                    let mut list = s.takeovers.lock();
                    list.push(record);
                    list.len() - 1
                };
                let from = s.holder.swap(sb.index, Ordering::SeqCst);
                s.standby.store(from, Ordering::SeqCst);
                *watch = Some(Watch {
                    service: h.service,
                    at,
                    t0: h.t0,
                    tx0: tx.tx_frames,
                    arp0: tx.guest_announcements,
                });
            }
            Err(tap) => {
                if let Some(st) = &s.state {
                    st.unmap_from(sb.index, &vm);
                }
                // Not ours to take (no spare device, or one in use): the
                // failed holder's monitor takes it back.
                sb.monitor.hand_over(Handover { tap, ..h });
                sb.monitor.refuse_handover();
            }
        }
    }
    if let Some(w) = watch {
        let n = sb.vm().net_stats().map(|n| n.0).unwrap_or_default();
        let list = &set.services.services[w.service].takeovers;
        let mut list = list.lock();
        let Some(r) = list.get_mut(w.at) else {
            *watch = None;
            return;
        };
        if r.announced_ms.is_none() && n.guest_announcements > w.arp0 {
            r.announced_ms = ms(w.t0);
            crate::trace(format_args!("{}: guest announced", sb.config.name));
        }
        // Any other frame the guest sends: its first reply (or its first
        // ARP request, when a client's frame made it look up the sender).
        if r.first_reply_ms.is_none() && n.tx_frames > w.tx0 + (n.guest_announcements - w.arp0) {
            r.first_reply_ms = ms(w.t0);
            crate::trace(format_args!("{}: first other frame", sb.config.name));
        }
        if r.announced_ms.is_some() && r.first_reply_ms.is_some() {
            *watch = None;
        }
    }
}

/// Ends following a takeover (its record stays with the phases reached).
pub(crate) fn finish_watch(_set: &SandboxSet, watch: &mut Option<Watch>) {
    *watch = None;
}
