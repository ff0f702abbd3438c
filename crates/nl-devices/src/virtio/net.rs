//! virtio-net backed by a host TAP interface.
//!
//! Queue 0 receives, queue 1 transmits. Transmit is served when the driver
//! notifies queue 1: each chain's frame (after the 12-byte virtio-net
//! header) goes to the TAP. Receive is driven by the driver too: a notify of
//! queue 0 (or 1) moves the frames waiting on the TAP into the posted
//! receive buffers, so a polling ring-3 driver needs no interrupts. A frame
//! that finds no buffer waits in the device for the next notify.

use virtio_bindings::virtio_net::VIRTIO_NET_F_MAC;
use virtio_queue::{desc::split::Descriptor, Queue, QueueT};
use vm_memory::{Bytes, GuestMemory, Permissions};

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
}

pub struct Net {
    tap: Tap,
    mac: [u8; 6],
    pending: Option<Vec<u8>>,
    buf: Vec<u8>,
    stats: NetStats,
    /// Guest ranges written by receive since the last `take_written`.
    written: Vec<(u64, u64)>,
    /// Output commit: while set, transmitted frames wait here instead of
    /// going to the TAP, until the VMM releases them.
    held: Option<Vec<Vec<u8>>>,
}

impl Net {
    pub fn new(tap: Tap, mac: [u8; 6]) -> Self {
        Net {
            tap,
            mac,
            pending: None,
            buf: vec![0; 65536],
            stats: NetStats::default(),
            written: Vec::new(),
            held: None,
        }
    }

    /// Holds transmitted frames (output commit) or, with `false`, sends them
    /// straight to the TAP again (frames already held are returned).
    pub fn hold_output(&mut self, on: bool) -> Vec<Vec<u8>> {
        let old = if on { self.held.replace(Vec::new()) } else { self.held.take() };
        old.unwrap_or_default()
    }

    /// Takes the frames held since the last call (the epoch that just ended).
    pub fn take_held(&mut self) -> Vec<Vec<u8>> {
        self.held.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Sends frames (held earlier) to the TAP.
    pub fn release(&mut self, frames: &[Vec<u8>]) {
        for f in frames {
            if !self.tap.send(f) {
                self.stats.dropped += 1;
            }
        }
    }

    pub fn stats(&self) -> NetStats {
        self.stats
    }

    /// The TAP's file descriptor (to wait for frames on).
    pub fn tap_fd(&self) -> std::os::fd::RawFd {
        self.tap.raw_fd()
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
        if let Some(held) = self.held.as_mut() {
            held.push(frame[NET_HDR_BYTES..].to_vec());
        } else if !self.tap.send(&frame[NET_HDR_BYTES..]) {
            self.stats.dropped += 1;
            return;
        }
        self.stats.tx_frames += 1;
    }

    /// Moves waiting frames into posted receive buffers.
    fn receive(&mut self, queue: &mut Queue, mem: &GuestMem) -> Result<bool, QueueError> {
        let mut used = false;
        for _ in 0..queue.size() {
            if self.pending.is_none() {
                match self.tap.recv(&mut self.buf) {
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
        1 << VIRTIO_NET_F_MAC
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
}
