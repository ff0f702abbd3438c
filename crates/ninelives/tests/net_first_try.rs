//! Networking on the first try: `--net-host-ip` brings the host end of a
//! fresh TAP up with its address, so the guest answers a ping with no
//! manual `ip` step; bad combinations are refused by name.

use crate::common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

#[test]
fn net_host_ip_makes_the_guest_reachable_without_an_ip_step() {
    if !kvm_available() {
        return;
    }
    let Some(ns) = Netns::bare("firsttry") else { return };
    let mut vm = ns
        .ninelives(&[
            "run",
            "--workload",
            "netbench",
            "--net-tap",
            "nlfirst0",
            "--net-ip",
            "10.0.0.2/24",
            "--net-host-ip",
            "10.0.0.1/24",
            "--duration",
            "60",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let answered = ns.wait_answering(Duration::from_secs(60));
    // Read while the VMM (which owns the TAP) still runs.
    let addr = Command::new("ip")
        .args(["netns", "exec", ns.0.name(), "ip", "-4", "addr", "show", "dev", "nlfirst0"])
        .output()
        .unwrap();
    let addr = String::from_utf8_lossy(&addr.stdout).to_string();
    let _ = vm.kill();
    let out = vm.wait_with_output().unwrap();
    assert!(answered, "the guest never answered: {}", String::from_utf8_lossy(&out.stderr));
    assert!(addr.contains("10.0.0.1/24") && addr.contains("UP"), "{addr}");
}

#[test]
fn a_host_address_off_the_guests_subnet_is_refused() {
    for (host, needle) in [
        ("10.1.0.1/24", "not on the same subnet"),
        ("10.0.0.2/24", "the guest's own address"),
        ("10.0.0.1/16", "not on the same subnet"),
    ] {
        let o = run_cli(&[
            "run",
            "--workload",
            "netbench",
            "--net-tap",
            "nlnever0",
            "--net-ip",
            "10.0.0.2/24",
            "--net-host-ip",
            host,
            "--duration",
            "1",
        ]);
        assert_clean_error(&o, needle);
    }
}

/// Without `--net-host-ip`, a TAP that is down in the VMM's namespace (the
/// VMM created it there, and nobody brought it up) gets the hint that the
/// guest is unreachable and how to fix it. The check asks the VMM's own
/// namespace: `net::netbench_answers_pings` shows it does not complain of
/// a TAP that is up there.
#[test]
fn a_tap_left_down_gets_the_hint_to_bring_it_up() {
    if !kvm_available() {
        return;
    }
    let Some(ns) = Netns::bare("tapdown") else { return };
    let o = ns
        .ninelives(&[
            "run",
            "--workload",
            "netbench",
            "--net-tap",
            "nldown0",
            "--net-ip",
            "10.0.0.2/24",
            "--duration",
            "0.2",
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("TAP nldown0 is down on the host")
            && err.contains("--net-host-ip 10.0.0.1/24"),
        "no hint for a TAP that is down: {err}"
    );
}
