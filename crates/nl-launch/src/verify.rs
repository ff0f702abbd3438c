//! Checking a guest's results against the same workload code run on the host.

use std::thread;

use nl_abi::WorkloadParams;
use nl_devices::control::VcpuRegsSnapshot;

/// The verdict for one vCPU.
#[derive(Clone, Debug)]
pub struct VcpuVerdict {
    pub digest_ok: bool,
    /// Measured ops per second in the guest (warm-up excluded).
    pub ops_per_sec: f64,
    pub problem: Option<String>,
}

/// Replays each vCPU's rounds natively and compares digests. A wrong digest
/// is silent data corruption, never success. Replays run in parallel.
pub fn verify_vcpus(
    params: &WorkloadParams,
    regs: &[VcpuRegsSnapshot],
    tsc_khz: u64,
) -> Vec<VcpuVerdict> {
    thread::scope(|s| {
        let handles: Vec<_> = regs
            .iter()
            .enumerate()
            .map(|(cpu, r)| {
                // Named: the CLI's check, not a VMM thread (it runs no guest
                // and holds no VM), unfiltered like the main thread.
                thread::Builder::new()
                    .name(format!("verify{cpu}"))
                    .spawn_scoped(s, move || verify_one(params, cpu as u64, r, tsc_khz))
            })
            .collect();
        let failed = |problem: String| VcpuVerdict {
            digest_ok: false,
            ops_per_sec: 0.0,
            problem: Some(problem),
        };
        handles
            .into_iter()
            .map(|h| match h {
                Ok(h) => h.join().unwrap_or_else(|_| failed("host replay panicked".into())),
                Err(e) => failed(format!("cannot start the host replay: {e}")),
            })
            .collect()
    })
}

fn verify_one(
    params: &WorkloadParams,
    cpu: u64,
    r: &VcpuRegsSnapshot,
    tsc_khz: u64,
) -> VcpuVerdict {
    let secs = if tsc_khz > 0 { r.cycles as f64 / (tsc_khz as f64 * 1e3) } else { 0.0 };
    let ops_per_sec = if secs > 0.0 { r.ops as f64 / secs } else { 0.0 };
    if r.phase != nl_abi::PHASE_DONE {
        return VcpuVerdict {
            digest_ok: false,
            ops_per_sec,
            problem: Some("workload did not finish".into()),
        };
    }
    // Halts cost nothing on the host when verifying: timer_hz = 0.
    match nl_workloads::native::replay(params, cpu, r.rounds, 0) {
        Ok(rep)
            if rep.digest == r.digest
                && rep.ops == r.ops
                && rep.warmup_ops == r.warmup_ops
                && (rep.cache_hits, rep.cache_misses) == (r.cache_hits, r.cache_misses) =>
        {
            VcpuVerdict { digest_ok: true, ops_per_sec, problem: None }
        }
        Ok(rep) => VcpuVerdict {
            digest_ok: false,
            ops_per_sec,
            problem: Some(format!(
                "silent data corruption: guest digest {:#018x} over {} rounds ({} ops, {} cache hits, {} misses), host computes {:#018x} ({} ops, {} hits, {} misses)",
                r.digest, r.rounds, r.ops, r.cache_hits, r.cache_misses, rep.digest, rep.ops, rep.cache_hits, rep.cache_misses
            )),
        },
        Err(e) => VcpuVerdict { digest_ok: false, ops_per_sec, problem: Some(format!("cannot replay: {e}")) },
    }
}

/// The verdict on a whole VM whose run ended with `outcome`.
#[derive(Clone, Debug)]
pub struct VmVerdict {
    pub digest_ok: bool,
    /// Measured ops of all vCPUs (warm-up excluded).
    pub ops: u64,
    pub ops_per_sec: f64,
    /// Why the VM does not count as verified.
    pub error: Option<String>,
}

/// Verifies every vCPU of a VM that has stopped running: a VM that did not
/// complete, or any vCPU whose digest the host replay does not reproduce,
/// is not verified.
pub fn verify_vm(vm: &nl_vmm::Vm, outcome: &nl_vmm::VmOutcome) -> anyhow::Result<VmVerdict> {
    let regs: Vec<_> = vm.control().vcpus.iter().map(|r| r.snapshot()).collect();
    let ops = regs.iter().map(|r| r.ops).sum();
    if *outcome != nl_vmm::VmOutcome::Completed {
        return Ok(VmVerdict {
            digest_ok: false,
            ops,
            ops_per_sec: 0.0,
            error: Some(outcome.message()),
        });
    }
    let tsc_khz = nl_arch::read_boot_info(vm.memory().mem())?.tsc_khz;
    let verdicts = verify_vcpus(&vm.config().workload, &regs, tsc_khz);
    let digest_ok = verdicts.iter().all(|v| v.digest_ok);
    let error = verdicts
        .iter()
        .enumerate()
        .find_map(|(i, v)| v.problem.as_ref().map(|p| format!("vCPU {i}: {p}")))
        .or_else(|| (!digest_ok).then(|| "digest mismatch".to_string()));
    Ok(VmVerdict {
        digest_ok,
        ops,
        ops_per_sec: verdicts.iter().map(|v| v.ops_per_sec).sum(),
        error,
    })
}

/// The one-line digest verdict the protecting commands print.
pub fn digest_line(digest_ok: bool, error: Option<&str>, ops_per_sec: f64) -> String {
    format!(
        "digest {}{}, {:.3e} ops/s",
        if digest_ok { "verified" } else { "NOT verified" },
        error.map_or(String::new(), |e| format!(" ({e})")),
        ops_per_sec
    )
}
