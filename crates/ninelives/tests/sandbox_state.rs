//! A service's state region (Quest-V remote recovery): the kv service keeps
//! its table in a memfd only its holder maps; at a takeover the region moves
//! to the standby, which loads the table (CRC-checked entries, a journal).
//!
//! Each test runs in a network namespace of its own with TAP nltap0 at
//! 10.0.0.1/24; the service is 10.0.0.2 (kv on TCP 7000). Every wait and
//! loop is bounded in count and time; nothing asserts on timing.

use crate::common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{kvm_available, sandbox_images, two_cores, wait_or, Netns, LOADED};
use nl_checkpoint::inject::GuestFault;
use nl_sandbox::{SandboxSet, SetConfig};

const NET: &str = r#""net": {"tap": "nltap0", "mac": "52:54:00:5a:00:02", "ipv4": "10.0.0.2/24"}"#;

fn kv_addr() -> SocketAddr {
    "10.0.0.2:7000".parse().unwrap()
}

/// An unmapped RIP: the next instruction faults (#PF) in guest ring 3.
const BAD_RIP: GuestFault = GuestFault::Register { cpu: 0, reg: "rip", bit: 40 };

/// A kv service on web (owner) and spare (standby) with a state region.
fn config(policy: &str) -> String {
    let [c0, c1] = two_cores();
    format!(
        r#"{{"sandboxes": [
            {{"name": "web", "cores": [{c0}], "workload": {{"kind": "kv", "duration_ms": 0}}, {NET},
              "recovery": {{"policy": "{policy}", "max_recoveries": 100, "window_ms": 1000}}}},
            {{"name": "spare", "cores": [{c1}], "workload": {{"kind": "kv", "duration_ms": 0}},
              "recovery": {{"policy": "{policy}", "max_recoveries": 100, "window_ms": 1000}}}}
        ], "services": [{{"name": "kv", "owner": "web", "standby": "spare", "state": {{"mib": 4}}}}]}}"#
    )
}

/// A small kv client: one request at a time, reconnecting after any error
/// (a takeover resets the connection). Every call is bounded by timeouts.
/// (Also used by `host_sandboxes`: a state region carried by a host.)
pub(crate) struct Client {
    conn: Option<BufReader<TcpStream>>,
}

impl Client {
    pub(crate) fn new() -> Self {
        Client { conn: None }
    }

    /// The response line (without its newline), or None (not answered).
    pub(crate) fn request(&mut self, line: &str) -> Option<String> {
        if self.conn.is_none() {
            let s = TcpStream::connect_timeout(&kv_addr(), Duration::from_millis(300)).ok()?;
            s.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
            s.set_write_timeout(Some(Duration::from_millis(500))).ok()?;
            s.set_nodelay(true).ok()?;
            self.conn = Some(BufReader::new(s));
        }
        let c = self.conn.as_mut()?;
        let mut out = String::new();
        let ok = c.get_mut().write_all(format!("{line}\n").as_bytes()).is_ok()
            && c.read_line(&mut out).is_ok_and(|n| n > 0 && out.ends_with('\n'));
        if !ok {
            self.conn = None;
            return None;
        }
        Some(out.trim_end().to_string())
    }

    /// A request retried (bounded) until answered.
    pub(crate) fn must(&mut self, line: &str, limit: Duration) -> String {
        let t = Instant::now();
        for _ in 0..10_000 {
            if let Some(r) = self.request(line) {
                return r;
            }
            assert!(t.elapsed() < limit * LOADED, "'{line}' not answered within {limit:?}");
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!("'{line}' not answered");
    }
}

/// What a writer knows of one key: the last value acknowledged and the
/// values sent since without an answer (each may or may not be stored).
#[derive(Default, Debug)]
struct KeyLog {
    acked: Option<u64>,
    unanswered: Vec<u64>,
}

/// Writes `PUT kK vN` until `stop`, bounded by `limit`: K = N for even N
/// (a key written once, which must survive every later takeover) and
/// N mod `keys` for odd N (keys updated in place); returns each key's log
/// and the writes acknowledged.
/// Keys a writer cycles through for its fresh-key writes (the table holds
/// well over this plus the repeated keys).
const FRESH_KEYS: u64 = 8192;

fn writer(
    stop: &AtomicBool,
    keys: u64,
    limit: Duration,
    progress: &AtomicU64,
) -> (BTreeMap<u64, KeyLog>, u64) {
    let mut log: BTreeMap<u64, KeyLog> = BTreeMap::new();
    let mut c = Client::new();
    let t = Instant::now();
    let mut acked = 0;
    for n in 0..10_000_000u64 {
        if stop.load(Ordering::SeqCst) || t.elapsed() > limit {
            break;
        }
        // Every other write goes to a key of its own for a long while (the
        // table grows through the takeovers), but from a bounded set: a
        // slow run writes more, and must not fill the table.
        let k = if n % 2 == 0 { keys + (n / 2) % FRESH_KEYS } else { n % keys };
        let e = log.entry(k).or_default();
        match c.request(&format!("PUT k{k} v{n}")).as_deref() {
            Some("OK") => {
                e.acked = Some(n);
                e.unanswered.clear();
                acked += 1;
                progress.store(acked, Ordering::SeqCst);
            }
            Some(other) => panic!("PUT k{k} v{n}: {other}"),
            None => {
                e.unanswered.push(n);
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }
    (log, acked)
}

/// Reads every key back: (lost, wrong). Lost: an acknowledged key whose
/// value is missing or older than the one acknowledged; wrong: any value
/// that was never written to the key.
fn check(log: &BTreeMap<u64, KeyLog>) -> (Vec<String>, Vec<String>) {
    let mut c = Client::new();
    let (mut lost, mut wrong) = (Vec::new(), Vec::new());
    for (k, e) in log {
        let r = c.must(&format!("GET k{k}"), Duration::from_secs(10));
        let got: Option<u64> = r.strip_prefix("VAL v").and_then(|v| v.parse().ok());
        let possible = |n: u64| e.acked == Some(n) || e.unanswered.contains(&n);
        match (r.as_str(), got) {
            ("NONE", _) if e.acked.is_none() => {}
            ("NONE", _) => lost.push(format!("k{k}: NONE, acknowledged v{:?}", e.acked)),
            (_, Some(n)) if possible(n) => {}
            (_, Some(n)) if e.acked.is_some_and(|a| n < a) => {
                lost.push(format!("k{k}: v{n}, older than acknowledged v{:?}", e.acked))
            }
            _ => wrong.push(format!("k{k}: {r:?}, log {e:?}")),
        }
    }
    (lost, wrong)
}

fn holder(s: &SandboxSet) -> (String, String, usize) {
    let names: Vec<String> = s.sandboxes.iter().map(|b| b.config.name.clone()).collect();
    let r = s.services.report(&names).remove(0);
    (r.holder, r.standby, r.takeovers.len())
}

#[test]
fn kv_keeps_every_acknowledged_write_across_20_takeovers() {
    let _one_at_a_time = common::pace_sensitive();
    if !kvm_available() {
        return;
    }
    let Some(ns) = Netns::new("sbstate") else { return };
    const TAKEOVERS: usize = 20;
    let mut result = None;
    let r = ns.supervised_set(&config("restart"), |s| {
        let mut c = Client::new();
        assert_eq!(c.must("PUT first 1", Duration::from_secs(60)), "OK");
        let stop = AtomicBool::new(false);
        let progress = AtomicU64::new(0);
        std::thread::scope(|scope| {
            let w = scope.spawn(|| writer(&stop, 301, Duration::from_secs(900), &progress));
            let state = || format!("{:?}", holder(s));
            for t in 0..TAKEOVERS {
                let (from, to, n) = holder(s);
                assert_eq!(n, t);
                // The standby is up: its restart after the last takeover is
                // recorded (a heartbeat alone may be its old VM's, before
                // the restart replaced it) and its new VM heartbeats.
                wait_or(
                    "the standby ready",
                    Duration::from_secs(60),
                    || {
                        let sb = s.get(&to).unwrap();
                        sb.monitor.recovery_count() >= sb.monitor.detections().len()
                            && sb.vm().control().vcpus[0].snapshot().beats > 0
                    },
                    state,
                );
                // The holder acknowledged writes of its own.
                let before = progress.load(Ordering::SeqCst);
                wait_or(
                    "writes acknowledged by the holder",
                    Duration::from_secs(30),
                    || progress.load(Ordering::SeqCst) > before + 20,
                    state,
                );
                s.inject(&from, &BAD_RIP).expect("inject");
                wait_or("the takeover", Duration::from_secs(30), || holder(s).2 == t + 1, state);
                let (h, _, _) = holder(s);
                assert_eq!(h, to, "takeover {t}");
            }
            std::thread::sleep(Duration::from_millis(300));
            stop.store(true, Ordering::SeqCst);
            let (log, acked) = w.join().expect("writer");
            let (lost, wrong) = check(&log);
            let header = s.services.services[0].state.as_ref().unwrap().header();
            result = Some((acked, lost, wrong, header));
        });
    });
    let (acked, lost, wrong, header) = result.expect("the test body ran");
    eprintln!("{acked} writes acknowledged across {TAKEOVERS} takeovers; {header:?}");
    assert!(acked > 100, "too few writes acknowledged: {acked}");
    assert!(lost.is_empty(), "{} acknowledged writes lost: {lost:?}", lost.len());
    assert!(wrong.is_empty(), "{} wrong values: {wrong:?}", wrong.len());
    // Each new holder loaded the table (the owner formatted it first).
    assert_eq!(header.loads, TAKEOVERS as u64, "{header:?}");
    assert_eq!(header.dropped, 0, "{header:?}");
    let svc = &r.services[0];
    assert_eq!(svc.takeovers.len(), TAKEOVERS, "{svc:?}");
    assert!(svc.takeovers.iter().all(|t| t.ok), "{svc:?}");
}

/// Byte offset of entry slot `i` in the region (after the header and the
/// journal slot; 128 bytes a slot: `nl_workloads::kv`).
fn slot_offset(i: u64) -> u64 {
    (i + 2) * 128
}

#[test]
fn corrupt_entries_in_the_state_region_are_dropped_counted_and_never_served() {
    if !kvm_available() {
        return;
    }
    let Some(ns) = Netns::new("sbcorrupt") else { return };
    let mut console = String::new();
    let r = ns.supervised_set(&config("restart"), |s| {
        let mut c = Client::new();
        for k in 0..100 {
            assert_eq!(c.must(&format!("PUT key{k} value{k}"), Duration::from_secs(60)), "OK");
        }
        drop(c);
        let st = s.services.services[0].state.as_ref().unwrap();
        assert_eq!(st.mapped_in(), Some(0), "the owner maps it");
        // Plant: in 5 entries one bit of the value flipped (still a
        // printable value: a wrong one if served), in 1 the key.
        let slots = st.bytes / 128 - 2;
        let mut hit: Vec<String> = Vec::new();
        for i in 0..slots {
            if hit.len() == 6 {
                break;
            }
            let at = slot_offset(i);
            let tag = u64::from_le_bytes(st.read(at, 8).try_into().unwrap());
            if tag >> 63 == 0 {
                continue;
            }
            let kl = (tag & 0xff) as usize;
            let key = String::from_utf8_lossy(&st.read(at + 8, kl)).into_owned();
            let (off, bit) =
                if hit.len() < 5 { (at + 32, 1u8) } else { (at + 8 + kl as u64 - 1, 4) };
            let b = st.read(off, 1)[0] ^ bit;
            assert!(st.write(off, &[b]));
            hit.push(key);
        }
        assert_eq!(hit.len(), 6);
        s.inject("web", &BAD_RIP).expect("inject");
        wait_or(
            "the takeover",
            Duration::from_secs(30),
            || holder(s).2 == 1,
            || format!("{:?}", holder(s)),
        );
        let mut c = Client::new();
        let mut served_wrong = Vec::new();
        for k in 0..100 {
            let key = format!("key{k}");
            let r = c.must(&format!("GET {key}"), Duration::from_secs(30));
            let ok = if hit.contains(&key) { r == "NONE" } else { r == format!("VAL value{k}") };
            if !ok {
                served_wrong.push(format!("{key}: {r}"));
            }
        }
        assert!(served_wrong.is_empty(), "{served_wrong:?}");
        assert_eq!(st.mapped_in(), Some(1), "the new holder maps it, the old one not");
        let h = st.header();
        // One load: the takeover's (the owner formatted the empty region).
        assert_eq!((h.dropped, h.entries, h.loads), (6, 94, 1), "{h:?}");
        console = s.get("spare").unwrap().vm().console().tail();
    });
    assert!(console.contains("94 entries kept, 6 corrupt dropped"), "{console}");
    assert!(r.services[0].takeovers[0].ok, "{:?}", r.services[0]);
}

/// No standby available: the standby failed and stopped (policy `stop`)
/// before the owner fails. The takeover ends, within its bounded wait, in
/// a failed record saying so; the owner recovers locally on its own TAP
/// with the state region moved to its new VM, and serves every
/// acknowledged write again.
#[test]
fn a_takeover_with_no_standby_available_is_reported_and_the_owner_recovers_locally() {
    if !kvm_available() {
        return;
    }
    let Some(ns) = Netns::new("sbnostandby") else { return };
    let config = config("restart");
    // spare stops for good at its first fault.
    let config = {
        let i = config.find(r#""name": "spare""#).unwrap();
        let (a, b) = config.split_at(i);
        format!("{a}{}", b.replacen(r#""policy": "restart""#, r#""policy": "stop""#, 1))
    };
    let r = ns.supervised_set(&config, |s| {
        let mut c = Client::new();
        for k in 0..20 {
            assert_eq!(c.must(&format!("PUT key{k} value{k}"), Duration::from_secs(60)), "OK");
        }
        drop(c);
        let state = || format!("{:?}", s.services.report(&["web".into(), "spare".into()]));
        s.inject("spare", &BAD_RIP).expect("inject into the standby");
        wait_or(
            "the standby stopped",
            Duration::from_secs(30),
            || !s.get("spare").unwrap().monitor.detections().is_empty(),
            state,
        );
        s.inject("web", &BAD_RIP).expect("inject into the owner");
        wait_or(
            "the failed takeover's record",
            Duration::from_secs(30),
            || {
                let r = s.services.report(&["web".into(), "spare".into()]).remove(0);
                r.takeovers.first().is_some_and(|t| t.error.is_some())
            },
            state,
        );
        wait_or(
            "web's local restart",
            Duration::from_secs(60),
            || s.get("web").unwrap().monitor.recovery_count() == 1,
            state,
        );
        let mut c = Client::new();
        for k in 0..20 {
            let r = c.must(&format!("GET key{k}"), Duration::from_secs(30));
            assert_eq!(r, format!("VAL value{k}"), "key{k}");
        }
        let st = s.services.services[0].state.as_ref().unwrap();
        assert_eq!(st.mapped_in(), Some(0), "the state region stays with web");
    });
    let svc = &r.services[0];
    assert_eq!((svc.holder.as_str(), svc.standby.as_str()), ("web", "spare"), "{svc:?}");
    let t = &svc.takeovers[0];
    assert!(!t.ok, "{t:?}");
    let e = t.error.as_deref().unwrap_or("");
    assert!(e.contains("no standby available") && e.contains("'spare'"), "{e}");
    let web = r.sandboxes.iter().find(|b| b.name == "web").unwrap();
    assert!(web.recoveries.iter().all(|r| r.ok) && web.gave_up.is_none(), "{web:?}");
}

/// `rollback` of a kv sandbox (no service: a rolled-back sandbox keeps its
/// device): 20 faults, each rolled back in place, while a client writes.
/// Every acknowledged write must read back.
#[test]
#[ignore = "20 scripted faults gave 10 rollbacks in its one run (several triple faults right after a rollback), not understood yet (docs/sandboxes.md, 'State region')"]
fn kv_keeps_every_acknowledged_write_across_20_rollbacks() {
    if !kvm_available() {
        return;
    }
    let Some(ns) = Netns::new("sbrollback") else { return };
    let [c0, _] = two_cores();
    let config = format!(
        r#"{{"sandboxes": [
            {{"name": "kv", "cores": [{c0}], "workload": {{"kind": "kv", "duration_ms": 0}}, {NET},
              "recovery": {{"policy": "rollback", "max_recoveries": 100, "window_ms": 1000,
                           "checkpoint_interval_ms": 20}}}}
        ]}}"#
    );
    const ROLLBACKS: usize = 20;
    let config = SetConfig::parse(&config).expect("config");
    let mut result = None;
    ns.0.run_in(|| {
        let kvm = nl_vmm::open_kvm().expect("kvm");
        let s = SandboxSet::create(&kvm, config, &sandbox_images()).expect("sandbox set");
        // A fault every 700 ms, from 3 s on (the guest up and serving).
        let script = (0..ROLLBACKS)
            .map(|i| (Duration::from_millis(3000 + 700 * i as u64), BAD_RIP))
            .collect();
        s.get("kv").unwrap().set_script(script);
        s.start_all().expect("start");
        let stop = AtomicBool::new(false);
        let progress = AtomicU64::new(0);
        std::thread::scope(|scope| {
            let h = scope.spawn(|| s.supervise(Duration::from_secs(600)));
            let w = scope.spawn(|| writer(&stop, 301, Duration::from_secs(300), &progress));
            let kvsb = s.get("kv").unwrap();
            let t = Instant::now();
            while kvsb.monitor.recovery_count() < ROLLBACKS
                && t.elapsed() < Duration::from_secs(300)
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            std::thread::sleep(Duration::from_millis(500));
            stop.store(true, Ordering::SeqCst);
            let (log, acked) = w.join().expect("writer");
            let (lost, wrong) = check(&log);
            s.request_stop();
            let report = h.join().expect("supervision");
            result = Some((acked, lost, wrong, report));
        });
        Ok(())
    })
    .expect("the namespace");
    let (acked, lost, wrong, report) = result.unwrap();
    let rollbacks = report.sandboxes[0].recoveries.len();
    eprintln!(
        "{acked} writes acknowledged across {rollbacks} rollbacks; lost {}, wrong {}",
        lost.len(),
        wrong.len()
    );
    assert!(rollbacks >= ROLLBACKS, "{:?}", report.sandboxes[0]);
    assert!(
        lost.is_empty(),
        "{} acknowledged writes lost: {:?}",
        lost.len(),
        &lost[..lost.len().min(10)]
    );
    assert!(wrong.is_empty(), "{} wrong values: {wrong:?}", wrong.len());
}
