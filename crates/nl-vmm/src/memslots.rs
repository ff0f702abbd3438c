//! Registering guest RAM with KVM: the one unsafe step of building a VM.

use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::VmFd;

use crate::error::{kvm, VmmError};

/// Registers a memory slot. The caller guarantees the host range stays mapped
/// for the VM's lifetime: `Vm` declares its `VmFd` before its `GuestMemory`,
/// so the VM is torn down before the mapping.
pub(crate) fn set_region(vm: &VmFd, region: kvm_userspace_memory_region) -> Result<(), VmmError> {
    // SAFETY: userspace_addr..+memory_size is a live MAP_SHARED mapping owned by the Vm.
    unsafe { vm.set_user_memory_region(region) }.map_err(kvm("KVM_SET_USER_MEMORY_REGION"))
}
