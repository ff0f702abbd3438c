//! The host's HTTP API on its Unix socket: every route answers, errors have
//! their status, the event stream reports a VM's life, metrics are
//! Prometheus text, JSON lines still work on the same socket, and the
//! committed OpenAPI document is the one the code generates.

use crate::common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

/// Reads server-sent events until one of `kind` about VM `vm` (bounded).
fn wait_event(r: &mut BufReader<UnixStream>, kind: &str, vm: u64, seen: &mut Vec<String>) -> Value {
    let t = Instant::now();
    let mut event = String::new();
    while t.elapsed() < Duration::from_secs(60) {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap() == 0 {
            panic!("event stream ended; saw {seen:?}");
        }
        if let Some(k) = line.strip_prefix("event: ") {
            event = k.trim().to_string();
        } else if let Some(d) = line.strip_prefix("data: ") {
            let v: Value = serde_json::from_str(d).unwrap();
            seen.push(event.clone());
            if event == kind && v["data"]["vm"] == vm {
                return v;
            }
        }
    }
    panic!("no {kind} event for VM {vm} within 60 s; saw {seen:?}");
}

#[test]
fn the_http_api_serves_every_route_with_named_errors_events_and_metrics() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    let (mut child, _first) = spawn_host(&sock);

    // The event stream, opened before anything happens.
    let mut ev = UnixStream::connect(&sock).unwrap();
    ev.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(ev, "GET /v1/events HTTP/1.1\r\nHost: localhost\r\n\r\n").unwrap();
    let mut ev = BufReader::new(ev);
    let mut head = String::new();
    ev.read_line(&mut head).unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");

    let (st, info) = http_json(&sock, "GET", "/v1/info", None);
    assert_eq!(st, 200, "{info}");
    assert_eq!(info["pid"], child.id());

    let create = r#"{"workload":"compute","duration":1,"mem":"64M","seed":5}"#;
    let (st, c) = http_json(&sock, "POST", "/v1/vms", Some(create));
    assert_eq!(st, 201, "{c}");
    let id = c["id"].as_u64().unwrap();
    let mut seen = Vec::new();
    wait_event(&mut ev, "vm_created", id, &mut seen);

    let (st, l) = http_json(&sock, "GET", "/v1/vms", None);
    assert_eq!(st, 200);
    assert_eq!(l["vms"][0]["workload"], "compute", "names, not codes: {l}");

    let (st, _) =
        http_json(&sock, "PATCH", &format!("/v1/vms/{id}"), Some(r#"{"state":"paused"}"#));
    assert_eq!(st, 200);
    wait_event(&mut ev, "vm_paused", id, &mut seen);
    let (_, m) = http(&sock, "GET", "/metrics", None);
    assert!(m.contains(&format!("ninelives_vm_paused{{vm=\"{id}\"}} 1")), "{m}");
    assert!(m.contains("# TYPE ninelives_vcpu_exits_total counter"), "{m}");
    assert!(m.contains("ninelives_vms 1"), "{m}");
    let (st, _) =
        http_json(&sock, "PATCH", &format!("/v1/vms/{id}"), Some(r#"{"state":"running"}"#));
    assert_eq!(st, 200);
    wait_event(&mut ev, "vm_resumed", id, &mut seen);
    let ended = wait_event(&mut ev, "vm_ended", id, &mut seen);
    assert_eq!(ended["data"]["outcome"]["kind"], "completed", "{ended}");

    let (st, s) = http_json(&sock, "GET", &format!("/v1/vms/{id}"), None);
    assert_eq!(st, 200);
    let asked = json!({"kind": "compute", "seed": 5, "duration_ms": 1000, "vcpus": 1});
    assert_stats_replay(id, &asked, &s["stats"]);

    // The JSON-lines protocol of earlier releases is refused with its
    // reason (on a new connection: the one the helper opened at start was
    // once found closed here in CI, cause not yet known) ...
    let mut legacy = UnixStream::connect(&sock).unwrap();
    legacy.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    writeln!(legacy, "{}", json!({"op": "list"})).unwrap();
    let mut line = String::new();
    BufReader::new(legacy.try_clone().unwrap()).read_line(&mut line).unwrap();
    let v: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["ok"], false, "{v}");
    assert!(v["error"].as_str().unwrap().contains("--api-legacy"), "{v}");
    // ... and served, beside HTTP, by a host started with --api-legacy.
    let dir2 = tempfile::tempdir().unwrap();
    let sock2 = dir2.path().join("legacy.sock");
    let (mut legacy_host, mut l2) = spawn_host_with(&sock2, &["--api-legacy"]);
    writeln!(l2, "{}", json!({"op": "list"})).unwrap();
    let mut line = String::new();
    BufReader::new(l2.try_clone().unwrap()).read_line(&mut line).unwrap();
    let v: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(http_json(&sock2, "GET", "/v1/vms", None).0, 200);
    stop_host(&sock2, &mut legacy_host);

    // Named errors.
    let cases: &[(&str, &str, Option<&str>, u16, &str)] = &[
        ("GET", "/v1/vms/999", None, 404, "no such VM"),
        ("GET", "/v1/vms/abc", None, 404, "VM ids are numbers"),
        ("GET", "/v1/nothing", None, 404, "no such resource"),
        ("PUT", "/v1/vms", None, 405, "allowed: GET, POST"),
        ("POST", "/v1/vms", Some("{"), 400, "malformed JSON body"),
        ("POST", "/v1/vms", Some(r#"{"vcpus":0}"#), 400, "vcpus 0 is out of range"),
        ("POST", "/v1/vms", Some(r#"{"colour":"red"}"#), 400, "unknown field `colour`"),
        ("POST", "/v1/vms", Some(r#"{"mem":"60G"}"#), 409, "not enough guest memory"),
        ("PATCH", &format!("/v1/vms/{id}"), Some(r#"{"state":"gone"}"#), 400, "\"paused\""),
    ];
    for (m, p, b, want, needle) in cases {
        let (st, e) = http_json(&sock, m, p, *b);
        assert_eq!(st, *want, "{m} {p}: {e}");
        assert!(e["error"].as_str().unwrap().contains(needle), "{m} {p}: {e}");
    }
    // A body longer than the request limit is refused before it is read.
    let mut s = UnixStream::connect(&sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(s, "POST /v1/vms HTTP/1.1\r\nContent-Length: 100000\r\n\r\n").unwrap();
    let mut first = String::new();
    BufReader::new(s).read_line(&mut first).unwrap();
    assert!(first.starts_with("HTTP/1.1 413"), "{first}");

    let (st, _) = http_json(&sock, "DELETE", &format!("/v1/vms/{id}"), None);
    assert_eq!(st, 200);
    wait_event(&mut ev, "vm_destroyed", id, &mut seen);
    assert_eq!(http_json(&sock, "GET", &format!("/v1/vms/{id}"), None).0, 404);

    let (st, _) = http_json(&sock, "POST", "/v1/shutdown", None);
    assert_eq!(st, 200);
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() && t.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(child.try_wait().unwrap().is_some(), "the host did not stop");
}

#[test]
fn the_committed_openapi_document_is_the_generated_one() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/api.yaml");
    let text = std::fs::read_to_string(&path).expect("docs/api.yaml");
    let committed: Value =
        serde_json::from_str(&text).expect("docs/api.yaml is JSON (a YAML subset)");
    let generated = ninelives::openapi::document();
    assert!(
        committed == generated,
        "docs/api.yaml is stale: regenerate it with `ninelives api --openapi > docs/api.yaml`"
    );
    // Every route of the host is documented with its method, and nothing else is.
    let paths = generated["paths"].as_object().unwrap();
    let mut documented = 0;
    for r in nl_vmm::api::http::ROUTES {
        assert!(paths[r.path][r.method.to_lowercase()].is_object(), "{} {}", r.method, r.path);
        documented += 1;
    }
    let ops: usize = paths.values().map(|p| p.as_object().unwrap().len()).sum();
    assert_eq!(ops, documented);
    // The create body is the Rust type's: an unknown field is refused by both.
    let create = &generated["components"]["schemas"]["CreateVm"];
    assert_eq!(create["additionalProperties"], false);
    for field in ["workload", "mem", "vcpus", "duration", "ws", "net_tap", "disk"] {
        assert!(create["properties"][field].is_object(), "{field}");
    }
}

/// A connection the host refuses before reading it (over
/// `--max-connections`) is told why in HTTP, as curl expects: a 503 with
/// the reason, then the end of the connection; the API client reports it.
/// Once a slot is free, a new connection is served again.
#[test]
fn connections_over_the_limit_get_an_http_refusal() {
    if !kvm_available() {
        return;
    }
    use std::io::Read;
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    // The helper's own connection holds the one slot.
    let (mut child, held) = spawn_host_with(&sock, &["--max-connections", "1"]);
    // Bounded: the held connection is being served once a second one is refused.
    let mut reply = String::new();
    for _ in 0..100 {
        let mut s = UnixStream::connect(&sock).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let _ = write!(s, "GET /v1/info HTTP/1.1\r\nHost: localhost\r\n\r\n");
        reply.clear();
        let _ = s.read_to_string(&mut reply);
        if reply.starts_with("HTTP/1.1 503") {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(reply.starts_with("HTTP/1.1 503 Service Unavailable\r\n"), "{reply:?}");
    assert!(reply.contains("Connection: close\r\n"), "{reply:?}");
    let body: Value = serde_json::from_str(reply.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    assert!(body["error"].as_str().unwrap().contains("too many connections"), "{body}");
    let r = nl_vmm::api::request(&sock, &json!({"op": "info"})).unwrap();
    assert_eq!((r["ok"].clone(), r["status"].clone()), (json!(false), json!(503)), "{r}");

    drop(held);
    let mut served = None;
    for _ in 0..200 {
        match nl_vmm::api::request(&sock, &json!({"op": "info"})) {
            Ok(r) if r["ok"] == true => {
                served = Some(r);
                break;
            }
            _ => std::thread::sleep(Duration::from_millis(50)),
        }
    }
    assert!(served.is_some(), "no connection was served after the slot was freed");
    stop_host(&sock, &mut child);
}
