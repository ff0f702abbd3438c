//! A `ninelives host` for tests of its self-test fault points: started
//! with options and environment, its stderr kept for the detection and
//! recovery lines, killed on drop.

use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{assert_stats_replay, ninelives};

pub struct SelftestHost {
    pub child: Child,
    pub sock: PathBuf,
    err: PathBuf,
    _dir: tempfile::TempDir,
    /// The workload each VM was created with, as the test asked for it.
    asked: std::cell::RefCell<std::collections::HashMap<u64, Value>>,
}

impl SelftestHost {
    /// A host started with `args` and the self-test variables `env`.
    pub fn start_env(args: &[&str], env: &[(&str, &str)]) -> Self {
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
        let h = SelftestHost { child, sock, err, _dir: dir, asked: Default::default() };
        let t = Instant::now();
        while UnixStream::connect(&h.sock).is_err() {
            assert!(t.elapsed() < Duration::from_secs(20), "the host did not start");
            std::thread::sleep(Duration::from_millis(10));
        }
        h
    }

    /// One request on a new connection; None if it was not answered.
    pub fn req(&self, v: Value) -> Option<Value> {
        nl_vmm::api::request_timeout(&self.sock, &v, Duration::from_secs(30)).ok()
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    /// The JSON of every stderr line starting with `prefix`.
    pub fn lines(&self, prefix: &str) -> Vec<Value> {
        self.stderr()
            .lines()
            .filter_map(|l| l.strip_prefix(prefix))
            .filter_map(|j| serde_json::from_str(j).ok())
            .collect()
    }

    /// Waits (bounded) for the host to end; its exit code.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<i32> {
        let t = Instant::now();
        while t.elapsed() < limit {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Creates a 64M VM running `workload` for `secs`; its id.
    pub fn create(&self, workload: &str, secs: f64) -> u64 {
        // A seed other than the default (1), so a create that ignored it fails.
        let seed = 9;
        let r = self
            .req(json!({"op":"create","workload":workload,"mem":"64M","duration":secs,
                "seed":seed}))
            .expect("create answered");
        assert_eq!(r["ok"], true, "{r}");
        let id = r["id"].as_u64().unwrap();
        assert!(nl_abi::workload_kind(workload).is_some(), "a known workload name");
        // The stats name the kind, as the create did.
        let asked = json!({"kind": workload, "seed": seed,
            "duration_ms": (secs * 1000.0) as u64, "vcpus": 1});
        self.asked.borrow_mut().insert(id, asked);
        id
    }

    /// Waits (bounded) for a VM to complete, then replays its workload
    /// natively and checks every vCPU's digest and op count.
    pub fn assert_completes_verified(&self, id: u64) {
        let t = Instant::now();
        let s = loop {
            let r = self.req(json!({"op":"stats","id":id})).unwrap_or(Value::Null);
            let s = r["stats"].clone();
            // A VM is paused for a moment while a recovery ends.
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
        let asked = self.asked.borrow().get(&id).cloned().expect("a VM this host created");
        assert_stats_replay(id, &asked, &s);
    }
}

impl Drop for SelftestHost {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
