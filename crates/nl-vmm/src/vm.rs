//! One VM: guest memory, in-kernel irqchip, devices and vCPUs.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;

use nl_sync::Lock;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_bindings::{kvm_mp_state, kvm_userspace_memory_region, CpuId, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use nl_abi::*;
use nl_devices::control::{describe_error, ControlDevice, ControlState, VcpuRegsSnapshot};
use nl_devices::echo::EchoPort;
use nl_devices::serial::{Console, SerialDevice};
use nl_devices::virtio::blk::{BlkStats, Block};
use nl_devices::virtio::held_writes::DiskWrite;
use nl_devices::virtio::net::{Net, NetStats};
use nl_devices::virtio::MmioTransport;
use nl_devices::Bus;
use nl_memory::GuestMemory;
use serde::Serialize;

use crate::config::VmConfig;
use crate::error::{kvm, VmmError};
use crate::kick;
use crate::state::{IrqchipState, VcpuState, VmState};
use crate::vcpu::{run_vcpu, RunControl, VcpuContext, VcpuStats, VcpuStatsSnapshot, VcpuStop};

/// KVM's APIC bus runs at 1 GHz.
const APIC_BUS_HZ: u64 = 1_000_000_000;

/// How a VM's run ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum VmOutcome {
    /// Every vCPU finished its workload.
    Completed,
    /// The guest reported an error through the control device.
    GuestError { cpu: usize, code: u64, info: u64, message: String },
    /// A vCPU crashed (triple fault, emulation failure, ...).
    Crashed { cpu: usize, message: String },
    /// No heartbeat or other guest activity for too long.
    Hung { silent_ms: u64 },
    /// The run went past its time limit.
    TimedOut { limit_ms: u64 },
    /// The VMM stopped the VM.
    Stopped,
}

impl VmOutcome {
    pub fn message(&self) -> String {
        match self {
            VmOutcome::Completed => "completed".into(),
            VmOutcome::GuestError { cpu, message, .. } => format!("vCPU {cpu}: {message}"),
            VmOutcome::Crashed { cpu, message } => format!("vCPU {cpu} crashed: {message}"),
            VmOutcome::Hung { silent_ms } => {
                format!("guest stopped heartbeating: no sign of life for {silent_ms} ms")
            }
            VmOutcome::TimedOut { limit_ms } => format!("did not finish within {limit_ms} ms"),
            VmOutcome::Stopped => "stopped by the VMM".into(),
        }
    }
}

/// Per-vCPU view for reports.
#[derive(Clone, Debug, Serialize)]
pub struct VcpuReport {
    pub cpu: usize,
    pub regs: VcpuRegsSnapshot,
    pub exits: VcpuStatsSnapshot,
    pub stop: Option<VcpuStop>,
}

/// A VM's report (the `stats` of the host API).
#[derive(Clone, Debug, Serialize)]
pub struct VmReport {
    pub id: u32,
    pub mem_bytes: u64,
    pub vcpus: Vec<VcpuReport>,
    pub paused: bool,
    /// From the start of VM creation to the first workload instruction (vCPU 0).
    pub boot_ms: Option<f64>,
    pub unclaimed_io: u64,
    pub unclaimed_mmio: u64,
}

struct VcpuSlot {
    fd: Arc<Lock<VcpuFd>>,
    stats: Arc<VcpuStats>,
    thread: Option<JoinHandle<VcpuStop>>,
    stop: Option<VcpuStop>,
}

/// One virtual machine. Methods take `&self`, so a VM can be shared between
/// a monitor and an API server.
pub struct Vm {
    id: u32,
    config: VmConfig,
    created_at: Instant,
    // Field order matters for drop: vCPUs, then the VM fd, then the memory
    // that its memory slots point into.
    vcpus: Arc<Lock<Vec<VcpuSlot>>>,
    run: Arc<RunControl>,
    started: AtomicBool,
    io_bus: Arc<Bus>,
    mmio_bus: Arc<Bus>,
    control: Arc<ControlState>,
    console: Console,
    blk: Option<Arc<Lock<MmioTransport<Block>>>>,
    net: Option<Arc<Lock<MmioTransport<Net>>>>,
    /// The virtio-net receive thread (`NetConfig::rx_irq`).
    rx: Arc<Lock<Option<crate::netrx::RxThread>>>,
    /// A Linux VM's i8042 reset request (see [`crate::linux`]).
    guest_reset: Option<nl_devices::i8042::ResetFlag>,
    /// A Linux VM: how it was booted ([`crate::linux`]), for a successor.
    pub(crate) linux: std::sync::OnceLock<crate::linux::LinuxRecord>,
    vm_fd: VmFd,
    memory: GuestMemory,
    /// Sandbox channel windows (their host mappings outlive the VM fd).
    windows: Option<Arc<crate::windows::VmWindows>>,
    /// Taken by [`Vm::hold_paused`] and [`Vm::exclusive`].
    pauser: Arc<Lock<()>>,
    /// [`Vm::note_vmm_write`]s, while tracked.
    vmm_writes: Arc<Lock<Option<Vec<GuestRange>>>>,
}

/// A guest range `(gpa, len)`.
type GuestRange = (u64, u64);

/// A [`Vm::hold_paused`]: the VM stays paused while it lives.
pub struct PauseHold<'v> {
    vm: &'v Vm,
    _section: nl_sync::Guard<'v, ()>,
}

impl Drop for PauseHold<'_> {
    fn drop(&mut self) {
        self.vm.run.release_hold();
    }
}

fn supported_cpuid(kvm: &Kvm) -> Result<CpuId, VmmError> {
    kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).map_err(kvm_err("KVM_GET_SUPPORTED_CPUID"))
}

/// An eventfd registered with KVM as the irqfd of `gsi` (in-kernel IOAPIC).
fn irqfd(vm_fd: &VmFd, gsi: u32) -> Result<vmm_sys_util::eventfd::EventFd, VmmError> {
    let e = vmm_sys_util::eventfd::EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)
        .map_err(|e| VmmError::Config(format!("cannot create an eventfd: {e}")))?;
    vm_fd.register_irqfd(&e, gsi).map_err(kvm_err("KVM_IRQFD"))?;
    Ok(e)
}

fn kvm_err(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmmError {
    kvm(what)
}

impl Vm {
    /// Creates a VM ready to boot the reference guest (not started).
    pub fn create(kvm: &Kvm, id: u32, config: VmConfig) -> Result<Self, VmmError> {
        Self::create_with_windows(kvm, id, config, None, None)
    }

    /// [`Vm::create`] with memory windows beside RAM (a sandbox's channels):
    /// registered as memory slots (read-only ones with `KVM_MEM_READONLY`),
    /// mapped user-writable in the guest page tables and listed in the boot
    /// info. Writes to read-only windows go to `windows.guard`. `memory`:
    /// the VM's RAM (zeroed) when the caller provides it, e.g. from a named
    /// file; a fresh memfd otherwise.
    pub fn create_with_windows(
        kvm: &Kvm,
        id: u32,
        config: VmConfig,
        memory: Option<GuestMemory>,
        windows: Option<crate::windows::VmWindows>,
    ) -> Result<Self, VmmError> {
        let created_at = Instant::now();
        config.validate().map_err(VmmError::Config)?;
        if let Some(w) = &windows {
            w.validate().map_err(VmmError::Config)?;
        }
        let memory = match memory {
            Some(m) if m.size() != config.mem_bytes => {
                return Err(VmmError::Config(format!(
                    "the memory given holds {} bytes, the VM has {}",
                    m.size(),
                    config.mem_bytes
                )))
            }
            Some(m) => m,
            None => GuestMemory::new(&format!("vm{id}"), config.mem_bytes)?,
        };
        let mut vm = Self::assemble(kvm, id, config, memory, created_at, false)?;
        if let Some(w) = windows {
            w.register(&vm.vm_fd, vm.memory.regions().len() as u32)?;
            vm.windows = Some(Arc::new(w));
        }
        vm.write_boot_structures()?;
        for (gpa, size) in vm.windows.iter().flat_map(|w| w.user_ranges()) {
            nl_arch::paging::map_user_window(vm.memory.mem(), gpa, size)?;
        }
        vm.route_interrupts()?;
        let cpuid = supported_cpuid(kvm)?;
        let entry = vm.load_images()?;
        for (cpu, slot) in vm.slots().iter().enumerate() {
            let fd = slot.fd.lock();
            nl_arch::regs::setup_vcpu(&fd, cpu as u64, entry, &cpuid)?;
            if cpu > 0 {
                // Application processors start runnable: no INIT/SIPI dance.
                fd.set_mp_state(kvm_mp_state { mp_state: kvm_bindings::KVM_MP_STATE_RUNNABLE })
                    .map_err(kvm_err("KVM_SET_MP_STATE"))?;
            }
        }
        Ok(vm)
    }

    /// Re-creates a VM over existing guest memory from saved state (not
    /// started). This is how a new VMM process takes over a running guest.
    pub fn restore(
        kvm: &Kvm,
        id: u32,
        config: VmConfig,
        memory: GuestMemory,
        state: &VmState,
    ) -> Result<Self, VmmError> {
        check_compatible(&config, state)?;
        check_memory(&memory, state)?;
        let vm = Self::prepare(kvm, id, config, memory)?;
        vm.load_state(state)?;
        Ok(vm)
    }

    /// [`Vm::restore`] of a VM with memory windows (a sandbox carried to a
    /// new VMM process): the windows are registered as in
    /// [`Vm::create_with_windows`]; the boot structures and guest page
    /// tables mapping them are in the guest memory already.
    pub fn restore_with_windows(
        kvm: &Kvm,
        id: u32,
        config: VmConfig,
        memory: GuestMemory,
        state: &VmState,
        windows: crate::windows::VmWindows,
    ) -> Result<Self, VmmError> {
        check_compatible(&config, state)?;
        check_memory(&memory, state)?;
        windows.validate().map_err(VmmError::Config)?;
        let mut vm = Self::prepare(kvm, id, config, memory)?;
        windows.register(&vm.vm_fd, vm.memory.regions().len() as u32)?;
        vm.windows = Some(Arc::new(windows));
        vm.route_interrupts()?;
        vm.load_state(state)?;
        Ok(vm)
    }

    /// Builds a VM over existing guest memory, ready for
    /// [`Vm::restore_state`] (not started, no state loaded). A standby
    /// successor prepares its VMs this way while the old process still runs
    /// them: the expensive part of a take-over happens outside the pause.
    pub fn prepare(
        kvm: &Kvm,
        id: u32,
        config: VmConfig,
        memory: GuestMemory,
    ) -> Result<Self, VmmError> {
        let created_at = Instant::now();
        config.validate().map_err(VmmError::Config)?;
        let vm = Self::assemble(kvm, id, config, memory, created_at, false)?;
        vm.route_interrupts()?;
        let cpuid = supported_cpuid(kvm)?;
        for (cpu, slot) in vm.slots().iter().enumerate() {
            let fd = slot.fd.lock();
            let c = nl_arch::regs::vcpu_cpuid(&cpuid, cpu as u64);
            fd.set_cpuid2(&c).map_err(kvm_err("KVM_SET_CPUID2"))?;
        }
        Ok(vm)
    }

    /// Memory slots, irqchip, devices and vCPU fds. A `linux` VM also gets
    /// the UART's interrupt, an i8042 and a PIT (see [`crate::linux`]).
    pub(crate) fn assemble(
        kvm: &Kvm,
        id: u32,
        config: VmConfig,
        memory: GuestMemory,
        created_at: Instant,
        linux: bool,
    ) -> Result<Self, VmmError> {
        kick::install();
        let vm_fd = kvm.create_vm().map_err(kvm_err("KVM_CREATE_VM"))?;
        for (slot, (region, host)) in memory.regions().iter().zip(memory.host_addrs()).enumerate() {
            let r = kvm_userspace_memory_region {
                slot: slot as u32,
                flags: 0,
                guest_phys_addr: region.gpa,
                memory_size: region.size,
                userspace_addr: host,
            };
            crate::memslots::set_region(&vm_fd, r)?;
        }
        vm_fd.create_irq_chip().map_err(kvm_err("KVM_CREATE_IRQCHIP"))?;

        let console = match &config.console_path {
            Some(p) => Console::to_file(
                std::fs::OpenOptions::new().create(true).append(true).open(p).map_err(|e| {
                    VmmError::Config(format!("cannot open console file {}: {e}", p.display()))
                })?,
            ),
            None => Console::buffer(),
        };
        let n = config.vcpus as usize;
        let control = ControlState::new(n);
        let mut io_bus = Bus::new();
        let serial = if linux {
            SerialDevice::with_irq(console.clone(), irqfd(&vm_fd, crate::linux::SERIAL_GSI)?)?
        } else {
            SerialDevice::new(console.clone())?
        };
        io_bus.insert(u64::from(SERIAL_PORT), 8, Lock::new("dev.serial", serial))?;
        let guest_reset =
            if linux { crate::linux::add_platform_devices(&vm_fd, &mut io_bus)? } else { None };
        io_bus.insert(u64::from(EXITS_PORT), 4, Lock::new("dev.echo", EchoPort::new(n)))?;
        // A Linux kernel sees no IOAPIC without MP/ACPI tables: ISA lines.
        let (blk_gsi, net_gsi) = if linux {
            (crate::linux::VIRTIO_BLK_GSI, crate::linux::VIRTIO_NET_GSI)
        } else {
            (nl_abi::VIRTIO_BLK_GSI, nl_abi::VIRTIO_NET_GSI)
        };
        let mut mmio_bus = Bus::new();
        mmio_bus.insert(
            CONTROL_MMIO_GPA,
            ControlDevice::mmio_len(n),
            Lock::new("dev.control", ControlDevice::new(control.clone(), console.clone())),
        )?;
        let blk = match &config.disk {
            Some(d) => {
                let dev = Block::open(&d.path, d.readonly).map_err(VmmError::Config)?;
                let mut t = MmioTransport::new(dev, memory.mem().clone());
                t.set_irq(irqfd(&vm_fd, blk_gsi)?);
                let t = Lock::new("dev.virtio-blk", t);
                mmio_bus.insert(VIRTIO_BLK_MMIO_GPA, VIRTIO_MMIO_SIZE, t.clone())?;
                Some(t)
            }
            None => None,
        };
        let net = match &config.net {
            Some(n) if n.spare => {
                let mac = n.mac.unwrap_or([0x52, 0x54, 0x00, 0x4e, 0x4c, id as u8]);
                let mut t = MmioTransport::new(Net::spare(mac), memory.mem().clone());
                t.set_irq(irqfd(&vm_fd, net_gsi)?);
                let t = Lock::new("dev.virtio-net", t);
                mmio_bus.insert(VIRTIO_NET_MMIO_GPA, VIRTIO_MMIO_SIZE, t.clone())?;
                Some(t)
            }
            Some(n) => {
                let tap = match (&n.port, crate::handover::take_inherited_tap(&n.tap)) {
                    (Some(p), _) => nl_devices::tap::Tap::over_port(p, &n.tap)
                        .map_err(|e| format!("cannot use the port on shared TAP {}: {e}", n.tap)),
                    (None, Some(f)) => nl_devices::tap::Tap::from_attached(f, &n.tap),
                    (None, None) => nl_devices::tap::Tap::open(&n.tap),
                }
                .map_err(VmmError::Config)?;
                if n.port.is_some() {
                    // The link's owner configures the TAP.
                } else if let Some((ip, prefix)) = n.host_ip {
                    tap.configure_host(ip, prefix).map_err(VmmError::Config)?;
                } else if !tap.host_up() {
                    let [a, b, c, _] = n.ipv4;
                    tracing::warn!(
                        "TAP {0} is down on the host, so the guest at {1} \
                         is unreachable: pass --net-host-ip {a}.{b}.{c}.1/{2} (or run \
                         `ip addr add {a}.{b}.{c}.1/{2} dev {0} && ip link set {0} up`)",
                        n.tap,
                        std::net::Ipv4Addr::from(n.ipv4),
                        n.prefix
                    );
                }
                let mac = n.mac.unwrap_or([0x52, 0x54, 0x00, 0x4e, 0x4c, id as u8]);
                let dev = Net::new(tap, mac);
                let mut t = MmioTransport::new(dev, memory.mem().clone());
                t.set_irq(irqfd(&vm_fd, net_gsi)?);
                let t = Lock::new("dev.virtio-net", t);
                mmio_bus.insert(VIRTIO_NET_MMIO_GPA, VIRTIO_MMIO_SIZE, t.clone())?;
                Some(t)
            }
            None => None,
        };

        let mut vcpus = Vec::with_capacity(n);
        for cpu in 0..n {
            let fd = vm_fd.create_vcpu(cpu as u64).map_err(kvm_err("KVM_CREATE_VCPU"))?;
            vcpus.push(VcpuSlot {
                fd: Lock::new("vcpu.fd", fd),
                stats: Arc::default(),
                thread: None,
                stop: None,
            });
        }
        Ok(Self {
            id,
            config,
            created_at,
            vcpus: Lock::new("vm.vcpus", vcpus),
            run: Arc::default(),
            started: AtomicBool::new(false),
            io_bus: Arc::new(io_bus),
            mmio_bus: Arc::new(mmio_bus),
            control,
            console,
            blk,
            net,
            rx: Lock::new("vm.rx", None),
            guest_reset,
            linux: std::sync::OnceLock::new(),
            vm_fd,
            memory,
            windows: None,
            pauser: Lock::new("vm.pauser", ()),
            vmm_writes: Lock::new("vm.vmm_writes", None),
        })
    }

    fn slots(&self) -> MutexGuard<'_> {
        self.vcpus.lock()
    }

    fn write_boot_structures(&self) -> Result<(), VmmError> {
        let mem = self.memory.mem();
        nl_arch::setup_memory(mem, self.memory.size())?;
        for cpu in 0..u64::from(self.config.vcpus) {
            nl_arch::gdt::setup_cpu_area(mem, cpu)?;
        }
        Ok(())
    }

    /// Loads kernel and user images and writes the boot info; returns the kernel entry.
    fn load_images(&self) -> Result<u64, VmmError> {
        let kernel = nl_arch::image::load_elf(
            &self.memory,
            "kernel",
            &self.config.kernel,
            KERNEL_BASE,
            KERNEL_STACKS_GPA,
        )?;
        let user = nl_arch::image::load_elf(
            &self.memory,
            "user program",
            &self.config.user,
            USER_BASE,
            USER_STACKS_GPA,
        )?;
        let tsc_khz = {
            let slots = self.slots();
            let fd = slots[0].fd.lock();
            fd.get_tsc_khz().map_err(kvm_err("KVM_GET_TSC_KHZ"))?
        };
        let dma_end = self.memory.size().min(MMIO_HOLE_START);
        let heap_end = dma_end - DMA_BYTES;
        let info = BootInfo {
            magic: BOOT_MAGIC,
            version: BOOT_VERSION,
            mem_bytes: self.memory.size(),
            num_vcpus: u64::from(self.config.vcpus),
            tsc_khz: u64::from(tsc_khz),
            lapic_timer_count: APIC_BUS_HZ / self.config.timer_hz,
            timer_hz: self.config.timer_hz,
            user_entry: user.entry,
            heap_start: USER_HEAP_GPA,
            heap_end,
            user_iopl: 1,
            workload: self.config.workload,
            dma_start: heap_end,
            dma_end,
            has_blk: u64::from(self.blk.is_some()),
            has_net: if self.rx_irq() {
                NET_RX_IRQ
            } else if self.config.net.as_ref().is_some_and(|n| n.spare) {
                nl_abi::NET_STANDBY
            } else {
                u64::from(self.net.is_some())
            },
            net_ipv4: self.config.net.as_ref().map_or(0, |n| u64::from(u32::from_be_bytes(n.ipv4))),
            net_prefix: self.config.net.as_ref().map_or(0, |n| u64::from(n.prefix)),
            ..Default::default()
        };
        let mut info = info;
        if let Some(w) = &self.windows {
            info.sandbox = w.sandbox;
            info.num_channels = w.channels.len() as u64;
            if let Some((gpa, size)) = w.state {
                info.state_gpa = gpa;
                info.state_bytes = size;
            }
            for (slot, c) in info.channels.iter_mut().zip(&w.channels) {
                *slot = *c;
            }
        }
        nl_arch::write_boot_info(self.memory.mem(), &info)?;
        Ok(kernel.entry)
    }

    /// Whether [`Vm::start`] was called (its vCPU threads may have ended
    /// since, or be paused).
    pub fn started(&self) -> bool {
        self.started.load(Relaxed)
    }

    /// Starts the vCPU threads (and the net receive thread, if configured).
    pub fn start(&self) -> Result<(), VmmError> {
        if self.started.swap(true, Relaxed) {
            return Err(VmmError::Vm(self.id, "already started".into()));
        }
        if let (true, Some(net)) = (self.rx_irq(), &self.net) {
            let t = crate::netrx::spawn(self.id, net.clone(), self.run.clone()).map_err(|e| {
                VmmError::Vm(self.id, format!("cannot start the net receive thread: {e}"))
            })?;
            *self.rx.lock() = Some(t);
        }
        self.spawn_threads()
    }

    fn rx_irq(&self) -> bool {
        self.config.net.as_ref().is_some_and(|n| n.rx_irq)
    }

    /// Routes the reference guest's irqfd interrupts to vCPU 0 by MSI
    /// (`crate::irq_routes`, which says why): the net device's receive
    /// interrupt to NET_VECTOR, as firmware would, and the channel
    /// doorbells to DOORBELL_VECTOR.
    fn route_interrupts(&self) -> Result<(), VmmError> {
        let mut routes = Vec::new();
        if self.rx_irq() {
            routes.push((VIRTIO_NET_GSI, NET_VECTOR));
        }
        if self.windows.as_ref().is_some_and(|w| w.rung_into()) {
            routes.push((nl_abi::DOORBELL_GSI, nl_abi::DOORBELL_VECTOR));
        }
        if routes.is_empty() {
            return Ok(());
        }
        crate::irq_routes::route_to_vcpu0(&self.vm_fd, &routes)
    }

    /// Waits until the net receive thread is done with the device (after a
    /// pause or stop flag was raised).
    fn rx_barrier(&self) {
        if let (true, Some(net)) = (self.rx_irq(), &self.net) {
            crate::netrx::barrier(net);
        }
    }

    /// Starts fresh vCPU threads after [`Vm::halt_vcpus`] (e.g. after a
    /// rollback loaded older state into the vCPUs).
    pub fn relaunch(&self) -> Result<(), VmmError> {
        if self.slots().iter().any(|s| s.thread.is_some()) {
            return Err(VmmError::Vm(self.id, "vCPU threads are still running".into()));
        }
        self.run.reset();
        for s in self.slots().iter_mut() {
            s.stop = None;
        }
        self.control.poke();
        self.spawn_threads()
    }

    fn spawn_threads(&self) -> Result<(), VmmError> {
        let mut slots = self.slots();
        for (cpu, slot) in slots.iter_mut().enumerate() {
            let ctx = Arc::new(VcpuContext {
                io_bus: self.io_bus.clone(),
                mmio_bus: self.mmio_bus.clone(),
                control: self.control.clone(),
                run: self.run.clone(),
                console: self.console.clone(),
                windows: self.windows.clone(),
            });
            let (fd, stats) = (slot.fd.clone(), slot.stats.clone());
            self.run.thread_started();
            let t = std::thread::Builder::new()
                .name(format!("vm{}-vcpu{cpu}", self.id))
                .spawn(move || run_vcpu(cpu, fd, ctx, stats));
            match t {
                Ok(t) => slot.thread = Some(t),
                Err(e) => {
                    self.run.thread_ended_without_running();
                    drop(slots);
                    self.stop();
                    return Err(VmmError::Vm(self.id, format!("cannot start vCPU thread: {e}")));
                }
            }
        }
        Ok(())
    }

    fn kick_all(&self) {
        for s in self.slots().iter() {
            if let Some(t) = &s.thread {
                kick::kick(t);
            }
        }
    }

    /// Stops every vCPU at a consistent point. Returns once all are parked.
    pub fn pause(&self) {
        self.run.pause(|| self.kick_all());
        self.rx_barrier();
    }

    /// Asks every vCPU to pause and returns at once: pausing many VMs
    /// (request all, then [`Vm::pause`] each) takes the longest single
    /// pause, not the sum, and no VM waits paused for the others' pauses.
    pub fn request_pause(&self) {
        self.run.request_pause();
        self.kick_all();
    }

    /// Lets paused vCPUs run again (unless a [`Vm::hold_paused`] is out).
    pub fn resume(&self) {
        self.run.resume();
    }

    /// Keeps the VM paused until the returned hold is dropped, beside
    /// whoever else pauses it: a [`Vm::resume`] meanwhile does not let the
    /// vCPUs run, and dropping the hold does not resume a VM that someone
    /// else paused. For a short visit to a running VM's state (a fault
    /// injected by an API request or a campaign) while a supervisor pauses
    /// and resumes it for its checkpoints. One hold at a time, and never
    /// while a [`Vm::exclusive`] section runs: a checkpoint or rollback
    /// never sees a half-made visit, nor a visit a half-made checkpoint.
    pub fn hold_paused(&self) -> PauseHold<'_> {
        let section = self.pauser.lock();
        self.run.hold(|| self.kick_all());
        self.rx_barrier();
        PauseHold { vm: self, _section: section }
    }

    /// Keeps [`Vm::hold_paused`] out while the guard lives: a checkpoint
    /// supervisor's pause-capture-resume and rollback sections.
    pub fn exclusive(&self) -> nl_sync::Guard<'_, ()> {
        self.pauser.lock()
    }

    pub fn is_paused(&self) -> bool {
        self.run.paused()
    }

    /// Stops and joins all vCPU threads.
    pub fn stop(&self) {
        self.run.request_stop();
        for _ in 0..10_000 {
            let alive =
                self.slots().iter().any(|s| s.thread.as_ref().is_some_and(|t| !t.is_finished()));
            if !alive {
                break;
            }
            self.kick_all();
            std::thread::sleep(Duration::from_millis(1));
        }
        self.rx_barrier();
        self.reap();
    }

    /// Joins vCPU threads that have ended and records why.
    fn reap(&self) {
        for s in self.slots().iter_mut() {
            if s.thread.as_ref().is_some_and(|t| t.is_finished()) {
                let t = s.thread.take().expect("checked above");
                s.stop = Some(
                    t.join().unwrap_or_else(|_| VcpuStop::Internal("vCPU thread panicked".into())),
                );
            }
        }
    }

    /// Saves the VM's non-memory state. The VM must be paused (or not started).
    pub fn save_state(&self) -> Result<VmState, VmmError> {
        self.require_stopped_vcpus()?;
        self.save_state_held()
    }

    /// Saves the state of a VM whose vCPU threads a recovery holds outside
    /// KVM_RUN (not paused by the pause protocol).
    pub(crate) fn save_state_held(&self) -> Result<VmState, VmmError> {
        let vcpus = self
            .slots()
            .iter()
            .map(|s| VcpuState::save(&s.fd.lock()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(VmState {
            version: crate::state::STATE_VERSION,
            mem_bytes: self.memory.size(),
            num_vcpus: self.config.vcpus,
            timer_hz: self.config.timer_hz,
            workload: self.config.workload,
            vcpus,
            // A Linux VM (the one with an i8042) has the in-kernel PIT.
            irqchip: IrqchipState::save(&self.vm_fd, self.guest_reset.is_some())?,
            io_devices: self.io_bus.save(),
            mmio_devices: self.mmio_bus.save(),
        })
    }

    /// Loads saved state into this VM. The VM must be paused (or not started)
    /// and of the same shape.
    pub fn restore_state(&self, state: &VmState) -> Result<(), VmmError> {
        self.require_stopped_vcpus()?;
        check_compatible(&self.config, state)?;
        check_memory(&self.memory, state)?;
        self.load_state(state)
    }

    fn load_state(&self, state: &VmState) -> Result<(), VmmError> {
        // Devices first: their restore is all-or-nothing.
        self.io_bus.restore(&state.io_devices)?;
        self.mmio_bus.restore(&state.mmio_devices)?;
        state.irqchip.restore(&self.vm_fd)?;
        for (s, v) in self.slots().iter().zip(&state.vcpus) {
            v.restore(&s.fd.lock())?;
        }
        // Requests the guest had submitted while the disk was at its cap on
        // held writes were not served when this state was saved (its device
        // state says so): serve them now once under the cap, or the guest
        // would wait for them forever.
        if let Some(b) = &self.blk {
            serve_unblocked(&mut b.lock());
        }
        // The guest may now answer from another process or host (a
        // takeover, failover or restore): tell the network where it is.
        self.announce();
        Ok(())
    }

    /// Sends a gratuitous ARP for the guest's address on its TAP (no-op
    /// without a network device); whether the TAP took it.
    pub fn announce(&self) -> bool {
        match (&self.net, &self.config.net) {
            (Some(t), Some(n)) => t.lock().device_mut().announce(n.ipv4),
            _ => false,
        }
    }

    fn require_stopped_vcpus(&self) -> Result<(), VmmError> {
        if self.started.load(Relaxed) && !self.run.paused() {
            let running =
                self.slots().iter().any(|s| s.thread.as_ref().is_some_and(|t| !t.is_finished()));
            if running {
                return Err(VmmError::Vm(
                    self.id,
                    "pause the VM before saving or restoring state".into(),
                ));
            }
        }
        Ok(())
    }

    /// Stops and joins every vCPU thread, leaving the vCPUs' state in KVM
    /// for [`Vm::save_state`], [`Vm::restore_state`] and [`Vm::relaunch`].
    pub fn halt_vcpus(&self) {
        self.stop();
    }

    /// The thread ids of the VM's device threads (the net receive thread,
    /// `NetConfig::rx_irq`) that run now; 0 for one not yet running. Empty
    /// without such threads.
    pub fn io_threads(&self) -> Vec<i32> {
        self.rx.lock().iter().map(|t| t.tid.load(std::sync::atomic::Ordering::SeqCst)).collect()
    }

    /// One sample per vCPU: its thread's id and time run in guest mode, or
    /// `None` when the vCPU has no running thread (halted, finished).
    pub fn vcpu_threads(&self) -> Vec<Option<crate::progress::ThreadSample>> {
        let tids: Vec<i32> = self
            .slots()
            .iter()
            .map(|s| s.stats.tid.load(std::sync::atomic::Ordering::SeqCst))
            .collect();
        tids.into_iter()
            .map(|tid| {
                crate::progress::thread_guest_ns(tid)
                    .map(|cpu_ns| crate::progress::ThreadSample { tid, cpu_ns })
            })
            .collect()
    }

    /// The guest's operations so far by its own count: the sum over vCPUs
    /// of the last value each wrote to its heartbeat register (0 for a
    /// guest that writes none, such as Linux).
    pub fn heartbeat_ops(&self) -> u64 {
        self.control
            .vcpus
            .iter()
            .map(|r| r.heartbeat.load(std::sync::atomic::Ordering::Relaxed))
            .fold(0u64, u64::wrapping_add)
    }

    /// A value that changes whenever the guest shows progress: a heartbeat
    /// or a phase change of any vCPU (also when a restore moves them back).
    pub fn progress_marker(&self) -> u64 {
        self.control.vcpus.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, r| {
            let r = r.snapshot();
            (h ^ r.beats).wrapping_mul(0x100_0000_01b3).rotate_left(17) ^ r.phase
        })
    }

    /// How the VM's run has ended, if it has (non-blocking; no hang detection).
    pub fn poll_outcome(&self) -> Option<VmOutcome> {
        self.reap();
        if let Some((cpu, code, info)) = self.control.first_error() {
            return Some(VmOutcome::GuestError {
                cpu,
                code,
                info,
                message: describe_error(code, info),
            });
        }
        let stops: Vec<Option<VcpuStop>> = self.slots().iter().map(|s| s.stop.clone()).collect();
        if let Some((cpu, s)) = stops
            .iter()
            .enumerate()
            .find_map(|(i, s)| s.as_ref().filter(|s| s.is_crash()).map(|s| (i, s)))
        {
            return Some(VmOutcome::Crashed { cpu, message: describe_stop(s) });
        }
        if stops.iter().all(|s| *s == Some(VcpuStop::Done)) {
            return Some(VmOutcome::Completed);
        }
        if stops.iter().all(Option::is_some) {
            return Some(VmOutcome::Stopped);
        }
        None
    }

    /// One non-blocking step of supervision: how the VM's run has ended,
    /// including a guest that stopped beating (hung) or ran out of time.
    pub fn supervise(&self, s: &mut Supervision) -> Option<VmOutcome> {
        if self.linux.get().is_some() {
            // A Linux VM has no heartbeat: see crate::linux::supervise.
            if let Some(o) = crate::linux::supervise(self) {
                return Some(o);
            }
        } else {
            if let Some(o) = self.poll_outcome() {
                return Some(o);
            }
            let now_activity = (self.control.total_beats(), self.control.generation());
            if now_activity != s.activity || self.run.paused() {
                s.activity = now_activity;
                s.last_alive = Instant::now();
            } else if s.last_alive.elapsed() > self.config.heartbeat_timeout {
                let silent_ms = s.last_alive.elapsed().as_millis() as u64;
                return Some(VmOutcome::Hung { silent_ms });
            }
        }
        if s.start.elapsed() > s.limit {
            return Some(VmOutcome::TimedOut { limit_ms: s.limit.as_millis() as u64 });
        }
        None
    }

    /// Makes redundant metadata consistent from its most reliable copy (a
    /// microreset repair): each virtio queue's indices from the used ring
    /// the guest sees, and the vCPU run counts from the vCPU threads.
    /// Returns what it changed.
    pub(crate) fn repair_metadata(&self) -> Vec<String> {
        fn resync<D: nl_devices::virtio::VirtioDevice>(
            t: &Lock<MmioTransport<D>>,
            what: String,
            limit: Duration,
        ) -> Vec<String> {
            match t.try_lock_for(limit) {
                Some(mut t) => {
                    t.resync_queues().into_iter().map(|m| format!("{what} {m}")).collect()
                }
                None => vec![format!("{what}: lock held, not repaired")],
            }
        }
        let limit = Duration::from_millis(20);
        let mut out = Vec::new();
        if let Some(b) = &self.blk {
            out.extend(resync(b, format!("vm{} blk", self.id), limit));
        }
        if let Some(n) = &self.net {
            out.extend(resync(n, format!("vm{} net", self.id), limit));
        }
        let live = match self.vcpus.try_lock_for(limit) {
            Some(s) => {
                s.iter().filter(|s| s.thread.as_ref().is_some_and(|t| !t.is_finished())).count()
                    as u32
            }
            None => return out,
        };
        if let Some(m) = self.run.repair_counts(live) {
            out.push(format!("vm{} {m}", self.id));
        }
        out
    }

    /// Checks the memory-tracking metadata of the VM (a microreset repair,
    /// the paper's page-frame check): every region's mapping against its
    /// memfd, and every allocated range of the memfd against the regions.
    /// Returns the pages checked and the problems found.
    pub(crate) fn check_memory(&self) -> (u64, Vec<String>) {
        let mut problems = Vec::new();
        let size = self.memory.size();
        match self.memory.fd().metadata() {
            Ok(m) if m.len() < size => problems.push(format!(
                "vm{}: memfd holds {} bytes, the VM has {size}",
                self.id,
                m.len()
            )),
            Ok(_) => {}
            Err(e) => problems.push(format!("vm{}: memfd: {e}", self.id)),
        }
        let mut pages = 0;
        match self.memory.allocated_ranges() {
            // Guest-address ranges [start, end) whose pages are allocated:
            // each must lie inside one RAM region of the VM.
            Ok(ranges) => {
                for (start, end) in ranges {
                    pages += end.saturating_sub(start).div_ceil(4096);
                    let inside = self
                        .memory
                        .regions()
                        .iter()
                        .any(|r| start >= r.gpa && end <= r.gpa.saturating_add(r.size));
                    if start >= end || !inside {
                        problems.push(format!(
                            "vm{}: allocated range {start:#x}..{end:#x} outside guest RAM",
                            self.id
                        ));
                    }
                }
            }
            Err(e) => problems.push(format!("vm{}: {e}", self.id)),
        }
        (pages, problems)
    }

    /// Waits until the VM completes, fails, hangs, or `limit` passes.
    /// Stops the vCPUs of a VM that did not complete.
    pub fn wait(&self, limit: Duration) -> VmOutcome {
        let start = Instant::now();
        let mut gen = self.control.generation();
        let mut activity = (self.control.total_beats(), gen);
        let mut last_alive = Instant::now();
        let progress = crate::detect::track();
        let outcome = loop {
            progress.beat();
            if let Some(o) = self.poll_outcome() {
                break o;
            }
            let now_activity = (self.control.total_beats(), gen);
            if now_activity != activity || self.run.paused() {
                activity = now_activity;
                last_alive = Instant::now();
            } else if last_alive.elapsed() > self.config.heartbeat_timeout {
                break VmOutcome::Hung { silent_ms: last_alive.elapsed().as_millis() as u64 };
            }
            if start.elapsed() > limit {
                break VmOutcome::TimedOut { limit_ms: limit.as_millis() as u64 };
            }
            gen = self.control.wait_event(gen, Duration::from_millis(50));
        };
        // Stopping waits on the vCPU threads (which are checked themselves).
        progress.wait();
        if outcome != VmOutcome::Completed {
            self.stop();
        }
        outcome
    }

    /// Runs `f` on vCPU `cpu`'s fd. The vCPU must not be running (paused or halted).
    pub fn with_vcpu<R>(&self, cpu: usize, f: impl FnOnce(&VcpuFd) -> R) -> Result<R, VmmError> {
        self.require_stopped_vcpus()?;
        let slots = self.slots();
        let slot = slots.get(cpu).ok_or_else(|| VmmError::Vm(self.id, format!("no vCPU {cpu}")))?;
        let fd = slot.fd.lock();
        Ok(f(&fd))
    }

    /// The descriptor of the VM's TAP, if it has a network device.
    pub fn tap_fd(&self) -> Option<std::os::fd::RawFd> {
        self.net.as_ref().and_then(|n| n.lock().device().tap_fd())
    }

    /// Takes the TAP from behind the VM's virtio-net device (its link goes
    /// down; the device stays as a spare). For moving a service's TAP to
    /// another sandbox.
    pub fn take_tap(&self) -> Option<nl_devices::tap::Tap> {
        self.net.as_ref().and_then(|n| n.lock().device_mut().detach())
    }

    /// Puts `tap` behind the VM's virtio-net device in place of the one it
    /// has (returned), with the VM paused: the net receive thread, if one
    /// runs, is started again on the new TAP. COLO's secondary moves from
    /// its socket pair to the real TAP this way when it takes over.
    pub fn replace_tap(
        &self,
        tap: nl_devices::tap::Tap,
    ) -> Result<Option<nl_devices::tap::Tap>, VmmError> {
        let Some(net) = &self.net else {
            return Err(VmmError::Vm(self.id, "no network device".into()));
        };
        if self.started() && !self.is_paused() {
            return Err(VmmError::Vm(self.id, "pause the VM before replacing its TAP".into()));
        }
        // The old thread waits on the old TAP's descriptor: ended first.
        drop(self.rx.lock().take());
        let old = {
            let mut t = net.lock();
            let old = t.device_mut().detach();
            t.device_mut().attach(tap);
            old
        };
        if self.rx_irq() && self.started() {
            let t = crate::netrx::spawn(self.id, net.clone(), self.run.clone()).map_err(|e| {
                VmmError::Vm(self.id, format!("cannot start the net receive thread: {e}"))
            })?;
            *self.rx.lock() = Some(t);
        }
        Ok(old)
    }

    /// Puts `tap` behind the VM's virtio-net device (its link comes up);
    /// refused (the TAP handed back) without a device or with a TAP already
    /// behind it.
    pub fn attach_tap(&self, tap: nl_devices::tap::Tap) -> Result<(), nl_devices::tap::Tap> {
        let Some(n) = &self.net else { return Err(tap) };
        let mut t = n.lock();
        if t.device().attached() {
            return Err(tap);
        }
        t.device_mut().attach(tap);
        Ok(())
    }

    /// Gives the VM a memory slot (read-write) behind its state region
    /// ([`crate::windows::VmWindows::state`]) over the host mapping at
    /// `host_addr`, which the caller keeps mapped while the slot exists
    /// (a sandbox set keeps its state regions for the lifetime of its VMs;
    /// the mapping's owner is also in the windows' `keep`).
    pub fn map_state(&self, host_addr: u64) -> Result<(), VmmError> {
        self.set_state_slot(host_addr, true)
    }

    /// Removes the slot behind the state region: the guest can no longer
    /// reach it (an access exits as MMIO to nothing).
    pub fn unmap_state(&self) -> Result<(), VmmError> {
        self.set_state_slot(0, false)
    }

    fn set_state_slot(&self, host_addr: u64, on: bool) -> Result<(), VmmError> {
        let w = self.windows.as_ref();
        let Some((gpa, size)) = w.and_then(|w| w.state) else {
            return Err(VmmError::Config("this VM has no state region".into()));
        };
        let slot = (self.memory.regions().len() + w.map_or(0, |w| w.windows.len())) as u32;
        let r = kvm_userspace_memory_region {
            slot,
            flags: 0,
            guest_phys_addr: gpa,
            memory_size: if on { size } else { 0 },
            userspace_addr: host_addr,
        };
        crate::memslots::set_region(&self.vm_fd, r)
    }

    /// Turns KVM dirty-page logging on or off for all RAM slots.
    pub fn set_dirty_logging(&self, on: bool) -> Result<(), VmmError> {
        let flags = if on { kvm_bindings::KVM_MEM_LOG_DIRTY_PAGES } else { 0 };
        for (slot, (region, host)) in
            self.memory.regions().iter().zip(self.memory.host_addrs()).enumerate()
        {
            let r = kvm_userspace_memory_region {
                slot: slot as u32,
                flags,
                guest_phys_addr: region.gpa,
                memory_size: region.size,
                userspace_addr: host,
            };
            crate::memslots::set_region(&self.vm_fd, r)?;
        }
        Ok(())
    }

    /// Fetches and clears the dirty bitmap of each RAM region (bit i of a
    /// region's bitmap = its page i was written since the last call).
    pub fn dirty_bitmaps(&self) -> Result<Vec<Vec<u64>>, VmmError> {
        self.memory
            .regions()
            .iter()
            .enumerate()
            .map(|(slot, r)| {
                self.vm_fd
                    .get_dirty_log(slot as u32, r.size as usize)
                    .map_err(kvm_err("KVM_GET_DIRTY_LOG"))
            })
            .collect()
    }

    /// Switches the VM to manual dirty-log protection: from now on
    /// [`Vm::dirty_bitmaps`] only reports, and [`Vm::clear_dirty_bitmaps`]
    /// re-protects the pages chosen.
    pub fn enable_manual_dirty_protect(&self) -> Result<(), VmmError> {
        crate::dirty::enable_manual_protect(&self.vm_fd)
    }

    /// Clears and write-protects again the pages set in `bitmaps` (one per
    /// RAM region, as [`Vm::dirty_bitmaps`] returns them). Manual protection only.
    pub fn clear_dirty_bitmaps(&self, bitmaps: &[Vec<u64>]) -> Result<(), VmmError> {
        for (slot, (r, b)) in self.memory.regions().iter().zip(bitmaps).enumerate() {
            let pages = u32::try_from(r.size / 4096)
                .map_err(|_| VmmError::State("RAM region too large for one clear".into()))?;
            crate::dirty::clear_dirty_log(&self.vm_fd, slot as u32, pages, b)?;
        }
        Ok(())
    }

    /// Starts or stops recording the guest memory the VMM's own devices write
    /// (virtio DMA), which KVM's dirty log does not see, and what
    /// [`Vm::note_vmm_write`] is told.
    pub fn track_vmm_writes(&self, on: bool) {
        let mut w = self.vmm_writes.lock();
        *w = on.then(Vec::new);
        drop(w);
        if let Some(n) = &self.net {
            n.lock().track_writes(on);
        }
        if let Some(b) = &self.blk {
            b.lock().track_writes(on);
        }
    }

    /// Records a write of the VMM's own to guest memory outside the devices
    /// (a fault injected from outside a checkpoint supervisor), while
    /// [`Vm::track_vmm_writes`] is on; nothing otherwise.
    pub fn note_vmm_write(&self, gpa: u64, len: u64) {
        if let Some(w) = self.vmm_writes.lock().as_mut() {
            w.push((gpa, len));
        }
    }

    /// Guest ranges `(gpa, len)` the devices (and [`Vm::note_vmm_write`])
    /// wrote since the last call.
    pub fn take_vmm_writes(&self) -> Vec<(u64, u64)> {
        let mut out = self.vmm_writes.lock().as_mut().map(std::mem::take).unwrap_or_default();
        if let Some(n) = &self.net {
            out.extend(n.lock().take_writes());
        }
        if let Some(b) = &self.blk {
            out.extend(b.lock().take_writes());
        }
        out
    }

    /// Output commit: holds the frames the guest transmits (`true`) or sends
    /// them straight out again (`false`; returns frames still held).
    pub fn hold_net_output(&self, on: bool) -> Vec<Vec<u8>> {
        self.net.as_ref().map_or_else(Vec::new, |n| n.lock().device_mut().hold_output(on))
    }

    /// The frames held since the last call.
    pub fn take_net_output(&self) -> Vec<Vec<u8>> {
        self.net.as_ref().map_or_else(Vec::new, |n| n.lock().device_mut().take_held())
    }

    /// When the oldest held frame not yet taken was transmitted; `None`
    /// when no output waits (or no network device).
    pub fn net_output_since(&self) -> Option<std::time::Instant> {
        self.net.as_ref().and_then(|n| n.lock().device().held_since())
    }

    /// An eventfd signalled each time the network device holds a frame
    /// (output waits for its epoch's acknowledgement); `None` without a
    /// network device.
    pub fn net_output_event(&self) -> Option<std::io::Result<vmm_sys_util::eventfd::EventFd>> {
        self.net.as_ref().map(|n| n.lock().device_mut().output_event())
    }

    /// COLO's secondary: every frame the guest transmits goes to `hook`, on
    /// the transmitting vCPU thread (`None`: back to the TAP or output
    /// commit).
    pub fn set_net_output_hook(&self, hook: Option<nl_devices::virtio::net::OutputHook>) {
        if let Some(n) = &self.net {
            n.lock().device_mut().set_output_hook(hook);
        }
    }

    /// Moves frames waiting behind the network device into the guest's
    /// receive buffers now, as the receive thread does once it wakes (not
    /// while the VM is paused or stopping): COLO's secondary is fed by the
    /// thread that wrote the frame, one thread wake-up sooner.
    pub fn service_net_rx(&self) {
        if let Some(n) = &self.net {
            let mut t = n.lock();
            if !self.run.paused() && !self.run.stopping() {
                t.service(0);
            }
        }
    }

    /// COLO: keeps a copy of each frame the network device delivers to
    /// the guest (`true`; the output event is signalled for each), or stops.
    pub fn copy_net_input(&self, on: bool) {
        if let Some(n) = &self.net {
            n.lock().device_mut().copy_input(on);
        }
    }

    /// The frames delivered to the guest since the last call, in order.
    pub fn take_net_input(&self) -> Vec<Vec<u8>> {
        self.net.as_ref().map_or_else(Vec::new, |n| n.lock().device_mut().take_input())
    }

    /// Sends held frames to the TAP.
    pub fn release_net_output(&self, frames: &[Vec<u8>]) {
        if let Some(n) = &self.net {
            n.lock().device_mut().release(frames);
        }
    }

    /// Output commit for the disk: holds the guest's writes (`true`), or
    /// writes every held sector out and stops holding (`false`).
    pub fn hold_disk_writes(&self, on: bool) -> Result<(), VmmError> {
        match &self.blk {
            Some(b) => {
                let mut t = b.lock();
                let r = t.device_mut().hold_writes(on).map_err(VmmError::Disk);
                serve_unblocked(&mut t);
                r
            }
            None => Ok(()),
        }
    }

    /// Whether the VM has a disk its guest can write.
    pub fn disk_writable(&self) -> bool {
        self.blk.as_ref().is_some_and(|b| !b.lock().device().is_readonly())
    }

    /// The disk writes held since the last call, in order.
    pub fn take_disk_writes(&self) -> Vec<DiskWrite> {
        self.blk.as_ref().map_or_else(Vec::new, |b| b.lock().device_mut().take_held())
    }

    /// Writes released disk writes to the image (their epoch acknowledged).
    pub fn release_disk_writes(&self, writes: &[DiskWrite]) {
        if let Some(b) = &self.blk {
            if !writes.is_empty() {
                b.lock().device_mut().release(writes);
            }
        }
    }

    /// Serves the requests the disk left in its ring at its cap on held
    /// writes, once releases brought it under the cap. Called by whoever
    /// releases, with the VM running or paused in a consistent state (not
    /// between a rollback of memory and the restore of the device state:
    /// the queue would then be read against the wrong memory).
    pub fn serve_disk_if_unblocked(&self) {
        if let Some(b) = &self.blk {
            serve_unblocked(&mut b.lock());
        }
    }

    /// Whether the disk holds back the guest's requests at its cap on held
    /// writes: the guest may be waiting for the VMM, not hung.
    pub fn disk_waiting_at_cap(&self) -> bool {
        self.blk.as_ref().is_some_and(|b| b.lock().device().is_waiting())
    }

    /// Drops the held disk writes unwritten (the VM is fenced).
    pub fn discard_disk_writes(&self) {
        if let Some(b) = &self.blk {
            b.lock().device_mut().discard_held();
        }
    }

    /// The disk's size in sectors, if the VM has a disk.
    pub fn disk_sectors(&self) -> Option<u64> {
        self.blk.as_ref().map(|b| b.lock().device().capacity_sectors())
    }

    /// The byte ranges of the disk image that hold data (holes left out).
    pub fn disk_data_ranges(&self) -> Result<Vec<(u64, u64)>, VmmError> {
        let b = self.blk.as_ref().ok_or_else(|| VmmError::Disk("the VM has none".into()))?;
        let b = b.lock();
        let len = b.device().capacity_sectors() * nl_devices::virtio::blk::SECTOR;
        nl_memory::file_data_ranges(b.device().image(), len)
            .map_err(|e| VmmError::Disk(format!("finding the image's data: {e}")))
    }

    /// Reads the disk image (held writes excluded) at `sector`.
    pub fn read_disk(&self, sector: u64, buf: &mut [u8]) -> Result<(), VmmError> {
        let b = self.blk.as_ref().ok_or_else(|| VmmError::Disk("the VM has none".into()))?;
        b.lock()
            .device()
            .read_image(sector, buf)
            .map_err(|e| VmmError::Disk(format!("reading the image: {e}")))
    }

    pub fn id(&self) -> u32 {
        self.id
    }

    /// The guest asked for a reset (a Linux guest's reboot through the i8042).
    pub fn guest_reset_requested(&self) -> bool {
        self.guest_reset.as_ref().is_some_and(|f| f.requested())
    }

    pub fn config(&self) -> &VmConfig {
        &self.config
    }

    /// Guest RAM (enumerate regions, map by fd, register with userfaultfd).
    pub fn memory(&self) -> &GuestMemory {
        &self.memory
    }

    /// The KVM VM fd (dirty logging and other VM-wide ioctls).
    pub fn vm_fd(&self) -> &VmFd {
        &self.vm_fd
    }

    /// The control device's shared state.
    pub fn control(&self) -> &Arc<ControlState> {
        &self.control
    }

    pub fn console(&self) -> &Console {
        &self.console
    }

    /// The virtio-blk device's counters and its last reason to need a reset.
    pub fn blk_stats(&self) -> Option<(BlkStats, u32, Option<String>)> {
        self.blk.as_ref().map(|b| {
            let b = b.lock();
            (b.device().stats(), b.status(), b.last_error().map(str::to_string))
        })
    }

    /// The virtio-net device's counters, device status and last reason to need a reset.
    pub fn net_stats(&self) -> Option<(NetStats, u32, Option<String>)> {
        self.net.as_ref().map(|b| {
            let b = b.lock();
            (b.device().stats(), b.status(), b.last_error().map(str::to_string))
        })
    }

    /// Times the virtio-blk and virtio-net devices signalled their irqfds.
    pub fn virtio_interrupts(&self) -> (Option<u64>, Option<u64>) {
        (
            self.blk.as_ref().map(|t| t.lock().interrupts()),
            self.net.as_ref().map(|t| t.lock().interrupts()),
        )
    }

    /// A snapshot of the VM for reports.
    pub fn report(&self) -> VmReport {
        self.reap();
        let boot_ms = self.control.workload_start.lock()[0]
            .map(|t| t.duration_since(self.created_at).as_secs_f64() * 1e3);
        VmReport {
            id: self.id,
            mem_bytes: self.memory.size(),
            vcpus: self
                .slots()
                .iter()
                .enumerate()
                .map(|(cpu, s)| VcpuReport {
                    cpu,
                    regs: self.control.vcpus[cpu].snapshot(),
                    exits: s.stats.snapshot(),
                    stop: s.stop.clone(),
                })
                .collect(),
            paused: self.run.paused(),
            boot_ms,
            unclaimed_io: {
                let u = self.io_bus.unclaimed();
                u.reads + u.writes
            },
            unclaimed_mmio: {
                let u = self.mmio_bus.unclaimed();
                u.reads + u.writes
            },
        }
    }
}

/// Supervision state of one VM (see [`Vm::supervise`]).
pub struct Supervision {
    start: Instant,
    activity: (u64, u64),
    last_alive: Instant,
    limit: Duration,
}

impl Supervision {
    /// Time since the guest last showed progress, as of the last step.
    pub fn silent_for(&self) -> Duration {
        self.last_alive.elapsed()
    }

    pub fn new(vm: &Vm, limit: Duration) -> Self {
        Self {
            start: Instant::now(),
            activity: (vm.control.total_beats(), vm.control.generation()),
            last_alive: Instant::now(),
            limit,
        }
    }
}

type MutexGuard<'a> = nl_sync::Guard<'a, Vec<VcpuSlot>>;

fn describe_stop(s: &VcpuStop) -> String {
    match s {
        VcpuStop::TripleFault { rip } => format!("guest triple fault (last rip {rip:#x})"),
        VcpuStop::Halted { rip } => format!("guest halted with interrupts off at rip {rip:#x}"),
        VcpuStop::Internal(m) => m.clone(),
        other => format!("{other:?}"),
    }
}

fn check_compatible(config: &VmConfig, state: &VmState) -> Result<(), VmmError> {
    if state.num_vcpus != config.vcpus || state.vcpus.len() != config.vcpus as usize {
        return Err(VmmError::State(format!(
            "state has {} vCPUs, the VM has {}",
            state.num_vcpus, config.vcpus
        )));
    }
    if state.mem_bytes != config.mem_bytes {
        return Err(VmmError::State(format!(
            "state is for {} bytes of memory, the VM has {}",
            state.mem_bytes, config.mem_bytes
        )));
    }
    Ok(())
}

fn check_memory(memory: &GuestMemory, state: &VmState) -> Result<(), VmmError> {
    if memory.size() != state.mem_bytes {
        return Err(VmmError::State(format!(
            "memory holds {} bytes but the state is for {}",
            memory.size(),
            state.mem_bytes
        )));
    }
    Ok(())
}

impl Drop for Vm {
    fn drop(&mut self) {
        // End the receive thread first: it holds the device and writes guest memory.
        drop(self.rx.lock().take());
        self.stop();
    }
}

/// Serves the requests a disk left in its ring at its cap on held writes,
/// once releases (or a discard, or the end of holding) brought it under.
fn serve_unblocked(t: &mut MmioTransport<Block>) {
    if t.device_mut().take_unblocked() {
        t.service(0);
    }
}
