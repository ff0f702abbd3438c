//! virtio devices over the virtio-mmio transport (virtio 1.x, MMIO version 2).
//!
//! [`MmioTransport`] implements the register interface and the device
//! status state machine; a [`VirtioDevice`] (virtio-blk in [`blk`]) consumes
//! its queues. Descriptor chains are parsed by the rust-vmm `virtio-queue`
//! crate against the VM's guest memory.
//!
//! Queue notifications are handled synchronously: a guest write to
//! QueueNotify exits to the VMM, which processes every available chain
//! before the write completes, so a polling driver sees the used ring
//! updated right after its notify. InterruptStatus is kept up to date and,
//! when the VMM gave the transport an interrupt eventfd ([`MmioTransport::set_irq`],
//! registered with KVM as an irqfd on the device's GSI of the in-kernel
//! IOAPIC), every new used buffer (unless the driver set
//! VIRTQ_AVAIL_F_NO_INTERRUPT) and every configuration change (NEEDS_RESET)
//! signals it. The reference guest keeps polling from ring 3 and leaves the
//! IOAPIC pin masked.
//!
//! A guest that hands the device garbage (rings outside its memory, a
//! malformed avail index, a chain that loops or has no status byte) makes
//! the device set DEVICE_NEEDS_RESET and stop using the queue until the
//! driver resets it; problems confined to one request (a buffer outside
//! guest memory, an oversized request, a write to a read-only disk) only
//! fail that request with the device's error status.

pub mod blk;
pub mod held_writes;
pub mod net;

use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use crate::bus::{le_value, put_le_value, BusError, Device};

/// The VM's guest memory as the devices see it.
pub type GuestMem = GuestMemoryMmap<()>;

pub const MMIO_MAGIC: u32 = 0x7472_6976; // "virt"
pub const MMIO_VERSION: u32 = 2;
pub const VENDOR_ID: u32 = 0x4c39_4e4c; // "LN9L"
pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;

/// Device status bits.
pub const STATUS_ACKNOWLEDGE: u32 = 1;
pub const STATUS_DRIVER: u32 = 2;
pub const STATUS_DRIVER_OK: u32 = 4;
pub const STATUS_FEATURES_OK: u32 = 8;
pub const STATUS_NEEDS_RESET: u32 = 0x40;
pub const STATUS_FAILED: u32 = 0x80;

/// Interrupt status bits.
pub const INT_USED_RING: u32 = 1;
pub const INT_CONFIG: u32 = 2;

/// Register offsets of the MMIO transport.
pub mod regs {
    pub const MAGIC: u64 = 0x000;
    pub const VERSION: u64 = 0x004;
    pub const DEVICE_ID: u64 = 0x008;
    pub const VENDOR_ID: u64 = 0x00c;
    pub const DEVICE_FEATURES: u64 = 0x010;
    pub const DEVICE_FEATURES_SEL: u64 = 0x014;
    pub const DRIVER_FEATURES: u64 = 0x020;
    pub const DRIVER_FEATURES_SEL: u64 = 0x024;
    pub const QUEUE_SEL: u64 = 0x030;
    pub const QUEUE_NUM_MAX: u64 = 0x034;
    pub const QUEUE_NUM: u64 = 0x038;
    pub const QUEUE_READY: u64 = 0x044;
    pub const QUEUE_NOTIFY: u64 = 0x050;
    pub const INTERRUPT_STATUS: u64 = 0x060;
    pub const INTERRUPT_ACK: u64 = 0x064;
    pub const STATUS: u64 = 0x070;
    pub const QUEUE_DESC_LOW: u64 = 0x080;
    pub const QUEUE_DESC_HIGH: u64 = 0x084;
    pub const QUEUE_AVAIL_LOW: u64 = 0x090;
    pub const QUEUE_AVAIL_HIGH: u64 = 0x094;
    pub const QUEUE_USED_LOW: u64 = 0x0a0;
    pub const QUEUE_USED_HIGH: u64 = 0x0a4;
    pub const CONFIG_GENERATION: u64 = 0x0fc;
    pub const CONFIG: u64 = 0x100;
}

/// Why a queue could not be processed: the device needs a reset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueError(pub String);

/// A device model behind the MMIO transport.
pub trait VirtioDevice: Send {
    fn name(&self) -> &str;
    /// virtio device ID (2 = block, 1 = network).
    fn device_id(&self) -> u32;
    /// Offered features (VIRTIO_F_VERSION_1 is added by the transport).
    fn features(&self) -> u64;
    /// Maximum size of each queue.
    fn queue_max_sizes(&self) -> &[u16];
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// Processes the available chains of queue `idx`. Returns whether any
    /// chain was used; an error means the device needs a reset.
    fn process(
        &mut self,
        idx: usize,
        queue: &mut Queue,
        mem: &GuestMem,
    ) -> Result<bool, QueueError>;
    /// Serializable device-specific state (beyond the transport's).
    fn save(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
    fn restore(&mut self, _state: &serde_json::Value) -> Result<(), String> {
        Ok(())
    }
    /// Counters for reports and tests.
    fn stats(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
    /// Moves the guest ranges `(gpa, len)` the device wrote since the last
    /// call into `out` (replication must copy pages the VMM itself wrote:
    /// KVM's dirty log sees only the guest's writes).
    fn take_written(&mut self, _out: &mut Vec<(u64, u64)>) {}
}

/// Saved state of one queue (the untrusted `QueueState` of virtio-queue).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
struct SavedQueue {
    max_size: u16,
    size: u16,
    ready: bool,
    desc_table: u64,
    avail_ring: u64,
    used_ring: u64,
    next_avail: u16,
    next_used: u16,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
struct SavedTransport {
    status: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    driver_features: u64,
    queue_sel: u32,
    interrupt_status: u32,
    config_generation: u32,
    queues: Vec<SavedQueue>,
    #[serde(default)]
    bad_size: Vec<bool>,
    device: serde_json::Value,
}

/// The virtio-mmio transport around device `D`.
pub struct MmioTransport<D: VirtioDevice> {
    dev: D,
    mem: GuestMem,
    status: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    driver_features: u64,
    queue_sel: u32,
    queues: Vec<Queue>,
    /// Queues the driver gave an invalid size (the queue keeps its old one).
    bad_size: Vec<bool>,
    interrupt_status: u32,
    config_generation: u32,
    /// The last reason the device needed a reset (for reports and tests).
    last_error: Option<String>,
    /// Guest ranges the device wrote, kept while tracking is on.
    written: Option<Vec<(u64, u64)>>,
    /// Signalled to raise the device's interrupt (a KVM irqfd).
    irq: Option<EventFd>,
    /// Times `irq` was signalled.
    irqs: u64,
}

fn new_queues(sizes: &[u16]) -> Vec<Queue> {
    // Max sizes are powers of two <= 32768, chosen by the device model.
    sizes
        .iter()
        .map(|&s| Queue::new(s).unwrap_or_else(|_| Queue::new(256).expect("256 is valid")))
        .collect()
}

impl<D: VirtioDevice> MmioTransport<D> {
    pub fn new(dev: D, mem: GuestMem) -> Self {
        let queues = new_queues(dev.queue_max_sizes());
        MmioTransport {
            dev,
            mem,
            status: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            driver_features: 0,
            queue_sel: 0,
            bad_size: vec![false; queues.len()],
            queues,
            interrupt_status: 0,
            config_generation: 0,
            last_error: None,
            written: None,
            irq: None,
            irqs: 0,
        }
    }

    /// Raises the device's interrupt through `irq` from now on.
    pub fn set_irq(&mut self, irq: EventFd) {
        self.irq = Some(irq);
    }

    /// Processes queue `idx` as if the driver had notified it (a device
    /// thread delivering received frames without a notify).
    pub fn service(&mut self, idx: u32) {
        self.notify(idx);
    }

    /// Makes each ready queue's indices consistent with the used ring in
    /// guest memory, the copy the driver acts on (a microreset repair). This
    /// device completes every chain it takes within one notify, so chains
    /// taken but not published as used were abandoned halfway: `next_avail`
    /// goes back to the published used index and they are processed again.
    /// Returns a line per queue it changed.
    pub fn resync_queues(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        for (i, q) in self.queues.iter_mut().enumerate() {
            if !q.ready() || !q.is_valid(&self.mem) {
                continue;
            }
            let Ok(used) = q.used_idx(&self.mem, std::sync::atomic::Ordering::Acquire) else {
                continue;
            };
            let (avail, next_used) = (q.next_avail(), q.next_used());
            if avail != used.0 || next_used != used.0 {
                q.set_next_used(used.0);
                q.set_next_avail(used.0);
                out.push(format!(
                    "queue {i}: next_avail {avail} next_used {next_used} -> {} (used ring)",
                    used.0
                ));
            }
        }
        out
    }

    /// Times the interrupt eventfd was signalled.
    pub fn interrupts(&self) -> u64 {
        self.irqs
    }

    /// Sets `bit` in InterruptStatus and signals the interrupt.
    fn raise(&mut self, bit: u32) {
        self.interrupt_status |= bit;
        // A full eventfd counter (2^64 - 2 pending) cannot happen while KVM
        // drains it; a failed write only loses a signal the status still shows.
        if self.irq.as_ref().is_some_and(|e| e.write(1).is_ok()) {
            self.irqs += 1;
        }
    }

    /// Starts or stops recording the guest memory this device writes.
    pub fn track_writes(&mut self, on: bool) {
        self.written = on.then(Vec::new);
    }

    /// The guest ranges `(gpa, len)` written since the last call (tracking on).
    pub fn take_writes(&mut self) -> Vec<(u64, u64)> {
        self.written.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// The device model itself (output commit holds frames in virtio-net).
    pub fn device_mut(&mut self) -> &mut D {
        &mut self.dev
    }

    pub fn device(&self) -> &D {
        &self.dev
    }

    pub fn status(&self) -> u32 {
        self.status
    }

    pub fn last_error(&self) -> Option<&str> {
        self.last_error.as_deref()
    }

    fn offered(&self) -> u64 {
        self.dev.features() | VIRTIO_F_VERSION_1
    }

    fn reset(&mut self) {
        self.status = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.driver_features = 0;
        self.queue_sel = 0;
        self.interrupt_status = 0;
        self.queues = new_queues(self.dev.queue_max_sizes());
        self.bad_size = vec![false; self.queues.len()];
        self.last_error = None;
    }

    fn selected(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(self.queue_sel as usize)
    }

    /// Queue registers may only change while the driver sets the device up.
    fn queue_writable(&self) -> bool {
        self.status & (STATUS_DRIVER_OK | STATUS_NEEDS_RESET | STATUS_FAILED) == 0
    }

    fn needs_reset(&mut self, why: String) {
        self.status |= STATUS_NEEDS_RESET;
        self.last_error = Some(why);
        self.raise(INT_CONFIG);
    }

    fn set_status(&mut self, v: u32) {
        if v == 0 {
            self.reset();
            return;
        }
        // FEATURES_OK only sticks when the driver accepted VERSION_1 and
        // nothing that was not offered.
        let mut v = v;
        if v & STATUS_FEATURES_OK != 0 && self.status & STATUS_FEATURES_OK == 0 {
            let ok = self.driver_features & VIRTIO_F_VERSION_1 != 0
                && self.driver_features & !self.offered() == 0;
            if !ok {
                v &= !STATUS_FEATURES_OK;
            }
        }
        // The driver cannot clear bits other than by a reset; NEEDS_RESET is the device's.
        self.status = (self.status & STATUS_NEEDS_RESET) | (v & !STATUS_NEEDS_RESET);
    }

    fn notify(&mut self, idx: u32) {
        let ready = self.status & STATUS_DRIVER_OK != 0
            && self.status & (STATUS_NEEDS_RESET | STATUS_FAILED) == 0;
        if !ready {
            return;
        }
        let Some(q) = self.queues.get_mut(idx as usize) else {
            return;
        };
        if self.bad_size[idx as usize] {
            self.needs_reset(format!("queue {idx}: the driver set an invalid queue size"));
            return;
        }
        if !q.is_valid(&self.mem) {
            self.needs_reset(format!("queue {idx}: rings outside guest memory or queue not ready"));
            return;
        }
        let avail = q.avail_ring();
        let r = self.dev.process(idx as usize, q, &self.mem);
        let mut dev_writes = Vec::new();
        self.dev.take_written(&mut dev_writes);
        if let Some(w) = self.written.as_mut() {
            // The used ring: flags, idx, size elements of 8 bytes, avail_event.
            w.push((q.used_ring(), 6 + 8 * u64::from(q.size())));
            w.extend(dev_writes);
        }
        match r {
            Ok(true) => {
                // The driver may have asked for no interrupts (it polls):
                // VIRTQ_AVAIL_F_NO_INTERRUPT in the avail ring's flags.
                let flags: u16 =
                    vm_memory::Bytes::read_obj(&self.mem, vm_memory::GuestAddress(avail))
                        .unwrap_or(0);
                if flags & 1 == 0 {
                    self.raise(INT_USED_RING);
                } else {
                    self.interrupt_status |= INT_USED_RING;
                }
            }
            Ok(false) => {}
            Err(QueueError(why)) => self.needs_reset(format!("queue {idx}: {why}")),
        }
    }

    fn read32(&self, off: u64) -> u32 {
        let q = self.queues.get(self.queue_sel as usize);
        match off {
            regs::MAGIC => MMIO_MAGIC,
            regs::VERSION => MMIO_VERSION,
            regs::DEVICE_ID => self.dev.device_id(),
            regs::VENDOR_ID => VENDOR_ID,
            regs::DEVICE_FEATURES => match self.device_features_sel {
                0 => self.offered() as u32,
                1 => (self.offered() >> 32) as u32,
                _ => 0,
            },
            regs::QUEUE_NUM_MAX => q.map_or(0, |q| u32::from(q.max_size())),
            regs::QUEUE_READY => q.map_or(0, |q| u32::from(q.ready())),
            regs::INTERRUPT_STATUS => self.interrupt_status,
            regs::STATUS => self.status,
            regs::CONFIG_GENERATION => self.config_generation,
            _ => 0,
        }
    }

    fn write32(&mut self, off: u64, v: u32) {
        let setup = self.queue_writable();
        match off {
            regs::DEVICE_FEATURES_SEL => self.device_features_sel = v,
            regs::DRIVER_FEATURES_SEL => self.driver_features_sel = v,
            regs::DRIVER_FEATURES if self.status & STATUS_FEATURES_OK == 0 => {
                match self.driver_features_sel {
                    0 => {
                        self.driver_features = (self.driver_features & !0xffff_ffff) | u64::from(v)
                    }
                    1 => {
                        self.driver_features =
                            (self.driver_features & 0xffff_ffff) | (u64::from(v) << 32)
                    }
                    _ => {}
                }
            }
            regs::QUEUE_SEL => self.queue_sel = v,
            regs::QUEUE_NUM if setup => {
                let sel = self.queue_sel as usize;
                if let Some(q) = self.queues.get_mut(sel) {
                    // An invalid size (0, not a power of two, above the
                    // maximum) makes the next notify of this queue fail.
                    let ok = u16::try_from(v).is_ok_and(|v| q.try_set_size(v).is_ok());
                    self.bad_size[sel] = !ok;
                }
            }
            regs::QUEUE_READY if setup => {
                if let Some(q) = self.selected() {
                    q.set_ready(v == 1);
                }
            }
            regs::QUEUE_DESC_LOW if setup => {
                if let Some(q) = self.selected() {
                    q.set_desc_table_address(Some(v), None)
                }
            }
            regs::QUEUE_DESC_HIGH if setup => {
                if let Some(q) = self.selected() {
                    q.set_desc_table_address(None, Some(v))
                }
            }
            regs::QUEUE_AVAIL_LOW if setup => {
                if let Some(q) = self.selected() {
                    q.set_avail_ring_address(Some(v), None)
                }
            }
            regs::QUEUE_AVAIL_HIGH if setup => {
                if let Some(q) = self.selected() {
                    q.set_avail_ring_address(None, Some(v))
                }
            }
            regs::QUEUE_USED_LOW if setup => {
                if let Some(q) = self.selected() {
                    q.set_used_ring_address(Some(v), None)
                }
            }
            regs::QUEUE_USED_HIGH if setup => {
                if let Some(q) = self.selected() {
                    q.set_used_ring_address(None, Some(v))
                }
            }
            regs::QUEUE_NOTIFY => self.notify(v),
            regs::INTERRUPT_ACK => self.interrupt_status &= !v,
            regs::STATUS => self.set_status(v),
            _ => {}
        }
    }
}

impl<D: VirtioDevice> Device for MmioTransport<D> {
    fn name(&self) -> &str {
        self.dev.name()
    }

    fn read(&mut self, _cpu: usize, offset: u64, data: &mut [u8]) {
        if offset >= regs::CONFIG {
            self.dev.read_config(offset - regs::CONFIG, data);
        } else if data.len() == 4 && offset.is_multiple_of(4) {
            put_le_value(data, u64::from(self.read32(offset)));
        } else {
            data.fill(0);
        }
    }

    fn write(&mut self, _cpu: usize, offset: u64, data: &[u8]) {
        // The transport's registers are 32-bit; other widths are ignored.
        if offset < regs::CONFIG && data.len() == 4 && offset.is_multiple_of(4) {
            self.write32(offset, le_value(data) as u32);
        }
    }

    fn save(&self) -> serde_json::Value {
        let s = SavedTransport {
            status: self.status,
            device_features_sel: self.device_features_sel,
            driver_features_sel: self.driver_features_sel,
            driver_features: self.driver_features,
            queue_sel: self.queue_sel,
            interrupt_status: self.interrupt_status,
            config_generation: self.config_generation,
            queues: self
                .queues
                .iter()
                .map(|q| SavedQueue {
                    max_size: q.max_size(),
                    size: q.size(),
                    ready: q.ready(),
                    desc_table: q.desc_table(),
                    avail_ring: q.avail_ring(),
                    used_ring: q.used_ring(),
                    next_avail: q.next_avail(),
                    next_used: q.next_used(),
                })
                .collect(),
            bad_size: self.bad_size.clone(),
            device: self.dev.save(),
        };
        serde_json::to_value(s).unwrap_or(serde_json::Value::Null)
    }

    fn restore(&mut self, state: &serde_json::Value) -> Result<(), BusError> {
        let name = self.dev.name().to_string();
        let bad = |why: String| BusError::BadState { name: name.clone(), why };
        let s: SavedTransport =
            serde_json::from_value(state.clone()).map_err(|e| bad(e.to_string()))?;
        let maxes = self.dev.queue_max_sizes();
        if s.queues.len() != maxes.len()
            || s.queues.iter().zip(maxes).any(|(q, &m)| q.max_size != m)
        {
            return Err(bad("queue layout differs".into()));
        }
        let mut queues = new_queues(maxes);
        for (q, sq) in queues.iter_mut().zip(&s.queues) {
            // Untrusted values go through the same setters as guest writes.
            q.set_size(sq.size);
            q.set_ready(sq.ready);
            q.set_desc_table_address(
                Some(sq.desc_table as u32),
                Some((sq.desc_table >> 32) as u32),
            );
            q.set_avail_ring_address(
                Some(sq.avail_ring as u32),
                Some((sq.avail_ring >> 32) as u32),
            );
            q.set_used_ring_address(Some(sq.used_ring as u32), Some((sq.used_ring >> 32) as u32));
            q.set_next_avail(sq.next_avail);
            q.set_next_used(sq.next_used);
        }
        self.dev.restore(&s.device).map_err(bad)?;
        self.bad_size =
            (0..queues.len()).map(|i| s.bad_size.get(i).copied().unwrap_or(false)).collect();
        self.queues = queues;
        self.status = s.status;
        self.device_features_sel = s.device_features_sel;
        self.driver_features_sel = s.driver_features_sel;
        self.driver_features = s.driver_features;
        self.queue_sel = s.queue_sel;
        self.interrupt_status = s.interrupt_status;
        self.config_generation = s.config_generation;
        Ok(())
    }
}

/// Pops every available chain of `queue`, calling `f` with each; an avail
/// ring the queue cannot read is a queue error.
/// The next descriptor chain the driver made available, if any.
pub(crate) fn next_chain<'m>(
    queue: &mut Queue,
    mem: &'m GuestMem,
) -> Result<Option<virtio_queue::DescriptorChain<&'m GuestMem>>, QueueError> {
    let mut it =
        queue.iter(mem).map_err(|e| QueueError(format!("cannot read the avail ring: {e}")))?;
    Ok(it.next())
}

pub(crate) fn for_each_chain(
    queue: &mut Queue,
    mem: &GuestMem,
    mut f: impl FnMut(virtio_queue::DescriptorChain<&GuestMem>) -> Result<(u16, u32), QueueError>,
) -> Result<bool, QueueError> {
    for_each_chain_while(queue, mem, &mut f, |_| true, |f, c| f(c))
}

/// [`for_each_chain`] over a device `dev`, taking the next chain only while
/// `more(dev)` says so (the chains not taken stay in the ring for a later
/// notify or service).
pub(crate) fn for_each_chain_while<S: ?Sized>(
    queue: &mut Queue,
    mem: &GuestMem,
    dev: &mut S,
    mut more: impl FnMut(&mut S) -> bool,
    mut f: impl FnMut(
        &mut S,
        virtio_queue::DescriptorChain<&GuestMem>,
    ) -> Result<(u16, u32), QueueError>,
) -> Result<bool, QueueError> {
    let mut used = false;
    // At most one queue's worth per notify, whatever the guest does to the
    // avail index meanwhile (another vCPU may keep adding chains).
    for _ in 0..queue.size() {
        if !more(dev) {
            break;
        }
        let Some(chain) = next_chain(queue, mem)? else { break };
        let (head, len) = f(dev, chain)?;
        queue
            .add_used(mem, head, len)
            .map_err(|e| QueueError(format!("cannot write the used ring: {e}")))?;
        used = true;
    }
    Ok(used)
}

/// The descriptors of one chain, at most `max`. A chain that is longer, or
/// that the iterator cut short while it still said "next" (a loop, a next
/// index outside the table, a table outside guest memory), is a queue error.
pub(crate) fn collect_chain(
    chain: virtio_queue::DescriptorChain<&GuestMem>,
    max: usize,
) -> Result<(u16, Vec<virtio_queue::desc::split::Descriptor>), QueueError> {
    let head = chain.head_index();
    let mut descs = Vec::with_capacity(4);
    let mut last_has_next = false;
    for d in chain {
        if descs.len() == max {
            return Err(QueueError(format!("descriptor chain at {head} is longer than {max}")));
        }
        last_has_next = d.has_next();
        descs.push(d);
    }
    if last_has_next {
        return Err(QueueError(format!("descriptor chain at {head} loops or leaves guest memory")));
    }
    if descs.is_empty() {
        return Err(QueueError(format!("descriptor chain at {head} is empty or unreadable")));
    }
    Ok((head, descs))
}
