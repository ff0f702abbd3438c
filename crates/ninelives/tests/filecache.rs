//! The filecache workload end to end: a cache in guest memory over a data
//! set on the virtio-blk disk, hits and misses visible to the host while it
//! runs and in the result, verification by host replay, a rebooted guest
//! finding its data set on the disk, and a warm rejuvenation under it.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use common::*;
use nl_vmm::{DiskConfig, Vm, VmOutcome};
use serde_json::{json, Value};

const DATA: u64 = 8 << 20;

fn disk(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(nl_workloads::filecache::disk_bytes(DATA)).unwrap();
    p
}

/// Runs one filecache VM on `path` to completion in this process; returns
/// its final registers and console.
fn run_vm(path: &Path, ms: u64) -> (nl_devices::control::VcpuRegsSnapshot, String) {
    let mut c = config(params(nl_abi::WORKLOAD_FILECACHE, ms), 1);
    c.disk = Some(DiskConfig { path: path.to_path_buf(), readonly: false });
    let kvm = nl_vmm::open_kvm().unwrap();
    let vm = Vm::create(&kvm, 0, c).unwrap();
    vm.start().unwrap();
    let outcome = vm.wait(Duration::from_secs(120));
    let console = vm.console().tail();
    assert_eq!(outcome, VmOutcome::Completed, "{console}");
    let r = vm.control().vcpus[0].snapshot();
    let rep = nl_workloads::native::replay(&vm.config().workload, 0, r.rounds, 0).unwrap();
    assert_eq!(rep.digest, r.digest, "digest after {} rounds", r.rounds);
    assert_eq!((rep.ops, rep.warmup_ops), (r.ops, r.warmup_ops));
    assert_eq!((rep.cache_hits, rep.cache_misses), (r.cache_hits, r.cache_misses));
    (r, console)
}

/// The data set is written by the first boot and found by the second (a
/// rebooted guest, same disk), with the same verified result either way.
#[test]
fn filecache_verifies_and_a_second_boot_finds_its_data_set() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = disk(dir.path(), "fc.img");
    let (r1, c1) = run_vm(&img, 600);
    assert!(c1.contains("data set of 8 MiB written to the disk"), "{c1}");
    assert!(r1.cache_hits > 0 && r1.cache_misses > 0, "{r1:?}");
    // The whole data set fits in the default cache: each block misses once at most.
    assert!(r1.cache_misses <= DATA / nl_workloads::filecache::BLOCK_BYTES, "{r1:?}");
    assert_eq!(r1.ops, (r1.cache_hits + r1.cache_misses) * nl_workloads::filecache::BLOCK_BYTES);
    let (r2, c2) = run_vm(&img, 300);
    assert!(c2.contains("data set of 8 MiB found on the disk"), "{c2}");
    assert!(r2.cache_hits > 0, "{r2:?}");
}

#[test]
fn filecache_cli_reports_hits_and_misses() {
    if !kvm_available() {
        return;
    }
    // No --disk: a temporary image of the size the data set needs.
    let o = run_cli(&[
        "run",
        "--workload",
        "filecache",
        "--data",
        "16M",
        "--mem",
        "128M",
        "--duration",
        "0.5",
        "--json",
    ]);
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    let j = &last_json(&o)["vms"][0];
    assert_eq!(j["workload"], "filecache");
    assert_eq!(j["digest_ok"], true, "{j}");
    let (hits, misses) = (j["cache_hits"].as_u64().unwrap(), j["cache_misses"].as_u64().unwrap());
    assert!(hits > 0 && misses > 0, "{j}");
    assert!(stdout(&o).contains("cache hits"), "{}", stdout(&o));
    // Other workloads do not report cache counters.
    let o = run_cli(&["run", "--workload", "compute", "--duration", "0.1", "--json"]);
    assert!(last_json(&o)["vms"][0].get("cache_hits").is_none());
}

#[test]
fn filecache_bad_setups_are_clear_errors() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let small = dir.path().join("small.img");
    std::fs::write(&small, vec![0u8; 1 << 20]).unwrap();
    let small = small.to_string_lossy().into_owned();
    let fc = ["run", "--workload", "filecache"];
    let with = |extra: &[&str]| run_cli(&[&fc[..], extra].concat());
    assert_clean_error(&with(&["--disk", &small]), "filecache needs at least 193 MiB");
    assert_clean_error(&with(&["--vcpus", "2"]), "one vCPU");
    assert_clean_error(&with(&["--data", "1000"]), "multiple of the 16 KiB block");
    assert_clean_error(&with(&["--ws", "64K"]), "too small");
    assert_clean_error(&with(&["--data", "512M"]), "guest memory too small");
    // Over the API: a create without a disk is refused with the reason.
    let d = tempfile::tempdir().unwrap();
    let h = ApiHost::start(d.path());
    let r = h.req(json!({"op":"create","workload":"filecache","data":"8M","mem":"64M"}));
    assert_eq!(r["ok"], false, "{r}");
    assert!(r["error"].as_str().unwrap().contains("filecache needs a disk"), "{r}");
}

/// A host started by a test; after a handover its pid changes, so the
/// current pid is asked for and killed on drop.
struct ApiHost {
    child: Child,
    sock: PathBuf,
}

impl ApiHost {
    fn start(dir: &Path) -> Self {
        let sock = dir.join("api.sock");
        let (child, _) = spawn_host(&sock);
        ApiHost { child, sock }
    }

    fn req(&self, v: Value) -> Value {
        nl_vmm::api::request_timeout(&self.sock, &v, Duration::from_secs(120))
            .unwrap_or_else(|e| panic!("no reply to {v}: {e}"))
    }

    fn regs(&self, id: u64) -> (String, Value) {
        let r = self.req(json!({"op":"stats","id":id}));
        assert_eq!(r["ok"], true, "{r}");
        (r["stats"]["state"].as_str().unwrap().to_string(), r["stats"]["vcpus"][0]["regs"].clone())
    }

    /// Waits (bounded) until the VM has served requests from its cache.
    fn wait_hits(&self, id: u64) -> Value {
        let t = Instant::now();
        loop {
            let (state, regs) = self.regs(id);
            assert_eq!(state, "running", "{regs}");
            if regs["cache_hits"].as_u64().unwrap() > 0 {
                return regs;
            }
            assert!(t.elapsed() < Duration::from_secs(60), "no cache hits reported: {regs}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits (bounded) for the VM to complete and checks it by host replay.
    /// `seed` and `secs` are what the VM was created with (a filecache of
    /// `DATA` bytes, one vCPU).
    fn assert_completes_verified(&self, id: u64, seed: u64, secs: f64) -> Value {
        let t = Instant::now();
        let s = loop {
            let r = self.req(json!({"op":"stats","id":id}));
            if r["stats"]["state"] != "running" {
                break r["stats"].clone();
            }
            assert!(t.elapsed() < Duration::from_secs(120), "VM {id} did not finish");
            std::thread::sleep(Duration::from_millis(50));
        };
        assert_eq!(s["state"], "completed", "{s}");
        let asked = json!({"kind": "filecache", "seed": seed,
            "data_bytes": DATA, "duration_ms": (secs * 1000.0) as u64, "vcpus": 1});
        assert_stats_replay(id, &asked, &s);
        let regs = &s["vcpus"][0]["regs"];
        let p = workload_params(&s["workload"]);
        let rounds = regs["rounds"].as_u64().unwrap();
        let rep = nl_workloads::native::replay(&p, 0, rounds, 0).unwrap();
        assert_eq!(regs["cache_hits"].as_u64(), Some(rep.cache_hits), "{regs}");
        assert_eq!(regs["cache_misses"].as_u64(), Some(rep.cache_misses), "{regs}");
        regs.clone()
    }
}

impl Drop for ApiHost {
    fn drop(&mut self) {
        stop_host(&self.sock, &mut self.child);
    }
}

/// Hits and misses are visible in `stats` while the VM runs, and the
/// finished VM verifies by host replay (its counters included).
#[test]
fn hits_and_misses_are_live_in_stats_and_the_result_verifies() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = disk(dir.path(), "api.img");
    let h = ApiHost::start(dir.path());
    let r = h.req(json!({"op":"create","workload":"filecache","data":DATA,"mem":"64M",
        "disk":img,"duration":1.5,"seed":3}));
    assert_eq!(r["ok"], true, "{r}");
    let id = r["id"].as_u64().unwrap();
    let live = h.wait_hits(id);
    assert_eq!(live["phase"], nl_abi::PHASE_MEASURE_START, "{live}");
    let done = h.assert_completes_verified(id, 3, 1.5);
    assert!(done["cache_hits"].as_u64() >= live["cache_hits"].as_u64(), "{done} {live}");
    assert!(done["cache_misses"].as_u64().unwrap() > 0, "{done}");
}

/// A warm rejuvenation under a running filecache VM: the cache (guest
/// memory) survives, so the counters keep growing, and the VM completes
/// with a verified digest.
#[test]
fn a_filecache_vm_survives_a_warm_rejuvenation_and_verifies() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = disk(dir.path(), "warm.img");
    let h = ApiHost::start(dir.path());
    let r = h.req(json!({"op":"create","workload":"filecache","data":DATA,"mem":"64M",
        "disk":img,"duration":3.0,"seed":4}));
    assert_eq!(r["ok"], true, "{r}");
    let id = r["id"].as_u64().unwrap();
    let before = h.wait_hits(id);
    let o = run_cli(&["rejuvenate", "--api", h.sock.to_str().unwrap(), "--mode", "warm", "--json"]);
    let rep = last_json(&o);
    assert!(o.status.success(), "{rep} {}", stderr(&o));
    assert_eq!(rep["ok"], true, "{rep}");
    assert_eq!(rep["rolled_back"], false, "{rep}");
    let (_, after) = h.regs(id);
    for k in ["heartbeat", "cache_hits", "cache_misses"] {
        assert!(after[k].as_u64() >= before[k].as_u64(), "{k} went back: {after} {before}");
    }
    let done = h.assert_completes_verified(id, 4, 3.0);
    assert!(done["cache_hits"].as_u64() > before["cache_hits"].as_u64(), "{done}");
}
