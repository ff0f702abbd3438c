//! COLO's secondary VM, on the backup: a VM over a private copy-on-write
//! view of the backup's memory ([`GuestMemory::private_copy`]) that runs
//! alongside the primary's VM on the same input, so that the primary can
//! release a reply as soon as the secondary has sent the same one
//! ([`crate::colo::Comparator`]), without waiting for an epoch.
//!
//! * **Input.** The primary forwards each frame its guest received
//!   ([`crate::protocol::Kind::ColoIn`]). The backup's receive thread
//!   writes it into a socket pair that stands in for the secondary's TAP
//!   ([`nl_devices::tap::Tap::over_socket`]) and moves it into the guest's
//!   receive buffers at once ([`Feed::input`]).
//! * **Output.** Every frame the secondary's guest sends goes to an output
//!   hook on its vCPU thread (it never reaches a network), tagged with the
//!   secondary's generation; the backup queues it for a thread that sends
//!   it to the primary ([`crate::protocol::Kind::ColoOut`]).
//! * **Checkpoints.** When the backup commits an epoch, the secondary
//!   becomes that epoch again: paused, its own writes dropped
//!   ([`GuestMemory::reset_private`]), its state loaded, input still in
//!   flight thrown away, and its generation moved on, so that input and
//!   output from before the reset are never taken for what follows it.
//! * **Failover.** The secondary has run every input the primary's guest
//!   received and sent every reply the primary released, so it, not the
//!   last checkpoint, is what takes over ([`Secondary::into_vm`]).
//!
//! [`GuestMemory::private_copy`]: nl_memory::GuestMemory::private_copy
//! [`GuestMemory::reset_private`]: nl_memory::GuestMemory::reset_private

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use nl_vmm::state::VmState;
use nl_vmm::{Vm, VmOutcome};

/// Where the secondary's output goes: (generation, frame), called on the
/// secondary's vCPU thread as the guest transmits.
pub type OutputSink = Box<dyn Fn(u64, &[u8]) + Send + Sync>;

/// Counts of one secondary's life.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct SecondaryStats {
    pub frames_in: u64,
    /// Input for an older generation (sent before a checkpoint reached
    /// the secondary), dropped.
    pub stale_in: u64,
    /// Input the socket pair did not take (its buffer full), dropped.
    pub dropped_in: u64,
    pub checkpoints: u64,
    /// Mean time of a checkpoint on the secondary (pause, reset, load).
    pub checkpoint_ms_avg: f64,
}

/// Where the primary's input goes into the secondary: shared with the
/// backup's receive thread, which feeds each frame as it reads it.
pub struct Feed {
    /// The end of the socket pair the VMM writes into.
    file: File,
    /// The generation: input tagged with it is taken. Held while a
    /// checkpoint moves it on, so no input of the old generation gets in
    /// after the reset.
    gen: Mutex<u64>,
    /// The generation the secondary's output is tagged with; moved on with
    /// the vCPUs paused.
    out_gen: AtomicU64,
    /// The VM, to deliver each frame at once; `None` once handed over.
    vm: Weak<Vm>,
    closed: AtomicBool,
    frames_in: AtomicU64,
    stale_in: AtomicU64,
    dropped_in: AtomicU64,
}

impl Feed {
    /// A frame the primary's guest received, for generation `tag`: into
    /// the secondary's receive buffers now.
    pub fn input(&self, tag: u64, frame: &[u8]) {
        let g = self.gen.lock().unwrap_or_else(|p| p.into_inner());
        if tag != *g || self.closed.load(Ordering::SeqCst) {
            self.stale_in.fetch_add(1, Ordering::Relaxed);
            return;
        }
        // One message per frame: a seqpacket socket takes all of it or none.
        match (&self.file).write(frame) {
            Ok(n) if n == frame.len() => self.frames_in.fetch_add(1, Ordering::Relaxed),
            _ => self.dropped_in.fetch_add(1, Ordering::Relaxed),
        };
        drop(g);
        if let Some(vm) = self.vm.upgrade() {
            vm.service_net_rx();
        }
    }
}

pub struct Secondary {
    /// `None` only once handed over ([`Secondary::into_vm`]).
    vm: Option<Arc<Vm>>,
    feed: Arc<Feed>,
    checkpoints: u64,
    /// Their total time, ms.
    checkpoint_ms: f64,
}

/// A non-blocking `SOCK_SEQPACKET` socket pair.
fn socket_pair() -> Result<(File, File), String> {
    let mut fds = [0; 2];
    // SAFETY: socketpair(2) writes two descriptors into `fds`, an array of
    // two ints that outlives the call; both are checked and owned below.
    let r = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if r < 0 {
        return Err(format!("cannot create a socket pair: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: both descriptors are fresh and owned by nothing else.
    let (a, b) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    Ok((File::from(a), File::from(b)))
}

/// Reads and drops every message waiting on a non-blocking socket
/// (bounded: a full buffer's worth).
fn drain(mut f: &File) {
    let mut buf = vec![0u8; 65536];
    for _ in 0..4096 {
        match f.read(&mut buf) {
            Ok(n) if n > 0 => {}
            _ => break,
        }
    }
}

impl Secondary {
    /// Starts `vm` (built over a [`GuestMemory::private_copy`] of the
    /// backup's memory, with a spare network device and no disk, not
    /// started) from committed epoch `epoch` with `state`; its output goes
    /// to `sink`.
    ///
    /// [`GuestMemory::private_copy`]: nl_memory::GuestMemory::private_copy
    pub fn start(vm: Vm, epoch: u64, state: &VmState, sink: OutputSink) -> Result<Self, String> {
        if !vm.memory().is_private() {
            return Err("the secondary must run over a private copy of the backup's memory".into());
        }
        if vm.config().net.is_none() {
            return Err("the secondary has no network device".into());
        }
        let (feed, device_end) = socket_pair()?;
        let tap = nl_devices::tap::Tap::over_socket(device_end, "colo-secondary");
        vm.attach_tap(tap)
            .map_err(|_| "the secondary's network device has a TAP already".to_string())?;
        vm.restore_state(state).map_err(|e| format!("loading epoch {epoch}: {e}"))?;
        let vm = Arc::new(vm);
        let feed = Arc::new(Feed {
            file: feed,
            gen: Mutex::new(epoch + 1),
            out_gen: AtomicU64::new(epoch + 1),
            vm: Arc::downgrade(&vm),
            closed: AtomicBool::new(false),
            frames_in: AtomicU64::new(0),
            stale_in: AtomicU64::new(0),
            dropped_in: AtomicU64::new(0),
        });
        let f = feed.clone();
        vm.set_net_output_hook(Some(Box::new(move |frame: &[u8]| {
            sink(f.out_gen.load(Ordering::SeqCst), frame)
        })));
        vm.start().map_err(|e| format!("cannot start the secondary: {e}"))?;
        Ok(Secondary { vm: Some(vm), feed, checkpoints: 0, checkpoint_ms: 0.0 })
    }

    /// Where the primary's input goes (the receive thread feeds it).
    pub fn feed(&self) -> Arc<Feed> {
        self.feed.clone()
    }

    /// The backup committed `epoch` with `state`: the secondary becomes it.
    pub fn checkpoint(&mut self, epoch: u64, state: &VmState) -> Result<(), String> {
        let t = std::time::Instant::now();
        let vm = self.vm.as_ref().ok_or("the secondary was handed over")?;
        let mut g = self.feed.gen.lock().unwrap_or_else(|p| p.into_inner());
        vm.pause();
        // What the device wrote into the pair (the gratuitous ARP of each
        // state load) and input not yet taken: gone.
        drain(&self.feed.file);
        if let Some(tap) = vm.take_tap() {
            // Re-attaching drops a frame read but not yet delivered.
            if let Ok(f) = tap.try_clone_file() {
                drain(&f);
            }
            vm.attach_tap(tap).map_err(|_| "the secondary's TAP came back".to_string())?;
        }
        let r = vm
            .memory()
            .reset_private()
            .map_err(|e| e.to_string())
            .and_then(|()| vm.restore_state(state).map_err(|e| e.to_string()));
        *g = epoch + 1;
        self.feed.out_gen.store(epoch + 1, Ordering::SeqCst);
        drop(g);
        vm.resume();
        self.checkpoints += 1;
        self.checkpoint_ms += t.elapsed().as_secs_f64() * 1e3;
        r.map_err(|e| format!("the secondary cannot become epoch {epoch}: {e}"))
    }

    /// Why the secondary's guest stopped, if it failed (an error report,
    /// an exception, a triple fault): it can no longer match anything.
    pub fn failed(&self) -> Option<String> {
        match self.vm.as_ref()?.poll_outcome()? {
            o @ (VmOutcome::GuestError { .. } | VmOutcome::Crashed { .. }) => {
                Some(format!("the secondary VM failed: {}", o.message()))
            }
            _ => None,
        }
    }

    /// A test's fault: vCPU 0's next instruction becomes `ud2`, written into
    /// the secondary's private memory only (the backup's copy keeps its
    /// code). Its guest then fails, as a secondary that diverged into a
    /// crash would.
    pub fn break_guest_for_test(&self) -> Result<u64, String> {
        use vm_memory::{Bytes, GuestAddress};
        let vm = self.vm.as_ref().ok_or("the secondary was handed over")?;
        // Paused, so the instruction written is the one it runs next.
        let _paused = vm.hold_paused();
        let rip = vm
            .with_vcpu(0, |fd| fd.get_regs().map(|r| r.rip))
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("KVM_GET_REGS: {e}"))?;
        vm.memory()
            .mem()
            .write_slice(&[0x0f, 0x0b], GuestAddress(rip))
            .map_err(|e| format!("writing at {rip:#x}: {e}"))?;
        Ok(rip)
    }

    pub fn stats(&self) -> SecondaryStats {
        let f = &self.feed;
        SecondaryStats {
            frames_in: f.frames_in.load(Ordering::Relaxed),
            stale_in: f.stale_in.load(Ordering::Relaxed),
            dropped_in: f.dropped_in.load(Ordering::Relaxed),
            checkpoints: self.checkpoints,
            checkpoint_ms_avg: self.checkpoint_ms / self.checkpoints.max(1) as f64,
        }
    }

    /// Hands over the running VM (failover), paused, its output hook
    /// removed: the caller gives it the real TAP and resumes it.
    pub fn into_vm(mut self) -> Result<Vm, String> {
        self.feed.closed.store(true, Ordering::SeqCst);
        let mut vm = self.vm.take().ok_or("the secondary was handed over")?;
        vm.pause();
        vm.set_net_output_hook(None);
        // The receive thread may hold the VM for a moment (feeding a frame).
        for _ in 0..1000 {
            match Arc::try_unwrap(vm) {
                Ok(v) => return Ok(v),
                Err(v) => vm = v,
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Err("the secondary VM is still shared".into())
    }
}

impl Drop for Secondary {
    /// A secondary not handed over (the backup stands down) stops.
    fn drop(&mut self) {
        self.feed.closed.store(true, Ordering::SeqCst);
        if let Some(vm) = self.vm.take() {
            vm.stop();
        }
    }
}
