//! The ninelives device model.
//!
//! * [`bus`]: address-range routing of port I/O and MMIO to devices; every
//!   device's state can be saved to and restored from JSON.
//! * [`control`]: the paravirtual control device the reference guest reports
//!   through (heartbeat, phase, result digest, errors).
//! * [`echo`]: the port-I/O target of the `exits` workload.
//! * [`i8042`]: the keyboard controller's CPU reset (a Linux guest's reboot).
//! * [`serial`]: the 16550 console (vm-superio) and the console sink.

pub mod bus;
pub mod control;
pub mod echo;
pub mod i8042;
pub mod packet;
pub mod serial;
pub mod tap;

pub use bus::{Bus, BusError, Device, DeviceState};
pub mod virtio;
