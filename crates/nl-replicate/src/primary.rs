//! The primary: runs the VM in epochs and ships each epoch to the backup;
//! the guest's network output of an epoch leaves only after the backup
//! acknowledged that epoch (output commit).
//!
//! Pipelined mode (Remus): during the pause only what must be consistent is
//! collected (the dirty log, a copy of the dirty pages into a staging buffer,
//! coalesced into contiguous runs, the vCPU and device state, and the
//! network frames the epoch produced); the VM resumes at once, and a sender
//! thread ships epoch k and waits for its ack while epoch k+1 runs. The
//! sender releases epoch k's frames only after that ack. At most
//! `pipeline` epochs are in flight: when the backup falls behind, the next
//! epoch boundary waits.

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use std::os::fd::AsRawFd;

use nl_devices::virtio::held_writes::DiskWrite;
use nl_vmm::{Vm, VmOutcome};
use serde::Serialize;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use crate::auth::{primary_handshake, Deadline, Key};
pub use crate::compare::AutoStats;
use crate::compare::Compare;
pub use crate::predict::GateStats;
use crate::predict::{Histase, Predictor};
use crate::protocol::*;
use crate::ram::{runs, RamView};

/// The optimizations, each switchable. [`Options::recommended`] (also
/// `Default`) is the combination `ninelives bench replicate` measured best
/// on this host; every front end (the CLI's `replicate primary`, a backup's
/// re-protection after a takeover, the lab's benches) starts from it, so
/// there is one place for the defaults. [`Options::none`] turns everything
/// off.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Options {
    /// Manual dirty-log protection: KVM_GET_DIRTY_LOG only reports and
    /// KVM_CLEAR_DIRTY_LOG re-protects exactly the pages dirtied in the epoch.
    pub selective: bool,
    /// Send coalesced runs straight from guest memory while the vCPUs are
    /// paused (no copy); otherwise copy each dirty page into a buffer during
    /// the pause and send page by page after resuming. Not with `predict`
    /// (refused): prediction compares the staging copy.
    pub direct: bool,
    /// Epochs shipped by a sender thread while the VM runs on: at most this
    /// many epochs sent but not yet acknowledged (0: the epoch loop sends
    /// and waits for each ack itself). Implies the copy into a staging
    /// buffer (not `direct`).
    pub pipeline: u32,
    /// Output-triggered epochs: when the guest has sent frames (held for
    /// output commit), end the epoch early instead of at the timer (off:
    /// epochs always last their full length). Cuts the time a reply waits
    /// for its epoch to end. The epoch loop learns that output waits from
    /// the network device's eventfd, not by polling.
    pub output_epochs: bool,
    /// The minimum spacing of output-triggered epochs, in milliseconds
    /// since the last boundary, applied only after an epoch whose guest
    /// dirtied pages faster than [`Options::output_spacing_rate`] (0:
    /// never; an epoch ends as soon as output waits).
    pub output_epoch_ms: u64,
    /// Output-triggered epochs after an epoch that dirtied at most this many
    /// pages per millisecond of its length (or of the spacing, if longer:
    /// a short epoch still collects the pages each request touches) end as
    /// soon as output waits,
    /// without the spacing (0: every output-triggered epoch is spaced, the
    /// old rule). A rate, not a count: a spaced epoch lasts longer and
    /// collects more pages, so a count would keep the spacing on.
    pub output_spacing_rate: u64,
    /// Write-fault prediction (needs `selective`): pages the guest really
    /// changed in an epoch are not re-protected, so they take no write fault
    /// in the next epoch; at each boundary they are copied as dirty and
    /// compared with what the backup has, and those whose content did not
    /// change are dropped as fake dirty and re-protected (at the next
    /// boundary, with the VM paused, after they were copied once more).
    pub predict: bool,
    /// Copy the epoch's pages into the staging buffer on one thread during
    /// the pause, instead of spread over the host's cores (the vCPUs are
    /// stopped, so the cores are free).
    pub serial_copy: bool,
    /// Histase as in the paper, per write fault: writes are tracked with
    /// userfaultfd write-protection instead of KVM's dirty log; only the
    /// pages made writable in an epoch are protected again at its end
    /// (selective re-protection), and a write fault also makes the pages up
    /// to his_stride ahead and his_stride/3 behind in its 2 MiB table
    /// writable, treated as dirty and dropped at the boundary if unchanged.
    pub histase: bool,
    /// The fault-free compare capture: no write tracking at all; at each
    /// boundary every allocated page is compared with a shadow of what the
    /// backup has, on the host's cores while the vCPUs are stopped, and the
    /// pages that differ are shipped (`compare.rs`). Replaces `selective`,
    /// `predict` and `histase`.
    #[serde(default)]
    pub compare: bool,
    /// Chooses, epoch by epoch, between the dirty log (with `selective` and
    /// `predict`) and the compare capture, by the guest time each loses
    /// with this host's unit costs (`compare::Auto`). Needs `selective`.
    #[serde(default)]
    pub auto_capture: bool,
    /// COLO (QEMU's coarse-grained lock-stepping): the backup runs a
    /// secondary VM on the primary's input, and a frame leaves as soon as
    /// the secondary sent the same ([`crate::colo`]); an epoch is taken only
    /// when the two differ, when a frame waited [`Options::colo_timeout_ms`],
    /// or when the epoch timer runs out. Synchronous epochs only; not for a
    /// VM with a disk or a Linux VM.
    #[serde(default)]
    pub colo: bool,
    /// COLO: the longest a frame waits for the secondary's before an epoch
    /// is taken (which releases it).
    #[serde(default)]
    pub colo_timeout_ms: u64,
    /// COLO: an epoch at least this often (in place of the epoch length),
    /// to bound what an epoch carries and how far the secondary's private
    /// copy drifts from the backup's memory.
    #[serde(default)]
    pub colo_period_ms: u64,
}

impl Options {
    /// [`Options::colo_timeout_ms`] unless set.
    pub const COLO_TIMEOUT_MS: u64 = 10;
    /// [`Options::colo_period_ms`] unless set: kv at 8 connections ran
    /// 4.1 to 4.2k ops/s with an epoch every 20 ms, 4.8 to 5.0k every 100 ms
    /// and 5.2 to 5.3k every 500 ms, in one stage of the data path
    /// (docs/performance.md, "COLO for kv: built and measured").
    pub const COLO_PERIOD_MS: u64 = 1000;

    /// The defaults: selective re-protection and write-fault prediction
    /// (which turns itself off while its guesses are wrong), epochs shipped
    /// by the epoch loop itself (no pipeline: at 20 ms epochs the pipelined
    /// rows of `bench replicate` were slower on every memwrite row),
    /// output-triggered epochs (at once, or 2 ms after the last boundary
    /// when the guest writes fast), and the one-thread copy. See
    /// docs/replication.md for the measurements.
    pub const fn recommended() -> Self {
        Options {
            selective: true,
            direct: false,
            pipeline: 0,
            output_epochs: true,
            output_epoch_ms: Self::RECOMMENDED_OUTPUT_EPOCH_MS,
            output_spacing_rate: Self::RECOMMENDED_OUTPUT_SPACING_RATE,
            predict: true,
            serial_copy: true,
            histase: false,
            compare: false,
            auto_capture: true,
            colo: false,
            colo_timeout_ms: Self::COLO_TIMEOUT_MS,
            colo_period_ms: Self::COLO_PERIOD_MS,
        }
    }

    /// The minimum spacing of output-triggered epochs in
    /// [`Options::recommended`].
    pub const RECOMMENDED_OUTPUT_EPOCH_MS: u64 = 2;

    /// The dirty rate (pages per millisecond) above which output-triggered
    /// epochs are spaced, in [`Options::recommended`]: 128, i.e. 256 pages
    /// in a 2 ms epoch. Each page shipped costs a copy (0.5 µs) and,
    /// re-protected, a write fault in the next epoch (6-9 µs on this host):
    /// at this rate tracking costs the guest about as much time as it runs,
    /// and epochs with output get the 2 ms spacing. kv dirtied 1 to 5 pages
    /// per millisecond in `bench replicate`.
    pub const RECOMMENDED_OUTPUT_SPACING_RATE: u64 = 128;

    /// Every optimization off: full re-protection at every boundary, no
    /// prediction, synchronous epochs of full length.
    pub const fn none() -> Self {
        Options {
            selective: false,
            direct: false,
            pipeline: 0,
            output_epochs: false,
            output_epoch_ms: 0,
            output_spacing_rate: 0,
            predict: false,
            serial_copy: true,
            histase: false,
            compare: false,
            auto_capture: false,
            colo: false,
            colo_timeout_ms: Self::COLO_TIMEOUT_MS,
            colo_period_ms: Self::COLO_PERIOD_MS,
        }
    }
}

impl Default for Options {
    fn default() -> Self {
        Self::recommended()
    }
}

#[derive(Clone, Debug)]
pub struct PrimaryConfig {
    pub backup: SocketAddr,
    pub epoch: Duration,
    /// Without any frame from the backup for this long the primary fences
    /// itself (the backup may have taken over).
    pub lease: Duration,
    /// The pre-shared key both ends prove they hold.
    pub key: Key,
    pub opts: Options,
    /// Stop the VM after this long whatever it does.
    pub time_limit: Duration,
    /// After the backup is gone, keep trying to attach a new one there.
    pub reattach: bool,
    /// Test hook (kill campaigns): the first epoch shipped this long after
    /// the start is cut off half-way through its bytes by a SIGKILL of this
    /// process, i.e. the primary dies mid-send.
    pub die_mid_send_after: Option<Duration>,
}

/// What a replicated run measured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PrimaryReport {
    pub epoch_ms: f64,
    pub options: Options,
    pub epochs: u64,
    pub full_copy_pages: u64,
    pub full_copy_ms: f64,
    /// Pages shipped per epoch (guest-dirtied plus VMM-written).
    pub pages_per_epoch: f64,
    /// Write faults per epoch: the pages KVM logged, each re-protected at the
    /// previous epoch boundary, so each took one write fault.
    pub write_faults_per_epoch: f64,
    pub vmm_written_pages: u64,
    /// VM paused per epoch, and its parts.
    pub pause_ms_avg: f64,
    pub pause_ms_max: f64,
    pub collect_ms_avg: f64,
    pub copy_ms_avg: f64,
    pub send_in_pause_ms_avg: f64,
    /// Saving vCPU, irqchip and device state during the pause.
    pub state_ms_avg: f64,
    /// Sending after the resume (copy mode) and waiting for the ack.
    pub send_after_ms_avg: f64,
    pub ack_wait_ms_avg: f64,
    /// Pipelined: how long epoch boundaries waited for a free pipeline slot
    /// (the backup behind), on average per epoch.
    pub stall_ms_avg: f64,
    /// Time from an epoch's boundary to its acknowledgement (how long its
    /// output was held at least), average and max.
    pub commit_ms_avg: f64,
    pub commit_ms_max: f64,
    /// Output commit of network frames, the phases of a reply: epochs that
    /// held frames, and those ended early because frames waited
    /// (output-triggered); per epoch with frames, from its oldest held
    /// frame to the epoch's boundary (the trigger's wait), and to the
    /// frames' release (the whole hold: wait, pause, send, ack); and from a
    /// release to the next frame held after it (the client's and the
    /// guest's turnaround, which replication does not add to).
    pub output_epochs: u64,
    pub output_triggered_epochs: u64,
    /// Of those, the epochs whose end waited for the minimum spacing
    /// ([`Options::output_epoch_ms`], while the guest wrote fast) while output
    /// was held.
    pub output_spaced_epochs: u64,
    pub output_wait_ms_avg: f64,
    /// Of the wait: from the oldest held frame to when the epoch loop saw
    /// it (its wake-up), averaged over the epochs it saw waiting.
    pub output_wake_ms_avg: f64,
    /// Stopping the vCPUs at a boundary (before the pause's parts above),
    /// over all epochs and over the epochs with output (part of their wait).
    pub stop_ms_avg: f64,
    pub output_stop_ms_avg: f64,
    pub output_held_ms_avg: f64,
    pub output_held_ms_max: f64,
    pub turnaround_ms_avg: f64,
    /// Average time between epoch boundaries (longer than the epoch when
    /// the backup is behind).
    pub interval_ms_avg: f64,
    pub bytes_sent: u64,
    pub frames_released: u64,
    /// Disk writes (and flushes) the guest made, held and released after
    /// their epoch's ack; bytes of disk the full copy sent.
    pub disk_writes_released: u64,
    pub disk_bytes_written: u64,
    pub disk_full_copy_bytes: u64,
    /// Write-fault prediction: pages left writable (predicted) per epoch,
    /// the share of them really written (precision), the share of the
    /// really written pages that were predicted (recall), and fake-dirty
    /// pages dropped per epoch.
    pub predicted_per_epoch: f64,
    pub precision: Option<f64>,
    pub recall: Option<f64>,
    pub fake_dirty_per_epoch: f64,
    /// Write-fault prediction over the dirty log: epochs it predicted and
    /// epochs it was off, times it turned itself off (its precision
    /// collapsed), probed again, and stayed on after a probe.
    pub prediction_gate: Option<GateStats>,
    /// The compare capture (`Options::compare`): pages compared per epoch
    /// and the scan's wall time per epoch (ms, in the pause).
    pub compared_per_epoch: Option<f64>,
    pub compare_ms_avg: Option<f64>,
    /// `--auto-capture`: epochs on each capture and switches.
    pub auto_capture: Option<AutoStats>,
    /// `--colo`: frames released by the comparison and by epochs, and why
    /// epochs were taken.
    pub colo: Option<crate::colo::ColoStats>,
    /// Set when the backup was lost: why, and whether the primary went on
    /// unprotected or fenced itself.
    pub backup_lost: Option<String>,
    pub unprotected: bool,
    pub fenced: bool,
    pub reattached: u32,
    pub outcome: Option<VmOutcome>,
}

/// How the backup was lost.
enum Lost {
    /// The backup's host said so (connection refused, reset or closed, or
    /// an explicit refusal): the backup is not running; safe to continue.
    Definitive(String),
    /// Silence: it may be a partition and the backup may take over.
    Silent(String),
}

struct Conn {
    s: TcpStream,
    /// Seals the frames to the backup (the session's counter for them).
    seal: Sealer,
    frames: mpsc::Receiver<Result<Frame, ProtoError>>,
    /// Signalled after each frame the reader thread passes on (COLO waits
    /// for the secondary's output on it).
    arrived: EventFd,
    last_heard: Instant,
    /// COLO: why the backup's secondary stopped, once it said so
    /// ([`Kind::ColoDown`]), until the primary acts on it.
    colo_down: Option<String>,
}

fn connect(cfg: &PrimaryConfig, vm: &Vm) -> Result<Conn, String> {
    let s = TcpStream::connect_timeout(&cfg.backup, cfg.lease)
        .map_err(|e| format!("cannot reach the backup at {}: {e}", cfg.backup))?;
    let _ = s.set_nodelay(true);
    let hello = Hello {
        protocol: PROTOCOL_VERSION,
        state_version: nl_vmm::state::STATE_VERSION,
        mem_bytes: vm.memory().size(),
        vcpus: vm.config().vcpus,
        disk_bytes: vm.disk_sectors().unwrap_or(0) * SECTOR,
        lease_ms: u64::try_from(cfg.lease.as_millis()).unwrap_or(u64::MAX),
        linux: vm.linux_record().map(LinuxHello::of),
        colo: cfg.opts.colo,
    };
    // The whole handshake within two leases (a slow peer cannot hold the
    // primary longer, e.g. when it attaches a backup again mid-run).
    let session = primary_handshake(&mut Deadline::new(&s, 2 * cfg.lease), &cfg.key, &hello)?;
    s.set_read_timeout(None).map_err(|e| e.to_string())?;
    // A send into a silent link must not block past the lease.
    s.set_write_timeout(Some(cfg.lease)).map_err(|e| e.to_string())?;
    Conn::new(s, &session)
}

impl Conn {
    /// Wraps an authenticated stream; a thread reads the backup's frames.
    fn new(s: TcpStream, session: &SessionKey) -> Result<Conn, String> {
        let mut reader = s.try_clone().map_err(|e| e.to_string())?;
        let mut open = session.opener(Dir::ToPrimary);
        // Unbounded: this thread must always read the stream (COLO's
        // output arrives while the epoch loop sends an epoch, and a backup
        // blocked on a full stream would stop reading ours).
        let (tx, frames) = mpsc::channel();
        let arrived = EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)
            .map_err(|e| format!("cannot create an eventfd: {e}"))?;
        let poke = arrived.try_clone().map_err(|e| format!("cannot clone an eventfd: {e}"))?;
        std::thread::Builder::new()
            .name("repl-acks".into())
            .spawn(move || {
                nl_vmm::seccomp::apply(nl_vmm::seccomp::Kind::Replication);
                loop {
                    let r = open.read_frame(&mut reader);
                    let end = r.is_err();
                    if tx.send(r).is_err() || end {
                        break;
                    }
                    let _ = poke.write(1);
                }
            })
            .map_err(|e| format!("cannot start the ack thread: {e}"))?;
        Ok(Conn {
            s,
            seal: session.sealer(Dir::ToBackup),
            frames,
            arrived,
            last_heard: Instant::now(),
            colo_down: None,
        })
    }
}

/// Disk writes to send with an epoch, in order.
type DiskSource<'d> = &'d mut dyn Iterator<Item = Result<DiskWrite, String>>;

/// Sends one epoch: `Pages` frames for `runs` (data from `data(gpa, len)`),
/// `Disk` frames for `disk`, then the `EpochEnd` with `state`. Returns
/// bytes sent. Writes go through a buffer (no small segment per run
/// header); each byte is hashed once.
fn send_epoch<'a>(
    s: &mut impl Write,
    seal: &mut Sealer,
    epoch: u64,
    runs: &[(u64, u32)],
    mut data: impl FnMut(u64, usize) -> Result<&'a [u8], String>,
    disk: DiskSource,
    state: &[u8],
) -> Result<u64, String> {
    let mut s = std::io::BufWriter::with_capacity(256 << 10, s);
    let mut crc = crc32fast::Hasher::new();
    let (mut seq, mut pages, mut bytes) = (0u32, 0u64, 0u64);
    let mut i = 0;
    while i < runs.len() {
        // One frame: runs until PAGES_PER_FRAME pages.
        let mut heads = Vec::new();
        let mut n = 0usize;
        let start = i;
        while i < runs.len() && (n == 0 || n + runs[i].1 as usize <= PAGES_PER_FRAME) {
            heads.push(run_header(runs[i].0, runs[i].1));
            n += runs[i].1 as usize;
            i += 1;
        }
        let mut parts: Vec<&[u8]> = Vec::with_capacity(2 * heads.len());
        for (k, r) in runs[start..i].iter().enumerate() {
            parts.push(&heads[k]);
            parts.push(data(r.0, r.1 as usize * PAGE)?);
        }
        bytes += epoch_frame(&mut s, seal, Kind::Pages, epoch, seq, &parts, &mut crc)?;
        seq += 1;
        pages += n as u64;
    }
    // The disk writes, in guest order, a few MiB per frame.
    let mut batch: Vec<DiskWrite> = Vec::new();
    let mut batch_bytes = 0usize;
    let mut disk = disk.peekable();
    while let Some(w) = disk.next() {
        let w = w?;
        batch_bytes += w.data.len();
        batch.push(w);
        if batch_bytes < DISK_FRAME_BYTES && disk.peek().is_some() {
            continue;
        }
        let heads: Vec<_> = batch
            .iter()
            .map(|w| {
                let flags = if w.is_flush() { DISK_FLUSH } else { 0 };
                disk_run_header(w.sector, w.data.len() as u32, flags)
            })
            .collect();
        let mut parts: Vec<&[u8]> = Vec::with_capacity(2 * batch.len());
        for (h, w) in heads.iter().zip(&batch) {
            parts.push(h);
            parts.push(&w.data);
        }
        bytes += epoch_frame(&mut s, seal, Kind::Disk, epoch, seq, &parts, &mut crc)?;
        seq += 1;
        batch.clear();
        batch_bytes = 0;
    }
    let end = EpochEnd { frames: seq, pages, data_crc: crc.finalize(), state: Vec::new() };
    seal.write_frame(&mut s, Kind::EpochEnd, epoch, 0, &[&end.encode_head(), state])
        .map_err(|e| e.to_string())?;
    s.flush().map_err(|e| e.to_string())?;
    Ok(bytes + state.len() as u64)
}

/// Writes one data frame of an epoch from `parts`, adding its payload to the
/// epoch's CRC. Returns the payload bytes.
fn epoch_frame(
    s: &mut impl Write,
    seal: &mut Sealer,
    kind: Kind,
    epoch: u64,
    seq: u32,
    parts: &[&[u8]],
    crc: &mut crc32fast::Hasher,
) -> Result<u64, String> {
    let mut pc = crc32fast::Hasher::new();
    for p in parts {
        pc.update(p);
    }
    crc.combine(&pc);
    seal.write_frame_crc(s, kind, epoch, seq, parts, &pc).map_err(|e| e.to_string())?;
    Ok(parts.iter().map(|p| p.len() as u64).sum())
}

/// Waits for the backup's ack of `epoch`.
fn wait_ack(c: &mut Conn, epoch: u64, lease: Duration) -> Result<(), Lost> {
    loop {
        let left = lease.saturating_sub(c.last_heard.elapsed());
        if left.is_zero() {
            return Err(Lost::Silent(format!(
                "no acknowledgement or heartbeat from the backup for {} ms",
                c.last_heard.elapsed().as_millis()
            )));
        }
        match c.frames.recv_timeout(left) {
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(Lost::Definitive("the ack thread ended".into()))
            }
            Ok(r) => match heard(c, r)? {
                Some(f) if f.kind == Kind::Ack && f.epoch == epoch => return Ok(()),
                // An older epoch's ack, or the secondary's output from before
                // this epoch (stale).
                Some(_) | None => {}
            },
        }
    }
}

/// A frame from the backup's stream, or why the backup is lost: `None` for
/// what needs nothing more (a heartbeat, an older ack, a read timeout).
fn heard(c: &mut Conn, r: Result<Frame, ProtoError>) -> Result<Option<Frame>, Lost> {
    match r {
        Ok(f) => {
            c.last_heard = Instant::now();
            match f.kind {
                Kind::Ack | Kind::ColoOut => Ok(Some(f)),
                Kind::Heartbeat => Ok(None),
                Kind::ColoDown => {
                    let why = String::from_utf8_lossy(&f.payload);
                    c.colo_down = Some(why.chars().take(500).collect());
                    Ok(None)
                }
                Kind::Takeover => {
                    Err(Lost::Silent("the backup announced that it takes over".into()))
                }
                Kind::Refuse => Err(Lost::Definitive(format!(
                    "the backup refused the stream: {}",
                    String::from_utf8_lossy(&f.payload)
                ))),
                k => Err(Lost::Definitive(format!("unexpected {k:?} from the backup"))),
            }
        }
        Err(ProtoError::Timeout) => Ok(None),
        Err(e @ ProtoError::Auth { .. }) => {
            // Not the backup's frame (forged, replayed or modified on the
            // way): the backup itself may be alive and may take over, so
            // this is no proof that it is gone.
            Err(Lost::Silent(format!("a frame from the backup: {e}")))
        }
        Err(e @ (ProtoError::Bad(_) | ProtoError::Version { .. })) => {
            Err(Lost::Definitive(format!("bad frame from the backup: {e}")))
        }
        Err(e) => Err(Lost::Definitive(format!("backup connection: {e}"))),
    }
}

/// The pages KVM's dirty log reports (the VM paused), re-protected
/// selectively when asked.
fn kvm_log(vm: &Vm, clear: bool) -> Result<Vec<u64>, String> {
    let bitmaps = vm.dirty_bitmaps().map_err(|e| e.to_string())?;
    if clear {
        vm.clear_dirty_bitmaps(&bitmaps).map_err(|e| e.to_string())?;
    }
    let mut pages = Vec::new();
    for (r, bitmap) in vm.memory().regions().iter().zip(&bitmaps) {
        for (w, word) in bitmap.iter().enumerate() {
            let mut bits = *word;
            while bits != 0 {
                let b = bits.trailing_zeros() as u64;
                pages.push(r.gpa + (w as u64 * 64 + b) * PAGE as u64);
                bits &= bits - 1;
            }
        }
    }
    Ok(pages)
}

/// Pages to ship at an epoch boundary: the `logged` pages plus the pages
/// the VMM's devices wrote. Returns them and how many the VMM added.
fn with_vmm_writes(vm: &Vm, view: &RamView, logged: &[u64]) -> (Vec<u64>, u64) {
    let mut pages = logged.to_vec();
    let mut vmm = 0u64;
    for (gpa, len) in vm.take_vmm_writes() {
        let first = gpa & !(PAGE as u64 - 1);
        let mut p = first;
        while p < gpa.saturating_add(len) {
            if view.contains(p) {
                pages.push(p);
                vmm += 1;
            }
            p += PAGE as u64;
        }
    }
    pages.sort_unstable();
    pages.dedup();
    (pages, vmm)
}

/// The disk image's data as writes of at most 1 MiB, holes and all-zero
/// chunks left out (the backup's copy starts empty): the disk part of the
/// full copy.
struct DiskImageChunks<'v> {
    vm: &'v Vm,
    /// Sector ranges `[start, end)` still to read.
    ranges: std::vec::IntoIter<(u64, u64)>,
    at: Option<(u64, u64)>,
    sent: u64,
}

impl<'v> DiskImageChunks<'v> {
    const CHUNK_SECTORS: u64 = (1 << 20) / SECTOR;

    fn new(vm: &'v Vm) -> Result<Self, String> {
        let ranges = match vm.disk_sectors() {
            None => Vec::new(),
            Some(sectors) => vm
                .disk_data_ranges()
                .map_err(|e| e.to_string())?
                .into_iter()
                .map(|(s, e)| (s / SECTOR, e.div_ceil(SECTOR).min(sectors)))
                .filter(|(s, e)| s < e)
                .collect(),
        };
        Ok(DiskImageChunks { vm, ranges: ranges.into_iter(), at: None, sent: 0 })
    }
}

impl Iterator for DiskImageChunks<'_> {
    type Item = Result<DiskWrite, String>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let (sector, end) = match self.at {
                Some(r) if r.0 < r.1 => r,
                _ => {
                    self.at = Some(self.ranges.next()?);
                    continue;
                }
            };
            let n = Self::CHUNK_SECTORS.min(end - sector);
            self.at = Some((sector + n, end));
            let mut buf = vec![0u8; (n * SECTOR) as usize];
            if let Err(e) = self.vm.read_disk(sector, &mut buf) {
                return Some(Err(format!("full copy of the disk at sector {sector}: {e}")));
            }
            if buf.iter().any(|&b| b != 0) {
                self.sent += buf.len() as u64;
                return Some(Ok(DiskWrite { seq: 0, sector, data: Arc::from(buf) }));
            }
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// One epoch collected during the pause: its pages as coalesced runs with
/// their data copied into `buf` (in run order), the VM state, and the
/// network frames the guest sent during the epoch (held until the ack).
struct Staged {
    epoch: u64,
    runs: Vec<(u64, u32)>,
    buf: Vec<u8>,
    state: Vec<u8>,
    out: Vec<Vec<u8>>,
    /// The guest's disk writes of the epoch (held until the ack).
    disk: Vec<DiskWrite>,
    /// When the VM was paused for this epoch's boundary.
    boundary: Instant,
    /// When the oldest of `out` was held.
    held_since: Option<Instant>,
}

/// Copies the runs' pages into `buf`, one copy per run; `buf` keeps its
/// capacity from epoch to epoch (no host page faults once it has grown).
#[cfg(test)]
fn stage_copy(view: &RamView, runs: &[(u64, u32)], buf: &mut Vec<u8>) -> Result<(), String> {
    stage_copy_on(view, runs, buf, 1)
}

/// Below this many pages an epoch's copy stays on one thread (starting a
/// thread costs more than it saves).
const PARALLEL_COPY_MIN_PAGES: usize = 512;

/// [`stage_copy`] spread over up to `threads` threads (the vCPUs are
/// paused, so the host's cores are free): the pages are cut into parts of
/// about equal size (a run may be split), each thread copying its part into
/// its own slice of `buf`. The result is the same as on one thread.
fn stage_copy_on(
    view: &RamView,
    runs: &[(u64, u32)],
    buf: &mut Vec<u8>,
    threads: usize,
) -> Result<(), String> {
    let pages: usize = runs.iter().map(|r| r.1 as usize).sum();
    let total = pages * PAGE;
    // Bytes already there are overwritten; only growth is zero-filled.
    if buf.len() < total {
        buf.resize(total, 0);
    } else {
        buf.truncate(total);
    }
    let threads = if pages < PARALLEL_COPY_MIN_PAGES { 1 } else { threads.clamp(1, 16) };
    // Each part: its (gpa, pages) pieces, in buffer order.
    let per = pages.div_ceil(threads).max(1);
    let mut parts: Vec<Vec<(u64, usize)>> = vec![Vec::new()];
    let mut in_part = 0usize;
    for &(mut g, n) in runs {
        let mut n = n as usize;
        while n > 0 {
            if in_part == per {
                parts.push(Vec::new());
                in_part = 0;
            }
            let take = n.min(per - in_part);
            parts.last_mut().expect("one part at least").push((g, take));
            in_part += take;
            g += (take * PAGE) as u64;
            n -= take;
        }
    }
    let copy = |pieces: &[(u64, usize)], out: &mut [u8]| -> Result<(), String> {
        let mut at = 0;
        for &(g, n) in pieces {
            out[at..at + n * PAGE].copy_from_slice(view.slice(g, n * PAGE)?);
            at += n * PAGE;
        }
        Ok(())
    };
    if parts.len() == 1 {
        return copy(&parts[0], buf);
    }
    let mut rest: &mut [u8] = buf;
    let mut jobs = Vec::new();
    for p in &parts {
        let len: usize = p.iter().map(|x| x.1 * PAGE).sum();
        let (mine, tail) = std::mem::take(&mut rest).split_at_mut(len);
        jobs.push((p.as_slice(), mine));
        rest = tail;
    }
    std::thread::scope(|sc| {
        let handles: Vec<_> = jobs
            .into_iter()
            .map(|(p, out)| {
                sc.spawn(move || {
                    // Filters are per thread: a copy thread gets the
                    // replication threads' own (its parent may have none).
                    nl_vmm::seccomp::apply(nl_vmm::seccomp::Kind::Replication);
                    copy(p, out)
                })
            })
            .collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().unwrap_or_else(|_| Err("a copy thread panicked".into())))
    })
}

/// Threads an epoch's copy may use: the host's cores, at most 8.
fn copy_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get()).min(8)
}

/// Sends a staged epoch from its buffer. Returns bytes sent.
fn send_staged(s: &mut impl Write, seal: &mut Sealer, st: &Staged) -> Result<u64, String> {
    let buf = &st.buf;
    let mut at = 0usize;
    send_epoch(
        s,
        seal,
        st.epoch,
        &st.runs,
        |_, l| {
            let d = buf.get(at..at + l).ok_or("staging buffer shorter than its runs")?;
            at += l;
            Ok(d)
        },
        &mut st.disk.iter().cloned().map(Ok),
        &st.state,
    )
}

/// Refines a loss with what the connection still shows: a takeover notice
/// waiting behind the error, or more than a lease of silence, mean the
/// backup may be active, so the primary must not go on unprotected.
fn classify(c: &Conn, l: Lost, lease: Duration) -> Lost {
    let silent_too_long = c.last_heard.elapsed() > lease;
    let took_over =
        c.frames.try_iter().any(|f| matches!(f, Ok(Frame { kind: Kind::Takeover, .. })));
    match l {
        Lost::Definitive(why) if took_over => {
            Lost::Silent(format!("{why}; the backup announced that it takes over"))
        }
        Lost::Definitive(why) if silent_too_long => {
            Lost::Silent(format!("{why}, after more than a lease of silence"))
        }
        l => l,
    }
}

/// What shipping one epoch took.
struct Shipped {
    epoch: u64,
    send: Duration,
    ack_wait: Duration,
    bytes: u64,
    released: u64,
    disk_released: u64,
    disk_bytes: u64,
    /// From the epoch's boundary to its ack.
    commit: Duration,
    /// From the epoch's oldest held frame to its release (`None`: no frames).
    held: Option<Duration>,
    released_at: Instant,
}

/// Hands an acknowledged epoch's held output on: frames to the network,
/// disk writes to the image.
type Release<'r> = &'r (dyn Fn(&[Vec<u8>], &[DiskWrite]) + Sync);

/// Output commit of an acknowledged epoch: its disk writes to the image, its
/// frames to the network.
fn release_output(vm: &Vm, frames: &[Vec<u8>], disk: &[DiskWrite]) {
    vm.release_disk_writes(disk);
    vm.serve_disk_if_unblocked();
    vm.release_net_output(frames);
}

/// A writer that passes `left` bytes on and then kills this process with
/// SIGKILL (the mid-send kill of the kill campaigns).
struct DieAfter<'w, W: Write> {
    w: &'w mut W,
    left: usize,
}

impl<W: Write> Write for DieAfter<'_, W> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if b.len() >= self.left {
            self.w.write_all(&b[..self.left])?;
            self.w.flush()?;
            // SAFETY: raise() has no memory-safety preconditions; SIGKILL ends the process here.
            unsafe { libc::raise(libc::SIGKILL) };
        }
        let n = self.w.write(b)?;
        self.left -= n;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.w.flush()
    }
}

/// Sends a staged epoch, waits for its ack, then releases its output.
/// With `die` past, the process kills itself half-way through the send.
fn ship(
    release: Release,
    c: &mut Conn,
    st: &Staged,
    lease: Duration,
    die: Option<Instant>,
) -> Result<Shipped, Lost> {
    let t = Instant::now();
    let sent = if die.is_some_and(|d| Instant::now() >= d) {
        let half = (st.buf.len() + st.state.len()) / 2 + HEADER_BYTES;
        send_staged(&mut DieAfter { w: &mut c.s, left: half }, &mut c.seal, st)
    } else {
        send_staged(&mut c.s, &mut c.seal, st)
    };
    let bytes = sent.map_err(|e| Lost::Definitive(format!("sending epoch {}: {e}", st.epoch)))?;
    let send = t.elapsed();
    let t = Instant::now();
    wait_ack(c, st.epoch, lease)?;
    let ack_wait = t.elapsed();
    // Output commit: the epoch's output leaves only once the backup has it.
    release(&st.out, &st.disk);
    let released_at = Instant::now();
    Ok(Shipped {
        held: st.held_since.filter(|_| !st.out.is_empty()).map(|h| released_at - h),
        released_at,
        epoch: st.epoch,
        send,
        ack_wait,
        bytes,
        released: st.out.len() as u64,
        disk_released: st.disk.len() as u64,
        disk_bytes: st.disk.iter().map(|w| w.data.len() as u64).sum(),
        commit: st.boundary.elapsed(),
    })
}

/// Messages of the sender thread, in epoch order.
enum FromSender {
    /// Epoch shipped and acknowledged, its output released; the staging
    /// buffer comes back for reuse.
    Acked(Shipped, Vec<u8>),
    /// The backup was lost while shipping; `held` is the output of the
    /// failed epoch (not released).
    Lost(Lost, Vec<Vec<u8>>),
    /// An epoch queued after the loss: never sent, its output still held.
    Unsent(Vec<Vec<u8>>),
}

/// The sender thread: ships staged epochs in order until the channel
/// closes. Returns the connection when nothing failed (for the final Done).
fn sender(
    release: Release,
    mut c: Conn,
    epochs: mpsc::Receiver<Staged>,
    to_main: mpsc::Sender<FromSender>,
    lease: Duration,
    die: Option<Instant>,
) -> Option<Conn> {
    let mut failed = false;
    for st in epochs {
        if failed {
            let _ = to_main.send(FromSender::Unsent(st.out));
            continue;
        }
        match ship(release, &mut c, &st, lease, die) {
            Ok(s) => {
                let _ = to_main.send(FromSender::Acked(s, st.buf));
            }
            Err(l) => {
                failed = true;
                let l = classify(&c, l, lease);
                let _ = c.s.shutdown(std::net::Shutdown::Both);
                let _ = to_main.send(FromSender::Lost(l, st.out));
            }
        }
    }
    (!failed).then_some(c)
}

/// Waits for the network device to hold a frame (its output eventfd),
/// so an output-triggered epoch ends as soon as output waits.
pub(crate) struct OutputWait {
    epoll: Epoll,
    event: EventFd,
}

impl OutputWait {
    /// `None` for a VM without a network device.
    pub(crate) fn new(vm: &Vm) -> std::io::Result<Option<OutputWait>> {
        let Some(event) = vm.net_output_event().transpose()? else { return Ok(None) };
        let epoll = Epoll::new()?;
        epoll.ctl(ControlOperation::Add, event.as_raw_fd(), EpollEvent::new(EventSet::IN, 0))?;
        Ok(Some(OutputWait { epoll, event }))
    }

    /// Returns once a frame was held since the last return, or after
    /// `timeout` (rounded up to a millisecond); errors and interruptions
    /// are a return too (the caller looks again).
    pub(crate) fn wait(&self, timeout: Duration) {
        let ms = i32::try_from(timeout.as_micros().div_ceil(1000)).unwrap_or(i32::MAX);
        let mut ev = [EpollEvent::default()];
        if let Ok(1) = self.epoll.wait(ms, &mut ev) {
            // Reset the counter (non-blocking: a second reader is none).
            let _ = self.event.read();
        }
    }
}

/// The link to the backup.
enum Link<'s> {
    /// No backup (lost, or never reattached).
    Down,
    /// The epoch loop sends and waits for acks itself.
    Sync(Conn),
    /// A sender thread ships epochs while the VM runs on.
    Piped(Pipe<'s>),
}

struct Pipe<'s> {
    tx: mpsc::SyncSender<Staged>,
    rx: mpsc::Receiver<FromSender>,
    handle: std::thread::ScopedJoinHandle<'s, Option<Conn>>,
    in_flight: usize,
}

/// A loss with the output that was held for epochs not acknowledged.
struct Failure {
    lost: Lost,
    held: Vec<Vec<u8>>,
}

#[derive(Default)]
struct Sums {
    pauses: Vec<f64>,
    collect: f64,
    copy: f64,
    state: f64,
    send_in: f64,
    send_after: f64,
    ack_wait: f64,
    stall: f64,
    commit: f64,
    commit_max: f64,
    acked: u64,
    output_epochs: u64,
    triggered: u64,
    spaced: u64,
    output_wait: f64,
    wake: f64,
    wake_n: u64,
    stop: f64,
    /// The vCPU stop of the boundary under way, and summed over epochs
    /// with output.
    last_stop: f64,
    stop_out: f64,
    held: f64,
    held_n: u64,
    held_max: f64,
    turnaround: f64,
    turnaround_n: u64,
    /// When held frames last left.
    last_release: Option<Instant>,
    pages: f64,
    faults: u64,
    first_boundary: Option<Instant>,
    last_boundary: Option<Instant>,
}

/// The primary side of a replicated run.
pub struct Primary<'a> {
    vm: &'a Vm,
    cfg: PrimaryConfig,
    view: RamView,
    epoch: u64,
    rep: PrimaryReport,
    log: &'a mut dyn FnMut(String),
    sums: Sums,
    /// Staging buffers, kept across epochs (no page faults on reuse).
    pool: Vec<Vec<u8>>,
    /// When the mid-send test kill is due.
    die: Option<Instant>,
    pred: Option<Predictor>,
    /// Histase over userfaultfd (in place of KVM's dirty log).
    histase: Option<Histase>,
    compare: Option<Compare>,
    auto: Option<crate::compare::Auto>,
    /// `--colo`: the frames held for the secondary's.
    colo: Option<crate::colo::Outbox>,
    /// Pages per millisecond the last boundary collected (guest- and
    /// VMM-written, over the time since the boundary before, at least the
    /// spacing): decides
    /// whether the next output-triggered epoch is spaced.
    last_rate: f64,
}

impl<'a> Primary<'a> {
    pub fn new(vm: &'a Vm, cfg: PrimaryConfig, log: &'a mut dyn FnMut(String)) -> Self {
        let rep =
            PrimaryReport { epoch_ms: ms(cfg.epoch), options: cfg.opts, ..Default::default() };
        Self {
            view: RamView::new(vm.memory()),
            vm,
            cfg,
            epoch: 0,
            rep,
            log,
            sums: Sums::default(),
            pool: Vec::new(),
            die: None,
            pred: None,
            histase: None,
            compare: None,
            auto: None,
            colo: None,
            last_rate: 0.0,
        }
    }

    /// Starts the VM, makes the full copy and runs epochs until the VM ends,
    /// the time limit passes, or the primary fences itself.
    pub fn run(mut self) -> Result<PrimaryReport, String> {
        let vm = self.vm;
        // With reattach, a backup that is not there yet does not hold the
        // VM back: it starts unprotected and the backup is attached (full
        // copy) once it answers, as after a lost backup. This is how a VM
        // that failed over is protected again by a fresh backup.
        let conn = match connect(&self.cfg, vm) {
            Ok(c) => Some(c),
            Err(e) if self.cfg.reattach => {
                (self.log)(format!(
                    "WARNING: {e}; the VM starts UNPROTECTED and is protected once a backup \
                     answers at {}",
                    self.cfg.backup
                ));
                self.rep.unprotected = true;
                self.rep.backup_lost = Some(e);
                None
            }
            Err(e) => return Err(e),
        };
        if self.cfg.opts.auto_capture {
            if self.cfg.opts.compare || self.cfg.opts.histase || self.cfg.opts.direct {
                return Err("--auto-capture chooses between the dirty log and the compare \
                            capture itself: not with --compare, --histase or --direct"
                    .into());
            }
            if !self.cfg.opts.selective {
                return Err("--auto-capture works over selective re-protection".into());
            }
            self.compare = Some(Compare::new());
            self.auto = Some(crate::compare::Auto::new());
        }
        if self.cfg.opts.compare {
            if self.cfg.opts.selective || self.cfg.opts.predict || self.cfg.opts.histase {
                return Err("--compare captures without write tracking: it replaces \
                            --selective, --predict and --histase"
                    .into());
            }
            self.compare = Some(Compare::new());
        } else if self.cfg.opts.histase {
            if self.cfg.opts.selective || self.cfg.opts.predict {
                return Err("--histase tracks writes with userfaultfd: it replaces --selective \
                            and --predict"
                    .into());
            }
            self.histase = Some(Histase::new(vm.memory(), &self.view)?);
        } else {
            if self.cfg.opts.predict && self.cfg.opts.direct {
                return Err("--direct sends from guest memory without the staging copy that \
                            write-fault prediction compares: turn prediction off"
                    .into());
            }
            if self.cfg.opts.selective {
                vm.enable_manual_dirty_protect().map_err(|e| e.to_string())?;
            }
            vm.set_dirty_logging(true).map_err(|e| e.to_string())?;
        }
        if self.cfg.opts.colo {
            if self.cfg.opts.pipeline > 0 {
                return Err("--colo takes synchronous epochs: not with --pipeline".into());
            }
            if vm.disk_sectors().is_some() {
                return Err("--colo compares network output only: not for a VM with a disk".into());
            }
            if vm.linux_record().is_some() {
                return Err("--colo needs the reference guest (its network stack's seed is in \
                            guest memory): not for a Linux VM"
                    .into());
            }
            if vm.config().net.is_none() {
                return Err("--colo compares network output: the VM has no network device".into());
            }
            vm.copy_net_input(true);
            self.colo = Some(crate::colo::Outbox::new());
        }
        vm.track_vmm_writes(true);
        if conn.is_some() {
            vm.hold_net_output(true);
            vm.hold_disk_writes(true).map_err(|e| e.to_string())?;
        }
        vm.start().map_err(|e| e.to_string())?;
        self.die = self.cfg.die_mid_send_after.map(|d| Instant::now() + d);
        if self.cfg.opts.predict {
            if !self.cfg.opts.selective {
                return Err("write-fault prediction needs selective re-protection".into());
            }
            self.pred = Some(Predictor::new(&self.view));
        }
        let outcome = std::thread::scope(|sc| self.run_in(sc, conn))?;
        if !self.rep.fenced {
            // Whatever is still held (the VM ended) goes to the image.
            if let Err(e) = vm.hold_disk_writes(false) {
                (self.log)(format!("WARNING: the disk image missed writes: {e}"));
            }
        }
        Ok(self.finish(outcome))
    }

    fn run_in<'s>(
        &mut self,
        sc: &'s std::thread::Scope<'s, '_>,
        conn: Option<Conn>,
    ) -> Result<Option<VmOutcome>, String>
    where
        'a: 's,
    {
        let vm = self.vm;
        let mut link = match conn {
            None => Link::Down,
            Some(mut conn) => {
                vm.pause();
                let r = self.full_copy(&mut conn);
                vm.resume();
                match r {
                    Ok(()) => self.link_up(sc, conn),
                    Err(l) => {
                        let lost = classify(&conn, l, self.cfg.lease);
                        if self.lost(Failure { lost, held: Vec::new() }) {
                            return Ok(None);
                        }
                        Link::Down
                    }
                }
            }
        };
        let start = Instant::now();
        let mut next = Instant::now() + self.interval();
        let mut last = Instant::now();
        let spacing = Duration::from_millis(self.cfg.opts.output_epoch_ms);
        let mut seen = None;
        let mut waiter = None;
        let mut waiter_tried = false;
        loop {
            // Output-triggered epochs, unless COLO releases output (made
            // once COLO's secondary is down, if it goes).
            if self.cfg.opts.output_epochs && !waiter_tried && !self.colo_live() {
                waiter_tried = true;
                waiter = OutputWait::new(vm).unwrap_or_else(|e| {
                    (self.log)(format!(
                        "WARNING: no output event from the network device ({e}): epochs end \
                         on the timer only"
                    ));
                    None
                });
            }
            // The spacing holds back an output-triggered epoch only while
            // the guest writes fast (see `Options::output_spacing_rate`).
            let early = match self.last_rate > self.cfg.opts.output_spacing_rate as f64 {
                true => spacing,
                false => Duration::ZERO,
            };
            let mut spaced = false;
            if let (true, Link::Sync(c)) = (self.colo_live(), &mut link) {
                if let Err(f) = self.colo_wait(c, next) {
                    let _ = self.close(std::mem::replace(&mut link, Link::Down));
                    if self.lost(f) {
                        return Ok(None);
                    }
                }
                next = Instant::now();
            }
            loop {
                let now = Instant::now();
                if now >= next {
                    break;
                }
                let Some(w) = waiter.as_ref().filter(|_| !matches!(link, Link::Down)) else {
                    std::thread::sleep(next - now);
                    break;
                };
                // Output waits: the epoch ends as soon as it has run its
                // minimum; otherwise sleep until the device holds a frame.
                if let Some(h) = vm.net_output_since() {
                    if seen != Some(h) {
                        seen = Some(h);
                        self.sums.wake += ms(now.saturating_duration_since(h));
                        self.sums.wake_n += 1;
                    }
                    if now >= last + early {
                        self.sums.triggered += 1;
                        self.sums.spaced += u64::from(spaced);
                        break;
                    }
                    spaced = true;
                    std::thread::sleep((last + early).min(next) - now);
                    continue;
                }
                w.wait(next - now);
            }
            // A free pipeline slot first: the boundary waits for the backup.
            if self.drain(&mut link, true) {
                return Ok(None);
            }
            next = Instant::now() + self.interval();
            last = Instant::now();
            if matches!(link, Link::Down) && self.cfg.reattach && !self.rep.fenced {
                link = self.try_reattach(sc);
            }
            // A Linux VM's end is read before the pause: what PVM's
            // emulator stopped on is completed there (it relaunches the
            // vCPUs), and a reset or its time limit ends it.
            let linux_end = vm.linux_record().map(|_| nl_vmm::linux::poll(vm));
            let t = Instant::now();
            vm.pause();
            self.sums.last_stop = ms(t.elapsed());
            self.sums.stop += self.sums.last_stop;
            let outcome = linux_end.unwrap_or_else(|| vm.poll_outcome());
            let timed_out = start.elapsed() > self.cfg.time_limit;
            if matches!(link, Link::Down) {
                vm.resume();
            } else if let Err(mut f) = self.boundary(&mut link) {
                // Epochs still in flight are older: their frames go first.
                let (_, more) = self.close(std::mem::replace(&mut link, Link::Down));
                if let Some(m) = more {
                    f.held = [m.held, f.held].concat();
                }
                if self.lost(f) {
                    return Ok(None);
                }
            }
            if outcome.is_some() || timed_out {
                let outcome = outcome.unwrap_or_else(|| {
                    vm.stop();
                    VmOutcome::TimedOut { limit_ms: self.cfg.time_limit.as_millis() as u64 }
                });
                // Every epoch in flight is shipped and acknowledged first.
                let (conn, failure) = self.close(link);
                if let Some(f) = failure {
                    if self.lost(f) {
                        return Ok(None);
                    }
                }
                if let Some(mut c) = conn {
                    let _ = c.seal.write_frame(
                        &mut c.s,
                        Kind::Done,
                        self.epoch,
                        0,
                        &[outcome.message().as_bytes()],
                    );
                    let _ = c.s.flush();
                }
                return Ok(Some(outcome));
            }
        }
    }

    fn link_up<'s>(&mut self, sc: &'s std::thread::Scope<'s, '_>, conn: Conn) -> Link<'s>
    where
        'a: 's,
    {
        let depth = self.cfg.opts.pipeline as usize;
        if depth == 0 {
            return Link::Sync(conn);
        }
        let (tx, epochs) = mpsc::sync_channel(depth);
        let (to_main, rx) = mpsc::channel();
        let (vm, lease, die) = (self.vm, self.cfg.lease, self.die);
        let handle =
            std::thread::Builder::new().name("repl-send".into()).spawn_scoped(sc, move || {
                nl_vmm::seccomp::apply(nl_vmm::seccomp::Kind::Replication);
                sender(&|f, d| release_output(vm, f, d), conn, epochs, to_main, lease, die)
            });
        match handle {
            Ok(handle) => Link::Piped(Pipe { tx, rx, handle, in_flight: 0 }),
            Err(e) => {
                (self.log)(format!("cannot start the sender thread ({e}): sending synchronously"));
                // The connection moved into the failed closure; without a
                // sender there is no link (the caller treats it as lost).
                Link::Down
            }
        }
    }

    /// Takes in what the sender reported; with `block`, waits until the
    /// pipeline has a free slot. Returns true when the primary fenced itself.
    fn drain(&mut self, link: &mut Link<'_>, block: bool) -> bool {
        let Link::Piped(p) = link else { return false };
        let depth = self.cfg.opts.pipeline as usize;
        let t = Instant::now();
        let mut failure = None;
        loop {
            let must_wait = block && p.in_flight >= depth;
            let m = if must_wait {
                // The sender answers within a lease (its reads and writes
                // time out); three leases of nothing is a stuck sender.
                match p.rx.recv_timeout(self.cfg.lease * 3) {
                    Ok(m) => m,
                    Err(_) => {
                        failure = Some(Failure {
                            lost: Lost::Silent("the sender thread stopped answering".into()),
                            held: Vec::new(),
                        });
                        break;
                    }
                }
            } else {
                match p.rx.try_recv() {
                    Ok(m) => m,
                    Err(_) => break,
                }
            };
            match m {
                FromSender::Acked(s, buf) => {
                    p.in_flight -= 1;
                    self.pool.push(buf);
                    self.count_shipped(&s);
                }
                FromSender::Lost(lost, held) => {
                    failure = Some(Failure { lost, held });
                    break;
                }
                FromSender::Unsent(_) => {}
            }
        }
        self.sums.stall += ms(t.elapsed());
        match failure {
            None => false,
            Some(f) => {
                let old = std::mem::replace(link, Link::Down);
                let (_, more) = self.close(old);
                let mut f = f;
                if let Some(m) = more {
                    f.held.extend(m.held);
                }
                self.lost(f)
            }
        }
    }

    /// Ends a link: a pipeline ships and acknowledges what it has in flight
    /// first. Returns the connection if it is still good, or the failure
    /// (with every frame held for epochs not acknowledged, oldest first).
    fn close(&mut self, link: Link<'_>) -> (Option<Conn>, Option<Failure>) {
        match link {
            Link::Down => (None, None),
            Link::Sync(c) => (Some(c), None),
            Link::Piped(p) => {
                drop(p.tx);
                let conn = p.handle.join().unwrap_or(None);
                let mut failure: Option<Failure> = None;
                for m in p.rx.try_iter() {
                    match m {
                        FromSender::Acked(s, buf) => {
                            self.pool.push(buf);
                            self.count_shipped(&s);
                        }
                        FromSender::Lost(lost, held) => failure = Some(Failure { lost, held }),
                        FromSender::Unsent(held) => {
                            if let Some(f) = failure.as_mut() {
                                f.held.extend(held);
                            }
                        }
                    }
                }
                if conn.is_none() && failure.is_none() {
                    failure = Some(Failure {
                        lost: Lost::Silent("the sender thread ended".into()),
                        held: Vec::new(),
                    });
                }
                (conn, failure)
            }
        }
    }

    fn count_shipped(&mut self, s: &Shipped) {
        let m = &mut self.sums;
        m.send_after += ms(s.send);
        m.ack_wait += ms(s.ack_wait);
        m.commit += ms(s.commit);
        m.commit_max = m.commit_max.max(ms(s.commit));
        m.acked += 1;
        self.note_release(s.held, s.released_at);
        let m = &mut self.sums;
        if m.acked == 1 {
            (self.log)(format!(
                "epoch {} acknowledged by the backup: the VM is protected",
                s.epoch
            ));
        }
        self.rep.bytes_sent += s.bytes;
        self.rep.frames_released += s.released;
        self.rep.disk_writes_released += s.disk_released;
        self.rep.disk_bytes_written += s.disk_bytes;
        debug_assert!(s.epoch > 0);
    }

    /// Output commit done for an epoch whose frames were held `held`.
    fn note_release(&mut self, held: Option<Duration>, at: Instant) {
        let Some(h) = held else { return };
        let m = &mut self.sums;
        m.held += ms(h);
        m.held_n += 1;
        m.held_max = m.held_max.max(ms(h));
        m.last_release = Some(at);
    }

    fn finish(mut self, outcome: Option<VmOutcome>) -> PrimaryReport {
        let m = &self.sums;
        let n = m.pauses.len().max(1) as f64;
        let acked = m.acked.max(1) as f64;
        let r = &mut self.rep;
        r.epochs = m.pauses.len() as u64;
        r.pause_ms_avg = m.pauses.iter().sum::<f64>() / n;
        r.pause_ms_max = m.pauses.iter().copied().fold(0.0, f64::max);
        r.collect_ms_avg = m.collect / n;
        r.copy_ms_avg = m.copy / n;
        r.state_ms_avg = m.state / n;
        r.send_in_pause_ms_avg = m.send_in / n;
        r.send_after_ms_avg = m.send_after / acked;
        r.ack_wait_ms_avg = m.ack_wait / acked;
        r.stall_ms_avg = m.stall / n;
        r.commit_ms_avg = m.commit / acked;
        r.commit_ms_max = m.commit_max;
        r.output_epochs = m.output_epochs;
        r.output_triggered_epochs = m.triggered;
        r.output_spaced_epochs = m.spaced;
        r.output_wait_ms_avg = m.output_wait / m.output_epochs.max(1) as f64;
        r.output_wake_ms_avg = m.wake / m.wake_n.max(1) as f64;
        r.stop_ms_avg = m.stop / n;
        r.output_stop_ms_avg = m.stop_out / m.output_epochs.max(1) as f64;
        r.output_held_ms_avg = m.held / m.held_n.max(1) as f64;
        r.output_held_ms_max = m.held_max;
        r.turnaround_ms_avg = m.turnaround / m.turnaround_n.max(1) as f64;
        r.pages_per_epoch = m.pages / n;
        r.write_faults_per_epoch = m.faults as f64 / n;
        if let Some(p) =
            self.pred.as_ref().map(|p| p.counts).or(self.histase.as_ref().map(|h| h.counts))
        {
            r.predicted_per_epoch = p.predicted as f64 / n;
            r.fake_dirty_per_epoch = p.fake as f64 / n;
            r.precision = (p.predicted > 0).then(|| p.hits as f64 / p.predicted as f64);
            r.recall = (p.written > 0).then(|| p.hits as f64 / p.written as f64);
        }
        if let Some(p) = &self.pred {
            r.prediction_gate = Some(p.gate.stats);
        }
        r.auto_capture = self.auto.as_ref().map(|a| a.stats());
        r.colo = self.colo.as_ref().map(|c| c.stats.clone());
        if let Some(c) = self.compare.as_ref().filter(|c| c.scans > 0) {
            r.compared_per_epoch = Some(c.scanned as f64 / c.scans as f64);
            r.compare_ms_avg = Some(c.scan_ms / c.scans as f64);
        }
        if let (Some(a), Some(b)) = (m.first_boundary, m.last_boundary) {
            if m.pauses.len() > 1 {
                r.interval_ms_avg = ms(b - a) / (m.pauses.len() - 1) as f64;
            }
        }
        r.outcome = outcome;
        self.rep
    }

    /// Handles a lost backup. Returns true when the primary fenced itself.
    fn lost(&mut self, f: Failure) -> bool {
        match f.lost {
            Lost::Definitive(why) => {
                (self.log)(format!(
                    "WARNING: backup lost ({why}); the VM keeps running UNPROTECTED. \
                     Start a new backup with `ninelives replicate backup --listen {}`{}",
                    self.cfg.backup,
                    if self.cfg.reattach { " and this primary attaches to it" } else { "" }
                ));
                self.rep.backup_lost = Some(why);
                self.rep.unprotected = true;
                // The backup is gone for sure: output no longer waits for
                // anyone; the oldest held frames go first.
                self.rep.frames_released += f.held.len() as u64;
                self.vm.release_net_output(&f.held);
                let held = self.vm.hold_net_output(false);
                self.rep.frames_released += held.len() as u64;
                self.vm.release_net_output(&held);
                // Every held disk sector goes to the image with its newest
                // content (what the failed epochs held is superseded).
                if let Err(e) = self.vm.hold_disk_writes(false) {
                    (self.log)(format!("WARNING: the disk image missed writes: {e}"));
                }
                false
            }
            Lost::Silent(why) => {
                (self.log)(format!(
                    "FENCED: {why}; the backup may have taken over, so this primary stops \
                     its VM and releases no more output"
                ));
                self.rep.backup_lost = Some(why);
                self.rep.fenced = true;
                self.vm.stop();
                // Held output is dropped.
                let _ = self.vm.hold_net_output(true);
                self.vm.discard_disk_writes();
                true
            }
        }
    }

    fn try_reattach<'s>(&mut self, sc: &'s std::thread::Scope<'s, '_>) -> Link<'s>
    where
        'a: 's,
    {
        let Ok(mut c) = connect(&self.cfg, self.vm) else { return Link::Down };
        (self.log)(format!("backup at {} attached again: full copy", self.cfg.backup));
        self.epoch = 0;
        self.rep.unprotected = false;
        self.rep.reattached += 1;
        self.vm.hold_net_output(true);
        self.vm.pause();
        let r = self.full_copy(&mut c);
        self.vm.resume();
        match r {
            Ok(()) => self.link_up(sc, c),
            Err(l) => {
                let lost = classify(&c, l, self.cfg.lease);
                let _ = self.lost(Failure { lost, held: Vec::new() });
                Link::Down
            }
        }
    }

    /// Epoch 0: every allocated page, with the VM paused; waits for the ack.
    fn full_copy(&mut self, c: &mut Conn) -> Result<(), Lost> {
        let t = Instant::now();
        let vm = self.vm;
        // Reset the tracking: it starts at this copy.
        if let Some(a) = self.auto.as_mut() {
            a.reset();
            if let Some(c) = self.compare.as_mut() {
                c.forget();
            }
        }
        match (self.histase.as_mut(), self.compare.as_mut()) {
            (Some(h), _) => h.restart().map_err(Lost::Definitive)?,
            (None, Some(c)) if self.auto.is_none() => {
                c.restart(vm.memory()).map_err(Lost::Definitive)?
            }
            (None, _) => {
                kvm_log(vm, self.cfg.opts.selective).map_err(Lost::Definitive)?;
            }
        }
        let _ = vm.take_vmm_writes();
        if let Some(p) = self.pred.as_mut() {
            p.reset();
        }
        let ranges = vm.memory().allocated_ranges().map_err(|e| Lost::Definitive(e.to_string()))?;
        let mut pages = Vec::new();
        for (s, e) in ranges {
            let mut p = s & !(PAGE as u64 - 1);
            while p < e {
                pages.push(p);
                p += PAGE as u64;
            }
        }
        pages.sort_unstable();
        pages.dedup();
        let state = vm.save_state().map_err(|e| Lost::Definitive(e.to_string()))?.to_bytes();
        // The disk: whatever is held goes to the image first, so the image
        // is the whole disk as of this pause; holding starts again from it.
        vm.hold_disk_writes(false)
            .and_then(|()| vm.hold_disk_writes(true))
            .map_err(|e| Lost::Definitive(format!("preparing the disk for the full copy: {e}")))?;
        let mut disk = DiskImageChunks::new(vm).map_err(Lost::Definitive)?;
        let view = &self.view;
        let runs = runs(&pages, PAGES_PER_FRAME as u32);
        let bytes =
            send_epoch(&mut c.s, &mut c.seal, 0, &runs, |g, l| view.slice(g, l), &mut disk, &state)
                .map_err(Lost::Definitive)?;
        self.rep.bytes_sent += bytes;
        self.rep.disk_full_copy_bytes = disk.sent;
        wait_ack(c, 0, self.cfg.lease)?;
        self.rep.full_copy_pages = pages.len() as u64;
        self.rep.full_copy_ms = ms(t.elapsed());
        self.epoch = 1;
        Ok(())
    }

    /// Whether this epoch's pages come from the compare capture.
    fn comparing(&self) -> bool {
        self.compare.is_some()
            && self.auto.as_ref().is_none_or(|a| a.mode == crate::compare::Mode::Compare)
    }

    /// `--auto-capture`, at the end of a boundary's collect and copy (VM
    /// paused): judges the epoch and switches the capture for the next.
    /// Into the compare, the shadow is taken now (memory as the backup will
    /// have it once this epoch is in); back to the log, every page written
    /// since is re-protected and prediction starts afresh.
    fn choose_capture(&mut self, shipped: usize, faults: u64) -> Result<(), String> {
        let (Some(a), Some(c)) = (self.auto.as_mut(), self.compare.as_mut()) else {
            return Ok(());
        };
        let vm = self.vm;
        let allocated = nl_checkpoint::engine::pages_in(
            &vm.memory().allocated_ranges().map_err(|e| e.to_string())?,
        );
        let before = a.mode;
        // The guest's own count of its progress (the reference guest's
        // heartbeat); Linux keeps none.
        let progress = vm.linux_record().is_none().then(|| (vm.heartbeat_ops(), Instant::now()));
        let after = a.next(shipped, faults, c.last_scan.take(), allocated, progress);
        let why = a.take_note();
        match (before, after) {
            (crate::compare::Mode::Log, crate::compare::Mode::Compare) => {
                c.restart(vm.memory())?;
                (self.log)(format!(
                    "capture: epoch {}: {}: switching to the compare capture",
                    self.epoch - 1,
                    why.unwrap_or_else(|| format!(
                        "{faults} write faults for {shipped} pages of {allocated}"
                    ))
                ));
            }
            (crate::compare::Mode::Compare, crate::compare::Mode::Log) => {
                // The shadow is dropped at the next boundary: this epoch
                // may still be sent from it.
                kvm_log(vm, true)?;
                if let Some(p) = self.pred.as_mut() {
                    p.reset();
                }
                (self.log)(format!(
                    "capture: epoch {}: {}: back to the dirty log",
                    self.epoch - 1,
                    why.unwrap_or_else(|| format!("{shipped} pages changed of {allocated}"))
                ));
            }
            (m, _) => {
                if let Some(why) = why {
                    (self.log)(format!(
                        "capture: epoch {}: {why}: keeping {}",
                        self.epoch - 1,
                        if m == crate::compare::Mode::Log {
                            "the dirty log"
                        } else {
                            "the compare capture"
                        }
                    ));
                }
            }
        }
        Ok(())
    }

    /// The epoch timer: `--epoch`, or under COLO its period.
    fn interval(&self) -> Duration {
        match self.colo_live() {
            true => Duration::from_millis(self.cfg.opts.colo_period_ms.max(1)),
            false => self.cfg.epoch,
        }
    }

    /// Whether COLO releases output: asked for, and the backup's secondary
    /// has not stopped.
    fn colo_live(&self) -> bool {
        self.colo.as_ref().is_some_and(|k| k.stats.secondary_down.is_none())
    }

    /// COLO between epochs: forwards the guest's input to the secondary,
    /// compares the two VMs' output and releases what matches. Returns when
    /// an epoch is due: the outputs differ, a frame waited too long, or
    /// `until` passed.
    fn colo_wait(&mut self, c: &mut Conn, until: Instant) -> Result<(), Failure> {
        let vm = self.vm;
        let k = self.colo.as_mut().expect("called under --colo only");
        let timeout = Duration::from_millis(self.cfg.opts.colo_timeout_ms.max(1));
        let fail = |lost| Failure { lost, held: Vec::new() };
        let io = |e: String| fail(Lost::Definitive(format!("sending input to the backup: {e}")));
        let epoll = Epoll::new().map_err(|e| io(e.to_string()))?;
        let dev = vm.net_output_event().transpose().map_err(|e| io(e.to_string()))?;
        for fd in dev.as_ref().map(|e| e.as_raw_fd()).into_iter().chain([c.arrived.as_raw_fd()]) {
            epoll
                .ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, 0))
                .map_err(|e| io(e.to_string()))?;
        }
        let epoch = self.epoch;
        // Input is the only traffic to the backup between COLO's epochs: an
        // idle guest's primary says it is alive (the backup's lease).
        let beat = self.cfg.lease / 4;
        let mut last_sent = Instant::now();
        loop {
            if let Some(why) = c.colo_down.take() {
                // Nothing will match any more: the epoch now releases what
                // is held, and epochs alone release output from here on.
                (self.log)(format!(
                    "WARNING: colo: the backup's secondary stopped ({why}): output is \
                     released by epochs from now on"
                ));
                vm.copy_net_input(false);
                let _ = vm.take_net_input();
                k.stats.secondary_down = Some(why);
                return Ok(());
            }
            let now = Instant::now();
            let input = vm.take_net_input();
            if !input.is_empty() {
                for f in &input {
                    c.seal
                        .write_frame(&mut c.s, Kind::ColoIn, epoch, 0, &[f])
                        .map_err(|e| io(e.to_string()))?;
                }
                k.stats.forwarded += input.len() as u64;
                last_sent = now;
            } else if now >= last_sent + beat {
                c.seal
                    .write_frame(&mut c.s, Kind::Heartbeat, epoch, 0, &[])
                    .map_err(|e| io(e.to_string()))?;
                last_sent = now;
            }
            let (mut out, mut differ) = k.primary_batch(vm.take_net_output(), now);
            while differ.is_none() {
                let Ok(r) = c.frames.try_recv() else { break };
                let Some(f) = heard(c, r).map_err(fail)? else { continue };
                if f.kind != Kind::ColoOut {
                    continue; // An older epoch's ack.
                }
                if f.epoch != epoch {
                    k.stats.stale_secondary += 1;
                    continue;
                }
                match k.secondary(&f.payload, now) {
                    Ok(r) => out.extend(r),
                    Err(d) => differ = Some(d),
                }
            }
            // What matched leaves now, whatever comes next.
            vm.release_net_output(&out);
            self.rep.frames_released += out.len() as u64;
            if let Some(d) = differ {
                k.stats.divergences += 1;
                if k.stats.divergences <= 3 {
                    (self.log)(format!("colo: epoch {epoch}: the outputs differ: {}", d.0));
                }
                return Ok(());
            }
            let due = k.oldest().map(|h| h + timeout);
            if due.is_some_and(|d| now >= d) {
                k.stats.timeouts += 1;
                return Ok(());
            }
            if now >= until {
                k.stats.periodic += 1;
                return Ok(());
            }
            if c.last_heard.elapsed() > self.cfg.lease {
                return Ok(()); // The epoch's ack wait says what became of it.
            }
            let left = due
                .map_or(until, |d| d.min(until))
                .min(last_sent + beat)
                .saturating_duration_since(now);
            let ms = i32::try_from(left.as_micros().div_ceil(1000)).unwrap_or(i32::MAX);
            let mut ev = [EpollEvent::default(); 2];
            if epoll.wait(ms.max(1), &mut ev).is_ok_and(|n| n > 0) {
                // Both are eventfds: reset them (non-blocking).
                if let Some(d) = &dev {
                    let _ = d.read();
                }
                let _ = c.arrived.read();
            }
        }
    }

    /// One epoch boundary; the VM is paused on entry and running on return.
    fn boundary(&mut self, link: &mut Link<'_>) -> Result<(), Failure> {
        let vm = self.vm;
        let t0 = Instant::now();
        let m = &mut self.sums;
        m.first_boundary.get_or_insert(t0);
        let since = m.last_boundary.map_or(self.cfg.epoch, |b| t0 - b);
        m.last_boundary = Some(t0);
        let fail = |why: String| Failure { lost: Lost::Definitive(why), held: Vec::new() };
        // Prediction leaves logged pages writable (their dirty bits set);
        // without it, or while it is off, every logged page is re-protected.
        // Under the compare capture nothing is re-protected (with the log
        // on, as under --auto-capture, a page faults once and stays
        // writable) and prediction sits out.
        let comparing = self.comparing();
        if !comparing && self.auto.is_some() {
            if let Some(c) = self.compare.as_mut() {
                c.forget();
            }
        }
        let clear = !comparing
            && self.cfg.opts.selective
            && self.pred.as_ref().is_none_or(|p| p.reprotects_all());
        let tracked = self.histase.as_mut().map(|h| h.take()).transpose();
        let logged = match &tracked {
            Ok(Some(t)) => Ok(t.pages.clone()),
            Ok(None) => match self.compare.as_mut() {
                Some(c) if comparing => c.take(vm.memory()),
                _ => kvm_log(vm, clear),
            },
            Err(e) => Err(e.clone()),
        };
        let (logged, tracked) = match (logged, tracked) {
            (Ok(l), Ok(t)) => (l, t),
            (Err(e), _) | (_, Err(e)) => {
                vm.resume();
                return Err(fail(format!("collecting the epoch: {e}")));
            }
        };
        let (pages, vmm) = with_vmm_writes(vm, &self.view, &logged);
        // Over at least the spacing: a short epoch still collects the pages
        // each request touches, which is no fast writer.
        let over = ms(since).max(self.cfg.opts.output_epoch_ms as f64).max(0.1);
        self.last_rate = pages.len() as f64 / over;
        // Each logged page took a write fault, except those left writable.
        let faults = match (&self.pred, &tracked) {
            _ if comparing => 0,
            (_, Some(t)) => t.faults,
            (Some(p), None) => logged
                .iter()
                .filter(|&&g| self.view.flat(g).is_some_and(|o| !p.writable[o / PAGE]))
                .count() as u64,
            (None, None) => logged.len() as u64,
        };
        let t_collect = t0.elapsed();
        let t = Instant::now();
        let state = match vm.save_state() {
            Ok(s) => s.to_bytes(),
            Err(e) => {
                vm.resume();
                return Err(fail(format!("saving the VM state: {e}")));
            }
        };
        let held_since = vm.net_output_since();
        let mut out = vm.take_net_output();
        if let Some(k) = self.colo.as_mut() {
            // Input the guest took before this pause is in the epoch: the
            // secondary gets it by becoming the epoch, not as a frame.
            let _ = vm.take_net_input();
            out = k.checkpointed(out);
        }
        if let Some(h) = held_since.filter(|_| !out.is_empty()) {
            let m = &mut self.sums;
            m.output_epochs += 1;
            m.output_wait += ms(t0.saturating_duration_since(h));
            m.stop_out += m.last_stop;
            if let Some(r) = m.last_release.filter(|&r| h > r) {
                m.turnaround += ms(h - r);
                m.turnaround_n += 1;
            }
        }
        let disk = vm.take_disk_writes();
        let t_state = t.elapsed();
        let epoch = self.epoch;
        self.epoch += 1;
        let rr = runs(&pages, PAGES_PER_FRAME as u32);
        let (mut copy, mut send_in) = (Duration::ZERO, Duration::ZERO);
        // Under --compare with synchronous epochs the scan left this
        // epoch's pages in the shadow, which nothing changes before the next
        // boundary: they are sent from there with the vCPUs running, without
        // a staging copy in the pause.
        let from_shadow = comparing && !self.cfg.opts.direct;
        let direct = (self.cfg.opts.direct || from_shadow) && matches!(link, Link::Sync(_));
        let mut result = Ok(());
        if direct {
            // Send straight from guest memory while the vCPUs are paused, or
            // from the compare's shadow after they resume.
            let Link::Sync(c) = link else { unreachable!("checked above") };
            // --auto-capture judges the epoch while the vCPUs are stopped
            // (back to the log, every page is protected again now).
            let chosen = if from_shadow {
                self.choose_capture(pages.len(), faults)
                    .map_err(|e| Lost::Definitive(format!("choosing the capture: {e}")))
            } else {
                Ok(())
            };
            let view = &self.view;
            let shadow = self.compare.as_ref().filter(|_| from_shadow);
            if from_shadow {
                vm.resume();
            }
            let t = Instant::now();
            let mut ds = disk.iter().cloned().map(Ok);
            let mut send = |mut w: &mut dyn Write, seal: &mut Sealer| {
                send_epoch(
                    &mut w,
                    seal,
                    epoch,
                    &rr,
                    |g, l| match shadow {
                        Some(s) => s.slice(g, l),
                        None => view.slice(g, l),
                    },
                    &mut ds,
                    &state,
                )
            };
            let r = if self.die.is_some_and(|d| Instant::now() >= d) {
                // The kill campaign's mid-send kill, half-way through.
                let half = (pages.len() * PAGE + state.len()) / 2 + HEADER_BYTES;
                send(&mut DieAfter { w: &mut c.s, left: half }, &mut c.seal)
            } else {
                send(&mut c.s, &mut c.seal)
            };
            if from_shadow {
                self.sums.send_after += ms(t.elapsed());
            } else {
                send_in = t.elapsed();
                vm.resume();
            }
            self.rep.bytes_sent += r.as_ref().map_or(0, |b| *b);
            let t = Instant::now();
            result = chosen.and_then(|()| {
                r.map_err(|e| Lost::Definitive(format!("sending epoch {epoch}: {e}")))
                    .and_then(|_| wait_ack(c, epoch, self.cfg.lease))
            });
            self.sums.ack_wait += ms(t.elapsed());
            if result.is_ok() {
                self.sums.acked += 1;
                if self.sums.acked == 1 {
                    (self.log)(format!(
                        "epoch {epoch} acknowledged by the backup: the VM is protected"
                    ));
                }
                self.rep.frames_released += out.len() as u64;
                self.rep.disk_writes_released += disk.len() as u64;
                self.rep.disk_bytes_written +=
                    disk.iter().map(|w| w.data.len() as u64).sum::<u64>();
                release_output(vm, &out, &disk);
                let now = Instant::now();
                self.note_release(held_since.filter(|_| !out.is_empty()).map(|h| now - h), now);
            }
            let st = Staged {
                epoch,
                runs: Vec::new(),
                buf: Vec::new(),
                state,
                out,
                disk,
                boundary: t0,
                held_since,
            };
            result = result.map_err(|l| classify(c, l, self.cfg.lease));
            self.account(t_collect, copy, t_state, send_in, pages.len(), faults, vmm);
            return result.map_err(|lost| Failure { lost, held: st.out });
        }
        // Copy the dirty runs into a staging buffer, then resume.
        let t = Instant::now();
        let mut buf = self.pool.pop().unwrap_or_default();
        let threads = if self.cfg.opts.serial_copy { 1 } else { copy_threads() };
        let mut copied = stage_copy_on(&self.view, &rr, &mut buf, threads);
        copy = t.elapsed();
        // Prediction: re-protect the pages found fake dirty last time, now
        // that this epoch's copy of them is taken and the VM is still paused.
        let cleared = match self.pred.as_mut() {
            _ if comparing => Vec::new(),
            Some(p) if clear => {
                // Everything logged was re-protected at the collect.
                p.to_clear.clear();
                logged.clone()
            }
            Some(p) => std::mem::take(&mut p.to_clear),
            None => Vec::new(),
        };
        if !cleared.is_empty() && !clear {
            if let Err(e) = vm.clear_dirty_bitmaps(&self.view.bitmaps(&cleared)) {
                copied = Err(e.to_string());
            }
        }
        if copied.is_ok() {
            if let Err(e) = self.choose_capture(pages.len(), faults) {
                copied = Err(e);
            }
        }
        vm.resume();
        let rr = match (self.pred.as_mut(), self.histase.as_mut(), &tracked) {
            _ if copied.is_err() || comparing => rr,
            (Some(p), _, _) => p.filter(&self.view, &rr, &mut buf, &logged, &cleared),
            (None, Some(h), Some(t)) => h.filter(&self.view, &rr, &mut buf, t),
            _ => rr,
        };
        let shipped_pages = rr.iter().map(|r| r.1 as usize).sum();
        self.account(t_collect, copy, t_state, send_in, shipped_pages, faults, vmm);
        let st = Staged { epoch, runs: rr, buf, state, out, disk, boundary: t0, held_since };
        if let Err(e) = copied {
            return Err(Failure {
                lost: Lost::Definitive(format!("copying epoch {epoch}: {e}")),
                held: st.out,
            });
        }
        match link {
            Link::Down => unreachable!("no boundary without a link"),
            Link::Sync(c) => {
                let release = |f: &[Vec<u8>], d: &[DiskWrite]| release_output(vm, f, d);
                match ship(&release, c, &st, self.cfg.lease, self.die) {
                    Ok(s) => {
                        self.count_shipped(&s);
                        self.pool.push(st.buf);
                    }
                    Err(l) => {
                        result = Err(classify(c, l, self.cfg.lease));
                    }
                }
            }
            Link::Piped(p) => {
                // Never blocks: at most `pipeline` epochs are in flight.
                match p.tx.send(st) {
                    Ok(()) => p.in_flight += 1,
                    Err(mpsc::SendError(st)) => {
                        return Err(Failure {
                            lost: Lost::Silent("the sender thread is gone".into()),
                            held: st.out,
                        })
                    }
                }
                return Ok(());
            }
        }
        result.map_err(|lost| Failure { lost, held: st.out })
    }

    #[allow(clippy::too_many_arguments)]
    fn account(
        &mut self,
        collect: Duration,
        copy: Duration,
        state: Duration,
        send_in: Duration,
        pages: usize,
        faults: u64,
        vmm: u64,
    ) {
        let m = &mut self.sums;
        m.pauses.push(ms(collect + copy + state + send_in));
        m.collect += ms(collect);
        m.copy += ms(copy);
        m.state += ms(state);
        m.send_in += ms(send_in);
        m.pages += pages as f64;
        m.faults += faults;
        self.rep.vmm_written_pages += vmm;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::sync::Mutex;

    fn staged(epoch: u64, byte: u8) -> Staged {
        Staged {
            epoch,
            runs: vec![(0x1000 * epoch, 1)],
            buf: vec![byte; PAGE],
            state: b"state".to_vec(),
            out: vec![vec![byte]],
            disk: vec![DiskWrite { seq: epoch, sector: epoch, data: Arc::from(vec![byte; 512]) }],
            boundary: Instant::now(),
            held_since: None,
        }
    }

    /// The pipeline releases an epoch's frames only after the backup
    /// acknowledged that epoch, never a later epoch's with it, and hands
    /// back unreleased the frames of an epoch whose ack never came.
    #[test]
    fn pipelined_output_waits_for_its_own_ack() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let (go_tx, go_rx) = mpsc::channel::<Option<u64>>();
        let session = SessionKey([9; 32]);
        let (mut open, mut seal) = (session.opener(Dir::ToBackup), session.sealer(Dir::ToPrimary));
        let fake_backup = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut r = s.try_clone().unwrap();
            let mut ended = Vec::new();
            // Acks only when told to, and only epochs fully received.
            while let Ok(Some(e)) = go_rx.recv() {
                while !ended.contains(&e) {
                    let f = open.read_frame(&mut r).unwrap();
                    if f.kind == Kind::EpochEnd {
                        ended.push(f.epoch);
                    }
                }
                seal.write_frame(&mut s, Kind::Ack, e, 0, &[]).unwrap();
            }
            // Told to die: the connection closes with epoch 2 unacknowledged.
        });
        let s = TcpStream::connect(addr).unwrap();
        let c = Conn::new(s, &session).unwrap();
        let released = Mutex::new(Vec::<Vec<u8>>::new());
        let disk_released = Mutex::new(Vec::<u64>::new());
        let release = |f: &[Vec<u8>], d: &[DiskWrite]| {
            released.lock().unwrap().extend_from_slice(f);
            disk_released.lock().unwrap().extend(d.iter().map(|w| w.sector));
        };
        let (tx, epochs) = mpsc::sync_channel(2);
        let (to_main, rx) = mpsc::channel();
        std::thread::scope(|sc| {
            let h =
                sc.spawn(|| sender(&release, c, epochs, to_main, Duration::from_secs(10), None));
            tx.send(staged(1, 1)).unwrap();
            tx.send(staged(2, 2)).unwrap();
            assert!(rx.recv_timeout(Duration::from_millis(200)).is_err(), "nothing acked yet");
            assert!(released.lock().unwrap().is_empty(), "released before any ack");
            go_tx.send(Some(1)).unwrap();
            match rx.recv_timeout(Duration::from_secs(10)).expect("epoch 1 acked") {
                FromSender::Acked(s, _) => assert_eq!(s.epoch, 1),
                _ => panic!("expected the ack of epoch 1"),
            }
            assert_eq!(*released.lock().unwrap(), vec![vec![1u8]]);
            go_tx.send(None).unwrap();
            match rx.recv_timeout(Duration::from_secs(10)).expect("loss reported") {
                FromSender::Lost(Lost::Definitive(_), held) => assert_eq!(held, vec![vec![2u8]]),
                _ => panic!("expected a definitive loss holding epoch 2's frames"),
            }
            tx.send(staged(3, 3)).unwrap();
            drop(tx);
            assert!(h.join().unwrap().is_none(), "no connection after a loss");
            match rx.recv_timeout(Duration::from_secs(10)).expect("epoch 3 handed back") {
                FromSender::Unsent(held) => assert_eq!(held, vec![vec![3u8]]),
                _ => panic!("expected epoch 3 unsent"),
            }
        });
        assert_eq!(*released.lock().unwrap(), vec![vec![1u8]], "only epoch 1 ever left");
        assert_eq!(*disk_released.lock().unwrap(), vec![1], "only epoch 1's disk write");
        fake_backup.join().unwrap();
    }

    /// An ack that fails authentication (here: sealed under another
    /// session, as a replay from an earlier connection would be) is no ack,
    /// and no proof that the backup is gone either: the primary fences.
    #[test]
    fn a_forged_ack_is_refused_and_fences() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let fake_backup = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut other = SessionKey([8; 32]).sealer(Dir::ToPrimary);
            other.write_frame(&mut s, Kind::Ack, 1, 0, &[]).unwrap();
            std::thread::sleep(Duration::from_millis(500));
        });
        let s = TcpStream::connect(addr).unwrap();
        let mut c = Conn::new(s, &SessionKey([9; 32])).unwrap();
        match wait_ack(&mut c, 1, Duration::from_secs(10)) {
            Err(Lost::Silent(why)) => assert!(why.contains("failed authentication"), "{why}"),
            Err(Lost::Definitive(why)) => panic!("a forged ack made the backup 'gone': {why}"),
            Ok(()) => panic!("a forged ack was taken"),
        }
        fake_backup.join().unwrap();
    }

    #[test]
    fn staging_copies_runs_in_order() {
        let mem = nl_memory::GuestMemory::new("t", 64 << 20).unwrap();
        use vm_memory::{Bytes, GuestAddress};
        mem.mem().write_slice(&[7u8; PAGE], GuestAddress(0x3000)).unwrap();
        mem.mem().write_slice(&[9u8; PAGE], GuestAddress(0x8000)).unwrap();
        let view = RamView::new(&mem);
        let rr = runs(&[0x2000, 0x3000, 0x8000], PAGES_PER_FRAME as u32);
        assert_eq!(rr, vec![(0x2000, 2), (0x8000, 1)]);
        let mut buf = Vec::new();
        stage_copy(&view, &rr, &mut buf).unwrap();
        assert_eq!(buf.len(), 3 * PAGE);
        assert!(buf[..PAGE].iter().all(|&b| b == 0));
        assert!(buf[PAGE..2 * PAGE].iter().all(|&b| b == 7));
        assert!(buf[2 * PAGE..].iter().all(|&b| b == 9));
        assert!(stage_copy(&view, &[(64 << 20, 1)], &mut buf).is_err());
    }

    #[test]
    fn runs_coalesce_and_split() {
        assert_eq!(runs(&[0x1000, 0x2000, 0x3000, 0x5000], 8), vec![(0x1000, 3), (0x5000, 1)]);
        assert_eq!(runs(&[0, 0x1000, 0x2000], 2), vec![(0, 2), (0x2000, 1)]);
    }
}

/// The parallel copy of an epoch into its staging buffer.
#[cfg(test)]
mod parallel_copy_tests {
    use super::*;
    use vm_memory::{Bytes, GuestAddress};

    /// On any thread count the staging buffer holds exactly what one thread
    /// copies: runs split across threads and parts of uneven size included.
    #[test]
    fn a_parallel_copy_equals_the_serial_one() {
        let mem = nl_memory::GuestMemory::new("t", 64 << 20).unwrap();
        let view = RamView::new(&mem);
        // Every page of the first 16 MiB gets its own content.
        let mut pages = Vec::new();
        for i in 0..4096u64 {
            let g = i * PAGE as u64;
            if !view.contains(g) {
                continue;
            }
            let fill: Vec<u8> = (0..PAGE).map(|b| (i as usize * 31 + b / 512) as u8).collect();
            mem.mem().write_slice(&fill, GuestAddress(g)).unwrap();
            // Gaps, so runs of several lengths.
            if i % 7 != 3 {
                pages.push(g);
            }
        }
        let rr = runs(&pages, PAGES_PER_FRAME as u32);
        let mut want = Vec::new();
        stage_copy_on(&view, &rr, &mut want, 1).unwrap();
        assert_eq!(want.len(), pages.len() * PAGE);
        for threads in [2, 3, 5, 8] {
            // A reused buffer longer than needed, with stale content.
            let mut got = vec![0xAB; want.len() + 3 * PAGE];
            stage_copy_on(&view, &rr, &mut got, threads).unwrap();
            assert!(got == want, "{threads} threads: the staging buffer differs");
        }
        // A bad run is an error on the parallel path too.
        let mut bad = rr.clone();
        bad.push((64 << 20, 600));
        assert!(stage_copy_on(&view, &bad, &mut Vec::new(), 4).is_err());
    }
}
