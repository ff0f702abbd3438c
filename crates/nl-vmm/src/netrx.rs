//! The virtio-net receive thread (`NetConfig::rx_irq`, experimental): waits
//! on the TAP and moves arriving frames into the guest's posted receive
//! buffers without a guest notify, which raises the device's interrupt
//! (its irqfd), so the guest can halt while idle.
//!
//! Consistency with pauses and stops: the thread only touches the device
//! (and guest memory) with the transport locked and after checking, under
//! that lock, that the VM is neither paused nor stopping. `Vm::pause` and
//! `Vm::stop` raise their flag first and then take and release the lock
//! once ([`barrier`]), so once they return the thread is done with the
//! device until the VM runs again.

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering::Relaxed};
use std::sync::Arc;

use nl_sync::Lock;
use std::thread::JoinHandle;
use std::time::Duration;

use nl_devices::virtio::net::Net;
use nl_devices::virtio::MmioTransport;

use crate::vcpu::RunControl;

pub(crate) type NetTransport = Arc<Lock<MmioTransport<Net>>>;

/// The running thread; ended and joined on drop.
pub(crate) struct RxThread {
    quit: Arc<AtomicBool>,
    /// The thread's id once it runs (0 before): a sandbox's I/O budget
    /// moves it into its cgroup.
    pub(crate) tid: Arc<AtomicI32>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for RxThread {
    fn drop(&mut self) {
        self.quit.store(true, Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Waits up to `ms` for the TAP to become readable.
fn wait_readable(fd: std::os::fd::RawFd, ms: i32) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: polls one valid pollfd that lives across the call.
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    n > 0 && p.revents & libc::POLLIN != 0
}

pub(crate) fn spawn(vm: u32, net: NetTransport, run: Arc<RunControl>) -> std::io::Result<RxThread> {
    let quit = Arc::new(AtomicBool::new(false));
    let q = quit.clone();
    let tid = Arc::new(AtomicI32::new(0));
    let t_id = tid.clone();
    let fd = net.lock().device().tap_fd().ok_or_else(|| {
        std::io::Error::other("a spare virtio-net device has no TAP to receive from")
    })?;
    let thread = std::thread::Builder::new().name(format!("vm{vm}-netrx")).spawn(move || {
        t_id.store(nl_sync::tid(), std::sync::atomic::Ordering::SeqCst);
        crate::seccomp::apply(crate::seccomp::Kind::Device);
        let _reg = crate::recovery::enter(false);
        // A frame half delivered when a microreset discards this thread is
        // lost, as on a real link; the loop starts over.
        while !q.load(Relaxed) {
            let _ = crate::recovery::protected(|| {
                while !q.load(Relaxed) {
                    // Bounded waits, so `quit` is seen within 10 ms.
                    if !crate::recovery::safe(|| wait_readable(fd, 10)) {
                        continue;
                    }
                    let pending = {
                        let mut t = net.lock();
                        if run.paused() || run.stopping() {
                            None
                        } else {
                            t.service(0);
                            Some(t.device().rx_pending())
                        }
                    };
                    match pending {
                        // Paused or stopping, or no receive buffer free: the frame
                        // waits; do not spin on a readable TAP.
                        None | Some(true) => {
                            crate::recovery::safe(|| std::thread::sleep(Duration::from_micros(200)))
                        }
                        Some(false) => {}
                    }
                }
            });
        }
    })?;
    Ok(RxThread { quit, tid, thread: Some(thread) })
}

/// Takes and releases the transport lock: any device work the thread began
/// before the caller raised its pause or stop flag is finished.
pub(crate) fn barrier(net: &NetTransport) {
    drop(net.lock());
}
