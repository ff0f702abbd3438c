//! Sandbox sets on a running host (`/v1/sandboxes`): created beside an
//! ordinary VM, listed, inspected while running and after, refused with
//! the right status when the request is wrong, blocking a rejuvenation that
//! would lose them, and destroyed.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

fn pair_set(c0: usize, c1: usize) -> Value {
    json!({"sandboxes": [
        {"name": "a", "cores": [c0], "workload": {"kind": "chanbench", "seed": 5, "max_msg": 1024}},
        {"name": "b", "cores": [c1], "workload": {"kind": "chanbench", "seed": 5, "max_msg": 1024}}
    ], "channels": [{"name": "ab", "between": ["a", "b"]}]})
}

/// The report of set `pair` once it has ended (bounded), checking each
/// running state on the way; every sandbox must have completed, verified.
fn wait_ended(sock: &std::path::Path, running: impl Fn(&Value)) -> Value {
    let t = Instant::now();
    let report = loop {
        let (st, v) = http_json(sock, "GET", "/v1/sandboxes/pair", None);
        assert_eq!(st, 200, "{v}");
        if v["state"] == "ended" {
            break v["report"].clone();
        }
        running(&v);
        assert!(t.elapsed() < Duration::from_secs(120), "the set never ended: {v}");
        std::thread::sleep(Duration::from_millis(200));
    };
    for s in report["sandboxes"].as_array().unwrap() {
        assert_eq!(s["outcome"]["kind"], "completed", "{s}");
        assert_eq!(s["verified"], true, "{s}");
    }
    report
}

#[test]
fn a_host_runs_sandbox_sets_beside_its_vms() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    let (mut child, _s) = spawn_host(&sock);
    let cores = nl_sandbox::affinity::host_cores().expect("affinity");
    let (c0, c1) = (cores[0], *cores.last().unwrap());

    let (st, vm) = http_json(&sock, "POST", "/v1/vms", Some(r#"{"workload":"idle","mem":"64M"}"#));
    assert_eq!(st, 201, "{vm}");
    let body = json!({"name": "pair", "set": pair_set(c0, c1)}).to_string();
    let (st, v) = http_json(&sock, "POST", "/v1/sandboxes", Some(&body));
    assert_eq!(st, 201, "{v}");
    assert_eq!(v["sandboxes"], json!(["a", "b"]), "{v}");

    // Wrong requests, each with its status and reason.
    let cases: [(&str, &str, Option<String>, u16, &str); 6] = [
        ("POST", "/v1/sandboxes", Some(body.clone()), 409, "named 'pair' exists"),
        (
            "POST",
            "/v1/sandboxes",
            Some(r#"{"name":"a b","set":{}}"#.into()),
            400,
            "must be 1 to 64",
        ),
        ("POST", "/v1/sandboxes", Some(r#"{"name":"x"}"#.into()), 400, "needs a \"set\""),
        (
            "POST",
            "/v1/sandboxes",
            Some(format!(
                r#"{{"name":"huge","set":{{"sandboxes":[{{"name":"h","cores":[{c0}],"mem_mib":{},"workload":{{"kind":"chanbench"}}}}]}}}}"#,
                u64::MAX
            )),
            409,
            "of the host's",
        ),
        ("GET", "/v1/sandboxes/nope", None, 404, "no such sandbox set 'nope'"),
        ("POST", "/v1/rejuvenate", Some(r#"{"mode":"warm"}"#.into()), 409, "sandbox set(s) pair"),
    ];
    for (method, path, body, status, needle) in &cases {
        let (st, v) = http_json(&sock, method, path, body.as_deref());
        assert_eq!(st, *status, "{method} {path}: {v}");
        assert!(v["error"].as_str().unwrap_or("").contains(needle), "{method} {path}: {v}");
    }

    let (_, list) = http_json(&sock, "GET", "/v1/sandboxes", None);
    assert_eq!(list["sets"][0]["name"], "pair", "{list}");
    // Running: live per-sandbox and per-channel statistics; then the report.
    wait_ended(&sock, |v| {
        assert_eq!(v["sandbox_stats"].as_array().map(Vec::len), Some(2), "{v}");
        assert_eq!(v["channel_stats"][0]["between"], json!(["a", "b"]), "{v}");
    });
    // The ordinary VM ran on, untouched.
    let (_, vms) = http_json(&sock, "GET", "/v1/vms", None);
    assert_eq!(vms["vms"][0]["state"], "running", "{vms}");

    let (st, v) = http_json(&sock, "DELETE", "/v1/sandboxes/pair", None);
    assert_eq!(st, 200, "{v}");
    let (_, list) = http_json(&sock, "GET", "/v1/sandboxes", None);
    assert_eq!(list["sets"], json!([]), "{list}");
    let (st, _) = http_json(&sock, "DELETE", "/v1/sandboxes/pair", None);
    assert_eq!(st, 404);
    stop_host(&sock, &mut child);
}

/// A VMM fault while serving the host API, recovered by a microreset, leaves
/// a running sandbox set and its channel alone: the set keeps running
/// through the recovery, and its sandboxes finish with their channel
/// traffic verified.
#[test]
fn a_microreset_of_the_host_keeps_its_sandbox_sets_running() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    // Request 1 creates the set, 2 reads its stats, and the connection that
    // reads request 3 faults (SIGSEGV); the host recovers by a microreset.
    let mut child = ninelives()
        .args(["host", "--api", sock.to_str().unwrap(), "--recovery", "microreset"])
        .env("NINELIVES_API_FAULT", "segv:3")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
        assert!(child.try_wait().unwrap().is_none(), "the host exited");
        assert!(t.elapsed() < Duration::from_secs(20), "the host did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    let cores = nl_sandbox::affinity::host_cores().expect("affinity");
    let (c0, c1) = (cores[0], *cores.last().unwrap());
    let body = json!({"name": "pair", "set": pair_set(c0, c1)}).to_string();
    let (st, v) = http_json(&sock, "POST", "/v1/sandboxes", Some(&body));
    assert_eq!(st, 201, "{v}");
    let (st, before) = http_json(&sock, "GET", "/v1/sandboxes/pair", None);
    assert_eq!(st, 200, "{before}");
    assert_eq!(before["state"], "running", "the set ended before the fault: {before}");
    // Request 3: its connection fails; no answer comes back on it.
    let r = nl_vmm::api::request_timeout(
        &sock,
        &json!({"op": "sandbox_list"}),
        Duration::from_secs(30),
    );
    assert!(
        r.is_err() || r.as_ref().unwrap()["ok"] != true,
        "the faulting request was answered: {r:?}"
    );
    // The same process serves on (a microreset, not a restart), and the set
    // ran through the recovery to a verified end.
    let (_, info) = http_json(&sock, "GET", "/v1/info", None);
    assert_eq!(info["pid"], child.id(), "{info}");
    let report = wait_ended(&sock, |_| {});
    for s in report["sandboxes"].as_array().unwrap() {
        assert!(s["recoveries"].as_array().is_none_or(Vec::is_empty), "{s}");
    }
    for r in report["channels"][0]["regions"].as_array().unwrap() {
        assert!(r["head_words"].as_u64().unwrap() > 0, "no traffic on the channel: {report}");
    }
    stop_host(&sock, &mut child);
    let err = {
        use std::io::Read;
        let mut e = String::new();
        child.stderr.take().unwrap().read_to_string(&mut e).unwrap();
        e
    };
    assert_eq!(err.matches("NINELIVES-DETECTED").count(), 1, "{err}");
    assert_eq!(err.matches("NINELIVES-RECOVERED").count(), 1, "{err}");
}
