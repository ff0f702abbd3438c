//! Memory windows a VM maps beside its RAM: the shared regions of sandbox
//! channels, each read-write or read-only (`KVM_MEM_READONLY`), and the
//! guard that turns a guest write to a read-only window into a violation
//! report.
//!
//! On every backend a write to a read-only memory slot exits to the VMM as
//! an MMIO write. [`WriteGuard`] is asked about each such exit that falls
//! inside a read-only window, with the vCPU's RIP, before the MMIO bus sees
//! it; the guest's write is dropped either way.

use std::sync::Arc;

use kvm_bindings::{kvm_userspace_memory_region, KVM_MEM_READONLY};
use kvm_ioctls::{IoEventAddress, NoDatamatch, VmFd};
use nl_abi::ChannelWindow;
use vmm_sys_util::eventfd::EventFd;

use crate::error::VmmError;

/// One window: `size` bytes of host memory at `host_addr` shown to the
/// guest at `gpa`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Window {
    pub gpa: u64,
    pub size: u64,
    /// Start of a host mapping that stays mapped at least as long as the
    /// VM: its owner is in [`VmWindows::keep`].
    pub host_addr: u64,
    pub readonly: bool,
}

/// One end of a channel doorbell (see [`nl_abi::channel_doorbell_gpa`]).
/// The sender's VM registers the eventfd as an ioeventfd, the receiver's
/// as an irqfd on [`nl_abi::DOORBELL_GSI`]: KVM carries the ring from one
/// VM to the other without either VMM.
#[derive(Clone, Debug)]
pub enum Doorbell {
    /// A guest write at `gpa` (any length) signals `fd`.
    Ring { gpa: u64, fd: Arc<EventFd> },
    /// `fd` raises [`nl_abi::DOORBELL_VECTOR`] on vCPU 0.
    Irq { fd: Arc<EventFd> },
}

/// A write a guest made to a read-only window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Violation {
    pub cpu: usize,
    pub gpa: u64,
    pub rip: u64,
    /// Bytes the write instruction tried to store.
    pub len: usize,
}

/// What the vCPU does after a violation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuardAction {
    /// Drop the write and let the guest run on.
    Continue,
    /// Stop the vCPU: it ends with [`nl_abi::ERR_CHANNEL_VIOLATION`]
    /// (ERROR_INFO = the address) as a guest error.
    Stop,
}

/// Receives the violations of one VM (a sandbox's monitor).
pub trait WriteGuard: Send + Sync {
    fn violation(&self, v: Violation) -> GuardAction;
}

/// Everything a VM maps beyond its own RAM.
#[derive(Clone, Default)]
pub struct VmWindows {
    pub windows: Vec<Window>,
    /// Owners of the host mappings behind `windows`; dropped after the VM fd.
    pub keep: Vec<Arc<dyn Send + Sync>>,
    /// Written into [`nl_abi::BootInfo::channels`].
    pub channels: Vec<ChannelWindow>,
    /// [`nl_abi::BootInfo::sandbox`].
    pub sandbox: u64,
    pub guard: Option<Arc<dyn WriteGuard>>,
    /// Doorbells rung by this VM and doorbells ringing into it.
    pub doorbells: Vec<Doorbell>,
    /// A service's state region: (gpa, size) mapped in the guest page
    /// tables and named in the boot info, with no memory slot until
    /// [`crate::Vm::map_state`] (only the service's holder has one).
    pub state: Option<(u64, u64)>,
}

impl std::fmt::Debug for VmWindows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmWindows")
            .field("windows", &self.windows)
            .field("channels", &self.channels)
            .field("sandbox", &self.sandbox)
            .field("doorbells", &self.doorbells)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl VmWindows {
    /// Checks the windows against each other and the guest layout.
    pub fn validate(&self) -> Result<(), String> {
        if self.channels.len() > nl_abi::MAX_CHANNELS {
            return Err(format!(
                "{} channels: at most {} per sandbox",
                self.channels.len(),
                nl_abi::MAX_CHANNELS
            ));
        }
        for (i, w) in self.windows.iter().enumerate() {
            let end = w.gpa.checked_add(w.size).ok_or("window past the address space")?;
            if w.size == 0 || !w.gpa.is_multiple_of(4096) || !w.size.is_multiple_of(4096) {
                return Err(format!("window {:#x}+{:#x} is not page aligned", w.gpa, w.size));
            }
            if w.gpa < nl_abi::MMIO_HOLE_START || end > nl_abi::CONTROL_MMIO_GPA {
                return Err(format!(
                    "window {:#x}+{:#x} is outside the channel area of the MMIO hole",
                    w.gpa, w.size
                ));
            }
            for o in &self.windows[..i] {
                if w.gpa < o.gpa + o.size && o.gpa < end {
                    return Err(format!("windows at {:#x} and {:#x} overlap", o.gpa, w.gpa));
                }
            }
        }
        if let Some((gpa, size)) = self.state {
            if gpa != nl_abi::STATE_REGION_GPA
                || size == 0
                || size > nl_abi::MAX_STATE_BYTES
                || !size.is_multiple_of(2 << 20)
            {
                return Err(format!(
                    "state region {gpa:#x}+{size:#x}: it must be at {:#x}, a multiple of 2 MiB, at most {} MiB",
                    nl_abi::STATE_REGION_GPA,
                    nl_abi::MAX_STATE_BYTES >> 20
                ));
            }
        }
        for d in &self.doorbells {
            if let Doorbell::Ring { gpa, .. } = d {
                let area = nl_abi::DOORBELLS_GPA..nl_abi::DOORBELLS_GPA + nl_abi::DOORBELLS_BYTES;
                if !area.contains(gpa) {
                    return Err(format!("doorbell {gpa:#x} is outside the doorbell area"));
                }
            }
        }
        Ok(())
    }

    /// The guest-physical ranges the guest page tables map user-writable:
    /// every window, and the doorbell area when a doorbell is rung from here.
    pub fn user_ranges(&self) -> Vec<(u64, u64)> {
        let mut v: Vec<(u64, u64)> = self.windows.iter().map(|w| (w.gpa, w.size)).collect();
        if self.doorbells.iter().any(|d| matches!(d, Doorbell::Ring { .. })) {
            v.push((nl_abi::DOORBELLS_GPA, nl_abi::DOORBELLS_BYTES));
        }
        v.extend(self.state);
        v
    }

    /// The read-only window holding `gpa`, if any.
    pub fn readonly_at(&self, gpa: u64) -> bool {
        self.windows.iter().any(|w| w.readonly && gpa >= w.gpa && gpa - w.gpa < w.size)
    }

    /// Registers the windows as memory slots `first_slot..`.
    pub(crate) fn register(&self, vm: &VmFd, first_slot: u32) -> Result<(), VmmError> {
        for (i, w) in self.windows.iter().enumerate() {
            let r = kvm_userspace_memory_region {
                slot: first_slot + i as u32,
                flags: if w.readonly { KVM_MEM_READONLY } else { 0 },
                guest_phys_addr: w.gpa,
                memory_size: w.size,
                userspace_addr: w.host_addr,
            };
            crate::memslots::set_region(vm, r)?;
        }
        self.register_doorbells(vm)
    }

    /// Registers the doorbells with KVM (the VM's in-kernel irqchip exists;
    /// [`VmWindows::rung_into`] says whether [`nl_abi::DOORBELL_GSI`] needs
    /// its route, set with the VM's others: `crate::irq_routes`).
    fn register_doorbells(&self, vm: &VmFd) -> Result<(), VmmError> {
        let err = |what: &'static str| {
            move |e: kvm_ioctls::Error| VmmError::Config(format!("doorbell: {what} failed: {e}"))
        };
        for d in &self.doorbells {
            match d {
                Doorbell::Ring { gpa, fd } => vm
                    .register_ioevent(fd.as_ref(), &IoEventAddress::Mmio(*gpa), NoDatamatch)
                    .map_err(err("KVM_IOEVENTFD"))?,
                Doorbell::Irq { fd } => vm
                    .register_irqfd(fd.as_ref(), nl_abi::DOORBELL_GSI)
                    .map_err(err("KVM_IRQFD"))?,
            }
        }
        Ok(())
    }

    /// Whether a doorbell rings into this VM.
    pub(crate) fn rung_into(&self) -> bool {
        self.doorbells.iter().any(|d| matches!(d, Doorbell::Irq { .. }))
    }
}

impl VmWindows {
    /// Reports a write by vCPU `cpu` at `gpa` (in a read-only window, see
    /// [`VmWindows::readonly_at`]) and returns what the vCPU does.
    pub(crate) fn violation(&self, cpu: usize, gpa: u64, len: usize, rip: u64) -> GuardAction {
        let v = Violation { cpu, gpa, rip, len };
        match &self.guard {
            Some(g) => g.violation(v),
            None => GuardAction::Stop,
        }
    }
}
