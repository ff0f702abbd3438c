//! virtio-blk and the blkbench workload, end to end: the ring-3 driver in
//! the guest, the device in the VMM, verification by host replay.

use crate::common;

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use common::*;
use nl_vmm::{DiskConfig, Vm, VmOutcome};

fn disk(dir: &std::path::Path, name: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(nl_workloads::blk::BLKBENCH_DISK_BYTES).unwrap();
    p
}

fn blk_config(path: std::path::PathBuf, readonly: bool, ms: u64) -> nl_vmm::VmConfig {
    let mut c = config(params(nl_abi::WORKLOAD_BLKBENCH, ms), 1);
    c.disk = Some(DiskConfig { path, readonly });
    c
}

fn assert_digest(vm: &Vm) {
    let r = vm.control().vcpus[0].snapshot();
    assert_eq!(r.phase, nl_abi::PHASE_DONE);
    let rep = nl_workloads::native::replay(&vm.config().workload, 0, r.rounds, 0).unwrap();
    assert_eq!(rep.digest, r.digest, "digest after {} rounds", r.rounds);
    assert_eq!(rep.ops, r.ops);
    assert!(r.rounds > 2, "only {} rounds", r.rounds);
}

#[test]
fn blkbench_cli_passes_its_verification() {
    if !kvm_available() {
        return;
    }
    // No --disk: a temporary image is created and removed.
    let o = run_cli(&["run", "--workload", "blkbench", "--duration", "0.5", "--json"]);
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    let j = last_json(&o);
    assert_eq!(j["vms"][0]["workload"], "blkbench");
    assert_eq!(j["vms"][0]["digest_ok"], true);
    assert!(j["vms"][0]["ops"].as_u64().unwrap() > 1 << 20);
    // --disk FILE is created sparse when missing, and reused.
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("new.img");
    let img_s = img.to_string_lossy().into_owned();
    for _ in 0..2 {
        let o = run_cli(&["run", "--workload", "blkbench", "--duration", "0.2", "--disk", &img_s]);
        assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    }
    assert_eq!(std::fs::metadata(&img).unwrap().len(), 256 << 20);
}

#[test]
fn blkbench_bad_setups_are_clear_errors() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let small = dir.path().join("small.img");
    std::fs::write(&small, vec![0u8; 4096]).unwrap();
    let small = small.to_string_lossy().into_owned();
    let o = run_cli(&["run", "--workload", "blkbench", "--disk", &small]);
    assert_clean_error(&o, "blkbench needs at least 128 MiB");
    let o = run_cli(&["run", "--workload", "blkbench", "--vcpus", "2"]);
    assert_clean_error(&o, "one vCPU");
    let o = run_cli(&["run", "--workload", "idle", "--disk", &small, "--vms", "2"]);
    assert_clean_error(&o, "cannot share a writable disk");
    let o = run_cli(&["run", "--workload", "idle", "--disk", "/nonexistent-dir/x.img"]);
    assert_clean_error(&o, "cannot create disk image");
}

/// A read-only disk: the guest's writes get the virtio error status, the
/// guest reports a device error, and a second VM in the same VMM process
/// running blkbench on its own disk is unaffected.
#[test]
fn readonly_disk_fails_the_guest_not_the_vmm_or_other_vms() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let kvm = nl_vmm::open_kvm().unwrap();
    let ro = Vm::create(&kvm, 0, blk_config(disk(dir.path(), "ro.img"), true, 400)).unwrap();
    let rw = Vm::create(&kvm, 1, blk_config(disk(dir.path(), "rw.img"), false, 400)).unwrap();
    ro.start().unwrap();
    rw.start().unwrap();
    match ro.wait(Duration::from_secs(60)) {
        VmOutcome::GuestError { code, message, .. } => {
            assert_eq!(code, nl_abi::ERR_DEVICE);
            assert!(message.contains("virtio-blk requests failed"), "{message}");
        }
        other => panic!("expected a guest device error, got {other:?}"),
    }
    let (stats, status, _) = ro.blk_stats().unwrap();
    assert!(stats.errors > 0 && stats.writes == 0, "{stats:?}");
    assert_eq!(status & 0x40, 0, "a failed request is not a device failure");
    assert_eq!(rw.wait(Duration::from_secs(60)), VmOutcome::Completed);
    assert_digest(&rw);
    let (stats, _, err) = rw.blk_stats().unwrap();
    assert!(stats.errors == 0 && stats.reads > 0 && stats.writes > 0, "{stats:?} {err:?}");
    // Every completed request signalled the device's irqfd (registered with KVM).
    let (blk_irqs, net_irqs) = rw.virtio_interrupts();
    assert!(blk_irqs.unwrap() >= stats.reads + stats.writes, "{blk_irqs:?} {stats:?}");
    assert_eq!(net_irqs, None);
}

/// Pause in the middle of blkbench, save and restore the whole VM state
/// (virtio transport and queue included), resume: the run still verifies.
#[test]
fn blkbench_survives_save_restore_of_device_state() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let kvm = nl_vmm::open_kvm().unwrap();
    let vm = Vm::create(&kvm, 0, blk_config(disk(dir.path(), "d.img"), false, 600)).unwrap();
    vm.start().unwrap();
    let t = Instant::now();
    while vm.control().vcpus[0].phase.load(Relaxed) < nl_abi::PHASE_MEASURE_START {
        assert!(t.elapsed() < Duration::from_secs(30), "blkbench never started measuring");
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(100));
    vm.pause();
    let state = vm.save_state().unwrap();
    let blk = state.mmio_devices.iter().find(|d| d.name == "virtio-blk").expect("saved");
    assert_eq!(blk.state["status"], 0xf, "driver OK, features OK: {}", blk.state);
    // Into a new VM over the same memory and disk: its virtio-blk starts
    // reset, so the guest's driver (mid-run, queues set up) finds its
    // device only if the device state was restored.
    let cfg = vm.config().clone();
    let fd = vm.memory().fd().clone();
    vm.stop();
    drop(vm);
    let memory = nl_memory::GuestMemory::from_fd(fd, cfg.mem_bytes).unwrap();
    let vm = Vm::restore(&kvm, 1, cfg, memory, &state).unwrap();
    let again = vm.save_state().unwrap();
    let blk2 = again.mmio_devices.iter().find(|d| d.name == "virtio-blk").expect("saved");
    assert_eq!(blk2.state, blk.state, "the device state after the restore");
    vm.start().unwrap();
    assert_eq!(vm.wait(Duration::from_secs(60)), VmOutcome::Completed, "{}", vm.console().tail());
    assert_digest(&vm);
}

/// Guest-driven bad input: the guest (test-only mode) submits a buffer
/// outside its memory, a buffer of the wrong direction, a descriptor loop
/// and a bogus avail index, and checks each gets its virtio error (IOERR or
/// DEVICE_NEEDS_RESET); after resets it runs blkbench, which still verifies.
#[test]
fn guest_driven_malformed_requests_get_virtio_errors() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let kvm = nl_vmm::open_kvm().unwrap();
    let mut c = blk_config(disk(dir.path(), "m.img"), false, 200);
    c.workload.pattern = nl_abi::BLK_TEST_MALFORMED;
    let vm = Vm::create(&kvm, 0, c).unwrap();
    vm.start().unwrap();
    let outcome = vm.wait(Duration::from_secs(60));
    let console = vm.console().tail();
    assert_eq!(outcome, VmOutcome::Completed, "{console}");
    assert!(console.contains("malformed-request checks passed"), "{console}");
    assert_digest(&vm);
    let (stats, status, _) = vm.blk_stats().unwrap();
    assert!(stats.errors >= 2, "{stats:?}");
    assert_eq!(status & 0x40, 0, "the driver reset the device after each NEEDS_RESET");
}
