//! Sandbox sets on a running host (`/v1/sandboxes`): created beside an
//! ordinary VM, listed, inspected while running and after, refused with
//! the right status when the request is wrong, destroyed, and carried
//! through a microreset, warm rejuvenations and a microreboot of the host
//! (channels, TAPs, services, shared links, state regions).

use crate::common;

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
    let _one_at_a_time = common::pace_sensitive();
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    let (mut child, _s) = spawn_host(&sock);
    let _end = EndHostOnDrop(sock.to_path_buf());
    let cores = nl_sandbox::affinity::host_cores().expect("affinity");
    let (c0, c1) = (cores[0], *cores.last().unwrap());

    let (st, vm) = http_json(&sock, "POST", "/v1/vms", Some(r#"{"workload":"idle","mem":"64M"}"#));
    assert_eq!(st, 201, "{vm}");
    // Sandbox a has a reserved budget (5 ms of every 10 ms, SCHED_FIFO
    // vCPU threads switched by a reserve thread of the host's, under its
    // seccomp filter), shown in its stats.
    let mut set = pair_set(c0, c1);
    set["sandboxes"][0]["budget"] =
        json!({"runtime_us": 5000, "period_us": 10000, "reserve": true});
    let body = json!({"name": "pair", "set": set}).to_string();
    let (st, v) = http_json(&sock, "POST", "/v1/sandboxes", Some(&body));
    assert_eq!(st, 201, "{v}");
    assert_eq!(v["sandboxes"], json!(["a", "b"]), "{v}");

    // Wrong requests, each with its status and reason.
    let cases: [(&str, &str, Option<String>, u16, &str); 5] = [
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
    ];
    for (method, path, body, status, needle) in &cases {
        let (st, v) = http_json(&sock, method, path, body.as_deref());
        assert_eq!(st, *status, "{method} {path}: {v}");
        assert!(v["error"].as_str().unwrap_or("").contains(needle), "{method} {path}: {v}");
    }

    let (_, list) = http_json(&sock, "GET", "/v1/sandboxes", None);
    assert_eq!(list["sets"][0]["name"], "pair", "{list}");
    // Running: live per-sandbox and per-channel statistics; then the report.
    let report = wait_ended(&sock, |v| {
        assert_eq!(v["sandbox_stats"].as_array().map(Vec::len), Some(2), "{v}");
        assert_eq!(v["channel_stats"][0]["between"], json!(["a", "b"]), "{v}");
        // The budget's counters while it runs (none for b, without one).
        assert!(v["sandbox_stats"][0]["throttling"]["periods"].is_u64(), "{v}");
        assert!(v["sandbox_stats"][1]["throttling"].is_null(), "{v}");
    });
    // The reservation's windows, by the host's account (a reserved budget
    // runs its vCPU threads as SCHED_FIFO in its windows: the CFS counters
    // may stay 0).
    let reserved = &report["sandboxes"][0]["throttling"]["reserved"];
    assert!(reserved["periods"].as_u64() > Some(0), "{report}");
    assert!(reserved["met"].as_u64() > Some(0), "{report}");
    // The ordinary VM ran on, untouched.
    let (_, vms) = http_json(&sock, "GET", "/v1/vms", None);
    assert_eq!(vms["vms"][0]["state"], "running", "{vms}");

    let cgroup = format!("/sys/fs/cgroup/cpu/ninelives-{}-a", child.id());
    assert!(std::path::Path::new(&cgroup).exists(), "no budget cgroup {cgroup}");
    let (st, v) = http_json(&sock, "DELETE", "/v1/sandboxes/pair", None);
    assert_eq!(st, 200, "{v}");
    // The budget's cgroup went with the set (removed on the API thread).
    assert!(!std::path::Path::new(&cgroup).exists(), "{cgroup} is still there");
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
    let _end = EndHostOnDrop(sock.to_path_buf());
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

/// A pair streaming messages to each other over one channel for
/// `duration_ms` of guest time (every byte and sequence number checked by
/// the receiver).
fn stream_set(c0: usize, c1: usize, duration_ms: u64) -> Value {
    let w = json!({"kind": "chanstream", "duration_ms": duration_ms, "send_every_us": 500});
    json!({"sandboxes": [
        {"name": "a", "cores": [c0], "mem_mib": 48, "workload": w},
        {"name": "b", "cores": [c1], "mem_mib": 48, "workload": w}
    ], "channels": [{"name": "ab", "between": ["a", "b"]}]})
}

/// The channel's (generation, head words) of both regions, while the set
/// runs.
fn channel_now(sock: &std::path::Path) -> [(u64, u64); 2] {
    let (st, v) = http_json(sock, "GET", "/v1/sandboxes/pair", None);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["state"], "running", "the set ended too early: {v}");
    let r = &v["channel_stats"][0]["regions"];
    let get =
        |i: usize| (r[i]["generation"].as_u64().unwrap(), r[i]["head_words"].as_u64().unwrap());
    [get(0), get(1)]
}

/// Waits (bounded) until both ends publish past `heads`, checking the
/// generations stay `gens`; returns the heads seen.
fn wait_traffic(
    sock: &std::path::Path,
    gens: Option<[u64; 2]>,
    heads: [u64; 2],
) -> [(u64, u64); 2] {
    let t = Instant::now();
    loop {
        let now = channel_now(sock);
        if let Some(g) = gens {
            assert_eq!([now[0].0, now[1].0], g, "a channel generation changed: a resync");
        }
        if now[0].0 != 0 && now[1].0 != 0 && now[0].1 > heads[0] && now[1].1 > heads[1] {
            return now;
        }
        assert!(t.elapsed() < Duration::from_secs(120), "no traffic past {heads:?}: {now:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn vm_beats(sock: &std::path::Path, id: u64) -> u64 {
    let (st, v) = http_json(sock, "GET", &format!("/v1/vms/{id}"), None);
    assert_eq!(st, 200, "{v}");
    let v = &v["stats"];
    assert_eq!(v["state"], "running", "{v}");
    v["vcpus"].as_array().unwrap().iter().map(|c| c["regs"]["beats"].as_u64().unwrap()).sum()
}

fn median_spread(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

/// Warm rejuvenation carries a running sandbox set: three times over the
/// HTTP API while a pair streams over its channel beside an ordinary VM,
/// the new process takes the set over (same memfds, vCPU and device state,
/// channel regions untouched: no generation change), the traffic goes on
/// past each handover, and both sandboxes end completed with every message
/// checked; the ordinary VM runs on. Prints the sets' downtime per
/// handover (median and spread over the three, with the load average).
#[test]
fn warm_rejuvenation_carries_a_running_sandbox_set() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    let (mut child, _s) = spawn_host(&sock);
    let _end = EndHostOnDrop(sock.to_path_buf());
    let [c0, c1] = two_cores();
    let (st, vm) = http_json(&sock, "POST", "/v1/vms", Some(r#"{"workload":"idle","mem":"64M"}"#));
    assert_eq!(st, 201, "{vm}");
    let vm_id = vm["id"].as_u64().unwrap();
    let body =
        json!({"name": "pair", "set": stream_set(c0, c1, 45_000), "timeout_secs": 300}).to_string();
    let (st, v) = http_json(&sock, "POST", "/v1/sandboxes", Some(&body));
    assert_eq!(st, 201, "{v}");
    let first = wait_traffic(&sock, None, [0, 0]);
    let gens = [first[0].0, first[1].0];
    let mut pid = child.id() as u64;
    let mut downtimes = Vec::new();
    for round in 1..=3u64 {
        let before = channel_now(&sock);
        let beats = vm_beats(&sock, vm_id);
        let (st, r) = http_json(&sock, "POST", "/v1/rejuvenate", Some(r#"{"mode":"warm"}"#));
        assert_eq!(st, 200, "{r}");
        let rep = &r["report"];
        assert_eq!(rep["ok"], true, "round {round}: {r}");
        assert_eq!(rep["sets"], json!(["pair"]), "{r}");
        downtimes.push(rep["sets_downtime_ms"].as_f64().expect("the sets' downtime"));
        let (_, info) = http_json(&sock, "GET", "/v1/info", None);
        let new_pid = info["pid"].as_u64().unwrap();
        assert_ne!(new_pid, pid, "a new process serves");
        pid = new_pid;
        // The same set, listed and carried; its channel where it was.
        let (_, list) = http_json(&sock, "GET", "/v1/sandboxes", None);
        assert_eq!(list["sets"][0]["name"], "pair", "{list}");
        assert_eq!(list["sets"][0]["handovers"], round, "{list}");
        let after = channel_now(&sock);
        for i in 0..2 {
            assert_eq!(after[i].0, gens[i], "round {round}: region {i} generation changed");
            assert!(after[i].1 >= before[i].1, "round {round}: region {i} head went back");
        }
        // Traffic flows on in the new process, with no resync.
        wait_traffic(&sock, Some(gens), [after[0].1, after[1].1]);
        // The ordinary VM was carried too and runs on.
        let t = Instant::now();
        while vm_beats(&sock, vm_id) <= beats {
            assert!(t.elapsed() < Duration::from_secs(60), "VM {vm_id} stopped beating");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let report = wait_ended(&sock, |_| {});
    for (i, r) in report["channels"][0]["regions"].as_array().unwrap().iter().enumerate() {
        assert_eq!(r["generation"].as_u64(), Some(gens[i]), "{report}");
    }
    let (m, lo, hi) = median_spread(downtimes.clone());
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "sandbox set carried by warm rejuvenation: set downtime median {m:.1} ms \
         (min {lo:.1}, max {hi:.1}) over {} handovers {downtimes:?}; loadavg {}",
        downtimes.len(),
        load.trim()
    );
    stop_host(&sock, &mut child);
}

/// A microreboot (a fault in the VMM, the process exec'd afresh in place)
/// carries a running sandbox set the same way: the same process id serves
/// on, the set is listed with its channel untouched, its traffic goes on
/// and both sandboxes end completed and verified; the ordinary VM runs on.
#[test]
fn a_microreboot_of_the_host_carries_its_sandbox_sets() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    // The connection reading request FAULT_AT faults (SIGSEGV); the host
    // recovers by a microreboot. Requests before it: 2 creates, then
    // polls of the set until it streams, then harmless `info`s.
    const FAULT_AT: usize = 60;
    let (mut child, vm_id, before, mut sent) =
        host_with_a_streaming_set(&sock, FAULT_AT, &[], 8_000, FAULT_AT - 2);
    let _end = EndHostOnDrop(sock.to_path_buf());
    let beats = vm_beats(&sock, vm_id);
    sent += 1;
    while sent < FAULT_AT - 1 {
        let (st, _) = http_json(&sock, "GET", "/v1/info", None);
        assert_eq!(st, 200);
        sent += 1;
    }
    // Request FAULT_AT: its connection fails; the host microreboots.
    let r = nl_vmm::api::request_timeout(&sock, &json!({"op": "info"}), Duration::from_secs(30));
    assert!(
        r.is_err() || r.as_ref().unwrap()["ok"] != true,
        "the faulting request was answered: {r:?}"
    );
    // The fresh process (same pid, the host's generation 1: the old
    // process may answer a little longer) serves with the set carried over.
    let t = Instant::now();
    loop {
        let info =
            nl_vmm::api::request_timeout(&sock, &json!({"op": "info"}), Duration::from_secs(30));
        if let Ok(v) = info {
            if v["generation"] == 1 {
                assert_eq!(v["pid"], child.id(), "{v}");
                break;
            }
        }
        assert!(child.try_wait().unwrap().is_none(), "the host died");
        assert!(t.elapsed() < Duration::from_secs(60), "the host did not serve again");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (_, list) = http_json(&sock, "GET", "/v1/sandboxes", None);
    assert_eq!(list["sets"][0]["name"], "pair", "{list}");
    assert_eq!(list["sets"][0]["handovers"], 1, "{list}");
    let gens = [before[0].0, before[1].0];
    let after = channel_now(&sock);
    assert_eq!([after[0].0, after[1].0], gens, "a channel generation changed");
    wait_traffic(&sock, Some(gens), [after[0].1, after[1].1]);
    let t = Instant::now();
    while vm_beats(&sock, vm_id) <= beats {
        assert!(t.elapsed() < Duration::from_secs(60), "VM {vm_id} stopped beating");
        std::thread::sleep(Duration::from_millis(50));
    }
    let report = wait_ended(&sock, |_| {});
    for (i, r) in report["channels"][0]["regions"].as_array().unwrap().iter().enumerate() {
        assert_eq!(r["generation"].as_u64(), Some(gens[i]), "{report}");
    }
    stop_host(&sock, &mut child);
    let err = {
        use std::io::Read;
        let mut e = String::new();
        child.stderr.take().unwrap().read_to_string(&mut e).unwrap();
        e
    };
    let line = err
        .lines()
        .find(|l| l.starts_with("NINELIVES-RECOVERED "))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(line.contains("\"policy\":\"microreboot\"") && line.contains("\"sets\":1"), "{line}");
}

/// Pads the API's request count up to `at - 1` with harmless requests
/// (the fault armed for request `at` then hits the next one).
fn pad_requests(sock: &std::path::Path, sent: &mut usize, at: usize) {
    assert!(*sent < at, "{sent} requests sent, the fault is armed for request {at}");
    while *sent < at - 1 {
        let (st, _) = http_json(sock, "GET", "/v1/info", None);
        assert_eq!(st, 200);
        *sent += 1;
    }
}

/// A corrupt set record is refused with a clear error, and the rest of the
/// host comes up: the new process of a warm rejuvenation refuses the whole
/// handover (the old process keeps the set and its VM running, traffic
/// and all); after a microreboot, which has no way back, the set is
/// reported and left out while the host and its VM serve on. The fault
/// point `NINELIVES_HANDOVER_SELFTEST=corrupt-sets` corrupts every set
/// record the new process reads.
#[test]
fn a_corrupt_set_record_is_refused_and_the_rest_of_the_host_comes_up() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    const FAULT_AT: usize = 80;
    let corrupt = [("NINELIVES_HANDOVER_SELFTEST", "corrupt-sets")];
    let (mut child, vm_id, before, mut sent) =
        host_with_a_streaming_set(&sock, FAULT_AT, &corrupt, 0, FAULT_AT / 2);
    let _end = EndHostOnDrop(sock.to_path_buf());
    let gens = [before[0].0, before[1].0];
    // Warm: the new process refuses; everything runs on in this one.
    let (st, r) = http_json(&sock, "POST", "/v1/rejuvenate", Some(r#"{"mode":"warm"}"#));
    sent += 1;
    assert_eq!(st, 200, "{r}");
    let rep = &r["report"];
    assert_eq!(rep["ok"], false, "{r}");
    assert_eq!(rep["rolled_back"], true, "{r}");
    let e = rep["error"].as_str().unwrap_or("");
    assert!(e.contains("sandbox set record 'pair' refused: corrupt"), "{e}");
    let (_, info) = http_json(&sock, "GET", "/v1/info", None);
    sent += 1;
    assert_eq!(info["pid"], child.id(), "{info}");
    let after = channel_now(&sock);
    sent += 1;
    assert_eq!([after[0].0, after[1].0], gens, "{after:?}");
    // Traffic goes on in this process (every poll counted: the fault is
    // armed by request number).
    loop {
        let now = channel_now(&sock);
        sent += 1;
        assert_eq!([now[0].0, now[1].0], gens, "{now:?}");
        if now[0].1 > after[0].1 && now[1].1 > after[1].1 {
            break;
        }
        assert!(sent < FAULT_AT - 5, "no traffic after the refused handover: {now:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let beats = vm_beats(&sock, vm_id);
    sent += 1;
    pad_requests(&sock, &mut sent, FAULT_AT);
    // Request FAULT_AT faults: a microreboot, whose new process refuses the
    // (corrupted) set record and comes up with the VM.
    let r = nl_vmm::api::request_timeout(&sock, &json!({"op": "info"}), Duration::from_secs(30));
    assert!(
        r.is_err() || r.as_ref().unwrap()["ok"] != true,
        "the faulting request was answered: {r:?}"
    );
    let t = Instant::now();
    loop {
        let info =
            nl_vmm::api::request_timeout(&sock, &json!({"op": "info"}), Duration::from_secs(30));
        if info.as_ref().is_ok_and(|v| v["generation"] == 1) {
            break;
        }
        assert!(child.try_wait().unwrap().is_none(), "the host died");
        assert!(t.elapsed() < Duration::from_secs(60), "the host did not serve again");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (_, list) = http_json(&sock, "GET", "/v1/sandboxes", None);
    assert_eq!(list["sets"], json!([]), "the corrupt set was not left out: {list}");
    let t = Instant::now();
    while vm_beats(&sock, vm_id) <= beats {
        assert!(t.elapsed() < Duration::from_secs(60), "VM {vm_id} stopped beating");
        std::thread::sleep(Duration::from_millis(50));
    }
    stop_host(&sock, &mut child);
    let err = {
        use std::io::Read;
        let mut e = String::new();
        child.stderr.take().unwrap().read_to_string(&mut e).unwrap();
        e
    };
    let line = err
        .lines()
        .find(|l| l.starts_with("NINELIVES-RECOVERED "))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(
        line.contains("\"sets\":0") && line.contains("sandbox set record 'pair' refused: corrupt"),
        "{line}"
    );
}

/// A host started with `--recovery microreboot` whose API connection
/// reading request `fault_at` faults (SIGSEGV), with `env` set, holding an
/// idle VM and a streaming two-sandbox set `pair` (`stream_ms`: the
/// stream's duration, 0 until stopped). Returns the host, the VM's id, the
/// channels once both carry traffic, and the requests sent so far (at
/// most `max_polls` before the set streams).
fn host_with_a_streaming_set(
    sock: &std::path::Path,
    fault_at: usize,
    env: &[(&str, &str)],
    stream_ms: u64,
    max_polls: usize,
) -> (std::process::Child, u64, [(u64, u64); 2], usize) {
    let mut child = ninelives()
        .args(["host", "--api", sock.to_str().unwrap(), "--recovery", "microreboot"])
        .env("NINELIVES_API_FAULT", format!("segv:{fault_at}"))
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while std::os::unix::net::UnixStream::connect(sock).is_err() {
        assert!(child.try_wait().unwrap().is_none(), "the host exited");
        assert!(t.elapsed() < Duration::from_secs(20), "the host did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    let [c0, c1] = two_cores();
    let (st, vm) = http_json(sock, "POST", "/v1/vms", Some(r#"{"workload":"idle","mem":"64M"}"#));
    assert_eq!(st, 201, "{vm}");
    let vm_id = vm["id"].as_u64().unwrap();
    let body = json!({"name": "pair", "set": stream_set(c0, c1, stream_ms), "timeout_secs": 300})
        .to_string();
    let (st, v) = http_json(sock, "POST", "/v1/sandboxes", Some(&body));
    assert_eq!(st, 201, "{v}");
    let mut sent = 2;
    let before = loop {
        let now = channel_now(sock);
        sent += 1;
        if now[0].1 > 0 && now[1].1 > 0 {
            break now;
        }
        assert!(sent < max_polls, "the set did not stream before the fault: {now:?}");
        std::thread::sleep(Duration::from_millis(500));
    };
    (child, vm_id, before, sent)
}

/// A sandbox with a TAP of its own is carried by warm rejuvenation: twice,
/// with a 1 ms ping running across each handover, the new process takes
/// the set over with the TAP descriptor it inherited (re-opening the TAP by
/// name would fail while the old process still holds it), the sandbox
/// answers the same pinger after each, and the set is listed as carried.
/// Prints each handover's longest ping gap and the set's downtime.
#[test]
fn warm_rejuvenation_carries_a_sandbox_with_its_own_tap() {
    if !kvm_available() {
        return;
    }
    let Some(mut h) = NsHost::start("sbxtap", Host::Plain) else { return };
    let [c0, _] = two_cores();
    let set = json!({"sandboxes": [
        {"name": "web", "cores": [c0], "mem_mib": 48,
         "workload": {"kind": "netbench", "duration_ms": 0},
         "net": {"tap": "nltap0", "mac": "52:54:00:5a:00:02", "ipv4": "10.0.0.2/24"}}
    ]});
    let body = json!({"name": "web", "set": set, "timeout_secs": 300}).to_string();
    h.create(&body);
    assert!(h.ns.wait_answering(Duration::from_secs(60)), "the sandbox never answered");
    let mut pid = http_json(&h.sock, "GET", "/v1/info", None).1["pid"].as_u64().unwrap();
    for round in 1..=2u64 {
        let ping = start_ping(&h.ns);
        std::thread::sleep(Duration::from_millis(300));
        let (st, r) = http_json(&h.sock, "POST", "/v1/rejuvenate", Some(r#"{"mode":"warm"}"#));
        assert_eq!(st, 200, "{r}");
        assert_eq!(r["report"]["ok"], true, "round {round}: {r}");
        assert_eq!(r["report"]["sets"], json!(["web"]), "{r}");
        let new_pid = http_json(&h.sock, "GET", "/v1/info", None).1["pid"].as_u64().unwrap();
        assert_ne!(new_pid, pid, "round {round}: a new process serves");
        pid = new_pid;
        let (_, list) = http_json(&h.sock, "GET", "/v1/sandboxes", None);
        assert_eq!(list["sets"][0]["name"], "web", "{list}");
        assert_eq!(list["sets"][0]["handovers"], round, "{list}");
        let j = ping_report(ping);
        assert!(h.ns.wait_answering(Duration::from_secs(30)), "round {round}: no answer after it");
        eprintln!(
            "round {round}: ping sent {} received {} longest gap {} ms; set downtime {} ms",
            j["sent"], j["received"], j["longest_gap_ms"], r["report"]["sets_downtime_ms"]
        );
    }
    let (st, v) = http_json(&h.sock, "GET", "/v1/sandboxes/web", None);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["state"], "running", "{v}");
    stop_host(&h.sock, &mut h.child);
}

/// `POST /v1/sandboxes` of set `lan`: a `demux` link on TAP nltap0 (the
/// namespace's, 10.0.0.1/24) with netbench sandboxes a (10.0.0.2) and b
/// (10.0.0.3) on it.
fn link_set_body(c0: usize, c1: usize) -> String {
    let member = |name: &str, core: usize, last: u8| {
        json!({"name": name, "cores": [core], "mem_mib": 48,
               "workload": {"kind": "netbench", "duration_ms": 0},
               "net": {"link": "lan", "mac": format!("52:54:00:5a:00:{last:02x}"),
                       "ipv4": format!("10.0.0.{last}/24")}})
    };
    let set = json!({"links": [{"name": "lan", "tap": "nltap0", "mode": "demux"}],
                     "sandboxes": [member("a", c0, 2), member("b", c1, 3)]});
    json!({"name": "lan", "set": set, "timeout_secs": 600}).to_string()
}

/// Set `lan`'s link counters and its two sandboxes' device counters now.
fn link_now(sock: &std::path::Path) -> (Value, [Value; 2]) {
    let (st, v) = http_json(sock, "GET", "/v1/sandboxes/lan", None);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["state"], "running", "the set ended: {v}");
    let net = |i: usize| v["sandbox_stats"][i]["net"].clone();
    (v["link_stats"][0].clone(), [net(0), net(1)])
}

fn count(v: &Value, path: &[&str]) -> u64 {
    let mut v = v;
    for k in path {
        v = match k.parse::<usize>() {
            Ok(i) => &v[i],
            Err(_) => &v[*k],
        };
    }
    v.as_u64().unwrap_or_else(|| panic!("no count at {path:?}"))
}

/// TAP nltap0's transmit drops (`/proc/net/dev` in namespace `ns`): with
/// a link's drop-all filter on the TAP, every frame the host sends out of
/// it counts there (nobody reads the TAP's own queue).
fn tap_tx_dropped(ns: &Netns) -> u64 {
    let o = ns.0.command("cat").unwrap().arg("/proc/net/dev").output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    let line = text
        .lines()
        .find_map(|l| l.trim_start().strip_prefix("nltap0:"))
        .unwrap_or_else(|| panic!("no nltap0 in {text}"));
    // Receive: bytes packets errs drop fifo frame compressed multicast;
    // transmit: bytes packets errs drop ...
    line.split_whitespace().nth(11).and_then(|n| n.parse().ok()).expect("a drop count")
}

/// `ninelives ping` of `ip` from namespace `ns` every `interval` for
/// `secs` seconds: its JSON report.
fn ping_at(ns: &Netns, ip: &str, interval: &str, secs: &str) -> Value {
    let c = ns
        .ninelives(&["ping", "--target", ip, "--interval", interval, "--duration", secs, "--json"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    ping_report(c)
}

/// Pings each member of set `lan` in turn (every 5 ms for 1 s) and checks
/// with the link's and the devices' counters that only the member pinged
/// got the pings: its socket delivered and its device received at least
/// the pings answered, the other member's under 50 frames (the host's
/// broadcasts: ARP), no member dropped or was offered a foreign frame
/// meanwhile; and that the TAP's transmit drops grow by at least the pings
/// (weak: once the TAP's unread queue is full, tun drops and counts every
/// frame without the drop-all filter too).
fn check_each_member_gets_only_its_own_frames(ns: &Netns, sock: &std::path::Path) {
    for (who, other, ip) in [(0, 1, "10.0.0.2"), (1, 0, "10.0.0.3")] {
        let (l0, n0) = link_now(sock);
        let d0 = tap_tx_dropped(ns);
        let p = ping_at(ns, ip, "5ms", "1");
        let answered = count(&p, &["received"]);
        assert!(answered > 100, "{ip} answered {answered} of 200: {p}");
        let (l1, n1) = link_now(sock);
        let d1 = tap_tx_dropped(ns);
        let state =
            format!("{ip}: link before {l0}, after {l1}; devices before {n0:?}, after {n1:?}");
        let grew =
            |a: u64, b: u64| b.checked_sub(a).unwrap_or_else(|| panic!("went back: {state}"));
        let delivered = |l: &Value, m: usize| count(l, &["members", &m.to_string(), "delivered"]);
        let rx = |n: &[Value; 2], m: usize| count(&n[m], &["rx_frames"]);
        let (got, other_got) = (
            grew(delivered(&l0, who), delivered(&l1, who)),
            grew(delivered(&l0, other), delivered(&l1, other)),
        );
        let (rx_got, rx_other) =
            (grew(rx(&n0, who), rx(&n1, who)), grew(rx(&n0, other), rx(&n1, other)));
        assert!(got >= answered && rx_got >= answered, "{state}");
        assert!(other_got < 50 && rx_other < 50, "the other member got {ip}'s frames: {state}");
        // No foreign frame and no drop in this window (a member's socket
        // may have dropped frames before, while its VM was paused for a
        // handover and its buffer filled).
        for m in 0..2 {
            for k in ["foreign", "dropped"] {
                let n = |l: &Value| count(l, &["members", &m.to_string(), k]);
                assert_eq!(grew(n(&l0), n(&l1)), 0, "member {m}'s {k}: {state}");
            }
        }
        assert!(grew(count(&l0, &["from_tap"]), count(&l1, &["from_tap"])) >= got, "{state}");
        assert!(grew(d0, d1) >= answered, "the TAP's queue kept frames ({d0} -> {d1}): {state}");
    }
}

/// The link of set `lan` is the one `before` was, with its counters
/// carried on: the same name, TAP, mode and members (sandbox, MAC), and
/// at least `sent` more frames from the host (the pings answered since).
fn check_same_link(before: &Value, after: &Value, sent: u64) {
    for k in ["name", "tap", "mode"] {
        assert_eq!(after[k], before[k], "{before} -> {after}");
    }
    assert_eq!((after["name"].as_str(), after["mode"].as_str()), (Some("lan"), Some("demux")));
    for i in 0..2 {
        for k in ["sandbox", "mac"] {
            assert_eq!(after["members"][i][k], before["members"][i][k], "{before} -> {after}");
        }
    }
    assert!(
        count(after, &["from_tap"]) >= count(before, &["from_tap"]) + sent,
        "the link's counters started over: {before} -> {after} ({sent} pings answered)"
    );
}

/// A set on a shared link (one TAP, two sandboxes with their own MAC and
/// address) created over a host's API is carried by warm rejuvenation:
/// twice, with a 1 ms ping to each member across each handover, the new
/// process takes the link over (the TAP's descriptor and the link's packet
/// sockets, each checked to carry its role's filter) and both members
/// answer at their own address after each. Before and after, each member
/// gets only its own frames (the link's and the devices' counters, no
/// foreign frame, no drop) and the TAP's queue drops what nobody reads;
/// the set reports the same link, its counters carried on. Prints each
/// member's longest ping gap per handover. The link's sockets are opened
/// under the host's process seccomp filter and read by the devices'
/// receive threads under the device filter (a syscall outside either
/// would kill the host).
#[test]
fn warm_rejuvenation_carries_a_set_on_a_shared_link() {
    if !kvm_available() {
        return;
    }
    let Some(mut h) = NsHost::start("sbxlink", Host::Plain) else { return };
    let [c0, c1] = two_cores();
    h.create(&link_set_body(c0, c1));
    for ip in ["10.0.0.2", "10.0.0.3"] {
        assert!(h.ns.wait_answering_at(ip, Duration::from_secs(60)), "{ip} never answered");
    }
    check_each_member_gets_only_its_own_frames(&h.ns, &h.sock);
    let (before, _) = link_now(&h.sock);
    let mut pid = http_json(&h.sock, "GET", "/v1/info", None).1["pid"].as_u64().unwrap();
    let mut answered = 0;
    for round in 1..=2u64 {
        let pings = ["10.0.0.2", "10.0.0.3"].map(|ip| (ip, start_ping_at(&h.ns, ip)));
        std::thread::sleep(Duration::from_millis(300));
        let (st, r) = http_json(&h.sock, "POST", "/v1/rejuvenate", Some(r#"{"mode":"warm"}"#));
        assert_eq!(st, 200, "{r}");
        assert_eq!(r["report"]["ok"], true, "round {round}: {r}");
        assert_eq!(r["report"]["sets"], json!(["lan"]), "{r}");
        let new_pid = http_json(&h.sock, "GET", "/v1/info", None).1["pid"].as_u64().unwrap();
        assert_ne!(new_pid, pid, "round {round}: a new process serves");
        pid = new_pid;
        let (_, list) = http_json(&h.sock, "GET", "/v1/sandboxes", None);
        assert_eq!(list["sets"][0]["name"], "lan", "{list}");
        assert_eq!(list["sets"][0]["handovers"], round, "{list}");
        for (ip, ping) in pings {
            let j = ping_report(ping);
            answered += count(&j, &["received"]);
            assert!(
                h.ns.wait_answering_at(ip, Duration::from_secs(30)),
                "round {round}: {ip} silent"
            );
            eprintln!(
                "link round {round}, {ip}: ping sent {} received {} longest gap {} ms; set \
                 downtime {} ms",
                j["sent"], j["received"], j["longest_gap_ms"], r["report"]["sets_downtime_ms"]
            );
        }
    }
    let (after, _) = link_now(&h.sock);
    check_same_link(&before, &after, answered);
    check_each_member_gets_only_its_own_frames(&h.ns, &h.sock);
    stop_host(&h.sock, &mut h.child);
}

/// Makes the microrebooting host on `sock` (request `fault_at` faults;
/// `sent` requests so far) microreboot: pads the requests, sends the
/// faulting one, and waits (bounded) until the fresh process (the same
/// pid, generation 1) serves.
fn microreboot(
    sock: &std::path::Path,
    child: &mut std::process::Child,
    sent: &mut usize,
    fault_at: usize,
) {
    pad_requests(sock, sent, fault_at);
    let r = nl_vmm::api::request_timeout(sock, &json!({"op": "info"}), Duration::from_secs(30));
    assert!(
        r.is_err() || r.as_ref().unwrap()["ok"] != true,
        "the faulting request was answered: {r:?}"
    );
    let t = Instant::now();
    loop {
        let info =
            nl_vmm::api::request_timeout(sock, &json!({"op": "info"}), Duration::from_secs(30));
        if let Ok(v) = info {
            if v["generation"] == 1 {
                assert_eq!(v["pid"], child.id(), "{v}");
                break;
            }
        }
        assert!(child.try_wait().unwrap().is_none(), "the host died");
        assert!(t.elapsed() < Duration::from_secs(60), "the host did not serve again");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Stops the host and returns the recovery line its microreboot printed
/// on stderr.
fn stop_and_recovery_line(sock: &std::path::Path, child: &mut std::process::Child) -> String {
    stop_host(sock, child);
    let err = {
        use std::io::Read;
        let mut e = String::new();
        child.stderr.take().unwrap().read_to_string(&mut e).unwrap();
        e
    };
    err.lines()
        .find(|l| l.starts_with("NINELIVES-RECOVERED "))
        .unwrap_or_else(|| panic!("{err}"))
        .to_string()
}

/// A microreboot (a fault in the host's API thread, the process exec'd
/// afresh in place) carries a set on a shared link the same way: with a
/// 1 ms ping to each member across it, the fresh process (same pid) takes
/// the link's TAP and sockets over, both members answer at their own
/// address, the set reports the same link with its counters carried on,
/// each member still gets only its own frames, and the recovery line
/// counts the set.
#[test]
fn a_microreboot_carries_a_set_on_a_shared_link() {
    if !kvm_available() {
        return;
    }
    // The connection reading request FAULT_AT faults; requests before it:
    // the create, the counters, then `info`s.
    const FAULT_AT: usize = 20;
    let Some(mut h) = NsHost::start("sbxlmr", Host::Microrebooting(FAULT_AT)) else { return };
    let [c0, c1] = two_cores();
    h.create(&link_set_body(c0, c1));
    for ip in ["10.0.0.2", "10.0.0.3"] {
        assert!(h.ns.wait_answering_at(ip, Duration::from_secs(60)), "{ip} never answered");
    }
    let (before, _) = link_now(&h.sock);
    let mut sent = 2;
    let pings = ["10.0.0.2", "10.0.0.3"].map(|ip| (ip, start_ping_at(&h.ns, ip)));
    std::thread::sleep(Duration::from_millis(300));
    microreboot(&h.sock, &mut h.child, &mut sent, FAULT_AT);
    let mut answered = 0;
    for (ip, ping) in pings {
        let j = ping_report(ping);
        answered += count(&j, &["received"]);
        assert!(h.ns.wait_answering_at(ip, Duration::from_secs(30)), "{ip}: no answer after it");
        eprintln!(
            "link microreboot, {ip}: ping sent {} received {} longest gap {} ms",
            j["sent"], j["received"], j["longest_gap_ms"]
        );
    }
    let (_, list) = http_json(&h.sock, "GET", "/v1/sandboxes", None);
    assert_eq!(list["sets"][0]["name"], "lan", "{list}");
    assert_eq!(list["sets"][0]["handovers"], 1, "{list}");
    let (after, _) = link_now(&h.sock);
    check_same_link(&before, &after, answered);
    check_each_member_gets_only_its_own_frames(&h.ns, &h.sock);
    let line = stop_and_recovery_line(&h.sock, &mut h.child);
    assert!(line.contains("\"sets\":1"), "{line}");
}

/// `POST /v1/sandboxes` of set `svc`: service `echo` with owner `web` (on
/// TAP nltap0, 10.0.0.2) and standby `spare`, both `netbench`, restarting.
fn service_set_body(c0: usize, c1: usize) -> String {
    let net = json!({"tap": "nltap0", "mac": "52:54:00:5a:00:02", "ipv4": "10.0.0.2/24"});
    let set = json!({"sandboxes": [
        {"name": "web", "cores": [c0], "mem_mib": 48, "net": net,
         "workload": {"kind": "netbench", "duration_ms": 0}, "recovery": {"policy": "restart"}},
        {"name": "spare", "cores": [c1], "mem_mib": 48,
         "workload": {"kind": "netbench", "duration_ms": 0}, "recovery": {"policy": "restart"}}
    ], "services": [{"name": "echo", "owner": "web", "standby": "spare"}]});
    json!({"name": "svc", "set": set, "timeout_secs": 300}).to_string()
}

/// The service of set `svc` now: (holder, standby, takeovers).
fn service_now(sock: &std::path::Path) -> (String, String, Vec<Value>) {
    let (st, v) = http_json(sock, "GET", "/v1/sandboxes/svc", None);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["state"], "running", "the set ended: {v}");
    let s = &v["services"][0];
    let name = |k: &str| s[k].as_str().unwrap_or_else(|| panic!("no {k}: {v}")).to_string();
    (name("holder"), name("standby"), s["takeovers"].as_array().cloned().unwrap_or_default())
}

/// A set with a `services` registry (owner `web` on its TAP, standby
/// `spare` on a spare device under the same identity) is carried by a
/// warm rejuvenation while a client pings (1 ms): the registry (holder,
/// standby, takeovers) and the holder's TAP go to the new process, the
/// service answers after it, and a takeover in the new process still works:
/// a bad RIP injected into the holder (`sandbox_inject`) moves the service
/// to the standby, which answers on the same TAP. A second rejuvenation
/// then carries the swapped registry (holder `spare`, one takeover).
#[test]
fn warm_rejuvenation_carries_a_service_set_and_a_takeover_works_after_it() {
    if !kvm_available() {
        return;
    }
    let Some(mut h) = NsHost::start("sbxsvc", Host::Plain) else { return };
    let [c0, c1] = two_cores();
    h.create(&service_set_body(c0, c1));
    assert!(h.ns.wait_answering(Duration::from_secs(60)), "the owner never answered");
    let rejuvenate = |round: u64| {
        let ping = start_ping(&h.ns);
        std::thread::sleep(Duration::from_millis(300));
        let (st, r) = http_json(&h.sock, "POST", "/v1/rejuvenate", Some(r#"{"mode":"warm"}"#));
        assert_eq!(st, 200, "{r}");
        assert_eq!(r["report"]["ok"], true, "round {round}: {r}");
        assert_eq!(r["report"]["sets"], json!(["svc"]), "{r}");
        let (_, list) = http_json(&h.sock, "GET", "/v1/sandboxes", None);
        assert_eq!(list["sets"][0]["handovers"], round, "{list}");
        let j = ping_report(ping);
        assert!(h.ns.wait_answering(Duration::from_secs(30)), "round {round}: no answer after it");
        eprintln!(
            "service round {round}: ping sent {} received {} longest gap {} ms; set downtime {} ms",
            j["sent"], j["received"], j["longest_gap_ms"], r["report"]["sets_downtime_ms"]
        );
    };
    rejuvenate(1);
    let (holder, standby, takeovers) = service_now(&h.sock);
    assert_eq!((holder.as_str(), standby.as_str()), ("web", "spare"));
    assert!(takeovers.is_empty(), "{takeovers:?}");
    // A takeover in the new process.
    inject_bad_rip(&h.sock, "svc", "web");
    wait_for("the standby to take the service over", Duration::from_secs(60), || {
        service_now(&h.sock).0 == "spare"
    });
    let (holder, standby, takeovers) = service_now(&h.sock);
    assert_eq!((holder.as_str(), standby.as_str()), ("spare", "web"));
    assert_eq!(takeovers.len(), 1, "{takeovers:?}");
    assert_eq!(takeovers[0]["ok"], true, "{takeovers:?}");
    assert!(h.ns.wait_answering(Duration::from_secs(60)), "the standby never answered");
    // The failed holder restarts as the new standby (until then the set
    // cannot be carried: one of its sandboxes has ended).
    wait_for("'web' to run again as the standby", Duration::from_secs(120), || {
        let (_, v) = http_json(&h.sock, "GET", "/v1/sandboxes/svc", None);
        v["sandbox_stats"][0]["state"] == "running"
    });
    // The swapped registry is carried too.
    rejuvenate(2);
    let (holder, standby, takeovers) = service_now(&h.sock);
    assert_eq!((holder.as_str(), standby.as_str()), ("spare", "web"));
    assert_eq!(takeovers.len(), 1, "the takeover record is carried: {takeovers:?}");
    stop_host(&h.sock, &mut h.child);
}

/// A microreboot (a fault in the VMM's API thread, the process exec'd
/// afresh in place) carries a service set with its TAP and registry: a
/// client pinging every 1 ms across it is answered again by the holder
/// (`web`) in the fresh process, the registry is unchanged, and the
/// recovery line counts the set. Prints the ping's longest gap.
#[test]
fn a_microreboot_carries_a_service_set_with_its_tap() {
    if !kvm_available() {
        return;
    }
    // The connection reading request FAULT_AT faults; requests before it:
    // the create, then `info`s.
    const FAULT_AT: usize = 20;
    let Some(mut h) = NsHost::start("sbxmr", Host::Microrebooting(FAULT_AT)) else { return };
    let [c0, c1] = two_cores();
    h.create(&service_set_body(c0, c1));
    let mut sent = 1;
    assert!(h.ns.wait_answering(Duration::from_secs(60)), "the owner never answered");
    let ping = start_ping(&h.ns);
    std::thread::sleep(Duration::from_millis(300));
    microreboot(&h.sock, &mut h.child, &mut sent, FAULT_AT);
    let j = ping_report(ping);
    assert!(h.ns.wait_answering(Duration::from_secs(30)), "no answer after the microreboot");
    eprintln!(
        "microreboot: ping sent {} received {} longest gap {} ms",
        j["sent"], j["received"], j["longest_gap_ms"]
    );
    let (_, list) = http_json(&h.sock, "GET", "/v1/sandboxes", None);
    assert_eq!(list["sets"][0]["name"], "svc", "{list}");
    assert_eq!(list["sets"][0]["handovers"], 1, "{list}");
    let (holder, standby, takeovers) = service_now(&h.sock);
    assert_eq!((holder.as_str(), standby.as_str()), ("web", "spare"));
    assert!(takeovers.is_empty(), "{takeovers:?}");
    let line = stop_and_recovery_line(&h.sock, &mut h.child);
    assert!(line.contains("\"sets\":1"), "{line}");
}

/// Reads keys `k0`..`k{n-1}` (and `first`) from the kv service at
/// 10.0.0.2 in namespace `ns`: each must hold the value written,
/// `v{i}` (`1`). Returns the keys read.
fn read_back(ns: &Netns, n: u64, when: &str) -> u64 {
    ns.0.run_in(|| {
        let mut c = crate::sandbox_state::Client::new();
        let first = c.must("GET first", Duration::from_secs(60));
        assert_eq!(first, "VAL 1", "{when}: first");
        let mut wrong = Vec::new();
        for i in 0..n {
            let r = c.must(&format!("GET k{i}"), Duration::from_secs(30));
            if r != format!("VAL v{i}") {
                wrong.push(format!("k{i}: {r}"));
            }
        }
        assert!(wrong.is_empty(), "{when}: {} of {n} keys lost or wrong: {wrong:?}", wrong.len());
        Ok(n)
    })
    .unwrap()
}

/// Writes `PUT k{i} v{i}` for `i` in `range` to the kv service at
/// 10.0.0.2 in namespace `ns`, each acknowledged (`OK`) before the next.
fn write_acked(ns: &Netns, range: std::ops::Range<u64>) {
    ns.0.run_in(|| {
        let mut c = crate::sandbox_state::Client::new();
        for i in range {
            assert_eq!(c.must(&format!("PUT k{i} v{i}"), Duration::from_secs(30)), "OK", "k{i}");
        }
        Ok(())
    })
    .unwrap()
}

/// Writes `PUT first 1` to the kv service at 10.0.0.2 in namespace `ns`
/// (waiting for it to answer, bounded), acknowledged.
fn put_first(ns: &Netns) {
    ns.0.run_in(|| {
        let mut c = crate::sandbox_state::Client::new();
        assert_eq!(c.must("PUT first 1", Duration::from_secs(60)), "OK");
        Ok(())
    })
    .unwrap();
}

/// Injects an unmapped RIP (the next instruction faults) into sandbox
/// `sandbox` of set `set` through the host's API.
fn inject_bad_rip(sock: &std::path::Path, set: &str, sandbox: &str) {
    let fault = json!({"kind": "register", "cpu": 0, "reg": "rip", "bit": 40});
    let req = json!({"op": "sandbox_inject", "name": set, "sandbox": sandbox, "fault": fault});
    let r = nl_vmm::api::request_timeout(sock, &req, Duration::from_secs(30)).unwrap();
    assert_eq!(r["ok"], true, "{r}");
}

/// A warm rejuvenation of the host on `sock`, which must carry set `set`
/// (its `handovers` then `handovers`); returns the rejuvenation's answer.
fn rejuvenate_warm(sock: &std::path::Path, set: &str, handovers: u64) -> Value {
    let (st, r) = http_json(sock, "POST", "/v1/rejuvenate", Some(r#"{"mode":"warm"}"#));
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["report"]["ok"], true, "{r}");
    assert_eq!(r["report"]["sets"], json!([set]), "{r}");
    let (_, list) = http_json(sock, "GET", "/v1/sandboxes", None);
    assert_eq!(list["sets"][0]["handovers"], handovers, "{list}");
    r
}

/// A kv service with a state region (owner `web` on TAP nltap0, standby
/// `spare`) is carried by a warm rejuvenation: 200 writes acknowledged
/// before it are read back after it (the new process maps the same memfd
/// and gives the slot to the holder's rebuilt VM), then 100 more are
/// written, and a takeover in the new process (a bad RIP injected into
/// `web`) moves the region to `spare`, which loads the table and answers
/// all 301 keys with their values.
#[test]
fn warm_rejuvenation_carries_a_state_region_and_a_takeover_keeps_its_writes() {
    let _one_at_a_time = common::pace_sensitive();
    if !kvm_available() {
        return;
    }
    let Some(mut h) = NsHost::start("sbxstate", Host::Plain) else { return };
    let [c0, c1] = two_cores();
    let net = json!({"tap": "nltap0", "mac": "52:54:00:5a:00:02", "ipv4": "10.0.0.2/24"});
    let kv = json!({"kind": "kv", "duration_ms": 0});
    let set = json!({"sandboxes": [
        {"name": "web", "cores": [c0], "mem_mib": 48, "net": net, "workload": kv,
         "recovery": {"policy": "restart"}},
        {"name": "spare", "cores": [c1], "mem_mib": 48, "workload": kv,
         "recovery": {"policy": "restart"}}
    ], "services": [{"name": "kv", "owner": "web", "standby": "spare", "state": {"mib": 4}}]});
    let body = json!({"name": "svc", "set": set, "timeout_secs": 600}).to_string();
    h.create(&body);
    put_first(&h.ns);
    write_acked(&h.ns, 0..200);
    rejuvenate_warm(&h.sock, "svc", 1);
    read_back(&h.ns, 200, "after the rejuvenation");
    write_acked(&h.ns, 200..300);
    let (holder, standby, takeovers) = service_now(&h.sock);
    assert_eq!((holder.as_str(), standby.as_str()), ("web", "spare"));
    assert!(takeovers.is_empty(), "{takeovers:?}");
    // A takeover in the new process: the region moves to spare.
    inject_bad_rip(&h.sock, "svc", "web");
    wait_for("the standby to take the service over", Duration::from_secs(60), || {
        service_now(&h.sock).0 == "spare"
    });
    let (_, _, takeovers) = service_now(&h.sock);
    assert_eq!(takeovers.len(), 1, "{takeovers:?}");
    assert_eq!(takeovers[0]["ok"], true, "{takeovers:?}");
    read_back(&h.ns, 300, "after the takeover");
    stop_host(&h.sock, &mut h.child);
}

/// How a test's [`NsHost`] is started.
enum Host<'e> {
    Plain,
    /// With these environment variables set.
    Env(&'e [(&'e str, &'e str)]),
    /// With microreboot recovery; its API connection reading request N
    /// faults.
    Microrebooting(usize),
}

/// `ninelives host --api SOCK` in a network namespace of the test's own,
/// listening. Fields drop in order: the guard ends whichever process
/// serves `sock` if the test fails midway, then the socket's directory
/// goes, and the namespace last, after the host is gone.
struct NsHost {
    _end: EndHostOnDrop,
    child: std::process::Child,
    sock: std::path::PathBuf,
    _dir: tempfile::TempDir,
    ns: Netns,
}

impl NsHost {
    /// `None` when the namespace cannot be made (`Netns::new` reports the
    /// missing prerequisite).
    fn start(tag: &str, how: Host) -> Option<NsHost> {
        let ns = Netns::new(tag)?;
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("api.sock");
        let mut cmd = ns.ninelives(&["host", "--api", sock.to_str().unwrap()]);
        cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null());
        match how {
            Host::Plain => {}
            Host::Env(env) => {
                cmd.envs(env.iter().copied());
            }
            Host::Microrebooting(fault_at) => {
                cmd.args(["--recovery", "microreboot"])
                    .env("NINELIVES_API_FAULT", format!("segv:{fault_at}"))
                    .stderr(std::process::Stdio::piped());
            }
        }
        let child = cmd.spawn().unwrap();
        let end = EndHostOnDrop(sock.clone());
        wait_for_socket(&sock);
        Some(NsHost { _end: end, child, sock, _dir: dir, ns })
    }

    /// `POST /v1/sandboxes` of `body`, which must be created.
    fn create(&self, body: &str) -> Value {
        let (st, v) = http_json(&self.sock, "POST", "/v1/sandboxes", Some(body));
        assert_eq!(st, 201, "{v}");
        v
    }
}

/// Waits (bounded: 20 s) until a host listens on `sock`.
fn wait_for_socket(sock: &std::path::Path) {
    wait_for("the host's API socket", Duration::from_secs(20), || {
        std::os::unix::net::UnixStream::connect(sock).is_ok()
    });
}

/// `ninelives ping` of the sandbox at 10.0.0.2 from namespace `ns`: every
/// 1 ms for 3 s, its JSON report on stdout.
fn start_ping(ns: &Netns) -> std::process::Child {
    start_ping_at(ns, "10.0.0.2")
}

/// [`start_ping`] of the sandbox at `ip`.
fn start_ping_at(ns: &Netns, ip: &str) -> std::process::Child {
    ns.ninelives(&["ping", "--target", ip, "--interval", "1ms"])
        .args(["--duration", "3", "--json"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

/// The JSON report of a ping started by [`start_ping`], once it ends.
fn ping_report(ping: std::process::Child) -> Value {
    let out = ping.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no ping report: {text}"))
}

/// A sandbox's own disk goes with its set through a warm rejuvenation:
/// blkbench, in the middle of its file operations on the image, goes on in
/// the new process (its virtio-blk device restored, the image opened
/// again) and ends verified, every read checked against what it wrote.
#[test]
fn warm_rejuvenation_carries_a_sandbox_with_its_own_disk() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    let img = dir.path().join("a.img");
    let (mut child, _s) = spawn_host(&sock);
    let _end = EndHostOnDrop(sock.to_path_buf());
    let [c0, _] = two_cores();
    let set = json!({"sandboxes": [
        {"name": "a", "cores": [c0], "mem_mib": 48,
         "workload": {"kind": "blkbench", "duration_ms": 6000},
         "disk": {"path": img}}
    ]});
    let body = json!({"name": "pair", "set": set, "timeout_secs": 300}).to_string();
    let (st, v) = http_json(&sock, "POST", "/v1/sandboxes", Some(&body));
    assert_eq!(st, 201, "{v}");
    // blkbench has written files to its image.
    let written = || {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(&img).map_or(0, |m| m.blocks() * 512)
    };
    let t = Instant::now();
    while written() < 4 << 20 {
        assert!(t.elapsed() < Duration::from_secs(60) * LOADED, "blkbench never wrote its disk");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (st, r) = http_json(&sock, "POST", "/v1/rejuvenate", Some(r#"{"mode":"warm"}"#));
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["report"]["ok"], true, "{r}");
    assert_eq!(r["report"]["sets"], json!(["pair"]), "{r}");
    let report = wait_ended(&sock, |v| assert_ne!(v["state"], "failed", "{v}"));
    let a = &report["sandboxes"][0];
    assert!(a["disk"]["writes"].as_u64() > Some(0), "no writes after the handover: {a}");
    assert_eq!(a["disk"]["errors"], 0, "{a}");
    stop_host(&sock, &mut child);
}

/// `POST /v1/sandboxes` of set `rb`: one kv sandbox under `rollback`
/// (output commit on, released at the next checkpoint, 20 ms checkpoints,
/// 100 ms heartbeat bound) on TAP nltap0 at 10.0.0.2. Its table is in
/// guest RAM only (no state region): a restart would lose it. (Released
/// after the detection latency instead, a reply of the mostly idle guest
/// waits for 100 ms of its guest time: a single client's requests then
/// took over 30 s each.)
fn rollback_kv_body(c0: usize) -> String {
    let net = json!({"tap": "nltap0", "mac": "52:54:00:5a:00:02", "ipv4": "10.0.0.2/24"});
    let set = json!({"sandboxes": [
        {"name": "kv", "cores": [c0], "mem_mib": 48, "net": net,
         "workload": {"kind": "kv", "duration_ms": 0},
         "detect": {"heartbeat_cpu_ms": 100},
         "recovery": {"policy": "rollback", "max_recoveries": 100, "window_ms": 1000,
                      "checkpoint_interval_ms": 20, "release": "next_checkpoint"}}
    ]});
    json!({"name": "rb", "set": set, "timeout_secs": 600}).to_string()
}

/// Sandbox `kv` of set `rb` now: its rollbacks so far (over every process
/// it ran in); the set must be running (the sandbox's own VM shows an
/// outcome for a moment between a fault and its rollback).
fn rollbacks_now(sock: &std::path::Path) -> u64 {
    let (st, v) = http_json(sock, "GET", "/v1/sandboxes/rb", None);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["state"], "running", "the set ended: {v}");
    v["sandbox_stats"][0]["rollbacks"].as_u64().unwrap_or_else(|| panic!("no rollbacks: {v}"))
}

/// The rollback kv sandbox of [`rollback_kv_body`] across `hand_over` (a
/// warm rejuvenation or a microreboot of its host, or one that fails):
/// 100 writes acknowledged before are read back after it from the same
/// guest (no restart: its table is in its RAM), 50 more are written; then
/// a bad RIP injected into it is rolled back by whichever process serves
/// now (the rollback count grows), and all 150 keys read back again and
/// 10 more are written.
fn rollback_kv_across(ns: &Netns, sock: &std::path::Path, hand_over: impl FnOnce()) {
    put_first(ns);
    write_acked(ns, 0..100);
    assert_eq!(rollbacks_now(sock), 0);
    hand_over();
    read_back(ns, 100, "after the handover");
    write_acked(ns, 100..150);
    inject_bad_rip(sock, "rb", "kv");
    wait_for("a rollback after the handover", Duration::from_secs(60), || rollbacks_now(sock) >= 1);
    read_back(ns, 150, "after the rollback after the handover");
    write_acked(ns, 150..160);
}

/// A set with a `rollback` sandbox is carried by a warm rejuvenation
/// (issue 18): its supervisor ends its run at the pause (output released,
/// ring dropped), the new process supervises the same guest with a fresh
/// ring, every write acknowledged before is read back, and a fault after
/// the handover is rolled back in the new process. Prints the set's
/// downtime and the load average.
#[test]
fn warm_rejuvenation_carries_a_rollback_sandbox_and_rolls_back_after_it() {
    let _one_at_a_time = common::pace_sensitive();
    if !kvm_available() {
        return;
    }
    let Some(mut h) = NsHost::start("sbxrbw", Host::Plain) else { return };
    let [c0, _] = two_cores();
    h.create(&rollback_kv_body(c0));
    let pid = h.child.id() as u64;
    rollback_kv_across(&h.ns, &h.sock, || {
        let before = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        let r = rejuvenate_warm(&h.sock, "rb", 1);
        let (_, info) = http_json(&h.sock, "GET", "/v1/info", None);
        assert_ne!(info["pid"].as_u64(), Some(pid), "a new process serves");
        let after = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        eprintln!(
            "rollback sandbox carried by warm rejuvenation: set downtime {} ms; loadavg {} \
             before, {} after",
            r["report"]["sets_downtime_ms"],
            before.trim(),
            after.trim()
        );
    });
    stop_host(&h.sock, &mut h.child);
}

/// A warm rejuvenation that fails (its new process refuses the set record,
/// `NINELIVES_HANDOVER_SELFTEST=corrupt-sets`) leaves a rollback sandbox
/// supervised in the old process: its supervisor had ended its run at the
/// pause, and its monitor starts a new one over the paused VM (a fresh
/// ring, first checkpoint before it runs). Every acknowledged write is
/// read back and a fault after it is rolled back.
#[test]
fn a_failed_rejuvenation_leaves_a_rollback_sandbox_supervised_in_the_old_process() {
    if !kvm_available() {
        return;
    }
    let Some(mut h) =
        NsHost::start("sbxrbf", Host::Env(&[("NINELIVES_HANDOVER_SELFTEST", "corrupt-sets")]))
    else {
        return;
    };
    let [c0, _] = two_cores();
    h.create(&rollback_kv_body(c0));
    rollback_kv_across(&h.ns, &h.sock, || {
        let (st, r) = http_json(&h.sock, "POST", "/v1/rejuvenate", Some(r#"{"mode":"warm"}"#));
        assert_eq!(st, 200, "{r}");
        assert_eq!(r["report"]["ok"], false, "{r}");
        assert_eq!(r["report"]["rolled_back"], true, "{r}");
        let (_, info) = http_json(&h.sock, "GET", "/v1/info", None);
        assert_eq!(info["pid"], h.child.id(), "{info}");
    });
    stop_host(&h.sock, &mut h.child);
}

/// The same across a microreboot (a fault in the host's API thread, the
/// process exec'd afresh in place): the old process's microreboot thread
/// has the rollback supervisor end its run before the exec, the fresh
/// process (same pid) supervises the same guest, every acknowledged write
/// is read back, a fault after it is rolled back, and the recovery line
/// counts the set.
#[test]
fn a_microreboot_carries_a_rollback_sandbox_and_rolls_back_after_it() {
    if !kvm_available() {
        return;
    }
    // The connection reading request FAULT_AT faults; requests before it:
    // the create, the rollback counts, then `info`s.
    const FAULT_AT: usize = 20;
    let Some(mut h) = NsHost::start("sbxrbm", Host::Microrebooting(FAULT_AT)) else { return };
    let [c0, _] = two_cores();
    h.create(&rollback_kv_body(c0));
    rollback_kv_across(&h.ns, &h.sock, || {
        // The create and one rollback count so far.
        let mut sent = 2;
        microreboot(&h.sock, &mut h.child, &mut sent, FAULT_AT);
        let (_, list) = http_json(&h.sock, "GET", "/v1/sandboxes", None);
        assert_eq!(list["sets"][0]["name"], "rb", "{list}");
        assert_eq!(list["sets"][0]["handovers"], 1, "{list}");
    });
    let line = stop_and_recovery_line(&h.sock, &mut h.child);
    assert!(line.contains("\"sets\":1"), "{line}");
}
