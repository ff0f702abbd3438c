//! VM-μCheckpoint with errors found later than the detection latency: an
//! error whose detector fires long after the fault (the end-of-run result
//! check) is rolled back further and further until the fault is gone, and
//! a run whose result check fails is never reported as completed with it.

use crate::common;

use std::time::Duration;

use common::*;
use nl_checkpoint::inject::GuestFault;
use nl_checkpoint::{CheckpointConfig, Mode, Supervisor};
use nl_memory::vm_memory::{Bytes, GuestAddress};
use nl_vmm::{Vm, VmOutcome};

/// A guest page the compute workload never touches: a flipped bit there is
/// only seen by the test's result check, at completion (a detector with a
/// latency far above the hang timeout).
const SPARE_GPA: u64 = nl_abi::USER_HEAP_GPA + (1 << 20);

/// Every test runs under CoW-P and under auto (the default mode).
const MODES: [Mode; 2] = [Mode::CowP, Mode::Auto];

fn cfg(mode: Mode, script: Vec<(Duration, GuestFault)>, max_rollbacks: u32) -> CheckpointConfig {
    CheckpointConfig {
        mode,
        block_pages: 16,
        interval: Duration::from_millis(50),
        inject: 0,
        script,
        seed: 1,
        // A short detection latency L (guest time): the result check's real
        // latency (the rest of the run) is many times L.
        hang_timeout: Duration::from_millis(200),
        latency_bound: None,
        max_rollbacks,
        time_limit: Duration::from_secs(90),
        disk_every: 0,
        disk_path: None,
        disk_key: None,
        output_commit: false,
        commit_rule: Default::default(),
        live: None,
    }
}

fn spare_word(vm: &Vm) -> u64 {
    vm.memory().mem().read_obj(GuestAddress(SPARE_GPA)).unwrap()
}

#[test]
fn an_error_found_late_is_rolled_back_until_the_fault_is_gone() {
    if !kvm_available() {
        return;
    }
    let kvm = nl_vmm::open_kvm().unwrap();
    for mode in MODES {
        let vm = Vm::create(&kvm, 0, config(params(nl_abi::WORKLOAD_COMPUTE, 2500), 1)).unwrap();
        let clean = spare_word(&vm);
        let flip = GuestFault::Memory { gpa: SPARE_GPA, bit: 9 };
        let mut checks = 0u32;
        let report =
            Supervisor::start(&vm, cfg(mode, vec![(Duration::from_millis(300), flip)], 10))
                .unwrap()
                .with_result_check(Box::new(|vm: &Vm| {
                    checks += 1;
                    if spare_word(vm) == clean {
                        Ok(())
                    } else {
                        Err("the spare word is corrupted".into())
                    }
                }))
                .run()
                .unwrap();
        assert_eq!(report.outcome, VmOutcome::Completed, "{report:#?}");
        assert_eq!(spare_word(&vm), clean, "{mode:?}: completed with the fault still in memory");
        let rbs = &report.rollbacks;
        assert!(!rbs.is_empty(), "the result check never failed: {report:#?}");
        assert!(rbs.iter().all(|r| r.reason.contains("result check failed")), "{rbs:#?}");
        // The last rollback removed the fault; the first, L back, could not
        // (the fault was seconds of guest time older), so the look-back grew.
        let last = rbs.last().unwrap();
        assert!(!last.checkpoint_after_fault, "{rbs:#?}");
        assert!(
            rbs.len() == 1 && last.target_is_first || last.recurrence >= 1,
            "recovered without the look-back growing: {rbs:#?}"
        );
        assert_eq!(checks as usize, rbs.len() + 1);
        assert!(digest_ok_after(&vm));
    }
}

#[test]
fn a_result_that_keeps_failing_its_check_is_never_reported_completed() {
    if !kvm_available() {
        return;
    }
    let kvm = nl_vmm::open_kvm().unwrap();
    for mode in MODES {
        let vm = Vm::create(&kvm, 0, config(params(nl_abi::WORKLOAD_COMPUTE, 400), 1)).unwrap();
        let report = Supervisor::start(&vm, cfg(mode, Vec::new(), 3))
            .unwrap()
            .with_result_check(Box::new(|_: &Vm| Err("always wrong".into())))
            .run()
            .unwrap();
        match &report.outcome {
            VmOutcome::Crashed { message, .. } => {
                assert!(message.contains("gave up after 3 rollbacks"), "{message}");
                assert!(message.contains("always wrong"), "{message}");
            }
            other => panic!("expected the run to give up, got {other:?}"),
        }
        assert_eq!(report.rollbacks.len(), 3);
        // Each recurrence looks further back; the first rollback looks L back.
        let rec: Vec<u32> = report.rollbacks.iter().map(|r| r.recurrence).collect();
        assert_eq!(rec[0], 0, "{rec:?}");
        assert!(rec.windows(2).all(|w| w[1] == w[0] + 1), "{rec:?}");
    }
}

/// The guest's digest, replayed on the host.
fn digest_ok_after(vm: &Vm) -> bool {
    vm.control().vcpus.iter().enumerate().all(|(cpu, r)| {
        let r = r.snapshot();
        let rep =
            nl_workloads::native::replay(&vm.config().workload, cpu as u64, r.rounds, 0).unwrap();
        r.phase == nl_abi::PHASE_DONE && rep.digest == r.digest
    })
}

/// A caller's detector (`Supervisor::with_detector`, a sandbox's channel
/// detectors under `rollback`) is polled while the guest runs: each
/// detection is rolled back like the supervisor's own, and the detector is
/// told to forget what it knew on its first call and on the first after
/// each rollback.
#[test]
fn a_callers_detector_is_rolled_back_and_told_to_forget_after_each_rollback() {
    if !kvm_available() {
        return;
    }
    let kvm = nl_vmm::open_kvm().unwrap();
    let vm = Vm::create(&kvm, 0, config(params(nl_abi::WORKLOAD_COMPUTE, 1500), 1)).unwrap();
    let (mut calls, mut fresh_calls, mut fired) = (0u32, 0u32, 0u32);
    let report = Supervisor::start(&vm, cfg(Mode::CowP, Vec::new(), 10))
        .unwrap()
        .with_detector(Box::new(|_: &Vm, fresh: bool| {
            if fresh {
                fresh_calls += 1;
                calls = 0;
            }
            calls += 1;
            // Twice, some polls after the start or the last rollback.
            (calls == 50 && fired < 2).then(|| {
                fired += 1;
                format!("the caller's detector fired ({fired})")
            })
        }))
        .run()
        .unwrap();
    assert_eq!(report.outcome, VmOutcome::Completed, "{report:#?}");
    let rbs = &report.rollbacks;
    assert_eq!(rbs.len(), 2, "{rbs:#?}");
    assert!(rbs.iter().all(|r| r.reason.contains("the caller's detector fired")), "{rbs:#?}");
    assert_eq!(fresh_calls, 3, "told to forget {fresh_calls} times over 2 rollbacks");
    assert!(digest_ok_after(&vm));
}
