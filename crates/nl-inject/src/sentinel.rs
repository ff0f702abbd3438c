//! Code faults repaired at the moment they are detected.
//!
//! A bit flipped in the VMM's code stays there until something puts it back.
//! The paper's injector repairs it when the error is detected, so that the
//! fault acts like a transient one. Seen from outside the process, the
//! earliest such moment is the fault signal itself. So, for a `code` fault
//! under recovery, the injection runs in a sentinel process that, just
//! before the bit is flipped, traces every thread of the VMM (new ones too):
//!
//! * a SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGTRAP or SIGABRT stops the faulting thread
//!   before its handler runs. The sentinel puts the code back, writes the
//!   VMM's repair flag ([`nl_vmm::recovery::INJECTOR_REPAIR_ENV`]) and
//!   detaches every thread, delivering the signal, so the VMM detects the
//!   error as it would untraced;
//! * an error the VMM detects otherwise (a panic, a hang) is reported to the
//!   sentinel by the campaign with SIGUSR1: it repairs then;
//! * SIGTERM (the run's end) repairs a fault that never showed, and detaches.
//!
//! Other signals are passed on as they come. The sentinel is a process of
//! its own so that its waits see only its tracees, never the campaign's
//! children. It prints the injection record as its first line of stdout,
//! and how the repair went as its last.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use nix::errno::Errno;
use nix::sys::ptrace;
use nix::unistd::Pid;
use serde_json::{json, Value};

use crate::{inject_traced, poke, wait_event, Alarm, Event, Injection, Plan, Traced};

/// The arguments of the hidden `ninelives inject sentinel` command.
#[derive(clap::Args, Clone, Debug)]
pub struct SentinelArgs {
    /// The VMM process.
    #[arg(long)]
    pub pid: i32,
    /// The thread to inject into, and its name.
    #[arg(long)]
    pub tid: i32,
    #[arg(long)]
    pub thread: String,
    /// The injection plan (JSON).
    #[arg(long)]
    pub plan: String,
    /// Wall-time budget for stepping the target (ms).
    #[arg(long)]
    pub budget_ms: u64,
    /// The VMM's repair flag file, written once the code is repaired.
    #[arg(long)]
    pub flag: PathBuf,
    /// Give up (repair, detach) after this many seconds.
    #[arg(long, default_value_t = 120.0)]
    pub limit_s: f64,
}

static REPAIR_NOW: AtomicBool = AtomicBool::new(false);
static FINISH: AtomicBool = AtomicBool::new(false);

extern "C" fn on_repair(_: libc::c_int) {
    REPAIR_NOW.store(true, Relaxed);
}

extern "C" fn on_finish(_: libc::c_int) {
    FINISH.store(true, Relaxed);
}

fn install_handlers() {
    for (sig, handler) in [
        (libc::SIGUSR1, on_repair as extern "C" fn(libc::c_int)),
        (libc::SIGTERM, on_finish),
        (libc::SIGINT, on_finish),
    ] {
        // SAFETY: a zeroed sigaction is a valid start; the handlers only store
        // to an atomic (async-signal-safe); no SA_RESTART, so waits return EINTR.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = handler as *const () as usize;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

/// Signals a flipped instruction raises in the thread that runs it (SIGABRT:
/// a check in the code, such as glibc's stack protector, caught it).
fn is_fault(sig: i32) -> bool {
    matches!(
        sig,
        libc::SIGSEGV | libc::SIGBUS | libc::SIGILL | libc::SIGFPE | libc::SIGTRAP | libc::SIGABRT
    )
}

/// Why the watch ended.
enum End {
    /// A fault signal stopped this thread.
    Signal(Pid, i32),
    /// The campaign saw the VMM detect an error (SIGUSR1).
    Request,
    /// The run ended (SIGTERM) or the time limit passed.
    Finish,
    /// The process replaced its image (microreboot): the flipped code is gone.
    Exec,
    /// Every traced thread ended.
    Gone,
}

/// `ninelives inject sentinel`: inject, watch, repair, report.
pub fn run(a: SentinelArgs) -> Result<std::process::ExitCode> {
    install_handlers();
    let plan: Plan = serde_json::from_str(&a.plan).context("--plan is not an injection plan")?;
    let limit = Instant::now() + Duration::from_secs_f64(a.limit_s.clamp(1.0, 3600.0));
    let alarm = Rc::new(Alarm::new());
    let never = AtomicBool::new(false);
    let options = ptrace::Options::PTRACE_O_TRACECLONE | ptrace::Options::PTRACE_O_TRACEEXEC;
    let mut others: Vec<Traced> = Vec::new();
    let injected = inject_traced(
        &plan,
        a.pid,
        (&a.thread, a.tid),
        Duration::from_millis(a.budget_ms),
        &never,
        limit,
        &alarm,
        &mut |traced| {
            // Every other thread, before the bit flips: new threads show up
            // while we look, so look until no new one does (bounded).
            for _ in 0..5 {
                let mut new = 0;
                for (_, tid) in crate::threads(a.pid) {
                    let known =
                        traced.contains(&tid) || others.iter().any(|t| t.tid.as_raw() == tid);
                    if !known {
                        if let Ok(t) = Traced::attach(tid, options, &alarm) {
                            others.push(t);
                            new += 1;
                        }
                    }
                }
                if new == 0 {
                    break;
                }
            }
        },
    );
    let rec = injected.rec.clone();
    let start = Instant::now();
    print_line(&serde_json::to_value(&rec)?);
    let Some(addr) = rec.repair_addr else {
        // Nothing went in: let everything go.
        drop(others);
        injected.release();
        return Ok(std::process::ExitCode::SUCCESS);
    };
    // From here on, every thread is traced: resume the held ones.
    let mut traced: HashMap<Pid, Traced> = HashMap::new();
    for t in injected.hold.0.into_iter().chain(injected.target).chain(others) {
        traced.insert(t.tid, t);
    }
    for t in traced.values_mut() {
        if t.stopped {
            t.resume();
        }
    }
    let end = watch(&mut traced, a.pid, &alarm, limit);
    let mut repair = Repair { addr, word: rec.repair_word, flag: &a.flag, done: false };
    let mut thread = None;
    if let End::Signal(tid, _) = &end {
        // The faulting thread first: its error is the one the VMM should see.
        thread =
            crate::threads(a.pid).into_iter().find(|(_, t)| *t == tid.as_raw()).map(|(n, _)| n);
        if let Some(mut t) = traced.remove(tid) {
            repair.through(t.tid);
            t.detach();
        }
    }
    let after_us = start.elapsed().as_micros() as u64;
    if matches!(end, End::Exec) {
        // The flipped code went with the old image.
        let _ = std::fs::write(&a.flag, "repaired");
    }
    let wants_repair = matches!(end, End::Request | End::Finish);
    release_all(
        traced,
        &alarm,
        wants_repair.then_some(&mut repair),
        Instant::now() + RELEASE_LIMIT,
    );
    let after_us = if wants_repair { start.elapsed().as_micros() as u64 } else { after_us };
    let (by, signal) = match &end {
        End::Signal(_, sig) => ("signal", Some(signal_name(*sig))),
        End::Request => ("detection", None),
        End::Finish => ("end", None),
        End::Exec => ("exec", None),
        End::Gone => ("gone", None),
    };
    print_line(&json!({
        "by": by, "signal": signal, "repaired": repair.done, "after_us": after_us, "thread": thread,
    }));
    Ok(std::process::ExitCode::SUCCESS)
}

/// The most time spent letting every thread go; the kernel detaches any
/// thread still traced when the sentinel exits.
const RELEASE_LIMIT: Duration = Duration::from_secs(5);

/// The code word to put back, and the VMM's flag to write once it is.
struct Repair<'a> {
    addr: u64,
    word: i64,
    flag: &'a Path,
    done: bool,
}

impl Repair<'_> {
    /// Puts the code back through the stopped thread `tid` and tells the VMM.
    fn through(&mut self, tid: Pid) {
        if !self.done && poke(tid, self.addr, self.word) {
            self.done = true;
            let _ = std::fs::write(self.flag, "repaired");
        }
    }
}

/// Detaches every traced thread at its next stop, passing on the signal it
/// stopped for; with `repair`, the first thread stopped puts the code back
/// before any is let go. Waits for any tracee, not thread by thread: once
/// the process is ending, its leader's end is reported only after every
/// other thread's, which are ours to collect.
fn release_all(
    mut traced: HashMap<Pid, Traced>,
    alarm: &Rc<Alarm>,
    mut repair: Option<&mut Repair>,
    limit: Instant,
) {
    for t in traced.values_mut() {
        if !t.stopped && ptrace::interrupt(t.tid).is_err() {
            t.settle();
        }
    }
    loop {
        for t in traced.values_mut().filter(|t| t.stopped) {
            if let Some(r) = repair.as_deref_mut() {
                r.through(t.tid);
            }
            t.detach();
        }
        traced.retain(|_, t| !t.settled);
        if traced.is_empty() || Instant::now() > limit {
            break;
        }
        alarm.arm(true);
        let r = wait_event(-1);
        alarm.arm(false);
        let (tid, ev) = match r {
            Err(Errno::EINTR) => continue,
            Err(_) => break,
            Ok(e) => e,
        };
        // An unknown thread was auto-attached at its creation.
        let t = traced.entry(tid).or_insert_with(|| Traced::adopt(tid, alarm));
        match ev {
            Event::Ended => t.settle(),
            _ => t.stop_for(ev.signal()),
        }
    }
    // What is left, the kernel detaches when we exit.
    for t in traced.values_mut() {
        t.settle();
    }
}

fn print_line(v: &Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

fn signal_name(sig: i32) -> String {
    nix::sys::signal::Signal::try_from(sig)
        .map_or_else(|_| format!("signal {sig}"), |s| s.to_string())
}

/// Passes signals and events on until a fault signal, a request, the end,
/// an exec or the process's end.
fn watch(traced: &mut HashMap<Pid, Traced>, pid: i32, alarm: &Rc<Alarm>, limit: Instant) -> End {
    loop {
        if REPAIR_NOW.load(Relaxed) {
            return End::Request;
        }
        if FINISH.load(Relaxed) || Instant::now() > limit {
            return End::Finish;
        }
        alarm.arm(true);
        let r = wait_event(-1);
        alarm.arm(false);
        let (tid, ev) = match r {
            Err(Errno::EINTR) => continue,
            Err(_) => return End::Gone,
            Ok(e) => e,
        };
        match ev {
            Event::Ended => {
                if let Some(mut t) = traced.remove(&tid) {
                    t.settle();
                }
                if tid.as_raw() == pid || traced.is_empty() {
                    return End::Gone;
                }
                continue;
            }
            Event::Ptrace(libc::PTRACE_EVENT_EXEC) => {
                traced.entry(tid).or_insert_with(|| Traced::adopt(tid, alarm)).stopped = true;
                return End::Exec;
            }
            _ => {}
        }
        // A thread we have not seen yet is one auto-attached at its creation.
        let t = traced.entry(tid).or_insert_with(|| Traced::adopt(tid, alarm));
        t.stop_for(ev.signal());
        if let Some(sig) = ev.signal().filter(|&s| is_fault(s)) {
            return End::Signal(tid, sig);
        }
        t.resume();
    }
}

/// The campaign's handle on a sentinel process.
pub struct Sentinel {
    child: Option<Child>,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Sentinel {
    /// Starts the sentinel on thread `(name, tid)` of `pid` and waits (until
    /// `deadline`) for its injection record.
    pub fn start(
        exe: &Path,
        plan: &Plan,
        pid: i32,
        (name, tid): (&str, i32),
        budget: Duration,
        flag: &Path,
        deadline: Instant,
    ) -> Result<(Sentinel, Injection)> {
        let mut cmd = Command::new(exe);
        cmd.args(["inject", "sentinel", "--pid", &pid.to_string(), "--tid", &tid.to_string()])
            .args(["--thread", name, "--plan", &serde_json::to_string(plan)?])
            .args(["--budget-ms", &budget.as_millis().to_string(), "--flag"])
            .arg(flag)
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
        let mut child = cmd.spawn().context("cannot start the injector's sentinel")?;
        let out = child.stdout.take().context("the sentinel has no stdout")?;
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let s = Sentinel { child: Some(child), lines };
        let wait = deadline.saturating_duration_since(Instant::now());
        let Ok(first) = s.lines.recv_timeout(wait) else {
            bail!("the sentinel reported no injection");
        };
        let rec: Injection =
            serde_json::from_str(&first).context("the sentinel's injection record")?;
        Ok((s, rec))
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().map_or(0, |c| c.id() as i32)
    }

    /// Asks for the repair now: the VMM reported an error.
    pub fn repair_now(pid: i32) {
        if pid > 0 {
            // SAFETY: kill sends a signal to one process; no memory is involved.
            unsafe { libc::kill(pid, libc::SIGUSR1) };
        }
    }

    /// Ends the watch (repairing a fault still in place) and returns the
    /// sentinel's report of the repair. Bounded: a stuck sentinel is killed
    /// (its tracees are then detached by the kernel).
    pub fn finish(self, limit: Duration) -> Option<Value> {
        if self.pid() > 0 {
            // SAFETY: kill sends a signal to one process; no memory is involved.
            unsafe { libc::kill(self.pid(), libc::SIGTERM) };
        }
        let t = Instant::now();
        let mut last = None;
        while t.elapsed() < limit {
            match self.lines.recv_timeout(Duration::from_millis(50)) {
                Ok(l) => last = serde_json::from_str(&l).ok(),
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
                Err(_) => {}
            }
        }
        last
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            if c.try_wait().ok().flatten().is_none() {
                let _ = c.kill();
            }
            let _ = c.wait();
        }
    }
}
