//! Core hooks: pause/resume, state save and restore, and restore into a new
//! VM over the same guest memory (what warm reboot and microreboot build on).

use crate::common;

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use common::*;
use nl_vmm::state::VmState;
use nl_vmm::{Vm, VmOutcome};

fn wait_phase(vm: &Vm, phase: u64) {
    let t = Instant::now();
    while vm.control().vcpus.iter().any(|r| r.phase.load(Relaxed) < phase) {
        assert!(t.elapsed() < Duration::from_secs(30), "guest never reached phase {phase}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Replays every vCPU's rounds on the host and checks the digest.
fn assert_digests(vm: &Vm) {
    for (cpu, r) in vm.control().vcpus.iter().enumerate() {
        let r = r.snapshot();
        assert_eq!(r.phase, nl_abi::PHASE_DONE);
        let rep =
            nl_workloads::native::replay(&vm.config().workload, cpu as u64, r.rounds, 0).unwrap();
        assert_eq!(rep.digest, r.digest, "vCPU {cpu}: digest after {} rounds", r.rounds);
    }
}

/// Whether two saved states hold the same general and special registers
/// on every vCPU (the parts a restore sets exactly; the TSC and the APIC
/// timer count move on by themselves).
fn same_registers(a: &[u8], b: &[u8]) -> bool {
    let (a, b): (serde_json::Value, serde_json::Value) =
        (serde_json::from_slice(a).unwrap(), serde_json::from_slice(b).unwrap());
    let regs = |s: &serde_json::Value| -> Vec<(serde_json::Value, serde_json::Value)> {
        s["vcpus"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| (v["regs"].clone(), v["sregs"].clone()))
            .collect()
    };
    regs(&a) == regs(&b)
}

#[test]
fn pause_stops_progress_and_resume_continues() {
    if !kvm_available() {
        return;
    }
    let kvm = nl_vmm::open_kvm().unwrap();
    let vm = Vm::create(&kvm, 0, config(params(nl_abi::WORKLOAD_MEMWRITE, 600), 2)).unwrap();
    vm.start().unwrap();
    wait_phase(&vm, nl_abi::PHASE_MEASURE_START);
    vm.pause();
    assert!(vm.is_paused());
    let before = vm.control().total_beats();
    let exits_before: Vec<_> = vm.report().vcpus.iter().map(|v| v.exits.mmio_exits).collect();
    std::thread::sleep(Duration::from_millis(150));
    assert_eq!(vm.control().total_beats(), before, "a paused guest must not run");
    let exits_after: Vec<_> = vm.report().vcpus.iter().map(|v| v.exits.mmio_exits).collect();
    assert_eq!(exits_before, exits_after);
    vm.resume();
    assert_eq!(vm.wait(Duration::from_secs(60)), VmOutcome::Completed);
    assert_digests(&vm);
}

/// Saves state and RAM at point A, lets the guest run on to B, then puts
/// A back into the same VM: the state saved again right after the restore
/// is A's (not B's), and the guest, re-running from A, ends with the
/// replayed digest. A `restore_state` that did nothing would leave B's
/// registers over A's memory.
#[test]
fn save_restore_in_place_round_trip_keeps_the_digest() {
    use std::os::unix::fs::FileExt;
    if !kvm_available() {
        return;
    }
    let kvm = nl_vmm::open_kvm().unwrap();
    let vm = Vm::create(&kvm, 0, config(params(nl_abi::WORKLOAD_MEMWRITE, 1500), 1)).unwrap();
    vm.start().unwrap();
    assert!(vm.save_state().is_err(), "saving a running VM must be refused");
    wait_phase(&vm, nl_abi::PHASE_MEASURE_START);
    vm.pause();
    let bytes = vm.save_state().unwrap().to_bytes();
    let mut ram = vec![0u8; vm.memory().size() as usize];
    vm.memory().fd().read_exact_at(&mut ram, 0).unwrap();
    let beats_a = vm.control().total_beats();
    // On to B: the guest makes progress (bounded: 100 slices of 10 ms) but
    // does not finish.
    for _ in 0..100 {
        vm.resume();
        std::thread::sleep(Duration::from_millis(10));
        vm.pause();
        if vm.control().total_beats() > beats_a {
            break;
        }
    }
    assert!(vm.control().total_beats() > beats_a, "the guest made no progress");
    assert!(vm.control().vcpus[0].phase.load(Relaxed) < nl_abi::PHASE_DONE, "finished before B");
    let at_b = vm.save_state().unwrap().to_bytes();
    assert_ne!(at_b, bytes, "the state at B must differ from A's for this test to mean anything");
    vm.memory().fd().write_all_at(&ram, 0).unwrap();
    let state = VmState::from_bytes(&bytes).unwrap();
    vm.restore_state(&state).unwrap();
    let again = vm.save_state().unwrap().to_bytes();
    assert!(same_registers(&again, &bytes), "the vCPU registers after the restore are not A's");
    assert!(!same_registers(&again, &at_b), "the vCPU registers after the restore are B's");
    vm.resume();
    assert_eq!(vm.wait(Duration::from_secs(60)), VmOutcome::Completed);
    assert_digests(&vm);
}

#[test]
fn restore_into_a_new_vm_over_the_same_memory() {
    if !kvm_available() {
        return;
    }
    let kvm = nl_vmm::open_kvm().unwrap();
    for kind in [nl_abi::WORKLOAD_MEMWRITE, nl_abi::WORKLOAD_EXITS] {
        let cfg = config(params(kind, 600), 2);
        let old = Vm::create(&kvm, 0, cfg.clone()).unwrap();
        old.start().unwrap();
        wait_phase(&old, nl_abi::PHASE_MEASURE_START);
        std::thread::sleep(Duration::from_millis(100));
        old.pause();
        let bytes = old.save_state().unwrap().to_bytes();
        let fd = old.memory().fd().clone();
        old.stop();
        drop(old);

        let memory = nl_memory::GuestMemory::from_fd(fd, cfg.mem_bytes).unwrap();
        let state = VmState::from_bytes(&bytes).unwrap();
        let new = Vm::restore(&kvm, 1, cfg, memory, &state).unwrap();
        new.start().unwrap();
        assert_eq!(new.wait(Duration::from_secs(60)), VmOutcome::Completed, "kind {kind}");
        assert_digests(&new);
    }
}

#[test]
fn bad_state_is_refused_and_the_vm_is_left_untouched() {
    if !kvm_available() {
        return;
    }
    let kvm = nl_vmm::open_kvm().unwrap();
    let vm = Vm::create(&kvm, 0, config(params(nl_abi::WORKLOAD_MEMWRITE, 400), 1)).unwrap();
    vm.start().unwrap();
    wait_phase(&vm, nl_abi::PHASE_MEASURE_START);
    vm.pause();
    let bytes = vm.save_state().unwrap().to_bytes();

    let text = String::from_utf8(bytes.clone()).unwrap();
    let other_version = text.replacen("\"version\":1", "\"version\":99", 1);
    let e = VmState::from_bytes(other_version.as_bytes()).err().expect("version 99 refused");
    assert!(e.to_string().contains("version 99"), "{e}");
    let e = VmState::from_bytes(&bytes[..bytes.len() / 2]).err().expect("truncated refused");
    assert!(
        e.to_string().contains("ninelives VM state") || e.to_string().contains("corrupt"),
        "{e}"
    );

    // A state for another shape of VM: refused before anything is loaded.
    // The VM it was tried on is untouched: its state is what it was, and
    // it still boots and runs its own workload to the right digest.
    let two = Vm::create(&kvm, 1, config(params(nl_abi::WORKLOAD_MEMWRITE, 400), 2)).unwrap();
    let before = two.save_state().unwrap().to_bytes();
    let state = VmState::from_bytes(&bytes).unwrap();
    let e = two.restore_state(&state).expect_err("a 1-vCPU state refused by a 2-vCPU VM");
    assert!(e.to_string().contains("vCPU"), "the error must name what differs: {e}");
    let after = two.save_state().unwrap().to_bytes();
    assert!(same_registers(&after, &before), "a refused restore changed the VM's registers");
    two.start().unwrap();
    assert_eq!(two.wait(Duration::from_secs(60)), VmOutcome::Completed);
    assert_digests(&two);

    vm.resume();
    assert_eq!(vm.wait(Duration::from_secs(60)), VmOutcome::Completed);
    assert_digests(&vm);
}
