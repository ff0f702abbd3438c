//! virtio-net and netbench, end to end, inside a network namespace of the
//! test's own with a TAP in it: only addresses inside it are ever used.

use crate::common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;

#[test]
fn netbench_answers_pings() {
    netbench_ping("ping", false);
}

/// The same with the VMM's receive thread and the net interrupt: the guest
/// halts whenever it is idle and is woken by the interrupt of each frame.
/// The test checks the device raised at least one interrupt per answered
/// ping, and, from the guest's own counts, that the guest took net
/// interrupts and that some of its idle halts were ended by one with a
/// frame received during the halt, which only the receive thread can put
/// there (the timer tick also wakes it and answers the pings by polling,
/// and its own notify raises the interrupt too; those wake-ups are counted
/// apart and do not count here).
#[test]
fn netbench_with_rx_interrupts_answers_pings_and_raises_interrupts() {
    netbench_ping("irq", true);
}

/// Boots netbench in a namespace of its own and pings it. No rate or
/// window is asserted (the machine is shared and loaded): only that pings
/// were answered, that the guest's device moved at least as many frames,
/// and how the guest was told of them.
fn netbench_ping(tag: &str, rx_irq: bool) {
    if !kvm_available() {
        return;
    }
    let Some(ns) = Netns::new(tag) else { return };
    let mut args = vec![
        "run",
        "--workload",
        "netbench",
        "--net-tap",
        "nltap0",
        "--net-ip",
        "10.0.0.2/24",
        "--duration",
        "3",
        "--json",
    ];
    if rx_irq {
        args.push("--net-rx-irq");
    }
    let vm = ns.ninelives(&args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    // Wait (bounded) until the guest answers at all, then measure.
    assert!(ns.wait_answering(Duration::from_secs(10)), "the guest never answered");
    let o = ns
        .ninelives(&[
            "ping",
            "--target",
            "10.0.0.2",
            "--interval",
            "5ms",
            "--duration",
            "0.5",
            "--json",
        ])
        .output()
        .unwrap();
    let p = last_json(&o);
    assert_eq!(p["sent"], 100, "{p}");
    let received = p["received"].as_u64().unwrap();
    assert!(received > 0, "no ping answered: {p}");
    let out = vm.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    // The namespace's TAP is up: no hint that it is down (the check must
    // ask the TAP's namespace, not the sysfs of the one /sys came from).
    assert!(!err.contains("is down on the host"), "a false hint: {err}");
    let j = last_json(&out);
    let v = &j["vms"][0];
    assert_eq!(v["digest_ok"], true, "{j}");
    // wait_answering's pings and these: the device received and sent each.
    assert!(v["net"]["rx_frames"].as_u64().unwrap() >= received, "{j}");
    assert!(v["net"]["tx_frames"].as_u64().unwrap() >= received, "{j}");
    if rx_irq {
        // The receive thread raised an interrupt for each frame it moved.
        let irqs = v["net_interrupts"].as_u64().unwrap();
        assert!(irqs >= received, "{irqs} interrupts for {received} answered pings: {j}");
        // The guest took them, and they, not only its timer tick, ended
        // its idle halts.
        let g = &v["guest_net"];
        assert!(g["irqs"].as_u64().unwrap() > 0, "the guest took no net interrupt: {j}");
        assert!(
            g["irq_wakes"].as_u64().unwrap() > 0,
            "no idle halt of the guest was ended by a net interrupt: {j}"
        );
    } else {
        // Without --net-rx-irq the guest never halts to wait for frames
        // and takes no net interrupt (the pins stay masked).
        let g = &v["guest_net"];
        assert_eq!(g["irqs"], 0, "{j}");
        assert_eq!((g["irq_wakes"].as_u64(), g["other_wakes"].as_u64()), (Some(0), Some(0)), "{j}");
    }
}

#[test]
fn kv_serves_answers_udp_echo_and_kvload_finds_every_acknowledged_write() {
    if !kvm_available() {
        return;
    }
    let Some(ns) = Netns::new("kv") else { return };
    let vm = ns
        .ninelives(&[
            "run",
            "--workload",
            "kv",
            "--net-tap",
            "nltap0",
            "--net-ip",
            "10.0.0.2/24",
            "--duration",
            "8",
            "--json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait (bounded) until the server answers at all.
    let t = Instant::now();
    loop {
        let o = ns
            .ninelives(&[
                "kvload",
                "--target",
                "10.0.0.2",
                "--duration",
                "0.1",
                "--keys",
                "4",
                "--timeout",
                "200ms",
            ])
            .output()
            .unwrap();
        if o.status.success() {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "the guest never answered: {}", stdout(&o));
    }
    // The kv guest answers UDP echo on port 7 too (what the failover ping
    // of `bench replicate` probes), outside the table and its digest.
    let o = ns
        .ninelives(&["ping", "--target", "10.0.0.2", "--interval", "10ms", "--duration", "0.3"])
        .arg("--json")
        .output()
        .unwrap();
    let j = last_json(&o);
    assert!(j["received"].as_u64().is_some_and(|r| r > 0), "no echo from the kv guest: {j}");
    let o = ns
        .ninelives(&[
            "kvload",
            "--target",
            "10.0.0.2:7000",
            "--duration",
            "2",
            "--connections",
            "4",
            "--keys",
            "300",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stdout(&o));
    let j = last_json(&o);
    assert!(j["ops"].as_u64().unwrap() > 0, "{j}");
    assert!(j["puts"].as_u64().unwrap() > 0, "{j}");
    assert_eq!(j["mismatches"], 0, "{j}");
    assert_eq!(j["readback_checked"], 300, "{j}");
    assert_eq!(j["readback_mismatches"], 0, "{j}");
    assert_eq!(j["digest_ok"], true, "{j}");
    let out = vm.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let j = last_json(&out);
    assert_eq!(j["vms"][0]["digest_ok"], true);
}

#[test]
fn net_bad_setups_are_clear_errors() {
    let o = run_cli(&["run", "--workload", "kv"]);
    assert_clean_error(&o, "kv needs a network device");
    let o = run_cli(&["kvload", "--target", "not an address", "--duration", "0.1"]);
    assert_clean_error(&o, "not an address");
    let o = run_cli(&["kvload", "--target", "127.0.0.1", "--keys", "0"]);
    assert_clean_error(&o, "0 is not in 1..=");
    let o = run_cli(&["run", "--workload", "netbench"]);
    assert_clean_error(&o, "needs a network device");
    let o = run_cli(&["run", "--workload", "netbench", "--net-tap", "x", "--net-ip", "300.1.1.1"]);
    assert_clean_error(&o, "not an IPv4 address");
    let o = run_cli(&["ping", "--target", "not an address", "--duration", "0.1"]);
    assert_clean_error(&o, "not an address");
    let o = run_cli(&["ping", "--target", "127.0.0.1", "--interval", "1h"]);
    assert_clean_error(&o, "longer than --duration");
    let o = run_cli(&["ping", "--target", "127.0.0.1", "--interval", "3 fortnights"]);
    assert_clean_error(&o, "not a duration");
}

#[test]
fn bench_reports_netbench_next_to_a_host_baseline() {
    if !kvm_available() {
        return;
    }
    let o =
        run_cli(&["bench", "--workloads", "netbench", "--duration", "1", "--boots", "1", "--json"]);
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    let j = last_json(&o);
    if let Some(s) = j["skipped"].as_array().filter(|s| !s.is_empty()) {
        common::skip(common::Prereq::Netns, &format!("bench netbench entry: {}", s[0]["reason"]));
        return;
    }
    let e = &j["results"][0];
    assert_eq!(e["workload"], "netbench", "{j}");
    assert_eq!(e["digest_ok"], true, "{j}");
    assert!(e["guest"]["received"].as_u64().unwrap() > 0, "{j}");
    assert!(e["host_baseline"]["received"].as_u64().unwrap() > 0, "{j}");
    assert!(e["guest_rx_irq"]["received"].as_u64().unwrap() > 0, "{j}");
    assert!(e["guest"]["median_ms"].as_f64().unwrap() > 0.0, "{j}");
}
