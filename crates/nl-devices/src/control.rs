//! The paravirtual control device (see `nl_abi::reg`).
//!
//! Each vCPU owns a block of 64-bit registers. The guest writes its heartbeat,
//! workload phase, results and errors there; the VMM reads them without
//! stopping the guest through [`ControlState`], shared with the monitor.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use nl_sync::{Condvar, Lock};
use std::time::Instant;

use nl_abi::{reg, CONTROL_BLOCK_SIZE, CONTROL_MAGIC, MAX_VCPUS};
use serde::{Deserialize, Serialize};

use crate::bus::{le_value, put_le_value, BusError, Device};
use crate::serial::Console;

/// Register values of one vCPU's block.
#[derive(Default)]
pub struct VcpuRegs {
    pub heartbeat: AtomicU64,
    /// Heartbeat writes seen (progress even if the value does not change).
    pub beats: AtomicU64,
    pub phase: AtomicU64,
    pub ops: AtomicU64,
    pub warmup_ops: AtomicU64,
    pub digest: AtomicU64,
    pub error: AtomicU64,
    pub error_info: AtomicU64,
    pub cycles: AtomicU64,
    pub rounds: AtomicU64,
    pub scratch: AtomicU64,
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    pub net_irqs: AtomicU64,
    pub net_irq_wakes: AtomicU64,
    pub net_other_wakes: AtomicU64,
}

/// Serializable copy of [`VcpuRegs`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VcpuRegsSnapshot {
    pub heartbeat: u64,
    pub beats: u64,
    pub phase: u64,
    pub ops: u64,
    pub warmup_ops: u64,
    pub digest: u64,
    pub error: u64,
    pub error_info: u64,
    pub cycles: u64,
    pub rounds: u64,
    pub scratch: u64,
    /// filecache: requests served from the cache / read from the disk so far
    /// (absent in states saved before these registers existed).
    #[serde(default)]
    pub cache_hits: u64,
    #[serde(default)]
    pub cache_misses: u64,
    /// netbench, kv: net interrupts the guest took, and its idle halts
    /// ended by one or by something else (absent in older states).
    #[serde(default)]
    pub net_irqs: u64,
    #[serde(default)]
    pub net_irq_wakes: u64,
    #[serde(default)]
    pub net_other_wakes: u64,
}

impl VcpuRegs {
    pub fn snapshot(&self) -> VcpuRegsSnapshot {
        VcpuRegsSnapshot {
            heartbeat: self.heartbeat.load(Relaxed),
            beats: self.beats.load(Relaxed),
            phase: self.phase.load(Relaxed),
            ops: self.ops.load(Relaxed),
            warmup_ops: self.warmup_ops.load(Relaxed),
            digest: self.digest.load(Relaxed),
            error: self.error.load(Relaxed),
            error_info: self.error_info.load(Relaxed),
            cycles: self.cycles.load(Relaxed),
            rounds: self.rounds.load(Relaxed),
            scratch: self.scratch.load(Relaxed),
            cache_hits: self.cache_hits.load(Relaxed),
            cache_misses: self.cache_misses.load(Relaxed),
            net_irqs: self.net_irqs.load(Relaxed),
            net_irq_wakes: self.net_irq_wakes.load(Relaxed),
            net_other_wakes: self.net_other_wakes.load(Relaxed),
        }
    }

    fn set(&self, s: &VcpuRegsSnapshot) {
        self.heartbeat.store(s.heartbeat, Relaxed);
        self.beats.store(s.beats, Relaxed);
        self.phase.store(s.phase, Relaxed);
        self.ops.store(s.ops, Relaxed);
        self.warmup_ops.store(s.warmup_ops, Relaxed);
        self.digest.store(s.digest, Relaxed);
        self.error.store(s.error, Relaxed);
        self.error_info.store(s.error_info, Relaxed);
        self.cycles.store(s.cycles, Relaxed);
        self.rounds.store(s.rounds, Relaxed);
        self.scratch.store(s.scratch, Relaxed);
        self.cache_hits.store(s.cache_hits, Relaxed);
        self.cache_misses.store(s.cache_misses, Relaxed);
        self.net_irqs.store(s.net_irqs, Relaxed);
        self.net_irq_wakes.store(s.net_irq_wakes, Relaxed);
        self.net_other_wakes.store(s.net_other_wakes, Relaxed);
    }
}

/// State shared between the control device and the VMM's monitor.
pub struct ControlState {
    pub vcpus: Vec<VcpuRegs>,
    /// Host time at which each vCPU first wrote PHASE_WORKLOAD_START.
    pub workload_start: Arc<Lock<Vec<Option<Instant>>>>,
    /// Bumped and notified on every phase change and error.
    events: Arc<Lock<u64>>,
    cond: Condvar,
}

impl ControlState {
    pub fn new(num_vcpus: usize) -> Arc<Self> {
        Arc::new(Self {
            vcpus: (0..num_vcpus).map(|_| VcpuRegs::default()).collect(),
            workload_start: Lock::new("control.workload_start", vec![None; num_vcpus]),
            events: Lock::new("control.events", 0),
            cond: Condvar::new(),
        })
    }

    fn notify(&self) {
        let mut g = self.events.lock();
        *g += 1;
        self.cond.notify_all();
    }

    /// Wakes anyone blocked in [`ControlState::wait_event`] (used by the VMM
    /// when a vCPU stops for a reason the guest did not report itself).
    pub fn poke(&self) {
        self.notify();
    }

    /// Current event generation.
    pub fn generation(&self) -> u64 {
        *self.events.lock()
    }

    /// Blocks until the event generation differs from `seen` or `timeout` passes.
    pub fn wait_event(&self, seen: u64, timeout: std::time::Duration) -> u64 {
        let deadline = std::time::Instant::now() + timeout;
        let mut g = self.events.lock();
        while *g == seen {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            g.wait_for(&self.cond, left);
        }
        *g
    }

    /// The first guest-reported error of any vCPU: (vCPU, code, info).
    pub fn first_error(&self) -> Option<(usize, u64, u64)> {
        self.vcpus.iter().enumerate().find_map(|(i, r)| {
            let e = r.error.load(Relaxed);
            (e != 0).then(|| (i, e, r.error_info.load(Relaxed)))
        })
    }

    /// Sum of heartbeat writes of all vCPUs (liveness).
    pub fn total_beats(&self) -> u64 {
        self.vcpus.iter().map(|r| r.beats.load(Relaxed)).sum()
    }
}

/// Describes a guest error code for humans.
pub fn describe_error(code: u64, info: u64) -> String {
    const NAMES: [&str; 32] = [
        "divide error",
        "debug",
        "NMI",
        "breakpoint",
        "overflow",
        "bound range",
        "invalid opcode",
        "device not available",
        "double fault",
        "coprocessor overrun",
        "invalid TSS",
        "segment not present",
        "stack fault",
        "general protection",
        "page fault",
        "reserved",
        "x87 error",
        "alignment check",
        "machine check",
        "SIMD error",
        "virtualization",
        "control protection",
        "reserved",
        "reserved",
        "reserved",
        "reserved",
        "reserved",
        "reserved",
        "hypervisor injection",
        "VMM communication",
        "security",
        "reserved",
    ];
    match code {
        c if (nl_abi::ERR_EXCEPTION_BASE..nl_abi::ERR_EXCEPTION_BASE + 256).contains(&c) => {
            let v = (c - nl_abi::ERR_EXCEPTION_BASE) as usize;
            let name = NAMES.get(v).copied().unwrap_or("unexpected interrupt");
            format!("unhandled guest exception {v} ({name}) at rip {info:#x}")
        }
        nl_abi::ERR_SELF_CHECK => format!("workload self-check failed in round {info}"),
        nl_abi::ERR_BAD_BOOT_INFO => "guest rejected its boot information".to_string(),
        nl_abi::ERR_KERNEL_PANIC => format!("guest kernel panic (info {info:#x})"),
        nl_abi::ERR_USER_PANIC => format!("guest user program panic (info {info:#x})"),
        nl_abi::ERR_DEVICE => format!("guest device error: {}", device_error(info)),
        nl_abi::ERR_CHANNEL_VIOLATION => {
            format!("isolation violation: write to the read-only channel page at {info:#x}")
        }
        c => format!("guest error {c:#x} (info {info:#x})"),
    }
}

/// Meaning of ERR_DEVICE's info: `DEVERR_*` in the high 32 bits, a count
/// or detail in the low 32.
fn device_error(info: u64) -> String {
    let detail = info & 0xffff_ffff;
    match info >> 32 {
        nl_abi::DEVERR_NO_BLK => "the workload needs a virtio-blk disk, the VM has none".into(),
        nl_abi::DEVERR_BLK_INIT => format!("virtio-blk set-up failed (step {detail})"),
        nl_abi::DEVERR_BLK_SMALL => {
            format!("the virtio-blk disk is too small ({detail} MiB)")
        }
        nl_abi::DEVERR_BLK_IO => format!("{detail} virtio-blk requests failed"),
        nl_abi::DEVERR_NO_NET => "the workload needs a network device, the VM has none".into(),
        nl_abi::DEVERR_NET_INIT => format!("virtio-net set-up failed (step {detail})"),
        _ => format!("code {info:#x}"),
    }
}

/// The MMIO device in front of [`ControlState`].
pub struct ControlDevice {
    state: Arc<ControlState>,
    console: Console,
}

impl ControlDevice {
    pub fn new(state: Arc<ControlState>, console: Console) -> Self {
        Self { state, console }
    }

    /// Bytes the device occupies on the MMIO bus.
    pub fn mmio_len(num_vcpus: usize) -> u64 {
        num_vcpus.min(MAX_VCPUS as usize) as u64 * CONTROL_BLOCK_SIZE
    }
}

impl Device for ControlDevice {
    fn name(&self) -> &str {
        "control"
    }

    fn read(&mut self, _cpu: usize, offset: u64, data: &mut [u8]) {
        let block = (offset / CONTROL_BLOCK_SIZE) as usize;
        let Some(r) = self.state.vcpus.get(block) else {
            data.fill(0xff);
            return;
        };
        let v = match offset % CONTROL_BLOCK_SIZE {
            reg::MAGIC => CONTROL_MAGIC,
            reg::SCRATCH => r.scratch.load(Relaxed),
            reg::HEARTBEAT => r.heartbeat.load(Relaxed),
            reg::PHASE => r.phase.load(Relaxed),
            _ => u64::MAX,
        };
        put_le_value(data, v);
    }

    fn write(&mut self, _cpu: usize, offset: u64, data: &[u8]) {
        let block = (offset / CONTROL_BLOCK_SIZE) as usize;
        let Some(r) = self.state.vcpus.get(block) else { return };
        let v = le_value(data);
        match offset % CONTROL_BLOCK_SIZE {
            reg::HEARTBEAT => {
                r.heartbeat.store(v, Relaxed);
                r.beats.fetch_add(1, Relaxed);
            }
            reg::PHASE => {
                if v == nl_abi::PHASE_WORKLOAD_START {
                    let mut s = self.state.workload_start.lock();
                    s[block].get_or_insert_with(Instant::now);
                }
                r.phase.store(v, Relaxed);
                self.state.notify();
            }
            reg::OPS => r.ops.store(v, Relaxed),
            reg::WARMUP_OPS => r.warmup_ops.store(v, Relaxed),
            reg::DIGEST => r.digest.store(v, Relaxed),
            reg::ERROR_INFO => r.error_info.store(v, Relaxed),
            reg::ERROR => {
                // Keep the first error: later ones are usually consequences.
                let _ = r.error.compare_exchange(0, v.max(1), Relaxed, Relaxed);
                self.state.notify();
            }
            reg::CYCLES => r.cycles.store(v, Relaxed),
            reg::ROUNDS => r.rounds.store(v, Relaxed),
            reg::SCRATCH => r.scratch.store(v, Relaxed),
            reg::CACHE_HITS => r.cache_hits.store(v, Relaxed),
            reg::CACHE_MISSES => r.cache_misses.store(v, Relaxed),
            reg::NET_IRQS => r.net_irqs.store(v, Relaxed),
            reg::NET_IRQ_WAKES => r.net_irq_wakes.store(v, Relaxed),
            reg::NET_OTHER_WAKES => r.net_other_wakes.store(v, Relaxed),
            reg::PRINT => self.console.write_bytes(&[v as u8]),
            _ => {}
        }
    }

    fn save(&self) -> serde_json::Value {
        let regs: Vec<_> = self.state.vcpus.iter().map(VcpuRegs::snapshot).collect();
        serde_json::to_value(regs).expect("plain struct serializes")
    }

    fn restore(&mut self, state: &serde_json::Value) -> Result<(), BusError> {
        let regs: Vec<VcpuRegsSnapshot> = serde_json::from_value(state.clone())
            .map_err(|e| BusError::BadState { name: "control".into(), why: e.to_string() })?;
        if regs.len() != self.state.vcpus.len() {
            return Err(BusError::BadState {
                name: "control".into(),
                why: format!(
                    "{} vCPU blocks saved, {} present",
                    regs.len(),
                    self.state.vcpus.len()
                ),
            });
        }
        for (r, s) in self.state.vcpus.iter().zip(&regs) {
            r.set(s);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registers_and_events() {
        let st = ControlState::new(2);
        let mut dev = ControlDevice::new(st.clone(), Console::buffer());
        let mut d = [0u8; 8];
        dev.read(0, reg::MAGIC, &mut d);
        assert_eq!(u64::from_le_bytes(d), CONTROL_MAGIC);
        let g = st.generation();
        dev.write(1, CONTROL_BLOCK_SIZE + reg::PHASE, &nl_abi::PHASE_WORKLOAD_START.to_le_bytes());
        assert_ne!(st.generation(), g);
        assert!(st.workload_start.lock()[1].is_some());
        dev.write(0, reg::SCRATCH, &0x55u64.to_le_bytes());
        dev.read(0, reg::SCRATCH, &mut d);
        assert_eq!(u64::from_le_bytes(d), 0x55);
        dev.write(1, CONTROL_BLOCK_SIZE + reg::CACHE_HITS, &7u64.to_le_bytes());
        dev.write(1, CONTROL_BLOCK_SIZE + reg::CACHE_MISSES, &3u64.to_le_bytes());
        assert_eq!(
            (st.vcpus[1].snapshot().cache_hits, st.vcpus[1].snapshot().cache_misses),
            (7, 3)
        );
        dev.write(1, CONTROL_BLOCK_SIZE + reg::ERROR_INFO, &9u64.to_le_bytes());
        dev.write(1, CONTROL_BLOCK_SIZE + reg::ERROR, &0x10eu64.to_le_bytes());
        dev.write(1, CONTROL_BLOCK_SIZE + reg::ERROR, &0x200u64.to_le_bytes());
        assert_eq!(st.first_error(), Some((1, 0x10e, 9)));
        assert!(describe_error(0x10e, 9).contains("page fault"));
        // Out of range blocks: ignored / all ones.
        dev.write(0, 7 * CONTROL_BLOCK_SIZE + reg::ERROR, &1u64.to_le_bytes());
        dev.read(0, 7 * CONTROL_BLOCK_SIZE, &mut d);
        assert_eq!(d, [0xff; 8]);
        let saved = dev.save();
        dev.write(0, reg::SCRATCH, &1u64.to_le_bytes());
        dev.restore(&saved).unwrap();
        assert_eq!(st.vcpus[0].scratch.load(Relaxed), 0x55);
        assert_eq!(st.vcpus[1].cache_hits.load(Relaxed), 7);
        assert!(dev.restore(&serde_json::json!([1, 2])).is_err());
        // A state saved before the cache registers existed still restores.
        let mut old = saved.clone();
        for r in old.as_array_mut().unwrap() {
            let o = r.as_object_mut().unwrap();
            o.remove("cache_hits");
            o.remove("cache_misses");
        }
        dev.restore(&old).unwrap();
        assert_eq!(st.vcpus[1].cache_hits.load(Relaxed), 0);
    }
}
