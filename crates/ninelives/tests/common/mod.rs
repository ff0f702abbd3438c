//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod selftest_host;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use std::time::Duration;

use nl_abi::WorkloadParams;
use nl_vmm::VmConfig;

/// A prerequisite a test may find missing on this machine.
#[derive(Clone, Copy, Debug)]
pub enum Prereq {
    /// /dev/kvm (any KVM backend).
    Kvm,
    /// Root: network namespaces (the lab's rtnetlink helper), TAP and veth devices.
    Netns,
    /// A headless browser (Debian's `chromium`) for the report page.
    Browser,
}

impl Prereq {
    /// The environment variable that turns a skip for this prerequisite
    /// into a failure (`.ci/run` sets both).
    pub fn require_var(self) -> &'static str {
        match self {
            Prereq::Kvm => "NINELIVES_REQUIRE_KVM",
            Prereq::Netns => "NINELIVES_REQUIRE_NETNS",
            Prereq::Browser => "NINELIVES_REQUIRE_BROWSER",
        }
    }
}

/// Reports that the calling test cannot run here because `what` is missing.
///
/// With `NINELIVES_REQUIRE_KVM=1` / `NINELIVES_REQUIRE_NETNS=1` (CI) this
/// panics: a missing prerequisite is a failure there, never a pass.
/// Otherwise the SKIPPED line is written with `std::io::stderr().write_all`,
/// which libtest's output capture does not intercept (it captures only the
/// `print!`/`eprint!` macros), so plain `cargo test` shows it next to the
/// test's `ok` line without `--nocapture`.
pub fn skip(what: Prereq, why: &str) {
    use std::io::Write;
    let var = what.require_var();
    let test = std::thread::current().name().unwrap_or("?").to_string();
    if std::env::var(var).is_ok_and(|v| v == "1") {
        panic!("{var}=1 but {what:?} is missing, so {test} cannot run: {why}");
    }
    let line = format!(
        "\n*** SKIPPED {test}: {what:?} missing ({why}); set {var}=1 to fail instead ***\n"
    );
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// How much longer than its nominal bound every wait of the sandbox tests
/// may take: on a loaded 2-core host, building a restarted sandbox's VM
/// alone took up to 30 s (CI beside a report run: the 60 s restart wait ran
/// out). The bounds stay bounds; a passing run is not slower.
pub const LOADED: u32 = 3;

/// Polls `f` every 2 ms until it holds or `limit` (times [`LOADED`])
/// passes; then panics naming `what`, with `state()` in the message.
pub fn wait_or(
    what: &str,
    limit: Duration,
    mut f: impl FnMut() -> bool,
    state: impl Fn() -> String,
) {
    let limit = limit * LOADED;
    let t = std::time::Instant::now();
    for _ in 0..(limit.as_millis() / 2 + 1) {
        if f() {
            return;
        }
        if t.elapsed() > limit {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    panic!("timed out after {limit:?} waiting for {what}\n{}", state());
}

/// [`wait_or`] with nothing more in the message.
pub fn wait_for(what: &str, limit: Duration, f: impl FnMut() -> bool) {
    wait_or(what, limit, f, String::new);
}

/// Whether KVM can be used. When it cannot, the test is skipped loudly
/// (see [`skip`]: a failure under `NINELIVES_REQUIRE_KVM=1`).
pub fn kvm_available() -> bool {
    match nl_vmm::open_kvm() {
        Ok(_) => true,
        Err(e) => {
            skip(Prereq::Kvm, &e.to_string());
            false
        }
    }
}

pub fn ninelives() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ninelives"))
}

/// Runs the CLI and returns its output.
pub fn run_cli(args: &[&str]) -> Output {
    ninelives().args(args).output().expect("the ninelives binary runs")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The JSON object on the last line of stdout.
pub fn last_json(o: &Output) -> serde_json::Value {
    let out = stdout(o);
    let line = out.lines().last().unwrap_or_else(|| panic!("no stdout; stderr: {}", stderr(o)));
    serde_json::from_str(line).unwrap_or_else(|e| panic!("last line is not JSON ({e}): {line}"))
}

/// Asserts a failure is a clear one-line error, not a panic.
pub fn assert_clean_error(o: &Output, needle: &str) {
    let err = stderr(o);
    assert!(!o.status.success(), "expected failure, got success; stdout: {}", stdout(o));
    assert!(!err.contains("panicked"), "must not panic: {err}");
    assert!(!err.contains("RUST_BACKTRACE"), "must not print a backtrace hint: {err}");
    let all = format!("{}{}", stdout(o), err);
    assert!(all.to_lowercase().contains(&needle.to_lowercase()), "expected '{needle}' in: {all}");
}

/// Workload parameters as the CLI defaults would give.
pub fn params(kind: u64, duration_ms: u64) -> WorkloadParams {
    WorkloadParams {
        kind,
        seed: 7,
        ws_bytes: match kind {
            nl_abi::WORKLOAD_MEMWRITE => 16 << 20,
            nl_abi::WORKLOAD_BLKBENCH => nl_workloads::blk::BLKBENCH_WS_BYTES,
            nl_abi::WORKLOAD_FILECACHE => nl_workloads::filecache::ws_bytes_for(8 << 20),
            _ => 0,
        },
        write_pct: 50,
        pattern: nl_abi::PATTERN_RANDOM,
        stride: 4096,
        hot_pct: 10,
        duration_ms,
        data_bytes: if kind == nl_abi::WORKLOAD_FILECACHE { 8 << 20 } else { 0 },
    }
}

/// A VM configuration booting the embedded reference guest.
pub fn config(workload: WorkloadParams, vcpus: u32) -> VmConfig {
    VmConfig {
        mem_bytes: 128 << 20,
        vcpus,
        workload,
        kernel: Arc::new(nl_guest::KERNEL_ELF.to_vec()),
        user: Arc::new(nl_guest::USER_ELF.to_vec()),
        console_path: None,
        timer_hz: 100,
        heartbeat_timeout: Duration::from_secs(20),
        disk: None,
        net: None,
    }
}

/// A minimal static ELF64 executable whose one segment holds `code` at the
/// kernel base, entry at its first byte.
pub fn tiny_elf(code: &[u8]) -> Vec<u8> {
    let base = nl_abi::KERNEL_BASE;
    let mut e = Vec::new();
    e.extend_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    e.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    e.extend_from_slice(&0x3eu16.to_le_bytes()); // x86-64
    e.extend_from_slice(&1u32.to_le_bytes());
    e.extend_from_slice(&base.to_le_bytes()); // entry
    e.extend_from_slice(&64u64.to_le_bytes()); // phoff
    e.extend_from_slice(&0u64.to_le_bytes()); // shoff
    e.extend_from_slice(&0u32.to_le_bytes()); // flags
    for v in [64u16, 56, 1, 64, 0, 0] {
        e.extend_from_slice(&v.to_le_bytes());
    }
    assert_eq!(e.len(), 64);
    e.extend_from_slice(&1u32.to_le_bytes()); // PT_LOAD
    e.extend_from_slice(&7u32.to_le_bytes()); // RWX
    e.extend_from_slice(&120u64.to_le_bytes()); // offset
    e.extend_from_slice(&base.to_le_bytes()); // vaddr
    e.extend_from_slice(&base.to_le_bytes()); // paddr
    e.extend_from_slice(&(code.len() as u64).to_le_bytes());
    e.extend_from_slice(&(code.len() as u64).to_le_bytes());
    e.extend_from_slice(&0x1000u64.to_le_bytes());
    e.extend_from_slice(code);
    e
}

pub fn write_file(dir: &Path, name: &str, bytes: &[u8]) -> String {
    let p = dir.join(name);
    std::fs::write(&p, bytes).expect("write temp file");
    p.to_string_lossy().into_owned()
}

/// Starts `ninelives host --api SOCK` (output discarded) and returns once it
/// accepts connections, with a connected stream. Panics after 20 s.
/// The caller owns the child and must kill and wait for it.
pub fn spawn_host(sock: &Path) -> (std::process::Child, std::os::unix::net::UnixStream) {
    spawn_host_with(sock, &[])
}

/// [`spawn_host`] with more `host` options.
#[allow(clippy::zombie_processes)] // the child is returned to the caller, who reaps it
pub fn spawn_host_with(
    sock: &Path,
    extra: &[&str],
) -> (std::process::Child, std::os::unix::net::UnixStream) {
    let mut child = ninelives()
        .args(["host", "--api", sock.to_str().expect("utf-8 path")])
        .args(extra)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("the ninelives binary starts");
    let t = std::time::Instant::now();
    loop {
        if let Ok(s) = std::os::unix::net::UnixStream::connect(sock) {
            s.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout set");
            return (child, s);
        }
        if let Ok(Some(st)) = child.try_wait() {
            panic!("host exited before listening ({st}); options {extra:?}");
        }
        if t.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("host did not start listening");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Replays a completed VM's workload natively and checks every vCPU's
/// digest and op count. The replay's parameters are what the TEST asked
/// for (`requested`: `WorkloadParams` fields by name, plus `vcpus`), not
/// what the VMM under test reports: each requested field is first compared
/// with the VMM's `stats.workload`, so a create that dropped or changed a
/// field fails here by its name; the fields the test left to the defaults
/// are taken from the report.
/// The `WorkloadParams` a VM's `stats.workload` describes: the API names
/// the kind and the access pattern (`"memwrite"`, `"random"`).
#[allow(dead_code)]
pub fn workload_params(named: &serde_json::Value) -> nl_abi::WorkloadParams {
    let mut v = named.clone();
    let kind = named["kind"].as_str().unwrap_or_else(|| panic!("a workload kind by name: {named}"));
    v["kind"] = nl_abi::workload_kind(kind).unwrap_or_else(|| panic!("kind {kind}")).into();
    let pattern = named["pattern"].as_str().unwrap_or_else(|| panic!("a pattern by name: {named}"));
    v["pattern"] =
        nl_abi::pattern_of(pattern).unwrap_or_else(|| panic!("pattern {pattern}")).into();
    serde_json::from_value(v).expect("workload parameters")
}

#[allow(dead_code)]
pub fn assert_stats_replay(id: u64, requested: &serde_json::Value, s: &serde_json::Value) {
    let reported = &s["workload"];
    let mut asked = reported.clone();
    for (k, v) in requested.as_object().expect("the requested fields as a JSON object") {
        if k == "vcpus" {
            let n = s["vcpus"].as_array().map_or(0, Vec::len) as u64;
            assert_eq!(
                Some(n),
                v.as_u64(),
                "VM {id} reports {n} vCPUs, but the test asked for {v}"
            );
            continue;
        }
        assert!(reported.get(k).is_some(), "VM {id} reports no workload.{k}: {reported}");
        assert_eq!(
            &reported[k], v,
            "VM {id} runs with workload.{k} = {}, but the test asked for {v}",
            reported[k]
        );
        asked[k] = v.clone();
    }
    let params = workload_params(&asked);
    for (cpu, v) in s["vcpus"].as_array().unwrap().iter().enumerate() {
        let r = &v["regs"];
        let rounds = r["rounds"].as_u64().unwrap();
        let rep = nl_workloads::native::replay(&params, cpu as u64, rounds, 0).unwrap();
        assert_eq!(rep.digest, r["digest"].as_u64().unwrap(), "VM {id} vCPU {cpu} digest");
        assert_eq!(rep.ops, r["ops"].as_u64().unwrap(), "VM {id} vCPU {cpu} ops");
    }
}

/// A network namespace of the test's own with TAP `nltap0` at 10.0.0.1/24
/// (the guest is 10.0.0.2), deleted on drop (the lab's helper,
/// [`nl_lab::netns::Netns`]). Only addresses inside it are used.
pub struct Netns(pub nl_lab::netns::Netns);

impl Netns {
    /// None (after [`skip`]: a failure under `NINELIVES_REQUIRE_NETNS=1`)
    /// without root.
    pub fn new(tag: &str) -> Option<Netns> {
        if let Some(why) = nl_lab::netns::unavailable() {
            skip(Prereq::Netns, &format!("cannot create a network namespace ({why})"));
            return None;
        }
        let name = format!("nl-test-{tag}-{}", std::process::id());
        Some(Netns(nl_lab::netns::Netns::with_tap(&name, "nltap0").expect("the test's namespace")))
    }

    /// A namespace with only loopback: no TAP, no address (unlike
    /// [`Netns::new`]). None (after [`skip`]) when it cannot be created.
    pub fn bare(tag: &str) -> Option<Netns> {
        let name = format!("nl-test-{tag}-{}", std::process::id());
        match nl_lab::netns::Netns::new(&name) {
            Ok(n) => Some(Netns(n)),
            Err(e) => {
                skip(Prereq::Netns, &format!("cannot create a network namespace: {e:#}"));
                None
            }
        }
    }

    /// Creates a sandbox set from `config` inside the namespace (its TAPs
    /// are opened there), runs `body` while the set is supervised (at most
    /// 600 s), stops it and returns its report; a panic in `body` comes
    /// back after the set stopped.
    pub fn supervised_set(
        &self,
        config: &str,
        body: impl FnOnce(&nl_sandbox::SandboxSet) + Send,
    ) -> nl_sandbox::SetReport {
        let config = nl_sandbox::SetConfig::parse(config).expect("config");
        self.0
            .run_in(|| {
                let kvm = nl_vmm::open_kvm().expect("kvm");
                let s = nl_sandbox::SandboxSet::create(&kvm, config, &sandbox_images())
                    .expect("sandbox set");
                s.start_all().expect("start");
                Ok(std::thread::scope(|scope| {
                    let h = scope.spawn(|| s.supervise(Duration::from_secs(600)));
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(&s)));
                    s.request_stop();
                    let report = h.join().expect("supervision");
                    if let Err(p) = r {
                        std::panic::resume_unwind(p);
                    }
                    report
                }))
            })
            .expect("the namespace")
    }

    /// This binary, run inside the namespace.
    pub fn ninelives(&self, args: &[&str]) -> Command {
        let mut c = self.0.command(env!("CARGO_BIN_EXE_ninelives")).expect("the namespace opens");
        c.args(args);
        c
    }

    /// Waits (at most 100 tries and `within`) until the guest at 10.0.0.2
    /// answers a short ping from inside the namespace.
    pub fn wait_answering(&self, within: Duration) -> bool {
        self.wait_answering_at("10.0.0.2", within)
    }

    /// [`Netns::wait_answering`] for the guest at `ip`.
    pub fn wait_answering_at(&self, ip: &str, within: Duration) -> bool {
        let t = std::time::Instant::now();
        for _ in 0..100 {
            let o = self
                .ninelives(&["ping", "--target", ip, "--interval", "10ms", "--duration", "0.05"])
                .stdin(std::process::Stdio::null())
                .output()
                .unwrap();
            if o.status.success() {
                return true;
            }
            if t.elapsed() > within {
                break;
            }
        }
        false
    }
}

/// Ends a host started by a test, and the process serving its socket now if
/// a rejuvenation replaced it (a new pid the test did not start).
pub fn stop_host(sock: &Path, child: &mut std::process::Child) {
    let info = serde_json::json!({"op":"info"});
    if let Ok(v) = nl_vmm::api::request_timeout(sock, &info, Duration::from_secs(5)) {
        if let Some(pid) = v["pid"].as_u64() {
            if pid != u64::from(child.id()) {
                let _ = Command::new("kill").arg(pid.to_string()).status();
            }
        }
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Ends, when dropped, the host serving `sock`: a test that fails midway
/// leaves no host behind, also after a rejuvenation started a process the
/// test did not (its own child is the caller's to kill and reap).
#[allow(dead_code)]
pub struct EndHostOnDrop(pub PathBuf);

impl Drop for EndHostOnDrop {
    fn drop(&mut self) {
        let info = serde_json::json!({"op":"info"});
        if let Ok(v) = nl_vmm::api::request_timeout(&self.0, &info, Duration::from_secs(5)) {
            if let Some(pid) = v["pid"].as_u64() {
                let _ = Command::new("kill").arg(pid.to_string()).status();
            }
        }
    }
}

/// One HTTP exchange on a fresh connection: (status, body).
#[allow(dead_code)]
pub fn http(sock: &Path, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::os::unix::net::UnixStream;
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let body = body.unwrap_or("");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut r = BufReader::new(s);
    let mut status_line = String::new();
    r.read_line(&mut status_line).unwrap();
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status in '{status_line}'"));
    let mut length = None;
    let mut version = None;
    loop {
        let mut h = String::new();
        r.read_line(&mut h).unwrap();
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        let (name, value) = h.split_once(':').unwrap();
        if name.eq_ignore_ascii_case("content-length") {
            length = value.trim().parse::<usize>().ok();
        }
        if name.eq_ignore_ascii_case("ninelives-api-version") {
            version = Some(value.trim().to_string());
        }
    }
    assert_eq!(version.as_deref(), Some("1"), "{method} {path}: no API version header");
    let mut b = vec![0; length.expect("Content-Length")];
    r.read_exact(&mut b).unwrap();
    (status, String::from_utf8(b).unwrap())
}

#[allow(dead_code)]
pub fn http_json(
    sock: &Path,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> (u16, serde_json::Value) {
    let (status, b) = http(sock, method, path, body);
    (status, serde_json::from_str(&b).unwrap_or_else(|e| panic!("{method} {path}: {e}: {b}")))
}

/// The reference guest's images, for sandbox sets built in a test.
#[allow(dead_code)]
pub fn sandbox_images() -> nl_sandbox::Images {
    nl_sandbox::Images {
        kernel: Arc::new(nl_guest::KERNEL_ELF.to_vec()),
        user: Arc::new(nl_guest::USER_ELF.to_vec()),
    }
}

/// Two cores a sandbox test may use: the host's first and last (the same
/// one on a one-core host).
#[allow(dead_code)]
pub fn two_cores() -> [usize; 2] {
    let c = nl_sandbox::affinity::host_cores().expect("affinity");
    [c[0], *c.last().expect("a core")]
}

/// A sandbox ran to completion with its result verified (its console in
/// the message otherwise).
#[allow(dead_code)]
pub fn assert_completed_and_verified(sb: &nl_sandbox::SandboxReport) {
    assert_eq!(
        sb.outcome,
        nl_vmm::VmOutcome::Completed,
        "{}: {} {:?}\n{}",
        sb.name,
        sb.message,
        sb.problem,
        sb.console
    );
    assert!(sb.verified, "{}: {:?}", sb.name, sb.problem);
}

/// A sandbox set from a configuration text (not started).
#[allow(dead_code)]
pub fn sandbox_set(text: &str) -> nl_sandbox::SandboxSet {
    let kvm = nl_vmm::open_kvm().expect("kvm");
    let config = nl_sandbox::SetConfig::parse(text).expect("config");
    nl_sandbox::SandboxSet::create(&kvm, config, &sandbox_images()).expect("sandbox set")
}

/// Held by the tests whose checks need a guest to keep pace with the
/// host: those that reserve CPU budgets (`SCHED_DEADLINE` or a budget
/// cgroup: two reservations on the same core at once could be refused by
/// the kernel's admission control or blur each other's throttling counts)
/// and those that inject fault after fault into a kv service under load.
/// Each of them used to run alone in a test binary of its own; now that
/// the tests share one binary, at most one of them runs at a time (other
/// tests still run beside it).
pub fn pace_sensitive() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A thread's scheduling policy (`libc::SCHED_*`), from its `stat`.
pub fn thread_policy(tid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).ok()?;
    // Fields after the command name (which may hold blanks) start at 3.
    stat.rsplit_once(')')?.1.split_whitespace().nth(41 - 3)?.parse().ok()
}
