//! Rejuvenating a running host: replace the VMM process (same binary, or an
//! upgrade) while its VMs survive, in one of three [`Mode`]s, over the
//! [`handover`](crate::handover) mechanism.
//!
//! The old process gives its VMs up only after the new one confirmed:
//!
//! 0. warm (default): start the new binary first, as a standby successor.
//!    It maps every VM's memfd and builds the VM (KVM VM, memory slots,
//!    irqchip, vCPUs, devices) while the VMs still run here, then reports
//!    `standby`; a binary that fails to start or refuses the record costs
//!    the VMs nothing;
//! 1. suspend: pause every VM, save its vCPU and device state (save-restore:
//!    also write its memory to a file; cold and save-restore then shut the
//!    VMs down here, as an ordinary restart would);
//! 2. send the states to the standby successor (or, without one, start the
//!    new binary now with everything in its record) and wait for `ready`
//!    (every VM re-created there, none running);
//! 3. send `go`; the new process answers `starting` and only then runs any
//!    vCPU. Warm: only now are the paused VMs torn down here (outside the
//!    downtime).
//!
//! If the new process fails to start, rejects the record or the states, dies
//! or times out before `starting`, it is killed and only then do the VMs come
//! back here: resumed where they were paused (or, for cold and save-restore,
//! which released them, booted afresh or restored from the image file).
//! After `starting` the new process owns the VMs and this one exits.
//!
//! Sandbox sets (warm only): they pause after the VMs in step 1 and their
//! records join the handover record ([`crate::carry`]); with sets the new
//! binary starts during the pause (step 0 is skipped: the record needs the
//! sets' paused state). On a rollback they resume with the VMs.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nl_memory::GuestMemory;
use serde::Serialize;
use serde_json::Value;

use crate::handover::{
    self, mono_ns, ms_between, HandoverRecord, Images, MemorySource, Mode, VmRecord,
};
use crate::host::Host;
use crate::state::VmState;
use crate::VmmError;

/// What to do.
#[derive(Clone, Debug)]
pub struct Options {
    pub mode: Mode,
    /// The binary to start (the running one for plain rejuvenation).
    pub binary: PathBuf,
    /// The API socket path (passed to the new process for messages and cleanup).
    pub api_path: PathBuf,
    /// Where save-restore writes memory images.
    pub image_dir: PathBuf,
    /// How long the new process may take to become ready.
    pub timeout: Duration,
    /// Warm: start the new process and let it build the VMs before any VM
    /// pauses (only the states cross the pause). Off: start it during the
    /// pause, as in the paper.
    pub prespawn: bool,
}

/// Downtime of one VM. All times are from the moment its pause began.
#[derive(Clone, Debug, Default, Serialize)]
pub struct VmDowntime {
    pub id: u32,
    /// Time to stop all its vCPUs at a consistent point.
    pub pause_ms: f64,
    /// Time to save its state (save-restore: and write its memory image).
    pub save_ms: f64,
    /// Bytes written to disk for it (0 unless save-restore).
    pub image_bytes: u64,
    /// Until its vCPUs run again in the new process: the VM's downtime.
    pub downtime_ms: Option<f64>,
    /// Until the guest's first heartbeat after the handover: the
    /// guest-visible gap (heartbeats come every 10 ms of guest work, so this
    /// exceeds the downtime by up to one heartbeat period; for cold it
    /// includes the guest's boot and warm-up round).
    pub heartbeat_gap_ms: Option<f64>,
    /// Cold: until the rebooted guest reached its workload again.
    pub boot_done_ms: Option<f64>,
}

/// Host-wide phases (the terms of the paper's downtime model).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Phases {
    /// Pause and save all VMs (save-restore: and write the images).
    pub suspend_ms: f64,
    /// Shut the VMs down here before the restart (cold, save-restore).
    pub shutdown_ms: f64,
    /// Warm with a standby successor: exec and building the VMs happened
    /// before the pause (`exec_ms` and `standby_ms` are not downtime).
    pub prespawned: bool,
    /// From starting the new binary to its `main` (the "VMM reboot").
    pub exec_ms: f64,
    /// Standby successor: from its `main` to every VM built over its memfd.
    pub standby_ms: f64,
    /// From its `main` (standby: from sending the states) to every VM
    /// re-created with its state (cold: created).
    pub restore_ms: f64,
    /// Tear the paused VMs down here after the new process committed
    /// (warm; not part of the downtime).
    pub release_ms: f64,
    /// From `go` to the last VM's vCPUs running in the new process.
    pub start_ms: f64,
}

/// The answer to a `rejuvenate` request.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    pub mode: &'static str,
    pub ok: bool,
    pub rolled_back: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub old_pid: u32,
    pub new_pid: Option<u32>,
    pub binary: String,
    pub generation: u64,
    pub vms: Vec<VmDowntime>,
    /// Finished VMs (completed, failed, stopped) are not carried over.
    pub not_carried: Vec<u32>,
    /// From the first pause to the last VM running again.
    pub total_downtime_ms: Option<f64>,
    /// From the first pause to the last first-heartbeat.
    pub max_heartbeat_gap_ms: Option<f64>,
    pub phases: Phases,
    /// The sandbox sets carried over (warm), by name.
    pub sets: Vec<String>,
    /// From the sets' pause (after the VMs') to every set's sandboxes
    /// running again in the new process: their downtime.
    pub sets_downtime_ms: Option<f64>,
}

/// One VM as suspended here, kept until the new process has committed.
struct Suspended {
    rec: VmRecord,
    images: Images,
    memory: Option<GuestMemory>,
    state: Option<VmState>,
    image: Option<PathBuf>,
}

fn images_of(c: &crate::VmConfig) -> Images {
    Images { kernel: c.kernel.clone(), user: c.user.clone() }
}

/// Runs a rejuvenation. `Ok` with `ok: true` means the new process owns the
/// VMs and the caller must stop serving (and exit) without touching the
/// socket file; `ok: false` means the VMs are back in this process.
pub fn rejuvenate(host: &Host, listener_fd: Option<i32>, opts: &Options) -> Report {
    let mut report = Report {
        mode: opts.mode.name(),
        old_pid: std::process::id(),
        binary: opts.binary.display().to_string(),
        generation: host.generation() + 1,
        ..Report::default()
    };
    // Sandbox sets live in their memfds: only a warm handover carries them.
    let sets_here = crate::carry::holds();
    if sets_here && opts.mode != Mode::Warm {
        report.error = Some(format!(
            "the host runs sandbox sets, which only a warm rejuvenation carries over (not {})",
            opts.mode.name()
        ));
        report.rolled_back = true;
        return report;
    }
    // 0. Warm: start the successor before anything pauses. It builds every
    // VM over its memfd while the VMs still run here; a binary that fails to
    // start or refuses the record costs the VMs nothing. Sandbox sets need
    // their paused state in the record: with sets the successor starts
    // during the pause.
    let mut standby = None;
    if opts.mode == Mode::Warm && opts.prespawn && !sets_here {
        report.phases.prespawned = true;
        match Successor::standby(host, listener_fd, opts, &mut report) {
            Ok(s) => standby = Some(s),
            Err(e) => {
                report.error = Some(e);
                report.rolled_back = true;
                return report;
            }
        }
    }
    let t0 = mono_ns();
    // 1. Suspend: ask every VM to pause at once, then wait for each and save.
    let mut suspended = Vec::new();
    let mut carry = Vec::new();
    for h in host.hosted() {
        if h.outcome.lock().is_some() {
            report.not_carried.push(h.vm.id());
            continue;
        }
        h.vm.request_pause();
        carry.push((h, mono_ns()));
    }
    for (i, (h, pause_requested_ns)) in carry.iter().enumerate() {
        let id = h.vm.id();
        let user_paused = h.user_paused.load(std::sync::atomic::Ordering::Relaxed);
        let mut rec = VmRecord::describe_vm(&h.vm, user_paused);
        rec.paused_at_ns = *pause_requested_ns;
        h.vm.pause();
        let paused_ns = mono_ns();
        let mut d = VmDowntime {
            id,
            pause_ms: ms_between(rec.paused_at_ns, paused_ns),
            ..Default::default()
        };
        let r = suspend_one(&h.vm, &mut rec, opts, &mut d);
        d.save_ms = ms_between(paused_ns, mono_ns());
        report.vms.push(d);
        let (state, image) = match r {
            Ok(v) => v,
            Err(e) => {
                report.error = Some(format!("cannot suspend VM {id}: {e}"));
                suspended.push(Suspended {
                    rec,
                    images: images_of(h.vm.config()),
                    memory: None,
                    state: None,
                    image: None,
                });
                if let Some(s) = standby.take() {
                    s.kill();
                }
                resume_all(host, &suspended);
                // The VMs asked to pause but not reached yet resume too.
                for (rest, _) in &carry[i + 1..] {
                    if !rest.user_paused.load(std::sync::atomic::Ordering::Relaxed) {
                        let _ = host.resume(rest.vm.id());
                    }
                }
                report.rolled_back = true;
                return report;
            }
        };
        suspended.push(Suspended {
            rec,
            images: images_of(h.vm.config()),
            memory: Some(h.vm.memory().clone()),
            state: Some(state),
            image,
        });
    }
    // The sandbox sets pause after the VMs (a warm handover only).
    let sets_paused_ns = mono_ns();
    let sets = match crate::carry::suspend(true) {
        Ok(s) => s,
        Err(e) => {
            let why = format!("cannot suspend the sandbox sets: {e}");
            abandon(host, &mut report, why, standby, &suspended);
            return report;
        }
    };
    if standby.is_some() && !sets.is_empty() {
        // A set created after the standby successor started: it has no
        // record of it.
        let why = "a sandbox set was created while the host rejuvenated".to_string();
        abandon(host, &mut report, why, standby, &suspended);
        return report;
    }
    report.sets = sets.iter().map(|s| s.name.clone()).collect();
    report.phases.suspend_ms = ms_between(t0, mono_ns());
    // Release drops a VM (closing its TAP and disk) only if nothing here
    // still holds it.
    drop(carry);
    // Cold and save-restore shut the VMs down before the restart.
    let mut released = false;
    if opts.mode != Mode::Warm {
        let t = mono_ns();
        for s in &mut suspended {
            let _ = host.release(s.rec.id);
            s.memory = None;
        }
        released = true;
        report.phases.shutdown_ms = ms_between(t, mono_ns());
    }

    // 2. Start the new process (or hand the states to the standby one) and
    // wait for `ready`.
    let outcome = hand_over(
        host,
        listener_fd,
        opts,
        standby,
        (&suspended, &sets, sets_paused_ns),
        &mut report,
        &mut released,
    );
    match outcome {
        Ok(()) => {
            report.ok = true;
            if let Some(g) = report.vms.iter().map(|v| v.downtime_ms).collect::<Option<Vec<_>>>() {
                report.total_downtime_ms = g.into_iter().reduce(f64::max);
            }
            report.max_heartbeat_gap_ms =
                report.vms.iter().filter_map(|v| v.heartbeat_gap_ms).reduce(f64::max);
            for s in &suspended {
                if let Some(p) = &s.image {
                    let _ = std::fs::remove_file(p);
                }
            }
        }
        Err(HandoverFailure::Recoverable(e)) => {
            report.error = Some(e);
            report.rolled_back = true;
            crate::carry::resume();
            // The new process was killed: it serves nothing.
            report.new_pid = None;
            if released {
                if let Err(e) = recover_here(host, &suspended) {
                    report.error = Some(format!(
                        "{}; and recovering here failed: {e}",
                        report.error.take().unwrap_or_default()
                    ));
                }
            } else {
                resume_all(host, &suspended);
            }
            for s in &suspended {
                if let Some(p) = &s.image {
                    let _ = std::fs::remove_file(p);
                }
            }
        }
        Err(HandoverFailure::Lost(e)) => {
            report.error = Some(e);
        }
    }
    report
}

fn suspend_one(
    vm: &crate::Vm,
    rec: &mut VmRecord,
    opts: &Options,
    d: &mut VmDowntime,
) -> Result<(VmState, Option<PathBuf>), VmmError> {
    let state = vm.save_state()?;
    let mut image = None;
    match opts.mode {
        Mode::Warm => {
            let (fd, ino) = handover::memfd_of(vm.memory())?;
            rec.memory = MemorySource::Memfd { fd, ino };
            rec.state = Some(String::from_utf8(state.to_bytes()).expect("JSON is UTF-8"));
            // The TAP stays attached across the handover: frames that arrive
            // meanwhile wait in its queue instead of being dropped.
            rec.tap_fd = vm.tap_fd();
        }
        Mode::SaveRestore => {
            std::fs::create_dir_all(&opts.image_dir)?;
            let path =
                opts.image_dir.join(format!("ninelives-{}-vm{}.mem", std::process::id(), rec.id));
            let mut f = File::create(&path).map_err(|e| {
                VmmError::Config(format!("cannot create memory image {}: {e}", path.display()))
            })?;
            vm.memory().dump_to(&mut f)?;
            // The image must be on disk, as for a host reboot.
            f.sync_data()?;
            d.image_bytes = vm.memory().size();
            rec.memory = MemorySource::Image { path: path.clone() };
            rec.state = Some(String::from_utf8(state.to_bytes()).expect("JSON is UTF-8"));
            image = Some(path);
        }
        Mode::Cold => {}
    }
    Ok((state, image))
}

/// Why a handover did not complete.
enum HandoverFailure {
    /// The new process never ran a vCPU: the VMs come back here.
    Recoverable(String),
    /// The new process committed and then failed: nothing safe to do here.
    Lost(String),
}

/// The new VMM process and this side of its control socket.
struct Successor {
    child: std::process::Child,
    out: UnixStream,
    reader: BufReader<UnixStream>,
    binary: PathBuf,
    timeout: Duration,
    spawn_ns: u64,
}

impl Successor {
    /// Starts `opts.binary` as `host --handover-fd R --handover-ctl C` with
    /// the record, the control socket, the listener, the memfds and the
    /// TAPs the record names inherited.
    fn spawn(
        record: &HandoverRecord,
        listener_fd: Option<i32>,
        opts: &Options,
    ) -> Result<Self, String> {
        let rec_file = handover::record_memfd(record).map_err(|e| e.to_string())?;
        let (mine, theirs) = UnixStream::pair().map_err(|e| e.to_string())?;
        let mut inherit = vec![rec_file.as_raw_fd(), theirs.as_raw_fd()];
        inherit.extend(listener_fd);
        inherit.extend(record.vms.iter().filter_map(|v| match v.memory {
            MemorySource::Memfd { fd, .. } => Some(fd),
            _ => None,
        }));
        inherit.extend(record.vms.iter().filter_map(|v| v.tap_fd));
        inherit.extend(record.set_fds());
        let args: Vec<String> = vec![
            "host".into(),
            "--api".into(),
            opts.api_path.display().to_string(),
            "--handover-fd".into(),
            rec_file.as_raw_fd().to_string(),
            "--handover-ctl".into(),
            theirs.as_raw_fd().to_string(),
        ];
        let args: Vec<String> = args.into_iter().chain(crate::successor::args()).collect();
        let spawn_ns = mono_ns();
        let mut child = handover::spawn_with_fds(&opts.binary, &args, inherit)
            .map_err(|e| format!("cannot start {}: {e}", opts.binary.display()))?;
        let out = match mine.try_clone() {
            Ok(o) => o,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(e.to_string());
            }
        };
        Ok(Self {
            child,
            out,
            reader: BufReader::new(mine),
            binary: opts.binary.clone(),
            timeout: opts.timeout,
            spawn_ns,
        })
    }

    /// Starts a standby successor for the warm handover of every VM still
    /// running here and waits until it has built them all.
    fn standby(
        host: &Host,
        listener_fd: Option<i32>,
        opts: &Options,
        report: &mut Report,
    ) -> Result<Self, String> {
        let mut record =
            HandoverRecord::new(Mode::Warm, host.generation() + 1, listener_fd, host.next_id());
        record.limits = host.limits_for_handover();
        record.defer_state();
        for h in host.hosted() {
            if h.outcome.lock().is_some() {
                continue;
            }
            let mut rec = VmRecord::describe_vm(&h.vm, false);
            let (fd, ino) = handover::memfd_of(h.vm.memory()).map_err(|e| e.to_string())?;
            rec.memory = MemorySource::Memfd { fd, ino };
            rec.tap_fd = h.vm.tap_fd();
            record.vms.push(rec);
        }
        let mut s = Self::spawn(&record, listener_fd, opts)?;
        match s.expect("standby") {
            Ok(t) => {
                let num = |k: &str| t.get(k).and_then(Value::as_u64).unwrap_or(0);
                report.phases.exec_ms = ms_between(s.spawn_ns, num("main_ns"));
                report.phases.standby_ms = ms_between(num("main_ns"), num("standby_ns"));
                report.new_pid = Some(s.child.id());
                Ok(s)
            }
            Err(e) => {
                s.kill();
                Err(e)
            }
        }
    }

    fn read_line(&mut self) -> Option<String> {
        let mut line = String::new();
        match self.reader.read_line(&mut line) {
            Ok(n) if n > 0 => Some(line.trim_end().to_string()),
            _ => None,
        }
    }

    fn send(&mut self, line: &str) -> Result<(), String> {
        writeln!(self.out, "{line}").map_err(|_| "the new VMM went away".to_string())
    }

    /// Waits (at most the timeout) for the line `word {...}` and returns its JSON.
    fn expect(&mut self, word: &str) -> Result<Value, String> {
        let waited_from = mono_ns();
        let _ = self.reader.get_ref().set_read_timeout(Some(self.timeout));
        let line = self.read_line();
        match line.as_deref() {
            Some(l) if l.starts_with(word) && l[word.len()..].starts_with(' ') => {
                Ok(serde_json::from_str(&l[word.len() + 1..]).unwrap_or(Value::Null))
            }
            Some(l) if l == word => Ok(Value::Null),
            Some(l) if l.starts_with("error ") => {
                Err(format!("the new VMM refused the handover: {}", &l[6..]))
            }
            Some(l) => Err(format!("the new VMM said {l:?} instead of {word}")),
            None => {
                let waited =
                    waited_from.saturating_add(self.timeout.as_nanos() as u64) <= mono_ns();
                Err(match (waited, self.exit_status()) {
                    (false, Some(s)) => format!(
                        "the new VMM ({}) exited ({s}) before it reported {word}",
                        self.binary.display()
                    ),
                    (false, None) => {
                        format!("the new VMM closed the control channel before it reported {word}")
                    }
                    (true, _) => {
                        format!("the new VMM did not report {word} within {:?}", self.timeout)
                    }
                })
            }
        }
    }

    /// The exit status of a child that closed its end, waiting briefly for
    /// the kernel to finish its exit (its fds close before it becomes a zombie).
    fn exit_status(&mut self) -> Option<std::process::ExitStatus> {
        for _ in 0..200 {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        None
    }

    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Kills the successor: the handover failed before it ran anything.
    fn fail(self, why: String) -> HandoverFailure {
        self.kill();
        HandoverFailure::Recoverable(why)
    }
}

fn hand_over(
    host: &Host,
    listener_fd: Option<i32>,
    opts: &Options,
    standby: Option<Successor>,
    (suspended, sets, sets_paused_ns): (&[Suspended], &[crate::carry::SetRecord], u64),
    report: &mut Report,
    released: &mut bool,
) -> Result<(), HandoverFailure> {
    use HandoverFailure::*;
    // VMs that ended here stay visible (their results) in the new process.
    let carried: BTreeSet<u32> = suspended.iter().map(|s| s.rec.id).collect();
    let mut finished = match host.ended_stats() {
        Ok(f) => f,
        Err(e) => {
            if let Some(s) = standby {
                s.kill();
            }
            return Err(Recoverable(e.to_string()));
        }
    };
    finished
        .retain(|f| f["summary"]["id"].as_u64().is_some_and(|id| !carried.contains(&(id as u32))));
    let mut s = match standby {
        Some(mut s) => {
            // The states of the paused VMs complete what the standby built.
            let states = handover::DeferredStates {
                finished: finished.clone(),
                vms: suspended
                    .iter()
                    .map(|v| handover::DeferredState {
                        id: v.rec.id,
                        paused: v.rec.paused,
                        paused_at_ns: v.rec.paused_at_ns,
                        state: v.rec.state.clone().unwrap_or_default(),
                    })
                    .collect(),
            };
            let line = format!("state {}", serde_json::to_string(&states).expect("serializes"));
            let sent_ns = mono_ns();
            if let Err(e) = s.send(&line) {
                return Err(s.fail(format!("{e} before it got the VM states")));
            }
            match s.expect("ready") {
                Ok(r) => {
                    let ready_ns = r.get("ready_ns").and_then(Value::as_u64).unwrap_or(0);
                    report.phases.restore_ms = ms_between(sent_ns, ready_ns);
                }
                Err(e) => return Err(s.fail(e)),
            }
            s
        }
        None => {
            let mut record =
                HandoverRecord::new(opts.mode, host.generation() + 1, listener_fd, host.next_id());
            record.limits = host.limits_for_handover();
            record.vms = suspended.iter().map(|s| s.rec.clone()).collect();
            record.finished = finished;
            record.carry_sets(sets);
            let mut s = Successor::spawn(&record, listener_fd, opts).map_err(Recoverable)?;
            match s.expect("ready") {
                Ok(r) => {
                    let num = |k: &str| r.get(k).and_then(Value::as_u64).unwrap_or(0);
                    report.phases.exec_ms = ms_between(s.spawn_ns, num("main_ns"));
                    report.phases.restore_ms = ms_between(num("main_ns"), num("ready_ns"));
                    report.new_pid = Some(s.child.id());
                }
                Err(e) => return Err(s.fail(e)),
            }
            s
        }
    };

    // 3. Commit. The paused VMs stay paused here until the new process
    // said `starting`; any failure before that kills it first and only then
    // resumes them, so two copies of a VM never run.
    if let Err(e) = s.send("go") {
        return Err(s.fail(format!("{e} before go")));
    }
    match s.read_line().as_deref() {
        Some("starting") => {}
        other => return Err(s.fail(format!("the new VMM did not start the VMs (said {other:?})"))),
    }
    // Committed: from here on the VMs belong to the new process. Tearing
    // them down here (vCPU threads, KVM VMs, memory mappings) is outside
    // their downtime (warm).
    if !*released {
        let t = mono_ns();
        for v in suspended {
            let _ = host.release(v.rec.id);
        }
        *released = true;
        report.phases.release_ms = ms_between(t, mono_ns());
    }
    let started: Value = match s.read_line() {
        Some(l) if l.starts_with("started ") => {
            serde_json::from_str(&l[8..]).unwrap_or(Value::Null)
        }
        _ => {
            if s.exit_status().is_some() {
                return Err(Lost("the new VMM died after taking the VMs over".into()));
            }
            Value::Null
        }
    };
    let go_ns = started.get("go_ns").and_then(Value::as_u64).unwrap_or(0);
    let mut last_start = go_ns;
    for v in started.get("vms").and_then(Value::as_array).into_iter().flatten() {
        let id = v.get("id").and_then(Value::as_u64).unwrap_or(u64::MAX);
        let t = |k: &str| v.get(k).and_then(Value::as_u64);
        let Some(d) = report.vms.iter_mut().find(|d| u64::from(d.id) == id) else { continue };
        let paused = t("paused_at_ns").unwrap_or(0);
        if let Some(st) = t("start_ns") {
            d.downtime_ms = Some(ms_between(paused, st));
            last_start = last_start.max(st);
        }
        d.heartbeat_gap_ms = t("first_beat_ns").map(|b| ms_between(paused, b));
        d.boot_done_ms = t("workload_start_ns").map(|b| ms_between(paused, b));
    }
    report.phases.start_ms = ms_between(go_ns, last_start);
    if !sets.is_empty() {
        report.sets_downtime_ms = started
            .get("sets_started_ns")
            .and_then(Value::as_u64)
            .map(|t| ms_between(sets_paused_ns, t));
    }
    // The child is reparented when this process exits; it is not waited for.
    std::mem::forget(s.child);
    Ok(())
}

/// Resumes VMs that are still here, paused by the suspend step.
/// Gives up a rejuvenation after every VM and set was suspended: the sets
/// and VMs resume here, a prespawned successor is killed, and the report
/// says why.
fn abandon(
    host: &Host,
    report: &mut Report,
    why: String,
    standby: Option<Successor>,
    suspended: &[Suspended],
) {
    report.error = Some(why);
    crate::carry::resume();
    if let Some(s) = standby {
        s.kill();
    }
    resume_all(host, suspended);
    report.rolled_back = true;
}

fn resume_all(host: &Host, suspended: &[Suspended]) {
    for s in suspended {
        if !s.rec.paused {
            let _ = host.resume(s.rec.id);
        }
    }
}

/// Brings released VMs back in this process: over the same memfd (warm),
/// from the image (save-restore), or booted afresh (cold).
fn recover_here(host: &Host, suspended: &[Suspended]) -> Result<(), VmmError> {
    let mut first_err = None;
    for s in suspended {
        let r = (|| -> Result<(), VmmError> {
            let mut rec = s.rec.clone();
            let memory = match (&s.image, s.state.as_ref()) {
                (Some(p), Some(_)) if s.memory.is_none() => Some(handover::load_image(&rec, p)?),
                _ => s.memory.clone(),
            };
            match (&memory, &s.state) {
                (Some(_), Some(st)) => {
                    rec.state = Some(String::from_utf8(st.to_bytes()).expect("JSON is UTF-8"))
                }
                _ => rec.state = None,
            }
            let vm = handover::build_vm(host.kvm(), &rec, &s.images, memory)?;
            host.adopt(vm, rec.paused)?;
            Ok(())
        })();
        if let Err(e) = r {
            first_err.get_or_insert(VmmError::Vm(s.rec.id, e.to_string()));
        }
    }
    first_err.map_or(Ok(()), Err)
}

/// Where save-restore images go by default.
pub fn default_image_dir() -> PathBuf {
    std::env::var_os("NINELIVES_IMAGE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new("/var/tmp").to_path_buf())
}

/// Names this process `name` (its `comm`, what `ps` and `pgrep` show) if
/// it was started through `/proc/self/exe`, as a rejuvenation successor or a
/// microreboot is: the kernel names such a process `exe`. Call it on the
/// main thread before other threads start (they inherit the name).
pub fn restore_process_name(name: &str) {
    let comm = std::fs::read_to_string("/proc/self/comm").unwrap_or_default();
    if comm.trim_end() != "exe" {
        return;
    }
    let Ok(c) = std::ffi::CString::new(name) else { return };
    // SAFETY: PR_SET_NAME reads a NUL-terminated string (at most 16 bytes
    // are used) from a pointer valid for the call.
    unsafe { libc::prctl(libc::PR_SET_NAME, c.as_ptr()) };
}

/// The running binary (plain rejuvenation restarts it): `/proc/self/exe`,
/// which is the very same file even if its path was since replaced or deleted.
pub fn current_binary() -> Result<PathBuf, VmmError> {
    let p = PathBuf::from("/proc/self/exe");
    if !p.exists() {
        return Err(VmmError::Config("cannot find the running binary (/proc/self/exe)".into()));
    }
    Ok(p)
}
