//! virtio-net backed by a host TAP interface.
//!
//! Queue 0 receives, queue 1 transmits. Transmit is served when the driver
//! notifies queue 1: each chain's frame (after the 12-byte virtio-net
//! header) goes to the TAP. Receive is driven by the driver too: a notify of
//! queue 0 (or 1) moves the frames waiting on the TAP into the posted
//! receive buffers, so a polling ring-3 driver needs no interrupts. A frame
//! that finds no buffer waits in the device for the next notify.
//!
//! A device may also be a *spare* ([`Net::spare`]): no TAP behind it, its
//! link down (config status, `VIRTIO_NET_F_STATUS`), frames sent to it
//! dropped. [`Net::attach`] gives it a TAP (a standby sandbox taking over a
//! service, `nl_sandbox::service`) and [`Net::detach`] takes it away.

use std::time::Instant;

use virtio_bindings::virtio_net::{VIRTIO_NET_F_MAC, VIRTIO_NET_F_STATUS, VIRTIO_NET_S_LINK_UP};
use virtio_queue::{desc::split::Descriptor, Queue, QueueT};
use vm_memory::{Bytes, GuestMemory, Permissions};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::{collect_chain, for_each_chain, GuestMem, QueueError, VirtioDevice};
use crate::tap::Tap;

/// virtio_net_hdr_v1 (VIRTIO_F_VERSION_1): 12 bytes in front of every frame.
pub const NET_HDR_BYTES: usize = 12;
pub const QUEUE_SIZE: u16 = 256;
/// Largest frame accepted from the guest (Ethernet, no offloads).
const MAX_FRAME: usize = 1514;
const MAX_CHAIN: usize = 16;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct NetStats {
    pub tx_frames: u64,
    pub rx_frames: u64,
    /// Frames dropped: malformed or oversized from the guest, TAP errors.
    pub dropped: u64,
    /// Gratuitous ARPs sent for the guest after a restore, failover or
    /// takeover ([`Net::announce`]).
    pub announcements: u64,
    /// Gratuitous ARPs the guest itself sent (ARP, sender address equal to
    /// the target address): a standby announcing a service it took over.
    pub guest_announcements: u64,
}

/// Whether `frame` is a gratuitous ARP (an ARP whose sender protocol
/// address is its target protocol address).
pub fn is_gratuitous_arp(frame: &[u8]) -> bool {
    frame.len() >= 42 && frame[12..14] == [0x08, 0x06] && frame[28..32] == frame[38..42]
}

/// An ARP announcement (RFC 5227 section 2.3, a "gratuitous ARP"): a
/// broadcast ARP request from `mac` whose sender and target address are
/// both `ip`. Switches learn where `mac` now is and neighbours refresh
/// `ip`'s entry, as QEMU's announce does after a migration.
pub fn gratuitous_arp(mac: [u8; 6], ip: [u8; 4]) -> [u8; 42] {
    let mut f = [0u8; 42];
    f[0..6].copy_from_slice(&[0xff; 6]); // broadcast
    f[6..12].copy_from_slice(&mac);
    f[12..14].copy_from_slice(&0x0806u16.to_be_bytes()); // ARP
    f[14..16].copy_from_slice(&1u16.to_be_bytes()); // Ethernet
    f[16..18].copy_from_slice(&0x0800u16.to_be_bytes()); // IPv4
    f[18] = 6;
    f[19] = 4;
    f[20..22].copy_from_slice(&1u16.to_be_bytes()); // request
    f[22..28].copy_from_slice(&mac);
    f[28..32].copy_from_slice(&ip);
    // Target hardware address zero, target protocol address the same IP.
    f[38..42].copy_from_slice(&ip);
    f
}

pub struct Net {
    /// `None`: a spare device, link down.
    tap: Option<Tap>,
    mac: [u8; 6],
    pending: Option<Vec<u8>>,
    buf: Vec<u8>,
    stats: NetStats,
    /// Guest ranges written by receive since the last `take_written`.
    written: Vec<(u64, u64)>,
    /// Output commit: while set, transmitted frames wait here instead of
    /// going to the TAP, until the VMM releases them.
    held: Option<Vec<Vec<u8>>>,
    /// When the oldest frame in `held` was held (`None`: nothing held).
    held_since: Option<Instant>,
    /// Signalled each time a transmitted frame is held: output waits for
    /// its epoch to end (replication's output-triggered epochs); under
    /// COLO also for each delivered frame copied for the secondary.
    output_event: Option<EventFd>,
    /// COLO: while set, a copy of each frame delivered to the guest waits
    /// here for the VMM to forward it to the secondary VM (and the output
    /// event is signalled).
    input_copies: Option<Vec<Vec<u8>>>,
    /// COLO's secondary: each transmitted frame goes here (at once, on the
    /// transmitting thread) instead of to the TAP or the held frames.
    output_hook: Option<OutputHook>,
}

/// Where a device with an output hook sends its frames ([`Net::set_output_hook`]).
pub type OutputHook = Box<dyn FnMut(&[u8]) + Send>;

impl Net {
    pub fn new(tap: Tap, mac: [u8; 6]) -> Self {
        let mut n = Net::spare(mac);
        n.tap = Some(tap);
        n
    }

    /// A device with no TAP behind it (link down) until [`Net::attach`].
    pub fn spare(mac: [u8; 6]) -> Self {
        Net {
            tap: None,
            mac,
            pending: None,
            buf: vec![0; 65536],
            stats: NetStats::default(),
            written: Vec::new(),
            held: None,
            held_since: None,
            output_event: None,
            input_copies: None,
            output_hook: None,
        }
    }

    /// Holds transmitted frames (output commit) or, with `false`, sends them
    /// straight to the TAP again (frames already held are returned).
    pub fn hold_output(&mut self, on: bool) -> Vec<Vec<u8>> {
        let old = if on { self.held.replace(Vec::new()) } else { self.held.take() };
        self.held_since = None;
        old.unwrap_or_default()
    }

    /// Takes the frames held since the last call (the epoch that just ended).
    pub fn take_held(&mut self) -> Vec<Vec<u8>> {
        self.held_since = None;
        self.held.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// When the oldest frame not yet taken ([`Net::take_held`]) was held;
    /// `None` when no frame waits.
    pub fn held_since(&self) -> Option<Instant> {
        self.held_since
    }

    /// An eventfd (non-blocking) the device signals each time it holds a
    /// transmitted frame, so a waiter learns at once that output waits,
    /// without polling. Every call returns a handle to the same eventfd.
    pub fn output_event(&mut self) -> std::io::Result<EventFd> {
        if self.output_event.is_none() {
            self.output_event = Some(EventFd::new(EFD_NONBLOCK)?);
        }
        self.output_event.as_ref().expect("made above").try_clone()
    }

    /// Sends every frame the guest transmits to `hook` from now on, on the
    /// transmitting thread, instead of to the TAP or the held frames
    /// (`None`: as before).
    pub fn set_output_hook(&mut self, hook: Option<OutputHook>) {
        self.output_hook = hook;
    }

    /// Keeps a copy of each frame delivered to the guest from now on
    /// ([`Net::take_input`]), or with `false` stops and drops the copies.
    pub fn copy_input(&mut self, on: bool) {
        self.input_copies = on.then(Vec::new);
    }

    /// The frames delivered to the guest since the last call, in order.
    pub fn take_input(&mut self) -> Vec<Vec<u8>> {
        self.input_copies.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Sends frames (held earlier) to the TAP.
    pub fn release(&mut self, frames: &[Vec<u8>]) {
        for f in frames {
            if !self.tap.as_mut().is_some_and(|t| t.send(f)) {
                self.stats.dropped += 1;
            }
        }
    }

    pub fn stats(&self) -> NetStats {
        self.stats
    }

    /// Announces the guest at `ip` on the TAP with a gratuitous ARP from
    /// its MAC, straight to the TAP (never held: it is the VMM's frame, not
    /// guest output). False if the TAP did not take it.
    pub fn announce(&mut self, ip: [u8; 4]) -> bool {
        let frame = gratuitous_arp(self.mac, ip);
        let ok = self.tap.as_mut().is_some_and(|t| t.send(&frame));
        if ok {
            self.stats.announcements += 1;
        } else {
            self.stats.dropped += 1;
        }
        ok
    }

    /// The TAP's file descriptor (to wait for frames on); `None` for a
    /// spare.
    pub fn tap_fd(&self) -> Option<std::os::fd::RawFd> {
        self.tap.as_ref().map(Tap::raw_fd)
    }

    /// Puts `tap` behind the device (link up); the TAP it had, if any, is
    /// returned. A frame read from the old TAP and not yet delivered is
    /// dropped with it.
    pub fn attach(&mut self, tap: Tap) -> Option<Tap> {
        self.pending = None;
        self.tap.replace(tap)
    }

    /// Takes the TAP away (link down), e.g. to attach it to another VM's
    /// device; the device keeps running as a spare.
    pub fn detach(&mut self) -> Option<Tap> {
        self.pending = None;
        self.tap.take()
    }

    /// Whether a TAP is behind the device.
    pub fn attached(&self) -> bool {
        self.tap.is_some()
    }

    /// Whether a frame read from the TAP still waits for a receive buffer.
    pub fn rx_pending(&self) -> bool {
        self.pending.is_some()
    }

    fn transmit(&mut self, mem: &GuestMem, descs: &[Descriptor]) {
        let mut frame = Vec::with_capacity(MAX_FRAME + NET_HDR_BYTES);
        for d in descs {
            let n = d.len() as usize;
            if d.is_write_only()
                || frame.len() + n > MAX_FRAME + NET_HDR_BYTES
                || !mem.check_range(d.addr(), n, Permissions::Read)
            {
                self.stats.dropped += 1;
                return;
            }
            let at = frame.len();
            frame.resize(at + n, 0);
            if mem.read_slice(&mut frame[at..], d.addr()).is_err() {
                self.stats.dropped += 1;
                return;
            }
        }
        if frame.len() <= NET_HDR_BYTES {
            self.stats.dropped += 1;
            return;
        }
        if let Some(h) = self.output_hook.as_mut() {
            h(&frame[NET_HDR_BYTES..]);
        } else if let Some(held) = self.held.as_mut() {
            held.push(frame[NET_HDR_BYTES..].to_vec());
            self.held_since.get_or_insert_with(Instant::now);
            if let Some(e) = &self.output_event {
                // A full counter (never, at 2^64 - 2) only means it is
                // signalled already.
                let _ = e.write(1);
            }
        } else if !self.tap.as_mut().is_some_and(|t| t.send(&frame[NET_HDR_BYTES..])) {
            self.stats.dropped += 1;
            return;
        }
        if is_gratuitous_arp(&frame[NET_HDR_BYTES..]) {
            self.stats.guest_announcements += 1;
        }
        self.stats.tx_frames += 1;
    }

    /// Moves waiting frames into posted receive buffers.
    fn receive(&mut self, queue: &mut Queue, mem: &GuestMem) -> Result<bool, QueueError> {
        let mut used = false;
        for _ in 0..queue.size() {
            if self.pending.is_none() {
                let Some(tap) = self.tap.as_mut() else { break };
                match tap.recv(&mut self.buf) {
                    Ok(Some(n)) => self.pending = Some(self.buf[..n].to_vec()),
                    Ok(None) => break,
                    Err(_) => break,
                }
            }
            let Some(chain) = super::next_chain(queue, mem)? else { break };
            let (head, descs) = collect_chain(chain, MAX_CHAIN)?;
            let frame = self.pending.take().unwrap_or_default();
            let mut hdr = [0u8; NET_HDR_BYTES];
            hdr[10] = 1; // num_buffers
            let mut data = hdr.iter().chain(frame.iter()).copied();
            let total = NET_HDR_BYTES + frame.len();
            let mut written = 0usize;
            for d in &descs {
                let n = (d.len() as usize).min(total - written);
                if n == 0 {
                    break;
                }
                if !d.is_write_only() || !mem.check_range(d.addr(), n, Permissions::Write) {
                    return Err(QueueError(format!(
                        "receive buffer at {head} is not writable guest memory"
                    )));
                }
                let chunk: Vec<u8> = data.by_ref().take(n).collect();
                mem.write_slice(&chunk, d.addr())
                    .map_err(|e| QueueError(format!("cannot write a receive buffer: {e}")))?;
                self.written.push((d.addr().0, chunk.len() as u64));
                written += n;
            }
            if written < total {
                // The buffers were too small: the frame is lost.
                self.stats.dropped += 1;
            } else {
                self.stats.rx_frames += 1;
                if let Some(c) = self.input_copies.as_mut() {
                    c.push(frame);
                    if let Some(e) = &self.output_event {
                        let _ = e.write(1);
                    }
                }
            }
            queue
                .add_used(mem, head, written as u32)
                .map_err(|e| QueueError(format!("cannot write the used ring: {e}")))?;
            used = true;
        }
        Ok(used)
    }
}

impl VirtioDevice for Net {
    fn name(&self) -> &str {
        "virtio-net"
    }

    fn device_id(&self) -> u32 {
        1
    }

    fn features(&self) -> u64 {
        (1 << VIRTIO_NET_F_MAC) | (1 << VIRTIO_NET_F_STATUS)
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE, QUEUE_SIZE]
    }

    /// A frame already read from the TAP but not yet delivered is part of
    /// the device's state: a handover or restore must not drop it.
    fn save(&self) -> serde_json::Value {
        serde_json::json!({ "pending": self.pending })
    }

    fn restore(&mut self, state: &serde_json::Value) -> Result<(), String> {
        let pending = match state.get("pending") {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => {
                let f: Vec<u8> = serde_json::from_value(v.clone())
                    .map_err(|e| format!("bad pending receive frame: {e}"))?;
                if f.len() > self.buf.len() {
                    return Err(format!("pending receive frame of {} bytes is too big", f.len()));
                }
                Some(f)
            }
        };
        self.pending = pending;
        Ok(())
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let mut cfg = [0u8; 8];
        cfg[..6].copy_from_slice(&self.mac);
        // status (VIRTIO_NET_F_STATUS): the link is up while a TAP is behind.
        let status = if self.tap.is_some() { VIRTIO_NET_S_LINK_UP as u16 } else { 0 };
        cfg[6..8].copy_from_slice(&status.to_le_bytes());
        for (i, b) in data.iter_mut().enumerate() {
            *b = (offset as usize).checked_add(i).and_then(|k| cfg.get(k)).copied().unwrap_or(0);
        }
    }

    fn process(
        &mut self,
        idx: usize,
        queue: &mut Queue,
        mem: &GuestMem,
    ) -> Result<bool, QueueError> {
        match idx {
            1 => for_each_chain(queue, mem, |c| {
                let (head, descs) = collect_chain(c, MAX_CHAIN)?;
                self.transmit(mem, &descs);
                Ok((head, 0))
            }),
            _ => self.receive(queue, mem),
        }
    }

    fn take_written(&mut self, out: &mut Vec<(u64, u64)>) {
        out.append(&mut self.written);
    }

    fn stats(&self) -> serde_json::Value {
        serde_json::to_value(self.stats).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net() -> Net {
        Net::new(Tap::for_test(std::fs::File::open("/dev/null").unwrap()), [0; 6])
    }

    #[test]
    fn a_pending_receive_frame_survives_save_and_restore() {
        let mut a = net();
        a.pending = Some(vec![1, 2, 3]);
        let saved = a.save();
        let mut b = net();
        b.restore(&saved).unwrap();
        assert_eq!(b.pending, Some(vec![1, 2, 3]));
        // Nothing pending, and state from before the field existed.
        b.restore(&net().save()).unwrap();
        assert!(!b.rx_pending());
        b.restore(&serde_json::Value::Null).unwrap();
        // Bad state is refused, not trusted.
        let big = serde_json::json!({ "pending": vec![0u8; 70000] });
        assert!(b.restore(&big).unwrap_err().contains("too big"));
        assert!(b.restore(&serde_json::json!({ "pending": "x" })).is_err());
    }

    /// A virtio-net device driven through its MMIO transport like a guest
    /// driver would, over 1 MiB of guest memory, its TAP replaced by one end
    /// of a datagram socket pair (frame boundaries kept): the test reads
    /// what the device sends and writes what it should receive on `peer`.
    mod driven {
        use super::super::*;
        use crate::bus::Device;
        use crate::virtio::{regs, MmioTransport, STATUS_NEEDS_RESET};
        use std::os::unix::net::UnixDatagram;
        use vm_memory::{Address, GuestAddress, GuestMemoryMmap};

        const MEM: u64 = 1 << 20;
        const QSIZE: u16 = 16;
        /// (descriptor table, avail ring, used ring) of queue 0 (receive)
        /// and queue 1 (transmit).
        const RINGS: [(u64, u64, u64); 2] = [(0x1000, 0x2000, 0x3000), (0x5000, 0x6000, 0x7000)];
        const RX_BUF: u64 = 0x10000;
        const TX_HDR: u64 = 0x20000;
        const TX_BUF: u64 = 0x21000;
        const F_NEXT: u16 = 1;
        const F_WRITE: u16 = 2;
        const MAC: [u8; 6] = [0x52, 0x54, 0, 0x12, 0x34, 0x56];

        pub struct Rig {
            pub t: MmioTransport<Net>,
            pub mem: GuestMem,
            pub peer: UnixDatagram,
            avail: [u16; 2],
        }

        fn w32(t: &mut MmioTransport<Net>, off: u64, v: u32) {
            t.write(0, off, &v.to_le_bytes());
        }

        fn r32(t: &mut MmioTransport<Net>, off: u64) -> u32 {
            let mut b = [0u8; 4];
            t.read(0, off, &mut b);
            u32::from_le_bytes(b)
        }

        /// A device and its peer socket; `mem` is shared with an earlier rig
        /// when given (restore tests).
        fn device(mem: &GuestMem) -> (MmioTransport<Net>, UnixDatagram) {
            let (tap_end, peer) = UnixDatagram::pair().unwrap();
            tap_end.set_nonblocking(true).unwrap();
            peer.set_nonblocking(true).unwrap();
            let file = std::fs::File::from(std::os::fd::OwnedFd::from(tap_end));
            (MmioTransport::new(Net::new(Tap::for_test(file), MAC), mem.clone()), peer)
        }

        pub fn rig() -> Rig {
            let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM as usize)]).unwrap();
            let (mut t, peer) = device(&mem);
            assert_eq!(r32(&mut t, regs::DEVICE_ID), 1);
            w32(&mut t, regs::STATUS, 0);
            w32(&mut t, regs::STATUS, 1 | 2);
            w32(&mut t, regs::DRIVER_FEATURES_SEL, 1);
            w32(&mut t, regs::DRIVER_FEATURES, 1);
            w32(&mut t, regs::STATUS, 1 | 2 | 8);
            assert_eq!(r32(&mut t, regs::STATUS) & 8, 8, "features accepted");
            for (q, (desc, avail, used)) in RINGS.iter().enumerate() {
                w32(&mut t, regs::QUEUE_SEL, q as u32);
                assert_eq!(r32(&mut t, regs::QUEUE_NUM_MAX), u32::from(QUEUE_SIZE));
                w32(&mut t, regs::QUEUE_NUM, u32::from(QSIZE));
                w32(&mut t, regs::QUEUE_DESC_LOW, *desc as u32);
                w32(&mut t, regs::QUEUE_AVAIL_LOW, *avail as u32);
                w32(&mut t, regs::QUEUE_USED_LOW, *used as u32);
                w32(&mut t, regs::QUEUE_READY, 1);
            }
            w32(&mut t, regs::STATUS, 1 | 2 | 8 | 4);
            Rig { t, mem, peer, avail: [0; 2] }
        }

        impl Rig {
            pub fn desc(&self, q: usize, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
                let a = GuestAddress(RINGS[q].0 + u64::from(i) * 16);
                self.mem.write_obj(addr, a).unwrap();
                self.mem.write_obj(len, a.unchecked_add(8)).unwrap();
                self.mem.write_obj(flags, a.unchecked_add(12)).unwrap();
                self.mem.write_obj(next, a.unchecked_add(14)).unwrap();
            }

            /// Makes the chain at `head` available on queue `q` (no notify).
            pub fn post(&mut self, q: usize, head: u16) {
                let slot = RINGS[q].1 + 4 + 2 * u64::from(self.avail[q] % QSIZE);
                self.mem.write_obj(head, GuestAddress(slot)).unwrap();
                self.avail[q] = self.avail[q].wrapping_add(1);
                self.mem.write_obj(self.avail[q], GuestAddress(RINGS[q].1 + 2)).unwrap();
            }

            pub fn notify(&mut self, q: u32) {
                w32(&mut self.t, regs::QUEUE_NOTIFY, q);
            }

            /// The used ring's index of queue `q`.
            pub fn used_idx(&self, q: usize) -> u16 {
                self.mem.read_obj(GuestAddress(RINGS[q].2 + 2)).unwrap()
            }

            /// The used element `n` of queue `q`: (id, len).
            pub fn used(&self, q: usize, n: u16) -> (u32, u32) {
                let e = RINGS[q].2 + 4 + 8 * u64::from(n % QSIZE);
                (
                    self.mem.read_obj(GuestAddress(e)).unwrap(),
                    self.mem.read_obj(GuestAddress(e + 4)).unwrap(),
                )
            }

            /// Transmits `payload` as a header descriptor and a data
            /// descriptor; returns whether the chain was used.
            pub fn transmit(&mut self, payload: &[u8]) -> bool {
                let before = self.used_idx(1);
                self.mem.write_slice(&[0u8; NET_HDR_BYTES], GuestAddress(TX_HDR)).unwrap();
                self.mem.write_slice(payload, GuestAddress(TX_BUF)).unwrap();
                self.desc(1, 0, TX_HDR, NET_HDR_BYTES as u32, F_NEXT, 1);
                self.desc(1, 1, TX_BUF, payload.len() as u32, 0, 0);
                self.post(1, 0);
                self.notify(1);
                self.used_idx(1) == before.wrapping_add(1)
            }

            /// Posts one receive buffer of `len` bytes and notifies queue 0.
            pub fn post_rx(&mut self, len: u32) {
                self.desc(0, 0, RX_BUF, len, F_WRITE, 0);
                self.post(0, 0);
                self.notify(0);
            }

            /// The frame the peer got, if any.
            pub fn sent(&self) -> Option<Vec<u8>> {
                let mut b = vec![0u8; 4096];
                match self.peer.recv(&mut b) {
                    Ok(n) => Some(b[..n].to_vec()),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => None,
                    Err(e) => panic!("peer recv: {e}"),
                }
            }

            pub fn needs_reset(&mut self) -> bool {
                r32(&mut self.t, regs::STATUS) & STATUS_NEEDS_RESET != 0
            }
        }

        fn frame(tag: u8, len: usize) -> Vec<u8> {
            (0..len).map(|i| tag ^ (i as u8)).collect()
        }

        #[test]
        fn transmit_sends_the_frame_without_its_header() {
            let mut r = rig();
            let f = frame(1, 60);
            assert!(r.transmit(&f));
            assert_eq!(r.sent(), Some(f), "the frame, without the 12-byte header");
            assert_eq!(r.sent(), None, "one frame per chain");
            assert_eq!(r.used(1, 0).0, 0, "the used element names the chain's head");
            assert_eq!(r.t.device().stats(), NetStats { tx_frames: 1, ..Default::default() });
            // The MAC in the config space.
            let mut mac = [0u8; 6];
            r.t.read(0, regs::CONFIG, &mut mac);
            assert_eq!(mac, MAC);
            // Then the status: the link is up (a TAP is behind the device).
            let mut status = [0xffu8; 2];
            r.t.read(0, regs::CONFIG + 6, &mut status);
            assert_eq!(u16::from_le_bytes(status), VIRTIO_NET_S_LINK_UP as u16, "link up");
            let mut past = [0xffu8; 4];
            r.t.read(0, regs::CONFIG + 8, &mut past);
            assert_eq!(past, [0; 4], "nothing but the MAC and the status in the config space");
        }

        /// Output commit: while output is held, a transmitted frame is used
        /// (the guest goes on) but nothing reaches the TAP until the VMM
        /// releases exactly that frame.
        #[test]
        fn held_output_reaches_the_tap_only_when_released() {
            let mut r = rig();
            assert!(r.t.device_mut().hold_output(true).is_empty());
            let (a, b) = (frame(2, 80), frame(3, 90));
            assert!(r.transmit(&a), "a held frame is still used");
            assert!(r.transmit(&b));
            assert_eq!(r.sent(), None, "a held frame went out before its release");
            let held = r.t.device_mut().take_held();
            assert_eq!(held, vec![a.clone(), b.clone()], "held in order");
            assert!(r.t.device_mut().take_held().is_empty(), "taken once");
            assert_eq!(r.sent(), None, "taking is not releasing");
            r.t.device_mut().release(&held);
            assert_eq!(r.sent(), Some(a));
            assert_eq!(r.sent(), Some(b));
            assert_eq!(r.sent(), None);
            // Held when output commit ends: returned to the caller, not sent.
            let c = frame(4, 70);
            assert!(r.transmit(&c));
            assert_eq!(r.t.device_mut().hold_output(false), vec![c]);
            assert_eq!(r.sent(), None);
            let d = frame(5, 70);
            assert!(r.transmit(&d));
            assert_eq!(r.sent(), Some(d), "not held any more");
            assert_eq!(r.t.device().stats().tx_frames, 4);
            assert_eq!(r.t.device().stats().dropped, 0, "every released frame was sent");
        }

        /// Output-triggered epochs: the output eventfd is signalled when a
        /// frame is held (and only then), and `held_since` names the oldest
        /// frame not yet taken.
        #[test]
        fn a_held_frame_signals_the_output_event() {
            let mut r = rig();
            let ev = r.t.device_mut().output_event().unwrap();
            assert!(r.transmit(&frame(6, 60)));
            assert!(ev.read().is_err(), "signalled for a frame sent straight out");
            assert_eq!(r.t.device().held_since(), None);
            r.t.device_mut().hold_output(true);
            let before = Instant::now();
            assert!(r.transmit(&frame(7, 60)));
            assert_eq!(ev.read().unwrap(), 1, "one signal for one held frame");
            let since = r.t.device().held_since().expect("a frame waits");
            assert!(since >= before);
            assert!(r.transmit(&frame(8, 60)));
            assert_eq!(r.t.device().held_since(), Some(since), "the oldest frame's time");
            assert_eq!(r.t.device_mut().take_held().len(), 2);
            assert_eq!(r.t.device().held_since(), None, "nothing waits once taken");
            // A second handle is the same eventfd.
            let again = r.t.device_mut().output_event().unwrap();
            assert!(r.transmit(&frame(9, 60)));
            assert_eq!(again.read().unwrap(), 2, "both frames since the last read");
        }

        /// COLO: with input copied, each frame delivered to the guest (and
        /// only once it is delivered: not while it waits for a buffer, not a
        /// frame too big for the buffer) is kept for the VMM, in order, and
        /// signals the output event.
        #[test]
        fn delivered_frames_are_copied_for_the_secondary() {
            let mut r = rig();
            let ev = r.t.device_mut().output_event().unwrap();
            r.t.device_mut().copy_input(true);
            let (a, b) = (frame(1, 100), frame(2, 120));
            r.peer.send(&a).unwrap();
            r.notify(0);
            assert!(r.t.device_mut().take_input().is_empty(), "not delivered yet");
            r.post_rx(2048);
            r.peer.send(&b).unwrap();
            r.post_rx(2048);
            assert_eq!(r.t.device_mut().take_input(), vec![a, b.clone()]);
            assert!(r.t.device_mut().take_input().is_empty(), "taken once");
            assert_eq!(ev.read().unwrap(), 2, "one signal per frame delivered");
            // Too big for the buffer: lost for the guest, so not copied.
            r.peer.send(&frame(3, 300)).unwrap();
            r.post_rx(64);
            assert!(r.t.device_mut().take_input().is_empty());
            r.t.device_mut().copy_input(false);
            r.peer.send(&b).unwrap();
            r.post_rx(2048);
            assert!(r.t.device_mut().take_input().is_empty(), "copying stopped");
        }

        /// COLO's secondary: with an output hook, each transmitted frame
        /// goes to the hook, not to the TAP and not to the held frames.
        #[test]
        fn an_output_hook_takes_every_transmitted_frame() {
            let mut r = rig();
            r.t.device_mut().hold_output(true);
            let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
            let g = got.clone();
            r.t.device_mut().set_output_hook(Some(Box::new(move |f: &[u8]| {
                g.lock().unwrap().push(f.to_vec())
            })));
            let (a, b) = (frame(4, 60), frame(5, 70));
            assert!(r.transmit(&a) && r.transmit(&b));
            assert_eq!(*got.lock().unwrap(), vec![a, b]);
            assert_eq!(r.sent(), None, "nothing to the TAP");
            assert!(r.t.device_mut().take_held().is_empty(), "nothing held");
            r.t.device_mut().set_output_hook(None);
            let c = frame(6, 60);
            assert!(r.transmit(&c));
            assert_eq!(r.t.device_mut().take_held(), vec![c], "held again without the hook");
        }

        #[test]
        fn receive_fills_posted_buffers_and_a_frame_waits_for_one() {
            let mut r = rig();
            let f = frame(6, 100);
            r.peer.send(&f).unwrap();
            // No buffer posted: the frame waits in the device.
            r.notify(0);
            assert_eq!(r.used_idx(0), 0);
            assert!(r.t.device().rx_pending());
            r.t.track_writes(true);
            r.post_rx(2048);
            assert_eq!(r.used_idx(0), 1);
            assert_eq!(r.used(0, 0), (0, (NET_HDR_BYTES + f.len()) as u32));
            let mut got = vec![0u8; NET_HDR_BYTES + f.len()];
            r.mem.read_slice(&mut got, GuestAddress(RX_BUF)).unwrap();
            let mut hdr = [0u8; NET_HDR_BYTES];
            hdr[10] = 1; // num_buffers
            assert_eq!(got[..NET_HDR_BYTES], hdr);
            assert_eq!(got[NET_HDR_BYTES..], f[..]);
            assert!(!r.t.device().rx_pending());
            assert_eq!(r.t.device().stats().rx_frames, 1);
            // The written guest range is reported (for dirty tracking).
            let w = r.t.take_writes();
            assert!(w.contains(&(RX_BUF, (NET_HDR_BYTES + f.len()) as u64)), "{w:x?}");
            // Nothing more to receive: a posted buffer stays unused.
            r.post_rx(2048);
            assert_eq!(r.used_idx(0), 1);
        }

        #[test]
        fn bad_frames_are_dropped_and_the_device_keeps_working() {
            let mut r = rig();
            // Header only, oversized, outside guest memory, device-writable.
            assert!(r.transmit(&[]));
            assert!(r.transmit(&frame(7, MAX_FRAME + 1)));
            r.desc(1, 0, MEM - 8, 64, 0, 0);
            r.post(1, 0);
            r.notify(1);
            r.desc(1, 0, TX_BUF, 64, F_WRITE, 0);
            r.post(1, 0);
            r.notify(1);
            assert_eq!(r.used_idx(1), 4, "dropped frames are used all the same");
            assert_eq!(r.sent(), None);
            assert_eq!(r.t.device().stats(), NetStats { dropped: 4, ..Default::default() });
            let ok = frame(8, MAX_FRAME);
            assert!(r.transmit(&ok));
            assert_eq!(r.sent(), Some(ok));
            // A receive buffer too small for the frame: dropped, buffer used.
            r.peer.send(&frame(9, 200)).unwrap();
            r.post_rx(64);
            assert_eq!(r.used_idx(0), 1);
            assert_eq!(r.t.device().stats().dropped, 5);
            assert!(!r.needs_reset());
            // A receive buffer the device may not write: the queue is broken.
            r.peer.send(&frame(10, 60)).unwrap();
            r.desc(0, 0, RX_BUF, 2048, 0, 0);
            r.post(0, 0);
            r.notify(0);
            assert!(r.needs_reset(), "a read-only receive buffer must need a reset");
            assert!(r.t.last_error().unwrap().contains("not writable"), "{:?}", r.t.last_error());
        }

        /// Saved mid-run (a frame waiting for a buffer, rings in use) and
        /// restored into a fresh device: the fresh one delivers the waiting
        /// frame into the next posted buffer and transmits on the same ring.
        #[test]
        fn save_and_restore_into_a_fresh_device_keeps_the_rings_and_the_waiting_frame() {
            let mut r = rig();
            assert!(r.transmit(&frame(11, 60)));
            let waiting = frame(12, 120);
            r.peer.send(&waiting).unwrap();
            r.notify(0);
            assert!(r.t.device().rx_pending());
            let saved = r.t.save();
            let (mut fresh, peer) = device(&r.mem);
            assert_ne!(fresh.save(), saved, "a fresh device must differ for this to mean anything");
            fresh.restore(&saved).unwrap();
            assert_eq!(fresh.save(), saved);
            r.t = fresh;
            r.peer = peer;
            assert!(r.t.device().rx_pending());
            r.post_rx(2048);
            assert_eq!(r.used_idx(0), 1);
            let mut got = vec![0u8; waiting.len()];
            r.mem.read_slice(&mut got, GuestAddress(RX_BUF + NET_HDR_BYTES as u64)).unwrap();
            assert_eq!(got, waiting);
            let f = frame(13, 60);
            assert!(r.transmit(&f));
            assert_eq!(r.used_idx(1), 2);
            assert_eq!(r.sent(), Some(f));
        }
        /// A gratuitous ARP goes to the TAP even while guest output is held
        /// (it is the VMM's frame), from the guest's MAC, with the guest's
        /// address as both sender and target.
        #[test]
        fn announce_sends_a_gratuitous_arp_past_held_output() {
            let mut r = rig();
            r.t.device_mut().hold_output(true);
            assert!(r.transmit(&frame(21, 60)));
            assert_eq!(r.sent(), None, "guest output is held");
            assert!(r.t.device_mut().announce([10, 0, 0, 2]));
            let f = r.sent().expect("the announcement went out");
            assert_eq!(f.len(), 42);
            assert_eq!(&f[0..6], &[0xff; 6], "broadcast");
            assert_eq!(&f[6..12], &MAC, "from the guest's MAC");
            assert_eq!(&f[12..14], &[0x08, 0x06], "ARP");
            assert_eq!(&f[14..22], &[0, 1, 0x08, 0x00, 6, 4, 0, 1], "Ethernet/IPv4 request");
            assert_eq!(&f[22..28], &MAC, "sender hardware address");
            assert_eq!(&f[28..32], &[10, 0, 0, 2], "sender protocol address");
            assert_eq!(&f[32..38], &[0; 6], "target hardware address");
            assert_eq!(&f[38..42], &[10, 0, 0, 2], "target protocol address");
            assert_eq!(r.t.device().stats().announcements, 1);
            assert_eq!(r.sent(), None, "the held guest frame is still held");
        }
    }
}
