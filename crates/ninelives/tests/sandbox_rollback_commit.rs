//! Output commit for `rollback` sandboxes (issue 19): a kv service rolled
//! back again and again while `kvload` writes and reads never loses a write
//! it acknowledged, because no reply leaves before the state that produced
//! it can no longer be rolled back (nl_checkpoint::output_commit).
//!
//! The test runs in a network namespace of its own with TAP nltap0 at
//! 10.0.0.1/24; the service is 10.0.0.2 (kv on TCP 7000, UDP echo on 7).
//! Every wait and loop is bounded in count and time; nothing asserts on
//! timing.

use crate::common;

use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use common::{kvm_available, two_cores, wait_or, Netns, LOADED};
use nl_checkpoint::inject::GuestFault;
use nl_lab::kvload::{self, LoadConfig};

/// An unmapped RIP: the next instruction faults (#PF) in guest ring 3.
const BAD_RIP: GuestFault = GuestFault::Register { cpu: 0, reg: "rip", bit: 40 };

const FAULTS: u64 = 6;

/// The kv sandbox, with output commit or without, and with `release`
/// (`recovery.release`) if given.
fn config(output_commit: bool, release: Option<&str>) -> String {
    let [c0, _] = two_cores();
    let release = release.map_or(String::new(), |r| format!(r#", "release": "{r}""#));
    format!(
        r#"{{"sandboxes": [
            {{"name": "kv", "cores": [{c0}], "workload": {{"kind": "kv", "duration_ms": 0}},
              "net": {{"tap": "nltap0", "mac": "52:54:00:5a:00:02", "ipv4": "10.0.0.2/24"}},
              "detect": {{"heartbeat_cpu_ms": 100}},
              "recovery": {{"policy": "rollback", "max_recoveries": 100, "window_ms": 1000,
                           "checkpoint_interval_ms": 20, "output_commit": {output_commit}{release}}}}}
        ]}}"#
    )
}

/// Whether the service answers a UDP echo within `within` (bounded tries;
/// held replies arrive late, so each try waits 200 ms).
fn echo_answers(within: Duration) -> bool {
    let to: SocketAddr = "10.0.0.2:7".parse().unwrap();
    let Ok(s) = UdpSocket::bind("10.0.0.1:0") else { return false };
    if s.set_read_timeout(Some(Duration::from_millis(200))).is_err() {
        return false;
    }
    let t = Instant::now();
    let mut buf = [0u8; 64];
    for i in 0..10_000u32 {
        if t.elapsed() > within {
            break;
        }
        let _ = s.send_to(format!("probe {i}").as_bytes(), to);
        if s.recv_from(&mut buf).is_ok() {
            return true;
        }
    }
    false
}

/// Runs kvload against the service while `FAULTS` faults are injected one
/// after another, each once the previous rollback is done and the service
/// answers again; returns kvload's report and the rollbacks done.
fn faults_under_load(
    output_commit: bool,
    release: Option<&str>,
    tag: &str,
) -> Option<(kvload::KvReport, u64, String)> {
    let ns = Netns::new(tag)?;
    let mut out = None;
    let report = ns.supervised_set(&config(output_commit, release), |s| {
        let kv = s.get("kv").unwrap();
        assert!(echo_answers(Duration::from_secs(90) * LOADED), "the service never answered");
        let load = LoadConfig {
            duration: Duration::from_secs(25),
            connections: 4,
            keys: 200,
            put_pct: 50,
            seed: 7,
            // Keys are at most 24 bytes (nl_workloads::kv::MAX_KEY).
            prefix: format!("commit{output_commit}{}-", if release.is_some() { "n" } else { "" }),
            verify_stall: Duration::from_secs(20),
            timeline: false,
        };
        let at: SocketAddr = "10.0.0.2:7000".parse().unwrap();
        let (r, injected_by) = std::thread::scope(|scope| {
            let loader = scope.spawn(|| {
                // Replies wait about L of guest time plus an interval; a
                // request given up on (and its connection dropped) may still
                // be applied later, after newer acknowledged writes, which
                // the checker would call lost: no request is given up early.
                kvload::load(&load, &|| kvload::tcp_link(at, Duration::from_secs(20)))
            });
            let began = Instant::now();
            let state =
                || format!("rollbacks {}, since load {:?}", kv.rollbacks(), began.elapsed());
            std::thread::sleep(Duration::from_secs(1));
            for i in 0..FAULTS {
                // Acknowledged writes accumulate after the last rollback,
                // and the guest re-runs what it undid: a fault before that
                // counts as the same error back (its rollback goes further,
                // past released output: counted, and a lost write).
                std::thread::sleep(Duration::from_millis(300));
                wait_or(
                    "the last rollback settled",
                    Duration::from_secs(60),
                    || kv.rollback_settled(),
                    state,
                );
                s.inject("kv", &BAD_RIP).expect("inject");
                wait_or("the rollback", Duration::from_secs(30), || kv.rollbacks() > i, state);
                assert!(echo_answers(Duration::from_secs(30) * LOADED), "no answer after {i}");
            }
            let injected_by = began.elapsed();
            (loader.join().expect("kvload"), injected_by)
        });
        // Every fault fell inside the load (else the check proves less).
        assert!(injected_by < load.duration, "faults took {injected_by:?}, past the load");
        out = Some((r, kv.rollbacks()));
    });
    let sb = &report.sandboxes[0];
    let (r, rollbacks) = out.expect("the test body ran");
    eprintln!("output commit: {:?}", sb.output_commit);
    if output_commit {
        let oc = sb.output_commit.as_ref().expect("output commit statistics");
        assert!(oc.frames_released > 0 && oc.batches > 0, "{oc:?}");
        assert_eq!(oc.rollbacks_past_released_output, 0, "{oc:?}");
    }
    Some((r, rollbacks, format!("{:?}", sb.recoveries)))
}

#[test]
fn kv_under_rollback_with_output_commit_loses_no_acknowledged_write() {
    no_acknowledged_write_lost(None, "rbcommit");
}

/// `recovery.release: "next_checkpoint"`: replies leave when the
/// checkpoint after theirs is taken, and a first rollback goes back one
/// checkpoint, so faults found within an interval (an unmapped RIP, found
/// at the guest's next instruction, at the latest after its next timer
/// tick) undo nothing that left.
#[test]
fn kv_under_rollback_releasing_at_the_next_checkpoint_loses_no_acknowledged_write() {
    no_acknowledged_write_lost(Some("next_checkpoint"), "rbcommitck");
}

fn no_acknowledged_write_lost(release: Option<&str>, tag: &str) {
    let _one_at_a_time = common::pace_sensitive();
    if !kvm_available() {
        return;
    }
    let Some((r, rollbacks, recoveries)) = faults_under_load(true, release, tag) else { return };
    eprintln!(
        "{rollbacks} rollbacks, {} ops ({} puts), lost {} + {} read back, unverified {}, \
         digest {:?}, errors {}, examples {:?}",
        r.ops,
        r.puts,
        r.mismatches,
        r.readback_mismatches,
        r.unverified,
        r.digest_ok,
        r.errors,
        r.examples
    );
    assert!(rollbacks >= FAULTS, "{rollbacks} rollbacks: {recoveries}");
    assert!(r.puts > 20, "too few writes to prove anything: {r:?}");
    assert_eq!(r.mismatches + r.readback_mismatches, 0, "acknowledged writes lost: {r:?}");
    assert_eq!(r.unverified, 0, "not every key read back: {r:?}");
    assert_eq!(r.digest_ok, Some(true), "{r:?}");
}
