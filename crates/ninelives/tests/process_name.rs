//! After a warm rejuvenation and after a microreboot the host process is
//! still called `ninelives` (the kernel names a process exec'd through
//! /proc/self/exe `exe`, which `pgrep ninelives` cannot find).

use crate::common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

fn request(sock: &Path, req: Value) -> Value {
    nl_vmm::api::request_timeout(sock, &req, Duration::from_secs(120))
        .unwrap_or_else(|e| panic!("no reply to {req}: {e}"))
}

fn comm(pid: u64) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap().trim_end().to_string()
}

/// The pid serving `sock`, once it answers (bounded).
fn serving_pid(sock: &Path, not: u64) -> u64 {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(60) {
        let info = json!({"op": "info"});
        if let Ok(v) = nl_vmm::api::request_timeout(sock, &info, Duration::from_secs(10)) {
            if let Some(pid) = v["pid"].as_u64() {
                if pid != not {
                    return pid;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("no new host answered on {}", sock.display());
}

#[test]
fn the_host_keeps_its_name_after_a_warm_rejuvenation() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    let (mut child, _s) = spawn_host(&sock);
    let first = u64::from(child.id());
    assert_eq!(comm(first), "ninelives");
    let r =
        request(&sock, json!({"op": "create", "workload": "idle", "duration": 600, "mem": "64M"}));
    assert_eq!(r["ok"], true, "{r}");
    let r = request(&sock, json!({"op": "rejuvenate", "mode": "warm"}));
    assert_eq!(r["ok"], true, "{r}");
    let second = serving_pid(&sock, first);
    assert_eq!(comm(second), "ninelives", "the successor (pid {second}) is misnamed");
    stop_host(&sock, &mut child);
}
