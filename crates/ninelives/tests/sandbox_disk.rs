//! A sandbox's own virtio-blk disk: each sandbox works on its own image, a
//! restart builds the new VM over the same image, and an image reachable
//! from two sandboxes (under any name) is refused before anything runs.
//!
//! Every wait is bounded in count and time; nothing asserts on timing.

use crate::common;

use std::os::unix::fs::MetadataExt;
use std::time::Duration;

use common::{assert_completed_and_verified, kvm_available, sandbox_set, two_cores, wait_for};
use nl_checkpoint::inject::GuestFault;

/// An unmapped RIP: the next instruction faults (#PF) in guest ring 3.
const BAD_RIP: GuestFault = GuestFault::Register { cpu: 0, reg: "rip", bit: 40 };

fn two_on_disks(a: &std::path::Path, b: &std::path::Path) -> String {
    let [c0, c1] = two_cores();
    format!(
        r#"{{"sandboxes": [
            {{"name": "a", "cores": [{c0}], "mem_mib": 48, "recovery": {{"policy": "restart"}},
              "workload": {{"kind": "blkbench", "duration_ms": 1500}},
              "disk": {{"path": "{}"}}}},
            {{"name": "b", "cores": [{c1}], "mem_mib": 48,
              "workload": {{"kind": "blkbench", "duration_ms": 1500}},
              "disk": {{"path": "{}"}}}}
        ]}}"#,
        a.display(),
        b.display()
    )
}

/// Bytes of the image that hold data (allocated blocks, not holes).
fn allocated(path: &std::path::Path) -> u64 {
    std::fs::metadata(path).expect("image").blocks() * 512
}

#[test]
fn each_sandbox_works_on_its_own_disk_and_a_restart_keeps_it() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let (a_img, b_img) = (dir.path().join("a.img"), dir.path().join("b.img"));
    let s = sandbox_set(&two_on_disks(&a_img, &b_img));
    // Created sparse, sized for blkbench.
    for img in [&a_img, &b_img] {
        assert!(std::fs::metadata(img).expect("image").len() >= 128 << 20);
    }
    let a = s.get("a").expect("a");
    s.start_all().expect("start");
    let report = std::thread::scope(|scope| {
        let h = scope.spawn(|| s.supervise(Duration::from_secs(120) * common::LOADED));
        wait_for("a writing its disk", Duration::from_secs(60), || {
            a.vm().blk_stats().is_some_and(|(st, _, _)| st.writes > 0)
        });
        s.inject("a", &BAD_RIP).expect("inject");
        wait_for("a's restart", Duration::from_secs(60), || a.monitor.recovery_count() == 1);
        // The new VM has the disk again and writes it.
        wait_for("the restarted a writing its disk", Duration::from_secs(60), || {
            a.vm().blk_stats().is_some_and(|(st, _, _)| st.writes > 0)
        });
        h.join().expect("supervision")
    });
    for sb in &report.sandboxes {
        assert_completed_and_verified(sb);
        let d = sb.disk.expect("disk counters in the report");
        assert!(d.writes > 0 && d.reads > 0 && d.errors == 0, "{}: {d:?}", sb.name);
    }
    let (ra, rb) = (&report.sandboxes[0], &report.sandboxes[1]);
    assert_eq!(ra.recoveries.len(), 1, "{:?}", ra.recoveries);
    assert!(ra.recoveries[0].ok, "{:?}", ra.recoveries[0]);
    assert!(rb.detections.is_empty() && rb.recoveries.is_empty(), "b was touched: {rb:?}");
    // Each image holds what its own sandbox wrote.
    for img in [&a_img, &b_img] {
        assert!(allocated(img) > 1 << 20, "{} holds no data", img.display());
    }
}

/// The same image under a second name (a hard link, a symlink) in another
/// sandbox is refused with both names, from the command line too, and the
/// refused set writes nothing to it.
#[test]
fn one_image_in_two_sandboxes_is_refused_under_any_name() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let img = dir.path().join("a.img");
    std::fs::write(&img, vec![0x5au8; 128 << 20]).expect("image");
    let before = std::fs::read(&img).expect("read");
    let link = dir.path().join("link.img");
    std::os::unix::fs::symlink(&img, &link).expect("symlink");
    let cfg = dir.path().join("set.json");
    std::fs::write(&cfg, two_on_disks(&img, &link)).expect("config");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ninelives"))
        .args(["sandbox", "--config"])
        .arg(&cfg)
        .output()
        .expect("ninelives sandbox");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "accepted: {err}");
    assert!(
        err.contains("sandboxes 'a' and 'b' both reach disk image")
            && err.contains("at least one may write it"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(std::fs::read(&img).expect("read") == before, "the refused set wrote the image");
}

/// A `rollback` sandbox may have a writable disk: its writes are held until
/// no rollback can undo them, so blkbench, rolled back in the middle of its
/// file operations, finds on the image what its rolled-back state wrote and
/// ends verified, with no recurrence.
#[test]
fn a_rollback_sandbox_keeps_its_disk_consistent_with_its_memory() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let img = dir.path().join("r.img");
    let [c0, _] = two_cores();
    let s = sandbox_set(&format!(
        r#"{{"sandboxes": [
            {{"name": "r", "cores": [{c0}], "mem_mib": 48,
              "recovery": {{"policy": "rollback", "checkpoint_interval_ms": 50}},
              "detect": {{"heartbeat_cpu_ms": 100}},
              "workload": {{"kind": "blkbench", "duration_ms": 4000}},
              "disk": {{"path": "{}"}}}}
        ]}}"#,
        img.display()
    ));
    // The fault at 2.5 s, well into its file operations (a `rollback`
    // sandbox's faults are scripted into its checkpoint supervisor).
    s.get("r").expect("r").set_script(vec![(Duration::from_millis(2500), BAD_RIP)]);
    s.start_all().expect("start");
    let report = s.supervise(Duration::from_secs(120) * common::LOADED);
    let sb = &report.sandboxes[0];
    assert_completed_and_verified(sb);
    assert_eq!(sb.recoveries.len(), 1, "the error came back: {:?}", sb.recoveries);
    assert!(sb.recoveries[0].ok && sb.recoveries[0].policy == "rollback", "{:?}", sb.recoveries);
    let oc = sb.output_commit.as_ref().expect("the disk's writes were held");
    assert!(oc.disk_writes_released > 0, "{oc:?}");
}
