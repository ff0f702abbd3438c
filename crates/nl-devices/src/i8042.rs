//! The i8042 keyboard controller, only for its CPU-reset command: a Linux
//! guest booted with `reboot=k` resets through it, and the VMM ends the VM
//! (as Firecracker does). vm-superio's device does the decoding.

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use vm_superio::{I8042Device, Trigger};

use crate::bus::{BusError, Device};

/// Ports 0x60..0x65: data at offset 0, command/status at offset 4.
pub const I8042_PORT: u64 = 0x60;
pub const I8042_LEN: u64 = 5;

/// Set when the guest asked for a reset; the VMM polls it.
#[derive(Clone, Default)]
pub struct ResetFlag(Arc<AtomicBool>);

impl ResetFlag {
    pub fn requested(&self) -> bool {
        self.0.load(SeqCst)
    }
}

impl Trigger for ResetFlag {
    type E = std::convert::Infallible;
    fn trigger(&self) -> Result<(), Self::E> {
        self.0.store(true, SeqCst);
        Ok(())
    }
}

#[derive(Serialize, Deserialize)]
struct I8042State {
    reset_requested: bool,
}

pub struct I8042 {
    dev: I8042Device<ResetFlag>,
}

impl I8042 {
    /// The controller and the flag its reset command sets.
    pub fn new() -> (Self, ResetFlag) {
        let flag = ResetFlag::default();
        (Self { dev: I8042Device::new(flag.clone()) }, flag)
    }
}

impl Device for I8042 {
    fn name(&self) -> &str {
        "i8042"
    }
    fn read(&mut self, _cpu: usize, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if let Some(d) = data.first_mut() {
            *d = self.dev.read(offset as u8);
        }
    }
    fn write(&mut self, _cpu: usize, offset: u64, data: &[u8]) {
        if let Some(&b) = data.first() {
            let _ = self.dev.write(offset as u8, b);
        }
    }
    fn save(&self) -> serde_json::Value {
        serde_json::to_value(I8042State { reset_requested: self.dev.reset_evt().requested() })
            .expect("plain struct")
    }
    fn restore(&mut self, state: &serde_json::Value) -> Result<(), BusError> {
        let s: I8042State = serde_json::from_value(state.clone())
            .map_err(|e| BusError::BadState { name: "i8042".into(), why: e.to_string() })?;
        self.dev.reset_evt().0.store(s.reset_requested, SeqCst);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_command_sets_the_flag_and_state_round_trips() {
        let (mut d, flag) = I8042::new();
        d.write(0, 4, &[0xfd]);
        d.write(0, 0, &[0xfe]);
        assert!(!flag.requested(), "only 0xfe on the command port resets");
        let clean = d.save();
        d.write(0, 4, &[0xfe]);
        assert!(flag.requested());
        let reset = d.save();
        d.restore(&clean).unwrap();
        assert!(!flag.requested());
        d.restore(&reset).unwrap();
        assert!(flag.requested());
        assert!(d.restore(&serde_json::json!({"x": 1})).is_err());
    }
}
