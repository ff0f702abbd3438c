//! `ninelives host` limits: no API client can make the host buffer, wait or
//! commit without bound. An oversized, slow or idle request and a client
//! that does not read its replies get an error line and lose their
//! connection (never a hang of the host); connections are capped; `create`
//! is admitted against guest-memory and vCPU budgets.

use crate::common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

/// A host started by a test, killed on drop.
struct HostProcess {
    child: Child,
}

impl Drop for HostProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl HostProcess {
    fn start(sock: &Path, extra: &[&str]) -> (Self, UnixStream) {
        // These tests drive the JSON-lines protocol's limits byte by byte.
        let extra: Vec<&str> = ["--api-legacy"].iter().chain(extra).copied().collect();
        let (child, s) = spawn_host_with(sock, &extra);
        (Self { child }, s)
    }

    /// The host process is still running (it did not exit on a detector).
    fn assert_alive(&mut self, what: &str) {
        if let Some(st) = self.child.try_wait().unwrap() {
            panic!("the host exited ({st}) after {what}");
        }
    }
}

/// One request on an open connection and its reply.
fn send(s: &mut UnixStream, v: Value) -> Value {
    writeln!(s, "{v}").unwrap();
    read_reply(s).unwrap_or_else(|| panic!("no reply to {v}"))
}

/// One request on a new connection and its reply.
fn request(sock: &Path, v: Value) -> Value {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    send(&mut s, v)
}

/// The next reply line, or None if the connection ended first.
fn read_reply(s: &UnixStream) -> Option<Value> {
    let mut line = String::new();
    match BufReader::new(s).read_line(&mut line) {
        Ok(n) if n > 0 => Some(
            serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("reply is not JSON ({e}): {line}")),
        ),
        _ => None,
    }
}

/// The error of a `{"ok":false,"error":...}` reply.
fn error_of(r: &Value) -> String {
    assert_eq!(r["ok"], false, "expected an error reply: {r}");
    r["error"].as_str().unwrap_or_else(|| panic!("error reply without an error: {r}")).to_string()
}

/// The connection was closed by the host: reading gives end of file (or a
/// reset), not a timeout.
fn assert_closed(s: &mut UnixStream) {
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut b = [0u8; 1];
    match s.read(&mut b) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        r => panic!("the connection is still open after the error: {r:?}"),
    }
}

/// Beats of vCPU 0 of VM `id`.
fn beats(sock: &Path, id: u64) -> u64 {
    let st = request(sock, json!({"op":"stats","id":id}));
    st["stats"]["vcpus"][0]["regs"]["beats"].as_u64().unwrap_or_else(|| panic!("{st}"))
}

/// The VM keeps heartbeating (bounded wait).
fn assert_heartbeating(sock: &Path, id: u64) {
    let before = beats(sock, id);
    let t = Instant::now();
    for _ in 0..1500 {
        if beats(sock, id) != before {
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "VM {id} stopped heartbeating");
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("VM {id} stopped heartbeating");
}

/// The host answers `info` and `list` on new connections.
fn assert_answers(sock: &Path) {
    assert_eq!(request(sock, json!({"op":"info"}))["ok"], true);
    let l = request(sock, json!({"op":"list"}));
    assert_eq!(l["ok"], true, "{l}");
}

/// Sends more than 64 KiB without a newline, then waits with the socket
/// open: the one reply is the size error, then the host closes.
fn oversized_client(sock: &Path) -> String {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    // The host may close before all of it is written: a failed write is fine.
    let _ = s.write_all(&vec![b'x'; 70 * 1024]);
    // Wait like a client that expects more: long past the hang watchdog's 300 ms.
    std::thread::sleep(Duration::from_millis(1500));
    let r =
        read_reply(&s).expect("an oversized request gets an error line, not a dropped connection");
    let e = error_of(&r);
    assert_closed(&mut s);
    e
}

#[test]
fn oversized_request_is_refused_and_the_host_survives() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    let (mut host, mut s) = HostProcess::start(&sock, &[]);
    let vm = send(
        &mut s,
        json!({"op":"create","workload":"memwrite","ws":"8M","mem":"64M","duration":600}),
    );
    assert_eq!(vm["ok"], true, "{vm}");
    let id = vm["id"].as_u64().unwrap();

    let e = oversized_client(&sock);
    assert!(e.contains("longer than 65536 bytes"), "{e}");
    host.assert_alive("one oversized request");
    assert_answers(&sock);
    assert_heartbeating(&sock, id);

    // Five at once.
    let clients: Vec<_> = (0..5)
        .map(|_| {
            let sock = sock.clone();
            std::thread::spawn(move || oversized_client(&sock))
        })
        .collect();
    for c in clients {
        let e = c.join().expect("an oversized client got its error");
        assert!(e.contains("longer than"), "{e}");
    }
    host.assert_alive("five concurrent oversized requests");
    assert_answers(&sock);
    assert_heartbeating(&sock, id);
    // The first connection, idle meanwhile, is still served.
    let l = send(&mut s, json!({"op":"list"}));
    assert_eq!(l["vms"][0]["state"], "running", "{l}");
}

#[test]
fn slow_request_is_cut_off_at_the_time_limit() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    let (mut host, _s) = HostProcess::start(&sock, &["--request-timeout", "1s"]);
    let mut s = UnixStream::connect(&sock).unwrap();
    let w = s.try_clone().unwrap();
    // One byte every 200 ms, never a newline: at most 50 bytes (10 s).
    let writer = std::thread::spawn(move || {
        let mut w = w;
        for b in b"{\"op\":\"list\"                                       ".iter().take(50) {
            if w.write_all(&[*b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    });
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let r = read_reply(&s).expect("a slow request gets an error line");
    let e = error_of(&r);
    assert!(e.contains("within 1.0 s"), "{e}");
    assert_closed(&mut s);
    writer.join().unwrap();
    host.assert_alive("a slow request");
    assert_answers(&sock);
}

#[test]
fn idle_connection_is_closed_with_a_reason() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    let (mut host, mut s) = HostProcess::start(&sock, &["--idle-timeout", "1s"]);
    // A request, then nothing: the idle limit counts between requests.
    assert_eq!(send(&mut s, json!({"op":"info"}))["ok"], true);
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let r = read_reply(&s).expect("an idle connection gets an error line");
    assert!(error_of(&r).contains("idle"), "{r}");
    assert_closed(&mut s);
    host.assert_alive("an idle connection");
    assert_answers(&sock);
}

#[test]
fn client_that_does_not_read_its_replies_is_cut_off() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    let (mut host, _s) = HostProcess::start(&sock, &["--request-timeout", "1s"]);
    let s = UnixStream::connect(&sock).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
    // Requests whose replies fill the socket's buffer: the host blocks
    // sending them until its time limit, then drops the connection.
    let mut w = &s;
    let line = format!("{}\n", json!({"op":"info"}));
    let mut ended = None;
    for _ in 0..200_000 {
        if let Err(e) = w.write_all(line.as_bytes()) {
            ended = Some(e.kind());
            break;
        }
    }
    // The host stopped reading (blocked on its replies), then gave up on
    // this client and closed the connection.
    assert!(
        matches!(ended, Some(std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset)),
        "the host did not close the connection: {ended:?}"
    );
    // Long past the hang watchdog's 300 ms and the 1 s limit.
    std::thread::sleep(Duration::from_millis(2500));
    host.assert_alive("a client that does not read its replies");
    assert_answers(&sock);
}

#[test]
fn connections_are_capped_and_the_extra_one_is_told_why() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    let (mut host, mut first) = HostProcess::start(&sock, &["--max-connections", "4"]);
    assert_eq!(send(&mut first, json!({"op":"info"}))["ok"], true);
    // Three more: four connections, each served.
    let mut open = vec![first];
    for _ in 0..3 {
        let mut s = UnixStream::connect(&sock).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        assert_eq!(send(&mut s, json!({"op":"info"}))["ok"], true);
        open.push(s);
    }
    // The fifth is refused with a reason, and closed.
    let mut extra = UnixStream::connect(&sock).unwrap();
    extra.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let r = read_reply(&extra).expect("the extra connection gets an error line");
    let e = error_of(&r);
    assert!(e.contains("too many connections") && e.contains('4'), "{e}");
    assert_closed(&mut extra);
    host.assert_alive("a refused connection");
    // The four are still served.
    for s in &mut open {
        assert_eq!(send(s, json!({"op":"info"}))["ok"], true);
    }
    // Closing one frees its slot (once the host sees it closed).
    drop(open.pop());
    let t = Instant::now();
    let mut served = false;
    for _ in 0..300 {
        let mut s = UnixStream::connect(&sock).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        writeln!(s, "{}", json!({"op":"list"})).unwrap_or_default();
        match read_reply(&s) {
            Some(r) if r["ok"] == true => {
                served = true;
                break;
            }
            Some(r) => assert!(error_of(&r).contains("too many connections"), "{r}"),
            None => {}
        }
        assert!(t.elapsed() < Duration::from_secs(30), "the freed slot is never reused");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(served, "the freed slot is never reused");
}

#[test]
fn create_is_admitted_against_the_memory_budget() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    let (mut host, mut s) = HostProcess::start(&sock, &["--mem-budget", "96M"]);
    let vm = json!({"op":"create","workload":"idle","mem":"64M","duration":600});
    let a = send(&mut s, vm.clone());
    assert_eq!(a["ok"], true, "{a}");
    // 64 + 64 MiB > 96 MiB.
    let e = error_of(&send(&mut s, vm.clone()));
    assert!(e.contains("budget") && e.contains("96 MiB"), "{e}");
    let l = send(&mut s, json!({"op":"list"}));
    assert_eq!(l["vms"].as_array().unwrap().len(), 1, "{l}");
    // Destroying the first frees its memory.
    assert_eq!(send(&mut s, json!({"op":"destroy","id":a["id"]}))["ok"], true);
    let b = send(&mut s, vm.clone());
    assert_eq!(b["ok"], true, "{b}");
    assert_eq!(send(&mut s, json!({"op":"destroy","id":b["id"]}))["ok"], true);

    // Concurrent creations cannot both pass: exactly one of four fits.
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (sock, vm) = (sock.clone(), vm.clone());
            std::thread::spawn(move || request(&sock, vm))
        })
        .collect();
    let replies: Vec<Value> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let ok = replies.iter().filter(|r| r["ok"] == true).count();
    assert_eq!(ok, 1, "{replies:?}");
    for r in replies.iter().filter(|r| r["ok"] != true) {
        assert!(error_of(r).contains("budget"), "{r}");
    }
    host.assert_alive("refused creations");
}

#[test]
fn by_default_a_vm_larger_than_the_host_memory_is_refused() {
    if !kvm_available() {
        return;
    }
    // Prerequisite of this test: 64 GiB (the largest VM) is more than this host has.
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let total_kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("MemTotal in /proc/meminfo");
    assert!(total_kib < 60 << 20, "this host has {total_kib} KiB; the test needs less than 60 GiB");
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    let (mut host, mut s) = HostProcess::start(&sock, &[]);
    let e = error_of(&send(&mut s, json!({"op":"create","workload":"idle","mem":"64G"})));
    assert!(e.contains("budget"), "{e}");
    let a = send(&mut s, json!({"op":"create","workload":"idle","mem":"64M","duration":600}));
    assert_eq!(a["ok"], true, "{a}");
    host.assert_alive("a refused creation");
}

#[test]
fn vcpu_counts_are_bounded() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    let (mut host, mut s) = HostProcess::start(&sock, &["--vcpu-budget", "3"]);
    let vm = |vcpus: u32| json!({"op":"create","workload":"idle","mem":"64M","vcpus":vcpus,"duration":600});
    for bad in [0, 33] {
        let e = error_of(&send(&mut s, vm(bad)));
        assert!(e.contains("out of range"), "vcpus {bad}: {e}");
    }
    let e = error_of(&send(&mut s, json!({"op":"create","vcpus":-1})));
    assert!(e.contains("vcpus"), "{e}");
    let a = send(&mut s, vm(2));
    assert_eq!(a["ok"], true, "{a}");
    // 2 + 2 > 3.
    let e = error_of(&send(&mut s, vm(2)));
    assert!(e.contains("vCPU") && e.contains("budget of 3"), "{e}");
    let b = send(&mut s, vm(1));
    assert_eq!(b["ok"], true, "{b}");
    assert_eq!(send(&mut s, json!({"op":"destroy","id":a["id"]}))["ok"], true);
    assert_eq!(send(&mut s, vm(2))["ok"], true);
    host.assert_alive("refused creations");
}

#[test]
fn bad_limit_options_are_refused() {
    for (args, needle) in [
        (vec!["host", "--api", "/nonexistent/x", "--max-connections", "0"], "max-connections"),
        (vec!["host", "--api", "/nonexistent/x", "--mem-budget", "12X"], "unknown unit"),
        (vec!["host", "--api", "/nonexistent/x", "--request-timeout", "0s"], "out of range"),
        (vec!["host", "--api", "/nonexistent/x", "--vcpu-budget", "0"], "vcpu-budget"),
    ] {
        assert_clean_error(&run_cli(&args), needle);
    }
}

#[test]
fn limits_carry_over_a_rejuvenation() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    let (mut child, mut s) = spawn_host_with(
        &sock,
        &[
            "--api-legacy",
            "--mem-budget",
            "96M",
            "--max-connections",
            "5",
            "--request-timeout",
            "2s",
        ],
    );
    let check = |sock: &Path| {
        let info = request(sock, json!({"op":"info"}));
        let l = &info["limits"];
        assert_eq!(l["mem_budget"], 96 << 20, "{info}");
        assert_eq!(l["max_connections"], 5, "{info}");
        assert_eq!(l["request_timeout"]["secs"], 2, "{info}");
        info
    };
    let vm = json!({"op":"create","workload":"idle","mem":"64M","duration":600});
    let a = send(&mut s, vm.clone());
    assert_eq!(a["ok"], true, "{a}");
    drop(s);
    let before = check(&sock);
    assert_eq!(before["committed"]["mem_bytes"], 64 << 20, "{before}");
    let o = run_cli(&["rejuvenate", "--api", sock.to_str().unwrap(), "--mode", "warm", "--json"]);
    assert!(o.status.success(), "rejuvenation failed: {}{}", stdout(&o), stderr(&o));
    // The new process serves with the same limits and counts the VM it took over.
    let after = check(&sock);
    assert_ne!(after["pid"], before["pid"], "{after}");
    assert_eq!(after["committed"]["mem_bytes"], 64 << 20, "{after}");
    let e = error_of(&request(&sock, vm));
    assert!(e.contains("96 MiB"), "{e}");
    stop_host(&sock, &mut child);
}

#[test]
fn limits_carry_over_a_microreboot() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    // Request 1: create; 2: the connection that reads it fails (SIGSEGV),
    // and the host microreboots in place.
    let child = ninelives()
        .args(["host", "--api", sock.to_str().unwrap(), "--recovery", "microreboot"])
        .args(["--mem-budget", "96M", "--max-connections", "5", "--api-legacy"])
        .env("NINELIVES_API_FAULT", "segv:2")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut host = HostProcess { child };
    let t = Instant::now();
    while UnixStream::connect(&sock).is_err() {
        host.assert_alive("starting");
        assert!(t.elapsed() < Duration::from_secs(20), "the host did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    let vm = json!({"op":"create","workload":"idle","mem":"64M","duration":600});
    assert_eq!(request(&sock, vm.clone())["ok"], true);
    // The failing request gets no answer.
    let mut s = UnixStream::connect(&sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    writeln!(s, "{}", json!({"op":"info"})).unwrap();
    assert!(read_reply(&s).is_none(), "the failed connection answered");
    // The rebooted process (generation 1) keeps the limits.
    let t = Instant::now();
    let info = loop {
        let mut s = UnixStream::connect(&sock).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let _ = writeln!(s, "{}", json!({"op":"info"}));
        if let Some(i) = read_reply(&s).filter(|i| i["generation"] == 1) {
            break i;
        }
        host.assert_alive("the microreboot");
        assert!(t.elapsed() < Duration::from_secs(30), "no microreboot");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(info["limits"]["mem_budget"], 96 << 20, "{info}");
    assert_eq!(info["limits"]["max_connections"], 5, "{info}");
    assert_eq!(info["committed"]["mem_bytes"], 64 << 20, "{info}");
    let e = error_of(&request(&sock, vm));
    assert!(e.contains("96 MiB"), "{e}");
}

/// The API authenticates its clients: the socket file is the host user's
/// alone, and a client of another user that reaches the socket anyway (its
/// mode widened here on purpose) is refused by its kernel-reported
/// credentials, with a reason, and never served.
#[test]
fn clients_of_other_users_are_refused() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    if !kvm_available() {
        return;
    }
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    assert_eq!(uid, 0, "this test acts as another user (nobody), which needs root");
    let dir = tempfile::tempdir().unwrap();
    // The other user must reach the socket's directory.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let sock = dir.path().join("api.sock");
    let (mut host, _s) = HostProcess::start(&sock, &[]);
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the API socket is the host user's alone");
    let as_nobody = || {
        ninelives()
            .uid(65534)
            .gid(65534)
            .args(["api", "--api", sock.to_str().unwrap(), r#"{"op":"list"}"#])
            .output()
            .unwrap()
    };
    // Through the file mode: the connection itself is refused.
    let o = as_nobody();
    assert!(!o.status.success(), "a client of another user was served: {}", stdout(&o));
    assert!(stderr(&o).contains("ermission denied"), "{}", stderr(&o));
    // With the file mode widened, the peer check still refuses, by name.
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o666)).unwrap();
    let o = as_nobody();
    assert!(!o.status.success(), "a client of another user was served: {}", stdout(&o));
    let all = format!("{}{}", stdout(&o), stderr(&o));
    assert!(all.contains("user 65534 may not use this host's API"), "{all}");
    host.assert_alive("refusing another user");
    assert_answers(&sock);
}
