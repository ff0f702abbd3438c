//! Routing of guest accesses to devices by address range.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::Arc;

use nl_sync::{Guard, Lock};

use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("device {name} at {base:#x}+{len:#x} overlaps {other}")]
    Overlap { name: String, base: u64, len: u64, other: String },
    #[error("device {0} has zero length")]
    Empty(String),
    #[error("saved state names device {0}, which this bus does not have")]
    UnknownDevice(String),
    #[error("saved state has no state for device {name} at {base:#x}")]
    MissingDevice { name: String, base: u64 },
    #[error("saved state names device {name} at {base:#x} twice")]
    DuplicateDevice { name: String, base: u64 },
    #[error("saved state of device {name} is invalid: {why}")]
    BadState { name: String, why: String },
}

/// A device on a bus. `cpu` is the index of the vCPU making the access.
pub trait Device: Send {
    fn name(&self) -> &str;
    fn read(&mut self, cpu: usize, offset: u64, data: &mut [u8]);
    fn write(&mut self, cpu: usize, offset: u64, data: &[u8]);
    /// The device's state, serializable.
    fn save(&self) -> serde_json::Value;
    /// Replaces the device's state with a saved one; on error the state is unchanged.
    fn restore(&mut self, state: &serde_json::Value) -> Result<(), BusError>;
}

pub type SharedDevice = Arc<Lock<dyn Device>>;

struct Entry {
    len: u64,
    dev: SharedDevice,
}

/// Saved state of one device on a bus.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceState {
    pub name: String,
    pub base: u64,
    pub state: serde_json::Value,
}

/// Statistics of accesses nobody claimed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnclaimedStats {
    pub reads: u64,
    pub writes: u64,
    pub last_addr: u64,
}

impl Default for Bus {
    fn default() -> Self {
        Self::new()
    }
}

/// A port-I/O or MMIO bus.
pub struct Bus {
    entries: BTreeMap<u64, Entry>,
    unclaimed: Option<Arc<Lock<UnclaimedStats>>>,
}

fn lock(dev: &SharedDevice) -> Guard<'_, dyn Device + 'static> {
    dev.lock()
}

thread_local! {
    /// Device accesses the calling thread is inside (the VMM's "IRQ count").
    static ACCESS_DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Device accesses the calling thread is inside now: 0 outside device
/// emulation, 1 inside it. An access never nests, and the bus asserts so.
pub fn access_depth() -> u32 {
    ACCESS_DEPTH.with(Cell::get)
}

/// Sets the calling thread's access depth to 0 (a microreset repair: a
/// thread whose stack was discarded inside a device never left it).
pub fn reset_access_depth() {
    ACCESS_DEPTH.with(|d| d.set(0));
}

/// A self-test fault: armed, the N-th device access runs a hook inside the
/// device, with its lock held.
static FAULT: nl_sync::FaultHook = nl_sync::FaultHook::new();

/// Arms the self-test fault (tests of VMM recovery): the `after`-th device
/// access from now runs `hook` inside the device, holding its lock.
pub fn arm_fault_hook(after: u64, hook: fn()) {
    FAULT.arm(after, hook);
}

/// Marks one device access on this thread for the duration of `f`.
fn access<R>(f: impl FnOnce() -> R) -> R {
    let depth = ACCESS_DEPTH.with(|d| {
        let v = d.get();
        d.set(v + 1);
        v
    });
    assert!(depth == 0, "device access nested {depth} deep on one thread");
    let r = f();
    ACCESS_DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
    r
}

impl Bus {
    pub fn new() -> Self {
        Self {
            entries: BTreeMap::new(),
            unclaimed: Some(Lock::new("bus.unclaimed", UnclaimedStats::default())),
        }
    }

    fn unclaimed_stats(&self) -> Option<Guard<'_, UnclaimedStats>> {
        self.unclaimed.as_ref().map(|u| u.lock())
    }

    /// Places `dev` at `[base, base + len)`.
    pub fn insert(&mut self, base: u64, len: u64, dev: SharedDevice) -> Result<(), BusError> {
        let name = lock(&dev).name().to_string();
        if len == 0 {
            return Err(BusError::Empty(name));
        }
        let end = base.saturating_add(len);
        if let Some((&b, e)) = self.entries.range(..end).next_back() {
            if b.saturating_add(e.len) > base {
                let other = lock(&e.dev).name().to_string();
                return Err(BusError::Overlap { name, base, len, other });
            }
        }
        self.entries.insert(base, Entry { len, dev });
        Ok(())
    }

    fn find(&self, addr: u64, size: usize) -> Option<(u64, &Entry)> {
        let (&base, e) = self.entries.range(..=addr).next_back()?;
        let off = addr - base;
        (off.checked_add(size as u64)? <= e.len).then_some((off, e))
    }

    /// Reads from the device at `addr`; unclaimed reads return all ones.
    /// Returns whether a device claimed the access.
    pub fn read(&self, cpu: usize, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((off, e)) => {
                access(|| {
                    let mut d = lock(&e.dev);
                    FAULT.pass();
                    d.read(cpu, off, data)
                });
                true
            }
            None => {
                data.fill(0xff);
                if let Some(mut u) = self.unclaimed_stats() {
                    u.reads += 1;
                    u.last_addr = addr;
                }
                false
            }
        }
    }

    /// Writes to the device at `addr`; unclaimed writes are dropped.
    pub fn write(&self, cpu: usize, addr: u64, data: &[u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((off, e)) => {
                access(|| {
                    let mut d = lock(&e.dev);
                    FAULT.pass();
                    d.write(cpu, off, data)
                });
                true
            }
            None => {
                if let Some(mut u) = self.unclaimed_stats() {
                    u.writes += 1;
                    u.last_addr = addr;
                }
                false
            }
        }
    }

    /// Accesses no device claimed (wild port I/O or MMIO from the guest).
    pub fn unclaimed(&self) -> UnclaimedStats {
        self.unclaimed_stats().map(|u| *u).unwrap_or_default()
    }

    /// Saves every device's state.
    pub fn save(&self) -> Vec<DeviceState> {
        self.entries
            .iter()
            .map(|(&base, e)| {
                let d = lock(&e.dev);
                DeviceState { name: d.name().to_string(), base, state: d.save() }
            })
            .collect()
    }

    /// Restores device states saved by [`Bus::save`] on a bus of the same shape.
    /// Every state is checked against its device before any is applied, and
    /// every device must have exactly one state: a state left out would leave
    /// that device as it is, not as it was saved.
    pub fn restore(&self, states: &[DeviceState]) -> Result<(), BusError> {
        let mut targets = Vec::new();
        let mut seen = std::collections::BTreeSet::new();
        for s in states {
            if !seen.insert(s.base) {
                return Err(BusError::DuplicateDevice { name: s.name.clone(), base: s.base });
            }
            let e = self
                .entries
                .get(&s.base)
                .filter(|e| lock(&e.dev).name() == s.name)
                .ok_or_else(|| BusError::UnknownDevice(s.name.clone()))?;
            targets.push((e, s));
        }
        if let Some((&base, e)) = self.entries.iter().find(|(b, _)| !seen.contains(*b)) {
            return Err(BusError::MissingDevice { name: lock(&e.dev).name().to_string(), base });
        }
        // Validate by restoring into the live device only after a dry run on
        // its current state succeeds for all: save old states to roll back.
        let old: Vec<_> = targets.iter().map(|(e, _)| lock(&e.dev).save()).collect();
        for (i, (e, s)) in targets.iter().enumerate() {
            if let Err(err) = lock(&e.dev).restore(&s.state) {
                for ((e, _), o) in targets.iter().zip(&old).take(i) {
                    let _ = lock(&e.dev).restore(o);
                }
                return Err(err);
            }
        }
        Ok(())
    }
}

/// Decodes a little-endian access of 1, 2, 4 or 8 bytes.
pub fn le_value(data: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    let n = data.len().min(8);
    b[..n].copy_from_slice(&data[..n]);
    u64::from_le_bytes(b)
}

/// Encodes `v` little-endian into an access of `data.len()` bytes.
pub fn put_le_value(data: &mut [u8], v: u64) {
    let b = v.to_le_bytes();
    let n = data.len().min(8);
    data[..n].copy_from_slice(&b[..n]);
    data[n..].fill(0);
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Reg {
        name: &'static str,
        v: u64,
    }
    impl Device for Reg {
        fn name(&self) -> &str {
            self.name
        }
        fn read(&mut self, _cpu: usize, _off: u64, data: &mut [u8]) {
            put_le_value(data, self.v)
        }
        fn write(&mut self, _cpu: usize, _off: u64, data: &[u8]) {
            self.v = le_value(data)
        }
        fn save(&self) -> serde_json::Value {
            serde_json::json!(self.v)
        }
        fn restore(&mut self, s: &serde_json::Value) -> Result<(), BusError> {
            self.v = s
                .as_u64()
                .ok_or(BusError::BadState { name: self.name.into(), why: "not a number".into() })?;
            Ok(())
        }
    }

    fn reg(name: &'static str) -> SharedDevice {
        Lock::new("test.reg", Reg { name, v: 0 })
    }

    #[test]
    fn routes_and_rejects_overlaps() {
        let mut bus = Bus::new();
        bus.insert(0x100, 0x10, reg("a")).unwrap();
        bus.insert(0x110, 0x10, reg("b")).unwrap();
        assert!(matches!(bus.insert(0x10f, 2, reg("c")), Err(BusError::Overlap { .. })));
        assert!(matches!(bus.insert(0xf8, 0x10, reg("c")), Err(BusError::Overlap { .. })));
        assert!(bus.write(0, 0x104, &7u32.to_le_bytes()));
        let mut d = [0u8; 4];
        assert!(bus.read(0, 0x100, &mut d));
        assert_eq!(u32::from_le_bytes(d), 7);
        // Straddling the end of a device, or nothing there: unclaimed, all ones.
        assert!(!bus.read(0, 0x10e, &mut d));
        assert_eq!(d, [0xff; 4]);
        assert!(!bus.write(0, 0x5000, &[1]));
        assert_eq!(bus.unclaimed().reads, 1);
        assert_eq!(bus.unclaimed().writes, 1);
    }

    #[test]
    fn save_restore_round_trip_and_bad_state_changes_nothing() {
        let mut bus = Bus::new();
        bus.insert(0x100, 8, reg("a")).unwrap();
        bus.insert(0x200, 8, reg("b")).unwrap();
        bus.write(0, 0x100, &[5]);
        bus.write(0, 0x200, &[6]);
        let saved = bus.save();
        bus.write(0, 0x100, &[9]);
        bus.restore(&saved).unwrap();
        let mut d = [0u8; 1];
        bus.read(0, 0x100, &mut d);
        assert_eq!(d[0], 5);
        let mut bad = saved.clone();
        bad[1].state = serde_json::json!("x");
        bus.write(0, 0x100, &[1]);
        assert!(bus.restore(&bad).is_err());
        bus.read(0, 0x100, &mut d);
        assert_eq!(d[0], 1, "a failed restore must leave devices as they were");
        bad[1].name = "zz".into();
        assert!(matches!(bus.restore(&bad), Err(BusError::UnknownDevice(_))));
    }

    #[test]
    fn a_missing_or_repeated_device_state_is_refused_by_name() {
        let mut bus = Bus::new();
        bus.insert(0x100, 8, reg("a")).unwrap();
        bus.insert(0x200, 8, reg("b")).unwrap();
        bus.write(0, 0x200, &[6]);
        let saved = bus.save();
        bus.write(0, 0x200, &[9]);
        let e = bus.restore(&saved[..1]).unwrap_err();
        assert!(matches!(&e, BusError::MissingDevice { name, base: 0x200 } if name == "b"), "{e}");
        assert!(e.to_string().contains("no state for device b at 0x200"), "{e}");
        let mut d = [0u8; 1];
        bus.read(0, 0x200, &mut d);
        assert_eq!(d[0], 9, "a refused restore changes nothing");
        let twice = vec![saved[0].clone(), saved[0].clone(), saved[1].clone()];
        assert!(matches!(bus.restore(&twice), Err(BusError::DuplicateDevice { base: 0x100, .. })));
    }
}
