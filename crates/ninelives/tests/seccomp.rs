//! seccomp filters on the VMM's threads (on by default): a syscall outside
//! a thread's allowlist is caught (SIGSYS), reported as a `seccomp`
//! detection naming the syscall, and recovered by `--recovery microreset`
//! like any other fatal signal. With `--seccomp off` the same syscall runs.
//!
//! The forbidden syscall is `personality(0xffffffff)` (a harmless query no
//! VMM thread needs), made by the self-test fault points
//! `NINELIVES_DEVICE_FAULT=syscall:N` (inside a device, on a vCPU thread)
//! and `NINELIVES_API_FAULT=syscall:N` (on an API connection thread).

use crate::common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

const SYS_PERSONALITY: i64 = libc::SYS_personality;

type Host = common::selftest_host::SelftestHost;

/// A host with `args` and the self-test variables `env` (KVM required).
fn start(args: &[&str], env: &[(&str, &str)]) -> Host {
    assert!(nl_vmm::open_kvm().is_ok(), "these tests need KVM (/dev/kvm)");
    Host::start_env(args, env)
}

fn seccomp_detections(h: &Host) -> Vec<Value> {
    h.lines("NINELIVES-DETECTED ").into_iter().filter(|d| d["detector"] == "seccomp").collect()
}

const DEVICE_FAULT: (&str, &str) = ("NINELIVES_DEVICE_FAULT", "syscall:600");

#[test]
fn a_forbidden_syscall_on_a_vcpu_thread_is_detected_and_ends_the_vmm_without_recovery() {
    let mut h = start(&["--recovery", "none"], &[DEVICE_FAULT]);
    let _ = h.create("exits", 3.0);
    assert_eq!(h.wait_exit(Duration::from_secs(30)), Some(86), "{}", h.stderr());
    let d = seccomp_detections(&h);
    assert_eq!(d.len(), 1, "{}", h.stderr());
    assert_eq!(d[0]["syscall"], SYS_PERSONALITY, "{}", d[0]);
    assert_eq!(d[0]["name"], "personality", "{}", d[0]);
    assert_eq!(d[0]["signal"], "SIGSYS");
    assert!(d[0]["thread"].as_str().unwrap().starts_with("vm0-vcpu"), "{}", d[0]);
}

#[test]
fn a_forbidden_syscall_on_a_vcpu_thread_is_recovered_by_microreset() {
    let h = start(&["--recovery", "microreset"], &[DEVICE_FAULT]);
    let id = h.create("exits", 1.5);
    h.assert_completes_verified(id);
    let d = seccomp_detections(&h);
    assert_eq!(d.len(), 1, "{}", h.stderr());
    assert_eq!(d[0]["syscall"], SYS_PERSONALITY, "{}", d[0]);
    assert_eq!(d[0]["name"], "personality", "{}", d[0]);
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
    let h = start(&["--recovery", "microreset"], &[("NINELIVES_API_FAULT", "syscall:2")]);
    let _ = h.req(json!({"op":"list"}));
    let _ = h.req(json!({"op":"list"}));
    let t = Instant::now();
    while seccomp_detections(&h).is_empty() {
        assert!(t.elapsed() < Duration::from_secs(20), "no detection: {}", h.stderr());
        std::thread::sleep(Duration::from_millis(20));
    }
    let d = seccomp_detections(&h);
    assert_eq!(d[0]["syscall"], SYS_PERSONALITY, "{}", d[0]);
    assert_eq!(d[0]["name"], "personality", "{}", d[0]);
    assert_eq!(d[0]["thread"], "api-conn", "{}", d[0]);
    let id = h.create("compute", 0.3);
    h.assert_completes_verified(id);
    assert_eq!(h.lines("NINELIVES-RECOVERED ").len(), 1, "{}", h.stderr());
}

#[test]
fn with_seccomp_off_the_same_syscall_is_not_detected() {
    let h = start(&["--recovery", "none", "--seccomp", "off"], &[DEVICE_FAULT]);
    let id = h.create("exits", 1.5);
    h.assert_completes_verified(id);
    assert!(h.lines("NINELIVES-DETECTED ").is_empty(), "{}", h.stderr());
}

#[test]
fn the_seccomp_flag_is_checked() {
    let o = run_cli(&["run", "--seccomp", "maybe"]);
    assert_clean_error(&o, "--seccomp");
}

/// Per thread of a running process (by tid): its name and whether it ran
/// under a seccomp filter (`Seccomp: 2` in its status) at the last sample.
#[derive(Default)]
struct Threads {
    /// tid -> (name, samples taken, filtered at the last sample)
    seen: std::collections::BTreeMap<u32, (String, u32, bool)>,
}

impl Threads {
    /// Samples `pid`'s threads; false once the process is gone.
    fn sample(&mut self, pid: u32) -> bool {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        if status.is_empty() || status.contains("State:\tZ") {
            return false;
        }
        let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return false };
        for e in dir.flatten() {
            let Ok(tid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
            let status = std::fs::read_to_string(e.path().join("status")).unwrap_or_default();
            let field = |k: &str| {
                status.lines().find_map(|l| l.strip_prefix(k)).map(|v| v.trim().to_string())
            };
            let (Some(name), Some(mode)) = (field("Name:"), field("Seccomp:")) else { continue };
            let t = self.seen.entry(tid).or_default();
            *t = (name, t.1 + 1, mode == "2");
        }
        true
    }

    /// Samples `pid` every 20 ms for at most `limit` or until it exits.
    fn watch(pids: &[u32], limit: Duration) -> Vec<Threads> {
        let mut all: Vec<Threads> = pids.iter().map(|_| Threads::default()).collect();
        let t = Instant::now();
        for _ in 0..2000 {
            let mut alive = false;
            for (p, th) in pids.iter().zip(all.iter_mut()) {
                alive |= th.sample(*p);
            }
            if !alive || t.elapsed() > limit {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        all
    }

    /// Every thread but the main one (tid == pid) and its `verifyN`
    /// helpers (the CLI's native replay of the guest's result) was filtered
    /// when last seen (a thread seen only once may have been sampled
    /// between its start and its filter), and each of `names` was seen
    /// filtered.
    fn assert_filtered(&self, pid: u32, names: &[&str]) {
        let all = format!("{:?}", self.seen);
        for (tid, (name, samples, filtered)) in &self.seen {
            if *tid != pid && !name.starts_with("verify") && *samples > 1 {
                assert!(filtered, "thread {name} ({tid}) runs without a seccomp filter: {all}");
            }
        }
        for n in names {
            assert!(
                self.seen.values().any(|(name, _, f)| name == n && *f),
                "no filtered thread {n}: {all}"
            );
        }
    }
}

#[test]
fn every_thread_of_a_checkpoint_run_is_filtered() {
    assert!(nl_vmm::open_kvm().is_ok(), "this test needs KVM (/dev/kvm)");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ckpt.bin");
    let mut c = ninelives()
        .args(["checkpoint", "--workload", "memwrite", "--ws", "16M", "--mem", "128M"])
        .args(["--interval", "100", "--mode", "cow-b", "--duration", "3", "--json"])
        .args(["--disk-every", "2", "--disk-path", file.to_str().unwrap()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = c.id();
    let th = Threads::watch(&[pid], Duration::from_secs(60)).remove(0);
    let _ = c.kill();
    let o = c.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // The userfaultfd fault thread and the vCPU run for the whole run.
    th.assert_filtered(pid, &["ckpt-faults", "vm0-vcpu0"]);
}

#[test]
fn every_thread_of_a_replicating_pair_is_filtered() {
    assert!(nl_vmm::open_kvm().is_ok(), "this test needs KVM (/dev/kvm)");
    let ns = Netns::new("seccomp").expect("a network namespace (needs root)");
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("repl.key");
    let key = key.to_str().unwrap();
    assert!(run_cli(&["replicate", "keygen", key]).status.success());
    let spawn = |args: &[&str]| {
        ns.ninelives(args)
            .args(["--key-file", key, "--mem", "128M", "--json"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let mut backup = spawn(&["replicate", "backup", "--listen", "127.0.0.1:7070"]);
    std::thread::sleep(Duration::from_millis(500));
    let mut primary = spawn(&[
        "replicate",
        "primary",
        "--backup",
        "127.0.0.1:7070",
        "--workload",
        "memwrite",
        "--ws",
        "16M",
        "--epoch",
        "20",
        "--pipeline",
        "2",
        "--duration",
        "3",
    ]);
    // `ip netns exec` execs ninelives: the child's pid is the VMM's.
    let (b, p) = (backup.id(), primary.id());
    let mut th = Threads::watch(&[b, p], Duration::from_secs(60));
    let _ = primary.kill();
    let _ = backup.kill();
    let _ = (primary.wait(), backup.wait());
    let pt = th.pop().unwrap();
    let bt = th.pop().unwrap();
    bt.assert_filtered(b, &["repl-accept", "repl-rx"]);
    pt.assert_filtered(p, &["repl-send", "repl-acks", "vm0-vcpu0"]);
}
