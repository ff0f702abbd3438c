//! Microreboot: a fresh VMM process takes over in place.
//!
//! With every thread held, the old process saves each VM's vCPU and device
//! state (guest memory stays in its memfd), writes a handover record (the
//! same versioned record as warm reboot) into a memfd, and execs its own
//! binary with the record, the memfds and the API socket inherited. exec
//! discards every thread and the whole heap at once; the new process
//! re-creates the VMs ([`crate::handover::take_over_in_place`]).

use std::ffi::CString;
use std::os::fd::AsRawFd;
use std::time::Instant;

use serde_json::json;

use crate::handover::{self, HandoverRecord, MemorySource, Mode, VmRecord};

use super::Steps;

/// The API socket to hand over: (listening fd, path).
static API: std::sync::Mutex<Option<(i32, std::path::PathBuf)>> = std::sync::Mutex::new(None);

pub(crate) fn set_api(fd: i32, path: &std::path::Path) {
    if let Ok(mut a) = API.try_lock() {
        *a = Some((fd, path.to_path_buf()));
    }
}

/// A microreboot's work: what was detected, when, and the steps so far.
type Job = (String, Instant, Steps);

/// The started microreboot thread's queue.
static READY: std::sync::OnceLock<std::sync::mpsc::Sender<Job>> = std::sync::OnceLock::new();

/// Starts the microreboot thread ahead of any error, from the thread that
/// installs the detectors: a thread spawned at detection time by a vCPU
/// thread would inherit its seccomp filter, and so would the process it
/// execs ([`crate::seccomp`]).
pub(crate) fn prepare() {
    let (tx, rx) = std::sync::mpsc::channel::<Job>();
    let r = std::thread::Builder::new().name("microreboot".into()).spawn(move || {
        crate::seccomp::apply(crate::seccomp::Kind::Microreboot);
        if let Ok((what, t0, steps)) = rx.recv() {
            run(what, t0, steps);
        }
    });
    if r.is_ok() {
        let _ = READY.set(tx);
    }
}

/// Starts the second half of a microreboot on a thread of its own (the
/// thread that detected the error may be a vCPU thread, which must finish
/// its exit and park): pause every VM, save, exec. The recovery deadline
/// stays armed until the exec.
pub(crate) fn start(what: String, t0: Instant, steps: Steps) {
    let job = match READY.get() {
        Some(tx) => match tx.send((what, t0, steps)) {
            Ok(()) => return,
            Err(e) => e.0,
        },
        None => (what, t0, steps),
    };
    let r = std::thread::Builder::new()
        .name("microreboot".into())
        .spawn(move || run(job.0, job.1, job.2));
    if let Err(e) = r {
        super::fail(&format!("microreboot: cannot start its thread: {e}"));
    }
}

fn run(what: String, t0: Instant, mut steps: Steps) {
    let e = match build_and_exec(&what, t0, &mut steps) {
        Ok(never) => match never {},
        Err(e) => e,
    };
    super::fail(&format!("{what}: microreboot failed: {e}"));
}

enum Never {}

fn build_and_exec(what: &str, t0: Instant, steps: &mut Steps) -> Result<Never, String> {
    // This thread's steps are timed from its own start.
    steps.restart();
    let (listener_fd, path) = API
        .try_lock()
        .ok()
        .and_then(|a| a.clone())
        .ok_or("no API socket to hand over (microreboot needs `ninelives host`)")?;
    let hosts = super::live_hosts();
    let host = hosts.first().ok_or("no host")?;
    let mut record =
        HandoverRecord::new(Mode::Warm, host.generation() + 1, Some(listener_fd), host.next_id());
    record.limits = host.limits_for_handover();
    let mut inherit = vec![listener_fd];
    let paused_at_ns = handover::mono_ns();
    let live: Vec<_> = host.hosted().into_iter().filter(|h| h.outcome.lock().is_none()).collect();
    for h in &live {
        h.vm.request_pause();
    }
    for h in &live {
        h.vm.pause();
    }
    steps.done("pause_vms", json!(host.hosted().len()));
    record.finished = host.ended_stats().map_err(|e| e.to_string())?;
    for h in host.hosted() {
        let id = h.vm.id();
        if h.outcome.lock().is_some() {
            continue;
        }
        let state = h.vm.save_state().map_err(|e| format!("VM {id}: {e}"))?;
        let paused = h.user_paused.load(std::sync::atomic::Ordering::Relaxed);
        let mut rec = VmRecord::describe_vm(&h.vm, paused);
        let (fd, ino) = handover::memfd_of(h.vm.memory()).map_err(|e| e.to_string())?;
        rec.memory = MemorySource::Memfd { fd, ino };
        rec.state = Some(String::from_utf8(state.to_bytes()).map_err(|e| e.to_string())?);
        rec.paused_at_ns = paused_at_ns;
        // The TAP stays attached across exec: frames queued meanwhile survive.
        rec.tap_fd = h.vm.tap_fd();
        inherit.extend(rec.tap_fd);
        record.vms.push(rec);
        inherit.push(fd);
    }
    steps.done("save_vm_state", json!(record.vms.len()));
    // Sandbox sets: paused and saved by the front end; a set that cannot be
    // carried is left behind with a report (there is no way back).
    let sets = crate::carry::suspend(false)?;
    record.carry_sets(&sets);
    inherit.extend(record.set_fds());
    steps.done("save_sandbox_sets", json!(sets.len()));
    let exec_ns = handover::mono_ns();
    let started_ns = exec_ns.saturating_sub(t0.elapsed().as_nanos() as u64);
    record.reboot = Some(json!({
        "cause": what, "started_ns": started_ns, "exec_ns": exec_ns, "steps": steps.list,
    }));
    let bytes = record.to_bytes();
    let checksum = handover::record_checksum(&bytes);
    let f = {
        use std::io::Write;
        let mut f = nl_memory::create_memfd("microreboot").map_err(|e| e.to_string())?;
        f.write_all(&bytes).map_err(|e| e.to_string())?;
        f
    };
    inherit.push(f.as_raw_fd());
    for &fd in &inherit {
        handover::set_cloexec(fd, false).map_err(|e| format!("descriptor {fd}: {e}"))?;
    }
    let exe = CString::new("/proc/self/exe").expect("no NUL");
    let args: Vec<String> = vec![
        "ninelives".into(),
        "host".into(),
        "--api".into(),
        path.display().to_string(),
        "--recovery".into(),
        "microreboot".into(),
        "--reboot-record".into(),
        f.as_raw_fd().to_string(),
        "--reboot-checksum".into(),
        format!("{checksum:x}"),
    ];
    let args: Vec<String> = args.into_iter().chain(crate::successor::args()).collect();
    let cargs: Vec<CString> = args
        .iter()
        .map(|a| CString::new(a.as_str()).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let mut argv: Vec<*const libc::c_char> = cargs.iter().map(|c| c.as_ptr()).collect();
    argv.push(std::ptr::null());
    // Keep the record open across exec.
    std::mem::forget(f);
    // Interval timers survive exec: the new process must not inherit this one.
    super::disarm_deadline();
    // SAFETY: argv is a NULL-terminated array of valid C strings that live
    // until execv returns (it only returns on failure); environ is inherited.
    unsafe { libc::execv(exe.as_ptr(), argv.as_ptr()) };
    Err(format!("exec failed: {}", std::io::Error::last_os_error()))
}
