//! seccomp filters on the VMM's threads (on by default): a syscall outside
//! a thread's allowlist is caught (SIGSYS), reported as a `seccomp`
//! detection naming the syscall, and recovered by `--recovery microreset`
//! like any other fatal signal. With `--seccomp off` the same syscall runs.
//!
//! The forbidden syscall is `personality(0xffffffff)` (a harmless query no
//! VMM thread needs), made by the self-test fault points
//! `NINELIVES_DEVICE_FAULT=syscall:N` (inside a device, on a vCPU thread)
//! and `NINELIVES_API_FAULT=syscall:N` (on an API connection thread).

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

const SYS_PERSONALITY: i64 = libc::SYS_personality;

struct Host {
    child: Child,
    sock: PathBuf,
    err: PathBuf,
    _dir: tempfile::TempDir,
}

impl Host {
    fn start(args: &[&str], env: &[(&str, &str)]) -> Self {
        assert!(nl_vmm::open_kvm().is_ok(), "these tests need KVM (/dev/kvm)");
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("api.sock");
        let err = dir.path().join("stderr");
        let child = ninelives()
            .args(["host", "--api", sock.to_str().unwrap()])
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .unwrap();
        let h = Host { child, sock, err, _dir: dir };
        let t = Instant::now();
        while UnixStream::connect(&h.sock).is_err() {
            assert!(t.elapsed() < Duration::from_secs(20), "the host did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
        h
    }

    fn req(&self, v: Value) -> Option<Value> {
        let mut s = UnixStream::connect(&self.sock).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        writeln!(s, "{v}").ok()?;
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line).ok()?;
        serde_json::from_str(&line).ok()
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    fn lines(&self, prefix: &str) -> Vec<Value> {
        self.stderr()
            .lines()
            .filter_map(|l| l.strip_prefix(prefix))
            .filter_map(|j| serde_json::from_str(j).ok())
            .collect()
    }

    fn wait_exit(&mut self, limit: Duration) -> Option<i32> {
        let t = Instant::now();
        while t.elapsed() < limit {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    fn create(&self, workload: &str, secs: f64) -> u64 {
        let r = self
            .req(json!({"op":"create","workload":workload,"mem":"64M","duration":secs}))
            .expect("create answered");
        assert_eq!(r["ok"], true, "{r}");
        r["id"].as_u64().unwrap()
    }

    /// Waits (bounded) for a VM to complete, then replays its workload
    /// natively and checks every vCPU's digest and op count.
    fn assert_completes_verified(&self, id: u64) {
        let t = Instant::now();
        let s = loop {
            let r = self.req(json!({"op":"stats","id":id})).unwrap_or(Value::Null);
            let s = r["stats"].clone();
            if !["running", "paused"].contains(&s["state"].as_str().unwrap_or("running")) {
                break s;
            }
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "VM {id} did not finish: {}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        assert_eq!(s["state"], "completed", "{s}\n{}", self.stderr());
        assert_stats_replay(id, &s);
    }

    fn seccomp_detections(&self) -> Vec<Value> {
        self.lines("NINELIVES-DETECTED ")
            .into_iter()
            .filter(|d| d["detector"] == "seccomp")
            .collect()
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const DEVICE_FAULT: (&str, &str) = ("NINELIVES_DEVICE_FAULT", "syscall:600");

#[test]
fn a_forbidden_syscall_on_a_vcpu_thread_is_detected_and_ends_the_vmm_without_recovery() {
    let mut h = Host::start(&["--recovery", "none"], &[DEVICE_FAULT]);
    let _ = h.create("exits", 3.0);
    assert_eq!(h.wait_exit(Duration::from_secs(30)), Some(86), "{}", h.stderr());
    let d = h.seccomp_detections();
    assert_eq!(d.len(), 1, "{}", h.stderr());
    assert_eq!(d[0]["syscall"], SYS_PERSONALITY, "{}", d[0]);
    assert_eq!(d[0]["signal"], "SIGSYS");
    assert!(d[0]["thread"].as_str().unwrap().starts_with("vm0-vcpu"), "{}", d[0]);
}

#[test]
fn a_forbidden_syscall_on_a_vcpu_thread_is_recovered_by_microreset() {
    let h = Host::start(&["--recovery", "microreset"], &[DEVICE_FAULT]);
    let id = h.create("exits", 1.5);
    h.assert_completes_verified(id);
    let d = h.seccomp_detections();
    assert_eq!(d.len(), 1, "{}", h.stderr());
    assert_eq!(d[0]["syscall"], SYS_PERSONALITY, "{}", d[0]);
    let rec = h.lines("NINELIVES-RECOVERED ");
    assert_eq!(rec.len(), 1, "{}", h.stderr());
    assert_eq!(rec[0]["policy"], "microreset");
    // The host still creates and runs VMs, under its filters.
    let id2 = h.create("compute", 0.3);
    h.assert_completes_verified(id2);
}

#[test]
fn a_forbidden_syscall_on_an_api_thread_is_recovered_by_microreset() {
    // The second request's connection makes the forbidden syscall.
    let h = Host::start(&["--recovery", "microreset"], &[("NINELIVES_API_FAULT", "syscall:2")]);
    let _ = h.req(json!({"op":"list"}));
    let _ = h.req(json!({"op":"list"}));
    let t = Instant::now();
    while h.seccomp_detections().is_empty() {
        assert!(t.elapsed() < Duration::from_secs(20), "no detection: {}", h.stderr());
        std::thread::sleep(Duration::from_millis(20));
    }
    let d = h.seccomp_detections();
    assert_eq!(d[0]["syscall"], SYS_PERSONALITY, "{}", d[0]);
    assert_eq!(d[0]["thread"], "api-conn", "{}", d[0]);
    let id = h.create("compute", 0.3);
    h.assert_completes_verified(id);
    assert_eq!(h.lines("NINELIVES-RECOVERED ").len(), 1, "{}", h.stderr());
}

#[test]
fn with_seccomp_off_the_same_syscall_is_not_detected() {
    let h = Host::start(&["--recovery", "none", "--seccomp", "off"], &[DEVICE_FAULT]);
    let id = h.create("exits", 1.5);
    h.assert_completes_verified(id);
    assert!(h.lines("NINELIVES-DETECTED ").is_empty(), "{}", h.stderr());
}

#[test]
fn the_seccomp_flag_is_checked() {
    let o = run_cli(&["run", "--seccomp", "maybe"]);
    assert_clean_error(&o, "--seccomp");
}
