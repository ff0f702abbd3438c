//! Configuration files: `run --config` runs exactly the VMs a file
//! describes, `host --config` creates them before it serves its API, and a
//! bad file is refused whole, naming the VM and field, before anything
//! starts.

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

fn temp_dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("nl-config-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn run_config_runs_each_vm_as_described() {
    if !kvm_available() {
        return;
    }
    let dir = temp_dir("run");
    let file = write_file(
        &dir,
        "vms.json",
        json!({"vms": [
            {"workload": "compute", "duration": 0.5, "seed": 7},
            {"workload": "memwrite", "mem": "128M", "ws": "4M", "pattern": "sequential", "duration": 0.5},
            {"workload": "idle", "duration": 0.5}
        ]})
        .to_string()
        .as_bytes(),
    );
    let o = run_cli(&["run", "--config", &file, "--json"]);
    assert!(o.status.success(), "{}\n{}", stdout(&o), stderr(&o));
    let j = last_json(&o);
    let vms = j["vms"].as_array().unwrap();
    let names: Vec<_> = vms.iter().map(|v| v["workload"].as_str().unwrap()).collect();
    assert_eq!(names, ["compute", "memwrite", "idle"], "{j}");
    assert!(vms.iter().all(|v| v["digest_ok"] == true), "{j}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn host_config_creates_its_vms_before_serving() {
    if !kvm_available() {
        return;
    }
    let dir = temp_dir("host");
    let file = write_file(
        &dir,
        "vms.json",
        json!({"vms": [
            {"workload": "compute", "mem": "64M"},
            {"workload": "idle", "mem": "96M", "vcpus": 2}
        ]})
        .to_string()
        .as_bytes(),
    );
    let sock = dir.join("api.sock");
    let (mut child, _s) = spawn_host_with(&sock, &["--config", &file]);
    let list = nl_vmm::api::request(&sock, &json!({"op": "list"})).unwrap();
    let vms = list["vms"].as_array().unwrap();
    let got: Vec<_> = vms
        .iter()
        .map(|v| {
            (
                v["workload"].as_str().unwrap(),
                v["mem_bytes"].as_u64().unwrap(),
                v["vcpus"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(got, [("compute", 64 << 20, 1), ("idle", 96 << 20, 2)], "{list}");
    assert!(vms.iter().all(|v| v["state"] == "running"), "{list}");
    stop_host(&sock, &mut child);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_bad_config_stops_the_host_before_it_listens() {
    let dir = temp_dir("bad");
    let sock = dir.join("api.sock");
    let cases: [(&str, &str); 4] = [
        (r#"{"vms":[{"workload":"compute"},{"vcpus":0}]}"#, "vms[1]: vcpus 0 is out of range"),
        (r#"{"vms":[{"memory":"1G"}]}"#, "unknown field `memory`"),
        ("{\"vms\":[\n{},\n{\"mem\":\"64M\",}]}", "line 3"),
        (r#"{"vms":[]}"#, "holds 0 VMs"),
    ];
    for (i, (text, needle)) in cases.iter().enumerate() {
        let file = write_file(&dir, &format!("bad{i}.json"), text.as_bytes());
        let mut child = ninelives()
            .args(["host", "--api", sock.to_str().unwrap(), "--config", &file])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let t = Instant::now();
        let status = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break st;
            }
            if t.elapsed() > Duration::from_secs(30) {
                let _ = child.kill();
                let _ = child.wait();
                panic!("host with bad config {i} did not exit");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut err = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
        assert!(!status.success(), "bad config {i} was accepted");
        assert!(err.contains(needle), "config {i}: wanted '{needle}' in: {err}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(!sock.exists(), "the host listened with bad config {i}");
        // run refuses the same file the same way.
        let o = run_cli(&["run", "--config", &file]);
        assert_clean_error(&o, needle);
    }
    let o = run_cli(&["run", "--config", "/nonexistent/vms.json"]);
    assert_clean_error(&o, "cannot read the configuration file /nonexistent/vms.json");
    let file = write_file(&dir, "ok.json", br#"{"vms":[{}]}"#);
    let o = run_cli(&["run", "--config", &file, "--mem", "64M"]);
    assert_clean_error(&o, "cannot be used with");
    let _ = std::fs::remove_dir_all(&dir);
}
