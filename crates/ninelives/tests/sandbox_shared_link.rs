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
use nl_devices::packet::{ifindex, Filter, PacketSocket};
use nl_devices::tap::Tap;
use nl_lab::ping::{ping, PingReport};
use nl_sandbox::shared_link::{LinkReport, SharedLink};

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
        // Frames from the host only (its pings, ARP), never the other
        // member's (its replies, its ARP).
        assert!(m.delivered >= 100 && m.delivered <= link.from_tap, "{link:?}");
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
    // Both members got frames the host sent only, never a's replies (a
    // member's transmitted frames), which would add about 100 each.
    for m in &link.members {
        assert!(m.delivered + m.dropped <= link.from_tap, "got a member's frames: {link:?}");
    }
}

const MAC_A: [u8; 6] = [0x52, 0x54, 0, 0x5a, 0, 2];
const MAC_B: [u8; 6] = [0x52, 0x54, 0, 0x5a, 0, 3];
const MAC_C: [u8; 6] = [0x52, 0x54, 0, 0x5a, 0, 9];
/// The test frames' EtherType (IEEE local experimental), so the host's own
/// frames (IPv6 multicast) are told apart.
const MARK: [u8; 2] = [0x88, 0xb5];
/// Byte 14 of a test frame: who sent it.
const FROM_HOST: u8 = 1;
const FROM_MEMBER: u8 = 2;

fn test_frame(dst: [u8; 6], src: [u8; 6], from: u8) -> Vec<u8> {
    let mut f = vec![0u8; 60];
    f[..6].copy_from_slice(&dst);
    f[6..12].copy_from_slice(&src);
    f[12..14].copy_from_slice(&MARK);
    f[14] = from;
    f
}

/// The marked frames waiting on `port` (read until none came for 100 ms,
/// at most 2 s), as (destination, sender kind).
fn marked(port: &mut Tap) -> Vec<([u8; 6], u8)> {
    let (mut got, mut buf) = (Vec::new(), vec![0u8; 2048]);
    let (t0, mut quiet) = (std::time::Instant::now(), 0);
    while quiet < 10 && t0.elapsed() < Duration::from_secs(2) {
        match port.recv(&mut buf).expect("a port read") {
            Some(n) => {
                quiet = 0;
                if n >= 15 && buf[12..14] == MARK {
                    got.push((buf[..6].try_into().unwrap(), buf[14]));
                }
            }
            None => {
                quiet += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
    got
}

/// Opens the link of `config(mode)` in the calling thread's namespace;
/// the host sends marked frames out of nltap0 (3 to a's MAC, 4 to b's, 2
/// broadcast, 5 to a MAC on no member) and both members transmit marked
/// frames (broadcast and to c's MAC) into it. Returns what each port got
/// and the link's report.
type Got = (Vec<([u8; 6], u8)>, Vec<([u8; 6], u8)>, LinkReport);
fn exchange(mode: &str) -> Got {
    let c = nl_sandbox::SetConfig::parse(&config(mode, false)).expect("config");
    let link = SharedLink::open(&c, &c.links[0]).expect("the link");
    let mut a = Tap::over_port(&link.port("a").expect("a's port"), "nltap0").unwrap();
    let mut b = Tap::over_port(&link.port("b").expect("b's port"), "nltap0").unwrap();
    let host = PacketSocket::open(ifindex("nltap0").unwrap(), &Filter::new().drop_all(), Some(1))
        .expect("the host's packet socket");
    let me = [0x02, 0, 0, 0, 0, 1];
    // Until the TAP's carrier is in effect (the kernel switches its queue
    // discipline from noop, which drops, a moment after the link attached
    // it), the host's frames are lost: send broadcast probes until one
    // reaches a (at most 3 s), then take what the ports got so far.
    let mut buf = vec![0u8; 2048];
    let ready = (0..300).any(|_| {
        host.send(&test_frame([0xff; 6], me, 0)).unwrap();
        std::thread::sleep(Duration::from_millis(10));
        std::iter::from_fn(|| a.recv(&mut buf).unwrap()).take(100).count() > 0
    });
    assert!(ready, "no frame from the host reached a in 3 s");
    let _ = (marked(&mut a), marked(&mut b));
    for (dst, n) in [(MAC_A, 3), (MAC_B, 4), ([0xff; 6], 2), (MAC_C, 5)] {
        for _ in 0..n {
            assert_eq!(host.send(&test_frame(dst, me, FROM_HOST)).unwrap(), 60);
        }
    }
    for (port, src) in [(&mut a, MAC_A), (&mut b, MAC_B)] {
        for dst in [[0xff; 6], MAC_C, MAC_A, MAC_B] {
            assert!(port.send(&test_frame(dst, src, FROM_MEMBER)), "a member's send");
        }
    }
    let (ga, gb) = (marked(&mut a), marked(&mut b));
    (ga, gb, link.report())
}

fn count(got: &[([u8; 6], u8)], dst: [u8; 6]) -> usize {
    got.iter().filter(|(d, _)| *d == dst).count()
}

#[test]
fn a_links_members_get_only_the_frames_the_host_sends_them_never_a_members_own() {
    let Some(ns) = Netns::new("sbsock") else { return };
    let (da, db, dl) = ns.0.run_in(|| Ok(exchange("demux"))).unwrap();
    // demux: each member its own MAC's frames and the broadcasts, from the
    // host only (no member's transmitted frame, broadcast or not).
    for (got, mine, n) in [(&da, MAC_A, 3), (&db, MAC_B, 4)] {
        assert!(got.iter().all(|&(_, from)| from == FROM_HOST), "{got:?}");
        assert_eq!((count(got, mine), count(got, [0xff; 6]), got.len()), (n, 2, n + 2), "{got:?}");
    }
    assert_eq!(dl.unknown, 5, "{dl:?}");
    assert!(dl.from_tap >= 14, "{dl:?}");
    for (m, n) in dl.members.iter().zip([5, 6]) {
        assert!(m.delivered >= n && m.dropped == 0 && m.foreign == 0, "{dl:?}");
    }
    let (ma, mb, ml) = ns.0.run_in(|| Ok(exchange("multicast"))).unwrap();
    // multicast: every frame the host sent, to both; still none a member sent.
    for got in [&ma, &mb] {
        assert!(got.iter().all(|&(_, from)| from == FROM_HOST), "{got:?}");
        assert_eq!(got.len(), 14, "{got:?}");
    }
    assert_eq!(ml.unknown, 0, "{ml:?}");
    // Foreign: unicast for another MAC (a: 4 for b and 5 for c; b: 3 + 5).
    let foreign: Vec<u64> = ml.members.iter().map(|m| m.foreign).collect();
    assert_eq!(foreign, [9, 8], "{ml:?}");
    // After the link closed, a private user of the (persistent) TAP gets
    // the host's frames (no drop-all filter left on it), and none were
    // left queued.
    ns.0.run_in(|| {
        let mut tap = Tap::open("nltap0").map_err(anyhow::Error::msg)?;
        let mut buf = vec![0u8; 2048];
        let mut stale = 0;
        for _ in 0..1000 {
            match tap.recv(&mut buf)? {
                Some(n) if n >= 15 && buf[12..14] == MARK => stale += 1,
                Some(_) => {}
                None => break,
            }
        }
        assert_eq!(stale, 0, "frames left in the TAP's queue");
        let host = PacketSocket::open(ifindex("nltap0")?, &Filter::new().drop_all(), Some(1))?;
        // (Sent again until it arrives: see the carrier in `exchange`.)
        let mut got = false;
        for _ in 0..300 {
            host.send(&test_frame(MAC_A, [0x02, 0, 0, 0, 0, 1], FROM_HOST))?;
            std::thread::sleep(Duration::from_millis(10));
            if let Some(n) = tap.recv(&mut buf)? {
                if n >= 15 && buf[12..14] == MARK {
                    got = true;
                    break;
                }
            }
        }
        assert!(got, "the TAP kept the link's drop-all filter");
        Ok(())
    })
    .unwrap();
}
