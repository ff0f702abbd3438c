//! KVM dirty-log control beyond kvm-ioctls: manual re-protection
//! (KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2 and KVM_CLEAR_DIRTY_LOG).
//!
//! With manual protection on, KVM_GET_DIRTY_LOG only reports dirty pages; it
//! no longer clears the log or write-protects them. The VMM then re-protects
//! exactly the pages it chooses with KVM_CLEAR_DIRTY_LOG (the paper's
//! selective re-protection).

use std::os::fd::AsRawFd;

use kvm_bindings::{kvm_clear_dirty_log, kvm_enable_cap, KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2};
use kvm_ioctls::VmFd;

use crate::error::{kvm, VmmError};

/// KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE (without KVM_DIRTY_LOG_INITIALLY_SET).
const MANUAL_PROTECT_ENABLE: u64 = 1;
/// _IOWR(KVMIO, 0xc0, struct kvm_clear_dirty_log) (24 bytes).
const KVM_CLEAR_DIRTY_LOG: libc::c_ulong = 0xC018_AEC0;

/// Turns manual dirty-log protection on for the VM.
pub(crate) fn enable_manual_protect(vm: &VmFd) -> Result<(), VmmError> {
    let mut cap = kvm_enable_cap { cap: KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2, ..Default::default() };
    cap.args[0] = MANUAL_PROTECT_ENABLE;
    vm.enable_cap(&cap).map_err(kvm("KVM_ENABLE_CAP(MANUAL_DIRTY_LOG_PROTECT2)"))
}

/// Clears (and write-protects again) the pages of `slot` whose bits are set
/// in `bitmap` (bit i = page i of the slot), `num_pages` pages in all.
pub(crate) fn clear_dirty_log(
    vm: &VmFd,
    slot: u32,
    num_pages: u32,
    bitmap: &[u64],
) -> Result<(), VmmError> {
    if (bitmap.len() as u64) * 64 < u64::from(num_pages) {
        return Err(VmmError::State(format!(
            "dirty bitmap of {} words is too short for {num_pages} pages",
            bitmap.len()
        )));
    }
    let mut arg = kvm_clear_dirty_log { slot, num_pages, first_page: 0, ..Default::default() };
    arg.__bindgen_anon_1.dirty_bitmap = bitmap.as_ptr() as *mut libc::c_void;
    // SAFETY: `arg` is a valid kvm_clear_dirty_log whose bitmap covers num_pages bits (checked above); KVM only reads it.
    let r = unsafe { libc::ioctl(vm.as_raw_fd(), KVM_CLEAR_DIRTY_LOG as _, &arg) };
    if r < 0 {
        return Err(VmmError::State(format!(
            "KVM_CLEAR_DIRTY_LOG on slot {slot}: {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}
