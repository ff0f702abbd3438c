//! After a warm rejuvenation and after a microreboot the host process is
//! still called `ninelives` (the kernel names a process exec'd through
//! /proc/self/exe `exe`, which `pgrep ninelives` cannot find).

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

fn request(sock: &Path, req: Value) -> Value {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    writeln!(s, "{req}").unwrap();
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).unwrap();
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"))
}

fn comm(pid: u64) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap().trim_end().to_string()
}

/// The pid serving `sock`, once it answers (bounded).
fn serving_pid(sock: &Path, not: u64) -> u64 {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(60) {
        if let Ok(mut s) = UnixStream::connect(sock) {
            let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
            let _ = writeln!(s, "{}", json!({"op": "info"}));
            let mut line = String::new();
            let _ = BufReader::new(s).read_line(&mut line);
            if let Some(pid) =
                serde_json::from_str::<Value>(&line).ok().and_then(|v| v["pid"].as_u64())
            {
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
