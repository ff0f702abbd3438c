//! Shared links (Quest-V's shared NIC driver): two sandboxes on one host
//! TAP, each with its own MAC and address.
//!
//! Each test runs in a network namespace of its own with TAP nltap0 at
//! 10.0.0.1/24; sandbox `a` is 10.0.0.2 and `b` 10.0.0.3, both netbench
//! (UDP echo on port 7). Every wait is bounded in count and time; nothing
//! asserts on timing.

use crate::common;

use std::net::SocketAddr;
use std::time::Duration;

use common::{kvm_available, two_cores, wait_for, Netns};
use nl_lab::ping::{ping, PingReport};

fn at(ip: &str) -> SocketAddr {
    format!("{ip}:7").parse().unwrap()
}

fn short_ping(ip: &str) -> PingReport {
    ping(at(ip), Duration::from_millis(10), Duration::from_millis(100), None).expect("ping")
}

/// 100 pings 5 ms apart.
fn pings(ip: &str) -> PingReport {
    let p = ping(at(ip), Duration::from_millis(5), Duration::from_millis(500), None).expect("ping");
    assert_eq!(p.sent, 100);
    p
}

fn config(mode: &str, rx_irq: bool) -> String {
    let [c0, c1] = two_cores();
    format!(
        r#"{{"links": [{{"name": "lan", "tap": "nltap0", "mode": "{mode}"}}],
            "sandboxes": [
            {{"name": "a", "cores": [{c0}], "workload": {{"kind": "netbench", "duration_ms": 0}},
              "net": {{"link": "lan", "mac": "52:54:00:5a:00:02", "ipv4": "10.0.0.2/24", "rx_irq": {rx_irq}}}}},
            {{"name": "b", "cores": [{c1}], "workload": {{"kind": "netbench", "duration_ms": 0}},
              "net": {{"link": "lan", "mac": "52:54:00:5a:00:03", "ipv4": "10.0.0.3/24", "rx_irq": {rx_irq}}}}}
        ]}}"#
    )
}

#[test]
fn two_sandboxes_on_one_shared_tap_answer_at_their_own_addresses_and_never_see_each_others_frames()
{
    if !kvm_available() {
        return;
    }
    let Some(ns) = Netns::new("sblink") else { return };
    let (mut to_a, mut to_b) = (None, None);
    let r = ns.supervised_set(&config("demux", false), |_| {
        wait_for("a answering on the shared TAP", Duration::from_secs(60), || {
            short_ping("10.0.0.2").received > 0
        });
        wait_for("b answering on the shared TAP", Duration::from_secs(60), || {
            short_ping("10.0.0.3").received > 0
        });
        to_a = Some(pings("10.0.0.2"));
        to_b = Some(pings("10.0.0.3"));
    });
    let (to_a, to_b) = (to_a.unwrap(), to_b.unwrap());
    assert!(to_a.received > 50 && to_b.received > 50, "a: {to_a:?}\nb: {to_b:?}");
    let (a, b) = (&r.sandboxes[0], &r.sandboxes[1]);
    let (na, nb) = (a.net.expect("a's device"), b.net.expect("b's device"));
    // Each answered its own pings: it sent at least the replies received.
    assert!(na.tx_frames >= to_a.received, "a: {na:?}");
    assert!(nb.tx_frames >= to_b.received, "b: {nb:?}");
    // Neither device got the other's pings (200 datagrams went out, 100 to
    // each; what else reaches both is the host's few broadcasts, ARP).
    assert!(na.rx_frames >= to_a.received && na.rx_frames < 150, "a got b's frames: {na:?}");
    assert!(nb.rx_frames >= to_b.received && nb.rx_frames < 150, "b got a's frames: {nb:?}");
    let link = &r.links[0];
    assert_eq!(link.members.len(), 2, "{link:?}");
    for m in &link.members {
        assert_eq!(m.foreign, 0, "{link:?}");
        assert_eq!(m.dropped, 0, "{link:?}");
    }
}

#[test]
fn multicast_gives_every_frame_and_its_interrupt_to_every_sandbox_on_the_link() {
    if !kvm_available() {
        return;
    }
    let Some(ns) = Netns::new("sbmcast") else { return };
    let mut to_a = None;
    let r = ns.supervised_set(&config("multicast", true), |_| {
        wait_for("a answering on the shared TAP", Duration::from_secs(60), || {
            short_ping("10.0.0.2").received > 0
        });
        to_a = Some(pings("10.0.0.2"));
    });
    let to_a = to_a.unwrap();
    assert!(to_a.received > 50, "{to_a:?}");
    let (a, b) = (&r.sandboxes[0], &r.sandboxes[1]);
    let (na, nb) = (a.net.expect("a's device"), b.net.expect("b's device"));
    // b's device got a's pings too, and was interrupted for them (the
    // receive thread raises one interrupt per batch it moves, so there are
    // at most as many interrupts as frames) ...
    assert!(nb.rx_frames >= to_a.received, "b: {nb:?}");
    let (ia, ib) = (a.net_interrupts.unwrap_or(0), b.net_interrupts.unwrap_or(0));
    assert!(ib > 0 && ia > 0, "interrupts: a {ia}, b {ib}");
    let link = &r.links[0];
    let mb = link.members.iter().find(|m| m.sandbox == "b").expect("b on the link");
    assert!(mb.foreign >= to_a.received, "{link:?}");
    // ... and its guest dropped them (early demultiplexing): it answered
    // none of them (what it sends is its own ARP, a handful of frames).
    assert!(na.tx_frames >= to_a.received, "a: {na:?}");
    assert!(nb.tx_frames < 20, "b answered a's pings: {nb:?}");
}
