//! The measurement workloads of the Quest-V bench in sandboxes: `syscall`
//! (null syscalls through the guest kernel) and `tlbwalk` (one load, or one
//! instruction fetched, per page at a 4,160-byte stride), each verified
//! against the host's replay.

use crate::common;

use std::time::Duration;

use common::{assert_completed_and_verified, kvm_available, sandbox_set, two_cores};

#[test]
fn syscall_and_tlbwalk_sandboxes_complete_with_verified_digests() {
    if !kvm_available() {
        return;
    }
    let [c0, c1] = two_cores();
    let s = sandbox_set(&format!(
        r#"{{"sandboxes": [
            {{"name": "sys", "cores": [{c0}], "workload": {{"kind": "syscall", "seed": 2, "duration_ms": 200}}}},
            {{"name": "tlb", "cores": [{c1}], "workload": {{"kind": "tlbwalk", "seed": 2, "pages": 600, "duration_ms": 200}}}},
            {{"name": "itlb", "cores": [{c1}], "workload": {{"kind": "tlbwalk", "seed": 2, "pages": 600, "access": "fetch", "duration_ms": 200}}}}
        ], "channels": []}}"#
    ));
    s.start_all().expect("start");
    let r = s.supervise(Duration::from_secs(120));
    for sb in &r.sandboxes {
        assert_completed_and_verified(sb);
        assert!(sb.ops > 0, "{}: no ops", sb.name);
    }
    // Whole passes over the 600 pages: 109 passes of 600 loads (or 600
    // fetches: the guest ran its chain of code through every page, each
    // call's sum checked by the guest and the digest by the host) per round.
    for tlb in &r.sandboxes[1..] {
        assert_eq!(tlb.ops % (65_536 / 600 * 600), 0, "{}: {}", tlb.name, tlb.ops);
    }
}

#[test]
fn a_fetch_walk_is_only_for_tlbwalk_and_access_is_checked() {
    let cfg = |kind: &str, access: &str| {
        format!(
            r#"{{"sandboxes": [{{"name": "a", "cores": [0], "workload": {{"kind": "{kind}", "access": "{access}"}}}}], "channels": []}}"#
        )
    };
    assert!(nl_sandbox::SetConfig::parse(&cfg("tlbwalk", "fetch"))
        .and_then(|c| c.validate(1))
        .is_ok());
    for (kind, access) in [("memwrite", "fetch"), ("tlbwalk", "store")] {
        let e = nl_sandbox::SetConfig::parse(&cfg(kind, access))
            .and_then(|c| c.validate(1))
            .expect_err("refused");
        assert!(e.to_string().contains(&format!("access '{access}'")), "{e}");
    }
}

#[test]
fn a_tlbwalk_larger_than_the_sandbox_is_refused_by_name() {
    let text = r#"{"sandboxes": [
        {"name": "big", "cores": [0], "mem_mib": 64, "workload": {"kind": "tlbwalk", "pages": 65536}}
    ], "channels": []}"#;
    let c = nl_sandbox::SetConfig::parse(text).expect("parse");
    let e = c.validate(1).expect_err("refused").to_string();
    assert!(e.contains("sandbox 'big'") && e.contains("do not fit in 64 MiB"), "{e}");
    let zero = text.replace("65536", "0");
    let e = nl_sandbox::SetConfig::parse(&zero).and_then(|c| c.validate(1)).expect_err("refused");
    assert!(e.to_string().contains("tlbwalk pages 0 must be in 1..=65536"), "{e}");
}
