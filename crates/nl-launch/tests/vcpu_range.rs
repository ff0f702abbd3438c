//! The vCPU count of a VM is checked at three layers, each with its own
//! test here, so that removing any one check fails a test (the API's
//! end-to-end test in `ninelives/tests/host_api.rs` passes as long as one
//! of them refuses): the request's parsing (`VmSpec::args`), the host's
//! admission (`Host::create`, before any VM is built) and the VM's own
//! configuration check (`VmConfig::validate`, also used by restores).

use nl_abi::MAX_VCPUS;
use nl_launch::vm_spec::{build_config, VmSpec};

fn spec_vcpus(v: i64) -> Result<u32, String> {
    let s: VmSpec = serde_json::from_value(serde_json::json!({ "vcpus": v })).unwrap();
    s.args(1.0).map(|a| a.machine.vcpus)
}

#[test]
fn the_request_refuses_vcpus_outside_1_to_max() {
    for bad in [0, i64::from(MAX_VCPUS) + 1] {
        let e = spec_vcpus(bad).unwrap_err();
        assert!(
            e.contains(&format!("vcpus {bad} is out of range: a VM has 1 to {MAX_VCPUS}")),
            "{e}"
        );
    }
    assert_eq!(spec_vcpus(1), Ok(1));
    assert_eq!(spec_vcpus(i64::from(MAX_VCPUS)), Ok(MAX_VCPUS));
}

fn config() -> nl_vmm::VmConfig {
    build_config(&serde_json::json!({ "workload": "compute", "duration": 1 })).unwrap()
}

#[test]
fn the_vm_configuration_refuses_vcpus_outside_1_to_max() {
    let mut c = config();
    for bad in [0, MAX_VCPUS + 1] {
        c.vcpus = bad;
        let e = c.validate().unwrap_err();
        assert!(e.contains(&format!("--vcpus {bad} is out of range")), "{e}");
    }
    for good in [1, MAX_VCPUS] {
        c.vcpus = good;
        assert_eq!(c.validate(), Ok(()));
    }
}

/// The host refuses before building anything: its own message, not the
/// configuration check's (which says `--vcpus`).
#[test]
fn the_host_refuses_vcpus_outside_1_to_max_before_building_the_vm() {
    if std::fs::metadata("/dev/kvm").is_err() {
        assert!(
            std::env::var("NINELIVES_REQUIRE_KVM").as_deref() != Ok("1"),
            "NINELIVES_REQUIRE_KVM=1 but /dev/kvm is missing"
        );
        use std::io::Write;
        let _ = std::io::stderr().write_all(
            b"*** SKIPPED the_host_refuses_vcpus_outside_1_to_max_before_building_the_vm: no /dev/kvm ***\n",
        );
        return;
    }
    let host = nl_vmm::host::Host::new().unwrap();
    for bad in [0, MAX_VCPUS + 1] {
        let mut c = config();
        c.vcpus = bad;
        let e = host.create(c).unwrap_err().to_string();
        assert!(
            e.contains(&format!("vcpus {bad} is out of range: a VM has 1 to {MAX_VCPUS} vCPUs")),
            "{e}"
        );
        assert!(!e.contains("--vcpus"), "refused by the VM's check, not the host's: {e}");
    }
}
