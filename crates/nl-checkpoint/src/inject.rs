//! Guest fault injection: a bit flip in guest memory or in a vCPU register,
//! applied with the VM paused, so rollback can be exercised without a real
//! transient fault.

use nl_abi::*;
use nl_vmm::Vm;
use serde::Serialize;
use vm_memory::{Bytes, GuestAddress};

use crate::CheckpointError;

/// Registers a register fault can hit (the Gigan set: the 16 general-purpose
/// registers, RSP among them, plus RFLAGS and RIP).
pub const REGISTERS: [&str; 18] = [
    "rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp", "r8", "r9", "r10", "r11", "r12", "r13",
    "r14", "r15", "rip", "rflags",
];

/// One injected fault.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum GuestFault {
    Memory {
        gpa: u64,
        bit: u32,
    },
    Register {
        cpu: usize,
        reg: &'static str,
        bit: u32,
    },
    /// An infinite loop (`jmp .`) written over the instruction vCPU `cpu`
    /// is at (the guest is identity mapped): the guest spins and stops
    /// heartbeating, an error only the hang detector finds, a hang timeout
    /// after the fault (a test's fault with a known, long detection latency).
    Spin {
        cpu: usize,
    },
    /// The workload's own end (it reports `PHASE_DONE` and exits) written
    /// over the ring-3 instruction vCPU `cpu` is at: the program ends early,
    /// as one does when a control-flow error returns it into its end. A
    /// workload without end (a service) then completes, which is a failure;
    /// one with an end completes with a wrong result. Refused with
    /// [`CheckpointError::NotNow`] while the vCPU is in the kernel.
    Exit {
        cpu: usize,
    },
}

/// A small deterministic generator (splitmix64) so a campaign is replayable from its seed.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x6A09_E667_F3BC_C909)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n.max(1))) >> 64) as u64
    }
}

/// Picks a fault: half memory (a word of a working set if the workload has
/// one, else of the user image and stacks), half registers.
pub fn pick(rng: &mut Rng, vm: &Vm) -> GuestFault {
    let cfg = vm.config();
    if rng.below(2) == 0 {
        let (base, len) = if cfg.workload.ws_bytes > 0 {
            (USER_HEAP_GPA, cfg.workload.ws_bytes * u64::from(cfg.vcpus))
        } else {
            (USER_BASE, USER_HEAP_GPA - USER_BASE)
        };
        let gpa = base + rng.below(len / 8) * 8;
        GuestFault::Memory { gpa, bit: rng.below(64) as u32 }
    } else {
        GuestFault::Register {
            cpu: rng.below(u64::from(cfg.vcpus)) as usize,
            reg: REGISTERS[rng.below(REGISTERS.len() as u64) as usize],
            bit: rng.below(64) as u32,
        }
    }
}

fn reg_mut<'a>(r: &'a mut kvm_bindings::kvm_regs, name: &str) -> &'a mut u64 {
    match name {
        "rax" => &mut r.rax,
        "rbx" => &mut r.rbx,
        "rcx" => &mut r.rcx,
        "rdx" => &mut r.rdx,
        "rsi" => &mut r.rsi,
        "rdi" => &mut r.rdi,
        "rbp" => &mut r.rbp,
        "rsp" => &mut r.rsp,
        "r8" => &mut r.r8,
        "r9" => &mut r.r9,
        "r10" => &mut r.r10,
        "r11" => &mut r.r11,
        "r12" => &mut r.r12,
        "r13" => &mut r.r13,
        "r14" => &mut r.r14,
        "r15" => &mut r.r15,
        "rip" => &mut r.rip,
        _ => &mut r.rflags,
    }
}

/// Applies `fault` to a VM, which is held paused around it
/// ([`Vm::hold_paused`]: never resumed mid-checkpoint, nor mid-fault by a
/// checkpoint). Returns the guest address the VMM wrote, if it wrote
/// memory.
pub fn apply(vm: &Vm, fault: &GuestFault) -> Result<Option<u64>, CheckpointError> {
    let _hold = vm.hold_paused();
    apply_paused(vm, fault)
}

fn apply_paused(vm: &Vm, fault: &GuestFault) -> Result<Option<u64>, CheckpointError> {
    match *fault {
        GuestFault::Memory { gpa, bit } => {
            let mem = vm.memory().mem();
            let err = |e: vm_memory::GuestMemoryError| CheckpointError::GuestMemory {
                gpa,
                why: e.to_string(),
            };
            let v: u64 = mem.read_obj(GuestAddress(gpa)).map_err(err)?;
            // Written through the VM's own mapping: under CoW the first write
            // after a checkpoint saves the pre-fault page, as a guest write would.
            mem.write_obj(v ^ (1u64 << bit), GuestAddress(gpa)).map_err(err)?;
            Ok(Some(gpa))
        }
        GuestFault::Register { cpu, reg, bit } => {
            vm.with_vcpu(cpu, |fd| -> Result<(), CheckpointError> {
                let mut regs = fd
                    .get_regs()
                    .map_err(|e| CheckpointError::Config(format!("KVM_GET_REGS: {e}")))?;
                *reg_mut(&mut regs, reg) ^= 1u64 << bit;
                fd.set_regs(&regs)
                    .map_err(|e| CheckpointError::Config(format!("KVM_SET_REGS: {e}")))
            })??;
            Ok(None)
        }
        GuestFault::Spin { cpu } => {
            let rip = vm.with_vcpu(cpu, |fd| {
                fd.get_regs()
                    .map(|r| r.rip)
                    .map_err(|e| CheckpointError::Config(format!("KVM_GET_REGS: {e}")))
            })??;
            vm.memory()
                .mem()
                .write_slice(&[0xEB, 0xFE], GuestAddress(rip))
                .map_err(|e| CheckpointError::GuestMemory { gpa: rip, why: e.to_string() })?;
            Ok(Some(rip))
        }
        GuestFault::Exit { cpu } => {
            let (rip, ring) = vm
                .with_vcpu(cpu, |fd| {
                    let r = fd.get_regs().map_err(|e| format!("KVM_GET_REGS: {e}"))?;
                    let s = fd.get_sregs().map_err(|e| format!("KVM_GET_SREGS: {e}"))?;
                    Ok::<_, String>((r.rip, s.cs.selector & 3))
                })?
                .map_err(CheckpointError::Config)?;
            if ring != 3 {
                return Err(CheckpointError::NotNow(format!(
                    "vCPU {cpu} is in the kernel (ring {ring}), not in its workload: try again"
                )));
            }
            vm.memory()
                .mem()
                .write_slice(&end_code(cpu as u64), GuestAddress(rip))
                .map_err(|e| CheckpointError::GuestMemory { gpa: rip, why: e.to_string() })?;
            Ok(Some(rip))
        }
    }
}

/// Bytes the VMM writes for one fault, at most ([`end_code`]'s): a caller
/// that tracks the VMM's writes notes the pages of `gpa` to `gpa +
/// MAX_WRITE - 1`.
pub const MAX_WRITE: usize = 23;

/// A ring-3 program's end, as the reference guest's user program ends
/// (`guest/user`): `PHASE_DONE` into vCPU `cpu`'s phase register, then the
/// exit syscall (its gate is `int3`, see nl-abi).
fn end_code(cpu: u64) -> [u8; MAX_WRITE] {
    let mut c = [0u8; MAX_WRITE];
    // movabs rax, control_reg(cpu, PHASE)
    c[..2].copy_from_slice(&[0x48, 0xB8]);
    c[2..10].copy_from_slice(&control_reg(cpu, reg::PHASE).to_le_bytes());
    // mov qword ptr [rax], PHASE_DONE
    c[10..13].copy_from_slice(&[0x48, 0xC7, 0x00]);
    c[13..17].copy_from_slice(&(PHASE_DONE as u32).to_le_bytes());
    // mov eax, SYS_EXIT; int3
    c[17] = 0xB8;
    c[18..22].copy_from_slice(&(SYS_EXIT as u32).to_le_bytes());
    c[22] = 0xCC;
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rng_is_deterministic_and_bounded() {
        let (mut a, mut b) = (Rng::new(5), Rng::new(5));
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
            assert!(a.below(7) < 7);
            b.below(7);
        }
        let mut kvm = kvm_bindings::kvm_regs::default();
        for r in REGISTERS {
            *reg_mut(&mut kvm, r) ^= 1;
        }
        assert_eq!((kvm.rax, kvm.r15, kvm.rip, kvm.rflags), (1, 1, 1, 1));
    }
}
