//! `chanstream`: a message service over every channel of a sandbox, the
//! workload of the sandbox recovery tests and bench (Quest-V's Fig. 10).
//!
//! Each end sends one [`MSG_BYTES`]-byte message on each of its channels
//! every send period and drains its receive side every receive period.
//! A message carries its sequence number and its sender, and the rest of it
//! is derived from both ([`message`]), so the receiver checks every byte.
//! The receiver also follows the sequence: a message that skips ahead is
//! counted as lost messages, one that goes back as a duplicate; a stream
//! that starts over at 0 is a peer restart (the channel's generation
//! changed, see [`crate::channel`]), not a loss.
//!
//! The counters are kept per channel: after each drain, an end publishes
//! what it found wrong in what that channel delivered ([`pack`]) in its own
//! region's header ([`crate::channel::Endpoint::report`]), beside the
//! channel's delivered and rejected counts. The host reads them per channel
//! ([`unpack`]), so bad records a faulty peer sent on one channel are told
//! apart from a healthy pair's own channel.

use crate::channel::{Endpoint, SendError};

/// Bytes of one message.
pub const MSG_BYTES: usize = 64;

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Message `seq` of sender `sender` (a sandbox index).
pub fn message(sender: u64, seq: u64) -> [u8; MSG_BYTES] {
    let mut m = [0u8; MSG_BYTES];
    m[..8].copy_from_slice(&seq.to_le_bytes());
    m[8..16].copy_from_slice(&sender.to_le_bytes());
    let mut h = mix(sender ^ mix(seq));
    for c in m[16..].chunks_exact_mut(8) {
        h = mix(h);
        c.copy_from_slice(&h.to_le_bytes());
    }
    m
}

/// One end's counters on one channel (or summed over several).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub sent: u64,
    pub received: u64,
    /// Messages whose bytes were not what their sender must have sent.
    pub corrupt: u64,
    /// Sequence numbers skipped within a peer's stream.
    pub lost: u64,
    /// Messages that went back in a peer's stream (other than a restart).
    pub duplicate: u64,
    /// Sends refused because the peer had not consumed enough (retried).
    pub full: u64,
    /// Times a peer's stream started over (the peer restarted).
    pub peer_restarts: u64,
}

impl Counters {
    /// Corrupt, lost or duplicated messages: must stay 0 for a healthy pair.
    pub fn errors(&self) -> u64 {
        self.corrupt + self.lost + self.duplicate
    }

    /// Adds `o`'s counts to these.
    pub fn add(&mut self, o: &Counters) {
        self.sent += o.sent;
        self.received += o.received;
        self.corrupt += o.corrupt;
        self.lost += o.lost;
        self.duplicate += o.duplicate;
        self.full += o.full;
        self.peer_restarts += o.peer_restarts;
    }
}

/// Bits of each field of a packed verdict ([`pack`]).
pub const VERDICT_BITS: u32 = 21;
const FIELD_MAX: u64 = (1 << VERDICT_BITS) - 1;

/// What a receiver found wrong in one channel's delivered messages, as
/// one header word: corrupt in bits 0..21, lost in 21..42, duplicate in
/// 42..63, each saturating at 2^21 - 1. 0 = nothing wrong.
pub fn pack(c: &Counters) -> u64 {
    let f = |v: u64| v.min(FIELD_MAX);
    f(c.corrupt) | f(c.lost) << VERDICT_BITS | f(c.duplicate) << (2 * VERDICT_BITS)
}

/// [`pack`]'s fields back: `(corrupt, lost, duplicate)`.
pub fn unpack(v: u64) -> (u64, u64, u64) {
    (v & FIELD_MAX, (v >> VERDICT_BITS) & FIELD_MAX, (v >> (2 * VERDICT_BITS)) & FIELD_MAX)
}

/// The receive state of one channel.
#[derive(Clone, Copy, Debug, Default)]
pub struct Lane {
    /// The sandbox at the other end.
    pub peer: u64,
    /// The next sequence number expected (`None`: take the next as it comes,
    /// after this end (re)started).
    pub expected: Option<u64>,
}

impl Lane {
    pub fn new(peer: u64) -> Self {
        Self { peer, expected: None }
    }

    /// Checks one received message.
    pub fn check(&mut self, msg: &[u8], c: &mut Counters) {
        let seq = match msg.get(..8) {
            Some(b) if msg.len() == MSG_BYTES => {
                let mut s = [0u8; 8];
                s.copy_from_slice(b);
                u64::from_le_bytes(s)
            }
            _ => {
                c.corrupt += 1;
                return;
            }
        };
        if msg != message(self.peer, seq) {
            c.corrupt += 1;
            return;
        }
        match self.expected {
            Some(e) if seq == e => {}
            Some(_) if seq == 0 => c.peer_restarts += 1,
            Some(e) if seq > e => c.lost += seq - e,
            Some(_) => c.duplicate += 1,
            None => {}
        }
        self.expected = Some(seq + 1);
        c.received += 1;
    }
}

/// The host's audit check of a `chanstream` writer's records
/// ([`crate::channel_audit`]): each message is exactly
/// [`message`]`(sender, seq)` for the record's own sequence number (a
/// correct sender numbers its messages as the channel numbers its records,
/// see [`send`]).
pub struct StreamCheck {
    pub sender: u64,
}

impl crate::channel_audit::PayloadCheck for StreamCheck {
    fn start(&mut self, _fresh: bool) {}

    fn check(&mut self, seq: u64, payload: &[u8]) -> Result<(), &'static str> {
        if payload.len() != MSG_BYTES {
            return Err("its message has the wrong length");
        }
        if payload[..8] != seq.to_le_bytes() {
            return Err("its message's number is not the record's");
        }
        if payload != message(self.sender, seq) {
            return Err("its message's bytes are not what its sender must send");
        }
        Ok(())
    }
}

/// Sends this end's next message (`me`: this sandbox's index) on `ep`;
/// a full ring is counted and retried at the next send period.
pub fn send(ep: &mut Endpoint<'_>, me: u64, c: &mut Counters) {
    match ep.send(&message(me, ep.sent())) {
        Ok(()) => c.sent += 1,
        Err(SendError::Full) => c.full += 1,
        // MSG_BYTES fits every region an endpoint accepts.
        Err(SendError::TooLarge) => c.corrupt += 1,
    }
}

/// Receives and checks everything published on `ep` (at most `limit`
/// messages, so one call's work is bounded) into `c`, this channel's
/// counters, and publishes their verdict ([`pack`]) in `ep`'s header.
pub fn drain(ep: &mut Endpoint<'_>, lane: &mut Lane, c: &mut Counters, limit: usize) {
    let mut buf = [0u8; 2 * MSG_BYTES];
    for _ in 0..limit {
        match ep.recv(&mut buf) {
            Some(n) => lane.check(&buf[..n], c),
            None => break,
        }
    }
    ep.report(pack(c));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::channel::{withdraw, Endpoint, HEADER_WORDS};
    use core::sync::atomic::AtomicU64;
    use std::vec::Vec;

    fn region() -> Vec<AtomicU64> {
        (0..HEADER_WORDS + 256).map(|_| AtomicU64::new(0)).collect()
    }

    #[test]
    fn a_stream_survives_a_restart_of_either_end_without_loss_or_corruption() {
        let (a, b) = (region(), region());
        let (mut ca, mut cb) = (Counters::default(), Counters::default());
        let mut x = Endpoint::new(&a, &b, 1).unwrap();
        let mut y = Endpoint::new(&b, &a, 2).unwrap();
        let (mut lx, mut ly) = (Lane::new(1), Lane::new(0));
        for round in 0..600 {
            send(&mut x, 0, &mut ca);
            send(&mut y, 1, &mut cb);
            drain(&mut x, &mut lx, &mut ca, 64);
            drain(&mut y, &mut ly, &mut cb, 64);
            if round == 200 {
                // x restarts (fresh state): withdrawn by the host, rejoins.
                withdraw(&a);
                x = Endpoint::rejoin(&a, &b, 3).unwrap();
                lx = Lane::new(1);
                ca = Counters::default();
            }
            if round == 400 {
                withdraw(&b);
                y = Endpoint::rejoin(&b, &a, 4).unwrap();
                ly = Lane::new(0);
                cb = Counters::default();
            }
        }
        assert_eq!((ca.errors(), cb.errors()), (0, 0), "{ca:?} {cb:?}");
        assert_eq!(cb.peer_restarts, 0, "y restarted after x; counters reset");
        assert_eq!(ca.peer_restarts, 1, "x saw y's new stream");
        assert!(ca.received > 150 && cb.received > 150, "{ca:?} {cb:?}");
    }

    #[test]
    fn corrupt_lost_and_duplicate_messages_are_counted() {
        let mut c = Counters::default();
        let mut l = Lane::new(7);
        l.check(&message(7, 5), &mut c);
        l.check(&message(7, 6), &mut c);
        l.check(&message(7, 9), &mut c);
        l.check(&message(7, 9), &mut c);
        let mut bad = message(7, 10);
        bad[40] ^= 1;
        l.check(&bad, &mut c);
        l.check(&message(8, 10), &mut c);
        l.check(&[0u8; 3], &mut c);
        assert_eq!((c.received, c.lost, c.duplicate, c.corrupt), (4, 2, 1, 3));
        assert_eq!(unpack(pack(&c)), (3, 2, 1));
        assert_eq!(pack(&Counters { received: 9, sent: 9, ..Default::default() }), 0);
        let huge = Counters { lost: u64::MAX, ..Default::default() };
        assert_eq!(unpack(pack(&huge)), (0, (1 << VERDICT_BITS) - 1, 0), "saturates");
    }

    #[test]
    fn the_hosts_stream_check_takes_exactly_the_senders_messages() {
        use crate::channel_audit::PayloadCheck;
        let mut c = StreamCheck { sender: 3 };
        assert_eq!(c.check(5, &message(3, 5)), Ok(()));
        assert!(c.check(5, &message(4, 5)).is_err(), "another sender's bytes");
        assert!(c.check(6, &message(3, 5)).is_err(), "a number other than the record's");
        assert!(c.check(5, &message(3, 5)[..32]).is_err(), "a short message");
        let mut m = message(3, 5);
        m[63] ^= 0x80;
        assert!(c.check(5, &m).is_err(), "one flipped bit");
    }
}
