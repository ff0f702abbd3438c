//! VMM recovery (`--recovery microreset|microreboot`): a fault injected
//! inside a device, with its lock held, while a guest runs. Microreset
//! discards the faulting thread, repairs and resumes in place; microreboot
//! execs a fresh VMM in the same process. Either way the guest finishes
//! with a verified digest. Without the repairs, or with a corrupt recovery
//! record, the VMM ends with a clean, reported failure (exit 86).

use crate::common;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

type Host = common::selftest_host::SelftestHost;

/// A host whose `after`-th device access fails as `fault` (segv, panic, hang).
/// The exits workload makes about 1,300 accesses a second even on a
/// loaded host: the tests keep `after` well below what their VMs make.
fn start(recovery: &[&str], fault: &str, after: u64) -> Host {
    Host::start_env(recovery, &[("NINELIVES_DEVICE_FAULT", &format!("{fault}:{after}"))])
}

#[test]
fn microreset_recovers_from_a_crash_a_panic_and_a_hang_inside_a_device() {
    if !kvm_available() {
        return;
    }
    for fault in ["segv", "panic", "hang"] {
        let h = start(&["--recovery", "microreset"], fault, 600);
        let pid = h.req(json!({"op":"info"})).unwrap()["pid"].as_u64();
        let id = h.create("exits", 1.5);
        h.assert_completes_verified(id);
        let rec = h.lines("NINELIVES-RECOVERED ");
        assert_eq!(rec.len(), 1, "{fault}: one recovery expected:\n{}", h.stderr());
        assert_eq!(rec[0]["policy"], "microreset");
        // A crashed or hung vCPU was discarded holding the device's lock and
        // its own fd lock; a panic unwound and dropped its guards itself.
        let steps = rec[0]["steps"].as_array().unwrap();
        let released = steps.iter().find(|s| s["step"] == "release_locks").unwrap();
        let held_fd = released["detail"].as_array().unwrap().iter().any(|n| n == "vcpu.fd");
        assert_eq!(held_fd, fault != "panic", "{fault}: {released}");
        // The page-frame check found the VM's memory consistent.
        let mem = steps.iter().find(|s| s["step"] == "memory_check").unwrap();
        assert!(mem["detail"]["pages"].as_u64().unwrap() > 0, "{fault}: {mem}");
        assert_eq!(mem["detail"]["problems"], json!([]), "{fault}: {mem}");
        // Same process, and it still creates and runs VMs.
        assert_eq!(h.req(json!({"op":"info"})).unwrap()["pid"].as_u64(), pid);
        let id2 = h.create("compute", 0.5);
        h.assert_completes_verified(id2);
    }
}

#[test]
fn microreset_without_its_repairs_ends_in_a_clean_reported_failure() {
    if !kvm_available() {
        return;
    }
    // Without releasing the abandoned locks the vCPU deadlocks on its own fd
    // lock: the error recurs after every recovery until the storm limit.
    let mut h = start(&["--recovery", "microreset", "--repairs", "none"], "segv", 600);
    let _ = h.create("exits", 3.0);
    assert_eq!(h.wait_exit(Duration::from_secs(30)), Some(86), "{}", h.stderr());
    let failed = h.lines("NINELIVES-DETECTED ");
    assert!(failed.iter().any(|d| d["detector"] == "recovery_failed"), "{}", h.stderr());
}

#[test]
fn an_error_inside_the_recovery_ends_in_a_clean_reported_failure() {
    if !kvm_available() {
        return;
    }
    for policy in ["microreset", "microreboot"] {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("api.sock");
        let o = ninelives()
            .args(["host", "--api", sock.to_str().unwrap(), "--recovery", policy])
            .env("NINELIVES_DEVICE_FAULT", "segv:200")
            .env("NINELIVES_FAULT_IN_RECOVERY", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let t = Instant::now();
        while UnixStream::connect(&sock).is_err() {
            assert!(t.elapsed() < Duration::from_secs(20), "the host did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut s = UnixStream::connect(&sock).unwrap();
        let body = json!({"workload":"exits","mem":"64M","duration":3}).to_string();
        write!(s, "POST /v1/vms HTTP/1.1\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
        let o = o.wait_with_output().unwrap();
        // Exit 86, not a signal (no core dump), with both errors reported.
        assert_eq!(o.status.code(), Some(86), "{policy}: {o:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(err.matches("NINELIVES-DETECTED").count(), 2, "{policy}: {err}");
        assert!(!err.contains("NINELIVES-RECOVERED"), "{policy}: {err}");
    }
}

#[test]
fn microreboot_execs_a_fresh_vmm_in_place_and_the_guest_finishes() {
    if !kvm_available() {
        return;
    }
    let h = start(&["--recovery", "microreboot"], "segv", 600);
    let pid = h.req(json!({"op":"info"})).unwrap()["pid"].as_u64();
    let done = h.create("compute", 0.2);
    h.assert_completes_verified(done);
    let id = h.create("exits", 1.5);
    h.assert_completes_verified(id);
    let rec = h.lines("NINELIVES-RECOVERED ");
    assert_eq!(rec.len(), 1, "{}", h.stderr());
    assert_eq!(rec[0]["policy"], "microreboot");
    assert!(rec[0]["new_process_steps"].as_array().is_some_and(|s| !s.is_empty()));
    let info = h.req(json!({"op":"info"})).unwrap();
    assert_eq!(info["pid"].as_u64(), pid, "exec in place keeps the pid");
    assert_eq!(info["generation"], 1, "{info}");
    // A VM that had finished before the microreboot is still reported.
    h.assert_completes_verified(done);
    let id2 = h.create("compute", 0.5);
    h.assert_completes_verified(id2);
}

/// The same error showing on a second thread as the recovery starts (as
/// when two threads ran the same corrupted code before it was caught): the
/// second thread's work is discarded with the rest, and one recovery
/// covers both. The host keeps its pid and still serves its API.
#[test]
fn an_error_on_a_second_thread_as_a_recovery_starts_is_recovered_with_it() {
    if !kvm_available() {
        return;
    }
    let h = Host::start_env(
        &["--recovery", "microreset"],
        &[("NINELIVES_DEVICE_FAULT", "segv:300"), ("NINELIVES_FAULT_IN_RECOVERY", "other")],
    );
    let pid = h.req(json!({"op":"info"})).unwrap()["pid"].as_u64();
    let id = h.create("exits", 1.5);
    h.assert_completes_verified(id);
    let detected = h.lines("NINELIVES-DETECTED ");
    assert_eq!(detected.len(), 2, "{}", h.stderr());
    assert_eq!(h.lines("NINELIVES-RECOVERED ").len(), 1, "{}", h.stderr());
    assert_eq!(h.req(json!({"op":"info"})).unwrap()["pid"].as_u64(), pid);
}

/// An error in an API connection thread outside any request's handling
/// (here, just after it read a request) discards that connection only: its
/// client sees it close without an answer, the VMM recovers, and the VM
/// created before runs on to a verified end.
#[test]
fn an_error_in_an_api_connection_drops_only_that_connection() {
    if !kvm_available() {
        return;
    }
    for (policy, fault) in
        [("microreset", "segv"), ("microreset", "panic"), ("microreboot", "segv")]
    {
        // Request 1: info, 2: create, 3: the one that fails.
        let h = Host::start_env(
            &["--recovery", policy],
            &[("NINELIVES_API_FAULT", &format!("{fault}:3"))],
        );
        let pid = h.req(json!({"op":"info"})).unwrap()["pid"].as_u64();
        let id = h.create("exits", 1.5);
        assert!(
            h.req(json!({"op":"info"})).is_none(),
            "{policy}/{fault}: the failed connection answered"
        );
        h.assert_completes_verified(id);
        let rec = h.lines("NINELIVES-RECOVERED ");
        assert_eq!(rec.len(), 1, "{policy}/{fault}: one recovery expected:\n{}", h.stderr());
        assert_eq!(rec[0]["policy"], policy);
        assert_eq!(h.req(json!({"op":"info"})).unwrap()["pid"].as_u64(), pid);
    }
}

#[test]
fn a_corrupt_microreboot_record_is_refused_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    let rec = dir.path().join("record");
    std::fs::write(&rec, br#"{"magic":"ninelives-handover","version":1,"vms":[]}"#).unwrap();
    let cmd = format!(
        "exec 7<'{}'; exec '{}' host --api '{}' --recovery microreboot --reboot-record 7 --reboot-checksum 1234",
        rec.display(),
        env!("CARGO_BIN_EXE_ninelives"),
        sock.display()
    );
    let o = std::process::Command::new("bash").args(["-c", &cmd]).output().unwrap();
    assert_eq!(o.status.code(), Some(86), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("recovery_failed") && err.contains("corrupt"), "{err}");
}
