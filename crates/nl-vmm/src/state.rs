//! vCPU, device and VM state as versioned, serializable data.
//!
//! This is what pause → save → restore moves around: checkpoints, warm
//! reboot, microreboot and replication all use these types. Guest memory is
//! not part of it; it stays in the memfd.

use kvm_bindings::{
    kvm_clock_data, kvm_irqchip, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_pit_state2,
    kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave, Msrs, KVM_IRQCHIP_IOAPIC,
    KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
};
use kvm_ioctls::{VcpuFd, VmFd};
use nl_abi::WorkloadParams;
use nl_arch::regs::SAVED_MSRS;
use nl_devices::DeviceState;
use serde::{Deserialize, Serialize};

use crate::error::{kvm, VmmError};

/// Version of the serialized [`VmState`]; bumped on incompatible change.
pub const STATE_VERSION: u32 = 1;

/// Everything KVM holds for one vCPU.
#[derive(Serialize, Deserialize)]
pub struct VcpuState {
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    pub xsave: kvm_xsave,
    pub xcrs: kvm_xcrs,
    pub msrs: Vec<kvm_msr_entry>,
    pub lapic: kvm_lapic_state,
    pub mp_state: kvm_mp_state,
    pub events: kvm_vcpu_events,
}

/// Reads the MSRs in [`SAVED_MSRS`] that this KVM backend supports.
fn read_msrs(fd: &VcpuFd) -> Result<Vec<kvm_msr_entry>, VmmError> {
    let entries: Vec<_> =
        SAVED_MSRS.iter().map(|&index| kvm_msr_entry { index, ..Default::default() }).collect();
    let mut msrs = Msrs::from_entries(&entries).map_err(|e| VmmError::State(format!("{e:?}")))?;
    let n = fd.get_msrs(&mut msrs).map_err(kvm("KVM_GET_MSRS"))?;
    if n == entries.len() {
        return Ok(msrs.as_slice().to_vec());
    }
    // Some MSR is not supported here: keep those that read one by one.
    let mut out = Vec::new();
    for e in entries {
        let mut one = Msrs::from_entries(&[e]).map_err(|e| VmmError::State(format!("{e:?}")))?;
        if fd.get_msrs(&mut one).map_err(kvm("KVM_GET_MSRS"))? == 1 {
            out.push(one.as_slice()[0]);
        }
    }
    Ok(out)
}

impl VcpuState {
    /// Saves a vCPU that is not running (its thread is parked).
    pub fn save(fd: &VcpuFd) -> Result<Self, VmmError> {
        Ok(Self {
            regs: fd.get_regs().map_err(kvm("KVM_GET_REGS"))?,
            sregs: fd.get_sregs().map_err(kvm("KVM_GET_SREGS"))?,
            xsave: fd.get_xsave().map_err(kvm("KVM_GET_XSAVE"))?,
            xcrs: fd.get_xcrs().map_err(kvm("KVM_GET_XCRS"))?,
            msrs: read_msrs(fd)?,
            lapic: fd.get_lapic().map_err(kvm("KVM_GET_LAPIC"))?,
            mp_state: fd.get_mp_state().map_err(kvm("KVM_GET_MP_STATE"))?,
            events: fd.get_vcpu_events().map_err(kvm("KVM_GET_VCPU_EVENTS"))?,
        })
    }

    /// Loads this state into a vCPU that is not running.
    pub fn restore(&self, fd: &VcpuFd) -> Result<(), VmmError> {
        fd.set_sregs(&self.sregs).map_err(kvm("KVM_SET_SREGS"))?;
        fd.set_regs(&self.regs).map_err(kvm("KVM_SET_REGS"))?;
        // SAFETY: the buffer came from KVM_GET_XSAVE (legacy 4 KiB layout), the size KVM_SET_XSAVE reads.
        unsafe { fd.set_xsave(&self.xsave) }.map_err(kvm("KVM_SET_XSAVE"))?;
        fd.set_xcrs(&self.xcrs).map_err(kvm("KVM_SET_XCRS"))?;
        fd.set_lapic(&self.lapic).map_err(kvm("KVM_SET_LAPIC"))?;
        let msrs = Msrs::from_entries(&self.msrs).map_err(|e| VmmError::State(format!("{e:?}")))?;
        let n = fd.set_msrs(&msrs).map_err(kvm("KVM_SET_MSRS"))?;
        if n != self.msrs.len() {
            let bad = self.msrs.get(n).map_or(0, |m| m.index);
            return Err(VmmError::State(format!("KVM refused saved MSR {bad:#x}")));
        }
        fd.set_mp_state(self.mp_state).map_err(kvm("KVM_SET_MP_STATE"))?;
        fd.set_vcpu_events(&self.events).map_err(kvm("KVM_SET_VCPU_EVENTS"))?;
        Ok(())
    }
}

/// In-kernel interrupt controllers, clock and PIT of a VM.
#[derive(Clone, Serialize, Deserialize)]
pub struct IrqchipState {
    pub chips: Vec<kvm_irqchip>,
    pub clock: Option<kvm_clock_data>,
    /// The in-kernel PIT (i8254, `KVM_GET_PIT2`) of a VM that has one (a
    /// Linux VM: its channel 0 is the kernel's early timer). Absent for the
    /// reference guest, and in the records and checkpoint files of older
    /// processes, which still read: the PIT then keeps its fresh state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pit: Option<kvm_pit_state2>,
}

impl IrqchipState {
    /// Saves the VM's in-kernel chips; `pit`: the VM has an in-kernel PIT
    /// (`KVM_CREATE_PIT2`), whose state is saved too.
    pub fn save(vm: &VmFd, pit: bool) -> Result<Self, VmmError> {
        let mut chips = Vec::new();
        for id in [KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, KVM_IRQCHIP_IOAPIC] {
            let mut c = kvm_irqchip { chip_id: id, ..Default::default() };
            vm.get_irqchip(&mut c).map_err(kvm("KVM_GET_IRQCHIP"))?;
            chips.push(c);
        }
        // The clock is optional: not every backend exposes kvmclock control.
        let clock = vm.get_clock().ok();
        let pit = if pit { Some(vm.get_pit2().map_err(kvm("KVM_GET_PIT2"))?) } else { None };
        Ok(Self { chips, clock, pit })
    }

    pub fn restore(&self, vm: &VmFd) -> Result<(), VmmError> {
        for c in &self.chips {
            vm.set_irqchip(c).map_err(kvm("KVM_SET_IRQCHIP"))?;
        }
        if let Some(pit) = &self.pit {
            vm.set_pit2(pit).map_err(kvm("KVM_SET_PIT2 (the saved state has a PIT)"))?;
        }
        if let Some(mut clock) = self.clock {
            clock.flags = 0;
            // Best effort, as in save.
            let _ = vm.set_clock(&clock);
        }
        Ok(())
    }
}

/// The complete non-memory state of a VM.
#[derive(Serialize, Deserialize)]
pub struct VmState {
    pub version: u32,
    pub mem_bytes: u64,
    pub num_vcpus: u32,
    pub timer_hz: u64,
    pub workload: WorkloadParams,
    pub vcpus: Vec<VcpuState>,
    pub irqchip: IrqchipState,
    pub io_devices: Vec<DeviceState>,
    pub mmio_devices: Vec<DeviceState>,
}

impl VmState {
    /// Serializes to bytes (JSON, so a state file can be inspected).
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("VM state serializes")
    }

    /// Parses bytes written by [`VmState::to_bytes`], refusing other versions.
    pub fn from_bytes(b: &[u8]) -> Result<Self, VmmError> {
        #[derive(Deserialize)]
        struct Version {
            version: u32,
        }
        let v: Version = serde_json::from_slice(b)
            .map_err(|e| VmmError::State(format!("not a ninelives VM state: {e}")))?;
        if v.version != STATE_VERSION {
            return Err(VmmError::State(format!(
                "state version {} is not supported by this binary (it reads version {STATE_VERSION})",
                v.version
            )));
        }
        let s: Self = serde_json::from_slice(b)
            .map_err(|e| VmmError::State(format!("corrupt VM state: {e}")))?;
        if s.vcpus.len() != s.num_vcpus as usize {
            return Err(VmmError::State(format!(
                "corrupt VM state: {} vCPU states for {} vCPUs",
                s.vcpus.len(),
                s.num_vcpus
            )));
        }
        Ok(s)
    }
}
