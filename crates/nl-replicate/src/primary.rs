//! The primary: runs the VM in epochs and ships each epoch to the backup;
//! the guest's network output of an epoch leaves only after the backup
//! acknowledged that epoch (output commit).

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nl_memory::GuestMemory;
use nl_vmm::{Vm, VmOutcome};
use serde::Serialize;

use crate::protocol::*;

/// The optimizations, each switchable.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Options {
    /// Manual dirty-log protection: KVM_GET_DIRTY_LOG only reports and
    /// KVM_CLEAR_DIRTY_LOG re-protects exactly the pages dirtied in the epoch.
    pub selective: bool,
    /// Send coalesced runs straight from guest memory while the vCPUs are
    /// paused (no copy); otherwise copy each dirty page into a buffer during
    /// the pause and send page by page after resuming.
    pub direct: bool,
}

#[derive(Clone, Debug)]
pub struct PrimaryConfig {
    pub backup: SocketAddr,
    pub epoch: Duration,
    /// Without any frame from the backup for this long the primary fences
    /// itself (the backup may have taken over).
    pub lease: Duration,
    pub secret: String,
    pub opts: Options,
    /// Stop the VM after this long whatever it does.
    pub time_limit: Duration,
    /// After the backup is gone, keep trying to attach a new one there.
    pub reattach: bool,
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
    /// Sending after the resume (copy mode) and waiting for the ack.
    pub send_after_ms_avg: f64,
    pub ack_wait_ms_avg: f64,
    pub bytes_sent: u64,
    pub frames_released: u64,
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
    frames: mpsc::Receiver<Result<Frame, ProtoError>>,
    last_heard: Instant,
}

fn connect(cfg: &PrimaryConfig, vm: &Vm) -> Result<Conn, String> {
    let mut s = TcpStream::connect_timeout(&cfg.backup, cfg.lease)
        .map_err(|e| format!("cannot reach the backup at {}: {e}", cfg.backup))?;
    let _ = s.set_nodelay(true);
    let hello = Hello {
        protocol: PROTOCOL_VERSION,
        state_version: nl_vmm::state::STATE_VERSION,
        mem_bytes: vm.memory().size(),
        vcpus: vm.config().vcpus,
        secret: cfg.secret.clone(),
    };
    let body = serde_json::to_vec(&hello).map_err(|e| e.to_string())?;
    write_frame(&mut s, Kind::Hello, 0, 0, &[&body]).map_err(|e| format!("hello: {e}"))?;
    s.set_read_timeout(Some(cfg.lease)).map_err(|e| e.to_string())?;
    let f = read_frame(&mut s).map_err(|e| format!("no answer from the backup: {e}"))?;
    match f.kind {
        Kind::Welcome => {}
        Kind::Refuse => {
            return Err(format!(
                "the backup refused this primary: {}",
                String::from_utf8_lossy(&f.payload)
            ))
        }
        k => return Err(format!("unexpected {k:?} from the backup")),
    }
    s.set_read_timeout(None).map_err(|e| e.to_string())?;
    // A send into a silent link must not block past the lease.
    s.set_write_timeout(Some(cfg.lease)).map_err(|e| e.to_string())?;
    let mut reader = s.try_clone().map_err(|e| e.to_string())?;
    let (tx, frames) = mpsc::sync_channel(64);
    std::thread::Builder::new()
        .name("repl-acks".into())
        .spawn(move || loop {
            let r = read_frame(&mut reader);
            let end = r.is_err();
            if tx.send(r).is_err() || end {
                break;
            }
        })
        .map_err(|e| format!("cannot start the ack thread: {e}"))?;
    Ok(Conn { s, frames, last_heard: Instant::now() })
}

/// Host view of guest RAM for sending pages without copying them.
struct RamView {
    regions: Vec<(u64, u64, u64)>, // gpa, size, host address
}

impl RamView {
    fn new(m: &GuestMemory) -> Self {
        Self {
            regions: m
                .regions()
                .iter()
                .zip(m.host_addrs())
                .map(|(r, h)| (r.gpa, r.size, h))
                .collect(),
        }
    }

    /// The bytes of guest RAM `[gpa, gpa + len)`; call only with the vCPUs
    /// paused (devices run on vCPU threads, so nothing writes meanwhile).
    fn slice(&self, gpa: u64, len: usize) -> Result<&[u8], String> {
        let &(rg, _, host) = self
            .regions
            .iter()
            .find(|&&(g, sz, _)| gpa >= g && gpa + len as u64 <= g + sz)
            .ok_or_else(|| format!("{gpa:#x}+{len:#x} is not guest RAM"))?;
        // SAFETY: the range lies inside a live MAP_SHARED mapping owned by the VM (checked above); vCPUs are paused.
        Ok(unsafe { std::slice::from_raw_parts((host + gpa - rg) as *const u8, len) })
    }

    fn contains(&self, gpa: u64) -> bool {
        self.regions.iter().any(|&(g, sz, _)| gpa >= g && gpa < g + sz)
    }
}

/// Sorted page addresses coalesced into (gpa, pages) runs of at most `max`.
fn runs(pages: &[u64], max: u32) -> Vec<(u64, u32)> {
    let mut out: Vec<(u64, u32)> = Vec::new();
    for &g in pages {
        match out.last_mut() {
            Some((s, n)) if *s + u64::from(*n) * PAGE as u64 == g && *n < max => *n += 1,
            _ => out.push((g, 1)),
        }
    }
    out
}

/// Sends one epoch: `Pages` frames for `runs` (data from `data(gpa, len)`),
/// then the `EpochEnd` with `state`. Returns bytes sent.
fn send_epoch<'a>(
    s: &mut impl Write,
    epoch: u64,
    runs: &[(u64, u32)],
    mut data: impl FnMut(u64, usize) -> Result<&'a [u8], String>,
    state: &[u8],
) -> Result<u64, String> {
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
        for p in &parts {
            crc.update(p);
            bytes += p.len() as u64;
        }
        write_frame(s, Kind::Pages, epoch, seq, &parts).map_err(|e| e.to_string())?;
        seq += 1;
        pages += n as u64;
    }
    let end = EpochEnd { frames: seq, pages, data_crc: crc.finalize(), state: Vec::new() };
    write_frame(s, Kind::EpochEnd, epoch, 0, &[&end.encode_head(), state])
        .map_err(|e| e.to_string())?;
    s.flush().map_err(|e| e.to_string())?;
    Ok(bytes + state.len() as u64)
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
            Ok(Ok(f)) => {
                c.last_heard = Instant::now();
                match f.kind {
                    Kind::Ack if f.epoch == epoch => return Ok(()),
                    Kind::Ack | Kind::Heartbeat => {}
                    Kind::Takeover => {
                        return Err(Lost::Silent("the backup announced that it takes over".into()))
                    }
                    Kind::Refuse => {
                        return Err(Lost::Definitive(format!(
                            "the backup refused the stream: {}",
                            String::from_utf8_lossy(&f.payload)
                        )))
                    }
                    k => return Err(Lost::Definitive(format!("unexpected {k:?} from the backup"))),
                }
            }
            Ok(Err(ProtoError::Timeout)) => {}
            Ok(Err(e @ (ProtoError::Bad(_) | ProtoError::Version { .. }))) => {
                return Err(Lost::Definitive(format!("bad frame from the backup: {e}")))
            }
            Ok(Err(e)) => return Err(Lost::Definitive(format!("backup connection: {e}"))),
        }
    }
}

/// Pages to ship at an epoch boundary (the VM paused): the KVM dirty log,
/// re-protected selectively when asked, plus pages the VMM wrote.
fn collect(vm: &Vm, opts: Options, view: &RamView) -> Result<(Vec<u64>, u64, u64), String> {
    let bitmaps = vm.dirty_bitmaps().map_err(|e| e.to_string())?;
    if opts.selective {
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
    let faults = pages.len() as u64;
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
    Ok((pages, faults, vmm))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The primary side of a replicated run.
pub struct Primary<'a> {
    vm: &'a Vm,
    cfg: PrimaryConfig,
    view: RamView,
    conn: Option<Conn>,
    epoch: u64,
    rep: PrimaryReport,
    log: &'a mut dyn FnMut(String),
    // sums for averages
    pauses: Vec<f64>,
    sums: [f64; 6], // collect, copy, send_in_pause, send_after, ack_wait, pages
    faults: u64,
    /// The copy-mode buffer, kept across epochs (no page faults on reuse).
    buf: Vec<u8>,
}

impl<'a> Primary<'a> {
    pub fn new(vm: &'a Vm, cfg: PrimaryConfig, log: &'a mut dyn FnMut(String)) -> Self {
        let rep =
            PrimaryReport { epoch_ms: ms(cfg.epoch), options: cfg.opts, ..Default::default() };
        Self {
            view: RamView::new(vm.memory()),
            vm,
            cfg,
            conn: None,
            epoch: 0,
            rep,
            log,
            pauses: Vec::new(),
            sums: [0.0; 6],
            faults: 0,
            buf: Vec::new(),
        }
    }

    /// Starts the VM, makes the full copy and runs epochs until the VM ends,
    /// the time limit passes, or the primary fences itself.
    pub fn run(mut self) -> Result<PrimaryReport, String> {
        let vm = self.vm;
        let conn = connect(&self.cfg, vm)?;
        if self.cfg.opts.selective {
            vm.enable_manual_dirty_protect().map_err(|e| e.to_string())?;
        }
        vm.set_dirty_logging(true).map_err(|e| e.to_string())?;
        vm.track_vmm_writes(true);
        vm.hold_net_output(true);
        vm.start().map_err(|e| e.to_string())?;
        vm.pause();
        self.conn = Some(conn);
        let r = self.full_copy();
        vm.resume();
        if let Err(l) = r {
            self.lost(l)?;
        }
        let start = Instant::now();
        let mut next = Instant::now() + self.cfg.epoch;
        loop {
            let now = Instant::now();
            if next > now {
                std::thread::sleep(next - now);
            }
            next = Instant::now() + self.cfg.epoch;
            if self.conn.is_none() && self.cfg.reattach && !self.rep.fenced {
                self.try_reattach();
            }
            vm.pause();
            let outcome = vm.poll_outcome();
            let timed_out = start.elapsed() > self.cfg.time_limit;
            if self.conn.is_some() {
                if let Err(l) = self.epoch_boundary() {
                    if self.lost(l)? {
                        return Ok(self.finish(None));
                    }
                }
            } else {
                vm.resume();
            }
            if outcome.is_some() || timed_out {
                let outcome = outcome.unwrap_or_else(|| {
                    vm.stop();
                    VmOutcome::TimedOut { limit_ms: self.cfg.time_limit.as_millis() as u64 }
                });
                if let Some(c) = self.conn.as_mut() {
                    let _ = write_frame(
                        &mut c.s,
                        Kind::Done,
                        self.epoch,
                        0,
                        &[outcome.message().as_bytes()],
                    );
                }
                return Ok(self.finish(Some(outcome)));
            }
        }
    }

    fn finish(mut self, outcome: Option<VmOutcome>) -> PrimaryReport {
        let n = self.pauses.len().max(1) as f64;
        let r = &mut self.rep;
        r.epochs = self.pauses.len() as u64;
        r.pause_ms_avg = self.pauses.iter().sum::<f64>() / n;
        r.pause_ms_max = self.pauses.iter().copied().fold(0.0, f64::max);
        r.collect_ms_avg = self.sums[0] / n;
        r.copy_ms_avg = self.sums[1] / n;
        r.send_in_pause_ms_avg = self.sums[2] / n;
        r.send_after_ms_avg = self.sums[3] / n;
        r.ack_wait_ms_avg = self.sums[4] / n;
        r.pages_per_epoch = self.sums[5] / n;
        r.write_faults_per_epoch = self.faults as f64 / n;
        r.outcome = outcome;
        self.rep
    }

    /// Handles a lost backup. Returns true when the primary fenced itself.
    fn lost(&mut self, l: Lost) -> Result<bool, String> {
        // A closed connection after a silence longer than the lease may be
        // a backup that already took over: never go on unprotected then.
        let silent_too_long =
            self.conn.as_ref().is_some_and(|c| c.last_heard.elapsed() > self.cfg.lease);
        // A takeover notice may wait behind the error that brought us here.
        let took_over = self.conn.as_ref().is_some_and(|c| {
            c.frames.try_iter().any(|f| matches!(f, Ok(Frame { kind: Kind::Takeover, .. })))
        });
        let l = match l {
            Lost::Definitive(why) if took_over => {
                Lost::Silent(format!("{why}; the backup announced that it takes over"))
            }
            l => l,
        };
        let l = match l {
            Lost::Definitive(why) if silent_too_long => {
                Lost::Silent(format!("{why}, after more than a lease of silence"))
            }
            l => l,
        };
        self.conn = None;
        match l {
            Lost::Definitive(why) => {
                (self.log)(format!(
                    "WARNING: backup lost ({why}); the VM keeps running UNPROTECTED. \
                     Start a new backup with `ninelives replicate backup --listen {}`{}",
                    self.cfg.backup,
                    if self.cfg.reattach { " and this primary attaches to it" } else { "" }
                ));
                self.rep.backup_lost = Some(why);
                self.rep.unprotected = true;
                // Output no longer waits for anyone.
                let held = self.vm.hold_net_output(false);
                self.rep.frames_released += held.len() as u64;
                self.vm.release_net_output(&held);
                Ok(false)
            }
            Lost::Silent(why) => {
                (self.log)(format!(
                    "FENCED: {why}; the backup may have taken over, so this primary stops \
                     its VM and releases no more output"
                ));
                self.rep.backup_lost = Some(why);
                self.rep.fenced = true;
                self.vm.stop();
                let _ = self.vm.hold_net_output(true); // held output is dropped
                Ok(true)
            }
        }
    }

    fn try_reattach(&mut self) {
        let Ok(c) = connect(&self.cfg, self.vm) else { return };
        (self.log)(format!("backup at {} attached again: full copy", self.cfg.backup));
        self.conn = Some(c);
        self.epoch = 0;
        self.rep.unprotected = false;
        self.rep.reattached += 1;
        self.vm.hold_net_output(true);
        self.vm.pause();
        let r = self.full_copy();
        self.vm.resume();
        if let Err(l) = r {
            let _ = self.lost(l);
        }
    }

    /// Epoch 0: every allocated page, with the VM paused; waits for the ack.
    fn full_copy(&mut self) -> Result<(), Lost> {
        let t = Instant::now();
        let vm = self.vm;
        // Reset the logs: tracking starts at this copy.
        collect(vm, self.cfg.opts, &self.view).map_err(Lost::Definitive)?;
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
        let c = self.conn.as_mut().expect("connected");
        let view = &self.view;
        let runs = runs(&pages, PAGES_PER_FRAME as u32);
        let bytes = send_epoch(&mut c.s, 0, &runs, |g, l| view.slice(g, l), &state)
            .map_err(Lost::Definitive)?;
        self.rep.bytes_sent += bytes;
        wait_ack(c, 0, self.cfg.lease)?;
        self.rep.full_copy_pages = pages.len() as u64;
        self.rep.full_copy_ms = ms(t.elapsed());
        self.epoch = 1;
        Ok(())
    }

    /// One epoch boundary; the VM is paused on entry and running on return.
    fn epoch_boundary(&mut self) -> Result<(), Lost> {
        let vm = self.vm;
        let t0 = Instant::now();
        let r = (|| {
            let (pages, faults, vmm) = collect(vm, self.cfg.opts, &self.view)?;
            let state = vm.save_state().map_err(|e| e.to_string())?.to_bytes();
            let out = vm.take_net_output();
            Ok::<_, String>((pages, faults, vmm, state, out))
        })();
        let (pages, faults, vmm, state, out) = match r {
            Ok(x) => x,
            Err(e) => {
                vm.resume();
                return Err(Lost::Definitive(format!("collecting the epoch: {e}")));
            }
        };
        let t_collect = t0.elapsed();
        let epoch = self.epoch;
        let c = self.conn.as_mut().expect("connected");
        let (copy, send_in, send_after, bytes);
        let send_res;
        if self.cfg.opts.direct {
            let view = &self.view;
            let rr = runs(&pages, PAGES_PER_FRAME as u32);
            let t = Instant::now();
            send_res = send_epoch(&mut c.s, epoch, &rr, |g, l| view.slice(g, l), &state);
            send_in = t.elapsed();
            copy = Duration::ZERO;
            vm.resume();
            send_after = Duration::ZERO;
        } else {
            let t = Instant::now();
            let buf = &mut self.buf;
            buf.clear();
            let mut copy_err = None;
            for &g in &pages {
                match self.view.slice(g, PAGE) {
                    Ok(s) => buf.extend_from_slice(s),
                    Err(e) => copy_err = Some(e),
                }
            }
            copy = t.elapsed();
            send_in = Duration::ZERO;
            vm.resume();
            if let Some(e) = copy_err {
                return Err(Lost::Definitive(format!("copying the epoch: {e}")));
            }
            let t = Instant::now();
            let rr: Vec<(u64, u32)> = pages.iter().map(|&g| (g, 1)).collect();
            let mut at = 0usize;
            send_res = send_epoch(
                &mut c.s,
                epoch,
                &rr,
                |_, l| {
                    let s = &buf[at..at + l];
                    at += l;
                    Ok(s)
                },
                &state,
            );
            send_after = t.elapsed();
        }
        let pause = t_collect + copy + send_in;
        bytes = send_res.map_err(|e| Lost::Definitive(format!("sending epoch {epoch}: {e}")))?;
        let t = Instant::now();
        let acked = wait_ack(c, epoch, self.cfg.lease);
        let ack_wait = t.elapsed();
        // Output commit: the epoch's frames leave only once the backup has it.
        if acked.is_ok() {
            self.rep.frames_released += out.len() as u64;
            vm.release_net_output(&out);
        }
        self.pauses.push(ms(pause));
        self.sums[0] += ms(t_collect);
        self.sums[1] += ms(copy);
        self.sums[2] += ms(send_in);
        self.sums[3] += ms(send_after);
        self.sums[4] += ms(ack_wait);
        self.sums[5] += pages.len() as f64;
        self.faults += faults;
        self.rep.vmm_written_pages += vmm;
        self.rep.bytes_sent += bytes;
        self.epoch += 1;
        match acked {
            Ok(()) => Ok(()),
            Err(Lost::Definitive(w)) => {
                // The backup is gone for sure: this epoch's output may go.
                self.rep.frames_released += out.len() as u64;
                vm.release_net_output(&out);
                Err(Lost::Definitive(w))
            }
            Err(l) => Err(l),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::runs;

    #[test]
    fn runs_coalesce_and_split() {
        assert_eq!(runs(&[0x1000, 0x2000, 0x3000, 0x5000], 8), vec![(0x1000, 3), (0x5000, 1)]);
        assert_eq!(runs(&[0, 0x1000, 0x2000], 2), vec![(0, 2), (0x2000, 1)]);
    }
}
