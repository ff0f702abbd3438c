//! Linux guests: creating a VM that boots a Linux kernel, supervising it by
//! its console, and explaining how it stopped.
//!
//! A Linux VM is an ordinary [`Vm`] (so pause, resume, save and restore
//! work unchanged) with a different boot ([`nl_arch::linux`]) and a few
//! platform devices: the UART's interrupt on GSI 4 of the in-kernel irqchip,
//! an i8042 whose reset command ends the VM, and the in-kernel PIT. The
//! reference guest's heartbeat does not exist here: a Linux VM is watched
//! through its console ([`wait`]).
//!
//! On PVM the kernel's ring 0 is emulated instruction by instruction; what
//! the emulator cannot run is hidden from CPUID
//! ([`nl_arch::linux::CpuidPolicy::PvmSafe`]), and an `int3` it stops on is
//! completed here by injecting #BP ([`complete_int3`]).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_bindings::KVM_MAX_CPUID_ENTRIES;
use kvm_ioctls::{Kvm, VmFd};
use nl_arch::backend::Backend;
use nl_arch::linux::{CpuidPolicy, SystemMap};
use nl_devices::i8042::{ResetFlag, I8042, I8042_LEN, I8042_PORT};
use nl_devices::Bus;
use nl_memory::GuestMemory;
use nl_sync::Lock;
use serde::{Deserialize, Serialize};

use crate::config::VmConfig;
use crate::error::{kvm as kvm_err, VmmError};
use crate::state::VmState;
use crate::vm::{Vm, VmOutcome};

/// The UART's interrupt line (COM1's ISA IRQ).
pub const SERIAL_GSI: u32 = 4;

/// The virtio-blk and virtio-net interrupts of a Linux VM: ISA lines, so
/// that they reach the kernel both through the 8259 PIC (one vCPU: no MP
/// table, no IOAPIC for the kernel) and through the IOAPIC the MP table of
/// a VM with several vCPUs announces (KVM routes GSIs 0-15 to both; the
/// reference guest's GSIs 16 and 17 are IOAPIC-only pins).
pub const VIRTIO_BLK_GSI: u32 = 5;
pub const VIRTIO_NET_GSI: u32 = 6;

/// The virtio-mmio devices a Linux VM with `config` has, as its kernel is
/// told about them on the command line.
pub fn virtio_devices(config: &VmConfig) -> Vec<nl_arch::linux::VirtioMmio> {
    let mut d = Vec::new();
    let size = nl_abi::VIRTIO_MMIO_SIZE;
    if config.disk.is_some() {
        d.push(nl_arch::linux::VirtioMmio {
            base: nl_abi::VIRTIO_BLK_MMIO_GPA,
            size,
            irq: VIRTIO_BLK_GSI,
        });
    }
    if config.net.is_some() {
        d.push(nl_arch::linux::VirtioMmio {
            base: nl_abi::VIRTIO_NET_MMIO_GPA,
            size,
            irq: VIRTIO_NET_GSI,
        });
    }
    d
}

/// The command line a Linux VM with `config` boots with: `boot.cmdline`
/// and its virtio-mmio devices ([`virtio_devices`]).
pub fn kernel_cmdline(config: &VmConfig, boot: &LinuxBoot) -> Result<String, VmmError> {
    Ok(nl_arch::linux::with_virtio_mmio(&boot.cmdline, &virtio_devices(config))?)
}

/// What a Linux kernel boots with besides its image (`VmConfig::kernel`).
#[derive(Clone, Debug, Default)]
pub struct LinuxBoot {
    pub cmdline: String,
    pub initrd: Option<Arc<Vec<u8>>>,
    /// The files the kernel and initrd came from, for a successor process
    /// that boots the VM again ([`LinuxRecord`]).
    pub kernel_path: Option<PathBuf>,
    pub initrd_path: Option<PathBuf>,
    /// The kernel's System.map: a host names the guest function where the
    /// VM stopped ([`describe_crash`]) in its outcome.
    pub system_map_path: Option<PathBuf>,
    /// How long a host lets the VM run before it stops it ([`supervise`];
    /// `duration` in a host's `create`). `None`: until the guest ends.
    pub time_limit: Option<Duration>,
    /// When the VM was first created (ms since the Unix epoch), for a VM
    /// booted again by a successor: its time limit counts from there.
    /// `None`: now.
    pub started_unix_ms: Option<u64>,
}

/// How a Linux VM was booted, as a handover record carries it
/// (`VmRecord::linux`): a warm successor rebuilds the VM as a Linux VM
/// (UART interrupt, i8042, PIT) over the same memory; a cold one boots the
/// kernel again from these files.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinuxRecord {
    pub kernel: Option<PathBuf>,
    /// The command line as given (the VMM adds the virtio-mmio devices).
    pub cmdline: String,
    pub initrd: Option<PathBuf>,
    /// The kernel's System.map, if one was given (absent from the records
    /// of older processes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_map: Option<PathBuf>,
    /// The VM's time limit in ms ([`LinuxBoot::time_limit`]); absent in
    /// older records (no limit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_limit_ms: Option<u64>,
    /// When the VM was first created (ms since the Unix epoch): a
    /// successor process counts the time limit from there, not from its
    /// own start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_unix_ms: Option<u64>,
}

/// Now, in ms since the Unix epoch.
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Longest file name a record from a peer may hold ([`LinuxRecord::validate`]).
pub const MAX_RECORD_PATH: usize = 1024;

/// Largest kernel image and initrd a successor reads back.
const MAX_KERNEL_BYTES: u64 = 256 << 20;
const MAX_INITRD_BYTES: u64 = 512 << 20;

impl LinuxRecord {
    /// The record of a VM booted with `boot`.
    pub fn of(boot: &LinuxBoot) -> Self {
        Self {
            kernel: boot.kernel_path.clone(),
            cmdline: boot.cmdline.clone(),
            initrd: boot.initrd_path.clone(),
            system_map: boot.system_map_path.clone(),
            time_limit_ms: boot.time_limit.map(|d| d.as_millis() as u64),
            started_unix_ms: Some(boot.started_unix_ms.unwrap_or_else(unix_ms)),
        }
    }

    /// Whether the VM has run past its time limit (counted from its first
    /// creation, paused time and handovers included), and the limit.
    pub fn past_time_limit(&self) -> Option<u64> {
        let (limit, started) = (self.time_limit_ms?, self.started_unix_ms?);
        (unix_ms().saturating_sub(started) >= limit).then_some(limit)
    }

    /// Checks a record that came from elsewhere (a replication peer): its
    /// command line is printable ASCII of at most what a VM accepts (the
    /// user's [`nl_arch::linux::CMDLINE_MAX`] bytes plus the parameters the
    /// VMM adds on PVM), and each file name is absolute and at
    /// most [`MAX_RECORD_PATH`] bytes, without control characters. The
    /// error names the field.
    pub fn validate(&self) -> Result<(), String> {
        let max = nl_arch::linux::CMDLINE_MAX + 1 + nl_arch::linux::PVM_CMDLINE.len();
        if self.cmdline.len() > max {
            return Err(format!(
                "its command line has {} bytes (at most {max})",
                self.cmdline.len()
            ));
        }
        if let Some(c) = self.cmdline.chars().find(|c| !(' '..='~').contains(c)) {
            return Err(format!("its command line holds {c:?}, not printable ASCII"));
        }
        for (what, p) in
            [("kernel", &self.kernel), ("initrd", &self.initrd), ("system_map", &self.system_map)]
        {
            let Some(p) = p else { continue };
            let b = p.as_os_str().as_encoded_bytes();
            let control = b.iter().any(|&c| c < 0x20 || c == 0x7f);
            if b.len() > MAX_RECORD_PATH || control || !p.is_absolute() {
                return Err(format!(
                    "its {what} file name is not an absolute path of at most {MAX_RECORD_PATH} \
                     bytes without control characters ({} bytes)",
                    b.len()
                ));
            }
        }
        if self.time_limit_ms == Some(0) {
            return Err("its time limit is 0 ms".into());
        }
        Ok(())
    }

    /// The kernel image and boot of a cold rebuild, read from the files.
    pub fn load(&self) -> Result<(Arc<Vec<u8>>, LinuxBoot), VmmError> {
        let read = |p: &PathBuf, what: &str, max: u64| {
            nl_memory::file::read_limited(p, what, max).map(Arc::new).map_err(|e| {
                VmmError::State(format!("Linux VM: cannot read its {what} {}: {e}", p.display()))
            })
        };
        let Some(kernel) = &self.kernel else {
            return Err(VmmError::State(
                "Linux VM: its record names no kernel file to boot again".into(),
            ));
        };
        let image = read(kernel, "kernel", MAX_KERNEL_BYTES)?;
        let initrd =
            self.initrd.as_ref().map(|p| read(p, "initrd", MAX_INITRD_BYTES)).transpose()?;
        Ok((
            image,
            LinuxBoot {
                cmdline: self.cmdline.clone(),
                initrd,
                kernel_path: self.kernel.clone(),
                initrd_path: self.initrd.clone(),
                system_map_path: self.system_map.clone(),
                time_limit: self.time_limit_ms.map(Duration::from_millis),
                started_unix_ms: self.started_unix_ms,
            },
        ))
    }
}

/// Adds the i8042 to a Linux VM's port bus and creates the in-kernel PIT.
/// Returns the flag the i8042's reset command sets.
pub(crate) fn add_platform_devices(
    vm_fd: &VmFd,
    io_bus: &mut Bus,
) -> Result<Option<ResetFlag>, VmmError> {
    let pit = kvm_bindings::kvm_pit_config {
        flags: kvm_bindings::KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    };
    vm_fd.create_pit2(pit).map_err(kvm_err("KVM_CREATE_PIT2"))?;
    let (dev, flag) = I8042::new();
    io_bus.insert(I8042_PORT, I8042_LEN, Lock::new("dev.i8042", dev))?;
    Ok(Some(flag))
}

/// What the backend cannot run, hidden from CPUID.
pub fn cpuid_policy() -> CpuidPolicy {
    if Backend::detect() == Backend::Pvm {
        CpuidPolicy::PvmSafe
    } else {
        CpuidPolicy::AsSupported
    }
}

fn check_config(config: &VmConfig) -> Result<(), VmmError> {
    if config.vcpus == 0 || config.vcpus > nl_arch::mptable::MAX_CPUS {
        return Err(VmmError::Config(format!(
            "--vcpus {}: a Linux guest has 1 to {} vCPUs (its MP table's limit)",
            config.vcpus,
            nl_arch::mptable::MAX_CPUS
        )));
    }
    GuestMemory::check_size(config.mem_bytes)?;
    Ok(())
}

impl Vm {
    /// Creates a VM that boots the Linux kernel in `config.kernel` (a
    /// bzImage or vmlinux ELF) with `boot` (not started).
    pub fn create_linux(
        kvm: &Kvm,
        id: u32,
        config: VmConfig,
        boot: &LinuxBoot,
    ) -> Result<Self, VmmError> {
        let created_at = Instant::now();
        check_config(&config)?;
        let kernel = nl_arch::linux::prepare(&config.kernel)?;
        let cmdline = kernel_cmdline(&config, boot)?;
        if cmdline != boot.cmdline {
            tracing::info!("the kernel's virtio-mmio devices are on its command line: {cmdline}");
        }
        let memory = GuestMemory::new(&format!("vm{id}"), config.mem_bytes)?;
        let vm = Self::assemble(kvm, id, config, memory, created_at, true)?;
        let entry = nl_arch::linux::load(
            vm.memory(),
            &kernel,
            &nl_arch::linux::BootConfig {
                cmdline,
                initrd: boot.initrd.as_ref().map(|i| i.to_vec()),
            },
        )?;
        let n = vm.config().vcpus;
        if n > 1 {
            // One vCPU boots as before (8259 PIC only); several need the
            // MP table to be found, and it shows the kernel the IOAPIC.
            let lines: Vec<u32> = virtio_devices(vm.config()).iter().map(|d| d.irq).collect();
            nl_arch::mptable::write(vm.memory().mem(), n, &lines)?;
        }
        for cpu in 0..n {
            let cpuid = vcpu_cpuid(kvm, cpu)?;
            if cpu == 0 {
                vm.with_vcpu(0, |fd| nl_arch::linux::setup_boot_vcpu(fd, entry, &cpuid))??;
            } else {
                vm.with_vcpu(cpu as usize, |fd| nl_arch::linux::setup_ap_vcpu(fd, &cpuid))??;
            }
        }
        let _ = vm.linux.set(LinuxRecord::of(boot));
        Ok(vm)
    }

    /// Re-creates a Linux VM booted as `record` says over existing guest
    /// memory from saved state (not started): the Linux counterpart of
    /// [`Vm::restore`].
    pub fn restore_linux(
        kvm: &Kvm,
        id: u32,
        config: VmConfig,
        memory: GuestMemory,
        state: &VmState,
        record: &LinuxRecord,
    ) -> Result<Self, VmmError> {
        let vm = Self::prepare_linux(kvm, id, config, memory, record)?;
        vm.restore_state(state)?;
        Ok(vm)
    }

    /// A Linux VM booted as `record` says, built over existing guest
    /// memory without its state yet (not started): what a standby
    /// successor prepares before the old process pauses the VM (the Linux
    /// counterpart of [`Vm::prepare`]). [`Vm::restore_state`] completes it.
    pub fn prepare_linux(
        kvm: &Kvm,
        id: u32,
        config: VmConfig,
        memory: GuestMemory,
        record: &LinuxRecord,
    ) -> Result<Self, VmmError> {
        check_config(&config)?;
        let vm = Self::assemble(kvm, id, config, memory, Instant::now(), true)?;
        for cpu in 0..vm.config().vcpus {
            let cpuid = vcpu_cpuid(kvm, cpu)?;
            vm.with_vcpu(cpu as usize, |fd| fd.set_cpuid2(&cpuid))
                .map(|r| r.map_err(kvm_err("KVM_SET_CPUID2")))??;
        }
        let _ = vm.linux.set(record.clone());
        Ok(vm)
    }

    /// How this VM was booted, if it is a Linux VM.
    pub fn linux_record(&self) -> Option<&LinuxRecord> {
        self.linux.get()
    }
}

/// vCPU `cpu`'s CPUID (its APIC id `cpu`): KVM's supported set under
/// [`cpuid_policy`].
fn vcpu_cpuid(kvm: &Kvm, cpu: u32) -> Result<kvm_bindings::CpuId, VmmError> {
    let supported = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(kvm_err("KVM_GET_SUPPORTED_CPUID"))?;
    Ok(nl_arch::linux::linux_cpuid(&supported, u64::from(cpu), cpuid_policy()))
}

/// How waiting on a Linux VM ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinuxOutcome {
    /// The console showed what was waited for (the VM still runs).
    Reached,
    /// The guest reset through the i8042 (its reboot or power-off with
    /// `reboot=k`); the VM is stopped.
    Reset,
    /// The VM stopped otherwise (crash, emulation failure, VMM stop).
    Ended(VmOutcome),
    /// `limit` passed; the VM still runs.
    TimedOut,
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_linux_record_without_its_files_is_refused_by_name() {
        let mut r = super::LinuxRecord {
            kernel: None,
            cmdline: "quiet".into(),
            initrd: None,
            system_map: None,
            time_limit_ms: None,
            started_unix_ms: None,
        };
        assert!(r.load().unwrap_err().to_string().contains("names no kernel file"));
        r.kernel = Some("/nonexistent/ninelives-vmlinuz".into());
        let e = r.load().unwrap_err().to_string();
        assert!(e.contains("kernel /nonexistent/ninelives-vmlinuz"), "{e}");
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<super::LinuxRecord>(&json).unwrap(), r);
    }

    #[test]
    fn a_time_limit_counts_from_the_first_creation() {
        let now = super::unix_ms();
        let r = |limit, started| super::LinuxRecord {
            kernel: None,
            cmdline: String::new(),
            initrd: None,
            system_map: None,
            time_limit_ms: limit,
            started_unix_ms: started,
        };
        assert_eq!(r(Some(1000), Some(now - 2000)).past_time_limit(), Some(1000));
        assert_eq!(r(Some(60_000), Some(now)).past_time_limit(), None);
        assert_eq!(r(None, Some(now - 2000)).past_time_limit(), None, "no limit");
        // A record without the new fields (an older process's) has no limit.
        let old: super::LinuxRecord =
            serde_json::from_str(r#"{"kernel":null,"cmdline":"","initrd":null}"#).unwrap();
        assert_eq!(old.past_time_limit(), None);
        // A successor rebuilding the VM keeps the first creation's time.
        let boot = super::LinuxRecord { kernel: Some("/k".into()), ..r(Some(5), Some(7)) };
        let rec = super::LinuxRecord::of(&super::LinuxBoot {
            time_limit: Some(std::time::Duration::from_millis(5)),
            started_unix_ms: boot.started_unix_ms,
            ..Default::default()
        });
        assert_eq!((rec.time_limit_ms, rec.started_unix_ms), (Some(5), Some(7)));
    }

    #[test]
    fn the_emulators_bytes_are_read_back_from_the_stop_message() {
        let m = "KVM internal error (suberror 1: instruction emulation failed) at rip 0x10; \
                 the emulator saw: cc 38 ba";
        assert_eq!(super::parse_emulator_saw(m), Some(vec![0xcc, 0x38, 0xba]));
        assert_eq!(super::parse_emulator_saw("at rip 0x10"), None);
    }

    #[test]
    fn xrstor_and_cmpxchg16b_get_a_hint() {
        let xrstor = [0x48, 0x0f, 0xae, 0x2f, 0x31, 0xc0];
        assert!(super::emulation_hint(&xrstor).unwrap().contains("noxsave"));
        let lfence = [0x0f, 0xae, 0xe8];
        assert_eq!(super::emulation_hint(&lfence), None);
        let cx16 = [0xf0, 0x48, 0x0f, 0xc7, 0x0e];
        assert_eq!(super::emulation_hint(&cx16), None, "lock prefix first: no guess");
        assert!(super::emulation_hint(&cx16[1..]).unwrap().contains("cmpxchg"));
        assert!(super::emulation_hint(&[0x0f, 0x01, 0xca, 0xfc])
            .unwrap()
            .contains("clearcpuid=smap"));
        let popcnt = [0xf3, 0x48, 0x0f, 0xb8, 0xc7];
        let regs = kvm_bindings::kvm_regs {
            rsp: 0x1000,
            rbx: 0x2000,
            r12: 0x3000,
            rip: 0x100,
            ..Default::default()
        };
        // ldmxcsr [rsp+4] (the kernel's kernel_fpu_begin): SIB, disp8.
        assert_eq!(
            super::decode_mxcsr(&[0x0f, 0xae, 0x54, 0x24, 0x04, 0x83], &regs),
            Some((true, 0x1004, None, 5))
        );
        // stmxcsr [rbx]; ldmxcsr [r12+0x10] (REX.B); ldmxcsr [rip+0x20].
        assert_eq!(super::decode_mxcsr(&[0x0f, 0xae, 0x1b], &regs), Some((false, 0x2000, None, 3)));
        assert_eq!(
            super::decode_mxcsr(&[0x41, 0x0f, 0xae, 0x54, 0x24, 0x10], &regs),
            Some((true, 0x3010, None, 6))
        );
        assert_eq!(
            super::decode_mxcsr(&[0x0f, 0xae, 0x15, 0x20, 0, 0, 0], &regs),
            Some((true, 0x100 + 7 + 0x20, None, 7))
        );
        // gs-relative; and other 0f ae forms are not ours.
        assert_eq!(
            super::decode_mxcsr(&[0x65, 0x0f, 0xae, 0x13], &regs),
            Some((true, 0x2000, Some(0x65), 4))
        );
        assert_eq!(super::decode_mxcsr(&[0x0f, 0xae, 0xe8], &regs), None, "lfence");
        assert_eq!(super::decode_mxcsr(&[0x0f, 0xae, 0x2f], &regs), None, "xrstor");
        assert!(super::emulation_hint(&popcnt).unwrap().contains("clearcpuid=popcnt"));
    }
}

/// The instructions PVM's emulator stopped on that [`wait`] completed:
/// `int3` by injecting #BP, `fwait` as the no-op it is, `ldmxcsr` and
/// `stmxcsr` through the vCPU's FPU state.
#[derive(Clone, Copy, Debug, Default)]
pub struct WaitStats {
    /// Stops on code another vCPU rewrote meanwhile, run again.
    pub refetched: u64,
    pub int3_completed: u64,
    pub fwait_completed: u64,
    pub mxcsr_completed: u64,
}

/// Waits until the console satisfies `reached`, the guest resets, the VM
/// ends, or `limit` passes. On PVM, a vCPU stopped by an emulation failure
/// on `int3` is given its #BP and relaunched (counted in `stats`).
pub fn wait(
    vm: &Vm,
    limit: Duration,
    mut reached: impl FnMut(&str) -> bool,
    stats: &mut WaitStats,
) -> LinuxOutcome {
    let start = Instant::now();
    loop {
        if vm.guest_reset_requested() {
            vm.stop();
            return LinuxOutcome::Reset;
        }
        if reached(&vm.console().tail()) {
            return LinuxOutcome::Reached;
        }
        if let Some(o) = vm.poll_outcome() {
            if matches!(o, VmOutcome::Crashed { .. }) {
                match complete_unemulated(vm) {
                    Ok(Some(Completed::Refetched)) => {
                        stats.refetched += 1;
                        continue;
                    }
                    Ok(Some(Completed::Int3)) => {
                        stats.int3_completed += 1;
                        continue;
                    }
                    Ok(Some(Completed::Fwait)) => {
                        stats.fwait_completed += 1;
                        continue;
                    }
                    Ok(Some(Completed::Mxcsr)) => {
                        stats.mxcsr_completed += 1;
                        continue;
                    }
                    _ => {}
                }
            }
            return LinuxOutcome::Ended(o);
        }
        if start.elapsed() > limit {
            return LinuxOutcome::TimedOut;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// [`Vm::supervise`] for a Linux VM, which has no heartbeat: it ends when
/// the guest resets through the i8042 (`Completed`: its reboot or
/// power-off), when a vCPU stops on what [`complete_unemulated`] cannot
/// complete (or at the supervision's limit, checked by the caller). A host
/// can thus hold a Linux VM (and a successor process adopt one) without
/// declaring it hung. A VM past its time limit
/// ([`LinuxRecord::past_time_limit`]) is stopped and ends `TimedOut`
/// ([`time_limit_state`] is how a host lists it).
pub(crate) fn supervise(vm: &Vm) -> Option<VmOutcome> {
    if vm.guest_reset_requested() {
        vm.stop();
        return Some(VmOutcome::Completed);
    }
    if let Some(limit_ms) = vm.linux_record().and_then(LinuxRecord::past_time_limit) {
        vm.stop();
        tracing::info!("vm{}: stopped at its time limit of {limit_ms} ms", vm.id());
        return Some(VmOutcome::TimedOut { limit_ms });
    }
    if let Some(o) = vm.poll_outcome() {
        if matches!(o, VmOutcome::Crashed { .. }) && matches!(complete_unemulated(vm), Ok(Some(_)))
        {
            return None;
        }
        if let VmOutcome::Crashed { cpu, message } = o {
            // The outcome a host reports names the instruction (and, with
            // a System.map, the guest function) where the kernel stopped.
            let map = vm.linux_record().and_then(|r| r.system_map.as_ref()).and_then(|p| {
                let bytes = nl_memory::file::read_limited(p, "System.map", MAX_SYSTEM_MAP).ok()?;
                Some(SystemMap::parse(&String::from_utf8_lossy(&bytes)))
            });
            let message = message + &crash_details(vm, cpu, map.as_ref());
            return Some(VmOutcome::Crashed { cpu, message });
        }
        return Some(o);
    }
    None
}

/// Whether a saved state is a Linux VM's: only a Linux VM has the i8042
/// on its port bus (a reference-guest VM cannot load it, nor a Linux VM
/// built without it load a reference guest's).
pub fn is_linux_state(s: &VmState) -> bool {
    s.io_devices.iter().any(|d| d.name == "i8042")
}

/// One non-blocking step of a Linux VM's supervision ([`supervise`]):
/// its end (a reset through the i8042 is `Completed`, its record's time
/// limit `TimedOut`, a stop the VMM cannot complete `Crashed` with the
/// instruction), or `None` while it runs; an instruction PVM's emulator
/// stopped on that the VMM can complete is completed and the vCPUs run
/// again. Not while the VM is paused: completing relaunches its vCPUs.
pub fn poll(vm: &Vm) -> Option<VmOutcome> {
    supervise(vm)
}

/// How a host lists a Linux VM stopped at its time limit: an ordinary
/// end, not a failure.
pub fn time_limit_state(limit_ms: u64) -> String {
    format!("stopped: its time limit (duration {:.1} s) was reached", limit_ms as f64 / 1000.0)
}

/// Largest System.map read.
pub const MAX_SYSTEM_MAP: u64 = 64 << 20;

/// Up to 15 bytes of guest code at vCPU `cpu`'s RIP, and the RIP.
pub fn code_at_rip(vm: &Vm, cpu: usize) -> Result<(u64, Vec<u8>), VmmError> {
    let (rip, gpa) = vm.with_vcpu(cpu, |fd| -> Result<(u64, u64), VmmError> {
        let rip = fd.get_regs().map_err(kvm_err("KVM_GET_REGS"))?.rip;
        let t = fd.translate_gva(rip).map_err(kvm_err("KVM_TRANSLATE"))?;
        if t.valid == 0 {
            return Err(VmmError::State(format!("rip {rip:#x} is not mapped")));
        }
        Ok((rip, t.physical_address))
    })??;
    let mut bytes = Vec::new();
    for i in 0..15u64 {
        let mut b = [0u8];
        use vm_memory::Bytes;
        // Stop at the end of the page: the next one may map elsewhere.
        if i > 0 && (gpa + i) % 4096 == 0 {
            break;
        }
        if vm.memory().mem().read_slice(&mut b, vm_memory::GuestAddress(gpa + i)).is_err() {
            break;
        }
        bytes.push(b[0]);
    }
    Ok((rip, bytes))
}

/// Explains a crashed Linux VM: the stop reason, the instruction bytes at
/// RIP and, with a System.map, the guest symbol.
pub fn describe_crash(vm: &Vm, outcome: &VmOutcome, map: Option<&SystemMap>) -> String {
    let mut m = outcome.message();
    if let VmOutcome::Crashed { cpu, .. } = outcome {
        m.push_str(&crash_details(vm, *cpu, map));
    }
    m
}

/// What [`describe_crash`] adds to a crash's message: `; instruction bytes
/// at RIP: ...`, a hint, and the guest symbol.
fn crash_details(vm: &Vm, cpu: usize, map: Option<&SystemMap>) -> String {
    let mut m = String::new();
    match code_at_rip(vm, cpu) {
        Ok((rip, bytes)) => {
            let hex: Vec<String> = bytes.iter().map(|b| format!("{b:02x}")).collect();
            m.push_str(&format!("; instruction bytes at {rip:#x}: {}", hex.join(" ")));
            if let Some(hint) = emulation_hint(&bytes) {
                m.push_str(&format!(" [{hint}]"));
            }
            match map.and_then(|s| s.symbolize(rip)) {
                Some(sym) => m.push_str(&format!(" ({sym})")),
                None if map.is_none() => m.push_str(
                    " (give a System.map, --system-map or \"system_map\", for the symbol)",
                ),
                None => {}
            }
        }
        Err(e) => m.push_str(&format!("; code at rip unreadable: {e}")),
    }
    m
}

/// What to do about an instruction PVM's ring-0 emulator is known to stop on.
fn emulation_hint(code: &[u8]) -> Option<&'static str> {
    // Skip a REX prefix; 0f ae /4 /5 (memory forms) are xsave and xrstor.
    let c = if code.first().is_some_and(|b| b & 0xf0 == 0x40) { &code[1..] } else { code };
    match c {
        [0x0f, 0xae, modrm, ..] if modrm >> 6 != 3 && matches!((modrm >> 3) & 7, 4 | 5) => Some(
            "xsave/xrstor, which PVM's emulator cannot run and CPUID does not hide there: \
             add noxsave to --cmdline",
        ),
        [0x0f, 0x01, 0xca | 0xcb, ..] => {
            Some("clac/stac, which PVM's emulator cannot run: add clearcpuid=smap to --cmdline")
        }
        [0xf3, 0x0f, 0xb8, ..] | [0xf3, 0x40..=0x4f, 0x0f, 0xb8, ..] => {
            Some("popcnt, which PVM's emulator cannot run: add clearcpuid=popcnt to --cmdline")
        }
        [0x0f, 0xc7, modrm, ..] if (modrm >> 3) & 7 == 1 => {
            Some("cmpxchg8b/16b, which PVM's emulator cannot run")
        }
        _ => None,
    }
}

/// An instruction [`complete_unemulated`] completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Completed {
    /// The code at RIP changed since the emulator fetched it (another vCPU
    /// patched it, as the kernel's `text_poke_bp` does: int3 first, then
    /// the new instruction): the vCPU runs it again as it now is.
    Refetched,
    Int3,
    Fwait,
    /// `ldmxcsr m32` (MXCSR loaded from memory) or `stmxcsr m32`.
    Mxcsr,
}

/// The general registers in ModRM/SIB order (rax, rcx, rdx, rbx, rsp, rbp,
/// rsi, rdi, r8..r15).
fn gpr(regs: &kvm_bindings::kvm_regs, n: u8) -> u64 {
    [
        regs.rax, regs.rcx, regs.rdx, regs.rbx, regs.rsp, regs.rbp, regs.rsi, regs.rdi, regs.r8,
        regs.r9, regs.r10, regs.r11, regs.r12, regs.r13, regs.r14, regs.r15,
    ][usize::from(n & 15)]
}

/// An `ldmxcsr`/`stmxcsr` with a memory operand at `code` (64-bit mode):
/// (`true` for ldmxcsr, the operand's linear address before any FS/GS
/// base, the segment prefix, the instruction's length). `None` for any
/// other instruction or form.
fn decode_mxcsr(
    code: &[u8],
    regs: &kvm_bindings::kvm_regs,
) -> Option<(bool, u64, Option<u8>, u64)> {
    let mut i = 0;
    let mut seg = None;
    while let Some(&b) = code.get(i) {
        match b {
            0x64 | 0x65 => seg = Some(b),
            0x2e | 0x36 | 0x3e | 0x26 => {}
            _ => break,
        }
        i += 1;
    }
    let rex = match code.get(i) {
        Some(&b) if b & 0xf0 == 0x40 => {
            i += 1;
            b
        }
        _ => 0,
    };
    if code.get(i..i + 2)? != [0x0f, 0xae] {
        return None;
    }
    let modrm = *code.get(i + 2)?;
    i += 3;
    let (md, reg, rm) = (modrm >> 6, (modrm >> 3) & 7, modrm & 7);
    let load = match (md, reg) {
        (3, _) => return None,
        (_, 2) => true,
        (_, 3) => false,
        _ => return None,
    };
    let (rex_b, rex_x) = ((rex & 1) << 3, (rex & 2) << 2);
    let mut rip_relative = false;
    let base = if rm == 4 {
        let sib = *code.get(i)?;
        i += 1;
        let (scale, index, b) = (sib >> 6, ((sib >> 3) & 7) | rex_x, sib & 7);
        let idx = if index == 4 { 0 } else { gpr(regs, index) << scale };
        let base = if b == 5 && md == 0 { 0 } else { gpr(regs, b | rex_b) };
        if b == 5 && md == 0 {
            let d = i32::from_le_bytes(code.get(i..i + 4)?.try_into().ok()?);
            i += 4;
            return Some((load, idx.wrapping_add(d as i64 as u64), seg, i as u64));
        }
        base.wrapping_add(idx)
    } else if rm == 5 && md == 0 {
        rip_relative = true;
        0
    } else {
        gpr(regs, rm | rex_b)
    };
    let disp: i64 = match md {
        0 if rip_relative => {
            let d = i32::from_le_bytes(code.get(i..i + 4)?.try_into().ok()?);
            i += 4;
            i64::from(d)
        }
        1 => {
            let d = *code.get(i)? as i8;
            i += 1;
            i64::from(d)
        }
        2 => {
            let d = i32::from_le_bytes(code.get(i..i + 4)?.try_into().ok()?);
            i += 4;
            i64::from(d)
        }
        _ => 0,
    };
    let len = i as u64;
    let addr = if rip_relative {
        regs.rip.wrapping_add(len).wrapping_add(disp as u64)
    } else {
        base.wrapping_add(disp as u64)
    };
    Some((load, addr, seg, len))
}

/// The first vCPU that stopped on an emulation failure, if one did.
fn emulation_failure_cpu(vm: &Vm) -> Option<usize> {
    vm.report().vcpus.iter().position(|v| {
        v.stop.as_ref().is_some_and(
            |s| matches!(s, crate::vcpu::VcpuStop::Internal(m) if m.contains("emulation failed")),
        )
    })
}

/// The instruction bytes KVM's emulator fetched when vCPU `cpu` stopped on
/// an emulation failure, if KVM reported them.
fn emulator_saw(vm: &Vm, cpu: usize) -> Option<Vec<u8>> {
    let report = vm.report();
    let stop = report.vcpus.get(cpu)?.stop.as_ref()?;
    let crate::vcpu::VcpuStop::Internal(m) = stop else { return None };
    parse_emulator_saw(m)
}

/// The bytes after [`crate::vcpu::EMULATOR_SAW`] in a stop's message.
fn parse_emulator_saw(m: &str) -> Option<Vec<u8>> {
    let hex = &m[m.find(crate::vcpu::EMULATOR_SAW)? + crate::vcpu::EMULATOR_SAW.len()..];
    hex.split_whitespace().map(|h| u8::from_str_radix(h, 16).ok()).collect()
}

/// The last (VM, vCPU, RIP) run again without the emulator's bytes to go
/// by: the same stop twice in a row is not retried again.
static LAST_BLIND_RETRY: std::sync::Mutex<Option<(u32, usize, u64)>> = std::sync::Mutex::new(None);

/// Whether the code at vCPU `cpu`'s RIP (`now`) is not what the emulator
/// stopped on: another vCPU rewrote it in between (cross-modifying code;
/// the kernel patches jump labels and alternatives with `text_poke_bp`,
/// an `int3` first, then the new instruction, so the emulator may stop on
/// the `int3` and the memory show the new instruction). With the bytes KVM
/// reports this is exact. Without them, with several vCPUs, an instruction
/// the patching writes (a `jmp` or a NOP, which the emulator runs) is taken
/// as changed once per RIP.
fn code_changed(vm: &Vm, cpu: usize, rip: u64, now: &[u8]) -> bool {
    if let Some(saw) = emulator_saw(vm, cpu) {
        return !saw.is_empty() && saw.first() != now.first();
    }
    let patched = matches!(now, [0xeb | 0xe9 | 0x90, ..] | [0x66, 0x90, ..] | [0x0f, 0x1f, ..]);
    if vm.config().vcpus < 2 || !patched {
        return false;
    }
    let mut last = LAST_BLIND_RETRY.lock().unwrap_or_else(|e| e.into_inner());
    let key = (vm.id(), cpu, rip);
    if *last == Some(key) {
        return false;
    }
    *last = Some(key);
    true
}

/// Starts every vCPU again after one was completed (the others were
/// halted at a KVM_RUN boundary, their state kept in KVM).
fn relaunch_all(vm: &Vm) -> Result<(), VmmError> {
    vm.halt_vcpus();
    vm.relaunch()
}

/// Each vCPU's MP state (KVM_MP_STATE_*: 0 runnable, 1 uninitialized, 2
/// INIT received / waiting for SIPI, 3 halted, 4 SIPI received), RIP and
/// CS, for the report of a VM with several vCPUs: whether the kernel
/// started its application processors. The vCPUs must be stopped.
pub fn vcpu_states(vm: &Vm) -> String {
    (0..vm.config().vcpus as usize)
        .map(|cpu| {
            let s = vm.with_vcpu(cpu, |fd| {
                let mp = fd.get_mp_state().map(|m| m.mp_state).ok()?;
                let rip = fd.get_regs().map(|r| r.rip).ok()?;
                let cs = fd.get_sregs().map(|s| s.cs.selector).ok()?;
                Some(format!("vcpu{cpu} mp_state {mp} rip {rip:#x} cs {cs:#x}"))
            });
            match s {
                Ok(Some(s)) => s,
                Ok(None) => format!("vcpu{cpu} state unreadable"),
                Err(e) => format!("vcpu{cpu}: {e}"),
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// If a vCPU stopped on an emulation failure at an instruction whose
/// effect the VMM can give, completes it as the CPU would and relaunches
/// the vCPUs: `int3` (0xcc) moves RIP past it and injects #BP; `fwait`
/// (0x9b) moves RIP past it, or injects #NM when CR0.TS and CR0.MP are set
/// (pending x87 exceptions are not modelled: the kernel masks them).
pub fn complete_unemulated(vm: &Vm) -> Result<Option<Completed>, VmmError> {
    let Some(cpu) = emulation_failure_cpu(vm) else {
        return Ok(None);
    };
    // With several vCPUs the others still run: the vCPUs' state is read
    // and set with all of them stopped.
    vm.halt_vcpus();
    let (rip, bytes) = code_at_rip(vm, cpu)?;
    if code_changed(vm, cpu, rip, &bytes) {
        tracing::info!(
            "vm{}: vCPU {cpu}'s code at {rip:#x} changed since the emulator stopped on it \
             (another vCPU patched it): running it again",
            vm.id()
        );
        relaunch_all(vm)?;
        return Ok(Some(Completed::Refetched));
    }
    let done = match bytes.first() {
        Some(0xcc) => {
            complete_int3(vm)?;
            return Ok(Some(Completed::Int3));
        }
        Some(0x9b) => Completed::Fwait,
        _ => return complete_mxcsr(vm, cpu, &bytes),
    };
    vm.with_vcpu(cpu, |fd| -> Result<(), VmmError> {
        let sregs = fd.get_sregs().map_err(kvm_err("KVM_GET_SREGS"))?;
        if sregs.cr0 & 0b1010 == 0b1010 {
            let mut ev = fd.get_vcpu_events().map_err(kvm_err("KVM_GET_VCPU_EVENTS"))?;
            ev.exception.injected = 1;
            ev.exception.nr = 7;
            ev.exception.has_error_code = 0;
            fd.set_vcpu_events(&ev).map_err(kvm_err("KVM_SET_VCPU_EVENTS"))
        } else {
            let mut regs = fd.get_regs().map_err(kvm_err("KVM_GET_REGS"))?;
            regs.rip += 1;
            fd.set_regs(&regs).map_err(kvm_err("KVM_SET_REGS"))
        }
    })??;
    relaunch_all(vm)?;
    Ok(Some(done))
}

/// Completes an `ldmxcsr`/`stmxcsr` with a memory operand: the 4 bytes
/// at its address loaded into (or stored from) MXCSR through
/// `KVM_GET/SET_FPU`, RIP moved past it, the vCPU relaunched. A load of a
/// value with reserved bits set gets #GP, as on the CPU.
fn complete_mxcsr(vm: &Vm, cpu: usize, code: &[u8]) -> Result<Option<Completed>, VmmError> {
    use vm_memory::Bytes;
    let done = vm.with_vcpu(cpu, |fd| -> Result<bool, VmmError> {
        let mut regs = fd.get_regs().map_err(kvm_err("KVM_GET_REGS"))?;
        let Some((load, addr, seg, len)) = decode_mxcsr(code, &regs) else {
            return Ok(false);
        };
        let sregs = fd.get_sregs().map_err(kvm_err("KVM_GET_SREGS"))?;
        let addr = match seg {
            Some(0x64) => addr.wrapping_add(sregs.fs.base),
            Some(0x65) => addr.wrapping_add(sregs.gs.base),
            _ => addr,
        };
        let t = fd.translate_gva(addr).map_err(kvm_err("KVM_TRANSLATE"))?;
        // Within one page: an aligned 4-byte operand never crosses one.
        if t.valid == 0 || addr % 4096 > 4092 {
            return Ok(false);
        }
        let gpa = vm_memory::GuestAddress(t.physical_address);
        let mut fpu = fd.get_fpu().map_err(kvm_err("KVM_GET_FPU"))?;
        if load {
            let mut b = [0u8; 4];
            if vm.memory().mem().read_slice(&mut b, gpa).is_err() {
                return Ok(false);
            }
            let v = u32::from_le_bytes(b);
            if v & 0xffff_0000 != 0 {
                let mut ev = fd.get_vcpu_events().map_err(kvm_err("KVM_GET_VCPU_EVENTS"))?;
                ev.exception.injected = 1;
                ev.exception.nr = 13;
                ev.exception.has_error_code = 1;
                ev.exception.error_code = 0;
                fd.set_vcpu_events(&ev).map_err(kvm_err("KVM_SET_VCPU_EVENTS"))?;
                return Ok(true);
            }
            fpu.mxcsr = v;
            fd.set_fpu(&fpu).map_err(kvm_err("KVM_SET_FPU"))?;
        } else if vm.memory().mem().write_slice(&fpu.mxcsr.to_le_bytes(), gpa).is_err() {
            return Ok(false);
        }
        regs.rip += len;
        fd.set_regs(&regs).map_err(kvm_err("KVM_SET_REGS"))?;
        Ok(true)
    })??;
    if !done {
        return Ok(None);
    }
    relaunch_all(vm)?;
    Ok(Some(Completed::Mxcsr))
}

/// If a vCPU stopped on an emulation failure at an `int3` (0xcc),
/// completes it as the CPU would: RIP past the instruction and #BP
/// injected, then relaunches the vCPUs. Returns whether it did.
pub fn complete_int3(vm: &Vm) -> Result<bool, VmmError> {
    let Some(cpu) = emulation_failure_cpu(vm) else {
        return Ok(false);
    };
    vm.halt_vcpus();
    let (_, bytes) = code_at_rip(vm, cpu)?;
    if bytes.first() != Some(&0xcc) {
        return Ok(false);
    }
    vm.with_vcpu(cpu, |fd| -> Result<(), VmmError> {
        let mut regs = fd.get_regs().map_err(kvm_err("KVM_GET_REGS"))?;
        regs.rip += 1;
        fd.set_regs(&regs).map_err(kvm_err("KVM_SET_REGS"))?;
        let mut ev = fd.get_vcpu_events().map_err(kvm_err("KVM_GET_VCPU_EVENTS"))?;
        ev.exception.injected = 1;
        ev.exception.nr = 3;
        ev.exception.has_error_code = 0;
        ev.exception.error_code = 0;
        fd.set_vcpu_events(&ev).map_err(kvm_err("KVM_SET_VCPU_EVENTS"))
    })??;
    relaunch_all(vm)?;
    Ok(true)
}
