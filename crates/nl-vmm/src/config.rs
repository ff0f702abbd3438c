//! What a VM is made of.

use std::sync::Arc;
use std::time::Duration;

use nl_abi::WorkloadParams;

/// Configuration of one VM.
#[derive(Clone, Debug)]
pub struct VmConfig {
    pub mem_bytes: u64,
    pub vcpus: u32,
    pub workload: WorkloadParams,
    /// Kernel ELF image (ring 0).
    pub kernel: Arc<Vec<u8>>,
    /// User program ELF image (ring 3).
    pub user: Arc<Vec<u8>>,
    /// Where console output goes, in addition to an in-memory tail.
    pub console_path: Option<std::path::PathBuf>,
    /// LAPIC timer frequency the guest programs.
    pub timer_hz: u64,
    /// The VM is declared hung when the guest shows no control-device
    /// activity for this long while running.
    pub heartbeat_timeout: Duration,
    /// A virtio-blk disk backed by this raw image file.
    pub disk: Option<DiskConfig>,
    /// A virtio-net device on this host TAP interface.
    pub net: Option<NetConfig>,
}

/// A virtio-net device.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NetConfig {
    /// TAP interface (attached, or created if missing, in the VMM's network namespace).
    pub tap: String,
    /// The guest's address and prefix length.
    pub ipv4: [u8; 4],
    pub prefix: u8,
    /// A VMM thread moves frames from the TAP into posted receive buffers
    /// as they arrive and raises the device's interrupt (GSI
    /// [`nl_abi::VIRTIO_NET_GSI`] routed by MSI to [`nl_abi::NET_VECTOR`]), so the
    /// guest may halt when idle instead of polling (experimental).
    #[serde(default)]
    pub rx_irq: bool,
    /// Bring the host end of the TAP up with this address and prefix
    /// (`--net-host-ip`); `None` leaves the TAP as it is.
    #[serde(default)]
    pub host_ip: Option<([u8; 4], u8)>,
    /// The guest's MAC address (default 52:54:00:4e:4c:ID).
    #[serde(default)]
    pub mac: Option<[u8; 6]>,
    /// A spare device: `tap` is not opened, the link is down and the
    /// guest is told it is a standby ([`nl_abi::NET_STANDBY`]) until a TAP
    /// is attached ([`crate::Vm::attach_tap`]; sandbox service takeover).
    #[serde(default)]
    pub spare: bool,
    /// A port on a shared link instead of a TAP of its own: `tap` (the
    /// link's TAP, for reports) is not opened; the device receives
    /// through the port's packet socket on the link's TAP and sends to
    /// the TAP, which the set owns (`nl_sandbox::shared_link`). Not
    /// carried in records: a set with a
    /// shared link is not carried across a rejuvenation.
    #[serde(skip)]
    pub port: Option<nl_devices::tap::Port>,
}

/// A virtio-blk disk.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DiskConfig {
    pub path: std::path::PathBuf,
    pub readonly: bool,
}

impl VmConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.vcpus == 0 || self.vcpus > nl_abi::MAX_VCPUS {
            return Err(format!(
                "--vcpus {} is out of range: between 1 and {} are supported",
                self.vcpus,
                nl_abi::MAX_VCPUS
            ));
        }
        nl_memory::GuestMemory::check_size(self.mem_bytes).map_err(|e| e.to_string())?;
        if !(10..=10_000).contains(&self.timer_hz) {
            return Err(format!("timer frequency {} Hz is out of range 10..=10000", self.timer_hz));
        }
        let heap =
            self.mem_bytes.min(nl_abi::MMIO_HOLE_START) - nl_abi::USER_HEAP_GPA - nl_abi::DMA_BYTES;
        let need = self.workload.ws_bytes.saturating_mul(u64::from(self.vcpus));
        if need > heap {
            return Err(format!(
                "guest memory too small: {} vCPUs x {} MiB working set need {} MiB of heap, \
                 but {} MiB of memory leave only {} MiB (raise --mem or lower --ws)",
                self.vcpus,
                self.workload.ws_bytes >> 20,
                need >> 20,
                self.mem_bytes >> 20,
                heap >> 20
            ));
        }
        Ok(())
    }
}
