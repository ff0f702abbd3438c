//! COLO-style output comparison (QEMU COLO's colo-compare, for ninelives):
//! the primary's frames are held until the secondary VM, running the same
//! input, has produced the same output; then they leave without waiting
//! for an epoch. Where the two VMs' outputs differ, the caller takes a
//! checkpoint (the secondary becomes the primary's copy again) and
//! releases what was held.
//!
//! This module is the comparison and the primary's held frames; the
//! secondary VM that sends the other side is [`crate::secondary`]'s, on
//! the backup (docs/replication.md, "COLO"). TCP is compared per
//! stream, as colo-compare does: two guests that share a TCP stack's
//! random seed send the same sequence numbers and payload, but their pure
//! acknowledgements, windows, IP identifications and timing differ. A
//! primary segment is released once the secondary has sent
//!
//! * the same SYN (the same initial sequence number),
//! * the same payload bytes at the same sequence numbers,
//! * the same FIN, and
//! * an acknowledgement at least as far (the client then never sees an
//!   acknowledgement of data the secondary has not received).
//!
//! Segments of one stream leave in order. Other frames (ARP, ICMP, UDP)
//! are released when the secondary has sent a byte-identical frame. A frame
//! that cannot be parsed is compared as an other frame. Different payload
//! at the same sequence number, or a different initial sequence number, is
//! a [`Divergence`]; so is a frame held longer than the caller's bound
//! (see [`Comparator::oldest_held`]). Nothing here trusts a frame: every
//! length is checked by smoltcp's parsers, and a frame never makes this
//! module panic.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use smoltcp::wire::{EthernetFrame, EthernetProtocol, IpProtocol, Ipv4Packet, TcpPacket};

/// A TCP stream as the guest sees it: (local address, local port, remote
/// address, remote port), from the guest's outgoing frames.
type FlowKey = ([u8; 4], u16, [u8; 4], u16);

/// Why the two VMs' outputs can no longer be matched: the caller must
/// checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Divergence(pub String);

/// A parsed outgoing TCP segment.
#[derive(Clone, Debug)]
struct Segment {
    flow: FlowKey,
    seq: u32,
    /// The acknowledgement number, if the ACK flag is set.
    ack: Option<u32>,
    syn: bool,
    fin: bool,
    rst: bool,
    payload: Vec<u8>,
}

/// Where a TCP segment's payload starts in `frame`, if it has one.
pub(crate) fn tcp_payload_at(frame: &[u8]) -> Option<usize> {
    let eth = EthernetFrame::new_checked(frame).ok()?;
    let ip = Ipv4Packet::new_checked(eth.payload()).ok()?;
    if eth.ethertype() != EthernetProtocol::Ipv4 || ip.next_header() != IpProtocol::Tcp {
        return None;
    }
    let tcp = TcpPacket::new_checked(ip.payload()).ok()?;
    let at = 14 + usize::from(ip.header_len()) + usize::from(tcp.header_len());
    (!tcp.payload().is_empty() && at < frame.len()).then_some(at)
}

fn parse(frame: &[u8]) -> Option<Segment> {
    let eth = EthernetFrame::new_checked(frame).ok()?;
    if eth.ethertype() != EthernetProtocol::Ipv4 {
        return None;
    }
    let ip = Ipv4Packet::new_checked(eth.payload()).ok()?;
    if ip.next_header() != IpProtocol::Tcp || ip.more_frags() || ip.frag_offset() != 0 {
        return None;
    }
    let tcp = TcpPacket::new_checked(ip.payload()).ok()?;
    Some(Segment {
        flow: (ip.src_addr().octets(), tcp.src_port(), ip.dst_addr().octets(), tcp.dst_port()),
        seq: tcp.seq_number().0 as u32,
        ack: tcp.ack().then(|| tcp.ack_number().0 as u32),
        syn: tcp.syn(),
        fin: tcp.fin(),
        rst: tcp.rst(),
        payload: tcp.payload().to_vec(),
    })
}

/// `a` is at or after `b` in sequence space.
fn at_or_after(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) >= 0
}

/// What the secondary has sent on one stream.
#[derive(Default)]
struct Secondary {
    /// Its initial sequence number (from its SYN).
    isn: Option<u32>,
    /// Its payload bytes from `start`, contiguous.
    start: u32,
    data: Vec<u8>,
    /// The sequence number its FIN took.
    fin: Option<u32>,
    /// The furthest acknowledgement it sent.
    ack: Option<u32>,
    rst: bool,
}

impl Secondary {
    fn end(&self) -> u32 {
        self.start.wrapping_add(self.data.len() as u32)
    }

    /// Takes in a secondary segment; a retransmission must repeat what was
    /// sent.
    fn take(&mut self, s: &Segment) -> Result<(), Divergence> {
        let mut seq = s.seq;
        if s.syn {
            match self.isn {
                Some(isn) if isn != s.seq => {
                    return Err(Divergence(format!(
                        "the secondary sent a second SYN ({:#x} after {isn:#x})",
                        s.seq
                    )))
                }
                _ => {}
            }
            if self.isn.is_none() {
                self.isn = Some(s.seq);
                self.start = s.seq.wrapping_add(1);
            }
            seq = seq.wrapping_add(1);
        }
        if self.isn.is_none() && self.data.is_empty() {
            // The stream was open before comparison began: start here.
            self.start = seq;
        }
        if !s.payload.is_empty() {
            // Bytes before the kept stream are skipped; bytes after a gap
            // (a frame lost on the way) are not kept: a retransmission
            // fills the gap.
            let skip = if at_or_after(seq, self.start) {
                0
            } else {
                self.start.wrapping_sub(seq) as usize
            };
            let off = seq.wrapping_add(skip as u32).wrapping_sub(self.start) as usize;
            if skip < s.payload.len() && off <= self.data.len() {
                let new = &s.payload[skip..];
                let overlap = (self.data.len() - off).min(new.len());
                if self.data[off..off + overlap] != new[..overlap] {
                    return Err(Divergence(format!(
                        "the secondary retransmitted different bytes at {seq:#x}"
                    )));
                }
                self.data.extend_from_slice(&new[overlap..]);
            }
        }
        if s.fin {
            let at = seq.wrapping_add(s.payload.len() as u32);
            if self.fin.is_some_and(|f| f != at) {
                return Err(Divergence(format!("the secondary sent two FINs ({at:#x})")));
            }
            self.fin = Some(at);
        }
        if let Some(a) = s.ack {
            if self.ack.is_none_or(|old| at_or_after(a, old)) {
                self.ack = Some(a);
            }
        }
        self.rst |= s.rst;
        Ok(())
    }

    /// Whether the primary's segment `p` is matched; `Err` if it differs.
    fn covers(&self, p: &Segment) -> Result<bool, Divergence> {
        let mut seq = p.seq;
        if p.syn {
            match self.isn {
                None => return Ok(false),
                Some(isn) if isn != p.seq => {
                    return Err(Divergence(format!(
                        "initial sequence numbers differ: primary {:#x}, secondary {isn:#x}",
                        p.seq
                    )))
                }
                Some(_) => seq = seq.wrapping_add(1),
            }
        }
        if !p.payload.is_empty() {
            if self.isn.is_none() && self.data.is_empty() {
                return Ok(false);
            }
            let end = seq.wrapping_add(p.payload.len() as u32);
            if !at_or_after(seq, self.start) {
                return Err(Divergence(format!(
                    "the primary sent bytes at {seq:#x}, before the secondary's stream began"
                )));
            }
            if !at_or_after(self.end(), end) {
                return Ok(false);
            }
            let off = seq.wrapping_sub(self.start) as usize;
            if self.data[off..off + p.payload.len()] != p.payload[..] {
                return Err(Divergence(format!("payload differs at {seq:#x}")));
            }
        }
        if p.fin {
            let at = seq.wrapping_add(p.payload.len() as u32);
            match self.fin {
                None => return Ok(false),
                Some(f) if f != at => {
                    return Err(Divergence(format!("FIN at {at:#x} against {f:#x}")))
                }
                Some(_) => {}
            }
        }
        if p.rst && !self.rst {
            return Ok(false);
        }
        if let Some(a) = p.ack {
            if !self.ack.is_some_and(|s| at_or_after(s, a)) {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// One held primary frame.
struct Held<T> {
    tag: T,
    since: Instant,
}

/// One stream: what the secondary sent, and the primary's segments held.
type Stream<T> = (Secondary, VecDeque<(Held<T>, Segment)>);

/// The comparator. `T` names a held primary frame for the caller (its
/// buffer, or an index into the caller's queue of held output).
pub struct Comparator<T> {
    flows: HashMap<FlowKey, Stream<T>>,
    /// Held primary frames that are not TCP, with their bytes.
    others: VecDeque<(Held<T>, Vec<u8>)>,
    /// Non-TCP frames the secondary sent that no primary frame has matched
    /// yet (bounded: the oldest go first).
    spare: VecDeque<Vec<u8>>,
    /// Frames released, and bytes compared.
    pub released: u64,
    pub compared_bytes: u64,
}

/// Non-TCP secondary frames kept for matching.
const SPARE: usize = 256;

impl<T> Default for Comparator<T> {
    fn default() -> Self {
        Comparator {
            flows: HashMap::new(),
            others: VecDeque::new(),
            spare: VecDeque::new(),
            released: 0,
            compared_bytes: 0,
        }
    }
}

impl<T> Comparator<T> {
    pub fn new() -> Self {
        Self::default()
    }

    /// A frame the primary's guest sent, held as `tag`; returns the held
    /// frames that may leave now, in order.
    pub fn primary(&mut self, frame: &[u8], tag: T, now: Instant) -> Result<Vec<T>, Divergence> {
        let held = Held { tag, since: now };
        match parse(frame) {
            Some(s) => {
                let flow = s.flow;
                self.flows.entry(flow).or_default().1.push_back((held, s));
                self.release_flow(flow)
            }
            None => {
                self.others.push_back((held, frame.to_vec()));
                Ok(self.release_others())
            }
        }
    }

    /// A frame the secondary's guest sent (it goes nowhere else); returns
    /// the held primary frames that may leave now.
    pub fn secondary(&mut self, frame: &[u8]) -> Result<Vec<T>, Divergence> {
        match parse(frame) {
            Some(s) => {
                let flow = s.flow;
                self.flows.entry(flow).or_default().0.take(&s)?;
                self.release_flow(flow)
            }
            None => {
                if self.spare.len() == SPARE {
                    self.spare.pop_front();
                }
                self.spare.push_back(frame.to_vec());
                Ok(self.release_others())
            }
        }
    }

    /// When the oldest frame still held was held (the caller checkpoints
    /// once it has waited too long: the secondary is slow or silent).
    pub fn oldest_held(&self) -> Option<Instant> {
        let tcp = self.flows.values().filter_map(|(_, q)| q.front().map(|(h, _)| h.since));
        tcp.chain(self.others.front().map(|(h, _)| h.since)).min()
    }

    /// After a checkpoint: the secondary is the primary's copy again, so
    /// everything held may leave, and comparison starts afresh (each
    /// stream from where the primary is).
    pub fn checkpointed(&mut self) -> Vec<T> {
        let mut out = Vec::new();
        for (_, (_, q)) in self.flows.drain() {
            out.extend(q.into_iter().map(|(h, _)| h.tag));
        }
        out.extend(self.others.drain(..).map(|(h, _)| h.tag));
        self.spare.clear();
        self.released += out.len() as u64;
        out
    }

    fn release_flow(&mut self, flow: FlowKey) -> Result<Vec<T>, Divergence> {
        let mut out = Vec::new();
        let Some((sec, q)) = self.flows.get_mut(&flow) else { return Ok(out) };
        while let Some((_, s)) = q.front() {
            if !sec.covers(s)? {
                break;
            }
            let (h, s) = q.pop_front().expect("a front was seen");
            self.compared_bytes += s.payload.len() as u64;
            out.push(h.tag);
        }
        self.released += out.len() as u64;
        Ok(out)
    }

    fn release_others(&mut self) -> Vec<T> {
        let mut out = Vec::new();
        while let Some((_, f)) = self.others.front() {
            let Some(i) = self.spare.iter().position(|s| s == f) else { break };
            self.spare.remove(i);
            let (h, f) = self.others.pop_front().expect("a front was seen");
            self.compared_bytes += f.len() as u64;
            out.push(h.tag);
        }
        self.released += out.len() as u64;
        out
    }
}

/// COLO's counts on the primary, for its report.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct ColoStats {
    /// Frames released because the secondary sent the same.
    pub matched: u64,
    /// Frames released by an epoch (held when it was taken).
    pub released_by_epoch: u64,
    /// Epochs taken because the two VMs' outputs differed, because a frame
    /// waited too long for the secondary's, or because the timer ran out.
    pub divergences: u64,
    pub timeouts: u64,
    pub periodic: u64,
    /// Frames the secondary sent that were compared, and those from
    /// before the last epoch (dropped unread).
    pub secondary_frames: u64,
    pub stale_secondary: u64,
    /// Frames the primary's guest received, forwarded to the secondary.
    pub forwarded: u64,
    /// How long a matched frame waited for the secondary's (ms).
    pub match_wait_ms_avg: f64,
    pub match_wait_ms_max: f64,
    /// Why the backup's secondary stopped, if it did: from then on output
    /// is released by epochs alone, as without COLO.
    pub secondary_down: Option<String>,
}

/// The primary's side of COLO: the frames its guest sent, held until the
/// secondary sent the same or an epoch is taken.
#[derive(Default)]
pub struct Outbox {
    cmp: Comparator<u64>,
    frames: HashMap<u64, (Vec<u8>, Instant)>,
    next: u64,
    pub stats: ColoStats,
    wait_sum: f64,
}

impl Outbox {
    pub fn new() -> Self {
        Self::default()
    }

    fn take(&mut self, tags: Vec<u64>, now: Instant) -> Vec<Vec<u8>> {
        let mut out = Vec::with_capacity(tags.len());
        for t in tags {
            if let Some((f, since)) = self.frames.remove(&t) {
                let w = now.saturating_duration_since(since).as_secs_f64() * 1e3;
                self.stats.matched += 1;
                self.wait_sum += w;
                self.stats.match_wait_ms_max = self.stats.match_wait_ms_max.max(w);
                self.stats.match_wait_ms_avg = self.wait_sum / self.stats.matched as f64;
                out.push(f);
            }
        }
        out
    }

    /// A frame the primary's guest sent: held. Returns the frames that may
    /// leave now, in order; `Err` when the two VMs differ.
    pub fn primary(&mut self, frame: Vec<u8>, now: Instant) -> Result<Vec<Vec<u8>>, Divergence> {
        let tag = self.next;
        self.next += 1;
        let r = self.cmp.primary(&frame, tag, now);
        self.frames.insert(tag, (frame, now));
        r.map(|tags| self.take(tags, now))
    }

    /// The frames the primary's guest sent since the last call, in order:
    /// those that may leave now, and whether one differed from the
    /// secondary's. Every frame is held, the one that differs and those
    /// after it too: the epoch the caller then takes releases them.
    pub fn primary_batch(
        &mut self,
        frames: Vec<Vec<u8>>,
        now: Instant,
    ) -> (Vec<Vec<u8>>, Option<Divergence>) {
        let (mut out, mut differ) = (Vec::new(), None);
        for f in frames {
            match self.primary(f, now) {
                Ok(r) => out.extend(r),
                Err(d) => differ = differ.or(Some(d)),
            }
        }
        (out, differ)
    }

    /// A frame the secondary sent. Returns the frames that may leave now.
    pub fn secondary(&mut self, frame: &[u8], now: Instant) -> Result<Vec<Vec<u8>>, Divergence> {
        self.stats.secondary_frames += 1;
        self.cmp.secondary(frame).map(|tags| self.take(tags, now))
    }

    /// When the oldest frame still held was sent.
    pub fn oldest(&self) -> Option<Instant> {
        self.cmp.oldest_held()
    }

    /// An epoch was taken: every frame held leaves with it (in the order
    /// sent, a frame that diverged included), ahead of `more` (the frames
    /// the device held since).
    pub fn checkpointed(&mut self, more: Vec<Vec<u8>>) -> Vec<Vec<u8>> {
        self.cmp.checkpointed();
        let mut held: Vec<(u64, Vec<u8>)> = self.frames.drain().map(|(t, (f, _))| (t, f)).collect();
        held.sort_unstable_by_key(|h| h.0);
        let mut out: Vec<Vec<u8>> = held.into_iter().map(|(_, f)| f).collect();
        self.stats.released_by_epoch += (out.len() + more.len()) as u64;
        out.extend(more);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GUEST: [u8; 4] = [10, 0, 0, 2];
    const CLIENT: [u8; 4] = [10, 0, 0, 1];

    /// An Ethernet/IPv4/TCP frame from the guest's port 7000 to the
    /// client's 40000, with `ipid` and `window` (which differ between the
    /// two VMs and must not matter).
    fn tcp(
        seq: u32,
        ack: Option<u32>,
        flags: &str,
        payload: &[u8],
        ipid: u16,
        window: u16,
    ) -> Vec<u8> {
        let tcp_len = 20 + payload.len();
        let ip_len = 20 + tcp_len;
        let mut f = vec![0u8; 14 + ip_len];
        f[0..6].copy_from_slice(&[2, 0, 0, 0, 0, 1]);
        f[6..12].copy_from_slice(&[2, 0, 0, 0, 0, 2]);
        f[12..14].copy_from_slice(&[0x08, 0x00]);
        let ip = &mut f[14..];
        ip[0] = 0x45;
        ip[2..4].copy_from_slice(&(ip_len as u16).to_be_bytes());
        ip[4..6].copy_from_slice(&ipid.to_be_bytes());
        ip[8] = 64;
        ip[9] = 6;
        ip[12..16].copy_from_slice(&GUEST);
        ip[16..20].copy_from_slice(&CLIENT);
        let t = &mut ip[20..];
        t[0..2].copy_from_slice(&7000u16.to_be_bytes());
        t[2..4].copy_from_slice(&40000u16.to_be_bytes());
        t[4..8].copy_from_slice(&seq.to_be_bytes());
        t[8..12].copy_from_slice(&ack.unwrap_or(0).to_be_bytes());
        t[12] = 5 << 4;
        let mut fl = 0u8;
        for c in flags.chars() {
            fl |= match c {
                'F' => 0x01,
                'S' => 0x02,
                'R' => 0x04,
                _ => 0,
            };
        }
        if ack.is_some() {
            fl |= 0x10;
        }
        t[13] = fl;
        t[14..16].copy_from_slice(&window.to_be_bytes());
        t[20..].copy_from_slice(payload);
        f
    }

    #[test]
    fn the_payload_of_a_segment_is_found() {
        let f = tcp(1001, Some(20), "", b"value=1\n", 1, 512);
        assert_eq!(tcp_payload_at(&f).map(|a| f[a]), Some(b'v'));
        assert_eq!(tcp_payload_at(&tcp(1001, Some(20), "", b"", 1, 512)), None);
        assert_eq!(tcp_payload_at(&[0u8; 10]), None);
    }

    /// The primary's side: a frame leaves (its bytes, as the primary's
    /// guest sent them) once the secondary sent its match; what is still
    /// held at an epoch leaves with it, in the order sent and ahead of the
    /// device's frames; the counts say which way each left.
    #[test]
    fn the_outbox_releases_matched_frames_and_the_rest_at_an_epoch() {
        let t0 = Instant::now();
        let mut o = Outbox::new();
        let a = tcp(1001, Some(20), "", b"value=1\n", 1, 512);
        let b = tcp(1009, Some(40), "", b"value=2\n", 2, 512);
        let c = tcp(1017, Some(60), "", b"value=3\n", 3, 512);
        assert!(o.primary(a.clone(), t0).unwrap().is_empty());
        assert!(o.primary(b.clone(), t0).unwrap().is_empty());
        assert!(o.primary(c.clone(), t0).unwrap().is_empty());
        assert_eq!(o.oldest(), Some(t0));
        // The secondary's copy of `a` (its own IP id and window).
        let later = t0 + std::time::Duration::from_millis(2);
        let out = o.secondary(&tcp(1001, Some(20), "", b"value=1\n", 77, 4096), later).unwrap();
        assert_eq!(out, vec![a], "the primary's own bytes leave");
        assert_eq!(o.stats.matched, 1);
        assert!((o.stats.match_wait_ms_avg - 2.0).abs() < 1e-6);
        // A different reply at `b`'s sequence number: the VMs differ.
        assert!(o.secondary(&tcp(1009, Some(40), "", b"value=9\n", 78, 4096), later).is_err());
        // The epoch releases b and c, then the device's frame.
        let d = vec![9u8; 60];
        assert_eq!(o.checkpointed(vec![d.clone()]), vec![b, c, d]);
        assert_eq!(o.stats.released_by_epoch, 3);
        assert_eq!(o.oldest(), None);
        assert!(o.checkpointed(Vec::new()).is_empty(), "nothing is released twice");
        // The secondary sent other bytes where the primary's frame goes:
        // that frame differs, and is held all the same for the epoch.
        let mut o = Outbox::new();
        assert!(o.secondary(&tcp(1001, Some(20), "", b"value=8\n", 79, 4096), t0).is_ok());
        let e = tcp(1001, Some(20), "", b"value=4\n", 4, 512);
        assert!(o.primary(e.clone(), t0).is_err());
        assert_eq!(o.checkpointed(Vec::new()), vec![e]);
        // A batch whose first frame differs: the frames after it are held
        // too, and the epoch releases all of them, in order.
        let mut o = Outbox::new();
        assert!(o.secondary(&tcp(1001, Some(20), "", b"value=8\n", 79, 4096), t0).is_ok());
        let batch = vec![
            tcp(1001, Some(20), "", b"value=4\n", 5, 512),
            tcp(1009, Some(20), "", b"value=5\n", 6, 512),
            vec![7u8; 60],
        ];
        let (out, differ) = o.primary_batch(batch.clone(), t0);
        assert!(out.is_empty() && differ.is_some(), "{differ:?}");
        assert_eq!(o.checkpointed(Vec::new()), batch);
    }

    /// The same stream from both VMs, with different windows and IP ids and
    /// the secondary's frames arriving later or earlier: every primary
    /// frame leaves, in order, once the secondary has sent its match.
    #[test]
    fn the_same_stream_from_both_leaves_in_order_whoever_is_first() {
        let t0 = Instant::now();
        let stream = |ipid: u16, win: u16| {
            vec![
                tcp(1000, Some(5), "S", b"", ipid, win),
                tcp(1001, Some(20), "", b"value=1\n", ipid + 1, win),
                tcp(1009, Some(40), "", b"value=2\n", ipid + 2, win),
                tcp(1017, Some(41), "F", b"", ipid + 3, win),
            ]
        };
        let (p, s) = (stream(1, 512), stream(900, 4096));
        let mut c = Comparator::new();
        // The primary first: everything waits for the secondary.
        for (i, f) in p.iter().enumerate() {
            assert_eq!(c.primary(f, i, t0).unwrap(), Vec::<usize>::new());
        }
        assert_eq!(c.oldest_held(), Some(t0));
        let mut out = Vec::new();
        for f in &s {
            out.extend(c.secondary(f).unwrap());
        }
        assert_eq!(out, vec![0, 1, 2, 3]);
        assert_eq!(c.oldest_held(), None);
        // The secondary first: each primary frame leaves as it comes.
        let mut c = Comparator::new();
        for f in &s {
            assert!(c.secondary(f).unwrap().is_empty());
        }
        for (i, f) in p.iter().enumerate() {
            assert_eq!(c.primary(f, i, t0).unwrap(), vec![i]);
        }
    }

    /// Different bytes at the same place, or a different initial sequence
    /// number, is a divergence; a retransmission with other bytes too.
    #[test]
    fn different_payload_or_isn_is_a_divergence() {
        let t0 = Instant::now();
        let mut c = Comparator::new();
        c.secondary(&tcp(1000, Some(5), "S", b"", 1, 1)).unwrap();
        c.secondary(&tcp(1001, Some(6), "", b"value=1\n", 2, 1)).unwrap();
        c.primary(&tcp(1000, Some(5), "S", b"", 1, 1), 0, t0).unwrap();
        let e = c.primary(&tcp(1001, Some(6), "", b"value=9\n", 2, 1), 1, t0).unwrap_err();
        assert!(e.0.contains("payload differs"), "{e:?}");
        let e = c.secondary(&tcp(1001, Some(6), "", b"value=8\n", 3, 1)).unwrap_err();
        assert!(e.0.contains("retransmitted different bytes"), "{e:?}");

        let mut c = Comparator::new();
        c.secondary(&tcp(7777, Some(5), "S", b"", 1, 1)).unwrap();
        let e = c.primary(&tcp(1000, Some(5), "S", b"", 1, 1), 0, t0).unwrap_err();
        assert!(e.0.contains("initial sequence numbers differ"), "{e:?}");
    }

    /// The primary's acknowledgement waits until the secondary has
    /// acknowledged as far: the client must never see data acknowledged
    /// that the secondary did not receive.
    #[test]
    fn an_acknowledgement_waits_for_the_secondarys() {
        let t0 = Instant::now();
        let mut c = Comparator::new();
        c.secondary(&tcp(1000, Some(5), "S", b"", 1, 1)).unwrap();
        assert_eq!(c.primary(&tcp(1000, Some(5), "S", b"", 1, 1), 0, t0).unwrap(), vec![0]);
        // A pure ACK of the client's bytes up to 50.
        assert!(c.primary(&tcp(1001, Some(50), "", b"", 2, 1), 1, t0).unwrap().is_empty());
        assert!(c.secondary(&tcp(1001, Some(30), "", b"", 2, 1)).unwrap().is_empty());
        assert_eq!(c.secondary(&tcp(1001, Some(50), "", b"", 3, 1)).unwrap(), vec![1]);
    }

    /// Frames that are not TCP leave when the secondary sent the same
    /// bytes; held ones all leave at a checkpoint.
    #[test]
    fn other_frames_match_by_bytes_and_a_checkpoint_releases_everything() {
        let t0 = Instant::now();
        let (arp, other) = (vec![0xffu8; 42], vec![0x11u8; 60]);
        let mut c = Comparator::new();
        assert!(c.primary(&arp, 0, t0).unwrap().is_empty());
        assert!(c.secondary(&other).unwrap().is_empty(), "another frame matched");
        assert_eq!(c.secondary(&arp).unwrap(), vec![0]);
        assert!(c.primary(&arp, 1, t0).unwrap().is_empty());
        assert!(c.primary(&tcp(1, Some(2), "", b"x", 1, 1), 2, t0).unwrap().is_empty());
        let mut all = c.checkpointed();
        all.sort_unstable();
        assert_eq!(all, vec![1, 2]);
        assert_eq!(c.oldest_held(), None);
    }

    /// Garbage, truncated and oversized-length frames from either VM never
    /// panic (bounded, seeded).
    #[test]
    fn malformed_frames_never_panic() {
        let t0 = Instant::now();
        let mut c = Comparator::new();
        let good = tcp(1000, Some(5), "", b"hello", 1, 1);
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for i in 0..5000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let mut f = good.clone();
            let cut = (x as usize) % (f.len() + 1);
            f.truncate(cut);
            if let Some(b) = f.get_mut((x >> 20) as usize % good.len()) {
                *b = (x >> 40) as u8;
            }
            let _ = c.primary(&f, i, t0);
            let _ = c.secondary(&f);
        }
        let _ = c.checkpointed();
    }
}
