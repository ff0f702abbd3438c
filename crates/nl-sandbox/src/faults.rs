//! Fault injection into one sandbox of a running set (tests, the recovery
//! campaign and bench): guest bit flips (nl-checkpoint's injector), a
//! violating write made by the guest itself, and a broken driver
//! scribbling over the sandbox's own channel output.

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
}

impl SandboxFault {
    pub fn name(&self) -> &'static str {
        match self {
            SandboxFault::Guest { fault: GuestFault::Memory { .. } } => "memory-flip",
            SandboxFault::Guest { fault: GuestFault::Register { .. } } => "register-flip",
            SandboxFault::Guest { fault: GuestFault::Spin { .. } } => "spin",
            SandboxFault::ViolatingWrite { .. } => "violating-write",
            SandboxFault::BrokenDriver { .. } => "broken-driver",
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
            inject::apply(&vm, fault).map_err(|e| err(e.to_string()))?;
        }
        SandboxFault::ViolatingWrite { channel, offset } => {
            let gpa = nl_abi::channel_peer_gpa(*channel) + offset % nl_abi::CHANNEL_REGION_BYTES;
            vm.pause();
            let r = vm
                .with_vcpu(0, |fd| -> Result<u64, String> {
                    let mut regs = fd.get_regs().map_err(|e| format!("KVM_GET_REGS: {e}"))?;
                    regs.rax = gpa & !7;
                    fd.set_regs(&regs).map_err(|e| format!("KVM_SET_REGS: {e}"))?;
                    Ok(regs.rip)
                })
                .map_err(|e| e.to_string())
                .and_then(|r| r)
                .and_then(|rip| {
                    // mov [rax], rax
                    vm.memory()
                        .mem()
                        .write_slice(&[0x48, 0x89, 0x00], GuestAddress(rip))
                        .map_err(|e| format!("writing the store at {rip:#x}: {e}"))
                });
            vm.resume();
            r.map_err(err)?;
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
