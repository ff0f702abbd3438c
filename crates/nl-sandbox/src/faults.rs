//! Fault injection into one sandbox of a running set (tests, the recovery
//! campaign and bench): guest bit flips (nl-checkpoint's injector), a
//! violating write made by the guest itself, a broken driver scribbling
//! over the sandbox's own channel output, and a broken driver storming
//! MMIO addresses no device claims.
//!
//! [`FaultModel`] and [`pick_model`] choose one fault of one model (the
//! sandbox campaign, `ninelives inject --setup sandbox`).

use nl_checkpoint::inject;
pub use nl_checkpoint::inject::{GuestFault, Rng};
use serde::Serialize;
use vm_memory::{Bytes, GuestAddress};

use crate::set::SandboxSet;
use crate::SandboxError;

/// One fault injected into a sandbox.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SandboxFault {
    /// A bit flip in guest memory or a register, or a spin (as
    /// `--inject-guest-fault` does).
    Guest { fault: GuestFault },
    /// The guest's next instruction becomes a store to its read-only peer
    /// window of channel `channel` (`mov [rax], rax` with RAX the address):
    /// a real guest write that the VMM must trap.
    ViolatingWrite { channel: u64, offset: u64 },
    /// `bytes` of garbage written over the sandbox's own output region of
    /// its `channel`-th channel at `offset` (a broken driver).
    BrokenDriver { channel: usize, offset: u64, bytes: usize, seed: u64 },
    /// A broken driver's MMIO storm: the guest's next instructions become
    /// an endless loop of stores to `gpa`, an address in the sandbox's
    /// device page that no device claims (`1: mov [rax], rax; jmp 1b` with
    /// RAX = `gpa`). Every store exits to the VMM; the guest never beats
    /// again.
    MmioStorm { gpa: u64 },
}

/// The device page's addresses no device claims: from 1 MiB into the 2 MiB
/// page of [`nl_abi::CONTROL_MMIO_GPA`] (the control blocks and the virtio
/// windows lie in its first 32 KiB) to its end.
pub const UNCLAIMED_MMIO: (u64, u64) =
    (nl_abi::CONTROL_MMIO_GPA + 0x10_0000, nl_abi::CONTROL_MMIO_GPA + 0x20_0000);

/// A fault model: which kind of fault [`pick_model`] picks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultModel {
    /// A bit flip in guest memory (a word of the user image, stacks or
    /// working set), as `--inject-guest-fault` picks it.
    MemoryFlip,
    /// A bit flip in a general-purpose register, RIP or RFLAGS.
    RegisterFlip,
    /// A store to the sandbox's read-only peer window of a channel.
    ViolatingWrite,
    /// A broken driver: an MMIO storm ([`SandboxFault::MmioStorm`]).
    BrokenDriver,
    /// The workload's own end written over its next ring-3 instruction
    /// ([`GuestFault::Exit`]): it completes early, as one does when a
    /// control-flow error returns it into its end.
    PrematureExit,
}

impl FaultModel {
    pub const ALL: [FaultModel; 5] = [
        FaultModel::MemoryFlip,
        FaultModel::RegisterFlip,
        FaultModel::ViolatingWrite,
        FaultModel::BrokenDriver,
        FaultModel::PrematureExit,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FaultModel::MemoryFlip => "memory-flip",
            FaultModel::RegisterFlip => "register-flip",
            FaultModel::ViolatingWrite => "violating-write",
            FaultModel::BrokenDriver => "broken-driver",
            FaultModel::PrematureExit => "premature-exit",
        }
    }
}

/// Picks a fault of `model` for sandbox `name`. A violating write needs a
/// sandbox with channels.
pub fn pick_model(
    set: &SandboxSet,
    name: &str,
    model: FaultModel,
    rng: &mut Rng,
) -> Result<SandboxFault, SandboxError> {
    let sb = set.get(name).ok_or_else(|| SandboxError::Config(format!("no sandbox '{name}'")))?;
    let channels = set.own_regions_of(sb.index).len() as u64;
    Ok(match model {
        FaultModel::MemoryFlip | FaultModel::RegisterFlip => {
            // nl-checkpoint's picker chooses memory or register by a coin:
            // draw until it is the model's kind (bounded; each draw is a
            // fair coin, so 64 all failing does not happen in practice).
            let want_memory = model == FaultModel::MemoryFlip;
            let vm = sb.vm();
            let mut f = inject::pick(rng, &vm);
            for _ in 0..64 {
                if matches!(f, GuestFault::Memory { .. }) == want_memory {
                    break;
                }
                f = inject::pick(rng, &vm);
            }
            if matches!(f, GuestFault::Memory { .. }) != want_memory {
                return Err(SandboxError::Config(format!("cannot pick a {}", model.name())));
            }
            SandboxFault::Guest { fault: f }
        }
        FaultModel::ViolatingWrite => {
            if channels == 0 {
                return Err(SandboxError::Config(format!(
                    "sandbox '{name}' has no channel: a violating write needs one"
                )));
            }
            SandboxFault::ViolatingWrite {
                channel: rng.below(channels),
                offset: rng.below(nl_abi::CHANNEL_REGION_BYTES / 8) * 8,
            }
        }
        FaultModel::BrokenDriver => {
            let (lo, hi) = UNCLAIMED_MMIO;
            SandboxFault::MmioStorm { gpa: lo + rng.below((hi - lo) / 8) * 8 }
        }
        FaultModel::PrematureExit => SandboxFault::Guest { fault: GuestFault::Exit { cpu: 0 } },
    })
}

impl SandboxFault {
    pub fn name(&self) -> &'static str {
        match self {
            SandboxFault::Guest { fault: GuestFault::Memory { .. } } => "memory-flip",
            SandboxFault::Guest { fault: GuestFault::Register { .. } } => "register-flip",
            SandboxFault::Guest { fault: GuestFault::Spin { .. } } => "spin",
            SandboxFault::Guest { fault: GuestFault::Exit { .. } } => "exit",
            SandboxFault::ViolatingWrite { .. } => "violating-write",
            SandboxFault::BrokenDriver { .. } => "broken-driver",
            SandboxFault::MmioStorm { .. } => "mmio-storm",
        }
    }
}

/// Picks a fault for sandbox `name`: memory and register flips as
/// nl-checkpoint picks them, violating writes and broken drivers (the last
/// two only for a sandbox with channels).
pub fn pick(set: &SandboxSet, name: &str, rng: &mut Rng) -> Result<SandboxFault, SandboxError> {
    let sb = set.get(name).ok_or_else(|| SandboxError::Config(format!("no sandbox '{name}'")))?;
    let channels = set.own_regions_of(sb.index).len() as u64;
    let kinds = if channels > 0 { 4 } else { 2 };
    Ok(match rng.below(kinds) {
        0 | 1 => SandboxFault::Guest { fault: inject::pick(rng, &sb.vm()) },
        2 => SandboxFault::ViolatingWrite {
            channel: rng.below(channels),
            offset: rng.below(nl_abi::CHANNEL_REGION_BYTES / 8) * 8,
        },
        _ => SandboxFault::BrokenDriver {
            channel: rng.below(channels) as usize,
            offset: rng.below(nl_abi::CHANNEL_REGION_BYTES),
            bytes: 64 + rng.below(4096) as usize,
            seed: rng.next_u64(),
        },
    })
}

/// Injects `fault` into sandbox `name`.
pub fn apply(set: &SandboxSet, name: &str, fault: &SandboxFault) -> Result<(), SandboxError> {
    let sb = set.get(name).ok_or_else(|| SandboxError::Config(format!("no sandbox '{name}'")))?;
    let vm = sb.vm();
    let err = |e: String| SandboxError::Vm(name.into(), format!("fault injection: {e}"));
    match fault {
        SandboxFault::Guest { fault } => {
            // A `rollback` sandbox's supervisor injects it at its next step.
            set.inject(name, fault)?;
        }
        SandboxFault::ViolatingWrite { channel, offset } => {
            let gpa = nl_abi::channel_peer_gpa(*channel) + offset % nl_abi::CHANNEL_REGION_BYTES;
            // mov [rax], rax
            store_at_rip(&vm, gpa & !7, &[0x48, 0x89, 0x00]).map_err(err)?;
        }
        SandboxFault::MmioStorm { gpa } => {
            let (lo, hi) = UNCLAIMED_MMIO;
            if !(lo..hi).contains(gpa) {
                return Err(err(format!("{gpa:#x} is not an unclaimed MMIO address")));
            }
            // 1: mov [rax], rax; jmp 1b
            store_at_rip(&vm, gpa & !7, &[0x48, 0x89, 0x00, 0xeb, 0xfb]).map_err(err)?;
        }
        SandboxFault::BrokenDriver { channel, offset, bytes, seed } => {
            let own = set.own_regions_of(sb.index);
            let &(c, region) =
                own.get(*channel).ok_or_else(|| err(format!("no channel {channel}")))?;
            let mut rng = Rng::new(*seed);
            let garbage: Vec<u8> = (0..*bytes).map(|_| rng.next_u64() as u8).collect();
            set.channels[c].scribble(region, *offset, &garbage);
        }
    }
    Ok(())
}

/// Sets vCPU 0's RAX to `rax` and writes `code` over the instruction it is
/// at (the guest is identity mapped), with the VM held paused around it
/// ([`nl_vmm::Vm::hold_paused`]: a `rollback` sandbox's supervisor pauses
/// and resumes the same VM for its checkpoints meanwhile).
fn store_at_rip(vm: &nl_vmm::Vm, rax: u64, code: &[u8]) -> Result<(), String> {
    let _hold = vm.hold_paused();
    vm.with_vcpu(0, |fd| -> Result<u64, String> {
        let mut regs = fd.get_regs().map_err(|e| format!("KVM_GET_REGS: {e}"))?;
        regs.rax = rax;
        fd.set_regs(&regs).map_err(|e| format!("KVM_SET_REGS: {e}"))?;
        Ok(regs.rip)
    })
    .map_err(|e| e.to_string())
    .and_then(|r| r)
    .and_then(|rip| {
        vm.memory()
            .mem()
            .write_slice(code, GuestAddress(rip))
            .map_err(|e| format!("writing the code at {rip:#x}: {e}"))?;
        // A `rollback` sandbox's checkpoints must see the code change
        // (KVM's dirty log does not), or a rollback would keep it.
        vm.note_vmm_write(rip, code.len() as u64);
        Ok(())
    })
}
