//! Sandboxes (Quest-V): channels between isolated VMs, the isolation audit,
//! read-only channel pages enforced by the VMM, and configuration errors.

use crate::common;

use std::io::Read;
use std::time::Duration;

use common::{
    assert_clean_error, assert_completed_and_verified, kvm_available, last_json, run_cli,
    sandbox_set, two_cores, write_file,
};
use nl_sandbox::SandboxSet;
use nl_vmm::VmOutcome;

/// The whole of a sandbox's RAM, read from its memfd.
fn ram(set: &SandboxSet, name: &str) -> Vec<u8> {
    let sb = set.get(name).expect("sandbox");
    let vm = sb.vm();
    let mut f = vm.memory().fd().as_ref();
    let mut v = Vec::new();
    std::io::Seek::rewind(&mut f).expect("rewind");
    f.read_to_end(&mut v).expect("read the memfd");
    v
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .or((a.len() != b.len()).then_some(a.len().min(b.len())))
}

#[test]
fn two_sandboxes_run_chanbench_over_a_channel_and_verify() {
    if !kvm_available() {
        return;
    }
    let [c0, c1] = two_cores();
    let s = sandbox_set(&format!(
        r#"{{"sandboxes": [
            {{"name": "a", "cores": [{c0}], "workload": {{"kind": "chanbench", "seed": 5, "max_msg": 1024}}}},
            {{"name": "b", "cores": [{c1}], "workload": {{"kind": "chanbench", "seed": 5, "max_msg": 1024}}}}
        ], "channels": [{{"name": "ab", "between": ["a", "b"]}}]}}"#
    ));
    s.start_all().expect("start");
    let r = s.supervise(Duration::from_secs(120));
    for sb in &r.sandboxes {
        assert_completed_and_verified(sb);
        assert_eq!(sb.violations, 0);
    }
    let lead = nl_sandbox::chanbench::parse_console(&r.sandboxes[0].console);
    assert_eq!(
        lead.iter().map(|n| n.size).collect::<Vec<_>>(),
        vec![8, 16, 32, 64, 128, 256, 512, 1024]
    );
    assert!(r.sandboxes[1].console.contains("rejected=0"), "{}", r.sandboxes[1].console);
    let c = &r.channels[0];
    assert!(c.regions[0].generation != 0 && c.regions[1].generation != 0, "{c:?}");
    assert!(c.regions[0].head_words > 0 && c.regions[1].head_words > 0, "{c:?}");
}

/// A runs wild (ring-3 writes over its heap and both of its channel
/// windows) while B is paused; B's RAM and B's channel region must be
/// unchanged byte for byte, every write A aimed at B's read-only region
/// reported, and B must then finish with its digest verified.
fn wildwrite_beside(seed: u64) {
    let [c0, c1] = two_cores();
    let s = sandbox_set(&format!(
        r#"{{"sandboxes": [
            {{"name": "a", "cores": [{c0}], "on_violation": "report", "workload": {{"kind": "wildwrite", "seed": {seed}}}}},
            {{"name": "b", "cores": [{c1}], "workload": {{"kind": "memwrite", "seed": {seed}, "ws_mib": 4, "duration_ms": 200}}}}
        ], "channels": [{{"name": "ab", "between": ["a", "b"]}}]}}"#
    ));
    let (a, b) = (s.get("a").unwrap(), s.get("b").unwrap());
    s.start(b).expect("start b");
    b.vm().pause();
    let b_ram = ram(&s, "b");
    let b_region = s.channels[0].read_region(1);
    let a_region = s.channels[0].read_region(0);
    s.start(a).expect("start a");
    let out = a.vm().wait(Duration::from_secs(120));
    assert_eq!(out, VmOutcome::Completed, "a: {}\n{}", out.message(), a.vm().console().tail());
    let after = ram(&s, "b");
    assert_eq!(first_difference(&b_ram, &after), None, "seed {seed}: sandbox b's RAM changed");
    assert_eq!(
        first_difference(&b_region, &s.channels[0].read_region(1)),
        None,
        "seed {seed}: b's channel region changed"
    );
    assert!(
        first_difference(&a_region, &s.channels[0].read_region(0)).is_some(),
        "a's own window was written"
    );
    b.vm().resume();
    let outb = b.vm().wait(Duration::from_secs(120));
    let r = s.report(&[out, outb]);
    let (ra, rb) = (&r.sandboxes[0], &r.sandboxes[1]);
    assert!(ra.verified, "seed {seed}: {:?}", ra.problem);
    assert!(
        ra.violations > 0 && ra.violations == ra.digest,
        "{} reported, {} aimed",
        ra.violations,
        ra.digest
    );
    let peer = nl_abi::channel_peer_gpa(0);
    for v in &ra.violation_log {
        assert!(v.gpa >= peer && v.gpa < peer + nl_abi::CHANNEL_REGION_BYTES, "{v:?}");
        assert!(
            v.rip >= nl_abi::USER_BASE && v.rip < nl_abi::USER_STACKS_GPA,
            "rip in the user program: {v:?}"
        );
        assert_eq!(v.sandbox, "a");
    }
    assert_eq!(rb.outcome, VmOutcome::Completed, "b: {}", rb.message);
    assert!(rb.verified, "b: {:?}", rb.problem);
    assert_eq!(rb.violations, 0);
}

#[test]
fn wildwrite_changes_nothing_in_another_sandbox_and_every_readonly_write_is_reported() {
    if !kvm_available() {
        return;
    }
    for seed in [1, 2] {
        wildwrite_beside(seed);
    }
}

#[test]
fn a_write_to_a_readonly_channel_page_stops_the_sandbox_by_default() {
    if !kvm_available() {
        return;
    }
    let [c0, c1] = two_cores();
    let s = sandbox_set(&format!(
        r#"{{"sandboxes": [
            {{"name": "a", "cores": [{c0}], "workload": {{"kind": "wildwrite", "seed": 3}}}},
            {{"name": "b", "cores": [{c1}], "workload": {{"kind": "memwrite", "ws_mib": 4, "duration_ms": 300}}}}
        ], "channels": [{{"name": "ab", "between": ["a", "b"]}}]}}"#
    ));
    s.start_all().expect("start");
    let r = s.supervise(Duration::from_secs(120));
    let (a, b) = (&r.sandboxes[0], &r.sandboxes[1]);
    assert!(a.stopped_for_violation, "a: {}", a.message);
    assert!(
        matches!(a.outcome, VmOutcome::GuestError { code, .. } if code == nl_abi::ERR_CHANNEL_VIOLATION)
    );
    assert!(a.message.contains("isolation violation"), "{}", a.message);
    assert_eq!(a.violations, 1, "stopped at the first violation");
    let v = &a.violation_log[0];
    let peer = nl_abi::channel_peer_gpa(0);
    assert!(v.gpa >= peer && v.gpa < peer + nl_abi::CHANNEL_REGION_BYTES, "{v:?}");
    assert!(v.rip >= nl_abi::USER_BASE, "{v:?}");
    assert_eq!(b.outcome, VmOutcome::Completed, "b runs on: {}", b.message);
    assert!(b.verified, "{:?}", b.problem);
}

#[test]
fn the_cli_runs_a_sandbox_set_and_reports_json() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let [c0, c1] = two_cores();
    let cfg = write_file(
        dir.path(),
        "set.json",
        format!(
            r#"{{"sandboxes": [
                {{"name": "a", "cores": [{c0}], "workload": {{"kind": "chanbench", "max_msg": 64}}}},
                {{"name": "b", "cores": [{c1}], "workload": {{"kind": "chanbench", "max_msg": 64}}}}
            ], "channels": [{{"name": "ab", "between": ["a", "b"]}}]}}"#
        )
        .as_bytes(),
    );
    let o = run_cli(&["sandbox", "--config", &cfg, "--json"]);
    assert!(o.status.success(), "{}{}", common::stdout(&o), common::stderr(&o));
    let j = last_json(&o);
    assert_eq!(j["sandboxes"][0]["verified"], true);
    assert_eq!(j["sandboxes"][1]["verified"], true);
    assert!(common::stdout(&o).contains("isolation audit: 6 memory slots checked, passed"));
}

/// Runs `ninelives sandbox --check` on `config` and expects a clean error
/// containing `needle`.
fn refused(config: &str, needle: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = write_file(dir.path(), "set.json", config.as_bytes());
    assert_clean_error(&run_cli(&["sandbox", "--config", &cfg, "--check"]), needle);
}

#[test]
fn bad_configurations_are_refused_with_clear_errors() {
    if !kvm_available() {
        return;
    }
    let host = nl_sandbox::affinity::host_cores().expect("affinity").len();
    let dir = tempfile::tempdir().expect("tempdir");
    let mem = dir.path().join("ram");
    // Overlapping memory: two sandboxes backed by one file (through two
    // names: a hard link is the same host pages).
    let link = dir.path().join("ram-link");
    std::fs::write(&mem, b"").expect("file");
    std::fs::hard_link(&mem, &link).expect("link");
    refused(
        &format!(
            r#"{{"sandboxes": [
                {{"name": "a", "cores": [0], "memory_file": "{}", "workload": {{"kind": "idle"}}}},
                {{"name": "b", "cores": [0], "memory_file": "{}", "workload": {{"kind": "idle"}}}}
            ]}}"#,
            mem.display(),
            link.display()
        ),
        "reachable from sandbox 'a' (RAM in",
    );
    refused(
        r#"{"sandboxes": [{"name": "a", "cores": [0], "workload": {"kind": "idle"}}],
            "channels": [{"name": "x", "between": ["a", "ghost"]}]}"#,
        "channel 'x' names unknown sandbox 'ghost'",
    );
    refused(
        r#"{"sandboxes": [{"name": "a", "cores": [0], "workload": {"kind": "idle"},
            "budget": {"runtime_us": 9700, "period_us": 10000}}]}"#,
        "97% of a core, more than the 95% allowed",
    );
    let too_many: Vec<String> = (0..=host).map(|c| c.to_string()).collect();
    refused(
        &format!(
            r#"{{"sandboxes": [{{"name": "a", "cores": [{}], "workload": {{"kind": "idle"}}}}]}}"#,
            too_many.join(", ")
        ),
        &format!("asks for {} cores, the host has {host}", host + 1),
    );
    refused(
        r#"{"sandboxes": [{"name": "a", "cores": [0], "workload": {"kind": "nope"}}]}"#,
        "unknown workload kind 'nope'",
    );
    refused(r#"{"sandboxes": "#, "not a valid sandbox configuration");
    // The refused set left the memory file untouched (nothing was created).
    assert_eq!(std::fs::metadata(&mem).expect("file").len(), 0);
}
