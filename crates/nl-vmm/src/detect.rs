//! Error detectors of the VMM process: fatal signals on any thread (a
//! syscall forbidden by the thread's seccomp filter included), Rust
//! panics (assertion failures included), and a hang watchdog.
//!
//! Every detection is reported on stderr as one machine-readable line,
//! [`REPORT_PREFIX`] followed by a JSON object naming the detector, the
//! thread and what it saw, e.g.
//!
//! ```text
//! NINELIVES-DETECTED {"detector":"signal","signal":"SIGSEGV","thread":"vm0-vcpu0","tid":4242,"addr":"0x0","rip":"0x0"}
//! NINELIVES-DETECTED {"detector":"panic","thread":"vm0-monitor","message":"...","location":"src/x.rs:1:2"}
//! NINELIVES-DETECTED {"detector":"seccomp","syscall":135,"name":"personality","signal":"SIGSYS","thread":"vm0-vcpu0","tid":4242,"addr":"0x...","rip":"0x..."}
//! NINELIVES-DETECTED {"detector":"hang","thread":"vm0-vcpu0","tid":4242,"missed_checks":3}
//! ```
//!
//! What happens next is the [`Recovery`] policy. `None` (the baseline) ends
//! the VMM process, and with it all its VMs, with exit status
//! [`DETECTED_EXIT`]; `Microreset` and `Microreboot` recover the VMM
//! ([`crate::recovery`]).
//!
//! Hang detection: each tracked thread owns a [`Progress`] with a beat
//! counter and a "waiting" flag. A thread marks itself waiting while it is
//! legitimately blocked (a vCPU inside KVM_RUN while the guest runs, a
//! paused vCPU, a connection thread waiting for a request) and beats when it
//! makes progress. Every 100 ms the watchdog checks each busy thread; three
//! checks in a row without a beat are a hang. A check only counts when the
//! watchdog itself woke on time, so a stalled host does not look like a hung
//! VMM.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Once, OnceLock, Weak};

use nl_sync::Lock;

pub use crate::recovery::Policy as Recovery;
use std::time::{Duration, Instant};

/// Exit status of a VMM ended by a detected error (recovery `none`).
pub const DETECTED_EXIT: i32 = 86;

/// Start of every detection line on stderr.
pub const REPORT_PREFIX: &str = "NINELIVES-DETECTED ";

/// Watchdog period and the number of silent periods that make a hang.
pub const WATCHDOG_PERIOD: Duration = Duration::from_millis(100);
pub const HANG_MISSES: u32 = 3;

/// Ends the process after an error nothing recovers from.
fn end() -> ! {
    // SAFETY: _exit is async-signal-safe and ends the process at once.
    unsafe { libc::_exit(DETECTED_EXIT) }
}

/// Progress of one tracked thread.
pub struct Progress {
    name: String,
    tid: i32,
    beats: AtomicU64,
    waiting: AtomicBool,
}

impl Progress {
    /// The thread made progress.
    #[inline]
    pub fn beat(&self) {
        self.beats.fetch_add(1, Relaxed);
    }

    /// The thread is about to block legitimately (not checked until it
    /// calls [`Progress::resume`]).
    #[inline]
    pub fn wait(&self) {
        self.waiting.store(true, Relaxed);
    }

    /// The thread is running VMM code again.
    #[inline]
    pub fn resume(&self) {
        self.beats.fetch_add(1, Relaxed);
        self.waiting.store(false, Relaxed);
    }
}

fn registry() -> &'static Lock<Vec<Weak<Progress>>> {
    static R: OnceLock<Arc<Lock<Vec<Weak<Progress>>>>> = OnceLock::new();
    R.get_or_init(|| Lock::new("detect.progress", Vec::new()))
}

/// Registers the calling thread with the hang watchdog. The thread is
/// checked while the returned handle lives and it is not waiting.
pub fn track() -> Arc<Progress> {
    let p = Arc::new(Progress {
        name: std::thread::current().name().unwrap_or("unnamed").to_string(),
        tid: gettid(),
        beats: AtomicU64::new(0),
        waiting: AtomicBool::new(false),
    });
    let mut r = registry().lock();
    r.retain(|w| w.strong_count() > 0);
    r.push(Arc::downgrade(&p));
    p
}

fn gettid() -> i32 {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::gettid() }
}

/// The fatal signals the detector catches.
pub const FATAL_SIGNALS: [(libc::c_int, &str); 7] = [
    (libc::SIGSEGV, "SIGSEGV"),
    (libc::SIGBUS, "SIGBUS"),
    (libc::SIGILL, "SIGILL"),
    (libc::SIGFPE, "SIGFPE"),
    (libc::SIGTRAP, "SIGTRAP"),
    (libc::SIGABRT, "SIGABRT"),
    // A syscall a seccomp filter forbids ([`crate::seccomp`]).
    (libc::SIGSYS, "SIGSYS"),
];

/// Installs all detectors once per process: the fatal-signal handler, the
/// panic hook and the hang watchdog thread.
pub fn install(recovery: Recovery) {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        crate::recovery::set_policy(recovery);
        crate::recovery::install();
        install_signal_handlers();
        install_panic_hook();
        let _ = std::thread::Builder::new().name("watchdog".into()).spawn(watchdog);
    });
}

fn install_signal_handlers() {
    for (sig, _) in FATAL_SIGNALS {
        // SAFETY: a zeroed sigaction is a valid starting value; the handler is
        // async-signal-safe and runs on the thread's alternate stack (std sets
        // one up for every thread it spawns), so a corrupted RSP still reports.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_fatal_signal as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

/// A fixed buffer for building the report line without allocating.
struct Line {
    buf: [u8; 384],
    len: usize,
}

impl Line {
    fn push(&mut self, s: &[u8]) {
        for &b in s {
            if self.len < self.buf.len() - 1 {
                self.buf[self.len] = b;
                self.len += 1;
            }
        }
    }

    fn hex(&mut self, v: u64) {
        self.push(b"0x");
        let mut started = false;
        for i in (0..16).rev() {
            let d = ((v >> (i * 4)) & 0xf) as u8;
            if d != 0 || started || i == 0 {
                started = true;
                self.push(&[b"0123456789abcdef"[d as usize]]);
            }
        }
    }

    fn dec(&mut self, v: u64) {
        let mut digits = [0u8; 20];
        let mut n = 0;
        let mut v = v;
        loop {
            digits[n] = b'0' + (v % 10) as u8;
            n += 1;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        for i in (0..n).rev() {
            self.push(&[digits[i]]);
        }
    }

    fn write_stderr(&mut self) {
        self.push(b"\n");
        // SAFETY: write(2) is async-signal-safe; the buffer is valid for len bytes.
        unsafe { libc::write(2, self.buf.as_ptr().cast(), self.len) };
    }
}

extern "C" fn on_fatal_signal(
    sig: libc::c_int,
    info: *mut libc::siginfo_t,
    ctx: *mut libc::c_void,
) {
    let mut name = [0u8; 17];
    // SAFETY: PR_GET_NAME writes at most 16 bytes into the 17-byte buffer.
    unsafe { libc::prctl(libc::PR_GET_NAME, name.as_mut_ptr()) };
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as u64;
    // SAFETY: the kernel passes a valid ucontext_t for an SA_SIGINFO handler.
    let rip =
        unsafe { (*(ctx as *const libc::ucontext_t)).uc_mcontext.gregs[libc::REG_RIP as usize] };
    let signame = FATAL_SIGNALS.iter().find(|(s, _)| *s == sig).map_or("?", |(_, n)| n);
    let mut l = Line { buf: [0; 384], len: 0 };
    l.push(REPORT_PREFIX.as_bytes());
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler.
    match unsafe { crate::seccomp::trapped_syscall(info) } {
        Some(nr) => {
            l.push(b"{\"detector\":\"seccomp\",\"syscall\":");
            l.dec(nr as u32 as u64);
            if let Some(name) = crate::seccomp::syscall_name(nr.into()) {
                l.push(b",\"name\":\"");
                l.push(name.as_bytes());
                l.push(b"\"");
            }
            l.push(b",\"signal\":\"");
        }
        None => l.push(b"{\"detector\":\"signal\",\"signal\":\""),
    }
    l.push(signame.as_bytes());
    l.push(b"\",\"thread\":\"");
    for &b in name.iter().take_while(|&&b| b != 0) {
        l.push(&[if b.is_ascii_graphic() && b != b'"' && b != b'\\' { b } else { b'?' }]);
    }
    l.push(b"\",\"tid\":");
    l.dec(gettid() as u64);
    l.push(b",\"addr\":\"");
    l.hex(addr);
    l.push(b"\",\"rip\":\"");
    l.hex(rip as u64);
    l.push(b"\"}");
    l.write_stderr();
    // A recovery policy discards this thread's execution (it does not return
    // into the faulting instruction); without one, or if it cannot, the end.
    crate::recovery::on_fatal_signal(sig);
    end();
}

fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        let thread = std::thread::current().name().unwrap_or("unnamed").to_string();
        let message = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "panic".into());
        let location = info.location().map(|l| l.to_string()).unwrap_or_default();
        report(&serde_json::json!({
            "detector": "panic", "thread": thread, "tid": gettid(),
            "message": message, "location": location,
        }));
        // Unwinding to the thread's recovery point starts the recovery there.
        if !crate::recovery::panic_recoverable() {
            end();
        }
    }));
}

pub(crate) fn report_line(v: &serde_json::Value) {
    report(v)
}

fn report(v: &serde_json::Value) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{REPORT_PREFIX}{v}");
    crate::event_log::publish("detection", v.clone());
}

fn watchdog() {
    crate::seccomp::apply(crate::seccomp::Kind::Watchdog);
    let _reg = crate::recovery::enter(false);
    // Per tracked thread: the beats seen at the last check and the misses since.
    let mut seen: Vec<(Weak<Progress>, u64, u32, u64)> = Vec::new();
    let mut last = Instant::now();
    loop {
        if let crate::recovery::Outcome::Recovered { .. } =
            crate::recovery::protected(|| watch(&mut seen, &mut last))
        {
            // Counts from before a recovery mean nothing after it.
            seen.clear();
            last = Instant::now();
        }
    }
}

fn watch(seen: &mut Vec<(Weak<Progress>, u64, u32, u64)>, last: &mut Instant) {
    loop {
        let recoveries = crate::recovery::threads::COMPLETED.load(Relaxed);
        crate::recovery::safe(|| std::thread::sleep(WATCHDOG_PERIOD));
        if crate::recovery::threads::COMPLETED.load(Relaxed) != recoveries {
            seen.clear();
        }
        let now = Instant::now();
        // A late wake-up means the host was stalled: skip this check.
        let on_time = now.duration_since(*last) < WATCHDOG_PERIOD * 3 / 2;
        *last = now;
        let live: Vec<Arc<Progress>> = registry().lock().iter().filter_map(Weak::upgrade).collect();
        seen.retain(|(w, _, _, _)| w.strong_count() > 0);
        for p in live {
            let beats = p.beats.load(Relaxed);
            let idx = match seen.iter().position(|(w, _, _, _)| std::ptr::eq(w.as_ptr(), &*p)) {
                Some(i) => i,
                None => {
                    seen.push((Arc::downgrade(&p), beats, 0, 0));
                    continue;
                }
            };
            let entry = &mut seen[idx];
            if p.waiting.load(Relaxed) || beats != entry.1 {
                entry.1 = beats;
                entry.2 = 0;
            } else if on_time && !excused(p.tid, &mut entry.3) {
                entry.2 += 1;
                if entry.2 >= HANG_MISSES {
                    let locks: Vec<String> = nl_sync::held_locks()
                        .iter()
                        .map(|l| format!("{}@{}", l.name, l.owner))
                        .collect();
                    report(&serde_json::json!({
                        "detector": "hang", "thread": p.name, "tid": p.tid,
                        "missed_checks": entry.2, "held_locks": locks,
                        "wchan": std::fs::read_to_string(format!("/proc/self/task/{}/wchan", p.tid)).unwrap_or_default(),
                    }));
                    if crate::recovery::policy() == Recovery::None {
                        end();
                    }
                    crate::recovery::recover_from_watchdog(&format!("hang of thread {}", p.name));
                    seen.clear();
                    *last = Instant::now();
                    break;
                }
            }
        }
    }
}

/// Whether thread `tid`, busy and silent since the last check, is not to
/// be blamed for it: a thread stopped by a tracer or debugger, or runnable
/// but given little CPU (a loaded host, or a single-stepping injector), is
/// excused. Like the paper's watchdog, which counts 100 ms of unhalted
/// cycles, a miss needs the thread to have spun (half a period of CPU) or to
/// sleep while busy (stuck on a lock or a syscall).
fn excused(tid: i32, last_ns: &mut u64) -> bool {
    let state = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").and_then(|(_, r)| r.chars().next()));
    let ran_ns = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse::<u64>().ok()))
        .unwrap_or(0);
    let ran = ran_ns.saturating_sub(*last_ns);
    *last_ns = ran_ns;
    match state {
        Some('S' | 'D') => false,
        Some('R') => ran < (WATCHDOG_PERIOD / 2).as_nanos() as u64,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_formats_numbers() {
        let mut l = Line { buf: [0; 384], len: 0 };
        l.hex(0);
        l.push(b" ");
        l.hex(0xdead_beef);
        l.push(b" ");
        l.dec(0);
        l.push(b" ");
        l.dec(1234567);
        assert_eq!(&l.buf[..l.len], b"0x0 0xdeadbeef 0 1234567");
    }

    #[test]
    fn progress_beats() {
        let p = track();
        p.wait();
        assert!(p.waiting.load(Relaxed));
        p.resume();
        assert!(!p.waiting.load(Relaxed));
        assert_eq!(p.beats.load(Relaxed), 1);
    }
}
