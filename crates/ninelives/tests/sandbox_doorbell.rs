//! Channel doorbells: a write by one sandbox to its doorbell page raises an
//! interrupt in the other through KVM alone (an ioeventfd in the sender's
//! VM, an irqfd with the same eventfd in the receiver's). The `doorbell`
//! workload never polls: it halts until the peer's head moves, so only the
//! doorbell's interrupt (or the 100 Hz timer) wakes it, and it counts the
//! halts that ended before any timer tick.

use crate::common;

use std::time::Duration;

use common::{assert_completed_and_verified, kvm_available, sandbox_set, two_cores};
use nl_vmm::VmOutcome;

fn doorbell_pair(seed: u64, irqfd: bool) -> nl_sandbox::SetReport {
    let [c0, c1] = two_cores();
    let s = sandbox_set(&format!(
        r#"{{"sandboxes": [
            {{"name": "a", "cores": [{c0}], "workload": {{"kind": "doorbell", "seed": {seed}}}}},
            {{"name": "b", "cores": [{c1}], "workload": {{"kind": "doorbell", "seed": {seed}}}}}
        ], "channels": [{{"name": "ab", "between": ["a", "b"], "doorbell": true, "doorbell_irqfd": {irqfd}}}]}}"#
    ));
    s.start_all().expect("start");
    s.supervise(Duration::from_secs(120))
}

/// `woken=N` from a sandbox's `doorbell end=...` console line.
fn woken(console: &str) -> Option<u64> {
    let line = console.lines().find(|l| l.starts_with("doorbell end="))?;
    line.split_whitespace().find_map(|w| w.strip_prefix("woken=")?.parse().ok())
}

#[test]
fn a_doorbell_wakes_the_halted_receiver_in_the_other_sandbox() {
    if !kvm_available() {
        return;
    }
    let r = doorbell_pair(3, true);
    for sb in &r.sandboxes {
        assert_completed_and_verified(sb);
        let w = woken(&sb.console).unwrap_or_else(|| panic!("no doorbell line:\n{}", sb.console));
        assert!(w > 0, "{}: no halt ended by the doorbell:\n{}", sb.name, sb.console);
        assert_eq!(sb.ops, nl_workloads::doorbell::ITERS as u64);
    }
}

#[test]
fn without_the_receivers_irqfd_no_halt_ends_by_the_doorbell_and_the_check_fails() {
    if !kvm_available() {
        return;
    }
    let r = doorbell_pair(4, false);
    for sb in &r.sandboxes {
        assert!(
            matches!(sb.outcome, VmOutcome::GuestError { code: nl_abi::ERR_SELF_CHECK, .. }),
            "{}: {}\n{}",
            sb.name,
            sb.message,
            sb.console
        );
        assert!(
            sb.console.contains("the doorbell was not delivered"),
            "{}: {}\n{}",
            sb.name,
            sb.message,
            sb.console
        );
        assert_eq!(woken(&sb.console), Some(0), "{}", sb.console);
    }
}
