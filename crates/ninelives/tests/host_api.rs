//! `ninelives host`: several VMs driven over the Unix-socket API; malformed
//! requests get errors and the host keeps serving the other VMs.

use crate::common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::process::Child;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

struct HostProcess {
    child: Child,
}

impl Drop for HostProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn send_raw(s: &mut UnixStream, line: &[u8]) -> Value {
    s.write_all(line).unwrap();
    s.write_all(b"\n").unwrap();
    let mut r = String::new();
    BufReader::new(s.try_clone().unwrap()).read_line(&mut r).unwrap();
    serde_json::from_str(&r).unwrap_or_else(|e| panic!("reply is not JSON ({e}): {r}"))
}

fn send(s: &mut UnixStream, v: Value) -> Value {
    send_raw(s, v.to_string().as_bytes())
}

#[test]
fn host_serves_several_vms_and_survives_bad_requests() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    // This test drives the JSON-lines protocol (HTTP: tests/http_api.rs).
    let (child, mut s) = spawn_host_with(&sock, &["--api-legacy"]);
    let mut host = HostProcess { child };

    let a = send(&mut s, json!({"op":"create","workload":"idle","duration":600}));
    assert_eq!(a["ok"], true, "{a}");
    let b = send(
        &mut s,
        json!({"op":"create","workload":"memwrite","ws":"8M","mem":"64M","duration":600}),
    );
    assert_eq!(b["ok"], true, "{b}");
    let (ida, idb) = (a["id"].as_u64().unwrap(), b["id"].as_u64().unwrap());
    assert_ne!(ida, idb);

    // Malformed requests of every kind: each gets the error naming what
    // was wrong (not merely some error).
    for (bad, why) in [
        (&b"this is not json"[..], "malformed request"),
        (b"{\"no_op\":1}", "needs an \"op\" string"),
        (b"{\"op\":\"frobnicate\"}", "unknown op \"frobnicate\""),
        (b"{\"op\":\"pause\"}", "needs a numeric \"id\""),
        (b"{\"op\":\"pause\",\"id\":999}", "VM 999: no such VM"),
        (b"{\"op\":\"create\",\"mem\":\"1M\"}", "1048576 bytes is too small"),
        (b"{\"op\":\"create\",\"vcpus\":1000}", "vcpus 1000 is out of range"),
        (b"{\"op\":\"create\",\"bogus_field\":1}", "unknown field `bogus_field`"),
        (b"[1,2,3]", "needs an \"op\" string"),
    ] {
        let r = send_raw(&mut s, bad);
        assert_eq!(r["ok"], false, "{}: {r}", String::from_utf8_lossy(bad));
        let e = r["error"].as_str().unwrap_or_default();
        assert!(e.contains(why), "{}: expected '{why}' in: {r}", String::from_utf8_lossy(bad));
    }
    // An oversized request is refused and closes its connection (tests/api_limits.rs).
    {
        let mut s2 = UnixStream::connect(&sock).unwrap();
        s2.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let _ = s2.write_all(&vec![b'x'; 100 * 1024]);
        let mut r = String::new();
        BufReader::new(s2).read_line(&mut r).unwrap();
        let r: Value = serde_json::from_str(&r).unwrap();
        assert_eq!(r["ok"], false, "{r}");
        let e = r["error"].as_str().unwrap_or_default();
        assert!(e.contains("request longer than 65536 bytes"), "{r}");
    }

    // A second connection dropped mid-request does not disturb the host.
    {
        let mut s2 = UnixStream::connect(&sock).unwrap();
        s2.write_all(b"{\"op\":\"li").unwrap();
    }

    // The good VMs are still running, and respond to pause/resume/stats.
    let list = send(&mut s, json!({"op":"list"}));
    let vms = list["vms"].as_array().unwrap();
    assert_eq!(vms.len(), 2, "{list}");
    assert!(vms.iter().all(|v| v["state"] == "running"), "{list}");
    assert_eq!(send(&mut s, json!({"op":"pause","id":idb}))["ok"], true);
    let st = send(&mut s, json!({"op":"stats","id":idb}));
    assert_eq!(st["stats"]["state"], "paused", "{st}");
    assert_eq!(st["stats"]["paused"], true);
    assert_eq!(send(&mut s, json!({"op":"resume","id":idb}))["ok"], true);
    // The memwrite VM keeps heartbeating after resume.
    let beats = |s: &mut UnixStream| {
        send(s, json!({"op":"stats","id":idb}))["stats"]["vcpus"][0]["regs"]["beats"]
            .as_u64()
            .unwrap()
    };
    let before = beats(&mut s);
    let t = Instant::now();
    while beats(&mut s) == before {
        assert!(t.elapsed() < Duration::from_secs(30), "resumed VM does not heartbeat");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(send(&mut s, json!({"op":"destroy","id":ida}))["ok"], true);
    let again = send(&mut s, json!({"op":"destroy","id":ida}));
    assert_eq!(again["ok"], false, "{again}");
    let e = again["error"].as_str().unwrap_or_default();
    assert!(e.contains(&format!("VM {ida}: no such VM")), "a destroyed VM is gone: {again}");
    let list = send(&mut s, json!({"op":"list"}));
    assert_eq!(list["vms"].as_array().unwrap().len(), 1);

    // The CLI client speaks the same protocol.
    let o = run_cli(&["api", "--api", sock.to_str().unwrap(), "{\"op\":\"list\"}"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("\"vms\""));

    assert_eq!(send(&mut s, json!({"op":"shutdown"}))["ok"], true);
    let t = Instant::now();
    loop {
        if let Some(st) = host.child.try_wait().unwrap() {
            assert!(st.success());
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "host did not exit after shutdown");
        std::thread::sleep(Duration::from_millis(20));
    }
}
