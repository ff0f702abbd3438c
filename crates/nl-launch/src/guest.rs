//! From command-line arguments to VM configurations for the reference guest.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use nl_abi::WorkloadParams;
use nl_vmm::{DiskConfig, NetConfig, VmConfig};

/// Parses "A.B.C.D/N".
pub fn parse_cidr(s: &str) -> Result<([u8; 4], u8)> {
    let (ip, prefix) = s.split_once('/').unwrap_or((s, "24"));
    let ip: std::net::Ipv4Addr =
        ip.parse().map_err(|_| anyhow::anyhow!("--net-ip {s}: not an IPv4 address"))?;
    let prefix: u8 = prefix
        .parse()
        .ok()
        .filter(|p| (1..=32).contains(p))
        .ok_or_else(|| anyhow::anyhow!("--net-ip {s}: prefix must be 1..=32"))?;
    Ok((ip.octets(), prefix))
}

/// Size of a disk image `--disk` creates when the file is missing.
pub const DEFAULT_DISK_BYTES: u64 = 256 << 20;

pub use nl_workloads::disk_needed;

/// Size of the image to create for a workload: 256 MiB, or more if it needs more.
pub fn disk_size_for(w: &WorkloadParams) -> u64 {
    disk_needed(w).map_or(DEFAULT_DISK_BYTES, |n| n.max(DEFAULT_DISK_BYTES))
}

/// Creates `path` as a sparse image of `bytes` if it does not exist.
pub fn ensure_disk(path: &std::path::Path, bytes: u64) -> Result<()> {
    if path.exists() {
        return Ok(());
    }
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .with_context(|| format!("cannot create disk image {}", path.display()))?;
    f.set_len(bytes).with_context(|| format!("cannot size disk image {}", path.display()))?;
    Ok(())
}

/// A temporary sparse disk image, removed when dropped.
pub struct TempDisk(pub std::path::PathBuf);

impl TempDisk {
    /// A temporary sparse image of `bytes`.
    pub fn with_size(tag: &str, bytes: u64) -> Result<Self> {
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p =
            std::env::temp_dir().join(format!("ninelives-{tag}-{}-{n}.img", std::process::id()));
        let _ = std::fs::remove_file(&p);
        ensure_disk(&p, bytes)?;
        Ok(TempDisk(p))
    }
}

impl Drop for TempDisk {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

use crate::args::{MachineArgs, PatternName, WorkloadArgs, WorkloadName};

impl WorkloadName {
    pub fn abi(self) -> u64 {
        match self {
            WorkloadName::Memwrite => nl_abi::WORKLOAD_MEMWRITE,
            WorkloadName::Compute => nl_abi::WORKLOAD_COMPUTE,
            WorkloadName::Exits => nl_abi::WORKLOAD_EXITS,
            WorkloadName::Idle => nl_abi::WORKLOAD_IDLE,
            WorkloadName::Blkbench => nl_abi::WORKLOAD_BLKBENCH,
            WorkloadName::Netbench => nl_abi::WORKLOAD_NETBENCH,
            WorkloadName::Kv => nl_abi::WORKLOAD_KV,
            WorkloadName::Filecache => nl_abi::WORKLOAD_FILECACHE,
        }
    }

    pub fn name(self) -> &'static str {
        nl_abi::workload_name(self.abi())
    }

    /// What `ninelives bench` measures by default.
    pub const ALL: [WorkloadName; 6] = [
        WorkloadName::Memwrite,
        WorkloadName::Compute,
        WorkloadName::Exits,
        WorkloadName::Idle,
        WorkloadName::Blkbench,
        WorkloadName::Netbench,
    ];
}

impl PatternName {
    pub fn abi(self) -> u64 {
        match self {
            PatternName::Sequential => nl_abi::PATTERN_SEQUENTIAL,
            PatternName::Strided => nl_abi::PATTERN_STRIDED,
            PatternName::Random => nl_abi::PATTERN_RANDOM,
            PatternName::Hotcold => nl_abi::PATTERN_HOTCOLD,
        }
    }
}

/// The workload parameters every vCPU receives.
pub fn workload_params(w: &WorkloadArgs, duration_secs: f64) -> Result<WorkloadParams> {
    if !(duration_secs.is_finite() && duration_secs > 0.0 && duration_secs <= 86_400.0) {
        bail!("--duration {duration_secs} must be between 0 and 86400 seconds");
    }
    let filecache = w.workload == WorkloadName::Filecache;
    let ws_bytes = match w.workload {
        WorkloadName::Memwrite => w.ws.unwrap_or(64 << 20),
        WorkloadName::Blkbench => nl_workloads::blk::BLKBENCH_WS_BYTES,
        WorkloadName::Kv => nl_workloads::kv::KV_WS_BYTES,
        WorkloadName::Filecache => {
            w.ws.unwrap_or(nl_workloads::filecache::ws_bytes_for(w.data)).div_ceil(4096) * 4096
        }
        _ => 0,
    };
    let p = WorkloadParams {
        kind: w.workload.abi(),
        seed: w.seed,
        ws_bytes,
        write_pct: w.write_pct,
        pattern: w.pattern.abi(),
        stride: w.stride,
        hot_pct: w.hot_pct,
        duration_ms: (duration_secs * 1000.0).round().max(1.0) as u64,
        data_bytes: if filecache { w.data } else { 0 },
    };
    nl_workloads::validate(&p).map_err(|e| anyhow::anyhow!("invalid workload parameters: {e}"))?;
    Ok(p)
}

/// Largest `--kernel` file read. The kernel's loaded segments must fit in
/// the 4 MiB kernel range; the rest of the ELF (symbols, debug information)
/// may make the file larger, but not this large.
pub const MAX_KERNEL_BYTES: u64 = 64 << 20;

/// Reads `--kernel` (a regular file of at most [`MAX_KERNEL_BYTES`]), or
/// returns the embedded reference kernel.
pub fn kernel_image(m: &MachineArgs) -> Result<Arc<Vec<u8>>> {
    Ok(Arc::new(match &m.kernel {
        Some(p) => nl_memory::file::read_limited(p, "kernel image", MAX_KERNEL_BYTES)
            .context("cannot read --kernel")?,
        None => nl_guest::KERNEL_ELF.to_vec(),
    }))
}

/// The VM configuration for these arguments.
pub fn vm_config(
    m: &MachineArgs,
    workload: WorkloadParams,
    kernel: Arc<Vec<u8>>,
    console: Option<std::path::PathBuf>,
) -> Result<VmConfig> {
    if !(m.heartbeat_timeout().is_finite() && m.heartbeat_timeout() > 0.0) {
        bail!("--heartbeat-timeout must be a positive number of seconds");
    }
    if workload.kind == nl_abi::WORKLOAD_NETBENCH || workload.kind == nl_abi::WORKLOAD_KV {
        let name = if workload.kind == nl_abi::WORKLOAD_KV { "kv" } else { "netbench" };
        if m.vcpus != 1 {
            bail!("{name} runs on one vCPU (got --vcpus {})", m.vcpus);
        }
        if m.net_tap.is_none() {
            bail!("{name} needs a network device (--net-tap NAME)");
        }
    }
    if let Some(need) = disk_needed(&workload) {
        let name =
            if workload.kind == nl_abi::WORKLOAD_FILECACHE { "filecache" } else { "blkbench" };
        if m.vcpus != 1 {
            bail!("{name} runs on one vCPU (got --vcpus {})", m.vcpus);
        }
        let Some(disk) = &m.disk else {
            bail!("{name} needs a disk (--disk FILE)");
        };
        let len = std::fs::metadata(disk)
            .with_context(|| format!("cannot use --disk {}", disk.display()))?
            .len();
        if len < need {
            bail!(
                "--disk {} holds {} MiB; {name} needs at least {} MiB",
                disk.display(),
                len >> 20,
                need.div_ceil(1 << 20)
            );
        }
    }
    let net = match &m.net_tap {
        Some(tap) => {
            let (ipv4, prefix) = parse_cidr(&m.net_ip)?;
            let host_ip = m.net_host_ip.as_deref().map(parse_cidr).transpose()?;
            if let Some((h, hp)) = host_ip {
                if h == ipv4 {
                    bail!("--net-host-ip {} is the guest's own address (--net-ip)", m.net_ip);
                }
                let net = |a: [u8; 4], p: u8| u32::from_be_bytes(a) >> (32 - u32::from(p.max(1)));
                if hp != prefix || net(h, hp) != net(ipv4, prefix) {
                    bail!(
                        "--net-host-ip {} and --net-ip {} are not on the same subnet",
                        m.net_host_ip.as_deref().unwrap_or(""),
                        m.net_ip
                    );
                }
            }
            Some(NetConfig {
                tap: tap.clone(),
                ipv4,
                prefix,
                rx_irq: m.net_rx_irq,
                host_ip,
                ..Default::default()
            })
        }
        None => None,
    };
    let c = VmConfig {
        net,
        mem_bytes: m.mem,
        vcpus: m.vcpus,
        workload,
        kernel,
        user: Arc::new(nl_guest::USER_ELF.to_vec()),
        console_path: console,
        timer_hz: m.timer_hz,
        heartbeat_timeout: Duration::from_secs_f64(m.heartbeat_timeout()),
        disk: m.disk.as_ref().map(|p| DiskConfig { path: p.clone(), readonly: m.disk_readonly }),
    };
    c.validate().map_err(anyhow::Error::msg)?;
    Ok(c)
}

/// The embedded reference guest's images, for a sandbox set.
pub fn sandbox_images() -> nl_sandbox::Images {
    nl_sandbox::Images {
        kernel: std::sync::Arc::new(nl_guest::KERNEL_ELF.to_vec()),
        user: std::sync::Arc::new(nl_guest::USER_ELF.to_vec()),
    }
}
