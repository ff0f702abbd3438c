//! A service's state region (remote recovery, Quest-V): one memfd, mapped
//! once in the VMM, that only the service's current holder has a memory
//! slot for (read-write, at [`nl_abi::STATE_REGION_GPA`]). The standby's
//! VM has the range in its guest page tables and its boot info but no slot
//! behind it: it cannot reach the region until a takeover moves the slot
//! to it ([`StateRegion::map_into`], after [`StateRegion::release_stopped`]
//! took it from the failed holder, whose stopped VM, never run again, keeps
//! its slot until it is released). So the region is writable in at most
//! one running sandbox at any time, which [`StateRegion::map_into`]
//! enforces.
//!
//! A warm rejuvenation or a microreboot carries the region: its memfd,
//! the sandbox that has the slot and the size go into the set's handover
//! record, and the new process maps the same memfd
//! ([`StateRegion::over_file`]) and gives the slot to the same sandbox's
//! rebuilt VM before it runs. Nothing is copied.
//!
//! The kv service keeps its table there (`nl_workloads::kv`: entries with
//! a CRC, a journal): the sandbox that takes the service over loads it,
//! replays a torn update, drops and counts corrupt entries, and every
//! write it acknowledged before is still there (a PUT's `OK` is queued only
//! after the entry is in the region).

use std::sync::Arc;

use nix::sys::memfd::{memfd_create, MemFdCreateFlag};
use nl_sync::Lock;
use nl_vmm::Vm;
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestRegionMmap, MemoryRegionAddress};

use crate::audit::{Backing, Mapping};
use crate::SandboxError;

/// One service's state region.
pub struct StateRegion {
    pub service: String,
    pub bytes: u64,
    backing: Backing,
    map: Arc<GuestRegionMmap>,
    /// The sandbox whose VM has the slot now.
    mapped_in: Arc<Lock<Option<usize>>>,
}

/// A state region's size, checked: whole 2 MiB pages (the guest maps it
/// with 2 MiB page-table entries), at most [`nl_abi::MAX_STATE_BYTES`].
pub fn check_size(mib: u64) -> Result<u64, String> {
    let max = nl_abi::MAX_STATE_BYTES >> 20;
    if mib == 0 || mib > max || !mib.is_multiple_of(2) {
        return Err(format!("state.mib {mib}: an even number of MiB in 2..={max}"));
    }
    Ok(mib << 20)
}

impl StateRegion {
    /// Creates the zeroed memfd and maps it in the VMM.
    pub fn create(service: &str, bytes: u64) -> Result<Self, SandboxError> {
        let err = |what: &str, e: String| {
            SandboxError::Resource(format!("service '{service}': state region: {what}: {e}"))
        };
        let name = std::ffi::CString::new(format!("state-{service}"))
            .map_err(|_| SandboxError::Config(format!("service name '{service}' has a NUL")))?;
        let fd = memfd_create(&name, MemFdCreateFlag::MFD_CLOEXEC)
            .map(std::fs::File::from)
            .map_err(|e| err("cannot create its memfd", e.to_string()))?;
        fd.set_len(bytes).map_err(|e| err("cannot size its memfd", e.to_string()))?;
        Self::mapped(service, fd, bytes, |e| err("cannot map its memfd", e))
    }

    /// The region over memfd `fd` of `bytes`, mapped in the VMM, with no
    /// sandbox holding its slot; `map_err` words a failed mapping.
    fn mapped(
        service: &str,
        fd: std::fs::File,
        bytes: u64,
        map_err: impl FnOnce(String) -> SandboxError,
    ) -> Result<Self, SandboxError> {
        let backing = Backing::of(&fd)?;
        let map = GuestRegionMmap::from_range(
            GuestAddress(0),
            bytes as usize,
            Some(FileOffset::new(fd, 0)),
        )
        .map_err(|e| map_err(e.to_string()))?;
        Ok(Self {
            service: service.into(),
            bytes,
            backing,
            map: Arc::new(map),
            mapped_in: Lock::new("sandbox.state", None),
        })
    }

    /// A region over an inherited memfd (a set carried to a new VMM
    /// process: [`crate::handover`]), checked to be a memfd (a shmem file:
    /// `F_GET_SEALS` answers only for those) of exactly `bytes`, mapped in
    /// the VMM. No sandbox has its slot yet ([`StateRegion::map_into`]).
    pub fn over_file(service: &str, fd: std::fs::File, bytes: u64) -> Result<Self, SandboxError> {
        use std::os::fd::AsRawFd;
        let bad = |m: String| {
            SandboxError::Resource(format!("service '{service}': inherited state region: {m}"))
        };
        nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_GET_SEALS)
            .map_err(|e| bad(format!("not a memfd ({e})")))?;
        let len = fd.metadata().map_err(|e| bad(format!("cannot stat it: {e}")))?.len();
        if len != bytes {
            return Err(bad(format!("{len} bytes, the service's region has {bytes}")));
        }
        Self::mapped(service, fd, bytes, |e| bad(format!("cannot map it: {e}")))
    }

    /// Its memfd (named in a handover record).
    pub fn file(&self) -> Option<&std::fs::File> {
        use vm_memory::GuestMemoryRegion;
        self.map.file_offset().map(|f| f.file())
    }

    /// The VM windows' entry for it: (gpa, size).
    pub fn window(&self) -> (u64, u64) {
        (nl_abi::STATE_REGION_GPA, self.bytes)
    }

    /// Keeps the host mapping alive as long as a VM may have a slot over it.
    pub fn keepalive(&self) -> Arc<dyn Send + Sync> {
        self.map.clone()
    }

    /// The audit's view of it, mapped writable in sandbox `i`.
    pub fn mapping(&self, i: usize) -> Mapping {
        Mapping {
            sandbox: i,
            backing: self.backing,
            offset: 0,
            len: self.bytes,
            writable: true,
            channel: None,
            what: format!("state region of service '{}'", self.service),
        }
    }

    /// The sandbox whose VM has the region's slot now.
    pub fn mapped_in(&self) -> Option<usize> {
        *self.mapped_in.lock()
    }

    /// Gives sandbox `i`'s VM `vm` its slot. Refused while another
    /// sandbox's VM has it: writable in at most one at any time.
    pub fn map_into(&self, i: usize, vm: &Vm) -> Result<(), SandboxError> {
        let mut m = self.mapped_in.lock();
        if let Some(other) = *m {
            if other != i {
                return Err(SandboxError::Isolation(format!(
                    "service '{}': its state region is still mapped in sandbox {other}",
                    self.service
                )));
            }
        }
        vm.map_state(self.map.as_ptr() as u64).map_err(|e| {
            SandboxError::Resource(format!(
                "service '{}': cannot map its state region into sandbox {i}: {e}",
                self.service
            ))
        })?;
        *m = Some(i);
        Ok(())
    }

    /// Takes the slot from `vm` (sandbox `i`'s, stopped).
    pub fn unmap_from(&self, i: usize, vm: &Vm) {
        let mut m = self.mapped_in.lock();
        if *m == Some(i) {
            // Only fails for a VM without a state region; the slot is gone
            // either way for the guest.
            let _ = vm.unmap_state();
            *m = None;
        }
    }

    /// Takes the region from sandbox `i` whose VM is stopped for good (its
    /// vCPU threads ended by `Vm::stop`, and the VM is replaced by a new one
    /// or stays stopped; it never runs again), *without* removing the slot
    /// from that VM: no guest can reach the region through it, and the
    /// slot goes when the VM is released. Removing a slot
    /// (`KVM_SET_USER_MEMORY_REGION`) waits for SRCU grace periods and for
    /// every memory-map invalidation in progress anywhere in this process
    /// (another sandbox's old VM being unmapped by its release thread, a VM
    /// being built): on a takeover it held the TAP back from the standby
    /// for 130 ms to 2.2 s (issue 19, docs/sandboxes.md). Returns whether
    /// `i` had the region.
    pub fn release_stopped(&self, i: usize) -> bool {
        let mut m = self.mapped_in.lock();
        let had = *m == Some(i);
        if had {
            *m = None;
        }
        had
    }

    /// Gives the region back to sandbox `i` whose stopped VM still has its
    /// slot ([`StateRegion::release_stopped`] left it there): a takeover
    /// that failed. Refused while another sandbox has it.
    pub fn reclaim_stopped(&self, i: usize) -> Result<(), SandboxError> {
        let mut m = self.mapped_in.lock();
        match *m {
            Some(other) if other != i => Err(SandboxError::Isolation(format!(
                "service '{}': its state region is still mapped in sandbox {other}",
                self.service
            ))),
            _ => {
                *m = Some(i);
                Ok(())
            }
        }
    }

    /// The table header stored at the start of the region.
    pub fn header(&self) -> nl_workloads::kv::Header {
        let words: Vec<u64> = (0..8u64)
            .map(|w| self.map.read_obj::<u64>(MemoryRegionAddress(w * 8)).unwrap_or(0))
            .collect();
        nl_workloads::kv::Header::of(&words)
    }

    /// A copy of `len` bytes at `offset` (clamped to the region).
    pub fn read(&self, offset: u64, len: usize) -> Vec<u8> {
        let len = len.min(self.bytes.saturating_sub(offset) as usize);
        let mut v = vec![0u8; len];
        let _ = self.map.read_slice(&mut v, MemoryRegionAddress(offset));
        v
    }

    /// Writes `data` at `offset` (tests and fault injection: planting
    /// corrupt entries). False if it does not fit.
    pub fn write(&self, offset: u64, data: &[u8]) -> bool {
        offset.checked_add(data.len() as u64).is_some_and(|end| end <= self.bytes)
            && self.map.write_slice(data, MemoryRegionAddress(offset)).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd(bytes: u64) -> std::fs::File {
        let f = memfd_create(c"state-test", MemFdCreateFlag::MFD_CLOEXEC)
            .map(std::fs::File::from)
            .unwrap();
        f.set_len(bytes).unwrap();
        f
    }

    #[test]
    fn an_inherited_state_region_must_be_a_memfd_of_the_services_size() {
        let err = |f: std::fs::File, bytes| StateRegion::over_file("kv", f, bytes).err().unwrap();
        let e = err(memfd(2 << 20), 4 << 20).to_string();
        assert!(e.contains("service 'kv': inherited state region: 2097152 bytes"), "{e}");
        // A socket, and a file on disk (this crate's manifest).
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let e = err(std::fs::File::from(std::os::fd::OwnedFd::from(a)), 2 << 20).to_string();
        assert!(e.contains("not a memfd"), "{e}");
        let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
        let on_disk = std::fs::File::open(manifest).unwrap();
        let len = on_disk.metadata().unwrap().len();
        let e = err(on_disk, len).to_string();
        assert!(e.contains("not a memfd"), "{e}");
        // The right one keeps what was written through the old mapping.
        let f = memfd(2 << 20);
        let old = StateRegion::over_file("kv", f.try_clone().unwrap(), 2 << 20).unwrap();
        assert!(old.write(4096, b"acknowledged"));
        let new = StateRegion::over_file("kv", f, 2 << 20).unwrap();
        assert_eq!(new.read(4096, 12), b"acknowledged");
        assert_eq!(new.mapped_in(), None);
        assert!(new.file().is_some());
    }
    /// A takeover (or a restart) takes the region from its stopped holder
    /// without that VM (`release_stopped` has no VM to remove a slot from:
    /// nothing waits for the kernel before the TAP is handed over), and a
    /// failed takeover gives it back to the holder whose VM kept the slot;
    /// a second sandbox can never have it while one does.
    #[test]
    fn a_stopped_holder_gives_the_region_up_without_its_vm_and_can_take_it_back() {
        let st = StateRegion::create("kv", 2 << 20).unwrap();
        assert_eq!(st.mapped_in(), None);
        // As if sandbox 0's VM had the slot.
        st.reclaim_stopped(0).unwrap();
        assert_eq!(st.mapped_in(), Some(0));
        let e = st.reclaim_stopped(1).unwrap_err().to_string();
        assert!(e.contains("still mapped in sandbox 0"), "{e}");
        assert!(!st.release_stopped(1), "sandbox 1 did not have it");
        assert_eq!(st.mapped_in(), Some(0));
        // The holder stopped: the region is free for the standby.
        assert!(st.release_stopped(0));
        assert_eq!(st.mapped_in(), None, "released without the holder's VM");
        assert!(!st.release_stopped(0), "released once");
        // The takeover failed: back to the holder, whose VM kept the slot.
        st.reclaim_stopped(0).unwrap();
        assert_eq!(st.mapped_in(), Some(0));
    }
}
