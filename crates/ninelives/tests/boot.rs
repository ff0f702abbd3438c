//! Booting the reference guest and verifying its workloads end to end.

use crate::common;

use std::os::unix::fs::MetadataExt;
use std::time::Duration;

use common::*;

#[test]
fn default_run_prints_json_and_verifies() {
    if !kvm_available() {
        return;
    }
    let o = run_cli(&["run", "--duration", "0.5", "--json"]);
    assert!(o.status.success(), "stderr: {}", stderr(&o));
    let j = last_json(&o);
    let vm = &j["vms"][0];
    assert_eq!(vm["id"], 0);
    assert_eq!(vm["workload"], "memwrite");
    assert_eq!(vm["ok"], true);
    assert_eq!(vm["digest_ok"], true);
    assert!(vm["ops"].as_u64().unwrap() > 0);
    assert!(vm["ops_per_sec"].as_f64().unwrap() > 0.0);
    assert!(vm["boot_ms"].as_f64().unwrap() > 0.0);
    assert!(j["host_ms"].as_f64().unwrap() > 0.0);
}

#[test]
fn every_workload_verifies() {
    if !kvm_available() {
        return;
    }
    for w in ["compute", "exits", "idle"] {
        let o = run_cli(&["run", "--workload", w, "--duration", "0.3", "--json"]);
        assert!(o.status.success(), "{w}: stderr: {}", stderr(&o));
        let j = last_json(&o);
        assert_eq!(j["vms"][0]["digest_ok"], true, "{w}");
        assert_eq!(j["vms"][0]["workload"], w);
    }
    for p in ["sequential", "strided", "hotcold"] {
        let o = run_cli(&[
            "run",
            "--pattern",
            p,
            "--ws",
            "8M",
            "--write-pct",
            "30",
            "--duration",
            "0.3",
            "--json",
        ]);
        assert!(o.status.success(), "{p}: stderr: {}", stderr(&o));
        assert_eq!(last_json(&o)["vms"][0]["digest_ok"], true, "{p}");
    }
}

#[test]
fn three_vms_with_two_vcpus_each_in_one_process() {
    if !kvm_available() {
        return;
    }
    let o = run_cli(&[
        "run",
        "--vms",
        "3",
        "--vcpus",
        "2",
        "--ws",
        "8M",
        "--duration",
        "0.4",
        "--json",
    ]);
    assert!(o.status.success(), "stderr: {}", stderr(&o));
    let j = last_json(&o);
    let vms = j["vms"].as_array().unwrap();
    assert_eq!(vms.len(), 3);
    for (i, vm) in vms.iter().enumerate() {
        assert_eq!(vm["id"], i as u64);
        assert_eq!(vm["ok"], true);
    }
}

#[test]
fn guest_memory_is_allocated_lazily() {
    if !kvm_available() {
        return;
    }
    let kvm = nl_vmm::open_kvm().unwrap();
    let mut c = config(params(nl_abi::WORKLOAD_IDLE, 100), 1);
    c.mem_bytes = 2 << 30;
    let vm = nl_vmm::Vm::create(&kvm, 0, c).unwrap();
    vm.start().unwrap();
    assert_eq!(vm.wait(Duration::from_secs(60)), nl_vmm::VmOutcome::Completed);
    let allocated = vm.memory().fd().metadata().unwrap().blocks() * 512;
    assert!(allocated < 64 << 20, "a 2 GiB idle VM allocated {allocated} bytes");
}
