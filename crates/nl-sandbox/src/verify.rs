//! Checking a completed sandbox's result.

use nl_abi::{WORKLOAD_CHANBENCH, WORKLOAD_CHANSTREAM, WORKLOAD_WILDWRITE};
use nl_devices::control::VcpuRegsSnapshot;

use crate::set::{Sandbox, SandboxSet};

/// [`check`] on the registers of `vm`, the sandbox's VM as it completed.
pub fn check_vm(set: &SandboxSet, sb: &Sandbox, vm: &nl_vmm::Vm) -> (bool, Option<String>) {
    let regs: Vec<_> = vm.control().vcpus.iter().map(|r| r.snapshot()).collect();
    check(set, sb, &regs)
}

/// Whether the sandbox's result is right, and what is wrong if not.
pub fn check(set: &SandboxSet, sb: &Sandbox, regs: &[VcpuRegsSnapshot]) -> (bool, Option<String>) {
    let p = &sb.params();
    let r0 = regs.first().copied().unwrap_or_default();
    match p.kind {
        WORKLOAD_CHANBENCH => {
            let end = set.config.channels_of(&sb.config.name).first().map_or(0, |c| c.1);
            let want = nl_workloads::chanbench::expected_digest(p.seed, p.stride as usize, end);
            if r0.digest == want {
                (true, None)
            } else {
                (false, Some(format!("chanbench digest {:#x}, expected {want:#x}", r0.digest)))
            }
        }
        nl_abi::WORKLOAD_DOORBELL => {
            let end = set.config.channels_of(&sb.config.name).first().map_or(0, |c| c.1);
            let want = nl_workloads::doorbell::expected_digest(p.seed, end);
            if r0.digest == want {
                (true, None)
            } else {
                (false, Some(format!("doorbell digest {:#x}, expected {want:#x}", r0.digest)))
            }
        }
        nl_abi::WORKLOAD_PERIODIC => {
            let want = nl_workloads::periodic::periodic_digest(p.seed, r0.ops);
            if r0.digest == want && r0.ops > 0 {
                (true, None)
            } else {
                (
                    false,
                    Some(format!(
                        "periodic: digest {:#x} over {} ops, the host computes {want:#x}",
                        r0.digest, r0.ops
                    )),
                )
            }
        }
        nl_abi::WORKLOAD_STORM => {
            let want = nl_workloads::periodic::storm_digest(p.seed, r0.ops);
            if r0.digest == want && r0.ops > 0 {
                (true, None)
            } else {
                (
                    false,
                    Some(format!(
                        "storm: digest {:#x} over {} rings, the host computes {want:#x}",
                        r0.digest, r0.ops
                    )),
                )
            }
        }
        WORKLOAD_CHANSTREAM => {
            if let Some(why) = cut_short(sb, p, 0, &r0) {
                return (false, Some(why));
            }
            if r0.digest == 0 && r0.ops > 0 {
                (true, None)
            } else {
                (
                    false,
                    Some(format!(
                        "chanstream: {} messages received, {} corrupt, lost or duplicated",
                        r0.ops, r0.digest
                    )),
                )
            }
        }
        WORKLOAD_WILDWRITE => {
            let boot = match nl_vmm_boot_info(sb) {
                Ok(b) => b,
                Err(e) => return (false, Some(e)),
            };
            let heap = boot.heap_end.saturating_sub(boot.heap_start);
            let plan = nl_workloads::wildwrite::Plan::new(
                p.seed,
                nl_workloads::wildwrite::WRITES,
                heap,
                boot.num_channels as usize,
                nl_abi::CHANNEL_REGION_BYTES,
            );
            let want = plan.expected().peer;
            let seen = sb.monitor.violations();
            if r0.digest != want || seen != want {
                (
                    false,
                    Some(format!(
                        "wildwrite aimed {want} writes at read-only pages: the guest counted {}, the monitor {seen}",
                        r0.digest
                    )),
                )
            } else {
                (true, None)
            }
        }
        _ => {
            for (cpu, r) in regs.iter().enumerate() {
                if let Some(why) = cut_short(sb, p, cpu, r) {
                    return (false, Some(why));
                }
                match nl_workloads::native::replay(p, cpu as u64, r.rounds, 0) {
                    Ok(rep) if rep.digest == r.digest && rep.ops == r.ops => {}
                    Ok(rep) => {
                        return (
                            false,
                            Some(format!(
                                "vCPU {cpu}: guest digest {:#x} over {} rounds, the host computes {:#x}",
                                r.digest, r.rounds, rep.digest
                            )),
                        )
                    }
                    Err(e) => return (false, Some(format!("vCPU {cpu}: cannot replay: {e}"))),
                }
            }
            (true, None)
        }
    }
}

/// Why vCPU `cpu`'s measured period was shorter than `duration_ms`, if it
/// was. The guest's loop ends only once its TSC has run the whole period
/// (`CYCLES` at least `duration_ms` × the TSC's kHz), so a shorter one
/// ended early: a derailed workload that returned into its own end, whose
/// digest can still replay right over the rounds it did.
fn cut_short(
    sb: &Sandbox,
    p: &nl_abi::WorkloadParams,
    cpu: usize,
    r: &VcpuRegsSnapshot,
) -> Option<String> {
    let khz = nl_vmm_boot_info(sb).ok()?.tsc_khz;
    let want = p.duration_ms.checked_mul(khz)?;
    (r.cycles < want).then(|| {
        format!(
            "vCPU {cpu} ended after {} of its {} ms: cut short",
            r.cycles / khz.max(1),
            p.duration_ms
        )
    })
}

fn nl_vmm_boot_info(sb: &Sandbox) -> Result<nl_abi::BootInfo, String> {
    nl_arch::read_boot_info(sb.vm().memory().mem())
        .map_err(|e| format!("cannot read the boot info: {e}"))
}
