//! virtio-net and netbench, end to end, inside a network namespace of the
//! test's own with a TAP in it: only addresses inside it are ever used.

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;

#[test]
fn netbench_answers_a_1ms_ping() {
    netbench_ping("ping", &[]);
}

/// The same with the VMM's receive thread and the net interrupt: the guest
/// halts whenever it is idle and is woken by the interrupt of each frame.
#[test]
fn netbench_with_rx_interrupts_answers_a_1ms_ping() {
    netbench_ping("irq", &["--net-rx-irq"]);
}

fn netbench_ping(tag: &str, extra: &[&str]) {
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
    args.extend_from_slice(extra);
    let vm = ns.ninelives(&args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    // Wait (bounded) until the guest answers at all, then measure.
    assert!(ns.wait_answering(Duration::from_secs(10)), "the guest never answered");
    let o = ns
        .ninelives(&[
            "ping",
            "--target",
            "10.0.0.2",
            "--interval",
            "1ms",
            "--duration",
            "1",
            "--json",
        ])
        .output()
        .unwrap();
    let j = last_json(&o);
    assert_eq!(j["sent"], 1000);
    assert!(j["received"].as_u64().unwrap() >= 900, "{j}");
    assert_eq!(j["bad_windows"].as_array().unwrap().len(), 0, "{j}");
    let out = vm.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let j = last_json(&out);
    assert_eq!(j["vms"][0]["digest_ok"], true);
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
    assert!(!o.status.success());
    let o = run_cli(&["run", "--workload", "netbench"]);
    assert_clean_error(&o, "needs a network device");
    let o = run_cli(&["run", "--workload", "netbench", "--net-tap", "x", "--net-ip", "300.1.1.1"]);
    assert_clean_error(&o, "not an IPv4 address");
    let o = run_cli(&["ping", "--target", "not an address", "--duration", "0.1"]);
    assert_clean_error(&o, "not an address");
    let o = run_cli(&["ping", "--target", "127.0.0.1", "--interval", "1h"]);
    assert_clean_error(&o, "unknown unit");
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
