//! The `exits` workload's port-I/O target: a 32-bit `out` stores a value per
//! vCPU, an `in` returns it with every bit inverted.

use serde::{Deserialize, Serialize};

use crate::bus::{le_value, put_le_value, BusError, Device};

#[derive(Default, Serialize, Deserialize)]
pub struct EchoPort {
    last: Vec<u32>,
}

impl EchoPort {
    pub fn new(num_vcpus: usize) -> Self {
        Self { last: vec![0; num_vcpus] }
    }
}

impl Device for EchoPort {
    fn name(&self) -> &str {
        "echo"
    }
    fn read(&mut self, cpu: usize, _offset: u64, data: &mut [u8]) {
        put_le_value(data, u64::from(!self.last.get(cpu).copied().unwrap_or(0)));
    }
    fn write(&mut self, cpu: usize, _offset: u64, data: &[u8]) {
        if let Some(l) = self.last.get_mut(cpu) {
            *l = le_value(data) as u32;
        }
    }
    fn save(&self) -> serde_json::Value {
        serde_json::to_value(&self.last).expect("Vec<u32> serializes")
    }
    fn restore(&mut self, state: &serde_json::Value) -> Result<(), BusError> {
        let last: Vec<u32> = serde_json::from_value(state.clone())
            .map_err(|e| BusError::BadState { name: "echo".into(), why: e.to_string() })?;
        if last.len() != self.last.len() {
            return Err(BusError::BadState {
                name: "echo".into(),
                why: "vCPU count differs".into(),
            });
        }
        self.last = last;
        Ok(())
    }
}
