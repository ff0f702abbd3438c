//! Handing running VMs to a new VMM process.
//!
//! One mechanism, used by warm reboot (rejuvenation, upgrade) and by
//! microreboot: the old process pauses its VMs at a consistent point, saves
//! their small vCPU and device state, and writes a versioned
//! [`HandoverRecord`] into a memfd. It then starts the new binary with that
//! memfd, the guest-memory memfds, the API listening socket and one end of a
//! control socket inherited across exec (FD_CLOEXEC is cleared only in the
//! child, between fork and exec). The new process maps the same memory
//! ([`GuestMemory::from_fd`], nothing is copied), re-creates each VM with
//! [`Vm::restore`], and drives a small two-phase protocol over the control
//! socket (see [`take_over`]). Guest memory never leaves its memfd in warm
//! mode.
//!
//! The front end's sandbox sets ride along: one [`crate::carry::SetRecord`]
//! per set in [`HandoverRecord::sets`] (version 3), their memfds inherited
//! the same way, rebuilt by the front end before `ready` (see
//! [`crate::carry`]).

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use kvm_ioctls::Kvm;
use nl_abi::WorkloadParams;
use nl_memory::GuestMemory;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::host::Host;
use crate::state::VmState;
use crate::{Vm, VmConfig, VmmError};

/// First field of every record.
pub const HANDOVER_MAGIC: &str = "ninelives-handover";
/// The newest record version this binary reads and writes. Version 2 adds
/// [`HandoverRecord::deferred_state`], version 3 [`HandoverRecord::sets`];
/// records without them are still written as version 1, which every
/// ninelives reads.
pub const HANDOVER_VERSION: u32 = 3;
/// The record version of a record carrying sandbox sets.
pub const SETS_VERSION: u32 = 3;
/// The record version of a standby successor's record (deferred state).
pub const DEFERRED_STATE_VERSION: u32 = 2;
/// The oldest record version this binary still reads.
pub const OLDEST_HANDOVER_VERSION: u32 = 1;
/// Largest record accepted (it holds only small vCPU and device state).
pub const MAX_RECORD: u64 = 64 << 20;

/// How the VMs get to the new process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// On-memory suspend, quick reload, on-memory resume: memfds are handed over.
    Warm,
    /// Shut the VMs down, start the new VMM, boot them again from scratch.
    Cold,
    /// Suspend each VM's full memory to a file, start the new VMM, restore from disk.
    SaveRestore,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Warm => "warm",
            Mode::Cold => "cold",
            Mode::SaveRestore => "save-restore",
        }
    }

    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "warm" => Ok(Mode::Warm),
            "cold" => Ok(Mode::Cold),
            "save-restore" => Ok(Mode::SaveRestore),
            o => Err(format!("unknown rejuvenation mode \"{o}\" (warm, cold, save-restore)")),
        }
    }
}

/// Where a VM's memory comes from in the new process.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum MemorySource {
    /// An inherited memfd, mapped as it is (warm). `ino` guards against a
    /// record naming the wrong descriptor.
    Memfd { fd: i32, ino: u64 },
    /// A memory image on disk, loaded into fresh memory (save-restore).
    Image { path: PathBuf },
    /// Fresh memory: the VM boots from scratch (cold).
    Fresh,
}

/// One VM in a handover record.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VmRecord {
    pub id: u32,
    pub mem_bytes: u64,
    pub vcpus: u32,
    pub workload: WorkloadParams,
    pub timer_hz: u64,
    pub heartbeat_timeout_ms: u64,
    pub console_path: Option<PathBuf>,
    /// Paused by the API user before the handover: stays paused after it.
    pub paused: bool,
    pub memory: MemorySource,
    /// The VM's [`VmState`] bytes (versioned on their own); none when cold.
    pub state: Option<String>,
    /// CLOCK_MONOTONIC when the VM's pause began (downtime accounting).
    pub paused_at_ns: u64,
    /// The VM's virtio-blk disk and virtio-net TAP, re-opened by the new process.
    #[serde(default)]
    pub disk: Option<crate::config::DiskConfig>,
    #[serde(default)]
    pub net: Option<crate::config::NetConfig>,
    /// An attached TAP descriptor kept open across a microreboot's exec.
    #[serde(default)]
    pub tap_fd: Option<i32>,
    /// A Linux VM: how it was booted (absent for the reference guest).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub linux: Option<crate::linux::LinuxRecord>,
}

impl VmRecord {
    /// The essentials of a VM's configuration, without memory or state.
    pub fn describe(id: u32, c: &VmConfig, paused: bool) -> Self {
        Self {
            id,
            mem_bytes: c.mem_bytes,
            vcpus: c.vcpus,
            workload: c.workload,
            timer_hz: c.timer_hz,
            heartbeat_timeout_ms: c.heartbeat_timeout.as_millis() as u64,
            console_path: c.console_path.clone(),
            paused,
            memory: MemorySource::Fresh,
            state: None,
            paused_at_ns: 0,
            disk: c.disk.clone(),
            net: c.net.clone(),
            tap_fd: None,
            linux: None,
        }
    }

    /// [`VmRecord::describe`] of a VM, with how a Linux VM was booted.
    pub fn describe_vm(vm: &Vm, paused: bool) -> Self {
        Self { linux: vm.linux_record().cloned(), ..Self::describe(vm.id(), vm.config(), paused) }
    }

    /// Every field of the record that the VM's saved state also holds must
    /// agree with it: a mismatch is refused by the field's name, with both
    /// values (the VM would otherwise be rebuilt with a configuration that
    /// is not the one its state was saved under).
    pub fn check_state(&self, s: &VmState) -> Result<(), VmmError> {
        let id = self.id;
        let field = |f: &str, rv: String, sv: String| {
            Err(VmmError::State(format!(
                "handover refused: VM {id}: record field {f} is {rv} but its saved state says {sv}"
            )))
        };
        if self.mem_bytes != s.mem_bytes {
            return field("mem_bytes", self.mem_bytes.to_string(), s.mem_bytes.to_string());
        }
        if self.vcpus != s.num_vcpus || s.vcpus.len() != s.num_vcpus as usize {
            return field(
                "vcpus",
                self.vcpus.to_string(),
                format!("{} ({} vCPU states)", s.num_vcpus, s.vcpus.len()),
            );
        }
        if self.timer_hz != s.timer_hz {
            return field("timer_hz", self.timer_hz.to_string(), s.timer_hz.to_string());
        }
        if self.workload != s.workload {
            return field("workload", format!("{:?}", self.workload), format!("{:?}", s.workload));
        }
        Ok(())
    }

    /// The record's own fields, checked as a VM configuration would be
    /// (vCPU count, memory size, timer frequency, working set against
    /// memory), before anything is built from it.
    pub(crate) fn check_fields(&self) -> Result<(), VmmError> {
        let images = Images { kernel: Arc::default(), user: Arc::default() };
        self.config(&images)
            .validate()
            .map_err(|m| VmmError::State(format!("handover refused: VM {}: {m}", self.id)))
    }

    /// The VM configuration, with guest images supplied by the binary.
    pub fn config(&self, images: &Images) -> VmConfig {
        VmConfig {
            mem_bytes: self.mem_bytes,
            vcpus: self.vcpus,
            workload: self.workload,
            kernel: images.kernel.clone(),
            user: images.user.clone(),
            console_path: self.console_path.clone(),
            timer_hz: self.timer_hz,
            heartbeat_timeout: Duration::from_millis(self.heartbeat_timeout_ms),
            disk: self.disk.clone(),
            net: self.net.clone(),
        }
    }
}

/// Everything the new process needs to take over.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HandoverRecord {
    pub magic: String,
    pub version: u32,
    /// `CARGO_PKG_VERSION` of the binary that wrote the record.
    pub binary_version: String,
    pub mode: Mode,
    /// Handovers so far in this host's lineage (1 for the first successor).
    pub generation: u64,
    /// The API listening socket, kept open across the handover.
    pub listener_fd: Option<i32>,
    pub next_id: u32,
    pub vms: Vec<VmRecord>,
    /// VMs that had ended before a microreboot: their last `stats`.
    #[serde(default)]
    pub finished: Vec<serde_json::Value>,
    /// A microreboot's cause, start time and steps in the old process.
    #[serde(default)]
    pub reboot: Option<serde_json::Value>,
    /// Version 2: a standby successor. The record is written before any VM
    /// pauses and holds no state; the new process builds each VM over its
    /// memfd, reports `standby`, and receives the states over the control
    /// socket once the old process has paused the VMs (see [`take_over`]).
    #[serde(default)]
    pub deferred_state: bool,
    /// The old process's budgets and API limits, kept by the new one
    /// (absent in older records: the new process's own defaults).
    #[serde(default)]
    pub limits: Option<crate::host::Limits>,
    /// Version 3: the front end's sandbox sets, one
    /// [`crate::carry::SetRecord`] each. Kept as JSON values here and
    /// parsed one by one when taken over, so a corrupt set record is
    /// refused on its own ([`crate::carry`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sets: Vec<serde_json::Value>,
}

impl HandoverRecord {
    pub fn new(mode: Mode, generation: u64, listener_fd: Option<i32>, next_id: u32) -> Self {
        Self {
            magic: HANDOVER_MAGIC.into(),
            // Version 1 unless deferred: every ninelives reads it.
            version: OLDEST_HANDOVER_VERSION,
            binary_version: env!("CARGO_PKG_VERSION").into(),
            mode,
            generation,
            listener_fd,
            next_id,
            vms: Vec::new(),
            finished: Vec::new(),
            reboot: None,
            deferred_state: false,
            limits: None,
            sets: Vec::new(),
        }
    }

    /// Adds the sandbox sets (a version 3 record).
    pub fn carry_sets(&mut self, sets: &[crate::carry::SetRecord]) {
        if sets.is_empty() {
            return;
        }
        self.sets = sets.iter().map(|s| serde_json::to_value(s).expect("serializes")).collect();
        self.version = self.version.max(SETS_VERSION);
    }

    /// Every descriptor the sets' records name (best effort: a corrupt set
    /// record names none).
    pub fn set_fds(&self) -> Vec<i32> {
        self.sets
            .iter()
            .filter_map(|v| crate::carry::SetRecord::parse(v).ok())
            .flat_map(|s| s.fds())
            .collect()
    }

    /// Makes this the record of a standby successor (version 2).
    pub fn defer_state(&mut self) {
        self.deferred_state = true;
        self.version = DEFERRED_STATE_VERSION;
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("handover record serializes")
    }

    /// Parses a record, accepting every version from
    /// [`OLDEST_HANDOVER_VERSION`] to [`HANDOVER_VERSION`] and refusing
    /// others with a message that names both binaries' versions.
    pub fn from_bytes(b: &[u8]) -> Result<Self, VmmError> {
        #[derive(Deserialize)]
        struct Head {
            magic: String,
            version: u32,
            #[serde(default)]
            binary_version: String,
        }
        let bad = |m: String| VmmError::State(format!("handover refused: {m}"));
        let head: Head = serde_json::from_slice(b)
            .map_err(|e| bad(format!("not a ninelives handover record ({e})")))?;
        if head.magic != HANDOVER_MAGIC {
            return Err(bad(format!("not a ninelives handover record (magic {:?})", head.magic)));
        }
        let mine = env!("CARGO_PKG_VERSION");
        if head.version > HANDOVER_VERSION || head.version < OLDEST_HANDOVER_VERSION {
            return Err(bad(format!(
                "record version {} (written by ninelives {}) is not supported by ninelives \
                 {mine}, which reads versions {OLDEST_HANDOVER_VERSION}..={HANDOVER_VERSION}",
                head.version, head.binary_version
            )));
        }
        // Version 1 is the only layout so far; an older layout would be
        // parsed into its own struct here and converted.
        let r: Self = serde_json::from_slice(b)
            .map_err(|e| bad(format!("corrupt version {} record ({e})", head.version)))?;
        if r.deferred_state && r.version < DEFERRED_STATE_VERSION {
            return Err(bad(format!(
                "corrupt record: deferred state in a version {} record",
                r.version
            )));
        }
        if !r.sets.is_empty() && (r.version < SETS_VERSION || r.deferred_state) {
            return Err(bad(format!(
                "corrupt record: sandbox sets in a version {} {}record",
                r.version,
                if r.deferred_state { "standby " } else { "" }
            )));
        }
        let mut ids = BTreeSet::new();
        let mut fds = BTreeSet::new();
        fds.extend(r.listener_fd);
        for v in &r.vms {
            if r.deferred_state
                && (v.state.is_some() || !matches!(v.memory, MemorySource::Memfd { .. }))
            {
                return Err(bad(format!(
                    "corrupt record: VM {} of a standby record must have a memfd and no state",
                    v.id
                )));
            }
            if !ids.insert(v.id) {
                return Err(bad(format!("corrupt record: VM {} listed twice", v.id)));
            }
            let memfd = match v.memory {
                MemorySource::Memfd { fd, .. } => Some(fd),
                _ => None,
            };
            for fd in memfd.into_iter().chain(v.tap_fd) {
                if !fds.insert(fd) {
                    return Err(bad(format!("corrupt record: descriptor {fd} used twice")));
                }
            }
            v.check_fields()?;
            if v.id >= r.next_id {
                return Err(bad(format!(
                    "corrupt record: VM id {} >= next id {}",
                    v.id, r.next_id
                )));
            }
        }
        Ok(r)
    }
}

/// The guest images the taking-over binary boots fresh VMs with (cold).
#[derive(Clone)]
pub struct Images {
    pub kernel: Arc<Vec<u8>>,
    pub user: Arc<Vec<u8>>,
}

/// CLOCK_MONOTONIC in nanoseconds: comparable between the old and the new
/// process (an `Instant` is not transferable).
pub fn mono_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: ts is a valid timespec to write into; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Milliseconds between two [`mono_ns`] readings.
pub fn ms_between(from_ns: u64, to_ns: u64) -> f64 {
    to_ns.saturating_sub(from_ns) as f64 / 1e6
}

pub(crate) fn set_cloexec(fd: RawFd, on: bool) -> std::io::Result<()> {
    // SAFETY: F_GETFD/F_SETFD only read and write the descriptor flags of fd.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let new = if on { flags | libc::FD_CLOEXEC } else { flags & !libc::FD_CLOEXEC };
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, new) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Writes a record into a new memfd (close-on-exec until handed over).
pub fn record_memfd(record: &HandoverRecord) -> Result<File, VmmError> {
    let mut f = nl_memory::create_memfd("handover")?;
    f.write_all(&record.to_bytes())?;
    Ok(f)
}

/// Starts `binary args` with `inherit` open in the child under the same
/// numbers. FD_CLOEXEC is cleared in the child only, between fork and exec,
/// so no other process this one starts can inherit them by accident.
pub fn spawn_with_fds(
    binary: &Path,
    args: &[String],
    inherit: Vec<RawFd>,
) -> std::io::Result<Child> {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(binary);
    cmd.args(args).stdin(Stdio::null());
    // SAFETY: the hook runs between fork and exec and only calls fcntl (async-signal-safe) on fds it does not allocate.
    unsafe {
        cmd.pre_exec(move || {
            for &fd in &inherit {
                set_cloexec(fd, false)?;
            }
            Ok(())
        });
    }
    cmd.spawn()
}

/// Takes ownership of an inherited descriptor named in a record or argument.
pub(crate) fn take_fd(fd: i32, taken: &mut BTreeSet<i32>, what: &str) -> Result<File, VmmError> {
    if fd < 3 || !taken.insert(fd) {
        return Err(VmmError::State(format!(
            "handover refused: {what} descriptor {fd} is invalid or named twice"
        )));
    }
    set_cloexec(fd, true).map_err(|e| {
        VmmError::State(format!("handover refused: {what} descriptor {fd} is not open ({e})"))
    })?;
    // SAFETY: fd is open (F_SETFD succeeded), was inherited for exactly this purpose, and is taken at most once (checked above).
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// Reads a record from an inherited memfd.
fn read_record(file: &mut File) -> Result<HandoverRecord, VmmError> {
    HandoverRecord::from_bytes(&read_record_bytes(file)?)
}

/// A record's bytes from an inherited memfd: a regular file (a memfd is one)
/// of at most [`MAX_RECORD`] bytes.
fn read_record_bytes(file: &mut File) -> Result<Vec<u8>, VmmError> {
    nl_memory::file::read_open_limited(
        file,
        "(inherited descriptor)",
        "handover record",
        MAX_RECORD,
    )
    .map_err(|e| VmmError::State(format!("handover refused: {e}")))
}

/// Builds one VM of a record over the given memory (not started). With no
/// saved state the VM is created from scratch (cold).
pub fn build_vm(
    kvm: &Kvm,
    rec: &VmRecord,
    images: &Images,
    memory: Option<GuestMemory>,
) -> Result<Vm, VmmError> {
    let config = rec.config(images);
    match (&rec.state, memory, &rec.linux) {
        (Some(s), Some(mem), linux) => {
            let state = VmState::from_bytes(s.as_bytes())?;
            rec.check_state(&state)?;
            match linux {
                Some(l) => Vm::restore_linux(kvm, rec.id, config, mem, &state, l),
                None => Vm::restore(kvm, rec.id, config, mem, &state),
            }
        }
        (None, _, Some(l)) => {
            let (kernel, boot) = l.load()?;
            Vm::create_linux(kvm, rec.id, VmConfig { kernel, ..config }, &boot)
        }
        (None, _, None) => Vm::create(kvm, rec.id, config),
        (Some(_), None, _) => Err(VmmError::State(format!("VM {}: state without memory", rec.id))),
    }
}

/// Loads a save-restore memory image into fresh memory.
pub fn load_image(rec: &VmRecord, path: &Path) -> Result<GuestMemory, VmmError> {
    // A regular file of at most the VM's memory (load_from wants exactly that).
    let (mut f, _) = nl_memory::file::open_limited(path, "memory image", rec.mem_bytes)
        .map_err(|e| VmmError::State(format!("VM {}: {e}", rec.id)))?;
    let mem = GuestMemory::new(&format!("vm{}", rec.id), rec.mem_bytes)?;
    mem.load_from(&mut f)?;
    Ok(mem)
}

/// The new process's side of a handover, after the VMs are running here.
pub struct TakenOver {
    pub host: Arc<Host>,
    pub listener: Option<UnixListener>,
}

/// One VM's saved state, sent to a standby successor once the old process
/// has paused the VM (`state` line of the control protocol).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DeferredState {
    pub id: u32,
    /// Paused by the API user: stays paused after the handover.
    pub paused: bool,
    pub paused_at_ns: u64,
    /// The VM's [`VmState`] bytes.
    pub state: String,
}

/// The `state` line: every VM still to carry over (VMs that finished after
/// the record was written are left out and dropped by the successor).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct DeferredStates {
    pub vms: Vec<DeferredState>,
    /// The last `stats` of VMs that ended before the pause.
    #[serde(default)]
    pub finished: Vec<serde_json::Value>,
}

/// At most 80 characters of a peer's line, for an error message.
fn clip(line: &str) -> String {
    line.chars().take(80).collect()
}

/// Loads the deferred states into the VMs a standby successor prepared.
fn apply_states(
    host: &Host,
    vms: Vec<(VmRecord, Vm)>,
    line: &str,
) -> Result<Vec<(VmRecord, Vm)>, VmmError> {
    let bad = |m: String| VmmError::State(format!("handover refused: {m}"));
    let body = line
        .strip_prefix("state ")
        .ok_or_else(|| bad(format!("expected the VM states, got {:?}", clip(line))))?;
    let states: DeferredStates =
        serde_json::from_str(body).map_err(|e| bad(format!("bad state message ({e})")))?;
    if crate::selftest::handover_refuses_state() {
        return Err(bad("self-test: refusing the VM states".into()));
    }
    let mut by_id: std::collections::BTreeMap<u32, DeferredState> = Default::default();
    for st in states.vms {
        let id = st.id;
        if by_id.insert(id, st).is_some() {
            return Err(bad(format!("state for VM {id} sent twice")));
        }
    }
    let mut out = Vec::new();
    for (mut rec, vm) in vms {
        // A VM without state finished in the old process meanwhile: dropped.
        let Some(st) = by_id.remove(&rec.id) else { continue };
        let state = VmState::from_bytes(st.state.as_bytes())?;
        rec.check_state(&state)?;
        vm.restore_state(&state).map_err(|e| bad(format!("VM {}: {e}", rec.id)))?;
        rec.paused = st.paused;
        rec.paused_at_ns = st.paused_at_ns;
        rec.state = Some(st.state);
        out.push((rec, vm));
    }
    if let Some(id) = by_id.keys().next() {
        return Err(bad(format!("state for VM {id}, which the record does not list")));
    }
    adopt_finished(host, &states.finished);
    Ok(out)
}

/// Lines of the control protocol (new → old unless noted). A standby
/// successor (record version 2, [`HandoverRecord::deferred_state`]) first
/// sends `standby {...}` (every VM built over its memfd, nothing paused yet)
/// and receives old → new `state {...}` ([`DeferredStates`]) once the old
/// process has paused the VMs. Then: `ready {...}` (all VMs re-created with
/// their state, not running), old → new `go` or `abort`, `starting` (the
/// commit point: sent before any vCPU runs here), `started {...}` (per-VM
/// start and first-heartbeat times), or `error MESSAGE` at any point before
/// `starting`.
pub fn take_over(
    record_fd: i32,
    ctl_fd: i32,
    images: &Images,
    main_ns: u64,
) -> Result<TakenOver, VmmError> {
    let mut taken = BTreeSet::new();
    let ctl = take_fd(ctl_fd, &mut taken, "control")?;
    let ctl = UnixStream::from(std::os::fd::OwnedFd::from(ctl));
    ctl.local_addr().map_err(|e| {
        VmmError::State(format!("handover refused: control descriptor is not a socket ({e})"))
    })?;
    let mut out = ctl.try_clone()?;
    let mut reader = BufReader::new(ctl);
    let refuse = |out: &mut UnixStream, e: VmmError| {
        let _ = writeln!(out, "error {}", e.to_string().replace('\n', " "));
        e
    };
    let r = take_fd(record_fd, &mut taken, "record")
        .and_then(|mut f| read_record(&mut f))
        .and_then(|record| {
            let prepared = prepare_record(&record, &mut taken, images)?;
            // Sandbox sets are rebuilt before `ready`: one that cannot be
            // refuses the handover, and the old process keeps everything.
            crate::carry::adopt_all(prepared.0.kvm(), &record.sets, &mut taken, true)?;
            Ok((record.deferred_state, record.finished, prepared))
        });
    let (deferred, finished, (host, listener, mut vms, generation)) = match r {
        Ok(v) => v,
        Err(e) => return Err(refuse(&mut out, e)),
    };
    adopt_finished(&host, &finished);
    let mut line = String::new();
    let mut times = json!({"main_ns": main_ns});
    if deferred {
        times["standby_ns"] = json!(mono_ns());
        writeln!(out, "standby {times}")?;
        reader.read_line(&mut line)?;
        times["state_ns"] = json!(mono_ns());
        vms = match apply_states(&host, vms, line.trim_end()) {
            Ok(v) => v,
            Err(e) => return Err(refuse(&mut out, e)),
        };
    }
    times["ready_ns"] = json!(mono_ns());
    writeln!(out, "ready {times}")?;
    line.clear();
    reader.read_line(&mut line)?;
    if line.trim() != "go" {
        return Err(VmmError::State("the old VMM kept its VMs (handover aborted)".into()));
    }
    let go_ns = mono_ns();
    writeln!(out, "starting")?;
    let mut starts = Vec::new();
    for (rec, vm) in vms {
        let id = vm.id();
        let vm = host.adopt(vm, rec.paused).map_err(|e| VmmError::Vm(id, e.to_string()))?;
        starts.push((rec, vm, mono_ns()));
    }
    crate::carry::start_adopted();
    let sets_started_ns = mono_ns();
    host.set_generation(generation);
    // Report per-VM start and first-heartbeat times without holding up the API.
    std::thread::Builder::new().name("handover-report".into()).spawn(move || {
        crate::seccomp::apply(crate::seccomp::Kind::Api);
        let mut vms = Vec::new();
        for (rec, vm, start_ns) in &starts {
            let (beat_ns, workload_ns) = if rec.paused {
                (None, None)
            } else {
                wait_first_beat(vm, rec.state.is_none(), Duration::from_secs(20))
            };
            vms.push(json!({
                "id": rec.id, "paused_at_ns": rec.paused_at_ns, "start_ns": start_ns,
                "first_beat_ns": beat_ns, "workload_start_ns": workload_ns,
            }));
        }
        let _ = writeln!(
            out,
            "started {}",
            json!({"go_ns": go_ns, "vms": vms, "sets_started_ns": sets_started_ns})
        );
    })?;
    Ok(TakenOver { host, listener })
}

/// Keeps answering for VMs that ended before the handover.
fn adopt_finished(host: &Host, finished: &[serde_json::Value]) {
    for f in finished {
        if let Some(id) = f["summary"]["id"].as_u64().and_then(|i| u32::try_from(i).ok()) {
            host.adopt_finished(id, f.clone());
        }
    }
}

type Prepared = (Arc<Host>, Option<UnixListener>, Vec<(VmRecord, Vm)>, u64);

/// TAP descriptors inherited across a microreboot or a warm reboot, by interface name; the
/// VM that uses the interface takes its descriptor when it is re-created.
static INHERITED_TAPS: std::sync::Mutex<Vec<(String, File)>> = std::sync::Mutex::new(Vec::new());

pub(crate) fn inherit_tap(name: &str, f: File) {
    INHERITED_TAPS.lock().unwrap_or_else(|p| p.into_inner()).push((name.to_string(), f));
}

pub(crate) fn take_inherited_tap(name: &str) -> Option<File> {
    let mut v = INHERITED_TAPS.lock().unwrap_or_else(|p| p.into_inner());
    let i = v.iter().position(|(n, _)| n == name)?;
    Some(v.swap_remove(i).1)
}

/// FNV-1a of a record's bytes: a microreboot passes it beside the record,
/// so a record corrupted in memory is refused.
pub fn record_checksum(b: &[u8]) -> u64 {
    b.iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &x| (h ^ u64::from(x)).wrapping_mul(0x100_0000_01b3))
}

/// The fresh process of a microreboot: the old process exec'd this one in
/// place (same pid) with the record in `record_fd`. Re-creates and starts
/// every VM over its inherited memfd, and reports the steps.
pub fn take_over_in_place(
    record_fd: i32,
    checksum: u64,
    images: &Images,
    main_ns: u64,
) -> Result<TakenOver, VmmError> {
    let mut taken = BTreeSet::new();
    let b = read_record_bytes(&mut take_fd(record_fd, &mut taken, "record")?)?;
    let got = record_checksum(&b);
    if got != checksum {
        return Err(VmmError::State(format!(
            "microreboot refused: the recovery record is corrupt (checksum {got:#x}, expected {checksum:#x})"
        )));
    }
    let record = HandoverRecord::from_bytes(&b)?;
    let prep_ns = mono_ns();
    let (host, listener, vms, generation) = prepare_record(&record, &mut taken, images)?;
    // No way back from a microreboot: a set that cannot be rebuilt is
    // reported and left out, the rest of the host comes up.
    let refused = crate::carry::adopt_all(host.kvm(), &record.sets, &mut taken, false)?;
    let built_ns = mono_ns();
    adopt_finished(&host, &record.finished);
    for (rec, vm) in vms {
        let id = vm.id();
        host.adopt(vm, rec.paused).map_err(|e| VmmError::Vm(id, e.to_string()))?;
    }
    crate::carry::start_adopted();
    host.set_generation(generation);
    let started_ns = mono_ns();
    let old = record.reboot.clone().unwrap_or(serde_json::Value::Null);
    let begin_ns = old["started_ns"].as_u64().unwrap_or(main_ns);
    let exec_ns = old["exec_ns"].as_u64().unwrap_or(main_ns);
    let line = json!({
        "policy": "microreboot", "cause": old["cause"], "recovery": generation,
        "total_us": (started_ns.saturating_sub(begin_ns)) as f64 / 1e3,
        "steps": old["steps"],
        "new_process_steps": [
            {"step": "exec_to_main", "us": main_ns.saturating_sub(exec_ns) as f64 / 1e3},
            {"step": "runtime_and_args", "us": prep_ns.saturating_sub(main_ns) as f64 / 1e3},
            {"step": "recreate_vms", "us": built_ns.saturating_sub(prep_ns) as f64 / 1e3,
             "detail": record.vms.len(), "sets": record.sets.len() - refused.len(),
             "sets_refused": refused},
            {"step": "start_vms", "us": started_ns.saturating_sub(built_ns) as f64 / 1e3},
        ],
    });
    eprintln!("{}{line}", crate::recovery::RECOVERED_PREFIX);
    Ok(TakenOver { host, listener })
}

fn prepare_record(
    record: &HandoverRecord,
    taken: &mut BTreeSet<i32>,
    images: &Images,
) -> Result<Prepared, VmmError> {
    let listener = match record.listener_fd {
        Some(fd) => {
            let f = take_fd(fd, taken, "listener")?;
            let l = UnixListener::from(std::os::fd::OwnedFd::from(f));
            l.local_addr().map_err(|e| {
                VmmError::State(format!("handover refused: descriptor {fd} is not a socket ({e})"))
            })?;
            Some(l)
        }
        None => None,
    };
    for rec in &record.vms {
        if let (Some(fd), Some(net)) = (rec.tap_fd, &rec.net) {
            inherit_tap(&net.tap, take_fd(fd, taken, "TAP")?);
        }
    }
    let host = Host::new()?;
    if let Some(l) = record.limits {
        host.set_limits(l);
    }
    host.reserve_ids(record.next_id);
    let mut vms = Vec::new();
    for rec in &record.vms {
        let memory = match &rec.memory {
            MemorySource::Memfd { fd, ino } => {
                let f = take_fd(*fd, taken, "memory")?;
                let got = f.metadata()?.ino();
                if got != *ino {
                    return Err(VmmError::State(format!(
                        "handover refused: VM {}: descriptor {fd} is inode {got}, the record says {ino}",
                        rec.id
                    )));
                }
                Some(GuestMemory::from_fd(Arc::new(f), rec.mem_bytes)?)
            }
            MemorySource::Image { path } => Some(load_image(rec, path)?),
            MemorySource::Fresh => None,
        };
        let vm = match memory {
            Some(mem) if record.deferred_state => {
                // A standby successor has time: fill the page tables now,
                // not by one fault per page after the VM resumes.
                if let Err(e) = mem.populate_allocated() {
                    tracing::warn!("VM {}: {e} (pages will fault in on use)", rec.id);
                }
                match &rec.linux {
                    Some(l) => Vm::prepare_linux(host.kvm(), rec.id, rec.config(images), mem, l),
                    None => Vm::prepare(host.kvm(), rec.id, rec.config(images), mem),
                }
            }
            memory => build_vm(host.kvm(), rec, images, memory),
        }
        .map_err(|e| VmmError::State(format!("VM {}: {e}", rec.id)))?;
        vms.push((rec.clone(), vm));
    }
    Ok((host, listener, vms, record.generation))
}

/// Polls until a VM's guest heartbeats (or finishes) after a start. Returns
/// the first-heartbeat time and, if the guest (re)entered its workload, when.
fn wait_first_beat(vm: &Vm, fresh: bool, limit: Duration) -> (Option<u64>, Option<u64>) {
    use std::sync::atomic::Ordering::Relaxed;
    let c = vm.control();
    // A freshly booted VM starts from zero; a restored one from its saved registers.
    let beats0 = if fresh { 0 } else { c.total_beats() };
    let phase0: Vec<u64> =
        c.vcpus.iter().map(|r| if fresh { 0 } else { r.phase.load(Relaxed) }).collect();
    let t0 = mono_ns();
    let mut workload = None;
    while ms_between(t0, mono_ns()) < limit.as_secs_f64() * 1e3 {
        let now = mono_ns();
        if workload.is_none()
            && c.vcpus.iter().zip(&phase0).any(|(r, p)| {
                let ph = r.phase.load(Relaxed);
                ph >= nl_abi::PHASE_WORKLOAD_START && *p < nl_abi::PHASE_WORKLOAD_START
            })
        {
            workload = Some(now);
        }
        if c.total_beats() != beats0
            || c.vcpus.iter().all(|r| r.phase.load(Relaxed) == nl_abi::PHASE_DONE)
        {
            return (Some(now), workload);
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    (None, workload)
}

/// The raw descriptor of a memory's memfd and its inode.
pub fn memfd_of(mem: &GuestMemory) -> Result<(RawFd, u64), VmmError> {
    let f = mem.fd();
    Ok((f.as_raw_fd(), f.metadata()?.ino()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> HandoverRecord {
        let mut r = HandoverRecord::new(Mode::Warm, 1, Some(5), 3);
        let c = VmConfig {
            mem_bytes: 64 << 20,
            vcpus: 1,
            workload: WorkloadParams::default(),
            kernel: Arc::default(),
            user: Arc::default(),
            console_path: None,
            timer_hz: 100,
            heartbeat_timeout: Duration::from_secs(10),
            disk: Some(crate::config::DiskConfig { path: "/tmp/d.img".into(), readonly: true }),
            net: None,
        };
        let mut v = VmRecord::describe(2, &c, false);
        v.memory = MemorySource::Memfd { fd: 7, ino: 99 };
        v.state = Some("{}".into());
        r.vms.push(v);
        r
    }

    #[test]
    fn records_round_trip() {
        // Every field read back, not only a few: the record as JSON is the
        // same after a round trip, with fields set away from their defaults.
        let mut rec = sample();
        rec.vms[0].mem_bytes = 96 << 20;
        rec.vms[0].workload.seed = 0x5eed;
        rec.vms[0].workload.duration_ms = 1234;
        rec.vms[0].paused = true;
        rec.vms[0].paused_at_ns = 42;
        rec.vms[0].console_path = Some("/tmp/c.log".into());
        rec.vms[0].tap_fd = Some(9);
        let r = HandoverRecord::from_bytes(&rec.to_bytes()).unwrap();
        assert_eq!(serde_json::to_value(&r).unwrap(), serde_json::to_value(&rec).unwrap());
        assert_eq!(r.vms[0].id, 2);
        assert_eq!(r.mode, Mode::Warm);
    }

    #[test]
    fn other_versions_and_corruption_are_refused_clearly() {
        let mut v = serde_json::to_value(sample()).unwrap();
        v["version"] = json!(HANDOVER_VERSION + 1);
        let e = HandoverRecord::from_bytes(v.to_string().as_bytes()).unwrap_err().to_string();
        assert!(e.contains("record version 4") && e.contains("reads versions 1..=3"), "{e}");
        v["version"] = json!(0);
        assert!(HandoverRecord::from_bytes(v.to_string().as_bytes()).is_err());
        let b = sample().to_bytes();
        let e = HandoverRecord::from_bytes(&b[..b.len() / 2]).unwrap_err().to_string();
        assert!(e.contains("not a ninelives handover record"), "{e}");
        let e = HandoverRecord::from_bytes(b"{\"magic\":\"x\",\"version\":1}").unwrap_err();
        assert!(e.to_string().contains("magic"), "{e}");
        let mut v = serde_json::to_value(sample()).unwrap();
        v["vms"][0]["memory"]["fd"] = json!(5);
        let e = HandoverRecord::from_bytes(v.to_string().as_bytes()).unwrap_err();
        assert!(e.to_string().contains("used twice"), "{e}");
        let mut v = serde_json::to_value(sample()).unwrap();
        v["vms"][0]["mem_bytes"] = json!("lots");
        let e = HandoverRecord::from_bytes(v.to_string().as_bytes()).unwrap_err();
        assert!(e.to_string().contains("corrupt version 1 record"), "{e}");
    }

    #[test]
    fn standby_records_are_version_2_and_checked() {
        // Without deferred state a record stays version 1, for older readers.
        assert_eq!(sample().version, 1);
        let mut r = sample();
        r.vms[0].state = None;
        r.defer_state();
        let back = HandoverRecord::from_bytes(&r.to_bytes()).unwrap();
        assert!(back.deferred_state);
        assert_eq!(back.version, DEFERRED_STATE_VERSION);
        // A version 1 record cannot carry deferred state.
        let mut v = serde_json::to_value(&r).unwrap();
        v["version"] = json!(1);
        let e = HandoverRecord::from_bytes(v.to_string().as_bytes()).unwrap_err().to_string();
        assert!(e.contains("deferred state in a version 1 record"), "{e}");
        // A standby record names memfds and no state.
        let mut v = serde_json::to_value(&r).unwrap();
        v["vms"][0]["state"] = json!("{}");
        let e = HandoverRecord::from_bytes(v.to_string().as_bytes()).unwrap_err().to_string();
        assert!(e.contains("must have a memfd and no state"), "{e}");
    }

    #[test]
    fn records_with_sets_are_version_3_and_checked() {
        let mut r = sample();
        let set = crate::carry::SetRecord::new("pair", json!({}));
        r.carry_sets(std::slice::from_ref(&set));
        assert_eq!(r.version, SETS_VERSION);
        let back = HandoverRecord::from_bytes(&r.to_bytes()).unwrap();
        assert_eq!(back.sets.len(), 1);
        // Without sets a record stays version 1.
        let mut plain = sample();
        plain.carry_sets(&[]);
        assert_eq!(plain.version, 1);
        let mut v = serde_json::to_value(&r).unwrap();
        v["version"] = json!(2);
        let e = HandoverRecord::from_bytes(v.to_string().as_bytes()).unwrap_err().to_string();
        assert!(e.contains("sandbox sets in a version 2 record"), "{e}");
        // A corrupt set record does not spoil the record: it is refused
        // on its own when the sets are taken over.
        let mut v = serde_json::to_value(&r).unwrap();
        v["sets"][0]["vms"] = json!("garbage");
        let back = HandoverRecord::from_bytes(v.to_string().as_bytes()).unwrap();
        let e = crate::carry::SetRecord::parse(&back.sets[0]).unwrap_err().to_string();
        assert!(e.contains("sandbox set record 'pair' refused: corrupt"), "{e}");
    }

    #[test]
    fn a_record_from_before_filecache_still_parses() {
        // Written by a binary whose workload parameters had no data_bytes.
        let mut v = serde_json::to_value(sample()).unwrap();
        let w = v["vms"][0]["workload"].as_object_mut().unwrap();
        assert!(w.remove("data_bytes").is_some());
        let r = HandoverRecord::from_bytes(v.to_string().as_bytes()).unwrap();
        assert_eq!(r.vms[0].workload.data_bytes, 0);
    }

    fn state_for(v: &VmRecord) -> VmState {
        use crate::state::{IrqchipState, VcpuState};
        let vcpu = || VcpuState {
            regs: Default::default(),
            sregs: Default::default(),
            xsave: Default::default(),
            xcrs: Default::default(),
            msrs: Vec::new(),
            lapic: Default::default(),
            mp_state: Default::default(),
            events: Default::default(),
        };
        VmState {
            version: crate::state::STATE_VERSION,
            mem_bytes: v.mem_bytes,
            num_vcpus: v.vcpus,
            timer_hz: v.timer_hz,
            workload: v.workload,
            vcpus: (0..v.vcpus).map(|_| vcpu()).collect(),
            irqchip: IrqchipState { chips: Vec::new(), clock: None, pit: None },
            io_devices: Vec::new(),
            mmio_devices: Vec::new(),
        }
    }

    #[test]
    fn a_record_that_disagrees_with_its_state_is_refused_by_field() {
        let r = sample();
        let v = &r.vms[0];
        v.check_state(&state_for(v)).unwrap();
        let mut s = state_for(v);
        s.timer_hz = 250;
        let e = v.check_state(&s).unwrap_err().to_string();
        assert!(e.contains("record field timer_hz is 100 but its saved state says 250"), "{e}");
        let mut s = state_for(v);
        s.mem_bytes = 128 << 20;
        let e = v.check_state(&s).unwrap_err().to_string();
        assert!(e.contains("field mem_bytes"), "{e}");
        let mut s = state_for(v);
        s.num_vcpus = 2;
        let e = v.check_state(&s).unwrap_err().to_string();
        assert!(e.contains("field vcpus"), "{e}");
        let mut s = state_for(v);
        s.vcpus.clear();
        let e = v.check_state(&s).unwrap_err().to_string();
        assert!(e.contains("field vcpus is 1 but its saved state says 1 (0 vCPU states)"), "{e}");
        let mut s = state_for(v);
        s.workload.duration_ms = u64::MAX;
        let e = v.check_state(&s).unwrap_err().to_string();
        assert!(e.contains("field workload"), "{e}");
    }

    #[test]
    fn a_record_with_impossible_fields_is_refused_by_name() {
        for (field, value, want) in [
            ("vcpus", json!(0), "--vcpus 0 is out of range"),
            ("vcpus", json!(nl_abi::MAX_VCPUS + 1), "is out of range"),
            ("timer_hz", json!(0), "timer frequency 0 Hz"),
            ("mem_bytes", json!(u64::MAX), "too large"),
            ("mem_bytes", json!((64u64 << 20) + 1), "multiple of 4096"),
        ] {
            let mut v = serde_json::to_value(sample()).unwrap();
            v["vms"][0][field] = value;
            let e = HandoverRecord::from_bytes(v.to_string().as_bytes()).unwrap_err().to_string();
            assert!(e.contains("handover refused: VM 2") && e.contains(want), "{field}: {e}");
        }
        // The working set must fit the memory the record names.
        let mut v = serde_json::to_value(sample()).unwrap();
        v["vms"][0]["workload"]["ws_bytes"] = json!(1u64 << 40);
        let e = HandoverRecord::from_bytes(v.to_string().as_bytes()).unwrap_err().to_string();
        assert!(e.contains("guest memory too small"), "{e}");
    }

    #[test]
    fn a_record_descriptor_that_is_not_a_regular_file_or_too_big_is_refused() {
        let mut zero = File::open("/dev/zero").unwrap();
        let e = read_record_bytes(&mut zero).unwrap_err().to_string();
        assert!(e.contains("handover record") && e.contains("character device"), "{e}");
        let mut big = nl_memory::create_memfd("big-record").unwrap();
        big.set_len(MAX_RECORD + 1).unwrap();
        let e = read_record_bytes(&mut big).unwrap_err().to_string();
        assert!(e.contains(&format!("limit for a handover record is {MAX_RECORD}")), "{e}");
    }

    #[test]
    fn modes_parse() {
        assert_eq!(Mode::parse("save-restore"), Ok(Mode::SaveRestore));
        assert!(Mode::parse("tepid").unwrap_err().contains("warm, cold, save-restore"));
    }
}
