//! Unit tests written against surviving cargo-mutants mutants of recovery
//! (see docs/testing.md). The thread handling of a recovery is tested in
//! `tests/recovery_threads.rs`, a process of its own.

use std::sync::Arc;

use super::*;

/// The hosts a recovery repairs are the live ones registered: a dropped
/// host is no longer among them. Needs KVM (a host opens /dev/kvm).
#[test]
fn live_hosts_are_the_registered_hosts_still_alive() {
    if std::fs::metadata("/dev/kvm").is_err() {
        assert!(
            std::env::var("NINELIVES_REQUIRE_KVM").as_deref() != Ok("1"),
            "NINELIVES_REQUIRE_KVM=1 but /dev/kvm is missing"
        );
        use std::io::Write;
        let _ = std::io::stderr().write_all(
            b"*** SKIPPED live_hosts_are_the_registered_hosts_still_alive: no /dev/kvm ***\n",
        );
        return;
    }
    let h = crate::host::Host::new().expect("a host");
    assert!(live_hosts().iter().any(|l| Arc::ptr_eq(l, &h)), "a new host is not live");
    let weak = Arc::downgrade(&h);
    drop(h);
    if weak.strong_count() == 0 {
        assert!(
            live_hosts().iter().all(|l| !std::ptr::eq(Arc::as_ptr(l), weak.as_ptr())),
            "a dropped host is still live"
        );
    }
}
