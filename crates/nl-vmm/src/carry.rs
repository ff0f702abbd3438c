//! Carrying what a front end runs beside the host's VMs (sandbox sets)
//! across a warm rejuvenation or a microreboot.
//!
//! A sandbox set is not one of the host's VMs: its VMs map channel windows,
//! its supervision belongs to the front end (`nl-sandbox`, which this crate
//! does not know). The front end registers a [`Carrier`] once ([`register`]);
//! the handover then asks it to pause and describe every set
//! ([`Carrier::suspend`]), writes one [`SetRecord`] per set into the
//! handover record (next to the VM records, as JSON values: a corrupt set
//! record is refused on its own, the rest of the record still serves),
//! passes the sets' memfds across exec like the VMs' memfds, and in the new
//! process hands each set, its memory, saved states and channel memfds
//! ([`InheritedSet`]) back to the front end ([`Carrier::adopt`]), which
//! rebuilds it; [`Carrier::start`] then runs every adopted set.
//!
//! Version 2 of a set record adds what a set shares with the host beyond
//! its memory: each shared link's TAP and packet sockets ([`LinkRecord`],
//! checked here to be a TAP attached to the interface named and raw packet
//! sockets bound to it, [`InheritedLink`]), and its services' state-region
//! memfds (checked by inode as the channels' are). A set without either is
//! still written as version 1, which older binaries read.

use std::collections::BTreeSet;
use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::sync::{Arc, OnceLock};

use kvm_ioctls::Kvm;
use nl_memory::GuestMemory;
use serde::{Deserialize, Serialize};

use crate::handover::{take_fd, MemorySource, VmRecord};
use crate::state::VmState;
use crate::VmmError;

/// The newest version of a [`SetRecord`] this binary writes and reads: 2
/// adds [`SetRecord::links`] and [`SetRecord::state_regions`]. A record
/// with neither is written as version 1 ([`PLAIN_SET_RECORD_VERSION`]).
pub const SET_RECORD_VERSION: u32 = 2;
/// The version of a set record without links or state regions.
pub const PLAIN_SET_RECORD_VERSION: u32 = 1;

/// An inherited descriptor and the inode it must be.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FdRecord {
    pub fd: i32,
    pub ino: u64,
}

/// A shared link in a set record: its TAP (interface `tap`, descriptor
/// `tap_fd`) and its packet sockets on it, in the front end's order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkRecord {
    pub tap: String,
    pub tap_fd: i32,
    pub sockets: Vec<i32>,
}

/// A shared link as the new process inherited it: the TAP, checked to be
/// attached to the interface its record names, and its sockets, each
/// checked to be a raw packet socket bound to that interface (their
/// filters are the front end's to check).
pub struct InheritedLink {
    pub tap: nl_devices::tap::Tap,
    pub sockets: Vec<nl_devices::packet::PacketSocket>,
}

/// One set in a handover record.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SetRecord {
    pub version: u32,
    /// The set's name on the host API.
    pub name: String,
    /// The front end's description of the set (its configuration and
    /// supervision), checked by the front end when it adopts the set.
    pub config: serde_json::Value,
    /// One VM per running sandbox, in sandbox order, each with its memfd
    /// and saved state (none for a set that had ended).
    pub vms: Vec<VmRecord>,
    /// The channels' memfds, in channel order.
    pub channels: Vec<FdRecord>,
    /// Version 2: the set's shared links, in link order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub links: Vec<LinkRecord>,
    /// Version 2: the memfds of its services' state regions, in the order
    /// of the services that have one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub state_regions: Vec<FdRecord>,
}

impl SetRecord {
    pub fn new(name: &str, config: serde_json::Value) -> Self {
        Self {
            version: PLAIN_SET_RECORD_VERSION,
            name: name.into(),
            config,
            vms: Vec::new(),
            channels: Vec::new(),
            links: Vec::new(),
            state_regions: Vec::new(),
        }
    }

    /// Adds the set's shared links and state regions (a version 2 record
    /// if there are any).
    pub fn carry_shared(&mut self, links: Vec<LinkRecord>, state_regions: Vec<FdRecord>) {
        if !links.is_empty() || !state_regions.is_empty() {
            self.version = SET_RECORD_VERSION;
        }
        self.links = links;
        self.state_regions = state_regions;
    }

    /// Parses and checks one set record: its version, its name, every VM
    /// with a memfd and a state and fields a VM may have, no descriptor
    /// named twice. The message names the set (when it has a name) and
    /// what is wrong.
    pub fn parse(v: &serde_json::Value) -> Result<Self, VmmError> {
        let name = v.get("name").and_then(|n| n.as_str()).unwrap_or("?").to_string();
        let bad = |m: String| VmmError::State(format!("sandbox set record '{name}' refused: {m}"));
        let version = v.get("version").and_then(|n| n.as_u64());
        let known = u64::from(PLAIN_SET_RECORD_VERSION)..=u64::from(SET_RECORD_VERSION);
        if !version.is_some_and(|v| known.contains(&v)) {
            return Err(bad(format!(
                "version {version:?}; this binary reads versions {PLAIN_SET_RECORD_VERSION} to \
                 {SET_RECORD_VERSION}"
            )));
        }
        let r: Self =
            serde_json::from_value(v.clone()).map_err(|e| bad(format!("corrupt ({e})")))?;
        if r.version < SET_RECORD_VERSION && (!r.links.is_empty() || !r.state_regions.is_empty()) {
            return Err(bad(format!(
                "shared links or state regions in a version {} record",
                r.version
            )));
        }
        if r.name.is_empty()
            || r.name.len() > 64
            || !r.name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(bad("its name must be 1 to 64 of letters, digits, '-' and '_'".into()));
        }
        let mut fds = BTreeSet::new();
        let mut ids = BTreeSet::new();
        for vm in &r.vms {
            let MemorySource::Memfd { fd, .. } = vm.memory else {
                return Err(bad(format!("sandbox VM {} has no memfd", vm.id)));
            };
            if vm.state.is_none() {
                return Err(bad(format!("sandbox VM {} has no saved state", vm.id)));
            }
            if !ids.insert(vm.id) {
                return Err(bad(format!("sandbox VM {} listed twice", vm.id)));
            }
            vm.check_fields().map_err(|e| bad(e.to_string()))?;
            if vm.tap_fd.is_some() && vm.net.is_none() {
                return Err(bad(format!("sandbox VM {} has a TAP descriptor but no net", vm.id)));
            }
            for fd in std::iter::once(fd).chain(vm.tap_fd) {
                if !fds.insert(fd) {
                    return Err(bad(format!("descriptor {fd} used twice")));
                }
            }
        }
        for l in &r.links {
            if l.tap.is_empty() || l.tap.len() >= 16 || l.tap.contains(['/', ' ', '\0']) {
                return Err(bad(format!("a link's TAP name '{}' is not an interface name", l.tap)));
            }
            if l.sockets.is_empty() {
                return Err(bad(format!("the link on TAP {} has no sockets", l.tap)));
            }
        }
        let shared =
            r.links.iter().flat_map(|l| std::iter::once(l.tap_fd).chain(l.sockets.clone()));
        for fd in r
            .channels
            .iter()
            .map(|c| c.fd)
            .chain(shared)
            .chain(r.state_regions.iter().map(|s| s.fd))
        {
            if !fds.insert(fd) {
                return Err(bad(format!("descriptor {fd} used twice")));
            }
        }
        Ok(r)
    }

    /// Every descriptor the record names (to be inherited across exec).
    pub fn fds(&self) -> Vec<i32> {
        let vms = self.vms.iter().filter_map(|v| match v.memory {
            MemorySource::Memfd { fd, .. } => Some(fd),
            _ => None,
        });
        let taps = self.vms.iter().filter_map(|v| v.tap_fd);
        let links =
            self.links.iter().flat_map(|l| std::iter::once(l.tap_fd).chain(l.sockets.clone()));
        vms.chain(taps)
            .chain(self.channels.iter().map(|c| c.fd))
            .chain(links)
            .chain(self.state_regions.iter().map(|s| s.fd))
            .collect()
    }
}

/// A set as the new process inherited it: its record, each sandbox VM's
/// memory, saved state and attached TAP descriptor (in the record's
/// order), the channel memfds.
pub struct InheritedSet {
    pub record: SetRecord,
    pub memories: Vec<GuestMemory>,
    pub states: Vec<VmState>,
    /// Per VM: the TAP it had attached (checked to be attached to the
    /// interface its `net` names), for the front end to attach to the
    /// rebuilt VM itself. Never parked by interface name: a set that
    /// cannot be rebuilt closes its TAPs with it.
    pub taps: Vec<Option<nl_devices::tap::Tap>>,
    pub channels: Vec<File>,
    /// The shared links, in the record's order.
    pub links: Vec<InheritedLink>,
    /// The state regions' memfds (inodes checked), in the record's order.
    pub state_regions: Vec<File>,
}

/// What a front end does with its sets at a handover.
pub trait Carrier: Send + Sync {
    /// Whether it runs anything to carry now.
    fn holds(&self) -> bool;
    /// Pauses every set and describes it (VM states saved; memfds stay
    /// open here). `strict` (a rejuvenation, which can still roll back): a
    /// set that cannot be carried fails the handover; otherwise (a
    /// microreboot) it is left behind with a report.
    fn suspend(&self, strict: bool) -> Result<Vec<SetRecord>, String>;
    /// The handover failed: the suspended sets run on here.
    fn resume(&self);
    /// In the new process: rebuild one set, not started.
    fn adopt(&self, kvm: &Kvm, set: InheritedSet) -> Result<(), String>;
    /// In the new process: start every adopted set; the errors.
    fn start(&self) -> Vec<String>;
}

static CARRIER: OnceLock<Arc<dyn Carrier>> = OnceLock::new();

/// Registers the front end's carrier (once, at start, before any handover
/// is taken over).
pub fn register(c: Arc<dyn Carrier>) {
    let _ = CARRIER.set(c);
}

pub(crate) fn carrier() -> Option<&'static Arc<dyn Carrier>> {
    CARRIER.get()
}

/// Whether a registered carrier holds sets now.
pub(crate) fn holds() -> bool {
    carrier().is_some_and(|c| c.holds())
}

/// The sets' records as JSON values, after pausing them.
pub(crate) fn suspend(strict: bool) -> Result<Vec<SetRecord>, String> {
    match carrier() {
        Some(c) if c.holds() => c.suspend(strict),
        _ => Ok(Vec::new()),
    }
}

pub(crate) fn resume() {
    if let Some(c) = carrier() {
        c.resume();
    }
}

/// Takes one set's inherited descriptors and parses its states: every
/// descriptor must be open and not taken yet, each memfd the inode its
/// record names, each TAP attached to its interface, each link socket a raw
/// packet socket bound to its link's TAP. The error names the set and
/// what is wrong (public for the front end's tests).
pub fn inherit(v: &serde_json::Value, taken: &mut BTreeSet<i32>) -> Result<InheritedSet, VmmError> {
    let record = SetRecord::parse(v)?;
    let name = record.name.clone();
    let bad = |m: String| VmmError::State(format!("sandbox set record '{name}' refused: {m}"));
    let check_ino = |f: &File, fd: i32, ino: u64| -> Result<(), VmmError> {
        let got = f.metadata()?.ino();
        if got != ino {
            return Err(bad(format!("descriptor {fd} is inode {got}, the record says {ino}")));
        }
        Ok(())
    };
    let mut memories = Vec::new();
    let mut states = Vec::new();
    let mut taps = Vec::new();
    for vm in &record.vms {
        let MemorySource::Memfd { fd, ino } = vm.memory else { unreachable!("parse checked") };
        let f = take_fd(fd, taken, "sandbox memory").map_err(|e| bad(e.to_string()))?;
        check_ino(&f, fd, ino)?;
        memories
            .push(GuestMemory::from_fd(Arc::new(f), vm.mem_bytes).map_err(|e| bad(e.to_string()))?);
        let s = vm.state.as_deref().unwrap_or_default();
        let state = VmState::from_bytes(s.as_bytes()).map_err(|e| bad(e.to_string()))?;
        vm.check_state(&state).map_err(|e| bad(e.to_string()))?;
        states.push(state);
        // A sandbox's TAP stays attached across the handover (frames that
        // arrive meanwhile wait in it); the front end attaches it to the
        // rebuilt VM.
        taps.push(match (vm.tap_fd, &vm.net) {
            (Some(fd), Some(net)) => {
                let f = take_fd(fd, taken, "sandbox TAP").map_err(|e| bad(e.to_string()))?;
                let tap = nl_devices::tap::Tap::from_attached(f, &net.tap)
                    .map_err(|e| bad(format!("sandbox VM {}: descriptor {fd}: {e}", vm.id)))?;
                Some(tap)
            }
            _ => None,
        });
    }
    let mut channels = Vec::new();
    for c in &record.channels {
        let f = take_fd(c.fd, taken, "channel").map_err(|e| bad(e.to_string()))?;
        check_ino(&f, c.fd, c.ino)?;
        channels.push(f);
    }
    let mut links = Vec::new();
    for l in &record.links {
        let what = |fd: i32, e: String| bad(format!("link on TAP {}: descriptor {fd}: {e}", l.tap));
        let f = take_fd(l.tap_fd, taken, "link TAP").map_err(|e| bad(e.to_string()))?;
        let tap = nl_devices::tap::Tap::from_attached(f, &l.tap).map_err(|e| what(l.tap_fd, e))?;
        let ifindex = nl_devices::packet::ifindex(&l.tap)
            .map_err(|e| bad(format!("link on TAP {}: no such interface here: {e}", l.tap)))?;
        let mut sockets = Vec::new();
        for &fd in &l.sockets {
            let f = take_fd(fd, taken, "link socket").map_err(|e| bad(e.to_string()))?;
            sockets.push(
                nl_devices::packet::PacketSocket::from_inherited(f, ifindex)
                    .map_err(|e| what(fd, e))?,
            );
        }
        links.push(InheritedLink { tap, sockets });
    }
    let mut state_regions = Vec::new();
    for s in &record.state_regions {
        let f = take_fd(s.fd, taken, "state region").map_err(|e| bad(e.to_string()))?;
        check_ino(&f, s.fd, s.ino)?;
        state_regions.push(f);
    }
    Ok(InheritedSet { record, memories, states, taps, channels, links, state_regions })
}

/// Rebuilds every set of a record in the new process (not started).
/// `strict` (a rejuvenation): the first set that cannot be rebuilt refuses
/// the handover, so the old process keeps everything. Otherwise (a
/// microreboot, which has no way back) such a set is reported and left
/// out; the host and its other sets come up. Returns the refusals.
pub(crate) fn adopt_all(
    kvm: &Kvm,
    sets: &[serde_json::Value],
    taken: &mut BTreeSet<i32>,
    strict: bool,
) -> Result<Vec<String>, VmmError> {
    let mut refused = Vec::new();
    if sets.is_empty() {
        return Ok(refused);
    }
    let Some(c) = carrier() else {
        let m =
            format!("{} sandbox set(s) in the record, but no front end to run them", sets.len());
        return if strict {
            Err(VmmError::State(format!("handover refused: {m}")))
        } else {
            Ok(vec![m])
        };
    };
    for v in sets {
        let mut v = v.clone();
        if crate::selftest::handover_corrupts_sets() {
            v["vms"] = serde_json::json!("corrupted by NINELIVES_HANDOVER_SELFTEST");
        }
        let r = inherit(&v, taken).and_then(|set| {
            let name = set.record.name.clone();
            c.adopt(kvm, set).map_err(|e| {
                VmmError::State(format!("sandbox set '{name}' cannot be rebuilt: {e}"))
            })
        });
        match r {
            Ok(()) => {}
            Err(e) if strict => return Err(e),
            Err(e) => {
                let m = e.to_string();
                crate::event_log::publish("sandbox_set_refused", serde_json::json!({"error": m}));
                tracing::error!("{m}");
                refused.push(m);
            }
        }
    }
    Ok(refused)
}

/// Starts what [`adopt_all`] rebuilt.
pub(crate) fn start_adopted() {
    if let Some(c) = carrier() {
        for e in c.start() {
            crate::event_log::publish("sandbox_set_refused", serde_json::json!({"error": e}));
            tracing::error!("{e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sample() -> serde_json::Value {
        let mut r = SetRecord::new("pair", json!({"any": 1}));
        let c = crate::VmConfig {
            mem_bytes: 64 << 20,
            vcpus: 1,
            workload: Default::default(),
            kernel: Arc::default(),
            user: Arc::default(),
            console_path: None,
            timer_hz: 100,
            heartbeat_timeout: std::time::Duration::from_secs(10),
            disk: None,
            net: None,
        };
        let mut v = VmRecord::describe(0, &c, false);
        v.memory = MemorySource::Memfd { fd: 7, ino: 99 };
        v.state = Some("{}".into());
        r.vms.push(v);
        r.channels.push(FdRecord { fd: 8, ino: 100 });
        serde_json::to_value(r).unwrap()
    }

    #[test]
    fn set_records_round_trip_and_name_their_descriptors() {
        let r = SetRecord::parse(&sample()).unwrap();
        assert_eq!(r.name, "pair");
        assert_eq!(r.fds(), vec![7, 8]);
        assert_eq!(serde_json::to_value(&r).unwrap(), sample());
    }

    #[test]
    fn corrupt_set_records_are_refused_by_what_is_wrong() {
        let cases: [(&str, serde_json::Value, &str); 6] = [
            ("version", json!(3), "version Some(3); this binary reads versions 1 to 2"),
            ("name", json!("a b"), "must be 1 to 64"),
            ("vms", json!("many"), "corrupt"),
            ("channels", json!([{"fd": 7, "ino": 1}]), "descriptor 7 used twice"),
            ("vms", json!([sample()["vms"][0], sample()["vms"][0]]), "listed twice"),
            ("config", json!(null), ""),
        ];
        for (field, value, want) in cases {
            let mut v = sample();
            v[field] = value;
            let r = SetRecord::parse(&v);
            if want.is_empty() {
                assert!(r.is_ok(), "{field}: {r:?}");
                continue;
            }
            let e = r.unwrap_err().to_string();
            assert!(e.contains("sandbox set record") && e.contains(want), "{field}: {e}");
        }
        let mut v = sample();
        v["vms"][0]["state"] = json!(null);
        let e = SetRecord::parse(&v).unwrap_err().to_string();
        assert!(e.contains("'pair' refused: sandbox VM 0 has no saved state"), "{e}");
        let mut v = sample();
        v["vms"][0]["memory"] = json!({"kind": "fresh"});
        let e = SetRecord::parse(&v).unwrap_err().to_string();
        assert!(e.contains("has no memfd"), "{e}");
        let mut v = sample();
        v["vms"][0]["tap_fd"] = json!(9);
        let e = SetRecord::parse(&v).unwrap_err().to_string();
        assert!(e.contains("sandbox VM 0 has a TAP descriptor but no net"), "{e}");
        let mut v = sample();
        v["vms"][0]["net"] = json!({"tap": "nltap0", "ipv4": [10, 0, 0, 2], "prefix": 24});
        v["vms"][0]["tap_fd"] = json!(8);
        let e = SetRecord::parse(&v).unwrap_err().to_string();
        assert!(e.contains("descriptor 8 used twice"), "{e}");
        v["vms"][0]["tap_fd"] = json!(9);
        let r = SetRecord::parse(&v).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r.fds(), vec![7, 9, 8], "memfds, TAPs, channels");
        let mut v = sample();
        v["vms"][0]["vcpus"] = json!(0);
        let e = SetRecord::parse(&v).unwrap_err().to_string();
        assert!(e.contains("out of range"), "{e}");
    }

    fn link(tap_fd: i32, sockets: Vec<i32>) -> LinkRecord {
        LinkRecord { tap: "nltap0".into(), tap_fd, sockets }
    }

    #[test]
    fn links_and_state_regions_make_a_version_2_record_and_are_checked() {
        let mut r = SetRecord::parse(&sample()).unwrap();
        r.carry_shared(Vec::new(), Vec::new());
        assert_eq!(r.version, PLAIN_SET_RECORD_VERSION, "nothing shared: still version 1");
        r.carry_shared(vec![link(10, vec![11, 12])], vec![FdRecord { fd: 13, ino: 5 }]);
        assert_eq!(r.version, SET_RECORD_VERSION);
        let v = serde_json::to_value(&r).unwrap();
        let back = SetRecord::parse(&v).unwrap();
        assert_eq!(back.fds(), vec![7, 8, 10, 11, 12, 13], "memfds, channels, links, states");
        assert_eq!(back.links, r.links);
        // A version 1 record cannot have them (an older writer had none).
        let mut old = v.clone();
        old["version"] = json!(1);
        let e = SetRecord::parse(&old).unwrap_err().to_string();
        assert!(e.contains("shared links or state regions in a version 1 record"), "{e}");
        let cases: [(&str, serde_json::Value, &str); 5] = [
            ("links", json!([link(10, vec![11, 7])]), "descriptor 7 used twice"),
            ("links", json!([link(8, vec![11])]), "descriptor 8 used twice"),
            ("links", json!([link(10, vec![])]), "has no sockets"),
            ("links", json!([{"tap": "a/b", "tap_fd": 10, "sockets": [11]}]), "not an interface"),
            ("state_regions", json!([{"fd": 11, "ino": 1}]), "descriptor 11 used twice"),
        ];
        for (field, value, want) in cases {
            let mut w = v.clone();
            w[field] = value;
            let e = SetRecord::parse(&w).unwrap_err().to_string();
            assert!(e.contains(want), "{field}: {e}");
        }
    }

    /// A record of no VMs naming `links` and `states`, for [`inherit`].
    fn shared_only(links: Vec<LinkRecord>, states: Vec<FdRecord>) -> serde_json::Value {
        let mut r = SetRecord::new("pair", json!({}));
        r.carry_shared(links, states);
        serde_json::to_value(r).unwrap()
    }

    /// A descriptor of a fresh memfd of `bytes`, given up (for `take_fd`).
    fn memfd_fd(bytes: u64) -> (i32, u64) {
        use std::os::fd::IntoRawFd;
        let f = nl_memory::create_memfd("carry-test").unwrap();
        f.set_len(bytes).unwrap();
        let ino = f.metadata().unwrap().ino();
        (f.into_raw_fd(), ino)
    }

    #[test]
    fn inherited_links_and_state_regions_must_be_open_and_of_their_kind() {
        let ok = |v: &serde_json::Value| inherit(v, &mut BTreeSet::new()).map(|_| ());
        let err = |v: serde_json::Value| ok(&v).unwrap_err().to_string();
        // Not open (no descriptor this high exists in a test).
        let e = err(shared_only(vec![link(900_000, vec![900_001])], vec![]));
        assert!(e.contains("link TAP descriptor 900000 is not open"), "{e}");
        // A memfd where the TAP should be.
        let (fd, _) = memfd_fd(4096);
        let e = err(shared_only(vec![link(fd, vec![900_001])], vec![]));
        assert!(
            e.contains(&format!(
                "link on TAP nltap0: descriptor {fd}: inherited descriptor is not an attached TAP"
            )),
            "{e}"
        );
        // A state region that is another inode than recorded.
        let (fd, ino) = memfd_fd(2 << 20);
        let e = err(shared_only(vec![], vec![FdRecord { fd, ino: ino + 1 }]));
        assert!(
            e.contains(&format!("descriptor {fd} is inode {ino}, the record says {}", ino + 1)),
            "{e}"
        );
        let e = err(shared_only(vec![], vec![FdRecord { fd: 900_002, ino }]));
        assert!(e.contains("state region descriptor 900002 is not open"), "{e}");
        // The right inode is taken (its size and kind are the front end's
        // to check: nl_sandbox::state).
        let (fd, ino) = memfd_fd(2 << 20);
        let v = shared_only(vec![], vec![FdRecord { fd, ino }]);
        let set = inherit(&v, &mut BTreeSet::new()).unwrap();
        assert_eq!(set.state_regions.len(), 1);
    }
}
