//! A hostile replication peer against both ends of the handshake, and a
//! hostile (or broken) stream against the backup's frame parser and epoch
//! receiver.
//!
//! Properties checked for every input:
//! - nobody without the key completes a handshake, on either side (an `Ok`
//!   from random bytes would be a forged proof);
//! - no frame whose bytes were changed after sealing is opened;
//! - frames sealed under the session key (a peer that holds the key but
//!   sends garbage inside well-formed frames) never panic the receiver, and
//!   an epoch commits only in order.

use std::io::{Cursor, Read, Write};

use arbitrary::Arbitrary;
use nl_replicate::auth::{backup_challenge, primary_handshake, Key};
use nl_replicate::backup::Receiver;
use nl_replicate::protocol::{Dir, Hello, Kind, PROTOCOL_VERSION};

/// A peer's bytes in, what we answer out.
struct Peer<'a> {
    input: Cursor<&'a [u8]>,
    out: Vec<u8>,
}

impl Read for Peer<'_> {
    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        self.input.read(b)
    }
}

impl Write for Peer<'_> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        // Bounded: a handshake answers a few frames of at most a few KiB.
        if self.out.len() < 1 << 20 {
            self.out.extend_from_slice(b);
        }
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn key() -> Key {
    Key::from_bytes(&[0x5a; 32]).expect("a 32-byte key")
}

/// The fuzzer as a peer that does not hold the key.
pub fn handshake(data: &[u8]) {
    let key = key();
    let mut p = Peer { input: Cursor::new(data), out: Vec::new() };
    assert!(backup_challenge(&mut p, &key).is_err(), "a peer without the key passed the backup");
    let hello = Hello {
        protocol: PROTOCOL_VERSION,
        state_version: 1,
        mem_bytes: 1 << 20,
        vcpus: 1,
        disk_bytes: 0,
        lease_ms: 1000,
    };
    let mut p = Peer { input: Cursor::new(data), out: Vec::new() };
    assert!(primary_handshake(&mut p, &key, &hello).is_err(), "a peer without the key passed the primary");
}

/// One frame a key-holding peer sends.
#[derive(Arbitrary, Debug)]
pub struct FrameSpec {
    kind: u8,
    epoch: u8,
    seq: u8,
    payload: Vec<u8>,
}

#[derive(Arbitrary, Debug)]
pub struct Stream {
    frames: Vec<FrameSpec>,
    /// Flip this byte of the sealed stream (if in range).
    flip: Option<(u32, u8)>,
}

/// Sealed frames (optionally tampered with on the wire) into the backup's
/// opener and receiver.
pub fn stream(data: &[u8]) {
    let Ok(s) = arbitrary::Unstructured::new(data).arbitrary::<Stream>() else { return };
    let session = key().session(&[1; 32], &[2; 32]);
    let mut sealer = session.sealer(Dir::ToBackup);
    let mut wire = Vec::new();
    let mut sent = 0usize;
    for f in &s.frames {
        let Some(kind) = Kind::from_u8(f.kind % 13) else { continue };
        let payload = &f.payload[..f.payload.len().min(64 << 10)];
        sealer
            .write_frame(&mut wire, kind, u64::from(f.epoch % 4), u32::from(f.seq % 8), &[payload])
            .expect("sealing into memory");
        sent += 1;
    }
    let flipped = match s.flip {
        Some((at, x)) if x != 0 && (at as usize) < wire.len() => {
            wire[at as usize] ^= x;
            Some(at as usize)
        }
        _ => None,
    };
    let mut opener = session.opener(Dir::ToBackup);
    // The smallest memory the reference layout takes (sparse: untouched pages cost nothing).
    let mut rx = Receiver::new(64 << 20, 1).expect("backup memory");
    let mut r = Cursor::new(&wire[..]);
    let mut last = None;
    for _ in 0..sent {
        let start = r.position() as usize;
        let Ok(frame) = opener.read_frame(&mut r) else { break };
        if let Some(at) = flipped {
            assert!(at >= r.position() as usize || at < start, "a tampered frame was opened");
        }
        match rx.on_frame(frame) {
            Ok(Some(e)) => {
                assert!(last.is_none_or(|l| e == l + 1), "epoch {e} committed after {last:?}");
                last = Some(e);
            }
            Ok(None) => {}
            Err(_) => rx.discard_staging(),
        }
    }
}
