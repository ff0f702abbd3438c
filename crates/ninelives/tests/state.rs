//! Core hooks: pause/resume, state save and restore, and restore into a new
//! VM over the same guest memory (what warm reboot and microreboot build on).

mod common;

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

#[test]
fn save_restore_in_place_round_trip_keeps_the_digest() {
    if !kvm_available() {
        return;
    }
    let kvm = nl_vmm::open_kvm().unwrap();
    let vm = Vm::create(&kvm, 0, config(params(nl_abi::WORKLOAD_MEMWRITE, 500), 1)).unwrap();
    vm.start().unwrap();
    assert!(vm.save_state().is_err(), "saving a running VM must be refused");
    wait_phase(&vm, nl_abi::PHASE_MEASURE_START);
    vm.pause();
    let bytes = vm.save_state().unwrap().to_bytes();
    let state = VmState::from_bytes(&bytes).unwrap();
    vm.restore_state(&state).unwrap();
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
    let two = Vm::create(&kvm, 1, config(params(nl_abi::WORKLOAD_MEMWRITE, 400), 2)).unwrap();
    let state = VmState::from_bytes(&bytes).unwrap();
    assert!(two.restore_state(&state).is_err());
    drop(two);

    vm.resume();
    assert_eq!(vm.wait(Duration::from_secs(60)), VmOutcome::Completed);
    assert_digests(&vm);
}
