//! Sandbox fault recovery (Quest-V): per-sandbox detection and the local
//! recovery policies, with healthy sandboxes running on untouched.
//!
//! Every wait is bounded in count and time; nothing asserts on timing.

use crate::common;

use std::time::Duration;

use common::{kvm_available, sandbox_set, thread_policy, two_cores, wait_for, LOADED};
use nl_checkpoint::inject::GuestFault;
use nl_sandbox::detect::Detector;
use nl_sandbox::{SandboxSet, SetReport};
use nl_vmm::VmOutcome;

/// Words both ends of channel `c` have consumed of each other's stream.
fn consumed(s: &SandboxSet, c: usize) -> u64 {
    let st = s.channel_stats();
    st[c].regions[0].ack_words + st[c].regions[1].ack_words
}

/// Runs `body` while the set is supervised; then stops the set and
/// returns its report.
fn supervised(s: &SandboxSet, limit: Duration, body: impl FnOnce(&SandboxSet)) -> SetReport {
    s.start_all().expect("start");
    supervised_started(s, limit, body)
}

/// [`supervised`] for a set already started.
fn supervised_started(
    s: &SandboxSet,
    limit: Duration,
    body: impl FnOnce(&SandboxSet),
) -> SetReport {
    let limit = limit * LOADED;
    std::thread::scope(|scope| {
        let h = scope.spawn(|| s.supervise(limit));
        // A failed check still stops the set, so the test ends at once.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(s)));
        s.request_stop();
        let report = h.join().expect("supervision");
        if let Err(p) = r {
            std::panic::resume_unwind(p);
        }
        report
    })
}

/// This process's threads named `name`.
fn threads_named(name: &str) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else { return Vec::new() };
    dir.filter_map(|e| {
        let tid: i32 = e.ok()?.file_name().to_str()?.parse().ok()?;
        let comm = std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).ok()?;
        (comm.trim_end() == name).then_some(tid)
    })
    .collect()
}

/// An unmapped RIP: the next instruction faults (#PF) in guest ring 3.
const BAD_RIP: GuestFault = GuestFault::Register { cpu: 0, reg: "rip", bit: 40 };

fn three(svc_extra: &str) -> String {
    three_at(svc_extra, 1000)
}

/// svc, p, q; p sends every `p_every_us`.
fn three_at(svc_extra: &str, p_every_us: u64) -> String {
    let [c0, c1] = two_cores();
    format!(
        r#"{{"sandboxes": [
            {{"name": "svc", "cores": [{c0}], "mem_mib": 48, {svc_extra}
              "workload": {{"kind": "chanstream", "duration_ms": 0, "send_every_us": 1000}}}},
            {{"name": "p", "cores": [{c1}], "mem_mib": 48, "workload": {{"kind": "chanstream", "duration_ms": 0, "send_every_us": {p_every_us}}}}},
            {{"name": "q", "cores": [{c0}], "mem_mib": 48, "workload": {{"kind": "chanstream", "duration_ms": 0, "send_every_us": 1000}}}}
        ], "channels": [{{"name": "sp", "between": ["svc", "p"]}}, {{"name": "pq", "between": ["p", "q"]}}]}}"#
    )
}

/// The healthy sandboxes lost, corrupted or rejected nothing and kept
/// going (`names` ending in '?' have a peer that may never send).
fn healthy(r: &SetReport, names: &[&str]) {
    for n in names {
        let quiet_peer = n.ends_with('?');
        let n = &n.trim_end_matches('?');
        let sb = r.sandboxes.iter().find(|s| s.name == *n).expect("sandbox");
        assert_eq!(sb.outcome, VmOutcome::Stopped, "{n}: {}", sb.message);
        assert!(quiet_peer || sb.ops > 0, "{n} received nothing");
        assert_eq!(
            sb.digest, 0,
            "{n}: messages corrupt, lost, duplicated or rejected\n{}",
            sb.console
        );
        assert!(sb.detections.is_empty(), "{n}: {:?}", sb.detections);
        assert!(sb.recoveries.is_empty(), "{n}");
    }
}

#[test]
fn restart_recovers_a_faulted_sandbox_while_its_peers_run_on_untouched() {
    if !kvm_available() {
        return;
    }
    // p sends fast, so its stream to svc wraps the ring before the fault:
    // the restarted svc must resume at its acknowledgement, not re-read
    // overwritten records.
    let s = sandbox_set(&three_at(r#""recovery": {"policy": "restart"},"#, 50));
    let r = supervised(&s, Duration::from_secs(120), |s| {
        let svc = s.get("svc").expect("svc");
        wait_for("p's stream to svc wrapping its ring", Duration::from_secs(90), || {
            consumed(s, 0) > 1000
                && consumed(s, 1) > 1000
                && s.channel_stats()[0].regions[1].head_words > nl_abi::CHANNEL_REGION_BYTES / 8
        });
        let tids = |n: &str| {
            s.get(n)
                .expect("sb")
                .vm()
                .vcpu_threads()
                .iter()
                .map(|t| t.map(|t| t.tid))
                .collect::<Vec<_>>()
        };
        let (p_tids, q_tids) = (tids("p"), tids("q"));
        s.inject("svc", &BAD_RIP).expect("inject");
        wait_for("the detection", Duration::from_secs(30), || !svc.monitor.detections().is_empty());
        let at_detection = consumed(s, 1);
        let mut progressed = false;
        wait_for("the recovery", Duration::from_secs(60), || {
            progressed |= consumed(s, 1) > at_detection;
            assert!(!s.get("p").expect("p").vm().is_paused());
            assert!(!s.get("q").expect("q").vm().is_paused());
            svc.monitor.recovery_count() == 1
        });
        // A restart with its VM built ahead takes milliseconds, less than
        // the pair may need for its next drain: its progress may come
        // just after (bounded); that it was never paused is checked above.
        wait_for("the healthy pair progressing", Duration::from_secs(30), || {
            progressed || consumed(s, 1) > at_detection
        });
        assert_eq!(
            (tids("p"), tids("q")),
            (p_tids, q_tids),
            "the peers' vCPU threads are the same"
        );
        // The restarted sandbox serves again on its channel.
        let before = consumed(s, 0);
        wait_for("svc streaming again", Duration::from_secs(30), || consumed(s, 0) > before + 500);
    });
    healthy(&r, &["p", "q"]);
    let svc = &r.sandboxes[0];
    assert_eq!(svc.detections.len(), 1, "{:?}", svc.detections);
    let d = &svc.detections[0];
    assert_eq!(d.sandbox, "svc");
    assert_eq!(d.detector, Detector::GuestException, "{}", d.detail);
    let rec = &svc.recoveries[0];
    assert!(rec.ok && rec.policy == "restart", "{rec:?}");
    let ph = &rec.phases;
    assert!(ph.stopped_ms.is_some() && ph.image_ms.is_some() && ph.reentry_ms.is_some());
    assert!(ph.guest_init_ms.is_some() && ph.first_reply_ms.is_some(), "{ph:?}");
    // The new incarnation rejoined p's stream: nothing rejected or lost.
    assert_eq!(svc.digest, 0, "{}", svc.console);
    // (Its service resumed: "svc streaming again" above. Its op count is
    // published by the guest later and may still be 0 when the set stops.)
    assert!(svc.gave_up.is_none());
}

#[test]
fn replace_restarts_a_violating_sandbox_with_its_alternative_workload() {
    if !kvm_available() {
        return;
    }
    let [c0, c1] = two_cores();
    let s = sandbox_set(&format!(
        r#"{{"sandboxes": [
            {{"name": "a", "cores": [{c0}], "mem_mib": 48, "workload": {{"kind": "wildwrite", "seed": 3}},
              "recovery": {{"policy": "replace", "replace_with": {{"kind": "chanstream", "duration_ms": 0}}}}}},
            {{"name": "b", "cores": [{c1}], "mem_mib": 48, "workload": {{"kind": "chanstream", "duration_ms": 0}}}}
        ], "channels": [{{"name": "ab", "between": ["a", "b"]}}]}}"#
    ));
    let r = supervised(&s, Duration::from_secs(120), |s| {
        let a = s.get("a").expect("a");
        wait_for("the replacement", Duration::from_secs(60), || a.monitor.recovery_count() == 1);
        let before = consumed(s, 0);
        wait_for("a streaming", Duration::from_secs(30), || consumed(s, 0) > before + 500);
    });
    let a = &r.sandboxes[0];
    assert_eq!(a.detections.len(), 1, "{:?}", a.detections);
    assert_eq!(a.detections[0].detector, Detector::ChannelViolation);
    assert_eq!(a.recoveries[0].policy, "replace");
    assert_eq!(a.violations, 1, "stopped at its first stray write");
    assert!(a.console.contains("chanstream") || a.ops > 0, "a runs chanstream now");
    assert_eq!(a.digest, 0);
    assert!(a.ops > 0);
    healthy(&r, &["b"]);
}

#[test]
fn a_fault_that_recurs_beyond_its_bound_ends_in_a_report_not_a_loop() {
    if !kvm_available() {
        return;
    }
    let [c0, c1] = two_cores();
    let s = sandbox_set(&format!(
        r#"{{"sandboxes": [
            {{"name": "a", "cores": [{c0}], "mem_mib": 48, "workload": {{"kind": "wildwrite", "seed": 5}},
              "recovery": {{"policy": "restart", "max_recoveries": 3, "window_ms": 600000}}}},
            {{"name": "b", "cores": [{c1}], "mem_mib": 48, "workload": {{"kind": "chanstream", "duration_ms": 0}}}}
        ], "channels": [{{"name": "ab", "between": ["a", "b"]}}]}}"#
    ));
    let r = supervised(&s, Duration::from_secs(120), |s| {
        let a = s.get("a").expect("a");
        wait_for("a to give up", Duration::from_secs(90), || a.monitor.gave_up_reason().is_some());
    });
    let a = &r.sandboxes[0];
    assert_eq!(a.recoveries.len(), 3, "{:?}", a.recoveries);
    assert_eq!(a.detections.len(), 4);
    assert!(a.detections.iter().all(|d| d.detector == Detector::ChannelViolation));
    let why = a.gave_up.as_deref().expect("gave up");
    assert!(why.contains("gave up") && why.contains("max_recoveries"), "{why}");
    assert!(a.stopped_for_violation, "{}", a.message);
    healthy(&r, &["b?"]);
}

#[test]
fn lost_heartbeat_is_judged_on_vcpu_time_not_wall_time() {
    if !kvm_available() {
        return;
    }
    let s = sandbox_set(&three(
        r#""recovery": {"policy": "restart"}, "detect": {"heartbeat_cpu_ms": 300},"#,
    ));
    let r = supervised(&s, Duration::from_secs(120), |s| {
        wait_for("streaming", Duration::from_secs(60), || consumed(s, 1) > 500);
        // q paused for far longer than the heartbeat bound in wall time:
        // its vCPU does not run, so it is not hung.
        let q = s.get("q").expect("q");
        q.vm().pause();
        std::thread::sleep(Duration::from_millis(1500));
        q.vm().resume();
        // svc spins in place: its vCPU runs but never beats.
        s.inject("svc", &GuestFault::Spin { cpu: 0 }).expect("inject");
        let svc = s.get("svc").expect("svc");
        wait_for("the restart", Duration::from_secs(60), || svc.monitor.recovery_count() == 1);
    });
    let svc = &r.sandboxes[0];
    assert_eq!(svc.detections[0].detector, Detector::LostHeartbeat, "{:?}", svc.detections);
    healthy(&r, &["p", "q"]);
}

#[test]
fn a_receiver_that_stops_consuming_is_caught_by_the_channel_lag_detector() {
    if !kvm_available() {
        return;
    }
    let [c0, c1] = two_cores();
    let s = sandbox_set(&format!(
        r#"{{"sandboxes": [
            {{"name": "slow", "cores": [{c0}], "mem_mib": 48,
              "workload": {{"kind": "memwrite", "ws_mib": 4, "duration_ms": 600000}},
              "detect": {{"channel_lag_words": 2000, "channel_lag_cpu_ms": 100}}}},
            {{"name": "fast", "cores": [{c1}], "mem_mib": 48, "workload": {{"kind": "chanstream", "duration_ms": 0, "send_every_us": 100}}}}
        ], "channels": [{{"name": "sf", "between": ["slow", "fast"]}}]}}"#
    ));
    let r = supervised(&s, Duration::from_secs(120), |s| {
        let slow = s.get("slow").expect("slow");
        wait_for("the lag detection", Duration::from_secs(60), || {
            !slow.monitor.detections().is_empty()
        });
        // The policy is stop: the sandbox ends.
        wait_for("slow stopped", Duration::from_secs(30), || slow.vm().poll_outcome().is_some());
    });
    let slow = &r.sandboxes[0];
    let d = &slow.detections[0];
    assert_eq!((d.sandbox.as_str(), d.detector), ("slow", Detector::ChannelLag), "{}", d.detail);
    assert!(d.detail.contains("channel 'sf'"), "{}", d.detail);
    assert!(slow.recoveries.is_empty());
    assert!(
        matches!(&slow.outcome, VmOutcome::Crashed { message, .. } if message.contains("channel-lag"))
    );
    healthy(&r, &["fast?"]);
}

#[test]
fn rollback_recovers_in_place_and_the_sandbox_keeps_its_state() {
    if !kvm_available() {
        return;
    }
    let [c0, c1] = two_cores();
    let s = sandbox_set(&format!(
        r#"{{"sandboxes": [
            {{"name": "rb", "cores": [{c0}], "mem_mib": 48,
              "workload": {{"kind": "memwrite", "ws_mib": 2, "duration_ms": 2000}},
              "recovery": {{"policy": "rollback", "checkpoint_interval_ms": 100}}}},
            {{"name": "p", "cores": [{c1}], "mem_mib": 48, "workload": {{"kind": "chanstream", "duration_ms": 0}}}},
            {{"name": "q", "cores": [{c0}], "mem_mib": 48, "workload": {{"kind": "chanstream", "duration_ms": 0}}}}
        ], "channels": [{{"name": "pq", "between": ["p", "q"]}}]}}"#
    ));
    s.get("rb").expect("rb").set_script(vec![(Duration::from_millis(1000), BAD_RIP)]);
    let r = supervised(&s, Duration::from_secs(120), |s| {
        let m = s.get("rb").expect("rb");
        // Its supervisor runs as a real-time thread (so that its wake-ups
        // do not wait behind the vCPU thread on its core): seen real-time
        // in some of 300 samples 1 ms apart.
        let (mut fifo, mut other) = (0, 0);
        for _ in 0..300 {
            for p in threads_named("monitor-rb").into_iter().filter_map(thread_policy) {
                match p {
                    p if p == libc::SCHED_FIFO as u64 => fifo += 1,
                    _ => other += 1,
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        eprintln!("its supervisor was real-time in {fifo} and ordinary in {other} samples");
        assert!(fifo > 0, "its supervisor never ran as a real-time thread (needs CAP_SYS_NICE)");
        // Its detections are reported when its supervised run ends.
        wait_for("rb to complete", Duration::from_secs(100), || m.monitor.recovery_count() == 1);
    });
    let m = &r.sandboxes[0];
    assert_eq!(m.outcome, VmOutcome::Completed, "{}\n{}", m.message, m.console);
    assert!(m.verified, "state kept across the rollback: {:?}", m.problem);
    assert_eq!(m.recoveries.len(), 1, "{:?}", m.recoveries);
    assert_eq!(m.recoveries[0].policy, "rollback");
    assert_eq!(m.detections[0].sandbox, "rb");
    healthy(&r, &["p", "q"]);
}

#[test]
fn a_failed_restart_leaves_the_sandbox_stopped_and_reported() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let ram = dir.path().join("svc-ram");
    let s = sandbox_set(&three(&format!(
        r#""recovery": {{"policy": "restart"}}, "memory_file": "{}","#,
        ram.display()
    )));
    let r = supervised(&s, Duration::from_secs(120), |s| {
        wait_for("streaming", Duration::from_secs(60), || consumed(s, 1) > 500);
        // Someone replaced the audited memory file: the restart must refuse it.
        std::fs::remove_file(&ram).expect("remove");
        s.inject("svc", &BAD_RIP).expect("inject");
        let svc = s.get("svc").expect("svc");
        wait_for("the failed recovery", Duration::from_secs(60), || {
            !svc.monitor.recoveries().is_empty()
        });
        let before = consumed(s, 1);
        wait_for("the peers running on", Duration::from_secs(30), || consumed(s, 1) > before + 200);
    });
    let svc = &r.sandboxes[0];
    let rec = &svc.recoveries[0];
    assert!(!rec.ok, "{rec:?}");
    assert!(
        rec.error.as_deref().unwrap_or("").contains("no longer the file the audit checked"),
        "{rec:?}"
    );
    assert!(matches!(svc.outcome, VmOutcome::GuestError { .. }), "{}", svc.message);
    assert!(s.get("svc").expect("svc").vm().poll_outcome().is_some(), "stopped, not half-restored");
    healthy(&r, &["p", "q"]);
}

/// A `restart` starts the VM its monitor built ahead of the fault (VM
/// creation waits for kernel grace periods, seconds on a loaded host:
/// `nl_sandbox::prepare`), and the monitor builds the next one for the
/// restart after. Twice, so the second restart shows the rebuilt one.
#[test]
fn a_restart_starts_the_vm_built_ahead_and_the_next_one_is_built() {
    if !kvm_available() {
        return;
    }
    let s = sandbox_set(&three(r#""recovery": {"policy": "restart"},"#));
    let r = supervised(&s, Duration::from_secs(240), |s| {
        let svc = s.get("svc").expect("svc");
        for round in 1..=2 {
            wait_for("svc streaming", Duration::from_secs(90), || consumed(s, 0) > 500);
            wait_for("a VM built ahead", Duration::from_secs(120), || svc.monitor.next_vm_ready());
            s.inject("svc", &BAD_RIP).expect("inject");
            wait_for("the recovery", Duration::from_secs(60), || {
                svc.monitor.recovery_count() == round
            });
            let before = consumed(s, 0);
            wait_for("svc streaming again", Duration::from_secs(30), || {
                consumed(s, 0) > before + 100
            });
        }
    });
    healthy(&r, &["p", "q"]);
    let svc = &r.sandboxes[0];
    assert_eq!(svc.recoveries.len(), 2, "{:?}", svc.recoveries);
    for rec in &svc.recoveries {
        assert!(rec.ok, "{rec:?}");
        assert!(rec.phases.image_prepared, "the restart built its own VM: {rec:?}");
    }
}

/// The first restart VM is built before the set's vCPUs start (when a
/// build is quick), so a fault in the first moments of a run finds one too.
#[test]
fn the_first_restart_vm_is_built_before_the_set_runs() {
    if !kvm_available() {
        return;
    }
    let s = sandbox_set(&three(r#""recovery": {"policy": "restart"},"#));
    s.start_all().expect("start");
    // Before supervision (and so before any builder thread) started.
    assert!(s.get("svc").expect("svc").monitor.next_vm_ready(), "svc (restart) has no VM built");
    assert!(!s.get("p").expect("p").monitor.next_vm_ready(), "p (stop) got a restart VM");
    let r = supervised_started(&s, Duration::from_secs(120), |s| {
        let svc = s.get("svc").expect("svc");
        // At once: no wait for the builder thread.
        s.inject("svc", &BAD_RIP).expect("inject");
        wait_for("the recovery", Duration::from_secs(60), || svc.monitor.recovery_count() == 1);
    });
    let svc = &r.sandboxes[0];
    assert_eq!(svc.recoveries.len(), 1, "{:?}", svc.recoveries);
    assert!(svc.recoveries[0].phases.image_prepared, "{:?}", svc.recoveries[0]);
}

/// The output-stall detector finds a sandbox that heartbeats but no longer
/// sends (here svc sends once, then waits 60 s for its next message), and
/// leaves one that keeps sending (p, every 1 ms, the same bound) alone.
#[test]
fn a_sandbox_that_heartbeats_but_stops_sending_is_detected_by_output_stall() {
    if !kvm_available() {
        return;
    }
    let [c0, c1] = two_cores();
    let stall = r#""detect": {"output_stall_cpu_ms": 100}"#;
    let text = format!(
        r#"{{"sandboxes": [
            {{"name": "svc", "cores": [{c0}], "mem_mib": 48, {stall},
              "workload": {{"kind": "chanstream", "duration_ms": 0, "send_every_us": 60000000}}}},
            {{"name": "p", "cores": [{c1}], "mem_mib": 48, {stall},
              "workload": {{"kind": "chanstream", "duration_ms": 0, "send_every_us": 1000}}}}
        ], "channels": [{{"name": "sp", "between": ["svc", "p"]}}]}}"#
    );
    let s = sandbox_set(&text);
    let r = supervised(&s, Duration::from_secs(120), |s| {
        let svc = s.get("svc").expect("svc");
        wait_for("svc's output stall found", Duration::from_secs(60), || {
            !svc.monitor.detections().is_empty()
        });
    });
    let svc = &r.sandboxes[0];
    assert_eq!(svc.detections[0].detector, Detector::OutputStall, "{:?}", svc.detections);
    assert!(svc.detections[0].detail.contains("no record sent"), "{:?}", svc.detections);
    let p = &r.sandboxes[1];
    assert!(p.detections.is_empty(), "p kept sending: {:?}", p.detections);
}

/// Writes into `svc`'s output region (region 0 of channel 0) one more
/// record with a valid frame (its CRC, the next sequence number) carrying a
/// message its sender would never send (another sender's bytes): what a
/// writer with a corrupt message buffer publishes. svc is paused meanwhile,
/// and the host's check reads the record before svc runs again.
fn forge_a_wrong_message(s: &SandboxSet) {
    use nl_workloads::channel::{record_crc, HEADER_WORDS};
    use nl_workloads::chanstream::{message, MSG_BYTES};
    let vm = s.get("svc").expect("svc").vm();
    vm.pause();
    let ch = &s.channels[0];
    // Up to date with svc's stream first (nothing wrong in it yet).
    assert_eq!(ch.check_region(0).first, None, "svc's own records were wrong");
    let head = ch.header(0).head_words;
    let n = nl_abi::CHANNEL_REGION_BYTES / 8 - HEADER_WORDS as u64;
    let words = 2 + (MSG_BYTES / 8) as u64;
    let ring = ch.read_region(0);
    let word = |w: u64| {
        let at = (HEADER_WORDS as u64 + w % n) as usize * 8;
        u64::from_le_bytes(ring[at..at + 8].try_into().expect("8 bytes"))
    };
    // The last record before the head (chanstream's are all one size).
    let seq = word(head - words + 1) + 1;
    let payload = message(99, seq);
    let mut rec = Vec::new();
    rec.extend_from_slice(
        &(MSG_BYTES as u64 | u64::from(record_crc(64, seq, &payload)) << 32).to_le_bytes(),
    );
    rec.extend_from_slice(&seq.to_le_bytes());
    rec.extend_from_slice(&payload);
    assert!(head % n + words <= n, "the forged record would wrap");
    ch.scribble(0, (head % n) * 8, &rec);
    ch.set_head(0, head + words);
    // The host's check reads it now, while svc is still paused: resumed
    // in the middle of a send, svc would finish its own record over the
    // forged one before a monitor's next look (seen once in CI). svc's
    // monitor takes the finding once svc runs.
    let found = ch.check_region(0).first.expect("the host's check found the forged record");
    assert_eq!(found.seq, seq, "{found:?}");
    vm.resume();
}

/// The channel check blames the writer of a wrong message (svc, although
/// p is the one that received it) and the reporter of a false complaint
/// (svc again, whose own report says p's intact stream was corrupt), and
/// never p.
#[test]
fn the_channel_check_blames_a_wrong_messages_writer_and_a_false_reports_reporter() {
    if !kvm_available() {
        return;
    }
    let [c0, c1] = two_cores();
    let text = format!(
        r#"{{"sandboxes": [
            {{"name": "svc", "cores": [{c0}], "mem_mib": 48, "recovery": {{"policy": "restart"}},
              "workload": {{"kind": "chanstream", "duration_ms": 0, "send_every_us": 1000}}}},
            {{"name": "p", "cores": [{c1}], "mem_mib": 48,
              "workload": {{"kind": "chanstream", "duration_ms": 0, "send_every_us": 1000}}}}
        ], "channels": [{{"name": "sp", "between": ["svc", "p"]}}]}}"#
    );
    let s = sandbox_set(&text);
    let r = supervised(&s, Duration::from_secs(180), |s| {
        let svc = s.get("svc").expect("svc");
        wait_for("both streaming", Duration::from_secs(60), || consumed(s, 0) > 2000);
        forge_a_wrong_message(s);
        wait_for("svc's bad message found", Duration::from_secs(30), || {
            !svc.monitor.detections().is_empty()
        });
        wait_for("svc restarted", Duration::from_secs(60), || svc.monitor.recovery_count() == 1);
        let before = consumed(s, 0);
        wait_for("svc streaming again", Duration::from_secs(60), || consumed(s, 0) > before + 500);
        // svc's receive report turns false: corrupt messages that p's
        // stream, as the host reads it, does not hold. (svc's guest
        // rewrites the word at each drain: keep writing, bounded.)
        let mut k = 1;
        wait_for("svc's false report found", Duration::from_secs(30), || {
            let c = nl_workloads::chanstream::Counters { corrupt: k, ..Default::default() };
            s.channels[0].set_verdict(0, nl_workloads::chanstream::pack(&c));
            k += 1;
            svc.monitor.detections().len() >= 2
        });
    });
    let svc = &r.sandboxes[0];
    let d: Vec<_> = svc.detections.iter().map(|d| (d.detector, d.detail.as_str())).collect();
    assert!(d.len() >= 2, "{d:?}");
    assert_eq!(d[0].0, Detector::ChannelCheck, "{d:?}");
    assert!(d[0].1.contains("not what its sender must send"), "{d:?}");
    assert_eq!(d[1].0, Detector::ChannelCheck, "{d:?}");
    assert!(d[1].1.contains("its own receive state is wrong"), "{d:?}");
    let p = &r.sandboxes[1];
    assert!(
        p.detections.is_empty(),
        "p received the wrong message but wrote nothing wrong: {:?}",
        p.detections
    );
}

/// Under `rollback` the sandbox's channel detectors run too (beside the
/// checkpoint supervisor's outcome and heartbeat): svc's receive report
/// turning false (corrupt messages that p's stream, as the host reads it,
/// does not hold) is found by the channel check and rolled back, not left
/// to end as a wrong result; svc then streams on, and p sees nothing.
#[test]
fn under_rollback_the_channel_check_finds_a_false_report_and_rolls_it_back() {
    if !kvm_available() {
        return;
    }
    let s = sandbox_set(&three_at(
        r#""recovery": {"policy": "rollback", "checkpoint_interval_ms": 20,
                        "release": "next_checkpoint", "max_recoveries": 20, "window_ms": 1000},"#,
        1000,
    ));
    let r = supervised(&s, Duration::from_secs(180), |s| {
        let svc = s.get("svc").expect("svc");
        wait_for("both streaming", Duration::from_secs(60), || consumed(s, 0) > 2000);
        assert!(!svc.monitor.ended(), "svc's monitor ended while it streams");
        // svc's guest rewrites the word at each drain: keep writing,
        // bounded, until a rollback.
        let mut k = 1;
        wait_for("svc's false report rolled back", Duration::from_secs(30), || {
            let c = nl_workloads::chanstream::Counters { corrupt: k, ..Default::default() };
            s.channels[0].set_verdict(0, nl_workloads::chanstream::pack(&c));
            k += 1;
            svc.rollbacks() >= 1
        });
        let before = consumed(s, 0);
        wait_for("svc streaming again", Duration::from_secs(60), || consumed(s, 0) > before + 500);
    });
    let svc = &r.sandboxes[0];
    let d: Vec<_> = svc.detections.iter().map(|d| (d.detector, d.detail.as_str())).collect();
    assert!(!d.is_empty(), "{d:?}");
    assert_eq!(d[0].0, Detector::ChannelCheck, "{d:?}");
    assert!(d[0].1.contains("its own receive state is wrong"), "{d:?}");
    assert!(svc.recoveries.iter().all(|r| r.policy == "rollback" && r.ok), "{:?}", svc.recoveries);
    healthy(&r, &["p", "q"]);
    // Its outcome is final once its monitor says so (what the campaign
    // waits for before it reads a completion).
    assert!(s.get("svc").expect("svc").monitor.ended(), "svc's monitor never ended");
}

/// Issue 19: a `chanstream` sandbox under `rollback` with output commit
/// (released at the next checkpoint) is rolled back again and again. What
/// it publishes and acknowledges on its channel is held until no rollback
/// can undo it (`nl_workloads::channel`, "Held output"), so its peer never
/// reads a record a rollback undid nor sees the stream go back: p counts
/// nothing corrupt, lost, duplicated or rejected in svc's stream, svc
/// nothing in p's (which p sends fast, wrapping the ring), and the stream
/// goes on after every rollback.
#[test]
fn rollback_holds_channel_output_so_the_peer_never_sees_it_undone() {
    if !kvm_available() {
        return;
    }
    const FAULTS: u64 = 4;
    let s = sandbox_set(&three_at(
        r#""detect": {"heartbeat_cpu_ms": 200},
           "recovery": {"policy": "rollback", "checkpoint_interval_ms": 10,
                        "release": "next_checkpoint", "max_recoveries": 100, "window_ms": 1000},"#,
        50,
    ));
    // How far p consumed svc's stream (channel sp, p's region: its ack).
    let at_p = |s: &SandboxSet| s.channel_stats()[0].regions[1].ack_words;
    let r = supervised(&s, Duration::from_secs(240), |s| {
        let svc = s.get("svc").expect("svc");
        let state = || format!("rollbacks {}, p at word {}", svc.rollbacks(), at_p(s));
        common::wait_or(
            "svc's stream reaching p",
            Duration::from_secs(60),
            || at_p(s) > 1000 && consumed(s, 1) > 1000,
            state,
        );
        for i in 0..FAULTS {
            // A fault before the guest re-ran what the last rollback undid
            // would be taken for the same error back, and go back past
            // released output (counted, and seen by p): not this test.
            common::wait_or(
                "the last rollback settled",
                Duration::from_secs(60),
                || svc.rollback_settled(),
                state,
            );
            s.inject("svc", &BAD_RIP).expect("inject");
            common::wait_or("the rollback", Duration::from_secs(30), || svc.rollbacks() > i, state);
            let before = at_p(s);
            common::wait_or(
                "svc's stream going on after the rollback",
                Duration::from_secs(30),
                || at_p(s) > before + 500,
                state,
            );
        }
    });
    let svc = &r.sandboxes[0];
    assert_eq!(svc.outcome, VmOutcome::Stopped, "{}\n{}", svc.message, svc.console);
    assert!(svc.recoveries.len() as u64 >= FAULTS, "{:?}", svc.recoveries);
    assert!(svc.recoveries.iter().all(|rc| rc.policy == "rollback" && rc.ok));
    let oc = svc.output_commit.as_ref().expect("output commit stats");
    assert_eq!(oc.rollbacks_past_released_output, 0, "{oc:?}");
    // p's and q's own reports (corrupt + lost + duplicated + rejected
    // over all their channels) and no detection.
    healthy(&r, &["p", "q"]);
    let sp = &r.channels[0];
    assert!(sp.regions[1].received > 0);
    assert_eq!(sp.regions[1].errors(), 0, "p on svc's stream: {:?}", sp.regions[1]);
    assert_eq!(sp.regions[0].errors(), 0, "svc on p's stream: {:?}", sp.regions[0]);
}

/// Writes its workload's end over svc's ring-3 code (`GuestFault::Exit`),
/// again while its vCPU is in the kernel (refused), until it is applied
/// (bounded). Under `rollback` the supervisor applies it at its next step
/// and itself waits for ring 3.
fn end_svc(s: &SandboxSet) {
    wait_for("svc's end written", Duration::from_secs(30), || {
        match s.inject("svc", &GuestFault::Exit { cpu: 0 }) {
            Ok(_) => true,
            Err(e) => {
                assert!(e.to_string().contains("try again"), "{e}");
                std::thread::sleep(Duration::from_millis(1));
                false
            }
        }
    });
}

/// Issue 19: a service (a workload without end) that completes has failed:
/// a control-flow error that returns it into its exit must not end it as
/// done. Under `restart` its monitor detects the completion as a guest
/// error and restarts it, and it streams again.
#[test]
fn under_restart_a_service_that_completes_is_detected_and_restarted() {
    if !kvm_available() {
        return;
    }
    let s = sandbox_set(&three(r#""recovery": {"policy": "restart"},"#));
    let r = supervised(&s, Duration::from_secs(120), |s| {
        let svc = s.get("svc").expect("svc");
        wait_for("both streaming", Duration::from_secs(60), || consumed(s, 0) > 1000);
        end_svc(s);
        wait_for("svc's completion detected", Duration::from_secs(30), || {
            !svc.monitor.detections().is_empty()
        });
        wait_for("the restart", Duration::from_secs(60), || svc.monitor.recovery_count() >= 1);
        let before = consumed(s, 0);
        wait_for("svc streaming again", Duration::from_secs(60), || consumed(s, 0) > before + 500);
    });
    let svc = &r.sandboxes[0];
    assert_eq!(svc.outcome, VmOutcome::Stopped, "{}", svc.message);
    let d = &svc.detections[0];
    assert_eq!(d.detector, Detector::GuestError, "{d:?}");
    assert!(d.detail.contains("runs without end"), "{d:?}");
    assert!(svc.recoveries.iter().all(|r| r.policy == "restart" && r.ok), "{:?}", svc.recoveries);
    healthy(&r, &["p", "q"]);
}

/// Issue 19: a workload with an end that a fault returns into its end
/// early is cut short, not done: its digest may still replay right over
/// the rounds it ran, but its measured period (`CYCLES`) is shorter than
/// its `duration_ms`. Under `restart` its monitor's result check at the
/// completion finds it (a guest error), the sandbox runs again from a fresh
/// start and this time completes its whole period, verified; p and q see
/// nothing of it.
#[test]
fn under_restart_a_workload_cut_short_by_a_fault_is_detected_and_run_again() {
    if !kvm_available() {
        return;
    }
    // svc (the first sandbox) with an end: 3 s.
    let finite = three(r#""recovery": {"policy": "restart"},"#).replacen(
        r#""duration_ms": 0"#,
        r#""duration_ms": 3000"#,
        1,
    );
    assert!(finite.contains(r#""duration_ms": 3000"#), "{finite}");
    let s = sandbox_set(&finite);
    let r = supervised(&s, Duration::from_secs(120), |s| {
        let svc = s.get("svc").expect("svc");
        wait_for("both streaming", Duration::from_secs(60), || consumed(s, 0) > 500);
        end_svc(s);
        wait_for("the restart", Duration::from_secs(60), || svc.monitor.recovery_count() >= 1);
        wait_for("svc's whole run after it", Duration::from_secs(60), || svc.monitor.ended());
    });
    let svc = &r.sandboxes[0];
    assert_eq!(svc.outcome, VmOutcome::Completed, "{}\n{}", svc.message, svc.console);
    assert!(svc.verified, "{}", svc.message);
    let d = &svc.detections[0];
    assert_eq!(d.detector, Detector::GuestError, "{d:?}");
    assert!(d.detail.contains("cut short"), "{d:?}");
    assert!(svc.recoveries.iter().all(|r| r.policy == "restart" && r.ok), "{:?}", svc.recoveries);
    healthy(&r, &["p", "q"]);
}

/// Issue 19: the same under `rollback`: the supervisor's result check
/// refuses the completion and rolls svc back to its last checkpoint (the
/// code the fault overwrote comes back with it), and it streams on.
#[test]
fn under_rollback_a_service_that_completes_is_rolled_back() {
    if !kvm_available() {
        return;
    }
    let s = sandbox_set(&three(
        r#""recovery": {"policy": "rollback", "checkpoint_interval_ms": 20,
                        "release": "next_checkpoint", "max_recoveries": 20, "window_ms": 1000},"#,
    ));
    let r = supervised(&s, Duration::from_secs(180), |s| {
        let svc = s.get("svc").expect("svc");
        wait_for("both streaming", Duration::from_secs(60), || consumed(s, 0) > 1000);
        end_svc(s);
        wait_for("svc's completion rolled back", Duration::from_secs(30), || svc.rollbacks() >= 1);
        let before = consumed(s, 0);
        wait_for("svc streaming again", Duration::from_secs(60), || consumed(s, 0) > before + 500);
        assert!(!svc.monitor.ended(), "svc's monitor ended on a completion it rolled back");
    });
    let svc = &r.sandboxes[0];
    assert_eq!(svc.outcome, VmOutcome::Stopped, "{}", svc.message);
    let d = &svc.detections[0];
    assert_eq!(d.detector, Detector::GuestError, "{d:?}");
    assert!(d.detail.contains("runs without end"), "{d:?}");
    assert!(svc.recoveries.iter().all(|r| r.policy == "rollback" && r.ok), "{:?}", svc.recoveries);
    healthy(&r, &["p", "q"]);
}
