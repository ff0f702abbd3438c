//! The backup: receives epochs, stages each one, applies it only when it is
//! complete and verified, acknowledges it, and decides when to take over.
//!
//! Connections: one thread accepts; each connection's handshake runs on a
//! thread of its own (at most [`MAX_PENDING`] at once, more are refused at
//! once) and must be complete within [`BackupConfig::handshake`] in all, not
//! per byte, so a slow or bogus peer never delays the real primary. The
//! first peer that proves the key (see [`crate::auth`]) and whose VM matches
//! holds the slot; every later connection is refused with the reason.
//!
//! **Activation rule.** The backup takes the VM over only
//! 1. from an epoch it acknowledged to an authenticated primary (an epoch
//!    is acknowledged once all of its sealed frames verified, its page and
//!    disk checks passed and its disk writes are in the copy; a frame that
//!    fails authentication rejects the stream: the backup stands down and
//!    never activates from that connection), and
//! 2. only once that primary's lease has run out: no frame from it for
//!    [`BackupConfig::lease`]. A closed or reset connection alone does not
//!    activate before then; the backup waits out the rest of the lease.
//!
//! A peer that never authenticated can never lead to an activation: it never
//! gets the slot, and no frame of it is read past the handshake.

use std::fs::File;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use nl_memory::GuestMemory;
use nl_vmm::linux::LinuxRecord;
use nl_vmm::state::{VmState, STATE_VERSION};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use crate::auth::{backup_challenge, Deadline, Key};
use crate::protocol::*;

/// The backup's copy of the VM: memory, disk and state as of the last
/// complete, verified epoch, plus the epoch being received.
pub struct Receiver {
    memory: GuestMemory,
    vcpus: u32,
    /// The hello announced a Linux VM: every epoch's state must be a Linux
    /// VM's, and without it none may be.
    linux: bool,
    disk: Option<BackupDisk>,
    committed: Option<(u64, Vec<u8>)>,
    staging: Staging,
    spare: Vec<Vec<u8>>,
}

/// The backup's copy of the primary's disk image.
pub struct BackupDisk {
    file: File,
    sectors: u64,
    /// An epoch's writes failed half-way: the copy matches no epoch, and
    /// this backup must never activate.
    broken: bool,
}

impl BackupDisk {
    /// Creates `path`, or empties an existing file, at `bytes` (the full
    /// copy then fills it).
    pub fn create(path: &Path, bytes: u64) -> Result<Self, String> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(|e| format!("cannot create the disk copy {}: {e}", path.display()))?;
        file.set_len(bytes)
            .map_err(|e| format!("cannot size the disk copy {}: {e}", path.display()))?;
        Ok(BackupDisk { file, sectors: bytes / SECTOR, broken: false })
    }
}

#[derive(Default)]
struct Staging {
    frames: u32,
    pages: u64,
    bytes: u64,
    crc: crc32fast::Hasher,
    /// The epoch's `Pages` and `Disk` payloads, kept whole (no copy per run).
    payloads: Vec<Vec<u8>>,
    /// (gpa, payload index, offset, length) of each run.
    runs: Vec<(u64, usize, usize, usize)>,
    /// (sector, payload index, offset, length, flush) of each disk write.
    disk: Vec<(u64, usize, usize, usize, bool)>,
}

impl Receiver {
    pub fn new(mem_bytes: u64, vcpus: u32) -> Result<Self, String> {
        let memory = GuestMemory::new("backup", mem_bytes).map_err(|e| e.to_string())?;
        Ok(Self {
            memory,
            vcpus,
            linux: false,
            disk: None,
            committed: None,
            staging: Staging::default(),
            spare: Vec::new(),
        })
    }

    /// The primary's VM is a Linux VM (its hello carried a boot record).
    pub fn with_linux(mut self, linux: bool) -> Self {
        self.linux = linux;
        self
    }

    /// Keeps the primary's disk in `disk` as well.
    pub fn with_disk(mut self, disk: BackupDisk) -> Self {
        self.disk = Some(disk);
        self
    }

    /// The epoch the next frames must belong to.
    pub fn expected_epoch(&self) -> u64 {
        self.committed.as_ref().map_or(0, |(e, _)| e + 1)
    }

    /// The last complete epoch and its state bytes.
    pub fn committed(&self) -> Option<(u64, &[u8])> {
        self.committed.as_ref().map(|(e, s)| (*e, s.as_slice()))
    }

    pub fn memory(&self) -> &GuestMemory {
        &self.memory
    }

    /// Hands over memory and state of the last complete epoch.
    pub fn into_committed(self) -> Option<(u64, GuestMemory, VmState)> {
        if self.disk.as_ref().is_some_and(|d| d.broken) {
            return None;
        }
        let (epoch, bytes) = self.committed?;
        let state = VmState::from_bytes(&bytes).ok()?;
        Some((epoch, self.memory, state))
    }

    /// Drops a partly received epoch (the last complete one stays).
    pub fn discard_staging(&mut self) {
        let st = std::mem::take(&mut self.staging);
        self.spare.extend(st.payloads);
    }

    /// Payload buffers no longer needed, for reading further frames into.
    pub fn take_spare(&mut self) -> Vec<Vec<u8>> {
        std::mem::take(&mut self.spare)
    }

    /// Takes one epoch frame. Returns the epoch number when the frame
    /// completed and applied an epoch. An error rejects the epoch being
    /// received (it is discarded; the last complete epoch stays).
    pub fn on_frame(&mut self, f: Frame) -> Result<Option<u64>, ProtoError> {
        let c = crc32fast::hash(&f.payload);
        self.on_frame_ack(f, c, &mut |_| Ok(()))
    }

    /// [`Receiver::on_frame`] with the payload's CRC already known, calling
    /// `ack` once a complete epoch verified and before it is applied (the
    /// apply is a copy that cannot fail: every run was bounds-checked, and
    /// nothing else happens on this side before it is done). An epoch whose
    /// ack could not be sent is not committed: the backup never activates
    /// from an epoch it did not acknowledge.
    pub fn on_frame_ack(
        &mut self,
        f: Frame,
        payload_crc: u32,
        ack: &mut dyn FnMut(u64) -> Result<(), ProtoError>,
    ) -> Result<Option<u64>, ProtoError> {
        let r = self.take(f, payload_crc, ack);
        if r.is_err() {
            self.discard_staging();
        }
        r
    }

    fn take(
        &mut self,
        f: Frame,
        payload_crc: u32,
        ack: &mut dyn FnMut(u64) -> Result<(), ProtoError>,
    ) -> Result<Option<u64>, ProtoError> {
        let want = self.expected_epoch();
        if f.epoch != want {
            return Err(ProtoError::Bad(format!(
                "{:?} frame for epoch {} while receiving epoch {want} (reordered or replayed)",
                f.kind, f.epoch
            )));
        }
        match f.kind {
            Kind::Pages => {
                self.check_seq(&f, want)?;
                let idx = self.staging.payloads.len();
                let mut runs = Vec::new();
                for (gpa, data) in parse_runs(&f.payload)? {
                    self.check_range(gpa, data.len() as u64)?;
                    let off = data.as_ptr() as usize - f.payload.as_ptr() as usize;
                    runs.push((gpa, idx, off, data.len()));
                }
                self.stage(f.payload, payload_crc, want)?;
                self.staging.pages += runs.iter().map(|r| (r.3 / PAGE) as u64).sum::<u64>();
                self.staging.runs.extend(runs);
                Ok(None)
            }
            Kind::Disk => {
                self.check_seq(&f, want)?;
                let Some(disk) = &self.disk else {
                    return Err(ProtoError::Bad("disk writes for a VM without a disk".into()));
                };
                let idx = self.staging.payloads.len();
                let mut writes = Vec::new();
                for r in parse_disk_runs(&f.payload, disk.sectors)? {
                    let off = r.data.as_ptr() as usize - f.payload.as_ptr() as usize;
                    writes.push((r.sector, idx, off, r.data.len(), r.flush));
                }
                self.stage(f.payload, payload_crc, want)?;
                self.staging.disk.extend(writes);
                Ok(None)
            }
            Kind::EpochEnd => {
                let end = EpochEnd::decode(&f.payload)?;
                let st = std::mem::take(&mut self.staging);
                let checked = (|| {
                    if end.frames != st.frames || end.pages != st.pages {
                        return Err(ProtoError::Bad(format!(
                            "epoch {want} is incomplete: {} frames / {} pages received, {} / {} sent",
                            st.frames, st.pages, end.frames, end.pages
                        )));
                    }
                    if st.crc.clone().finalize() != end.data_crc {
                        return Err(ProtoError::Bad(format!(
                            "epoch {want}: page data checksum mismatch"
                        )));
                    }
                    let state = VmState::from_bytes(&end.state)
                        .map_err(|e| ProtoError::Bad(format!("epoch {want}: {e}")))?;
                    if state.mem_bytes != self.memory.size() || state.num_vcpus != self.vcpus {
                        return Err(ProtoError::Bad(format!(
                            "epoch {want}: state is for {} bytes / {} vCPUs, not {} / {}",
                            state.mem_bytes,
                            state.num_vcpus,
                            self.memory.size(),
                            self.vcpus
                        )));
                    }
                    match (self.linux, nl_vmm::linux::is_linux_state(&state)) {
                        (false, true) => Err(ProtoError::Bad(format!(
                            "epoch {want}: the state is a Linux VM's (it has an i8042) but the \
                             primary's hello carried no Linux record"
                        ))),
                        (true, false) => Err(ProtoError::Bad(format!(
                            "epoch {want}: the primary's hello announced a Linux VM but the \
                             state is not one (it has no i8042)"
                        ))),
                        _ => Ok(()),
                    }
                })();
                if let Err(e) = checked {
                    self.spare.extend(st.payloads);
                    return Err(e);
                }
                // Verified. The disk writes go first: they can fail (a full
                // host disk), and an epoch is acknowledged only once its
                // writes are in the copy. What they overwrite is kept, so
                // an epoch whose ack cannot be sent (the primary died in
                // that moment) is taken back out of the copy, which then
                // matches the last acknowledged epoch again.
                let undo = match self.apply_disk(&st) {
                    Ok(undo) => undo,
                    Err(e) => {
                        self.spare.extend(st.payloads);
                        return Err(e);
                    }
                };
                // Then acknowledge, and apply the memory.
                if let Err(e) = ack(want) {
                    self.undo_disk(undo);
                    self.spare.extend(st.payloads);
                    return Err(e);
                }
                self.spare.extend(undo.into_iter().map(|(_, old)| old));
                for &(gpa, idx, off, len) in &st.runs {
                    let data = &st.payloads[idx][off..off + len];
                    self.memory.mem().write_slice(data, GuestAddress(gpa)).map_err(|e| {
                        ProtoError::Bad(format!("applying a page at {gpa:#x}: {e}"))
                    })?;
                }
                self.spare.extend(st.payloads);
                self.committed = Some((want, end.state));
                Ok(Some(want))
            }
            other => Err(ProtoError::Bad(format!("unexpected {other:?} frame inside an epoch"))),
        }
    }

    /// Keeps a data frame's payload for its epoch (bounded: an epoch
    /// carries at most twice the guest's memory and disk) and adds it to the
    /// epoch's CRC.
    fn stage(&mut self, payload: Vec<u8>, payload_crc: u32, want: u64) -> Result<(), ProtoError> {
        self.staging.bytes += payload.len() as u64;
        let disk_bytes = self.disk.as_ref().map_or(0, |d| d.sectors * SECTOR);
        if self.staging.bytes > 2 * (self.memory.size() + disk_bytes) {
            return Err(ProtoError::Bad(format!(
                "epoch {want} carries more data than twice the guest memory and disk"
            )));
        }
        let h = crc32fast::Hasher::new_with_initial_len(payload_crc, payload.len() as u64);
        self.staging.crc.combine(&h);
        self.staging.frames += 1;
        self.staging.payloads.push(payload);
        Ok(())
    }

    /// Data frames of an epoch must come in sequence.
    fn check_seq(&self, f: &Frame, want: u64) -> Result<(), ProtoError> {
        if f.seq == self.staging.frames {
            return Ok(());
        }
        Err(ProtoError::Bad(format!(
            "frame {} of epoch {want} arrived where frame {} was due (reordered)",
            f.seq, self.staging.frames
        )))
    }

    /// Writes an epoch's disk writes to the copy, in order, and returns
    /// what they overwrote (sector, old bytes), in the same order, for
    /// [`Receiver::undo_disk`]. A failure leaves the copy matching no
    /// epoch: the backup is broken for good.
    fn apply_disk(&mut self, st: &Staging) -> Result<Vec<(u64, Vec<u8>)>, ProtoError> {
        let Some(disk) = self.disk.as_mut() else { return Ok(Vec::new()) };
        let mut undo = Vec::new();
        for &(sector, idx, off, len, flush) in &st.disk {
            let r = if flush {
                disk.file.sync_data()
            } else {
                let mut old = self.spare.pop().unwrap_or_default();
                old.clear();
                old.resize(len, 0);
                disk.file.read_exact_at(&mut old, sector * SECTOR).and_then(|()| {
                    undo.push((sector, old));
                    disk.file.write_all_at(&st.payloads[idx][off..off + len], sector * SECTOR)
                })
            };
            if let Err(e) = r {
                disk.broken = true;
                return Err(ProtoError::Bad(format!(
                    "cannot write the disk copy at sector {sector} ({e}); this backup can no \
                     longer take over"
                )));
            }
        }
        Ok(undo)
    }

    /// Takes an epoch's disk writes back out of the copy (newest first),
    /// from what [`Receiver::apply_disk`] kept. If that fails too, the copy
    /// matches no epoch and the backup can no longer take over.
    fn undo_disk(&mut self, undo: Vec<(u64, Vec<u8>)>) {
        let Some(disk) = self.disk.as_mut() else { return };
        for (sector, old) in undo.into_iter().rev() {
            if disk.file.write_all_at(&old, sector * SECTOR).is_err() {
                disk.broken = true;
            }
            self.spare.push(old);
        }
    }

    fn check_range(&self, gpa: u64, len: u64) -> Result<(), ProtoError> {
        let ok = self
            .memory
            .regions()
            .iter()
            .any(|r| gpa >= r.gpa && gpa.checked_add(len).is_some_and(|e| e <= r.gpa + r.size));
        if ok {
            Ok(())
        } else {
            Err(ProtoError::Bad(format!("page run {gpa:#x}+{len:#x} is outside guest RAM")))
        }
    }
}

/// How the backup is set up.
#[derive(Clone, Debug)]
pub struct BackupConfig {
    pub listen: SocketAddr,
    /// Only this address may be the primary (None: any).
    pub allow: Option<IpAddr>,
    /// The pre-shared key the primary must prove it holds.
    pub key: Key,
    pub mem_bytes: u64,
    pub vcpus: u32,
    /// Where to keep the copy of the primary's disk (needed when the
    /// primary's VM has one).
    pub disk: Option<PathBuf>,
    /// The primary is declared gone after this long without a frame.
    pub lease: Duration,
    /// How often the backup sends a heartbeat.
    pub heartbeat: Duration,
    /// A peer's whole handshake must be done within this (not per byte).
    pub handshake: Duration,
    /// Runs COLO's secondary VM for a primary that asks for it
    /// ([`serve_colo`]); a primary that asks without it is refused.
    pub colo: bool,
    /// A test of COLO's divergences: every Nth frame with TCP payload the
    /// secondary sends has its first payload byte flipped (0: never).
    pub colo_test_perturb: u64,
    /// A test of a failed secondary: its Nth checkpoint fails (0: never).
    pub colo_test_fail_at: u64,
    /// A test of a secondary whose guest fails: after its Nth checkpoint
    /// its vCPU 0's next instruction becomes `ud2` (0: never).
    pub colo_test_crash_at: u64,
}

/// Default for [`BackupConfig::handshake`].
pub const HANDSHAKE_TIME: Duration = Duration::from_secs(2);
/// Handshakes in progress at most; a connection beyond is refused at once.
pub const MAX_PENDING: usize = 8;

/// Why the backup stopped receiving.
pub enum BackupEnd {
    /// The primary is gone: take over from this epoch.
    Activate {
        epoch: u64,
        memory: GuestMemory,
        state: Box<VmState>,
        reason: String,
        /// When the failure was detected (for the failover time).
        detected: Instant,
        /// The last frame from the primary before that.
        last_heard: Instant,
        /// A Linux VM: how it was booted (from the primary's hello).
        linux: Option<Box<LinuxRecord>>,
    },
    /// COLO: the primary is gone and the secondary VM, which ran every
    /// input the primary's guest received, takes over as it is (paused,
    /// its output hook removed, its network device on a socket pair: the
    /// caller gives it the TAP and resumes it).
    ActivateSecondary {
        /// The last epoch the secondary became.
        epoch: u64,
        vm: Box<nl_vmm::Vm>,
        reason: String,
        detected: Instant,
        last_heard: Instant,
        stats: crate::secondary::SecondaryStats,
    },
    /// The primary's VM finished: nothing to take over.
    PrimaryFinished { message: String },
    /// The stream was bad (corrupt, reordered): the backup stands down and
    /// keeps its last good epoch, the primary runs unprotected.
    Rejected { reason: String, kept_epoch: Option<u64> },
    /// The primary went away before the first complete epoch, or the
    /// disk copy matches no acknowledged epoch.
    NothingToActivate { reason: String },
}

/// Drains what the peer is still sending, then closes: closing with unread
/// data resets the connection, and the peer would see a broken pipe instead
/// of the reason. Bounded: 64 KiB or 500 ms.
fn drain_and_close(s: &TcpStream) {
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut d = Deadline::new(s, Duration::from_millis(500));
    let mut sink = [0u8; 4096];
    for _ in 0..16 {
        match d.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
}

/// Refuses a peer during the handshake (plain frame).
fn refuse_plain(s: &TcpStream, why: &str) {
    let mut d = Deadline::new(s, Duration::from_millis(500));
    let _ = write_plain_frame(&mut d, Kind::Refuse, &[&why.as_bytes()[..why.len().min(1024)]]);
    drain_and_close(s);
}

/// Refuses the authenticated primary (sealed frame).
fn refuse_sealed(s: &mut TcpStream, seal: &mut Sealer, why: &str) {
    let _ = seal.write_frame(s, Kind::Refuse, 0, 0, &[why.as_bytes()]);
    let _ = s.flush();
    drain_and_close(s);
}

/// Refuses on the accept thread: one small frame into an empty socket
/// buffer (never blocks for long), then close.
fn refuse_now(s: TcpStream, why: &str) {
    let _ = s.set_write_timeout(Some(Duration::from_millis(100)));
    let _ = write_plain_frame(&mut &s, Kind::Refuse, &[why.as_bytes()]);
    let _ = s.shutdown(std::net::Shutdown::Write);
}

/// Checks an authenticated primary's hello against the backup's configuration.
pub fn check_hello(cfg: &BackupConfig, h: &Hello) -> Result<(), String> {
    // The backup may take over only once the primary has fenced itself:
    // its own lease must be at least the primary's.
    let mine = u64::try_from(cfg.lease.as_millis()).unwrap_or(u64::MAX);
    if h.lease_ms == 0 || h.lease_ms > mine {
        return Err(format!(
            "the primary's lease ({} ms) is not at most this backup's ({mine} ms): the backup \
             could take over a primary that still runs; give the backup --lease-ms of at \
             least the primary's",
            h.lease_ms
        ));
    }
    if let Some(l) = &h.linux {
        l.check()?;
    }
    if h.colo && !cfg.colo {
        return Err("the primary runs COLO (--colo): start the backup with --colo, which runs \
                    the secondary VM"
            .into());
    }
    if h.protocol != PROTOCOL_VERSION {
        return Err(format!(
            "protocol version {} does not match the backup's {PROTOCOL_VERSION}",
            h.protocol
        ));
    }
    if h.state_version != STATE_VERSION {
        return Err(format!(
            "VM state version {} does not match the backup's {STATE_VERSION}",
            h.state_version
        ));
    }
    if h.mem_bytes != cfg.mem_bytes || h.vcpus != cfg.vcpus {
        return Err(format!(
            "the primary's VM has {} MiB and {} vCPUs, this backup is set up for {} MiB and {} vCPUs",
            h.mem_bytes >> 20,
            h.vcpus,
            cfg.mem_bytes >> 20,
            cfg.vcpus
        ));
    }
    match (h.disk_bytes, &cfg.disk) {
        (0, None) => {}
        (0, Some(_)) => {
            return Err(
                "this backup keeps a disk copy (--disk) but the primary's VM has no disk".into()
            )
        }
        (n, None) => {
            return Err(format!(
            "the primary's VM has a {} MiB disk: start the backup with --disk FILE for its copy",
            n >> 20
        ))
        }
        (n, Some(_)) if !n.is_multiple_of(SECTOR) => {
            return Err(format!("disk size {n} is not a whole number of sectors"))
        }
        _ => {}
    }
    Ok(())
}

/// What the accept and handshake threads tell the serving thread.
enum Event {
    Log(String),
    /// The primary proved the key and holds the slot.
    Attached(Attached),
}

struct Attached {
    s: TcpStream,
    peer: SocketAddr,
    session: SessionKey,
    disk: Option<BackupDisk>,
    linux: Option<LinuxRecord>,
    /// The primary asked for COLO.
    colo: bool,
}

/// State shared by the accept and handshake threads.
#[derive(Default)]
struct Slot {
    /// An authenticated primary holds the slot.
    taken: AtomicBool,
    /// The backup is done: the accept thread ends.
    stop: AtomicBool,
    /// Handshakes in progress.
    pending: AtomicUsize,
}

/// Counts a handshake in progress while it lives.
struct Pending(Arc<Slot>);

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.pending.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Waits for the configured primary, then receives epochs until the primary
/// is gone, finishes, or sends a bad stream. `log` gets one line per event.
pub fn serve(cfg: &BackupConfig, log: &mut dyn FnMut(String)) -> Result<BackupEnd, String> {
    serve_with(cfg, log, &mut |_: &GuestMemory, _: &VmState, _: Option<&LinuxRecord>| {})
}

/// What [`serve_with`] calls after the full copy: the backup's guest
/// memory, the first epoch's state and, for a Linux VM, its boot record.
pub type FirstCopy<'f> = dyn FnMut(&GuestMemory, &VmState, Option<&LinuxRecord>) + 'f;

/// [`serve`], calling `first_copy` once, on the serving thread, right after
/// the first epoch (the primary's full copy) is acknowledged and applied,
/// with the backup's guest memory, that epoch's state and a Linux VM's boot
/// record (the primary's hello): from then on the
/// VM's shape (memory, vCPUs, workload, timer) is known, and the caller may
/// build the VM over that very memory (a clone of the [`GuestMemory`]
/// shares its memfd and mapping; epochs keep being applied to it) so that a
/// takeover only loads the last state. It should return at once (start a
/// thread): frames wait while it runs.
pub fn serve_with(
    cfg: &BackupConfig,
    log: &mut dyn FnMut(String),
    first_copy: &mut FirstCopy,
) -> Result<BackupEnd, String> {
    serve_colo(cfg, log, first_copy, None)
}

/// Builds COLO's secondary VM (not started) over the memory given, a
/// [`GuestMemory::private_copy`] of the backup's, with a spare network
/// device and no disk, for the epoch state given.
pub type BuildSecondary<'f> = dyn FnMut(GuestMemory, &VmState) -> Result<nl_vmm::Vm, String> + 'f;

/// [`serve_with`], running COLO's secondary VM (built by `secondary`) for
/// a primary that asks for it: from the first epoch on, the secondary
/// becomes each committed epoch, runs the primary's forwarded input, and
/// its output goes to the primary. On the primary's loss it is the
/// secondary that takes over ([`BackupEnd::ActivateSecondary`]).
pub fn serve_colo(
    cfg: &BackupConfig,
    log: &mut dyn FnMut(String),
    first_copy: &mut FirstCopy,
    mut secondary: Option<&mut BuildSecondary<'_>>,
) -> Result<BackupEnd, String> {
    let listener = TcpListener::bind(cfg.listen)
        .map_err(|e| format!("cannot listen on {}: {e}", cfg.listen))?;
    log(format!("backup listening on {}", cfg.listen));
    let slot = Arc::new(Slot::default());
    // Wakes the accept thread's poll when the backup is done, so joining it
    // costs no poll timeout (it was up to 100 ms of every takeover).
    let wake = EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)
        .map_err(|e| format!("cannot create an eventfd: {e}"))?;
    let (tx, events) = mpsc::channel();
    let acceptor = {
        let (cfg, slot) = (cfg.clone(), slot.clone());
        let wake = wake.try_clone().map_err(|e| format!("cannot clone an eventfd: {e}"))?;
        std::thread::Builder::new()
            .name("repl-accept".into())
            .spawn(move || {
                nl_vmm::seccomp::apply(nl_vmm::seccomp::Kind::Replication);
                accept(listener, &cfg, &slot, &tx, &wake)
            })
            .map_err(|e| format!("cannot start the accept thread: {e}"))?
    };
    let end = loop {
        match events.recv() {
            Ok(Event::Log(m)) => log(m),
            Ok(Event::Attached(a)) => {
                log(format!("primary {} authenticated and attached", a.peer));
                let _ = a.s.set_read_timeout(None);
                let _ = a.s.set_write_timeout(None);
                let _ = a.s.set_nodelay(true);
                let linux = a.linux;
                let rx = Receiver::new(cfg.mem_bytes, cfg.vcpus).map(|rx| {
                    let rx = rx.with_linux(linux.is_some());
                    match a.disk {
                        Some(d) => rx.with_disk(d),
                        None => rx,
                    }
                });
                if let Some(l) = &linux {
                    log(format!("the primary's VM is a Linux VM (command line {:?})", l.cmdline));
                }
                let build = if a.colo { secondary.take() } else { None };
                break rx.and_then(|rx| {
                    let mut r = Receiving { events: &events, log, first_copy, build };
                    receive(cfg, a.s, a.session, rx, linux, &mut r)
                });
            }
            Err(_) => break Err("the accept thread ended".into()),
        }
    };
    slot.stop.store(true, Ordering::SeqCst);
    let _ = wake.write(1);
    let _ = acceptor.join();
    end
}

/// The accept thread: hands each connection to a handshake thread of its
/// own, until the backup is done.
fn accept(
    listener: TcpListener,
    cfg: &BackupConfig,
    slot: &Arc<Slot>,
    tx: &mpsc::Sender<Event>,
    wake: &EventFd,
) {
    let say = |m: String| {
        let _ = tx.send(Event::Log(m));
    };
    while !slot.stop.load(Ordering::SeqCst) {
        let mut pfd = [
            libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: wake.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        // SAFETY: `pfd` is an array of two valid pollfds that outlives the
        // call, and both fds stay open during it.
        let n = unsafe { libc::poll(pfd.as_mut_ptr(), 2, 100) };
        if n <= 0 || pfd[0].revents == 0 {
            continue; // Timeout, EINTR or the wake-up: look at `stop` again.
        }
        let (s, peer) = match listener.accept() {
            Ok(c) => c,
            Err(e) => {
                say(format!("accept: {e}"));
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let why = if cfg.allow.is_some_and(|a| a != peer.ip()) {
            Some("not the configured primary")
        } else if slot.taken.load(Ordering::SeqCst) {
            Some("this backup already serves an authenticated primary")
        } else if slot.pending.fetch_add(1, Ordering::SeqCst) >= MAX_PENDING {
            slot.pending.fetch_sub(1, Ordering::SeqCst);
            Some("too many handshakes in progress; try again")
        } else {
            None
        };
        if let Some(why) = why {
            say(format!("refused a connection from {peer}: {why}"));
            refuse_now(s, why);
            continue;
        }
        let pending = Pending(slot.clone());
        let (cfg, slot, tx) = (cfg.clone(), slot.clone(), tx.clone());
        let spawned = std::thread::Builder::new()
            .name("repl-hello".into())
            .stack_size(256 << 10)
            .spawn(move || {
                nl_vmm::seccomp::apply(nl_vmm::seccomp::Kind::Replication);
                handshake(s, peer, &cfg, &slot, &tx, pending)
            });
        if let Err(e) = spawned {
            say(format!("cannot start a handshake thread for {peer}: {e}"));
        }
    }
}

/// One connection's handshake, all of it within `cfg.handshake`.
fn handshake(
    s: TcpStream,
    peer: SocketAddr,
    cfg: &BackupConfig,
    slot: &Slot,
    tx: &mpsc::Sender<Event>,
    _pending: Pending,
) {
    let mut d = Deadline::new(&s, cfg.handshake);
    let r = (|| {
        let p = backup_challenge(&mut d, &cfg.key)?;
        check_hello(cfg, &p.hello)?;
        if slot.taken.compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst).is_err() {
            return Err("this backup already serves an authenticated primary".to_string());
        }
        // The disk copy is (re)created for this primary's full copy.
        let disk = match &cfg.disk {
            Some(path) if p.hello.disk_bytes > 0 => {
                BackupDisk::create(path, p.hello.disk_bytes).map(Some)
            }
            _ => Ok(None),
        };
        let linux = p.hello.linux.as_ref().map(|l| l.record.clone());
        let colo = p.hello.colo;
        let r = disk.and_then(|disk| Ok((p.welcome(&mut d, &cfg.key)?, disk, linux, colo)));
        if r.is_err() {
            slot.taken.store(false, Ordering::SeqCst);
        }
        r
    })();
    match r {
        Ok((session, disk, linux, colo)) => {
            let _ = tx.send(Event::Attached(Attached { s, peer, session, disk, linux, colo }));
        }
        Err(why) => {
            let _ = tx.send(Event::Log(format!("refused the peer at {peer}: {why}")));
            refuse_plain(&s, &why);
        }
    }
}

/// What [`receive`] reports to and calls.
struct Receiving<'r, 'f, 'b> {
    events: &'r mpsc::Receiver<Event>,
    log: &'r mut dyn FnMut(String),
    first_copy: &'r mut FirstCopy<'f>,
    /// COLO: builds the secondary (the primary asked for COLO).
    build: Option<&'r mut BuildSecondary<'b>>,
}

/// What the receive loop takes in: the primary's frames, each with its
/// payload's CRC.
type Got = Result<(Frame, u32), ProtoError>;

fn sealed(seal: &std::sync::Mutex<Sealer>) -> std::sync::MutexGuard<'_, Sealer> {
    seal.lock().unwrap_or_else(|p| p.into_inner())
}

/// Where the secondary's output goes: a thread of its own seals each frame
/// and sends it to the primary under the backup's lock. The secondary's
/// vCPU thread only queues it (and drops it when the queue is full, as a
/// link would): a vCPU blocked on the stream could hold its device, and
/// with it the receive thread that keeps the stream moving.
fn colo_sink(
    s: &TcpStream,
    seal: &Arc<std::sync::Mutex<Sealer>>,
    perturb: u64,
) -> Result<crate::secondary::OutputSink, String> {
    let mut s = s.try_clone().map_err(|e| format!("socket: {e}"))?;
    let seal = seal.clone();
    let (tx, rx) = mpsc::sync_channel::<(u64, Vec<u8>)>(4096);
    std::thread::Builder::new()
        .name("colo-out".into())
        .spawn(move || {
            nl_vmm::seccomp::apply(nl_vmm::seccomp::Kind::Replication);
            while let Ok((g, f)) = rx.recv() {
                // A failed send shows up as a read error too.
                let _ = sealed(&seal).write_frame(&mut s, Kind::ColoOut, g, 0, &[&f]);
            }
        })
        .map_err(|e| format!("cannot start the secondary's output thread: {e}"))?;
    let sent = std::sync::atomic::AtomicU64::new(0);
    Ok(Box::new(move |g, f| {
        let mut f = f.to_vec();
        if let Some(at) = crate::colo::tcp_payload_at(&f).filter(|_| perturb > 0) {
            if (sent.fetch_add(1, Ordering::Relaxed) + 1).is_multiple_of(perturb) {
                f[at] ^= 1;
            }
        }
        let _ = tx.try_send((g, f));
    }))
}

/// COLO's secondary failed (`why`): it is stopped (no more input fed, not
/// built again) and the primary is told, so that it releases output by
/// epochs alone instead of waiting for frames that will never come. Best
/// effort: a failed send shows up as a read error too.
fn colo_down<B>(
    s: &TcpStream,
    seal: &Arc<std::sync::Mutex<Sealer>>,
    why: &str,
    log: &mut dyn FnMut(String),
    feed: &std::sync::Mutex<Option<Arc<crate::secondary::Feed>>>,
    secondary: &mut Option<crate::secondary::Secondary>,
    build: &mut Option<B>,
) {
    log(format!("WARNING: colo: {why}; the secondary is stopped, the primary told"));
    *feed.lock().unwrap_or_else(|p| p.into_inner()) = None;
    *secondary = None;
    *build = None;
    let mut s = s;
    let _ = sealed(seal).write_frame(&mut s, Kind::ColoDown, 0, 0, &[why.as_bytes()]);
}

/// COLO's secondary becomes committed `epoch` (`state`), unless its guest
/// failed. The backup's COLO test flags act here: the Nth checkpoint made
/// to fail, or the guest broken after it.
fn colo_checkpoint(
    sec: &mut crate::secondary::Secondary,
    cfg: &BackupConfig,
    epoch: u64,
    state: &VmState,
    log: &mut dyn FnMut(String),
) -> Result<(), String> {
    let n = sec.stats().checkpoints + 1;
    if n == cfg.colo_test_fail_at {
        return Err(format!("checkpoint {n} made to fail (--test-colo-fail-at)"));
    }
    if let Some(why) = sec.failed() {
        return Err(why);
    }
    sec.checkpoint(epoch, state)?;
    if n == cfg.colo_test_crash_at {
        let broken = sec.break_guest_for_test();
        log(format!("colo: test: the secondary's guest broken after checkpoint {n}: {broken:?}"));
    }
    Ok(())
}

/// Receives the authenticated primary's sealed frames until it is gone,
/// finishes, or sends a bad stream.
fn receive(
    cfg: &BackupConfig,
    mut s: TcpStream,
    session: SessionKey,
    mut rx: Receiver,
    linux: Option<LinuxRecord>,
    r: &mut Receiving<'_, '_, '_>,
) -> Result<BackupEnd, String> {
    let (events, log) = (r.events, &mut *r.log);
    let mut first_copy = Some(&mut *r.first_copy);
    let mut build = r.build.take();
    let mut secondary: Option<crate::secondary::Secondary> = None;
    let reader = s.try_clone().map_err(|e| format!("socket: {e}"))?;
    let mut reader = std::io::BufReader::with_capacity(256 << 10, reader);
    let mut open = session.opener(Dir::ToBackup);
    // Shared with the secondary's output thread, which sends its frames
    // itself: the lock is held across each write, so frames leave in the
    // order of their seals.
    let seal = Arc::new(std::sync::Mutex::new(session.sealer(Dir::ToPrimary)));
    // The secondary's feed once it runs: the receive thread writes the
    // primary's input into it as it reads each frame.
    let feed: Arc<std::sync::Mutex<Option<Arc<crate::secondary::Feed>>>> = Arc::default();
    let (tx, frames) = mpsc::sync_channel::<Got>(64);
    // Spent payload buffers go back to the reader (no fresh allocation, so
    // no page faults, per frame once warm).
    let (spare_tx, spare_rx) = mpsc::channel::<Vec<u8>>();
    let feed_rx = feed.clone();
    // COLO's input never reaches this loop: the receive thread says when it
    // last read a frame (microseconds since `base`), for the lease.
    let base = Instant::now();
    let heard = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let heard_rx = heard.clone();
    let fed = || base + Duration::from_micros(heard.load(Ordering::Relaxed));
    std::thread::Builder::new()
        .name("repl-rx".into())
        .spawn(move || {
            nl_vmm::seccomp::apply(nl_vmm::seccomp::Kind::Replication);
            let mut buf = Vec::new();
            loop {
                if buf.capacity() == 0 {
                    buf = spare_rx.try_recv().unwrap_or_default();
                }
                let r = open.read_frame_into(&mut reader, &mut buf);
                if let Ok((Kind::ColoIn, epoch, _, _)) = r {
                    let us = u64::try_from(base.elapsed().as_micros()).unwrap_or(u64::MAX);
                    heard_rx.store(us, Ordering::Relaxed);
                    // Authenticated input for the secondary: fed at once,
                    // the buffer kept for the next frame.
                    let f = feed_rx.lock().unwrap_or_else(|p| p.into_inner()).clone();
                    if let Some(f) = f {
                        f.input(epoch, &buf);
                    }
                    continue;
                }
                let payload = std::mem::take(&mut buf);
                let r = r.map(|(kind, epoch, seq, crc)| (Frame { kind, epoch, seq, payload }, crc));
                let end = r.is_err();
                if tx.send(r).is_err() || end {
                    break;
                }
            }
        })
        .map_err(|e| format!("cannot start the receive thread: {e}"))?;
    let mut last_heard = Instant::now();
    let mut last_beat = Instant::now();
    // Activation: only from the last acknowledged epoch, and only once the
    // primary's lease has run out (a closed connection alone is not enough).
    let gone = |reason: String,
                rx: Receiver,
                secondary: Option<crate::secondary::Secondary>,
                last_heard: Instant,
                log: &mut dyn FnMut(String)| {
        let left = cfg.lease.saturating_sub(last_heard.elapsed());
        if !left.is_zero() && rx.committed().is_some() {
            log(format!(
                "{reason}: waiting out the primary's lease ({} ms more) before taking over",
                left.as_millis()
            ));
            std::thread::sleep(left);
        }
        let detected = Instant::now();
        if let Some(sec) = secondary {
            let (epoch, stats) = (rx.committed().map_or(0, |(e, _)| e), sec.stats());
            match sec.into_vm() {
                Ok(vm) => {
                    return BackupEnd::ActivateSecondary {
                        epoch,
                        vm: Box::new(vm),
                        reason,
                        detected,
                        last_heard,
                        stats,
                    }
                }
                // Never from the last epoch instead: the primary released
                // replies the secondary sent after it.
                Err(e) => {
                    return BackupEnd::NothingToActivate {
                        reason: format!("{reason}; the secondary cannot take over: {e}"),
                    }
                }
            }
        }
        let broken = rx.disk.as_ref().is_some_and(|d| d.broken);
        match rx.into_committed() {
            Some((epoch, memory, state)) => BackupEnd::Activate {
                epoch,
                memory,
                state: Box::new(state),
                reason,
                detected,
                last_heard,
                linux: linux.clone().map(Box::new),
            },
            None if broken => BackupEnd::NothingToActivate {
                reason: format!(
                    "{reason}; this backup's disk copy matches no acknowledged epoch (a write \
                     to it failed)"
                ),
            },
            None => BackupEnd::NothingToActivate {
                reason: format!("{reason}; it went away before the first complete epoch"),
            },
        }
    };
    loop {
        for e in events.try_iter() {
            if let Event::Log(m) = e {
                log(m);
            }
        }
        // Wake for the next heartbeat or the moment the primary's lease
        // runs out, whichever comes first: waiting a whole heartbeat after
        // any frame let a partitioned primary be declared gone up to one
        // heartbeat (a tenth of the lease, at most 100 ms) after its lease.
        last_heard = last_heard.max(fed());
        let wait = cfg
            .heartbeat
            .saturating_sub(last_beat.elapsed())
            .min(cfg.lease.saturating_sub(last_heard.elapsed()))
            .max(Duration::from_millis(1));
        let got = frames.recv_timeout(wait);
        if last_beat.elapsed() >= cfg.heartbeat {
            // Best effort: a failed heartbeat shows up as a read error too.
            let _ = sealed(&seal).write_frame(&mut s, Kind::Heartbeat, 0, 0, &[]);
            last_beat = Instant::now();
            // As often, whether the secondary's guest failed.
            if let Some(why) = secondary.as_ref().and_then(|sec| sec.failed()) {
                colo_down(&s, &seal, &why, log, &feed, &mut secondary, &mut build);
            }
        }
        match got {
            Err(mpsc::RecvTimeoutError::Timeout) => {
                last_heard = last_heard.max(fed());
                if last_heard.elapsed() > cfg.lease {
                    let why = format!(
                        "no frame from the primary for {} ms (lease {} ms)",
                        last_heard.elapsed().as_millis(),
                        cfg.lease.as_millis()
                    );
                    // Stop acknowledging before anything else: the primary
                    // can release no more output. If the primary can still
                    // hear us, it learns that we take over and fences itself.
                    let _ = sealed(&seal).write_frame(&mut s, Kind::Takeover, 0, 0, &[]);
                    let _ = s.shutdown(std::net::Shutdown::Both);
                    return Ok(gone(why, rx, secondary, last_heard, log));
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let _ = s.shutdown(std::net::Shutdown::Both);
                return Ok(gone("receive thread ended".into(), rx, secondary, last_heard, log));
            }
            Ok(Err(e @ (ProtoError::Closed | ProtoError::Truncated | ProtoError::Io(_)))) => {
                rx.discard_staging();
                let _ = s.shutdown(std::net::Shutdown::Both);
                let why = format!("primary connection lost: {e}");
                return Ok(gone(why, rx, secondary, last_heard, log));
            }
            Ok(Err(ProtoError::Timeout)) => {}
            Ok(Err(e)) => {
                // Corrupt, forged, replayed or reordered: the stream is not
                // the primary's any more. Stand down (never activate).
                let kept = rx.committed().map(|(e, _)| e);
                let reason = format!("rejected epoch {}: {e}", rx.expected_epoch());
                refuse_sealed(&mut s, &mut sealed(&seal), &reason);
                let _ = s.shutdown(std::net::Shutdown::Both);
                return Ok(BackupEnd::Rejected { reason, kept_epoch: kept });
            }
            Ok(Ok((f, payload_crc))) => {
                last_heard = Instant::now();
                match f.kind {
                    Kind::Heartbeat => {}
                    // Fed by the receive thread before the secondary ran.
                    Kind::ColoIn => {}
                    Kind::Done => {
                        let _ = s.shutdown(std::net::Shutdown::Both);
                        return Ok(BackupEnd::PrimaryFinished {
                            message: String::from_utf8_lossy(&f.payload).into_owned(),
                        });
                    }
                    _ => match rx.on_frame_ack(f, payload_crc, &mut |epoch| {
                        sealed(&seal).write_frame(&mut s, Kind::Ack, epoch, 0, &[])
                    }) {
                        Ok(done) => {
                            for b in rx.take_spare() {
                                let _ = spare_tx.send(b);
                            }
                            // The state is decoded only for whoever needs it:
                            // the first copy's callback, or COLO's secondary.
                            let wanted = first_copy.is_some() || build.is_some();
                            if let Some(epoch) = done.filter(|_| wanted) {
                                let state = rx.committed().map(|(_, b)| VmState::from_bytes(b));
                                let state = match state {
                                    Some(Ok(state)) => Some(state),
                                    _ => {
                                        log(format!("epoch {epoch}'s state does not decode"));
                                        None
                                    }
                                };
                                if let (Some(f), Some(st)) = (first_copy.take(), &state) {
                                    f(rx.memory(), st, linux.as_ref());
                                }
                                if let (Some(b), Some(st)) = (build.as_mut(), &state) {
                                    let r = match secondary.as_mut() {
                                        Some(sec) => colo_checkpoint(sec, cfg, epoch, st, log),
                                        None => colo_sink(&s, &seal, cfg.colo_test_perturb)
                                            .and_then(|sink| {
                                                colo_start(&rx, &mut **b, epoch, st, sink)
                                            })
                                            .map(|sec| {
                                                log(format!("colo: the secondary VM runs from epoch {epoch}"));
                                                *feed.lock().unwrap_or_else(|p| p.into_inner()) = Some(sec.feed());
                                                secondary = Some(sec);
                                            }),
                                    };
                                    if let Err(e) = r {
                                        colo_down(
                                            &s,
                                            &seal,
                                            &e,
                                            log,
                                            &feed,
                                            &mut secondary,
                                            &mut build,
                                        );
                                    }
                                }
                            }
                        }
                        Err(e @ (ProtoError::Closed | ProtoError::Io(_) | ProtoError::Timeout)) => {
                            // The ack could not be sent: the connection is
                            // lost, and that epoch was not acknowledged.
                            let _ = s.shutdown(std::net::Shutdown::Both);
                            let why = format!("cannot acknowledge: {e}");
                            return Ok(gone(why, rx, secondary, last_heard, log));
                        }
                        Err(e) => {
                            let kept = rx.committed().map(|(e, _)| e);
                            let reason = format!("rejected epoch {}: {e}", rx.expected_epoch());
                            refuse_sealed(&mut s, &mut sealed(&seal), &reason);
                            let _ = s.shutdown(std::net::Shutdown::Both);
                            return Ok(BackupEnd::Rejected { reason, kept_epoch: kept });
                        }
                    },
                }
            }
        }
    }
}

/// Builds and starts COLO's secondary over a private copy of the backup's
/// memory, from committed epoch `epoch`.
fn colo_start(
    rx: &Receiver,
    build: &mut BuildSecondary,
    epoch: u64,
    state: &VmState,
    sink: crate::secondary::OutputSink,
) -> Result<crate::secondary::Secondary, String> {
    let mem = rx.memory().private_copy().map_err(|e| e.to_string())?;
    let vm = build(mem, state)?;
    crate::secondary::Secondary::start(vm, epoch, state, sink)
}

#[cfg(test)]
mod tests {
    use super::*;
    use nl_vmm::state::{IrqchipState, VcpuState};

    pub(super) const MEM: u64 = 64 << 20;

    fn state() -> Vec<u8> {
        VmState {
            version: STATE_VERSION,
            mem_bytes: MEM,
            num_vcpus: 1,
            timer_hz: 100,
            workload: Default::default(),
            vcpus: vec![VcpuState {
                regs: Default::default(),
                sregs: Default::default(),
                xsave: Default::default(),
                xcrs: Default::default(),
                msrs: Vec::new(),
                lapic: Default::default(),
                mp_state: Default::default(),
                events: Default::default(),
            }],
            irqchip: IrqchipState { chips: Vec::new(), clock: None, pit: None },
            io_devices: Vec::new(),
            mmio_devices: Vec::new(),
        }
        .to_bytes()
    }

    /// The frames of one epoch writing `byte` into page `gpa`.
    pub(super) fn epoch(e: u64, gpa: u64, byte: u8) -> Vec<Frame> {
        epoch_with(e, gpa, byte, state())
    }

    /// [`state`] of a Linux VM: it has an i8042 on its port bus.
    fn linux_state() -> Vec<u8> {
        let mut v: serde_json::Value = serde_json::from_slice(&state()).unwrap();
        v["io_devices"] = serde_json::json!([{"name": "i8042", "base": 0x60, "state": {}}]);
        serde_json::to_vec(&v).unwrap()
    }

    /// [`epoch`] closed by `state`.
    fn epoch_with(e: u64, gpa: u64, byte: u8, state: Vec<u8>) -> Vec<Frame> {
        let mut payload = run_header(gpa, 1).to_vec();
        payload.extend([byte; PAGE]);
        let end = EpochEnd {
            frames: 1,
            pages: 1,
            data_crc: crc32fast::hash(&payload),
            state: Vec::new(),
        };
        let mut endp = end.encode_head().to_vec();
        endp.extend(state);
        vec![
            Frame { kind: Kind::Pages, epoch: e, seq: 0, payload },
            Frame { kind: Kind::EpochEnd, epoch: e, seq: 0, payload: endp },
        ]
    }

    fn page(rx: &Receiver, gpa: u64) -> u8 {
        rx.memory().mem().read_obj::<u8>(GuestAddress(gpa)).unwrap()
    }

    #[test]
    fn bad_epochs_are_rejected_and_the_last_good_one_kept() {
        let mut rx = Receiver::new(MEM, 1).unwrap();
        for (i, f) in epoch(0, 0x1000, 1).iter().enumerate() {
            assert_eq!(rx.on_frame(f.clone()).unwrap(), (i == 1).then_some(0));
        }
        for (i, f) in epoch(1, 0x1000, 2).iter().enumerate() {
            assert_eq!(rx.on_frame(f.clone()).unwrap(), (i == 1).then_some(1));
        }
        assert_eq!(page(&rx, 0x1000), 2);
        // Each bad input is refused for its own reason, by name.
        let err = |rx: &mut Receiver, f: &Frame| rx.on_frame(f.clone()).unwrap_err().to_string();
        // Truncated: the end arrives without its pages.
        let e2 = epoch(2, 0x1000, 3);
        assert_eq!(
            err(&mut rx, &e2[1]),
            "bad frame: epoch 2 is incomplete: 0 frames / 0 pages received, 1 / 1 sent"
        );
        // Corrupted page data (frame checksums pass, the epoch's does not).
        let mut bad = epoch(2, 0x1000, 3);
        bad[0].payload[100] ^= 1;
        assert_eq!(rx.on_frame(bad[0].clone()).unwrap(), None);
        assert_eq!(err(&mut rx, &bad[1]), "bad frame: epoch 2: page data checksum mismatch");
        // Reordered / replayed: an old epoch, a frame out of sequence.
        assert_eq!(
            err(&mut rx, &epoch(1, 0x1000, 9)[0]),
            "bad frame: Pages frame for epoch 1 while receiving epoch 2 (reordered or replayed)"
        );
        let mut skip = epoch(2, 0x1000, 3);
        skip[0].seq = 1;
        assert_eq!(
            err(&mut rx, &skip[0]),
            "bad frame: frame 1 of epoch 2 arrived where frame 0 was due (reordered)"
        );
        // Outside RAM.
        assert_eq!(
            err(&mut rx, &epoch(2, MEM, 3)[0]),
            format!("bad frame: page run {MEM:#x}+0x1000 is outside guest RAM")
        );
        // An end that counts one page more than was sent (frames agree).
        let mut short = epoch(2, 0x1000, 3);
        let mut end = EpochEnd::decode(&short[1].payload).unwrap();
        end.pages = 2;
        let mut endp = end.encode_head().to_vec();
        endp.extend(end.state);
        short[1].payload = endp;
        assert_eq!(rx.on_frame(short[0].clone()).unwrap(), None);
        assert_eq!(
            err(&mut rx, &short[1]),
            "bad frame: epoch 2 is incomplete: 1 frames / 1 pages received, 1 / 2 sent"
        );
        // Through all of it the last good epoch stayed, untouched.
        assert_eq!(rx.committed().unwrap().0, 1);
        assert_eq!(page(&rx, 0x1000), 2);
        // And a good epoch 2 still applies.
        for f in epoch(2, 0x2000, 7) {
            rx.on_frame(f).unwrap();
        }
        assert_eq!((rx.committed().unwrap().0, page(&rx, 0x2000)), (2, 7));
    }

    /// An epoch may carry up to twice the guest memory (pages sent again
    /// within it), and not a byte more.
    #[test]
    fn an_epoch_carries_at_most_twice_the_guest_memory() {
        let mut rx = Receiver::new(MEM, 1).unwrap();
        // 16 MiB runs at gpa 0: seven fit in 2 * 64 MiB, the eighth's
        // run headers take the epoch over.
        let pages = 4096u32;
        let mut payload = run_header(0, pages).to_vec();
        payload.extend(vec![1u8; pages as usize * PAGE]);
        for seq in 0..7 {
            let f = Frame { kind: Kind::Pages, epoch: 0, seq, payload: payload.clone() };
            assert_eq!(rx.on_frame(f).unwrap(), None, "frame {seq}");
        }
        let f = Frame { kind: Kind::Pages, epoch: 0, seq: 7, payload };
        assert_eq!(
            rx.on_frame(f).unwrap_err().to_string(),
            "bad frame: epoch 0 carries more data than twice the guest memory and disk"
        );
        assert!(rx.committed().is_none());
    }

    /// An epoch writing `byte` into page `gpa` and `sectors` of the disk.
    fn disk_epoch(e: u64, gpa: u64, byte: u8, sector: u64, sectors: u32) -> Vec<Frame> {
        let mut f = epoch(e, gpa, byte);
        let mut disk = disk_run_header(sector, sectors * 512, 0).to_vec();
        disk.extend(vec![byte; sectors as usize * 512]);
        disk.extend(disk_run_header(0, 0, DISK_FLUSH));
        let mut end = EpochEnd::decode(&f[1].payload).unwrap();
        let mut crc = crc32fast::Hasher::new();
        crc.update(&f[0].payload);
        crc.update(&disk);
        end.frames = 2;
        end.data_crc = crc.finalize();
        let mut endp = end.encode_head().to_vec();
        endp.extend(end.state);
        f[1] = Frame { kind: Kind::Disk, epoch: e, seq: 1, payload: disk };
        f.push(Frame { kind: Kind::EpochEnd, epoch: e, seq: 0, payload: endp });
        f
    }

    #[test]
    fn disk_writes_apply_with_their_epoch_and_bad_ones_are_rejected() {
        let path = std::env::temp_dir().join(format!("nl-backup-disk-{}", std::process::id()));
        let disk = BackupDisk::create(&path, 8 * 512).unwrap();
        let mut rx = Receiver::new(MEM, 1).unwrap().with_disk(disk);
        let sector = |n: u64| {
            let mut b = [0u8; 1];
            std::fs::File::open(&path).unwrap().read_exact_at(&mut b, n * 512).unwrap();
            b[0]
        };
        for f in disk_epoch(0, 0x1000, 4, 2, 2) {
            rx.on_frame(f).unwrap();
        }
        assert_eq!((sector(1), sector(2), sector(3), sector(4)), (0, 4, 4, 0));
        // Staged but never completed: the copy is untouched.
        let e1 = disk_epoch(1, 0x1000, 5, 3, 1);
        rx.on_frame(e1[0].clone()).unwrap();
        rx.on_frame(e1[1].clone()).unwrap();
        rx.discard_staging();
        assert_eq!(sector(3), 4);
        // Outside the disk: rejected at its frame.
        let bad = disk_epoch(1, 0x1000, 5, 7, 2);
        rx.on_frame(bad[0].clone()).unwrap();
        assert!(rx.on_frame(bad[1].clone()).unwrap_err().to_string().contains("outside"));
        // A corrupted disk payload fails the epoch's checksum; nothing written.
        let mut bad = disk_epoch(1, 0x1000, 5, 3, 1);
        bad[1].payload[20] ^= 1;
        for f in &bad[..2] {
            rx.on_frame(f.clone()).unwrap();
        }
        assert!(rx.on_frame(bad[2].clone()).is_err());
        assert_eq!((sector(3), rx.committed().unwrap().0), (4, 0));
        for f in disk_epoch(1, 0x1000, 5, 3, 1) {
            rx.on_frame(f).unwrap();
        }
        assert_eq!((sector(2), sector(3), rx.committed().unwrap().0), (4, 5, 1));
        // A VM without a disk gets no disk writes.
        let mut plain = Receiver::new(MEM, 1).unwrap();
        let f = disk_epoch(0, 0x1000, 4, 2, 2);
        plain.on_frame(f[0].clone()).unwrap();
        assert!(plain.on_frame(f[1].clone()).unwrap_err().to_string().contains("without a disk"));
        let _ = std::fs::remove_file(&path);
    }

    fn config() -> BackupConfig {
        BackupConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            allow: None,
            key: Key::from_bytes(&[3; 32]).unwrap(),
            mem_bytes: MEM,
            vcpus: 1,
            disk: None,
            lease: Duration::from_secs(1),
            heartbeat: Duration::from_millis(100),
            handshake: HANDSHAKE_TIME,
            colo: false,
            colo_test_perturb: 0,
            colo_test_fail_at: 0,
            colo_test_crash_at: 0,
        }
    }

    /// A hello this test backup accepts (a reference-guest VM).
    fn good_hello() -> Hello {
        Hello {
            protocol: PROTOCOL_VERSION,
            state_version: STATE_VERSION,
            mem_bytes: MEM,
            vcpus: 1,
            disk_bytes: 0,
            lease_ms: 1000,
            linux: None,
            colo: false,
        }
    }

    #[test]
    fn hellos_are_checked() {
        let cfg = config();
        let good = good_hello();
        assert!(check_hello(&cfg, &good).is_ok());
        let e = check_hello(&cfg, &Hello { mem_bytes: 2 * MEM, ..good.clone() });
        assert!(e.unwrap_err().contains("set up for 64 MiB"));
        let e = check_hello(&cfg, &Hello { state_version: 99, ..good.clone() });
        assert!(e.unwrap_err().contains("state version 99"));
        let e = check_hello(&cfg, &Hello { disk_bytes: 1 << 20, ..good.clone() });
        assert!(e.unwrap_err().contains("--disk FILE"));
        // A primary that fences later than this backup would take over.
        let e = check_hello(&cfg, &Hello { lease_ms: 1001, ..good.clone() });
        assert!(e.unwrap_err().contains("lease (1001 ms)"));
        assert!(check_hello(&cfg, &Hello { lease_ms: 0, ..good.clone() }).is_err());
        assert!(check_hello(&cfg, &Hello { lease_ms: 400, ..good.clone() }).is_ok());
        let with_disk = BackupConfig { disk: Some("/nonexistent".into()), ..cfg.clone() };
        assert!(check_hello(&with_disk, &good).unwrap_err().contains("no disk"));
    }

    fn linux_record() -> LinuxRecord {
        LinuxRecord {
            kernel: Some("/boot/vmlinuz-6.1.0-56-amd64".into()),
            cmdline: "console=ttyS0 reboot=k panic=-1 nokaslr".into(),
            initrd: None,
            system_map: None,
            time_limit_ms: Some(60_000),
            started_unix_ms: Some(1),
        }
    }

    /// A Linux VM's boot record in the hello is versioned and validated:
    /// each bad field is refused by name, never a panic.
    #[test]
    fn a_linux_record_in_the_hello_is_versioned_and_validated() {
        let cfg = config();
        let good = Hello { linux: Some(LinuxHello::of(&linux_record())), ..good_hello() };
        assert!(check_hello(&cfg, &good).is_ok());
        let check = |f: &dyn Fn(&mut LinuxHello)| {
            let mut h = good.clone();
            f(h.linux.as_mut().unwrap());
            check_hello(&cfg, &h)
        };
        // The longest command line a VM boots with: the user's 2048 bytes
        // and the parameters the VMM adds on PVM.
        let longest = 2048 + 1 + "noxsave clearcpuid=smap,smep,popcnt,cx16".len();
        assert!(check(&|l| l.record.cmdline = "x".repeat(longest)).is_ok());
        let bad = |f: &dyn Fn(&mut LinuxHello)| check(f).unwrap_err();
        let e = bad(&|l| l.version = 2);
        assert!(e.contains("Linux record has version 2"), "{e}");
        let e = bad(&|l| l.record.cmdline = "x".repeat(longest + 1));
        assert!(e.contains(&format!("command line has {} bytes", longest + 1)), "{e}");
        let e = bad(&|l| l.record.cmdline = "console=ttyS0\u{1b}[2J".into());
        assert!(e.contains("not printable ASCII"), "{e}");
        let e = bad(&|l| l.record.kernel = Some("vmlinuz".into()));
        assert!(e.contains("kernel file name"), "{e}");
        let e = bad(&|l| l.record.initrd = Some(format!("/{}", "i".repeat(2000)).into()));
        assert!(e.contains("initrd file name") && e.contains("2001 bytes"), "{e}");
        let e = bad(&|l| l.record.system_map = Some("/boot/System\n.map".into()));
        assert!(e.contains("system_map file name"), "{e}");
        let e = bad(&|l| l.record.time_limit_ms = Some(0));
        assert!(e.contains("time limit is 0 ms"), "{e}");
        // A reference-guest VM's hello has no record, as before.
        assert!(check_hello(&cfg, &Hello { linux: None, ..good.clone() }).is_ok());
    }

    /// The hello says whether the VM is a Linux VM, and every epoch's state
    /// must agree: a Linux VM's state (its i8042) from a primary whose hello
    /// carried no record, or the other way round, rejects the epoch before
    /// it is acknowledged (the backup would otherwise build the wrong VM).
    #[test]
    fn an_epoch_of_another_vm_kind_than_the_hello_announced_is_rejected() {
        let run = |rx: &mut Receiver, frames: Vec<Frame>| {
            frames.into_iter().try_fold(None, |_, f| rx.on_frame(f))
        };
        let mut rx = Receiver::new(MEM, 1).unwrap();
        let e = run(&mut rx, epoch_with(0, 0x1000, 1, linux_state())).unwrap_err().to_string();
        assert!(e.contains("carried no Linux record"), "{e}");
        assert!(rx.committed().is_none());
        let mut rx = Receiver::new(MEM, 1).unwrap().with_linux(true);
        let e = run(&mut rx, epoch(0, 0x1000, 1)).unwrap_err().to_string();
        assert!(e.contains("announced a Linux VM") && e.contains("no i8042"), "{e}");
        assert!(rx.committed().is_none());
        assert_eq!(run(&mut rx, epoch_with(0, 0x1000, 2, linux_state())).unwrap(), Some(0));
        assert_eq!(page(&rx, 0x1000), 2);
    }

    /// An epoch whose ack could not be sent is not committed (the backup
    /// never activates from an epoch it did not acknowledge), and its disk
    /// writes, already in the copy, are taken back out of it.
    #[test]
    fn an_epoch_not_acknowledged_is_not_committed_and_its_disk_writes_are_undone() {
        let mut rx = Receiver::new(MEM, 1).unwrap();
        for f in epoch(0, 0x1000, 1) {
            rx.on_frame(f).unwrap();
        }
        let e1 = epoch(1, 0x1000, 2);
        rx.on_frame(e1[0].clone()).unwrap();
        let mut fail = |_| Err(ProtoError::Closed);
        assert!(rx.on_frame_ack(e1[1].clone(), 0, &mut fail).is_err());
        assert_eq!((rx.committed().unwrap().0, page(&rx, 0x1000)), (0, 1));
        let (epoch, _, _) = rx.into_committed().unwrap();
        assert_eq!(epoch, 0);

        let path = std::env::temp_dir().join(format!("nl-backup-noack-{}", std::process::id()));
        let disk = BackupDisk::create(&path, 8 * 512).unwrap();
        let mut rx = Receiver::new(MEM, 1).unwrap().with_disk(disk);
        for f in disk_epoch(0, 0x1000, 4, 2, 2) {
            rx.on_frame(f).unwrap();
        }
        let e1 = disk_epoch(1, 0x1000, 5, 3, 1);
        rx.on_frame(e1[0].clone()).unwrap();
        rx.on_frame(e1[1].clone()).unwrap();
        let crc = crc32fast::hash(&e1[2].payload);
        assert!(rx.on_frame_ack(e1[2].clone(), crc, &mut fail).is_err());
        // Epoch 1's write to sector 3 was taken back out of the copy: it
        // holds epoch 0's writes only, and the backup can still take over
        // from epoch 0 (a primary that dies as the ack is sent).
        let copy = std::fs::read(&path).unwrap();
        assert!(copy[2 * 512..4 * 512].iter().all(|&b| b == 4), "epoch 1's disk write stayed");
        assert!(copy[..2 * 512].iter().chain(&copy[4 * 512..]).all(|&b| b == 0));
        let (epoch, _, _) = rx.into_committed().expect("the acknowledged epoch 0 is still usable");
        assert_eq!(epoch, 0);
        let _ = std::fs::remove_file(&path);
    }
}

/// The backup's server end to end on loopback: handshakes, the slot, sealed
/// frames and the activation rule (no KVM needed: activation hands over the
/// memory and state, it does not run them).
#[cfg(test)]
mod serve_tests {
    use super::tests::{epoch, MEM};
    use super::*;
    use crate::auth::{nonce, primary_handshake, NONCE};
    use std::thread::JoinHandle;

    const WAIT: Duration = Duration::from_secs(20);

    struct Running {
        addr: SocketAddr,
        end: JoinHandle<Result<BackupEnd, String>>,
        logs: mpsc::Receiver<String>,
    }

    fn key() -> Key {
        Key::from_bytes(&[5; 32]).unwrap()
    }

    /// Starts `serve` on a free loopback port; returns once it listens.
    fn start(lease_ms: u64, handshake: Duration) -> Running {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let cfg = BackupConfig {
            listen: addr,
            allow: None,
            key: key(),
            mem_bytes: MEM,
            vcpus: 1,
            disk: None,
            lease: Duration::from_millis(lease_ms),
            heartbeat: Duration::from_millis(20),
            handshake,
            colo: false,
            colo_test_perturb: 0,
            colo_test_fail_at: 0,
            colo_test_crash_at: 0,
        };
        let (tx, logs) = mpsc::channel();
        let end = std::thread::spawn(move || {
            serve(&cfg, &mut |m| {
                let _ = tx.send(m);
            })
        });
        let first = logs.recv_timeout(WAIT).expect("the backup starts");
        assert!(first.contains("listening"), "{first}");
        Running { addr, end, logs }
    }

    impl Running {
        fn finish(self) -> BackupEnd {
            let t = Instant::now();
            while !self.end.is_finished() {
                assert!(t.elapsed() < WAIT, "the backup did not end");
                std::thread::sleep(Duration::from_millis(10));
            }
            self.end.join().unwrap().unwrap()
        }

        fn logs(&self) -> String {
            self.logs.try_iter().collect::<Vec<_>>().join("\n")
        }
    }

    fn hello() -> Hello {
        Hello {
            protocol: PROTOCOL_VERSION,
            state_version: STATE_VERSION,
            mem_bytes: MEM,
            vcpus: 1,
            disk_bytes: 0,
            lease_ms: 100, // at most every test backup's lease
            linux: None,
            colo: false,
        }
    }

    /// A primary of the test's own, authenticated with `key`.
    struct Primary {
        s: TcpStream,
        seal: Sealer,
        open: Opener,
    }

    impl Primary {
        fn attach(addr: SocketAddr, key: &Key, within: Duration) -> Result<Primary, String> {
            let s = TcpStream::connect(addr).map_err(|e| e.to_string())?;
            let session = primary_handshake(&mut Deadline::new(&s, within), key, &hello())?;
            s.set_read_timeout(Some(WAIT)).unwrap();
            let (seal, open) = (session.sealer(Dir::ToBackup), session.opener(Dir::ToPrimary));
            Ok(Primary { s, seal, open })
        }

        /// The sealed bytes of frame `f` (the next counter).
        fn seal(&mut self, f: &Frame) -> Vec<u8> {
            let mut b = Vec::new();
            self.seal.write_frame(&mut b, f.kind, f.epoch, f.seq, &[&f.payload]).unwrap();
            b
        }

        fn send(&mut self, f: &Frame) {
            let b = self.seal(f);
            self.s.write_all(&b).unwrap();
        }

        /// The next frame from the backup that is not a heartbeat.
        fn next(&mut self) -> Result<Frame, ProtoError> {
            for _ in 0..10_000 {
                let f = self.open.read_frame(&mut self.s)?;
                if f.kind != Kind::Heartbeat {
                    return Ok(f);
                }
            }
            panic!("only heartbeats")
        }

        fn epoch(&mut self, e: u64) {
            for f in epoch(e, 0x1000, e as u8 + 1) {
                self.send(&f);
            }
            let a = self.next().unwrap();
            assert_eq!((a.kind, a.epoch), (Kind::Ack, e));
        }
    }

    /// (a) A peer without the key, sending a hello, a made-up proof, a
    /// whole epoch 0 and closing, never gets the slot, and nothing it sent
    /// is ever activated; nor does one that skips the proof. The backup
    /// keeps waiting, and the real primary is served afterwards.
    #[test]
    fn forged_peers_never_lead_to_activation_and_the_real_primary_is_served() {
        let b = start(200, HANDSHAKE_TIME);
        let wrong = Key::from_bytes(&[6; 32]).unwrap();
        for skip_proof in [false, true] {
            let mut s = TcpStream::connect(b.addr).unwrap();
            s.set_read_timeout(Some(WAIT)).unwrap();
            let np = nonce().unwrap();
            let body = [&np[..], &serde_json::to_vec(&hello()).unwrap()].concat();
            write_plain_frame(&mut s, Kind::Hello, &[&body]).unwrap();
            let c = read_plain_frame(&mut s).unwrap();
            assert_eq!(c.kind, Kind::Challenge);
            let nb: [u8; NONCE] = c.payload.try_into().unwrap();
            // All of it at once, without waiting for the verdict.
            let mut attack = Vec::new();
            if !skip_proof {
                write_plain_frame(&mut attack, Kind::Auth, &[&[0u8; 32]]).unwrap();
            }
            let mut seal = wrong.session(&np, &nb).sealer(Dir::ToBackup);
            for f in epoch(0, 0x1000, 0xcc) {
                seal.write_frame(&mut attack, f.kind, f.epoch, f.seq, &[&f.payload]).unwrap();
            }
            let _ = s.write_all(&attack);
            let r = read_plain_frame(&mut s).unwrap();
            assert_eq!(r.kind, Kind::Refuse);
            let why = String::from_utf8_lossy(&r.payload).into_owned();
            let want = if skip_proof { "no proof of the key" } else { "authentication failed" };
            assert!(why.contains(want), "{why}");
            drop(s);
        }
        // Well past the lease: still waiting, nothing activated.
        std::thread::sleep(Duration::from_millis(600));
        assert!(!b.end.is_finished(), "the backup ended after forged peers: {}", b.logs());
        let mut p = Primary::attach(b.addr, &key(), WAIT).unwrap();
        p.epoch(0);
        p.send(&Frame { kind: Kind::Done, epoch: 1, seq: 0, payload: b"done".to_vec() });
        let logs = b.logs();
        assert!(logs.contains("authentication failed"), "{logs}");
        assert!(matches!(b.finish(), BackupEnd::PrimaryFinished { .. }));
    }

    /// (b) and (e): the backup activates from the last epoch it
    /// acknowledged (not the one cut off before its end), and only once the
    /// primary's lease has run out, even though the connection closed at once.
    #[test]
    fn activation_is_from_the_acknowledged_epoch_once_the_lease_ran_out() {
        let lease = Duration::from_millis(700);
        let b = start(lease.as_millis() as u64, HANDSHAKE_TIME);
        let mut p = Primary::attach(b.addr, &key(), WAIT).unwrap();
        p.epoch(0);
        p.epoch(1);
        // Epoch 2: its pages, but never its end; then the primary dies.
        p.send(&epoch(2, 0x1000, 9)[0]);
        drop(p);
        match b.finish() {
            BackupEnd::Activate { epoch, memory, detected, last_heard, .. } => {
                assert_eq!(epoch, 1);
                let byte = memory.mem().read_obj::<u8>(GuestAddress(0x1000)).unwrap();
                assert_eq!(byte, 2, "epoch 1's page, not the unfinished epoch 2's");
                assert!(
                    detected.duration_since(last_heard) >= lease,
                    "activated {:?} after the last frame, before the lease of {lease:?} ran out",
                    detected.duration_since(last_heard)
                );
            }
            _ => panic!("expected an activation from epoch 1"),
        }
    }

    /// (c) and (b): a frame of the authenticated primary's stream that was
    /// modified, replayed, reordered or spliced in from another session is
    /// refused, the connection dropped, and the backup stands down: it
    /// never activates from that stream (kept: the last acknowledged epoch).
    #[test]
    fn modified_replayed_reordered_or_spliced_frames_reject_the_stream() {
        type Tamper = fn(&mut Primary, Vec<Vec<u8>>, &[Vec<u8>]) -> Vec<Vec<u8>>;
        let cases: [(&str, Tamper); 4] = [
            ("modified", |_, mut f, _| {
                // A page byte changed and the CRC made to match: only the tag
                // tells.
                let n = f[0].len();
                f[0][n / 2] ^= 1;
                let mut crc = crc32fast::Hasher::new();
                crc.update(&f[0][..24]);
                crc.update(&f[0][HEADER_BYTES..n - TAG_BYTES]);
                f[0][24..28].copy_from_slice(&crc.finalize().to_le_bytes());
                f
            }),
            ("replayed", |_, f, old| vec![old[0].clone(), f[0].clone(), f[1].clone()]),
            ("reordered", |_, f, _| vec![f[1].clone(), f[0].clone()]),
            ("spliced", |_, f, _| {
                let mut other = SessionKey([1; 32]).sealer(Dir::ToBackup);
                let mut b = Vec::new();
                let e = epoch(1, 0x1000, 7);
                other.write_frame(&mut b, e[0].kind, 1, 0, &[&e[0].payload]).unwrap();
                vec![b, f[1].clone()]
            }),
        ];
        for (what, tamper) in cases {
            let b = start(300, HANDSHAKE_TIME);
            let mut p = Primary::attach(b.addr, &key(), WAIT).unwrap();
            // Epoch 0, its sealed bytes kept for the replay.
            let old: Vec<Vec<u8>> = epoch(0, 0x1000, 1).iter().map(|f| p.seal(f)).collect();
            for f in &old {
                p.s.write_all(f).unwrap();
            }
            let a = p.next().unwrap();
            assert_eq!((a.kind, a.epoch), (Kind::Ack, 0));
            let e1: Vec<Vec<u8>> = epoch(1, 0x1000, 2).iter().map(|f| p.seal(f)).collect();
            for f in tamper(&mut p, e1, &old) {
                let _ = p.s.write_all(&f);
            }
            let r = p.next().unwrap();
            assert_eq!(r.kind, Kind::Refuse, "{what}");
            let why = String::from_utf8_lossy(&r.payload).into_owned();
            assert!(why.contains("failed authentication"), "{what}: {why}");
            match b.finish() {
                BackupEnd::Rejected { reason, kept_epoch } => {
                    assert_eq!(kept_epoch, Some(0), "{what}: {reason}")
                }
                _ => panic!("{what}: the backup did not stand down"),
            }
        }
    }

    /// (d) Slow clients (a byte every 0.3 s) do not delay the real primary:
    /// each handshake runs on its own thread. The handshake deadline here
    /// is 60 s, so a backup that served hellos one at a time would keep the
    /// primary waiting far longer than the 5 s it is given. Once the primary
    /// holds the slot, another peer with the key is refused.
    #[test]
    fn slow_clients_do_not_delay_the_primary() {
        let b = start(2000, Duration::from_secs(60));
        let stop = Arc::new(AtomicBool::new(false));
        let slow: Vec<_> = (0..3)
            .map(|_| {
                let mut s = TcpStream::connect(b.addr).unwrap();
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut h = Vec::new();
                    write_plain_frame(&mut h, Kind::Hello, &[&[0u8; 100]]).unwrap();
                    for byte in h {
                        if stop.load(Ordering::SeqCst) || s.write_all(&[byte]).is_err() {
                            break;
                        }
                        std::thread::sleep(Duration::from_millis(300));
                    }
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(500));
        let p = Primary::attach(b.addr, &key(), Duration::from_secs(5));
        let mut p = p.expect("the primary was not served while slow clients dribbled");
        let e = Primary::attach(b.addr, &key(), WAIT).err().unwrap();
        assert!(e.contains("already serves an authenticated primary"), "{e}");
        p.epoch(0);
        p.send(&Frame { kind: Kind::Done, epoch: 1, seq: 0, payload: Vec::new() });
        assert!(matches!(b.finish(), BackupEnd::PrimaryFinished { .. }));
        stop.store(true, Ordering::SeqCst);
        for t in slow {
            t.join().unwrap();
        }
    }

    /// The handshake's time is for all of it, not per byte: a client that
    /// keeps sending a byte every 0.2 s is cut off once the 1 s is up, long
    /// before its 40 bytes are out.
    #[test]
    fn a_slow_hello_is_cut_off_at_its_deadline() {
        let b = start(2000, Duration::from_secs(1));
        let mut s = TcpStream::connect(b.addr).unwrap();
        let mut r = s.try_clone().unwrap();
        let writer = std::thread::spawn(move || {
            let mut h = Vec::new();
            write_plain_frame(&mut h, Kind::Hello, &[&[0u8; 100]]).unwrap();
            let mut sent = 0;
            for byte in &h[..40] {
                if s.write_all(&[*byte]).is_err() {
                    break;
                }
                sent += 1;
                std::thread::sleep(Duration::from_millis(200));
            }
            sent
        });
        r.set_read_timeout(Some(WAIT)).unwrap();
        let f = read_plain_frame(&mut r).expect("refused");
        let why = String::from_utf8_lossy(&f.payload).into_owned();
        assert_eq!(f.kind, Kind::Refuse);
        assert!(why.contains("no valid hello"), "{why}");
        assert!(writer.join().unwrap() < 40, "the slow hello was never cut off");
        assert!(!b.end.is_finished());
    }

    /// At most MAX_PENDING handshakes at once; the next peer is told why.
    #[test]
    fn handshakes_in_progress_are_bounded() {
        let b = start(2000, Duration::from_secs(30));
        let idle: Vec<_> = (0..MAX_PENDING).map(|_| TcpStream::connect(b.addr).unwrap()).collect();
        // The accept thread takes connections in order: by the next one,
        // all of these count as handshakes in progress.
        let mut s = TcpStream::connect(b.addr).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        let f = read_plain_frame(&mut s).expect("refused");
        assert_eq!(f.kind, Kind::Refuse);
        assert!(String::from_utf8_lossy(&f.payload).contains("too many handshakes"));
        drop(idle);
        // The slots free up: the primary is served.
        let mut p = None;
        for _ in 0..50 {
            match Primary::attach(b.addr, &key(), WAIT) {
                Ok(x) => {
                    p = Some(x);
                    break;
                }
                Err(e) => assert!(e.contains("too many handshakes"), "{e}"),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let mut p = p.expect("served once the idle peers left");
        p.send(&Frame { kind: Kind::Done, epoch: 0, seq: 0, payload: Vec::new() });
        assert!(matches!(b.finish(), BackupEnd::PrimaryFinished { .. }));
    }
}
