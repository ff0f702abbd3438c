//! From command-line arguments to VM configurations for the reference guest.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use nl_abi::WorkloadParams;
use nl_vmm::VmConfig;

use crate::cli::{MachineArgs, PatternName, WorkloadArgs, WorkloadName};

impl WorkloadName {
    pub fn abi(self) -> u64 {
        match self {
            WorkloadName::Memwrite => nl_abi::WORKLOAD_MEMWRITE,
            WorkloadName::Compute => nl_abi::WORKLOAD_COMPUTE,
            WorkloadName::Exits => nl_abi::WORKLOAD_EXITS,
            WorkloadName::Idle => nl_abi::WORKLOAD_IDLE,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            WorkloadName::Memwrite => "memwrite",
            WorkloadName::Compute => "compute",
            WorkloadName::Exits => "exits",
            WorkloadName::Idle => "idle",
        }
    }

    pub const ALL: [WorkloadName; 4] =
        [WorkloadName::Memwrite, WorkloadName::Compute, WorkloadName::Exits, WorkloadName::Idle];
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
    let memwrite = w.workload == WorkloadName::Memwrite;
    let p = WorkloadParams {
        kind: w.workload.abi(),
        seed: w.seed,
        ws_bytes: if memwrite { w.ws } else { 0 },
        write_pct: w.write_pct,
        pattern: w.pattern.abi(),
        stride: w.stride,
        hot_pct: w.hot_pct,
        duration_ms: (duration_secs * 1000.0).round().max(1.0) as u64,
    };
    nl_workloads::validate(&p).map_err(|e| anyhow::anyhow!("invalid workload parameters: {e}"))?;
    Ok(p)
}

/// Reads `--kernel`, or returns the embedded reference kernel.
pub fn kernel_image(m: &MachineArgs) -> Result<Arc<Vec<u8>>> {
    Ok(Arc::new(match &m.kernel {
        Some(p) => {
            std::fs::read(p).with_context(|| format!("cannot read --kernel {}", p.display()))?
        }
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
    if !(m.heartbeat_timeout.is_finite() && m.heartbeat_timeout > 0.0) {
        bail!("--heartbeat-timeout must be a positive number of seconds");
    }
    let c = VmConfig {
        mem_bytes: m.mem,
        vcpus: m.vcpus,
        workload,
        kernel,
        user: Arc::new(nl_guest::USER_ELF.to_vec()),
        console_path: console,
        timer_hz: m.timer_hz,
        heartbeat_timeout: Duration::from_secs_f64(m.heartbeat_timeout),
    };
    c.validate().map_err(anyhow::Error::msg)?;
    Ok(c)
}
