//! The lab's child processes, one type for all: [`Proc`] (any child:
//! `ninelives host`, `ping`, `kvload`, a hostile client) and [`HostProc`]
//! (a `ninelives host` with its API socket).
//!
//! A [`Proc`] runs in a process group of its own (a terminal's Ctrl-C does
//! not reach it, and the successors a host execs in a rejuvenation or
//! microreboot stay in the group), has stdin closed, and has its stdout and
//! stderr read line by line into memory by two reader threads, so neither
//! pipe can fill and block it. Dropping it kills the whole group and reaps
//! the child. Every wait is bounded.
//!
//! [`install_cancel_handler`] turns SIGINT and SIGTERM into the [`CANCEL`]
//! flag that long runs (campaigns, benches) poll.

use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::netns::Netns;

/// This binary (`ninelives`), which the lab starts for VMMs and clients.
pub fn exe() -> Result<PathBuf> {
    std::env::current_exe().context("cannot find the ninelives binary")
}

/// Lines a reader thread has collected, and whether its pipe has closed.
#[derive(Clone, Default)]
pub struct Lines {
    lines: Arc<Mutex<Vec<String>>>,
    closed: Arc<AtomicBool>,
}

impl Lines {
    fn read_from(&self, r: impl Read + Send + 'static) {
        let me = self.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(r).lines().map_while(std::io::Result::ok) {
                me.lines.lock().unwrap_or_else(|p| p.into_inner()).push(line);
            }
            me.closed.store(true, Relaxed);
        });
    }

    /// Every line so far.
    pub fn all(&self) -> Vec<String> {
        self.lines.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// True once some line starts with `prefix`.
    pub fn any_starts_with(&self, prefix: &str) -> bool {
        self.lines.lock().unwrap_or_else(|p| p.into_inner()).iter().any(|l| l.starts_with(prefix))
    }

    /// The JSON records of the lines that start with `prefix`.
    pub fn records(&self, prefix: &str) -> Vec<Value> {
        let lines = self.lines.lock().unwrap_or_else(|p| p.into_inner());
        lines
            .iter()
            .filter_map(|l| l.strip_prefix(prefix))
            .filter_map(|j| serde_json::from_str(j).ok())
            .collect()
    }

    /// The last `n` lines, each cut to 600 characters.
    pub fn tail(&self, n: usize) -> Vec<String> {
        let lines = self.lines.lock().unwrap_or_else(|p| p.into_inner());
        let from = lines.len().saturating_sub(n);
        lines[from..].iter().map(|l| l.chars().take(600).collect()).collect()
    }

    /// Everything, one string.
    pub fn text(&self) -> String {
        self.all().join("\n")
    }
}

/// A child process of the lab (see the module documentation).
pub struct Proc {
    child: Child,
    pub stdout: Lines,
    pub stderr: Lines,
}

impl Proc {
    /// Starts `cmd` in a process group of its own.
    pub fn spawn(mut cmd: Command) -> Result<Proc> {
        let what = format!("{:?}", cmd.get_program());
        cmd.process_group(0).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = cmd.spawn().with_context(|| format!("cannot start {what}"))?;
        let (stdout, stderr) = (Lines::default(), Lines::default());
        if let Some(o) = child.stdout.take() {
            stdout.read_from(o);
        }
        if let Some(e) = child.stderr.take() {
            stderr.read_from(e);
        }
        Ok(Proc { child, stdout, stderr })
    }

    /// `ninelives ARGS...`, inside `ns` if given.
    pub fn ninelives(ns: Option<&Netns>, args: &[&str]) -> Result<Proc> {
        let mut c = match ns {
            Some(ns) => ns.ninelives()?,
            None => Command::new(exe()?),
        };
        c.args(args);
        Proc::spawn(c)
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// The exit status once the process has ended.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Waits up to `limit` for the process to end; once it has, also (at
    /// most 1 s more) for its output to be read to the end.
    pub fn wait_for(&mut self, limit: Duration) -> Option<ExitStatus> {
        let t = Instant::now();
        let status = loop {
            if let Some(s) = self.exited() {
                break s;
            }
            if t.elapsed() > limit {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let t = Instant::now();
        while !(self.stdout.closed.load(Relaxed) && self.stderr.closed.load(Relaxed))
            && t.elapsed() < Duration::from_secs(1)
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        Some(status)
    }

    /// Waits up to `limit`, then kills the process group if it still runs;
    /// the last JSON object it printed on stdout.
    pub fn finish(&mut self, limit: Duration) -> Option<Value> {
        if self.wait_for(limit).is_none() {
            self.kill();
            self.wait_for(Duration::from_secs(5));
        }
        self.last_json()
    }

    /// The last JSON object on stdout so far.
    pub fn last_json(&self) -> Option<Value> {
        crate::json_out::last_json(&self.stdout.text())
    }

    /// Kills the process group.
    pub fn kill(&mut self) {
        // SAFETY: kill(2) on the child's own process group (its pid, set up
        // by `process_group(0)`); no memory is involved.
        unsafe { libc::kill(-(self.child.id() as i32), libc::SIGKILL) };
        let _ = self.child.kill();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // The group goes even if the leader has ended: a successor it
        // exec'd or forked may still run in it.
        self.kill();
        let _ = self.child.wait();
    }
}

/// A `ninelives host` process with its API socket.
pub struct HostProc {
    pub proc: Proc,
    sock: PathBuf,
}

impl HostProc {
    /// Starts `ninelives host --api SOCK EXTRA...` (inside `ns` if given,
    /// with `env` set) and waits (at most 20 s) until its API answers.
    pub fn start(
        sock: &Path,
        ns: Option<&Netns>,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Result<HostProc> {
        let sock = sock.to_path_buf();
        let _ = std::fs::remove_file(&sock);
        let mut c = match ns {
            Some(ns) => ns.ninelives()?,
            None => Command::new(exe()?),
        };
        c.arg("host").arg("--api").arg(&sock).args(extra);
        for (k, v) in env {
            c.env(k, v);
        }
        let mut h = HostProc { proc: Proc::spawn(c)?, sock };
        let t = Instant::now();
        while h.api(json!({"op":"list"})).is_err() {
            if let Some(st) = h.proc.exited() {
                bail!(
                    "the host ended ({st}) before its API answered: {}",
                    h.proc.stderr.tail(3).join(" | ")
                );
            }
            if t.elapsed() > Duration::from_secs(20) {
                bail!("the host's API did not answer within 20 s");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(h)
    }

    pub fn sock(&self) -> &Path {
        &self.sock
    }

    pub fn pid(&self) -> i32 {
        self.proc.pid()
    }

    /// One API request; the reply as it is (`ok` true or false).
    pub fn api(&self, req: Value) -> Result<Value> {
        Ok(nl_vmm::api::request(&self.sock, &req)?)
    }

    /// One API request whose reply must say `ok`.
    pub fn req(&self, req: Value) -> Result<Value> {
        self.req_within(req, Duration::from_secs(60))
    }

    /// [`HostProc::req`] with a reply timeout of its own (a rejuvenation
    /// can take long).
    pub fn req_within(&self, req: Value, timeout: Duration) -> Result<Value> {
        let r = nl_vmm::api::request_timeout(&self.sock, &req, timeout)?;
        if r["ok"] != true {
            bail!("host: {}", r["error"]);
        }
        Ok(r)
    }

    /// Waits (at most `limit`) until VM `id` is no longer running; its stats.
    pub fn wait_done(&self, id: u64, limit: Duration) -> Result<Value> {
        let t = Instant::now();
        loop {
            let r = self.api(json!({"op":"stats","id":id}))?;
            if r["stats"]["state"] != "running" {
                return Ok(r["stats"].clone());
            }
            if t.elapsed() > limit {
                bail!("VM {id} did not finish within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A temporary directory of one run, removed with everything in it on drop.
pub struct RunDir(pub PathBuf);

impl RunDir {
    /// A fresh directory under the system's temporary directory.
    pub fn new(tag: &str) -> Result<RunDir> {
        use std::sync::atomic::AtomicU64;
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Relaxed);
        let p = std::env::temp_dir().join(format!("nl-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).with_context(|| format!("cannot create {}", p.display()))?;
        Ok(RunDir(p))
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// Interruption: a lab run that is interrupted stops, cleans up and reports.

/// Set by SIGINT/SIGTERM: stop stepping, detach, clean up, report.
pub static CANCEL: AtomicBool = AtomicBool::new(false);

extern "C" fn on_cancel(_: libc::c_int) {
    CANCEL.store(true, Relaxed);
}

/// Whether SIGINT or SIGTERM arrived since [`install_cancel_handler`].
pub fn cancelled() -> bool {
    CANCEL.load(Relaxed)
}

pub fn install_cancel_handler() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { libc::signal(sig, on_cancel as *const () as libc::sighandler_t) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_is_captured_and_the_group_killed_on_drop() {
        let mut c = Command::new("sh");
        c.args(["-c", "echo one; echo '{\"x\":2}'; echo err >&2; sleep 30 & echo $!; wait"]);
        let mut p = Proc::spawn(c).unwrap();
        let t = Instant::now();
        while p.stdout.all().len() < 3 && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(10));
        }
        let out = p.stdout.all();
        assert_eq!(&out[..2], ["one", "{\"x\":2}"]);
        let sleeper: i32 = out[2].parse().unwrap();
        assert!(p.wait_for(Duration::from_millis(100)).is_none(), "the shell waits for its child");
        drop(p);
        // The grandchild went with the group (bounded wait for the kernel to reap it).
        let t = Instant::now();
        // SAFETY: signal 0 only checks that the pid exists.
        while unsafe { libc::kill(sleeper, 0) } == 0 && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
        let alive = std::fs::read_to_string(format!("/proc/{sleeper}/stat"))
            .is_ok_and(|s| !s.contains(") Z "));
        assert!(!alive, "the process group was not killed");
    }

    #[test]
    fn finish_returns_the_last_json_and_stderr_records() {
        let mut c = Command::new("sh");
        c.args(["-c", "echo '{\"a\":1}'; echo 'REC {\"k\":3}' >&2; echo '{\"a\":2}'"]);
        let mut p = Proc::spawn(c).unwrap();
        assert_eq!(p.finish(Duration::from_secs(10)), Some(json!({"a":2})));
        assert_eq!(p.stderr.records("REC "), vec![json!({"k":3})]);
    }
}
