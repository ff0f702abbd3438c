//! `ninelives rejuvenate`: a running host's VMM process is replaced while its
//! VMs survive. Warm keeps the very same guest memory (same memfd inode) and
//! the workloads finish with verified digests; a broken or refusing new
//! binary leaves the VMs running in the old process; the API socket never
//! goes away. A netbench VM on a TAP (in a network namespace of the test's
//! own) keeps answering a 1 ms ping across warm, cold and save-restore
//! rejuvenations.

use crate::common;

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Stdio};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

/// A host started by the test; after handovers its pid changes, so the
/// current pid is asked for and killed on drop.
struct Host {
    child: Child,
    sock: PathBuf,
    _dir: tempfile::TempDir,
    /// The workload each VM was created with, as the test asked for it
    /// (what its replay is checked against).
    asked: std::cell::RefCell<std::collections::HashMap<u64, Value>>,
}

impl Host {
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("api.sock");
        let (child, _) = spawn_host(&sock);
        Host { child, sock, _dir: dir, asked: Default::default() }
    }

    /// A host inside network namespace `ns` (its VMs attach the TAP there).
    fn start_in(ns: &Netns) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("api.sock");
        let mut child = ns
            .ninelives(&["host", "--api", sock.to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let t = Instant::now();
        while UnixStream::connect(&sock).is_err() {
            if t.elapsed() > Duration::from_secs(20) {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the host did not start listening");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Host { child, sock, _dir: dir, asked: Default::default() }
    }

    fn req(&self, v: Value) -> Value {
        nl_vmm::api::request_timeout(&self.sock, &v, Duration::from_secs(120))
            .unwrap_or_else(|e| panic!("no reply to {v}: {e}"))
    }

    fn pid(&self) -> u64 {
        self.req(json!({"op":"info"}))["pid"].as_u64().unwrap()
    }

    fn stats(&self, id: u64) -> Value {
        let r = self.req(json!({"op":"stats","id":id}));
        assert_eq!(r["ok"], true, "{r}");
        r["stats"].clone()
    }

    fn rejuvenate(&self, args: &[&str]) -> (std::process::Output, Value) {
        let mut a = vec!["rejuvenate", "--api", self.sock.to_str().unwrap(), "--json"];
        a.extend_from_slice(args);
        let o = run_cli(&a);
        let v = last_json(&o);
        (o, v)
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        stop_host(&self.sock, &mut self.child);
    }
}

fn create(h: &Host, vcpus: u32, secs: f64) -> u64 {
    // A seed other than the default (1), so a create that ignored it fails.
    let seed = 40 + vcpus;
    let r = h.req(json!({"op":"create","workload":"memwrite","ws":"8M","mem":"64M",
        "vcpus":vcpus,"duration":secs,"seed":seed}));
    assert_eq!(r["ok"], true, "{r}");
    let id = r["id"].as_u64().unwrap();
    let asked = json!({"kind": "memwrite", "seed": seed, "ws_bytes": 8 << 20,
        "duration_ms": (secs * 1000.0) as u64, "vcpus": vcpus});
    h.asked.borrow_mut().insert(id, asked);
    id
}

/// Waits until every vCPU of a VM heartbeats in its measured phase.
fn wait_running(h: &Host, id: u64) {
    let t = Instant::now();
    loop {
        let s = h.stats(id);
        let vcpus = s["vcpus"].as_array().unwrap();
        if vcpus.iter().all(|v| v["regs"]["beats"].as_u64().unwrap() > 0) {
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "VM {id} never ran: {s}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for a VM to complete, then replays its workload on the host and
/// checks every vCPU's digest and op count.
fn assert_completes_verified(h: &Host, id: u64) {
    let t = Instant::now();
    let s = loop {
        let s = h.stats(id);
        if s["state"] != "running" {
            break s;
        }
        assert!(t.elapsed() < Duration::from_secs(120), "VM {id} did not finish");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(s["state"], "completed", "{s}");
    let asked = h.asked.borrow().get(&id).cloned().expect("a VM this test created");
    assert_stats_replay(id, &asked, &s);
}

fn script(dir: &Path, name: &str, body: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p.to_string_lossy().into_owned()
}

#[test]
fn warm_rejuvenation_keeps_guest_memory_and_the_socket() {
    if !kvm_available() {
        return;
    }
    let h = Host::start();
    // Long enough to still run at the handover on a loaded machine (the
    // test fails below if either had finished before it).
    let a = create(&h, 1, 12.0);
    let b = create(&h, 2, 14.0);
    // A VM that ended before the handover: its result must stay available.
    let done = create(&h, 1, 0.2);
    assert_completes_verified(&h, done);
    wait_running(&h, a);
    wait_running(&h, b);
    let old_pid = h.pid();
    let ino = |id| h.stats(id)["memfd_ino"].as_u64().unwrap();
    let (ino_a, ino_b) = (ino(a), ino(b));
    let rounds_before = h.stats(b)["vcpus"][0]["regs"]["heartbeat"].as_u64().unwrap();

    // A client hammering the socket throughout: every connect succeeds.
    let stop = Arc::new(AtomicBool::new(false));
    let (sock, stop2) = (h.sock.clone(), stop.clone());
    let hammer = std::thread::spawn(move || {
        let mut answered = 0;
        while !stop2.load(Relaxed) {
            let _s = UnixStream::connect(&sock).expect("socket vanished during handover");
            // No reply is allowed for a connection the old process accepted
            // just before it exited.
            let list = json!({"op":"list"});
            if nl_vmm::api::request_timeout(&sock, &list, Duration::from_secs(30)).is_ok() {
                answered += 1;
            }
        }
        answered
    });
    let (o, r) = h.rejuvenate(&["--mode", "warm"]);
    stop.store(true, Relaxed);
    assert!(o.status.success(), "{r} {}", stderr(&o));
    assert!(hammer.join().unwrap() > 0);
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(r["rolled_back"], false);
    assert_eq!(r["old_pid"].as_u64(), Some(old_pid));
    let new_pid = h.pid();
    assert_ne!(new_pid, old_pid, "a new process serves the socket");
    assert_eq!(r["new_pid"].as_u64(), Some(new_pid));
    // Both were still running at the handover: each was paused and carried
    // over (a VM that had finished is listed as not carried instead, and
    // this test would prove nothing about it); only the VM that ended
    // before is not carried.
    let mut carried: Vec<u64> =
        r["vms"].as_array().unwrap().iter().map(|v| v["id"].as_u64().unwrap()).collect();
    carried.sort_unstable();
    assert_eq!(carried, vec![a, b], "both VMs ran at the handover and were carried: {r}");
    assert_eq!(r["not_carried"], json!([done]), "{r}");
    for v in r["vms"].as_array().unwrap() {
        assert_eq!(v["image_bytes"], 0, "warm writes no memory image: {v}");
        assert!(v["downtime_ms"].is_number(), "{v}");
    }
    // The new process maps the same memfds: nothing was copied.
    assert_eq!(ino(a), ino_a);
    assert_eq!(ino(b), ino_b);
    // The guests kept their in-memory progress (counters did not restart).
    let after = h.stats(b)["vcpus"][0]["regs"]["heartbeat"].as_u64().unwrap();
    assert!(after >= rounds_before, "progress lost: {after} < {rounds_before}");
    assert_eq!(h.req(json!({"op":"info"}))["generation"], 1);
    assert_eq!(r["not_carried"][0], json!(done), "{r}");
    assert_completes_verified(&h, done);
    // The successor was started and built the VMs before they paused.
    assert_eq!(r["phases"]["prespawned"], true, "{r}");

    // A second warm rejuvenation of the successor works too, this time
    // starting the new process during the pause (version 1 record).
    let (o, r) = h.rejuvenate(&["--mode", "warm", "--no-prespawn"]);
    assert!(o.status.success(), "{r}");
    assert_eq!(r["phases"]["prespawned"], false, "{r}");
    assert_eq!(h.req(json!({"op":"info"}))["generation"], 2);
    assert_eq!(ino(b), ino_b);

    assert_completes_verified(&h, a);
    assert_completes_verified(&h, b);
    // The new host still creates VMs, with fresh ids.
    let c = create(&h, 1, 0.2);
    assert!(c > b);
    assert_completes_verified(&h, c);
}

#[test]
fn a_broken_or_refusing_new_binary_leaves_the_vms_running_in_the_old_process() {
    if !kvm_available() {
        return;
    }
    let h = Host::start();
    // Long enough to still run when the cases that pause it (the first two)
    // are tried on a loaded machine.
    let a = create(&h, 2, 30.0);
    wait_running(&h, a);
    let pid = h.pid();
    let dir = tempfile::tempdir().unwrap();
    let real = env!("CARGO_BIN_EXE_ninelives");
    // The two cases that pause the VM come first: they need it running,
    // the others only that it is not harmed.
    let cases = [
        // Started during the pause, as in the paper: the record is refused
        // after the VMs paused, and they resume here.
        (
            script(
                dir.path(),
                "newer-late",
                &format!(
                    "printf '{{\"magic\":\"ninelives-handover\",\"version\":99,\"binary_version\":\"9.9\"}}' > /proc/self/fd/$5\nexec {real} \"$@\""
                ),
            ),
            "record version 99",
            vec!["--no-prespawn"],
        ),
        // A standby successor that built the VMs, then refuses their states
        // (after the VMs paused here): they resume here.
        (
            script(
                dir.path(),
                "refuse-state",
                &format!("NINELIVES_HANDOVER_SELFTEST=refuse-state exec {real} \"$@\""),
            ),
            "refusing the VM states",
            vec![],
        ),
        (script(dir.path(), "exit1", "exit 1"), "exited", vec![]),
        // Args are: host --api S --handover-fd R --handover-ctl C
        (
            script(
                dir.path(),
                "newer",
                &format!(
                    "printf '{{\"magic\":\"ninelives-handover\",\"version\":99,\"binary_version\":\"9.9\"}}' > /proc/self/fd/$5\nexec {real} \"$@\""
                ),
            ),
            "record version 99",
            vec![],
        ),
        (
            script(
                dir.path(),
                "corrupt",
                &format!("printf 'garbage' > /proc/self/fd/$5\nexec {real} \"$@\""),
            ),
            "not a ninelives handover record",
            vec![],
        ),
        (script(dir.path(), "hang", "exec sleep 60"), "did not report", vec!["--timeout", "1"]),
    ];
    for (bin, why, extra) in &cases {
        let mut args = vec!["--mode", "warm", "--binary", bin.as_str()];
        args.extend(extra.iter().copied());
        let (o, r) = h.rejuvenate(&args);
        // A standby successor that fails before it has built the VMs costs
        // them no pause at all; the others fail after the VMs paused.
        let paused = extra.contains(&"--no-prespawn") || bin.ends_with("refuse-state");
        assert_eq!(r["vms"].as_array().is_some_and(|v| !v.is_empty()), paused, "{bin}: {r}");
        assert!(!o.status.success(), "{bin}: must fail: {r}");
        assert_eq!(r["ok"], false, "{r}");
        assert_eq!(r["rolled_back"], true, "{r}");
        assert!(r["new_pid"].is_null(), "{r}");
        assert!(r["error"].as_str().unwrap().contains(why), "{bin}: expected '{why}' in {r}");
        assert_eq!(h.pid(), pid, "the old process still serves");
        let st = h.stats(a)["state"].clone();
        assert!(st == "running" || st == "completed", "{st}");
    }
    // Bad requests are refused with a clear error, nothing changes.
    let r = h.req(json!({"op":"rejuvenate","mode":"lukewarm"}));
    assert_eq!(r["ok"], false);
    assert!(r["error"].as_str().unwrap().contains("warm, cold, save-restore"), "{r}");
    let o = run_cli(&["rejuvenate", "--api", "/nonexistent/sock", "--mode", "warm"]);
    assert_clean_error(&o, "cannot connect");
    // The VM still runs, and its workload verifies.
    let beats = h.stats(a)["vcpus"][0]["regs"]["beats"].as_u64().unwrap();
    let t = Instant::now();
    while h.stats(a)["state"] == "running"
        && h.stats(a)["vcpus"][0]["regs"]["beats"].as_u64().unwrap() == beats
    {
        assert!(t.elapsed() < Duration::from_secs(30), "VM does not run after the rollback");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_completes_verified(&h, a);
}

#[test]
fn save_restore_and_cold_rejuvenation() {
    if !kvm_available() {
        return;
    }
    let h = Host::start();
    let a = create(&h, 1, 2.0);
    wait_running(&h, a);
    let ino = h.stats(a)["memfd_ino"].as_u64().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (o, r) =
        h.rejuvenate(&["--mode", "save-restore", "--image-dir", dir.path().to_str().unwrap()]);
    assert!(o.status.success(), "{r}");
    assert_eq!(r["vms"][0]["image_bytes"], 64 << 20, "{r}");
    assert_ne!(h.stats(a)["memfd_ino"].as_u64().unwrap(), ino, "restored into new memory");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "images are removed");
    assert_completes_verified(&h, a);

    // Cold: the guest boots again from scratch (its progress is lost) and
    // still runs its workload to a verified end.
    let b = create(&h, 1, 1.0);
    wait_running(&h, b);
    let (o, r) = h.rejuvenate(&["--mode", "cold"]);
    assert!(o.status.success(), "{r}");
    assert_eq!(r["not_carried"], json!([a]), "finished VMs are not carried over");
    assert!(r["vms"][0]["boot_done_ms"].is_number(), "{r}");
    assert_completes_verified(&h, b);
}

/// A 1 ms `ninelives ping` of the guest that runs until its stdin is closed
/// (at most 120 s); killed on drop.
struct Pinger {
    child: Child,
    stdin: Option<ChildStdin>,
    out: BufReader<ChildStdout>,
    t0: Instant,
}

impl Pinger {
    fn start(ns: &Netns) -> Pinger {
        let mut child = ns
            .ninelives(&["ping", "--target", "10.0.0.2", "--interval", "1ms", "--duration", "120"])
            .args(["--until-stdin-eof", "--json"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "sending", "the pinger did not start");
        Pinger { child, stdin, out, t0: Instant::now() }
    }

    /// Milliseconds since the pinger's clock started (it started a little
    /// earlier than `t0`, so its own times are never behind this).
    fn now_ms(&self) -> f64 {
        self.t0.elapsed().as_secs_f64() * 1e3
    }

    /// Ends the run and returns the pinger's report.
    fn finish(mut self) -> Value {
        drop(self.stdin.take());
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut self.out, &mut rest).unwrap();
        let _ = self.child.wait();
        let line = rest.lines().last().unwrap_or_else(|| panic!("no ping report: {rest}"));
        serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"))
    }
}

impl Drop for Pinger {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Rejuvenates with a 1 ms ping running from before the request until the
/// guest answers again; the guest must answer the same pinger afterwards.
fn rejuvenate_under_ping(h: &Host, ns: &Netns, args: &[&str]) -> Value {
    let p = Pinger::start(ns);
    // Some replies before the request (a window, not a timing assertion).
    std::thread::sleep(Duration::from_millis(200));
    let (o, r) = h.rejuvenate(args);
    assert!(o.status.success(), "{args:?}: {r} {}", stderr(&o));
    assert_eq!(r["ok"], true, "{r}");
    let done_ms = p.now_ms();
    assert!(
        ns.wait_answering(Duration::from_secs(30)),
        "{args:?}: the guest does not answer pings after it"
    );
    std::thread::sleep(Duration::from_millis(200));
    let j = p.finish();
    eprintln!(
        "{args:?}: ping sent {} received {} longest gap {} ms; VM downtime {} ms",
        j["sent"], j["received"], j["longest_gap_ms"], r["vms"][0]["downtime_ms"]
    );
    assert!(j["received"].as_u64().unwrap() > 0, "{j}");
    // Replies kept coming to the same pinger after the rejuvenation.
    let last = j["last_reply_ms"].as_f64().unwrap_or(0.0);
    assert!(last > done_ms, "{args:?}: no reply after the rejuvenation ({last} <= {done_ms}): {j}");
    r
}

#[test]
fn a_vm_on_a_tap_answers_pings_across_warm_cold_and_save_restore() {
    if !kvm_available() {
        return;
    }
    // Declared first: the namespace is deleted after the host is gone.
    let Some(ns) = Netns::new("rejuv") else { return };
    let h = Host::start_in(&ns);
    let r = h.req(json!({"op":"create","workload":"netbench","mem":"64M","duration":600,
        "net_tap":"nltap0","net_ip":"10.0.0.2/24"}));
    assert_eq!(r["ok"], true, "{r}");
    let id = r["id"].as_u64().unwrap();
    assert!(ns.wait_answering(Duration::from_secs(30)), "the guest never answered");
    let ino = |h: &Host| h.stats(id)["memfd_ino"].as_u64().unwrap();
    let ino0 = ino(&h);

    // Warm, twice (the second successor inherits a TAP it inherited
    // itself). The TAP descriptor is handed over: re-opening the TAP by
    // name would fail (EBUSY) while the old process still holds it.
    for _ in 0..2 {
        let old_pid = h.pid();
        let r = rejuvenate_under_ping(&h, &ns, &["--mode", "warm"]);
        let new_pid = h.pid();
        assert_ne!(new_pid, old_pid, "a new process serves the VM");
        assert_eq!(r["new_pid"].as_u64(), Some(new_pid), "{r}");
        assert_eq!(r["vms"][0]["id"].as_u64(), Some(id), "{r}");
        assert_eq!(ino(&h), ino0, "the same guest memory");
        let st = h.stats(id);
        assert_eq!(st["state"], "running");
        // The successor announced the guest (a gratuitous ARP on its TAP).
        assert_eq!(st["net"]["announcements"], 1, "{}", st["net"]);
    }
    // Cold (the guest boots again and re-opens the TAP by name) and
    // save-restore (restored from a memory image): connectivity comes back.
    let r = rejuvenate_under_ping(&h, &ns, &["--mode", "cold"]);
    assert!(r["vms"][0]["boot_done_ms"].is_number(), "{r}");
    assert_eq!(h.stats(id)["state"], "running");
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().to_str().unwrap();
    let r = rejuvenate_under_ping(&h, &ns, &["--mode", "save-restore", "--image-dir", img]);
    assert_eq!(r["vms"][0]["image_bytes"], 64 << 20, "{r}");
    let st = h.stats(id);
    assert_eq!(st["state"], "running");
    assert_eq!(st["net"]["announcements"], 1, "{}", st["net"]);
    let list = h.req(json!({"op":"list"}));
    assert_eq!(list["vms"].as_array().unwrap().len(), 1, "{list}");
    assert_eq!(list["vms"][0]["id"].as_u64(), Some(id), "{list}");
}
